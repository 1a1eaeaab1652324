// kernels/reduce.cu: reductions over one axis extent, deterministic (fixed-order trees, no
// atomics): sum, mean, max, min, prod, sum_square, l1, l2, log_sum, log_sum_exp, argmax, argmin; and
// Einsum (at the end of the file).
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
//
// The host permutes/merges axes so that the input is a contiguous (outer, reduced, inner) array:
// element (o, r, i) is at x[(o * reduced + r) * inner + i], and output (o, i) at y[o * inner + i].
// (Reducing several axes at once: make them adjacent with a transpose copy, then merge them.)
// Floats accumulate in f32 (f64 for f64); integers in i64.
//
// ---- Kernel shapes (every kind has `rows` and `cols`; the simple kinds also `split`/`finish`) ----
// rows:   reduce_<kind>_rows_<T>(const T* x, T* y, long long outer, long long reduced, long long inner)
//         One block per output (grid-stride over the outer*inner outputs with blockIdx.x), the
//         block's threads stride over `reduced`, then a fixed-order block reduction.
//         blockDim.x = 256 (a multiple of 32, <= 256), gridDim.x = min(outer*inner, 65535).
//         Best when inner == 1 (contiguous rows).
// cols:   reduce_<kind>_cols_<T>(const T* x, T* y, long long outer, long long reduced, long long inner)
//         blockDim = (32, 8): threadIdx.x walks 32 consecutive inner positions (coalesced),
//         threadIdx.y the reduced index modulo 8; the 8 partials are combined in order.
//         gridDim.x = ceil(inner / 32), gridDim.y = min(outer, 65535) (grid-stride over outer).
//         Best when inner >= 32.
// split:  reduce_<kind>_split_<T>(const T* x, C* part, long long outer, long long reduced,
//                                  long long inner, long long splits)
//         First pass of a two-pass reduction for long rows: block b (grid-stride over
//         outer*inner*splits) reduces r in [s*chunk, min(reduced, (s+1)*chunk)), chunk =
//         ceil(reduced / splits), for output o*inner+i = b / splits, s = b % splits, into
//         part[b] (C = float, or double for f64; not finalised). blockDim.x = 256.
// cols_split: reduce_<kind>_cols_split_<T>(const T* x, C* part, long long outer, long long reduced,
//                                  long long inner, long long splits)
//         First pass for few, long columns (a bias gradient: rows of a (tokens, features)
//         matrix summed): blockDim = (32, 8) as cols; gridDim.x = ceil(inner / 32), block y
//         (grid-stride over outer*splits) is (o, s) = (y / splits, y % splits) and reduces r in
//         [s*chunk, min(reduced, (s+1)*chunk)) of 32 columns into part[(o*inner+i)*splits + s],
//         which `finish` then combines (nout = outer*inner).
// finish: reduce_<kind>_finish_<T>(const C* part, T* y, long long nout, long long splits,
//                                   long long reduced)
//         Second pass: one block per output combines part[out*splits .. +splits) in a fixed
//         order and finalises (mean divides by `reduced`, l2 takes the root). blockDim.x = 256
//         (or 32 for few splits).
// kinds and dtypes:
//   sum, max, min, prod:              f32 f16 bf16 f64 i64 i32 (rows, cols, split, cols_split, finish)
//   max, min:                         also u8 (bool too: its bytes are 0 and 1), saturating
//   mean, sum_square, l1, l2, log_sum: f32 f16 bf16 f64         (rows, cols, split, cols_split, finish)
//   log_sum_exp:                      f32 f16 bf16 f64          (rows, cols)
//   argmax, argmin:                   f32 f16 bf16 f64          (rows, cols) with
//       reduce_arg{max,min}_{rows,cols}_<T>(const T* x, long long* y, long long outer,
//                                           long long reduced, long long inner, int select_last)
//       first (or, with select_last, last) index of the extreme value; NaNs are skipped, except
//       that a NaN at index 0 gives 0 (the CPU reference's scan); an empty extent gives 0.
// Semantics as the CPU reference: max/min propagate NaN; an empty extent gives the identity
// (0, 1 for prod, -inf/+inf for max/min; i32 max/min saturate to INT_MIN/INT_MAX); mean of an
// empty extent is 0; log_sum_exp = log(sum(exp(x - m))) + m with m the NaN-ignoring max (0 where
// that is infinite).
// Output dtype = input dtype except argmax/argmin (i64). i32 results saturate to the i32 range.

