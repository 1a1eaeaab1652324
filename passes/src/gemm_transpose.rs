//! Matrix transposes that a Gemm's `transA` / `transB` flags do instead.
//!
//! PyTorch exports `nn.Linear` on an input of rank 3 (a transformer's) as `MatMul(x,
//! Transpose(W))`, with the Transpose of the weight left in the graph when the export does not
//! fold constants (as in training mode). Lowering already reads a Transpose that only matrix
//! products read transposed, but the backward pass adds two more readers of it:
//!
//! - the input gradient `dX = dY · Wᵀᵀ`, a `Gemm(dY, Transpose(W), transB=1)`, which keeps the
//!   transposed copy alive from the forward pass to the backward (the LM head's is 74 MiB in f16
//!   for GPT-2's vocabulary), and makes the Transpose a launch every step;
//! - the weight gradient, `dW = Transpose(Gemm(X, dY, transA=1))`: one more launch and one more
//!   copy of every weight's gradient.
//!
//! Here, on the finished training graph, a 2-D Transpose that a Gemm reads becomes the Gemm's flag
//! (`Gemm(Transpose(B)…)` → `Gemm(B…)` with the flag flipped), and a 2-D Transpose of a Gemm
//! without C that nothing else reads becomes the product of the swapped operands, `(op(A)
//! op(B))ᵀ = op(B)ᵀ op(A)ᵀ`. The forward Transpose is then read only by its MatMul, which reads
//! it transposed without launching it. The same products: cuBLAS and the CPU's Gemm take either
//! operand transposed (for the swapped product cuBLAS may choose another algorithm, so the last
//! bits may differ on a GPU).

use mpc_ir::ops::{GemmAttrs, TransposeAttrs};
use mpc_ir::{Graph, NodeId, Op, ValueId};

use crate::{Changed, Context, Pass, Result};

pub struct GemmTranspose;

impl Pass for GemmTranspose {
    fn name(&self) -> &'static str {
        "gemm-transpose"
    }

    fn run(&self, g: &mut Graph, _cx: &Context) -> Result<Changed> {
        let mut changed = Changed::No;
        for n in g.topo_order()? {
            if matches!(g.node(n).op, Op::Gemm(_)) && read_through(g, n) {
                changed = Changed::Yes;
            }
        }
        for n in g.topo_order()? {
            if swap_operands(g, n) {
                changed = Changed::Yes;
            }
        }
        Ok(changed)
    }
}

/// The input of `v`'s producer when that is a Transpose of a matrix (rank 2, axes swapped).
fn transpose_of(g: &Graph, v: ValueId) -> Option<ValueId> {
    let (p, _) = g.value(v).producer()?;
    let node = g.node(p);
    let Op::Transpose(TransposeAttrs { perm }) = &node.op else { return None };
    let u = node.input(0)?;
    let rank2 = g.ty(u).shape.as_ref().is_some_and(|s| s.rank() == 2);
    (rank2 && perm.as_deref().is_none_or(|p| p == [1, 0])).then_some(u)
}

/// Gemm `n` reads the Transposes' inputs for its A and B (through any number of them), its flags
/// flipped. Whether it changed.
fn read_through(g: &mut Graph, n: NodeId) -> bool {
    let mut changed = false;
    for slot in 0..2 {
        while let Some(u) = g.node(n).input(slot).and_then(|v| transpose_of(g, v)) {
            let Op::Gemm(a) = g.node_op_mut(n) else { unreachable!("checked by the caller") };
            if slot == 0 {
                a.transA = !a.transA;
            } else {
                a.transB = !a.transB;
            }
            g.set_input(n, slot, Some(u));
            changed = true;
        }
    }
    changed
}

