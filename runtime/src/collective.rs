//! Collectives: what `ai.mpc::AllReduce` does across the ranks of a data-parallel run.
//!
//! A device runs an `AllReduce` launch by handing its input to its [`Collective`], which returns
//! the ranks' tensors combined element by element; every rank gets the same bits. [`Solo`] is one
//! rank (each reduction is the tensor itself: what every device does without a group), and
//! [`LocalGroup`] is a group of ranks in one process, one thread each: the reference the
//! transports of other processes (MPI, NCCL) are checked against. A rank that never arrives ends
//! the others' wait after the group's timeout with an error naming it: no rank hangs.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use mpc_ir::ops::CollectiveReduction;
use mpc_ir::DType;

use crate::{HostTensor, RuntimeError};

/// The ranks a device reduces over.
pub trait Collective: Send + Sync + std::fmt::Debug {
    /// This rank, from 0.
    fn rank(&self) -> usize;
    /// How many ranks reduce together.
    fn world(&self) -> usize;
    /// Says which training step the next calls belong to, for the messages of a group that
    /// names where it waited (nothing by default).
    fn at_step(&self, _step: u64) {}
    /// `x` combined with the other ranks' tensors of the same call: the same dtype and shape on
    /// every rank, which every rank calls in the same order. The result is the same on every rank.
    fn all_reduce(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError>;

    /// This rank's block of `x` (1-D, `world · s` elements on every rank) combined over the
    /// ranks: elements `[rank · s, (rank + 1) · s)` of what [`Self::all_reduce`] gives. By
    /// default that all-reduce, sliced; a transport with a reduce-scatter of its own moves a
    /// world's share of the bytes.
    fn reduce_scatter(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
        let all = self.all_reduce(x, how)?;
        Ok(block(&all, self.rank(), self.world()))
    }

    /// The ranks' `x` (1-D, the same length and dtype on every rank) one after the other in rank
    /// order, on every rank. By default a sum of each rank's block placed in zeros (exact: one
    /// value and zeros).
    fn all_gather(&self, x: &HostTensor) -> Result<HostTensor, RuntimeError> {
        let (s, w) = (x.len(), self.world());
        let mut placed = vec![0f64; s * w];
        placed[self.rank() * s..(self.rank() + 1) * s].copy_from_slice(&x.f64s());
        let t = floats(x.dtype(), vec![s * w], placed);
        self.all_reduce(&t, CollectiveReduction::Sum)
    }
}

/// Block `rank` of `world` equal blocks of the 1-D `t`.
pub fn block(t: &HostTensor, rank: usize, world: usize) -> HostTensor {
    let s = t.len() / world.max(1);
    let idx: Vec<usize> = (rank * s..(rank + 1) * s).collect();
    t.pick(vec![s], &idx)
}

/// Block `rank` of `t` flattened and padded with zeros to `world` blocks of `⌈n / world⌉`
/// elements (at least one): what a rank of a sharded optimizer state keeps of it. Floats only.
pub fn padded_block(t: &HostTensor, rank: usize, world: usize) -> HostTensor {
    let s = t.len().div_ceil(world.max(1)).max(1);
    let v = t.f64s();
    let part: Vec<f64> = (rank * s..(rank + 1) * s).map(|i| v.get(i).copied().unwrap_or(0.0)).collect();
    floats(t.dtype(), vec![s], part)
}

/// A float tensor of `dtype` from f64 values (rounded once to `dtype`).
pub fn floats(dtype: DType, shape: Vec<usize>, values: Vec<f64>) -> HostTensor {
    match dtype {
        DType::F64 => HostTensor::from_f64(dtype, shape, values),
        _ => HostTensor::from_f32(dtype, shape, values.into_iter().map(|v| v as f32).collect()),
    }
}

/// Checks that every rank of `group` runs the same collectives: `program`'s `AllReduce`,
/// `ReduceScatter` and `AllGather` launches, in order, each coded by its kind, dtype and element
/// count; the ranks compare the codes (their largest and smallest over the ranks, position by
/// position). Different programs would pair one rank's gradients with another's, or hang: one
/// line instead, naming the first collective that differs and this rank's node there.
pub fn same_program(group: &dyn Collective, program: &crate::program::Program) -> Result<(), RuntimeError> {
    let kind = |op: &mpc_ir::Op| match op {
        mpc_ir::Op::AllReduce(_) => Some((0, "all-reduce")),
        mpc_ir::Op::ReduceScatter(_) => Some((1, "reduce-scatter")),
        mpc_ir::Op::AllGather(_) => Some((2, "all-gather")),
        _ => None,
    };
    let calls: Vec<_> = program.launches.iter().filter_map(|l| kind(&l.op).map(|k| (l, k))).collect();
    // (elements · 32 + dtype) · 3 + kind: exact in f64 below 2^46 elements.
    let code = |l: &crate::program::Launch, k: u64| {
        let elems: u64 = l.outputs.iter().map(|t| t.numel() as u64).sum();
        let dtype = l.outputs.first().map_or(0, |t| t.dtype.onnx_code()) as u64;
        ((elems * 32 + dtype) * 3 + k) as f64
    };
    let (most, least) = extremes(group, &[calls.len() as f64])?;
    let len = most[0] as usize;
    if len == 0 {
        return Ok(());
    }
    let mut mine = vec![-1.0; len];
    for (i, &(l, (k, _))) in calls.iter().enumerate() {
        mine[i] = code(l, k);
    }
    let (hi, lo) = extremes(group, &mine)?;
    let Some(first) = (0..len).find(|&i| hi[i] != lo[i]) else { return Ok(()) };
    let here = match calls.get(first) {
        Some(&(l, (_, what))) => {
            let elems: usize = l.outputs.iter().map(|t| t.numel()).sum();
            let dtype = l.outputs.first().map(|t| format!("{:?}", t.dtype)).unwrap_or_default();
            format!("here the {what} of {elems} {dtype} elements at {}", l.node)
        }
        None => "here none".into(),
    };
    Err(RuntimeError::Graph(format!(
        "rank {}: the ranks lowered different training steps: their collective {} differs ({here}; {} collectives here, between {} and {} on the ranks): every rank must run the same model, options and data shapes",
        group.rank(),
        first + 1,
        calls.len(),
        least[0],
        most[0]
    )))
}

/// The largest and the smallest of `x` over the ranks, element by element.
fn extremes(group: &dyn Collective, x: &[f64]) -> Result<(Vec<f64>, Vec<f64>), RuntimeError> {
    let t = |v: Vec<f64>| HostTensor::from_f64(DType::F64, vec![v.len()], v);
    let most = group.all_reduce(&t(x.to_vec()), CollectiveReduction::Max)?.f64s();
    let negated = group.all_reduce(&t(x.iter().map(|v| -v).collect()), CollectiveReduction::Max)?.f64s();
    Ok((most, negated.iter().map(|v| -v).collect()))
}

/// One rank alone.
#[derive(Clone, Copy, Debug, Default)]
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce(&self, x: &HostTensor, _: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
        Ok(x.clone())
    }
    fn reduce_scatter(&self, x: &HostTensor, _: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
        Ok(x.clone())
    }
    fn all_gather(&self, x: &HostTensor) -> Result<HostTensor, RuntimeError> {
        Ok(x.clone())
    }
}

