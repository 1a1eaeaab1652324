//! Text IR parser: one statement per line, values must be defined before they are read.

use std::collections::HashMap;

use bytes::Bytes;

use super::FORMAT_VERSION;
use crate::graph::{Graph, TypeInfo, ValueId};
use crate::{Attr, Attrs, DType, Dim, IrError, Op, Opaque, Result, Shape, Tensor};

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Value(u32),
    Str(String),
    Ident(String),
    Num(String),
    Punct(char),
    ColonColon,
}

fn lex(line: &str) -> Result<Vec<Tok>, String> {
    let b: Vec<char> = line.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            break;
        } else if c == '%' {
            let start = i + 1;
            i = start;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let s: String = b[start..i].iter().collect();
            out.push(Tok::Value(s.parse().map_err(|_| format!("bad value id `%{s}`"))?));
        } else if c == '"' {
            let (s, next) = unquote(&b, i)?;
            out.push(Tok::Str(s));
            i = next;
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push(Tok::ColonColon);
            i += 2;
        } else if c.is_ascii_digit() || (c == '-' && b.get(i + 1).is_some_and(|n| n.is_ascii_alphanumeric())) {
            let start = i;
            i += 1;
            while i < b.len()
                && (b[i].is_ascii_alphanumeric()
                    || b[i] == '.'
                    || (matches!(b[i], '-' | '+') && matches!(b[i - 1], 'e' | 'E')))
            {
                i += 1;
            }
            out.push(Tok::Num(b[start..i].iter().collect()));
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '_' || b[i] == '.') {
                i += 1;
            }
            out.push(Tok::Ident(b[start..i].iter().collect()));
        } else if "[](){},=:|@?.".contains(c) {
            out.push(Tok::Punct(c));
            i += 1;
        } else {
            return Err(format!("unexpected character `{c}`"));
        }
    }
    Ok(out)
}

fn unquote(b: &[char], start: usize) -> Result<(String, usize), String> {
    let mut s = String::new();
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            '"' => return Ok((s, i + 1)),
            '\\' => {
                i += 1;
                match b.get(i) {
                    Some('n') => s.push('\n'),
                    Some('t') => s.push('\t'),
                    Some('r') => s.push('\r'),
                    Some('"') => s.push('"'),
                    Some('\\') => s.push('\\'),
                    Some('u') if b.get(i + 1) == Some(&'{') => {
                        let end = (i..b.len()).find(|&j| b[j] == '}').ok_or("unterminated \\u{...}")?;
                        let hex: String = b[i + 2..end].iter().collect();
                        let c = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32).ok_or("bad \\u escape")?;
                        s.push(c);
                        i = end;
                    }
                    _ => return Err("bad escape in string".into()),
                }
                i += 1;
            }
            c => {
                s.push(c);
                i += 1;
            }
        }
    }
    Err("unterminated string".into())
}

/// A cursor over one line's tokens.
struct Line {
    toks: Vec<Tok>,
    pos: usize,
}

impl Line {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn next(&mut self) -> Result<Tok, String> {
        let t = self.toks.get(self.pos).cloned().ok_or("unexpected end of line")?;
        self.pos += 1;
        Ok(t)
    }
    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(&Tok::Punct(c)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected `{c}`, found {}", self.describe()))
        }
    }
    fn describe(&self) -> String {
        match self.peek() {
            None => "end of line".into(),
            Some(Tok::Value(v)) => format!("`%{v}`"),
            Some(Tok::Str(s)) => format!("\"{s}\""),
            Some(Tok::Ident(s) | Tok::Num(s)) => format!("`{s}`"),
            Some(Tok::Punct(c)) => format!("`{c}`"),
            Some(Tok::ColonColon) => "`::`".into(),
        }
    }
    fn ident(&mut self) -> Result<String, String> {
        match self.next()? {
            Tok::Ident(s) => Ok(s),
            _ => {
                self.pos -= 1;
                Err(format!("expected a name, found {}", self.describe()))
            }
        }
    }
    fn string(&mut self) -> Result<String, String> {
        match self.next()? {
            Tok::Str(s) => Ok(s),
            _ => {
                self.pos -= 1;
                Err(format!("expected a string, found {}", self.describe()))
            }
        }
    }
    fn int(&mut self) -> Result<i64, String> {
        match self.next()? {
            Tok::Num(s) => s.parse().map_err(|_| format!("bad integer `{s}`")),
            _ => {
                self.pos -= 1;
                Err(format!("expected an integer, found {}", self.describe()))
            }
        }
    }
    /// Hex digits, which lex as a number or a name depending on their first character.
    fn hex(&mut self) -> Result<Vec<u8>, String> {
        match self.next()? {
            Tok::Num(s) | Tok::Ident(s) => super::decode_hex(&s),
            _ => Err("expected hex data".into()),
        }
    }
    fn done(&self) -> Result<(), String> {
        match self.peek() {
            None => Ok(()),
            Some(_) => Err(format!("unexpected {} at end of line", self.describe())),
        }
    }
}

