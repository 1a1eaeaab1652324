// kernels/norm.cu: LayerNormalization (forward with Mean/InvStdDev, and its gradient),
// BatchNormalization (inference, training-mode statistics, gradient), InstanceNormalization,
// GroupNormalization, and LRN (at the end of the file).
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
//
// dtypes: every kernel is instantiated for (T, P) = (data, parameter) dtype pairs, named
// `norm_<op>_<T>_<P>`: f32_f32, f16_f16, bf16_bf16, f16_f32, bf16_f32, f64_f64. P is the dtype
// of scale / bias / running statistics. Gradient outputs (dX, dScale, dBias) have dY's dtype T,
// as the type rules of the ai.mpc gradient ops give them. Arithmetic, statistics outputs and
// workspaces are in A = AccT<T>: f32, or f64 for f64 data (written `float` below). Statistics are
// two-pass (mean, then mean of squared deviations: the biased variance), accumulated with
// fixed-order block reductions.
// Launch: the row/channel/plane kernels run one block per row (channel, plane, group),
// grid-stride over them with blockIdx.x: gridDim.x = min(count, 65535), blockDim.x = 256 (a
// multiple of 32 in [32, 256]; the sums' rounding depends on it). Element-wise kernels: 1-D grid
// stride, blockDim.x = 256, any grid.
//
// ---- LayerNormalization over the trailing dims from `axis`: rows = prod(dims before axis),
//      n = prod(dims from axis); scale/bias have scale_n elements broadcast as a suffix of the
//      normalised dims (scale_n divides n; element k of a row uses scale[k % scale_n]).
// norm_layer_norm_<T>_<P>(const T* x, const P* scale, const P* bias, T* y, float* mean,
//                         float* inv_std, long long rows, long long n, long long scale_n, float eps)
//     bias, mean, inv_std may be nullptr. y = (x - mean) * inv_std * scale + bias,
//     inv_std = 1 / sqrt(var + eps). One block per row.
// norm_layer_norm_grad_<T>_<P>(const T* dy, const T* x, const P* scale, T* dx, float* ws_mean,
//                              float* ws_inv_std, long long rows, long long n, long long scale_n, float eps)
//     LayerNormalizationGrad's dX: g = dy * scale, dx = inv_std / n * (n g - sum(g) - xhat sum(g xhat)).
//     Also writes each row's mean and inv_std to the f32 workspaces (rows entries each, required),
//     which the params kernel then reads. One block per row.
// norm_layer_norm_grad_params_<T>_<P>(const T* dy, const T* x, const float* ws_mean,
//                              const float* ws_inv_std, T* dscale, T* dbias, long long rows,
//                              long long n, long long scale_n)
//     dScale[j] = sum of dy * xhat and dBias[j] = sum of dy over every row and every k with
//     k % scale_n == j (dbias may be nullptr). Launch after the grad kernel, blockDim = (32, 8),
//     gridDim.x = ceil(scale_n / 32), gridDim.y = 1: threadIdx.x walks j, threadIdx.y the
//     (row, k / scale_n) pairs modulo 8; the 8 partials are added in order.
// norm_layer_norm_grad_params_split_<T>_<P>(const T* dy, const T* x, const float* ws_mean,
//                              const float* ws_inv_std, float* part_scale, float* part_bias,
//                              long long rows, long long n, long long scale_n, long long splits)
//     The same sums for few, long columns, in two passes: gridDim.y = splits, block y sums its
//     chunk of the (row, repeat) pairs into part_scale[j * splits + y] (part_bias likewise, may
//     be nullptr); reduce_sum_finish_<T> (reduce.cu) then adds each j's partials in order.
//
// norm_layer_norm_f32_f32_y<L>, norm_layer_norm_grad[_params[_split]]_f32_f32_dy<L> (L = f16, bf16)
//     The f32 kernels above with y (forward) or dy (the gradients) in L: a LayerNormalization
//     whose only reader is a Cast to L writes the Cast's values (rounded once, as the Cast
//     would), and a gradient whose dy a Cast from L made reads the Cast's input (widened as it
//     loads). The same arguments and launch; the results are the unfused launches' bits.
//
// ---- BatchNormalization over x = (N, C, inner) (inner = prod of the spatial dims)
// norm_batch_norm_infer_<T>_<P>(const T* x, const P* scale, const P* bias, const P* mean,
//                               const P* var, const T* res, T* y, long long n, long long c,
//                               long long inner, float eps)
//     y = (x - mean) * k + bias, k = scale / sqrt(var + eps) (per channel, f32). Element-wise.
//     Every batch-norm kernel that writes y takes a last argument `int relu`: y = relu(that)
//     when 1 (a Relu that was y's only reader, applied before the store: the same bits); and a
//     residual `res` before y (x's shape, may be nullptr): y = relu?(round(that) + res), the
//     value rounded to T as its store would round it, then a residual block's Add of its
//     shortcut (the Add's and the Relu's bits).
// norm_batch_norm_train_<T>_<P>(const T* x, const P* scale, const P* bias, const P* running_mean,
//                               const P* running_var, const T* res, T* y, P* running_mean_out,
//                               P* running_var_out, float* save_mean, float* save_var, long long n,
//                               long long c, long long inner, float eps, float momentum)
//     Batch statistics (biased variance) per channel; y as above with them; running_*_out =
//     running * momentum + batch * (1 - momentum) (may alias running_*); save_mean / save_var
//     (f32, c entries) may be nullptr. One block per channel.
// norm_batch_norm_grad_<T>_<P>(const T* dy, const T* ry, const T* x, const P* scale, T* dx,
//                              T* dscale, T* dbias, long long n, long long c, long long inner,
//                              float eps)
//     BatchNormalizationGrad: dBias = sum dy, dScale = sum dy xhat, dx = scale / (sigma M) *
//     (M dy - dBias - xhat dScale), M = n * inner. One block per channel. Where ry (the output
//     of the ReLU after the batch norm, x's shape) is not null, every dy is read through the
//     ReLU's gradient: dy where ry > 0, 0 elsewhere (train_relu_grad's values), here and in
//     the passes below.
//
// ---- The same in passes, for channels of many elements (gridDim = (splits, c), blockDim.x = 256):
//      block (s, ch) takes the statistics of chunk s of channel ch's n * inner elements, in units
//      of `vec ? V : 1` elements (V = 16 / sizeof(T): 16-byte loads, where inner is a multiple of
//      V and every tensor 16-byte aligned): each thread's count, mean and M2 (its elements
//      shifted by its first, so the squares do not cancel), merged pairwise (Chan et al.) in a
//      fixed order into part_*[ch * splits + s] (A); a finish kernel (one thread per channel)
//      merges each channel's splits in order and leaves per-channel coefficients that an
//      element-wise kernel applies.
// norm_bn_stats_<T>(const T* x, A* part_n, A* part_mean, A* part_m2, long long n, long long c,
//                   long long inner, long long splits, int vec)
//     the count, mean and sum of squared deviations of each chunk.
// norm_bn_grad_stats_<T>(const T* dy, const T* ry, const T* x, A* part_n, A* part_mean, A* part_m2,
//                        A* part_g, A* part_gd, n, c, inner, splits, vec)
//     the same, with the sums of dy and of dy * (x - the chunk's mean): x and dy read once.
// norm_bn_finish_<T>_<P>(const A* part_n, const A* part_mean, const A* part_m2, const P* scale,
//                        const P* running_mean, const P* running_var, A* mean, A* k,
//                        P* running_mean_out, P* running_var_out, long long c, long long splits,
//                        float eps, float momentum)
//     the channel's mean, biased var = M2 / M (M = n * inner) and k = scale / sqrt(var + eps);
//     the running statistics as norm_batch_norm_train.
// norm_bn_apply_<T>_<P>(const T* x, const A* mean, const A* k, const P* bias, const T* res, T* y,
//                       long long n, long long c, long long inner, int vec, int relu)
//     Element-wise (1-D grid stride over the n * c * inner / v units): y = (x - mean) * k + bias.
// norm_bn_grad_finish_<T>_<P>(const A* part_n, const A* part_mean, const A* part_m2,
//                             const A* part_g, const A* part_gd, const P* scale, A* mean,
//                             A* alpha, A* beta, A* gamma, T* dscale, T* dbias, long long c,
//                             long long splits, float eps)
//     With inv = 1 / sqrt(var + eps), g = sum dy and gd = sum dy (x - mean): dScale = gd inv,
//     dBias = g (either may be nullptr); the coefficients of dx = alpha dy + beta (x - mean) +
//     gamma: alpha = scale inv, beta = -scale inv^3 gd / M, gamma = -scale inv g / M
//     (norm_batch_norm_grad's dx, expanded).
// norm_bn_grad_apply_<T>(const T* dy, const T* ry, const T* x, const A* mean, const A* alpha,
//                        const A* beta, const A* gamma, T* dx, long long n, long long c,
//                        long long inner, int vec)
//     Element-wise, as norm_bn_apply.
//
// ---- InstanceNormalization and GroupNormalization over x = (N, C, inner)
// norm_instance_norm_<T>_<P>(const T* x, const P* scale, const P* bias, T* y, long long n,
//                            long long c, long long inner, float eps)
//     per (image, channel) plane: y = (x - mean) / sqrt(var + eps) * scale[c] + bias[c].
//     One block per plane (n * c blocks).
// norm_group_norm_<T>_<P>(const T* x, const P* scale, const P* bias, T* y, long long n,
//                         long long c, long long groups, long long inner, float eps)
//     per (image, group) of c / groups channels: y = (x - mean) / sqrt(var + eps) * scale[ch]
//     + bias[ch] (scale and bias per channel). One block per (image, group) (n * groups blocks).