/// The ranks of one process, a thread each. The reduction is computed once, by the last rank to
/// arrive, over the ranks in rank order (in f64 for floats, so the mean of f32 tensors is
/// rounded once), and handed to all.
#[derive(Debug)]
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<Round>,
    turn: Condvar,
}

/// One call of the group: each rank's tensor, then the result until every rank has taken it.
#[derive(Debug, Default)]
struct Round {
    /// Counts the calls finished, so that a rank early for the next call waits for this one.
    round: u64,
    parts: Vec<Option<HostTensor>>,
    result: Option<Result<HostTensor, String>>,
    taken: usize,
}

impl LocalGroup {
    /// `world` ranks, each handle for the thread of its rank; a call waits at most `timeout` for
    /// the other ranks.
    pub fn new(world: usize, timeout: Duration) -> Vec<LocalGroup> {
        let round = Round { parts: vec![None; world], ..Default::default() };
        let shared = Arc::new(Shared { world, timeout, state: Mutex::new(round), turn: Condvar::new() });
        (0..world).map(|rank| LocalGroup { rank, shared: shared.clone() }).collect()
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_reduce(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
        self.round(x, "all-reduce", &|parts| combine(parts, how))
    }

    fn reduce_scatter(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
        let all = self.round(x, "reduce-scatter", &|parts| combine(parts, how))?;
        Ok(block(&all, self.rank, self.shared.world))
    }

    fn all_gather(&self, x: &HostTensor) -> Result<HostTensor, RuntimeError> {
        self.round(x, "all-gather", &concatenate)
    }
}

impl LocalGroup {
    /// One collective call: every rank's `x` handed to `f` once (by the last rank to arrive, in
    /// rank order), and its result to every rank.
    fn round(
        &self,
        x: &HostTensor,
        what: &str,
        f: &dyn Fn(&[HostTensor]) -> Result<HostTensor, String>,
    ) -> Result<HostTensor, RuntimeError> {
        let s = &self.shared;
        let deadline = Instant::now() + s.timeout;
        let lost = |st: &Round| -> RuntimeError {
            let missing: Vec<String> =
                st.parts.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(r, _)| r.to_string()).collect();
            RuntimeError::Graph(format!(
                "{what}: rank {} waited {:.0?} for rank {} (call {}), which did not arrive",
                self.rank,
                s.timeout,
                missing.join(", "),
                st.round + 1
            ))
        };
        let mut st = s.state.lock().map_err(|_| RuntimeError::Internal("a rank panicked in an all-reduce".into()))?;
        // A result still being taken belongs to the previous call: wait for it to clear.
        while st.result.is_some() || st.parts[self.rank].is_some() {
            st = wait(s, st, deadline).map_err(|st| lost(&st))?;
        }
        let round = st.round;
        st.parts[self.rank] = Some(x.clone());
        if st.parts.iter().all(Option::is_some) {
            let parts: Vec<HostTensor> = st.parts.iter_mut().map(|p| p.take().expect("every part")).collect();
            st.result = Some(same_kind(&parts).and_then(|()| f(&parts)));
            s.turn.notify_all();
        }
        while st.round == round && st.result.is_none() {
            st = wait(s, st, deadline).map_err(|st| lost(&st))?;
        }
        let out = st.result.clone().expect("the round's result");
        st.taken += 1;
        if st.taken == s.world {
            (st.result, st.taken) = (None, 0);
            st.round += 1;
            s.turn.notify_all();
        }
        out.map_err(RuntimeError::Graph)
    }
}

