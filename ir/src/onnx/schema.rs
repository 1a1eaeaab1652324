//! The signature of every ai.onnx operator version, and the checks a node must pass against it.
//!
//! `schemas.tsv` is generated from the `onnx` package by `make_schemas.py` (one line per op and
//! `since_version`; the format is written at the top of the script). A node is checked against the
//! version in force at its model's opset: input and output counts, required inputs and outputs
//! present, every attribute known to the op and of its kind, required attributes given, and the
//! dtypes of the inputs whose dtypes are known against the op's type constraints. These are the
//! checks `onnx.checker` makes, so a model mpc accepts is one the checker accepts.

use std::collections::HashMap;
use std::sync::OnceLock;

use prost::Message;

use crate::{Attr, DType, Op};

const TABLE: &str = include_str!("schemas.tsv");

/// How many values a formal parameter takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    Single,
    Optional,
    /// The rest of the list, at least `min` values; `same_type`: all of one dtype.
    Variadic {
        min: usize,
        same_type: bool,
    },
}

/// An input or output of an op.
#[derive(Clone, Debug)]
pub struct Formal {
    pub name: &'static str,
    /// A type variable of [`Schema::types`], or one type (`tensor(int64)`).
    pub ty: &'static str,
    pub arity: Arity,
}

/// An attribute of an op.
#[derive(Clone, Debug)]
pub struct AttrSpec {
    pub name: &'static str,
    /// The kind as ONNX spells it in lower case: `int`, `floats`, `graph`, ...
    pub kind: &'static str,
    pub required: bool,
}

/// One version of one op.
#[derive(Clone, Debug)]
pub struct Schema {
    pub op: &'static str,
    pub since: i64,
    pub deprecated: bool,
    pub inputs_range: (usize, usize),
    pub outputs_range: (usize, usize),
    pub inputs: Vec<Formal>,
    pub outputs: Vec<Formal>,
    pub attrs: Vec<AttrSpec>,
    /// Each type variable and the types it allows (`float`, `int64`, `seq(tensor(float))`, ...).
    pub types: Vec<(&'static str, Vec<&'static str>)>,
}

/// What the table says of an op at an opset.
#[derive(Debug)]
pub enum Lookup<'a> {
    Found(&'a Schema),
    /// The op exists, but only from a later opset.
    NotYet {
        first: i64,
    },
    /// No ai.onnx op of this name.
    Unknown,
}

fn table() -> &'static HashMap<&'static str, Vec<Schema>> {
    static T: OnceLock<HashMap<&'static str, Vec<Schema>>> = OnceLock::new();
    T.get_or_init(|| {
        let mut t: HashMap<&'static str, Vec<Schema>> = HashMap::new();
        for line in TABLE.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
            let s = parse_line(line).unwrap_or_else(|| panic!("schemas.tsv: malformed line `{line}`"));
            t.entry(s.op).or_default().push(s);
        }
        t
    })
}

fn parse_line(line: &'static str) -> Option<Schema> {
    let f: Vec<&'static str> = line.split('\t').collect();
    let [op, since, deprecated, min_in, max_in, min_out, max_out, inputs, outputs, attrs, types] = f[..] else {
        return None;
    };
    let list = |s: &'static str| s.split(',').filter(move |x| !x.is_empty() && *x != "-");
    let formals = |s: &'static str| {
        list(s)
            .map(|p| {
                let (name, rest) = p.split_once(':')?;
                let (ty, arity) = if let Some(t) = rest.strip_suffix('?') {
                    (t, Arity::Optional)
                } else if let Some((t, v)) = rest.rsplit_once('*') {
                    let (min, same_type) = match v.strip_suffix('~') {
                        Some(m) => (m, false),
                        None => (v, true),
                    };
                    (t, Arity::Variadic { min: min.parse().ok()?, same_type })
                } else {
                    (rest, Arity::Single)
                };
                Some(Formal { name, ty, arity })
            })
            .collect::<Option<Vec<_>>>()
    };
    let attrs = list(attrs)
        .map(|a| {
            let (name, kind) = a.split_once(':')?;
            let (kind, required) = match kind.strip_suffix('!') {
                Some(k) => (k, true),
                None => (kind, false),
            };
            Some(AttrSpec { name, kind, required })
        })
        .collect::<Option<Vec<_>>>()?;
    let types = types
        .split(';')
        .filter(|x| *x != "-")
        .map(|t| t.split_once('=').map(|(v, allowed)| (v, allowed.split('|').collect())))
        .collect::<Option<Vec<_>>>()?;
    Some(Schema {
        op,
        since: since.parse().ok()?,
        deprecated: deprecated == "1",
        inputs_range: (min_in.parse().ok()?, max_in.parse().ok()?),
        outputs_range: (min_out.parse().ok()?, max_out.parse().ok()?),
        inputs: formals(inputs)?,
        outputs: formals(outputs)?,
        attrs,
        types,
    })
}

