//! What torch.onnx's dynamo exporter did to a model's parameters, undone from what it records.
//!
//! The dynamo exporter (`torch.onnx.export(..., dynamo=True)`, the default since PyTorch 2.9)
//! optimizes the model it writes, and two of its steps change the parameters of a freshly
//! initialised model, whose LayerNorm scales are all ones and many of whose biases are all zeros.
//! Inference is unchanged by either, but a training step would not train the module's parameters:
//!
//! - **Merged**: one initializer is kept for each set of equal small tensors, so a GPT's 25
//!   LayerNorms read one scale and one shift, which training would train as one parameter.
//! - **Removed**: a zero bias is dropped (a `Gemm` without its C, a linear layer's `MatMul`
//!   without its `Add`), so training would not train it at all (Hugging Face's GPT-2 loses every
//!   bias of its projections).
//!
//! The exporter leaves what undoes both. The graph's `pkg.torch.export.ExportedProgram.graph_signature`
//! names every parameter (`p_blocks_1_ln1_weight: PARAMETER target='blocks.1.ln1.weight'`), and
//! each node's `pkg.torch.onnx.fx_node` is the FX call it came from, with the placeholders it read
//! (`%layer_norm_2 : .. = call_function[target=torch.ops.aten.layer_norm.default](args = (%add,
//! [768], %p_blocks_1_ln1_weight, ...))`).
//!
//! [`untie`]: take an initializer named after a parameter (`blocks.0.ln1.weight`, placeholder
//! `p_blocks_0_ln1_weight`). One of its readers' calls reads that placeholder, at some position
//! among its `%` arguments (or, for the calls [`argument_of`] knows, the op and input say which
//! argument it is: a linear layer's `Add` reads its bias). Another reader whose call is the same
//! function but reads, at that position, another parameter that no value of the graph is named
//! after, reads a copy of the initializer under that parameter's name instead. Readers that say nothing (no metadata, another
//! function, a subgraph) keep reading the initializer: a parameter genuinely read twice, such as a
//! tied embedding, stays one.
//!
//! The legacy exporter (`dynamo=False`) merges equal initializers too, in eval mode, and says so:
//! each merged parameter is an `Identity` of the kept one, named after it
//! (`m.transformer.h.1.ln_2.weight = Identity(m.transformer.h.0.ln_1.weight)`). [`untie_identities`]
//! makes such an Identity of an initializer whose elements are all equal an initializer of its
//! own, as the training compiler never ties such tensors (equal by initialisation, not by sharing).
//!
//! [`restore_removed`]: a call of `aten.addmm` (bias first), `aten.linear`, `aten.convolution`
//! or `aten.layer_norm` (bias third) whose bias is a parameter that no value of the graph is named
//! after, and whose nodes are one `Gemm` without C, one `MatMul` and no `Add`, one `Conv` without B
//! or one `LayerNormalization` without B, gets that bias back: zeros (what the exporter drops) of
//! the size the weight gives, under the parameter's name.

use std::collections::{BTreeMap, HashMap};

use crate::graph::{Graph, NodeId, Use, ValueId};
use crate::{Op, Tensor};

/// The graph-level metadata key of torch.export's signature.
pub const SIGNATURE_KEY: &str = "pkg.torch.export.ExportedProgram.graph_signature";
/// The node-level metadata key of the FX call a node came from.
pub(super) const FX_NODE_KEY: &str = "pkg.torch.onnx.fx_node";

/// One input of torch.export's signature: `p_fc_weight: PARAMETER target='fc.weight'`,
/// `b_mask: BUFFER target='mask' persistent=False`, `tokens: USER_INPUT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignatureInput {
    pub placeholder: String,
    /// `PARAMETER`, `BUFFER`, `CONSTANT_TENSOR`, `USER_INPUT`, ...
    pub kind: String,
    /// The name in the module, where the kind has one.
    pub target: Option<String>,
}

/// The inputs of the signature the dynamo exporter wrote in the graph's metadata, if it did.
pub fn signature(g: &Graph) -> Option<Vec<SignatureInput>> {
    let (_, text) = g.meta.graph_metadata_props.iter().find(|(k, _)| k == SIGNATURE_KEY)?;
    Some(parse_signature(text))
}

