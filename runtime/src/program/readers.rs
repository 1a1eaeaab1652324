//! The nodes a launch computes inside another's ([`read_in_readers`]): Casts read widened,
//! Transposes read transposed or through a permutation, element-wise nodes applied as the
//! epilogue of the launch that makes their input (with a second operand: a bias, a residual
//! block's shortcut and the Relu after it, or the ReLU output a ReluGrad reads), and ReluGrads
//! read through by their reader.

use std::collections::{HashMap, HashSet};

use mpc_ir::ops::GeluApprox;
use mpc_ir::{DType, Def, Graph, NodeId, Op, ValueId};

use super::lower::typed;
use super::*;

/// The nodes computed inside other launches. Read inside their readers' launches, each value
/// mapped to the value its readers read instead: Casts read widened ([`Operand::Widened`]) and
/// Transposes read transposed ([`Operand::Transposed`]). Applied by the launch that makes their
/// input ([`takes_epilogue`]; only when `epilogues`): each input mapped to the node's output (or,
/// with a Relu after it, [`InOthers::thens`], the Relu's) and the node; the input is the product's
/// own result where the node reads a reshape of it.
pub(super) struct InOthers {
    pub(super) widened: HashMap<ValueId, ValueId>,
    pub(super) transposed: HashMap<ValueId, ValueId>,
    pub(super) permuted: HashMap<ValueId, (ValueId, Vec<usize>)>,
    pub(super) epilogues: HashMap<ValueId, (ValueId, NodeId)>,
    /// The second operand of an epilogue that has two, by the epilogue's node.
    pub(super) operands: HashMap<NodeId, ValueId>,
    /// The Relu applied after an epilogue, by the epilogue's node (a residual block's, after the
    /// Add of its last batch norm's output and the block's shortcut); the epilogue's result in
    /// [`InOthers::epilogues`] is then the Relu's.
    pub(super) thens: HashMap<NodeId, NodeId>,
    /// ReluGrads read through by their only reader ([`reads_relu_grad`]; only when
    /// `epilogues`): the ReluGrad's result mapped to its node and its dY and Y, which the reader
    /// reads.
    pub(super) prologues: HashMap<ValueId, (NodeId, [ValueId; 2])>,
}

pub(super) fn read_in_readers(
    g: &Graph,
    caps: DeviceCaps,
    steps: &[NodeId],
    view_of: &HashMap<ValueId, ValueId>,
    epilogues: bool,
    library: bool,
) -> InOthers {
    let step_of = steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let r = Reading { g, caps, steps, step_of, view_of, viewed: view_of.values().copied().collect() };
    let widened = r.widened_casts();
    let mut transposed = r.transposed_reads();
    let permuted = r.permuted_reads(&mut transposed);
    let mut epilogue = Epilogues::default();
    if epilogues {
        for &n in steps {
            r.epilogue(n, library, &transposed, &permuted, &mut epilogue);
        }
    }
    let thens = r.relu_thens(&mut epilogue.applied, &transposed, &permuted);
    let prologues = if epilogues { r.relu_prologues(&epilogue.applied) } else { HashMap::new() };
    InOthers {
        widened,
        transposed,
        permuted,
        epilogues: epilogue.applied,
        operands: epilogue.operands,
        thens,
        prologues,
    }
}

/// What [`read_in_readers`] reads the steps with: the graph, its views and the steps' order.
struct Reading<'a> {
    g: &'a Graph,
    caps: DeviceCaps,
    steps: &'a [NodeId],
    /// Each step's place in `steps`.
    step_of: HashMap<NodeId, usize>,
    view_of: &'a HashMap<ValueId, ValueId>,
    /// The values some view is of.
    viewed: HashSet<ValueId>,
}

/// The epilogues found: each input mapped to the node's output and the node, and the second
/// operand of those that have two.
#[derive(Default)]
struct Epilogues {
    applied: HashMap<ValueId, (ValueId, NodeId)>,
    operands: HashMap<NodeId, ValueId>,
}

