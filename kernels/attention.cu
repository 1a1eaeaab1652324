// kernels/attention.cu: fused scaled-dot-product attention ("flash" attention: the [sq, sk]
// scores and probabilities never reach global memory), forward and backward, for f16 and bf16
// on the tensor cores (mma.sync m16n8k16 with f32 accumulation).
//
// Compiled as `common.cuh` + `attention_mma.cuh` (the warp-level products and tile copies) + this
// file (the host prepends both; see common.cuh's header). The tensor core path needs sm_80 or
// newer (mma.sync with bf16, ldmatrix, cp.async).
//
// Layout: Q, K, V, O, dO, dQ, dK, dV are [batch, heads, seq, d] arrays addressed by strides in
// elements with d contiguous: element (b, h, i, c) of Q is q[b*qs.b + h*qs.h + i*qs.s + c]
// (seq = sq for Q, O, dO, dQ and sk for K, V, dK, dV). The mask is optional (nullptr when absent),
// f32 and additive: element (b, h, i, j) at mask[b*ms.b + h*ms.h + i*ms.s + j] (broadcast dims
// have stride 0, the key index j is contiguous). lse and delta are contiguous f32
// [batch, heads, sq]: element (b, h, i) at (b*heads + h)*sq + i. Any strides work; 16-byte
// vector accesses are used where a tensor's base and strides allow them (checked at run time),
// element accesses otherwise.
//
// Arithmetic (f32):
//   s_ij = scale * (q_i . k_j) + mask_ij, m_i = max_j s_ij, l_i = sum_j exp(s_ij - m_i),
//   lse_i = m_i + log(l_i), o_i = sum_j exp(s_ij - m_i) v_j / l_i (rounded once to T).
//   Causal (causal != 0): s_ij = -inf wherever j > i, replacing the mask's value there (which is
//   never used: it may be anything, NaN included), i.e. an extra -inf mask aligned top-left: query i
//   sees keys 0..min(i, sk - 1) (so rows i >= sk see every key, and with sq < sk the keys
//   j >= sq are seen by no row). Both it and the mask pointer may be given.
//   A row whose scores are all -inf gives o_i = 0 and lse_i = -inf (and zero gradients).
//   Backward, P_ij = exp(s_ij - lse_i) (0 where lse_i = -inf):
//   delta_i = dO_i . O_i, dV_j = sum_i P_ij dO_i, dS_ij = P_ij (dO_i . v_j - delta_i),
//   dQ_i = scale * sum_j dS_ij k_j, dK_j = scale * sum_i dS_ij q_i (each rounded once to T).
// The exponentials are taken base 2 (the scores are scaled by log2(e)), and P and dS are
// rounded to T before they enter a tensor core product; so results match an f32 evaluation of
// the formulas above to T's precision, not to the bit. There are no atomics and every loop has a
// fixed order: a shape and causal flag give the same bits on every run.
//
// Head dim: the kernels are instantiated for a padded head dim DP in {16, 32, 64, 128}; launch the
// smallest DP >= d (1 <= d <= 128). Columns c >= d are read as zeros and never written.
// batch, heads >= 1; 1 <= sq, sk < 2^31 (the sequence indices are 32-bit; offsets are 64-bit).
//
// ABI (T in f16 bf16; DP in 16 32 64 128; the structs are passed by value):
//   struct AttnShape { long long batch, heads, sq, sk, d; };
//   struct AttnStrides { long long b, h, s; };   // in elements
//
//   attention_fwd_d<DP>_<T>(const T* q, const T* k, const T* v, const float* mask, T* o, float* lse,
//                           AttnShape sh, AttnStrides qs, AttnStrides ks, AttnStrides vs,
//                           AttnStrides ms, AttnStrides os, float scale, int causal)
//       Writes O and lse.
//   attention_delta_<T>(const T* o, const T* dout, float* delta, AttnShape sh, AttnStrides os,
//                       AttnStrides dos)
//       delta_i = sum_c dout_ic * o_ic (sh.d columns).
//   attention_bwd_dkdv_d<DP>_<T>(const T* q, const T* k, const T* v, const float* mask,
//                                const T* dout, const float* lse, const float* delta, T* dk, T* dv,
//                                AttnShape sh, AttnStrides qs, AttnStrides ks, AttnStrides vs,
//                                AttnStrides ms, AttnStrides dos, AttnStrides dks,
//                                AttnStrides dvs, float scale, int causal)
//       Writes dK and dV, from the forward's lse and attention_delta's delta.
//   attention_bwd_dq_d<DP>_<T>(const T* q, const T* k, const T* v, const float* mask,
//                              const T* dout, const float* lse, const float* delta, T* dq,
//                              AttnShape sh, AttnStrides qs, AttnStrides ks, AttnStrides vs,
//                              AttnStrides ms, AttnStrides dos, AttnStrides dqs, float scale,
//                              int causal)
//       Writes dQ.
// Outputs must not overlap inputs or each other. The backward's three kernels are independent of
// one another once delta is written (dkdv and dq may run in either order). The backward must be
// given the forward's mask and causal flag.
//
// Launch (blockDim.y = blockDim.z = gridDim.y = gridDim.z = 1; static shared memory only):
//   attention_fwd_d<DP>_<T>:      blockDim.x = 128, gridDim.x = ceil(sq / 64) * batch * heads.
//   attention_bwd_dq_d<DP>_<T>:   blockDim.x = 128, gridDim.x = ceil(sq / 64) * batch * heads.
//       Block x owns query rows [64 * (x % ceil(sq/64)), +64) of head (x / ceil(sq/64)) % heads,
//       batch x / ceil(sq/64) / heads; each of its 4 warps owns 16 of those rows.
//   attention_bwd_dkdv_d<DP>_<T>: blockDim.x = 128, gridDim.x = ceil(sk / 64) * batch * heads.
//       Block x owns keys [64 * (x % ceil(sk/64)), +64) of (batch, head) x / ceil(sk/64), as above;
//       each warp owns 16 of those keys.
//   attention_delta_<T>:          blockDim.x = 256, any gridDim.x >= 1 (grid-stride over the
//       batch*heads*sq rows, 16 rows per block per step): gridDim.x = min(ceil(rows / 16), 65535).
// Static shared memory per block (bytes):
//   DP:        16      32      64      128
//   fwd     12288   20480   36864   34816
//   dq      12288   20480   36864   34816
//   dkdv    12800   20992   37376   43648
//   delta       0
//
// Tiles: the forward and dQ kernels walk the keys in tiles of 64 (32 for DP = 128), two tiles of
// K and V in flight (cp.async double buffering); dK/dV walk the queries in tiles of 32 (16 for
// DP = 128; single-buffered there, double-buffered otherwise). Tiles live in shared memory with a
// row pitch of DP + 8 elements, which makes the ldmatrix row reads free of bank conflicts. Each
// warp keeps its 16 rows' operand fragments (Q, or dO, or K and V for DP <= 64) and f32
// accumulators in registers; the probabilities P and dS go from the score accumulators to the next
// product's A operand in registers.
//
// Causal skipping: a tile that causality masks for every row of a block is neither loaded nor
// computed by that block (nothing of it is read: K, V, Q, dO, lse, delta or mask). Forward and dQ:
// a block (rows q0..q0 + 63) stops after the key tile holding key min(q0 + 63, sq - 1), the last
// key its last row sees (or at the last key tile, if that is sooner). dK/dV: a block (keys
// k0..k0 + 63) starts at the query tile holding row k0, the first query that sees any of its keys;
// a block with k0 >= sq reads no query tile and writes zeros. The tiles the diagonal crosses are
// computed in full and masked per element: the forward replaces those scores with -inf (the mask
// is read there and its value dropped), dQ and dK/dV do not read the mask there and take P = 0.
// This leaves the work unbalanced: a forward or dQ block's work grows with its query tile index,
// a dK/dV block's shrinks with its key tile index (with sq = sk, from 1 / ceil(sq / 64) of the
// full work to all of it). The grid is the same as without causal, but the forward and dQ take
// their query tiles in reverse order there (attn_block), so each kernel starts the heavy tiles
// first.

