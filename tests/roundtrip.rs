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