/// The version of `op` in force at `opset`. A deprecated version counts as the one before it
/// (older exporters still write Upsample and Scatter at opsets that deprecated them, and mpc
/// reads them as such).
pub fn lookup(op: &str, opset: i64) -> Lookup<'static> {
    let Some(versions) = table().get(op) else {
        return Lookup::Unknown;
    };
    match versions.iter().rev().find(|s| s.since <= opset && !s.deprecated) {
        Some(s) => Lookup::Found(s),
        None => Lookup::NotYet { first: versions[0].since },
    }
}

/// The first opset in which `op` takes these inputs and gives these outputs, of these dtypes
/// (`None`: in none).
pub fn first_accepting(op: &str, inputs: &[(bool, Option<DType>)], outputs: &[Option<DType>]) -> Option<i64> {
    let fits = |(lo, hi): (usize, usize), n: usize| lo <= n && n <= hi;
    table()
        .get(op)?
        .iter()
        .find(|s| {
            // The inputs given must be ones the version has (Pad's `axes` came in 18).
            let given = inputs.iter().rposition(|&(g, _)| g).map_or(0, |i| i + 1);
            !s.deprecated
                && fits(s.inputs_range, given.max(s.inputs_range.0))
                && fits(s.outputs_range, outputs.len())
                && s.check_types(inputs, outputs).is_ok()
        })
        .map(|s| s.since)
}

/// The newest version of `op` (the internal form of the ops mpc models).
pub fn newest(op: &str) -> Option<&'static Schema> {
    table().get(op)?.iter().rev().find(|s| !s.deprecated)
}

/// The ONNX name of a dtype in type constraints.
fn onnx_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "double",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U64 => "uint64",
        DType::U32 => "uint32",
        DType::U16 => "uint16",
        DType::U8 => "uint8",
        DType::Bool => "bool",
    }
}

/// A node's view for the checks: for each input and output slot whether it is given (a
/// non-empty name), and the dtype where known.
pub struct NodeSig<'a> {
    pub inputs: &'a [(bool, Option<DType>)],
    pub outputs: &'a [bool],
    /// Each attribute's name and kind (as [`AttrSpec::kind`]).
    pub attrs: &'a [(&'a str, &'a str)],
}

impl Schema {
    /// The formal parameter that slot `i` of `formals` binds to.
    fn formal(formals: &[Formal], i: usize) -> Option<&Formal> {
        formals.get(i).or_else(|| formals.last().filter(|f| matches!(f.arity, Arity::Variadic { .. })))
    }

