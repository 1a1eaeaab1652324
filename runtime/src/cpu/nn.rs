//! Normalisations, softmax, pooling, reductions: all accumulate in f32 (f64 for f64 inputs) and
//! round on store, as GPU kernels do.

use super::elementwise::Real;
use super::{err, floats, store, Res};
use crate::value::{Data, HostTensor};
use mpc_ir::ops::{CumSumAttrs, Reduction};

/// f32, f16 and bf16 data as f32, borrowed when already f32; `None` for f64 and non-floats.
fn f32_view(x: &HostTensor) -> Option<std::borrow::Cow<'_, [f32]>> {
    match &x.data {
        Data::F32(v) => Some(std::borrow::Cow::Borrowed(v)),
        Data::F16(_) | Data::BF16(_) => x.f32s().map(std::borrow::Cow::Owned),
        _ => None,
    }
}

/// (outer, axis length, inner) around `axis`.
fn split_at(shape: &[usize], axis: usize) -> (usize, usize, usize) {
    (shape[..axis].iter().product(), shape[axis], shape[axis + 1..].iter().product())
}

pub(crate) fn softmax(x: &HostTensor, axis: usize, log: bool) -> Res<HostTensor> {
    if let Some(v) = f32_view(x) {
        let (outer, n, inner) = split_at(&x.shape, axis);
        let mut out = vec![0f32; v.len()];
        let mut e = vec![0f32; n];
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let m = (0..n).map(|k| v[at(k)]).fold(f32::NEG_INFINITY, f32::max);
                let mut s = 0f32;
                if log {
                    for (k, ek) in e.iter_mut().enumerate() {
                        *ek = v[at(k)] - m;
                        s += ek.exp();
                    }
                    let ls = s.ln();
                    for (k, &ek) in e.iter().enumerate() {
                        out[at(k)] = ek - ls;
                    }
                } else {
                    // Each exponential once: kept for the division.
                    for (k, ek) in e.iter_mut().enumerate() {
                        *ek = (v[at(k)] - m).exp();
                        s += *ek;
                    }
                    for (k, &ek) in e.iter().enumerate() {
                        out[at(k)] = ek / s;
                    }
                }
            }
        }
        return Ok(HostTensor::from_f32(x.dtype(), x.shape.clone(), out));
    }
    let v = floats(x, "input")?;
    let (outer, n, inner) = split_at(&x.shape, axis);
    let f32c = x.dtype() != mpc_ir::DType::F64;
    let mut out = vec![0f64; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * n + k) * inner + i;
            let m = (0..n).map(|k| v[at(k)]).fold(f64::NEG_INFINITY, f64::max);
            if f32c {
                let m = m as f32;
                let s: f32 = (0..n).map(|k| (v[at(k)] as f32 - m).exp()).sum();
                for k in 0..n {
                    let e = v[at(k)] as f32 - m;
                    out[at(k)] = if log { (e - s.ln()) as f64 } else { (e.exp() / s) as f64 };
                }
            } else {
                let s: f64 = (0..n).map(|k| (v[at(k)] - m).exp()).sum();
                for k in 0..n {
                    let e = v[at(k)] - m;
                    out[at(k)] = if log { e - s.ln() } else { e.exp() / s };
                }
            }
        }
    }
    Ok(store(x, x.shape.clone(), out))
}

