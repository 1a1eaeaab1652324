//! Text IR printer. Deterministic: values are numbered inputs first, then initializers in order,
//! then node outputs in the graph's topological order.

use std::fmt::Write;

use half::{bf16, f16};

use super::{Printed, TensorMode, FORMAT_VERSION};
use crate::graph::{Graph, ValueId};
use crate::{Attr, DType, Dim, Op, Result, Tensor};

pub(super) struct Printer<'a> {
    g: &'a Graph,
    mode: TensorMode,
    ids: Vec<Option<u32>>,
    next: u32,
    out: String,
    sidecar: Vec<u8>,
}

impl<'a> Printer<'a> {
    pub(super) fn new(g: &'a Graph, mode: TensorMode) -> Self {
        let ids = vec![None; g.value_ids().count()];
        Printer { g, mode, ids, next: 0, out: String::new(), sidecar: Vec::new() }
    }

    fn number(&mut self, v: ValueId) -> u32 {
        let id = self.next;
        self.ids[v.index()] = Some(id);
        self.next += 1;
        id
    }

    fn id(&self, v: ValueId) -> String {
        match self.ids[v.index()] {
            Some(i) => format!("%{i}"),
            None => format!("%?{}", v.index()),
        }
    }

    pub(super) fn print(mut self) -> Result<Printed> {
        let g = self.g;
        let order = g.topo_order()?;
        let m = &g.meta;
        writeln!(self.out, "mpcir {FORMAT_VERSION}").ok();
        let mut model = format!("model ir_version={}", m.ir_version);
        for (k, v) in [
            ("producer_name", &m.producer_name),
            ("producer_version", &m.producer_version),
            ("domain", &m.domain),
            ("doc_string", &m.doc_string),
        ] {
            if !v.is_empty() {
                write!(model, " {k}={}", quote(v)).ok();
            }
        }
        if m.model_version != 0 {
            write!(model, " model_version={}", m.model_version).ok();
        }
        writeln!(self.out, "{model}").ok();
        for (d, v) in &m.opsets {
            writeln!(self.out, "opset {} {v}", quote(d)).ok();
        }
        let train = g.train.as_ref().map(|t| t.to_metadata(g)).unwrap_or_default();
        for (k, v) in m.metadata_props.iter().chain(&train) {
            writeln!(self.out, "meta {} {}", quote(k), quote(v)).ok();
        }
        for f in &m.functions {
            writeln!(self.out, "function {}", hex(f)).ok();
        }
        writeln!(self.out, "graph {}", quote(&g.name)).ok();
        for &v in g.inputs() {
            let line = format!("  input {}", self.decl(v));
            writeln!(self.out, "{line}").ok();
        }
        for v in g.initializers().collect::<Vec<_>>() {
            let id = self.number(v);
            let t = g.value(v).initializer().expect("initializer");
            let name = g.name(v);
            let mut line = format!("  init %{id}");
            if !name.is_empty() {
                write!(line, " {}", quote(name)).ok();
            }
            line.push_str(" = ");
            self.tensor(&mut line, t);
            writeln!(self.out, "{line}").ok();
        }
        for n in order {
            let node = g.node(n);
            let outs: Vec<String> = node.outputs().iter().map(|&o| self.decl(o)).collect();
            let mut line = format!("  {} = ", outs.join(", "));
            self.op(&mut line, &node.op);
            line.push('(');
            let explicit = match &node.op {
                Op::Opaque(o) => o.explicit_inputs,
                _ => usize::MAX,
            };
            for (i, inp) in node.inputs().iter().enumerate() {
                if i == explicit {
                    line.push_str(" | ");
                } else if i > 0 {
                    line.push_str(", ");
                }
                match inp {
                    Some(v) => line.push_str(&self.id(*v)),
                    None => line.push('_'),
                }
            }
            line.push(')');
            if !node.name.is_empty() {
                write!(line, " @{}", quote(&node.name)).ok();
            }
            writeln!(self.out, "{line}").ok();
        }
        let outs: Vec<String> = g.outputs().iter().map(|&v| self.id(v)).collect();
        // A graph without outputs (a valid, if useless, ONNX graph) has no output line.
        if !outs.is_empty() {
            writeln!(self.out, "  output {}", outs.join(", ")).ok();
        }
        writeln!(self.out, "end").ok();
        Ok(Printed { text: self.out, sidecar: self.sidecar })
    }

    /// `%N "name": type` (name omitted for anonymous values).
    fn decl(&mut self, v: ValueId) -> String {
        let id = self.number(v);
        let val = self.g.value(v);
        let mut s = format!("%{id}");
        if !val.name.is_empty() {
            write!(s, " {}", quote(&val.name)).ok();
        }
        write!(s, ": {}", type_str(&val.ty.dtype.map(|d| d.to_string()), val.ty.shape.as_ref().map(|s| s.dims()))).ok();
        s
    }

    fn op(&mut self, line: &mut String, op: &Op) {
        match op {
            Op::Opaque(o) => write!(line, "{}::{}", quote_domain(&o.domain), ident_or_quote(&o.op_type)).ok(),
            _ if op.is_mpc() => write!(line, "{}::{}", op.domain(), op.op_type()).ok(),
            _ => write!(line, "{}", op.op_type()).ok(),
        };
        let attrs = op.attrs();
        if attrs.is_empty() {
            return;
        }
        line.push('[');
        for (i, (k, a)) in attrs.iter().enumerate() {
            if i > 0 {
                line.push_str(", ");
            }
            write!(line, "{}=", ident_or_quote(k)).ok();
            self.attr(line, a);
        }
        line.push(']');
    }

