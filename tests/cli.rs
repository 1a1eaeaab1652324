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

/// `inspect --memory --train` plans the training step: the state holds the masters and Adam's
/// two moments (three copies of the 85,002 parameters, and more under mixed), and the arena
/// keeps what the gradients read; `--train` alone is one line and exit 2.
#[test]
fn inspect_memory_plans_the_training_step() {
    let m = fixture("mlp");
    let plan = |extra: &[&str]| {
        let mut args = vec!["inspect", m.to_str().unwrap(), "--memory", "--batch", "64"];
        args.extend(extra);
        let r = mpc(&args);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
        let out = String::from_utf8_lossy(&r.stdout).to_string();
        let num = |key: &str| -> u64 {
            let at = out.find(key).unwrap_or_else(|| panic!("no `{key}` in {out}")) + key.len();
            out[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
        };
        (num("(state "), num("peak activations "))
    };
    let (state, arena) = plan(&[]);
    let (train_state, train_arena) = plan(&["--train", "--optimizer", "adam"]);
    assert_eq!(state, 0, "inference keeps its weights as constants");
    assert!(train_state >= 3 * 85_002 * 4, "{train_state}");
    assert!(train_arena > arena, "{train_arena} vs {arena}");
    fails_with(&["inspect", m.to_str().unwrap(), "--train"], "--train goes with --ranges or --memory");
}

fn fails_with(args: &[&str], expect: &str) {
    let r = mpc(args);
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line: {err}");
    assert!(err.contains(expect), "expected `{expect}` in: {err}");
}

#[test]
fn policy_errors_name_what_is_wrong() {
    let dir = scratch("cli_policy_errors");
    let m = fixture("mlp");
    let m = m.to_str().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p.to_str().unwrap().to_string()
    };
    fails_with(&["compile", m, "--policy", "mixed", "--deny", "Frobnicate"], "--deny: unknown op `Frobnicate`");
    fails_with(
        &["compile", m, "--policy", "mixed", "--pin-fp32", "/nope"],
        "--pin-fp32 `/nope`: no node has that name",
    );
    fails_with(&["compile", m, "--allow", "Relu"], "policy fp32 rewrites nothing");
    fails_with(&["compile", m, "--fused-attention"], "--fused-attention fuses f16 or bf16 attention");
    let bad_line = write("bad_line.toml", "policy = \"mixed\"\nallow = [\"MatMul\"\ndeny = 3\n");
    fails_with(
        &["compile", m, "--config", &bad_line],
        "bad_line.toml: TOML parse error at line 3, column 1: missing comma between array elements",
    );
    let bad_key = write("bad_key.toml", "policy = \"mixed\"\nalow = [\"MatMul\"]\n");
    fails_with(&["compile", m, "--config", &bad_key], "unknown field `alow`");
    let bad_op = write("bad_op.toml", "policy = \"mixed\"\nfollow = [\"Softmaxx\"]\n");
    fails_with(&["compile", m, "--config", &bad_op], "bad_op.toml: unknown op `Softmaxx`");
    let bad_dtype = write("bad_dtype.toml", "policy = \"mixed\"\nlow_dtype = \"fp8\"\n");
    fails_with(&["compile", m, "--config", &bad_dtype], "low_dtype `fp8`: expected f16 or bf16");
}

