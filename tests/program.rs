//! What lowered programs promise: every fixture's inference graph under each policy and the
//! training graphs lower; no launch reads device data for a shape; a program run twice gives the
//! same bits; after the first step no step allocates (so no region moves) and no step reads back
//! more than its `If` conditions; a training step updates its state in place.

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_ir::{DType, Graph};
use mpc_runtime::device::Device;
use mpc_runtime::program::{Operand, Program, TensorRef};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

const BATCH: u64 = 4;

fn compiled(name: &str, policy: &str, train: bool) -> Graph {
    try_compiled(name, policy, train).unwrap_or_else(|e| panic!("{name} {policy}: {e}"))
}

/// The fixture compiled under `policy`, as an inference graph or a training step.
fn try_compiled(name: &str, policy: &str, train: bool) -> Result<Graph, mpc::Error> {
    common::compiled(name, policy, train)
}

fn dims() -> HashMap<String, u64> {
    [("batch".to_string(), BATCH)].into()
}

fn lowered(g: &Graph, caps: mpc_runtime::program::DeviceCaps) -> (Graph, Program) {
    let (bound, _) = mpc::summary::bind_inputs(g, &dims()).unwrap();
    let p =
        mpc::run::lower_bound(&bound, caps, None, None, &fixture("mlp")).unwrap_or_else(|e| panic!("lowering: {e}"));
    (bound, p)
}

/// A fixture compiled under `policy` and lowered for the CPU device with `opts`.
fn cpu_lowered(name: &str, policy: &str, train: bool, opts: mpc_runtime::program::LowerOptions) -> Program {
    let (bound, _) = mpc::summary::bind_inputs(&compiled(name, policy, train), &dims()).unwrap();
    mpc_runtime::program::lower(&bound, mpc_runtime::device::CpuDevice::default().caps(), opts).unwrap()
}

/// The arena buffer that holds `t` is alive from launch `from` to launch `to`.
fn assert_alive(p: &Program, t: &TensorRef, from: usize, to: usize) {
    let buffer = p.buffers.iter().find(|x| x.offset == t.offset && x.bytes >= t.bytes()).unwrap();
    assert!(buffer.first <= from && buffer.last >= to, "{}..{} for {from}..{to}", buffer.first, buffer.last);
}

/// Every host operand of every launch is a value in the descriptor.
fn assert_shapes_resolved(p: &Program) {
    for l in &p.launches {
        for &slot in l.op.host_operands() {
            assert!(
                l.inputs.get(slot).and_then(Operand::tensor).is_none(),
                "{}: operand {slot} would be read from device memory",
                l.node
            );
        }
    }
}

fn same(a: &HostTensor, b: &HostTensor, what: &str) {
    if let Some(e) = differs(a, b, what) {
        panic!("{e}");
    }
}

/// Where `a` and `b` differ in a bit, what and how (`None` where they are the same bits).
fn differs(a: &HostTensor, b: &HostTensor, what: &str) -> Option<String> {
    mpc_runtime::Tolerance::EXACT.check(a, b).err().map(|e| format!("{what}: {e}"))
}

/// Panics with every difference found, one per line, where there are any.
fn none_differ(bad: &[String]) {
    assert!(bad.is_empty(), "{} differences:\n{}", bad.len(), bad.join("\n"));
}

common::per_device!(
    inference_programs_keep_their_promises => inference_programs_keep_their_promises,
    training_programs_update_their_state_in_place => training_programs_update_their_state_in_place,
    fused_chains_give_the_unfused_bits => fused_chains_give_the_unfused_bits,
    residual_gradients_and_the_relu_gradient_are_one_launch => residual_gradients_and_the_relu_gradient_are_one_launch,
);

