//! Undoes decompositions, the importer's and the exporters', once shapes are known.
//!
//! - Softmax and LogSoftmax before opset 13 flatten their input to 2-D at `axis`; the importer
//!   writes that as `Reshape(Softmax(Flatten(x, axis)), Shape(x))` when it cannot see `x`'s rank.
//!   When inference shows that `axis` is the last dim, the four nodes are one `Softmax(x)`.
//! - GELU has been an ONNX op only since opset 20; exporters write it before that as element-wise
//!   arithmetic on x: `0.5·x·(1 + erf(x/√2))` (5 nodes), or the tanh approximation
//!   `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (8 or 9), in whatever order and grouping the
//!   exporter chose. Such a subgraph (one input x, scalar constants, every value inside read only
//!   inside it) is one `Gelu(x)` again when it computes the same function: checked by evaluating
//!   it at points from -8 to 8, not by matching one exporter's node order. One launch instead of
//!   eight forward and more backward, and training saves only x for the gradient. Written out, the
//!   graph then needs opset 20 (the exporter raises it).
//! - An Einsum's ellipsis is written out as letters once its operands' shapes are known.
//! - A CastLike whose second input's dtype the import did not know is a Cast once inference does.
//! - An `If` whose condition the shapes decide (torch's nn.MultiheadAttention squeezes a dim only
//!   `If Shape(x)[k] == 1`) is the nodes of the branch it takes.
//! - The standard ops of [`crate::composite`] are written out as the ops they are made of.

use mpc_ir::attr::take;
use mpc_ir::ops::{EinsumAttrs, GeluApprox, GeluAttrs, SoftmaxAttrs};
use mpc_ir::{DType, Graph, NodeId, Op, ValueId};

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

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        // Composite ops first: what they write out may be what the steps below look for. Under a
        // precision policy, those that must stay FP32 wait for the precision pass.
        let hold = if cx.policy.is_some() { crate::composite::HELD_FOR_COLOURING } else { &[] };
        let mut changed = Changed::No;
        loop {
            let wrote = crate::composite::expand_composites_but(g, hold)?;
            let cast = cast_like(g)?;
            if cast == Changed::Yes {
                // What reads a CastLike is typed only now.
                crate::infer_types(g)?;
            }
            if wrote == Changed::No && cast == Changed::No {
                break;
            }
            changed = Changed::Yes;
        }
        if softmax(g)? == Changed::Yes {
            changed = Changed::Yes;
        }
        for step in [gelu, einsum_ellipsis, split_to_sequence, known_if] {
            if step(g)? == Changed::Yes {
                changed = Changed::Yes;
            }
        }
        Ok(changed)
    }
}

/// A CastLike the import kept opaque (its second input's dtype was not known there) is the Cast
/// to that dtype once inference knows it.
fn cast_like(g: &mut Graph) -> Result<Changed> {
    let mut changed = Changed::No;
    for n in g.topo_order()? {
        let Op::Opaque(o) = &g.node(n).op else { continue };
        if !o.domain.is_empty() || o.op_type != "CastLike" || o.attrs.iter().any(|(k, _)| k != "saturate") {
            continue;
        }
        let Some(to) = g.node(n).input(1).and_then(|v| g.ty(v).dtype) else { continue };
        let saturate = !o.attrs.iter().any(|(_, a)| matches!(a, mpc_ir::Attr::Int(0)));
        *g.node_op_mut(n) = Op::Cast(mpc_ir::ops::CastAttrs { saturate, to });
        g.truncate_inputs(n, 1);
        changed = Changed::Yes;
    }
    Ok(changed)
}

