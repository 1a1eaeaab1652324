//! A sequence that only holds the pieces of a split is a Split.
//!
//! torch's dynamo exporter without its optimizer (`torch.onnx.export(..., dynamo=True,
//! optimize=False)`, which keeps every parameter of a freshly initialised model that the optimizer
//! would fold or merge) writes `torch.split` as `SplitToSequence` read by `SequenceAt` at constant
//! positions. mpc has no sequence values; such a group becomes one `Split` (and a `Squeeze` of
//! each piece where `keepdims` is 0), the pieces keeping the names the `SequenceAt`s gave them.
//! Any other use of a sequence stays opaque.

use crate::attr::Attr;
use crate::graph::{Graph, NodeId};
use crate::ops::SplitAttrs;
use crate::{normalize_axis, Op, Tensor};

/// Rewrites every `SplitToSequence` that can be a Split (see the module's documentation); a
/// sequence named in `outputs` (the graph's outputs, which import attaches by name afterwards)
/// stays. Returns the nodes removed.
pub(super) fn split_sequences(g: &mut Graph, outputs: &[&str]) -> Vec<NodeId> {
    let splits: Vec<NodeId> = g.node_ids().filter(|&n| opaque(g, n, "SplitToSequence")).collect();
    let mut removed = Vec::new();
    for n in splits {
        rewrite(g, n, outputs, &mut removed);
    }
    removed
}

fn opaque(g: &Graph, n: NodeId, op_type: &str) -> bool {
    matches!(&g.node(n).op, Op::Opaque(o) if o.op_type == op_type && (o.domain.is_empty() || o.domain == "ai.onnx"))
}

fn int_attr(g: &Graph, n: NodeId, name: &str, default: i64) -> Option<i64> {
    let Op::Opaque(o) = &g.node(n).op else { return None };
    match o.attrs.iter().find(|(k, _)| k == name) {
        None => Some(default),
        Some((_, Attr::Int(v))) => Some(*v),
        Some(_) => None,
    }
}

fn rewrite(g: &mut Graph, n: NodeId, outputs: &[&str], removed: &mut Vec<NodeId>) -> Option<()> {
    let (axis, keepdims) = (int_attr(g, n, "axis", 0)?, int_attr(g, n, "keepdims", 1)?);
    let node = g.node(n);
    let (x, split, seq) = (node.input(0)?, node.input(1), *node.outputs().first()?);
    if outputs.contains(&g.name(seq)) || g.name_is_referenced(seq) {
        return None;
    }
    // The pieces' sizes along the axis.
    let shape = g.ty(x).shape.clone()?;
    let axis = normalize_axis(axis, shape.rank())?;
    let dim = shape.dims()[axis].fixed()? as i64;
    let sizes: Vec<i64> = match split {
        None => vec![1; dim as usize],
        Some(s) => {
            let t = g.constant(s)?;
            let v = t.to_i64_vec()?;
            match (t.shape().len(), &v[..]) {
                (0, &[chunk]) if chunk > 0 => {
                    let mut sizes = vec![chunk; (dim / chunk) as usize];
                    if dim % chunk != 0 {
                        sizes.push(dim % chunk);
                    }
                    sizes
                }
                (1, _) if v.iter().all(|&x| x >= 0) && v.iter().sum::<i64>() == dim => v,
                _ => return None,
            }
        }
    };
    // keepdims applies only without `split`.
    let squeeze = keepdims == 0 && split.is_none();
    // Every reader a SequenceAt at a constant position.
    let count = sizes.len() as i64;
    let mut reads = Vec::new();
    for u in g.value(seq).uses() {
        let r = u.node;
        let position = g.node(r).input(1).and_then(|p| g.constant(p)).and_then(|t| t.to_i64_vec());
        let (true, 0, Some(&[p])) = (opaque(g, r, "SequenceAt"), u.slot, position.as_deref()) else { return None };
        let p = if p < 0 { p + count } else { p };
        let out = *g.node(r).outputs().first()?;
        if !(0..count).contains(&p) || g.name_is_referenced(out) {
            return None;
        }
        reads.push((r, p as usize, out));
    }
    let base = if g.node(n).name.is_empty() { g.name(seq).to_string() } else { g.node(n).name.clone() };
    let sizes_name = g.unique_name(&format!("{base}.sizes"));
    let sizes = g.add_initializer(&sizes_name, Tensor::from_i64(vec![sizes.len() as u64], &sizes));
    let op = Op::Split(SplitAttrs { axis: axis as i64, num_outputs: None });
    let split_node = g.push_op(format!("{base}.split"), op, [Some(x), Some(sizes)], count as usize);
    let pieces = g.node(split_node).outputs().to_vec();
    let axes = squeeze.then(|| {
        let name = g.unique_name(&format!("{base}.axes"));
        g.add_initializer(&name, Tensor::from_i64(vec![1], &[axis as i64]))
    });
    let mut named = vec![false; pieces.len()];
    for (r, p, out) in reads {
        let piece = match axes {
            Some(axes) => {
                let s = g.push_op(format!("{base}.squeeze{p}"), Op::Squeeze, [Some(pieces[p]), Some(axes)], 1);
                g.node(s).outputs()[0]
            }
            None => pieces[p],
        };
        // The first reader of a piece gives it its name and declared type; another reads it
        // through an Identity of its own name.
        let piece = if std::mem::replace(&mut named[p], true) && axes.is_none() {
            let i = g.push_op(format!("{base}.piece{p}"), Op::Identity, [Some(piece)], 1);
            g.node(i).outputs()[0]
        } else {
            piece
        };
        let (name, ty) = (g.name(out).to_string(), g.ty(out).clone());
        g.replace_uses(out, piece);
        g.remove_node(r);
        removed.push(r);
        g.rename(piece, &name);
        if g.ty(piece).dtype.is_none() {
            g.set_ty(piece, ty);
        }
    }
    g.remove_node(n);
    removed.push(n);
    Some(())
}
