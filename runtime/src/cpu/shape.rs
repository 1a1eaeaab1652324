//! Data movement: reshapes, transposes, slicing, gathering, concatenation, padding. Each builds the
//! flat input index of every output element and picks them (dtype kept, values exact).

use mpc_ir::normalize_axis;
use mpc_ir::ops::PadMode;

use super::{err, Res};
use crate::value::{gather_runs, Data, HostTensor};

/// Row-major strides. (A tensor that fits in memory has strides that fit in `usize`; an empty
/// one can have dims whose product does not, and its strides are never used: they saturate.)
pub(crate) fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1].saturating_mul(shape[i + 1]);
    }
    s
}

fn axis(a: i64, rank: usize) -> Res<usize> {
    normalize_axis(a, rank).ok_or_else(|| err(format!("axis {a} out of range for rank {rank}")))
}

/// Reshape with ONNX's 0 (copy, unless `allowzero`) and -1 (infer).
pub(crate) fn reshape(x: &HostTensor, target: &[i64], allowzero: bool) -> Res<HostTensor> {
    let mut shape = Vec::with_capacity(target.len());
    let mut infer = None;
    for (i, &t) in target.iter().enumerate() {
        shape.push(match t {
            0 if !allowzero => *x.shape.get(i).ok_or_else(|| err("0 in the target shape beyond the input's rank"))?,
            -1 => {
                infer = Some(i);
                1
            }
            t if t < 0 => return Err(err(format!("invalid target dimension {t}"))),
            t => t as usize,
        });
    }
    // Saturating: a target's dims may multiply past usize (an exact 0 still wins), and a
    // saturated product matches no input's length.
    let volume = |s: &[usize]| s.iter().fold(1usize, |a, &d| a.saturating_mul(d));
    let known = volume(&shape);
    if let Some(i) = infer {
        if known == 0 || x.len() % known != 0 {
            return Err(err(format!("cannot reshape {:?} into {target:?}", x.shape)));
        }
        shape[i] = x.len() / known;
    }
    if volume(&shape) != x.len() {
        return Err(err(format!("cannot reshape {:?} ({} elements) into {target:?}", x.shape, x.len())));
    }
    Ok(x.clone().with_shape(shape))
}

pub(crate) fn transpose(x: &HostTensor, perm: &[usize]) -> HostTensor {
    let out: Vec<usize> = perm.iter().map(|&p| x.shape[p]).collect();
    if out.iter().product::<usize>() == 0 {
        return x.pick(out, &[]);
    }
    let st = strides(&x.shape);
    let ps: Vec<usize> = perm.iter().map(|&p| st[p]).collect();
    x.strided(out, &ps)
}

pub(crate) fn concat(parts: &[&HostTensor], ax: i64) -> Res<HostTensor> {
    let rank = parts[0].shape.len();
    let a = axis(ax, rank)?;
    let outer: usize = parts[0].shape[..a].iter().product();
    let mut shape = parts[0].shape.clone();
    shape[a] = parts.iter().map(|p| p.shape[a]).sum();
    let mut runs = Vec::new();
    for o in 0..outer {
        for (pi, p) in parts.iter().enumerate() {
            let inner: usize = p.shape[a..].iter().product();
            if inner > 0 {
                runs.push((pi, o * inner, inner));
            }
        }
    }
    Ok(gather_runs(parts, shape, &runs))
}

/// Slice with per-axis start/end/step (ONNX clamping rules).
pub(crate) fn slice(x: &HostTensor, starts: &[i64], ends: &[i64], axes: &[i64], steps: &[i64]) -> Res<HostTensor> {
    let rank = x.shape.len();
    let mut begin = vec![0i64; rank];
    let mut step = vec![1i64; rank];
    let mut count: Vec<usize> = x.shape.clone();
    if [ends.len(), axes.len(), steps.len()].iter().any(|&n| n != starts.len()) {
        return Err(err("starts, ends, axes and steps have different lengths"));
    }
    for i in 0..starts.len() {
        let a = axis(axes[i], rank)?;
        let len = x.shape[a] as i64;
        let (b, n) = mpc_ir::geometry::slice_dim(len, starts[i], ends[i], steps[i]).map_err(err)?;
        begin[a] = b;
        step[a] = steps[i];
        count[a] = n as usize;
    }
    let st = strides(&x.shape);
    let total: usize = count.iter().product();
    let mut idx = Vec::with_capacity(total);
    let mut counter = vec![0usize; rank];
    for _ in 0..total {
        let p: i64 = (0..rank).map(|d| (begin[d] + step[d] * counter[d] as i64) * st[d] as i64).sum();
        idx.push(p as usize);
        for d in (0..rank).rev() {
            counter[d] += 1;
            if counter[d] < count[d] {
                break;
            }
            counter[d] = 0;
        }
    }
    Ok(x.pick(count, &idx))
}

pub(crate) fn gather(x: &HostTensor, indices: &HostTensor, ax: i64) -> Res<HostTensor> {
    let a = axis(ax, x.shape.len())?;
    let ind = indices.i64s().ok_or_else(|| err("indices must be integers"))?;
    let n = x.shape[a] as i64;
    let outer: usize = x.shape[..a].iter().product();
    let inner: usize = x.shape[a + 1..].iter().product();
    let mut shape = x.shape[..a].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&x.shape[a + 1..]);
    let mut runs = Vec::with_capacity(outer * ind.len());
    for o in 0..outer {
        for &i in &ind {
            let i = if i < 0 { i + n } else { i };
            if !(0..n).contains(&i) {
                return Err(err(format!("index {i} out of range for a dimension of {n}")));
            }
            runs.push((0, (o * n as usize + i as usize) * inner, inner));
        }
    }
    Ok(gather_runs(&[x], shape, &runs))
}

