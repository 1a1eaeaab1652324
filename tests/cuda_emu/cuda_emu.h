// tests/cuda_emu/cuda_emu.h: the CUDA device API that kernels/*.cu use, on the host, so the
// kernels' own source runs on a CPU (the `cuda_plan_semantics` tests run the CUDA plans through
// it and compare every launch with the CPU device).
//
// Each CUDA thread of a block is a fiber (ucontext) on the calling OS thread; the block's fibers
// run one at a time, each until it finishes or waits, a warp at a time (its lanes until all of
// them wait at a block barrier or have returned), and blocks run one after another. So:
// - __syncthreads waits until every thread of the block that has not returned arrives;
// - __shfl_sync, __shfl_down_sync, __shfl_xor_sync and __syncwarp wait for every lane of the warp:
//   all 32 must exist and none may have returned (the kernels only shuffle with the full mask);
// - __shared__ arrays are the kernel's static arrays, shared by the block's fibers (blocks never
//   run at the same time);
// - a wait that can never end (a barrier some threads skip) is reported, not hung on.
// Half and bfloat16 are bit patterns converted with round-to-nearest-even, as the device does.
// The host math library computes expf and the like, so the last bit may differ from the GPU's.
#pragma once
#define MPC_EMULATED 1

#include <ucontext.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

