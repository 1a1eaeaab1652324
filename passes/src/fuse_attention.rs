//! Scaled dot-product attention in f16 or bf16 as one `ai.mpc::Attention` node.
//!
//! Exporters write attention as its steps: `MatMul(Q, Kᵀ)`, a scale (`Mul` or `Div` by a
//! constant), an additive mask, `Softmax` over the keys and `MatMul(P, V)`; after the precision
//! pass the products are f16 (or bf16) and the softmax f32 between two Casts. PyTorch's
//! `scaled_dot_product_attention` (Hugging Face's default attention) exports the scale split over
//! the operands, `MatMul(Q·√s, Kᵀ·√s)`, and zeroes the probabilities of rows whose every key is
//! masked, `Where(IsNaN(P), 0, P)`, before the second product. Run as written, the
//! step keeps the probabilities, [..., Sq, Sk] per layer, from the forward pass to the backward
//! (GPT-2 small at sequence 512 and batch 8: 48 MiB in f16 for each of its 12 layers) and moves
//! them through memory four times more.
//!
//! Here such a chain becomes `Attention(Q, K, V, mask) → (Y, LSE)`, which keeps only each row's
//! log-sum-exp; its gradient, `ai.mpc::AttentionGrad`, computes the probabilities again from Q, K
//! and LSE (docs/ai-mpc-ops.md). The scores are summed and scaled in f32, not rounded to f16
//! first as the unfused chain's product is.
//!
//! A chain is fused when its products are f16 or bf16 (Q, K and V of one dtype), every value
//! between them has no other reader (but the IsNaN of such a Where) and is no graph output, the
//! scales are constants (their product is the node's), the mask
//! (if any) does not change the scores' shape, the softmax runs over the last axis, and the head
//! dim is at most 128 (the CUDA kernels' limit). Kᵀ's Transpose (a single reader) becomes K's.
//! The fused node gives a row whose every key is masked Y = 0 and no gradient, as that Where
//! does forward (the unfused softmax's gradient of such a row multiplies by its NaN
//! probabilities); NaN from Q, K or V is not zeroed, as the Where would have zeroed it
//! (the step is then skipped by the loss scaling's finite check).

use std::collections::HashSet;

use mpc_ir::ops::{AttentionAttrs, AttentionLayout, CastAttrs, TransposeAttrs};
use mpc_ir::{normalize_axis, DType, Dim, Graph, NodeId, Op, Shape, TypeInfo, ValueId};

use crate::known::scalar;
use crate::train::differentiable;
use crate::{Changed, Context, Pass, Result};

/// The largest head dim fused.
const MAX_HEAD_DIM: u64 = 128;

pub struct FuseAttention;

impl Pass for FuseAttention {
    fn name(&self) -> &'static str {
        "fuse-attention"
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        if !cx.policy.as_ref().is_some_and(|p| p.fused_attention) {
            return Ok(Changed::No);
        }
        // A chain's nodes are its own (single readers), so fusing one never removes another's Softmax.
        let softmaxes: Vec<NodeId> =
            g.topo_order()?.into_iter().filter(|&n| matches!(g.node(n).op, Op::Softmax(_))).collect();
        // A trained scale or mask (a learned temperature, a position bias) keeps its chain: the
        // fused node takes the scale as a constant and gives the mask no gradient.
        let trained: HashSet<ValueId> =
            cx.train.as_ref().map(|t| crate::train::trainable(g, &t.freeze).into_iter().collect()).unwrap_or_default();
        let mut changed = if shapes_before_transposes(g) { Changed::Yes } else { Changed::No };
        for n in softmaxes {
            if let Some(chain) = find(g, n, &trained) {
                fuse(g, chain);
                changed = Changed::Yes;
            }
        }
        Ok(changed)
    }
}

/// Each `Shape(Transpose(x, perm))` as `Gather(Shape(x), perm)` (the entries its `start` and
/// `end` take): the same dims, read without the transposed tensor. PyTorch's
/// scaled_dot_product_attention reads the heads' dims off Q and K after their Transposes (for its
/// scale and its causal mask's size); so rewritten, those Transposes are read by the products
/// alone, and the attention can take the heads where they lie. Whether any Shape changed.
fn shapes_before_transposes(g: &mut Graph) -> bool {
    let shapes: Vec<NodeId> = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Shape(_))).collect();
    let mut changed = false;
    for n in shapes {
        let (Op::Shape(a), Some(v), &[out]) = (&g.node(n).op, g.node(n).input(0), g.node(n).outputs()) else {
            continue;
        };
        let (start, end) = (a.start, a.end);
        let Some((t, 0)) = g.value(v).producer() else { continue };
        let (Op::Transpose(TransposeAttrs { perm }), Some(x)) = (&g.node(t).op, g.node(t).input(0)) else { continue };
        let Some(r) = g.ty(x).shape.as_ref().map(|s| s.rank() as i64) else { continue };
        let perm: Vec<i64> = perm.clone().unwrap_or_else(|| (0..r).rev().collect());
        if perm.len() as i64 != r {
            continue;
        }
        let clamp = |e: i64| (if e < 0 { e + r } else { e }).clamp(0, r) as usize;
        let (s0, s1) = (clamp(start), clamp(end.unwrap_or(r)));
        let taken: Vec<i64> = perm[s0..s1.max(s0)].to_vec();
        let name = g.name(out).to_string();
        let (_, full) =
            g.add_op(&g.unique_name(&format!("{name}.of_input")), Op::Shape(Default::default()), &[Some(x)], 1);
        g.set_ty(full[0], TypeInfo::new(DType::I64, Shape::fixed(&[r as u64])));
        let idx = g.add_initializer(
            &g.unique_name(&format!("{name}.perm")),
            mpc_ir::Tensor::from_i64(vec![taken.len() as u64], &taken),
        );
        let (_, picked) = g.add_op(
            &g.unique_name(&format!("{name}.picked")),
            Op::Gather(Default::default()),
            &[Some(full[0]), Some(idx)],
            1,
        );
        g.set_ty(picked[0], TypeInfo::new(DType::I64, Shape::fixed(&[taken.len() as u64])));
        // A value read by name (a graph output, a subgraph's capture) keeps its name.
        let output = g.name_is_referenced(out).then_some(name);
        g.replace_uses(out, picked[0]);
        g.remove_nodes(&[n]);
        if let Some(name) = output {
            g.rename(picked[0], &name);
        }
        changed = true;
    }
    changed
}

