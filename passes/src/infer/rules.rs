//! Per-op type rules. One exhaustive `match`: a new op does not compile until it has a rule.

use mpc_ir::ops::AttentionLayout;
use mpc_ir::{normalize_axis, DType, Dim, Graph, Kind, NodeId, Op, Shape, TypeInfo};

use super::known::{Known, KnownValues};
use super::movement::{concat, einsum, pad, reshape, resize, slice, split, squeeze, unsqueeze};
use super::nn::{conv, conv_transpose, loss_shapes, per_channel, per_feature, pool};
use super::{axis_in, indexing};

pub(crate) struct NodeCx<'a> {
    pub g: &'a Graph,
    pub n: NodeId,
    pub known: &'a KnownValues,
}

pub(super) type R = Result<Vec<TypeInfo>, String>;

impl NodeCx<'_> {
    pub(super) fn ty(&self, i: usize) -> Option<&TypeInfo> {
        self.g.node(self.n).input(i).map(|v| self.g.ty(v))
    }
    pub(super) fn dt(&self, i: usize) -> Option<DType> {
        self.ty(i).and_then(|t| t.dtype)
    }
    pub(super) fn sh(&self, i: usize) -> Option<&Shape> {
        self.ty(i).and_then(|t| t.shape.as_ref())
    }
    pub(super) fn known(&self, i: usize) -> Option<&Known> {
        self.g.node(self.n).input(i).and_then(|v| self.known.get(v))
    }
    pub(super) fn ints(&self, i: usize) -> Option<Vec<i64>> {
        self.known(i)?.ints()
    }
    pub(super) fn has(&self, i: usize) -> bool {
        self.g.node(self.n).input(i).is_some()
    }
    pub(super) fn n_inputs(&self) -> usize {
        self.g.node(self.n).inputs().len()
    }
    pub(super) fn n_outputs(&self) -> usize {
        self.g.node(self.n).outputs().len()
    }
    /// All present inputs in `range` share one dtype.
    fn same_dtype(&self, range: std::ops::Range<usize>) -> Result<Option<DType>, String> {
        let mut seen: Option<DType> = None;
        for i in range {
            if let (Some(d), Some(s)) = (self.dt(i), seen) {
                if d != s {
                    return Err(format!("input dtypes differ: {s} and {d}"));
                }
            }
            seen = seen.or(self.dt(i));
        }
        Ok(seen)
    }
}

pub(super) fn t(dtype: Option<DType>, shape: Option<Shape>) -> TypeInfo {
    TypeInfo { dtype, shape }
}

fn same(cx: &NodeCx, i: usize) -> TypeInfo {
    cx.ty(i).cloned().unwrap_or_default()
}

/// The types of node `cx.n`'s outputs, by the rules of its op's family ([`Op::kind`]).
pub(crate) fn infer_node(cx: &NodeCx) -> R {
    match cx.g.node(cx.n).op.kind() {
        Kind::Unary(_)
        | Kind::Arith(_)
        | Kind::Compare(_)
        | Kind::Predicate
        | Kind::Bitwise
        | Kind::Variadic
        | Kind::Select
        | Kind::Cast
        | Kind::ActivationGrad
        | Kind::RowWise => elementwise(cx),
        Kind::MatMul | Kind::Conv | Kind::Attention => linear(cx),
        Kind::Norm | Kind::Pool | Kind::Loss => layer(cx),
        Kind::Reduce(_) | Kind::Index | Kind::Scan => index(cx),
        Kind::View | Kind::Movement => movement(cx),
        Kind::Shape | Kind::Random | Kind::Train | Kind::Collective | Kind::Opaque => other(cx),
    }
}

