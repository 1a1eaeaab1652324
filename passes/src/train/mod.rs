//! The training passes: from a forward model to one whole mixed-precision training step.
//!
//! In pipeline order (after type inference): [`AddLoss`] (an FP32 loss on the model's output, or
//! the model's own scalar), then the precision pass (parameters stay FP32 masters, read through
//! one shared Cast each), [`TrainMode`] (Dropout draws its mask from the state `mpc.rng`,
//! BatchNormalization uses batch statistics), [`LossScale`] (the loss times the scale, which is training state), [`Autodiff`],
//! and [`Optimizer`]: unscale in FP32, one all-finite check over every gradient,
//! optional global-norm clipping, the update of the masters (moments FP32) that leaves everything
//! unchanged on a non-finite step and writes each master's low-precision copy (state that the
//! forward pass reads instead of the Cast), the dynamic loss-scale update and the step counter.
//!
//! Training state is carried as initializers that the step reads and outputs that hold their next
//! values. The passes record what they build in the graph's [`TrainSignature`] (the loss, the
//! scaled loss, the gradients, the step-skipped flag, the loss scale and the `state -> next`
//! pairs) and read it from there: a runtime keeps the state resident and writes each next value
//! into its state's slot, and the file writers store the runtime's part as metadata.

mod autodiff;
pub(crate) mod build;
mod decay;
mod differentiable;
mod low;
mod optimizer;
mod rules;
pub mod shard;
mod tie;

use std::collections::BTreeSet;

use mpc_ir::ops::{LossAttrs, LossScaleAttrs, LrKind, LrScheduleAttrs, ReduceAttrs, SeedAttrs};
use mpc_ir::{DType, Def, Dim, Graph, Op, Shape, Tensor, TrainSignature, TypeInfo, ValueId};

pub use autodiff::{differentiate, differentiate_all, Gradients};
use build::Builder;
pub use decay::NoDecay;
pub use differentiable::differentiable;
pub use optimizer::OptimizerPass;
pub use shard::StateShard;
pub use tie::{apply_ties, tie_weights, Tie};

use crate::{Changed, Context, Effect, Pass, PassError, Result};

#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    /// SoftmaxCrossEntropyLoss (mean over the labels not ignored) of the model's first output
    /// against integer labels.
    CrossEntropy(CrossEntropy),
    /// Mean squared error of the model's first output against targets of its shape.
    Mse,
    /// The model computes its own scalar loss: this output.
    Output(String),
}

/// Where cross-entropy finds the classes, and which label it skips.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropy {
    /// The class axis of the scores: 1 for `[batch, classes, ...]` (the default), -1 for a
    /// language model's `[batch, tokens, vocabulary]`. The labels have the scores' shape without it.
    pub axis: i64,
    /// Labels equal to this count for nothing (PyTorch's default: -100, the padding label).
    pub ignore_index: Option<i64>,
}

impl Default for CrossEntropy {
    fn default() -> Self {
        CrossEntropy { axis: 1, ignore_index: Some(-100) }
    }
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
    /// Dynamic scaling that starts where measured gradients say (`--loss-scale auto`): the
    /// caller resolves it to `Dynamic` before the passes run.
    Auto {
        attrs: LossScaleAttrs,
    },
}

