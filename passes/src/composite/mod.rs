//! Standard ops that mpc runs as the ops they are made of, written out once inference knows their
//! operand's dtype and rank. Each follows the ONNX spec's function body, or onnxruntime where the
//! two differ (said at the op), so the result runs, colours and differentiates as its parts do.
//!
//! - `ThresholdedRelu(x)` = `Where(x > alpha, x, 0)`.
//! - `Shrink(x)` = `Where(x < -lambd, x + bias, Where(x > lambd, x - bias, 0))` (float dtypes;
//!   an integer Shrink stays as it is).
//! - `Hardmax(x)` = `Cast(Equal(ArgMax(x, axis, keepdims), Range(0, dim) along axis))`: a one at
//!   the first largest element. Before opset 13 over the input flattened to 2-D at `axis`.
//! - `LpNormalization(x)` = `x / n` with `n` = `ReduceL1` or `ReduceL2` over `axis`, and 1 where
//!   `n` is 0 (onnxruntime gives 0 for a zero row, not NaN).
//! - `LpPool(x)` = `(sum of |x|^p over the window)^(1/p)`: the sum is `AveragePool` counting the
//!   padding, times the window's size, with the end padding made explicit and grown to cover the
//!   windows that run past the padded input (ceil_mode, or a window larger than the input; a pad
//!   the pool cannot take, at least its kernel, is a Pad of zeros before it); that needs the
//!   input's spatial sizes, so with symbolic ones an LpPool waits for a binding.
//! - `GlobalLpPool(x)` = `ReduceL1`, `ReduceL2` or `(ReduceSum |x|^p)^(1/p)` over the spatial axes.
//! - `MeanVarianceNormalization(x)` = `(x - mean) / (sqrt(mean((x - mean)²)) + 1e-9)` over `axes`
//!   (the spec's epsilon; the centred variance, as onnxruntime computes it).
//! - `RMSNormalization(x, scale)` = `Cast(xs · 1/sqrt(mean(xs²) + epsilon) · scale)` over the axes
//!   from `axis` on, `xs` and the scale in the `stash_type` dtype: onnxruntime's one rounding (the
//!   spec's function body rounds before the scale too).
//! - `EyeLike(x)` = `Cast(Equal(Range(0, rows) + k, Range(0, cols)))` in `dtype` (x's by default).
//! - `ReverseSequence(x, lens)` = `GatherElements(x, index, time_axis)`, the index `lens[b] - 1 - t`
//!   where `t < lens[b]` and `t` elsewhere.
//! - `GridSample(x, grid)`: gathers of x's flattened spatial dims at each tap's index, weighted and
//!   summed ([`grid_sample`]).
//!
//! The node itself becomes the last op of its expansion, so its outputs keep their names.

use mpc_ir::attr::{take, Attrs};
use mpc_ir::geometry::{AutoPad, WindowSpec};
use mpc_ir::ops::{ArgAttrs, AxisAttrs, CastAttrs, FlattenAttrs, ReduceAttrs, ShapeAttrs};
use mpc_ir::{Attr, DType, Graph, NodeId, Op, Tensor, ValueId};

use crate::{Changed, Result};

mod grid_sample;

/// The standard op types written out here.
pub const COMPOSITE: &[&str] = &[
    "ThresholdedRelu",
    "Shrink",
    "Hardmax",
    "LpNormalization",
    "LpPool",
    "GlobalLpPool",
    "MeanVarianceNormalization",
    "RMSNormalization",
    "EyeLike",
    "ReverseSequence",
    "GridSample",
];

/// The composite ops whose arithmetic must not be coloured low: GridSample's coordinates index
/// pixels, which FP16 misplaces on axes past about 2048 and BF16 past about 256 (torch's autocast
/// runs `grid_sampler` in FP32 for this). Under a precision policy the simplify pass leaves them
/// whole, the precision pass colours each as the opaque op it still is (FP32, with casts at its
/// edges) and then writes it out.
pub const HELD_FOR_COLOURING: &[&str] = &["GridSample"];

/// Writes out every composite op whose first input's dtype and rank are known, typing what it
/// wrote (a composite op that reads another is written out in the next round).
pub fn expand_composites(g: &mut Graph) -> Result<Changed> {
    expand_composites_but(g, &[])
}