/// Waits on the group's condition until `deadline`; the guard back, or (timed out) in the error.
fn wait<'a>(
    s: &'a Shared,
    st: std::sync::MutexGuard<'a, Round>,
    deadline: Instant,
) -> Result<std::sync::MutexGuard<'a, Round>, std::sync::MutexGuard<'a, Round>> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(st);
    }
    match s.turn.wait_timeout(st, left) {
        Ok((st, _)) => Ok(st),
        Err(poisoned) => Err(poisoned.into_inner().0),
    }
}

/// Checks that the ranks gave tensors of one dtype and shape, floats.
fn same_kind(parts: &[HostTensor]) -> Result<(), String> {
    let first = &parts[0];
    if let Some((r, p)) = parts.iter().enumerate().find(|(_, p)| p.shape != first.shape || p.dtype() != first.dtype()) {
        return Err(format!(
            "collective: rank {r} gives {:?} {:?} where rank 0 gives {:?} {:?} (the ranks run different programs)",
            p.dtype(),
            p.shape,
            first.dtype(),
            first.shape
        ));
    }
    let dt = first.dtype();
    if !dt.is_float() {
        return Err(format!("collective of {dt:?}: only float tensors are reduced or gathered"));
    }
    Ok(())
}

/// The ranks' tensors one after the other, in rank order.
fn concatenate(parts: &[HostTensor]) -> Result<HostTensor, String> {
    let values: Vec<f64> = parts.iter().flat_map(HostTensor::f64s).collect();
    Ok(floats(parts[0].dtype(), vec![values.len()], values))
}

