//! ONNX models built in tests, and the failure contract of bad input.

use std::path::{Path, PathBuf};

use mpc_ir::onnx::proto::{self, tensor_shape_proto::dimension, type_proto, ModelProto, NodeProto, TensorProto};
use prost::Message;

use super::mpc;

pub fn tensor_vi(name: &str, elem_type: i32, dims: &[i64]) -> proto::ValueInfoProto {
    let dim = dims
        .iter()
        .map(|&d| proto::tensor_shape_proto::Dimension {
            value: Some(dimension::Value::DimValue(d)),
            ..Default::default()
        })
        .collect();
    proto::ValueInfoProto {
        name: name.into(),
        r#type: Some(proto::TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type,
                shape: Some(proto::TensorShapeProto { dim }),
            })),
            denotation: String::new(),
        }),
        doc_string: String::new(),
    }
}

pub fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: op.into(),
        name: format!("{op}_{}", outputs[0]),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

/// x: f32[2,3] → nodes → y
pub fn model(nodes: Vec<NodeProto>, inits: Vec<TensorProto>) -> Vec<u8> {
    ModelProto {
        ir_version: 8,
        opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 17 }],
        graph: Some(proto::GraphProto {
            name: "bad".into(),
            node: nodes,
            initializer: inits,
            input: vec![tensor_vi("x", 1, &[2, 3])],
            output: vec![tensor_vi("y", 1, &[])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

pub fn i64_tensor(name: &str, v: &[i64]) -> TensorProto {
    TensorProto {
        name: name.into(),
        data_type: 7,
        dims: vec![v.len() as i64],
        int64_data: v.to_vec(),
        ..Default::default()
    }
}

/// Runs `mpc compile IN -o OUT` and checks the failure contract; returns stderr.
pub fn rejects(dir: &Path, input: &Path, expect: &str) -> String {
    let out = dir.join("out.onnx");
    let r = mpc(&["compile", input.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&r.stderr).to_string();
    assert_eq!(r.status.code(), Some(2), "exit code for {expect}: stderr {stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "one line expected: {stderr}");
    assert!(stderr.contains(input.file_name().unwrap().to_str().unwrap()), "file not named: {stderr}");
    assert!(stderr.contains(expect), "expected `{expect}` in: {stderr}");
    assert!(!out.exists(), "an output file was written");
    let leftovers: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    stderr
}

pub fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}