pub(super) struct Parser<'a> {
    g: Graph,
    ids: HashMap<u32, ValueId>,
    sidecar: Option<&'a [u8]>,
    seen_graph: bool,
    seen_end: bool,
}

impl<'a> Parser<'a> {
    pub(super) fn new(sidecar: Option<&'a [u8]>) -> Self {
        Parser { g: Graph::default(), ids: HashMap::new(), sidecar, seen_graph: false, seen_end: false }
    }

    pub(super) fn parse(mut self, text: &str) -> Result<Graph> {
        let mut first = true;
        for (i, raw) in text.lines().enumerate() {
            let err = |msg: String| IrError::Parse { line: i + 1, msg };
            let toks = lex(raw).map_err(err)?;
            if toks.is_empty() {
                continue;
            }
            let mut l = Line { toks, pos: 0 };
            if first {
                first = false;
                let magic = (l.ident(), l.int());
                if !matches!(magic, (Ok(ref m), Ok(FORMAT_VERSION)) if m == "mpcir") {
                    return Err(err(format!("not an mpc text IR file (expected `mpcir {FORMAT_VERSION}`)")));
                }
                continue;
            }
            if self.seen_end {
                return Err(err("text after `end`".into()));
            }
            self.statement(&mut l).and_then(|()| l.done()).map_err(err)?;
        }
        if !self.seen_end {
            return Err(IrError::Parse { line: text.lines().count(), msg: "missing `end`".into() });
        }
        self.g.check_structure()?;
        self.g.train = crate::TrainSignature::take_from_metadata(&mut self.g)?;
        Ok(self.g)
    }

    fn statement(&mut self, l: &mut Line) -> Result<(), String> {
        match l.peek() {
            Some(Tok::Ident(k)) => match k.as_str() {
                "model" => {
                    l.pos += 1;
                    while l.peek().is_some() {
                        let key = l.ident()?;
                        l.expect('=')?;
                        let m = &mut self.g.meta;
                        match key.as_str() {
                            "ir_version" => m.ir_version = l.int()?,
                            "model_version" => m.model_version = l.int()?,
                            "producer_name" => m.producer_name = l.string()?,
                            "producer_version" => m.producer_version = l.string()?,
                            "domain" => m.domain = l.string()?,
                            "doc_string" => m.doc_string = l.string()?,
                            _ => return Err(format!("unknown model field `{key}`")),
                        }
                    }
                    Ok(())
                }
                "opset" => {
                    l.pos += 1;
                    let (d, v) = (l.string()?, l.int()?);
                    self.g.meta.opsets.push((d, v));
                    Ok(())
                }
                "meta" => {
                    l.pos += 1;
                    let (k, v) = (l.string()?, l.string()?);
                    self.g.meta.metadata_props.push((k, v));
                    Ok(())
                }
                "function" => {
                    l.pos += 1;
                    let f = l.hex()?;
                    self.g.meta.functions.push(Bytes::from(f));
                    Ok(())
                }
                "graph" => {
                    l.pos += 1;
                    self.g.name = l.string()?;
                    self.seen_graph = true;
                    Ok(())
                }
                "input" => {
                    l.pos += 1;
                    self.need_graph()?;
                    let (id, name, ty) = self.decl(l)?;
                    let v = self.g.add_input(&name, ty);
                    self.define(id, v, &name)
                }
                "init" => {
                    l.pos += 1;
                    self.need_graph()?;
                    let id = value_tok(l)?;
                    let name = if let Some(Tok::Str(_)) = l.peek() { l.string()? } else { String::new() };
                    l.expect('=')?;
                    let t = self.tensor(l)?;
                    let v = self.g.add_initializer(&name, t);
                    self.define(id, v, &name)
                }
                "output" => {
                    l.pos += 1;
                    loop {
                        let v = self.use_value(value_tok(l)?)?;
                        self.g.add_new_output(v).map_err(|e| e.to_string())?;
                        if !l.eat(',') {
                            return Ok(());
                        }
                    }
                }
                "end" => {
                    l.pos += 1;
                    self.seen_end = true;
                    Ok(())
                }
                _ => Err(format!("unknown statement `{k}`")),
            },
            Some(Tok::Value(_)) | Some(Tok::Punct('=')) => self.need_graph().and_then(|()| self.node(l)),
            _ => Err(format!("unexpected {}", l.describe())),
        }
    }

