// kernels/elementwise.cu: element-wise unary, binary (numpy broadcasting), comparison, logical,
// Where, Clip, IsNaN/IsInf kernels.
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loops over the output, blockDim.x = 256 (any value up to 256 works),
// gridDim.x = min(ceil(n / 256), a few times the SM count x 8); results do not depend on it.
// Float math is f32 for f32/f16/bf16 (rounded once on store) and f64 for f64, written as the CPU
// reference (runtime/src/cpu/elementwise.rs) writes it.
//
// ---- ABIs (T is the dtype of the tag; U8 outputs are bool 0/1) ----
// Unary float, tags f32 f16 bf16 f64:
//   elementwise_<op>_<T>(const T* x, T* y, long long n, float alpha, float beta)
//   ops: relu sigmoid tanh exp log sqrt neg abs erf reciprocal floor ceil round (half to even)
//        sign sin cos softplus softsign hard_swish gelu (erf form) gelu_tanh
//        leaky_relu (alpha) elu (alpha) celu (alpha) selu (alpha, beta = gamma) hard_sigmoid (alpha, beta)
//        tan sinh cosh asin acos atan asinh acosh atanh (mpc_ir::ops::Trig)
//   alpha/beta are ignored by the ops that take no attribute. y may equal x (in place).
// Unary integer, tags i64 i32:  elementwise_{neg,abs,relu,sign}_<T>(const T* x, T* y, long long n)
//   (wrapping neg/abs like the CPU reference).
// Binary, broadcasting over an output of rank <= 8:
//   elementwise_<op>_<T>(const T* a, const T* b, T* y, long long n, int rank, Dims8 dims,
//                         Strides8 sa, Strides8 sb)
//   n = output element count = prod(dims[0..rank)); y is contiguous row-major over dims; sa/sb
//   are the operands' element strides per output dim (0 where broadcast). rank = 0 means both
//   operands are contiguous with n elements (no broadcasting; dims/strides ignored).
//   float ops (f32 f16 bf16 f64): add sub mul div pow min max prelu (a = x, b = slope)
//        mod (fmod=1: C fmod, sign of a) mod_py (fmod=0: numpy mod, sign of b)
//        Min/Max propagate NaN. Pow's exponent has the base's dtype (the host casts it first).
//   integer ops (i64 i32): add sub mul (wrapping) div (toward zero; b = 0 gives 0) min max
//        mod (C remainder) mod_py (numpy) pow ((double)a ^ (double)b, saturated); b = 0 gives 0
//        for div, mod, mod_py. The same ops for i16 i8 u64 u32 u16 u8 compute in i64 (operands
//        read as i64, u64's bits reinterpreted; the result truncated on store), as the CPU does.
//   bit ops (mpc_ir::ops::Bitwise), every integer tag: bitand bitor bitxor, and shl shr (BitShift,
//        in the operand's type: shr arithmetic on signed tags; a shift by the width or more, or
//        by a negative amount, leaves the sign's fill: -1 for a negative x shifted right, else 0).
//   elementwise_bitnot_<T>(const T* x, T* y, long long n), T any integer tag.
// Comparisons, same broadcasting ABI with `u8* y`:
//   elementwise_{equal,less,greater,greater_equal,less_equal}_<T>, T in f32 f16 bf16 f64 i64 i32
//   i16 i8 u64 u32 u16 u8 (integers compared as i64, so u64 past 2^63 as the CPU reference does)
// Logical on bool (u8, nonzero is true), same broadcasting ABI: elementwise_{and,or,xor}_u8
//   elementwise_not_u8(const u8* x, u8* y, long long n)
// Where, by element size (b1 b2 b4 b8 move any dtype of that size bit for bit):
//   elementwise_where_<b>(const u8* cond, const T* a, const T* b, T* y, long long n, int rank,
//                         Dims8 dims, Strides8 sc, Strides8 sa, Strides8 sb)
//   y = cond ? a : b; rank = 0 means all three contiguous with n elements.
// Clip: elementwise_clip_<T>(const T* x, T* y, long long n, const T* lo, const T* hi)
//   T in f32 f16 bf16 f64 i64 i32 i16 i8 u64 u32 u16 u8; lo/hi are device scalars, nullptr =
//   unbounded. Floats use
//   fmax/fmin (a NaN input gives the bound, like the CPU reference's f64::max/min).
// Tests: elementwise_isnan_<T>(const T* x, u8* y, long long n)
//        elementwise_isinf_<T>(const T* x, u8* y, long long n, int detect_positive, int detect_negative)
//   T in f32 f16 bf16 f64.

