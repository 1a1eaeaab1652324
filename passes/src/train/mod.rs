//! The training passes: from a forward model to one whole mixed-precision training step.
//!
//! In pipeline order (after type inference): [`AddLoss`] (an FP32 loss on the model's output, or
//! the model's own scalar), then the precision pass (parameters stay FP32 masters, read through
//! one shared Cast each), [`TrainMode`] (Dropout draws its mask from the state `mpc.rng`,
//! BatchNormalization uses batch statistics), [`LossScale`] (the loss times the scale, which is training state), [`Autodiff`],
//! and [`Optimizer`]: unscale in FP32, one all-finite check over every gradient,
//! optional global-norm clipping, the update of the masters (moments FP32) that leaves everything
//! unchanged on a non-finite step, the dynamic loss-scale update and the step counter.
//!
//! Training state is carried as initializers that the step reads and outputs that hold their next
//! values. The passes record what they build in the graph's [`TrainSignature`] (the loss, the
//! scaled loss, the gradients, the step-skipped flag, the loss scale and the `state -> next`
//! pairs) and read it from there: a runtime keeps the state resident and writes each next value
//! into its state's slot, and the file writers store the runtime's part as metadata.

mod autodiff;
mod build;
mod rules;

use std::collections::BTreeSet;

use mpc_ir::ops::{AdamAttrs, LossAttrs, LossScaleAttrs, ReduceAttrs, SeedAttrs, SgdAttrs};
use mpc_ir::{DType, Def, Dim, Graph, Op, Shape, Tensor, TrainSignature, TypeInfo, ValueId};

pub use autodiff::{differentiable, differentiate};
use build::Builder;

use crate::{Changed, Context, Effect, Pass, PassError, Result};

#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    /// SoftmaxCrossEntropyLoss (mean) of the model's first output against integer labels.
    CrossEntropy,
    /// Mean squared error of the model's first output against targets of its shape.
    Mse,
    /// The model computes its own scalar loss: this output.
    Output(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    Sgd,
    Momentum,
    Adam,
    AdamW,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LossScale {
    /// Dynamic scaling from `init`, updated by the rules in `attrs`.
    Dynamic {
        init: f32,
        attrs: LossScaleAttrs,
    },
    Static(f32),
    None,
}

/// Everything `--train` configures.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainOptions {
    pub loss: Loss,
    /// Name of the labels (or targets) input the loss adds.
    pub labels: String,
    pub optimizer: Optimizer,
    pub lr: f32,
    pub weight_decay: f32,
    pub momentum: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub epsilon: f32,
    pub clip_norm: Option<f32>,
    pub loss_scale: LossScale,
    /// Initializers that are not trained.
    pub freeze: BTreeSet<String>,
    /// Where the dropout random stream starts (the state `mpc.rng`).
    pub seed: u64,
    /// The settings of dynamic loss scaling, whenever it is dynamic (asked for or by default).
    pub dynamic_scale: DynamicScale,
}

/// Dynamic loss scaling: where the scale starts and how it moves.
#[derive(Clone, Debug, PartialEq)]
pub struct DynamicScale {
    pub init: f32,
    pub attrs: LossScaleAttrs,
}

impl Default for DynamicScale {
    fn default() -> Self {
        DynamicScale { init: 65536.0, attrs: LossScaleAttrs::default() }
    }
}

impl DynamicScale {
    pub fn loss_scale(&self) -> LossScale {
        LossScale::Dynamic { init: self.init, attrs: self.attrs.clone() }
    }
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            loss: Loss::CrossEntropy,
            labels: "labels".into(),
            optimizer: Optimizer::Adam,
            lr: 1e-3,
            weight_decay: 0.0,
            momentum: 0.9,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-8,
            clip_norm: None,
            loss_scale: LossScale::None,
            seed: 0,
            dynamic_scale: DynamicScale::default(),
            freeze: BTreeSet::new(),
        }
    }
}

impl LossScale {
    /// The paper's dynamic scaling: start 2^16, ×2 after 2000 finite steps, ×½ on overflow.
    pub fn dynamic() -> LossScale {
        LossScale::Dynamic { init: 65536.0, attrs: LossScaleAttrs::default() }
    }
}