/// The element-wise ops, the row-wise softmaxes and the activations' gradients.
fn elementwise(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        mpc_ir::unary_ops!() => vec![same(cx, 0)],
        Op::IsNaN | Op::IsInf(_) => vec![t(Some(DType::Bool), cx.sh(0).cloned())],
        Op::Softmax(_) | Op::LogSoftmax(_) => vec![same(cx, 0)],
        Op::Clip => {
            super::one_value(cx, 1, "min")?;
            super::one_value(cx, 2, "max")?;
            cx.same_dtype(0..cx.n_inputs())?;
            vec![same(cx, 0)]
        }
        Op::Not => vec![same(cx, 0)],
        mpc_ir::bitwise_ops!() => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            let bits = op.bitwise().expect("a bit operation");
            if let Some(d) = d.filter(|&d| !bits.accepts(d)) {
                return Err(format!("{} takes integers, not {d}", op.op_type()));
            }
            vec![t(d, broadcast_all(cx, 0..cx.n_inputs())?)]
        }
        Op::PRelu => {
            let d = cx.same_dtype(0..2)?;
            // The slope broadcasts to X one way: the output has X's shape.
            if let (Some(x), Some(b)) = (cx.sh(0), broadcast_all(cx, 0..2)?) {
                let fits = b.rank() == x.rank()
                    && x.0.iter().zip(&b.0).all(|(xd, bd)| check_eq(xd, bd, "PRelu's dims").is_ok());
                if !fits {
                    return Err(format!(
                        "the slope {} does not broadcast to the input's shape {x} one way",
                        cx.sh(1).map(|s| s.to_string()).unwrap_or_default()
                    ));
                }
            }
            vec![t(d, cx.sh(0).cloned())]
        }
        Op::Pow => vec![t(cx.dt(0), broadcast_all(cx, 0..2)?)],
        // The other arithmetic and Sum, Mean, Max, Min: operands of one dtype, broadcast.
        mpc_ir::arith_ops!() | Op::Sum | Op::Mean | Op::Max | Op::Min => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            vec![t(d, broadcast_all(cx, 0..cx.n_inputs())?)]
        }
        mpc_ir::compare_ops!() => {
            cx.same_dtype(0..2)?;
            vec![t(Some(DType::Bool), broadcast_all(cx, 0..2)?)]
        }
        Op::Where => {
            let d = cx.same_dtype(1..3)?;
            vec![t(d, broadcast_all(cx, 0..3)?)]
        }
        Op::Cast(a) => vec![t(Some(a.to), cx.sh(0).cloned())],
        Op::GeluGrad(_) => vec![t(cx.dt(0), cx.sh(1).cloned())],
        Op::SoftmaxGrad(_) | Op::ReluGrad => {
            cx.same_dtype(0..2)?;
            vec![t(cx.dt(0), broadcast_all(cx, 0..2)?)]
        }
        op => unreachable!("{} is not of the families elementwise infers", op.op_type()),
    })
}

/// The products: MatMul, Gemm, Einsum, the convolutions and attention (and their gradients).
fn linear(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        Op::MatMul => {
            let d = cx.same_dtype(0..2)?;
            vec![t(d, matmul(cx.sh(0), cx.sh(1))?)]
        }
        Op::Gemm(a) => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            let shape = match (cx.sh(0), cx.sh(1)) {
                (Some(x), Some(w)) if x.rank() == 2 && w.rank() == 2 => {
                    let (m, k1) = if a.transA { (&x.0[1], &x.0[0]) } else { (&x.0[0], &x.0[1]) };
                    let (k2, n) = if a.transB { (&w.0[1], &w.0[0]) } else { (&w.0[0], &w.0[1]) };
                    check_eq(k1, k2, "Gemm inner dimensions")?;
                    let out = Shape(vec![m.clone(), n.clone()]);
                    // C broadcasts to [M, N] one way: each of its dims is the output's or 1.
                    if let Some(c) = cx.sh(2) {
                        let fits = c.rank() <= 2
                            && c.0.iter().rev().zip(out.0.iter().rev()).all(|(cd, od)| {
                                match (cd.fixed(), od.fixed()) {
                                    (Some(p), Some(q)) => p == q || p == 1,
                                    _ => true,
                                }
                            });
                        if !fits {
                            return Err(format!("C {c} does not broadcast to the output {out}"));
                        }
                    }
                    Some(out)
                }
                (Some(x), _) if x.rank() != 2 => return Err(format!("Gemm needs 2-D inputs, A is {x}")),
                (_, Some(w)) if w.rank() != 2 => return Err(format!("Gemm needs 2-D inputs, B is {w}")),
                _ => None,
            };
            vec![t(d, shape)]
        }
        Op::Conv(a) => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            vec![t(d, conv(cx, a)?)]
        }
        Op::ConvTranspose(a) => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            vec![t(d, conv_transpose(cx, a)?)]
        }
        Op::Einsum(a) => vec![t(cx.same_dtype(0..cx.n_inputs())?, einsum(cx, &a.equation)?)],
        // ---- ai.mpc (training graphs): gradients take dY's dtype and their operand's shape ----
        Op::ConvGrad(_) => {
            let cout = cx.sh(2).and_then(|s| s.dims().first().cloned()).unwrap_or(Dim::Unknown);
            vec![t(cx.dt(0), cx.sh(1).cloned()), t(cx.dt(0), cx.sh(2).cloned()), t(cx.dt(0), Some(Shape(vec![cout])))]
        }
        // (Y, LSE): Y as Q, LSE over Q's rows in f32 (f64 for f64 operands).
        Op::Attention(a) => {
            let d = cx.same_dtype(0..3)?;
            let (q, lse) = attention_operands(cx, 0, a.layout)?;
            let lse_dt = if d == Some(DType::F64) { DType::F64 } else { DType::F32 };
            vec![t(d, q), t(Some(lse_dt), lse)]
        }
        // (dQ, dK, dV): Q's, K's and V's types.
        Op::AttentionGrad(a) => {
            cx.same_dtype(0..5)?;
            attention_operands(cx, 1, a.layout)?;
            vec![same(cx, 1), same(cx, 2), same(cx, 3)]
        }
        op => unreachable!("{} is not of the families linear infers", op.op_type()),
    })
}