// ---------------------------------------------------------------- unary float

template <typename T, typename F>
__device__ __forceinline__ void unary_body(const T* __restrict__ x, T* __restrict__ y, long long n, float alpha,
                                           float beta, F f) {
    typedef typename Acc<T>::type C;
    MPC_GRID_STRIDE(i, n) { st(y, i, f(ld(x, i), (C)alpha, (C)beta)); }
}

#define UNARY_T(name, T, tag)                                                           \
    MPC_KERNEL elementwise_##name##_##tag(const T* x, T* y, long long n, float alpha, float beta) { \
        unary_body<T>(x, y, n, alpha, beta, U_##name());                                \
    }
#define UNARY(name)                 \
    UNARY_T(name, float, f32)       \
    UNARY_T(name, __half, f16)      \
    UNARY_T(name, __nv_bfloat16, bf16) \
    UNARY_T(name, double, f64)

// One kernel per op of common.cuh's list.
#define UNARY_OF(name, expr) UNARY(name)
MPC_UNARY_OPS(UNARY_OF)

// ---------------------------------------------------------------- unary integer

template <typename T> struct Unsigned;
template <> struct Unsigned<long long> { typedef unsigned long long type; };
template <> struct Unsigned<int> { typedef unsigned int type; };
template <> struct Unsigned<short> { typedef unsigned short type; };
template <> struct Unsigned<signed char> { typedef unsigned char type; };
template <> struct Unsigned<unsigned long long> { typedef unsigned long long type; };
template <> struct Unsigned<unsigned int> { typedef unsigned int type; };
template <> struct Unsigned<unsigned short> { typedef unsigned short type; };
template <> struct Unsigned<unsigned char> { typedef unsigned char type; };

#define IUNARY_T(name, TT, tag, expr)                                                  \
    MPC_KERNEL elementwise_##name##_##tag(const TT* __restrict__ x, TT* __restrict__ y, long long n) { \
        typedef TT T;                                                                  \
        typedef Unsigned<T>::type U;                                                   \
        MPC_GRID_STRIDE(i, n) {                                                        \
            T v = x[i];                                                                \
            y[i] = (expr);                                                             \
        }                                                                              \
    }
#define IUNARY(name, expr)                  \
    IUNARY_T(name, long long, i64, expr)    \
    IUNARY_T(name, int, i32, expr)

IUNARY(neg, (T)((U)0 - (U)v))
IUNARY(abs, v < 0 ? (T)((U)0 - (U)v) : v)
IUNARY(relu, v > 0 ? v : (T)0)
IUNARY(sign, (T)((v > 0) - (v < 0)))

// ---------------------------------------------------------------- binary with broadcasting

template <typename TA, typename TY, typename F>
__device__ __forceinline__ void binary_body(const TA* __restrict__ a, const TA* __restrict__ b, TY* __restrict__ y,
                                            long long n, int rank, const Dims8& dims, const Strides8& sa,
                                            const Strides8& sb, F f) {
    MPC_GRID_STRIDE(i, n) {
        long long oa = i, ob = i;
        if (rank > 0) strided_offset2(i, rank, dims, sa, sb, oa, ob);
        f(a, oa, b, ob, y, i);
    }
}

// Float ops: load both in the compute type, store the result in T (the formulas are the V_<op>
// functors of common.cuh).
#define FBOP(name)                                                                               \
    struct B_##name {                                                                            \
        template <typename T>                                                                    \
        __device__ __forceinline__ void operator()(const T* a, long long oa, const T* b, long long ob, T* y, \
                                                   long long i) const {                          \
            typedef typename Acc<T>::type C;                                                     \
            C x = ld(a, oa), z = ld(b, ob);                                                      \
            st(y, i, (C)V_##name()(x, z));                                                       \
        }                                                                                        \
    };

