//! `mpc._mpc`: the library's [`mpc::trainer::Trainer`] for Python. It holds no training logic of
//! its own: tensors cross as `(dtype, shape, bytes)` (the package's Python layer turns numpy
//! arrays and torch tensors into those and back), options as the `[train]` table's JSON, errors
//! as `mpc.Error` exceptions carrying mpc's one-line messages.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use mpc::trainer::{StepHandle, StepNumbers, Trainer as Inner};
use mpc_ir::DType;
use mpc_runtime::device::{CpuDevice, Device, DeviceOptions};
use mpc_runtime::HostTensor;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

create_exception!(_mpc, Error, PyException, "An mpc failure: its message is mpc's one line.");
create_exception!(_mpc, InputError, Error, "Bad input: a model, data or option mpc refuses (the CLI's exit 2).");
create_exception!(_mpc, ModelError, InputError, "A model mpc cannot compile or differentiate.");
create_exception!(_mpc, InternalError, Error, "An invariant of mpc failed (the CLI's exit 1): a bug to report.");

fn raise(e: mpc::Error) -> PyErr {
    let text = e.to_string();
    match e {
        _ if e.exit_code() == 1 => InternalError::new_err(text),
        mpc::Error::Pass { .. } | mpc::Error::Input { .. } => ModelError::new_err(text),
        _ => InputError::new_err(text),
    }
}

/// The dtype numpy names `name`.
fn dtype_of(name: &str) -> PyResult<DType> {
    DType::ALL
        .into_iter()
        .find(|&d| numpy_name(d) == name)
        .ok_or_else(|| InputError::new_err(format!("dtype {name} is not one mpc runs")))
}

/// numpy's name of a dtype.
fn numpy_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U64 => "uint64",
        DType::U32 => "uint32",
        DType::U16 => "uint16",
        DType::U8 => "uint8",
        DType::Bool => "bool",
    }
}

/// A batch from Python: `{name: (dtype, shape, bytes)}`.
fn batch_of(d: &Bound<'_, PyDict>) -> PyResult<HashMap<String, HostTensor>> {
    let mut out = HashMap::new();
    for (k, v) in d.iter() {
        let name: String = k.extract()?;
        let (dtype, shape, data): Wire<'_> = v.extract()?;
        let dtype = dtype_of(&dtype)?;
        let bytes = data.as_bytes();
        let want = shape.iter().product::<usize>() * dtype.size();
        if bytes.len() != want {
            return Err(InputError::new_err(format!("`{name}`: {} bytes for shape {shape:?} of {dtype}", bytes.len())));
        }
        out.insert(name, HostTensor::from_le_bytes(dtype, shape, bytes));
    }
    Ok(out)
}

/// A tensor as Python sees it: `(dtype, shape, bytes)`.
type Wire<'py> = (String, Vec<usize>, Bound<'py, PyBytes>);

/// A tensor for Python.
fn wire<'py>(py: Python<'py>, t: &HostTensor) -> Wire<'py> {
    let mut bytes = vec![0u8; t.len() * t.dtype().size()];
    t.write_le_bytes(&mut bytes);
    (numpy_name(t.dtype()).to_string(), t.shape.clone(), PyBytes::new(py, &bytes))
}

/// The trainer on one of the devices.
enum AnyTrainer {
    Cpu(Box<Inner<CpuDevice>>),
    #[cfg(feature = "cuda")]
    Cuda(Box<Inner<mpc_runtime::cuda::device::CudaDevice>>),
}

/// A step's staged numbers on the device its trainer runs on.
enum AnyHandle {
    Cpu(StepHandle<<CpuDevice as Device>::Staged>),
    #[cfg(feature = "cuda")]
    Cuda(StepHandle<<mpc_runtime::cuda::device::CudaDevice as Device>::Staged>),
}

/// Runs `$body` with `$t` bound to the inner trainer, whatever its device.
macro_rules! on {
    ($any:expr, $t:ident => $body:expr) => {
        match $any {
            AnyTrainer::Cpu($t) => $body,
            #[cfg(feature = "cuda")]
            AnyTrainer::Cuda($t) => $body,
        }
    };
}

/// The library's trainer: `Trainer(model, first_batch, policy, settings_json, device)`.
#[pyclass(unsendable, module = "mpc._mpc")]
struct Trainer {
    inner: AnyTrainer,
    model: mpc_ir::Graph,
    path: PathBuf,
}

