//! Older opset forms → the internal (newest) form.
//!
//! The ops whose form changed between opset 9 and 21: attributes that became inputs
//! (Squeeze/Unsqueeze/Reduce*/Split/Slice/Clip/Pad/Dropout), Softmax/LogSoftmax's 2-D coercion before
//! opset 13, BatchNormalization's training outputs before 14, Upsample and opset-10 Resize, Scatter
//! (ScatterElements before opset 11), Constant's `value_*` shorthands, and CastLike (a Cast to
//! its second input's dtype). Inputs made from
//! attributes become initializers named `{node}.{attribute}`.

use crate::attr::Attrs;
use crate::graph::{Graph, ValueId};
use crate::ops::{CoordinateMode, NearestMode, ResizeAttrs, ResizeMode, SoftmaxAttrs};
use crate::{Attr, DType, Op, Tensor};

pub(crate) struct Cx<'a> {
    pub g: &'a mut Graph,
    pub opset: i64,
    pub node: &'a str,
    pub inputs: &'a mut Vec<Option<ValueId>>,
    pub outputs: &'a mut Vec<ValueId>,
}

impl Cx<'_> {
    /// A name for things made on behalf of this node.
    fn base(&self) -> String {
        if !self.node.is_empty() {
            self.node.to_string()
        } else {
            self.outputs.first().map(|&o| self.g.name(o).to_string()).unwrap_or_default()
        }
    }

    /// Sets input `slot` to a new initializer holding `t`.
    fn const_input(&mut self, slot: usize, what: &str, t: Tensor) {
        let name = format!("{}.{what}", self.base());
        let v = self.g.add_initializer(&name, t);
        if self.inputs.len() <= slot {
            self.inputs.resize(slot + 1, None);
        }
        self.inputs[slot] = Some(v);
    }

    /// Moves an ints attribute to input `slot` as an i64 tensor.
    fn ints_to_input(&mut self, attrs: &mut Attrs, name: &str, slot: usize) -> Result<(), String> {
        if let Some(a) = take(attrs, name) {
            let Attr::Ints(v) = a else {
                return Err(format!("attribute `{name}` must be ints"));
            };
            self.const_input(slot, name, Tensor::from_i64(vec![v.len() as u64], &v));
        }
        Ok(())
    }

    /// Moves a float attribute to input `slot` as a scalar of the first input's dtype.
    fn float_to_input(
        &mut self,
        attrs: &mut Attrs,
        name: &str,
        slot: usize,
        skip_if: Option<f32>,
    ) -> Result<(), String> {
        if let Some(a) = take(attrs, name) {
            let Attr::Float(v) = a else {
                return Err(format!("attribute `{name}` must be a float"));
            };
            if Some(v) == skip_if {
                return Ok(());
            }
            let dtype = self.input_dtype().unwrap_or(DType::F32);
            self.const_input(slot, name, Tensor::from_f64_as(dtype, vec![], &[v as f64]));
        }
        Ok(())
    }

    fn input_dtype(&self) -> Option<DType> {
        self.inputs.first().copied().flatten().and_then(|v| self.g.ty(v).dtype)
    }

    fn input_rank(&self) -> Option<usize> {
        let v = self.inputs.first().copied().flatten()?;
        self.g.ty(v).shape.as_ref().map(|s| s.rank())
    }
}

/// Op types of older opsets that import as another op of the closed set.
/// Standard ops that are no internal op but import as one: renamed, or (DepthToSpace,
/// SpaceToDepth, OneHot) written as the ops they are made of.
pub(crate) const RENAMED: &[&str] = &["Upsample", "Scatter", "CastLike", "DepthToSpace", "SpaceToDepth", "OneHot"];

fn take(attrs: &mut Attrs, name: &str) -> Option<Attr> {
    let pos = attrs.iter().position(|(n, _)| n == name)?;
    Some(attrs.remove(pos).1)
}

