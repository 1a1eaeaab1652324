//! IR → ONNX.
//!
//! One consistent ai.onnx opset: the model's own where it is ≥ 13, else 13, raised only where an
//! op's internal form needs a later one ([`Op::min_opset`]). Reductions whose axes became an input
//! only in opset 18 are written with the attribute form below it. Initializer data is shared with
//! the graph, so the only copy of the weights made is the output buffer itself.

use std::collections::HashSet;

use bytes::Bytes;
use prost::Message;

use super::proto::{self, attribute_type as at, type_proto, AttributeProto, TensorProto, ValueInfoProto};
use crate::error::{invalid, Result};
use crate::graph::{Def, Graph, NodeId, TypeInfo, ValueId};
use crate::{Attr, Dim, Op, Tensor};

/// The lowest IR version that may carry `opset`.
fn ir_version_for(opset: i64) -> i64 {
    match opset {
        ..=14 => 7,
        15..=18 => 8,
        19..=20 => 9,
        21..=22 => 10,
        _ => 11,
    }
}

/// The ai.onnx opset the graph will be written with.
pub fn export_opset(g: &Graph) -> i64 {
    let mut opset = g.meta.onnx_opset().max(13);
    let dtype = |v: Option<ValueId>| v.and_then(|v| g.ty(v).dtype);
    for n in g.node_ids() {
        let node = g.node(n);
        let op = &node.op;
        opset = opset.max(op.min_opset());
        // BatchNormalization takes parameters of another dtype than X from opset 15.
        if matches!(op, Op::BatchNormalization(_)) && (1..5).any(|i| dtype(node.input(i)) != dtype(node.input(0))) {
            opset = opset.max(15);
        }
        // Most ops accept bf16 from opset 13-16; activations such as Elu or Softplus only from 22.
        if node.outputs().iter().any(|&o| g.ty(o).dtype == Some(crate::DType::BF16)) && !op.is_opaque() {
            opset = opset.max(22);
        }
        if let Some(since) = op.axes_input_since() {
            let axes = g.node(n).input(1);
            if opset < since && axes.is_some_and(|a| g.constant(a).is_none()) {
                opset = opset.max(since);
            }
        }
    }
    opset
}

/// Encodes the graph as an ONNX model.
pub fn encode_onnx(g: &Graph) -> Result<Vec<u8>> {
    Ok(encode_onnx_parts(g)?.concat())
}

/// Tensors at least this large are written from their own buffers, not copied into the output.
const SHARED_TENSOR_BYTES: usize = 1 << 16;

/// Encodes the graph as an ONNX model in parts whose concatenation is the file: small protobuf
/// framing interleaved with the large tensors' own buffers, so no copy of the weights is made.
///
/// Streams: each node's message is built, encoded and dropped in turn (protobuf lets the elements
/// of a repeated field interleave, so a node's value_info entries follow it); the model's own
/// fields and the graph's length prefix come first, as a part made last.
pub fn encode_onnx_parts(g: &Graph) -> Result<Vec<Bytes>> {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, message, string, WireType};

    let opset = export_opset(g);
    let names = Names::new(g);
    let order = g.topo_order()?;
    let mut parts: Vec<Bytes> = Vec::new();
    let mut buf = Vec::with_capacity(order.len() * 96 + 1024);

    if !g.name.is_empty() {
        string::encode(2, &g.name, &mut buf);
    }
    for &n in &order {
        let (node, infos) = node_proto(g, n, opset, &names)?;
        message::encode(1, &node, &mut buf);
        for vi in infos {
            message::encode(13, &vi, &mut buf);
        }
    }
    for v in g.initializers().filter(|&v| !axes_as_attribute(g, v, opset)) {
        let Some(t) = g.value(v).initializer() else { continue };
        let mut p = tensor_proto(&names.get(g, v), t);
        if p.raw_data.len() < SHARED_TENSOR_BYTES {
            message::encode(5, &p, &mut buf);
            continue;
        }
        // The tensor's fields, then raw_data's key and length here; its bytes as their own part.
        let raw = std::mem::take(&mut p.raw_data);
        let len = p.encoded_len() + key_len(9) + encoded_len_varint(raw.len() as u64) + raw.len();
        encode_key(5, WireType::LengthDelimited, &mut buf);
        encode_varint(len as u64, &mut buf);
        p.encode(&mut buf).map_err(|e| invalid(format!("encoding failed: {e}")))?;
        encode_key(9, WireType::LengthDelimited, &mut buf);
        encode_varint(raw.len() as u64, &mut buf);
        parts.push(Bytes::from(std::mem::take(&mut buf)));
        parts.push(raw);
    }
    for &v in g.inputs() {
        message::encode(11, &value_info_proto(&names.get(g, v), g.ty(v)), &mut buf);
    }
    for &v in g.outputs() {
        message::encode(12, &value_info_proto(&names.get(g, v), g.ty(v)), &mut buf);
    }
    parts.push(Bytes::from(buf));

    let graph_len: usize = parts.iter().map(|p| p.len()).sum();
    let mut prefix = model_head(g, opset).encode_to_vec();
    encode_key(7, WireType::LengthDelimited, &mut prefix);
    encode_varint(graph_len as u64, &mut prefix);
    parts.insert(0, Bytes::from(prefix));
    Ok(parts)
}

