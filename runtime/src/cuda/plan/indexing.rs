//! Plans of gatherND, ScatterND, ScatterElements and the gradient of Gather.

use super::*;

pub(super) fn plan_gather_nd(p: &mut Planner, batch_dims: i64) -> Result<(), String> {
    let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let (r, q) = (x.shape.len(), idx.shape.len());
    let b = usize::try_from(batch_dims).ok().filter(|&b| b < r.min(q)).ok_or("GatherND's batch_dims")?;
    let k = idx.shape[q - 1];
    if k == 0 || k > r - b || x.shape[..b] != idx.shape[..b] {
        return Err("GatherND's indices do not fit its data".into());
    }
    let tuples = idx.numel() as u64 / k as u64;
    let batch = numel(&x.shape[..b]).max(1);
    let run = numel(&x.shape[b + k..]);
    let st = contiguous(&x.shape[b..]);
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(idx)),
        Arg::Ptr(buf(y)),
        Arg::I64(tuples as i64),
        Arg::I32(k as i32),
        Arg::I64(run as i64),
        Arg::I64((tuples / batch).max(1) as i64),
        Arg::I64(numel(&x.shape[b..]) as i64),
        Arg::Dims(dims8(&us(&x.shape[b..b + k]))?),
        Arg::Dims(dims8(&st[..k])?),
        Arg::Ptr(Buf::Flag),
    ];
    let name = format!("gather_nd_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
    p.flat("gather", name, tuples * run, args);
    Ok(())
}

