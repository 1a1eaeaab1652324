//! The precision pass: decides which ops run in the low dtype and rewrites the graph to match.
//!
//! 1. Every op with a class ([`table`]) whose float tensors are all FP32 is a candidate; integer,
//!    bool and index tensors, f64, and anything already in a low dtype are left alone, and so are
//!    opaque ops.
//! 2. Candidates are forced to F32 when pinned by name, or when they read a constant that the low
//!    dtype cannot hold: a value beyond its range (the -1e9 of attention masks), or more than 1% of
//!    the non-zero values flushing to zero (an epsilon of 1e-12).
//! 3. [`colour`] colours the candidates.
//! 4. Low nodes' outputs become the low dtype. A constant whose every reader wants it low is stored
//!    converted (no run-time cast); other mismatches get one shared `Cast` per (value, dtype), named
//!    `{value}.cast_{dtype}`. Graph inputs and outputs keep their dtypes (a low output is cast
//!    back and keeps its name) unless the policy asks for low interfaces.

pub mod colour;
pub mod table;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use mpc_ir::ops::{CastAttrs, ConstantAttrs, ConstantOfShapeAttrs};
use mpc_ir::{DType, Def, Graph, Narrowing, NodeId, Op, Tensor, TypeInfo, ValueId};

pub use colour::{Colour, Reason};
pub use table::{default_class, input_role, output_follows, Class, Role};

use crate::{Changed, Context, Pass, PassError, Result};

/// A precision policy: the low dtype and the edits to the default lists.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// f16 or bf16.
    pub low: DType,
    /// The naive `fp16` policy: every op low.
    pub everything_low: bool,
    /// Class overrides by op type (`--allow`, `--deny`, config lists).
    pub overrides: BTreeMap<String, Class>,
    /// Node names pinned to F32.
    pub pin_fp32: BTreeSet<String>,
    /// Graph inputs and outputs in the low dtype too.
    pub io_low: bool,
    /// Initializers that stay FP32 whatever reads them: the master weights of a training graph,
    /// which low readers see through one shared Cast.
    pub masters: BTreeSet<String>,
    /// Values measured to break in the low dtype (calibration), by name, with the measurement
    /// that says so: the nodes computing and reading one run in F32.
    pub measured: BTreeMap<String, String>,
    /// Attention chains whose products are low run as one fused `ai.mpc::Attention` node
    /// (the `fuse-attention` pass).
    pub fused_attention: bool,
}

impl Policy {
    /// The named policies; `fp32` (no rewrite) is `Ok(None)`.
    pub fn named(name: &str) -> Result<Option<Policy>, String> {
        let base = |low| Policy {
            low,
            everything_low: false,
            overrides: BTreeMap::new(),
            pin_fp32: BTreeSet::new(),
            io_low: false,
            masters: BTreeSet::new(),
            measured: BTreeMap::new(),
            fused_attention: false,
        };
        Ok(match name {
            "fp32" => None,
            "mixed" => Some(base(DType::F16)),
            "mixed-bf16" => Some(base(DType::BF16)),
            "fp16" => Some(Policy { everything_low: true, ..base(DType::F16) }),
            _ => return Err(format!("unknown policy `{name}` (policies: fp32, mixed, mixed-bf16, fp16)")),
        })
    }

    /// Puts `op_type` in `class`; an op type mpc does not know is an error.
    pub fn set_class(&mut self, op_type: &str, class: Class) -> Result<(), String> {
        if !Op::KNOWN.contains(&op_type) {
            return Err(format!("unknown op `{op_type}` (see the supported-op table)"));
        }
        self.overrides.insert(op_type.to_string(), class);
        Ok(())
    }

    /// The class of `op` under this policy (`None`: never recoloured).
    pub fn class(&self, op: &Op) -> Option<Class> {
        let default = default_class(op, self.low)?;
        Some(self.overrides.get(op.op_type()).copied().unwrap_or(default))
    }
}

/// What the pass decided, for `mpc inspect --explain`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Colour and reason of every candidate node.
    pub nodes: BTreeMap<NodeId, (Colour, Reason)>,
    /// Constants stored in the low dtype.
    pub converted: Vec<String>,
    /// Notes on constants: kept in F32, or with values flushed to zero.
    pub notes: Vec<String>,
}

