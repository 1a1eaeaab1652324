//! The CUDA plans' index arithmetic, checked on the CPU: a small interpreter executes the calls of
//! a plan (device copies and fills, cuBLAS GEMMs in their column-major terms, and the kernels
//! whose meaning is plain data movement or summation: `movement_copy`, `movement_fill`,
//! `elementwise_add`, `im2col`, `col2im`, `channel_sum`, as their headers in `kernels/` define
//! them) over copies of a program's regions, and every launch it can interpret is compared with
//! the CPU device's result at the same point of the same program. That covers what is easiest to
//! get wrong in a plan and hardest to see on a GPU: GEMM transposes, leading dims and batch
//! strides (MatMul with broadcasting, Gemm, Conv, ConvGrad, ConvTranspose), the im2col/col2im
//! layouts, and the strided copies of Transpose, Slice, Concat, Split, Expand and Pad.

#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_ir::DType;
use mpc_runtime::cpu::run_op;
use mpc_runtime::cuda::plan::{plan, Arg, Buf, Call, DnnConv, DnnOp, Gemm, Kernel, LaunchPlan, Window3};
use mpc_runtime::device::{CpuDevice, Device, Regions};
use mpc_runtime::program::{Program, Region, TensorRef};
use mpc_runtime::{HostTensor, Tolerance};

/// The bytes a plan runs over: the program's three regions, the workspace and the aux bytes.
#[derive(Clone)]
struct Memory {
    arena: Vec<u8>,
    state: Vec<u8>,
    constants: Vec<u8>,
    work: Vec<u8>,
    aux: Vec<u8>,
    flag: Vec<u8>,
    /// The buffers whose addresses the aux bytes hold, by aux offset.
    addresses: HashMap<u64, Buf>,
}

impl Memory {
    fn at(&mut self, b: Buf) -> (&mut Vec<u8>, usize) {
        match b {
            Buf::Tensor(Region::Arena, o) => (&mut self.arena, o as usize),
            Buf::Tensor(Region::State, o) => (&mut self.state, o as usize),
            Buf::Tensor(Region::Constants, o) => (&mut self.constants, o as usize),
            Buf::Work(o) => (&mut self.work, o as usize),
            Buf::Aux(o) => (&mut self.aux, o as usize),
            Buf::Flag => (&mut self.flag, 0),
        }
    }

    fn bytes(&mut self, b: Buf, elem: i64, size: usize) -> Vec<u8> {
        let (v, o) = self.at(b);
        let s = (o as i64 + elem * size as i64) as usize;
        v[s..s + size].to_vec()
    }

    fn put(&mut self, b: Buf, elem: i64, bytes: &[u8]) {
        let (v, o) = self.at(b);
        let s = (o as i64 + elem * bytes.len() as i64) as usize;
        v[s..s + bytes.len()].copy_from_slice(bytes);
    }

    fn get(&mut self, b: Buf, elem: i64, d: DType) -> f64 {
        HostTensor::from_le_bytes(d, vec![1], &self.bytes(b, elem, d.size())).f64s()[0]
    }

    fn set(&mut self, b: Buf, elem: i64, d: DType, v: f64) {
        let t = HostTensor::from_f64(d, vec![1], vec![v]);
        let mut bytes = vec![0u8; d.size()];
        t.write_le_bytes(&mut bytes);
        self.put(b, elem, &bytes);
    }
}

fn ptr(a: &Arg) -> Buf {
    match a {
        Arg::Ptr(b) => *b,
        a => panic!("{a:?} where a pointer was expected"),
    }
}

fn int(a: &Arg) -> i64 {
    match *a {
        Arg::I64(v) => v,
        Arg::I32(v) => v as i64,
        ref a => panic!("{a:?} where an integer was expected"),
    }
}

fn dims(a: &Arg) -> [i64; 8] {
    match a {
        Arg::Dims(d) => *d,
        a => panic!("{a:?} where Dims8 was expected"),
    }
}

fn window(a: &Arg) -> Window3 {
    match a {
        Arg::Window(w) => *w,
        a => panic!("{a:?} where Window3 was expected"),
    }
}

fn dtype_of(tag: &str) -> DType {
    tag.parse().unwrap_or_else(|e| panic!("dtype tag {tag}: {e}"))
}

/// The coordinates of row-major index `lin` over `dims[..rank]`, dotted with each stride list.
fn offsets(mut lin: i64, rank: usize, d: &[i64; 8], strides: &[[i64; 8]]) -> Vec<i64> {
    let mut out = vec![0i64; strides.len()];
    for k in (0..rank).rev() {
        let c = lin % d[k];
        lin /= d[k];
        for (o, s) in out.iter_mut().zip(strides) {
            *o += c * s[k];
        }
    }
    out
}

/// `(kind, finish)` of the two-pass reduction kernels this file interprets: `reduce_<kind>_cols_split_<T>`
/// (false) and `reduce_<kind>_finish_<T>` (true).
fn split_reduce(name: &str) -> Option<(&str, bool)> {
    let rest = name.strip_prefix("reduce_")?;
    let (kind, finish) = match (rest.split_once("_cols_split_"), rest.split_once("_finish_")) {
        (Some((k, _)), _) => (k, false),
        (_, Some((k, _))) => (k, true),
        _ => return None,
    };
    ["sum", "mean", "max", "min", "prod", "sum_square", "l1", "l2"].contains(&kind).then_some((kind, finish))
}

/// The kernels whose meaning this file interprets.
fn call_interpretable(c: &Call) -> bool {
    match c {
        Call::Kernel(k) => interpretable(k),
        Call::Conv(conv) => conv.fallback.iter().all(call_interpretable),
        _ => true,
    }
}

fn interpretable(k: &Kernel) -> bool {
    let reduce = ["sum", "mean", "max", "min", "prod", "sum_square", "l1", "l2", "log_sum_exp", "argmax", "argmin"]
        .iter()
        .any(|r| k.name.starts_with(&format!("reduce_{r}_rows_")) || k.name.starts_with(&format!("reduce_{r}_cols_")))
        || split_reduce(&k.name).is_some();
    let unary = UNARY.contains(&elementwise_op(&k.name)) && k.args.len() == 5;
    let binary = BINARY.contains(&elementwise_op(&k.name)) && k.args.len() == 8;
    reduce
        || unary
        || binary
        || [
            "movement_copy_",
            "movement_fill_",
            "im2col_im2col_",
            "im2col_col2im_",
            "im2col_channel_sum_",
            "casts_",
            "softmax_softmax_",
            "softmax_log_softmax_",
            "norm_layer_norm_",
            "gather_axis_",
            "gather_elements_",
            "gather_nd_",
            "gather_scatter_nd_",
            "gather_scatter_elements_",
        ]
        .iter()
        .any(|p| k.name.starts_with(p) && !k.name.contains("_grad"))
        || MORE.iter().any(|p| k.name.starts_with(p))
}

/// `op` of a kernel named `elementwise_<op>_<tag>` ("" for another family).
fn elementwise_op(name: &str) -> &str {
    match (name.strip_prefix("elementwise_"), name.rsplit_once('_')) {
        (Some(rest), Some((_, tag))) => &rest[..rest.len() - tag.len() - 1],
        _ => "",
    }
}

/// Pooling, batch and layer normalisation gradients, softmax gradients, losses and optimizer
/// kernels ([`run_more`]).
const MORE: [&str; 30] = [
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
    "train_unscale_",
];

/// The parameter and gradient dtypes of an update kernel, `train_<op>_<param>_<grad>`.
fn update_dtypes(name: &str) -> (DType, DType) {
    let parts: Vec<&str> = name.rsplitn(3, '_').collect();
    (dtype_of(parts[1]), dtype_of(parts[0]))
}

/// An update's `inv_scale` argument: the f32 it points at, or 1.
fn unscale_of(m: &mut Memory, a: &Arg) -> f64 {
    match *a {
        Arg::Ptr(b) => m.get(b, 0, DType::F32),
        _ => 1.0,
    }
}

fn f32_of(a: &Arg) -> f64 {
    match *a {
        Arg::F32(v) => v as f64,
        ref a => panic!("{a:?} where an f32 was expected"),
    }
}

