//! Plans of reductions: one pass, two passes for long rows or few long columns, a transposed copy
//! first for axes that are not adjacent.

use super::*;

pub(super) fn plan_reduce(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let (x, y) = (p.input(0)?, p.output(0)?);
    let kind = reduce_kind(&op).expect("a reduction");
    let r = x.shape.len();
    let axes: Vec<usize> = match op.reduction() {
        None => (2..r).collect(), // the global pools: the spatial axes
        Some((_, a)) => match mpc_ir::geometry::reduce_axes(p.host_ints(1).as_deref(), r, a.noop_with_empty_axes)? {
            Some(axes) => axes,
            // Nothing reduced, the element-wise part still applied: a reduction over no axes.
            None if kind.applies_elementwise() => Vec::new(),
            None => {
                p.copy(buf(x), buf(y), y.bytes());
                return Ok(());
            }
        },
    };
    let t = if x.dtype.is_float() {
        float_tag(x.dtype)?
    } else if matches!(kind, ReduceKind::Sum | ReduceKind::Max | ReduceKind::Min | ReduceKind::Prod) {
        tag(x.dtype)?
    } else {
        return Err(format!("{} on {}", op.op_type(), x.dtype));
    };
    let (src, outer, reduced, inner) = reduce_layout(p, x, &axes)?;
    if x.dtype == DType::Bool && reduced == 0 {
        // An empty extent: max is false and min is true (the u8 kernels would give 0 and 255).
        let byte = (kind == ReduceKind::Min) as u8;
        p.out.calls.push(Call::Fill { to: buf(y), bytes: y.bytes(), byte });
        return Ok(());
    }
    reduce_launches(p, x, y, kind, t, src, [outer, reduced, inner]);
    Ok(())
}

/// `x` as `(outer, reduced, inner)` for a reduction over `axes`: as it lies where the reduced
/// dims are one block of the dims that are not 1, else a transposed copy with the kept dims in
/// front.
fn reduce_layout(p: &mut Planner, x: &TensorRef, axes: &[usize]) -> Result<(Buf, u64, u64, u64), String> {
    let r = x.shape.len();
    // The reduced dims must be one block of the dims that are not 1: then x is (outer, reduced,
    // inner) as it lies; otherwise the kept dims are moved in front first.
    let big: Vec<usize> = (0..r).filter(|&d| x.shape[d] != 1).collect();
    let marks: Vec<bool> = big.iter().map(|d| axes.contains(d)).collect();
    let first = marks.iter().position(|&m| m);
    let last = marks.iter().rposition(|&m| m);
    let block = match (first, last) {
        (Some(f), Some(l)) => marks[f..=l].iter().all(|&m| m),
        _ => true,
    };
    Ok(if block {
        let reduced: u64 = axes.iter().map(|&d| x.shape[d] as u64).product();
        let (outer, inner) = match first {
            Some(f) => (numel(&x.shape[..big[f]]), numel(&x.shape[big[last.unwrap_or(f)] + 1..])),
            None => (numel(&x.shape) / reduced.max(1), 1),
        };
        (buf(x), outer, reduced, inner)
    } else {
        let kept: Vec<usize> = (0..r).filter(|d| !axes.contains(d)).collect();
        let perm: Vec<usize> = kept.iter().chain(axes).copied().collect();
        let dims: Vec<usize> = perm.iter().map(|&d| x.shape[d]).collect();
        let xs = contiguous(&x.shape);
        let xs: Vec<i64> = perm.iter().map(|&d| xs[d]).collect();
        let w = p.work(x.bytes());
        p.strided_copy(x.dtype, buf(x), w, &dims, &xs, &contiguous(&dims))?;
        let outer = numel(&dims[..kept.len()]);
        (w, outer, numel(&dims[kept.len()..]), 1)
    })
}

/// The launches of a reduction of `src`, `(outer, reduced, inner)` as it lies, into `y`: one
/// pass, or two for long rows or few long columns.
fn reduce_launches(
    p: &mut Planner,
    x: &TensorRef,
    y: &TensorRef,
    kind: ReduceKind,
    t: &str,
    src: Buf,
    [outer, reduced, inner]: [u64; 3],
) {
    let shape_args = [Arg::I64(outer as i64), Arg::I64(reduced as i64), Arg::I64(inner as i64)];
    let (splittable, kind) = (kind != ReduceKind::LogSumExp, kind.name());
    if inner == 1 && reduced >= 65536 && outer < 64 && splittable {
        // Long rows and few of them: a two-pass reduction.
        let splits = reduced.div_ceil(16384).min(1024);
        let acc = if x.dtype == DType::F64 || !x.dtype.is_float() { 8 } else { 4 };
        let part = p.work(outer * splits * acc);
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(part)];
        args.extend(shape_args);
        args.push(Arg::I64(splits as i64));
        p.kernel("reduce", format!("reduce_{kind}_split_{t}"), rows_grid(outer * splits), [BLOCK, 1, 1], args);
        let args = vec![
            Arg::Ptr(part),
            Arg::Ptr(buf(y)),
            Arg::I64(outer as i64),
            Arg::I64(splits as i64),
            Arg::I64(reduced as i64),
        ];
        p.kernel("reduce", format!("reduce_{kind}_finish_{t}"), rows_grid(outer), [BLOCK, 1, 1], args);
    } else if inner >= 32 && inner.div_ceil(32) * outer < 256 && reduced >= 512 && splittable && x.dtype.size() > 1 {
        // Few columns, long ones (a bias gradient: a (tokens, features) matrix summed over its
        // rows): the rows are split too, so that enough blocks are in flight, and the partials
        // combined in a fixed order.
        let blocks = inner.div_ceil(32) * outer;
        let splits = (512 / blocks).clamp(2, reduced / 128);
        let acc = if x.dtype == DType::F64 || !x.dtype.is_float() { 8 } else { 4 };
        let part = p.work(outer * inner * splits * acc);
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(part)];
        args.extend(shape_args);
        args.push(Arg::I64(splits as i64));
        let grid = [inner.div_ceil(32) as u32, (outer * splits).min(MAX_ROWS) as u32, 1];
        p.kernel("reduce", format!("reduce_{kind}_cols_split_{t}"), grid, [32, 8, 1], args);
        let args = vec![
            Arg::Ptr(part),
            Arg::Ptr(buf(y)),
            Arg::I64((outer * inner) as i64),
            Arg::I64(splits as i64),
            Arg::I64(reduced as i64),
        ];
        p.kernel("reduce", format!("reduce_{kind}_finish_{t}"), rows_grid(outer * inner), [32, 1, 1], args);
    } else if inner >= 32 {
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(buf(y))];
        args.extend(shape_args);
        let grid = [inner.div_ceil(32) as u32, outer.clamp(1, MAX_ROWS) as u32, 1];
        p.kernel("reduce", format!("reduce_{kind}_cols_{t}"), grid, [32, 8, 1], args);
    } else {
        let mut args = vec![Arg::Ptr(src), Arg::Ptr(buf(y))];
        args.extend(shape_args);
        p.kernel("reduce", format!("reduce_{kind}_rows_{t}"), rows_grid(outer * inner), [BLOCK, 1, 1], args);
    }
}

