//! Plans of max and average pooling and their gradients.

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
