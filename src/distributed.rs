//! Data-parallel training across processes: `mpiexec -n N mpc train ... --distributed`.
//!
//! MPI (the `mpi` crate, behind the `mpi` feature: a default build needs no MPI) launches the
//! ranks and carries the collectives of the CPU device: [`MpiGroup`] is the
//! [`mpc_runtime::collective::Collective`] each rank's device reduces its gradients through, and
//! [`join`] starts MPI and says which rank this process is. The CUDA device has no collective yet
//! (NCCL): a distributed run is on the CPU.

use crate::train::Shard;
use crate::{Error, Result};

/// This process's place in a data-parallel run, and the device that reduces over its ranks.
pub struct Group {
    shard: Shard,
    collective: std::sync::Arc<dyn mpc_runtime::collective::Collective>,
    /// MPI stays initialised while this lives.
    #[cfg(feature = "mpi")]
    _universe: mpi::environment::Universe,
}

impl Group {
    pub fn shard(&self) -> Shard {
        self.shard
    }

    /// A CPU device that reduces over the group.
    pub fn device(&self) -> mpc_runtime::device::CpuDevice {
        mpc_runtime::device::CpuDevice::default().with_collective(self.collective.clone())
    }
}

/// Starts MPI and joins its world: the rank and world size `mpiexec` gave this process.
/// `device` is the `--device` of the run (a distributed run is on the CPU).
/// A collective call that waits longer than `timeout` for the other ranks ends this process with
/// one line naming the rank, the step and the call (exit 2): a rank that died or hangs stops the
/// run instead of leaving the others waiting.
pub fn join(device: &str, timeout: std::time::Duration) -> Result<Group> {
    if device != "cpu" {
        return Err(Error::Usage(format!(
            "--distributed --device {device}: data-parallel training runs on the CPU device for now (the CUDA device has no collectives yet)"
        )));
    }
    join_mpi(timeout)
}

#[cfg(not(feature = "mpi"))]
fn join_mpi(_: std::time::Duration) -> Result<Group> {
    Err(Error::Usage(
        "--distributed: this mpc was built without MPI; build it with `cargo build --release --features mpi` (MPICH or Open MPI, and libclang) and launch it with `mpiexec -n N`".into(),
    ))
}

#[cfg(feature = "mpi")]
fn join_mpi(timeout: std::time::Duration) -> Result<Group> {
    use mpi::traits::Communicator;
    let universe =
        mpi::initialize().ok_or_else(|| Error::Usage("--distributed: MPI was initialised already".into()))?;
    let world = universe.world();
    let shard = Shard { rank: world.rank() as usize, world: world.size() as usize };
    let watch = Watch::start(shard.rank, timeout);
    Ok(Group { shard, collective: std::sync::Arc::new(MpiGroup { world, watch }), _universe: universe })
}

/// The ranks of `MPI_COMM_WORLD`, each a process.
#[cfg(feature = "mpi")]
pub struct MpiGroup {
    world: mpi::topology::SimpleCommunicator,
    watch: std::sync::Arc<Watch>,
}

/// The watch over a rank's collective calls: a thread that ends the process with one line when
/// a call has waited longer than the timeout (MPI's calls cannot be cancelled, and one whose
/// peer died may never return).
#[cfg(feature = "mpi")]
struct Watch {
    rank: usize,
    timeout: std::time::Duration,
    step: std::sync::atomic::AtomicU64,
    /// The call in progress: when it started, what it is, and its number among this rank's.
    call: std::sync::Mutex<(Option<(std::time::Instant, &'static str)>, u64)>,
}

#[cfg(feature = "mpi")]
impl Watch {
    fn start(rank: usize, timeout: std::time::Duration) -> std::sync::Arc<Watch> {
        let call = std::sync::Mutex::new((None, 0));
        let watch = std::sync::Arc::new(Watch { rank, timeout, step: Default::default(), call });
        let w = watch.clone();
        let every = (timeout / 10).clamp(std::time::Duration::from_millis(10), std::time::Duration::from_secs(1));
        std::thread::spawn(move || loop {
            std::thread::sleep(every);
            let Ok(c) = w.call.lock() else { continue };
            if let (Some((since, what)), n) = *c {
                if since.elapsed() > w.timeout {
                    let step = w.step.load(std::sync::atomic::Ordering::Relaxed);
                    eprintln!(
                        "mpc: rank {}: step {step}: the {what} (this rank's collective call {n}) waited {:?} for the other ranks, which did not arrive: a rank died or hangs (--collective-timeout)",
                        w.rank, w.timeout
                    );
                    std::process::exit(2);
                }
            }
        });
        watch
    }

    /// Runs the collective call `f`, watched.
    fn over<T>(&self, what: &'static str, f: impl FnOnce() -> T) -> T {
        if let Ok(mut c) = self.call.lock() {
            c.1 += 1;
            c.0 = Some((std::time::Instant::now(), what));
        }
        let out = f();
        if let Ok(mut c) = self.call.lock() {
            c.0 = None;
        }
        out
    }
}

#[cfg(feature = "mpi")]
impl std::fmt::Debug for MpiGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use mpi::traits::Communicator;
        write!(f, "MpiGroup(rank {} of {})", self.world.rank(), self.world.size())
    }
}

