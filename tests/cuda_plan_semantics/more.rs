//! The interpreter of the pooling, normalisation, softmax-gradient and loss kernels (the training
//! kernels' is `train.rs`).

use mpc_ir::DType;
use mpc_runtime::cuda::plan::{Arg, Buf, Kernel, Window3};
use mpc_runtime::value::HostTensor;

use super::interp::*;

/// Pooling, batch and layer normalisation gradients, softmax gradients, losses and optimizer
/// kernels ([`run_more`]).
pub(crate) const MORE: [&str; 32] = [
    "attention_",
    "elementwise_and_u8",
    "elementwise_or_u8",
    "elementwise_equal_",
    "elementwise_less_",
    "elementwise_greater_",
    "elementwise_less_equal_",
    "elementwise_greater_equal_",
    "movement_pad_",
    "elementwise_isnan_",
    "elementwise_where_",
    "norm_instance_norm_",
    "elementwise_not_u8",
    "elementwise_clip_",
    "gather_grad_direct_",
    "movement_resize_",
    "train_gelu_grad_",
    "train_seeded_dropout_",
    "pool_",
    "norm_batch_norm_",
    "norm_bn_",
    "norm_layer_norm_grad",
    "softmax_softmax_grad_",
    "softmax_log_softmax_grad_",
    "loss_",
    "train_relu_grad_",
    "train_all_finite",
    "train_sgd_",
    "train_adam_",
    "train_loss_scale_update",
    "train_lr_schedule",
    "train_unscale_",
];

/// A batch norm's value through its residual Add where `res` is given (the value rounded to `d`
/// as its store would round it, plus the residual's element `i`) and its Relu when `relu`.
fn bn_res_out(m: &mut Memory, v: f64, res: Arg, i: i64, d: DType, relu: bool) -> f64 {
    let v = match res {
        Arg::Ptr(r) => HostTensor::from_f64(d, vec![1], vec![v]).f64s()[0] + m.get(r, i, d),
        _ => v,
    };
    bn_out(v, relu)
}

/// A batch norm's output through its Relu epilogue when `relu`: NaN stays NaN.
fn bn_out(v: f64, relu: bool) -> f64 {
    if relu && !(v.is_nan() || v > 0.0) {
        0.0
    } else {
        v
    }
}

pub(crate) fn f32_of(a: &Arg) -> f64 {
    match *a {
        Arg::F32(v) => v as f64,
        ref a => panic!("{a:?} where an f32 was expected"),
    }
}

/// The input offsets (within one plane) of output `o`'s window taps, in kernel order; `None`
/// for a tap outside the input.
pub(crate) fn taps(w: &Window3, o: i64) -> Vec<Option<i64>> {
    let nsp = w.nsp as usize;
    let kvol: i64 = w.k[..nsp].iter().product();
    (0..kvol)
        .map(|kp| {
            let (mut kr, mut or, mut off, mut scale) = (kp, o, 0i64, 1i64);
            let mut inside = true;
            for s in (0..nsp).rev() {
                let (kc, oc) = (kr % w.k[s], or % w.out[s]);
                kr /= w.k[s];
                or /= w.out[s];
                let i = oc * w.stride[s] + kc * w.dil[s] - w.pad[s];
                inside &= i >= 0 && i < w.inp[s];
                off += i * scale;
                scale *= w.inp[s];
            }
            inside.then_some(off)
        })
        .collect()
}

/// AveragePool's divisor for output `o`: the taps inside, or with count_include_pad those
/// inside the explicit padding.
pub(crate) fn avg_divisor(w: &Window3, o: i64, cip: bool) -> f64 {
    let nsp = w.nsp as usize;
    let kvol: i64 = w.k[..nsp].iter().product();
    let mut count = 0;
    for kp in 0..kvol {
        let (mut kr, mut or, mut ok) = (kp, o, true);
        for s in (0..nsp).rev() {
            let (kc, oc) = (kr % w.k[s], or % w.out[s]);
            kr /= w.k[s];
            or /= w.out[s];
            let i = oc * w.stride[s] + kc * w.dil[s] - w.pad[s];
            ok &= if cip { i >= -w.pad[s] && i < w.inp[s] + w.pad_end[s] } else { i >= 0 && i < w.inp[s] };
        }
        count += ok as i64;
    }
    count.max(1) as f64
}

