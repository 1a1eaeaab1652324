//! Symbolic sizes: integer polynomials in named sizes, such as `batch`, `8*batch`, `seq - 1` or
//! `batch*seq`.
//!
//! Exporters declare such dims (`8*batch` is the batch times the heads after a head split) and
//! compute them in shape arithmetic (`Shape → Gather → Mul → Concat → Reshape`). Keeping them as
//! expressions lets inference carry them through that arithmetic, divide them exactly (a Reshape
//! with `-1`), compare them and evaluate them once the named sizes are bound.
//!
//! An expression is kept normal: terms sorted by their (sorted) symbols, no zero coefficients,
//! like terms merged. Two expressions are equal exactly when they are the same polynomial.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One term: `coef` times the product of `syms` (sorted, repeated for powers; empty for the
/// constant term).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Term {
    syms: Vec<Arc<str>>,
    coef: i64,
}

/// A symbolic size (see the module docs). Cheap to clone.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SymExpr(Arc<[Term]>);

impl SymExpr {
    /// The size named `name`.
    pub fn symbol(name: &str) -> SymExpr {
        SymExpr(Arc::from([Term { syms: vec![Arc::from(name)], coef: 1 }]))
    }

    pub fn constant(c: i64) -> SymExpr {
        SymExpr::normal(vec![Term { syms: Vec::new(), coef: c }])
    }

    fn normal(mut terms: Vec<Term>) -> SymExpr {
        for t in &mut terms {
            t.syms.sort();
        }
        terms.sort_by(|a, b| a.syms.cmp(&b.syms));
        let mut out: Vec<Term> = Vec::with_capacity(terms.len());
        for t in terms {
            match out.last_mut() {
                // Callers that can overflow go through `checked` first.
                Some(last) if last.syms == t.syms => last.coef = last.coef.wrapping_add(t.coef),
                _ => out.push(t),
            }
        }
        out.retain(|t| t.coef != 0);
        // The constant term (no symbols) sorts first; print it last.
        let constant_first = out.first().is_some_and(|t| t.syms.is_empty());
        out.rotate_left(usize::from(constant_first));
        SymExpr(Arc::from(out))
    }

    /// The value, when the expression has no symbols.
    pub fn as_const(&self) -> Option<i64> {
        match &*self.0 {
            [] => Some(0),
            [t] if t.syms.is_empty() => Some(t.coef),
            _ => None,
        }
    }

    /// The name, when the expression is one plain symbol.
    pub fn as_symbol(&self) -> Option<&str> {
        match &*self.0 {
            [Term { syms, coef: 1 }] if syms.len() == 1 => Some(&syms[0]),
            _ => None,
        }
    }

    /// Whether the value is ≥ 0 for every value of the (non-negative) sizes: no coefficient is
    /// negative.
    pub fn is_nonnegative(&self) -> bool {
        self.0.iter().all(|t| t.coef >= 0)
    }

