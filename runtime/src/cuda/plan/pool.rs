//! Plans of max and average pooling and their gradients, and of RoiAlign and its gradient.

use super::*;

pub(super) fn plan_pool(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (Op::MaxPool(a) | Op::AveragePool(a) | Op::MaxPoolGrad(a) | Op::AveragePoolGrad(a)) = &op else {
        unreachable!("not a pooling op")
    };
    let grad = matches!(op, Op::MaxPoolGrad(_) | Op::AveragePoolGrad(_));
    let x = p.input(if grad { 1 } else { 0 })?;
    if x.shape.len() < 3 {
        return Err("pooling of a tensor of rank below 3".into());
    }
    let w = a.window().resolve(&x.shape[2..])?;
    let win = window3(&w, &x.shape[2..])?;
    let planes = (x.shape[0] * x.shape[1]) as u64;
    // The kernels index within a plane in 32 bits (offsets, and MaxPoolGrad's argmax).
    let y0 = p.output(0)?;
    if numel(&x.shape[2..]).max(numel(&y0.shape[2..])) > i32::MAX as u64 {
        return Err("pooling over planes of 2^31 elements or more".into());
    }
    let t = match (&op, x.dtype) {
        (Op::MaxPool(_), DType::U8 | DType::I8) => tag(x.dtype)?,
        (_, d) => float_tag(d)?,
    };
    let y = p.output(0)?;
    match op {
        Op::MaxPool(_) => {
            let idx = p.l.outputs.get(1).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                idx,
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.storage_order as i32),
            ];
            p.flat("pool", format!("pool_max_{t}"), y.numel() as u64, args);
        }
        Op::AveragePool(_) => {
            let args = vec![
                Arg::Ptr(buf(x)),
                Arg::Ptr(buf(y)),
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.count_include_pad as i32),
            ];
            p.flat("pool", format!("pool_avg_{t}"), y.numel() as u64, args);
        }
        Op::MaxPoolGrad(_) => {
            let dy = p.input(0)?;
            let arg = p.work(dy.numel() as u64 * 4);
            let args = vec![Arg::Ptr(buf(x)), Arg::Ptr(arg), Arg::I64(planes as i64), Arg::Window(win)];
            p.flat("pool", format!("pool_max_argmax_{t}"), dy.numel() as u64, args);
            let args =
                vec![Arg::Ptr(buf(dy)), Arg::Ptr(arg), Arg::Ptr(buf(y)), Arg::I64(planes as i64), Arg::Window(win)];
            p.flat("pool", format!("pool_max_grad_{t}"), y.numel() as u64, args);
        }
        _ => {
            let dy = p.input(0)?;
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(y)),
                Arg::I64(planes as i64),
                Arg::Window(win),
                Arg::I32(a.count_include_pad as i32),
            ];
            p.flat("pool", format!("pool_avg_grad_{t}"), y.numel() as u64, args);
        }
    }
    Ok(())
}

/// RoiAlign (`grad` false: X, rois, batch indices → Y) or ai.mpc::RoiAlignGrad (dY, X, rois,
/// batch indices → dX): kernels/pool.cu's roi_align kernels.
pub(super) fn plan_roi_align(p: &mut Planner, a: &mpc_ir::ops::RoiAlignAttrs, grad: bool) -> Result<(), String> {
    let at = usize::from(grad);
    let (x, rois, batch) = (p.input(at)?, p.input(at + 1)?, p.input(at + 2)?);
    let [_, c, h, w] = x.shape[..] else { return Err("RoiAlign's X is not of rank 4".into()) };
    if rois.dtype != x.dtype || batch.dtype != DType::I64 {
        return Err(format!("RoiAlign of {} rois and {} batch indices on {}", rois.dtype, batch.dtype, x.dtype));
    }
    let t = float_tag(x.dtype)?;
    let sizes = [rois.shape[0], c, h, w, a.output_height as usize, a.output_width as usize];
    let mut args: Vec<Arg> = sizes.iter().map(|&n| Arg::I64(n as i64)).collect();
    args.extend([
        Arg::I64(a.sampling_ratio),
        Arg::F32(a.spatial_scale),
        Arg::I32((a.coordinate_transformation_mode == mpc_ir::ops::RoiCoordinates::HalfPixel) as i32),
        Arg::I32((a.mode == mpc_ir::ops::RoiMode::Max) as i32),
    ]);
    let outputs = rois.shape[0] as u64 * (c as u64) * a.output_height as u64 * a.output_width as u64;
    let head = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(rois)), Arg::Ptr(buf(batch))];
    if !grad {
        let y = p.output(0)?;
        let args = [head, vec![Arg::Ptr(buf(y))], args].concat();
        p.flat("pool", format!("roi_align_{t}"), outputs, args);
        return Ok(());
    }
    // dX by atomic additions: into dX itself (f32, f64), or an f32 workspace cast after.
    let (dy, dx) = (p.input(0)?, p.output(0)?);
    let wide = matches!(x.dtype, DType::F16 | DType::BF16);
    let acc = if wide { p.work(x.numel() as u64 * 4) } else { buf(dx) };
    let bytes = x.numel() as u64 * if wide { 4 } else { x.dtype.size() as u64 };
    p.out.calls.push(Call::Fill { to: acc, bytes, byte: 0 });
    let args = [vec![Arg::Ptr(buf(dy))], head, vec![Arg::Ptr(acc)], args].concat();
    p.flat("pool", format!("roi_align_grad_{t}"), outputs, args);
    if wide {
        p.cast(DType::F32, x.dtype, acc, buf(dx), x.numel() as u64)?;
    }
    Ok(())
}