    /// Checks a node against this version; the error says what is wrong, without the node's name.
    pub fn check(&self, n: &NodeSig) -> Result<(), String> {
        let v = format!("{} (opset {})", self.op, self.since);
        let count = |what: &str, have: usize, (lo, hi): (usize, usize)| {
            if have < lo || have > hi {
                let what = if lo == hi && lo == 1 { &what[..what.len() - 1] } else { what };
                return Err(format!("{v} takes {} {what}, not {have}", count_range(lo, hi)));
            }
            Ok(())
        };
        count("inputs", n.inputs.len(), self.inputs_range)?;
        count("outputs", n.outputs.len(), self.outputs_range)?;
        for (i, &(given, _)) in n.inputs.iter().enumerate() {
            match Self::formal(&self.inputs, i) {
                Some(f) if !given && f.arity != Arity::Optional => {
                    return Err(format!("{v} input {i} (`{}`) is required but empty", f.name))
                }
                _ => {}
            }
        }
        for (i, &given) in n.outputs.iter().enumerate() {
            match Self::formal(&self.outputs, i) {
                Some(f) if !given && f.arity == Arity::Single => {
                    return Err(format!("{v} output {i} (`{}`) is required but empty", f.name))
                }
                _ => {}
            }
        }
        for &(name, kind) in n.attrs {
            match self.attrs.iter().find(|a| a.name == name) {
                None => return Err(format!("{v} has no attribute `{name}`")),
                Some(a) if a.kind != kind => {
                    return Err(format!("attribute `{name}` of {v} is {kind} where {} was expected", a.kind))
                }
                Some(_) => {}
            }
        }
        if let Some(a) = self.attrs.iter().find(|a| a.required && !n.attrs.iter().any(|(x, _)| *x == a.name)) {
            return Err(format!("{v} requires attribute `{}`", a.name));
        }
        self.check_types(n.inputs, &[]).map_err(|e| format!("{v}: {e}"))
    }

    /// The dtypes known of the inputs (and outputs) against the type constraints: each in its
    /// variable's list, and the values of one variable of one dtype.
    pub fn check_types(&self, inputs: &[(bool, Option<DType>)], outputs: &[Option<DType>]) -> Result<(), String> {
        let mut bound: HashMap<&str, (String, DType)> = HashMap::new();
        let ins = inputs.iter().enumerate().map(|(i, &(_, d))| ("input", i, d, Self::formal(&self.inputs, i)));
        let outs = outputs.iter().enumerate().map(|(i, &d)| ("output", i, d, Self::formal(&self.outputs, i)));
        for (what, i, dtype, formal) in ins.chain(outs) {
            let (Some(d), Some(f)) = (dtype, formal) else {
                continue;
            };
            let name = onnx_type(d);
            let allowed = match self.types.iter().find(|(tv, _)| *tv == f.ty) {
                Some((_, allowed)) => allowed.contains(&name),
                None => f.ty.strip_prefix("tensor(").and_then(|t| t.strip_suffix(')')) == Some(name),
            };
            if !allowed {
                return Err(format!("{what} {i} (`{}`) is {d}, which `{}` does not allow", f.name, f.ty));
            }
            let heterogeneous = matches!(f.arity, Arity::Variadic { same_type: false, .. });
            if heterogeneous || !self.types.iter().any(|(tv, _)| *tv == f.ty) {
                continue;
            }
            match bound.get(f.ty) {
                Some((other, e)) if *e != d => {
                    return Err(format!("{what} {i} is {d} but {other} is {e}, and both are `{}`", f.ty))
                }
                Some(_) => {}
                None => {
                    bound.insert(f.ty, (format!("{what} {i}"), d));
                }
            }
        }
        Ok(())
    }
}

/// The ONNX kind name of an attribute type code (`AttributeProto.type`), or `None` for 0 and
/// codes ONNX does not define.
pub fn attr_kind(code: i32) -> Option<&'static str> {
    Some(match code {
        1 => "float",
        2 => "int",
        3 => "string",
        4 => "tensor",
        5 => "graph",
        6 => "floats",
        7 => "ints",
        8 => "strings",
        9 => "tensors",
        10 => "graphs",
        11 => "sparse_tensor",
        12 => "sparse_tensors",
        13 => "type_proto",
        14 => "type_protos",
        _ => return None,
    })
}

/// The ONNX kind name of an attribute value (for a value kept encoded, the kind its proto says).
pub fn kind_of(a: &Attr) -> Option<&'static str> {
    match a {
        Attr::Raw(bytes) => attr_kind(super::proto::AttributeProto::decode(bytes.clone()).ok()?.r#type),
        _ => Some(a.kind()),
    }
}