__device__ __forceinline__ float pld(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float pld(const __half* p, long long i) { return __half2float(p[i]); }
__device__ __forceinline__ float pld(const __nv_bfloat16* p, long long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ double pld(const double* p, long long i) { return p[i]; }

// The mean and biased variance of `count` elements at(base, k): two passes, every thread of the
// block, over the data shifted by its first element K. The sums are of x - K (exact for a constant
// row, small for a large mean with a small spread), and each element's deviation is taken as
// (x - K) - Σ(x - K)/count, so it keeps its digits where x - mean, with a plain f32 sum's mean
// ulps off, does not: an epsilon of 1e-12 (BERT's) turned those ulps into outputs off by up to 1.
template <typename A> struct Stats {
    A shift, dmean, var;
    __device__ __forceinline__ A mean() const { return shift + dmean; }
    __device__ __forceinline__ A dev(A v) const { return (v - shift) - dmean; }
};

template <typename T, typename At>
__device__ __forceinline__ Stats<AccT<T>> block_stats(const T* x, long long count, At at, AccT<T>* smem) {
    typedef AccT<T> A;
    const A K = count > 0 ? (A)ld(x, at(0)) : A(0);
    A s = A(0);
    for (long long k = threadIdx.x; k < count; k += blockDim.x) s += (A)ld(x, at(k)) - K;
    s = block_reduce(s, OpSum(), smem);
    Stats<A> out;
    out.shift = K;
    out.dmean = s / (A)count;
    A q = A(0);
    for (long long k = threadIdx.x; k < count; k += blockDim.x) {
        const A d = out.dev(ld(x, at(k)));
        q += d * d;
    }
    q = block_reduce(q, OpSum(), smem);
    out.var = q / (A)count;
    return out;
}

struct Contig {
    long long base;
    __device__ __forceinline__ long long operator()(long long k) const { return base + k; }
};
// Channel ch of (N, C, inner): the k-th element over (image, position).
struct Channel {
    long long c, inner, ch;
    __device__ __forceinline__ long long operator()(long long k) const {
        const long long b = index_div(k, inner);
        return (b * c + ch) * inner + (k - b * inner);
    }
};

// ---------------------------------------------------------------- LayerNormalization

template <typename T, typename P, typename Y>
__device__ __forceinline__ void layer_norm_body(const T* x, const P* scale, const P* bias, Y* y, AccT<T>* mean_out,
                                                AccT<T>* inv_out, long long rows, long long n, long long scale_n,
                                                float eps) {
    typedef AccT<T> A;
    __shared__ A smem[32];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Contig at{row * n};
        const Stats<A> stats = block_stats(x, n, at, smem);
        const A mean = stats.mean(), var = stats.var;
        const A r = A(1) / m_sqrt(var + eps);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const long long j = index_mod(k, scale_n);
            A v = stats.dev(ld(x, at(k))) * r * pld(scale, j);
            if (bias) v += pld(bias, j);
            st(y, at(k), v);
        }
        if (threadIdx.x == 0) {
            if (mean_out) mean_out[row] = mean;
            if (inv_out) inv_out[row] = r;
        }
    }
}

