//! [`lower_in`]: the stages of lowering a graph into a [`Program`] (see the module above).

use std::collections::{HashMap, HashSet};

use mpc_ir::{DType, Def, Graph, NodeId, Op, ValueId};

use super::groups::group_updates;
use super::readers::{read_in_readers, InOthers};
use super::*;
use crate::value::HostTensor;
use crate::RuntimeError;

/// Where a branch's buffers start, and the outer places of its inputs.
pub(super) struct Nested {
    arena_base: u64,
    constants_base: u64,
    inputs: Vec<TensorRef>,
}

/// The marker op of a fused launch.
fn fused_marker() -> Op {
    Op::Opaque(Box::new(mpc_ir::ops::Opaque {
        domain: "ai.mpc.runtime".into(),
        op_type: "Fused".into(),
        attrs: Default::default(),
        explicit_inputs: 0,
    }))
}

/// Ops that are views of their first input's bytes.
fn is_view(op: &Op) -> bool {
    op.kind() == mpc_ir::Kind::View
}

/// Standard ops whose output shape is a function of their input's values, not its shape.
const DATA_SHAPED: &[&str] = &["NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit"];

/// Whether the CPU reference (and so every backend) runs this op at all.
fn runnable(op: &Op) -> Result<(), String> {
    match op {
        Op::Opaque(o) if o.domain == "com.microsoft" && o.op_type == "Gelu" && o.attrs.is_empty() => Ok(()),
        Op::Opaque(o) if o.domain.is_empty() && o.op_type == "If" => Ok(()),
        Op::Opaque(o) if o.domain.is_empty() && DATA_SHAPED.contains(&o.op_type.as_str()) => Err(format!(
            "{}'s output shape depends on the values of its input: mpc plans every shape before the data \
             arrives, so it cannot run it",
            o.op_type
        )),
        Op::Opaque(o) => Err(format!("opaque op {}::{} cannot run", o.domain, o.op_type)),
        Op::Einsum(a) if a.equation.contains("...") => {
            Err("Einsum with an ellipsis over operands whose ranks are unknown".into())
        }
        _ => Ok(()),
    }
}

fn align_up(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

fn is_if(op: &Op) -> bool {
    matches!(op, Op::Opaque(o) if o.domain.is_empty() && o.op_type == "If")
}

/// A value's dtype and fixed dims, refused when unknown or too large to address.
pub(super) fn typed(g: &Graph, caps: DeviceCaps, v: ValueId) -> Result<(DType, Vec<usize>), RuntimeError> {
    let t = g.ty(v);
    let unknown = || RuntimeError::UnknownShape(g.name(v).to_string());
    let dtype = t.dtype.ok_or_else(unknown)?;
    let shape = t.shape.as_ref().ok_or_else(unknown)?;
    let dims = shape.dims().iter().map(|d| d.fixed().map(|x| x as usize)).collect::<Option<Vec<_>>>();
    let dims = dims.ok_or_else(unknown)?;
    // Every size below is computed from these: one that does not fit in memory's addresses
    // is refused here, not wrapped.
    let bytes = dims.iter().try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d as u64));
    match bytes {
        Some(b) if b <= MAX_TENSOR_BYTES && b <= caps.memory => {}
        Some(b) if b <= MAX_TENSOR_BYTES => {
            return Err(RuntimeError::TooLarge(format!(
                "`{}` is {dtype}{shape}: {b} bytes, more than the {} bytes the {} device may hold",
                g.name(v),
                caps.memory,
                caps.name
            )))
        }
        _ => {
            return Err(RuntimeError::Graph(format!(
                "`{}` is {dtype}{shape}: more than {} bytes, which mpc does not address",
                g.name(v),
                MAX_TENSOR_BYTES
            )))
        }
    }
    if !addressable(dtype, &dims) {
        return Err(RuntimeError::Graph(format!(
            "`{}` is {dtype}{shape}: empty, but its other dims multiply past the {} bytes mpc addresses",
            g.name(v),
            MAX_TENSOR_BYTES
        )));
    }
    Ok((dtype, dims))
}

/// The values known when lowering. An initializer no step changes is the graph's tensor, its
/// bytes shared: converted to a host tensor only where a fold or a host operand reads it (a
/// model's weights are written to the constants region as the graph holds them, never copied
/// here). A value folded here is the host tensor the fold made.
pub(super) struct KnownValues<'g> {
    values: HashMap<ValueId, (Option<&'g mpc_ir::Tensor>, std::cell::OnceCell<HostTensor>)>,
}

impl<'g> KnownValues<'g> {
    pub(super) fn contains_key(&self, v: &ValueId) -> bool {
        self.values.contains_key(v)
    }

    /// The value as a host tensor (an initializer converted on the first call).
    pub(super) fn get(&self, v: &ValueId) -> Option<&HostTensor> {
        let (init, host) = self.values.get(v)?;
        Some(host.get_or_init(|| HostTensor::from(init.expect("a known value is an initializer or folded"))))
    }

    fn init(&mut self, v: ValueId, t: &'g mpc_ir::Tensor) {
        self.values.insert(v, (Some(t), std::cell::OnceCell::new()));
    }

    fn insert(&mut self, v: ValueId, t: HostTensor) {
        self.values.insert(v, (None, std::cell::OnceCell::from(t)));
    }

    fn keys(&self) -> impl Iterator<Item = &ValueId> {
        self.values.keys()
    }

    /// The value for the constants region: the graph's own tensor where it is one.
    fn constant(&self, v: &ValueId) -> Option<mpc_ir::Tensor> {
        match self.values.get(v)? {
            (Some(t), _) => Some((*t).clone()),
            (None, host) => host.get().map(mpc_ir::Tensor::from),
        }
    }
}