/// The input offsets (within one plane) of output `o`'s window taps, in kernel order; `None`
/// for a tap outside the input.
fn taps(w: &Window3, o: i64) -> Vec<Option<i64>> {
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
fn avg_divisor(w: &Window3, o: i64, cip: bool) -> f64 {
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

fn run_more(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let name = k.name.as_str();
    let tag = name.rsplit('_').next().unwrap();
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
                    m.set(arg, pl * ovol + o, DType::I64, at as f64);
                }
            }
        } else if name.starts_with("pool_max_grad_") {
            let (dy, arg, dx, planes) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
            for pl in 0..planes {
                let mut acc = vec![0.0; ivol as usize];
                for o in 0..ovol {
                    let at = m.get(arg, pl * ovol + o, DType::I64) as i64;
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
                        // The first strict maximum, NaNs skipped; its flat index into x.
                        let (mut best, mut at) = (f64::NEG_INFINITY, 0i64);
                        for off in taps(&w, o).into_iter().flatten() {
                            let v = m.get(x, pl * ivol + off, d);
                            if v > best {
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
                                (best, at) = (v, pl * ivol + sp);
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
        let tags: Vec<&str> = name.rsplitn(3, '_').collect();
        let (d, dp) = (dtype_of(tags[1]), dtype_of(tags[0]));
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
                        let g = m.get(dy, at, d);
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
                    let g = m.get(dy, r * n + j, d);
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
                let g: Vec<f64> = (0..n).map(|j| m.get(dy, r * n + j, d) * param(m, scale, j % sn)).collect();
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
            // (n, c, inner) follow the pointers: 10 of them for training, 6 for inference and the
            // gradient.
            let c_at = if name.starts_with("norm_batch_norm_train_") { 11 } else { 7 };
            let (n, c, inner) = (int(&a[c_at - 1]), int(&a[c_at]), int(&a[c_at + 1]));
            let at = |b: i64, ch: i64, i: i64| (b * c + ch) * inner + i;
            for ch in 0..c {
                let idx: Vec<i64> = (0..n).flat_map(|b| (0..inner).map(move |i| at(b, ch, i))).collect();
                let cnt = idx.len() as f64;
                if name.starts_with("norm_batch_norm_infer_") {
                    let (x, sc, bi, mean, var, y) =
                        (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), ptr(&a[5]));
                    let eps = f32_of(&a[9]);
                    let kk = param(m, sc, ch) / (param(m, var, ch) + eps).sqrt();
                    let (mu, b) = (param(m, mean, ch), param(m, bi, ch));
                    for &e in &idx {
                        let v = (m.get(x, e, d) - mu) * kk + b;
                        m.set(y, e, d, v);
                    }
                    continue;
                }
                let x = ptr(&a[if name.starts_with("norm_batch_norm_grad_") { 1 } else { 0 }]);
                let v: Vec<f64> = idx.iter().map(|&e| m.get(x, e, d)).collect();
                let mean = v.iter().sum::<f64>() / cnt;
                let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / cnt;
                if name.starts_with("norm_batch_norm_train_") {
                    let (sc, bi, rm, rv, y, rmo, rvo) =
                        (ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), ptr(&a[5]), ptr(&a[6]), ptr(&a[7]));
                    let (eps, mom) = (f32_of(&a[13]), f32_of(&a[14]));
                    let kk = param(m, sc, ch) / (var + eps).sqrt();
                    let b = param(m, bi, ch);
                    for (&e, &xv) in idx.iter().zip(&v) {
                        m.set(y, e, d, (xv - mean) * kk + b);
                    }
                    let (om, ov) = (param(m, rm, ch), param(m, rv, ch));
                    m.set(rmo, ch, dp, om * mom + mean * (1.0 - mom));
                    m.set(rvo, ch, dp, ov * mom + var * (1.0 - mom));
                } else {
                    let (dy, sc, dx, ds, db) = (ptr(&a[0]), ptr(&a[2]), a[3], a[4], a[5]);
                    let eps = f32_of(&a[9]);
                    let sigma = (var + eps).sqrt();
                    let g: Vec<f64> = idx.iter().map(|&e| m.get(dy, e, d)).collect();
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
        let d = dtype_of(tag);
        let log = name.starts_with("softmax_log_");
        let (dy, y, dx, outer, n, inner) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: i64| (o * n + j) * inner + i;
                let g: Vec<f64> = (0..n).map(|j| m.get(dy, at(j), d)).collect();
                let yv: Vec<f64> = (0..n).map(|j| m.get(y, at(j), d)).collect();
                let s: f64 = if log { g.iter().sum() } else { g.iter().zip(&yv).map(|(a, b)| a * b).sum() };
                for j in 0..n as usize {
                    let r = if log { g[j] - yv[j].exp() * s } else { yv[j] * (g[j] - s) };
                    m.set(dx, at(j as i64), d, r);
                }
            }
        }
    } else if name.starts_with("loss_") {
        run_loss(m, k);
    } else if name.starts_with("train_relu_grad_") {
        let d = dtype_of(tag);
        let (dy, y, dx, n) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
        for i in 0..n {
            let r = if m.get(y, i, d) > 0.0 { m.get(dy, i, d) } else { 0.0 };
            m.set(dx, i, d, r);
        }
    } else if name == "train_all_finite_multi" {
        let Buf::Aux(at) = ptr(&a[0]) else { panic!("the address array is not in aux") };
        let (sizes, codes, count, f) = (ptr(&a[1]), ptr(&a[2]), int(&a[3]), ptr(&a[4]));
        for t in 0..count {
            let x = m.addresses[&(at + 8 * t as u64)];
            let n = m.get(sizes, t, DType::I64) as i64;
            let d = match m.get(codes, t, DType::I32) as i64 {
                0 => DType::F32,
                1 => DType::F16,
                2 => DType::BF16,
                _ => DType::F64,
            };
            if (0..n).any(|i| !m.get(x, i, d).is_finite()) {
                m.set(f, 0, DType::U8, 0.0);
            }
        }
    } else if name == "train_all_finite_init" {
        m.set(ptr(&a[0]), 0, DType::U8, 1.0);
    } else if name.starts_with("train_all_finite_") {
        let d = dtype_of(tag);
        let (x, n, f) = (ptr(&a[0]), int(&a[1]), ptr(&a[2]));
        if (0..n).any(|i| !m.get(x, i, d).is_finite()) {
            m.set(f, 0, DType::U8, 0.0);
        }
    } else if name.starts_with("train_unscale_") {
        let d = dtype_of(tag);
        let (g, scale, out, n) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
        let inv = 1.0 / m.get(scale, 0, DType::F32);
        for i in 0..n {
            let v = m.get(g, i, d) * inv;
            m.set(out, i, d, v);
        }
    } else if name.starts_with("train_sgd_") {
        // train_sgd_<param>_<grad>(param, grad, inv_scale, finite, velocity, param', velocity', ...)
        let (d, dg) = update_dtypes(name);
        let (param, grad, finite, vel, po, vo) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[3]), a[4], ptr(&a[5]), a[6]);
        let inv = unscale_of(m, &a[2]);
        let (n, lr, mom, wd, nesterov) = (int(&a[7]), f32_of(&a[8]), f32_of(&a[9]), f32_of(&a[10]), int(&a[11]) != 0);
        let ok = m.get(finite, 0, DType::U8) != 0.0;
        for i in 0..n {
            let p = m.get(param, i, d);
            if !ok {
                m.set(po, i, d, p);
                continue;
            }
            let dd = m.get(grad, i, dg) * inv + wd * p;
            let step = match (vel, vo) {
                (Arg::Ptr(v), Arg::Ptr(vout)) => {
                    let nv = mom * m.get(v, i, d) + dd;
                    m.set(vout, i, d, nv);
                    if nesterov {
                        dd + mom * nv
                    } else {
                        nv
                    }
                }
                _ => dd,
            };
            m.set(po, i, d, p - lr * step);
        }
    } else if name.starts_with("train_adam_") {
        // train_adam_<param>_<grad>(param, grad, inv_scale, m, v, step, finite, param', m', v', ...)
        let (d, dg) = update_dtypes(name);
        let (param, grad, mm, vv, step, finite) =
            (ptr(&a[0]), ptr(&a[1]), ptr(&a[3]), ptr(&a[4]), ptr(&a[5]), ptr(&a[6]));
        let inv = unscale_of(m, &a[2]);
        let (po, mo, vo, n) = (ptr(&a[7]), ptr(&a[8]), ptr(&a[9]), int(&a[10]));
        let (lr, b1, b2, eps, wd, decoupled) =
            (f32_of(&a[11]), f32_of(&a[12]), f32_of(&a[13]), f32_of(&a[14]), f32_of(&a[15]), int(&a[16]) != 0);
        let ok = m.get(finite, 0, DType::U8) != 0.0;
        let t = m.get(step, 0, DType::I64).max(1.0);
        for i in 0..n {
            let (mut p, g, m0, v0) = (m.get(param, i, d), m.get(grad, i, dg) * inv, m.get(mm, i, d), m.get(vv, i, d));
            if !ok {
                m.set(po, i, d, p);
                m.set(mo, i, d, m0);
                m.set(vo, i, d, v0);
                continue;
            }
            let dd = if decoupled {
                p -= lr * wd * p;
                g
            } else {
                g + wd * p
            };
            let (m1, v1) = (b1 * m0 + (1.0 - b1) * dd, b2 * v0 + (1.0 - b2) * dd * dd);
            let r = p - lr * (m1 / (1.0 - b1.powf(t))) / ((v1 / (1.0 - b2.powf(t))).sqrt() + eps);
            m.set(po, i, d, r);
            m.set(mo, i, d, m1);
            m.set(vo, i, d, v1);
        }
    } else if ["and", "or", "equal", "less", "greater"].iter().any(|c| name.starts_with(&format!("elementwise_{c}_"))) {
        let op = &name["elementwise_".len()..name.len() - tag.len() - 1];
        let d = if op == "and" || op == "or" { DType::U8 } else { dtype_of(tag) };
        let (pa, pb, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]) as usize);
        let (dd, sa, sb) = (dims(&a[5]), dims(&a[6]), dims(&a[7]));
        for i in 0..n {
            let o = if rank == 0 { vec![i, i] } else { offsets(i, rank, &dd, &[sa, sb]) };
            let (x, z) = (m.get(pa, o[0], d), m.get(pb, o[1], d));
            let r = match op {
                "and" => x != 0.0 && z != 0.0,
                "or" => x != 0.0 || z != 0.0,
                "equal" => x == z,
                "less" => x < z,
                "greater" => x > z,
                "less_equal" => x <= z,
                _ => x >= z,
            };
            m.set(y, i, DType::U8, r as u8 as f64);
        }
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
        let lo = if let Arg::Ptr(b) = lo { m.get(b, 0, d) } else { f64::NEG_INFINITY };
        let hi = if let Arg::Ptr(b) = hi { m.get(b, 0, d) } else { f64::INFINITY };
        for i in 0..n {
            let v = m.get(x, i, d).max(lo).min(hi);
            m.set(y, i, d, v);
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
        let (count, idx, w) = (ptr(&a[7]), ptr(&a[8]), ptr(&a[9]));
        for e in 0..n {
            let mut lin = e;
            let mut coord = [0i64; 8];
            for dd in (0..rank).rev() {
                coord[dd] = base[dd] + lin % od[dd];
                lin /= od[dd];
            }
            let mut acc = 0.0;
            for c in 0..(1i64 << rank) {
                let (mut off, mut weight, mut take) = (0i64, 1.0f64, true);
                for (dd, &at) in coord.iter().enumerate().take(rank) {
                    let t = (c >> (rank - 1 - dd)) & 1;
                    if t >= m.get(count, at, DType::I64) as i64 {
                        take = false;
                    } else {
                        off += m.get(idx, 2 * at + t, DType::I64) as i64 * xs[dd];
                        weight *= m.get(w, 2 * at + t, DType::F64);
                    }
                }
                if take {
                    acc += m.get(x, off, d) * weight;
                }
            }
            m.set(y, e, d, acc);
        }
    } else if name.starts_with("train_gelu_grad_") {
        let d = dtype_of(tag);
        let (dy, x, dx, n, tanh) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]) != 0);
        let c = (2.0 / std::f64::consts::PI).sqrt();
        for i in 0..n {
            let v = m.get(x, i, d);
            let g = if tanh {
                let t = (c * (v + 0.044715 * v * v * v)).tanh();
                0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v)
            } else {
                0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2))
                    + v * (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt()
            };
            let r = m.get(dy, i, d) * g;
            m.set(dx, i, d, r);
        }
    } else if name.starts_with("train_seeded_dropout_") {
        let d = dtype_of(tag);
        let (x, key, ratio_ptr, y, mask, n) = (ptr(&a[0]), ptr(&a[1]), a[2], ptr(&a[3]), a[4], int(&a[5]));
        let (seed, Arg::F64(ratio)) = (int(&a[6]), a[7]) else { panic!("ratio") };
        let ratio = if let Arg::Ptr(r) = ratio_ptr { m.get(r, 0, DType::F64) } else { ratio };
        let mix = |mut z: u64| {
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        };
        let base = mix(m.get(key, 0, DType::I64) as i64 as u64 ^ mix(seed as u64));
        for i in 0..n {
            let z = mix(base.wrapping_add((i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
            let keep = (z >> 40) as f64 / (1u64 << 24) as f64 >= ratio;
            let v = if keep { m.get(x, i, d) * (1.0 / (1.0 - ratio)) } else { 0.0 };
            m.set(y, i, d, v);
            if let Arg::Ptr(mb) = mask {
                m.set(mb, i, DType::U8, keep as u8 as f64);
            }
        }
    } else if name == "train_loss_scale_update" {
        let (scale, good, finite, so, go) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]));
        let (growth, backoff, interval, lo, hi) =
            (f32_of(&a[5]), f32_of(&a[6]), int(&a[7]), f32_of(&a[8]), f32_of(&a[9]));
        let (s, g) = (m.get(scale, 0, DType::F32), m.get(good, 0, DType::I64) as i64);
        let (s1, g1) = if m.get(finite, 0, DType::U8) != 0.0 {
            if g + 1 >= interval {
                ((s * growth).min(hi), 0)
            } else {
                (s, g + 1)
            }
        } else {
            ((s * backoff).max(lo), 0)
        };
        m.set(so, 0, DType::F32, s1);
        m.set(go, 0, DType::I64, g1 as f64);
    } else {
        panic!("{name} is not interpreted");
    }
}

