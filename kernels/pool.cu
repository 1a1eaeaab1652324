// kernels/pool.cu: MaxPool / AveragePool over 1-3 spatial dims (pads, strides, dilations,
// count_include_pad; ceil mode through the output sizes the host computes), MaxPool's Indices,
// and the gradients MaxPoolGrad / AveragePoolGrad written as gathers (no atomics).
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
//
// Layout: x is (planes, in[0], in[1], in[2]) with planes = N * C, y/dy is (planes, out[...]),
// both contiguous. The window comes in a `Window3` (common.cuh): in/out/k/stride/dil/pad/pad_end
// per spatial dim, nsp = 1..3 (entries past nsp are ignored). Output sizes (ceil mode included)
// are the host's, from mpc-ir's geometry module. A window tap at output o, kernel offset k reads
// input i = o * stride + k * dil - pad; taps outside [0, in) read nothing.
// Launch: every kernel is a 1-D grid-stride loop over its outputs (one thread per output
// element, or per input element for the gradients), blockDim.x = 256, any grid.
// dtypes: f32 f16 bf16 f64 (max/average in f32 for the f32 family, as the CPU reference); pool_max
// also u8 and i8.
//
// ABI:
// pool_max_<T>(const T* x, T* y, long long* indices, long long planes, Window3 w, int storage_order)
//     indices == nullptr: y = max over the window's taps, a NaN tap makes it NaN, -inf when the
//     window has no tap inside the input (the CPU reference's MaxPool).
//     indices != nullptr (MaxPool with its second output, i64, same shape as y): the first strict
//     maximum, NaNs skipped; indices = plane * prod(in) + the tap's offset in its plane (row-major
//     when storage_order == 0, column-major over the spatial dims when 1); a window with no
//     non-NaN tap gives -inf and the index of its first tap, 0 with none (the CPU reference's
//     MaxPool with indices).
// pool_avg_<T>(const T* x, T* y, long long planes, Window3 w, int count_include_pad)
//     sum of the taps inside the input (in tap order) / divisor; divisor = taps inside, or with
//     count_include_pad the taps with every coordinate i < in + pad_end (the explicit padding,
//     never the ceil-mode overhang); at least 1.
// pool_max_argmax_<T>(const T* x, int* arg, long long planes, Window3 w)
//     For MaxPoolGrad, pass 1: per output element, the plane-local offset of the first maximum of
//     its window (a NaN tap beats a non-NaN one; the first NaN wins), -1 when no tap is inside.
//     `arg` is a workspace of planes * prod(out) i32 (plane-local offsets are below 2^31).
// pool_max_grad_<T>(const T* dy, const int* arg, T* dx, long long planes, Window3 w)
//     Pass 2: one thread per dx element (planes * prod(in)); dx = sum of dy over the outputs whose
//     arg is this element, in increasing output order; 0 elsewhere. Writes every dx element.
// pool_avg_grad_<T>(const T* dy, T* dx, long long planes, Window3 w, int count_include_pad)
//     One thread per dx element: sum over the windows containing it of dy / divisor (as
//     pool_avg), in increasing output order. Writes every dx element.

// The window with 32-bit per-dim sizes (fewer registers) and 64-bit volumes.
struct Win {
    int in[3], out[3], k[3], s[3], d[3], p[3], pe[3];
    long long ivol, ovol;
};

// Entry D of the normalised 3-dim window (the host's nsp dims become the trailing ones, missing
// leading dims are `fill`). Constant indices only, so the parameter struct stays in registers.
template <int D> __device__ __forceinline__ int dim_of(const long long* a, int nsp, int fill) {
    if (nsp >= 3) return (int)a[D];
    if (nsp == 2) return D == 0 ? fill : (int)a[D > 0 ? D - 1 : 0];
    return D == 2 ? (int)a[0] : fill;
}

template <int D> __device__ __forceinline__ void normalise_dim(Win& r, const Window3& w) {
    r.in[D] = dim_of<D>(w.in, w.nsp, 1);
    r.out[D] = dim_of<D>(w.out, w.nsp, 1);
    r.k[D] = dim_of<D>(w.k, w.nsp, 1);
    r.s[D] = dim_of<D>(w.stride, w.nsp, 1);
    r.d[D] = dim_of<D>(w.dil, w.nsp, 1);
    r.p[D] = dim_of<D>(w.pad, w.nsp, 0);
    r.pe[D] = dim_of<D>(w.pad_end, w.nsp, 0);
}

