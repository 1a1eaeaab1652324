//! Bad input gets one line on stderr naming the file and the problem, exit code 2, and no output.

mod common;

use common::onnx::{i64_tensor, model, node, rejects, write};
use common::{fixture, mpc, scratch};
use mpc_ir::onnx::proto::TensorProto;

#[test]
fn empty_file() {
    let d = scratch("bad_empty");
    rejects(&d, &write(&d, "empty.onnx", b""), "empty");
}

#[test]
fn truncated_protobuf() {
    let d = scratch("bad_truncated");
    let full = std::fs::read(fixture("mlp")).unwrap();
    rejects(&d, &write(&d, "truncated.onnx", &full[..full.len() / 2]), "not a valid ONNX model");
}

#[test]
fn random_bytes() {
    let d = scratch("bad_random");
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    rejects(&d, &write(&d, "random.onnx", &bytes), "not a valid ONNX model");
}

#[test]
fn a_directory() {
    let d = scratch("bad_dir");
    let sub = d.join("model.onnx");
    std::fs::create_dir(&sub).unwrap();
    rejects(&d, &sub, "directory");
}

#[test]
fn cycle() {
    let d = scratch("bad_cycle");
    let m = model(
        vec![node("Add", &["x", "b"], &["a"]), node("Relu", &["a"], &["b"]), node("Relu", &["a"], &["y"])],
        vec![],
    );
    rejects(&d, &write(&d, "cycle.onnx", &m), "cycle");
}

#[test]
fn undefined_value() {
    let d = scratch("bad_undefined");
    let m = model(vec![node("Add", &["x", "ghost"], &["y"])], vec![]);
    let e = rejects(&d, &write(&d, "undefined.onnx", &m), "`ghost`");
    assert!(e.contains("Add_y"), "node not named: {e}");
}

#[test]
fn value_defined_twice() {
    let d = scratch("bad_twice");
    let m = model(vec![node("Relu", &["x"], &["y"]), node("Neg", &["x"], &["y"])], vec![]);
    rejects(&d, &write(&d, "twice.onnx", &m), "`y` is defined more than once");
}

#[test]
fn reshape_element_count() {
    let d = scratch("bad_reshape");
    let m = model(vec![node("Reshape", &["x", "shape"], &["y"])], vec![i64_tensor("shape", &[4, 2])]);
    let e = rejects(&d, &write(&d, "reshape.onnx", &m), "cannot reshape");
    assert!(e.contains("Reshape_y"), "node not named: {e}");
}

#[test]
fn initializer_length() {
    let d = scratch("bad_init_len");
    let bad = TensorProto {
        name: "w".into(),
        data_type: 1,
        dims: vec![2, 3],
        raw_data: vec![0u8; 20].into(),
        ..Default::default()
    };
    let m = model(vec![node("Add", &["x", "w"], &["y"])], vec![bad]);
    rejects(&d, &write(&d, "init_len.onnx", &m), "initializer `w`: 20 bytes");
}

#[test]
fn unknown_dtype_code() {
    let d = scratch("bad_dtype");
    let bad = TensorProto { name: "w".into(), data_type: 99, dims: vec![1], ..Default::default() };
    let m = model(vec![node("Add", &["x", "w"], &["y"])], vec![bad]);
    rejects(&d, &write(&d, "dtype.onnx", &m), "unknown dtype code 99");
}

