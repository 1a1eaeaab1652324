//! Graphviz output: one box per node, filled by the precision it computes in (f16 blue, bf16 green,
//! f32 orange, casts grey, opaque ops dashed), one edge per value read, labelled with its type.
//! Marked nodes (values at risk in the low dtype, nodes calibration pinned) get a thick red border
//! and the reason as a third line.

use std::collections::BTreeMap;
use std::fmt::Write;

use mpc_ir::{DType, Def, Graph, NodeId, Op};

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub fn to_dot(g: &Graph) -> mpc_ir::Result<String> {
    to_dot_marked(g, &BTreeMap::new())
}

/// [`to_dot`] with `marks` drawn on their nodes.
pub fn to_dot_marked(g: &Graph, marks: &BTreeMap<NodeId, String>) -> mpc_ir::Result<String> {
    let order = g.topo_order()?;
    let mut s =
        format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"Helvetica\"];\n", esc(&g.name));
    for &v in g.inputs() {
        writeln!(s, "  v{} [shape=ellipse, label=\"{}\\n{}\"];", v.index(), esc(g.name(v)), g.ty(v)).ok();
    }
    let legend = "  legend [shape=plaintext, label=\"f16: blue   bf16: green   f32: orange   cast: grey   red border: range at risk or calibrated\"];";
    writeln!(s, "{legend}").ok();
    for &n in &order {
        let node = g.node(n);
        let dtype = node.outputs().iter().find_map(|&o| g.ty(o).dtype.filter(|d| d.is_float()));
        let fill = match (&node.op, dtype) {
            (Op::Cast(_), _) => "#d9d9d9",
            (_, Some(DType::F16)) => "#9ecae1",
            (_, Some(DType::BF16)) => "#a1d99b",
            (_, Some(DType::F32)) => "#fdd0a2",
            _ => "#ffffff",
        };
        let style = if node.op.is_opaque() { "filled,dashed" } else { "filled" };
        let (mark, border) = match marks.get(&n) {
            Some(why) => (format!("\\n{}", esc(why)), ", color=\"#cb181d\", penwidth=3"),
            None => (String::new(), ""),
        };
        writeln!(
            s,
            "  n{} [label=\"{}\\n{}{mark}\", style=\"{style}\", fillcolor=\"{fill}\"{border}];",
            n.index(),
            esc(node.op.op_type()),
            esc(&node.name)
        )
        .ok();
        for v in node.inputs().iter().flatten() {
            let from = match g.value(*v).def() {
                Def::Node(p, _) => format!("n{}", p.index()),
                Def::Input => format!("v{}", v.index()),
                _ => continue, // initializers are not drawn
            };
            writeln!(s, "  {from} -> n{} [label=\"{}\"];", n.index(), g.ty(*v)).ok();
        }
    }
    for &v in g.outputs() {
        writeln!(s, "  out{} [shape=ellipse, label=\"{}\"];", v.index(), esc(g.name(v))).ok();
        if let Def::Node(p, _) = g.value(v).def() {
            writeln!(s, "  n{} -> out{} [label=\"{}\"];", p.index(), v.index(), g.ty(v)).ok();
        }
    }
    s.push_str("}\n");
    Ok(s)
}
