//! The default precision lists and the role of each input slot.
//!
//! The classes follow TF grappler's auto_mixed_precision lists (allow / deny / infer / clear), named
//! after what they do here; each op's default class is part of its classification
//! ([`Op::default_class`], mpc-ir's `classify`), where a new op does not compile until it is placed.

use mpc_ir::{DType, Op};

pub use mpc_ir::Class;

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

/// The default class of `op` for the low dtype `low` ([`Op::default_class`]).
pub fn default_class(op: &Op, low: DType) -> Option<Class> {
    op.default_class(low)
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