/// LayerNormalization over the dims from `axis`: Y, Mean, InvStdDev (the last two in f32).
pub(crate) fn layer_norm(
    x: &HostTensor,
    scale: &HostTensor,
    bias: Option<&HostTensor>,
    axis: usize,
    eps: f32,
) -> Res<Vec<HostTensor>> {
    let outer: usize = x.shape[..axis].iter().product();
    let n: usize = x.shape[axis..].iter().product();
    let mut stat_shape = x.shape[..axis].to_vec();
    stat_shape.extend(std::iter::repeat_n(1, x.shape.len() - axis));
    // Statistics in f64, from deviations of the f64 mean: an f32 running sum misses a row's mean
    // by an ulp or more, which BERT's epsilon (1e-12) turns into an output off by up to 1 on a
    // constant row, and a large mean with a small spread loses most of its digits.
    let v = floats(x, "input")?;
    let (sc, bi) = (scale.f64s(), bias.map(|b| b.f64s()));
    let si = super::elementwise::broadcast_index(&scale.shape, &x.shape[axis..]);
    let bidx = bias.map(|b| super::elementwise::broadcast_index(&b.shape, &x.shape[axis..]));
    let mut y = vec![0f64; v.len()];
    let mut means = Vec::with_capacity(outer);
    let mut inv = Vec::with_capacity(outer);
    for o in 0..outer {
        let row = &v[o * n..(o + 1) * n];
        let mean = row.iter().sum::<f64>() / n as f64;
        let var = row.iter().map(|&a| (a - mean) * (a - mean)).sum::<f64>() / n as f64;
        let r = 1.0 / (var + eps as f64).sqrt();
        for k in 0..n {
            let b = match (&bi, &bidx) {
                (Some(b), Some(bx)) => b[bx[k]],
                _ => 0.0,
            };
            y[o * n + k] = (row[k] - mean) * r * sc[si[k]] + b;
        }
        means.push(mean as f32);
        inv.push(r as f32);
    }
    Ok(vec![
        store(x, x.shape.clone(), y),
        HostTensor::from_f32(mpc_ir::DType::F32, stat_shape.clone(), means),
        HostTensor::from_f32(mpc_ir::DType::F32, stat_shape, inv),
    ])
}

/// BatchNormalization. Inference: running statistics. Training: batch statistics (biased
/// variance), and the updated running statistics as outputs 1 and 2.
#[allow(clippy::too_many_arguments)]
pub(crate) fn batch_norm(
    x: &HostTensor,
    scale: &HostTensor,
    bias: &HostTensor,
    mean: &HostTensor,
    var: &HostTensor,
    eps: f32,
    momentum: f32,
    training: bool,
) -> Res<Vec<HostTensor>> {
    if let (Some(v), false) = (f32_view(x), training) {
        // Inference: one multiply-add per element with per-channel constants.
        let c = *x.shape.get(1).unwrap_or(&1);
        let inner: usize = x.shape.iter().skip(2).product();
        let (sc, bi, rm, rv) = (scale.f64s(), bias.f64s(), mean.f64s(), var.f64s());
        let mut y = vec![0f32; v.len()];
        for (p, (dst, src)) in y.chunks_mut(inner.max(1)).zip(v.chunks(inner.max(1))).enumerate() {
            let ch = p % c;
            let k = sc[ch] as f32 / ((rv[ch] as f32) + eps).sqrt();
            let (m, b) = (rm[ch] as f32, bi[ch] as f32);
            for (d, &a) in dst.iter_mut().zip(src) {
                *d = (a - m) * k + b;
            }
        }
        return Ok(vec![HostTensor::from_f32(x.dtype(), x.shape.clone(), y)]);
    }
    let v = floats(x, "input")?;
    let (nb, c) = (x.shape[0], *x.shape.get(1).unwrap_or(&1));
    let inner: usize = x.shape.iter().skip(2).product();
    let (sc, bi, rm, rv) = (scale.f64s(), bias.f64s(), mean.f64s(), var.f64s());
    let plane = |b: usize, ch: usize| &v[(b * c + ch) * inner..(b * c + ch + 1) * inner];
    let (bm, bv): (Vec<f64>, Vec<f64>) = if training {
        (0..c)
            .map(|ch| {
                let cnt = (nb * inner) as f64;
                let m = (0..nb).map(|b| plane(b, ch).iter().sum::<f64>()).sum::<f64>() / cnt;
                let s = (0..nb).map(|b| plane(b, ch).iter().map(|a| (a - m) * (a - m)).sum::<f64>()).sum::<f64>() / cnt;
                (m, s)
            })
            .unzip()
    } else {
        (rm.clone(), rv.clone())
    };
    let mut y = vec![0f64; v.len()];
    let wide = x.dtype() == mpc_ir::DType::F64;
    for b in 0..nb {
        for ch in 0..c {
            if wide {
                let k = sc[ch] / (bv[ch] + eps as f64).sqrt();
                let dst = &mut y[(b * c + ch) * inner..(b * c + ch + 1) * inner];
                for (d, &a) in dst.iter_mut().zip(plane(b, ch)) {
                    *d = (a - bm[ch]) * k + bi[ch];
                }
                continue;
            }
            let k = sc[ch] as f32 / ((bv[ch] as f32) + eps).sqrt();
            let (m, bias) = (bm[ch] as f32, bi[ch] as f32);
            let dst = &mut y[(b * c + ch) * inner..(b * c + ch + 1) * inner];
            for (d, &a) in dst.iter_mut().zip(plane(b, ch)) {
                *d = ((a as f32 - m) * k + bias) as f64;
            }
        }
    }
    let mut out = vec![store(x, x.shape.clone(), y)];
    if training {
        let mo = momentum as f64;
        let nm: Vec<f64> = (0..c).map(|ch| rm[ch] * mo + bm[ch] * (1.0 - mo)).collect();
        let nv: Vec<f64> = (0..c).map(|ch| rv[ch] * mo + bv[ch] * (1.0 - mo)).collect();
        out.push(store(mean, mean.shape.clone(), nm));
        out.push(store(var, var.shape.clone(), nv));
    }
    Ok(out)
}

