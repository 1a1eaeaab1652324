// kernels/train.cu: the ai.mpc training ops (docs/ai-mpc-ops.md, runtime/src/cpu/train.rs):
// AllFinite (one tensor, or many at once), loss-scale unscaling, SgdUpdate, AdamUpdate,
// LossScaleUpdate, SeededDropout, ReluGrad, GeluGrad.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loops, blockDim.x = 256, any grid, except where a kernel says
// otherwise. Every flag, counter, scale and key is read from device memory, so a captured
// training step replays without the host looking at any value.
// The finite flag is a bool (one byte, 0 or 1). Arithmetic is f32 for f32/f16/bf16 (f64 for
// f64), rounded once on store, except SeededDropout, which computes in f64 exactly as the CPU
// reference does so that masks and values match it bit for bit.
//
// ---- AllFinite: `finite` = no NaN or Inf in any input. No atomics: the flag is set to 1 first,
// then every thread that sees a non-finite value stores 0 (identical plain stores, so the result
// does not depend on order or timing).
// train_all_finite_init(unsigned char* finite)
//     *finite = 1. Any launch (one thread does it). (A 1-byte memset of 1 does the same.)
// train_all_finite_<T>(const T* x, long long n, unsigned char* finite)
//     One tensor; T in f32 f16 bf16 f64. Launch after the init, once per tensor.
// train_all_finite_multi(const unsigned long long* ptrs, const long long* sizes, const int* dtypes,
//                        const int* chunk_tensor, const long long* chunk_start, long long chunks,
//                        long long chunk, unsigned char* finite)
//     Many tensors in one launch: ptrs/sizes/dtypes are device arrays, one entry per tensor
//     (device addresses, element counts, dtype codes 0 = f32, 1 = f16, 2 = bf16, 3 = f64; any
//     other code is an integer tensor, always finite). Chunk c is elements [chunk_start[c],
//     min(chunk_start[c] + chunk, sizes[t])) of tensor t = chunk_tensor[c] (chunk a multiple of
//     16); blockIdx.x walks the chunks (grid-stride), the block's threads a chunk's elements, 16
//     bytes at a time where the tensor starts on 16 bytes, the rest one at a time.
// train_unscale_<T>(const T* grad, const float* scale, T* out, long long n)
//     out = grad * inv, inv = 1 / *scale in f32, rounded to T first when T is not f32 (the
//     graph's Reciprocal, Cast, Mul). out may equal grad.
// train_unscale_all_finite_<T>(const T* grad, const float* scale, T* out, long long n,
//                              unsigned char* finite)
//     The same, and stores 0 to *finite when a result is not finite (after train_all_finite_init).
//
// ---- Updates. "Unchanged when not finite": when *finite == 0 every output equals its input bit
// for bit (copied when the output is another buffer; nothing is written when it is the same).
// Outputs may alias their inputs (the state's next value written into its own slot).
// Both read their learning rate from lr_ptr (a device f32 scalar: the op's `lr` input, which a
// schedule computes or the host writes) when it is non-null, else take the `lr` argument.
// Both take the gradient in G, widened to the parameter's compute type, and multiplied there by
// *inv_scale (an f32 scalar: the loss scale's reciprocal) when inv_scale is non-null: the unscale
// the training compiler folds into the update (the same arithmetic as a Cast and a Mul before it).
// <T>_<G>: f32_f32 f32_f16 f32_bf16 f16_f16 bf16_bf16 f64_f64.
// train_sgd_<T>_<G>(const T* param, const G* grad, const float* inv_scale,
//               const unsigned char* finite, const T* velocity, T* param_out, T* velocity_out,
//               long long n, float lr, const float* lr_ptr, float momentum, float weight_decay,
//               int nesterov)
//     d = grad + wd * param; with velocity (non-null): v' = momentum * v + d, step = nesterov ?
//     d + momentum * v' : v'; without: step = d. param' = param - lr * step.
//     Trailing arguments (both updates): void* low_out, const void* low, int low_code: the
//     parameter's low-precision copy (f32 parameters; code 1 f16, 2 bf16, 0 none, pointers null):
//     low_out = param' rounded to nearest even, as a Cast of param' would be; a skipped step
//     copies low to low_out when they differ.
// train_adam_<T>_<G>(const T* param, const G* grad, const float* inv_scale, const T* m,
//                const T* v, const long long* step, const unsigned char* finite, T* param_out,
//                T* m_out, T* v_out, long long n, float lr, const float* lr_ptr, float beta1, float beta2,
//                float epsilon, float weight_decay, int decoupled, low...)
//     t = max(*step, 1) (the count after this update); Adam: d = grad + wd * param; AdamW
//     (decoupled != 0): param <- param - lr * wd * param, d = grad. m' = b1 m + (1 - b1) d,
//     v' = b2 v + (1 - b2) d^2, param' = param - lr * (m' / (1 - b1^t)) / (sqrt(v' / (1 - b2^t))
//     + eps); the bias corrections 1 - b^t are computed in f64 once per thread.
// train_adam_multi_<T>(const unsigned long long* ptrs, const long long* sizes, const int* codes,
//                      const int* chunk_tensor, const long long* chunk_start, long long chunks,
//                      long long chunk, const float* inv_scale, const long long* step,
//                      const unsigned char* finite, float lr, const float* lr_ptr, float beta1, float beta2,
//                      float epsilon, float weight_decay, int decoupled)
//     Many AdamUpdates of T parameters (one attribute set, one step, finite flag and inv_scale)
//     in one launch. Tensor k: ptrs[9k .. 9k+9) = param, grad, m, v, param', m', v', low, low'
//     (device addresses; low and low' 0 without a copy), sizes[k] elements, codes[2k] the
//     gradient's dtype (0 f32, 1 f16, 2 bf16, 3 f64), codes[2k+1] the copy's low_code. Chunk c
//     is elements [chunk_start[c], min(chunk_start[c] + chunk, sizes[t])) of tensor
//     t = chunk_tensor[c]; blockIdx.x walks the chunks (grid-stride), the block's threads a
//     chunk's elements. Each element's arithmetic is train_adam's, so the bits are the separate
//     launches'. T in f32 f16 bf16 f64.
// train_loss_scale_update(const float* scale, const long long* good_steps,
//                         const unsigned char* finite, float* scale_out, long long* good_steps_out,
//                         float growth_factor, float backoff_factor, long long growth_interval,
//                         float min_scale, float max_scale)
//     One thread (launch <<<1, 1>>>; extra threads do nothing). finite: good + 1, and when that
//     reaches growth_interval scale' = min(scale * growth, max_scale), good' = 0; not finite:
//     scale' = max(scale * backoff, min_scale), good' = 0. Outputs may alias inputs. The scale is
//     f32 (mpc.loss_scale), the count i64 (mpc.good_steps).
// train_lr_schedule(const long long* step, const float* peak, float* lr, int kind, long long warmup,
//                   long long total, float min_ratio, float start_ratio, long long step_size,
//                   float gamma)
//     One thread (launch <<<1, 1>>>). *lr = the rate after *step applied updates at the peak
//     rate *peak, computed in f64 and rounded once (runtime/src/cpu/train.rs `scheduled_rate`
//     gives each curve). kind: 0 constant, 1 linear, 2 cosine, 3 step, 4 one-cycle.
//
// ---- SeededDropout (training-mode Dropout with a counter-based mask)
// train_seeded_dropout_<T>(const T* x, const long long* key, const double* ratio_ptr, T* y,
//                          unsigned char* mask, long long n, long long seed, double ratio)
//     Element i (row-major) draws u_i = (mix(mix(key ^ mix(seed)) + (i + 1) * phi) >> 40) / 2^24
//     (splitmix64 finalizer, phi = 0x9E3779B97F4A7C15, 64-bit wrapping), is kept when
//     u_i >= ratio, and y = keep ? x * (1 / (1 - ratio)) : 0 computed in f64 and rounded through
//     f32 into T (f64 stays f64). `key` is the i64 state mpc.rng on the device; ratio is read
//     from ratio_ptr (a device f64 scalar: the op's ratio input cast to f64) when not nullptr,
//     else the `ratio` argument (0.5 when the op has no ratio input). mask (bool) may be
//     nullptr. The host validates 0 <= ratio < 1. T in f32 f16 bf16 f64.
//
// ---- Element-wise gradients (same-shape operands, n elements; T in f32 f16 bf16 f64)
// train_relu_grad_<T>(const T* dy, const T* y, T* dx, long long n)      dx = y > 0 ? dy : 0
// train_gelu_grad_<T>(const T* dy, const T* x, T* dx, long long n, int approximate_tanh, int vec)
//     dx = dy * (Phi(x) + x phi(x)), or for tanh: dy * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi)
//     (1 + 3 * 0.044715 x^2)), t = tanh(sqrt(2/pi) (x + 0.044715 x^3)). `vec`: 16 bytes at a time
//     (n a multiple of 16 / sizeof(T) and every tensor 16-byte aligned; the grid walks that many
//     fewer units).

