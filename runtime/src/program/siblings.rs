//! Bias gradients computed by their weight gradient's launch ([`Launch::sibling`]).
//!
//! The backward pass of a dense layer `Y = X Wᵀ + b` (a Gemm) or `Y = X W + b` (a MatMul and an
//! Add) reads `dY` twice besides the input gradient: `dW = dYᵀ X` or `Xᵀ dY` (a Gemm with
//! `transA`, over the rows) and `db = Σ_rows dY` (a ReduceSum over every axis but the last). A
//! device can compute both in one pass over `dY` (cuBLASLt's bias-gradient epilogues): the
//! ReduceSum is not launched on its own, it becomes the Gemm launch's sibling.

use std::collections::{HashMap, HashSet};

use mpc_ir::{DType, Graph, NodeId, Op, ValueId};

/// The ReduceSums (values) that the Gemms (keys) of `steps` compute beside their product: a
/// ReduceSum of `dY` over every axis but the last, of `dY`'s dtype (f32, f16 or bf16), where a
/// Gemm with `transA`, without `transB` and without C (a product over the rows of both operands)
/// reads the same bytes (`root`) as `[rows, last]` in either slot, and every reader of the sum
/// comes after the Gemm. One per Gemm.
pub(super) fn bias_gradients(
    g: &Graph,
    steps: &[NodeId],
    known: &super::lower::KnownValues,
    shape: &dyn Fn(ValueId) -> Option<(DType, Vec<usize>)>,
    root: &dyn Fn(ValueId) -> ValueId,
) -> HashMap<NodeId, NodeId> {
    let at: HashMap<NodeId, usize> = steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    // The dense layers' weight gradients, by the root of each operand and its slot.
    let mut gemms: HashMap<ValueId, Vec<(NodeId, usize)>> = HashMap::new();
    for &n in steps {
        let node = g.node(n);
        let Op::Gemm(a) = &node.op else { continue };
        let c = node.input(2).filter(|_| a.beta != 0.0);
        // (cuBLASLt's bias gradient is not scaled by the product's alpha.)
        if a.transA && !a.transB && a.alpha == 1.0 && c.is_none() && node.outputs().len() == 1 {
            for slot in 0..2 {
                if let Some(v) = node.input(slot) {
                    gemms.entry(root(v)).or_default().push((n, slot));
                }
            }
        }
    }
    let mut taken: HashSet<NodeId> = HashSet::new();
    let mut out = HashMap::new();
    for &r in steps {
        let node = g.node(r);
        let (Op::ReduceSum(a), Some(dy), Some(axes), &[db]) = (&node.op, node.input(0), node.input(1), node.outputs())
        else {
            continue;
        };
        let Some((dtype, s)) = shape(dy) else { continue };
        let Some(axes) = known.get(&axes).and_then(|t| t.i64s()) else { continue };
        let rank = s.len() as i64;
        let mut axes: Vec<i64> = axes.iter().map(|&x| if x < 0 { x + rank } else { x }).collect();
        axes.sort_unstable();
        let leading: Vec<i64> = (0..rank - 1).collect();
        if a.noop_with_empty_axes
            || rank < 2
            || axes != leading
            || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            || shape(db).map(|t| t.0) != Some(dtype)
            || g.is_output(db)
            || g.train.as_ref().is_some_and(|t| t.state.iter().any(|&(s, next)| s == db || next == db))
        {
            continue;
        }
        let rows: usize = s[..s.len() - 1].iter().product();
        let cols = s[s.len() - 1];
        let Some(candidates) = gemms.get(&root(dy)) else { continue };
        let fits = |&(gm, slot): &(NodeId, usize)| {
            let x = g.node(gm).input(slot).and_then(shape);
            let readers_after = g.value(db).uses().iter().all(|u| at.get(&u.node).is_some_and(|&i| i > at[&gm]));
            !taken.contains(&gm) && x == Some((dtype, vec![rows, cols])) && readers_after
        };
        if let Some(&(gm, _)) = candidates.iter().find(|c| fits(c)) {
            taken.insert(gm);
            out.insert(gm, r);
        }
    }
    out
}