/// Whether the loss scale never drops below 1, so that its reciprocal never enlarges a
/// gradient: a widened gradient divided by it is then finite exactly when the gradient is.
fn loss_scale_at_least_one(s: &LossScale) -> bool {
    match s {
        LossScale::Dynamic { init, attrs } => *init >= 1.0 && attrs.min_scale >= 1.0,
        LossScale::Auto { attrs } => attrs.min_scale >= 1.0,
        LossScale::Static(s) => *s >= 1.0,
        LossScale::None => true,
    }
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
    /// Train initializers that are copies or transposes of one another as one parameter
    /// ([`tie_weights`]).
    pub tie: bool,
    /// Where the dropout random stream starts (the state `mpc.rng`).
    pub seed: u64,
    /// The settings of dynamic loss scaling, whenever it is dynamic (asked for or by default).
    pub dynamic_scale: DynamicScale,
    /// The update writes each master weight's low-precision copy, the one the forward pass reads,
    /// as training state (`optimizer::low_copy`), instead of the next step casting the weight again. The
    /// same bits either way; off only to compare.
    pub weight_copies: bool,
    /// How the learning rate moves over the run; `None`: it stays `lr` (the state `mpc.lr`, which
    /// a runtime may rewrite between steps).
    pub schedule: Option<Schedule>,
    /// The parameters trained without weight decay ([`NoDecay`]).
    pub no_decay: Vec<NoDecay>,
    /// Micro-batches per update (gradient accumulation; 1: an update every step). The step sums
    /// its gradient into an FP32 accumulator per parameter and applies their mean on every
    /// `accumulate`-th step (the state `mpc.micro` counts), skipping the update when any of them
    /// was not finite.
    pub accumulate: u32,
    /// One rank of a data-parallel run: each gradient (and each batch norm's next running
    /// statistics) is averaged over the ranks by an `ai.mpc::AllReduce`, in FP32, before
    /// unscaling, so that every rank's finite flag, skip, loss scale and update agree. The program
    /// holds neither the rank nor the world size: every rank runs the same one.
    pub data_parallel: bool,
    /// The optimizer state sharded over the ranks (ZeRO stage 1, [`shard`]): this rank keeps its
    /// block of every master weight, moment and low-precision copy, gathers the weights at the
    /// step's start and reduce-scatters the gradients. `None`: every rank keeps all of it.
    pub shard_state: Option<StateShard>,
    /// Data parallel: the gradients all-reduced together in buckets of at most this many bytes
    /// (as DDP's `bucket_cap_mb`, 25 MiB by default), filled in the order the backward pass
    /// writes them; a larger gradient alone; 0: one all-reduce per gradient.
    pub bucket_bytes: u64,
}

/// A learning-rate schedule: `ai.mpc::LrSchedule`'s settings, computed on the device from the
/// count of applied updates (`mpc.step`) and the peak rate (`mpc.lr`).
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// The curve and its settings. `warmup` counts updates; `total`, the run's updates, may be 0
    /// until the trainer, which knows the data, fills it in ([`Schedule::for_run`]).
    pub attrs: LrScheduleAttrs,
    /// The warmup as a share of the run (`--warmup 0.1`), in place of `attrs.warmup`.
    pub warmup_share: Option<f64>,
}

impl Schedule {
    /// The schedule of a run of `total` updates, where it has no length of its own.
    pub fn for_run(&self, total: u64) -> Schedule {
        let mut s = self.clone();
        if s.attrs.total <= 0 {
            s.attrs.total = total as i64;
        }
        s
    }

