//! The training graph the compiler writes: snapshots, FP32 masters and their copies, the loss's
//! precision, one-line errors, the config file, gradient clipping, batch norms, masks and buffers,
//! the train signature through both formats, fixed-batch exports, and checkpoint checks.

mod common;

use common::training::*;
use common::{fixture, scratch, settings};
use mpc::train::{train, TrainConfig, Trained};
use mpc::Options;
use mpc_ir::{DType, Graph, Op, Tensor};
use mpc_passes::train::TrainOptions;
use mpc_runtime::device::CpuDevice;
use mpc_runtime::HostTensor;

#[test]
fn training_graph_snapshots() {
    for policy in ["mixed", "mixed-bf16"] {
        let g = training_graph(&fixture("mlp"), policy, TrainOptions::default());
        let text = mpc_ir::text::to_summary(&g).unwrap();
        settings().bind(|| insta::assert_snapshot!(format!("train-{policy}__mlp"), text));
    }
}

/// What each pass of the training pipeline does to the CNN and the transformer, as a diff of the
/// graph before and after it: the precision pass's colouring, the loss scale, the backward graph,
/// the optimizer and each cleanup, one snapshot per pass that changes the graph (the CNN's casts
/// need no cleanup).
#[test]
fn each_training_pass_as_a_diff() {
    let passes = mpc_passes::PassManager::pipeline(mpc_passes::Pipeline::Training).pass_names();
    for name in ["cnn_bn", "transformer"] {
        let path = fixture(name);
        let mut g = mpc::load(&path).unwrap();
        let mut before = by_name(&mpc_ir::text::to_summary(&g).unwrap());
        let opts = Options {
            dump_after: passes.iter().map(|p| p.to_string()).collect(),
            ..options("mixed", TrainOptions::default())
        };
        let mut diffs = Vec::new();
        mpc::compile(&mut g, &path, &opts, &mut |pass, g| {
            let after = by_name(&mpc_ir::text::to_summary(g).unwrap());
            if after != before {
                let diff = similar::TextDiff::from_lines(&before, &after);
                diffs.push((pass.to_string(), diff.unified_diff().context_radius(1).to_string()));
                before = after;
            }
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let changed: Vec<&str> = diffs.iter().map(|(p, _)| p.as_str()).collect();
        for pass in ["precision", "loss-scale", "autodiff", "optimizer"] {
            assert!(changed.contains(&pass), "{name}: {pass} changed nothing ({changed:?})");
        }
        for (i, (pass, diff)) in diffs.iter().enumerate() {
            settings().bind(|| insta::assert_snapshot!(format!("pass-{name}__{i:02}-{pass}"), diff));
        }
    }
}

/// A summary whose values are called by their names (`%conv1_out`) instead of their numbers,
/// which every added value shifts: a pass's diff shows the lines it changed, not a renumbering.
fn by_name(summary: &str) -> String {
    // `%12 "name"` declares; `%12` refers.
    let number = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let mut names = std::collections::HashMap::new();
    for part in summary.split('%').skip(1) {
        let n = number(part);
        if let Some(rest) = part[n..].strip_prefix(" \"") {
            let name = &rest[..rest.find('"').unwrap_or(rest.len())];
            names.insert(&part[..n], name);
        }
    }
    let mut parts = summary.split('%');
    let mut out = parts.next().unwrap_or_default().to_string();
    for part in parts {
        let n = number(part);
        match names.get(&part[..n]) {
            Some(name) => {
                let rest = &part[n..];
                let rest = rest.strip_prefix(&format!(" \"{name}\"")).unwrap_or(rest);
                out += &format!("%{name}{rest}");
            }
            None => out += &format!("%{part}"),
        }
    }
    out
}

/// A convolution's gradient computes its bias's only where the convolution has one: ConvGrad
/// has two outputs (dX, dW) for a Conv without a bias (a ResNet's, before each batch norm), no
/// sum over dY that nothing reads, and three where the bias trains.
#[test]
fn a_convolution_without_a_bias_has_no_bias_gradient() {
    let (mut with, mut without) = (0, 0);
    for name in ["cnn_bn", "resblock"] {
        let g = training_graph(&fixture(name), "mixed", TrainOptions::default());
        for n in g.node_ids() {
            let node = g.node(n);
            if !matches!(node.op, Op::Conv(_)) {
                continue;
            }
            let grad = g
                .node_ids()
                .find(|&m| matches!(g.node(m).op, Op::ConvGrad(_)) && g.node(m).input(2) == node.input(1))
                .unwrap_or_else(|| panic!("{name}: no gradient of `{}`", g.node_label(n)));
            let biased = node.input(2).is_some();
            assert_eq!(g.node(grad).outputs().len(), if biased { 3 } else { 2 }, "{name}: {}", g.node_label(n));
            if biased {
                with += 1;
            } else {
                without += 1;
            }
        }
    }
    assert!(without > 0, "no convolution without a bias in the fixtures ({with} with one)");
}

/// Each FP32 master's FP16 copy is state that its update writes, and the forward pass reads it
/// (with `weight_copies` off: the master is cast to FP16 once per step). The update reads the FP16
/// gradient as computed with the loss scale's reciprocal: no FP32 copy of a gradient is made.
#[test]
fn masters_stay_f32_and_each_is_cast_once() {
    for weight_copies in [true, false] {
        let g = training_graph(&fixture("mlp"), "mixed", TrainOptions { weight_copies, ..Default::default() });
        let inv = g.find("optimizer.inv_scale").unwrap();
        for name in ["fc1.weight", "fc2.weight", "fc3.bias"] {
            let v = g.find(name).unwrap();
            assert_eq!(g.value(v).initializer().unwrap().dtype(), DType::F32, "{name}");
            let casts = g.value(v).uses().iter().filter(|u| matches!(g.node(u.node).op, Op::Cast(_))).count();
            let update = update_of(&g, name);
            let grad = update.input(1).unwrap();
            assert_eq!(g.ty(grad).dtype, Some(DType::F16), "{name}'s gradient");
            assert!(g.find(&format!("{name}.grad")).is_none(), "an FP32 copy of {name}'s gradient");
            // AdamUpdate's copy and unscale inputs.
            let ins = [update.input(7), update.input(6)];
            if weight_copies {
                assert_eq!(casts, 0, "{name}");
                let copy = g.find(&format!("mpc.f16.{name}")).unwrap();
                let t = g.value(copy).initializer().unwrap();
                assert_eq!(*t, g.value(v).initializer().unwrap().to_dtype(DType::F16), "{name}'s first copy");
                assert_eq!(ins, [Some(copy), Some(inv)], "{name}'s update unscales and writes the copy");
                assert!(g.value(copy).uses().iter().any(|u| g.node(u.node).op.op_type() == "Gemm"), "{name}");
                let next = update.outputs().last().copied().unwrap();
                assert!(state_of(&g).contains(&(copy, next)), "{name}'s copy is not state");
            } else {
                assert_eq!(casts, 1, "{name}");
                assert_eq!(ins, [None, Some(inv)], "{name}'s update unscales");
            }
        }
    }
    // With clipping, which needs the unscaled gradients, they are made in FP32 first.
    let clipped = training_graph(&fixture("mlp"), "mixed", TrainOptions { clip_norm: Some(1.0), ..Default::default() });
    let grad = update_of(&clipped, "fc1.weight").input(1).unwrap();
    assert_eq!(clipped.ty(grad).dtype, Some(DType::F32));
}

/// `--io-types low` puts the model's inputs and outputs in the low dtype but never the loss: it
/// stays FP32 (an FP16 loss made the loss scale's Mul mix f16 and f32), and the step trains.
#[test]
fn io_low_keeps_the_loss_fp32() {
    let model = fixture("mlp");
    for (policy, low) in [("mixed", DType::F16), ("mixed-bf16", DType::BF16)] {
        let mut g = mpc::load(&model).unwrap();
        let opts = Options { io_low: true, ..options(policy, TrainOptions::default()) };
        mpc::compile(&mut g, &model, &opts, &mut |_, _| {}).unwrap_or_else(|e| panic!("{policy}: {e}"));
        let loss = g.train.as_ref().unwrap().loss.unwrap();
        assert_eq!(g.ty(loss).dtype, Some(DType::F32), "{policy}: the loss");
        assert_eq!(g.ty(g.find("x").unwrap()).dtype, Some(low), "{policy}: the input");
        let mut feeds = digits_batch(0, 8);
        let x = feeds.get_mut("images").map(|t| t.cast(low)).unwrap();
        feeds.insert("x".into(), x);
        feeds.remove("images");
        let mut s = program_session(CpuDevice::default(), &g, &feeds);
        s.feed(0, &feeds).unwrap();
        s.step(0).unwrap();
        assert!(s.read(0, g.name(loss)).unwrap().f64s()[0].is_finite(), "{policy}");
    }
}

#[test]
fn ops_without_gradients_and_bad_options_are_one_line_errors() {
    let dir = scratch("train_errors");
    let out = dir.join("out.onnx");
    for (args, want) in [
        (
            vec!["compile", "tests/models/custom_op.onnx", "--train", "-o"],
            "node `/act/Gelu` (Gelu): op com.microsoft::Gelu has no gradient rule",
        ),
        (
            vec!["compile", "tests/models/control_flow.onnx", "--train", "-o"],
            "node `branch` (If): op If has no gradient rule",
        ),
        (vec!["compile", "tests/models/mlp.onnx", "--train", "--optimizer", "lamb", "-o"], "--optimizer `lamb`"),
        (vec!["compile", "tests/models/mlp.onnx", "--train", "--loss", "output:nope", "-o"], "no output has that name"),
        (
            vec!["compile", "tests/models/mlp.onnx", "--train", "--loss", "cross-entropy:axis=x", "-o"],
            "loss `cross-entropy:axis=x`: `axis` is `x`, not an integer",
        ),
        (
            vec!["compile", "tests/models/mlp.onnx", "--train", "--loss", "cross-entropy:axis=0", "-o"],
            "cross-entropy over axis 0 needs scores with a batch axis before it",
        ),
        (
            vec!["compile", "tests/models/mlp.onnx", "--train", "--loss-scale", "static:-1", "-o"],
            "--loss-scale `static:-1`",
        ),
    ] {
        let mut args: Vec<&str> = args;
        args.push(out.to_str().unwrap());
        let o = common::mpc(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(!out.exists(), "{args:?} left an output file");
    }
    let o = common::mpc(&["train", "tests/models/mlp.onnx", "--data", digits().to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no tensor `x`") && stderr.contains("images, labels"), "{stderr}");
}

/// An `If` that the shapes decide (nn.MultiheadAttention's `If Shape(x)[k] == 1` around a
/// Squeeze) is the branch it takes, and trains through it: the control_flow fixture's condition
/// made `Shape(x)[1] == k` takes the Mul branch for k = 4 (x is [batch, 4]) and the Sub for 3.
#[test]
fn an_if_the_shapes_decide_is_the_branch_it_takes() {
    use mpc_ir::onnx::proto::{ModelProto, NodeProto, TensorProto};
    use prost::Message;
    let dir = scratch("known_if");
    for (k, kept, gone) in [(4, "then_mul", "else_sub"), (3, "else_sub", "then_mul")] {
        let mut m = ModelProto::decode(std::fs::read(fixture("control_flow")).unwrap().as_slice()).unwrap();
        let g = m.graph.as_mut().unwrap();
        g.input.retain(|i| i.name != "cond");
        let ints = |name: &str, v: i64| TensorProto {
            name: name.into(),
            dims: vec![1],
            data_type: 7,
            int64_data: vec![v],
            ..Default::default()
        };
        g.initializer.extend([ints("one", 1), ints("k", k)]);
        let node = |op: &str, ins: &[&str], out: &str| NodeProto {
            op_type: op.into(),
            name: out.into(),
            input: ins.iter().map(|s| s.to_string()).collect(),
            output: vec![out.into()],
            ..Default::default()
        };
        let cond = [
            node("Shape", &["x"], "shape"),
            node("Gather", &["shape", "one"], "dim"),
            node("Equal", &["dim", "k"], "cond1"),
        ];
        g.node.splice(0..0, cond);
        let at = g.node.iter().position(|n| n.op_type == "If").unwrap();
        g.node[at].input[0] = "cond1".into();
        let path = dir.join(format!("if_{k}.onnx"));
        std::fs::write(&path, m.encode_to_vec()).unwrap();
        let text = dir.join(format!("if_{k}.mpcir"));
        let o = common::mpc(&["compile", path.to_str().unwrap(), "--train", "-o", text.to_str().unwrap()]);
        assert!(o.status.success(), "k = {k}: {}", String::from_utf8_lossy(&o.stderr));
        let text = std::fs::read_to_string(&text).unwrap();
        assert!(
            text.contains(&format!("branch/{kept}")) && !text.contains(gone) && !text.contains("If["),
            "k = {k}: {text}"
        );
    }
}

/// `--no-decay`: each update's weight decay is 0 for the parameters named (biases and
/// normalisation parameters, as Hugging Face's Trainer exempts them, or a name pattern), the
/// option's value for the rest; a pattern that names no parameter is one line naming it.
#[test]
fn no_decay_exempts_biases_norms_and_named_parameters() {
    use mpc_passes::train::{NoDecay, Optimizer};
    let decays = |model: &str, no_decay: Vec<NoDecay>| -> Vec<(String, usize, f32)> {
        let t = TrainOptions { optimizer: Optimizer::AdamW, weight_decay: 0.01, no_decay, ..Default::default() };
        let g = training_graph(&fixture(model), "mixed", t);
        let mut out: Vec<_> = g
            .node_ids()
            .filter_map(|n| match &g.node(n).op {
                Op::AdamUpdate(a) => {
                    let p = g.node(n).input(0).unwrap();
                    let rank = g.ty(p).shape.as_ref().unwrap().dims().len();
                    Some((g.name(p).to_string(), rank, a.weight_decay))
                }
                _ => None,
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    };
    for model in ["cnn_bn", "transformer"] {
        let all = decays(model, Vec::new());
        assert!(all.iter().all(|p| p.2 == 0.01), "{model}: {all:?}");
        let groups = decays(model, vec![NoDecay::Biases, NoDecay::Norms]);
        assert!(groups.iter().any(|p| p.1 == 1) && groups.iter().any(|p| p.1 > 1), "{model}: {groups:?}");
        for (name, rank, decay) in &groups {
            assert_eq!(*decay, if *rank == 1 { 0.0 } else { 0.01 }, "{model}: `{name}`");
        }
        let biases = decays(model, vec![NoDecay::Biases]);
        let norms = decays(model, vec![NoDecay::Norms]);
        assert!(biases.iter().chain(&norms).any(|p| p.2 == 0.01 && p.1 == 1), "{model}: one kind only {biases:?}");
        let named = decays(model, vec![NoDecay::Named("*weight".into())]);
        for (name, _, decay) in &named {
            assert_eq!(*decay, if name.ends_with("weight") { 0.0 } else { 0.01 }, "{model}: `{name}`");
        }
    }
    // A bias is found where it is read (Gemm's C, behind the mixed policy's Cast), whatever its name.
    let model = fixture("mlp");
    let mut g = mpc::load(&model).unwrap();
    for v in g.initializers().collect::<Vec<_>>() {
        let name = g.name(v).replace("bias", "b");
        g.rename(v, &name);
    }
    let t = TrainOptions {
        optimizer: Optimizer::AdamW,
        weight_decay: 0.01,
        no_decay: vec![NoDecay::Biases],
        ..Default::default()
    };
    mpc::compile(&mut g, &model, &options("mixed", t), &mut |_, _| {}).unwrap();
    let mut exempt = 0;
    for n in g.node_ids() {
        if let Op::AdamUpdate(a) = &g.node(n).op {
            let rank = g.ty(g.node(n).input(0).unwrap()).shape.as_ref().unwrap().dims().len();
            assert_eq!(a.weight_decay, if rank == 1 { 0.0 } else { 0.01 }, "{}", g.node_label(n));
            exempt += (rank == 1) as usize;
        }
    }
    assert_eq!(exempt, 3, "the MLP's three Gemm biases");
    let o = common::mpc(&["compile", "tests/models/mlp.onnx", "--train", "--no-decay", "biases,fc9.*"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("no_decay `fc9.*`: no trained parameter's name matches it"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

#[test]
fn the_config_file_sets_training_options_and_flags_override_it() {
    let dir = scratch("train_config");
    let config = dir.join("policy.toml");
    std::fs::write(
        &config,
        "policy = \"mixed\"\n[train]\noptimizer = \"momentum\"\nlr = 0.05\nmomentum = 0.8\nclip_norm = 2.0\n\
         init_scale = 1024.0\ngrowth_interval = 10\nbackoff_factor = 0.25\nmax_scale = 4096.0\nseed = 9\n",
    )
    .unwrap();
    let out = dir.join("step.mpcir");
    let compile = |extra: &[&str]| {
        let mut args = vec!["compile", "tests/models/mlp.onnx", "--train", "--config", config.to_str().unwrap()];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["-o", out.to_str().unwrap()]);
        let o = common::mpc(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(&out).unwrap()
    };
    let text = compile(&[]);
    assert!(text.contains("ai.mpc::SgdUpdate[lr=0.05, momentum=0.8]"), "{text}");
    assert!(text.contains("= Min(") && text.contains("\"optimizer.grad_norm"), "clip_norm from the file");
    assert!(text.contains("\"mpc.loss_scale\" = f32[]{1024.0}"), "init_scale from the file");
    assert!(
        text.contains("ai.mpc::LossScaleUpdate[backoff_factor=0.25, growth_interval=10, max_scale=4096.0]"),
        "{text}"
    );
    // A flag wins over the file; the rest of the file still applies.
    let text = compile(&["--lr", "0.01", "--loss-scale", "static:8"]);
    assert!(text.contains("ai.mpc::SgdUpdate[lr=0.01, momentum=0.8]"), "{text}");
    assert!(text.contains("\"mpc.loss_scale\" = f32[]{8.0}") && !text.contains("LossScaleUpdate"), "{text}");
    // The weights' f16 copies are state by default; the flag and the file's key cast every step.
    assert!(text.contains("init %") && text.contains("\"mpc.f16.fc1.weight\" = f16[256,64]"), "{text}");
    let text = compile(&["--no-weight-copies"]);
    assert!(!text.contains("mpc.f16.") && text.contains("\"fc1.weight.cast_f16\": f16[256,64] = Cast"), "{text}");
    let body = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, format!("{body}weight_copies = false\n")).unwrap();
    assert!(!compile(&[]).contains("mpc.f16."), "weight_copies from the file");

    // A bad or unknown setting names the file and the setting; exit 2, nothing written.
    for (body, want) in [
        ("[train]\nlr = -1.0\n", "[train]: lr -1: expected a positive number"),
        ("[train]\ngrowth_interval = 0\n", "growth_interval 0"),
        ("[train]\naccumulate = 0\n", "accumulate 0: expected a positive count of micro-batches"),
        ("[train]\nmin_scale = 8.0\nmax_scale = 2.0\n", "min_scale 8 is above max_scale 2"),
        ("[train]\nlearning_rate = 0.1\n", "unknown field `learning_rate`"),
    ] {
        std::fs::write(&config, body).unwrap();
        let _ = std::fs::remove_file(&out);
        let o = common::mpc(&[
            "compile",
            "tests/models/mlp.onnx",
            "--policy",
            "mixed",
            "--train",
            "--config",
            config.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{body}: {stderr}");
        assert!(stderr.contains(want) && stderr.contains("policy.toml"), "{body}: {stderr}");
        assert!(!out.exists());
    }
}

#[test]
fn clipping_bounds_the_global_gradient_norm() {
    // One SGD step with lr 1 moves the weights by exactly the (clipped) gradient: with a norm
    // cap far below the gradient's norm, the step's length is the cap.
    let dir = scratch("clip");
    let (model, data) = common::regression(&dir, 0.0, 0.5, 64, None);
    let cfg = TrainConfig { data: vec![data], epochs: 1, batch: 64, max_steps: Some(1), ..Default::default() };
    for (policy, cap) in [("fp32", 1e-3f32), ("mixed", 1e-3), ("fp32", 1e6)] {
        let t = run(&model, policy, TrainOptions { clip_norm: Some(cap), ..sgd(1.0) }, &cfg);
        let w = t.state.iter().find(|(n, _)| n == "w").unwrap().1.f64s();
        let step = w.iter().map(|x| x * x).sum::<f64>().sqrt();
        println!("clip {policy} cap {cap:e}: step length {step:.4e}");
        if cap < 1.0 {
            assert!((step - cap as f64).abs() < 1e-3 * cap as f64, "{policy}: step {step} vs cap {cap}");
        } else {
            assert!(step > 1e-2, "an uncapped step is the gradient itself: {step}");
        }
    }
}

#[test]
fn inference_mode_batch_norm_trains_as_in_training_mode() {
    // torch.onnx exports BatchNormalization in inference mode by default. The train-mode pass
    // switches it to batch statistics with running statistics as state, which must give the very
    // step of the same model exported in training mode.
    let dir = scratch("bn_mode");
    let mut g = mpc::load(&fixture("cnn_bn")).unwrap();
    let x = g.find("x").unwrap();
    g.rename(x, "images");
    let trained_mode = dir.join("cnn_train_mode.onnx");
    mpc::save(&g, &trained_mode, mpc::Format::Onnx).unwrap();
    let printed = mpc_ir::text::print(&g, mpc_ir::text::TensorMode::FILE).unwrap();
    let mut text = printed.text.clone();
    for bn in ["bn1", "bn2"] {
        let line = text.lines().find(|l| l.contains(&format!("\"{bn}_out\""))).unwrap().to_string();
        let (outs, rest) = line.split_once(" = ").unwrap();
        let y = outs.split(", ").next().unwrap();
        let inference = format!("{y} = {}", rest.replace("[training_mode=1]", ""));
        text = text.replace(&line, &inference);
    }
    let out_line = text.lines().find(|l| l.trim_start().starts_with("output ")).unwrap().to_string();
    text = text.replace(&out_line, out_line.split(", ").next().unwrap());
    let inference = mpc_ir::text::parse(&text, Some(&printed.sidecar)).unwrap();
    assert!(inference
        .node_ids()
        .any(|n| matches!(&inference.node(n).op, Op::BatchNormalization(a) if !a.training_mode)));
    let inference_mode = dir.join("cnn_inference_mode.onnx");
    mpc::save(&inference, &inference_mode, mpc::Format::Onnx).unwrap();

    let cfg = TrainConfig { max_steps: Some(20), ..digits_cfg(1) };
    let a = run(&trained_mode, "mixed", TrainOptions::default(), &cfg);
    let b = run(&inference_mode, "mixed", TrainOptions::default(), &cfg);
    assert_eq!(a.losses, b.losses);
    let stats = |t: &Trained| t.state.iter().filter(|(n, _)| n.contains("running")).cloned().collect::<Vec<_>>();
    assert_eq!(stats(&a).len(), 4);
    assert_eq!(stats(&a), stats(&b), "running statistics");
    assert!(
        stats(&b).iter().any(|(_, t)| t.f64s().iter().any(|&v| v != 0.0 && v != 1.0)),
        "the running statistics moved"
    );
    println!("inference-mode BN: 20 steps equal to the training-mode export's, bit for bit");
}

#[test]
fn additive_masks_are_buffers_not_parameters() {
    use mpc_passes::train::is_additive_mask;
    let mask = Tensor::from_f32(vec![2, 2], &[0.0, -1e9, 0.0, 0.0]);
    assert!(is_additive_mask(&mask));
    assert!(is_additive_mask(&Tensor::from_f32(vec![2], &[f32::NEG_INFINITY, 0.0])));
    // A zero-initialised bias, or a weight with one large negative value, is a parameter.
    assert!(!is_additive_mask(&Tensor::from_f32(vec![3], &[0.0; 3])));
    assert!(!is_additive_mask(&Tensor::from_f32(vec![2], &[-1e9, 0.5])));
    // The transformer fixture's causal mask is added to the attention scores, yet not trained.
    let g = training_graph(&fixture("transformer"), "mixed", TrainOptions::default());
    let state: Vec<&str> = state_of(&g).iter().map(|&(s, _)| g.name(s)).collect();
    assert!(state.iter().all(|s| !s.contains("causal_mask")), "{state:?}");
    assert!(state.contains(&"attn.q.weight"));
}

#[test]
fn the_train_signature_survives_onnx_and_text_ir_and_nothing_else_leaks() {
    let g = training_graph(&fixture("mlp"), "mixed", TrainOptions::default());
    let sig = g.train.as_ref().expect("a training graph");
    assert!(!sig.grads.is_empty() && sig.scaled_loss.is_some() && sig.loss_scale.is_some());
    let names = |g: &Graph| {
        let t = g.train.as_ref().expect("a signature");
        let n = |v: Option<mpc_ir::ValueId>| v.map(|v| g.name(v).to_string());
        let state: Vec<(String, String)> =
            t.state.iter().map(|&(s, x)| (g.name(s).to_string(), g.name(x).to_string())).collect();
        (n(t.loss), n(t.skipped), n(t.loss_scale), state)
    };
    let want = names(&g);
    assert_eq!(want.1.as_deref(), Some("mpc.step_skipped"));
    assert_eq!(want.2.as_deref(), Some("mpc.loss_scale"));
    let onnx = mpc_ir::onnx::encode_onnx(&g).unwrap();
    let back = mpc_ir::onnx::decode_onnx(onnx.into(), None).unwrap();
    assert_eq!(names(&back), want);
    // The file holds the runtime's part only, and the metadata holds no copy of it once read.
    let keys: Vec<&str> = back.meta.metadata_props.iter().map(|(k, _)| k.as_str()).collect();
    assert!(keys.iter().all(|k| !k.starts_with("mpc.train")), "{keys:?}");
    let text = mpc_ir::text::print(&g, mpc_ir::text::TensorMode::FILE).unwrap();
    assert!(text.text.contains("mpc.train.state") && !text.text.contains("mpc.train.grads"));
    assert!(!text.text.contains("scaled_loss"));
    let parsed = mpc_ir::text::parse(&text.text, Some(&text.sidecar)).unwrap();
    assert_eq!(names(&parsed), want);
}

#[test]
fn a_signature_naming_an_undefined_value_is_refused() {
    let g = training_graph(&fixture("mlp"), "fp32", TrainOptions::default());
    let text = mpc_ir::text::print(&g, mpc_ir::text::TensorMode::FILE).unwrap();
    let bad = text.text.replace("fc1.weight -> fc1.weight.next", "fc1.weight -> nowhere");
    let e = mpc_ir::text::parse(&bad, Some(&text.sidecar)).unwrap_err().to_string();
    assert!(e.contains("mpc.train.state") && e.contains("`nowhere`"), "{e}");
}

/// A model exported with a fixed batch of 4 (its Reshape targets, a constant expanded to the
/// batch and its output say 4) trains at batch 3 with a short last batch; one whose batch is
/// built into a constant that differs per sample is refused in one line that says so.
#[test]
fn a_fixed_batch_export_trains_at_any_batch() {
    let dir = scratch("fixed_batch");
    let model = |bias: &str| {
        format!(
            "mpcir 1\nmodel ir_version=8\nopset \"\" 18\ngraph \"fixed\"
  input %0 \"x\": f32[4,8]
  init %1 \"w\" = f32[3,8]{{0.1, -0.2, 0.3, 0.1, 0.2, -0.1, 0.05, 0.3, -0.3, 0.1, 0.2, 0.1, -0.2, 0.3, 0.1, 0.1, 0.2, 0.1, -0.1, 0.3, 0.2, -0.2, 0.1, 0.05}}
  init %2 \"split\" = i64[3]{{4, 2, 4}}
  init %3 \"flat\" = i64[2]{{4, 8}}
  %5 \"h\": f32[4,2,4] = Reshape(%0, %2)
  %6 \"r\": f32[4,2,4] = Relu(%5)
  %7 \"f\": f32[4,8] = Reshape(%6, %3)
  %8 \"g\": f32[4,3] = Gemm[transB=1](%7, %1)
  %4 \"bias\": f32[4,3] = Constant[value={bias}]()
  %9 \"logits\": f32[4,3] = Add(%8, %4) @\"/bias/Add\"
  output %9
end
"
        )
    };
    let n = 10;
    let x: Vec<f32> = (0..n * 8).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
    let labels: Vec<i64> = (0..n as i64).map(|i| i % 3).collect();
    let data = dir.join("data.safetensors");
    mpc::run::write_safetensors(
        &data,
        &[
            ("x".into(), HostTensor::from_f32(DType::F32, vec![n, 8], x)),
            ("labels".into(), HostTensor::from_i64(DType::I64, vec![n], labels)),
        ],
    )
    .unwrap();
    let cfg = TrainConfig { data: vec![data], epochs: 3, batch: 3, ..Default::default() };
    let opts = options("fp32", TrainOptions { lr: 0.1, ..Default::default() });
    let path = dir.join("fixed.mpcir");
    // The same bias for every sample: a constant expanded to the export's batch.
    let g = mpc_ir::text::parse(&model("f32[4,3]{0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3}"), None)
        .unwrap();
    let t = train(&g, &path, &opts, &cfg, &mut |_| {}).unwrap();
    assert_eq!(t.losses.len(), 3 * 4, "3 epochs of batches 3, 3, 3, 1");
    assert!(t.losses.last().unwrap() < t.losses.first().unwrap(), "{:?}", t.losses);
    let g = mpc_ir::text::parse(&model("f32[4,3]{0.1, 0.2, 0.3, 0.4, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3}"), None)
        .unwrap();
    let e = train(&g, &path, &opts, &cfg, &mut |_| {}).err().expect("a per-sample constant pins the batch").to_string();
    assert!(e.contains("exported with a fixed batch of 4") && e.contains("`/bias/Add`"), "{e}");
    assert_eq!(e.lines().count(), 1, "{e}");
}

/// A tampered checkpoint is refused on `--resume` in one line: no or a bad iteration count,
/// nothing left to train, a bad or another global batch, a non-finite or out-of-bounds loss scale, a negative counter.
#[test]
fn resuming_checks_the_checkpoint() {
    let dir = scratch("resume_checks");
    let model = fixture("digits_mlp");
    let base = TrainConfig { checkpoint: Some(dir.clone()), max_steps: Some(3), ..digits_cfg(1) };
    run(&model, "mixed", TrainOptions::default(), &base);
    let file = dir.join("checkpoint.safetensors");
    let saved = mpc::run::read_safetensors(&file).unwrap();
    let counter = saved
        .iter()
        .find(|(k, t)| {
            k.starts_with("mpc.")
                && !["mpc.rng", "mpc.iteration", "mpc.global_batch"].contains(&k.as_str())
                && t.dtype() == DType::I64
        })
        .map(|(k, _)| k.clone())
        .expect("a step counter");
    let scalar_f32 = |x: f32| HostTensor::from_f32(DType::F32, vec![], vec![x]);
    let scalar_i64 = |x: i64| HostTensor::from_i64(DType::I64, vec![], vec![x]);
    let cases: Vec<(Option<(&str, HostTensor)>, &str)> = vec![
        (None, "no `mpc.iteration`"),
        (Some(("mpc.iteration", scalar_i64(-3))), "`mpc.iteration` is not a count of batches"),
        (Some(("mpc.iteration", scalar_i64(1 << 40))), "nothing is left to train"),
        (Some(("mpc.global_batch", scalar_i64(-64))), "`mpc.global_batch` is not a count of samples"),
        (Some(("mpc.global_batch", scalar_i64(128))), "resume with --global-batch 128"),
        (Some(("mpc.loss_scale", scalar_f32(f32::INFINITY))), "`mpc.loss_scale` holds inf"),
        (Some(("mpc.loss_scale", scalar_f32(1e-30))), "outside the dynamic scaling's bounds"),
        (Some((counter.as_str(), scalar_i64(-1))), "is -1: counters are never negative"),
    ];
    for (change, want) in cases {
        let mut tensors = saved.clone();
        match &change {
            None => {
                tensors.remove("mpc.iteration");
            }
            Some((k, t)) => {
                tensors.insert(k.to_string(), t.clone());
            }
        }
        let list: Vec<(String, HostTensor)> = tensors.into_iter().collect();
        mpc::run::write_safetensors(&file, &list).unwrap();
        let g = mpc::load(&model).unwrap();
        let cfg = TrainConfig { resume: true, max_steps: Some(6), ..base.clone() };
        let err = train(&g, &model, &options("mixed", TrainOptions::default()), &cfg, &mut |_| {})
            .err()
            .unwrap_or_else(|| panic!("{want}: resumed"));
        let e = err.to_string();
        assert!(e.contains(want) && e.lines().count() == 1 && err.exit_code() == 2, "{want}: {e}");
    }
}