impl std::ops::Index<&ValueId> for KnownValues<'_> {
    type Output = HostTensor;

    fn index(&self, v: &ValueId) -> &HostTensor {
        self.get(v).expect("a value known when lowering")
    }
}

/// Stage 1, what is known when lowering: the values folded (constants, the initializers no step
/// changes, shape arithmetic), the views, and the nodes left to launch, in order.
struct Schedule<'g> {
    known: KnownValues<'g>,
    steps: Vec<NodeId>,
    view_of: HashMap<ValueId, ValueId>,
    folded: usize,
}

fn schedule<'g>(
    g: &'g Graph,
    caps: DeviceCaps,
    order: &[NodeId],
    changing: &HashSet<ValueId>,
) -> Result<Schedule<'g>, RuntimeError> {
    let label = |n: NodeId| g.node_label(n);
    let ty = |v: ValueId| typed(g, caps, v);
    let mut known = KnownValues { values: HashMap::new() };
    for v in g.initializers() {
        if let (false, Some(t)) = (changing.contains(&v), g.value(v).initializer()) {
            known.init(v, t);
        }
    }
    let mut steps: Vec<NodeId> = Vec::new();
    let mut view_of: HashMap<ValueId, ValueId> = HashMap::new();
    let mut folded = 0;
    for &n in order {
        let node = g.node(n);
        runnable(&node.op).map_err(|msg| RuntimeError::Unsupported { node: label(n), msg })?;
        let all_known = !is_if(&node.op) && node.inputs().iter().flatten().all(|v| known.contains_key(v));
        let shape_of = matches!(node.op, Op::Shape(_) | Op::Size) && node.input(0).is_some_and(|v| ty(v).is_ok());
        if (all_known && !node.inputs().is_empty()) || shape_of || matches!(node.op, Op::Constant(_)) {
            let shapes: Vec<Option<(DType, Vec<usize>)>> =
                node.inputs().iter().map(|i| i.filter(|v| !known.contains_key(v)).and_then(|v| ty(v).ok())).collect();
            let ins: Vec<Option<Known>> = node
                .inputs()
                .iter()
                .zip(&shapes)
                .map(|(i, sh)| match (i.and_then(|v| known.get(&v)), sh) {
                    (Some(t), _) => Some(Known::Value(t)),
                    (None, Some((d, s))) => Some(Known::Shape(*d, s)),
                    (None, None) => None,
                })
                .collect();
            let outs =
                fold_within(&node.op, &ins, node.outputs().len(), caps.memory).map_err(|e| kernel_error(g, n, e))?;
            for (&o, t) in node.outputs().iter().zip(outs) {
                known.insert(o, t);
            }
            folded += 1;
            continue;
        }
        if is_view(&node.op) {
            let (Some(x), &[o]) = (node.input(0), node.outputs()) else {
                return Err(RuntimeError::Node { node: label(n), msg: "a view needs one input and one output".into() });
            };
            let (xd, xs) = ty(x)?;
            let (od, os) = ty(o)?;
            if xd != od || xs.iter().product::<usize>() != os.iter().product::<usize>() {
                return Err(RuntimeError::Node {
                    node: label(n),
                    msg: format!("a view of {xd}{xs:?} as {od}{os:?} changes its size"),
                });
            }
            if !known.contains_key(&x) {
                view_of.insert(o, *view_of.get(&x).unwrap_or(&x));
                continue;
            }
        }
        for &slot in node.op.host_operands() {
            if let Some(v) = node.input(slot).filter(|v| !known.contains_key(v)) {
                return Err(RuntimeError::Node {
                    node: label(n),
                    msg: format!(
                        "input {slot} (`{}`) sets a shape or parameter and must be known when lowering, \
                     but it is computed from run-time data",
                        g.name(v)
                    ),
                });
            }
        }
        steps.push(n);
    }
    Ok(Schedule { known, steps, view_of, folded })
}

/// Lowers `g` in the named stages: what is known ([`schedule`]), the launches to make
/// ([`plan_steps`]), the state and constants regions, the arena (lifetimes, buffers, ReLU masks,
/// placement), the launches, and the program that holds them ([`finish`]). `nested` places a
/// branch's buffers past its If's program.
pub(super) fn lower_in(
    g: &Graph,
    caps: DeviceCaps,
    opts: LowerOptions,
    nested: Option<Nested>,
) -> Result<Program, RuntimeError> {
    let no_vars = HashSet::new();
    let variables = opts.variables.unwrap_or(&no_vars);
    let state: Vec<(ValueId, ValueId)> = g.train.as_ref().map(|t| t.state.clone()).unwrap_or_default();
    let changing: HashSet<ValueId> = state.iter().map(|&(s, _)| s).chain(variables.iter().copied()).collect();

    let s = plan_steps(g, caps, &opts, &changing)?;
    let mut refs: HashMap<ValueId, TensorRef> = HashMap::new();
    let (state_layout, state_init) = state_region(g, caps, opts.layout, &changing, &mut refs)?;
    let (constants, constants_bytes) =
        constants_region(&s, nested.as_ref().map_or(0, |n| n.constants_base), &mut refs)?;
    let life = lifetimes(&s, &state);
    // A branch reads its inputs where the outer program keeps them.
    if let Some(n) = &nested {
        for (&v, r) in g.inputs().iter().zip(&n.inputs) {
            refs.insert(v, r.clone());
        }
    }
    let mut buffers = Buffers::default();
    if nested.is_none() {
        input_buffers(&s, &life, &mut buffers)?;
    }
    states_in_place(&s, &life, &state, &mut refs)?;
    output_buffers(&s, &life, &refs, &mut buffers)?;
    let masks = relu_masks(&s, &mut buffers);
    let (mut offsets, mut arena_bytes) = crate::plan::place_buffers(&buffers.sizes);
    if let Some(n) = &nested {
        offsets.iter_mut().for_each(|o| *o += n.arena_base);
        arena_bytes += n.arena_base;
    }
    let (arena_buffers, mask_ref) = arena_report(&s, &buffers, &offsets, masks.0)?;
    let p = Places { s: &s, refs, buffer_of: buffers.of, offsets, mask_of: masks.1, mask_ref };
    let mut regions = Regions { arena_bytes, constants_bytes, constants, folded: s.folded };
    let launches = launch_steps(&p, &life, opts, &state_layout, &mut regions)?;
    finish(&p, launches, arena_buffers, regions, (state_layout, state_init), &state, nested.is_none())
}

