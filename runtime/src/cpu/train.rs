//! The `ai.mpc` ops of training graphs: gradient kernels that need more than standard ops, and the
//! optimizer and loss-scale updates. Most compute in f64 and round on store through f32 into the
//! storage dtype (f64 stays f64); AdamUpdate on the f32 family computes in f32, as the docs'
//! rule says and as PyTorch and `kernels/train.cu` do. Their meaning as decompositions into standard ops is in docs/ai-mpc-ops.md.

use mpc_ir::ops::{AdamAttrs, ConvAttrs, LossScaleAttrs, LrKind, LrScheduleAttrs, PoolAttrs, SgdAttrs};
use mpc_ir::ops::{GeluApprox, Reduction};
use mpc_ir::DType;

use super::elementwise::Real;
use super::{err, floats as float, kernel_of, store, window, window_offsets as taps, Res};
use crate::value::{Data, HostTensor};

fn same_shape(a: &HostTensor, b: &HostTensor, what: &str) -> Res<()> {
    if a.shape != b.shape {
        return Err(err(format!("{what}: shapes {:?} and {:?} differ", a.shape, b.shape)));
    }
    Ok(())
}

fn ones(v: &[i64], n: usize) -> Vec<usize> {
    (0..n).map(|i| v.get(i).copied().unwrap_or(1) as usize).collect()
}

/// Direct convolution in f64 (the f64 forward; the f32 family goes through im2col + GEMM).
pub(crate) fn conv_f64(x: &HostTensor, w: &HostTensor, b: Option<&HostTensor>, a: &ConvAttrs) -> Res<HostTensor> {
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let sp = kernel.len();
    let (out_sp, pads) = window(&x.shape[2..], &a.window(&kernel_of(w)))?;
    let src = taps(&x.shape[2..], &kernel, &pads, &ones(&a.strides, sp), &ones(&a.dilations, sp), &out_sp);
    let (nb, cin, cout) = (x.shape[0], x.shape[1], w.shape[0]);
    let group = a.group.max(1) as usize;
    let (cg, og) = (cin / group, cout / group);
    let (kvol, ovol, ivol): (usize, usize, usize) =
        (kernel.iter().product(), out_sp.iter().product(), x.shape[2..].iter().product());
    let (xv, wv) = (x.f64s(), w.f64s());
    let bv = b.map(|b| b.f64s());
    let mut y = vec![0f64; nb * cout * ovol];
    for n in 0..nb {
        for oc in 0..cout {
            let g = oc / og;
            let dst = &mut y[(n * cout + oc) * ovol..(n * cout + oc + 1) * ovol];
            for ic in 0..cg {
                let xp = &xv[(n * cin + g * cg + ic) * ivol..];
                for kp in 0..kvol {
                    let wk = wv[(oc * cg + ic) * kvol + kp];
                    for (op, d) in dst.iter_mut().enumerate() {
                        if let Some(o) = src[kp * ovol + op] {
                            *d += wk * xp[o];
                        }
                    }
                }
            }
            if let Some(bv) = &bv {
                dst.iter_mut().for_each(|d| *d += bv[oc]);
            }
        }
    }
    let mut shape = vec![nb, cout];
    shape.extend(out_sp);
    Ok(store(x, shape, y))
}

