//! Convolutions through cuDNN (the legacy convolution API, loaded at run time like cuBLAS).
//!
//! A [`DnnConv`] of a plan becomes, when a program is prepared, descriptors and an algorithm per
//! operation: chosen by cuDNN's heuristics (`cudnnGet*Algorithm_v7`) among those that are
//! deterministic (two runs give the same bits, as every other launch here; unless
//! `MPC_CUDNN_DETERMINISTIC=0`, [`deterministic_only`]) and need at most
//! [`WORKSPACE_LIMIT`] bytes of scratch: the first, unless its scratch misses both the arena
//! bytes free during its launch and [`SCRATCH_BUDGET`] and a later one fits ([`choose`]). A step only enqueues the calls. Where cuDNN is missing
//! (`libcudnn.so.9` not found), turned off (`MPC_CUDNN=0`), or refuses one convolution, the
//! device runs the plan's fallback for it instead.

use std::ffi::c_void;

use cudarc::cudnn::sys;
use mpc_ir::DType;

use super::plan::{DnnConv, DnnOp};

/// The most scratch one convolution's algorithm may use.
pub const WORKSPACE_LIMIT: usize = 512 << 20;

/// The scratch a convolution's algorithm may take beyond the arena bytes free during its launch
/// before a later-ranked algorithm that fits gives way to it ([`choose`]): scratch that misses
/// the free bytes lies in the program's one workspace, which lasts as long as the program.
pub const SCRATCH_BUDGET: usize = 64 << 20;

/// Which of the ranked algorithms (their scratch bytes, fastest first by cuDNN's heuristics) a
/// convolution takes, given `budget` bytes that cost no memory of their own: the first, unless
/// it needs more, and a later one fits; `None` for none.
pub fn choose(ranked: &[usize], budget: usize) -> Option<usize> {
    match ranked.first() {
        Some(&first) if first > budget => Some(ranked.iter().position(|&m| m <= budget).unwrap_or(0)),
        Some(_) => Some(0),
        None => None,
    }
}

/// A cuDNN handle bound to the device's stream.
pub struct Dnn {
    handle: sys::cudnnHandle_t,
    /// Convolutions take deterministic algorithms only (off: cuDNN's first-ranked may sum with
    /// atomics, as PyTorch's default; to measure what determinism costs).
    deterministic: bool,
}

/// Why cuDNN is not used under `options`.
pub fn unavailable(options: &crate::device::DeviceOptions) -> Option<String> {
    if !options.cudnn {
        return Some("turned off (MPC_CUDNN=0)".into());
    }
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Some("libcudnn.so.9 was not found".into());
    }
    None
}

fn check(what: &str, s: sys::cudnnStatus_t) -> Result<(), String> {
    if s == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("cuDNN {what}: {s:?}"))
    }
}

