//! Import → IR → export round trips on every fixture, and snapshots of the imported IR.

mod common;

use common::{fixture, mpc, scratch, settings, FIXTURES};
use mpc_ir::text::{self, TensorMode};

fn compiled(name: &str) -> mpc_ir::Graph {
    let path = fixture(name);
    let mut g = mpc::load(&path).expect("load");
    mpc::compile(&mut g, &path, &mpc::Options::default(), &mut |_, _| {}).expect("compile");
    g
}

#[test]
fn imported_ir_snapshots() {
    for name in FIXTURES {
        let g = compiled(name);
        settings().bind(|| insta::assert_snapshot!(format!("import__{name}"), text::to_summary(&g).unwrap()));
    }
}

#[test]
fn text_ir_reproduces_the_graph() {
    for name in FIXTURES {
        let g = compiled(name);
        for mode in [TensorMode::Inline, TensorMode::FILE] {
            let printed = text::print(&g, mode).unwrap();
            let back = text::parse(&printed.text, Some(&printed.sidecar)).unwrap_or_else(|e| panic!("{name}: {e}"));
            let again = text::print(&back, mode).unwrap();
            assert_eq!(printed.text, again.text, "{name}: text differs after a parse");
            assert_eq!(printed.sidecar, again.sidecar, "{name}: sidecar differs after a parse");
            let (a, b) = (mpc_ir::onnx::encode_onnx(&g).unwrap(), mpc_ir::onnx::encode_onnx(&back).unwrap());
            assert!(a == b, "{name}: the parsed IR exports a different ONNX model");
        }
    }
}

#[test]
fn onnx_export_is_a_fixed_point() {
    for name in FIXTURES {
        let g = compiled(name);
        let once = mpc_ir::onnx::encode_onnx(&g).unwrap();
        let back = mpc_ir::onnx::decode_onnx(once.clone().into(), None).unwrap();
        let twice = mpc_ir::onnx::encode_onnx(&back).unwrap();
        assert!(once == twice, "{name}: export → import → export changed the model");
    }
}

#[test]
fn cli_text_ir_round_trip_is_byte_identical() {
    let dir = scratch("cli_text_ir_round_trip");
    for name in FIXTURES {
        let (x, y, z) =
            (dir.join(format!("{name}.mpcir")), dir.join(format!("{name}2.mpcir")), dir.join(format!("{name}.onnx")));
        let src = fixture(name);
        for args in [
            vec![src.to_str().unwrap(), "-o", x.to_str().unwrap()],
            vec![x.to_str().unwrap(), "-o", y.to_str().unwrap()],
            vec![x.to_str().unwrap(), "-o", z.to_str().unwrap()],
        ] {
            let mut full = vec!["compile"];
            full.extend(args);
            let out = mpc(&full);
            assert!(out.status.success(), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        }
        assert_eq!(std::fs::read(&x).unwrap(), std::fs::read(&y).unwrap(), "{name}: .mpcir differs");
        let (sx, sy) = (mpc::sidecar_path(&x), mpc::sidecar_path(&y));
        assert_eq!(std::fs::read(&sx).ok(), std::fs::read(&sy).ok(), "{name}: sidecar differs");
        // .mpcir → .onnx gives the same model as .onnx → .onnx.
        let direct = dir.join(format!("{name}.direct.onnx"));
        assert!(mpc(&["compile", src.to_str().unwrap(), "-o", direct.to_str().unwrap()]).status.success());
        assert!(std::fs::read(&z).unwrap() == std::fs::read(&direct).unwrap(), "{name}: .mpcir → .onnx differs");
    }
}

/// GatherND, ScatterND and ScatterElements are typed ops: their attributes survive the text IR
/// and ONNX export (tests/models/indexing.onnx, which tests/interop/check_onnx.py also runs
/// through onnx.checker and onnxruntime), and the export opset covers their reductions.
#[test]
fn index_ops_keep_their_attributes_through_export() {
    use mpc_ir::onnx::proto;
    use mpc_ir::{Attr, Attrs, Graph};
    use prost::Message;

    let attrs = |g: &Graph| -> Vec<(String, Attrs)> {
        g.node_ids()
            .map(|n| (g.node(n).op.op_type().to_string(), g.node(n).op.attrs()))
            .filter(|(t, _)| t != "MatMul")
            .collect()
    };
    let s = |v: &str| Attr::String(v.into());
    let want: Vec<(String, Attrs)> = vec![
        ("GatherND".into(), vec![("batch_dims".into(), Attr::Int(1))]),
        ("ScatterND".into(), vec![("reduction".into(), s("add"))]),
        ("ScatterElements".into(), vec![("axis".into(), Attr::Int(1)), ("reduction".into(), s("max"))]),
    ];
    let g = compiled("indexing");
    assert!(g.node_ids().all(|n| !g.node(n).op.is_opaque()), "an index op was left opaque");
    assert_eq!(attrs(&g), want);

    let bytes = mpc_ir::onnx::encode_onnx(&g).unwrap();
    let model = proto::ModelProto::decode(bytes.as_slice()).unwrap();
    let written: Vec<(String, Vec<String>)> = model
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .filter(|n| n.op_type != "MatMul")
        .map(|n| (n.op_type.clone(), n.attribute.iter().map(|a| a.name.clone()).collect()))
        .collect();
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        written,
        vec![
            ("GatherND".into(), names(&["batch_dims"])),
            ("ScatterND".into(), names(&["reduction"])),
            ("ScatterElements".into(), names(&["axis", "reduction"])),
        ]
    );
    assert_eq!(attrs(&mpc_ir::onnx::decode_onnx(bytes.into(), None).unwrap()), want);
    let printed = text::print(&g, TensorMode::Inline).unwrap();
    assert_eq!(attrs(&text::parse(&printed.text, None).unwrap()), want);

    // A reduction needs opset 16 (add, mul) or 18 (max, min): export raises a model's opset to it.
    for (reduction, opset) in [("none", 13), ("add", 16), ("mul", 16), ("max", 18), ("min", 18)] {
        for op in ["ScatterND", "ScatterElements"] {
            let i = if op == "ScatterND" { "i64[1,1]" } else { "i64[1]" };
            let src = format!(
                "mpcir 1\nmodel ir_version=8\nopset \"\" 13\ngraph \"t\"\n  input %0 \"x\": f32[4]\n  init %1 \"i\" = {i}{{0}}\n  init %2 \"u\" = f32[1]{{1.0}}\n  %3 \"y\": f32[4] = {op}[reduction=\"{reduction}\"](%0, %1, %2)\n  output %3\nend\n"
            );
            let g = text::parse(&src, None).unwrap();
            assert_eq!(mpc_ir::onnx::export_opset(&g), opset, "{op} {reduction}");
        }
    }
}

