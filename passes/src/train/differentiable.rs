//! Which inputs of each op gradients flow into: the parameters' paths to the loss, and the
//! inputs the backward pass differentiates.

use mpc_ir::Op;

/// The inputs of `op` that gradients flow into ([`Op::differentiable`], by the op's family).
pub fn differentiable(op: &Op, slot: usize) -> bool {
    op.differentiable(slot)
}