// ---------------------------------------------------------------- AllFinite

__device__ __forceinline__ bool finite_bits(const float* p, long long i) {
    return (__float_as_uint(p[i]) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool finite_bits(const __half* p, long long i) {
    return (__half_as_ushort(p[i]) & 0x7c00u) != 0x7c00u;
}
__device__ __forceinline__ bool finite_bits(const __nv_bfloat16* p, long long i) {
    return (__bfloat16_as_ushort(p[i]) & 0x7f80u) != 0x7f80u;
}
__device__ __forceinline__ bool finite_bits(const double* p, long long i) {
    return (__double_as_longlong(p[i]) & 0x7ff0000000000000LL) != 0x7ff0000000000000LL;
}

MPC_KERNEL train_all_finite_init(unsigned char* finite) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *finite = 1;
}

template <typename T>
__device__ __forceinline__ void all_finite_range(const T* x, long long n, long long first, long long step,
                                                 unsigned char* finite) {
    bool ok = true;
    for (long long i = first; i < n; i += step) ok &= finite_bits(x, i);
    if (!ok) *finite = 0;
}

#define ALL_FINITE_T(T, tag)                                                                          \
    MPC_KERNEL train_all_finite_##tag(const T* x, long long n, unsigned char* finite) {               \
        all_finite_range(x, n, (long long)blockIdx.x * blockDim.x + threadIdx.x,                      \
                         (long long)blockDim.x * gridDim.x, finite);                                  \
    }
