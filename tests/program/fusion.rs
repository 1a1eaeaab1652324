//! What fusion promises: element-wise runs, epilogues and in-place gradients write what is read
//! after them and give the unfused bits; no launch touches the arena bytes free during it.

use super::*;

/// A residual block whose input is a Relu's output (ResNet's, between blocks): in the backward
/// pass the two gradients meeting at the block's input (a Sum of two) and the Relu's gradient are
/// one launch, and the step computes the unfused program's bits, under each policy.
pub(crate) fn residual_gradients_and_the_relu_gradient_are_one_launch<D: Device>(device: impl Fn() -> D) {
    let w = |name: &str, rows: usize, seed: usize| {
        let v: Vec<String> =
            (0..rows * 8).map(|i| format!("{:.3}", ((i * 37 + seed * 11) % 29) as f32 / 58.0 - 0.25)).collect();
        format!("init %{seed} \"{name}\" = f32[{rows},8]{{{}}}", v.join(", "))
    };
    let text = format!(
        "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"res\"\n  input %0 \"x\": f32[batch,8]\n  {}\n  {}\n  {}\n  \
         %4 \"a\": f32[batch,8] = Gemm[transB=1](%0, %1)\n  %5 \"h\": f32[batch,8] = Relu(%4)\n  \
         %6 \"b\": f32[batch,8] = Gemm[transB=1](%5, %2)\n  %7 \"s\": f32[batch,8] = Add(%6, %5)\n  \
         %8 \"r\": f32[batch,8] = Relu(%7)\n  %9 \"logits\": f32[batch,3] = Gemm[transB=1](%8, %3)\n  output %9\nend\n",
        w("w1", 8, 1),
        w("w2", 8, 2),
        w("w3", 3, 3)
    );
    let path = common::scratch("residual_relu").join("res.mpcir");
    std::fs::write(&path, text).unwrap();
    let mut bad = Vec::new();
    for policy in ["fp32", "mixed", "mixed-bf16"] {
        let mut g = mpc::load(&path).unwrap();
        let t = mpc_passes::train::TrainOptions::default();
        let opts = mpc::Options { policy: Some(policy.into()), train: Some(t), ..Default::default() };
        mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
        let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
        let caps = device().caps();
        let lowered = |unfused| {
            mpc_runtime::program::lower(
                &bound,
                caps,
                // The products' library fusions are summed in another order on a GPU.
                mpc_runtime::program::LowerOptions { unfused, bitwise: caps.name != "cpu", ..Default::default() },
            )
            .unwrap()
        };
        let (fused, plain) = (lowered(false), lowered(true));
        let kinds: Vec<String> = fused.launches.iter().map(|l| l.kind()).collect();
        assert!(kinds.iter().any(|k| k.ends_with("Sum+ReluGrad)")), "{policy}: {kinds:?}");
        let state: Vec<String> = fused.state.iter().map(|s| s.name.clone()).collect();
        // The unfused program twice: its bits are the same from run to run.
        let mut s = [fused, plain.clone(), plain].map(|p| Session::new(device(), p).unwrap());
        for step in 0..2 {
            let inputs = mpc::run::random_inputs(&bound, 5 + step, &dims()).unwrap();
            for x in s.iter_mut() {
                x.feed(0, &inputs).unwrap();
                x.step(0).unwrap();
            }
        }
        for n in &state {
            let [x, y, z] = [0, 1, 2].map(|i| s[i].read_state(n).unwrap());
            bad.extend(differs(&y, &z, &format!("{policy} `{n}` after 2 steps, unfused run twice")));
            bad.extend(differs(&x, &y, &format!("{policy} `{n}` after 2 steps")));
        }
    }
    none_differ(&bad);
}

