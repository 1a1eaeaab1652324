//! Where the backward pass reads low-precision values instead of their FP32 copies: the low copy
//! a forward pass already made, and a loss gradient written straight in its scores' dtype.

use mpc_ir::{DType, Op, ValueId};

use super::build::Builder;

/// What the backward pass reads of an FP32 output `y` that the forward pass also rounds to a
/// low dtype (a softmax whose probabilities feed a low matrix product): that low copy, widened
/// where it is read. The forward then keeps only the low copy alive until the backward pass
/// (half the bytes, or less), at the cost of the rounding in what the gradient reads; the
/// forward's results are unchanged. `None` when the forward makes no low copy.
pub(super) fn saved_low_copy(b: &mut Builder, y: ValueId) -> Option<ValueId> {
    if b.g.ty(y).dtype != Some(DType::F32) {
        return None;
    }
    let low = b.g.value(y).uses().iter().find_map(|u| {
        let node = b.g.node(u.node);
        let out = *node.outputs().first()?;
        (matches!(node.op, Op::Cast(_)) && matches!(b.g.ty(out).dtype, Some(DType::F16 | DType::BF16))).then_some(out)
    })?;
    Some(b.cast(low, DType::F32))
}

/// The gradient of a loss over scores widened from a low dtype (`y = Cast(x)` to FP32, read by a
/// SoftmaxCrossEntropyLoss): instead of the loss's gradient written in FP32 and cast back to
/// `x`'s dtype, the gradient node reads `x` itself and writes `x`'s dtype. The kernels widen each
/// score as they load it and compute in FP32 as before, so only the rounding of the result moves
/// (once into the low dtype, where it was rounded to FP32 and then cast); no FP32 copy of the
/// gradient, and none of the scores, lives into the backward pass. Returns the new gradient of
/// `x`, or `None` where the pattern does not hold (then the cast's rule applies).
pub(super) fn narrow_loss_grad(b: &mut Builder, x: ValueId, y: ValueId, dy: ValueId) -> Option<ValueId> {
    let low = matches!(b.g.ty(x).dtype, Some(DType::F16 | DType::BF16));
    if !low || b.g.ty(y).dtype != Some(DType::F32) || !b.g.value(dy).uses().is_empty() || b.g.is_output(dy) {
        return None;
    }
    let (m, 0) = b.g.value(dy).producer()? else { return None };
    let grad = b.g.node(m);
    if !matches!(grad.op, Op::SoftmaxCrossEntropyLossGrad(_)) || grad.input(1) != Some(y) {
        return None;
    }
    b.g.set_input(m, 1, Some(x));
    Some(dy)
}
