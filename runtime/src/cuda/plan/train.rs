//! Plans of losses and their gradients, and the training ops of the ai.mpc domain.

use super::*;

/// An update's low-precision copy of its parameter (input `input`, next value output `output`):
/// the next value's buffer, the copy's and its `low_code` (kernels/train.cu), or None.
fn low_copy(p: &Planner, input: usize, output: usize, param: &TensorRef) -> Result<Option<(Buf, Buf, i32)>, String> {
    let Some(low) = p.opt_input(input) else { return Ok(None) };
    let out = p.output(output)?;
    let code = match low.dtype {
        DType::F16 => 1,
        DType::BF16 => 2,
        d => return Err(format!("a {d} low-precision copy")),
    };
    if param.dtype != DType::F32 || low.shape != param.shape || out.dtype != low.dtype || out.shape != low.shape {
        return Err(format!(
            "a {}{:?} low-precision copy of a {}{:?} parameter",
            low.dtype, low.shape, param.dtype, param.shape
        ));
    }
    Ok(Some((buf(out), buf(low), code)))
}

/// An update's trailing arguments for [`low_copy`]: `low_out, low, low_code`; nulls and 0
/// without a copy.
fn low_copy_args(p: &Planner, input: usize, output: usize, param: &TensorRef) -> Result<[Arg; 3], String> {
    Ok(match low_copy(p, input, output, param)? {
        Some((out, low, code)) => [Arg::Ptr(out), Arg::Ptr(low), Arg::I32(code)],
        None => [Arg::Null, Arg::Null, Arg::I32(0)],
    })
}

/// The dtype code of a multi-tensor kernel's tables (kernels/train.cu): 0 f32, 1 f16, 2 bf16,
/// 3 f64.
fn float_code(d: DType) -> Result<i32, String> {
    match d {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        DType::F64 => Ok(3),
        d => Err(format!("a multi-tensor launch over {d}")),
    }
}

/// What a loss and its gradient share: the scores (read widened or not), labels, optional class
/// weights, the `(n, c, inner)` split of the scores and the kernels' common arguments.
struct LossShape<'a> {
    scores: &'a TensorRef,
    widened: bool,
    labels: &'a TensorRef,
    weights: Arg,
    softmax: bool,
    /// The index of the scores among the inputs (1 in a gradient, after dloss).
    base: usize,
    c: u64,
    positions: u64,
    /// The scores' and the labels' dtype tags.
    t: &'static str,
    it: &'static str,
    /// 0 none, 1 sum, 2 mean (kernels/loss.cu).
    reduction: i32,
    ignore: [Arg; 2],
    dims: [Arg; 3],
    block: u32,
    /// The size of one accumulator element.
    acc: u64,
}

pub(super) fn plan_loss(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    let a = match &op {
        Op::SoftmaxCrossEntropyLoss(a) | Op::NegativeLogLikelihoodLoss(a) => a,
        Op::SoftmaxCrossEntropyLossGrad(a) | Op::NegativeLogLikelihoodLossGrad(a) => &**a,
        _ => unreachable!("not a loss"),
    };
    let grad = matches!(op, Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_));
    let softmax = matches!(op, Op::SoftmaxCrossEntropyLoss(_) | Op::SoftmaxCrossEntropyLossGrad(_));
    let base = grad as usize;
    // Scores read widened: the f32 loss of f16/bf16 scores (the f32 weights, log-probabilities
    // and loss of an f32 op), by the `_wide_` kernels.
    let ((scores, widened), labels) = (p.input_or_widened(base)?, p.input(base + 1)?);
    if grad && widened {
        return Err("a loss gradient reading its scores widened".into());
    }
    let weights = p.opt_input(base + 2).map_or(Arg::Null, |w| Arg::Ptr(buf(w)));
    if scores.shape.len() < 2 {
        return Err("loss scores of rank below 2".into());
    }
    let (n, c, inner) = split3(&scores.shape, 1, 2);
    let t = match scores.dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 => tag(scores.dtype)?,
        d => return Err(format!("a loss on {d} scores")),
    };
    let reduction = match a.reduction {
        Reduction::None => 0,
        Reduction::Sum => 1,
        Reduction::Mean => 2,
    };
    let shape = LossShape {
        scores,
        widened,
        labels,
        weights,
        softmax,
        base,
        c,
        positions: n * inner,
        t,
        it: index_tag(labels.dtype)?,
        reduction,
        ignore: [Arg::I32(a.ignore_index.is_some() as i32), Arg::I64(a.ignore_index.unwrap_or(0))],
        dims: [Arg::I64(n as i64), Arg::I64(c as i64), Arg::I64(inner as i64)],
        block: if c <= 128 { 32 } else { BLOCK },
        acc: acc_dtype(scores.dtype).size() as u64,
    };
    if grad {
        plan_loss_grad(p, &shape)
    } else {
        plan_loss_forward(p, &shape)
    }
}

