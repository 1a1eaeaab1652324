//! Type and shape inference.
//!
//! Walks the graph in topological order and computes every typed op's output dtypes and shapes
//! from its inputs (one exhaustive `match` in [`rules`]). Shapes carry symbolic dims (`batch`):
//! broadcasting a symbol against a fixed size > 1 takes the size, two different symbols give an
//! unknown dim. Small integer tensors are also tracked as values whose elements may be symbolic
//! ([`Known`]), so the `Shape → Gather → Unsqueeze → Concat → Reshape` chains that exporters emit
//! for a dynamic batch still give `Reshape` a precise output shape.
//!
//! Inferred types replace what the graph said, except that a declared fixed size or symbol fills an
//! inferred unknown dim. Opaque ops keep their declared output types. A typed op whose inputs make
//! no sense (a Reshape whose element count cannot match, mismatched dtypes, a bad axis) is an
//! error naming the node.

mod indexing;
mod known;
mod movement;
mod nn;
mod rules;

use mpc_ir::{Dim, Graph, Op, Shape, TypeInfo};

pub(crate) use known::{const_ints, Elem};

use crate::{Changed, Context, Pass, PassError, Result};

pub struct InferTypes;

impl Pass for InferTypes {
    fn name(&self) -> &'static str {
        "infer-types"
    }

    fn run(&self, g: &mut Graph, _cx: &Context) -> Result<Changed> {
        let before: Vec<TypeInfo> = g.value_ids().map(|v| g.ty(v).clone()).collect();
        infer_types(g)?;
        let changed = g.value_ids().any(|v| *g.ty(v) != before[v.index()]);
        Ok(if changed { Changed::Yes } else { Changed::No })
    }
}

/// Infers the types of every node output in place.
pub fn infer_types(g: &mut Graph) -> Result<()> {
    let order = g.topo_order()?;
    infer_types_in(g, &order, None)
}

/// Infers the types of the outputs of the nodes that `retype` selects (every node when `None`),
/// visiting the nodes in `order` (a topological order). The known values of the nodes left as
/// they are still flow into the ones retyped, so retyping only the nodes a pass added gives the
/// same types as inferring the whole graph again.
pub(crate) fn infer_types_in(
    g: &mut Graph,
    order: &[mpc_ir::NodeId],
    retype: Option<&dyn Fn(mpc_ir::NodeId) -> bool>,
) -> Result<()> {
    let mut known = known::KnownValues::new(g);
    for &n in order {
        if let Op::Opaque(o) = &g.node(n).op {
            // Subgraphs read outer values whose types inference may have changed: they must
            // still be valid bodies (an If branch subtracting f32 from a value now u8 is not).
            if retype.is_none_or(|r| r(n)) {
                let node = g.node_label(n);
                mpc_ir::onnx::check_subgraphs(&o.attrs, g)
                    .map_err(|msg| PassError::Node { node: node.clone(), msg })?;
                check_dtypes(g, n).map_err(|msg| PassError::Node { node, msg })?;
                // The one opaque op the runtime computes, onnxruntime's element-wise Gelu, has
                // one input and one output, of its input's type as any element-wise op, whatever
                // its file declared.
                if o.domain == "com.microsoft" && o.op_type == "Gelu" {
                    let (ins, outs) = (g.node(n).inputs(), g.node(n).outputs());
                    let &[Some(x)] = ins else {
                        let msg = match ins {
                            [] | [None] => "com.microsoft::Gelu: its input is missing".to_string(),
                            _ => format!("com.microsoft::Gelu takes one input, not {}", ins.len()),
                        };
                        return Err(PassError::Node { node: g.node_label(n), msg });
                    };
                    let &[y] = outs else {
                        let msg = format!("com.microsoft::Gelu gives one output, not {}", outs.len());
                        return Err(PassError::Node { node: g.node_label(n), msg });
                    };
                    let merged = merge(g.ty(y), g.ty(x).clone());
                    g.set_ty(y, merged);
                }
            }
            continue;
        }
        if retype.is_some_and(|r| !r(n)) {
            for (slot, &v) in g.node(n).outputs().iter().enumerate() {
                if let Some(k) = known::propagate(g, n, slot, &known) {
                    known.set(v, k);
                }
            }
            continue;
        }
        let outs = {
            let cx = rules::NodeCx { g, n, known: &known };
            rules::infer_node(&cx).map_err(|msg| PassError::Node { node: g.node_label(n), msg })?
        };
        let outputs = g.node(n).outputs().to_vec();
        for (slot, (&v, ty)) in outputs.iter().zip(outs).enumerate() {
            let merged = merge(g.ty(v), ty);
            g.set_ty(v, merged);
            if let Some(k) = known::propagate(g, n, slot, &known) {
                known.set(v, k);
            }
        }
        check_dtypes(g, n).map_err(|msg| PassError::Node { node: g.node_label(n), msg })?;
    }
    Ok(())
}