    fn attr(&mut self, line: &mut String, a: &Attr) {
        match a {
            Attr::Int(i) => write!(line, "{i}").ok(),
            Attr::Float(f) => write!(line, "{}", float(*f as f64, DType::F32)).ok(),
            Attr::String(s) => write!(line, "{}", quote(s)).ok(),
            Attr::Ints(v) if v.is_empty() => write!(line, "ints[]").ok(),
            Attr::Floats(v) if v.is_empty() => write!(line, "floats[]").ok(),
            Attr::Strings(v) if v.is_empty() => write!(line, "strings[]").ok(),
            Attr::Ints(v) => write!(line, "[{}]", join(v.iter().map(|i| i.to_string()))).ok(),
            Attr::Floats(v) => write!(line, "[{}]", join(v.iter().map(|&f| float(f as f64, DType::F32)))).ok(),
            Attr::Strings(v) => write!(line, "[{}]", join(v.iter().map(|s| quote(s)))).ok(),
            Attr::Tensor(t) => {
                self.tensor(line, t);
                Some(())
            }
            Attr::Raw(b) => write!(line, "raw({})", hex(b)).ok(),
        };
    }

    /// `dtype[shape]{v, ...}`, `dtype[shape]@sidecar(offset, len)` or `dtype[shape]{...}`.
    fn tensor(&mut self, line: &mut String, t: &Tensor) {
        let dims: Vec<Dim> = t.shape().iter().map(|&d| Dim::Fixed(d)).collect();
        line.push_str(&type_str(&Some(t.dtype().to_string()), Some(&dims)));
        let n = t.numel() as usize;
        match self.mode {
            TensorMode::Sidecar { max_inline } if n > max_inline => {
                // 64-byte aligned so that a reader may map the sidecar and use it in place.
                let pad = (64 - self.sidecar.len() % 64) % 64;
                self.sidecar.extend(std::iter::repeat_n(0u8, pad));
                let offset = self.sidecar.len();
                self.sidecar.extend_from_slice(t.bytes());
                write!(line, "@sidecar({offset}, {})", t.bytes().len()).ok();
            }
            // Summaries show structure: small integer tensors (axes, shapes) and float scalars.
            TensorMode::Summary { max_inline } if n > max_inline || (t.dtype().is_float() && n > 1) => {
                line.push_str("{...}")
            }
            _ => {
                line.push('{');
                line.push_str(&join(elements(t)));
                line.push('}');
            }
        }
    }
}

fn elements(t: &Tensor) -> impl Iterator<Item = String> + '_ {
    let d = t.dtype();
    t.bytes().chunks_exact(d.size()).map(move |c| match d {
        DType::F16 => float(f16::from_le_bytes([c[0], c[1]]).to_f64(), d),
        DType::BF16 => float(bf16::from_le_bytes([c[0], c[1]]).to_f64(), d),
        DType::F32 => float(f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64, d),
        DType::F64 => float(f64::from_le_bytes(c.try_into().unwrap_or_default()), d),
        DType::I64 => i64::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
        DType::U64 => u64::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
        // Integers of 32 bits or fewer are exact in f64.
        _ => (crate::tensor::decode_f64(d, c) as i64).to_string(),
    })
}

/// The shortest decimal that reads back to the same value in `dtype`, always with a `.`, `e`,
/// `inf` or `NaN` so that it is never mistaken for an integer.
pub(super) fn float(v: f64, dtype: DType) -> String {
    if dtype == DType::F64 {
        format!("{v:?}")
    } else {
        // f16/bf16 values are exact in f32, and f32's shortest form reads back exactly.
        format!("{:?}", v as f32)
    }
}

fn join(items: impl Iterator<Item = String>) -> String {
    items.collect::<Vec<_>>().join(", ")
}

pub(super) fn type_str(dtype: &Option<String>, dims: Option<&[Dim]>) -> String {
    let mut s = dtype.clone().unwrap_or_else(|| "?".into());
    if let Some(dims) = dims {
        let ds: Vec<String> = dims
            .iter()
            .map(|d| match d {
                Dim::Sym(e) => ident_or_quote(&e.to_string()),
                _ => d.to_string(),
            })
            .collect();
        write!(s, "[{}]", ds.join(",")).ok();
    }
    s
}

fn is_ident(s: &str) -> bool {
    let mut c = s.chars();
    matches!(c.next(), Some(ch) if ch.is_ascii_alphabetic() || ch == '_')
        && c.all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
}

fn ident_or_quote(s: &str) -> String {
    if is_ident(s) && s != "_" {
        s.to_string()
    } else {
        quote(s)
    }
}

fn quote_domain(d: &str) -> String {
    if d.split('.').all(is_ident) || d.is_empty() {
        d.to_string()
    } else {
        quote(d)
    }
}

/// A double-quoted string; `"`, `\` and control characters escaped.
pub(super) fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => write!(out, "\\u{{{:x}}}", c as u32).unwrap_or(()),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

pub(super) fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        write!(s, "{x:02x}").ok();
    }
    s
}