/// A loss: per-position losses (and log-probabilities), then their reduction.
fn plan_loss_forward(p: &mut Planner, s: &LossShape) -> Result<(), String> {
    let (scores, widened, t, it) = (s.scores, s.widened, s.t, s.it);
    let loss = p.output(0)?;
    if widened {
        if !s.softmax || !matches!(scores.dtype, DType::F16 | DType::BF16) || loss.dtype != DType::F32 {
            return Err(format!("a loss of {} reading {} scores widened", loss.dtype, scores.dtype));
        }
        if p.opt_input(2).is_some_and(|w| w.dtype != DType::F32) {
            return Err("a widened loss with weights other than f32".into());
        }
    }
    let (ws_loss, ws_weight, none) = if s.reduction == 0 {
        (Arg::Null, Arg::Null, Arg::Ptr(buf(loss)))
    } else {
        (Arg::Ptr(p.work(s.positions * s.acc)), Arg::Ptr(p.work(s.positions * s.acc)), Arg::Null)
    };
    let mut args = vec![Arg::Ptr(buf(scores)), Arg::Ptr(buf(s.labels)), s.weights];
    if s.softmax {
        args.push(p.l.outputs.get(1).map_or(Arg::Null, |t| Arg::Ptr(buf(t))));
    }
    args.extend([ws_loss, ws_weight, none]);
    args.extend(s.dims);
    args.extend(s.ignore);
    if s.softmax {
        let name = if widened { format!("loss_softmax_ce_wide_{t}_{it}") } else { format!("loss_softmax_ce_{t}_{it}") };
        p.kernel("loss", name, rows_grid(s.positions), [s.block, 1, 1], args);
    } else {
        p.flat("loss", format!("loss_nll_{t}_{it}"), s.positions, args);
    }
    if s.reduction != 0 {
        let args = vec![ws_loss, ws_weight, Arg::Ptr(buf(loss)), Arg::I64(s.positions as i64), Arg::I32(s.reduction)];
        let lt = if widened { "f32" } else { t };
        p.kernel("loss", format!("loss_reduce_{lt}"), [1, 1, 1], [BLOCK, 1, 1], args);
    }
    Ok(())
}