/// erf(x) to about 1e-7 (Abramowitz and Stegun 7.1.26).
fn erf(x: f64) -> f64 {
    let t = 1.0 / (1.0 + 0.3275911 * x.abs());
    let p = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    (1.0 - p * (-x * x).exp()).copysign(x)
}

/// The loss kernels of loss.cu: positions (b, i), classes at ((b c + k) inner + i).
/// Batch normalisation in passes (kernels/norm.cu): per-(channel, split) partial sums, and the
/// element-wise kernels that apply the finished statistics.
fn run_bn_pass(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let name = k.name.as_str();
    let partial = ["norm_bn_sum_", "norm_bn_sqdev_", "norm_bn_grad_sums_"].iter().find(|p| name.starts_with(*p));
    if let Some(prefix) = partial {
        let d = dtype_of(&name[prefix.len()..]);
        let base = match *prefix {
            "norm_bn_sum_" => 2,
            "norm_bn_sqdev_" => 3,
            _ => 5,
        };
        let (n, c, inner, splits) = (int(&a[base]), int(&a[base + 1]), int(&a[base + 2]), int(&a[base + 3]));
        let count = n * inner;
        let chunk = (count + splits - 1) / splits;
        for ch in 0..c {
            for s in 0..splits {
                let (mut u, mut v) = (0.0, 0.0);
                for e in s * chunk..((s + 1) * chunk).min(count) {
                    let at = ((e / inner) * c + ch) * inner + e % inner;
                    match *prefix {
                        "norm_bn_sum_" => u += m.get(ptr(&a[0]), at, d),
                        "norm_bn_sqdev_" => {
                            let dev = m.get(ptr(&a[0]), at, d) - m.get(ptr(&a[1]), ch, acc(d));
                            u += dev * dev;
                        }
                        _ => {
                            let g = m.get(ptr(&a[0]), at, d);
                            u += g;
                            v += g * (m.get(ptr(&a[1]), at, d) - m.get(ptr(&a[2]), ch, acc(d)));
                        }
                    }
                }
                match *prefix {
                    "norm_bn_sum_" => m.set(ptr(&a[1]), ch * splits + s, acc(d), u),
                    "norm_bn_sqdev_" => m.set(ptr(&a[2]), ch * splits + s, acc(d), u),
                    _ => {
                        m.set(ptr(&a[3]), ch * splits + s, acc(d), u);
                        m.set(ptr(&a[4]), ch * splits + s, acc(d), v);
                    }
                }
            }
        }
        return;
    }
    let tags: Vec<&str> = name.rsplitn(3, '_').collect();
    let (d, dp) = (dtype_of(tags[1]), dtype_of(tags[0]));
    if name.starts_with("norm_bn_apply_") {
        let (x, sc, bi, mean, var, y, rm, rv, rmo, rvo) = (
            ptr(&a[0]),
            ptr(&a[1]),
            ptr(&a[2]),
            ptr(&a[3]),
            ptr(&a[4]),
            ptr(&a[5]),
            ptr(&a[6]),
            ptr(&a[7]),
            a[8],
            a[9],
        );
        let (n, c, inner, eps, mom) = (int(&a[10]), int(&a[11]), int(&a[12]), f32_of(&a[13]), f32_of(&a[14]));
        for i in 0..n * c * inner {
            let ch = (i / inner) % c;
            let (mu, var_) = (m.get(mean, ch, acc(d)), m.get(var, ch, acc(d)));
            let kk = m.get(sc, ch, dp) / (var_ + eps).sqrt();
            let out = (m.get(x, i, d) - mu) * kk + m.get(bi, ch, dp);
            m.set(y, i, d, out);
        }
        if let (Arg::Ptr(rmo), Arg::Ptr(rvo)) = (rmo, rvo) {
            for ch in 0..c {
                let (mu, var_) = (m.get(mean, ch, acc(d)), m.get(var, ch, acc(d)));
                let (om, ov) = (m.get(rm, ch, dp), m.get(rv, ch, dp));
                m.set(rmo, ch, dp, om * mom + mu * (1.0 - mom));
                m.set(rvo, ch, dp, ov * mom + var_ * (1.0 - mom));
            }
        }
    } else {
        // norm_bn_grad_apply_<T>_<P>
        let (dy, x, sc, mean, var, sg, sgd) =
            (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]), ptr(&a[5]), ptr(&a[6]));
        let (dx, ds, db) = (a[7], a[8], a[9]);
        let (n, c, inner, eps) = (int(&a[10]), int(&a[11]), int(&a[12]), f32_of(&a[13]));
        let cnt = (n * inner) as f64;
        for ch in 0..c {
            let inv = 1.0 / (m.get(var, ch, acc(d)) + eps).sqrt();
            let (g, gd, mu) = (m.get(sg, ch, acc(d)), m.get(sgd, ch, acc(d)), m.get(mean, ch, acc(d)));
            if let Arg::Ptr(dx) = dx {
                let kk = m.get(sc, ch, dp) * inv / cnt;
                for e in 0..n * inner {
                    let at = ((e / inner) * c + ch) * inner + e % inner;
                    let xhat = (m.get(x, at, d) - mu) * inv;
                    let out = kk * (cnt * m.get(dy, at, d) - g - xhat * gd * inv);
                    m.set(dx, at, d, out);
                }
            }
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
fn acc(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

fn run_loss(m: &mut Memory, k: &Kernel) {
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
                m.get(wb, l, d)
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
                        m.set(lpb, at(b, kk, i), d, log_prob[kk as usize]);
                    }
                }
                if let Arg::Ptr(q) = wl {
                    m.set(q, p, acc(d), loss);
                }
                if let Arg::Ptr(q) = ww {
                    m.set(q, p, acc(d), w);
                }
                if let Arg::Ptr(q) = none {
                    m.set(q, p, d, loss);
                }
                continue;
            }
            let (dloss, total, out, red) = (ptr(&a[0]), a[4], ptr(&a[5]), int(&a[at_dims + 5]));
            let g = match red {
                0 => m.get(dloss, p, d),
                1 => m.get(dloss, 0, d),
                _ => m.get(dloss, 0, d) / m.get(ptr(&total), 0, acc(d)),
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

const UNARY: [&str; 12] = [
    "relu",
    "exp",
    "neg",
    "sqrt",
    "tanh",
    "sigmoid",
    "reciprocal",
    "erf",
    "gelu",
    "gelu_tanh",
    "hard_swish",
    "hard_sigmoid",
];
const BINARY: [&str; 7] = ["add", "sub", "mul", "div", "max", "min", "pow"];

fn run_kernel(m: &mut Memory, k: &Kernel) {
    let a = &k.args;
    let tag = k.name.rsplit('_').next().unwrap();
    if k.name.starts_with("movement_copy_") {
        let size: usize = tag[1..].parse().unwrap();
        let (x, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]) as usize);
        let (d, xs, ys) = (dims(&a[4]), dims(&a[5]), dims(&a[6]));
        for i in 0..n {
            let (xo, yo) = if rank == 0 {
                (i, i)
            } else {
                let o = offsets(i, rank, &d, &[xs, ys]);
                (o[0], o[1])
            };
            let v = m.bytes(x, xo, size);
            m.put(y, yo, &v);
        }
    } else if k.name.starts_with("movement_fill_") {
        let size: usize = tag[1..].parse().unwrap();
        let (y, n) = (ptr(&a[0]), int(&a[1]));
        let Arg::U64(v) = a[2] else { panic!("fill value") };
        for i in 0..n {
            m.put(y, i, &v.to_le_bytes()[..size]);
        }
    } else if let Some(op) = BINARY.iter().find(|&&b| b == elementwise_op(&k.name) && k.args.len() == 8) {
        let d = dtype_of(tag);
        let (pa, pb, y, n, rank) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]) as usize);
        let (dd, sa, sb) = (dims(&a[5]), dims(&a[6]), dims(&a[7]));
        let mut out = Vec::with_capacity(n as usize);
        for i in 0..n {
            let (oa, ob) = if rank == 0 {
                (i, i)
            } else {
                let o = offsets(i, rank, &dd, &[sa, sb]);
                (o[0], o[1])
            };
            let (x, z) = (m.get(pa, oa, d), m.get(pb, ob, d));
            out.push(match *op {
                "add" => x + z,
                "sub" => x - z,
                "mul" => x * z,
                "div" => x / z,
                "max" => x.max(z),
                "pow" => x.powf(z),
                _ => x.min(z),
            });
        }
        // Every element is read before any is written (y may be a).
        for (i, v) in out.into_iter().enumerate() {
            m.set(y, i as i64, d, v);
        }
    } else if k.name.starts_with("im2col_im2col_") || k.name.starts_with("im2col_col2im_") {
        let d = dtype_of(tag);
        // The wide col2im reads f32 columns.
        let dc = if k.name.starts_with("im2col_col2im_wide_") { DType::F32 } else { d };
        let (src, dst) = (ptr(&a[0]), ptr(&a[1]));
        let (imgs, channels, img_stride, ch_stride) = (int(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
        let (w, col_ld, col_img) = (window(&a[6]), int(&a[7]), int(&a[8]));
        let nsp = w.nsp as usize;
        let kvol: i64 = w.k[..nsp].iter().product();
        let ovol: i64 = w.out[..nsp].iter().product();
        let ivol: i64 = w.inp[..nsp].iter().product();
        let to_col = k.name.starts_with("im2col_im2col_");
        // The image element each (kernel offset, output position) tap reads, if inside.
        let tap = |kp: i64, op: i64| -> Option<i64> {
            let (mut kr, mut or, mut off, mut scale) = (kp, op, 0i64, 1i64);
            for s in (0..nsp).rev() {
                let (kc, oc) = (kr % w.k[s], or % w.out[s]);
                kr /= w.k[s];
                or /= w.out[s];
                let i = oc * w.stride[s] + kc * w.dil[s] - w.pad[s];
                if i < 0 || i >= w.inp[s] {
                    return None;
                }
                off += i * scale;
                scale *= w.inp[s];
            }
            Some(off)
        };
        let mut sums: HashMap<i64, f64> = HashMap::new();
        for img in 0..imgs {
            for c in 0..channels {
                for kp in 0..kvol {
                    for op in 0..ovol {
                        let col_at = (c * kvol + kp) * col_ld + img * col_img + op;
                        let image = tap(kp, op).map(|i| img * img_stride + c * ch_stride + i);
                        if to_col {
                            let v = image.map_or(0.0, |at| m.get(src, at, d));
                            m.set(dst, col_at, d, v);
                        } else if let Some(at) = image {
                            *sums.entry(at).or_default() += m.get(src, col_at, dc);
                        }
                    }
                }
            }
        }
        if !to_col {
            for img in 0..imgs {
                for c in 0..channels {
                    for i in 0..ivol {
                        let at = img * img_stride + c * ch_stride + i;
                        m.set(dst, at, d, sums.get(&at).copied().unwrap_or(0.0));
                    }
                }
            }
        }
    } else if k.name.starts_with("im2col_channel_sum_") {
        let d = dtype_of(tag);
        let (dy, db, n, c, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for ch in 0..c {
            let mut s = 0.0;
            for b in 0..n {
                for i in 0..inner {
                    s += m.get(dy, (b * c + ch) * inner + i, d);
                }
            }
            m.set(db, ch, d, s);
        }
    } else if let Some(op) = UNARY.iter().find(|&&u| u == elementwise_op(&k.name) && k.args.len() == 5) {
        let d = dtype_of(tag);
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]));
        for i in 0..n {
            let v = m.get(x, i, d);
            let r = match *op {
                "relu" => v.max(0.0),
                "exp" => v.exp(),
                "neg" => -v,
                "sqrt" => v.sqrt(),
                "tanh" => v.tanh(),
                "reciprocal" => 1.0 / v,
                "erf" => erf(v),
                "gelu" => 0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2)),
                "gelu_tanh" => {
                    0.5 * v * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (v + 0.044715 * v * v * v)).tanh())
                }
                "hard_swish" => v * (v / 6.0 + 0.5).clamp(0.0, 1.0),
                "hard_sigmoid" => (f32_of(&a[3]) * v + f32_of(&a[4])).clamp(0.0, 1.0),
                _ => 1.0 / (1.0 + (-v).exp()),
            };
            m.set(y, i, d, r);
        }
    } else if k.name.starts_with("casts_") {
        let (from, to) = k.name["casts_".len()..].split_once("_to_").unwrap();
        let tag = |t: &str| if t == "bool" { DType::Bool } else { dtype_of(t) };
        let (df, dt) = (tag(from), tag(to));
        let (x, y, n) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]) as usize);
        let src = HostTensor::from_le_bytes(df, vec![n], &m.bytes(x, 0, n * df.size()));
        let out = src.cast(dt);
        let mut bytes = vec![0u8; out.bytes()];
        out.write_le_bytes(&mut bytes);
        m.put(y, 0, &bytes);
    } else if let Some((kind, finish)) = split_reduce(&k.name) {
        // Two passes: partials over chunks of the reduced axis (in the accumulator dtype), then
        // each output's partials combined and finalised.
        let d = dtype_of(tag);
        let acc = if d == DType::F64 {
            DType::F64
        } else if d.is_float() {
            DType::F32
        } else {
            DType::I64
        };
        let combine = |a: f64, b: f64| match kind {
            "max" => a.max(b),
            "min" => a.min(b),
            "prod" => a * b,
            _ => a + b,
        };
        let id = match kind {
            "max" => f64::NEG_INFINITY,
            "min" => f64::INFINITY,
            "prod" => 1.0,
            _ => 0.0,
        };
        if finish {
            let (part, y, nout, splits, reduced) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
            for out in 0..nout {
                let v = (0..splits).map(|s| m.get(part, out * splits + s, acc)).fold(id, combine);
                let v = match kind {
                    "mean" => v / reduced.max(1) as f64,
                    "l2" => v.sqrt(),
                    _ => v,
                };
                m.set(y, out, d, v);
            }
        } else {
            let (x, part, outer, reduced, inner, splits) =
                (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]), int(&a[5]));
            let chunk = (reduced + splits - 1) / splits;
            for o in 0..outer {
                for s in 0..splits {
                    for i in 0..inner {
                        let v = (s * chunk..((s + 1) * chunk).min(reduced))
                            .map(|r| {
                                let e = m.get(x, (o * reduced + r) * inner + i, d);
                                match kind {
                                    "sum_square" | "l2" => e * e,
                                    "l1" => e.abs(),
                                    _ => e,
                                }
                            })
                            .fold(id, combine);
                        m.set(part, (o * inner + i) * splits + s, acc, v);
                    }
                }
            }
        }
    } else if k.name.starts_with("reduce_") {
        let kind = k.name["reduce_".len()..]
            .rsplit_once(if k.name.contains("_rows_") { "_rows_" } else { "_cols_" })
            .unwrap()
            .0;
        let d = dtype_of(tag);
        let (x, y, outer, reduced, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for o in 0..outer {
            for i in 0..inner {
                let v: Vec<f64> = (0..reduced).map(|r| m.get(x, (o * reduced + r) * inner + i, d)).collect();
                let at = o * inner + i;
                let arg = |best: &dyn Fn(f64, f64) -> bool| {
                    let mut b = 0usize;
                    for (j, &e) in v.iter().enumerate() {
                        if best(e, v[b]) || (int(&a[5]) != 0 && e == v[b]) {
                            b = j;
                        }
                    }
                    b as f64
                };
                let r = match kind {
                    "sum" => v.iter().sum(),
                    "mean" => v.iter().sum::<f64>() / (reduced.max(1) as f64),
                    "max" => v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    "min" => v.iter().copied().fold(f64::INFINITY, f64::min),
                    "prod" => v.iter().product(),
                    "sum_square" => v.iter().map(|e| e * e).sum(),
                    "l1" => v.iter().map(|e| e.abs()).sum(),
                    "l2" => v.iter().map(|e| e * e).sum::<f64>().sqrt(),
                    "log_sum_exp" => {
                        let mx = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        v.iter().map(|e| (e - mx).exp()).sum::<f64>().ln() + mx
                    }
                    "argmax" => arg(&|e, b| e > b),
                    _ => arg(&|e, b| e < b),
                };
                let dy = if kind.starts_with("arg") { DType::I64 } else { d };
                m.set(y, at, dy, r);
            }
        }
    } else if (k.name.starts_with("softmax_softmax_") || k.name.starts_with("softmax_log_softmax_"))
        && !k.name.contains("_grad")
    {
        let d = dtype_of(tag);
        let log = k.name.starts_with("softmax_log_softmax_");
        let (x, y, outer, n, inner) = (ptr(&a[0]), ptr(&a[1]), int(&a[2]), int(&a[3]), int(&a[4]));
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: i64| (o * n + j) * inner + i;
                let v: Vec<f64> = (0..n).map(|j| m.get(x, at(j), d)).collect();
                let mx = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = v.iter().map(|e| (e - mx).exp()).sum();
                for (j, e) in v.iter().enumerate() {
                    let r = if log { e - mx - s.ln() } else { (e - mx).exp() / s };
                    m.set(y, at(j as i64), d, r);
                }
            }
        }
    } else if k.name.starts_with("norm_layer_norm_") && !k.name.contains("_grad") {
        let tags: Vec<&str> = k.name["norm_layer_norm_".len()..].split('_').collect();
        let (d, dp) = (dtype_of(tags[0]), dtype_of(tags[1]));
        let (x, scale, bias, y) = (ptr(&a[0]), ptr(&a[1]), a[2], ptr(&a[3]));
        let (mean_out, inv_out) = (a[4], a[5]);
        let (rows, n, sn) = (int(&a[6]), int(&a[7]), int(&a[8]));
        let Arg::F32(eps) = a[9] else { panic!("eps") };
        for r in 0..rows {
            let v: Vec<f64> = (0..n).map(|j| m.get(x, r * n + j, d)).collect();
            let mean = v.iter().sum::<f64>() / n as f64;
            let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f64>() / n as f64;
            let inv = 1.0 / (var + eps as f64).sqrt();
            for (j, e) in v.iter().enumerate() {
                let b = if let Arg::Ptr(b) = bias { m.get(b, j as i64 % sn, dp) } else { 0.0 };
                let out = (e - mean) * inv * m.get(scale, j as i64 % sn, dp) + b;
                m.set(y, r * n + j as i64, d, out);
            }
            if let Arg::Ptr(p) = mean_out {
                m.set(p, r, acc(d), mean);
            }
            if let Arg::Ptr(p) = inv_out {
                m.set(p, r, acc(d), inv);
            }
        }
    } else if k.name.starts_with("gather_axis_")
        || k.name.starts_with("gather_elements_")
        || k.name.starts_with("gather_nd_")
    {
        // Named by element size and index dtype: gather_<kind>_b<size>_<index tag>.
        let parts: Vec<&str> = k.name.rsplitn(3, '_').collect();
        let (size, di): (usize, DType) = (parts[1][1..].parse().unwrap(), dtype_of(parts[0]));
        let (x, idx, y) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]));
        let index = |m: &mut Memory, j: i64, len: i64| {
            let v = m.get(idx, j, di) as i64;
            let v = if v < 0 { v + len } else { v };
            assert!((0..len).contains(&v), "{}: index out of range", k.name);
            v
        };
        if k.name.starts_with("gather_axis_") {
            let (outer, len, count, inner) = (int(&a[3]), int(&a[4]), int(&a[5]), int(&a[6]));
            for o in 0..outer {
                for j in 0..count {
                    let l = index(m, j, len);
                    for i in 0..inner {
                        let v = m.bytes(x, (o * len + l) * inner + i, size);
                        m.put(y, (o * count + j) * inner + i, &v);
                    }
                }
            }
        } else if k.name.starts_with("gather_elements_") {
            let (n, rank, d, xs, axis, len) =
                (int(&a[3]), int(&a[4]) as usize, dims(&a[5]), dims(&a[6]), int(&a[7]) as usize, int(&a[8]));
            for e in 0..n {
                let mut xs_no_axis = xs;
                xs_no_axis[axis] = 0;
                let off = offsets(e, rank, &d, &[xs_no_axis])[0] + index(m, e, len) * xs[axis];
                let v = m.bytes(x, off, size);
                m.put(y, e, &v);
            }
        } else {
            let (tuples, kk, run, per_batch, batch_len) = (int(&a[3]), int(&a[4]), int(&a[5]), int(&a[6]), int(&a[7]));
            let (d, st) = (dims(&a[8]), dims(&a[9]));
            for t in 0..tuples {
                let mut off = (t / per_batch) * batch_len;
                for j in 0..kk {
                    off += index(m, t * kk + j, d[j as usize]) * st[j as usize];
                }
                for r in 0..run {
                    let v = m.bytes(x, off + r, size);
                    m.put(y, t * run + r, &v);
                }
            }
        }
    } else if k.name.starts_with("gather_scatter_") {
        let parts: Vec<&str> = k.name.rsplitn(3, '_').collect();
        let (d, di) = (dtype_of(parts[1]), dtype_of(parts[0]));
        let (idx, upd, out, n_out) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
        let red = int(&a[a.len() - 2]);
        // f16/bf16 accumulate in f32 and round once: hold the output as f64 until the end.
        let mut acc: Vec<f64> = (0..n_out).map(|o| m.get(out, o, d)).collect();
        let combine = |old: f64, u: f64| match red {
            0 => u,
            1 => old + u,
            2 => old * u,
            3 => old.max(u),
            _ => old.min(u),
        };
        let index = |m: &mut Memory, j: i64, len: i64| {
            let v = m.get(idx, j, di) as i64;
            if v < 0 {
                v + len
            } else {
                v
            }
        };
        if k.name.starts_with("gather_scatter_nd_") {
            let (tuples, kk, run, dd, st) = (int(&a[4]), int(&a[5]), int(&a[6]), dims(&a[7]), dims(&a[8]));
            for t in 0..tuples {
                let mut dst = 0;
                for j in 0..kk {
                    dst += index(m, t * kk + j, dd[j as usize]) * st[j as usize];
                }
                for r in 0..run {
                    let u = m.get(upd, t * run + r, d);
                    acc[(dst + r) as usize] = combine(acc[(dst + r) as usize], u);
                }
            }
        } else {
            let (n_upd, rank, idd, os, axis, len) =
                (int(&a[4]), int(&a[5]) as usize, dims(&a[6]), dims(&a[7]), int(&a[8]) as usize, int(&a[9]));
            let mut os_no_axis = os;
            os_no_axis[axis] = 0;
            for u in 0..n_upd {
                let dst = offsets(u, rank, &idd, &[os_no_axis])[0] + index(m, u, len) * os[axis];
                acc[dst as usize] = combine(acc[dst as usize], m.get(upd, u, d));
            }
        }
        for (o, v) in acc.into_iter().enumerate() {
            m.set(out, o as i64, d, v);
        }
    } else if MORE.iter().any(|p| k.name.starts_with(p)) {
        run_more(m, k);
    } else {
        panic!("{} is not interpreted", k.name);
    }
}