// ---- per-dtype load/store in the accumulator type ----

template <typename T> struct RT {
    typedef typename Acc<T>::type C;
    __device__ static C load(const T* p, long long i) { return ld(p, i); }
    __device__ static void store(T* p, long long i, C v) { st(p, i, v); }
};
template <> struct RT<long long> {
    typedef long long C;
    __device__ static C load(const long long* p, long long i) { return p[i]; }
    __device__ static void store(long long* p, long long i, C v) { p[i] = v; }
};
template <> struct RT<int> {
    typedef long long C;
    __device__ static C load(const int* p, long long i) { return p[i]; }
    __device__ static void store(int* p, long long i, C v) {
        p[i] = v > 2147483647LL ? 2147483647 : (v < -2147483648LL ? (-2147483647 - 1) : (int)v);
    }
};

// u8 (and bool, stored as a 0/1 byte): max and min only; results saturate to [0, 255].
template <> struct RT<unsigned char> {
    typedef long long C;
    __device__ static C load(const unsigned char* p, long long i) { return p[i]; }
    __device__ static void store(unsigned char* p, long long i, C v) {
        p[i] = v > 255 ? 255 : (v < 0 ? 0 : (unsigned char)v);
    }
};

__device__ __forceinline__ long long max_nan(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long min_nan(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long lowest(long long) { return -0x7fffffffffffffffLL - 1; }
__device__ __forceinline__ long long highest(long long) { return 0x7fffffffffffffffLL; }
__device__ __forceinline__ float lowest(float v) { return -m_inf(v); }
__device__ __forceinline__ float highest(float v) { return m_inf(v); }
__device__ __forceinline__ double lowest(double v) { return -m_inf(v); }
__device__ __forceinline__ double highest(double v) { return m_inf(v); }

// ---- the simple kinds: map each element, combine with an associative op, finalise ----

struct K_sum {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};
struct K_mean {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long n) { return a / (C)(n > 0 ? n : 1); }
};
struct K_sum_square {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return x * x; }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};
struct K_l1 {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return m_abs(x); }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};
struct K_l2 {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return x * x; }
    template <typename C> __device__ static C fin(C a, long long) { return m_sqrt(a); }
};
struct K_log_sum {
    typedef OpSum Op;
    template <typename C> __device__ static C id() { return C(0); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long) { return m_log(a); }
};
struct K_prod {
    typedef OpProd Op;
    template <typename C> __device__ static C id() { return C(1); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};
struct OpMaxR {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return max_nan(a, b); }
};
struct OpMinR {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return min_nan(a, b); }
};
struct K_max {
    typedef OpMaxR Op;
    template <typename C> __device__ static C id() { return lowest(C(0)); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};
struct K_min {
    typedef OpMinR Op;
    template <typename C> __device__ static C id() { return highest(C(0)); }
    template <typename C> __device__ static C map(C x) { return x; }
    template <typename C> __device__ static C fin(C a, long long) { return a; }
};

template <typename T, typename K>
__device__ __forceinline__ void rows_body(const T* __restrict__ x, T* __restrict__ y, long long outer,
                                          long long reduced, long long inner) {
    typedef typename RT<T>::C C;
    __shared__ C smem[32];
    typename K::Op op;
    const long long nout = outer * inner;
    for (long long out = blockIdx.x; out < nout; out += gridDim.x) {
        const long long o = out / inner, i = out % inner;
        const long long base = o * reduced * inner + i;
        C a = K::template id<C>();
        for (long long r = threadIdx.x; r < reduced; r += blockDim.x)
            a = op(a, K::map(RT<T>::load(x, base + r * inner)));
        a = block_reduce(a, op, smem);
        if (threadIdx.x == 0) RT<T>::store(y, out, K::fin(a, reduced));
    }
}

template <typename T, typename K>
__device__ __forceinline__ void cols_body(const T* __restrict__ x, T* __restrict__ y, long long outer,
                                          long long reduced, long long inner) {
    typedef typename RT<T>::C C;
    __shared__ C smem[8][33];
    typename K::Op op;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * 32 + tx;
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        C a = K::template id<C>();
        if (i < inner) {
            const long long base = o * reduced * inner + i;
            for (long long r = ty; r < reduced; r += 8) a = op(a, K::map(RT<T>::load(x, base + r * inner)));
        }
        smem[ty][tx] = a;
        __syncthreads();
        if (ty == 0 && i < inner) {
            C s = smem[0][tx];
#pragma unroll
            for (int k = 1; k < 8; ++k) s = op(s, smem[k][tx]);
            RT<T>::store(y, o * inner + i, K::fin(s, reduced));
        }
        __syncthreads();
    }
}

