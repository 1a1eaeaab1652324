//! The [`Device`] trait: what a backend implements to run a [`Program`](crate::program::Program).
//!
//! A device owns memory and a queue. It allocates regions, writes host bytes into them, reads
//! bytes back, copies between places and enqueues launches of resolved descriptors. It only
//! enqueues: nothing in a step waits for the device, and reading back is the one explicit
//! synchronisation. [`CpuDevice`] is the reference: its queue runs each launch at once on host
//! memory with the CPU kernels.

use std::collections::BTreeMap;

use crate::program::{DeviceCaps, Launch, Operand, Program, Region, TensorRef};
use crate::value::HostTensor;
use crate::{cpu, RuntimeError};

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
    /// Launches run in place on the regions (the rest ran on copies of their operands).
    pub in_place: u64,
    /// Copies to the host enqueued without waiting, and the waits for them.
    pub staged: u64,
    pub fetches: u64,
    pub host_writes: u64,
}

/// A backend: memory, and a queue of launches.
pub trait Device {
    /// One region of device memory.
    type Memory;

    fn caps(&self) -> DeviceCaps;
    /// Called once a program's constants region holds its contents, before any step.
    fn prepare(&mut self, _program: &Program, _regions: &Regions<Self::Memory>) -> Result<(), RuntimeError> {
        Ok(())
    }
    /// Allocates the memory of one region.
    fn alloc(&mut self, region: Region, bytes: u64) -> Result<Self::Memory, RuntimeError>;
    /// Enqueues a write of host bytes at `offset`.
    fn write(&mut self, mem: &mut Self::Memory, offset: u64, bytes: &[u8]) -> Result<(), RuntimeError>;
    /// Reads `len` bytes at `offset` back to the host, after everything enqueued before it: a
    /// synchronisation.
    fn read(&mut self, mem: &Self::Memory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError>;
    /// Bytes on their way to the host.
    type Staged;
    /// Enqueues a copy of `len` bytes at `offset` to host memory, without waiting for it (a
    /// training loop stages each step's loss and reads them all when it prints).
    fn stage(&mut self, mem: &Self::Memory, offset: u64, len: u64) -> Result<Self::Staged, RuntimeError>;
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
/// The reference kernels work on host tensors, so a launch reads its operands out of the regions
/// and writes its results back. What a launch wrote, and the constants, are also kept decoded
/// (keyed by their region's address and offset) until something writes over their bytes, so the
/// next launch that reads them takes them as they are; f32 matrix products run in place on the
/// regions ([`cpu::views`]).
pub struct CpuDevice {
    counters: DeviceCounters,
    decoded: BTreeMap<(usize, u64), HostTensor>,
    /// Run the launches that can work in place on the regions so (f32 matrix products).
    in_place: bool,
}

impl Default for CpuDevice {
    fn default() -> Self {
        CpuDevice { counters: DeviceCounters::default(), decoded: BTreeMap::new(), in_place: true }
    }
}

impl CpuDevice {
    /// A device that runs every launch through the reference kernels on copies of its operands
    /// (tests compare it with the default, which works in place where it can).
    pub fn on_copies() -> CpuDevice {
        CpuDevice { in_place: false, ..CpuDevice::default() }
    }

    /// Forgets the decoded values that a write to `offset..offset+len` of `mem` changes. The
    /// decoded values of one region never overlap (each is dropped before another is kept over
    /// its bytes), so a backwards scan from the end of the write stops at the first one that ends
    /// before it.
    fn invalidate(&mut self, mem: &CpuMemory, offset: u64, len: u64) {
        let addr = mem.addr();
        let mut gone = Vec::new();
        for (&(a, o), t) in self.decoded.range((addr, 0)..(addr, offset + len)).rev() {
            debug_assert_eq!(a, addr);
            if o + t.bytes() as u64 <= offset {
                break;
            }
            gone.push((a, o));
        }
        for k in gone {
            self.decoded.remove(&k);
        }
    }

    /// The decoded value at `t`'s place, if it is what `t` says.
    fn decoded_at(&self, regions: &Regions<CpuMemory>, t: &TensorRef) -> Option<&HostTensor> {
        let d = self.decoded.get(&(regions.get(t.region).addr(), t.offset))?;
        (d.shape == t.shape && d.dtype() == t.dtype).then_some(d)
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
    fn tensor(regions: &Regions<CpuMemory>, t: &TensorRef) -> Result<HostTensor, RuntimeError> {
        let mem = regions.get(t.region);
        let r = range(t, mem.len)?;
        Ok(HostTensor::from_le_bytes(t.dtype, t.shape.clone(), &mem.bytes()[r]))
    }
}

impl Device for CpuDevice {
    type Memory = CpuMemory;

    fn caps(&self) -> DeviceCaps {
        DeviceCaps { name: "cpu", align: 64 }
    }

    fn prepare(&mut self, program: &Program, regions: &Regions<CpuMemory>) -> Result<(), RuntimeError> {
        let addr = regions.constants.addr();
        for (place, _) in &program.constants {
            self.decoded.insert((addr, place.offset), Self::tensor(regions, place)?);
        }
        Ok(())
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
        self.invalidate(mem, offset, bytes.len() as u64);
        Ok(())
    }

    fn read(&mut self, mem: &CpuMemory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
        let (s, e) = (offset as usize, (offset + len) as usize);
        if e > mem.len {
            return Err(RuntimeError::Internal(format!("a read at {s}..{e} overruns its region")));
        }
        self.counters.host_reads += 1;
        Ok(mem.bytes()[s..e].to_vec())
    }

    type Staged = Vec<u8>;

    fn stage(&mut self, mem: &CpuMemory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
        let (s, e) = (offset as usize, (offset + len) as usize);
        if e > mem.len {
            return Err(RuntimeError::Internal(format!("a staged read at {s}..{e} overruns its region")));
        }
        self.counters.staged += 1;
        Ok(mem.bytes()[s..e].to_vec())
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
        self.invalidate(regions.get(to.region), to.offset, to.bytes());
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
        if self.in_place && cpu::views::try_launch(regions, l) {
            for t in &l.outputs {
                self.invalidate(regions.get(t.region), t.offset, t.bytes());
            }
            self.counters.launches += 1;
            self.counters.in_place += 1;
            return Ok(());
        }
        let decoded = |t: &TensorRef| self.decoded_at(regions, t);
        let read: Vec<Option<HostTensor>> = l
            .inputs
            .iter()
            .map(|o| match o {
                Operand::Device(t) if decoded(t).is_none() => Self::tensor(regions, t).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_, _>>()?;
        let refs: Vec<Option<&HostTensor>> = l
            .inputs
            .iter()
            .zip(&read)
            .map(|(o, r)| match o {
                Operand::Absent => None,
                Operand::Host(t) => Some(t),
                Operand::Device(t) => r.as_ref().or_else(|| decoded(t)),
            })
            .collect();
        let outs = cpu::run_op(&l.op, &refs, l.outputs.len()).map_err(|e| match e {
            cpu::KernelError::Invalid(msg) => RuntimeError::Node { node: l.node.clone(), msg },
            cpu::KernelError::Unsupported(msg) => RuntimeError::Unsupported { node: l.node.clone(), msg },
        })?;
        if outs.len() > l.outputs.len() {
            return Err(RuntimeError::Internal(format!(
                "{}: {} outputs for {} places",
                l.node,
                outs.len(),
                l.outputs.len()
            )));
        }
        for (t, place) in outs.into_iter().zip(&l.outputs) {
            // Each launch writes exactly what the graph declares: its dtype, shape and bytes.
            if t.dtype() != place.dtype || t.shape != place.shape {
                return Err(RuntimeError::Internal(format!(
                    "{}: the kernel made {}{:?} where the graph declares {}{:?}",
                    l.node,
                    t.dtype(),
                    t.shape,
                    place.dtype,
                    place.shape
                )));
            }
            let mem = regions.get_mut(place.region);
            let r = range(place, mem.len)?;
            t.write_le_bytes(&mut mem.bytes_mut()[r]);
            // The next reader takes the result as it is, until something writes over it.
            let mem = regions.get(place.region);
            self.invalidate(mem, place.offset, place.bytes());
            self.decoded.insert((mem.addr(), place.offset), t);
        }
        self.counters.launches += 1;
        Ok(())
    }

    fn poison(&mut self, mem: &mut CpuMemory) -> Result<(), RuntimeError> {
        // 0xFF bytes are NaN in f16, bf16, f32 and f64.
        mem.bytes_mut().fill(0xFF);
        self.invalidate(mem, 0, mem.len as u64);
        Ok(())
    }

    fn counters(&self) -> DeviceCounters {
        self.counters
    }
}
