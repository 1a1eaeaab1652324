//! `mpc run`: compile with a policy, run on a backend, read and write safetensors.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use mpc_ir::{DType, Graph, Tensor};
use mpc_runtime::build::{self, BuildError};
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

pub(crate) fn from_st(d: StDtype) -> Option<DType> {
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
/// fair; symbolic dims from `dims` (else 1) ([`build::random_inputs`]).
pub fn random_inputs(g: &Graph, seed: u64, dims: &HashMap<String, u64>) -> Result<HashMap<String, HostTensor>> {
    build::random_inputs(g, seed, dims).map_err(unplaced)
}

/// [`random_inputs`], each input at most `limit` bytes (a device's memory limit, `--max-memory`).
pub fn random_inputs_within(
    g: &Graph,
    seed: u64,
    dims: &HashMap<String, u64>,
    limit: u64,
) -> Result<HashMap<String, HostTensor>> {
    build::random_inputs_within(g, seed, dims, limit).map_err(unplaced)
}

/// One line per output: name, dtype, shape and a few statistics.
pub fn summary(name: &str, t: &HostTensor) -> String {
    let v = t.f64s();
    let finite: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    let mean = finite.iter().sum::<f64>() / finite.len().max(1) as f64;
    let (lo, hi) = finite.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &x| (a.min(x), b.max(x)));
    let bad = v.len() - finite.len();
    if finite.is_empty() {
        // No finite element (or none at all): no statistics to give.
        let what = if v.is_empty() { "empty".to_string() } else { format!("{bad} NaN/Inf, no finite element") };
        return format!("{name}: {}{:?} {what}", t.dtype(), t.shape);
    }
    let mut s = format!("{name}: {}{:?} mean {mean:.6} min {lo:.6} max {hi:.6}", t.dtype(), t.shape);
    if bad > 0 {
        s.push_str(&format!(" ({bad} NaN/Inf)"));
    }
    s
}

/// The program of `g` for the CPU device with its symbolic dims bound (`inspect --memory`): its
/// arena is the peak activation memory, its state and constants the weights.
pub fn memory_plan(
    g: &Graph,
    model: &Path,
    dims: &HashMap<String, u64>,
) -> Result<(mpc_runtime::program::Program, BTreeMap<String, u64>)> {
    use mpc_runtime::device::Device;
    memory_plan_for(g, model, dims, mpc_runtime::device::CpuDevice::default().caps())
}

/// [`memory_plan`] for a device of `caps` (its memory limit, whether it fuses).
pub fn memory_plan_for(
    g: &Graph,
    model: &Path,
    dims: &HashMap<String, u64>,
    caps: mpc_runtime::program::DeviceCaps,
) -> Result<(mpc_runtime::program::Program, BTreeMap<String, u64>)> {
    let state: std::collections::HashSet<mpc_ir::ValueId> =
        g.train.iter().flat_map(|t| t.state.iter().map(|&(s, _)| s)).collect();
    let (bound, used) = fold_and_infer(g.clone(), dims, &state, caps, model)?;
    let program = lower_bound(&bound, caps, None, None, model)?;
    Ok((program, used))
}

