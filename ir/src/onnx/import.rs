//! ONNX → IR.
//!
//! The model is decoded from one shared buffer (initializer data is not copied), and its nodes one
//! at a time (a node's encoding is read twice: for its outputs, then whole), so a large graph is
//! never held as protos beside the graph being built. Every value a node defines is declared
//! before any node is built, so a graph listed out of order still imports and a cycle, an
//! undefined read or a double definition is reported by name. Each standard-domain node
//! is then brought to its internal (newest) form by [`super::legacy`]; anything else is kept as an
//! [`Opaque`] op.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use bytes::Bytes;
use prost::Message;

use super::proto::{self, attribute_type as at, tensor_proto, type_proto, TensorProto, ValueInfoProto};
use super::{legacy, schema, sequences, torch_export};
use crate::error::{invalid, IrError, Result};
use crate::graph::{Graph, ModelMeta, TypeInfo, ValueId};
use crate::{Attr, Attrs, DType, Dim, Op, Opaque, Shape, Tensor};

/// Reads an ONNX model file. External tensor data is looked up next to the file.
pub fn read_onnx(path: &Path) -> Result<Graph> {
    if path.is_dir() {
        return Err(invalid("is a directory, not an ONNX model"));
    }
    let data = std::fs::read(path)?;
    decode_onnx(Bytes::from(data), path.parent())
}

/// Decodes an ONNX model from bytes. `dir` is where external data files live, if any.
pub fn decode_onnx(data: Bytes, dir: Option<&Path>) -> Result<Graph> {
    if data.is_empty() {
        return Err(IrError::Decode("the file is empty".into()));
    }
    let decode_error = |e: prost::DecodeError| IrError::Decode(e.to_string());
    let model = proto::LazyModelProto::decode(data).map_err(decode_error)?;
    let graph = model.graph.ok_or_else(|| IrError::Decode("the model has no graph".into()))?;
    let graph = proto::LazyGraphProto::decode(graph).map_err(decode_error)?;
    if model.opset_import.is_empty() && model.ir_version == 0 {
        return Err(IrError::Decode("no ir_version and no opset_import: not an ONNX model".into()));
    }
    let meta = ModelMeta {
        ir_version: model.ir_version,
        producer_name: model.producer_name,
        producer_version: model.producer_version,
        domain: model.domain,
        model_version: model.model_version,
        doc_string: model.doc_string,
        opsets: model.opset_import.into_iter().map(|o| (o.domain, o.version)).collect(),
        metadata_props: model.metadata_props.into_iter().map(|e| (e.key, e.value)).collect(),
        graph_metadata_props: graph.metadata_props.iter().map(|e| (e.key.clone(), e.value.clone())).collect(),
        functions: model.functions,
    };
    let external = External { dir, files: Default::default() };
    Importer { g: Graph::new(graph.name.clone()), external: &external, opset: 0, main: true }.run(graph, meta)
}

/// Where external tensor data lives, and the files read so far: each is read once, and every
/// tensor in it shares its bytes (a model's weights usually lie in one file, hundreds of
/// tensors at their offsets).
struct External<'a> {
    dir: Option<&'a Path>,
    files: std::cell::RefCell<std::collections::HashMap<std::path::PathBuf, Bytes>>,
}

struct Importer<'a> {
    g: Graph,
    external: &'a External<'a>,
    opset: i64,
    /// The model's graph, not a subgraph: its inputs must say their element type.
    main: bool,
}