    fn need_graph(&self) -> Result<(), String> {
        if self.seen_graph {
            Ok(())
        } else {
            Err("values must come after the `graph` line".into())
        }
    }

    fn define(&mut self, id: u32, v: ValueId, name: &str) -> Result<(), String> {
        if !name.is_empty() && self.g.name(v) != name {
            return Err(format!("value name \"{name}\" is used twice"));
        }
        if self.ids.insert(id, v).is_some() {
            return Err(format!("%{id} is defined twice"));
        }
        Ok(())
    }

    fn use_value(&self, id: u32) -> Result<ValueId, String> {
        self.ids.get(&id).copied().ok_or_else(|| format!("%{id} is not defined before this line"))
    }

    /// `%N ["name"]: type`
    fn decl(&mut self, l: &mut Line) -> Result<(u32, String, TypeInfo), String> {
        let id = value_tok(l)?;
        let name = if let Some(Tok::Str(_)) = l.peek() { l.string()? } else { String::new() };
        l.expect(':')?;
        let dtype = if l.eat('?') { None } else { Some(dtype(&l.ident()?)?) };
        let shape = if l.peek() == Some(&Tok::Punct('[')) { Some(dims(l)?) } else { None };
        Ok((id, name, TypeInfo { dtype, shape }))
    }

    fn node(&mut self, l: &mut Line) -> Result<(), String> {
        let mut outs = Vec::new();
        if !l.eat('=') {
            loop {
                outs.push(self.decl(l)?);
                if !l.eat(',') {
                    break;
                }
            }
            l.expect('=')?;
        }
        let op_line = l.pos;
        // An opaque op's type is a name, or quoted when it is not one.
        let opaque_type = |l: &mut Line| match l.peek() {
            Some(Tok::Str(_)) => l.string(),
            _ => l.ident(),
        };
        let (domain, op_type) = match (l.next()?, l.peek()) {
            (Tok::ColonColon, _) => (Some(String::new()), opaque_type(l)?),
            (Tok::Ident(d) | Tok::Str(d), Some(Tok::ColonColon)) => {
                l.pos += 1;
                (Some(d), opaque_type(l)?)
            }
            (Tok::Ident(op), _) => (None, op),
            _ => {
                l.pos = op_line;
                return Err(format!("expected an op, found {}", l.describe()));
            }
        };
        let attrs = if l.eat('[') { self.attrs(l)? } else { Vec::new() };
        let (inputs, explicit) = self.node_inputs(l)?;
        let name = if l.eat('@') { l.string()? } else { String::new() };
        let op = match domain {
            Some(domain) if domain == crate::ops::MPC_DOMAIN && Op::MPC_KNOWN.contains(&op_type.as_str()) => {
                match Op::from_mpc_attrs(&op_type, attrs) {
                    Some(r) => r.map_err(|e| format!("{domain}::{op_type}: {e}"))?,
                    None => unreachable!("MPC_KNOWN lists the ai.mpc ops"),
                }
            }
            Some(domain) => {
                let explicit_inputs = explicit.unwrap_or(inputs.len());
                Op::Opaque(Box::new(Opaque { domain, op_type, attrs, explicit_inputs }))
            }
            None => match Op::from_attrs(&op_type, attrs) {
                Some(r) => r.map_err(|e| format!("{op_type}: {e}"))?,
                None => return Err(format!("unknown op `{op_type}` (opaque ops are written `domain::{op_type}`)")),
            },
        };
        self.check_node(&op, &inputs, outs.len()).map_err(|e| match name.is_empty() {
            true => e,
            false => format!("node `{name}` ({}): {e}", op.op_type()),
        })?;
        let mut out_ids = Vec::with_capacity(outs.len());
        for (id, vname, ty) in &outs {
            let v = self.g.new_value(vname, ty.clone());
            self.define(*id, v, vname)?;
            out_ids.push(v);
        }
        self.g.add_node(name, op, inputs, out_ids);
        Ok(())
    }

