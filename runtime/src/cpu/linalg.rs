//! Matrix products through matrixmultiply (f32 accumulation for f32/f16/bf16, f64 for f64;
//! multi-threaded), integer products in i64.

use super::{err, Res};
use crate::value::{Data, HostTensor};

/// `$name`: C[m×n] = A[m×k] · B[k×n] with arbitrary strides, through matrixmultiply's `$kernel`
/// (row-major C, beta 0).
macro_rules! gemm {
    ($name:ident, $t:ty, $kernel:path) => {
        #[allow(clippy::too_many_arguments)]
        fn $name(
            m: usize,
            k: usize,
            n: usize,
            a: &[$t],
            rsa: isize,
            csa: isize,
            b: &[$t],
            rsb: isize,
            csb: isize,
            c: &mut [$t],
        ) {
            if m == 0 || n == 0 {
                return;
            }
            // SAFETY: the strides and dimensions describe matrices inside `a`, `b` and `c`, which
            // the callers size as m×k, k×n and m×n.
            unsafe {
                $kernel(m, k, n, 1.0, a.as_ptr(), rsa, csa, b.as_ptr(), rsb, csb, 0.0, c.as_mut_ptr(), n as isize, 1);
            }
        }
    };
}
gemm!(gemm_f32, f32, matrixmultiply::sgemm);
gemm!(gemm_f64, f64, matrixmultiply::dgemm);

/// Float or integer matrix data in the compute type, borrowed when it already is.
enum Mat<'a> {
    F32(std::borrow::Cow<'a, [f32]>),
    F64(std::borrow::Cow<'a, [f64]>),
    I64(Vec<i64>),
}

fn widen(t: &HostTensor) -> Mat<'_> {
    use std::borrow::Cow;
    match &t.data {
        Data::F32(v) => Mat::F32(Cow::Borrowed(v)),
        Data::F64(v) => Mat::F64(Cow::Borrowed(v)),
        _ => match t.f32s() {
            Some(v) => Mat::F32(Cow::Owned(v)),
            None => Mat::I64(t.i64s().unwrap_or_default()),
        },
    }
}

/// The shape of one product: m×k · k×n, either operand possibly transposed.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    k: usize,
    n: usize,
    ta: bool,
    tb: bool,
}

/// Batched products: pairs of (offset into a, offset into b), each m×k · k×n.
fn products(a: &Mat, b: &Mat, pairs: &[(usize, usize)], d: Dims) -> Mat<'static> {
    let Dims { m, k, n, ta, tb } = d;
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    match (a, b) {
        (Mat::F32(a), Mat::F32(b)) => {
            let mut c = vec![0f32; pairs.len() * m * n];
            for (i, &(oa, ob)) in pairs.iter().enumerate() {
                gemm_f32(m, k, n, &a[oa..], rsa, csa, &b[ob..], rsb, csb, &mut c[i * m * n..(i + 1) * m * n]);
            }
            Mat::F32(c.into())
        }
        (Mat::F64(a), Mat::F64(b)) => {
            let mut c = vec![0f64; pairs.len() * m * n];
            for (i, &(oa, ob)) in pairs.iter().enumerate() {
                gemm_f64(m, k, n, &a[oa..], rsa, csa, &b[ob..], rsb, csb, &mut c[i * m * n..(i + 1) * m * n]);
            }
            Mat::F64(c.into())
        }
        (a, b) => {
            let geti = |m: &Mat, i: usize| match m {
                Mat::I64(v) => v[i],
                Mat::F32(v) => v[i] as i64,
                Mat::F64(v) => v[i] as i64,
            };
            let mut c = vec![0i64; pairs.len() * m * n];
            for (p, &(oa, ob)) in pairs.iter().enumerate() {
                for i in 0..m {
                    for j in 0..n {
                        let mut s = 0i64;
                        for l in 0..k {
                            let ai = oa + (i as isize * rsa + l as isize * csa) as usize;
                            let bi = ob + (l as isize * rsb + j as isize * csb) as usize;
                            s = s.wrapping_add(geti(a, ai).wrapping_mul(geti(b, bi)));
                        }
                        c[p * m * n + i * n + j] = s;
                    }
                }
            }
            Mat::I64(c)
        }
    }
}

