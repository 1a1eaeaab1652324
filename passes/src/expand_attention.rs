//! ONNX's `Attention` operator (opset 23 and later) as the standard ops of its definition.
//!
//! torch.onnx writes `F.scaled_dot_product_attention` as one `Attention` node from opset 23. Its
//! definition is a chain of standard ops: Q and Kᵀ each scaled by √scale (in their dtype), their
//! product, a soft cap, an additive bias (the mask, boolean or additive, and the causal mask),
//! Softmax over the keys (in `softmax_precision`), rows whose every key is masked set to 0, and the
//! product with V; 3-D inputs are split into heads first and merged after, and grouped-query K
//! and V heads are repeated. Written as those ops the node runs on every device, the precision
//! pass colours it (the products low, the softmax as the policy says), the training compiler
//! differentiates it, and `--fused-attention` fuses it back into one flash-attention node.
//!
//! Expanded: 3-D and 4-D inputs, grouped-query heads, a boolean or additive mask as wide as the
//! keys, `is_causal` without a cache (key j seen from query i when j ≤ i), `scale`, `softcap`,
//! `softmax_precision`, a sliding window where both sequence lengths are fixed, and the outputs
//! `present_key` / `present_value` (K and V themselves without a cache) and `qk_matmul_output`
//! (each of its four modes; modes 0 and 1 both the soft-capped product, as the onnx package's
//! reference gives them). Left as the opaque node, which no device runs: a KV cache (`past_key`,
//! `past_value`), `nonpad_kv_seqlen`, a mask narrower than the keys (which the definition pads),
//! a sliding window over lengths not fixed, unknown attributes, an unknown head size where the
//! scale is not given, and grouped heads of an unknown size.
//!
//! The rows whose every key is masked are found as the definition's NaN probabilities
//! (`Where(IsNaN(P), 0, P)`, PyTorch's own export of scaled_dot_product_attention), not from the
//! bias alone: the two agree unless a score is infinite or NaN (Q or K holding one, or f16
//! scores overflowing).

use mpc_ir::attr::Attr;
use mpc_ir::ops::{CastAttrs, ReshapeAttrs, SoftmaxAttrs, TransposeAttrs, TriluAttrs};
use mpc_ir::{DType, Dim, Graph, NodeId, Op, Tensor, ValueId};

use crate::train::build::Builder;
use crate::{infer_types, Changed, Context, Pass, Result};

pub struct ExpandAttention;

impl Pass for ExpandAttention {
    fn name(&self) -> &'static str {
        "expand-attention"
    }

    fn run(&self, g: &mut Graph, _cx: &Context) -> Result<Changed> {
        let nodes: Vec<NodeId> = g
            .node_ids()
            .filter(|&n| matches!(&g.node(n).op, Op::Opaque(o) if o.domain.is_empty() && o.op_type == "Attention"))
            .collect();
        let mut changed = Changed::No;
        for n in nodes {
            if let Some(spec) = Spec::of(g, n) {
                expand(g, n, &spec);
                changed = Changed::Yes;
            }
        }
        if changed == Changed::Yes {
            infer_types(g)?;
        }
        Ok(changed)
    }
}

/// What one Attention node computes, where it can be expanded.
struct Spec {
    q: ValueId,
    k: ValueId,
    v: ValueId,
    mask: Option<ValueId>,
    /// T, the dtype of Q, K and V.
    dtype: DType,
    /// √scale, rounded to T as the definition does.
    root_scale: f64,
    causal: bool,
    /// The sliding window's reach to the left and right of each query (-1: unbounded).
    window: (i64, i64),
    softcap: f64,
    /// The dtype the softmax runs in, where it is not T.
    softmax_dtype: Option<DType>,
    qk_mode: i64,
    /// For 3-D inputs: the heads of Q and of K and V.
    heads: Option<(i64, i64)>,
    /// How many query heads share one K/V head (1 without grouping), the query heads, and the
    /// head sizes of K and V (to merge the repeated heads).
    group: i64,
    q_heads: i64,
    kv_head_dims: (i64, i64),
    /// The causal mask's [q, kv] sizes where both are fixed (a constant), else none (computed).
    fixed_lengths: Option<(u64, u64)>,
}

