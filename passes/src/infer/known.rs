//! Known values of small integer tensors (shapes, axes, sizes), with symbolic elements.

use mpc_ir::{normalize_axis, Dim, Graph, NodeId, Op, SymExpr, ValueId};
use std::collections::HashMap;

/// One element of a known integer tensor: an integer, a symbolic size such as `batch` or
/// `8*batch` (never a constant), or unknown. Booleans are the integers 0 and 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Elem {
    Int(i64),
    Sym(SymExpr),
    Unknown,
}

impl Elem {
    pub fn int(&self) -> Option<i64> {
        match self {
            Elem::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The element as a dim (negative numbers are not sizes).
    pub fn dim(&self) -> Dim {
        match self {
            Elem::Int(i) if *i >= 0 => Dim::Fixed(*i as u64),
            Elem::Sym(e) => Dim::Sym(e.clone()),
            _ => Dim::Unknown,
        }
    }

    fn from_dim(d: &Dim) -> Elem {
        d.expr().map_or(Elem::Unknown, Elem::from_expr)
    }

    fn from_expr(e: SymExpr) -> Elem {
        match e.as_const() {
            Some(c) => Elem::Int(c),
            None => Elem::Sym(e),
        }
    }

    fn expr(&self) -> Option<SymExpr> {
        match self {
            Elem::Int(i) => Some(SymExpr::constant(*i)),
            Elem::Sym(e) => Some(e.clone()),
            Elem::Unknown => None,
        }
    }

    /// `a op b` for the integer arithmetic and comparisons of shape computations. Division is
    /// exact on symbols and truncating on integers (as ONNX runtimes divide int64).
    /// The integer formula of a binary op that shape arithmetic folds, or `None` for the ops it
    /// does not.
    fn int_formula(op: &Op) -> Option<fn(i64, i64) -> Option<i64>> {
        let f: fn(i64, i64) -> Option<i64> = match op {
            Op::Add => |x, y| x.checked_add(y),
            Op::Sub => |x, y| x.checked_sub(y),
            Op::Mul => |x, y| x.checked_mul(y),
            Op::Div => |x, y| x.checked_div(y),
            Op::Max => |x, y| Some(x.max(y)),
            Op::Min => |x, y| Some(x.min(y)),
            // ONNX Mod: C's remainder with fmod, else the divisor's sign (Python's %).
            Op::Mod(m) if m.fmod => |x, y| x.checked_rem(y),
            Op::Mod(_) => |x, y| x.checked_rem(y).map(|r| if r != 0 && (r < 0) != (y < 0) { r + y } else { r }),
            Op::Equal => |x, y| Some(i64::from(x == y)),
            Op::Less => |x, y| Some(i64::from(x < y)),
            Op::Greater => |x, y| Some(i64::from(x > y)),
            _ => return None,
        };
        Some(f)
    }

    fn binary(op: &Op, a: &Elem, b: &Elem) -> Elem {
        if let (Elem::Int(x), Elem::Int(y)) = (a, b) {
            let v = Elem::int_formula(op).and_then(|f| f(*x, *y));
            return v.map_or(Elem::Unknown, Elem::Int);
        }
        let (Some(x), Some(y)) = (a.expr(), b.expr()) else { return Elem::Unknown };
        let v = match op {
            Op::Add => x.add(&y),
            Op::Sub => x.sub(&y),
            Op::Mul => x.mul(&y),
            Op::Div => x.div_exact(&y),
            // A size built from sizes with no negative coefficient is never negative.
            Op::Equal if x == y => Some(SymExpr::constant(1)),
            Op::Equal
                if [(&x, &y), (&y, &x)]
                    .iter()
                    .any(|(s, c)| s.is_nonnegative() && c.as_const().is_some_and(|c| c < 0)) =>
            {
                Some(SymExpr::constant(0))
            }
            _ => None,
        };
        v.map_or(Elem::Unknown, Elem::from_expr)
    }
}

/// A known integer tensor of rank 0 or 1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Known {
    pub scalar: bool,
    pub elems: Vec<Elem>,
}

impl Known {
    /// Every element, if all are plain integers.
    pub fn ints(&self) -> Option<Vec<i64>> {
        self.elems.iter().map(Elem::int).collect()
    }
}

/// Largest tensor tracked: shape vectors and axes lists are far smaller.
const MAX_ELEMS: u64 = 64;

pub(crate) struct KnownValues {
    map: HashMap<ValueId, Known>,
}

impl KnownValues {
    pub(crate) fn new(g: &Graph) -> Self {
        let mut map = HashMap::new();
        for v in g.initializers() {
            if let Some(k) = g.value(v).initializer().and_then(from_tensor) {
                map.insert(v, k);
            }
        }
        KnownValues { map }
    }