pub struct Precision;

impl Pass for Precision {
    fn name(&self) -> &'static str {
        "precision"
    }

    fn run(&self, g: &mut Graph, cx: &Context) -> Result<Changed> {
        let Some(policy) = &cx.policy else { return Ok(Changed::No) };
        let report = rewrite(g, policy)?;
        // The composites held for colouring, FP32 now, written out.
        let wrote = crate::expand_composites(g)? == Changed::Yes;
        let changed = wrote || !report.nodes.values().all(|(c, _)| *c == Colour::F32) || policy.io_low;
        *cx.report.borrow_mut() = Some(report);
        Ok(if changed { Changed::Yes } else { Changed::No })
    }
}

fn is_f32(g: &Graph, v: ValueId) -> bool {
    g.ty(v).dtype == Some(DType::F32)
}

/// The node's float tensors that follow its precision: (inputs, outputs).
///
/// An input of unknown dtype (an opaque op's output that declares none) is one of them: it gets
/// a Cast to the node's dtype like any other, since what it holds is never guessed.
fn t_values(g: &Graph, n: NodeId) -> (Vec<ValueId>, Vec<ValueId>) {
    let node = g.node(n);
    let float = |v: &ValueId| g.ty(*v).dtype.is_some_and(|d| d.is_float());
    let float_or_unknown = |v: &ValueId| g.ty(*v).dtype.is_none_or(|d| d.is_float());
    let ins = node
        .inputs()
        .iter()
        .enumerate()
        .filter_map(|(s, v)| v.filter(|v| input_role(&node.op, s) == Role::T && float_or_unknown(v)))
        .collect();
    let outs = node
        .outputs()
        .iter()
        .enumerate()
        .filter(|(s, v)| output_follows(&node.op, *s) && float(v))
        .map(|(_, v)| *v)
        .collect();
    (ins, outs)
}

/// A constant converted to the low dtype, and why it must not be (if so).
struct Narrowed {
    tensor: Option<Tensor>,
    why: Option<String>,
}

/// Converts `t` to `low` once, judging the result: see [`judged`].
fn narrow(t: &Tensor, low: DType, name: &str, notes: &mut Vec<String>) -> Narrowed {
    judged(t.narrow(low), low, name, notes)
}

/// A conversion judged: unsafe when a finite value overflows, or when more than 1% of the
/// non-zero values flush to zero.
fn judged(narrowed: Option<(Tensor, Narrowing)>, low: DType, name: &str, notes: &mut Vec<String>) -> Narrowed {
    let Some((converted, r)) = narrowed else { return Narrowed { tensor: None, why: None } };
    let why = if let Some(x) = r.overflow {
        Some(format!("{x:e} overflows {low}"))
    } else if r.flushed * 100 > r.nonzero {
        let e = r.example_flushed.unwrap_or_default();
        Some(format!("{} of {} non-zero values (e.g. {e:e}) become 0 in {low}", r.flushed, r.nonzero))
    } else {
        if r.flushed > 0 {
            notes.push(format!("`{name}`: {} tiny non-zero values become 0 in {low}", r.flushed));
        }
        None
    };
    Narrowed { tensor: Some(converted), why }
}

fn constant_tensor(g: &Graph, v: ValueId) -> Option<Tensor> {
    match g.value(v).def() {
        Def::Init(t) => Some(Tensor::clone(t)),
        Def::Node(n, 0) => match &g.node(*n).op {
            Op::Constant(c) => Some(c.value.clone()),
            Op::ConstantOfShape(c) => Some(c.value.clone().unwrap_or_else(|| Tensor::from_f32(vec![1], &[0.0]))),
            _ => None,
        },
        _ => None,
    }
}

