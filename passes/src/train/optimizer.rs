//! The optimizer pass: the step's end, from the gradients to the next training state.

use std::collections::{HashMap, HashSet};

use mpc_ir::ops::{AdamAttrs, ReduceAttrs, SgdAttrs};
use mpc_ir::{DType, Def, Graph, Op, Tensor, ValueId};

use super::build::Builder;
use super::{loss_scale_at_least_one, loss_value, opts, signature, LossScale, Optimizer, LR, MICRO, RNG};
use crate::{Changed, Context, Effect, Pass, PassError, Result};

/// Unscale, all-finite check, clipping, the optimizer update of the masters, the loss-scale
/// update and the step counter; the state pairs are recorded and the next values made outputs.
pub struct OptimizerPass;

impl Pass for OptimizerPass {
    fn name(&self) -> &'static str {
        "optimizer"
    }

    fn effect(&self) -> Effect {
        Effect::Adds
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let o = opts(cx)?.clone();
        let pg = g.train.as_ref().map(|t| t.grads.clone()).unwrap_or_default();
        let loss = loss_value(g).ok_or_else(|| PassError::Usage("no loss: run add-loss first".into()))?;
        let (mut state, variances) = running_statistics(g);
        // The batch norms' pairs come first in `state`; the accumulators follow.
        let running = state.len();
        let params: Vec<ValueId> = pg.iter().map(|&(p, _)| p).collect();
        let undecayed = super::decay::exempt(g, &params, &o.no_decay)?;
        let mut b = Builder::new(g);
        b.at("optimizer");
        correct_running_variances(&mut b, &mut state, variances)?;
        let scale = b.g.train.as_ref().and_then(|t| t.loss_scale);
        // 0. Gradient accumulation: the update reads the sums of the micro-batches' gradients.
        let acc = (o.accumulate > 1).then(|| accumulate(&mut b, &pg, o.accumulate, &mut state)).transpose()?;
        let mut pg = acc.as_ref().map_or(pg, |a| a.grads.clone());
        // 1. Data parallel: the gradients and the running statistics averaged over the ranks;
        // with the state sharded, each rank's block of each gradient, and the blocks of the
        // masters it updates.
        // Accumulating, only the micro-batch that applies the sums combines them.
        let when = acc.as_ref().map(|a| a.boundary);
        if o.data_parallel || o.shard_state.is_some() {
            b.at("optimizer");
            if o.shard_state.is_none() {
                all_reduced_in_buckets(&mut b, &mut pg, o.bucket_bytes, when)?;
            }
            all_reduced(&mut b, &mut state[..running], true, None)?;
        }
        let shard = |z| shard_parameters(&mut b, z, &mut pg, o.weight_copies, when);
        let mut sharded = o.shard_state.map(shard).transpose()?;
        let undecayed = match &sharded {
            Some(s) => undecayed.iter().filter_map(|p| s.blocks.get(p).copied()).collect(),
            None => undecayed,
        };
        let inv = inverse_scale(&mut b, &o, scale, acc.is_some());
        let (mut gs, folded) = unscaled(&mut b, &o, &pg, inv)?;
        // 2. One finite flag for the whole step.
        b.at("optimizer");
        let all: Vec<Option<ValueId>> = gs.iter().map(|&(_, d)| Some(d)).collect();
        let mut finite = b.ops("all_finite", Op::AllFinite, &all, 1)[0];
        if sharded.is_some() {
            finite = finite_on_every_rank(&mut b, finite);
        }
        // Accumulating, an update applies on the last micro-batch when every sum is finite.
        let apply = match &acc {
            Some(a) => b.op("apply_update", Op::And, &[finite, a.boundary]),
            None => finite,
        };
        // 3. Global-norm clipping after unscaling: g · min(1, c / (‖g‖ + 1e-6)).
        if let Some(c) = o.clip_norm {
            clip(&mut b, &mut gs, c, sharded.is_some())?;
        }
        let (step_next, lr, rate) = counters(&mut b, &o, apply, &mut state)?;
        // 5. The updates.
        let flags = UpdateInputs { inv, folded: &folded, apply, step_next, rate };
        updates(&mut b, &o, &gs, &undecayed, &flags, &mut state, sharded.as_mut())?;
        // 6. Dynamic loss scaling.
        b.at("optimizer");
        scale_update(&mut b, &o, scale, finite, acc.as_ref(), &mut state);
        // 7. The dropout stream moves on every step, applied or skipped: a skipped step's
        // forward pass drew its masks all the same.
        if let Some(key) = b.g.find(RNG).filter(|&k| matches!(b.g.value(k).def(), Def::Init(_))) {
            let one = b.scalar(1.0, DType::I64);
            let next = b.op("rng_next", Op::Add, &[key, one]);
            state.push((key, next));
        }
        let mut skipped = b.op("skipped", Op::Not, &[finite]);
        if let Some(a) = &acc {
            skipped = b.op("skipped", Op::And, &[skipped, a.boundary]);
        }
        set_outputs(&mut b, loss, skipped, lr, &state);
        let sig = signature(g);
        sig.skipped = Some(skipped);
        sig.lr = lr;
        sig.state = state;
        sig.sharded = sharded.map(|s| s.state).unwrap_or_default();
        g.meta.set_opset(mpc_ir::ops::MPC_DOMAIN, 1);
        Ok(Changed::Yes)
    }
}