/// Softmax, LogSoftmax and the softmax gradient ([`Kind::RowWise`](mpc_ir::Kind::RowWise)).
pub(super) fn plan_row_wise(p: &mut Planner) -> Result<(), String> {
    let op = &p.l.op;
    let a = match op {
        Op::Softmax(a) | Op::LogSoftmax(a) => a,
        Op::SoftmaxGrad(a) => &**a,
        _ => unreachable!(),
    };
    let grad = matches!(op, Op::SoftmaxGrad(_));
    // SoftmaxGrad may read dy and y widened from f16/bf16 into an f32 gradient.
    let (x, x_wide) = if grad { p.input_or_widened(1)? } else { (p.input(0)?, false) };
    let (dy, dy_wide) = if grad { p.input_or_widened(0)? } else { (x, false) };
    let y = p.output(0)?;
    let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
    let (outer, n, inner) = split3(&x.shape, ax, ax + 1);
    let name = match op {
        Op::Softmax(_) => "softmax",
        Op::LogSoftmax(_) => "log_softmax",
        _ => "softmax_grad",
    };
    let mut args = vec![Arg::Ptr(buf(x))];
    if grad {
        args.insert(0, Arg::Ptr(buf(dy)));
    }
    args.extend([Arg::Ptr(buf(y)), Arg::I64(outer as i64), Arg::I64(n as i64), Arg::I64(inner as i64)]);
    let block = row_block(n);
    let kernel = if x_wide || dy_wide {
        let (dt, xt) = (float_tag(dy.dtype)?, float_tag(x.dtype)?);
        let low = |d: DType| matches!(d, DType::F16 | DType::BF16);
        let pair = (dy.dtype == x.dtype || !low(dy.dtype) || !low(x.dtype)) && (low(dy.dtype) || low(x.dtype));
        if y.dtype != DType::F32 || !pair {
            return Err(format!("a {} SoftmaxGrad reading {} dy and {} y", y.dtype, dy.dtype, x.dtype));
        }
        format!("softmax_softmax_grad_wide_{dt}_{xt}")
    } else {
        format!("softmax_{name}_{}", float_tag(x.dtype)?)
    };
    p.kernel("softmax", kernel, rows_grid(outer * inner), [block, 1, 1], args);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::Launch;

    #[test]
    fn reductions_over_one_block_of_dims_need_no_transpose() {
        use mpc_ir::ops::ReduceAttrs;
        let t =
            |shape: &[usize]| TensorRef { region: Region::Arena, offset: 0, dtype: DType::F32, shape: shape.to_vec() };
        let launch = |axes: Vec<i64>, out: &[usize]| {
            Launch::new(
                "r",
                Op::ReduceSum(ReduceAttrs { keepdims: true, noop_with_empty_axes: false }),
                vec![
                    Operand::Device(t(&[4, 1, 6, 8])),
                    Operand::Host(HostTensor::from_i64(DType::I64, vec![axes.len()], axes)),
                ],
                vec![t(out)],
            )
        };
        let none = |_: &TensorRef| None;
        // Axes 1 and 2 (1 has size 1): one block, rows of 6 read with stride 8 (cols).
        let plan1 = plan(&launch(vec![1, 2], &[4, 1, 1, 8]), &none).unwrap();
        assert_eq!(plan1.calls.len(), 1);
        let Call::Kernel(k) = &plan1.calls[0] else { panic!() };
        assert_eq!(k.name, "reduce_sum_rows_f32");
        assert_eq!(&k.args[2..5], &[Arg::I64(4), Arg::I64(6), Arg::I64(8)]);
        // Axes 0 and 3 are not adjacent: a transposed copy first.
        let plan2 = plan(&launch(vec![0, 3], &[1, 1, 6, 1]), &none).unwrap();
        assert_eq!(plan2.calls.len(), 2);
        assert!(plan2.workspace >= 4 * 6 * 8 * 4);
        let Call::Kernel(k) = &plan2.calls[1] else { panic!() };
        assert_eq!(&k.args[2..5], &[Arg::I64(6), Arg::I64(32), Arg::I64(1)]);
    }
}
