//! Matrix products that finish with a bias and a ReLU (keeping the ReLU's signs as bits where its
//! gradient will need them), that apply a ReLU's gradient from those bits or a GELU's from its
//! input, or that sum a bias gradient as they read it, through cuBLASLt (loaded at run time like
//! cuBLAS).
//!
//! An [`LtGemm`] of a plan becomes, when a program is prepared, a matmul descriptor (transposes,
//! epilogue, bias address), the operands' layouts and cuBLASLt's first heuristic algorithm for
//! them within the shared workspace. A step only enqueues `cublasLtMatmul`. Where cuBLASLt is
//! missing, turned off (`MPC_CUBLASLT=0`), or has no algorithm for one product, the device runs
//! the plan's fallback for it instead (the broadcast bias, a cuBLAS GEMM with beta 1, a ReLU; the
//! GEMM and the ReLU's gradient from the ReLU's output, or the GELU's from its input; or the GEMM
//! and the bias gradient's reduction).

use std::ffi::c_void;

use cudarc::cublaslt::{result as lt, sys};
use mpc_ir::DType;

use super::plan::{Buf, GradOf, LtGemm};

/// A cuBLASLt handle and the scratch its products may use (cuBLAS's: both run on the device's
/// one stream, so never at once).
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: u64,
    workspace_bytes: usize,
}

/// Why cuBLASLt is not used under `options`.
pub fn unavailable(options: &crate::device::DeviceOptions) -> Option<String> {
    if !options.cublaslt {
        return Some("turned off (MPC_CUBLASLT=0)".into());
    }
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        return Some("libcublasLt.so.13 was not found".into());
    }
    None
}

fn check<T>(what: &str, r: Result<T, lt::CublasError>) -> Result<T, String> {
    r.map_err(|e| format!("cuBLASLt {what}: {:?}", e.0))
}

/// The largest power of two (at most 256) that divides `addr`: the alignment cuBLASLt's
/// heuristics must assume of an operand (they assume 256 unless told).
fn alignment(addr: u64) -> u32 {
    1u32 << addr.trailing_zeros().min(8)
}

impl Lt {
    /// A handle whose products use `workspace_bytes` of scratch at `workspace`, or why not.
    pub fn new(workspace: u64, workspace_bytes: usize, options: &crate::device::DeviceOptions) -> Result<Lt, String> {
        if let Some(why) = unavailable(options) {
            return Err(why);
        }
        let handle = check("create", lt::create_handle())?;
        Ok(Lt { handle, workspace, workspace_bytes })
    }

