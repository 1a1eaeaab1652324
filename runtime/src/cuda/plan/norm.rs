//! Plans of layer, batch, instance and group normalisation and their gradients.

use super::*;

/// The (data, parameter) dtype suffix of the norm kernels.
fn norm_tags(x: DType, param: DType) -> Result<String, String> {
    match (x, param) {
        (DType::F32, DType::F32)
        | (DType::F16, DType::F16)
        | (DType::BF16, DType::BF16)
        | (DType::F16, DType::F32)
        | (DType::BF16, DType::F32)
        | (DType::F64, DType::F64) => Ok(format!("{}_{}", tag(x)?, tag(param)?)),
        _ => Err(format!("normalisation of {x} data with {param} parameters")),
    }
}

/// Channels of many elements (a ResNet's batch norms before its last stage: 64 to 512 channels
/// of 50,000 to 800,000 elements): the splits of each channel's elements that its statistics and
/// sums are taken over in passes, so that about [`BN_BLOCKS`] blocks are in flight, each over at
/// least 4096 elements. One block per channel leaves most of the GPU idle, each thread walking
/// thousands of elements (256 channels of 64 × 56 × 56: 256 blocks, two per multiprocessor);
/// 1024 channels and more are enough blocks on their own.
fn bn_splits(c: u64, count: u64) -> Option<u64> {
    let splits = BN_BLOCKS.div_ceil(c.max(1)).min(count / 4096);
    (splits >= 2).then_some(splits)
}

/// The blocks a batch norm's passes aim for: about one full wave of 256-thread blocks on a
/// 132-multiprocessor GPU (8 resident each).
const BN_BLOCKS: u64 = 1024;

fn bn_grid(c: u64, splits: u64) -> [u32; 3] {
    [splits.min(MAX_ROWS) as u32, c.min(MAX_ROWS) as u32, 1]
}

/// The arguments every pass takes: the dims, the splits and whether elements move 16 bytes at a
/// time ([`bn_vec`]).
fn bn_dims(n: u64, c: u64, inner: u64, splits: u64, vec: bool) -> [Arg; 5] {
    [Arg::I64(n as i64), Arg::I64(c as i64), Arg::I64(inner as i64), Arg::I64(splits as i64), Arg::I32(vec as i32)]
}

/// Whether a batch norm's passes move `x`-shaped tensors 16 bytes at a time: each plane a whole
/// number of 16-byte vectors, and every tensor starting on one.
fn bn_vec(wide: bool, inner: u64, ts: &[&TensorRef]) -> bool {
    let v = 16 / ts[0].dtype.size() as u64;
    wide && inner % v == 0 && ts.iter().all(|t| t.offset % 16 == 0)
}

/// The statistics pass (with the gradient's sums where `dy` is given, read through the ReLU's
/// gradient where its output is given beside it): per (channel, split), in `splits * c`
/// workspace entries each, the count, mean and sum of squared deviations, and the sums of dy and
/// of dy (x - mean).
fn bn_stats(
    p: &mut Planner,
    dy: Option<(&TensorRef, Arg)>,
    x: &TensorRef,
    dims: [Arg; 5],
    c: u64,
    splits: u64,
) -> Result<Vec<Buf>, String> {
    let a = acc_dtype(x.dtype).size() as u64;
    let parts: Vec<Buf> = (0..if dy.is_some() { 5 } else { 3 }).map(|_| p.work(c * splits * a)).collect();
    let t = float_tag(x.dtype)?;
    let grad = dy.is_some();
    let mut args: Vec<Arg> = dy.into_iter().flat_map(|(t, ry)| [Arg::Ptr(buf(t)), ry]).collect();
    args.push(Arg::Ptr(buf(x)));
    args.extend(parts.iter().map(|&b| Arg::Ptr(b)));
    args.extend(dims);
    let name = if grad { format!("norm_bn_grad_stats_{t}") } else { format!("norm_bn_stats_{t}") };
    p.kernel("norm", name, bn_grid(c, splits), [BLOCK, 1, 1], args);
    Ok(parts)
}