pub(crate) fn expand(x: &HostTensor, target: &[i64], limit: u64) -> Res<HostTensor> {
    let t: Vec<usize> = target.iter().map(|&d| d.max(0) as usize).collect();
    let shape = super::elementwise::broadcast_shape(&[&x.shape, &t])
        .ok_or_else(|| err(format!("cannot expand {:?} to {target:?}", x.shape)))?;
    super::fits(&shape, x.dtype(), limit)?;
    let idx = super::elementwise::broadcast_index(&x.shape, &shape);
    Ok(x.pick(shape, &idx))
}

pub(crate) fn tile(x: &HostTensor, reps: &[i64], limit: u64) -> Res<HostTensor> {
    if reps.len() != x.shape.len() {
        return Err(err(format!("{} repeats for rank {}", reps.len(), x.shape.len())));
    }
    let shape: Vec<usize> = x
        .shape
        .iter()
        .zip(reps)
        .map(|(&d, &r)| d.checked_mul(r.max(0) as usize).ok_or_else(|| err("Tile's output size overflows")))
        .collect::<Res<_>>()?;
    super::fits(&shape, x.dtype(), limit)?;
    let st = strides(&x.shape);
    let total: usize = shape.iter().product();
    let ost = strides(&shape);
    let idx: Vec<usize> =
        (0..total).map(|k| (0..shape.len()).map(|d| ((k / ost[d]) % shape[d] % x.shape[d]) * st[d]).sum()).collect();
    Ok(x.pick(shape, &idx))
}

/// Pad: constant, reflect, edge and wrap modes over the given axes.
pub(crate) fn pad(
    x: &HostTensor,
    pads: &[i64],
    value: Option<&HostTensor>,
    axes: &[usize],
    mode: PadMode,
    limit: u64,
) -> Res<HostTensor> {
    let rank = x.shape.len();
    if pads.len() != 2 * axes.len() || axes.iter().any(|&a| a >= rank) {
        return Err(err(format!("{} pads for {} axes of a rank-{rank} input", pads.len(), axes.len())));
    }
    let mut before = vec![0i64; rank];
    let mut after = vec![0i64; rank];
    for (i, &a) in axes.iter().enumerate() {
        before[a] = pads[i];
        after[a] = pads[i + axes.len()];
    }
    let shape: Vec<usize> = (0..rank)
        .map(|d| (x.shape[d] as i64).saturating_add(before[d]).saturating_add(after[d]).max(0) as usize)
        .collect();
    super::fits(&shape, x.dtype(), limit)?;
    let st = strides(&x.shape);
    let ost = strides(&shape);
    let total: usize = shape.iter().product();
    // Index len (one past the data) stands for the constant.
    let fill = x.len();
    let idx: Vec<usize> = (0..total)
        .map(|k| {
            let mut p = 0usize;
            for d in 0..rank {
                let n = x.shape[d] as i64;
                let c = ((k / ost[d]) % shape[d]) as i64 - before[d];
                let Some(c) = mpc_ir::geometry::pad_source(c, n, mode) else { return fill };
                p += c as usize * st[d];
            }
            p
        })
        .collect();
    let constant = match value {
        Some(v) => v.cast(x.dtype()).pick(vec![1], &[0]),
        None => HostTensor::from_f64(x.dtype(), vec![1], vec![0.0]),
    };
    let joined = gather_runs(&[x, &constant], vec![x.len() + 1], &[(0, 0, x.len()), (1, 0, 1)]);
    Ok(joined.pick(shape, &idx))
}

pub(crate) fn range(start: &HostTensor, end: &HostTensor, delta: &HostTensor, bytes: u64) -> Res<HostTensor> {
    let (s, l, d) = (start.f64s()[0], end.f64s()[0], delta.f64s()[0]);
    if d == 0.0 {
        return Err(err("Range delta is 0"));
    }
    let n = ((l - s) / d).ceil().max(0.0) as usize;
    super::fits(&[n], start.dtype(), bytes)?;
    let v: Vec<f64> = (0..n).map(|i| s + i as f64 * d).collect();
    Ok(match &start.data {
        Data::F32(_) => HostTensor::from_f32(
            start.dtype(),
            vec![n],
            (0..n)
                .map(|i| start.f32s().unwrap_or_default()[0] + i as f32 * delta.f32s().unwrap_or_default()[0])
                .collect(),
        ),
        _ if !start.dtype().is_float() => {
            let (s, d) = (start.i64s().unwrap_or_default()[0], delta.i64s().unwrap_or_default()[0]);
            HostTensor::from_i64(start.dtype(), vec![n], (0..n as i64).map(|i| s + i * d).collect())
        }
        _ => HostTensor::from_f64(start.dtype(), vec![n], v),
    })
}

/// Trilu: keeps the upper (j - i >= k) or lower (j - i <= k) triangle of the last two dims.
pub(crate) fn trilu(x: &HostTensor, k: i64, upper: bool) -> Res<HostTensor> {
    let r = x.shape.len();
    if r < 2 {
        return Err(err("Trilu needs rank >= 2"));
    }
    let (n, m) = (x.shape[r - 2], x.shape[r - 1]);
    // Index len (one past the data) stands for zero.
    let zero = HostTensor::from_f64(x.dtype(), vec![1], vec![0.0]);
    let joined = gather_runs(&[x, &zero], vec![x.len() + 1], &[(0, 0, x.len()), (1, 0, 1)]);
    let idx: Vec<usize> = (0..x.len())
        .map(|p| {
            let (i, j) = (((p / m) % n) as i64, (p % m) as i64);
            let keep = if upper { j - i >= k } else { j - i <= k };
            if keep {
                p
            } else {
                x.len()
            }
        })
        .collect();
    Ok(joined.pick(x.shape.clone(), &idx))
}
