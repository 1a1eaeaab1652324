//! The [`Device`] trait: what a backend implements to run a [`Program`].
//!
//! A device owns memory and a queue. It allocates regions, writes host bytes into them, reads
//! bytes back, copies between places and enqueues launches of resolved descriptors. It only
//! enqueues: nothing in a step waits for the device, and reading back is the one explicit
//! synchronisation. [`CpuDevice`] is the reference: its queue runs each launch at once on host
//! memory with the CPU kernels.

use crate::program::{DeviceCaps, Launch, Operand, Program, Region, TensorRef};
use crate::value::HostTensor;
use crate::{cpu, RuntimeError};
use mpc_ir::Op;

/// The regions one program runs over: its arena and constants, and the session's state.
pub struct Regions<'a, M> {
    pub arena: &'a mut M,
    pub state: &'a mut M,
    pub constants: &'a mut M,
}

impl<M> Regions<'_, M> {
    pub fn get(&self, r: Region) -> &M {
        match r {
            Region::Arena => self.arena,
            Region::State => self.state,
            Region::Constants => self.constants,
        }
    }

    pub fn get_mut(&mut self, r: Region) -> &mut M {
        match r {
            Region::Arena => self.arena,
            Region::State => self.state,
            Region::Constants => self.constants,
        }
    }
}

/// What a device counts, for `--stats` and for the tests that hold steps to their promises.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    pub allocations: u64,
    pub allocated_bytes: u64,
    pub launches: u64,
    pub copies: u64,
    /// Reads of device memory back to the host (each a synchronisation).
    pub host_reads: u64,
    /// Launches that wrote their result straight into its place (the CPU device's f32 matrix
    /// products; its other launches make the result, then copy it in).
    pub in_place: u64,
    /// Operands a launch read through a copy instead of where they lie (on the CPU device: bools,
    /// whose bytes need not be 0 or 1, operands read widened, and every operand of a device made
    /// by `on_copies`).
    pub operand_copies: u64,
    /// Copies to the host enqueued without waiting, and the waits for them.
    pub staged: u64,
    pub fetches: u64,
    pub host_writes: u64,
    /// Recorded steps replayed whole (CUDA graphs).
    pub replays: u64,
    /// Convolutions prepared as cuDNN calls, and those cuDNN refused (their fallback runs).
    pub dnn_convolutions: u64,
    pub dnn_fallbacks: u64,
    /// Products prepared as cuBLASLt calls with a bias or ReLU epilogue, and those cuBLASLt
    /// refused (their fallback runs).
    pub lt_gemms: u64,
    pub lt_fallbacks: u64,
    /// Launches whose scratch lies in arena bytes free during them, and the largest workspace
    /// allocated for the scratch that did not fit (the CUDA device).
    pub scratch_in_arena: u64,
    pub workspace_bytes: u64,
}

/// A backend: memory, and a queue of launches.
pub trait Device {
    /// One region of device memory.
    type Memory;

