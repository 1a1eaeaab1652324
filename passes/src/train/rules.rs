//! The gradient rules that take more than a few nodes, one function per op (or family), called
//! from [`super::autodiff`]'s `rule`: Max and Min, ConvTranspose, the per-channel normalisations,
//! LRN, Resize, Einsum, the reductions other than sum and mean, Tile, Pad, GatherElements, Slice,
//! GatherND, the scatters and the ops of [`Trig`].

use mpc_ir::geometry::AutoPad;
use mpc_ir::ops::{
    AxisAttrs, ConvAttrs, EinsumAttrs, GatherNdAttrs, LayerNormAttrs, LrnAttrs, PadAttrs, PadMode, ReduceAttrs,
    ReduceKind, ReshapeAttrs, ResizeAttrs, ScatterElementsAttrs, ScatterNdAttrs, ScatterReduction, TransposeAttrs,
    Trig,
};
use mpc_ir::{normalize_axis, DType, Dim, Graph, Node, Op, Shape, Tensor, ValueId};

use super::build::{fixed, int_const, Builder};

/// Each input's gradient (`None` where none is wanted).
type Grads = Vec<Option<ValueId>>;

fn input(node: &Node, i: usize) -> Result<ValueId, String> {
    node.input(i).ok_or_else(|| format!("input {i} is missing"))
}

fn want(wants: &[bool], i: usize) -> bool {
    wants.get(i).copied().unwrap_or(false)
}

/// Max and Min over any number of inputs: dy goes to the inputs equal to the result, split equally
/// between tied ones (torch.maximum's convention), summed over each input's broadcast axes.
pub(super) fn extremum(b: &mut Builder, node: &Node, dy: ValueId, wants: &[bool]) -> Result<Grads, String> {
    let (n, y) = (node.inputs().len(), node.outputs()[0]);
    if n == 1 {
        return Ok(vec![Some(dy)]);
    }
    let dt = b.dtype(y)?;
    let (zero, one) = (b.scalar(0.0, dt), b.scalar(1.0, dt));
    let mut masks = Vec::with_capacity(n);
    for i in 0..n {
        let e = b.op("eq", Op::Equal, &[input(node, i)?, y]);
        masks.push(b.op("mask", Op::Where, &[e, one, zero]));
    }
    let ins: Vec<Option<ValueId>> = masks.iter().map(|&m| Some(m)).collect();
    let count = b.ops("count", Op::Sum, &ins, 1)[0];
    let share = b.op("share", Op::Div, &[dy, count]);
    let mut grads = Vec::with_capacity(n);
    for (i, &m) in masks.iter().enumerate() {
        grads.push(if want(wants, i) {
            let t = b.op("mul", Op::Mul, &[share, m]);
            Some(b.unbroadcast(t, input(node, i)?, y)?)
        } else {
            None
        });
    }
    Ok(grads)
}

/// Pad in constant mode: dX = Pad(dY, −pads), cropping what was added and zero-filling what was
/// cut. The other modes fold copies back (a scatter-add) and are refused.
pub(super) fn pad(b: &mut Builder, node: &Node, a: &PadAttrs, dy: ValueId) -> Result<ValueId, String> {
    let pads = int_const(b.g, node.input(1), "Pad pads")?.ok_or("Pad pads are missing")?;
    if a.mode != PadMode::Constant {
        // Reflect, edge, wrap: every output element along a padded axis reads one input
        // element (mpc_ir::geometry::pad_source), so dy adds back to it, one axis at a time.
        let xs = b.shape(input(node, 0)?)?;
        let r = xs.rank();
        let axes = int_const(b.g, node.input(3), "Pad axes")?.unwrap_or_else(|| (0..r as i64).collect());
        let (mut ys, dt) = (b.shape(node.outputs()[0])?, b.dtype(node.outputs()[0])?);
        let mut g = dy;
        for (i, &ax) in axes.iter().enumerate() {
            let ax = normalize_axis(ax, r).ok_or(format!("Pad axis {ax} is out of range"))?;
            let (before, after) = (pads[i], pads[i + axes.len()]);
            if before == 0 && after == 0 {
                continue;
            }
            let n = fixed(&xs.dims()[ax], "a padded axis")?;
            let at: Option<Vec<i64>> =
                (0..(n + before + after).max(0)).map(|o| mpc_ir::geometry::pad_source(o - before, n, a.mode)).collect();
            g = scatter_along(b, g, &mut ys, dt, ax, &at.ok_or("Pad of an empty axis")?, n)?;
        }
        return Ok(g);
    }
    let back: Vec<i64> = pads.iter().map(|p| -p).collect();
    let mut ins = vec![Some(dy), Some(b.ints(&back))];
    if let Some(axes) = node.input(3) {
        ins.extend([None, Some(axes)]);
    }
    Ok(b.ops("pad", Op::Pad(a.clone()), &ins, 1)[0])
}