template <typename T, typename K>
__device__ __forceinline__ void split_body(const T* __restrict__ x, typename RT<T>::C* __restrict__ part,
                                           long long outer, long long reduced, long long inner, long long splits) {
    typedef typename RT<T>::C C;
    __shared__ C smem[32];
    typename K::Op op;
    const long long nblocks = outer * inner * splits;
    const long long chunk = (reduced + splits - 1) / splits;
    for (long long b = blockIdx.x; b < nblocks; b += gridDim.x) {
        const long long out = b / splits, s = b % splits;
        const long long o = out / inner, i = out % inner;
        const long long base = o * reduced * inner + i;
        const long long r0 = s * chunk;
        const long long r1 = r0 + chunk < reduced ? r0 + chunk : reduced;
        C a = K::template id<C>();
        for (long long r = r0 + threadIdx.x; r < r1; r += blockDim.x)
            a = op(a, K::map(RT<T>::load(x, base + r * inner)));
        a = block_reduce(a, op, smem);
        if (threadIdx.x == 0) part[b] = a;
    }
}

template <typename T, typename K>
__device__ __forceinline__ void cols_split_body(const T* __restrict__ x, typename RT<T>::C* __restrict__ part,
                                                long long outer, long long reduced, long long inner, long long splits) {
    typedef typename RT<T>::C C;
    __shared__ C smem[8][33];
    typename K::Op op;
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * 32 + tx;
    const long long chunk = (reduced + splits - 1) / splits;
    for (long long b = blockIdx.y; b < outer * splits; b += gridDim.y) {
        const long long o = b / splits, s = b % splits;
        const long long r0 = s * chunk;
        const long long r1 = r0 + chunk < reduced ? r0 + chunk : reduced;
        C a = K::template id<C>();
        if (i < inner) {
            const long long base = o * reduced * inner + i;
            for (long long r = r0 + ty; r < r1; r += 8) a = op(a, K::map(RT<T>::load(x, base + r * inner)));
        }
        smem[ty][tx] = a;
        __syncthreads();
        if (ty == 0 && i < inner) {
            C t = smem[0][tx];
#pragma unroll
            for (int k = 1; k < 8; ++k) t = op(t, smem[k][tx]);
            part[(o * inner + i) * splits + s] = t;
        }
        __syncthreads();
    }
}

template <typename T, typename K>
__device__ __forceinline__ void finish_body(const typename RT<T>::C* __restrict__ part, T* __restrict__ y,
                                            long long nout, long long splits, long long reduced) {
    typedef typename RT<T>::C C;
    __shared__ C smem[32];
    typename K::Op op;
    for (long long out = blockIdx.x; out < nout; out += gridDim.x) {
        C a = K::template id<C>();
        for (long long s = threadIdx.x; s < splits; s += blockDim.x) a = op(a, part[out * splits + s]);
        a = block_reduce(a, op, smem);
        if (threadIdx.x == 0) RT<T>::store(y, out, K::fin(a, reduced));
    }
}

#define REDUCE_T(kind, T, tag)                                                                          \
    MPC_KERNEL reduce_##kind##_rows_##tag(const T* x, T* y, long long outer, long long reduced, long long inner) { \
        rows_body<T, K_##kind>(x, y, outer, reduced, inner);                                            \
    }                                                                                                   \
    MPC_KERNEL reduce_##kind##_cols_##tag(const T* x, T* y, long long outer, long long reduced, long long inner) { \
        cols_body<T, K_##kind>(x, y, outer, reduced, inner);                                            \
    }                                                                                                   \
    MPC_KERNEL reduce_##kind##_split_##tag(const T* x, RT<T>::C* part, long long outer, long long reduced, \
                                           long long inner, long long splits) {                         \
        split_body<T, K_##kind>(x, part, outer, reduced, inner, splits);                                \
    }                                                                                                   \
    MPC_KERNEL reduce_##kind##_cols_split_##tag(const T* x, RT<T>::C* part, long long outer, long long reduced, \
                                                long long inner, long long splits) {                    \
        cols_split_body<T, K_##kind>(x, part, outer, reduced, inner, splits);                           \
    }                                                                                                   \
    MPC_KERNEL reduce_##kind##_finish_##tag(const RT<T>::C* part, T* y, long long nout, long long splits, \
                                            long long reduced) {                                        \
        finish_body<T, K_##kind>(part, y, nout, splits, reduced);                                       \
    }
