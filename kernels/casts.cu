// kernels/casts.cu: ONNX Cast between f32, f16, bf16, f64, i64, i32, i8, u8 and bool, exactly as
// the CPU reference converts (runtime/src/value.rs `HostTensor::cast`).
//
// Compiled as `common.cuh` + this file (the host prepends common.cuh; see its header).
// Launch: 1-D grid-stride loop, blockDim.x = 256, any grid (e.g. min(ceil(n / 256), 8 x SMs x 8)).
//
// ABI, one kernel per ordered pair of distinct dtypes (156 kernels; a same-dtype Cast is a copy):
//   casts_<src>_to_<dst>(const S* x, D* y, long long n)
//   <src>, <dst> in f32 f16 bf16 f64 i64 i32 i16 i8 u64 u32 u16 u8 bool (bool is one byte holding
//   0 or 1).
//   y must not partially overlap x (y == x is fine when the sizes are equal).
//
// Semantics:
// - integer or bool -> integer: two's-complement wrap (Rust `as`), e.g. i64 300 -> u8 44; u64
//   reads as i64 first (the CPU reference's integer path), so the bits are kept.
// - anything -> bool: x != 0 (a NaN is true).
// - bool -> anything: 0 or 1.
// - float -> integer: truncation toward zero, saturating at the target's range, NaN -> 0.
// - to a float: through f64 (i64 rounds to nearest f64 first, as the CPU does), then rounded
//   once to nearest even: f64 -> f16/bf16 without double rounding (round-to-odd through f32).
//   f32/f16/bf16 to each other are the direct conversions (the same result).

// ---- reading: every source as f64, or as a 64-bit integer for the integer path ----

template <typename S> struct Src;
template <> struct Src<float> {
    static const bool is_int = false;
    __device__ static double f64(const float* p, long long i) { return (double)p[i]; }
    __device__ static long long i64(const float*, long long) { return 0; }
};
template <> struct Src<__half> {
    static const bool is_int = false;
    __device__ static double f64(const __half* p, long long i) { return (double)__half2float(p[i]); }
    __device__ static long long i64(const __half*, long long) { return 0; }
};
template <> struct Src<__nv_bfloat16> {
    static const bool is_int = false;
    __device__ static double f64(const __nv_bfloat16* p, long long i) { return (double)__bfloat162float(p[i]); }
    __device__ static long long i64(const __nv_bfloat16*, long long) { return 0; }
};
template <> struct Src<double> {
    static const bool is_int = false;
    __device__ static double f64(const double* p, long long i) { return p[i]; }
    __device__ static long long i64(const double*, long long) { return 0; }
};
#define INT_SRC(T)                                                                        \
    template <> struct Src<T> {                                                           \
        static const bool is_int = true;                                                  \
        __device__ static double f64(const T* p, long long i) { return (double)p[i]; }    \
        __device__ static long long i64(const T* p, long long i) { return (long long)p[i]; } \
    };
INT_SRC(long long)
INT_SRC(int)
INT_SRC(signed char)
INT_SRC(unsigned char)
INT_SRC(short)
INT_SRC(unsigned short)
INT_SRC(unsigned int)
// u64 -> integer reinterprets the bits as i64 first (the CPU reference reads integers as i64);
// u64 -> float converts the unsigned value.
template <> struct Src<unsigned long long> {
    static const bool is_int = true;
    __device__ static double f64(const unsigned long long* p, long long i) { return (double)p[i]; }
    __device__ static long long i64(const unsigned long long* p, long long i) { return (long long)p[i]; }
};

// bool storage is a byte; read it as 0/1 whatever the byte holds.
struct Bool {
    unsigned char b;
};
template <> struct Src<Bool> {
    static const bool is_int = true;
    __device__ static double f64(const Bool* p, long long i) { return p[i].b ? 1.0 : 0.0; }
    __device__ static long long i64(const Bool* p, long long i) { return p[i].b ? 1 : 0; }
};

// ---- writing ----

__device__ __forceinline__ long long sat_i64(double d) {
    if (d != d) return 0;
    if (d >= 9223372036854775808.0) return 0x7fffffffffffffffLL;
    if (d <= -9223372036854775808.0) return -0x7fffffffffffffffLL - 1;
    return (long long)d;
}
__device__ __forceinline__ int sat_int(double d, int lo, int hi) {
    if (d != d) return 0;
    if (d >= (double)hi) return hi;
    if (d <= (double)lo) return lo;
    return (int)d;
}

