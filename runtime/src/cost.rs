//! What a lowered program costs, known before it runs: what its arena holds at its peak
//! ([`Program::peak_live`]), and the bytes and matrix-product FLOPs of each launch
//! ([`Program::traffic`]), from which a step's two floors follow (bytes over a device's
//! bandwidth, FLOPs over its matrix-product rate).

use std::collections::{BTreeMap, HashSet};

use mpc_ir::{DType, Op};

use crate::program::{Launch, Operand, Program, TensorRef};

/// The launch during which the most arena bytes are alive, and the values alive then, largest
/// first: what a smaller peak must remove. The placed arena may be larger than their sum (gaps).
#[derive(Clone, Debug, Default)]
pub struct PeakLive {
    pub step: usize,
    pub bytes: u64,
    pub values: Vec<(String, DType, Vec<usize>, u64)>,
}

/// What one launch must move and compute at the least: each distinct tensor it reads and each
/// it writes, once (a kernel that reads a tensor again, as a GEMM reads its tiles or a row-wise
/// kernel its rows, is counted once: that is the floor), and the multiply-adds of a matrix
/// product or convolution as 2 FLOPs each, under the dtype of its operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchCost {
    pub read: u64,
    pub written: u64,
    pub flops: u64,
    /// The operands' dtype of a matrix product or convolution (`None` for other launches).
    pub product: Option<DType>,
}

impl LaunchCost {
    pub fn bytes(&self) -> u64 {
        self.read + self.written
    }
}

/// The launches of one kind (an op type, `Gemm f16`, or a fused chain's name) and what they move.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindCost {
    pub kind: String,
    pub launches: usize,
    pub read: u64,
    pub written: u64,
    pub flops: u64,
}

impl KindCost {
    pub fn bytes(&self) -> u64 {
        self.read + self.written
    }
}

/// A step's traffic: every launch's [`LaunchCost`], summed by kind (most bytes first) and by the
/// dtype of the matrix products. An `If`'s branches are not counted (which runs is known only
/// when stepping).
#[derive(Clone, Debug, Default)]
pub struct Traffic {
    pub launches: usize,
    pub read: u64,
    pub written: u64,
    pub flops: BTreeMap<DType, u64>,
    pub kinds: Vec<KindCost>,
}

impl Traffic {
    pub fn bytes(&self) -> u64 {
        self.read + self.written
    }
}

impl Program {
    /// The step with the most arena bytes alive (branches of an `If` aside), and what is alive.
    pub fn peak_live(&self) -> PeakLive {
        let steps = self.buffers.iter().map(|b| b.last + 1).max().unwrap_or(0);
        let mut alive = vec![0u64; steps];
        for b in &self.buffers {
            alive[b.first..=b.last].iter_mut().for_each(|a| *a += b.bytes);
        }
        let Some((step, &bytes)) = alive.iter().enumerate().max_by_key(|&(i, a)| (*a, std::cmp::Reverse(i))) else {
            return PeakLive::default();
        };
        let mut values: Vec<(String, DType, Vec<usize>, u64)> = self
            .buffers
            .iter()
            .filter(|b| b.first <= step && step <= b.last)
            .filter_map(|b| {
                let (_, name, dtype, shape) = b.values.iter().rev().find(|v| v.0 <= step).or(b.values.first())?;
                Some((name.clone(), *dtype, shape.clone(), b.bytes))
            })
            .collect();
        values.sort_by(|a, b| b.3.cmp(&a.3).then_with(|| a.0.cmp(&b.0)));
        PeakLive { step, bytes, values }
    }