fn run_gemm(m: &mut Memory, g: &Gemm) {
    let (d, dc) = (g.dtype, g.c_dtype);
    for bi in 0..g.batch {
        let (a0, b0, c0) = (bi * g.stride_a, bi * g.stride_b, bi * g.stride_c);
        for i in 0..g.m {
            for j in 0..g.n {
                let mut s = 0.0;
                for l in 0..g.k {
                    let av =
                        if g.trans_a { m.get(g.a, a0 + l + i * g.lda, d) } else { m.get(g.a, a0 + i + l * g.lda, d) };
                    let bv =
                        if g.trans_b { m.get(g.b, b0 + j + l * g.ldb, d) } else { m.get(g.b, b0 + l + j * g.ldb, d) };
                    s += av * bv;
                }
                let at = c0 + i + j * g.ldc;
                let old = if g.beta != 0.0 { m.get(g.c, at, dc) } else { 0.0 };
                m.set(g.c, at, dc, g.alpha * s + g.beta * old);
            }
        }
    }
}

/// Runs a plan's calls; a convolution as cuDNN computes it (`dnn`) or as its fallback.
fn run_plan(m: &mut Memory, p: &LaunchPlan, dnn: bool) {
    m.work = vec![0xAB; p.workspace as usize];
    m.aux = p.aux.clone();
    m.addresses = p.addresses.iter().copied().collect();
    for c in &p.calls {
        run_call(m, c, dnn);
    }
}