    /// The distinct names the expression reads.
    pub fn symbols(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self.0.iter().flat_map(|t| t.syms.iter().map(|s| &**s)).collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// `self + other`; `None` on an overflow (as for every operation below).
    pub fn add(&self, other: &SymExpr) -> Option<SymExpr> {
        SymExpr::checked(self.0.iter().chain(other.0.iter()).cloned().collect())
    }

    pub fn neg(&self) -> Option<SymExpr> {
        let terms = self.0.iter().map(|t| Some(Term { syms: t.syms.clone(), coef: t.coef.checked_neg()? }));
        SymExpr::checked(terms.collect::<Option<_>>()?)
    }

    pub fn sub(&self, other: &SymExpr) -> Option<SymExpr> {
        self.add(&other.neg()?)
    }

    pub fn mul(&self, other: &SymExpr) -> Option<SymExpr> {
        let mut terms = Vec::with_capacity(self.0.len() * other.0.len());
        for a in self.0.iter() {
            for b in other.0.iter() {
                let syms = a.syms.iter().chain(&b.syms).cloned().collect();
                terms.push(Term { syms, coef: a.coef.checked_mul(b.coef)? });
            }
        }
        SymExpr::checked(terms)
    }

    /// The normal form, `None` when merging like terms overflows.
    fn checked(terms: Vec<Term>) -> Option<SymExpr> {
        let mut sorted = terms.clone();
        sorted.sort_by(|a, b| a.syms.cmp(&b.syms));
        for w in sorted.windows(2) {
            if w[0].syms == w[1].syms {
                w[0].coef.checked_add(w[1].coef)?;
            }
        }
        Some(SymExpr::normal(terms))
    }

    /// `self / d`, when it is exact for every value of the symbols that this form shows: `d` a
    /// non-zero constant dividing every coefficient, or one term dividing every term, or `d`
    /// equal to `self`. `None` otherwise.
    pub fn div_exact(&self, d: &SymExpr) -> Option<SymExpr> {
        if self == d && d.as_const() != Some(0) {
            return Some(SymExpr::constant(1));
        }
        let [dt] = &*d.0 else { return None };
        if dt.coef == 0 {
            return None;
        }
        let mut terms = Vec::with_capacity(self.0.len());
        for t in self.0.iter() {
            if t.coef % dt.coef != 0 {
                return None;
            }
            let mut syms = t.syms.clone();
            for s in &dt.syms {
                let i = syms.iter().position(|x| x == s)?;
                syms.remove(i);
            }
            terms.push(Term { syms, coef: t.coef / dt.coef });
        }
        Some(SymExpr::normal(terms))
    }

    /// Replaces the symbols `bind` knows by their values; `None` on an overflow.
    pub fn bind(&self, bind: &dyn Fn(&str) -> Option<u64>) -> Option<SymExpr> {
        let mut terms = Vec::with_capacity(self.0.len());
        for t in self.0.iter() {
            let (mut coef, mut syms) = (t.coef, Vec::new());
            for s in &t.syms {
                match bind(s) {
                    Some(v) => coef = coef.checked_mul(i64::try_from(v).ok()?)?,
                    None => syms.push(s.clone()),
                }
            }
            terms.push(Term { syms, coef });
        }
        SymExpr::checked(terms)
    }

    /// The value when `bind` knows every symbol; `None` on an unbound symbol or an overflow.
    pub fn eval(&self, bind: &dyn Fn(&str) -> Option<u64>) -> Option<i64> {
        self.0.iter().try_fold(0i64, |acc, t| {
            let v = t.syms.iter().try_fold(t.coef, |p, s| p.checked_mul(i64::try_from(bind(s)?).ok()?))?;
            acc.checked_add(v)
        })
    }

    /// Parses a sum of products of integers and names (`8*batch`, `s0 + 1`, `2*s0*s1 - 3`). Text
    /// that is not of that form (other operators, brackets) is one opaque name, so that any
    /// `dim_param` an exporter writes is still one size, equal wherever it appears.
    pub fn parse(text: &str) -> SymExpr {
        parse_sum(text).unwrap_or_else(|| SymExpr::symbol(text.trim()))
    }
}

fn parse_sum(text: &str) -> Option<SymExpr> {
    let mut terms = Vec::new();
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut sign = 1i64;
    if let Some(r) = rest.strip_prefix('-') {
        sign = -1;
        rest = r.trim_start();
    }
    loop {
        // A `-` is an operator only after a space (`seq - 1`); `seq-len` is one name.
        let end = rest
            .char_indices()
            .find(|&(i, c)| c == '+' || (c == '-' && rest[..i].ends_with(char::is_whitespace)))
            .map_or(rest.len(), |(i, _)| i);
        let mut t = parse_product(&rest[..end])?;
        t.coef = t.coef.checked_mul(sign)?;
        terms.push(t);
        if end == rest.len() {
            break;
        }
        sign = if rest.as_bytes()[end] == b'-' { -1 } else { 1 };
        rest = rest[end + 1..].trim_start();
    }
    SymExpr::checked(terms)
}

fn parse_product(text: &str) -> Option<Term> {
    let mut t = Term { syms: Vec::new(), coef: 1 };
    for f in text.split('*') {
        let f = f.trim();
        let mut chars = f.chars();
        match chars.next()? {
            c if c.is_ascii_digit() => t.coef = t.coef.checked_mul(f.parse().ok()?)?,
            c if c.is_alphabetic() || c == '_' => {
                if !chars.all(|c| c.is_alphanumeric() || c == '_' || c == '.') {
                    return None;
                }
                t.syms.push(Arc::from(f));
            }
            _ => return None,
        }
    }
    Some(t)
}

impl fmt::Display for SymExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("0");
        }
        for (i, t) in self.0.iter().enumerate() {
            let coef = match (i, t.coef < 0) {
                (0, true) => {
                    f.write_str("-")?;
                    t.coef.unsigned_abs()
                }
                (0, false) => t.coef as u64,
                (_, true) => {
                    f.write_str(" - ")?;
                    t.coef.unsigned_abs()
                }
                (_, false) => {
                    f.write_str(" + ")?;
                    t.coef as u64
                }
            };
            let mut parts: Vec<String> = Vec::new();
            if coef != 1 || t.syms.is_empty() {
                parts.push(coef.to_string());
            }
            parts.extend(t.syms.iter().map(|s| s.to_string()));
            f.write_str(&parts.join("*"))?;
        }
        Ok(())
    }
}