/// Brings a standard-domain node to its internal form. `Ok(None)`: keep it opaque (a form mpc
/// does not model); `Err`: the node is invalid.
pub(crate) fn normalize(cx: &mut Cx, op_type: &str, mut attrs: Attrs) -> Result<Option<Op>, String> {
    let v = cx.opset;
    let op_type = match op_type {
        "Squeeze" | "Unsqueeze" if v < 13 => {
            cx.ints_to_input(&mut attrs, "axes", 1)?;
            op_type
        }
        name if Op::default_of(name).and_then(|op| op.axes_input_since()) > Some(v) => {
            cx.ints_to_input(&mut attrs, "axes", 1)?;
            op_type
        }
        "Split" if v < 13 => {
            cx.ints_to_input(&mut attrs, "split", 1)?;
            op_type
        }
        "Slice" if v < 10 => {
            for (slot, name) in [(1, "starts"), (2, "ends"), (3, "axes")] {
                cx.ints_to_input(&mut attrs, name, slot)?;
            }
            op_type
        }
        "Clip" if v < 11 => {
            cx.float_to_input(&mut attrs, "min", 1, None)?;
            cx.float_to_input(&mut attrs, "max", 2, None)?;
            op_type
        }
        "Pad" if v < 11 => {
            cx.ints_to_input(&mut attrs, "pads", 1)?;
            cx.float_to_input(&mut attrs, "value", 2, Some(0.0))?;
            op_type
        }
        "Dropout" if v < 12 => {
            if let Some(Attr::Float(r)) = take(&mut attrs, "ratio") {
                if r != 0.5 {
                    cx.const_input(1, "ratio", Tensor::from_f32(vec![], &[r]));
                }
            }
            op_type
        }
        "Softmax" | "LogSoftmax" if v < 13 => return softmax_2d(cx, op_type, attrs).map(Some),
        "BatchNormalization" if v < 14 => {
            take(&mut attrs, "spatial");
            take(&mut attrs, "is_test");
            let used = cx.outputs.iter().skip(3).any(|&o| !cx.g.name(o).is_empty());
            if used {
                return Ok(None); // saved mean / inverse std outputs: not in the internal form
            }
            cx.outputs.truncate(3);
            if cx.outputs.len() > 1 {
                attrs.push(("training_mode".into(), Attr::Int(1)));
            }
            op_type
        }
        "Upsample" => return upsample(cx, attrs, true),
        "TopK" if v < 10 => {
            if let Some(Attr::Int(k)) = take(&mut attrs, "k") {
                cx.const_input(1, "k", Tensor::from_i64(vec![1], &[k]));
            }
            op_type
        }
        "DepthToSpace" | "SpaceToDepth" => return pixel_shuffle(cx, op_type, attrs).map(Some),
        // RoiAlign-10 has no coordinate_transformation_mode: it samples as `output_half_pixel`.
        "RoiAlign" if v < 16 => {
            attrs.push(("coordinate_transformation_mode".into(), Attr::String("output_half_pixel".into())));
            op_type
        }
        "OneHot" => return one_hot(cx, attrs),
        // Opset 9-10 Scatter is ScatterElements under its old name (same inputs, same `axis`).
        "Scatter" => "ScatterElements",
        "Resize" if v < 11 => return upsample(cx, attrs, false),
        "Constant" => {
            let shorthand = ["value_float", "value_floats", "value_int", "value_ints"];
            if let Some(i) = attrs.iter().position(|(n, _)| shorthand.contains(&n.as_str())) {
                let t = match attrs.remove(i).1 {
                    Attr::Float(f) => Tensor::from_f32(vec![], &[f]),
                    Attr::Floats(f) => Tensor::from_f32(vec![f.len() as u64], &f),
                    Attr::Int(n) => Tensor::scalar_i64(n),
                    Attr::Ints(n) => Tensor::from_i64(vec![n.len() as u64], &n),
                    _ => return Err("Constant shorthand attribute of the wrong kind".into()),
                };
                attrs.push(("value".into(), Attr::Tensor(t)));
            }
            op_type
        }
        // CastLike (opset 15; torch's dynamo exporter without its optimizer writes it for every
        // `.to(x.dtype)`) is a Cast to the second input's dtype, where the import knows it.
        "CastLike" => {
            let like = cx.inputs.get(1).copied().flatten();
            let dtype = |v: ValueId| cx.g.ty(v).dtype.or_else(|| cx.g.constant(v).map(|t| t.dtype()));
            let Some(to) = like.and_then(dtype) else { return Ok(None) };
            if matches!(take(&mut attrs, "round_mode"), Some(Attr::String(m)) if m != "up") {
                return Ok(None);
            }
            cx.inputs.truncate(1);
            attrs.push(("to".into(), Attr::Int(to.onnx_code() as i64)));
            "Cast"
        }
        // Opset 18-20 GroupNormalization has per-group scale/bias; opset 21 per-channel.
        "GroupNormalization" if v < 21 => return Ok(None),
        _ => op_type,
    };
    // The attributes passed the op's schema: one the internal form does not model keeps the node
    // opaque; a value the internal form cannot take (a boolean of 2, an unknown mode) is an error.
    match Op::from_attrs(op_type, attrs) {
        Some(Ok(op)) => Ok(Some(op)),
        Some(Err(e)) if !e.starts_with("unknown attribute") => Err(e),
        _ => Ok(None),
    }
}

