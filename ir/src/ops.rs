//! The closed op set.
//!
//! One variant per supported op, named exactly as its ONNX `op_type`, with a typed attribute struct
//! where the op has attributes. The internal form of each op is its newest ONNX form (inputs that
//! older opsets had as attributes are inputs here); the importer normalises older forms and the
//! exporter writes the form of the target opset. Everything else is [`Op::Opaque`], which keeps the
//! node losslessly and which passes leave at its original dtypes.
//!
//! Adding an op: add it to the `define_ops!` list (and an attribute struct if it has attributes);
//! the compiler then points at every exhaustive `match` that must learn it.

use serde::{Deserialize, Serialize};

use crate::attr::{attr_struct, string_enum_attr, Attr, AttrValue, Attrs};

/// Declares an enum for a string attribute with a closed set of values, and its parsing.
macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident, $kind:literal { $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name { $($(#[$vm])* $variant),+ }
        impl $name {
            pub const NAMES: &'static [(&'static str, $name)] = &[$(($text, $name::$variant)),+];
        }
        string_enum_attr!($name, $kind);
    };
}

string_enum!(
    /// Gelu's `approximate`.
    GeluApprox, "one of none, tanh" { Erf = "none", Tanh = "tanh" });
string_enum!(
    /// The `reduction` of a loss.
    Reduction, "one of none, sum, mean" { None = "none", Sum = "sum", Mean = "mean" });
string_enum!(
    /// Resize's `mode`.
    ResizeMode, "one of nearest, linear, cubic" { Nearest = "nearest", Linear = "linear", Cubic = "cubic" });
string_enum!(
    /// Resize's `coordinate_transformation_mode`.
    CoordinateMode, "one of half_pixel, half_pixel_symmetric, pytorch_half_pixel, align_corners, asymmetric, tf_crop_and_resize" {
        HalfPixel = "half_pixel", HalfPixelSymmetric = "half_pixel_symmetric",
        PytorchHalfPixel = "pytorch_half_pixel", AlignCorners = "align_corners",
        Asymmetric = "asymmetric", TfCropAndResize = "tf_crop_and_resize" });
string_enum!(
    /// Resize's `nearest_mode`.
    NearestMode, "one of round_prefer_floor, round_prefer_ceil, floor, ceil" {
        RoundPreferFloor = "round_prefer_floor", RoundPreferCeil = "round_prefer_ceil",
        Floor = "floor", Ceil = "ceil" });
string_enum!(
    /// Resize's `keep_aspect_ratio_policy`.
    AspectPolicy, "one of stretch, not_larger, not_smaller" {
        Stretch = "stretch", NotLarger = "not_larger", NotSmaller = "not_smaller" });
string_enum!(
    /// ScatterND's and ScatterElements' `reduction`: how an update combines with the value it
    /// lands on (`none` replaces it).
    ScatterReduction, "one of none, add, mul, max, min" {
        None = "none", Add = "add", Mul = "mul", Max = "max", Min = "min" });
string_enum!(
    /// `ai.mpc::Attention`'s operand layout: `bhsd`, [..., heads, rows, head dim], or `bshd`,
    /// [batch, rows, heads, head dim] (the heads as a model's projection writes them).
    AttentionLayout, "one of bhsd, bshd" { Bhsd = "bhsd", Bshd = "bshd" });
string_enum!(
    /// `ai.mpc::LrSchedule`'s `kind`: the learning-rate curve after the warmup.
    LrKind, "one of constant, linear, cosine, step, one_cycle" {
        Constant = "constant", Linear = "linear", Cosine = "cosine", Step = "step", OneCycle = "one_cycle" });
string_enum!(
    /// `ai.mpc::AllReduce`'s `reduction`: how the ranks' tensors combine, element by element.
    CollectiveReduction, "one of mean, sum, max" { Mean = "mean", Sum = "sum", Max = "max" });
string_enum!(
    /// Pad's `mode`.
    PadMode, "one of constant, reflect, edge, wrap" {
        Constant = "constant", Reflect = "reflect", Edge = "edge", Wrap = "wrap" });
string_enum!(
    /// RoiAlign's `mode`: the samples of a bin averaged, or their largest weighted corner.
    RoiMode, "one of avg, max" { Avg = "avg", Max = "max" });
string_enum!(
    /// RoiAlign's `coordinate_transformation_mode` (opset 16; before it, `output_half_pixel`).
    RoiCoordinates, "one of half_pixel, output_half_pixel" {
        HalfPixel = "half_pixel", OutputHalfPixel = "output_half_pixel" });
string_enum!(
    /// BitShift's `direction`.
    ShiftDirection, "one of LEFT, RIGHT" { Left = "LEFT", Right = "RIGHT" });
impl crate::attr::Placeholder for ShiftDirection {
    fn placeholder() -> Self {
        ShiftDirection::Left
    }
}
use crate::geometry::AutoPad;
use crate::{DType, Tensor};

attr_struct!(ModAttrs { fmod: bool[default = false] });
attr_struct!(AlphaAttrs { alpha: f32[default = 0.01f32] });
attr_struct!(EluAttrs { alpha: f32[default = 1.0f32] });
attr_struct!(GeluAttrs { approximate: GeluApprox[default = GeluApprox::Erf] });
attr_struct!(HardSigmoidAttrs { alpha: f32[default = 0.2f32], beta: f32[default = 0.5f32] });
attr_struct!(GemmAttrs {
    alpha: f32[default = 1.0f32],
    beta: f32[default = 1.0f32],
    transA: bool[default = false],
    transB: bool[default = false],
});
attr_struct!(
    /// Conv and ConvTranspose (the last two fields are ConvTranspose's only).
    ConvAttrs {
    auto_pad: AutoPad [default = AutoPad::NotSet],
    dilations: Vec<i64> [default = Vec::new()],
    group: i64 [default = 1],
    kernel_shape: Vec<i64> [default = Vec::new()],
    output_padding: Vec<i64> [default = Vec::new()],
    output_shape: Vec<i64> [default = Vec::new()],
    pads: Vec<i64> [default = Vec::new()],
    strides: Vec<i64> [default = Vec::new()],
});
attr_struct!(BatchNormAttrs {
    epsilon: f32[default = 1e-5f32],
    momentum: f32[default = 0.9f32],
    training_mode: bool[default = false],
});
attr_struct!(LayerNormAttrs { axis: i64[default = -1], epsilon: f32[default = 1e-5f32], stash_type: i64[default = 1] });
attr_struct!(EpsilonAttrs { epsilon: f32[default = 1e-5f32] });
attr_struct!(GroupNormAttrs {
    epsilon: f32[default = 1e-5f32],
    num_groups: i64[required],
    stash_type: i64[default = 1],
});
attr_struct!(LrnAttrs {
    alpha: f32[default = 1e-4f32],
    beta: f32[default = 0.75f32],
    bias: f32[default = 1.0f32],
    size: i64[required],
});
attr_struct!(
    /// Softmax, LogSoftmax (opset 13 semantics: one axis).
    SoftmaxAttrs { axis: i64 [default = -1] });