/// A state value and its next value (or a parameter and its gradient).
type StatePair = (ValueId, ValueId);

/// The state pairs of the batch normalisations in training mode (their running statistics), and
/// for each running variance its place among them, the normalised input and the momentum.
fn running_statistics(g: &Graph) -> (Vec<StatePair>, Vec<(usize, ValueId, f32)>) {
    let mut state: Vec<(ValueId, ValueId)> = Vec::new();
    // Batch-norm running statistics computed in training mode are state too. ONNX updates the
    // running variance with the batch's biased variance; PyTorch, which users compare with,
    // with the unbiased one: rv ← m·rv + (1−m)·v·n/(n−1) for n values per channel. From ONNX's
    // r = m·rv + (1−m)·v that is r + (r − m·rv)/(n − 1).
    let mut variances = Vec::new();
    for n in g.node_ids().collect::<Vec<_>>() {
        let node = g.node(n);
        if let Op::BatchNormalization(a) = &node.op {
            if a.training_mode {
                for slot in 1..=2 {
                    if let (Some(s), Some(&next)) = (node.input(slot + 2), node.outputs().get(slot)) {
                        if g.value(s).initializer().is_some() {
                            state.push((s, next));
                            if slot == 2 {
                                variances.push((
                                    state.len() - 1,
                                    node.input(0).expect("BatchNormalization reads x"),
                                    a.momentum,
                                ));
                            }
                        }
                    }
                }
            }
        }
    }
    (state, variances)
}

/// Each running variance's next value made PyTorch's (see [`running_statistics`]).
fn correct_running_variances(
    b: &mut Builder,
    state: &mut [(ValueId, ValueId)],
    variances: Vec<(usize, ValueId, f32)>,
) -> Result<()> {
    for (i, x, momentum) in variances {
        let (rv, next) = state[i];
        let dt = b.dtype(rv).map_err(PassError::Usage)?;
        let shape = b.op("bn_shape", Op::Shape(Default::default()), &[x]);
        let size = b.op("bn_size", Op::Size, &[x]);
        let one = b.ints(&[1]);
        let channels = b.op("bn_channels", Op::Gather(Default::default()), &[shape, one]);
        let per_channel = b.op("bn_count", Op::Div, &[size, channels]);
        let less_one = b.op("bn_count", Op::Sub, &[per_channel, one]);
        let less_one = b.op("bn_count", Op::Max, &[less_one, one]);
        let less_one = b.cast(less_one, dt);
        let m = b.scalar(f64::from(momentum), dt);
        let kept = b.op("bn_var", Op::Mul, &[rv, m]);
        let batch_part = b.op("bn_var", Op::Sub, &[next, kept]);
        let correction = b.op("bn_var", Op::Div, &[batch_part, less_one]);
        state[i].1 = b.op("bn_running_var", Op::Add, &[next, correction]);
    }
    Ok(())
}

