//! IR → ONNX.
//!
//! One consistent ai.onnx opset: the model's own where it is ≥ 13, else 13, raised only where an
//! op's internal form needs a later one ([`Op::min_opset`]). Reductions whose axes became an input
//! only in opset 18 are written with the attribute form below it. Initializer data is shared with
//! the graph, so the only copy of the weights made is the output buffer itself.

use std::collections::{HashMap, HashSet};

use prost::Message;

use super::proto::{self, attribute_type as at, AttributeProto, TensorProto};
use crate::error::{invalid, Result};
use crate::graph::{Def, Graph, NodeId, TypeInfo, ValueId};
use crate::ops::SplitAttrs;
use crate::{Attr, ConvertAhead, Dim, Op, Tensor};

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
        // The first version of the op that takes its inputs' dtypes: an op newer than the model's
        // opset (a text IR model may use one), bf16 (most ops from opset 13-16, activations
        // such as Elu from 22), f16 Range (25), BatchNormalization's parameters in another dtype
        // than X (15).
        if !op.is_opaque() && !op.is_mpc() {
            let sig: Vec<(bool, Option<crate::DType>)> =
                node.inputs().iter().map(|&v| (v.is_some(), dtype(v))).collect();
            let outs: Vec<Option<crate::DType>> = node.outputs().iter().map(|&v| g.ty(v).dtype).collect();
            opset = opset.max(super::schema::first_accepting(op.op_type(), &sig, &outs).unwrap_or(0));
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
    let mut out = Vec::new();
    write_onnx(g, &mut out)?;
    Ok(out)
}

/// Writes are gathered into a buffer of this size before they go out.
const CHUNK_BYTES: usize = 1 << 20;

/// Tensors at least this large are written from their own buffers, not copied into the output.
const SHARED_TENSOR_BYTES: usize = 1 << 16;

/// Writes the graph as an ONNX model to `w`, streaming: memory stays at one buffer of
/// [`CHUNK_BYTES`] however large the graph (a training graph's encoding runs to tens of MB), and
/// the weights are written from their own buffers, never copied (weights narrowed to f16/bf16
/// are converted on their way out, a piece at a time).
///
/// Protobuf puts the graph's length before the graph, so the graph is walked twice: once
/// counting the bytes, once writing them. Each node is encoded from the graph's own strings and
/// dropped in turn (protobuf lets the elements of a repeated field interleave, so a node's
/// value_info entries follow it).
pub fn write_onnx(g: &Graph, w: &mut dyn std::io::Write) -> Result<()> {
    use prost::encoding::{encode_key, encode_varint, WireType};

    let opset = export_opset(g);
    let names = Names::new(g);
    let order = g.topo_order()?;
    let mut enc = GraphEncoder {
        g,
        opset,
        names,
        order,
        outputs: g.outputs().iter().copied().collect(),
        scratch: Vec::new(),
        tmp: Vec::new(),
    };
    let mut count = Counter(0);
    enc.graph(&mut count)?;
    let mut head = model_head(g, opset).encode_to_vec();
    encode_key(7, WireType::LengthDelimited, &mut head);
    encode_varint(count.0 as u64, &mut head);
    let large: Vec<&Tensor> =
        written_initializers(g, opset).map(|(_, t)| t).filter(|t| t.byte_len() >= SHARED_TENSOR_BYTES).collect();
    std::thread::scope(|s| {
        let ahead = ConvertAhead::start(s, &large);
        let mut out = Chunked { out: Buffered { w, buf: Vec::with_capacity(CHUNK_BYTES) }, ahead };
        out.put(&head)?;
        enc.graph(&mut out)?;
        out.out.flush()
    })
}

/// Where encoded bytes go: counted (the first walk) or written.
trait Sink {
    fn put(&mut self, bytes: &[u8]) -> Result<()>;

    /// A tensor's data (the bytes of its `raw_data`).
    fn put_data(&mut self, t: &Tensor) -> Result<()>;
}

struct Counter(usize);

impl Sink for Counter {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.0 += bytes.len();
        Ok(())
    }

    fn put_data(&mut self, t: &Tensor) -> Result<()> {
        self.0 += t.byte_len();
        Ok(())
    }
}

/// A writer behind a buffer of [`CHUNK_BYTES`]; large writes (weights) go straight through.
struct Buffered<'w> {
    w: &'w mut dyn std::io::Write,
    buf: Vec<u8>,
}