/// Stage 2, the launches to make: the steps left once readers read their operands' producers
/// (widening casts, transposes, epilogues, ReluGrad prologues) and weight-gradient launches compute
/// their bias gradients, and the element-wise runs that fuse into one launch each.
struct Steps<'g> {
    g: &'g Graph,
    caps: DeviceCaps,
    known: KnownValues<'g>,
    steps: Vec<NodeId>,
    view_of: HashMap<ValueId, ValueId>,
    folded: usize,
    fuse: bool,
    library: bool,
    read: InOthers,
    /// The bias gradient each weight gradient's launch computes, by the weight gradient's node.
    siblings: HashMap<NodeId, NodeId>,
    runs: Vec<Vec<usize>>,
    run_of: HashMap<usize, usize>,
}

fn plan_steps<'g>(
    g: &'g Graph,
    caps: DeviceCaps,
    opts: &LowerOptions,
    changing: &HashSet<ValueId>,
) -> Result<Steps<'g>, RuntimeError> {
    let order = g.topo_order().map_err(|e| RuntimeError::Graph(e.to_string()))?;
    let Schedule { known, mut steps, view_of, folded } = schedule(g, caps, &order, changing)?;
    let fuse = !opts.unfused && caps.fuse;
    let library = fuse && !opts.bitwise;
    let read = read_in_readers(g, caps, &steps, &view_of, fuse, library);
    let applied: HashSet<NodeId> = read
        .epilogues
        .values()
        .map(|&(_, n)| n)
        .chain(read.thens.values().copied())
        .chain(read.prologues.values().map(|&(n, _)| n))
        .collect();
    let read_through =
        |o: &ValueId| read.widened.contains_key(o) || read.transposed.contains_key(o) || read.permuted.contains_key(o);
    steps.retain(|&n| !applied.contains(&n) && !g.node(n).outputs().first().is_some_and(read_through));
    let mut s = Steps {
        g,
        caps,
        known,
        steps,
        view_of,
        folded,
        fuse,
        library,
        read,
        siblings: HashMap::new(),
        runs: Vec::new(),
        run_of: HashMap::new(),
    };
    if library {
        s.siblings =
            super::siblings::bias_gradients(g, &s.steps, &s.known, &|v: ValueId| s.ty(v).ok(), &|v: ValueId| s.root(v));
        let merged: HashSet<NodeId> = s.siblings.values().copied().collect();
        s.steps.retain(|n| !merged.contains(n));
    }
    if fuse {
        let shape_of = |v: ValueId| s.ty(v).ok().map(|t| t.1);
        s.runs = crate::fuse::runs(g, &s.steps, &shape_of, &|v: ValueId| s.root(v), &|n: NodeId| s.also(n));
    }
    for (r, run) in s.runs.iter().enumerate() {
        s.run_of.extend(run.iter().map(|&i| (i, r)));
    }
    Ok(s)
}

impl Steps<'_> {
    fn ty(&self, v: ValueId) -> Result<(DType, Vec<usize>), RuntimeError> {
        typed(self.g, self.caps, v)
    }

    /// The value a launch writes for `o`: an output with an epilogue is the epilogue's output.
    fn written(&self, o: ValueId) -> ValueId {
        self.read.epilogues.get(&o).map_or(o, |&(v, _)| v)
    }

    /// The value whose bytes `v` is: read through a widening, transposing or permuting reader, or
    /// a view of another's bytes.
    fn root(&self, v: ValueId) -> ValueId {
        let r = &self.read;
        let v = r.widened.get(&v).or(r.transposed.get(&v)).or(r.permuted.get(&v).map(|(u, _)| u)).copied().unwrap_or(v);
        *self.view_of.get(&v).unwrap_or(&v)
    }

    /// The nodes a step computes: its own, and its sibling's.
    fn computed(&self, n: NodeId) -> impl Iterator<Item = NodeId> {
        std::iter::once(n).chain(self.siblings.get(&n).copied())
    }

    /// The epilogue node of a step's launch.
    fn epilogue_node(&self, n: NodeId) -> Option<NodeId> {
        self.g.node(n).outputs().first().and_then(|o| self.read.epilogues.get(o)).map(|&(_, e)| e)
    }

    /// The second operand of a step's epilogue, if it has one (which the launch reads).
    fn epilogue_of(&self, n: NodeId) -> Option<ValueId> {
        self.epilogue_node(n).and_then(|e| self.read.operands.get(&e).copied())
    }

    /// A value read as it is, or the operands of the ReluGrad it is read through.
    fn read_as(&self, v: ValueId) -> Vec<ValueId> {
        match self.read.prologues.get(&v) {
            Some(&(_, operands)) => operands.to_vec(),
            None => vec![v],
        }
    }

    /// What a step's launch reads: its nodes' inputs (a ReluGrad's result read through it as the
    /// ReluGrad's operands) and its epilogue's second operand.
    fn reads(&self, n: NodeId) -> Vec<ValueId> {
        let inputs =
            self.computed(n).flat_map(|m| self.g.node(m).inputs().iter().flatten().flat_map(|&v| self.read_as(v)));
        inputs.chain(self.epilogue_of(n)).collect()
    }

    /// What a step's launch writes: its node's outputs (an epilogue's result for an output with
    /// one) and its sibling's.
    fn also(&self, n: NodeId) -> Vec<ValueId> {
        let own = self.g.node(n).outputs().iter().map(|&o| self.written(o));
        own.chain(self.siblings.get(&n).iter().flat_map(|&&r| self.g.node(r).outputs().iter().copied())).collect()
    }

    /// The step at which step `i` is launched: a fused run's at its last consecutive step.
    fn pos(&self, i: usize) -> usize {
        self.run_of.get(&i).map_or(i, |&r| crate::fuse::launch_at(&self.runs[r]))
    }
}

