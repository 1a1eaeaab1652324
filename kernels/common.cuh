// kernels/common.cuh: helpers shared by every kernel family of the CUDA backend.
//
// This file is never #included by path. The host builds each NVRTC program as
//     "#line 1 \"common.cuh\"\n" + <this file> + "\n#line 1 \"<family>.cu\"\n" + <family file>
// (the #line directives make NVRTC messages name the right file and line), names the program
// `<family>.cu` (elementwise.cu, reduce.cu, ...), and compiles it with
//     --gpu-architecture=sm_XX -std=c++17 --fmad=false [-I<dir holding cuda_fp16.h and cuda_bf16.h>]
// to a cubin for the device's exact architecture (no --use_fast_math: denormals are kept and the
// math functions are the accurate ones). `kernels/check_nvrtc.py` compiles every family the same
// way for sm_80 and sm_90.
//
// Conventions shared by all families:
// - Every kernel is `extern "C" __global__`, named `<family>_<op>_<dtype>`, and declared with
//   `__launch_bounds__(MPC_BLOCK, 1)`: at most 256 threads per block (MPC_BLOCK). Kernels that
//   reduce within a block need blockDim.x a multiple of 32 in [32, 256], blockDim.y = .z = 1
//   (unless a kernel's comment says otherwise). A block reduction's rounding depends on
//   blockDim.x, so results are bit-identical from run to run for a fixed launch configuration;
//   the host should always use the block size the kernel comment recommends.
// - Element-wise kernels use grid-stride loops, so any grid size is correct; the host picks
//   grid = min(ceil(n / 256), 65535 * k) or similar.
// - dtype tags: f32 = float, f16 = __half, bf16 = __nv_bfloat16, f64 = double, i64 = long long,
//   i32 = int, i8 = signed char, u8 = unsigned char, bool = unsigned char holding 0 or 1.
//   Pure data movement is typed by element size: b1, b2, b4, b8 move 1-, 2-, 4-, 8-byte elements
//   of any dtype bit for bit.
// - FP16/BF16 are storage only: loaded to f32, computed in f32, rounded to nearest even once on
//   store. f64 computes in f64. Sums accumulate in f32 (f64 for f64) in a fixed order.
// - No float atomics anywhere, no dynamic allocation, no printf.
// - Counts, offsets and indices are 64-bit (`long long`). Shapes and strides (in elements, not
//   bytes) are passed by value in the POD structs below; unused trailing entries are ignored.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define MPC_BLOCK 256
#define MPC_MAX_RANK 8
// (256, 1): at most 256 threads per block; the explicit minimum of one block per SM keeps ptxas
// from capping registers for occupancy (with the bound alone, ptxas 13.0 spilled at 32 registers).
#define MPC_KERNEL extern "C" __global__ void __launch_bounds__(MPC_BLOCK, 1)

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef signed char i8;
typedef __half f16;
typedef __nv_bfloat16 bf16;

// Up to 8 dims / strides; a host fills them from a resolved descriptor (`#[repr(C)] struct
// Dims8 { d: [i64; 8] }` and the same for Strides8). Entries past `rank` are ignored.
struct Dims8 {
    long long d[MPC_MAX_RANK];
};
struct Strides8 {
    long long s[MPC_MAX_RANK];
};
// Up to 3 spatial dims of a convolution or pooling window. `nsp` is the number of spatial dims
// (1..3); entries past it are ignored. Pads are the begin pads (the end pads only matter to the
// output size, which the host computes, and to count_include_pad: see pool.cu).
struct Window3 {
    long long in[3];       // input spatial sizes
    long long out[3];      // output spatial sizes
    long long k[3];        // kernel sizes
    long long stride[3];
    long long dil[3];
    long long pad[3];      // begin pads
    long long pad_end[3];  // end pads
    int nsp;
    int _unused;
};

#define MPC_GRID_STRIDE(i, n)                                                       \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

// ---- loads and stores: T in storage, f32 (f64 for double) in registers ----

__device__ __forceinline__ float ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float ld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ double ld(const double* p, long long i) { return p[i]; }

__device__ __forceinline__ void st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void st(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void st(double* p, long long i, double v) { p[i] = v; }

// The compute type of a storage type.
template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };
template <typename T> using AccT = typename Acc<T>::type;

