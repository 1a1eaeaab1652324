//! Calibration: measured ranges keep in FP32 the nodes whose values FP16 would break, and
//! `--explain` names the measurement. Two models of the kinds that fail under plain `mixed`:
//! activations above 65504 (Inf, then NaN), and activations below FP16's smallest subnormal (all
//! zeros, as in a freshly initialised MobileNetV3).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{mpc, scratch};
use mpc_ir::DType;
use mpc_runtime::HostTensor;

/// A two-layer model: `x @ w1`, then `op` applied to it, then `@ w2`; the weights scaled by
/// `scale1` and `scale2`. All nodes named, so that `--explain` names them.
fn model(dir: &Path, name: &str, scale1: f32, op: &str, scale2: f32) -> PathBuf {
    let w = |n: usize, scale: f32, seed: usize| -> String {
        let v: Vec<String> =
            (0..n).map(|i| format!("{:e}", scale * (((i * 7 + seed) % 11) as f32 - 4.5) / 4.5)).collect();
        v.join(", ")
    };
    let text = format!(
        "mpcir 1\nmodel ir_version=8\nopset \"\" 18\ngraph \"{name}\"
  input %0 \"x\": f32[batch,16]
  init %1 \"w1\" = f32[16,16]{{{}}}
  init %2 \"w2\" = f32[16,4]{{{}}}
  %3 \"h\": ? = MatMul(%0, %1) @\"/fc1/MatMul\"
  %4 \"g\": ? = {op} @\"/act\"
  %5 \"y\": ? = MatMul(%4, %2) @\"/fc2/MatMul\"
  output %5
end
",
        w(256, scale1, 1),
        w(64, scale2, 3)
    );
    let path = dir.join(format!("{name}.mpcir"));
    std::fs::write(&path, text).unwrap();
    path
}

fn data(dir: &Path, name: &str, n: usize, seed: usize) -> PathBuf {
    let x: Vec<f32> = (0..n * 16).map(|i| (((i * 31 + seed * 17) % 23) as f32 - 11.0) / 7.0).collect();
    let path = dir.join(format!("{name}.safetensors"));
    mpc::run::write_safetensors(&path, &[("x".into(), HostTensor::from_f32(DType::F32, vec![n, 16], x))]).unwrap();
    path
}

fn run(model: &Path, inputs: &Path, out: &Path, extra: &[&str]) -> Vec<f64> {
    let args =
        [&["run", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "-o", out.to_str().unwrap()], extra]
            .concat();
    let o = mpc(&args);
    assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    let outs: HashMap<String, HostTensor> = mpc::run::read_safetensors(out).unwrap();
    outs["y"].f64s()
}

fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt();
    d / b.iter().map(|y| y * y).sum::<f64>().sqrt()
}

/// Runs `model` in FP32, under `mixed`, and under `mixed` calibrated on other samples than the
/// inputs: (error of mixed, error of calibrated mixed), relative L2 against FP32.
fn errors(dir: &Path, model: &Path) -> (f64, f64, Vec<f64>) {
    let (calib, inputs) = (data(dir, "calib", 64, 1), data(dir, "inputs", 8, 2));
    let out = dir.join("out.safetensors");
    let fp32 = run(model, &inputs, &out, &["--policy", "fp32"]);
    let mixed = run(model, &inputs, &out, &["--policy", "mixed"]);
    let ranges = dir.join("ranges.json");
    let calibrated = run(
        model,
        &inputs,
        &out,
        &["--policy", "mixed", "--calibrate", calib.to_str().unwrap(), "--ranges-out", ranges.to_str().unwrap()],
    );
    assert!(calibrated.iter().all(|x| x.is_finite()), "calibrated mixed is not finite: {calibrated:?}");
    // Saved ranges calibrate the same way without measuring again.
    let reused = run(model, &inputs, &out, &["--policy", "mixed", "--ranges-in", ranges.to_str().unwrap()]);
    assert_eq!(reused, calibrated);
    let err = |v: &[f64]| if v.iter().all(|x| x.is_finite()) { rel_l2(v, &fp32) } else { f64::INFINITY };
    (err(&mixed), err(&calibrated), fp32)
}

