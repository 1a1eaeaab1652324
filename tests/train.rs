//! The training compiler end to end: digits accuracy per policy, skipped steps, bit-exact resume,
//! seeded dropout, and the paper's three failure modes (the graph it writes: train_graph.rs).

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::training::*;
use common::{fixture, scratch};
use half::f16;
use mpc::train::{train, TrainConfig};
use mpc::Options;
use mpc_ir::{DType, Graph, Op, Shape, Tensor, TypeInfo};
use mpc_passes::train::{Optimizer, TrainOptions};
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

// The training tests every device must pass (the CUDA device adds its line in `per_device!`).
common::per_device!(
    digits_mixed_accuracy_tracks_fp32 => digits_mixed_accuracy_tracks_fp32,
    resume_equals_a_straight_run_bit_for_bit => resume_equals_a_straight_run_bit_for_bit,
    a_non_finite_gradient_skips_the_step => a_non_finite_gradient_skips_the_step,
    weight_copies_written_by_the_update_give_the_same_bits => weight_copies_written_by_the_update_give_the_same_bits,
    accumulating_four_micro_batches_equals_one_batch_of_their_size => accumulating_four_micro_batches_equals_one_batch_of_their_size,
);

fn digits_mixed_accuracy_tracks_fp32<D: Device>(device: impl Fn() -> D) {
    let model = fixture("digits_mlp");
    let mut acc = HashMap::new();
    for policy in ["fp32", "mixed", "mixed-bf16"] {
        let t = run_on(device(), &model, policy, TrainOptions::default(), &digits_cfg(30));
        let (a, l) = t.epochs.last().unwrap().eval.unwrap();
        let skipped: usize = t.epochs.iter().map(|e| e.skipped).sum();
        println!("digits MLP, Adam lr 1e-3, batch 64, 30 epochs, {policy}: test accuracy {:.2}%, test loss {l:.4}, {skipped} steps skipped", a * 100.0);
        acc.insert(policy, a);
    }
    // PyTorch reaches 91-93% in FP32 (three seeds); mpc must be within a point of that range.
    for (p, a) in &acc {
        assert!((0.90..=0.94).contains(a), "{p}: accuracy {a}");
    }
    assert!((acc["mixed"] - acc["fp32"]).abs() <= 0.005, "mixed {} vs fp32 {}", acc["mixed"], acc["fp32"]);
}

fn a_non_finite_gradient_skips_the_step<D: Device>(device: impl Fn() -> D) {
    let g = training_graph(&fixture("digits_mlp"), "mixed", TrainOptions::default());
    let state = state_of(&g);
    let mut s = program_session(device(), &g, &digits_batch(0, 32));
    let step = |s: &mut Session<D>, feeds: &HashMap<String, HostTensor>| {
        s.feed(0, feeds).unwrap();
        s.step(0).unwrap();
        s.read(0, "mpc.step_skipped").unwrap().f64s()[0]
    };
    for k in 0..3 {
        assert_eq!(step(&mut s, &digits_batch(k * 32, 32)), 0.0, "step {k} skipped");
    }
    let before: Vec<HostTensor> = state.iter().map(|&(v, _)| s.read_state(g.name(v)).unwrap()).collect();
    assert_eq!(s.read_state("mpc.good_steps").unwrap().i64s().unwrap(), vec![3]);
    assert_eq!(s.read_state("mpc.step").unwrap().i64s().unwrap(), vec![3]);

    let mut bad = digits_batch(96, 32);
    let img = bad.get_mut("images").unwrap();
    let mut v = img.f64s();
    v[5] = f64::INFINITY;
    *img = HostTensor::from_f64(DType::F32, img.shape.clone(), v);
    assert_eq!(step(&mut s, &bad), 1.0, "the step was not skipped");
    let mut unchanged = 0;
    for (&(v, _), b) in state.iter().zip(&before) {
        let name = g.name(v);
        let now = s.read_state(name).unwrap();
        match name {
            "mpc.loss_scale" => assert_eq!(now.f64s()[0], b.f64s()[0] / 2.0, "scale not halved"),
            "mpc.good_steps" => assert_eq!(now.i64s().unwrap(), vec![0], "good-step counter not reset"),
            _ => {
                assert_eq!(&now, b, "`{name}` changed on a skipped step");
                unchanged += 1;
            }
        }
    }
    println!("injected Inf: step skipped, {unchanged} state tensors bit-for-bit unchanged, loss scale 65536 -> 32768");
    assert!(unchanged >= 19, "masters, moments and the step counter: {unchanged}");
}

/// `--accumulate 4 --batch 16` is `--batch 64`: under fp32 the same weights (within 1e-6,
/// relative L2) after 20 updates, on the same samples; under mixed, with an Inf injected into one
/// micro-batch, the same updates skipped (only the last micro-batch of a group can skip) and the
/// same loss scale and count of applied updates after them.
fn accumulating_four_micro_batches_equals_one_batch_of_their_size<D: Device>(device: impl Fn() -> D) {
    let model = fixture("digits_mlp");
    let large = TrainConfig { max_steps: Some(20), ..digits_cfg(1) };
    let micro = TrainConfig { batch: 16, max_steps: Some(80), ..digits_cfg(1) };
    let four = TrainOptions { accumulate: 4, ..Default::default() };
    let a = run_on(device(), &model, "fp32", TrainOptions::default(), &large);
    let b = run_on(device(), &model, "fp32", four.clone(), &micro);
    let state: HashMap<&str, &HostTensor> = b.state.iter().map(|(n, t)| (n.as_str(), t)).collect();
    assert_eq!(state["mpc.step"].i64s().unwrap(), vec![20], "updates applied");
    assert_eq!(state["mpc.micro"].i64s().unwrap(), vec![0], "micro-batches left over");
    let mut worst = 0f64;
    for (name, x) in a.state.iter().filter(|(n, _)| !n.starts_with("mpc.")) {
        let (x, y) = (x.f64s(), state[name.as_str()].f64s());
        let diff: f64 = x.iter().zip(&y).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
        let rel = diff / x.iter().map(|p| p * p).sum::<f64>().sqrt();
        assert!(rel <= 1e-6, "`{name}` differs by {rel:e} (relative L2)");
        worst = worst.max(rel);
    }
    println!("fp32: 20 updates of 4 × 16 == 20 of 64, weights within {worst:.1e} (relative L2)");

    // Mixed, by hand: 6 updates, an Inf in the second micro-batch of the third.
    let graph = |t: TrainOptions| training_graph(&model, "mixed", t);
    let (ga, gb) = (graph(TrainOptions::default()), graph(four));
    let mut sa = program_session(device(), &ga, &digits_batch(0, 64));
    let mut sb = program_session(device(), &gb, &digits_batch(0, 16));
    let step = |s: &mut Session<D>, feeds: &HashMap<String, HostTensor>| {
        s.feed(0, feeds).unwrap();
        s.step(0).unwrap();
        s.read(0, "mpc.step_skipped").unwrap().f64s()[0] != 0.0
    };
    let with_inf = |mut batch: HashMap<String, HostTensor>, at: usize| {
        let img = batch.get_mut("images").unwrap();
        let mut v = img.f64s();
        v[at] = f64::INFINITY;
        *img = HostTensor::from_f64(DType::F32, img.shape.clone(), v);
        batch
    };
    let (mut skipped_a, mut skipped_b) = (Vec::new(), Vec::new());
    for k in 0..6 {
        // Sample 19 of the batch of 64 is sample 3 of its second micro-batch.
        let bad = |b, at: Option<usize>| match at {
            Some(at) if k == 2 => with_inf(b, at),
            _ => b,
        };
        skipped_a.push(step(&mut sa, &bad(digits_batch(k * 64, 64), Some(19 * 64 + 5))));
        for m in 0..4 {
            let feed = bad(digits_batch(k * 64 + m * 16, 16), (m == 1).then_some(3 * 64 + 5));
            let flag = step(&mut sb, &feed);
            assert!(!flag || m == 3, "update {k}: micro-batch {m} skipped");
            if m == 3 {
                skipped_b.push(flag);
            }
        }
    }
    assert_eq!(skipped_a, [false, false, true, false, false, false]);
    assert_eq!(skipped_a, skipped_b, "skipped updates");
    for name in ["mpc.loss_scale", "mpc.step", "mpc.good_steps"] {
        assert_eq!(sa.read_state(name).unwrap(), sb.read_state(name).unwrap(), "`{name}`");
    }
    println!("mixed: an Inf in one micro-batch skips its group's update, as it skips the batch of 64");
}