impl Buffered<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        if self.buf.len() + bytes.len() > CHUNK_BYTES || bytes.len() >= SHARED_TENSOR_BYTES {
            self.flush()?;
        }
        if bytes.len() >= SHARED_TENSOR_BYTES {
            self.w.write_all(bytes)?;
        } else {
            self.buf.extend_from_slice(bytes);
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        self.w.write_all(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

/// The writing walk's sink: the file, and the large initializers' data converted ahead where it
/// is narrowed.
struct Chunked<'w, 't> {
    out: Buffered<'w>,
    ahead: ConvertAhead<'t>,
}

impl Sink for Chunked<'_, '_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out.put(bytes)
    }

    fn put_data(&mut self, t: &Tensor) -> Result<()> {
        self.ahead.put_data(t, |piece| self.out.put(piece))
    }
}

/// The GraphProto's fields, written to a [`Sink`].
struct GraphEncoder<'g> {
    g: &'g Graph,
    opset: i64,
    names: Names,
    order: Vec<NodeId>,
    outputs: HashSet<ValueId>,
    /// A node's fields (its length must precede it).
    scratch: Vec<u8>,
    /// What goes to the sink next.
    tmp: Vec<u8>,
}

/// The initializers written to the graph (not those that become attributes), in order.
fn written_initializers(g: &Graph, opset: i64) -> impl Iterator<Item = (ValueId, &Tensor)> {
    g.initializers()
        .filter(move |&v| !axes_as_attribute(g, v, opset))
        .filter_map(move |v| Some((v, g.value(v).initializer()?)))
}

impl GraphEncoder<'_> {
    fn graph(&mut self, sink: &mut dyn Sink) -> Result<()> {
        use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, message, string, WireType};
        let g = self.g;
        self.tmp.clear();
        if !g.name.is_empty() {
            string::encode(2, &g.name, &mut self.tmp);
        }
        for i in 0..self.order.len() {
            write_node(g, self.order[i], self.opset, &self.names, &self.outputs, &mut self.scratch, &mut self.tmp)?;
            if self.tmp.len() >= SHARED_TENSOR_BYTES {
                sink.put(&self.tmp)?;
                self.tmp.clear();
            }
        }
        for (v, t) in written_initializers(g, self.opset) {
            let name = self.names.get(g, v);
            let raw = t.byte_len();
            if raw < SHARED_TENSOR_BYTES {
                message::encode(5, &tensor_proto(name, t), &mut self.tmp);
                continue;
            }
            // The tensor's other fields, then raw_data's key and length; then its bytes from its
            // own buffer (or converted on the way, see `ConvertAhead`).
            let p = tensor_head(name, t);
            let len = p.encoded_len() + key_len(9) + encoded_len_varint(raw as u64) + raw;
            encode_key(5, WireType::LengthDelimited, &mut self.tmp);
            encode_varint(len as u64, &mut self.tmp);
            p.encode(&mut self.tmp).map_err(|e| invalid(format!("encoding failed: {e}")))?;
            encode_key(9, WireType::LengthDelimited, &mut self.tmp);
            encode_varint(raw as u64, &mut self.tmp);
            sink.put(&self.tmp)?;
            self.tmp.clear();
            sink.put_data(t)?;
        }
        for &v in g.inputs() {
            write_value_info(11, self.names.get(g, v), g.ty(v), &mut self.tmp);
        }
        for &v in g.outputs() {
            write_value_info(12, self.names.get(g, v), g.ty(v), &mut self.tmp);
        }
        sink.put(&self.tmp)?;
        self.tmp.clear();
        Ok(())
    }
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
            .chain(&g.train.as_ref().map(|t| t.to_metadata(g)).unwrap_or_default())
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

