//! Preparing a program on the CUDA device: every launch planned, its kernels loaded, cuDNN asked
//! about its convolutions, each launch's scratch placed, and every call's arguments resolved.

use std::collections::HashMap;
use std::ffi::{c_void, CString};

use cudarc::driver::result as drv;

use super::{cuda_error, driver, param_offsets, uses_flag, CudaDevice, CudaMemory, Prepared, Ready};
use crate::cuda::nvrtc;
use crate::cuda::plan::{self, Buf, Call, LtGemm};
use crate::device::Regions;
use crate::program::{Launch, Program, Region, TensorRef};
use crate::RuntimeError;

impl CudaDevice {
    /// [`crate::device::Device::prepare`]: see the module's documentation.
    pub(super) fn prepare_program(
        &mut self,
        program: &Program,
        regions: &mut Regions<CudaMemory>,
    ) -> Result<(), RuntimeError> {
        self.current()?;
        self.masks_written.clear();
        let mut plans = Vec::new();
        self.prepare_launches(&program.launches, program, &mut plans)?;
        self.load_fused(&plans)?;
        let (workspace_bytes, scratch_at) = self.place_scratch(&plans, program, regions);
        let mut aux_bytes = Vec::new();
        let mut aux_at = Vec::with_capacity(plans.len());
        for (_, _, p) in &plans {
            let at = aux_bytes.len().next_multiple_of(256);
            aux_bytes.resize(at, 0);
            aux_bytes.extend_from_slice(&p.aux);
            aux_at.push(at as u64);
        }
        let workspace = if workspace_bytes > 0 { self.alloc_bytes(workspace_bytes, "workspace")? } else { 0 };
        self.counters.workspace_bytes = self.counters.workspace_bytes.max(workspace_bytes);
        // One error word per launch that reads indices on the device, zeroed once.
        let flagged: Vec<String> = plans.iter().filter(|(_, _, p)| uses_flag(p)).map(|(_, n, _)| n.clone()).collect();
        let flags = if flagged.is_empty() {
            0
        } else {
            let ptr = self.alloc_bytes(4 * flagged.len() as u64, "error words")?;
            // SAFETY: the allocation just made.
            unsafe { drv::memset_d8_async(ptr, 0, 4 * flagged.len(), self.stream) }.map_err(driver("fill"))?;
            self.flags.push((ptr, flagged));
            ptr
        };
        let aux = if aux_bytes.is_empty() { 0 } else { self.alloc_bytes(aux_bytes.len() as u64, "launch constants")? };
        // Where each plan's buffers lie: a plan's addresses inside its aux bytes are written
        // before the bytes are uploaded.
        let mut flag_slots = Vec::with_capacity(plans.len());
        let mut slot = 0u64;
        for (_, _, p) in &plans {
            flag_slots.push(flags + 4 * slot);
            slot += uses_flag(p) as u64;
        }
        let arena = regions.get(Region::Arena).ptr;
        let work_at: Vec<u64> = scratch_at.iter().map(|at| at.map_or(workspace, |o| arena + o)).collect();
        let resolve = |b: Buf, aux_base: u64, flag: u64, work: u64| -> u64 {
            match b {
                Buf::Tensor(r, o) => regions.get(r).ptr + o,
                Buf::Work(o) => work + o,
                Buf::Aux(o) => aux + aux_base + o,
                Buf::Flag => flag,
            }
        };
        for ((((_, _, p), &aux_base), &flag), &work) in plans.iter().zip(&aux_at).zip(&flag_slots).zip(&work_at) {
            for &(at, b) in &p.addresses {
                let s = (aux_base + at) as usize;
                aux_bytes[s..s + 8].copy_from_slice(&resolve(b, aux_base, flag, work).to_le_bytes());
            }
        }
        if aux != 0 {
            // SAFETY: `aux` holds aux_bytes.len() bytes; the source is copied before the call
            // returns (pageable memory), and the stream is synchronised below.
            unsafe { drv::memcpy_htod_async(aux, &aux_bytes, self.stream) }.map_err(driver("upload"))?;
        }
        for ((((key, node, p), aux_base), flag), work) in plans.into_iter().zip(aux_at).zip(flag_slots).zip(work_at) {
            let resolve = |b: Buf| resolve(b, aux_base, flag, work);
            let mut calls = Vec::with_capacity(p.calls.len());
            for c in p.calls {
                self.ready(c, &node, &resolve, &mut calls)?;
            }
            self.prepared.insert(key, Prepared { node, calls });
        }
        self.sync()
    }