fn rewrite(g: &mut Graph, policy: &Policy) -> Result<Report> {
    let order = g.topo_order()?;
    let mut report = Report::default();

    // 1-2. Candidates, pins and unsafe constants, and the edges along which colours follow.
    let (cg, mut checked) = colour_graph(g, policy, &order, &mut report)?;

    // 3. Colour.
    let colours = colour::colour(&cg, policy.everything_low);
    // In index order, so the map is built in one sweep rather than by a million inserts.
    report.nodes = colours.iter().enumerate().filter_map(|(i, c)| Some((NodeId::from_index(i), c.clone()?))).collect();
    let is_low = |n: NodeId| matches!(colours.get(n.index()), Some(Some((Colour::Low, _))));

    // 4. Retype, convert constants, insert casts.
    let original: Vec<Option<DType>> = g.value_ids().map(|v| g.ty(v).dtype).collect();
    retype(g, policy, &order, &is_low);
    let wants = reader_wants(g, &order, &cg.class, &is_low, &original, policy.low);
    store_low(g, policy, &wants, &original, &mut checked, &mut report);
    let mut casts = cast_readers(g, wants);
    keep_interfaces(g, policy, &order, &original, &mut casts);
    Ok(report)
}

/// What the colouring reads: each candidate's class, the nodes forced to FP32 (pins, measured
/// values, constants the low dtype breaks) and the edges between candidates; and the constants
/// judged on the way.
fn colour_graph(
    g: &Graph,
    policy: &Policy,
    order: &[NodeId],
    report: &mut Report,
) -> Result<(colour::ColourGraph, HashMap<ValueId, Narrowed>)> {
    let bound = g.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let mut class: Vec<Option<Class>> = vec![None; bound];
    let mut forced: Vec<Option<Reason>> = vec![None; bound];
    let mut pins_found = BTreeSet::new();
    // Candidates (not pinned) and the constants they read.
    let mut candidates: Vec<NodeId> = Vec::new();
    let mut constants: Vec<(ValueId, Tensor)> = Vec::new();
    let mut seen = HashSet::new();
    for &n in order {
        let Some(c) = policy.class(&g.node(n).op) else { continue };
        let (ins, outs) = t_values(g, n);
        if ins.is_empty() && outs.is_empty() || !ins.iter().chain(&outs).all(|&v| is_f32(g, v)) {
            continue;
        }
        class[n.index()] = Some(c);
        if policy.pin_fp32.contains(&g.node(n).name) {
            pins_found.insert(g.node(n).name.clone());
            forced[n.index()] = Some(Reason::Pinned);
            continue;
        }
        // A value the low dtype breaks is neither computed nor read in it.
        if let Some(why) = outs.iter().find_map(|&v| policy.measured.get(g.name(v))) {
            forced[n.index()] = Some(Reason::Measured(why.clone()));
            continue;
        }
        if let Some((v, why)) = ins.iter().find_map(|&v| Some((v, policy.measured.get(g.name(v))?))) {
            forced[n.index()] = Some(Reason::Measured(format!("reads `{}`: {why}", g.name(v))));
            continue;
        }
        for v in ins {
            if let Some(t) = constant_tensor(g, v).filter(|_| seen.insert(v)) {
                constants.push((v, t));
            }
        }
        candidates.push(n);
    }
    // Every constant judged at once (the work is spread over the threads), in a fixed order.
    let tensors: Vec<&Tensor> = constants.iter().map(|(_, t)| t).collect();
    let mut checked: HashMap<ValueId, Narrowed> = HashMap::new();
    for ((v, _), nw) in constants.iter().zip(Tensor::narrow_all(&tensors, policy.low)) {
        checked.insert(*v, judged(nw, policy.low, g.name(*v), &mut report.notes));
    }
    for n in candidates {
        for v in t_values(g, n).0 {
            if let Some(why) = checked.get(&v).and_then(|nw| nw.why.as_ref()) {
                forced[n.index()] = Some(Reason::UnsafeConstant(format!("`{}`: {why}", g.name(v))));
            }
        }
    }
    if let Some(missing) =
        policy.pin_fp32.iter().find(|p| !pins_found.contains(*p) && !g.node_ids().any(|n| &g.node(n).name == *p))
    {
        return Err(PassError::Usage(format!("--pin-fp32 `{missing}`: no node has that name")));
    }
    let (succ, pred) = follow_edges(g, order, &class, bound);
    Ok((colour::ColourGraph { class, succ, pred, forced }, checked))
}

