//! The interpreter of the training kernels (kernels/train.cu): ReluGrad, GeluGrad, AllFinite,
//! the unscale, the SGD and Adam updates (one tensor or many), LossScaleUpdate and SeededDropout.

use mpc_ir::DType;
use mpc_runtime::cuda::plan::{Arg, Buf, Kernel};

use super::interp::*;
use super::more::{erf, f32_of};

/// The parameter and gradient dtypes of an update kernel, `train_<op>_<param>_<grad>`.
pub(crate) fn update_dtypes(name: &str) -> (DType, DType) {
    let parts: Vec<&str> = name.rsplitn(3, '_').collect();
    (dtype_of(parts[1]), dtype_of(parts[0]))
}

/// Adam's hyper-parameters (lr, beta1, beta2, epsilon, weight_decay, decoupled arguments), its
/// unscale, step count and whether the step is applied.
pub(crate) struct AdamHyper {
    lr: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    wd: f64,
    decoupled: bool,
    inv: f64,
    t: f64,
    ok: bool,
}

/// An update's learning rate: the f32 its `lr_ptr` argument points at, else its `lr` argument.
fn rate(m: &mut Memory, lr: &Arg, lr_ptr: &Arg) -> f64 {
    match *lr_ptr {
        Arg::Ptr(b) => m.get(b, 0, DType::F32),
        _ => f32_of(lr),
    }
}

fn adam_hyper(m: &mut Memory, a: &[Arg], inv: &Arg, step: Buf, finite: Buf) -> AdamHyper {
    AdamHyper {
        lr: rate(m, &a[0], &a[1]),
        b1: f32_of(&a[2]),
        b2: f32_of(&a[3]),
        eps: f32_of(&a[4]),
        wd: f32_of(&a[5]),
        decoupled: int(&a[6]) != 0,
        inv: unscale_of(m, inv),
        t: m.get(step, 0, DType::I64).max(1.0),
        ok: m.get(finite, 0, DType::U8) != 0.0,
    }
}

/// One tensor's Adam update, as train_adam_ computes it: `b` = param, grad, m, v, param', m', v';
/// `d` the parameter's and the gradient's dtypes.
fn adam_tensor(m: &mut Memory, h: &AdamHyper, b: [Buf; 7], d: (DType, DType), n: i64, low: Option<(Buf, Buf, DType)>) {
    let [param, grad, mm, vv, po, mo, vo] = b;
    let (d, dg) = d;
    for i in 0..n {
        let (mut p, g, m0, v0) = (m.get(param, i, d), m.get(grad, i, dg) * h.inv, m.get(mm, i, d), m.get(vv, i, d));
        if !h.ok {
            m.set(po, i, d, p);
            m.set(mo, i, d, m0);
            m.set(vo, i, d, v0);
            keep_low(m, low, i);
            continue;
        }
        let dd = if h.decoupled {
            p -= h.lr * h.wd * p;
            g
        } else {
            g + h.wd * p
        };
        let (m1, v1) = (h.b1 * m0 + (1.0 - h.b1) * dd, h.b2 * v0 + (1.0 - h.b2) * dd * dd);
        let r = p - h.lr * (m1 / (1.0 - h.b1.powf(h.t))) / ((v1 / (1.0 - h.b2.powf(h.t))).sqrt() + h.eps);
        m.set(po, i, d, r);
        m.set(mo, i, d, m1);
        m.set(vo, i, d, v1);
        store_low(m, low, i, po, d);
    }
}

/// An update's low-precision copy, from its trailing `low_out, low, low_code` arguments: the two
/// buffers and the copy's dtype, or None for code 0.
pub(crate) fn low_copy_of(a: &[Arg]) -> Option<(Buf, Buf, DType)> {
    let dt = match a[2] {
        Arg::I32(0) => return None,
        Arg::I32(1) => DType::F16,
        Arg::I32(2) => DType::BF16,
        ref c => panic!("low_code {c:?}"),
    };
    Some((ptr(&a[0]), ptr(&a[1]), dt))
}