ALL_FINITE_T(float, f32)
ALL_FINITE_T(__half, f16)
ALL_FINITE_T(__nv_bfloat16, bf16)
ALL_FINITE_T(double, f64)

// Whether the block's share of elements [s, e) of x are all finite: 16 bytes at a time from s
// (a multiple of 16 bytes' elements) where x starts on 16 bytes, the rest one at a time.
template <typename T>
__device__ __forceinline__ bool finite_chunk(const T* x, long long s, long long e) {
    constexpr int per = 16 / (int)sizeof(T);
    const long long ev = (unsigned long long)x % 16 == 0 ? s + (e - s) / per * per : s;
    bool ok = true;
    for (long long i = s + (long long)per * threadIdx.x; i < ev; i += (long long)per * blockDim.x) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + i);
        const T* lane = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int q = 0; q < per; ++q) ok &= finite_bits(lane, q);
    }
    for (long long i = ev + threadIdx.x; i < e; i += blockDim.x) ok &= finite_bits(x, i);
    return ok;
}

MPC_KERNEL train_all_finite_multi(const unsigned long long* ptrs, const long long* sizes, const int* dtypes,
                                  const int* chunk_tensor, const long long* chunk_start, long long chunks,
                                  long long chunk, unsigned char* finite) {
    bool ok = true;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        const int t = chunk_tensor[c];
        const long long s = chunk_start[c];
        const long long e = s + chunk < sizes[t] ? s + chunk : sizes[t];
        switch (dtypes[t]) {
        case 0: ok &= finite_chunk((const float*)ptrs[t], s, e); break;
        case 1: ok &= finite_chunk((const __half*)ptrs[t], s, e); break;
        case 2: ok &= finite_chunk((const __nv_bfloat16*)ptrs[t], s, e); break;
        case 3: ok &= finite_chunk((const double*)ptrs[t], s, e); break;
        default: break;
        }
    }
    if (!ok) *finite = 0;
}

// ---------------------------------------------------------------- unscale

template <typename T> __device__ __forceinline__ void unscale_body(const T* g, const float* scale, T* out, long long n,
                                                                   unsigned char* finite) {
    const float inv = round_to<T>(1.f / *scale);
    bool ok = true;
    MPC_GRID_STRIDE(i, n) {
        const float r = ld(g, i) * inv;
        st(out, i, r);
        if (finite) ok &= (bool)isfinite(round_to<T>(r));
    }
    if (finite && !ok) *finite = 0;
}
#define UNSCALE_T(T, tag)                                                                             \
    MPC_KERNEL train_unscale_##tag(const T* grad, const float* scale, T* out, long long n) {          \
        unscale_body(grad, scale, out, n, nullptr);                                                   \
    }                                                                                                 \
    MPC_KERNEL train_unscale_all_finite_##tag(const T* grad, const float* scale, T* out, long long n, \
                                              unsigned char* finite) {                                \
        unscale_body(grad, scale, out, n, finite);                                                    \
    }