impl Spec {
    fn of(g: &Graph, n: NodeId) -> Option<Spec> {
        let node = g.node(n);
        let Op::Opaque(o) = &node.op else { return None };
        let mut attrs = std::collections::HashMap::new();
        for (name, a) in &o.attrs {
            attrs.insert(name.as_str(), a.clone());
        }
        let int = |k: &str, default: i64| match attrs.get(k) {
            None => Some(default),
            Some(Attr::Int(v)) => Some(*v),
            Some(_) => None,
        };
        let float = |k: &str| match attrs.get(k) {
            None => Some(None),
            Some(Attr::Float(v)) => Some(Some(*v as f64)),
            Some(_) => None,
        };
        // Every attribute must be one this expansion models.
        let known = [
            "is_causal",
            "kv_num_heads",
            "left_window_size",
            "right_window_size",
            "q_num_heads",
            "qk_matmul_output_mode",
            "scale",
            "softcap",
            "softmax_precision",
        ];
        if o.attrs.iter().any(|(name, _)| !known.contains(&name.as_str())) {
            return None;
        }
        // No cache: past_key, past_value, nonpad_kv_seqlen absent.
        if (4..node.inputs().len()).any(|i| node.input(i).is_some()) {
            return None;
        }
        let (q, k, v) = (node.input(0)?, node.input(1)?, node.input(2)?);
        let mask = node.input(3);
        let dtype = g.ty(q).dtype.filter(|d| d.is_float())?;
        if [k, v].iter().any(|&x| g.ty(x).dtype != Some(dtype)) {
            return None;
        }
        let shape = |x: ValueId| g.ty(x).shape.clone();
        let (qs, ks, vs) = (shape(q)?, shape(k)?, shape(v)?);
        let rank = qs.rank();
        if ks.rank() != rank || vs.rank() != rank || !(rank == 3 || rank == 4) {
            return None;
        }
        let fixed = |d: &Dim| d.fixed().map(|x| x as i64);
        let (q_heads, kv_heads, heads) = if rank == 3 {
            let (qh, kvh) = (int("q_num_heads", 0)?, int("kv_num_heads", 0)?);
            if qh <= 0 || kvh <= 0 {
                return None;
            }
            (qh, kvh, Some((qh, kvh)))
        } else {
            (fixed(&qs.dims()[1])?, fixed(&ks.dims()[1])?, None)
        };
        if kv_heads <= 0 || q_heads % kv_heads != 0 {
            return None;
        }
        // Head sizes: Q's (for the default scale), K's and V's (for grouped heads).
        let head = |s: &mpc_ir::Shape, h: i64| -> Option<i64> {
            let last = fixed(s.dims().last()?)?;
            Some(if rank == 3 { (last % h == 0).then_some(last / h)? } else { last })
        };
        let scale = match float("scale")? {
            Some(s) => s,
            None => 1.0 / (head(&qs, q_heads)? as f64).sqrt(),
        };
        let root_scale = Tensor::from_f64_as(dtype, vec![], &[scale.sqrt()]).to_f64_vec()[0];
        let group = q_heads / kv_heads;
        let kv_head_dims = if group > 1 { (head(&ks, kv_heads)?, head(&vs, kv_heads)?) } else { (0, 0) };
        let softmax_dtype = match int("softmax_precision", 0)? {
            0 => None,
            p => Some(DType::from_onnx_code(p as i32).ok()?).filter(|&d| d != dtype && d.is_float()),
        };
        let qk_mode = int("qk_matmul_output_mode", 0)?;
        if !(0..=3).contains(&qk_mode) {
            return None;
        }
        let causal = int("is_causal", 0)? != 0;
        let window = (int("left_window_size", -1)?, int("right_window_size", -1)?);
        if window.0 < -1 || window.1 < -1 {
            return None;
        }
        // The sequence lengths: dim 2 of 4-D inputs, dim 1 of 3-D ones. A sliding window needs
        // them fixed (its mask a constant).
        let seq = |s: &mpc_ir::Shape| s.dims()[rank - 2].fixed();
        let fixed_lengths = seq(&qs).zip(seq(&ks));
        if window != (-1, -1) && fixed_lengths.is_none() {
            return None;
        }
        // A mask as wide as the keys (the definition pads a narrower one, which only a cache makes).
        if let Some(m) = mask {
            let ms = shape(m)?;
            let keys = ms.dims().last()?;
            // (A mask one key wide is padded too, not broadcast: only as wide as the keys.)
            if ms.rank() == 0 || ms.rank() > 4 || keys != &ks.dims()[rank - 2] || matches!(keys, Dim::Unknown) {
                return None;
            }
            if !matches!(g.ty(m).dtype, Some(DType::Bool)) && g.ty(m).dtype != Some(dtype) {
                return None;
            }
        }
        let softcap = float("softcap")?.unwrap_or(0.0);
        Some(Spec {
            q,
            k,
            v,
            mask,
            dtype,
            root_scale,
            causal,
            window,
            softcap,
            softmax_dtype,
            qk_mode,
            heads,
            group,
            q_heads,
            kv_head_dims,
            fixed_lengths,
        })
    }
}