/// ScatterND (`axis` None) or ScatterElements: the data copied into the output, then the updates
/// applied in order by one thread per output element.
pub(super) fn plan_scatter(
    p: &mut Planner,
    axis: Option<i64>,
    reduction: mpc_ir::ops::ScatterReduction,
) -> Result<(), String> {
    use mpc_ir::ops::ScatterReduction as R;
    let (x, idx, upd, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
    let t = match x.dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I64 | DType::I32 => tag(x.dtype)?,
        d => return Err(format!("a scatter of {d} (f32, f16, bf16, f64, i64 and i32 run on cuda)")),
    };
    let it = index_tag(idx.dtype)?;
    let red = match reduction {
        R::None => 0,
        R::Add => 1,
        R::Mul => 2,
        R::Max => 3,
        R::Min => 4,
    };
    p.copy(buf(x), buf(y), y.bytes());
    let n_out = y.numel() as u64;
    let head = [Arg::Ptr(buf(idx)), Arg::Ptr(buf(upd)), Arg::Ptr(buf(y)), Arg::I64(n_out as i64)];
    let (name, mut args) = match axis {
        None => {
            let q = idx.shape.len();
            let k = *idx.shape.last().ok_or("ScatterND's indices of rank 0")?;
            if k > x.shape.len() {
                return Err("ScatterND's index tuples are longer than the data's rank".into());
            }
            let st = contiguous(&x.shape);
            let mut a = head.to_vec();
            a.extend([
                Arg::I64(numel(&idx.shape[..q - 1]) as i64),
                Arg::I32(k as i32),
                Arg::I64(numel(&x.shape[k..]) as i64),
                Arg::Dims(dims8(&us(&x.shape[..k]))?),
                Arg::Dims(dims8(&st[..k])?),
            ]);
            (format!("gather_scatter_nd_{t}_{it}"), a)
        }
        Some(axis) => {
            let r = x.shape.len();
            let ax = normalize_axis(axis, r).ok_or("axis out of range")?;
            if idx.shape.len() != r || upd.shape != idx.shape {
                return Err("ScatterElements' indices and updates do not fit its data".into());
            }
            let mut a = head.to_vec();
            a.extend([
                Arg::I64(idx.numel() as i64),
                Arg::I32(r as i32),
                Arg::Dims(dims8(&us(&idx.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
                Arg::I32(ax as i32),
                Arg::I64(x.shape[ax] as i64),
            ]);
            (format!("gather_scatter_elements_{t}_{it}"), a)
        }
    };
    args.extend([Arg::I32(red), Arg::Ptr(Buf::Flag)]);
    p.flat("gather", name, n_out, args);
    Ok(())
}

pub(super) fn plan_gather_grad(p: &mut Planner, axis: i64) -> Result<(), String> {
    let (dy, idx, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let ax = normalize_axis(axis, dx.shape.len()).ok_or("axis out of range")?;
    let (outer, len, inner) = split3(&dx.shape, ax, ax + 1);
    let count = idx.numel() as u64;
    let t = float_tag(dx.dtype)?;
    let it = index_tag(idx.dtype)?;
    let n = dx.numel() as u64;
    if count <= 64 || count >= 1 << 32 || len >= 1 << 31 {
        let args = vec![
            Arg::Ptr(buf(dy)),
            Arg::Ptr(buf(idx)),
            Arg::Ptr(buf(dx)),
            Arg::I64(outer as i64),
            Arg::I64(len as i64),
            Arg::I64(count as i64),
            Arg::I64(inner as i64),
        ];
        p.flat("gather", format!("gather_grad_direct_{t}_{it}"), n, args);
        return Ok(());
    }
    let padded = count.next_power_of_two().max(2048);
    let keys = p.work(padded * 8);
    let seg = p.work((len + 1) * 8);
    let args =
        vec![Arg::Ptr(buf(idx)), Arg::Ptr(keys), Arg::I64(count as i64), Arg::I64(padded as i64), Arg::I64(len as i64)];
    p.flat("gather", format!("gather_grad_keys_{it}"), padded, args);
    let chunks = (padded / 2048) as u32;
    p.kernel(
        "gather",
        "gather_sort_local".into(),
        [chunks, 1, 1],
        [BLOCK, 1, 1],
        vec![Arg::Ptr(keys), Arg::I64(padded as i64)],
    );
    let mut k = 4096;
    while k <= padded {
        let mut j = k / 2;
        while j >= 2048 {
            let args = vec![Arg::Ptr(keys), Arg::I64(padded as i64), Arg::I64(k as i64), Arg::I64(j as i64)];
            p.flat("gather", "gather_sort_step".into(), padded / 2, args);
            j /= 2;
        }
        let args = vec![Arg::Ptr(keys), Arg::I64(padded as i64), Arg::I64(k as i64)];
        p.kernel("gather", "gather_sort_merge_local".into(), [chunks, 1, 1], [BLOCK, 1, 1], args);
        k *= 2;
    }
    let args = vec![Arg::Ptr(keys), Arg::I64(count as i64), Arg::I64(len as i64), Arg::Ptr(seg)];
    p.flat("gather", "gather_grad_segments".into(), len + 1, args);
    let args = vec![
        Arg::Ptr(buf(dy)),
        Arg::Ptr(keys),
        Arg::Ptr(seg),
        Arg::Ptr(buf(dx)),
        Arg::I64(outer as i64),
        Arg::I64(len as i64),
        Arg::I64(count as i64),
        Arg::I64(inner as i64),
    ];
    p.flat("gather", format!("gather_grad_sorted_{t}"), n, args);
    Ok(())
}

/// The gathers, scatters, top-k, arg-max/min and RoiAlign ([`Kind::Index`](mpc_ir::Kind::Index)).
pub(super) fn plan_index(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    match op {
        Op::ArgMax(a) | Op::ArgMin(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, len, inner) = split3(&x.shape, ax, ax + 1);
            let kind = if matches!(op, Op::ArgMin(_)) { "argmin" } else { "argmax" };
            let t = float_tag(x.dtype)?;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(len as i64),
                Arg::I64(inner as i64),
                Arg::I32(a.select_last_index as i32),
            ];
            if inner == 1 {
                p.kernel("reduce", format!("reduce_{kind}_rows_{t}"), rows_grid(outer), [BLOCK, 1, 1], args);
            } else {
                let grid = [inner.div_ceil(32) as u32, outer.clamp(1, MAX_ROWS) as u32, 1];
                p.kernel("reduce", format!("reduce_{kind}_cols_{t}"), grid, [32, 8, 1], args);
            }
        }
        Op::TopK(a) => {
            let (x, values, indices) = (p.input(0)?, p.output(0)?, p.output(1)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
            let t = match x.dtype {
                DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::I64 | DType::I32 => tag(x.dtype)?,
                d => return Err(format!("TopK on {d}: the kernel takes f32, f16, bf16, f64, i64 or i32")),
            };
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(values)),
                Arg::Ptr(buf(indices)),
                Arg::I64(outer as i64),
                Arg::I64(n as i64),
                Arg::I64(inner as i64),
                Arg::I64(values.shape[ax] as i64),
                Arg::I32(a.largest as i32),
            ];
            p.flat("movement", format!("movement_topk_{t}"), outer * inner, args);
        }
        Op::RoiAlign(a) => pool::plan_roi_align(p, a, false)?,
        Op::RoiAlignGrad(a) => pool::plan_roi_align(p, a, true)?,
        Op::Gather(a) => {
            let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let (outer, len, inner) = split3(&x.shape, ax, ax + 1);
            let count = idx.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(idx)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(len as i64),
                Arg::I64(count as i64),
                Arg::I64(inner as i64),
                Arg::Ptr(Buf::Flag),
            ];
            let name = format!("gather_axis_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
            p.flat("gather", name, y.numel() as u64, args);
        }
        Op::GatherElements(a) => {
            let (x, idx, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let n = y.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(idx)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I32(idx.shape.len() as i32),
                Arg::Dims(dims8(&us(&idx.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
                Arg::I32(ax as i32),
                Arg::I64(x.shape[ax] as i64),
                Arg::Ptr(Buf::Flag),
            ];
            let name = format!("gather_elements_{}_{}", size_tag(x.dtype)?, index_tag(idx.dtype)?);
            p.flat("gather", name, n, args);
        }
        Op::GatherGrad(a) => plan_gather_grad(p, a.axis)?,
        Op::GatherND(a) => plan_gather_nd(p, a.batch_dims)?,
        Op::ScatterND(a) => plan_scatter(p, None, a.reduction)?,
        Op::ScatterElements(a) => plan_scatter(p, Some(a.axis), a.reduction)?,
        op => return Err(no_kernel(op)),
    }
    Ok(())
}