#[cfg(feature = "mpi")]
impl mpc_runtime::collective::Collective for MpiGroup {
    fn rank(&self) -> usize {
        use mpi::traits::Communicator;
        self.world.rank() as usize
    }

    fn world(&self) -> usize {
        use mpi::traits::Communicator;
        self.world.size() as usize
    }

    fn at_step(&self, step: u64) {
        self.watch.step.store(step, std::sync::atomic::Ordering::Relaxed);
    }

    /// In f64 (so the mean of f32 gradients is rounded once), by `MPI_Allreduce`: every rank
    /// gets the same bits.
    fn all_reduce(
        &self,
        x: &mpc_runtime::HostTensor,
        how: mpc_ir::ops::CollectiveReduction,
    ) -> std::result::Result<mpc_runtime::HostTensor, mpc_runtime::RuntimeError> {
        use mpc_ir::ops::CollectiveReduction;
        use mpi::collective::SystemOperation;
        use mpi::traits::CommunicatorCollectives;
        let dt = x.dtype();
        if !dt.is_float() {
            return Err(mpc_runtime::RuntimeError::Graph(format!(
                "all-reduce of {dt:?}: only float tensors are reduced"
            )));
        }
        let mine = x.f64s();
        let mut all = vec![0f64; mine.len()];
        let op = match how {
            CollectiveReduction::Max => SystemOperation::max(),
            CollectiveReduction::Sum | CollectiveReduction::Mean => SystemOperation::sum(),
        };
        self.watch.over("all-reduce", || self.world.all_reduce_into(&mine[..], &mut all[..], op));
        if how == CollectiveReduction::Mean {
            let n = mpc_runtime::collective::Collective::world(self) as f64;
            all.iter_mut().for_each(|v| *v /= n);
        }
        Ok(mpc_runtime::collective::floats(dt, x.shape.clone(), all))
    }

    /// By `MPI_Reduce_scatter_block` in f64: each rank receives only its block.
    fn reduce_scatter(
        &self,
        x: &mpc_runtime::HostTensor,
        how: mpc_ir::ops::CollectiveReduction,
    ) -> std::result::Result<mpc_runtime::HostTensor, mpc_runtime::RuntimeError> {
        use mpc_ir::ops::CollectiveReduction;
        use mpi::collective::SystemOperation;
        use mpi::traits::CommunicatorCollectives;
        let dt = floats_only(x, "reduce-scatter")?;
        let n = mpc_runtime::collective::Collective::world(self);
        let mine = x.f64s();
        let mut block = vec![0f64; mine.len() / n];
        let op = match how {
            CollectiveReduction::Max => SystemOperation::max(),
            CollectiveReduction::Sum | CollectiveReduction::Mean => SystemOperation::sum(),
        };
        self.watch.over("reduce-scatter", || self.world.reduce_scatter_block_into(&mine[..], &mut block[..], op));
        if how == CollectiveReduction::Mean {
            block.iter_mut().for_each(|v| *v /= n as f64);
        }
        Ok(mpc_runtime::collective::floats(dt, vec![block.len()], block))
    }

    /// By `MPI_Allgather` (in f64, exact for every float dtype).
    fn all_gather(
        &self,
        x: &mpc_runtime::HostTensor,
    ) -> std::result::Result<mpc_runtime::HostTensor, mpc_runtime::RuntimeError> {
        use mpi::traits::CommunicatorCollectives;
        let dt = floats_only(x, "all-gather")?;
        let mine = x.f64s();
        let mut all = vec![0f64; mine.len() * mpc_runtime::collective::Collective::world(self)];
        self.watch.over("all-gather", || self.world.all_gather_into(&mine[..], &mut all[..]));
        Ok(mpc_runtime::collective::floats(dt, vec![all.len()], all))
    }
}

/// `x`'s dtype, which a collective over MPI carries as f64: floats only.
#[cfg(feature = "mpi")]
fn floats_only(
    x: &mpc_runtime::HostTensor,
    what: &str,
) -> std::result::Result<mpc_ir::DType, mpc_runtime::RuntimeError> {
    let dt = x.dtype();
    if !dt.is_float() {
        return Err(mpc_runtime::RuntimeError::Graph(format!("{what} of {dt:?}: only float tensors")));
    }
    Ok(dt)
}