/// The model's own fields (everything but the graph).
fn model_head(g: &Graph, opset: i64) -> proto::ModelProto {
    let meta = &g.meta;
    let mut opset_import: Vec<proto::OperatorSetIdProto> = meta
        .opsets
        .iter()
        .filter(|(d, _)| !d.is_empty() && d != "ai.onnx")
        .map(|(domain, version)| proto::OperatorSetIdProto { domain: domain.clone(), version: *version })
        .collect();
    opset_import.insert(0, proto::OperatorSetIdProto { domain: String::new(), version: opset });
    proto::ModelProto {
        ir_version: meta.ir_version.max(ir_version_for(opset)),
        opset_import,
        producer_name: if meta.producer_name.is_empty() { "mpc".into() } else { meta.producer_name.clone() },
        producer_version: meta.producer_version.clone(),
        domain: meta.domain.clone(),
        model_version: meta.model_version,
        doc_string: meta.doc_string.clone(),
        graph: None,
        metadata_props: meta
            .metadata_props
            .iter()
            .map(|(k, v)| proto::StringStringEntryProto { key: k.clone(), value: v.clone() })
            .collect(),
        functions: meta.functions.clone(),
    }
}

/// An initializer that only feeds reduction axes written back as attributes (below opset 18).
fn axes_as_attribute(g: &Graph, v: ValueId, opset: i64) -> bool {
    let uses = g.value(v).uses();
    !uses.is_empty()
        && !g.is_output(v)
        && uses.iter().all(|u| u.slot == 1 && g.node(u.node).op.axes_input_since().is_some_and(|s| opset < s))
}

/// One node in the target opset's form, with the value_info entries of its outputs.
fn node_proto(g: &Graph, n: NodeId, opset: i64, names: &Names) -> Result<(proto::NodeProto, Vec<ValueInfoProto>)> {
    let nd = g.node(n);
    let mut inputs: Vec<Option<ValueId>> = nd.inputs().to_vec();
    let mut attrs = nd.op.attrs();
    if let Op::Opaque(o) = &nd.op {
        inputs.truncate(o.explicit_inputs);
    }
    if nd.op.axes_input_since().is_some_and(|since| opset < since) {
        if let Some(axes) = nd.input(1) {
            let t = g.constant(axes).ok_or_else(|| invalid("reduction axes must be constant"))?;
            attrs.insert(0, ("axes".into(), Attr::Ints(t.to_i64_vec().unwrap_or_default())));
        }
        inputs.truncate(1);
    }
    while inputs.last() == Some(&None) {
        inputs.pop();
    }
    let mut infos = Vec::new();
    let output: Vec<String> = nd.outputs().iter().map(|&o| names.get(g, o)).collect();
    for (&o, name) in nd.outputs().iter().zip(&output) {
        if !name.is_empty() && !g.is_output(o) && g.ty(o).dtype.is_some() {
            infos.push(value_info_proto(name, g.ty(o)));
        }
    }
    let node = proto::NodeProto {
        input: inputs.iter().map(|i| i.map(|v| names.get(g, v)).unwrap_or_default()).collect(),
        output,
        name: nd.name.clone(),
        op_type: nd.op.op_type().to_string(),
        domain: nd.op.domain().to_string(),
        attribute: attrs.into_iter().map(|(k, a)| attribute(k, a)).collect::<Result<_>>()?,
        ..Default::default()
    };
    Ok((node, infos))
}