UNSCALE_T(float, f32)
UNSCALE_T(__half, f16)
UNSCALE_T(__nv_bfloat16, bf16)

// ---------------------------------------------------------------- SGD

template <typename T>
__device__ __forceinline__ void copy_if_moved(const T* src, T* dst, long long n) {
    if (dst == nullptr || src == nullptr || (const void*)dst == (const void*)src) return;
    MPC_GRID_STRIDE(i, n) { dst[i] = src[i]; }
}

// The gradient in the parameter's compute type C, unscaled when `inv` is given.
template <typename C, typename G>
__device__ __forceinline__ C grad_at(const G* grad, const float* inv, long long i) {
    const C d = (C)ld(grad, i);
    return inv ? d * (C)*inv : d;
}

// The parameter's low-precision copy (an update's low/low_out/low_code arguments): code 1 f16,
// 2 bf16, anything else none. The new parameter `w` (already rounded to T) is stored rounded to
// nearest even, as a Cast of it would be; a skipped step copies the copy when it moves.
struct LowCopy {
    void* out;
    const void* in;
    int code;
    __device__ __forceinline__ void store(long long i, float w) const {
        if (code == 1) st((__half*)out, i, w);
        else if (code == 2) st((__nv_bfloat16*)out, i, w);
    }
    __device__ __forceinline__ void store(long long i, double w) const { store(i, (float)w); }
    __device__ __forceinline__ void keep(long long n) const {
        if (code == 1) copy_if_moved((const __half*)in, (__half*)out, n);
        else if (code == 2) copy_if_moved((const __nv_bfloat16*)in, (__nv_bfloat16*)out, n);
    }
};

template <typename T, typename G>
__device__ __forceinline__ void sgd_body(const T* param, const G* grad, const float* inv, const unsigned char* finite,
                                         const T* vel, T* param_out, T* vel_out, long long n, float lr, float mu,
                                         float wd, int nesterov, LowCopy low) {
    typedef typename Acc<T>::type C;
    if (!*finite) {
        copy_if_moved(param, param_out, n);
        if (vel) copy_if_moved(vel, vel_out, n);
        low.keep(n);
        return;
    }
    MPC_GRID_STRIDE(i, n) {
        const C p = ld(param, i);
        const C d = grad_at<C>(grad, inv, i) + (C)wd * p;
        C step = d;
        if (vel) {
            const C v = (C)mu * ld(vel, i) + d;
            st(vel_out, i, v);
            step = nesterov ? d + (C)mu * v : v;
        }
        const C w = round_to<T>(p - (C)lr * step);
        st(param_out, i, w);
        low.store(i, w);
    }
}

// ---------------------------------------------------------------- Adam / AdamW

// Adam's bias corrections 1 - b^t for t = max(*step, 1), computed in f64.
template <typename C>
__device__ __forceinline__ void bias_corrections(const long long* step, float b1, float b2, C* c1, C* c2) {
    const long long t = *step > 1 ? *step : 1;
    *c1 = (C)(1.0 - pow((double)b1, (double)t));
    *c2 = (C)(1.0 - pow((double)b2, (double)t));
}

// One element of Adam or AdamW from its values: `d` is the gradient, widened and unscaled; the new
// weight (rounded to T), first and second moments.
template <typename T>
__device__ __forceinline__ void adam_one(AccT<T> d, AccT<T> w, AccT<T> m, AccT<T> v, AccT<T> c1, AccT<T> c2, float lr,
                                         float b1, float b2, float eps, float wd, int decoupled, AccT<T>& next,
                                         AccT<T>& mn, AccT<T>& vn) {
    typedef AccT<T> C;
    const C one = C(1);
    if (decoupled)
        w -= (C)lr * (C)wd * w;
    else
        d += (C)wd * w;
    mn = (C)b1 * m + (one - (C)b1) * d;
    vn = (C)b2 * v + (one - (C)b2) * d * d;
    next = round_to<T>(w - (C)lr * (mn / c1) / (m_sqrt(vn / c2) + (C)eps));
}

