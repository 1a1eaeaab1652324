// kernels/movement.cu: data movement: the generic strided copy (Transpose, Expand, Slice with
// steps, Concat parts, Split parts, any view made contiguous), Tile, Pad (constant / reflect /
// edge / wrap), Trilu, fill (ConstantOfShape, zeroing), Range, CumSum, and Resize (nearest and
// linear, at the end of the file).
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loops over the output (CumSum: over its lines), blockDim.x = 256, any
// grid. Movement kernels are typed by element size: b1 b2 b4 b8 copy any dtype of 1, 2, 4, 8
// bytes bit for bit (bool/i8/u8, f16/bf16, f32/i32, f64/i64); movement_copy_b16 moves 16-byte
// units of any dtype (a strided copy of whole rows on 16-byte boundaries).
// Shapes and strides are in elements; pointers are element pointers the host has already offset
// (a Slice's start, a Concat part's place in the output, a negative step's first element).
//
// ABI:
// movement_copy_<b>(const T* x, T* y, long long n, int rank, Dims8 dims, Strides8 xs, Strides8 ys)
//     For every index c over dims[0..rank) (n = prod(dims)): y[sum c_d ys_d] = x[sum c_d xs_d].
//     Strides may be 0 (Expand) or negative (Slice with negative steps). rank = 0: both
//     contiguous, n elements. Transpose: dims = output dims, xs = input strides permuted,
//     ys = output's contiguous strides. Concat: one launch per input, y offset to its part,
//     ys = the full output's strides. The destination elements must be distinct.
// movement_transpose_<b>(const T* x, T* y, long long batch, int rank, Dims8 dims, Strides8 xs, Strides8 ys,
//                        long long rows, long long cols, long long x_col, long long y_row)
//     A strided copy whose input is contiguous along one axis (rows: x stride 1) and whose output
//     is contiguous along another (cols: y stride 1), through 32 x 32 tiles in shared memory so
//     that the reads and the writes are both coalesced (a Transpose that moves the last axis).
//     For each index b over dims[0..rank) (batch = their product; rank 0: one) with offsets
//     (xb, yb) by xs and ys: y[yb + r * y_row + c] = x[xb + r + c * x_col]. Grid (ceil(cols / 32),
//     ceil(rows / 32), up to 65535 batches at once), block (32, 8).
// movement_tile_<b>(const T* x, T* y, long long n, int rank, Dims8 out_dims, Dims8 in_dims, Strides8 xs)
//     y contiguous over out_dims (out_dims[d] = in_dims[d] * repeats[d]);
//     y[c] = x[sum (c_d % in_dims[d]) * xs_d].
// movement_pad_<b>(const T* x, T* y, long long n, int rank, Dims8 out_dims, Dims8 in_dims,
//                  Strides8 xs, Dims8 before, int mode, unsigned long long value)
//     y contiguous over out_dims; input coordinate c_d - before[d] (before may be negative: a
//     crop). mode 0 constant (`value` holds the element's bits in its low bytes, already in x's
//     dtype), 1 reflect (edge when the dim has one element), 2 edge, 3 wrap.
// movement_trilu_<b>(const T* x, T* y, long long n, long long rows, long long cols, long long k, int upper)
//     x, y contiguous (..., rows, cols), n elements; keeps j - i >= k (upper) or j - i <= k
//     (lower), zero bits elsewhere. y may equal x.
// movement_fill_<b>(T* y, long long n, unsigned long long value)
//     y[0..n) = value's low bytes.
// movement_range_<T>(const T* start, const T* delta, T* y, long long n)
//     T in f32 f16 bf16 f64 i64 i32; start and delta are device scalars; n is the host's count.
//     f32: start + (float)i * delta in f32; f16/bf16/f64: start + i * delta in f64, rounded once;
//     integers: start + i * delta (wrapping). (As the CPU reference.)
// movement_cumsum_<T>(const T* x, T* y, long long outer, long long n, long long inner,
//                     int exclusive, int reverse)
//     T in f32 f16 bf16 f64 i64 i32. Along the middle axis of a contiguous (outer, n, inner)
//     array; one thread per line (outer * inner lines), sequential in the line's order, so the
//     result is exact to the CPU reference: floats accumulate in f64 and round through f32 on
//     store (f64 stays f64), integers in i64. y may equal x.

