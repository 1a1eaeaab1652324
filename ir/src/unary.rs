//! The element-wise unary float ops, each described once: the family the CPU reference kernels,
//! the CUDA plans (`elementwise_<name>_<dtype>`, the functor `U_<name>` in kernels/common.cuh)
//! and the kernel-name check read, instead of lists of their own.

use crate::ops::{GeluApprox, Trig};
use crate::real::{gelu_erf, gelu_tanh, max, min, Real};
use crate::Op;

/// An element-wise unary float op ([`Op::unary`] gives it with its parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unary {
    Relu,
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Neg,
    Abs,
    Erf,
    Reciprocal,
    Floor,
    Ceil,
    Round,
    Sign,
    Sin,
    Cos,
    Softplus,
    /// `x · tanh(softplus(x))`.
    Mish,
    Softsign,
    HardSwish,
    /// Gelu with the erf form.
    Gelu,
    /// Gelu with `approximate = "tanh"`.
    GeluTanh,
    /// Parameter: alpha.
    LeakyRelu,
    /// Parameter: alpha.
    Elu,
    /// Parameter: alpha.
    Celu,
    /// Parameters: alpha, gamma.
    Selu,
    /// Parameters: alpha, beta.
    HardSigmoid,
    Trig(Trig),
}

impl Unary {
    /// Every member but the [`Trig`] ones ([`Trig::ALL`]).
    pub const PLAIN: [Unary; 27] = [
        Unary::Relu,
        Unary::Sigmoid,
        Unary::Tanh,
        Unary::Exp,
        Unary::Log,
        Unary::Sqrt,
        Unary::Neg,
        Unary::Abs,
        Unary::Erf,
        Unary::Reciprocal,
        Unary::Floor,
        Unary::Ceil,
        Unary::Round,
        Unary::Sign,
        Unary::Sin,
        Unary::Cos,
        Unary::Softplus,
        Unary::Mish,
        Unary::Softsign,
        Unary::HardSwish,
        Unary::Gelu,
        Unary::GeluTanh,
        Unary::LeakyRelu,
        Unary::Elu,
        Unary::Celu,
        Unary::Selu,
        Unary::HardSigmoid,
    ];

    /// Every member.
    pub fn all() -> impl Iterator<Item = Unary> {
        Unary::PLAIN.into_iter().chain(Trig::ALL.into_iter().map(Unary::Trig))
    }

    /// The CUDA kernel's name, `elementwise_<name>_<dtype>` (the functor `U_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Unary::Relu => "relu",
            Unary::Sigmoid => "sigmoid",
            Unary::Tanh => "tanh",
            Unary::Exp => "exp",
            Unary::Log => "log",
            Unary::Sqrt => "sqrt",
            Unary::Neg => "neg",
            Unary::Abs => "abs",
            Unary::Erf => "erf",
            Unary::Reciprocal => "reciprocal",
            Unary::Floor => "floor",
            Unary::Ceil => "ceil",
            Unary::Round => "round",
            Unary::Sign => "sign",
            Unary::Sin => "sin",
            Unary::Cos => "cos",
            Unary::Softplus => "softplus",
            Unary::Mish => "mish",
            Unary::Softsign => "softsign",
            Unary::HardSwish => "hard_swish",
            Unary::Gelu => "gelu",
            Unary::GeluTanh => "gelu_tanh",
            Unary::LeakyRelu => "leaky_relu",
            Unary::Elu => "elu",
            Unary::Celu => "celu",
            Unary::Selu => "selu",
            Unary::HardSigmoid => "hard_sigmoid",
            Unary::Trig(t) => t.name(),
        }
    }

    /// What the op makes of a low-precision input ([`Rounding`]).
    pub fn rounding(self) -> Rounding {
        use Unary::*;
        match self {
            Relu | Abs | Neg => Rounding::Exact,
            Exp | Log | Reciprocal | Sin | Cos | Trig(_) => Rounding::Wide,
            Sigmoid | Tanh | Sqrt | Erf | Floor | Ceil | Round | Sign | Softplus | Mish | Softsign | HardSwish
            | Gelu | GeluTanh | LeakyRelu | Elu | Celu | Selu | HardSigmoid => Rounding::Follows,
        }
    }

    /// Whether a fused element-wise chain may hold it ([`Op::fusable`]): the chains' generator
    /// has its functor.
    pub fn chains(self) -> bool {
        use Unary::*;
        match self {
            Relu | Sigmoid | Tanh | Neg | Exp | Sqrt | Reciprocal | Erf | Gelu | GeluTanh | LeakyRelu | Mish => true,
            Log | Abs | Floor | Ceil | Round | Sign | Sin | Cos | Softplus | Softsign | HardSwish | Elu | Celu
            | Selu | HardSigmoid | Trig(_) => false,
        }
    }

    /// Whether the op has an integer kernel: Neg, Abs, Relu and Sign compute on integers;
    /// Floor, Ceil and Round leave them as they are.
    pub fn on_integers(self) -> Option<IntegerUnary> {
        use Unary::*;
        Some(match self {
            Neg | Abs | Relu | Sign => IntegerUnary::Computes,
            Floor | Ceil | Round => IntegerUnary::Keeps,
            Sigmoid | Tanh | Exp | Log | Sqrt | Erf | Reciprocal | Sin | Cos | Softplus | Mish | Softsign
            | HardSwish | Gelu | GeluTanh | LeakyRelu | Elu | Celu | Selu | HardSigmoid | Trig(_) => return None,
        })
    }
}

