//! Plans of the fused attention and its gradient (kernels/attention.cu).

use mpc_ir::ops::AttentionLayout;

use super::*;

/// The head dims the kernels are compiled for: a launch takes the smallest at least `d`.
const HEAD_DIMS: [usize; 4] = [16, 32, 64, 128];

/// An operand of `[..., S, D]` as the kernels address it: all leading dims but the last are the
/// batch (one stride over them), the last the heads; strides in elements, D's 1.
struct Addressed {
    buf: Buf,
    /// (batch, heads), the rows and the head dim; the (batch, head, row) strides.
    batch: usize,
    heads: usize,
    seq: usize,
    d: usize,
    strides: [i64; 3],
}

/// One stride over `dims` (outermost first) with `strides`, where they collapse into one (each
/// stride the next one's times its extent; extents of 1 anywhere); 0 for no dims.
fn collapsed(dims: &[usize], strides: &[i64]) -> Option<i64> {
    let kept: Vec<(usize, i64)> = dims.iter().copied().zip(strides.iter().copied()).filter(|&(d, _)| d != 1).collect();
    for w in kept.windows(2) {
        if w[0].1 != w[1].1 * w[1].0 as i64 {
            return None;
        }
    }
    Some(kept.last().map_or(0, |&(_, s)| s))
}

/// Addresses `t` read as `shape` with element strides `strides` (D's must be 1); under the
/// `bshd` layout the shape is [B, S, H, D].
fn addressed(t: &TensorRef, shape: Vec<usize>, strides: Vec<i64>, bshd: bool, what: &str) -> Result<Addressed, String> {
    let r = shape.len();
    if r < 3 || bshd && r != 4 || strides[r - 1] != 1 && shape[r - 1] > 1 {
        return Err(format!("attention's {what} of shape {shape:?} is not read row by row"));
    }
    if bshd {
        return Ok(Addressed {
            buf: buf(t),
            batch: shape[0],
            heads: shape[2],
            strides: [strides[0], strides[2], strides[1]],
            seq: shape[1],
            d: shape[3],
        });
    }
    let batch_stride = collapsed(&shape[..r - 3], &strides[..r - 3])
        .ok_or_else(|| format!("attention's {what} of shape {shape:?}: its batch dims have no one stride"))?;
    Ok(Addressed {
        buf: buf(t),
        batch: shape[..r - 3].iter().product(),
        heads: shape[r - 3],
        strides: [batch_stride, strides[r - 3], strides[r - 2]],
        seq: shape[r - 2],
        d: shape[r - 1],
    })
}

/// Input `i`: stored, or read through its heads' Transpose ([`Operand::Permuted`]).
fn operand(p: &Planner, i: usize, bshd: bool, what: &str) -> Result<(Addressed, DType), String> {
    match p.l.inputs.get(i) {
        Some(Operand::Permuted(t, perm)) => {
            let stored = contiguous(&t.shape);
            let shape = perm.iter().map(|&a| t.shape[a]).collect();
            let strides = perm.iter().map(|&a| stored[a]).collect();
            Ok((addressed(t, shape, strides, bshd, what)?, t.dtype))
        }
        _ => {
            let t = p.input(i)?;
            Ok((addressed(t, t.shape.clone(), contiguous(&t.shape), bshd, what)?, t.dtype))
        }
    }
}

fn output(p: &Planner, i: usize, bshd: bool, what: &str) -> Result<(Addressed, DType), String> {
    let t = p.output(i)?;
    Ok((addressed(t, t.shape.clone(), contiguous(&t.shape), bshd, what)?, t.dtype))
}

/// Whether `m`, a constant mask over `[.., sq, sk]` (every other dim 1), is the causal one: 0
/// where key j ≤ query i, −∞ (or below −10³⁰, whose exponential is 0 as −∞'s) where j > i. The
/// kernels then skip the masked tiles and read no mask.
fn is_causal(m: &HostTensor, sq: usize, sk: usize) -> bool {
    let r = m.shape.len();
    if r < 2 || m.shape[r - 2..] != [sq, sk] || m.shape[..r - 2].iter().any(|&d| d != 1) {
        return false;
    }
    let v = m.f64s();
    (0..sq).all(|i| (0..sk).all(|j| if j > i { v[i * sk + j] < -1e30 } else { v[i * sk + j] == 0.0 }))
}

/// The mask at input `i` (f32, broadcast to the scores `[..., sq, sk]`, keys contiguous): its
/// pointer and (batch, head, row) strides, or a null pointer where there is none; and whether it
/// is the causal mask, which the kernels apply themselves (no pointer then).
fn mask(p: &Planner, i: usize, scores: &[usize]) -> Result<(Arg, [i64; 3], bool), String> {
    let m = match p.l.inputs.get(i) {
        None | Some(Operand::Absent) => return Ok((Arg::Null, [0; 3], false)),
        Some(Operand::Device(m)) => m,
        Some(_) => return Err("attention's mask is not a device tensor read as stored".into()),
    };
    let r = scores.len();
    if m.dtype != DType::F32 || m.shape.len() > r {
        return Err(format!("attention's mask is {}{:?}, not f32 of rank {r} at most", m.dtype, m.shape));
    }
    let mut shape = vec![1usize; r - m.shape.len()];
    shape.extend(&m.shape);
    let stored = contiguous(&shape);
    let strides: Vec<i64> = (0..r).map(|a| if shape[a] == 1 && scores[a] != 1 { 0 } else { stored[a] }).collect();
    let fits = shape.iter().zip(scores).all(|(&m, &s)| m == s || m == 1) && (scores[r - 1] == 1 || shape[r - 1] > 1);
    let batch = collapsed(&scores[..r - 3], &strides[..r - 3]).filter(|_| fits);
    let batch = batch.ok_or_else(|| format!("attention's mask {:?} for the scores {scores:?}", m.shape))?;
    if (p.constant)(m).is_some_and(|v| is_causal(&v, scores[r - 2], scores[r - 1])) {
        return Ok((Arg::Null, [0; 3], true));
    }
    Ok((Arg::Ptr(buf(m)), [batch, strides[r - 3], strides[r - 2]], false))
}