/// Max or average pooling over N-D windows (pads, strides, dilations; output size given).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pool(
    x: &HostTensor,
    kernel: &[usize],
    pads: &[usize],
    strides: &[usize],
    dilations: &[usize],
    out_spatial: &[usize],
    max: bool,
    count_include_pad: bool,
) -> Res<HostTensor> {
    if !max && !x.dtype().is_float() {
        return Err(err(format!("AveragePool on {}", x.dtype())));
    }
    let (nb, c) = (x.shape[0], x.shape[1]);
    let in_sp = &x.shape[2..];
    let ivol: usize = in_sp.iter().product();
    let (taps, padded) = window_taps(in_sp, kernel, pads, strides, dilations, out_spatial);
    let mut shape = vec![nb, c];
    shape.extend(out_spatial);
    // The f32 family is pooled in f32 (no f64 copy of the input); f64 and integers in f64.
    Ok(match f32_view(x) {
        Some(f) => {
            let out = pool_planes(&f, nb * c, ivol, &taps, &padded, max, count_include_pad);
            HostTensor::from_f32(x.dtype(), shape, out)
        }
        None => {
            let out = pool_planes(&x.f64s(), nb * c, ivol, &taps, &padded, max, count_include_pad);
            if x.dtype().is_float() {
                store(x, shape, out)
            } else {
                HostTensor::from_f64(x.dtype(), shape, out)
            }
        }
    })
}