fn run_call(m: &mut Memory, c: &Call, dnn: bool) {
    match c {
        Call::Kernel(k) => run_kernel(m, k),
        Call::Gemm(g) => run_gemm(m, g),
        Call::Copy { from, to, bytes } => {
            let v = m.bytes(*from, 0, *bytes as usize);
            m.put(*to, 0, &v);
        }
        Call::Fill { to, bytes, byte } => m.put(*to, 0, &vec![*byte; *bytes as usize]),
        Call::Conv(conv) if dnn => run_dnn(m, conv),
        Call::Conv(conv) => conv.fallback.iter().for_each(|c| run_call(m, c, dnn)),
    }
}

/// What cuDNN computes for `conv`, by the CPU's Conv and ConvGrad on the operands the
/// descriptors describe: the plan's shapes, pads, strides, dilations and groups.
fn run_dnn(m: &mut Memory, conv: &DnnConv) {
    use mpc_ir::ops::ConvAttrs;
    use mpc_ir::Op;
    let d = conv.dtype;
    let shape = |s: [i64; 4]| s.iter().map(|&v| v as usize).collect::<Vec<_>>();
    let numel = |s: [i64; 4]| s.iter().product::<i64>() as usize;
    let mut read = |b: Buf, s: [i64; 4]| HostTensor::from_le_bytes(d, shape(s), &m.bytes(b, 0, numel(s) * d.size()));
    let zeros = |s: [i64; 4]| HostTensor::from_f64(d, shape(s), vec![0.0; numel(s)]);
    let attrs = ConvAttrs {
        pads: vec![conv.pads[0], conv.pads[1], conv.pads[0], conv.pads[1]],
        strides: conv.strides.to_vec(),
        dilations: conv.dilations.to_vec(),
        group: conv.groups,
        kernel_shape: conv.w[2..].to_vec(),
        ..ConvAttrs::default()
    };
    let mut results = Vec::new();
    for op in &conv.ops {
        let (out, t) = match *op {
            DnnOp::Forward { x, w, y } => {
                let (x, w) = (read(x, conv.x), read(w, conv.w));
                (y, run_op(&Op::Conv(Box::new(attrs.clone())), &[Some(&x), Some(&w)], 1).unwrap().remove(0))
            }
            DnnOp::BackwardData { w, dy, dx } => {
                let (w, dy, x) = (read(w, conv.w), read(dy, conv.y), zeros(conv.x));
                (
                    dx,
                    run_op(&Op::ConvGrad(Box::new(attrs.clone())), &[Some(&dy), Some(&x), Some(&w)], 2)
                        .unwrap()
                        .remove(0),
                )
            }
            DnnOp::BackwardFilter { x, dy, dw } => {
                let (x, dy, w) = (read(x, conv.x), read(dy, conv.y), zeros(conv.w));
                (
                    dw,
                    run_op(&Op::ConvGrad(Box::new(attrs.clone())), &[Some(&dy), Some(&x), Some(&w)], 2)
                        .unwrap()
                        .remove(1),
                )
            }
        };
        results.push((out, t));
    }
    // Every operation reads the operands as they were before any of them wrote.
    for (out, t) in results {
        let mut b = vec![0u8; t.bytes()];
        t.write_le_bytes(&mut b);
        m.put(out, 0, &b);
    }
}