    fn caps(&self) -> DeviceCaps;
    /// The ranks this device's `AllReduce` launches reduce over; `None`: this one alone.
    fn collective(&self) -> Option<&dyn crate::collective::Collective> {
        None
    }
    /// Called once a program's constants region holds its contents, before any step.
    fn prepare(&mut self, _program: &Program, _regions: &mut Regions<Self::Memory>) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Allocates the memory of one region.
    fn alloc(&mut self, region: Region, bytes: u64) -> Result<Self::Memory, RuntimeError>;
    /// Enqueues a write of host bytes at `offset`.
    fn write(&mut self, mem: &mut Self::Memory, offset: u64, bytes: &[u8]) -> Result<(), RuntimeError>;
    /// Reads `len` bytes at `offset` back to the host, after everything enqueued before it: a
    /// synchronisation.
    fn read(&mut self, mem: &mut Self::Memory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError>;
    /// Bytes on their way to the host.
    type Staged;
    /// Enqueues a copy of `len` bytes at `offset` to host memory, without waiting for it (a
    /// training loop stages each step's loss and reads them all when it prints).
    fn stage(&mut self, mem: &mut Self::Memory, offset: u64, len: u64) -> Result<Self::Staged, RuntimeError>;
    /// Waits for staged bytes.
    fn fetch(&mut self, staged: Self::Staged) -> Result<Vec<u8>, RuntimeError>;
    /// Enqueues a copy of one tensor's bytes to another place of the same size.
    fn copy(
        &mut self,
        regions: &mut Regions<Self::Memory>,
        from: &TensorRef,
        to: &TensorRef,
    ) -> Result<(), RuntimeError>;
    /// Enqueues one launch.
    fn launch(&mut self, regions: &mut Regions<Self::Memory>, launch: &Launch) -> Result<(), RuntimeError>;
    /// Fills a region with a pattern that reads as NaN in every float dtype (debug checks).
    fn poison(&mut self, mem: &mut Self::Memory) -> Result<(), RuntimeError>;
    fn counters(&self) -> DeviceCounters;
    /// Starts recording what is enqueued instead of running it, so that a whole step can be
    /// replayed with one call (a CUDA graph); `false`: this device does not record (the CPU runs
    /// each launch as it comes).
    fn begin_capture(&mut self) -> Result<bool, RuntimeError> {
        Ok(false)
    }
    /// Ends the recording `begin_capture` started (nothing of it has run yet); its handle.
    fn end_capture(&mut self) -> Result<u64, RuntimeError> {
        Err(RuntimeError::Internal("this device records nothing".into()))
    }
    /// Enqueues a recorded step.
    fn replay(&mut self, _recording: u64) -> Result<(), RuntimeError> {
        Err(RuntimeError::Internal("this device records nothing".into()))
    }
    /// Enqueues a timing mark (a CUDA event); `None`: this device times nothing itself (the CPU
    /// runs each launch as it is enqueued, so host clocks time it).
    fn mark(&mut self) -> Result<Option<u64>, RuntimeError> {
        Ok(None)
    }
    /// The milliseconds between two marks, once the second is reached (a wait for it).
    fn elapsed_ms(&mut self, _from: u64, _to: u64) -> Result<f64, RuntimeError> {
        Err(RuntimeError::Internal("this device makes no timing marks".into()))
    }
    /// The device memory in use as its driver reports it (every process's), where there is one.
    fn memory_in_use(&self) -> Option<u64> {
        None
    }
}

/// How a device behaves: the most memory a program may hold, whether chains of element-wise ops
/// fuse, whether steps are recorded and replayed, and the CUDA device's switches (each on by
/// default but `fmad`; turned off one by one, they tell one kind of kernel's fault from another's
/// or measure what it is worth). The CLI sets them from its flags (`--max-memory`,
/// `--no-cuda-graph`) and its `MPC_*` environment overrides, read once at its top.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceOptions {
    /// The most bytes one program may hold; `None`: the machine's memory (on CUDA, within the
    /// GPU's).
    pub memory_limit: Option<u64>,
    /// Lower chains of element-wise ops as one launch (off: to compare with the unfused program).
    pub fuse: bool,
    /// Record a step and replay it where the device can (CUDA graphs).
    pub capture: bool,
    /// CUDA: kernels move 8 or 16 bytes of a tensor at a time where they can (element-wise
    /// chains, batch norms, GELU's gradient, strided copies of whole rows); off: one element.
    pub wide: bool,
    /// CUDA: a dense layer's ReLU keeps its signs as bits for its gradient's product (cuBLASLt's
    /// bit-mask epilogue); off: the gradient is the GEMM and the ReluGrad kernel.
    pub relu_masks: bool,
    /// CUDA: NVRTC may contract a multiply and an add into a fused multiply-add (off by default:
    /// each op rounds as written, as the CPU's).
    pub fmad: bool,
    /// CUDA: products go through cuBLASLt where it is present.
    pub cublaslt: bool,
    /// CUDA: convolutions go through cuDNN where it is present.
    pub cudnn: bool,
    /// CUDA: cuDNN's convolutions take deterministic algorithms only (off: its first-ranked, which
    /// may sum with atomics, as PyTorch's default).
    pub cudnn_deterministic: bool,
    /// CUDA: a launch's scratch may lie in the arena bytes free during it (off: in the
    /// workspace).
    pub scratch_in_arena: bool,
}