/// The text-IR model `text` (written to a scratch file named `name`), lowered for the CPU with
/// fusion and without.
fn fused_and_plain(name: &str, text: &str) -> (Graph, Program, Program) {
    let path = common::scratch(name).join("g.mpcir");
    std::fs::write(&path, text).unwrap();
    let g = mpc::load(&path).unwrap();
    let caps = mpc_runtime::device::CpuDevice::default().caps();
    let lowered = |unfused| {
        let opts = mpc_runtime::program::LowerOptions { unfused, ..Default::default() };
        mpc_runtime::program::lower(&g, caps, opts).unwrap()
    };
    let (fused, plain) = (lowered(false), lowered(true));
    (g, fused, plain)
}

/// Runs both programs on the same random inputs: the same outputs, bit for bit.
fn same_outputs(g: &Graph, fused: Program, plain: Program) {
    let inputs = mpc::run::random_inputs(g, 3, &HashMap::new()).unwrap();
    let run = |p: Program| Session::new(mpc_runtime::device::CpuDevice::default(), p).unwrap().run(&inputs).unwrap();
    let (x, y) = (run(fused), run(plain));
    assert_eq!(x.len(), g.outputs().len());
    for ((n, a), (m, b)) in x.iter().zip(&y) {
        assert_eq!(n, m);
        same(a, b, n);
    }
}

/// A fused run writes the values read after it, also through a view, and no others: Cast, Add
/// and Tanh fuse, the Add's result is read again through a Reshape (a view) by a Neg, which
/// is not in the run; the Cast's result is read by nothing else and gets no memory.
#[test]
fn a_fused_run_writes_what_is_read_after_it() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f16[4,8]\n  \
                input %1 \"b\": f32[8]\n  init %2 \"shape\" = i64[1]{32}\n  \
                %3 \"c\": f32[4,8] = Cast[to=1](%0)\n  %4 \"a\": f32[4,8] = Add(%3, %1)\n  \
                %5 \"t\": f32[4,8] = Tanh(%4)\n  %6 \"r\": f32[32] = Reshape(%4, %2)\n  \
                %7 \"u\": f32[32] = Neg(%6)\n  output %5\n  output %7\nend\n";
    let (g, fused, plain) = fused_and_plain("fused_run", text);
    assert_eq!((fused.launches.len(), plain.launches.len()), (2, 4));
    let chain = fused.launches[0].chain.as_ref().unwrap();
    assert_eq!(fused.launches[0].kind(), "Fused(Cast+Add+Tanh)");
    assert_eq!(chain.outputs, vec![1, 2], "the Add's and the Tanh's results are written");
    let written: Vec<&str> = fused.buffers.iter().flat_map(|b| b.values.iter().map(|v| v.1.as_str())).collect();
    assert!(!written.contains(&"c") && written.contains(&"a"), "{written:?}");
    same_outputs(&g, fused, plain);
}

/// A residual block whose input is a Relu's output (ResNet's, between blocks): in the backward
/// pass the two gradients meeting at the block's input (a Sum of two) and the Relu's gradient are
/// one launch, and the step computes the unfused program's bits, under each policy.
fn residual_gradients_and_the_relu_gradient_are_one_launch<D: Device>(device: impl Fn() -> D) {
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

/// A run takes in a step from a little further on that reads what it made and nothing the steps
/// in between make (GPT's residual gradient: its Sum, the bias gradient's ReduceSum, then the
/// Sum's Cast to f16): the Cast is computed in the Sum's launch. A step that reads, through a
/// view, what a step in between made stays where it is. Both give the unfused bits.
#[test]
fn a_run_takes_in_a_later_step_that_reads_only_what_is_ready() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[4,8]\n  \
                input %1 \"y\": f32[4,8]\n  init %2 \"shape\" = i64[2]{4, 8}\n  \
                %3 \"a\": f32[4,8] = Sum(%0, %1)\n  %4 \"t\": f32[8,4] = Transpose[perm=[1, 0]](%3)\n  \
                %5 \"u\": f32[4,8] = Reshape(%4, %2)\n  %6 \"c\": f16[4,8] = Cast[to=10](%3)\n  \
                %7 \"d\": f32[4,8] = Add(%3, %5)\n  output %6\n  output %7\nend\n";
    let (g, fused, plain) = fused_and_plain("look_ahead", text);
    let kinds: Vec<String> = fused.launches.iter().map(|l| l.kind()).collect();
    assert_eq!(kinds, ["Fused(Sum+Cast)", "Transpose", "Add"], "{kinds:?}");
    assert_eq!(plain.launches.len(), 4);
    same_outputs(&g, fused, plain);
}