FBOP(add)
FBOP(sub)
FBOP(mul)
FBOP(div)
FBOP(pow)
FBOP(min)
FBOP(max)
FBOP(prelu)
FBOP(mod)
FBOP(mod_py)

#define BINARY_T(name, T, tag)                                                                        \
    MPC_KERNEL elementwise_##name##_##tag(const T* a, const T* b, T* y, long long n, int rank, Dims8 dims, \
                                          Strides8 sa, Strides8 sb) {                                 \
        binary_body(a, b, y, n, rank, dims, sa, sb, B_##name());                                      \
    }
#define FBINARY(name)                  \
    BINARY_T(name, float, f32)         \
    BINARY_T(name, __half, f16)        \
    BINARY_T(name, __nv_bfloat16, bf16) \
    BINARY_T(name, double, f64)

FBINARY(add)
FBINARY(sub)
FBINARY(mul)
FBINARY(div)
FBINARY(pow)
FBINARY(min)
FBINARY(max)
FBINARY(prelu)
FBINARY(mod)
FBINARY(mod_py)

// Integer ops: wrapping arithmetic through the unsigned type, like the CPU reference's i64 ops.
template <typename T> __device__ __forceinline__ T int_pow(T a, T b) {
    double r = pow((double)a, (double)b);
    if (r != r) return 0;
    if (sizeof(T) == 8) {
        if (r >= 9223372036854775808.0) return (T)0x7fffffffffffffffLL;
        if (r <= -9223372036854775808.0) return (T)(-0x7fffffffffffffffLL - 1);
    } else {
        if (r >= 2147483647.0) return (T)2147483647;
        if (r <= -2147483648.0) return (T)(-2147483647 - 1);
    }
    return (T)r;
}
template <typename T> __device__ __forceinline__ T int_div(T a, T b) {
    if (b == 0) return 0;
    if (b == -1) return (T)((typename Unsigned<T>::type)0 - (typename Unsigned<T>::type)a);  // wrapping
    return a / b;
}
template <typename T> __device__ __forceinline__ T int_rem(T a, T b) {
    if (b == 0 || b == -1) return 0;
    return a % b;
}
template <typename T> __device__ __forceinline__ T int_mod_py(T a, T b) {
    T r = int_rem(a, b);
    return (r != 0 && ((r < 0) != (b < 0))) ? (T)((typename Unsigned<T>::type)r + (typename Unsigned<T>::type)b) : r;
}

#define IBOP(name, expr)                                                                         \
    struct IB_##name {                                                                           \
        template <typename T>                                                                    \
        __device__ __forceinline__ void operator()(const T* a, long long oa, const T* b, long long ob, T* y, \
                                                   long long i) const {                          \
            typedef typename Unsigned<T>::type U;                                                \
            T x = a[oa], z = b[ob];                                                              \
            y[i] = (expr);                                                                       \
        }                                                                                        \
    };
IBOP(add, (T)((U)x + (U)z))
IBOP(sub, (T)((U)x - (U)z))
IBOP(mul, (T)((U)x * (U)z))
IBOP(div, int_div(x, z))
IBOP(min, x < z ? x : z)
IBOP(max, x > z ? x : z)
IBOP(mod, int_rem(x, z))
IBOP(mod_py, int_mod_py(x, z))
IBOP(pow, int_pow(x, z))
IBOP(bitand, x & z)
IBOP(bitor, x | z)
IBOP(bitxor, x ^ z)
// Shifts in the operand's own type (never widened: u64 shifts right logically, i8 arithmetically).
// What a right shift past the width leaves: the sign's fill (0 for the unsigned types).
template <typename T> __device__ __forceinline__ T sign_fill(T) { return 0; }
template <> __device__ __forceinline__ long long sign_fill(long long x) { return x < 0 ? -1 : 0; }
template <> __device__ __forceinline__ int sign_fill(int x) { return x < 0 ? -1 : 0; }
template <> __device__ __forceinline__ short sign_fill(short x) { return x < 0 ? -1 : 0; }
template <> __device__ __forceinline__ signed char sign_fill(signed char x) { return x < 0 ? -1 : 0; }
IBOP(shl, (unsigned long long)z < 8 * sizeof(T) ? (T)((U)x << z) : (T)0)
IBOP(shr, (unsigned long long)z < 8 * sizeof(T) ? (T)(x >> z) : sign_fill(x))