fn store(m: Mat, like: &HostTensor, shape: Vec<usize>) -> HostTensor {
    match m {
        Mat::F32(v) => HostTensor::from_f32(like.dtype(), shape, v.into_owned()),
        Mat::F64(v) => HostTensor { shape, data: Data::F64(v.into_owned().into()) },
        Mat::I64(v) => HostTensor::from_i64(like.dtype(), shape, v),
    }
}

/// numpy matmul: 1-D operands are promoted and the added dim removed; batch dims broadcast.
pub(crate) fn matmul(a: &HostTensor, b: &HostTensor) -> Res<HostTensor> {
    let a_shape = if a.shape.len() == 1 { vec![1, a.shape[0]] } else { a.shape.clone() };
    let b_shape = if b.shape.len() == 1 { vec![b.shape[0], 1] } else { b.shape.clone() };
    let (ar, br) = (a_shape.len(), b_shape.len());
    let (m, k, k2, n) = (a_shape[ar - 2], a_shape[ar - 1], b_shape[br - 2], b_shape[br - 1]);
    if k != k2 {
        return Err(err(format!("MatMul inner dimensions differ: {:?} and {:?}", a.shape, b.shape)));
    }
    let batch = super::elementwise::broadcast_shape(&[&a_shape[..ar - 2], &b_shape[..br - 2]])
        .ok_or_else(|| err(format!("MatMul batch dims do not broadcast: {:?} and {:?}", a.shape, b.shape)))?;
    let ia = super::elementwise::broadcast_index(&a_shape[..ar - 2], &batch);
    let ib = super::elementwise::broadcast_index(&b_shape[..br - 2], &batch);
    let pairs: Vec<(usize, usize)> = ia.iter().zip(&ib).map(|(&i, &j)| (i * m * k, j * k * n)).collect();
    let c = products(&widen(a), &widen(b), &pairs, Dims { m, k, n, ta: false, tb: false });
    let mut shape = batch;
    if a.shape.len() > 1 {
        shape.push(m);
    }
    if b.shape.len() > 1 {
        shape.push(n);
    }
    Ok(store(c, a, shape))
}