/// Stage 3, the state region: the changing initializers, at the shared layout's places or laid out
/// here, with their initial values.
#[allow(clippy::type_complexity)]
fn state_region(
    g: &Graph,
    caps: DeviceCaps,
    layout: Option<&StateLayout>,
    changing: &HashSet<ValueId>,
    refs: &mut HashMap<ValueId, TensorRef>,
) -> Result<(StateLayout, Vec<(TensorRef, mpc_ir::Tensor)>), RuntimeError> {
    let ty = |v: ValueId| typed(g, caps, v);
    let changing_vals: Vec<ValueId> = g.initializers().filter(|v| changing.contains(v)).collect();
    let state_layout = match layout {
        Some(l) => {
            for &v in &changing_vals {
                let (dtype, shape) = ty(v)?;
                let r = l.find(g.name(v)).ok_or_else(|| internal(g, v, "is not in the shared state layout"))?;
                if r.dtype != dtype || r.shape != shape {
                    return Err(RuntimeError::Graph(format!(
                        "`{}` is {dtype}{shape:?} here but {}{:?} in the shared state",
                        g.name(v),
                        r.dtype,
                        r.shape
                    )));
                }
                refs.insert(v, r.clone());
            }
            l.clone()
        }
        None => {
            let mut l = StateLayout::default();
            for &v in &changing_vals {
                let (dtype, shape) = ty(v)?;
                let r = TensorRef { region: Region::State, offset: l.bytes, dtype, shape };
                l.bytes = align_up(l.bytes + r.bytes(), caps.align);
                l.values.push((g.name(v).to_string(), r.clone()));
                refs.insert(v, r);
            }
            l
        }
    };
    let state_init = changing_vals
        .iter()
        .map(|&v| {
            let t = g.value(v).initializer().ok_or_else(|| internal(g, v, "has no initial value"))?;
            Ok((refs[&v].clone(), t.clone()))
        })
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    Ok((state_layout, state_init))
}

/// Stage 3, the constants region from `base`: the known values that a launch reads as data or that
/// are outputs. Equal values are one constant (a causal mask that each layer builds from shapes,
/// the equal norm scales of a fresh model's inference graph): the earlier constants of its dtype
/// and shape, compared in full.
#[allow(clippy::type_complexity)]
fn constants_region(
    s: &Steps,
    base: u64,
    refs: &mut HashMap<ValueId, TensorRef>,
) -> Result<(Vec<(TensorRef, mpc_ir::Tensor)>, u64), RuntimeError> {
    let g = s.g;
    let mut device_reads: HashSet<ValueId> = HashSet::new();
    for n in s.steps.iter().flat_map(|&n| s.computed(n)) {
        let host = g.node(n).op.host_operands();
        for (slot, v) in g.node(n).inputs().iter().enumerate() {
            if let Some(v) = v {
                if !host.contains(&slot) {
                    device_reads.extend(s.read_as(*v));
                }
            }
        }
    }
    device_reads.extend(s.steps.iter().filter_map(|&n| s.epilogue_of(n)));
    let mut known_needed: Vec<ValueId> =
        s.known.keys().copied().filter(|v| device_reads.contains(v) || g.is_output(*v)).collect();
    known_needed.sort_unstable();
    let mut top = base;
    let mut constants: Vec<(TensorRef, mpc_ir::Tensor)> = Vec::new();
    let mut by_type: HashMap<(DType, Vec<usize>), Vec<usize>> = HashMap::new();
    for v in known_needed {
        let (dtype, shape) = s.ty(v)?;
        let value = s.known.constant(&v).ok_or_else(|| internal(g, v, "is known but has no value"))?;
        let same = by_type.entry((dtype, shape.clone())).or_default();
        if let Some(&i) = same.iter().find(|&&i| constants[i].1.same_data(&value)) {
            refs.insert(v, constants[i].0.clone());
            continue;
        }
        same.push(constants.len());
        let r = TensorRef { region: Region::Constants, offset: top, dtype, shape };
        top = align_up(top + r.bytes(), s.caps.align);
        constants.push((r.clone(), value));
        refs.insert(v, r);
    }
    Ok((constants, top))
}

/// Stage 4's facts, in launch steps: when each value is last read, the values that live to the end
/// (outputs and next states), and the fused runs' chains and the values no launch writes.
struct Lifetimes {
    last: HashMap<ValueId, usize>,
    keep: HashSet<ValueId>,
    chains: Vec<(crate::fuse::Chain, Vec<ValueId>, Vec<ValueId>)>,
    dropped: HashSet<ValueId>,
}