/// A dense layer's ReLU gradient in the backward pass is the epilogue of the product that makes
/// its dY (the next layer's input gradient), and shares a bit-mask with the ReLU's own product:
/// the same place, written before it is read, holding one bit per element in rows padded to 128
/// bits, and alive from the one launch to the other. Without the products' library fusions
/// (`bitwise`) there are no masks and the ReluGrads are launches again.
#[test]
fn a_relu_gradient_is_its_products_epilogue_and_shares_the_relus_bits() {
    use mpc_runtime::program::{relu_mask_bytes, LowerOptions};
    let p = cpu_lowered("mlp", "mixed", true, LowerOptions::default());
    let has = |l: &mpc_runtime::program::Launch, e: &mpc_ir::Op| l.epilogue.as_ref() == Some(e);
    let kinds: Vec<String> = p.launches.iter().map(|l| l.kind()).collect();
    assert!(!kinds.iter().any(|k| k == "ReluGrad"), "{kinds:?}");
    let grads: Vec<usize> = (0..p.launches.len()).filter(|&i| has(&p.launches[i], &mpc_ir::Op::ReluGrad)).collect();
    // The MLP has two hidden ReLUs.
    assert_eq!(grads.len(), 2, "{kinds:?}");
    for &b in &grads {
        let l = &p.launches[b];
        let mask = l.relu_mask.as_ref().unwrap_or_else(|| panic!("{}: no mask", l.node));
        let f = p.launches.iter().position(|f| f.relu_mask.as_ref() == Some(mask)).unwrap();
        let relu = &p.launches[f];
        assert!(f < b && matches!(relu.op, mpc_ir::Op::Gemm(_)) && has(relu, &mpc_ir::Op::Relu), "{}", relu.node);
        // The gradient's operand is the ReLU's output, and the mask holds one bit per element.
        let y = &relu.outputs[0];
        assert!(matches!(&l.epilogue_operand, Some(Operand::Device(t)) if t == y), "{}", l.node);
        let (rows, cols) = (y.shape[0], y.shape[1]);
        assert_eq!((mask.dtype, mask.bytes()), (DType::U8, relu_mask_bytes(rows, cols)));
        assert_eq!(relu_mask_bytes(rows, cols), (rows * 256 / 8) as u64, "256 features: two words of 128 bits");
        assert_alive(&p, mask, f, b);
    }
    let plain = cpu_lowered("mlp", "mixed", true, LowerOptions { bitwise: true, ..Default::default() });
    assert!(plain.launches.iter().all(|l| l.relu_mask.is_none()));
    assert_eq!(plain.launches.iter().filter(|l| l.op == mpc_ir::Op::ReluGrad).count(), 2);
    assert_eq!(relu_mask_bytes(3, 129), 3 * 256 / 8);
}

/// A batch norm's gradient reads its dy through the gradient of the ReLU after the batch norm
/// (a convolution block's): the ReluGrad is not launched, and the ReLU's output, written by the
/// batch norm's own launch (its Relu epilogue), stays in memory until the gradient has read it.
/// Unfused, the ReluGrads are launches again.
#[test]
fn a_batch_norms_gradient_reads_its_relus_gradient_as_it_loads_dy() {
    use mpc_runtime::program::LowerOptions;
    let p = cpu_lowered("cnn_bn", "mixed", true, LowerOptions::default());
    let grads: Vec<usize> = (0..p.launches.len()).filter(|&i| p.launches[i].relu_prologue.is_some()).collect();
    assert!(!grads.is_empty() && grads.len() == p.prologues, "{} prologues", p.prologues);
    for &b in &grads {
        let l = &p.launches[b];
        assert!(matches!(l.op, mpc_ir::Op::BatchNormalizationGrad(_)), "{}", l.node);
        let Some(Operand::Device(y)) = &l.relu_prologue else { panic!("{}", l.node) };
        let Some(Operand::Device(dy)) = l.inputs.first() else { panic!("{}", l.node) };
        assert_eq!((y.dtype, &y.shape), (dy.dtype, &dy.shape), "{}", l.node);
        let f = p.launches.iter().position(|f| f.outputs.first() == Some(y)).unwrap();
        let relu = &p.launches[f];
        assert!(f < b && matches!(relu.op, mpc_ir::Op::BatchNormalization(_)), "{}", relu.node);
        assert_eq!(relu.epilogue, Some(mpc_ir::Op::Relu), "{}", relu.node);
        assert_alive(&p, y, f, b);
    }
    let plain = cpu_lowered("cnn_bn", "mixed", true, LowerOptions { unfused: true, ..Default::default() });
    assert_eq!(plain.prologues, 0);
    assert_eq!(plain.launches.iter().filter(|l| l.op == mpc_ir::Op::ReluGrad).count(), grads.len());
}