/// Checks a node of the internal form (the text IR's, or one a pass built): a modelled op against
/// its newest version, an opaque standard-domain op against the version at `opset` (0: newest).
/// Other domains pass once their attributes do.
pub fn check_op(op: &Op, opset: i64, inputs: &[(bool, Option<DType>)], outputs: &[bool]) -> Result<(), String> {
    // Every attribute, in any domain, as the ONNX reader takes it: of a kind (one kept encoded must
    // say a valid type), given once, and no reference to a function's attribute.
    let attrs = op.attrs();
    let mut kinds: Vec<(&str, &str)> = Vec::with_capacity(attrs.len());
    for (name, a) in &attrs {
        let kind = kind_of(a).ok_or_else(|| format!("attribute `{name}` has no valid type"))?;
        if kinds.iter().any(|&(n, _)| n == name) {
            return Err(format!("attribute `{name}` is given twice"));
        }
        if let Attr::Raw(bytes) = a {
            if super::proto::AttributeProto::decode(bytes.clone()).is_ok_and(|p| !p.ref_attr_name.is_empty()) {
                return Err(format!("attribute `{name}` refers to a function's attribute outside a function"));
            }
        }
        kinds.push((name.as_str(), kind));
    }
    check_outputs(op, outputs.len())?;
    let (s, inputs) = match op {
        Op::Opaque(o) if o.domain.is_empty() || o.domain == "ai.onnx" => {
            let s = match lookup(&o.op_type, if opset == 0 { i64::MAX } else { opset }) {
                Lookup::Found(s) => s,
                Lookup::NotYet { first } => {
                    return Err(format!("{} is an op of opset {first} and later, not {opset}", o.op_type))
                }
                Lookup::Unknown => return Err(format!("no op `{}` in the ai.onnx domain", o.op_type)),
            };
            (s, &inputs[..o.explicit_inputs.min(inputs.len())])
        }
        Op::Opaque(_) => return Ok(()),
        _ if op.is_mpc() => return check_mpc_arity(op, inputs, outputs.len()),
        _ => (newest(op.op_type()).ok_or_else(|| format!("{} has no schema", op.op_type()))?, inputs),
    };
    s.check(&NodeSig { inputs, outputs, attrs: &kinds })
}

/// ONNX's rules on a node's outputs beyond its op's signature: BatchNormalization's running mean
/// and variance are outputs only in training mode (an inference-mode node computes one output).
pub fn check_outputs(op: &Op, outputs: usize) -> Result<(), String> {
    match op {
        Op::BatchNormalization(a) if !a.training_mode && outputs > 1 => {
            Err(format!("BatchNormalization has one output in inference mode (training_mode=0), not {outputs}"))
        }
        _ => Ok(()),
    }
}

/// A count a signature allows: `2`, `2 to 3`, `at least 1` (ONNX writes "any" as i32::MAX).
fn count_range(lo: usize, hi: usize) -> String {
    match hi {
        _ if lo == hi => format!("{lo}"),
        usize::MAX | 2147483647 => format!("at least {lo}"),
        _ => format!("{lo} to {hi}"),
    }
}