/// Softmax before opset 13 flattens the input to 2-D at `axis` (default 1). When `axis` is the
/// last dim that is today's Softmax; otherwise: Reshape(Softmax(Flatten(x, axis)), Shape(x)).
fn softmax_2d(cx: &mut Cx, op_type: &str, mut attrs: Attrs) -> Result<Op, String> {
    let axis = match take(&mut attrs, "axis") {
        Some(Attr::Int(a)) => a,
        None => 1,
        Some(_) => return Err("attribute `axis` must be an int".into()),
    };
    crate::attr::no_more_attrs(&attrs)?;
    let make = |a: i64| match op_type {
        "Softmax" => Op::Softmax(SoftmaxAttrs { axis: a }),
        _ => Op::LogSoftmax(SoftmaxAttrs { axis: a }),
    };
    let last = axis == -1 || cx.input_rank().is_some_and(|r| r as i64 - 1 == axis);
    if last {
        return Ok(make(-1));
    }
    let x = cx.inputs.first().copied().flatten().ok_or("missing input")?;
    let base = cx.base();
    let flatten = Op::Flatten(crate::ops::FlattenAttrs { axis });
    let (_, f) = cx.g.add_op(&format!("{base}.flatten"), flatten, &[Some(x)], 1);
    let (_, s) = cx.g.add_op(&format!("{base}.shape"), Op::Shape(Default::default()), &[Some(x)], 1);
    let (_, y) = cx.g.add_op(&format!("{base}.{}2d", op_type.to_lowercase()), make(-1), &[Some(f[0])], 1);
    *cx.inputs = vec![Some(y[0]), Some(s[0])];
    Ok(Op::Reshape(Default::default()))
}

