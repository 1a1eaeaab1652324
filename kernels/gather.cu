// kernels/gather.cu: Gather along an axis, GatherElements, GatherND, ScatterND, ScatterElements,
// and GatherGrad (the scatter-add of the embedding gradient), without float atomics.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loops, blockDim.x = 256, any grid, except the block-local sort kernels
// (blockDim.x = 256 exactly, see below).
// Gathers move elements by size (b1 b2 b4 b8, any dtype of that size, bit for bit); indices are
// i64 or i32 (`_i64` / `_i32` suffix); a negative index counts from the end of the axis. An index
// still out of range gives zero bits and, when `err` is not nullptr, sets *err = 1 (a plain store
// of the same value by every such thread; the host zeroes it before and reads it after).
//
// ABI:
// gather_axis_<b>_<I>(const T* x, const I* idx, T* y, long long outer, long long len,
//                     long long count, long long inner, int* err)
//     x is (outer, len, inner), idx has `count` entries (any shape, flattened), y is
//     (outer, count, inner): y[(o*count + j)*inner + i] = x[(o*len + idx[j])*inner + i].
// gather_elements_<b>_<I>(const T* x, const I* idx, T* y, long long n, int rank, Dims8 idx_dims,
//                         Strides8 xs, int axis, long long axis_len, int* err)
//     y and idx contiguous over idx_dims (n elements); y[c] = x[sum_{d != axis} c_d xs_d +
//     idx[c] * xs_axis], xs being x's strides.
//
// GatherGrad(dY, indices, shape) along an axis: dx is (outer, len, inner), dy is
// (outer, count, inner), idx has `count` entries. dx[o, l, i] = sum over j with idx[j] == l of
// dy[o, j, i], added in increasing j (the CPU reference's order), so the result is repeatable.
// Every dx element is written (no zeroing needed). Out-of-range indices contribute nothing.
// Two ways, with the same result:
// gather_grad_direct_<T>_<I>(const T* dy, const I* idx, T* dx, long long outer, long long len,
//                            long long count, long long inner)
//     One thread per dx element scanning all `count` indices: for small counts (say <= 64).
// The sorted path, for embeddings (T in f32 f16 bf16 f64; counts below 2^32, len below 2^31):
//   1. gather_grad_keys_<I>(const I* idx, unsigned long long* keys, long long count,
//                           long long padded, long long len)
//      keys[j] = (normalised idx[j] << 32) | j for j < count (len << 32 | j when out of range),
//      ~0 for count <= j < padded; padded = a power of two >= count (for example the next one).
//   2. Bitonic sort of the `padded` keys, ascending (the keys are distinct apart from the
//      identical padding, so any sorting network gives the same order):
//        gather_sort_local(unsigned long long* keys, long long padded)
//            sorts each 2048-key chunk (all stages k <= 2048; k <= padded); blockDim.x = 256,
//            gridDim.x = ceil(padded / 2048); 16 KiB static shared memory.
//        then for k = 4096, 8192, ... <= padded:
//            for j = k/2, k/4, ... >= 2048: gather_sort_step(keys, padded, k, j)   (grid-stride,
//                one thread per key pair: padded / 2 threads)
//            gather_sort_merge_local(keys, padded, k)   (steps j = 1024 .. 1 in shared memory;
//                blockDim.x = 256, gridDim.x = padded / 2048)
//   3. gather_grad_segments(const unsigned long long* keys, long long count, long long len,
//                           long long* seg)
//      seg has len + 1 entries: seg[l] = the first sorted position whose index is >= l (one
//      binary search per l; one thread per l, len + 1 threads).
//   4. gather_grad_sorted_<T>(const T* dy, const unsigned long long* keys, const long long* seg,
//                             T* dx, long long outer, long long len, long long count, long long inner)
//      One thread per dx element: sums dy[o, keys[p] & 0xffffffff, i] for p in [seg[l], seg[l+1]).
//   Workspaces: keys (padded x u64), seg ((len + 1) x i64).

template <int B> struct Bits;
template <> struct Bits<1> { typedef unsigned char T; };
template <> struct Bits<2> { typedef unsigned short T; };
template <> struct Bits<4> { typedef unsigned int T; };
template <> struct Bits<8> { typedef unsigned long long T; };

// The index normalised to [0, len), or -1 when out of range.
template <typename I> __device__ __forceinline__ long long norm_index(const I* idx, long long j, long long len) {
    long long k = (long long)idx[j];
    if (k < 0) k += len;
    return (k < 0 || k >= len) ? -1 : k;
}