fn parse_signature(text: &str) -> Vec<SignatureInput> {
    let mut out = Vec::new();
    // The inputs are listed before `# outputs`.
    for line in text.lines().take_while(|l| !l.starts_with("# outputs")) {
        let Some((placeholder, rest)) = line.trim().split_once(": ") else { continue };
        let kind = rest.split(' ').next().unwrap_or_default();
        let target = rest.split_once("target='").and_then(|(_, t)| Some(t.split_once('\'')?.0.to_string()));
        out.push(SignatureInput { placeholder: placeholder.to_string(), kind: kind.to_string(), target });
    }
    out
}

/// The parameters of a signature: placeholder → target (the parameter's name in the module).
pub(super) fn parameters(signature: &str) -> HashMap<String, String> {
    let entries = parse_signature(signature).into_iter().filter(|e| e.kind == "PARAMETER");
    entries.filter_map(|e| Some((e.placeholder, e.target?))).collect()
}

/// An FX call: its result's name, the function and the placeholders named in its arguments, in
/// order.
#[derive(Debug, PartialEq)]
pub(super) struct FxCall {
    result: String,
    function: String,
    args: Vec<String>,
}

impl FxCall {
    /// Reads `%y : [..] = call_function[target=F](args = (..), kwargs = {..})`.
    pub(super) fn parse(text: &str) -> Option<FxCall> {
        let (result, rest) = text.split_once("call_function[target=")?;
        let result = result.trim_start().strip_prefix('%')?.split(' ').next()?.to_string();
        let (function, args) = rest.split_once("](")?;
        let mut names = Vec::new();
        let mut rest = args;
        while let Some(i) = rest.find('%') {
            rest = &rest[i + 1..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            names.push(rest[..end].to_string());
            rest = &rest[end..];
        }
        Some(FxCall { result, function: function.to_string(), args: names })
    }
}

/// Gives each parameter that the exporter merged into another its own initializer again (see the
/// module's documentation). `calls` holds the FX call of every node that has one.
pub(super) fn untie(g: &mut Graph, params: &HashMap<String, String>, calls: &HashMap<NodeId, FxCall>) {
    let placeholder_of: HashMap<&str, &str> = params.iter().map(|(p, t)| (t.as_str(), p.as_str())).collect();
    let inits: Vec<ValueId> = g.initializers().collect();
    for v in inits {
        let name = g.name(v).to_string();
        let Some(&own) = placeholder_of.get(name.as_str()) else { continue };
        let uses: Vec<Use> = g.value(v).uses().iter().copied().filter(|u| !g.is_capture(u.node, u.slot)).collect();
        if uses.len() < 2 {
            continue;
        }
        // Where each function reads this parameter, from a reader that names it.
        let mut position: HashMap<&str, usize> = HashMap::new();
        for u in &uses {
            if let Some(c) = calls.get(&u.node) {
                if let Some(k) = c.args.iter().position(|a| a == own) {
                    position.entry(c.function.as_str()).or_insert(k);
                }
            }
        }
        // The readers that name another parameter there, by that parameter's name.
        let mut moves: Vec<(String, Vec<Use>)> = Vec::new();
        for u in &uses {
            let Some(c) = calls.get(&u.node) else { continue };
            if c.args.iter().any(|a| a == own) {
                continue;
            }
            let known = || argument_of(&c.function, &g.node(u.node).op, u.slot);
            let Some(k) = position.get(c.function.as_str()).copied().or_else(known) else { continue };
            let Some(target) = c.args.get(k).and_then(|p| params.get(p)) else { continue };
            if *target == name {
                continue;
            }
            match moves.iter_mut().find(|(t, _)| t == target) {
                Some((_, us)) => us.push(*u),
                None => moves.push((target.clone(), vec![*u])),
            }
        }
        for (target, us) in moves {
            // A name the graph already has is another value, not this parameter's: left as read.
            if g.find(&target).is_some() {
                continue;
            }
            let tensor = g.value(v).initializer().expect("an initializer").clone();
            let copy = g.add_initializer(&target, tensor);
            g.move_uses(v, copy, &us);
        }
    }
}

/// Which `%` argument of a call of `function` the input `slot` of one of its nodes, `op`, reads,
/// for the calls whose parameters exporters merge: a linear layer (`MatMul` or `Gemm` reads the
/// weight, the `Add` or the Gemm's C the bias), `addmm` (bias first), a convolution and a layer
/// norm.
fn argument_of(function: &str, op: &Op, slot: usize) -> Option<usize> {
    let f = function.strip_prefix("torch.ops.aten.")?;
    Some(match (f, op, slot) {
        ("linear.default", Op::MatMul | Op::Gemm(_), 1) => 1,
        ("linear.default", Op::Gemm(_), 2) | ("linear.default", Op::Add, _) => 2,
        ("addmm.default", Op::Gemm(_), 2) => 0,
        ("addmm.default", Op::Gemm(_), 1) => 2,
        ("convolution.default" | "conv1d.default" | "conv2d.default" | "conv3d.default", Op::Conv(_), 1 | 2) => slot,
        ("layer_norm.default", Op::LayerNormalization(_), 1 | 2) => slot,
        _ => return None,
    })
}

/// Makes each `Identity` of an initializer whose elements are all equal an initializer of its own
/// (see the module's documentation). Returns the Identity nodes removed.
pub(super) fn untie_identities(g: &mut Graph) -> Vec<NodeId> {
    let mut removed = Vec::new();
    let identities: Vec<NodeId> = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Identity)).collect();
    for n in identities {
        let (Some(v), [o]) = (g.node(n).input(0), g.node(n).outputs()) else { continue };
        let o = *o;
        let Some(t) = g.value(v).initializer() else { continue };
        if t.numel() == 0 || !t.dtype().is_float() || !t.all_equal() || g.name_is_referenced(o) {
            continue;
        }
        let (t, name) = (t.clone(), g.name(o).to_string());
        let copy = g.add_initializer(&format!("{name}.copy"), t);
        g.replace_uses(o, copy);
        g.remove_node(n);
        g.rename(copy, &name);
        removed.push(n);
    }
    removed
}