template <int B> struct Bits;
template <> struct Bits<1> { typedef unsigned char T; };
template <> struct Bits<2> { typedef unsigned short T; };
template <> struct Bits<4> { typedef unsigned int T; };
template <> struct Bits<8> { typedef unsigned long long T; };
template <> struct Bits<16> { typedef uint4 T; };

template <typename T>
__device__ __forceinline__ void copy_body(const T* __restrict__ x, T* __restrict__ y, long long n, int rank,
                                          const Dims8& dims, const Strides8& xs, const Strides8& ys) {
    MPC_GRID_STRIDE(i, n) {
        long long ox = i, oy = i;
        if (rank > 0) strided_offset2(i, rank, dims, xs, ys, ox, oy);
        y[oy] = x[ox];
    }
}

template <typename T>
__device__ __forceinline__ void tile_body(const T* __restrict__ x, T* __restrict__ y, long long n, int rank,
                                          const Dims8& od, const Dims8& id, const Strides8& xs) {
    MPC_GRID_STRIDE(i, n) {
        long long lin = i, off = 0;
#pragma unroll
        for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
            if (d < rank) {
                const long long c = lin % od.d[d];
                lin /= od.d[d];
                off += (c % id.d[d]) * xs.s[d];
            }
        }
        y[i] = x[off];
    }
}

__device__ __forceinline__ long long rem_euclid(long long a, long long m) {
    const long long r = a % m;
    return r < 0 ? r + m : r;
}

template <typename T>
__device__ __forceinline__ void pad_body(const T* __restrict__ x, T* __restrict__ y, long long n, int rank,
                                         const Dims8& od, const Dims8& id, const Strides8& xs, const Dims8& before,
                                         int mode, unsigned long long value) {
    MPC_GRID_STRIDE(i, n) {
        long long lin = i, off = 0;
        bool fill = false;
#pragma unroll
        for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
            if (d >= rank) continue;
            const long long len = id.d[d];
            long long c = lin % od.d[d] - before.d[d];
            lin /= od.d[d];
            if (c < 0 || c >= len) {
                if (mode == 1 && len > 1) {
                    const long long period = 2 * (len - 1);
                    const long long m = rem_euclid(c, period);
                    c = m >= len ? period - m : m;
                } else if (mode == 1 || mode == 2) {
                    c = c < 0 ? 0 : len - 1;
                } else if (mode == 3) {
                    c = rem_euclid(c, len);
                } else {
                    fill = true;
                    c = 0;
                }
            }
            off += c * xs.s[d];
        }
        y[i] = fill ? (T)value : x[off];
    }
}

template <typename T>
__device__ __forceinline__ void trilu_body(const T* x, T* y, long long n, long long rows, long long cols, long long k,
                                           int upper) {
    MPC_GRID_STRIDE(p, n) {
        const long long j = p % cols, i = (p / cols) % rows;
        const bool keep = upper ? (j - i >= k) : (j - i <= k);
        y[p] = keep ? x[p] : (T)0;
    }
}

template <typename T>
__device__ __forceinline__ void transpose_body(const T* __restrict__ x, T* __restrict__ y, long long batch, int rank,
                                               const Dims8& dims, const Strides8& xs, const Strides8& ys,
                                               long long rows, long long cols, long long x_col, long long y_row) {
    __shared__ T tile[32][33];
    const long long c0 = (long long)blockIdx.x * 32, r0 = (long long)blockIdx.y * 32;
    for (long long b = blockIdx.z; b < batch; b += gridDim.z) {
        long long xb = 0, yb = 0;
        if (rank > 0) strided_offset2(b, rank, dims, xs, ys, xb, yb);
        // Consecutive threads read consecutive rows (x is contiguous along them)...
        for (int k = threadIdx.y; k < 32; k += 8) {
            const long long r = r0 + threadIdx.x, c = c0 + k;
            if (r < rows && c < cols) tile[k][threadIdx.x] = x[xb + r + c * x_col];
        }
        __syncthreads();
        // ...and write consecutive columns (y is contiguous along them).
        for (int k = threadIdx.y; k < 32; k += 8) {
            const long long r = r0 + k, c = c0 + threadIdx.x;
            if (r < rows && c < cols) y[yb + r * y_row + c] = tile[threadIdx.x][k];
        }
        __syncthreads();
    }
}

