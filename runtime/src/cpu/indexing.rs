//! The index ops: GatherElements, GatherND, ScatterElements and ScatterND.
//!
//! Each first resolves every index into a flat offset of the data (a negative index counts from
//! the end; one out of range is an error naming it and its axis, before anything is read or
//! written), then moves elements: the gathers pick them whatever the dtype, the scatters apply the
//! updates in index order to a copy of the data, combined by the `reduction` (`none` replaces, so
//! the last of duplicate indices wins). Integer reductions wrap; f16 and bf16 combine in f32 and
//! round once on store, as the other CPU kernels do.

use half::{bf16, f16};
use mpc_ir::ops::ScatterReduction;

use super::shape::strides;
use super::{axis, err, Res};
use crate::value::{gather_runs, Data, HostTensor};

fn index_values(indices: &HostTensor) -> Res<Vec<i64>> {
    if indices.dtype().is_float() {
        return Err(err(format!("indices are {}, not integers", indices.dtype())));
    }
    indices.i64s().ok_or_else(|| err("indices must be integers"))
}

/// Index `i` along an axis of `n` positions.
fn resolve(i: i64, n: usize, axis: usize) -> Res<usize> {
    let j = if i < 0 { i.checked_add(n as i64) } else { Some(i) };
    match j {
        Some(j) if (0..n as i64).contains(&j) => Ok(j as usize),
        _ => Err(err(format!("index {i} is out of range for axis {axis} of size {n}"))),
    }
}

/// For every element of `indices` (GatherElements, ScatterElements): the flat offset in data it
/// addresses, its own coordinates with the one along `ax` replaced by its value.
fn element_offsets(shape: &[usize], indices: &HostTensor, ax: i64) -> Res<Vec<usize>> {
    let r = shape.len();
    let a = axis(ax, r)?;
    let ish = &indices.shape;
    if ish.len() != r {
        return Err(err(format!("indices {ish:?} must have the rank of data {shape:?}")));
    }
    if let Some(d) = (0..r).find(|&d| d != a && ish[d] > shape[d]) {
        return Err(err(format!("indices {ish:?} are larger than data {shape:?} along axis {d}")));
    }
    let ind = index_values(indices)?;
    let (xs, is) = (strides(shape), strides(ish));
    ind.iter()
        .enumerate()
        .map(|(k, &i)| {
            let mut p = resolve(i, shape[a], a)? * xs[a];
            for d in (0..r).filter(|&d| d != a) {
                p += (k / is[d]) % ish[d] * xs[d];
            }
            Ok(p)
        })
        .collect()
}

pub(crate) fn gather_elements(x: &HostTensor, indices: &HostTensor, ax: i64) -> Res<HostTensor> {
    let idx = element_offsets(&x.shape, indices, ax)?;
    Ok(x.pick(indices.shape.clone(), &idx))
}

/// GatherND: for each index tuple (the last dim of `indices`, `k` long), the slice of data it
/// addresses within its batch. Output `indices.shape[:-1] + data.shape[batch_dims + k:]`.
pub(crate) fn gather_nd(x: &HostTensor, indices: &HostTensor, batch_dims: i64) -> Res<HostTensor> {
    let (r, q) = (x.shape.len(), indices.shape.len());
    let b = usize::try_from(batch_dims).ok().filter(|&b| b < r.min(q)).ok_or_else(|| {
        err(format!("batch_dims {batch_dims} needs data and indices of rank above it, not {r} and {q}"))
    })?;
    let k = indices.shape[q - 1];
    if k == 0 || k > r - b {
        return Err(err(format!(
            "indices' last dim is {k}; it must be from 1 to {} (data rank less batch_dims)",
            r - b
        )));
    }
    if x.shape[..b] != indices.shape[..b] {
        return Err(err(format!("the batch dims of data {:?} and indices {:?} differ", x.shape, indices.shape)));
    }
    let ind = index_values(indices)?;
    let batch: usize = x.shape[..b].iter().product();
    let batch_len: usize = x.shape[b..].iter().product();
    let run: usize = x.shape[b + k..].iter().product();
    let st = strides(&x.shape[b..]);
    let tuples = ind.len() / k;
    let per_batch = tuples.checked_div(batch).unwrap_or(0);
    let mut runs = Vec::with_capacity(tuples);
    for t in 0..tuples {
        let mut off = (t / per_batch) * batch_len;
        for j in 0..k {
            off += resolve(ind[t * k + j], x.shape[b + j], b + j)? * st[j];
        }
        if run > 0 {
            runs.push((0, off, run));
        }
    }
    let mut shape = indices.shape[..q - 1].to_vec();
    shape.extend(&x.shape[b + k..]);
    Ok(gather_runs(&[x], shape, &runs))
}

/// ScatterND: each index tuple of `indices` (the last dim, `k` long) addresses a slice of data,
/// `data.shape[k:]`, that the matching slice of updates (`indices.shape[:-1] + data.shape[k:]`)
/// replaces or combines with.
pub(crate) fn scatter_nd(
    x: &HostTensor,
    indices: &HostTensor,
    updates: &HostTensor,
    reduction: ScatterReduction,
) -> Res<HostTensor> {
    let (r, q) = (x.shape.len(), indices.shape.len());
    let Some(&k) = indices.shape.last() else {
        return Err(err("indices must have rank >= 1"));
    };
    if k > r {
        return Err(err(format!("indices' last dim is {k}, more than the rank of data {:?}", x.shape)));
    }
    let want: Vec<usize> = indices.shape[..q - 1].iter().chain(&x.shape[k..]).copied().collect();
    if updates.shape != want {
        return Err(err(format!(
            "updates are {:?}; data {:?} and indices {:?} make them {want:?}",
            updates.shape, x.shape, indices.shape
        )));
    }
    let ind = index_values(indices)?;
    let st = strides(&x.shape);
    let tuples: usize = indices.shape[..q - 1].iter().product();
    let dst = (0..tuples)
        .map(|t| (0..k).try_fold(0, |off, j| Ok(off + resolve(ind[t * k + j], x.shape[j], j)? * st[j])))
        .collect::<Res<Vec<usize>>>()?;
    scatter(x, updates, &dst, x.shape[k..].iter().product(), reduction)
}

