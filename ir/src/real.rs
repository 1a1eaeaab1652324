//! The float arithmetic of the reference formulas, written once for f32 and f64 ([`Real`]), and
//! the functions several formulas share. Each unary op's formula is [`Unary::eval`](crate::ops::Unary::eval).

use crate::ops::Trig;

/// The arithmetic the float kernels need, for f32 and f64.
pub trait Real:
    Copy
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::Neg<Output = Self>
{
    fn of(x: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn erf(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn abs(self) -> Self;
    fn is_nan(self) -> bool;
    fn ln_1p(self) -> Self;
    /// Remainder with the dividend's sign (C fmod).
    fn fmod(self, b: Self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    /// Round half to even (ONNX Round).
    fn round_even(self) -> Self;
    /// Tan, Sinh, Cosh and the inverse functions, with the standard library's accuracy.
    fn trig(self, t: Trig) -> Self;
}

macro_rules! real {
    ($t:ty, $erf:path) => {
        impl Real for $t {
            fn of(x: f64) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            fn erf(self) -> Self {
                $erf(self)
            }
            fn powf(self, e: Self) -> Self {
                <$t>::powf(self, e)
            }
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            fn fmod(self, b: Self) -> Self {
                self % b
            }
            fn sin(self) -> Self {
                <$t>::sin(self)
            }
            fn cos(self) -> Self {
                <$t>::cos(self)
            }
            fn floor(self) -> Self {
                <$t>::floor(self)
            }
            fn ceil(self) -> Self {
                <$t>::ceil(self)
            }
            fn round_even(self) -> Self {
                <$t>::round_ties_even(self)
            }
            fn trig(self, t: Trig) -> Self {
                match t {
                    Trig::Tan => self.tan(),
                    Trig::Sinh => self.sinh(),
                    Trig::Cosh => self.cosh(),
                    Trig::Asin => self.asin(),
                    Trig::Acos => self.acos(),
                    Trig::Atan => self.atan(),
                    // Likewise 2|x| overflows in the standard library's asinh near the largest f32.
                    Trig::Asinh if self.abs() >= 268435456.0 => {
                        (self.abs().ln() + std::f64::consts::LN_2 as $t).copysign(self)
                    }
                    Trig::Asinh => self.asinh(),
                    // The standard library's ln(x + √(x² − 1)) overflows past half the largest value;
                    // from 2^28 on, ln(2x) is acosh to the last bit in both widths.
                    Trig::Acosh if self >= 268435456.0 => self.ln() + std::f64::consts::LN_2 as $t,
                    Trig::Acosh => self.acosh(),
                    Trig::Atanh => self.atanh(),
                }
            }
        }
    };
}
real!(f32, libm::erff);
real!(f64, libm::erf);

/// The larger, NaN if either is (ONNX Max).
pub fn max<R: Real>(a: R, b: R) -> R {
    if a.is_nan() || b.is_nan() {
        R::of(f64::NAN)
    } else if a > b {
        a
    } else {
        b
    }
}

/// The smaller, NaN if either is (ONNX Min).
pub fn min<R: Real>(a: R, b: R) -> R {
    if a.is_nan() || b.is_nan() {
        R::of(f64::NAN)
    } else if a < b {
        a
    } else {
        b
    }
}

/// Gelu, the erf form.
pub fn gelu_erf<R: Real>(x: R) -> R {
    R::of(0.5) * x * (R::of(1.0) + (x / R::of(std::f64::consts::SQRT_2)).erf())
}

/// Gelu, the tanh approximation.
pub fn gelu_tanh<R: Real>(x: R) -> R {
    let c = R::of((2.0 / std::f64::consts::PI).sqrt());
    R::of(0.5) * x * (R::of(1.0) + (c * (x + R::of(0.044715) * x * x * x)).tanh())
}
