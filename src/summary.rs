//! `mpc inspect`'s summary (op counts, parameters per dtype, estimated FLOPs) and `--emit json`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;

use mpc_ir::{DType, Dim, Graph, Op};
use mpc_passes::PassError;
use serde_json::json;

/// Estimated floating-point operations of the matrix products (a multiply-add counts 2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Flops {
    pub matmul: u64,
    pub conv: u64,
    /// Products whose shapes stayed unknown after binding the input dims.
    pub unknown: usize,
}

impl Flops {
    pub fn total(&self) -> u64 {
        self.matmul.saturating_add(self.conv)
    }
}

pub use mpc_runtime::build::{bind_inputs, bind_symbols};

/// FLOPs of one MatMul, Gemm, Attention (and its gradient), Conv or ConvTranspose node:
/// `Some((flops, is_conv))`, with
/// `flops` `None` when its shapes are unknown; `None` for other ops.
pub fn node_flops(g: &Graph, n: mpc_ir::NodeId) -> Option<(Option<u64>, bool)> {
    // Counts too large for 64 bits (only a malformed graph has them) saturate.
    let product = |dims: &[u64]| dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d));
    let fixed = |v: Option<mpc_ir::ValueId>| v.and_then(|v| g.ty(v).shape.as_ref()?.as_fixed());
    let node = g.node(n);
    let out = fixed(node.outputs().first().copied());
    match &node.op {
        Op::MatMul | Op::Gemm(_) => {
            let f = (|| {
                let (a, o) = (fixed(node.input(0))?, out?);
                let k = match &node.op {
                    Op::Gemm(at) if at.transA => a.first().copied().unwrap_or(1),
                    _ => a.last().copied().unwrap_or(1),
                };
                Some(product(&[2, k, product(&o)]))
            })();
            Some((f, false))
        }
        // A fused attention's two products, Q·Kᵀ and P·V: 4·(Q's elements)·Sk; its gradient's
        // four (dP, dV, dQ, dK), as the unfused chain computes them (not the scores it
        // recomputes).
        Op::Attention(a) | Op::AttentionGrad(a) => {
            let at = usize::from(matches!(node.op, Op::AttentionGrad(_)));
            let f = (|| {
                let (q, k) = (fixed(node.input(at))?, fixed(node.input(at + 1))?);
                let axis = if a.layout == mpc_ir::ops::AttentionLayout::Bshd { 1 } else { k.len().checked_sub(2)? };
                let sk = k.get(axis).copied()?;
                Some(product(&[4 * (1 + at as u64), product(&q), sk]))
            })();
            Some((f, false))
        }
        Op::Conv(_) | Op::ConvTranspose(_) => {
            let f = (|| {
                let (x, w, o) = (fixed(node.input(0))?, fixed(node.input(1))?, out?);
                let kernel = product(w.get(2..).unwrap_or(&[]));
                let per = w.get(1).copied().unwrap_or(1).saturating_mul(kernel);
                // Conv: each output element takes (C_in / group) · kernel multiply-adds;
                // ConvTranspose: each input element scatters into (C_out / group) · kernel outputs.
                let elems = if matches!(node.op, Op::Conv(_)) { product(&o) } else { product(&x) };
                Some(product(&[2, elems, per]))
            })();
            Some((f, true))
        }
        _ => None,
    }
}

/// FLOPs of MatMul, Gemm, Conv and ConvTranspose from the graph's current shapes.
pub fn flops(g: &Graph) -> Flops {
    let mut f = Flops::default();
    for n in g.node_ids() {
        match node_flops(g, n) {
            Some((None, _)) => f.unknown += 1,
            Some((Some(x), true)) => f.conv = f.conv.saturating_add(x),
            Some((Some(x), false)) => f.matmul = f.matmul.saturating_add(x),
            None => {}
        }
    }
    f
}

fn human(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `n` bytes in B, KiB, MiB or GiB.
pub(crate) fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.2} MiB", n as f64 / (1u64 << 20) as f64),
        n if n >= 1 << 10 => format!("{:.1} KiB", n as f64 / 1024.0),
        n => format!("{n} B"),
    }
}

