// kernels/loss.cu: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss (ignore_index, class
// weights, reduction none / sum / mean) and their gradients (ai.mpc
// SoftmaxCrossEntropyLossGrad, NegativeLogLikelihoodLossGrad), deterministic.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
//
// Layout: scores / log-probabilities are a contiguous (n, c, inner) array (inner = product of
// the extra dims d...; 1 for plain classification); labels are (n, inner), i64 or i32 (suffix
// `_i64` / `_i32`); weights, when given (else nullptr), have c entries of T. A position is
// (b, i), p = b * inner + i; class k of it is at ((b * c + k) * inner + i). `reduction`: 0 none,
// 1 sum, 2 mean (weighted: divided by the sum of the non-ignored positions' weights).
// `has_ignore` != 0 enables `ignore_index`; an ignored position has loss 0, weight 0, gradient 0.
// A label outside [0, c) that is not ignored is treated as ignored (the CPU reference rejects
// it; kernels cannot).
// T in f32 f16 bf16 f64; arithmetic and the workspaces (`float` below) in A = AccT<T>: f32, or
// f64 for f64 scores. Sums in fixed-order block reductions. A row's max and sum of exponentials
// come from one pass over it (row_max_sum), the forward's loss from that pass alone, the
// gradient from it and one more.
//
// Forward, SoftmaxCrossEntropyLoss = LogSoftmax over c, then NLL on the stored log-probabilities
// (rounded to T, as the CPU reference reads them):
// loss_softmax_ce_<T>_<I>(const T* scores, const I* labels, const T* weights, T* log_prob,
//                         float* ws_loss, float* ws_weight, T* loss_none, long long n, long long c,
//                         long long inner, int has_ignore, long long ignore_index)
//     One block per position (grid-stride over the n * inner positions with blockIdx.x),
//     blockDim.x a multiple of 32 in [32, 256] (32 for small c). log_prob (the op's optional
//     second output, shaped like scores) may be nullptr. Per position: ws_loss[p] = -log_prob[p,
//     label] * w[label], ws_weight[p] = w[label] (f32 workspaces of n * inner entries; needed for
//     sum/mean, may be nullptr for none); loss_none[p] = the same loss in T (may be nullptr).
// loss_nll_<T>_<I>(const T* input, const I* labels, const T* weights, float* ws_loss,
//                  float* ws_weight, T* loss_none, long long n, long long c, long long inner,
//                  int has_ignore, long long ignore_index)
//     NegativeLogLikelihoodLoss on log-probabilities; one thread per position, 1-D grid stride.
// loss_reduce_<T>(const float* ws_loss, const float* ws_weight, T* loss, long long positions,
//                 int reduction)
//     reduction 1 or 2: loss[0] = sum of ws_loss (divided by the sum of ws_weight for mean).
//     Exactly one block: gridDim.x = 1, blockDim.x = 256.
//
// loss_softmax_ce_wide_<T>_<I>, T f16 or bf16: as loss_softmax_ce_<T>_<I>, with weights,
//     log_prob, ws_loss, ws_weight and loss_none in f32: the f32 loss of the scores widened.
//
// Gradients (dloss is a T scalar for sum/mean, (n, inner) for none):
// loss_softmax_ce_grad_wide_<T>_<I>, T f16 or bf16: as loss_softmax_ce_grad_<T>_<I> below, with
//     dloss and weights in f32 (the gradient of an f32 loss over scores widened from T, written
//     in T: the rounding of the f32 gradient and its cast, in one).

// loss_weight_total_<T>_<I>(const I* labels, const T* weights, float* total, long long positions,
//                           long long c, int has_ignore, long long ignore_index)
//     total[0] = the sum of w[label] over the non-ignored positions (the mean's divisor); launch
//     it before a mean gradient. Exactly one block: gridDim.x = 1, blockDim.x = 256.
// loss_softmax_ce_grad_<T>_<I>(const T* dloss, const T* scores, const I* labels, const T* weights,
//                              const float* total, T* dscores, long long n, long long c,
//                              long long inner, int has_ignore, long long ignore_index, int reduction)
//     dscores[p, k] = g * w[label] * (softmax(scores[p])[k] - (k == label)), g = dloss[p] (none),
//     dloss[0] (sum), dloss[0] / total[0] (mean; `total` unused otherwise); 0 at ignored
//     positions. One block per position, as the forward.
// loss_nll_grad_<T>_<I>(const T* dloss, const T* input, const I* labels, const T* weights,
//                       const float* total, T* dinput, long long n, long long c, long long inner,
//                       int has_ignore, long long ignore_index, int reduction)
//     dinput = -g * w[label] at the label's class, 0 elsewhere. One thread per dinput element.