/// The f32 Gemm into `out` (m×n, row-major): C starts as the bias broadcast to [m, n] (or zeros)
/// and sgemm applies alpha and beta itself. The reference kernel and the in-place launch
/// ([`super::views`]) both come here.
pub(crate) fn gemm_f32_into(
    out: &mut [f32],
    av: &[f32],
    bv: &[f32],
    bias: Option<(&[f32], &[usize])>,
    (m, k, n): (usize, usize, usize),
    (ta, tb): (bool, bool),
    (alpha, beta): (f32, f32),
) {
    let mut cbeta = 0.0;
    match bias {
        Some((v, shape)) => {
            if shape.last() == Some(&n) && v.len() == n {
                out.chunks_mut(n.max(1)).for_each(|row| row.copy_from_slice(v));
            } else {
                let idx = super::elementwise::broadcast_index(shape, &[m, n]);
                out.iter_mut().zip(idx).for_each(|(o, i)| *o = v[i]);
            }
            cbeta = beta;
        }
        None => out.fill(0.0),
    }
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    if m > 0 && n > 0 {
        // SAFETY: `av` is k×m or m×k, `bv` k×n or n×k, `out` m×n, as the strides say.
        unsafe {
            matrixmultiply::sgemm(
                m,
                k,
                n,
                alpha,
                av.as_ptr(),
                rsa,
                csa,
                bv.as_ptr(),
                rsb,
                csb,
                cbeta,
                out.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    }
}

/// The f32 MatMul of operands of rank 2 or more into `out` (of `out_shape`), batch dims
/// broadcast, one product per batch as [`matmul`] computes it, an operand flagged transposed
/// being stored with its last two axes swapped; `false` when the shapes do not fit (the caller
/// reports it through the reference kernel).
pub(crate) fn matmul_f32_into(
    out: &mut [f32],
    out_shape: &[usize],
    (av, a_shape, ta): (&[f32], &[usize], bool),
    (bv, b_shape, tb): (&[f32], &[usize], bool),
) -> bool {
    let (ar, br) = (a_shape.len(), b_shape.len());
    // A transposed operand is stored with its last two axes swapped.
    let (m, k) = if ta { (a_shape[ar - 1], a_shape[ar - 2]) } else { (a_shape[ar - 2], a_shape[ar - 1]) };
    let (k2, n) = if tb { (b_shape[br - 1], b_shape[br - 2]) } else { (b_shape[br - 2], b_shape[br - 1]) };
    let Some(batch) = super::elementwise::broadcast_shape(&[&a_shape[..ar - 2], &b_shape[..br - 2]]) else {
        return false;
    };
    if k != k2 || out_shape.len() != batch.len() + 2 || out_shape[..batch.len()] != batch[..] {
        return false;
    }
    if out_shape[batch.len()..] != [m, n] {
        return false;
    }
    let ia = super::elementwise::broadcast_index(&a_shape[..ar - 2], &batch);
    let ib = super::elementwise::broadcast_index(&b_shape[..br - 2], &batch);
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    out.fill(0.0);
    for (i, (&x, &y)) in ia.iter().zip(&ib).enumerate() {
        gemm_f32(m, k, n, &av[x * m * k..], rsa, csa, &bv[y * k * n..], rsb, csb, &mut out[i * m * n..(i + 1) * m * n]);
    }
    true
}

/// Gemm: alpha · op(A) · op(B) + beta · C, with C broadcast to [M, N].
pub(crate) fn gemm(
    a: &HostTensor,
    b: &HostTensor,
    c: Option<&HostTensor>,
    alpha: f32,
    beta: f32,
    ta: bool,
    tb: bool,
) -> Res<HostTensor> {
    if a.shape.len() != 2 || b.shape.len() != 2 {
        return Err(err("Gemm needs 2-D inputs"));
    }
    let (m, k) = if ta { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
    let (k2, n) = if tb { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
    if k != k2 {
        return Err(err(format!("Gemm inner dimensions differ: {k} and {k2}")));
    }
    // f32 (and f16/bf16): C starts as the broadcast bias and sgemm applies alpha and beta itself.
    if let (Mat::F32(av), Mat::F32(bv)) = (widen(a), widen(b)) {
        let mut out = vec![0f32; m * n];
        let cv = c.map(|c| c.f32s().unwrap_or_else(|| c.f64s().into_iter().map(|x| x as f32).collect()));
        let bias = c.zip(cv.as_deref()).map(|(c, v)| (v, c.shape.as_slice()));
        gemm_f32_into(&mut out, &av, &bv, bias, (m, k, n), (ta, tb), (alpha, beta));
        return Ok(HostTensor::from_f32(a.dtype(), vec![m, n], out));
    }
    let prod = products(&widen(a), &widen(b), &[(0, 0)], Dims { m, k, n, ta, tb });
    // The bias broadcast to [m, n]: a row vector (the usual case) indexes by column.
    let bias: Option<Vec<f64>> = c.map(|c| {
        let v = c.f64s();
        if c.shape.iter().product::<usize>() == n && c.shape.last() == Some(&n) {
            (0..m * n).map(|i| v[i % n]).collect()
        } else {
            super::elementwise::broadcast_index(&c.shape, &[m, n]).into_iter().map(|i| v[i]).collect()
        }
    });
    let out = match prod {
        Mat::F32(v) => {
            let mut v = v.into_owned();
            for (i, x) in v.iter_mut().enumerate() {
                *x = alpha * *x + bias.as_ref().map_or(0.0, |b| beta * b[i] as f32);
            }
            Mat::F32(v.into())
        }
        Mat::F64(v) => Mat::F64(
            v.iter()
                .enumerate()
                .map(|(i, x)| alpha as f64 * x + bias.as_ref().map_or(0.0, |b| beta as f64 * b[i]))
                .collect(),
        ),
        Mat::I64(v) => Mat::I64(
            v.into_iter()
                .enumerate()
                .map(|(i, x)| (alpha as i64) * x + bias.as_ref().map_or(0, |b| (beta as f64 * b[i]) as i64))
                .collect(),
        ),
    };
    Ok(store(out, a, vec![m, n]))
}

/// Conv as im2col + GEMM per image and group, accumulating in f32 (f64 for f64 inputs).
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv(
    x: &HostTensor,
    w: &HostTensor,
    bias: Option<&HostTensor>,
    pads: &[usize],
    strides: &[usize],
    dilations: &[usize],
    group: usize,
    out_spatial: &[usize],
) -> Res<HostTensor> {
    let (nb, cin) = (x.shape[0], x.shape[1]);
    let cout = w.shape[0];
    let cg = cin / group;
    let og = cout / group;
    let kernel: Vec<usize> = w.shape[2..].to_vec();
    let kvol: usize = kernel.iter().product();
    let ovol: usize = out_spatial.iter().product();
    let in_spatial = &x.shape[2..];
    let ivol: usize = in_spatial.iter().product();
    let (Some(xv), Some(wv)) = (x.f32s(), w.f32s()) else {
        return Err(err(format!("Conv on {} is not supported (f32, f16, bf16)", x.dtype())));
    };
    let src = super::window_offsets(in_spatial, &kernel, pads, strides, dilations, out_spatial);
    let bias_v = bias.map(|b| b.f64s());
    let mut out = vec![0f32; nb * cout * ovol];
    // Images side by side in one column matrix [cg·kvol, images·ovol], one GEMM per chunk of
    // images and group; chunks keep the column matrix to about 8M floats.
    let rows = cg * kvol;
    let chunk = (8usize << 20).checked_div(rows * ovol).unwrap_or(1).clamp(1, nb.max(1));
    let mut cols = vec![0f32; rows * chunk * ovol];
    let mut tmp = vec![0f32; og * chunk * ovol];
    for b0 in (0..nb).step_by(chunk) {
        let imgs = chunk.min(nb - b0);
        let width = imgs * ovol;
        for g in 0..group {
            for c in 0..cg {
                for kp in 0..kvol {
                    let row = &mut cols[(c * kvol + kp) * width..(c * kvol + kp + 1) * width];
                    let taps = &src[kp * ovol..(kp + 1) * ovol];
                    for i in 0..imgs {
                        let base = ((b0 + i) * cin + g * cg + c) * ivol;
                        for (slot, tap) in row[i * ovol..(i + 1) * ovol].iter_mut().zip(taps) {
                            *slot = tap.map_or(0.0, |o| xv[base + o]);
                        }
                    }
                }
            }
            let wg = &wv[g * og * rows..(g + 1) * og * rows];
            gemm_f32(
                og,
                rows,
                width,
                wg,
                rows as isize,
                1,
                &cols[..rows * width],
                width as isize,
                1,
                &mut tmp[..og * width],
            );
            for o in 0..og {
                for i in 0..imgs {
                    let dst = ((b0 + i) * cout + g * og + o) * ovol;
                    out[dst..dst + ovol].copy_from_slice(&tmp[o * width + i * ovol..o * width + (i + 1) * ovol]);
                }
            }
        }
    }
    if let Some(bv) = bias_v {
        // One constant per (image, channel) plane.
        for (p, plane) in out.chunks_mut(ovol.max(1)).enumerate() {
            let b = bv[p % cout] as f32;
            plane.iter_mut().for_each(|v| *v += b);
        }
    }
    let mut shape = vec![nb, cout];
    shape.extend(out_spatial);
    Ok(HostTensor::from_f32(x.dtype(), shape, out))
}
