//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod onnx;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const FIXTURES: [&str; 8] =
    ["mlp", "mlp_loss", "cnn_bn", "resblock", "transformer", "opset9", "custom_op", "control_flow"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models").join(format!("{name}.onnx"))
}

/// The fixture `name` compiled under `policy`: the inference graph, or with `train` the training
/// step (the batch freed from the export; the loss on the first output, or the model's own `loss`
/// output where it has one).
pub fn compiled(name: &str, policy: &str, train: bool) -> Result<mpc_ir::Graph, mpc::Error> {
    use mpc_passes::train::{Loss, TrainOptions};
    let path = fixture(name);
    let mut g = mpc::load(&path)?;
    if train {
        mpc::train::free_batch(&mut g);
    }
    let loss =
        if name.ends_with("_loss") { Loss::Output("loss".into()) } else { Loss::CrossEntropy(Default::default()) };
    let t = train.then(|| TrainOptions { loss, ..TrainOptions::default() });
    let opts = mpc::Options { policy: Some(policy.into()), train: t, ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {})?;
    Ok(g)
}

/// A fresh scratch folder for one test.
pub fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn mpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mpc")).args(args).output().expect("run mpc")
}

pub fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s.set_omit_expression(true);
    s
}

/// Instantiates each `name => generic test function` once per device, the function receiving a
/// factory of fresh devices: the CPU, and the first GPU, whose tests skip with one line where
/// none can be used (no driver, no GPU, no NVRTC) and so hold the GPU to the CPU's results
/// wherever there is one.
#[allow(unused_macros)]
macro_rules! per_device {
    ($($name:ident => $f:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() {
                    super::$f(mpc_runtime::device::CpuDevice::default)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(
                #[test]
                fn $name() {
                    if let Err(e) = mpc_runtime::cuda::device::CudaDevice::new(0) {
                        eprintln!("skipped on cuda: {e}");
                        return;
                    }
                    super::$f(|| mpc_runtime::cuda::device::CudaDevice::new(0).expect("the GPU opened a moment ago"))
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_device;

/// y = x·W against targets x·W*, W all `w0` and W* all `target_w`, the data written to `dir`.
/// With `loss_factor` the model computes its own loss, `factor · mean((y − t)²)`, as output `loss`.
pub fn regression(dir: &Path, w0: f32, target_w: f32, n: usize, loss_factor: Option<f32>) -> (PathBuf, PathBuf) {
    let mut g = mpc_ir::Graph::new("regression");
    let batch = mpc_ir::Shape(vec![mpc_ir::Dim::sym("batch"), mpc_ir::Dim::Fixed(16)]);
    let x = g.add_input("x", mpc_ir::TypeInfo::new(mpc_ir::DType::F32, batch.clone()));
    let w = g.add_initializer("w", mpc_ir::Tensor::from_f32(vec![16, 16], &vec![w0; 256]));
    let (_, y) = g.add_op("matmul", mpc_ir::Op::MatMul, &[Some(x), Some(w)], 1);
    match loss_factor {
        None => g.add_output(y[0]),
        Some(c) => {
            let t = g.add_input("targets", mpc_ir::TypeInfo::new(mpc_ir::DType::F32, batch));
            let k = g.add_initializer("factor", mpc_ir::Tensor::from_f32(vec![], &[c]));
            let (_, d) = g.add_op("sub", mpc_ir::Op::Sub, &[Some(y[0]), Some(t)], 1);
            let (_, sq) = g.add_op("square", mpc_ir::Op::Mul, &[Some(d[0]), Some(d[0])], 1);
            let attrs = mpc_ir::ops::ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
            let (_, m) = g.add_op("mean", mpc_ir::Op::ReduceMean(attrs), &[Some(sq[0])], 1);
            let (_, l) = g.add_op("loss", mpc_ir::Op::Mul, &[Some(m[0]), Some(k)], 1);
            g.add_output(l[0]);
        }
    }
    let model = dir.join("regression.onnx");
    mpc::save(&g, &model, mpc::Format::Onnx).unwrap();
    let mut seed = 12345u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let xs: Vec<f64> = (0..n * 16).map(|_| next() * 2.0 - 1.0).collect();
    let ts: Vec<f64> = (0..n)
        .flat_map(|r| {
            let s: f64 = xs[r * 16..(r + 1) * 16].iter().sum::<f64>() * target_w as f64;
            vec![s; 16]
        })
        .collect();
    let data = dir.join("data.safetensors");
    mpc::run::write_safetensors(
        &data,
        &[
            ("x".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![n, 16], xs)),
            ("targets".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![n, 16], ts)),
        ],
    )
    .unwrap();
    (model, data)
}

/// One tensor of an ONNX conformance case (`input_0.pb`, `output_0.pb`, ...).
pub fn read_pb(p: &Path) -> Result<mpc_runtime::value::HostTensor, String> {
    let bytes = std::fs::read(p).map_err(|e| e.to_string())?;
    let t = mpc_ir::onnx::decode_tensor(bytes.into()).map_err(|e| e.to_string())?;
    Ok(mpc_runtime::value::HostTensor::from(&t))
}

/// The files `<prefix><n>.pb` of `dir`, by n.
pub fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let n = name.strip_prefix(prefix)?.strip_suffix(".pb")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// An ONNX conformance case whose model mpc imports and compiles (default options) and whose
/// first input set decodes.
pub struct ConformanceCase {
    pub name: String,
    pub model: PathBuf,
    pub graph: mpc_ir::Graph,
    /// The first input set, by the graph's input names.
    pub feeds: std::collections::HashMap<String, mpc_runtime::value::HostTensor>,
}

/// The cases of `MPC_ONNX_NODE_TESTS` that [`ConformanceCase`] describes, by name; `None`, with a
/// line saying so, when the variable is not set.
pub fn conformance_cases() -> Option<Vec<ConformanceCase>> {
    let Some(root) = std::env::var_os("MPC_ONNX_NODE_TESTS") else {
        eprintln!("skipped: set MPC_ONNX_NODE_TESTS to the onnx-node-tests folder to run the conformance cases");
        return None;
    };
    let mut dirs: Vec<PathBuf> =
        std::fs::read_dir(&root).expect("read MPC_ONNX_NODE_TESTS").flatten().map(|e| e.path()).collect();
    dirs.sort();
    let mut out = Vec::new();
    for case in dirs.iter().filter(|c| c.join("model.onnx").is_file()) {
        let model = case.join("model.onnx");
        let Ok(mut graph) = mpc::load(&model) else { continue };
        if mpc::compile(&mut graph, &model, &mpc::Options::default(), &mut |_, _| {}).is_err() {
            continue;
        }
        let Some(set) = std::fs::read_dir(case).into_iter().flatten().flatten().map(|e| e.path()).find(|p| p.is_dir())
        else {
            continue;
        };
        let Ok(ins) = numbered(&set, "input_").iter().map(|p| read_pb(p)).collect::<Result<Vec<_>, _>>() else {
            continue;
        };
        let feeds = graph.inputs().iter().zip(ins).map(|(&v, t)| (graph.name(v).to_string(), t)).collect();
        let name = case.file_name().unwrap_or_default().to_string_lossy().to_string();
        out.push(ConformanceCase { name, model, graph, feeds });
    }
    Some(out)
}