// A value rounded through storage type T (what a store then a load gives).
template <typename T> __device__ __forceinline__ typename Acc<T>::type round_to(typename Acc<T>::type v) { return v; }
template <> __device__ __forceinline__ float round_to<__half>(float v) { return __half2float(__float2half_rn(v)); }
template <> __device__ __forceinline__ float round_to<__nv_bfloat16>(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}

// ---- f64 to narrow floats without double rounding ----

// `v` as f32, an inexact result replaced by its odd neighbour on v's side ("round to odd"):
// rounding that to f16/bf16 then rounds as v itself would. Matches mpc_ir's f16_from_f64.
__device__ __forceinline__ float f32_round_odd(double v) {
    float f = __double2float_rn(v);
    if (isinf(f) || isnan(f) || (double)f == v) return f;
    unsigned int b = __float_as_uint(f);
    if (b & 1u) return f;
    return __uint_as_float(fabs(v) > fabs((double)f) ? b + 1u : b - 1u);
}
__device__ __forceinline__ __half f16_from_f64(double v) { return __float2half_rn(f32_round_odd(v)); }
__device__ __forceinline__ __nv_bfloat16 bf16_from_f64(double v) { return __float2bfloat16_rn(f32_round_odd(v)); }

// ---- math in the compute type (overloads for f32 and f64) ----

__device__ __forceinline__ float m_exp(float x) { return expf(x); }
__device__ __forceinline__ double m_exp(double x) { return exp(x); }
__device__ __forceinline__ float m_log(float x) { return logf(x); }
__device__ __forceinline__ double m_log(double x) { return log(x); }
__device__ __forceinline__ float m_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double m_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float m_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double m_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float m_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double m_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float m_erf(float x) { return erff(x); }
__device__ __forceinline__ double m_erf(double x) { return erf(x); }
__device__ __forceinline__ float m_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double m_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ float m_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double m_abs(double x) { return fabs(x); }
__device__ __forceinline__ float m_sin(float x) { return sinf(x); }
__device__ __forceinline__ double m_sin(double x) { return sin(x); }
__device__ __forceinline__ float m_cos(float x) { return cosf(x); }
__device__ __forceinline__ double m_cos(double x) { return cos(x); }
#define M_TRIG(name)                                                                   \
    __device__ __forceinline__ float m_##name(float x) { return name##f(x); }         \
    __device__ __forceinline__ double m_##name(double x) { return name(x); }
M_TRIG(tan)
M_TRIG(sinh)
M_TRIG(cosh)
M_TRIG(asin)
M_TRIG(acos)
M_TRIG(atan)
M_TRIG(asinh)
M_TRIG(acosh)
M_TRIG(atanh)
__device__ __forceinline__ float m_floor(float x) { return floorf(x); }
__device__ __forceinline__ double m_floor(double x) { return floor(x); }
__device__ __forceinline__ float m_ceil(float x) { return ceilf(x); }
__device__ __forceinline__ double m_ceil(double x) { return ceil(x); }
__device__ __forceinline__ float m_rint(float x) { return rintf(x); }  // half to even
__device__ __forceinline__ double m_rint(double x) { return rint(x); }
__device__ __forceinline__ float m_fmod(float x, float y) { return fmodf(x, y); }
__device__ __forceinline__ double m_fmod(double x, double y) { return fmod(x, y); }
__device__ __forceinline__ float m_fmax(float x, float y) { return fmaxf(x, y); }  // NaN-ignoring
__device__ __forceinline__ double m_fmax(double x, double y) { return fmax(x, y); }
__device__ __forceinline__ float m_fmin(float x, float y) { return fminf(x, y); }
__device__ __forceinline__ double m_fmin(double x, double y) { return fmin(x, y); }
__device__ __forceinline__ bool m_isnan(float x) { return x != x; }
__device__ __forceinline__ bool m_isnan(double x) { return x != x; }
__device__ __forceinline__ float m_inf(float) { return __int_as_float(0x7f800000); }
__device__ __forceinline__ double m_inf(double) { return __longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ float m_nan(float) { return __int_as_float(0x7fc00000); }
__device__ __forceinline__ double m_nan(double) { return __longlong_as_double(0x7ff8000000000000LL); }

// max/min as the CPU reference computes them: NaN if either is NaN.
template <typename C> __device__ __forceinline__ C max_nan(C a, C b) {
    return (m_isnan(a) || m_isnan(b)) ? m_nan(a) : (a > b ? a : b);
}
template <typename C> __device__ __forceinline__ C min_nan(C a, C b) {
    return (m_isnan(a) || m_isnan(b)) ? m_nan(a) : (a < b ? a : b);
}

// ---- V elements at once: p + i aligned to their V * sizeof(T) bytes (8, or whole 16-byte
// units), widened as ld widens them (ldv) or rounded as st rounds them (stv). One wide access
// keeps several elements in flight per thread, where one of 2 or 4 bytes leaves a memory-bound
// kernel far below the bandwidth.
template <int V, typename T> __device__ __forceinline__ void ldv(const T* p, long long i, AccT<T>* out) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 8 || B % 16 == 0, "8 bytes or whole 16-byte units");
    if constexpr (B == 8) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p + i);
        const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int q = 0; q < V; ++q) out[q] = ld(t, q);
    } else {
        constexpr int per = 16 / (int)sizeof(T);
#pragma unroll
        for (int h = 0; h < B / 16; ++h) {
            const uint4 raw = *reinterpret_cast<const uint4*>(p + i + h * per);
            const T* t = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int q = 0; q < per; ++q) out[h * per + q] = ld(t, q);
        }
    }
}
template <int V, typename T> __device__ __forceinline__ void stv(T* p, long long i, const AccT<T>* v) {
    constexpr int B = V * (int)sizeof(T);
    static_assert(B == 8 || B % 16 == 0, "8 bytes or whole 16-byte units");
    if constexpr (B == 8) {
        uint2 raw;
        T* t = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int q = 0; q < V; ++q) st(t, q, v[q]);
        *reinterpret_cast<uint2*>(p + i) = raw;
    } else {
        constexpr int per = 16 / (int)sizeof(T);
#pragma unroll
        for (int h = 0; h < B / 16; ++h) {
            uint4 raw;
            T* t = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int q = 0; q < per; ++q) st(t, q, v[h * per + q]);
            *reinterpret_cast<uint4*>(p + i + h * per) = raw;
        }
    }
}

