//! Transformer exports lowered: ONNX's Attention op, equal folded constants, the parameters a
//! dynamo export merged, and the fused attention trained against its chain.

use super::*;

/// ONNX's Attention operator, expanded by `expand-attention`, computes what PyTorch's legacy
/// export of the same scaled_dot_product_attention computes: the tiny GPT (the same weights)
/// exported both ways gives the same fp32 loss on the same inputs.
#[test]
fn the_onnx_attention_op_computes_the_exported_chain() {
    let loss = |model: &str| {
        let path = fixture(model);
        let mut g = mpc::load(&path).unwrap();
        mpc::compile(&mut g, &path, &mpc::Options::default(), &mut |_, _| {}).unwrap();
        let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
        let inputs = mpc::run::random_inputs(&bound, 3, &dims()).unwrap();
        let out = mpc::run::run_once(&bound, &inputs, &path).unwrap();
        (out.into_iter().find(|(n, _)| n == "loss").unwrap().1.f64s()[0], g)
    };
    let ((chain, _), (op, g)) = (loss("tiny_gpt_sdpa_loss"), loss("tiny_gpt_attention23_loss"));
    // Expanded: no Attention node is left opaque.
    assert!(!g.node_ids().any(|n| matches!(&g.node(n).op, mpc_ir::Op::Opaque(_))));
    println!("tiny GPT loss: {chain} as the exported chain, {op} as one ONNX Attention node");
    assert!((chain - op).abs() <= 1e-6 * chain.abs(), "loss {op} where the exported chain gives {chain}");
}

/// A value lowering folds that equals one folded before shares its bytes in the constants region:
/// the scaled_dot_product_attention export builds its causal mask from shapes in every layer, and
/// the two layers' masks are one constant.
#[test]
fn equal_folded_values_are_one_constant() {
    for (model, policy, train) in [("tiny_gpt_sdpa_loss", "fp32", false), ("tiny_gpt_sdpa_loss", "mixed", true)] {
        let p = cpu_lowered(model, policy, train, Default::default());
        let mut seen: Vec<(&TensorRef, &mpc_ir::Tensor)> = Vec::new();
        for (r, t) in &p.constants {
            let twin = seen.iter().find(|(s, u)| s.dtype == r.dtype && s.shape == r.shape && u.bytes() == t.bytes());
            assert!(
                twin.is_none(),
                "{model} {policy}: {:?} at {} and {} hold the same bytes",
                r.shape,
                r.offset,
                twin.unwrap().0.offset
            );
            seen.push((r, t));
        }
        // Both layers read the one causal mask.
        let masks = p.constants.iter().filter(|(r, _)| r.shape == [16, 16]).count();
        assert_eq!(masks, 1, "{model} {policy}: {:?}", p.constants.iter().map(|c| &c.0.shape).collect::<Vec<_>>());
    }
}

/// torch.onnx's dynamo exporter keeps one initializer for equal tensors, so the opset-23 tiny GPT
/// (freshly initialised: every LayerNorm scale is ones, every shift zeros) has its five LayerNorms
/// read `blocks.0.ln1.weight` and `blocks.0.ln1.bias`. Imported, they are ten parameters again,
/// named as in the module, and an fp32 SGD step updates each as the legacy export of the same
/// weights (which keeps them apart) does; trained as one, the five would take the sum of their
/// gradients.
#[test]
fn merged_parameters_of_a_dynamo_export_train_apart() {
    use mpc_passes::train::{Loss, Optimizer, TrainOptions};
    let step = |model: &str| {
        let path = fixture(model);
        let mut g = mpc::load(&path).unwrap();
        mpc::train::free_batch(&mut g);
        let train = TrainOptions {
            loss: Loss::Output("loss".into()),
            optimizer: Optimizer::Sgd,
            lr: 0.1,
            ..Default::default()
        };
        let opts = mpc::Options { policy: Some("fp32".into()), train: Some(train), ..Default::default() };
        mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
        let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
        let caps = mpc_runtime::device::CpuDevice::default().caps();
        let program = mpc_runtime::program::lower(&bound, caps, Default::default()).unwrap();
        let names: Vec<String> = program.state.iter().map(|s| s.name.clone()).collect();
        let mut s = Session::new(mpc_runtime::device::CpuDevice::default(), program).unwrap();
        let before: Vec<HostTensor> = names.iter().map(|n| s.read_state(n).unwrap()).collect();
        s.feed(0, &mpc::run::random_inputs(&bound, 5, &dims()).unwrap()).unwrap();
        s.step(0).unwrap();
        let mut updates = HashMap::new();
        for (n, w0) in names.iter().zip(&before) {
            if w0.shape.len() == 1 {
                let w = s.read_state(n).unwrap();
                updates.insert(n.clone(), w.f64s().iter().zip(w0.f64s()).map(|(a, b)| a - b).collect::<Vec<f64>>());
            }
        }
        updates
    };
    let (legacy, dynamo) = (step("tiny_gpt_sdpa_loss"), step("tiny_gpt_attention23_loss"));
    let norms = ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2", "ln"];
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    for p in norms.iter().flat_map(|n| [format!("{n}.weight"), format!("{n}.bias")]) {
        let (a, b) =
            (&legacy[&p], dynamo.get(&p).unwrap_or_else(|| panic!("the dynamo export has no parameter `{p}`")));
        let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        let e = norm(&diff) / norm(a);
        assert!(norm(a) > 0.0 && e <= 1e-4, "`{p}`'s update differs by {e:.2e} (relative L2) from the legacy export's");
    }
    // The biases the exporter kept apart (random, so unequal) are the same parameters too.
    assert_eq!(dynamo.len(), legacy.len(), "{:?} against {:?}", dynamo.keys(), legacy.keys());
}

