//! `mpc run`: compile with a policy, run on a backend, read and write safetensors.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use mpc_ir::{DType, Dim, Graph, Op, Tensor};
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
/// fair; symbolic dims from `dims` (else 1).
pub fn random_inputs(g: &Graph, seed: u64, dims: &HashMap<String, u64>) -> Result<HashMap<String, HostTensor>> {
    random_inputs_within(g, seed, dims, mpc_runtime::device::DeviceOptions::default().memory())
}

/// [`random_inputs`], each input at most `limit` bytes (a device's memory limit, `--max-memory`).
pub fn random_inputs_within(
    g: &Graph,
    seed: u64,
    dims: &HashMap<String, u64>,
    limit: u64,
) -> Result<HashMap<String, HostTensor>> {
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
                // An expression too large (or negative) is refused below as too large to fill.
                Dim::Sym(e) => e
                    .eval(&|s| Some(dims.get(s).copied().unwrap_or(1)))
                    .and_then(|n| usize::try_from(n).ok())
                    .unwrap_or(usize::MAX),
                Dim::Unknown => 1,
            })
            .collect();
        let n = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .filter(|&b| b as u64 <= mpc_runtime::program::MAX_TENSOR_BYTES.min(limit))
            .map(|b| b / dtype.size())
            .ok_or_else(|| {
                Error::Usage(format!(
                    "input `{name}`: {dtype}{shape:?} is more than the {limit} bytes a program may hold (--max-memory)"
                ))
            })?;
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
    let (bound, used) = fold_and_infer(g.clone(), dims, &state, model)?;
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

/// The graph inputs whose values decide shapes or parameters ([`mpc_ir::Op::host_operands`]),
/// found by walking back from those operands.
fn host_valued_inputs(g: &Graph) -> Vec<mpc_ir::ValueId> {
    let mut seen = std::collections::HashSet::new();
    let mut todo: Vec<mpc_ir::ValueId> = Vec::new();
    for n in g.node_ids() {
        let node = g.node(n);
        todo.extend(node.op.host_operands().iter().filter_map(|&s| node.input(s)));
    }
    let mut out = Vec::new();
    while let Some(v) = todo.pop() {
        if !seen.insert(v) {
            continue;
        }
        match g.value(v).def() {
            mpc_ir::Def::Input => out.push(v),
            // Shape and Size read only their input's shape, which binding the dims gives.
            mpc_ir::Def::Node(n, _) if matches!(g.node(*n).op, Op::Shape(_) | Op::Size) => {}
            mpc_ir::Def::Node(n, _) => todo.extend(g.node(*n).inputs().iter().flatten().copied()),
            _ => {}
        }
    }
    out
}