/// The input and output counts of the `ai.mpc` ops (docs/ai-mpc-ops.md), and the inputs that
/// must be given.
fn check_mpc_arity(op: &Op, inputs: &[(bool, Option<DType>)], outputs: usize) -> Result<(), String> {
    let (ins, outs, optional): ((usize, usize), (usize, usize), &[usize]) = match op {
        Op::ConvGrad(_) => ((3, 3), (1, 3), &[]),
        Op::BatchNormalizationGrad(_) | Op::LayerNormalizationGrad(_) => ((3, 3), (1, 3), &[]),
        Op::MaxPoolGrad(_) | Op::AveragePoolGrad(_) | Op::GeluGrad(_) | Op::ReluGrad | Op::SoftmaxGrad(_) => {
            ((2, 2), (1, 1), &[])
        }
        Op::SoftmaxCrossEntropyLossGrad(_) | Op::NegativeLogLikelihoodLossGrad(_) => ((3, 4), (1, 1), &[3]),
        Op::GatherGrad(_) => ((3, 3), (1, 1), &[]),
        Op::Attention(_) => ((3, 4), (2, 2), &[3]),
        Op::AttentionGrad(_) => ((6, 7), (3, 3), &[6]),
        Op::AllFinite => ((1, usize::MAX), (1, 1), &[]),
        // The reductions' second input: whether the ranks combine at all this step.
        Op::AllReduce(_) | Op::ReduceScatter(_) => ((1, 2), (1, 1), &[]),
        Op::AllGather(_) => ((1, 1), (1, 1), &[]),
        Op::SgdUpdate(_) => ((3, 7), (1, 3), &[3, 4, 5]),
        Op::AdamUpdate(_) => ((6, 9), (3, 4), &[6, 7]),
        Op::LossScaleUpdate(_) => ((3, 3), (2, 2), &[]),
        Op::LrSchedule(_) => ((2, 2), (1, 1), &[]),
        Op::SeededDropout(_) => ((2, 3), (1, 2), &[1]),
        _ => return Ok(()),
    };
    let name = format!("ai.mpc::{}", op.op_type());
    let range = |(lo, hi)| count_range(lo, hi);
    if inputs.len() < ins.0 || inputs.len() > ins.1 {
        return Err(format!("{name} takes {} inputs, not {}", range(ins), inputs.len()));
    }
    if outputs < outs.0 || outputs > outs.1 {
        return Err(format!("{name} has {} outputs, not {outputs}", range(outs)));
    }
    // SeededDropout's ratio may be left out only with the key after it.
    let last = inputs.len() - 1;
    let may_be_empty = |i: usize| optional.contains(&i) && (i < last || !matches!(op, Op::SeededDropout(_)));
    match inputs.iter().enumerate().find(|&(i, &(given, _))| !given && !may_be_empty(i)) {
        Some((i, _)) => Err(format!("{name} input {i} is required but empty")),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_parses_and_every_modelled_op_has_a_schema() {
        let n: usize = table().values().map(Vec::len).sum();
        assert!(n > 500, "{n} schemas");
        for op in crate::Op::KNOWN {
            assert!(newest(op).is_some(), "{op} has no schema");
        }
    }

    #[test]
    fn versions_are_found_by_opset() {
        let Lookup::Found(s) = lookup("Resize", 12) else { panic!() };
        assert_eq!(s.since, 11);
        assert!(matches!(lookup("Gelu", 17), Lookup::NotYet { first: 20 }));
        assert!(matches!(lookup("NoSuchOp", 17), Lookup::Unknown));
        // Deprecated versions read as the version before them.
        let Lookup::Found(s) = lookup("Upsample", 13) else { panic!() };
        assert_eq!(s.since, 9);
    }

    #[test]
    fn checks_say_what_is_wrong() {
        let Lookup::Found(conv) = lookup("Conv", 17) else { panic!() };
        let f32 = Some(DType::F32);
        let ok = NodeSig { inputs: &[(true, f32), (true, f32)], outputs: &[true], attrs: &[("group", "int")] };
        conv.check(&ok).unwrap();
        let e = conv.check(&NodeSig { inputs: &[(true, f32)], ..ok }).unwrap_err();
        assert!(e.contains("takes 2 to 3 inputs, not 1"), "{e}");
        let e = conv.check(&NodeSig { inputs: &[(true, f32), (false, None)], ..ok }).unwrap_err();
        assert!(e.contains("input 1 (`W`) is required"), "{e}");
        let e = conv.check(&NodeSig { attrs: &[("bogus", "int")], ..ok }).unwrap_err();
        assert!(e.contains("no attribute `bogus`"), "{e}");
        let e = conv.check(&NodeSig { attrs: &[("group", "float")], ..ok }).unwrap_err();
        assert!(e.contains("`group` of Conv (opset 11) is float where int"), "{e}");
        let e = conv.check(&NodeSig { inputs: &[(true, f32), (true, Some(DType::F16))], ..ok }).unwrap_err();
        assert!(e.contains("input 1 is f16 but input 0 is f32"), "{e}");
        let e = conv.check(&NodeSig { inputs: &[(true, Some(DType::I64)), (true, None)], ..ok }).unwrap_err();
        assert!(e.contains("input 0 (`X`) is i64"), "{e}");
        let Lookup::Found(cast) = lookup("Cast", 17) else { panic!() };
        let e = cast.check(&NodeSig { inputs: &[(true, f32)], outputs: &[true], attrs: &[] }).unwrap_err();
        assert!(e.contains("requires attribute `to`"), "{e}");
    }
}