impl Importer<'_> {
    fn run(mut self, graph: proto::LazyGraphProto, mut meta: ModelMeta) -> Result<Graph> {
        // A model that imports no ai.onnx opset is read as opset 1, and the graph says so: its
        // text IR is then checked at the opset its nodes were read at, not at the newest.
        if meta.onnx_opset() == 0 {
            meta.set_opset("", 1);
        }
        self.opset = meta.onnx_opset();
        self.g.meta = meta;
        if !graph.sparse_initializer.is_empty() {
            return Err(invalid("sparse initializers are not supported"));
        }
        // Most nodes define one value: room for that at once, not at every doubling.
        let n = graph.node.len();
        self.g.reserve(n, n + graph.initializer.len() + graph.input.len());
        // A name is declared once the graph has a value of that name.
        for t in graph.initializer {
            let name = t.name.clone();
            if self.g.find(&name).is_some() {
                return Err(crate::GraphError::Redefined(name).into());
            }
            let tensor = self.tensor(t).map_err(|e| invalid(format!("initializer `{name}`: {e}")))?;
            self.g.add_initializer(&name, tensor);
        }
        for vi in &graph.input {
            // Older exporters list initializers as inputs too; they are initializers here.
            if self.g.find(&vi.name).is_some() {
                continue;
            }
            let ty = value_type(vi, true)?;
            if self.main && ty.dtype.is_none() {
                return Err(invalid(format!("input `{}` has no element type", vi.name)));
            }
            self.g.add_input(&vi.name, ty);
        }
        let mut known: HashMap<&str, &ValueInfoProto> = HashMap::new();
        for vi in graph.value_info.iter().chain(&graph.output) {
            known.insert(&vi.name, vi);
        }
        let decode_error = |e: prost::DecodeError| IrError::Decode(e.to_string());
        // torch.export's parameters, when the exporter wrote them, and the FX call of each node.
        let params = self.g.meta.graph_metadata_props.iter().find(|(k, _)| k == torch_export::SIGNATURE_KEY);
        let params = params.map(|(_, s)| torch_export::parameters(s)).unwrap_or_default();
        let mut calls = HashMap::new();

        // Declare every node output first (forward references, cycles and duplicates): node i
        // defines `outs[ends[i - 1]..ends[i]]`.
        let mut outs: Vec<ValueId> = Vec::with_capacity(graph.node.len());
        let mut ends: Vec<usize> = Vec::with_capacity(graph.node.len());
        for n in &graph.node {
            for o in proto::NodeOutputsProto::decode(n.clone()).map_err(decode_error)?.output {
                if !o.is_empty() && self.g.find(&o).is_some() {
                    return Err(crate::GraphError::Redefined(o).into());
                }
                let ty = match known.get(o.as_str()) {
                    Some(vi) => value_type(vi, false)?,
                    None => TypeInfo::default(),
                };
                outs.push(self.g.new_value(&o, ty));
            }
            ends.push(outs.len());
        }

        for (i, n) in graph.node.iter().enumerate() {
            let mut n = proto::NodeProto::decode(n.clone()).map_err(decode_error)?;
            let outputs = outs[i.checked_sub(1).map_or(0, |p| ends[p])..ends[i]].to_vec();
            let node_label = label(&n);
            let mut inputs = Vec::with_capacity(n.input.len());
            for i in &n.input {
                if i.is_empty() {
                    inputs.push(None);
                    continue;
                }
                let v = self
                    .g
                    .find(i)
                    .ok_or_else(|| crate::GraphError::Undefined { node: node_label.clone(), value: i.clone() })?;
                inputs.push(Some(v));
            }
            self.check_schema(&n, &inputs).map_err(|e| invalid(format!("node {node_label}: {e}")))?;
            for a in &mut n.attribute {
                inline_external(a, self.external)
                    .map_err(|e| invalid(format!("node {node_label}: attribute `{}`: {e}", a.name)))?;
            }
            check_bodies(n.attribute.iter(), &self.g).map_err(|e| invalid(format!("node {node_label}: {e}")))?;
            let attrs = n.attribute.into_iter().map(|a| attr(a, self.external)).collect::<Result<Attrs>>();
            let attrs = attrs.map_err(|e| invalid(format!("node {node_label}: {e}")))?;
            let call = if params.is_empty() {
                None
            } else {
                let fx = n.metadata_props.iter().find(|e| e.key == torch_export::FX_NODE_KEY);
                fx.and_then(|e| torch_export::FxCall::parse(&e.value)).zip(outputs.first().copied())
            };
            self.node(n.name, n.op_type, n.domain, attrs, inputs, outputs)
                .map_err(|e| invalid(format!("node {node_label}: {e}")))?;
            if let Some((call, out)) = call {
                if let Some((node, _)) = self.g.value(out).producer() {
                    calls.insert(node, call);
                }
            }
        }
        // (Nodes these remove leave the FX calls: a node made later may take a removed one's id.)
        let output_names: Vec<&str> = graph.output.iter().map(|o| o.name.as_str()).collect();
        for n in sequences::split_sequences(&mut self.g, &output_names) {
            calls.remove(&n);
        }
        for n in torch_export::untie_identities(&mut self.g) {
            calls.remove(&n);
        }
        if !calls.is_empty() {
            torch_export::untie(&mut self.g, &params, &calls);
            torch_export::restore_removed(&mut self.g, &params, &calls);
        }
        for vi in &graph.output {
            let v = self.g.find(&vi.name).ok_or_else(|| crate::GraphError::UndefinedOutput(vi.name.clone()))?;
            let declared_ty = value_type(vi, true)?;
            if self.g.ty(v).dtype.is_none() || self.g.ty(v).shape.is_none() {
                self.g.set_ty(v, declared_ty);
            }
            self.g.add_new_output(v)?;
        }
        self.g.check_structure()?;
        self.g.train = crate::TrainSignature::take_from_metadata(&mut self.g)?;
        Ok(self.g)
    }

    /// Checks a standard-domain node against its op's signature at the model's opset (see
    /// [`super::schema`]); nodes of other domains are the business of whoever defines them.
    fn check_schema(&self, n: &proto::NodeProto, inputs: &[Option<ValueId>]) -> Result<(), String> {
        let mut kinds = Vec::with_capacity(n.attribute.len());
        for a in &n.attribute {
            if !a.ref_attr_name.is_empty() {
                return Err(format!("attribute `{}` refers to a function's attribute outside a function", a.name));
            }
            let kind = schema::attr_kind(a.r#type)
                .ok_or_else(|| format!("attribute `{}` has no valid type (code {})", a.name, a.r#type))?;
            if kinds.iter().any(|&(name, _)| name == a.name.as_str()) {
                return Err(format!("attribute `{}` is given twice", a.name));
            }
            kinds.push((a.name.as_str(), kind));
        }
        if !(n.domain.is_empty() || n.domain == "ai.onnx") {
            return Ok(());
        }
        let s = match schema::lookup(&n.op_type, self.opset) {
            schema::Lookup::Found(s) => s,
            schema::Lookup::NotYet { first } => {
                return Err(format!(
                    "{} is an op of opset {first} and later; the model imports opset {}",
                    n.op_type, self.opset
                ))
            }
            schema::Lookup::Unknown => return Err(format!("no op `{}` in the ai.onnx domain", n.op_type)),
        };
        let ins: Vec<(bool, Option<DType>)> =
            inputs.iter().map(|v| (v.is_some(), v.and_then(|v| self.g.ty(v).dtype))).collect();
        let outs: Vec<bool> = n.output.iter().map(|o| !o.is_empty()).collect();
        s.check(&schema::NodeSig { inputs: &ins, outputs: &outs, attrs: &kinds })
    }

    /// Builds one node in its internal form.
    fn node(
        &mut self,
        name: String,
        op_type: String,
        domain: String,
        attrs: Attrs,
        mut inputs: Vec<Option<ValueId>>,
        mut outputs: Vec<ValueId>,
    ) -> Result<(), String> {
        let standard = domain.is_empty() || domain == "ai.onnx";
        let opaque = |attrs: Attrs, g: &Graph, inputs: &mut Vec<Option<ValueId>>| {
            let explicit_inputs = inputs.len();
            inputs.extend(captures(&attrs, g).into_iter().map(Some));
            Op::Opaque(Box::new(Opaque { domain: domain.clone(), op_type: op_type.clone(), attrs, explicit_inputs }))
        };
        let op = if standard && (Op::KNOWN.contains(&op_type.as_str()) || legacy::RENAMED.contains(&op_type.as_str())) {
            let mut cx = legacy::Cx {
                g: &mut self.g,
                opset: self.opset,
                node: &name,
                inputs: &mut inputs,
                outputs: &mut outputs,
            };
            match legacy::normalize(&mut cx, &op_type, attrs.clone())? {
                Some(op) => {
                    schema::check_outputs(&op, outputs.len())?;
                    // An older form that normalisation does not rewrite (Reshape-1's `shape`
                    // attribute) would become a malformed node of the newest form.
                    let sig: Vec<(bool, Option<DType>)> = inputs.iter().map(|v| (v.is_some(), None)).collect();
                    schema::check_op(&op, 0, &sig, &vec![true; outputs.len()])
                        .map_err(|e| format!("mpc does not read {op_type} as opset {} wrote it: {e}", self.opset))?;
                    op
                }
                None => opaque(attrs, &self.g, &mut inputs),
            }
        } else if domain == crate::ops::MPC_DOMAIN {
            match Op::from_mpc_attrs(&op_type, attrs.clone()) {
                Some(r) => {
                    let op = r.map_err(|e| format!("ai.mpc::{op_type}: {e}"))?;
                    let sig: Vec<(bool, Option<DType>)> = inputs.iter().map(|v| (v.is_some(), None)).collect();
                    schema::check_op(&op, self.opset, &sig, &vec![true; outputs.len()])?;
                    op
                }
                None => opaque(attrs, &self.g, &mut inputs),
            }
        } else {
            opaque(attrs, &self.g, &mut inputs)
        };
        op.validate(inputs.len())?;
        self.g.add_node(name, op, inputs, outputs);
        Ok(())
    }

    fn tensor(&self, t: TensorProto) -> Result<Tensor, String> {
        tensor_from_proto(t, Some(self.external))
    }
}

fn label(n: &proto::NodeProto) -> String {
    if n.name.is_empty() {
        format!("({}) defining `{}`", n.op_type, n.output.first().map_or("", |s| s))
    } else {
        format!("`{}` ({})", n.name, n.op_type)
    }
}

/// Decodes a serialized `TensorProto` (the `.pb` files of ONNX's test data).
pub fn decode_tensor(data: Bytes) -> Result<Tensor> {
    let t = TensorProto::decode(data).map_err(|e| IrError::Decode(e.to_string()))?;
    tensor_from_proto(t, None).map_err(invalid)
}

/// A tensor from its proto: raw data (shared, not copied), typed fields, or an external file.
fn tensor_from_proto(t: TensorProto, external: Option<&External>) -> Result<Tensor, String> {
    let dtype = DType::from_onnx_code(t.data_type)?;
    let mut shape = Vec::with_capacity(t.dims.len());
    for &d in &t.dims {
        shape.push(u64::try_from(d).map_err(|_| format!("negative dimension {d}"))?);
    }
    if t.segment.is_some() {
        return Err("segmented tensors are not supported".into());
    }
    let data = if t.data_location == tensor_proto::EXTERNAL {
        match external {
            Some(e) => external_data(&t, e)?,
            // A tensor read on its own: its external file is looked for in the working folder.
            None => external_data(&t, &External { dir: None, files: Default::default() })?,
        }
    } else if !t.raw_data.is_empty() {
        t.raw_data
    } else {
        let mut out = Vec::new();
        let put = |v: f64, out: &mut Vec<u8>| crate::tensor::encode_f64(dtype, v, out);
        match dtype {
            DType::F32 => t.float_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            DType::F64 => t.double_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            DType::I64 => t.int64_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            DType::U64 => t.uint64_data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            DType::U32 => t.uint64_data.iter().for_each(|&v| out.extend_from_slice(&(v as u32).to_le_bytes())),
            // Half types keep their bit patterns in int32_data.
            DType::F16 | DType::BF16 => {
                t.int32_data.iter().for_each(|&v| out.extend_from_slice(&(v as u16).to_le_bytes()))
            }
            DType::I32 | DType::I16 | DType::I8 | DType::U16 | DType::U8 | DType::Bool => {
                t.int32_data.iter().for_each(|&v| put(v as f64, &mut out))
            }
        }
        Bytes::from(out)
    };
    Tensor::from_bytes(dtype, shape, data)
}

fn external_data(t: &TensorProto, external: &External) -> Result<Bytes, String> {
    let get = |k: &str| t.external_data.iter().find(|e| e.key == k).map(|e| e.value.as_str());
    let location = get("location").ok_or("external data without a location")?;
    let rel = Path::new(location);
    if rel.is_absolute() || rel.components().any(|c| matches!(c, std::path::Component::ParentDir)) {
        return Err(format!("external data location `{location}` leaves the model's folder"));
    }
    let base = external.dir.unwrap_or(Path::new("."));
    let path = base.join(rel);
    // With symlinks followed, the file must still lie inside the model's folder.
    let real = match (std::fs::canonicalize(&path), std::fs::canonicalize(base)) {
        (Ok(r), Ok(b)) if !r.starts_with(&b) => {
            return Err(format!("external data location `{location}` leaves the model's folder (through a link)"))
        }
        (Err(e), _) => return Err(format!("external data `{location}`: {e}")),
        (Ok(r), _) => r,
    };
    let parse =
        |k: &str| get(k).map(|v| v.parse::<u64>().map_err(|_| format!("bad external data {k} `{v}`"))).transpose();
    let offset = parse("offset")?.unwrap_or(0);
    let length = parse("length")?;
    let file = match external.files.borrow_mut().entry(real) {
        std::collections::hash_map::Entry::Occupied(e) => e.get().clone(),
        std::collections::hash_map::Entry::Vacant(e) => {
            let bytes = Bytes::from(std::fs::read(&path).map_err(|e| format!("external data `{location}`: {e}"))?);
            e.insert(bytes).clone()
        }
    };
    let start = usize::try_from(offset).map_err(|_| "offset too large")?;
    let end = match length {
        Some(l) => usize::try_from(l).ok().and_then(|l| start.checked_add(l)).ok_or("length too large")?,
        None => file.len(),
    };
    if end > file.len() || start > end {
        return Err(format!("external data `{location}` is {} bytes, shorter than offset+length {end}", file.len()));
    }
    Ok(file.slice(start..end))
}

/// The type of a value from its `ValueInfoProto`. `interface` values (graph inputs and outputs)
/// must be tensors; other non-tensor types are simply not modelled.
fn value_type(vi: &ValueInfoProto, interface: bool) -> Result<TypeInfo> {
    let tensor = match vi.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => t,
        Some(_) if interface => {
            return Err(invalid(format!(
                "`{}` is not a tensor (sequence, map and optional types are not supported)",
                vi.name
            )))
        }
        _ => return Ok(TypeInfo::default()),
    };
    let dtype = match tensor.elem_type {
        0 => None,
        code => Some(DType::from_onnx_code(code).map_err(|e| invalid(format!("value `{}`: {e}", vi.name)))?),
    };
    let shape = tensor.shape.as_ref().map(|s| {
        Shape(
            s.dim
                .iter()
                .map(|d| match &d.value {
                    Some(proto::tensor_shape_proto::dimension::Value::DimValue(v)) if *v >= 0 => Dim::Fixed(*v as u64),
                    Some(proto::tensor_shape_proto::dimension::Value::DimParam(p)) if !p.is_empty() => {
                        Dim::from_expr(crate::SymExpr::parse(p))
                    }
                    _ => Dim::Unknown,
                })
                .collect(),
        )
    });
    Ok(TypeInfo { dtype, shape })
}

/// An attribute from its proto. Kinds mpc does not model are kept as the encoded proto.
fn attr(a: proto::AttributeProto, external: &External) -> Result<(String, Attr)> {
    let utf8 =
        |b: &Bytes| String::from_utf8(b.to_vec()).map_err(|_| invalid(format!("attribute `{}` is not UTF-8", a.name)));
    let value = match a.r#type {
        at::INT => Attr::Int(a.i),
        at::FLOAT => Attr::Float(a.f),
        at::STRING => Attr::String(utf8(&a.s)?),
        at::INTS => Attr::Ints(a.ints.clone()),
        at::FLOATS => Attr::Floats(a.floats.clone()),
        at::STRINGS => Attr::Strings(a.strings.iter().map(utf8).collect::<Result<_>>()?),
        at::TENSOR if a.t.is_some() => {
            let t = a.t.clone().unwrap_or_default();
            let t = tensor_from_proto(t, Some(external));
            Attr::Tensor(t.map_err(|e| invalid(format!("attribute `{}`: {e}", a.name)))?)
        }
        // Graphs, sparse tensors, type protos, attribute references: kept encoded.
        _ => Attr::Raw(Bytes::from(a.encode_to_vec())),
    };
    Ok((a.name, value))
}