/// A residual block's Add of its last batch norm's output and its shortcut, and the Relu after
/// it, are that batch norm's epilogue: the batch norm reads the shortcut and writes the Relu's
/// output, the Add and the Relu are not launched and the batch norm's own output is never
/// written. Unfused, they are launches again.
#[test]
fn a_residual_blocks_add_and_relu_are_its_batch_norms_epilogue() {
    use mpc_runtime::program::LowerOptions;
    for train in [false, true] {
        let p = cpu_lowered("resblock", "mixed", train, LowerOptions::default());
        let blocks: Vec<&mpc_runtime::program::Launch> =
            p.launches.iter().filter(|l| l.epilogue == Some(mpc_ir::Op::Add)).collect();
        assert!(!blocks.is_empty(), "train {train}: {:?}", p.launches.iter().map(|l| l.kind()).collect::<Vec<_>>());
        for l in &blocks {
            assert!(matches!(l.op, mpc_ir::Op::BatchNormalization(_)), "{}", l.node);
            assert_eq!(l.epilogue_then, Some(mpc_ir::Op::Relu), "{}", l.node);
            let Some(Operand::Device(r)) = &l.epilogue_operand else { panic!("{}: no shortcut", l.node) };
            assert_eq!((r.dtype, &r.shape), (l.outputs[0].dtype, &l.outputs[0].shape), "{}", l.node);
        }
        let plain = cpu_lowered("resblock", "mixed", train, LowerOptions { unfused: true, ..Default::default() });
        let count =
            |p: &mpc_runtime::program::Program, op: mpc_ir::Op| p.launches.iter().filter(|l| l.op == op).count();
        assert!(count(&plain, mpc_ir::Op::Add) >= blocks.len() && count(&plain, mpc_ir::Op::Relu) >= blocks.len());
        assert!(plain.launches.iter().all(|l| l.epilogue_then.is_none()));
    }
}

/// A tanh GELU's gradient in the backward pass is the epilogue of the product that makes its dY
/// (the input gradient of the layer after the GELU, a Gemm over the sequence's rows that dY
/// views as `[B, S, F]`), reading the GELU's input; without the products' library fusions
/// (`bitwise`) the GeluGrads are launches again.
#[test]
fn a_gelu_gradient_is_its_products_epilogue() {
    use mpc_runtime::program::LowerOptions;
    let p = cpu_lowered("tiny_gpt_loss", "mixed", true, LowerOptions::default());
    let kinds: Vec<String> = p.launches.iter().map(|l| l.kind()).collect();
    assert!(!kinds.iter().any(|k| k == "GeluGrad"), "{kinds:?}");
    let grads: Vec<usize> =
        (0..p.launches.len()).filter(|&i| matches!(p.launches[i].epilogue, Some(mpc_ir::Op::GeluGrad(_)))).collect();
    assert!(!grads.is_empty(), "{kinds:?}");
    for &b in &grads {
        let l = &p.launches[b];
        assert!(matches!(l.op, mpc_ir::Op::Gemm(_)), "{}", l.node);
        let Some(Operand::Device(h)) = &l.epilogue_operand else { panic!("{}: no GELU input", l.node) };
        let (y, a) = (&l.outputs[0], l.inputs[0].tensor().unwrap());
        assert_eq!((h.dtype, &h.shape), (y.dtype, &y.shape), "{}", l.node);
        assert!(y.shape.len() == 3 && a.shape.len() == 2, "{}: {:?} from {:?}", l.node, y.shape, a.shape);
        // The GELU's launch read the same place earlier, and it lives until here.
        let gelu = |f: &mpc_runtime::program::Launch| {
            matches!(f.op, mpc_ir::Op::Gelu(_)) && f.inputs.first().and_then(Operand::tensor) == Some(h)
        };
        let f = p.launches.iter().position(gelu).unwrap_or_else(|| panic!("{}: no GELU reads its input", l.node));
        assert!(f < b, "{}", l.node);
        assert_alive(&p, h, f, b);
    }
    let plain = cpu_lowered("tiny_gpt_loss", "mixed", true, LowerOptions { bitwise: true, ..Default::default() });
    assert_eq!(plain.launches.iter().filter(|l| matches!(l.op, mpc_ir::Op::GeluGrad(_))).count(), grads.len());
}