/// The summary printed after the text IR by `mpc inspect`, as `#` comment lines.
pub fn summarize(g: &Graph, dims: &HashMap<String, u64>) -> Result<String, PassError> {
    let mut s = String::new();
    let mut ops: BTreeMap<String, usize> = BTreeMap::new();
    for n in g.node_ids() {
        let op = &g.node(n).op;
        let key = match op {
            Op::Opaque(o) if !o.domain.is_empty() => format!("{}::{}", o.domain, o.op_type),
            Op::Opaque(o) => format!("::{} (opaque)", o.op_type),
            _ => op.op_type().to_string(),
        };
        *ops.entry(key).or_default() += 1;
    }
    let inits: Vec<_> = g.initializers().collect();
    writeln!(
        s,
        "# {} nodes, {} initializers, {} inputs, {} outputs; ai.onnx opset {}",
        g.node_count(),
        inits.len(),
        g.inputs().len(),
        g.outputs().len(),
        g.meta.onnx_opset()
    )
    .ok();
    let ops: Vec<String> = ops.iter().map(|(k, v)| format!("{k} {v}")).collect();
    writeln!(s, "# ops: {}", ops.join(", ")).ok();
    let mut per: BTreeMap<DType, (u64, u64)> = BTreeMap::new();
    for &v in &inits {
        if let Some(t) = g.value(v).initializer() {
            let e = per.entry(t.dtype()).or_default();
            e.0 += t.numel();
            e.1 += t.bytes().len() as u64;
        }
    }
    let params: Vec<String> = per.iter().map(|(d, (n, b))| format!("{d} {} ({})", human(*n), bytes(*b))).collect();
    writeln!(s, "# initializers: {}", if params.is_empty() { "none".into() } else { params.join(", ") }).ok();
    let (bound, used) = match bind_inputs(g, dims) {
        Ok(b) => b,
        Err(e) => {
            writeln!(s, "{}", not_estimated("FLOPs", g, dims, &e)).ok();
            return Ok(s);
        }
    };
    let f = flops(&bound);
    let at: Vec<String> = used.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let at = if at.is_empty() { "the model's own input shapes".to_string() } else { at.join(", ") };
    let mut line =
        format!("# FLOPs at {at}: {} (MatMul/Gemm {}, Conv {})", human(f.total()), human(f.matmul), human(f.conv));
    if f.unknown > 0 {
        write!(line, "; {} products of unknown shape not counted", f.unknown).ok();
    }
    writeln!(s, "{line}").ok();
    Ok(s)
}

/// The comment line saying that `what` was not estimated: the shapes do not hold at the input
/// sizes `dims` gives (1 for the others: a model that keeps its traced sizes in its constants
/// needs them given).
pub(crate) fn not_estimated(what: &str, g: &Graph, dims: &HashMap<String, u64>, e: &PassError) -> String {
    let mut at: BTreeMap<String, u64> = BTreeMap::new();
    for &v in g.inputs() {
        for d in g.ty(v).shape.iter().flat_map(|s| s.dims()) {
            if let Dim::Sym(x) = d {
                for sym in x.symbols() {
                    at.insert(sym.to_string(), dims.get(sym).copied().unwrap_or(1));
                }
            }
        }
    }
    let at: Vec<String> = at.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("# {what}: not estimated at {}: {e}; give the model's sizes with --dim NAME=N", at.join(", "))
}

/// The graph as JSON: interface, initializers by dtype and shape, nodes with attributes.
pub fn to_json(g: &Graph) -> mpc_ir::Result<String> {
    let order = g.topo_order()?;
    let ty = |v: mpc_ir::ValueId| {
        let t = g.ty(v);
        json!({
            "name": g.name(v),
            "dtype": t.dtype.map(|d| d.to_string()),
            "shape": t.shape.as_ref().map(|s| s.dims().iter().map(|d| match d {
                Dim::Fixed(n) => json!(n),
                Dim::Sym(e) => json!(e.to_string()),
                Dim::Unknown => serde_json::Value::Null,
            }).collect::<Vec<_>>()),
        })
    };
    let nodes: Vec<_> = order
        .iter()
        .map(|&n| {
            let node = g.node(n);
            json!({
                "name": node.name,
                "op_type": node.op.op_type(),
                "domain": node.op.domain(),
                "attributes": serde_json::to_value(node.op.attrs()).unwrap_or_default(),
                "inputs": node.inputs().iter().map(|i| i.map(|v| g.name(v).to_string())).collect::<Vec<_>>(),
                "outputs": node.outputs().iter().map(|&o| ty(o)).collect::<Vec<_>>(),
            })
        })
        .collect();
    let doc = json!({
        "name": g.name,
        "opsets": g.meta.opsets.iter().map(|(d, v)| json!({"domain": d, "version": v})).collect::<Vec<_>>(),
        "inputs": g.inputs().iter().map(|&v| ty(v)).collect::<Vec<_>>(),
        "initializers": g.initializers().map(ty).collect::<Vec<_>>(),
        "nodes": nodes,
        "outputs": g.outputs().iter().map(|&v| ty(v)).collect::<Vec<_>>(),
    });
    Ok(serde_json::to_string_pretty(&doc).unwrap_or_default() + "\n")
}
