//! A small builder for the nodes the training passes add: stable names (`{base}.{what}`), shared
//! constants, and the few composite helpers the gradient rules use (un-broadcasting, transposes).

use std::collections::HashMap;

use mpc_ir::ops::{CastAttrs, ConstantOfShapeAttrs, ReduceAttrs, TransposeAttrs};
use mpc_ir::{DType, Dim, Graph, Op, Shape, Tensor, TypeInfo, ValueId};

pub(crate) struct Builder<'g> {
    pub g: &'g mut Graph,
    /// Prefix of the names of the nodes being added (the forward node's name, `.grad`).
    pub base: String,
    counter: usize,
    consts: HashMap<(DType, u64), ValueId>,
    ints: HashMap<Vec<i64>, ValueId>,
}

impl<'g> Builder<'g> {
    pub fn new(g: &'g mut Graph) -> Builder<'g> {
        Builder { g, base: String::new(), counter: 0, consts: HashMap::new(), ints: HashMap::new() }
    }

    /// Starts naming nodes after `base`.
    pub fn at(&mut self, base: &str) {
        self.base = base.to_string();
        self.counter = 0;
    }

    /// `{base}.{what}` for the first node at this base, `{base}.{what}{k}` for the k-th.
    fn next_name(&mut self, what: &str) -> String {
        use std::fmt::Write;
        self.counter += 1;
        let mut name = String::with_capacity(self.base.len() + what.len() + 4);
        name.push_str(&self.base);
        name.push('.');
        name.push_str(what);
        if self.counter > 1 {
            write!(name, "{}", self.counter).ok();
        }
        name
    }

    /// Adds `op` with `n` outputs.
    pub fn ops(&mut self, what: &str, op: Op, inputs: &[Option<ValueId>], n: usize) -> Vec<ValueId> {
        let name = self.next_name(what);
        let id = self.g.push_op(name, op, inputs.iter().copied(), n);
        self.g.node(id).outputs().to_vec()
    }

    /// Adds `op` with one output.
    pub fn op(&mut self, what: &str, op: Op, inputs: &[ValueId]) -> ValueId {
        let name = self.next_name(what);
        let id = self.g.push_op(name, op, inputs.iter().map(|&v| Some(v)), 1);
        self.g.node(id).outputs()[0]
    }

    /// A named value with a known type (inputs and state added by the passes).
    pub fn init(&mut self, name: &str, t: Tensor) -> ValueId {
        let name = self.g.unique_name(name);
        let v = self.g.add_initializer(&name, t.clone());
        self.g.set_ty(v, TypeInfo::new(t.dtype(), Shape::fixed(t.shape())));
        v
    }

    /// A shared scalar constant of `dtype`.
    pub fn scalar(&mut self, x: f64, dtype: DType) -> ValueId {
        let key = (dtype, x.to_bits());
        if let Some(&v) = self.consts.get(&key) {
            return v;
        }
        let name = format!("grad.const.{dtype}.{x}");
        let t = if dtype.is_float() {
            Tensor::from_f64_as(dtype, vec![], &[x])
        } else {
            Tensor::from_i64(vec![], &[x as i64]).to_dtype(dtype)
        };
        let v = self.init(&name, t);
        self.consts.insert(key, v);
        v
    }

    /// A shared 1-D i64 constant (axes, shapes, sizes).
    pub fn ints(&mut self, xs: &[i64]) -> ValueId {
        if let Some(&v) = self.ints.get(xs) {
            return v;
        }
        let text: Vec<String> = xs.iter().map(|x| x.to_string()).collect();
        let v = self.init(&format!("grad.ints.[{}]", text.join(",")), Tensor::from_i64(vec![xs.len() as u64], xs));
        self.ints.insert(xs.to_vec(), v);
        v
    }

    pub fn dtype(&self, v: ValueId) -> Result<DType, String> {
        self.g.ty(v).dtype.ok_or_else(|| format!("the dtype of `{}` is unknown", self.g.name(v)))
    }

    pub fn shape(&self, v: ValueId) -> Result<Shape, String> {
        self.g.ty(v).shape.clone().ok_or_else(|| format!("the shape of `{}` is unknown", self.g.name(v)))
    }

    pub fn cast(&mut self, x: ValueId, to: DType) -> ValueId {
        self.op("cast", Op::Cast(CastAttrs { to, ..Default::default() }), &[x])
    }

    pub fn reduce_sum(&mut self, x: ValueId, axes: &[i64], keepdims: bool) -> ValueId {
        let ax = self.ints(axes);
        let attrs = ReduceAttrs { keepdims, noop_with_empty_axes: false };
        self.op("sum", Op::ReduceSum(attrs), &[x, ax])
    }

    /// Swaps the last two axes.
    pub fn transpose_last(&mut self, x: ValueId, rank: usize) -> ValueId {
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        self.op("transpose", Op::Transpose(TransposeAttrs { perm: Some(perm) }), &[x])
    }

    /// A tensor of `dt` filled with `x`, shaped by the 1-D shape value `s`.
    pub fn full(&mut self, what: &str, s: ValueId, x: f64, dt: DType) -> ValueId {
        let value = Tensor::from_f64_as(dt, vec![1], &[x]);
        self.op(what, Op::ConstantOfShape(Box::new(ConstantOfShapeAttrs { value: Some(value) })), &[s])
    }

    /// Zeros shaped like `v` (the gradient of an unread output).
    pub fn zeros_like(&mut self, v: ValueId) -> Result<ValueId, String> {
        let dt = self.dtype(v)?;
        let s = self.shape_of(v);
        Ok(self.full("zeros", s, 0.0, dt))
    }

    /// `x`'s shape as a value: a constant when fully known, else a `Shape` node.
    pub fn shape_of(&mut self, x: ValueId) -> ValueId {
        match self.g.ty(x).shape.as_ref().and_then(|s| s.as_fixed()) {
            Some(dims) => {
                let d: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
                self.ints(&d)
            }
            None => self.op("shape", Op::Shape(Default::default()), &[x]),
        }
    }

    /// Sums `dy` (shaped like the broadcast result `out`) down to the shape of `x`: the gradient
    /// of numpy broadcasting.
    pub fn unbroadcast(&mut self, dy: ValueId, x: ValueId, out: ValueId) -> Result<ValueId, String> {
        let (xs, ys) = (self.shape(x)?, self.shape(out)?);
        let (rx, ry) = (xs.rank(), ys.rank());
        if rx > ry {
            return Err(format!("`{}` has a higher rank than the result", self.g.name(x)));
        }
        let lead = ry - rx;
        let mut dy = dy;
        if lead > 0 {
            let axes: Vec<i64> = (0..lead as i64).collect();
            dy = self.reduce_sum(dy, &axes, false);
        }
        let bcast: Vec<i64> = (0..rx)
            .filter(|&i| xs.dims()[i] == Dim::Fixed(1) && ys.dims()[lead + i] != Dim::Fixed(1))
            .map(|i| i as i64)
            .collect();
        if !bcast.is_empty() {
            dy = self.reduce_sum(dy, &bcast, true);
        }
        Ok(dy)
    }
}

/// The value of an integer operand that a rule needs as a constant (`None` when absent).
pub(super) fn int_const(g: &Graph, v: Option<ValueId>, what: &str) -> Result<Option<Vec<i64>>, String> {
    match v {
        None => Ok(None),
        Some(v) => match g.constant(v).and_then(|t| t.to_i64_vec()).or_else(|| crate::infer::const_ints(g, v)) {
            Some(x) => Ok(Some(x)),
            None => Err(format!("{what} must be a constant to differentiate")),
        },
    }
}

/// A dim a rule needs as a number.
pub(super) fn fixed(d: &Dim, what: &str) -> Result<i64, String> {
    d.fixed().map(|x| x as i64).ok_or_else(|| format!("{what} must have a known size to differentiate"))
}