/// `inspect --memory`: the plan's bytes, then what is alive at the arena's peak, largest first
/// (the values that hold the most, and the bytes of each dtype).
pub fn memory_report(p: &mpc_runtime::program::Program, used: &BTreeMap<String, u64>) -> String {
    use std::fmt::Write;
    let at: Vec<String> = used.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let weights = p.state_layout.bytes + p.constants_bytes;
    let mut out = format!(
        "memory plan at {}: weights {weights} bytes (state {}, constants {}), peak activations {} bytes \
         (the arena: {} launches, {} views, {} nodes folded, {} element-wise launches fused into {}, {} epilogues{}{}{}), \
         total {} bytes\n",
        if at.is_empty() { "the model's shapes".to_string() } else { at.join(", ") },
        p.state_layout.bytes,
        p.constants_bytes,
        p.arena_bytes,
        p.launches.len(),
        p.views,
        p.folded,
        p.fused.0,
        p.fused.1,
        p.epilogues,
        match p.prologues {
            0 => String::new(),
            n => format!(", {n} ReLU gradients read by their batch norm's gradient"),
        },
        match p.siblings {
            0 => String::new(),
            n => format!(", {n} bias gradients in their weight gradient's launch"),
        },
        match p.grouped {
            (0, _) => String::new(),
            (n, 1) => format!(", {n} optimizer updates in one launch"),
            (n, g) => format!(", {n} optimizer updates in {g} launches"),
        },
        weights + p.arena_bytes
    );
    out += &cuda_scratch_report(p);
    let peak = p.peak_live();
    if peak.values.is_empty() {
        return out + &traffic_report(&p.traffic());
    }
    let size = crate::summary::bytes;
    let node = p.launches.get(peak.step).map_or("-".to_string(), |l| l.node.clone());
    let _ = writeln!(
        out,
        "alive at the peak, during launch {} of {} ({node}): {} in {} buffers",
        peak.step,
        p.launches.len(),
        size(peak.bytes),
        peak.values.len()
    );
    let mut by_dtype: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    for (_, d, _, b) in &peak.values {
        let e = by_dtype.entry(d.to_string()).or_default();
        e.0 += b;
        e.1 += 1;
    }
    let dtypes: Vec<String> = by_dtype.iter().map(|(d, (b, n))| format!("{d} {} ({n})", size(*b))).collect();
    let _ = writeln!(out, "  by dtype: {}", dtypes.join(", "));
    const SHOWN: usize = 12;
    for (name, d, shape, b) in peak.values.iter().take(SHOWN) {
        let dims: Vec<String> = shape.iter().map(|x| x.to_string()).collect();
        let _ = writeln!(out, "  {:>11}  {d}[{}]  {name}", size(*b), dims.join(", "));
    }
    if peak.values.len() > SHOWN {
        let rest: u64 = peak.values[SHOWN..].iter().map(|v| v.3).sum();
        let _ = writeln!(out, "  {:>11}  in {} more", size(rest), peak.values.len() - SHOWN);
    }
    out + &traffic_report(&p.traffic())
}

/// The scratch the CUDA device allocates beside the regions for `p`: the largest launch's
/// workspace (the split reductions' partials, sorted keys, transposed copies), where cuDNN takes
/// every convolution (its algorithms' own scratch, chosen on the device, comes on top) and where
/// none (the fallbacks' columns).
#[cfg(feature = "cuda")]
fn cuda_scratch_report(p: &mpc_runtime::program::Program) -> String {
    use mpc_runtime::cuda::plan::plan;
    let constant = |t: &mpc_runtime::program::TensorRef| p.constant(t);
    let (mut with, mut without) = (0, 0);
    // The arena bytes free during each top-level convolution: where cuDNN's scratch goes.
    let mut free = Vec::new();
    let mut launches: Vec<(Option<usize>, &mpc_runtime::program::Launch)> =
        p.launches.iter().enumerate().map(|(i, l)| (Some(i), l)).collect();
    while let Some((step, l)) = launches.pop() {
        if let Some(b) = &l.branches {
            launches.extend(b.then_launches.iter().chain(&b.else_launches).map(|l| (None, l)));
            continue;
        }
        // A launch the CUDA device cannot plan is named when a program is prepared there.
        let Ok(lp) = plan(l, &constant) else { continue };
        with = u64::max(with, lp.workspace);
        without = u64::max(without, lp.workspace_with_fallbacks());
        if lp.calls.iter().any(|c| matches!(c, mpc_runtime::cuda::plan::Call::Conv(_))) {
            free.push(step.map_or(0, |i| p.free_during(i).1));
        }
    }
    free.sort_unstable();
    let convs = match free.len() {
        0 => String::new(),
        n => format!(
            "; the arena bytes free during its {n} convolutions for cuDNN (their algorithms' scratch goes there \
             where it fits): least {}, median {}",
            free[0],
            free[n / 2]
        ),
    };
    format!(
        "CUDA scratch: {with} bytes with every convolution through cuDNN (its algorithms' scratch aside), \
         {without} bytes without cuDNN; cuBLAS's workspace {} bytes{convs}\n",
        mpc_runtime::cuda::device::CUBLAS_WORKSPACE
    )
}

#[cfg(not(feature = "cuda"))]
fn cuda_scratch_report(_: &mpc_runtime::program::Program) -> String {
    String::new()
}

