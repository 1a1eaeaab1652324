//! Element-wise chains fused into one launch.
//!
//! Lowering finds runs of consecutive element-wise launches over one shape, each reading a value
//! the run made before it (a bias add and its activation; a Cast, a scale and a mask; a residual
//! add after a Cast), and makes each run one launch: a [`Chain`] of steps. A run may hold one
//! row-wise step, a Softmax, LogSoftmax or SoftmaxGrad over that shape: the steps before it are
//! computed as it reads its rows, the steps after it as it writes them (an attention's scale and
//! mask, its softmax and the Cast of the probabilities to f16 are one launch; so are the
//! softmax's gradient, the scale's and the Cast back to f16).
//! Values made inside the run and read nowhere else get no place in memory; the others are the
//! launch's outputs. Every step keeps its own rounding (a device computes each step as its
//! unfused kernel does and rounds the result to the step's dtype before the next reads it), so a
//! fused program computes the bits of the unfused one: the CPU device runs the steps one after
//! the other with the reference kernels, the CUDA device one generated kernel per chain.

use std::collections::{HashMap, HashSet};

use mpc_ir::geometry::broadcast_shape;
use mpc_ir::{DType, Graph, NodeId, Op, ValueId};

/// One step of a chain: an element-wise op over the chain's inputs and earlier steps' results.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainStep {
    /// The node it comes from (`"name" (Op)`).
    pub node: String,
    pub op: Op,
    pub args: Vec<ChainArg>,
    /// The dtype its result is rounded to (the node's output dtype).
    pub dtype: DType,
}

/// What a step reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChainArg {
    /// The launch's input `k` (broadcast to the chain's shape where it is smaller).
    Input(usize),
    /// The result of an earlier step.
    Step(usize),
}

/// A fused launch's steps, all over the shape of its outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct Chain {
    pub steps: Vec<ChainStep>,
    /// The step whose result each of the launch's outputs is.
    pub outputs: Vec<usize>,
}

impl Chain {
    /// `Fused(Cast+Mul+Add)`: what a profile calls the launch.
    pub fn kind(&self) -> String {
        let ops: Vec<&str> = self.steps.iter().map(|s| s.op.op_type()).collect();
        format!("Fused({})", ops.join("+"))
    }

    /// The row-wise step, if the chain has one.
    pub fn row_step(&self) -> Option<usize> {
        self.steps.iter().position(|s| row_wise(&s.op))
    }
}

/// The row-wise ops a run may hold (one of them).
pub fn row_wise(op: &Op) -> bool {
    matches!(op, Op::Softmax(_) | Op::LogSoftmax(_) | Op::SoftmaxGrad(_))
}

/// The ops a chain may hold: element-wise, with the same formula on every device
/// ([`Op::fusable`]).
pub fn fusable_op(op: &Op) -> bool {
    op.fusable()
}

fn chain_dtype(d: Option<DType>) -> bool {
    matches!(d, Some(DType::F32 | DType::F16 | DType::BF16))
}