template <typename T, typename P, typename D>
__device__ __forceinline__ void layer_norm_grad_body(const D* dy, const T* x, const P* scale, T* dx, AccT<T>* ws_mean,
                                                     AccT<T>* ws_inv, long long rows, long long n, long long scale_n,
                                                     float eps) {
    typedef AccT<T> A;
    __shared__ A smem[64];
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const Contig at{row * n};
        const Stats<A> stats = block_stats(x, n, at, smem);
        const A mean = stats.mean(), var = stats.var;
        const A r = A(1) / m_sqrt(var + eps);
        A s1 = A(0), s2 = A(0);
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const A g = ld(dy, at(k)) * pld(scale, index_mod(k, scale_n));
            s1 += g;
            s2 += g * (stats.dev(ld(x, at(k))) * r);
        }
        block_reduce2(s1, s2, OpSum(), smem);
        const A nf = (A)n;
        for (long long k = threadIdx.x; k < n; k += blockDim.x) {
            const A xhat = stats.dev(ld(x, at(k))) * r;
            const A g = ld(dy, at(k)) * pld(scale, index_mod(k, scale_n));
            st(dx, at(k), r / nf * (nf * g - s1 - xhat * s2));
        }
        if (threadIdx.x == 0) {
            ws_mean[row] = mean;
            ws_inv[row] = r;
        }
    }
}

// The sums of dy * xhat and dy over the (row, repeat) pairs [t0, t1) for feature j of each of the
// block's 32 columns: threadIdx.y walks the pairs modulo 8, and the 8 partials are added in order.
// `*scale_sum` and `*bias_sum` are valid in the threads with threadIdx.y == 0 and j < scale_n.
template <typename T, typename D>
__device__ __forceinline__ void layer_norm_params_sums(const D* dy, const T* x, const AccT<T>* ws_mean,
                                                       const AccT<T>* ws_inv, long long j, long long t0, long long t1,
                                                       long long per_row, long long scale_n, AccT<T> (*sa)[33],
                                                       AccT<T> (*sb)[33], AccT<T>* scale_sum, AccT<T>* bias_sum) {
    typedef AccT<T> A;
    const int tx = threadIdx.x, ty = threadIdx.y;
    A a = A(0), b = A(0);
    if (j < scale_n) {
        for (long long t = t0 + ty; t < t1; t += 8) {
            const long long row = per_row == 1 ? t : index_div(t, per_row);
            const long long at = t * scale_n + j;  // = row * n + (t % per_row) * scale_n + j
            const A g = ld(dy, at);
            a += g * ((ld(x, at) - ws_mean[row]) * ws_inv[row]);
            b += g;
        }
    }
    sa[ty][tx] = a;
    sb[ty][tx] = b;
    __syncthreads();
    if (ty == 0 && j < scale_n) {
        A u = sa[0][tx], v = sb[0][tx];
#pragma unroll
        for (int k = 1; k < 8; ++k) {
            u += sa[k][tx];
            v += sb[k][tx];
        }
        *scale_sum = u;
        *bias_sum = v;
    }
    __syncthreads();
}

template <typename T, typename D>
__device__ __forceinline__ void layer_norm_grad_params_body(const D* dy, const T* x, const AccT<T>* ws_mean,
                                                            const AccT<T>* ws_inv, T* dscale, T* dbias, long long rows,
                                                            long long n, long long scale_n) {
    typedef AccT<T> A;
    __shared__ A sa[8][33];
    __shared__ A sb[8][33];
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    const long long per_row = n / scale_n;  // scale repeats per row
    A u = A(0), v = A(0);
    layer_norm_params_sums(dy, x, ws_mean, ws_inv, j, 0, rows * per_row, per_row, scale_n, sa, sb, &u, &v);
    if (threadIdx.y == 0 && j < scale_n) {
        st(dscale, j, u);
        if (dbias) st(dbias, j, v);
    }
}

template <typename T, typename D>
__device__ __forceinline__ void layer_norm_grad_params_split_body(const D* dy, const T* x, const AccT<T>* ws_mean,
                                                                  const AccT<T>* ws_inv, AccT<T>* part_scale,
                                                                  AccT<T>* part_bias, long long rows, long long n,
                                                                  long long scale_n, long long splits) {
    typedef AccT<T> A;
    __shared__ A sa[8][33];
    __shared__ A sb[8][33];
    const long long j = (long long)blockIdx.x * 32 + threadIdx.x;
    const long long per_row = n / scale_n;
    const long long total = rows * per_row;
    const long long chunk = (total + splits - 1) / splits;
    for (long long s = blockIdx.y; s < splits; s += gridDim.y) {
        const long long t0 = s * chunk;
        const long long t1 = t0 + chunk < total ? t0 + chunk : total;
        A u = A(0), v = A(0);
        layer_norm_params_sums(dy, x, ws_mean, ws_inv, j, t0, t1, per_row, scale_n, sa, sb, &u, &v);
        if (threadIdx.y == 0 && j < scale_n) {
            part_scale[j * splits + s] = u;
            if (part_bias) part_bias[j * splits + s] = v;
        }
    }
}

// ---------------------------------------------------------------- BatchNormalization