attr_struct!(
    /// MaxPool and AveragePool (`storage_order` is MaxPool's, `count_include_pad` AveragePool's).
    PoolAttrs {
    auto_pad: AutoPad [default = AutoPad::NotSet],
    ceil_mode: bool[default = false],
    count_include_pad: bool[default = false],
    dilations: Vec<i64> [default = Vec::new()],
    kernel_shape: Vec<i64> [required],
    pads: Vec<i64> [default = Vec::new()],
    storage_order: i64 [default = 0],
    strides: Vec<i64> [default = Vec::new()],
});
attr_struct!(
    /// Reduce* ops; axes are input 1 (opset 18 form).
    ReduceAttrs {
    keepdims: bool[default = true],
    noop_with_empty_axes: bool[default = false],
});
attr_struct!(SeluAttrs { alpha: f32[default = 1.6732632f32], gamma: f32[default = 1.050701f32] });
attr_struct!(IsInfAttrs { detect_negative: bool[default = true], detect_positive: bool[default = true] });
attr_struct!(TriluAttrs { upper: bool[default = true] });
attr_struct!(
    /// CumSum and CumProd (and ai.mpc::CumProdGrad).
    CumSumAttrs { exclusive: bool[default = false], reverse: bool[default = false] });
attr_struct!(ArgAttrs {
    axis: i64[default = 0],
    keepdims: bool[default = true],
    select_last_index: bool[default = false]
});
attr_struct!(BitShiftAttrs { direction: ShiftDirection[required] });
attr_struct!(
    /// RoiAlign (and ai.mpc::RoiAlignGrad).
    RoiAlignAttrs {
    coordinate_transformation_mode: RoiCoordinates[default = RoiCoordinates::HalfPixel],
    mode: RoiMode[default = RoiMode::Avg],
    output_height: i64[default = 1],
    output_width: i64[default = 1],
    sampling_ratio: i64[default = 0],
    spatial_scale: f32[default = 1.0f32],
});
attr_struct!(ReshapeAttrs { allowzero: bool[default = false] });
attr_struct!(TransposeAttrs { perm: Vec<i64> [optional] });
attr_struct!(FlattenAttrs { axis: i64[default = 1] });
attr_struct!(
    /// Concat (axis required), Gather, GatherElements (axis default 0) share the shape of this
    /// struct but not the requiredness, hence two structs.
    ConcatAttrs { axis: i64 [required] });
attr_struct!(AxisAttrs { axis: i64[default = 0] });
attr_struct!(GatherNdAttrs { batch_dims: i64[default = 0] });
attr_struct!(ScatterNdAttrs { reduction: ScatterReduction[default = ScatterReduction::None] });
attr_struct!(ScatterElementsAttrs {
    axis: i64[default = 0],
    reduction: ScatterReduction[default = ScatterReduction::None],
});
attr_struct!(SplitAttrs { axis: i64[default = 0], num_outputs: i64[optional] });
attr_struct!(PadAttrs { mode: PadMode[default = PadMode::Constant] });
attr_struct!(DropoutAttrs { seed: i64[optional] });
attr_struct!(CastAttrs { saturate: bool[default = true], to: DType[required] });
attr_struct!(ConstantAttrs { value: Tensor[required] });
attr_struct!(ConstantOfShapeAttrs { value: Tensor[optional] });
attr_struct!(ShapeAttrs { end: i64[optional], start: i64[default = 0] });
attr_struct!(EinsumAttrs { equation: String[required] });
attr_struct!(
    /// TopK (k is input 1). `sorted = 0` leaves the order to the implementation: mpc sorts anyway.
    TopKAttrs { axis: i64[default = -1], largest: bool[default = true], sorted: bool[default = true] });

/// The equation with each `...` written as letters, given the operands' shapes (`None` for a dim
/// of unknown size): an operand's ellipsis stands for its dims that no letter names, aligned
/// from the right across operands as numpy broadcasts them; the output's ellipsis (or, without
/// `->`, the output's head) is the longest of them. A dim of size 1 that broadcasts against a
/// larger one gets a letter of its own, summed over (a sum over one element is that element).
/// The result has `->` and no ellipsis; an equation without one comes back as it is.
pub fn einsum_expand(equation: &str, shapes: &[Vec<Option<u64>>]) -> Result<String, String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    if !eq.contains("...") {
        return Ok(eq);
    }
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), Some(r.to_string())),
        None => (eq.clone(), None),
    };
    let terms: Vec<&str> = lhs.split(',').collect();
    if terms.len() != shapes.len() {
        return Err(format!("`{eq}` has {} operands, the node {} inputs", terms.len(), shapes.len()));
    }
    let mut free = ('a'..='z').chain('A'..='Z').filter(|c| !eq.contains(*c));
    // Per operand, the dims its ellipsis covers; the broadcast rank is the longest.
    let mut covered = Vec::with_capacity(terms.len());
    for (i, (t, s)) in terms.iter().zip(shapes).enumerate() {
        let letters = t.replacen("...", "", 1).len();
        let n = if t.contains("...") {
            s.len()
                .checked_sub(letters)
                .ok_or_else(|| format!("`{eq}`: operand {i} has {letters} labels but rank {}", s.len()))?
        } else {
            0
        };
        covered.push(n);
    }
    let rank = covered.iter().copied().max().unwrap_or(0);
    // The broadcast size of each ellipsis dim (counted from the right), where it is known.
    let size = |k: usize| -> Option<u64> {
        let sizes: Vec<Option<u64>> = terms
            .iter()
            .zip(shapes)
            .zip(&covered)
            .filter(|((t, _), &n)| t.contains("...") && k < n)
            .map(|((t, s), &n)| s[t.find("...").unwrap() + n - 1 - k])
            .collect();
        sizes.iter().flatten().copied().max()
    };
    let shared: Vec<char> = (0..rank).map(|_| free.next()).collect::<Option<_>>().ok_or("too many labels")?;
    let mut out_terms = Vec::with_capacity(terms.len());
    for ((t, s), &n) in terms.iter().zip(shapes).zip(&covered) {
        let Some(at) = t.find("...") else {
            out_terms.push(t.to_string());
            continue;
        };
        let mut labels = String::new();
        for j in 0..n {
            let k = n - 1 - j; // the dim's place from the right
            if s[at + j] == Some(1) && size(k).is_some_and(|b| b > 1) {
                labels.push(free.next().ok_or("too many labels")?);
            } else {
                labels.push(shared[rank - 1 - k]);
            }
        }
        out_terms.push(t.replacen("...", &labels, 1));
    }
    let head: String = shared.iter().collect();
    let rhs = match rhs {
        Some(r) => r.replacen("...", &head, 1),
        None => {
            let mut once: Vec<char> =
                lhs.chars().filter(|&c| c.is_ascii_alphabetic() && lhs.matches(c).count() == 1).collect();
            once.sort_unstable();
            head + &once.into_iter().collect::<String>()
        }
    };
    Ok(format!("{}->{rhs}", out_terms.join(",")))
}