/// A step that reads what a launch in between writes through its epilogue (the Relu a Gemm
/// applies: a second residual block's input) is not taken into an earlier run: it would read the
/// value before it is written.
#[test]
fn a_run_takes_in_no_step_that_reads_an_epilogue_written_after_it() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[4,8]\n  \
                input %1 \"w\": f32[8,8]\n  %2 \"a\": f32[4,8] = Add(%0, %0)\n  %3 \"r\": f32[4,8] = Relu(%2)\n  \
                %4 \"g\": f32[4,8] = Gemm[transB=1](%3, %1)\n  %5 \"h\": f32[4,8] = Relu(%4)\n  \
                %6 \"s\": f32[4,8] = Add(%5, %3)\n  output %6\nend\n";
    let (g, fused, plain) = fused_and_plain("epilogue_ahead", text);
    let kinds: Vec<String> = fused.launches.iter().map(|l| l.kind()).collect();
    assert_eq!(kinds, ["Fused(Add+Relu)", "Gemm", "Add"], "{kinds:?}");
    assert!(fused.launches[1].epilogue.is_some(), "the Gemm applies the Relu");
    same_outputs(&g, fused, plain);
}

/// A Linear over a sequence (MatMul by a weight, then Add of a bias over the features) adds its
/// bias as the product is written, either side of the Add; a bias made after the product (here
/// a Neg scheduled between them) is not read before it is written: that Add stays a launch. Both
/// give the unfused bits.
#[test]
fn a_bias_made_before_its_product_is_the_products_epilogue() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[2,3,8]\n  \
                input %1 \"w\": f32[8,6]\n  input %2 \"b\": f32[6]\n  %3 \"y\": f32[2,3,6] = MatMul(%0, %1)\n  \
                %4 \"z\": f32[2,3,6] = Add(%2, %3)\n  %5 \"u\": f32[2,3,6] = MatMul(%0, %1)\n  \
                %6 \"c\": f32[6] = Neg(%2)\n  %7 \"v\": f32[2,3,6] = Add(%5, %6)\n  output %4\n  output %7\nend\n";
    let (g, fused, plain) = fused_and_plain("bias_epilogue", text);
    let kinds: Vec<String> = fused.launches.iter().map(|l| l.kind()).collect();
    assert_eq!(kinds, ["MatMul", "MatMul", "Neg", "Add"], "{kinds:?}");
    assert!(matches!(fused.launches[0].epilogue, Some(mpc_ir::Op::Add)));
    assert!(matches!(&fused.launches[0].epilogue_operand, Some(Operand::Device(t)) if t.shape == [6]));
    assert!(fused.launches[1].epilogue.is_none(), "`c` is made after `u`");
    assert_eq!(plain.launches.len(), 5);
    same_outputs(&g, fused, plain);
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
fn fused_chains_give_the_unfused_bits<D: Device>(device: impl Fn() -> D) {
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
    let caps = DeviceCaps { name: "cuda", align: 256, memory: 1 << 40 };
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

fn inference_programs_keep_their_promises<D: Device>(device: impl Fn() -> D) {
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let g = compiled(name, policy, false);
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let program = mpc::run::lower_bound(&bound, device().caps(), None, None, &fixture(name))
                .unwrap_or_else(|e| panic!("{name} {policy}: {e}"));
            assert_shapes_resolved(&program);
            println!(
                "{name} {policy}: {} launches, {} folded, {} views, arena {} B, constants {} B",
                program.launches.len(),
                program.folded,
                program.views,
                program.arena_bytes,
                program.constants_bytes
            );
            let mut inputs = mpc::run::random_inputs(&bound, 7, &dims()).unwrap();
            let mut s = Session::new(device(), program).unwrap();
            // An If's condition is an input: both branches, on one session.
            let conds: &[bool] = if inputs.contains_key("cond") { &[true, false] } else { &[true] };
            let mut got = Vec::new();
            for &c in conds {
                if inputs.contains_key("cond") {
                    inputs.insert("cond".into(), HostTensor::from_i64(mpc_ir::DType::Bool, vec![], vec![c as i64]));
                }
                got = s.run(&inputs).unwrap();
                assert_eq!(got.len(), bound.outputs().len());
            }
            // A second run on the same session gives the same bits.
            let again = s.run(&inputs).unwrap();
            for ((_, a), (_, b)) in got.iter().zip(&again) {
                same(a, b, &format!("{name} {policy} second run"));
            }
            assert_eq!(s.stats(0).allocations_in_steps, 0);
            assert_eq!(s.stats(0).host_reads_per_step as usize, s.program(0).unwrap().host_reads, "{name}");
        }
    }
}