/// A `SplitToSequence` that only `SequenceAt`s at known positions read (torch's chunk and split
/// in the legacy exporter) is a Split: each SequenceAt becomes an Identity of its part (a Squeeze
/// of the axis with `keepdims` 0). The parts are as many as the split input has entries, or the
/// chunks of a scalar size, or the axis's elements without one; the sequence op itself goes.
fn split_to_sequence(g: &mut Graph) -> Result<Changed> {
    let mut changed = Changed::No;
    for n in g.topo_order()? {
        let Op::Opaque(o) = &g.node(n).op else { continue };
        if !o.domain.is_empty() || o.op_type != "SplitToSequence" {
            continue;
        }
        let mut attrs = o.attrs.clone();
        let (Ok(axis), Ok(keep)) = (take::<i64>(&mut attrs, "axis"), take::<i64>(&mut attrs, "keepdims")) else {
            continue;
        };
        let (Some(x), true) = (g.node(n).input(0), attrs.is_empty()) else { continue };
        let Some(dims) = g.ty(x).shape.as_ref().map(|s| s.dims().to_vec()) else { continue };
        let Some(axis) = mpc_ir::normalize_axis(axis.unwrap_or(0), dims.len()) else { continue };
        let split = g.node(n).input(1);
        let split_rank = split.and_then(|s| g.ty(s).shape.as_ref().map(|sh| sh.rank()));
        // The parts and the Split's sizes input (none: equal parts of one element; Err: sizes to
        // write, once the readers say the rewrite applies).
        let (count, sizes) = match (split, split_rank) {
            (None, _) => (dims[axis].fixed().map(|d| d as usize), Ok(None)),
            (Some(s), Some(1)) => {
                (g.ty(s).shape.as_ref().and_then(|sh| sh.dims()[0].fixed()).map(|c| c as usize), Ok(Some(s)))
            }
            (Some(s), Some(0)) => {
                let (Some(d), Some(k)) =
                    (dims[axis].fixed(), g.constant(s).and_then(|t| t.to_i64_vec()).and_then(|v| v.first().copied()))
                else {
                    continue;
                };
                let k = k.max(1) as u64;
                let parts: Vec<i64> = (0..d.div_ceil(k)).map(|i| k.min(d - i * k) as i64).collect();
                (Some(parts.len()), Err(parts))
            }
            _ => continue,
        };
        let Some(count) = count.filter(|&c| c > 0) else { continue };
        let seq = g.node(n).outputs()[0];
        // Every reader a SequenceAt at a known position inside the sequence.
        let readers: Option<Vec<(NodeId, usize)>> = g
            .value(seq)
            .uses()
            .iter()
            .map(|u| {
                let at = g.node(u.node);
                let sequence_at = matches!(&at.op, Op::Opaque(o) if o.domain.is_empty() && o.op_type == "SequenceAt");
                let k = at.input(1).and_then(|i| g.constant(i)).and_then(|t| t.to_i64_vec())?;
                let k = *k.first()?;
                let k = if k < 0 { k + count as i64 } else { k };
                (sequence_at && u.slot == 0 && (0..count as i64).contains(&k)).then_some((u.node, k as usize))
            })
            .collect();
        let Some(readers) = readers.filter(|r| !r.is_empty() && !g.outputs().contains(&seq)) else { continue };
        let squeeze = keep == Some(0) && split.is_none();
        let name = g.node(n).name.clone();
        let sizes = sizes.unwrap_or_else(|parts| {
            let t = mpc_ir::Tensor::from_i64(vec![parts.len() as u64], &parts);
            let sizes = g.unique_name(&format!("{name}.sizes"));
            Some(g.add_initializer(&sizes, t))
        });
        let op = Op::Split(mpc_ir::ops::SplitAttrs { axis: axis as i64, num_outputs: None });
        let parts = g.push_op(format!("{name}.split"), op, [Some(x), sizes], count);
        let outs = g.node(parts).outputs().to_vec();
        let axes = squeeze.then(|| {
            let name = g.unique_name(&format!("{name}.axis"));
            g.add_initializer(&name, mpc_ir::Tensor::from_i64(vec![1], &[axis as i64]))
        });
        for (m, k) in readers {
            *g.node_op_mut(m) = if squeeze { Op::Squeeze } else { Op::Identity };
            g.set_input(m, 0, Some(outs[k]));
            g.set_input(m, 1, axes);
            g.truncate_inputs(m, if squeeze { 2 } else { 1 });
        }
        g.remove_node(n);
        changed = Changed::Yes;
    }
    if changed == Changed::Yes {
        // The parts are new values: typed now, for the passes after this one.
        crate::infer_types(g)?;
    }
    Ok(changed)
}