fn lifetimes(s: &Steps, state: &[(ValueId, ValueId)]) -> Lifetimes {
    let g = s.g;
    let mut last: HashMap<ValueId, usize> = HashMap::new();
    for (i, &n) in s.steps.iter().enumerate() {
        for v in s.reads(n) {
            let e = last.entry(s.root(v)).or_insert(s.pos(i));
            *e = (*e).max(s.pos(i));
        }
    }
    let keep: HashSet<ValueId> = g.outputs().iter().chain(state.iter().map(|(_, n)| n)).map(|&v| s.root(v)).collect();
    // A fused run's value is written when something reads it past the run, or it outlives it.
    let needed = |o: ValueId, run_end: usize| keep.contains(&o) || last.get(&o).is_some_and(|&l| l > run_end);
    let chains: Vec<_> = s
        .runs
        .iter()
        .map(|run| crate::fuse::chain(g, &s.steps, run, &|o| needed(o, crate::fuse::launch_at(run))))
        .collect();
    let dropped: HashSet<ValueId> = s
        .runs
        .iter()
        .zip(&chains)
        .flat_map(|(run, (_, _, written))| {
            run.iter().map(|&i| g.node(s.steps[i]).outputs()[0]).filter(|o| !written.contains(o)).collect::<Vec<_>>()
        })
        .collect();
    Lifetimes { last, keep, chains, dropped }
}

/// The arena's buffers: each one's size and first and last step, the values it holds by defining
/// step, and each value's buffer (views share their source's).
#[derive(Default)]
struct Buffers {
    of: HashMap<ValueId, usize>,
    sizes: Vec<(u64, usize, usize)>,
    holders: Vec<Vec<(usize, ValueId)>>,
}

impl Buffers {
    /// A new buffer, holding `v` (defined at `first`) if given.
    fn add(&mut self, bytes: u64, first: usize, last: usize, v: Option<ValueId>) -> usize {
        let b = self.sizes.len();
        self.sizes.push((bytes, first, last));
        self.holders.push(v.map(|v| (first, v)).into_iter().collect());
        if let Some(v) = v {
            self.of.insert(v, b);
        }
        b
    }
}

/// A value's bytes, aligned.
fn aligned_bytes(s: &Steps, v: ValueId) -> Result<u64, RuntimeError> {
    let (d, sh) = s.ty(v)?;
    Ok(align_up((sh.iter().product::<usize>() * d.size()) as u64, s.caps.align))
}

/// The graph's inputs: each lives from the feed to its last reader (a step needs a feed before it).
fn input_buffers(s: &Steps, life: &Lifetimes, b: &mut Buffers) -> Result<(), RuntimeError> {
    for &v in s.g.inputs() {
        let dies = if life.keep.contains(&v) { s.steps.len() } else { life.last.get(&v).copied().unwrap_or(0) };
        b.add(aligned_bytes(s, v)?, 0, dies, Some(v));
    }
    Ok(())
}

/// A next state that a launch computes after the last read of its state is written straight into
/// the state's slot (the optimizer updates the masters and moments in place): no arena buffer, no
/// copy after the step.
fn states_in_place(
    s: &Steps,
    life: &Lifetimes,
    state: &[(ValueId, ValueId)],
    refs: &mut HashMap<ValueId, TensorRef>,
) -> Result<(), RuntimeError> {
    let g = s.g;
    let def_step: HashMap<ValueId, usize> = s
        .steps
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| s.computed(n).flat_map(move |m| g.node(m).outputs().iter().map(move |&o| (o, s.pos(i)))))
        .collect();
    for &(st, next) in state {
        let (Some(&d), Some(slot)) = (def_step.get(&next), refs.get(&st).cloned()) else { continue };
        if s.view_of.contains_key(&next) || g.is_output(st) || life.last.get(&st).is_some_and(|&l| l > d) {
            continue;
        }
        if s.ty(next)? == (slot.dtype, slot.shape.clone()) {
            refs.insert(next, slot);
        }
    }
    Ok(())
}

/// The launches' outputs: each in a buffer of its own, or in place of an input that dies at its
/// launch.
fn output_buffers(
    s: &Steps,
    life: &Lifetimes,
    refs: &HashMap<ValueId, TensorRef>,
    b: &mut Buffers,
) -> Result<(), RuntimeError> {
    let g = s.g;
    for (i0, &n) in s.steps.iter().enumerate() {
        let node = g.node(n);
        let i = s.pos(i0);
        // What an output may be written over: a fused launch's external inputs (each element is
        // read before it is written), or an element-wise op's inputs.
        let over: Vec<ValueId> = match s.run_of.get(&i0) {
            Some(&r) => life.chains[r].1.clone(),
            None => node.inputs().iter().flatten().copied().collect(),
        };
        for (k, &o) in s.computed(n).flat_map(|m| g.node(m).outputs()).enumerate() {
            let o = s.written(o);
            if refs.contains_key(&o) || life.dropped.contains(&o) {
                continue;
            }
            let t = s.ty(o)?;
            let size = aligned_bytes(s, o)?;
            let dies = if life.keep.contains(&o) { s.steps.len() } else { *life.last.get(&o).unwrap_or(&i) };
            // In place over an input that dies here, of the output's dtype and shape (a broadcast
            // input of the same aligned size would be overwritten while other elements still read
            // it), not an input slot.
            let reuse = (k == 0 && (s.run_of.contains_key(&i0) || crate::plan::elementwise(&node.op)))
                .then(|| {
                    let same = |v: &&ValueId| s.ty(**v).is_ok_and(|u| u == t);
                    over.iter().filter(same).map(|&v| s.root(v)).find(|v| {
                        matches!(g.value(*v).def(), Def::Node(..))
                            && life.last.get(v) == Some(&i)
                            && !life.keep.contains(v)
                            && b.of.get(v).is_some_and(|&x| b.sizes[x].0 == size && b.sizes[x].2 == i)
                    })
                })
                .flatten();
            match reuse {
                Some(v) => {
                    let x = b.of[&v];
                    b.sizes[x].2 = dies;
                    b.of.insert(o, x);
                    b.holders[x].push((i, o));
                }
                None => {
                    b.add(size, i, dies, Some(o));
                }
            }
        }
    }
    Ok(())
}