__device__ __forceinline__ Win normalise(const Window3& w) {
    Win r;
    normalise_dim<0>(r, w);
    normalise_dim<1>(r, w);
    normalise_dim<2>(r, w);
    r.ivol = (long long)r.in[0] * r.in[1] * r.in[2];
    r.ovol = (long long)r.out[0] * r.out[1] * r.out[2];
    return r;
}

// The divisor of output (o0, o1, o2): taps inside, or (count_include_pad) taps below in + pad_end.
__device__ __forceinline__ long long avg_divisor(const Win& w, const int* o, int count_include_pad) {
    long long n = 1;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
        int c = 0;
        for (int k = 0; k < w.k[d]; ++k) {
            const int i = o[d] * w.s[d] + k * w.d[d] - w.p[d];
            c += count_include_pad ? (i < w.in[d] + w.pe[d]) : (i >= 0 && i < w.in[d]);
        }
        n *= c;
    }
    return n > 0 ? n : 1;
}

__device__ __forceinline__ void split_out(const Win& w, long long e, long long& plane, int* o) {
    plane = index_div(e, w.ovol);
    int r = (int)(e - plane * w.ovol);
    o[2] = r % w.out[2];
    r /= w.out[2];
    o[1] = r % w.out[1];
    o[0] = r / w.out[1];
}

// Visits the window taps of output o inside the input, in row-major kernel order:
// f(offset in plane, i0, i1, i2). (Plane-local offsets are below 2^31.)
template <typename F> __device__ __forceinline__ void for_taps(const Win& w, const int* o, F f) {
    for (int k0 = 0; k0 < w.k[0]; ++k0) {
        const int i0 = o[0] * w.s[0] + k0 * w.d[0] - w.p[0];
        if (i0 < 0 || i0 >= w.in[0]) continue;
        for (int k1 = 0; k1 < w.k[1]; ++k1) {
            const int i1 = o[1] * w.s[1] + k1 * w.d[1] - w.p[1];
            if (i1 < 0 || i1 >= w.in[1]) continue;
            for (int k2 = 0; k2 < w.k[2]; ++k2) {
                const int i2 = o[2] * w.s[2] + k2 * w.d[2] - w.p[2];
                if (i2 < 0 || i2 >= w.in[2]) continue;
                f((i0 * w.in[1] + i1) * w.in[2] + i2, i0, i1, i2);
            }
        }
    }
}

// The outputs of one dim whose windows contain input i, without dilation: o from lo to hi (none
// when lo > hi). Output o's taps cover inputs o s - p .. o s - p + k - 1.
__device__ __forceinline__ void window_range(int i, int p, int k, int s, int out, int& lo, int& hi) {
    const int t = i + p, a = t - k + 1;
    hi = t < 0 ? -1 : t / s;
    if (hi > out - 1) hi = out - 1;
    lo = a <= 0 ? 0 : (a + s - 1) / s;
}

// Visits the outputs whose windows contain input i, in increasing output order:
// f(output offset in plane, o0, o1, o2). Without dilation the range of each dim is computed
// (two divisions a dim); with it, each tap is tried.
template <typename F> __device__ __forceinline__ void for_windows(const Win& w, const int* i, F f) {
    if (w.d[0] == 1 && w.d[1] == 1 && w.d[2] == 1) {
        int lo[3], hi[3];
#pragma unroll
        for (int d = 0; d < 3; ++d) window_range(i[d], w.p[d], w.k[d], w.s[d], w.out[d], lo[d], hi[d]);
        for (int o0 = lo[0]; o0 <= hi[0]; ++o0)
            for (int o1 = lo[1]; o1 <= hi[1]; ++o1)
                for (int o2 = lo[2]; o2 <= hi[2]; ++o2) f((o0 * w.out[1] + o1) * w.out[2] + o2, o0, o1, o2);
        return;
    }
    for (int k0 = w.k[0] - 1; k0 >= 0; --k0) {
        const int t0 = i[0] + w.p[0] - k0 * w.d[0];
        if (t0 < 0 || t0 % w.s[0] != 0 || t0 / w.s[0] >= w.out[0]) continue;
        const int o0 = t0 / w.s[0];
        for (int k1 = w.k[1] - 1; k1 >= 0; --k1) {
            const int t1 = i[1] + w.p[1] - k1 * w.d[1];
            if (t1 < 0 || t1 % w.s[1] != 0 || t1 / w.s[1] >= w.out[1]) continue;
            const int o1 = t1 / w.s[1];
            for (int k2 = w.k[2] - 1; k2 >= 0; --k2) {
                const int t2 = i[2] + w.p[2] - k2 * w.d[2];
                if (t2 < 0 || t2 % w.s[2] != 0 || t2 / w.s[2] >= w.out[2]) continue;
                const int o2 = t2 / w.s[2];
                f((o0 * w.out[1] + o1) * w.out[2] + o2, o0, o1, o2);
            }
        }
    }
}