/// Transpose `n` of a Gemm's product that only it reads, the Gemm without C: the Gemm computes
/// the product of the swapped operands where it stands (a weight gradient where its layer's
/// backward pass is, not where the Transpose was: the forward's Transposes of the weights come
/// first, so their gradients come last), the Transpose's readers read it and the Transpose is
/// removed. Whether it changed.
fn swap_operands(g: &mut Graph, n: NodeId) -> bool {
    let (&[y], Some(p)) = (g.node(n).outputs(), g.node(n).input(0)) else { return false };
    if transpose_of(g, y).is_none()
        || g.value(p).uses().len() != 1
        || [p, y].iter().any(|&v| g.is_output(v) || g.name_is_referenced(v))
    {
        return false;
    }
    let Some((gemm, 0)) = g.value(p).producer() else { return false };
    let node = g.node(gemm);
    let Op::Gemm(a) = &node.op else { return false };
    let c = node.input(2).filter(|_| a.beta != 0.0);
    let (Some(x), Some(w), None) = (node.input(0), node.input(1), c) else { return false };
    let attrs = GemmAttrs { alpha: a.alpha, beta: 0.0, transA: !a.transB, transB: !a.transA };
    g.truncate_inputs(gemm, 2);
    *g.node_op_mut(gemm) = Op::Gemm(attrs);
    g.set_input(gemm, 0, Some(w));
    g.set_input(gemm, 1, Some(x));
    g.set_ty(p, g.ty(y).clone());
    // `p` now holds the transposed product: what named it as the product is gone.
    if let Some(t) = &mut g.train {
        t.activation_grads.retain(|&(_, d)| d != p);
    }
    g.replace_uses(y, p);
    g.remove_node(n);
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Dce;
    use mpc_ir::{DType, Shape, TypeInfo};

    fn gemm(a: bool, b: bool) -> Op {
        Op::Gemm(GemmAttrs { alpha: 1.0, beta: 0.0, transA: a, transB: b })
    }

    fn transpose() -> Op {
        Op::Transpose(TransposeAttrs { perm: Some(vec![1, 0]) })
    }

    /// A dense layer's backward pass as the training compiler writes it for PyTorch's export:
    /// `dX = Gemm(dY, Wᵀ, transB)` and `dW = Transpose(Gemm(X, dY, transA))`.
    #[test]
    fn a_dense_layers_gradients_read_the_weight_and_write_the_gradient_as_stored() {
        let mut g = Graph::new("g");
        let f = |d: &[u64]| TypeInfo::new(DType::F32, Shape::fixed(d));
        let x = g.add_input("x", f(&[8, 3]));
        let dy = g.add_input("dy", f(&[8, 5]));
        let w = g.add_input("w", f(&[5, 3]));
        let (_, wt) = g.add_op("wt", transpose(), &[Some(w)], 1);
        let (fwd, y) = g.add_op("y", Op::MatMul, &[Some(x), Some(wt[0])], 1);
        let (dx_n, dx) = g.add_op("dx", gemm(false, true), &[Some(dy), Some(wt[0])], 1);
        let (dwt_n, dwt) = g.add_op("dwt", gemm(true, false), &[Some(x), Some(dy)], 1);
        let (_, dw) = g.add_op("dw", transpose(), &[Some(dwt[0])], 1);
        let (update, next) = g.add_op("update", Op::Sub, &[Some(w), Some(dw[0])], 1);
        for v in [y[0], dx[0], next[0]] {
            g.add_output(v);
        }
        crate::infer_types(&mut g).unwrap();
        let cx = Context::default();
        assert_eq!(GemmTranspose.run(&mut g, &cx).unwrap(), Changed::Yes);
        // The Transpose of the product is gone with the pass (no wrong-shaped reader left).
        crate::verify(&g).unwrap();
        assert!(g.node_ids().all(|n| g.node(n).name != "dw"));
        Dce.run(&mut g, &cx).unwrap();
        crate::verify(&g).unwrap();
        // dX reads W itself; the forward MatMul is the Transpose's only reader.
        assert_eq!(g.node(dx_n).op, gemm(false, false));
        assert_eq!(g.node(dx_n).inputs(), &[Some(dy), Some(w)]);
        assert_eq!(g.value(wt[0]).uses().len(), 1);
        assert_eq!(g.value(wt[0]).uses()[0].node, fwd);
        // dW = dYᵀ X, one Gemm where the first one was, read by the update; the Transpose is gone.
        assert_eq!(g.node(dwt_n).op, gemm(true, false));
        assert_eq!(g.node(dwt_n).inputs(), &[Some(dy), Some(x)]);
        assert_eq!(g.ty(dwt[0]), g.ty(w));
        assert_eq!(g.node(update).inputs(), &[Some(w), Some(dwt[0])]);
        assert!(g.node_ids().all(|n| g.node(n).name != "dw"));
        assert_eq!(GemmTranspose.run(&mut g, &cx).unwrap(), Changed::No);
    }

    /// What must stay: a product read by something else besides the Transpose, a Gemm with C, and
    /// Transposes that are not of a matrix.
    #[test]
    fn leaves_what_it_cannot_fold() {
        let mut g = Graph::new("g");
        let f = |d: &[u64]| TypeInfo::new(DType::F32, Shape::fixed(d));
        let a = g.add_input("a", f(&[4, 4]));
        let b = g.add_input("b", f(&[4, 4]));
        let c = g.add_input("c", f(&[4, 4]));
        let t3 = g.add_input("t3", f(&[2, 4, 4]));
        let (_, shared) = g.add_op("shared", gemm(true, false), &[Some(a), Some(b)], 1);
        let (_, t1) = g.add_op("t1", transpose(), &[Some(shared[0])], 1);
        let with_c = Op::Gemm(GemmAttrs { alpha: 1.0, beta: 1.0, transA: false, transB: false });
        let (_, biased) = g.add_op("biased", with_c, &[Some(a), Some(b), Some(c)], 1);
        let (_, t2) = g.add_op("t2", transpose(), &[Some(biased[0])], 1);
        let batched = Op::Transpose(TransposeAttrs { perm: Some(vec![0, 2, 1]) });
        let (_, t4) = g.add_op("t4", batched, &[Some(t3)], 1);
        let (_, m) = g.add_op("m", Op::MatMul, &[Some(t4[0]), Some(t3)], 1);
        for v in [shared[0], t1[0], t2[0], m[0]] {
            g.add_output(v);
        }
        crate::infer_types(&mut g).unwrap();
        let before = mpc_ir::text::to_summary(&g).unwrap();
        assert_eq!(GemmTranspose.run(&mut g, &Context::default()).unwrap(), Changed::No);
        assert_eq!(mpc_ir::text::to_summary(&g).unwrap(), before);
    }
}