struct AttnShape {
    long long batch, heads, sq, sk, d;
};
struct AttnStrides {
    long long b, h, s;
};

// 128 threads per block and a minimum of MINB resident blocks per SM: ptxas then keeps each kernel
// within 65536 / (128 * MINB) registers. MINB is per kernel and DP, the largest that compiles
// without spills for sm_80 and sm_90 (registers: 128 for 4 blocks, 168 for 3, 255 for 2).
#define ATTN_KERNEL(MINB) extern "C" __global__ void __launch_bounds__(ATTN_THREADS, MINB)
#define ATTN_MINB_FWD_16 4
#define ATTN_MINB_FWD_32 4
#define ATTN_MINB_FWD_64 3
#define ATTN_MINB_FWD_128 3
#define ATTN_MINB_DQ_16 4
#define ATTN_MINB_DQ_32 3
#define ATTN_MINB_DQ_64 2
#define ATTN_MINB_DQ_128 2
#define ATTN_MINB_DKDV_16 4
#define ATTN_MINB_DKDV_32 4
#define ATTN_MINB_DKDV_64 2
#define ATTN_MINB_DKDV_128 2

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_LN2 0.6931471805599453f

// A block's shared memory: raw bytes, 16-byte aligned (the cp.async and ldmatrix rows).
template <int BYTES> struct alignas(16) AttnSmem {
    unsigned char b[BYTES];

    // The bytes as the block starts. On the device they are whatever was there; the emulation
    // (blocks one after another, the array static) sets them to NaN bits, so that a read of bytes
    // this block has not written (a tile's zero fill skipped, the row pitch's padding) shows.
    __device__ __forceinline__ unsigned char* start() {
#ifdef MPC_EMULATED
        if (threadIdx.x == 0) std::memset(b, 0xff, BYTES);
        __syncthreads();
#endif
        return b;
    }
};

__device__ __forceinline__ float attn_neg_inf() { return -__int_as_float(0x7f800000); }

