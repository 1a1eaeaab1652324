//! The classification of every op: [`Op::kind`] puts each into one family, and the facts the
//! passes and devices need about an op (its default precision, the inputs gradients flow into,
//! whether it may write over its input, whether a fused chain may hold it, which operands are
//! read on the host) are answered here from its family, in one place. A new op does not compile
//! until [`Op::kind`] places it; the families' own tables ([`Unary`], [`Arith`], [`Compare`],
//! [`ReduceKind`]) say the rest.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ops::{Arith, Compare, ReduceKind, Rounding, ScatterReduction, Unary};
use crate::{DType, Op};

/// The family of an op ([`Op::kind`]). The backward ops of `ai.mpc` are in their forward op's
/// family (ConvGrad with Conv, SoftmaxGrad with Softmax), so a device that dispatches by family
/// plans each pair in one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// Element-wise of one float operand.
    Unary(Unary),
    /// Element-wise arithmetic of two broadcast operands.
    Arith(Arith),
    /// Comparisons and logic: a bool result.
    Compare(Compare),
    /// Not, IsNaN, IsInf: a bool result of one operand.
    Predicate,
    /// The bit operations on integers.
    Bitwise,
    /// Sum, Mean, Max, Min: any number of broadcast operands.
    Variadic,
    /// Clip and Where: each element one of the operands' (or a bound).
    Select,
    /// ReluGrad and GeluGrad: `dy` times the activation's derivative at `x`.
    ActivationGrad,
    /// The Reduce ops.
    Reduce(ReduceKind),
    /// CumSum, CumProd (and CumProd's gradient).
    Scan,
    /// Softmax, LogSoftmax (and the softmax gradient): a function of each whole row.
    RowWise,
    /// The normalisations (and their gradients).
    Norm,
    /// The pools (and the windowed pools' gradients).
    Pool,
    /// Conv, ConvTranspose (and Conv's gradient).
    Conv,
    /// MatMul, Gemm, Einsum.
    MatMul,
    /// The same bytes in the same order, read as another shape: Reshape, Flatten, Squeeze,
    /// Unsqueeze, Identity.
    View,
    /// Data movement that reorders, repeats, pads or resamples elements.
    Movement,
    /// Gathers, scatters, top-k, arg-max/min and RoiAlign (and their gradients).
    Index,
    /// Shapes, sizes, ranges and constants.
    Shape,
    Cast,
    /// Dropout, by ONNX's ratio or by mpc's seeded mask.
    Random,
    /// The training losses (and their gradients).
    Loss,
    /// mpc's attention (and its gradient).
    Attention,
    /// The optimizer's ops: the finite check, the updates, the loss scale, the schedule.
    Train,
    /// The collectives of data-parallel training.
    Collective,
    /// An op mpc does not model.
    Opaque,
}

