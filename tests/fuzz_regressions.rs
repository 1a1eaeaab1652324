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

/// Findings that must be refused: the file, the command (`compile` refuses what `run` does too)
/// and what its one line says. The others may also succeed.
const REFUSED: &[(&str, &str, &str)] = &[
    ("batchnorm_empty_huge_dims.mpcir", "run", "empty, but its other dims multiply past"),
    ("batchnorm_empty_huge_dims_folded.mpcir", "run", "has dims that multiply past"),
    ("batchnorm_inference_two_outputs.mpcir", "compile", "one output in inference mode (training_mode=0), not 2"),
    ("batchnorm_inference_two_outputs.onnx", "compile", "one output in inference mode (training_mode=0), not 2"),
    ("clip_bound_of_data_dependent_length.onnx", "run", "(Clip): min is [0], not one value"),
    ("contrib_gelu_two_outputs.mpcir", "compile", "com.microsoft::Gelu gives one output, not 2"),
    (
        "prelu_slope_wider_than_input.onnx",
        "compile",
        "the slope [3] does not broadcast to the input's shape [] one way",
    ),
    ("resize_empty_axis_to_nonempty.onnx", "run", "axis 1 of the input is empty and cannot be resized to 3"),
    ("tile_repeats_not_a_vector.mpcir", "compile", "repeats must be 1-D, not of rank 2"),
];

/// Asserts what `REFUSED` says of `name` under `command`, if anything.
fn refused_as_listed(name: &str, command: &str, what: &str, r: &std::process::Output) {
    let listed = REFUSED.iter().find(|(f, c, _)| *f == name && (*c == command || *c == "compile"));
    if let Some((_, _, msg)) = listed {
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.code() == Some(2) && err.contains(msg), "{what} {command}: {err}");
    }
}

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
            refused_as_listed(&name, "compile", &what, &r);
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
            refused_as_listed(&name, "run", &what, &r);
            one_line_or_ok(&format!("{what} run"), &r);
            // The summary's FLOP count, which the fuzz targets compute to size their runs.
            one_line_or_ok(&format!("{what} inspect"), &mpc(&["inspect", m, "--policy", policy]));
        }
    }
    println!("fuzz regressions: {} inputs", files.len());
}