/// Y = ConvTranspose(X, W) is the adjoint of Conv(·, W) over the same window: dX = Conv(dY, W),
/// dW = the weight gradient of that Conv with X as its output gradient (ai.mpc::ConvGrad), dB = ΣdY.
pub(super) fn conv_transpose(
    b: &mut Builder,
    node: &Node,
    a: &ConvAttrs,
    dy: ValueId,
    wants: &[bool],
) -> Result<Grads, String> {
    let (x0, w) = (input(node, 0)?, input(node, 1)?);
    let xs = b.shape(x0)?;
    if xs.rank() < 3 {
        return Err("ConvTranspose needs spatial axes".into());
    }
    let sp = xs.rank() - 2;
    let kernel: Vec<i64> = if a.kernel_shape.is_empty() {
        let ws = b.shape(w)?;
        ws.dims()[2..].iter().map(|d| fixed(d, "the kernel")).collect::<Result<_, _>>()?
    } else {
        a.kernel_shape.clone()
    };
    let mut pads = vec![0i64; 2 * sp];
    let mut sizes = Vec::with_capacity(sp);
    for d in 0..sp {
        let n = fixed(&xs.dims()[2 + d], "the spatial dims")? as u64;
        // output_shape may list N and C too: its last `sp` entries are the spatial ones.
        let target = a.output_shape.len().checked_sub(sp).map(|k| a.output_shape[k + d]);
        let pad = a.output_padding.get(d).copied().unwrap_or(0);
        let o = mpc_ir::geometry::conv_transpose_dim(&a.window(&kernel), d, n, pad, target)?;
        (pads[d], pads[sp + d]) = (o.pad_begin as i64, o.pad_end as i64);
        sizes.push((n, o.out));
    }
    let conv = ConvAttrs {
        auto_pad: AutoPad::NotSet,
        dilations: a.dilations.clone(),
        group: a.group,
        kernel_shape: a.kernel_shape.clone(),
        output_padding: Vec::new(),
        output_shape: Vec::new(),
        pads,
        strides: a.strides.clone(),
    };
    // The Conv gives X's sizes back, or more where an output_padding of a stride or more left
    // output positions that no input reaches: Conv output i is dX_i for i < n (the rest read only
    // those positions), so dX is the Conv cropped to n, and dW the ConvGrad of X padded with zeros
    // to the Conv's size. An output_shape that crops the full output leaves the Conv short.
    let mut extra = vec![0i64; 2 * (sp + 2)];
    for (d, &(n, out)) in sizes.iter().enumerate() {
        let back = conv.window(&kernel).out_dim(d, out)?.out;
        if back < n {
            return Err(format!(
                "ConvTranspose from {n} to {out} along spatial axis {d} is not the adjoint of a Conv \
                 (its output_shape crops the output) and cannot be differentiated"
            ));
        }
        extra[sp + 2 + 2 + d] = (back - n) as i64;
    }
    let grown = extra.iter().any(|&e| e != 0);
    let dx = if want(wants, 0) {
        let full = b.op("conv", Op::Conv(Box::new(conv.clone())), &[dy, w]);
        Some(if grown {
            let crop: Vec<i64> = extra.iter().map(|e| -e).collect();
            let crop = b.ints(&crop);
            b.op("crop", Op::Pad(PadAttrs::default()), &[full, crop])
        } else {
            full
        })
    } else {
        None
    };
    let dw = if want(wants, 1) {
        let xz = if grown {
            let pads = b.ints(&extra);
            b.op("pad", Op::Pad(PadAttrs::default()), &[x0, pads])
        } else {
            x0
        };
        Some(b.ops("conv", Op::ConvGrad(Box::new(conv)), &[Some(xz), Some(dy), Some(w)], 3)[1])
    } else {
        None
    };
    let db = if want(wants, 2) {
        let axes: Vec<i64> = std::iter::once(0).chain(2..2 + sp as i64).collect();
        Some(b.reduce_sum(dy, &axes, false))
    } else {
        None
    };
    Ok(vec![dx, dw, db])
}

/// InstanceNormalization (`groups` None) and GroupNormalization: x̂ normalised per (n, c), or per
/// (n, group), over the channels of the group and the spatial axes; Y = γ·x̂ + β, γ and β per
/// channel. dX is LayerNormalizationGrad's over those elements with ĝ = γ·dY and a unit scale:
/// (1/σ)/m · (m·ĝ − Σĝ − x̂·Σ(ĝ·x̂)); dγ = Σ dY·x̂ and dβ = ΣdY over N and the spatial axes, x̂
/// being the op itself with unit scale and zero bias.
pub(super) fn channel_norm(
    b: &mut Builder,
    node: &Node,
    dy: ValueId,
    wants: &[bool],
    epsilon: f32,
    groups: Option<i64>,
) -> Result<Grads, String> {
    let (x0, scale) = (input(node, 0)?, input(node, 1)?);
    let (r, dt) = (b.shape(x0)?.rank(), b.dtype(x0)?);
    if r < 3 && groups.is_none() {
        return Err("InstanceNormalization without spatial axes cannot be differentiated".into());
    }
    // The axes γ and β are shared over.
    let shared: Vec<i64> = std::iter::once(0).chain(2..r as i64).collect();
    let dx = if want(wants, 0) {
        let g = if r > 2 {
            let ax: Vec<i64> = (1..r as i64 - 1).collect();
            let ax = b.ints(&ax);
            b.op("unsqueeze", Op::Unsqueeze, &[scale, ax])
        } else {
            scale
        };
        let gh = b.op("mul", Op::Mul, &[dy, g]);
        let one = b.scalar(1.0, dt);
        let ln = Op::LayerNormalizationGrad(Box::new(LayerNormAttrs { axis: 2, epsilon, stash_type: 1 }));
        Some(match groups {
            None => b.ops("ln", ln, &[Some(gh), Some(x0), Some(one)], 3)[0],
            // Rows of a group: [N, G, C/G · spatial].
            Some(gr) => {
                let rows = b.ints(&[0, gr, -1]);
                let gh = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[gh, rows]);
                let xr = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[x0, rows]);
                let d = b.ops("ln", ln, &[Some(gh), Some(xr), Some(one)], 3)[0];
                let s = b.shape_of(x0);
                b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[d, s])
            }
        })
    } else {
        None
    };
    let dscale = if want(wants, 1) {
        let s = b.shape_of(scale);
        let (ones, zeros) = (b.full("ones", s, 1.0, dt), b.full("zeros", s, 0.0, dt));
        let xh = b.op("xhat", node.op.clone(), &[x0, ones, zeros]);
        let t = b.op("mul", Op::Mul, &[dy, xh]);
        Some(b.reduce_sum(t, &shared, false))
    } else {
        None
    };
    let dbias = if want(wants, 2) { Some(b.reduce_sum(dy, &shared, false)) } else { None };
    Ok(vec![dx, dscale, dbias])
}