/// What a step's launches move and compute at the least ([`mpc_runtime::cost::Traffic`]): the
/// totals, then the kinds of launch that move the most.
fn traffic_report(t: &mpc_runtime::cost::Traffic) -> String {
    use std::fmt::Write;
    let size = crate::summary::bytes;
    let flop = |f: u64| match f as f64 {
        f if f >= 1e12 => format!("{:.3} T", f / 1e12),
        f if f >= 1e9 => format!("{:.2} G", f / 1e9),
        f if f >= 1e6 => format!("{:.2} M", f / 1e6),
        f => format!("{f} "),
    };
    let products: Vec<String> = t.flops.iter().map(|(d, f)| format!("{d} {}FLOP", flop(*f))).collect();
    let mut out = format!(
        "traffic of a step (each tensor a launch reads or writes, once): {} read, {} written, {} in all ({} \
         bytes), by {} launches; matrix products: {}\n",
        size(t.read),
        size(t.written),
        size(t.bytes()),
        t.bytes(),
        t.launches,
        if products.is_empty() { "none".to_string() } else { products.join(", ") }
    );
    const SHOWN: usize = 16;
    let _ = writeln!(out, "  {:>8}  {:>11}  {:>11}  kind (most bytes first)", "launches", "bytes", "FLOP");
    for k in t.kinds.iter().take(SHOWN) {
        let flops = if k.flops > 0 { flop(k.flops) } else { "-".into() };
        let _ = writeln!(out, "  {:>8}  {:>11}  {:>11}  {}", k.launches, size(k.bytes()), flops, k.kind);
    }
    if t.kinds.len() > SHOWN {
        let rest = &t.kinds[SHOWN..];
        let bytes: u64 = rest.iter().map(|k| k.bytes()).sum();
        let launches: usize = rest.iter().map(|k| k.launches).sum();
        let _ = writeln!(out, "  {launches:>8}  {:>11}  {:>11}  in {} more kinds", size(bytes), "", rest.len());
    }
    out
}

/// `inspect --memory --launches`: every launch in step order, with what it moves at the least
/// ([`mpc_runtime::cost::launch_cost`]), its FLOPs and its outputs.
pub fn launch_list(p: &mpc_runtime::program::Program) -> String {
    use std::fmt::Write;
    let size = crate::summary::bytes;
    let mut out = format!("launches of a step, in order ({}):\n", p.launches.len());
    let _ = writeln!(out, "  {:>5}  {:>11}  {:>9}  kind, node: outputs", "#", "bytes", "GFLOP");
    for (i, l) in p.launches.iter().enumerate() {
        let c = mpc_runtime::cost::launch_cost(l);
        let flops = if c.flops > 0 { format!("{:.2}", c.flops as f64 / 1e9) } else { "-".into() };
        let outputs: Vec<String> = l
            .parts()
            .iter()
            .flat_map(|m| &m.outputs)
            .take(4)
            .map(|t| {
                let dims: Vec<String> = t.shape.iter().map(|x| x.to_string()).collect();
                format!("{}[{}]", t.dtype, dims.join(", "))
            })
            .collect();
        let more = l.parts().iter().map(|m| m.outputs.len()).sum::<usize>().saturating_sub(outputs.len());
        let more = if more > 0 { format!(" and {more} more") } else { String::new() };
        let _ = writeln!(
            out,
            "  {i:>5}  {:>11}  {flops:>9}  {}, {}: {}{more}",
            size(c.bytes()),
            l.kind(),
            l.node,
            outputs.join(", ")
        );
    }
    out
}

/// `--stats`: what a lowered program costs on its device.
pub fn stats_line(p: &mpc_runtime::program::Program, s: &mpc_runtime::session::StepStats) -> String {
    // The counts of the program that ran; the bytes of every program the session holds.
    format!(
        "arena {} B, state {} B, constants {} B, {} launches per step ({} nodes folded when lowering, \
         {} views), {} allocations inside steps after the first, {} host reads per step, {} steps",
        s.arena_bytes,
        s.state_bytes,
        s.constants_bytes,
        s.launches_per_step,
        p.folded,
        p.views,
        s.allocations_in_steps,
        s.host_reads_per_step,
        s.steps
    )
}