template <typename T, typename I>
__device__ __forceinline__ void gather_axis_body(const T* __restrict__ x, const I* __restrict__ idx, T* __restrict__ y,
                                                 long long outer, long long len, long long count, long long inner,
                                                 int* err) {
    MPC_GRID_STRIDE(e, outer * count * inner) {
        long long i, t, j, o;
        index_divmod(e, inner, t, i);
        index_divmod(t, count, o, j);
        const long long k = norm_index(idx, j, len);
        if (k < 0) {
            y[e] = (T)0;
            if (err) *err = 1;
        } else {
            y[e] = x[(o * len + k) * inner + i];
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void gather_elements_body(const T* __restrict__ x, const I* __restrict__ idx,
                                                     T* __restrict__ y, long long n, int rank, const Dims8& dims,
                                                     const Strides8& xs, int axis, long long axis_len, int* err) {
    MPC_GRID_STRIDE(e, n) {
        long long lin = e, off = 0, axis_stride = 0;
#pragma unroll
        for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
            if (d < rank) {
                const long long c = lin % dims.d[d];
                lin /= dims.d[d];
                if (d != axis)
                    off += c * xs.s[d];
                else
                    axis_stride = xs.s[d];
            }
        }
        const long long k = norm_index(idx, e, axis_len);
        if (k < 0) {
            y[e] = (T)0;
            if (err) *err = 1;
        } else {
            y[e] = x[off + k * axis_stride];
        }
    }
}

#define GATHER_BI(B, I, itag)                                                                              \
    MPC_KERNEL gather_axis_b##B##_##itag(const Bits<B>::T* x, const I* idx, Bits<B>::T* y, long long outer, \
                                         long long len, long long count, long long inner, int* err) {      \
        gather_axis_body(x, idx, y, outer, len, count, inner, err);                                        \
    }                                                                                                      \
    MPC_KERNEL gather_elements_b##B##_##itag(const Bits<B>::T* x, const I* idx, Bits<B>::T* y, long long n, \
                                             int rank, Dims8 idx_dims, Strides8 xs, int axis,              \
                                             long long axis_len, int* err) {                               \
        gather_elements_body(x, idx, y, n, rank, idx_dims, xs, axis, axis_len, err);                       \
    }
#define GATHER_B(B)             \
    GATHER_BI(B, long long, i64) \
    GATHER_BI(B, int, i32)
GATHER_B(1)
GATHER_B(2)
GATHER_B(4)
GATHER_B(8)

// ---------------------------------------------------------------- GatherGrad, direct

template <typename T, typename I>
__device__ __forceinline__ void grad_direct_body(const T* __restrict__ dy, const I* __restrict__ idx,
                                                 T* __restrict__ dx, long long outer, long long len, long long count,
                                                 long long inner) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(e, outer * len * inner) {
        long long i, t, l, o;
        index_divmod(e, inner, t, i);
        index_divmod(t, len, o, l);
        C s = C(0);
        for (long long j = 0; j < count; ++j)
            if (norm_index(idx, j, len) == l) s += ld(dy, (o * count + j) * inner + i);
        st(dx, e, s);
    }
}

// ---------------------------------------------------------------- GatherGrad, sorted

template <typename I>
__device__ __forceinline__ void keys_body(const I* __restrict__ idx, unsigned long long* __restrict__ keys,
                                          long long count, long long padded, long long len) {
    MPC_GRID_STRIDE(j, padded) {
        if (j < count) {
            const long long k = norm_index(idx, j, len);
            const unsigned long long hi = (unsigned long long)(k < 0 ? len : k);
            keys[j] = (hi << 32) | (unsigned long long)j;
        } else {
            keys[j] = ~0ull;
        }
    }
}

// One compare-exchange of the bitonic network: element p against p ^ j, direction from p & k.
__device__ __forceinline__ void bitonic_cas(unsigned long long* a, unsigned long long* b, bool up) {
    const unsigned long long x = *a, y = *b;
    if ((x > y) == up) {
        *a = y;
        *b = x;
    }
}

MPC_KERNEL gather_sort_step(unsigned long long* keys, long long padded, long long k, long long j) {
    MPC_GRID_STRIDE(t, padded / 2) {
        // The t-th pair: p has bit j clear.
        const long long p = ((t / j) * 2 * j) + (t % j);
        const long long q = p + j;
        bitonic_cas(&keys[p], &keys[q], (p & k) == 0);
    }
}

#define SORT_CHUNK 2048

