//! Reverse-mode differentiation of the typed forward graph.
//!
//! From the (scaled) loss backwards, in reverse topological order, every node with an output
//! gradient and an input that needs one gets its rule applied. Gradients have their value's dtype:
//! a low node's gradient is computed low, and the gradient of a Cast is a Cast back, so an FP32
//! master weight read through a Cast receives an FP32 gradient. A value read several times gets
//! the sum of its readers' gradients. Index, shape and mask inputs are never differentiated. A node
//! on the path from a parameter to the loss whose op has no rule is an error naming node and op.

use std::collections::BTreeMap;

use mpc_ir::ops::{
    AxisAttrs, CastAttrs, CumSumAttrs, GemmAttrs, PoolAttrs, ReshapeAttrs, ScatterElementsAttrs, SplitAttrs,
    TransposeAttrs,
};
use mpc_ir::{normalize_axis, DType, Graph, Kind, Node, NodeId, Op, ValueId};

use super::build::{fixed, Builder};
use super::differentiable::differentiable;
use super::low::{narrow_loss_grad, saved_low_copy};
use super::rules;
use crate::PassError;

mod elementwise;
mod movement;
mod nn;

/// The values that need a gradient, by value index: those on a path from a parameter to `loss`
/// through differentiable float inputs.
fn needed(g: &Graph, order: &[NodeId], params: &[ValueId], loss: ValueId) -> Vec<bool> {
    let n_values = g.value_bound();
    // An output of unknown dtype (an opaque op's) may be float: it stays on the path, so that a
    // parameter behind it is an error naming the op, never silently left out of training.
    let float = |v: ValueId| g.ty(v).dtype.is_none_or(|d| d.is_float());
    let mut fwd = vec![false; n_values];
    for &p in params {
        fwd[p.index()] = true;
    }
    for &n in order {
        let node = g.node(n);
        let hit = node
            .inputs()
            .iter()
            .enumerate()
            .any(|(s, v)| v.is_some_and(|v| fwd[v.index()]) && differentiable(&node.op, s));
        if hit {
            for &o in node.outputs() {
                fwd[o.index()] |= float(o);
            }
        }
    }
    let mut back = vec![false; n_values];
    back[loss.index()] = true;
    for &n in order.iter().rev() {
        let node = g.node(n);
        if node.outputs().iter().any(|o| back[o.index()]) {
            for v in node.inputs().iter().flatten() {
                back[v.index()] = true;
            }
        }
    }
    fwd.iter().zip(back).map(|(&f, b)| f && b).collect()
}

/// Adds the backward graph of `loss` (seeded with `seed`, shaped like `loss`); returns the
/// gradient of each parameter, by parameter.
pub fn differentiate(
    g: &mut Graph,
    params: &[ValueId],
    loss: ValueId,
    seed: ValueId,
) -> Result<BTreeMap<ValueId, ValueId>, PassError> {
    Ok(differentiate_all(g, params, loss, seed)?.params)
}

/// What [`differentiate_all`] computed.
pub struct Gradients {
    /// Each parameter's gradient.
    pub params: BTreeMap<ValueId, ValueId>,
    /// Each forward activation (a node output on a parameter's path to the loss, the loss
    /// excepted) and its gradient: what the paper's histogram of activation gradients counts.
    pub activations: Vec<(ValueId, ValueId)>,
}

/// [`differentiate`], returning the activations' gradients too.
pub fn differentiate_all(
    g: &mut Graph,
    params: &[ValueId],
    loss: ValueId,
    seed: ValueId,
) -> Result<Gradients, PassError> {
    let order = g.topo_order()?;
    let need = needed(g, &order, params, loss);
    // An op mpc does not know, between a parameter and the loss, stops training before any rule
    // reads the types it left unknown.
    if let Some(&n) = order.iter().find(|&&n| {
        let node = g.node(n);
        node.op.is_opaque() && node.outputs().iter().any(|o| need[o.index()])
    }) {
        let op = &g.node(n).op;
        let name = match op.domain() {
            "" => op.op_type().to_string(),
            d => format!("{d}::{}", op.op_type()),
        };
        let msg = format!("op {name} has no gradient rule, and it lies between a parameter and the loss");
        return Err(PassError::Node { node: g.node_label(n), msg });
    }
    // Most rules add three to five nodes per differentiated node.
    g.reserve(4 * order.len(), 4 * g.value_bound());
    // The gradient contributions of each forward value, by value index.
    let mut contrib: Vec<Vec<ValueId>> = vec![Vec::new(); need.len()];
    contrib[loss.index()].push(seed);
    let mut b = Builder::new(g);
    let mut wants = Vec::new();
    let mut activations = Vec::new();
    for &n in order.iter().rev() {
        let node = b.g.node(n);
        wants.clear();
        wants.extend(
            node.inputs()
                .iter()
                .enumerate()
                .map(|(s, v)| v.is_some_and(|v| need[v.index()]) && differentiable(&node.op, s)),
        );
        if !wants.iter().any(|&w| w) || !node.outputs().iter().any(|o| !contrib[o.index()].is_empty()) {
            continue;
        }
        let outs = node.outputs().to_vec();
        let dys: Vec<Option<ValueId>> = outs.iter().map(|o| total(&mut b, &mut contrib, *o)).collect();
        activations.extend(outs.iter().zip(&dys).filter(|(&o, _)| o != loss).filter_map(|(&o, dy)| Some((o, (*dy)?))));
        let node = b.g.node(n);
        let base = if node.name.is_empty() { b.g.name(outs[0]) } else { &node.name };
        let base = format!("{base}.grad");
        b.at(&base);
        let grads = rule(&mut b, n, &dys, &wants).map_err(|msg| PassError::Node { node: b.g.node_label(n), msg })?;
        for (slot, dx) in grads.into_iter().enumerate() {
            if let (Some(dx), Some(Some(x)), true) =
                (dx, b.g.node(n).inputs().get(slot), wants.get(slot) == Some(&true))
            {
                contrib[x.index()].push(dx);
            }
        }
    }
    let mut out = BTreeMap::new();
    for &p in params {
        if let Some(d) = total(&mut b, &mut contrib, p) {
            let name = format!("{}.grad", b.g.name(p));
            let name = b.g.unique_name(&name);
            b.g.rename(d, &name);
            out.insert(p, d);
        }
    }
    Ok(Gradients { params: out, activations })
}