// A batch norm's output value, through the Relu that reads only it when `relu` (the launch's
// epilogue; elementwise.cu's relu, so the bits are the unfused Relu's).
template <typename A> __device__ __forceinline__ A bn_out(A v, int relu) {
    return relu ? U_relu()(v, A(0), A(0)) : v;
}

// A value kept apart from the arithmetic around it (no FMA contracted across a rounding).
__device__ __forceinline__ float bn_keep(float v) { return mpc_keep(v); }
__device__ __forceinline__ double bn_keep(double v) { return v; }

// A batch norm's value v of element i with the residual r added where there is one (the Add
// after the batch norm, of its stored value: rounded to T first), through the Relu as bn_out.
template <typename T> __device__ __forceinline__ AccT<T> bn_res_out(AccT<T> v, const T* res, AccT<T> r, int relu) {
    return bn_out(res ? V_add()(bn_keep(round_to<T>(v)), r) : v, relu);
}

template <typename T, typename P>
__device__ __forceinline__ void batch_norm_infer_body(const T* x, const P* scale, const P* bias, const P* mean,
                                                      const P* var, const T* res, T* y, long long n, long long c,
                                                      long long inner, float eps, int relu) {
    typedef AccT<T> A;
    const long long total = n * c * inner;
    MPC_GRID_STRIDE(i, total) {
        const long long ch = (i / inner) % c;
        const A k = pld(scale, ch) / m_sqrt(pld(var, ch) + eps);
        const AccT<T> r = res ? ld(res, i) : AccT<T>(0);
        st(y, i, bn_res_out<T>((ld(x, i) - pld(mean, ch)) * k + pld(bias, ch), res, r, relu));
    }
}

template <typename T, typename P>
__device__ __forceinline__ void batch_norm_train_body(const T* x, const P* scale, const P* bias, const P* rmean,
                                                      const P* rvar, const T* res, T* y, P* rmean_out, P* rvar_out,
                                                      AccT<T>* save_mean,
                                                      AccT<T>* save_var, long long n, long long c, long long inner,
                                                      float eps, float momentum, int relu) {
    typedef AccT<T> A;
    __shared__ A smem[32];
    const long long count = n * inner;
    for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
        const Channel at{c, inner, ch};
        const Stats<A> stats = block_stats(x, count, at, smem);
        const A mean = stats.mean(), var = stats.var;
        const A k = pld(scale, ch) / m_sqrt(var + eps);
        const A b = pld(bias, ch);
        for (long long e = threadIdx.x; e < count; e += blockDim.x) {
            const A r = res ? ld(res, at(e)) : A(0);
            st(y, at(e), bn_res_out<T>(stats.dev(ld(x, at(e))) * k + b, res, r, relu));
        }
        if (threadIdx.x == 0) {
            const A rm = pld(rmean, ch), rv = pld(rvar, ch);
            st(rmean_out, ch, rm * momentum + mean * (A(1) - momentum));
            st(rvar_out, ch, rv * momentum + var * (A(1) - momentum));
            if (save_mean) save_mean[ch] = mean;
            if (save_var) save_var[ch] = var;
        }
    }
}

// dy[i] as a batch norm's gradient reads it: through the ReLU's gradient where ry is given.
template <typename T> __device__ __forceinline__ AccT<T> ld_dy(const T* dy, const T* ry, long long i) {
    return ry && !(ld(ry, i) > AccT<T>(0)) ? AccT<T>(0) : ld(dy, i);
}

// V elements of dy from i as ld_dy reads them, 16 bytes at a time.
template <int V, typename T> __device__ __forceinline__ void ldv_dy(const T* dy, const T* ry, long long i, AccT<T>* gs) {
    ldv<V>(dy, i, gs);
    if (ry) {
        AccT<T> rs[V];
        ldv<V>(ry, i, rs);
#pragma unroll
        for (int q = 0; q < V; ++q) gs[q] = rs[q] > AccT<T>(0) ? gs[q] : AccT<T>(0);
    }
}

template <typename T, typename P>
__device__ __forceinline__ void batch_norm_grad_body(const T* dy, const T* ry, const T* x, const P* scale, T* dx,
                                                     T* dscale, T* dbias, long long n, long long c, long long inner,
                                                     float eps) {
    typedef AccT<T> A;
    __shared__ A smem[64];
    const long long count = n * inner;
    const A cnt = (A)count;
    for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
        const Channel at{c, inner, ch};
        const Stats<A> stats = block_stats(x, count, at, smem);
        const A var = stats.var;
        const A inv = A(1) / m_sqrt(var + eps);
        A sg = A(0), sgx = A(0);
        for (long long e = threadIdx.x; e < count; e += blockDim.x) {
            const A g = ld_dy(dy, ry, at(e));
            sg += g;
            sgx += g * (stats.dev(ld(x, at(e))) * inv);
        }
        block_reduce2(sg, sgx, OpSum(), smem);
        const A k = pld(scale, ch) * inv / cnt;
        for (long long e = threadIdx.x; e < count; e += blockDim.x) {
            const A xhat = stats.dev(ld(x, at(e))) * inv;
            st(dx, at(e), k * (cnt * ld_dy(dy, ry, at(e)) - sg - xhat * sgx));
        }
        if (threadIdx.x == 0) {
            st(dscale, ch, sgx);
            st(dbias, ch, sg);
        }
    }
}

// ---- BatchNormalization in passes

// 16 bytes of T: the elements a batch norm's walks move at a time (ldv and stv of common.cuh).
template <typename T> struct Vec {
    static constexpr int N = 16 / sizeof(T);
};

// f(index of the unit's first element) for this thread's units [u0, u1) of channel ch of
// (N, C, inner), units of v elements, each thread every blockDim.x-th: the plane and the position
// in it move on by constant steps (one division before the loop, none per unit).
template <typename F>
__device__ __forceinline__ void bn_units(long long c, long long inner, long long ch, long long v, long long u0,
                                         long long u1, F f) {
    const long long per = inner / v;  // units in a plane
    long long u = u0 + threadIdx.x;
    long long b = index_div(u, per), j = u - b * per;
    const long long step_b = index_div(blockDim.x, per), step_j = (long long)blockDim.x - step_b * per;
    for (; u < u1; u += blockDim.x) {
        f((b * c + ch) * inner + j * v);
        b += step_b;
        j += step_j;
        if (j >= per) {
            j -= per;
            ++b;
        }
    }
}