/// A norm kernel's operand of `like`'s dtype and shape beside its own (a batch norm's residual,
/// the ReLU output its gradient reads dy through), where the launch has one.
fn operand_like(o: Option<&Operand>, like: &TensorRef, what: &str) -> Result<Option<TensorRef>, String> {
    match o {
        None => Ok(None),
        Some(Operand::Device(t)) if t.dtype == like.dtype && t.shape == like.shape => Ok(Some(t.clone())),
        Some(_) => Err(format!("{what} not shaped as {:?}", like.shape)),
    }
}

/// The per-channel kernels of the finish: one thread each.
fn channels_grid(c: u64) -> [u32; 3] {
    [c.div_ceil(BLOCK as u64).clamp(1, MAX_ROWS) as u32, 1, 1]
}

/// The kernel-name suffix of a layer norm whose `what` (y written, or dy read) is f16 or bf16
/// beside f32 data (`_yf16`, `_dybf16`: kernels/norm.cu), or none when it has the data's dtype.
fn low_suffix(what: &str, x: &TensorRef, t: &TensorRef) -> Result<String, String> {
    match (x.dtype, t.dtype) {
        (a, b) if a == b => Ok(String::new()),
        (DType::F32, DType::F16 | DType::BF16) if t.shape == x.shape => Ok(format!("_{what}{}", tag(t.dtype)?)),
        (a, b) => Err(format!("a layer norm of {a}{:?} data with {what} {b}{:?}", x.shape, t.shape)),
    }
}

/// A statistics output of LayerNormalization, and the workspace (in the kernel's accumulator
/// dtype) to cast into it.
type Stat<'t> = (Arg, Option<(Buf, &'t TensorRef)>);

pub(super) fn plan_norm(p: &mut Planner) -> Result<(), String> {
    match &p.l.op.clone() {
        Op::LayerNormalization(a) => plan_layer_norm(p, a),
        Op::LayerNormalizationGrad(a) => plan_layer_norm_grad(p, a),
        Op::BatchNormalization(a) => plan_batch_norm(p, a),
        Op::BatchNormalizationGrad(a) => plan_batch_norm_grad(p, a),
        op @ (Op::InstanceNormalization(_) | Op::GroupNormalization(_)) => plan_instance_or_group_norm(p, op),
        _ => unreachable!("not a normalisation"),
    }
}

/// LayerNormalization: a row kernel writing y and, in its accumulator dtype, Mean and InvStdDev (cast into place where their dtype differs).
fn plan_layer_norm(p: &mut Planner, a: &mpc_ir::ops::LayerNormAttrs) -> Result<(), String> {
    let (x, scale, y) = (p.input(0)?, p.input(1)?, p.output(0)?);
    let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
    let (rows, n, _) = split3(&x.shape, ax, x.shape.len());
    let bias = p.opt_input(2).map_or(Arg::Null, |b| Arg::Ptr(buf(b)));
    // Mean and InvStdDev come from the kernel in its accumulator dtype; another dtype is
    // cast into place.
    let outputs = &p.l.outputs;
    let acc = acc_dtype(x.dtype);
    let stat = |p: &mut Planner, i: usize| -> Result<Stat, String> {
        match outputs.get(i) {
            None => Ok((Arg::Null, None)),
            Some(t) if t.dtype == acc => Ok((Arg::Ptr(buf(t)), None)),
            Some(t) => {
                let w = p.work(rows * acc.size() as u64);
                Ok((Arg::Ptr(w), Some((w, t))))
            }
        }
    };
    let (mean, mean_cast) = stat(p, 1)?;
    let (inv, inv_cast) = stat(p, 2)?;
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(scale)),
        bias,
        Arg::Ptr(buf(y)),
        mean,
        inv,
        Arg::I64(rows as i64),
        Arg::I64(n as i64),
        Arg::I64(scale.numel() as i64),
        Arg::F32(a.epsilon),
    ];
    let name = format!("norm_layer_norm_{}{}", norm_tags(x.dtype, scale.dtype)?, low_suffix("y", x, y)?);
    p.kernel("norm", name, rows_grid(rows), [BLOCK, 1, 1], args);
    for (w, t) in [mean_cast, inv_cast].into_iter().flatten() {
        p.cast(acc, t.dtype, w, buf(t), rows)?;
    }
    Ok(())
}