/// One attention chain, found from its Softmax.
struct Chain {
    q: ValueId,
    /// Kᵀ, the scores' second operand.
    kt: ValueId,
    v: ValueId,
    mask: Option<ValueId>,
    scale: f32,
    /// The softmax's output, which names the log-sum-exp.
    probs: ValueId,
    /// `MatMul(P, V)`, which becomes the Attention node.
    pv: NodeId,
    /// The nodes from the scores' product to the probabilities' Cast, which go.
    dead: Vec<NodeId>,
}

/// The single-reader producer of `v`, when `v` is no graph output.
fn private_producer(g: &Graph, v: ValueId) -> Option<NodeId> {
    let (p, 0) = g.value(v).producer()? else { return None };
    (g.value(v).uses().len() == 1 && !g.is_output(v) && !g.name_is_referenced(v)).then_some(p)
}

fn is_cast(g: &Graph, n: NodeId) -> bool {
    matches!(g.node(n).op, Op::Cast(_))
}

/// Whether two dims are known to be equal (unknown dims are not).
fn same(a: &Dim, b: &Dim) -> bool {
    a == b && !matches!(a, Dim::Unknown)
}

/// The chain whose Softmax is `sm`, where it can be fused. `trained`: the initializers training
/// changes (a scale or mask computed from one must stay in the graph).
fn find(g: &Graph, sm: NodeId, trained: &HashSet<ValueId>) -> Option<Chain> {
    let node = g.node(sm);
    let (Op::Softmax(a), Some(x), &[probs]) = (&node.op, node.input(0), node.outputs()) else { return None };
    let scores = g.ty(x).shape.as_ref()?;
    let rank = scores.rank();
    if rank < 3 || normalize_axis(a.axis, rank)? != rank - 1 || scores.dims().iter().any(|d| matches!(d, Dim::Unknown))
    {
        return None;
    }
    let mut dead = vec![sm];
    let pv = down(g, probs, &mut dead)?;
    let v = g.node(pv).input(1)?;
    // Up: an optional Add of the mask, an optional scale, an optional Cast, then MatMul(Q, Kᵀ).
    let scores_ty = g.ty(x).clone();
    let mut at = private_producer(g, x)?;
    let mut mask = None;
    if g.node(at).op == Op::Add {
        let (l, r) = (g.node(at).input(0)?, g.node(at).input(1)?);
        // The scores' side is the one a private product leads to; the mask the other.
        let (s, m) = if leads_to_product(g, l) { (l, r) } else { (r, l) };
        // The mask must not widen the scores, and must have the keys' axis (the kernels read it
        // along the keys).
        let keys = g.ty(m).shape.as_ref()?.dims().last().cloned()?;
        if !leads_to_product(g, s) || g.ty(s) != &scores_ty || !same(&keys, &scores.dims()[rank - 1]) {
            return None;
        }
        if depends_on(g, m, trained) {
            return None;
        }
        mask = Some(m);
        dead.push(at);
        at = private_producer(g, s)?;
    }
    let mut scale = 1.0f64;
    if matches!(g.node(at).op, Op::Mul | Op::Div) {
        let (s, c) = scaled(g, at, trained)?;
        scale = c;
        dead.push(at);
        at = private_producer(g, s)?;
    }
    if is_cast(g, at) {
        dead.push(at);
        at = private_producer(g, g.node(at).input(0)?)?;
    }
    if g.node(at).op != Op::MatMul {
        return None;
    }
    dead.push(at);
    // Q and Kᵀ, each maybe scaled by a constant before the product (PyTorch's
    // scaled_dot_product_attention exports `(Q·√s)(Kᵀ·√s)`).
    let mut operand = |i: usize| -> Option<ValueId> {
        let x = g.node(at).input(i)?;
        let Some((op, y, c)) = private_producer(g, x).and_then(|m| scaled(g, m, trained).map(|(y, c)| (m, y, c)))
        else {
            return Some(x);
        };
        scale *= c;
        dead.push(op);
        Some(y)
    };
    let (q, kt) = (operand(0)?, operand(1)?);
    // Kᵀ's Transpose may be rewritten into K's: nothing else of the chain may be it.
    if kt == q || kt == v || Some(kt) == mask {
        return None;
    }
    // f16 or bf16 products of [..., S, D] operands with the same leading dims.
    let dt = g.ty(q).dtype?;
    if !matches!(dt, DType::F16 | DType::BF16)
        || [kt, v, g.node(pv).outputs()[0]].iter().any(|&u| g.ty(u).dtype != Some(dt))
        || !scale.is_finite()
    {
        return None;
    }
    let (qs, ks, vs) = (g.ty(q).shape.as_ref()?, g.ty(kt).shape.as_ref()?, g.ty(v).shape.as_ref()?);
    if qs.rank() != rank || ks.rank() != rank || vs.rank() != rank {
        return None;
    }
    let (qd, kd, vd) = (qs.dims(), ks.dims(), vs.dims());
    let d = qd[rank - 1].fixed()?;
    let same_lead =
        (0..rank - 2).all(|i| same(&qd[i], &kd[i]) && same(&qd[i], &vd[i]) && same(&qd[i], &scores.dims()[i]));
    if !same_lead || d > MAX_HEAD_DIM || kd[rank - 2].fixed() != Some(d) || vd[rank - 1].fixed() != Some(d) {
        return None;
    }
    if !same(&kd[rank - 1], &vd[rank - 2]) {
        return None;
    }
    Some(Chain { q, kt, v, mask, scale: scale as f32, probs, pv, dead })
}