// One element of Adam or AdamW: `d` is the gradient, widened and unscaled.
template <typename T>
__device__ __forceinline__ void adam_at(long long i, AccT<T> d, const T* param, const T* m, const T* v, T* param_out,
                                        T* m_out, T* v_out, AccT<T> c1, AccT<T> c2, float lr, float b1, float b2,
                                        float eps, float wd, int decoupled, const LowCopy& low) {
    typedef AccT<T> C;
    C next, mn, vn;
    adam_one<T>(d, ld(param, i), ld(m, i), ld(v, i), c1, c2, lr, b1, b2, eps, wd, decoupled, next, mn, vn);
    st(m_out, i, mn);
    st(v_out, i, vn);
    st(param_out, i, next);
    low.store(i, next);
}

template <typename T, typename G>
__device__ __forceinline__ void adam_body(const T* param, const G* grad, const float* inv, const T* m, const T* v,
                                          const long long* step, const unsigned char* finite, T* param_out, T* m_out,
                                          T* v_out, long long n, float lr, float b1, float b2, float eps, float wd,
                                          int decoupled, LowCopy low) {
    typedef typename Acc<T>::type C;
    if (!*finite) {
        copy_if_moved(param, param_out, n);
        copy_if_moved(m, m_out, n);
        copy_if_moved(v, v_out, n);
        low.keep(n);
        return;
    }
    C c1, c2;
    bias_corrections(step, b1, b2, &c1, &c2);
    MPC_GRID_STRIDE(i, n) {
        adam_at(i, grad_at<C>(grad, inv, i), param, m, v, param_out, m_out, v_out, c1, c2, lr, b1, b2, eps, wd,
                decoupled, low);
    }
}

// ---- Many updates in one launch

// A gradient of dtype code 0 f32, 1 f16, 2 bf16, 3 f64, widened to C and unscaled as grad_at.
template <typename C>
__device__ __forceinline__ C grad_of_code(const void* g, int code, const float* inv, long long i) {
    C d;
    if (code == 1)
        d = (C)ld((const __half*)g, i);
    else if (code == 2)
        d = (C)ld((const __nv_bfloat16*)g, i);
    else if (code == 3)
        d = (C)((const double*)g)[i];
    else
        d = (C)((const float*)g)[i];
    return inv ? d * (C)*inv : d;
}

// The block copies [s, e) of src to dst when they differ.
template <typename T>
__device__ __forceinline__ void copy_block(const void* src, void* dst, long long s, long long e) {
    if (src == dst || src == nullptr || dst == nullptr) return;
    for (long long i = s + threadIdx.x; i < e; i += blockDim.x) ((T*)dst)[i] = ((const T*)src)[i];
}

// Bytes of a gradient of dtype code 0 f32, 1 f16, 2 bf16, 3 f64.
__device__ __forceinline__ int code_size(int code) { return code == 3 ? 8 : (code == 1 || code == 2) ? 2 : 4; }

// V gradients from i on, widened and unscaled as grad_of_code does each.
template <int V, typename C>
__device__ __forceinline__ void grads_of_code(const void* g, int code, const float* inv, long long i, C* d) {
    if (code == 3) {
        double t[V];
        ldv<V>((const double*)g, i, t);
#pragma unroll
        for (int q = 0; q < V; ++q) d[q] = (C)t[q];
    } else {
        float t[V];
        if (code == 1)
            ldv<V>((const __half*)g, i, t);
        else if (code == 2)
            ldv<V>((const __nv_bfloat16*)g, i, t);
        else
            ldv<V>((const float*)g, i, t);
#pragma unroll
        for (int q = 0; q < V; ++q) d[q] = (C)t[q];
    }
    if (inv) {
#pragma unroll
        for (int q = 0; q < V; ++q) d[q] = d[q] * (C)*inv;
    }
}