#[pymethods]
impl Trainer {
    /// Compiles the ONNX (or text IR) model at `model` under `policy` with the `[train]`
    /// settings in `settings` (JSON) and loads the step for `first` on `device` (cpu or cuda).
    #[new]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        first: &Bound<'_, PyDict>,
        policy: &str,
        settings: &str,
        device: &str,
    ) -> PyResult<Self> {
        let file: mpc::config::TrainFile =
            serde_json::from_str(settings).map_err(|e| InputError::new_err(format!("training options: {e}")))?;
        let (t, scale) = file.resolve().map_err(|e| InputError::new_err(format!("training options: {e}")))?;
        let opts =
            mpc::Options { policy: Some(policy.into()), train: Some(t), loss_scale: scale, ..Default::default() };
        let first = batch_of(first)?;
        let graph = mpc::load(&model).map_err(raise)?;
        let open = || -> mpc::Result<AnyTrainer> {
            Ok(match device {
                // Other Python threads run while the step compiles.
                "cpu" => AnyTrainer::Cpu(Box::new(
                    py.detach(|| Inner::new(CpuDevice::default(), &graph, &model, &opts, &first))?,
                )),
                #[cfg(feature = "cuda")]
                "cuda" => {
                    let dev = mpc_runtime::cuda::device::CudaDevice::with_options(0, DeviceOptions::default())
                        .map_err(|e| mpc::Error::Usage(format!("device cuda: {e}")))?;
                    AnyTrainer::Cuda(Box::new(Inner::new(dev, &graph, &model, &opts, &first)?))
                }
                d => return Err(mpc::Error::Usage(format!("device `{d}`: expected cpu or cuda"))),
            })
        };
        Ok(Trainer { inner: open().map_err(raise)?, model: graph, path: model })
    }

    /// Runs one step on `batch`; returns at once, the numbers staged.
    fn step(slf: Bound<'_, Self>, batch: &Bound<'_, PyDict>) -> PyResult<Step> {
        let batch = batch_of(batch)?;
        let py = slf.py();
        let handle = {
            let mut t = slf.borrow_mut();
            match &mut t.inner {
                // Other Python threads run while the CPU computes the step.
                AnyTrainer::Cpu(t) => AnyHandle::Cpu(py.detach(|| t.step(&batch)).map_err(raise)?),
                #[cfg(feature = "cuda")]
                AnyTrainer::Cuda(t) => AnyHandle::Cuda(t.step(&batch).map_err(raise)?),
            }
        };
        Ok(Step { trainer: slf.unbind(), handle: Some(handle), numbers: None })
    }

    /// The mean loss and the accuracy counts of `batch`: `(loss or None, correct, counted)`.
    fn evaluate(&mut self, py: Python<'_>, batch: &Bound<'_, PyDict>) -> PyResult<(Option<f64>, usize, usize)> {
        let batch = batch_of(batch)?;
        let e = match &mut self.inner {
            AnyTrainer::Cpu(t) => py.detach(|| t.evaluate(&batch)),
            #[cfg(feature = "cuda")]
            AnyTrainer::Cuda(t) => t.evaluate(&batch),
        }
        .map_err(raise)?;
        Ok((e.loss, e.correct, e.counted))
    }

    /// The learning rate of the next steps (under a schedule, its peak).
    #[getter]
    fn get_lr(&mut self) -> PyResult<f32> {
        on!(&mut self.inner, t => t.lr()).map_err(raise)
    }

    #[setter]
    fn set_lr(&mut self, lr: f32) -> PyResult<()> {
        if !(lr >= 0.0 && lr.is_finite()) {
            return Err(InputError::new_err(format!("lr {lr}: expected a number >= 0")));
        }
        on!(&mut self.inner, t => t.set_lr(lr)).map_err(raise)
    }

    /// The loss scale now (None without loss scaling).
    #[getter]
    fn loss_scale(&mut self) -> PyResult<Option<f64>> {
        on!(&mut self.inner, t => t.loss_scale()).map_err(raise)
    }

    /// Every state tensor by name: `{name: (dtype, shape, bytes)}`.
    fn state<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<(String, Wire<'py>)>> {
        let state = on!(&mut self.inner, t => t.state()).map_err(raise)?;
        Ok(state.iter().map(|(n, t)| (n.clone(), wire(py, t))).collect())
    }

    /// Writes a state (every state tensor by name), checked as a checkpoint is.
    fn load_state(&mut self, state: &Bound<'_, PyDict>) -> PyResult<()> {
        let saved = batch_of(state)?;
        let origin = Path::new("state");
        on!(&mut self.inner, t => t.load_state(&saved, origin)).map_err(raise)
    }

    /// Writes the checkpoint `mpc train --checkpoint` writes, with `iteration` batches done.
    fn save(&mut self, file: PathBuf, iteration: usize) -> PyResult<()> {
        on!(&mut self.inner, t => t.save(&file, iteration)).map_err(raise)
    }

    /// Loads such a checkpoint; returns its batches done.
    fn load(&mut self, file: PathBuf) -> PyResult<usize> {
        on!(&mut self.inner, t => t.load(&file)).map_err(raise)
    }

    /// Writes the model with the trained weights as ONNX.
    fn export(&mut self, file: PathBuf) -> PyResult<()> {
        let g = on!(&mut self.inner, t => t.export(&self.model)).map_err(raise)?;
        mpc::save(&g, &file, mpc::Format::Onnx).map_err(raise)
    }

    /// The names of the step's inputs (the model's and the labels).
    fn inputs(&self) -> Vec<String> {
        let g = on!(&self.inner, t => t.graph());
        g.inputs().iter().map(|&v| g.name(v).to_string()).collect()
    }

    /// What the step costs: its launches, arena, state and constants.
    fn stats(&self) -> PyResult<String> {
        on!(&self.inner, t => t.stats()).map_err(raise)
    }

    fn __repr__(&self) -> String {
        let device = match &self.inner {
            AnyTrainer::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            AnyTrainer::Cuda(_) => "cuda",
        };
        format!("mpc.Trainer({}, device={device})", self.path.display())
    }
}