// Saturating float -> unsigned conversion (Rust `as`): NaN -> 0, below 0 -> 0, past the top -> max.
__device__ __forceinline__ unsigned long long sat_u(double d, double top, unsigned long long max) {
    if (d != d || d <= 0.0) return 0;
    if (d >= top) return max;
    return (unsigned long long)d;
}

template <typename D> struct Dst {
    static const bool is_float = false;
};
template <> struct Dst<float> {
    static const bool is_float = true;
    __device__ static void f64(float* p, long long i, double v) { p[i] = __double2float_rn(v); }
    __device__ static void i64(float* p, long long i, long long v) { p[i] = __double2float_rn((double)v); }
};
template <> struct Dst<__half> {
    static const bool is_float = true;
    __device__ static void f64(__half* p, long long i, double v) { p[i] = f16_from_f64(v); }
    __device__ static void i64(__half* p, long long i, long long v) { p[i] = f16_from_f64((double)v); }
};
template <> struct Dst<__nv_bfloat16> {
    static const bool is_float = true;
    __device__ static void f64(__nv_bfloat16* p, long long i, double v) { p[i] = bf16_from_f64(v); }
    __device__ static void i64(__nv_bfloat16* p, long long i, long long v) { p[i] = bf16_from_f64((double)v); }
};
template <> struct Dst<double> {
    static const bool is_float = true;
    __device__ static void f64(double* p, long long i, double v) { p[i] = v; }
    __device__ static void i64(double* p, long long i, long long v) { p[i] = (double)v; }
};
template <> struct Dst<long long> {
    static const bool is_float = false;
    __device__ static void f64(long long* p, long long i, double v) { p[i] = sat_i64(v); }
    __device__ static void i64(long long* p, long long i, long long v) { p[i] = v; }
};
template <> struct Dst<int> {
    static const bool is_float = false;
    __device__ static void f64(int* p, long long i, double v) { p[i] = sat_int(v, -2147483647 - 1, 2147483647); }
    __device__ static void i64(int* p, long long i, long long v) { p[i] = (int)(unsigned int)(unsigned long long)v; }
};
template <> struct Dst<signed char> {
    static const bool is_float = false;
    __device__ static void f64(signed char* p, long long i, double v) { p[i] = (signed char)sat_int(v, -128, 127); }
    __device__ static void i64(signed char* p, long long i, long long v) {
        p[i] = (signed char)(unsigned char)(unsigned long long)v;
    }
};
template <> struct Dst<unsigned char> {
    static const bool is_float = false;
    __device__ static void f64(unsigned char* p, long long i, double v) { p[i] = (unsigned char)sat_int(v, 0, 255); }
    __device__ static void i64(unsigned char* p, long long i, long long v) {
        p[i] = (unsigned char)(unsigned long long)v;
    }
};
template <> struct Dst<Bool> {
    static const bool is_float = false;
    __device__ static void f64(Bool* p, long long i, double v) { p[i].b = v != 0.0 ? 1 : 0; }
    __device__ static void i64(Bool* p, long long i, long long v) { p[i].b = v != 0 ? 1 : 0; }
};

template <> struct Dst<short> {
    static const bool is_float = false;
    __device__ static void f64(short* p, long long i, double v) { p[i] = (short)sat_int(v, -32768, 32767); }
    __device__ static void i64(short* p, long long i, long long v) { p[i] = (short)(unsigned short)(unsigned long long)v; }
};
template <> struct Dst<unsigned short> {
    static const bool is_float = false;
    __device__ static void f64(unsigned short* p, long long i, double v) {
        p[i] = (unsigned short)sat_u(v, 65535.0, 65535);
    }
    __device__ static void i64(unsigned short* p, long long i, long long v) { p[i] = (unsigned short)(unsigned long long)v; }
};
template <> struct Dst<unsigned int> {
    static const bool is_float = false;
    __device__ static void f64(unsigned int* p, long long i, double v) {
        p[i] = (unsigned int)sat_u(v, 4294967295.0, 4294967295ull);
    }
    __device__ static void i64(unsigned int* p, long long i, long long v) { p[i] = (unsigned int)(unsigned long long)v; }
};
template <> struct Dst<unsigned long long> {
    static const bool is_float = false;
    __device__ static void f64(unsigned long long* p, long long i, double v) {
        p[i] = sat_u(v, 18446744073709551616.0, ~0ull);
    }
    __device__ static void i64(unsigned long long* p, long long i, long long v) { p[i] = (unsigned long long)v; }
};