#define REDUCE_F(kind)                   \
    REDUCE_T(kind, float, f32)           \
    REDUCE_T(kind, __half, f16)          \
    REDUCE_T(kind, __nv_bfloat16, bf16)  \
    REDUCE_T(kind, double, f64)
#define REDUCE_FI(kind)                  \
    REDUCE_F(kind)                       \
    REDUCE_T(kind, long long, i64)       \
    REDUCE_T(kind, int, i32)

REDUCE_FI(sum)
REDUCE_FI(max)
REDUCE_FI(min)
REDUCE_FI(prod)
REDUCE_T(max, unsigned char, u8)
REDUCE_T(min, unsigned char, u8)
REDUCE_F(mean)
REDUCE_F(sum_square)
REDUCE_F(l1)
REDUCE_F(l2)
REDUCE_F(log_sum)

// ---- log-sum-exp: a NaN-ignoring max, then sum(exp(x - m)) ----

struct OpFmax {
    template <typename C> __device__ __forceinline__ C operator()(C a, C b) const { return m_fmax(a, b); }
};

template <typename T>
__device__ __forceinline__ void lse_rows_body(const T* __restrict__ x, T* __restrict__ y, long long outer,
                                              long long reduced, long long inner) {
    typedef typename Acc<T>::type C;
    __shared__ C smem[32];
    const long long nout = outer * inner;
    for (long long out = blockIdx.x; out < nout; out += gridDim.x) {
        const long long o = out / inner, i = out % inner;
        const long long base = o * reduced * inner + i;
        C m = -m_inf(C(0));
        for (long long r = threadIdx.x; r < reduced; r += blockDim.x) m = m_fmax(m, ld(x, base + r * inner));
        m = block_reduce(m, OpFmax(), smem);
        // Shifted by the maximum where it is finite: an infinite one (+inf, or -inf alone) would
        // make inf - inf a NaN; unshifted the sum gives inf and log(0) = -inf as they should be.
        m = (m - m == C(0)) ? m : C(0);
        C s = C(0);
        for (long long r = threadIdx.x; r < reduced; r += blockDim.x) s += m_exp(ld(x, base + r * inner) - m);
        s = block_reduce(s, OpSum(), smem);
        if (threadIdx.x == 0) st(y, out, m_log(s) + m);
    }
}

template <typename T>
__device__ __forceinline__ void lse_cols_body(const T* __restrict__ x, T* __restrict__ y, long long outer,
                                              long long reduced, long long inner) {
    typedef typename Acc<T>::type C;
    __shared__ C smem[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * 32 + tx;
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long base = o * reduced * inner + i;
        C m = -m_inf(C(0));
        if (i < inner)
            for (long long r = ty; r < reduced; r += 8) m = m_fmax(m, ld(x, base + r * inner));
        smem[ty][tx] = m;
        __syncthreads();
        m = smem[0][tx];
#pragma unroll
        for (int k = 1; k < 8; ++k) m = m_fmax(m, smem[k][tx]);
        __syncthreads();
        m = (m - m == C(0)) ? m : C(0);  // an infinite maximum does not shift (as lse_rows_body)
        C s = C(0);
        if (i < inner)
            for (long long r = ty; r < reduced; r += 8) s += m_exp(ld(x, base + r * inner) - m);
        smem[ty][tx] = s;
        __syncthreads();
        if (ty == 0 && i < inner) {
            C t = smem[0][tx];
#pragma unroll
            for (int k = 1; k < 8; ++k) t += smem[k][tx];
            st(y, o * inner + i, m_log(t) + m);
        }
        __syncthreads();
    }
}