pub(super) fn plan_attention(p: &mut Planner) -> Result<(), String> {
    let (grad, a) = match &p.l.op {
        Op::Attention(a) => (false, a),
        Op::AttentionGrad(a) => (true, a),
        op => return Err(format!("{} is not attention", op.op_type())),
    };
    let (scale, bshd) = (a.scale, a.layout == AttentionLayout::Bshd);
    let at = usize::from(grad);
    let operand = |i: usize, what: &str| operand(p, i, bshd, what);
    let ((q, dt), (k, _), (v, _)) = (operand(at, "Q")?, operand(at + 1, "K")?, operand(at + 2, "V")?);
    let t = match dt {
        DType::F16 | DType::BF16 => tag(dt)?,
        d => return Err(format!("a fused attention in {d}: the kernels take f16 or bf16")),
    };
    let (sq, d, sk) = (q.seq, q.d, k.seq);
    let dp = HEAD_DIMS.into_iter().find(|&x| x >= d).ok_or_else(|| format!("a head dim of {d} (at most 128)"))?;
    let same = |x: &Addressed| (x.batch, x.heads, x.d) == (q.batch, q.heads, d);
    if !same(&k) || !same(&v) || v.seq != sk {
        return Err(format!(
            "attention of Q ({}, {}, {sq}, {d}), K ({}, {}, {sk}, {}) and V ({}, {}, {}, {})",
            q.batch, q.heads, k.batch, k.heads, k.d, v.batch, v.heads, v.seq, v.d
        ));
    }
    if sq >= 1 << 31 || sk >= 1 << 31 {
        return Err(format!("attention over {sq} queries and {sk} keys (the kernels take fewer than 2³¹)"));
    }
    // The scores' shape: the log-sum-exp's, then the keys.
    let mut scores = if grad { p.input(5)? } else { p.output(1)? }.shape.clone();
    scores.push(sk);
    let (mask, ms, causal) = mask(p, if grad { 6 } else { 3 }, &scores)?;
    let tail = [Arg::F32(scale), Arg::I32(causal.into())];
    let shape = Arg::Longs5([q.batch, q.heads, sq, sk, d].map(|x| x as i64));
    let bh = (q.batch * q.heads) as u64;
    // No rows: no blocks, and the launch is left out (the other kernel writes the zeros).
    let grid = |rows: usize| -> Result<Option<[u32; 3]>, String> {
        let blocks = (rows as u64).div_ceil(64) * bh;
        let b = u32::try_from(blocks).map_err(|_| format!("attention of {blocks} blocks"))?;
        Ok((b > 0).then_some([b, 1, 1]))
    };
    let (qkv, strides) = (
        [Arg::Ptr(q.buf), Arg::Ptr(k.buf), Arg::Ptr(v.buf), mask],
        [q.strides, k.strides, v.strides, ms].map(Arg::Longs3),
    );
    if !grad {
        let (o, _) = output(p, 0, bshd, "Y")?;
        let lse = p.output(1)?;
        let mut args = qkv.to_vec();
        args.extend([Arg::Ptr(o.buf), Arg::Ptr(buf(lse)), shape]);
        args.extend(strides);
        args.push(Arg::Longs3(o.strides));
        args.extend(tail);
        if let Some(g) = grid(sq)? {
            p.kernel("attention", format!("attention_fwd_d{dp}_{t}"), g, [128, 1, 1], args);
        }
        return Ok(());
    }
    let ((dy, _), (y, _)) = (operand(0, "dY")?, operand(4, "Y")?);
    let lse = Arg::Ptr(buf(p.input(5)?));
    let output = |i: usize, what: &str| output(p, i, bshd, what);
    let ((dq, _), (dk, _), (dv, _)) = (output(0, "dQ")?, output(1, "dK")?, output(2, "dV")?);
    let rows = bh * sq as u64;
    let delta = p.work(rows * 4);
    let delta_args = vec![
        Arg::Ptr(y.buf),
        Arg::Ptr(dy.buf),
        Arg::Ptr(delta),
        shape,
        Arg::Longs3(y.strides),
        Arg::Longs3(dy.strides),
    ];
    p.kernel(
        "attention",
        format!("attention_delta_{t}"),
        [rows.div_ceil(16).clamp(1, 65535) as u32, 1, 1],
        [256, 1, 1],
        delta_args,
    );
    let common = |outs: &[Buf]| {
        let mut args = qkv.to_vec();
        args.extend([Arg::Ptr(dy.buf), lse, Arg::Ptr(delta)]);
        args.extend(outs.iter().map(|&b| Arg::Ptr(b)));
        args.push(shape);
        args.extend(strides);
        args.push(Arg::Longs3(dy.strides));
        args
    };
    let mut args = common(&[dk.buf, dv.buf]);
    args.extend([Arg::Longs3(dk.strides), Arg::Longs3(dv.strides)]);
    args.extend(tail);
    if let Some(g) = grid(sk)? {
        p.kernel("attention", format!("attention_bwd_dkdv_d{dp}_{t}"), g, [128, 1, 1], args);
    }
    let mut args = common(&[dq.buf]);
    args.push(Arg::Longs3(dq.strides));
    args.extend(tail);
    if let Some(g) = grid(sq)? {
        p.kernel("attention", format!("attention_bwd_dq_d{dp}_{t}"), g, [128, 1, 1], args);
    }
    Ok(())
}
