//! Undoes import-time decompositions once shapes are known.
//!
//! Softmax and LogSoftmax before opset 13 flatten their input to 2-D at `axis`; the importer writes
//! that as `Reshape(Softmax(Flatten(x, axis)), Shape(x))` when it cannot see `x`'s rank. When
//! inference shows that `axis` is the last dim, the four nodes are one `Softmax(x)`.

use mpc_ir::ops::SoftmaxAttrs;
use mpc_ir::{Graph, NodeId, Op};

use crate::{Changed, Context, Pass, Result};

pub struct Simplify;

/// The node producing input `slot` of `n`, if a node produces it and nothing else reads it.
fn sole_producer(g: &Graph, n: NodeId, slot: usize) -> Option<NodeId> {
    let v = g.node(n).input(slot)?;
    let (p, _) = g.value(v).producer()?;
    (g.value(v).uses().len() == 1 && !g.name_is_referenced(v)).then_some(p)
}

impl Pass for Simplify {
    fn name(&self) -> &'static str {
        "simplify"
    }

    fn run(&self, g: &mut Graph, _cx: &Context) -> Result<Changed> {
        let mut changed = Changed::No;
        for n in g.topo_order()? {
            if !matches!(g.node(n).op, Op::Reshape(_)) {
                continue;
            }
            let Some(sm) = sole_producer(g, n, 0) else { continue };
            let log = match &g.node(sm).op {
                Op::Softmax(a) if a.axis == -1 => false,
                Op::LogSoftmax(a) if a.axis == -1 => true,
                _ => continue,
            };
            let Some(fl) = sole_producer(g, sm, 0) else { continue };
            let Op::Flatten(f) = &g.node(fl).op else { continue };
            let (Some(x), Some(shape_v)) = (g.node(fl).input(0), g.node(n).input(1)) else { continue };
            let Some((sh, _)) = g.value(shape_v).producer() else { continue };
            if !matches!(&g.node(sh).op, Op::Shape(a) if a.start == 0 && a.end.is_none())
                || g.node(sh).input(0) != Some(x)
            {
                continue;
            }
            let Some(rank) = g.ty(x).shape.as_ref().map(|s| s.rank() as i64) else { continue };
            let axis = if f.axis < 0 { f.axis + rank } else { f.axis };
            if axis != rank - 1 {
                continue;
            }
            // The Reshape node becomes the softmax; the three helpers are left for DCE.
            let attrs = SoftmaxAttrs { axis: -1 };
            *g.node_op_mut(n) = if log { Op::LogSoftmax(attrs) } else { Op::Softmax(attrs) };
            g.truncate_inputs(n, 1);
            g.set_input(n, 0, Some(x));
            let removable: Vec<NodeId> = [sm, fl, sh]
                .into_iter()
                .filter(|&m| {
                    g.node(m).outputs().iter().all(|&o| g.value(o).uses().is_empty() && !g.name_is_referenced(o))
                })
                .collect();
            g.remove_nodes(&removable);
            changed = Changed::Yes;
        }
        Ok(changed)
    }
}