/// `--fused-attention` trains the GPT-shaped fixtures as their unfused attention chains do: the two
/// chains become Attention and AttentionGrad launches (no Softmax is left), and a mixed (and a
/// mixed-bf16) SGD step on the CPU from the same weights and inputs gives the same loss and the
/// same update of every weight within the low dtype's rounding (the fused scores are summed in
/// f32, not rounded to the low dtype first).
#[test]
fn fused_attention_trains_as_the_unfused_chain() {
    use mpc_passes::train::{Loss, Optimizer, TrainOptions};
    // The tiny GPT with its attention as its steps, and with F.scaled_dot_product_attention
    // (is_causal) as PyTorch exports it, by the legacy exporter as its steps and by the dynamo
    // exporter at opset 23 as one ONNX Attention node (expanded by `expand-attention`): that chain also rounds Q·√s and Kᵀ·√s to the low dtype
    // before its product, which the fused node does not, so the two steps' roundings differ more
    // (measured against an fp32 step from the same weights, the fused and unfused mixed steps'
    // updates are within 3.7e-3 and 2.3e-3 of it, mixed-bf16 within 2.3e-2 and 1.6e-2).
    for (model, policy, rel_l2) in [
        ("tiny_gpt_loss", "mixed", 2e-3),
        ("tiny_gpt_loss", "mixed-bf16", 1.5e-2),
        ("tiny_gpt_sdpa_loss", "mixed", 5e-3),
        ("tiny_gpt_sdpa_loss", "mixed-bf16", 5e-2),
        ("tiny_gpt_attention23_loss", "mixed", 5e-3),
        ("tiny_gpt_attention23_loss", "mixed-bf16", 5e-2),
    ] {
        let label = format!("{model} {policy}");
        let build = |fused: bool| {
            let path = fixture(model);
            let mut g = mpc::load(&path).unwrap();
            mpc::train::free_batch(&mut g);
            let loss = Loss::Output("loss".into());
            let train = Some(TrainOptions { loss, optimizer: Optimizer::Sgd, lr: 0.1, ..TrainOptions::default() });
            let opts =
                mpc::Options { policy: Some(policy.into()), train, fused_attention: fused, ..Default::default() };
            mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let caps = mpc_runtime::device::CpuDevice::default().caps();
            (mpc_runtime::program::lower(&bound, caps, Default::default()).unwrap(), bound)
        };
        let ((fused, bound), (plain, _)) = (build(true), build(false));
        let count = |p: &Program, kind: &str| p.launches.iter().filter(|l| l.kind() == kind).count();
        assert_eq!((count(&fused, "Attention"), count(&fused, "AttentionGrad")), (2, 2), "{label}");
        assert_eq!(count(&plain, "Attention") + count(&fused, "Softmax") + count(&fused, "SoftmaxGrad"), 0, "{label}");
        // The heads are read and written where the projections put them: no Transpose of them.
        assert_eq!(count(&fused, "Transpose"), 0, "{label}");
        assert!(fused.launches.len() < plain.launches.len(), "{label}");
        let state: Vec<String> = fused.state.iter().map(|s| s.name.clone()).collect();
        let mut s = [fused, plain].map(|p| Session::new(mpc_runtime::device::CpuDevice::default(), p).unwrap());
        // The matrices (and their low copies) 4 times larger: the exported initial weights score
        // every key alike, so that the attention would hardly depend on its scores.
        for n in &state {
            let w = s[1].read_state(n).unwrap();
            if w.shape.len() >= 2 {
                let big = HostTensor::from_f64(w.dtype(), w.shape.clone(), w.f64s().iter().map(|x| 4.0 * x).collect());
                s.iter_mut().for_each(|x| x.write_state(n, &big).unwrap());
            }
        }
        let inputs = mpc::run::random_inputs(&bound, 11, &dims()).unwrap();
        let (updated, worst) = common::training::compare_one_step(&label, &mut s, &state, &inputs, rel_l2);
        assert!(updated >= 20, "{label}: {updated} weights updated");
        println!("{label}: {updated} weights' updates within {worst:.2e} (relative L2) of the unfused step's");
    }
}
