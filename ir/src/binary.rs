//! The element-wise binary ops (broadcasting), each family described once: the arithmetic ops
//! and the comparisons and logic. The CPU reference kernels, the CUDA plans (the functors
//! `V_<name>` of kernels/common.cuh, the comparison kernels of kernels/elementwise.cu) and type
//! inference read these, not lists of their own.

use crate::Op;

/// An element-wise arithmetic op of two operands ([`Op::arith`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arith {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    PRelu,
    /// `fmod` true: the remainder with the dividend's sign (C's fmod); false: Python's, with the
    /// divisor's.
    Mod {
        fmod: bool,
    },
}

impl Arith {
    /// The CUDA functor's name (`V_<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Arith::Add => "add",
            Arith::Sub => "sub",
            Arith::Mul => "mul",
            Arith::Div => "div",
            Arith::Pow => "pow",
            Arith::PRelu => "prelu",
            Arith::Mod { fmod: true } => "mod",
            Arith::Mod { fmod: false } => "mod_py",
        }
    }
}

/// A comparison or logical op: two operands of one dtype, a bool result ([`Op::compare`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Compare {
    Equal,
    Less,
    Greater,
    GreaterOrEqual,
    LessOrEqual,
    And,
    Or,
    Xor,
}

impl Compare {
    /// The CUDA kernel's name (`elementwise_<name>_<dtype>`; the logic ops' on bool, `_u8`).
    pub fn name(self) -> &'static str {
        match self {
            Compare::Equal => "equal",
            Compare::Less => "less",
            Compare::Greater => "greater",
            Compare::GreaterOrEqual => "greater_equal",
            Compare::LessOrEqual => "less_equal",
            Compare::And => "and",
            Compare::Or => "or",
            Compare::Xor => "xor",
        }
    }
}

/// The ops of [`Arith`] as a pattern, for the exhaustive matches that must name them.
#[macro_export]
macro_rules! arith_ops {
    () => {
        $crate::Op::Add
            | $crate::Op::Sub
            | $crate::Op::Mul
            | $crate::Op::Div
            | $crate::Op::Pow
            | $crate::Op::PRelu
            | $crate::Op::Mod(_)
    };
}

/// The ops of [`Compare`] as a pattern, for the exhaustive matches that must name them.
#[macro_export]
macro_rules! compare_ops {
    () => {
        $crate::Op::Equal
            | $crate::Op::Less
            | $crate::Op::Greater
            | $crate::Op::GreaterOrEqual
            | $crate::Op::LessOrEqual
            | $crate::Op::And
            | $crate::Op::Or
            | $crate::Op::Xor
    };
}

impl Op {
    /// The op as an [`Arith`], if it is one.
    pub fn arith(&self) -> Option<Arith> {
        Some(match self {
            Op::Add => Arith::Add,
            Op::Sub => Arith::Sub,
            Op::Mul => Arith::Mul,
            Op::Div => Arith::Div,
            Op::Pow => Arith::Pow,
            Op::PRelu => Arith::PRelu,
            Op::Mod(a) => Arith::Mod { fmod: a.fmod },
            _ => return None,
        })
    }

    /// The op as a [`Compare`], if it is one.
    pub fn compare(&self) -> Option<Compare> {
        Some(match self {
            Op::Equal => Compare::Equal,
            Op::Less => Compare::Less,
            Op::Greater => Compare::Greater,
            Op::GreaterOrEqual => Compare::GreaterOrEqual,
            Op::LessOrEqual => Compare::LessOrEqual,
            Op::And => Compare::And,
            Op::Or => Compare::Or,
            Op::Xor => Compare::Xor,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The patterns are the families: each op the pattern names is a member, and the ops
    /// beside them are not.
    #[test]
    fn the_patterns_are_the_families() {
        let of = |name: &str| Op::default_of(name).unwrap_or_else(|| panic!("no op {name}"));
        for name in ["Add", "Sub", "Mul", "Div", "Pow", "PRelu", "Mod"] {
            let op = of(name);
            assert!(op.arith().is_some() && matches!(op, arith_ops!()) && op.compare().is_none(), "{name}");
        }
        for name in ["Equal", "Less", "Greater", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor"] {
            let op = of(name);
            assert!(op.compare().is_some() && matches!(op, compare_ops!()) && op.arith().is_none(), "{name}");
        }
        for name in ["Sum", "Max", "Min", "Mean", "Not", "Where", "BitwiseAnd", "Relu"] {
            let op = of(name);
            let neither = op.arith().is_none() && op.compare().is_none();
            assert!(neither && !matches!(op, arith_ops!() | compare_ops!()), "{name}");
        }
    }
}