#define MOVE_B(B)                                                                                          \
    MPC_KERNEL movement_copy_b##B(const Bits<B>::T* x, Bits<B>::T* y, long long n, int rank, Dims8 dims,   \
                                  Strides8 xs, Strides8 ys) {                                              \
        copy_body(x, y, n, rank, dims, xs, ys);                                                            \
    }                                                                                                      \
    MPC_KERNEL movement_transpose_b##B(const Bits<B>::T* x, Bits<B>::T* y, long long batch, int rank,      \
                                       Dims8 dims, Strides8 xs, Strides8 ys, long long rows, long long cols,  \
                                       long long x_col, long long y_row) {                                   \
        transpose_body(x, y, batch, rank, dims, xs, ys, rows, cols, x_col, y_row);                           \
    }                                                                                                      \
    MPC_KERNEL movement_tile_b##B(const Bits<B>::T* x, Bits<B>::T* y, long long n, int rank,               \
                                  Dims8 out_dims, Dims8 in_dims, Strides8 xs) {                            \
        tile_body(x, y, n, rank, out_dims, in_dims, xs);                                                   \
    }                                                                                                      \
    MPC_KERNEL movement_pad_b##B(const Bits<B>::T* x, Bits<B>::T* y, long long n, int rank, Dims8 out_dims, \
                                 Dims8 in_dims, Strides8 xs, Dims8 before, int mode,                       \
                                 unsigned long long value) {                                               \
        pad_body(x, y, n, rank, out_dims, in_dims, xs, before, mode, value);                               \
    }                                                                                                      \
    MPC_KERNEL movement_trilu_b##B(const Bits<B>::T* x, Bits<B>::T* y, long long n, long long rows,        \
                                   long long cols, long long k, int upper) {                               \
        trilu_body(x, y, n, rows, cols, k, upper);                                                         \
    }                                                                                                      \
    MPC_KERNEL movement_fill_b##B(Bits<B>::T* y, long long n, unsigned long long value) {                  \
        MPC_GRID_STRIDE(i, n) { y[i] = (Bits<B>::T)value; }                                                \
    }
MOVE_B(1)
MOVE_B(2)
MOVE_B(4)
MOVE_B(8)
// A copy 16 bytes at a time: a strided copy whose innermost dim is contiguous on both sides,
// its units of 16 bytes whole and every stride and start a multiple of 16 bytes (the host then
// divides the innermost dim and the strides into such units).
MPC_KERNEL movement_copy_b16(const uint4* x, uint4* y, long long n, int rank, Dims8 dims, Strides8 xs, Strides8 ys) {
    copy_body(x, y, n, rank, dims, xs, ys);
}

// ---------------------------------------------------------------- Range

MPC_KERNEL movement_range_f32(const float* start, const float* delta, float* y, long long n) {
    const float s = *start, d = *delta;
    MPC_GRID_STRIDE(i, n) { y[i] = s + (float)i * d; }
}
MPC_KERNEL movement_range_f16(const __half* start, const __half* delta, __half* y, long long n) {
    const double s = (double)__half2float(*start), d = (double)__half2float(*delta);
    MPC_GRID_STRIDE(i, n) { y[i] = f16_from_f64(s + (double)i * d); }
}
MPC_KERNEL movement_range_bf16(const __nv_bfloat16* start, const __nv_bfloat16* delta, __nv_bfloat16* y,
                               long long n) {
    const double s = (double)__bfloat162float(*start), d = (double)__bfloat162float(*delta);
    MPC_GRID_STRIDE(i, n) { y[i] = bf16_from_f64(s + (double)i * d); }
}
MPC_KERNEL movement_range_f64(const double* start, const double* delta, double* y, long long n) {
    const double s = *start, d = *delta;
    MPC_GRID_STRIDE(i, n) { y[i] = s + (double)i * d; }
}
MPC_KERNEL movement_range_i64(const long long* start, const long long* delta, long long* y, long long n) {
    const unsigned long long s = (unsigned long long)*start, d = (unsigned long long)*delta;
    MPC_GRID_STRIDE(i, n) { y[i] = (long long)(s + (unsigned long long)i * d); }
}
MPC_KERNEL movement_range_i32(const int* start, const int* delta, int* y, long long n) {
    const unsigned int s = (unsigned int)*start, d = (unsigned int)*delta;
    MPC_GRID_STRIDE(i, n) { y[i] = (int)(s + (unsigned int)i * d); }
}