/// Resize is linear in X and separable: along each resized axis, Y = T·X with T the [m, n] matrix of
/// the axis's taps (the kernel's own, from `geometry::resize_taps`), so dX = Tᵀ·dY axis by axis.
/// An axis that copies each input into a block of s outputs (nearest at an integer upscale) sums
/// the blocks instead: dY reshaped to [.., n, s, ..] and summed over the s axes.
pub(super) fn resize(b: &mut Builder, node: &Node, a: &ResizeAttrs, dy: ValueId) -> Result<ValueId, String> {
    let x0 = input(node, 0)?;
    let (xs, dt) = (b.shape(x0)?, b.dtype(x0)?);
    let r = xs.rank();
    // Unknown dims as 0: they may only be kept as they are (size and scale unchanged).
    let ns: Vec<usize> = xs.dims().iter().map(|d| d.fixed().unwrap_or(0) as usize).collect();
    let y = node.outputs()[0];
    // Sizes computed from a symbolic shape (the batch's, kept): the output's dims say them, an
    // axis of unknown size that the output keeps as 0 for 0 (kept below).
    let sizes = match int_const(b.g, node.input(3), "Resize sizes") {
        Ok(s) => s,
        Err(e) => {
            let ys = b.shape(y)?;
            let kept = |d: usize| xs.dims()[d].fixed().is_none() && ys.dims()[d] == xs.dims()[d];
            let out: Option<Vec<i64>> =
                (0..r).map(|d| if kept(d) { Some(0) } else { ys.dims()[d].fixed().map(|v| v as i64) }).collect();
            Some(out.ok_or(e)?)
        }
    };
    let scales = match node.input(2) {
        Some(v) => Some(crate::known::floats(b.g, v).ok_or("Resize scales must be a constant to differentiate")?),
        None => None,
    };
    let (ms, scale) = mpc_ir::geometry::resize_plan(a, &ns, scales.as_deref(), sizes.as_deref())?;
    let crop = a.coordinate_transformation_mode == mpc_ir::ops::CoordinateMode::TfCropAndResize;
    let roi = match node.input(1).filter(|_| crop) {
        Some(v) => Some(crate::known::floats(b.g, v).ok_or("Resize roi must be a constant to differentiate")?),
        None => None,
    };
    let roi = mpc_ir::geometry::resize_roi(a, r, roi.as_deref())?;
    let (mut blocks, mut spread) = (vec![1i64; r], Vec::new());
    // Kept: the same size at scale 1 (or an axis of unknown size the output keeps: 0 for 0).
    for d in (0..r).filter(|&d| ms[d] != ns[d] || (scale[d] != 1.0 && ns[d] != 0)) {
        let n = fixed(&xs.dims()[d], "a resized axis")? as usize;
        let taps = mpc_ir::geometry::resize_taps(a, n, ms[d], scale[d], roi[d])
            .map_err(|e| format!("{e} cannot be differentiated"))?;
        let s = ms[d] / n.max(1);
        if ms[d] == s * n && taps.iter().enumerate().all(|(o, t)| t[..] == [(o / s, 1.0)]) {
            blocks[d] = s as i64;
        } else {
            spread.push((d, n, taps));
        }
    }
    let mut dy = dy;
    if let Some(first) = blocks.iter().position(|&s| s > 1) {
        let (mut target, mut summed, mut inferred) = (Vec::new(), Vec::new(), false);
        for (i, d) in xs.dims().iter().enumerate() {
            target.push(match d.fixed() {
                _ if spread.iter().any(|&(d, ..)| d == i) => ms[i] as i64,
                Some(n) => n as i64,
                None if i < first => 0,
                None if !inferred => {
                    inferred = true;
                    -1
                }
                None => {
                    return Err(
                        "Resize with two unknown dims from the first resized axis on cannot be differentiated".into()
                    )
                }
            });
            if blocks[i] > 1 {
                summed.push(target.len() as i64);
                target.push(blocks[i]);
            }
        }
        let t = b.ints(&target);
        let t = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, t]);
        dy = b.reduce_sum(t, &summed, false);
    }
    for (d, n, taps) in spread {
        let m = taps.len();
        // Along the axis before the last: Tᵀ·dY with Tᵀ as [n, m]; else dY·T with T as [m, n], the
        // axis moved last and back for the others.
        let left = d + 2 == r;
        let mut t = vec![0f64; m * n];
        for (o, tap) in taps.iter().enumerate() {
            for &(i, w) in tap {
                t[if left { i * m + o } else { o * n + i }] += w;
            }
        }
        let shape = if left { vec![n as u64, m as u64] } else { vec![m as u64, n as u64] };
        let name = format!("grad.{}.taps{d}", b.base);
        let t = b.init(&name, mpc_ir::Tensor::from_f64_as(dt, shape, &t));
        dy = if left {
            b.op("matmul", Op::MatMul, &[t, dy])
        } else if d + 1 == r {
            b.op("matmul", Op::MatMul, &[dy, t])
        } else {
            let mut perm: Vec<i64> = (0..r as i64).collect();
            perm.swap(d, r - 1);
            let swap = Op::Transpose(TransposeAttrs { perm: Some(perm) });
            let u = b.op("transpose", swap.clone(), &[dy]);
            let u = b.op("matmul", Op::MatMul, &[u, t]);
            b.op("transpose", swap, &[u])
        };
    }
    Ok(dy)
}