    /// The longest run of arena bytes that no buffer alive during launch `step` holds, as
    /// (offset, bytes), within the bytes the program's own buffers span (an `If`'s branches lie
    /// past them, and an `If` launch itself has none free): scratch for that launch alone, as a
    /// device's library may want (cuDNN's), that costs no memory beyond the arena's.
    pub fn free_during(&self, step: usize) -> (u64, u64) {
        if self.launches.get(step).is_none_or(|l| l.branches.is_some()) {
            return (0, 0);
        }
        let end = self.buffers.iter().map(|b| b.offset + b.bytes).max().unwrap_or(0);
        let mut held: Vec<(u64, u64)> = self
            .buffers
            .iter()
            .filter(|b| b.first <= step && step <= b.last && b.bytes > 0)
            .map(|b| (b.offset, b.offset + b.bytes))
            .collect();
        held.sort_unstable();
        let (mut best, mut from) = ((0, 0), 0);
        for (start, stop) in held.into_iter().chain([(end, end)]) {
            if start > from && start - from > best.1 {
                best = (from, start - from);
            }
            from = from.max(stop);
        }
        best
    }

    /// What the step's launches move and compute, by kind.
    pub fn traffic(&self) -> Traffic {
        let mut t = Traffic { launches: self.launches.len(), ..Traffic::default() };
        let mut kinds: BTreeMap<String, KindCost> = BTreeMap::new();
        for l in &self.launches {
            let c = launch_cost(l);
            t.read += c.read;
            t.written += c.written;
            let mut kind = l.kind();
            if let Some(d) = c.product {
                *t.flops.entry(d).or_default() += c.flops;
                kind = format!("{kind} {d}");
            }
            let k = kinds.entry(kind.clone()).or_insert_with(|| KindCost { kind, ..KindCost::default() });
            k.launches += 1;
            k.read += c.read;
            k.written += c.written;
            k.flops += c.flops;
        }
        t.kinds = kinds.into_values().collect();
        t.kinds.sort_by(|a, b| b.bytes().cmp(&a.bytes()).then_with(|| a.kind.cmp(&b.kind)));
        t
    }
}

/// The least one launch moves and computes ([`LaunchCost`]).
pub fn launch_cost(l: &Launch) -> LaunchCost {
    if !l.group.is_empty() {
        let parts: Vec<LaunchCost> = l.group.iter().map(launch_cost).collect();
        let sum = |f: &dyn Fn(&LaunchCost) -> u64| parts.iter().map(f).sum::<u64>();
        return LaunchCost {
            read: sum(&|c| c.read),
            written: sum(&|c| c.written),
            flops: sum(&|c| c.flops),
            product: None,
        };
    }
    let mut seen = HashSet::new();
    let mut c = own_cost(l, &mut seen);
    if let Some(s) = &l.sibling {
        // What the sibling reads that the launch read is read once.
        let more = own_cost(s, &mut seen);
        c.read += more.read;
        c.written += more.written;
    }
    c
}

/// A launch's cost without its sibling; `seen` holds the tensors already counted as read.
fn own_cost(l: &Launch, seen: &mut HashSet<(crate::program::Region, u64, u64)>) -> LaunchCost {
    let ins: Vec<Option<TensorRef>> = l.inputs.iter().map(|o| o.tensor().cloned()).collect();
    let mut read = 0;
    for (slot, t) in ins.iter().enumerate() {
        let Some(t) = t else { continue };
        if !seen.insert((t.region, t.offset, t.bytes())) {
            continue;
        }
        read += match (&l.op, slot) {
            // A gather reads the rows it takes, not its whole table.
            (Op::Gather(_) | Op::GatherElements(_) | Op::GatherND(_), 0) => {
                l.outputs.first().map_or(0, |y| (y.numel() * t.dtype.size()) as u64).min(t.bytes())
            }
            // An update writes its parameter's low-precision copy; it reads the copy only on a
            // skipped step.
            (Op::SgdUpdate(_), 5) | (Op::AdamUpdate(_), 7) => 0,
            _ => t.bytes(),
        };
    }
    // A ReLU's gradient from its mask reads the bits, not the ReLU's output; the ReLU's launch
    // writes them (the path of a device that keeps them: cuBLASLt's on CUDA).
    let (from_mask, mask_written) = match (&l.relu_mask, &l.epilogue) {
        (Some(m), Some(Op::ReluGrad)) => (Some(m), 0),
        (Some(m), _) => (None, m.bytes()),
        (None, _) => (None, 0),
    };
    let second = from_mask.or(l.epilogue_operand.as_ref().and_then(|o| o.tensor()));
    for t in second.into_iter().chain(l.relu_prologue.as_ref().and_then(|o| o.tensor())) {
        if seen.insert((t.region, t.offset, t.bytes())) {
            read += t.bytes();
        }
    }
    // Outputs nothing reads are not written (a device may skip them; CUDA does a ConvGrad's dX).
    let written =
        l.outputs.iter().enumerate().filter(|(k, _)| !l.unread.contains(k)).map(|(_, t)| t.bytes()).sum::<u64>()
            + mask_written;
    let (flops, product) = product_flops(l, &ins).map_or((0, None), |(f, d)| (f, Some(d)));
    LaunchCost { read, written, flops, product }
}