/// For every output position of a pooling window: the input offsets it reads (in the window's
/// row-major order), and how many of its positions fall in the padding (past the right padding,
/// in ceil mode, does not count even with count_include_pad). Computed once per call and shared
/// by every (image, channel) plane. The work is per tap that reads the input, not per position of
/// the window: a window far larger than its input (SAME padding of a huge kernel) costs no more
/// than one that covers it. The geometry keeps every padded coordinate below i64::MAX.
pub(crate) fn window_taps(
    in_sp: &[usize],
    kernel: &[usize],
    pads: &[usize],
    strides: &[usize],
    dilations: &[usize],
    out_spatial: &[usize],
) -> (Vec<Vec<usize>>, Vec<usize>) {
    let sp = kernel.len();
    let ovol: usize = out_spatial.iter().product();
    let (ist, ost) = (super::shape::strides(in_sp), super::shape::strides(out_spatial));
    let mut taps = Vec::with_capacity(ovol);
    let mut padded = Vec::with_capacity(ovol);
    // Per axis: the first input coordinate read and how many taps read the input.
    let mut axes = vec![(0usize, 0usize); sp];
    let mut at = vec![0usize; sp];
    for op in 0..ovol {
        let (mut inside, mut within) = (1usize, 1usize);
        for d in 0..sp {
            let oc = (op / ost[d]) % out_spatial[d];
            let (first, n_in, n_within) =
                axis_taps(oc * strides[d], kernel[d], dilations[d], pads[d], in_sp[d], pads[d + sp]);
            axes[d] = (first, n_in);
            inside = inside.saturating_mul(n_in);
            within = within.saturating_mul(n_within);
        }
        let mut offs = Vec::with_capacity(inside);
        if inside > 0 {
            // The taps that read the input are a box: walk it in row-major order.
            at.fill(0);
            'walk: loop {
                offs.push((0..sp).map(|d| (axes[d].0 + at[d] * dilations[d]) * ist[d]).sum());
                for d in (0..sp).rev() {
                    at[d] += 1;
                    if at[d] < axes[d].1 {
                        continue 'walk;
                    }
                    at[d] = 0;
                }
                break;
            }
        }
        taps.push(offs);
        padded.push(within.saturating_sub(inside));
    }
    (taps, padded)
}

/// One axis of a window whose taps read padded coordinates `start + t * dilation` for t below
/// `kernel`, over an input of `n` between `pad` and `pad_end` of padding: the input coordinate of
/// the first tap that reads the input, how many do, and how many fall before the end padding's
/// end (those included).
fn axis_taps(
    start: usize,
    kernel: usize,
    dilation: usize,
    pad: usize,
    n: usize,
    pad_end: usize,
) -> (usize, usize, usize) {
    // The taps at coordinates below `limit`.
    let below = |limit: usize| if limit <= start { 0 } else { kernel.min((limit - start - 1) / dilation + 1) };
    let (before, through, within) = (below(pad), below(pad + n), below(pad + n + pad_end));
    let n_in = through - before;
    let first = if n_in > 0 { start + before * dilation - pad } else { 0 };
    (first, n_in, within)
}

/// Max or average over each window of each (image, channel) plane, in the data's own float type.
fn pool_planes<R: Real>(
    v: &[R],
    planes: usize,
    ivol: usize,
    taps: &[Vec<usize>],
    padded: &[usize],
    max: bool,
    count_include_pad: bool,
) -> Vec<R> {
    let mut out = Vec::with_capacity(planes * taps.len());
    // Every plane, also of an empty input: its windows then lie in the padding (max: -inf,
    // saturated to an integer dtype's least value; average: 0).
    for row in (0..planes).map(|p| &v[p * ivol..(p + 1) * ivol]) {
        for (offs, &pad_count) in taps.iter().zip(padded) {
            out.push(if max {
                offs.iter()
                    .map(|&o| row[o])
                    .fold(R::of(f64::NEG_INFINITY), |m, a| if a.is_nan() || a > m { a } else { m })
            } else {
                let n = if count_include_pad { offs.len().saturating_add(pad_count) } else { offs.len() };
                offs.iter().fold(R::of(0.0), |acc, &o| acc + row[o]) / R::of(n.max(1) as f64)
            });
        }
    }
    out
}