/// The edges between candidates along the float values whose type follows the op's, both ways.
fn follow_edges(
    g: &Graph,
    order: &[NodeId],
    class: &[Option<Class>],
    bound: usize,
) -> (colour::Adjacency, colour::Adjacency) {
    let mut edges: Vec<(u32, u32)> = Vec::new();
    for &n in order {
        if class[n.index()].is_none() {
            continue;
        }
        let node = g.node(n);
        for (s, v) in node.inputs().iter().enumerate() {
            let Some(v) = *v else { continue };
            if input_role(&node.op, s) != Role::T || !is_f32(g, v) {
                continue;
            }
            if let Some((p, o)) = g.value(v).producer() {
                if class[p.index()].is_some() && output_follows(&g.node(p).op, o) {
                    edges.push((p.index() as u32, n.index() as u32));
                }
            }
        }
    }
    let succ = colour::Adjacency::new(bound, &edges);
    edges.iter_mut().for_each(|e| *e = (e.1, e.0));
    let pred = colour::Adjacency::new(bound, &edges);
    (succ, pred)
}

/// The low nodes' outputs (and, under `io_low`, the graph's float inputs) take the low dtype.
fn retype(g: &mut Graph, policy: &Policy, order: &[NodeId], is_low: &dyn Fn(NodeId) -> bool) {
    let low = policy.low;
    for &n in order {
        if is_low(n) {
            for v in t_values(g, n).1 {
                set_dtype(g, v, low);
            }
        }
    }
    if policy.io_low {
        for v in g.inputs().to_vec() {
            if is_f32(g, v) {
                set_dtype(g, v, low);
            }
        }
    }
}

/// What each reader wants of each float value it reads: (reader, slot, value, dtype).
fn reader_wants(
    g: &Graph,
    order: &[NodeId],
    class: &[Option<Class>],
    is_low: &dyn Fn(NodeId) -> bool,
    original: &[Option<DType>],
    low: DType,
) -> Vec<(NodeId, usize, ValueId, DType)> {
    let mut wants: Vec<(NodeId, usize, ValueId, DType)> = Vec::new();
    for &n in order {
        let node = g.node(n);
        for (s, v) in node.inputs().iter().enumerate() {
            let Some(v) = *v else { continue };
            let Some(orig) = original[v.index()].filter(|d| d.is_float()) else { continue };
            if g.is_capture(n, s) {
                continue; // read by name inside a subgraph: handled with the interfaces below
            }
            let want = match input_role(&node.op, s) {
                Role::T if class[n.index()].is_some() => {
                    if is_low(n) {
                        low
                    } else {
                        orig
                    }
                }
                Role::Any => continue,
                _ => orig,
            };
            wants.push((n, s, v, want));
        }
    }
    wants
}

/// Constants every reader wants low are stored low (converted once, as judged before where they
/// were).
fn store_low(
    g: &mut Graph,
    policy: &Policy,
    wants: &[(NodeId, usize, ValueId, DType)],
    original: &[Option<DType>],
    checked: &mut HashMap<ValueId, Narrowed>,
    report: &mut Report,
) {
    let low = policy.low;
    // Per value: read by anyone (bit 0), read by someone who wants it high (bit 1).
    let mut readers = vec![0u8; original.len()];
    for &(_, _, v, want) in wants {
        readers[v.index()] |= if want == low { 1 } else { 3 };
    }
    let constants: Vec<ValueId> = g
        .value_ids()
        .filter(|v| readers[v.index()] == 1 && !g.is_output(*v) && original[v.index()] == Some(DType::F32))
        .filter(|v| !policy.masters.contains(g.name(*v)))
        .collect();
    for v in constants {
        let Some(t) = constant_tensor(g, v) else { continue };
        let nw = match checked.remove(&v) {
            Some(nw) => nw,
            None => narrow(&t, low, g.name(v), &mut report.notes),
        };
        let (Some(converted), None) = (nw.tensor, nw.why) else { continue };
        match g.value(v).def().clone() {
            Def::Init(_) => g.set_initializer(v, converted),
            Def::Node(p, _) => {
                *g.node_op_mut(p) = match g.node(p).op.clone() {
                    Op::Constant(_) => Op::Constant(Box::new(ConstantAttrs { value: converted })),
                    _ => Op::ConstantOfShape(Box::new(ConstantOfShapeAttrs { value: Some(converted) })),
                };
                set_dtype(g, v, low);
            }
            _ => continue,
        }
        report.converted.push(g.name(v).to_string());
    }
}