// ---- index helpers ----

// lin / n for 0 <= lin and 0 < n, in 32 bits where both fit (a 64-bit division is a long
// software routine on the GPU; every index of a tensor under 2^32 elements takes the short one).
__device__ __forceinline__ long long index_div(long long lin, long long n) {
    if (((unsigned long long)lin | (unsigned long long)n) >> 32 == 0) return (unsigned int)lin / (unsigned int)n;
    return lin / n;
}

// q = a / b and r = a % b for 0 <= a and 0 < b, as index_div divides.
__device__ __forceinline__ void index_divmod(long long a, long long b, long long& q, long long& r) {
    q = index_div(a, b);
    r = a - q * b;
}

// a % b for 0 <= a and 0 < b, with no division where a < b (a layer norm's scale over its row).
__device__ __forceinline__ long long index_mod(long long a, long long b) { return a < b ? a : a - index_div(a, b) * b; }

// The offset of the element with row-major linear index `lin` over `dims[0..rank)`, for strides
// `s` (in elements). The loops are unrolled over all 8 slots so that the structs are indexed with
// constants and stay in the parameter bank (a runtime index would copy them to local memory).
// The host merges dims that every operand steps over as one, so rank is often 1 (a scalar or
// row broadcast), which needs no division at all.
__device__ __forceinline__ long long strided_offset(long long lin, int rank, const Dims8& dims, const Strides8& s) {
    if (rank == 1) return lin * s.s[0];
    long long off = 0;
#pragma unroll
    for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
        if (d < rank) {
            const long long n = dims.d[d];
            const long long q = index_div(lin, n);
            off += (lin - q * n) * s.s[d];
            lin = q;
        }
    }
    return off;
}