fn explain(model: &Path, dir: &Path) -> String {
    let ranges = dir.join("ranges.json");
    let o = mpc(&[
        "inspect",
        model.to_str().unwrap(),
        "--policy",
        "mixed",
        "--ranges-in",
        ranges.to_str().unwrap(),
        "--explain",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // The explanation's rows only (`# NODE OP RUNS WHY`), not the graph above them.
    String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("# /")).collect::<Vec<_>>().join("\n")
}

#[test]
fn activations_beyond_fp16_stay_fp32_and_explain_says_why() {
    let dir = scratch("calibrate_overflow");
    // h ~ 1e3, h·h ~ 1e6 > 65504: the square overflows FP16.
    let m = model(&dir, "overflow", 300.0, "Mul(%3, %3)", 1e-4);
    let (mixed, calibrated, _) = errors(&dir, &m);
    println!("overflowing model: mixed relative L2 error {mixed:.2e}, calibrated {calibrated:.2e}");
    assert!(mixed.is_infinite(), "plain mixed should overflow, error {mixed}");
    assert!(calibrated <= 1e-2, "calibrated mixed: relative L2 error {calibrated:.2e}");
    let text = explain(&m, &dir);
    let line = text.lines().find(|l| l.contains("/act ")).expect("the square's line");
    assert!(line.contains("f32") && line.contains("calibration: max |x|") && line.contains("> 65504"), "{line}");
    // What reads the square cannot read it in FP16 either; the first product stays low.
    let line = text.lines().find(|l| l.contains("/fc2/MatMul")).expect("the second product's line");
    assert!(line.contains("f32") && line.contains("calibration: reads `g`: max |x|"), "{line}");
    let line = text.lines().find(|l| l.contains("/fc1/MatMul")).expect("the first product's line");
    assert!(line.contains("f16"), "{line}");
}

#[test]
fn activations_below_fp16_stay_fp32() {
    let dir = scratch("calibrate_flush");
    // Weights of 1e-9: every activation is far below 2^-24, and plain mixed returns zeros.
    let m = model(&dir, "tiny", 1e-9, "Relu(%3)", 1.0);
    let (mixed, calibrated, fp32) = errors(&dir, &m);
    println!("tiny-activation model: mixed relative L2 error {mixed:.2e}, calibrated {calibrated:.2e}");
    assert!(fp32.iter().any(|&x| x != 0.0));
    assert!(mixed > 0.5, "plain mixed should lose the values, error {mixed}");
    assert!(calibrated <= 1e-2, "calibrated mixed: relative L2 error {calibrated:.2e}");
    let text = explain(&m, &dir);
    let line = text.lines().find(|l| l.contains("/fc1/MatMul")).expect("the first product's line");
    assert!(line.contains("f32") && line.contains("below FP16's smallest subnormal"), "{line}");
}

#[test]
fn inspect_reports_the_values_at_risk() {
    let dir = scratch("calibrate_inspect");
    let m = model(&dir, "overflow", 300.0, "Mul(%3, %3)", 1e-4);
    let calib = data(&dir, "calib", 64, 1);
    let o = mpc(&["inspect", m.to_str().unwrap(), "--policy", "mixed", "--ranges", calib.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("over 64 samples") && text.contains("1 at risk in f16"), "{text}");
    assert!(text.contains("`g` (computed low by the policy): max |x|"), "{text}");
    // The DOT picture marks the square: at risk under plain mixed, pinned once calibrated.
    let o = mpc(&["inspect", m.to_str().unwrap(), "--policy", "mixed", "--ranges", calib.to_str().unwrap(), "--dot"]);
    let dot = String::from_utf8_lossy(&o.stdout);
    let line = dot.lines().find(|l| l.contains("\\n/act")).unwrap_or_else(|| panic!("{dot}"));
    assert!(line.contains("at risk: max |x|") && line.contains("penwidth=3"), "{line}");
    let args = ["inspect", m.to_str().unwrap(), "--policy", "mixed", "--calibrate", calib.to_str().unwrap(), "--dot"];
    let dot = String::from_utf8_lossy(&mpc(&args).stdout).into_owned();
    let line = dot.lines().find(|l| l.contains("\\n/act")).unwrap_or_else(|| panic!("{dot}"));
    assert!(line.contains("calibration: max |x|") && line.contains("penwidth=3"), "{line}");
    // BF16 holds the same range.
    let o = mpc(&["inspect", m.to_str().unwrap(), "--policy", "mixed-bf16", "--ranges", calib.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("0 at risk in bf16"));
    let o = mpc(&["inspect", m.to_str().unwrap(), "--ranges", calib.to_str().unwrap(), "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(json["values"]["g"]["f16_overflow"].as_u64().unwrap() > 0, "{json}");
    // A data file without the model's input is one line.
    let bad = dir.join("bad.safetensors");
    mpc::run::write_safetensors(&bad, &[("z".into(), HostTensor::from_f32(DType::F32, vec![1], vec![0.0]))]).unwrap();
    let o = mpc(&[
        "run",
        m.to_str().unwrap(),
        "--policy",
        "mixed",
        "--calibrate",
        bad.to_str().unwrap(),
        "--random-inputs",
        "1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no tensor `x`") && err.trim().lines().count() == 1, "{err}");
}

/// The paper's failure mode (b), the model of `tests/train.rs`'s test of it: a loss of 1e-6 · MSE,
/// whose activation gradients (~2e-9) lie below FP16's smallest subnormal. The histogram says so; `--loss-scale auto` picks a scale that
/// loses none of them, and training at it skips no step after the first.
#[test]
fn the_gradient_histogram_finds_the_scale_that_loses_nothing() {
    let dir = scratch("calibrate_gradients");
    let (model, data) = common::regression(&dir, 0.0, 0.5, 256, Some(1e-6));
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let svg = dir.join("gradients.svg");
    let o = mpc(&[
        "inspect",
        m,
        "--policy",
        "mixed",
        "--ranges",
        d,
        "--train",
        "--loss",
        "output:loss",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.starts_with("<svg") && picture.contains("lost in FP16 (below 2^-24)"), "{picture}");
    println!("{text}");
    let share = |key: &str| -> f64 {
        let at = text.find(key).unwrap_or_else(|| panic!("no `{key}` in\n{text}"));
        let before = text[..at].trim_end();
        let num = before.rsplit(' ').next().unwrap().trim_end_matches('%');
        num.parse().unwrap()
    };
    // All but the loss's own gradient (1e-6) are lost in FP16 unscaled.
    assert!(share("are below 2^-24") > 99.0, "{text}");
    assert!(text.contains("losing 0.00%"), "{text}");

    // Training at the scale auto picks: no step skipped after the first, and the loss falls.
    let t = mpc_passes::train::TrainOptions {
        loss: mpc_passes::train::Loss::Output("loss".into()),
        optimizer: mpc_passes::train::Optimizer::Sgd,
        lr: 5e6,
        ..Default::default()
    };
    let calibrate = mpc::ranges::Calibration { data: Some(data.clone()), batch: 64, batches: 2, ..Default::default() };
    let opts = mpc::Options {
        policy: Some("mixed".into()),
        train: Some(t),
        loss_scale: Some(mpc_passes::train::LossScale::Auto { attrs: Default::default() }),
        calibrate: Some(calibrate),
        ..Default::default()
    };
    let cfg = mpc::train::TrainConfig { data: vec![data], epochs: 3, batch: 64, ..Default::default() };
    let run = mpc::train::train(&mpc::load(&model).unwrap(), &model, &opts, &cfg, &mut |_| {}).unwrap();
    let a = run.auto_scale.expect("auto measured the gradients");
    println!(
        "--loss-scale auto: 2^{}, starting at {}, {} lost; steps skipped: {:?}",
        a.exp, a.init, a.lost, run.skipped
    );
    assert_eq!(a.lost, 0.0);
    assert!(run.skipped[1..].iter().all(|&s| !s), "skipped after the first: {:?}", run.skipped);
    assert!(run.losses.last().unwrap() < run.losses.first().unwrap(), "{:?}", run.losses);
}