/// Value names for export: the graph's own, with names made up for anonymous values that are read.
struct Names {
    made_up: Vec<Option<String>>,
}

impl Names {
    fn new(g: &Graph) -> Names {
        let mut taken: HashSet<String> = HashSet::new();
        let mut made_up = Vec::new();
        for v in g.value_ids() {
            let val = g.value(v);
            let needs = val.name.is_empty()
                && !matches!(val.def(), Def::None)
                && (!val.uses().is_empty() || g.is_output(v) || !matches!(val.def(), Def::Node(..)));
            made_up.push(needs.then(|| {
                let name =
                    (0..).map(|i| format!("_v{}_{i}", v.index())).find(|n| g.find(n).is_none() && !taken.contains(n));
                let name = name.unwrap_or_default();
                taken.insert(name.clone());
                name
            }));
        }
        Names { made_up }
    }

    fn get(&self, g: &Graph, v: ValueId) -> String {
        match &self.made_up[v.index()] {
            Some(n) => n.clone(),
            None => g.name(v).to_string(),
        }
    }
}

pub(crate) fn tensor_proto(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: t.dtype().onnx_code(),
        name: name.to_string(),
        raw_data: t.bytes().clone(),
        ..Default::default()
    }
}

fn value_info_proto(name: &str, ty: &TypeInfo) -> ValueInfoProto {
    use proto::tensor_shape_proto::{dimension, Dimension};
    let shape = ty.shape.as_ref().map(|s| proto::TensorShapeProto {
        dim: s
            .dims()
            .iter()
            .map(|d| Dimension {
                value: match d {
                    Dim::Fixed(n) => Some(dimension::Value::DimValue(*n as i64)),
                    Dim::Sym(p) => Some(dimension::Value::DimParam(p.to_string())),
                    Dim::Unknown => None,
                },
                denotation: String::new(),
            })
            .collect(),
    });
    let tensor = type_proto::Tensor { elem_type: ty.dtype.map_or(0, |d| d.onnx_code()), shape };
    ValueInfoProto {
        name: name.to_string(),
        r#type: Some(proto::TypeProto {
            value: Some(type_proto::Value::TensorType(tensor)),
            denotation: String::new(),
        }),
        doc_string: String::new(),
    }
}

fn attribute(name: String, a: Attr) -> Result<AttributeProto> {
    let mut p = AttributeProto { name, ..Default::default() };
    match a {
        Attr::Int(i) => (p.r#type, p.i) = (at::INT, i),
        Attr::Float(f) => (p.r#type, p.f) = (at::FLOAT, f),
        Attr::String(s) => (p.r#type, p.s) = (at::STRING, s.into_bytes().into()),
        Attr::Ints(v) => (p.r#type, p.ints) = (at::INTS, v),
        Attr::Floats(v) => (p.r#type, p.floats) = (at::FLOATS, v),
        Attr::Strings(v) => {
            (p.r#type, p.strings) = (at::STRINGS, v.into_iter().map(|s| s.into_bytes().into()).collect())
        }
        Attr::Tensor(t) => (p.r#type, p.t) = (at::TENSOR, Some(tensor_proto("", &t))),
        Attr::Raw(bytes) => {
            let mut raw = AttributeProto::decode(bytes).map_err(|e| invalid(format!("attribute `{}`: {e}", p.name)))?;
            raw.name = p.name;
            return Ok(raw);
        }
    }
    Ok(p)
}