/// The update writes each master's f16 (bf16) copy as state, and the forward pass reads it instead
/// of casting the master: the same losses and the same state, bit for bit, as casting each step,
/// and each copy is its master rounded. Adam and SGD with momentum, f16 and bf16, over steps
/// that include a skipped one (an Inf in the images).
fn weight_copies_written_by_the_update_give_the_same_bits<D: Device>(device: impl Fn() -> D) {
    let model = fixture("digits_mlp");
    let sgd = TrainOptions { optimizer: Optimizer::Momentum, lr: 0.05, ..Default::default() };
    for (policy, t, low) in [
        ("mixed", TrainOptions::default(), DType::F16),
        ("mixed-bf16", sgd.clone(), DType::BF16),
        ("mixed", sgd, DType::F16),
    ] {
        let what = format!("{policy}, {:?}", t.optimizer);
        let mut runs = Vec::new();
        for weight_copies in [true, false] {
            let g = training_graph(&model, policy, TrainOptions { weight_copies, ..t.clone() });
            let copies: Vec<String> = state_of(&g)
                .iter()
                .map(|&(v, _)| g.name(v).to_string())
                .filter(|n| n.starts_with("mpc.f16.") || n.starts_with("mpc.bf16."))
                .collect();
            assert_eq!(copies.is_empty(), !weight_copies, "{what}: {copies:?}");
            let mut s = program_session(device(), &g, &digits_batch(0, 32));
            let mut losses = Vec::new();
            for k in 0..4 {
                let mut feeds = digits_batch(k * 32, 32);
                if k == 2 {
                    let img = feeds.get_mut("images").unwrap();
                    let mut v = img.f64s();
                    v[3] = f64::INFINITY;
                    *img = HostTensor::from_f64(DType::F32, img.shape.clone(), v);
                }
                s.feed(0, &feeds).unwrap();
                s.step(0).unwrap();
                let skipped = s.read(0, "mpc.step_skipped").unwrap().f64s()[0];
                assert_eq!(skipped, (k == 2) as u8 as f64, "{what}: step {k}");
                losses.push(s.read(0, g.name(g.train.as_ref().unwrap().loss.unwrap())).unwrap().f64s()[0].to_bits());
            }
            for name in &copies {
                let master = name.strip_prefix(&format!("mpc.{low}.")).unwrap_or_else(|| panic!("{what}: {name}"));
                let master = s.read_state(master).unwrap();
                let copy = s.read_state(name).unwrap();
                assert_eq!(copy.dtype(), low, "{what}: {name}");
                assert!(copy == master.cast(low), "{what}: {name} is not its master rounded");
            }
            let state: HashMap<String, HostTensor> = state_of(&g)
                .iter()
                .map(|&(v, _)| (g.name(v).to_string(), s.read_state(g.name(v)).unwrap()))
                .filter(|(n, _)| !copies.contains(n))
                .collect();
            runs.push((losses, state, copies.len()));
        }
        assert!(runs[0].2 >= 3, "{what}: {} copies", runs[0].2);
        assert_eq!(runs[0].0, runs[1].0, "{what}: the losses differ");
        assert_eq!(runs[0].1.len(), runs[1].1.len(), "{what}");
        for (name, t) in &runs[1].1 {
            assert!(Some(t) == runs[0].1.get(name), "{what}: `{name}` differs");
        }
    }
}

fn resume_equals_a_straight_run_bit_for_bit<D: Device>(device: impl Fn() -> D) {
    // Mid-schedule: a cosine decay after a warmup, both spanning the three epochs.
    fn scheduled() -> TrainOptions {
        let file = mpc::config::TrainFile {
            schedule: Some("cosine".into()),
            warmup: Some(0.1),
            lr: Some(3e-3),
            ..Default::default()
        };
        file.resolve().unwrap().0
    }
    let model = fixture("digits_mlp");
    let dir = scratch(&format!("resume_{}", device().caps().name));
    let (n, m) = (30, 25);
    let base = TrainConfig { epochs: 3, eval_split: 297.0, seed: 3, ..digits_cfg(3) };
    let (straight_log, resumed_log) = (dir.join("straight.jsonl"), dir.join("resumed.jsonl"));
    let logged = TrainConfig { max_steps: Some(n + m), log: Some(straight_log.clone()), ..base.clone() };
    let straight = run_on(device(), &model, "mixed", scheduled(), &logged);
    let ck = TrainConfig { checkpoint: Some(dir.clone()), log: Some(resumed_log.clone()), ..base.clone() };
    run_on(device(), &model, "mixed", scheduled(), &TrainConfig { max_steps: Some(n), ..ck.clone() });
    assert!(dir.join("checkpoint.safetensors").is_file());
    let saved = mpc::run::read_safetensors(&dir.join("checkpoint.safetensors")).unwrap();
    assert!(saved.contains_key("fc1.weight") && saved.contains_key("mpc.adam_m.fc1.weight"), "{:?}", saved.keys());
    // A run killed after it logged steps its checkpoint does not hold: resuming drops them.
    let mut text = std::fs::read_to_string(&resumed_log).unwrap();
    text.push_str(&format!("{{\"step\":{},\"epoch\":2,\"loss\":9.0}}\n", n + 1));
    std::fs::write(&resumed_log, text).unwrap();
    let resumed = run_on(
        device(),
        &model,
        "mixed",
        scheduled(),
        &TrainConfig { max_steps: Some(n + m), resume: true, ..ck.clone() },
    );
    // Two runs give the same bits.
    let again = run_on(device(), &model, "mixed", scheduled(), &TrainConfig { max_steps: Some(n + m), ..base.clone() });
    assert_eq!(straight.losses, again.losses, "two runs differ");
    assert_eq!(straight.losses[n..], resumed.losses[..], "losses after resuming differ");
    check_logs(&straight_log, &resumed_log, &straight.losses, n + m);
    assert_eq!(straight.state.len(), resumed.state.len());
    for ((a, x), (b, y)) in straight.state.iter().zip(&resumed.state) {
        assert_eq!(a, b);
        assert_eq!(x, y, "`{a}` differs after resuming");
    }
    println!(
        "{n} steps + checkpoint + {m} resumed steps == {} straight steps, {} state tensors bit for bit",
        n + m,
        straight.state.len()
    );
    // A checkpoint without the weights' f16 copies (written with --no-weight-copies) resumes a run
    // that keeps them: each copy is its master rounded, and the run goes on as the straight one.
    let uncopied = TrainOptions { weight_copies: false, ..scheduled() };
    run_on(device(), &model, "mixed", uncopied, &TrainConfig { max_steps: Some(n), ..ck.clone() });
    let saved = mpc::run::read_safetensors(&dir.join("checkpoint.safetensors")).unwrap();
    assert!(!saved.keys().any(|k| k.starts_with("mpc.f16.")), "{:?}", saved.keys());
    let resumed =
        run_on(device(), &model, "mixed", scheduled(), &TrainConfig { max_steps: Some(n + m), resume: true, ..ck });
    assert_eq!(straight.losses[n..], resumed.losses[..], "losses after resuming without copies differ");
    assert!(straight.state == resumed.state, "the state after resuming without copies differs");
}

/// The step lines of `--log` (without the timing): the straight run's are the stopped run's and
/// then the resumed run's (appended), with its losses, the warmup-cosine rate and the loss scale.
fn check_logs(straight: &Path, resumed: &Path, losses: &[f32], steps: usize) {
    let lines = |p: &Path| -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(p).unwrap();
        text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    };
    let step_lines = |p: &Path| -> Vec<serde_json::Value> {
        let mut v: Vec<_> = lines(p).into_iter().filter(|l| l.get("loss").is_some()).collect();
        v.iter_mut()
            .for_each(|l| assert!(l.as_object_mut().unwrap().remove("samples_per_s").unwrap().as_f64().unwrap() > 0.0));
        v
    };
    let (a, b) = (step_lines(straight), step_lines(resumed));
    assert_eq!(a.len(), steps);
    assert_eq!(a, b, "the resumed run's log differs from the straight run's");
    let evals: Vec<u64> = lines(straight).iter().filter_map(|l| l.get("eval_loss").and(l["step"].as_u64())).collect();
    assert_eq!(evals, [24, 48, steps as u64], "an evaluation line after each epoch and at the end");
    for (i, l) in a.iter().enumerate() {
        assert_eq!(l["step"], i + 1);
        assert_eq!(l["loss"].as_f64().unwrap() as f32, losses[i]);
        assert_eq!(l["skipped"], false);
        assert_eq!(l["loss_scale"], 65536.0);
        // The schedule: a warmup of 10% of 3 epochs of 24 batches to 3e-3, then a cosine to 0.
        let (w, total) = (8.0, 72.0);
        let t = i as f64;
        let want = if t < w {
            3e-3 * t / w
        } else {
            3e-3 * 0.5 * (1.0 + (std::f64::consts::PI * (t - w) / (total - w)).cos())
        };
        let got = l["lr"].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-6 * want.max(1e-9) + 1e-12, "step {}: lr {got}, expected {want}", i + 1);
    }
}