/// A loss's gradient: the weight total of a mean, then the gradient of the scores.
fn plan_loss_grad(p: &mut Planner, s: &LossShape) -> Result<(), String> {
    let (scores, t, it) = (s.scores, s.t, s.it);
    let (dloss, d) = (p.input(0)?, p.output(0)?);
    // An f32 loss's gradient over f16/bf16 scores (the training compiler's narrowed loss
    // gradient): dloss and the class weights are f32.
    let wide = s.softmax && matches!(scores.dtype, DType::F16 | DType::BF16) && dloss.dtype == DType::F32;
    let weights_dtype = p.opt_input(s.base + 2).map(|w| w.dtype);
    if (!wide && dloss.dtype != scores.dtype) || weights_dtype.is_some_and(|w| w != dloss.dtype) {
        return Err(format!(
            "a loss gradient with {} scores, a {} dloss and {} weights",
            scores.dtype,
            dloss.dtype,
            weights_dtype.map_or("no".to_string(), |w| w.to_string())
        ));
    }
    let total = if s.reduction == 2 {
        let total = p.work(s.acc);
        let mut args = vec![
            Arg::Ptr(buf(s.labels)),
            s.weights,
            Arg::Ptr(total),
            Arg::I64(s.positions as i64),
            Arg::I64(s.c as i64),
        ];
        args.extend(s.ignore);
        let wt = if wide { "f32" } else { t };
        p.kernel("loss", format!("loss_weight_total_{wt}_{it}"), [1, 1, 1], [BLOCK, 1, 1], args);
        Arg::Ptr(total)
    } else {
        Arg::Null
    };
    let mut args =
        vec![Arg::Ptr(buf(dloss)), Arg::Ptr(buf(scores)), Arg::Ptr(buf(s.labels)), s.weights, total, Arg::Ptr(buf(d))];
    args.extend(s.dims);
    args.extend(s.ignore);
    args.push(Arg::I32(s.reduction));
    if s.softmax {
        let name =
            if wide { format!("loss_softmax_ce_grad_wide_{t}_{it}") } else { format!("loss_softmax_ce_grad_{t}_{it}") };
        p.kernel("loss", name, rows_grid(s.positions), [s.block, 1, 1], args);
    } else {
        p.flat("loss", format!("loss_nll_grad_{t}_{it}"), d.numel() as u64, args);
    }
    Ok(())
}

/// The `<param>_<grad>` dtype suffix of the update kernels: a gradient of the parameter's dtype,
/// or an f16/bf16 one of an f32 parameter (the master weights of mixed precision).
fn update_tags(op: &str, param: DType, grad: DType) -> Result<String, String> {
    match (param, grad) {
        (p, g) if p == g && p.is_float() => Ok(format!("{}_{}", float_tag(p)?, float_tag(g)?)),
        (DType::F32, DType::F16 | DType::BF16) => Ok(format!("f32_{}", float_tag(grad)?)),
        _ => Err(format!("{op} of {param} parameters with {grad} gradients")),
    }
}

/// An update's optional `inv_scale` input (slot `i`): a pointer to the f32 scalar, or null. Only
/// f32 and f64 parameters take one (the kernels multiply in their compute type).
fn unscale_arg(p: &Planner, i: usize, param: DType) -> Result<Arg, String> {
    match p.opt_input(i) {
        None => Ok(Arg::Null),
        Some(_) if !matches!(param, DType::F32 | DType::F64) => Err(format!("an inv_scale with {param} parameters")),
        Some(t) if t.dtype == DType::F32 && t.numel() == 1 => Ok(Arg::Ptr(buf(t))),
        Some(t) => Err(format!("an update's inv_scale must be one f32, not {}{:?}", t.dtype, t.shape)),
    }
}

/// An update's learning-rate input `i` (an f32 scalar on the device), or null for its attribute.
fn rate_arg(p: &Planner, i: usize) -> Result<Arg, String> {
    match p.opt_input(i) {
        None => Ok(Arg::Null),
        Some(t) if t.dtype == DType::F32 && t.numel() == 1 => Ok(Arg::Ptr(buf(t))),
        Some(t) => Err(format!("an update's learning rate must be one f32, not {}{:?}", t.dtype, t.shape)),
    }
}

/// Adam's trailing kernel arguments: lr, the learning-rate input `rate`, beta1, beta2, epsilon,
/// weight_decay, decoupled.
fn adam_hyper(a: &mpc_ir::ops::AdamAttrs, rate: Arg) -> [Arg; 7] {
    [
        Arg::F32(a.lr),
        rate,
        Arg::F32(a.beta1),
        Arg::F32(a.beta2),
        Arg::F32(a.epsilon),
        Arg::F32(a.weight_decay),
        Arg::I32(a.decoupled as i32),
    ]
}

/// Elements per block of a multi-tensor update or finite check: each tensor is cut into chunks of
/// this many, one block per chunk, so that small and large tensors alike fill the device.
const UPDATE_CHUNK: u64 = 65536;

