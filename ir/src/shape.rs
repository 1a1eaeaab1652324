//! Shapes: static dims, symbolic dims (`batch`, `8*batch`) and unknown dims.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::SymExpr;

/// One dimension of a shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// A known size.
    Fixed(u64),
    /// A size given by named sizes that are the same wherever the name appears: `batch`, or an
    /// expression in them such as `8*batch`. Never a constant (that is `Fixed`).
    Sym(SymExpr),
    /// A size nothing is known about.
    Unknown,
}

impl Dim {
    pub fn fixed(&self) -> Option<u64> {
        match self {
            Dim::Fixed(n) => Some(*n),
            _ => None,
        }
    }

    /// The size named `name`.
    pub fn sym(name: &str) -> Dim {
        Dim::Sym(SymExpr::symbol(name))
    }

    /// The dim an expression gives: `Fixed` when it is a constant (`Unknown` when a negative
    /// one), else `Sym`.
    pub fn from_expr(e: SymExpr) -> Dim {
        match e.as_const() {
            Some(c) => u64::try_from(c).map_or(Dim::Unknown, Dim::Fixed),
            None => Dim::Sym(e),
        }
    }

    /// The dim as an expression (`None` when unknown, or too large for one).
    pub fn expr(&self) -> Option<SymExpr> {
        match self {
            Dim::Fixed(n) => Some(SymExpr::constant(i64::try_from(*n).ok()?)),
            Dim::Sym(e) => Some(e.clone()),
            Dim::Unknown => None,
        }
    }

    /// The name, when the dim is one plain symbol (`batch`, not `8*batch`).
    pub fn symbol(&self) -> Option<&str> {
        match self {
            Dim::Sym(e) => e.as_symbol(),
            _ => None,
        }
    }
}

impl From<u64> for Dim {
    fn from(n: u64) -> Dim {
        Dim::Fixed(n)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Sym(e) => write!(f, "{e}"),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A shape of known rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn fixed(dims: &[u64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    /// All dims as numbers, if every dim is fixed.
    pub fn as_fixed(&self) -> Option<Vec<u64>> {
        self.0.iter().map(Dim::fixed).collect()
    }

    /// Element count, if every dim is fixed.
    pub fn numel(&self) -> Option<u64> {
        self.0.iter().try_fold(1u64, |acc, d| acc.checked_mul(d.fixed()?))
    }

    /// Replaces the named sizes that `bind` knows by their values (symbolic dims whose every
    /// name is bound become fixed; one whose value overflows becomes unknown).
    pub fn bind(&self, bind: &dyn Fn(&str) -> Option<u64>) -> Shape {
        Shape(
            self.0
                .iter()
                .map(|d| match d {
                    Dim::Sym(e) => e.bind(bind).map_or(Dim::Unknown, Dim::from_expr),
                    _ => d.clone(),
                })
                .collect(),
        )
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// Normalises a possibly negative `axis` against `rank`; `None` when out of range.
pub fn normalize_axis(axis: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}