template <typename T>
__device__ __forceinline__ void adam_multi_body(const unsigned long long* ptrs, const long long* sizes,
                                                const int* codes, const int* chunk_tensor,
                                                const long long* chunk_start, long long chunks, long long chunk,
                                                const float* inv, const long long* step,
                                                const unsigned char* finite, float lr, float b1, float b2, float eps,
                                                float wd, int decoupled) {
    typedef AccT<T> C;
    constexpr int V = 4;
    C c1, c2;
    bias_corrections(step, b1, b2, &c1, &c2);
    const bool ok = *finite != 0;
    for (long long c = blockIdx.x; c < chunks; c += gridDim.x) {
        const int k = chunk_tensor[c];
        const unsigned long long* p = ptrs + 9 * (long long)k;
        const long long s = chunk_start[c];
        const long long e = s + chunk < sizes[k] ? s + chunk : sizes[k];
        const LowCopy low{(void*)p[8], (const void*)p[7], codes[2 * k + 1]};
        if (!ok) {
            copy_block<T>((const void*)p[0], (void*)p[4], s, e);
            copy_block<T>((const void*)p[2], (void*)p[5], s, e);
            copy_block<T>((const void*)p[3], (void*)p[6], s, e);
            if (low.code == 1 || low.code == 2) copy_block<unsigned short>(low.in, low.out, s, e);
            continue;
        }
        const T* param = (const T*)p[0];
        const T* m = (const T*)p[2];
        const T* v = (const T*)p[3];
        T* param_out = (T*)p[4];
        T* m_out = (T*)p[5];
        T* v_out = (T*)p[6];
        const void* grad = (const void*)p[1];
        const int gcode = codes[2 * k];
        // V elements at a time where every tensor of the tensor's update starts on V elements'
        // bytes (each element as adam_at computes it: the same bits), the rest one at a time.
        const unsigned long long wide = (p[0] | p[2] | p[3] | p[4] | p[5] | p[6]) % (V * sizeof(T));
        const bool lows = low.code == 1 || low.code == 2;
        const bool aligned = wide == 0 && p[1] % (V * code_size(gcode)) == 0 && (!lows || p[8] % (V * 2) == 0);
        const long long ev = aligned ? s + (e - s) / V * V : s;
        for (long long i = s + V * threadIdx.x; i < ev; i += V * blockDim.x) {
            C d[V], w[V], mm[V], vv[V], next[V], mn[V], vn[V];
            grads_of_code<V>(grad, gcode, inv, i, d);
            ldv<V>(param, i, w);
            ldv<V>(m, i, mm);
            ldv<V>(v, i, vv);
#pragma unroll
            for (int q = 0; q < V; ++q)
                adam_one<T>(d[q], w[q], mm[q], vv[q], c1, c2, lr, b1, b2, eps, wd, decoupled, next[q], mn[q], vn[q]);
            stv<V>(m_out, i, mn);
            stv<V>(v_out, i, vn);
            stv<V>(param_out, i, next);
            if (lows) {
                float f[V];
#pragma unroll
                for (int q = 0; q < V; ++q) f[q] = (float)next[q];
                if (low.code == 1)
                    stv<V>((__half*)low.out, i, f);
                else
                    stv<V>((__nv_bfloat16*)low.out, i, f);
            }
        }
        for (long long i = ev + threadIdx.x; i < e; i += blockDim.x) {
            adam_at(i, grad_of_code<C>(grad, gcode, inv, i), param, m, v, param_out, m_out, v_out, c1, c2, lr, b1, b2,
                    eps, wd, decoupled, low);
        }
    }
}

#define UPDATE_T(T, tag, G, gtag)                                                                     \
    MPC_KERNEL train_sgd_##tag##_##gtag(const T* param, const G* grad, const float* inv_scale,             \
                                        const unsigned char* finite, const T* velocity, T* param_out,      \
                                        T* velocity_out, long long n, float lr, const float* lr_ptr,       \
                                        float momentum, float weight_decay, int nesterov, void* low_out,   \
                                        const void* low, int low_code) {                                   \
        sgd_body(param, grad, inv_scale, finite, velocity, param_out, velocity_out, n,                     \
                 lr_ptr ? *lr_ptr : lr, momentum,                                                          \
                 weight_decay, nesterov, LowCopy{low_out, low, low_code});                                 \
    }                                                                                                      \
    MPC_KERNEL train_adam_##tag##_##gtag(const T* param, const G* grad, const float* inv_scale, const T* m, \
                                         const T* v, const long long* step, const unsigned char* finite,   \
                                         T* param_out, T* m_out, T* v_out, long long n, float lr,          \
                                         const float* lr_ptr, float beta1, float beta2, float epsilon,     \
                                         float weight_decay, int decoupled, void* low_out, const void* low, \
                                         int low_code) {                                                   \
        adam_body(param, grad, inv_scale, m, v, step, finite, param_out, m_out, v_out, n,                  \
                  lr_ptr ? *lr_ptr : lr, beta1, beta2,                                                     \
                  epsilon, weight_decay, decoupled, LowCopy{low_out, low, low_code});                      \
    }