MPC_KERNEL gather_sort_local(unsigned long long* keys, long long padded) {
    __shared__ unsigned long long s[SORT_CHUNK];
    const long long chunk = padded < SORT_CHUNK ? padded : SORT_CHUNK;
    for (long long base = (long long)blockIdx.x * SORT_CHUNK; base < padded; base += (long long)gridDim.x * SORT_CHUNK) {
        __syncthreads();
        for (int t = threadIdx.x; t < chunk; t += blockDim.x) s[t] = keys[base + t];
        __syncthreads();
        for (long long k = 2; k <= chunk; k <<= 1) {
            for (long long j = k >> 1; j > 0; j >>= 1) {
                for (int t = threadIdx.x; t < chunk / 2; t += blockDim.x) {
                    const int p = (int)(((t / j) * 2 * j) + (t % j));
                    bitonic_cas(&s[p], &s[p + j], ((base + p) & k) == 0);
                }
                __syncthreads();
            }
        }
        for (int t = threadIdx.x; t < chunk; t += blockDim.x) keys[base + t] = s[t];
    }
}

MPC_KERNEL gather_sort_merge_local(unsigned long long* keys, long long padded, long long k) {
    __shared__ unsigned long long s[SORT_CHUNK];
    for (long long base = (long long)blockIdx.x * SORT_CHUNK; base < padded; base += (long long)gridDim.x * SORT_CHUNK) {
        __syncthreads();
        for (int t = threadIdx.x; t < SORT_CHUNK; t += blockDim.x) s[t] = keys[base + t];
        __syncthreads();
        for (int j = SORT_CHUNK / 2; j > 0; j >>= 1) {
            for (int t = threadIdx.x; t < SORT_CHUNK / 2; t += blockDim.x) {
                const int p = ((t / j) * 2 * j) + (t % j);
                bitonic_cas(&s[p], &s[p + j], ((base + p) & k) == 0);
            }
            __syncthreads();
        }
        for (int t = threadIdx.x; t < SORT_CHUNK; t += blockDim.x) keys[base + t] = s[t];
    }
}

MPC_KERNEL gather_grad_segments(const unsigned long long* keys, long long count, long long len, long long* seg) {
    MPC_GRID_STRIDE(l, len + 1) {
        // First position p in [0, count] with keys[p] >> 32 >= l.
        long long lo = 0, hi = count;
        while (lo < hi) {
            const long long mid = lo + (hi - lo) / 2;
            if ((long long)(keys[mid] >> 32) < l)
                lo = mid + 1;
            else
                hi = mid;
        }
        seg[l] = lo;
    }
}

template <typename T>
__device__ __forceinline__ void grad_sorted_body(const T* __restrict__ dy, const unsigned long long* __restrict__ keys,
                                                 const long long* __restrict__ seg, T* __restrict__ dx, long long outer,
                                                 long long len, long long count, long long inner) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(e, outer * len * inner) {
        long long i, t, l, o;
        index_divmod(e, inner, t, i);
        index_divmod(t, len, o, l);
        C s = C(0);
        const long long p1 = seg[l + 1];
        for (long long p = seg[l]; p < p1; ++p) {
            const long long j = (long long)(keys[p] & 0xffffffffull);
            s += ld(dy, (o * count + j) * inner + i);
        }
        st(dx, e, s);
    }
}

#define GRAD_T(T, tag)                                                                                     \
    MPC_KERNEL gather_grad_direct_##tag##_i64(const T* dy, const long long* idx, T* dx, long long outer,   \
                                              long long len, long long count, long long inner) {           \
        grad_direct_body(dy, idx, dx, outer, len, count, inner);                                           \
    }                                                                                                      \
    MPC_KERNEL gather_grad_direct_##tag##_i32(const T* dy, const int* idx, T* dx, long long outer,         \
                                              long long len, long long count, long long inner) {           \
        grad_direct_body(dy, idx, dx, outer, len, count, inner);                                           \
    }                                                                                                      \
    MPC_KERNEL gather_grad_sorted_##tag(const T* dy, const unsigned long long* keys, const long long* seg,  \
                                        T* dx, long long outer, long long len, long long count,            \
                                        long long inner) {                                                 \
        grad_sorted_body(dy, keys, seg, dx, outer, len, count, inner);                                     \
    }
GRAD_T(float, f32)
GRAD_T(__half, f16)
GRAD_T(__nv_bfloat16, bf16)
GRAD_T(double, f64)

MPC_KERNEL gather_grad_keys_i64(const long long* idx, unsigned long long* keys, long long count, long long padded,
                                long long len) {
    keys_body(idx, keys, count, padded, len);
}
MPC_KERNEL gather_grad_keys_i32(const int* idx, unsigned long long* keys, long long count, long long padded,
                                long long len) {
    keys_body(idx, keys, count, padded, len);
}