    /// The descriptors and algorithm of `g`, with the operands' addresses; `Err` (why) where
    /// cuBLASLt does not take it, and the fallback runs.
    pub fn prepare(&self, g: &LtGemm, allow_tf32: bool, resolve: &dyn Fn(Buf) -> u64) -> Result<Ready, String> {
        let p = &g.gemm;
        let ty = match (p.dtype, p.c_dtype) {
            (DType::F32, DType::F32) => sys::cudaDataType::CUDA_R_32F,
            (DType::F16, DType::F16) => sys::cudaDataType::CUDA_R_16F,
            (DType::BF16, DType::BF16) => sys::cudaDataType::CUDA_R_16BF,
            (a, c) => return Err(format!("a product of {a} into {c}")),
        };
        let compute = match p.dtype {
            DType::F32 if allow_tf32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        if p.batch != 1 || p.beta != 0.0 {
            return Err(format!("a batch of {} with beta {}", p.batch, p.beta));
        }
        let dim = |v: i64| u64::try_from(v).map_err(|_| format!("a dim of {v}"));
        let (a, b, d) = (resolve(p.a), resolve(p.b), resolve(p.c));
        if g.bgrad.is_some() && (g.bias.is_some() || g.relu || g.relu_grad || g.gelu_grad.is_some()) {
            return Err("a bias gradient with a bias or an activation".into());
        }
        if g.gelu_grad.is_some() && (g.bias.is_some() || g.relu || g.relu_grad) {
            return Err("a GELU's gradient with a bias or a ReLU".into());
        }
        // The GELU's input, of D's layout: its address and leading dim in elements (a multiple
        // of 8, as cuBLASLt asks of an auxiliary matrix's).
        let gelu_input = match g.gelu_grad {
            Some(h) if h.ld >= p.m && h.ld % 8 == 0 => Some((resolve(h.buf), h.ld)),
            Some(h) => return Err(format!("a GELU input of {} elements a column", h.ld)),
            None => None,
        };
        // A ReLU's bit-mask: written by a ReLU (RELU_AUX), read by its gradient (DRELU).
        let mask = match (g.mask, g.relu, g.relu_grad) {
            (_, true, true) => return Err("a ReLU and its gradient in one product".into()),
            (None, _, true) => return Err("a ReLU's gradient without its mask".into()),
            (Some(m), true, _) | (Some(m), _, true) if m.ld % 128 == 0 && m.ld >= p.m => Some((resolve(m.buf), m.ld)),
            (Some(m), true, _) | (Some(m), _, true) => return Err(format!("a ReLU mask of {} bits a column", m.ld)),
            (_, _, false) => None,
        };
        // The bias's address, or the bias gradient's: one attribute holds either.
        let bias = g.bias.or(g.bgrad.map(|(b, _)| b)).map(resolve);
        let mut r = Ready {
            handle: self.handle,
            desc: std::ptr::null_mut(),
            layouts: [std::ptr::null_mut(); 3],
            algo: None,
            operands: [a, b, d],
            alpha: p.alpha as f32,
            workspace: self.workspace,
            workspace_bytes: 0,
            writes_mask: false,
        };
        let stored = |trans: bool, rows: i64, cols: i64| if trans { (cols, rows) } else { (rows, cols) };
        let (ar, ac) = stored(p.trans_a, p.m, p.k);
        let (br, bc) = stored(p.trans_b, p.k, p.n);
        r.layouts = [
            check("layout", lt::create_matrix_layout(ty, dim(ar)?, dim(ac)?, p.lda))?,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        ];
        r.layouts[1] = check("layout", lt::create_matrix_layout(ty, dim(br)?, dim(bc)?, p.ldb))?;
        r.layouts[2] = check("layout", lt::create_matrix_layout(ty, dim(p.m)?, dim(p.n)?, p.ldc))?;
        r.desc = check("descriptor", lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F))?;
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match (g.bias.is_some(), g.relu, g.bgrad.map(|(_, of)| of), mask.is_some()) {
            (_, _, Some(GradOf::A), _) => E::CUBLASLT_EPILOGUE_BGRADA,
            (_, _, Some(GradOf::B), _) => E::CUBLASLT_EPILOGUE_BGRADB,
            _ if g.relu_grad => E::CUBLASLT_EPILOGUE_DRELU,
            _ if gelu_input.is_some() => E::CUBLASLT_EPILOGUE_DGELU,
            (true, true, _, true) => E::CUBLASLT_EPILOGUE_RELU_AUX_BIAS,
            (true, true, _, false) => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            (true, false, _, _) => E::CUBLASLT_EPILOGUE_BIAS,
            (false, true, _, true) => E::CUBLASLT_EPILOGUE_RELU_AUX,
            (false, true, _, false) => E::CUBLASLT_EPILOGUE_RELU,
            (false, false, _, _) => E::CUBLASLT_EPILOGUE_DEFAULT,
        };
        let pref = Pref(check("preference", lt::create_matmul_pref())?);
        use sys::cublasLtMatmulDescAttributes_t as D;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: each attribute is given a value of the type and size cuBLASLt documents for it
        // (int32 transposes, a u32 epilogue, device addresses, an int64 leading dim, a u64 size,
        // u32 alignments); the descriptors are live (destroyed by `r`'s and `pref`'s Drop, also on
        // an early return).
        unsafe {
            let set = |attr: D, v: *const c_void, size: usize| {
                check("descriptor attribute", lt::set_matmul_desc_attribute(r.desc, attr, v, size))
            };
            let (ta, tb) = (p.trans_a as i32, p.trans_b as i32);
            set(D::CUBLASLT_MATMUL_DESC_TRANSA, &ta as *const i32 as _, 4)?;
            set(D::CUBLASLT_MATMUL_DESC_TRANSB, &tb as *const i32 as _, 4)?;
            set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue as *const _ as _, std::mem::size_of_val(&epilogue))?;
            if let Some(bias) = &bias {
                // The bias (or its gradient) is of D's type (cuBLASLt's default for f16, bf16 and
                // f32 results).
                set(D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias as *const u64 as _, 8)?;
            }
            if let Some((at, ld)) = &mask {
                // The bit-mask's address and its leading dim in bits (an int64).
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, at as *const u64 as _, 8)?;
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld as *const i64 as _, 8)?;
            }
            if let Some((at, ld)) = &gelu_input {
                // The GELU's input (of D's type, cuBLASLt's default for the auxiliary matrix of
                // f16, bf16 and f32 results) and its leading dim in elements.
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, at as *const u64 as _, 8)?;
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, ld as *const i64 as _, 8)?;
            }
            let pset = |attr: P, v: *const c_void, size: usize| {
                check("preference attribute", lt::set_matmul_pref_attribute(pref.0, attr, v, size))
            };
            let ws = self.workspace_bytes as u64;
            pset(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as _, 8)?;
            for (attr, addr) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, d),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d),
            ] {
                let align = alignment(addr);
                pset(attr, &align as *const u32 as _, 4)?;
            }
            let h = check(
                "algorithm",
                lt::get_matmul_algo_heuristic(
                    self.handle,
                    r.desc,
                    r.layouts[0],
                    r.layouts[1],
                    r.layouts[2],
                    r.layouts[2],
                    pref.0,
                ),
            )?;
            if h.workspaceSize > self.workspace_bytes {
                return Err(format!("an algorithm that needs {} bytes of scratch", h.workspaceSize));
            }
            r.algo = Some(h.algo);
            r.workspace_bytes = h.workspaceSize;
            r.writes_mask = g.relu && mask.is_some();
        }
        Ok(r)
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: the handle was made in `new`, once.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