/// Gives back the zero biases the exporter removed (see the module's documentation).
pub(super) fn restore_removed(g: &mut Graph, params: &HashMap<String, String>, calls: &HashMap<NodeId, FxCall>) {
    // The nodes of each call, in node order.
    let mut nodes_of: BTreeMap<&str, Vec<NodeId>> = BTreeMap::new();
    for (&n, c) in calls {
        nodes_of.entry(c.result.as_str()).or_default().push(n);
    }
    for nodes in nodes_of.values_mut() {
        nodes.sort_unstable();
        let call = &calls[&nodes[0]];
        let bias = match call.function.as_str() {
            "torch.ops.aten.addmm.default" => 0,
            "torch.ops.aten.linear.default"
            | "torch.ops.aten.convolution.default"
            | "torch.ops.aten.conv1d.default"
            | "torch.ops.aten.conv2d.default"
            | "torch.ops.aten.conv3d.default"
            | "torch.ops.aten.layer_norm.default" => 2,
            _ => continue,
        };
        let Some(target) = call.args.get(bias).and_then(|p| params.get(p)) else { continue };
        let of =
            |pick: fn(&Op) -> bool| -> Vec<NodeId> { nodes.iter().copied().filter(|&n| pick(&g.node(n).op)).collect() };
        let gemm = of(|o| matches!(o, Op::Gemm(_)));
        let matmul = of(|o| matches!(o, Op::MatMul));
        let conv = of(|o| matches!(o, Op::Conv(_)));
        let norm = of(|o| matches!(o, Op::LayerNormalization(_)));
        let adds = of(|o| matches!(o, Op::Add));
        let missing = |n: NodeId| g.node(n).input(2).is_none();
        match (&gemm[..], &matmul[..], &conv[..], &norm[..]) {
            ([n], [], [], []) if missing(*n) => {
                let Op::Gemm(a) = &g.node(*n).op else { unreachable!() };
                let width = weight_dim(g, *n, if a.transB { 0 } else { 1 });
                if let Some(c) = width.and_then(|(dtype, w)| zero_bias(g, target, dtype, vec![w])) {
                    g.set_input(*n, 2, Some(c));
                }
            }
            ([], [n], [], []) if adds.is_empty() => {
                let width = weight_dim(g, *n, usize::MAX);
                if let Some(b) = width.and_then(|(dtype, w)| zero_bias(g, target, dtype, vec![w])) {
                    add_bias(g, *n, b);
                }
            }
            ([], [], [n], []) if missing(*n) => {
                let width = weight_dim(g, *n, 0);
                if let Some(b) = width.and_then(|(dtype, w)| zero_bias(g, target, dtype, vec![w])) {
                    g.set_input(*n, 2, Some(b));
                }
            }
            ([], [], [], [n]) if missing(*n) => {
                let scale = g.node(*n).input(1).map(|s| g.ty(s).clone());
                let shape = scale.as_ref().and_then(|t| Some((t.dtype?, t.shape.as_ref()?.as_fixed()?)));
                if let Some(b) = shape.and_then(|(dtype, shape)| zero_bias(g, target, dtype, shape)) {
                    g.set_input(*n, 2, Some(b));
                }
            }
            _ => {}
        }
    }
}