pub(crate) fn run_more(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let name = k.name.as_str();
    let tag = name.rsplit('_').next().unwrap();
    if super::train::run_train(m, k) || super::attention::run_attention(m, k) {
        return;
    }
    if name.starts_with("pool_") {
        let d = dtype_of(tag);
        let w = a.iter().find_map(|x| if let Arg::Window(w) = x { Some(*w) } else { None }).expect("a window");
        let nsp = w.nsp as usize;
        let (ivol, ovol): (i64, i64) = (w.inp[..nsp].iter().product(), w.out[..nsp].iter().product());
        if name.starts_with("pool_max_argmax_") {
            let (x, arg, planes) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]));
            for pl in 0..planes {
                for o in 0..ovol {
                    let (mut best, mut at) = (f64::NEG_INFINITY, -1i64);
                    for off in taps(&w, o).into_iter().flatten() {
                        let v = m.get(x, pl * ivol + off, d);
                        if at < 0 || (v.is_nan() && !best.is_nan()) || v > best {
                            (best, at) = (v, off);
                        }
                    }
                    m.set(arg, pl * ovol + o, DType::I32, at as f64);
                }
            }
        } else if name.starts_with("pool_max_grad_") {
            let (dy, arg, dx, planes) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
            for pl in 0..planes {
                let mut acc = vec![0.0; ivol as usize];
                for o in 0..ovol {
                    let at = m.get(arg, pl * ovol + o, DType::I32) as i64;
                    if at >= 0 {
                        acc[at as usize] += m.get(dy, pl * ovol + o, d);
                    }
                }
                for (i, v) in acc.into_iter().enumerate() {
                    m.set(dx, pl * ivol + i as i64, d, v);
                }
            }
        } else if name.starts_with("pool_avg_grad_") {
            let (dy, dx, planes, cip) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[4]) != 0);
            for pl in 0..planes {
                let mut acc = vec![0.0; ivol as usize];
                for o in 0..ovol {
                    let g = m.get(dy, pl * ovol + o, d) / avg_divisor(&w, o, cip);
                    for off in taps(&w, o).into_iter().flatten() {
                        acc[off as usize] += g;
                    }
                }
                for (i, v) in acc.into_iter().enumerate() {
                    m.set(dx, pl * ivol + i as i64, d, v);
                }
            }
        } else {
            let max = name.starts_with("pool_max_");
            let (x, y, planes) = (ptr(&a[0]), ptr(&a[1]), int(&a[if max { 3 } else { 2 }]));
            let (indices, col_major) = if max { (a[2], int(&a[5]) != 0) } else { (Arg::Null, false) };
            let cip = !max && int(&a[4]) != 0;
            for pl in 0..planes {
                for o in 0..ovol {
                    if let Arg::Ptr(ib) = indices {
                        // The first strict maximum, NaNs skipped; its flat index into x (the first
                        // tap's for a window of -inf or NaN, 0 with no tap).
                        let (mut best, mut at, mut first) = (f64::NEG_INFINITY, 0i64, true);
                        for off in taps(&w, o).into_iter().flatten() {
                            let v = m.get(x, pl * ivol + off, d);
                            if first || v > best {
                                first = false;
                                best = best.max(v);
                                let sp = if col_major {
                                    let nsp = w.nsp as usize;
                                    let (mut r, mut c, mut scale) = (off, vec![0i64; nsp], 1i64);
                                    for s in (0..nsp).rev() {
                                        c[s] = r % w.inp[s];
                                        r /= w.inp[s];
                                    }
                                    let mut sp = 0;
                                    for (s, &cs) in c.iter().enumerate() {
                                        sp += cs * scale;
                                        scale *= w.inp[s];
                                    }
                                    sp
                                } else {
                                    off
                                };
                                at = pl * ivol + sp;
                            }
                        }
                        m.set(y, pl * ovol + o, d, best);
                        m.set(ib, pl * ovol + o, DType::I64, at as f64);
                        continue;
                    }
                    let vals: Vec<f64> =
                        taps(&w, o).into_iter().flatten().map(|off| m.get(x, pl * ivol + off, d)).collect();
                    let r = if max {
                        vals.iter()
                            .fold(f64::NEG_INFINITY, |b, &v| if v.is_nan() || b.is_nan() { f64::NAN } else { b.max(v) })
                    } else {
                        vals.iter().sum::<f64>() / avg_divisor(&w, o, cip)
                    };
                    m.set(y, pl * ovol + o, d, r);
                }
            }
        }
    } else if name.starts_with("norm_bn_") {
        run_bn_pass(m, k);
    } else if name.starts_with("norm_batch_norm_") || name.starts_with("norm_layer_norm_grad") {
        // A layer norm gradient reading dy in another dtype ends in `_dy<dtype>`.
        let (name, dd) = match name.rsplit_once("_dy") {
            Some((base, t)) => (base, Some(dtype_of(t))),
            None => (name, None),
        };
        let tags: Vec<&str> = name.rsplitn(3, '_').collect();
        let (d, dp) = (dtype_of(tags[1]), dtype_of(tags[0]));
        let dd = dd.unwrap_or(d);
        let param = |m: &mut Memory, b: Buf, i: i64| m.get(b, i, dp);
        if name.starts_with("norm_layer_norm_grad_params_split") {
            // Partial sums of chunks of the (row, repeat) pairs, per feature j at j * splits + s.
            let (dy, x, wm, wi, ps, pb) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), a[5]);
            let (rows, n, sn, splits) = (int(&a[6]), int(&a[7]), int(&a[8]), int(&a[9]));
            let per_row = n / sn;
            let total = rows * per_row;
            let chunk = (total + splits - 1) / splits;
            for s in 0..splits {
                for j in 0..sn {
                    let (mut u, mut v) = (0.0, 0.0);
                    for t in s * chunk..((s + 1) * chunk).min(total) {
                        let (row, at) = (t / per_row, t * sn + j);
                        let g = m.get(dy, at, dd);
                        u += g * (m.get(x, at, d) - m.get(wm, row, acc(d))) * m.get(wi, row, acc(d));
                        v += g;
                    }
                    m.set(ps, j * splits + s, acc(d), u);
                    if let Arg::Ptr(b) = pb {
                        m.set(b, j * splits + s, acc(d), v);
                    }
                }
            }
        } else if name.starts_with("norm_layer_norm_grad_params") {
            let (dy, x, wm, wi, ds) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]));
            let (db, rows, n, sn) = (a[5], int(&a[6]), int(&a[7]), int(&a[8]));
            let (mut s_sc, mut s_b) = (vec![0.0; sn as usize], vec![0.0; sn as usize]);
            for r in 0..rows {
                let (mean, inv) = (m.get(wm, r, acc(d)), m.get(wi, r, acc(d)));
                for j in 0..n {
                    let g = m.get(dy, r * n + j, dd);
                    s_sc[(j % sn) as usize] += g * (m.get(x, r * n + j, d) - mean) * inv;
                    s_b[(j % sn) as usize] += g;
                }
            }
            for j in 0..sn as usize {
                m.set(ds, j as i64, d, s_sc[j]);
                if let Arg::Ptr(b) = db {
                    m.set(b, j as i64, d, s_b[j]);
                }
            }
        } else if name.starts_with("norm_layer_norm_grad_") {
            let (dy, x, scale, dx, wm, wi) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), a[3], ptr(&a[4]), ptr(&a[5]));
            let (rows, n, sn, eps) = (int(&a[6]), int(&a[7]), int(&a[8]), f32_of(&a[9]));
            for r in 0..rows {
                let v: Vec<f64> = (0..n).map(|j| m.get(x, r * n + j, d)).collect();
                let mean = v.iter().sum::<f64>() / n as f64;
                let inv = 1.0 / (v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / n as f64 + eps).sqrt();
                m.set(wm, r, acc(d), mean);
                m.set(wi, r, acc(d), inv);
                let g: Vec<f64> = (0..n).map(|j| m.get(dy, r * n + j, dd) * param(m, scale, j % sn)).collect();
                let xh: Vec<f64> = v.iter().map(|e| (e - mean) * inv).collect();
                let (sg, sgx) = (g.iter().sum::<f64>(), g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>());
                if let Arg::Ptr(dx) = dx {
                    for j in 0..n as usize {
                        let out = inv / n as f64 * (n as f64 * g[j] - sg - xh[j] * sgx);
                        m.set(dx, r * n + j as i64, d, out);
                    }
                }
            }
        } else {
            // (n, c, inner) follow the pointers: 11 of them for training, 7 for inference and
            // the gradient.
            let c_at = if name.starts_with("norm_batch_norm_train_") { 12 } else { 8 };
            let (n, c, inner) = (int(&a[c_at - 1]), int(&a[c_at]), int(&a[c_at + 1]));
            let at = |b: i64, ch: i64, i: i64| (b * c + ch) * inner + i;
            for ch in 0..c {
                let idx: Vec<i64> = (0..n).flat_map(|b| (0..inner).map(move |i| at(b, ch, i))).collect();
                let cnt = idx.len() as f64;
                if name.starts_with("norm_batch_norm_infer_") {
                    let (x, sc, bi, mean, var, res, y) =
                        (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), a[5], ptr(&a[6]));
                    let (eps, relu) = (f32_of(&a[10]), int(&a[11]) != 0);
                    let kk = param(m, sc, ch) / (param(m, var, ch) + eps).sqrt();
                    let (mu, b) = (param(m, mean, ch), param(m, bi, ch));
                    for &e in &idx {
                        let v = (m.get(x, e, d) - mu) * kk + b;
                        let out = bn_res_out(m, v, res, e, d, relu);
                        m.set(y, e, d, out);
                    }
                    continue;
                }
                let x = ptr(&a[if name.starts_with("norm_batch_norm_grad_") { 2 } else { 0 }]);
                let v: Vec<f64> = idx.iter().map(|&e| m.get(x, e, d)).collect();
                let mean = v.iter().sum::<f64>() / cnt;
                let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / cnt;
                if name.starts_with("norm_batch_norm_train_") {
                    let (sc, bi, rm, rv, res, y, rmo, rvo) =
                        (ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), a[5], ptr(&a[6]), ptr(&a[7]), ptr(&a[8]));
                    let (eps, mom, relu) = (f32_of(&a[14]), f32_of(&a[15]), int(&a[16]) != 0);
                    let kk = param(m, sc, ch) / (var + eps).sqrt();
                    let b = param(m, bi, ch);
                    for (&e, &xv) in idx.iter().zip(&v) {
                        let out = bn_res_out(m, (xv - mean) * kk + b, res, e, d, relu);
                        m.set(y, e, d, out);
                    }
                    let (om, ov) = (param(m, rm, ch), param(m, rv, ch));
                    m.set(rmo, ch, dp, om * mom + mean * (1.0 - mom));
                    m.set(rvo, ch, dp, ov * mom + var * (1.0 - mom));
                } else {
                    let (dy, ry, sc, dx, ds, db) = (ptr(&a[0]), a[1], ptr(&a[3]), a[4], a[5], a[6]);
                    let eps = f32_of(&a[10]);
                    let sigma = (var + eps).sqrt();
                    let g: Vec<f64> = idx.iter().map(|&e| relu_grad_dy(m, dy, ry, e, d)).collect();
                    let xh: Vec<f64> = v.iter().map(|e| (e - mean) / sigma).collect();
                    let (dbias, dscale) = (g.iter().sum::<f64>(), g.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>());
                    let s = param(m, sc, ch);
                    if let Arg::Ptr(dx) = dx {
                        for (j, &e) in idx.iter().enumerate() {
                            m.set(dx, e, d, s / (sigma * cnt) * (cnt * g[j] - dbias - xh[j] * dscale));
                        }
                    }
                    if let Arg::Ptr(p) = ds {
                        m.set(p, ch, d, dscale);
                    }
                    if let Arg::Ptr(p) = db {
                        m.set(p, ch, d, dbias);
                    }
                }
            }
        }
    } else if name.starts_with("softmax_softmax_grad_") || name.starts_with("softmax_log_softmax_grad_") {
        // `_wide_<dy>_<y>`: dy and y in their own dtypes, dx in f32.
        let wide = name.strip_prefix("softmax_softmax_grad_wide_").map(|t| t.split_once('_').unwrap());
        let (dd, yd, d) = match wide {
            Some((a, b)) => (dtype_of(a), dtype_of(b), DType::F32),
            None => (dtype_of(tag), dtype_of(tag), dtype_of(tag)),
        };
        let log = name.starts_with("softmax_log_");
        let (dy, y, dx, outer, n, inner) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: i64| (o * n + j) * inner + i;
                let g: Vec<f64> = (0..n).map(|j| m.get(dy, at(j), dd)).collect();
                let yv: Vec<f64> = (0..n).map(|j| m.get(y, at(j), yd)).collect();
                let s: f64 = if log { g.iter().sum() } else { g.iter().zip(&yv).map(|(a, b)| a * b).sum() };
                for j in 0..n as usize {
                    let r = if log { g[j] - yv[j].exp() * s } else { yv[j] * (g[j] - s) };
                    m.set(dx, at(j as i64), d, r);
                }
            }
        }
    } else if name.starts_with("loss_") {
        run_loss(m, k);
    } else if name.starts_with("movement_pad_") {
        let size: usize = tag[1..].parse().unwrap();
        let (x, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]) as usize);
        let (od, id, xs, before) = (dims(&a[4]), dims(&a[5]), dims(&a[6]), dims(&a[7]));
        let (mode, Arg::U64(value)) = (int(&a[8]), a[9]) else { panic!("pad value") };
        for e in 0..n {
            let (mut lin, mut off, mut inside) = (e, 0i64, true);
            for d in (0..rank).rev() {
                let c = lin % od[d] - before[d];
                lin /= od[d];
                let len = id[d];
                let c = match mode {
                    0 => {
                        inside &= c >= 0 && c < len;
                        c
                    }
                    1 if len == 1 => 0,
                    1 => {
                        let period = 2 * (len - 1);
                        let r = c.rem_euclid(period);
                        if r < len {
                            r
                        } else {
                            period - r
                        }
                    }
                    2 => c.clamp(0, len - 1),
                    _ => c.rem_euclid(len),
                };
                off += c * xs[d];
            }
            let v = if inside { m.bytes(x, off, size) } else { value.to_le_bytes()[..size].to_vec() };
            m.put(y, e, &v);
        }
    } else if name.starts_with("elementwise_isnan_") {
        let d = dtype_of(tag);
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]));
        for i in 0..n {
            let v = m.get(x, i, d).is_nan() as u8 as f64;
            m.set(y, i, DType::U8, v);
        }
    } else if name.starts_with("elementwise_where_") {
        let size: usize = tag[1..].parse().unwrap();
        let (c, pa, pb, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), int(&a[4]), int(&a[5]) as usize);
        let (dd, sc, sa, sb) = (dims(&a[6]), dims(&a[7]), dims(&a[8]), dims(&a[9]));
        for i in 0..n {
            let o = if rank == 0 { vec![i, i, i] } else { offsets(i, rank, &dd, &[sc, sa, sb]) };
            let v = if m.get(c, o[0], DType::U8) != 0.0 { m.bytes(pa, o[1], size) } else { m.bytes(pb, o[2], size) };
            m.put(y, i, &v);
        }
    } else if name.starts_with("norm_instance_norm_") {
        let tags: Vec<&str> = name.rsplitn(3, '_').collect();
        let (d, dp) = (dtype_of(tags[1]), dtype_of(tags[0]));
        let (x, sc, bi, y) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]));
        let (n, c, inner, eps) = (int(&a[4]), int(&a[5]), int(&a[6]), f32_of(&a[7]));
        for plane in 0..n * c {
            let ch = plane % c;
            let v: Vec<f64> = (0..inner).map(|i| m.get(x, plane * inner + i, d)).collect();
            let mean = v.iter().sum::<f64>() / inner as f64;
            let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / inner as f64;
            let (s, b) = (m.get(sc, ch, dp), m.get(bi, ch, dp));
            for (i, e) in v.iter().enumerate() {
                m.set(y, plane * inner + i as i64, d, (e - mean) / (var + eps).sqrt() * s + b);
            }
        }
    } else if name == "elementwise_not_u8" {
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]));
        for i in 0..n {
            let v = (m.get(x, i, DType::U8) == 0.0) as u8 as f64;
            m.set(y, i, DType::U8, v);
        }
    } else if name.starts_with("elementwise_clip_") {
        let d = dtype_of(tag);
        let (x, y, n, lo, hi) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), a[3], a[4]);
        let lo = if let Arg::Ptr(b) = lo { m.get(b, 0, d) } else { -d.finite_max() };
        let hi = if let Arg::Ptr(b) = hi { m.get(b, 0, d) } else { d.finite_max() };
        for i in 0..n {
            let v = m.get(x, i, d);
            m.set(y, i, d, if v.is_nan() { v } else { v.max(lo).min(hi) });
        }
    } else if name.starts_with("gather_grad_direct_") {
        let parts: Vec<&str> = name.rsplitn(3, '_').collect();
        let (d, di) = (dtype_of(parts[1]), dtype_of(parts[0]));
        let (dy, idx, dx) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]));
        let (outer, len, count, inner) = (int(&a[3]), int(&a[4]), int(&a[5]), int(&a[6]));
        for o in 0..outer {
            for l in 0..len {
                for i in 0..inner {
                    let mut s = 0.0;
                    for j in 0..count {
                        let v = m.get(idx, j, di) as i64;
                        if (if v < 0 { v + len } else { v }) == l {
                            s += m.get(dy, (o * count + j) * inner + i, d);
                        }
                    }
                    m.set(dx, (o * len + l) * inner + i, d, s);
                }
            }
        }
    } else if name.starts_with("movement_resize_") {
        let d = dtype_of(tag);
        let (x, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]) as usize);
        let (od, xs, base) = (dims(&a[4]), dims(&a[5]), dims(&a[6]));
        let (first, idx, w) = (ptr(&a[7]), ptr(&a[8]), ptr(&a[9]));
        let Arg::F64(extrapolation) = a[10] else { panic!("{name}: the extrapolation value") };
        for e in 0..n {
            // Per axis, the output coordinate's taps: first[c] .. first[c + 1].
            let mut lin = e;
            let mut taps = vec![(0i64, 0i64); rank];
            for dd in (0..rank).rev() {
                let c = base[dd] + lin % od[dd];
                let start = m.get(first, c, DType::I64) as i64;
                taps[dd] = (start, m.get(first, c + 1, DType::I64) as i64 - start);
                lin /= od[dd];
            }
            let combos: i64 = taps.iter().map(|t| t.1).product();
            let mut acc = 0.0;
            for c in 0..combos {
                // Lexicographic, axis 0 most significant.
                let (mut rem, mut pick) = (c, vec![0i64; rank]);
                for dd in (0..rank).rev() {
                    pick[dd] = taps[dd].0 + rem % taps[dd].1;
                    rem /= taps[dd].1;
                }
                let (mut off, mut weight) = (0i64, 1.0f64);
                for (dd, &t) in pick.iter().enumerate() {
                    off += m.get(idx, t, DType::I64) as i64 * xs[dd];
                    weight *= m.get(w, t, DType::F64);
                }
                acc += m.get(x, off, d) * weight;
            }
            m.set(y, e, d, if combos == 0 { extrapolation } else { acc });
        }
    } else {
        panic!("{name} is not interpreted");
    }
}