fn float(t: &(DType, Vec<usize>)) -> bool {
    matches!(t.0, DType::F32 | DType::F16 | DType::BF16)
}

impl Reading<'_> {
    fn ty(&self, v: ValueId) -> Result<(DType, Vec<usize>), RuntimeError> {
        typed(self.g, self.caps, v)
    }

    /// A training step's state or next state (kept in its slot, never computed inside another).
    fn state(&self, v: ValueId) -> bool {
        self.g.train.as_ref().is_some_and(|t| t.state.iter().any(|&(s, next)| s == v || next == v))
    }

    fn ranked(&self, x: ValueId) -> bool {
        self.g.ty(x).shape.as_ref().is_some_and(|s| s.rank() >= 2)
    }

    /// Casts to f32 of f16 or bf16 values whose every reader reads that operand widened: the
    /// readers take the low value, the Cast is not launched.
    fn widened_casts(&self) -> HashMap<ValueId, ValueId> {
        let g = self.g;
        let mut widened = HashMap::new();
        for &n in self.steps {
            let node = g.node(n);
            let (Op::Cast(_), Some(u), &[v]) = (&node.op, node.input(0), node.outputs()) else { continue };
            let low = matches!(g.ty(u).dtype, Some(DType::F16 | DType::BF16));
            let uses = g.value(v).uses();
            if low
                && g.ty(v).dtype == Some(DType::F32)
                && !g.is_output(v)
                && !self.viewed.contains(&v)
                && !uses.is_empty()
                && uses.iter().all(|u| reads_widened(&g.node(u.node).op, u.slot))
            {
                widened.insert(v, u);
            }
        }
        widened
    }

    /// Transposes of the last two axes whose every reader is a matrix product: the readers read
    /// the Transpose's input transposed, the Transpose is not launched.
    fn transposed_reads(&self) -> HashMap<ValueId, ValueId> {
        let g = self.g;
        let mut transposed = HashMap::new();
        for &n in self.steps {
            let node = g.node(n);
            let (Op::Transpose(a), Some(u), &[v]) = (&node.op, node.input(0), node.outputs()) else { continue };
            let uses = g.value(v).uses();
            if self.ty(u).is_ok_and(|(_, s)| swaps_last_two(a.perm.as_deref(), s.len()))
                && !g.is_output(v)
                && !self.viewed.contains(&v)
                && !uses.is_empty()
                && uses.iter().all(|u| reads_transposed(&g.node(u.node).op, u.slot))
            {
                transposed.insert(v, u);
            }
        }
        transposed
    }

    /// Other Transposes whose every reader is a matrix product of operands of rank 2 or more (or
    /// a Transpose of the last two axes read only by such products: the two composed, and taken
    /// out of `transposed`), and that keep the stored last axis as one of the matrix axes, or a
    /// fused attention that keeps it last ([`reads_permuted`]): the readers read each matrix where
    /// it lies ([`Operand::Permuted`]; attention's heads split from `[B, S, H, D]`, and their kᵀ).
    fn permuted_reads(&self, transposed: &mut HashMap<ValueId, ValueId>) -> HashMap<ValueId, (ValueId, Vec<usize>)> {
        let g = self.g;
        let mut permuted: HashMap<ValueId, (ValueId, Vec<usize>)> = HashMap::new();
        let products = |v: ValueId| {
            let uses = g.value(v).uses();
            !uses.is_empty()
                && uses.iter().all(|u| {
                    let reader = g.node(u.node);
                    reads_transposed(&reader.op, u.slot) && reader.inputs().iter().flatten().all(|&x| self.ranked(x))
                })
        };
        for &n in self.steps {
            let node = g.node(n);
            let (Op::Transpose(a), Some(u), &[v]) = (&node.op, node.input(0), node.outputs()) else { continue };
            let (Some(perm), Ok((_, s))) = (a.perm.as_deref(), self.ty(u)) else { continue };
            let Some(perm) = permutation(perm) else { continue };
            // (A Transpose already composed with the one before it is read through that.)
            if transposed.contains_key(&v)
                || permuted.contains_key(&v)
                || perm.len() != s.len()
                || g.is_output(v)
                || self.viewed.contains(&v)
            {
                continue;
            }
            // Each reader: a product, or a swap of the last two axes read only by products.
            let mut reads = vec![(v, perm.clone())];
            let mut fits = !g.value(v).uses().is_empty();
            for use_ in g.value(v).uses() {
                let reader = g.node(use_.node);
                match (&reader.op, reader.outputs()) {
                    (Op::Transpose(_), &[w]) if transposed.contains_key(&w) && products(w) => {
                        let r = perm.len();
                        let swapped: Vec<usize> = (0..r)
                            .map(|i| match r - i {
                                1 => perm[r - 2],
                                2 => perm[r - 1],
                                _ => perm[i],
                            })
                            .collect();
                        reads.push((w, swapped));
                    }
                    _ => {
                        fits &= reads_permuted(&reader.op, use_.slot, &perm)
                            && reader.inputs().iter().flatten().all(|&x| self.ranked(x))
                    }
                }
            }
            if fits && reads.iter().all(|(_, p)| reads_through(p)) {
                for (w, p) in reads {
                    transposed.remove(&w);
                    permuted.insert(w, (u, p));
                }
            }
        }
        permuted
    }

    /// Whether `other` is made before the step of `p` (or is not made by a step at all).
    fn made_before(&self, other: ValueId, p: NodeId) -> bool {
        match self.g.value(other).def() {
            Def::Node(m, _) => self.step_of.get(m).zip(self.step_of.get(&p)).is_some_and(|(m, p)| m < p),
            _ => true,
        }
    }

    /// Whether element-wise node `n` is the only reader of a launch's first output, which the
    /// launch can apply as it writes: the launch then writes the node's output, and the node is
    /// not launched.
    fn epilogue(
        &self,
        n: NodeId,
        library: bool,
        transposed: &HashMap<ValueId, ValueId>,
        permuted: &HashMap<ValueId, (ValueId, Vec<usize>)>,
        found: &mut Epilogues,
    ) {
        let (g, view_of) = (self.g, self.view_of);
        let node = g.node(n);
        let &[v] = node.outputs() else { return };
        let Some((u, other)) = self.epilogue_operands(n, library, transposed, permuted) else { return };
        // Read through a reshape that only this node reads (checked there): the product's result
        // is viewed by it alone.
        let via_view = node.input(0).is_some_and(|dy| view_of.get(&dy) == Some(&u));
        let Def::Node(p, 0) = g.value(u).def() else { return };
        if (other.is_some() || takes_epilogue(&g.node(*p).op, &node.op, g.ty(u).dtype, g.ty(v).dtype))
            && self.step_of.contains_key(p)
            && (library || !library_epilogue(&g.node(*p).op))
            && (g.node(*p).op != Op::MatMul || g.node(*p).inputs().iter().flatten().all(|&x| self.ranked(x)))
            && !transposed.contains_key(&v)
            && !permuted.contains_key(&v)
            && g.value(u).uses().len() == 1
            && !g.is_output(u)
            && (!self.viewed.contains(&u) || via_view)
            && !view_of.contains_key(&u)
            && !self.state(u)
        {
            found.applied.insert(u, (v, n));
            found.operands.extend(other.map(|o| (n, o)));
        }
    }

    /// The product's result `u` that element-wise node `n` would be applied to, and the second
    /// operand where it has two: a bias, a residual block's shortcut, an activation's input.
    fn epilogue_operands(
        &self,
        n: NodeId,
        library: bool,
        transposed: &HashMap<ValueId, ValueId>,
        permuted: &HashMap<ValueId, (ValueId, Vec<usize>)>,
    ) -> Option<(ValueId, Option<ValueId>)> {
        let g = self.g;
        let node = g.node(n);
        let &[v] = node.outputs() else { return None };
        let ty = |v: ValueId| self.ty(v);
        // A bias made before the product (either side of the Add).
        let bias = |u: ValueId, other: ValueId| -> bool {
            let (Def::Node(p, 0), Ok((d, s))) = (g.value(u).def(), ty(u)) else { return false };
            let prod = g.node(*p);
            let made_before = self.made_before(other, *p);
            let (Some(a), Some(b)) = (prod.input(0), prod.input(1)) else { return false };
            // B, a matrix, may be read transposed (a weight PyTorch exports as `Transpose(W)`):
            // the product takes it with its flag.
            let plain = |x: ValueId| !transposed.contains_key(&x) && !permuted.contains_key(&x);
            let shapes = (ty(a), ty(b), ty(other));
            matches!(node.op, Op::Add)
                && prod.op == Op::MatMul
                && plain(a)
                && !permuted.contains_key(&b)
                && made_before
                && other != u
                && matches!(shapes, (Ok((da, ref sa)), Ok((db, ref sb)), Ok((dc, ref sc)))
                    if [da, db, dc] == [d; 3] && ty(v).is_ok_and(|t| t == (d, s.clone())) && adds_bias(sa, sb, &s, sc))
        };
        // An activation's gradient where dY is a Gemm's product (the backward pass's input
        // gradient of the layer after the activation) and its other operand made before: the
        // product applies it as it writes. ReluGrad(dY, Y), Y the ReLU's output (cuBLASLt's DRELU
        // epilogue on CUDA, from the forward launch's bit-mask, [`Launch::relu_mask`]), and the
        // tanh GELU's GeluGrad(dY, X), X the GELU's input (cuBLASLt's DGELU), dY maybe a reshape
        // of the product's result.
        let act_grad = |dy: ValueId, y: ValueId| -> bool {
            let result = self.product_result(dy);
            let Def::Node(p, 0) = g.value(result).def() else { return false };
            let prod = g.node(*p);
            let plain = match &prod.op {
                Op::Gemm(a) => a.beta == 0.0 || prod.input(2).is_none(),
                _ => false,
            };
            let op = match &node.op {
                Op::ReluGrad => result == dy,
                Op::GeluGrad(a) => a.approximate == GeluApprox::Tanh,
                _ => false,
            };
            op && plain
                && dy != y
                && result != y
                && self.made_before(y, *p)
                && matches!((ty(dy), ty(y), ty(v)), (Ok(a), Ok(b), Ok(c)) if a == b && b == c && float(&a))
                && ty(result)
                    .is_ok_and(|(_, s)| s.iter().product::<usize>() == ty(dy).map_or(0, |t| t.1.iter().product()))
        };
        // A residual block's Add of a batch norm's output and its shortcut, made before the batch
        // norm (either side of the Add), all of one dtype and shape: the batch norm adds it as it
        // writes (its own kernels, the unfused bits).
        let residual = |u: ValueId, other: ValueId| -> bool {
            let Def::Node(p, 0) = g.value(u).def() else { return false };
            matches!(node.op, Op::Add)
                && adds_residual(&g.node(*p).op)
                && other != u
                && self.made_before(other, *p)
                && matches!((ty(u), ty(other), ty(v)), (Ok(a), Ok(b), Ok(c)) if a == b && b == c)
        };
        match *node.inputs() {
            [Some(u)] => Some((u, None)),
            [Some(a), Some(b)] if library && bias(a, b) => Some((a, Some(b))),
            [Some(a), Some(b)] if library && bias(b, a) => Some((b, Some(a))),
            [Some(a), Some(b)] if residual(a, b) => Some((a, Some(b))),
            [Some(a), Some(b)] if residual(b, a) => Some((b, Some(a))),
            [Some(dy), Some(y)] if library && act_grad(dy, y) => Some((self.product_result(dy), Some(y))),
            _ => None,
        }
    }

    /// The value a product wrote that a node reads as `dy`: dy itself, or the product's result
    /// where dy is a reshape of it (a view) that only this node reads, of a result that only that
    /// reshape reads (a GELU's input gradient over a sequence: the Gemm's 2-D result viewed as
    /// `[B, S, F]`).
    fn product_result(&self, dy: ValueId) -> ValueId {
        let (g, view_of) = (self.g, self.view_of);
        match view_of.get(&dy) {
            Some(&w)
                if g.value(dy).uses().len() == 1
                    && g.value(w).uses().len() == 1
                    && view_of.values().filter(|&&r| r == w).count() == 1
                    && !g.is_output(dy) =>
            {
                w
            }
            _ => dy,
        }
    }

    /// A Relu that is the only reader of a batch norm's residual Add: applied after the Add.
    fn relu_thens(
        &self,
        applied: &mut HashMap<ValueId, (ValueId, NodeId)>,
        transposed: &HashMap<ValueId, ValueId>,
        permuted: &HashMap<ValueId, (ValueId, Vec<usize>)>,
    ) -> HashMap<NodeId, NodeId> {
        let g = self.g;
        let mut thens: HashMap<NodeId, NodeId> = HashMap::new();
        for (&u, (v, e)) in applied.iter_mut() {
            let (Def::Node(p, 0), &[use_]) = (g.value(u).def(), g.value(*v).uses()) else { continue };
            let relu = g.node(use_.node);
            let &[w] = relu.outputs() else { continue };
            if g.node(*e).op == Op::Add
                && adds_residual(&g.node(*p).op)
                && relu.op == Op::Relu
                && self.step_of.contains_key(&use_.node)
                && !g.is_output(*v)
                && !self.viewed.contains(v)
                && !self.view_of.contains_key(v)
                && !transposed.contains_key(&w)
                && !permuted.contains_key(&w)
                && !self.state(*v)
                && self.ty(w).is_ok_and(|t| self.ty(*v).is_ok_and(|s| s == t))
            {
                thens.insert(*e, use_.node);
                *v = w;
            }
        }
        thens
    }

    /// ReluGrads whose only reader reads its operand through them (a batch norm's gradient after
    /// the block's ReLU): the reader reads dY and the ReLU's output Y, the ReluGrad is not
    /// launched. Not where dY comes from an element-wise launch, which a fused chain may end with
    /// the ReluGrad (the reader would then read two tensors where the chain's one result is).
    fn relu_prologues(
        &self,
        applied: &HashMap<ValueId, (ValueId, NodeId)>,
    ) -> HashMap<ValueId, (NodeId, [ValueId; 2])> {
        let g = self.g;
        let in_epilogues: HashSet<NodeId> = applied.values().map(|&(_, e)| e).collect();
        let mut prologues: HashMap<ValueId, (NodeId, [ValueId; 2])> = HashMap::new();
        for &n in self.steps {
            let node = g.node(n);
            let (Op::ReluGrad, &[Some(dy), Some(y)], &[v]) = (&node.op, node.inputs(), node.outputs()) else {
                continue;
            };
            let &[use_] = g.value(v).uses() else { continue };
            let elementwise = match g.value(dy).def() {
                Def::Node(m, _) => crate::fuse::fusable_op(&g.node(*m).op) || crate::fuse::row_wise(&g.node(*m).op),
                _ => false,
            };
            if reads_relu_grad(&g.node(use_.node).op, use_.slot)
                && self.step_of.contains_key(&use_.node)
                && !in_epilogues.contains(&n)
                && !elementwise
                && !g.is_output(v)
                && !self.viewed.contains(&v)
                && !self.view_of.contains_key(&v)
                && !self.state(v)
                && matches!((self.ty(dy), self.ty(y), self.ty(v)), (Ok(a), Ok(b), Ok(c)) if a == b && b == c && float(&a))
            {
                prologues.insert(v, (n, [dy, y]));
            }
        }
        prologues
    }
}

/// Whether a Transpose of a rank-`rank` tensor swaps its last two axes and no other.
fn swaps_last_two(perm: Option<&[i64]>, rank: usize) -> bool {
    rank >= 2
        && match perm {
            // No perm reverses the axes: the last two only of a matrix.
            None => rank == 2,
            Some(p) => {
                p.len() == rank
                    && p.iter().enumerate().all(|(i, &a)| match i + 2 {
                        j if j < rank => a == i as i64,
                        j if j == rank => a == rank as i64 - 1,
                        _ => a == rank as i64 - 2,
                    })
            }
        }
}