fn transpose(b: &mut Builder, x: ValueId, perm: &[i64]) -> ValueId {
    b.op("transpose", Op::Transpose(TransposeAttrs { perm: Some(perm.to_vec()) }), &[x])
}

fn reshape(b: &mut Builder, x: ValueId, dims: &[i64]) -> ValueId {
    let s = b.ints(dims);
    b.op("reshape", Op::Reshape(ReshapeAttrs { allowzero: false }), &[x, s])
}

/// A constant of `dtype` (rank 0), named after the node.
fn constant(b: &mut Builder, what: &str, x: f64, dtype: DType) -> ValueId {
    let name = format!("{}.{what}", b.base);
    b.init(&name, Tensor::from_f64_as(dtype, vec![], &[x]))
}

fn expand(g: &mut Graph, n: NodeId, s: &Spec) {
    let node = g.node(n);
    let outputs: Vec<Option<ValueId>> =
        (0..4).map(|i| node.outputs().get(i).copied().filter(|&o| !g.name(o).is_empty())).collect();
    let base = if node.name.is_empty() { g.name(node.outputs()[0]).to_string() } else { node.name.clone() };
    let mut b = Builder::new(g);
    b.at(&base);
    let dt = s.dtype;
    // Heads: 3-D [B, S, H·D] → [B, H, S, D].
    let split = |b: &mut Builder, x: ValueId, h: i64| {
        let x4 = reshape(b, x, &[0, 0, h, -1]);
        transpose(b, x4, &[0, 2, 1, 3])
    };
    let (q, k, v) = match s.heads {
        Some((qh, kvh)) => (split(&mut b, s.q, qh), split(&mut b, s.k, kvh), split(&mut b, s.v, kvh)),
        None => (s.q, s.k, s.v),
    };
    // Grouped K/V heads, each repeated for its queries: [B, Hkv, S, D] → [B, Hkv·G, S, D].
    let (kr, vr) = if s.group > 1 {
        let (g, h, (dk, dv)) = (s.group, s.q_heads, s.kv_head_dims);
        (repeat_heads(&mut b, k, g, h, dk), repeat_heads(&mut b, v, g, h, dv))
    } else {
        (k, v)
    };
    let c = constant(&mut b, "root_scale", s.root_scale, dt);
    let qs = b.op("q_scaled", Op::Mul, &[q, c]);
    let kt = transpose(&mut b, kr, &[0, 1, 3, 2]);
    let kts = b.op("kt_scaled", Op::Mul, &[kt, c]);
    let mut scores = b.op("qk", Op::MatMul, &[qs, kts]);
    if s.softcap > 0.0 {
        let cap = constant(&mut b, "softcap", s.softcap, dt);
        let x = b.op("softcap_div", Op::Div, &[scores, cap]);
        let t = b.op("softcap_tanh", Op::Tanh, &[x]);
        scores = b.op("softcap_mul", Op::Mul, &[t, cap]);
    }
    let capped = scores;
    if let Some(bias) = bias(&mut b, s, q, kr) {
        scores = b.op("masked", Op::Add, &[scores, bias]);
    }
    let biased = scores;
    if let Some(p) = s.softmax_dtype {
        scores = b.op("softmax_in", Op::Cast(CastAttrs { to: p, ..Default::default() }), &[scores]);
    }
    let mut probs = b.op("softmax", Op::Softmax(SoftmaxAttrs { axis: -1 }), &[scores]);
    if s.softmax_dtype.is_some() {
        probs = b.op("softmax_out", Op::Cast(CastAttrs { to: dt, ..Default::default() }), &[probs]);
    }
    // A row whose every key is masked: NaN probabilities, 0 as the definition has them (the
    // causal mask alone leaves every row a key).
    if s.mask.is_some() || s.window != (-1, -1) {
        let nan = b.op("masked_row", Op::IsNaN, &[probs]);
        let zero = constant(&mut b, "zero_p", 0.0, dt);
        probs = b.op("probs", Op::Where, &[nan, zero, probs]);
    }
    let mut y = b.op("y", Op::MatMul, &[probs, vr]);
    if s.heads.is_some() {
        let t = transpose(&mut b, y, &[0, 2, 1, 3]);
        y = reshape(&mut b, t, &[0, 0, -1]);
    }
    // (Modes 0 and 1 both give the soft-capped product: the onnx package's reference does.)
    let qk_out = match s.qk_mode {
        0 | 1 => capped,
        2 => biased,
        _ => probs,
    };
    // Each output the graph reads: Y, K and V (the present key and value without a cache), the
    // scores in the mode asked. A value read by name (a graph output, a subgraph's capture) keeps
    // its name, on an Identity of its value (K and V may be graph inputs).
    let mut renamed = Vec::new();
    for (old, new) in outputs.into_iter().zip([y, k, v, qk_out]) {
        let Some(old) = old else { continue };
        let new = if b.g.name_is_referenced(old) {
            let id = b.op("output", Op::Identity, &[new]);
            renamed.push((id, b.g.name(old).to_string()));
            id
        } else {
            new
        };
        b.g.replace_uses(old, new);
    }
    let g = b.g;
    g.remove_node(n);
    for (v, name) in renamed {
        g.rename(v, &name);
    }
}