    /// Asks cuDNN about every convolution of `plans` (queued in `dnn_pending` for `ready`), and
    /// places each plan's scratch: its own, and past it that of the algorithms of a convolution
    /// cuDNN takes or of the fallback of one it refuses (a launch's calls run one after another,
    /// so one range serves both). A plan's scratch lies in arena bytes that no value holds
    /// during its launch (the memory plan says which), costing no memory, where they are enough;
    /// else in the program's workspace. Returns the workspace's bytes and, per plan, the arena
    /// offset of its scratch (`None`: the workspace).
    fn place_scratch(
        &mut self,
        plans: &[(usize, String, plan::LaunchPlan)],
        program: &Program,
        regions: &Regions<CudaMemory>,
    ) -> (u64, Vec<Option<u64>>) {
        self.dnn_pending.clear();
        // Off, every launch's scratch lies in the workspace (to tell a fault of the placement
        // from another's on a GPU).
        let in_arena = self.options.scratch_in_arena;
        let step: HashMap<usize, usize> =
            program.launches.iter().enumerate().map(|(i, l)| (l as *const Launch as usize, i)).collect();
        let tensor = |b: Buf| match b {
            Buf::Tensor(r, o) => Some(regions.get(r).ptr + o),
            _ => None,
        };
        let (mut workspace, mut placed) = (0, Vec::with_capacity(plans.len()));
        for (key, node, p) in plans {
            // A launch inside an `If`'s branch is no step of the program's own: no free bytes.
            let (at, free) = step.get(key).map_or((0, 0), |&i| program.free_during(i));
            // cuDNN's algorithms may take the free bytes past the plan's own scratch, or the budget.
            let budget = (free.saturating_sub(p.library_scratch_at()) as usize).max(crate::cuda::dnn::SCRATCH_BUDGET);
            let mut convs = Vec::new();
            for c in &p.calls {
                let Call::Conv(conv) = c else { continue };
                let prepared = match &self.dnn {
                    Err(why) => Err(why.clone()),
                    Ok(_) if conv.ops.iter().flat_map(|op| op.buffers()).any(|b| tensor(b).is_none()) => {
                        Err("an operand outside the program's regions".to_string())
                    }
                    Ok(dnn) => dnn.prepare(conv, self.allow_tf32, budget, &|b| tensor(b).unwrap_or(0)),
                };
                match &prepared {
                    Ok(r) => {
                        self.counters.dnn_convolutions += 1;
                        convs.push(Some(r.workspace_bytes as u64));
                    }
                    Err(why) => {
                        if self.dnn.is_ok() {
                            self.counters.dnn_fallbacks += 1;
                            if self.dnn_refusals.len() < 16 {
                                self.dnn_refusals.push(format!("{node}: {why}"));
                            }
                        }
                        convs.push(None);
                    }
                }
                // cuDNN's scratch past the plan's own, wherever the plan's scratch lies.
                self.dnn_pending.push_back(prepared.map(|mut r| {
                    r.workspace = p.library_scratch_at();
                    Box::new(r)
                }));
            }
            let need = p.scratch_bytes(&convs);
            if need > 0 && need <= free && in_arena {
                self.counters.scratch_in_arena += 1;
                placed.push(Some(at));
            } else {
                workspace = workspace.max(need);
                placed.push(None);
            }
        }
        (workspace, placed)
    }

    fn prepare_launches(
        &mut self,
        launches: &[Launch],
        program: &Program,
        plans: &mut Vec<(usize, String, plan::LaunchPlan)>,
    ) -> Result<(), RuntimeError> {
        let constant = |t: &TensorRef| program.constant(t);
        for l in launches {
            if let Some(b) = &l.branches {
                self.prepare_launches(&b.then_launches, program, plans)?;
                self.prepare_launches(&b.else_launches, program, plans)?;
                continue;
            }
            let p = plan::plan_with(l, &constant, plan::PlanOptions::from(&self.options))
                .map_err(|msg| RuntimeError::Unsupported { node: l.node.clone(), msg: format!("on cuda: {msg}") })?;
            plans.push((l as *const Launch as usize, l.node.clone(), p));
        }
        Ok(())
    }