// Some elements' statistics: their count, mean and sum of squared deviations from it (M2), with
// the gradient's sums of dy and of dy (x - mean).
template <typename A> struct BnAcc {
    A n, mean, m2, g, gd;
};

// Two sets of elements as one (Chan, Golub and LeVeque's pairwise update): no cancellation where
// a mean is large against the deviations, as a plain sum of squares has.
template <typename A> __device__ __forceinline__ BnAcc<A> bn_merge(const BnAcc<A>& a, const BnAcc<A>& b) {
    if (b.n == A(0)) return a;
    if (a.n == A(0)) return b;
    const A n = a.n + b.n, delta = b.mean - a.mean, wb = b.n / n;
    BnAcc<A> r;
    r.n = n;
    r.mean = a.mean + delta * wb;
    r.m2 = a.m2 + b.m2 + delta * delta * a.n * wb;
    r.g = a.g + b.g;
    r.gd = a.gd + b.gd + (a.mean - r.mean) * a.g + (b.mean - r.mean) * b.g;
    return r;
}

template <typename A> __device__ __forceinline__ BnAcc<A> bn_shfl_down(const BnAcc<A>& v, int off) {
    BnAcc<A> r;
    r.n = __shfl_down_sync(0xffffffffu, v.n, off);
    r.mean = __shfl_down_sync(0xffffffffu, v.mean, off);
    r.m2 = __shfl_down_sync(0xffffffffu, v.m2, off);
    r.g = __shfl_down_sync(0xffffffffu, v.g, off);
    r.gd = __shfl_down_sync(0xffffffffu, v.gd, off);
    return r;
}

// The block's threads' statistics merged in a fixed order (each warp's as a tree, then the
// warps'), returned to every thread.
template <typename A> __device__ BnAcc<A> bn_block_merge(BnAcc<A> v, BnAcc<A>* smem /* 32 */) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = bn_merge(v, bn_shfl_down(v, off));
    __syncthreads();  // smem may still be read from a previous call
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const BnAcc<A> none = {A(0), A(0), A(0), A(0), A(0)};
        BnAcc<A> w = lane < nwarps ? smem[lane] : none;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) w = bn_merge(w, bn_shfl_down(w, off));
        if (lane == 0) smem[0] = w;
    }
    __syncthreads();
    return smem[0];
}

// Block (s, ch): the statistics of chunk s of channel ch (and the sums of dy, where dy is not
// null). Each thread sums its elements shifted by its first one (a value of the data, so the
// squares do not cancel), turns that into its own count, mean and M2, and the block merges them.
template <typename T>
__device__ __forceinline__ void bn_stats_body(const T* dy, const T* ry, const T* x, AccT<T>* part_n, AccT<T>* part_mean,
                                              AccT<T>* part_m2, AccT<T>* part_g, AccT<T>* part_gd, long long n,
                                              long long c, long long inner, long long splits, int vec) {
    typedef AccT<T> A;
    constexpr int V = Vec<T>::N;
    __shared__ BnAcc<A> smem[32];
    const long long v = vec ? V : 1, units = n * inner / v, chunk = (units + splits - 1) / splits;
    for (long long ch = blockIdx.y; ch < c; ch += gridDim.y) {
        for (long long s = blockIdx.x; s < splits; s += gridDim.x) {
            const long long u0 = s * chunk, u1 = u0 + chunk < units ? u0 + chunk : units;
            A k0 = A(0), cnt = A(0), sx = A(0), sxx = A(0), sg = A(0), sgx = A(0);
            auto add = [&](A xv, A g) {
                if (cnt == A(0)) k0 = xv;
                const A d = xv - k0;
                cnt += A(1);
                sx += d;
                sxx += d * d;
                sg += g;
                sgx += g * d;
            };
            if (vec) {
                bn_units(c, inner, ch, V, u0, u1, [&](long long i) {
                    A xs[V], gs[V];
                    ldv<V>(x, i, xs);
                    if (dy) {
                        ldv_dy<V>(dy, ry, i, gs);
                    } else {
#pragma unroll
                        for (int q = 0; q < V; ++q) gs[q] = A(0);
                    }
#pragma unroll
                    for (int q = 0; q < V; ++q) add(xs[q], gs[q]);
                });
            } else {
                bn_units(c, inner, ch, 1, u0, u1, [&](long long i) { add(ld(x, i), dy ? ld_dy(dy, ry, i) : A(0)); });
            }
            BnAcc<A> mine = {A(0), A(0), A(0), A(0), A(0)};
            if (cnt > A(0)) {
                const A m1 = sx / cnt;
                const A m2 = sxx - sx * m1;
                mine = {cnt, k0 + m1, m2 < A(0) ? A(0) : m2, sg, sgx - m1 * sg};
            }
            const BnAcc<A> all = bn_block_merge(mine, smem);
            if (threadIdx.x == 0) {
                const long long at = ch * splits + s;
                part_n[at] = all.n;
                part_mean[at] = all.mean;
                part_m2[at] = all.m2;
                if (dy) {
                    part_g[at] = all.g;
                    part_gd[at] = all.gd;
                }
            }
        }
    }
}

// Channel ch's splits merged in order (the gradient's sums too where `g` is not null).
template <typename A>
__device__ __forceinline__ BnAcc<A> bn_channel(const A* part_n, const A* part_mean, const A* part_m2, const A* part_g,
                                               const A* part_gd, long long ch, long long splits) {
    BnAcc<A> acc = {A(0), A(0), A(0), A(0), A(0)};
    for (long long s = 0; s < splits; ++s) {
        const long long at = ch * splits + s;
        const BnAcc<A> p = {part_n[at], part_mean[at], part_m2[at], part_g ? part_g[at] : A(0),
                            part_g ? part_gd[at] : A(0)};
        acc = bn_merge(acc, p);
    }
    return acc;
}