impl Dnn {
    /// A handle on `stream`, or why not.
    pub fn new(stream: *mut c_void, options: &crate::device::DeviceOptions) -> Result<Dnn, String> {
        if let Some(why) = unavailable(options) {
            return Err(why);
        }
        // SAFETY: the library is present; cudnnGetVersion exists in every version.
        let version = unsafe { sys::cudnnGetVersion() };
        if version < 90000 {
            return Err(format!("cuDNN {version} was found; mpc calls cuDNN 9"));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: the library is present (checked above); `handle` receives a new handle, which
        // is destroyed in Drop.
        unsafe { check("create", sys::cudnnCreate(&mut handle))? };
        let dnn = Dnn { handle, deterministic: options.cudnn_deterministic };
        // SAFETY: both are live; the stream outlives the handle (the device drops it first).
        unsafe { check("set stream", sys::cudnnSetStream(dnn.handle, stream as _))? };
        Ok(dnn)
    }

    /// The descriptors and algorithms of `conv`, with the operands' addresses; `Err` (why) where
    /// cuDNN does not take it, and the fallback runs. Each operation's algorithm is [`choose`]n
    /// with `budget` bytes of scratch.
    pub fn prepare(
        &self,
        conv: &DnnConv,
        allow_tf32: bool,
        budget: usize,
        resolve: &dyn Fn(super::plan::Buf) -> u64,
    ) -> Result<Ready, String> {
        let ty = match conv.dtype {
            DType::F32 => sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
            DType::F16 => sys::cudnnDataType_t::CUDNN_DATA_HALF,
            DType::BF16 => sys::cudnnDataType_t::CUDNN_DATA_BFLOAT16,
            d => return Err(format!("{d} data")),
        };
        let math = match conv.dtype {
            DType::F32 if allow_tf32 => sys::cudnnMathType_t::CUDNN_DEFAULT_MATH,
            // f32 stays f32: no TF32 tensor cores.
            DType::F32 => sys::cudnnMathType_t::CUDNN_FMA_MATH,
            _ => sys::cudnnMathType_t::CUDNN_TENSOR_OP_MATH,
        };
        let int = |v: i64| i32::try_from(v).map_err(|_| format!("a dim of {v}"));
        let dims = |d: [i64; 4]| -> Result<[i32; 4], String> { Ok([int(d[0])?, int(d[1])?, int(d[2])?, int(d[3])?]) };
        let (x, w, y) = (dims(conv.x)?, dims(conv.w)?, dims(conv.y)?);
        let mut r = Ready {
            handle: self.handle,
            x: std::ptr::null_mut(),
            w: std::ptr::null_mut(),
            y: std::ptr::null_mut(),
            conv: std::ptr::null_mut(),
            ops: Vec::new(),
            workspace: 0,
            workspace_bytes: 0,
        };
        // SAFETY: descriptors are created into `r` (destroyed by its Drop, also on an early
        // return) and set from arrays of the lengths given.
        unsafe {
            check("tensor descriptor", sys::cudnnCreateTensorDescriptor(&mut r.x))?;
            check("tensor descriptor", sys::cudnnCreateTensorDescriptor(&mut r.y))?;
            check("filter descriptor", sys::cudnnCreateFilterDescriptor(&mut r.w))?;
            check("convolution descriptor", sys::cudnnCreateConvolutionDescriptor(&mut r.conv))?;
            let packed = |d: [i32; 4]| [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1];
            check("X", sys::cudnnSetTensorNdDescriptor(r.x, ty, 4, x.as_ptr(), packed(x).as_ptr()))?;
            check("Y", sys::cudnnSetTensorNdDescriptor(r.y, ty, 4, y.as_ptr(), packed(y).as_ptr()))?;
            check(
                "W",
                sys::cudnnSetFilterNdDescriptor(r.w, ty, sys::cudnnTensorFormat_t::CUDNN_TENSOR_NCHW, 4, w.as_ptr()),
            )?;
            let (pads, strides, dil) = (
                [int(conv.pads[0])?, int(conv.pads[1])?],
                [int(conv.strides[0])?, int(conv.strides[1])?],
                [int(conv.dilations[0])?, int(conv.dilations[1])?],
            );
            check(
                "convolution",
                sys::cudnnSetConvolutionNdDescriptor(
                    r.conv,
                    2,
                    pads.as_ptr(),
                    strides.as_ptr(),
                    dil.as_ptr(),
                    sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                    sys::cudnnDataType_t::CUDNN_DATA_FLOAT,
                ),
            )?;
            check("groups", sys::cudnnSetConvolutionGroupCount(r.conv, int(conv.groups)?))?;
            check("math type", sys::cudnnSetConvolutionMathType(r.conv, math))?;
            // cuDNN's idea of Y's shape must be the plan's.
            let mut out = [0i32; 4];
            check("output shape", sys::cudnnGetConvolutionNdForwardOutputDim(r.conv, r.x, r.w, 4, out.as_mut_ptr()))?;
            if out != y {
                return Err(format!("cuDNN makes Y {out:?} where the plan has {y:?}"));
            }
        }
        for op in &conv.ops {
            let (algo, bytes) = self.algorithm(&r, op, budget, |m| math_fits(conv.dtype, allow_tf32, m))?;
            r.workspace_bytes = r.workspace_bytes.max(bytes);
            r.ops.push((algo, op.buffers().map(resolve)));
        }
        Ok(r)
    }

    /// Among the deterministic algorithms cuDNN's heuristics rank for `op` within the workspace
    /// limit and whose math `math` takes, the one [`choose`] takes for `budget`, and its scratch
    /// bytes.
    fn algorithm(
        &self,
        r: &Ready,
        op: &DnnOp,
        budget: usize,
        math: impl Fn(sys::cudnnMathType_t) -> bool,
    ) -> Result<(Algo, usize), String> {
        const N: usize = 16;
        let det = sys::cudnnDeterminism_t::CUDNN_DETERMINISTIC;
        let any = !self.deterministic;
        let ok = sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS;
        let mut count = 0i32;
        // Asks cuDNN's heuristics (`$get` over the descriptors `$descs`) for up to N ranked
        // results of type `$perf`, and takes the one `choose` picks of those that suit, as `$algo`.
        macro_rules! first_suitable {
            ($perf:ty, $get:ident, $what:literal, [$($descs:expr),*], $algo:path) => {{
                // SAFETY: the descriptors are set; the array holds N results (zeroed: every
                // field's zero is a valid value) and cuDNN writes at most N.
                let mut perf: [$perf; N] = unsafe { std::mem::zeroed() };
                check($what, unsafe { sys::$get(self.handle, $($descs),*, N as i32, &mut count, perf.as_mut_ptr()) })?;
                let suit: Vec<&$perf> = perf[..count.clamp(0, N as i32) as usize]
                    .iter()
                    .filter(|p| p.status == ok && (any || p.determinism == det))
                    .filter(|p| p.memory <= WORKSPACE_LIMIT && math(p.mathType))
                    .collect();
                let memory: Vec<usize> = suit.iter().map(|p| p.memory).collect();
                choose(&memory, budget).map(|i| ($algo(suit[i].algo, suit[i].mathType), suit[i].memory))
            }};
        }
        let found = match op {
            DnnOp::Forward { .. } => first_suitable!(
                sys::cudnnConvolutionFwdAlgoPerf_t,
                cudnnGetConvolutionForwardAlgorithm_v7,
                "forward algorithm",
                [r.x, r.w, r.conv, r.y],
                Algo::Forward
            ),
            DnnOp::BackwardData { .. } => first_suitable!(
                sys::cudnnConvolutionBwdDataAlgoPerf_t,
                cudnnGetConvolutionBackwardDataAlgorithm_v7,
                "backward-data algorithm",
                [r.w, r.y, r.conv, r.x],
                Algo::BackwardData
            ),
            DnnOp::BackwardFilter { .. } => first_suitable!(
                sys::cudnnConvolutionBwdFilterAlgoPerf_t,
                cudnnGetConvolutionBackwardFilterAlgorithm_v7,
                "backward-filter algorithm",
                [r.x, r.y, r.conv, r.w],
                Algo::BackwardFilter
            ),
        };
        let kind = if any { "" } else { "deterministic " };
        found.ok_or_else(|| format!("no {kind}algorithm within {WORKSPACE_LIMIT} bytes of scratch"))
    }
}

impl Drop for Dnn {
    fn drop(&mut self) {
        // SAFETY: the handle was made in `new`, once.
        unsafe {
            let _ = sys::cudnnDestroy(self.handle);
        }
    }
}

/// Whether an algorithm of math type `m` may run a convolution of `dtype`: f32 without TF32
/// takes only FMA kernels (f32 stays f32, as for matrix products).
fn math_fits(dtype: DType, allow_tf32: bool, m: sys::cudnnMathType_t) -> bool {
    dtype != DType::F32 || allow_tf32 || m == sys::cudnnMathType_t::CUDNN_FMA_MATH
}

/// An operation's algorithm, with the math type cuDNN ranked it under (set on the descriptor
/// before the call, as cuDNN's heuristics assume).
#[derive(Clone, Copy, Debug)]
enum Algo {
    Forward(sys::cudnnConvolutionFwdAlgo_t, sys::cudnnMathType_t),
    BackwardData(sys::cudnnConvolutionBwdDataAlgo_t, sys::cudnnMathType_t),
    BackwardFilter(sys::cudnnConvolutionBwdFilterAlgo_t, sys::cudnnMathType_t),
}

/// One prepared convolution: descriptors, and per operation its algorithm and addresses.
pub struct Ready {
    handle: sys::cudnnHandle_t,
    x: sys::cudnnTensorDescriptor_t,
    w: sys::cudnnFilterDescriptor_t,
    y: sys::cudnnTensorDescriptor_t,
    conv: sys::cudnnConvolutionDescriptor_t,
    ops: Vec<(Algo, [u64; 3])>,
    /// The scratch the device lends it, and how much it needs.
    pub workspace: u64,
    pub workspace_bytes: usize,
}

impl Ready {
    /// Enqueues the operations on the handle's stream.
    pub fn enqueue(&self) -> Result<(), String> {
        let (one, zero) = (1f32, 0f32);
        let (alpha, beta) = (&one as *const f32 as *const c_void, &zero as *const f32 as *const c_void);
        let ws = self.workspace as *mut c_void;
        for &(algo, [a, b, out]) in &self.ops {
            let math = match algo {
                Algo::Forward(_, m) | Algo::BackwardData(_, m) | Algo::BackwardFilter(_, m) => m,
            };
            // SAFETY: the descriptors were set in `prepare` and describe the operands at these
            // addresses (the plan's shapes, in this device's regions); the workspace holds
            // `workspace_bytes`; the algorithm came from cuDNN for this operation; alpha and beta
            // are read before the call returns.
            unsafe {
                check("math type", sys::cudnnSetConvolutionMathType(self.conv, math))?;
                match algo {
                    Algo::Forward(algo, _) => check(
                        "forward",
                        sys::cudnnConvolutionForward(
                            self.handle,
                            alpha,
                            self.x,
                            a as *const c_void,
                            self.w,
                            b as *const c_void,
                            self.conv,
                            algo,
                            ws,
                            self.workspace_bytes,
                            beta,
                            self.y,
                            out as *mut c_void,
                        ),
                    )?,
                    Algo::BackwardData(algo, _) => check(
                        "backward data",
                        sys::cudnnConvolutionBackwardData(
                            self.handle,
                            alpha,
                            self.w,
                            a as *const c_void,
                            self.y,
                            b as *const c_void,
                            self.conv,
                            algo,
                            ws,
                            self.workspace_bytes,
                            beta,
                            self.x,
                            out as *mut c_void,
                        ),
                    )?,
                    Algo::BackwardFilter(algo, _) => check(
                        "backward filter",
                        sys::cudnnConvolutionBackwardFilter(
                            self.handle,
                            alpha,
                            self.x,
                            a as *const c_void,
                            self.y,
                            b as *const c_void,
                            self.conv,
                            algo,
                            ws,
                            self.workspace_bytes,
                            beta,
                            self.w,
                            out as *mut c_void,
                        ),
                    )?,
                }
            }
        }
        Ok(())
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        // SAFETY: each descriptor not null was created once in `prepare`.
        unsafe {
            for d in [self.x, self.y] {
                if !d.is_null() {
                    let _ = sys::cudnnDestroyTensorDescriptor(d);
                }
            }
            if !self.w.is_null() {
                let _ = sys::cudnnDestroyFilterDescriptor(self.w);
            }
            if !self.conv.is_null() {
                let _ = sys::cudnnDestroyConvolutionDescriptor(self.conv);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::choose;

    #[test]
    fn the_fastest_algorithm_gives_way_only_to_one_that_fits_the_budget() {
        // The first fits: taken, whatever follows.
        assert_eq!(choose(&[10, 0, 5], 10), Some(0));
        // The first misses the budget: the first later one that fits.
        assert_eq!(choose(&[300, 200, 8, 0], 64), Some(2));
        // None fits: the fastest still.
        assert_eq!(choose(&[300, 200], 64), Some(0));
        assert_eq!(choose(&[], 64), None);
    }
}