/// Reductions over `axes` (all when empty), accumulating in f64 and rounding through f32.
pub(crate) fn reduce(
    x: &HostTensor,
    axes: &[usize],
    keepdims: bool,
    kind: mpc_ir::ops::ReduceKind,
    limit: u64,
) -> Res<HostTensor> {
    let rank = x.shape.len();
    // An empty output (an axis kept is 0) has nothing to compute: the loops below would still
    // walk the reduced axes, which an empty input may have of any size.
    let reduced = |d: usize| axes.contains(&d);
    let out_shape: Vec<usize> =
        (0..rank).filter_map(|d| if reduced(d) { keepdims.then_some(1) } else { Some(x.shape[d]) }).collect();
    if out_shape.contains(&0) {
        return Ok(if x.dtype().is_float() {
            store(x, out_shape, Vec::new())
        } else {
            HostTensor::from_f64(x.dtype(), out_shape, Vec::new())
        });
    }
    let v = x.f64s();
    // Fast path: the reduced axes are the trailing dims (global pooling, row sums), so each output
    // is one contiguous run of the input.
    let k = axes.len();
    let trailing = k > 0 && axes.iter().copied().eq(rank - k..rank) && kind.simple();
    if trailing && x.dtype() != mpc_ir::DType::Bool {
        let run: usize = x.shape[rank - k..].iter().product();
        let out: Vec<f64> = v
            .chunks(run.max(1))
            .map(|r| kind.finish(r.iter().fold(kind.init(), |m, &a| kind.step(m, a, 0.0)), run, 0.0))
            .collect();
        let mut shape: Vec<usize> = x.shape[..rank - k].to_vec();
        if keepdims {
            shape.extend(std::iter::repeat_n(1, k));
        }
        if run > 0 {
            return Ok(if x.dtype().is_float() {
                store(x, shape, out)
            } else {
                HostTensor::from_f64(x.dtype(), shape, out)
            });
        }
    }
    // Contiguous reduced axes (leading ones: bias gradients, batch statistics): the input is
    // (outer, reduced, inner) and each output folds its `reduced` values in input order, as the
    // general loop below does.
    let mut sorted = axes.to_vec();
    sorted.sort_unstable();
    let contiguous = k > 0 && sorted.windows(2).all(|w| w[1] == w[0] + 1);
    if contiguous && kind.simple() && x.dtype() != mpc_ir::DType::Bool {
        let (first, last) = (sorted[0], sorted[k - 1]);
        let outer: usize = x.shape[..first].iter().product();
        let red: usize = x.shape[first..=last].iter().product();
        let inner: usize = x.shape[last + 1..].iter().product();
        if red > 0 {
            let mut out = vec![kind.init(); outer * inner];
            for o in 0..outer {
                let acc = &mut out[o * inner..(o + 1) * inner];
                for r in 0..red {
                    let row = &v[(o * red + r) * inner..(o * red + r + 1) * inner];
                    match kind {
                        // The sums without the dispatch in their inner loop.
                        mpc_ir::ops::ReduceKind::Sum | mpc_ir::ops::ReduceKind::Mean => {
                            acc.iter_mut().zip(row).for_each(|(m, &a)| *m += a)
                        }
                        k => acc.iter_mut().zip(row).for_each(|(m, &a)| *m = k.step(*m, a, 0.0)),
                    }
                }
            }
            out.iter_mut().for_each(|m| *m = kind.finish(*m, red, 0.0));
            let shape: Vec<usize> = (0..rank)
                .filter_map(|d| match (sorted.contains(&d), keepdims) {
                    (true, true) => Some(1),
                    (true, false) => None,
                    _ => Some(x.shape[d]),
                })
                .collect();
            return Ok(if x.dtype().is_float() {
                store(x, shape, out)
            } else {
                HostTensor::from_f64(x.dtype(), shape, out)
            });
        }
    }
    let reduced = |d: usize| axes.contains(&d);
    let out_shape_keep: Vec<usize> = (0..rank).map(|d| if reduced(d) { 1 } else { x.shape[d] }).collect();
    let ost = super::shape::strides(&out_shape_keep);
    let ist = super::shape::strides(&x.shape);
    // An empty input may still reduce to a huge output (its empty dim reduced away).
    super::fits(&out_shape_keep, x.dtype(), limit)?;
    let n_out: usize = out_shape_keep.iter().product();
    let mut acc = vec![kind.init(); n_out];
    let mut count = vec![0usize; n_out];
    let lse_max: Option<Vec<f64>> = (kind == mpc_ir::ops::ReduceKind::LogSumExp).then(|| {
        let mut m = vec![f64::NEG_INFINITY; n_out];
        for (i, &a) in v.iter().enumerate() {
            let o: usize = (0..rank).map(|d| if reduced(d) { 0 } else { (i / ist[d]) % x.shape[d] * ost[d] }).sum();
            m[o] = m[o].max(a);
        }
        // No shift by an infinite maximum: inf - inf would be NaN, unshifted the sum is inf (or 0,
        // all -inf, whose log is -inf).
        m.iter_mut().filter(|v| v.is_infinite()).for_each(|v| *v = 0.0);
        m
    });
    for (i, &a) in v.iter().enumerate() {
        let o: usize = (0..rank).map(|d| if reduced(d) { 0 } else { (i / ist[d]) % x.shape[d] * ost[d] }).sum();
        count[o] += 1;
        acc[o] = kind.step(acc[o], a, lse_max.as_ref().map_or(0.0, |m| m[o]));
    }
    for (o, a) in acc.iter_mut().enumerate() {
        *a = kind.finish(*a, count[o], lse_max.as_ref().map_or(0.0, |m| m[o]));
    }
    // An empty bool max is false and an empty bool min true (the identities of Or and And).
    if x.dtype() == mpc_ir::DType::Bool {
        for (o, a) in acc.iter_mut().enumerate() {
            if count[o] == 0 && matches!(kind, mpc_ir::ops::ReduceKind::Max | mpc_ir::ops::ReduceKind::Min) {
                *a = if kind == mpc_ir::ops::ReduceKind::Max { 0.0 } else { 1.0 };
            }
        }
    }
    let shape =
        if keepdims { out_shape_keep } else { (0..rank).filter(|&d| !reduced(d)).map(|d| x.shape[d]).collect() };
    Ok(if x.dtype().is_float() { store(x, shape, acc) } else { HostTensor::from_f64(x.dtype(), shape, acc) })
}