// ---------------------------------------------------------------- CumSum, CumProd
//
// movement_{cumsum,cumprod}_<T>(const T* x, T* y, long long outer, long long n, long long inner,
//                               int exclusive, int reverse)
//     T in f32 f16 bf16 f64 i64 i32 u64 u32. Along the middle axis of a contiguous (outer, n,
//     inner) array, one thread per line: floats fold in f64 (rounded through f32 on store, f64
//     kept), integers in wrapping 64-bit arithmetic (u64's bits as i64), truncated on store.
// movement_cumprod_grad_<T>(const T* dy, const T* x, T* dx, double* e, long long outer,
//                           long long n, long long inner, int exclusive, int reverse)
//     T in f32 f16 bf16 f64: ai.mpc::CumProdGrad (docs/ai-mpc-ops.md), in f64 as the CPU
//     reference (runtime/src/cpu/nn.rs cumprod_grad): E_j the product before j, S_j by the
//     backward recurrence, dx_j = E_j * S_j; no division, so zeros in x are exact. e is f64
//     scratch of x's element count (E, kept unrounded between the two passes).

__device__ __forceinline__ double cs_ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ double cs_ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ double cs_ld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ double cs_ld(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ long long cs_ld(const long long* p, long long i) { return p[i]; }
__device__ __forceinline__ long long cs_ld(const int* p, long long i) { return p[i]; }
__device__ __forceinline__ long long cs_ld(const unsigned long long* p, long long i) { return (long long)p[i]; }
__device__ __forceinline__ long long cs_ld(const unsigned int* p, long long i) { return p[i]; }
// Floats round through f32 on store (the CPU reference's `store`); f64 stays f64.
__device__ __forceinline__ void cs_st(float* p, long long i, double v) { p[i] = __double2float_rn(v); }
__device__ __forceinline__ void cs_st(__half* p, long long i, double v) { p[i] = __float2half_rn(__double2float_rn(v)); }
__device__ __forceinline__ void cs_st(__nv_bfloat16* p, long long i, double v) {
    p[i] = __float2bfloat16_rn(__double2float_rn(v));
}
__device__ __forceinline__ void cs_st(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void cs_st(long long* p, long long i, long long v) { p[i] = v; }
__device__ __forceinline__ void cs_st(int* p, long long i, long long v) { p[i] = (int)(unsigned int)(unsigned long long)v; }
__device__ __forceinline__ void cs_st(unsigned long long* p, long long i, long long v) { p[i] = (unsigned long long)v; }
__device__ __forceinline__ void cs_st(unsigned int* p, long long i, long long v) {
    p[i] = (unsigned int)(unsigned long long)v;
}
// The folds: integers wrap (in unsigned arithmetic, where overflow is defined).
__device__ __forceinline__ double cs_add(double s, double v) { return s + v; }
__device__ __forceinline__ long long cs_add(long long s, long long v) {
    return (long long)((unsigned long long)s + (unsigned long long)v);
}
__device__ __forceinline__ double cs_mul(double s, double v) { return s * v; }
__device__ __forceinline__ long long cs_mul(long long s, long long v) {
    return (long long)((unsigned long long)s * (unsigned long long)v);
}

template <typename T, bool PRODUCT>
__device__ __forceinline__ void cumulative_body(const T* x, T* y, long long outer, long long n, long long inner,
                                                int exclusive, int reverse) {
    MPC_GRID_STRIDE(line, outer * inner) {
        const long long o = line / inner, i = line % inner;
        const long long base = o * n * inner + i;
        decltype(cs_ld(x, 0)) s = PRODUCT ? 1 : 0;
        for (long long step = 0; step < n; ++step) {
            const long long k = reverse ? n - 1 - step : step;
            const long long at = base + k * inner;
            const auto v = cs_ld(x, at);
            if (exclusive) cs_st(y, at, s);
            s = PRODUCT ? cs_mul(s, v) : cs_add(s, v);
            if (!exclusive) cs_st(y, at, s);
        }
    }
}
#define CUMULATIVE_T(T, tag)                                                                               \
    MPC_KERNEL movement_cumsum_##tag(const T* x, T* y, long long outer, long long n, long long inner,      \
                                     int exclusive, int reverse) {                                         \
        cumulative_body<T, false>(x, y, outer, n, inner, exclusive, reverse);                              \
    }                                                                                                      \
    MPC_KERNEL movement_cumprod_##tag(const T* x, T* y, long long outer, long long n, long long inner,     \
                                      int exclusive, int reverse) {                                        \
        cumulative_body<T, true>(x, y, outer, n, inner, exclusive, reverse);                               \
    }