// 8-bit integer MaxPool (the only integer pooling ONNX has): taps read as f32 (exact), the
// result stored as the CPU reference stores it (truncated toward zero, saturating; -inf gives the
// lowest value).
__device__ __forceinline__ float ld(const unsigned char* p, long long i) { return (float)p[i]; }
__device__ __forceinline__ float ld(const signed char* p, long long i) { return (float)p[i]; }
__device__ __forceinline__ void st(unsigned char* p, long long i, float v) {
    p[i] = (v != v || v <= 0.f) ? 0 : (v >= 255.f ? 255 : (unsigned char)v);
}
__device__ __forceinline__ void st(signed char* p, long long i, float v) {
    p[i] = v != v ? 0 : (v <= -128.f ? -128 : (v >= 127.f ? 127 : (signed char)v));
}

template <typename T>
__device__ __forceinline__ void max_body(const T* __restrict__ x, T* __restrict__ y, long long* __restrict__ indices,
                                         long long planes, const Window3& geom, int storage_order) {
    typedef typename Acc<T>::type C;
    const Win w = normalise(geom);
    MPC_GRID_STRIDE(e, planes * w.ovol) {
        long long plane;
        int o[3];
        split_out(w, e, plane, o);
        const T* xp = x + plane * w.ivol;
        C best = -m_inf(C(0));
        if (!indices) {
            for_taps(w, o, [&](int off, int, int, int) {
                const C a = ld(xp, off);
                if (m_isnan(a) || a > best) best = a;
            });
            st(y, e, best);
        } else {
            // The first tap until one is larger: a window of -inf (or NaN) alone has its maximum at
            // its first element; 0 where no tap is inside.
            long long best_i = -1;
            for_taps(w, o, [&](int off, int i0, int i1, int i2) {
                const C a = ld(xp, off);
                if (best_i < 0 || a > best) {
                    if (a > best) best = a;
                    // Column-major: the first spatial dim fastest (the leading size-1 dims
                    // that normalise() adds contribute nothing).
                    const long long sp =
                        storage_order != 0 ? i0 + (long long)w.in[0] * (i1 + (long long)w.in[1] * i2) : off;
                    best_i = plane * w.ivol + sp;
                }
            });
            st(y, e, best);
            indices[e] = best_i < 0 ? 0 : best_i;
        }
    }
}

template <typename T>
__device__ __forceinline__ void avg_body(const T* __restrict__ x, T* __restrict__ y, long long planes,
                                         const Window3& geom, int count_include_pad) {
    typedef typename Acc<T>::type C;
    const Win w = normalise(geom);
    MPC_GRID_STRIDE(e, planes * w.ovol) {
        long long plane;
        int o[3];
        split_out(w, e, plane, o);
        const T* xp = x + plane * w.ivol;
        C s = C(0);
        for_taps(w, o, [&](int off, int, int, int) { s += ld(xp, off); });
        st(y, e, s / (C)avg_divisor(w, o, count_include_pad));
    }
}

template <typename T>
__device__ __forceinline__ void argmax_body(const T* __restrict__ x, int* __restrict__ arg, long long planes,
                                            const Window3& geom) {
    typedef typename Acc<T>::type C;
    const Win w = normalise(geom);
    MPC_GRID_STRIDE(e, planes * w.ovol) {
        long long plane;
        int o[3];
        split_out(w, e, plane, o);
        const T* xp = x + plane * w.ivol;
        int best = -1;
        C bv = C(0);
        for_taps(w, o, [&](int off, int, int, int) {
            const C a = ld(xp, off);
            if (best < 0 || a > bv || (m_isnan(a) && !m_isnan(bv))) {
                best = off;
                bv = a;
            }
        });
        arg[e] = best;
    }
}

