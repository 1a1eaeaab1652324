//! ConvTranspose, GroupNormalization, LRN, MaxPool with indices, Einsum: reference loops, f32
//! accumulation (f64 for f64 inputs).

use std::collections::HashMap;

use mpc_ir::ops::{ConvAttrs, PoolAttrs};

use super::{err, store, unsupported, Res};
use crate::value::HostTensor;

pub(crate) fn conv_transpose(
    x: &HostTensor,
    w: &HostTensor,
    bias: Option<&HostTensor>,
    a: &ConvAttrs,
) -> Res<HostTensor> {
    let sp = x.shape.len() - 2;
    let (nb, cin) = (x.shape[0], x.shape[1]);
    let group = a.group.max(1) as usize;
    let og = w.shape[1];
    let cout = og * group;
    let cg = cin / group;
    let kernel: Vec<usize> = if a.kernel_shape.is_empty() {
        w.shape[2..].to_vec()
    } else {
        a.kernel_shape.iter().map(|&k| k as usize).collect()
    };
    let at = |v: &[i64], i: usize, d: i64| v.get(i).copied().unwrap_or(d);
    let in_sp = &x.shape[2..];
    let kernel_i64: Vec<i64> = kernel.iter().map(|&k| k as i64).collect();
    let spec = a.window(&kernel_i64);
    let mut pads = vec![0i64; 2 * sp];
    let mut out_sp = Vec::with_capacity(sp);
    if !a.output_shape.is_empty() && a.output_shape.len() < sp {
        return Err(err(format!("output_shape {:?} gives fewer than the {sp} spatial dims", a.output_shape)));
    }
    for d in 0..sp {
        let target = (!a.output_shape.is_empty()).then(|| a.output_shape[a.output_shape.len() - sp + d]);
        let o = mpc_ir::geometry::conv_transpose_dim(&spec, d, in_sp[d] as u64, at(&a.output_padding, d, 0), target)
            .map_err(err)?;
        pads[d] = o.pad_begin as i64;
        pads[d + sp] = o.pad_end as i64;
        out_sp.push(o.out as usize);
    }
    let (xv, wv) = (x.f64s(), w.f64s());
    let ivol: usize = in_sp.iter().product();
    let ovol: usize = out_sp.iter().product();
    let kvol: usize = kernel.iter().product();
    let (ist, ost, kst) =
        (super::shape::strides(in_sp), super::shape::strides(&out_sp), super::shape::strides(&kernel));
    let mut out = vec![0f64; nb * cout * ovol];
    for b in 0..nb {
        for g in 0..group {
            for ic in 0..cg {
                let xc = b * cin + g * cg + ic;
                for ip in 0..ivol {
                    let xval = xv[xc * ivol + ip];
                    for kp in 0..kvol {
                        let mut off = 0usize;
                        let mut inside = true;
                        for d in 0..sp {
                            let i = (ip / ist[d]) % in_sp[d];
                            let k = (kp / kst[d]) % kernel[d];
                            let o = (i as i64) * at(&a.strides, d, 1) + (k as i64) * at(&a.dilations, d, 1) - pads[d];
                            if o < 0 || o >= out_sp[d] as i64 {
                                inside = false;
                                break;
                            }
                            off += o as usize * ost[d];
                        }
                        if !inside {
                            continue;
                        }
                        for oc in 0..og {
                            let wi = ((g * cg + ic) * og + oc) * kvol + kp;
                            out[(b * cout + g * og + oc) * ovol + off] += xval * wv[wi];
                        }
                    }
                }
            }
        }
    }
    if let Some(bv) = bias.map(|b| b.f64s()) {
        for (i, v) in out.iter_mut().enumerate() {
            *v += bv[(i / ovol) % cout];
        }
    }
    let mut shape = vec![nb, cout];
    shape.extend(out_sp);
    Ok(store(x, shape, out))
}

pub(crate) fn group_norm(
    x: &HostTensor,
    scale: &HostTensor,
    bias: &HostTensor,
    groups: usize,
    eps: f32,
) -> Res<HostTensor> {
    let v = x.f64s();
    let (nb, c) = (x.shape[0], x.shape[1]);
    if groups == 0 || c % groups != 0 {
        return Err(err(format!("{c} channels do not split into {groups} groups")));
    }
    let inner: usize = x.shape.iter().skip(2).product();
    let per = c / groups * inner;
    let (sc, bi) = (scale.f64s(), bias.f64s());
    let mut out = vec![0f64; v.len()];
    for b in 0..nb {
        for g in 0..groups {
            let start = (b * c + g * (c / groups)) * inner;
            let row = &v[start..start + per];
            let m = row.iter().sum::<f64>() / per as f64;
            let var = row.iter().map(|a| (a - m) * (a - m)).sum::<f64>() / per as f64;
            for (k, &a) in row.iter().enumerate() {
                let ch = g * (c / groups) + k / inner;
                out[start + k] = (a - m) / (var + eps as f64).sqrt() * sc[ch] + bi[ch];
            }
        }
    }
    Ok(store(x, x.shape.clone(), out))
}