template <typename T, typename P>
__device__ __forceinline__ void bn_finish_body(const AccT<T>* part_n, const AccT<T>* part_mean, const AccT<T>* part_m2,
                                               const P* scale, const P* rmean, const P* rvar, AccT<T>* mean_out,
                                               AccT<T>* k_out, P* rmean_out, P* rvar_out, long long c,
                                               long long splits, float eps, float momentum) {
    typedef AccT<T> A;
    MPC_GRID_STRIDE(ch, c) {
        const BnAcc<A> s = bn_channel<A>(part_n, part_mean, part_m2, nullptr, nullptr, ch, splits);
        const A var = s.m2 / s.n;
        mean_out[ch] = s.mean;
        k_out[ch] = pld(scale, ch) / m_sqrt(var + eps);
        const A rm = pld(rmean, ch), rv = pld(rvar, ch);
        st(rmean_out, ch, rm * momentum + s.mean * (A(1) - momentum));
        st(rvar_out, ch, rv * momentum + var * (A(1) - momentum));
    }
}

// The channel of element i of (N, C, inner).
__device__ __forceinline__ long long channel_of(long long i, long long c, long long inner) {
    const long long q = index_div(i, inner);
    return q - index_div(q, c) * c;
}

template <typename T, typename P>
__device__ __forceinline__ void bn_apply_body(const T* x, const AccT<T>* mean, const AccT<T>* k, const P* bias,
                                              const T* res, T* y, long long n, long long c, long long inner, int vec,
                                              int relu) {
    typedef AccT<T> A;
    constexpr int V = Vec<T>::N;
    const long long v = vec ? V : 1;
    MPC_GRID_STRIDE(u, n * c * inner / v) {
        const long long i = u * v, ch = channel_of(i, c, inner);
        const A mu = mean[ch], kk = k[ch], b = pld(bias, ch);
        if (vec) {
            A xs[V], rs[V];
            ldv<V>(x, i, xs);
            if (res) {
                ldv<V>(res, i, rs);
            } else {
#pragma unroll
                for (int q = 0; q < V; ++q) rs[q] = A(0);
            }
#pragma unroll
            for (int q = 0; q < V; ++q) xs[q] = bn_res_out<T>((xs[q] - mu) * kk + b, res, rs[q], relu);
            stv<V>(y, i, xs);
        } else {
            const A r = res ? ld(res, i) : A(0);
            st(y, i, bn_res_out<T>((ld(x, i) - mu) * kk + b, res, r, relu));
        }
    }
}

template <typename T, typename P>
__device__ __forceinline__ void bn_grad_finish_body(const AccT<T>* part_n, const AccT<T>* part_mean,
                                                    const AccT<T>* part_m2, const AccT<T>* part_g,
                                                    const AccT<T>* part_gd, const P* scale, AccT<T>* mean_out,
                                                    AccT<T>* alpha, AccT<T>* beta, AccT<T>* gamma, T* dscale,
                                                    T* dbias, long long c, long long splits, float eps) {
    typedef AccT<T> A;
    MPC_GRID_STRIDE(ch, c) {
        const BnAcc<A> s = bn_channel<A>(part_n, part_mean, part_m2, part_g, part_gd, ch, splits);
        const A inv = A(1) / m_sqrt(s.m2 / s.n + eps);
        const A a = pld(scale, ch) * inv;
        mean_out[ch] = s.mean;
        alpha[ch] = a;
        beta[ch] = -a * inv * inv * s.gd / s.n;
        gamma[ch] = -a * s.g / s.n;
        if (dscale) st(dscale, ch, s.gd * inv);
        if (dbias) st(dbias, ch, s.g);
    }
}

template <typename T>
__device__ __forceinline__ void bn_grad_apply_body(const T* dy, const T* ry, const T* x, const AccT<T>* mean,
                                                   const AccT<T>* alpha, const AccT<T>* beta, const AccT<T>* gamma,
                                                   T* dx, long long n, long long c, long long inner, int vec) {
    typedef AccT<T> A;
    constexpr int V = Vec<T>::N;
    const long long v = vec ? V : 1;
    MPC_GRID_STRIDE(u, n * c * inner / v) {
        const long long i = u * v, ch = channel_of(i, c, inner);
        const A mu = mean[ch], a = alpha[ch], b = beta[ch], g = gamma[ch];
        if (vec) {
            A xs[V], gs[V];
            ldv<V>(x, i, xs);
            ldv_dy<V>(dy, ry, i, gs);
#pragma unroll
            for (int q = 0; q < V; ++q) xs[q] = a * gs[q] + b * (xs[q] - mu) + g;
            stv<V>(dx, i, xs);
        } else {
            st(dx, i, a * ld_dy(dy, ry, i) + b * (ld(x, i) - mu) + g);
        }
    }
}

// ---------------------------------------------------------------- Instance / Group

template <typename T, typename P>
__device__ __forceinline__ void instance_norm_body(const T* x, const P* scale, const P* bias, T* y, long long n,
                                                   long long c, long long inner, float eps) {
    typedef AccT<T> A;
    __shared__ A smem[32];
    for (long long plane = blockIdx.x; plane < n * c; plane += gridDim.x) {
        const Contig at{plane * inner};
        const Stats<A> stats = block_stats(x, inner, at, smem);
        const A var = stats.var;
        const A sd = m_sqrt(var + eps);
        const long long ch = plane % c;
        const A sc = pld(scale, ch), b = pld(bias, ch);
        for (long long k = threadIdx.x; k < inner; k += blockDim.x) st(y, at(k), stats.dev(ld(x, at(k))) / sd * sc + b);
    }
}