impl Op {
    /// The op's family. Exhaustive: a new op is placed here before anything else can read it.
    pub fn kind(&self) -> Kind {
        if let Some((u, _)) = self.unary() {
            return Kind::Unary(u);
        }
        if let Some(a) = self.arith() {
            return Kind::Arith(a);
        }
        if let Some(c) = self.compare() {
            return Kind::Compare(c);
        }
        if let Some((r, _)) = self.reduction() {
            return Kind::Reduce(r);
        }
        match self {
            crate::unary_ops!() | crate::arith_ops!() | crate::compare_ops!() | crate::reduce_ops!() => {
                unreachable!("a family member")
            }
            Op::Not | Op::IsNaN | Op::IsInf(_) => Kind::Predicate,
            crate::bitwise_ops!() => Kind::Bitwise,
            Op::Sum | Op::Mean | Op::Max | Op::Min => Kind::Variadic,
            Op::Clip | Op::Where => Kind::Select,
            Op::ReluGrad | Op::GeluGrad(_) => Kind::ActivationGrad,
            Op::CumSum(_) | Op::CumProd(_) | Op::CumProdGrad(_) => Kind::Scan,
            Op::Softmax(_) | Op::LogSoftmax(_) | Op::SoftmaxGrad(_) => Kind::RowWise,
            Op::BatchNormalization(_)
            | Op::BatchNormalizationGrad(_)
            | Op::LayerNormalization(_)
            | Op::LayerNormalizationGrad(_)
            | Op::InstanceNormalization(_)
            | Op::GroupNormalization(_)
            | Op::LRN(_) => Kind::Norm,
            Op::MaxPool(_)
            | Op::AveragePool(_)
            | Op::MaxPoolGrad(_)
            | Op::AveragePoolGrad(_)
            | Op::GlobalAveragePool
            | Op::GlobalMaxPool => Kind::Pool,
            Op::Conv(_) | Op::ConvTranspose(_) | Op::ConvGrad(_) => Kind::Conv,
            Op::MatMul | Op::Gemm(_) | Op::Einsum(_) => Kind::MatMul,
            Op::Reshape(_) | Op::Flatten(_) | Op::Squeeze | Op::Unsqueeze | Op::Identity => Kind::View,
            Op::Transpose(_)
            | Op::Concat(_)
            | Op::Split(_)
            | Op::Slice
            | Op::Expand
            | Op::Tile
            | Op::Pad(_)
            | Op::Trilu(_)
            | Op::Resize(_) => Kind::Movement,
            Op::Gather(_)
            | Op::GatherGrad(_)
            | Op::GatherElements(_)
            | Op::GatherND(_)
            | Op::ScatterND(_)
            | Op::ScatterElements(_)
            | Op::TopK(_)
            | Op::ArgMax(_)
            | Op::ArgMin(_)
            | Op::RoiAlign(_)
            | Op::RoiAlignGrad(_) => Kind::Index,
            Op::Shape(_) | Op::Size | Op::Range | Op::Constant(_) | Op::ConstantOfShape(_) => Kind::Shape,
            Op::Cast(_) => Kind::Cast,
            Op::Dropout(_) | Op::SeededDropout(_) => Kind::Random,
            Op::SoftmaxCrossEntropyLoss(_)
            | Op::NegativeLogLikelihoodLoss(_)
            | Op::SoftmaxCrossEntropyLossGrad(_)
            | Op::NegativeLogLikelihoodLossGrad(_) => Kind::Loss,
            Op::Attention(_) | Op::AttentionGrad(_) => Kind::Attention,
            Op::AllFinite | Op::SgdUpdate(_) | Op::AdamUpdate(_) | Op::LossScaleUpdate(_) | Op::LrSchedule(_) => {
                Kind::Train
            }
            Op::AllReduce(_) | Op::ReduceScatter(_) | Op::AllGather(_) => Kind::Collective,
            Op::Opaque(_) => Kind::Opaque,
        }
    }
}

/// What a node's float activations should be: the precision pass's default colouring.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// Run in the low dtype (matrix products): TF's allow list.
    Low,
    /// Run in FP32 (reductions, normalisations, exp/log, losses): TF's deny list.
    F32,
    /// Take the precision of the neighbours, F32 unless between low ops: TF's infer list.
    Follow,
    /// Data movement; follows low neighbours both ways: TF's clear list.
    Clear,
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Class::Low => "low",
            Class::F32 => "f32",
            Class::Follow => "follow",
            Class::Clear => "clear",
        })
    }
}

impl Op {
    /// The default class of the op for the low dtype `low`, or `None` for ops that are never
    /// recoloured (opaque ops, casts, constants, shape and integer ops, and mpc's own).
    pub fn default_class(&self, low: DType) -> Option<Class> {
        use Class::*;
        // BF16 keeps FP32's exponent range, so sums and means cannot overflow in it.
        let sums = if low == DType::BF16 { Follow } else { F32 };
        if self.is_mpc() {
            return None;
        }
        Some(match self.kind() {
            Kind::MatMul | Kind::Conv => Low,
            Kind::Unary(u) => match u.rounding() {
                Rounding::Exact => Clear,
                Rounding::Wide => F32,
                Rounding::Follows => Follow,
            },
            Kind::Arith(Arith::Pow) => F32,
            Kind::Arith(Arith::Mod { .. }) => return None,
            Kind::Arith(_) => Follow,
            Kind::Compare(Compare::And | Compare::Or | Compare::Xor) => return None,
            Kind::Compare(_) => Clear,
            Kind::Predicate if matches!(self, Op::Not) => return None,
            Kind::Predicate => Clear,
            Kind::Variadic if matches!(self, Op::Max | Op::Min) => Clear,
            Kind::Variadic => Follow,
            Kind::Select | Kind::View | Kind::Random => Clear,
            Kind::Reduce(ReduceKind::Sum | ReduceKind::Mean) => sums,
            Kind::Reduce(ReduceKind::Max | ReduceKind::Min) => Clear,
            Kind::Reduce(_) | Kind::Scan | Kind::RowWise | Kind::Loss => F32,
            Kind::Norm if matches!(self, Op::BatchNormalization(_)) => Follow,
            Kind::Norm => F32,
            Kind::Pool if matches!(self, Op::AveragePool(_) | Op::GlobalAveragePool) => Follow,
            Kind::Pool => Clear,
            Kind::Movement if matches!(self, Op::Resize(_)) => Follow,
            Kind::Movement => Clear,
            // A scatter that adds or multiplies accumulates into its targets: classed as the
            // reduction it is (ReduceSum, ReduceProd), not as data movement.
            Kind::Index => match self {
                Op::RoiAlign(_) => F32,
                Op::ScatterND(a) if a.reduction == ScatterReduction::Add => sums,
                Op::ScatterElements(a) if a.reduction == ScatterReduction::Add => sums,
                Op::ScatterND(a) if a.reduction == ScatterReduction::Mul => F32,
                Op::ScatterElements(a) if a.reduction == ScatterReduction::Mul => F32,
                _ => Clear,
            },
            Kind::Bitwise | Kind::Shape | Kind::Cast | Kind::Opaque => return None,
            Kind::ActivationGrad | Kind::Attention | Kind::Train | Kind::Collective => return None,
        })
    }