/// The symbols of the graph inputs' leading dims: the batch, which a program binds when it is
/// lowered (every other symbol may be bound before the passes run).
pub fn batch_symbols(g: &Graph) -> std::collections::HashSet<String> {
    g.inputs()
        .iter()
        .filter_map(|&v| g.ty(v).shape.as_ref()?.dims().first().cloned())
        .flat_map(|d| match d {
            Dim::Sym(e) => e.symbols().into_iter().map(String::from).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// `g` with the sizes `dims` given to its symbolic input dims other than the batch
/// ([`batch_symbols`]) and its types inferred again, so that the passes see them (an RNN over `seq`
/// steps unrolls); the batch stays symbolic, bound when a program is lowered.
pub fn bind_sample_dims(g: &Graph, mut dims: HashMap<String, u64>, model: &Path) -> Result<Graph> {
    let batch = batch_symbols(g);
    dims.retain(|s, _| !batch.contains(s));
    if dims.is_empty() {
        return Ok(g.clone());
    }
    crate::summary::bind_symbols(g, &dims).map_err(|source| Error::Pass { path: model.to_owned(), source })
}

/// The sizes the fed tensors give the graph's symbolic dims, checked: each input's dtype, rank and
/// fixed dims; each named dim the same in every input that has it; each dim expression (`8*batch`)
/// what the sizes make it. A message names the input, the axis, the dim the model declares there
/// and what the data has, and, where another input bound the dim, that input and its axis.
pub fn input_dims(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<HashMap<String, u64>> {
    let rerr = |source| Error::Run { path: model.to_owned(), source };
    for &v in g.inputs() {
        let name = g.name(v);
        let t = inputs.get(name).ok_or_else(|| rerr(mpc_runtime::RuntimeError::MissingInput(name.to_string())))?;
        let ty = g.ty(v);
        if ty.dtype.is_some_and(|d| d != t.dtype()) {
            return Err(rerr(mpc_runtime::RuntimeError::WrongDtype {
                name: name.to_string(),
                expected: ty.dtype.map(|d| d.to_string()).unwrap_or_default(),
                got: t.dtype().to_string(),
            }));
        }
    }
    sizes(g, inputs, model, true)
}

/// [`input_dims`] without its checks of the dtypes and of the fixed dims (left to lowering): the
/// sizes the inputs given give the symbolic dims (those of inputs not given stay unbound).
pub fn input_sizes(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<HashMap<String, u64>> {
    sizes(g, inputs, model, false)
}

/// The sizes of the symbolic dims, checked to agree between inputs; the ranks and fixed dims too
/// when `strict`.
fn sizes(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path, strict: bool) -> Result<HashMap<String, u64>> {
    let usage = |m: String| Error::Usage(format!("{}: {m}", model.display()));
    // Each named dim's size and the input and axis that bound it first.
    let mut dims: HashMap<String, (u64, &str, usize)> = HashMap::new();
    let mut derived = Vec::new();
    for &v in g.inputs() {
        let name = g.name(v);
        let Some(t) = inputs.get(name) else { continue };
        let Some(shape) = &g.ty(v).shape else { continue };
        if shape.rank() != t.shape.len() && !strict {
            continue;
        }
        if shape.rank() != t.shape.len() {
            return Err(usage(format!(
                "input `{name}` has {} axes {:?}, the model declares {} ({shape})",
                t.shape.len(),
                t.shape,
                shape.rank()
            )));
        }
        for (axis, (d, &n)) in shape.dims().iter().zip(&t.shape).enumerate() {
            match d {
                Dim::Fixed(f) if *f as usize != n && strict => {
                    return Err(usage(format!(
                        "input `{name}` axis {axis} is {n}, the model declares {f} there ({shape}; data {:?})",
                        t.shape
                    )))
                }
                Dim::Sym(e) => match e.as_symbol() {
                    None => derived.push((name, axis, e.clone(), n)),
                    Some(s) => match dims.get(s) {
                        Some(&(old, by, at)) if old != n as u64 => {
                            return Err(usage(format!(
                                "input `{name}` axis {axis} is {n} where the model's `{s}` is {old} (bound by input `{by}` axis {at}); its shape is {shape}, the data's {:?}",
                                t.shape
                            )))
                        }
                        Some(_) => {}
                        None => {
                            dims.insert(s.to_string(), (n as u64, name, axis));
                        }
                    },
                },
                _ => {}
            }
        }
    }
    let sizes: HashMap<String, u64> = dims.iter().map(|(k, &(n, _, _))| (k.clone(), n)).collect();
    for (name, axis, e, n) in derived {
        if let Some(want) = e.eval(&|s| sizes.get(s).copied()).filter(|&w| w != n as i64) {
            return Err(usage(format!(
                "input `{name}` axis {axis} is {n} where the model's `{e}` is {want} for the sizes the inputs bound"
            )));
        }
    }
    Ok(sizes)
}

/// Lowers `g` for the inputs about to be fed: the inputs' types become the fed tensors' (binding
/// every symbolic dim, [`input_dims`]), inputs that set shapes or parameters (Reshape's shape,
/// Slice's starts) become constants of the fed values, every type is inferred anew, and the graph
/// is lowered for a device with `caps`. A fed tensor of the wrong dtype or shape is an error naming
/// the input.
pub fn lower_for_inputs(
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
    caps: mpc_runtime::program::DeviceCaps,
    model: &Path,
) -> Result<mpc_runtime::program::Program> {
    let dims = input_dims(g, inputs, model)?;
    let mut b = g.clone();
    for &v in g.inputs() {
        let t = &inputs[g.name(v)];
        // Named dims stay symbolic (bound below, with the values that carry them); unknown and
        // missing ones, and expressions (`8*batch`, checked above), take the fed size.
        let dims_now: Vec<Dim> = match &g.ty(v).shape {
            Some(shape) => shape
                .dims()
                .iter()
                .zip(&t.shape)
                .map(|(d, &n)| match d {
                    Dim::Sym(e) if e.as_symbol().is_some() => d.clone(),
                    _ => Dim::Fixed(n as u64),
                })
                .collect(),
            None => t.shape.iter().map(|&n| Dim::Fixed(n as u64)).collect(),
        };
        b.set_ty(v, mpc_ir::TypeInfo::new(t.dtype(), mpc_ir::Shape(dims_now)));
    }
    for v in host_valued_inputs(&b) {
        let t = &inputs[b.name(v)];
        let name = b.unique_name(&format!("{}.value", b.name(v)));
        let c = b.add_initializer(&name, Tensor::from(t));
        b.replace_uses(v, c);
    }
    let state: std::collections::HashSet<mpc_ir::ValueId> =
        b.train.iter().flat_map(|t| t.state.iter().map(|&(s, _)| s)).collect();
    let (bound, _) = fold_and_infer(b, &dims, &state, model)?;
    lower_bound(&bound, caps, None, None, model)
}

/// Lowers `g` for `inputs` and runs it once on the CPU device; the outputs by name, in order.
pub fn run_once(g: &Graph, inputs: &HashMap<String, HostTensor>, model: &Path) -> Result<Vec<(String, HostTensor)>> {
    run_once_on(mpc_runtime::device::CpuDevice::default(), g, inputs, model)
}

/// [`run_once`] on `device`.
pub fn run_once_on<D: mpc_runtime::device::Device>(
    device: D,
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
    model: &Path,
) -> Result<Vec<(String, HostTensor)>> {
    let program = lower_for_inputs(g, inputs, device.caps(), model)?;
    let rerr = |source| Error::Run { path: model.to_owned(), source };
    mpc_runtime::session::Session::new(device, program).map_err(rerr)?.run(inputs).map_err(rerr)
}

/// Lowers a bound, typed graph: its `If` branches are decoded and typed first.
pub fn lower_bound(
    g: &Graph,
    caps: mpc_runtime::program::DeviceCaps,
    layout: Option<&mpc_runtime::program::StateLayout>,
    variables: Option<&std::collections::HashSet<mpc_ir::ValueId>>,
    model: &Path,
) -> Result<mpc_runtime::program::Program> {
    let branches = if_branches(g, model)?;
    let opts = mpc_runtime::program::LowerOptions {
        layout,
        variables,
        branches: Some(&branches),
        unfused: false,
        bitwise: false,
    };
    mpc_runtime::program::lower(g, caps, opts).map_err(|source| Error::Run { path: model.to_owned(), source })
}

/// The branches of every `If` of `g` as typed graphs of their own (the outer values they read
/// are their inputs), and theirs, recursively.
fn if_branches(g: &Graph, model: &Path) -> Result<HashMap<mpc_ir::NodeId, mpc_runtime::program::Branches>> {
    let mut out = HashMap::new();
    for n in g.node_ids() {
        let node = g.node(n);
        let mpc_ir::Op::Opaque(o) = &node.op else { continue };
        if !(o.domain.is_empty() && o.op_type == "If") {
            continue;
        }
        let captures: Vec<mpc_ir::ValueId> = node.inputs()[o.explicit_inputs..].iter().flatten().copied().collect();
        let branch = |name: &str| -> Result<(Graph, HashMap<mpc_ir::NodeId, mpc_runtime::program::Branches>)> {
            let err =
                |msg: String| Error::Usage(format!("{}: node {}: {name}: {msg}", model.display(), g.node_label(n)));
            let raw = o.attrs.iter().find_map(|(k, a)| match a {
                mpc_ir::Attr::Raw(b) if k == name => Some(b),
                _ => None,
            });
            let raw = raw.ok_or_else(|| err("missing".into()))?;
            let sub = mpc_ir::onnx::decode_subgraph(raw, g, &captures).map_err(|e| err(e.to_string()))?;
            let (typed, _) = fold_and_infer(sub, &HashMap::new(), &Default::default(), model)?;
            let nested = if_branches(&typed, model)?;
            Ok((typed, nested))
        };
        let (then_graph, then_nested) = branch("then_branch")?;
        let (else_graph, else_nested) = branch("else_branch")?;
        out.insert(n, mpc_runtime::program::Branches { then_graph, else_graph, then_nested, else_nested });
    }
    Ok(out)
}

/// Binds `dims`, infers every type, and folds what is constant until nothing more folds: folded
/// shape arithmetic (`Shape → Gather → Concat`) gives inference the values that decide the next
/// shapes (and the ranks that composite ops, `mpc_passes::expand_composites`, wait for).
/// Initializers named in `changing` (training state) are not constants. Also returns the symbolic
/// dims the inputs bound.
pub fn fold_and_infer(
    mut g: Graph,
    dims: &HashMap<String, u64>,
    changing: &std::collections::HashSet<mpc_ir::ValueId>,
    model: &Path,
) -> Result<(Graph, BTreeMap<String, u64>)> {
    let mut used = None;
    loop {
        let (bound, u) =
            crate::summary::bind_inputs(&g, dims).map_err(|source| Error::Pass { path: model.to_owned(), source })?;
        used.get_or_insert(u);
        g = bound;
        let folded = fold_constants(&mut g, changing, &|_| true);
        let folded = folded.map_err(|source| Error::Run { path: model.to_owned(), source })?;
        // A composite op whose input's rank only the bound values give is written out now.
        let wrote =
            mpc_passes::expand_composites(&mut g).map_err(|source| Error::Pass { path: model.to_owned(), source })?;
        if folded == 0 && wrote == mpc_passes::Changed::No {
            return Ok((g, used.unwrap_or_default()));
        }
    }
}

/// Replaces every node whose inputs are all constants (or that reads only a fixed shape) by
/// initializers of its results, computed by the CPU reference, where `keep` takes the results.
/// Returns how many nodes it folded.
pub(crate) fn fold_constants(
    g: &mut Graph,
    changing: &std::collections::HashSet<mpc_ir::ValueId>,
    keep: &dyn Fn(&[HostTensor]) -> bool,
) -> std::result::Result<usize, mpc_runtime::RuntimeError> {
    use mpc_ir::Op;
    let order = g.topo_order().map_err(|e| mpc_runtime::RuntimeError::Graph(e.to_string()))?;
    let mut folded = 0;
    for n in order {
        let node = g.node(n);
        if node.op.is_opaque() || node.outputs().is_empty() {
            continue;
        }
        use mpc_runtime::program::Known;
        let konst = |v: &mpc_ir::ValueId| !changing.contains(v) && g.constant(*v).is_some();
        let shape_of = matches!(node.op, Op::Shape(_) | Op::Size);
        let fixed = |v: mpc_ir::ValueId| {
            let t = g.ty(v);
            Some((t.dtype?, t.shape.as_ref()?.as_fixed()?.iter().map(|&d| d as usize).collect::<Vec<_>>()))
        };
        let values: Vec<Option<HostTensor>> =
            node.inputs().iter().map(|i| i.filter(konst).and_then(|v| g.constant(v)).map(HostTensor::from)).collect();
        let shapes: Vec<Option<(DType, Vec<usize>)>> = node.inputs().iter().map(|i| i.and_then(fixed)).collect();
        let ins: Vec<Option<Known>> = values
            .iter()
            .zip(&shapes)
            .map(|(v, sh)| match (v, sh) {
                (Some(t), _) => Some(Known::Value(t)),
                (None, Some((d, s))) if shape_of => Some(Known::Shape(*d, s)),
                _ => None,
            })
            .collect();
        // Every input present must be known (Shape and Size: by its shape at least).
        let complete =
            !node.inputs().is_empty() && node.inputs().iter().zip(&ins).all(|(i, k)| i.is_none() || k.is_some());
        if !complete {
            continue;
        }
        let outs = match mpc_runtime::program::fold(&node.op, &ins, node.outputs().len()) {
            Ok(o) if o.len() == node.outputs().len() && keep(&o) => o,
            // Left for lowering, which reports it with its node.
            _ => continue,
        };
        let outputs = node.outputs().to_vec();
        for (o, t) in outputs.into_iter().zip(outs) {
            let name = g.name(o).to_string();
            g.rename(o, "");
            let c = g.add_initializer(&name, Tensor::from(&t));
            g.replace_uses(o, c);
        }
        g.remove_node(n);
        folded += 1;
    }
    Ok(folded)
}
