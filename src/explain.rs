//! `mpc inspect --explain`: every node's precision and what decided it, and a summary.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use mpc_ir::{DType, Graph, NodeId, Op, ValueId};
use mpc_passes::precision::{Colour, Reason, Report};
use mpc_passes::PassError;

use crate::summary::{bind_inputs, flops, node_flops};

/// The precision a node computes in, read from the rewritten graph.
fn node_dtype(g: &Graph, n: NodeId) -> Option<DType> {
    g.node(n).outputs().iter().find_map(|&o| g.ty(o).dtype.filter(|d| d.is_float()))
}

fn label(g: &Graph, n: NodeId) -> String {
    let name = &g.node(n).name;
    if name.is_empty() {
        g.node(n).outputs().first().map_or(String::new(), |&o| format!("({})", g.name(o)))
    } else {
        name.clone()
    }
}

fn why(g: &Graph, r: &Reason) -> String {
    let who = |n: &NodeId| label(g, *n);
    match r {
        Reason::LowList => "low list".into(),
        Reason::F32List => "f32 list".into(),
        Reason::Pinned => "pinned by --pin-fp32".into(),
        Reason::UnsafeConstant(s) => format!("reads a constant the low dtype cannot hold: {s}"),
        Reason::Measured(s) => format!("calibration: {s}"),
        Reason::AfterF32(n) => format!("follows f32 `{}`", who(n)),
        Reason::BetweenLow(n) => format!("between low ops (on the path into `{}`)", who(n)),
        Reason::ClearNextToLow(n) => format!("data movement next to low `{}`", who(n)),
        Reason::FollowDefault => "follow op not between two low ops".into(),
        Reason::ClearDefault => "data movement with no low neighbour".into(),
        Reason::Everything => "fp16 policy: every op low".into(),
    }
}

/// Casts the precision pass inserted (`{value}.cast_{dtype}`), as (from, to) dtypes.
pub fn inserted_casts(g: &Graph) -> Vec<(NodeId, DType, DType)> {
    g.node_ids()
        .filter_map(|n| {
            let node = g.node(n);
            let Op::Cast(a) = &node.op else { return None };
            let from = g.ty(node.input(0)?).dtype?;
            node.name.ends_with(&format!(".cast_{}", a.to)).then_some((n, from, a.to))
        })
        .collect()
}

/// Colour boundaries: distinct (value, dtype) pairs where a reader reads a value in another
/// precision than its producer computed it in, looking through one cast.
pub fn colour_boundaries(g: &Graph) -> usize {
    let casts: HashMap<ValueId, ValueId> = inserted_casts(g)
        .into_iter()
        .filter_map(|(n, _, _)| Some((g.node(n).outputs()[0], g.node(n).input(0)?)))
        .collect();
    let mut pairs = std::collections::BTreeSet::new();
    for n in g.node_ids() {
        if casts.contains_key(&g.node(n).outputs()[0]) {
            continue;
        }
        for w in g.node(n).inputs().iter().flatten() {
            if let Some(&u) = casts.get(w) {
                if g.ty(u).dtype != g.ty(*w).dtype {
                    pairs.insert((u, g.ty(*w).dtype));
                }
            }
        }
    }
    for &o in g.outputs() {
        if let Some(&u) = casts.get(&o) {
            pairs.insert((u, g.ty(o).dtype));
        }
    }
    pairs.len()
}

fn weight_bytes(g: &Graph) -> u64 {
    g.initializers().filter_map(|v| g.value(v).initializer()).map(|t| t.bytes().len() as u64).sum()
}

/// The explanation: one line per node, then the summary.
pub fn explain(
    before: &Graph,
    g: &Graph,
    report: Option<&Report>,
    dims: &HashMap<String, u64>,
) -> Result<String, PassError> {
    let mut s = String::new();
    let order = g.topo_order()?;
    let inserted: HashMap<NodeId, (DType, DType)> =
        inserted_casts(g).into_iter().map(|(n, a, b)| (n, (a, b))).collect();
    let width = order.iter().map(|&n| label(g, n).len()).max().unwrap_or(4).min(48);
    writeln!(s, "# {:width$}  {:<24} {:<6} why", "node", "op", "runs").ok();
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    let mut low_ops = 0;
    for &n in &order {
        let op = g.node(n).op.op_type().to_string();
        let (runs, reason) = if let Some((a, b)) = inserted.get(&n) {
            ("cast".to_string(), format!("inserted: {a} → {b}"))
        } else if let Some((colour, r)) = report.and_then(|r| r.nodes.get(&n)) {
            let d = node_dtype(g, n).map_or("?".into(), |d| d.to_string());
            if *colour == Colour::Low {
                low_ops += 1;
            }
            (d, why(g, r))
        } else {
            let what = if g.node(n).op.is_opaque() {
                "opaque: original dtypes kept"
            } else {
                "not recoloured (no f32 float tensors, or a cast, constant or shape op)"
            };
            ("-".to_string(), what.to_string())
        };
        *per.entry(runs.clone()).or_default() += 1;
        writeln!(s, "# {:width$}  {:<24} {:<6} {reason}", label(g, n), op, runs).ok();
    }
    let counts: Vec<String> = per.iter().map(|(k, v)| format!("{v} {k}")).collect();
    writeln!(s, "# summary: {} nodes: {}", order.len(), counts.join(", ")).ok();
    let mut dirs: BTreeMap<(DType, DType), usize> = BTreeMap::new();
    for (a, b) in inserted.values() {
        *dirs.entry((*a, *b)).or_default() += 1;
    }
    let dir: Vec<String> = dirs.iter().map(|((a, b), n)| format!("{n} {a}→{b}")).collect();
    writeln!(
        s,
        "# casts inserted: {} ({}) at {} colour boundaries",
        inserted.len(),
        if dir.is_empty() { "none".into() } else { dir.join(", ") },
        colour_boundaries(g)
    )
    .ok();
    let bound = bind_inputs(g, dims);
    match &bound {
        Ok((bound, used)) => low_flops_line(&mut s, bound, used),
        Err(e) => {
            writeln!(s, "{}", crate::summary::not_estimated("low-precision FLOPs", g, dims, e)).ok();
        }
    }
    let (wb, wa) = (weight_bytes(before), weight_bytes(g));
    writeln!(s, "# weight bytes: {wb} → {wa} ({:.2}x)", wa as f64 / wb.max(1) as f64).ok();
    if let Some(r) = report {
        for note in &r.notes {
            writeln!(s, "# note: {note}").ok();
        }
    }
    if inserted.len() > low_ops {
        writeln!(
            s,
            "# warning: {} casts for {low_ops} low-precision ops: the conversions may cost more than they save",
            inserted.len()
        )
        .ok();
    }
    let Ok((bound, _)) = bound else { return Ok(s) };
    for n in bound.node_ids() {
        if !matches!(node_dtype(&bound, n), Some(DType::F16 | DType::BF16)) {
            continue;
        }
        if let Some(dims) = gemm_dims(&bound, n) {
            let odd: Vec<String> = dims.iter().filter(|(_, d)| d % 8 != 0).map(|(k, d)| format!("{k}={d}")).collect();
            if !odd.is_empty() {
                writeln!(s, "# note: `{}` has {} — tensor cores want multiples of 8", label(&bound, n), odd.join(", "))
                    .ok();
            }
        }
    }
    Ok(s)
}

