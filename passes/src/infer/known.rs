//! Known values of small integer tensors (shapes, axes, sizes), with symbolic elements.

use std::collections::HashMap;
use std::sync::Arc;

use mpc_ir::{normalize_axis, Dim, Graph, NodeId, Op, ValueId};

/// One element of a known integer tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Elem {
    Int(i64),
    Sym(Arc<str>),
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
            Elem::Sym(s) => Dim::Sym(s.clone()),
            _ => Dim::Unknown,
        }
    }

    fn from_dim(d: &Dim) -> Elem {
        match d {
            Dim::Fixed(n) => Elem::Int(*n as i64),
            Dim::Sym(s) => Elem::Sym(s.clone()),
            Dim::Unknown => Elem::Unknown,
        }
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
            let n = g.ty(node.input(0)?).shape.as_ref()?.numel()?;
            Some(Known { scalar: true, elems: vec![Elem::Int(n as i64)] })
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
        Op::Add | Op::Sub | Op::Mul | Op::Div => {
            let (a, b) = (input(0)?, input(1)?);
            let len = a.elems.len().max(b.elems.len());
            if !(a.elems.len() == len || a.elems.len() == 1) || !(b.elems.len() == len || b.elems.len() == 1) {
                return None;
            }
            let at = |k: &Known, i: usize| k.elems[if k.elems.len() == 1 { 0 } else { i }].clone();
            let elems = (0..len)
                .map(|i| match (at(a, i), at(b, i), &node.op) {
                    (Elem::Int(x), Elem::Int(y), Op::Add) => Elem::Int(x.wrapping_add(y)),
                    (Elem::Int(x), Elem::Int(y), Op::Sub) => Elem::Int(x.wrapping_sub(y)),
                    (Elem::Int(x), Elem::Int(y), Op::Mul) => Elem::Int(x.wrapping_mul(y)),
                    (Elem::Int(x), Elem::Int(y), Op::Div) if y != 0 => Elem::Int(x.wrapping_div(y)),
                    (s, Elem::Int(1), Op::Mul | Op::Div) | (Elem::Int(1), s, Op::Mul) => s,
                    (s, Elem::Int(0), Op::Add | Op::Sub) | (Elem::Int(0), s, Op::Add) => s,
                    _ => Elem::Unknown,
                })
                .collect();
            Some(Known { scalar: a.scalar && b.scalar, elems })
        }
        _ => None,
    }
}