/// The digits MLP with training-mode Dropout (ratio 0.2) after each Relu, written to `dir`.
fn digits_with_dropout(dir: &Path) -> PathBuf {
    let mut g = mpc::load(&fixture("digits_mlp")).unwrap();
    let ratio = g.add_initializer("dropout.ratio", Tensor::from_f32(vec![], &[0.2]));
    let on = g.add_initializer("dropout.training", Tensor::from_i64(vec![], &[1]).to_dtype(DType::Bool));
    let relus: Vec<_> = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::Relu)).collect();
    for (i, n) in relus.into_iter().enumerate() {
        let r = g.node(n).outputs()[0];
        let readers = g.value(r).uses().to_vec();
        let op = Op::Dropout(Default::default());
        let (_, d) = g.add_op(&format!("dropout{i}"), op, &[Some(r), Some(ratio), Some(on)], 1);
        g.move_uses(r, d[0], &readers);
    }
    let path = dir.join("digits_dropout.onnx");
    mpc::save(&g, &path, mpc::Format::Onnx).unwrap();
    path
}

#[test]
fn seeded_dropout_keeps_one_minus_ratio_and_draws_per_key() {
    let mut g = Graph::new("dropout");
    let x = g.add_initializer("x", Tensor::from_f32(vec![1000, 100], &vec![1.0; 100_000]));
    let ratio = g.add_initializer("ratio", Tensor::from_f32(vec![], &[0.25]));
    let key = g.add_initializer("key", Tensor::from_i64(vec![], &[7]));
    let mut masks = Vec::new();
    for seed in [1, 2] {
        let op = Op::SeededDropout(Box::new(mpc_ir::ops::SeedAttrs { seed }));
        let (_, o) = g.add_op(&format!("drop{seed}"), op, &[Some(x), Some(ratio), Some(key)], 2);
        g.add_output(o[0]);
        g.add_output(o[1]);
    }
    mpc_passes::infer_types(&mut g).unwrap();
    // The key is a variable of the program, as the training step's `mpc.rng` state is.
    let cpu = CpuDevice::default();
    let program = mpc::run::lower_bound(&g, cpu.caps(), None, Some(&[key].into()), Path::new("dropout")).unwrap();
    let mut s = Session::new(cpu, program).unwrap();
    let none = HashMap::new();
    for k in [7i64, 8] {
        s.write_state(g.name(key), &HostTensor::from_i64(DType::I64, vec![], vec![k])).unwrap();
        let out = s.run(&none).unwrap();
        let again = s.run(&none).unwrap();
        assert!(out.iter().zip(&again).all(|(a, b)| a.1 == b.1), "one key, one draw");
        for pair in out.chunks(2) {
            let (y, mask) = (pair[0].1.f32s().unwrap(), pair[1].1.i64s().unwrap());
            let mask: Vec<bool> = mask.iter().map(|&m| m != 0).collect();
            let kept = mask.iter().filter(|&&m| m).count() as f64 / mask.len() as f64;
            // 100,000 draws: the standard deviation of the kept share is 0.0014.
            assert!((kept - 0.75).abs() < 0.01, "kept {kept}");
            assert!(y.iter().zip(&mask).all(|(&v, &m)| v == if m { 1.0 / 0.75 } else { 0.0 }));
            masks.push(mask);
        }
    }
    // Two seeds under one key, and one seed under two keys, draw independent masks (agreeing
    // where both keep or both drop: 0.75² + 0.25² = 62.5% of the time).
    for (a, b) in [(0, 1), (0, 2)] {
        let agree = masks[a].iter().zip(&masks[b]).filter(|(x, y)| x == y).count() as f64 / 100_000.0;
        assert!((agree - 0.625).abs() < 0.01, "masks {a} and {b} agree on {agree}");
    }
}

#[test]
fn dropout_trains_from_the_rng_state_and_resumes_bit_for_bit() {
    let dir = scratch("dropout");
    let model = digits_with_dropout(&dir);
    let g = training_graph(&model, "mixed", TrainOptions { seed: 11, ..Default::default() });
    let seeded = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::SeededDropout(_))).count();
    assert_eq!(seeded, 2);
    let rng = g.find("mpc.rng").expect("the rng state");
    assert_eq!(g.value(rng).initializer().and_then(|t| t.to_i64_vec()), Some(vec![11]));
    assert!(state_of(&g).iter().any(|&(s, _)| s == rng), "mpc.rng is state");

    // Resume: the checkpoint carries the rng, so the resumed steps draw the straight run's masks.
    let ck = dir.join("ck");
    let (n, m) = (20, 15);
    let base = TrainConfig { epochs: 2, eval_split: 297.0, seed: 5, ..digits_cfg(2) };
    let t = TrainOptions { seed: 5, ..Default::default() };
    let straight = run(&model, "mixed", t.clone(), &TrainConfig { max_steps: Some(n + m), ..base.clone() });
    let cfg = TrainConfig { checkpoint: Some(ck.clone()), ..base.clone() };
    run(&model, "mixed", t.clone(), &TrainConfig { max_steps: Some(n), ..cfg.clone() });
    let saved = mpc::run::read_safetensors(&ck.join("checkpoint.safetensors")).unwrap();
    assert_eq!(saved["mpc.rng"].i64s(), Some(vec![5 + n as i64]), "one key per step");
    let resumed = run(&model, "mixed", t.clone(), &TrainConfig { max_steps: Some(n + m), resume: true, ..cfg });
    assert_eq!(straight.losses[n..], resumed.losses[..], "losses after resuming differ");
    assert!(straight.state.iter().zip(&resumed.state).all(|(a, b)| a == b), "state differs after resuming");

    // Another stream draws other masks: the same data and weights give other losses.
    let other = run(&model, "mixed", TrainOptions { seed: 6, ..t }, &TrainConfig { max_steps: Some(n), ..base });
    assert!(other.losses[..n] != straight.losses[..n], "the masks do not depend on the rng state");

    // Dropout is a regulariser, not noise that stops learning; evaluation runs without it.
    let trained = run(&model, "mixed", TrainOptions { seed: 5, ..Default::default() }, &digits_cfg(30));
    let (acc, loss) = trained.epochs.last().unwrap().eval.unwrap();
    println!("digits MLP + dropout 0.2, mixed, 30 epochs: test accuracy {:.2}%, test loss {loss:.4}", acc * 100.0);
    assert!(acc >= 0.90, "accuracy {acc}");
}

#[test]
fn failure_mode_a_fp16_weights_stall_while_masters_track_fp32() {
    // Weights at 1.0 (FP16 spacing 2^-10) with updates of about 1e-4 · w, below 2^-11 of the
    // weight: an FP16 weight rounds every update away; an FP32 master accumulates them.
    let dir = scratch("mode_a");
    let (model, data) = common::regression(&dir, 1.0, 1.01, 512, None);
    let cfg = TrainConfig { data: vec![data], epochs: 20, batch: 64, ..Default::default() };
    let mut last = HashMap::new();
    for policy in ["fp32", "mixed", "fp16"] {
        let t = run(&model, policy, sgd(0.25), &cfg);
        let (first, end) = (t.losses[0] as f64, *t.losses.last().unwrap() as f64);
        let w = &t.state.iter().find(|(n, _)| n == "w").unwrap().1;
        println!(
            "mode (a) {policy:>5}: loss {first:.3e} -> {end:.3e} over {} steps, w[0] = {:.6}",
            t.losses.len(),
            w.f64s()[0]
        );
        last.insert(policy, (first, end, w.f64s()[0]));
    }
    let (f32_first, f32_end, _) = last["fp32"];
    assert!(f32_end < 0.5 * f32_first, "fp32 did not learn");
    // Mixed moves the weights as fp32 does (its losses differ by FP16 forward rounding only).
    let (moved, gap) = (last["fp32"].2 - 1.0, (last["mixed"].2 - last["fp32"].2).abs());
    assert!(gap < 0.01 * moved, "mixed w {} vs fp32 w {}", last["mixed"].2, last["fp32"].2);
    assert_eq!(last["fp16"].2, 1.0, "an fp16 weight moved");
    assert!(last["fp16"].1 > 0.95 * last["fp16"].0, "fp16 kept learning: {:?}", last["fp16"]);
}