/// The runs of `steps` (by index) to fuse, each at least two steps long. `shape` gives a value's
/// fixed shape, `root` the value whose buffer a value is (through views and widened casts), and
/// `also` the values a step's launch writes besides its node's outputs (an epilogue's result, a
/// sibling's).
pub(crate) fn runs(
    g: &Graph,
    steps: &[NodeId],
    shape: &dyn Fn(ValueId) -> Option<Vec<usize>>,
    root: &dyn Fn(ValueId) -> ValueId,
    also: &dyn Fn(NodeId) -> Vec<ValueId>,
) -> Vec<Vec<usize>> {
    let fusable = |n: NodeId| -> Option<Vec<usize>> {
        let node = g.node(n);
        let (&[o], true) = (node.outputs(), fusable_op(&node.op) || row_wise(&node.op)) else { return None };
        // A Sum of two (the gradients meeting at a residual block's input): an Add. More terms
        // would round once at the end, not after each add.
        if matches!(node.op, Op::Sum) && node.inputs().len() != 2 {
            return None;
        }
        if !chain_dtype(g.ty(o).dtype) || !node.op.host_operands().is_empty() {
            return None;
        }
        let full = shape(o).filter(|s| s.iter().product::<usize>() > 0 && s.len() <= 8)?;
        let ok = node.inputs().iter().all(|v| {
            v.is_some_and(|v| {
                chain_dtype(g.ty(v).dtype)
                    && shape(v).is_some_and(|s| broadcast_shape(&[&s, &full]).as_deref() == Some(&full[..]))
            })
        });
        ok.then_some(full)
    };
    // The step that makes each value, to tell which values a step further on reads.
    let def_at: HashMap<ValueId, usize> = steps
        .iter()
        .enumerate()
        .flat_map(|(i, &n)| g.node(n).outputs().iter().copied().chain(also(n)).map(move |o| (o, i)))
        .collect();
    let mut out = Vec::new();
    let mut run: Vec<usize> = Vec::new();
    let mut made: HashSet<ValueId> = HashSet::new();
    let mut run_shape: Vec<usize> = Vec::new();
    let mut has_row = false;
    let mut moved: HashSet<usize> = HashSet::new();
    // Whether step `n` joins the run: over its shape, reading a value it made (not through a
    // view, whose shape differs), and no second row-wise step.
    let joins = |n: NodeId, made: &HashSet<ValueId>, run_shape: &[usize], has_row: bool| {
        let ins = g.node(n).inputs().iter().flatten();
        fusable(n).is_some_and(|f| f == run_shape)
            && !(row_wise(&g.node(n).op) && has_row)
            && ins.clone().any(|v| made.contains(v))
            && ins.clone().all(|v| made.contains(v) || !made.contains(&root(*v)))
    };
    for (i, &n) in steps.iter().enumerate() {
        // A step an earlier run computes ends the current run and starts none.
        let taken = moved.contains(&i);
        let full = if taken { None } else { fusable(n) };
        let row = row_wise(&g.node(n).op);
        if taken || run.is_empty() || !joins(n, &made, &run_shape, has_row) {
            // Before the run ends: a step a little further on that reads what the run made and
            // nothing the steps in between make is computed in the run (its launch is the run's,
            // before those steps, which do not read its result: they come first in the order).
            if let Some(&end) = run.last() {
                for (k, &m) in steps.iter().enumerate().take(i + LOOK_AHEAD).skip(i + 1) {
                    // (A view's value is its source's, made where the source is.)
                    let ready =
                        g.node(m).inputs().iter().flatten().all(|&v| def_at.get(&root(v)).is_none_or(|&d| d <= end));
                    if !moved.contains(&k) && ready && joins(m, &made, &run_shape, has_row) {
                        run.push(k);
                        moved.insert(k);
                        has_row |= row_wise(&g.node(m).op);
                        made.extend(g.node(m).outputs().iter().copied());
                    }
                }
            }
            if run.len() >= 2 {
                out.push(std::mem::take(&mut run));
            }
            run.clear();
            made.clear();
            has_row = false;
            if let Some(f) = full {
                run_shape = f;
            } else {
                continue;
            }
        }
        run.push(i);
        has_row |= row;
        made.extend(g.node(n).outputs().iter().copied());
    }
    if run.len() >= 2 {
        out.push(run);
    }
    out
}

/// [`runs`] looks for a step to compute in a run among the steps within this many of its end.
const LOOK_AHEAD: usize = 4;

/// The step a run's launch takes the place of: the last of its consecutive steps (the steps
/// after a gap were moved into it from further on).
pub(crate) fn launch_at(run: &[usize]) -> usize {
    let mut at = run[0];
    for &i in &run[1..] {
        if i != at + 1 {
            break;
        }
        at = i;
    }
    at
}

/// The chain of `run` (step indices into `steps`), its external inputs in the order the steps
/// first read them, and the run's values that must be written: those `needed` says are read
/// past the run (or outlive it). The steps' args index those inputs.
pub(crate) fn chain(
    g: &Graph,
    steps: &[NodeId],
    run: &[usize],
    needed: &dyn Fn(ValueId) -> bool,
) -> (Chain, Vec<ValueId>, Vec<ValueId>) {
    let mut step_of: HashMap<ValueId, usize> = HashMap::new();
    let mut inputs: Vec<ValueId> = Vec::new();
    let mut chain_steps = Vec::with_capacity(run.len());
    for (k, &i) in run.iter().enumerate() {
        let node = g.node(steps[i]);
        let args = node
            .inputs()
            .iter()
            .flatten()
            .map(|&v| match step_of.get(&v) {
                Some(&s) => ChainArg::Step(s),
                None => {
                    let at = inputs.iter().position(|&x| x == v).unwrap_or_else(|| {
                        inputs.push(v);
                        inputs.len() - 1
                    });
                    ChainArg::Input(at)
                }
            })
            .collect();
        let o = node.outputs()[0];
        step_of.insert(o, k);
        let dtype = g.ty(o).dtype.expect("a fusable step has a float dtype");
        chain_steps.push(ChainStep { node: g.node_label(steps[i]), op: node.op.clone(), args, dtype });
    }
    let mut outputs = Vec::new();
    let mut values = Vec::new();
    for &i in run {
        let o = g.node(steps[i]).outputs()[0];
        if needed(o) {
            outputs.push(step_of[&o]);
            values.push(o);
        }
    }
    (Chain { steps: chain_steps, outputs }, inputs, values)
}