#define IBINARY_T(name, T, tag)                                                                       \
    MPC_KERNEL elementwise_##name##_##tag(const T* a, const T* b, T* y, long long n, int rank, Dims8 dims, \
                                          Strides8 sa, Strides8 sb) {                                 \
        binary_body(a, b, y, n, rank, dims, sa, sb, IB_##name());                                     \
    }
#define IBINARY(name)                 \
    IBINARY_T(name, long long, i64)   \
    IBINARY_T(name, int, i32)

IBINARY(add)
IBINARY(sub)
IBINARY(mul)
IBINARY(div)
IBINARY(min)
IBINARY(max)
IBINARY(mod)
IBINARY(mod_py)
IBINARY(pow)
IBINARY(bitand)
IBINARY(bitor)
IBINARY(bitxor)

// The other integer dtypes compute as the CPU reference does: each operand read as i64 (u64's
// bits reinterpreted), the i64 op, the result truncated to the dtype on store.
template <typename Op> struct Wide {
    template <typename T>
    __device__ __forceinline__ void operator()(const T* a, long long oa, const T* b, long long ob, T* y,
                                               long long i) const {
        const long long x = (long long)a[oa], z = (long long)b[ob];
        long long r;
        Op()(&x, 0, &z, 0, &r, 0);
        y[i] = (T)(unsigned long long)r;
    }
};
#define WBINARY_T(name, T, tag)                                                                       \
    MPC_KERNEL elementwise_##name##_##tag(const T* a, const T* b, T* y, long long n, int rank, Dims8 dims, \
                                          Strides8 sa, Strides8 sb) {                                 \
        binary_body(a, b, y, n, rank, dims, sa, sb, Wide<IB_##name>());                               \
    }
#define WBINARY(name)                          \
    WBINARY_T(name, short, i16)                \
    WBINARY_T(name, signed char, i8)           \
    WBINARY_T(name, unsigned long long, u64)   \
    WBINARY_T(name, unsigned int, u32)         \
    WBINARY_T(name, unsigned short, u16)       \
    WBINARY_T(name, unsigned char, u8)

WBINARY(add)
WBINARY(sub)
WBINARY(mul)
WBINARY(div)
WBINARY(min)
WBINARY(max)
WBINARY(mod)
WBINARY(mod_py)
WBINARY(pow)
WBINARY(bitand)
WBINARY(bitor)
WBINARY(bitxor)
#define SHIFT(name)                            \
    IBINARY(name)                              \
    IBINARY_T(name, short, i16)                \
    IBINARY_T(name, signed char, i8)           \
    IBINARY_T(name, unsigned long long, u64)   \
    IBINARY_T(name, unsigned int, u32)         \
    IBINARY_T(name, unsigned short, u16)       \
    IBINARY_T(name, unsigned char, u8)
SHIFT(shl)
SHIFT(shr)

#define BITNOT_T(T, tag)                                                                   \
    MPC_KERNEL elementwise_bitnot_##tag(const T* __restrict__ x, T* __restrict__ y, long long n) { \
        MPC_GRID_STRIDE(i, n) { y[i] = (T)~x[i]; }                                         \
    }
BITNOT_T(long long, i64)
BITNOT_T(int, i32)
BITNOT_T(short, i16)
BITNOT_T(signed char, i8)
BITNOT_T(unsigned long long, u64)
BITNOT_T(unsigned int, u32)
BITNOT_T(unsigned short, u16)
BITNOT_T(unsigned char, u8)

// ---------------------------------------------------------------- comparisons and logic → u8