/// DepthToSpace and SpaceToDepth as the spec writes them: `Reshape(Transpose(Reshape(x, t1),
/// perm), t2)`, the shapes computed from `Shape(x)` so that any dim may be symbolic (the node
/// becomes the last Reshape; gradients and kernels are the three ops'). With `b` the blocksize
/// and x `[N, C, H, W]`:
/// - DepthToSpace DCR: `[N, b, b, C/b², H, W]`, perm `[0, 3, 4, 1, 5, 2]`, then `[N, C/b², H·b, W·b]`;
///   CRD: `[N, C/b², b, b, H, W]`, perm `[0, 1, 4, 2, 5, 3]`, the same result shape;
/// - SpaceToDepth: `[N, C, H/b, b, W/b, b]`, perm `[0, 3, 5, 1, 2, 4]`, then `[N, C·b², H/b, W/b]`.
fn pixel_shuffle(cx: &mut Cx, op_type: &str, mut attrs: Attrs) -> Result<Op, String> {
    let b = match take(&mut attrs, "blocksize") {
        Some(Attr::Int(b)) if b >= 1 => b,
        Some(Attr::Int(b)) => return Err(format!("blocksize is {b}; it must be at least 1")),
        _ => return Err("attribute `blocksize` is required".into()),
    };
    let crd = match take(&mut attrs, "mode") {
        Some(Attr::String(m)) if m == "CRD" && op_type == "DepthToSpace" => true,
        Some(Attr::String(m)) if m == "DCR" => false,
        None => false,
        Some(m) => return Err(format!("mode {m:?} is neither DCR nor CRD")),
    };
    crate::attr::no_more_attrs(&attrs)?;
    if cx.input_rank().is_some_and(|r| r != 4) {
        return Err(format!("the input has rank {}; {op_type} takes [N, C, H, W]", cx.input_rank().unwrap_or(0)));
    }
    let x = cx.inputs.first().copied().flatten().ok_or("missing input")?;
    let base = cx.base();
    let g = &mut *cx.g;
    let konst = |g: &mut Graph, what: &str, v: i64| {
        g.add_initializer(&format!("{base}.{what}"), Tensor::from_i64(vec![1], &[v]))
    };
    let (_, s) = g.add_op(&format!("{base}.shape"), Op::Shape(Default::default()), &[Some(x)], 1);
    let dims: Vec<ValueId> = ["n", "c", "h", "w"]
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let at = konst(g, &format!("{d}_at"), i as i64);
            g.add_op(&format!("{base}.{d}"), Op::Gather(Default::default()), &[Some(s[0]), Some(at)], 1).1[0]
        })
        .collect();
    let (n, c, h, w) = (dims[0], dims[1], dims[2], dims[3]);
    let (bv, bb) = (konst(g, "block", b), konst(g, "block_area", b * b));
    let arith = |g: &mut Graph, name: &str, op: Op, a: ValueId, z: ValueId| {
        g.add_op(&format!("{base}.{name}"), op, &[Some(a), Some(z)], 1).1[0]
    };
    let concat = |g: &mut Graph, name: &str, parts: &[ValueId]| {
        let ins: Vec<Option<ValueId>> = parts.iter().map(|&v| Some(v)).collect();
        g.add_op(&format!("{base}.{name}"), Op::Concat(crate::ops::ConcatAttrs { axis: 0 }), &ins, 1).1[0]
    };
    let (t1, perm, t2) = if op_type == "DepthToSpace" {
        let c2 = arith(g, "c_out", Op::Div, c, bb);
        let (h2, w2) = (arith(g, "h_out", Op::Mul, h, bv), arith(g, "w_out", Op::Mul, w, bv));
        let t2 = concat(g, "shape_out", &[n, c2, h2, w2]);
        if crd {
            (concat(g, "shape_in", &[n, c2, bv, bv, h, w]), vec![0, 1, 4, 2, 5, 3], t2)
        } else {
            (concat(g, "shape_in", &[n, bv, bv, c2, h, w]), vec![0, 3, 4, 1, 5, 2], t2)
        }
    } else {
        let c2 = arith(g, "c_out", Op::Mul, c, bb);
        let (h2, w2) = (arith(g, "h_out", Op::Div, h, bv), arith(g, "w_out", Op::Div, w, bv));
        (
            concat(g, "shape_in", &[n, c, h2, bv, w2, bv]),
            vec![0, 3, 5, 1, 2, 4],
            concat(g, "shape_out", &[n, c2, h2, w2]),
        )
    };
    // allowzero: a computed dim of 0 (an empty batch or image) is a size, not "copy this dim".
    let exact = || Op::Reshape(crate::ops::ReshapeAttrs { allowzero: true });
    let (_, r) = g.add_op(&format!("{base}.blocks"), exact(), &[Some(x), Some(t1)], 1);
    let transpose = Op::Transpose(crate::ops::TransposeAttrs { perm: Some(perm) });
    let (_, t) = g.add_op(&format!("{base}.moved"), transpose, &[Some(r[0])], 1);
    *cx.inputs = vec![Some(t[0]), Some(t2)];
    Ok(exact())
}