/// The normalisations, pools and losses (and their gradients).
fn layer(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        Op::LRN(_) => {
            per_channel(cx, 2, &[])?;
            vec![same(cx, 0)]
        }
        Op::InstanceNormalization(_) | Op::GroupNormalization(_) => {
            let min_rank = if matches!(cx.g.node(cx.n).op, Op::GroupNormalization(_)) { 2 } else { 3 };
            per_channel(cx, min_rank, &[(1, "scale"), (2, "bias")])?;
            vec![same(cx, 0)]
        }
        Op::BatchNormalization(_) => {
            per_channel(cx, 2, &[(1, "scale"), (2, "bias"), (3, "mean"), (4, "variance")])?;
            let mut out = vec![same(cx, 0)];
            for i in 1..cx.n_outputs() {
                out.push(t(cx.dt(3 + (i - 1).min(1)), cx.sh(3).cloned()));
            }
            out
        }
        Op::LayerNormalization(a) => {
            if let Some(s) = cx.sh(0) {
                per_feature(cx, s, axis_in(a.axis, s)?, &[1, 2])?;
            }
            let x = same(cx, 0);
            let stats_shape = x.shape.as_ref().and_then(|s| {
                let axis = normalize_axis(a.axis, s.rank())?;
                Some(Shape(
                    s.0.iter().enumerate().map(|(i, d)| if i < axis { d.clone() } else { Dim::Fixed(1) }).collect(),
                ))
            });
            let stash = if a.stash_type == 1 { Some(DType::F32) } else { x.dtype };
            let mut out = vec![x];
            for _ in 1..cx.n_outputs() {
                out.push(t(stash, stats_shape.clone()));
            }
            out
        }
        Op::MaxPool(a) | Op::AveragePool(a) => {
            let shape = pool(cx, a)?;
            let mut out = vec![t(cx.dt(0), shape.clone())];
            if cx.n_outputs() > 1 {
                out.push(t(Some(DType::I64), shape));
            }
            out
        }
        Op::GlobalAveragePool | Op::GlobalMaxPool => {
            let shape = cx.sh(0).map(|s| {
                Shape(s.0.iter().enumerate().map(|(i, d)| if i < 2 { d.clone() } else { Dim::Fixed(1) }).collect())
            });
            vec![t(cx.dt(0), shape)]
        }
        Op::SoftmaxCrossEntropyLoss(a) | Op::NegativeLogLikelihoodLoss(a) => {
            loss_shapes(cx)?;
            let loss_shape =
                if a.reduction == mpc_ir::ops::Reduction::None { cx.sh(1).cloned() } else { Some(Shape::scalar()) };
            let mut out = vec![t(cx.dt(0), loss_shape)];
            if cx.n_outputs() > 1 {
                out.push(same(cx, 0));
            }
            out
        }
        Op::MaxPoolGrad(_) | Op::AveragePoolGrad(_) => vec![t(cx.dt(0), cx.sh(1).cloned())],
        Op::BatchNormalizationGrad(_) | Op::LayerNormalizationGrad(_) => {
            vec![t(cx.dt(0), cx.sh(1).cloned()), t(cx.dt(0), cx.sh(2).cloned()), t(cx.dt(0), cx.sh(2).cloned())]
        }
        Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_) => vec![same(cx, 1)],
        op => unreachable!("{} is not of the families layer infers", op.op_type()),
    })
}