// The label of position p normalised: -1 when ignored or out of range.
template <typename I>
__device__ __forceinline__ long long label_at(const I* labels, long long p, long long c, int has_ignore,
                                              long long ignore_index) {
    const long long k = (long long)labels[p];
    if (has_ignore && k == ignore_index) return -1;
    return (k < 0 || k >= c) ? -1 : k;
}

template <typename W> __device__ __forceinline__ AccT<W> weight_of(const W* w, long long k) {
    return w ? ld(w, k) : AccT<W>(1);
}

// Two parts of a row as one: the larger max (NaN-ignoring, as m_fmax) and the sums of exp(x -
// max) rescaled to it. A part with no elements (max -inf, sum 0) leaves the other as it is.
template <typename A> __device__ __forceinline__ void max_sum_merge(A& m, A& s, A mo, A so) {
    if (so == A(0) && mo == -m_inf(A(0))) return;
    if (s == A(0) && m == -m_inf(A(0))) {
        m = mo;
        s = so;
        return;
    }
    const A big = m_fmax(m, mo);
    s = s * m_exp(m - big) + so * m_exp(mo - big);
    m = big;
}

// A row's max and sum of exp(x - max) in one pass over it: each thread keeps its own pair
// (its sum rescaled when its max grows), then the block merges them in a fixed order (each warp
// as a tree, then the warps'). Returned to every thread. NaN and infinities give what a max pass
// and then a sum pass give: a NaN in the row makes the sum NaN, and so does a max of +inf (whose
// own term is exp(inf - inf)); a -inf adds nothing (a row of them: a sum of 0, a log of -inf).
template <typename A, typename T>
__device__ __forceinline__ void row_max_sum(const T* scores, long long base, long long c, long long inner, A* smem,
                                            A& m, A& s) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    m = -m_inf(A(0));
    s = A(0);
    for (long long k = threadIdx.x; k < c; k += blockDim.x) {
        const A x = ld(scores, base + k * inner);
        if (x > m) {
            s = s * m_exp(m - x) + A(1);
            m = x;
        } else if (x != -m_inf(A(0))) {
            s += m_exp(x - m);
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const A mo = __shfl_down_sync(0xffffffffu, m, off), so = __shfl_down_sync(0xffffffffu, s, off);
        max_sum_merge(m, s, mo, so);
    }
    __syncthreads();  // smem may still be read from a previous row
    if (lane == 0) {
        smem[warp] = m;
        smem[32 + warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        A wm = lane < nwarps ? smem[lane] : -m_inf(A(0)), ws = lane < nwarps ? smem[32 + lane] : A(0);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const A mo = __shfl_down_sync(0xffffffffu, wm, off), so = __shfl_down_sync(0xffffffffu, ws, off);
            max_sum_merge(wm, ws, mo, so);
        }
        if (lane == 0) {
            smem[0] = wm;
            smem[32] = ws;
        }
    }
    __syncthreads();
    m = smem[0];
    s = m == m_inf(A(0)) ? m_nan(A(0)) : smem[32];
}

