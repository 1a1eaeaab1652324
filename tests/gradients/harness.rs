//! The finite-difference harness: a one-op graph's parameters, its reduction to a scalar, the
//! backward graph and the comparison, on the CPU and on a GPU where one can be opened.

use std::collections::HashMap;

use mpc_ir::attr::Attr;
use mpc_ir::{DType, Graph, Op, Tensor, ValueId};
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

pub(crate) struct Case {
    pub(crate) g: Graph,
    pub(crate) seed: u64,
    pub(crate) params: Vec<ValueId>,
    /// The finite-difference step.
    pub(crate) h: f64,
    /// Whether the checks run on a GPU too, where one can be opened (not for ops the CUDA device
    /// does not run in f64).
    pub(crate) on_gpu: bool,
}

impl Case {
    pub(crate) fn new(name: &str) -> Case {
        let seed = name.bytes().fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
        Case { g: Graph::new(name), seed, params: Vec::new(), h: 1e-6, on_gpu: true }
    }

    pub(crate) fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                self.seed ^= self.seed << 13;
                self.seed ^= self.seed >> 7;
                self.seed ^= self.seed << 17;
                lo + (hi - lo) * ((self.seed >> 11) as f64 / (1u64 << 53) as f64)
            })
            .collect()
    }

    pub(crate) fn tensor(&mut self, name: &str, shape: &[u64], lo: f64, hi: f64) -> ValueId {
        let n = shape.iter().product::<u64>() as usize;
        let v = self.uniform(n, lo, hi);
        self.g.add_initializer(name, Tensor::from_f64_as(DType::F64, shape.to_vec(), &v))
    }

    /// A trained f64 input with values in [-1, 1).
    pub(crate) fn param(&mut self, name: &str, shape: &[u64]) -> ValueId {
        self.param_in(name, shape, -1.0, 1.0)
    }

    pub(crate) fn param_in(&mut self, name: &str, shape: &[u64], lo: f64, hi: f64) -> ValueId {
        let v = self.tensor(name, shape, lo, hi);
        self.params.push(v);
        v
    }

    /// A trained f64 input holding `values` (where a rule must be right at particular points).
    pub(crate) fn param_of(&mut self, name: &str, shape: &[u64], values: &[f64]) -> ValueId {
        let v = self.g.add_initializer(name, Tensor::from_f64_as(DType::F64, shape.to_vec(), values));
        self.params.push(v);
        v
    }

    pub(crate) fn ints(&mut self, name: &str, shape: &[u64], values: &[i64]) -> ValueId {
        self.g.add_initializer(name, Tensor::from_i64(shape.to_vec(), values))
    }

    pub(crate) fn op(
        &mut self,
        op_type: &str,
        attrs: &[(&str, Attr)],
        inputs: &[Option<ValueId>],
        n_out: usize,
    ) -> Vec<ValueId> {
        let attrs = attrs.iter().map(|(k, a)| (k.to_string(), a.clone())).collect();
        let op = Op::from_attrs(op_type, attrs).expect("known op").expect("valid attributes");
        let name = format!("n{}", self.g.node_count());
        self.g.add_op(&name, op, inputs, n_out).1
    }

    pub(crate) fn op1(&mut self, op_type: &str, attrs: &[(&str, Attr)], inputs: &[ValueId]) -> ValueId {
        let ins: Vec<Option<ValueId>> = inputs.iter().map(|&v| Some(v)).collect();
        self.op(op_type, attrs, &ins, 1)[0]
    }

    /// A standard op that mpc writes out as the ops it is made of (`mpc_passes::COMPOSITE`):
    /// imported as it comes, opaque, and written out when the case is checked.
    pub(crate) fn composite(&mut self, op_type: &str, attrs: &[(&str, Attr)], inputs: &[ValueId]) -> ValueId {
        assert!(mpc_passes::COMPOSITE.contains(&op_type), "{op_type} is not a composite op");
        let attrs = attrs.iter().map(|(k, a)| (k.to_string(), a.clone())).collect();
        let opaque = mpc_ir::ops::Opaque {
            domain: String::new(),
            op_type: op_type.into(),
            attrs,
            explicit_inputs: inputs.len(),
        };
        let ins: Vec<Option<ValueId>> = inputs.iter().map(|&v| Some(v)).collect();
        let name = format!("n{}", self.g.node_count());
        self.g.add_op(&name, Op::Opaque(Box::new(opaque)), &ins, 1).1[0]
    }

    /// Differentiates `Σ y ⊙ R` and compares every parameter's gradient with finite differences;
    /// first, the same graph must differentiate and run in f16 and f32.
    pub(crate) fn check(mut self, y: ValueId, rtol: f64) {
        mpc_passes::infer_types(&mut self.g).unwrap();
        for dtype in [DType::F16, DType::F32] {
            self.runs_in(y, dtype);
        }
        mpc_passes::expand_composites(&mut self.g).unwrap();
        let loss = if self.g.ty(y).shape.as_ref().is_some_and(|s| s.rank() == 0) {
            y
        } else {
            let shape = self.g.ty(y).shape.as_ref().and_then(|s| s.as_fixed()).expect("a fixed output shape");
            let r = self.tensor("projection", &shape, -1.0, 1.0);
            let yd = if self.g.ty(y).dtype == Some(DType::F64) {
                y
            } else {
                self.op1("Cast", &[("to", Attr::Int(DType::F64.onnx_code() as i64))], &[y])
            };
            let p = self.op1("Mul", &[], &[yd, r]);
            self.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[p])
        };
        mpc_passes::infer_types(&mut self.g).unwrap();
        let seed = self.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
        let name = self.g.name.clone();
        let grads = mpc_passes::train::differentiate(&mut self.g, &self.params, loss, seed)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut outs = vec![loss];
        for p in &self.params {
            outs.push(*grads.get(p).unwrap_or_else(|| panic!("{name}: no gradient for `{}`", self.g.name(*p))));
        }
        self.g.set_outputs(outs);
        mpc_passes::infer_types(&mut self.g).unwrap();
        mpc_passes::verify(&self.g).unwrap_or_else(|e| panic!("{name}: {e}"));
        // The parameters are variables of the program: each finite-difference probe writes one.
        let params: std::collections::HashSet<_> = self.params.iter().copied().collect();
        finite_differences(&self, &params, rtol, CpuDevice::default);
        #[cfg(feature = "cuda")]
        if let Some(gpu) = gpu().filter(|_| self.on_gpu) {
            drop(gpu);
            finite_differences(&self, &params, rtol, || mpc_runtime::cuda::device::CudaDevice::new(0).unwrap());
        }
    }
}