// A mask value in the log2 domain: finite values stay finite (a mask of -3.4e38, float's lowest,
// would overflow to -inf when scaled and turn a row the unfused softmax spreads evenly into a
// fully masked one); -inf and NaN stay as they are.
__device__ __forceinline__ float attn_log2(float m) {
    const float x = m * ATTN_LOG2E;
    return x < -3.402823466e38f && m != attn_neg_inf() ? -3.402823466e38f : x;
}

// mrow[key] in the log2 domain where `ok`, else 0 (mrow is then not read).
__device__ __forceinline__ float attn_mask_at(const float* mrow, bool ok, int key) {
    return ok ? attn_log2(mrow[key]) : 0.0f;
}

// The row's two mask entries at key, key + 1 (key even) in the log2 domain; 0 where mrow is
// nullptr (no mask, or a row past sq) or the key is at or past nkeys.
__device__ __forceinline__ void attn_mask_pair(const float* mrow, int key, int nkeys, bool vec2, float& m0,
                                               float& m1) {
    m0 = 0.0f;
    m1 = 0.0f;
    if (mrow == nullptr) return;
    if (vec2 && key + 1 < nkeys) {
#ifdef MPC_EMULATED
        float v[2];
        std::memcpy(v, mrow + key, 8);
        m0 = attn_log2(v[0]);
        m1 = attn_log2(v[1]);
#else
        const float2 v = *reinterpret_cast<const float2*>(mrow + key);
        m0 = attn_log2(v.x);
        m1 = attn_log2(v.y);
#endif
    } else {
        if (key < nkeys) m0 = attn_log2(mrow[key]);
        if (key + 1 < nkeys) m1 = attn_log2(mrow[key + 1]);
    }
}

// The block's (batch * heads + head) index and tile index, from blockIdx.x = bh * ntiles + i: the
// tile is i, or with `reverse` ntiles - 1 - i. The forward and dQ kernels reverse under causal, so
// that in each (batch, head) the query tiles that see the most keys start first and the grid's
// last blocks are the short ones (dK/dV's heavy key tiles come first in the plain order).
__device__ __forceinline__ void attn_block(int ntiles, long long heads, bool reverse, long long& bh, long long& b,
                                           long long& h, int& tile) {
    long long tl;
    index_divmod((long long)blockIdx.x, (long long)ntiles, bh, tl);
    index_divmod(bh, heads, b, h);
    tile = reverse ? ntiles - 1 - (int)tl : (int)tl;
}

// The number of key tiles (of BK) that a block of BM query rows from q0 reads: all ceil(sk / BK),
// or with causal only those up to the tile of key min(q0 + BM, sq) - 1, its last row's last key.
template <int BM, int BK> __device__ __forceinline__ int attn_key_tiles(int sk, int sq, int q0, int causal) {
    const int nkt = (sk + BK - 1) / BK;
    if (causal == 0) return nkt;
    const int last = min(q0 + (BM - 1), sq - 1);  // q0 is a multiple of BM below sq: no overflow
    return min(nkt, last / BK + 1);
}

// The keys a query row sees are [0, limit): sk, or with causal min(sk, row + 1).
__device__ __forceinline__ int attn_key_limit(int row, int sk, int causal) {
    return causal != 0 ? min(sk - 1, row) + 1 : sk;
}

// ---- the blocks of query rows (forward and dQ) ----

// A block of the forward or dQ kernel: BM query rows from q0 of head (b, h), which read the key
// tiles 0..nkt-1 of BK keys (causal skipping as attn_key_tiles says) with K and V double-buffered:
// two stages of shared memory, each a K tile and then a V tile (pitch DP + 8).
template <int BM, int BK, int DP> struct AttnQBlock {
    static constexpr int LDS = DP + 8, KV = BK * LDS, STAGE = 2 * KV;
    long long bh, b, h;
    int q0, nkt;
    int rA, rB;  // the lane's query rows: g and g + 8 of its warp's 16 (either may be >= sq)
    const u16* kb;
    const u16* vb;
    long long kstride, vstride;
    int sk, d;
    bool kvec, vvec;

    __device__ __forceinline__ AttnQBlock(const void* k, const void* v, const AttnShape& sh, const AttnStrides& ks,
                                          const AttnStrides& vs, int causal) {
        const int sq = (int)sh.sq;
        sk = (int)sh.sk;
        d = (int)sh.d;
        int qt;
        attn_block((sq + BM - 1) / BM, sh.heads, causal != 0, bh, b, h, qt);
        q0 = qt * BM;
        nkt = attn_key_tiles<BM, BK>(sk, sq, q0, causal);
        rA = q0 + (int)(threadIdx.x >> 5) * 16 + (int)((threadIdx.x & 31) >> 2);
        rB = rA + 8;
        kb = reinterpret_cast<const u16*>(k) + b * ks.b + h * ks.h;
        vb = reinterpret_cast<const u16*>(v) + b * vs.b + h * vs.h;
        kstride = ks.s;
        vstride = vs.s;
        kvec = attn_vec_ok(kb, kstride, d);
        vvec = attn_vec_ok(vb, vstride, d);
    }

    // Key tile kt's K and V into the stage at `stage` (cp.async pieces: commit after).
    __device__ __forceinline__ void load_kv(u16* stage, int kt) const {
        attn_load_tile<BK, DP>(stage, kb, kstride, kt * BK, sk, d, kvec);
        attn_load_tile<BK, DP>(stage + KV, vb, vstride, kt * BK, sk, d, vvec);
    }

    // Before key tile kt's products (tile kt already loading): tile kt + 1 starts into the other
    // stage, tile kt is waited for. Returns tile kt's stage (K, then V at + KV).
    __device__ __forceinline__ const u16* next(u16* sm, int kt) const {
        if (kt + 1 < nkt) load_kv(sm + ((kt + 1) & 1) * STAGE, kt + 1);
        attn_cp_commit();
        attn_cp_wait<1>();
        __syncthreads();
        return sm + (kt & 1) * STAGE;
    }
};