#define ADAM_MULTI_T(T, tag)                                                                               \
    MPC_KERNEL train_adam_multi_##tag(const unsigned long long* ptrs, const long long* sizes, const int* codes, \
                                      const int* chunk_tensor, const long long* chunk_start, long long chunks,  \
                                      long long chunk, const float* inv_scale, const long long* step,           \
                                      const unsigned char* finite, float lr, const float* lr_ptr, float beta1,  \
                                      float beta2, float epsilon, float weight_decay, int decoupled) {          \
        adam_multi_body<T>(ptrs, sizes, codes, chunk_tensor, chunk_start, chunks, chunk, inv_scale, step,       \
                           finite, lr_ptr ? *lr_ptr : lr, beta1, beta2, epsilon, weight_decay, decoupled);      \
    }
ADAM_MULTI_T(float, f32)
ADAM_MULTI_T(__half, f16)
ADAM_MULTI_T(__nv_bfloat16, bf16)
ADAM_MULTI_T(double, f64)

UPDATE_T(float, f32, float, f32)
UPDATE_T(float, f32, __half, f16)
UPDATE_T(float, f32, __nv_bfloat16, bf16)
UPDATE_T(__half, f16, __half, f16)
UPDATE_T(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
UPDATE_T(double, f64, double, f64)

// ---------------------------------------------------------------- LossScaleUpdate

MPC_KERNEL train_loss_scale_update(const float* scale, const long long* good_steps, const unsigned char* finite,
                                   float* scale_out, long long* good_steps_out, float growth_factor,
                                   float backoff_factor, long long growth_interval, float min_scale,
                                   float max_scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double s = (double)*scale;
    long long g = *good_steps;
    if (*finite) {
        if (g + 1 >= growth_interval) {
            s = fmin(s * (double)growth_factor, (double)max_scale);
            g = 0;
        } else {
            g = g + 1;
        }
    } else {
        s = fmax(s * (double)backoff_factor, (double)min_scale);
        g = 0;
    }
    *scale_out = __double2float_rn(s);
    *good_steps_out = g;
}

// ---------------------------------------------------------------- LrSchedule

__device__ __forceinline__ double cosine_between(double from, double to, double pct) {
    return to + (from - to) / 2.0 * (cos(3.141592653589793 * pct) + 1.0);
}

MPC_KERNEL train_lr_schedule(const long long* step, const float* peak_ptr, float* lr, int kind, long long warmup,
                             long long total, float min_ratio, float start_ratio, long long step_size, float gamma) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const double s = (double)(*step > 0 ? *step : 0), w = (double)(warmup > 0 ? warmup : 0);
    const double t = (double)(total > 0 ? total : 0), peak = (double)*peak_ptr, floor_ratio = (double)min_ratio;
    double r;
    if (kind == 4) {
        const double rise_end = w - 1.0, end = t - 1.0;
        r = s <= rise_end ? cosine_between(peak * (double)start_ratio, peak, s / rise_end)
                          : cosine_between(peak, peak * floor_ratio, fmin((s - rise_end) / (end - rise_end), 1.0));
    } else if (s < w) {
        r = peak * (s / fmax(w, 1.0));
    } else if (kind == 0) {
        r = peak;
    } else if (kind == 3) {
        r = peak * pow((double)gamma, floor((s - w) / (double)(step_size > 1 ? step_size : 1)));
    } else {
        const double progress = fmin((s - w) / fmax(t - w, 1.0), 1.0);
        const double f = kind == 1 ? 1.0 - progress : 0.5 * (1.0 + cos(3.141592653589793 * progress));
        r = peak * (floor_ratio + (1.0 - floor_ratio) * f);
    }
    *lr = __double2float_rn(r);
}

// ---------------------------------------------------------------- SeededDropout