template <typename S, typename D> __device__ __forceinline__ void cast_body(const S* x, D* y, long long n) {
    MPC_GRID_STRIDE(i, n) {
        if (Src<S>::is_int && !Dst<D>::is_float)
            Dst<D>::i64(y, i, Src<S>::i64(x, i));
        else
            Dst<D>::f64(y, i, Src<S>::f64(x, i));
    }
}

// Direct paths between the f32 family (the same results as through f64, fewer instructions).
__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float as_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ void put_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void put_f32(__half* p, long long i, float v) { p[i] = __float2half_rn(v); }
__device__ __forceinline__ void put_f32(__nv_bfloat16* p, long long i, float v) { p[i] = __float2bfloat16_rn(v); }
template <typename S, typename D> __device__ __forceinline__ void cast_f32_family(const S* x, D* y, long long n) {
    MPC_GRID_STRIDE(i, n) { put_f32(y, i, as_f32(x[i])); }
}

#define CAST(S, stag, D, dtag)                                                     \
    MPC_KERNEL casts_##stag##_to_##dtag(const S* __restrict__ x, D* __restrict__ y, long long n) { \
        cast_body<S, D>(x, y, n);                                                  \
    }
#define CAST_F(S, stag, D, dtag)                                                   \
    MPC_KERNEL casts_##stag##_to_##dtag(const S* __restrict__ x, D* __restrict__ y, long long n) { \
        cast_f32_family<S, D>(x, y, n);                                            \
    }

// Sources in the order f32 f16 bf16 f64 i64 i32 i8 u8 bool, each to every other dtype.
CAST_F(float, f32, __half, f16)
CAST_F(float, f32, __nv_bfloat16, bf16)
CAST(float, f32, double, f64)
CAST(float, f32, long long, i64)
CAST(float, f32, int, i32)
CAST(float, f32, signed char, i8)
CAST(float, f32, unsigned char, u8)
CAST(float, f32, Bool, bool)

CAST_F(__half, f16, float, f32)
CAST_F(__half, f16, __nv_bfloat16, bf16)
CAST(__half, f16, double, f64)
CAST(__half, f16, long long, i64)
CAST(__half, f16, int, i32)
CAST(__half, f16, signed char, i8)
CAST(__half, f16, unsigned char, u8)
CAST(__half, f16, Bool, bool)

CAST_F(__nv_bfloat16, bf16, float, f32)
CAST_F(__nv_bfloat16, bf16, __half, f16)
CAST(__nv_bfloat16, bf16, double, f64)
CAST(__nv_bfloat16, bf16, long long, i64)
CAST(__nv_bfloat16, bf16, int, i32)
CAST(__nv_bfloat16, bf16, signed char, i8)
CAST(__nv_bfloat16, bf16, unsigned char, u8)
CAST(__nv_bfloat16, bf16, Bool, bool)

#define CAST_TO_FLOATS(S, stag)             \
    CAST(S, stag, float, f32)               \
    CAST(S, stag, __half, f16)              \
    CAST(S, stag, __nv_bfloat16, bf16)

CAST_TO_FLOATS(double, f64)
CAST(double, f64, long long, i64)
CAST(double, f64, int, i32)
CAST(double, f64, signed char, i8)
CAST(double, f64, unsigned char, u8)
CAST(double, f64, Bool, bool)

CAST_TO_FLOATS(long long, i64)
CAST(long long, i64, double, f64)
CAST(long long, i64, int, i32)
CAST(long long, i64, signed char, i8)
CAST(long long, i64, unsigned char, u8)
CAST(long long, i64, Bool, bool)

CAST_TO_FLOATS(int, i32)
CAST(int, i32, double, f64)
CAST(int, i32, long long, i64)
CAST(int, i32, signed char, i8)
CAST(int, i32, unsigned char, u8)
CAST(int, i32, Bool, bool)

CAST_TO_FLOATS(signed char, i8)
CAST(signed char, i8, double, f64)
CAST(signed char, i8, long long, i64)
CAST(signed char, i8, int, i32)
CAST(signed char, i8, unsigned char, u8)
CAST(signed char, i8, Bool, bool)

CAST_TO_FLOATS(unsigned char, u8)
CAST(unsigned char, u8, double, f64)
CAST(unsigned char, u8, long long, i64)
CAST(unsigned char, u8, int, i32)
CAST(unsigned char, u8, signed char, i8)
CAST(unsigned char, u8, Bool, bool)

CAST_TO_FLOATS(Bool, bool)
CAST(Bool, bool, double, f64)
CAST(Bool, bool, long long, i64)
CAST(Bool, bool, int, i32)
CAST(Bool, bool, signed char, i8)
CAST(Bool, bool, unsigned char, u8)