/// The second value of each pair (a gradient, a running statistic's next value) replaced by its
/// mean over the ranks, computed in FP32 (a lower-precision value widened first, and narrowed
/// back where `keep` says its dtype must stay; FP64 as it is); only on the steps where `when` is
/// true, when given (the others keep their own values).
fn all_reduced(b: &mut Builder, pairs: &mut [StatePair], keep: bool, when: Option<ValueId>) -> Result<()> {
    for (p, d) in pairs.iter_mut() {
        // Named after the parameter (or statistic): what a check that the ranks differ names.
        let name = format!("{}.grad", b.g.name(*p));
        b.at(&name);
        // A value this pass computed (a running variance made PyTorch's) is typed after it: the
        // state it is the next value of has its type.
        let dt = b.dtype(*d).or_else(|_| b.dtype(*p)).map_err(PassError::Usage)?;
        let widened = !matches!(dt, DType::F32 | DType::F64);
        let shape = b.g.ty(*d).shape.clone().or_else(|| b.g.ty(*p).shape.clone());
        let wide = if widened { b.cast(*d, DType::F32) } else { *d };
        let attrs = mpc_ir::ops::AllReduceAttrs { reduction: mpc_ir::ops::CollectiveReduction::Mean };
        *d = b.ops("all_reduce", Op::AllReduce(Box::new(attrs)), &[Some(wide), when], 1)[0];
        // Typed now: the steps after this one read the gradients' dtypes.
        let wide_dt = if widened { DType::F32 } else { dt };
        b.g.set_ty(*d, mpc_ir::TypeInfo { dtype: Some(wide_dt), shape: shape.clone() });
        if keep && widened {
            *d = b.cast(*d, dt);
            b.g.set_ty(*d, mpc_ir::TypeInfo { dtype: Some(dt), shape });
        }
    }
    Ok(())
}

/// The gradients of `pg` averaged over the ranks in buckets of at most `cap` bytes (a larger
/// one alone; 0: each alone), filled in the reverse of `pg`'s order (the backward pass writes
/// the last layers' gradients first): each bucket's gradients widened to FP32 (an FP64 one in a
/// bucket of FP64s), flattened and concatenated, one `AllReduce` (the same bits as one each:
/// the mean is element by element), and sliced back into their shapes.
fn all_reduced_in_buckets(b: &mut Builder, pg: &mut [StatePair], cap: u64, when: Option<ValueId>) -> Result<()> {
    let mut buckets: Vec<(DType, u64, Vec<usize>)> = Vec::new();
    for i in (0..pg.len()).rev() {
        let dt = if b.dtype(pg[i].1).map_err(PassError::Usage)? == DType::F64 { DType::F64 } else { DType::F32 };
        let bytes = param_shape(b, pg[i].0)?.iter().product::<u64>() * dt.size() as u64;
        match buckets.iter_mut().rev().find(|(d, _, _)| *d == dt) {
            Some((_, filled, members)) if *filled + bytes <= cap => {
                *filled += bytes;
                members.push(i);
            }
            _ => buckets.push((dt, bytes, vec![i])),
        }
    }
    for (dt, _, members) in buckets {
        if let [i] = members[..] {
            all_reduced(b, &mut pg[i..=i], false, when)?;
            continue;
        }
        b.at(&format!("{}.grad.bucket", b.g.name(pg[members[0]].0)));
        let flat = b.ints(&[-1]);
        let mut parts = Vec::new();
        for &i in &members {
            let d = pg[i].1;
            let d = if b.dtype(d).map_err(PassError::Usage)? == dt { d } else { b.cast(d, dt) };
            parts.push(Some(b.op("flatten", Op::Reshape(Default::default()), &[d, flat])));
        }
        let cat = b.ops("concat", Op::Concat(mpc_ir::ops::ConcatAttrs { axis: 0 }), &parts, 1)[0];
        let attrs = mpc_ir::ops::AllReduceAttrs { reduction: mpc_ir::ops::CollectiveReduction::Mean };
        let all = b.ops("all_reduce", Op::AllReduce(Box::new(attrs)), &[Some(cat), when], 1)[0];
        let mut at = 0i64;
        for &i in &members {
            let shape = param_shape(b, pg[i].0)?;
            let n = shape.iter().product::<u64>() as i64;
            let (start, end, axis) = (b.ints(&[at]), b.ints(&[at + n]), b.ints(&[0]));
            let piece = b.op("piece", Op::Slice, &[all, start, end, axis]);
            let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let to = b.ints(&dims);
            pg[i].1 = b.op("unflatten", Op::Reshape(Default::default()), &[piece, to]);
            // Typed now: the steps after this one read the gradients' dtypes.
            b.g.set_ty(pg[i].1, mpc_ir::TypeInfo::new(dt, mpc_ir::Shape::fixed(&shape)));
            at += n;
        }
    }
    Ok(())
}

