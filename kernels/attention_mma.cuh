// kernels/attention_mma.cuh: the warp-level pieces of the fused attention kernels
// (kernels/attention.cu): the tensor-core product mma.sync m16n8k16 and ldmatrix, their
// emulation on the CPU, the copies of tiles between global and shared memory (cp.async), and
// the products of a warp's fragments against shared tiles. The host compiles it as common.cuh +
// this file + attention.cu (`FAMILIES` in runtime/src/cuda/nvrtc.rs); it needs sm_80 or newer.

// The threads of an attention block: the tile copies spread a tile over all of them.
#define ATTN_THREADS 128
#define ATTN_FULL 0xffffffffu

template <typename T> struct AttnIsBf16 {
    static constexpr bool value = false;
};
template <> struct AttnIsBf16<__nv_bfloat16> {
    static constexpr bool value = true;
};

// ---- the tensor core primitives ----
//
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 computes D = A * B + C for a
// 16x16 A, a 16x8 B and a 16x8 C/D spread over the warp's 32 lanes (PTX ISA, "Matrix Fragments
// for mma.m16n8k16 with floating point type"). With g = lane >> 2 (groupID) and t = lane & 3
// (threadID_in_group), each lane holds:
//   A: 4 .b32 registers of two 16-bit elements each, the lower column in the low half:
//        a[0] = A[g][2t, 2t+1]      a[1] = A[g+8][2t, 2t+1]
//        a[2] = A[g][2t+8, 2t+9]    a[3] = A[g+8][2t+8, 2t+9]
//   B: 2 .b32 registers, the lower row in the low half:
//        b[0] = B[2t, 2t+1][g]      b[1] = B[2t+8, 2t+9][g]
//   C, D: 4 f32: c[0], c[1] = C[g][2t, 2t+1], c[2], c[3] = C[g+8][2t, 2t+1].
// So row r of A lies in lanes 4r..4r+3 (r < 8: registers 0 and 2; r >= 8: registers 1 and 3 of
// lanes 4(r-8)..), and column n of B in lanes 4n..4n+3 (registers 0 and 1). The C layout of two
// adjacent n8 tiles is the A layout of one k16 step: C tile 2k gives a[0] (c0, c1) and a[1]
// (c2, c3), C tile 2k+1 gives a[2] and a[3]; the probabilities go from the scores' accumulators
// into the next product without leaving the registers.
//
// ldmatrix.sync.aligned.m8n8.x4.shared.b16 loads four 8x8 matrices of 16-bit elements: lane l
// gives the address of row l & 7 of matrix l >> 3 (16 contiguous bytes), and register m of lane l
// receives row l >> 2, columns 2(l & 3) and 2(l & 3) + 1 of matrix m (the lower column in the low
// half), which is the layout of an mma fragment register. With .trans, register m of lane l
// receives the elements at (row 2(l & 3), column l >> 2) and (row 2(l & 3) + 1, column l >> 2) of
// matrix m as stored: the fragment of the transposed matrix.
//
// Under MPC_EMULATED (tests/cuda_emu: no PTX) these are computed with warp shuffles over the same
// register layouts: every lane gathers the A rows and B columns, or the row addresses, it needs.

#ifdef MPC_EMULATED
template <typename T> __device__ __forceinline__ float attn_bits_to_float(unsigned bits) {
    if constexpr (AttnIsBf16<T>::value) {
        return __bfloat162float(__ushort_as_bfloat16((unsigned short)(bits & 0xffffu)));
    } else {
        return __half2float(__ushort_as_half((unsigned short)(bits & 0xffffu)));
    }
}
#endif

// An A operand ready for several products (the same A times several B tiles): on the device its
// 4 registers; in the emulation the two rows of A each lane needs (g and g + 8), gathered once:
// row r of A lies in lanes 4r'..4r'+3 (r' = r mod 8), lane 4r'+s holding columns 2s, 2s+1 (a[0]
// for r < 8, a[1] for r >= 8) and 2s+8, 2s+9 (a[2], a[3]).
template <typename T> struct AttnA {
#ifdef MPC_EMULATED
    float row[2][16];
#else
    u32 r[4];
#endif
    __device__ __forceinline__ void set(const u32 (&a)[4]) {
#ifdef MPC_EMULATED
        const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const u64 lo = __shfl_sync(ATTN_FULL, (u64)a[0] | (u64)a[2] << 32, 4 * g + s);
            const u64 hi = __shfl_sync(ATTN_FULL, (u64)a[1] | (u64)a[3] << 32, 4 * g + s);
            const u64 both[2] = {lo, hi};
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row[r][2 * s] = attn_bits_to_float<T>((unsigned)both[r]);
                row[r][2 * s + 1] = attn_bits_to_float<T>((unsigned)(both[r] >> 16));
                row[r][2 * s + 8] = attn_bits_to_float<T>((unsigned)(both[r] >> 32));
                row[r][2 * s + 9] = attn_bits_to_float<T>((unsigned)(both[r] >> 48));
            }
        }
