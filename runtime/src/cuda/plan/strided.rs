//! Strided walks: dims merged where every operand walks them as one, the strided copy kernel's
//! arguments, and copies whose output is contiguous along another axis than the input's, in tiles.

use super::*;

/// The same walk over fewer dims: dims of size 1 dropped, and each dim merged into the next where
/// every operand steps over the two as over one (`s[d] == s[d + 1] * dims[d + 1]`). The kernels
/// divide an element's linear index once per dim: a bias row or a scalar broadcast over any
/// shape becomes one or two dims. Returns the dims and each operand's strides over them.
pub(super) fn coalesce(dims: &[usize], strides: &[&[i64]]) -> (Vec<i64>, Vec<Vec<i64>>) {
    let mut out: Vec<i64> = Vec::with_capacity(dims.len());
    let mut outs: Vec<Vec<i64>> = vec![Vec::with_capacity(dims.len()); strides.len()];
    for (d, &n) in dims.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let n = n as i64;
        let merge = !out.is_empty() && strides.iter().zip(&outs).all(|(s, o)| o[o.len() - 1] == s[d] * n);
        if merge {
            *out.last_mut().expect("a dim") *= n;
            for (s, o) in strides.iter().zip(outs.iter_mut()) {
                *o.last_mut().expect("a stride") = s[d];
            }
        } else {
            out.push(n);
            for (s, o) in strides.iter().zip(outs.iter_mut()) {
                o.push(s[d]);
            }
        }
    }
    (out, outs)
}

/// A strided copy as tiles (`movement_transpose_*`): the input's contiguous axis (rows) and the
/// output's (cols), their extents and other strides, and the remaining dims with both strides.
#[derive(Debug, PartialEq)]
pub(super) struct TiledTranspose {
    pub(super) rows: i64,
    pub(super) cols: i64,
    pub(super) x_col: i64,
    pub(super) y_row: i64,
    pub(super) batch: i64,
    pub(super) dims: Vec<i64>,
    pub(super) xs: Vec<i64>,
    pub(super) ys: Vec<i64>,
}

/// The tiles of a copy over `dims` whose output is contiguous along its last (coalesced) axis and
/// whose input is contiguous along another: a per-element copy would read each input element a
/// whole output row apart (a Transpose that moves the last axis, as attention's `kᵀ`).
pub(super) fn tiled_transpose(dims: &[usize], xs: &[i64], ys: &[i64]) -> Option<TiledTranspose> {
    let (d, s) = coalesce(dims, &[xs, ys]);
    let (xs, ys) = (&s[0], &s[1]);
    let c = d.len().checked_sub(1)?;
    let r = (0..c).find(|&r| xs[r] == 1)?;
    // At most 8 other dims (the kernel's Dims8), and a grid of at most 65535 row tiles.
    if ys[c] != 1 || xs[c] == 1 || d.len() > 10 || (d[r] as u64).div_ceil(32) > MAX_ROWS {
        return None;
    }
    let others: Vec<usize> = (0..c).filter(|&i| i != r).collect();
    Some(TiledTranspose {
        rows: d[r],
        cols: d[c],
        x_col: xs[c],
        y_row: ys[r],
        batch: others.iter().map(|&i| d[i]).product(),
        dims: others.iter().map(|&i| d[i]).collect(),
        xs: others.iter().map(|&i| xs[i]).collect(),
        ys: others.iter().map(|&i| ys[i]).collect(),
    })
}

/// A strided kernel's rank, dims and each operand's strides, as its arguments.
pub(super) type StridedArgs<const K: usize> = (i32, [i64; 8], [[i64; 8]; K]);

/// The rank and the dims and strides arguments of a strided kernel over `dims` (coalesced), for
/// each operand's strides; rank 0 where every operand is contiguous over the whole walk.
pub(super) fn strided_args<const K: usize>(dims: &[usize], strides: [&[i64]; K]) -> Result<StridedArgs<K>, String> {
    let (d, s) = coalesce(dims, &strides);
    if d.len() <= 1 && s.iter().all(|s| s.iter().all(|&x| x == 1)) {
        return Ok((0, [0; 8], [[0; 8]; K]));
    }
    let mut out = [[0i64; 8]; K];
    for (o, s) in out.iter_mut().zip(&s) {
        *o = dims8(s)?;
    }
    Ok((d.len() as i32, dims8(&d)?, out))
}