#[test]
fn unwritable_output() {
    let d = scratch("bad_output");
    let blocker = write(&d, "not_a_dir", b"");
    let out = blocker.join("out.onnx");
    let r = mpc(&["compile", fixture("mlp").to_str().unwrap(), "-o", out.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("out.onnx") && stderr.contains("cannot write"), "{stderr}");
}

#[test]
fn unknown_policy_and_pass() {
    let m = fixture("mlp");
    let r = mpc(&["compile", m.to_str().unwrap(), "--policy", "bogus"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("unknown policy `bogus`"));
    let r = mpc(&["compile", m.to_str().unwrap(), "--stop-after", "nope"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("unknown pass `nope`"));
}

#[test]
fn text_ir_errors_name_the_line() {
    let d = scratch("bad_text");
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[2]\n  %1 \"y\": f32[2] = Relu(%7)\n  output %1\nend\n";
    let e = rejects(&d, &write(&d, "bad.mpcir", text.as_bytes()), "line 6: %7 is not defined");
    assert!(e.contains("bad.mpcir"));
}

/// Inputs that once panicked: each is one line naming the node, exit 2, nothing written.
#[test]
fn former_panics_are_one_line_errors() {
    let dir = scratch("former_panics");
    let header = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n";
    let x4 = dir.join("x4.safetensors");
    let x: Vec<(String, mpc_runtime::HostTensor)> =
        vec![("x".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![4], vec![1.0; 4]))];
    mpc::run::write_safetensors(&x4, &x).unwrap();
    let cases: [(&str, &str, &[&str], &str); 5] = [
        // A Conv or MaxPool whose input has no shape, fed a tensor of the wrong rank.
        (
            "conv",
            "  input %0 \"x\": f32\n  init %1 \"w\" = f32[1,1,1,1]{1.0}\n  %2 \"y\": ? = Conv(%0, %1) @\"conv\"\n  output %2\n",
            &["--inputs"],
            "`conv` (Conv)",
        ),
        (
            "pool",
            "  input %0 \"x\": f32\n  %1 \"y\": ? = MaxPool[kernel_shape=[2, 2]](%0) @\"pool\"\n  output %1\n",
            &["--inputs"],
            "`pool` (MaxPool)",
        ),
        // Concat of an f32 value and an f16 initializer.
        (
            "concat",
            "  input %0 \"x\": f32[4]\n  init %1 \"h\" = f16[2]{1.0, 2.0}\n  %2 \"y\": ? = Concat[axis=0](%0, %1) @\"cat\"\n  output %2\n",
            &["--inputs"],
            "`cat` (Concat)",
        ),
        // CumSum with an empty axis tensor on a fully typed input.
        (
            "cumsum",
            "  input %0 \"x\": f32[4]\n  init %1 \"a\" = i64[0]{}\n  %2 \"y\": f32[4] = CumSum(%0, %1) @\"cumsum\"\n  output %2\n",
            &["--inputs"],
            "`cumsum` (CumSum)",
        ),
        // A bit shift of floats.
        (
            "bitshift",
            "  input %0 \"x\": f32[4]\n  %1 \"y\": ? = BitShift[direction=\"LEFT\"](%0, %0) @\"shift\"\n  output %1\n",
            &["--inputs"],
            "`shift` (BitShift)",
        ),
    ];
    for (name, body, flags, node) in cases {
        let model = dir.join(format!("{name}.mpcir"));
        std::fs::write(&model, format!("{header}{body}end\n")).unwrap();
        let out = dir.join(format!("{name}.out.safetensors"));
        let mut args = vec!["run", model.to_str().unwrap()];
        args.extend(flags);
        args.extend([x4.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        let r = mpc(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: {err}");
        assert!(err.contains(node), "{name}: {err}");
        assert!(!out.exists(), "{name}: an output was written");
    }
}

/// A tensor whose element count overflows (it once wrapped to a zero-length buffer and crashed
/// `run`) is refused when lowering: one line naming it, exit 2.
#[test]
fn tensors_too_large_to_address_are_refused() {
    let dir = scratch("too_large");
    let model = dir.join("huge.mpcir");
    let body = "  input %0 \"x\": f32[4611686018427387904,4]\n  init %1 \"w\" = f32[4,2]{1,2,3,4,5,6,7,8}\n  %2 \"y\": ? = MatMul(%0, %1)\n  output %2\n";
    std::fs::write(&model, format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{body}end\n")).unwrap();
    for args in [
        vec!["run", model.to_str().unwrap(), "--random-inputs", "1"],
        vec!["inspect", model.to_str().unwrap(), "--memory"],
    ] {
        let r = mpc(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains("`x`") && (err.contains("more than the") || err.contains("does not address")), "{err}");
    }
}

/// A program larger than the memory limit (the machine's memory, or `--max-memory`) is refused
/// when lowering, before anything is allocated: one line with its size, exit 2.
#[test]
fn programs_over_the_memory_limit_are_refused() {
    let dir = scratch("memory_limit");
    let model = dir.join("relu.mpcir");
    let body = "  input %0 \"x\": f32[batch,1024]\n  %1 \"y\": ? = Relu(%0) @\"r\"\n  output %1\n";
    std::fs::write(&model, format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{body}end\n")).unwrap();
    let m = model.to_str().unwrap();
    let out = dir.join("out.safetensors");
    let o = out.to_str().unwrap();
    let cases: [(&[&str], &str); 5] = [
        // 2^41 bytes: under what mpc addresses, over any CI machine's memory.
        (&["run", m, "--random-inputs", "1", "--dim", "batch=536870912"], "more than the"),
        (
            &["run", m, "--random-inputs", "1", "--dim", "batch=1024", "--max-memory", "4M"],
            "the program needs 8388608 bytes",
        ),
        (
            &["inspect", m, "--memory", "--dim", "batch=1024", "--max-memory", "1M"],
            "`x` is f32[1024,1024]: 4194304 bytes",
        ),
        (&["run", m, "--random-inputs", "1", "--max-memory", "4X"], "--max-memory `4X`"),
        (&["run", m, "--random-inputs", "1", "--max-memory", "0"], "--max-memory `0`"),
    ];
    for (args, expect) in cases {
        let mut args = args.to_vec();
        args.extend(["-o", o]);
        if args[0] == "inspect" {
            args.truncate(args.len() - 2);
        }
        let r = mpc(&args);
        let e = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.contains(expect) && e.trim().lines().count() == 1, "{args:?}: expected `{expect}` in {e}");
        assert!(!out.exists(), "{args:?}: an output was written");
    }
    let r = mpc(&["run", m, "--random-inputs", "1", "--dim", "batch=1024", "--max-memory", "64M", "-o", o]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

/// An index out of range in GatherND, ScatterND or ScatterElements stops `mpc run` with one line
/// naming the node, the index and its axis: exit 2, nothing written, no panic.
#[test]
fn index_out_of_range_is_one_line_naming_the_node() {
    let dir = scratch("index_out_of_range");
    let x4 = dir.join("x4.safetensors");
    let x: Vec<(String, mpc_runtime::HostTensor)> =
        vec![("x".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![4], vec![1.0; 4]))];
    mpc::run::write_safetensors(&x4, &x).unwrap();
    let cases = [
        ("gather_nd", "  init %1 \"i\" = i64[1,1]{4}\n  %2 \"y\": ? = GatherND(%0, %1) @\"gnd\"", "`gnd` (GatherND): index 4"),
        (
            "scatter_nd",
            "  init %1 \"i\" = i64[1,1]{-5}\n  init %3 \"u\" = f32[1]{1.0}\n  %2 \"y\": ? = ScatterND(%0, %1, %3) @\"snd\"",
            "`snd` (ScatterND): index -5",
        ),
        (
            "scatter_elements",
            "  init %1 \"i\" = i64[1]{7}\n  init %3 \"u\" = f32[1]{1.0}\n  %2 \"y\": ? = ScatterElements[reduction=\"add\"](%0, %1, %3) @\"sel\"",
            "`sel` (ScatterElements): index 7",
        ),
    ];
    for (name, body, expect) in cases {
        let model = dir.join(format!("{name}.mpcir"));
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 18\ngraph \"t\"\n  input %0 \"x\": f32[4]\n{body}\n  output %2\nend\n");
        std::fs::write(&model, text).unwrap();
        let out = dir.join(format!("{name}.out.safetensors"));
        let r = mpc(&["run", model.to_str().unwrap(), "--inputs", x4.to_str().unwrap(), "-o", out.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{name}: {err}");
        assert!(err.contains(expect) && err.contains("out of range for axis 0 of size 4"), "{name}: {err}");
        assert!(!out.exists(), "{name}: an output was written");
    }
}

/// `-o` replaces only a regular file: a symlink, a FIFO or a directory is refused (one line, exit
/// 2) and left as it was; a writer's stale temporary file beside the output is removed.
#[test]
fn outputs_replace_only_regular_files() {
    let dir = scratch("output_kinds");
    let mlp = fixture("mlp");
    let link = dir.join("link.onnx");
    std::os::unix::fs::symlink(dir.join("target.onnx"), &link).unwrap();
    let fifo = dir.join("fifo.onnx");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (out, why) in [(&link, "is a symbolic link"), (&fifo, "is not a regular file"), (&dir, "is a directory")] {
        let r = mpc(&["compile", mlp.to_str().unwrap(), "--emit", "onnx", "-o", out.to_str().unwrap()]);
        let e = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{e}");
        assert!(e.contains(why) && e.trim().lines().count() == 1, "{e}");
    }
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert!(!dir.join("target.onnx").exists());
    // A temporary file a killed writer left (its process is gone) goes with the next write.
    let out = dir.join("out.onnx");
    let stale = dir.join(".out.onnx.tmp4194303");
    std::fs::write(&stale, b"partial").unwrap();
    assert!(mpc(&["compile", mlp.to_str().unwrap(), "-o", out.to_str().unwrap()]).status.success());
    assert!(out.is_file() && !stale.exists());
}

/// Usage errors are one line and exit 2, as other errors; help is output and exit 0.
#[test]
fn usage_errors_are_one_line() {
    for args in [&["compile", "--bogus"][..], &["compile"], &["compile", "x.onnx", "--policy"], &["frobnicate"]] {
        let r = mpc(args);
        let e = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {e}");
        assert!(e.starts_with("mpc: ") && e.trim().lines().count() == 1, "{args:?}: {e}");
    }
    let e = String::from_utf8_lossy(&mpc(&["compile"]).stderr).into_owned();
    assert!(e.contains("<MODEL>"), "{e}");
    let r = mpc(&["--help"]);
    assert!(r.status.success() && String::from_utf8_lossy(&r.stdout).contains("Usage"));
}

/// A name holding a newline is escaped in messages: still one line.
#[test]
fn names_with_newlines_keep_errors_on_one_line() {
    let dir = scratch("newline_names");
    let mut g = mpc_ir::Graph::new("nl");
    let ty = mpc_ir::TypeInfo::new(mpc_ir::DType::F32, mpc_ir::Shape::fixed(&[2]));
    let x = g.add_input("x\nEVIL", ty);
    let (_, y) = g.add_op("relu", mpc_ir::Op::Relu, &[Some(x)], 1);
    g.add_output(y[0]);
    let model = dir.join("nl.onnx");
    mpc::save(&g, &model, mpc::Format::Onnx).unwrap();
    let inputs = dir.join("in.safetensors");
    let t = mpc_runtime::HostTensor::from_f32(mpc_ir::DType::F32, vec![2], vec![1.0, 2.0]);
    mpc::run::write_safetensors(&inputs, &[("other".into(), t)]).unwrap();
    let r = mpc(&["run", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(e.contains("x\\nEVIL") && e.trim().lines().count() == 1, "{e}");
}