/// The scores' bias: the mask (a boolean one as 0 / -inf), and the causal (or windowed) mask of
/// the positions of `q` and `k` added to it; none without either.
fn bias(b: &mut Builder, s: &Spec, q: ValueId, k: ValueId) -> Option<ValueId> {
    let dt = s.dtype;
    let mut bias = s.mask.map(|m| {
        if b.g.ty(m).dtype == Some(DType::Bool) {
            let zero = constant(b, "zero", 0.0, dt);
            let minus_inf = constant(b, "minus_inf", f64::NEG_INFINITY, dt);
            b.op("mask_bias", Op::Where, &[m, zero, minus_inf])
        } else {
            m
        }
    });
    if s.causal || s.window != (-1, -1) {
        let causal = position_mask(b, q, k, s);
        bias = Some(match bias {
            Some(m) => b.op("bias", Op::Add, &[m, causal]),
            None => causal,
        });
    }
    bias
}

/// K or V heads repeated `group` times each, in order ([h0, h0, h1, h1, ...]): [B, Hkv, S, D] →
/// [B, `heads` = Hkv·group, S, D] (`d`, the head size, fixed).
fn repeat_heads(b: &mut Builder, x: ValueId, group: i64, heads: i64, d: i64) -> ValueId {
    let axes = b.ints(&[2]);
    let x5 = b.op("unsqueeze", Op::Unsqueeze, &[x, axes]);
    let reps = b.ints(&[1, 1, group, 1, 1]);
    let wide = b.op("expand", Op::Expand, &[x5, reps]);
    // [B, Hkv, G, S, D] → [B, Hkv·G, S, D]: B copied (0), S the rest (-1).
    reshape(b, wide, &[0, heads, -1, d])
}