/// Reads the external data of the tensors inside a subgraph attribute (If branches, Loop and
/// Scan bodies, at any depth) into them. A body is kept encoded as it came but for this, so the
/// model's bodies never refer to files again: a body decoded later need not know the model's
/// folder, and an output written elsewhere carries the data. Whether anything was read.
fn inline_external(a: &mut proto::AttributeProto, external: &External) -> Result<bool, String> {
    let mut changed = false;
    for t in a.t.iter_mut().chain(&mut a.tensors) {
        changed |= inline_tensor(t, external).map_err(|e| format!("tensor `{}`: {e}", t.name))?;
    }
    for body in a.g.iter_mut().chain(&mut a.graphs) {
        // A body that does not decode is refused by `check_bodies`, with its own message.
        let Ok(mut g) = proto::GraphProto::decode(body.clone()) else { continue };
        let mut inner = false;
        for t in &mut g.initializer {
            inner |= inline_tensor(t, external).map_err(|e| format!("initializer `{}`: {e}", t.name))?;
        }
        for n in &mut g.node {
            for a in &mut n.attribute {
                inner |= inline_external(a, external)?;
            }
        }
        if inner {
            *body = Bytes::from(g.encode_to_vec());
            changed = true;
        }
    }
    Ok(changed)
}

/// An external tensor's data read into its proto; whether it was external.
fn inline_tensor(t: &mut TensorProto, external: &External) -> Result<bool, String> {
    if t.data_location != tensor_proto::EXTERNAL {
        return Ok(false);
    }
    t.raw_data = external_data(t, external)?;
    t.external_data.clear();
    t.data_location = 0;
    Ok(true)
}