/// A step's numbers: read when first asked for (the device is waited for then).
#[pyclass(unsendable, module = "mpc._mpc")]
struct Step {
    trainer: Py<Trainer>,
    handle: Option<AnyHandle>,
    numbers: Option<StepNumbers>,
}

impl Step {
    fn numbers(&mut self, py: Python<'_>) -> PyResult<StepNumbers> {
        if let Some(n) = self.numbers {
            return Ok(n);
        }
        let mut t = self.trainer.borrow_mut(py);
        let n = match (&mut t.inner, self.handle.take()) {
            (AnyTrainer::Cpu(t), Some(AnyHandle::Cpu(h))) => t.wait(h),
            #[cfg(feature = "cuda")]
            (AnyTrainer::Cuda(t), Some(AnyHandle::Cuda(h))) => t.wait(h),
            _ => return Err(InternalError::new_err("a step's numbers were read twice")),
        }
        .map_err(raise)?;
        self.numbers = Some(n);
        Ok(n)
    }
}

#[pymethods]
impl Step {
    /// The batch's loss.
    #[getter]
    fn loss(&mut self, py: Python<'_>) -> PyResult<f32> {
        Ok(self.numbers(py)?.loss)
    }

    /// Whether the update was skipped (a non-finite gradient under loss scaling).
    #[getter]
    fn skipped(&mut self, py: Python<'_>) -> PyResult<bool> {
        Ok(self.numbers(py)?.skipped)
    }

    /// The learning rate the step applied.
    #[getter]
    fn lr(&mut self, py: Python<'_>) -> PyResult<f32> {
        Ok(self.numbers(py)?.lr)
    }

    /// The loss scale after the step (None without scaling).
    #[getter]
    fn loss_scale(&mut self, py: Python<'_>) -> PyResult<Option<f64>> {
        Ok(self.numbers(py)?.loss_scale)
    }
}

/// The CPU and the GPUs mpc can use, one line each, and why no GPU can be used, if none can.
#[pyfunction]
fn devices() -> (Vec<String>, Option<String>) {
    mpc::devices::report(&DeviceOptions::default())
}

#[pymodule]
fn _mpc(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Trainer>()?;
    m.add_class::<Step>()?;
    m.add_function(wrap_pyfunction!(devices, m)?)?;
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