/// The shape of the parameter `p` (an initializer).
fn param_shape(b: &Builder, p: ValueId) -> Result<Vec<u64>> {
    let t = b.g.value(p).initializer();
    t.map(|t| t.shape().to_vec()).ok_or_else(|| PassError::Usage(format!("`{}` is not an initializer", b.g.name(p))))
}

/// What the gradients are multiplied by to unscale them: 1 / S, and accumulating, to average the
/// micro-batches' sums too, 1 / (S·N); none without a scale or accumulation.
///
/// Unscaling is in FP32 (a gradient computed low is widened first). Without clipping, which needs
/// the unscaled values, an FP32 (or FP64) parameter's update widens and unscales its gradient
/// itself (its `inv_scale` input): the same arithmetic as a Cast and a Mul, without writing and
/// reading the FP32 copy. The finite check then reads the gradients as computed: a value is finite
/// widened and divided by a scale of at least 1 exactly when it is finite as computed.
fn inverse_scale(
    b: &mut Builder,
    o: &super::TrainOptions,
    scale: Option<ValueId>,
    accumulating: bool,
) -> Option<ValueId> {
    match (scale, accumulating) {
        (Some(s), false) => Some(b.op("inv_scale", Op::Reciprocal, &[s])),
        (Some(s), true) => {
            let n = b.scalar(f64::from(o.accumulate), DType::F32);
            let sn = b.op("scale_times_micro_batches", Op::Mul, &[s, n]);
            Some(b.op("inv_scale", Op::Reciprocal, &[sn]))
        }
        (None, true) => Some(b.scalar(1.0 / f64::from(o.accumulate), DType::F32)),
        (None, false) => None,
    }
}

/// Each parameter's gradient as its update reads it: widened and unscaled by `inv`, or (without
/// clipping, an FP32 or FP64 parameter) as computed, the update widening and unscaling it itself;
/// and the parameters of the second kind.
fn unscaled(
    b: &mut Builder,
    o: &super::TrainOptions,
    pg: &[(ValueId, ValueId)],
    inv: Option<ValueId>,
) -> Result<(Vec<StatePair>, HashSet<ValueId>)> {
    let fold = o.clip_norm.is_none() && loss_scale_at_least_one(&o.loss_scale);
    let mut gs: Vec<(ValueId, ValueId)> = Vec::new();
    let mut folded: HashSet<ValueId> = HashSet::new();
    for &(p, d) in pg {
        let pname = b.g.name(p).to_string();
        b.at(&format!("{pname}.update"));
        let pdt = b.dtype(p).map_err(PassError::Usage)?;
        let ddt = b.dtype(d).map_err(PassError::Usage)?;
        let widens =
            matches!((pdt, ddt), (DType::F32, DType::F32 | DType::F16 | DType::BF16) | (DType::F64, DType::F64));
        if fold && widens {
            // A low-precision weight's gradient arrives widened (the gradient of its cast):
            // the update reads it as computed instead.
            let low = match b.g.value(d).def() {
                Def::Node(n, _) if pdt == DType::F32 && matches!(b.g.node(*n).op, Op::Cast(_)) => {
                    b.g.node(*n).input(0).filter(|&x| matches!(b.g.ty(x).dtype, Some(DType::F16 | DType::BF16)))
                }
                _ => None,
            };
            gs.push((p, low.unwrap_or(d)));
            folded.insert(p);
            continue;
        }
        let mut d = d;
        if b.dtype(d).map_err(PassError::Usage)? != pdt {
            d = b.cast(d, pdt);
        }
        if let Some(inv) = inv {
            let inv = if pdt == DType::F32 { inv } else { b.cast(inv, pdt) };
            d = b.op("unscale", Op::Mul, &[d, inv]);
        }
        gs.push((p, d));
    }
    Ok((gs, folded))
}