/// The parameters: float initializers read through a differentiable input, minus frozen names,
/// scalars (exporters write constants such as 1/√d or GELU's √2 as rank-0 initializers) and
/// additive masks (see [`is_additive_mask`]). Batch-norm running statistics, shapes, indices and
/// boolean masks are read through other inputs.
pub fn trainable(g: &Graph, freeze: &BTreeSet<String>) -> Vec<ValueId> {
    let mut out = BTreeSet::new();
    // `mpc.` names are training state (the loss scale, moments, counters), `grad.` the passes' constants.
    let candidate = |v: ValueId| {
        let name = g.name(v);
        matches!(g.value(v).def(), Def::Init(t) if t.dtype().is_float() && !t.shape().is_empty())
            && !freeze.contains(name)
            && !name.starts_with("mpc.")
            && !name.starts_with("grad.")
            && !g.value(v).initializer().is_some_and(is_additive_mask)
    };
    for n in g.node_ids() {
        let node = g.node(n);
        for (s, v) in node.inputs().iter().enumerate() {
            let Some(v) = *v else { continue };
            // A master read through a Cast (after the precision pass) is still a parameter.
            let read = match node.op {
                Op::Cast(_) => node.outputs().iter().any(|&o| read_differentiably(g, o)),
                _ => differentiable(&node.op, s),
            };
            if read && candidate(v) {
                out.insert(v);
            }
        }
    }
    out.into_iter().collect()
}

/// An additive attention mask (a buffer, not a parameter, in the framework the model came from):
/// every element 0 or a "minus infinity" (≤ -1e4, or -inf), with at least one of the latter. No
/// weight is initialised that way, while a causal or padding mask always is.
pub fn is_additive_mask(t: &Tensor) -> bool {
    let masked = |x: f64| x <= -1e4;
    let mut any = false;
    for x in t.values() {
        if masked(x) {
            any = true;
        } else if x != 0.0 {
            return false;
        }
    }
    any
}

fn read_differentiably(g: &Graph, v: ValueId) -> bool {
    g.value(v).uses().iter().any(|u| differentiable(&g.node(u.node).op, u.slot))
}

/// The graph's training signature, begun when the first training pass records something.
fn signature(g: &mut Graph) -> &mut TrainSignature {
    g.train.get_or_insert_with(TrainSignature::default)
}

/// The loss value of a graph that [`AddLoss`] ran on.
pub fn loss_value(g: &Graph) -> Option<ValueId> {
    g.train.as_ref()?.loss
}

fn opts(cx: &Context) -> Result<&TrainOptions> {
    cx.train.as_ref().ok_or_else(|| PassError::Usage("the training passes need training options".into()))
}

/// Adds the FP32 loss (or adopts the model's own) and makes it the first output.
pub struct AddLoss;

impl Pass for AddLoss {
    fn name(&self) -> &'static str {
        "add-loss"
    }

    fn effect(&self) -> Effect {
        Effect::Adds
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let o = opts(cx)?;
        let first_float = || {
            g.outputs()
                .iter()
                .copied()
                .find(|&v| g.ty(v).dtype.is_some_and(|d| d.is_float()))
                .ok_or_else(|| PassError::Usage("the model has no float output to put a loss on".into()))
        };
        let loss = match &o.loss {
            Loss::Output(name) => {
                let v = g.outputs().iter().copied().find(|&v| g.name(v) == name).ok_or_else(|| {
                    let all: Vec<&str> = g.outputs().iter().map(|&v| g.name(v)).collect();
                    PassError::Usage(format!(
                        "--loss output:{name}: no output has that name (outputs: {})",
                        all.join(", ")
                    ))
                })?;
                let ty = g.ty(v);
                if ty.dtype != Some(DType::F32) || ty.shape.as_ref().is_some_and(|s| s.rank() != 0) {
                    return Err(PassError::Usage(format!(
                        "--loss output:{name}: the loss must be an f32 scalar, not {ty}"
                    )));
                }
                v
            }
            Loss::CrossEntropy => {
                let logits = first_float()?;
                let shape = g
                    .ty(logits)
                    .shape
                    .clone()
                    .ok_or_else(|| PassError::Usage(format!("the shape of `{}` is unknown", g.name(logits))))?;
                if shape.rank() < 2 {
                    return Err(PassError::Usage(format!(
                        "cross-entropy needs [batch, classes, ...] scores; `{}` is {shape}",
                        g.name(logits)
                    )));
                }
                let mut dims: Vec<Dim> = shape.dims().to_vec();
                dims.remove(1);
                let labels = g.add_input(&o.labels, TypeInfo::new(DType::I64, Shape(dims)));
                let name = g.unique_name("loss");
                let op = Op::SoftmaxCrossEntropyLoss(LossAttrs {
                    ignore_index: None,
                    reduction: mpc_ir::ops::Reduction::Mean,
                });
                g.add_op(&name, op, &[Some(logits), Some(labels)], 1).1[0]
            }
            Loss::Mse => {
                let out = first_float()?;
                let ty = g.ty(out).clone();
                let targets = g.add_input(&o.labels, ty);
                let mut b = Builder::new(g);
                b.at("loss.mse");
                let d = b.op("sub", Op::Sub, &[out, targets]);
                let sq = b.op("square", Op::Mul, &[d, d]);
                let name = b.g.unique_name("loss");
                let attrs = ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
                b.g.add_op(&name, Op::ReduceMean(attrs), &[Some(sq)], 1).1[0]
            }
        };
        let mut outs: Vec<ValueId> = vec![loss];
        outs.extend(g.outputs().iter().copied().filter(|&v| v != loss));
        g.set_outputs(outs);
        signature(g).loss = Some(loss);
        Ok(Changed::Yes)
    }
}