/// LayerNormalization's gradient: dx by rows, and the scale's and bias's gradients by feature (split across blocks for few long columns, then summed).
fn plan_layer_norm_grad(p: &mut Planner, a: &mpc_ir::ops::LayerNormAttrs) -> Result<(), String> {
    let ((dy, _), x, scale) = (p.input_or_widened(0)?, p.input(1)?, p.input(2)?);
    let ax = normalize_axis(a.axis, x.shape.len()).ok_or("axis out of range")?;
    let (rows, n, _) = split3(&x.shape, ax, x.shape.len());
    let tags = format!("{}{}", norm_tags(x.dtype, scale.dtype)?, low_suffix("dy", x, dy)?);
    let acc = acc_dtype(x.dtype).size() as u64;
    let (ws_mean, ws_inv) = (p.work(rows * acc), p.work(rows * acc));
    let dx = p.l.outputs.first().map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
    let args = vec![
        Arg::Ptr(buf(dy)),
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(scale)),
        dx,
        Arg::Ptr(ws_mean),
        Arg::Ptr(ws_inv),
        Arg::I64(rows as i64),
        Arg::I64(n as i64),
        Arg::I64(scale.numel() as i64),
        Arg::F32(a.epsilon),
    ];
    p.kernel("norm", format!("norm_layer_norm_grad_{tags}"), rows_grid(rows), [BLOCK, 1, 1], args);
    if let Some(ds) = p.l.outputs.get(1) {
        let db = p.l.outputs.get(2);
        let sn = scale.numel() as u64;
        // Few, long columns (768 features over thousands of tokens): the pairs are split
        // across blocks too, and each feature's partials added in a second pass.
        let total = rows * (n / sn.max(1));
        let blocks = sn.div_ceil(32);
        if blocks < 256 && total >= 512 {
            let splits = (512 / blocks).clamp(2, total / 128);
            let part = |p: &mut Planner| p.work(sn * splits * acc);
            let (ps, pb) = (part(p), db.map(|_| part(p)));
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(x)),
                Arg::Ptr(ws_mean),
                Arg::Ptr(ws_inv),
                Arg::Ptr(ps),
                pb.map_or(Arg::Null, Arg::Ptr),
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(sn as i64),
                Arg::I64(splits as i64),
            ];
            let grid = [blocks as u32, splits.min(MAX_ROWS) as u32, 1];
            p.kernel("norm", format!("norm_layer_norm_grad_params_split_{tags}"), grid, [32, 8, 1], args);
            for (part, out) in [(Some(ps), Some(ds)), (pb, db)] {
                if let (Some(part), Some(out)) = (part, out) {
                    let args = vec![
                        Arg::Ptr(part),
                        Arg::Ptr(buf(out)),
                        Arg::I64(sn as i64),
                        Arg::I64(splits as i64),
                        Arg::I64(total as i64),
                    ];
                    let name = format!("reduce_sum_finish_{}", float_tag(out.dtype)?);
                    p.kernel("reduce", name, rows_grid(sn), [32, 1, 1], args);
                }
            }
        } else {
            let args = vec![
                Arg::Ptr(buf(dy)),
                Arg::Ptr(buf(x)),
                Arg::Ptr(ws_mean),
                Arg::Ptr(ws_inv),
                Arg::Ptr(buf(ds)),
                db.map_or(Arg::Null, |t| Arg::Ptr(buf(t))),
                Arg::I64(rows as i64),
                Arg::I64(n as i64),
                Arg::I64(sn as i64),
            ];
            let grid = [blocks as u32, 1, 1];
            p.kernel("norm", format!("norm_layer_norm_grad_params_{tags}"), grid, [32, 8, 1], args);
        }
    }
    Ok(())
}