/// The first GPU, where one can be used (the gradient checks then run on it too).
#[cfg(feature = "cuda")]
pub(crate) fn gpu() -> Option<mpc_runtime::cuda::device::CudaDevice> {
    mpc_runtime::cuda::device::CudaDevice::new(0).ok()
}

/// The analytic gradients of `case`'s graph (its outputs: the loss, then each parameter's
/// gradient) against central finite differences, computed on `device`.
pub(crate) fn finite_differences<D: Device>(
    case: &Case,
    params: &std::collections::HashSet<ValueId>,
    rtol: f64,
    device: impl Fn() -> D,
) {
    let dev = device();
    let name = format!("{} on {}", case.g.name, dev.caps().name);
    let path = std::path::Path::new(&name);
    let program =
        mpc::run::lower_bound(&case.g, dev.caps(), None, Some(params), path).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut s = Session::new(dev, program).unwrap();
    let none = HashMap::new();
    let out = s.run(&none).unwrap_or_else(|e| panic!("{name}: {e}"));
    let loss_at = |s: &mut Session<D>| s.run(&none).unwrap()[0].1.f64s()[0];
    let h = case.h;
    let mut worst = 0f64;
    for (i, &p) in case.params.iter().enumerate() {
        let analytic = out[i + 1].1.f64s();
        let pname = case.g.name(p).to_string();
        // A gradient that is zero everywhere would pass against any rule that also gives zero.
        assert!(analytic.iter().any(|&d| d != 0.0), "{name}: the gradient of `{pname}` is zero everywhere");
        let base = s.read_state(&pname).unwrap();
        let n = base.len();
        let picks: Vec<usize> = if n <= 16 { (0..n).collect() } else { (0..16).map(|k| k * n / 16 + k % 3).collect() };
        for k in picks {
            let mut v = base.f64s();
            v[k] += h;
            s.write_state(&pname, &HostTensor::from_f64(DType::F64, base.shape.clone(), v.clone())).unwrap();
            let up = loss_at(&mut s);
            v[k] -= 2.0 * h;
            s.write_state(&pname, &HostTensor::from_f64(DType::F64, base.shape.clone(), v)).unwrap();
            let down = loss_at(&mut s);
            s.write_state(&pname, &base).unwrap();
            let numeric = (up - down) / (2.0 * h);
            let err = (analytic[k] - numeric).abs() / (numeric.abs().max(analytic[k].abs()).max(1e-3));
            worst = worst.max(err);
            assert!(
                err <= rtol,
                "{name}: d/d {}[{k}]: autodiff {} vs finite differences {numeric} (rel err {err:.2e})",
                case.g.name(p),
                analytic[k]
            );
        }
    }
    println!("{name}: max relative error {worst:.2e} over {} parameters", case.params.len());
}