    /// A node's inputs, `(%1, _, %2 | %3)`: each a value or `_` (absent), and the count before
    /// `|` where there is one (an opaque op's explicit inputs; after it, what its subgraphs read).
    fn node_inputs(&mut self, l: &mut Line) -> Result<(Vec<Option<ValueId>>, Option<usize>), String> {
        l.expect('(')?;
        let mut inputs = Vec::new();
        let mut explicit = None;
        // An opaque op with no explicit inputs lists only what its subgraphs read: `(| %3)`.
        if l.eat('|') {
            explicit = Some(0);
        }
        if !l.eat(')') {
            loop {
                match l.peek() {
                    Some(Tok::Ident(u)) if u == "_" => {
                        l.pos += 1;
                        inputs.push(None);
                    }
                    _ => inputs.push(Some(self.use_value(value_tok(l)?)?)),
                }
                if l.eat('|') {
                    explicit = Some(inputs.len());
                    continue;
                }
                if l.eat(')') {
                    break;
                }
                l.expect(',')?;
            }
        }
        Ok((inputs, explicit))
    }

    /// Checks a parsed node as the ONNX reader does: its op's arity and operand dtypes, its
    /// attributes, and an opaque op's subgraphs against the values listed after `|`.
    fn check_node(&self, op: &Op, inputs: &[Option<ValueId>], outputs: usize) -> Result<(), String> {
        let sig: Vec<(bool, Option<DType>)> =
            inputs.iter().map(|v| (v.is_some(), v.and_then(|v| self.g.ty(v).dtype))).collect();
        crate::onnx::schema::check_op(op, self.g.meta.onnx_opset(), &sig, &vec![true; outputs])?;
        op.validate(inputs.len())?;
        let Op::Opaque(o) = op else { return Ok(()) };
        crate::onnx::check_subgraphs(&o.attrs, &self.g)?;
        // The values after `|` are the outer values the subgraphs read, no more, no fewer.
        let listed: Vec<ValueId> = inputs[o.explicit_inputs.min(inputs.len())..].iter().flatten().copied().collect();
        let read = crate::onnx::captures(&o.attrs, &self.g);
        if listed.len() == read.len() && read.iter().all(|v| listed.contains(v)) {
            return Ok(());
        }
        let names: Vec<&str> = read.iter().map(|&v| self.g.name(v)).collect();
        Err(format!("its subgraphs read {}, which must be the values after `|`", names.join(", ")))
    }

    fn attrs(&mut self, l: &mut Line) -> Result<Attrs, String> {
        let mut out = Vec::new();
        loop {
            let key = match l.next()? {
                Tok::Ident(k) | Tok::Str(k) => k,
                _ => return Err("expected an attribute name".into()),
            };
            l.expect('=')?;
            out.push((key, self.attr(l)?));
            if l.eat(']') {
                return Ok(out);
            }
            l.expect(',')?;
        }
    }

    fn attr(&mut self, l: &mut Line) -> Result<Attr, String> {
        match l.next()? {
            Tok::Num(s) => scalar(&s),
            Tok::Str(s) => Ok(Attr::String(s)),
            Tok::Ident(s) if s == "inf" || s == "NaN" => scalar(&s),
            Tok::Ident(s) if matches!(s.as_str(), "ints" | "floats" | "strings") => {
                l.expect('[')?;
                l.expect(']')?;
                Ok(match s.as_str() {
                    "ints" => Attr::Ints(vec![]),
                    "floats" => Attr::Floats(vec![]),
                    _ => Attr::Strings(vec![]),
                })
            }
            Tok::Ident(s) if s == "raw" => {
                l.expect('(')?;
                let b = l.hex()?;
                l.expect(')')?;
                Ok(Attr::Raw(Bytes::from(b)))
            }
            Tok::Ident(_) => {
                l.pos -= 1;
                Ok(Attr::Tensor(self.tensor(l)?))
            }
            Tok::Punct('[') => {
                let mut items = Vec::new();
                loop {
                    items.push(self.attr(l)?);
                    if l.eat(']') {
                        break;
                    }
                    l.expect(',')?;
                }
                list(items)
            }
            _ => {
                l.pos -= 1;
                Err(format!("expected an attribute value, found {}", l.describe()))
            }
        }
    }

    /// `dtype[dims]{elements}` or `dtype[dims]@sidecar(offset, len)`.
    fn tensor(&mut self, l: &mut Line) -> Result<Tensor, String> {
        let dt = dtype(&l.ident()?)?;
        let shape = dims(l)?.as_fixed().ok_or("tensor shapes must be fixed")?;
        if l.eat('@') {
            if l.ident()? != "sidecar" {
                return Err("expected `sidecar(offset, length)`".into());
            }
            l.expect('(')?;
            let off = l.int()? as usize;
            l.expect(',')?;
            let len = l.int()? as usize;
            l.expect(')')?;
            let side = self.sidecar.ok_or("tensor data is in a sidecar file that was not found")?;
            let data =
                side.get(off..off.saturating_add(len)).ok_or("tensor data lies past the end of the sidecar file")?;
            return Tensor::from_bytes(dt, shape, Bytes::copy_from_slice(data));
        }
        l.expect('{')?;
        let mut data = Vec::new();
        if l.eat('}') {
            return Tensor::from_bytes(dt, shape, Bytes::from(data));
        }
        loop {
            match l.next()? {
                Tok::Num(s) | Tok::Ident(s) => element(dt, &s, &mut data)?,
                Tok::Punct('.') => return Err("tensor data was elided (`{...}`): this text is a summary".into()),
                _ => return Err("expected a tensor element".into()),
            }
            if l.eat('}') {
                break;
            }
            l.expect(',')?;
        }
        Tensor::from_bytes(dt, shape, Bytes::from(data))
    }
}

