//! Parameters that torch.onnx merged because their values were equal, made separate again.
//!
//! torch.onnx's dynamo exporter (`torch.onnx.export(..., dynamo=True)`, the default since PyTorch
//! 2.9) optimizes the model it writes, and one of its steps keeps a single initializer for each
//! set of equal small tensors. In a freshly initialised model every LayerNorm scale is all ones and
//! many biases are all zeros, so a GPT's 25 LayerNorms end up reading one scale and one bias.
//! Inference is unchanged, but a training step would train them as one parameter.
//!
//! The exporter leaves what undoes it. The graph's `pkg.torch.export.ExportedProgram.graph_signature`
//! names every parameter (`p_blocks_1_ln1_weight: PARAMETER target='blocks.1.ln1.weight'`), and
//! each node's `pkg.torch.onnx.fx_node` is the call it came from, with the placeholders it read
//! (`aten.layer_norm.default(args = (%add, [768], %p_blocks_1_ln1_weight, ...))`). Take an
//! initializer named after a parameter (`blocks.0.ln1.weight`, placeholder `p_blocks_0_ln1_weight`).
//! One of its readers' calls reads that placeholder, at some position among its `%` arguments.
//! Another reader whose call is the same function but reads, at that position, another parameter
//! that no value of the graph is named after, reads a copy of the initializer under that
//! parameter's name instead. Readers that say nothing (no metadata, another function, a subgraph)
//! keep reading the initializer: a parameter genuinely read twice, such as a tied embedding,
//! stays one.

use std::collections::HashMap;

use crate::graph::{Graph, NodeId, Use, ValueId};

/// The graph-level metadata key of torch.export's signature.
pub(super) const SIGNATURE_KEY: &str = "pkg.torch.export.ExportedProgram.graph_signature";
/// The node-level metadata key of the FX call a node came from.
pub(super) const FX_NODE_KEY: &str = "pkg.torch.onnx.fx_node";

/// The parameters of a signature: placeholder → target (the parameter's name in the module).
pub(super) fn parameters(signature: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    for line in signature.lines() {
        let Some((placeholder, rest)) = line.trim().split_once(": PARAMETER target='") else { continue };
        let Some((target, _)) = rest.split_once('\'') else { continue };
        out.insert(placeholder.trim().to_string(), target.to_string());
    }
    out
}

/// An FX call: the function and the placeholders named in its arguments, in order.
#[derive(Debug, PartialEq)]
pub(super) struct FxCall {
    function: String,
    args: Vec<String>,
}

impl FxCall {
    /// Reads `%y : [..] = call_function[target=F](args = (..), kwargs = {..})`.
    pub(super) fn parse(text: &str) -> Option<FxCall> {
        let (_, rest) = text.split_once("call_function[target=")?;
        let (function, args) = rest.split_once("](")?;
        let mut names = Vec::new();
        let mut rest = args;
        while let Some(i) = rest.find('%') {
            rest = &rest[i + 1..];
            let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(rest.len());
            names.push(rest[..end].to_string());
            rest = &rest[end..];
        }
        Some(FxCall { function: function.to_string(), args: names })
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
            let Some(&k) = position.get(c.function.as_str()) else { continue };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_signature_and_the_calls() {
        let sig = "\n# inputs\np_tok_weight: PARAMETER target='tok.weight'\nb_mask: BUFFER target='mask' persistent=False\ntokens: USER_INPUT\n";
        let p = parameters(sig);
        assert_eq!(p.len(), 1);
        assert_eq!(p["p_tok_weight"], "tok.weight");
        let c = FxCall::parse("%layer_norm_2 : [num_users=1] = call_function[target=torch.ops.aten.layer_norm.default](args = (%add_129, [768], %p_blocks_1_ln1_weight, %p_blocks_1_ln1_bias, 1e-05, False), kwargs = {})").unwrap();
        assert_eq!(c.function, "torch.ops.aten.layer_norm.default");
        assert_eq!(c.args, ["add_129", "p_blocks_1_ln1_weight", "p_blocks_1_ln1_bias"]);
        assert_eq!(FxCall::parse("%x : [num_users=1] = placeholder[target=x]"), None);
    }

    /// An import: only the reader whose call names another, absent parameter where its function's
    /// other reader names this one reads a copy.
    #[test]
    fn only_readers_that_name_another_parameter_read_a_copy() {
        use super::super::proto::{self, ModelProto, NodeProto, StringStringEntryProto, TensorProto};
        use prost::Message;
        let entry = |k: &str, v: &str| StringStringEntryProto { key: k.into(), value: v.into() };
        let call = |f: &str, a: &str, p: &str| {
            format!("%o : [num_users=1] = call_function[target={f}](args = (%{a}, %{p}), kwargs = {{}})")
        };
        let node = |op: &str, a: &str, w: &str, out: &str, fx: Option<String>| NodeProto {
            op_type: op.into(),
            name: out.into(),
            input: vec![a.into(), w.into()],
            output: vec![out.into()],
            metadata_props: fx.map(|f| vec![entry(FX_NODE_KEY, &f)]).unwrap_or_default(),
            ..Default::default()
        };
        let ones = |name: &str| TensorProto {
            name: name.into(),
            data_type: 1,
            dims: vec![3],
            float_data: vec![1.0; 3],
            ..Default::default()
        };
        let vi = |name: &str| proto::ValueInfoProto {
            name: name.into(),
            r#type: Some(proto::TypeProto {
                value: Some(proto::type_proto::Value::TensorType(proto::type_proto::Tensor {
                    elem_type: 1,
                    shape: None,
                })),
                denotation: String::new(),
            }),
            doc_string: String::new(),
        };
        let nodes = vec![
            node("Mul", "x", "a.weight", "m1", Some(call("f", "x", "p_a_weight"))),
            // Merged: reads `b.weight`'s copy.
            node("Mul", "m1", "a.weight", "m2", Some(call("f", "m1", "p_b_weight"))),
            // Another function, which no reader of `a.weight` says reads it where: kept.
            node("Add", "m2", "a.weight", "m3", Some(call("g", "m2", "p_c_weight"))),
            // No metadata: kept.
            node("Mul", "m3", "a.weight", "m4", None),
            // The same parameter, read twice (a tied weight): kept.
            node("Mul", "m4", "a.weight", "m5", Some(call("f", "m4", "p_a_weight"))),
            // A parameter the graph has under its name already: kept.
            node("Mul", "m5", "a.weight", "y", Some(call("f", "m5", "p_d_weight"))),
        ];
        let signature = ["a", "b", "c", "d"].map(|p| format!("p_{p}_weight: PARAMETER target='{p}.weight'\n")).concat();
        let model = ModelProto {
            ir_version: 10,
            opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 18 }],
            graph: Some(proto::GraphProto {
                name: "merged".into(),
                node: nodes,
                initializer: vec![ones("a.weight"), ones("d.weight")],
                input: vec![vi("x")],
                output: vec![vi("y")],
                metadata_props: vec![entry(SIGNATURE_KEY, &signature)],
                ..Default::default()
            }),
            ..Default::default()
        };
        let g = super::super::decode_onnx(model.encode_to_vec().into(), None).unwrap();
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
}