/// An Einsum equation's operand terms and output term, whitespace removed; without `->` the
/// output is the labels that appear once, in alphabetical order. An ellipsis is refused
/// ([`einsum_expand`] writes it out once the operands' shapes are known).
pub fn einsum_parts(equation: &str) -> Result<(Vec<String>, String), String> {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    if eq.contains("...") {
        return Err("Einsum with an ellipsis".into());
    }
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l.to_string(), r.to_string()),
        None => {
            let mut once: Vec<char> = eq.chars().filter(|c| c.is_ascii_alphabetic()).collect();
            once.sort_unstable();
            let r = once.iter().filter(|c| once.iter().filter(|d| d == c).count() == 1).collect();
            (eq.clone(), r)
        }
    };
    Ok((lhs.split(',').map(String::from).collect(), rhs))
}
attr_struct!(
    /// SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss.
    LossAttrs { ignore_index: i64 [optional], reduction: Reduction [default = Reduction::Mean] });
attr_struct!(
    /// `ai.mpc::SgdUpdate`: plain SGD (`momentum` 0) or SGD with momentum (Nesterov optional).
    SgdAttrs {
    lr: f32 [required],
    momentum: f32 [default = 0.0f32],
    nesterov: bool[default = false],
    weight_decay: f32 [default = 0.0f32],
});
attr_struct!(
    /// `ai.mpc::AdamUpdate`: Adam, or AdamW when `decoupled` is 1 (weight decay applied to the
    /// weight, not added to the gradient).
    AdamAttrs {
    beta1: f32 [default = 0.9f32],
    beta2: f32 [default = 0.999f32],
    decoupled: bool[default = false],
    epsilon: f32 [default = 1e-8f32],
    lr: f32 [required],
    weight_decay: f32 [default = 0.0f32],
});
attr_struct!(
    /// `ai.mpc::AllReduce`: every rank's tensor combined over the ranks of a data-parallel run.
    AllReduceAttrs { reduction: CollectiveReduction [default = CollectiveReduction::Mean] });
attr_struct!(
    /// `ai.mpc::ReduceScatter`: the ranks' 1-D tensors of `world · s` elements combined, and rank
    /// r given elements `[r·s, (r+1)·s)` of the result.
    ReduceScatterAttrs {
    reduction: CollectiveReduction [default = CollectiveReduction::Mean],
    world: i64 [required],
});
attr_struct!(
    /// `ai.mpc::AllGather`: the ranks' 1-D tensors of `s` elements concatenated in rank order, on
    /// every rank.
    AllGatherAttrs { world: i64 [required] });
attr_struct!(
    /// `ai.mpc::LossScaleUpdate`: dynamic loss scaling.
    LossScaleAttrs {
    backoff_factor: f32 [default = 0.5f32],
    growth_factor: f32 [default = 2.0f32],
    growth_interval: i64 [default = 2000],
    max_scale: f32 [default = 16777216.0f32],
    min_scale: f32 [default = 1.0f32],
});
attr_struct!(
    /// `ai.mpc::LrSchedule`: the learning rate of an update as a function of the number of updates
    /// applied before it (docs/ai-mpc-ops.md gives each curve).
    LrScheduleAttrs {
    gamma: f32 [default = 0.1f32],
    kind: LrKind [default = LrKind::Constant],
    min_ratio: f32 [default = 0.0f32],
    start_ratio: f32 [default = 0.04f32],
    step_size: i64 [default = 1],
    total: i64 [default = 0],
    warmup: i64 [default = 0],
});
attr_struct!(
    /// `ai.mpc::Attention` and `ai.mpc::AttentionGrad`: the scores are `scale · Q·Kᵀ (+ mask)`.
    AttentionAttrs {
    layout: AttentionLayout [default = AttentionLayout::Bhsd],
    scale: f32 [default = 1.0f32],
});
attr_struct!(
    /// `ai.mpc::SeededDropout`: `seed` tells the node's random stream from the others'.
    SeedAttrs { seed: i64 [default = 0] });
attr_struct!(ResizeAttrs {
    antialias: bool[default = false],
    axes: Vec<i64> [default = Vec::new()],
    coordinate_transformation_mode: CoordinateMode [default = CoordinateMode::HalfPixel],
    cubic_coeff_a: f32 [default = -0.75f32],
    exclude_outside: bool[default = false],
    extrapolation_value: f32 [default = 0.0f32],
    keep_aspect_ratio_policy: AspectPolicy [default = AspectPolicy::Stretch],
    mode: ResizeMode [default = ResizeMode::Nearest],
    nearest_mode: NearestMode [default = NearestMode::RoundPreferFloor],
});