/// ScatterElements: every element of updates goes where the matching element of indices points
/// along `ax` (its other coordinates its own).
pub(crate) fn scatter_elements(
    x: &HostTensor,
    indices: &HostTensor,
    updates: &HostTensor,
    ax: i64,
    reduction: ScatterReduction,
) -> Res<HostTensor> {
    if updates.shape != indices.shape {
        return Err(err(format!("updates {:?} and indices {:?} differ in shape", updates.shape, indices.shape)));
    }
    let dst = element_offsets(&x.shape, indices, ax)?;
    scatter(x, updates, &dst, 1, reduction)
}

/// The element arithmetic of the reductions.
trait Combine: Copy {
    fn add(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
    fn max(self, b: Self) -> Self;
    fn min(self, b: Self) -> Self;
}

macro_rules! combine_int {
    ($($t:ty),*) => {$(
        impl Combine for $t {
            fn add(self, b: Self) -> Self {
                self.wrapping_add(b)
            }
            fn mul(self, b: Self) -> Self {
                self.wrapping_mul(b)
            }
            fn max(self, b: Self) -> Self {
                Ord::max(self, b)
            }
            fn min(self, b: Self) -> Self {
                Ord::min(self, b)
            }
        }
    )*};
}
combine_int!(i64, i32, i16, i8, u64, u32, u16, u8);

/// NaN wins max and min, as numpy's `maximum` and `minimum` (the ONNX reference) have it.
macro_rules! combine_float {
    ($($t:ty),*) => {$(
        impl Combine for $t {
            fn add(self, b: Self) -> Self {
                self + b
            }
            fn mul(self, b: Self) -> Self {
                self * b
            }
            fn max(self, b: Self) -> Self {
                if self.is_nan() || b.is_nan() { <$t>::NAN } else { <$t>::max(self, b) }
            }
            fn min(self, b: Self) -> Self {
                if self.is_nan() || b.is_nan() { <$t>::NAN } else { <$t>::min(self, b) }
            }
        }
    )*};
}
combine_float!(f32, f64);

/// Booleans as numpy combines them: add and max are `or`, mul and min `and`.
impl Combine for bool {
    fn add(self, b: Self) -> Self {
        self | b
    }
    fn mul(self, b: Self) -> Self {
        self & b
    }
    fn max(self, b: Self) -> Self {
        self | b
    }
    fn min(self, b: Self) -> Self {
        self & b
    }
}

/// A copy of `data` with run `j` of `updates` (`run` elements from `j * run`) applied at `dst[j]`,
/// in order. The offsets are resolved and the lengths checked by the callers.
fn apply<T: Combine>(data: &[T], updates: &[T], dst: &[usize], run: usize, reduction: ScatterReduction) -> Vec<T> {
    let mut out = data.to_vec();
    for (j, &d) in dst.iter().enumerate() {
        let (o, u) = (&mut out[d..d + run], &updates[j * run..(j + 1) * run]);
        let f: fn(T, T) -> T = match reduction {
            ScatterReduction::None => {
                o.copy_from_slice(u);
                continue;
            }
            ScatterReduction::Add => T::add,
            ScatterReduction::Mul => T::mul,
            ScatterReduction::Max => T::max,
            ScatterReduction::Min => T::min,
        };
        o.iter_mut().zip(u).for_each(|(a, &b)| *a = f(*a, b));
    }
    out
}

/// [`apply`] for f16 and bf16: combined in f32, rounded once on store.
fn apply_half<H: Copy>(
    data: &[H],
    updates: &[H],
    dst: &[usize],
    run: usize,
    reduction: ScatterReduction,
    widen: fn(H) -> f32,
    narrow: fn(f32) -> H,
) -> Vec<H> {
    let (a, b): (Vec<f32>, Vec<f32>) =
        (data.iter().map(|&v| widen(v)).collect(), updates.iter().map(|&v| widen(v)).collect());
    apply(&a, &b, dst, run, reduction).into_iter().map(narrow).collect()
}

fn scatter(
    data: &HostTensor,
    updates: &HostTensor,
    dst: &[usize],
    run: usize,
    reduction: ScatterReduction,
) -> Res<HostTensor> {
    if updates.len() != dst.len() * run {
        return Err(err(format!("{} updates for {} slices of {run}", updates.len(), dst.len())));
    }
    macro_rules! typed {
        ($($v:ident),*) => {
            match (&data.data, &updates.data) {
                $((Data::$v(a), Data::$v(b)) => Data::$v(apply(a, b, dst, run, reduction).into()),)*
                (Data::F16(a), Data::F16(b)) => {
                    Data::F16(apply_half(a, b, dst, run, reduction, f16::to_f32, f16::from_f32).into())
                }
                (Data::BF16(a), Data::BF16(b)) => {
                    Data::BF16(apply_half(a, b, dst, run, reduction, bf16::to_f32, bf16::from_f32).into())
                }
                _ => {
                    return Err(err(format!("updates are {} where data is {}", updates.dtype(), data.dtype())))
                }
            }
        };
    }
    let out = typed!(F32, F64, I64, I32, I16, I8, U64, U32, U16, U8, Bool);
    Ok(HostTensor { shape: data.shape.clone(), data: out })
}