#else
        r[0] = a[0];
        r[1] = a[1];
        r[2] = a[2];
        r[3] = a[3];
#endif
    }
};

// c += A * B (c: the lane's 4 accumulators of a 16x8 tile; b0, b1: the lane's B registers).
template <typename T> __device__ __forceinline__ void attn_mma(float (&c)[4], const AttnA<T>& a, u32 b0, u32 b1) {
#ifdef MPC_EMULATED
    // Columns 2t and 2t+1 of B: lane 4n+s holds rows 2s, 2s+1 (b0) and 2s+8, 2s+9 (b1) of column n.
    const int t = threadIdx.x & 3;
    float col[2][16];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const u64 v = __shfl_sync(ATTN_FULL, (u64)b0 | (u64)b1 << 32, 4 * (2 * t + n) + s);
            col[n][2 * s] = attn_bits_to_float<T>((unsigned)v);
            col[n][2 * s + 1] = attn_bits_to_float<T>((unsigned)(v >> 16));
            col[n][2 * s + 8] = attn_bits_to_float<T>((unsigned)(v >> 32));
            col[n][2 * s + 9] = attn_bits_to_float<T>((unsigned)(v >> 48));
        }
    }
    // c[2r + n] = C[g + 8r][2t + n]: products exact in f32, summed in f32 in k order.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            float acc = c[2 * r + n];
            for (int kk = 0; kk < 16; ++kk) acc += a.row[r][kk] * col[n][kk];
            c[2 * r + n] = acc;
        }
    }
#else
    if constexpr (AttnIsBf16<T>::value) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b0), "r"(b1));
    }
#endif
}

// Four 8x8 matrices from shared memory; `row` is this lane's row address (row l & 7 of matrix
// l >> 3), 16-byte aligned.
__device__ __forceinline__ void attn_ldsm_x4(u32 (&r)[4], const u16* row) {
#ifdef MPC_EMULATED
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const u16* p = (const u16*)__shfl_sync(ATTN_FULL, (u64)row, 8 * m + (lane >> 2));
        std::memcpy(&r[m], p + 2 * (lane & 3), 4);
    }
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// The same, each matrix transposed.
__device__ __forceinline__ void attn_ldsm_x4_t(u32 (&r)[4], const u16* row) {
#ifdef MPC_EMULATED
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const u16* p0 = (const u16*)__shfl_sync(ATTN_FULL, (u64)row, 8 * m + 2 * (lane & 3));
        const u16* p1 = (const u16*)__shfl_sync(ATTN_FULL, (u64)row, 8 * m + 2 * (lane & 3) + 1);
        r[m] = (u32)p0[lane >> 2] | (u32)p1[lane >> 2] << 16;
    }
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#endif
}