/// An op mpc does not understand, kept so that import → export never loses a node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Opaque {
    pub domain: String,
    pub op_type: String,
    pub attrs: Attrs,
    /// Inputs past this count are outer-scope values that the op's subgraph attributes read
    /// (If/Loop/Scan bodies): kept as inputs so that ordering and dead-code elimination see them,
    /// not written as inputs on export.
    pub explicit_inputs: usize,
}

macro_rules! define_ops {
    (plain { $($p:ident),* $(,)? } typed { $($t:ident($a:ty)),* $(,)? } boxed { $($b:ident($ba:ty)),* $(,)? }
     mpc_plain { $($mp:ident),* $(,)? } mpc { $($m:ident($ma:ty)),* $(,)? }) => {
        /// An operation: one variant per supported op, plus [`Op::Opaque`]. Variants with large
        /// attribute structs box them, keeping an op (and so a node) small.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        pub enum Op {
            $($p,)*
            $($t($a),)*
            $($b(Box<$ba>),)*
            $($mp,)*
            $($m(Box<$ma>),)*
            Opaque(Box<Opaque>),
        }

        impl Op {
            /// The ONNX `op_type`.
            pub fn op_type(&self) -> &str {
                match self {
                    $(Op::$p => stringify!($p),)*
                    $(Op::$t(_) => stringify!($t),)*
                    $(Op::$b(_) => stringify!($b),)*
                    $(Op::$mp => stringify!($mp),)*
                    $(Op::$m(_) => stringify!($m),)*
                    Op::Opaque(o) => &o.op_type,
                }
            }

            /// The op's domain: empty for the standard ONNX domain.
            pub fn domain(&self) -> &str {
                match self {
                    Op::Opaque(o) => &o.domain,
                    $(Op::$mp => MPC_DOMAIN,)*
                    $(Op::$m(_) => MPC_DOMAIN,)*
                    _ => "",
                }
            }

            /// Builds a standard-domain op in its internal form from its attributes, or `None`
            /// when `op_type` is not in the closed set.
            pub fn from_attrs(op_type: &str, attrs: Attrs) -> Option<Result<Op, String>> {
                Some(match op_type {
                    $(stringify!($p) => crate::attr::no_more_attrs(&attrs).map(|()| Op::$p),)*
                    $(stringify!($t) => <$a>::from_attrs(attrs).map(Op::$t),)*
                    $(stringify!($b) => <$ba>::from_attrs(attrs).map(|a| Op::$b(Box::new(a))),)*
                    _ => return None,
                })
            }

            /// Builds an `ai.mpc` op (training graphs) from its attributes, or `None` when
            /// `op_type` is not one.
            pub fn from_mpc_attrs(op_type: &str, attrs: Attrs) -> Option<Result<Op, String>> {
                Some(match op_type {
                    $(stringify!($mp) => crate::attr::no_more_attrs(&attrs).map(|()| Op::$mp),)*
                    $(stringify!($m) => <$ma>::from_attrs(attrs).map(|a| Op::$m(Box::new(a))),)*
                    _ => return None,
                })
            }

            /// The attributes that differ from their defaults (for an opaque op: all of them).
            pub fn attrs(&self) -> Attrs {
                match self {
                    $(Op::$p => Vec::new(),)*
                    $(Op::$t(a) => a.to_attrs(),)*
                    $(Op::$b(a) => a.to_attrs(),)*
                    $(Op::$mp => Vec::new(),)*
                    $(Op::$m(a) => a.to_attrs(),)*
                    Op::Opaque(o) => o.attrs.clone(),
                }
            }

            /// The op named `op_type` with default attributes (required ones at placeholder values),
            /// for tables and tests that need one instance of every op.
            pub fn default_of(op_type: &str) -> Option<Op> {
                Some(match op_type {
                    $(stringify!($p) => Op::$p,)*
                    $(stringify!($t) => Op::$t(<$a>::default()),)*
                    $(stringify!($b) => Op::$b(Box::default()),)*
                    _ => return None,
                })
            }

            /// Every op type of the closed set, for docs and tests.
            pub const KNOWN: &'static [&'static str] = &[$(stringify!($p),)* $(stringify!($t),)* $(stringify!($b),)*];

            /// Every op of the `ai.mpc` domain (gradient and optimizer ops of training graphs).
            pub const MPC_KNOWN: &'static [&'static str] = &[$(stringify!($mp),)* $(stringify!($m),)*];
        }
    };
}