fn training_programs_update_their_state_in_place<D: Device>(device: impl Fn() -> D) {
    let mut trained = 0;
    let models = FIXTURES.iter().chain(&["digits_mlp"]);
    for (name, policy) in models.flat_map(|n| ["fp32", "mixed", "mixed-bf16"].map(|p| (*n, p))) {
        let g = match try_compiled(name, policy, true) {
            Ok(g) => g,
            // Fixtures with nothing to train, or an op with no gradient rule, are refused when
            // compiling (tests/train.rs checks the messages).
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("nothing to train") || msg.contains("has no gradient rule"), "{name}: {msg}");
                continue;
            }
        };
        trained += 1;
        let (bound, program) = lowered(&g, device().caps());
        assert_shapes_resolved(&program);
        let sig = bound.train.clone().unwrap();
        // The optimizer writes masters and moments into their own slots: no copy after the step.
        let in_place = program.state.iter().filter(|st| st.next == st.slot).count();
        println!("{name} {policy}: {in_place} of {} state values updated in place", program.state.len());
        assert!(in_place * 2 > program.state.len(), "{name} {policy}: {in_place} in place");
        let mut s = Session::new(device(), program).unwrap();
        let loss_name = bound.name(sig.loss.unwrap()).to_string();
        let names: Vec<String> = sig.state.iter().map(|&(v, _)| bound.name(v).to_string()).collect();
        let start: Vec<HostTensor> = names.iter().map(|n| s.read_state(n).unwrap()).collect();
        for step in 0..3 {
            let inputs = mpc::run::random_inputs(&bound, 11 + step, &dims()).unwrap();
            s.feed(0, &inputs).unwrap();
            s.step(0).unwrap();
            let loss = s.read(0, &loss_name).unwrap().f64s()[0];
            assert!(loss.is_finite(), "{name} {policy} step {step}: loss {loss}");
        }
        let moved = names.iter().zip(&start).filter(|(n, t)| &s.read_state(n).unwrap() != *t).count();
        assert!(moved * 2 > names.len(), "{name} {policy}: only {moved} of {} state values moved", names.len());
        let st = s.stats(0);
        assert_eq!(st.allocations_in_steps, 0, "{name}: allocations inside steps");
        assert_eq!(st.host_reads_per_step, 0, "{name}: host reads inside a step");
        assert!(st.launches_per_step > 0 && st.steps == 3);
    }
    // mlp, mlp_loss, cnn_bn, resblock, transformer, digits_mlp under three policies.
    assert_eq!(trained, 18, "training steps lowered");
}

