//! Reverse-mode differentiation of the typed forward graph.
//!
//! From the (scaled) loss backwards, in reverse topological order, every node with an output
//! gradient and an input that needs one gets its rule applied. Gradients have their value's dtype:
//! a low node's gradient is computed low, and the gradient of a Cast is a Cast back, so an FP32
//! master weight read through a Cast receives an FP32 gradient. A value read several times gets
//! the sum of its readers' gradients. Index, shape and mask inputs are never differentiated. A node
//! on the path from a parameter to the loss whose op has no rule is an error naming node and op.

use std::collections::BTreeMap;

use mpc_ir::ops::{AxisAttrs, CastAttrs, GemmAttrs, ReshapeAttrs, SplitAttrs, TransposeAttrs};
use mpc_ir::{normalize_axis, DType, Dim, Graph, NodeId, Op, ValueId};

use super::build::Builder;
use crate::PassError;

/// The inputs of `op` that gradients flow into (the others are indices, shapes, masks or
/// statistics).
pub fn differentiable(op: &Op, slot: usize) -> bool {
    match op {
        Op::Reshape(_)
        | Op::Squeeze
        | Op::Unsqueeze
        | Op::Slice
        | Op::Gather(_)
        | Op::Expand
        | Op::Tile
        | Op::Pad(_)
        | Op::Dropout(_)
        | Op::SeededDropout(_)
        | Op::ReduceSum(_)
        | Op::ReduceMean(_)
        | Op::ReduceMax(_)
        | Op::ReduceMin(_)
        | Op::ReduceSumSquare(_)
        | Op::ReduceL2(_)
        | Op::ReduceL1(_)
        | Op::ReduceLogSumExp(_)
        | Op::ReduceProd(_)
        | Op::CumSum(_)
        | Op::Split(_)
        | Op::Clip
        | Op::Resize(_)
        | Op::SoftmaxCrossEntropyLoss(_)
        | Op::NegativeLogLikelihoodLoss(_)
        | Op::GatherElements(_)
        | Op::GatherND(_) => slot == 0,
        // Data and updates; never the indices.
        Op::ScatterND(_) | Op::ScatterElements(_) => slot == 0 || slot == 2,
        Op::Where => slot > 0,
        Op::BatchNormalization(_) | Op::LayerNormalization(_) | Op::Conv(_) | Op::Gemm(_) => slot <= 2,
        Op::Shape(_) | Op::Size | Op::ConstantOfShape(_) | Op::Range | Op::ArgMax(_) | Op::ArgMin(_) => false,
        // On the path, so that a parameter behind an op mpc cannot differentiate is an error.
        Op::Opaque(_) => true,
        _ => !op.is_mpc(),
    }
}

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
    Ok(out)
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

fn int_const(g: &Graph, v: Option<ValueId>, what: &str) -> Result<Option<Vec<i64>>, String> {
    match v {
        None => Ok(None),
        Some(v) => match g.constant(v).and_then(|t| t.to_i64_vec()) {
            Some(x) => Ok(Some(x)),
            None => Err(format!("{what} must be a constant to differentiate")),
        },
    }
}