fn whole(dev: &mut CpuDevice, regions: &mut Regions<mpc_runtime::device::CpuMemory>, r: Region) -> Vec<u8> {
    let mem = regions.get_mut(r);
    let len = mem.bytes().len() as u64;
    dev.read(mem, 0, len).unwrap()
}

/// Runs `program` on the CPU device launch by launch; each launch whose plan this file can
/// interpret is also run by the interpreter on a copy of the regions just before it, and the
/// two results are compared. The op types checked.
fn check_program(label: &str, program: &Program, feeds: &HashMap<String, HostTensor>) -> Vec<String> {
    let mut dev = CpuDevice::default();
    let mut arena = dev.alloc(Region::Arena, program.arena_bytes).unwrap();
    let mut state = dev.alloc(Region::State, program.state_layout.bytes).unwrap();
    let mut constants = dev.alloc(Region::Constants, program.constants_bytes).unwrap();
    let bytes = |t: &HostTensor| {
        let mut b = vec![0u8; t.bytes()];
        t.write_le_bytes(&mut b);
        b
    };
    for (place, t) in &program.constants {
        dev.write(&mut constants, place.offset, &bytes(t)).unwrap();
    }
    for (place, t) in &program.state_init {
        dev.write(&mut state, place.offset, &bytes(t)).unwrap();
    }
    for (name, place) in &program.inputs {
        dev.write(&mut arena, place.offset, &bytes(&feeds[name])).unwrap();
    }
    let mut regions = Regions { arena: &mut arena, state: &mut state, constants: &mut constants };
    dev.prepare(program, &mut regions).unwrap();
    let constant = |t: &TensorRef| program.constants.iter().find(|(p, _)| p == t).map(|(_, v)| v.clone());
    let mut checked = Vec::new();
    for l in &program.launches {
        let p = plan(l, &constant).unwrap_or_else(|e| panic!("{label}: {}: {e}", l.node));
        let ours = l.branches.is_none() && !p.calls.is_empty() && p.calls.iter().all(call_interpretable);
        let mut mem = ours.then(|| Memory {
            arena: whole(&mut dev, &mut regions, Region::Arena),
            state: whole(&mut dev, &mut regions, Region::State),
            constants: whole(&mut dev, &mut regions, Region::Constants),
            work: Vec::new(),
            aux: Vec::new(),
            flag: vec![0; 4],
            addresses: HashMap::new(),
        });
        dev.launch(&mut regions, l).unwrap();
        let Some(mem) = mem.as_mut() else {
            if !p.calls.is_empty() {
                checked.push(format!("not interpreted: {}", l.op.op_type()));
            }
            continue;
        };
        // A convolution for cuDNN: both what cuDNN computes and its fallback.
        let convs = p.calls.iter().any(|c| matches!(c, Call::Conv(_)));
        let fallback = convs.then(|| {
            let mut copy = mem.clone();
            run_plan(&mut copy, &p, false);
            copy
        });
        run_plan(mem, &p, true);
        for (mem, how) in std::iter::once((&*mem, "")).chain(fallback.as_ref().map(|f| (f, " (the fallback)"))) {
            for out in &l.outputs {
                let mem_bytes = match out.region {
                    Region::Arena => &mem.arena,
                    Region::State => &mem.state,
                    Region::Constants => &mem.constants,
                };
                let (s, e) = (out.offset as usize, (out.offset + out.bytes()) as usize);
                let got = HostTensor::from_le_bytes(out.dtype, out.shape.clone(), &mem_bytes[s..e]);
                let want_bytes = dev.read(regions.get_mut(out.region), out.offset, out.bytes()).unwrap();
                let want = HostTensor::from_le_bytes(out.dtype, out.shape.clone(), &want_bytes);
                let t = Tolerance::for_dtype(out.dtype);
                let tol = Tolerance { rtol: 10.0 * t.rtol, atol: 10.0 * t.atol, rel_l2: 10.0 * t.rel_l2 };
                if let Err(e) = tol.check(&got, &want) {
                    panic!("{label}: {} ({}){how}: the plan computes another result: {e}", l.node, l.op.op_type());
                }
            }
        }
        checked.push(l.op.op_type().to_string());
        if convs {
            checked.push(format!("{} for cuDNN", l.op.op_type()));
        }
    }
    checked
}

