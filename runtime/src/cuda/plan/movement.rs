//! Plans of slice, Pad and Resize.

use super::*;

pub(super) fn plan_slice(p: &mut Planner) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let r = x.shape.len();
    let starts = p.host_ints(1).ok_or("Slice's starts are not known")?;
    let ends = p.host_ints(2).ok_or("Slice's ends are not known")?;
    let axes = p.host_ints(3).unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = p.host_ints(4).unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
        return Err("Slice's starts, ends, axes and steps differ in length".into());
    }
    let xs = contiguous(&x.shape);
    let mut strides = xs.clone();
    let mut first = 0i64;
    for i in 0..starts.len() {
        let ax = normalize_axis(axes[i], r).ok_or("axis out of range")?;
        let (b, _) = slice_dim(x.shape[ax] as i64, starts[i], ends[i], steps[i])?;
        if y.shape[ax] > 0 {
            first += b * xs[ax];
        }
        strides[ax] = xs[ax] * steps[i];
    }
    let from = buf(x).at((first as u64) * x.dtype.size() as u64);
    p.strided_copy(x.dtype, from, buf(y), &y.shape, &strides, &contiguous(&y.shape))
}

pub(super) fn plan_pad(p: &mut Planner, mode: PadMode) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let r = x.shape.len();
    let pads = p.host_ints(1).ok_or("Pad's pads are not known")?;
    let axes: Vec<usize> = match p.host_ints(3) {
        Some(v) => v.iter().map(|&a| normalize_axis(a, r).ok_or("axis out of range")).collect::<Result<_, _>>()?,
        None => (0..r).collect(),
    };
    if pads.len() != 2 * axes.len() {
        return Err("Pad's pads do not match its axes".into());
    }
    let mut before = vec![0i64; r];
    for (i, &a) in axes.iter().enumerate() {
        before[a] = pads[i];
    }
    let mut bits = [0u8; 8];
    if let Some(v) = p.opt_input(2) {
        match (p.constant)(v) {
            Some(c) => {
                let c = c.cast(x.dtype);
                c.write_le_bytes(&mut bits[..c.bytes().min(8)]);
            }
            // The other modes never read the value.
            None if mode == PadMode::Constant => return pad_from_device(p, x, v, y, &before),
            None => {}
        }
    } else if let Some(v) = p.host(2) {
        let c = v.cast(x.dtype);
        c.write_le_bytes(&mut bits[..c.bytes().min(8)]);
    }
    let code = match mode {
        PadMode::Constant => 0,
        PadMode::Reflect => 1,
        PadMode::Edge => 2,
        PadMode::Wrap => 3,
    };
    let n = y.numel() as u64;
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I32(r as i32),
        Arg::Dims(dims8(&us(&y.shape))?),
        Arg::Dims(dims8(&us(&x.shape))?),
        Arg::Dims(dims8(&contiguous(&x.shape))?),
        Arg::Dims(dims8(&before)?),
        Arg::I32(code),
        Arg::U64(u64::from_le_bytes(bits)),
    ];
    p.flat("movement", format!("movement_pad_{}", size_tag(x.dtype)?), n, args);
    Ok(())
}

pub(super) fn plan_resize(p: &mut Planner, a: &mpc_ir::ops::ResizeAttrs) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    let t = float_tag(x.dtype)?;
    let scales = p.host(2).filter(|s| !s.is_empty()).map(|s| s.f64s());
    let sizes = p.host(3).filter(|s| !s.is_empty()).and_then(|s| s.i64s());
    let (out, scale) = mpc_ir::geometry::resize_plan(a, &x.shape, scales.as_deref(), sizes.as_deref())?;
    let roi = mpc_ir::geometry::resize_roi(a, x.shape.len(), p.host(1).map(|r| r.f64s()).as_deref())?;
    if out != y.shape {
        return Err(format!("Resize to {out:?} where the graph declares {:?}", y.shape));
    }
    // Each output coordinate's taps, all axes one after another: first[e] .. first[e + 1].
    let (mut first, mut idx, mut w, mut base) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for d in 0..x.shape.len() {
        base.push(first.len() as i64);
        for taps in mpc_ir::geometry::resize_taps(a, x.shape[d], out[d], scale[d], roi[d])? {
            first.push(idx.len() as i64);
            for (i, wt) in taps {
                idx.push(i as i64);
                w.push(wt);
            }
        }
    }
    first.push(idx.len() as i64);
    let le = |v: &[i64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let (first, idx) = (p.aux(&le(&first)), p.aux(&le(&idx)));
    let w = p.aux(&w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    let n = y.numel() as u64;
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I32(x.shape.len() as i32),
        Arg::Dims(dims8(&us(&y.shape))?),
        Arg::Dims(dims8(&contiguous(&x.shape))?),
        Arg::Dims(dims8(&base)?),
        Arg::Ptr(first),
        Arg::Ptr(idx),
        Arg::Ptr(w),
        Arg::F64(f64::from(a.extrapolation_value)),
    ];
    p.flat("movement", format!("movement_resize_{t}"), n, args);
    Ok(())
}