/// [`expand_composites`] but for the op types in `hold`.
pub fn expand_composites_but(g: &mut Graph, hold: &[&str]) -> Result<Changed> {
    let mut changed = Changed::No;
    while expand(g, hold)? == Changed::Yes {
        crate::infer_types(g)?;
        changed = Changed::Yes;
    }
    Ok(changed)
}

fn expand(g: &mut Graph, hold: &[&str]) -> Result<Changed> {
    let mut changed = Changed::No;
    for n in g.topo_order()? {
        let Op::Opaque(o) = &g.node(n).op else { continue };
        if !o.domain.is_empty() || !COMPOSITE.contains(&o.op_type.as_str()) || hold.contains(&o.op_type.as_str()) {
            continue;
        }
        let (op_type, attrs) = (o.op_type.clone(), o.attrs.clone());
        let Some(x) = g.node(n).input(0) else { continue };
        let (Some(dtype), Some(rank)) = (g.ty(x).dtype, g.ty(x).shape.as_ref().map(|s| s.rank())) else { continue };
        let base = g.node(n).name.clone();
        let mut at = At { g, n, base, x, dtype, rank, scalars: Default::default(), round_to: None };
        // Sums of powers and of squares overflow FP16 (and round in BF16) long before their
        // result does: these compute in FP32 and round once, as an op on FP16 values should.
        let widen = matches!(dtype, DType::F16 | DType::BF16) && WIDENED.contains(&op_type.as_str());
        let cast = widen.then(|| {
            at.x = at.op("wide", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[x]);
            // Typed now: the expansions read x's shape.
            let ty = mpc_ir::TypeInfo { dtype: Some(DType::F32), ..at.g.ty(x).clone() };
            at.g.set_ty(at.x, ty);
            (at.dtype, at.round_to) = (DType::F32, Some(dtype));
            at.g.value(at.x).producer().map(|(p, _)| p)
        });
        if at.expand(&op_type, attrs).is_some() {
            changed = Changed::Yes;
        } else if let Some(Some(p)) = cast {
            g.remove_node(p);
        }
    }
    Ok(changed)
}

/// One node being written out: `x` its first input, of `dtype` and `rank`.
struct At<'g> {
    g: &'g mut Graph,
    n: NodeId,
    base: String,
    x: ValueId,
    dtype: DType,
    rank: usize,
    /// The scalars made so far, one initializer per (dtype, value).
    scalars: std::collections::HashMap<(DType, u64), ValueId>,
    /// The dtype the result is rounded to, when x was widened to FP32 ([`WIDENED`]).
    round_to: Option<DType>,
}

/// The composite ops whose FP16 and BF16 forms compute in FP32 (x cast up, the result rounded
/// once): their sums of powers (LpPool, GlobalLpPool) and squares (MeanVarianceNormalization,
/// LpNormalization) overflow FP16 where the result does not (|x| = 48 cubed is past 65504).
const WIDENED: &[&str] = &["LpNormalization", "LpPool", "GlobalLpPool", "MeanVarianceNormalization"];

fn int(attrs: &mut Attrs, name: &str, default: i64) -> Option<i64> {
    take::<i64>(attrs, name).ok().map(|v| v.unwrap_or(default))
}

fn float(attrs: &mut Attrs, name: &str, default: f32) -> Option<f32> {
    take::<f32>(attrs, name).ok().map(|v| v.unwrap_or(default))
}

fn reduce(keepdims: bool) -> ReduceAttrs {
    ReduceAttrs { keepdims, noop_with_empty_axes: false }
}