// i16 u16 u32 u64: from each of them to every other dtype, and from the dtypes above to them.
CAST(short, i16, float, f32)
CAST(short, i16, __half, f16)
CAST(short, i16, __nv_bfloat16, bf16)
CAST(short, i16, double, f64)
CAST(short, i16, long long, i64)
CAST(short, i16, int, i32)
CAST(short, i16, signed char, i8)
CAST(short, i16, unsigned char, u8)
CAST(short, i16, Bool, bool)
CAST(short, i16, unsigned short, u16)
CAST(short, i16, unsigned int, u32)
CAST(short, i16, unsigned long long, u64)
CAST(float, f32, short, i16)
CAST(__half, f16, short, i16)
CAST(__nv_bfloat16, bf16, short, i16)
CAST(double, f64, short, i16)
CAST(long long, i64, short, i16)
CAST(int, i32, short, i16)
CAST(signed char, i8, short, i16)
CAST(unsigned char, u8, short, i16)
CAST(Bool, bool, short, i16)
CAST(unsigned short, u16, float, f32)
CAST(unsigned short, u16, __half, f16)
CAST(unsigned short, u16, __nv_bfloat16, bf16)
CAST(unsigned short, u16, double, f64)
CAST(unsigned short, u16, long long, i64)
CAST(unsigned short, u16, int, i32)
CAST(unsigned short, u16, signed char, i8)
CAST(unsigned short, u16, unsigned char, u8)
CAST(unsigned short, u16, Bool, bool)
CAST(unsigned short, u16, short, i16)
CAST(unsigned short, u16, unsigned int, u32)
CAST(unsigned short, u16, unsigned long long, u64)
CAST(float, f32, unsigned short, u16)
CAST(__half, f16, unsigned short, u16)
CAST(__nv_bfloat16, bf16, unsigned short, u16)
CAST(double, f64, unsigned short, u16)
CAST(long long, i64, unsigned short, u16)
CAST(int, i32, unsigned short, u16)
CAST(signed char, i8, unsigned short, u16)
CAST(unsigned char, u8, unsigned short, u16)
CAST(Bool, bool, unsigned short, u16)
CAST(unsigned int, u32, float, f32)
CAST(unsigned int, u32, __half, f16)
CAST(unsigned int, u32, __nv_bfloat16, bf16)
CAST(unsigned int, u32, double, f64)
CAST(unsigned int, u32, long long, i64)
CAST(unsigned int, u32, int, i32)
CAST(unsigned int, u32, signed char, i8)
CAST(unsigned int, u32, unsigned char, u8)
CAST(unsigned int, u32, Bool, bool)
CAST(unsigned int, u32, short, i16)
CAST(unsigned int, u32, unsigned short, u16)
CAST(unsigned int, u32, unsigned long long, u64)
CAST(float, f32, unsigned int, u32)
CAST(__half, f16, unsigned int, u32)
CAST(__nv_bfloat16, bf16, unsigned int, u32)
CAST(double, f64, unsigned int, u32)
CAST(long long, i64, unsigned int, u32)
CAST(int, i32, unsigned int, u32)
CAST(signed char, i8, unsigned int, u32)
CAST(unsigned char, u8, unsigned int, u32)
CAST(Bool, bool, unsigned int, u32)
CAST(unsigned long long, u64, float, f32)
CAST(unsigned long long, u64, __half, f16)
CAST(unsigned long long, u64, __nv_bfloat16, bf16)
CAST(unsigned long long, u64, double, f64)
CAST(unsigned long long, u64, long long, i64)
CAST(unsigned long long, u64, int, i32)
CAST(unsigned long long, u64, signed char, i8)
CAST(unsigned long long, u64, unsigned char, u8)
CAST(unsigned long long, u64, Bool, bool)
CAST(unsigned long long, u64, short, i16)
CAST(unsigned long long, u64, unsigned short, u16)
CAST(unsigned long long, u64, unsigned int, u32)
CAST(float, f32, unsigned long long, u64)
CAST(__half, f16, unsigned long long, u64)
CAST(__nv_bfloat16, bf16, unsigned long long, u64)
CAST(double, f64, unsigned long long, u64)
CAST(long long, i64, unsigned long long, u64)
CAST(int, i32, unsigned long long, u64)
CAST(signed char, i8, unsigned long long, u64)
CAST(unsigned char, u8, unsigned long long, u64)
CAST(Bool, bool, unsigned long long, u64)