impl Serialize for SymExpr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for SymExpr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(SymExpr::parse(&String::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> SymExpr {
        SymExpr::parse(s)
    }

    #[test]
    fn parses_normalises_and_prints() {
        assert_eq!(p("batch*8").to_string(), "8*batch");
        assert_eq!(p("8*batch"), p(" batch * 8 "));
        assert_eq!(p("s0 + 1 - 1").as_symbol(), Some("s0"));
        assert_eq!(p("seq - 1").to_string(), "seq - 1");
        assert_eq!(p("1 + 2*s1*s0").to_string(), "2*s0*s1 + 1");
        assert_eq!(p("-batch + 3").to_string(), "-batch + 3");
        assert_eq!(p("(s0//2)").as_symbol(), Some("(s0//2)"));
        assert_eq!(p("seq-len").as_symbol(), Some("seq-len"));
        assert_eq!(p("MatMul_dim_1").as_symbol(), Some("MatMul_dim_1"));
        assert_eq!(p("4 * 6").as_const(), Some(24));
    }

    #[test]
    fn arithmetic_and_exact_division() {
        let b = SymExpr::symbol("batch");
        let eight_b = b.mul(&SymExpr::constant(8)).unwrap();
        assert_eq!(eight_b, p("8*batch"));
        assert_eq!(eight_b.div_exact(&SymExpr::constant(4)), Some(p("2*batch")));
        assert_eq!(eight_b.div_exact(&SymExpr::constant(3)), None);
        assert_eq!(p("768*batch").div_exact(&p("96*batch")), Some(SymExpr::constant(8)));
        assert_eq!(p("batch*seq").div_exact(&b), Some(p("seq")));
        assert_eq!(p("batch + 1").div_exact(&b), None);
        assert_eq!(p("batch + 1").div_exact(&p("batch + 1")), Some(SymExpr::constant(1)));
        assert_eq!(p("seq - 1").add(&SymExpr::constant(1)), Some(p("seq")));
        assert_eq!(b.sub(&b).unwrap().as_const(), Some(0));
        assert_eq!(p("4611686018427387904*batch").mul(&SymExpr::constant(2)), None);
        assert_eq!(p("9223372036854775807*batch").add(&b), None);
    }

    #[test]
    fn binds_and_evaluates() {
        let bind = |s: &str| (s == "batch").then_some(5);
        assert_eq!(p("8*batch - 2").eval(&bind), Some(38));
        assert_eq!(p("batch*seq").eval(&bind), None);
        assert_eq!(p("batch*seq").bind(&bind), Some(p("5*seq")));
        assert_eq!(p("4611686018427387904*batch").bind(&bind), None);
        assert_eq!(p("4611686018427387904*batch").eval(&bind), None);
    }
}