__device__ __forceinline__ void split_in(const Win& w, long long e, long long& plane, int* i) {
    plane = index_div(e, w.ivol);
    int r = (int)(e - plane * w.ivol);
    i[2] = r % w.in[2];
    r /= w.in[2];
    i[1] = r % w.in[1];
    i[0] = r / w.in[1];
}

template <typename T>
__device__ __forceinline__ void max_grad_body(const T* __restrict__ dy, const int* __restrict__ arg,
                                              T* __restrict__ dx, long long planes, const Window3& geom) {
    typedef typename Acc<T>::type C;
    const Win w = normalise(geom);
    MPC_GRID_STRIDE(e, planes * w.ivol) {
        long long plane;
        int i[3];
        split_in(w, e, plane, i);
        const int me = (i[0] * w.in[1] + i[1]) * w.in[2] + i[2];
        const long long ob = plane * w.ovol;
        C s = C(0);
        for_windows(w, i, [&](int op, int, int, int) {
            if (arg[ob + op] == me) s += ld(dy, ob + op);
        });
        st(dx, e, s);
    }
}

template <typename T>
__device__ __forceinline__ void avg_grad_body(const T* __restrict__ dy, T* __restrict__ dx, long long planes,
                                              const Window3& geom, int count_include_pad) {
    typedef typename Acc<T>::type C;
    const Win w = normalise(geom);
    MPC_GRID_STRIDE(e, planes * w.ivol) {
        long long plane;
        int i[3];
        split_in(w, e, plane, i);
        const long long ob = plane * w.ovol;
        C s = C(0);
        for_windows(w, i, [&](int op, int o0, int o1, int o2) {
            const int o[3] = {o0, o1, o2};
            s += ld(dy, ob + op) / (C)avg_divisor(w, o, count_include_pad);
        });
        st(dx, e, s);
    }
}

#define POOL_T(T, tag)                                                                                    \
    MPC_KERNEL pool_max_##tag(const T* x, T* y, long long* indices, long long planes, Window3 w,          \
                              int storage_order) {                                                        \
        max_body(x, y, indices, planes, w, storage_order);                                                \
    }                                                                                                     \
    MPC_KERNEL pool_avg_##tag(const T* x, T* y, long long planes, Window3 w, int count_include_pad) {      \
        avg_body(x, y, planes, w, count_include_pad);                                                     \
    }                                                                                                     \
    MPC_KERNEL pool_max_argmax_##tag(const T* x, int* arg, long long planes, Window3 w) {                  \
        argmax_body(x, arg, planes, w);                                                                   \
    }                                                                                                     \
    MPC_KERNEL pool_max_grad_##tag(const T* dy, const int* arg, T* dx, long long planes, Window3 w) {       \
        max_grad_body(dy, arg, dx, planes, w);                                                            \
    }                                                                                                     \
    MPC_KERNEL pool_avg_grad_##tag(const T* dy, T* dx, long long planes, Window3 w, int count_include_pad) { \
        avg_grad_body(dy, dx, planes, w, count_include_pad);                                              \
    }
POOL_T(float, f32)
POOL_T(__half, f16)
POOL_T(__nv_bfloat16, bf16)
POOL_T(double, f64)

#define MAXPOOL_I(T, tag)                                                                              \
    MPC_KERNEL pool_max_##tag(const T* x, T* y, long long* indices, long long planes, Window3 w,        \
                              int storage_order) {                                                     \
        max_body(x, y, indices, planes, w, storage_order);                                             \
    }
MAXPOOL_I(unsigned char, u8)
MAXPOOL_I(signed char, i8)

// ---------------------------------------------------------------- RoiAlign
//
// roi_align_<T>(const T* x, const T* rois, const long long* batch, T* y, long long rois_n,
//               long long channels, long long h, long long w, long long oh, long long ow,
//               long long ratio, float scale, int half_pixel, int max_mode)
//     T in f32 f16 bf16 f64. One thread per output element (roi, channel, bin row, bin column):
//     the bin's grid of bilinear samples as onnxruntime takes them (runtime/src/cpu/roi_align.rs,
//     the CPU reference, in the same order and dtype: float below f64): ratio per side, or with
//     ratio 0 ceil(bin extent) samples; avg divides their sum by the count, max takes the largest
//     weighted corner by onnxruntime's std::max (corners within a sample, then samples; a NaN
//     first stays, a NaN after is passed over; the first of equals).
// roi_align_grad_<T>(const T* dy, const T* x, const T* rois, const long long* batch, A* acc, ...
//                    the same sizes and attributes)
//     One thread per dy element: dy times each corner's weight over the count (avg), or times the
//     picked corner's weight (max), added to acc (A = float, double for f64: dx itself for f32
//     and f64, a workspace the host casts for f16 and bf16) by atomicAdd, which the host zeroes
//     first. The order of the additions is the hardware's: not bitwise reproducible.

