//! ONNX operator conformance cases: import, type inference, export and text IR round trips.
//!
//! Reads the suite from the folder named by `MPC_ONNX_NODE_TESTS` (`.ci/run` sets it) and skips,
//! saying so, when it is not set. Each case must import (or be refused as unsupported: strings,
//! FP8 and the like), pass type inference, export to a model that re-imports and re-exports to
//! the same bytes, and survive a text IR print → parse → print unchanged. Numbers are checked
//! against onnxruntime by tests/interop/check_onnx.py.

mod common;

use std::path::Path;

use mpc_ir::text::{self, TensorMode};

fn check_case(model: &Path) -> Result<(), String> {
    let mut g = mpc::load(model).map_err(|e| e.to_string())?;
    mpc::compile(&mut g, model, &mpc::Options::default(), &mut |_, _| {}).map_err(|e| format!("compile: {e}"))?;
    let once = mpc_ir::onnx::encode_onnx(&g).map_err(|e| format!("export: {e}"))?;
    let back = mpc_ir::onnx::decode_onnx(once.clone().into(), None).map_err(|e| format!("re-import: {e}"))?;
    let twice = mpc_ir::onnx::encode_onnx(&back).map_err(|e| format!("re-export: {e}"))?;
    if once != twice {
        return Err("export → import → export is not a fixed point".into());
    }
    let printed = text::print(&g, TensorMode::Inline).map_err(|e| e.to_string())?;
    let parsed = text::parse(&printed.text, None).map_err(|e| format!("text IR parse: {e}"))?;
    if text::print(&parsed, TensorMode::Inline).map_err(|e| e.to_string())?.text != printed.text {
        return Err("text IR print → parse → print changed the text".into());
    }
    Ok(())
}

#[test]
fn onnx_node_tests_round_trip() {
    let Some(root) = std::env::var_os("MPC_ONNX_NODE_TESTS") else {
        eprintln!("skipped: set MPC_ONNX_NODE_TESTS to the onnx-node-tests folder to run the conformance cases");
        return;
    };
    let mut cases: Vec<_> =
        std::fs::read_dir(&root).expect("read MPC_ONNX_NODE_TESTS").flatten().map(|e| e.path()).collect();
    cases.sort();
    let (mut passed, mut skipped, mut failed) = (0, 0, Vec::new());
    for case in cases {
        let model = case.join("model.onnx");
        if !model.is_file() {
            continue;
        }
        match check_case(&model) {
            Ok(()) => passed += 1,
            Err(e) if e.contains("not supported") => skipped += 1,
            Err(e) => failed.push(format!("{}: {e}", case.file_name().unwrap_or_default().to_string_lossy())),
        }
    }
    for f in &failed {
        eprintln!("FAIL {f}");
    }
    eprintln!(
        "conformance round trip: {passed} passed, {} failed, {skipped} skipped (unsupported dtypes)",
        failed.len()
    );
    assert!(failed.is_empty(), "{} conformance cases failed", failed.len());
    assert!(passed > 800, "only {passed} cases passed: is MPC_ONNX_NODE_TESTS the right folder?");
}
