//! From a typed graph to a program, one way for every front end: bind the inputs' symbolic dims
//! (to sizes, or to what fed tensors have, checked), infer every type again, fold what is
//! constant, write out composite ops whose ranks only the bound values give, decode and type the
//! branches of `If`, and lower. Also deterministic random inputs for a graph.

use std::collections::{BTreeMap, HashMap};

use mpc_ir::{DType, Dim, Graph, Op, Shape, Tensor};
use mpc_passes::{infer_types, PassError};

use crate::{HostTensor, RuntimeError};

/// What can go wrong on the way to a program.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Type inference or a rewrite failed (a node names itself).
    #[error(transparent)]
    Pass(#[from] PassError),
    /// Lowering or a kernel failed.
    #[error(transparent)]
    Run(#[from] RuntimeError),
    /// The fed data, a size or a branch does not fit the model: one line naming the input or node.
    #[error("{0}")]
    Data(String),
}

pub type Result<T> = std::result::Result<T, BuildError>;

/// Deterministic random inputs for every graph input: floats N(0, 1), integers in [0, 2), bools
/// fair; symbolic dims from `dims` (else 1).
pub fn random_inputs(g: &Graph, seed: u64, dims: &HashMap<String, u64>) -> Result<HashMap<String, HostTensor>> {
    random_inputs_within(g, seed, dims, crate::device::DeviceOptions::default().memory())
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
        let dtype = ty.dtype.ok_or_else(|| BuildError::Data(format!("input `{name}` has no known dtype")))?;
        let shape: Vec<usize> = ty
            .shape
            .as_ref()
            .ok_or_else(|| BuildError::Data(format!("input `{name}` has no known shape")))?
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
            .filter(|&b| b as u64 <= crate::program::MAX_TENSOR_BYTES.min(limit))
            .map(|b| b / dtype.size())
            .ok_or_else(|| {
                BuildError::Data(format!(
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

/// Binds every symbolic or unknown input dim (`dims`, else 1) and re-infers shapes.
/// Returns the bound graph and the bindings used.
pub fn bind_inputs(
    g: &Graph,
    dims: &HashMap<String, u64>,
) -> std::result::Result<(Graph, BTreeMap<String, u64>), PassError> {
    let mut b = g.clone();
    let mut used = BTreeMap::new();
    for &v in g.inputs() {
        let Some(shape) = g.ty(v).shape.clone() else {
            continue;
        };
        let bound = Shape(
            shape
                .0
                .iter()
                .map(|d| match d {
                    Dim::Sym(e) => {
                        for s in e.symbols() {
                            used.insert(s.to_string(), dims.get(s).copied().unwrap_or(1));
                        }
                        let n = e.eval(&|s| used.get(s).copied()).and_then(|n| u64::try_from(n).ok());
                        n.map_or(Dim::Unknown, Dim::Fixed)
                    }
                    Dim::Unknown => Dim::Fixed(1),
                    d => d.clone(),
                })
                .collect(),
        );
        let mut ty = g.ty(v).clone();
        ty.shape = Some(bound);
        b.set_ty(v, ty);
    }
    reinfer(&mut b, &used)?;
    Ok((b, used))
}

/// `g` with the sizes `dims` given to those symbolic dims of its inputs, and every type inferred
/// again; the other symbolic dims stay as they are.
pub fn bind_symbols(g: &Graph, dims: &HashMap<String, u64>) -> std::result::Result<Graph, PassError> {
    let mut b = g.clone();
    for &v in g.inputs() {
        let Some(shape) = g.ty(v).shape.as_ref() else { continue };
        let mut ty = g.ty(v).clone();
        ty.shape = Some(shape.bind(&|s| dims.get(s).copied()));
        b.set_ty(v, ty);
    }
    reinfer(&mut b, &dims.iter().map(|(k, &v)| (k.clone(), v)).collect())?;
    Ok(b)
}

/// Infers every type of `b` from its inputs' again; opaque ops keep their declared types, with
/// the symbols of `used` bound there too.
fn reinfer(b: &mut Graph, used: &BTreeMap<String, u64>) -> std::result::Result<(), PassError> {
    for n in b.node_ids().collect::<Vec<_>>() {
        if !b.node(n).op.is_opaque() {
            for o in b.node(n).outputs().to_vec() {
                b.set_ty(o, Default::default());
            }
        }
    }
    infer_types(b)?;
    for v in b.value_ids().collect::<Vec<_>>() {
        if let Some(shape) = b.ty(v).shape.clone() {
            if shape
                .dims()
                .iter()
                .any(|d| matches!(d, Dim::Sym(e) if e.symbols().iter().any(|s| used.contains_key(*s))))
            {
                let bound = shape.bind(&|s| used.get(s).copied());
                let mut ty = b.ty(v).clone();
                ty.shape = Some(bound);
                b.set_ty(v, ty);
            }
        }
    }
    Ok(())
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
pub fn bind_sample_dims(g: &Graph, mut dims: HashMap<String, u64>) -> Result<Graph> {
    let batch = batch_symbols(g);
    dims.retain(|s, _| !batch.contains(s));
    if dims.is_empty() {
        return Ok(g.clone());
    }
    Ok(bind_symbols(g, &dims)?)
}

/// The sizes the fed tensors give the graph's symbolic dims, checked: each input's dtype, rank and
/// fixed dims; each named dim the same in every input that has it; each dim expression (`8*batch`)
/// what the sizes make it. A message names the input, the axis, the dim the model declares there
/// and what the data has, and, where another input bound the dim, that input and its axis.
pub fn input_dims(g: &Graph, inputs: &HashMap<String, HostTensor>) -> Result<HashMap<String, u64>> {
    let rerr = BuildError::Run;
    for &v in g.inputs() {
        let name = g.name(v);
        let t = inputs.get(name).ok_or_else(|| rerr(crate::RuntimeError::MissingInput(name.to_string())))?;
        let ty = g.ty(v);
        if ty.dtype.is_some_and(|d| d != t.dtype()) {
            return Err(rerr(crate::RuntimeError::WrongDtype {
                name: name.to_string(),
                expected: ty.dtype.map(|d| d.to_string()).unwrap_or_default(),
                got: t.dtype().to_string(),
            }));
        }
    }
    sizes(g, inputs, true)
}

/// [`input_dims`] without its checks of the dtypes and of the fixed dims (left to lowering): the
/// sizes the inputs given give the symbolic dims (those of inputs not given stay unbound).
pub fn input_sizes(g: &Graph, inputs: &HashMap<String, HostTensor>) -> Result<HashMap<String, u64>> {
    sizes(g, inputs, false)
}

/// The sizes of the symbolic dims, checked to agree between inputs; the ranks and fixed dims too
/// when `strict`.
fn sizes(g: &Graph, inputs: &HashMap<String, HostTensor>, strict: bool) -> Result<HashMap<String, u64>> {
    let usage = BuildError::Data;
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
    caps: crate::program::DeviceCaps,
) -> Result<crate::program::Program> {
    let dims = input_dims(g, inputs)?;
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
    let (bound, _) = fold_and_infer(b, &dims, &state, caps.memory)?;
    lower_bound(&bound, caps, None, None)
}

/// Lowers `g` for `inputs` and runs it once on the CPU device; the outputs by name, in order.
pub fn run_once(g: &Graph, inputs: &HashMap<String, HostTensor>) -> Result<Vec<(String, HostTensor)>> {
    run_once_on(crate::device::CpuDevice::default(), g, inputs)
}

/// [`run_once`] on `device`.
pub fn run_once_on<D: crate::device::Device>(
    device: D,
    g: &Graph,
    inputs: &HashMap<String, HostTensor>,
) -> Result<Vec<(String, HostTensor)>> {
    let program = lower_for_inputs(g, inputs, device.caps())?;
    let rerr = BuildError::Run;
    crate::session::Session::new(device, program).map_err(rerr)?.run(inputs).map_err(rerr)
}

/// Lowers a bound, typed graph: its `If` branches are decoded and typed first.
pub fn lower_bound(
    g: &Graph,
    caps: crate::program::DeviceCaps,
    layout: Option<&crate::program::StateLayout>,
    variables: Option<&std::collections::HashSet<mpc_ir::ValueId>>,
) -> Result<crate::program::Program> {
    let branches = if_branches(g, caps.memory)?;
    let opts =
        crate::program::LowerOptions { layout, variables, branches: Some(&branches), unfused: false, bitwise: false };
    crate::program::lower(g, caps, opts).map_err(BuildError::Run)
}

/// The branches of every `If` of `g` as typed graphs of their own (the outer values they read
/// are their inputs), and theirs, recursively.
fn if_branches(g: &Graph, limit: u64) -> Result<HashMap<mpc_ir::NodeId, crate::program::Branches>> {
    let mut out = HashMap::new();
    for n in g.node_ids() {
        let node = g.node(n);
        let mpc_ir::Op::Opaque(o) = &node.op else { continue };
        if !(o.domain.is_empty() && o.op_type == "If") {
            continue;
        }
        let captures: Vec<mpc_ir::ValueId> = node.inputs()[o.explicit_inputs..].iter().flatten().copied().collect();
        let branch = |name: &str| -> Result<(Graph, HashMap<mpc_ir::NodeId, crate::program::Branches>)> {
            let err = |msg: String| BuildError::Data(format!("node {}: {name}: {msg}", g.node_label(n)));
            let raw = o.attrs.iter().find_map(|(k, a)| match a {
                mpc_ir::Attr::Raw(b) if k == name => Some(b),
                _ => None,
            });
            let raw = raw.ok_or_else(|| err("missing".into()))?;
            let sub = mpc_ir::onnx::decode_subgraph(raw, g, &captures).map_err(|e| err(e.to_string()))?;
            let (typed, _) = fold_and_infer(sub, &HashMap::new(), &Default::default(), limit)?;
            let nested = if_branches(&typed, limit)?;
            Ok((typed, nested))
        };
        let (then_graph, then_nested) = branch("then_branch")?;
        let (else_graph, else_nested) = branch("else_branch")?;
        out.insert(n, crate::program::Branches { then_graph, else_graph, then_nested, else_nested });
    }
    Ok(out)
}

/// Binds `dims`, infers every type, and folds what is constant until nothing more folds: folded
/// shape arithmetic (`Shape → Gather → Concat`) gives inference the values that decide the next
/// shapes (and the ranks that composite ops, `mpc_passes::expand_composites`, wait for).
/// Initializers named in `changing` (training state) are not constants; a folded value whose shape
/// comes from data is refused past `limit` bytes (the memory of the device it is lowered for).
/// Also returns the symbolic dims the inputs bound.
pub fn fold_and_infer(
    mut g: Graph,
    dims: &HashMap<String, u64>,
    changing: &std::collections::HashSet<mpc_ir::ValueId>,
    limit: u64,
) -> Result<(Graph, BTreeMap<String, u64>)> {
    let mut used = None;
    loop {
        let (bound, u) = bind_inputs(&g, dims)?;
        used.get_or_insert(u);
        g = bound;
        let folded = fold_constants(&mut g, changing, &|_| true, limit);
        let folded = folded.map_err(BuildError::Run)?;
        // A composite op whose input's rank only the bound values give is written out now.
        let wrote = mpc_passes::expand_composites(&mut g).map_err(BuildError::Pass)?;
        if folded == 0 && wrote == mpc_passes::Changed::No {
            return Ok((g, used.unwrap_or_default()));
        }
    }
}

/// Replaces every node whose inputs are all constants (or that reads only a fixed shape) by
/// initializers of its results, computed by the CPU reference, where `keep` takes the results.
/// Returns how many nodes it folded.
pub fn fold_constants(
    g: &mut Graph,
    changing: &std::collections::HashSet<mpc_ir::ValueId>,
    keep: &dyn Fn(&[HostTensor]) -> bool,
    limit: u64,
) -> std::result::Result<usize, RuntimeError> {
    use mpc_ir::Op;
    let order = g.topo_order().map_err(|e| crate::RuntimeError::Graph(e.to_string()))?;
    let mut folded = 0;
    for n in order {
        let node = g.node(n);
        if node.op.is_opaque() || node.outputs().is_empty() {
            continue;
        }
        use crate::program::Known;
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
        let outs = match crate::program::fold_within(&node.op, &ins, node.outputs().len(), limit) {
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