/// ConvGrad(dY, X, W) → (dX, dW, dB) of `Y = Conv(X, W, B)`.
pub(crate) fn conv_grad(dy: &HostTensor, x: &HostTensor, w: &HostTensor, a: &ConvAttrs) -> Res<Vec<HostTensor>> {
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let sp = kernel.len();
    let (out_sp, pads) = window(&x.shape[2..], &a.window(&kernel_of(w)))?;
    let (nb, cin, cout) = (x.shape[0], x.shape[1], w.shape[0]);
    let mut want = vec![nb, cout];
    want.extend(&out_sp);
    if dy.shape != want {
        return Err(err(format!("ConvGrad: dY has shape {:?}, the convolution gives {want:?}", dy.shape)));
    }
    let src = taps(&x.shape[2..], &kernel, &pads, &ones(&a.strides, sp), &ones(&a.dilations, sp), &out_sp);
    let group = a.group.max(1) as usize;
    let (cg, og) = (cin / group, cout / group);
    let (kvol, ovol, ivol): (usize, usize, usize) =
        (kernel.iter().product(), out_sp.iter().product(), x.shape[2..].iter().product());
    let (dyv, xv, wv) = (float(dy, "dY")?, float(x, "X")?, float(w, "W")?);
    let mut dx = vec![0f64; xv.len()];
    let mut dw = vec![0f64; wv.len()];
    let mut db = vec![0f64; cout];
    for n in 0..nb {
        for oc in 0..cout {
            let g = oc / og;
            let dyp = &dyv[(n * cout + oc) * ovol..(n * cout + oc + 1) * ovol];
            db[oc] += dyp.iter().sum::<f64>();
            for ic in 0..cg {
                let xo = (n * cin + g * cg + ic) * ivol;
                for kp in 0..kvol {
                    let wi = (oc * cg + ic) * kvol + kp;
                    let wk = wv[wi];
                    let mut acc = 0.0;
                    for (op, &d) in dyp.iter().enumerate() {
                        if let Some(o) = src[kp * ovol + op] {
                            acc += d * xv[xo + o];
                            dx[xo + o] += d * wk;
                        }
                    }
                    dw[wi] += acc;
                }
            }
        }
    }
    Ok(vec![store(dy, x.shape.clone(), dx), store(dy, w.shape.clone(), dw), store(dy, vec![cout], db)])
}

/// MaxPoolGrad / AveragePoolGrad(dY, X) → dX: each output's gradient goes to the first maximum of
/// its window, or is spread evenly over the window's divisor.
pub(crate) fn pool_grad(dy: &HostTensor, x: &HostTensor, a: &PoolAttrs, max: bool) -> Res<HostTensor> {
    let kernel: Vec<usize> = a.kernel_shape.iter().map(|&k| k as usize).collect();
    let sp = kernel.len();
    let in_sp = &x.shape[2..];
    let (out_sp, pads) = window(in_sp, &a.window())?;
    let (st, dl) = (ones(&a.strides, sp), ones(&a.dilations, sp));
    // The same taps as the forward pooling, in the same order.
    let (src, padded) = super::nn::window_taps(in_sp, &kernel, &pads, &st, &dl, &out_sp);
    let (ovol, ivol): (usize, usize) = (out_sp.iter().product(), in_sp.iter().product());
    let planes = x.shape[0] * x.shape[1];
    if dy.len() != planes * ovol {
        return Err(err(format!("pool gradient: dY has {} values, the pooling gives {}", dy.len(), planes * ovol)));
    }
    // Divisor of each window for average pooling: taps inside the input, plus the explicit padding
    // when count_include_pad (never the ceil-mode overhang).
    let divisor: Vec<f64> = src
        .iter()
        .zip(&padded)
        .map(|(offs, &pad)| {
            let n = if a.count_include_pad { offs.len().saturating_add(pad) } else { offs.len() };
            n.max(1) as f64
        })
        .collect();
    let (dyv, xv) = (float(dy, "dY")?, float(x, "X")?);
    let mut dx = vec![0f64; xv.len()];
    for p in 0..planes {
        let (xp, g) = (&xv[p * ivol..(p + 1) * ivol], &dyv[p * ovol..(p + 1) * ovol]);
        let dxp = &mut dx[p * ivol..(p + 1) * ivol];
        for (op, offs) in src.iter().enumerate() {
            if max {
                let mut best: Option<usize> = None;
                for &o in offs {
                    if best.is_none_or(|b| xp[o] > xp[b] || (xp[o].is_nan() && !xp[b].is_nan())) {
                        best = Some(o);
                    }
                }
                if let Some(b) = best {
                    dxp[b] += g[op];
                }
            } else {
                for &o in offs {
                    dxp[o] += g[op] / divisor[op];
                }
            }
        }
    }
    Ok(store(dy, x.shape.clone(), dx))
}