#define LSE_T(T, tag)                                                                                   \
    MPC_KERNEL reduce_log_sum_exp_rows_##tag(const T* x, T* y, long long outer, long long reduced,      \
                                             long long inner) {                                         \
        lse_rows_body<T>(x, y, outer, reduced, inner);                                                  \
    }                                                                                                   \
    MPC_KERNEL reduce_log_sum_exp_cols_##tag(const T* x, T* y, long long outer, long long reduced,      \
                                             long long inner) {                                         \
        lse_cols_body<T>(x, y, outer, reduced, inner);                                                  \
    }
LSE_T(float, f32)
LSE_T(__half, f16)
LSE_T(__nv_bfloat16, bf16)
LSE_T(double, f64)

// ---- argmax / argmin: (value, index) pairs, NaN skipped, ties by index ----

// Whether candidate (v, i) beats (bv, bi): a larger (smaller for argmin) value, or an equal value
// at a smaller (larger with select_last) index. An index of -1 marks "no candidate yet".
template <typename C>
__device__ __forceinline__ bool arg_better(C v, long long i, C bv, long long bi, bool is_min, bool last) {
    if (i < 0) return false;
    if (bi < 0) return true;
    if (v == bv) return last ? i > bi : i < bi;
    return is_min ? v < bv : v > bv;
}

template <typename C>
__device__ __forceinline__ void arg_warp(C& v, long long& i, bool is_min, bool last) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        C ov = __shfl_down_sync(0xffffffffu, v, off);
        long long oi = __shfl_down_sync(0xffffffffu, i, off);
        if (arg_better(ov, oi, v, i, is_min, last)) {
            v = ov;
            i = oi;
        }
    }
}

template <typename T>
__device__ __forceinline__ void arg_rows_body(const T* __restrict__ x, long long* __restrict__ y, long long outer,
                                              long long reduced, long long inner, bool is_min, bool last) {
    typedef typename Acc<T>::type C;
    __shared__ C sv[32];
    __shared__ long long si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const long long nout = outer * inner;
    for (long long out = blockIdx.x; out < nout; out += gridDim.x) {
        const long long o = out / inner, i = out % inner;
        const long long base = o * reduced * inner + i;
        C bv = C(0);
        long long bi = -1;
        for (long long r = threadIdx.x; r < reduced; r += blockDim.x) {
            C v = ld(x, base + r * inner);
            if (!m_isnan(v) && arg_better(v, r, bv, bi, is_min, last)) {
                bv = v;
                bi = r;
            }
        }
        arg_warp(bv, bi, is_min, last);
        __syncthreads();
        if (lane == 0) {
            sv[warp] = bv;
            si[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            C v = lane < nwarps ? sv[lane] : C(0);
            long long k = lane < nwarps ? si[lane] : -1;
            arg_warp(v, k, is_min, last);
            if (lane == 0) {
                if (k < 0 || (reduced > 0 && m_isnan(ld(x, base)))) k = 0;
                y[out] = k;
            }
        }
    }
}

template <typename T>
__device__ __forceinline__ void arg_cols_body(const T* __restrict__ x, long long* __restrict__ y, long long outer,
                                              long long reduced, long long inner, bool is_min, bool last) {
    typedef typename Acc<T>::type C;
    __shared__ C sv[8][33];
    __shared__ long long si[8][33];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long i = (long long)blockIdx.x * 32 + tx;
    for (long long o = blockIdx.y; o < outer; o += gridDim.y) {
        const long long base = o * reduced * inner + i;
        C bv = C(0);
        long long bi = -1;
        if (i < inner)
            for (long long r = ty; r < reduced; r += 8) {
                C v = ld(x, base + r * inner);
                if (!m_isnan(v) && arg_better(v, r, bv, bi, is_min, last)) {
                    bv = v;
                    bi = r;
                }
            }
        sv[ty][tx] = bv;
        si[ty][tx] = bi;
        __syncthreads();
        if (ty == 0 && i < inner) {
            for (int k = 1; k < 8; ++k)
                if (arg_better(sv[k][tx], si[k][tx], bv, bi, is_min, last)) {
                    bv = sv[k][tx];
                    bi = si[k][tx];
                }
            if (bi < 0 || (reduced > 0 && m_isnan(ld(x, base)))) bi = 0;
            y[o * inner + i] = bi;
        }
        __syncthreads();
    }
}

#define ARG_T(T, tag)                                                                                   \
    MPC_KERNEL reduce_argmax_rows_##tag(const T* x, long long* y, long long outer, long long reduced,   \
                                        long long inner, int select_last) {                             \
        arg_rows_body<T>(x, y, outer, reduced, inner, false, select_last != 0);                         \
    }                                                                                                   \
    MPC_KERNEL reduce_argmin_rows_##tag(const T* x, long long* y, long long outer, long long reduced,   \
                                        long long inner, int select_last) {                             \
        arg_rows_body<T>(x, y, outer, reduced, inner, true, select_last != 0);                          \
    }                                                                                                   \
    MPC_KERNEL reduce_argmax_cols_##tag(const T* x, long long* y, long long outer, long long reduced,   \
                                        long long inner, int select_last) {                             \
        arg_cols_body<T>(x, y, outer, reduced, inner, false, select_last != 0);                         \
    }                                                                                                   \
    MPC_KERNEL reduce_argmin_cols_##tag(const T* x, long long* y, long long outer, long long reduced,   \
                                        long long inner, int select_last) {                             \
        arg_cols_body<T>(x, y, outer, reduced, inner, true, select_last != 0);                          \
    }