pub(crate) fn argmax(x: &HostTensor, axis: usize, keepdims: bool, last: bool, min: bool) -> Res<HostTensor> {
    let v = x.f64s();
    let (outer, n, inner) = split_at(&x.shape, axis);
    let mut out = Vec::with_capacity(outer * inner);
    for o in 0..outer {
        for i in 0..inner {
            let mut best = 0usize;
            for k in 1..n {
                let (mut a, mut b) = (v[(o * n + k) * inner + i], v[(o * n + best) * inner + i]);
                if min {
                    (a, b) = (-a, -b);
                }
                if a > b || (last && a == b) {
                    best = k;
                }
            }
            out.push(best as i64);
        }
    }
    let mut shape = x.shape.clone();
    if keepdims {
        shape[axis] = 1;
    } else {
        shape.remove(axis);
    }
    Ok(HostTensor::from_i64(mpc_ir::DType::I64, shape, out))
}

/// TopK along `axis`: the `k` first elements of each line in the order "larger first" (or
/// smaller with `largest` false), NaN before every number when largest and after when not (as
/// torch.topk), equal values in index order; their values and int64 indices. Integers compare
/// as i64, floats as f64 (exact for every float dtype). kernels/movement.cu's movement_topk
/// selects the same elements in the same order.
pub(crate) fn top_k(x: &HostTensor, axis: usize, k: usize, largest: bool) -> Res<Vec<HostTensor>> {
    use std::cmp::Ordering;
    let (outer, n, inner) = split_at(&x.shape, axis);
    if k > n {
        return Err(err(format!("k is {k} but axis {axis} has {n} elements")));
    }
    let ints = if x.dtype().is_float() { None } else { x.i64s() };
    let floats = if ints.is_none() { x.f64s() } else { Vec::new() };
    // The order of two flat positions: the one to pick first is Less.
    let order = |a: usize, b: usize| -> Ordering {
        let by_value = match &ints {
            Some(v) => v[a].cmp(&v[b]),
            None => {
                let (p, q) = (floats[a], floats[b]);
                match (p.is_nan(), q.is_nan()) {
                    (true, true) => Ordering::Equal,
                    (true, false) => Ordering::Greater,
                    (false, true) => Ordering::Less,
                    _ => p.partial_cmp(&q).unwrap_or(Ordering::Equal),
                }
            }
        };
        (if largest { by_value.reverse() } else { by_value }).then(a.cmp(&b))
    };
    let mut picked = vec![0usize; outer * k * inner];
    let mut line: Vec<usize> = Vec::with_capacity(n);
    for o in 0..outer {
        for i in 0..inner {
            line.clear();
            line.extend((0..n).map(|j| (o * n + j) * inner + i));
            line.sort_by(|&a, &b| order(a, b));
            for (j, &at) in line.iter().take(k).enumerate() {
                picked[(o * k + j) * inner + i] = at;
            }
        }
    }
    let mut shape = x.shape.clone();
    shape[axis] = k;
    let index: Vec<i64> = picked.iter().map(|&at| ((at / inner) % n) as i64).collect();
    Ok(vec![x.pick(shape.clone(), &picked), HostTensor::from_i64(mpc_ir::DType::I64, shape, index)])
}