/// Einsum: the gradient of operand i of `t₁,…,tₙ->o` is `o,t_j (j ≠ i)->tᵢ'`, tᵢ' being tᵢ less the
/// labels found in no other term (summed over Xᵢ alone), which dY is then expanded back over. An
/// ellipsis, or a label repeated within one term (a diagonal), is refused.
pub(super) fn einsum(
    b: &mut Builder,
    node: &Node,
    equation: &str,
    dy: ValueId,
    wants: &[bool],
) -> Result<Grads, String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, out) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), r.to_string()),
        // Implicit output: the labels used once, in alphabetical order.
        None => {
            let mut once: Vec<char> =
                eq.chars().filter(|&c| c.is_ascii_alphabetic() && eq.matches(c).count() == 1).collect();
            once.sort_unstable();
            (eq.clone(), once.into_iter().collect())
        }
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    let plain = |t: &str| t.chars().all(|c| c.is_ascii_alphabetic()) && t.chars().all(|c| t.matches(c).count() == 1);
    if !terms.iter().all(|t| plain(t)) || !plain(&out) {
        return Err(format!("Einsum `{eq}` has an ellipsis or a label repeated within one term: not differentiated"));
    }
    let mut grads = Vec::with_capacity(terms.len());
    for (i, t) in terms.iter().enumerate() {
        if !want(wants, i) {
            grads.push(None);
            continue;
        }
        let xi = input(node, i)?;
        let elsewhere = |c: char| out.contains(c) || terms.iter().enumerate().any(|(j, u)| j != i && u.contains(c));
        let kept: String = t.chars().filter(|&c| elsewhere(c)).collect();
        let mut ins = vec![Some(dy)];
        let mut parts = vec![out.as_str()];
        for (j, u) in terms.iter().enumerate().filter(|&(j, _)| j != i) {
            ins.push(Some(input(node, j)?));
            parts.push(u);
        }
        let equation = format!("{}->{kept}", parts.join(","));
        let mut g = b.ops("einsum", Op::Einsum(EinsumAttrs { equation }), &ins, 1)[0];
        if kept.len() < t.len() {
            let summed: Vec<i64> =
                t.chars().enumerate().filter(|&(_, c)| !elsewhere(c)).map(|(p, _)| p as i64).collect();
            let ax = b.ints(&summed);
            g = b.op("unsqueeze", Op::Unsqueeze, &[g, ax]);
            let s = b.shape_of(xi);
            g = b.op("expand", Op::Expand, &[g, s]);
        }
        grads.push(Some(g));
    }
    Ok(grads)
}

/// The axes a Reduce* node reduces over, `None` when it is the identity (no axes, with
/// `noop_with_empty_axes`).
pub(super) fn reduced_axes(b: &Builder, node: &Node, a: &ReduceAttrs) -> Result<Option<Vec<usize>>, String> {
    let r = b.shape(input(node, 0)?)?.rank();
    match int_const(b.g, node.input(1), "the axes")? {
        Some(ax) if !ax.is_empty() => ax
            .iter()
            .map(|&v| normalize_axis(v, r).ok_or_else(|| "bad axis".to_string()))
            .collect::<Result<_, _>>()
            .map(Some),
        _ if a.noop_with_empty_axes => Ok(None),
        _ => Ok(Some((0..r).collect())),
    }
}

/// `v`, reduced over `axes`, at its input's rank again: unsqueezed there unless the dims were kept.
pub(super) fn keep(b: &mut Builder, v: ValueId, axes: &[usize], keepdims: bool) -> ValueId {
    if keepdims || axes.is_empty() {
        return v;
    }
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let ax = b.ints(&ax);
    b.op("unsqueeze", Op::Unsqueeze, &[v, ax])
}