fn fixed(d: &Dim, what: &str) -> Result<i64, String> {
    d.fixed().map(|x| x as i64).ok_or_else(|| format!("{what} must have a known size to differentiate"))
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
        Op::Softmax(a) => vec![Some(b.op("softmax", Op::SoftmaxGrad(Box::new(a.clone())), &[dy, y]))],
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
        // dX = ConvTranspose(dY, W), dW = correlation of X with dY, dB = ΣdY: ai.mpc::ConvGrad.
        Op::Conv(a) => {
            let outs = b.ops("conv", Op::ConvGrad(a.clone()), &[Some(dy), Some(x(0)?), Some(x(1)?)], 3);
            vec![Some(outs[0]), Some(outs[1]), node.input(2).map(|_| outs[2])]
        }
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
            let mut sizes = Vec::new();
            for v in node.inputs().iter().flatten() {
                sizes.push(fixed(&b.shape(*v)?.dims()[ax], "each Concat input along the axis")?);
            }
            let s = b.ints(&sizes);
            let split = Op::Split(SplitAttrs { axis: ax as i64, num_outputs: None });
            b.ops("split", split, &[Some(dy), Some(s)], sizes.len()).into_iter().map(Some).collect()
        }
        // d split = concat of the outputs' gradients (zeros for outputs nothing reads).
        Op::Split(a) => {
            let mut parts = Vec::new();
            for (i, &o) in node.outputs().iter().enumerate() {
                parts.push(Some(match dys.get(i).copied().flatten() {
                    Some(d) => d,
                    None => zeros_like(b, o)?,
                }));
            }
            vec![Some(b.ops("concat", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: a.axis }), &parts, 1)[0])]
        }
        // d slice = dy padded back to the input's extent (unit steps).
        Op::Slice => {
            let xs = b.shape(x(0)?)?;
            let r = xs.rank();
            let g: &Graph = b.g;
            let starts = int_const(g, node.input(1), "Slice starts")?.unwrap_or_default();
            let ends = int_const(g, node.input(2), "Slice ends")?.unwrap_or_default();
            let axes = int_const(g, node.input(3), "Slice axes")?.unwrap_or_else(|| (0..starts.len() as i64).collect());
            let steps = int_const(g, node.input(4), "Slice steps")?.unwrap_or_else(|| vec![1; starts.len()]);
            let mut pads = vec![0i64; 2 * r];
            for i in 0..starts.len() {
                if steps[i] != 1 {
                    return Err("Slice with steps other than 1 cannot be differentiated yet".into());
                }
                let ax = normalize_axis(axes[i], r).ok_or("bad axis")?;
                let dim = fixed(&xs.dims()[ax], "the sliced axis")?;
                let clamp = |v: i64| (if v < 0 { v + dim } else { v }).clamp(0, dim);
                let (s, e) = (clamp(starts[i]), clamp(ends[i]));
                pads[ax] = s;
                pads[ax + r] = dim - e.max(s);
            }
            let p = b.ints(&pads);
            vec![Some(b.op("pad", Op::Pad(Default::default()), &[dy, p]))]
        }
        // Embedding: the rows of dy are added at their indices (ai.mpc::GatherGrad).
        Op::Gather(a) => {
            let s = b.shape_of(x(0)?);
            vec![Some(b.op("scatter", Op::GatherGrad(Box::new(AxisAttrs { axis: a.axis })), &[dy, x(1)?, s]))]
        }
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
            let r = xs.rank();
            let axes: Vec<usize> = match int_const(b.g, node.input(1), "the axes")? {
                Some(ax) if !ax.is_empty() => {
                    ax.iter().map(|&v| normalize_axis(v, r).ok_or("bad axis")).collect::<Result<_, _>>()?
                }
                _ if a.noop_with_empty_axes => return Ok(vec![Some(dy)]),
                _ => (0..r).collect(),
            };
            let mut t = dy;
            if !a.keepdims {
                let ax: Vec<i64> = axes.iter().map(|&v| v as i64).collect();
                let axv = b.ints(&ax);
                t = b.op("unsqueeze", Op::Unsqueeze, &[t, axv]);
            }
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

/// Zeros shaped like `v` (the gradient of an unread output).
fn zeros_like(b: &mut Builder, v: ValueId) -> Result<ValueId, String> {
    let dt = b.dtype(v)?;
    let s = b.shape_of(v);
    let value = mpc_ir::Tensor::from_f64_as(dt, vec![1], &[0.0]);
    let op = Op::ConstantOfShape(Box::new(mpc_ir::ops::ConstantOfShapeAttrs { value: Some(value) }));
    Ok(b.op("zeros", op, &[s]))
}