/// BatchNormalization, training (statistics in passes over split channels, or a block per channel) or inference (element-wise), with its fused residual Add and Relu.
fn plan_batch_norm(p: &mut Planner, a: &mpc_ir::ops::BatchNormAttrs) -> Result<(), String> {
    let (x, scale, bias, mean, var, y) =
        (p.input(0)?, p.input(1)?, p.input(2)?, p.input(3)?, p.input(4)?, p.output(0)?);
    if x.shape.len() < 2 {
        return Err("BatchNormalization of a tensor of rank below 2".into());
    }
    let (n, c, inner) = split3(&x.shape, 1, 2);
    let tags = norm_tags(x.dtype, scale.dtype)?;
    let ptr = |t: &TensorRef| Arg::Ptr(buf(t));
    // A Relu applied as y is written (the launch's epilogue, or after its residual Add),
    // and the residual added before it.
    let relu =
        Arg::I32(matches!((&p.l.epilogue, &p.l.epilogue_then), (Some(Op::Relu), _) | (_, Some(Op::Relu))) as i32);
    let add = p.l.epilogue_operand.as_ref().filter(|_| matches!(p.l.epilogue, Some(Op::Add)));
    let res = operand_like(add, y, "a batch norm's residual")?;
    let res_arg = res.as_ref().map_or(Arg::Null, ptr);
    if a.training_mode {
        let rm = p.l.outputs.get(1).map_or(Arg::Null, ptr);
        let rv = p.l.outputs.get(2).map_or(Arg::Null, ptr);
        if rm == Arg::Null || rv == Arg::Null {
            return Err("training-mode BatchNormalization without its running statistics outputs".into());
        }
        if let Some(splits) = bn_splits(c, n * inner) {
            // One pass for the sums, a thread per channel for the statistics (and the
            // running ones), one element-wise pass for y.
            let vec = bn_vec(p.opts.wide, inner, &[x, y].into_iter().chain(res.as_ref()).collect::<Vec<_>>());
            let parts = bn_stats(p, None, x, bn_dims(n, c, inner, splits, vec), c, splits)?;
            let acc = acc_dtype(x.dtype).size() as u64;
            let (m, k) = (p.work(c * acc), p.work(c * acc));
            let mut args: Vec<Arg> = parts.iter().map(|&b| Arg::Ptr(b)).collect();
            args.extend([ptr(scale), ptr(mean), ptr(var), Arg::Ptr(m), Arg::Ptr(k), rm, rv]);
            args.extend([Arg::I64(c as i64), Arg::I64(splits as i64)]);
            args.extend([Arg::F32(a.epsilon), Arg::F32(a.momentum)]);
            p.kernel("norm", format!("norm_bn_finish_{tags}"), channels_grid(c), [BLOCK, 1, 1], args);
            let args = vec![
                ptr(x),
                Arg::Ptr(m),
                Arg::Ptr(k),
                ptr(bias),
                res_arg,
                ptr(y),
                Arg::I64(n as i64),
                Arg::I64(c as i64),
                Arg::I64(inner as i64),
                Arg::I32(vec as i32),
                relu,
            ];
            let units = x.numel() as u64 / if vec { 16 / x.dtype.size() as u64 } else { 1 };
            p.flat("norm", format!("norm_bn_apply_{tags}"), units, args);
            return Ok(());
        }
        let args = vec![
            ptr(x),
            ptr(scale),
            ptr(bias),
            ptr(mean),
            ptr(var),
            res_arg,
            ptr(y),
            rm,
            rv,
            Arg::Null,
            Arg::Null,
            Arg::I64(n as i64),
            Arg::I64(c as i64),
            Arg::I64(inner as i64),
            Arg::F32(a.epsilon),
            Arg::F32(a.momentum),
            relu,
        ];
        p.kernel("norm", format!("norm_batch_norm_train_{tags}"), rows_grid(c), [BLOCK, 1, 1], args);
    } else {
        let args = vec![
            ptr(x),
            ptr(scale),
            ptr(bias),
            ptr(mean),
            ptr(var),
            res_arg,
            ptr(y),
            Arg::I64(n as i64),
            Arg::I64(c as i64),
            Arg::I64(inner as i64),
            Arg::F32(a.epsilon),
            relu,
        ];
        p.flat("norm", format!("norm_batch_norm_infer_{tags}"), x.numel() as u64, args);
    }
    Ok(())
}

