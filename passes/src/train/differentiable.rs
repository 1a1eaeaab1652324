//! Which inputs of each op gradients flow into: the parameters' paths to the loss, and the
//! inputs the backward pass differentiates.

use mpc_ir::Op;

/// The inputs of `op` that gradients flow into (the others are indices, shapes, masks or
/// statistics).
pub fn differentiable(op: &Op, slot: usize) -> bool {
    match op {
        Op::Reshape(_)
        | Op::Squeeze
        | Op::Unsqueeze
        | Op::Slice
        | Op::Gather(_)
        | Op::Expand
        | Op::Tile
        | Op::Pad(_)
        | Op::Dropout(_)
        | Op::SeededDropout(_)
        | Op::ReduceSum(_)
        | Op::ReduceMean(_)
        | Op::ReduceMax(_)
        | Op::ReduceMin(_)
        | Op::ReduceSumSquare(_)
        | Op::ReduceL2(_)
        | Op::ReduceL1(_)
        | Op::ReduceLogSumExp(_)
        | Op::ReduceProd(_)
        | Op::CumSum(_)
        | Op::CumProd(_)
        | Op::RoiAlign(_)
        | Op::Split(_)
        | Op::Clip
        | Op::Resize(_)
        | Op::Trilu(_)
        | Op::SoftmaxCrossEntropyLoss(_)
        | Op::NegativeLogLikelihoodLoss(_)
        | Op::GatherElements(_)
        | Op::TopK(_)
        | Op::GatherND(_) => slot == 0,
        // Data and updates; never the indices.
        Op::ScatterND(_) | Op::ScatterElements(_) => slot == 0 || slot == 2,
        Op::Where => slot > 0,
        // Piecewise constant: the gradient is zero wherever it exists (PyTorch's convention too), so
        // their input is not differentiated and no gradient flows through them.
        Op::Floor | Op::Ceil | Op::Round | Op::Sign => false,
        Op::BatchNormalization(_) | Op::LayerNormalization(_) | Op::Conv(_) | Op::Gemm(_) => slot <= 2,
        Op::Shape(_) | Op::Size | Op::ConstantOfShape(_) | Op::Range | Op::ArgMax(_) | Op::ArgMin(_) => false,
        // On the path, so that a parameter behind an op mpc cannot differentiate is an error
        // (Attention's mask too: its rule refuses a mask that needs a gradient).
        Op::Opaque(_) | Op::Attention(_) => true,
        _ => !op.is_mpc(),
    }
}