define_ops! {
    plain {
        Add, Sub, Mul, Div, Pow, Sqrt, Exp, Log, Neg, Abs, Reciprocal, Erf, Tanh, Sigmoid, Relu,
        PRelu, HardSwish, Softplus, Mish, Clip, Max, Min, Sum, Mean, MatMul, GlobalAveragePool,
        GlobalMaxPool, Squeeze, Unsqueeze, Slice, Expand, Tile, Identity, Size, Range, Where, Equal,
        Less, Greater, Not, And, Or, Floor, Ceil, Round, Sign, Sin, Cos, Softsign, IsNaN,
        GreaterOrEqual, LessOrEqual, Xor, Tan, Sinh, Cosh, Asin, Acos, Atan, Asinh, Acosh, Atanh,
        BitwiseAnd, BitwiseOr, BitwiseXor, BitwiseNot,
    }
    typed {
        Mod(ModAttrs), LeakyRelu(AlphaAttrs), Elu(EluAttrs), Celu(EluAttrs), Gelu(GeluAttrs),
        HardSigmoid(HardSigmoidAttrs), Gemm(GemmAttrs), BatchNormalization(BatchNormAttrs),
        LayerNormalization(LayerNormAttrs), InstanceNormalization(EpsilonAttrs),
        GroupNormalization(GroupNormAttrs), LRN(LrnAttrs), Softmax(SoftmaxAttrs),
        LogSoftmax(SoftmaxAttrs), ReduceSum(ReduceAttrs), ReduceMean(ReduceAttrs),
        ReduceMax(ReduceAttrs), ReduceMin(ReduceAttrs), ReduceSumSquare(ReduceAttrs),
        ReduceL2(ReduceAttrs), ReduceLogSumExp(ReduceAttrs), ReduceLogSum(ReduceAttrs), CumSum(CumSumAttrs), ArgMax(ArgAttrs),
        Reshape(ReshapeAttrs), Transpose(TransposeAttrs), Flatten(FlattenAttrs), Concat(ConcatAttrs),
        Split(SplitAttrs), Gather(AxisAttrs), GatherElements(AxisAttrs), Pad(PadAttrs),
        Dropout(DropoutAttrs), Cast(CastAttrs), Shape(ShapeAttrs), Einsum(EinsumAttrs),
        SoftmaxCrossEntropyLoss(LossAttrs), NegativeLogLikelihoodLoss(LossAttrs),
        Selu(SeluAttrs), IsInf(IsInfAttrs), ArgMin(ArgAttrs), ReduceL1(ReduceAttrs),
        ReduceProd(ReduceAttrs), Trilu(TriluAttrs), GatherND(GatherNdAttrs), ScatterND(ScatterNdAttrs),
        ScatterElements(ScatterElementsAttrs), TopK(TopKAttrs), BitShift(BitShiftAttrs), CumProd(CumSumAttrs),
        RoiAlign(RoiAlignAttrs),
    }
    boxed {
        Conv(ConvAttrs), ConvTranspose(ConvAttrs), MaxPool(PoolAttrs), AveragePool(PoolAttrs),
        Resize(ResizeAttrs), Constant(ConstantAttrs), ConstantOfShape(ConstantOfShapeAttrs),
    }
    // The `ai.mpc` domain: what training graphs need beyond the standard set. Each op's meaning as
    // a decomposition into standard ops is written in docs/ai-mpc-ops.md.
    mpc_plain { AllFinite, ReluGrad }
    mpc {
        ConvGrad(ConvAttrs), MaxPoolGrad(PoolAttrs), AveragePoolGrad(PoolAttrs),
        BatchNormalizationGrad(EpsilonAttrs), LayerNormalizationGrad(LayerNormAttrs), GeluGrad(GeluAttrs),
        SoftmaxCrossEntropyLossGrad(LossAttrs), NegativeLogLikelihoodLossGrad(LossAttrs), GatherGrad(AxisAttrs),
        SoftmaxGrad(SoftmaxAttrs), Attention(AttentionAttrs), AttentionGrad(AttentionAttrs),
        SgdUpdate(SgdAttrs), AdamUpdate(AdamAttrs), LossScaleUpdate(LossScaleAttrs), SeededDropout(SeedAttrs),
        LrSchedule(LrScheduleAttrs), CumProdGrad(CumSumAttrs), RoiAlignGrad(RoiAlignAttrs), AllReduce(AllReduceAttrs),
        ReduceScatter(ReduceScatterAttrs), AllGather(AllGatherAttrs),
    }
}

/// The trigonometric and hyperbolic ops beyond Sin and Cos, described once: the CPU kernels
/// (`Real::trig`), the CUDA kernels (`elementwise_<name>_<dtype>`, `U_<name>` in
/// kernels/common.cuh), colouring (FP32: their accuracy, and Sinh/Cosh overflow FP16 at 11.8)
/// and the gradient rule read this, not lists of their own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trig {
    Tan,
    Sinh,
    Cosh,
    Asin,
    Acos,
    Atan,
    Asinh,
    Acosh,
    Atanh,
}

impl Trig {
    pub const ALL: [Trig; 9] =
        [Trig::Tan, Trig::Sinh, Trig::Cosh, Trig::Asin, Trig::Acos, Trig::Atan, Trig::Asinh, Trig::Acosh, Trig::Atanh];

    /// The CUDA kernel's name (and the functor's, `U_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Trig::Tan => "tan",
            Trig::Sinh => "sinh",
            Trig::Cosh => "cosh",
            Trig::Asin => "asin",
            Trig::Acos => "acos",
            Trig::Atan => "atan",
            Trig::Asinh => "asinh",
            Trig::Acosh => "acosh",
            Trig::Atanh => "atanh",
        }
    }
}

/// The ops of [`Bitwise`] as a pattern, for the exhaustive matches that must name them.
#[macro_export]
macro_rules! bitwise_ops {
    () => {
        $crate::Op::BitwiseAnd
            | $crate::Op::BitwiseOr
            | $crate::Op::BitwiseXor
            | $crate::Op::BitwiseNot
            | $crate::Op::BitShift(_)
    };
}

/// The ops of [`Trig`] as a pattern, for the exhaustive matches that must name them:
/// `mpc_ir::trig_ops!() => ...`.
#[macro_export]
macro_rules! trig_ops {
    () => {
        $crate::Op::Tan
            | $crate::Op::Sinh
            | $crate::Op::Cosh
            | $crate::Op::Asin
            | $crate::Op::Acos
            | $crate::Op::Atan
            | $crate::Op::Asinh
            | $crate::Op::Acosh
            | $crate::Op::Atanh
    };
}

/// The integer bit operations (BitwiseAnd/Or/Xor/Not, BitShift), described once: the reference
/// formula ([`Bitwise::eval`], which the CPU kernels and constant folding compute by), the CUDA
/// kernel's name (`elementwise_<name>_<dtype>`, kernels/elementwise.cu), and the dtypes each
/// accepts. None is differentiable; colouring leaves them as they are (integers only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bitwise {
    And,
    Or,
    Xor,
    Not,
    ShiftLeft,
    ShiftRight,
}

impl Bitwise {
    pub const ALL: [Bitwise; 6] =
        [Bitwise::And, Bitwise::Or, Bitwise::Xor, Bitwise::Not, Bitwise::ShiftLeft, Bitwise::ShiftRight];