template <typename C> struct RoiGeom {
    C x0, y0, bh, bw;
    long long gh, gw;
    C count;
};

template <typename T, typename C = typename Acc<T>::type>
__device__ __forceinline__ RoiGeom<C> roi_geom(const T* rois, long long r, float scale, int half_pixel, long long oh,
                                               long long ow, long long ratio) {
    const C offset = half_pixel ? (C)0.5 : (C)0;
    const C s = (C)scale;
    RoiGeom<C> g;
    g.x0 = ld(rois, r * 4 + 0) * s - offset;
    g.y0 = ld(rois, r * 4 + 1) * s - offset;
    const C x1 = ld(rois, r * 4 + 2) * s - offset, y1 = ld(rois, r * 4 + 3) * s - offset;
    C rw = x1 - g.x0, rh = y1 - g.y0;
    if (!half_pixel) {
        rw = rw > (C)1 ? rw : (C)1;
        rh = rh > (C)1 ? rh : (C)1;
    }
    g.bh = rh / (C)oh;
    g.bw = rw / (C)ow;
    g.gh = ratio > 0 ? ratio : (long long)ceil(rh / (C)oh);
    g.gw = ratio > 0 ? ratio : (long long)ceil(rw / (C)ow);
    const long long n = g.gh * g.gw;
    g.count = (C)(n > 1 ? n : 1);
    return g;
}

// The sample at (y, x) on an h x w plane: its corners' offsets and weights (zero outside).
template <typename C>
__device__ __forceinline__ void roi_sample(C y, C x, long long h, long long w, long long pos[4], C wt[4]) {
    if (y < (C)-1 || y > (C)h || x < (C)-1 || x > (C)w) {
        for (int k = 0; k < 4; ++k) {
            pos[k] = 0;
            wt[k] = (C)0;
        }
        return;
    }
    y = y > (C)0 ? y : (C)0;
    x = x > (C)0 ? x : (C)0;
    long long ylo = (long long)y, xlo = (long long)x, yhi, xhi;
    if (ylo >= h - 1) {
        yhi = ylo = h - 1;
        y = (C)ylo;
    } else {
        yhi = ylo + 1;
    }
    if (xlo >= w - 1) {
        xhi = xlo = w - 1;
        x = (C)xlo;
    } else {
        xhi = xlo + 1;
    }
    const C ly = y - (C)ylo, lx = x - (C)xlo;
    const C hy = (C)1 - ly, hx = (C)1 - lx;
    pos[0] = ylo * w + xlo;
    pos[1] = ylo * w + xhi;
    pos[2] = yhi * w + xlo;
    pos[3] = yhi * w + xhi;
    wt[0] = hy * hx;
    wt[1] = hy * lx;
    wt[2] = ly * hx;
    wt[3] = ly * lx;
}

// Walks the samples of output element `i`'s bin: f(plane, pos[4], wt[4]) per sample, in order.
template <typename T, typename F, typename C = typename Acc<T>::type>
__device__ __forceinline__ RoiGeom<C> roi_bin(const T* rois, const long long* batch, long long i, long long channels,
                                              long long h, long long w, long long oh, long long ow, long long ratio,
                                              float scale, int half_pixel, long long* plane, F f) {
    const long long pw = i % ow, ph = (i / ow) % oh, c = (i / (ow * oh)) % channels, r = i / (ow * oh * channels);
    const RoiGeom<C> g = roi_geom<T>(rois, r, scale, half_pixel, oh, ow, ratio);
    *plane = (batch[r] * channels + c) * h * w;
    for (long long iy = 0; iy < g.gh; ++iy) {
        const C y = g.y0 + (C)ph * g.bh + ((C)iy + (C)0.5) * g.bh / (C)g.gh;
        for (long long ix = 0; ix < g.gw; ++ix) {
            const C x = g.x0 + (C)pw * g.bw + ((C)ix + (C)0.5) * g.bw / (C)g.gw;
            long long pos[4];
            C wt[4];
            roi_sample(y, x, h, w, pos, wt);
            f(pos, wt);
        }
    }
    return g;
}