/// erf(x) to about 1e-7 (Abramowitz and Stegun 7.1.26).
pub(crate) fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    (1.0 - p * (-x * x).exp()).copysign(x)
}

/// Batch normalisation in passes (kernels/norm.cu): per-(channel, split) statistics (count, mean,
/// sum of squared deviations, and the gradient's sums of dy and dy (x - mean)), merged pairwise
/// per channel by a thread each into the statistics and coefficients, and the element-wise
/// kernels that apply them. Elements moved 16 bytes at a time (`vec`) are the same elements, in
/// units that must not cross a plane or start off a 16-byte boundary.
pub(crate) fn run_bn_pass(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let name = k.name.as_str();
    let aligned = |b: Buf| match b {
        Buf::Tensor(_, o) | Buf::Work(o) | Buf::Aux(o) => o % 16 == 0,
        Buf::Flag => false,
    };
    let units = |d: DType, inner: i64, vec: &Arg, bufs: &[Buf]| -> i64 {
        if int(vec) == 0 {
            return 1;
        }
        let v = 16 / d.size() as i64;
        assert!(inner % v == 0 && bufs.iter().all(|&b| aligned(b)), "{name}: 16-byte units that do not fit");
        v
    };
    for (prefix, grad) in [("norm_bn_stats_", false), ("norm_bn_grad_stats_", true)] {
        let Some(tag) = name.strip_prefix(prefix) else { continue };
        let d = dtype_of(tag);
        let (dy, x) = if grad { (Some((ptr(&a[0]), a[1])), ptr(&a[2])) } else { (None, ptr(&a[0])) };
        let first = 1 + 2 * usize::from(grad);
        let parts: Vec<Buf> = (0..if grad { 5 } else { 3 }).map(|i| ptr(&a[first + i])).collect();
        let b = first + parts.len();
        let (n, c, inner, splits) = (int(&a[b]), int(&a[b + 1]), int(&a[b + 2]), int(&a[b + 3]));
        let mut bufs = vec![x];
        if let Some((dy, ry)) = dy {
            bufs.extend([dy].into_iter().chain(match ry {
                Arg::Ptr(r) => Some(r),
                _ => None,
            }));
        }
        let v = units(d, inner, &a[b + 4], &bufs);
        let count = n * inner / v;
        let chunk = (count + splits - 1) / splits;
        for ch in 0..c {
            for s in 0..splits {
                let at: Vec<i64> = (s * chunk..((s + 1) * chunk).min(count))
                    .flat_map(|u| u * v..(u + 1) * v)
                    .map(|e| ((e / inner) * c + ch) * inner + e % inner)
                    .collect();
                let xs: Vec<f64> = at.iter().map(|&i| m.get(x, i, d)).collect();
                let gs: Vec<f64> =
                    at.iter().map(|&i| dy.map_or(0.0, |(dy, ry)| relu_grad_dy(m, dy, ry, i, d))).collect();
                let cnt = xs.len() as f64;
                let mean = if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / cnt };
                let m2: f64 = xs.iter().map(|x| (x - mean) * (x - mean)).sum();
                let g: f64 = gs.iter().sum();
                let gd: f64 = xs.iter().zip(&gs).map(|(x, g)| g * (x - mean)).sum();
                for (part, value) in parts.iter().zip([cnt, mean, m2, g, gd]) {
                    m.set(*part, ch * splits + s, acc(d), value);
                }
            }
        }
        return;
    }
    // Channel ch's splits merged pairwise, in order: (count, mean, M2, sum dy, sum dy (x - mean)).
    let merged = |m: &mut Memory, d: DType, parts: &[Buf], ch: i64, splits: i64| {
        let mut all = [0.0f64; 5];
        for s in 0..splits {
            let mut p = [0.0f64; 5];
            for (v, b) in p.iter_mut().zip(parts) {
                *v = m.get(*b, ch * splits + s, acc(d));
            }
            if p[0] == 0.0 {
                continue;
            }
            if all[0] == 0.0 {
                all = p;
                continue;
            }
            let n = all[0] + p[0];
            let delta = p[1] - all[1];
            let mean = all[1] + delta * p[0] / n;
            let gd = all[4] + p[4] + (all[1] - mean) * all[3] + (p[1] - mean) * p[3];
            all = [n, mean, all[2] + p[2] + delta * delta * all[0] * p[0] / n, all[3] + p[3], gd];
        }
        all
    };
    if let Some(tag) = name.strip_prefix("norm_bn_grad_apply_") {
        let d = dtype_of(tag);
        let ry = a[1];
        let [dy, x, mean, alpha, beta, gamma, dx] = [0, 2, 3, 4, 5, 6, 7].map(|i| ptr(&a[i]));
        let (n, c, inner) = (int(&a[8]), int(&a[9]), int(&a[10]));
        let mut bufs = vec![dy, x, dx];
        bufs.extend(match ry {
            Arg::Ptr(r) => Some(r),
            _ => None,
        });
        units(d, inner, &a[11], &bufs);
        for i in 0..n * c * inner {
            let ch = (i / inner) % c;
            let [mu, al, be, ga] = [mean, alpha, beta, gamma].map(|b| m.get(b, ch, acc(d)));
            let out = al * relu_grad_dy(m, dy, ry, i, d) + be * (m.get(x, i, d) - mu) + ga;
            m.set(dx, i, d, out);
        }
        return;
    }
    let tags: Vec<&str> = name.rsplitn(3, '_').collect();
    let (d, dp) = (dtype_of(tags[1]), dtype_of(tags[0]));
    if name.starts_with("norm_bn_finish_") {
        let parts = [ptr(&a[0]), ptr(&a[1]), ptr(&a[2])];
        let [sc, rm, rv, mean, kk, rmo, rvo] = [3, 4, 5, 6, 7, 8, 9].map(|i| ptr(&a[i]));
        let (c, splits, eps, mom) = (int(&a[10]), int(&a[11]), f32_of(&a[12]), f32_of(&a[13]));
        for ch in 0..c {
            let s = merged(m, d, &parts, ch, splits);
            let (mu, var) = (s[1], s[2] / s[0]);
            m.set(mean, ch, acc(d), mu);
            let k = m.get(sc, ch, dp) / (var + eps).sqrt();
            m.set(kk, ch, acc(d), k);
            let (om, ov) = (m.get(rm, ch, dp), m.get(rv, ch, dp));
            m.set(rmo, ch, dp, om * mom + mu * (1.0 - mom));
            m.set(rvo, ch, dp, ov * mom + var * (1.0 - mom));
        }
    } else if name.starts_with("norm_bn_apply_") {
        let res = a[4];
        let [x, mean, kk, bi, y] = [0, 1, 2, 3, 5].map(|i| ptr(&a[i]));
        let (n, c, inner) = (int(&a[6]), int(&a[7]), int(&a[8]));
        let mut bufs = vec![x, y];
        bufs.extend(match res {
            Arg::Ptr(r) => Some(r),
            _ => None,
        });
        units(d, inner, &a[9], &bufs);
        let relu = int(&a[10]) != 0;
        for i in 0..n * c * inner {
            let ch = (i / inner) % c;
            let out = (m.get(x, i, d) - m.get(mean, ch, acc(d))) * m.get(kk, ch, acc(d)) + m.get(bi, ch, dp);
            let out = bn_res_out(m, out, res, i, d, relu);
            m.set(y, i, d, out);
        }
    } else {
        // norm_bn_grad_finish_<T>_<P>
        let parts = [0, 1, 2, 3, 4].map(|i| ptr(&a[i]));
        let [sc, mean, alpha, beta, gamma] = [5, 6, 7, 8, 9].map(|i| ptr(&a[i]));
        let (ds, db) = (a[10], a[11]);
        let (c, splits, eps) = (int(&a[12]), int(&a[13]), f32_of(&a[14]));
        for ch in 0..c {
            let [cnt, mu, m2, g, gd] = merged(m, d, &parts, ch, splits);
            let inv = 1.0 / (m2 / cnt + eps).sqrt();
            let al = m.get(sc, ch, dp) * inv;
            m.set(mean, ch, acc(d), mu);
            m.set(alpha, ch, acc(d), al);
            m.set(beta, ch, acc(d), -al * inv * inv * gd / cnt);
            m.set(gamma, ch, acc(d), -al * g / cnt);
            if let Arg::Ptr(ds) = ds {
                m.set(ds, ch, d, gd * inv);
            }
            if let Arg::Ptr(db) = db {
                m.set(db, ch, d, g);
            }
        }
    }
}