#[test]
fn failure_mode_b_underflow_without_loss_scaling() {
    // A model whose loss is 1e-6 · MSE: dL/dy is about 2e-9, far below FP16's smallest
    // subnormal (2^-24 ≈ 6e-8), so without scaling every weight gradient is lost; scaled by
    // 2^16 it is about 1e-4, a normal FP16 number.
    let dir = scratch("mode_b");
    let (model, data) = common::regression(&dir, 0.0, 0.5, 512, Some(1e-6));
    let own_loss = || TrainOptions { loss: mpc_passes::train::Loss::Output("loss".into()), ..sgd(5e6) };
    let grads = |policy: &str, scale: Option<mpc_passes::train::LossScale>| {
        let mut g = mpc::load(&model).unwrap();
        mpc::train::free_batch(&mut g);
        let opts = Options { loss_scale: scale, ..options(policy, own_loss()) };
        mpc::compile(&mut g, &model, &opts, &mut |_, _| {}).unwrap();
        let gv = update_of(&g, "w").input(1).unwrap();
        let scale = g.find("mpc.loss_scale");
        g.add_output(gv);
        let feeds = mpc::run::read_safetensors(&data).unwrap();
        let feeds: HashMap<String, HostTensor> =
            feeds.into_iter().map(|(k, t)| (k, t.pick(vec![64, 16], &(0..64 * 16).collect::<Vec<_>>()))).collect();
        let out = mpc::run::run_once(&g, &feeds, &model).unwrap();
        let v = out.iter().find(|(n, _)| n == g.name(gv)).unwrap().1.f64s();
        let k = scale.map_or(1.0, |sv| g.value(sv).initializer().unwrap().to_f64_vec()[0]);
        v.into_iter().map(|x| x / k).collect::<Vec<f64>>()
    };
    let reference = grads("fp32", None);
    let none = grads("mixed", Some(mpc_passes::train::LossScale::None));
    let dynamic = grads("mixed", Some(mpc_passes::train::LossScale::dynamic()));
    let lost = |v: &[f64]| v.iter().zip(&reference).filter(|(a, r)| **a == 0.0 && **r != 0.0).count();
    let (l_none, l_dyn) = (lost(&none), lost(&dynamic));
    let rel = |v: &[f64]| {
        let num: f64 = v.iter().zip(&reference).map(|(a, r)| (a - r) * (a - r)).sum();
        (num / reference.iter().map(|r| r * r).sum::<f64>()).sqrt()
    };
    println!(
        "mode (b) weight gradients lost to FP16 underflow: {l_none}/{} without scaling (rel. error {:.2}), {l_dyn}/{} with dynamic scaling (rel. error {:.2e})",
        reference.len(),
        rel(&none),
        reference.len(),
        rel(&dynamic)
    );
    assert_eq!(l_none, reference.len(), "gradients survived without scaling");
    assert_eq!(l_dyn, 0);
    assert!(rel(&dynamic) < 1e-2);

    // And the loss curves: dynamic scaling follows fp32, no scaling does not move.
    let cfg = TrainConfig { data: vec![data.clone()], epochs: 5, batch: 64, ..Default::default() };
    let curve = |policy: &str, scale: Option<mpc_passes::train::LossScale>| {
        let g = mpc::load(&model).unwrap();
        let opts = Options { loss_scale: scale, ..options(policy, own_loss()) };
        let t = train(&g, &model, &opts, &cfg, &mut |_| {}).unwrap();
        let w = t.state.iter().find(|(n, _)| n == "w").unwrap().1.f64s();
        (t.losses, w)
    };
    let (f, _) = curve("fp32", None);
    let (d, _) = curve("mixed", Some(mpc_passes::train::LossScale::dynamic()));
    let (z, zw) = curve("mixed", Some(mpc_passes::train::LossScale::None));
    let last = |c: &[f32]| *c.last().unwrap() as f64;
    println!(
        "mode (b) loss after {} steps: fp32 {:.3e}, mixed dynamic {:.3e}, mixed unscaled {:.3e} (start {:.3e})",
        f.len(),
        last(&f),
        last(&d),
        last(&z),
        f[0]
    );
    let start = f[0] as f64;
    assert!(last(&f) < 1e-3 * start, "fp32 did not learn");
    assert!(last(&d) < 1e-3 * start, "dynamic scaling did not follow fp32");
    assert!(zw.iter().all(|&w| w == 0.0), "the unscaled model's weights moved");
}

#[test]
fn failure_mode_c_fp16_sum_overflows_f32_accumulation_does_not() {
    let mut g = Graph::new("sum");
    let x = g.add_input("x", TypeInfo::new(DType::F32, Shape::fixed(&[4096])));
    let attrs = mpc_ir::ops::ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
    let (_, y) = g.add_op("sum", Op::ReduceSum(attrs), &[Some(x)], 1);
    g.add_output(y[0]);
    let feeds: HashMap<String, HostTensor> =
        [("x".to_string(), HostTensor::from_f64(DType::F32, vec![4096], vec![16.0; 4096]))].into();
    let result = |policy: &str| {
        let mut g = g.clone();
        let opts = Options { policy: Some(policy.into()), ..Default::default() };
        mpc::compile(&mut g, Path::new("sum"), &opts, &mut |_, _| {}).unwrap();
        mpc::run::run_once(&g, &feeds, Path::new("sum")).unwrap()[0].1.f64s()[0]
    };
    // The naive way: an FP16 accumulator.
    let naive = (0..4096).fold(f16::ZERO, |acc, _| acc + f16::from_f32(16.0)).to_f64();
    let (mixed, fp16) = (result("mixed"), result("fp16"));
    println!("mode (c) 4096 x 16.0: FP16 accumulator {naive}, fp16 policy {fp16}, mixed (F32 reduction) {mixed}");
    assert_eq!(mixed, 65536.0);
    assert!(fp16.is_infinite());
}

/// Each `--schedule` gives the learning rate of the PyTorch or Hugging Face scheduler it is named
/// after over 1000 steps (tests/data/schedules.json, made by tests/models/make_schedules.py), to
/// 1e-6 relative, from the same settings a user gives.
#[test]
fn schedules_follow_the_torch_and_hugging_face_schedulers() {
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/schedules.json")).unwrap();
    let data: serde_json::Value = serde_json::from_str(&text).unwrap();
    let peak = data["lr"].as_f64().unwrap() as f32;
    let cases = data["cases"].as_array().unwrap();
    assert!(cases.len() >= 9);
    for case in cases {
        let (name, s) = (case["name"].as_str().unwrap(), &case["settings"]);
        let file = mpc::config::TrainFile {
            lr: Some(peak),
            schedule: s["schedule"].as_str().map(String::from),
            warmup: s["warmup"].as_f64(),
            lr_min: s["lr_min"].as_f64().map(|x| x as f32),
            total_steps: Some(1000),
            ..Default::default()
        };
        let (opts, _) = file.resolve().unwrap();
        let attrs = opts.schedule.expect("a schedule").resolved().unwrap();
        let want = case["rates"].as_array().unwrap();
        assert_eq!(want.len(), 1000);
        for (k, w) in want.iter().enumerate() {
            let w = w.as_f64().unwrap();
            let got = mpc_runtime::scheduled_rate(&attrs, k as i64, f64::from(peak)) as f32 as f64;
            assert!((got - w).abs() <= 1e-6 * w.abs(), "{name}: step {k}: {got:e}, torch {w:e}");
        }
    }
}

/// The library's `Trainer` on its own: a step's numbers read after it, `set_lr` setting the
/// rate the next steps apply (0: the weights stay), evaluation counts, a checkpoint that another
/// trainer loads into the same state, and the export's weights the trained ones.
#[test]
fn the_trainer_steps_sets_the_rate_evaluates_and_round_trips_its_state() {
    use mpc::trainer::Trainer;
    let path = fixture("digits_mlp");
    let model = mpc::load(&path).unwrap();
    let opts = options("fp32", TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, ..Default::default() });
    let batch = digits_batch(0, 64);
    let mut t = Trainer::new(CpuDevice::default(), &model, &path, &opts, &batch).unwrap();
    let h = t.step(&batch).unwrap();
    let first = t.wait(h).unwrap();
    assert_eq!((first.lr, first.skipped, first.loss_scale), (0.1, false, None));
    let weight =
        |t: &mut Trainer<CpuDevice>| t.state().unwrap().into_iter().find(|(n, _)| n == "fc1.weight").unwrap().1;
    let before = weight(&mut t);
    t.set_lr(0.0).unwrap();
    let h = t.step(&batch).unwrap();
    let second = t.wait(h).unwrap();
    assert_eq!(second.lr, 0.0);
    assert!(second.loss < first.loss, "the first step did not lower the loss: {} then {}", first.loss, second.loss);
    assert_eq!(weight(&mut t), before, "a step at rate 0 moved the weights");
    t.set_lr(0.1).unwrap();
    let h = t.step(&digits_batch(64, 64)).unwrap();
    assert_eq!(t.wait(h).unwrap().lr, 0.1);
    let e = t.evaluate(&digits_batch(1500, 97)).unwrap();
    assert_eq!(e.counted, 97);
    assert!(e.correct > 10 && e.loss.is_some_and(|l| l.is_finite()), "{e:?}");

    let file = scratch("trainer_api").join("checkpoint.safetensors");
    t.save(&file, 3).unwrap();
    let mut u = Trainer::new(CpuDevice::default(), &model, &path, &opts, &batch).unwrap();
    assert_eq!(u.load(&file).unwrap(), 3);
    assert!(u.state().unwrap() == t.state().unwrap(), "the loaded state differs");
    let trained = t.export(&model).unwrap();
    let w = trained.value(trained.find("fc1.weight").unwrap()).initializer().unwrap().clone();
    assert_eq!(HostTensor::from(&w), weight(&mut t));
}