    /// The CUDA kernel's name.
    pub fn name(self) -> &'static str {
        match self {
            Bitwise::And => "bitand",
            Bitwise::Or => "bitor",
            Bitwise::Xor => "bitxor",
            Bitwise::Not => "bitnot",
            Bitwise::ShiftLeft => "shl",
            Bitwise::ShiftRight => "shr",
        }
    }

    /// Whether it takes one operand (BitwiseNot) rather than two.
    pub fn unary(self) -> bool {
        self == Bitwise::Not
    }

    /// Whether `d` is a dtype of its operands: every integer dtype (BitShift's signed ones since
    /// opset 28; the schema check holds the opset's list).
    pub fn accepts(self, d: DType) -> bool {
        d.is_int()
    }

    /// The result for operands of dtype `d` read as i64 (signed dtypes sign-extended, unsigned
    /// ones zero-extended, u64's bits reinterpreted); the caller truncates it to `d`. Right shifts
    /// are arithmetic on signed dtypes and logical on unsigned ones; a shift by the width or
    /// more, or by a negative amount, leaves only the sign's fill (-1 for a negative operand
    /// shifted right, else 0), as the spec (opset 28), onnxruntime and the reference evaluator do.
    pub fn eval(self, d: DType, a: i64, b: i64) -> i64 {
        let (signed, fits) = (d.is_signed_int(), (b as u64) < 64);
        match self {
            Bitwise::And => a & b,
            Bitwise::Or => a | b,
            Bitwise::Xor => a ^ b,
            Bitwise::Not => !a,
            Bitwise::ShiftLeft if fits => ((a as u64) << b) as i64,
            Bitwise::ShiftRight if fits && signed => a >> b,
            Bitwise::ShiftRight if fits => ((a as u64) >> b) as i64,
            Bitwise::ShiftRight if signed && a < 0 => -1,
            Bitwise::ShiftLeft | Bitwise::ShiftRight => 0,
        }
    }
}

impl Op {
    /// The op as a [`Bitwise`], if it is one.
    pub fn bitwise(&self) -> Option<Bitwise> {
        Some(match self {
            Op::BitwiseAnd => Bitwise::And,
            Op::BitwiseOr => Bitwise::Or,
            Op::BitwiseXor => Bitwise::Xor,
            Op::BitwiseNot => Bitwise::Not,
            Op::BitShift(a) if a.direction == ShiftDirection::Left => Bitwise::ShiftLeft,
            Op::BitShift(_) => Bitwise::ShiftRight,
            _ => return None,
        })
    }

    /// The op as a [`Trig`], if it is one.
    pub fn trig(&self) -> Option<Trig> {
        Some(match self {
            Op::Tan => Trig::Tan,
            Op::Sinh => Trig::Sinh,
            Op::Cosh => Trig::Cosh,
            Op::Asin => Trig::Asin,
            Op::Acos => Trig::Acos,
            Op::Atan => Trig::Atan,
            Op::Asinh => Trig::Asinh,
            Op::Acosh => Trig::Acosh,
            Op::Atanh => Trig::Atanh,
            _ => return None,
        })
    }
}

pub use crate::binary::{Arith, Compare};
pub use crate::unary::{IntegerUnary, Rounding, Unary};

/// The ops of [`Op::reduction`] as a pattern, for the exhaustive matches that must name them.
#[macro_export]
macro_rules! reduce_ops {
    () => {
        $crate::Op::ReduceSum(_)
            | $crate::Op::ReduceMean(_)
            | $crate::Op::ReduceMax(_)
            | $crate::Op::ReduceMin(_)
            | $crate::Op::ReduceProd(_)
            | $crate::Op::ReduceL1(_)
            | $crate::Op::ReduceL2(_)
            | $crate::Op::ReduceSumSquare(_)
            | $crate::Op::ReduceLogSumExp(_)
            | $crate::Op::ReduceLogSum(_)
    };
}

/// The domain of mpc's own ops.
pub const MPC_DOMAIN: &str = "ai.mpc";

/// A reduction's formula: its identity, how it folds a value in, and what it makes of the fold.
/// Every Reduce op is one ([`Op::reduction`]): the CPU reference and the kernels' interpreter
/// compute by these formulas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
    Min,
    Prod,
    L1,
    L2,
    SumSquare,
    LogSumExp,
    LogSum,
}

impl ReduceKind {
    /// The CUDA kernels' name of the reduction (`reduce_<name>_rows_<dtype>`, kernels/reduce.cu).
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Mean => "mean",
            ReduceKind::Max => "max",
            ReduceKind::Min => "min",
            ReduceKind::Prod => "prod",
            ReduceKind::L1 => "l1",
            ReduceKind::L2 => "l2",
            ReduceKind::SumSquare => "sum_square",
            ReduceKind::LogSumExp => "log_sum_exp",
            ReduceKind::LogSum => "log_sum",
        }
    }

    /// The fold's start.
    pub fn init(self) -> f64 {
        match self {
            ReduceKind::Max => f64::NEG_INFINITY,
            ReduceKind::Min => f64::INFINITY,
            ReduceKind::Prod => 1.0,
            ReduceKind::Sum | ReduceKind::Mean | ReduceKind::L1 | ReduceKind::L2 | ReduceKind::SumSquare => 0.0,
            ReduceKind::LogSumExp | ReduceKind::LogSum => 0.0,
        }
    }

    /// `acc` with `a` folded in; `shift` is the log-sum-exp's maximum (0 for the others).
    pub fn step(self, acc: f64, a: f64, shift: f64) -> f64 {
        match self {
            ReduceKind::Max => {
                if a.is_nan() || a > acc {
                    a
                } else {
                    acc
                }
            }
            ReduceKind::Min => {
                if a.is_nan() || a < acc {
                    a
                } else {
                    acc
                }
            }
            ReduceKind::Sum | ReduceKind::Mean | ReduceKind::LogSum => acc + a,
            ReduceKind::SumSquare | ReduceKind::L2 => acc + a * a,
            ReduceKind::L1 => acc + a.abs(),
            ReduceKind::Prod => acc * a,
            ReduceKind::LogSumExp => acc + (a - shift).exp(),
        }
    }

    /// The result of a fold over `count` values.
    pub fn finish(self, acc: f64, count: usize, shift: f64) -> f64 {
        match self {
            ReduceKind::Mean => acc / count.max(1) as f64,
            ReduceKind::L2 => acc.sqrt(),
            ReduceKind::LogSumExp => acc.ln() + shift,
            ReduceKind::LogSum => acc.ln(),
            ReduceKind::Sum | ReduceKind::Max | ReduceKind::Min | ReduceKind::Prod | ReduceKind::L1 => acc,
            ReduceKind::SumSquare => acc,
        }
    }

    /// Whether the fast paths take it: a plain fold in any order the input's runs give.
    pub fn simple(self) -> bool {
        match self {
            ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Max | ReduceKind::Min | ReduceKind::LogSum => true,
            ReduceKind::Prod | ReduceKind::L1 | ReduceKind::L2 | ReduceKind::SumSquare | ReduceKind::LogSumExp => false,
        }
    }

    /// Whether it is more than the identity over no axes (`noop_with_empty_axes`): |x|, x², log x
    /// (its fold or its finish maps each element).
    pub fn applies_elementwise(self) -> bool {
        match self {
            ReduceKind::L1 | ReduceKind::L2 | ReduceKind::SumSquare | ReduceKind::LogSum => true,
            ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Max | ReduceKind::Min | ReduceKind::Prod => false,
            ReduceKind::LogSumExp => false,
        }
    }
}

