//! The precision pass on the fixtures: snapshots, cast counts, interfaces, explanations.

mod common;

use common::{fixture, settings, FIXTURES};
use mpc::explain::{colour_boundaries, inserted_casts};
use mpc_ir::{DType, Graph, Op};

fn compile(name: &str, policy: &str) -> (Graph, Graph, mpc_passes::Context) {
    let path = fixture(name);
    let before = mpc::load(&path).unwrap();
    let mut g = before.clone();
    let opts = mpc::Options { policy: Some(policy.into()), ..Default::default() };
    let cx = mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{name} {policy}: {e}"));
    (before, g, cx)
}

#[test]
fn rewritten_ir_snapshots() {
    for name in FIXTURES {
        for policy in ["mixed", "mixed-bf16", "fp16"] {
            let (_, g, _) = compile(name, policy);
            let text = mpc_ir::text::to_summary(&g).unwrap();
            settings().bind(|| insta::assert_snapshot!(format!("{policy}__{name}"), text));
        }
    }
}

#[test]
fn transformer_explanation_snapshot() {
    let (before, g, cx) = compile("transformer", "mixed");
    let dims = [("batch".to_string(), 64)].into();
    let text = mpc::explain::explain(&before, &g, cx.report.borrow().as_ref(), &dims).unwrap();
    settings().bind(|| insta::assert_snapshot!("explain__transformer_mixed", text));
}

#[test]
fn transformer_casts_are_few() {
    let (_, g, _) = compile("transformer", "mixed");
    let casts = inserted_casts(&g).len();
    let low_ops = g
        .node_ids()
        .filter(|&n| !matches!(g.node(n).op, Op::Cast(_)))
        .filter(|&n| g.node(n).outputs().iter().any(|&o| g.ty(o).dtype == Some(DType::F16)))
        .count();
    let boundaries = colour_boundaries(&g);
    eprintln!("transformer mixed: {casts} casts, {boundaries} colour boundaries, {low_ops} low-precision ops");
    assert!(casts <= boundaries, "{casts} casts for {boundaries} boundaries");
    assert!(casts <= 2 * low_ops, "{casts} casts for {low_ops} low ops");
    // Every MatMul runs low; Softmax and LayerNormalization stay f32.
    for n in g.node_ids() {
        let out = g.ty(g.node(n).outputs()[0]).dtype;
        match g.node(n).op {
            Op::MatMul => assert_eq!(out, Some(DType::F16), "{}", g.node(n).name),
            Op::Softmax(_) | Op::LayerNormalization(_) => assert_eq!(out, Some(DType::F32), "{}", g.node(n).name),
            _ => {}
        }
    }
}

#[test]
fn interfaces_keep_names_and_dtypes() {
    for name in FIXTURES {
        let (before, g, _) = compile(name, "mixed");
        let sig = |g: &Graph, vs: &[mpc_ir::ValueId]| {
            vs.iter().map(|&v| (g.name(v).to_string(), g.ty(v).dtype)).collect::<Vec<_>>()
        };
        assert_eq!(sig(&before, before.inputs()), sig(&g, g.inputs()), "{name}: inputs");
        assert_eq!(sig(&before, before.outputs()), sig(&g, g.outputs()), "{name}: outputs");
    }
}