// D: the dtype of the weights, log-probabilities and losses (T, or f32 for the wide kernels of
// f16/bf16 scores, whose log-probabilities are rounded to f32 as an f32 op's are).
template <typename T, typename I, typename D>
__device__ __forceinline__ void softmax_ce_body(const T* scores, const I* labels, const D* weights, D* log_prob,
                                                AccT<D>* ws_loss, AccT<D>* ws_weight, D* loss_none, long long n,
                                                long long c, long long inner, int has_ignore, long long ignore_index) {
    typedef AccT<D> A;
    __shared__ A smem[64];
    for (long long p = blockIdx.x; p < n * inner; p += gridDim.x) {
        const long long b = p / inner, i = p % inner;
        const long long base = b * c * inner + i;
        A m, s;
        row_max_sum(scores, base, c, inner, smem, m, s);
        const A ls = m_log(s);
        if (log_prob)
            for (long long k = threadIdx.x; k < c; k += blockDim.x)
                st(log_prob, base + k * inner, (ld(scores, base + k * inner) - m) - ls);
        if (threadIdx.x == 0) {
            const long long k = label_at(labels, p, c, has_ignore, ignore_index);
            A loss = A(0), w = A(0);
            if (k >= 0) {
                w = weight_of(weights, k);
                loss = -round_to<D>((ld(scores, base + k * inner) - m) - ls) * w;
            }
            if (ws_loss) ws_loss[p] = loss;
            if (ws_weight) ws_weight[p] = w;
            if (loss_none) st(loss_none, p, loss);
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void nll_body(const T* input, const I* labels, const T* weights, AccT<T>* ws_loss,
                                         AccT<T>* ws_weight, T* loss_none, long long n, long long c, long long inner,
                                         int has_ignore, long long ignore_index) {
    typedef AccT<T> A;
    MPC_GRID_STRIDE(p, n * inner) {
        const long long b = p / inner, i = p % inner;
        const long long k = label_at(labels, p, c, has_ignore, ignore_index);
        A loss = A(0), w = A(0);
        if (k >= 0) {
            w = weight_of(weights, k);
            loss = -ld(input, (b * c + k) * inner + i) * w;
        }
        if (ws_loss) ws_loss[p] = loss;
        if (ws_weight) ws_weight[p] = w;
        if (loss_none) st(loss_none, p, loss);
    }
}

template <typename T>
__device__ __forceinline__ void loss_reduce_body(const AccT<T>* ws_loss, const AccT<T>* ws_weight, T* loss,
                                                 long long positions, int reduction) {
    typedef AccT<T> A;
    __shared__ A smem[64];
    if (blockIdx.x != 0) return;
    A s = A(0), w = A(0);
    for (long long p = threadIdx.x; p < positions; p += blockDim.x) {
        s += ws_loss[p];
        if (reduction == 2) w += ws_weight[p];
    }
    block_reduce2(s, w, OpSum(), smem);
    if (threadIdx.x == 0) st(loss, 0, reduction == 2 ? s / w : s);
}

template <typename T, typename I>
__device__ __forceinline__ void weight_total_body(const I* labels, const T* weights, AccT<T>* total, long long positions,
                                                  long long c, int has_ignore, long long ignore_index) {
    typedef AccT<T> A;
    __shared__ A smem[32];
    if (blockIdx.x != 0) return;
    A w = A(0);
    for (long long p = threadIdx.x; p < positions; p += blockDim.x) {
        const long long k = label_at(labels, p, c, has_ignore, ignore_index);
        if (k >= 0) w += weight_of(weights, k);
    }
    w = block_reduce(w, OpSum(), smem);
    if (threadIdx.x == 0) total[0] = w;
}

template <typename D>
__device__ __forceinline__ AccT<D> grad_scale(const D* dloss, const AccT<D>* total, long long p, int reduction) {
    if (reduction == 0) return ld(dloss, p);
    if (reduction == 1) return ld(dloss, 0);
    return ld(dloss, 0) / total[0];
}

// D: the dtype of dloss, weights and total (T, or f32 for the wide kernels of f16/bf16 scores).
template <typename T, typename I, typename D>
__device__ __forceinline__ void softmax_ce_grad_body(const D* dloss, const T* scores, const I* labels,
                                                     const D* weights, const AccT<D>* total, T* dscores, long long n,
                                                     long long c, long long inner, int has_ignore,
                                                     long long ignore_index, int reduction) {
    typedef AccT<T> A;
    __shared__ A smem[64];
    for (long long p = blockIdx.x; p < n * inner; p += gridDim.x) {
        const long long b = p / inner, i = p % inner;
        const long long base = b * c * inner + i;
        const long long label = label_at(labels, p, c, has_ignore, ignore_index);
        if (label < 0) {
            for (long long k = threadIdx.x; k < c; k += blockDim.x) st(dscores, base + k * inner, A(0));
            continue;  // uniform across the block: no reduction is skipped by part of it
        }
        A m, s;
        row_max_sum(scores, base, c, inner, smem, m, s);
        const A gw = A(grad_scale(dloss, total, p, reduction) * weight_of(weights, label));
        for (long long k = threadIdx.x; k < c; k += blockDim.x) {
            const A prob = m_exp(ld(scores, base + k * inner) - m) / s;
            st(dscores, base + k * inner, gw * (prob - (k == label ? A(1) : A(0))));
        }
    }
}

template <typename T, typename I>
__device__ __forceinline__ void nll_grad_body(const T* dloss, const T* input, const I* labels, const T* weights,
                                              const AccT<T>* total, T* dinput, long long n, long long c,
                                              long long inner, int has_ignore, long long ignore_index,
                                              int reduction) {
    typedef AccT<T> A;
    (void)input;
    MPC_GRID_STRIDE(e, n * c * inner) {
        const long long i = e % inner, t = e / inner;
        const long long k = t % c, b = t / c;
        const long long p = b * inner + i;
        const long long label = label_at(labels, p, c, has_ignore, ignore_index);
        A v = A(0);
        if (label >= 0 && label == k) v = -grad_scale(dloss, total, p, reduction) * weight_of(weights, label);
        st(dinput, e, v);
    }
}

#define LOSS_TI(T, tag, I, itag)                                                                           \
    MPC_KERNEL loss_softmax_ce_##tag##_##itag(const T* scores, const I* labels, const T* weights,          \
                                              T* log_prob, AccT<T>* ws_loss, AccT<T>* ws_weight, T* loss_none, \
                                              long long n, long long c, long long inner, int has_ignore,   \
                                              long long ignore_index) {                                    \
        softmax_ce_body(scores, labels, weights, log_prob, ws_loss, ws_weight, loss_none, n, c, inner,     \
                        has_ignore, ignore_index);                                                         \
    }                                                                                                      \
    MPC_KERNEL loss_nll_##tag##_##itag(const T* input, const I* labels, const T* weights, AccT<T>* ws_loss, \
                                       AccT<T>* ws_weight, T* loss_none, long long n, long long c,         \
                                       long long inner, int has_ignore, long long ignore_index) {          \
        nll_body(input, labels, weights, ws_loss, ws_weight, loss_none, n, c, inner, has_ignore,           \
                 ignore_index);                                                                            \
    }                                                                                                      \
    MPC_KERNEL loss_weight_total_##tag##_##itag(const I* labels, const T* weights, AccT<T>* total,         \
                                                long long positions, long long c, int has_ignore,          \
                                                long long ignore_index) {                                  \
        weight_total_body(labels, weights, total, positions, c, has_ignore, ignore_index);                 \
    }                                                                                                      \
    MPC_KERNEL loss_softmax_ce_grad_##tag##_##itag(const T* dloss, const T* scores, const I* labels,       \
                                                   const T* weights, const AccT<T>* total, T* dscores,     \
                                                   long long n, long long c, long long inner,              \
                                                   int has_ignore, long long ignore_index, int reduction) { \
        softmax_ce_grad_body(dloss, scores, labels, weights, total, dscores, n, c, inner, has_ignore,      \
                             ignore_index, reduction);                                                     \
    }                                                                                                      \
    MPC_KERNEL loss_nll_grad_##tag##_##itag(const T* dloss, const T* input, const I* labels,               \
                                            const T* weights, const AccT<T>* total, T* dinput, long long n, \
                                            long long c, long long inner, int has_ignore,                  \
                                            long long ignore_index, int reduction) {                       \
        nll_grad_body(dloss, input, labels, weights, total, dinput, n, c, inner, has_ignore, ignore_index, \
                      reduction);                                                                          \
    }