/// The ranks' tensors combined element by element, in rank order.
fn combine(parts: &[HostTensor], how: CollectiveReduction) -> Result<HostTensor, String> {
    let first = &parts[0];
    let dt = first.dtype();
    let values: Vec<Vec<f64>> = parts.iter().map(HostTensor::f64s).collect();
    let n = parts.len() as f64;
    let out: Vec<f64> = (0..values[0].len())
        .map(|i| {
            let mut ranks = values.iter().map(|v| v[i]);
            let start = ranks.next().expect("one rank at least");
            match how {
                CollectiveReduction::Sum => ranks.fold(start, |a, b| a + b),
                CollectiveReduction::Mean => ranks.fold(start, |a, b| a + b) / n,
                CollectiveReduction::Max => ranks.fold(start, |a, b| if b > a || b.is_nan() { b } else { a }),
            }
        })
        .collect();
    Ok(floats(dt, first.shape.clone(), out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[f32]) -> HostTensor {
        HostTensor::from_f32(DType::F32, vec![v.len()], v.to_vec())
    }

    /// Three ranks, three calls each: every rank gets the same mean, sum and max, in rank order.
    #[test]
    fn every_rank_gets_the_reduction_of_all() {
        let group = LocalGroup::new(3, Duration::from_secs(30));
        let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let ranks: Vec<_> = group
                .iter()
                .map(|r| {
                    s.spawn(move || {
                        let x = t(&[r.rank() as f32, 1.0, -(r.rank() as f32)]);
                        [CollectiveReduction::Mean, CollectiveReduction::Sum, CollectiveReduction::Max]
                            .map(|how| r.all_reduce(&x, how).unwrap().f32s().unwrap())
                            .to_vec()
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for g in &got {
            assert_eq!(g, &vec![vec![1.0, 1.0, -1.0], vec![3.0, 3.0, -3.0], vec![2.0, 1.0, 0.0]]);
        }
    }

    /// Each rank of `group` (a thread each) reduce-scatters [k, 10 + k, 2k, −k] (k its rank) and
    /// all-gathers its block: the blocks and the gathers, in rank order.
    fn scatter_and_gather<C: Collective>(group: &[C]) -> Vec<(Vec<f32>, Vec<f32>)> {
        std::thread::scope(|s| {
            let ranks: Vec<_> = group
                .iter()
                .map(|r| {
                    s.spawn(move || {
                        let k = r.rank() as f32;
                        let x = t(&[k, 10.0 + k, 2.0 * k, -k]);
                        let mine = r.reduce_scatter(&x, CollectiveReduction::Mean).unwrap();
                        let all = r.all_gather(&mine).unwrap();
                        (mine.f32s().unwrap(), all.f32s().unwrap())
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Two ranks: each gets its block of the mean (by default and as the group computes it),
    /// and every rank gets the blocks in rank order.
    #[test]
    fn reduce_scatter_gives_each_rank_its_block_and_all_gather_puts_them_back() {
        let group = LocalGroup::new(2, Duration::from_secs(30));
        let got = scatter_and_gather(&group);
        assert_eq!(got[0].0, [0.5, 10.5]);
        assert_eq!(got[1].0, [1.0, -0.5]);
        for (_, all) in &got {
            assert_eq!(all, &[0.5, 10.5, 1.0, -0.5]);
        }
        // The trait's defaults (an all-reduce sliced, a sum of placed blocks) agree.
        #[derive(Debug)]
        struct ByAllReduce(LocalGroup);
        impl Collective for ByAllReduce {
            fn rank(&self) -> usize {
                self.0.rank()
            }
            fn world(&self) -> usize {
                self.0.world()
            }
            fn all_reduce(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
                self.0.all_reduce(x, how)
            }
        }
        let group: Vec<ByAllReduce> =
            LocalGroup::new(2, Duration::from_secs(30)).into_iter().map(ByAllReduce).collect();
        let by_default = scatter_and_gather(&group);
        assert_eq!(by_default, got);
    }

    /// A rank that never calls ends the other's wait with an error naming it; ranks that give
    /// tensors of other shapes are an error on every rank.
    #[test]
    fn a_missing_rank_or_a_different_program_is_an_error_not_a_hang() {
        let group = LocalGroup::new(2, Duration::from_millis(200));
        let e = group[0].all_reduce(&t(&[1.0]), CollectiveReduction::Mean).unwrap_err().to_string();
        assert!(e.contains("rank 0 waited") && e.contains("for rank 1"), "{e}");
        let group = LocalGroup::new(2, Duration::from_secs(30));
        let errs: Vec<String> = std::thread::scope(|s| {
            let a = s.spawn(|| group[0].all_reduce(&t(&[1.0]), CollectiveReduction::Sum));
            let b = s.spawn(|| group[1].all_reduce(&t(&[1.0, 2.0]), CollectiveReduction::Sum));
            [a, b].map(|h| h.join().unwrap().unwrap_err().to_string()).to_vec()
        });
        for e in errs {
            assert!(e.contains("rank 1 gives") && e.contains("different programs"), "{e}");
        }
        assert_eq!(Solo.all_reduce(&t(&[2.5]), CollectiveReduction::Mean).unwrap().f32s().unwrap(), [2.5]);
    }
}