// The mask rows of a lane's query rows rA and rB (nullptr without a mask, or for a row past sq),
// and whether they can be read two floats at a time.
__device__ __forceinline__ void attn_mask_rows(const float* mask, const AttnStrides& ms, long long b, long long h,
                                               int rA, int rB, int sq, const float*& mA, const float*& mB,
                                               bool& mvec) {
    mA = nullptr;
    mB = nullptr;
    mvec = false;
    if (mask == nullptr) return;
    const float* mb = mask + b * ms.b + h * ms.h;
    mA = rA < sq ? mb + rA * ms.s : nullptr;
    mB = rB < sq ? mb + rB * ms.s : nullptr;
    mvec = ((unsigned long long)mb & 7) == 0 && (ms.s & 1) == 0;
}

// A warp's 16 x DP accumulators times mul0 (rows g) and mul1 (rows g + 8) as rows row0.. of the
// [n, d] output at `out` (head b, h), through the shared tile sm (BM rows): called by the whole
// block once every warp is done reading sm.
template <typename T, int BM, int DP>
__device__ __forceinline__ void attn_store_rows(T* out, const AttnStrides& os, long long b, long long h, int row0,
                                                int n, int d, u16* sm, const float (&acc)[DP / 8][4], float mul0,
                                                float mul1) {
    attn_acc_to_smem<T, DP>(sm, (int)(threadIdx.x >> 5) * 16, acc, mul0, mul1);
    __syncthreads();
    u16* ob = reinterpret_cast<u16*>(out) + b * os.b + h * os.h;
    attn_store_tile<BM, DP>(ob, os.s, row0, n, d, attn_vec_ok(ob, os.s, d), sm);
}

// ---- forward ----