/// CumSum (`product` false) or CumProd along `axis`: floats folded in f64 and rounded on store,
/// integers in wrapping i64 arithmetic (f64 would round past 2^53), truncated to the dtype.
pub(crate) fn cumulative(x: &HostTensor, axis: usize, a: &CumSumAttrs, product: bool) -> Res<HostTensor> {
    let (shape, line, (ex, rev)) = (&x.shape, split_at(&x.shape, axis), (a.exclusive, a.reverse));
    Ok(if x.dtype().is_float() {
        let v = x.f64s();
        let out = if product {
            scan(&v, line, ex, rev, 1.0, |s, v| s * v)
        } else {
            scan(&v, line, ex, rev, 0.0, |s, v| s + v)
        };
        store(x, shape.clone(), out)
    } else {
        let what = if product { "CumProd" } else { "CumSum" };
        let v = x.i64s().ok_or_else(|| err(format!("{what} on {}", x.dtype())))?;
        let out = if product {
            scan(&v, line, ex, rev, 1, i64::wrapping_mul)
        } else {
            scan(&v, line, ex, rev, 0, i64::wrapping_add)
        };
        HostTensor::from_i64(x.dtype(), shape.clone(), out)
    })
}

/// ai.mpc::CumProdGrad: dX of `CumProd(x)` along `axis` for `dy`, without dividing by x (which
/// may be 0). Along each line, in the order the product runs (`reverse` reverses it): with E_j
/// the product of the elements before j, dX_j = E_j·S_j, S_j = dY_j + x_{j+1}·S_{j+1} (inclusive,
/// S_{n-1} = dY_{n-1}) or S_j = dY_{j+1} + x_{j+1}·S_{j+1} (exclusive, S_{n-1} = 0). In f64,
/// rounded on store.
pub(crate) fn cumprod_grad(dy: &HostTensor, x: &HostTensor, axis: usize, a: &CumSumAttrs) -> Res<HostTensor> {
    if dy.shape != x.shape {
        return Err(err(format!("CumProdGrad: dY {:?} and X {:?} differ", dy.shape, x.shape)));
    }
    let (g, v) = (dy.f64s(), x.f64s());
    let (outer, n, inner) = split_at(&x.shape, axis);
    let mut out = vec![0f64; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            // The line's elements in the product's order.
            let at = |step: usize| (o * n + if a.reverse { n - 1 - step } else { step }) * inner + i;
            let mut e = 1.0;
            for step in 0..n {
                out[at(step)] = e;
                e *= v[at(step)];
            }
            let mut s = 0.0;
            for step in (0..n).rev() {
                s = match (step + 1 < n, a.exclusive) {
                    (true, false) => g[at(step)] + v[at(step + 1)] * s,
                    (true, true) => g[at(step + 1)] + v[at(step + 1)] * s,
                    (false, false) => g[at(step)],
                    (false, true) => 0.0,
                };
                out[at(step)] *= s;
            }
        }
    }
    Ok(store(x, x.shape.clone(), out))
}