/// The FLOPs of a matrix product or convolution launch and its operands' dtype.
fn product_flops(l: &Launch, ins: &[Option<TensorRef>]) -> Option<(u64, DType)> {
    let shape = |i: usize| ins.get(i).and_then(|t| t.as_ref()).map(|t| t.shape.as_slice());
    let numel = |s: &[usize]| s.iter().map(|&d| d as u64).product::<u64>();
    let dtype = ins.first()?.as_ref()?.dtype;
    let y = l.outputs.first()?;
    let flops = match &l.op {
        Op::MatMul => {
            // The inner dim: A's last, its second last where A is stored transposed, or the
            // stored axis its last is where it is read through a permutation.
            let a = shape(0)?;
            let k = match l.inputs.first() {
                Some(Operand::Transposed(_)) => a.get(a.len().checked_sub(2)?)?,
                Some(Operand::Permuted(_, perm)) => a.get(*perm.last()?)?,
                _ => a.last()?,
            };
            2 * numel(&y.shape) * *k as u64
        }
        Op::Gemm(g) => {
            let a = shape(0)?;
            let k = if g.transA { a.first()? } else { a.get(1)? };
            2 * numel(&y.shape) * *k as u64
        }
        // Fused attention: the products of the unfused chain, Q·Kᵀ and P·V forward, dP, dV, dQ and
        // dK backward (not the scores the gradient computes again).
        Op::Attention(a) | Op::AttentionGrad(a) => {
            let at = usize::from(matches!(l.op, Op::AttentionGrad(_)));
            // K's length: its axis 1 (bshd) or second-last, where a permuted operand stores it.
            let k = shape(at + 1)?;
            let axis = if a.layout == mpc_ir::ops::AttentionLayout::Bshd { 1 } else { k.len().checked_sub(2)? };
            let axis = match l.inputs.get(at + 1) {
                Some(Operand::Permuted(_, perm)) => *perm.get(axis)?,
                _ => axis,
            };
            4 * (1 + at as u64) * numel(shape(at)?) * *k.get(axis)? as u64
        }
        // Each output element of a convolution takes (C_in / group) · kernel multiply-adds; each
        // input element of a transposed one scatters into (C_out / group) · kernel outputs; the
        // gradient computes dX and dW, each the forward's count (dW alone where nothing reads
        // dX).
        Op::Conv(_) | Op::ConvTranspose(_) | Op::ConvGrad(_) => {
            let w = shape(if matches!(l.op, Op::ConvGrad(_)) { 2 } else { 1 })?;
            let per = numel(w.get(1..)?);
            match &l.op {
                Op::Conv(_) => 2 * numel(&y.shape) * per,
                Op::ConvTranspose(_) => 2 * numel(shape(0)?) * per,
                _ => (2 - l.unread.contains(&0) as u64) * 2 * numel(shape(0)?) * per,
            }
        }
        Op::Einsum(e) => {
            // Every label's extent once: the multiply-adds of the contraction.
            let (terms, _) = mpc_ir::ops::einsum_parts(&e.equation).ok()?;
            let mut extent = BTreeMap::new();
            for (i, term) in terms.iter().enumerate() {
                for (c, &d) in term.chars().zip(shape(i)?) {
                    extent.insert(c, d as u64);
                }
            }
            2 * extent.values().product::<u64>()
        }
        _ => return None,
    };
    Some((flops, dtype))
}