/// OneHot(indices, depth, values) as `Where(Equal(Unsqueeze(i, axis), positions), on, off)`: `i`
/// the indices as int64 with a negative one counted from `depth` (one outside [-depth, depth) then
/// matches no position: all off), `positions` `Range(0, depth)` shaped to run along `axis`, `off`
/// and `on` `values[0]` and `values[1]`. The positions' trailing 1s are counted from the
/// indices' rank where the import does not know it (`Size(Shape(indices)) - axis` of them).
fn one_hot(cx: &mut Cx, mut attrs: Attrs) -> Result<Option<Op>, String> {
    let axis = match take(&mut attrs, "axis") {
        Some(Attr::Int(a)) => a,
        None => -1,
        Some(_) => return Err("attribute `axis` must be an int".into()),
    };
    crate::attr::no_more_attrs(&attrs)?;
    let out_rank = cx.input_rank().map(|r| r as i64 + 1);
    // Dims after `axis` in the output: the positions' trailing 1s (None: counted in the graph).
    let after = match (axis, out_rank) {
        (a, _) if a < 0 => Some(-a - 1),
        (a, Some(r)) if a < r => Some(r - 1 - a),
        (a, Some(r)) => return Err(format!("axis {a} is outside an output of rank {r}")),
        (_, None) => None,
    };
    let input = |i: usize| cx.inputs.get(i).copied().flatten().ok_or(format!("input {i} is missing"));
    let (indices, depth, values) = (input(0)?, input(1)?, input(2)?);
    let base = cx.base();
    let g = &mut *cx.g;
    let op = |g: &mut Graph, name: &str, op: Op, ins: &[ValueId]| {
        let ins: Vec<Option<ValueId>> = ins.iter().map(|&v| Some(v)).collect();
        g.add_op(&format!("{base}.{name}"), op, &ins, 1).1[0]
    };
    let konst = |g: &mut Graph, what: &str, t: Tensor| g.add_initializer(&format!("{base}.{what}"), t);
    let to_i64 = || Op::Cast(crate::ops::CastAttrs { saturate: true, to: DType::I64 });
    let i = op(g, "indices", to_i64(), &[indices]);
    let d = op(g, "depth_i64", to_i64(), &[depth]);
    let (zero, one) = (konst(g, "zero", Tensor::scalar_i64(0)), konst(g, "one", Tensor::scalar_i64(1)));
    let scalar = konst(g, "scalar", Tensor::from_i64(vec![0], &[]));
    let d = op(g, "depth", Op::Reshape(Default::default()), &[d, scalar]);
    let negative = op(g, "negative", Op::Less, &[i, zero]);
    let wrapped = op(g, "wrapped", Op::Add, &[i, d]);
    let i = op(g, "counted", Op::Where, &[negative, wrapped, i]);
    let axes = konst(g, "axis", Tensor::from_i64(vec![1], &[axis]));
    let i = op(g, "along", Op::Unsqueeze, &[i, axes]);
    let positions = op(g, "positions", Op::Range, &[zero, d, one]);
    let shape = match after {
        Some(after) => {
            let shape: Vec<i64> = std::iter::once(-1).chain(std::iter::repeat_n(1, after as usize)).collect();
            konst(g, "positions_shape", Tensor::from_i64(vec![shape.len() as u64], &shape))
        }
        None => {
            let dims = op(g, "indices_shape", Op::Shape(Default::default()), &[indices]);
            let rank = op(g, "indices_rank", Op::Size, &[dims]);
            let at = konst(g, "axis_scalar", Tensor::scalar_i64(axis));
            let after = op(g, "after", Op::Sub, &[rank, at]);
            let count = konst(g, "count_shape", Tensor::from_i64(vec![1], &[1]));
            let after = op(g, "after_1d", Op::Reshape(Default::default()), &[after, count]);
            let fill = crate::ops::ConstantOfShapeAttrs { value: Some(Tensor::from_i64(vec![1], &[1])) };
            let ones = op(g, "ones", Op::ConstantOfShape(Box::new(fill)), &[after]);
            let head = konst(g, "positions_head", Tensor::from_i64(vec![1], &[-1]));
            op(g, "positions_shape", Op::Concat(crate::ops::ConcatAttrs { axis: 0 }), &[head, ones])
        }
    };
    let positions = op(g, "positions_along", Op::Reshape(Default::default()), &[positions, shape]);
    let hot = op(g, "hot", Op::Equal, &[i, positions]);
    let off = op(g, "off", Op::Gather(Default::default()), &[values, zero]);
    let on = op(g, "on", Op::Gather(Default::default()), &[values, one]);
    *cx.inputs = vec![Some(hot), Some(on), Some(off)];
    Ok(Some(Op::Where))
}

/// Upsample (opset 9) and Resize-10 → Resize: inputs (X, roi, scales), asymmetric coordinates.
/// Their "nearest" rounds down when upsampling and up when downsampling, so with constant scales
/// it becomes `nearest_mode` floor or ceil; mixed or unknown scales stay opaque.
fn upsample(cx: &mut Cx, mut attrs: Attrs, is_upsample: bool) -> Result<Option<Op>, String> {
    let mode = match take(&mut attrs, "mode") {
        Some(Attr::String(m)) => m,
        None => "nearest".into(),
        Some(_) => return Err("attribute `mode` must be a string".into()),
    };
    if !attrs.is_empty() || cx.inputs.len() != 2 {
        return Ok(None);
    }
    let mut nearest_mode = NearestMode::Floor;
    if mode == "nearest" && !is_upsample {
        let scales = cx.inputs[1].and_then(|s| cx.g.constant(s)).map(|t| t.to_f64_vec());
        match scales {
            Some(s) if s.iter().all(|&x| x >= 1.0) => {}
            Some(s) if s.iter().all(|&x| x <= 1.0) => nearest_mode = NearestMode::Ceil,
            _ => return Ok(None),
        }
    }
    let mode = match mode.as_str() {
        "nearest" => ResizeMode::Nearest,
        "linear" | "bilinear" => ResizeMode::Linear,
        _ => return Ok(None),
    };
    let scales = cx.inputs[1];
    *cx.inputs = vec![cx.inputs[0], None, scales];
    Ok(Some(Op::Resize(Box::new(ResizeAttrs {
        coordinate_transformation_mode: CoordinateMode::Asymmetric,
        nearest_mode,
        mode,
        ..Default::default()
    }))))
}