/// BatchNormalization's gradient (dy read through the ReLU's gradient where the launch says), in passes over split channels or a block per channel.
fn plan_batch_norm_grad(p: &mut Planner, a: &mpc_ir::ops::EpsilonAttrs) -> Result<(), String> {
    let (dy, x, scale) = (p.input(0)?, p.input(1)?, p.input(2)?);
    let tags = norm_tags(x.dtype, scale.dtype)?;
    let c = x.shape.get(1).copied().unwrap_or(1) as u64;
    let inner = numel(&x.shape[2.min(x.shape.len())..]);
    let out = |i: usize| p.l.outputs.get(i).map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
    let n = x.shape.first().copied().unwrap_or(1) as u64;
    // dy read through the ReLU's gradient ([`Launch::relu_prologue`]), from its output.
    let ry = operand_like(p.l.relu_prologue.as_ref(), dy, "a batch norm gradient's ReLU output")?;
    let ry_arg = ry.as_ref().map_or(Arg::Null, |t| Arg::Ptr(buf(t)));
    if let Some(splits) = bn_splits(c, n * inner) {
        // One pass over x and dy for the sums, a thread per channel for the parameters'
        // gradients and dx's coefficients, one element-wise pass for dx.
        let dx = p.l.outputs.first().cloned();
        let vec =
            bn_vec(p.opts.wide, inner, &[x, dy].into_iter().chain(dx.as_ref()).chain(ry.as_ref()).collect::<Vec<_>>());
        let dims = bn_dims(n, c, inner, splits, vec);
        let parts = bn_stats(p, Some((dy, ry_arg)), x, dims, c, splits)?;
        let acc = acc_dtype(x.dtype).size() as u64;
        let coef: Vec<Buf> = (0..4).map(|_| p.work(c * acc)).collect();
        let mut args: Vec<Arg> = parts.iter().map(|&b| Arg::Ptr(b)).collect();
        args.push(Arg::Ptr(buf(scale)));
        args.extend(coef.iter().map(|&b| Arg::Ptr(b)));
        args.extend([out(1), out(2)]);
        args.extend([Arg::I64(c as i64), Arg::I64(splits as i64)]);
        args.push(Arg::F32(a.epsilon));
        p.kernel("norm", format!("norm_bn_grad_finish_{tags}"), channels_grid(c), [BLOCK, 1, 1], args);
        if let Some(dx) = dx {
            let mut args = vec![Arg::Ptr(buf(dy)), ry_arg, Arg::Ptr(buf(x))];
            args.extend(coef.iter().map(|&b| Arg::Ptr(b)));
            args.extend([Arg::Ptr(buf(&dx)), Arg::I64(n as i64), Arg::I64(c as i64), Arg::I64(inner as i64)]);
            args.push(Arg::I32(vec as i32));
            let units = x.numel() as u64 / if vec { 16 / x.dtype.size() as u64 } else { 1 };
            p.flat("norm", format!("norm_bn_grad_apply_{}", float_tag(x.dtype)?), units, args);
        }
        return Ok(());
    }
    let args = vec![
        Arg::Ptr(buf(dy)),
        ry_arg,
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(scale)),
        out(0),
        out(1),
        out(2),
        Arg::I64(x.shape[0] as i64),
        Arg::I64(c as i64),
        Arg::I64(inner as i64),
        Arg::F32(a.epsilon),
    ];
    p.kernel("norm", format!("norm_batch_norm_grad_{tags}"), rows_grid(c), [BLOCK, 1, 1], args);
    Ok(())
}

