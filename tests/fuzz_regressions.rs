//! The inputs the fuzz campaigns found (tests/data/fuzz: each once crashed, hung or made mpc
//! write what it could not read), through the commands the fuzz targets mirror. Each must end
//! with exit 0, or one line and exit 2; what compile writes must read back, as ONNX and as text
//! (the text IR both of the input and of the ONNX written).

mod common;

use common::{mpc, scratch};

fn one_line_or_ok(what: &str, r: &std::process::Output) -> bool {
    let err = String::from_utf8_lossy(&r.stderr);
    match r.status.code() {
        Some(0) => true,
        Some(2) => {
            assert_eq!(err.trim().lines().count(), 1, "{what}: {err}");
            false
        }
        c => panic!("{what}: exit {c:?}: {err}"),
    }
}

/// Findings that must be refused, with what the one line says (the others may also compile).
const REFUSED: &[(&str, &str)] = &[
    ("batchnorm_inference_two_outputs.mpcir", "one output in inference mode (training_mode=0), not 2"),
    ("batchnorm_inference_two_outputs.onnx", "one output in inference mode (training_mode=0), not 2"),
    ("contrib_gelu_two_outputs.mpcir", "com.microsoft::Gelu gives one output, not 2"),
    ("tile_repeats_not_a_vector.mpcir", "repeats must be 1-D, not of rank 2"),
];

#[test]
fn every_fuzz_finding_is_handled() {
    let dir = scratch("fuzz_regressions");
    let found = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/fuzz");
    let mut files: Vec<_> = std::fs::read_dir(&found).unwrap().flatten().map(|e| e.path()).collect();
    files.sort();
    assert!(!files.is_empty());
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let m = f.to_str().unwrap();
        for policy in ["fp32", "mixed"] {
            let onnx = dir.join(format!("{name}.{policy}.onnx"));
            let text = dir.join(format!("{name}.{policy}.mpcir"));
            let what = format!("{name} ({policy})");
            let r = mpc(&["compile", m, "--policy", policy, "-o", onnx.to_str().unwrap()]);
            if let Some((_, msg)) = REFUSED.iter().find(|(f, _)| *f == name) {
                let err = String::from_utf8_lossy(&r.stderr);
                assert!(r.status.code() == Some(2) && err.contains(msg), "{what}: {err}");
            }
            if one_line_or_ok(&what, &r) {
                // What compile wrote reads back, and its text IR too.
                let r = mpc(&["compile", onnx.to_str().unwrap(), "-o", text.to_str().unwrap()]);
                assert!(r.status.success(), "{what}: {}", String::from_utf8_lossy(&r.stderr));
                let r = mpc(&["compile", text.to_str().unwrap(), "--emit", "onnx", "-o", onnx.to_str().unwrap()]);
                assert!(r.status.success(), "{what}: {}", String::from_utf8_lossy(&r.stderr));
            }
            // The text IR written straight from the input reads back too (even where the ONNX
            // export refuses a form the opset it writes does not have).
            let r = mpc(&["compile", m, "--policy", policy, "-o", text.to_str().unwrap()]);
            if one_line_or_ok(&format!("{what} text"), &r) {
                let again = dir.join(format!("{name}.{policy}.again.mpcir"));
                let r = mpc(&["compile", text.to_str().unwrap(), "-o", again.to_str().unwrap()]);
                assert!(r.status.success(), "{what}: {}", String::from_utf8_lossy(&r.stderr));
            }
            let r = mpc(&["run", m, "--policy", policy, "--random-inputs", "1", "--max-memory", "4M"]);
            one_line_or_ok(&format!("{what} run"), &r);
            // The summary's FLOP count, which the fuzz targets compute to size their runs.
            one_line_or_ok(&format!("{what} inspect"), &mpc(&["inspect", m, "--policy", policy]));
        }
    }
    println!("fuzz regressions: {} inputs", files.len());
}