__device__ __forceinline__ unsigned long long splitmix_mix(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ void dropout_store(float* p, long long i, double v) { p[i] = __double2float_rn(v); }
__device__ __forceinline__ void dropout_store(__half* p, long long i, double v) {
    p[i] = __float2half_rn(__double2float_rn(v));
}
__device__ __forceinline__ void dropout_store(__nv_bfloat16* p, long long i, double v) {
    p[i] = __float2bfloat16_rn(__double2float_rn(v));
}
__device__ __forceinline__ void dropout_store(double* p, long long i, double v) { p[i] = v; }

template <typename T>
__device__ __forceinline__ void dropout_body(const T* x, const long long* key, const double* ratio_ptr, T* y,
                                             unsigned char* mask, long long n, long long seed, double ratio) {
    const double r = ratio_ptr ? *ratio_ptr : ratio;
    const double scale = 1.0 / (1.0 - r);
    const unsigned long long base = splitmix_mix((unsigned long long)*key ^ splitmix_mix((unsigned long long)seed));
    MPC_GRID_STRIDE(i, n) {
        const unsigned long long z =
            splitmix_mix(base + ((unsigned long long)i + 1ull) * 0x9e3779b97f4a7c15ull);
        const double u = (double)(z >> 40) / 16777216.0;
        const bool keep = u >= r;
        dropout_store(y, i, keep ? (double)ld(x, i) * scale : 0.0);
        if (mask) mask[i] = keep ? 1 : 0;
    }
}
#define DROPOUT_T(T, tag)                                                                             \
    MPC_KERNEL train_seeded_dropout_##tag(const T* x, const long long* key, const double* ratio_ptr, T* y, \
                                          unsigned char* mask, long long n, long long seed, double ratio) { \
        dropout_body(x, key, ratio_ptr, y, mask, n, seed, ratio);                                     \
    }
DROPOUT_T(float, f32)
DROPOUT_T(__half, f16)
DROPOUT_T(__nv_bfloat16, bf16)
DROPOUT_T(double, f64)

// ---------------------------------------------------------------- ReluGrad, GeluGrad

template <typename T>
__device__ __forceinline__ void relu_grad_body(const T* dy, const T* y, T* dx, long long n) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(i, n) { st(dx, i, V_relu_grad()((C)ld(dy, i), (C)ld(y, i))); }
}

// GELU's slope at v (exact, or of the tanh approximation).
template <typename T> __device__ __forceinline__ AccT<T> gelu_slope(AccT<T> v, int approximate_tanh) {
    typedef AccT<T> C;
    const C c = C(0.7978845608028654);  // sqrt(2 / pi)
    const C root_2pi = C(2.5066282746310002);
    if (approximate_tanh) {
        const C t = m_tanh(c * (v + C(0.044715) * v * v * v));
        return C(0.5) * (C(1) + t) + C(0.5) * v * (C(1) - t * t) * c * (C(1) + C(3) * C(0.044715) * v * v);
    }
    const C cdf = C(0.5) * (C(1) + m_erf(v / C(1.4142135623730951)));
    const C pdf = m_exp(C(-0.5) * v * v) / root_2pi;
    return cdf + v * pdf;
}

// `vec`: 16 bytes of each tensor at a time (n a multiple of 16 / sizeof(T), every tensor on a
// 16-byte boundary; the grid then walks n / (16 / sizeof(T)) units), each element as one at a time.
template <typename T>
__device__ __forceinline__ void gelu_grad_body(const T* dy, const T* x, T* dx, long long n, int approximate_tanh,
                                               int vec) {
    typedef AccT<T> C;
    constexpr int V = 16 / sizeof(T);
    if (vec) {
        MPC_GRID_STRIDE(q, n / V) {
            const long long i = q * V;
            C g[V], v[V];
            ldv<V>(dy, i, g);
            ldv<V>(x, i, v);
#pragma unroll
            for (int u = 0; u < V; ++u) v[u] = g[u] * gelu_slope<T>(v[u], approximate_tanh);
            stv<V>(dx, i, v);
        }
        return;
    }
    MPC_GRID_STRIDE(i, n) { st(dx, i, ld(dy, i) * gelu_slope<T>(ld(x, i), approximate_tanh)); }
}

#define GRADS_T(T, tag)                                                                               \
    MPC_KERNEL train_relu_grad_##tag(const T* dy, const T* y, T* dx, long long n) { relu_grad_body(dy, y, dx, n); } \
    MPC_KERNEL train_gelu_grad_##tag(const T* dy, const T* x, T* dx, long long n, int approximate_tanh,  \
                                     int vec) {                                                       \
        gelu_grad_body(dy, x, dx, n, approximate_tanh, vec);                                          \
    }
GRADS_T(float, f32)
GRADS_T(__half, f16)
GRADS_T(__nv_bfloat16, bf16)
GRADS_T(double, f64)