/// Writes one node in the target opset's form (a `graph.node` entry), then the value_info entries
/// of its outputs. Encoded field by field from the graph's own strings: a training graph has
/// hundreds of thousands of nodes, and building a `NodeProto` of owned strings for each costs more
/// than encoding it.
fn write_node(
    g: &Graph,
    n: NodeId,
    opset: i64,
    names: &Names,
    outputs: &HashSet<ValueId>,
    scratch: &mut Vec<u8>,
    buf: &mut Vec<u8>,
) -> Result<()> {
    use prost::encoding::message;
    let nd = g.node(n);
    let mut inputs: &[Option<ValueId>] = nd.inputs();
    let mut attrs = nd.op.attrs();
    if let Op::Opaque(o) = &nd.op {
        inputs = &inputs[..o.explicit_inputs.min(inputs.len())];
        // An opaque standard node keeps the form of the model's opset; written at a later one it
        // must still be valid there (And-1's `axis` is not, from opset 7).
        let sig: Vec<(bool, Option<crate::DType>)> = inputs.iter().map(|v| (v.is_some(), None)).collect();
        super::schema::check_op(&nd.op, opset, &sig, &vec![true; nd.outputs().len()]).map_err(|e| {
            invalid(format!(
                "node {}: {e}; mpc writes ai.onnx opset {opset}, where this form is invalid",
                g.node_label(n)
            ))
        })?;
    }
    if nd.op.axes_input_since().is_some_and(|since| opset < since) {
        if let Some(axes) = nd.input(1) {
            let t = g.constant(axes).ok_or_else(|| invalid("reduction axes must be constant"))?;
            attrs.insert(0, ("axes".into(), Attr::Ints(t.to_i64_vec().unwrap_or_default())));
        }
        inputs = &inputs[..inputs.len().min(1)];
    }
    while let Some((None, rest)) = inputs.split_last() {
        inputs = rest;
    }
    // RoiAlign-10 samples as `output_half_pixel` and has no attribute to say so.
    if let Op::RoiAlign(a) = &nd.op {
        if opset < 16 {
            if a.coordinate_transformation_mode != crate::ops::RoiCoordinates::OutputHalfPixel {
                return Err(invalid(format!(
                    "node {}: RoiAlign with half_pixel coordinates needs opset 16; mpc writes opset {opset}",
                    g.node_label(n)
                )));
            }
            attrs.retain(|(k, _)| k != "coordinate_transformation_mode");
        }
    }
    // From opset 18 an equal Split (no `split` input) says how many parts it makes.
    if let Op::Split(SplitAttrs { num_outputs: None, .. }) = &nd.op {
        if opset >= 18 && inputs.len() < 2 {
            attrs.push(("num_outputs".into(), Attr::Int(nd.outputs().len() as i64)));
        }
    }
    // NodeProto: input = 1, output = 2, name = 3, op_type = 4, attribute = 5, domain = 7.
    scratch.clear();
    for i in inputs {
        put_bytes(1, i.map_or("", |v| names.get(g, v)).as_bytes(), scratch);
    }
    for &o in nd.outputs() {
        put_bytes(2, names.get(g, o).as_bytes(), scratch);
    }
    put_str(3, &nd.name, scratch);
    put_str(4, nd.op.op_type(), scratch);
    for (k, a) in attrs {
        message::encode(5, &attribute(k, a)?, scratch);
    }
    put_str(7, nd.op.domain(), scratch);
    put_bytes(1, scratch, buf);
    for &o in nd.outputs() {
        let name = names.get(g, o);
        if !name.is_empty() && !outputs.contains(&o) && g.ty(o).dtype.is_some() {
            write_value_info(13, name, g.ty(o), buf);
        }
    }
    Ok(())
}

/// A length-delimited field (strings, bytes, embedded messages), written even when empty.
fn put_bytes(tag: u32, bytes: &[u8], buf: &mut Vec<u8>) {
    use prost::encoding::{encode_key, encode_varint, WireType};
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(bytes.len() as u64, buf);
    buf.extend_from_slice(bytes);
}

/// A singular string field, left out when empty (proto3's default).
fn put_str(tag: u32, s: &str, buf: &mut Vec<u8>) {
    if !s.is_empty() {
        put_bytes(tag, s.as_bytes(), buf);
    }
}

/// Writes a ValueInfoProto field `tag` for a tensor of type `ty`, sizes computed bottom-up so
/// nothing is encoded twice.
fn write_value_info(tag: u32, name: &str, ty: &TypeInfo, buf: &mut Vec<u8>) {
    use prost::encoding::{encode_key, encode_varint, encoded_len_varint as vlen, WireType};
    let delimited = |len: usize| 1 + vlen(len as u64) + len;
    // TensorShapeProto.Dimension: dim_value = 1, dim_param = 2.
    let dim_len = |d: &Dim| match d {
        Dim::Fixed(n) => 1 + vlen(*n),
        Dim::Sym(p) => delimited(p.to_string().len()),
        Dim::Unknown => 0,
    };
    let shape_len = ty.shape.as_ref().map(|s| s.dims().iter().map(|d| delimited(dim_len(d))).sum::<usize>());
    // TypeProto.Tensor: elem_type = 1, shape = 2.
    let elem = ty.dtype.map_or(0, |d| d.onnx_code()) as u64;
    let tensor_len = if elem != 0 { 1 + vlen(elem) } else { 0 } + shape_len.map_or(0, delimited);
    // TypeProto: tensor_type = 1. ValueInfoProto: name = 1, type = 2.
    let type_len = delimited(tensor_len);
    let info_len = if name.is_empty() { 0 } else { delimited(name.len()) } + delimited(type_len);
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(info_len as u64, buf);
    put_str(1, name, buf);
    encode_key(2, WireType::LengthDelimited, buf);
    encode_varint(type_len as u64, buf);
    encode_key(1, WireType::LengthDelimited, buf);
    encode_varint(tensor_len as u64, buf);
    if elem != 0 {
        encode_key(1, WireType::Varint, buf);
        encode_varint(elem, buf);
    }
    if let (Some(shape), Some(len)) = (&ty.shape, shape_len) {
        encode_key(2, WireType::LengthDelimited, buf);
        encode_varint(len as u64, buf);
        for d in shape.dims() {
            encode_key(1, WireType::LengthDelimited, buf);
            encode_varint(dim_len(d) as u64, buf);
            match d {
                Dim::Fixed(n) => {
                    encode_key(1, WireType::Varint, buf);
                    encode_varint(*n, buf);
                }
                Dim::Sym(p) => put_bytes(2, p.to_string().as_bytes(), buf),
                Dim::Unknown => {}
            }
        }
    }
}