/// `x · c`, `c · x` or `x / c` at node `n`, with `c` a constant scalar ([`scalar`]) that no
/// trained parameter makes (a rank-0 initializer may be a learned temperature): `x` and the
/// factor it is multiplied by.
fn scaled(g: &Graph, n: NodeId, trained: &HashSet<ValueId>) -> Option<(ValueId, f64)> {
    let node = g.node(n);
    let (l, r) = (node.input(0)?, node.input(1)?);
    let (x, c) = match (&node.op, scalar(g, l), scalar(g, r)) {
        (Op::Mul | Op::Div, _, Some(c)) => (l, c),
        (Op::Mul, Some(c), None) => (r, c),
        _ => return None,
    };
    if depends_on(g, if x == l { r } else { l }, trained) {
        return None;
    }
    let c = if node.op == Op::Div { 1.0 / c } else { c };
    c.is_finite().then_some((x, c))
}

/// From the probabilities down to `MatMul(P, V)`, which it returns: Casts, and the
/// `Where(IsNaN(p), 0, p)` that PyTorch's exported scaled_dot_product_attention puts there (a
/// row whose every key is masked has NaN probabilities, which it makes 0: the fused node gives
/// such a row Y = 0 and no gradient itself). Every node passed, IsNaN's included, goes into `dead`;
/// each value on the way has no reader besides the next node and an IsNaN whose only reader is
/// that kind of Where further down.
fn down(g: &Graph, probs: ValueId, dead: &mut Vec<NodeId>) -> Option<NodeId> {
    let mut at = probs;
    // The IsNaN outputs seen and not yet consumed by their Where.
    let mut nan_checks: Vec<ValueId> = Vec::new();
    let mut cast = false;
    loop {
        if g.is_output(at) || g.name_is_referenced(at) {
            return None;
        }
        let mut next = None;
        for u in g.value(at).uses() {
            let reader = g.node(u.node);
            if matches!(reader.op, Op::IsNaN) && u.slot == 0 {
                dead.push(u.node);
                nan_checks.push(reader.outputs()[0]);
            } else if next.replace((u.node, u.slot)).is_some() {
                return None; // a second reader
            }
        }
        let (n, slot) = next?;
        let node = g.node(n);
        match &node.op {
            // One Cast, to a float (the probabilities to the products' dtype): a second, or one
            // to an integer or an 8-bit float, rounds what the fused node would not.
            Op::Cast(c) if !cast && matches!(c.to, DType::F16 | DType::BF16 | DType::F32 | DType::F64) => cast = true,
            Op::Where if slot == 2 => {
                let (cond, zero) = (node.input(0)?, node.input(1)?);
                let i = nan_checks.iter().position(|&c| c == cond)?;
                if g.value(cond).uses().len() != 1 || g.is_output(cond) || scalar(g, zero) != Some(0.0) {
                    return None;
                }
                // The result has the probabilities' shape (the zero is a scalar).
                if g.ty(node.outputs()[0]).shape != g.ty(at).shape {
                    return None;
                }
                nan_checks.swap_remove(i);
            }
            Op::MatMul if slot == 0 && nan_checks.is_empty() => return Some(n),
            _ => return None,
        }
        dead.push(n);
        at = node.outputs()[0];
    }
}