impl Unary {
    /// The reference formula, written once for f32 and f64: the op with its parameters `p`
    /// ([`Op::unary`](crate::Op::unary)) at `x`. The CPU device computes by it.
    pub fn eval<R: Real>(self, p: [f32; 2], x: R) -> R {
        let zero = R::of(0.0);
        let one = R::of(1.0);
        let (alpha, beta) = (R::of(p[0] as f64), R::of(p[1] as f64));
        match self {
            Unary::Sqrt => x.sqrt(),
            Unary::Exp => x.exp(),
            Unary::Log => x.ln(),
            Unary::Neg => -x,
            Unary::Abs => x.abs(),
            Unary::Reciprocal => one / x,
            Unary::Erf => x.erf(),
            Unary::Tanh => x.tanh(),
            Unary::Sigmoid => {
                // Stable for large |x|.
                if x >= zero {
                    one / (one + (-x).exp())
                } else {
                    let e = x.exp();
                    e / (one + e)
                }
            }
            Unary::Relu => max(x, zero),
            Unary::LeakyRelu => {
                if x < zero {
                    alpha * x
                } else {
                    x
                }
            }
            Unary::Elu => {
                if x < zero {
                    alpha * (x.exp() - one)
                } else {
                    x
                }
            }
            // max(0, x) + min(0, α(e^(x/α) − 1)): the two pieces meet at 0.
            Unary::Celu => {
                if x > zero {
                    x
                } else {
                    alpha * ((x / alpha).exp() - one)
                }
            }
            Unary::GeluTanh => gelu_tanh(x),
            Unary::Gelu => gelu_erf(x),
            Unary::HardSigmoid => max(zero, min(one, alpha * x + beta)),
            Unary::HardSwish => x * max(zero, min(one, x / R::of(6.0) + R::of(0.5))),
            Unary::Softplus => {
                // log(1 + e^x) without overflow.
                if x > zero {
                    x + (-x).exp().ln_1p()
                } else {
                    x.exp().ln_1p()
                }
            }
            Unary::Mish => x * Unary::Softplus.eval(p, x).tanh(),
            Unary::Floor => x.floor(),
            Unary::Ceil => x.ceil(),
            Unary::Round => x.round_even(),
            Unary::Sign => {
                if x > zero {
                    one
                } else if x < zero {
                    -one
                } else {
                    x
                }
            }
            Unary::Sin => x.sin(),
            Unary::Cos => x.cos(),
            Unary::Softsign => x / (one + x.abs()),
            // beta is gamma.
            Unary::Selu => {
                if x > zero {
                    beta * x
                } else {
                    beta * alpha * (x.exp() - one)
                }
            }
            Unary::Trig(t) => x.trig(t),
        }
    }
}

/// What the op makes of a low-precision input: the default colouring of the precision pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rounding {
    /// Its result is one of its input's values or their negation (Relu, Abs, Neg): nothing
    /// rounds, and it takes whatever precision its input has.
    Exact,
    /// As accurate in the low dtype as its input is: it follows its input's precision.
    Follows,
    /// Needs FP32, for its range or its accuracy (Exp, Log, Reciprocal, Sin, Cos and the
    /// [`Trig`] ops).
    Wide,
}

/// What a unary op does to an integer tensor ([`Unary::on_integers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IntegerUnary {
    /// It has an integer formula (the CPU's and an integer CUDA kernel).
    Computes,
    /// Every integer is its own result.
    Keeps,
}