pub(super) fn dims8(v: &[i64]) -> Result<[i64; 8], String> {
    if v.len() > 8 {
        return Err(format!("rank {} (the CUDA kernels take at most 8 dims)", v.len()));
    }
    let mut d = [0i64; 8];
    d[..v.len()].copy_from_slice(v);
    Ok(d)
}

impl Planner<'_> {
    /// `y[c] = x[Σ c_d xs_d]` over `dims`, y at `ys` strides (movement_copy).
    pub(super) fn strided_copy(
        &mut self,
        dtype: DType,
        x: Buf,
        y: Buf,
        dims: &[usize],
        xs: &[i64],
        ys: &[i64],
    ) -> Result<(), String> {
        let n = numel(dims);
        if let Some(t) = tiled_transpose(dims, xs, ys) {
            // Reads along the input's contiguous axis and writes along the output's.
            let tiles = |n: i64| (n as u64).div_ceil(32) as u32;
            let grid = [tiles(t.cols), tiles(t.rows), t.batch.clamp(1, MAX_ROWS as i64) as u32];
            let (rank, d, [bxs, bys]) = (t.dims.len() as i32, dims8(&t.dims)?, [dims8(&t.xs)?, dims8(&t.ys)?]);
            let args = vec![
                Arg::Ptr(x),
                Arg::Ptr(y),
                Arg::I64(t.batch),
                Arg::I32(rank),
                Arg::Dims(d),
                Arg::Dims(bxs),
                Arg::Dims(bys),
                Arg::I64(t.rows),
                Arg::I64(t.cols),
                Arg::I64(t.x_col),
                Arg::I64(t.y_row),
            ];
            if n > 0 {
                self.kernel("movement", format!("movement_transpose_{}", size_tag(dtype)?), grid, [32, 8, 1], args);
            }
            return Ok(());
        }
        // Rows contiguous on both sides, in whole 16-byte units on 16-byte boundaries: copied 16
        // bytes at a time (the qkv Split's parts and the Concat of their gradients).
        let (cd, cs) = coalesce(dims, &[xs, ys]);
        let size = dtype.size() as i64;
        let v = 16 / size;
        let wide = self.opts.wide;
        let units = |d: &[i64], s: &[Vec<i64>]| -> Option<(Vec<usize>, Vec<i64>, Vec<i64>)> {
            let last = d.len().checked_sub(1)?;
            let fits = |st: &[i64]| st[last] == 1 && st[..last].iter().all(|&x| x % v == 0);
            let aligned = |b: Buf| matches!(b, Buf::Tensor(_, o) | Buf::Work(o) if o % 16 == 0);
            (wide && 16 % size == 0 && d[last] % v == 0 && s.iter().all(|st| fits(st)) && aligned(x) && aligned(y))
                .then(|| {
                    let mut dims: Vec<usize> = d.iter().map(|&x| x as usize).collect();
                    dims[last] /= v as usize;
                    let per =
                        |st: &[i64]| st.iter().enumerate().map(|(k, &x)| if k == last { 1 } else { x / v }).collect();
                    (dims, per(&s[0]), per(&s[1]))
                })
        };
        let (name, dims, xs, ys): (String, Vec<usize>, Vec<i64>, Vec<i64>) = match units(&cd, &cs) {
            Some((d, a, b)) if n > 0 => ("movement_copy_b16".into(), d, a, b),
            _ => (format!("movement_copy_{}", size_tag(dtype)?), dims.to_vec(), xs.to_vec(), ys.to_vec()),
        };
        let n = numel(&dims);
        let (rank, d, [xs, ys]) = strided_args(&dims, [&xs, &ys])?;
        let args = vec![
            Arg::Ptr(x),
            Arg::Ptr(y),
            Arg::I64(n as i64),
            Arg::I32(rank),
            Arg::Dims(d),
            Arg::Dims(xs),
            Arg::Dims(ys),
        ];
        self.flat("movement", name, n, args);
        Ok(())
    }
}