/// Imports every subgraph attribute (If branches, Loop and Scan bodies) on its own, its outer
/// reads resolved against `outer`: a body with an undefined read, a malformed node or bytes that
/// do not decode is refused, not copied into an output.
fn check_bodies<'a>(attrs: impl Iterator<Item = &'a proto::AttributeProto>, outer: &Graph) -> Result<(), String> {
    for a in attrs {
        for body in a.g.iter().chain(&a.graphs) {
            let sub = proto::GraphProto::decode(body.clone())
                .map_err(|e| format!("attribute `{}` is not a valid graph: {e}", a.name))?;
            let mut free = Vec::new();
            free_names(&sub, &mut HashSet::new(), &mut free);
            let mut captured = Vec::new();
            for name in free {
                let v = outer
                    .find(&name)
                    .ok_or_else(|| format!("attribute `{}` reads `{name}`, which is not defined", a.name))?;
                if !captured.contains(&v) {
                    captured.push(v);
                }
            }
            let single = proto::AttributeProto { name: a.name.clone(), g: Some(body.clone()), ..Default::default() };
            decode_subgraph(&Bytes::from(single.encode_to_vec()), outer, &captured)
                .map_err(|e| format!("attribute `{}`: {e}", a.name))?;
        }
    }
    Ok(())
}