namespace emu {

enum class Wait { None, Block, Warp, Done };

// One 16-byte (or shorter) cp.async: its source as read when it was issued, and where it goes.
struct AsyncCopy {
    void* dst;
    size_t n;
    unsigned char bytes[16];
};

struct Fiber {
    ucontext_t ctx;
    dim3 idx;
    Wait wait = Wait::None;
    std::vector<AsyncCopy> open;                 // issued since the last commit
    std::vector<std::vector<AsyncCopy>> groups;  // committed, not yet waited for (oldest first)
};

struct WarpSync {
    int arrived = 0;
    unsigned gen = 0;
    unsigned long long slot[32] = {};
    unsigned long long snap[32] = {};
};

struct Block {
    dim3 grid, block, block_idx;
    std::vector<Fiber> fibers;
    std::vector<WarpSync> warps;
    int current = 0;
    int live = 0;
    int bar_arrived = 0;
    unsigned bar_gen = 0;
    ucontext_t scheduler;
    void (*body)(void*, void**) = nullptr;
    void* fn = nullptr;
    void** args = nullptr;
    bool progress = false;
    std::string error;
};

inline thread_local Block* current_block = nullptr;
inline thread_local std::vector<std::vector<char>>* stacks = nullptr;

inline Block& B() { return *current_block; }
inline const dim3& thread_idx() { return B().fibers[B().current].idx; }

inline void yield() {
    Block& b = B();
    swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
}

inline void syncthreads() {
    Block& b = B();
    const unsigned gen = b.bar_gen;
    b.progress = true;
    b.fibers[b.current].wait = Wait::Block;
    if (++b.bar_arrived == b.live) {
        b.bar_arrived = 0;
        ++b.bar_gen;
    }
    while (B().bar_gen == gen) yield();
    B().fibers[B().current].wait = Wait::None;
}

// cp.async as late as the device may complete it: the source is read when the copy is issued,
// the destination holds a poison pattern (all ones: NaN in f16, bf16 and f32) until a wait that
// covers the copy's group writes it. So a thread that reads the bytes before its wait and the
// barrier after it, or a copy issued into bytes other threads still read, gives wrong results
// here, as it may on the device. cp_async(dst, nullptr, n) is the zero fill of a copy of size 0.
inline void cp_async(void* dst, const void* src, size_t n) {
    AsyncCopy c{dst, n, {}};
    if (src != nullptr) std::memcpy(c.bytes, src, n);
    std::memset(dst, 0xff, n);
    B().fibers[B().current].open.push_back(c);
}

// Closes the group of the copies issued since the last commit (an empty group too).
inline void cp_commit() {
    Fiber& f = B().fibers[B().current];
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}

// Completes this thread's oldest committed groups until at most `pending` are left.
inline void cp_wait(size_t pending) {
    Fiber& f = B().fibers[B().current];
    while (f.groups.size() > pending) {
        for (const AsyncCopy& c : f.groups.front()) std::memcpy(c.dst, c.bytes, c.n);
        f.groups.erase(f.groups.begin());
    }
}

inline int lane_count(const Block& b, int warp) {
    const int n = (int)(b.block.x * b.block.y * b.block.z);
    return n - warp * 32 < 32 ? n - warp * 32 : 32;
}

inline int linear_tid(const Block& b) {
    const dim3& t = b.fibers[b.current].idx;
    return (int)(t.x + b.block.x * (t.y + b.block.y * t.z));
}

// Every lane of the warp arrives with `bits`; each gets the lanes' values as they were then.
inline const unsigned long long* warp_exchange(unsigned mask, unsigned long long bits) {
    Block& b = B();
    const int tid = linear_tid(b), warp = tid / 32, lane = tid % 32;
    if (mask != 0xffffffffu || lane_count(b, warp) != 32) {
        b.error = "a warp operation without 32 lanes or with a partial mask";
        b.fibers[b.current].wait = Wait::Done;
        yield();
    }
    WarpSync& w = b.warps[warp];
    const unsigned gen = w.gen;
    w.slot[lane] = bits;
    b.progress = true;
    b.fibers[b.current].wait = Wait::Warp;
    if (++w.arrived == 32) {
        std::memcpy(w.snap, w.slot, sizeof w.snap);
        w.arrived = 0;
        ++w.gen;
    }
    while (B().warps[warp].gen == gen) yield();
    B().fibers[B().current].wait = Wait::None;
    return B().warps[warp].snap;
}

template <typename T> inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffles move up to 8 bytes");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <typename T> inline T from_bits(unsigned long long u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}

inline void fiber_main() {
    Block& b = B();
    b.body(b.fn, b.args);
    Block& c = B();
    c.fibers[c.current].wait = Wait::Done;
    --c.live;
    c.progress = true;
    // A thread that returns no longer holds back the block's barrier.
    if (c.bar_arrived > 0 && c.bar_arrived == c.live) {
        c.bar_arrived = 0;
        ++c.bar_gen;
    }
    swapcontext(&c.fibers[c.current].ctx, &c.scheduler);
}

constexpr size_t kStack = 256 * 1024;

// Runs the grid; "" or what went wrong.
inline std::string run(dim3 grid, dim3 block, void (*body)(void*, void**), void* fn, void** args) {
    const int n = (int)(block.x * block.y * block.z);
    if (n <= 0 || n > 1024) return "a block of " + std::to_string(n) + " threads";
    if (!stacks) stacks = new std::vector<std::vector<char>>();
    while ((int)stacks->size() < n) stacks->emplace_back(kStack);
    Block b;
    b.grid = grid;
    b.block = block;
    b.body = body;
    b.fn = fn;
    b.args = args;
    b.fibers.resize(n);
    b.warps.resize((n + 31) / 32);
    Block* saved = current_block;
    current_block = &b;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                b.block_idx = {bx, by, bz};
                b.live = n;
                b.bar_arrived = 0;
                for (auto& w : b.warps) w.arrived = 0;
                for (int t = 0; t < n; ++t) {
                    Fiber& f = b.fibers[t];
                    f.idx = {(unsigned)t % block.x, (unsigned)t / block.x % block.y, (unsigned)t / (block.x * block.y)};
                    f.wait = Wait::None;
                    f.open.clear();
                    f.groups.clear();
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = (*stacks)[t].data();
                    f.ctx.uc_stack.ss_size = kStack;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, fiber_main, 0);
                }
                while (b.live > 0) {
                    // Each warp in turn runs as far as it can (until each of its lanes waits at a
                    // block barrier or has returned) before the next one starts: a warp that reads
                    // what another writes, or writes what another reads, without a barrier between
                    // them sees the other a whole phase ahead or behind, not in step with it.
                    bool moved = false;
                    for (int w0 = 0; w0 < n; w0 += 32) {
                        for (;;) {
                            b.progress = false;
                            for (int t = w0; t < n && t < w0 + 32; ++t) {
                                if (b.fibers[t].wait == Wait::Done) continue;
                                b.current = t;
                                swapcontext(&b.scheduler, &b.fibers[t].ctx);
                                if (!b.error.empty()) {
                                    current_block = saved;
                                    return b.error + " (block " + std::to_string(bx) + "," + std::to_string(by) +
                                           "," + std::to_string(bz) + ", thread " + std::to_string(t) + ")";
                                }
                            }
                            if (!b.progress) break;
                            moved = true;
                        }
                    }
                    if (!moved && b.live > 0) {
                        current_block = saved;
                        return "threads wait for a barrier or shuffle that the others never reach (block " +
                               std::to_string(bx) + ")";
                    }
                }
            }
    current_block = saved;
    return "";
}