    /// The op's attributes: the warmup share turned into updates (rounded up, as Hugging Face's
    /// `get_warmup_steps` does). A curve that needs the run's length and has none is an error.
    pub fn resolved(&self) -> Result<LrScheduleAttrs> {
        let mut a = self.attrs.clone();
        let needs_length =
            matches!(a.kind, LrKind::Linear | LrKind::Cosine | LrKind::OneCycle) || self.warmup_share.is_some();
        if needs_length && a.total <= 0 {
            return Err(PassError::Usage(format!(
                "the {} schedule needs the run's length in updates (total_steps)",
                LrKind::NAMES.iter().find(|(_, k)| *k == a.kind).map_or("learning-rate", |(n, _)| *n)
            )));
        }
        if let Some(share) = self.warmup_share {
            a.warmup = (share * a.total as f64).ceil() as i64;
        }
        if a.kind == LrKind::OneCycle && a.warmup >= a.total {
            return Err(PassError::Usage(format!(
                "the one-cycle schedule's rise ({} updates) must be shorter than the run ({} updates)",
                a.warmup, a.total
            )));
        }
        Ok(a)
    }
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

/// The loss scaling a policy calls for when none is asked for: dynamic (from `t`'s settings)
/// where the low dtype is FP16 and the weights keep FP32 masters (`mixed`), none otherwise (FP32;
/// BF16, which has FP32's range; the naive `fp16` policy, which has no masters to unscale into).
pub fn default_loss_scale(policy: Option<&crate::Policy>, t: &TrainOptions) -> LossScale {
    match policy {
        Some(p) if p.low == DType::F16 && !p.everything_low => t.dynamic_scale.loss_scale(),
        _ => LossScale::None,
    }
}

/// The FP32 master weights a policy keeps for training `g`: every trained parameter (not in
/// `freeze`), by name; none where the policy stores the weights low (the naive `fp16` policy).
pub fn masters(g: &Graph, policy: &crate::Policy, freeze: &BTreeSet<String>) -> BTreeSet<String> {
    if policy.everything_low {
        return BTreeSet::new();
    }
    trainable(g, freeze).into_iter().map(|v| g.name(v).to_string()).collect()
}

impl Default for TrainOptions {
    fn default() -> Self {
        TrainOptions {
            loss: Loss::CrossEntropy(CrossEntropy::default()),
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
            tie: true,
            weight_copies: true,
            schedule: None,
            no_decay: Vec::new(),
            accumulate: 1,
            data_parallel: false,
            shard_state: None,
            bucket_bytes: 25 << 20,
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
///
/// A model from the torch dynamo exporter names its program's parameters and buffers; there,
/// buffers (rotary tables, masks) are not trained, and a constant the exporter folded (named by
/// no entry) is a parameter only where the signature lost one (see [`ExportSignature`]).
pub fn trainable(g: &Graph, freeze: &BTreeSet<String>) -> Vec<ValueId> {
    parameters(g, freeze, Folded::FromLost)
}

/// The candidates [`tie_weights`] compares: [`trainable`]'s, and every constant a dynamo export
/// folded whatever its signature lost (a tied head's transpose, folded beside the embedding it
/// copies, trains as that embedding once tied).
pub fn tie_candidates(g: &Graph, freeze: &BTreeSet<String>) -> Vec<ValueId> {
    parameters(g, freeze, Folded::Any)
}

/// Which constants a dynamo export folded count as parameters.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Folded {
    /// Those [`ExportSignature::is_parameter`] admits.
    FromLost,
    /// Any with varied elements, as a tie's copy.
    Any,
}

fn parameters(g: &Graph, freeze: &BTreeSet<String>, folded: Folded) -> Vec<ValueId> {
    let signature = ExportSignature::of(g);
    let mut out = BTreeSet::new();
    // `mpc.` names are training state (the loss scale, moments, counters), `grad.` the passes' constants.
    let candidate = |v: ValueId| {
        let name = g.name(v);
        matches!(g.value(v).def(), Def::Init(t) if t.dtype().is_float() && !t.shape().is_empty())
            && !freeze.contains(name)
            && !name.starts_with("mpc.")
            && !name.starts_with("grad.")
            && !g.value(v).initializer().is_some_and(is_additive_mask)
            && signature.as_ref().is_none_or(|s| match folded {
                Folded::FromLost => s.is_parameter(g, v),
                Folded::Any => s.is_parameter(g, v) || s.may_be_copy(g, v),
            })
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

/// The constants that `trained` (the parameters training found) holds where a torch.export
/// program's signature names parameters that are no initializer of the graph (the exporter folded
/// them: a class token expanded to a fixed batch, a token-type row looked up for it), and those
/// parameters: each such constant trains as a weight of its own, not as the parameter it came
/// from, which the front end reports. `None` where the signature lost no parameter.
pub fn folded_weights(g: &Graph, trained: &[ValueId]) -> Option<(Vec<String>, Vec<String>)> {
    let signature = ExportSignature::of(g)?;
    let inits: BTreeSet<&str> = g.initializers().map(|v| g.name(v)).collect();
    let lost: Vec<String> = signature.params.iter().filter(|p| !inits.contains(p.as_str())).cloned().collect();
    let own: Vec<String> =
        trained.iter().map(|&v| g.name(v).to_string()).filter(|n| !signature.names_parameter(n)).collect();
    (!lost.is_empty() && !own.is_empty()).then_some((own, lost))
}

/// The parameters and buffers of a torch `ExportedProgram`, as the dynamo exporter records them in
/// the graph metadata `pkg.torch.export.ExportedProgram.graph_signature` (lines such as
/// `p_fc_weight: PARAMETER target='fc.weight'` and `b_rope_inv_freq: BUFFER target='rope.inv_freq'`).
pub struct ExportSignature {
    params: BTreeSet<String>,
    buffers: BTreeSet<String>,
    /// Some buffer is not an initializer: the exporter folded it into constants (a rotary table
    /// from `inv_freq`), which then cannot be told from folded parameters by name.
    buffer_folded: bool,
    /// Some parameter is not an initializer: the exporter folded it (a weight transposed, a
    /// class token expanded). Where none is lost, no folded constant came from a parameter alone.
    param_folded: bool,
}

impl ExportSignature {
    pub fn of(g: &Graph) -> Option<ExportSignature> {
        let mut sig = ExportSignature {
            params: BTreeSet::new(),
            buffers: BTreeSet::new(),
            buffer_folded: false,
            param_folded: false,
        };
        for e in mpc_ir::onnx::torch_export::signature(g)? {
            match e.kind.as_str() {
                "PARAMETER" => sig.params.extend(e.target),
                "BUFFER" | "CONSTANT_TENSOR" => sig.buffers.extend(e.target),
                _ => {}
            }
        }
        let inits: BTreeSet<&str> = g.initializers().map(|v| g.name(v)).collect();
        sig.buffer_folded = sig.buffers.iter().any(|b| !inits.contains(b.as_str()));
        sig.param_folded = sig.params.iter().any(|p| !inits.contains(p.as_str()));
        Some(sig)
    }

    /// Whether the signature names `name` as a parameter of the module.
    pub fn names_parameter(&self, name: &str) -> bool {
        self.params.contains(name)
    }

    /// Whether initializer `v` is a parameter: one the signature names so, or, where the signature
    /// lost a parameter, a constant the exporter folded (named by no entry: a transposed or
    /// reshaped weight, a batch norm folded into a convolution, a position-embedding lookup
    /// folded for the export's sequence length) whose elements are not all equal (a folded ones
    /// or zeros tensor is no weight), or that has one element and is read as a weight or a bias
    /// (a 1×1 Linear's transposed weight, PReLU's one slope: one read otherwise is as likely a
    /// constant of a decomposition, GELU's √½ or GroupNorm's unit scale). Where no parameter was
    /// lost, a folded constant is computed from constants and buffers (the taps of
    /// F.interpolate, a mask): no parameter. When a buffer was folded too, a folded constant is a
    /// parameter only when it is read as a weight or a bias ([`weight_or_bias_read`]): a folded
    /// table that only multiplies (rotary cos and sin) is a buffer. A constant named after an
    /// arithmetic op of the program ([`computed_name`]: `clamp_2`, the taps F.interpolate
    /// computes from an `arange`) is computed, not a parameter moved.
    pub fn is_parameter(&self, g: &Graph, v: ValueId) -> bool {
        if self.params.contains(g.name(v)) {
            return true;
        }
        if self.buffers.contains(g.name(v)) || !self.param_folded || computed_name(g.name(v)) {
            return false;
        }
        let Some(t) = g.value(v).initializer() else { return false };
        let one = t.numel() == 1;
        (one || !t.all_equal()) && (!(self.buffer_folded || one) || weight_or_bias_read(g, v, 2))
    }

    /// Whether initializer `v` may be an exporter's copy of a parameter (named by no entry, its
    /// elements varied): what [`tie_weights`] then compares with the parameters.
    fn may_be_copy(&self, g: &Graph, v: ValueId) -> bool {
        let name = g.name(v);
        !self.params.contains(name)
            && !self.buffers.contains(name)
            && g.value(v).initializer().is_some_and(|t| t.numel() > 1 && !t.all_equal())
    }
}

/// Whether `name` is a torch.export node name (the aten op's, then `_N`) of arithmetic on
/// indices and fills: what such a node computes from constants alone is no parameter, and a
/// parameter folded through it could not train as itself anyway.
fn computed_name(name: &str) -> bool {
    const COMPUTED: &[&str] = &[
        "arange",
        "linspace",
        "full",
        "full_like",
        "ones",
        "ones_like",
        "zeros",
        "zeros_like",
        "clamp",
        "clamp_min",
        "clamp_max",
        "floor",
        "ceil",
        "round",
        "trunc",
        "add",
        "sub",
        "rsub",
        "mul",
        "div",
        "floor_divide",
        "remainder",
        "pow",
        "sqrt",
        "rsqrt",
        "reciprocal",
        "lt",
        "le",
        "gt",
        "ge",
        "eq",
        "ne",
        "where",
    ];
    let base = match name.rsplit_once('_') {
        Some((b, n)) if !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()) => b,
        _ => name,
    };
    COMPUTED.contains(&base)
}

/// Whether `v` is read as a weight (by a MatMul, Gemm, Conv or ConvTranspose, as a Gather's
/// table or PRelu's slope) or added (Add, Sub: a bias, an embedding; additive masks are never
/// parameters), directly or through `depth` Transposes, Reshapes or Casts.
fn weight_or_bias_read(g: &Graph, v: ValueId, depth: usize) -> bool {
    g.value(v).uses().iter().any(|u| match &g.node(u.node).op {
        Op::MatMul | Op::Add | Op::Sub => true,
        Op::Gemm(_) | Op::Conv(_) | Op::ConvTranspose(_) => true,
        Op::Gather(_) => u.slot == 0,
        Op::PRelu => u.slot == 1,
        Op::Transpose(_) | Op::Reshape(_) | Op::Cast(_) if depth > 0 => {
            g.node(u.node).outputs().iter().any(|&o| weight_or_bias_read(g, o, depth - 1))
        }
        _ => false,
    })
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
            Loss::CrossEntropy(ce) => {
                let logits = first_float()?;
                let shape = g
                    .ty(logits)
                    .shape
                    .clone()
                    .ok_or_else(|| PassError::Usage(format!("the shape of `{}` is unknown", g.name(logits))))?;
                let axis = match mpc_ir::normalize_axis(ce.axis, shape.rank()) {
                    Some(a) if shape.rank() >= 2 && a > 0 => a,
                    _ => {
                        return Err(PassError::Usage(format!(
                            "cross-entropy over axis {} needs scores with a batch axis before it; `{}` is {shape}",
                            ce.axis,
                            g.name(logits)
                        )))
                    }
                };
                let mut dims: Vec<Dim> = shape.dims().to_vec();
                dims.remove(axis);
                let labels = g.add_input(&o.labels, TypeInfo::new(DType::I64, Shape(dims)));
                let mut b = Builder::new(g);
                b.at("loss.cross_entropy");
                let rank = shape.rank();
                // SoftmaxCrossEntropyLoss takes the classes on axis 1. Classes last (a language
                // model's) flatten to [positions, classes] and the labels to [positions]: views,
                // no copy. Any other axis moves to 1.
                let (scores, labels) = if axis == 1 {
                    (logits, labels)
                } else if axis == rank - 1 {
                    let flat = b.op("scores", Op::Flatten(mpc_ir::ops::FlattenAttrs { axis: axis as i64 }), &[logits]);
                    let minus_one = b.ints(&[-1]);
                    let attrs = mpc_ir::ops::ReshapeAttrs { allowzero: false };
                    (flat, b.op("labels", Op::Reshape(attrs), &[labels, minus_one]))
                } else {
                    let mut perm: Vec<i64> = (0..rank as i64).filter(|&d| d != axis as i64).collect();
                    perm.insert(1, axis as i64);
                    let t = b.op("scores", Op::Transpose(mpc_ir::ops::TransposeAttrs { perm: Some(perm) }), &[logits]);
                    (t, labels)
                };
                let name = b.g.unique_name("loss");
                let op = Op::SoftmaxCrossEntropyLoss(LossAttrs {
                    ignore_index: ce.ignore_index,
                    reduction: mpc_ir::ops::Reduction::Mean,
                });
                b.g.add_op(&name, op, &[Some(scores), Some(labels)], 1).1[0]
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

/// Name of the peak learning rate's state: an f32 scalar the step reads and never changes (a
/// runtime rewrites it to set the rate from the host).
pub const LR: &str = "mpc.lr";

/// Name of gradient accumulation's count of micro-batches since the last update (an i64 state).
pub const MICRO: &str = "mpc.micro";

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
            LossScale::Auto { .. } => {
                return Err(PassError::Usage(
                    "--loss-scale auto needs gradients measured on data (--calibrate DATA)".into(),
                ))
            }
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
        let grads = differentiate_all(g, &params, target, seed)?;
        let sig = signature(g);
        sig.grads = grads.params.into_iter().collect();
        sig.activation_grads = grads.activations;
        Ok(Changed::Yes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dynamo export's folded constants: where the signature lost a parameter, a folded
    /// weight of one element trains (a 1×1 Linear's transposed weight read by MatMul), while one
    /// read by a Mul (GELU's √½) and a constant named after arithmetic (F.interpolate's taps,
    /// `clamp_2`) do not; where none was lost, no folded constant trains, but a varied one is
    /// still a candidate for a tie.
    #[test]
    fn folded_constants_train_only_where_the_signature_lost_a_parameter() {
        let text = "mpcir 1\ngraph \"g\"\n  input %0 \"x\": f32[2,1]
  init %1 \"fc.bias\" = f32[1]{0.5}
  init %2 \"val_4\" = f32[1,1]{0.25}
  init %3 \"clamp_2\" = f32[2,1]{0.25, 0.75}
  init %4 \"val_9\" = f32[1,1]{3}
  %5 \"m\": f32[2,1] = MatMul(%0, %2)
  %6 \"a\": f32[2,1] = Add(%5, %1)
  %7 \"t\": f32[2,1] = Mul(%6, %3)
  %8 \"y\": f32[2,1] = Mul(%7, %4)
  output %8
end
";
        let names = |lost: bool, f: fn(&Graph, &BTreeSet<String>) -> Vec<ValueId>| {
            let mut g = mpc_ir::text::parse(text, None).unwrap();
            let lines = if lost { "p_fc_weight: PARAMETER target='fc.weight'\n" } else { "" };
            let sig = format!("\n# inputs\n{lines}p_fc_bias: PARAMETER target='fc.bias'\nx: USER_INPUT\n");
            g.meta.graph_metadata_props.push((mpc_ir::onnx::torch_export::SIGNATURE_KEY.into(), sig));
            f(&g, &BTreeSet::new()).into_iter().map(|v| g.name(v).to_string()).collect::<Vec<_>>()
        };
        assert_eq!(names(true, trainable), ["fc.bias", "val_4"]);
        assert_eq!(names(false, trainable), ["fc.bias"]);
        assert_eq!(names(false, tie_candidates), ["fc.bias", "clamp_2"]);
    }
}