    pub(crate) fn get(&self, v: ValueId) -> Option<&Known> {
        self.map.get(&v)
    }

    pub(crate) fn set(&mut self, v: ValueId, k: Known) {
        self.map.insert(v, k);
    }
}

/// The integer value of `v` when constants alone decide it: an initializer, a Constant, or the
/// shape arithmetic the exporters build on them and on known dims (`Unsqueeze(Constant)`,
/// `Gather(Shape(x), 1)` where that dim is fixed). What a rule that needs a constant operand uses.
pub(crate) fn const_ints(g: &Graph, v: ValueId) -> Option<Vec<i64>> {
    fn visit(g: &Graph, v: ValueId, known: &mut KnownValues, depth: usize) -> Option<()> {
        if known.get(v).is_some() {
            return Some(());
        }
        if let Some(t) = g.value(v).initializer() {
            known.set(v, from_tensor(t)?);
            return Some(());
        }
        let &mpc_ir::Def::Node(n, slot) = g.value(v).def() else { return None };
        if depth > 32 {
            return None;
        }
        for i in g.node(n).inputs().iter().flatten() {
            // An input left unknown may still not matter (Shape reads only its input's type).
            let _ = visit(g, *i, known, depth + 1);
        }
        let k = propagate(g, n, slot, known)?;
        known.set(v, k);
        Some(())
    }
    let mut known = KnownValues { map: HashMap::new() };
    visit(g, v, &mut known, 0)?;
    known.get(v)?.ints()
}

fn from_tensor(t: &mpc_ir::Tensor) -> Option<Known> {
    if t.shape().len() > 1 || t.numel() > MAX_ELEMS {
        return None;
    }
    let v = t.to_i64_vec()?;
    Some(Known { scalar: t.shape().is_empty(), elems: v.into_iter().map(Elem::Int).collect() })
}

/// The known value of output `slot` of node `n`, where the op and its inputs allow one.
pub(crate) fn propagate(g: &Graph, n: NodeId, slot: usize, known: &KnownValues) -> Option<Known> {
    let node = g.node(n);
    let input = |i: usize| node.input(i).and_then(|v| known.get(v));
    if slot != 0 {
        return None;
    }
    match &node.op {
        Op::Constant(c) => from_tensor(&c.value),
        Op::Shape(a) => {
            let shape = g.ty(node.input(0)?).shape.as_ref()?;
            let r = shape.rank() as i64;
            let clamp = |x: i64| (if x < 0 { x + r } else { x }).clamp(0, r) as usize;
            let (s, e) = (clamp(a.start), clamp(a.end.unwrap_or(r)));
            let elems = shape.dims().get(s..e.max(s))?.iter().map(Elem::from_dim).collect();
            Some(Known { scalar: false, elems })
        }
        Op::Size => {
            let shape = g.ty(node.input(0)?).shape.as_ref()?;
            let n = shape.dims().iter().try_fold(SymExpr::constant(1), |acc, d| acc.mul(&d.expr()?))?;
            Some(Known { scalar: true, elems: vec![Elem::from_expr(n)] })
        }
        Op::Identity => input(0).cloned(),
        Op::Cast(c) if !c.to.is_float() => input(0).cloned(),
        Op::Gather(a) => {
            let data = input(0)?;
            let idx = input(1)?.ints()?;
            if data.scalar || normalize_axis(a.axis, 1)? != 0 {
                return None;
            }
            let len = data.elems.len() as i64;
            let elems = idx
                .iter()
                .map(|&i| data.elems.get(if i < 0 { i + len } else { i } as usize).cloned())
                .collect::<Option<Vec<_>>>()?;
            Some(Known { scalar: input(1)?.scalar, elems })
        }
        Op::Unsqueeze => {
            let x = input(0)?;
            x.scalar.then(|| Known { scalar: false, elems: x.elems.clone() })
        }
        Op::Squeeze => {
            let x = input(0)?;
            (!x.scalar && x.elems.len() == 1).then(|| Known { scalar: true, elems: x.elems.clone() })
        }
        Op::Concat(_) => {
            let mut elems = Vec::new();
            for i in 0..node.inputs().len() {
                let k = input(i)?;
                elems.extend(k.elems.iter().cloned());
            }
            Some(Known { scalar: false, elems })
        }
        Op::Slice => {
            let x = input(0)?;
            let (starts, ends) = (input(1)?.ints()?, input(2)?.ints()?);
            let steps = match node.input(4) {
                Some(_) => input(4)?.ints()?,
                None => vec![1],
            };
            if x.scalar || starts.len() != 1 || steps != [1] {
                return None;
            }
            let len = x.elems.len() as i64;
            let clamp = |v: i64| (if v < 0 { v + len } else { v }).clamp(0, len) as usize;
            let (s, e) = (clamp(starts[0]), clamp(ends[0]));
            Some(Known { scalar: false, elems: x.elems.get(s..e.max(s))?.to_vec() })
        }
        op if node.inputs().len() == 2 && Elem::int_formula(op).is_some() => {
            let (a, b) = (input(0)?, input(1)?);
            let elems = broadcast_elems(&[a, b], |e| Elem::binary(&node.op, &e[0], &e[1]))?;
            Some(Known { scalar: a.scalar && b.scalar, elems })
        }
        Op::Neg => {
            let x = input(0)?;
            let zero = Elem::Int(0);
            Some(Known { scalar: x.scalar, elems: x.elems.iter().map(|e| Elem::binary(&Op::Sub, &zero, e)).collect() })
        }
        Op::Not => {
            let x = input(0)?;
            let elems =
                x.elems.iter().map(|e| e.int().map_or(Elem::Unknown, |b| Elem::Int(i64::from(b == 0)))).collect();
            Some(Known { scalar: x.scalar, elems })
        }
        Op::Where => {
            let (c, a, b) = (input(0)?, input(1)?, input(2)?);
            let elems = broadcast_elems(&[c, a, b], |e| match e[0].int() {
                Some(0) => e[2].clone(),
                Some(_) => e[1].clone(),
                None if e[1] == e[2] => e[1].clone(),
                None => Elem::Unknown,
            })?;
            Some(Known { scalar: c.scalar && a.scalar && b.scalar, elems })
        }
        // A reshape of a known vector or scalar to a vector or scalar keeps its elements.
        Op::Reshape(_) | Op::Flatten(_) | Op::Expand => {
            let x = input(0)?;
            let out = g.ty(node.outputs()[0]).shape.as_ref()?;
            let n = out.numel()?;
            let elems = match (x.elems.len() as u64, out.rank()) {
                (len, 0 | 1) if len == n => x.elems.clone(),
                (1, 0 | 1) if n <= MAX_ELEMS => vec![x.elems[0].clone(); n as usize],
                _ => return None,
            };
            Some(Known { scalar: out.rank() == 0, elems })
        }
        Op::ConstantOfShape(a) => {
            let dims = input(0)?.ints()?;
            let n = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(u64::try_from(d).ok()?))?;
            if dims.len() > 1 || n > MAX_ELEMS {
                return None;
            }
            let value = match &a.value {
                Some(t) => t.to_i64_vec()?.first().copied()?,
                None => return None,
            };
            Some(Known { scalar: dims.is_empty(), elems: vec![Elem::Int(value); n as usize] })
        }
        Op::Range => {
            let (s, l, d) = (input(0)?.ints()?, input(1)?.ints()?, input(2)?.ints()?);
            let (&[s], &[l], &[d]) = (s.as_slice(), l.as_slice(), d.as_slice()) else { return None };
            if d == 0 {
                return None;
            }
            let n = (l.checked_sub(s)?.checked_add(d - d.signum())? / d).max(0) as u64;
            if n > MAX_ELEMS {
                return None;
            }
            Some(Known { scalar: false, elems: (0..n as i64).map(|i| Elem::Int(s + i * d)).collect() })
        }
        _ => None,
    }
}

/// Applies `f` elementwise to known vectors of equal length or of one element (numpy
/// broadcasting of rank ≤ 1).
fn broadcast_elems(inputs: &[&Known], f: impl Fn(&[Elem]) -> Elem) -> Option<Vec<Elem>> {
    let len = inputs.iter().map(|k| k.elems.len()).max()?;
    if inputs.iter().any(|k| k.elems.len() != len && k.elems.len() != 1) {
        return None;
    }
    let mut args = Vec::with_capacity(inputs.len());
    Some(
        (0..len)
            .map(|i| {
                args.clear();
                args.extend(inputs.iter().map(|k| k.elems[if k.elems.len() == 1 { 0 } else { i }].clone()));
                f(&args)
            })
            .collect(),
    )
}
