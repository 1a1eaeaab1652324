//! `ai.mpc::Attention` and `ai.mpc::AttentionGrad`: scaled dot-product attention computed row by
//! row from Q, K, V (and an additive mask), keeping only each row's log-sum-exp, as a fused
//! (flash) attention kernel does. The reference the CUDA kernels are checked against.

use std::borrow::Cow;

use mpc_ir::ops::AttentionLayout;
use mpc_ir::{DType, Op};

use super::{err, floats, permute, store, Res};
use crate::value::HostTensor;

/// Attention or AttentionGrad on `ins`: under the `bshd` layout the operands are read as
/// [B, H, S, D] (their axes 1 and 2 swapped) and the results written back as [B, S, H, D].
pub(crate) fn run(op: &Op, ins: &[Option<&HostTensor>]) -> Res<Vec<HostTensor>> {
    let (Op::Attention(a) | Op::AttentionGrad(a)) = op else { return Err(err("not an attention")) };
    let x = |i: usize| ins.get(i).copied().flatten().ok_or_else(|| err(format!("missing input {i}")));
    let bshd = a.layout == AttentionLayout::Bshd;
    if bshd && (0..3).any(|i| x(i).is_ok_and(|t| t.shape.len() != 4)) {
        return Err(err("a bshd attention of operands other than rank 4"));
    }
    const SWAP: [usize; 4] = [0, 2, 1, 3];
    fn heads_first(t: &HostTensor, bshd: bool) -> Cow<'_, HostTensor> {
        if bshd {
            Cow::Owned(permute(t, &SWAP))
        } else {
            Cow::Borrowed(t)
        }
    }
    let grad = matches!(op, Op::AttentionGrad(_));
    // Every operand but the log-sum-exp and the mask is [.., S, D] (swapped under bshd).
    let n = if grad { 5 } else { 3 };
    let ops: Vec<Cow<HostTensor>> = (0..n).map(|i| x(i).map(|t| heads_first(t, bshd))).collect::<Res<_>>()?;
    let mask = ins.get(if grad { 6 } else { 3 }).copied().flatten();
    let mut outs = if grad {
        attention_grad(&ops[0], &ops[1], &ops[2], &ops[3], &ops[4], x(5)?, mask, a.scale)?
    } else {
        attention(&ops[0], &ops[1], &ops[2], mask, a.scale)?
    };
    let swapped = if grad { 3 } else { 1 };
    for t in outs.iter_mut().take(swapped).filter(|_| bshd) {
        *t = permute(t, &SWAP);
    }
    Ok(outs)
}

/// The operands' sizes: `n` rows of leading dims, `sq` queries, `sk` keys, head dim `d`.
struct Dims {
    n: usize,
    sq: usize,
    sk: usize,
    d: usize,
}

fn dims(q: &HostTensor, k: &HostTensor, v: &HostTensor) -> Res<Dims> {
    let r = q.shape.len();
    let lead = |t: &HostTensor| t.shape.get(..r.saturating_sub(2)).map(|s| s.to_vec());
    // Q [..., sq, d], K and V [..., sk, d] (the last two dims of K and V the same).
    let fits = r >= 3 && k.shape.len() == r && v.shape.len() == r && lead(k) == lead(q) && lead(v) == lead(q);
    if !fits || k.shape[r - 1] != q.shape[r - 1] || v.shape[r - 2..] != k.shape[r - 2..] {
        return Err(err(format!("Attention of Q {:?}, K {:?}, V {:?}", q.shape, k.shape, v.shape)));
    }
    let (sq, d, sk) = (q.shape[r - 2], q.shape[r - 1], k.shape[r - 2]);
    Ok(Dims { n: q.shape[..r - 2].iter().product(), sq, sk, d })
}

/// The mask's values, read where they broadcast to the scores [..., sq, sk]: element (at, i, j) of
/// the scores reads `v[base[at] + i·si + j·sj]` (never expanded: at GPT's size that would be
/// 200 MB of f64).
struct Mask {
    v: Vec<f64>,
    base: Vec<usize>,
    si: usize,
    sj: usize,
}

impl Mask {
    fn at(&self, at: usize, i: usize, j: usize) -> f64 {
        self.v[self.base[at] + i * self.si + j * self.sj]
    }
}

fn mask_values(mask: Option<&HostTensor>, q: &HostTensor, sk: usize) -> Res<Option<Mask>> {
    let Some(m) = mask else { return Ok(None) };
    let mut scores = q.shape.clone();
    *scores.last_mut().expect("rank checked") = sk;
    let fits =
        m.shape.len() <= scores.len() && m.shape.iter().rev().zip(scores.iter().rev()).all(|(&a, &b)| a == 1 || a == b);
    if !fits {
        return Err(err(format!("the mask {:?} does not broadcast to the scores {scores:?}", m.shape)));
    }
    let r = scores.len();
    let strides = mpc_ir::geometry::broadcast_strides(&m.shape, &scores);
    // Each leading position's offset, in row-major order of the scores' leading dims.
    let mut base = vec![0usize];
    for (&n, &st) in scores[..r - 2].iter().zip(&strides[..r - 2]) {
        base = base.iter().flat_map(|&o| (0..n).map(move |x| o + x * st)).collect();
    }
    Ok(Some(Mask { v: floats(m, "the mask")?, base, si: strides[r - 2], sj: strides[r - 1] }))
}