/// Whether a gradient of `v` would flow into one of `values` (a parameter training changes):
/// through the inputs gradients flow into, not through shapes or indices.
fn depends_on(g: &Graph, v: ValueId, values: &HashSet<ValueId>) -> bool {
    let mut todo = vec![v];
    let mut seen = HashSet::new();
    while let Some(u) = todo.pop() {
        if values.contains(&u) {
            return true;
        }
        if let Some((p, _)) = g.value(u).producer() {
            let node = g.node(p);
            let flows = |&(slot, w): &(usize, &Option<ValueId>)| w.is_some() && differentiable(&node.op, slot);
            todo.extend(
                node.inputs().iter().enumerate().filter(flows).filter_map(|(_, w)| *w).filter(|&w| seen.insert(w)),
            );
        }
    }
    false
}

/// Whether `v` is the scores' product: a private MatMul, through an optional scale (by a scalar
/// on either side) and Cast.
fn leads_to_product(g: &Graph, v: ValueId) -> bool {
    let mut at = v;
    for _ in 0..3 {
        let Some(p) = private_producer(g, at) else { return false };
        let node = g.node(p);
        match node.op {
            Op::MatMul => return true,
            Op::Cast(_) | Op::Div => match node.input(0) {
                Some(i) => at = i,
                None => return false,
            },
            Op::Mul => match (node.input(0), node.input(1)) {
                (Some(l), Some(r)) => at = if scalar(g, l).is_some() { r } else { l },
                _ => return false,
            },
            _ => return false,
        }
    }
    false
}

/// K from Kᵀ (whose reader, the scores' product, is gone): the input of Kᵀ's Transpose with the
/// last two axes of its permutation swapped (that Transpose itself when nothing else reads it,
/// none when the permutation becomes the identity), or a new Transpose.
fn untranspose(g: &mut Graph, kt: ValueId, k_ty: TypeInfo) -> ValueId {
    let r = k_ty.shape.as_ref().map_or(0, |s| s.rank());
    if let Some((t, 0)) = g.value(kt).producer() {
        if let (Op::Transpose(TransposeAttrs { perm }), Some(src)) = (&g.node(t).op, g.node(t).input(0)) {
            let mut p: Vec<i64> = perm.clone().unwrap_or_else(|| (0..r as i64).rev().collect());
            if p.len() == r {
                p.swap(r - 2, r - 1);
                let unread = g.value(kt).uses().is_empty() && !g.is_output(kt) && !g.name_is_referenced(kt);
                if p.iter().enumerate().all(|(i, &a)| a == i as i64) {
                    // K itself; the Transpose goes when nothing else reads it, so that K's only
                    // reader may be the attention (which then may read the heads in place).
                    if unread {
                        g.remove_nodes(&[t]);
                    }
                    return src;
                }
                if unread {
                    *g.node_op_mut(t) = Op::Transpose(TransposeAttrs { perm: Some(p) });
                    g.set_ty(kt, k_ty);
                    return kt;
                }
            }
        }
    }
    let mut p: Vec<i64> = (0..r as i64).collect();
    p.swap(r - 2, r - 1);
    let name = format!("{}.k", g.name(kt));
    let (_, out) = g.add_op(&g.unique_name(&name), Op::Transpose(TransposeAttrs { perm: Some(p) }), &[Some(kt)], 1);
    g.set_ty(out[0], k_ty);
    out[0]
}

fn fuse(g: &mut Graph, c: Chain) {
    let q_ty = g.ty(c.q).clone();
    // K's type: Kᵀ's with its last two dims swapped.
    let mut k_ty = g.ty(c.kt).clone();
    if let Some(s) = &mut k_ty.shape {
        let r = s.rank();
        s.0.swap(r - 2, r - 1);
    }
    // The scores' own links go first, so that Kᵀ's Transpose has the scores' product as its only
    // reader when it is rewritten.
    let y = g.node(c.pv).outputs()[0];
    let lse_name = format!("{}.lse", g.name(c.probs));
    g.set_input(c.pv, 0, None);
    g.remove_nodes(&c.dead);
    let k = untranspose(g, c.kt, k_ty);
    let mask = c.mask.map(|m| {
        if g.ty(m).dtype == Some(DType::F32) {
            return m;
        }
        let name = g.unique_name(&format!("{}.cast_f32", g.name(m)));
        let (_, out) = g.add_op(&name, Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(m)], 1);
        g.set_ty(out[0], TypeInfo { dtype: Some(DType::F32), shape: g.ty(m).shape.clone() });
        out[0]
    });
    *g.node_op_mut(c.pv) = Op::Attention(Box::new(AttentionAttrs { layout: AttentionLayout::Bhsd, scale: c.scale }));
    for (slot, v) in [Some(c.q), Some(k), Some(c.v), mask].into_iter().enumerate() {
        g.set_input(c.pv, slot, v);
    }
    if mask.is_none() {
        g.truncate_inputs(c.pv, 3);
    }
    let lse_shape = q_ty.shape.as_ref().map(|s| Shape(s.0[..s.rank() - 1].to_vec()));
    let lse = g.new_value(&lse_name, TypeInfo { dtype: Some(DType::F32), shape: lse_shape });
    g.push_output(c.pv, lse);
    g.set_ty(y, TypeInfo { dtype: q_ty.dtype, shape: g.ty(y).shape.clone() });
    heads_in_place(g, c.pv);
}

