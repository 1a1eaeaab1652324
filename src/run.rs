//! `mpc run`: compile with a policy, run on a backend, read and write safetensors.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use mpc_ir::{DType, Dim, Graph, Tensor};
use mpc_runtime::HostTensor;
use safetensors::tensor::{Dtype as StDtype, TensorView};

use crate::{Error, Result};

fn st_dtype(d: DType) -> StDtype {
    match d {
        DType::F32 => StDtype::F32,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::F64 => StDtype::F64,
        DType::I64 => StDtype::I64,
        DType::I32 => StDtype::I32,
        DType::I16 => StDtype::I16,
        DType::I8 => StDtype::I8,
        DType::U64 => StDtype::U64,
        DType::U32 => StDtype::U32,
        DType::U16 => StDtype::U16,
        DType::U8 => StDtype::U8,
        DType::Bool => StDtype::BOOL,
    }
}

fn from_st(d: StDtype) -> Option<DType> {
    Some(match d {
        StDtype::F32 => DType::F32,
        StDtype::F16 => DType::F16,
        StDtype::BF16 => DType::BF16,
        StDtype::F64 => DType::F64,
        StDtype::I64 => DType::I64,
        StDtype::I32 => DType::I32,
        StDtype::I16 => DType::I16,
        StDtype::I8 => DType::I8,
        StDtype::U64 => DType::U64,
        StDtype::U32 => DType::U32,
        StDtype::U16 => DType::U16,
        StDtype::U8 => DType::U8,
        StDtype::BOOL => DType::Bool,
        _ => return None,
    })
}

/// Reads every tensor of a safetensors file.
pub fn read_safetensors(path: &Path) -> Result<HashMap<String, HostTensor>> {
    let usage = |msg: String| Error::Usage(format!("{}: {msg}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| usage(e.to_string()))?;
    let st =
        safetensors::SafeTensors::deserialize(&bytes).map_err(|e| usage(format!("not a safetensors file: {e}")))?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let dtype = from_st(view.dtype())
            .ok_or_else(|| usage(format!("tensor `{name}`: dtype {:?} is not supported", view.dtype())))?;
        let shape = view.shape().iter().map(|&d| d as u64).collect();
        let t = Tensor::from_bytes(dtype, shape, bytes::Bytes::copy_from_slice(view.data()))
            .map_err(|e| usage(format!("tensor `{name}`: {e}")))?;
        out.insert(name, HostTensor::from(&t));
    }
    Ok(out)
}

/// Writes named tensors as a safetensors file (atomically).
pub fn write_safetensors(path: &Path, tensors: &[(String, HostTensor)]) -> Result<()> {
    let owned: Vec<(String, Tensor)> = tensors.iter().map(|(n, t)| (n.clone(), Tensor::from(t))).collect();
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, t)| {
            let shape = t.shape().iter().map(|&d| d as usize).collect();
            let view = TensorView::new(st_dtype(t.dtype()), shape, t.bytes())
                .map_err(|e| Error::Usage(format!("output `{n}`: {e}")));
            view.map(|v| (n.clone(), v))
        })
        .collect::<Result<_>>()?;
    let data = safetensors::serialize(views, None).map_err(|e| Error::Usage(format!("{}: {e}", path.display())))?;
    crate::write_atomic(path, &data)
}

/// Deterministic random inputs for every graph input: floats N(0, 1), integers in [0, 2), bools
/// fair; symbolic dims from `dims` (else 1).
pub fn random_inputs(g: &Graph, seed: u64, dims: &HashMap<String, u64>) -> Result<HashMap<String, HostTensor>> {
    let mut state = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut out = HashMap::new();
    for &v in g.inputs() {
        let name = g.name(v).to_string();
        let ty = g.ty(v);
        let dtype = ty.dtype.ok_or_else(|| Error::Usage(format!("input `{name}` has no known dtype")))?;
        let shape: Vec<usize> = ty
            .shape
            .as_ref()
            .ok_or_else(|| Error::Usage(format!("input `{name}` has no known shape")))?
            .dims()
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => *n as usize,
                Dim::Sym(s) => dims.get(s.as_ref()).copied().unwrap_or(1) as usize,
                Dim::Unknown => 1,
            })
            .collect();
        let n: usize = shape.iter().product();
        let t = if dtype.is_float() {
            // Box-Muller.
            let vals: Vec<f64> = (0..n)
                .map(|_| {
                    let (u, w) = (next().max(1e-12), next());
                    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * w).cos()
                })
                .collect();
            HostTensor::from_f64(dtype, shape, vals)
        } else {
            HostTensor::from_i64(dtype, shape, (0..n).map(|_| (next() * 2.0) as i64).collect())
        };
        out.insert(name, t);
    }
    Ok(out)
}

/// One line per output: name, dtype, shape and a few statistics.
pub fn summary(name: &str, t: &HostTensor) -> String {
    let v = t.f64s();
    let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let mean = finite.iter().sum::<f64>() / finite.len().max(1) as f64;
    let (lo, hi) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let bad = v.len() - finite.len();
    let mut s = format!("{name}: {}{:?} mean {mean:.6} min {lo:.6} max {hi:.6}", t.dtype(), t.shape);
    if bad > 0 {
        s.push_str(&format!(" ({bad} NaN/Inf)"));
    }
    s
}

/// The memory plan of `g` with its symbolic dims bound.
pub fn memory_plan(
    g: &Graph,
    model: &Path,
    dims: &HashMap<String, u64>,
) -> Result<(mpc_runtime::Plan, BTreeMap<String, u64>)> {
    let (bound, used) =
        crate::summary::bind_inputs(g, dims).map_err(|source| Error::Pass { path: model.to_owned(), source })?;
    let plan = mpc_runtime::plan(&bound).map_err(|e| Error::Run { path: model.to_owned(), source: e })?;
    Ok((plan, used))
}