template <typename T, int DP>
__device__ __forceinline__ void attn_fwd(const T* q, const T* k, const T* v, const float* mask, T* o, float* lse,
                                         const AttnShape& sh, const AttnStrides& qs, const AttnStrides& ks,
                                         const AttnStrides& vs, const AttnStrides& ms, const AttnStrides& os,
                                         float scale, int causal) {
    constexpr int BM = 64, BK = DP == 128 ? 32 : 64;
    using Block = AttnQBlock<BM, BK, DP>;
    constexpr int LDS = Block::LDS, STAGE = Block::STAGE;
    static_assert(BM * LDS <= STAGE, "the Q tile is staged in the second stage");
    __shared__ AttnSmem<2 * STAGE * 2> smem;
    u16* sm = reinterpret_cast<u16*>(smem.start());

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int sq = (int)sh.sq, sk = (int)sh.sk, d = (int)sh.d;
    // Causal: the key tiles past the block's last row are skipped (key tile 0 is always read).
    const Block blk(k, v, sh, ks, vs, causal);
    const int q0 = blk.q0, rA = blk.rA, rB = blk.rB;
    const u16* qb = reinterpret_cast<const u16*>(q) + blk.b * qs.b + blk.h * qs.h;

    // Q into the second stage, key tile 0 into the first.
    attn_load_tile<BM, DP>(sm + STAGE, qb, qs.s, q0, sq, d, attn_vec_ok(qb, qs.s, d));
    attn_cp_commit();
    blk.load_kv(sm, 0);
    attn_cp_commit();
    attn_cp_wait<1>();
    __syncthreads();
    u32 qf[DP / 16][4];
    attn_load_a<DP>(qf, sm + STAGE + warp * 16 * LDS);
    __syncthreads();  // every warp has its Q fragments before key tile 1 overwrites them

    const float* mA;
    const float* mB;
    bool mvec;
    attn_mask_rows(mask, ms, blk.b, blk.h, rA, rB, sq, mA, mB, mvec);
    const float sl2 = scale * ATTN_LOG2E;
    const float ninf = attn_neg_inf();

    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
    float mrow[2] = {ninf, ninf}, lrow[2] = {0.0f, 0.0f};

    for (int kt = 0; kt < blk.nkt; ++kt) {
        const u16* Ks = blk.next(sm, kt);
        const u16* Vs = Ks + Block::KV;

        float s[BK / 8][4];
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        attn_mma_abt<T, DP, BK / 8>(s, qf, Ks);

        // Scores in the log2 domain; keys past sk are -inf.
        float mx[2] = {ninf, ninf};
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            const int key = kt * BK + 8 * j + 2 * t;
            float a0, a1, b0, b1;
            attn_mask_pair(mA, key, sk, mvec, a0, a1);
            attn_mask_pair(mB, key, sk, mvec, b0, b1);
            s[j][0] = key < sk ? s[j][0] * sl2 + a0 : ninf;
            s[j][1] = key + 1 < sk ? s[j][1] * sl2 + a1 : ninf;
            s[j][2] = key < sk ? s[j][2] * sl2 + b0 : ninf;
            s[j][3] = key + 1 < sk ? s[j][3] * sl2 + b1 : ninf;
        }
        // Causal: keys past the row are -inf, whatever the mask held there. Only a tile whose last
        // key lies past the warp's first row has any.
        if (causal != 0 && kt * BK + (BK - 1) > q0 + warp * 16) {
#pragma unroll
            for (int j = 0; j < BK / 8; ++j) {
                const int key = kt * BK + 8 * j + 2 * t;
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (key + (e & 1) > rA + 8 * (e >> 1)) s[j][e] = ninf;
                }
            }
        }
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
            mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
        }
        // Online softmax: a row's 4 lanes share its running max; each lane keeps a partial sum.
        float muse[2], alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(ATTN_FULL, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(ATTN_FULL, mx[r], 2));
            const float mnew = fmaxf(mrow[r], mx[r]);
            muse[r] = mnew == ninf ? 0.0f : mnew;  // a row all -inf so far: exp2(-inf - 0) = 0, no NaN
            alpha[r] = exp2f(mrow[r] - muse[r]);
            mrow[r] = mnew;
        }
        float ls[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = exp2f(s[j][e] - muse[e >> 1]);
                ls[e >> 1] += s[j][e];
            }
        }
        lrow[0] = lrow[0] * alpha[0] + ls[0];
        lrow[1] = lrow[1] * alpha[1] + ls[1];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) {
            acc[n][0] *= alpha[0];
            acc[n][1] *= alpha[0];
            acc[n][2] *= alpha[1];
            acc[n][3] *= alpha[1];
        }
        attn_mma_pb<T, DP, BK / 8>(acc, s, Vs);
        __syncthreads();  // every warp is done with this stage before it is refilled
    }

    // The row sums over the row's 4 lanes (the butterfly leaves the same bits in all four).
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float l = lrow[r];
        l += __shfl_xor_sync(ATTN_FULL, l, 1);
        l += __shfl_xor_sync(ATTN_FULL, l, 2);
        lrow[r] = l;
        inv[r] = l > 0.0f ? 1.0f / l : 0.0f;
    }
    if (t == 0) {
        float* lb = lse + blk.bh * sh.sq;
        if (rA < sq) lb[rA] = lrow[0] > 0.0f ? mrow[0] * ATTN_LN2 + logf(lrow[0]) : ninf;
        if (rB < sq) lb[rB] = lrow[1] > 0.0f ? mrow[1] * ATTN_LN2 + logf(lrow[1]) : ninf;
    }
    attn_store_rows<T, BM, DP>(o, os, blk.b, blk.h, q0, sq, d, sm, acc, inv[0], inv[1]);
}

// ---- backward: delta ----

template <typename T>
__device__ __forceinline__ void attn_delta(const T* o, const T* dout, float* delta, const AttnShape& sh,
                                           const AttnStrides& os, const AttnStrides& dos) {
    // 16 lanes per row, 8 columns each (d <= 128); a warp takes two rows per step.
    const int lane = threadIdx.x & 31, half = lane >> 4, c0 = (lane & 15) * 8;
    const int d = (int)sh.d;
    const long long rows = sh.batch * sh.heads * sh.sq;
    const bool vec = attn_vec_ok(o, os.s, d) && attn_vec_ok(dout, dos.s, d) && ((os.b | os.h | dos.b | dos.h) & 7) == 0;
    const long long warps = (long long)(blockDim.x >> 5);
    const long long step = (long long)gridDim.x * warps;
    for (long long p = (long long)blockIdx.x * warps + (threadIdx.x >> 5); 2 * p < rows; p += step) {
        const long long row = 2 * p + half;
        float acc = 0.0f;
        if (row < rows && c0 < d) {
            long long bh, i, b, h;
            index_divmod(row, sh.sq, bh, i);
            index_divmod(bh, sh.heads, b, h);
            const T* op = o + b * os.b + h * os.h + i * os.s;
            const T* dp = dout + b * dos.b + h * dos.h + i * dos.s;
            if (vec) {
                float x[8], y[8];
                ldv<8>(op, c0, x);
                ldv<8>(dp, c0, y);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc += y[e] * x[e];
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    if (c0 + e < d) acc += ld(dp, c0 + e) * ld(op, c0 + e);
                }
            }
        }
        acc += __shfl_xor_sync(ATTN_FULL, acc, 8);
        acc += __shfl_xor_sync(ATTN_FULL, acc, 4);
        acc += __shfl_xor_sync(ATTN_FULL, acc, 2);
        acc += __shfl_xor_sync(ATTN_FULL, acc, 1);
        if ((lane & 15) == 0 && row < rows) delta[row] = acc;
    }
}

// lse in the log2 domain for P = exp2(s2 - lse2): +inf where the row is absent or fully masked
// (lse = -inf), which makes every P of the row 0.
__device__ __forceinline__ float attn_lse2(const float* lse_bh, int row, int sq) {
    const float l = row < sq ? lse_bh[row] : attn_neg_inf();
    return l == attn_neg_inf() ? __int_as_float(0x7f800000) : attn_log2(l);
}