    /// Whether gradients flow into input `slot` (the others are indices, shapes, masks or
    /// statistics).
    pub fn differentiable(&self, slot: usize) -> bool {
        match self.kind() {
            // On the path, so that a parameter behind an op mpc cannot differentiate is an error
            // (Attention's mask too: its rule refuses a mask that needs a gradient).
            Kind::Opaque => true,
            Kind::Attention => matches!(self, Op::Attention(_)),
            // Piecewise constant: the gradient is zero wherever it exists (PyTorch's convention
            // too), so their input is not differentiated and no gradient flows through them.
            Kind::Unary(u) => !matches!(u, Unary::Floor | Unary::Ceil | Unary::Round | Unary::Sign),
            Kind::Shape => false,
            // Data and updates; never the indices.
            Kind::Index if matches!(self, Op::ScatterND(_) | Op::ScatterElements(_)) => slot == 0 || slot == 2,
            Kind::Index if matches!(self, Op::ArgMax(_) | Op::ArgMin(_)) => false,
            Kind::Select if matches!(self, Op::Where) => slot > 0,
            Kind::Movement if matches!(self, Op::Concat(_)) => true,
            Kind::Random if matches!(self, Op::SeededDropout(_)) => slot == 0,
            // mpc's other ops are the backward pass and the optimizer's: never differentiated.
            _ if self.is_mpc() => false,
            Kind::Index | Kind::Select | Kind::View | Kind::Movement | Kind::Random => slot == 0,
            Kind::Reduce(_) | Kind::Scan | Kind::Loss => slot == 0,
            // The data, the weights or scale, the bias; not batch norm's running statistics.
            Kind::Norm | Kind::Conv => slot <= 2,
            Kind::Arith(_) | Kind::Compare(_) | Kind::Predicate | Kind::Bitwise | Kind::Variadic => true,
            Kind::MatMul | Kind::RowWise | Kind::Pool | Kind::Cast => true,
            Kind::ActivationGrad | Kind::Train | Kind::Collective => false,
        }
    }

    /// Whether the output may take over the buffer of an input of the same size that dies with
    /// it: element-wise ops and their gradients (ReluGrad, GeluGrad); the views, whose output is
    /// the input's bytes in the same order; and the row-wise normalisations (Softmax,
    /// LayerNormalization, inference BatchNormalization) and row-wise gradients (SoftmaxGrad,
    /// SoftmaxCrossEntropyLossGrad over its scores), which read a whole row before writing it,
    /// each element by the thread that writes it.
    pub fn in_place(&self) -> bool {
        match self.kind() {
            Kind::Unary(_) | Kind::View | Kind::RowWise | Kind::ActivationGrad => true,
            Kind::Arith(a) => matches!(a, Arith::Add | Arith::Sub | Arith::Mul | Arith::Div),
            Kind::Select => matches!(self, Op::Clip),
            Kind::Norm => match self {
                Op::LayerNormalization(_) => true,
                Op::BatchNormalization(a) => !a.training_mode,
                _ => false,
            },
            Kind::Loss => matches!(self, Op::SoftmaxCrossEntropyLossGrad(_)),
            _ => false,
        }
    }

    /// Whether a fused element-wise chain may hold the op: the same formula on every device (the
    /// CUDA device generates chains from the functors of `kernels/common.cuh`).
    pub fn fusable(&self) -> bool {
        match self.kind() {
            Kind::Unary(u) => u.chains(),
            Kind::Arith(a) => matches!(a, Arith::Add | Arith::Sub | Arith::Mul | Arith::Div),
            Kind::Cast => true,
            Kind::Variadic => matches!(self, Op::Sum),
            Kind::ActivationGrad => matches!(self, Op::ReluGrad),
            _ => false,
        }
    }