/// Clips the gradients `gs` (unscaled) to the global norm `c`; with `blocks`, each rank's blocks
/// of them, whose squares the ranks sum.
fn clip(b: &mut Builder, gs: &mut [(ValueId, ValueId)], c: f32, blocks: bool) -> Result<()> {
    let attrs = ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
    let mut sq = Vec::new();
    for &(p, d) in gs.iter() {
        // The gradients have their parameters' dtypes by now (the nodes added here are
        // typed after the pass).
        let d32 = if b.dtype(p).map_err(PassError::Usage)? == DType::F32 { d } else { b.cast(d, DType::F32) };
        sq.push(Some(b.ops("sumsq", Op::ReduceSumSquare(attrs.clone()), &[Some(d32)], 1)[0]));
    }
    let mut total = b.ops("sumsq_total", Op::Sum, &sq, 1)[0];
    if blocks {
        let attrs = mpc_ir::ops::AllReduceAttrs { reduction: mpc_ir::ops::CollectiveReduction::Sum };
        total = b.op("sumsq_over_ranks", Op::AllReduce(Box::new(attrs)), &[total]);
    }
    let norm = b.op("grad_norm", Op::Sqrt, &[total]);
    let eps = b.scalar(1e-6, DType::F32);
    let den = b.op("add", Op::Add, &[norm, eps]);
    let cv = b.scalar(c as f64, DType::F32);
    let ratio = b.op("div", Op::Div, &[cv, den]);
    let one = b.scalar(1.0, DType::F32);
    let factor = b.op("clip_factor", Op::Min, &[ratio, one]);
    for (p, d) in gs.iter_mut() {
        let pdt = b.dtype(*p).map_err(PassError::Usage)?;
        let f = if pdt == DType::F32 { factor } else { b.cast(factor, pdt) };
        *d = b.op("clip", Op::Mul, &[*d, f]);
    }
    Ok(())
}

/// The step counter (advancing on applied updates only) and the learning rate: the next count,
/// the schedule's rate as an output (none without a schedule), and the rate the updates read.
fn counters(
    b: &mut Builder,
    o: &super::TrainOptions,
    apply: ValueId,
    state: &mut Vec<(ValueId, ValueId)>,
) -> Result<(ValueId, Option<ValueId>, ValueId)> {
    // 4. The step counter advances on applied steps only.
    let step = b.init("mpc.step", Tensor::from_i64(vec![], &[0]));
    let inc = b.cast(apply, DType::I64);
    let step_next = b.op("step_next", Op::Add, &[step, inc]);
    state.push((step, step_next));
    // The learning rate: the state `mpc.lr` (the peak, which the step never changes), or the
    // schedule's rate at the count of updates applied before this one.
    let peak = b.init(LR, Tensor::from_f32(vec![], &[o.lr]));
    state.push((peak, peak));
    let lr = match &o.schedule {
        Some(s) => {
            let name = b.g.unique_name("mpc.learning_rate");
            let lr = b.op("lr_schedule", Op::LrSchedule(Box::new(s.resolved()?)), &[step, peak]);
            b.g.rename(lr, &name);
            Some(lr)
        }
        None => None,
    };
    let rate = lr.unwrap_or(peak);
    Ok((step_next, lr, rate))
}

/// What every update reads besides its parameter and gradient.
struct UpdateInputs<'a> {
    /// The reciprocal of the loss scale, which the parameters in `folded` apply themselves.
    inv: Option<ValueId>,
    folded: &'a HashSet<ValueId>,
    /// Whether the update applies, the count of updates after it and the rate.
    apply: ValueId,
    step_next: ValueId,
    rate: ValueId,
}