/// A running fold of `v` along the middle axis of `(outer, n, inner)`, from `start`, each output
/// the fold up to and with its element (`exclusive`: before it), from the end when `reverse`.
fn scan<T: Copy>(
    v: &[T],
    (outer, n, inner): (usize, usize, usize),
    exclusive: bool,
    reverse: bool,
    start: T,
    f: impl Fn(T, T) -> T,
) -> Vec<T> {
    let mut out = vec![start; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let mut s = start;
            for step in 0..n {
                let k = if reverse { n - 1 - step } else { step };
                let at = (o * n + k) * inner + i;
                if exclusive {
                    out[at] = s;
                    s = f(s, v[at]);
                } else {
                    s = f(s, v[at]);
                    out[at] = s;
                }
            }
        }
    }
    out
}

/// InstanceNormalization: per (image, channel) over the spatial dims.
pub(crate) fn instance_norm(x: &HostTensor, scale: &HostTensor, bias: &HostTensor, eps: f32) -> Res<HostTensor> {
    let v = floats(x, "input")?;
    if x.shape.len() < 3 {
        return Err(err(format!("InstanceNormalization on an input of shape {:?}", x.shape)));
    }
    let c = x.shape[1];
    let inner: usize = x.shape.iter().skip(2).product();
    let (sc, bi) = (scale.f64s(), bias.f64s());
    if sc.len() != c || bi.len() != c {
        return Err(err(format!(
            "InstanceNormalization: scale and bias of {} and {} values for {c} channels",
            sc.len(),
            bi.len()
        )));
    }
    let mut out = vec![0f64; v.len()];
    for plane in 0..v.len() / inner.max(1) {
        let row = &v[plane * inner..(plane + 1) * inner];
        let m = row.iter().sum::<f64>() / inner as f64;
        let var = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / inner as f64;
        let ch = plane % c;
        for k in 0..inner {
            out[plane * inner + k] = ((row[k] - m) / (var + eps as f64).sqrt()) * sc[ch] + bi[ch];
        }
    }
    Ok(store(x, x.shape.clone(), out))
}

/// NegativeLogLikelihoodLoss on log-probabilities `x` [N, C, d...] and integer `target` [N, d...],
/// optional per-class `weight`, `ignore_index`; reduction none, sum or mean (weighted).
pub(crate) fn nll_loss(
    x: &HostTensor,
    target: &HostTensor,
    weight: Option<&HostTensor>,
    ignore: Option<i64>,
    reduction: Reduction,
) -> Res<HostTensor> {
    let v = floats(x, "input")?;
    let t = target.i64s().ok_or_else(|| err("target must be integers"))?;
    let (n, c) = (x.shape[0], *x.shape.get(1).ok_or_else(|| err("input needs a class dimension"))?);
    let inner: usize = x.shape.iter().skip(2).product();
    let w = weight.map(|w| w.f64s());
    let mut losses = Vec::with_capacity(n * inner);
    let mut wsum = 0f64;
    for b in 0..n {
        for i in 0..inner {
            let cls = t[b * inner + i];
            if Some(cls) == ignore {
                losses.push(0.0);
                continue;
            }
            if !(0..c as i64).contains(&cls) {
                return Err(err(format!("target {cls} out of range for {c} classes")));
            }
            let wc = w.as_ref().map_or(1.0, |w| w[cls as usize]);
            wsum += wc;
            losses.push(-v[(b * c + cls as usize) * inner + i] * wc);
        }
    }
    Ok(match reduction {
        Reduction::None => store(x, target.shape.clone(), losses),
        Reduction::Sum => store(x, vec![], vec![losses.iter().sum()]),
        Reduction::Mean => store(x, vec![], vec![losses.iter().sum::<f64>() / wsum]),
    })
}