// ---------------------------------------------------------------- GatherND, ScatterND, ScatterElements
//
// An index out of range reads or writes nothing, gives zero bits (GatherND) and, when `err` is not
// nullptr, stores 1 to *err, as the gathers above.
//
// gather_nd_<b>_<I>(const T* x, const I* idx, T* y, long long tuples, int k, long long run,
//                   long long per_batch, long long batch_len, Dims8 dims, Strides8 st, int* err)
//     GatherND with `batch_dims` b: idx holds `tuples` index tuples of k entries (the last dim of
//     the indices); tuple t reads the run of `run` elements at (t / per_batch) * batch_len +
//     sum_j idx[t k + j] * st[j] (dims[j] the size each entry indexes, st[j] its element stride
//     within one batch of batch_len elements). y is (tuples, run), one thread per element.
// gather_scatter_nd_<T>_<I>(const I* idx, const T* upd, T* out, long long n_out, long long tuples, int k,
//                           long long run, Dims8 dims, Strides8 st, int reduction, int* err)
//     ScatterND on `out`, which already holds the data (the host copies it first): update t
//     (updates are (tuples, run)) lands on the run at sum_j idx[t k + j] * st[j]. One thread per
//     out element scans every tuple in order and applies those that land on it: `reduction` 0
//     replaces (the last wins), 1 adds, 2 multiplies, 3 max, 4 min (NaN propagates), in the
//     compute type (f32 for f16/bf16, rounded once on store; wrapping i64 for integers), so the
//     result is the CPU reference's sequential one. T in f32 f16 bf16 f64 i64 i32.
// gather_scatter_elements_<T>_<I>(const I* idx, const T* upd, T* out, long long n_out, long long n_upd,
//                                 int rank, Dims8 idx_dims, Strides8 os, int axis,
//                                 long long axis_len, int reduction, int* err)
//     ScatterElements on `out` (holding the data): update u (coordinates c over idx_dims) lands on
//     sum_{d != axis} c_d os_d + idx[u] os_axis (os: out's strides). One thread per out element
//     scans every update in order, as gather_scatter_nd.
// These scans cost out elements x updates: right for the sizes these ops have in the models mpc
// trains (the embedding gradient is GatherGrad's, above).

