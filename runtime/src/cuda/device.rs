//! [`CudaDevice`]: the [`Device`] that runs programs on an NVIDIA GPU.
//!
//! - One primary context and one non-blocking stream; every region is one device allocation,
//!   made when a program is loaded, and freed with the device.
//! - `prepare` plans every launch of the program ([`super::plan`]), fails there for an op the
//!   device cannot run (naming its node), allocates the program's workspace, uploads the plans'
//!   aux bytes, loads the kernels (NVRTC, cached cubins: [`super::nvrtc`]) and resolves every
//!   argument to its final bytes. A step then only enqueues: `cuLaunchKernel` with ready
//!   parameter buffers, cuBLAS GEMMs (FP32 accumulation for f16/bf16; f32 stays f32 unless
//!   `allow_tf32`), device copies and fills. Nothing in a step allocates or waits.
//! - `read` is a synchronisation; `stage` enqueues a copy into pinned host memory and records an
//!   event, and `fetch` waits for that event only.

use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};

use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result as drv, sys as drv_sys};

use super::plan::{self, param_offsets, Buf, Gemm};
use super::{nvrtc, CudaError, Gpu};
use crate::device::{Device, DeviceCounters, DeviceOptions, Regions};
use crate::program::{DeviceCaps, Launch, Program, Region, TensorRef};
use crate::RuntimeError;

mod prepare;

/// One region of device memory.
#[derive(Debug)]
pub struct CudaMemory {
    ptr: u64,
    len: u64,
}

impl CudaMemory {
    /// The device address of the region's first byte (tests check that it never moves).
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

/// A call with every address resolved.
enum Ready {
    Kernel { f: drv_sys::CUfunction, grid: [u32; 3], block: [u32; 3], params: Vec<u8>, offsets: Vec<usize> },
    Gemm { g: Gemm, operands: [u64; 3], arrays: Option<[u64; 3]> },
    Copy { from: u64, to: u64, bytes: u64 },
    Fill { to: u64, bytes: u64, byte: u8 },
    Conv(Box<super::dnn::Ready>),
    Lt(Box<super::lt::Ready>),
}

struct Prepared {
    node: String,
    calls: Vec<Ready>,
}

/// Bytes on their way to the host: pinned memory and the event that marks the copy done.
pub struct Staged {
    host: *mut u8,
    cap: usize,
    len: usize,
    event: drv_sys::CUevent,
}

pub struct CudaDevice {
    gpu: Gpu,
    dev: drv_sys::CUdevice,
    ctx: drv_sys::CUcontext,
    stream: drv_sys::CUstream,
    blas: blas_sys::cublasHandle_t,
    /// cuDNN for convolutions, or why not (the plans' fallbacks run instead).
    dnn: Result<super::dnn::Dnn, String>,
    /// cuDNN's answer for each convolution of the program being prepared, in the order its
    /// calls are readied: descriptors and algorithms (their scratch at an offset in the
    /// launch's scratch), or why not.
    dnn_pending: VecDeque<Result<Box<super::dnn::Ready>, String>>,
    /// Why cuDNN refused convolutions it was offered: node and reason, the first 16.
    dnn_refusals: Vec<String>,
    /// cuBLASLt for products with a bias or ReLU epilogue, or why not (the fallbacks run).
    lt: Result<super::lt::Lt, String>,
    /// Why cuBLASLt refused products it was offered: node and reason, the first 16.
    lt_refusals: Vec<String>,
    /// The ReLU bit-masks that products of the program being prepared write (by address): a
    /// ReLU's gradient is read from its mask only where the ReLU's product went to cuBLASLt.
    masks_written: std::collections::HashSet<u64>,
    allow_tf32: bool,
    modules: HashMap<String, drv_sys::CUmodule>,
    functions: HashMap<String, drv_sys::CUfunction>,
    /// Every loaded kernel's parameter layout, from its cubin: each call is checked against it
    /// when a program is prepared.
    params: HashMap<String, super::cubin::KernelParams>,
    /// Every device allocation, freed with the device.
    allocations: Vec<u64>,
    /// The resolved calls of each prepared launch, by the launch's address (a loaded program's
    /// launches never move).
    prepared: HashMap<usize, Prepared>,
    /// Pinned host buffers and events for `stage`, reused.
    pinned: Vec<(*mut u8, usize)>,
    /// Every pinned buffer made, freed with the device.
    pinned_all: Vec<*mut u8>,
    events: Vec<drv_sys::CUevent>,
    /// Timing events by mark, and the marks free for reuse.
    timers: Vec<drv_sys::CUevent>,
    free_timers: Vec<u64>,
    /// The error words of the launches that read indices from device memory: each program's
    /// block (one i32 per such launch) and the launches' nodes. Read at each synchronisation.
    flags: Vec<(u64, Vec<String>)>,
    /// Recorded steps (CUDA graphs), by the handle `end_capture` gave.
    graphs: Vec<drv_sys::CUgraphExec>,
    counters: DeviceCounters,
    /// How it behaves (the memory limit, capture, the kernels' and libraries' switches).
    options: DeviceOptions,
}

/// cuBLAS's workspace: set once, so that no GEMM allocates inside a recorded step.
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

fn driver(what: &str) -> impl Fn(drv::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Internal(format!("CUDA {what}: {e:?}"))
}

fn cuda_error(e: CudaError) -> RuntimeError {
    RuntimeError::Graph(e.to_string())
}

impl CudaDevice {
    /// The GPU `ordinal`, or why it cannot be used (no driver, no GPU, a driver too old).
    pub fn new(ordinal: usize) -> Result<CudaDevice, CudaError> {
        CudaDevice::with_options(ordinal, DeviceOptions::default())
    }