template <typename T, typename P>
__device__ __forceinline__ void group_norm_body(const T* x, const P* scale, const P* bias, T* y, long long n,
                                                long long c, long long groups, long long inner, float eps) {
    typedef AccT<T> A;
    __shared__ A smem[32];
    const long long cg = c / groups, per = cg * inner;
    for (long long blk = blockIdx.x; blk < n * groups; blk += gridDim.x) {
        const long long g = blk % groups;
        const Contig at{blk * per};
        const Stats<A> stats = block_stats(x, per, at, smem);
        const A var = stats.var;
        const A sd = m_sqrt(var + eps);
        for (long long k = threadIdx.x; k < per; k += blockDim.x) {
            const long long ch = g * cg + k / inner;
            st(y, at(k), stats.dev(ld(x, at(k))) / sd * pld(scale, ch) + pld(bias, ch));
        }
    }
}

// ---------------------------------------------------------------- instantiations

#define NORM_PAIR(T, t, P, p)                                                                              \
    MPC_KERNEL norm_layer_norm_##t##_##p(const T* x, const P* scale, const P* bias, T* y, AccT<T>* mean,   \
                                         AccT<T>* inv_std, long long rows, long long n, long long scale_n, \
                                         float eps) {                                                      \
        layer_norm_body(x, scale, bias, y, mean, inv_std, rows, n, scale_n, eps);                          \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_##t##_##p(const T* dy, const T* x, const P* scale, T* dx,              \
                                              AccT<T>* ws_mean, AccT<T>* ws_inv_std, long long rows,       \
                                              long long n, long long scale_n, float eps) {                 \
        layer_norm_grad_body(dy, x, scale, dx, ws_mean, ws_inv_std, rows, n, scale_n, eps);                \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_params_##t##_##p(const T* dy, const T* x, const AccT<T>* ws_mean,      \
                                                     const AccT<T>* ws_inv_std, T* dscale, T* dbias,       \
                                                     long long rows, long long n, long long scale_n) {     \
        layer_norm_grad_params_body(dy, x, ws_mean, ws_inv_std, dscale, dbias, rows, n, scale_n);          \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_params_split_##t##_##p(                                                \
        const T* dy, const T* x, const AccT<T>* ws_mean, const AccT<T>* ws_inv_std, AccT<T>* part_scale,   \
        AccT<T>* part_bias, long long rows, long long n, long long scale_n, long long splits) {           \
        layer_norm_grad_params_split_body(dy, x, ws_mean, ws_inv_std, part_scale, part_bias, rows, n,      \
                                          scale_n, splits);                                                \
    }                                                                                                      \
    MPC_KERNEL norm_batch_norm_infer_##t##_##p(const T* x, const P* scale, const P* bias, const P* mean,   \
                                               const P* var, const T* res, T* y, long long n, long long c, \
                                               long long inner, float eps, int relu) {                     \
        batch_norm_infer_body(x, scale, bias, mean, var, res, y, n, c, inner, eps, relu);                  \
    }                                                                                                      \
    MPC_KERNEL norm_batch_norm_train_##t##_##p(const T* x, const P* scale, const P* bias,                  \
                                               const P* running_mean, const P* running_var, const T* res,  \
                                               T* y, P* running_mean_out, P* running_var_out,              \
                                               AccT<T>* save_mean, AccT<T>* save_var, long long n,         \
                                               long long c, long long inner, float eps, float momentum,    \
                                               int relu) {                                                 \
        batch_norm_train_body(x, scale, bias, running_mean, running_var, res, y, running_mean_out,         \
                              running_var_out, save_mean, save_var, n, c, inner, eps, momentum, relu);     \
    }                                                                                                      \
    MPC_KERNEL norm_batch_norm_grad_##t##_##p(const T* dy, const T* ry, const T* x, const P* scale, T* dx, \
                                              T* dscale, T* dbias, long long n, long long c,               \
                                              long long inner, float eps) {                                \
        batch_norm_grad_body(dy, ry, x, scale, dx, dscale, dbias, n, c, inner, eps);                       \
    }                                                                                                      \
    MPC_KERNEL norm_bn_finish_##t##_##p(const AccT<T>* part_n, const AccT<T>* part_mean,                   \
                                        const AccT<T>* part_m2, const P* scale, const P* running_mean,     \
                                        const P* running_var, AccT<T>* mean, AccT<T>* k,                   \
                                        P* running_mean_out, P* running_var_out, long long c,              \
                                        long long splits, float eps, float momentum) {                     \
        bn_finish_body<T, P>(part_n, part_mean, part_m2, scale, running_mean, running_var, mean, k,         \
                             running_mean_out, running_var_out, c, splits, eps, momentum);                 \
    }                                                                                                      \
    MPC_KERNEL norm_bn_apply_##t##_##p(const T* x, const AccT<T>* mean, const AccT<T>* k, const P* bias,   \
                                       const T* res, T* y, long long n, long long c, long long inner,      \
                                       int vec, int relu) {                                                \
        bn_apply_body(x, mean, k, bias, res, y, n, c, inner, vec, relu);                                   \
    }                                                                                                      \
    MPC_KERNEL norm_bn_grad_finish_##t##_##p(const AccT<T>* part_n, const AccT<T>* part_mean,              \
                                             const AccT<T>* part_m2, const AccT<T>* part_g,                \
                                             const AccT<T>* part_gd, const P* scale, AccT<T>* mean,        \
                                             AccT<T>* alpha, AccT<T>* beta, AccT<T>* gamma, T* dscale,     \
                                             T* dbias, long long c, long long splits, float eps) {         \
        bn_grad_finish_body<T, P>(part_n, part_mean, part_m2, part_g, part_gd, scale, mean, alpha, beta,    \
                                  gamma, dscale, dbias, c, splits, eps);                                   \
    }                                                                                                      \
    MPC_KERNEL norm_instance_norm_##t##_##p(const T* x, const P* scale, const P* bias, T* y, long long n,  \
                                            long long c, long long inner, float eps) {                     \
        instance_norm_body(x, scale, bias, y, n, c, inner, eps);                                           \
    }                                                                                                      \
    MPC_KERNEL norm_group_norm_##t##_##p(const T* x, const P* scale, const P* bias, T* y, long long n,     \
                                         long long c, long long groups, long long inner, float eps) {      \
        group_norm_body(x, scale, bias, y, n, c, groups, inner, eps);                                      \
    }