impl Op {
    /// The reduction a Reduce op computes and its attributes; `None` for any other op.
    ///
    /// [`reduce_ops!`](crate::reduce_ops) is the same ops as a pattern.
    pub fn reduction(&self) -> Option<(ReduceKind, &ReduceAttrs)> {
        Some(match self {
            Op::ReduceSum(a) => (ReduceKind::Sum, a),
            Op::ReduceMean(a) => (ReduceKind::Mean, a),
            Op::ReduceMax(a) => (ReduceKind::Max, a),
            Op::ReduceMin(a) => (ReduceKind::Min, a),
            Op::ReduceProd(a) => (ReduceKind::Prod, a),
            Op::ReduceL1(a) => (ReduceKind::L1, a),
            Op::ReduceL2(a) => (ReduceKind::L2, a),
            Op::ReduceSumSquare(a) => (ReduceKind::SumSquare, a),
            Op::ReduceLogSumExp(a) => (ReduceKind::LogSumExp, a),
            Op::ReduceLogSum(a) => (ReduceKind::LogSum, a),
            _ => return None,
        })
    }

    pub fn is_opaque(&self) -> bool {
        matches!(self, Op::Opaque(_))
    }

    /// An op of the `ai.mpc` domain.
    pub fn is_mpc(&self) -> bool {
        self.domain() == MPC_DOMAIN
    }

    /// Builds a known op of `domain` (standard or `ai.mpc`), or `None`.
    pub fn from_domain_attrs(domain: &str, op_type: &str, attrs: Attrs) -> Option<Result<Op, String>> {
        match domain {
            "" | "ai.onnx" => Op::from_attrs(op_type, attrs),
            MPC_DOMAIN => Op::from_mpc_attrs(op_type, attrs),
            _ => None,
        }
    }

    /// The lowest ai.onnx opset in which this op's internal form (inputs and attributes) exists;
    /// export raises the model's opset to at least this.
    pub fn min_opset(&self) -> i64 {
        match self {
            Op::Gelu(_) => 20,
            Op::Mish => 18,
            Op::GroupNormalization(_) => 21,
            Op::Reshape(a) if a.allowzero => 14,
            Op::Split(a) if a.num_outputs.is_some() => 18,
            Op::LayerNormalization(_) => 17,
            Op::BatchNormalization(a) if a.training_mode => 14,
            Op::Shape(a) if a.start != 0 || a.end.is_some() => 15,
            Op::Cast(a) if !a.saturate => 19,
            Op::Resize(a)
                if a.antialias || !a.axes.is_empty() || a.keep_aspect_ratio_policy != AspectPolicy::Stretch =>
            {
                18
            }
            Op::Pad(a) if a.mode == PadMode::Wrap => 19,
            Op::AveragePool(a) if !a.dilations.is_empty() => 19,
            // `reduction` came in opset 16 (add, mul) and 18 (max, min).
            Op::ScatterND(ScatterNdAttrs { reduction: r })
            | Op::ScatterElements(ScatterElementsAttrs { reduction: r, .. }) => match r {
                ScatterReduction::None => 13,
                ScatterReduction::Add | ScatterReduction::Mul => 16,
                ScatterReduction::Max | ScatterReduction::Min => 18,
            },
            _ => 13,
        }
    }

    /// A reduction whose `axes` moved from attribute to input in opset 18 (ReduceSum moved in 13).
    pub fn axes_input_since(&self) -> Option<i64> {
        match self {
            Op::ReduceSum(_) => Some(13),
            op if op.reduction().is_some() => Some(18),
            _ => None,
        }
    }

    /// The attribute value named `name`, if set to a non-default value.
    pub fn attr(&self, name: &str) -> Option<Attr> {
        self.attrs().into_iter().find(|(n, _)| n == name).map(|(_, a)| a)
    }
}