/// The optimizer's update of each parameter (and its moments, and its low copy), as state.
fn updates(
    b: &mut Builder,
    o: &super::TrainOptions,
    gs: &[(ValueId, ValueId)],
    undecayed: &HashSet<ValueId>,
    u: &UpdateInputs,
    state: &mut Vec<(ValueId, ValueId)>,
    mut sharded: Option<&mut Sharded>,
) -> Result<()> {
    let decay = |p: ValueId| if undecayed.contains(&p) { 0.0 } else { o.weight_decay };
    let UpdateInputs { inv, folded, apply, step_next, rate } = *u;
    for &(p, d) in gs {
        let first = state.len();
        let pname = b.g.name(p).to_string();
        b.at(&format!("{pname}.update"));
        let tensor =
            b.g.value(p)
                .initializer()
                .cloned()
                .ok_or_else(|| PassError::Usage(format!("`{pname}` is not an initializer")))?;
        let zeros = || Tensor::zeros(tensor.dtype(), tensor.shape().to_vec());
        let low = match sharded.as_deref() {
            Some(s) => s.lows.get(&p).copied().flatten(),
            None if o.weight_copies => low_copy(b.g, p, &pname, &tensor, None),
            None => None,
        };
        let unscale = inv.filter(|_| folded.contains(&p));
        match o.optimizer {
            Optimizer::Sgd | Optimizer::Momentum => {
                let momentum = if o.optimizer == Optimizer::Momentum { o.momentum } else { 0.0 };
                let attrs = SgdAttrs { lr: o.lr, momentum, nesterov: false, weight_decay: decay(p) };
                let vel = (momentum != 0.0).then(|| b.init(&format!("mpc.velocity.{pname}"), zeros()));
                let ins = [Some(p), Some(d), Some(apply), vel, unscale, low, Some(rate)];
                let n = 1 + vel.is_some() as usize + low.is_some() as usize;
                let mut outs = b.ops("sgd", Op::SgdUpdate(Box::new(attrs)), &ins, n).into_iter();
                for s in [Some(p), vel, low].into_iter().flatten() {
                    state.push((s, outs.next().expect("one output per state")));
                }
            }
            Optimizer::Adam | Optimizer::AdamW => {
                let attrs = AdamAttrs {
                    beta1: o.beta1,
                    beta2: o.beta2,
                    decoupled: o.optimizer == Optimizer::AdamW,
                    epsilon: o.epsilon,
                    lr: o.lr,
                    weight_decay: decay(p),
                };
                let m = b.init(&format!("mpc.adam_m.{pname}"), zeros());
                let v = b.init(&format!("mpc.adam_v.{pname}"), zeros());
                let ins = [Some(p), Some(d), Some(m), Some(v), Some(step_next), Some(apply), unscale, low, Some(rate)];
                let outs = b.ops("adam", Op::AdamUpdate(Box::new(attrs)), &ins, 3 + low.is_some() as usize);
                for (s, next) in [Some(p), Some(m), Some(v), low].into_iter().flatten().zip(outs) {
                    state.push((s, next));
                }
            }
        }
        // A sharded master's moments and low copy are blocks like it.
        if let Some(s) = sharded.as_deref_mut() {
            let whole = s.shapes.get(&p).cloned().unwrap_or_default();
            s.state.extend(state[first..].iter().map(|&(v, _)| (v, whole.clone())));
        }
    }
    Ok(())
}

/// The parameters sharded over the ranks ([`super::shard`]).
struct Sharded {
    /// Each parameter's master block.
    blocks: HashMap<ValueId, ValueId>,
    /// Each master block's low-precision copy (a block too; none where no Cast read the master)
    /// and the master's shape.
    lows: HashMap<ValueId, Option<ValueId>>,
    shapes: HashMap<ValueId, Vec<u64>>,
    /// Each state block and the shape of the tensor it is a block of.
    state: Vec<(ValueId, Vec<u64>)>,
}

/// Every parameter of `pg` sharded over the ranks as `z` says: its master (and low copy) held
/// as this rank's block, read by the step as the blocks gathered, and its gradient replaced by
/// this rank's block of the ranks' mean; `pg` then pairs the blocks.
fn shard_parameters(
    b: &mut Builder,
    z: super::StateShard,
    pg: &mut [(ValueId, ValueId)],
    copies: bool,
    when: Option<ValueId>,
) -> Result<Sharded> {
    let mut s = Sharded { blocks: HashMap::new(), lows: HashMap::new(), shapes: HashMap::new(), state: Vec::new() };
    for (p, d) in pg.iter_mut() {
        let pname = b.g.name(*p).to_string();
        b.at(&format!("{pname}.shard"));
        let t = b.g.value(*p).initializer().cloned();
        let t = t.ok_or_else(|| PassError::Usage(format!("`{pname}` is not an initializer")))?;
        let low = if copies { low_copy(b.g, *p, &pname, &t, Some(z)) } else { None };
        let block = super::shard::read_gathered(b.g, *p, z)?;
        *d = super::shard::scattered(b, *d, t.numel(), z, when)?;
        s.blocks.insert(*p, block);
        s.lows.insert(block, low);
        s.shapes.insert(block, t.shape().to_vec());
        *p = block;
    }
    Ok(s)
}