/// Value names for export: the graph's own, with names made up for anonymous values that are read.
struct Names {
    made_up: HashMap<ValueId, String>,
}

impl Names {
    fn new(g: &Graph) -> Names {
        let mut made_up = HashMap::new();
        let mut taken: HashSet<String> = HashSet::new();
        for v in g.value_ids() {
            let val = g.value(v);
            let needs = val.name.is_empty()
                && !matches!(val.def(), Def::None)
                && (!val.uses().is_empty() || g.is_output(v) || !matches!(val.def(), Def::Node(..)));
            if needs {
                let name =
                    (0..).map(|i| format!("_v{}_{i}", v.index())).find(|n| g.find(n).is_none() && !taken.contains(n));
                let name = name.unwrap_or_default();
                taken.insert(name.clone());
                made_up.insert(v, name);
            }
        }
        Names { made_up }
    }

    fn get<'a>(&'a self, g: &'a Graph, v: ValueId) -> &'a str {
        match self.made_up.get(&v) {
            Some(n) => n,
            None => g.name(v),
        }
    }
}

pub(crate) fn tensor_proto(name: &str, t: &Tensor) -> TensorProto {
    TensorProto { raw_data: t.bytes().clone(), ..tensor_head(name, t) }
}

/// A tensor's fields but its data.
fn tensor_head(name: &str, t: &Tensor) -> TensorProto {
    TensorProto {
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: t.dtype().onnx_code(),
        name: name.to_string(),
        ..Default::default()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Shape};

    /// A chain of `n` Relu nodes with a 300 KB weight feeding the first.
    fn chain(n: usize) -> Graph {
        let mut g = Graph::new("chain");
        let x = g.add_input("x", TypeInfo::new(DType::F32, Shape(vec![Dim::sym("batch"), Dim::Fixed(75_000)])));
        let w = g.add_initializer("w", Tensor::from_f32(vec![75_000], &vec![0.5; 75_000]));
        let (_, mut v) = g.add_op("add", Op::Add, &[Some(x), Some(w)], 1);
        for i in 0..n {
            v = g.add_op(&format!("relu_with_a_long_name_{i}"), Op::Relu, &[Some(v[0])], 1).1;
            g.set_ty(v[0], TypeInfo::new(DType::F32, Shape(vec![Dim::sym("batch"), Dim::Fixed(75_000)])));
        }
        g.add_output(v[0]);
        g
    }

    #[test]
    fn streaming_writes_a_model_that_decodes_whole() {
        // Well over one chunk of nodes, and a weight written from its own buffer.
        let g = chain(30_000);
        let bytes = encode_onnx(&g).unwrap();
        assert!(bytes.len() > 2 * CHUNK_BYTES, "{} bytes", bytes.len());
        // The graph's length prefix, counted in the first walk, must match what the second wrote:
        // prost rejects a model whose graph ends early or late.
        let model = proto::ModelProto::decode(bytes.as_slice()).unwrap();
        let graph = model.graph.unwrap();
        assert_eq!(graph.node.len(), 30_001);
        assert_eq!(graph.node[30_000].name, "relu_with_a_long_name_29999");
        assert!(graph.initializer[0].raw_data == g.value(g.find("w").unwrap()).initializer().unwrap().bytes()[..]);
        // Every typed value but the graph output.
        assert_eq!(graph.value_info.len(), 29_999);
        assert_eq!((graph.input.len(), graph.output.len()), (1, 1));
        // Writing into a file in pieces gives the same bytes.
        let mut pieces = Pieces(Vec::new(), 0);
        write_onnx(&g, &mut pieces).unwrap();
        assert!(pieces.0 == bytes && pieces.1 > 2);
    }

    /// A writer that records how many writes it got.
    struct Pieces(Vec<u8>, usize);

    impl std::io::Write for Pieces {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.extend_from_slice(b);
            self.1 += 1;
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
}