    /// The fused chains' kernels of `plans` that are not loaded yet, compiled by NVRTC as one
    /// module (one compile per program, not per chain).
    fn load_fused(&mut self, plans: &[(usize, String, plan::LaunchPlan)]) -> Result<(), RuntimeError> {
        let mut names: Vec<&str> = Vec::new();
        let mut source = String::new();
        for k in plans.iter().flat_map(|(_, _, p)| p.kernels()) {
            if let Some(f) = &k.fused {
                if !self.functions.contains_key(&k.name) && !names.contains(&k.name.as_str()) {
                    names.push(&k.name);
                    source.push_str(&f.source);
                }
            }
        }
        if names.is_empty() {
            return Ok(());
        }
        let compiled =
            nvrtc::compile_with("fused", &source, &self.gpu.arch(), false, self.options.fmad).map_err(cuda_error)?;
        let params =
            crate::cuda::cubin::kernels(&compiled.cubin).map_err(|e| RuntimeError::Internal(format!("fused: {e}")))?;
        self.params.extend(params);
        // SAFETY: a cubin NVRTC made for this device's architecture; it is copied by the driver.
        let module = unsafe { drv::module::load_data(compiled.cubin.as_ptr() as *const c_void) }
            .map_err(driver("loading a module"))?;
        self.modules.insert(format!("fused#{}", self.modules.len()), module);
        for name in names {
            let cname = CString::new(name).map_err(|_| RuntimeError::Internal(format!("kernel name {name}")))?;
            // SAFETY: the module is loaded and stays loaded as long as the device.
            let f = unsafe { drv::module::get_function(module, cname) }
                .map_err(|e| RuntimeError::Internal(format!("fused kernel {name}: {e:?}")))?;
            self.functions.insert(name.to_string(), f);
        }
        Ok(())
    }

    /// `c` with every address resolved, appended to `out`: a convolution as cuDNN calls where
    /// cuDNN takes it, else as its fallback's calls.
    fn ready(
        &mut self,
        c: Call,
        node: &str,
        resolve: &dyn Fn(Buf) -> u64,
        out: &mut Vec<Ready>,
    ) -> Result<(), RuntimeError> {
        out.push(match c {
            Call::Kernel(k) => {
                let f = self.function(&k)?;
                let declared = self
                    .params
                    .get(&k.name)
                    .ok_or_else(|| RuntimeError::Internal(format!("{node}: no parameter layout for {}", k.name)))?;
                plan::check_args(&k.name, &k.args, declared)
                    .map_err(|e| RuntimeError::Internal(format!("{node}: {e}")))?;
                let (offsets, total) = param_offsets(&k.args);
                let mut params = vec![0u8; total];
                for (a, &o) in k.args.iter().zip(&offsets) {
                    let b = a.bytes(resolve);
                    params[o..o + b.len()].copy_from_slice(&b);
                }
                Ready::Kernel { f, grid: k.grid, block: k.block, params, offsets }
            }
            Call::Gemm(g) => Ready::Gemm {
                operands: [resolve(g.a), resolve(g.b), resolve(g.c)],
                arrays: g.pointers.map(|p| p.map(resolve)),
                g,
            },
            Call::Copy { from, to, bytes } => Ready::Copy { from: resolve(from), to: resolve(to), bytes },
            Call::Fill { to, bytes, byte } => Ready::Fill { to: resolve(to), bytes, byte },
            Call::Conv(conv) => match self.dnn_pending.pop_front() {
                Some(Ok(mut ready)) => {
                    ready.workspace = resolve(Buf::Work(ready.workspace));
                    Ready::Conv(ready)
                }
                Some(Err(_)) => {
                    for c in conv.fallback {
                        self.ready(c, node, resolve, out)?;
                    }
                    return Ok(());
                }
                None => return Err(RuntimeError::Internal(format!("{node}: a convolution cuDNN was not asked about"))),
            },
            Call::Lt(g) => {
                // A ReLU's gradient needs the bits its ReLU's product wrote (launches are readied
                // in program order); a ReLU whose bits cuBLASLt cannot write is still a ReLU.
                let mask = g.mask.map(|m| resolve(m.buf));
                let prepared = match &self.lt {
                    Ok(_) if g.relu_grad && !mask.is_some_and(|m| self.masks_written.contains(&m)) => {
                        Err("a ReLU's gradient whose ReLU wrote no mask".to_string())
                    }
                    Ok(lt) => lt.prepare(&g, self.allow_tf32, resolve).or_else(|why| match g.mask {
                        Some(_) if g.relu => {
                            lt.prepare(&LtGemm { mask: None, ..(*g).clone() }, self.allow_tf32, resolve)
                        }
                        _ => Err(why),
                    }),
                    Err(why) => Err(why.clone()),
                };
                match prepared {
                    Ok(r) => {
                        self.counters.lt_gemms += 1;
                        if g.relu && r.writes_mask() {
                            self.masks_written.extend(mask);
                        }
                        Ready::Lt(Box::new(r))
                    }
                    Err(why) => {
                        if self.lt.is_ok() {
                            self.counters.lt_fallbacks += 1;
                            if self.lt_refusals.len() < 16 {
                                self.lt_refusals.push(format!("{node}: {why}"));
                            }
                        }
                        for c in g.fallback {
                            self.ready(c, node, resolve, out)?;
                        }
                        return Ok(());
                    }
                }
            }
        });
        Ok(())
    }
}