impl Default for DeviceOptions {
    fn default() -> Self {
        DeviceOptions {
            memory_limit: None,
            fuse: true,
            capture: true,
            wide: true,
            relu_masks: true,
            fmad: false,
            cublaslt: true,
            cudnn: true,
            cudnn_deterministic: true,
            scratch_in_arena: true,
        }
    }
}

impl DeviceOptions {
    /// The most bytes one program may hold: the limit set, or else the machine's memory
    /// (`MemTotal` of /proc/meminfo; no limit where that cannot be read).
    pub fn memory(&self) -> u64 {
        self.memory_limit.unwrap_or_else(|| host_memory().unwrap_or(u64::MAX))
    }
}

/// The machine's memory, read once.
pub fn host_memory() -> Option<u64> {
    static HOST: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *HOST.get_or_init(read_host_memory)
}

fn read_host_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Host memory aligned to 64 bytes.
pub struct CpuMemory {
    buf: Vec<u8>,
    start: usize,
    len: usize,
}

impl CpuMemory {
    fn new(len: usize) -> CpuMemory {
        let buf = vec![0u8; len + 64];
        let start = buf.as_ptr().align_offset(64).min(64);
        CpuMemory { buf, start, len }
    }

    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// The address of the region's first byte (tests check that it never moves).
    pub fn addr(&self) -> usize {
        self.bytes().as_ptr() as usize
    }

    /// The region's first byte, for launches that work in place ([`crate::cpu`]'s views).
    pub(crate) fn base_mut(&mut self) -> *mut u8 {
        self.bytes_mut().as_mut_ptr()
    }
}

/// The CPU reference device: launches run at once, on host memory, with the CPU kernels.
///
/// The regions are the memory. A launch hands its kernel typed views of its operands' bytes
/// where they lie (`Elems` views: no copy; bools, whose bytes may not be 0 or 1 in a poisoned
/// arena, are decoded) and writes what the kernel makes into its place before the next launch.
/// f32 matrix products write straight into their place (`cpu::views`); every other kernel makes
/// its result and the device copies it in, after the views are gone, so an output the plan puts
/// on one of its inputs (in place) is read whole before it is written.
pub struct CpuDevice {
    counters: DeviceCounters,
    options: DeviceOptions,
    /// Hand kernels views of their operands and run f32 matrix products in place; else every
    /// operand is a copy.
    in_place: bool,
    /// The ranks an `AllReduce` reduces over ([`crate::collective::Solo`]: this one alone).
    collective: std::sync::Arc<dyn crate::collective::Collective>,
}

impl Default for CpuDevice {
    fn default() -> Self {
        CpuDevice {
            counters: DeviceCounters::default(),
            options: DeviceOptions::default(),
            in_place: true,
            collective: std::sync::Arc::new(crate::collective::Solo),
        }
    }
}

fn range(t: &TensorRef, len: usize) -> Result<std::ops::Range<usize>, RuntimeError> {
    let (s, e) = (t.offset as usize, (t.offset + t.bytes()) as usize);
    if e > len {
        return Err(RuntimeError::Internal(format!("a tensor at {s}..{e} lies outside its region of {len} bytes")));
    }
    Ok(s..e)
}

impl CpuDevice {
    /// A device that runs every launch through the reference kernels on copies of its operands
    /// (tests compare it with the default, which reads operands where they lie).
    pub fn on_copies() -> CpuDevice {
        CpuDevice { in_place: false, ..CpuDevice::default() }
    }

    /// A device that behaves as `options` say (the memory limit and fusion; the rest is CUDA's).
    pub fn with_options(options: DeviceOptions) -> CpuDevice {
        CpuDevice { options, ..CpuDevice::default() }
    }

    /// This device as one rank of `collective`: its `AllReduce` launches combine with the other
    /// ranks'.
    pub fn with_collective(self, collective: std::sync::Arc<dyn crate::collective::Collective>) -> CpuDevice {
        CpuDevice { collective, ..self }
    }

    /// Checks that a sharded collective at `node`, built for `world` ranks, runs in a group of
    /// that many.
    fn same_world(&self, node: &str, world: i64) -> Result<(), RuntimeError> {
        let here = self.collective.world();
        if world == here as i64 {
            return Ok(());
        }
        Err(RuntimeError::Node {
            node: node.to_string(),
            msg: format!("the step was sharded for {world} ranks and runs on {here}: compile it for this run's ranks"),
        })
    }