impl Case {
    /// Differentiates `Σ y` with every f64 initializer narrowed to `dtype` and runs the backward
    /// graph once: each rule builds it in its values' own dtype, from ops the CPU backend runs.
    pub(crate) fn runs_in(&self, y: ValueId, dtype: DType) {
        let mut g = self.g.clone();
        let name = format!("{} in {dtype}", g.name);
        let wide: Vec<ValueId> =
            g.initializers().filter(|&v| g.constant(v).is_some_and(|t| t.dtype() == DType::F64)).collect();
        for v in wide {
            let t = g.constant(v).unwrap().to_dtype(dtype);
            g.set_initializer(v, t);
        }
        mpc_passes::infer_types(&mut g).unwrap_or_else(|e| panic!("{name}: {e}"));
        mpc_passes::expand_composites(&mut g).unwrap_or_else(|e| panic!("{name}: {e}"));
        let loss = if g.ty(y).shape.as_ref().is_some_and(|s| s.rank() == 0) {
            y
        } else {
            let sum = Op::from_attrs("ReduceSum", vec![("keepdims".into(), Attr::Int(0))]).unwrap().unwrap();
            g.add_op("sum", sum, &[Some(y)], 1).1[0]
        };
        mpc_passes::infer_types(&mut g).unwrap();
        let ldt = g.ty(loss).dtype.unwrap();
        let seed = g.add_initializer("seed", Tensor::from_f64_as(ldt, vec![], &[1.0]));
        let grads = mpc_passes::train::differentiate(&mut g, &self.params, loss, seed)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let outs: Vec<ValueId> = self.params.iter().map(|p| grads[p]).collect();
        g.set_outputs(outs);
        mpc_passes::infer_types(&mut g).unwrap_or_else(|e| panic!("{name}: {e}"));
        mpc_passes::verify(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        runs_on(&g, &self.g, &self.params, dtype, &name, CpuDevice::default());
        #[cfg(feature = "cuda")]
        if let Some(gpu) = gpu().filter(|_| self.on_gpu) {
            runs_on(&g, &self.g, &self.params, dtype, &name, gpu);
        }
    }
}

/// Runs the backward graph `g` once on `device`: every gradient of `dtype` and finite.
pub(crate) fn runs_on<D: Device>(g: &Graph, forward: &Graph, params: &[ValueId], dtype: DType, name: &str, device: D) {
    let name = format!("{name} on {}", device.caps().name);
    let path = std::path::Path::new(&name);
    let program = mpc::run::lower_bound(g, device.caps(), None, None, path).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut s = Session::new(device, program).unwrap();
    for (k, (_, t)) in s.run(&HashMap::new()).unwrap_or_else(|e| panic!("{name}: {e}")).iter().enumerate() {
        let p = forward.name(params[k]);
        assert_eq!(t.dtype(), dtype, "{name}: the gradient of `{p}`");
        assert!(t.f64s().iter().all(|v| v.is_finite()), "{name}: the gradient of `{p}` is not finite");
    }
}

pub(crate) fn ints(v: &[i64]) -> Attr {
    Attr::Ints(v.to_vec())
}

pub(crate) const TOL: f64 = 1e-6;