/// The zero bias `target` of `dtype` and `shape`: made, or the one made for another call of the
/// same module (or kept by the exporter where a call kept it); `None` where the name is another
/// value's.
fn zero_bias(g: &mut Graph, target: &str, dtype: crate::DType, shape: Vec<u64>) -> Option<ValueId> {
    let Some(v) = g.find(target) else { return Some(g.add_initializer(target, Tensor::zeros(dtype, shape))) };
    let t = g.value(v).initializer()?;
    let zero = t.dtype() == dtype && t.shape() == shape && t.values().all(|x| x == 0.0);
    zero.then_some(v)
}

/// The dtype of input 1 of `n` (a weight) and its dim `axis` (`usize::MAX`: the last), when fixed.
fn weight_dim(g: &Graph, n: NodeId, axis: usize) -> Option<(crate::DType, u64)> {
    let ty = g.ty(g.node(n).input(1)?);
    let dims = ty.shape.as_ref()?.dims();
    let d = if axis == usize::MAX { dims.last()? } else { dims.get(axis)? };
    Some((ty.dtype?, d.fixed()?))
}

/// `y = MatMul(..)` becomes `Add(MatMul(..), bias)`: the Add's output takes `y`'s name, readers
/// and declared type.
fn add_bias(g: &mut Graph, n: NodeId, b: ValueId) {
    let y = g.node(n).outputs()[0];
    if g.name_is_referenced(y) {
        return;
    }
    let name = g.name(y).to_string();
    g.rename(y, &format!("{name}.unbiased"));
    let (_, out) = g.add_op(&name, Op::Add, &[Some(y), Some(b)], 1);
    let readers: Vec<Use> = g.value(y).uses().iter().copied().filter(|u| g.node(u.node).outputs() != out).collect();
    g.move_uses(y, out[0], &readers);
    g.set_ty(out[0], g.ty(y).clone());
}

#[cfg(test)]
mod tests {
    use super::super::proto::{self, ModelProto, NodeProto, StringStringEntryProto, TensorProto};
    use super::*;
    use prost::Message;

    fn entry(k: &str, v: &str) -> StringStringEntryProto {
        StringStringEntryProto { key: k.into(), value: v.into() }
    }

    /// A node with one output (its name the node's), and the FX call it came from.
    fn node(op: &str, ins: &[&str], out: &str, fx: Option<String>) -> NodeProto {
        NodeProto {
            op_type: op.into(),
            name: out.into(),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: vec![out.into()],
            metadata_props: fx.map(|f| vec![entry(FX_NODE_KEY, &f)]).unwrap_or_default(),
            ..Default::default()
        }
    }