/// ReduceMax, ReduceMin, ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSumExp, ReduceLogSum and
/// ReduceProd: dX from dY and Y at X's rank, broadcast over the reduced axes.
pub(super) fn reduce(b: &mut Builder, node: &Node, a: &ReduceAttrs, dy: ValueId) -> Result<ValueId, String> {
    let (x0, y) = (input(node, 0)?, node.outputs()[0]);
    let (kind, _) = node.op.reduction().ok_or_else(|| format!("{} is not a reduction", node.op.op_type()))?;
    // No axes with noop_with_empty_axes: the element-wise part (x², |x|, log x) still has its
    // gradient.
    let axes = match reduced_axes(b, node, a)? {
        Some(axes) => axes,
        None if kind.applies_elementwise() => Vec::new(),
        None => return Ok(dy),
    };
    let dt = b.dtype(x0)?;
    let (g, yk) = (keep(b, dy, &axes, a.keepdims), keep(b, y, &axes, a.keepdims));
    let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
    let (zero, one) = (b.scalar(0.0, dt), b.scalar(1.0, dt));
    Ok(match kind {
        // dy split equally between the elements equal to the maximum (torch.amax's rule); likewise
        // for the minimum.
        ReduceKind::Max | ReduceKind::Min => {
            let e = b.op("eq", Op::Equal, &[x0, yk]);
            let m = b.op("mask", Op::Where, &[e, one, zero]);
            let count = b.reduce_sum(m, &ax, true);
            let share = b.op("share", Op::Div, &[g, count]);
            b.op("mul", Op::Mul, &[m, share])
        }
        // d Σx² = 2x dy.
        ReduceKind::SumSquare => {
            let two = b.scalar(2.0, dt);
            let t = b.op("mul", Op::Mul, &[x0, two]);
            b.op("mul", Op::Mul, &[t, g])
        }
        // d Σ|x| = sign(x) dy.
        ReduceKind::L1 => {
            let s = b.op("sign", Op::Sign, &[x0]);
            b.op("mul", Op::Mul, &[s, g])
        }
        // d √Σx² = x/y dy, 0 where y = 0 (torch.norm's rule).
        ReduceKind::L2 => {
            let q = b.op("div", Op::Div, &[g, yk]);
            let z = b.op("zero", Op::Equal, &[yk, zero]);
            let q = b.op("where", Op::Where, &[z, zero, q]);
            b.op("mul", Op::Mul, &[x0, q])
        }
        // d log Σeˣ = e^(x − y) dy.
        ReduceKind::LogSumExp => {
            let t = b.op("sub", Op::Sub, &[x0, yk]);
            let t = b.op("exp", Op::Exp, &[t]);
            b.op("mul", Op::Mul, &[t, g])
        }
        // d log Σx = dy / Σx = e^(−y) dy.
        ReduceKind::LogSum => {
            let t = b.op("neg", Op::Neg, &[yk]);
            let t = b.op("exp", Op::Exp, &[t]);
            b.op("mul", Op::Mul, &[t, g])
        }
        // d Πx = the product of the others dy: y/x in a group without zeros; in a group with one
        // zero, the product of the rest at the zero and 0 elsewhere; 0 with more zeros.
        ReduceKind::Prod => {
            let z = b.op("zero", Op::Equal, &[x0, zero]);
            let safe = b.op("nonzero", Op::Where, &[z, one, x0]);
            let q = b.op("div", Op::Div, &[yk, safe]);
            let nz = b.op("mask", Op::Where, &[z, one, zero]);
            let zeros = b.reduce_sum(nz, &ax, true);
            let single = b.op("single", Op::Equal, &[zeros, one]);
            let axv = b.ints(&ax);
            let prod = Op::ReduceProd(ReduceAttrs { keepdims: true, noop_with_empty_axes: false });
            let rest = b.op("rest", prod, &[safe, axv]);
            let at_zero = b.op("where", Op::Where, &[single, rest, zero]);
            let t = b.op("where", Op::Where, &[z, at_zero, q]);
            b.op("mul", Op::Mul, &[t, g])
        }
        // Their rule is the broadcast of dy (autodiff's).
        ReduceKind::Sum | ReduceKind::Mean => return Err(format!("{} has its own rule", node.op.op_type())),
    })
}

/// The sizes of `v`'s dims as a reshape target with `extra` inserted before dim i (when not 1),
/// and the positions of the inserted entries: unknown dims are copied (0) before the first
/// insertion and inferred (-1) once after it.
fn split_target(b: &Builder, v: ValueId, extra: &[i64], what: &str) -> Result<(Vec<i64>, Vec<i64>), String> {
    let first = extra.iter().position(|&e| e != 1).unwrap_or(extra.len());
    let (mut target, mut inserted, mut inferred) = (Vec::new(), Vec::new(), false);
    for (i, d) in b.shape(v)?.dims().iter().enumerate() {
        if extra[i] != 1 {
            inserted.push(target.len() as i64);
            target.push(extra[i]);
        }
        target.push(match d.fixed() {
            Some(n) => n as i64,
            None if i < first => 0,
            None if !inferred => {
                inferred = true;
                -1
            }
            None => {
                return Err(format!(
                    "{what} with two unknown dims from the first repeated axis on cannot be differentiated"
                ))
            }
        });
    }
    Ok((target, inserted))
}

/// Tile repeats X rᵢ times along each axis: dX sums dY's copies (dY reshaped to
/// [r₀, d₀, r₁, d₁, …] and summed over the r axes).
pub(super) fn tile(b: &mut Builder, node: &Node, dy: ValueId) -> Result<ValueId, String> {
    let x0 = input(node, 0)?;
    let reps = int_const(b.g, node.input(1), "Tile repeats")?.ok_or("Tile repeats are missing")?;
    if reps.iter().all(|&r| r == 1) {
        return Ok(dy);
    }
    let (target, copies) = split_target(b, x0, &reps, "Tile")?;
    let t = b.ints(&target);
    let t = b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[dy, t]);
    Ok(b.reduce_sum(t, &copies, false))
}

/// GatherElements reads X at one flat position per index: dX adds dY there (ai.mpc::GatherGrad
/// over the flattened X), the position being Σ coordinate·stride with the index (wrapped when
/// negative) as the coordinate along the axis.
pub(super) fn gather_elements(b: &mut Builder, node: &Node, a: &AxisAttrs, dy: ValueId) -> Result<ValueId, String> {
    let (x0, idx) = (input(node, 0)?, input(node, 1)?);
    let known = |b: &Builder, v: ValueId, what: &str| -> Result<Vec<i64>, String> {
        b.shape(v)?.dims().iter().map(|d| fixed(d, what)).collect()
    };
    let (Ok(xd), Ok(id)) = (known(b, x0, "GatherElements' data"), known(b, idx, "GatherElements' indices")) else {
        // A dim of unknown size (a batch): dy added at the indices into zeros shaped like x.
        let z = b.zeros_like(x0)?;
        let add = Op::ScatterElements(ScatterElementsAttrs { axis: a.axis, reduction: ScatterReduction::Add });
        return Ok(b.ops("scatter", add, &[Some(z), Some(idx), Some(dy)], 1)[0]);
    };
    let r = xd.len();
    let ax = normalize_axis(a.axis, r).ok_or("bad axis")?;
    let mut strides = vec![1i64; r];
    for d in (0..r.saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * xd[d + 1];
    }
    // The flat position of every index with its own coordinate along the axis at 0.
    let n: i64 = id.iter().product();
    let base: Vec<i64> = (0..n)
        .map(|k| {
            let (mut rem, mut off) = (k, 0);
            for d in (0..r).rev() {
                if d != ax {
                    off += rem % id[d] * strides[d];
                }
                rem /= id[d];
            }
            off
        })
        .collect();
    let it = b.dtype(idx)?;
    let shape: Vec<u64> = id.iter().map(|&d| d as u64).collect();
    let name = format!("grad.{}.offsets", b.base);
    let base = b.init(&name, Tensor::from_i64(shape, &base).to_dtype(it));
    let (zero, len, stride) = (b.scalar(0.0, it), b.scalar(xd[ax] as f64, it), b.scalar(strides[ax] as f64, it));
    let neg = b.op("negative", Op::Less, &[idx, zero]);
    let wrapped = b.op("wrap", Op::Add, &[idx, len]);
    let i = b.op("where", Op::Where, &[neg, wrapped, idx]);
    let off = b.op("mul", Op::Mul, &[i, stride]);
    let flat = b.op("flat", Op::Add, &[off, base]);
    let total = b.ints(&[xd.iter().product()]);
    let d = b.op("scatter", Op::GatherGrad(Box::new(AxisAttrs { axis: 0 })), &[dy, flat, total]);
    let s = b.shape_of(x0);
    Ok(b.op("reshape", Op::Reshape(ReshapeAttrs::default()), &[d, s]))
}