/// The CPU device's in-place launches (f32 matrix products on the regions) give exactly the
/// bits of the reference kernels on copies: inference under every policy, and training steps.
#[test]
fn in_place_launches_give_the_reference_bits() {
    use mpc_runtime::device::CpuDevice;
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let g = compiled(name, policy, false);
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims()).unwrap();
            let inputs = mpc::run::random_inputs(&bound, 3, &dims()).unwrap();
            let path = fixture(name);
            let a = mpc::run::run_once_on(CpuDevice::default(), &bound, &inputs, &path).unwrap();
            let b = mpc::run::run_once_on(CpuDevice::on_copies(), &bound, &inputs, &path).unwrap();
            for ((n, x), (_, y)) in a.iter().zip(&b) {
                same(x, y, &format!("{name} {policy} `{n}`"));
            }
        }
    }
    for (name, policy) in [("mlp", "mixed"), ("cnn_bn", "mixed"), ("transformer", "mixed"), ("mlp", "fp32")] {
        let g = compiled(name, policy, true);
        let (bound, program) = lowered(&g, CpuDevice::default().caps());
        let names: Vec<String> =
            bound.train.as_ref().unwrap().state.iter().map(|&(v, _)| bound.name(v).to_string()).collect();
        // The operands of the launches that run a kernel (not those whose outputs are all empty).
        let operands: Vec<&TensorRef> = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .filter(|l| l.outputs.is_empty() || !l.outputs.iter().all(|t| t.shape.contains(&0)))
            .flat_map(|l| &l.inputs)
            .filter_map(Operand::tensor)
            .collect();
        let bools = operands.iter().filter(|t| t.dtype == DType::Bool).count() as u64;
        // Operands read widened (a fused Cast) are widened into a copy.
        let widened = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .flat_map(|l| &l.inputs)
            .filter(|o| matches!(o, Operand::Widened(_)))
            .count() as u64;
        // So are operands read transposed (a fused Transpose) by a product that does not run in
        // place (an f16 or bf16 one), and operands read through a permutation.
        let transposed = program
            .launches
            .iter()
            .flat_map(|l| l.parts())
            .flat_map(|l| &l.inputs)
            .filter(|o| {
                matches!(o, Operand::Transposed(t) if t.dtype != DType::F32) || matches!(o, Operand::Permuted(..))
            })
            .count() as u64;
        let all = operands.len() as u64;
        // A dy read through a ReLU's gradient is that gradient, computed into a new tensor.
        let prologues =
            program.launches.iter().flat_map(|l| l.parts()).filter(|l| l.relu_prologue.is_some()).count() as u64;
        let mut s = [
            Session::new(CpuDevice::default(), program.clone()).unwrap(),
            Session::new(CpuDevice::on_copies(), program).unwrap(),
        ];
        for step in 0..3 {
            let inputs = mpc::run::random_inputs(&bound, 21 + step, &dims()).unwrap();
            for x in s.iter_mut() {
                x.feed(0, &inputs).unwrap();
                x.step(0).unwrap();
            }
        }
        // fp32 matrix products (forward and gradients) run in place; f16 ones on copies.
        assert_eq!(s[1].counters().in_place, 0);
        assert!(policy != "fp32" || s[0].counters().in_place > 0, "{name}: no launch ran in place");
        // Kernels read every operand where it lies, but bools (whose bytes need not be 0 or 1),
        // operands read widened and low-precision operands read transposed.
        println!(
            "{name} {policy}: {all} operands a step, {bools} of them bools, {widened} read widened, \
             {transposed} read transposed in f16 or bf16, {prologues} read through a ReLU's gradient"
        );
        let copied = bools + widened + transposed + prologues;
        assert_eq!(s[0].counters().operand_copies, 3 * copied, "{name} {policy}: operands copied");
        assert_eq!(s[1].counters().operand_copies, 3 * (all + prologues), "{name} {policy}: operands copied");
        for n in &names {
            let (x, y) = (s[0].read_state(n).unwrap(), s[1].read_state(n).unwrap());
            same(&x, &y, &format!("{name} {policy} `{n}` after 3 steps"));
        }
    }
}

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