/// An `If` whose condition constants and known dims decide ([`crate::infer::const_ints`]) is
/// replaced by the nodes of the branch it takes, which read the outer values the branch reads
/// (its captures); a graph output the If wrote keeps its name. A branch that does not decode, or
/// declares inputs of its own, is left to the runtime's `If`.
fn known_if(g: &mut Graph) -> Result<Changed> {
    let mut changed = Changed::No;
    for n in g.topo_order()? {
        let Op::Opaque(o) = &g.node(n).op else { continue };
        if !o.domain.is_empty() || o.op_type != "If" {
            continue;
        }
        let Some(&[c]) = g.node(n).input(0).and_then(|v| crate::infer::const_ints(g, v)).as_deref() else { continue };
        let branch = if c != 0 { "then_branch" } else { "else_branch" };
        let Some(raw) = o.attrs.iter().find_map(|(k, a)| match a {
            mpc_ir::Attr::Raw(b) if k == branch => Some(b.clone()),
            _ => None,
        }) else {
            continue;
        };
        let captures: Vec<ValueId> = g.node(n).inputs()[o.explicit_inputs..].iter().flatten().copied().collect();
        let Ok(sub) = mpc_ir::onnx::decode_subgraph(&raw, g, &captures) else { continue };
        if sub.inputs().len() != captures.len() || sub.outputs().len() != g.node(n).outputs().len() {
            continue;
        }
        let Some(outs) = inline_graph(g, &sub, &captures, &g.node(n).name.clone()) else { continue };
        let mut named = Vec::new();
        for (&o, &m) in g.node(n).outputs().to_vec().iter().zip(&outs) {
            if g.is_output(o) {
                named.push((m, g.name(o).to_string()));
            }
            g.replace_uses(o, m);
        }
        g.remove_node(n);
        for (m, name) in named {
            if g.value(m).producer().is_some() {
                g.rename(m, &name);
            }
        }
        changed = Changed::Yes;
    }
    if changed == Changed::Yes {
        crate::infer_types(g)?;
    }
    Ok(changed)
}

/// Copies `sub`'s initializers and nodes into `g`, its inputs read as `inputs`; the values in
/// `g` of `sub`'s outputs. Value names are kept where free and prefixed by `scope` otherwise,
/// node names prefixed. `None`, with `g` untouched, for a graph with a cycle.
fn inline_graph(g: &mut Graph, sub: &Graph, inputs: &[ValueId], scope: &str) -> Option<Vec<ValueId>> {
    let order = sub.topo_order().ok()?;
    let mut map: std::collections::HashMap<ValueId, ValueId> =
        sub.inputs().iter().copied().zip(inputs.iter().copied()).collect();
    let fresh = |g: &Graph, name: &str| match g.find(name) {
        Some(_) => g.unique_name(&format!("{scope}/{name}")),
        None => name.to_string(),
    };
    for v in sub.initializers() {
        let t = sub.value(v).initializer()?.clone();
        let name = fresh(g, sub.name(v));
        map.insert(v, g.add_initializer(&name, t));
    }
    for m in order {
        let node = sub.node(m);
        // An imported graph defines what it reads (its inputs, initializers, earlier outputs).
        let ins: Vec<Option<ValueId>> = node.inputs().iter().map(|i| i.map(|v| map[&v])).collect();
        let outs: Vec<ValueId> = node
            .outputs()
            .iter()
            .map(|&o| {
                let name = fresh(g, sub.name(o));
                g.new_value(&name, mpc_ir::TypeInfo::default())
            })
            .collect();
        map.extend(node.outputs().iter().copied().zip(outs.iter().copied()));
        g.add_node(format!("{scope}/{}", node.name), node.op.clone(), ins, outs);
    }
    Some(sub.outputs().iter().map(|o| map[o]).collect())
}

