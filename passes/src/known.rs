//! Values known without running the graph: the scalars and shape vectors that exporters compute
//! from constants and static dims (a head's scale, a dim taken from a Shape).

use mpc_ir::{DType, Def, Graph, Op, ValueId};

/// The value of a scalar computed from constants and static dims, as exporters write a head's
/// scale (PyTorch: `Pow(Cast(Div(Gather(Shape(x), 2), heads)), -0.5)`, and its
/// scaled_dot_product_attention `Sqrt(Div(1, Sqrt(Cast(Slice(Shape(q), -1)))))`): constants (a
/// Constant node, or an initializer that is a scalar or integer: a one-element float initializer
/// of rank 1 or more may be a parameter that training changes), one fixed dim of a Shape taken by
/// Gather or Slice ([`ints`]), Cast (rounded to a 16-bit float, truncated to an integer), Div
/// (integer division for integers), Mul, Pow, Sqrt and Reciprocal. `None` for anything else.
pub(crate) fn scalar(g: &Graph, v: ValueId) -> Option<f64> {
    fn eval(g: &Graph, v: ValueId, depth: usize) -> Option<f64> {
        if let Some(t) = g.constant(v) {
            let fixed = matches!(g.value(v).def(), Def::Node(..)) || t.shape().is_empty() || !t.dtype().is_float();
            let x = t.to_f64_vec();
            return (fixed && x.len() == 1).then(|| x[0]);
        }
        if depth == 0 {
            return None;
        }
        let (p, 0) = g.value(v).producer()? else { return None };
        let node = g.node(p);
        let arg = |i: usize| node.input(i).and_then(|u| eval(g, u, depth - 1));
        let dt = g.ty(v).dtype?;
        let int = !dt.is_float();
        let x = match &node.op {
            Op::Cast(_) => match dt {
                DType::F16 => half::f16::from_f64(arg(0)?).to_f64(),
                DType::BF16 => half::bf16::from_f64(arg(0)?).to_f64(),
                DType::F32 => arg(0)? as f32 as f64,
                DType::F64 => arg(0)?,
                DType::Bool => return None,
                _ => arg(0)?,
            },
            Op::Div if int => {
                let (a, b) = (arg(0)?, arg(1)?);
                (b != 0.0).then(|| (a / b).trunc())?
            }
            Op::Div => arg(0)? / arg(1)?,
            Op::Mul => arg(0)? * arg(1)?,
            Op::Pow => arg(0)?.powf(arg(1)?),
            Op::Sqrt => arg(0)?.sqrt(),
            Op::Reciprocal => 1.0 / arg(0)?,
            // One entry of a Shape's fixed dims, by Gather or Slice.
            Op::Gather(_) | Op::Slice => match ints(g, v, depth)?[..] {
                [Some(x)] => x as f64,
                _ => return None,
            },
            _ => return None,
        };
        Some(if int { x.trunc() } else { x })
    }
    eval(g, v, 16).filter(|x| x.is_finite())
}

/// The values of a float vector that constants decide: a constant, or a Concat of such vectors
/// (the exporters write Resize's scales as `Concat(Constant [1, 1], Constant [2])`).
pub(crate) fn floats(g: &Graph, v: ValueId) -> Option<Vec<f64>> {
    if let Some(t) = g.constant(v) {
        return Some(t.to_f64_vec());
    }
    let (n, _) = g.value(v).producer()?;
    match &g.node(n).op {
        Op::Concat(_) => {
            g.node(n).inputs().iter().map(|p| floats(g, (*p)?)).collect::<Option<Vec<_>>>().map(|p| p.concat())
        }
        _ => None,
    }
}