/// Name of the dropout random stream's state: an i64 key that every step advances.
pub const RNG: &str = "mpc.rng";

/// Whether a Dropout node runs in training mode: its `training_mode` input is true, or is not a
/// constant (then it may be true).
fn dropout_trains(g: &Graph, node: &mpc_ir::Node) -> bool {
    match node.input(2) {
        None => false,
        Some(t) => g.constant(t).and_then(|t| t.to_i64_vec()).is_none_or(|v| v.first() != Some(&0)),
    }
}

/// The forward ops that behave differently in training run as a framework's `train()` runs them.
/// Training-mode Dropout becomes `ai.mpc::SeededDropout`: its mask is drawn from the step's key
/// (the training state [`RNG`], which the optimizer pass advances every step) and a seed of the
/// node's own, so a step's masks are reproducible (a resumed run draws what a straight run does)
/// and the backward pass can read the mask the forward pass used. BatchNormalization exported in
/// inference mode (torch.onnx's default) normalises with the batch's statistics and updates its
/// running statistics, which become state. Dropout exported in inference mode stays the identity.
pub struct TrainMode;

impl Pass for TrainMode {
    fn name(&self) -> &'static str {
        "train-mode"
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let o = opts(cx)?;
        let dropouts: Vec<_> =
            g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Dropout(_)) && dropout_trains(g, g.node(n))).collect();
        let norms: Vec<_> =
            g.node_ids().filter(|&n| matches!(&g.node(n).op, Op::BatchNormalization(a) if !a.training_mode)).collect();
        if !dropouts.is_empty() && g.find(RNG).is_none() {
            g.add_initializer(RNG, Tensor::from_i64(vec![], &[o.seed as i64]));
        }
        for &n in &dropouts {
            let key = g.find(RNG).expect("added above");
            let Op::Dropout(a) = &g.node(n).op else { continue };
            // The node's seed: its own `seed` attribute, else its name's hash (stable run to run).
            let seed = a.seed.unwrap_or_else(|| fnv1a(g.node(n).name.as_bytes()) as i64);
            *g.node_op_mut(n) = Op::SeededDropout(Box::new(SeedAttrs { seed }));
            g.set_input(n, 2, Some(key));
            if g.node(n).outputs().len() < 2 {
                let x = g.node(n).outputs()[0];
                let ty = TypeInfo { dtype: Some(DType::Bool), shape: g.ty(x).shape.clone() };
                add_output(g, n, "mask", ty);
            }
        }
        for &n in &norms {
            if let Op::BatchNormalization(a) = g.node_op_mut(n) {
                a.training_mode = true;
            }
            // The updated running mean and variance, typed like the running statistics.
            for (slot, what) in [(3, "running_mean"), (4, "running_var")] {
                if g.node(n).outputs().len() == slot - 2 {
                    let stat = g.node(n).input(slot).ok_or_else(|| PassError::Node {
                        node: g.node_label(n),
                        msg: format!("BatchNormalization has no {what} input"),
                    })?;
                    add_output(g, n, what, g.ty(stat).clone());
                }
            }
        }
        Ok(if dropouts.is_empty() && norms.is_empty() { Changed::No } else { Changed::Yes })
    }
}

/// A new output of `n`, named after its first output.
fn add_output(g: &mut Graph, n: mpc_ir::NodeId, what: &str, ty: TypeInfo) {
    let name = format!("{}.{what}", g.name(g.node(n).outputs()[0]));
    let v = g.new_value(&name, ty);
    g.push_output(n, v);
}