/// An Einsum whose equation has an ellipsis gets it written out as letters
/// ([`mpc_ir::ops::einsum_expand`]) once its operands' shapes are known, so that the kernels,
/// the cost model and the gradient rule see only letters.
fn einsum_ellipsis(g: &mut Graph) -> Result<Changed> {
    let mut changed = Changed::No;
    for n in g.topo_order()? {
        let Op::Einsum(a) = &g.node(n).op else { continue };
        if !a.equation.contains("...") {
            continue;
        }
        let eq = a.equation.clone();
        let shapes: Option<Vec<Vec<Option<u64>>>> = g
            .node(n)
            .inputs()
            .iter()
            .map(|v| v.and_then(|v| g.ty(v).shape.as_ref()).map(|s| s.dims().iter().map(|d| d.fixed()).collect()))
            .collect();
        let Some(shapes) = shapes else { continue };
        let Ok(equation) = mpc_ir::ops::einsum_expand(&eq, &shapes) else { continue };
        *g.node_op_mut(n) = Op::Einsum(EinsumAttrs { equation });
        changed = Changed::Yes;
    }
    Ok(changed)
}

/// `Reshape(Softmax(Flatten(x, axis)), Shape(x))` with `axis` the last dim becomes `Softmax(x)`.
fn softmax(g: &mut Graph) -> Result<Changed> {
    {
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

/// What a candidate GELU subgraph computes: an expression over one value `x`.
#[derive(Debug)]
enum Expr {
    X,
    Const(f64),
    Tanh(Box<Expr>),
    Erf(Box<Expr>),
    Sqrt(Box<Expr>),
    Bin(Bin, Box<Expr>, Box<Expr>),
}

#[derive(Clone, Copy, Debug)]
enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
}

impl Expr {
    fn eval(&self, x: f64) -> f64 {
        match self {
            Expr::X => x,
            Expr::Const(c) => *c,
            Expr::Tanh(a) => a.eval(x).tanh(),
            Expr::Erf(a) => libm::erf(a.eval(x)),
            Expr::Sqrt(a) => a.eval(x).sqrt(),
            Expr::Bin(op, a, b) => {
                let (a, b) = (a.eval(x), b.eval(x));
                match op {
                    Bin::Add => a + b,
                    Bin::Sub => a - b,
                    Bin::Mul => a * b,
                    Bin::Div => a / b,
                    Bin::Pow => a.powf(b),
                }
            }
        }
    }

    /// Whether the expression applies `Erf` (else `Tanh`) somewhere.
    fn has(&self, erf: bool) -> bool {
        match self {
            Expr::X | Expr::Const(_) => false,
            Expr::Erf(a) => erf || a.has(erf),
            Expr::Tanh(a) => !erf || a.has(erf),
            Expr::Sqrt(a) => a.has(erf),
            Expr::Bin(_, a, b) => a.has(erf) || b.has(erf),
        }
    }
}

/// The most nodes a GELU decomposition has (the tanh form: 9, with a `Div` or `Sqrt` more).
const GELU_NODES: usize = 12;

/// Builds the expression that `v` computes from one value `x` (set on the way), taking into it
/// every producer of an element-wise op whose result is read once, by the expression, and has
/// `x`'s shape. `inside` collects those producers.
fn expr_of(g: &Graph, v: ValueId, root: bool, x: &mut Option<ValueId>, inside: &mut Vec<NodeId>) -> Option<Expr> {
    if let Some(c) = scalar(g, v) {
        return Some(Expr::Const(c));
    }
    let sole = root || (g.value(v).uses().len() == 1 && !g.name_is_referenced(v));
    let same_shape = x.is_none_or(|x| g.ty(v).shape.is_some() && g.ty(v).shape == g.ty(x).shape);
    let producer = g.value(v).producer().filter(|&(_, slot)| slot == 0).map(|(p, _)| p);
    if let Some(p) = producer.filter(|_| sole && same_shape && inside.len() < GELU_NODES) {
        let node = g.node(p);
        let arg = |i: usize, x: &mut Option<ValueId>, inside: &mut Vec<NodeId>| {
            expr_of(g, node.input(i)?, false, x, inside).map(Box::new)
        };
        let bin = |op: Bin, x: &mut Option<ValueId>, inside: &mut Vec<NodeId>| {
            let a = arg(0, x, inside)?;
            Some(Expr::Bin(op, a, arg(1, x, inside)?))
        };
        let before = inside.len();
        inside.push(p);
        let e = match &node.op {
            Op::Tanh => Some(arg(0, x, inside).map(Expr::Tanh)),
            Op::Erf => Some(arg(0, x, inside).map(Expr::Erf)),
            Op::Sqrt => Some(arg(0, x, inside).map(Expr::Sqrt)),
            Op::Add => Some(bin(Bin::Add, x, inside)),
            Op::Sub => Some(bin(Bin::Sub, x, inside)),
            Op::Mul => Some(bin(Bin::Mul, x, inside)),
            Op::Div => Some(bin(Bin::Div, x, inside)),
            Op::Pow => Some(bin(Bin::Pow, x, inside)),
            _ => None,
        };
        match e {
            // One of the expression's ops: its operands must be expressions too.
            Some(e) => return e,
            None => inside.truncate(before),
        }
    }
    // Anything else is the one input.
    match *x {
        None if g.ty(v).dtype.is_some_and(|d| d.is_float()) && g.ty(v).shape.is_some() => {
            *x = Some(v);
            Some(Expr::X)
        }
        Some(y) if y == v => Some(Expr::X),
        _ => None,
    }
}

/// A float scalar constant's value, also through a `Cast` (an exporter's f64 constant cast to
/// the graph's dtype), rounded as the cast rounds it.
fn scalar(g: &Graph, v: ValueId) -> Option<f64> {
    if let Some(t) = g.constant(v) {
        return (t.numel() == 1 && t.dtype().is_float()).then(|| t.to_f64_vec()[0]);
    }
    let (p, _) = g.value(v).producer()?;
    match &g.node(p).op {
        Op::Cast(c) if c.to.is_float() => {
            let t = g.constant(g.node(p).input(0)?)?;
            (t.numel() == 1 && t.dtype().is_float()).then(|| t.to_dtype(c.to).to_f64_vec()[0])
        }
        _ => None,
    }
}

fn gelu_exact(x: f64, tanh: bool) -> f64 {
    if tanh {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
    } else {
        0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2))
    }
}