/// Opset 9-10 `Scatter` is ScatterElements under its old name: it imports as that op (so it
/// runs) and exports under the new name.
#[test]
fn opset10_scatter_imports_as_scatter_elements() {
    use mpc_ir::onnx::proto::{self, tensor_shape_proto::dimension, type_proto};
    use mpc_ir::{Attr, Op};
    use prost::Message;

    let vi = |name: &str, elem_type: i32, dims: &[i64]| proto::ValueInfoProto {
        name: name.into(),
        r#type: Some(proto::TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type,
                shape: Some(proto::TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| proto::tensor_shape_proto::Dimension {
                            value: Some(dimension::Value::DimValue(d)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            denotation: String::new(),
        }),
        doc_string: String::new(),
    };
    let node = proto::NodeProto {
        op_type: "Scatter".into(),
        name: "scatter".into(),
        input: vec!["x".into(), "i".into(), "u".into()],
        output: vec!["y".into()],
        attribute: vec![proto::AttributeProto { name: "axis".into(), r#type: 2, i: 1, ..Default::default() }],
        ..Default::default()
    };
    let model = proto::ModelProto {
        ir_version: 5,
        opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 10 }],
        graph: Some(proto::GraphProto {
            name: "scatter".into(),
            node: vec![node],
            input: vec![vi("x", 1, &[1, 5]), vi("i", 7, &[1, 2]), vi("u", 1, &[1, 2])],
            output: vec![vi("y", 1, &[1, 5])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let g = mpc_ir::onnx::decode_onnx(model.encode_to_vec().into(), None).unwrap();
    let n = g.node_ids().next().unwrap();
    assert!(matches!(&g.node(n).op, Op::ScatterElements(a) if a.axis == 1), "{:?}", g.node(n).op);
    let out = proto::ModelProto::decode(mpc_ir::onnx::encode_onnx(&g).unwrap().as_slice()).unwrap();
    let written = &out.graph.unwrap().node[0];
    assert_eq!(written.op_type, "ScatterElements");
    assert_eq!(g.node(n).op.attrs(), vec![("axis".to_string(), Attr::Int(1))]);
}

/// What torch's dynamo exporter writes without its optimizer: `SplitToSequence` read by
/// `SequenceAt` at constant positions (one negative, one read twice) imports as a Split, and
/// `CastLike` as a Cast to its second input's dtype (an initializer's, or a Constant node's).
/// The model runs: y = x's columns [2, 0, 1] + x (f16 there and back) + x's first column again.
#[test]
fn unoptimized_dynamo_forms_import_as_split_and_cast() {
    use common::onnx::{i64_tensor, node, tensor_vi};
    use mpc_ir::onnx::proto::{self, AttributeProto, ModelProto, TensorProto};
    use mpc_ir::Op;
    use prost::Message;

    let int = |name: &str, i: i64| AttributeProto { name: name.into(), r#type: 2, i, ..Default::default() };
    let mut split = node("SplitToSequence", &["x", "two"], &["seq"]);
    split.attribute = vec![int("axis", 1), int("keepdims", 1)];
    let half =
        TensorProto { name: "half".into(), data_type: 10, dims: vec![], int32_data: vec![0], ..Default::default() };
    let mut like = node("Constant", &[], &["like32"]);
    let like_value = TensorProto { data_type: 1, dims: vec![], float_data: vec![0.0], ..Default::default() };
    like.attribute =
        vec![AttributeProto { name: "value".into(), r#type: 4, t: Some(like_value), ..Default::default() }];
    let nodes = vec![
        split,
        node("SequenceAt", &["seq", "one"], &["tail"]),
        node("SequenceAt", &["seq", "minus_two"], &["head"]),
        node("SequenceAt", &["seq", "zero"], &["head_again"]),
        node("Concat", &["tail", "head"], &["perm"]),
        node("CastLike", &["x", "half"], &["x16"]),
        like,
        node("CastLike", &["x16", "like32"], &["x32"]),
        node("Add", &["perm", "x32"], &["sum"]),
        node("Slice", &["head_again", "zero1", "one1", "one1"], &["first"]),
        node("Add", &["sum", "first"], &["y"]),
    ];
    let mut nodes = nodes;
    nodes[4].attribute = vec![int("axis", 1)];
    let scalar = |name: &str, v: i64| TensorProto {
        name: name.into(),
        data_type: 7,
        dims: vec![],
        int64_data: vec![v],
        ..Default::default()
    };
    let inits = vec![
        scalar("two", 2),
        scalar("one", 1),
        scalar("minus_two", -2),
        scalar("zero", 0),
        i64_tensor("zero1", &[0]),
        i64_tensor("one1", &[1]),
        half,
    ];
    let model = ModelProto {
        ir_version: 8,
        opset_import: vec![proto::OperatorSetIdProto { domain: String::new(), version: 18 }],
        graph: Some(proto::GraphProto {
            name: "unoptimized".into(),
            node: nodes,
            initializer: inits,
            input: vec![tensor_vi("x", 1, &[2, 3])],
            output: vec![tensor_vi("y", 1, &[2, 3])],
            ..Default::default()
        }),
        ..Default::default()
    };
    let g = mpc_ir::onnx::decode_onnx(model.encode_to_vec().into(), None).unwrap();
    let ops: Vec<&Op> = g.node_ids().map(|n| &g.node(n).op).collect();
    assert!(!ops.iter().any(|o| matches!(o, Op::Opaque(_))), "{ops:?}");
    assert_eq!(ops.iter().filter(|o| matches!(o, Op::Split(_))).count(), 1);
    assert_eq!(ops.iter().filter(|o| matches!(o, Op::Cast(_))).count(), 2);
    let x: Vec<f32> = vec![1.0, 2.0, 3.0, 0.1, 0.2, 0.3];
    let inputs =
        [("x".to_string(), mpc_runtime::HostTensor::from_f32(mpc_ir::DType::F32, vec![2, 3], x.clone()))].into();
    let out = mpc::run::run_once(&g, &inputs, std::path::Path::new("unoptimized.onnx")).unwrap();
    let y = out.iter().find(|(n, _)| n == "y").unwrap().1.f64s();
    let r = |v: f32| half::f16::from_f32(v).to_f32() as f64;
    let want: Vec<f64> = (0..2)
        .flat_map(|i| {
            let row = &x[3 * i..3 * i + 3];
            let perm = [row[2], row[0], row[1]];
            (0..3).map(move |j| perm[j] as f64 + r(row[j]) + row[0] as f64).collect::<Vec<_>>()
        })
        .collect();
    for (a, b) in y.iter().zip(&want) {
        assert!((a - b).abs() < 1e-6, "{y:?} against {want:?}");
    }
}
