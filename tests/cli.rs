//! The CLI's pipeline controls and inspect's summary.

mod common;

use common::{fixture, mpc, scratch};

const DEAD: &str = "mpcir 1
model ir_version=8
opset \"\" 17
graph \"g\"
  input %0 \"x\": f32[batch,4]
  %1 \"y\": ? = Relu(%0)
  %2 \"unused\": ? = Neg(%0)
  output %1
end
";

#[test]
fn dump_after_and_stop_after() {
    let dir = scratch("cli_pipeline");
    let src = dir.join("dead.mpcir");
    std::fs::write(&src, DEAD).unwrap();
    let r = mpc(&["compile", src.to_str().unwrap(), "--dump-after", "infer-types"]);
    assert!(r.status.success());
    let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    assert!(err.contains("# after infer-types") && err.contains("\"unused\": f32[batch,4] = Neg"), "{err}");
    assert!(!out.contains("Neg"), "dce should have removed the dead node:\n{out}");
    assert!(out.contains("\"y\": f32[batch,4] = Relu"), "{out}");
    let r = mpc(&["compile", src.to_str().unwrap(), "--stop-after", "infer-types"]);
    assert!(String::from_utf8_lossy(&r.stdout).contains("= Neg(%0)"), "stopped before dce");
}

#[test]
fn inspect_summarizes_ops_parameters_and_flops() {
    let r = mpc(&["inspect", fixture("mlp").to_str().unwrap(), "--dim", "batch=64"]);
    assert!(r.status.success());
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("# 5 nodes, 6 initializers, 1 inputs, 1 outputs; ai.onnx opset 17"), "{out}");
    assert!(out.contains("# ops: Gemm 3, Relu 2"), "{out}");
    // 64·256 + 256 + 256·256 + 256 + 256·10 + 10 parameters
    assert!(out.contains("# initializers: f32 85,002 (332.0 KiB)"), "{out}");
    // 2 · 64 · (64·256 + 256·256 + 256·10)
    assert!(out.contains("# FLOPs at batch=64: 10,813,440"), "{out}");
    let bad = mpc(&["inspect", fixture("mlp").to_str().unwrap(), "--dim", "batch"]);
    assert_eq!(bad.status.code(), Some(2));
}