/// BatchNormalizationGrad(dY, X, scale) → (dX, dScale, dBias) of training-mode batch norm
/// (batch statistics, biased variance).
pub(crate) fn batch_norm_grad(dy: &HostTensor, x: &HostTensor, scale: &HostTensor, eps: f32) -> Res<Vec<HostTensor>> {
    same_shape(dy, x, "BatchNormalizationGrad")?;
    let (nb, c) = (x.shape[0], *x.shape.get(1).unwrap_or(&1));
    let inner: usize = x.shape.iter().skip(2).product();
    let (dyv, xv, sc) = (float(dy, "dY")?, float(x, "X")?, float(scale, "scale")?);
    let cnt = (nb * inner) as f64;
    let mut dx = vec![0f64; xv.len()];
    let (mut ds, mut dbias) = (vec![0f64; c], vec![0f64; c]);
    let idx = |b: usize, ch: usize| (b * c + ch) * inner..(b * c + ch + 1) * inner;
    for ch in 0..c {
        let mean = (0..nb).map(|b| xv[idx(b, ch)].iter().sum::<f64>()).sum::<f64>() / cnt;
        let var =
            (0..nb).map(|b| xv[idx(b, ch)].iter().map(|a| (a - mean) * (a - mean)).sum::<f64>()).sum::<f64>() / cnt;
        let inv = 1.0 / (var + eps as f64).sqrt();
        let (mut sg, mut sgx) = (0.0, 0.0);
        for b in 0..nb {
            for (g, a) in dyv[idx(b, ch)].iter().zip(&xv[idx(b, ch)]) {
                sg += g;
                sgx += g * (a - mean) * inv;
            }
        }
        dbias[ch] = sg;
        ds[ch] = sgx;
        let k = sc[ch] * inv / cnt;
        for b in 0..nb {
            for i in idx(b, ch) {
                let xhat = (xv[i] - mean) * inv;
                dx[i] = k * (cnt * dyv[i] - sg - xhat * sgx);
            }
        }
    }
    Ok(vec![store(dy, x.shape.clone(), dx), store(dy, scale.shape.clone(), ds), store(dy, scale.shape.clone(), dbias)])
}

/// LayerNormalizationGrad(dY, X, scale) → (dX, dScale, dBias): statistics over the dims from `axis`.
pub(crate) fn layer_norm_grad(
    dy: &HostTensor,
    x: &HostTensor,
    scale: &HostTensor,
    axis: usize,
    eps: f32,
) -> Res<Vec<HostTensor>> {
    same_shape(dy, x, "LayerNormalizationGrad")?;
    let outer: usize = x.shape[..axis].iter().product();
    let n: usize = x.shape[axis..].iter().product();
    let si = super::elementwise::broadcast_index(&scale.shape, &x.shape[axis..]);
    let (dyv, xv, sc) = (float(dy, "dY")?, float(x, "X")?, float(scale, "scale")?);
    let mut dx = vec![0f64; xv.len()];
    let (mut ds, mut dbias) = (vec![0f64; scale.len()], vec![0f64; scale.len()]);
    let nf = n as f64;
    for o in 0..outer {
        let r = o * n..(o + 1) * n;
        let (row, g) = (&xv[r.clone()], &dyv[r.clone()]);
        let mean = row.iter().sum::<f64>() / nf;
        let var = row.iter().map(|a| (a - mean) * (a - mean)).sum::<f64>() / nf;
        let inv = 1.0 / (var + eps as f64).sqrt();
        let (mut s1, mut s2) = (0.0, 0.0);
        for k in 0..n {
            let xhat = (row[k] - mean) * inv;
            let gh = g[k] * sc[si[k]];
            s1 += gh;
            s2 += gh * xhat;
            ds[si[k]] += g[k] * xhat;
            dbias[si[k]] += g[k];
        }
        for k in 0..n {
            let xhat = (row[k] - mean) * inv;
            dx[o * n + k] = inv / nf * (nf * g[k] * sc[si[k]] - s1 - xhat * s2);
        }
    }
    Ok(vec![store(dy, x.shape.clone(), dx), store(dy, scale.shape.clone(), ds), store(dy, scale.shape.clone(), dbias)])
}

/// GeluGrad(dY, X) → dY · Gelu'(X), for the exact (erf) and tanh forms.
pub(crate) fn gelu_grad(dy: &HostTensor, x: &HostTensor, approximate: GeluApprox) -> Res<HostTensor> {
    same_shape(dy, x, "GeluGrad")?;
    let (dyv, xv) = (float(dy, "dY")?, float(x, "X")?);
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let d: Vec<f64> = dyv
        .iter()
        .zip(&xv)
        .map(|(&g, &x)| {
            let slope = if approximate == GeluApprox::Tanh {
                let t = (c * (x + 0.044715 * x * x * x)).tanh();
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
            } else {
                let cdf = 0.5 * (1.0 + Real::erf(x / std::f64::consts::SQRT_2));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                cdf + x * pdf
            };
            g * slope
        })
        .collect();
    Ok(store(dy, x.shape.clone(), d))
}