ARG_T(float, f32)
ARG_T(__half, f16)
ARG_T(__nv_bfloat16, bf16)
ARG_T(double, f64)

// ---------------------------------------------------------------- Einsum
//
// reduce_einsum_<T>(const T* a, const T* b, const T* c, T* y, long long n_out, long long inner,
//                   int nops, int nletters, int nout, Dims8 sizes, Strides8 sa, Strides8 sb,
//                   Strides8 sc)
//     T in f32 f16 bf16 f64. An Einsum of 1 to 3 operands (b, c unused past nops) as the CPU
//     reference computes it (runtime/src/cpu/extra.rs): the letters are the output's nout first,
//     then the summed ones, each of sizes[l] elements; operand k reads element sum_l coord_l *
//     s_k[l] (0 for a letter it lacks, the sum of both strides for a letter it repeats). One
//     thread per output element: y[o] = sum over the `inner` summed coordinates (row-major, the
//     last letter fastest) of the operands' product, in f64, rounded through f32 on store (f64
//     stays f64). n_out = prod of the output letters' sizes, inner = prod of the others'.
template <typename T>
__device__ __forceinline__ void einsum_body(const T* a, const T* b, const T* c, T* y, long long n_out, long long inner,
                                            int nops, int nletters, int nout, const Dims8& sizes, const Strides8& sa,
                                            const Strides8& sb, const Strides8& sc) {
    MPC_GRID_STRIDE(o, n_out) {
        long long ba = 0, bb = 0, bc = 0, lin = o;
#pragma unroll
        for (int l = MPC_MAX_RANK - 1; l >= 0; --l) {
            if (l < nout) {
                const long long q = lin / sizes.d[l], x = lin - q * sizes.d[l];
                lin = q;
                ba += x * sa.s[l];
                bb += x * sb.s[l];
                bc += x * sc.s[l];
            }
        }
        double acc = 0.0;
        for (long long k = 0; k < inner; ++k) {
            long long oa = ba, ob = bb, oc = bc, rest = k;
#pragma unroll
            for (int l = MPC_MAX_RANK - 1; l >= 0; --l) {
                if (l >= nout && l < nletters) {
                    const long long q = rest / sizes.d[l], x = rest - q * sizes.d[l];
                    rest = q;
                    oa += x * sa.s[l];
                    ob += x * sb.s[l];
                    oc += x * sc.s[l];
                }
            }
            double p = (double)ld(a, oa);
            if (nops > 1) p *= (double)ld(b, ob);
            if (nops > 2) p *= (double)ld(c, oc);
            acc += p;
        }
        st(y, o, (typename Acc<T>::type)acc);
    }
}
#define EINSUM_T(T, tag)                                                                                   \
    MPC_KERNEL reduce_einsum_##tag(const T* a, const T* b, const T* c, T* y, long long n_out, long long inner, \
                                   int nops, int nletters, int nout, Dims8 sizes, Strides8 sa, Strides8 sb, \
                                   Strides8 sc) {                                                          \
        einsum_body(a, b, c, y, n_out, inner, nops, nletters, nout, sizes, sa, sb, sc);                    \
    }
EINSUM_T(float, f32)
EINSUM_T(__half, f16)
EINSUM_T(__nv_bfloat16, bf16)
EINSUM_T(double, f64)