// Two f32 rounded to T and packed, `lo` in the low half (the lower column of a fragment register).
template <typename T> __device__ __forceinline__ u32 attn_pack(float lo, float hi) {
#ifdef MPC_EMULATED
    if constexpr (AttnIsBf16<T>::value) {
        return (u32)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
               (u32)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
    } else {
        return (u32)__half_as_ushort(__float2half_rn(lo)) | (u32)__half_as_ushort(__float2half_rn(hi)) << 16;
    }
#else
    u32 r;
    // cvt.rn.{f16x2,bf16x2}.f32 d, a, b puts a in the upper half and b in the lower one.
    if constexpr (AttnIsBf16<T>::value) {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
#endif
}

// ---- global <-> shared copies ----

// 16 bytes from global `src` to shared `dst` without passing through registers, or 16 zero bytes
// when !valid (src is then not read). Completes at the next attn_cp_wait that covers its group.
__device__ __forceinline__ void attn_cp_async16(u16* dst, const u16* src, bool valid) {
#ifdef MPC_EMULATED
    emu::cp_async(dst, valid ? src : nullptr, 16);
#else
    const unsigned addr = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
#endif
}

// Closes the group of cp.async issued since the last commit (an empty group is fine).
__device__ __forceinline__ void attn_cp_commit() {
#ifdef MPC_EMULATED
    emu::cp_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's groups are still in flight (a __syncthreads must follow
// before other threads read the data).
template <int N> __device__ __forceinline__ void attn_cp_wait() {
#ifdef MPC_EMULATED
    emu::cp_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

__device__ __forceinline__ void attn_copy16(u16* dst, const u16* src) {
#ifdef MPC_EMULATED
    std::memcpy(dst, src, 16);
#else
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#endif
}

__device__ __forceinline__ void attn_st_u32(u16* dst, u32 v) {
#ifdef MPC_EMULATED
    std::memcpy(dst, &v, 4);
#else
    *reinterpret_cast<u32*>(dst) = v;
#endif
}

// Whether rows of `d` elements at base + i * stride can move in 16-byte pieces.
__device__ __forceinline__ bool attn_vec_ok(const void* base, long long stride, long long d) {
    return ((unsigned long long)base & 15) == 0 && (stride & 7) == 0 && (d & 7) == 0;
}

// Rows [row0, row0 + ROWS) of the [n, d] matrix at g (row stride `stride`) into the shared tile
// sm (ROWS x DP, row pitch DP + 8), zeros past row n and column d. Called by the whole block.
// vec: attn_vec_ok (cp.async in 16-byte pieces); else element by element (stored at once).
template <int ROWS, int DP>
__device__ __forceinline__ void attn_load_tile(u16* sm, const u16* g, long long stride, int row0, int n, int d,
                                               bool vec) {
    constexpr int CH = DP / 8, LDS = DP + 8, TOTAL = ROWS * CH;
    static_assert(ATTN_THREADS % CH == 0, "a thread's pieces share their column");
    // Piece it of this thread: row r0 + it * (ATTN_THREADS / CH), columns c0..c0+7.
    const int r0 = (int)threadIdx.x / CH, c0 = ((int)threadIdx.x % CH) * 8;
#pragma unroll
    for (int it = 0; it < (TOTAL + ATTN_THREADS - 1) / ATTN_THREADS; ++it) {
        const int r = r0 + it * (ATTN_THREADS / CH);
        if (TOTAL % ATTN_THREADS == 0 || r < ROWS) {
            const int row = row0 + r;
            u16* dst = sm + r * LDS + c0;
            const bool in = row < n;
            if (vec) {
                const bool ok = in && c0 < d;
                attn_cp_async16(dst, ok ? g + row * stride + c0 : g, ok);
            } else {
                const u16* src = g + (in ? row * stride : 0);
#pragma unroll
                for (int e = 0; e < 8; ++e) dst[e] = (in && c0 + e < d) ? src[c0 + e] : (u16)0;
            }
        }
    }
}

// The shared tile sm (ROWS x DP, pitch DP + 8) to rows [row0, row0 + ROWS) of the [n, d] matrix
// at g, rows >= n and columns >= d left alone. Called by the whole block after a __syncthreads.
template <int ROWS, int DP>
__device__ __forceinline__ void attn_store_tile(u16* g, long long stride, int row0, int n, int d, bool vec,
                                                const u16* sm) {
    constexpr int CH = DP / 8, LDS = DP + 8, TOTAL = ROWS * CH;
    const int r0 = (int)threadIdx.x / CH, c0 = ((int)threadIdx.x % CH) * 8;
#pragma unroll
    for (int it = 0; it < (TOTAL + ATTN_THREADS - 1) / ATTN_THREADS; ++it) {
        const int r = r0 + it * (ATTN_THREADS / CH);
        if (TOTAL % ATTN_THREADS == 0 || r < ROWS) {
            const int row = row0 + r;
            if (row < n && c0 < d) {
                const u16* src = sm + r * LDS + c0;
                u16* dst = g + row * stride + c0;
                if (vec) {
                    attn_copy16(dst, src);
                } else {
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        if (c0 + e < d) dst[e] = src[e];
                    }
                }
            }
        }
    }
}

// A warp's 16 x DP accumulators (C layout) times mul0 (rows g) and mul1 (rows g + 8), rounded to
// T, into rows row0..row0+15 of the shared tile sm (pitch DP + 8).
template <typename T, int DP>
__device__ __forceinline__ void attn_acc_to_smem(u16* sm, int row0, const float (&acc)[DP / 8][4], float mul0,
                                                 float mul1) {
    constexpr int LDS = DP + 8;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
        attn_st_u32(sm + (row0 + g) * LDS + 8 * n + 2 * t, attn_pack<T>(acc[n][0] * mul0, acc[n][1] * mul0));
        attn_st_u32(sm + (row0 + g + 8) * LDS + 8 * n + 2 * t, attn_pack<T>(acc[n][2] * mul1, acc[n][3] * mul1));
    }
}

// ---- warp-level products over shared tiles (pitch LDS = DP + 8) ----

// acc[NT][4] (+)= A * Bt^T for the warp's 16 rows: A given as fragments af[DP/16] over the DP
// reduction columns, Bt the shared tile rows [0, 8 * NT) (each row one output column) with the
// reduction along its DP columns: the B operand read with non-transposing ldmatrix.
template <typename T, int DP, int NT>
__device__ __forceinline__ void attn_mma_abt(float (&acc)[NT][4], const u32 (&af)[DP / 16][4], const u16* bt) {
    constexpr int LDS = DP + 8;
    const int lane = threadIdx.x & 31;
    // Matrices: (rows 16j..+7, cols 16kk..+7), (rows 16j..+7, cols 16kk+8..), (rows 16j+8.., cols
    // 16kk..), (rows 16j+8.., cols 16kk+8..): b[0], b[1] for output tile 2j, b[2], b[3] for 2j+1.
    const u16* base = bt + ((lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
        AttnA<T> a;
        a.set(af[kk]);
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            u32 b[4];
            attn_ldsm_x4(b, base + 16 * j * LDS + 16 * kk);
            attn_mma<T>(acc[2 * j], a, b[0], b[1]);
            attn_mma<T>(acc[2 * j + 1], a, b[2], b[3]);
        }
    }
}

// acc[DP/8][4] += P * Bs for the warp's 16 rows: P given as accumulators p[KT][4] of 16 x (8 KT)
// (rounded to T here), Bs the shared tile rows [0, 8 KT) (the reduction index) by DP columns (the
// output columns): the B operand read with transposing ldmatrix.
template <typename T, int DP, int KT>
__device__ __forceinline__ void attn_mma_pb(float (&acc)[DP / 8][4], const float (&p)[KT][4], const u16* bs) {
    constexpr int LDS = DP + 8;
    const int lane = threadIdx.x & 31;
    // Matrices: (rows 16kk..+7, cols 16n..+7), (rows 16kk+8.., cols 16n..), (rows 16kk..+7,
    // cols 16n+8..), (rows 16kk+8.., cols 16n+8..): b[0], b[1] for output tile 2n, b[2], b[3] for 2n+1.
    const u16* base = bs + (lane & 15) * LDS + ((lane >> 4) << 3);
#pragma unroll
    for (int kk = 0; kk < KT / 2; ++kk) {
        const u32 pa[4] = {attn_pack<T>(p[2 * kk][0], p[2 * kk][1]), attn_pack<T>(p[2 * kk][2], p[2 * kk][3]),
                           attn_pack<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                           attn_pack<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
        AttnA<T> a;
        a.set(pa);
#pragma unroll
        for (int n = 0; n < DP / 16; ++n) {
            u32 b[4];
            attn_ldsm_x4_t(b, base + 16 * kk * LDS + 16 * n);
            attn_mma<T>(acc[2 * n], a, b[0], b[1]);
            attn_mma<T>(acc[2 * n + 1], a, b[2], b[3]);
        }
    }
}

// The A fragments of rows [0, 16) of a shared tile (all DP columns).
template <int DP> __device__ __forceinline__ void attn_load_a(u32 (&af)[DP / 16][4], const u16* tile) {
    constexpr int LDS = DP + 8;
    const int lane = threadIdx.x & 31;
    // Matrices: (rows 0..7, cols 16kk..), (rows 8..15, cols 16kk..), (rows 0..7, cols 16kk+8..),
    // (rows 8..15, cols 16kk+8..) = a[0], a[1], a[2], a[3].
    const u16* base = tile + (lane & 15) * LDS + ((lane >> 4) << 3);
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) attn_ldsm_x4(af[kk], base + 16 * kk);
}