__device__ __forceinline__ float sc_ld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float sc_ld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float sc_ld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ double sc_ld(const double* p, long long i) { return p[i]; }
__device__ __forceinline__ long long sc_ld(const long long* p, long long i) { return p[i]; }
__device__ __forceinline__ long long sc_ld(const int* p, long long i) { return p[i]; }
__device__ __forceinline__ void sc_st(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void sc_st(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void sc_st(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ __forceinline__ void sc_st(double* p, long long i, double v) { p[i] = v; }
__device__ __forceinline__ void sc_st(long long* p, long long i, long long v) { p[i] = v; }
__device__ __forceinline__ void sc_st(int* p, long long i, long long v) { p[i] = (int)(unsigned int)(unsigned long long)v; }

template <typename C> __device__ __forceinline__ C sc_combine(C a, C b, int reduction) {
    switch (reduction) {
        case 1: return a + b;
        case 2: return a * b;
        case 3: return max_nan(a, b);
        case 4: return min_nan(a, b);
        default: return b;
    }
}
template <> __device__ __forceinline__ long long sc_combine(long long a, long long b, int reduction) {
    switch (reduction) {
        case 1: return (long long)((unsigned long long)a + (unsigned long long)b);
        case 2: return (long long)((unsigned long long)a * (unsigned long long)b);
        case 3: return a > b ? a : b;
        case 4: return a < b ? a : b;
        default: return b;
    }
}

template <typename T, typename I>
__device__ __forceinline__ void gather_nd_body(const T* __restrict__ x, const I* __restrict__ idx, T* __restrict__ y,
                                               long long tuples, int k, long long run, long long per_batch,
                                               long long batch_len, const Dims8& dims, const Strides8& st, int* err) {
    MPC_GRID_STRIDE(e, tuples * run) {
        const long long t = e / run, r = e - t * run;
        long long off = (t / per_batch) * batch_len;
        bool bad = false;
#pragma unroll
        for (int j = 0; j < MPC_MAX_RANK; ++j) {
            if (j < k) {
                const long long v = norm_index(idx, t * k + j, dims.d[j]);
                if (v < 0) bad = true;
                off += v * st.s[j];
            }
        }
        if (bad) {
            y[e] = (T)0;
            if (err) *err = 1;
        } else {
            y[e] = x[off + r];
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void scatter_nd_body(const I* __restrict__ idx, const T* __restrict__ upd, T* __restrict__ out,
                                                long long n_out, long long tuples, int k, long long run,
                                                const Dims8& dims, const Strides8& st, int reduction, int* err) {
    MPC_GRID_STRIDE(o, n_out) {
        const long long r = o % run, slice = o - r;
        auto acc = sc_ld(out, o);
        bool touched = false;
        for (long long t = 0; t < tuples; ++t) {
            long long dst = 0;
            bool bad = false;
#pragma unroll
            for (int j = 0; j < MPC_MAX_RANK; ++j) {
                if (j < k) {
                    const long long v = norm_index(idx, t * k + j, dims.d[j]);
                    if (v < 0) bad = true;
                    dst += v * st.s[j];
                }
            }
            if (bad) {
                if (err) *err = 1;
                continue;
            }
            if (dst == slice) {
                acc = sc_combine(acc, sc_ld(upd, t * run + r), reduction);
                touched = true;
            }
        }
        if (touched) sc_st(out, o, acc);
    }
}

template <typename T, typename I>
__device__ __forceinline__ void scatter_elements_body(const I* __restrict__ idx, const T* __restrict__ upd,
                                                      T* __restrict__ out, long long n_out, long long n_upd, int rank,
                                                      const Dims8& idx_dims, const Strides8& os, int axis,
                                                      long long axis_len, int reduction, int* err) {
    MPC_GRID_STRIDE(o, n_out) {
        auto acc = sc_ld(out, o);
        bool touched = false;
        for (long long u = 0; u < n_upd; ++u) {
            long long lin = u, dst = 0, axis_stride = 0;
#pragma unroll
            for (int d = MPC_MAX_RANK - 1; d >= 0; --d) {
                if (d < rank) {
                    const long long c = lin % idx_dims.d[d];
                    lin /= idx_dims.d[d];
                    if (d != axis)
                        dst += c * os.s[d];
                    else
                        axis_stride = os.s[d];
                }
            }
            const long long v = norm_index(idx, u, axis_len);
            if (v < 0) {
                if (err) *err = 1;
                continue;
            }
            if (dst + v * axis_stride == o) {
                acc = sc_combine(acc, sc_ld(upd, u), reduction);
                touched = true;
            }
        }
        if (touched) sc_st(out, o, acc);
    }
}

#define GATHER_ND_BI(B, I, itag)                                                                          \
    MPC_KERNEL gather_nd_b##B##_##itag(const Bits<B>::T* x, const I* idx, Bits<B>::T* y, long long tuples, \
                                       int k, long long run, long long per_batch, long long batch_len,     \
                                       Dims8 dims, Strides8 st, int* err) {                                \
        gather_nd_body(x, idx, y, tuples, k, run, per_batch, batch_len, dims, st, err);                    \
    }
#define GATHER_ND_B(B)             \
    GATHER_ND_BI(B, long long, i64) \
    GATHER_ND_BI(B, int, i32)
GATHER_ND_B(1)
GATHER_ND_B(2)
GATHER_ND_B(4)
GATHER_ND_B(8)

#define SCATTER_TI(T, tag, I, itag)                                                                          \
    MPC_KERNEL gather_scatter_nd_##tag##_##itag(const I* idx, const T* upd, T* out, long long n_out,         \
                                                long long tuples, int k, long long run, Dims8 dims,          \
                                                Strides8 st, int reduction, int* err) {                      \
        scatter_nd_body(idx, upd, out, n_out, tuples, k, run, dims, st, reduction, err);                     \
    }                                                                                                        \
    MPC_KERNEL gather_scatter_elements_##tag##_##itag(const I* idx, const T* upd, T* out, long long n_out,   \
                                                      long long n_upd, int rank, Dims8 idx_dims, Strides8 os, \
                                                      int axis, long long axis_len, int reduction, int* err) { \
        scatter_elements_body(idx, upd, out, n_out, n_upd, rank, idx_dims, os, axis, axis_len, reduction, err); \
    }
#define SCATTER_T(T, tag)                 \
    SCATTER_TI(T, tag, long long, i64)    \
    SCATTER_TI(T, tag, int, i32)
SCATTER_T(float, f32)
SCATTER_T(__half, f16)
SCATTER_T(__nv_bfloat16, bf16)
SCATTER_T(double, f64)
SCATTER_T(long long, i64)
SCATTER_T(int, i32)