// The same for two and three operands at once (one division chain).
__device__ __forceinline__ void strided_offset2(long long lin, int rank, const Dims8& dims, const Strides8& sa,
                                                const Strides8& sb, long long& oa, long long& ob) {
    if (rank == 1) {
        oa = lin * sa.s[0];
        ob = lin * sb.s[0];
        return;
    }
    oa = 0;
    ob = 0;
#pragma unroll
    for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
        if (d < rank) {
            const long long n = dims.d[d];
            const long long q = index_div(lin, n);
            const long long c = lin - q * n;
            lin = q;
            oa += c * sa.s[d];
            ob += c * sb.s[d];
        }
    }
}
__device__ __forceinline__ void strided_offset3(long long lin, int rank, const Dims8& dims, const Strides8& sa,
                                                const Strides8& sb, const Strides8& sc, long long& oa, long long& ob,
                                                long long& oc) {
    if (rank == 1) {
        oa = lin * sa.s[0];
        ob = lin * sb.s[0];
        oc = lin * sc.s[0];
        return;
    }
    oa = 0;
    ob = 0;
    oc = 0;
#pragma unroll
    for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
        if (d < rank) {
            const long long n = dims.d[d];
            const long long q = index_div(lin, n);
            const long long c = lin - q * n;
            lin = q;
            oa += c * sa.s[d];
            ob += c * sb.s[d];
            oc += c * sc.s[d];
        }
    }
}

// ---- fixed-order block reduction (no atomics) ----
//
// Every thread of the block must call it with the same `op` (blockDim.x a multiple of 32, at
// most 1024, blockDim.y = .z = 1). Each warp reduces with shuffles in a fixed tree, warp results
// go through `smem` (32 slots of C) and warp 0 reduces them in the same fixed tree; the result
// is returned to every thread. The order depends only on blockDim.x, so it is repeatable.
struct OpSum {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return a + b; }
};
struct OpProd {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return a * b; }
};
struct OpMaxNan {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return max_nan(a, b); }
};
struct OpMinNan {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return min_nan(a, b); }
};
struct OpMaxInt {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return a > b ? a : b; }
};
struct OpMinInt {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return a < b ? a : b; }
};

template <typename C, typename Op> __device__ __forceinline__ C warp_reduce(C v, Op op) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, off));
    return v;
}

template <typename C, typename Op> __device__ C block_reduce(C v, Op op, C* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();  // smem may still be read from a previous call
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        // Lanes past the warp count hold a copy of slot 0 and are never combined in.
        C w = smem[lane < nwarps ? lane : 0];
        for (int off = 16; off > 0; off >>= 1) {
            C o = __shfl_down_sync(0xffffffffu, w, off);
            if (lane + off < nwarps) w = op(w, o);
        }
        __syncwarp();  // every lane has read its slot before lane 0 overwrites slot 0
        if (lane == 0) smem[0] = w;
    }
    __syncthreads();
    return smem[0];
}

// Two values reduced together with the same op (mean and mean of squares, and so on).
template <typename C, typename Op> __device__ void block_reduce2(C& a, C& b, Op op, C* smem /* 64 slots */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    a = warp_reduce(a, op);
    b = warp_reduce(b, op);
    __syncthreads();
    if (lane == 0) {
        smem[warp] = a;
        smem[32 + warp] = b;
    }
    __syncthreads();
    if (warp == 0) {
        C x = smem[lane < nwarps ? lane : 0], y = smem[32 + (lane < nwarps ? lane : 0)];
        for (int off = 16; off > 0; off >>= 1) {
            C ox = __shfl_down_sync(0xffffffffu, x, off), oy = __shfl_down_sync(0xffffffffu, y, off);
            if (lane + off < nwarps) {
                x = op(x, ox);
                y = op(y, oy);
            }
        }
        __syncwarp();  // every lane has read its slots before lane 0 overwrites slots 0 and 32
        if (lane == 0) {
            smem[0] = x;
            smem[32] = y;
        }
    }
    __syncthreads();
    a = smem[0];
    b = smem[32];
}

// A value the compiler cannot see through: a fused chain's steps stay separate roundings (no FMA
// contracted from one step's product and the next step's sum), as the unfused kernels' stores
// keep them.
__device__ __forceinline__ float mpc_keep(float v) {
#ifdef MPC_EMULATED
    asm volatile("" : "+x"(v));  // the CPU emulation of the tests (tests/cuda_emu): an SSE register
#else
    asm volatile("" : "+f"(v));
#endif
    return v;
}

// The reduction of a fused chain's softmax (softmax.cu's OpFmaxS).
struct OpFmaxF {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return m_fmax(a, b); }
};

// ---- element-wise formulas: elementwise.cu's kernels and the fused chains the CUDA device
// generates (runtime/src/cuda/fused.rs) compute each op with these, so a chain's step and the
// op's own kernel agree to the bit.