const CUDA: mpc_runtime::program::DeviceCaps =
    mpc_runtime::program::DeviceCaps { name: "cuda", align: 256, memory: 1 << 40 };

#[test]
fn the_plans_of_the_fixtures_compute_what_the_cpu_computes() {
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            for train in [false, true] {
                let Some(g) = common::compiled(name, policy, train).ok() else { continue };
                let dims: HashMap<String, u64> = [("batch".to_string(), 3)].into();
                let (bound, _) = mpc::summary::bind_inputs(&g, &dims).unwrap();
                let Ok(program) = mpc::run::lower_bound(&bound, CUDA, None, None, &fixture(name)) else { continue };
                if program.host_reads > 0 {
                    continue;
                }
                let feeds = mpc::run::random_inputs(&bound, 9, &dims).unwrap();
                let label = format!("{name} {policy}{}", if train { " train" } else { "" });
                for op in check_program(&label, &program, &feeds) {
                    *seen.entry(op).or_default() += 1;
                }
            }
        }
    }
    println!("launches checked against the CPU by op: {seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
    for op in ["MatMul", "Gemm", "Conv", "ConvGrad", "Transpose"] {
        assert!(seen.contains_key(op), "no {op} launch was checked: {seen:?}");
    }
}

/// Single ops with the awkward cases: broadcast batch dims, transposes, groups, dilations, pads,
/// output padding, negative steps, a Pad crop with a computed value.
#[test]
fn the_plans_of_awkward_single_ops_compute_what_the_cpu_computes() {
    let cases = [
        ("input %0 \"a\": f32[2,1,3,5]\n  input %1 \"b\": f32[1,4,5,2]\n  %2 \"y\": f32[2,4,3,2] = MatMul(%0, %1)\n  output %2", "MatMul"),
        ("input %0 \"a\": f32[5]\n  input %1 \"b\": f32[3,5,2]\n  %2 \"y\": f32[3,2] = MatMul(%0, %1)\n  output %2", "MatMul"),
        ("input %0 \"a\": f16[4,3,7]\n  input %1 \"b\": f16[7]\n  %2 \"y\": f16[4,3] = MatMul(%0, %1)\n  output %2", "MatMul"),
        ("input %0 \"a\": f32[5,3]\n  input %1 \"b\": f32[4,5]\n  input %2 \"c\": f32[4]\n  %3 \"y\": f32[3,4] = Gemm[transA=1, transB=1, alpha=0.5, beta=2.0](%0, %1, %2)\n  output %3", "Gemm"),
        ("input %0 \"x\": f32[2,4,7,6]\n  input %1 \"w\": f32[6,2,3,2]\n  input %2 \"b\": f32[6]\n  %3 \"y\": f32[2,6,4,5] = Conv[group=2, pads=[1,0,1,1], strides=[2,1], dilations=[1,2]](%0, %1, %2)\n  output %3", "Conv"),
        ("input %0 \"x\": f32[2,4,5]\n  input %1 \"w\": f32[4,3,3]\n  %2 \"y\": f32[2,6,11] = ConvTranspose[group=2, strides=[2], pads=[1,0], output_padding=[1]](%0, %1)\n  output %2", "ConvTranspose"),
        ("input %0 \"x\": f32[2,3,4]\n  %1 \"y\": f32[4,2,3] = Transpose[perm=[2,0,1]](%0)\n  output %1", "Transpose"),
        ("input %0 \"x\": f32[5,6]\n  init %1 \"s\" = i64[2]{4, 1}\n  init %2 \"e\" = i64[2]{0, 6}\n  init %3 \"ax\" = i64[2]{0, 1}\n  init %4 \"st\" = i64[2]{-2, 2}\n  %5 \"y\": f32[2,3] = Slice(%0, %1, %2, %3, %4)\n  output %5", "Slice"),
        ("input %0 \"a\": f32[2,3]\n  input %1 \"b\": f32[2,1]\n  %2 \"y\": f32[2,4] = Concat[axis=1](%0, %1)\n  output %2", "Concat"),
        ("input %0 \"x\": f32[3,1,4]\n  init %1 \"s\" = i64[4]{2, 3, 3, 1}\n  %2 \"y\": f32[2,3,3,4] = Expand(%0, %1)\n  output %2", "Expand"),
        ("input %0 \"x\": f32[3,4,5,2]\n  init %1 \"ax\" = i64[2]{0, 2}\n  %2 \"y\": f32[1,4,1,2] = ReduceSum(%0, %1)\n  output %2", "ReduceSum"),
        ("input %0 \"x\": f32[3,4,5,2]\n  init %1 \"ax\" = i64[2]{1, 2}\n  %2 \"y\": f32[3,2] = ReduceMax[keepdims=0](%0, %1)\n  output %2", "ReduceMax"),
        ("input %0 \"x\": f32[2,3,4]\n  %1 \"y\": f32[2,3,4] = Softmax[axis=1](%0)\n  output %1", "Softmax"),
        ("input %0 \"x\": f16[3,7]\n  %1 \"y\": f16[3,7] = LogSoftmax[axis=-1](%0)\n  output %1", "LogSoftmax"),
        ("input %0 \"x\": f32[2,5,40]\n  %1 \"y\": i64[2,40] = ArgMax[axis=1, keepdims=0, select_last_index=1](%0)\n  output %1", "ArgMax"),
        ("input %0 \"x\": f32[8]\n  init %1 \"i\" = i64[4,1]{0, 0, -1, 0}\n  init %2 \"u\" = f32[4]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[8] = ScatterND[reduction=\"add\"](%0, %1, %2)\n  output %3", "ScatterND"),
        ("input %0 \"x\": f16[3,2]\n  init %1 \"i\" = i64[2,1]{2, 0}\n  init %2 \"u\" = f16[2,2]{1.0, 2.0, 3.0, 4.0}\n  %3 \"y\": f16[3,2] = ScatterND(%0, %1, %2)\n  output %3", "ScatterND"),
        ("input %0 \"x\": f32[2,3]\n  init %1 \"i\" = i64[2,2]{2, 0, 2, -1}\n  init %2 \"u\" = f32[2,2]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[2,3] = ScatterElements[axis=1, reduction=\"add\"](%0, %1, %2)\n  output %3", "ScatterElements"),
        ("input %0 \"x\": i64[2,3]\n  init %1 \"i\" = i32[1,3]{1, 1, 0}\n  init %2 \"u\" = i64[1,3]{10, 20, 30}\n  %3 \"y\": i64[2,3] = ScatterElements[reduction=\"max\"](%0, %1, %2)\n  output %3", "ScatterElements"),
        ("input %0 \"x\": f32[2,3,4]\n  init %1 \"i\" = i64[2,2,1]{1, 0, 2, 2}\n  %2 \"y\": f32[2,2,4] = GatherND[batch_dims=1](%0, %1)\n  output %2", "GatherND"),
        ("input %0 \"x\": f32[3,4]\n  init %1 \"i\" = i64[2,2]{0, 3, 2, -1}\n  %2 \"y\": f32[2] = GatherND(%0, %1)\n  output %2", "GatherND"),
        ("input %0 \"x\": f32[5,3]\n  init %1 \"i\" = i64[2,2]{4, -1, 0, 2}\n  %2 \"y\": f32[2,2,3] = Gather(%0, %1)\n  output %2", "Gather"),
        ("input %0 \"x\": f32[3,4]\n  init %1 \"i\" = i64[2,4]{0, 2, 1, -1, 2, 2, 0, 1}\n  %2 \"y\": f32[2,4] = GatherElements(%0, %1)\n  output %2", "GatherElements"),
        ("input %0 \"x\": f32[2,3,7,6]\n  %1 \"y\": f32[2,3,4,3] = AveragePool[kernel_shape=[3,2], pads=[1,1,1,0], strides=[2,2], count_include_pad=1, ceil_mode=1](%0)\n  output %1", "AveragePool"),
        ("input %0 \"x\": f32[2,3,9]\n  %1 \"y\": f32[2,3,4] = MaxPool[kernel_shape=[2], dilations=[3], strides=[2], pads=[1,1]](%0)\n  output %1", "MaxPool"),
        ("input %0 \"x\": f32[3,4]\n  input %1 \"v\": f32[]\n  init %2 \"p\" = i64[4]{1, -1, 0, 2}\n  %3 \"y\": f32[4,5] = Pad(%0, %2, %1)\n  output %3", "Pad"),
        // Few long columns: the rows split, partials combined in a second pass.
        ("input %0 \"x\": f32[1024,40]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[40] = ReduceSum[keepdims=0](%0, %1)\n  output %2", "ReduceSum"),
        ("input %0 \"x\": f16[2,600,64]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f16[2,1,64] = ReduceMean(%0, %1)\n  output %2", "ReduceMean"),
        ("input %0 \"x\": f32[700,33]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[1,33] = ReduceMax(%0, %1)\n  output %2", "ReduceMax"),
        ("input %0 \"x\": f32[3,520,40]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f32[3,40] = ReduceL2[keepdims=0](%0, %1)\n  output %2", "ReduceL2"),
        ("input %0 \"dy\": f32[600,48]\n  input %1 \"x\": f32[600,48]\n  input %2 \"s\": f32[48]\n  %3 \"dx\": f32[600,48], %4 \"ds\": f32[48], %5 \"db\": f32[48] = ai.mpc::LayerNormalizationGrad[axis=-1](%0, %1, %2)\n  output %3\n  output %4\n  output %5", "LayerNormalizationGrad"),
        // Few channels of many elements: batch norm statistics in passes.
        ("input %0 \"x\": f32[4,3,80,80]\n  input %1 \"s\": f32[3]\n  input %2 \"b\": f32[3]\n  input %3 \"m\": f32[3]\n  input %4 \"v\": f32[3]\n  %5 \"y\": f32[4,3,80,80], %6 \"rm\": f32[3], %7 \"rv\": f32[3] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"dy\": f16[4,3,80,80]\n  input %1 \"x\": f16[4,3,80,80]\n  input %2 \"s\": f32[3]\n  %3 \"dx\": f16[4,3,80,80], %4 \"ds\": f16[3], %5 \"db\": f16[3] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5", "BatchNormalizationGrad"),
        // f64 data: the norm and loss kernels compute and keep their statistics in f64; LayerNorm's
        // f32 Mean / InvStdDev (stash_type) are cast from them.
        ("input %0 \"x\": f64[3,2,5]\n  input %1 \"s\": f64[2,5]\n  input %2 \"b\": f64[2,5]\n  %3 \"y\": f64[3,2,5], %4 \"m\": f32[3,1,1], %5 \"r\": f32[3,1,1] = LayerNormalization[axis=1](%0, %1, %2)\n  output %3\n  output %4\n  output %5", "LayerNormalization"),
        ("input %0 \"x\": f64[2,3,4]\n  input %1 \"s\": f64[3]\n  input %2 \"b\": f64[3]\n  input %3 \"m\": f64[3]\n  input %4 \"v\": f64[3]\n  %5 \"y\": f64[2,3,4], %6 \"rm\": f64[3], %7 \"rv\": f64[3] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"x\": f64[4,5,2]\n  init %1 \"l\" = i64[4,2]{0, 4, 2, 1, 3, 3, 4, 0}\n  init %2 \"w\" = f64[5]{1.0, 0.5, 2.0, 1.5, 0.25}\n  %3 \"y\": f64[] = SoftmaxCrossEntropyLoss[reduction=\"mean\", ignore_index=3](%0, %1, %2)\n  output %3", "SoftmaxCrossEntropyLoss"),
    ];
    for (body, op) in cases {
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  {body}\nend\n");
        let g = mpc_ir::text::parse(&text, None).unwrap_or_else(|e| panic!("{op}: {e}\n{text}"));
        let feeds = mpc::run::random_inputs(&g, 4, &HashMap::new()).unwrap();
        let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, std::path::Path::new(op)).unwrap();
        let checked = check_program(op, &program, &feeds);
        assert!(checked.iter().any(|c| c == op), "{op}: not checked ({checked:?})");
    }
}