    fn bytes(mem: &CpuMemory, offset: u64, len: u64, what: &str) -> Result<Vec<u8>, RuntimeError> {
        let (s, e) = (offset as usize, (offset + len) as usize);
        if e > mem.len {
            return Err(RuntimeError::Internal(format!("a {what} at {s}..{e} overruns its region")));
        }
        Ok(mem.bytes()[s..e].to_vec())
    }
}

impl CpuDevice {
    /// One launch without its sibling.
    fn launch_one(&mut self, regions: &mut Regions<CpuMemory>, l: &Launch) -> Result<(), RuntimeError> {
        if !l.group.is_empty() {
            // A multi-tensor launch: its members one after the other (none reads what another
            // writes), counted as one launch.
            for m in &l.group {
                self.launch(regions, m)?;
            }
            self.counters.launches -= l.group.len() as u64 - 1;
            return Ok(());
        }
        for t in l.inputs.iter().filter_map(Operand::tensor) {
            range(t, regions.get(t.region).len)?;
        }
        let prologue = l.relu_prologue.as_ref().and_then(Operand::tensor);
        for t in l.outputs.iter().chain(l.epilogue_operand.as_ref().and_then(Operand::tensor)).chain(prologue) {
            range(t, regions.get(t.region).len)?;
        }
        // An epilogue's second operand (a bias), copied out before the launch writes anything.
        let second = match l.epilogue_operand.as_ref().and_then(Operand::tensor) {
            Some(t) => {
                let mem = regions.get(t.region);
                Some(HostTensor::from_le_bytes(t.dtype, t.shape.clone(), &mem.bytes()[range(t, mem.len)?]))
            }
            None => None,
        };
        if self.in_place && prologue.is_none() && cpu::views::try_launch(regions, l) {
            epilogue_in_place(regions, l, second.as_ref())?;
            self.counters.launches += 1;
            self.counters.in_place += 1;
            return Ok(());
        }
        // Outputs with no elements need no kernel (whose loops may still walk the dims around an
        // empty one).
        if !l.outputs.is_empty() && l.outputs.iter().all(|t| t.shape.contains(&0)) {
            self.counters.launches += 1;
            return Ok(());
        }
        let (outs, copies) = {
            let bases = cpu::views::Bases::of(regions);
            // SAFETY: each place lies inside its region (checked above) and nothing writes the
            // regions until the views are dropped at the end of this block.
            let (read, copies) = unsafe { self.operands(&bases, l, prologue)? };
            let outs = if let Some(chain) = &l.chain {
                run_chain(l, chain, &read)?
            } else {
                let refs: Vec<Option<&HostTensor>> = l
                    .inputs
                    .iter()
                    .zip(&read)
                    .map(|(o, r)| match o {
                        Operand::Absent => None,
                        Operand::Host(t) => Some(t),
                        Operand::Device(_) | Operand::Widened(_) | Operand::Transposed(_) | Operand::Permuted(..) => {
                            r.as_ref()
                        }
                    })
                    .collect();
                self.kernel(l, &refs)?
            };
            (outs, copies)
        };
        self.counters.operand_copies += copies;
        if outs.len() > l.outputs.len() {
            return Err(RuntimeError::Internal(format!(
                "{}: {} outputs for {} places",
                l.node,
                outs.len(),
                l.outputs.len()
            )));
        }
        let mut outs = outs;
        if let Some(first) = outs.first_mut() {
            epilogue(l, first, second.as_ref())?;
        }
        write_outputs(regions, l, outs)?;
        self.counters.launches += 1;
        Ok(())
    }