/// 64-bit FNV-1a: a stable hash of a name.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
}

/// Multiplies the loss by the loss scale (training state `mpc.loss_scale`) when scaling is on.
pub struct LossScalePass;

impl Pass for LossScalePass {
    fn name(&self) -> &'static str {
        "loss-scale"
    }

    fn effect(&self) -> Effect {
        Effect::Adds
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let o = opts(cx)?;
        let init = match o.loss_scale {
            LossScale::Dynamic { init, .. } => init,
            LossScale::Static(s) => s,
            LossScale::None => return Ok(Changed::No),
        };
        let loss = loss_value(g).ok_or_else(|| PassError::Usage("no loss: run add-loss first".into()))?;
        let mut b = Builder::new(g);
        let scale = b.init("mpc.loss_scale", Tensor::from_f32(vec![], &[init]));
        let name = b.g.unique_name("loss.scaled");
        let scaled = b.g.add_op(&name, Op::Mul, &[Some(loss), Some(scale)], 1).1[0];
        let sig = signature(g);
        sig.scaled_loss = Some(scaled);
        sig.loss_scale = Some(scale);
        Ok(Changed::Yes)
    }
}

/// Generates the backward graph; parameter gradients are named `{param}.grad`.
pub struct Autodiff;

impl Pass for Autodiff {
    fn name(&self) -> &'static str {
        "autodiff"
    }

    fn effect(&self) -> Effect {
        Effect::Adds
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let o = opts(cx)?;
        let loss = loss_value(g).ok_or_else(|| PassError::Usage("no loss: run add-loss first".into()))?;
        let target = g.train.as_ref().and_then(|t| t.scaled_loss).unwrap_or(loss);
        let params = trainable(g, &o.freeze);
        if params.is_empty() {
            return Err(PassError::Usage(
                "nothing to train: the model has no float initializer the loss depends on".into(),
            ));
        }
        let seed = {
            let mut b = Builder::new(g);
            b.init("grad.seed", Tensor::from_f32(vec![], &[1.0]))
        };
        let grads = differentiate(g, &params, target, seed)?;
        signature(g).grads = grads.into_iter().collect();
        Ok(Changed::Yes)
    }
}

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
        let mut state: Vec<(ValueId, ValueId)> = Vec::new();
        // Batch-norm running statistics computed in training mode are state too.
        for n in g.node_ids().collect::<Vec<_>>() {
            let node = g.node(n);
            if let Op::BatchNormalization(a) = &node.op {
                if a.training_mode {
                    for slot in 1..=2 {
                        if let (Some(s), Some(&next)) = (node.input(slot + 2), node.outputs().get(slot)) {
                            if g.value(s).initializer().is_some() {
                                state.push((s, next));
                            }
                        }
                    }
                }
            }
        }
        let mut b = Builder::new(g);
        b.at("optimizer");
        let scale = b.g.train.as_ref().and_then(|t| t.loss_scale);
        // 1. Unscale in FP32: g / S (a gradient computed low is widened first).
        let inv = scale.map(|s| b.op("inv_scale", Op::Reciprocal, &[s]));
        let mut gs: Vec<(ValueId, ValueId)> = Vec::new();
        for &(p, d) in &pg {
            let pname = b.g.name(p).to_string();
            b.at(&format!("{pname}.update"));
            let pdt = b.dtype(p).map_err(PassError::Usage)?;
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
        // 2. One finite flag for the whole step.
        b.at("optimizer");
        let all: Vec<Option<ValueId>> = gs.iter().map(|&(_, d)| Some(d)).collect();
        let finite = b.ops("all_finite", Op::AllFinite, &all, 1)[0];
        // 3. Global-norm clipping after unscaling: g · min(1, c / (‖g‖ + 1e-6)).
        if let Some(c) = o.clip_norm {
            let attrs = ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
            let mut sq = Vec::new();
            for &(p, d) in &gs {
                // The gradients have their parameters' dtypes by now (the nodes added here are
                // typed after the pass).
                let d32 = if b.dtype(p).map_err(PassError::Usage)? == DType::F32 { d } else { b.cast(d, DType::F32) };
                sq.push(Some(b.ops("sumsq", Op::ReduceSumSquare(attrs.clone()), &[Some(d32)], 1)[0]));
            }
            let total = b.ops("sumsq_total", Op::Sum, &sq, 1)[0];
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
        }
        // 4. The step counter advances on applied steps only.
        let step = b.init("mpc.step", Tensor::from_i64(vec![], &[0]));
        let inc = b.cast(finite, DType::I64);
        let step_next = b.op("step_next", Op::Add, &[step, inc]);
        state.push((step, step_next));
        // 5. The updates.
        for &(p, d) in &gs {
            let pname = b.g.name(p).to_string();
            b.at(&format!("{pname}.update"));
            let tensor =
                b.g.value(p)
                    .initializer()
                    .cloned()
                    .ok_or_else(|| PassError::Usage(format!("`{pname}` is not an initializer")))?;
            let zeros =
                || Tensor::from_f64_as(tensor.dtype(), tensor.shape().to_vec(), &vec![0.0; tensor.numel() as usize]);
            match o.optimizer {
                Optimizer::Sgd | Optimizer::Momentum => {
                    let momentum = if o.optimizer == Optimizer::Momentum { o.momentum } else { 0.0 };
                    let attrs = SgdAttrs { lr: o.lr, momentum, nesterov: false, weight_decay: o.weight_decay };
                    let mut ins = vec![Some(p), Some(d), Some(finite)];
                    let vel = (momentum != 0.0).then(|| b.init(&format!("mpc.velocity.{pname}"), zeros()));
                    ins.extend(vel.map(Some));
                    let outs = b.ops("sgd", Op::SgdUpdate(Box::new(attrs)), &ins, 1 + vel.is_some() as usize);
                    state.push((p, outs[0]));
                    if let Some(v) = vel {
                        state.push((v, outs[1]));
                    }
                }
                Optimizer::Adam | Optimizer::AdamW => {
                    let attrs = AdamAttrs {
                        beta1: o.beta1,
                        beta2: o.beta2,
                        decoupled: o.optimizer == Optimizer::AdamW,
                        epsilon: o.epsilon,
                        lr: o.lr,
                        weight_decay: o.weight_decay,
                    };
                    let m = b.init(&format!("mpc.adam_m.{pname}"), zeros());
                    let v = b.init(&format!("mpc.adam_v.{pname}"), zeros());
                    let ins = [Some(p), Some(d), Some(m), Some(v), Some(step_next), Some(finite)];
                    let outs = b.ops("adam", Op::AdamUpdate(Box::new(attrs)), &ins, 3);
                    state.push((p, outs[0]));
                    state.push((m, outs[1]));
                    state.push((v, outs[2]));
                }
            }
        }
        // 6. Dynamic loss scaling.
        b.at("optimizer");
        if let (LossScale::Dynamic { attrs, .. }, Some(s)) = (&o.loss_scale, scale) {
            let good = b.init("mpc.good_steps", Tensor::from_i64(vec![], &[0]));
            let outs = b.ops(
                "loss_scale",
                Op::LossScaleUpdate(Box::new(attrs.clone())),
                &[Some(s), Some(good), Some(finite)],
                2,
            );
            state.push((s, outs[0]));
            state.push((good, outs[1]));
        }
        // 7. The dropout stream moves on every step, applied or skipped: a skipped step's
        // forward pass drew its masks all the same.
        if let Some(key) = b.g.find(RNG).filter(|&k| matches!(b.g.value(k).def(), Def::Init(_))) {
            let one = b.scalar(1.0, DType::I64);
            let next = b.op("rng_next", Op::Add, &[key, one]);
            state.push((key, next));
        }
        let skipped = b.op("skipped", Op::Not, &[finite]);
        // Outputs: loss, the step-skipped flag, the model's outputs, then every next state.
        let mut outs = vec![loss];
        let sname = b.g.unique_name("mpc.step_skipped");
        b.g.rename(skipped, &sname);
        outs.push(skipped);
        outs.extend(b.g.outputs().iter().copied().filter(|&v| v != loss));
        for &(s, next) in &state {
            let want = format!("{}.next", b.g.name(s));
            if !b.g.is_output(next) && b.g.name(next) != want && b.g.find(&want).is_none() {
                b.g.rename(next, &want);
            }
            if !outs.contains(&next) {
                outs.push(next);
            }
        }
        b.g.set_outputs(outs);
        let sig = signature(g);
        sig.skipped = Some(skipped);
        sig.state = state;
        g.meta.set_opset(mpc_ir::ops::MPC_DOMAIN, 1);
        Ok(Changed::Yes)
    }
}