/// The chunks of [`UPDATE_CHUNK`] elements that cut tensors of `numels` elements, one block each:
/// a multi-tensor kernel's `chunk_tensor`, `chunk_start`, `chunks` and `chunk` arguments (the
/// first two in aux bytes), and its grid.
fn chunks(p: &mut Planner, numels: &[u64]) -> ([Arg; 4], [u32; 3]) {
    let (mut tensor_of, mut start_of) = (Vec::new(), Vec::new());
    for (k, &n) in numels.iter().enumerate() {
        for s in (0..n).step_by(UPDATE_CHUNK as usize) {
            tensor_of.extend((k as i32).to_le_bytes());
            start_of.extend((s as i64).to_le_bytes());
        }
    }
    let count = (tensor_of.len() / 4) as u64;
    let args = [
        Arg::Ptr(p.aux(&tensor_of)),
        Arg::Ptr(p.aux(&start_of)),
        Arg::I64(count as i64),
        Arg::I64(UPDATE_CHUNK as i64),
    ];
    (args, [count.clamp(1, 65535) as u32, 1, 1])
}

/// A multi-tensor launch of AdamUpdates ([`crate::program::Launch::group`]): one
/// `train_adam_multi_<T>` kernel over the members' tensors, cut into chunks. The step, finite
/// flag and unscale are the first member's (the lowering groups only updates that share them).
pub(super) fn plan_update_group(p: &mut Planner) -> Result<(), String> {
    let Op::AdamUpdate(a) = &p.l.op else {
        return Err(format!("a multi-tensor launch of {}", p.l.op.op_type()));
    };
    let a = a.clone();
    let group: &[Launch] = &p.l.group;
    let member = |l| Planner { l, opts: p.opts, constant: p.constant, out: LaunchPlan::default(), sibling_done: false };
    let first = member(&group[0]);
    let (step, finite) = (first.input(4)?, first.input(5)?);
    let param_dtype = first.input(0)?.dtype;
    if step.dtype != DType::I64 {
        return Err(format!("AdamUpdate with a {} step", step.dtype));
    }
    let inv = unscale_arg(&first, 6, param_dtype)?;
    let mut ptrs: Vec<Option<Buf>> = Vec::with_capacity(9 * group.len());
    let (mut sizes, mut codes, mut numels) = (Vec::new(), Vec::new(), Vec::new());
    for l in group {
        let m = member(l);
        let ins: Vec<&TensorRef> = (0..4).map(|i| m.input(i)).collect::<Result<_, _>>()?;
        let outs: Vec<&TensorRef> = (0..3).map(|i| m.output(i)).collect::<Result<_, _>>()?;
        let (param, grad) = (ins[0], ins[1]);
        update_tags("AdamUpdate", param.dtype, grad.dtype)?;
        let n = param.numel();
        let same = |t: &&TensorRef| t.dtype == param.dtype && t.numel() == n;
        if param.dtype != param_dtype || grad.numel() != n || !ins[2..].iter().all(same) || !outs.iter().all(same) {
            return Err(format!("{}: a member of a multi-tensor update of another dtype or size", l.node));
        }
        let low = low_copy(&m, 7, 3, param)?;
        ptrs.extend(ins.iter().chain(&outs).map(|t| Some(buf(t))));
        ptrs.extend([low.map(|l| l.1), low.map(|l| l.0)]);
        sizes.extend((n as i64).to_le_bytes());
        codes.extend(float_code(grad.dtype)?.to_le_bytes());
        codes.extend(low.map_or(0, |l| l.2).to_le_bytes());
        numels.push(n as u64);
    }
    if numels.iter().all(|&n| n == 0) {
        return Ok(());
    }
    let table = p.aux(&vec![0u8; 8 * ptrs.len()]);
    let Buf::Aux(at) = table else { unreachable!("aux bytes") };
    for (j, b) in ptrs.iter().enumerate() {
        if let Some(b) = b {
            p.out.addresses.push((at + 8 * j as u64, *b));
        }
    }
    let (sizes, codes) = (p.aux(&sizes), p.aux(&codes));
    let (chunked, grid) = chunks(p, &numels);
    let mut args = vec![Arg::Ptr(table), Arg::Ptr(sizes), Arg::Ptr(codes)];
    args.extend(chunked);
    args.extend([inv, Arg::Ptr(buf(step)), Arg::Ptr(buf(finite))]);
    args.extend(adam_hyper(&a, rate_arg(&first, 8)?));
    p.kernel("train", format!("train_adam_multi_{}", float_tag(param_dtype)?), grid, [BLOCK, 1, 1], args);
    Ok(())
}