impl Op {
    /// The checks an op's attributes allow without shapes: windows and counts at least 1, pads
    /// not negative, a perm with distinct non-negative entries, an einsum equation with one term
    /// per input. Shape-dependent checks (axes in range, group dividing channels) are type
    /// inference's. Readers call this for every node they build.
    pub fn validate(&self, n_inputs: usize) -> Result<(), String> {
        let at_least_1 = |what: &str, v: &[i64]| match v.iter().find(|&&x| x < 1) {
            Some(x) => Err(format!("{what} {v:?} has {x}; each must be at least 1")),
            None => Ok(()),
        };
        let not_negative = |what: &str, v: &[i64]| match v.iter().find(|&&x| x < 0) {
            Some(x) => Err(format!("{what} {v:?} has {x}; each must be 0 or more")),
            None => Ok(()),
        };
        let positive = |what: &str, v: i64| match v {
            ..1 => Err(format!("{what} is {v}; it must be at least 1")),
            _ => Ok(()),
        };
        match self {
            Op::Conv(a) | Op::ConvTranspose(a) | Op::ConvGrad(a) => {
                at_least_1("strides", &a.strides)?;
                at_least_1("dilations", &a.dilations)?;
                at_least_1("kernel_shape", &a.kernel_shape)?;
                positive("group", a.group)?;
                not_negative("pads", &a.pads)?;
                not_negative("output_padding", &a.output_padding)?;
                not_negative("output_shape", &a.output_shape)?;
            }
            Op::MaxPool(a) | Op::AveragePool(a) | Op::MaxPoolGrad(a) | Op::AveragePoolGrad(a) => {
                at_least_1("strides", &a.strides)?;
                at_least_1("dilations", &a.dilations)?;
                at_least_1("kernel_shape", &a.kernel_shape)?;
                not_negative("pads", &a.pads)?;
            }
            Op::LRN(a) => positive("size", a.size)?,
            Op::GroupNormalization(a) => positive("num_groups", a.num_groups)?,
            Op::Split(a) => a.num_outputs.map_or(Ok(()), |n| positive("num_outputs", n))?,
            Op::GatherND(a) if a.batch_dims < 0 => {
                return Err(format!("batch_dims is {}; it must be 0 or more", a.batch_dims))
            }
            Op::Transpose(TransposeAttrs { perm: Some(perm) }) => {
                not_negative("perm", perm)?;
                if (1..perm.len()).any(|i| perm[..i].contains(&perm[i])) {
                    return Err(format!("perm {perm:?} repeats an axis"));
                }
            }
            Op::Einsum(a) => {
                let lhs = a.equation.split("->").next().unwrap_or("");
                let terms = lhs.split(',').count();
                if terms != n_inputs {
                    return Err(format!(
                        "equation `{}` has {terms} operands but the node {n_inputs} inputs",
                        a.equation
                    ));
                }
                // Each operand's term and the output are letters and at most one ellipsis: a
                // lone `.` (or `-`, `>` outside the arrow) would be a label no kernel sizes.
                let eq: String = a.equation.chars().filter(|c| !c.is_whitespace()).collect();
                let (lhs, rhs) = match eq.split_once("->") {
                    Some((l, r)) => (l, Some(r)),
                    None => (eq.as_str(), None),
                };
                for part in lhs.split(',').chain(rhs) {
                    if let Some(c) = part.replacen("...", "", 1).chars().find(|c| !c.is_ascii_alphabetic()) {
                        return Err(format!("equation `{}` has `{c}`, which is not a label", a.equation));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

impl ConvAttrs {
    /// The window of this Conv or ConvTranspose over `kernel` (the weight's spatial dims when the
    /// attribute does not give them).
    pub fn window<'a>(&'a self, kernel: &'a [i64]) -> crate::geometry::WindowSpec<'a> {
        crate::geometry::WindowSpec {
            kernel,
            strides: &self.strides,
            dilations: &self.dilations,
            pads: &self.pads,
            auto_pad: self.auto_pad,
            ceil_mode: false,
            pool: false,
        }
    }
}

impl PoolAttrs {
    /// The pooling window.
    pub fn window(&self) -> crate::geometry::WindowSpec<'_> {
        crate::geometry::WindowSpec {
            kernel: &self.kernel_shape,
            strides: &self.strides,
            dilations: &self.dilations,
            pads: &self.pads,
            auto_pad: self.auto_pad,
            ceil_mode: self.ceil_mode,
            pool: true,
        }
    }
}

#[cfg(test)]
mod tests {

    /// `reduce_ops!()` is exactly the ops `Op::reduction` knows.
    #[test]
    fn the_reduction_pattern_is_the_family() {
        for name in [
            "ReduceSum",
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceSumSquare",
            "ReduceLogSumExp",
            "ReduceLogSum",
        ] {
            let op = Op::default_of(name).unwrap();
            assert!(op.reduction().is_some() && matches!(op, crate::reduce_ops!()), "{name}");
        }
        for name in ["ArgMax", "CumSum", "Softmax", "Sum", "GlobalAveragePool"] {
            let Some(op) = Op::default_of(name) else { continue };
            assert!(op.reduction().is_none() && !matches!(op, crate::reduce_ops!()), "{name}");
        }
    }

    use super::*;

    #[test]
    fn typed_attrs_round_trip_and_reject_unknown() {
        let attrs = vec![("group".to_string(), Attr::Int(2)), ("strides".into(), Attr::Ints(vec![2, 2]))];
        let op = Op::from_attrs("Conv", attrs.clone()).unwrap().unwrap();
        assert_eq!(op.attrs(), attrs);
        let err = Op::from_attrs("Conv", vec![("bogus".into(), Attr::Int(1))]).unwrap().unwrap_err();
        assert!(err.contains("bogus"), "{err}");
        let err = Op::from_attrs("Cast", vec![]).unwrap().unwrap_err();
        assert!(err.contains("`to` is required"), "{err}");
        let err = Op::from_attrs("Gemm", vec![("alpha".into(), Attr::Int(1))]).unwrap().unwrap_err();
        assert!(err.contains("`alpha` is 1 where float was expected"), "{err}");
        assert!(Op::from_attrs("NoSuchOp", vec![]).is_none());
    }

    #[test]
    fn an_einsum_ellipsis_is_written_out_as_numpy_broadcasts_it() {
        let d = |v: &[u64]| v.iter().map(|&n| Some(n)).collect::<Vec<_>>();
        // Batched matmul: the ellipsis of both operands and the output is the same two dims.
        let eq = einsum_expand("...ij,...jk->...ik", &[d(&[2, 3, 4, 5]), d(&[2, 3, 5, 6])]).unwrap();
        assert_eq!(eq, "abij,abjk->abik");
        // Right-aligned: the second operand's ellipsis is the first's last dim; no `->`: the
        // ellipsis dims lead, then the labels seen once in alphabetical order.
        assert_eq!(einsum_expand("...ij,...j", &[d(&[6, 7, 2, 3]), d(&[7, 3])]).unwrap(), "abij,bj->abi");
        // A dim of 1 against a larger one is its own label, summed over.
        let eq = einsum_expand("...i,...i->...i", &[d(&[1, 4, 3]), d(&[5, 4, 3])]).unwrap();
        assert_eq!(eq, "cbi,abi->abi");
        // An ellipsis of no dims, an unknown size kept shared, and summation of the ellipsis.
        assert_eq!(einsum_expand("i...,i->i", &[d(&[3]), d(&[3])]).unwrap(), "i,i->i");
        assert_eq!(einsum_expand("...k->k", &[vec![None, Some(2)]]).unwrap(), "ak->k");
        assert!(einsum_expand("...ijk", &[d(&[2, 3])]).unwrap_err().contains("3 labels but rank 2"));
        assert_eq!(einsum_expand("ij->ji", &[d(&[2, 3])]).unwrap(), "ij->ji");
    }

    #[test]
    fn defaults_are_not_printed() {
        let op = Op::from_attrs("Gemm", vec![("transB".into(), Attr::Int(1)), ("alpha".into(), Attr::Float(1.0))]);
        assert_eq!(op.unwrap().unwrap().attrs(), vec![("transB".to_string(), Attr::Int(1))]);
    }
}