// Loads in a type where comparisons are exact: f32 for the float storage types, f64, integers.
__device__ __forceinline__ long long cmp_ld(const long long* p, long long i) { return p[i]; }
__device__ __forceinline__ int cmp_ld(const int* p, long long i) { return p[i]; }
__device__ __forceinline__ int cmp_ld(const unsigned char* p, long long i) { return p[i]; }
__device__ __forceinline__ int cmp_ld(const signed char* p, long long i) { return p[i]; }
__device__ __forceinline__ int cmp_ld(const short* p, long long i) { return p[i]; }
__device__ __forceinline__ int cmp_ld(const unsigned short* p, long long i) { return p[i]; }
__device__ __forceinline__ long long cmp_ld(const unsigned int* p, long long i) { return p[i]; }
// As the CPU reference, which compares integers as i64.
__device__ __forceinline__ long long cmp_ld(const unsigned long long* p, long long i) { return (long long)p[i]; }
template <typename T> __device__ __forceinline__ typename Acc<T>::type cmp_ld(const T* p, long long i) {
    return ld(p, i);
}

#define CMPOP(name, expr)                                                                        \
    struct C_##name {                                                                            \
        template <typename T>                                                                    \
        __device__ __forceinline__ void operator()(const T* a, long long oa, const T* b, long long ob, u8* y, \
                                                   long long i) const {                          \
            auto x = cmp_ld(a, oa);                                                              \
            auto z = cmp_ld(b, ob);                                                              \
            y[i] = (expr) ? 1 : 0;                                                               \
        }                                                                                        \
    };
CMPOP(equal, x == z)
CMPOP(less, x < z)
CMPOP(greater, x > z)
CMPOP(greater_equal, x >= z)
CMPOP(less_equal, x <= z)
CMPOP(land, (x != 0) && (z != 0))
CMPOP(lor, (x != 0) || (z != 0))
CMPOP(lxor, (x != 0) != (z != 0))

#define CMP_K(kname, op, T)                                                                             \
    MPC_KERNEL kname(const T* a, const T* b, u8* y, long long n, int rank, Dims8 dims, Strides8 sa, Strides8 sb) { \
        binary_body(a, b, y, n, rank, dims, sa, sb, C_##op());                                                \
    }
#define CMP_T(name, T, tag) CMP_K(elementwise_##name##_##tag, name, T)
#define CMP(name)                      \
    CMP_T(name, float, f32)            \
    CMP_T(name, __half, f16)           \
    CMP_T(name, __nv_bfloat16, bf16)   \
    CMP_T(name, double, f64)           \
    CMP_T(name, long long, i64)        \
    CMP_T(name, int, i32)              \
    CMP_T(name, short, i16)            \
    CMP_T(name, signed char, i8)       \
    CMP_T(name, unsigned long long, u64) \
    CMP_T(name, unsigned int, u32)     \
    CMP_T(name, unsigned short, u16)   \
    CMP_T(name, unsigned char, u8)

CMP(equal)
CMP(less)
CMP(greater)
CMP(greater_equal)
CMP(less_equal)
CMP_K(elementwise_and_u8, land, unsigned char)
CMP_K(elementwise_or_u8, lor, unsigned char)
CMP_K(elementwise_xor_u8, lxor, unsigned char)

MPC_KERNEL elementwise_not_u8(const u8* __restrict__ x, u8* __restrict__ y, long long n) {
    MPC_GRID_STRIDE(i, n) { y[i] = x[i] == 0 ? 1 : 0; }
}

// ---------------------------------------------------------------- Where

template <typename T>
__device__ __forceinline__ void where_body(const u8* __restrict__ c, const T* __restrict__ a, const T* __restrict__ b,
                                           T* __restrict__ y, long long n, int rank, const Dims8& dims,
                                           const Strides8& sc, const Strides8& sa, const Strides8& sb) {
    MPC_GRID_STRIDE(i, n) {
        long long oc = i, oa = i, ob = i;
        if (rank > 0) strided_offset3(i, rank, dims, sc, sa, sb, oc, oa, ob);
        y[i] = c[oc] ? a[oa] : b[ob];
    }
}
#define WHERE_T(T, tag)                                                                                \
    MPC_KERNEL elementwise_where_##tag(const u8* c, const T* a, const T* b, T* y, long long n, int rank, \
                                       Dims8 dims, Strides8 sc, Strides8 sa, Strides8 sb) {            \
        where_body(c, a, b, y, n, rank, dims, sc, sa, sb);                                             \
    }