#[test]
fn io_types_low_changes_the_interface() {
    let path = fixture("mlp");
    let mut g = mpc::load(&path).unwrap();
    let opts = mpc::Options { policy: Some("mixed".into()), io_low: true, ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    assert_eq!(g.ty(g.inputs()[0]).dtype, Some(DType::F16));
    assert_eq!(g.ty(g.outputs()[0]).dtype, Some(DType::F16));
    assert_eq!(g.name(g.outputs()[0]), "logits");
    assert!(inserted_casts(&g).is_empty(), "an all-low MLP with low interfaces needs no cast");
}

#[test]
fn weights_of_low_ops_are_stored_low() {
    let (before, g, _) = compile("mlp", "mixed");
    for v in g.initializers() {
        assert_eq!(g.value(v).initializer().unwrap().dtype(), DType::F16, "{}", g.name(v));
    }
    let bytes = |g: &Graph| g.initializers().map(|v| g.value(v).initializer().unwrap().bytes().len()).sum::<usize>();
    assert_eq!(bytes(&g) * 2, bytes(&before));
    // ConstantOfShape weights too (a form converters break).
    let (_, g, _) = compile("opset9", "mixed");
    let cos = g.node_ids().find(|&n| matches!(g.node(n).op, Op::ConstantOfShape(_))).unwrap();
    assert_eq!(g.ty(g.node(cos).outputs()[0]).dtype, Some(DType::F16));
}

#[test]
fn opaque_ops_keep_their_dtypes() {
    let (_, g, _) = compile("custom_op", "mixed");
    let gelu = g.node_ids().find(|&n| g.node(n).op.is_opaque()).unwrap();
    let x = g.node(gelu).input(0).unwrap();
    assert_eq!(g.ty(x).dtype, Some(DType::F32), "opaque input must stay f32");
    assert_eq!(g.ty(g.node(gelu).outputs()[0]).dtype, Some(DType::F32));
    // The If's subgraph reads `h` by name: it keeps its name and dtype.
    let (_, g, _) = compile("control_flow", "mixed");
    let h = g.find("h").unwrap();
    assert_eq!(g.ty(h).dtype, Some(DType::F32));
    assert!(matches!(g.node(g.value(h).producer().unwrap().0).op, Op::Cast(_)));
}

/// GridSample's coordinates index pixels: under a low policy none of its arithmetic is coloured
/// low, even between low ops (its grid and its input made by MatMuls, a MatMul after it).
#[test]
fn grid_sample_stays_fp32_between_low_ops() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[1,1,4,300]\n  \
                input %1 \"p\": f32[1,1,5,2]\n  input %2 \"w\": f32[300,300]\n  input %3 \"v\": f32[2,2]\n  input %8 \"u\": f32[5,5]\n  \
                %4 \"xw\": ? = MatMul(%0, %2)\n  %5 \"grid\": ? = MatMul(%1, %3)\n  \
                %6 \"s\": ? = ::GridSample[align_corners=0](%4, %5) @\"sample\"\n  %7 \"y\": ? = MatMul(%6, %8)\n  \
                output %7\nend\n";
    for policy in ["mixed", "mixed-bf16"] {
        let mut g = mpc_ir::text::parse(text, None).unwrap();
        let opts = mpc::Options { policy: Some(policy.into()), ..Default::default() };
        mpc::compile(&mut g, "grid.mpcir".as_ref(), &opts, &mut |_, _| {}).unwrap();
        let low: Vec<String> = g
            .node_ids()
            .filter(|&n| !matches!(g.node(n).op, Op::MatMul | Op::Cast(_)))
            .filter(|&n| g.node(n).outputs().iter().any(|&o| matches!(g.ty(o).dtype, Some(DType::F16 | DType::BF16))))
            .map(|n| format!("{} ({})", g.node(n).name, g.node(n).op.op_type()))
            .collect();
        assert!(low.is_empty(), "{policy}: low nodes besides the MatMuls: {low:?}");
        let matmuls = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::MatMul)).count();
        assert_eq!(matmuls, 3, "{policy}");
        assert!(g.node_ids().all(|n| !g.node(n).op.is_opaque()), "{policy}: GridSample was not written out");
    }
}

/// A BF16 GridSample on an axis of 600 samples where its coordinates say (computed in FP32): in
/// BF16 they would be off by up to 4 pixels (the spacing of BF16 past 512).
#[test]
fn a_bf16_grid_sample_samples_where_its_grid_points() {
    let (len, points) = (600usize, 256usize);
    let text = format!(
        "mpcir 1\nmodel ir_version=10\nopset \"\" 22\ngraph \"g\"\n  input %0 \"x\": bf16[1,1,1,{len}]\n  \
         input %1 \"grid\": bf16[1,1,{points},2]\n  %2 \"y\": ? = ::GridSample[align_corners=0](%0, %1)\n  output %2\nend\n"
    );
    let g = mpc_ir::text::parse(&text, None).unwrap();
    let x: Vec<f64> = (0..len).map(|i| (i % 16) as f64).collect();
    // x in [-1, 1) on a 1/128 grid (exact in BF16), y at the row's centre.
    let grid: Vec<f64> = (0..points).flat_map(|k| [-1.0 + k as f64 / 128.0, 0.0]).collect();
    let feeds = std::collections::HashMap::from([
        ("x".to_string(), mpc_runtime::HostTensor::from_f64(DType::BF16, vec![1, 1, 1, len], x.clone())),
        ("grid".to_string(), mpc_runtime::HostTensor::from_f64(DType::BF16, vec![1, 1, points, 2], grid.clone())),
    ]);
    let out = mpc_runtime::build::run_once(&g, &feeds).unwrap();
    let got = out[0].1.f64s();
    for k in 0..points {
        let u = ((grid[2 * k] + 1.0) * len as f64 - 1.0) / 2.0;
        let (lo, t) = (u.floor(), u - u.floor());
        let at = |i: f64| if i >= 0.0 && i < len as f64 { x[i as usize] } else { 0.0 };
        let want = at(lo) * (1.0 - t) + at(lo + 1.0) * t;
        assert!((got[k] - want).abs() <= want.abs() / 128.0 + 1e-6, "point {k} (u = {u}): {} where {want}", got[k]);
    }
}
