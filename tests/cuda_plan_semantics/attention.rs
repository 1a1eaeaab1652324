//! The interpreter of the fused attention kernels (kernels/attention.cu), from their ABI: each
//! operand addressed by its (batch, head, row) strides, the arithmetic in f64.

use mpc_ir::DType;
use mpc_runtime::cuda::plan::{Arg, Buf, Kernel};

use super::interp::*;

fn longs<const N: usize>(a: &Arg) -> [i64; N] {
    match (a, N) {
        (Arg::Longs3(v), 3) => v[..].try_into().unwrap(),
        (Arg::Longs5(v), 5) => v[..].try_into().unwrap(),
        (a, _) => panic!("{a:?} where {N} long longs were expected"),
    }
}

fn float(a: &Arg) -> f64 {
    match a {
        Arg::F32(v) => *v as f64,
        a => panic!("{a:?} where an f32 was expected"),
    }
}

/// One operand: its buffer and (batch, head, row) strides.
#[derive(Clone, Copy)]
struct At(Buf, [i64; 3]);

impl At {
    fn of(p: &Arg, s: &Arg) -> At {
        At(ptr(p), longs(s))
    }
    fn row(&self, m: &mut Memory, b: i64, h: i64, i: i64, d: i64, t: DType) -> Vec<f64> {
        let base = b * self.1[0] + h * self.1[1] + i * self.1[2];
        (0..d).map(|c| m.get(self.0, base + c, t)).collect()
    }
    fn put(&self, m: &mut Memory, b: i64, h: i64, i: i64, v: &[f64], t: DType) {
        let base = b * self.1[0] + h * self.1[1] + i * self.1[2];
        for (c, &x) in v.iter().enumerate() {
            m.set(self.0, base + c as i64, t, x);
        }
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// What the scores of a launch add: the mask (or none), and whether key j > i is masked.
#[derive(Clone, Copy)]
struct Masking {
    mask: Option<At>,
    causal: bool,
}

/// The scores of row `i` of (b, h): `scale · q_i·k_j + mask_ij`, −∞ for j > i when causal.
#[allow(clippy::too_many_arguments)]
fn scores(
    m: &mut Memory,
    q: At,
    k: At,
    masking: Masking,
    sh: [i64; 5],
    b: i64,
    h: i64,
    i: i64,
    scale: f64,
    t: DType,
) -> Vec<f64> {
    let qi = q.row(m, b, h, i, sh[4], t);
    (0..sh[3])
        .map(|j| {
            if masking.causal && j > i {
                return f64::NEG_INFINITY;
            }
            let kj = k.row(m, b, h, j, sh[4], t);
            let at = |mk: At| b * mk.1[0] + h * mk.1[1] + i * mk.1[2] + j;
            let mv = masking.mask.map_or(0.0, |mk| m.get(mk.0, at(mk), DType::F32));
            scale * dot(&qi, &kj) + mv
        })
        .collect()
}

/// Runs `k` if it is an attention kernel; whether it was.
pub(crate) fn run_attention(m: &mut Memory, k: &Kernel) -> bool {
    let Some(rest) = k.name.strip_prefix("attention_") else { return false };
    let a = &k.args;
    let t = dtype_of(rest.rsplit('_').next().unwrap());
    let mask_of = |p: &Arg, s: &Arg| (!matches!(p, Arg::Null)).then(|| At::of(p, s));
    if rest.starts_with("delta_") {
        let sh: [i64; 5] = longs(&a[3]);
        let (o, dout, delta) = (At::of(&a[0], &a[4]), At::of(&a[1], &a[5]), ptr(&a[2]));
        for (b, h, i) in rows(sh, sh[2]) {
            let v = dot(&o.row(m, b, h, i, sh[4], t), &dout.row(m, b, h, i, sh[4], t));
            m.set(delta, (b * sh[1] + h) * sh[2] + i, DType::F32, v);
        }
        return true;
    }
    let fwd = rest.starts_with("fwd_");
    // The shape, then the strides of Q, K, V, the mask, then dO's (backward) and the outputs'.
    let at = a.iter().position(|x| matches!(x, Arg::Longs5(_))).expect("the shape");
    let sh: [i64; 5] = longs(&a[at]);
    let s = at + 1;
    let (q, kk, v) = (At::of(&a[0], &a[s]), At::of(&a[1], &a[s + 1]), At::of(&a[2], &a[s + 2]));
    // ..., scale, causal.
    let masking = Masking { mask: mask_of(&a[3], &a[s + 3]), causal: int(&a[a.len() - 1]) != 0 };
    let scale = float(&a[a.len() - 2]);
    let d = sh[4];
    if fwd {
        let (o, lse) = (At::of(&a[4], &a[11]), ptr(&a[5]));
        for (b, h, i) in rows(sh, sh[2]) {
            let sc = scores(m, q, kk, masking, sh, b, h, i, scale, t);
            let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut out = vec![0f64; d as usize];
            let mut l = f64::NEG_INFINITY;
            if mx > f64::NEG_INFINITY {
                let mut sum = 0.0;
                for (j, &sj) in sc.iter().enumerate() {
                    let p = (sj - mx).exp();
                    sum += p;
                    let vj = v.row(m, b, h, j as i64, d, t);
                    out.iter_mut().zip(&vj).for_each(|(o, x)| *o += p * x);
                }
                out.iter_mut().for_each(|o| *o /= sum);
                l = mx + sum.ln();
            }
            o.put(m, b, h, i, &out, t);
            m.set(lse, (b * sh[1] + h) * sh[2] + i, DType::F32, l);
        }
        return true;
    }
    let (dout, lse, delta) = (At::of(&a[4], &a[s + 4]), ptr(&a[5]), ptr(&a[6]));
    // P_ij and dS_ij of row i against every key.
    let probs = |m: &mut Memory, b: i64, h: i64, i: i64| -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let l = m.get(lse, (b * sh[1] + h) * sh[2] + i, DType::F32);
        let dl = m.get(delta, (b * sh[1] + h) * sh[2] + i, DType::F32);
        let sc = scores(m, q, kk, masking, sh, b, h, i, scale, t);
        let doi = dout.row(m, b, h, i, d, t);
        let p: Vec<f64> = sc.iter().map(|&s| if l == f64::NEG_INFINITY { 0.0 } else { (s - l).exp() }).collect();
        let ds = (0..sh[3] as usize).map(|j| p[j] * (dot(&doi, &v.row(m, b, h, j as i64, d, t)) - dl)).collect();
        (p, ds, doi)
    };
    if rest.starts_with("bwd_dkdv_") {
        let (dk, dv) = (At::of(&a[7], &a[s + 5]), At::of(&a[8], &a[s + 6]));
        for (b, h, _) in rows(sh, 1) {
            let (mut gk, mut gv) = (vec![0f64; (sh[3] * d) as usize], vec![0f64; (sh[3] * d) as usize]);
            for i in 0..sh[2] {
                let (p, ds, doi) = probs(m, b, h, i);
                let qi = q.row(m, b, h, i, d, t);
                for j in 0..sh[3] as usize {
                    for c in 0..d as usize {
                        gv[j * d as usize + c] += p[j] * doi[c];
                        gk[j * d as usize + c] += scale * ds[j] * qi[c];
                    }
                }
            }
            for j in 0..sh[3] {
                let at = (j * d) as usize..((j + 1) * d) as usize;
                dk.put(m, b, h, j, &gk[at.clone()], t);
                dv.put(m, b, h, j, &gv[at], t);
            }
        }
    } else {
        let dq = At::of(&a[7], &a[s + 5]);
        for (b, h, i) in rows(sh, sh[2]) {
            let (_, ds, _) = probs(m, b, h, i);
            let mut g = vec![0f64; d as usize];
            for (j, &x) in ds.iter().enumerate() {
                let kj = kk.row(m, b, h, j as i64, d, t);
                g.iter_mut().zip(&kj).for_each(|(o, k)| *o += scale * x * k);
            }
            dq.put(m, b, h, i, &g, t);
        }
    }
    true
}

/// Every (batch, head, row) of `n` rows.
fn rows(sh: [i64; 5], n: i64) -> Vec<(i64, i64, i64)> {
    (0..sh[0]).flat_map(|b| (0..sh[1]).flat_map(move |h| (0..n).map(move |i| (b, h, i)))).collect()
}
