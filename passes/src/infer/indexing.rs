//! Type rules of the index ops that read or write whole tuples of coordinates: GatherND, ScatterND
//! and ScatterElements. Gathers take the data's dtype; scatters give the data's type unchanged.
//! Shapes are checked where they are known: a mismatch is an error naming the node.

use mpc_ir::{DType, Dim, Shape};

use super::rules::{check_eq, t, NodeCx, R};

/// The index input `i` is int64 or int32 (the only index types ONNX allows these ops).
fn index_dtype(cx: &NodeCx, i: usize) -> Result<(), String> {
    match cx.dt(i) {
        None | Some(DType::I64 | DType::I32) => Ok(()),
        Some(d) => Err(format!("indices are {d}, not int64 or int32")),
    }
}

/// Data (input 0) and updates (input 2) share one dtype.
fn updates_dtype(cx: &NodeCx) -> Result<(), String> {
    match (cx.dt(0), cx.dt(2)) {
        (Some(d), Some(u)) if d != u => Err(format!("updates are {u} where data is {d}")),
        _ => Ok(()),
    }
}

/// Of two dims known to be equal, the one that says more.
fn better(a: &Dim, b: &Dim) -> Dim {
    match (a, b) {
        (Dim::Fixed(_), _) => a.clone(),
        (_, Dim::Fixed(_)) => b.clone(),
        (Dim::Sym(_), _) => a.clone(),
        _ => b.clone(),
    }
}

/// GatherND: `indices.shape[:-1] + data.shape[batch_dims + k:]`, `k = indices.shape[-1]`. The
/// rank needs `k`: unknown, it is 1 only when one data dim is left past the batch dims.
pub(super) fn gather_nd(cx: &NodeCx, batch_dims: i64) -> R {
    index_dtype(cx, 1)?;
    let b = usize::try_from(batch_dims).map_err(|_| format!("batch_dims {batch_dims} is negative"))?;
    let (Some(d), Some(i)) = (cx.sh(0), cx.sh(1)) else {
        return Ok(vec![t(cx.dt(0), None)]);
    };
    let (r, q) = (d.rank(), i.rank());
    if b >= r.min(q) {
        return Err(format!("batch_dims {b} needs data ({d}) and indices ({i}) of a larger rank"));
    }
    let mut out = Vec::with_capacity(q - 1 + r);
    for j in 0..q - 1 {
        if j < b {
            check_eq(&d.0[j], &i.0[j], "the batch dims of data and indices")?;
            out.push(better(&i.0[j], &d.0[j]));
        } else {
            out.push(i.0[j].clone());
        }
    }
    let k = match i.0[q - 1].fixed() {
        Some(k) => k as usize,
        None if r - b == 1 => 1,
        None => return Ok(vec![t(cx.dt(0), None)]),
    };
    if k == 0 || k > r - b {
        return Err(format!(
            "indices' last dim is {k}; it must be from 1 to {} (data rank {r} less batch_dims {b})",
            r - b
        ));
    }
    out.extend(d.0[b + k..].iter().cloned());
    Ok(vec![t(cx.dt(0), Some(Shape(out)))])
}

/// ScatterND: data's type; updates must be `indices.shape[:-1] + data.shape[k:]`.
pub(super) fn scatter_nd(cx: &NodeCx) -> R {
    index_dtype(cx, 1)?;
    updates_dtype(cx)?;
    if let (Some(d), Some(i), Some(u)) = (cx.sh(0), cx.sh(1), cx.sh(2)) {
        let (r, q) = (d.rank(), i.rank());
        if q == 0 {
            return Err("indices must have rank >= 1".into());
        }
        if let Some(k) = i.0[q - 1].fixed().map(|k| k as usize) {
            if k > r {
                return Err(format!("indices' last dim is {k}, more than the rank of data ({d})"));
            }
            let want: Vec<Dim> = i.0[..q - 1].iter().chain(&d.0[k..]).cloned().collect();
            if u.rank() != want.len() {
                return Err(format!("updates are {u}; data {d} and indices {i} make them {}", Shape(want)));
            }
            for (a, w) in u.0.iter().zip(&want) {
                check_eq(a, w, "updates and indices[:-1] + data[k:]")?;
            }
        }
    }
    Ok(vec![cx.ty(0).cloned().unwrap_or_default()])
}

/// ScatterElements: data's type; indices and updates have one shape, of data's rank.
pub(super) fn scatter_elements(cx: &NodeCx, axis: i64) -> R {
    index_dtype(cx, 1)?;
    updates_dtype(cx)?;
    if let Some(d) = cx.sh(0) {
        super::axis_in(axis, d)?;
        for s in [cx.sh(1), cx.sh(2)].into_iter().flatten() {
            if s.rank() != d.rank() {
                return Err(format!("indices and updates must have the rank of data ({d}), not {s}"));
            }
        }
    }
    if let (Some(i), Some(u)) = (cx.sh(1), cx.sh(2)) {
        if i.rank() != u.rank() {
            return Err(format!("indices {i} and updates {u} differ in rank"));
        }
        for (a, b) in i.0.iter().zip(&u.0) {
            check_eq(a, b, "indices and updates dims")?;
        }
    }
    Ok(vec![cx.ty(0).cloned().unwrap_or_default()])
}