    /// The input slots whose values decide the output's shape or are read as parameters (shapes,
    /// axes, starts/ends, repeats, pads, scales, ratios): a runtime needs their values when it
    /// lowers the graph, not on the device.
    pub fn host_operands(&self) -> &'static [usize] {
        match self {
            Op::Reshape(_) | Op::Expand | Op::Tile | Op::Squeeze | Op::Unsqueeze | Op::Split(_) | Op::CumSum(_) => &[1],
            Op::CumProd(_) => &[1],
            Op::CumProdGrad(_) => &[2],
            Op::Trilu(_) | Op::TopK(_) => &[1],
            // The axes of a reduction (an input from opset 13, 18 for most).
            op if op.reduction().is_some() => &[1],
            Op::Slice => &[1, 2, 3, 4],
            Op::Pad(_) => &[1, 3],
            Op::ConstantOfShape(_) => &[0],
            Op::Range => &[0, 1, 2],
            Op::Resize(_) => &[1, 2, 3],
            Op::Dropout(_) => &[1, 2],
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op of both domains (with its default attributes) has a family, and the families
    /// that carry a member say which.
    fn every_op() -> Vec<Op> {
        let standard = Op::KNOWN.iter().map(|n| Op::default_of(n).unwrap_or_else(|| panic!("{n}")));
        let mpc = Op::MPC_KNOWN.iter().map(|n| mpc_op(n));
        standard.chain(mpc).collect()
    }

    /// An `ai.mpc` op with its required attribute (a pool's window, a learning rate, the world
    /// size) and the rest defaulted.
    fn mpc_op(name: &str) -> Op {
        let required = [
            ("kernel_shape", crate::Attr::Ints(vec![1])),
            ("lr", crate::Attr::Float(0.1)),
            ("world", crate::Attr::Int(2)),
        ];
        let with = |attrs: Vec<(String, crate::Attr)>| Op::from_mpc_attrs(name, attrs).and_then(Result::ok);
        with(Vec::new())
            .or_else(|| required.iter().find_map(|(k, v)| with(vec![(k.to_string(), v.clone())])))
            .unwrap_or_else(|| panic!("ai.mpc::{name}"))
    }

    #[test]
    fn every_op_has_a_family() {
        let ops = every_op();
        assert!(ops.len() > 140, "{} ops", ops.len());
        for op in &ops {
            match op.kind() {
                Kind::Unary(u) => assert_eq!(op.unary().map(|(u, _)| u), Some(u)),
                Kind::Arith(a) => assert_eq!(op.arith(), Some(a)),
                Kind::Compare(c) => assert_eq!(op.compare(), Some(c)),
                Kind::Reduce(r) => assert_eq!(op.reduction().map(|(r, _)| r), Some(r)),
                _ => assert!(op.unary().is_none() && op.arith().is_none() && op.reduction().is_none(), "{op:?}"),
            }
        }
    }

    /// The facts read from the families, on the ops whose answers the passes rely on.
    #[test]
    fn the_facts_follow_the_families() {
        let of = |n: &str| Op::default_of(n).unwrap();
        let mpc = mpc_op;
        for op in every_op() {
            // mpc's own ops are never recoloured, and only attention and the seeded dropout are
            // differentiated.
            if op.is_mpc() {
                assert_eq!(op.default_class(DType::F16), None, "{op:?}");
                let through = matches!(op, Op::Attention(_) | Op::SeededDropout(_));
                assert_eq!(op.differentiable(0), through, "{op:?}");
            }
            // A chain holds only what may also write over its input, Cast and Sum apart (their
            // output may be another size).
            if op.fusable() && !matches!(op, Op::Cast(_) | Op::Sum) {
                assert!(op.in_place(), "{op:?}");
            }
            if op.kind() == Kind::View {
                assert!(op.in_place() && op.default_class(DType::F16) == Some(Class::Clear), "{op:?}");
            }
        }
        assert_eq!(of("MatMul").default_class(DType::F16), Some(Class::Low));
        assert_eq!(of("ReduceSum").default_class(DType::F16), Some(Class::F32));
        assert_eq!(of("ReduceSum").default_class(DType::BF16), Some(Class::Follow));
        assert_eq!(of("Exp").default_class(DType::F16), Some(Class::F32));
        assert_eq!(of("Relu").default_class(DType::F16), Some(Class::Clear));
        assert!(!of("Floor").differentiable(0) && of("Sqrt").differentiable(0));
        assert!(!of("Where").differentiable(0) && of("Where").differentiable(1) && of("Where").differentiable(2));
        assert!(of("Einsum").differentiable(5) && !of("BatchNormalization").differentiable(3));
        assert!(of("ScatterND").differentiable(2) && !of("ScatterND").differentiable(1));
        assert!(!of("Reshape").differentiable(1) && of("Concat").differentiable(7));
        assert!(mpc("ReluGrad").fusable() && !mpc("GeluGrad").fusable() && mpc("GeluGrad").in_place());
        assert!(!of("Pow").in_place() && !of("Pow").fusable() && of("Gelu").fusable());
    }
}