// ---- backward: dQ ----

template <typename T, int DP>
__device__ __forceinline__ void attn_bwd_dq(const T* q, const T* k, const T* v, const float* mask, const T* dout,
                                            const float* lse, const float* delta, T* dq, const AttnShape& sh,
                                            const AttnStrides& qs, const AttnStrides& ks, const AttnStrides& vs,
                                            const AttnStrides& ms, const AttnStrides& dos, const AttnStrides& dqs,
                                            float scale, int causal) {
    constexpr int BM = 64, BK = DP == 128 ? 32 : 64;
    using Block = AttnQBlock<BM, BK, DP>;
    constexpr int LDS = Block::LDS, STAGE = Block::STAGE, QT = BM * LDS;
    // Q and dO staged in the second stage when they fit there (their load then overlaps key
    // tile 0's), else over both stages before key tile 0 is loaded.
    constexpr bool OVERLAP = 2 * QT <= STAGE;
    constexpr int ELEMS = 2 * STAGE > 2 * QT ? 2 * STAGE : 2 * QT;
    __shared__ AttnSmem<ELEMS * 2> smem;
    u16* sm = reinterpret_cast<u16*>(smem.start());

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = lane & 3;
    const int sq = (int)sh.sq, sk = (int)sh.sk, d = (int)sh.d;
    // Causal: the key tiles past the block's last row are skipped (as in the forward).
    const Block blk(k, v, sh, ks, vs, causal);
    const int q0 = blk.q0, rA = blk.rA, rB = blk.rB;
    const u16* qb = reinterpret_cast<const u16*>(q) + blk.b * qs.b + blk.h * qs.h;
    const u16* dob = reinterpret_cast<const u16*>(dout) + blk.b * dos.b + blk.h * dos.h;

    u16* qbuf = OVERLAP ? sm + STAGE : sm;
    attn_load_tile<BM, DP>(qbuf, qb, qs.s, q0, sq, d, attn_vec_ok(qb, qs.s, d));
    attn_load_tile<BM, DP>(qbuf + QT, dob, dos.s, q0, sq, d, attn_vec_ok(dob, dos.s, d));
    attn_cp_commit();
    if constexpr (OVERLAP) {
        blk.load_kv(sm, 0);
        attn_cp_commit();
        attn_cp_wait<1>();
    } else {
        attn_cp_wait<0>();
    }
    __syncthreads();
    u32 qf[DP / 16][4], df[DP / 16][4];
    attn_load_a<DP>(qf, qbuf + warp * 16 * LDS);
    attn_load_a<DP>(df, qbuf + QT + warp * 16 * LDS);
    __syncthreads();
    if constexpr (!OVERLAP) {
        blk.load_kv(sm, 0);
        attn_cp_commit();
    }

    const int lim[2] = {attn_key_limit(rA, sk, causal), attn_key_limit(rB, sk, causal)};
    const float* lb = lse + blk.bh * sh.sq;
    const float* db = delta + blk.bh * sh.sq;
    const float l2[2] = {attn_lse2(lb, rA, sq), attn_lse2(lb, rB, sq)};
    const float dl[2] = {rA < sq ? db[rA] : 0.0f, rB < sq ? db[rB] : 0.0f};
    const float* mA;
    const float* mB;
    bool mvec;
    attn_mask_rows(mask, ms, blk.b, blk.h, rA, rB, sq, mA, mB, mvec);
    const float sl2 = scale * ATTN_LOG2E;

    float acc[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    for (int kt = 0; kt < blk.nkt; ++kt) {
        const u16* Ks = blk.next(sm, kt);
        const u16* Vs = Ks + Block::KV;

        float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
        }
        attn_mma_abt<T, DP, BK / 8>(s, qf, Ks);
        attn_mma_abt<T, DP, BK / 8>(dp, df, Vs);
        // P = exp2(s2 - lse2) (0 for keys at or past the row's limit, sk or causal, where the mask
        // is not read, and for absent or fully masked rows), dS = P (dP - delta).
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
            const int key = kt * BK + 8 * j + 2 * t;
            float a0, a1, b0, b1;
            attn_mask_pair(mA, key, lim[0], mvec, a0, a1);
            attn_mask_pair(mB, key, lim[1], mvec, b0, b1);
            const float mk[4] = {a0, a1, b0, b1};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool in = key + (e & 1) < lim[e >> 1];
                const float p = in ? exp2f(s[j][e] * sl2 + mk[e] - l2[e >> 1]) : 0.0f;
                dp[j][e] = p * (dp[j][e] - dl[e >> 1]);
            }
        }
        attn_mma_pb<T, DP, BK / 8>(acc, dp, Ks);
        __syncthreads();
    }

    attn_store_rows<T, BM, DP>(dq, dqs, blk.b, blk.h, q0, sq, d, sm, acc, scale, scale);
}

// ---- backward: dK and dV ----