template <typename T>
__device__ __forceinline__ void roi_align_body(const T* x, const T* rois, const long long* batch, T* y, long long rois_n,
                                               long long channels, long long h, long long w, long long oh, long long ow,
                                               long long ratio, float scale, int half_pixel, int max_mode) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(i, rois_n * channels * oh * ow) {
        long long plane = 0;
        C sum = 0, best = 0;
        bool any = false;
        const T* xs = x;
        const RoiGeom<C> g = roi_bin(rois, batch, i, channels, h, w, oh, ow, ratio, scale, half_pixel, &plane,
                                     [&](const long long* pos, const C* wt) {
                                         if (max_mode) {
                                             // std::max in onnxruntime's order (the CPU reference's).
                                             C v = wt[0] * ld(xs, plane + pos[0]);
                                             for (int k = 1; k < 4; ++k) {
                                                 const C t = wt[k] * ld(xs, plane + pos[k]);
                                                 if (v < t) v = t;
                                             }
                                             if (!any || best < v) best = v;
                                             any = true;
                                         } else {
                                             const C t = wt[0] * ld(xs, plane + pos[0]) + wt[1] * ld(xs, plane + pos[1]) +
                                                         wt[2] * ld(xs, plane + pos[2]) + wt[3] * ld(xs, plane + pos[3]);
                                             sum = sum + t;
                                         }
                                     });
        st(y, i, max_mode ? best : sum / g.count);
    }
}

template <typename T>
__device__ __forceinline__ void roi_align_grad_body(const T* dy, const T* x, const T* rois, const long long* batch,
                                                    typename Acc<T>::type* acc, long long rois_n, long long channels,
                                                    long long h, long long w, long long oh, long long ow,
                                                    long long ratio, float scale, int half_pixel, int max_mode) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(i, rois_n * channels * oh * ow) {
        const C d = ld(dy, i);
        long long plane = 0, at = -1;
        C best = 0, best_w = 0;
        const T* xs = x;
        // Max: find the picked corner first. Avg: the count is the geometry's, known up front.
        const RoiGeom<C> g = roi_bin(rois, batch, i, channels, h, w, oh, ow, ratio, scale, half_pixel, &plane,
                                     [&](const long long* pos, const C* wt) {
                                         if (!max_mode) return;
                                         int pick = 0;
                                         C v = wt[0] * ld(xs, plane + pos[0]);
                                         for (int k = 1; k < 4; ++k) {
                                             const C t = wt[k] * ld(xs, plane + pos[k]);
                                             if (v < t) {
                                                 v = t;
                                                 pick = k;
                                             }
                                         }
                                         if (at < 0 || best < v) {
                                             best = v;
                                             at = pos[pick];
                                             best_w = wt[pick];
                                         }
                                     });
        if (max_mode) {
            if (at >= 0) atomicAdd(acc + plane + at, d * best_w);
            continue;
        }
        roi_bin(rois, batch, i, channels, h, w, oh, ow, ratio, scale, half_pixel, &plane,
                [&](const long long* pos, const C* wt) {
                    for (int k = 0; k < 4; ++k) atomicAdd(acc + plane + pos[k], d * wt[k] / g.count);
                });
    }
}

#define ROI_ALIGN_T(T, tag)                                                                                   \
    MPC_KERNEL roi_align_##tag(const T* x, const T* rois, const long long* batch, T* y, long long rois_n,        \
                               long long channels, long long h, long long w, long long oh, long long ow,         \
                               long long ratio, float scale, int half_pixel, int max_mode) {                    \
        roi_align_body(x, rois, batch, y, rois_n, channels, h, w, oh, ow, ratio, scale, half_pixel, max_mode);   \
    }                                                                                                         \
    MPC_KERNEL roi_align_grad_##tag(const T* dy, const T* x, const T* rois, const long long* batch,              \
                                    Acc<T>::type* acc, long long rois_n, long long channels, long long h,        \
                                    long long w, long long oh, long long ow, long long ratio, float scale,       \
                                    int half_pixel, int max_mode) {                                             \
        roi_align_grad_body(dy, x, rois, batch, acc, rois_n, channels, h, w, oh, ow, ratio, scale, half_pixel,  \
                            max_mode);                                                                          \
    }
ROI_ALIGN_T(float, f32)
ROI_ALIGN_T(__half, f16)
ROI_ALIGN_T(__nv_bfloat16, bf16)
ROI_ALIGN_T(double, f64)