pub(super) fn plan_train(p: &mut Planner) -> Result<(), String> {
    let op = p.l.op.clone();
    match &op {
        Op::AllFinite => plan_all_finite(p)?,
        Op::SgdUpdate(a) => plan_sgd(p, a)?,
        Op::AdamUpdate(a) => plan_adam(p, a)?,
        Op::LossScaleUpdate(a) => plan_loss_scale_update(p, a)?,
        Op::LrSchedule(a) => plan_lr_schedule(p, a)?,
        Op::SeededDropout(a) => plan_seeded_dropout(p, a)?,
        Op::ReluGrad => {
            let (dy, y, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
            let n = dx.numel() as u64;
            let args = vec![Arg::Ptr(buf(dy)), Arg::Ptr(buf(y)), Arg::Ptr(buf(dx)), Arg::I64(n as i64)];
            p.flat("train", format!("train_relu_grad_{}", float_tag(dx.dtype)?), n, args);
        }
        Op::GeluGrad(a) => {
            let (dy, x, dx) = (p.input(0)?, p.input(1)?, p.output(0)?);
            gelu_grad(p, dy, x, dx, a.approximate)?;
        }
        _ => unreachable!("not a training op"),
    }
    Ok(())
}

/// Whether every float input is finite: one launch for one tensor, or one over chunks of all of them.
fn plan_all_finite(p: &mut Planner) -> Result<(), String> {
    let f = p.output(0)?;
    p.kernel("train", "train_all_finite_init".into(), [1, 1, 1], [1, 1, 1], vec![Arg::Ptr(buf(f))]);
    let floats: Vec<&TensorRef> =
        (0..p.l.inputs.len()).filter_map(|i| p.opt_input(i)).filter(|x| x.dtype.is_float() && x.numel() > 0).collect();
    if let [x] = floats[..] {
        let n = x.numel() as u64;
        let args = vec![Arg::Ptr(buf(x)), Arg::I64(n as i64), Arg::Ptr(buf(f))];
        p.flat("train", format!("train_all_finite_{}", float_tag(x.dtype)?), n, args);
    } else if !floats.is_empty() {
        // Every gradient in one launch: arrays of addresses, sizes and dtype codes.
        let ptrs = p.aux(&vec![0u8; 8 * floats.len()]);
        let Buf::Aux(at) = ptrs else { unreachable!("aux bytes") };
        for (k, x) in floats.iter().enumerate() {
            p.out.addresses.push((at + 8 * k as u64, buf(x)));
        }
        let sizes: Vec<u8> = floats.iter().flat_map(|x| (x.numel() as i64).to_le_bytes()).collect();
        let codes: Vec<u8> =
            floats.iter().map(|x| float_code(x.dtype).map(i32::to_le_bytes)).collect::<Result<Vec<_>, _>>()?.concat();
        // Cut into chunks, one block each, so that every tensor, large or small, keeps
        // the device busy (one block row per tensor left the largest few to a few blocks
        // each).
        let (sizes, codes) = (p.aux(&sizes), p.aux(&codes));
        let numels: Vec<u64> = floats.iter().map(|x| x.numel() as u64).collect();
        let (chunked, grid) = chunks(p, &numels);
        let mut args = vec![Arg::Ptr(ptrs), Arg::Ptr(sizes), Arg::Ptr(codes)];
        args.extend(chunked);
        args.push(Arg::Ptr(buf(f)));
        p.kernel("train", "train_all_finite_multi".into(), grid, [BLOCK, 1, 1], args);
    }
    Ok(())
}

/// One parameter's SGD step, with its velocity and, where given, its low-precision copy.
fn plan_sgd(p: &mut Planner, a: &mpc_ir::ops::SgdAttrs) -> Result<(), String> {
    let (param, grad, finite) = (p.input(0)?, p.input(1)?, p.input(2)?);
    let vel = p.opt_input(3);
    let out = p.output(0)?;
    let n = param.numel() as u64;
    let tags = update_tags("SgdUpdate", param.dtype, grad.dtype)?;
    let inv = unscale_arg(p, 4, param.dtype)?;
    let mut args = vec![
        Arg::Ptr(buf(param)),
        Arg::Ptr(buf(grad)),
        inv,
        Arg::Ptr(buf(finite)),
        vel.map_or(Arg::Null, |v| Arg::Ptr(buf(v))),
        Arg::Ptr(buf(out)),
        p.l.outputs.get(1).map_or(Arg::Null, |v| Arg::Ptr(buf(v))),
        Arg::I64(n as i64),
        Arg::F32(a.lr),
        rate_arg(p, 6)?,
        Arg::F32(a.momentum),
        Arg::F32(a.weight_decay),
        Arg::I32(a.nesterov as i32),
    ];
    args.extend(low_copy_args(p, 5, 1 + vel.is_some() as usize, param)?);
    p.flat("train", format!("train_sgd_{tags}"), n, args);
    Ok(())
}

/// One parameter's Adam(W) step, with its moments and, where given, its low-precision copy.
fn plan_adam(p: &mut Planner, a: &mpc_ir::ops::AdamAttrs) -> Result<(), String> {
    let ins: Vec<&TensorRef> = (0..6).map(|i| p.input(i)).collect::<Result<_, _>>()?;
    let (param, grad, step) = (ins[0], ins[1], ins[4]);
    if step.dtype != DType::I64 {
        return Err(format!("AdamUpdate with a {} step", step.dtype));
    }
    let tags = update_tags("AdamUpdate", param.dtype, grad.dtype)?;
    let n = param.numel() as u64;
    let mut args = vec![Arg::Ptr(buf(param)), Arg::Ptr(buf(grad)), unscale_arg(p, 6, param.dtype)?];
    args.extend(ins[2..].iter().map(|t| Arg::Ptr(buf(t))));
    for i in 0..3 {
        args.push(Arg::Ptr(buf(p.output(i)?)));
    }
    args.push(Arg::I64(n as i64));
    args.extend(adam_hyper(a, rate_arg(p, 8)?));
    args.extend(low_copy_args(p, 7, 3, param)?);
    p.flat("train", format!("train_adam_{tags}"), n, args);
    Ok(())
}

/// The dynamic loss scale: grown after `growth_interval` finite steps, backed off after one that is not.
fn plan_loss_scale_update(p: &mut Planner, a: &mpc_ir::ops::LossScaleAttrs) -> Result<(), String> {
    let (scale, good, finite) = (p.input(0)?, p.input(1)?, p.input(2)?);
    if scale.dtype != DType::F32 || good.dtype != DType::I64 {
        return Err(format!("LossScaleUpdate of a {} scale and {} count", scale.dtype, good.dtype));
    }
    let args = vec![
        Arg::Ptr(buf(scale)),
        Arg::Ptr(buf(good)),
        Arg::Ptr(buf(finite)),
        Arg::Ptr(buf(p.output(0)?)),
        Arg::Ptr(buf(p.output(1)?)),
        Arg::F32(a.growth_factor),
        Arg::F32(a.backoff_factor),
        Arg::I64(a.growth_interval),
        Arg::F32(a.min_scale),
        Arg::F32(a.max_scale),
    ];
    p.kernel("train", "train_loss_scale_update".into(), [1, 1, 1], [1, 1, 1], args);
    Ok(())
}

/// The learning rate of the step, one thread computing the schedule's curve.
fn plan_lr_schedule(p: &mut Planner, a: &mpc_ir::ops::LrScheduleAttrs) -> Result<(), String> {
    let (step, peak, lr) = (p.input(0)?, p.input(1)?, p.output(0)?);
    if step.dtype != DType::I64 || peak.dtype != DType::F32 {
        return Err(format!("LrSchedule of a {} step and a {} rate", step.dtype, peak.dtype));
    }
    // The kernel's codes for the curves (kernels/train.cu, train_lr_schedule).
    use mpc_ir::ops::LrKind;
    let kind = match a.kind {
        LrKind::Constant => 0,
        LrKind::Linear => 1,
        LrKind::Cosine => 2,
        LrKind::Step => 3,
        LrKind::OneCycle => 4,
    };
    let args = vec![
        Arg::Ptr(buf(step)),
        Arg::Ptr(buf(peak)),
        Arg::Ptr(buf(lr)),
        Arg::I32(kind),
        Arg::I64(a.warmup),
        Arg::I64(a.total),
        Arg::F32(a.min_ratio),
        Arg::F32(a.start_ratio),
        Arg::I64(a.step_size),
        Arg::F32(a.gamma),
    ];
    p.kernel("train", "train_lr_schedule".into(), [1, 1, 1], [1, 1, 1], args);
    Ok(())
}

/// Dropout by a counter-based mask of `seed` and the step key, the ratio a constant, a host value or
/// a device scalar (cast to f64 where it is not one).
fn plan_seeded_dropout(p: &mut Planner, a: &mpc_ir::ops::SeedAttrs) -> Result<(), String> {
    let (x, key, y) = (p.input(0)?, p.input(2)?, p.output(0)?);
    let n = x.numel() as u64;
    let (ratio_ptr, ratio) = match (p.opt_input(1), p.host(1)) {
        (Some(r), _) => match (p.constant)(r) {
            Some(v) => (Arg::Null, v.f64s().first().copied().unwrap_or(0.5)),
            None if r.dtype == DType::F64 => (Arg::Ptr(buf(r)), 0.5),
            None => {
                let w = p.work(8);
                p.cast(r.dtype, DType::F64, buf(r), w, 1)?;
                (Arg::Ptr(w), 0.5)
            }
        },
        (None, Some(v)) => (Arg::Null, v.f64s().first().copied().unwrap_or(0.5)),
        _ => (Arg::Null, 0.5),
    };
    if !(0.0..1.0).contains(&ratio) {
        return Err(format!("a dropout ratio of {ratio}, outside [0, 1)"));
    }
    let args = vec![
        Arg::Ptr(buf(x)),
        Arg::Ptr(buf(key)),
        ratio_ptr,
        Arg::Ptr(buf(y)),
        p.l.outputs.get(1).map_or(Arg::Null, |m| Arg::Ptr(buf(m))),
        Arg::I64(n as i64),
        Arg::I64(a.seed),
        Arg::F64(ratio),
    ];
    p.flat("train", format!("train_seeded_dropout_{}", float_tag(x.dtype)?), n, args);
    Ok(())
}

/// GELU's gradient `dx = dy · GELU'(x)` over `dx`'s elements (`dx` may be `dy`: each element is
/// read before it is written), 16 bytes at a time where their count and the three tensors allow.
pub(super) fn gelu_grad(
    p: &mut Planner,
    dy: &TensorRef,
    x: &TensorRef,
    dx: &TensorRef,
    approximate: GeluApprox,
) -> Result<(), String> {
    let n = dx.numel() as u64;
    let v = 16 / dx.dtype.size() as u64;
    let vec = p.opts.wide && n % v == 0 && [dy, x, dx].iter().all(|t| t.offset % 16 == 0);
    let mut args = vec![Arg::Ptr(buf(dy)), Arg::Ptr(buf(x)), Arg::Ptr(buf(dx)), Arg::I64(n as i64)];
    args.extend([Arg::I32((approximate == GeluApprox::Tanh) as i32), Arg::I32(vec as i32)]);
    p.flat("train", format!("train_gelu_grad_{}", float_tag(dx.dtype)?), if vec { n / v } else { n }, args);
    Ok(())
}