/// What a launch writes in the arena is read by a later launch before anything writes over it,
/// or is an output of the program: no launch computes a tensor nothing reads. The one exception,
/// a first convolution's input gradient (ConvGrad's dX, positional before dW, for an input that
/// takes no gradient), is marked unread (`Launch::unread`) and the CUDA device does not
/// compute it.
#[test]
fn every_tensor_a_training_step_writes_is_read() {
    use mpc_runtime::program::Region;
    let (mut checked, mut unread) = (0, 0);
    for name in FIXTURES {
        for policy in ["fp32", "mixed"] {
            let Ok(g) = try_compiled(name, policy, true) else { continue };
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let caps = mpc_runtime::device::CpuDevice::default().caps();
            let Ok(p) = mpc::run::lower_bound(&bound, caps, None, None, &fixture(name)) else { continue };
            let arena = |t: &TensorRef| (t.region == Region::Arena).then_some((t.offset, t.offset + t.bytes()));
            let meets = |a: (u64, u64), t: &TensorRef| arena(t).is_some_and(|b| a.0 < b.1 && b.0 < a.1);
            for (i, l) in p.launches.iter().enumerate() {
                for m in l.parts() {
                    for (k, o) in m.outputs.iter().enumerate() {
                        let Some(r) = arena(o).filter(|r| r.1 > r.0) else { continue };
                        // Outputs the lowering marks unread a device may skip: only a first
                        // convolution's input gradient.
                        if m.unread.contains(&k) {
                            let first_dx = matches!(m.op, mpc_ir::Op::ConvGrad(_)) && k == 0;
                            assert!(first_dx, "{name} {policy}: {} output {k} unread", m.node);
                            unread += 1;
                            continue;
                        }
                        if p.outputs.iter().any(|(_, t)| t == o) {
                            continue;
                        }
                        // The next launch that touches the place reads it (a launch reading and
                        // writing it in place reads it first).
                        let next = p.launches[i + 1..].iter().flat_map(|n| n.parts()).find_map(|n| {
                            let reads = n.operands().filter_map(Operand::tensor).any(|t| meets(r, t));
                            let writes = n.outputs.iter().chain(&n.relu_mask).any(|t| meets(r, t));
                            (reads || writes).then_some(reads)
                        });
                        assert_eq!(
                            next,
                            Some(true),
                            "{name} {policy}: {} writes {:?}{:?} that nothing reads",
                            m.node,
                            o.dtype,
                            o.shape
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 200, "only {checked} outputs checked");
    assert!(unread > 0, "no first convolution's input gradient marked unread");
}

#[test]
fn transposes_read_only_by_matrix_products_are_not_launched() {
    // `y` reads both operands through Transposes of their last two axes; `z`'s Transpose is also
    // read by a Neg: it is launched; `p` reads its left operand through a permutation that moves a
    // batch axis (each matrix where it lies).
    let graph = |dtype: &str, keep: bool| {
        let outs = if keep { "  output %4\n  output %5\n" } else { "" };
        format!(
            "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"a\": {dtype}[2,3,4]\n  \
             input %1 \"b\": {dtype}[2,5,3]\n  input %2 \"q\": {dtype}[3,2,4]\n  input %3 \"w\": {dtype}[4,3]\n  \
             %4 \"at\": {dtype}[2,4,3] = Transpose[perm=[0, 2, 1]](%0)\n  \
             %5 \"bt\": {dtype}[2,3,5] = Transpose[perm=[0, 2, 1]](%1)\n  \
             %6 \"y\": {dtype}[2,4,5] = MatMul(%4, %5)\n  %7 \"z\": {dtype}[2,4,4] = MatMul(%4, %0)\n  \
             %8 \"n\": {dtype}[2,4,3] = Neg(%4)\n  %9 \"qt\": {dtype}[2,3,4] = Transpose[perm=[1, 0, 2]](%2)\n  \
             %10 \"p\": {dtype}[2,3,3] = MatMul(%9, %3)\n  output %6\n  output %7\n  output %8\n  output %10\n{outs}end\n"
        )
    };
    for dtype in ["f32", "f16"] {
        let load = |keep: bool| {
            let path = common::scratch("transposed").join(format!("{dtype}{keep}.mpcir"));
            std::fs::write(&path, graph(dtype, keep)).unwrap();
            mpc::load(&path).unwrap()
        };
        let (g, kept) = (load(false), load(true));
        let caps = mpc_runtime::device::CpuDevice::default().caps();
        let p = mpc_runtime::program::lower(&g, caps, Default::default()).unwrap();
        let kinds: Vec<String> = p.launches.iter().map(|l| l.kind()).collect();
        assert_eq!(kinds, ["Transpose", "MatMul", "MatMul", "Neg", "MatMul"], "{dtype}");
        assert_eq!(p.transposed, 2, "{dtype}: `bt` is fused into `y`, `qt` into `p`, `at` is read by a Neg too");
        let pm = p.launches.iter().find(|l| l.outputs[0].shape == [2, 3, 3]).unwrap();
        assert!(
            matches!(&pm.inputs[0], Operand::Permuted(t, perm) if t.shape == [3, 2, 4] && perm == &[1, 0, 2]),
            "{dtype}: {:?}",
            pm.inputs
        );
        let y = p.launches.iter().find(|l| l.outputs[0].shape == [2, 4, 5]).unwrap();
        assert!(matches!(&y.inputs[1], Operand::Transposed(t) if t.shape == [2, 5, 3]), "{dtype}: {:?}", y.inputs);
        assert!(matches!(&y.inputs[0], Operand::Device(t) if t.shape == [2, 4, 3]), "{dtype}: {:?}", y.inputs);
        // The same products with the Transposes launched (their results are graph outputs).
        let plain = mpc_runtime::program::lower(&kept, caps, Default::default()).unwrap();
        assert_eq!(plain.transposed, 1, "{dtype}: only `qt` is read in place there");
        let inputs = mpc::run::random_inputs(&g, 5, &HashMap::new()).unwrap();
        let devices: [fn() -> mpc_runtime::device::CpuDevice; 2] =
            [mpc_runtime::device::CpuDevice::default, mpc_runtime::device::CpuDevice::on_copies];
        for device in devices {
            let x = Session::new(device(), p.clone()).unwrap().run(&inputs).unwrap();
            let want = Session::new(device(), plain.clone()).unwrap().run(&inputs).unwrap();
            for (n, a) in &x {
                let b = &want.iter().find(|(m, _)| m == n).unwrap().1;
                same(a, b, &format!("{dtype} {n}"));
            }
        }
    }
}

/// Element-wise chains fused into one launch compute the bits of the launches they replace:
/// the fixtures' inference graphs and training steps (and a GPT-shaped step with its loss inside)
/// under each policy, lowered with and without fusion, run on the same inputs, give the same
/// outputs and state to the bit. On the GPU the fused side keeps only the fusions that promise
/// those bits (`LowerOptions::bitwise`): there cuBLAS and cuBLASLt choose their own algorithms
/// for a product with an epilogue, so a Gemm's ReLU, a MatMul's bias or Transpose and a bias gradient
/// computed with its weight gradient are the same arithmetic summed in another order (checked
/// against the CPU within the dtype's tolerance by `cuda_vs_cpu`).
pub(crate) fn fused_chains_give_the_unfused_bits<D: Device>(device: impl Fn() -> D) {
    use mpc_runtime::program::{lower, LowerOptions};
    let mut chains: HashMap<String, usize> = HashMap::new();
    let mut bad = Vec::new();
    let names = ["mlp", "mlp_loss", "cnn_bn", "resblock", "transformer", "opset9", "tiny_gpt_loss"];
    for name in names {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            for train in [false, true] {
                if name == "opset9" && train {
                    continue; // nothing to train
                }
                let g = compiled(name, policy, train);
                let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
                let caps = device().caps();
                let bitwise = caps.name != "cpu";
                let lowered =
                    |unfused| lower(&bound, caps, LowerOptions { unfused, bitwise, ..Default::default() }).unwrap();
                let (fused, plain) = (lowered(false), lowered(true));
                assert_eq!(plain.fused, (0, 0));
                for l in fused.launches.iter().filter_map(|l| l.chain.as_ref()) {
                    *chains.entry(l.kind()).or_default() += 1;
                }
                let label = format!("{name} {policy}{}", if train { " train" } else { "" });
                assert_eq!((plain.grouped, plain.epilogues, plain.prologues, plain.siblings), ((0, 0), 0, 0, 0));
                for l in fused.launches.iter().filter(|l| l.epilogue.is_some()) {
                    let e = l.epilogue.as_ref().map_or("", |e| e.op_type());
                    let then = l.epilogue_then.as_ref().map_or(String::new(), |t| format!("+{}", t.op_type()));
                    *chains.entry(format!("{}+{e}{then} (epilogue)", l.op.op_type())).or_default() += 1;
                }
                for l in fused.launches.iter().filter(|l| l.relu_prologue.is_some()) {
                    *chains.entry(format!("ReluGrad+{} (prologue)", l.op.op_type())).or_default() += 1;
                }
                for l in fused.launches.iter().filter(|l| l.sibling.is_some()) {
                    *chains.entry(format!("{} (sibling)", l.kind())).or_default() += 1;
                }
                assert!(!train || fused.grouped.1 == 1, "{label}: {:?}", fused.grouped);
                assert_eq!(
                    fused.launches.len() + fused.fused.0 - fused.fused.1 + fused.grouped.0 - fused.grouped.1
                        + fused.epilogues
                        + fused.prologues
                        + fused.siblings,
                    plain.launches.len(),
                    "{label}: launches"
                );
                let state: Vec<String> = fused.state.iter().map(|s| s.name.clone()).collect();
                let outputs: Vec<String> = fused.outputs.iter().map(|(n, _)| n.clone()).collect();
                // The unfused program twice: its bits are the same from run to run.
                let mut s = [fused, plain.clone(), plain].map(|p| Session::new(device(), p).unwrap());
                for step in 0..2 {
                    let inputs = mpc::run::random_inputs(&bound, 31 + step, &dims()).unwrap();
                    for x in s.iter_mut() {
                        x.feed(0, &inputs).unwrap();
                        x.step(0).unwrap();
                    }
                    for n in &outputs {
                        let [x, y, z] = [0, 1, 2].map(|i| s[i].read(0, n).unwrap());
                        bad.extend(differs(&y, &z, &format!("{label} `{n}`, step {step}, unfused run twice")));
                        bad.extend(differs(&x, &y, &format!("{label} `{n}`, step {step}")));
                    }
                }
                for n in &state {
                    let [x, y, z] = [0, 1, 2].map(|i| s[i].read_state(n).unwrap());
                    bad.extend(differs(&y, &z, &format!("{label} `{n}` after 2 steps, unfused run twice")));
                    bad.extend(differs(&x, &y, &format!("{label} `{n}` after 2 steps")));
                }
            }
        }
    }
    println!("chains fused: {chains:?}");
    none_differ(&bad);
    for kind in [
        "Fused(Cast+Mul+Add+Softmax+Cast)",
        "Fused(SoftmaxGrad+Mul+Cast)",
        "Fused(Cast+Add+Add)",
        "LayerNormalization+Cast (epilogue)",
        "BatchNormalization+Relu (epilogue)",
        "ReluGrad+BatchNormalizationGrad (prologue)",
        "BatchNormalization+Add+Relu (epilogue)",
    ] {
        assert!(chains.contains_key(kind), "no {kind}: {chains:?}");
    }
    // The products' fusions, where the fused side has them (the CPU).
    // (A Linear's bias is its MatMul's epilogue there; elsewhere it is fused with the Gelu.)
    let products: &[&str] = if device().caps().name == "cpu" {
        &[
            "Gemm+Relu (epilogue)",
            "Gemm+ReluGrad (epilogue)",
            "Gemm+GeluGrad (epilogue)",
            "Gemm+ReduceSum (sibling)",
            "MatMul+Transpose (epilogue)",
            "MatMul+Add (epilogue)",
        ]
    } else {
        &["Fused(Add+Gelu)"]
    };
    for kind in products {
        assert!(chains.contains_key(*kind), "no {kind}: {chains:?}");
    }
}

/// The arena bytes the memory plan says no value holds during a launch (where the CUDA device
/// puts the launch's scratch) hold none of the tensors it reads or writes: every fixture's
/// inference graph and training step under each policy, lowered for a GPU's alignment fused,
/// with the bitwise fusions only, and unfused (whose lifetimes once all said "the step's end",
/// so that every launch's scratch went over its own operands).
#[test]
fn no_launch_reads_or_writes_the_bytes_free_during_it() {
    use mpc_runtime::program::{lower, DeviceCaps, LowerOptions, Region};
    let caps = DeviceCaps { name: "cuda", align: 256, memory: 1 << 40, fuse: true };
    let mut checked = 0;
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            for train in [false, true] {
                let Ok(g) = try_compiled(name, policy, train) else { continue };
                let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
                for (unfused, bitwise) in [(false, false), (false, true), (true, false)] {
                    let opts = LowerOptions { unfused, bitwise, ..Default::default() };
                    let Ok(p) = lower(&bound, caps, opts) else { continue };
                    for (i, l) in p.launches.iter().enumerate() {
                        let (at, free) = p.free_during(i);
                        let inputs = l.members().iter().flat_map(|m| m.operands().chain(&l.epilogue_operand));
                        let read = inputs.filter_map(Operand::tensor).chain(l.operands().filter_map(Operand::tensor));
                        let written = l.members().iter().flat_map(|m| &m.outputs).chain(&l.outputs);
                        for t in read.chain(written).chain(&l.relu_mask) {
                            assert!(
                                t.region != Region::Arena || t.offset >= at + free || t.offset + t.bytes() <= at,
                                "{name} {policy} train={train} unfused={unfused} bitwise={bitwise}: launch {i} ({}) \
                                 uses {}..{}, free {at}..{}",
                                l.node,
                                t.offset,
                                t.offset + t.bytes(),
                                at + free
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    assert!(checked > 1000, "only {checked} launches checked");
}

/// Fusion is the device's option (`DeviceOptions::fuse`; the CLI's `MPC_FUSE=0`): a device
/// without it lowers the unfused program, and the CLI's override reaches the lowering.
#[test]
fn a_device_without_fusion_lowers_the_unfused_program() {
    use mpc_runtime::device::{CpuDevice, DeviceOptions};
    use mpc_runtime::program::LowerOptions;
    let (bound, _) = mpc::summary::bind_inputs(&compiled("mlp", "mixed", true), &dims()).unwrap();
    let ops = |p: &Program| p.launches.iter().map(|l| l.op.op_type().to_string()).collect::<Vec<_>>();
    let off = CpuDevice::with_options(DeviceOptions { fuse: false, ..Default::default() }).caps();
    let without = mpc_runtime::program::lower(&bound, off, LowerOptions::default()).unwrap();
    let unfused = cpu_lowered("mlp", "mixed", true, LowerOptions { unfused: true, ..Default::default() });
    let fused = cpu_lowered("mlp", "mixed", true, LowerOptions::default());
    assert_eq!(ops(&without), ops(&unfused));
    assert!(fused.launches.len() < without.launches.len(), "{} vs {}", fused.launches.len(), without.launches.len());
    let launches = |fuse: Option<&str>| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_mpc"));
        c.args(["inspect", "tests/models/mlp.onnx", "--train", "--policy", "mixed", "--memory", "--launches"]);
        if let Some(v) = fuse {
            c.env("MPC_FUSE", v);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).lines().count()
    };
    assert!(launches(Some("0")) > launches(None), "MPC_FUSE=0 did not reach the lowering");
}