/// The accumulator dtype of the norm and loss kernels for data of dtype `d` (`AccT` in
/// kernels/common.cuh).
pub(crate) fn acc(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// The loss kernels of loss.cu: positions (b, i), classes at ((b c + k) inner + i).
pub(crate) fn run_loss(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let name = k.name.as_str();
    let parts: Vec<&str> = name.rsplitn(3, '_').collect();
    let label = |m: &mut Memory, b: Buf, di: DType, p: i64| m.get(b, p, di) as i64;
    if name.starts_with("loss_reduce_") {
        let d = dtype_of(parts[0]);
        let (wl, ww, out, positions, red) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]));
        let s: f64 = (0..positions).map(|p| m.get(wl, p, acc(d))).sum();
        let w: f64 = (0..positions).map(|p| m.get(ww, p, acc(d))).sum();
        m.set(out, 0, d, if red == 2 { s / w } else { s });
        return;
    }
    let (d, di) = (dtype_of(parts[1]), dtype_of(parts[0]));
    if name.starts_with("loss_weight_total_") {
        let (labels, weights, total, positions, c) = (ptr(&a[0]), a[1], ptr(&a[2]), int(&a[3]), int(&a[4]));
        let (has_ignore, ignore) = (int(&a[5]) != 0, int(&a[6]));
        let mut t = 0.0;
        for p in 0..positions {
            let l = label(m, labels, di, p);
            if (has_ignore && l == ignore) || l < 0 || l >= c {
                continue;
            }
            t += if let Arg::Ptr(w) = weights { m.get(w, l, d) } else { 1.0 };
        }
        m.set(total, 0, acc(d), t);
        return;
    }
    let grad = name.contains("_grad_");
    let softmax = name.starts_with("loss_softmax_ce");
    // The wide kernels of f16/bf16 scores: weights, log-probabilities and losses (forward),
    // dloss and weights (gradient) in f32.
    let dw = if name.contains("_wide_") { DType::F32 } else { d };
    let base = grad as usize;
    let (scores, labels, weights) = (ptr(&a[base]), ptr(&a[base + 1]), a[base + 2]);
    let at_dims = if grad {
        6
    } else if softmax {
        7
    } else {
        6
    };
    let (n, c, inner) = (int(&a[at_dims]), int(&a[at_dims + 1]), int(&a[at_dims + 2]));
    let (has_ignore, ignore) = (int(&a[at_dims + 3]) != 0, int(&a[at_dims + 4]));
    let at = |b: i64, kk: i64, i: i64| (b * c + kk) * inner + i;
    for b in 0..n {
        for i in 0..inner {
            let p = b * inner + i;
            let l = label(m, labels, di, p);
            let ignored = (has_ignore && l == ignore) || l < 0 || l >= c;
            let w = if ignored {
                0.0
            } else if let Arg::Ptr(wb) = weights {
                m.get(wb, l, dw)
            } else {
                1.0
            };
            let x: Vec<f64> = (0..c).map(|kk| m.get(scores, at(b, kk, i), d)).collect();
            let log_prob: Vec<f64> = if softmax {
                let mx = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = x.iter().map(|v| (v - mx).exp()).sum();
                x.iter().map(|v| v - mx - s.ln()).collect()
            } else {
                x.clone()
            };
            if !grad {
                let loss = if ignored { 0.0 } else { -log_prob[l as usize] * w };
                let (lp, wl, ww, none) = if softmax { (a[3], a[4], a[5], a[6]) } else { (Arg::Null, a[3], a[4], a[5]) };
                if let Arg::Ptr(lpb) = lp {
                    for kk in 0..c {
                        m.set(lpb, at(b, kk, i), dw, log_prob[kk as usize]);
                    }
                }
                if let Arg::Ptr(q) = wl {
                    m.set(q, p, acc(d), loss);
                }
                if let Arg::Ptr(q) = ww {
                    m.set(q, p, acc(d), w);
                }
                if let Arg::Ptr(q) = none {
                    m.set(q, p, dw, loss);
                }
                continue;
            }
            let (dloss, total, out, red) = (ptr(&a[0]), a[4], ptr(&a[5]), int(&a[at_dims + 5]));
            let g = match red {
                0 => m.get(dloss, p, dw),
                1 => m.get(dloss, 0, dw),
                _ => m.get(dloss, 0, dw) / m.get(ptr(&total), 0, acc(d)),
            };
            for kk in 0..c {
                let r = if ignored {
                    0.0
                } else if softmax {
                    g * w * (log_prob[kk as usize].exp() - (kk == l) as i64 as f64)
                } else if kk == l {
                    -g * w
                } else {
                    0.0
                };
                m.set(out, at(b, kk, i), d, r);
            }
        }
    }
}

/// dy[i] as a batch norm's gradient reads it: through the ReLU's gradient where the ReLU's output
/// `ry` is given (dy where it is positive, 0 elsewhere), as the unfused ReluGrad wrote it.
fn relu_grad_dy(m: &mut Memory, dy: Buf, ry: Arg, i: i64, d: DType) -> f64 {
    match ry {
        Arg::Ptr(r) if m.get(r, i, d) <= 0.0 || m.get(r, i, d).is_nan() => 0.0,
        _ => m.get(dy, i, d),
    }
}