/// [`check_bodies`] for attributes kept encoded (an opaque op's, as the text IR reads them).
pub fn check_subgraphs(attrs: &Attrs, outer: &Graph) -> Result<(), String> {
    let mut protos = Vec::new();
    for (name, a) in attrs {
        if let Attr::Raw(bytes) = a {
            let p = proto::AttributeProto::decode(bytes.clone())
                .map_err(|e| format!("attribute `{name}` does not decode: {e}"))?;
            protos.push(p);
        }
    }
    check_bodies(protos.iter(), outer)
}

/// Outer-scope values read by the subgraphs in `attrs` (If/Loop/Scan bodies), in the order they
/// are first read: an opaque op's inputs past its explicit ones.
pub fn captures(attrs: &Attrs, g: &Graph) -> Vec<ValueId> {
    let mut names = Vec::new();
    for (_, a) in attrs {
        if let Attr::Raw(bytes) = a {
            if let Ok(p) = proto::AttributeProto::decode(bytes.clone()) {
                for body in p.g.iter().chain(&p.graphs) {
                    if let Ok(sub) = proto::GraphProto::decode(body.clone()) {
                        free_names(&sub, &mut HashSet::new(), &mut names);
                    }
                }
            }
        }
    }
    let mut seen = HashSet::new();
    names.into_iter().filter_map(|n| g.find(&n)).filter(|v| seen.insert(*v)).collect()
}