/// The integers of `v` where they are known without running the graph, entry by entry: a
/// constant integer tensor (flattened), a Shape's dims (its `start` and `end`; a negative one
/// counts from the end; a symbolic dim unknown), and a Gather (axis 0) or a Slice (axis 0,
/// positive steps) of such a vector by constant indices. `None` for anything else.
pub(crate) fn ints(g: &Graph, v: ValueId, depth: usize) -> Option<Vec<Option<i64>>> {
    if let Some(t) = g.constant(v) {
        // (A vector or a scalar: Gather and Slice below take axis 0 of a vector.)
        let vector = !t.dtype().is_float() && t.shape().len() <= 1;
        return vector.then(|| t.to_f64_vec().into_iter().map(|x| Some(x as i64)).collect());
    }
    if depth == 0 {
        return None;
    }
    let (p, 0) = g.value(v).producer()? else { return None };
    let node = g.node(p);
    let arg = |i: usize| node.input(i).and_then(|u| ints(g, u, depth - 1));
    // Constant indices: every entry known.
    let known = |i: usize| arg(i)?.into_iter().collect::<Option<Vec<i64>>>();
    // An index into `len` entries (negative from the end), clamped to [0, len] as Slice's are.
    let clamp =
        |e: i64, len: usize| (if e < 0 { e.saturating_add(len as i64) } else { e }).clamp(0, len as i64) as usize;
    match &node.op {
        Op::Shape(a) => {
            let dims = g.ty(node.input(0)?).shape.as_ref()?.dims().to_vec();
            let (start, end) = (clamp(a.start, dims.len()), clamp(a.end.unwrap_or(dims.len() as i64), dims.len()));
            Some(dims.get(start..end.max(start))?.iter().map(|d| d.fixed().map(|x| x as i64)).collect())
        }
        Op::Gather(a) if a.axis == 0 => {
            let (data, idx) = (arg(0)?, known(1)?);
            let n = data.len() as i64;
            idx.iter().map(|&i| data.get(usize::try_from(if i < 0 { i + n } else { i }).ok()?).copied()).collect()
        }
        Op::Slice => {
            let data = arg(0)?;
            let (starts, ends) = (known(1)?, known(2)?);
            let axes = if node.input(3).is_some() { known(3)? } else { vec![0] };
            let steps = if node.input(4).is_some() { known(4)? } else { vec![1] };
            if starts.len() != 1
                || ends.len() != 1
                || !matches!(axes[..], [0] | [-1])
                || !matches!(steps[..], [s] if s > 0)
            {
                return None;
            }
            let (start, end, step) = (clamp(starts[0], data.len()), clamp(ends[0], data.len()), steps[0] as usize);
            Some(data.get(start..end.max(start))?.iter().step_by(step).copied().collect())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpc_ir::ops::CastAttrs;
    use mpc_ir::{Shape, TypeInfo};

    /// A head's scale from a Shape's slice and a negative index, as exporters write it; a
    /// one-element parameter is no constant.
    #[test]
    fn scalar_reads_shape_slices_and_refuses_parameters() {
        let mut g = Graph::new("g");
        let q = g.add_input("q", TypeInfo::new(DType::F16, Shape::fixed(&[2, 3, 8, 4])));
        let shape = Op::Shape(mpc_ir::ops::ShapeAttrs { end: None, start: 1 });
        let dims = g.add_op("dims", shape, &[Some(q)], 1).1[0];
        let last = g.add_initializer("last", mpc_ir::Tensor::from_i64(vec![], &[-1]));
        let d = g.add_op("d", Op::Gather(Default::default()), &[Some(dims), Some(last)], 1).1[0];
        let df = g.add_op("df", Op::Cast(CastAttrs { saturate: true, to: DType::F32 }), &[Some(d)], 1).1[0];
        let half = g.add_initializer("half", mpc_ir::Tensor::from_f64_as(DType::F32, vec![], &[-0.5]));
        let scale = g.add_op("scale", Op::Pow, &[Some(df), Some(half)], 1).1[0];
        let t = g.add_initializer("t", mpc_ir::Tensor::from_f64_as(DType::F32, vec![1], &[0.5]));
        crate::infer_types(&mut g).unwrap();
        assert_eq!(scalar(&g, scale), Some(0.5));
        assert_eq!(scalar(&g, t), None);
        // A constant of rank 2 is no vector to index: [[4, 5, 6]][0] is a row, not 4.
        let m = g.add_initializer("m", mpc_ir::Tensor::from_i64(vec![1, 3], &[4, 5, 6]));
        let zero = g.add_initializer("zero", mpc_ir::Tensor::from_i64(vec![], &[0]));
        let row = g.add_op("row", Op::Gather(Default::default()), &[Some(m), Some(zero)], 1).1[0];
        crate::infer_types(&mut g).unwrap();
        assert_eq!((ints(&g, row, 4), scalar(&g, row)), (None, None));
    }
}
