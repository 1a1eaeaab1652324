// kernels/im2col.cu: im2col and col2im for N-d (1-3 spatial dims) Conv / ConvTranspose / ConvGrad
// with groups, pads, strides and dilations; col2im is a gather (no atomics), so repeatable. Also
// the per-channel sum used for a convolution's bias gradient.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loops (one thread per column element / image element), blockDim.x =
// 256, any grid; im2col_channel_sum is one block per channel (blockDim.x = 256).
// T in f32 f16 bf16 f64 (data is copied, col2im sums in f32, or f64 for f64).
//
// Geometry: a `Window3` (common.cuh) with in = the image's spatial sizes, out = the column
// matrix's spatial sizes (the convolution's output), k, stride, dil, pad (begin pads; pad_end is
// ignored), nsp = 1..3. kvol = prod(k), ovol = prod(out), ivol = prod(in). A tap (output o,
// kernel offset kk) reads image position i = o * stride + kk * dil - pad per dim.
//
// Column layout, chosen by the host through two strides: element (img, r, op) with
// r = c * kvol + kp (c the channel within the group, kp the row-major kernel offset) and op the
// row-major output offset is at col[r * col_ld + img * col_img_stride + op]. For one GEMM per
// image: col_ld = ovol, col_img_stride = channels * kvol * ovol. For one wide GEMM over `imgs`
// images side by side: col_ld = imgs * ovol, col_img_stride = ovol.
// The image is addressed as x[img * img_stride + c * ch_stride + spatial offset], x already
// offset by the host to the first image and the group's first channel (usually img_stride =
// C_total * ivol, ch_stride = ivol).
//
// ABI:
// im2col_im2col_<T>(const T* x, T* col, long long imgs, long long channels, long long img_stride,
//                   long long ch_stride, Window3 w, long long col_ld, long long col_img_stride)
//     Fills every column element (zeros in the padding).
// im2col_col2im_<T>(const T* col, T* x, long long imgs, long long channels, long long img_stride,
//                   long long ch_stride, Window3 w, long long col_ld, long long col_img_stride)
//     (and im2col_col2im_wide_<T> for T in f16 bf16: the same from f32 columns)
//     The adjoint: every image element (img, c, i) is set (not added) to the sum of the column
//     elements whose tap reads it, in increasing kernel-offset order. Conv's dX: col = W_g^T dY
//     per group (GEMM), then col2im into dX with the convolution's geometry. ConvTranspose's Y:
//     col = W_g^T X, then col2im into Y with in = Y's spatial sizes, out = X's, and the
//     ConvTranspose's strides, dilations and begin pads (the bias is added afterwards).
// im2col_channel_sum_<T>(const T* dy, T* db, long long n, long long c, long long inner)
//     db[ch] = sum over images and positions of dy (n, c, inner) (ConvGrad's dB), fixed order;
//     one block per channel (grid-stride), blockDim.x a multiple of 32 in [32, 256].

struct Geo {
    int in[3], out[3], k[3], s[3], d[3], p[3];
    long long ivol, ovol;
    int kvol;
};

template <int D> __device__ __forceinline__ int geo_dim(const long long* a, int nsp, int fill) {
    if (nsp >= 3) return (int)a[D];
    if (nsp == 2) return D == 0 ? fill : (int)a[D > 0 ? D - 1 : 0];
    return D == 2 ? (int)a[0] : fill;
}
template <int D> __device__ __forceinline__ void geo_set(Geo& g, const Window3& w) {
    g.in[D] = geo_dim<D>(w.in, w.nsp, 1);
    g.out[D] = geo_dim<D>(w.out, w.nsp, 1);
    g.k[D] = geo_dim<D>(w.k, w.nsp, 1);
    g.s[D] = geo_dim<D>(w.stride, w.nsp, 1);
    g.d[D] = geo_dim<D>(w.dil, w.nsp, 1);
    g.p[D] = geo_dim<D>(w.pad, w.nsp, 0);
}
// The window with missing leading dims as size 1 (the host's dims are the trailing ones).
__device__ __forceinline__ Geo make_geo(const Window3& w) {
    Geo g;
    geo_set<0>(g, w);
    geo_set<1>(g, w);
    geo_set<2>(g, w);
    g.ivol = (long long)g.in[0] * g.in[1] * g.in[2];
    g.ovol = (long long)g.out[0] * g.out[1] * g.out[2];
    g.kvol = g.k[0] * g.k[1] * g.k[2];
    return g;
}

template <typename T>
__device__ __forceinline__ void im2col_body(const T* __restrict__ x, T* __restrict__ col, long long imgs,
                                            long long channels, long long img_stride, long long ch_stride,
                                            const Window3& w, long long col_ld, long long col_img_stride) {
    const Geo g = make_geo(w);
    const long long rows = channels * g.kvol;
    MPC_GRID_STRIDE(e, imgs * rows * g.ovol) {
        const long long t = index_div(e, g.ovol), op = e - t * g.ovol;
        const long long img = index_div(t, rows), r = t - img * rows;
        const long long c = index_div(r, g.kvol);
        const int kp = (int)(r - c * g.kvol);
        const int k2 = kp % g.k[2], k1 = (kp / g.k[2]) % g.k[1], k0 = kp / (g.k[2] * g.k[1]);
        const long long q2 = index_div(op, g.out[2]), q1 = index_div(q2, g.out[1]);
        const int o2 = (int)(op - q2 * g.out[2]), o1 = (int)(q2 - q1 * g.out[1]), o0 = (int)q1;
        const int i0 = o0 * g.s[0] + k0 * g.d[0] - g.p[0];
        const int i1 = o1 * g.s[1] + k1 * g.d[1] - g.p[1];
        const int i2 = o2 * g.s[2] + k2 * g.d[2] - g.p[2];
        T v = T(0.0f);
        if (i0 >= 0 && i0 < g.in[0] && i1 >= 0 && i1 < g.in[1] && i2 >= 0 && i2 < g.in[2])
            v = x[img * img_stride + c * ch_stride + ((long long)i0 * g.in[1] + i1) * g.in[2] + i2];
        col[r * col_ld + img * col_img_stride + op] = v;
    }
}