    /// An f32 value of `dims` (`None`: no shape).
    fn vi(name: &str, dims: Option<&[i64]>) -> proto::ValueInfoProto {
        let dim = |&d: &i64| proto::tensor_shape_proto::Dimension {
            value: Some(proto::tensor_shape_proto::dimension::Value::DimValue(d)),
            ..Default::default()
        };
        let shape = dims.map(|d| proto::TensorShapeProto { dim: d.iter().map(dim).collect() });
        proto::ValueInfoProto {
            name: name.into(),
            r#type: Some(proto::TypeProto {
                value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor { elem_type: 1, shape })),
                denotation: String::new(),
            }),
            doc_string: String::new(),
        }
    }

    /// Imports a model of `nodes` whose graph carries `signature`, each target a PARAMETER.
    fn import(
        nodes: Vec<NodeProto>,
        initializer: Vec<TensorProto>,
        io: (Vec<proto::ValueInfoProto>, Vec<proto::ValueInfoProto>),
        targets: &[&str],
    ) -> Graph {
        let signature =
            targets.iter().map(|t| format!("p_{}: PARAMETER target='{t}'\n", t.replace('.', "_"))).collect::<String>();
        let model = ModelProto {
            ir_version: 10,
            opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 18 }],
            graph: Some(proto::GraphProto {
                name: "exported".into(),
                node: nodes,
                initializer,
                input: io.0,
                output: io.1,
                metadata_props: vec![entry(SIGNATURE_KEY, &signature)],
                ..Default::default()
            }),
            ..Default::default()
        };
        super::super::decode_onnx(model.encode_to_vec().into(), None).unwrap()
    }

    #[test]
    fn reads_the_signature_and_the_calls() {
        let sig = "\n# inputs\np_tok_weight: PARAMETER target='tok.weight'\nb_mask: BUFFER target='mask' persistent=False\ntokens: USER_INPUT\n";
        let p = parameters(sig);
        assert_eq!(p.len(), 1);
        assert_eq!(p["p_tok_weight"], "tok.weight");
        let entry = |p: &str, k: &str, t: Option<&str>| SignatureInput {
            placeholder: p.into(),
            kind: k.into(),
            target: t.map(String::from),
        };
        let all = parse_signature(&format!("{sig}\n# outputs\nloss: USER_OUTPUT\n"));
        assert_eq!(
            all,
            [
                entry("p_tok_weight", "PARAMETER", Some("tok.weight")),
                entry("b_mask", "BUFFER", Some("mask")),
                entry("tokens", "USER_INPUT", None)
            ]
        );
        let c = FxCall::parse("%layer_norm_2 : [num_users=1] = call_function[target=torch.ops.aten.layer_norm.default](args = (%add_129, [768], %p_blocks_1_ln1_weight, %p_blocks_1_ln1_bias, 1e-05, False), kwargs = {})").unwrap();
        assert_eq!(c.function, "torch.ops.aten.layer_norm.default");
        assert_eq!(c.args, ["add_129", "p_blocks_1_ln1_weight", "p_blocks_1_ln1_bias"]);
        assert_eq!(FxCall::parse("%x : [num_users=1] = placeholder[target=x]"), None);
    }

    /// An import: only the reader whose call names another, absent parameter where its function's
    /// other reader names this one reads a copy.
    #[test]
    fn only_readers_that_name_another_parameter_read_a_copy() {
        let call = |f: &str, a: &str, p: &str| {
            Some(format!("%o : [num_users=1] = call_function[target={f}](args = (%{a}, %{p}), kwargs = {{}})"))
        };
        let ones = |name: &str| TensorProto {
            name: name.into(),
            data_type: 1,
            dims: vec![3],
            float_data: vec![1.0; 3],
            ..Default::default()
        };
        let nodes = vec![
            node("Mul", &["x", "a.weight"], "m1", call("f", "x", "p_a_weight")),
            // Merged: reads `b.weight`'s copy.
            node("Mul", &["m1", "a.weight"], "m2", call("f", "m1", "p_b_weight")),
            // Another function, which no reader of `a.weight` says reads it where: kept.
            node("Add", &["m2", "a.weight"], "m3", call("g", "m2", "p_c_weight")),
            // No metadata: kept.
            node("Mul", &["m3", "a.weight"], "m4", None),
            // The same parameter, read twice (a tied weight): kept.
            node("Mul", &["m4", "a.weight"], "m5", call("f", "m4", "p_a_weight")),
            // A parameter the graph has under its name already: kept.
            node("Mul", &["m5", "a.weight"], "y", call("f", "m5", "p_d_weight")),
        ];
        let io = (vec![vi("x", None)], vec![vi("y", None)]);
        let g = import(
            nodes,
            vec![ones("a.weight"), ones("d.weight")],
            io,
            &["a.weight", "b.weight", "c.weight", "d.weight"],
        );
        let readers = |name: &str| -> Vec<String> {
            let v = g.find(name).unwrap_or_else(|| panic!("no `{name}`"));
            assert!(g.value(v).initializer().is_some());
            g.value(v).uses().iter().map(|u| g.node(u.node).name.clone()).collect()
        };
        assert_eq!(readers("b.weight"), ["m2"]);
        assert_eq!(readers("a.weight"), ["m1", "m3", "m4", "m5", "y"]);
        assert_eq!(readers("d.weight"), Vec::<String>::new());
        assert!(g.find("c.weight").is_none());
    }

    /// Zero biases the optimizer dropped: a module called twice (one `addmm` bias, two Gemms
    /// without C) gets one bias back, read by both; a linear layer's MatMul gets its Add back, which
    /// takes the MatMul's name (the graph output's).
    #[test]
    fn dropped_zero_biases_come_back_for_every_call() {
        let call = |r: &str, f: &str, args: &str| {
            Some(format!("%{r} : [num_users=1] = call_function[target=torch.ops.aten.{f}.default](args = ({args}), kwargs = {{}})"))
        };
        let w = |name: &str| TensorProto {
            name: name.into(),
            data_type: 1,
            dims: vec![3, 4],
            float_data: (0..12).map(|i| i as f32).collect(),
            ..Default::default()
        };
        let nodes = vec![
            node("Gemm", &["x", "w.weight"], "y1", call("addmm", "addmm", "%p_a_bias, %x, %p_w_weight")),
            node("Gemm", &["x", "w.weight"], "y2", call("addmm_1", "addmm", "%p_a_bias, %x, %p_w_weight")),
            node("MatMul", &["x", "v.weight"], "y3", call("linear", "linear", "%x, %p_v_weight, %p_v_bias")),
            node("Add", &["y1", "y2"], "y", None),
        ];
        let io = (vec![vi("x", Some(&[2, 3]))], vec![vi("y", Some(&[2, 4])), vi("y3", Some(&[2, 4]))]);
        let g = import(nodes, vec![w("w.weight"), w("v.weight")], io, &["a.bias", "w.weight", "v.weight", "v.bias"]);
        let bias = |name: &str| {
            let v = g.find(name).unwrap_or_else(|| panic!("no `{name}`"));
            assert_eq!(
                g.value(v).initializer().map(|t| (t.shape().to_vec(), t.to_f64_vec())),
                Some((vec![4], vec![0.0; 4]))
            );
            g.value(v).uses().iter().map(|u| (g.node(u.node).name.clone(), u.slot)).collect::<Vec<_>>()
        };
        assert_eq!(bias("a.bias"), [("y1".to_string(), 2), ("y2".to_string(), 2)]);
        assert_eq!(bias("v.bias"), [("y3".to_string(), 1)]);
        let y3 = g.outputs()[1];
        assert_eq!(g.name(y3), "y3");
        let (add, _) = g.value(y3).producer().unwrap();
        assert!(matches!(g.node(add).op, Op::Add));
        assert!(matches!(g.node(g.value(g.node(add).input(0).unwrap()).producer().unwrap().0).op, Op::MatMul));
    }

    /// The legacy exporter's Identity of a merged initializer: of an all-ones scale, its own
    /// initializer; of a tensor whose elements differ (shared, not equal by initialisation), kept.
    #[test]
    fn identities_of_uniform_initializers_become_initializers() {
        use crate::{DType, Shape, TypeInfo};
        let mut g = Graph::new("g");
        let x = g.add_input("x", TypeInfo::new(DType::F32, Shape::fixed(&[3])));
        let ones = g.add_initializer("a.weight", Tensor::from_f32(vec![3], &[1.0; 3]));
        let mixed = g.add_initializer("c.weight", Tensor::from_f32(vec![3], &[1.0, 2.0, 3.0]));
        let b = g.add_op("b.weight", Op::Identity, &[Some(ones)], 1).1[0];
        let d = g.add_op("d.weight", Op::Identity, &[Some(mixed)], 1).1[0];
        let y = g.add_op("y", Op::Mul, &[Some(x), Some(b)], 1).1[0];
        let z = g.add_op("z", Op::Mul, &[Some(y), Some(d)], 1).1[0];
        g.add_output(z);
        untie_identities(&mut g);
        let b = g.find("b.weight").unwrap();
        assert_eq!(g.value(b).initializer().map(|t| t.to_f64_vec()), Some(vec![1.0; 3]));
        assert_eq!(g.value(b).uses().len(), 1);
        assert!(g.value(ones).uses().is_empty());
        let d = g.find("d.weight").unwrap();
        assert!(g.value(d).initializer().is_none());
        assert_eq!(g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Identity)).count(), 1);
        g.check_structure().unwrap();
    }
}
