//! The default precision lists and the role of each input slot.
//!
//! One exhaustive `match`: a new op does not compile until it is classified. The classes follow
//! TF grappler's auto_mixed_precision lists (allow / deny / infer / clear), named after what they
//! do here.

use std::fmt;

use mpc_ir::ops::{Rounding, ScatterReduction};
use mpc_ir::{DType, Op};
use serde::{Deserialize, Serialize};

/// What a node's float activations should be.
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

/// How an input slot's float tensor relates to the node's precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The node's precision (the op's type variable `T`).
    T,
    /// Always FP32 (BatchNormalization's scale, bias and statistics).
    F32,
    /// Must keep its original dtype (opaque ops, Resize scales, Dropout ratio).
    Orig,
    /// Any dtype is fine (Shape, Size, the input of a Cast).
    Any,
}

/// The default class of `op` for the low dtype `low`, or `None` for ops that are never recoloured
/// (opaque ops, casts, constants, shape and integer ops).
pub fn default_class(op: &Op, low: DType) -> Option<Class> {
    use Class::*;
    Some(match op {
        Op::MatMul | Op::Gemm(_) | Op::Conv(_) | Op::ConvTranspose(_) | Op::Einsum(_) => Low,
        // A scatter that adds or multiplies accumulates into its targets: classed as the reduction
        // it is (ReduceSum, ReduceProd), not as data movement.
        Op::ScatterND(_) | Op::ScatterElements(_) if scatter_reduction(op) == Some(ScatterReduction::Add) => {
            if low == DType::BF16 {
                Follow
            } else {
                F32
            }
        }
        Op::ScatterND(_) | Op::ScatterElements(_) if scatter_reduction(op) == Some(ScatterReduction::Mul) => F32,
        Op::Softmax(_)
        | Op::LogSoftmax(_)
        | Op::LayerNormalization(_)
        | Op::GroupNormalization(_)
        | Op::InstanceNormalization(_)
        | Op::LRN(_)
        | Op::ReduceSumSquare(_)
        | Op::ReduceL2(_)
        | Op::ReduceLogSumExp(_)
        | Op::CumSum(_)
        | Op::CumProd(_)
        | Op::RoiAlign(_)
        | Op::ReduceL1(_)
        | Op::ReduceProd(_)
        | Op::Pow
        | Op::SoftmaxCrossEntropyLoss(_)
        | Op::NegativeLogLikelihoodLoss(_) => F32,
        // BF16 keeps FP32's exponent range, so sums and means cannot overflow in it.
        Op::ReduceSum(_) | Op::ReduceMean(_) => {
            if low == DType::BF16 {
                Follow
            } else {
                F32
            }
        }
        Op::Add
        | Op::Sub
        | Op::Mul
        | Op::Div
        | Op::PRelu
        | Op::AveragePool(_)
        | Op::GlobalAveragePool
        | Op::Sum
        | Op::Mean
        | Op::BatchNormalization(_)
        | Op::Resize(_) => Follow,
        mpc_ir::unary_ops!() => match op.unary().map(|(u, _)| u.rounding()) {
            Some(Rounding::Exact) => Clear,
            Some(Rounding::Wide) => F32,
            _ => Follow,
        },
        Op::Clip
        | Op::Max
        | Op::Min
        | Op::MaxPool(_)
        | Op::GlobalMaxPool
        | Op::ReduceMax(_)
        | Op::ReduceMin(_)
        | Op::ArgMax(_)
        | Op::Reshape(_)
        | Op::Transpose(_)
        | Op::Squeeze
        | Op::Unsqueeze
        | Op::Flatten(_)
        | Op::Concat(_)
        | Op::Split(_)
        | Op::Slice
        | Op::Gather(_)
        | Op::GatherElements(_)
        | Op::GatherND(_)
        | Op::ScatterND(_)
        | Op::ScatterElements(_)
        | Op::Pad(_)
        | Op::Tile
        | Op::Expand
        | Op::Identity
        | Op::Dropout(_)
        | Op::Where
        | Op::Equal
        | Op::Less
        | Op::Greater
        | Op::GreaterOrEqual
        | Op::LessOrEqual
        | Op::IsNaN
        | Op::IsInf(_)
        | Op::ArgMin(_)
        | Op::TopK(_)
        | Op::Trilu(_) => Clear,
        Op::Cast(_)
        | Op::Constant(_)
        | Op::ConstantOfShape(_)
        | Op::Shape(_)
        | Op::Size
        | Op::Range
        | Op::Mod(_)
        | Op::Not
        | Op::And
        | Op::Or
        | Op::Xor
        | Op::Opaque(_)
        | Op::ConvGrad(_)
        | Op::MaxPoolGrad(_)
        | Op::AveragePoolGrad(_)
        | Op::BatchNormalizationGrad(_)
        | Op::LayerNormalizationGrad(_)
        | Op::GeluGrad(_)
        | Op::SoftmaxCrossEntropyLossGrad(_)
        | Op::NegativeLogLikelihoodLossGrad(_)
        | Op::GatherGrad(_)
        | Op::SoftmaxGrad(_)
        | Op::Attention(_)
        | Op::AttentionGrad(_)
        | Op::ReluGrad
        | Op::AllFinite
        | Op::AllReduce(_)
        | Op::ReduceScatter(_)
        | Op::AllGather(_)
        | Op::SgdUpdate(_)
        | Op::AdamUpdate(_)
        | Op::LossScaleUpdate(_)
        | Op::LrSchedule(_)
        | Op::CumProdGrad(_)
        | Op::RoiAlignGrad(_)
        | Op::SeededDropout(_)
        | mpc_ir::bitwise_ops!() => return None,
    })
}

fn scatter_reduction(op: &Op) -> Option<ScatterReduction> {
    match op {
        Op::ScatterND(a) => Some(a.reduction),
        Op::ScatterElements(a) => Some(a.reduction),
        _ => None,
    }
}

/// The role of input `slot` of `op`.
pub fn input_role(op: &Op, slot: usize) -> Role {
    match (op, slot) {
        (Op::Opaque(_), _) => Role::Orig,
        (Op::Shape(_) | Op::Size | Op::Cast(_), _) => Role::Any,
        (Op::BatchNormalization(_), 1..=4) => Role::F32,
        (Op::Resize(_), 1 | 2) | (Op::Dropout(_), 1) => Role::Orig,
        (op, _) if default_class(op, DType::F16).is_none() => Role::Orig,
        _ => Role::T,
    }
}

/// Whether output `slot` of `op` carries the node's precision (else it keeps its dtype).
pub fn output_follows(op: &Op, slot: usize) -> bool {
    match (op, slot) {
        // Running statistics, and LayerNormalization's stashed mean and inverse deviation.
        (Op::BatchNormalization(_) | Op::LayerNormalization(_), 1 | 2) => false,
        (op, _) => default_class(op, DType::F16).is_some(),
    }
}