template <typename T, int DP>
__device__ __forceinline__ void attn_bwd_dkdv(const T* q, const T* k, const T* v, const float* mask, const T* dout,
                                              const float* lse, const float* delta, T* dk, T* dv, const AttnShape& sh,
                                              const AttnStrides& qs, const AttnStrides& ks, const AttnStrides& vs,
                                              const AttnStrides& ms, const AttnStrides& dos, const AttnStrides& dks,
                                              const AttnStrides& dvs, float scale, int causal) {
    constexpr int BN = 64, BQ = DP == 128 ? 16 : 32, NST = DP == 128 ? 1 : 2, LDS = DP + 8;
    constexpr int KT = BN * LDS;       // the K or V tile (elements)
    constexpr int QT = BQ * LDS;       // a Q or dO tile
    constexpr int STAGE = 2 * QT;      // Q and dO of one query tile
    // K, V, NST stages of Q and dO (u16), then NST stages of lse2 and delta (f32, BQ each).
    constexpr int ELEMS = 2 * KT + NST * STAGE;
    constexpr int BYTES = ELEMS * 2 + NST * 2 * BQ * 4;
    // The K and V fragments stay in registers where they are few enough.
    constexpr bool KVREG = DP <= 64;
    __shared__ AttnSmem<BYTES> smem;
    u16* sm = reinterpret_cast<u16*>(smem.start());
    float* fl = reinterpret_cast<float*>(smem.b + ELEMS * 2);

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int sq = (int)sh.sq, sk = (int)sh.sk, d = (int)sh.d;
    long long bh, b, h;
    int kt;
    attn_block((sk + BN - 1) / BN, sh.heads, false, bh, b, h, kt);
    const int k0 = kt * BN;
    const u16* qb = reinterpret_cast<const u16*>(q) + b * qs.b + h * qs.h;
    const u16* dob = reinterpret_cast<const u16*>(dout) + b * dos.b + h * dos.h;
    const u16* kb = reinterpret_cast<const u16*>(k) + b * ks.b + h * ks.h;
    const u16* vb = reinterpret_cast<const u16*>(v) + b * vs.b + h * vs.h;
    const bool qvec = attn_vec_ok(qb, qs.s, d), dvec = attn_vec_ok(dob, dos.s, d);
    const float* lb = lse + bh * sh.sq;
    const float* db = delta + bh * sh.sq;
    const int nqt = (sq + BQ - 1) / BQ;
    // Causal: the query tiles before the one of row k0 (the block's first key) see none of the
    // block's keys and are skipped (all of them when k0 >= sq).
    const int it0 = causal != 0 ? k0 / BQ : 0;
    u16* Kt = sm;
    u16* Vt = sm + KT;

    // Query tile i into stage st: Q, dO (cp.async or element stores), lse2 and delta (stores).
    auto load_stage = [&](int st, int i) {
        u16* qd = sm + 2 * KT + st * STAGE;
        attn_load_tile<BQ, DP>(qd, qb, qs.s, i * BQ, sq, d, qvec);
        attn_load_tile<BQ, DP>(qd + QT, dob, dos.s, i * BQ, sq, d, dvec);
        const int tid = (int)threadIdx.x;
        if (tid < BQ) {
            const int row = i * BQ + tid;
            fl[st * 2 * BQ + tid] = attn_lse2(lb, row, sq);
            fl[st * 2 * BQ + BQ + tid] = row < sq ? db[row] : 0.0f;
        }
    };

    attn_load_tile<BN, DP>(Kt, kb, ks.s, k0, sk, d, attn_vec_ok(kb, ks.s, d));
    attn_load_tile<BN, DP>(Vt, vb, vs.s, k0, sk, d, attn_vec_ok(vb, vs.s, d));
    if (it0 < nqt) load_stage(it0 & (NST - 1), it0);
    attn_cp_commit();
    attn_cp_wait<0>();
    __syncthreads();
    u32 kf[KVREG ? DP / 16 : 1][4], vf[KVREG ? DP / 16 : 1][4];
    if constexpr (KVREG) {
        attn_load_a<DP>(kf, Kt + warp * 16 * LDS);
        attn_load_a<DP>(vf, Vt + warp * 16 * LDS);
    }

    // Lane rows (keys): g and g + 8 of the warp's 16; lane columns (queries): 8j + 2t + {0, 1}.
    // Key key[r] is seen by the queries i >= qmin[r]: all (0), or with causal i >= key[r]; none
    // for keys past sk.
    const int key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
    int qmin[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) qmin[r] = key[r] >= sk ? 0x7fffffff : causal != 0 ? key[r] : 0;
    const float* mb = mask != nullptr ? mask + b * ms.b + h * ms.h : nullptr;
    const float sl2 = scale * ATTN_LOG2E;

    float ak[DP / 8][4], av[DP / 8][4];
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
        ak[n][0] = ak[n][1] = ak[n][2] = ak[n][3] = 0.0f;
        av[n][0] = av[n][1] = av[n][2] = av[n][3] = 0.0f;
    }

    for (int it = it0; it < nqt; ++it) {
        if constexpr (NST == 2) {
            if (it + 1 < nqt) load_stage((it + 1) & 1, it + 1);
            attn_cp_commit();
            attn_cp_wait<1>();
        } else {
            if (it > it0) {
                load_stage(0, it);
                attn_cp_commit();
            }
            attn_cp_wait<0>();
        }
        __syncthreads();
        const int st = NST == 2 ? (it & 1) : 0;
        const u16* Qs = sm + 2 * KT + st * STAGE;
        const u16* Ds = Qs + QT;
        const float* l2s = fl + st * 2 * BQ;
        const float* dls = l2s + BQ;
        const int i0 = it * BQ;

        // S^T (keys x queries) and dP^T = V dO^T.
        float s[BQ / 8][4], dp[BQ / 8][4];
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.0f;
        }
        if constexpr (KVREG) {
            attn_mma_abt<T, DP, BQ / 8>(s, kf, Qs);
            attn_mma_abt<T, DP, BQ / 8>(dp, vf, Ds);
        } else {
            u32 af[DP / 16][4];
            attn_load_a<DP>(af, Kt + warp * 16 * LDS);
            attn_mma_abt<T, DP, BQ / 8>(s, af, Qs);
            attn_load_a<DP>(af, Vt + warp * 16 * LDS);
            attn_mma_abt<T, DP, BQ / 8>(dp, af, Ds);
        }
        // P^T = exp2(s2 - lse2) (0 for absent or fully masked query rows, for keys past sk and for
        // causally masked pairs, where the mask is not read).
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int il = 8 * j + 2 * t + (e & 1);
                const int i = i0 + il;
                const bool in = i >= qmin[e >> 1];
                const float mk = mb != nullptr ? attn_mask_at(mb + i * ms.s, in && i < sq, key[e >> 1]) : 0.0f;
                s[j][e] = in ? exp2f(s[j][e] * sl2 + mk - l2s[il]) : 0.0f;
            }
        }
        attn_mma_pb<T, DP, BQ / 8>(av, s, Ds);  // dV += P^T dO