/// The input dtypes of a standard node against its op's type constraints (the readers check
/// what they can see; here every dtype is known): an op and dtype that ONNX does not define is
/// refused before a file with it is written.
fn check_dtypes(g: &Graph, n: mpc_ir::NodeId) -> std::result::Result<(), String> {
    let node = g.node(n);
    // An opaque op of the standard domain: its explicit inputs (the rest are what its subgraphs
    // read); its outputs keep the types its file declared.
    let (inputs, outputs) = match &node.op {
        Op::Opaque(o) if o.domain.is_empty() || o.domain == "ai.onnx" => {
            (&node.inputs()[..o.explicit_inputs.min(node.inputs().len())], &[][..])
        }
        op if op.is_opaque() || op.is_mpc() => return Ok(()),
        _ => (node.inputs(), node.outputs()),
    };
    let Some(schema) = mpc_ir::onnx::schema::newest(node.op.op_type()) else { return Ok(()) };
    let sig: Vec<(bool, Option<mpc_ir::DType>)> =
        inputs.iter().map(|v| (v.is_some(), v.and_then(|v| g.ty(v).dtype))).collect();
    let outs: Vec<Option<mpc_ir::DType>> = outputs.iter().map(|&v| g.ty(v).dtype).collect();
    schema.check_types(&sig, &outs).map_err(|e| format!("{} (opset {}): {e}", schema.op, schema.since))
}

/// Checks every typed node's output dtypes against its rule applied to its current input types.
/// Node by node in topological order this is the same as inferring from scratch, without a copy
/// of the graph.
pub fn check_types(g: &Graph, order: &[mpc_ir::NodeId]) -> Result<(), String> {
    let mut known = known::KnownValues::new(g);
    for &n in order {
        if g.node(n).op.is_opaque() {
            continue;
        }
        let cx = rules::NodeCx { g, n, known: &known };
        let inferred = rules::infer_node(&cx).map_err(|msg| format!("node {}: {msg}", g.node_label(n)))?;
        for (slot, (&v, ty)) in g.node(n).outputs().iter().zip(inferred).enumerate() {
            let have = g.ty(v).dtype;
            if have.is_some() && ty.dtype.is_some() && have != ty.dtype {
                return Err(format!(
                    "value `{}` is typed {} but its producer {} gives {}",
                    g.name(v),
                    g.ty(v),
                    g.node_label(n),
                    ty
                ));
            }
            if let Some(k) = known::propagate(g, n, slot, &known) {
                known.set(v, k);
            }
        }
    }
    Ok(())
}

/// The inferred type, with unknown dims filled from what was declared.
fn merge(declared: &TypeInfo, inferred: TypeInfo) -> TypeInfo {
    let dtype = inferred.dtype.or(declared.dtype);
    let shape = match (inferred.shape, &declared.shape) {
        (Some(i), Some(d)) if i.rank() == d.rank() => Some(Shape(
            i.0.into_iter()
                .zip(&d.0)
                .map(|(i, d)| match (&i, d) {
                    (Dim::Unknown, _) => d.clone(),
                    (Dim::Sym(_), Dim::Fixed(_)) => d.clone(),
                    _ => i,
                })
                .collect(),
        )),
        (Some(i), _) => Some(i),
        (None, d) => d.clone(),
    };
    TypeInfo { dtype, shape }
}

/// `axis` of a value of shape `s`, counted from the end when negative.
pub(super) fn axis_in(axis: i64, s: &mpc_ir::Shape) -> std::result::Result<usize, String> {
    mpc_ir::normalize_axis(axis, s.rank()).ok_or(format!("axis {axis} out of range for rank {}", s.rank()))
}

/// Input `i`, where given and its shape known, holds one value (a scalar operand: Pad's constant,
/// Clip's bounds, Dropout's ratio).
pub(super) fn one_value(cx: &rules::NodeCx, i: usize, what: &str) -> std::result::Result<(), String> {
    match cx.sh(i).filter(|s| s.as_fixed().is_some()) {
        Some(s) if s.numel() != Some(1) => Err(format!("{what} is {s}, not one value")),
        _ => Ok(()),
    }
}