template <typename TC, typename T>
__device__ __forceinline__ void col2im_body(const TC* __restrict__ col, T* __restrict__ x, long long imgs,
                                            long long channels, long long img_stride, long long ch_stride,
                                            const Window3& w, long long col_ld, long long col_img_stride) {
    typedef typename Acc<T>::type C;
    const Geo g = make_geo(w);
    MPC_GRID_STRIDE(e, imgs * channels * g.ivol) {
        const long long t = index_div(e, g.ivol), ip = e - t * g.ivol;
        const long long img = index_div(t, channels), c = t - img * channels;
        const long long q2 = index_div(ip, g.in[2]), q1 = index_div(q2, g.in[1]);
        const int i2 = (int)(ip - q2 * g.in[2]), i1 = (int)(q2 - q1 * g.in[1]), i0 = (int)q1;
        const TC* cb = col + c * g.kvol * col_ld + img * col_img_stride;
        C s = C(0);
        for (int k0 = 0; k0 < g.k[0]; ++k0) {
            const int t0 = i0 + g.p[0] - k0 * g.d[0];
            if (t0 < 0 || t0 % g.s[0] != 0 || t0 / g.s[0] >= g.out[0]) continue;
            const int o0 = t0 / g.s[0];
            for (int k1 = 0; k1 < g.k[1]; ++k1) {
                const int t1 = i1 + g.p[1] - k1 * g.d[1];
                if (t1 < 0 || t1 % g.s[1] != 0 || t1 / g.s[1] >= g.out[1]) continue;
                const int o1 = t1 / g.s[1];
                for (int k2 = 0; k2 < g.k[2]; ++k2) {
                    const int t2 = i2 + g.p[2] - k2 * g.d[2];
                    if (t2 < 0 || t2 % g.s[2] != 0 || t2 / g.s[2] >= g.out[2]) continue;
                    const int o2 = t2 / g.s[2];
                    const int kp = (k0 * g.k[1] + k1) * g.k[2] + k2;
                    const long long op = ((long long)o0 * g.out[1] + o1) * g.out[2] + o2;
                    s += ld(cb, (long long)kp * col_ld + op);
                }
            }
        }
        st(x, img * img_stride + c * ch_stride + ip, s);
    }
}

template <typename T>
__device__ __forceinline__ void channel_sum_body(const T* __restrict__ dy, T* __restrict__ db, long long n,
                                                 long long c, long long inner) {
    typedef typename Acc<T>::type C;
    __shared__ C smem[32];
    const long long count = n * inner;
    for (long long ch = blockIdx.x; ch < c; ch += gridDim.x) {
        C s = C(0);
        for (long long e = threadIdx.x; e < count; e += blockDim.x) {
            const long long b = index_div(e, inner);
            s += ld(dy, (b * c + ch) * inner + (e - b * inner));
        }
        s = block_reduce(s, OpSum(), smem);
        if (threadIdx.x == 0) st(db, ch, s);
    }
}

#define IM2COL_T(T, tag)                                                                                   \
    MPC_KERNEL im2col_im2col_##tag(const T* x, T* col, long long imgs, long long channels,                 \
                                   long long img_stride, long long ch_stride, Window3 w, long long col_ld, \
                                   long long col_img_stride) {                                             \
        im2col_body(x, col, imgs, channels, img_stride, ch_stride, w, col_ld, col_img_stride);             \
    }                                                                                                      \
    MPC_KERNEL im2col_col2im_##tag(const T* col, T* x, long long imgs, long long channels,                 \
                                   long long img_stride, long long ch_stride, Window3 w, long long col_ld, \
                                   long long col_img_stride) {                                             \
        col2im_body(col, x, imgs, channels, img_stride, ch_stride, w, col_ld, col_img_stride);             \
    }                                                                                                      \
    MPC_KERNEL im2col_channel_sum_##tag(const T* dy, T* db, long long n, long long c, long long inner) {   \
        channel_sum_body(dy, db, n, c, inner);                                                             \
    }
IM2COL_T(float, f32)
IM2COL_T(__half, f16)
IM2COL_T(__nv_bfloat16, bf16)
IM2COL_T(double, f64)

// col2im from f32 columns into an f16/bf16 image: the columns of a low-precision ConvGrad's dX or
// ConvTranspose's Y, which the GEMM leaves in f32 so that the image is rounded once.
#define COL2IM_WIDE_T(T, tag)                                                                            \
    MPC_KERNEL im2col_col2im_wide_##tag(const float* col, T* x, long long imgs, long long channels,      \
                                        long long img_stride, long long ch_stride, Window3 w,            \
                                        long long col_ld, long long col_img_stride) {                    \
        col2im_body(col, x, imgs, channels, img_stride, ch_stride, w, col_ld, col_img_stride);           \
    }
COL2IM_WIDE_T(__half, f16)
COL2IM_WIDE_T(__nv_bfloat16, bf16)
