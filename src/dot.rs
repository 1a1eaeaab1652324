//! Graphviz output: one box per node, one edge per value read, labelled with its type.

use std::fmt::Write;

use mpc_ir::{Def, Graph};

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

pub fn to_dot(g: &Graph) -> mpc_ir::Result<String> {
    let order = g.topo_order()?;
    let mut s =
        format!("digraph \"{}\" {{\n  rankdir=TB;\n  node [shape=box, fontname=\"Helvetica\"];\n", esc(&g.name));
    for &v in g.inputs() {
        writeln!(s, "  v{} [shape=ellipse, label=\"{}\\n{}\"];", v.index(), esc(g.name(v)), g.ty(v)).ok();
    }
    for &n in &order {
        let node = g.node(n);
        let style = if node.op.is_opaque() { ", style=dashed" } else { "" };
        writeln!(s, "  n{} [label=\"{}\\n{}\"{style}];", n.index(), esc(node.op.op_type()), esc(&node.name)).ok();
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