/// The zoo's exports (BERT, DistilBERT, GPT-2, Llama, ViT, MobileNetV3, a UNet, a GroupNorm CNN,
/// an LSTM and a GRU, from both torch exporters), compiled mixed, at batch 2.
#[test]
fn the_plans_of_the_zoo_exports_compute_what_the_cpu_computes() {
    let zoo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/zoo");
    let mut names: Vec<_> = std::fs::read_dir(&zoo).unwrap().flatten().map(|e| e.path()).collect();
    names.retain(|p| p.extension().is_some_and(|e| e == "onnx"));
    names.sort();
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for path in &names {
        let mut g = mpc::load(path).unwrap();
        let opts = mpc::Options { policy: Some("mixed".into()), ..Default::default() };
        mpc::compile(&mut g, path, &opts, &mut |_, _| {}).unwrap();
        let mut dims = HashMap::new();
        for &v in g.inputs() {
            for d in g.ty(v).shape.iter().flat_map(|s| s.dims().to_vec()) {
                if let Some(s) = d.symbol() {
                    dims.insert(s.to_string(), 2);
                }
            }
        }
        let feeds = mpc::run::random_inputs(&g, 3, &dims).unwrap();
        let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, path).unwrap();
        let label = path.file_name().unwrap().to_string_lossy().to_string();
        // An export whose Dropout stayed in training mode runs on neither device.
        let constant = |t: &TensorRef| program.constants.iter().find(|(p, _)| p == t).map(|(_, v)| v.clone());
        if program.launches.iter().any(|l| plan(l, &constant).is_err_and(|e| e.contains("training mode"))) {
            println!("{label}: skipped (Dropout in training mode)");
            continue;
        }
        let t = std::time::Instant::now();
        for op in check_program(&label, &program, &feeds) {
            *seen.entry(op).or_default() += 1;
        }
        println!("{label}: {:.1} s", t.elapsed().as_secs_f64());
    }
    println!("zoo launches checked against the CPU by op: {seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
}

/// The zoo's training steps (mixed, Adam, each family's loss and labels from zoo.json, torch's
/// batch): every launch's plan computes what the CPU does, GatherGrad, the losses over sequences
/// and the recurrent nets' unrolled steps included.
#[test]
fn the_plans_of_the_zoo_training_steps_compute_what_the_cpu_computes() {
    let zoo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/zoo");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(zoo.join("zoo.json")).unwrap()).unwrap();
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for (family, f) in json.as_object().unwrap() {
        let expected = mpc::run::read_safetensors(&zoo.join(format!("{family}.grads.safetensors"))).unwrap();
        let feeds: HashMap<String, HostTensor> =
            expected.iter().filter_map(|(k, t)| Some((k.strip_prefix("input.")?.to_string(), t.clone()))).collect();
        for export in ["dynamo", "legacy"] {
            let path = zoo.join(format!("{family}.{export}.onnx"));
            let mut g = mpc::load(&path).unwrap();
            let cfg = mpc::config::TrainFile { loss: f["loss"].as_str().map(String::from), ..Default::default() };
            let (t, _) = cfg.resolve().unwrap();
            let t = mpc_passes::train::TrainOptions { labels: f["labels"].as_str().unwrap().to_string(), ..t };
            let opts = mpc::Options { policy: Some("mixed".into()), train: Some(t), ..Default::default() };
            mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
            let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, &path).unwrap();
            let label = format!("{family}.{export} train");
            for op in check_program(&label, &program, &feeds) {
                *seen.entry(op).or_default() += 1;
            }
        }
    }
    println!("zoo training launches checked against the CPU by op: {seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
}

/// The ONNX conformance cases (where `MPC_ONNX_NODE_TESTS` points at them): each launch this
/// file can interpret computes on its plan what the CPU does.
#[test]
fn the_plans_of_the_conformance_cases_compute_what_the_cpu_computes() {
    let Some(cases) = common::conformance_cases() else { return };
    let (mut checked, mut skipped) = (0, 0);
    for common::ConformanceCase { name: label, model, graph: g, feeds } in &cases {
        let Ok(program) = mpc::run::lower_for_inputs(g, feeds, CUDA, model) else { continue };
        let constant = |t: &TensorRef| program.constants.iter().find(|(p, _)| p == t).map(|(_, v)| v.clone());
        let runs = program.host_reads == 0
            && program.launches.iter().all(|l| plan(l, &constant).is_ok())
            && mpc::run::run_once(g, feeds, model).is_ok();
        if !runs {
            skipped += 1;
            continue;
        }
        checked += check_program(label, &program, feeds).iter().filter(|o| !o.starts_with("not interpreted")).count();
    }
    println!("conformance launches checked against the CPU: {checked} ({skipped} cases skipped)");
    assert!(checked > 500, "only {checked} launches checked");
}