    /// [`CudaDevice::new`], behaving as `options` say.
    pub fn with_options(ordinal: usize, options: DeviceOptions) -> Result<CudaDevice, CudaError> {
        let (gpus, _) = super::gpus()?;
        let gpu = gpus.get(ordinal).cloned().ok_or(CudaError::NoDevice)?;
        let err = |e: drv::DriverError| CudaError::Driver(format!("{e:?}"));
        let dev = drv::device::get(gpu.ordinal).map_err(err)?;
        // SAFETY: `dev` came from the driver; the context is released in Drop.
        let ctx = unsafe { drv::primary_ctx::retain(dev) }.map_err(err)?;
        // SAFETY: `ctx` is a live context.
        unsafe { drv::ctx::set_current(ctx) }.map_err(err)?;
        let stream = drv::stream::create(drv::stream::StreamKind::NonBlocking).map_err(err)?;
        // SAFETY: the library is present when the driver is (probe checks it below).
        if !unsafe { blas_sys::is_culib_present() } {
            return Err(CudaError::Driver("cuBLAS was not found (libcublas.so.13)".into()));
        }
        let blas = blas::create_handle().map_err(|e| CudaError::Driver(format!("cuBLAS: {e:?}")))?;
        // SAFETY: both handles are live.
        unsafe { blas::set_stream(blas, stream as _) }.map_err(|e| CudaError::Driver(format!("cuBLAS: {e:?}")))?;
        nvrtc::version()?;
        nvrtc::include_dir()?;
        let dnn = super::dnn::Dnn::new(stream as *mut c_void, &options);
        let mut device = CudaDevice {
            gpu,
            dev,
            ctx,
            stream,
            blas,
            dnn,
            dnn_pending: VecDeque::new(),
            dnn_refusals: Vec::new(),
            lt: Err(String::new()),
            lt_refusals: Vec::new(),
            masks_written: Default::default(),
            allow_tf32: false,
            modules: HashMap::new(),
            functions: HashMap::new(),
            params: HashMap::new(),
            allocations: Vec::new(),
            prepared: HashMap::new(),
            pinned: Vec::new(),
            pinned_all: Vec::new(),
            events: Vec::new(),
            graphs: Vec::new(),
            flags: Vec::new(),
            timers: Vec::new(),
            free_timers: Vec::new(),
            counters: DeviceCounters::default(),
            options,
        };
        // SAFETY: a plain allocation, freed in Drop; cuBLAS uses it for as long as the handle lives.
        let ws = unsafe { drv::malloc_sync(CUBLAS_WORKSPACE) }.map_err(err)?;
        device.allocations.push(ws);
        device.counters.allocations += 1;
        device.counters.allocated_bytes += CUBLAS_WORKSPACE as u64;
        // SAFETY: the handle and the allocation are live.
        unsafe { blas_sys::cublasSetWorkspace_v2(device.blas, ws as *mut c_void, CUBLAS_WORKSPACE) }
            .result()
            .map_err(|e| CudaError::Driver(format!("cuBLAS workspace: {e:?}")))?;
        device.lt = super::lt::Lt::new(ws, CUBLAS_WORKSPACE, &options);
        Ok(device)
    }