/// InstanceNormalization and GroupNormalization: a block per (sample, channel or group).
fn plan_instance_or_group_norm(p: &mut Planner, op: &Op) -> Result<(), String> {
    let (x, scale, bias, y) = (p.input(0)?, p.input(1)?, p.input(2)?, p.output(0)?);
    let tags = norm_tags(x.dtype, scale.dtype)?;
    let (n, c) = (x.shape[0] as u64, x.shape.get(1).copied().unwrap_or(1) as u64);
    let inner = numel(&x.shape[2.min(x.shape.len())..]);
    let mut args = vec![Arg::Ptr(buf(x)), Arg::Ptr(buf(scale)), Arg::Ptr(buf(bias)), Arg::Ptr(buf(y))];
    args.extend([Arg::I64(n as i64), Arg::I64(c as i64)]);
    match op {
        Op::InstanceNormalization(a) => {
            args.extend([Arg::I64(inner as i64), Arg::F32(a.epsilon)]);
            p.kernel("norm", format!("norm_instance_norm_{tags}"), rows_grid(n * c), [BLOCK, 1, 1], args);
        }
        Op::GroupNormalization(a) => {
            let groups = a.num_groups as u64;
            args.extend([Arg::I64(groups as i64), Arg::I64(inner as i64), Arg::F32(a.epsilon)]);
            p.kernel("norm", format!("norm_group_norm_{tags}"), rows_grid(n * groups), [BLOCK, 1, 1], args);
        }
        _ => unreachable!(),
    }
    Ok(())
}

pub(super) fn plan_lrn(p: &mut Planner, a: &mpc_ir::ops::LrnAttrs) -> Result<(), String> {
    let (x, y) = (p.input(0)?, p.output(0)?);
    if x.shape.len() < 2 {
        return Err("LRN of a tensor of rank below 2".into());
    }
    let (n, c) = (x.numel() as u64, x.shape[1] as i64);
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(y)),
        Arg::I64(n as i64),
        Arg::I64(c),
        Arg::I64(numel(&x.shape[2..]) as i64),
        Arg::I64(a.size),
        Arg::F32(a.alpha),
        Arg::F32(a.beta),
        Arg::F32(a.bias),
    ];
    p.flat("norm", format!("norm_lrn_{}", float_tag(x.dtype)?), n, args);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::bn_splits;

    /// ResNet-50's batch norms at batch 64 (channels, elements per channel): those of up to 512
    /// channels over 50,000 elements or more are taken in passes of at least 1024 blocks; the
    /// last stage's have enough channels, or too few elements to split.
    #[test]
    fn wide_batch_norms_are_split_until_a_wave_of_blocks_is_in_flight() {
        let count = |hw: u64| 64 * hw * hw;
        for (c, hw, want) in [
            (64, 112, Some(16)),
            (64, 56, Some(16)),
            (256, 56, Some(4)),
            (128, 28, Some(8)),
            (512, 28, Some(2)),
            (256, 14, Some(3)),
            (1024, 14, None),
            (512, 7, None),
            (2048, 7, None),
        ] {
            assert_eq!(bn_splits(c, count(hw)), want, "{c} channels of {hw}²");
            if let Some(s) = want {
                assert!(c * s >= 768 && count(hw) / s >= 4096, "{c} channels of {hw}²");
            }
        }
        assert_eq!(bn_splits(3, 4 * 80 * 80), Some(6));
    }
}
