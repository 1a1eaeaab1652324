//! Matrix products through cuBLAS: a plan's [`Gemm`] as one strided-batched `cublasGemmEx`, or
//! one `cublasGemmBatchedEx` over arrays of addresses (FP32 accumulation for f16 and bf16; f32
//! stays f32 unless TF32 is allowed).

use std::ffi::c_void;

use cudarc::cublas::{result as blas, sys};
use mpc_ir::DType;

use super::plan::Gemm;

/// Enqueues `g` on `handle`'s stream, with its operands at `a`, `b` and `c`, or (`arrays`) the
/// addresses of its matrices in three device arrays.
///
/// # Safety
/// `handle` is a live cuBLAS handle, and `a`, `b` and `c` are device addresses of operands laid
/// out as `g` says (leading dims, strides and batch), or `arrays` hold `g.batch` addresses of such
/// matrices each, in memory that outlives the work.
pub unsafe fn gemm(
    handle: sys::cublasHandle_t,
    g: &Gemm,
    [a, b, c]: [u64; 3],
    arrays: Option<[u64; 3]>,
    allow_tf32: bool,
) -> Result<(), String> {
    use sys::cublasComputeType_t as Compute;
    use sys::cudaDataType_t as Ty;
    let (ty, compute) = match g.dtype {
        DType::F32 if allow_tf32 => (Ty::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F_FAST_TF32),
        DType::F32 => (Ty::CUDA_R_32F, Compute::CUBLAS_COMPUTE_32F),
        DType::F16 => (Ty::CUDA_R_16F, Compute::CUBLAS_COMPUTE_32F),
        DType::BF16 => (Ty::CUDA_R_16BF, Compute::CUBLAS_COMPUTE_32F),
        DType::F64 => (Ty::CUDA_R_64F, Compute::CUBLAS_COMPUTE_64F),
        d => return Err(format!("a GEMM of {d}")),
    };
    // f16/bf16 operands may leave an f32 result.
    let c_ty = match (g.dtype, g.c_dtype) {
        (a, c) if a == c => ty,
        (DType::F16 | DType::BF16, DType::F32) => Ty::CUDA_R_32F,
        (a, c) => return Err(format!("a GEMM of {a} into {c}")),
    };
    let op = |t: bool| {
        if t {
            sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (a32, b32) = (g.alpha as f32, g.beta as f32);
    let (alpha, beta): (*const c_void, *const c_void) = if g.dtype == DType::F64 {
        (&g.alpha as *const f64 as _, &g.beta as *const f64 as _)
    } else {
        (&a32 as *const f32 as _, &b32 as *const f32 as _)
    };
    let int = |v: i64| i32::try_from(v).map_err(|_| format!("a GEMM dim of {v}"));
    if let Some([pa, pb, pc]) = arrays {
        // SAFETY: the caller's promise; alpha and beta are read before the call returns.
        return unsafe {
            sys::cublasGemmBatchedEx(
                handle,
                op(g.trans_a),
                op(g.trans_b),
                int(g.m)?,
                int(g.n)?,
                int(g.k)?,
                alpha,
                pa as *const *const c_void,
                ty,
                int(g.lda)?,
                pb as *const *const c_void,
                ty,
                int(g.ldb)?,
                beta,
                pc as *const *mut c_void,
                c_ty,
                int(g.ldc)?,
                int(g.batch)?,
                compute,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(|e| format!("cuBLAS batched GEMM: {e:?}"));
    }
    // SAFETY: the caller's promise; alpha and beta are read before the call returns (host
    // pointer mode).
    unsafe {
        blas::gemm_strided_batched_ex(
            handle,
            op(g.trans_a),
            op(g.trans_b),
            int(g.m)?,
            int(g.n)?,
            int(g.k)?,
            alpha,
            a as *const c_void,
            ty,
            int(g.lda)?,
            g.stride_a,
            b as *const c_void,
            ty,
            int(g.ldb)?,
            g.stride_b,
            beta,
            c as *mut c_void,
            c_ty,
            int(g.ldc)?,
            g.stride_c,
            int(g.batch)?,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| format!("cuBLAS GEMM: {e:?}"))
}