/// Each ReLU mask's buffer, shape and name, and the buffer each launch that writes or reads one uses.
type Masks = (Vec<(usize, Vec<usize>, String)>, HashMap<NodeId, usize>);

/// ReLU masks ([`Launch::relu_mask`]): a Gemm launch whose Relu epilogue writes `Y`, and the later
/// product launches whose ReluGrad epilogue reads `Y`, share one buffer of bits, from the forward
/// launch to the last backward one.
fn relu_masks(s: &Steps, b: &mut Buffers) -> Masks {
    let g = s.g;
    let mut masks: Masks = (Vec::new(), HashMap::new());
    if !s.library {
        return masks;
    }
    let step_of: HashMap<NodeId, usize> = s.steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // The Gemm whose Relu epilogue writes each value.
    let mut relu_of: HashMap<ValueId, NodeId> = HashMap::new();
    for (&u, &(y, e)) in &s.read.epilogues {
        if let (Op::Relu, Def::Node(p, 0)) = (&g.node(e).op, g.value(u).def()) {
            if matches!(g.node(*p).op, Op::Gemm(_)) && step_of.contains_key(p) {
                relu_of.insert(y, *p);
            }
        }
    }
    let mut buffer_of_relu: HashMap<NodeId, usize> = HashMap::new();
    for (i, &n) in s.steps.iter().enumerate() {
        let Some(e) = s.epilogue_node(n).filter(|&e| g.node(e).op == Op::ReluGrad) else { continue };
        let Some(&f) = s.read.operands.get(&e).and_then(|y| relu_of.get(y)) else { continue };
        let Ok((_, shape)) = s.ty(g.node(f).outputs()[0]) else { continue };
        let &[rows, cols] = shape.as_slice() else { continue };
        let x = *buffer_of_relu.entry(f).or_insert_with(|| {
            let bytes = align_up(relu_mask_bytes(rows, cols), s.caps.align);
            let x = b.add(bytes, s.pos(step_of[&f]), s.pos(i), None);
            masks.0.push((x, relu_mask_shape(rows, cols), format!("{}.relu_mask", g.node_label(f))));
            x
        });
        b.sizes[x].2 = b.sizes[x].2.max(s.pos(i));
        masks.1.insert(f, x);
        masks.1.insert(n, x);
    }
    masks
}

/// The arena's buffers as the program reports them, in launches (a fused run is one, at its end),
/// and the ReLU masks' places by buffer.
#[allow(clippy::type_complexity)]
fn arena_report(
    s: &Steps,
    b: &Buffers,
    offsets: &[u64],
    masks: Vec<(usize, Vec<usize>, String)>,
) -> Result<(Vec<ArenaBuffer>, HashMap<usize, TensorRef>), RuntimeError> {
    let mut launch_at = Vec::with_capacity(s.steps.len() + 1);
    let mut launched = 0;
    for i in 0..s.steps.len() {
        launch_at.push(launched);
        launched += usize::from(s.pos(i) == i);
    }
    launch_at.push(launched);
    let at = |i: usize| launch_at[i.min(s.steps.len())];
    let mut arena_buffers = b
        .sizes
        .iter()
        .zip(&b.holders)
        .zip(offsets)
        .map(|((&(bytes, first, last), vs), &offset)| {
            let values = vs
                .iter()
                .map(|&(i, v)| Ok((at(i), s.g.name(v).to_string(), s.ty(v)?.0, s.ty(v)?.1)))
                .collect::<Result<Vec<_>, RuntimeError>>()?;
            Ok(ArenaBuffer { offset, bytes, first: at(first), last: at(last), values })
        })
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    let mut mask_ref: HashMap<usize, TensorRef> = HashMap::new();
    for (x, shape, name) in masks {
        let r = TensorRef { region: Region::Arena, offset: offsets[x], dtype: DType::U8, shape };
        let first = arena_buffers[x].first;
        arena_buffers[x].values.push((first, name, DType::U8, r.shape.clone()));
        mask_ref.insert(x, r);
    }
    Ok((arena_buffers, mask_ref))
}

/// Where every value lives once the arena is placed.
struct Places<'s, 'g> {
    s: &'s Steps<'g>,
    refs: HashMap<ValueId, TensorRef>,
    buffer_of: HashMap<ValueId, usize>,
    offsets: Vec<u64>,
    mask_of: HashMap<NodeId, usize>,
    mask_ref: HashMap<usize, TensorRef>,
}

impl Places<'_, '_> {
    fn place(&self, v: ValueId) -> Result<TensorRef, RuntimeError> {
        let (dtype, shape) = self.s.ty(v)?;
        let r = self.s.root(v);
        if let Some(p) = self.refs.get(&r) {
            return Ok(TensorRef { dtype, shape, ..p.clone() });
        }
        let b = *self.buffer_of.get(&r).ok_or_else(|| internal(self.s.g, v, "has no place"))?;
        Ok(TensorRef { region: Region::Arena, offset: self.offsets[b], dtype, shape })
    }