/// The heads' Transpose ([B, S, H, D] → [B, H, S, D]) that makes `v`, read only by the attention,
/// and its input.
fn heads_split(g: &Graph, v: ValueId) -> Option<(NodeId, ValueId)> {
    let (t, 0) = g.value(v).producer()? else { return None };
    let node = g.node(t);
    let (Op::Transpose(TransposeAttrs { perm: Some(p) }), Some(x)) = (&node.op, node.input(0)) else { return None };
    let private = g.value(v).uses().len() == 1 && !g.is_output(v) && !g.name_is_referenced(v);
    (p == &[0, 2, 1, 3] && private).then_some((t, x))
}

/// Attention node `n` under the `bshd` layout where its Q, K and V are each the heads' Transpose
/// of a [B, S, H, D] tensor (a projection's heads split) and its result's only reader transposes
/// it back (the heads merged): it reads and writes [B, S, H, D] itself, and the four Transposes
/// go (PyTorch's attention launches none of them; the backward pass then has none either).
fn heads_in_place(g: &mut Graph, n: NodeId) {
    let y = g.node(n).outputs()[0];
    let split: Option<Vec<(NodeId, ValueId)>> = (0..3).map(|i| heads_split(g, g.node(n).input(i)?)).collect();
    let (Some(split), &[u]) = (split, g.value(y).uses()) else { return };
    let merge = u.node;
    let (Op::Transpose(TransposeAttrs { perm: Some(p) }), &[merged]) = (&g.node(merge).op, g.node(merge).outputs())
    else {
        return;
    };
    let captured = g.value(merged).uses().iter().any(|u| g.is_capture(u.node, u.slot));
    if p != &[0, 2, 1, 3] || captured {
        return;
    }
    // A graph output keeps its name.
    let output = g.is_output(merged).then(|| g.name(merged).to_string());
    for (slot, &(_, x)) in split.iter().enumerate() {
        g.set_input(n, slot, Some(x));
    }
    let Op::Attention(a) = g.node_op_mut(n) else { unreachable!("an attention node") };
    a.layout = AttentionLayout::Bshd;
    g.set_ty(y, g.ty(merged).clone());
    g.replace_uses(merged, y);
    let mut dead: Vec<NodeId> = split.iter().map(|&(t, _)| t).collect();
    dead.push(merge);
    g.remove_nodes(&dead);
    if let Some(name) = output {
        g.rename(y, &name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::known::ints;
    use mpc_ir::ops::SoftmaxAttrs;

    /// PyTorch's attention after the precision pass: f16 products, the scores cast to f32, scaled
    /// by a scalar computed from a Shape, masked, softmaxed and cast back; Kᵀ a Transpose of the
    /// heads split from [B, S, H, D]. `probs_out` makes the probabilities a graph output too.
    fn exported(probs_out: bool) -> (Graph, NodeId) {
        let mut g = Graph::new("g");
        let f16 = |d: &[u64]| TypeInfo::new(DType::F16, Shape::fixed(d));
        let q = g.add_input("q", f16(&[2, 3, 8, 4]));
        let k4 = g.add_input("k4", f16(&[2, 8, 3, 4]));
        let v = g.add_input("v", f16(&[2, 3, 8, 4]));
        let mask = g.add_input("mask", TypeInfo::new(DType::F32, Shape::fixed(&[8, 8])));
        let kt = g.add_op("kt", Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 3, 1]) }), &[Some(k4)], 1).1[0];
        let s = g.add_op("s", Op::MatMul, &[Some(q), Some(kt)], 1).1[0];
        let s32 = g.add_op("s32", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(s)], 1).1[0];
        let shape = g.add_op("shape", Op::Shape(Default::default()), &[Some(q)], 1).1[0];
        let three = g.add_initializer("three", mpc_ir::Tensor::from_i64(vec![], &[3]));
        let d = g.add_op("d", Op::Gather(Default::default()), &[Some(shape), Some(three)], 1).1[0];
        let df = g.add_op("df", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(d)], 1).1[0];
        let half = g.add_initializer("half", mpc_ir::Tensor::from_f64_as(DType::F32, vec![], &[-0.5]));
        let scale = g.add_op("scale", Op::Pow, &[Some(df), Some(half)], 1).1[0];
        let scaled = g.add_op("scaled", Op::Mul, &[Some(s32), Some(scale)], 1).1[0];
        let masked = g.add_op("masked", Op::Add, &[Some(scaled), Some(mask)], 1).1[0];
        let p = g.add_op("p", Op::Softmax(SoftmaxAttrs { axis: -1 }), &[Some(masked)], 1).1;
        let p16 = g.add_op("p16", Op::Cast(CastAttrs { saturate: true, to: DType::F16 }), &[Some(p[0])], 1).1[0];
        let (pv, y) = g.add_op("y", Op::MatMul, &[Some(p16), Some(v)], 1);
        g.add_output(y[0]);
        if probs_out {
            g.add_output(p[0]);
        }
        crate::infer_types(&mut g).unwrap();
        (g, pv)
    }

    fn context(on: bool) -> Context {
        let mut policy = crate::Policy::named("mixed").unwrap().unwrap();
        policy.fused_attention = on;
        Context { policy: Some(policy), ..Context::default() }
    }

    /// The pass with the option on, then dead-code elimination and the full verification.
    fn fused(g: &mut Graph) -> Changed {
        let changed = FuseAttention.run(g, &context(true)).unwrap();
        crate::Dce.run(g, &Context::default()).unwrap();
        crate::verify(g).unwrap();
        changed
    }

    #[test]
    fn an_exported_chain_becomes_one_attention_node() {
        let (mut g, pv) = exported(false);
        assert_eq!(fused(&mut g), Changed::Yes);
        assert_eq!(
            g.node(pv).op,
            Op::Attention(Box::new(AttentionAttrs { layout: AttentionLayout::Bhsd, scale: 0.5 }))
        );
        let ins: Vec<&str> = g.node(pv).inputs().iter().map(|v| g.name(v.unwrap())).collect();
        // K is the heads' Transpose of [B, S, H, D], the one Kᵀ's was, with the last two axes swapped.
        assert_eq!(ins, ["q", "kt", "v", "mask"]);
        let (t, _) = g.value(g.find("kt").unwrap()).producer().unwrap();
        assert_eq!(g.node(t).op, Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 1, 3]) }));
        let lse = g.node(pv).outputs()[1];
        assert_eq!((g.name(lse), g.ty(lse)), ("p.lse", &TypeInfo::new(DType::F32, Shape::fixed(&[2, 3, 8]))));
        let ops: Vec<String> = g.node_ids().map(|n| g.node(n).op.op_type().to_string()).collect();
        assert_eq!(ops, ["Transpose", "Attention"]);
    }

    /// f16 inputs `q4`, `k4` and `v4` of [B 2, S 8, H 3, D 4] and their heads as PyTorch splits
    /// them: Q and V by a Transpose to [B, H, S, D], Kᵀ by one to [B, H, D, S].
    fn bshd_heads(g: &mut Graph) -> (ValueId, ValueId, ValueId) {
        let mut heads = |name: &str, perm: Vec<i64>| {
            let x = g.add_input(name, TypeInfo::new(DType::F16, Shape::fixed(&[2, 8, 3, 4])));
            g.add_op(&format!("{name}.t"), Op::Transpose(TransposeAttrs { perm: Some(perm) }), &[Some(x)], 1).1[0]
        };
        (heads("q4", vec![0, 2, 1, 3]), heads("k4", vec![0, 2, 3, 1]), heads("v4", vec![0, 2, 1, 3]))
    }

    /// PyTorch's heads: Q and V split from [B, S, H, D] by Transposes, Kᵀ by one more, and the
    /// result merged back by a Transpose: the attention reads and writes [B, S, H, D] itself.
    #[test]
    fn heads_split_and_merged_by_transposes_are_read_and_written_in_place() {
        let mut g = Graph::new("g");
        let f16 = |d: &[u64]| TypeInfo::new(DType::F16, Shape::fixed(d));
        let (q, kt, v) = bshd_heads(&mut g);
        let s = g.add_op("s", Op::MatMul, &[Some(q), Some(kt)], 1).1[0];
        let c = g.add_initializer("c", mpc_ir::Tensor::from_f64_as(DType::F16, vec![], &[2.0]));
        let scaled = g.add_op("scaled", Op::Div, &[Some(s), Some(c)], 1).1[0];
        let p = g.add_op("p", Op::Softmax(SoftmaxAttrs { axis: 3 }), &[Some(scaled)], 1).1[0];
        let (pv, y) = g.add_op("y", Op::MatMul, &[Some(p), Some(v)], 1);
        let merged =
            g.add_op("merged", Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 1, 3]) }), &[Some(y[0])], 1);
        g.add_output(merged.1[0]);
        crate::infer_types(&mut g).unwrap();
        assert_eq!(fused(&mut g), Changed::Yes);
        assert_eq!(
            g.node(pv).op,
            Op::Attention(Box::new(AttentionAttrs { layout: AttentionLayout::Bshd, scale: 0.5 }))
        );
        let ins: Vec<&str> = g.node(pv).inputs().iter().map(|v| g.name(v.unwrap())).collect();
        assert_eq!(ins, ["q4", "k4", "v4"]);
        assert_eq!((g.outputs(), g.name(y[0])), (&[y[0]][..], "merged"));
        assert_eq!(g.ty(y[0]), &f16(&[2, 8, 3, 4]));
        let lse = g.node(pv).outputs()[1];
        assert_eq!(g.ty(lse), &TypeInfo::new(DType::F32, Shape::fixed(&[2, 3, 8])));
        assert_eq!(g.node_count(), 1);
    }

    /// PyTorch's scaled_dot_product_attention as exported after the precision pass: the heads
    /// split from [B, S, H, D], Q and Kᵀ each scaled by √s before the product, the mask added to
    /// the f32 scores, and the probabilities of wholly masked rows zeroed by
    /// `Where(IsNaN(P), 0, Cast(P))`. `edit` changes it before the pass runs.
    fn sdpa(edit: &dyn Fn(&mut Graph)) -> (Graph, NodeId, Changed) {
        let mut g = Graph::new("g");
        let constant = |g: &mut Graph, name: &str, x: f64, shape: Vec<u64>| {
            let value = mpc_ir::Tensor::from_f64_as(DType::F16, shape, &[x]);
            g.add_op(name, Op::Constant(Box::new(mpc_ir::ops::ConstantAttrs { value })), &[], 1).1[0]
        };
        let (q, kt, v) = bshd_heads(&mut g);
        let mask = g.add_input("mask", TypeInfo::new(DType::F32, Shape::fixed(&[2, 1, 8, 8])));
        let (c1, c2) = (constant(&mut g, "c1", 0.5, vec![]), constant(&mut g, "c2", 0.5, vec![]));
        let qs = g.add_op("qs", Op::Mul, &[Some(q), Some(c1)], 1).1[0];
        let kts = g.add_op("kts", Op::Mul, &[Some(kt), Some(c2)], 1).1[0];
        let s = g.add_op("s", Op::MatMul, &[Some(qs), Some(kts)], 1).1[0];
        let s32 = g.add_op("s32", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(s)], 1).1[0];
        let masked = g.add_op("masked", Op::Add, &[Some(s32), Some(mask)], 1).1[0];
        let p = g.add_op("p", Op::Softmax(SoftmaxAttrs { axis: -1 }), &[Some(masked)], 1).1[0];
        let nan = g.add_op("nan", Op::IsNaN, &[Some(p)], 1).1[0];
        let p16 = g.add_op("p16", Op::Cast(CastAttrs { saturate: true, to: DType::F16 }), &[Some(p)], 1).1[0];
        let zero = constant(&mut g, "zero", 0.0, vec![1]);
        let z = g.add_op("z", Op::Where, &[Some(nan), Some(zero), Some(p16)], 1).1[0];
        let (pv, y) = g.add_op("y", Op::MatMul, &[Some(z), Some(v)], 1);
        let merged =
            g.add_op("merged", Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 1, 3]) }), &[Some(y[0])], 1);
        g.add_output(merged.1[0]);
        edit(&mut g);
        crate::infer_types(&mut g).unwrap();
        let changed = fused(&mut g);
        (g, pv, changed)
    }

    #[test]
    fn pytorch_scaled_dot_product_attention_becomes_one_attention_node() {
        let (g, pv, changed) = sdpa(&|_| {});
        assert_eq!(changed, Changed::Yes);
        // The two √s multiply into the node's scale; the IsNaN and Where go with the chain.
        assert_eq!(
            g.node(pv).op,
            Op::Attention(Box::new(AttentionAttrs { layout: AttentionLayout::Bshd, scale: 0.25 }))
        );
        let ins: Vec<&str> = g.node(pv).inputs().iter().map(|v| g.name(v.unwrap())).collect();
        assert_eq!(ins, ["q4", "k4", "v4", "mask"]);
        assert_eq!(g.node_count(), 1);
        // Scaled Q read elsewhere too: the node reads it scaled, and takes Kᵀ's factor only.
        let (g, pv, changed) = sdpa(&|g| {
            let qs = g.find("qs").unwrap();
            g.add_output(qs);
        });
        assert_eq!(changed, Changed::Yes);
        let Op::Attention(a) = &g.node(pv).op else { panic!("{:?}", g.node(pv).op) };
        assert_eq!((a.scale, a.layout, g.name(g.node(pv).input(0).unwrap())), (0.5, AttentionLayout::Bhsd, "qs"));
    }

    /// A Where that puts anything but 0 in NaN rows, an IsNaN read elsewhere too, or an IsNaN of
    /// another value: the chain stays.
    #[test]
    fn refuses_what_the_zeroing_where_does_not_cover() {
        let producer = |g: &Graph, name: &str| g.value(g.find(name).unwrap()).producer().unwrap().0;
        let nonzero = |g: &mut Graph| {
            let value = mpc_ir::Tensor::from_f64_as(DType::F16, vec![1], &[1.0]);
            let one = g.add_op("one", Op::Constant(Box::new(mpc_ir::ops::ConstantAttrs { value })), &[], 1).1[0];
            let w = producer(g, "z");
            g.set_input(w, 1, Some(one));
        };
        let nan_out = |g: &mut Graph| {
            let nan = g.find("nan").unwrap();
            g.add_output(nan);
        };
        let other_nan = |g: &mut Graph| {
            let m = g.find("mask").unwrap();
            let nan = g.add_op("nan2", Op::IsNaN, &[Some(m)], 1).1[0];
            let w = producer(g, "z");
            g.set_input(w, 0, Some(nan));
        };
        // A second Cast of the probabilities (here to f32 and back): a rounding the fused node
        // would not make.
        let recast = |g: &mut Graph| {
            let w = producer(g, "z");
            let p16 = g.find("p16").unwrap();
            let to32 = g.add_op("p32", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(p16)], 1).1[0];
            let back = g.add_op("p16b", Op::Cast(CastAttrs { saturate: true, to: DType::F16 }), &[Some(to32)], 1).1[0];
            g.set_input(w, 2, Some(back));
        };
        for (what, edit) in [
            ("a second Cast", &recast as &dyn Fn(&mut Graph)),
            ("a Where of 1", &nonzero as &dyn Fn(&mut Graph)),
            ("IsNaN an output", &nan_out),
            ("the mask's IsNaN", &other_nan),
        ] {
            assert_eq!(sdpa(edit).2, Changed::No, "{what}");
        }
    }

    /// PyTorch's scaled_dot_product_attention scale, `Sqrt(Div(1, Sqrt(Cast(Slice(Shape(q), -1)))))`,
    /// from the Shape of the heads' Transpose of a tensor with a symbolic batch: the Shape is read
    /// off the Transpose's input (`shapes_before_transposes`), only the last dim is taken, and the
    /// value is known.
    #[test]
    fn the_sdpa_scale_is_read_through_slices_of_a_transposed_shape() {
        let mut g = Graph::new("g");
        let dims =
            vec![mpc_ir::Dim::sym("batch"), mpc_ir::Dim::Fixed(8), mpc_ir::Dim::Fixed(3), mpc_ir::Dim::Fixed(16)];
        let x = g.add_input("x", TypeInfo { dtype: Some(DType::F16), shape: Some(Shape(dims)) });
        let q = g.add_op("q", Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 1, 3]) }), &[Some(x)], 1).1[0];
        let shape = g.add_op("shape", Op::Shape(Default::default()), &[Some(q)], 1).1[0];
        let i64s = |g: &mut Graph, name: &str, v: i64| g.add_initializer(name, mpc_ir::Tensor::from_i64(vec![1], &[v]));
        let (start, end) = (i64s(&mut g, "start", -1), i64s(&mut g, "end", i64::MAX));
        let d = g.add_op("d", Op::Slice, &[Some(shape), Some(start), Some(end)], 1).1[0];
        let df = g.add_op("df", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(d)], 1).1[0];
        let root = g.add_op("root", Op::Sqrt, &[Some(df)], 1).1[0];
        let one = g.add_initializer("one", mpc_ir::Tensor::from_f64_as(DType::F32, vec![], &[1.0]));
        let inv = g.add_op("inv", Op::Div, &[Some(one), Some(root)], 1).1[0];
        let half = g.add_op("half", Op::Sqrt, &[Some(inv)], 1).1[0];
        let batch = g.add_op("batch", Op::Gather(Default::default()), &[Some(shape), Some(start)], 1).1[0];
        g.add_output(half);
        g.add_output(batch);
        crate::infer_types(&mut g).unwrap();
        assert_eq!(scalar(&g, half), Some(0.5));
        assert!(shapes_before_transposes(&mut g));
        crate::verify(&g).unwrap();
        assert_eq!(scalar(&g, half), Some(0.5));
        // The Transpose is read by nothing now; the Shape reads its input, the dims permuted.
        assert!(g.value(q).uses().is_empty());
        assert_eq!(ints(&g, shape_of(&g, d), 4).unwrap(), [None, Some(3), Some(8), Some(16)]);
        // Where a taken dim is symbolic there is no value.
        let first = i64s(&mut g, "first", 0);
        let b = g.add_op("b", Op::Gather(Default::default()), &[Some(shape_of(&g, d)), Some(first)], 1).1[0];
        crate::infer_types(&mut g).unwrap();
        assert_eq!(ints(&g, b, 4), Some(vec![None]));
    }

    /// The Shape value a Slice `d` reads.
    fn shape_of(g: &Graph, d: ValueId) -> ValueId {
        let (p, _) = g.value(d).producer().unwrap();
        g.node(p).input(0).unwrap()
    }

    /// A softmax over another axis, a mask that widens the scores, or a learned scale: no fusion.
    #[test]
    fn refuses_chains_that_are_not_attention() {
        let refused = |edit: &dyn Fn(&mut Graph)| {
            let (mut g, _) = exported(false);
            edit(&mut g);
            crate::infer_types(&mut g).unwrap();
            FuseAttention.run(&mut g, &context(true)).unwrap() == Changed::No
        };
        let producer = |g: &Graph, name: &str| g.value(g.find(name).unwrap()).producer().unwrap().0;
        assert!(refused(&|g| {
            let sm = producer(g, "p");
            *g.node_op_mut(sm) = Op::Softmax(SoftmaxAttrs { axis: 2 });
        }));
        assert!(refused(&|g| {
            let wide = g.add_input("wide", TypeInfo::new(DType::F32, Shape::fixed(&[5, 1, 1, 8, 8])));
            let add = producer(g, "masked");
            g.set_input(add, 1, Some(wide));
        }));
        assert!(refused(&|g| {
            let t = g.add_initializer("t", mpc_ir::Tensor::from_f64_as(DType::F32, vec![1], &[0.5]));
            let mul = producer(g, "scaled");
            g.set_input(mul, 1, Some(t));
        }));
        // The same chain with the scalar on the left of its Mul is fused.
        assert!(!refused(&|g| {
            let mul = producer(g, "scaled");
            let (l, r) = (g.node(mul).input(0), g.node(mul).input(1));
            g.set_input(mul, 0, r);
            g.set_input(mul, 1, l);
        }));
    }

    /// Without the option, under fp32, or with the probabilities read elsewhere, nothing changes.
    #[test]
    fn leaves_what_it_must_not_fuse() {
        for (probs_out, cx) in [(false, context(false)), (false, Context::default()), (true, context(true))] {
            let (mut g, _) = exported(probs_out);
            let before = mpc_ir::text::to_summary(&g).unwrap();
            assert_eq!(FuseAttention.run(&mut g, &cx).unwrap(), Changed::No);
            assert_eq!(mpc_ir::text::to_summary(&g).unwrap(), before);
        }
    }
}