CUMULATIVE_T(float, f32)
CUMULATIVE_T(__half, f16)
CUMULATIVE_T(__nv_bfloat16, bf16)
CUMULATIVE_T(double, f64)
CUMULATIVE_T(long long, i64)
CUMULATIVE_T(int, i32)
CUMULATIVE_T(unsigned long long, u64)
CUMULATIVE_T(unsigned int, u32)

template <typename T>
__device__ __forceinline__ void cumprod_grad_body(const T* dy, const T* x, T* dx, double* e, long long outer,
                                                  long long n, long long inner, int exclusive, int reverse) {
    MPC_GRID_STRIDE(line, outer * inner) {
        const long long o = line / inner, i = line % inner;
        const long long base = o * n * inner + i;
        // The line's element at `step` of the product's order.
#define MPC_CP_AT(step) (base + (reverse ? n - 1 - (step) : (step)) * inner)
        double before = 1.0;
        for (long long step = 0; step < n; ++step) {
            e[MPC_CP_AT(step)] = before;
            before *= cs_ld(x, MPC_CP_AT(step));
        }
        double s = 0.0;
        for (long long step = n - 1; step >= 0; --step) {
            if (step + 1 < n) {
                const double g = exclusive ? cs_ld(dy, MPC_CP_AT(step + 1)) : cs_ld(dy, MPC_CP_AT(step));
                s = g + cs_ld(x, MPC_CP_AT(step + 1)) * s;
            } else {
                s = exclusive ? 0.0 : cs_ld(dy, MPC_CP_AT(step));
            }
            cs_st(dx, MPC_CP_AT(step), e[MPC_CP_AT(step)] * s);
        }
#undef MPC_CP_AT
    }
}
#define CUMPROD_GRAD_T(T, tag)                                                                           \
    MPC_KERNEL movement_cumprod_grad_##tag(const T* dy, const T* x, T* dx, double* e, long long outer,   \
                                           long long n, long long inner, int exclusive, int reverse) {   \
        cumprod_grad_body(dy, x, dx, e, outer, n, inner, exclusive, reverse);                            \
    }
CUMPROD_GRAD_T(float, f32)
CUMPROD_GRAD_T(__half, f16)
CUMPROD_GRAD_T(__nv_bfloat16, bf16)
CUMPROD_GRAD_T(double, f64)

// ---------------------------------------------------------------- TopK
//
// movement_topk_<T>(const T* x, T* values, long long* indices, long long outer, long long n,
//                   long long inner, long long k, int largest)
//     T in f32 f16 bf16 f64 i64 i32. Along the middle axis of a contiguous (outer, n, inner)
//     array, the k first elements of each line in the CPU reference's order (runtime/src/cpu/nn.rs
//     top_k): larger first (smaller with largest 0), NaN before every number when largest and
//     after when not, equal values in index order. One thread per line; the j-th pick is the first
//     element in that order after the (j-1)-th, so no scratch (n * k reads per line: for the small
//     k of routers and heads). values keeps x's bits; indices are positions along the axis.
template <typename V> __device__ __forceinline__ bool topk_before(V a, long long ia, V b, long long ib, int largest) {
    const bool an = a != a, bn = b != b;
    if (an || bn) return an && bn ? ia < ib : (largest ? an : bn);
    if (a != b) return largest ? a > b : a < b;
    return ia < ib;
}
template <typename T>
__device__ __forceinline__ void topk_body(const T* x, T* values, long long* indices, long long outer, long long n,
                                          long long inner, long long k, int largest) {
    MPC_GRID_STRIDE(line, outer * inner) {
        const long long o = line / inner, i = line % inner;
        const long long base = o * n * inner + i, out = o * k * inner + i;
        decltype(cs_ld(x, 0)) pv = 0;
        long long pj = -1;
        for (long long j = 0; j < k; ++j) {
            decltype(cs_ld(x, 0)) bv = 0;
            long long bj = -1;
            for (long long t = 0; t < n; ++t) {
                const auto v = cs_ld(x, base + t * inner);
                if (pj >= 0 && !topk_before(pv, pj, v, t, largest)) continue;
                if (bj < 0 || topk_before(v, t, bv, bj, largest)) {
                    bv = v;
                    bj = t;
                }
            }
            values[out + j * inner] = x[base + bj * inner];
            indices[out + j * inner] = bj;
            pv = bv;
            pj = bj;
        }
    }
}
#define TOPK_T(T, tag)                                                                                      \
    MPC_KERNEL movement_topk_##tag(const T* x, T* values, long long* indices, long long outer, long long n, \
                                   long long inner, long long k, int largest) {                             \
        topk_body(x, values, indices, outer, n, inner, k, largest);                                         \
    }