    /// A node's operands as its launch reads them.
    fn operands(&self, n: NodeId) -> Result<Vec<Operand>, RuntimeError> {
        let (g, read) = (self.s.g, &self.s.read);
        let host = g.node(n).op.host_operands();
        g.node(n)
            .inputs()
            .iter()
            .enumerate()
            .map(|(slot, v)| match v {
                None => Ok(Operand::Absent),
                Some(v) if host.contains(&slot) => Ok(Operand::Host(self.s.known[v].clone())),
                Some(v) if read.prologues.contains_key(v) => self.place(read.prologues[v].1[0]).map(Operand::Device),
                Some(v) => match (read.widened.get(v), read.transposed.get(v), read.permuted.get(v)) {
                    (Some(&low), _, _) => self.place(low).map(Operand::Widened),
                    (_, Some(&stored), _) => self.place(stored).map(Operand::Transposed),
                    (_, _, Some((stored, perm))) => self.place(*stored).map(|t| Operand::Permuted(t, perm.clone())),
                    _ => self.place(*v).map(Operand::Device),
                },
            })
            .collect()
    }

    /// A node's outputs as its launch writes them.
    fn results(&self, n: NodeId) -> Result<Vec<TensorRef>, RuntimeError> {
        self.s.g.node(n).outputs().iter().map(|&o| self.place(self.s.written(o))).collect()
    }
}

/// What a program and its branches add up: a branch's arena starts past its If's, and its
/// constants and folds are the program's.
struct Regions {
    arena_bytes: u64,
    constants_bytes: u64,
    constants: Vec<(TensorRef, mpc_ir::Tensor)>,
    folded: usize,
}

/// Stage 5, the launches: one per fused run (at its end) and one per other step.
fn launch_steps(
    p: &Places,
    life: &Lifetimes,
    opts: LowerOptions,
    state_layout: &StateLayout,
    regions: &mut Regions,
) -> Result<Vec<Launch>, RuntimeError> {
    let s = p.s;
    let mut launches = Vec::with_capacity(s.steps.len());
    for (i, &n) in s.steps.iter().enumerate() {
        match s.run_of.get(&i) {
            Some(&r) if s.pos(i) == i => launches.push(fused_launch(p, &life.chains[r])?),
            Some(_) => {}
            None => launches.push(step_launch(p, life, n, opts, state_layout, regions)?),
        }
    }
    Ok(launches)
}

/// The launch of a fused element-wise run.
fn fused_launch(p: &Places, chain: &(crate::fuse::Chain, Vec<ValueId>, Vec<ValueId>)) -> Result<Launch, RuntimeError> {
    let (chain, ins, outs) = chain;
    let labels: Vec<&str> = chain.steps.iter().map(|s| s.node.as_str()).collect();
    let inputs = ins
        .iter()
        .map(|v| match p.s.read.widened.get(v) {
            Some(&low) => p.place(low).map(Operand::Widened),
            None => p.place(*v).map(Operand::Device),
        })
        .collect::<Result<_, _>>()?;
    let outputs = outs.iter().map(|&o| p.place(o)).collect::<Result<_, _>>()?;
    Ok(Launch {
        chain: Some(Box::new(chain.clone())),
        ..Launch::new(labels.join(" + "), fused_marker(), inputs, outputs)
    })
}

/// The launch of one step: its node, with what its launch also computes or reads through.
fn step_launch(
    p: &Places,
    life: &Lifetimes,
    n: NodeId,
    opts: LowerOptions,
    state_layout: &StateLayout,
    regions: &mut Regions,
) -> Result<Launch, RuntimeError> {
    let (s, g) = (p.s, p.s.g);
    let node = g.node(n);
    let inputs = p.operands(n)?;
    let outputs = p.results(n)?;
    let sibling = match s.siblings.get(&n) {
        Some(&r) => Some(Box::new(Launch::new(g.node_label(r), g.node(r).op.clone(), p.operands(r)?, p.results(r)?))),
        None => None,
    };
    let branches =
        if is_if(&node.op) { Some(if_launch(s, n, &inputs, &outputs, opts, state_layout, regions)?) } else { None };
    let epilogue_node = s.epilogue_node(n);
    let epilogue = epilogue_node.map(|e| g.node(e).op.clone());
    let epilogue_then = epilogue_node.and_then(|e| s.read.thens.get(&e)).map(|&r| g.node(r).op.clone());
    let epilogue_operand = s.epilogue_of(n).map(|v| p.place(v).map(Operand::Device)).transpose()?;
    // The outputs nothing reads or keeps (a device may skip them).
    let unread: Vec<usize> = (0..node.outputs().len())
        .filter(|&k| {
            let o = s.written(node.outputs()[k]);
            g.value(o).uses().is_empty() && !life.keep.contains(&s.root(o))
        })
        .collect();
    // The ReLU output through whose gradient input 0 is read.
    let relu_prologue = match node.input(0).and_then(|v| s.read.prologues.get(&v)) {
        Some(&(_, [_, y])) => Some(p.place(y).map(Operand::Device)?),
        None => None,
    };
    Ok(Launch {
        node: g.node_label(n),
        op: node.op.clone(),
        inputs,
        outputs,
        branches,
        chain: None,
        epilogue,
        epilogue_operand,
        epilogue_then,
        group: Vec::new(),
        sibling,
        relu_mask: p.mask_of.get(&n).map(|b| p.mask_ref[b].clone()),
        relu_prologue,
        unread,
    })
}