/// The class and weight of each position of a loss input, `None` where ignored.
type Positions = Vec<Option<(usize, f64)>>;

/// The weight and the class of every position of a [N, C, d...] loss input, `None` where ignored.
fn loss_positions(
    input: &HostTensor,
    target: &HostTensor,
    weights: Option<&HostTensor>,
    ignore: Option<i64>,
) -> Res<(usize, usize, Positions)> {
    let (nb, c) = (input.shape[0], *input.shape.get(1).ok_or_else(|| err("loss input needs a class axis"))?);
    let inner: usize = input.shape.iter().skip(2).product();
    let t = target.i64s().ok_or_else(|| err("loss target must be integers"))?;
    if t.len() != nb * inner {
        return Err(err(format!("loss target has {} values, the input has {} positions", t.len(), nb * inner)));
    }
    let w = weights.map(|w| w.f64s());
    let pos = t
        .iter()
        .map(|&k| {
            if Some(k) == ignore {
                return Ok(None);
            }
            if k < 0 || k as usize >= c {
                return Err(err(format!("class {k} out of range for {c} classes")));
            }
            Ok(Some((k as usize, w.as_ref().map_or(1.0, |w| w[k as usize]))))
        })
        .collect::<Res<Vec<_>>>()?;
    Ok((c, inner, pos))
}

/// SoftmaxCrossEntropyLossGrad (`softmax`: the input is scores) or NegativeLogLikelihoodLossGrad
/// (the input is log-probabilities): the gradient with respect to the [N, C, d...] input.
pub(crate) fn loss_grad(
    dloss: &HostTensor,
    input: &HostTensor,
    target: &HostTensor,
    weights: Option<&HostTensor>,
    ignore: Option<i64>,
    reduction: Reduction,
    softmax: bool,
) -> Res<HostTensor> {
    let (c, inner, pos) = loss_positions(input, target, weights, ignore)?;
    let xv = float(input, "loss input")?;
    let dl = dloss.f64s();
    let total_w: f64 = pos.iter().flatten().map(|(_, w)| w).sum();
    let mut dx = vec![0f64; xv.len()];
    for (p, at) in pos.iter().enumerate() {
        let Some((k, w)) = *at else { continue };
        let g = match reduction {
            Reduction::None => *dl.get(p).ok_or_else(|| err("dLoss has fewer values than positions"))?,
            Reduction::Sum => dl[0],
            Reduction::Mean => dl[0] / total_w,
        };
        let (n, i) = (p / inner, p % inner);
        let at = |cls: usize| (n * c + cls) * inner + i;
        if softmax {
            let m = (0..c).map(|cls| xv[at(cls)]).fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = (0..c).map(|cls| (xv[at(cls)] - m).exp()).sum();
            for cls in 0..c {
                let prob = (xv[at(cls)] - m).exp() / z;
                dx[at(cls)] = g * w * (prob - if cls == k { 1.0 } else { 0.0 });
            }
        } else {
            dx[at(k)] = -g * w;
        }
    }
    Ok(store(input, input.shape.clone(), dx))
}

/// GatherGrad(dY, indices, shape) → zeros(shape) with dY's slices added at `indices` along `axis`
/// (repeated indices accumulate: the embedding gradient).
pub(crate) fn gather_grad(dy: &HostTensor, indices: &HostTensor, shape: &HostTensor, axis: i64) -> Res<HostTensor> {
    let shape: Vec<usize> =
        shape.i64s().ok_or_else(|| err("shape must be integers"))?.iter().map(|&d| d as usize).collect();
    let ax = super::axis(axis, shape.len())?;
    let idx = indices.i64s().ok_or_else(|| err("indices must be integers"))?;
    let (outer, len, inner): (usize, usize, usize) =
        (shape[..ax].iter().product(), shape[ax], shape[ax + 1..].iter().product());
    if dy.len() != outer * idx.len() * inner {
        return Err(err(format!("GatherGrad: dY has {} values, expected {}", dy.len(), outer * idx.len() * inner)));
    }
    let g = float(dy, "dY")?;
    let mut out = vec![0f64; outer * len * inner];
    for o in 0..outer {
        for (j, &i) in idx.iter().enumerate() {
            let i = if i < 0 { i + len as i64 } else { i };
            if i < 0 || i as usize >= len {
                return Err(err(format!("index {i} out of range for axis of {len}")));
            }
            let src = &g[(o * idx.len() + j) * inner..(o * idx.len() + j + 1) * inner];
            let dst = &mut out[(o * len + i as usize) * inner..(o * len + i as usize + 1) * inner];
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        }
    }
    Ok(store(dy, shape, out))
}