    /// The operands of `l` as the host reads them (views of the regions where they can be, a
    /// widened, transposed or permuted copy where the launch asks; input 0 through a ReLU's
    /// gradient where it has that prologue), and the count of copies made.
    ///
    /// # Safety
    /// Every place of `l` lies inside its region, and nothing writes the regions while the
    /// views live.
    unsafe fn operands(
        &self,
        bases: &cpu::views::Bases,
        l: &Launch,
        prologue: Option<&TensorRef>,
    ) -> Result<(Vec<Option<HostTensor>>, u64), RuntimeError> {
        let mut copies = 0;
        let read: Vec<Option<HostTensor>> = l
            .inputs
            .iter()
            .map(|o| match o {
                Operand::Device(t) => {
                    // SAFETY: each place lies inside its region (checked above) and nothing
                    // writes the regions until the views are dropped at the end of this block.
                    let view = unsafe { cpu::views::host_view(bases, t) };
                    let t = if self.in_place || !view.is_view() { view } else { view.clone() };
                    copies += u64::from(!t.is_view());
                    Some(t)
                }
                Operand::Widened(t) => {
                    // SAFETY: as above.
                    let view = unsafe { cpu::views::host_view(bases, t) };
                    copies += 1;
                    Some(view.cast(mpc_ir::DType::F32))
                }
                Operand::Transposed(t) => {
                    // SAFETY: as above.
                    let view = unsafe { cpu::views::host_view(bases, t) };
                    copies += 1;
                    Some(cpu::swap_last_two(&view))
                }
                Operand::Permuted(t, perm) => {
                    // SAFETY: as above.
                    let view = unsafe { cpu::views::host_view(bases, t) };
                    copies += 1;
                    Some(cpu::permute(&view, perm))
                }
                _ => None,
            })
            .collect();
        let mut read = read;
        if let Some(y) = prologue {
            // Input 0 read through a ReLU's gradient: the ReluGrad's reference kernel first,
            // the unfused node's bits.
            // SAFETY: as above.
            let y = unsafe { cpu::views::host_view(bases, y) };
            let dy = read
                .first()
                .and_then(Option::as_ref)
                .ok_or_else(|| RuntimeError::Internal(format!("{}: a ReLU prologue without an input 0", l.node)))?;
            let masked = cpu::run_op(&Op::ReluGrad, &[Some(dy), Some(&y)], 1)
                .map_err(|e| kernel_error(&l.node, e))?
                .into_iter()
                .next()
                .ok_or_else(|| RuntimeError::Internal(format!("{}: no ReluGrad result", l.node)))?;
            read[0] = Some(masked);
            copies += 1;
        }
        Ok((read, copies))
    }

    /// The reference kernel of `l`'s op on its operands `refs`; a collective through the
    /// device's group.
    fn kernel(&self, l: &Launch, refs: &[Option<&HostTensor>]) -> Result<Vec<HostTensor>, RuntimeError> {
        let g = &self.collective;
        let at = |e| at_node(&l.node, e);
        Ok(match (&l.op, refs.first().copied().flatten()) {
            // An `active` input false: this step does not combine (every rank alike).
            (Op::AllReduce(_), Some(x)) if !active(refs) => vec![x.clone()],
            (Op::AllReduce(a), Some(x)) => vec![g.all_reduce(x, a.reduction).map_err(at)?],
            (Op::ReduceScatter(a), Some(x)) => {
                self.same_world(&l.node, a.world)?;
                vec![match active(refs) {
                    true => g.reduce_scatter(x, a.reduction).map_err(at)?,
                    false => crate::collective::block(x, g.rank(), g.world()),
                }]
            }
            (Op::AllGather(a), Some(x)) => {
                self.same_world(&l.node, a.world)?;
                vec![g.all_gather(x).map_err(at)?]
            }
            _ => cpu::run_op_within(&l.op, refs, l.outputs.len(), self.options.memory())
                .map_err(|e| kernel_error(&l.node, e))?,
        })
    }
}

/// Applies `l`'s epilogue (where it has one) to its first output by the epilogue's reference
/// kernel: the unfused node's bits (the output in the epilogue's shape, where an element-wise
/// one reads a reshape of it); `second` is its second operand.
fn epilogue(l: &Launch, first: &mut HostTensor, second: Option<&HostTensor>) -> Result<(), RuntimeError> {
    let Some(e) = &l.epilogue else { return Ok(()) };
    let reshaped = |p: &&TensorRef| p.shape != first.shape && p.numel() == first.len();
    if let Some(place) = l.outputs.first().filter(reshaped).filter(|_| crate::plan::elementwise(e)) {
        first.shape.clone_from(&place.shape);
    }
    let args = [Some(&*first), second];
    let applied =
        cpu::run_op(e, &args[..1 + usize::from(second.is_some())], 1).map_err(|e| kernel_error(&l.node, e))?;
    *first = then_applied(l, applied)?
        .into_iter()
        .next()
        .ok_or_else(|| RuntimeError::Internal(format!("{}: no epilogue result", l.node)))?;
    Ok(())
}