#pragma unroll
        for (int j = 0; j < BQ / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - dls[8 * j + 2 * t + (e & 1)]);
        }
        attn_mma_pb<T, DP, BQ / 8>(ak, dp, Qs);  // dK += dS^T Q (scaled at the end)
        __syncthreads();
    }

    attn_store_rows<T, BN, DP>(dk, dks, b, h, k0, sk, d, Kt, ak, scale, scale);
    attn_store_rows<T, BN, DP>(dv, dvs, b, h, k0, sk, d, Vt, av, 1.0f, 1.0f);
}

// ---- the kernels ----

#define ATTN_DP(T, tag, DP)                                                                                   \
    ATTN_KERNEL(ATTN_MINB_FWD_##DP)                                                                           \
    attention_fwd_d##DP##_##tag(const T* q, const T* k, const T* v, const float* mask, T* o, float* lse,      \
                                AttnShape sh, AttnStrides qs, AttnStrides ks, AttnStrides vs, AttnStrides ms, \
                                AttnStrides os, float scale, int causal) {                                    \
        attn_fwd<T, DP>(q, k, v, mask, o, lse, sh, qs, ks, vs, ms, os, scale, causal);                        \
    }                                                                                                         \
    ATTN_KERNEL(ATTN_MINB_DKDV_##DP)                                                                          \
    attention_bwd_dkdv_d##DP##_##tag(const T* q, const T* k, const T* v, const float* mask, const T* dout,    \
                                     const float* lse, const float* delta, T* dk, T* dv, AttnShape sh,        \
                                     AttnStrides qs, AttnStrides ks, AttnStrides vs, AttnStrides ms,          \
                                     AttnStrides dos, AttnStrides dks, AttnStrides dvs, float scale,          \
                                     int causal) {                                                            \
        attn_bwd_dkdv<T, DP>(q, k, v, mask, dout, lse, delta, dk, dv, sh, qs, ks, vs, ms, dos, dks, dvs,      \
                             scale, causal);                                                                  \
    }                                                                                                         \
    ATTN_KERNEL(ATTN_MINB_DQ_##DP)                                                                            \
    attention_bwd_dq_d##DP##_##tag(const T* q, const T* k, const T* v, const float* mask, const T* dout,      \
                                   const float* lse, const float* delta, T* dq, AttnShape sh, AttnStrides qs, \
                                   AttnStrides ks, AttnStrides vs, AttnStrides ms, AttnStrides dos,           \
                                   AttnStrides dqs, float scale, int causal) {                                \
        attn_bwd_dq<T, DP>(q, k, v, mask, dout, lse, delta, dq, sh, qs, ks, vs, ms, dos, dqs, scale, causal); \
    }

#define ATTN_T(T, tag)                                                                                       \
    MPC_KERNEL attention_delta_##tag(const T* o, const T* dout, float* delta, AttnShape sh, AttnStrides os, \
                                     AttnStrides dos) {                                                     \
        attn_delta<T>(o, dout, delta, sh, os, dos);                                                         \
    }                                                                                                       \
    ATTN_DP(T, tag, 16)                                                                                     \
    ATTN_DP(T, tag, 32)                                                                                     \
    ATTN_DP(T, tag, 64)                                                                                     \
    ATTN_DP(T, tag, 128)

ATTN_T(__half, f16)
ATTN_T(__nv_bfloat16, bf16)
