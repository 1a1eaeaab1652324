//! Shapes: static dims, named symbolic dims (`batch`) and unknown dims.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// One dimension of a shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Dim {
    /// A known size.
    Fixed(u64),
    /// A named size that is the same wherever the name appears (`batch`, `seq`).
    Sym(Arc<str>),
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

    pub fn sym(name: &str) -> Dim {
        Dim::Sym(Arc::from(name))
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
            Dim::Sym(s) => f.write_str(s),
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

    /// Replaces symbolic dims by the sizes bound in `bind` (unbound ones stay symbolic).
    pub fn bind(&self, bind: &dyn Fn(&str) -> Option<u64>) -> Shape {
        Shape(
            self.0
                .iter()
                .map(|d| match d {
                    Dim::Sym(s) => bind(s).map(Dim::Fixed).unwrap_or_else(|| d.clone()),
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