/// Which GELU `e` computes, if it is one: it applies `Erf` (or `Tanh`) and equals the exact
/// function at points from -8 to 8 within what rounding its constants to `dtype` moves it.
fn gelu_form(e: &Expr, dtype: DType) -> Option<GeluApprox> {
    let tol = match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 1e-2,
        _ => 1e-5,
    };
    [(false, GeluApprox::Erf), (true, GeluApprox::Tanh)].into_iter().find_map(|(tanh, form)| {
        let close = (-32..=32).all(|i| {
            let x = i as f64 / 4.0;
            let (got, want) = (e.eval(x), gelu_exact(x, tanh));
            (got - want).abs() <= tol * (1.0 + want.abs())
        });
        (close && e.has(!tanh)).then_some(form)
    })
}

/// Every exported GELU decomposition becomes one `Gelu` node.
fn gelu(g: &mut Graph) -> Result<Changed> {
    let mut changed = Changed::No;
    let order = g.topo_order()?;
    let mut gone = std::collections::HashSet::new();
    // From the last node back, so that a decomposition is found from its final product.
    for &n in order.iter().rev() {
        if gone.contains(&n) || !matches!(g.node(n).op, Op::Mul | Op::Div | Op::Add) || g.node(n).outputs().len() != 1 {
            continue;
        }
        let out = g.node(n).outputs()[0];
        let (mut x, mut inside) = (None, Vec::new());
        let Some(e) = expr_of(g, out, true, &mut x, &mut inside) else { continue };
        let Some(x) = x else { continue };
        if inside.len() < 4 || g.ty(out).shape != g.ty(x).shape || g.ty(out).dtype != g.ty(x).dtype {
            continue;
        }
        let Some(form) = g.ty(x).dtype.and_then(|d| gelu_form(&e, d)) else { continue };
        *g.node_op_mut(n) = Op::Gelu(GeluAttrs { approximate: form });
        g.truncate_inputs(n, 1);
        g.set_input(n, 0, Some(x));
        let rest: Vec<NodeId> = inside.into_iter().filter(|&m| m != n).collect();
        gone.extend(rest.iter().copied());
        g.remove_nodes(&rest);
        changed = Changed::Yes;
    }
    Ok(changed)
}