// Unary: U_<op>()(x, alpha, beta) in the compute type C.
#define UOP(name, expr)                                                                            \
    struct U_##name {                                                                              \
        template <typename C> __device__ __forceinline__ C operator()(C x, C alpha, C beta) const { \
            (void)alpha;                                                                           \
            (void)beta;                                                                            \
            return (expr);                                                                         \
        }                                                                                          \
    };

// Every unary op of mpc_ir::ops::Unary, by the name Unary::name gives (the Trig ops' too), with
// its formula: X(name, expr). Expanded here into the functors U_<name> and in elementwise.cu into
// the kernels elementwise_<name>_<T>, so an op is added in this one place.
#define MPC_UNARY_OPS(X)                                                                               \
    X(relu, m_isnan(x) ? x : (x > C(0) ? x : C(0)))                                                    \
    X(sigmoid, x >= C(0) ? C(1) / (C(1) + m_exp(-x)) : m_exp(x) / (C(1) + m_exp(x)))                   \
    X(tanh, m_tanh(x))                                                                                 \
    X(exp, m_exp(x))                                                                                   \
    X(log, m_log(x))                                                                                   \
    X(sqrt, m_sqrt(x))                                                                                 \
    X(neg, -x)                                                                                         \
    X(abs, m_abs(x))                                                                                   \
    X(erf, m_erf(x))                                                                                   \
    X(reciprocal, C(1) / x)                                                                            \
    X(floor, m_floor(x))                                                                               \
    X(ceil, m_ceil(x))                                                                                 \
    X(round, m_rint(x))                                                                                \
    X(sign, x > C(0) ? C(1) : (x < C(0) ? C(-1) : x))                                                  \
    X(sin, m_sin(x))                                                                                   \
    X(cos, m_cos(x))                                                                                   \
    X(softplus, x > C(0) ? x + m_log1p(m_exp(-x)) : m_log1p(m_exp(x)))                                 \
    X(mish, x * m_tanh(x > C(0) ? x + m_log1p(m_exp(-x)) : m_log1p(m_exp(x))))                         \
    X(softsign, x / (C(1) + m_abs(x)))                                                                 \
    X(hard_swish, x* max_nan(C(0), min_nan(C(1), x / C(6) + C(0.5))))                                  \
    X(gelu, C(0.5) * x * (C(1) + m_erf(x / C(1.4142135623730951))))                                    \
    X(gelu_tanh, C(0.5) * x * (C(1) + m_tanh(C(0.7978845608028654) * (x + C(0.044715) * x * x * x))))  \
    X(leaky_relu, x < C(0) ? alpha * x : x)                                                            \
    X(elu, x < C(0) ? alpha * (m_exp(x) - C(1)) : x)                                                   \
    X(celu, x > C(0) ? x : alpha * (m_exp(x / alpha) - C(1)))                                          \
    X(tan, m_tan(x))                                                                                   \
    X(sinh, m_sinh(x))                                                                                 \
    X(cosh, m_cosh(x))                                                                                 \
    X(asin, m_asin(x))                                                                                 \
    X(acos, m_acos(x))                                                                                 \
    X(atan, m_atan(x))                                                                                 \
    X(asinh, m_asinh(x))                                                                               \
    X(acosh, m_acosh(x))                                                                               \
    X(atanh, m_atanh(x))                                                                               \
    X(selu, x > C(0) ? beta * x : beta * alpha * (m_exp(x) - C(1)))                                    \
    X(hard_sigmoid, max_nan(C(0), min_nan(C(1), alpha * x + beta)))
MPC_UNARY_OPS(UOP)

// Binary: V_<op>()(x, z) in the compute type C.
#define VOP(name, expr)                                                                           \
    struct V_##name {                                                                             \
        template <typename C> __device__ __forceinline__ C operator()(C x, C z) const { return (expr); } \
    };

VOP(add, x + z)
VOP(relu_grad, z > C(0) ? x : C(0))  // ReluGrad(dy = x, y = z), as train.cu's train_relu_grad
VOP(sub, x - z)
VOP(mul, x* z)
VOP(div, x / z)
VOP(pow, m_pow(x, z))
VOP(min, min_nan(x, z))
VOP(max, max_nan(x, z))
VOP(prelu, x < C(0) ? x * z : x)
VOP(mod, m_fmod(x, z))
VOP(mod_py, (m_fmod(x, z) != C(0) && ((m_fmod(x, z) < C(0)) != (z < C(0)))) ? m_fmod(x, z) + z : m_fmod(x, z))