/// LRN: y = x·s^(−β), s = bias + α/size · Σ x² over the channels c − ⌊(size−1)/2⌋ … c + ⌈(size−1)/2⌉.
/// dX = dY·s^(−β) − 2αβ/size · x · Σ dY·y/s over the channels whose window holds x's (the mirrored
/// window).
pub(super) fn lrn(b: &mut Builder, node: &Node, a: &LrnAttrs, dy: ValueId) -> Result<ValueId, String> {
    let (x0, y) = (input(node, 0)?, node.outputs()[0]);
    let (r, dt) = (b.shape(x0)?.rank(), b.dtype(x0)?);
    if a.size < 1 || r < 2 {
        return Err("LRN needs a size of at least 1 and a channel axis".into());
    }
    let (lo, hi) = ((a.size - 1) / 2, a.size / 2);
    let sq = b.op("square", Op::Mul, &[x0, x0]);
    let s = window_sum(b, sq, lo, hi, r);
    let (k, bias) = (b.scalar(a.alpha as f64 / a.size as f64, dt), b.scalar(a.bias as f64, dt));
    let s = b.op("scale", Op::Mul, &[s, k]);
    let s = b.op("bias", Op::Add, &[s, bias]);
    let nb = b.scalar(-(a.beta as f64), dt);
    let p = b.op("pow", Op::Pow, &[s, nb]);
    let direct = b.op("mul", Op::Mul, &[dy, p]);
    let q = b.op("div", Op::Div, &[y, s]);
    let q = b.op("mul", Op::Mul, &[dy, q]);
    let w = window_sum(b, q, hi, lo, r);
    let c = b.scalar(2.0 * a.alpha as f64 * a.beta as f64 / a.size as f64, dt);
    let t = b.op("mul", Op::Mul, &[x0, w]);
    let t = b.op("mul", Op::Mul, &[t, c]);
    Ok(b.op("sub", Op::Sub, &[direct, t]))
}

/// Σ v over the channels c − lo … c + hi (zeros past the ends): v padded along the channel axis
/// and sliced at each of the lo + hi + 1 offsets.
fn window_sum(b: &mut Builder, v: ValueId, lo: i64, hi: i64, r: usize) -> ValueId {
    if lo + hi == 0 {
        return v;
    }
    let mut pads = vec![0i64; 2 * r];
    (pads[1], pads[r + 1]) = (lo, hi);
    let pads = b.ints(&pads);
    let padded = b.op("pad", Op::Pad(Default::default()), &[v, pads]);
    let axis = b.ints(&[1]);
    let mut parts = Vec::new();
    for t in 0..=lo + hi {
        // Ends counted from the padded end; the last slice runs to it.
        let end = if t == lo + hi { i64::MAX } else { t - lo - hi };
        let (st, en) = (b.ints(&[t]), b.ints(&[end]));
        parts.push(Some(b.op("slice", Op::Slice, &[padded, st, en, axis])));
    }
    b.ops("sum", Op::Sum, &parts, 1)[0]
}