#[test]
fn config_file_sets_the_policy() {
    let dir = scratch("cli_config");
    let cfg = dir.join("p.toml");
    std::fs::write(&cfg, "policy = \"mixed\"\nlow_dtype = \"bf16\"\npin_fp32 = [\"/fc3/Gemm\"]\n").unwrap();
    let r = mpc(&["compile", fixture("mlp").to_str().unwrap(), "--config", cfg.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("\"fc1\": bf16[batch,256] = Gemm"), "{out}");
    assert!(out.contains("\"logits\": f32[batch,10] = Gemm"), "pinned node stays f32:\n{out}");
}

#[test]
fn run_checks_its_inputs_and_writes_outputs() {
    let dir = scratch("cli_run");
    let m = fixture("mlp");
    let m = m.to_str().unwrap();
    let ok = |name: &str, shape: Vec<usize>, dtype: mpc_ir::DType| {
        let n = shape.iter().product();
        let t = mpc_runtime::HostTensor::from_f64(dtype, shape, vec![0.5; n]);
        let p = dir.join(format!("{name}.safetensors"));
        mpc::run::write_safetensors(&p, &[("x".to_string(), t)]).unwrap();
        p.to_str().unwrap().to_string()
    };
    let good = ok("good", vec![3, 64], mpc_ir::DType::F32);
    let out = dir.join("out.safetensors");
    let r = mpc(&["run", m, "--inputs", &good, "-o", out.to_str().unwrap(), "--policy", "mixed"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(String::from_utf8_lossy(&r.stdout).starts_with("logits: f32[3, 10] mean"));
    let back = mpc::run::read_safetensors(&out).unwrap();
    assert_eq!(back["logits"].shape, vec![3, 10]);

    fails_with(
        &["run", m, "--inputs", &ok("dtype", vec![3, 64], mpc_ir::DType::F16)],
        "input `x` is f16, the model expects f32",
    );
    fails_with(
        &["run", m, "--inputs", &ok("shape", vec![3, 65], mpc_ir::DType::F32)],
        "input `x` axis 1 is 65, the model declares 64 there ([batch,64]; data [3, 65])",
    );
    let loss = fixture("mlp_loss");
    fails_with(&["run", loss.to_str().unwrap(), "--inputs", &good], "input `labels` is missing");
    fails_with(&["run", m], "give --inputs FILE.safetensors or --random-inputs SEED");
}

#[test]
fn if_runs_the_branch_its_condition_picks() {
    // then: h * 2, else: h - 2 (tests/models/make_fixtures.py), so then = 2 * (else + 2).
    let path = fixture("control_flow");
    let mut g = mpc::load(&path).unwrap();
    mpc::compile(&mut g, &path, &mpc::Options::default(), &mut |_, _| {}).unwrap();
    let x = mpc_runtime::HostTensor::from_f32(
        mpc_ir::DType::F32,
        vec![2, 4],
        (0..8).map(|i| i as f32 * 0.25 - 1.0).collect(),
    );
    let run = |c: bool| {
        let cond = mpc_runtime::HostTensor::from_i64(mpc_ir::DType::Bool, vec![], vec![c as i64]);
        let feeds = [("x".to_string(), x.clone()), ("cond".to_string(), cond)].into_iter().collect();
        mpc::run::run_once(&g, &feeds, &path).unwrap()[0].1.f64s()
    };
    let (t, e) = (run(true), run(false));
    for (a, b) in t.iter().zip(&e) {
        assert!((a - 2.0 * (b + 2.0)).abs() < 1e-5, "then {a}, else {b}");
    }
}

/// `--device cuda` runs where `mpc devices` finds a GPU it can use, and is one line and exit 2
/// everywhere else (no driver, no GPU, no NVRTC, or a build without CUDA).
#[test]
fn device_cuda_runs_or_says_in_one_line_why_not() {
    let m = fixture("mlp");
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/digits.safetensors");
    let d = fixture("digits_mlp");
    let gpu = mpc(&["devices"]).status.success();
    let dir = scratch("device_cuda");
    let (ckpt, out) = (dir.join("ckpt"), dir.join("trained.onnx"));
    let (ckpt, out) = (ckpt.to_str().unwrap(), out.to_str().unwrap());
    let train = ["train", d.to_str().unwrap(), "--data", data, "--device", "cuda", "--checkpoint", ckpt];
    for cmd in [
        vec!["run", m.to_str().unwrap(), "--random-inputs", "1", "--dim", "batch=4", "--device", "cuda"],
        vec!["train", d.to_str().unwrap(), "--data", data, "--epochs", "1", "--device", "cuda"],
        vec!["bench", m.to_str().unwrap(), "--batch", "4", "--steps", "2", "--untimed", "1", "--device", "cuda"],
        // Checkpoints, a resumed run and the trained model written out, on the GPU.
        [&train[..], &["--epochs", "2", "--max-steps", "30"]].concat(),
        [&train[..], &["--epochs", "2", "--resume", "-o", out]].concat(),
    ] {
        let r = mpc(&cmd);
        let err = String::from_utf8_lossy(&r.stderr);
        if gpu {
            assert!(r.status.success(), "{cmd:?}: {err}");
        } else {
            assert_eq!(r.status.code(), Some(2), "{err}");
            assert_eq!(err.trim().lines().count(), 1, "{err}");
            assert!(err.contains("--device cuda"), "{err}");
        }
    }
    if gpu {
        let r = mpc(&["run", out, "--random-inputs", "1", "--dim", "batch=4", "--device", "cuda"]);
        assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    }
    let r = mpc(&["run", m.to_str().unwrap(), "--random-inputs", "1", "--device", "tpu"]);
    assert_eq!(r.status.code(), Some(2));
}

/// A static loss scale is a constant of the training graph, not a state: training with one runs
/// under every policy and reports the scale it used.
#[test]
fn train_with_a_static_loss_scale() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/digits.safetensors");
    let d = fixture("digits_mlp");
    for policy in ["mixed", "fp32"] {
        let r = mpc(&[
            "train",
            d.to_str().unwrap(),
            "--data",
            data,
            "--policy",
            policy,
            "--epochs",
            "2",
            "--loss-scale",
            "static:128",
        ]);
        let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
        assert!(r.status.success(), "{policy}: {err}");
        let epochs: Vec<&str> = out.lines().chain(err.lines()).filter(|l| l.starts_with("epoch ")).collect();
        assert_eq!(epochs.len(), 2, "{policy}: {out}{err}");
        assert!(epochs.iter().all(|l| l.contains("loss scale 128,")), "{policy}: {epochs:?}");
        let loss = |l: &str| l.split("loss ").nth(1).and_then(|v| v.split(',').next()).unwrap().parse::<f64>().unwrap();
        assert!(loss(epochs[1]) < loss(epochs[0]), "{policy}: the loss does not fall: {epochs:?}");
    }
}

#[test]
fn stats_say_what_a_step_costs() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/digits.safetensors");
    let d = fixture("digits_mlp");
    let r = mpc(&["train", d.to_str().unwrap(), "--data", data, "--epochs", "1", "--eval-split", "297", "--stats"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{err}");
    let line = err.lines().find(|l| l.contains("training step:")).unwrap_or_else(|| panic!("{err}"));
    for want in ["arena", "launches per step", "0 allocations inside steps after the first", "0 host reads per step"] {
        assert!(line.contains(want), "{line}");
    }
    let m = fixture("control_flow");
    let r = mpc(&["run", m.to_str().unwrap(), "--random-inputs", "1", "--stats"]);
    let err = String::from_utf8_lossy(&r.stderr);
    // Choosing the If's branch is the step's one host read.
    assert!(err.contains("1 host reads per step"), "{err}");
}

#[test]
fn devices_lists_the_cpu_and_each_gpu_or_says_why_none() {
    let r = mpc(&["devices"]);
    let (out, err) = (String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    assert!(out.starts_with("cpu: "), "{out}");
    assert!(out.contains("\ncuda: driver "), "{out}");
    // Whether data-parallel training can run, and what its CUDA collectives would load.
    let mpi = if cfg!(feature = "mpi") { "\nmpi: " } else { "\nmpi: not built in" };
    assert!(out.contains(mpi) && out.contains("\nnccl: "), "{out}");
    if err.contains("no GPU to use") {
        // A machine without a GPU (CI): one line naming what is missing, exit 2.
        assert_eq!(r.status.code(), Some(2));
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    } else {
        assert!(r.status.success(), "{err}");
        assert!(out.contains("\ngpu 0: ") && out.contains("compute capability"), "{out}");
    }
}

/// `mpc bench` measures each policy of the list: step times, the FLOPs of the step (the MLP's
/// three products, three times over when training), the program's bytes and launches.
/// A reader that closes the output early (`mpc inspect ... | head`) ends mpc quietly: no panic,
/// no error line, success.
#[test]
fn a_closed_output_ends_quietly() {
    use std::process::{Command, Stdio};
    let m = fixture("transformer");
    for args in [&["inspect", m.to_str().unwrap()][..], &["devices"][..]] {
        // The reading end is closed before mpc starts: its first write meets a closed pipe.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let child = Command::new(env!("CARGO_BIN_EXE_mpc"))
            .args(args)
            .stdout(Stdio::from(writer))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let r = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.success() && err.is_empty(), "{args:?}: {:?} {err}", r.status);
    }
}

#[test]
fn bench_reports_each_policy() {
    let m = fixture("mlp");
    let args = ["bench", m.to_str().unwrap(), "--batch", "8", "--steps", "3", "--untimed", "1", "--json"];
    let r = mpc(&args);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let policies: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(policies, ["fp32", "mixed", "mixed-bf16"]);
    // 2 · batch · (64·256 + 256·256 + 256·10) multiply-adds.
    let forward = 2 * 8 * (64 * 256 + 256 * 256 + 256 * 10);
    for row in rows {
        assert_eq!(row["flops_per_step"].as_u64(), Some(forward), "{row}");
        assert!(row["step_ms_median"].as_f64().unwrap() > 0.0 && row["peak_tflops"].as_f64().unwrap() > 0.0);
        assert!(row["launches_per_step"].as_u64().unwrap() >= 3, "{row}");
        // Every allocation of the run holds at least the program's regions.
        let regions: u64 =
            ["arena_bytes", "state_bytes", "constants_bytes"].iter().map(|k| row[k].as_u64().unwrap()).sum();
        assert!(row["allocated_bytes"].as_u64().unwrap() >= regions, "{row}");
    }
    // Mixed holds its weights in FP16: half the constants of FP32.
    let consts = |i: usize| rows[i]["constants_bytes"].as_u64().unwrap();
    assert!(consts(1) * 2 <= consts(0) + 64 * 6, "{} vs {}", consts(1), consts(0));

    let d = fixture("digits_mlp");
    let train = |policy: &str, more: &[&str]| {
        let base = ["bench", d.to_str().unwrap(), "--train", "--loss", "cross-entropy", "--policies", policy];
        mpc(&[&base[..], &["--batch", "16", "--steps", "2", "--untimed", "1"], more].concat())
    };
    let r = train("fp32", &[]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.contains("training step") && out.lines().any(|l| l.starts_with("fp32 ")), "{out}");
    // `--profile` times each launch of one more step: by op and dtype, every launch of the step
    // counted once, the shares summing to the whole.
    let r = train("mixed", &["--profile", "--json"]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let report: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap();
    let row = &report["rows"][0];
    let profile = row["profile"].as_array().unwrap();
    let counted = |p: &serde_json::Value| p["launches"].as_u64().unwrap();
    let launches: u64 = profile.iter().filter(|p| p["op"] != "(state copies)").map(counted).sum();
    assert_eq!(launches, row["launches_per_step"].as_u64().unwrap(), "{row}");
    // The updates are one multi-tensor launch.
    for op in ["Gemm", "Multi(AdamUpdate)", "SoftmaxCrossEntropyLossGrad", "Cast"] {
        assert!(profile.iter().any(|p| p["op"] == op), "no {op} in {row}");
    }
    let shares: f64 = profile.iter().map(|p| p["share"].as_f64().unwrap()).sum();
    assert!((shares - 1.0).abs() < 1e-6, "{shares}");
    assert!(profile.windows(2).all(|w| w[0]["ms"].as_f64() >= w[1]["ms"].as_f64()), "not the longest first");
    // Each op's bytes are its launches' traffic, as `inspect --memory` counts the step's.
    let bytes: u64 = profile.iter().filter(|p| p["op"] != "(state copies)").map(|p| p["bytes"].as_u64().unwrap()).sum();
    let args = ["inspect", d.to_str().unwrap(), "--memory", "--train", "--loss", "cross-entropy"];
    let r = mpc(&[&args[..], &["--policy", "mixed", "--batch", "16"]].concat());
    let out = String::from_utf8_lossy(&r.stdout);
    let traffic = out.split("in all (").nth(1).and_then(|t| t.split(' ').next()).unwrap();
    assert_eq!(bytes.to_string(), traffic, "{out}");
    // `--launches`: one row per launch, in order, numbered from 0.
    let r = mpc(&[&args[..], &["--policy", "mixed", "--batch", "16", "--launches"]].concat());
    let listed = String::from_utf8_lossy(&r.stdout);
    let launches = out.split(" launches; matrix products").next().and_then(|t| t.rsplit(' ').next()).unwrap();
    let list = listed.split("launches of a step, in order (").nth(1).unwrap();
    assert!(list.starts_with(&format!("{launches}):")), "{listed}");
    let rows: Vec<&str> = list.lines().skip(2).collect();
    assert_eq!(rows.len().to_string(), launches, "{listed}");
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row.split_whitespace().next(), Some(i.to_string().as_str()), "{row}");
    }
    assert!(rows.iter().any(|r| r.contains("Multi(AdamUpdate)")), "{listed}");
    assert!(profile.iter().all(|p| p["gb_per_s"].as_f64().is_some_and(|g| g >= 0.0)), "{row}");

    let r = mpc(&["bench", m.to_str().unwrap(), "--policies", "fp32,fast"]);
    assert_eq!(r.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&r.stderr).contains("unknown policy `fast`"));
}

/// `train --distributed` is one line and exit 2 where it cannot run: on the CUDA device (no
/// collectives there yet), and in a build without MPI (the default), which says how to build one.
#[test]
fn distributed_training_says_what_it_needs() {
    let base = ["train", "tests/models/digits_mlp.onnx", "--data", "tests/data/digits.safetensors", "--distributed"];
    let cuda = [&base[..], &["--device", "cuda"]].concat();
    fails_with(&cuda, "data-parallel training runs on the CPU device for now");
    if !cfg!(feature = "mpi") {
        fails_with(&base, "this mpc was built without MPI; build it with `cargo build --release --features mpi`");
    }
    let shard =
        ["train", "tests/models/digits_mlp.onnx", "--data", "tests/data/digits.safetensors", "--shard-optimizer"];
    fails_with(
        &[&shard[..], &["--device", "cuda"]].concat(),
        "the sharded optimizer state runs on the CPU device for now",
    );
    // One process alone: the sharded step is the plain one, and so is the trained model.
    let dir = scratch("shard_alone");
    let out = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (plain, sharded) = (out("plain.onnx"), out("sharded.onnx"));
    let run = [&shard[..4], &["--epochs", "1", "--optimizer", "adamw", "-o"]].concat();
    let a = mpc(&[&run[..], &[plain.as_str()]].concat());
    let b = mpc(&[&run[..], &[sharded.as_str(), "--shard-optimizer"]].concat());
    assert!(a.status.success() && b.status.success(), "{}", String::from_utf8_lossy(&b.stderr));
    assert_eq!(
        std::fs::read(&plain).unwrap(),
        std::fs::read(&sharded).unwrap(),
        "one rank sharded trains another model"
    );
}

/// `mpc inspect` of an export whose constants hold the length it was traced at (a legacy
/// nn.MultiheadAttention encoder, traced at seq 8) prints the graph and says the FLOPs were not
/// estimated at seq=1, naming the node and the sizes to give; with `--dim seq=8` it counts them.
#[test]
fn inspect_says_where_the_default_sizes_do_not_hold() {
    let m = "tests/models/zoo/encoder.legacy.onnx";
    let r = mpc(&["inspect", m]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let line = out.lines().find(|l| l.starts_with("# FLOPs")).expect("a FLOPs line");
    assert!(
        line.starts_with("# FLOPs: not estimated at batch=1, seq=1: node `/enc/layers.0/self_attn/Reshape_4`"),
        "{line}"
    );
    assert!(line.ends_with("give the model's sizes with --dim NAME=N"), "{line}");
    let r = mpc(&["inspect", m, "--dim", "seq=8", "--explain"]);
    let out = String::from_utf8_lossy(&r.stdout);
    assert!(out.contains("# FLOPs at batch=1, seq=8: 278,720"), "{out}");
}