/// The bias [q, kv] in T of the queries' positions: 0 where query i sees key j, -inf elsewhere.
/// Causal: j ≤ i; a sliding window: i - left ≤ j ≤ i + right (each bound where not -1); both
/// where both are asked. A constant where both lengths are fixed; else (causal only) made from the
/// lengths of Q and K, as PyTorch's export makes it.
fn position_mask(b: &mut Builder, q: ValueId, k: ValueId, s: &Spec) -> ValueId {
    let dt = s.dtype;
    if let Some((lq, lk)) = s.fixed_lengths {
        let (left, right) = s.window;
        let sees =
            |i: i64, j: i64| (!s.causal || j <= i) && (left < 0 || i - j <= left) && (right < 0 || j - i <= right);
        let values: Vec<f64> = (0..(lq * lk) as i64)
            .map(|e| if sees(e / lk as i64, e % lk as i64) { 0.0 } else { f64::NEG_INFINITY })
            .collect();
        let name = format!("{}.position_mask", b.base);
        return b.init(&name, Tensor::from_f64_as(dt, vec![lq, lk], &values));
    }
    let lengths = |b: &mut Builder, x: ValueId| {
        let shape = b.op("shape", Op::Shape(Default::default()), &[x]);
        let (start, end) = (b.ints(&[2]), b.ints(&[3]));
        b.op("length", Op::Slice, &[shape, start, end])
    };
    let (lq, lk) = (lengths(b, q), lengths(b, k));
    let size = b.op("causal_size", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &[lq, lk]);
    let ones = b.full("causal_ones", size, 1.0, dt);
    let lower = b.op("causal_lower", Op::Trilu(TriluAttrs { upper: false }), &[ones]);
    let zero = constant(b, "causal_zero", 0.0, dt);
    let above = b.op("causal_above", Op::Equal, &[lower, zero]);
    let minus_inf = constant(b, "causal_minus_inf", f64::NEG_INFINITY, dt);
    b.op("causal_mask", Op::Where, &[above, minus_inf, zero])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(body: &str) -> Graph {
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 23\ngraph \"t\"\n  {body}\nend\n");
        let mut g = mpc_ir::text::parse(&text, None).unwrap_or_else(|e| panic!("{e}\n{text}"));
        infer_types(&mut g).unwrap();
        g
    }

    fn ops(g: &Graph) -> Vec<String> {
        g.node_ids().map(|n| g.node(n).op.op_type().to_string()).collect()
    }

    /// The present key and value without a cache are K and V; as graph outputs they keep their
    /// names (on an Identity: K and V are graph inputs here).
    #[test]
    fn present_key_and_value_without_a_cache_are_k_and_v() {
        let mut g = graph(
            "input %0 \"q\": f32[2,3,4,8]\n  input %1 \"k\": f32[2,3,5,8]\n  input %2 \"v\": f32[2,3,5,8]\n  \
             %3 \"y\": f32[2,3,4,8], %4 \"pk\": f32[2,3,5,8], %5 \"pv\": f32[2,3,5,8] = ::Attention(%0, %1, %2)\n  \
             output %3\n  output %4\n  output %5",
        );
        assert_eq!(ExpandAttention.run(&mut g, &Context::default()).unwrap(), Changed::Yes);
        crate::verify(&g).unwrap();
        assert!(!ops(&g).iter().any(|o| o == "Attention"), "{:?}", ops(&g));
        let names: Vec<&str> = g.outputs().iter().map(|&o| g.name(o)).collect();
        assert_eq!(names, ["y", "pk", "pv"]);
        let (p, _) = g.value(g.outputs()[1]).producer().unwrap();
        assert_eq!((g.node(p).op.op_type(), g.node(p).input(0)), ("Identity", g.find("k")));
        // The default scale, 1/√8, split as √ over Q and Kᵀ.
        let c = g.initializers().find(|&v| g.name(v).ends_with(".root_scale")).unwrap();
        let c = g.constant(c).unwrap().to_f64_vec()[0];
        assert!((c - (1.0f64 / 8.0).sqrt().sqrt()).abs() < 1e-7, "{c}");
    }

    /// A KV cache, a mask narrower than the keys (which the definition pads) or K without heads
    /// leaves the node as it is.
    #[test]
    fn what_it_cannot_expand_stays_opaque() {
        let qkv = "input %0 \"q\": f32[2,3,4,8]\n  input %1 \"k\": f32[2,3,5,8]\n  input %2 \"v\": f32[2,3,5,8]\n  ";
        for body in [
            "input %3 \"past_k\": f32[2,3,6,8]\n  input %4 \"past_v\": f32[2,3,6,8]\n  \
             %5 \"y\": f32[2,3,4,8] = ::Attention(%0, %1, %2, _, %3, %4)\n  output %5"
                .to_string(),
            "input %3 \"m\": f32[1,1,4,1]\n  %5 \"y\": f32[2,3,4,8] = ::Attention(%0, %1, %2, %3)\n  output %5"
                .to_string(),
        ] {
            let mut g = graph(&format!("{qkv}{body}"));
            assert_eq!(ExpandAttention.run(&mut g, &Context::default()).unwrap(), Changed::No, "{body}");
            assert_eq!(ops(&g), ["Attention"]);
        }
        let mut g = graph(
            "input %0 \"q\": f32[2,3,4,8]\n  input %1 \"k\": f32[2,0,5,8]\n  input %2 \"v\": f32[2,0,5,8]\n  \
             %3 \"y\": f32[2,3,4,8] = ::Attention(%0, %1, %2)\n  output %3",
        );
        assert_eq!(ExpandAttention.run(&mut g, &Context::default()).unwrap(), Changed::No);
    }
}