/// The epilogue (where `l` has one) over the product a launch wrote in place.
fn epilogue_in_place(
    regions: &mut Regions<CpuMemory>,
    l: &Launch,
    second: Option<&HostTensor>,
) -> Result<(), RuntimeError> {
    let (Some(e), Some(place)) = (&l.epilogue, l.outputs.first()) else { return Ok(()) };
    let mem = regions.get_mut(place.region);
    let r = range(place, mem.len)?;
    let y = HostTensor::from_le_bytes(place.dtype, place.shape.clone(), &mem.bytes()[r.clone()]);
    let applied = cpu::run_op(e, &[Some(&y), second][..1 + usize::from(second.is_some())], 1)
        .map_err(|e| kernel_error(&l.node, e))?;
    let applied = then_applied(l, applied)?;
    let t = applied
        .first()
        .filter(|t| t.dtype() == place.dtype && t.len() == place.numel())
        .ok_or_else(|| RuntimeError::Internal(format!("{}: no epilogue result", l.node)))?;
    t.write_le_bytes(&mut mem.bytes_mut()[r]);
    Ok(())
}

/// Writes a launch's results into its output places: exactly what the graph declares for each.
fn write_outputs(regions: &mut Regions<CpuMemory>, l: &Launch, outs: Vec<HostTensor>) -> Result<(), RuntimeError> {
    for (t, place) in outs.into_iter().zip(&l.outputs) {
        // Each launch makes exactly what the graph declares: its dtype and shape, and as many
        // values as the shape holds.
        if t.dtype() != place.dtype || t.shape != place.shape || t.len() != place.numel() {
            return Err(RuntimeError::Internal(format!(
                "{}: the kernel made {}{:?} ({} values) where the graph declares {}{:?}",
                l.node,
                t.dtype(),
                t.shape,
                t.len(),
                place.dtype,
                place.shape
            )));
        }
        let mem = regions.get_mut(place.region);
        let r = range(place, mem.len)?;
        t.write_le_bytes(&mut mem.bytes_mut()[r]);
    }
    Ok(())
}

/// An epilogue's result with the op after it applied ([`Launch::epilogue_then`]), by its
/// reference kernel: the unfused node's bits.
fn then_applied(l: &Launch, applied: Vec<HostTensor>) -> Result<Vec<HostTensor>, RuntimeError> {
    match (&l.epilogue_then, applied.first()) {
        (Some(op), Some(t)) => cpu::run_op(op, &[Some(t)], 1).map_err(|e| kernel_error(&l.node, e)),
        _ => Ok(applied),
    }
}

impl Device for CpuDevice {
    type Memory = CpuMemory;

    fn collective(&self) -> Option<&dyn crate::collective::Collective> {
        Some(self.collective.as_ref())
    }

    fn caps(&self) -> DeviceCaps {
        DeviceCaps { name: "cpu", align: 64, memory: self.options.memory(), fuse: self.options.fuse }
    }

    fn alloc(&mut self, _region: Region, bytes: u64) -> Result<CpuMemory, RuntimeError> {
        let len = usize::try_from(bytes).map_err(|_| RuntimeError::Graph(format!("{bytes} bytes do not fit")))?;
        self.counters.allocations += 1;
        self.counters.allocated_bytes += bytes;
        Ok(CpuMemory::new(len))
    }

    fn write(&mut self, mem: &mut CpuMemory, offset: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        let s = offset as usize;
        if s + bytes.len() > mem.len {
            return Err(RuntimeError::Internal(format!("a write at {s} of {} bytes overruns its region", bytes.len())));
        }
        mem.bytes_mut()[s..s + bytes.len()].copy_from_slice(bytes);
        self.counters.host_writes += 1;
        Ok(())
    }

    fn read(&mut self, mem: &mut CpuMemory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
        self.counters.host_reads += 1;
        CpuDevice::bytes(mem, offset, len, "read")
    }

