//! The arena of a lowered program never lets two values that are alive at once share bytes, and
//! mixed precision shrinks it.

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_ir::Op;
use mpc_runtime::program::{Launch, Operand, Program, Region, TensorRef};

/// The fixture's program under `policy` at `batch`.
fn program(name: &str, policy: &str, batch: u64) -> Program {
    let path = fixture(name);
    let mut g = mpc::load(&path).unwrap();
    let opts = mpc::Options { policy: Some(policy.into()), ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    let dims: HashMap<String, u64> = [("batch".to_string(), batch)].into();
    mpc::run::memory_plan(&g, &path, &dims).unwrap().0
}

/// Every launch, the branches of an `If` after it, in the order a step may run them.
fn flat(launches: &[Launch]) -> Vec<&Launch> {
    let mut out = Vec::new();
    for l in launches {
        out.push(l);
        if let Some(b) = &l.branches {
            out.extend(flat(&b.then_launches));
            out.extend(flat(&b.else_launches));
        }
    }
    out
}

/// A place in the arena (offset, bytes), and the steps over which a value lives there: the step
/// that writes it and the last that reads it.
type Life = ((u64, u64), (usize, usize));

/// The arena places (offset, bytes) one step reads, and those it writes.
type Places = (Vec<(u64, u64)>, Vec<(u64, u64)>);

/// The values of `p`'s arena and their lives, from what each step reads and writes (`steps`: the
/// places each reads, those it writes), not from the lowering's own record. A write to a place
/// starts a new value there unless the same step reads that place (an output written in place
/// over its input). Inputs are written before the first step, outputs read after the last.
fn lives(p: &Program, steps: &[Places], label: &str) -> Vec<Life> {
    let end = steps.len();
    let mut life: Vec<Life> = Vec::new();
    let mut current: HashMap<(u64, u64), usize> = HashMap::new();
    for (_, t) in &p.inputs {
        current.insert((t.offset, t.bytes()), life.len());
        life.push(((t.offset, t.bytes()), (0, 0)));
    }
    for (i, (reads, writes)) in steps.iter().enumerate() {
        for k in reads {
            let e = *current.get(k).unwrap_or_else(|| panic!("{label}: step {i} reads {k:?}, never written"));
            life[e].1 .1 = life[e].1 .1.max(i);
        }
        for &k in writes {
            if !reads.contains(&k) || !current.contains_key(&k) {
                current.insert(k, life.len());
                life.push((k, (i, i)));
            }
        }
    }
    for (_, t) in p.outputs.iter().filter(|(_, t)| t.region == Region::Arena) {
        let e = current[&(t.offset, t.bytes())];
        life[e].1 .1 = end;
    }
    life
}

/// The arena places `l` reads (an epilogue's second operand, a bias, and a prologue's ReLU
/// output among them) and writes.
fn places(l: &Launch) -> Places {
    let arena = |t: &TensorRef| (t.region == Region::Arena).then_some((t.offset, t.bytes()));
    let parts = l.parts();
    // A ReLU mask is written by the ReLU's launch and read by its gradient's.
    let (mask_read, mask_written): (Vec<_>, Vec<_>) =
        parts.iter().filter_map(|m| Some((m.relu_mask.as_ref()?, m.epilogue == Some(Op::ReluGrad)))).partition(|m| m.1);
    let reads = parts
        .iter()
        .flat_map(|m| m.operands())
        .filter_map(|o| arena(o.tensor()?))
        .chain(mask_read.into_iter().filter_map(|m| arena(m.0)));
    let writes = parts
        .iter()
        .flat_map(|m| &m.outputs)
        .filter_map(arena)
        .chain(mask_written.into_iter().filter_map(|m| arena(m.0)));
    (reads.collect(), writes.collect())
}

/// The fixture's inference program under each policy at batch 8, and its training step where it
/// trains, each with its label.
fn programs(name: &str) -> Vec<(String, Program)> {
    let dims: HashMap<String, u64> = [("batch".to_string(), 8)].into();
    let mut out = Vec::new();
    for policy in ["fp32", "mixed", "mixed-bf16"] {
        out.push((format!("{name}/{policy}"), program(name, policy, 8)));
        if let Ok(g) = common::compiled(name, policy, true) {
            let step = mpc::run::memory_plan(&g, &fixture(name), &dims).unwrap().0;
            out.push((format!("{name}/{policy} training"), step));
        }
    }
    out
}

#[test]
fn live_values_never_overlap_in_the_arena() {
    let mut training = 0;
    for name in FIXTURES {
        for (label, p) in programs(name) {
            training += usize::from(label.ends_with("training"));
            let steps: Vec<_> = flat(&p.launches).into_iter().map(places).collect();
            let bufs = lives(&p, &steps, &label);
            for (i, &((oa, ba), (da, la))) in bufs.iter().enumerate() {
                assert!(oa + ba <= p.arena_bytes, "{label}: a buffer past the arena");
                for &((oc, bc), (dc, lc)) in &bufs[i + 1..] {
                    let bytes_overlap = oa < oc + bc && oc < oa + ba;
                    // Alive together, except for an in-place hand-over at the step the input dies.
                    let alive_together = da < lc && dc < la;
                    assert!(
                        !(bytes_overlap && alive_together),
                        "{label}: [{oa}, +{ba}) live [{da}, {la}] and [{oc}, +{bc}) live [{dc}, {lc}] share bytes"
                    );
                }
            }
        }
    }
    assert!(training >= 6, "{training} training programs checked");
}

/// The bytes `Program::free_during` offers a launch as scratch (cuDNN's, on CUDA) hold no value
/// alive during it, by the lives each launch's operands give: for every launch of every fixture,
/// and the bytes are there to take where the arena has room.
#[test]
fn the_free_bytes_during_a_launch_hold_no_live_value() {
    let mut offered = 0;
    for name in FIXTURES {
        for (label, p) in programs(name) {
            // One step per launch of the program, an `If` reading and writing what its branches do.
            let steps: Vec<_> = p
                .launches
                .iter()
                .map(|l| {
                    let (mut reads, mut writes) = places(l);
                    let branches = l
                        .branches
                        .iter()
                        .flat_map(|b| flat(&b.then_launches).into_iter().chain(flat(&b.else_launches)));
                    for b in branches {
                        let (r, w) = places(b);
                        // What a branch reads of its own values is no read of the program's.
                        reads.extend(r.into_iter().filter(|k| !writes.contains(k)));
                        writes.extend(w);
                    }
                    (reads, writes)
                })
                .collect();
            let bufs = lives(&p, &steps, &label);
            for i in 0..p.launches.len() {
                let (at, bytes) = p.free_during(i);
                assert!(at + bytes <= p.arena_bytes, "{label}: launch {i}'s free bytes past the arena");
                offered += u64::from(bytes > 0);
                for &((o, b), (first, last)) in &bufs {
                    assert!(
                        !(o < at + bytes && at < o + b && first <= i && i <= last),
                        "{label}: launch {i} ({}) is offered [{at}, +{bytes}), where [{o}, +{b}) lives over [{first}, {last}]",
                        p.launches[i].node
                    );
                }
            }
        }
    }
    assert!(offered > 400, "free bytes offered to {offered} launches only");
}

#[test]
fn mixed_activations_are_at_most_six_tenths_of_fp32() {
    for name in ["cnn_bn", "transformer"] {
        let (mixed, fp32) = (program(name, "mixed", 64).arena_bytes, program(name, "fp32", 64).arena_bytes);
        let ratio = mixed as f64 / fp32 as f64;
        println!("{name}: the arena at batch 64, mixed {mixed} B, fp32 {fp32} B: {ratio:.3}x");
        assert!(ratio <= 0.6, "{name}: mixed / fp32 = {ratio}");
    }
}

/// The training step of `tests/models/tiny_gpt_loss.onnx` (a GPT-2-shaped model with its loss
/// inside and no other output, as `benches/memory_plan.py --tiny` builds it: vocabulary 128,
/// 2 layers of width 32, 2 heads, 16 tokens) under `policy`, lowered at batch 4.
fn gpt_step(policy: &str) -> (mpc_ir::Graph, Program) {
    use mpc_passes::train::{Loss, TrainOptions};
    let path = fixture("tiny_gpt_loss");
    let mut g = mpc::load(&path).unwrap();
    let t = TrainOptions { loss: Loss::Output("loss".into()), ..TrainOptions::default() };
    let opts = mpc::Options { policy: Some(policy.into()), train: Some(t), ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
    let dims: HashMap<String, u64> = [("batch".to_string(), 4)].into();
    let p = mpc::run::memory_plan(&g, &path, &dims).unwrap().0;
    (g, p)
}

#[test]
fn mixed_training_keeps_no_f32_copy_of_the_logits_or_the_probabilities() {
    use mpc_ir::{DType, Op};
    let (logits, probs): (&[usize], &[usize]) = (&[64, 128], &[4, 2, 16, 16]);
    for policy in ["mixed", "mixed-bf16"] {
        let (g, p) = gpt_step(policy);
        let low = if policy == "mixed" { DType::F16 } else { DType::BF16 };
        // The forward loss reads the low logits widened: their f32 Cast is not launched.
        let loss = p.launches.iter().find(|l| matches!(l.op, Op::SoftmaxCrossEntropyLoss(_))).unwrap();
        assert!(
            matches!(&loss.inputs[0], Operand::Widened(t) if t.dtype == low && t.shape == logits),
            "{policy}: {:?}",
            loss.inputs[0]
        );
        // So do the 2 SoftmaxGrads, both of their dy and y (f32 Casts of the f16 or bf16 values),
        // and the 5 LayerNormalizationGrads their dy (the gradient of the Cast after each f32
        // layer norm). The layer norms write their outputs low: their Casts to f16 or bf16 are not
        // launched either.
        assert_eq!(p.widened, 5 + 5, "{policy}");
        let casts = p.launches.iter().filter(|l| matches!(l.epilogue, Some(Op::Cast(_)))).count();
        assert_eq!(casts, 5, "{policy}");
        let ln = |l: &&Launch| matches!(l.op, Op::LayerNormalization(_));
        let lng = |l: &&Launch| matches!(l.op, Op::LayerNormalizationGrad(_));
        assert_eq!((p.launches.iter().filter(ln).count(), p.launches.iter().filter(lng).count()), (5, 5));
        for l in p.launches.iter().filter(ln) {
            let Operand::Device(x) = &l.inputs[0] else { panic!("{policy}: {}", l.node) };
            assert_eq!((x.dtype, l.outputs[0].dtype), (DType::F32, low), "{policy}: {}", l.node);
            assert!(matches!(l.epilogue, Some(Op::Cast(_))), "{policy}: {}", l.node);
        }
        for l in p.launches.iter().filter(lng) {
            assert!(matches!(&l.inputs[0], Operand::Widened(t) if t.dtype == low), "{policy}: {}", l.node);
        }
        for l in p.launches.iter().filter(|l| matches!(l.op, Op::SoftmaxGrad(_))) {
            let low_in = |o: &Operand| matches!(o, Operand::Widened(t) if t.dtype == low && t.shape == probs);
            assert!(low_in(&l.inputs[0]) && low_in(&l.inputs[1]), "{policy}: {}: {:?}", l.node, l.inputs);
            assert_eq!(l.outputs[0].dtype, DType::F32);
        }
        // Its gradient is written low; the softmax's gradient reads the probabilities' low copy.
        let grad = p.launches.iter().find(|l| matches!(l.op, Op::SoftmaxCrossEntropyLossGrad(_))).unwrap();
        assert_eq!(grad.outputs[0].dtype, low, "{policy}");
        for n in g.node_ids().filter(|&n| matches!(g.node(n).op, Op::SoftmaxGrad(_))) {
            let y = g.node(n).input(1).unwrap();
            let (m, _) = g.value(y).producer().unwrap();
            let from = g.node(m).input(0).unwrap();
            assert!(matches!(g.node(m).op, Op::Cast(_)) && g.ty(from).dtype == Some(low), "{policy}: {}", g.name(y));
        }
        // No f32 logits or loss gradient anywhere in the arena, and no f32 scores or
        // probabilities kept from the forward pass for the backward one (the forward computes
        // them in f32 on the way to the softmax, the backward widens them for SoftmaxGrad).
        let backward = p.launches.iter().position(|l| l.node.contains(".grad.")).unwrap();
        for b in &p.buffers {
            for (_, name, _, shape) in b.values.iter().filter(|v| v.2 == DType::F32) {
                assert!(shape != logits, "{policy}: `{name}` is f32{shape:?}");
                let kept = b.first < backward && b.last >= backward;
                assert!(!(shape == probs && kept), "{policy}: `{name}` (f32{shape:?}) is kept for the backward pass");
            }
        }
    }
}

#[test]
fn the_forward_runs_before_the_backward_and_the_peak_is_what_it_holds() {
    for policy in ["fp32", "mixed"] {
        let (_, p) = gpt_step(policy);
        // The forward loss is launched before any gradient (a node added later never takes the
        // index of one removed earlier, among the forward's).
        let at = |f: &dyn Fn(&Launch) -> bool| p.launches.iter().position(f).unwrap();
        let loss = at(&|l| matches!(l.op, mpc_ir::Op::SoftmaxCrossEntropyLoss(_)));
        let first_grad = at(&|l| l.node.contains(".grad."));
        assert!(loss < first_grad, "{policy}: the loss at launch {loss}, a gradient at {first_grad}");
        // The placed arena holds what is alive at its peak, with no gap on this model.
        let peak = p.peak_live();
        assert_eq!(peak.values.iter().map(|v| v.3).sum::<u64>(), peak.bytes);
        assert!(peak.bytes <= p.arena_bytes, "{policy}");
        assert!(peak.bytes * 10 >= p.arena_bytes * 9, "{policy}: {} of {}", peak.bytes, p.arena_bytes);
    }
    let (fp32, mixed) = (gpt_step("fp32").1.arena_bytes, gpt_step("mixed").1.arena_bytes);
    println!("tiny GPT training step at batch 4: the arena, mixed {mixed} B, fp32 {fp32} B");
    assert!(mixed * 10 <= fp32 * 7, "mixed {mixed} B, fp32 {fp32} B");
}

/// The tiny GPT writes its Linears as PyTorch exports them, `MatMul(x, Transpose(W))` + bias:
/// the training step launches no Transpose of a weight or of a weight's gradient. Each forward
/// product reads its weight transposed and adds its bias as it writes; each input gradient reads
/// the weight as stored (a Gemm without `transB`), each weight gradient is one Gemm that writes it
/// as stored (`dYᵀ X`).
#[test]
fn a_weights_transpose_is_read_by_its_products_not_launched() {
    use mpc_ir::ops::GemmAttrs;
    for policy in ["fp32", "mixed"] {
        let (_, p) = gpt_step(policy);
        let moves: Vec<&str> =
            p.launches.iter().filter(|l| matches!(l.op, Op::Transpose(_))).map(|l| l.node.as_str()).collect();
        assert!(moves.is_empty(), "{policy}: {moves:?}");
        // 2 layers of 4 Linears, and the LM head (no bias).
        let forward: Vec<&Launch> = p
            .launches
            .iter()
            .filter(|l| {
                l.op == Op::MatMul && matches!(l.inputs.get(1), Some(Operand::Transposed(w)) if w.shape.len() == 2)
            })
            .collect();
        assert_eq!(forward.len(), 9, "{policy}");
        // Under mixed, the projections back to the f32 residual stream add their biases in f32
        // with the residual, in one chain after the product.
        let biased = if policy == "fp32" { 8 } else { 4 };
        assert_eq!(forward.iter().filter(|l| l.epilogue == Some(Op::Add)).count(), biased, "{policy}");
        let gemm = |l: &&Launch, ta: bool, tb: bool| matches!(l.op, Op::Gemm(GemmAttrs { transA, transB, .. }) if transA == ta && transB == tb);
        let grads = |ta, tb| p.launches.iter().filter(|l| l.node.contains(".grad.") && gemm(l, ta, tb)).count();
        // The input gradients of all 9 (the first layer's too: its input is the layer norm's) and
        // the 9 weight gradients; none reads an operand transposed by a flag pair of its own.
        assert_eq!((grads(false, false), grads(true, false), grads(false, true)), (9, 9, 0), "{policy}");
        // Each weight gradient is launched right after its layer's input gradient (not where the
        // forward's Transpose of the weight was, before everything: that kept every layer's dY
        // and X to the end of the backward pass).
        for (i, l) in p.launches.iter().enumerate().filter(|(_, l)| l.node.contains(".grad.") && gemm(l, true, false)) {
            assert!(gemm(&&p.launches[i - 1], false, false), "{policy}: `{}` at launch {i}", l.node);
        }
    }
}

/// A step's traffic counts each tensor a launch reads or writes once, a gather's table by the
/// rows it takes, and the FLOPs of its matrix products, an operand read transposed included.
#[test]
fn traffic_counts_what_each_launch_must_move() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"a\": f32[8,4]\n  \
                input %1 \"b\": f32[8,16]\n  input %2 \"i\": i64[3]\n  input %3 \"e\": f16[100,8]\n  \
                %4 \"at\": f32[4,8] = Transpose(%0)\n  %5 \"y\": f32[4,16] = MatMul(%4, %1)\n  \
                %6 \"r\": f32[4,16] = Relu(%5)\n  %7 \"s\": f32[4,16] = Add(%6, %6)\n  \
                %8 \"g\": f16[3,8] = Gather(%3, %2)\n  output %7\n  output %8\nend\n";
    let g = mpc_ir::text::parse(text, None).unwrap();
    let caps = mpc_runtime::device::Device::caps(&mpc_runtime::device::CpuDevice::default());
    let opts = mpc_runtime::program::LowerOptions { unfused: true, ..Default::default() };
    let p = mpc_runtime::program::lower(&g, caps, opts).unwrap();
    let t = p.traffic();
    let kinds: Vec<(&str, usize, u64, u64, u64)> =
        t.kinds.iter().map(|k| (k.kind.as_str(), k.launches, k.read, k.written, k.flops)).collect();
    // MatMul: a (8×4, read transposed) and b, 2·4·16·8 FLOPs; Add reads its one input once; the
    // Gather reads 3 rows of 8 halves and 3 indices.
    assert_eq!(
        kinds,
        [
            ("MatMul f32", 1, (32 + 128) * 4, 64 * 4, 1024),
            ("Add", 1, 64 * 4, 64 * 4, 0),
            ("Relu", 1, 64 * 4, 64 * 4, 0),
            ("Gather", 1, 3 * 8 * 2 + 3 * 8, 3 * 8 * 2, 0),
        ]
    );
    assert_eq!((t.launches, t.read, t.written), (4, 640 + 256 + 256 + 72, 256 * 3 + 48));
    assert_eq!(t.flops.get(&mpc_ir::DType::F32), Some(&1024));
}