/// The reductions, scans, gathers, scatters, top-k, arg-max/min and RoiAlign.
fn index(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        Op::CumSum(_) | Op::CumProd(_) | Op::CumProdGrad(_) => vec![same(cx, 0)],
        Op::RoiAlign(a) => vec![t(cx.same_dtype(0..2)?, roi_align(cx, a)?)],
        Op::RoiAlignGrad(_) => vec![same(cx, 1)],
        mpc_ir::reduce_ops!() => {
            let (_, a) = op.reduction().ok_or("a reduction without its attributes")?;
            // The axes operand: absent, or its values (`None` where they are not known).
            let axes = if cx.has(1) { Some(cx.ints(1)) } else { None };
            let shape = match (cx.sh(0), axes) {
                (Some(s), Some(None)) if a.keepdims => Some(Shape(vec![Dim::Unknown; s.rank()])),
                (Some(_), Some(None)) | (None, _) => None,
                (Some(s), ax) => {
                    match mpc_ir::geometry::reduce_axes(ax.flatten().as_deref(), s.rank(), a.noop_with_empty_axes)? {
                        Some(axes) => Some(reduced(s, &axes, a.keepdims)),
                        None => Some(s.clone()),
                    }
                }
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::ArgMax(a) | Op::ArgMin(a) => {
            if let Some(s) = cx.sh(0) {
                if s.0[axis_in(a.axis, s)?].fixed() == Some(0) {
                    return Err(format!("axis {} of {s} is empty: there is no index to take", a.axis));
                }
            }
            let shape = cx.sh(0).map(|s| axis_in(a.axis, s).map(|ax| reduced(s, &[ax], a.keepdims))).transpose()?;
            vec![t(Some(DType::I64), shape)]
        }
        Op::TopK(a) => {
            let k = match cx.ints(1).as_deref() {
                Some(&[k]) if k >= 0 => Some(k as u64),
                Some(&[k]) => return Err(format!("k is {k}; it must not be negative")),
                Some(v) => return Err(format!("k holds {} values, not one", v.len())),
                None => None,
            };
            let shape = match cx.sh(0) {
                Some(s) => {
                    let ax = axis_in(a.axis, s)?;
                    let mut out = s.clone();
                    if let (Some(k), Some(n)) = (k, s.0[ax].fixed()) {
                        if k > n {
                            return Err(format!("k is {k} but axis {} of {s} has {n} elements", a.axis));
                        }
                    }
                    out.0[ax] = k.map_or(Dim::Unknown, Dim::Fixed);
                    Some(out)
                }
                None => None,
            };
            vec![t(cx.dt(0), shape.clone()), t(Some(DType::I64), shape)]
        }
        Op::Gather(a) => {
            let shape = match (cx.sh(0), cx.sh(1)) {
                (Some(d), Some(i)) => {
                    let axis = normalize_axis(a.axis, d.rank()).ok_or(format!("axis {} out of range", a.axis))?;
                    let mut s = d.0[..axis].to_vec();
                    s.extend(i.0.iter().cloned());
                    s.extend(d.0[axis + 1..].iter().cloned());
                    Some(Shape(s))
                }
                _ => None,
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::GatherElements(_) => vec![t(cx.dt(0), cx.sh(1).cloned())],
        Op::GatherND(a) => indexing::gather_nd(cx, a.batch_dims)?,
        Op::ScatterND(_) => indexing::scatter_nd(cx)?,
        Op::ScatterElements(a) => indexing::scatter_elements(cx, a.axis)?,
        Op::GatherGrad(_) => {
            let shape = cx.known(2).map(|k| Shape(k.elems.iter().map(|e| e.dim()).collect()));
            vec![t(cx.dt(0), shape)]
        }
        op => unreachable!("{} is not of the families index infers", op.op_type()),
    })
}

/// The views and data movement.
fn movement(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        Op::Identity => vec![same(cx, 0)],
        Op::Trilu(_) => {
            if let Some(k) = cx.sh(1).filter(|k| k.numel() != Some(1) && k.as_fixed().is_some()) {
                return Err(format!("k is {k}, not one value"));
            }
            vec![same(cx, 0)]
        }
        Op::Reshape(a) => vec![t(cx.dt(0), reshape(cx, a.allowzero)?)],
        Op::Transpose(a) => {
            let shape = match cx.sh(0) {
                Some(s) => {
                    let perm: Vec<i64> = a.perm.clone().unwrap_or_else(|| (0..s.rank() as i64).rev().collect());
                    if perm.len() != s.rank() {
                        return Err(format!("perm {perm:?} does not match rank {}", s.rank()));
                    }
                    let dims = perm.iter().map(|&p| s.0.get(p as usize).cloned().ok_or(format!("bad perm {perm:?}")));
                    Some(Shape(dims.collect::<Result<_, _>>()?))
                }
                None => None,
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::Flatten(a) => {
            let shape = match cx.sh(0) {
                Some(s) => {
                    let r = s.rank() as i64;
                    let axis = if a.axis < 0 { a.axis + r } else { a.axis };
                    if !(0..=r).contains(&axis) {
                        return Err(format!("axis {} out of range for rank {r}", a.axis));
                    }
                    let (l, rt) = s.0.split_at(axis as usize);
                    Some(Shape(vec![product(l), product(rt)]))
                }
                None => None,
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::Squeeze => vec![t(cx.dt(0), squeeze(cx)?)],
        Op::Unsqueeze => vec![t(cx.dt(0), unsqueeze(cx)?)],
        Op::Concat(a) => {
            let d = cx.same_dtype(0..cx.n_inputs())?;
            vec![t(d, concat(cx, a.axis)?)]
        }
        Op::Split(a) => split(cx, a.axis, a.num_outputs)?,
        Op::Slice => vec![t(cx.dt(0), slice(cx)?)],
        Op::Expand => {
            // With the target's values unknown, its length still gives the rank.
            let target = match cx.known(1) {
                Some(k) => Some(Shape(k.elems.iter().map(|e| e.dim()).collect())),
                None => vector_len(cx, 1).map(|n| Shape(vec![Dim::Unknown; n])),
            };
            let shape = match (cx.sh(0), target) {
                (Some(x), Some(tg)) => broadcast(&[x, &tg])?,
                _ => None,
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::Tile => {
            // Repeats: a vector of one entry per dim, even where its values are not known.
            if let Some(r) = cx.sh(1) {
                match (r.dims(), cx.sh(0)) {
                    ([Dim::Fixed(n)], Some(s)) if *n != s.rank() as u64 => {
                        return Err(format!("{n} repeats for rank {}", s.rank()))
                    }
                    ([_], _) => {}
                    _ => return Err(format!("repeats must be 1-D, not of rank {}", r.rank())),
                }
            }
            if let Some(k) = cx.ints(1).and_then(|r| r.into_iter().find(|&k| k < 0)) {
                return Err(format!("repeats has {k}; each must be 0 or more"));
            }
            let shape = match (cx.sh(0), cx.ints(1)) {
                (Some(s), Some(r)) if r.len() == s.rank() => Some(Shape(
                    s.0.iter()
                        .zip(&r)
                        .map(|(d, &k)| match d.fixed() {
                            Some(d) => {
                                d.checked_mul(k as u64).map(Dim::Fixed).ok_or_else(|| format!("{d} × {k} overflows"))
                            }
                            None => Ok(Dim::Unknown),
                        })
                        .collect::<Result<_, _>>()?,
                )),
                (Some(s), Some(r)) => return Err(format!("{} repeats for rank {}", r.len(), s.rank())),
                (Some(s), _) => Some(Shape(vec![Dim::Unknown; s.rank()])),
                _ => None,
            };
            vec![t(cx.dt(0), shape)]
        }
        Op::Pad(_) => vec![t(cx.dt(0), pad(cx)?)],
        Op::Resize(_) => vec![t(cx.dt(0), resize(cx)?)],
        op => unreachable!("{} is not of the families movement infers", op.op_type()),
    })
}

/// Shapes and constants, dropout, the optimizer's ops, the collectives and opaque ops.
fn other(cx: &NodeCx) -> R {
    let op = &cx.g.node(cx.n).op;
    Ok(match op {
        Op::Dropout(_) | Op::SeededDropout(_) => {
            if matches!(cx.g.node(cx.n).op, Op::Dropout(_)) {
                super::one_value(cx, 1, "ratio")?;
                super::one_value(cx, 2, "training_mode")?;
            }
            let mut out = vec![same(cx, 0)];
            if cx.n_outputs() > 1 {
                out.push(t(Some(DType::Bool), cx.sh(0).cloned()));
            }
            out
        }
        Op::Constant(a) => vec![t(Some(a.value.dtype()), Some(Shape::fixed(a.value.shape())))],
        Op::ConstantOfShape(a) => {
            let dtype = a.value.as_ref().map_or(DType::F32, |v| v.dtype());
            if let Some(d) = cx.ints(0).and_then(|s| s.into_iter().find(|&d| d < 0)) {
                return Err(format!("the shape has {d}; each dim must be 0 or more"));
            }
            let shape = match cx.known(0) {
                Some(k) => Some(Shape(k.elems.iter().map(|e| e.dim()).collect())),
                None => vector_len(cx, 0).map(|n| Shape(vec![Dim::Unknown; n])),
            };
            vec![t(Some(dtype), shape)]
        }
        Op::Shape(a) => {
            let shape = cx.sh(0).map(|s| {
                let r = s.rank() as i64;
                let clamp = |x: i64| (if x < 0 { x + r } else { x }).clamp(0, r);
                let n = (clamp(a.end.unwrap_or(r)) - clamp(a.start)).max(0);
                Shape::fixed(&[n as u64])
            });
            vec![t(Some(DType::I64), shape.or(Some(Shape(vec![Dim::Unknown]))))]
        }
        Op::Size => vec![t(Some(DType::I64), Some(Shape::scalar()))],
        Op::Range => {
            for (i, what) in [(0, "start"), (1, "limit"), (2, "delta")] {
                super::one_value(cx, i, what)?;
            }
            let d = cx.same_dtype(0..3)?;
            let n = match (cx.ints(0), cx.ints(1), cx.ints(2)) {
                (Some(s), Some(l), Some(dl)) if s.len() == 1 && l.len() == 1 && dl.len() == 1 && dl[0] != 0 => {
                    let n = (l[0] - s[0] + dl[0] - dl[0].signum()) / dl[0];
                    Dim::Fixed(n.max(0) as u64)
                }
                // `Range(start, limit, 1)` up to a size: `limit - start` elements.
                _ => match (cx.ints(0).as_deref(), cx.known(1), cx.ints(2).as_deref()) {
                    (Some(&[s]), Some(k), Some(&[1])) if k.elems.len() == 1 => k.elems[0]
                        .dim()
                        .expr()
                        .and_then(|l| l.sub(&mpc_ir::SymExpr::constant(s)))
                        .map_or(Dim::Unknown, Dim::from_expr),
                    _ => Dim::Unknown,
                },
            };
            vec![t(d, Some(Shape(vec![n])))]
        }
        Op::Opaque(_) => return Err("opaque ops keep their declared types".into()),
        Op::AllFinite => vec![t(Some(DType::Bool), Some(Shape::scalar()))],
        Op::AllReduce(_) => vec![same(cx, 0)],
        Op::ReduceScatter(a) => vec![t(cx.dt(0), collective_shape(cx, a.world, false)?)],
        Op::AllGather(a) => vec![t(cx.dt(0), collective_shape(cx, a.world, true)?)],
        // The next values of the state inputs, in order: the parameter, its velocity or moments,
        // and its low-precision copy (the last input, f16 or bf16, when given).
        // An update's last input, when given, is its learning rate (an f32 scalar).
        Op::SgdUpdate(_) => {
            scalar_rate(cx, 6)?;
            update_outputs(cx, &[0, 3], 5)?
        }
        Op::AdamUpdate(_) => {
            scalar_rate(cx, 8)?;
            update_outputs(cx, &[0, 2, 3], 7)?
        }
        Op::LossScaleUpdate(_) => vec![same(cx, 0), same(cx, 1)],
        Op::LrSchedule(_) => {
            if !matches!(cx.dt(0), Some(DType::I64) | None) {
                return Err(format!("the step count is {}, not int64", cx.dt(0).map_or("?".into(), |d| d.to_string())));
            }
            scalar_rate(cx, 1)?;
            vec![t(Some(DType::F32), Some(Shape::scalar()))]
        }
        op => unreachable!("{} is not of the families other infers", op.op_type()),
    })
}

/// Checks that input `i`, when given, is a learning rate: an f32 value.
fn scalar_rate(cx: &NodeCx, i: usize) -> Result<(), String> {
    match cx.dt(i) {
        Some(d) if cx.has(i) && d != DType::F32 => Err(format!("the learning rate (input {i}) is {d}, not float32")),
        _ => Ok(()),
    }
}

/// An optimizer update's outputs: the types of its present `state` inputs, then of its
/// low-precision copy input `low` when present (which must be f16 or bf16, the parameter f32).
fn update_outputs(cx: &NodeCx, state: &[usize], low: usize) -> R {
    let mut out: Vec<TypeInfo> = state.iter().filter(|&&i| cx.has(i)).map(|&i| same(cx, i)).collect();
    if cx.has(low) {
        match (cx.dt(0), cx.dt(low)) {
            (Some(DType::F32) | None, Some(DType::F16 | DType::BF16) | None) => {}
            (p, l) => {
                let show = |d: Option<DType>| d.map_or("?".to_string(), |d| d.to_string());
                return Err(format!("a {} low-precision copy of a {} parameter", show(l), show(p)));
            }
        }
        out.push(same(cx, low));
    }
    if out.len() < cx.n_outputs() {
        return Err(format!("{} outputs, but {} state inputs to update", cx.n_outputs(), out.len()));
    }
    out.truncate(cx.n_outputs());
    Ok(out)
}

/// Attention's Q, K and V at inputs `at..at + 3`: [..., Sq, D], [..., Sk, D] and [..., Sk, D]
/// with the same leading dims (at least one), or under the `bshd` layout [B, Sq, H, D],
/// [B, Sk, H, D] and [B, Sk, H, D]; the mask after them broadcasts to the scores, [..., Sq, Sk]
/// ([B, H, Sq, Sk]). Q's shape and the log-sum-exp's ([..., Sq]; [B, H, Sq]), where known.
fn attention_operands(
    cx: &NodeCx,
    at: usize,
    layout: AttentionLayout,
) -> Result<(Option<Shape>, Option<Shape>), String> {
    let bshd = layout == AttentionLayout::Bshd;
    let lse = |q: &Shape| {
        let r = q.rank();
        Shape(if bshd { vec![q.0[0].clone(), q.0[2].clone(), q.0[1].clone()] } else { q.0[..r - 1].to_vec() })
    };
    let min_rank = if bshd { 4 } else { 3 };
    if let Some(q) = cx.sh(at).filter(|q| q.rank() < min_rank || bshd && q.rank() != 4) {
        return Err(format!("Q of rank {}: expected {}", q.rank(), if bshd { "4 (bshd)" } else { "at least 3" }));
    }
    let (Some(q), Some(k), Some(v)) = (cx.sh(at), cx.sh(at + 1), cx.sh(at + 2)) else {
        return Ok((cx.sh(at).cloned(), cx.sh(at).map(lse)));
    };
    let r = q.rank();
    if r < 3 || k.rank() != r || v.rank() != r || bshd && r != 4 {
        let want = if bshd { "4 (bshd)" } else { "at least 3" };
        return Err(format!("Q, K and V of ranks {r}, {} and {}: expected the same rank, {want}", k.rank(), v.rank()));
    }
    // The rows' axis; every other axis but the head dim is a batch or head axis.
    let seq = if bshd { 1 } else { r - 2 };
    for i in (0..r - 1).filter(|&i| i != seq) {
        check_eq(&q.0[i], &k.0[i], "Q's and K's batch and head dims")?;
        check_eq(&q.0[i], &v.0[i], "Q's and V's batch and head dims")?;
    }
    check_eq(&q.0[r - 1], &k.0[r - 1], "Q's and K's head dims")?;
    check_eq(&q.0[r - 1], &v.0[r - 1], "Q's and V's head dims")?;
    check_eq(&k.0[seq], &v.0[seq], "K's and V's lengths")?;
    let mask_at = if at == 0 { 3 } else { 6 };
    if let Some(m) = cx.sh(mask_at) {
        let mut scores = lse(q).0;
        scores.push(k.0[seq].clone());
        let fits = m.rank() <= scores.len()
            && m.0.iter().rev().zip(scores.iter().rev()).all(|(md, sd)| match (md.fixed(), sd.fixed()) {
                (Some(p), Some(s)) => p == s || p == 1,
                _ => true,
            });
        if !fits {
            return Err(format!("the mask {m} does not broadcast to the scores {}", Shape(scores)));
        }
    }
    Ok((Some(q.clone()), Some(lse(q))))
}

/// RoiAlign's [R, C, output_height, output_width] from X [N, C, H, W], rois [R, 4] and
/// batch_indices [R].
fn roi_align(cx: &NodeCx, a: &mpc_ir::ops::RoiAlignAttrs) -> Result<Option<Shape>, String> {
    if a.output_height < 1 || a.output_width < 1 {
        return Err(format!("RoiAlign's output is {}x{}: both must be at least 1", a.output_height, a.output_width));
    }
    let (Some(x), Some(rois)) = (cx.sh(0), cx.sh(1)) else { return Ok(None) };
    if x.rank() != 4 || rois.rank() != 2 {
        return Err(format!("RoiAlign takes X of rank 4 and rois of rank 2, not {x} and {rois}"));
    }
    check_eq(&rois.0[1], &Dim::Fixed(4), "the rois' corners (4)")?;
    if let Some(b) = cx.sh(2) {
        if b.rank() != 1 {
            return Err(format!("RoiAlign's batch_indices are {b}, not one per roi"));
        }
        check_eq(&b.0[0], &rois.0[0], "the rois and their batch indices")?;
    }
    let (h, w) = (Dim::Fixed(a.output_height as u64), Dim::Fixed(a.output_width as u64));
    Ok(Some(Shape(vec![rois.0[0].clone(), x.0[1].clone(), h, w])))
}

pub(super) fn check_eq(a: &Dim, b: &Dim, what: &str) -> Result<(), String> {
    match (a, b) {
        (Dim::Fixed(x), Dim::Fixed(y)) if x != y => Err(format!("{what} differ: {x} and {y}")),
        _ => Ok(()),
    }
}

fn broadcast_all(cx: &NodeCx, range: std::ops::Range<usize>) -> Result<Option<Shape>, String> {
    let mut shapes = Vec::new();
    for i in range {
        if !cx.has(i) {
            continue;
        }
        match cx.sh(i) {
            Some(s) => shapes.push(s),
            None => return Ok(None),
        }
    }
    broadcast(&shapes)
}

/// Numpy broadcasting with symbolic dims.
pub(crate) fn broadcast(shapes: &[&Shape]) -> Result<Option<Shape>, String> {
    mpc_ir::geometry::broadcast_dims(shapes).map(Some)
}

fn matmul(a: Option<&Shape>, b: Option<&Shape>) -> Result<Option<Shape>, String> {
    let (Some(a), Some(b)) = (a, b) else {
        return Ok(None);
    };
    if a.rank() == 0 || b.rank() == 0 {
        return Err("MatMul inputs must have rank ≥ 1".into());
    }
    let a2 = if a.rank() == 1 { Shape(vec![Dim::Fixed(1), a.0[0].clone()]) } else { a.clone() };
    let b2 = if b.rank() == 1 { Shape(vec![b.0[0].clone(), Dim::Fixed(1)]) } else { b.clone() };
    let (ar, br) = (a2.rank(), b2.rank());
    check_eq(&a2.0[ar - 1], &b2.0[br - 2], "MatMul inner dimensions")?;
    let batch = broadcast(&[&Shape(a2.0[..ar - 2].to_vec()), &Shape(b2.0[..br - 2].to_vec())])?.unwrap_or_default();
    let mut out = batch.0;
    if a.rank() > 1 {
        out.push(a2.0[ar - 2].clone());
    }
    if b.rank() > 1 {
        out.push(b2.0[br - 1].clone());
    }
    Ok(Some(Shape(out)))
}

fn product(dims: &[Dim]) -> Dim {
    let n = dims.iter().try_fold(mpc_ir::SymExpr::constant(1), |acc, d| acc.mul(&d.expr()?));
    n.map_or(Dim::Unknown, Dim::from_expr)
}

/// `s` with the dims `axes` (normalised) reduced: kept as 1, or dropped.
fn reduced(s: &Shape, axes: &[usize], keepdims: bool) -> Shape {
    Shape(
        s.0.iter()
            .enumerate()
            .filter_map(|(i, d)| match (axes.contains(&i), keepdims) {
                (true, true) => Some(Dim::Fixed(1)),
                (true, false) => None,
                _ => Some(d.clone()),
            })
            .collect(),
    )
}

/// The length of input `i` when it is a vector of fixed length (a shape operand).
/// (A longer vector is no shape mpc would run: its rank is left unknown rather than spelled out.)
pub(super) fn vector_len(cx: &NodeCx, i: usize) -> Option<usize> {
    match cx.sh(i)?.dims() {
        [Dim::Fixed(n)] => usize::try_from(*n).ok().filter(|&n| n <= MAX_RANK),
        _ => None,
    }
}

/// The most dims a shape operand is taken to give.
const MAX_RANK: usize = 4096;

/// The 1-D shape a `ReduceScatter` (its input's length over `world`) or an `AllGather` (`gather`:
/// times `world`) gives.
fn collective_shape(cx: &NodeCx, world: i64, gather: bool) -> Result<Option<Shape>, String> {
    let Some(s) = cx.sh(0) else { return Ok(None) };
    let [d] = s.dims() else { return Err(format!("a collective of shards reads a 1-D tensor, not rank {}", s.rank())) };
    let Some(n) = d.fixed() else { return Ok(Some(Shape(vec![Dim::Unknown]))) };
    if world < 1 || (!gather && n % world as u64 != 0) {
        return Err(format!("{n} elements do not split into {world} equal shards"));
    }
    let out = if gather { n * world as u64 } else { n / world as u64 };
    Ok(Some(Shape(vec![Dim::Fixed(out)])))
}