/// The ops of [`Unary`] as a pattern, for the exhaustive matches that must name them.
#[macro_export]
macro_rules! unary_ops {
    () => {
        $crate::Op::Relu
            | $crate::Op::Sigmoid
            | $crate::Op::Tanh
            | $crate::Op::Exp
            | $crate::Op::Log
            | $crate::Op::Sqrt
            | $crate::Op::Neg
            | $crate::Op::Abs
            | $crate::Op::Erf
            | $crate::Op::Reciprocal
            | $crate::Op::Floor
            | $crate::Op::Ceil
            | $crate::Op::Round
            | $crate::Op::Sign
            | $crate::Op::Sin
            | $crate::Op::Cos
            | $crate::Op::Softplus
            | $crate::Op::Mish
            | $crate::Op::Softsign
            | $crate::Op::HardSwish
            | $crate::Op::Gelu(_)
            | $crate::Op::LeakyRelu(_)
            | $crate::Op::Elu(_)
            | $crate::Op::Celu(_)
            | $crate::Op::Selu(_)
            | $crate::Op::HardSigmoid(_)
            | $crate::trig_ops!()
    };
}

impl Op {
    /// The op as a [`Unary`], with its parameters (alpha, then beta or gamma; 0 where it has
    /// none), if it is one.
    pub fn unary(&self) -> Option<(Unary, [f32; 2])> {
        let plain = |u| Some((u, [0.0, 0.0]));
        match self {
            Op::Relu => plain(Unary::Relu),
            Op::Sigmoid => plain(Unary::Sigmoid),
            Op::Tanh => plain(Unary::Tanh),
            Op::Exp => plain(Unary::Exp),
            Op::Log => plain(Unary::Log),
            Op::Sqrt => plain(Unary::Sqrt),
            Op::Neg => plain(Unary::Neg),
            Op::Abs => plain(Unary::Abs),
            Op::Erf => plain(Unary::Erf),
            Op::Reciprocal => plain(Unary::Reciprocal),
            Op::Floor => plain(Unary::Floor),
            Op::Ceil => plain(Unary::Ceil),
            Op::Round => plain(Unary::Round),
            Op::Sign => plain(Unary::Sign),
            Op::Sin => plain(Unary::Sin),
            Op::Cos => plain(Unary::Cos),
            Op::Softplus => plain(Unary::Softplus),
            Op::Mish => plain(Unary::Mish),
            Op::Softsign => plain(Unary::Softsign),
            Op::HardSwish => plain(Unary::HardSwish),
            Op::Gelu(a) if a.approximate == GeluApprox::Tanh => plain(Unary::GeluTanh),
            Op::Gelu(_) => plain(Unary::Gelu),
            Op::LeakyRelu(a) => Some((Unary::LeakyRelu, [a.alpha, 0.0])),
            Op::Elu(a) => Some((Unary::Elu, [a.alpha, 0.0])),
            Op::Celu(a) => Some((Unary::Celu, [a.alpha, 0.0])),
            Op::Selu(a) => Some((Unary::Selu, [a.alpha, a.gamma])),
            Op::HardSigmoid(a) => Some((Unary::HardSigmoid, [a.alpha, a.beta])),
            op => op.trig().map(|t| (Unary::Trig(t), [0.0, 0.0])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `unary_ops!()` is exactly the ops `Op::unary` knows: each op of a unary member (made
    /// from its name, Gelu's tanh form from its attribute) matches it, and the ops beside them
    /// do not.
    #[test]
    fn the_pattern_is_the_family() {
        let of = |name: &str| Op::default_of(name).unwrap_or_else(|| panic!("no op {name}"));
        for u in Unary::all() {
            let op = match u {
                Unary::GeluTanh => Op::Gelu(crate::ops::GeluAttrs { approximate: GeluApprox::Tanh }),
                Unary::Trig(t) => of(&format!("{t:?}")),
                u => of(&format!("{u:?}")),
            };
            assert_eq!(op.unary().map(|(v, _)| v), Some(u), "{u:?}");
            assert!(matches!(op, unary_ops!()), "{u:?} is not in unary_ops!()");
        }
        for name in ["Identity", "Add", "Not", "IsNaN", "Clip", "PRelu", "Cast", "Dropout", "Softmax"] {
            let op = of(name);
            assert!(op.unary().is_none() && !matches!(op, unary_ops!()), "{name}");
        }
    }

    /// `PLAIN` and the trig ops are every member once, and each has a name of its own.
    #[test]
    fn every_member_is_listed_once_with_its_own_name() {
        let all: Vec<Unary> = Unary::all().collect();
        let names: std::collections::HashSet<&str> = all.iter().map(|u| u.name()).collect();
        assert_eq!(names.len(), all.len());
        assert_eq!(all.len(), 27 + Trig::ALL.len());
    }
}