/// The finite flag of one rank's gradient blocks made the whole step's: true on every rank when
/// it is true on all.
fn finite_on_every_rank(b: &mut Builder, finite: ValueId) -> ValueId {
    let as_float = b.cast(finite, DType::F32);
    let attrs = mpc_ir::ops::AllReduceAttrs { reduction: mpc_ir::ops::CollectiveReduction::Mean };
    let mean = b.op("finite_over_ranks", Op::AllReduce(Box::new(attrs)), &[as_float]);
    let one = b.scalar(1.0, DType::F32);
    b.op("all_finite_over_ranks", Op::Equal, &[mean, one])
}

/// Dynamic loss scaling's update of the scale and the count of good steps (accumulating, on a
/// group's last micro-batch only).
fn scale_update(
    b: &mut Builder,
    o: &super::TrainOptions,
    scale: Option<ValueId>,
    finite: ValueId,
    acc: Option<&Accumulation>,
    state: &mut Vec<(ValueId, ValueId)>,
) {
    if let (LossScale::Dynamic { attrs, .. }, Some(s)) = (&o.loss_scale, scale) {
        let good = b.init("mpc.good_steps", Tensor::from_i64(vec![], &[0]));
        let outs =
            b.ops("loss_scale", Op::LossScaleUpdate(Box::new(attrs.clone())), &[Some(s), Some(good), Some(finite)], 2);
        // Accumulating, the scale moves once per update, on its last micro-batch.
        let gated: Vec<ValueId> = match acc {
            Some(a) => [(s, outs[0]), (good, outs[1])]
                .iter()
                .map(|&(now, next)| b.op("loss_scale_at_update", Op::Where, &[a.boundary, next, now]))
                .collect(),
            None => outs,
        };
        state.push((s, gated[0]));
        state.push((good, gated[1]));
    }
}

/// The step's outputs: the loss, the step-skipped flag, the rate, the model's outputs, then every
/// next state (named `<state>.next`).
fn set_outputs(b: &mut Builder, loss: ValueId, skipped: ValueId, lr: Option<ValueId>, state: &[(ValueId, ValueId)]) {
    // Outputs: loss, the step-skipped flag, the model's outputs, then every next state.
    let mut outs = vec![loss];
    let sname = b.g.unique_name("mpc.step_skipped");
    b.g.rename(skipped, &sname);
    outs.push(skipped);
    outs.extend(lr);
    outs.extend(b.g.outputs().iter().copied().filter(|&v| v != loss));
    for &(s, next) in state.iter().filter(|(s, next)| s != next) {
        let want = format!("{}.next", b.g.name(s));
        if !b.g.is_output(next) && b.g.name(next) != want && b.g.find(&want).is_none() {
            b.g.rename(next, &want);
        }
        if !outs.contains(&next) {
            outs.push(next);
        }
    }
    b.g.set_outputs(outs);
}

/// Gradient accumulation's part of a step: the sums of the gradients and the flag of the step
/// that applies them.
struct Accumulation {
    /// Each parameter and the sum of its gradients over the micro-batches so far, this one's
    /// included (FP32, FP64 for an FP64 parameter; still scaled by the loss scale).
    grads: Vec<(ValueId, ValueId)>,
    /// True on every `n`-th micro-batch: the update applies the sums, which then start again.
    boundary: ValueId,
}