impl At<'_> {
    fn op(&mut self, what: &str, op: Op, ins: &[ValueId]) -> ValueId {
        let id = self.g.push_op(format!("{}.{what}", self.base), op, ins.iter().map(|&v| Some(v)), 1);
        self.g.node(id).outputs()[0]
    }

    fn konst(&mut self, what: &str, t: Tensor) -> ValueId {
        let name = self.g.unique_name(&format!("{}.{what}", self.base));
        self.g.add_initializer(&name, t)
    }

    /// A scalar of x's dtype (the same value made once).
    fn scalar(&mut self, what: &str, v: f64) -> ValueId {
        let key = (self.dtype, v.to_bits());
        if let Some(&s) = self.scalars.get(&key) {
            return s;
        }
        let s = self.konst(what, Tensor::from_f64_as(key.0, vec![], &[v]));
        self.scalars.insert(key, s);
        s
    }

    fn ints(&mut self, what: &str, v: &[i64]) -> ValueId {
        self.konst(what, Tensor::from_i64(vec![v.len() as u64], v))
    }

    /// `axis` counted from the front, if it names a dim of x.
    fn axis(&self, axis: i64) -> Option<usize> {
        let r = self.rank as i64;
        (-r..r).contains(&axis).then_some(axis.rem_euclid(r.max(1)) as usize)
    }

    /// The size of x's dim `axis`, as an int64 scalar.
    fn dim(&mut self, what: &str, v: ValueId, axis: usize) -> ValueId {
        let shape = self.op(&format!("{what}_shape"), Op::Shape(ShapeAttrs::default()), &[v]);
        let at = self.konst(&format!("{what}_at"), Tensor::scalar_i64(axis as i64));
        self.op(what, Op::Gather(AxisAttrs { axis: 0 }), &[shape, at])
    }

    /// `Range(0, size)` shaped to run along `axis` of a tensor of `rank` (1s elsewhere).
    fn positions(&mut self, what: &str, size: ValueId, axis: usize, rank: usize) -> ValueId {
        let (zero, one) = (self.konst("zero", Tensor::scalar_i64(0)), self.konst("one", Tensor::scalar_i64(1)));
        let r = self.op(what, Op::Range, &[zero, size, one]);
        let mut shape = vec![1; rank];
        shape[axis] = -1;
        let shape = self.ints(&format!("{what}_shape"), &shape);
        self.op(&format!("{what}_along"), Op::Reshape(Default::default()), &[r, shape])
    }

    /// The node becomes `op` of `ins`.
    fn finish(&mut self, op: Op, ins: &[ValueId]) -> Option<()> {
        let (op, ins) = match self.round_to {
            Some(d) => (Op::Cast(CastAttrs { saturate: true, to: d }), vec![self.op("result_f32", op, ins)]),
            None => (op, ins.to_vec()),
        };
        let ins = &ins[..];
        *self.g.node_op_mut(self.n) = op;
        for (slot, &v) in ins.iter().enumerate() {
            self.g.set_input(self.n, slot, Some(v));
        }
        self.g.truncate_inputs(self.n, ins.len());
        Some(())
    }

    fn expand(&mut self, op_type: &str, mut a: Attrs) -> Option<()> {
        let x = self.x;
        match op_type {
            "ThresholdedRelu" => {
                let alpha = self.scalar("alpha", float(&mut a, "alpha", 1.0)? as f64);
                let above = self.op("above", Op::Greater, &[x, alpha]);
                let zero = self.scalar("zero", 0.0);
                self.finish(Op::Where, &[above, x, zero])
            }
            "Shrink" => self.shrink(&mut a),
            "Hardmax" => self.hardmax(&mut a),
            "LpNormalization" => {
                let axis = self.axis(int(&mut a, "axis", -1)?)?;
                let norm = match int(&mut a, "p", 2)? {
                    1 => Op::ReduceL1(reduce(true)),
                    2 => Op::ReduceL2(reduce(true)),
                    _ => return None,
                };
                let axes = self.ints("axes", &[axis as i64]);
                let n = self.op("norm", norm, &[x, axes]);
                let (zero, one) = (self.scalar("zero", 0.0), self.scalar("one", 1.0));
                let is_zero = self.op("norm_is_zero", Op::Equal, &[n, zero]);
                let d = self.op("divisor", Op::Where, &[is_zero, one, n]);
                self.finish(Op::Div, &[x, d])
            }
            "LpPool" => self.lp_pool(a),
            "GlobalLpPool" => {
                let p = int(&mut a, "p", 2)?;
                if self.rank < 3 || p < 1 {
                    return None; // no spatial axis (empty axes would reduce them all), or no norm
                }
                let axes: Vec<i64> = (2..self.rank as i64).collect();
                let axes = self.ints("axes", &axes);
                match p {
                    1 => self.finish(Op::ReduceL1(reduce(true)), &[x, axes]),
                    2 => self.finish(Op::ReduceL2(reduce(true)), &[x, axes]),
                    p => {
                        let powered = self.abs_pow(p);
                        let sum = self.op("sum", Op::ReduceSum(reduce(true)), &[powered, axes]);
                        let root = self.scalar("root", 1.0 / p as f64);
                        self.finish(Op::Pow, &[sum, root])
                    }
                }
            }
            "MeanVarianceNormalization" => {
                let axes = match take::<Vec<i64>>(&mut a, "axes").ok()? {
                    Some(v) => v,
                    None => vec![0, 2, 3],
                };
                // Every axis one of x's, none twice (else left as it is, for the lowering to refuse).
                let axes: Vec<i64> = axes.iter().map(|&d| self.axis(d).map(|d| d as i64)).collect::<Option<_>>()?;
                if (1..axes.len()).any(|i| axes[..i].contains(&axes[i])) {
                    return None;
                }
                let axes = self.ints("axes", &axes);
                let mean = self.op("mean", Op::ReduceMean(reduce(true)), &[x, axes]);
                let centred = self.op("centred", Op::Sub, &[x, mean]);
                let square = self.op("square", Op::Mul, &[centred, centred]);
                let var = self.op("variance", Op::ReduceMean(reduce(true)), &[square, axes]);
                let sd = self.op("deviation", Op::Sqrt, &[var]);
                let eps = self.scalar("epsilon", 1e-9);
                let d = self.op("divisor", Op::Add, &[sd, eps]);
                self.finish(Op::Div, &[centred, d])
            }
            "RMSNormalization" => self.rms_norm(&mut a),
            "GridSample" => self.grid_sample(&mut a),
            "EyeLike" => {
                if self.rank != 2 {
                    return None;
                }
                let to = match take::<i64>(&mut a, "dtype").ok()? {
                    Some(code) => DType::from_onnx_code(code as i32).ok()?,
                    None => self.dtype,
                };
                let k = self.konst("k", Tensor::scalar_i64(int(&mut a, "k", 0)?));
                let (rows, cols) = (self.dim("rows", x, 0), self.dim("cols", x, 1));
                let r = self.positions("row", rows, 0, 2);
                let c = self.positions("col", cols, 1, 2);
                let shifted = self.op("row_plus_k", Op::Add, &[r, k]);
                let diagonal = self.op("diagonal", Op::Equal, &[shifted, c]);
                self.finish(Op::Cast(CastAttrs { saturate: true, to }), &[diagonal])
            }
            "ReverseSequence" => {
                let time = self.axis(int(&mut a, "time_axis", 0)?)?;
                let batch = self.axis(int(&mut a, "batch_axis", 1)?)?;
                let lens = self.g.node(self.n).input(1)?;
                if time == batch {
                    return None;
                }
                let rank = self.rank;
                let steps = self.dim("steps", x, time);
                let t = self.positions("time", steps, time, rank);
                let mut shape = vec![1; rank];
                shape[batch] = -1;
                let shape = self.ints("lens_shape", &shape);
                let lens = self.op("lens_along", Op::Reshape(Default::default()), &[lens, shape]);
                let one = self.konst("one_i64", Tensor::scalar_i64(1));
                let last = self.op("last", Op::Sub, &[lens, one]);
                let reversed = self.op("reversed", Op::Sub, &[last, t]);
                let inside = self.op("inside", Op::Less, &[t, lens]);
                let index = self.op("index", Op::Where, &[inside, reversed, t]);
                let x_shape = self.op("x_shape", Op::Shape(ShapeAttrs::default()), &[x]);
                let index = self.op("index_full", Op::Expand, &[index, x_shape]);
                self.finish(Op::GatherElements(AxisAttrs { axis: time as i64 }), &[x, index])
            }
            _ => None,
        }
    }

    /// `|x|^p`, as `Abs` for p = 1 and `x·x` for p = 2.
    fn abs_pow(&mut self, p: i64) -> ValueId {
        let x = self.x;
        match p {
            1 => self.op("abs", Op::Abs, &[x]),
            2 => self.op("square", Op::Mul, &[x, x]),
            _ => {
                let abs = self.op("abs", Op::Abs, &[x]);
                let p = self.scalar("p", p as f64);
                self.op("powered", Op::Pow, &[abs, p])
            }
        }
    }

    fn shrink(&mut self, a: &mut Attrs) -> Option<()> {
        if !self.dtype.is_float() {
            return None;
        }
        let (lambd, bias) = (float(a, "lambd", 0.5)? as f64, float(a, "bias", 0.0)? as f64);
        let x = self.x;
        let (lo, hi, b) = (self.scalar("minus_lambd", -lambd), self.scalar("lambd", lambd), self.scalar("bias", bias));
        let below = self.op("below", Op::Less, &[x, lo]);
        let above = self.op("above", Op::Greater, &[x, hi]);
        let (up, down) = (self.op("plus_bias", Op::Add, &[x, b]), self.op("minus_bias", Op::Sub, &[x, b]));
        let zero = self.scalar("zero", 0.0);
        let upper = self.op("upper", Op::Where, &[above, down, zero]);
        self.finish(Op::Where, &[below, up, upper])
    }

    fn hardmax(&mut self, a: &mut Attrs) -> Option<()> {
        let opset = match self.g.meta.onnx_opset() {
            0 => i64::MAX, // no opset (text IR): the newest form
            v => v,
        };
        let from = self.axis(int(a, "axis", if opset < 13 { 1 } else { -1 })?)?;
        let x = self.x;
        // An empty row has nothing to pick: the output is as empty as the input.
        let dims = self.g.ty(x).shape.as_ref().map(|s| s.dims().to_vec()).unwrap_or_default();
        let row = if opset < 13 { &dims[from..] } else { &dims[from..=from] };
        if row.iter().any(|d| d.fixed() == Some(0)) {
            return self.finish(Op::Identity, &[x]);
        }
        // Before opset 13: over the input flattened to 2-D at `axis`, then shaped back.
        let (flat, axis, rank) = if opset < 13 {
            (self.op("flat", Op::Flatten(FlattenAttrs { axis: from as i64 }), &[x]), 1, 2)
        } else {
            (x, from, self.rank)
        };
        let arg = ArgAttrs { axis: axis as i64, keepdims: true, select_last_index: false };
        let first = self.op("argmax", Op::ArgMax(arg), &[flat]);
        let size = self.dim("size", flat, axis);
        let positions = self.positions("position", size, axis, rank);
        let hot = self.op("hot", Op::Equal, &[first, positions]);
        let cast = Op::Cast(CastAttrs { saturate: true, to: self.dtype });
        if opset >= 13 {
            return self.finish(cast, &[hot]);
        }
        let y = self.op("hardmax2d", cast, &[hot]);
        let shape = self.op("x_shape", Op::Shape(ShapeAttrs::default()), &[x]);
        self.finish(Op::Reshape(Default::default()), &[y, shape])
    }

    fn lp_pool(&mut self, mut a: Attrs) -> Option<()> {
        let p = int(&mut a, "p", 2)?;
        if p < 1 || self.rank < 3 {
            return None;
        }
        let kernel = take::<Vec<i64>>(&mut a, "kernel_shape").ok()??;
        let size: i64 = kernel.iter().product();
        let mut pool: Attrs = a.into_iter().filter(|(k, _)| k != "count_include_pad").collect();
        let spatial: Option<Vec<u64>> = {
            let s = self.g.ty(self.x).shape.as_ref()?;
            s.dims()[2..].iter().map(|d| d.fixed()).collect()
        };
        // A window that runs past the padded input (ceil_mode, or a kernel larger than the input)
        // needs explicit end padding, so the input's spatial sizes: with symbolic ones the node
        // waits for the sizes a binding gives (written out when lowering).
        pool = explicit_pads(pool, &kernel, &spatial?)?;
        let mut powered = self.abs_pow(p);
        // A pad the window's dilated extent needs but no pool takes (at least the kernel): the
        // padding is zeros of the sum, written by a Pad before a pool that pads nothing.
        let pads = pool.iter().find_map(|(k, v)| match v {
            Attr::Ints(p) if k == "pads" => Some(p.clone()),
            _ => None,
        });
        if let Some(pads) = pads.filter(|p| p.iter().enumerate().any(|(i, &q)| q >= kernel[i % kernel.len()])) {
            let sp = kernel.len();
            let all: Vec<i64> = [&[0, 0][..], &pads[..sp], &[0, 0], &pads[sp..]].concat();
            let pads = self.ints("pads", &all);
            let pad = Op::Pad(mpc_ir::ops::PadAttrs { mode: mpc_ir::ops::PadMode::Constant });
            powered = self.op("padded", pad, &[powered, pads]);
            pool.retain(|(k, _)| k != "pads");
        }
        pool.push(("kernel_shape".into(), Attr::Ints(kernel)));
        pool.push(("count_include_pad".into(), Attr::Int(1)));
        let pool = Op::from_attrs("AveragePool", pool)?.ok()?;
        let mean = self.op("mean", pool, &[powered]);
        let count = self.scalar("window", size as f64);
        if p == 1 {
            return self.finish(Op::Mul, &[mean, count]);
        }
        let sum = self.op("sum", Op::Mul, &[mean, count]);
        if p == 2 {
            return self.finish(Op::Sqrt, &[sum]);
        }
        let root = self.scalar("root", 1.0 / p as f64);
        self.finish(Op::Pow, &[sum, root])
    }

    fn rms_norm(&mut self, a: &mut Attrs) -> Option<()> {
        let axis = self.axis(int(a, "axis", -1)?)?;
        let eps = float(a, "epsilon", 1e-5)? as f64;
        let stash = DType::from_onnx_code(int(a, "stash_type", 1)? as i32).ok().filter(|d| d.is_float())?;
        let scale = self.g.node(self.n).input(1)?;
        // Opset 23 lets the scale (and so Y) have a dtype of its own: that form stays as it is.
        if self.g.ty(scale).dtype != Some(self.dtype) {
            return None;
        }
        let (x, dtype) = (self.x, self.dtype);
        let xs = if stash == dtype {
            x
        } else {
            self.op("stashed", Op::Cast(CastAttrs { saturate: true, to: stash }), &[x])
        };
        self.dtype = stash;
        let axes: Vec<i64> = (axis as i64..self.rank as i64).collect();
        let axes = self.ints("axes", &axes);
        let square = self.op("square", Op::Mul, &[xs, xs]);
        let mean = self.op("mean_square", Op::ReduceMean(reduce(true)), &[square, axes]);
        let eps = self.scalar("epsilon", eps);
        let shifted = self.op("plus_epsilon", Op::Add, &[mean, eps]);
        let rms = self.op("rms", Op::Sqrt, &[shifted]);
        let inverse = self.op("inverse_rms", Op::Reciprocal, &[rms]);
        if stash == dtype {
            let y = self.op("normalized", Op::Mul, &[xs, inverse]);
            return self.finish(Op::Mul, &[y, scale]);
        }
        let scale = self.op("scale_stashed", Op::Cast(CastAttrs { saturate: true, to: stash }), &[scale]);
        let y = self.op("normalized", Op::Mul, &[xs, inverse]);
        let y = self.op("scaled", Op::Mul, &[y, scale]);
        self.finish(Op::Cast(CastAttrs { saturate: true, to: dtype }), &[y])
    }
}