/// ReluGrad(dY, Y) → dY where Y > 0, else 0.
pub(crate) fn relu_grad(dy: &HostTensor, y: &HostTensor) -> Res<HostTensor> {
    same_shape(dy, y, "ReluGrad")?;
    let (g, v) = (float(dy, "dY")?, float(y, "Y")?);
    let out = g.iter().zip(&v).map(|(&g, &y)| if y > 0.0 { g } else { 0.0 }).collect();
    Ok(store(dy, dy.shape.clone(), out))
}

/// SoftmaxGrad(dY, Y) along `axis` → Y ⊙ (dY − Σ_axis dY ⊙ Y).
pub(crate) fn softmax_grad(dy: &HostTensor, y: &HostTensor, axis: usize) -> Res<HostTensor> {
    same_shape(dy, y, "SoftmaxGrad")?;
    let (g, v) = (float(dy, "dY")?, float(y, "Y")?);
    let (len, inner) = (y.shape[axis], y.shape[axis + 1..].iter().product::<usize>());
    let outer = v.len().checked_div(len * inner).unwrap_or(0);
    let mut out = vec![0f64; v.len()];
    for o in 0..outer {
        for i in 0..inner {
            let at = |k: usize| (o * len + k) * inner + i;
            let s: f64 = (0..len).map(|k| g[at(k)] * v[at(k)]).sum();
            for k in 0..len {
                out[at(k)] = v[at(k)] * (g[at(k)] - s);
            }
        }
    }
    Ok(store(dy, dy.shape.clone(), out))
}