#define LOSS_T(T, tag)                                                                                     \
    LOSS_TI(T, tag, long long, i64)                                                                        \
    LOSS_TI(T, tag, int, i32)                                                                              \
    MPC_KERNEL loss_reduce_##tag(const AccT<T>* ws_loss, const AccT<T>* ws_weight, T* loss, long long positions, \
                                 int reduction) {                                                          \
        loss_reduce_body(ws_loss, ws_weight, loss, positions, reduction);                                  \
    }
// The wide kernels of f16/bf16 scores: an f32 loss (weights, log-probabilities, workspaces and
// losses in f32; its reduction is loss_reduce_f32) and its gradient (dloss, weights and total in
// f32), reading the scores where they were before their cast to f32.
#define LOSS_WIDE_TI(T, tag, I, itag)                                                                      \
    MPC_KERNEL loss_softmax_ce_wide_##tag##_##itag(const T* scores, const I* labels, const float* weights,  \
                                                   float* log_prob, float* ws_loss, float* ws_weight,      \
                                                   float* loss_none, long long n, long long c,             \
                                                   long long inner, int has_ignore, long long ignore_index) { \
        softmax_ce_body(scores, labels, weights, log_prob, ws_loss, ws_weight, loss_none, n, c, inner,     \
                        has_ignore, ignore_index);                                                         \
    }                                                                                                      \
    MPC_KERNEL loss_softmax_ce_grad_wide_##tag##_##itag(const float* dloss, const T* scores, const I* labels, \
                                                        const float* weights, const float* total, T* dscores, \
                                                        long long n, long long c, long long inner,         \
                                                        int has_ignore, long long ignore_index,            \
                                                        int reduction) {                                   \
        softmax_ce_grad_body(dloss, scores, labels, weights, total, dscores, n, c, inner, has_ignore,      \
                             ignore_index, reduction);                                                     \
    }
LOSS_T(float, f32)
LOSS_T(__half, f16)
LOSS_T(__nv_bfloat16, bf16)
LOSS_T(double, f64)
LOSS_WIDE_TI(__half, f16, long long, i64)
LOSS_WIDE_TI(__half, f16, int, i32)
LOSS_WIDE_TI(__nv_bfloat16, bf16, long long, i64)
LOSS_WIDE_TI(__nv_bfloat16, bf16, int, i32)