/// Row `i` of matrix `at` of a [n, rows, d] array.
fn row(x: &[f64], at: usize, rows: usize, i: usize, d: usize) -> &[f64] {
    &x[(at * rows + i) * d..][..d]
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Row `i`'s scores `scale · q_i·k_j + mask_ij` of matrix `at`.
fn scores(q: &[f64], k: &[f64], mask: Option<&Mask>, x: &Dims, at: usize, i: usize, scale: f64) -> Vec<f64> {
    let qi = row(q, at, x.sq, i, x.d);
    (0..x.sk).map(|j| scale * dot(qi, row(k, at, x.sk, j, x.d)) + mask.map_or(0.0, |m| m.at(at, i, j))).collect()
}

/// Attention(Q, K, V, mask) → (Y, LSE; f32, f64 for f64 operands): s_ij = scale · q_i·k_j + mask_ij, y_i = Σ_j softmax(s_i)_j v_j,
/// lse_i = log Σ_j exp(s_ij). A row whose scores are all −∞ gives y_i = 0 and lse_i = −∞.
pub(crate) fn attention(
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    mask: Option<&HostTensor>,
    scale: f32,
) -> Res<Vec<HostTensor>> {
    let x = dims(q, k, v)?;
    let mask = mask_values(mask, q, x.sk)?;
    let (qv, kv, vv) = (floats(q, "Q")?, floats(k, "K")?, floats(v, "V")?);
    let mut y = vec![0f64; x.n * x.sq * x.d];
    let mut lse = vec![0f64; x.n * x.sq];
    for at in 0..x.n {
        for i in 0..x.sq {
            let s = scores(&qv, &kv, mask.as_ref(), &x, at, i, scale as f64);
            let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let out = &mut y[(at * x.sq + i) * x.d..][..x.d];
            if m == f64::NEG_INFINITY {
                lse[at * x.sq + i] = f64::NEG_INFINITY;
                continue;
            }
            let mut l = 0.0;
            for (j, &sj) in s.iter().enumerate() {
                let p = (sj - m).exp();
                l += p;
                for (o, vj) in out.iter_mut().zip(row(&vv, at, x.sk, j, x.d)) {
                    *o += p * vj;
                }
            }
            out.iter_mut().for_each(|o| *o /= l);
            lse[at * x.sq + i] = m + l.ln();
        }
    }
    let lse_shape = q.shape[..q.shape.len() - 1].to_vec();
    let lse_dt = if q.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
    Ok(vec![store(q, q.shape.clone(), y), HostTensor::from_f64(lse_dt, lse_shape, lse)])
}

/// AttentionGrad(dY, Q, K, V, Y, LSE, mask) → (dQ, dK, dV), with p_ij = exp(s_ij − lse_i) (0 where
/// lse_i = −∞), δ_i = dy_i·y_i and ds_ij = p_ij (dy_i·v_j − δ_i): dQ_i = scale Σ_j ds_ij k_j,
/// dK_j = scale Σ_i ds_ij q_i, dV_j = Σ_i p_ij dy_i.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_grad(
    dy: &HostTensor,
    q: &HostTensor,
    k: &HostTensor,
    v: &HostTensor,
    y: &HostTensor,
    lse: &HostTensor,
    mask: Option<&HostTensor>,
    scale: f32,
) -> Res<Vec<HostTensor>> {
    let x = dims(q, k, v)?;
    if dy.shape != q.shape || y.shape != q.shape || lse.shape[..] != q.shape[..q.shape.len() - 1] {
        return Err(err(format!(
            "AttentionGrad of dY {:?}, Y {:?}, LSE {:?} for Q {:?}",
            dy.shape, y.shape, lse.shape, q.shape
        )));
    }
    let mask = mask_values(mask, q, x.sk)?;
    let (qv, kv, vv) = (floats(q, "Q")?, floats(k, "K")?, floats(v, "V")?);
    let (dyv, yv, lv) = (floats(dy, "dY")?, floats(y, "Y")?, floats(lse, "LSE")?);
    let scale = scale as f64;
    let (mut dq, mut dk, mut dv) = (vec![0f64; qv.len()], vec![0f64; kv.len()], vec![0f64; vv.len()]);
    for at in 0..x.n {
        for i in 0..x.sq {
            let l = lv[at * x.sq + i];
            if l == f64::NEG_INFINITY {
                continue;
            }
            let s = scores(&qv, &kv, mask.as_ref(), &x, at, i, scale);
            let dyi = row(&dyv, at, x.sq, i, x.d);
            let delta = dot(dyi, row(&yv, at, x.sq, i, x.d));
            let qi = row(&qv, at, x.sq, i, x.d).to_vec();
            for (j, &sj) in s.iter().enumerate() {
                let p = (sj - l).exp();
                let vj = row(&vv, at, x.sk, j, x.d);
                let ds = p * (dot(dyi, vj) - delta);
                let kj = row(&kv, at, x.sk, j, x.d);
                let base = (at * x.sk + j) * x.d;
                for c in 0..x.d {
                    dq[(at * x.sq + i) * x.d + c] += scale * ds * kj[c];
                    dk[base + c] += scale * ds * qi[c];
                    dv[base + c] += p * dyi[c];
                }
            }
        }
    }
    Ok(vec![store(q, q.shape.clone(), dq), store(k, k.shape.clone(), dk), store(v, v.shape.clone(), dv)])
}