/// The splitmix64 finalizer: a bijective mix of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform number in [0, 1) that SeededDropout draws for element `i` of the stream
/// `(key, seed)`: 24 bits of `mix(mix(key ^ mix(seed)) + (i + 1) · φ)`, φ = 0x9E3779B97F4A7C15.
/// Counter-based, so any element can be drawn on its own (one GPU thread per element).
pub(crate) fn dropout_uniform(key: i64, seed: i64, i: u64) -> f64 {
    let base = mix(key as u64 ^ mix(seed as u64));
    let z = mix(base.wrapping_add((i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (z >> 40) as f64 / (1u64 << 24) as f64
}

/// SeededDropout(X, ratio, key) → (X · mask / (1 - ratio), mask): element `i` is kept when its
/// [`dropout_uniform`] is at least `ratio` (0.5 when absent).
pub(crate) fn seeded_dropout(
    x: &HostTensor,
    ratio: Option<&HostTensor>,
    key: &HostTensor,
    seed: i64,
) -> Res<(HostTensor, HostTensor)> {
    let ratio = match ratio {
        None => 0.5,
        Some(r) => float(r, "ratio")?.first().copied().ok_or_else(|| err("the ratio is empty"))?,
    };
    if !(0.0..1.0).contains(&ratio) {
        return Err(err(format!("dropout ratio {ratio} is outside [0, 1)")));
    }
    let key = key.i64s().and_then(|k| k.first().copied()).ok_or_else(|| err("the key must be an i64 scalar"))?;
    let scale = 1.0 / (1.0 - ratio);
    let v = float(x, "X")?;
    let mask: Vec<bool> = (0..v.len() as u64).map(|i| dropout_uniform(key, seed, i) >= ratio).collect();
    let out = v.iter().zip(&mask).map(|(&a, &keep)| if keep { a * scale } else { 0.0 }).collect();
    Ok((store(x, x.shape.clone(), out), HostTensor { shape: x.shape.clone(), data: Data::Bool(mask.into()) }))
}

/// AllFinite(x...) → true when no input holds an Inf or NaN.
pub(crate) fn all_finite(xs: &[&HostTensor]) -> Res<HostTensor> {
    let finite = xs.iter().all(|x| match &x.data {
        Data::F32(v) => v.iter().all(|a| a.is_finite()),
        Data::F16(v) => v.iter().all(|a| a.is_finite()),
        Data::BF16(v) => v.iter().all(|a| a.is_finite()),
        Data::F64(v) => v.iter().all(|a| a.is_finite()),
        _ => true,
    });
    Ok(HostTensor { shape: vec![], data: Data::Bool(vec![finite].into()) })
}

fn flag(t: &HostTensor) -> Res<bool> {
    match &t.data {
        Data::Bool(v) if v.len() == 1 => Ok(v[0]),
        _ => Err(err("the finite flag must be one bool")),
    }
}

/// An update's gradient in its parameter's dtype, multiplied by `inv_scale` there when given: what
/// a Cast to the parameter's dtype and a Mul by the scale would make, bit for bit (the training
/// compiler folds them into the update). A gradient of the parameter's dtype, or an f16/bf16
/// gradient of an f32 parameter; `inv_scale` one f32, for f32 and f64 parameters only (the CUDA
/// kernels multiply in f32 or f64, where an f16 Mul would round the product).
pub(crate) fn unscaled<'a>(
    p: &HostTensor,
    g: &'a HostTensor,
    inv: Option<&HostTensor>,
    op: &str,
) -> Res<std::borrow::Cow<'a, HostTensor>> {
    use std::borrow::Cow;
    let (pd, gd) = (p.dtype(), g.dtype());
    let widen = pd == DType::F32 && matches!(gd, DType::F16 | DType::BF16);
    if pd != gd && !widen {
        return Err(err(format!("{op} of {pd} parameters with {gd} gradients")));
    }
    let inv = match inv {
        None if !widen => return Ok(Cow::Borrowed(g)),
        None => None,
        Some(_) if !matches!(pd, DType::F32 | DType::F64) => {
            return Err(err(format!("{op}: an inv_scale with {pd} parameters")));
        }
        Some(s) if s.dtype() == DType::F32 && s.shape.iter().product::<usize>() == 1 => {
            s.f32s().and_then(|v| v.first().copied())
        }
        Some(s) => return Err(err(format!("{op}: inv_scale must be one f32, not {}{:?}", s.dtype(), s.shape))),
    };
    Ok(Cow::Owned(match pd {
        DType::F64 => {
            let k = inv.map_or(1.0, f64::from);
            HostTensor::from_f64(pd, g.shape.clone(), g.f64s().into_iter().map(|d| d * k).collect())
        }
        _ => {
            let v = g.f32s().ok_or_else(|| err(format!("{op}: {gd} gradients")))?;
            HostTensor::from_f32(pd, g.shape.clone(), v.into_iter().map(|d| inv.map_or(d, |k| d * k)).collect())
        }
    }))
}

/// SgdUpdate(param, grad, finite[, velocity][, inv_scale][, low]) → (param'[, velocity'][, low']);
/// unchanged when not finite (`low`, the parameter's low-precision copy: [`with_low_copy`]).
pub(crate) fn sgd_update(ins: &[&HostTensor], velocity: Option<&HostTensor>, a: &SgdAttrs) -> Res<Vec<HostTensor>> {
    let (p, g, finite) = (ins[0], ins[1], flag(ins[2])?);
    same_shape(p, g, "SgdUpdate")?;
    if !finite {
        return Ok(std::iter::once(p.clone()).chain(velocity.cloned()).collect());
    }
    let (pv, gv) = (float(p, "param")?, float(g, "grad")?);
    let mut vel = velocity.map(|v| v.f64s());
    let (lr, mu, wd) = (a.lr as f64, a.momentum as f64, a.weight_decay as f64);
    let mut out = Vec::with_capacity(pv.len());
    for i in 0..pv.len() {
        let d = gv[i] + wd * pv[i];
        let step = match vel.as_mut() {
            Some(v) => {
                v[i] = mu * v[i] + d;
                if a.nesterov {
                    d + mu * v[i]
                } else {
                    v[i]
                }
            }
            None => d,
        };
        out.push(pv[i] - lr * step);
    }
    let mut res = vec![store(p, p.shape.clone(), out)];
    if let (Some(v), Some(vv)) = (velocity, vel) {
        res.push(store(v, v.shape.clone(), vv));
    }
    Ok(res)
}

/// AdamUpdate(param, grad, m, v, step, finite[, inv_scale][, low]) → (param', m', v'[, low']),
/// `step` being the count after this update (bias correction); unchanged when not finite (`low`:
/// [`with_low_copy`]).
pub(crate) fn adam_update(ins: &[&HostTensor], a: &AdamAttrs) -> Res<Vec<HostTensor>> {
    let (p, g, m, v, step, finite) = (ins[0], ins[1], ins[2], ins[3], ins[4], flag(ins[5])?);
    same_shape(p, g, "AdamUpdate")?;
    if !finite {
        return Ok(vec![p.clone(), m.clone(), v.clone()]);
    }
    let t = step.i64s().and_then(|s| s.first().copied()).ok_or_else(|| err("step must be an integer"))?.max(1);
    // The bias corrections once, in f64 (as the CUDA kernel does).
    let (c1, c2) = (1.0 - (a.beta1 as f64).powf(t as f64), 1.0 - (a.beta2 as f64).powf(t as f64));
    if p.dtype() == DType::F64 {
        let (mut pv, gv, mut mv, mut vv) = (float(p, "param")?, float(g, "grad")?, m.f64s(), v.f64s());
        adam_in(&mut pv, &gv, &mut mv, &mut vv, a, (c1, c2))?;
        return Ok(vec![store(p, p.shape.clone(), pv), store(m, m.shape.clone(), mv), store(v, v.shape.clone(), vv)]);
    }
    // The f32 family: f32 arithmetic, as PyTorch's Adam and the CUDA kernel (kernels/train.cu).
    let f32s = |x: &HostTensor, what: &str| {
        x.f32s().ok_or_else(|| err(format!("{what}: {} where a float tensor was expected", x.dtype())))
    };
    let (mut pv, gv, mut mv, mut vv) = (f32s(p, "param")?, f32s(g, "grad")?, f32s(m, "m")?, f32s(v, "v")?);
    adam_in(&mut pv, &gv, &mut mv, &mut vv, a, (c1, c2))?;
    Ok(vec![
        HostTensor::from_f32(p.dtype(), p.shape.clone(), pv),
        HostTensor::from_f32(m.dtype(), m.shape.clone(), mv),
        HostTensor::from_f32(v.dtype(), v.shape.clone(), vv),
    ])
}

/// One Adam (or AdamW) update in the arithmetic of `T`, the bias corrections `c` given in f64.
fn adam_in<T: Real>(p: &mut [T], g: &[T], m: &mut [T], v: &mut [T], a: &AdamAttrs, c: (f64, f64)) -> Res<()> {
    if g.len() != p.len() || m.len() != p.len() || v.len() != p.len() {
        return Err(err("AdamUpdate: the parameter, gradient and moments differ in size"));
    }
    let of = |x: f32| T::of(x as f64);
    let (b1, b2, eps, lr, wd) = (of(a.beta1), of(a.beta2), of(a.epsilon), of(a.lr), of(a.weight_decay));
    let (c1, c2, one) = (T::of(c.0), T::of(c.1), T::of(1.0));
    for i in 0..p.len() {
        let (mut w, mut d) = (p[i], g[i]);
        if a.decoupled {
            w = w - lr * wd * w;
        } else {
            d = d + wd * w;
        }
        m[i] = b1 * m[i] + (one - b1) * d;
        v[i] = b2 * v[i] + (one - b2) * d * d;
        p[i] = w - lr * (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
    }
    Ok(())
}

/// An update's outputs followed, when the update has a low-precision copy of its parameter (its
/// last input), by the copy's next value: the new parameter cast to the copy's dtype (what a Cast
/// of it makes), or the copy unchanged on a skipped step.
pub(crate) fn with_low_copy(
    mut outs: Vec<HostTensor>,
    low: Option<&HostTensor>,
    finite: &HostTensor,
) -> Res<Vec<HostTensor>> {
    let Some(low) = low else { return Ok(outs) };
    let p = &outs[0];
    if p.dtype() != DType::F32 || !matches!(low.dtype(), DType::F16 | DType::BF16) || low.shape != p.shape {
        return Err(err(format!(
            "a {}{:?} low-precision copy of a {}{:?} parameter",
            low.dtype(),
            low.shape,
            p.dtype(),
            p.shape
        )));
    }
    let next = if flag(finite)? { p.cast(low.dtype()) } else { low.clone() };
    outs.push(next);
    Ok(outs)
}

/// The learning rate `LrSchedule` gives after `step` applied updates at the peak rate `peak`, in
/// f64 (kernels/train.cu's `train_lr_schedule` computes the same): a linear warmup from 0 over
/// `warmup` updates, then the curve. Each curve is the one of the PyTorch or Hugging Face
/// scheduler of that name: constant, linear and cosine decay to `min_ratio · peak` at `total`
/// (`get_{constant,linear,cosine}_schedule_with_warmup`, with `min_lr_rate`), held there after;
/// step: `gamma^⌊(step − warmup) / step_size⌋` (`StepLR`); one-cycle (`OneCycleLR`, cosine
/// annealing): from `start_ratio · peak` up to the peak at update `warmup − 1`, then down to
/// `min_ratio · peak` at update `total − 1`.
pub fn scheduled_rate(a: &LrScheduleAttrs, step: i64, peak: f64) -> f64 {
    let (s, w, t) = (step.max(0) as f64, a.warmup.max(0) as f64, a.total.max(0) as f64);
    let floor = f64::from(a.min_ratio);
    let cosine = |from: f64, to: f64, pct: f64| to + (from - to) / 2.0 * ((std::f64::consts::PI * pct).cos() + 1.0);
    if a.kind == LrKind::OneCycle {
        let (start, low, rise_end, end) = (peak * f64::from(a.start_ratio), peak * floor, w - 1.0, t - 1.0);
        return if s <= rise_end {
            cosine(start, peak, s / rise_end)
        } else {
            cosine(peak, low, ((s - rise_end) / (end - rise_end)).min(1.0))
        };
    }
    if s < w {
        return peak * (s / w.max(1.0));
    }
    let progress = ((s - w) / (t - w).max(1.0)).min(1.0);
    let factor = match a.kind {
        LrKind::Constant | LrKind::OneCycle => return peak,
        LrKind::Linear => 1.0 - progress,
        LrKind::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        LrKind::Step => return peak * f64::from(a.gamma).powf(((s - w) / a.step_size.max(1) as f64).floor()),
    };
    peak * (floor + (1.0 - floor) * factor)
}

/// LrSchedule(step, peak) → the rate ([`scheduled_rate`]), rounded to f32.
pub(crate) fn lr_schedule(step: &HostTensor, peak: &HostTensor, a: &LrScheduleAttrs) -> Res<Vec<HostTensor>> {
    let s = step.i64s().and_then(|s| s.first().copied()).ok_or_else(|| err("the step count must be an integer"))?;
    let p = peak.f64s().first().copied().ok_or_else(|| err("an empty peak learning rate"))?;
    Ok(vec![HostTensor::from_f32(DType::F32, vec![], vec![scheduled_rate(a, s, p) as f32])])
}

/// An update's attributes with the rate its `lr` input gives, when it has one.
pub(crate) fn rate_of(lr: Option<&HostTensor>, attr: f32) -> Res<f32> {
    match lr {
        None => Ok(attr),
        Some(t) => {
            t.f32s().and_then(|v| v.first().copied()).ok_or_else(|| err("the learning rate must be an f32 scalar"))
        }
    }
}

/// LossScaleUpdate(scale, good_steps, finite) → (scale', good_steps').
pub(crate) fn loss_scale_update(
    scale: &HostTensor,
    good: &HostTensor,
    finite: &HostTensor,
    a: &LossScaleAttrs,
) -> Res<Vec<HostTensor>> {
    let s = scale.f64s().first().copied().ok_or_else(|| err("empty loss scale"))?;
    let n = good.i64s().and_then(|v| v.first().copied()).ok_or_else(|| err("good-step count must be an integer"))?;
    let (s, n) = if flag(finite)? {
        if n + 1 >= a.growth_interval {
            ((s * a.growth_factor as f64).min(a.max_scale as f64), 0)
        } else {
            (s, n + 1)
        }
    } else {
        ((s * a.backoff_factor as f64).max(a.min_scale as f64), 0)
    };
    Ok(vec![
        store(scale, scale.shape.clone(), vec![s]),
        HostTensor::from_i64(good.dtype(), good.shape.clone(), vec![n]),
    ])
}
