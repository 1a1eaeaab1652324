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

pub(super) fn lower_in(
    g: &Graph,
    caps: DeviceCaps,
    opts: LowerOptions,
    nested: Option<Nested>,
) -> Result<Program, RuntimeError> {
    let (layout, no_vars) = (opts.layout, HashSet::new());
    let variables = opts.variables.unwrap_or(&no_vars);
    let order = g.topo_order().map_err(|e| RuntimeError::Graph(e.to_string()))?;
    let label = |n: NodeId| g.node_label(n);
    let ty = |v: ValueId| typed(g, caps, v);
    let state: Vec<(ValueId, ValueId)> = g.train.as_ref().map(|t| t.state.clone()).unwrap_or_default();
    let changing: HashSet<ValueId> = state.iter().map(|&(s, _)| s).chain(variables.iter().copied()).collect();

    // 1. What is known when lowering, and what is read inside its readers' launches.
    let Schedule { known, mut steps, view_of, mut folded } = schedule(g, caps, &order, &changing)?;
    let fuse = !opts.unfused && caps.fuse;
    let library = fuse && !opts.bitwise;
    let InOthers { widened, transposed, permuted, epilogues, operands: epilogue_operands, thens, prologues } =
        read_in_readers(g, caps, &steps, &view_of, fuse, library);
    let applied: HashSet<NodeId> = epilogues
        .values()
        .map(|&(_, n)| n)
        .chain(thens.values().copied())
        .chain(prologues.values().map(|&(n, _)| n))
        .collect();
    steps.retain(|&n| {
        !applied.contains(&n)
            && !g
                .node(n)
                .outputs()
                .first()
                .is_some_and(|o| widened.contains_key(o) || transposed.contains_key(o) || permuted.contains_key(o))
    });
    // A value a launch writes: an output with an epilogue is the epilogue's output.
    let written = |o: ValueId| epilogues.get(&o).map_or(o, |&(v, _)| v);
    let views = view_of.len();
    let root = |v: ValueId| {
        let v = widened.get(&v).or(transposed.get(&v)).or(permuted.get(&v).map(|(u, _)| u)).copied().unwrap_or(v);
        *view_of.get(&v).unwrap_or(&v)
    };
    // Bias gradients computed by their weight gradient's launch: not launched on their own.
    let siblings = if library {
        super::siblings::bias_gradients(g, &steps, &known, &|v| ty(v).ok(), &root)
    } else {
        HashMap::new()
    };
    let merged: HashSet<NodeId> = siblings.values().copied().collect();
    steps.retain(|n| !merged.contains(n));
    // The nodes a step computes: its own, and its sibling's.
    let computed = |n: NodeId| std::iter::once(n).chain(siblings.get(&n).copied());
    // The epilogue node of a step's launch, if it has a second operand (which the launch reads).
    let epilogue_of = |n: NodeId| {
        let e = g.node(n).outputs().first().and_then(|o| epilogues.get(o)).map(|&(_, e)| e);
        e.and_then(|e| epilogue_operands.get(&e).copied())
    };
    // A value read as it is, or the operands of the ReluGrad it is read through.
    let read_as = |v: ValueId| match prologues.get(&v) {
        Some(&(_, operands)) => operands.to_vec(),
        None => vec![v],
    };
    // What a step's launch reads: its nodes' inputs (a ReluGrad's result read through it as the
    // ReluGrad's operands) and its epilogue's second operand.
    let reads = |n: NodeId| {
        computed(n)
            .flat_map(|m| g.node(m).inputs().iter().flatten().flat_map(|&v| read_as(v)))
            .chain(epilogue_of(n))
            .collect::<Vec<_>>()
    };
    let end = steps.len();
    // Element-wise runs fused into one launch each, at the run's last consecutive step (`pos`).
    let shape_of = |v: ValueId| ty(v).ok().map(|t| t.1);
    // What a step's launch writes besides its node's outputs: an epilogue's result, a sibling's.
    let also = |n: NodeId| -> Vec<ValueId> {
        let own = g.node(n).outputs().iter().map(|&o| written(o));
        own.chain(siblings.get(&n).iter().flat_map(|&&r| g.node(r).outputs().iter().copied())).collect()
    };
    let runs = if fuse { crate::fuse::runs(g, &steps, &shape_of, &root, &also) } else { Vec::new() };
    let mut run_of: HashMap<usize, usize> = HashMap::new();
    for (r, run) in runs.iter().enumerate() {
        run_of.extend(run.iter().map(|&i| (i, r)));
    }
    let pos = |i: usize| run_of.get(&i).map_or(i, |&r| crate::fuse::launch_at(&runs[r]));

    // 2. The state region: the changing initializers, at the layout's places or laid out here.
    let changing_vals: Vec<ValueId> = g.initializers().filter(|v| changing.contains(v)).collect();
    let mut refs: HashMap<ValueId, TensorRef> = HashMap::new();
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

    // The constants region: known values that a launch reads as data or that are outputs.
    let mut device_reads: HashSet<ValueId> = HashSet::new();
    for n in steps.iter().flat_map(|&n| computed(n)) {
        let host = g.node(n).op.host_operands();
        for (slot, v) in g.node(n).inputs().iter().enumerate() {
            if let Some(v) = v {
                if !host.contains(&slot) {
                    device_reads.extend(read_as(*v));
                }
            }
        }
    }
    device_reads.extend(steps.iter().filter_map(|&n| epilogue_of(n)));
    let mut known_needed: Vec<ValueId> =
        known.keys().copied().filter(|v| device_reads.contains(v) || g.is_output(*v)).collect();
    known_needed.sort_unstable();
    let mut top = nested.as_ref().map_or(0, |n| n.constants_base);
    let mut constants: Vec<(TensorRef, mpc_ir::Tensor)> = Vec::new();
    // Equal values are one constant (a causal mask that each layer builds from shapes, the
    // equal norm scales of a fresh model's inference graph): the earlier constants by dtype
    // and shape, compared in full.
    let mut by_type: HashMap<(DType, Vec<usize>), Vec<usize>> = HashMap::new();
    for v in known_needed {
        let (dtype, shape) = ty(v)?;
        let value = known.constant(&v).ok_or_else(|| internal(g, v, "is known but has no value"))?;
        let same = by_type.entry((dtype, shape.clone())).or_default();
        if let Some(&i) = same.iter().find(|&&i| constants[i].1.same_data(&value)) {
            refs.insert(v, constants[i].0.clone());
            continue;
        }
        same.push(constants.len());
        let r = TensorRef { region: Region::Constants, offset: top, dtype, shape };
        top = align_up(top + r.bytes(), caps.align);
        constants.push((r.clone(), value));
        refs.insert(v, r);
    }
    let mut constants_bytes = top;

    // 3. Arena buffers: graph inputs and launch outputs, views sharing their source's buffer;
    // lifetimes in launch steps (graph outputs and next states live to the end).
    let mut buffer_of: HashMap<ValueId, usize> = HashMap::new();
    let mut buffers: Vec<(u64, usize, usize)> = Vec::new(); // size, first, last
    let mut holders: Vec<Vec<(usize, ValueId)>> = Vec::new(); // each buffer's values, by defining step
                                                              // A branch reads its inputs where the outer program keeps them.
    if let Some(n) = &nested {
        for (&v, r) in g.inputs().iter().zip(&n.inputs) {
            refs.insert(v, r.clone());
        }
    }
    let mut last: HashMap<ValueId, usize> = HashMap::new();
    for (i, &n) in steps.iter().enumerate() {
        for v in reads(n) {
            let e = last.entry(root(v)).or_insert(pos(i));
            *e = (*e).max(pos(i));
        }
    }
    let keep: HashSet<ValueId> = g.outputs().iter().chain(state.iter().map(|(_, n)| n)).map(|&v| root(v)).collect();
    // A fused run's value is written when something reads it past the run, or it outlives it.
    let needed = |o: ValueId, run_end: usize| keep.contains(&o) || last.get(&o).is_some_and(|&l| l > run_end);
    let chains: Vec<(crate::fuse::Chain, Vec<ValueId>, Vec<ValueId>)> = runs
        .iter()
        .map(|run| crate::fuse::chain(g, &steps, run, &|o| needed(o, crate::fuse::launch_at(run))))
        .collect();
    let dropped: HashSet<ValueId> = runs
        .iter()
        .zip(&chains)
        .flat_map(|(run, (_, _, written))| {
            run.iter().map(|&i| g.node(steps[i]).outputs()[0]).filter(|o| !written.contains(o)).collect::<Vec<_>>()
        })
        .collect();
    if nested.is_none() {
        // An input lives from the feed to its last reader: a step needs a feed before it.
        for &v in g.inputs() {
            let (d, s) = ty(v)?;
            let dies = if keep.contains(&v) { end } else { last.get(&v).copied().unwrap_or(0) };
            buffer_of.insert(v, buffers.len());
            buffers.push((align_up((s.iter().product::<usize>() * d.size()) as u64, caps.align), 0, dies));
            holders.push(vec![(0, v)]);
        }
    }
    // A next state that a launch computes after the last read of its state is written straight
    // into the state's slot (the optimizer updates the masters and moments in place): no arena
    // buffer, no copy after the step.
    let def_step: HashMap<ValueId, usize> = steps
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| computed(n).flat_map(move |m| g.node(m).outputs().iter().map(move |&o| (o, pos(i)))))
        .collect();
    for &(st, next) in &state {
        let (Some(&d), Some(slot)) = (def_step.get(&next), refs.get(&st).cloned()) else { continue };
        if view_of.contains_key(&next) || g.is_output(st) || last.get(&st).is_some_and(|&l| l > d) {
            continue;
        }
        if ty(next)? == (slot.dtype, slot.shape.clone()) {
            refs.insert(next, slot);
        }
    }
    for (i0, &n) in steps.iter().enumerate() {
        let node = g.node(n);
        let i = pos(i0);
        // What an output may be written over: a fused launch's external inputs (each element is
        // read before it is written), or an element-wise op's inputs.
        let over: Vec<ValueId> = match run_of.get(&i0) {
            Some(&r) => chains[r].1.clone(),
            None => node.inputs().iter().flatten().copied().collect(),
        };
        for (k, &o) in computed(n).flat_map(|m| g.node(m).outputs()).enumerate() {
            let o = written(o);
            if refs.contains_key(&o) || dropped.contains(&o) {
                continue;
            }
            let (d, s) = ty(o)?;
            let size = align_up((s.iter().product::<usize>() * d.size()) as u64, caps.align);
            let dies = if keep.contains(&o) { end } else { *last.get(&o).unwrap_or(&i) };
            // In place over an input that dies here, of the output's dtype and shape (a broadcast
            // input of the same aligned size would be overwritten while other elements still read
            // it), not an input slot.
            let reuse = (k == 0 && (run_of.contains_key(&i0) || crate::plan::elementwise(&node.op)))
                .then(|| {
                    let same = |v: &&ValueId| ty(**v).is_ok_and(|t| t == (d, s.clone()));
                    over.iter().filter(same).map(|&v| root(v)).find(|v| {
                        matches!(g.value(*v).def(), Def::Node(..))
                            && last.get(v) == Some(&i)
                            && !keep.contains(v)
                            && buffer_of.get(v).is_some_and(|&b| buffers[b].0 == size && buffers[b].2 == i)
                    })
                })
                .flatten();
            match reuse {
                Some(v) => {
                    let b = buffer_of[&v];
                    buffers[b].2 = dies;
                    buffer_of.insert(o, b);
                    holders[b].push((i, o));
                }
                None => {
                    buffer_of.insert(o, buffers.len());
                    buffers.push((size, i, dies));
                    holders.push(vec![(i, o)]);
                }
            }
        }
    }
    // ReLU masks ([`Launch::relu_mask`]): a Gemm launch whose Relu epilogue writes `Y`, and the
    // later product launches whose ReluGrad epilogue reads `Y`, share one buffer of bits, from the
    // forward launch to the last backward one.
    let mut relu_masks: Vec<(usize, Vec<usize>, String)> = Vec::new(); // buffer, shape, name
    let mut mask_of: HashMap<NodeId, usize> = HashMap::new();
    if library {
        let step_of: HashMap<NodeId, usize> = steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        // The Gemm whose Relu epilogue writes each value.
        let mut relu_of: HashMap<ValueId, NodeId> = HashMap::new();
        for (&u, &(y, e)) in &epilogues {
            if let (Op::Relu, Def::Node(p, 0)) = (&g.node(e).op, g.value(u).def()) {
                if matches!(g.node(*p).op, Op::Gemm(_)) && step_of.contains_key(p) {
                    relu_of.insert(y, *p);
                }
            }
        }
        let mut buffer_of_relu: HashMap<NodeId, usize> = HashMap::new();
        for (i, &n) in steps.iter().enumerate() {
            let e = g.node(n).outputs().first().and_then(|o| epilogues.get(o)).map(|&(_, e)| e);
            let Some(e) = e.filter(|&e| g.node(e).op == Op::ReluGrad) else { continue };
            let Some(&f) = epilogue_operands.get(&e).and_then(|y| relu_of.get(y)) else { continue };
            let Ok((_, shape)) = ty(g.node(f).outputs()[0]) else { continue };
            let &[rows, cols] = shape.as_slice() else { continue };
            let b = *buffer_of_relu.entry(f).or_insert_with(|| {
                let bytes = align_up(relu_mask_bytes(rows, cols), caps.align);
                buffers.push((bytes, pos(step_of[&f]), pos(i)));
                holders.push(Vec::new());
                let shape = relu_mask_shape(rows, cols);
                relu_masks.push((buffers.len() - 1, shape, format!("{}.relu_mask", label(f))));
                buffers.len() - 1
            });
            buffers[b].2 = buffers[b].2.max(pos(i));
            mask_of.insert(f, b);
            mask_of.insert(n, b);
        }
    }
    let (mut offsets, mut arena_bytes) = crate::plan::place_buffers(&buffers);
    // Lifetimes above count steps; a report counts launches (a fused run is one, at its end).
    let mut launch_at = Vec::with_capacity(steps.len() + 1);
    let mut launched = 0;
    for i in 0..steps.len() {
        launch_at.push(launched);
        launched += usize::from(pos(i) == i);
    }
    launch_at.push(launched);
    let at = |i: usize| launch_at[i.min(steps.len())];
    if let Some(n) = &nested {
        offsets.iter_mut().for_each(|o| *o += n.arena_base);
        arena_bytes += n.arena_base;
    }
    let arena_buffers = buffers
        .iter()
        .zip(&holders)
        .zip(&offsets)
        .map(|((&(bytes, first, last), vs), &offset)| {
            let values = vs
                .iter()
                .map(|&(i, v)| Ok((at(i), g.name(v).to_string(), ty(v)?.0, ty(v)?.1)))
                .collect::<Result<Vec<_>, RuntimeError>>()?;
            Ok(ArenaBuffer { offset, bytes, first: at(first), last: at(last), values })
        })
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    let mut arena_buffers = arena_buffers;
    let mut mask_ref: HashMap<usize, TensorRef> = HashMap::new();
    for (b, shape, name) in relu_masks {
        let r = TensorRef { region: Region::Arena, offset: offsets[b], dtype: DType::U8, shape };
        let first = arena_buffers[b].first;
        arena_buffers[b].values.push((first, name, DType::U8, r.shape.clone()));
        mask_ref.insert(b, r);
    }
    let place = |v: ValueId, refs: &HashMap<ValueId, TensorRef>| -> Result<TensorRef, RuntimeError> {
        let (dtype, shape) = ty(v)?;
        let r = root(v);
        if let Some(p) = refs.get(&r) {
            return Ok(TensorRef { dtype, shape, ..p.clone() });
        }
        let b = *buffer_of.get(&r).ok_or_else(|| internal(g, v, "has no place"))?;
        Ok(TensorRef { region: Region::Arena, offset: offsets[b], dtype, shape })
    };

    // 4. Launches.
    let mut launches = Vec::with_capacity(steps.len());
    for (i, &n) in steps.iter().enumerate() {
        if let Some(&r) = run_of.get(&i) {
            if pos(i) == i {
                let (chain, ins, outs) = &chains[r];
                let labels: Vec<&str> = chain.steps.iter().map(|s| s.node.as_str()).collect();
                let inputs = ins
                    .iter()
                    .map(|v| match widened.get(v) {
                        Some(&low) => place(low, &refs).map(Operand::Widened),
                        None => place(*v, &refs).map(Operand::Device),
                    })
                    .collect::<Result<_, _>>()?;
                let outputs = outs.iter().map(|&o| place(o, &refs)).collect::<Result<_, _>>()?;
                launches.push(Launch {
                    chain: Some(Box::new(chain.clone())),
                    ..Launch::new(labels.join(" + "), fused_marker(), inputs, outputs)
                });
            }
            continue;
        }
        let node = g.node(n);
        let operands = |n: NodeId| {
            let host = g.node(n).op.host_operands();
            g.node(n)
                .inputs()
                .iter()
                .enumerate()
                .map(|(slot, v)| match v {
                    None => Ok(Operand::Absent),
                    Some(v) if host.contains(&slot) => Ok(Operand::Host(known[v].clone())),
                    Some(v) if prologues.contains_key(v) => place(prologues[v].1[0], &refs).map(Operand::Device),
                    Some(v) => match (widened.get(v), transposed.get(v), permuted.get(v)) {
                        (Some(&low), _, _) => place(low, &refs).map(Operand::Widened),
                        (_, Some(&stored), _) => place(stored, &refs).map(Operand::Transposed),
                        (_, _, Some((stored, perm))) => {
                            place(*stored, &refs).map(|t| Operand::Permuted(t, perm.clone()))
                        }
                        _ => place(*v, &refs).map(Operand::Device),
                    },
                })
                .collect::<Result<Vec<_>, _>>()
        };
        let results =
            |n: NodeId| g.node(n).outputs().iter().map(|&o| place(written(o), &refs)).collect::<Result<Vec<_>, _>>();
        let inputs = operands(n)?;
        let outputs = results(n)?;
        let sibling = match siblings.get(&n) {
            Some(&r) => Some(Box::new(Launch::new(label(r), g.node(r).op.clone(), operands(r)?, results(r)?))),
            None => None,
        };
        let branches = if is_if(&node.op) {
            let b = opts.branches.and_then(|b| b.get(&n)).ok_or_else(|| RuntimeError::Unsupported {
                node: label(n),
                msg: "its branches were not decoded for lowering".into(),
            })?;
            let Some(Operand::Device(cond)) = inputs.first().cloned() else {
                return Err(RuntimeError::Node { node: label(n), msg: "If without a condition".into() });
            };
            // Both branches start past everything the program itself uses (only one runs).
            let captures: Vec<TensorRef> = inputs[1..]
                .iter()
                .filter_map(|o| match o {
                    Operand::Device(t) => Some(t.clone()),
                    _ => None,
                })
                .collect();
            let base = align_up(arena_bytes, caps.align);
            let mut lower_branch = |bg: &Graph, nested_b: &HashMap<NodeId, Branches>| {
                let sub = LowerOptions {
                    layout: Some(&state_layout),
                    variables: None,
                    branches: Some(nested_b),
                    unfused: opts.unfused,
                    bitwise: opts.bitwise,
                };
                let nest = Nested { arena_base: base, constants_base: constants_bytes, inputs: captures.clone() };
                let p = lower_in(bg, caps, sub, Some(nest))?;
                if p.outputs.len() != outputs.len() {
                    return Err(RuntimeError::Node {
                        node: label(n),
                        msg: format!("a branch has {} outputs, the If {}", p.outputs.len(), outputs.len()),
                    });
                }
                for ((_, o), want) in p.outputs.iter().zip(&outputs) {
                    if o.dtype != want.dtype || o.shape != want.shape {
                        return Err(RuntimeError::Node {
                            node: label(n),
                            msg: format!(
                                "a branch gives {}{:?} where the If declares {}{:?}",
                                o.dtype, o.shape, want.dtype, want.shape
                            ),
                        });
                    }
                }
                constants_bytes = p.constants_bytes;
                constants.extend(p.constants.iter().cloned());
                folded += p.folded;
                arena_bytes = arena_bytes.max(p.arena_bytes);
                Ok::<_, RuntimeError>(p)
            };
            let t = lower_branch(&b.then_graph, &b.then_nested)?;
            let e = lower_branch(&b.else_graph, &b.else_nested)?;
            Some(Box::new(IfLaunch {
                cond,
                then_launches: t.launches,
                then_outputs: t.outputs.into_iter().map(|(_, r)| r).collect(),
                else_launches: e.launches,
                else_outputs: e.outputs.into_iter().map(|(_, r)| r).collect(),
            }))
        } else {
            None
        };
        let epilogue_node = node.outputs().first().and_then(|o| epilogues.get(o)).map(|&(_, e)| e);
        let epilogue = epilogue_node.map(|e| g.node(e).op.clone());
        let epilogue_then = epilogue_node.and_then(|e| thens.get(&e)).map(|&r| g.node(r).op.clone());
        let epilogue_operand = epilogue_of(n).map(|v| place(v, &refs).map(Operand::Device)).transpose()?;
        // The outputs nothing reads or keeps (a device may skip them).
        let unread: Vec<usize> = (0..node.outputs().len())
            .filter(|&k| {
                let o = written(node.outputs()[k]);
                g.value(o).uses().is_empty() && !keep.contains(&root(o))
            })
            .collect();
        // The ReLU output through whose gradient input 0 is read.
        let relu_prologue = match node.input(0).and_then(|v| prologues.get(&v)) {
            Some(&(_, [_, y])) => Some(place(y, &refs).map(Operand::Device)?),
            None => None,
        };
        launches.push(Launch {
            node: label(n),
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
            relu_mask: mask_of.get(&n).map(|b| mask_ref[b].clone()),
            relu_prologue,
            unread,
        });
    }
    // Each launch's index after grouping (unfused: where it is), and past the last the end.
    let (launches, moved) = if fuse {
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
    let named = |vs: &[ValueId], refs: &HashMap<ValueId, TensorRef>| {
        vs.iter().map(|&v| Ok((g.name(v).to_string(), place(v, refs)?))).collect::<Result<Vec<_>, RuntimeError>>()
    };
    let state = state
        .iter()
        .map(|&(s, n)| Ok(StateSlot { name: g.name(s).to_string(), slot: place(s, &refs)?, next: place(n, &refs)? }))
        .collect::<Result<Vec<_>, RuntimeError>>()?;
    let total = arena_bytes.saturating_add(constants_bytes).saturating_add(state_layout.bytes);
    if nested.is_none() && total > caps.memory {
        return Err(RuntimeError::TooLarge(format!(
            "the program needs {total} bytes (activations {arena_bytes}, state {}, constants {constants_bytes}), \
             more than the {} bytes the {} device may hold",
            state_layout.bytes, caps.memory, caps.name
        )));
    }
    Ok(Program {
        align: caps.align,
        arena_bytes,
        constants_bytes,
        inputs: named(g.inputs(), &refs)?,
        outputs: named(g.outputs(), &refs)?,
        launches,
        constants,
        state_layout,
        state_init,
        state,
        host_reads,
        folded,
        views,
        widened: widened.len(),
        epilogues: epilogues.len() + thens.len(),
        prologues: prologues.len(),
        siblings: siblings.len(),
        transposed: transposed.len() + permuted.len(),
        fused: (runs.iter().map(Vec::len).sum(), runs.len()),
        grouped,
        buffers: arena_buffers,
    })
}

fn internal(g: &Graph, v: ValueId, what: &str) -> RuntimeError {
    RuntimeError::Internal(format!("lowering: `{}` {what}", g.name(v)))
}