/// Constant Pad whose value is computed on the device: the value broadcast over the output,
/// then the part of the input the output keeps copied into place.
fn pad_from_device(p: &mut Planner, x: &TensorRef, v: &TensorRef, y: &TensorRef, before: &[i64]) -> Result<(), String> {
    if v.numel() != 1 || v.dtype != x.dtype {
        return Err("Pad's constant value must be one value of the input's dtype".into());
    }
    p.expand(y.dtype, buf(v), &v.shape, buf(y), &y.shape)?;
    let (xs, ys) = (contiguous(&x.shape), contiguous(&y.shape));
    let (mut from, mut to, mut dims) = (0i64, 0i64, Vec::with_capacity(x.shape.len()));
    for d in 0..x.shape.len() {
        let (out_start, in_start) = (before[d].max(0), (-before[d]).max(0));
        let len = (x.shape[d] as i64 - in_start).min(y.shape[d] as i64 - out_start).max(0);
        from += in_start * xs[d];
        to += out_start * ys[d];
        dims.push(len as usize);
    }
    let es = x.dtype.size() as u64;
    p.strided_copy(x.dtype, buf(x).at(from as u64 * es), buf(y).at(to as u64 * es), &dims, &xs, &ys)
}

/// The data-movement family ([`Kind::Movement`](mpc_ir::Kind::Movement)).
pub(super) fn plan_movement(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    match op {
        Op::Transpose(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let r = x.shape.len();
            let perm: Vec<usize> = match &a.perm {
                Some(v) => {
                    v.iter().map(|&d| normalize_axis(d, r).ok_or("perm out of range")).collect::<Result<_, _>>()?
                }
                None => (0..r).rev().collect(),
            };
            let xs = contiguous(&x.shape);
            let xs: Vec<i64> = perm.iter().map(|&d| xs[d]).collect();
            p.strided_copy(x.dtype, buf(x), buf(y), &y.shape, &xs, &contiguous(&y.shape))?;
        }
        Op::Expand => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            p.expand(x.dtype, buf(x), &x.shape, buf(y), &y.shape)?;
        }
        Op::Slice => plan_slice(p)?,
        Op::Concat(a) => {
            let y = p.output(0)?;
            let ax = normalize_axis(a.axis, y.shape.len()).ok_or("axis out of range")?;
            let ys = contiguous(&y.shape);
            let mut at = 0u64;
            for i in 0..p.l.inputs.len() {
                let Some(x) = p.opt_input(i) else { continue };
                let to = buf(y).at(at * ys[ax] as u64 * y.dtype.size() as u64);
                p.strided_copy(x.dtype, buf(x), to, &x.shape, &contiguous(&x.shape), &ys)?;
                at += x.shape[ax] as u64;
            }
        }
        Op::Split(a) => {
            let x = p.input(0)?;
            let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
            let xs = contiguous(&x.shape);
            let mut at = 0u64;
            for y in &p.l.outputs {
                let from = buf(x).at(at * xs[ax] as u64 * x.dtype.size() as u64);
                p.strided_copy(x.dtype, from, buf(y), &y.shape, &xs, &contiguous(&y.shape))?;
                at += y.shape[ax] as u64;
            }
        }
        Op::Tile => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let n = y.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I32(y.shape.len() as i32),
                Arg::Dims(dims8(&us(&y.shape))?),
                Arg::Dims(dims8(&us(&x.shape))?),
                Arg::Dims(dims8(&contiguous(&x.shape))?),
            ];
            p.flat("movement", format!("movement_tile_{}", size_tag(x.dtype)?), n, args);
        }
        Op::Pad(a) => plan_pad(p, a.mode)?,
        Op::Trilu(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let k = p.host_ints(1).and_then(|v| v.first().copied()).unwrap_or(0);
            let r = x.shape.len();
            if r < 2 {
                return Err("Trilu of a tensor of rank below 2".into());
            }
            let n = x.numel() as u64;
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(n as i64),
                Arg::I64(x.shape[r - 2] as i64),
                Arg::I64(x.shape[r - 1] as i64),
                Arg::I64(k),
                Arg::I32(a.upper as i32),
            ];
            p.flat("movement", format!("movement_trilu_{}", size_tag(x.dtype)?), n, args);
        }
        Op::Resize(a) => plan_resize(p, a)?,
        op => return Err(no_kernel(op)),
    }
    Ok(())
}

