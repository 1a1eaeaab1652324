// kernels/softmax.cu: Softmax and LogSoftmax along one axis, and their gradients.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
//
// Layout: the input is a contiguous (outer, n, inner) array and the op runs along the middle
// axis: element k of row (o, i) is at x[(o * n + k) * inner + i]. For the last axis inner = 1
// (rows = outer, cols = n: the fast, coalesced case); for ONNX's axis=1 over (N, C, d...) pass
// outer = N, n = C, inner = prod(d). Outputs have the input's layout.
// Launch: one block per row, grid-stride over the outer*inner rows with blockIdx.x:
//   gridDim.x = min(outer*inner, 65535), blockDim.x a multiple of 32 in [32, 256]: 256 for long
//   rows, 32 (one warp per row) when n <= 1024. The sums' rounding depends on blockDim.x (fixed
//   per launch site: `row_block` in runtime/src/cuda/plan/mod.rs, for these kernels and the fused
//   chains alike).
// Arithmetic in f32 for f32/f16/bf16 (f64 for f64), as the CPU reference: m = max over the row
// (NaN-ignoring, like f32::max), s = sum(exp(x - m)); softmax = exp(x - m) / s, log-softmax =
// (x - m) - log(s).
//
// ABI (T in f32 f16 bf16 f64; y/dx may alias x/dy: every element is read before it is written
// only by the thread that reads it):
//   softmax_softmax_<T>(const T* x, T* y, long long outer, long long n, long long inner)
//   softmax_log_softmax_<T>(const T* x, T* y, long long outer, long long n, long long inner)
//   softmax_softmax_grad_<T>(const T* dy, const T* y, T* dx, long long outer, long long n, long long inner)
//       SoftmaxGrad (ai.mpc): dx = y * (dy - sum_k(dy * y)), y being Softmax's output.
//   softmax_softmax_grad_wide_<DY>_<Y>(const DY* dy, const Y* y, float* dx, long long outer, long long n,
//                                      long long inner)
//       SoftmaxGrad of an f32 softmax whose dy and/or y are read widened from f16 (or bf16):
//       (DY, Y) in (f16, f16), (f16, f32), (f32, f16) and the same with bf16.
//   softmax_log_softmax_grad_<T>(const T* dy, const T* y, T* dx, long long outer, long long n, long long inner)
//       LogSoftmax's gradient: dx = dy - exp(y) * sum_k(dy), y being LogSoftmax's output.

struct OpFmaxS {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return m_fmax(a, b); }
};

template <typename T, bool LOG>
__device__ __forceinline__ void softmax_body(const T* x, T* y, long long outer, long long n, long long inner) {
    typedef typename Acc<T>::type C;
    __shared__ C smem[32];
    const long long rows = outer * inner;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = row / inner, i = row % inner;
        const long long base = o * n * inner + i;
        C m = -m_inf(C(0));
        for (long long k = threadIdx.x; k < n; k += blockDim.x) m = m_fmax(m, ld(x, base + k * inner));
        m = block_reduce(m, OpFmaxS(), smem);
        C s = C(0);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) s += m_exp(ld(x, base + k * inner) - m);
        s = block_reduce(s, OpSum(), smem);
        const C ls = m_log(s);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const C e = ld(x, base + k * inner) - m;
            st(y, base + k * inner, LOG ? e - ls : m_exp(e) / s);
        }
    }
}

// TDY, TY: the dtypes dy and y are read in (T, or f16/bf16 read widened into an f32 gradient).
template <typename TDY, typename TY, typename T, bool LOG>
__device__ __forceinline__ void softmax_grad_body(const TDY* dy, const TY* y, T* dx, long long outer, long long n,
                                                  long long inner) {
    typedef typename Acc<T>::type C;
    __shared__ C smem[32];
    const long long rows = outer * inner;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long o = row / inner, i = row % inner;
        const long long base = o * n * inner + i;
        C s = C(0);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const long long at = base + k * inner;
            s += LOG ? ld(dy, at) : ld(dy, at) * ld(y, at);
        }
        s = block_reduce(s, OpSum(), smem);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const long long at = base + k * inner;
            const C g = ld(dy, at), v = ld(y, at);
            st(dx, at, LOG ? g - m_exp(v) * s : v * (g - s));
        }
    }
}

#define SOFTMAX_T(T, tag)                                                                                  \
    MPC_KERNEL softmax_softmax_##tag(const T* x, T* y, long long outer, long long n, long long inner) {     \
        softmax_body<T, false>(x, y, outer, n, inner);                                                     \
    }                                                                                                      \
    MPC_KERNEL softmax_log_softmax_##tag(const T* x, T* y, long long outer, long long n, long long inner) { \
        softmax_body<T, true>(x, y, outer, n, inner);                                                      \
    }                                                                                                      \
    MPC_KERNEL softmax_softmax_grad_##tag(const T* dy, const T* y, T* dx, long long outer, long long n,    \
                                          long long inner) {                                               \
        softmax_grad_body<T, T, T, false>(dy, y, dx, outer, n, inner);                                     \
    }                                                                                                      \
    MPC_KERNEL softmax_log_softmax_grad_##tag(const T* dy, const T* y, T* dx, long long outer, long long n, \
                                              long long inner) {                                           \
        softmax_grad_body<T, T, T, true>(dy, y, dx, outer, n, inner);                                      \
    }
SOFTMAX_T(float, f32)
SOFTMAX_T(__half, f16)
SOFTMAX_T(__nv_bfloat16, bf16)
SOFTMAX_T(double, f64)
#define SOFTMAX_GRAD_WIDE(TDY, dtag, TY, ytag)                                                             \
    MPC_KERNEL softmax_softmax_grad_wide_##dtag##_##ytag(const TDY* dy, const TY* y, float* dx, long long outer, \
                                                         long long n, long long inner) {                  \
        softmax_grad_body<TDY, TY, float, false>(dy, y, dx, outer, n, inner);                              \
    }
SOFTMAX_GRAD_WIDE(__half, f16, __half, f16)
SOFTMAX_GRAD_WIDE(__half, f16, float, f32)
SOFTMAX_GRAD_WIDE(float, f32, __half, f16)
SOFTMAX_GRAD_WIDE(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
SOFTMAX_GRAD_WIDE(__nv_bfloat16, bf16, float, f32)
SOFTMAX_GRAD_WIDE(float, f32, __nv_bfloat16, bf16)