/// The summed gradient of `v` (its readers' contributions), `None` when nothing flows into it.
/// Values created during differentiation have no entry and no contributions.
fn total(b: &mut Builder, contrib: &mut [Vec<ValueId>], v: ValueId) -> Option<ValueId> {
    let parts = contrib.get_mut(v.index()).filter(|p| !p.is_empty())?;
    if parts.len() > 1 {
        b.at(&format!("{}.grad", b.g.name(v)));
        let ins: Vec<Option<ValueId>> = parts.iter().map(|&p| Some(p)).collect();
        let d = b.ops("sum", Op::Sum, &ins, 1)[0];
        *parts = vec![d];
    }
    Some(parts[0])
}

/// What a gradient rule reads of its node: the node, its first output, the output gradients and
/// the first one's dtype, and which inputs need a gradient.
#[derive(Clone, Copy)]
pub(super) struct At<'n> {
    node: &'n Node,
    y: ValueId,
    dy: ValueId,
    dt: DType,
    wants: &'n [bool],
    dys: &'n [Option<ValueId>],
}

impl At<'_> {
    fn x(&self, i: usize) -> Result<ValueId, String> {
        self.node.input(i).ok_or_else(|| format!("input {i} is missing"))
    }

    fn want(&self, i: usize) -> bool {
        self.wants.get(i).copied().unwrap_or(false)
    }
}

/// The input gradients a rule makes (`None` for inputs no gradient flows into).
type Rule = Result<Vec<Option<ValueId>>, String>;

fn no_rule(op: &Op) -> String {
    match op {
        Op::Opaque(o) if !o.domain.is_empty() => format!("op {}::{} has no gradient rule", o.domain, o.op_type),
        op => format!("op {} has no gradient rule", op.op_type()),
    }
}

/// Input gradients of node `n` given its output gradients (`None` for outputs nothing reads), by
/// the rules of its family.
fn rule(b: &mut Builder, n: NodeId, dys: &[Option<ValueId>], wants: &[bool]) -> Rule {
    let node = b.g.node(n).clone();
    let op = &node.op;
    let y = node.outputs()[0];
    let dy = match dys.first().copied().flatten() {
        Some(d) => d,
        None if matches!(op, Op::Split(_)) => dys.iter().flatten().copied().next().ok_or("no output gradient")?,
        None => return Err("only the first output of this op can be differentiated".into()),
    };
    if dys.iter().skip(1).any(|d| d.is_some()) && !matches!(op, Op::Split(_)) {
        return Err(format!("{} has a gradient flowing into an output other than the first", op.op_type()));
    }
    let dt = b.dtype(y).unwrap_or(DType::F32);
    let at = At { node: &node, y, dy, dt, wants, dys };
    match op.kind() {
        Kind::Unary(_) => elementwise::unary(b, &at),
        Kind::Arith(_) => elementwise::arith(b, &at),
        Kind::Variadic | Kind::Select | Kind::Cast => elementwise::select(b, &at),
        Kind::MatMul => nn::matmul(b, &at),
        Kind::Conv | Kind::Attention | Kind::Norm | Kind::RowWise | Kind::Loss => nn::layer(b, &at),
        Kind::Reduce(_) | Kind::Pool | Kind::Scan => nn::reduce(b, &at),
        Kind::View | Kind::Movement => movement::movement(b, &at),
        Kind::Index | Kind::Random => movement::index(b, &at),
        _ => Err(no_rule(op)),
    }
}