/// The state of accumulating over `n` micro-batches: the count `mpc.micro` of micro-batches
/// since the last update and an accumulator `mpc.grad_sum.<name>` per parameter, which the
/// update's step resets to zero (applied or skipped, as `zero_grad` after GradScaler's step).
fn accumulate(
    b: &mut Builder,
    pg: &[(ValueId, ValueId)],
    n: u32,
    state: &mut Vec<(ValueId, ValueId)>,
) -> Result<Accumulation> {
    b.at("accumulate");
    let micro = b.init(MICRO, Tensor::from_i64(vec![], &[0]));
    let one = b.scalar(1.0, DType::I64);
    let count = b.op("micro_count", Op::Add, &[micro, one]);
    let every = b.scalar(f64::from(n), DType::I64);
    let boundary = b.op("update_now", Op::Equal, &[count, every]);
    let zero = b.scalar(0.0, DType::I64);
    let next = b.op("micro_next", Op::Where, &[boundary, zero, count]);
    state.push((micro, next));
    let mut grads = Vec::new();
    for &(p, d) in pg {
        let pname = b.g.name(p).to_string();
        b.at(&format!("{pname}.accumulate"));
        let dt = if b.dtype(p).map_err(PassError::Usage)? == DType::F64 { DType::F64 } else { DType::F32 };
        let shape = b.g.value(p).initializer().map(|t| t.shape().to_vec());
        let shape = shape.ok_or_else(|| PassError::Usage(format!("`{pname}` is not an initializer")))?;
        let sum = b.init(&format!("mpc.grad_sum.{pname}"), Tensor::zeros(dt, shape.clone()));
        let d = if b.dtype(d).map_err(PassError::Usage)? == dt { d } else { b.cast(d, dt) };
        let total = b.op("grad_sum", Op::Add, &[sum, d]);
        // Typed now: the rest of the pass reads the sums' dtypes (the pass manager types the
        // nodes a pass adds after it).
        b.g.set_ty(total, mpc_ir::TypeInfo::new(dt, mpc_ir::Shape::fixed(&shape)));
        let zero = b.scalar(0.0, dt);
        let kept = b.op("grad_sum_next", Op::Where, &[boundary, zero, total]);
        state.push((sum, kept));
        grads.push((p, total));
    }
    Ok(Accumulation { grads, boundary })
}

/// The forward pass's low-precision copy of the master weight `p`, made training state: the
/// Casts that read `p` into f16 (or bf16) are replaced by the initializer `mpc.<dtype>.<name>`
/// (the initial weight cast once), which the update writes from the new weight, rounded as the
/// Cast rounds. The step then neither casts the weight nor keeps the cast in its arena, and its
/// results are the same bits. None for a parameter no such Cast reads.
///
/// With `shard`, the copy is this rank's block of it, and the Casts' readers read the blocks
/// gathered.
fn low_copy(
    g: &mut Graph,
    p: ValueId,
    pname: &str,
    init: &Tensor,
    shard: Option<super::StateShard>,
) -> Option<ValueId> {
    if init.dtype() != DType::F32 {
        return None;
    }
    let casts = |g: &Graph, to: Option<DType>| -> Vec<(mpc_ir::NodeId, DType)> {
        g.value(p)
            .uses()
            .iter()
            .filter_map(|u| match &g.node(u.node).op {
                Op::Cast(a) if matches!(a.to, DType::F16 | DType::BF16) && to.is_none_or(|t| t == a.to) => {
                    let out = g.node(u.node).outputs()[0];
                    (!g.is_output(out)).then_some((u.node, a.to))
                }
                _ => None,
            })
            .collect()
    };
    let to = casts(g, None).first()?.1;
    let name = g.unique_name(&format!("mpc.{to}.{pname}"));
    // f32 masters through the narrowing path (converted on all threads when first read, the same
    // round-to-nearest-even bits as `to_dtype`), anything else element by element.
    let copy = init.narrow(to).map_or_else(|| init.to_dtype(to), |(t, _)| t);
    let (low, read) = match shard {
        None => {
            let low = g.add_initializer(&name, copy);
            (low, low)
        }
        Some(z) => {
            let mut b = Builder::new(g);
            b.at(&format!("{pname}.gather"));
            let low = b.init(&name, z.block(&copy));
            let whole = super::shard::gathered(&mut b, low, init.shape(), z);
            g.set_ty(whole, mpc_ir::TypeInfo::new(to, mpc_ir::Shape::fixed(init.shape())));
            (low, whole)
        }
    };
    // The Casts are left to dead-code elimination: a node removed here would free an index that
    // the next added node takes, and the pass manager types only the nodes added after its start.
    for (n, _) in casts(g, Some(to)) {
        let out = g.node(n).outputs()[0];
        g.replace_uses(out, read);
    }
    Some(low)
}