    type Staged = Vec<u8>;

    fn stage(&mut self, mem: &mut CpuMemory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
        self.counters.staged += 1;
        CpuDevice::bytes(mem, offset, len, "staged read")
    }

    fn fetch(&mut self, staged: Vec<u8>) -> Result<Vec<u8>, RuntimeError> {
        self.counters.fetches += 1;
        Ok(staged)
    }

    fn copy(&mut self, regions: &mut Regions<CpuMemory>, from: &TensorRef, to: &TensorRef) -> Result<(), RuntimeError> {
        if from.bytes() != to.bytes() {
            return Err(RuntimeError::Internal("a copy between places of different sizes".into()));
        }
        let src = range(from, regions.get(from.region).len)?;
        let dst = range(to, regions.get(to.region).len)?;
        if from.region == to.region {
            regions.get_mut(to.region).bytes_mut().copy_within(src, dst.start);
        } else {
            let data = regions.get(from.region).bytes()[src].to_vec();
            regions.get_mut(to.region).bytes_mut()[dst].copy_from_slice(&data);
        }
        self.counters.copies += 1;
        Ok(())
    }

    fn launch(&mut self, regions: &mut Regions<CpuMemory>, l: &Launch) -> Result<(), RuntimeError> {
        self.launch_one(regions, l)?;
        if let Some(s) = &l.sibling {
            // Computed after the launch, from what it read, and counted with it.
            self.launch_one(regions, s)?;
            self.counters.launches -= 1;
        }
        Ok(())
    }

    fn poison(&mut self, mem: &mut CpuMemory) -> Result<(), RuntimeError> {
        // 0xFF bytes are NaN in f16, bf16, f32 and f64.
        mem.bytes_mut().fill(0xFF);
        Ok(())
    }

    fn counters(&self) -> DeviceCounters {
        self.counters
    }
}

/// Whether a collective launch combines this step: its `active` input (the second) absent or true.
fn active(inputs: &[Option<&HostTensor>]) -> bool {
    inputs.get(1).copied().flatten().is_none_or(|f| f.f64s().first().is_some_and(|&v| v != 0.0))
}

/// A collective's failure (a rank that did not arrive, ranks that disagree) at `node`.
fn at_node(node: &str, e: RuntimeError) -> RuntimeError {
    match e {
        RuntimeError::Graph(msg) => RuntimeError::Node { node: node.to_string(), msg },
        e => e,
    }
}

fn kernel_error(node: &str, e: cpu::KernelError) -> RuntimeError {
    match e {
        cpu::KernelError::Invalid(msg) => RuntimeError::Node { node: node.to_string(), msg },
        cpu::KernelError::Unsupported(msg) => RuntimeError::Unsupported { node: node.to_string(), msg },
    }
}

/// A fused launch on the CPU: its steps one after the other, each with its reference kernel (the
/// bits of the unfused launches); the values its outputs are.
fn run_chain(
    l: &Launch,
    chain: &crate::fuse::Chain,
    read: &[Option<HostTensor>],
) -> Result<Vec<HostTensor>, RuntimeError> {
    let mut results: Vec<HostTensor> = Vec::with_capacity(chain.steps.len());
    for step in &chain.steps {
        let args: Vec<Option<&HostTensor>> = step
            .args
            .iter()
            .map(|a| match *a {
                crate::fuse::ChainArg::Input(k) => read.get(k).and_then(Option::as_ref),
                crate::fuse::ChainArg::Step(k) => results.get(k),
            })
            .collect();
        if args.iter().any(Option::is_none) {
            return Err(RuntimeError::Internal(format!("{}: a step reads past the chain or no tensor", step.node)));
        }
        let mut r = cpu::run_op(&step.op, &args, 1).map_err(|e| kernel_error(&step.node, e))?;
        if r.len() != 1 || r[0].dtype() != step.dtype {
            return Err(RuntimeError::Internal(format!("{}: the step made another dtype", step.node)));
        }
        results.push(r.remove(0));
    }
    chain
        .outputs
        .iter()
        .map(|&k| results.get(k).cloned())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| RuntimeError::Internal(format!("{}: an output past the chain", l.node)))
}