/// A skipped update keeps the copy.
fn keep_low(m: &mut Memory, low: Option<(Buf, Buf, DType)>, i: i64) {
    if let Some((out, inp, dt)) = low {
        let v = m.get(inp, i, dt);
        m.set(out, i, dt, v);
    }
}

/// The copy of the parameter just stored at `po`, rounded to the copy's dtype.
fn store_low(m: &mut Memory, low: Option<(Buf, Buf, DType)>, i: i64, po: Buf, d: DType) {
    if let Some((out, _, dt)) = low {
        let v = m.get(po, i, d);
        m.set(out, i, dt, v);
    }
}

/// An update's `inv_scale` argument: the f32 it points at, or 1.
pub(crate) fn unscale_of(m: &mut Memory, a: &Arg) -> f64 {
    match *a {
        Arg::Ptr(b) => m.get(b, 0, DType::F32),
        _ => 1.0,
    }
}

/// Runs `k` when it is a training kernel; false for any other.
pub(crate) fn run_train(m: &mut Memory, k: &Kernel) -> bool {
    let a = &k.args;
    let name = k.name.as_str();
    let tag = name.rsplit('_').next().unwrap();
    if name.starts_with("train_relu_grad_") {
        let d = dtype_of(tag);
        let (dy, y, dx, n) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]));
        for i in 0..n {
            let r = if m.get(y, i, d) > 0.0 { m.get(dy, i, d) } else { 0.0 };
            m.set(dx, i, d, r);
        }
    } else if name == "train_all_finite_multi" {
        let Buf::Aux(at) = ptr(&a[0]) else { panic!("the address array is not in aux") };
        let (sizes, codes, tensor_of, start_of) = (ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]));
        let (chunks, chunk, f) = (int(&a[5]), int(&a[6]), ptr(&a[7]));
        // Chunk by chunk, as the kernel reads them: elements no chunk covers are not checked.
        for c in 0..chunks {
            let t = m.get(tensor_of, c, DType::I32) as i64;
            let x = m.addresses[&(at + 8 * t as u64)];
            let s = m.get(start_of, c, DType::I64) as i64;
            let e = (s + chunk).min(m.get(sizes, t, DType::I64) as i64);
            let d = match m.get(codes, t, DType::I32) as i64 {
                0 => DType::F32,
                1 => DType::F16,
                2 => DType::BF16,
                3 => DType::F64,
                _ => continue,
            };
            if (s..e).any(|i| !m.get(x, i, d).is_finite()) {
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
        let (n, lr) = (int(&a[7]), rate(m, &a[8], &a[9]));
        let (mom, wd, nesterov) = (f32_of(&a[10]), f32_of(&a[11]), int(&a[12]) != 0);
        let ok = m.get(finite, 0, DType::U8) != 0.0;
        let low = low_copy_of(&a[13..16]);
        for i in 0..n {
            let p = m.get(param, i, d);
            if !ok {
                m.set(po, i, d, p);
                keep_low(m, low, i);
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
            store_low(m, low, i, po, d);
        }
    } else if name.starts_with("train_adam_multi_") {
        // train_adam_multi_<param>(ptrs, sizes, codes, chunk_tensor, chunk_start, chunks, chunk,
        //     inv_scale, step, finite, lr, beta1, beta2, eps, wd, decoupled): each tensor's chunks
        // must cover it exactly once, in order; each tensor is then train_adam_'s update.
        let d = dtype_of(tag);
        let Buf::Aux(at) = ptr(&a[0]) else { panic!("the address table is not in aux") };
        let (sizes, codes, ct, cs) = (ptr(&a[1]), ptr(&a[2]), ptr(&a[3]), ptr(&a[4]));
        let (chunks, chunk) = (int(&a[5]), int(&a[6]));
        let h = adam_hyper(m, &a[10..17], &a[7], ptr(&a[8]), ptr(&a[9]));
        let count = (0..chunks).map(|c| m.get(ct, c, DType::I32) as i64).max().unwrap_or(-1) + 1;
        let mut next = vec![0i64; count as usize];
        for c in 0..chunks {
            let (k, s) = (m.get(ct, c, DType::I32) as usize, m.get(cs, c, DType::I64) as i64);
            assert_eq!(s, next[k], "chunk {c} of tensor {k} starts at {s}");
            next[k] = s + chunk;
        }
        for k in 0..count {
            let n = m.get(sizes, k, DType::I64) as i64;
            assert!(next[k as usize] >= n && next[k as usize] - chunk < n.max(1), "tensor {k}'s chunks");
            let addresses = m.addresses.clone();
            let p = |j: i64| addresses.get(&(at + 8 * (9 * k + j) as u64)).copied();
            let bufs = [0, 1, 2, 3, 4, 5, 6].map(|j| p(j).expect("a tensor address"));
            let dg = match m.get(codes, 2 * k, DType::I32) as i64 {
                0 => DType::F32,
                1 => DType::F16,
                2 => DType::BF16,
                _ => DType::F64,
            };
            let low = match (p(8), p(7), m.get(codes, 2 * k + 1, DType::I32) as i64) {
                (Some(out), Some(inp), 1) => Some((out, inp, DType::F16)),
                (Some(out), Some(inp), 2) => Some((out, inp, DType::BF16)),
                (None, None, 0) => None,
                l => panic!("tensor {k}'s low copy {l:?}"),
            };
            adam_tensor(m, &h, bufs, (d, dg), n, low);
        }
    } else if name.starts_with("train_adam_") {
        // train_adam_<param>_<grad>(param, grad, inv_scale, m, v, step, finite, param', m', v', ...)
        let (d, dg) = update_dtypes(name);
        let (param, grad, mm, vv, step, finite) =
            (ptr(&a[0]), ptr(&a[1]), ptr(&a[3]), ptr(&a[4]), ptr(&a[5]), ptr(&a[6]));
        let (po, mo, vo, n) = (ptr(&a[7]), ptr(&a[8]), ptr(&a[9]), int(&a[10]));
        let h = adam_hyper(m, &a[11..18], &a[2], step, finite);
        adam_tensor(m, &h, [param, grad, mm, vv, po, mo, vo], (d, dg), n, low_copy_of(&a[18..21]));
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
    } else if name.starts_with("train_gelu_grad_") {
        let d = dtype_of(tag);
        let (dy, x, dx, n, tanh) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]), int(&a[3]), int(&a[4]) != 0);
        if int(&a[5]) != 0 {
            // 16 bytes at a time: whole units, every tensor on a 16-byte boundary.
            let aligned = |b: Buf| matches!(b, Buf::Tensor(_, o) if o % 16 == 0);
            assert!(n % (16 / d.size() as i64) == 0 && [dy, x, dx].into_iter().all(aligned), "{name}");
        }
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
    } else if name == "train_lr_schedule" {
        // train_lr_schedule(step, peak, lr, kind, warmup, total, min_ratio, start_ratio,
        //     step_size, gamma): the CPU's formula, from the arguments.
        let (step, peak, lr) = (ptr(&a[0]), ptr(&a[1]), ptr(&a[2]));
        use mpc_ir::ops::LrKind;
        let kinds = [LrKind::Constant, LrKind::Linear, LrKind::Cosine, LrKind::Step, LrKind::OneCycle];
        let kind = kinds[int(&a[3]) as usize];
        let attrs = mpc_ir::ops::LrScheduleAttrs {
            kind,
            warmup: int(&a[4]),
            total: int(&a[5]),
            min_ratio: f32_of(&a[6]) as f32,
            start_ratio: f32_of(&a[7]) as f32,
            step_size: int(&a[8]),
            gamma: f32_of(&a[9]) as f32,
        };
        let r = mpc_runtime::scheduled_rate(&attrs, m.get(step, 0, DType::I64) as i64, m.get(peak, 0, DType::F32));
        m.set(lr, 0, DType::F32, r as f32 as f64);
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
        return false;
    }
    true
}