fn value_tok(l: &mut Line) -> Result<u32, String> {
    match l.next()? {
        Tok::Value(v) => Ok(v),
        _ => {
            l.pos -= 1;
            Err(format!("expected a value (`%N`), found {}", l.describe()))
        }
    }
}

fn dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

fn dims(l: &mut Line) -> Result<Shape, String> {
    l.expect('[')?;
    let mut out = Vec::new();
    if l.eat(']') {
        return Ok(Shape(out));
    }
    loop {
        out.push(match l.next()? {
            Tok::Num(n) => Dim::Fixed(n.parse().map_err(|_| format!("bad dimension `{n}`"))?),
            Tok::Ident(s) | Tok::Str(s) => Dim::from_expr(crate::SymExpr::parse(&s)),
            Tok::Punct('?') => Dim::Unknown,
            _ => return Err("expected a dimension".into()),
        });
        if l.eat(']') {
            return Ok(Shape(out));
        }
        l.expect(',')?;
    }
}

fn is_float_text(s: &str) -> bool {
    s.contains(['.', 'e', 'E']) || s.contains("inf") || s.contains("NaN")
}

fn scalar(s: &str) -> Result<Attr, String> {
    if is_float_text(s) {
        s.parse::<f32>().map(Attr::Float).map_err(|_| format!("bad float `{s}`"))
    } else {
        s.parse::<i64>().map(Attr::Int).map_err(|_| format!("bad integer `{s}`"))
    }
}

fn list(items: Vec<Attr>) -> Result<Attr, String> {
    fn all<T>(items: Vec<Attr>, f: impl Fn(Attr) -> Option<T>) -> Result<Vec<T>, String> {
        items.into_iter().map(|a| f(a).ok_or_else(|| "a list mixes kinds of values".to_string())).collect()
    }
    match items.first() {
        Some(Attr::Int(_)) => all(items, |a| if let Attr::Int(i) = a { Some(i) } else { None }).map(Attr::Ints),
        Some(Attr::Float(_)) => all(items, |a| if let Attr::Float(f) = a { Some(f) } else { None }).map(Attr::Floats),
        Some(Attr::String(_)) => {
            all(items, |a| if let Attr::String(s) = a { Some(s) } else { None }).map(Attr::Strings)
        }
        _ => Err("lists hold ints, floats or strings".into()),
    }
}

/// Parses one element of `dtype` and appends its little-endian bytes; integers are parsed as
/// integers (never through f64) so 64-bit values survive.
fn element(dtype: DType, s: &str, out: &mut Vec<u8>) -> Result<(), String> {
    let bad = || format!("bad {dtype} element `{s}`");
    if dtype.is_float() {
        let v: f64 = s.parse().map_err(|_| bad())?;
        crate::tensor::encode_f64(dtype, v, out);
        return Ok(());
    }
    let v: i128 = s.parse().map_err(|_| bad())?;
    let fits = |lo: i128, hi: i128| {
        if (lo..=hi).contains(&v) {
            Ok(())
        } else {
            Err(bad())
        }
    };
    match dtype {
        DType::I64 => {
            fits(i64::MIN as i128, i64::MAX as i128).map(|()| out.extend_from_slice(&(v as i64).to_le_bytes()))
        }
        DType::U64 => fits(0, u64::MAX as i128).map(|()| out.extend_from_slice(&(v as u64).to_le_bytes())),
        DType::I32 => {
            fits(i32::MIN as i128, i32::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out))
        }
        DType::U32 => fits(0, u32::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out)),
        DType::I16 => {
            fits(i16::MIN as i128, i16::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out))
        }
        DType::U16 => fits(0, u16::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out)),
        DType::I8 => fits(i8::MIN as i128, i8::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out)),
        DType::U8 => fits(0, u8::MAX as i128).map(|()| crate::tensor::encode_f64(dtype, v as f64, out)),
        DType::Bool => fits(0, 1).map(|()| out.push(v as u8)),
        _ => Err(bad()),
    }
}
