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
use mpc_ir::{normalize_axis, DType, Graph, NodeId, Op, ValueId};

use super::build::{fixed, Builder};
use super::differentiable::differentiable;
use super::low::{narrow_loss_grad, saved_low_copy};
use super::rules;
use crate::PassError;

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

/// Input gradients of node `n` given its output gradients (`None` for outputs nothing reads).
fn rule(b: &mut Builder, n: NodeId, dys: &[Option<ValueId>], wants: &[bool]) -> Result<Vec<Option<ValueId>>, String> {
    let node = b.g.node(n).clone();
    let op = &node.op;
    let x = |i: usize| node.input(i).ok_or_else(|| format!("input {i} is missing"));
    let y = node.outputs()[0];
    let want = |i: usize| wants.get(i).copied().unwrap_or(false);
    let dy = match dys.first().copied().flatten() {
        Some(d) => d,
        None if matches!(op, Op::Split(_)) => dys.iter().flatten().copied().next().ok_or("no output gradient")?,
        None => return Err("only the first output of this op can be differentiated".into()),
    };
    if dys.iter().skip(1).any(|d| d.is_some()) && !matches!(op, Op::Split(_)) {
        return Err(format!("{} has a gradient flowing into an output other than the first", op.op_type()));
    }
    let dt = b.dtype(y).unwrap_or(DType::F32);
    Ok(match &op {
        // d/dx x = 1 (Dropout in inference mode is the identity).
        Op::Identity => vec![Some(dy)],
        Op::Dropout(_) => {
            if super::dropout_trains(b.g, &node) {
                return Err("Dropout in training mode needs its mask: the training pipeline's train-mode pass \
                            makes it an ai.mpc::SeededDropout"
                    .into());
            }
            vec![Some(dy)]
        }
        // d/dx (x · mask / (1 - ratio)) = mask / (1 - ratio): where(mask, dy / (1 - ratio), 0).
        Op::SeededDropout(_) => {
            let ratio = match node.input(1) {
                None => 0.5,
                Some(r) => {
                    b.g.constant(r)
                        .and_then(|t| t.to_f64_vec().first().copied())
                        .ok_or("the dropout ratio must be a constant to differentiate")?
                }
            };
            let mask = *node.outputs().get(1).ok_or("the mask output is missing")?;
            let scale = b.scalar(1.0 / (1.0 - ratio), dt);
            let zero = b.scalar(0.0, dt);
            let scaled = b.op("scale", Op::Mul, &[dy, scale]);
            vec![Some(b.op("where", Op::Where, &[mask, scaled, zero]))]
        }
        // d/dx cast(x) = cast back to x's dtype.
        Op::Cast(_) => {
            let to = b.dtype(x(0)?)?;
            if let Some(d) = narrow_loss_grad(b, x(0)?, y, dy) {
                return Ok(vec![Some(d)]);
            }
            vec![Some(b.op("cast", Op::Cast(CastAttrs { to, ..Default::default() }), &[dy]))]
        }
        // d(a+b) = da + db, summed over broadcast axes.
        Op::Add | Op::Sub => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) { Some(b.unbroadcast(dy, a, y)?) } else { None };
            let db = if want(1) {
                let d = if matches!(op, Op::Sub) { b.op("neg", Op::Neg, &[dy]) } else { dy };
                Some(b.unbroadcast(d, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d Σxᵢ = dy for every input (÷ n for the mean), summed over its broadcast axes.
        Op::Sum | Op::Mean => {
            let n = node.inputs().len();
            let d = if matches!(op, Op::Mean) && n > 1 {
                let k = b.scalar(n as f64, dt);
                b.op("div", Op::Div, &[dy, k])
            } else {
                dy
            };
            let mut grads = Vec::with_capacity(n);
            for i in 0..n {
                grads.push(if want(i) { Some(b.unbroadcast(d, x(i)?, y)?) } else { None });
            }
            grads
        }
        // d max(x₁, …, xₙ): dy goes to the inputs equal to the result, split equally between tied
        // ones (torch.maximum's convention), summed over broadcast axes; likewise for min.
        Op::Max | Op::Min => rules::extremum(b, &node, dy, wants)?,
        // d(a mod b) = da − q·db, q = (a − y)/b the whole quotient (floored, or truncated for fmod).
        Op::Mod(_) => {
            let (a0, c) = (x(0)?, x(1)?);
            let da = if want(0) { Some(b.unbroadcast(dy, a0, y)?) } else { None };
            let dc = if want(1) {
                let q = b.op("sub", Op::Sub, &[a0, y]);
                let q = b.op("div", Op::Div, &[q, c]);
                let q = b.op("round", Op::Round, &[q]);
                let t = b.op("mul", Op::Mul, &[dy, q]);
                let t = b.op("neg", Op::Neg, &[t]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, dc]
        }
        // d(a·b) = b·da + a·db.
        Op::Mul => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) {
                let t = b.op("mul", Op::Mul, &[dy, c]);
                Some(b.unbroadcast(t, a, y)?)
            } else {
                None
            };
            let db = if want(1) {
                let t = b.op("mul", Op::Mul, &[dy, a]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d(a/b) = da/b − (a/b)·db/b.
        Op::Div => {
            let (a, c) = (x(0)?, x(1)?);
            let da = if want(0) {
                let t = b.op("div", Op::Div, &[dy, c]);
                Some(b.unbroadcast(t, a, y)?)
            } else {
                None
            };
            let db = if want(1) {
                let q = b.op("div", Op::Div, &[y, c]);
                let t = b.op("mul", Op::Mul, &[dy, q]);
                let t = b.op("neg", Op::Neg, &[t]);
                Some(b.unbroadcast(t, c, y)?)
            } else {
                None
            };
            vec![da, db]
        }
        // d(a^p) = p·a^(p−1)·da + a^p·ln(a)·dp.
        Op::Pow => {
            let (a, p) = (x(0)?, x(1)?);
            let da = if want(0) {
                let one = b.scalar(1.0, b.dtype(p)?);
                let pm1 = b.op("sub", Op::Sub, &[p, one]);
                let t = b.op("pow", Op::Pow, &[a, pm1]);
                let t = b.op("mul", Op::Mul, &[t, p]);
                let t = b.op("mul", Op::Mul, &[dy, t]);
                Some(b.unbroadcast(t, a, y)?)
            } else {
                None
            };
            let dp = if want(1) {
                let l = b.op("log", Op::Log, &[a]);
                let t = b.op("mul", Op::Mul, &[y, l]);
                let t = b.op("mul", Op::Mul, &[dy, t]);
                Some(b.unbroadcast(t, p, y)?)
            } else {
                None
            };
            vec![da, dp]
        }
        // d√x = dx / (2√x).
        Op::Sqrt => {
            let half = b.scalar(0.5, dt);
            let t = b.op("mul", Op::Mul, &[dy, half]);
            vec![Some(b.op("div", Op::Div, &[t, y]))]
        }
        // d eˣ = eˣ dx.
        Op::Exp => vec![Some(b.op("mul", Op::Mul, &[dy, y]))],
        // d ln x = dx / x.
        Op::Log => vec![Some(b.op("div", Op::Div, &[dy, x(0)?]))],
        // d(−x) = −dx.
        Op::Neg => vec![Some(b.op("neg", Op::Neg, &[dy]))],
        // d(1/x) = −dx / x² = −y² dx.
        Op::Reciprocal => {
            let t = b.op("mul", Op::Mul, &[y, y]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("neg", Op::Neg, &[t]))]
        }
        // d|x| = sign(x) dx.
        Op::Abs => {
            let s = b.op("sign", Op::Sign, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, s]))]
        }
        // d relu(x) = [y > 0] dx, in ai.mpc::ReluGrad.
        Op::Relu => vec![Some(b.op("relu", Op::ReluGrad, &[dy, y]))],
        // d leaky(x) = (x > 0 ? 1 : α) dx.
        Op::LeakyRelu(a) => {
            let (zero, alpha) = (b.scalar(0.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let s = b.op("mul", Op::Mul, &[dy, alpha]);
            vec![Some(b.op("where", Op::Where, &[m, dy, s]))]
        }
        // d prelu(x, s) = (x < 0 ? s : 1) dx + (x < 0 ? x : 0) ds, summed over broadcast axes.
        Op::PRelu => {
            let (x0, s) = (x(0)?, x(1)?);
            let zero = b.scalar(0.0, dt);
            let m = b.op("mask", Op::Less, &[x0, zero]);
            let dx = if want(0) {
                let t = b.op("mul", Op::Mul, &[dy, s]);
                let t = b.op("where", Op::Where, &[m, t, dy]);
                Some(b.unbroadcast(t, x0, y)?)
            } else {
                None
            };
            let ds = if want(1) {
                let t = b.op("mul", Op::Mul, &[dy, x0]);
                let t = b.op("where", Op::Where, &[m, t, zero]);
                Some(b.unbroadcast(t, s, y)?)
            } else {
                None
            };
            vec![dx, ds]
        }
        // d elu(x) = (x > 0 ? 1 : α·eˣ = y + α) dx.
        Op::Elu(a) => {
            let (zero, alpha) = (b.scalar(0.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let t = b.op("add", Op::Add, &[y, alpha]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, dy, t]))]
        }
        // d celu(x) = (x > 0 ? 1 : e^(x/α) = y/α + 1) dx.
        Op::Celu(a) => {
            let (zero, one, alpha) = (b.scalar(0.0, dt), b.scalar(1.0, dt), b.scalar(a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let t = b.op("div", Op::Div, &[y, alpha]);
            let t = b.op("add", Op::Add, &[t, one]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, dy, t]))]
        }
        // d selu(x) = (x > 0 ? γ : γ·α·eˣ = y + γ·α) dx.
        Op::Selu(a) => {
            let zero = b.scalar(0.0, dt);
            let (g, ga) = (b.scalar(a.gamma as f64, dt), b.scalar(a.gamma as f64 * a.alpha as f64, dt));
            let m = b.op("mask", Op::Greater, &[x(0)?, zero]);
            let pos = b.op("mul", Op::Mul, &[dy, g]);
            let t = b.op("add", Op::Add, &[y, ga]);
            let neg = b.op("mul", Op::Mul, &[dy, t]);
            vec![Some(b.op("where", Op::Where, &[m, pos, neg]))]
        }
        // d hardsigmoid(x) = (0 < y < 1 ? α : 0) dx.
        Op::HardSigmoid(a) => {
            let (zero, one, alpha) = (b.scalar(0.0, dt), b.scalar(1.0, dt), b.scalar(a.alpha as f64, dt));
            let lo = b.op("above", Op::Greater, &[y, zero]);
            let hi = b.op("below", Op::Less, &[y, one]);
            let m = b.op("mask", Op::And, &[lo, hi]);
            let t = b.op("mul", Op::Mul, &[dy, alpha]);
            vec![Some(b.op("where", Op::Where, &[m, t, zero]))]
        }
        // d hardswish(x) = (x < −3 ? 0 : x > 3 ? 1 : (2x + 3)/6) dx (PyTorch's choice at the kinks).
        Op::HardSwish => {
            let x0 = x(0)?;
            let (zero, third, half) = (b.scalar(0.0, dt), b.scalar(1.0 / 3.0, dt), b.scalar(0.5, dt));
            let (m3, p3) = (b.scalar(-3.0, dt), b.scalar(3.0, dt));
            let lo = b.op("below", Op::Less, &[x0, m3]);
            let hi = b.op("above", Op::Greater, &[x0, p3]);
            let t = b.op("mul", Op::Mul, &[x0, third]);
            let t = b.op("add", Op::Add, &[t, half]);
            let t = b.op("mul", Op::Mul, &[dy, t]);
            let t = b.op("where", Op::Where, &[hi, dy, t]);
            vec![Some(b.op("where", Op::Where, &[lo, zero, t]))]
        }
        // d softplus(x) = σ(x) dx.
        Op::Softplus => {
            let s = b.op("sigmoid", Op::Sigmoid, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, s]))]
        }
        // d softsign(x) = dx / (1 + |x|)².
        Op::Softsign => {
            let one = b.scalar(1.0, dt);
            let t = b.op("abs", Op::Abs, &[x(0)?]);
            let t = b.op("add", Op::Add, &[t, one]);
            let t = b.op("mul", Op::Mul, &[t, t]);
            vec![Some(b.op("div", Op::Div, &[dy, t]))]
        }
        op if op.trig().is_some() => vec![Some(rules::trig(b, op.trig().unwrap(), x(0)?, y, dy)?)],
        // d sin x = cos x dx.
        Op::Sin => {
            let c = b.op("cos", Op::Cos, &[x(0)?]);
            vec![Some(b.op("mul", Op::Mul, &[dy, c]))]
        }
        // d cos x = −sin x dx.
        Op::Cos => {
            let s = b.op("sin", Op::Sin, &[x(0)?]);
            let t = b.op("mul", Op::Mul, &[dy, s]);
            vec![Some(b.op("neg", Op::Neg, &[t]))]
        }
        // d clip(x, lo, hi) = (lo ≤ x ≤ hi ? 1 : 0) dx (PyTorch's clamp: the bounds pass the gradient).
        Op::Clip => {
            let x0 = x(0)?;
            let lo = node.input(1).map(|v| b.op("above", Op::GreaterOrEqual, &[x0, v]));
            let hi = node.input(2).map(|v| b.op("below", Op::LessOrEqual, &[x0, v]));
            let m = match (lo, hi) {
                (Some(l), Some(h)) => b.op("mask", Op::And, &[l, h]),
                (Some(m), None) | (None, Some(m)) => m,
                (None, None) => return Ok(vec![Some(dy)]),
            };
            let zero = b.scalar(0.0, dt);
            vec![Some(b.op("where", Op::Where, &[m, dy, zero]))]
        }
        // d σ(x) = σ(x)(1 − σ(x)) dx.
        Op::Sigmoid => {
            let one = b.scalar(1.0, dt);
            let t = b.op("sub", Op::Sub, &[one, y]);
            let t = b.op("mul", Op::Mul, &[y, t]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        // d tanh(x) = (1 − tanh²(x)) dx.
        Op::Tanh => {
            let one = b.scalar(1.0, dt);
            let t = b.op("mul", Op::Mul, &[y, y]);
            let t = b.op("sub", Op::Sub, &[one, t]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        // d erf(x) = 2/√π · e^(−x²) dx.
        Op::Erf => {
            let x0 = x(0)?;
            let k = b.scalar(2.0 / std::f64::consts::PI.sqrt(), dt);
            let t = b.op("mul", Op::Mul, &[x0, x0]);
            let t = b.op("neg", Op::Neg, &[t]);
            let t = b.op("exp", Op::Exp, &[t]);
            let t = b.op("mul", Op::Mul, &[t, k]);
            vec![Some(b.op("mul", Op::Mul, &[dy, t]))]
        }
        // d gelu(x) = (Φ(x) + x·φ(x)) dx (tanh form: its own derivative), in ai.mpc::GeluGrad.
        Op::Gelu(a) => vec![Some(b.op("gelu", Op::GeluGrad(Box::new(a.clone())), &[dy, x(0)?]))],
        // d softmax: dx = y ⊙ (dy − Σ_axis dy ⊙ y), in ai.mpc::SoftmaxGrad.
        Op::Softmax(a) => {
            let y = saved_low_copy(b, y).unwrap_or(y);
            vec![Some(b.op("softmax", Op::SoftmaxGrad(Box::new(a.clone())), &[dy, y]))]
        }
        // Fused attention: ai.mpc::AttentionGrad recomputes the probabilities from Q, K, the mask
        // and the saved log-sum-exp, so none is kept between the passes.
        Op::Attention(a) => {
            if want(3) {
                return Err(
                    "the mask of a fused Attention depends on parameters, and its gradient is not computed".into()
                );
            }
            let lse = *node.outputs().get(1).ok_or("the log-sum-exp output is missing")?;
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?), Some(x(2)?), Some(y), Some(lse)];
            ins.extend(node.input(3).map(Some));
            let outs = b.ops("attention", Op::AttentionGrad(a.clone()), &ins, 3);
            (0..3).map(|i| want(i).then_some(outs[i])).collect()
        }
        // d logsoftmax: dx = dy − e^y ⊙ Σ_axis dy.
        Op::LogSoftmax(a) => {
            let s = b.reduce_sum(dy, &[a.axis], true);
            let e = b.op("exp", Op::Exp, &[y]);
            let t = b.op("mul", Op::Mul, &[e, s]);
            vec![Some(b.op("sub", Op::Sub, &[dy, t]))]
        }
        // d(A·B) = dY·Bᵀ, Aᵀ·dY, summed over broadcast batch axes.
        Op::MatMul => {
            let (a, c) = (x(0)?, x(1)?);
            let (ra, rc) = (b.shape(a)?.rank(), b.shape(c)?.rank());
            if ra < 2 || rc < 2 {
                return Err("MatMul with a 1-D operand cannot be differentiated yet".into());
            }
            let ry = b.shape(y)?.rank();
            // Plain 2-D products take their transposes as Gemm flags, not as Transpose nodes.
            let gemm = |ta: bool, tb: bool| Op::Gemm(GemmAttrs { alpha: 1.0, beta: 0.0, transA: ta, transB: tb });
            let da = if !want(0) {
                None
            } else if ra == 2 && rc == 2 {
                Some(b.op("gemm", gemm(false, true), &[dy, c]))
            } else if rc == 2 {
                // A weight shared by every row: dY's rows times Bᵀ as one GEMM with B transposed
                // by the flag, not by a Transpose of the weight each step; then A's shape.
                let nn = fixed(&b.shape(y)?.dims()[ry - 1], "the output dimension")?;
                let sn = b.ints(&[-1, nn]);
                let d2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, sn]);
                let t = b.op("gemm", gemm(false, true), &[d2, c]);
                let sa = b.op("shape", Op::Shape(Default::default()), &[a]);
                Some(b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[t, sa]))
            } else {
                let ct = b.transpose_last(c, rc);
                let t = b.op("matmul", Op::MatMul, &[dy, ct]);
                Some(b.unbroadcast(t, a, y)?)
            };
            let dc = if want(1) {
                if ra == 2 && rc == 2 {
                    Some(b.op("gemm", gemm(true, false), &[a, dy]))
                } else if rc == 2 && ra > 2 {
                    // A weight shared by every row: flatten the batch into the rows, one GEMM.
                    let k = fixed(&b.shape(a)?.dims()[ra - 1], "the inner dimension")?;
                    let nn = fixed(&b.shape(y)?.dims()[ry - 1], "the output dimension")?;
                    let (sk, sn) = (b.ints(&[-1, k]), b.ints(&[-1, nn]));
                    let a2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[a, sk]);
                    let d2 = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, sn]);
                    Some(b.op("gemm", gemm(true, false), &[a2, d2]))
                } else {
                    let at = b.transpose_last(a, ra);
                    let t = b.op("matmul", Op::MatMul, &[at, dy]);
                    Some(b.unbroadcast(t, c, y)?)
                }
            } else {
                None
            };
            vec![da, dc]
        }
        // Y = α·op(A)·op(B) + β·C: dA, dB are Gemms of dY with the other operand, dC = β·ΣdY.
        Op::Gemm(a) => {
            let (ta, tb) = (a.transA, a.transB);
            let gemm = |ta: bool, tb: bool| Op::Gemm(GemmAttrs { alpha: a.alpha, beta: 0.0, transA: ta, transB: tb });
            let da = if want(0) {
                let v = if ta {
                    b.op("gemm", gemm(tb, true), &[x(1)?, dy])
                } else {
                    b.op("gemm", gemm(false, !tb), &[dy, x(1)?])
                };
                Some(v)
            } else {
                None
            };
            let db = if want(1) {
                let v = if tb {
                    b.op("gemm", gemm(true, ta), &[dy, x(0)?])
                } else {
                    b.op("gemm", gemm(!ta, false), &[x(0)?, dy])
                };
                Some(v)
            } else {
                None
            };
            let dc = match node.input(2) {
                Some(c) if want(2) => {
                    let t = if a.beta == 1.0 {
                        dy
                    } else {
                        let k = b.scalar(a.beta as f64, dt);
                        b.op("mul", Op::Mul, &[dy, k])
                    };
                    Some(b.unbroadcast(t, c, y)?)
                }
                _ => None,
            };
            vec![da, db, dc]
        }
        // dX = ConvTranspose(dY, W), dW = correlation of X with dY, dB = ΣdY: ai.mpc::ConvGrad,
        // without its dB output where the Conv has no bias (no pass over dY for a sum no one
        // reads: ResNet's convolutions, each before a batch norm).
        Op::Conv(a) => {
            let n = if node.input(2).is_some() { 3 } else { 2 };
            let outs = b.ops("conv", Op::ConvGrad(a.clone()), &[Some(dy), Some(x(0)?), Some(x(1)?)], n);
            vec![Some(outs[0]), Some(outs[1]), node.input(2).map(|_| outs[2])]
        }
        // The adjoint of Conv: dX = Conv(dY, W), dW through ai.mpc::ConvGrad, dB = ΣdY.
        Op::ConvTranspose(a) => rules::conv_transpose(b, &node, a, dy, wants)?,
        // Batch statistics: dX = (γ/σ)/N · (N·dY − ΣdY − x̂·Σ(dY·x̂)), dγ = Σ dY·x̂, dβ = ΣdY.
        Op::BatchNormalization(a) => {
            if !a.training_mode {
                return Err("BatchNormalization in inference mode (training_mode=0) has no batch statistics to \
                            differentiate: the training pipeline's train-mode pass switches it to training mode"
                    .into());
            }
            let eps = mpc_ir::ops::EpsilonAttrs { epsilon: a.epsilon };
            let outs = b.ops("bn", Op::BatchNormalizationGrad(Box::new(eps)), &[Some(dy), Some(x(0)?), Some(x(1)?)], 3);
            vec![Some(outs[0]), Some(outs[1]), Some(outs[2])]
        }
        // Per row: dX = (1/σ)/n · (n·ĝ − Σĝ − x̂·Σ(ĝ·x̂)) with ĝ = γ·dY; dγ = Σ dY·x̂; dβ = ΣdY.
        Op::LayerNormalization(a) => {
            let outs =
                b.ops("ln", Op::LayerNormalizationGrad(Box::new(a.clone())), &[Some(dy), Some(x(0)?), Some(x(1)?)], 3);
            vec![Some(outs[0]), Some(outs[1]), node.input(2).map(|_| outs[2])]
        }
        // dX = Tᵀ·dY along each resized axis, T its taps (a nearest upscale's blocks summed back).
        Op::Resize(a) => vec![Some(rules::resize(b, &node, a, dy)?)],
        // dX = LayerNormalizationGrad per instance or group of γ·dY, dγ = Σ dY·x̂, dβ = ΣdY.
        Op::InstanceNormalization(a) => rules::channel_norm(b, &node, dy, wants, a.epsilon, None)?,
        Op::GroupNormalization(a) => rules::channel_norm(b, &node, dy, wants, a.epsilon, Some(a.num_groups))?,
        // Shape-only ops: the gradient takes the input's shape back.
        Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze | Op::Unsqueeze => {
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, s]))]
        }
        // d transpose(x, p) = transpose(dy, p⁻¹).
        Op::Transpose(a) => {
            let r = b.shape(x(0)?)?.rank();
            let perm: Vec<usize> = match &a.perm {
                Some(p) => p.iter().map(|&d| normalize_axis(d, r).ok_or("bad perm")).collect::<Result<_, _>>()?,
                None => (0..r).rev().collect(),
            };
            let mut inv = vec![0i64; r];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i as i64;
            }
            vec![Some(b.op("transpose", Op::Transpose(TransposeAttrs { perm: Some(inv) }), &[dy]))]
        }
        // d concat = split of dy at the inputs' sizes.
        Op::Concat(a) => {
            let r = b.shape(y)?.rank();
            let ax = normalize_axis(a.axis, r).ok_or("bad axis")?;
            let parts: Vec<ValueId> = node.inputs().iter().flatten().copied().collect();
            let fixed_sizes: Option<Vec<i64>> = parts
                .iter()
                .map(|&v| Ok(b.shape(v)?.dims()[ax].fixed().map(|d| d as i64)))
                .collect::<Result<Vec<_>, String>>()?
                .into_iter()
                .collect();
            let s = match fixed_sizes {
                Some(sizes) => b.ints(&sizes),
                // Symbolic lengths (a sequence): split by the inputs' own sizes, from their shapes.
                None => {
                    let at = b.ints(&[ax as i64]);
                    let each: Vec<Option<ValueId>> = parts
                        .iter()
                        .map(|&v| {
                            let shape = b.shape_of(v);
                            Some(b.op("len", Op::Gather(AxisAttrs { axis: 0 }), &[shape, at]))
                        })
                        .collect();
                    b.ops("sizes", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &each, 1)[0]
                }
            };
            let split = Op::Split(SplitAttrs { axis: ax as i64, num_outputs: None });
            b.ops("split", split, &[Some(dy), Some(s)], parts.len()).into_iter().map(Some).collect()
        }
        // d split = concat of the outputs' gradients (zeros for outputs nothing reads).
        Op::Split(a) => {
            let mut parts = Vec::new();
            for (i, &o) in node.outputs().iter().enumerate() {
                parts.push(Some(match dys.get(i).copied().flatten() {
                    Some(d) => d,
                    None => b.zeros_like(o)?,
                }));
            }
            vec![Some(b.ops("concat", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: a.axis }), &parts, 1)[0])]
        }
        // d slice = dy padded back to the input's extent (unit steps).
        // d slice = dy padded back to x's shape with zeros (steps of 1); see `rules::slice`.
        Op::Slice => vec![Some(rules::slice(b, &node, dy)?)],
        // Embedding: the rows of dy are added at their indices (ai.mpc::GatherGrad).
        Op::Gather(a) => {
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("scatter", Op::GatherGrad(Box::new(AxisAttrs { axis: a.axis })), &[dy, x(1)?, s]))]
        }
        // d trilu(x, k) = trilu(dy, k): the kept triangle passes dy, the rest nothing.
        Op::Trilu(a) => {
            let mut ins = vec![Some(dy)];
            ins.extend(node.input(1).map(Some));
            vec![Some(b.ops("trilu", Op::Trilu(a.clone()), &ins, 1)[0])]
        }
        // d einsum(…, Xᵢ, …)/dXᵢ = the einsum of dY with the other operands, into Xᵢ's labels.
        Op::Einsum(a) => rules::einsum(b, &node, &a.equation, dy, wants)?,
        // d expand = dy summed over the expanded axes.
        Op::Expand => vec![Some(b.unbroadcast(dy, x(0)?, y)?)],
        // d where(c, a, b) = (c ? dy : 0, c ? 0 : dy).
        Op::Where => {
            let c = x(0)?;
            let zero = b.scalar(0.0, dt);
            let da = if want(1) {
                let t = b.op("where", Op::Where, &[c, dy, zero]);
                Some(b.unbroadcast(t, x(1)?, y)?)
            } else {
                None
            };
            let db = if want(2) {
                let t = b.op("where", Op::Where, &[c, zero, dy]);
                Some(b.unbroadcast(t, x(2)?, y)?)
            } else {
                None
            };
            vec![None, da, db]
        }
        // The window's maximum receives dy (ai.mpc::MaxPoolGrad).
        Op::MaxPool(a) => vec![Some(b.op("maxpool", Op::MaxPoolGrad(a.clone()), &[dy, x(0)?]))],
        // The maximum of each plane receives dy: MaxPoolGrad over a window of the whole plane (the first
        // maximum at ties, as for MaxPool).
        Op::GlobalMaxPool => {
            let xs = b.shape(x(0)?)?;
            let kernel = xs.dims()[2..].iter().map(|d| fixed(d, "the pooled dims")).collect::<Result<_, _>>()?;
            let attrs = PoolAttrs { kernel_shape: kernel, ..Default::default() };
            vec![Some(b.op("maxpool", Op::MaxPoolGrad(Box::new(attrs)), &[dy, x(0)?]))]
        }
        // dy spread evenly over each window (ai.mpc::AveragePoolGrad).
        Op::AveragePool(a) => vec![Some(b.op("avgpool", Op::AveragePoolGrad(a.clone()), &[dy, x(0)?]))],
        // d mean over H·W = dy / (H·W), broadcast back.
        Op::GlobalAveragePool => {
            let xs = b.shape(x(0)?)?;
            let mut count = 1i64;
            for d in &xs.dims()[2..] {
                count *= fixed(d, "the pooled dims")?;
            }
            let k = b.scalar(count as f64, dt);
            let t = b.op("div", Op::Div, &[dy, k]);
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("expand", Op::Expand, &[t, s]))]
        }
        // d Σ = dy broadcast back over the reduced axes (÷ count for the mean).
        Op::ReduceSum(a) | Op::ReduceMean(a) => {
            let x0 = x(0)?;
            let xs = b.shape(x0)?;
            let Some(axes) = rules::reduced_axes(b, &node, a)? else { return Ok(vec![Some(dy)]) };
            let mut t = rules::keep(b, dy, &axes, a.keepdims);
            if matches!(op, Op::ReduceMean(_)) {
                let count: Option<i64> = axes.iter().map(|&ax| xs.dims()[ax].fixed().map(|d| d as i64)).product();
                let k = match count {
                    Some(c) => b.scalar(c as f64, dt),
                    // A symbolic dim (the batch): the count is size(x) / size(y) at run time.
                    None => {
                        let (nx, ny) = (b.op("size", Op::Size, &[x0]), b.op("size", Op::Size, &[y]));
                        let c = b.op("count", Op::Div, &[nx, ny]);
                        b.cast(c, dt)
                    }
                };
                t = b.op("div", Op::Div, &[t, k]);
            }
            let s = b.shape_of(x0);
            vec![Some(b.op("expand", Op::Expand, &[t, s]))]
        }
        // d max, min, Σx², Σ|x|, √Σx², log Σeˣ, Πx: each a function of x, y and dy at x's rank.
        op @ (mpc_ir::reduce_ops!()) => {
            let (_, a) = op.reduction().expect("a reduction");
            vec![Some(rules::reduce(b, &node, a, dy)?)]
        }
        // d cumsum(x) = the cumulative sum of dy the other way (exclusive stays exclusive).
        Op::CumSum(a) => {
            let back = Op::CumSum(CumSumAttrs { exclusive: a.exclusive, reverse: !a.reverse });
            vec![Some(b.op("cumsum", back, &[dy, x(1)?]))]
        }
        // d cumprod(x): each x_j's share of every later product, without dividing by x_j (which
        // may be 0): ai.mpc::CumProdGrad (docs/ai-mpc-ops.md).
        Op::CumProd(a) => vec![Some(b.op("cumprod_grad", Op::CumProdGrad(Box::new(a.clone())), &[dy, x(0)?, x(1)?]))],
        // d roi_align(x): each output's dy back to the corners its samples read, by their weights
        // (ai.mpc::RoiAlignGrad). The rois are positions, not trained (as in torchvision).
        Op::RoiAlign(a) => {
            let grad = Op::RoiAlignGrad(Box::new(a.clone()));
            vec![Some(b.op("roi_align_grad", grad, &[dy, x(0)?, x(1)?, x(2)?]))]
        }
        // d tile(x) = the sum of dy's copies.
        Op::Tile => vec![Some(rules::tile(b, &node, dy)?)],
        // d pad(x, p) = pad(dy, −p): what was added is cropped, what was cut comes back as zeros.
        Op::Pad(a) => vec![Some(rules::pad(b, &node, a, dy)?)],
        // dy added at each index's flat position (ai.mpc::GatherGrad over the flattened input).
        Op::GatherElements(a) => vec![Some(rules::gather_elements(b, &node, a, dy)?)],
        // d topk: dy scattered to the picked positions (distinct within each line), 0 elsewhere.
        Op::TopK(a) => {
            let z = b.zeros_like(x(0)?)?;
            let at = *node.outputs().get(1).ok_or("TopK's indices output is missing")?;
            let scatter = Op::ScatterElements(ScatterElementsAttrs { axis: a.axis, ..Default::default() });
            vec![Some(b.ops("topk_grad", scatter, &[Some(z), Some(at), Some(dy)], 1)[0])]
        }
        Op::GatherND(a) => vec![Some(rules::gather_nd(b, &node, a, dy)?)],
        Op::ScatterND(a) => rules::scatter(b, &node, Op::ScatterND(a.clone()), a.reduction, dy, wants)?,
        Op::ScatterElements(a) => rules::scatter(b, &node, Op::ScatterElements(a.clone()), a.reduction, dy, wants)?,
        // d lrn: dy·s^(−β) less the windowed term through the normaliser s.
        Op::LRN(a) => vec![Some(rules::lrn(b, &node, a, dy)?)],
        // d CE/d scores = (softmax(scores) − onehot(label)) · weight / N (ai.mpc::SoftmaxCrossEntropyLossGrad).
        Op::SoftmaxCrossEntropyLoss(a) => {
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?)];
            ins.extend(node.input(2).map(Some));
            vec![Some(b.ops("sce", Op::SoftmaxCrossEntropyLossGrad(Box::new(a.clone())), &ins, 1)[0])]
        }
        // d NLL/d input = −weight / N at the label, 0 elsewhere (ai.mpc::NegativeLogLikelihoodLossGrad).
        Op::NegativeLogLikelihoodLoss(a) => {
            let mut ins = vec![Some(dy), Some(x(0)?), Some(x(1)?)];
            ins.extend(node.input(2).map(Some));
            vec![Some(b.ops("nll", Op::NegativeLogLikelihoodLossGrad(Box::new(a.clone())), &ins, 1)[0])]
        }
        Op::Opaque(o) if !o.domain.is_empty() => {
            return Err(format!("op {}::{} has no gradient rule", o.domain, o.op_type))
        }
        other => return Err(format!("op {} has no gradient rule", other.op_type())),
    })
}