/// Names a subgraph reads but does not define (recursively through nested subgraphs).
fn free_names(g: &proto::GraphProto, outer_defined: &mut HashSet<String>, out: &mut Vec<String>) {
    let mut defined: HashSet<String> = outer_defined.clone();
    defined.extend(g.input.iter().map(|v| v.name.clone()));
    defined.extend(g.initializer.iter().map(|t| t.name.clone()));
    for n in &g.node {
        for i in &n.input {
            if !i.is_empty() && !defined.contains(i) {
                out.push(i.clone());
            }
        }
        for a in &n.attribute {
            for body in a.g.iter().chain(&a.graphs) {
                if let Ok(sub) = proto::GraphProto::decode(body.clone()) {
                    free_names(&sub, &mut defined, out);
                }
            }
        }
        defined.extend(n.output.iter().cloned());
    }
    for o in &g.output {
        if !defined.contains(&o.name) {
            out.push(o.name.clone());
        }
    }
}

/// The graph of a subgraph attribute (an If branch, a Loop body) as a graph of its own: the outer
/// values it reads (`captures`) become extra inputs, typed as in `outer`; opsets come from `outer`.
pub fn decode_subgraph(attr: &Bytes, outer: &Graph, captures: &[ValueId]) -> Result<Graph> {
    let a = proto::AttributeProto::decode(attr.clone()).map_err(|e| IrError::Decode(e.to_string()))?;
    let body = a.g.ok_or_else(|| invalid(format!("attribute `{}` is not a graph", a.name)))?;
    let mut sub = proto::LazyGraphProto::decode(body).map_err(|e| IrError::Decode(e.to_string()))?;
    for &v in captures {
        let ty = outer.ty(v);
        let shape = ty.shape.as_ref().map(|s| proto::TensorShapeProto {
            dim: s
                .dims()
                .iter()
                .map(|d| proto::tensor_shape_proto::Dimension {
                    value: match d {
                        Dim::Fixed(n) => Some(proto::tensor_shape_proto::dimension::Value::DimValue(*n as i64)),
                        Dim::Sym(p) => Some(proto::tensor_shape_proto::dimension::Value::DimParam(p.to_string())),
                        Dim::Unknown => None,
                    },
                    denotation: String::new(),
                })
                .collect(),
        });
        let tensor = type_proto::Tensor { elem_type: ty.dtype.map_or(0, |d| d.onnx_code()), shape };
        sub.input.push(ValueInfoProto {
            name: outer.name(v).to_string(),
            r#type: Some(proto::TypeProto {
                value: Some(type_proto::Value::TensorType(tensor)),
                denotation: String::new(),
            }),
            doc_string: String::new(),
        });
    }
    let meta = ModelMeta { ir_version: outer.meta.ir_version, opsets: outer.meta.opsets.clone(), ..Default::default() };
    let external = External { dir: None, files: Default::default() };
    Importer { g: Graph::new(sub.name.clone()), external: &external, opset: 0, main: false }.run(sub, meta)
}