    /// f32 matrix products on TF32 tensor cores (off by default: f32 stays f32, as in PyTorch).
    pub fn with_tf32(mut self, allow: bool) -> CudaDevice {
        self.allow_tf32 = allow;
        self
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether convolutions run through cuDNN, or why not.
    pub fn cudnn(&self) -> Result<(), &str> {
        self.dnn.as_ref().map(|_| ()).map_err(|e| e.as_str())
    }

    /// The convolutions cuDNN refused (their fallback runs), with why: the first 16.
    pub fn cudnn_refusals(&self) -> &[String] {
        &self.dnn_refusals
    }

    /// Whether products with a bias or ReLU run through cuBLASLt, or why not.
    pub fn cublaslt(&self) -> Result<(), &str> {
        self.lt.as_ref().map(|_| ()).map_err(|e| e.as_str())
    }

    /// The products cuBLASLt refused (their fallback runs), with why: the first 16.
    pub fn cublaslt_refusals(&self) -> &[String] {
        &self.lt_refusals
    }

    fn current(&self) -> Result<(), RuntimeError> {
        // SAFETY: the context lives as long as the device.
        unsafe { drv::ctx::set_current(self.ctx) }.map_err(driver("context"))
    }

    /// The kernel `k`, compiled and loaded on first use: from its family's file, or a fused
    /// chain's generated source (one module each).
    fn function(&mut self, k: &plan::Kernel) -> Result<drv_sys::CUfunction, RuntimeError> {
        let (family, name) = (k.family, k.name.as_str());
        if let Some(&f) = self.functions.get(name) {
            return Ok(f);
        }
        let module_key = if k.fused.is_some() { name.to_string() } else { family.to_string() };
        if !self.modules.contains_key(&module_key) {
            let source = match &k.fused {
                Some(fused) => fused.source.as_str(),
                None => nvrtc::FAMILIES
                    .iter()
                    .find(|(f, _)| *f == family)
                    .map(|(_, s)| *s)
                    .ok_or_else(|| RuntimeError::Internal(format!("no kernel family {family}")))?,
            };
            let compiled =
                nvrtc::compile_with(family, source, &self.gpu.arch(), false, self.options.fmad).map_err(cuda_error)?;
            let params =
                super::cubin::kernels(&compiled.cubin).map_err(|e| RuntimeError::Internal(format!("{family}: {e}")))?;
            self.params.extend(params);
            // SAFETY: a cubin NVRTC made for this device's architecture; it is copied by the driver.
            let module = unsafe { drv::module::load_data(compiled.cubin.as_ptr() as *const c_void) }
                .map_err(driver("loading a module"))?;
            self.modules.insert(module_key.clone(), module);
        }
        let cname = CString::new(name).map_err(|_| RuntimeError::Internal(format!("kernel name {name}")))?;
        // SAFETY: the module is loaded and stays loaded as long as the device.
        let f = unsafe { drv::module::get_function(self.modules[&module_key], cname) }
            .map_err(|e| RuntimeError::Internal(format!("kernel {name} is not in kernels/{family}.cu: {e:?}")))?;
        self.functions.insert(name.to_string(), f);
        Ok(f)
    }

    fn alloc_bytes(&mut self, bytes: u64, what: &str) -> Result<u64, RuntimeError> {
        // A zero-byte region still gets an address.
        let len = usize::try_from(bytes.max(1)).map_err(|_| RuntimeError::TooLarge(format!("{bytes} bytes")))?;
        // SAFETY: a plain allocation, freed in Drop.
        let ptr = unsafe { drv::malloc_sync(len) }.map_err(|e| {
            RuntimeError::TooLarge(format!(
                "the {what} needs {bytes} bytes of GPU memory and the allocation failed ({e:?}) on {}",
                self.gpu.name
            ))
        })?;
        self.allocations.push(ptr);
        self.counters.allocations += 1;
        self.counters.allocated_bytes += bytes;
        Ok(ptr)
    }

    fn enqueue(&mut self, r: &Ready) -> Result<(), RuntimeError> {
        match r {
            Ready::Kernel { f, grid, block, params, offsets } => {
                let mut ptrs: Vec<*mut c_void> =
                    offsets.iter().map(|&o| params.as_ptr().wrapping_add(o) as *mut c_void).collect();
                // SAFETY: `f` is a loaded kernel; the parameter buffer was laid out for its
                // declared parameters (checked against the cubins in the tests) and the driver
                // copies it before returning.
                unsafe {
                    drv::launch_kernel(
                        *f,
                        (grid[0], grid[1], grid[2]),
                        (block[0], block[1], block[2]),
                        0,
                        self.stream,
                        &mut ptrs,
                    )
                }
                .map_err(driver("kernel launch"))
            }
            // SAFETY: the handle is live; the operands lie in this device's regions with the plan's
            // leading dims and strides (checked against the tensors in the tests).
            Ready::Gemm { g, operands, arrays } => {
                unsafe { super::blas::gemm(self.blas, g, *operands, *arrays, self.allow_tf32) }
                    .map_err(RuntimeError::Internal)
            }
            // SAFETY: both ranges lie in regions of this device (the plan's sizes).
            Ready::Copy { from, to, bytes } => {
                unsafe { drv::memcpy_dtod_async(*to, *from, *bytes as usize, self.stream) }.map_err(driver("copy"))
            }
            // SAFETY: as above.
            Ready::Fill { to, bytes, byte } => {
                unsafe { drv::memset_d8_async(*to, *byte, *bytes as usize, self.stream) }.map_err(driver("fill"))
            }
            Ready::Conv(c) => c.enqueue().map_err(RuntimeError::Internal),
            Ready::Lt(g) => g.enqueue(self.stream as *mut c_void).map_err(RuntimeError::Internal),
        }
    }

    /// After a synchronisation: whether a launch that reads indices from device memory met one
    /// out of range since the last check (its error word is cleared), as an error naming it.
    fn check_flags(&mut self) -> Result<(), RuntimeError> {
        for (ptr, nodes) in &self.flags {
            let mut words = vec![0i32; nodes.len()];
            // SAFETY: the block holds one i32 per node; the stream is synchronised before use.
            unsafe {
                drv::memcpy_dtoh_async(&mut words, *ptr, self.stream).map_err(driver("reading error words"))?;
                drv::stream::synchronize(self.stream).map_err(driver("synchronising"))?;
            }
            if let Some(i) = words.iter().position(|&w| w != 0) {
                // SAFETY: the same block.
                unsafe { drv::memset_d8_async(*ptr, 0, 4 * nodes.len(), self.stream) }.map_err(driver("fill"))?;
                return Err(RuntimeError::Node {
                    node: nodes[i].clone(),
                    msg: "an index read on the device is out of range for its axis".into(),
                });
            }
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), RuntimeError> {
        // SAFETY: the stream lives as long as the device.
        unsafe { drv::stream::synchronize(self.stream) }.map_err(driver("synchronising"))
    }
}

/// Whether a plan's kernels take the launch's error word.
fn uses_flag(p: &plan::LaunchPlan) -> bool {
    p.kernels().iter().any(|k| k.args.contains(&plan::Arg::Ptr(Buf::Flag)))
}

fn place(regions: &Regions<CudaMemory>, t: &TensorRef) -> Result<u64, RuntimeError> {
    let mem = regions.get(t.region);
    if t.offset + t.bytes() > mem.len {
        return Err(RuntimeError::Internal(format!(
            "a tensor at {}..{} lies outside its region of {} bytes",
            t.offset,
            t.offset + t.bytes(),
            mem.len
        )));
    }
    Ok(mem.ptr + t.offset)
}

impl Device for CudaDevice {
    type Memory = CudaMemory;

    fn caps(&self) -> DeviceCaps {
        let memory = self.options.memory().min(self.gpu.memory_bytes);
        DeviceCaps { name: "cuda", align: 256, memory, fuse: self.options.fuse }
    }

    fn prepare(&mut self, program: &Program, regions: &mut Regions<CudaMemory>) -> Result<(), RuntimeError> {
        self.prepare_program(program, regions)
    }

    fn alloc(&mut self, region: Region, bytes: u64) -> Result<CudaMemory, RuntimeError> {
        self.current()?;
        let what = match region {
            Region::Arena => "activation arena",
            Region::State => "state",
            Region::Constants => "constants",
        };
        let ptr = self.alloc_bytes(bytes, what)?;
        Ok(CudaMemory { ptr, len: bytes })
    }

    fn write(&mut self, mem: &mut CudaMemory, offset: u64, bytes: &[u8]) -> Result<(), RuntimeError> {
        if offset + bytes.len() as u64 > mem.len {
            return Err(RuntimeError::Internal(format!(
                "a write at {offset} of {} bytes overruns its region",
                bytes.len()
            )));
        }
        self.current()?;
        // SAFETY: the range lies in the region; pageable source bytes are staged by the driver
        // before the call returns.
        unsafe { drv::memcpy_htod_async(mem.ptr + offset, bytes, self.stream) }.map_err(driver("write"))?;
        self.counters.host_writes += 1;
        Ok(())
    }

    fn read(&mut self, mem: &mut CudaMemory, offset: u64, len: u64) -> Result<Vec<u8>, RuntimeError> {
        if offset + len > mem.len {
            return Err(RuntimeError::Internal(format!("a read at {offset} of {len} bytes overruns its region")));
        }
        self.current()?;
        let mut out = vec![0u8; len as usize];
        // SAFETY: the range lies in the region and `out` holds `len` bytes; the stream is
        // synchronised before `out` is used.
        unsafe { drv::memcpy_dtoh_async(&mut out, mem.ptr + offset, self.stream) }.map_err(driver("read"))?;
        self.sync()?;
        self.counters.host_reads += 1;
        self.check_flags()?;
        Ok(out)
    }

    type Staged = Staged;

    fn stage(&mut self, mem: &mut CudaMemory, offset: u64, len: u64) -> Result<Staged, RuntimeError> {
        if offset + len > mem.len {
            return Err(RuntimeError::Internal(format!(
                "a staged read at {offset} of {len} bytes overruns its region"
            )));
        }
        self.current()?;
        let len = len as usize;
        let (host, cap) = match self.pinned.iter().position(|&(_, cap)| cap >= len) {
            Some(i) => self.pinned.swap_remove(i),
            None => {
                let cap = len.max(256);
                // SAFETY: pinned host memory, freed in Drop.
                let p = unsafe { drv::malloc_host(cap, 0) }.map_err(driver("pinned allocation"))? as *mut u8;
                self.pinned_all.push(p);
                (p, cap)
            }
        };
        let event = match self.events.pop() {
            Some(e) => e,
            None => drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(driver("event"))?,
        };
        // SAFETY: `host` holds at least `len` bytes and is not read until the event completes.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(host, len);
            drv::memcpy_dtoh_async(dst, mem.ptr + offset, self.stream).map_err(driver("staged read"))?;
            drv::event::record(event, self.stream).map_err(driver("event"))?;
        }
        self.counters.staged += 1;
        Ok(Staged { host, cap, len, event })
    }

    fn fetch(&mut self, s: Staged) -> Result<Vec<u8>, RuntimeError> {
        self.current()?;
        // SAFETY: the event was recorded after the copy into `host`.
        unsafe { drv::event::synchronize(s.event) }.map_err(driver("waiting for a staged read"))?;
        // SAFETY: the copy is complete; `host` holds `len` bytes.
        let out = unsafe { std::slice::from_raw_parts(s.host, s.len) }.to_vec();
        self.pinned.push((s.host, s.cap));
        self.events.push(s.event);
        self.counters.fetches += 1;
        self.check_flags()?;
        Ok(out)
    }

    fn copy(
        &mut self,
        regions: &mut Regions<CudaMemory>,
        from: &TensorRef,
        to: &TensorRef,
    ) -> Result<(), RuntimeError> {
        if from.bytes() != to.bytes() {
            return Err(RuntimeError::Internal("a copy between places of different sizes".into()));
        }
        let (src, dst) = (place(regions, from)?, place(regions, to)?);
        // SAFETY: both ranges lie in this device's regions.
        unsafe { drv::memcpy_dtod_async(dst, src, from.bytes() as usize, self.stream) }.map_err(driver("copy"))?;
        self.counters.copies += 1;
        Ok(())
    }

    fn launch(&mut self, _regions: &mut Regions<CudaMemory>, l: &Launch) -> Result<(), RuntimeError> {
        let key = l as *const Launch as usize;
        let prepared = self.prepared.remove(&key).ok_or_else(|| {
            RuntimeError::Internal(format!("{}: a launch of a program this device did not prepare", l.node))
        })?;
        let result = if prepared.node != l.node {
            Err(RuntimeError::Internal(format!("{}: prepared as {}", l.node, prepared.node)))
        } else {
            prepared.calls.iter().try_for_each(|r| self.enqueue(r))
        };
        self.prepared.insert(key, prepared);
        result?;
        self.counters.launches += 1;
        Ok(())
    }

    fn poison(&mut self, mem: &mut CudaMemory) -> Result<(), RuntimeError> {
        // 0xFF bytes are NaN in f16, bf16, f32 and f64.
        // SAFETY: the whole region.
        unsafe { drv::memset_d8_async(mem.ptr, 0xFF, mem.len as usize, self.stream) }.map_err(driver("poison"))
    }

    fn counters(&self) -> DeviceCounters {
        self.counters
    }

    fn begin_capture(&mut self) -> Result<bool, RuntimeError> {
        if !self.options.capture {
            return Ok(false);
        }
        self.current()?;
        // SAFETY: the stream is live; what is enqueued on it from here is recorded, not run.
        unsafe {
            drv::stream::begin_capture(self.stream, drv_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        }
        .map_err(driver("beginning a capture"))?;
        Ok(true)
    }

    fn end_capture(&mut self) -> Result<u64, RuntimeError> {
        // SAFETY: a capture begun on this stream; the graph is destroyed once instantiated.
        unsafe {
            let graph = drv::stream::end_capture(self.stream).map_err(driver("ending a capture"))?;
            let exec = drv::graph::instantiate(graph, drv_sys::CUgraphInstantiate_flags(0));
            let _ = drv::graph::destroy(graph);
            self.graphs.push(exec.map_err(driver("instantiating a graph"))?);
        }
        Ok(self.graphs.len() as u64 - 1)
    }

    fn replay(&mut self, recording: u64) -> Result<(), RuntimeError> {
        let exec = *self
            .graphs
            .get(recording as usize)
            .ok_or_else(|| RuntimeError::Internal(format!("no recorded step {recording}")))?;
        self.current()?;
        // SAFETY: an instantiated graph of this device's context.
        unsafe { drv::graph::launch(exec, self.stream) }.map_err(driver("replaying a step"))?;
        self.counters.replays += 1;
        Ok(())
    }

    fn mark(&mut self) -> Result<Option<u64>, RuntimeError> {
        self.current()?;
        let id = match self.free_timers.pop() {
            Some(id) => id,
            None => {
                let e = drv::event::create(drv_sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(driver("event"))?;
                self.timers.push(e);
                self.timers.len() as u64 - 1
            }
        };
        // SAFETY: a live event of this context, recorded on the device's stream.
        unsafe { drv::event::record(self.timers[id as usize], self.stream) }.map_err(driver("event"))?;
        Ok(Some(id))
    }

    fn elapsed_ms(&mut self, from: u64, to: u64) -> Result<f64, RuntimeError> {
        let get = |id: u64| {
            self.timers.get(id as usize).copied().ok_or_else(|| RuntimeError::Internal(format!("no mark {id}")))
        };
        let (a, b) = (get(from)?, get(to)?);
        self.current()?;
        // SAFETY: both events were recorded on this device's stream.
        let ms = unsafe {
            drv::event::synchronize(b).map_err(driver("waiting for a mark"))?;
            drv::event::elapsed(a, b).map_err(driver("timing"))?
        };
        self.free_timers.extend([from, to]);
        Ok(ms as f64)
    }

    fn memory_in_use(&self) -> Option<u64> {
        self.current().ok()?;
        let (free, total) = drv::mem_get_info().ok()?;
        Some((total - free) as u64)
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // SAFETY: everything freed here was made by this device, once; errors cannot be
        // reported from Drop and leave nothing to undo.
        unsafe {
            let _ = drv::ctx::set_current(self.ctx);
            let _ = drv::stream::synchronize(self.stream);
            for &p in &self.allocations {
                let _ = drv::free_sync(p);
            }
            for &p in &self.pinned_all {
                let _ = drv::free_host(p as *mut c_void);
            }
            for &e in &self.events {
                let _ = drv::event::destroy(e);
            }
            for &g in &self.graphs {
                let _ = drv::graph::exec_destroy(g);
            }
            for &e in &self.timers {
                let _ = drv::event::destroy(e);
            }
            for &m in self.modules.values() {
                let _ = drv::module::unload(m);
            }
            // cuDNN's descriptors, then its handle, while the context lives.
            self.prepared.clear();
            self.dnn = Err(String::new());
            self.lt = Err(String::new());
            let _ = blas::destroy_handle(self.blas);
            let _ = drv::stream::destroy(self.stream);
            let _ = drv::primary_ctx::release(self.dev);
        }
    }
}