/// The share of the FLOPs of `bound` (its inputs bound as `used` says) computed in f16 or bf16.
fn low_flops_line(s: &mut String, bound: &Graph, used: &std::collections::BTreeMap<String, u64>) {
    let total = flops(bound).total();
    let low_flops: u64 = bound
        .node_ids()
        .filter(|&n| matches!(node_dtype(bound, n), Some(DType::F16 | DType::BF16)))
        .filter_map(|n| node_flops(bound, n)?.0)
        .sum();
    let at: Vec<String> = used.iter().map(|(k, v)| format!("{k}={v}")).collect();
    if total > 0 {
        writeln!(
            s,
            "# low-precision FLOPs: {:.1}% of {total} (at {})",
            100.0 * low_flops as f64 / total as f64,
            at.join(", ")
        )
        .ok();
    }
}

/// The reduction and output dims of a matrix product (K, N; channels for Conv).
fn gemm_dims(g: &Graph, n: NodeId) -> Option<Vec<(&'static str, u64)>> {
    let node = g.node(n);
    let shape = |v: Option<ValueId>| v.and_then(|v| g.ty(v).shape.as_ref()?.as_fixed());
    let a = shape(node.input(0))?;
    let out = shape(node.outputs().first().copied())?;
    match &node.op {
        Op::MatMul => Some(vec![("K", *a.last()?), ("N", *out.last()?)]),
        Op::Gemm(at) => Some(vec![("K", if at.transA { a[0] } else { *a.last()? }), ("N", *out.last()?)]),
        Op::Conv(_) | Op::ConvTranspose(_) => Some(vec![("C_in", *a.get(1)?), ("C_out", *out.get(1)?)]),
        _ => None,
    }
}

/// The README's precision table: the default class of every op, for FP16 and BF16.
pub fn precision_table() -> String {
    use mpc_passes::precision::{default_class, Class};
    let mut rows = String::from("| class | what it means | ops (FP16 default) |\n|---|---|---|\n");
    let meaning = |c: Class| match c {
        Class::Low => "runs in the low dtype (FP32 accumulation)",
        Class::F32 => "runs in FP32",
        Class::Follow => "low between low ops, else FP32",
        Class::Clear => "data movement: low next to low ops, else FP32",
    };
    let mut ops: Vec<&str> = mpc_ir::Op::KNOWN.to_vec();
    ops.sort_unstable();
    for class in [Class::Low, Class::F32, Class::Follow, Class::Clear] {
        let names: Vec<&str> = ops
            .iter()
            .copied()
            .filter(|n| mpc_ir::Op::default_of(n).and_then(|op| default_class(&op, DType::F16)) == Some(class))
            .collect();
        rows.push_str(&format!("| {class} | {} | {} |\n", meaning(class), names.join(", ")));
    }
    let never: Vec<&str> = ops
        .iter()
        .copied()
        .filter(|n| mpc_ir::Op::default_of(n).and_then(|op| default_class(&op, DType::F16)).is_none())
        .collect();
    rows.push_str(&format!(
        "| — | never recoloured (keeps its dtypes) | {}, and every opaque op |\n",
        never.join(", ")
    ));
    let moved: Vec<String> = ops
        .iter()
        .filter_map(|n| {
            let op = mpc_ir::Op::default_of(n)?;
            let (a, b) = (default_class(&op, DType::F16)?, default_class(&op, DType::BF16)?);
            (a != b).then(|| format!("{n} ({a} → {b})"))
        })
        .collect();
    rows.push_str(&format!("\nBF16 (`mixed-bf16`) differs only in: {}.\n", moved.join(", ")));
    rows
}