NORM_PAIR(float, f32, float, f32)
NORM_PAIR(__half, f16, __half, f16)
NORM_PAIR(__nv_bfloat16, bf16, __nv_bfloat16, bf16)
NORM_PAIR(__half, f16, float, f32)
NORM_PAIR(__nv_bfloat16, bf16, float, f32)
NORM_PAIR(double, f64, double, f64)

// f32 LayerNormalization writing its f16/bf16 Cast's values (y in L, rounded once), and its
// gradient reading dy as the Cast before it had it (dy in L, widened as it loads).
#define NORM_LOW(L, l)                                                                                     \
    MPC_KERNEL norm_layer_norm_f32_f32_y##l(const float* x, const float* scale, const float* bias, L* y,   \
                                            float* mean, float* inv_std, long long rows, long long n,      \
                                            long long scale_n, float eps) {                                \
        layer_norm_body(x, scale, bias, y, mean, inv_std, rows, n, scale_n, eps);                          \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_f32_f32_dy##l(const L* dy, const float* x, const float* scale,         \
                                                  float* dx, float* ws_mean, float* ws_inv_std,            \
                                                  long long rows, long long n, long long scale_n,          \
                                                  float eps) {                                             \
        layer_norm_grad_body(dy, x, scale, dx, ws_mean, ws_inv_std, rows, n, scale_n, eps);                \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_params_f32_f32_dy##l(const L* dy, const float* x, const float* ws_mean, \
                                                         const float* ws_inv_std, float* dscale,           \
                                                         float* dbias, long long rows, long long n,        \
                                                         long long scale_n) {                              \
        layer_norm_grad_params_body(dy, x, ws_mean, ws_inv_std, dscale, dbias, rows, n, scale_n);          \
    }                                                                                                      \
    MPC_KERNEL norm_layer_norm_grad_params_split_f32_f32_dy##l(                                            \
        const L* dy, const float* x, const float* ws_mean, const float* ws_inv_std, float* part_scale,     \
        float* part_bias, long long rows, long long n, long long scale_n, long long splits) {             \
        layer_norm_grad_params_split_body(dy, x, ws_mean, ws_inv_std, part_scale, part_bias, rows, n,      \
                                          scale_n, splits);                                                \
    }
NORM_LOW(__half, f16)
NORM_LOW(__nv_bfloat16, bf16)

#define BN_PASSES_T(T, t)                                                                                  \
    MPC_KERNEL norm_bn_stats_##t(const T* x, AccT<T>* part_n, AccT<T>* part_mean, AccT<T>* part_m2,        \
                                 long long n, long long c, long long inner, long long splits, int vec) {   \
        bn_stats_body<T>(nullptr, nullptr, x, part_n, part_mean, part_m2, nullptr, nullptr, n, c, inner, splits, \
                         vec);                                                                             \
    }                                                                                                      \
    MPC_KERNEL norm_bn_grad_stats_##t(const T* dy, const T* ry, const T* x, AccT<T>* part_n,               \
                                      AccT<T>* part_mean, AccT<T>* part_m2, AccT<T>* part_g,               \
                                      AccT<T>* part_gd, long long n, long long c, long long inner,         \
                                      long long splits, int vec) {                                         \
        bn_stats_body<T>(dy, ry, x, part_n, part_mean, part_m2, part_g, part_gd, n, c, inner, splits, vec); \
    }                                                                                                      \
    MPC_KERNEL norm_bn_grad_apply_##t(const T* dy, const T* ry, const T* x, const AccT<T>* mean,           \
                                      const AccT<T>* alpha, const AccT<T>* beta, const AccT<T>* gamma,     \
                                      T* dx, long long n, long long c, long long inner, int vec) {         \
        bn_grad_apply_body(dy, ry, x, mean, alpha, beta, gamma, dx, n, c, inner, vec);                     \
    }
BN_PASSES_T(float, f32)
BN_PASSES_T(__half, f16)
BN_PASSES_T(__nv_bfloat16, bf16)
BN_PASSES_T(double, f64)

// ---- LocalResponseNormalization over x = (N, C, inner)
// norm_lrn_<T>(const T* x, T* y, long long n, long long c, long long inner, long long size,
//              float alpha, float beta, float bias)
//     T in f32 f16 bf16 f64; n = N * C * inner elements, one thread each (1-D grid stride).
//     y = x / (bias + alpha / size * sum of x^2 over the channels [ch - floor((size-1)/2),
//     ch + ceil((size-1)/2)] clipped to [0, C))^beta, in f64 in channel order, rounded through f32
//     on store (f64 stays f64), as the CPU reference.
template <typename T>
__device__ __forceinline__ void lrn_body(const T* x, T* y, long long n, long long c, long long inner, long long size,
                                         float alpha, float beta, float bias) {
    const long long lo = (size - 1) / 2, hi = size / 2;
    MPC_GRID_STRIDE(e, n) {
        const long long i = e % inner, ch = (e / inner) % c, img = e / (inner * c);
        const long long from = ch - lo < 0 ? 0 : ch - lo, to = ch + hi > c - 1 ? c - 1 : ch + hi;
        double sq = 0.0;
        for (long long k = from; k <= to; ++k) {
            const double v = (double)ld(x, (img * c + k) * inner + i);
            sq += v * v;
        }
        const double r = (double)ld(x, e) / pow((double)bias + (double)alpha / (double)size * sq, (double)beta);
        st(y, e, (typename Acc<T>::type)r);
    }
}
#define LRN_T(T, tag)                                                                                      \
    MPC_KERNEL norm_lrn_##tag(const T* x, T* y, long long n, long long c, long long inner, long long size, \
                              float alpha, float beta, float bias) {                                       \
        lrn_body(x, y, n, c, inner, size, alpha, beta, bias);                                              \
    }
LRN_T(float, f32)
LRN_T(__half, f16)
LRN_T(__nv_bfloat16, bf16)
LRN_T(double, f64)