TOPK_T(float, f32)
TOPK_T(__half, f16)
TOPK_T(__nv_bfloat16, bf16)
TOPK_T(double, f64)
TOPK_T(long long, i64)
TOPK_T(int, i32)

// ---------------------------------------------------------------- Resize
//
// movement_resize_<T>(const T* x, T* y, long long n, int rank, Dims8 out_dims, Strides8 xs,
//                     Dims8 base, const long long* first, const long long* idx, const double* w,
//                     double extrapolation)
//     T in f32 f16 bf16 f64. Separable Resize (nearest, linear, cubic, antialiased) as the CPU
//     reference computes it (runtime/src/cpu/resize.rs): along axis d, output coordinate o samples
//     the taps first[e] .. first[e + 1] (e = base_d + o; first has a last entry past the end):
//     input indices idx[t] with weights w[t] (the host takes them from mpc-ir's
//     geometry::resize_taps). y (contiguous over out_dims, n elements) is the sum over every
//     combination of one tap per axis of x[sum idx_d * xs_d] times the product of the weights
//     (multiplied in axis order), the combinations in lexicographic order with axis 0 most
//     significant, in f64, rounded through f32 on store (f64 stays f64). An output some axis gives
//     no taps (tf_crop_and_resize outside the input) is `extrapolation`.
template <typename T>
__device__ __forceinline__ void resize_body(const T* x, T* y, long long n, int rank, const Dims8& out_dims,
                                            const Strides8& xs, const Dims8& base, const long long* first,
                                            const long long* idx, const double* w, double extrapolation) {
    MPC_GRID_STRIDE(i, n) {
        long long at[MPC_MAX_RANK], cnt[MPC_MAX_RANK];
        long long lin = i, combos = 1;
#pragma unroll
        for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
            if (d < rank) {
                const long long m = out_dims.d[d];
                const long long q = lin / m;
                const long long e = base.d[d] + (lin - q * m);
                at[d] = first[e];
                cnt[d] = first[e + 1] - at[d];
                combos *= cnt[d];
                lin = q;
            }
        }
        double acc = -0.0;
        for (long long c = 0; c < combos; ++c) {
            long long t[MPC_MAX_RANK];
            long long rem = c;
#pragma unroll
            for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
                if (d < rank) {
                    t[d] = at[d] + rem % cnt[d];
                    rem /= cnt[d];
                }
            }
            long long off = 0;
            double weight = 1.0;
#pragma unroll
            for (int d = 0; d < MPC_MAX_RANK; ++d) {
                if (d < rank) {
                    off += idx[t[d]] * xs.s[d];
                    weight *= w[t[d]];
                }
            }
            acc += cs_ld(x, off) * weight;
        }
        cs_st(y, i, combos == 0 ? extrapolation : acc);
    }
}
#define RESIZE_T(T, tag)                                                                                  \
    MPC_KERNEL movement_resize_##tag(const T* x, T* y, long long n, int rank, Dims8 out_dims, Strides8 xs, \
                                     Dims8 base, const long long* first, const long long* idx,            \
                                     const double* w, double extrapolation) {                             \
        resize_body(x, y, n, rank, out_dims, xs, base, first, idx, w, extrapolation);                     \
    }
RESIZE_T(float, f32)
RESIZE_T(__half, f16)
RESIZE_T(__nv_bfloat16, bf16)
RESIZE_T(double, f64)