/// Shapes, ranges and constants ([`Kind::Shape`](mpc_ir::Kind::Shape)): the ones with a kernel.
pub(super) fn plan_shape(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    match op {
        Op::ConstantOfShape(a) => {
            let y = p.output(0)?;
            let v = a
                .value
                .as_ref()
                .map(HostTensor::from)
                .unwrap_or_else(|| HostTensor::from_f64(y.dtype, vec![1], vec![0.0]));
            let mut bits = [0u8; 8];
            v.write_le_bytes(&mut bits[..v.bytes().min(8)]);
            let n = y.numel() as u64;
            let args = vec![Arg::Ptr(buf(y)), Arg::I64(n as i64), Arg::U64(u64::from_le_bytes(bits))];
            p.flat("movement", format!("movement_fill_{}", size_tag(y.dtype)?), n, args);
        }
        Op::Range => {
            let y = p.output(0)?;
            let value =
                |p: &Planner, i: usize| p.host(i).cloned().ok_or_else(|| format!("Range's input {i} is not known"));
            let (start, delta) = (value(p, 0)?, value(p, 2)?);
            let bytes = |t: &HostTensor| {
                let mut b = vec![0u8; t.bytes()];
                t.write_le_bytes(&mut b);
                b
            };
            let (s, d) = (p.aux(&bytes(&start)), p.aux(&bytes(&delta)));
            let n = y.numel() as u64;
            let args = vec![Arg::Ptr(s), Arg::Ptr(d), Arg::Ptr(buf(y)), Arg::I64(n as i64)];
            p.flat("movement", format!("movement_range_{}", tag(y.dtype)?), n, args);
        }
        op => return Err(no_kernel(op)),
    }
    Ok(())
}

/// The scans ([`Kind::Scan`](mpc_ir::Kind::Scan)): CumSum, CumProd and CumProd's gradient.
pub(super) fn plan_scan(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    match op {
        Op::CumSum(a) | Op::CumProd(a) => {
            let (x, y) = (p.input(0)?, p.output(0)?);
            let ax = p.host_ints(1).and_then(|v| v.first().copied()).ok_or("the axis is not known")?;
            let ax = normalize_axis(ax, x.shape.len()).ok_or("axis out of range")?;
            let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(outer as i64),
                Arg::I64(n as i64),
                Arg::I64(inner as i64),
                Arg::I32(a.exclusive as i32),
                Arg::I32(a.reverse as i32),
            ];
            let kind = if matches!(op, Op::CumProd(_)) { "cumprod" } else { "cumsum" };
            p.flat("movement", format!("movement_{kind}_{}", tag(x.dtype)?), outer * inner, args);
        }
        Op::CumProdGrad(a) => {
            let (dy, x, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let ax = p.host_ints(2).and_then(|v| v.first().copied()).ok_or("the axis is not known")?;
            let ax = normalize_axis(ax, x.shape.len()).ok_or("axis out of range")?;
            let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
            let products = p.work(x.numel() as u64 * 8);
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(dx)),
                Arg::Ptr(products),
                Arg::I64(outer as i64),
                Arg::I64(n as i64),
                Arg::I64(inner as i64),
                Arg::I32(a.exclusive as i32),
                Arg::I32(a.reverse as i32),
            ];
            p.flat("movement", format!("movement_cumprod_grad_{}", float_tag(x.dtype)?), outer * inner, args);
        }
        op => return Err(no_kernel(op)),
    }
    Ok(())
}