// ---- the kernels' table: name, parameter sizes, and how to call one from an array of
// pointers to its arguments ----

struct Entry {
    void* fn;
    void (*body)(void*, void**);
    std::vector<size_t> sizes;
};

inline std::map<std::string, Entry>& table() {
    static std::map<std::string, Entry> t;
    return t;
}

template <typename... A, size_t... I> void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A> struct Register {
    Register(const char* name, void (*f)(A...)) {
        table()[name] = Entry{(void*)f,
                              [](void* fn, void** args) {
                                  call(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
                              },
                              {sizeof(A)...}};
    }
};

}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::B().block_idx)
#define blockDim (emu::B().block)
#define gridDim (emu::B().grid)

inline void __syncthreads() { emu::syncthreads(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_exchange(mask, 0); }
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_bits(v));
    const int lane = emu::linear_tid(emu::B()) % 32;
    return lane + (int)delta < 32 ? emu::from_bits<T>(s[lane + delta]) : v;
}
// Lane `src` of the lane's segment of `width` lanes (src taken modulo width), as the device does.
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_bits(v));
    const int lane = emu::linear_tid(emu::B()) % 32;
    return emu::from_bits<T>(s[(lane & ~(width - 1)) + (src & (width - 1))]);
}
// Lane `lane ^ lane_mask`; the lane's own value where that lies in a later segment of `width`.
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const unsigned long long* s = emu::warp_exchange(mask, emu::to_bits(v));
    const int lane = emu::linear_tid(emu::B()) % 32;
    const int src = lane ^ lane_mask;
    return src < (lane & ~(width - 1)) + width ? emu::from_bits<T>(s[src]) : v;
}

// ---- atomics: one thread runs at a time, so a read-modify-write is atomic as it is ----
inline float atomicAdd(float* p, float v) {
    const float old = *p;
    *p = old + v;
    return old;
}
inline double atomicAdd(double* p, double v) {
    const double old = *p;
    *p = old + v;
    return old;
}

// ---- bit casts ----
inline float __int_as_float(int v) { return emu::from_bits<float>((unsigned)v); }
inline float __uint_as_float(unsigned v) { return emu::from_bits<float>(v); }
inline unsigned __float_as_uint(float v) { return (unsigned)emu::to_bits(v); }
inline int __float_as_int(float v) { return (int)(unsigned)emu::to_bits(v); }
inline double __longlong_as_double(long long v) { return emu::from_bits<double>((unsigned long long)v); }
inline long long __double_as_longlong(double v) { return (long long)emu::to_bits(v); }
inline float __double2float_rn(double v) { return (float)v; }

// ---- f16 and bf16: storage types, converted with round-to-nearest-even ----
namespace emu {
inline unsigned short f32_to_f16(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to infinity
    if (ax < 0x38800000u) {                                           // subnormal or zero
        const float a = std::fabs(f) * 16777216.0f;                    // 2^24: units of the f16 ulp
        return (unsigned short)(sign | (unsigned)std::nearbyint(a));
    }
    const unsigned mant = ax & 0x7fffffu, exp = (ax >> 23) - 112;
    unsigned h = (exp << 10) | (mant >> 13);
    const unsigned rest = mant & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h;
    return (unsigned short)(sign | h);
}
inline float f16_to_f32(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
    unsigned x;
    if (exp == 0x1f) {
        x = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        const float v = (float)mant / 16777216.0f;
        return sign ? -v : v;
    } else {
        x = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline unsigned short f32_to_bf16(float f) {
    unsigned x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1);
    return (unsigned short)(x >> 16);
}
inline float bf16_to_f32(unsigned short h) {
    const unsigned x = (unsigned)h << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
}  // namespace emu

struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(emu::f32_to_f16(f)) {}
    operator float() const { return emu::f16_to_f32(__x); }
};
struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(emu::f32_to_bf16(f)) {}
    operator float() const { return emu::bf16_to_f32(__x); }
};
inline float __half2float(__half h) { return emu::f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) {
    __half h;
    h.__x = emu::f32_to_f16(f);
    return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
inline float __bfloat162float(__nv_bfloat16 h) { return emu::bf16_to_f32(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    __nv_bfloat16 h;
    h.__x = emu::f32_to_bf16(f);
    return h;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 h;
    h.__x = u;
    return h;
}

// ---- the device math the kernels call that the host library lacks ----
using std::isfinite;
using std::isinf;
using std::isnan;
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
inline double rsqrt(double v) { return 1.0 / std::sqrt(v); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