pub(crate) fn lrn(x: &HostTensor, size: usize, alpha: f32, beta: f32, bias: f32) -> Res<HostTensor> {
    let v = x.f64s();
    let (nb, c) = (x.shape[0], x.shape[1]);
    let inner: usize = x.shape.iter().skip(2).product();
    // The window [c - floor((size-1)/2), c + ceil((size-1)/2)], clipped to the channels.
    let (lo, hi) = ((size - 1) / 2, (size - 1).div_ceil(2));
    let mut out = vec![0f64; v.len()];
    for b in 0..nb {
        for ch in 0..c {
            for i in 0..inner {
                let from = ch.saturating_sub(lo);
                let to = (ch + hi).min(c - 1);
                let sq: f64 = (from..=to).map(|k| v[(b * c + k) * inner + i].powi(2)).sum();
                let at = (b * c + ch) * inner + i;
                out[at] = v[at] / (bias as f64 + alpha as f64 / size as f64 * sq).powf(beta as f64);
            }
        }
    }
    Ok(store(x, x.shape.clone(), out))
}

/// MaxPool's values and indices (flat into the input; storage_order 1 counts the spatial dims in
/// column-major order).
pub(crate) fn max_pool_with_indices(
    x: &HostTensor,
    a: &PoolAttrs,
    out_sp: &[usize],
    pads: &[usize],
) -> Res<Vec<HostTensor>> {
    let v = x.f64s();
    let sp = out_sp.len();
    let (nb, c) = (x.shape[0], x.shape[1]);
    let in_sp = &x.shape[2..];
    let ivol: usize = in_sp.iter().product();
    let kernel: Vec<usize> = a.kernel_shape.iter().map(|&k| k as usize).collect();
    let at = |v: &[i64]| (0..sp).map(|i| v.get(i).copied().unwrap_or(1) as usize).collect::<Vec<_>>();
    let (taps, _) = super::nn::window_taps(in_sp, &kernel, pads, &at(&a.strides), &at(&a.dilations), out_sp);
    let ist = super::shape::strides(in_sp);
    let ovol = taps.len();
    let (mut vals, mut idx) = (Vec::with_capacity(nb * c * ovol), Vec::with_capacity(nb * c * ovol));
    // The flat index of window offset `off` in `plane`, in the storage order asked for.
    let index = |plane: usize, off: usize| {
        let spatial = if a.storage_order == 0 {
            off
        } else {
            let (mut s, mut mul) = (0, 1);
            for d in 0..sp {
                s += (off / ist[d]) % in_sp[d] * mul;
                mul *= in_sp[d];
            }
            s
        };
        (plane * ivol + spatial) as i64
    };
    for plane in 0..nb * c {
        for offs in &taps {
            // A window of -inf alone has its maximum at its first element.
            let mut best_i = offs.first().map_or(0, |&off| index(plane, off));
            let mut best = f64::NEG_INFINITY;
            for &off in offs {
                let val = v[plane * ivol + off];
                if val > best {
                    best = val;
                    best_i = index(plane, off);
                }
            }
            vals.push(best);
            idx.push(best_i);
        }
    }
    let mut shape = vec![nb, c];
    shape.extend(out_sp);
    let values = if x.dtype().is_float() {
        store(x, shape.clone(), vals)
    } else {
        HostTensor::from_f64(x.dtype(), shape.clone(), vals)
    };
    Ok(vec![values, HostTensor::from_i64(mpc_ir::DType::I64, shape, idx)])
}

/// Einsum by explicit loops over every letter (no ellipsis yet).
pub(crate) fn einsum(eq: &str, ins: &[&HostTensor]) -> Res<HostTensor> {
    let (terms, rhs) = mpc_ir::ops::einsum_parts(eq).map_err(unsupported)?;
    let lhs = terms.join(",");
    if terms.len() != ins.len() {
        return Err(err(format!("Einsum equation has {} operands, {} given", terms.len(), ins.len())));
    }
    let mut size: HashMap<char, usize> = HashMap::new();
    for (t, x) in terms.iter().zip(ins) {
        if t.len() != x.shape.len() {
            return Err(err(format!("Einsum term `{t}` does not match rank {}", x.shape.len())));
        }
        for (c, &d) in t.chars().zip(&x.shape) {
            if let Some(e) = size.insert(c, d).filter(|&e| e != d) {
                return Err(err(format!("Einsum label `{c}` is {e} in one operand and {d} in another")));
            }
        }
    }
    let letters: Vec<char> = {
        let mut l: Vec<char> = rhs.chars().collect();
        for c in lhs.chars().filter(|c| c.is_ascii_alphabetic()) {
            if !l.contains(&c) {
                l.push(c);
            }
        }
        l
    };
    let dims: Vec<usize> = letters.iter().map(|c| size[c]).collect();
    let out_shape: Vec<usize> = rhs.chars().map(|c| size[&c]).collect();
    let vals: Vec<Vec<f64>> = ins.iter().map(|x| x.f64s()).collect();
    let strides: Vec<Vec<(usize, usize)>> = terms
        .iter()
        .zip(ins)
        .map(|(t, x)| {
            let st = super::shape::strides(&x.shape);
            t.chars().enumerate().map(|(i, c)| (letters.iter().position(|&l| l == c).unwrap_or(0), st[i])).collect()
        })
        .collect();
    let out_n: usize = out_shape.iter().product();
    let total: usize = dims.iter().product();
    let inner = total / out_n.max(1);
    let mut out = vec![0f64; out_n];
    let mut counter = vec![0usize; letters.len()];
    for step in 0..total {
        let mut prod = 1.0;
        for (k, st) in strides.iter().enumerate() {
            let off: usize = st.iter().map(|&(l, s)| counter[l] * s).sum();
            prod *= vals[k][off];
        }
        out[step / inner.max(1)] += prod;
        for d in (0..letters.len()).rev() {
            counter[d] += 1;
            if counter[d] < dims[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(store(ins[0], out_shape, out))
}