/// d slice = dy padded back to x's shape with zeros (steps of 1). Starts and ends that are not
/// constants (computed from shapes, as in rotary embeddings) give pads computed the same way,
/// which lowering folds once the shapes are bound.
pub(super) fn slice(b: &mut Builder, node: &Node, dy: ValueId) -> Result<ValueId, String> {
    let xs = b.shape(input(node, 0)?)?;
    let r = xs.rank();
    let g: &Graph = b.g;
    let consts = |i| g.constant(node.input(i)?).and_then(|t| t.to_i64_vec());
    let n_sliced = match (consts(1), b.shape(input(node, 1)?)?.dims()) {
        (Some(s), _) => s.len(),
        (None, [Dim::Fixed(n)]) => *n as usize,
        _ => return Err("Slice starts of unknown length cannot be differentiated".into()),
    };
    let axes = int_const(g, node.input(3), "Slice axes")?.unwrap_or_else(|| (0..n_sliced as i64).collect());
    let steps = int_const(g, node.input(4), "Slice steps")?.unwrap_or_else(|| vec![1; n_sliced]);
    let axes: Vec<usize> = axes
        .iter()
        .map(|&a| normalize_axis(a, r).ok_or(format!("Slice axis {a} is out of range")))
        .collect::<Result<_, _>>()?;
    if steps.iter().any(|&s| s != 1) {
        // A strided or reversed slice (x[:, ::2], torch.flip): dy goes back to the elements
        // it read, one sliced axis at a time.
        let starts = int_const(g, node.input(1), "Slice starts")?.ok_or("Slice starts are missing")?;
        let ends = int_const(g, node.input(2), "Slice ends")?.ok_or("Slice ends are missing")?;
        let (mut ys, dt) = (b.shape(node.outputs()[0])?, b.dtype(node.outputs()[0])?);
        let mut grad = dy;
        for (i, &ax) in axes.iter().enumerate() {
            let n = fixed(&xs.dims()[ax], "a sliced axis")?;
            let (begin, count) = mpc_ir::geometry::slice_dim(n, starts[i], ends[i], steps[i])?;
            let at: Vec<i64> = (0..count as i64).map(|k| begin + k * steps[i]).collect();
            grad = scatter_along(b, grad, &mut ys, dt, ax, &at, n)?;
        }
        return Ok(grad);
    }
    let fixed_dims: Option<Vec<i64>> = axes.iter().map(|&a| xs.dims()[a].fixed().map(|d| d as i64)).collect();
    let p = match (consts(1), consts(2), fixed_dims) {
        (Some(starts), Some(ends), Some(dims)) => {
            let mut pads = vec![0i64; 2 * r];
            for (i, (&ax, &dim)) in axes.iter().zip(&dims).enumerate() {
                let clamp = |v: i64| (if v < 0 { v + dim } else { v }).clamp(0, dim);
                let (s, e) = (clamp(starts[i]), clamp(ends[i]));
                pads[ax] = s;
                pads[ax + r] = dim - e.max(s);
            }
            b.ints(&pads)
        }
        _ => slice_pads(b, input(node, 0)?, input(node, 1)?, input(node, 2)?, &axes, r),
    };
    Ok(b.op("pad", Op::Pad(Default::default()), &[dy, p]))
}

/// A float tensor known before the data: a constant, or a Concat of them (the legacy exporter's
/// Resize scales).
/// `dy` added along `axis` into zeros with `n` elements there, element k of the axis landing at
/// `at[k]`: the gradient of an op each of whose outputs along one axis reads one input element
/// (a strided or reversed Slice; a reflect, edge or wrap Pad). A ScatterElements with reduction
/// add, its indices `at` broadcast over dy's other dims.
/// `ys` is dy's shape, which becomes `n` at `axis`.
fn scatter_along(
    b: &mut Builder,
    dy: ValueId,
    ys: &mut Shape,
    dt: DType,
    axis: usize,
    at: &[i64],
    n: i64,
) -> Result<ValueId, String> {
    let r = ys.rank();
    let mut along = vec![1u64; r];
    along[axis] = at.len() as u64;
    let name = format!("grad.{}.at{axis}", b.base);
    let idx = b.init(&name, Tensor::from_i64(along, at));
    let to = match ys.as_fixed() {
        Some(d) => b.ints(&d.iter().map(|&v| v as i64).collect::<Vec<_>>()),
        None => b.op("shape", Op::Shape(Default::default()), &[dy]),
    };
    let idx = b.op("along", Op::Expand, &[idx, to]);
    ys.0[axis] = Dim::Fixed(n as u64);
    let target = match ys.as_fixed() {
        Some(d) => b.ints(&d.iter().map(|&v| v as i64).collect::<Vec<_>>()),
        None => {
            let part = |b: &mut Builder, start: i64, end: Option<i64>| {
                b.op("dims", Op::Shape(mpc_ir::ops::ShapeAttrs { start, end }), &[dy])
            };
            let (head, tail) = (part(b, 0, Some(axis as i64)), part(b, axis as i64 + 1, None));
            let len = b.ints(&[n]);
            let cat = Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 });
            b.ops("shape", cat, &[Some(head), Some(len), Some(tail)], 1)[0]
        }
    };
    let zeros = b.full("zeros", target, 0.0, dt);
    let add = Op::ScatterElements(ScatterElementsAttrs { axis: axis as i64, reduction: ScatterReduction::Add });
    Ok(b.ops("scatter", add, &[Some(zeros), Some(idx), Some(dy)], 1)[0])
}

/// The Pad amounts `[begins..., ends...]` that undo `Slice(x, starts, ends, axes)` with steps of
/// 1, computed in the graph: per sliced axis, a start or end `v` is `v + dim` when negative,
/// clamped to `[0, dim]`; the pad before is the start, the pad after `dim - max(end, start)`.
fn slice_pads(b: &mut Builder, x: ValueId, starts: ValueId, ends: ValueId, axes: &[usize], r: usize) -> ValueId {
    let shape = b.op("shape", Op::Shape(Default::default()), &[x]);
    let zero = b.ints(&[0]);
    // Starts and ends may be int32; the arithmetic is in int64, as the shape.
    let (starts, ends) = match b.dtype(starts) {
        Ok(DType::I64) => (starts, ends),
        _ => (b.cast(starts, DType::I64), b.cast(ends, DType::I64)),
    };
    let (mut before, mut after) = (vec![zero; r], vec![zero; r]);
    let resolve = |b: &mut Builder, v: ValueId, dim: ValueId| {
        let neg = b.op("neg", Op::Less, &[v, zero]);
        let wrapped = b.op("wrap", Op::Add, &[v, dim]);
        let v = b.op("norm", Op::Where, &[neg, wrapped, v]);
        let v = b.op("min", Op::Min, &[v, dim]);
        b.op("max", Op::Max, &[v, zero])
    };
    for (i, &ax) in axes.iter().enumerate() {
        let at = b.ints(&[i as i64]);
        let next = b.ints(&[i as i64 + 1]);
        let ax_ix = b.ints(&[ax as i64]);
        let dim = b.op("dim", Op::Gather(Default::default()), &[shape, ax_ix]);
        let s = b.op("start", Op::Slice, &[starts, at, next]);
        let e = b.op("end", Op::Slice, &[ends, at, next]);
        let s = resolve(b, s, dim);
        let e = resolve(b, e, dim);
        let e = b.op("end", Op::Max, &[e, s]);
        before[ax] = s;
        after[ax] = b.op("after", Op::Sub, &[dim, e]);
    }
    let parts: Vec<ValueId> = before.into_iter().chain(after).collect();
    b.op("pads", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &parts)
}