WHERE_T(u8, b1)
WHERE_T(u16, b2)
WHERE_T(u32, b4)
WHERE_T(u64, b8)

// ---------------------------------------------------------------- Clip

template <typename T> __device__ __forceinline__ AccT<T> finite_max();
template <> __device__ __forceinline__ float finite_max<float>() { return 3.40282347e38f; }
template <> __device__ __forceinline__ float finite_max<__half>() { return 65504.0f; }
template <> __device__ __forceinline__ float finite_max<__nv_bfloat16>() { return 3.38953139e38f; }
template <> __device__ __forceinline__ double finite_max<double>() { return 1.7976931348623157e308; }

template <typename T>
__device__ __forceinline__ void clip_body(const T* __restrict__ x, T* __restrict__ y, long long n, const T* lo,
                                          const T* hi) {
    typedef typename Acc<T>::type C;
    // An absent bound is T's lowest or largest finite value (ONNX's default: an infinity becomes it).
    C l = lo ? (C)ld(lo, 0) : -finite_max<T>();
    C h = hi ? (C)ld(hi, 0) : finite_max<T>();
    MPC_GRID_STRIDE(i, n) {
        C v = ld(x, i);
        st(y, i, m_isnan(v) ? v : m_fmin(m_fmax(v, l), h));  // NaN in, NaN out (fmax would drop it)
    }
}
#define CLIP_T(T, tag) \
    MPC_KERNEL elementwise_clip_##tag(const T* x, T* y, long long n, const T* lo, const T* hi) { clip_body(x, y, n, lo, hi); }
CLIP_T(float, f32)
CLIP_T(__half, f16)
CLIP_T(__nv_bfloat16, bf16)
CLIP_T(double, f64)

template <typename T>
__device__ __forceinline__ void iclip_body(const T* __restrict__ x, T* __restrict__ y, long long n, const T* lo,
                                           const T* hi) {
    MPC_GRID_STRIDE(i, n) {
        T v = x[i];
        if (lo && v < *lo) v = *lo;
        if (hi && v > *hi) v = *hi;
        y[i] = v;
    }
}
MPC_KERNEL elementwise_clip_i64(const long long* x, long long* y, long long n, const long long* lo, const long long* hi) {
    iclip_body(x, y, n, lo, hi);
}
MPC_KERNEL elementwise_clip_i32(const int* x, int* y, long long n, const int* lo, const int* hi) {
    iclip_body(x, y, n, lo, hi);
}
#define ICLIP_T(T, tag)                                                                                   \
    MPC_KERNEL elementwise_clip_##tag(const T* x, T* y, long long n, const T* lo, const T* hi) {          \
        iclip_body(x, y, n, lo, hi);                                                                      \
    }
ICLIP_T(short, i16)
ICLIP_T(signed char, i8)
ICLIP_T(unsigned long long, u64)
ICLIP_T(unsigned int, u32)
ICLIP_T(unsigned short, u16)
ICLIP_T(unsigned char, u8)

// ---------------------------------------------------------------- IsNaN, IsInf

#define SPECIAL_T(T, tag)                                                                            \
    MPC_KERNEL elementwise_isnan_##tag(const T* __restrict__ x, u8* __restrict__ y, long long n) {   \
        MPC_GRID_STRIDE(i, n) { y[i] = m_isnan(ld(x, i)) ? 1 : 0; }                                  \
    }                                                                                                \
    MPC_KERNEL elementwise_isinf_##tag(const T* __restrict__ x, u8* __restrict__ y, long long n,     \
                                       int detect_positive, int detect_negative) {                   \
        MPC_GRID_STRIDE(i, n) {                                                                      \
            auto v = ld(x, i);                                                                       \
            auto inf = m_inf(v);                                                                     \
            y[i] = ((v == inf && detect_positive) || (v == -inf && detect_negative)) ? 1 : 0;        \
        }                                                                                            \
    }
SPECIAL_T(float, f32)
SPECIAL_T(__half, f16)
SPECIAL_T(__nv_bfloat16, bf16)
SPECIAL_T(double, f64)