/// A build step's error for the model at `model`: a pass's and the runtime's name the file, the
/// data's one line follows it.
fn at(model: &Path) -> impl Fn(BuildError) -> Error + '_ {
    move |e| match e {
        BuildError::Pass(source) => Error::Pass { path: model.to_owned(), source },
        BuildError::Run(source) => Error::Run { path: model.to_owned(), source },
        BuildError::Data(m) => Error::Usage(format!("{}: {m}", model.display())),
    }
}

/// A build step's error where the caller names the file.
fn unplaced(e: BuildError) -> Error {
    match e {
        BuildError::Data(m) => Error::Usage(m),
        e => at(Path::new(""))(e),
    }
}

pub use build::batch_symbols;

/// [`build::bind_sample_dims`]; messages name `model`.
pub fn bind_sample_dims(g: &Graph, dims: HashMap<String, u64>, model: &Path) -> Result<Graph> {
    build::bind_sample_dims(g, dims).map_err(at(model))
}

/// [`build::input_dims`]: the sizes the fed tensors give the graph's symbolic dims, checked (one
/// line naming `model`, the input and the axis).
pub fn input_dims(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<HashMap<String, u64>> {
    build::input_dims(g, inputs).map_err(at(model))
}

/// [`build::input_sizes`]; messages name `model`.
pub fn input_sizes(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<HashMap<String, u64>> {
    build::input_sizes(g, inputs).map_err(at(model))
}

/// [`build::lower_for_inputs`]; messages name `model`.
pub fn lower_for_inputs(
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
    caps: mpc_runtime::program::DeviceCaps,
    model: &Path,
) -> Result<mpc_runtime::program::Program> {
    build::lower_for_inputs(g, inputs, caps).map_err(at(model))
}

/// Lowers `g` for `inputs` and runs it once on the CPU device; the outputs by name, in order.
pub fn run_once(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<Vec<(String, HostTensor)>> {
    build::run_once(g, inputs).map_err(at(model))
}

/// [`run_once`] on `device`.
pub fn run_once_on<D: mpc_runtime::device::Device>(
    device: D,
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
    model: &Path,
) -> Result<Vec<(String, HostTensor)>> {
    build::run_once_on(device, g, inputs).map_err(at(model))
}

/// [`build::lower_bound`]; messages name `model`.
pub fn lower_bound(
    g: &Graph,
    caps: mpc_runtime::program::DeviceCaps,
    layout: Option<&mpc_runtime::program::StateLayout>,
    variables: Option<&std::collections::HashSet<mpc_ir::ValueId>>,
    model: &Path,
) -> Result<mpc_runtime::program::Program> {
    build::lower_bound(g, caps, layout, variables).map_err(at(model))
}

/// [`build::fold_and_infer`] for a device of `caps` (its memory bounds what a fold makes);
/// messages name `model`.
pub fn fold_and_infer(
    g: Graph,
    dims: &HashMap<String, u64>,
    changing: &std::collections::HashSet<mpc_ir::ValueId>,
    caps: mpc_runtime::program::DeviceCaps,
    model: &Path,
) -> Result<(Graph, BTreeMap<String, u64>)> {
    build::fold_and_infer(g, dims, changing, caps.memory).map_err(at(model))
}

pub(crate) use build::fold_constants;

#[cfg(test)]
mod tests {
    use super::*;

    /// An output with no finite element says so, rather than printing a minimum of inf.
    #[test]
    fn summaries_of_empty_and_non_finite_outputs() {
        let t = |shape: Vec<usize>, v: Vec<f32>| HostTensor::from_f32(mpc_ir::DType::F32, shape, v);
        assert_eq!(summary("y", &t(vec![2, 0], vec![])), "y: f32[2, 0] empty");
        assert_eq!(summary("y", &t(vec![2], vec![f32::NAN, f32::INFINITY])), "y: f32[2] 2 NaN/Inf, no finite element");
        assert_eq!(
            summary("y", &t(vec![2], vec![1.0, f32::NAN])),
            "y: f32[2] mean 1.000000 min 1.000000 max 1.000000 (1 NaN/Inf)"
        );
    }
}