/// d gather_nd = dy added back at the gathered positions: ScatterND(zeros, indices, dy, add).
pub(super) fn gather_nd(b: &mut Builder, node: &Node, a: &GatherNdAttrs, dy: ValueId) -> Result<ValueId, String> {
    if a.batch_dims != 0 {
        return Err("GatherND with batch_dims cannot be differentiated yet".into());
    }
    let zeros = b.zeros_like(input(node, 0)?)?;
    let add = Op::ScatterND(ScatterNdAttrs { reduction: ScatterReduction::Add });
    Ok(b.op("scatter", add, &[zeros, input(node, 1)?, dy]))
}

/// Scatter without a reduction: the data's gradient is dy with the overwritten positions zeroed
/// (the same scatter of zeros), the updates' is dy gathered at the indices (GatherND, or
/// GatherElements on the axis). With `add` the data's gradient is dy itself. Duplicate indices
/// without a reduction have no defined result, and `mul`, `max` and `min` are refused.
pub(super) fn scatter(
    b: &mut Builder,
    node: &Node,
    op: Op,
    reduction: ScatterReduction,
    dy: ValueId,
    wants: &[bool],
) -> Result<Grads, String> {
    let idx = input(node, 1)?;
    let gather = |b: &mut Builder| match &op {
        Op::ScatterElements(a) => b.op("gather", Op::GatherElements(AxisAttrs { axis: a.axis }), &[dy, idx]),
        _ => b.op("gather", Op::GatherND(GatherNdAttrs { batch_dims: 0 }), &[dy, idx]),
    };
    let dx = match reduction {
        _ if !want(wants, 0) => None,
        ScatterReduction::None => {
            let zeros = b.zeros_like(input(node, 2)?)?;
            Some(b.op("zero_overwritten", op.clone(), &[dy, idx, zeros]))
        }
        ScatterReduction::Add => Some(dy),
        r => {
            let name = ScatterReduction::NAMES.iter().find(|(_, v)| *v == r).map_or("?", |(n, _)| *n);
            return Err(format!("{} with reduction {name} cannot be differentiated yet", op.op_type()));
        }
    };
    let du = match reduction {
        ScatterReduction::None | ScatterReduction::Add if want(wants, 2) => Some(gather(b)),
        _ => None,
    };
    Ok(vec![dx, None, du])
}

/// The ops of [`Trig`]: dy times the derivative, written with x (or y for tan: 1 + tan²).
pub(super) fn trig(b: &mut Builder, t: Trig, x: ValueId, y: ValueId, dy: ValueId) -> Result<ValueId, String> {
    let dt = b.dtype(y)?;
    let one = b.scalar(1.0, dt);
    let sq = |b: &mut Builder, v: ValueId| b.op("square", Op::Mul, &[v, v]);
    // 1 - x², x² + 1, x² - 1: the radicands and denominators of the inverse functions.
    let one_minus_sq = |b: &mut Builder| {
        let s = sq(b, x);
        b.op("sub", Op::Sub, &[one, s])
    };
    let sq_plus = |b: &mut Builder, sign: f64| {
        let s = sq(b, x);
        let c = b.scalar(sign, dt);
        b.op("add", Op::Add, &[s, c])
    };
    let over = |b: &mut Builder, d: ValueId| b.op("div", Op::Div, &[dy, d]);
    let over_sqrt = |b: &mut Builder, d: ValueId| {
        let r = b.op("sqrt", Op::Sqrt, &[d]);
        b.op("div", Op::Div, &[dy, r])
    };
    Ok(match t {
        // d tan x = (1 + tan² x) dx.
        Trig::Tan => {
            let s = sq(b, y);
            let s = b.op("add", Op::Add, &[s, one]);
            b.op("mul", Op::Mul, &[dy, s])
        }
        // d sinh x = cosh x dx; d cosh x = sinh x dx.
        Trig::Sinh => {
            let c = b.op("cosh", Op::Cosh, &[x]);
            b.op("mul", Op::Mul, &[dy, c])
        }
        Trig::Cosh => {
            let s = b.op("sinh", Op::Sinh, &[x]);
            b.op("mul", Op::Mul, &[dy, s])
        }
        // d asin x = dx / √(1 − x²); d acos x = −dx / √(1 − x²).
        Trig::Asin => {
            let d = one_minus_sq(b);
            over_sqrt(b, d)
        }
        Trig::Acos => {
            let d = one_minus_sq(b);
            let g = over_sqrt(b, d);
            b.op("neg", Op::Neg, &[g])
        }
        // d atan x = dx / (1 + x²); d atanh x = dx / (1 − x²).
        Trig::Atan => {
            let d = sq_plus(b, 1.0);
            over(b, d)
        }
        Trig::Atanh => {
            let d = one_minus_sq(b);
            over(b, d)
        }
        // d asinh x = dx / √(x² + 1); d acosh x = dx / √(x² − 1).
        Trig::Asinh => {
            let d = sq_plus(b, 1.0);
            over_sqrt(b, d)
        }
        Trig::Acosh => {
            let d = sq_plus(b, -1.0);
            over_sqrt(b, d)
        }
    })
}