/// The readers moved to a cast of the value they read where they want another dtype: one cast
/// per (value, dtype), returned for the interfaces to share.
fn cast_readers(g: &mut Graph, wants: Vec<(NodeId, usize, ValueId, DType)>) -> HashMap<(ValueId, DType), ValueId> {
    // Readers to redirect, grouped by (value, dtype) so that each value's use list is rewritten once.
    let mut moves: BTreeMap<(ValueId, DType), Vec<mpc_ir::Use>> = BTreeMap::new();
    for (n, s, v, want) in wants {
        if g.ty(v).dtype != Some(want) {
            moves.entry((v, want)).or_default().push(mpc_ir::Use { node: n, slot: s });
        }
    }
    // One cast per (value, dtype): room for them at once, not at every doubling of a large graph.
    g.reserve(moves.len(), moves.len());
    let mut casts: HashMap<(ValueId, DType), ValueId> = HashMap::with_capacity(moves.len());
    for ((v, want), uses) in moves {
        let c = cast(g, &mut casts, v, want);
        g.move_uses(v, c, &uses);
    }
    casts
}

/// Interfaces (graph outputs, values that subgraphs read by name) keep their dtypes and their
/// names: the rewritten value takes a suffix and a cast back takes the name.
fn keep_interfaces(
    g: &mut Graph,
    policy: &Policy,
    order: &[NodeId],
    original: &[Option<DType>],
    casts: &mut HashMap<(ValueId, DType), ValueId>,
) {
    let low = policy.low;
    let mut interfaces: Vec<ValueId> = g.outputs().to_vec();
    for &n in order {
        for (s, v) in g.node(n).inputs().iter().enumerate() {
            if let Some(v) = v.filter(|_| g.is_capture(n, s)) {
                interfaces.push(v);
            }
        }
    }
    let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
    // A training graph's loss is an output but not the model's: it stays FP32 under io_low (the
    // loss scale multiplies it in FP32, and the backward pass starts from it).
    let loss = g.train.as_ref().and_then(|t| t.loss);
    for v in interfaces {
        if renamed.contains_key(&v) {
            continue;
        }
        let want = match original[v.index()] {
            Some(DType::F32) if policy.io_low && g.is_output(v) && Some(v) != loss => low,
            Some(d) => d,
            None => continue,
        };
        if g.ty(v).dtype == Some(want) {
            continue;
        }
        let name = g.name(v).to_string();
        let inner = format!("{name}.{}", g.ty(v).dtype.map_or("v".into(), |d| d.to_string()));
        g.rename(v, &inner);
        let c = cast(g, casts, v, want);
        g.rename(c, &name);
        renamed.insert(v, c);
    }
    let outputs: Vec<ValueId> = g.outputs().iter().map(|v| renamed.get(v).copied().unwrap_or(*v)).collect();
    g.set_outputs(outputs);
    if let Some(t) = &mut g.train {
        // The training contract follows its outputs to the casts that took their names.
        for (&v, &c) in &renamed {
            t.replace(v, c);
        }
    }
    for &n in order {
        for s in 0..g.node(n).inputs().len() {
            if let Some(&c) = g.node(n).input(s).and_then(|v| renamed.get(&v)).filter(|_| g.is_capture(n, s)) {
                g.set_input(n, s, Some(c));
            }
        }
    }
}

fn set_dtype(g: &mut Graph, v: ValueId, d: DType) {
    let ty = g.ty(v).clone();
    g.set_ty(v, TypeInfo { dtype: Some(d), ..ty });
}

/// The shared cast of `v` to `to`, made on first use.
fn cast(g: &mut Graph, casts: &mut HashMap<(ValueId, DType), ValueId>, v: ValueId, to: DType) -> ValueId {
    if let Some(&c) = casts.get(&(v, to)) {
        return c;
    }
    let name = match g.name(v) {
        "" => format!("v.cast_{to}"),
        n => format!("{n}.cast_{to}"),
    };
    let op = Op::Cast(CastAttrs { to, ..Default::default() });
    let (_, out) = g.add_op(&name, op, &[Some(v)], 1);
    let shape = g.ty(v).shape.clone();
    g.set_ty(out[0], TypeInfo { dtype: Some(to), shape });
    casts.insert((v, to), out[0]);
    out[0]
}