/// An LpPool's pooling attributes with its pads made explicit for spatial sizes `sizes`, the end
/// padding grown to cover every window (ceil_mode's last window, a window past the input): its
/// taps there are zeros of the sum. `None` when that does not give the same windows.
fn explicit_pads(mut a: Attrs, kernel: &[i64], sizes: &[u64]) -> Option<Attrs> {
    let original = a.clone();
    let ints = |a: &mut Attrs, name: &str| take::<Vec<i64>>(a, name).ok().map(Option::unwrap_or_default);
    let (strides, dilations, pads) = (ints(&mut a, "strides")?, ints(&mut a, "dilations")?, ints(&mut a, "pads")?);
    let auto_pad = match take::<AutoPad>(&mut a, "auto_pad").ok()? {
        Some(p) => p,
        None => AutoPad::NotSet,
    };
    let ceil_mode = int(&mut a, "ceil_mode", 0)? == 1;
    let input: Vec<usize> = sizes.iter().map(|&s| s as usize).collect();
    let resolve = |pads: &[i64], auto_pad, ceil_mode| {
        let spec =
            WindowSpec { kernel, strides: &strides, dilations: &dilations, pads, auto_pad, ceil_mode, pool: true };
        spec.resolve(&input).ok()
    };
    let sp = kernel.len();
    let want = resolve(&pads, auto_pad, ceil_mode)?;
    if want.out.contains(&0) {
        return Some(original); // no window at all: the pool as given, whose output is empty
    }
    let mut explicit = vec![0i64; 2 * sp];
    for i in 0..sp {
        let extent = (want.kernel[i] - 1) * want.dilations[i] + 1;
        let reach = (want.out[i] - 1) * want.strides[i] + extent;
        let covered = sizes[i] as usize + want.pads_begin[i];
        explicit[i] = want.pads_begin[i] as i64;
        explicit[sp + i] = reach.saturating_sub(covered) as i64;
    }
    if resolve(&explicit, AutoPad::NotSet, false)?.out != want.out {
        return None;
    }
    for (name, v) in [("strides", strides), ("dilations", dilations), ("pads", explicit)] {
        if !v.is_empty() {
            a.push((name.into(), Attr::Ints(v)));
        }
    }
    Some(a)
}