/// A shard's tensors, by name.
type ShardTensors = Vec<(String, HostTensor)>;

/// The digits data as shards of `sizes` samples (in order) under `dir`, named `name-K.safetensors`;
/// `alter` may change a shard's tensors before it is written.
fn digits_shards(dir: &Path, name: &str, sizes: &[usize], alter: impl Fn(usize, &mut ShardTensors)) -> Vec<PathBuf> {
    let data = mpc::run::read_safetensors(&digits()).unwrap();
    let mut from = 0;
    let mut out = Vec::new();
    for (k, &n) in sizes.iter().enumerate() {
        let rows: Vec<usize> = (from..from + n).collect();
        let mut tensors: ShardTensors =
            ["images", "labels"].iter().map(|&t| (t.to_string(), mpc::trainer::rows(&data[t], &rows, None))).collect();
        alter(k, &mut tensors);
        let file = dir.join(format!("{name}-{k}.safetensors"));
        mpc::run::write_safetensors(&file, &tensors).unwrap();
        out.push(file);
        from += n;
    }
    out
}

/// Shards are one dataset: three shards of the digits (matched by a pattern) train as the one file
/// does, loss for loss; a separate evaluation set (`--eval-data`) of the held-out samples reports
/// what the held-out split reports; shards that disagree, or both ways of evaluating, are one line
/// naming the shard and the tensor, exit 2, before any step.
#[test]
fn shards_train_as_one_file_and_disagreeing_shards_are_named() {
    let dir = scratch("shards");
    let model = fixture("digits_mlp");
    digits_shards(&dir, "train", &[600, 500, 400], |_, _| {});
    let eval = digits_shards(&dir, "eval", &[1500, 297], |_, _| {}).pop().unwrap();
    let one = run(&model, "mixed", TrainOptions::default(), &TrainConfig { eval_split: 297.0, ..digits_cfg(2) });
    let pattern = dir.join("train-*.safetensors");
    let cfg =
        TrainConfig { data: vec![pattern.clone()], eval_data: vec![eval.clone()], eval_split: 0.0, ..digits_cfg(2) };
    let sharded = run(&model, "mixed", TrainOptions::default(), &cfg);
    assert_eq!(one.losses, sharded.losses, "the shards trained otherwise");
    let evals = |t: &mpc::train::Trained| t.epochs.iter().map(|e| e.eval.unwrap()).collect::<Vec<_>>();
    assert_eq!(evals(&one), evals(&sharded), "the separate evaluation set");

    let bad = |alter: &dyn Fn(usize, &mut ShardTensors), want: &str| {
        let d = scratch(&format!("shards_bad_{}", want.len()));
        let files = digits_shards(&d, "s", &[100, 100], alter);
        let o = common::mpc(&[
            "train",
            "tests/models/digits_mlp.onnx",
            "--data",
            files[0].to_str().unwrap(),
            "--data",
            files[1].to_str().unwrap(),
            "--checkpoint",
            d.join("ck").to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{want}: {stderr}");
        assert!(stderr.contains(&format!("{}: {want}", files[1].display())), "{want}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        assert!(!d.join("ck").exists(), "{want}: a step ran");
    };
    let second = |k: usize| k == 1;
    bad(
        &|k, t| {
            if second(k) {
                t[0].1 = t[0].1.cast(DType::F16)
            }
        },
        "tensor `images` is f16, in ",
    );
    bad(
        &|k, t| {
            if second(k) {
                t.truncate(1)
            }
        },
        "no tensor `labels`, which ",
    );
    bad(
        &|k, t| {
            if second(k) {
                let x = &t[0].1;
                t[0].1 = x.pick(vec![x.shape[0], 32], &(0..x.shape[0] * 32).collect::<Vec<_>>());
            }
        },
        "input `images` axis 1 is 32, the model declares 64 there",
    );
    let o = common::mpc(&[
        "train",
        "tests/models/digits_mlp.onnx",
        "--data",
        pattern.to_str().unwrap(),
        "--eval-data",
        eval.to_str().unwrap(),
        "--eval-split",
        "0.1",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--eval-data and --eval-split: give one of them"));
    let o = common::mpc(&["train", "tests/models/digits_mlp.onnx", "--data", dir.join("none-*.st").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("none-*.st: no file matches"));
}

/// `--plot`: the training loss of every step and the rate of every step as lines, the
/// evaluation loss after each epoch as points, in one SVG.
#[test]
fn the_plot_draws_each_step_and_each_evaluation() {
    let file = scratch("plot").join("curves.svg");
    let cfg = TrainConfig { eval_split: 297.0, plot: Some(file.clone()), ..digits_cfg(2) };
    let t = run(&fixture("digits_mlp"), "mixed", TrainOptions::default(), &cfg);
    let svg = std::fs::read_to_string(&file).unwrap();
    let lines: Vec<usize> = svg
        .split("<polyline")
        .skip(1)
        .map(|p| p.split("points=\"").nth(1).unwrap().split('"').next().unwrap().split_whitespace().count())
        .filter(|&n| n > 2)
        .collect();
    let steps = t.losses.len();
    assert_eq!(steps, 48);
    assert_eq!(lines, [steps, steps], "a line of the losses and one of the rates");
    // Two evaluations and the legend's mark.
    assert_eq!(svg.matches("<circle").count(), 3, "{svg}");
}

/// Accumulating, a run stopped in the middle of a group (7 micro-batches of groups of 3) and
/// resumed ends bit for bit where the straight run ends: the sums and the count of micro-batches
/// are state in the checkpoint.
#[test]
fn a_run_stopped_mid_group_resumes_bit_for_bit() {
    let model = fixture("digits_mlp");
    let dir = scratch("resume_accumulating");
    let t = TrainOptions { accumulate: 3, ..Default::default() };
    let base = TrainConfig { batch: 32, eval_split: 297.0, ..digits_cfg(1) };
    let straight = run(&model, "mixed", t.clone(), &TrainConfig { max_steps: Some(13), ..base.clone() });
    let ck = TrainConfig { checkpoint: Some(dir.clone()), ..base.clone() };
    run(&model, "mixed", t.clone(), &TrainConfig { max_steps: Some(7), ..ck.clone() });
    let saved = mpc::run::read_safetensors(&dir.join("checkpoint.safetensors")).unwrap();
    assert_eq!(saved["mpc.micro"].i64s().unwrap(), vec![1], "7 micro-batches: two groups and one");
    assert_eq!(saved["mpc.step"].i64s().unwrap(), vec![2]);
    let resumed = run(&model, "mixed", t, &TrainConfig { max_steps: Some(13), resume: true, ..ck });
    assert_eq!(straight.losses[7..], resumed.losses[..]);
    assert!(straight.state == resumed.state, "the state after resuming mid-group differs");
}

/// Data parallel on two ranks of one process (`LocalGroup`, a thread each): each rank steps on its
/// half of every batch of 64 with its gradients averaged by `ai.mpc::AllReduce`. Under fp32 SGD
/// the two ranks' state is the same bits, and within 1e-6 (relative L2) of one process stepping
/// on the whole batch, after 10 updates. Under mixed with dynamic loss scaling an Inf in rank
/// 1's half alone skips the step on both ranks and halves both scales: the states stay the same
/// bits. With one rank (`Solo`) the data-parallel step is the plain one, bit for bit.
#[test]
fn two_ranks_train_as_one_batch_of_both() {
    use mpc_runtime::collective::{Collective, LocalGroup, Solo};
    use std::sync::Arc;
    let model = fixture("digits_mlp");
    let parallel = |t: &TrainOptions| TrainOptions { data_parallel: true, ..t.clone() };
    let with_inf = |mut batch: HashMap<String, HostTensor>| {
        let img = batch.get_mut("images").unwrap();
        let mut v = img.f64s();
        v[5] = f64::INFINITY;
        *img = HostTensor::from_f64(DType::F32, img.shape.clone(), v);
        batch
    };
    // Steps of `g` on `group`'s rank: its half of each batch (the whole batch for one rank), an
    // Inf in rank 1's half at step `bad`; the skipped flags and the state after them.
    let steps = |g: &Graph, group: Arc<dyn Collective>, bad: Option<usize>| {
        let (rank, world) = (group.rank(), group.world());
        let n = 64 / world;
        let mut s = program_session(CpuDevice::default().with_collective(group), g, &digits_batch(0, n));
        let mut skipped = Vec::new();
        for k in 0..10 {
            let batch = digits_batch(k * 64 + rank * n, n);
            let batch = if bad == Some(k) && rank == 1 { with_inf(batch) } else { batch };
            s.feed(0, &batch).unwrap();
            s.step(0).unwrap();
            skipped.push(s.read(0, "mpc.step_skipped").unwrap().f64s()[0] != 0.0);
        }
        let names: Vec<String> = state_of(g).iter().map(|&(v, _)| g.name(v).to_string()).collect();
        let state: Vec<(String, HostTensor)> =
            names.into_iter().map(|n| (n.clone(), s.read_state(&n).unwrap())).collect();
        (skipped, state)
    };
    let on_two = |g: &Graph, bad: Option<usize>| {
        let mut out: Vec<_> = std::thread::scope(|scope| {
            let ranks: Vec<_> = LocalGroup::new(2, std::time::Duration::from_secs(60))
                .into_iter()
                .map(|r| scope.spawn(|| steps(g, Arc::new(r), bad)))
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let one = out.pop().unwrap();
        assert_eq!(out.pop().unwrap(), one, "rank 0 and rank 1 differ");
        one
    };
    let sgd = TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, ..Default::default() };
    let whole = steps(&training_graph(&model, "fp32", sgd.clone()), Arc::new(Solo), None);
    let halves = on_two(&training_graph(&model, "fp32", parallel(&sgd)), None);
    let mut worst = 0f64;
    for ((name, a), (_, b)) in whole.1.iter().zip(&halves.1).filter(|((n, _), _)| !n.starts_with("mpc.")) {
        let (a, b) = (a.f64s(), b.f64s());
        let diff: f64 = a.iter().zip(&b).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
        let rel = diff / a.iter().map(|p| p * p).sum::<f64>().sqrt();
        assert!(rel <= 1e-6, "`{name}` differs by {rel:e} (relative L2)");
        worst = worst.max(rel);
    }
    println!("fp32 SGD: 2 ranks × 32 == 1 × 64 after 10 updates, weights within {worst:.1e} (relative L2)");
    // The gradients in one bucket (the default's 25 MiB) or each alone: the same bits, one
    // all-reduce in place of six.
    let alone = TrainOptions { bucket_bytes: 0, ..parallel(&sgd) };
    assert_eq!(on_two(&training_graph(&model, "fp32", alone.clone()), None), halves, "buckets change the step");
    let reduces = |t: &TrainOptions| {
        let g = training_graph(&model, "fp32", t.clone());
        g.node_ids().filter(|&n| matches!(g.node(n).op, mpc_ir::Op::AllReduce(_))).count()
    };
    assert_eq!((reduces(&parallel(&sgd)), reduces(&alone)), (1, 6), "all-reduces in buckets and alone");
    // One rank: the data-parallel step is the plain one.
    for policy in ["fp32", "mixed"] {
        let plain = steps(&training_graph(&model, policy, sgd.clone()), Arc::new(Solo), None);
        let solo = steps(&training_graph(&model, policy, parallel(&sgd)), Arc::new(Solo), None);
        assert_eq!(plain, solo, "{policy}: one rank's data-parallel step");
    }
    let adam = TrainOptions { loss_scale: mpc_passes::train::LossScale::dynamic(), ..Default::default() };
    let (skipped, state) = on_two(&training_graph(&model, "mixed", parallel(&adam)), Some(3));
    assert_eq!(skipped.iter().filter(|&&s| s).count(), 1, "{skipped:?}");
    assert!(skipped[3], "{skipped:?}");
    let scale = state.iter().find(|(n, _)| n == "mpc.loss_scale").unwrap().1.f64s()[0];
    assert_eq!(scale, 32768.0, "the scale halved once from 65536");
    println!("mixed: an Inf in rank 1's half skips step 3 on both ranks; both scales {scale}");

    // Ranks that lowered different steps (rank 1 freezes a weight: one all-reduce fewer) are an
    // error on both, naming the rank, before any step.
    // (One all-reduce per gradient here: in buckets, the ranks' one bucket each differs in size.)
    let each = TrainOptions { bucket_bytes: 0, ..parallel(&sgd) };
    let frozen = TrainOptions { freeze: ["fc1.bias".to_string()].into(), ..each.clone() };
    let graphs = [training_graph(&model, "fp32", each.clone()), training_graph(&model, "fp32", frozen)];
    let errors: Vec<String> = std::thread::scope(|scope| {
        let ranks: Vec<_> = LocalGroup::new(2, std::time::Duration::from_secs(60))
            .into_iter()
            .zip(&graphs)
            .map(|(r, g)| {
                scope.spawn(move || {
                    let s = program_session(CpuDevice::default(), g, &digits_batch(0, 32));
                    let program = s.program(0).unwrap();
                    mpc_runtime::collective::same_program(&r, program).unwrap_err().to_string()
                })
            })
            .collect();
        ranks.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(e.starts_with(&format!("rank {rank}: the ranks lowered different training steps")), "{e}");
        assert!(e.contains("collectives here, between 5 and 6 on the ranks"), "{e}");
        assert!(e.contains("their collective 5 differs (here the all-reduce of "), "{e}");
        println!("{e}");
    }
}

/// `train_on` as one rank of two (threads of one process, `LocalGroup`; what `mpc train
/// --distributed` runs under mpiexec): each rank trains on its half of each global batch, both
/// report the same epoch lines and end with the same weights, and each has its own dropout
/// stream: rank 1's key is rank 0's plus 2⁴⁰ (other masks on the same step).
#[test]
fn two_ranks_of_train_on_agree_and_draw_their_own_dropout() {
    use mpc::train::{train_on, Shard, Trained};
    use std::sync::Arc;
    let model_path = digits_with_dropout(&scratch("ranks_dropout"));
    let model = mpc::load(&model_path).unwrap();
    let opts = options("fp32", TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, ..Default::default() });
    let runs: Vec<(Vec<f64>, Trained)> = on_ranks(2, |rank, r| {
        let (model, model_path, opts) = (&model, &model_path, &opts);
        let cfg = TrainConfig { shard: Shard { rank, world: 2 }, batch: 32, ..digits_cfg(2) };
        let mut losses = Vec::new();
        let device = CpuDevice::default().with_collective(Arc::new(r));
        let t = train_on(device, model, model_path, opts, &cfg, &mut |e| losses.push(e.mean_loss)).unwrap();
        (losses, t)
    });
    let (a, b) = (&runs[0], &runs[1]);
    assert_eq!(a.0, b.0, "the epoch losses (means over the ranks)");
    let state = |t: &Trained| -> HashMap<String, HostTensor> { t.state.iter().cloned().collect() };
    let (sa, sb) = (state(&a.1), state(&b.1));
    for (name, x) in sa.iter().filter(|(n, _)| !n.starts_with("mpc.")) {
        assert_eq!(x, &sb[name], "`{name}` differs between the ranks");
    }
    let (ka, kb) = (sa["mpc.rng"].i64s().unwrap()[0], sb["mpc.rng"].i64s().unwrap()[0]);
    assert_eq!(kb - ka, 1 << 40, "rank 1's dropout key");
}

/// `--shard-optimizer` (ZeRO stage 1) on two ranks of one process: AdamW trained by `train_on`
/// on each half of every global batch ends with the unsharded two-rank run's weights and
/// moments, bit for bit (fp32 and mixed); with clipping, whose norm the ranks sum from their
/// blocks, within 1e-6 (relative L2) under fp32 and at the same accuracy under mixed. Each rank's
/// training state takes half the bytes (`--stats`, but for the scalars every rank keeps); one
/// rank sharded is the plain step bit for bit; the sharded run's checkpoint holds every value
/// whole and resumes on one rank unsharded and on two sharded.
#[test]
fn a_sharded_optimizer_state_trains_as_the_whole_in_half_the_bytes() {
    use mpc::train::{train_on, Shard, Trained};
    use mpc_passes::train::StateShard;
    use std::sync::Arc;
    let model_path = fixture("digits_mlp");
    let model = mpc::load(&model_path).unwrap();
    let adamw = TrainOptions { optimizer: Optimizer::AdamW, lr: 3e-3, weight_decay: 0.01, ..Default::default() };
    let dir = scratch("sharded_state");
    // Two ranks, sharded or not, `epochs` in all, checkpointing in `dir` (or resuming from it).
    let on_two = |policy: &str, t: &TrainOptions, sharded: bool, epochs: usize, resume: bool| -> Vec<Trained> {
        on_ranks(2, |rank, r| {
            let shard_state = sharded.then_some(StateShard { rank, world: 2 });
            let opts = options(policy, TrainOptions { shard_state, ..t.clone() });
            let (model, model_path, dir) = (&model, &model_path, &dir);
            let shard = Shard { rank, world: 2 };
            let checkpoint = Some(dir.clone());
            let cfg = TrainConfig { shard, batch: 32, checkpoint, resume, ..digits_cfg(epochs) };
            let device = CpuDevice::default().with_collective(Arc::new(r));
            train_on(device, model, model_path, &opts, &cfg, &mut |_| {}).unwrap()
        })
    };
    let state_bytes = |t: &Trained| -> u64 {
        let at = t.stats.find("state ").unwrap() + 6;
        t.stats[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let accuracy = |t: &Trained| t.epochs.last().unwrap().eval.unwrap().0;
    for (policy, clip_norm) in [("fp32", None), ("mixed", None), ("fp32", Some(1.0)), ("mixed", Some(1.0))] {
        let t = TrainOptions { clip_norm, ..adamw.clone() };
        let whole = on_two(policy, &t, false, 3, false);
        let sharded = on_two(policy, &t, true, 3, false);
        let full: HashMap<String, HostTensor> = whole[0].state.iter().cloned().collect();
        let mut worst = 0f64;
        for r in &sharded {
            // Each rank's state: its blocks, and the few scalars (and their alignment) every rank
            // keeps whole.
            let (mine, all) = (state_bytes(r), state_bytes(&whole[0]));
            assert!(mine <= all / 2 + 256, "{policy}: {mine} B of state on a rank, {all} B unsharded");
            assert_eq!(r.state.len(), whole[0].state.len(), "{policy}: the gathered state's values");
            for (name, x) in &r.state {
                let y = &full[name];
                assert_eq!(x.shape, y.shape, "{policy}: `{name}` gathered");
                let (a, b) = (y.f64s(), x.f64s());
                let diff: f64 = a.iter().zip(&b).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
                let rel = diff / a.iter().map(|p| p * p).sum::<f64>().sqrt().max(1e-30);
                worst = worst.max(rel);
                let bound = if clip_norm.is_none() {
                    0.0
                } else if policy == "fp32" {
                    1e-6
                } else {
                    f64::INFINITY
                };
                assert!(
                    rel <= bound,
                    "{policy}, clip {clip_norm:?}: `{name}` differs by {rel:e} from the unsharded run"
                );
            }
        }
        assert_eq!(accuracy(&sharded[0]), accuracy(&sharded[1]), "{policy}: the ranks' accuracy");
        let (a, b) = (accuracy(&sharded[0]), accuracy(&whole[0]));
        assert!((a - b).abs() <= 0.01, "{policy}: accuracy {a} sharded, {b} whole");
        println!(
            "{policy}, clip {clip_norm:?}: state per rank {} B sharded, {} B whole; state within {worst:.1e} \
             (relative L2) of the unsharded run after 3 epochs, accuracy {:.2}% and {:.2}%",
            state_bytes(&sharded[0]),
            state_bytes(&whole[0]),
            a * 100.0,
            b * 100.0
        );
    }
    // One rank: the sharded step is the plain one, bit for bit.
    for policy in ["fp32", "mixed"] {
        let solo = TrainOptions { shard_state: Some(StateShard { rank: 0, world: 1 }), ..adamw.clone() };
        let plain = run(&model_path, policy, adamw.clone(), &digits_cfg(1));
        assert!(plain.state == run(&model_path, policy, solo, &digits_cfg(1)).state, "{policy}: one rank sharded");
    }
    // The checkpoint of the last sharded run above (mixed, clipped) holds every value whole; it
    // resumes on one rank unsharded (at the same global batch of 64) and on two sharded, each
    // for the fourth epoch.
    let clipped = TrainOptions { clip_norm: Some(1.0), ..adamw.clone() };
    let saved = mpc::run::read_safetensors(&dir.join("checkpoint.safetensors")).unwrap();
    let w = model.value(model.find("fc1.weight").unwrap()).initializer().unwrap().shape().to_vec();
    assert_eq!(saved["fc1.weight"].shape, w.iter().map(|&d| d as usize).collect::<Vec<_>>());
    // One rank resumes a copy: its own checkpoint after the fourth epoch replaces the file.
    let alone = scratch("sharded_state_alone");
    std::fs::copy(dir.join("checkpoint.safetensors"), alone.join("checkpoint.safetensors")).unwrap();
    let cfg = TrainConfig { batch: 64, checkpoint: Some(alone), resume: true, ..digits_cfg(4) };
    let one = mpc::train::train(&model, &model_path, &options("mixed", clipped.clone()), &cfg, &mut |_| {}).unwrap();
    assert_eq!(one.epochs.len(), 1, "one rank: one epoch left after the checkpoint's three");
    let two = on_two("mixed", &clipped, true, 4, true);
    assert_eq!(two[0].epochs.len(), 1, "two ranks: one epoch left after the checkpoint's three");
    let (a, b) = (accuracy(&one), accuracy(&two[0]));
    assert!((a - b).abs() <= 0.01, "resumed: accuracy {a} on one rank, {b} on two");
}

/// A checkpoint counts batches of its global batch (`mpc.global_batch`): one process at
/// `--batch 64` resumes on two ranks at `--global-batch 64` (32 each) where the one process
/// would have gone on (fp32 SGD: the same weights within 1e-6), a resume at another global batch
/// is one line saying which to give, and a global batch the ranks do not divide is refused.
#[test]
fn a_checkpoint_resumes_at_its_global_batch_on_another_number_of_ranks() {
    use mpc::train::{train_on, Shard};
    use std::sync::Arc;
    let model_path = fixture("digits_mlp");
    let model = mpc::load(&model_path).unwrap();
    let opts = options("fp32", TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, ..Default::default() });
    let dir = scratch("global_batch");
    let at = |name: &str| {
        let d = dir.join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let first = TrainConfig { checkpoint: Some(at("first")), ..digits_cfg(2) };
    mpc::train::train(&model, &model_path, &opts, &first, &mut |_| {}).unwrap();
    let copy = |name: &str| {
        let d = at(name);
        std::fs::copy(dir.join("first/checkpoint.safetensors"), d.join("checkpoint.safetensors")).unwrap();
        Some(d)
    };
    // One process goes on at batch 64; at batch 32 it is told to give the checkpoint's 64.
    let on = TrainConfig { checkpoint: copy("one"), resume: true, ..digits_cfg(3) };
    let one = mpc::train::train(&model, &model_path, &opts, &on, &mut |_| {}).unwrap();
    let small = TrainConfig { batch: 32, checkpoint: copy("small"), resume: true, ..digits_cfg(3) };
    let e = mpc::train::train(&model, &model_path, &opts, &small, &mut |_| {}).err().unwrap().to_string();
    assert!(e.contains("the checkpoint counts batches of 64 samples over all ranks, and this run's are 32"), "{e}");
    assert!(e.ends_with("resume with --global-batch 64"), "{e}");
    // Two ranks at --global-batch 64 go on from the same checkpoint.
    let two_dir = copy("two");
    let two: Vec<mpc::train::Trained> = on_ranks(2, |rank, r| {
        let (model, model_path, opts, two_dir) = (&model, &model_path, &opts, &two_dir);
        let shard = Shard { rank, world: 2 };
        let cfg =
            TrainConfig { shard, global_batch: Some(64), checkpoint: two_dir.clone(), resume: true, ..digits_cfg(3) };
        let device = CpuDevice::default().with_collective(Arc::new(r));
        train_on(device, model, model_path, opts, &cfg, &mut |_| {}).unwrap()
    });
    assert_eq!(two[0].epochs.len(), 1, "the third epoch alone");
    let mut worst = 0f64;
    for ((name, a), (_, b)) in one.state.iter().zip(&two[0].state).filter(|((n, _), _)| !n.starts_with("mpc.")) {
        let (a, b) = (a.f64s(), b.f64s());
        let diff: f64 = a.iter().zip(&b).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
        let rel = diff / a.iter().map(|p| p * p).sum::<f64>().sqrt();
        assert!(rel <= 1e-6, "`{name}` differs by {rel:e} (relative L2)");
        worst = worst.max(rel);
    }
    println!("resumed on 2 ranks at --global-batch 64: the one process's weights within {worst:.1e}");
    let odd = TrainConfig { shard: Shard { rank: 0, world: 2 }, global_batch: Some(63), ..digits_cfg(1) };
    let e = mpc::train::train(&model, &model_path, &opts, &odd, &mut |_| {}).err().unwrap().to_string();
    assert_eq!(e, "--global-batch 63 over 2 ranks: the global batch must be a positive multiple of the ranks");
}

/// Accumulating on two ranks, only the micro-batch that applies the sums reduces them: with
/// `--accumulate 2` an epoch of 24 global batches all-reduces the gradients' bucket 12 times
/// (once per update), and the weights are one process's at twice the batch, accumulating
/// alike (fp32 SGD, within 1e-6 relative L2); sharded, the same state bit for bit.
#[test]
fn accumulating_ranks_reduce_only_the_sums_they_apply() {
    use mpc::train::{train_on, Shard};
    use mpc_ir::ops::CollectiveReduction;
    use mpc_runtime::collective::{Collective, LocalGroup};
    use mpc_runtime::RuntimeError;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    /// A rank that counts its all-reduces of the gradients' bucket (all of them: 85,002 elements).
    #[derive(Debug)]
    struct Counting(LocalGroup, AtomicUsize);
    impl Collective for Counting {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world(&self) -> usize {
            self.0.world()
        }
        fn all_reduce(&self, x: &HostTensor, how: CollectiveReduction) -> Result<HostTensor, RuntimeError> {
            if x.len() == 85_002 {
                self.1.fetch_add(1, Ordering::Relaxed);
            }
            self.0.all_reduce(x, how)
        }
    }
    let model_path = fixture("digits_mlp");
    let model = mpc::load(&model_path).unwrap();
    let sgd = TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, accumulate: 2, ..Default::default() };
    let on_two = |sharded: bool| -> Vec<(usize, mpc::train::Trained)> {
        on_ranks(2, |rank, r| {
            let shard_state = sharded.then_some(mpc_passes::train::StateShard { rank, world: 2 });
            let opts = options("fp32", TrainOptions { shard_state, ..sgd.clone() });
            let (model, model_path) = (&model, &model_path);
            let counting = Arc::new(Counting(r, AtomicUsize::new(0)));
            let cfg = TrainConfig { shard: Shard { rank, world: 2 }, batch: 32, ..digits_cfg(1) };
            let device = CpuDevice::default().with_collective(counting.clone());
            let t = train_on(device, model, model_path, &opts, &cfg, &mut |_| {}).unwrap();
            (counting.1.load(Ordering::Relaxed), t)
        })
    };
    let runs = on_two(false);
    // Sharded, the reduce-scatters are gated alike: the same state bit for bit.
    let sharded = on_two(true);
    assert!(sharded[0].1.state == runs[0].1.state, "accumulating, the sharded state differs from the unsharded");
    assert_eq!(runs[0].0, 12, "all-reduces of the gradients in 24 micro-batches of groups of 2");
    let one = run(
        &model_path,
        "fp32",
        TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, accumulate: 2, ..Default::default() },
        &digits_cfg(1),
    );
    for ((name, a), (_, b)) in one.state.iter().zip(&runs[0].1.state).filter(|((n, _), _)| !n.starts_with("mpc.")) {
        let (a, b) = (a.f64s(), b.f64s());
        let diff: f64 = a.iter().zip(&b).map(|(p, q)| (p - q) * (p - q)).sum::<f64>().sqrt();
        let rel = diff / a.iter().map(|p| p * p).sum::<f64>().sqrt();
        assert!(rel <= 1e-6, "`{name}` differs by {rel:e} (relative L2)");
    }
}

/// In a data-parallel run each step's loss (what `--log` writes and `Trained::losses` holds) is
/// the mean of the ranks' losses: the global batch's. Two ranks at 32 log, step for step, the
/// losses one process at 64 logs (fp32 SGD, within 1e-5 relative), where rank 0's own half
/// would be some percent away.
#[test]
fn a_data_parallel_log_holds_the_global_batch_losses() {
    use mpc::train::{train_on, Shard};
    use std::sync::Arc;
    let model_path = fixture("digits_mlp");
    let model = mpc::load(&model_path).unwrap();
    let sgd = TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, ..Default::default() };
    let opts = options("fp32", sgd.clone());
    let two: Vec<mpc::train::Trained> = on_ranks(2, |rank, r| {
        let (model, model_path, opts) = (&model, &model_path, &opts);
        let cfg = TrainConfig { shard: Shard { rank, world: 2 }, batch: 32, ..digits_cfg(2) };
        let device = CpuDevice::default().with_collective(Arc::new(r));
        train_on(device, model, model_path, opts, &cfg, &mut |_| {}).unwrap()
    });
    let one = run(&model_path, "fp32", sgd, &digits_cfg(2));
    assert_eq!(two[0].losses, two[1].losses, "the ranks' logged losses");
    assert_eq!(two[0].losses.len(), one.losses.len());
    for (k, (a, b)) in one.losses.iter().zip(&two[0].losses).enumerate() {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "step {}: {b} on two ranks, {a} on one", k + 1);
    }
}

/// Each rank draws its own dropout masks: two ranks stepping on the same batch (the digits MLP
/// with Dropout) compute other losses once rank 1's stream is moved, and the same loss, bit for
/// bit, while both keys are the seed.
#[test]
fn the_ranks_draw_other_dropout_masks_on_the_same_batch() {
    use mpc::train::Shard;
    use mpc::trainer::Trainer;
    use std::sync::Arc;
    let path = digits_with_dropout(&scratch("ranks_masks"));
    let model = mpc::load(&path).unwrap();
    let t = TrainOptions { optimizer: Optimizer::Sgd, lr: 0.1, data_parallel: true, ..Default::default() };
    let opts = options("fp32", t);
    let batch = digits_batch(0, 32);
    let first_losses = |moved: bool| -> Vec<f32> {
        on_ranks(2, |rank, r| {
            let (model, path, opts, batch) = (&model, &path, &opts, &batch);
            let device = CpuDevice::default().with_collective(Arc::new(r));
            let mut trainer = Trainer::new(device, model, path, opts, batch).unwrap();
            if moved {
                trainer.own_dropout_stream(Shard { rank, world: 2 }).unwrap();
            }
            let h = trainer.step(batch).unwrap();
            trainer.wait(h).unwrap().loss
        })
    };
    let same = first_losses(false);
    assert_eq!(same[0].to_bits(), same[1].to_bits(), "one key: the same masks, the same loss");
    let own = first_losses(true);
    assert_eq!(own[0].to_bits(), same[0].to_bits(), "rank 0 keeps the seed's masks");
    assert_ne!(own[0], own[1], "rank 1's masks are its own");
}

/// The sharded step on the fixtures beside the MLP (batch norms and their running statistics, a
/// residual CNN, a transformer's LayerNorms and embedding, GPT-2's LM head tied to its token
/// embedding), AdamW with weight decay and the biases and norms exempt: on two ranks, each on
/// batches of its own, every state block is the unsharded run's value's block, bit for bit, and
/// every value kept whole the same bits.
#[test]
fn a_sharded_state_trains_the_fixtures_as_the_whole() {
    use mpc_passes::train::{NoDecay, StateShard};
    use mpc_runtime::collective::padded_block;
    use std::sync::Arc;
    let cases = [
        ("cnn_bn", "mixed", None),
        ("transformer", "mixed", None),
        ("resblock", "fp32", None),
        ("zoo/gpt2.legacy", "mixed", Some("cross-entropy:axis=-1")),
    ];
    for (name, policy, loss) in cases {
        let model = fixture(name);
        let file = mpc::config::TrainFile { loss: loss.map(str::to_string), ..Default::default() };
        let base = TrainOptions {
            optimizer: Optimizer::AdamW,
            lr: 1e-3,
            weight_decay: 0.01,
            no_decay: vec![NoDecay::Biases, NoDecay::Norms],
            data_parallel: true,
            ..file.resolve().unwrap().0
        };
        let on_two = |sharded: bool| -> Vec<HashMap<String, HostTensor>> {
            on_ranks(2, |rank, r| {
                let shard_state = sharded.then_some(StateShard { rank, world: 2 });
                let t = TrainOptions { shard_state, ..base.clone() };
                let model = &model;
                let g = training_graph(model, policy, t);
                let dims = HashMap::from([("batch".to_string(), 4u64)]);
                let feeds: Vec<_> = (0..3)
                    .map(|k| mpc::run::random_inputs_within(&g, (rank * 10 + k) as u64, &dims, 1 << 30).unwrap())
                    .collect();
                let device = CpuDevice::default().with_collective(Arc::new(r));
                let mut s = program_session(device, &g, &feeds[0]);
                for f in &feeds {
                    s.feed(0, f).unwrap();
                    s.step(0).unwrap();
                }
                let names: Vec<String> = state_of(&g).iter().map(|&(v, _)| g.name(v).to_string()).collect();
                names.into_iter().map(|n| (n.clone(), s.read_state(&n).unwrap())).collect()
            })
        };
        let (whole, sharded) = (on_two(false), on_two(true));
        for rank in 0..2 {
            assert_eq!(whole[rank].len(), sharded[rank].len(), "{name}: the state's values");
            let mut blocks = 0;
            for (value, block) in &sharded[rank] {
                let full = &whole[rank][value];
                if full.shape == block.shape {
                    assert_eq!(full, block, "{name}: `{value}` (kept whole) on rank {rank}");
                } else {
                    assert_eq!(&padded_block(full, rank, 2), block, "{name}: `{value}`'s block on rank {rank}");
                    blocks += 1;
                }
            }
            assert!(blocks > 0, "{name}: nothing sharded");
        }
    }
}
