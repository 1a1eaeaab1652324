//! IR → ONNX.
//!
//! One consistent ai.onnx opset: the model's own where it is ≥ 13, else 13, raised only where an
//! op's internal form needs a later one ([`Op::min_opset`]). Reductions whose axes became an input
//! only in opset 18 are written with the attribute form below it. Initializer data is shared with
//! the graph, so the only copy of the weights made is the output buffer itself.

use std::collections::HashSet;

use prost::Message;

use super::proto::{self, attribute_type as at, type_proto, AttributeProto, TensorProto, ValueInfoProto};
use crate::error::{invalid, Result};
use crate::graph::{Def, Graph, TypeInfo, ValueId};
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
    let model = to_proto(g)?;
    let mut buf = Vec::with_capacity(model.encoded_len());
    model.encode(&mut buf).map_err(|e| invalid(format!("encoding failed: {e}")))?;
    Ok(buf)
}

pub fn to_proto(g: &Graph) -> Result<proto::ModelProto> {
    let opset = export_opset(g);
    let names = Names::new(g);
    let order = g.topo_order()?;

    let mut node = Vec::with_capacity(order.len());
    let mut value_info = Vec::new();
    for &n in &order {
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
        for &o in nd.outputs() {
            if !names.get(g, o).is_empty() && !g.is_output(o) && g.ty(o).dtype.is_some() {
                value_info.push(value_info_proto(&names.get(g, o), g.ty(o)));
            }
        }
        node.push(proto::NodeProto {
            input: inputs.iter().map(|i| i.map(|v| names.get(g, v)).unwrap_or_default()).collect(),
            output: nd.outputs().iter().map(|&o| names.get(g, o)).collect(),
            name: nd.name.clone(),
            op_type: nd.op.op_type().to_string(),
            domain: nd.op.domain().to_string(),
            attribute: attrs.into_iter().map(|(k, a)| attribute(k, a)).collect::<Result<_>>()?,
            ..Default::default()
        });
    }

    // Axes written back into attributes leave their initializers unread.
    let as_attribute = |v: ValueId| {
        let uses = g.value(v).uses();
        !uses.is_empty()
            && !g.is_output(v)
            && uses.iter().all(|u| u.slot == 1 && g.node(u.node).op.axes_input_since().is_some_and(|s| opset < s))
    };
    let initializer = g
        .initializers()
        .filter(|&v| !as_attribute(v))
        .filter_map(|v| g.value(v).initializer().map(|t| tensor_proto(&names.get(g, v), t)))
        .collect();
    let input = g.inputs().iter().map(|&v| value_info_proto(&names.get(g, v), g.ty(v))).collect();
    let output = g.outputs().iter().map(|&v| value_info_proto(&names.get(g, v), g.ty(v))).collect();

    let meta = &g.meta;
    let mut opset_import: Vec<proto::OperatorSetIdProto> = meta
        .opsets
        .iter()
        .filter(|(d, _)| !d.is_empty() && d != "ai.onnx")
        .map(|(domain, version)| proto::OperatorSetIdProto { domain: domain.clone(), version: *version })
        .collect();
    opset_import.insert(0, proto::OperatorSetIdProto { domain: String::new(), version: opset });

    Ok(proto::ModelProto {
        ir_version: meta.ir_version.max(ir_version_for(opset)),
        opset_import,
        producer_name: if meta.producer_name.is_empty() { "mpc".into() } else { meta.producer_name.clone() },
        producer_version: meta.producer_version.clone(),
        domain: meta.domain.clone(),
        model_version: meta.model_version,
        doc_string: meta.doc_string.clone(),
        graph: Some(proto::GraphProto {
            node,
            name: g.name.clone(),
            initializer,
            input,
            output,
            value_info,
            ..Default::default()
        }),
        metadata_props: meta
            .metadata_props
            .iter()
            .map(|(k, v)| proto::StringStringEntryProto { key: k.clone(), value: v.clone() })
            .collect(),
        functions: meta.functions.clone(),
    })
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