/// A preference descriptor, destroyed when the heuristic has read it.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: made once by `create_matmul_pref`.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.0);
        }
    }
}

/// One prepared product: its descriptor, the layouts of A, B and D (C is D, unread: beta 0), the
/// algorithm and the addresses.
pub struct Ready {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: Option<sys::cublasLtMatmulAlgo_t>,
    operands: [u64; 3],
    alpha: f32,
    workspace: u64,
    workspace_bytes: usize,
    writes_mask: bool,
}

impl Ready {
    /// Whether the product writes a ReLU's bit-mask (`RELU_AUX`).
    pub fn writes_mask(&self) -> bool {
        self.writes_mask
    }

    pub fn enqueue(&self, stream: *mut c_void) -> Result<(), String> {
        let algo = self.algo.as_ref().ok_or("cuBLASLt: a product without an algorithm")?;
        let beta = 0f32;
        let [a, b, d] = self.operands;
        // SAFETY: the descriptor and layouts were set in `prepare` for the operands at these
        // addresses (the plan's shapes, in this device's regions) and the algorithm came from
        // cuBLASLt's heuristic for them; the workspace holds `workspace_bytes`; alpha and beta
        // are read before the call returns (host pointer mode).
        unsafe {
            check(
                "matmul",
                lt::matmul(
                    self.handle,
                    self.desc,
                    &self.alpha as *const f32 as *const c_void,
                    &beta as *const f32 as *const c_void,
                    a as *const c_void,
                    self.layouts[0],
                    b as *const c_void,
                    self.layouts[1],
                    d as *const c_void,
                    self.layouts[2],
                    d as *mut c_void,
                    self.layouts[2],
                    algo,
                    self.workspace as *mut c_void,
                    self.workspace_bytes,
                    stream as sys::cudaStream_t,
                ),
            )
        }
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        // SAFETY: each descriptor not null was created once in `prepare`.
        unsafe {
            for &l in &self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;

    #[test]
    fn alignment_is_the_largest_power_of_two_that_divides_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
        assert_eq!(alignment(0x7f00_0000_0180), 128);
    }
}