/// An If's two branches, each lowered as a program of its own past everything the program itself
/// uses (only one runs), reading the If's inputs where the program keeps them.
fn if_launch(
    s: &Steps,
    n: NodeId,
    inputs: &[Operand],
    outputs: &[TensorRef],
    opts: LowerOptions,
    state_layout: &StateLayout,
    regions: &mut Regions,
) -> Result<Box<IfLaunch>, RuntimeError> {
    let (g, caps) = (s.g, s.caps);
    let label = || g.node_label(n);
    let b = opts.branches.and_then(|b| b.get(&n)).ok_or_else(|| RuntimeError::Unsupported {
        node: label(),
        msg: "its branches were not decoded for lowering".into(),
    })?;
    let Some(Operand::Device(cond)) = inputs.first().cloned() else {
        return Err(RuntimeError::Node { node: label(), msg: "If without a condition".into() });
    };
    let captures: Vec<TensorRef> = inputs[1..]
        .iter()
        .filter_map(|o| match o {
            Operand::Device(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    let base = align_up(regions.arena_bytes, caps.align);
    let mut lower_branch = |bg: &Graph, nested_b: &HashMap<NodeId, Branches>| {
        let sub = LowerOptions {
            layout: Some(state_layout),
            variables: None,
            branches: Some(nested_b),
            unfused: opts.unfused,
            bitwise: opts.bitwise,
        };
        let nest = Nested { arena_base: base, constants_base: regions.constants_bytes, inputs: captures.clone() };
        let p = lower_in(bg, caps, sub, Some(nest))?;
        if p.outputs.len() != outputs.len() {
            return Err(RuntimeError::Node {
                node: label(),
                msg: format!("a branch has {} outputs, the If {}", p.outputs.len(), outputs.len()),
            });
        }
        for ((_, o), want) in p.outputs.iter().zip(outputs) {
            if o.dtype != want.dtype || o.shape != want.shape {
                return Err(RuntimeError::Node {
                    node: label(),
                    msg: format!(
                        "a branch gives {}{:?} where the If declares {}{:?}",
                        o.dtype, o.shape, want.dtype, want.shape
                    ),
                });
            }
        }
        regions.constants_bytes = p.constants_bytes;
        regions.constants.extend(p.constants.iter().cloned());
        regions.folded += p.folded;
        regions.arena_bytes = regions.arena_bytes.max(p.arena_bytes);
        Ok::<_, RuntimeError>(p)
    };
    let t = lower_branch(&b.then_graph, &b.then_nested)?;
    let e = lower_branch(&b.else_graph, &b.else_nested)?;
    Ok(Box::new(IfLaunch {
        cond,
        then_launches: t.launches,
        then_outputs: t.outputs.into_iter().map(|(_, r)| r).collect(),
        else_launches: e.launches,
        else_outputs: e.outputs.into_iter().map(|(_, r)| r).collect(),
    }))
}

/// Stage 6, the program: the launches grouped (multi-tensor updates), the buffers renumbered to
/// match, the state slots, and the memory check.
#[allow(clippy::type_complexity)]
fn finish(
    p: &Places,
    launches: Vec<Launch>,
    arena_buffers: Vec<ArenaBuffer>,
    regions: Regions,
    (state_layout, state_init): (StateLayout, Vec<(TensorRef, mpc_ir::Tensor)>),
    state: &[(ValueId, ValueId)],
    top_level: bool,
) -> Result<Program, RuntimeError> {
    let (s, g, caps) = (p.s, p.s.g, p.s.caps);
    // Each launch's index after grouping (unfused: where it is), and past the last the end.
    let (launches, moved) = if s.fuse {
        group_updates(launches)
    } else {
        let at = (0..launches.len()).collect();
        (launches, at)
    };
    let arena_buffers: Vec<ArenaBuffer> = arena_buffers
        .into_iter()
        .map(|b| {
            let to = |i: usize| moved.get(i).copied().unwrap_or(launches.len());
            ArenaBuffer { first: to(b.first), last: to(b.last), ..b }
        })
        .collect();
    let grouped =
        (launches.iter().map(|l| l.group.len()).sum(), launches.iter().filter(|l| !l.group.is_empty()).count());
    let host_reads = launches.iter().filter(|l| l.branches.is_some()).count();
    let named = |vs: &[ValueId]| {
        vs.iter().map(|&v| Ok((g.name(v).to_string(), p.place(v)?))).collect::<Result<Vec<_>, RuntimeError>>()
    };
    let state = state
        .iter()
        .map(|&(st, n)| Ok(StateSlot { name: g.name(st).to_string(), slot: p.place(st)?, next: p.place(n)? }))
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    let Regions { arena_bytes, constants_bytes, constants, folded } = regions;
    let total = arena_bytes.saturating_add(constants_bytes).saturating_add(state_layout.bytes);
    if top_level && total > caps.memory {
        return Err(RuntimeError::TooLarge(format!(
            "the program needs {total} bytes (activations {arena_bytes}, state {}, constants {constants_bytes}), \
             more than the {} bytes the {} device may hold",
            state_layout.bytes, caps.memory, caps.name
        )));
    }
    let read = &s.read;
    Ok(Program {
        align: caps.align,
        arena_bytes,
        constants_bytes,
        inputs: named(g.inputs())?,
        outputs: named(g.outputs())?,
        launches,
        constants,
        state_layout,
        state_init,
        state,
        host_reads,
        folded,
        views: s.view_of.len(),
        widened: read.widened.len(),
        epilogues: read.epilogues.len() + read.thens.len(),
        prologues: read.prologues.len(),
        siblings: s.siblings.len(),
        transposed: read.transposed.len() + read.permuted.len(),
        fused: (s.runs.iter().map(Vec::len).sum(), s.runs.len()),
        grouped,
        buffers: arena_buffers,
    })
}

fn internal(g: &Graph, v: ValueId, what: &str) -> RuntimeError {
    RuntimeError::Internal(format!("lowering: `{}` {what}", g.name(v)))
}
