//! The CUDA plans' index arithmetic, checked on the CPU: a small interpreter executes the calls of
//! a plan (device copies and fills, cuBLAS GEMMs in their column-major terms, and the kernels
//! whose meaning is plain data movement or summation: `movement_copy`, `movement_fill`,
//! `elementwise_add`, `im2col`, `col2im`, `channel_sum`, as their headers in `kernels/` define
//! them) over copies of a program's regions, and every launch it can interpret is compared with
//! the CPU device's result at the same point of the same program. That covers what is easiest to
//! get wrong in a plan and hardest to see on a GPU: GEMM transposes, leading dims and batch
//! strides (MatMul with broadcasting, Gemm, Conv, ConvGrad, ConvTranspose), the im2col/col2im
//! layouts, and the strided copies of Transpose, Slice, Concat, Split, Expand and Pad.

#![cfg(feature = "cuda")]

mod attention;
#[path = "../common/mod.rs"]
mod common;
mod emu;
mod interp;
mod libraries;
mod more;
mod train;
mod zoo;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use interp::*;
use mpc_ir::Op;
use mpc_runtime::cuda::plan::{plan, Arg, Call};
use mpc_runtime::device::{CpuDevice, CpuMemory, Device, Regions};
use mpc_runtime::program::{Operand, Program, Region, TensorRef};
use mpc_runtime::{HostTensor, Tolerance};

fn whole(dev: &mut CpuDevice, regions: &mut Regions<CpuMemory>, r: Region) -> Vec<u8> {
    let mem = regions.get_mut(r);
    let len = mem.bytes().len() as u64;
    dev.read(mem, 0, len).unwrap()
}

/// A copy of the CPU device's regions for the plans to run over.
fn copy_of(dev: &mut CpuDevice, regions: &mut Regions<CpuMemory>) -> Memory {
    Memory {
        arena: whole(dev, regions, Region::Arena),
        state: whole(dev, regions, Region::State),
        constants: whole(dev, regions, Region::Constants),
        work: Vec::new(),
        work_in_arena: None,
        aux: Vec::new(),
        flag: vec![0; 4],
        addresses: HashMap::new(),
        emulated: None,
    }
}

fn bytes(t: &HostTensor) -> Vec<u8> {
    let mut b = vec![0u8; t.bytes()];
    t.write_le_bytes(&mut b);
    b
}

/// The program's arena, state and constants on the CPU device: the constants and the initial
/// state written, and the inputs fed.
fn loaded(dev: &mut CpuDevice, program: &Program, feeds: &HashMap<String, HostTensor>) -> [CpuMemory; 3] {
    let mut arena = dev.alloc(Region::Arena, program.arena_bytes).unwrap();
    let mut state = dev.alloc(Region::State, program.state_layout.bytes).unwrap();
    let mut constants = dev.alloc(Region::Constants, program.constants_bytes).unwrap();
    for (place, t) in &program.constants {
        dev.write(&mut constants, place.offset, t.bytes()).unwrap();
    }
    for (place, t) in &program.state_init {
        dev.write(&mut state, place.offset, t.bytes()).unwrap();
    }
    for (name, place) in &program.inputs {
        dev.write(&mut arena, place.offset, &bytes(&feeds[name])).unwrap();
    }
    [arena, state, constants]
}

/// Runs `program` on the CPU device launch by launch; each launch whose plan this file can
/// interpret is also run by the interpreter on a copy of the regions just before it, and the
/// two results are compared. The op types checked.
fn check_program(label: &str, program: &Program, feeds: &HashMap<String, HostTensor>) -> Vec<String> {
    let mut dev = CpuDevice::default();
    let [mut arena, mut state, mut constants] = loaded(&mut dev, program, feeds);
    let mut regions = Regions { arena: &mut arena, state: &mut state, constants: &mut constants };
    dev.prepare(program, &mut regions).unwrap();
    let constant = |t: &TensorRef| program.constant(t);
    let plans: Vec<_> = program
        .launches
        .iter()
        .map(|l| plan(l, &constant).unwrap_or_else(|e| panic!("{label}: {}: {e}", l.node)))
        .collect();
    let kernels = emu::kernels(&plans);
    let mut checked = Vec::new();
    for (l, p) in program.launches.iter().zip(&plans) {
        let runs = l.branches.is_none() && !p.calls.is_empty();
        let ours = runs && p.calls.iter().all(call_interpretable);
        let before = runs.then(|| copy_of(&mut dev, &mut regions));
        dev.launch(&mut regions, l).unwrap();
        let Some(before) = before else {
            if !p.calls.is_empty() {
                checked.push(format!("not interpreted: {}", l.op.op_type()));
            }
            continue;
        };
        if !ours {
            checked.push(format!("not interpreted: {}", l.op.op_type()));
        }
        // A convolution for cuDNN or a product for cuBLASLt: both what the library computes and
        // the fallback. Each as this file interprets the kernels, and as their source computes.
        let convs = p.calls.iter().any(|c| matches!(c, Call::Conv(_)));
        let lts = p.calls.iter().any(|c| matches!(c, Call::Lt(_)));
        let mut results = Vec::new();
        for emulated in [false, true] {
            if !emulated && !ours {
                continue;
            }
            for library in [true, false] {
                if !(library || convs || lts) {
                    continue;
                }
                let mut mem = before.clone();
                mem.emulated = emulated.then(|| kernels.clone());
                run_plan(&mut mem, p, library);
                let how = format!(
                    "{}{}",
                    if library { "" } else { " (the fallback)" },
                    if emulated { " (the kernels' source, emulated)" } else { "" }
                );
                results.push((mem, how, emulated, library));
            }
        }
        // A ReLU's bits, which only the library writes (the CPU device keeps none): the
        // gradient's product reads them from here, as it reads the library's on a GPU.
        if let (Some(mask), Some(Op::Relu)) = (&l.relu_mask, &l.epilogue) {
            let ran = results.iter().find(|r| r.3 && !r.2).map(|r| &r.0);
            let bits = ran.map_or_else(
                || vec![0; mask.bytes() as usize],
                |m| m.arena[mask.offset as usize..(mask.offset + mask.bytes()) as usize].to_vec(),
            );
            dev.write(regions.get_mut(Region::Arena), mask.offset, &bits).unwrap();
        }
        let scale = input_scale(l, &before);
        for (mem, how, emulated, _) in &results {
            // (Outputs nothing reads the plan may leave unwritten: a first convolution's dX.)
            let written = l
                .parts()
                .into_iter()
                .flat_map(|m| m.outputs.iter().enumerate().filter(|(k, _)| !m.unread.contains(k)).map(|(_, o)| o));
            for out in written {
                let mem_bytes = match out.region {
                    Region::Arena => &mem.arena,
                    Region::State => &mem.state,
                    Region::Constants => &mem.constants,
                };
                let (s, e) = (out.offset as usize, (out.offset + out.bytes()) as usize);
                let got = HostTensor::from_le_bytes(out.dtype, out.shape.clone(), &mem_bytes[s..e]);
                let want_bytes = dev.read(regions.get_mut(out.region), out.offset, out.bytes()).unwrap();
                let want = HostTensor::from_le_bytes(out.dtype, out.shape.clone(), &want_bytes);
                let t = Tolerance::for_dtype(out.dtype);
                let tol = Tolerance { rtol: 10.0 * t.rtol, atol: 10.0 * t.atol, rel_l2: 10.0 * t.rel_l2 };
                // The kernels' own sums run in another order than the CPU's: where they cancel
                // (a bias gradient through a normalisation, a loss-scaled gradient's sum), the
                // result is rounding noise of its inputs' size.
                let tol = if *emulated && out.dtype.is_float() { summed(tol, scale) } else { tol };
                // The attention kernels round P and dS to the operands' dtype for their products
                // (as FlashAttention does; the unfused chain rounds them for its products too):
                // where a gradient cancels (dQ = Σ dS·K, and Σ dS = 0 over a row), its elements
                // keep that rounding at the size of the terms, not of the result. Each element
                // within the relative L2 bound of the tensor's RMS.
                let tol = if *emulated && matches!(l.op, Op::Attention(_) | Op::AttentionGrad(_)) {
                    let w = want.f64s();
                    let rms = (w.iter().map(|x| x * x).sum::<f64>() / w.len().max(1) as f64).sqrt();
                    Tolerance { atol: tol.atol.max(10.0 * t.rel_l2 * rms), ..tol }
                } else {
                    tol
                };
                if let Err(e) = tol.check(&got, &want) {
                    panic!(
                        "{label}: {} ({}){how}: the plan computes another {:?}{:?} at {:?}: {e}",
                        l.node,
                        l.op.op_type(),
                        out.dtype,
                        out.shape,
                        out.region
                    );
                }
            }
        }
        if !ours {
            // Compared as the kernels' source computes it, with no interpretation beside it.
            checked.push(format!("emulated: {}", l.op.op_type()));
            continue;
        }
        checked.push(l.op.op_type().to_string());
        if convs {
            checked.push(format!("{} for cuDNN", l.op.op_type()));
        }
        if lts {
            checked.push(format!("{} for cuBLASLt", l.op.op_type()));
        }
        if let Some(s) = &l.sibling {
            checked.push(format!("{} with a {} sibling", l.op.op_type(), s.op.op_type()));
        }
        if let Some(e) = &l.epilogue {
            checked.push(format!("{} with a {} epilogue", l.op.op_type(), e.op_type()));
        }
        if l.relu_prologue.is_some() {
            checked.push(format!("{} through a ReluGrad", l.op.op_type()));
        }
        if l.inputs.iter().any(|o| matches!(o, Operand::Permuted(..))) {
            checked.push(format!("{} through a permutation", l.op.op_type()));
        }
        if p.calls.iter().any(|c| matches!(c, Call::Gemm(g) if g.pointers.is_some())) {
            checked.push(format!("{} by arrays of addresses", l.op.op_type()));
        }
    }
    checked
}

/// The largest magnitude among the float tensors the launch reads, and how many elements they
/// hold: what a sum over them can lose to rounding.
fn input_scale(l: &mpc_runtime::program::Launch, m: &Memory) -> (f64, usize) {
    let (mut most, mut count) = (0f64, 0usize);
    for t in l.parts().into_iter().flat_map(|p| p.operands()).filter_map(|o| o.tensor()) {
        if !t.dtype.is_float() {
            continue;
        }
        let bytes = match t.region {
            Region::Arena => &m.arena,
            Region::State => &m.state,
            Region::Constants => &m.constants,
        };
        let (s, e) = (t.offset as usize, (t.offset + t.bytes()) as usize);
        let v = HostTensor::from_le_bytes(t.dtype, t.shape.clone(), &bytes[s..e]).f64s();
        most = v.iter().filter(|x| x.is_finite()).fold(most, |a, x| a.max(x.abs()));
        count += v.len();
    }
    (most, count)
}

/// `tol` with an absolute floor of a sum's rounding error over inputs of `scale` (f32
/// accumulation, the error growing as the root of the count), and a relative L2 error that only
/// counts above that floor.
fn summed(tol: Tolerance, (most, count): (f64, usize)) -> Tolerance {
    let floor = f32::EPSILON as f64 * most * (count.max(1) as f64).sqrt();
    Tolerance { atol: tol.atol.max(floor), rel_l2: if floor > tol.atol { f64::INFINITY } else { tol.rel_l2 }, ..tol }
}

const CUDA: mpc_runtime::program::DeviceCaps =
    mpc_runtime::program::DeviceCaps { name: "cuda", align: 256, memory: 1 << 40, fuse: true };

#[test]
fn the_plans_of_the_fixtures_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            for train in [false, true] {
                let Some(g) = common::compiled(name, policy, train).ok() else { continue };
                let dims: HashMap<String, u64> = [("batch".to_string(), 3)].into();
                let (bound, _) = mpc::summary::bind_inputs(&g, &dims).unwrap();
                let Ok(program) = mpc::run::lower_bound(&bound, CUDA, None, None, &fixture(name)) else { continue };
                if program.host_reads > 0 {
                    continue;
                }
                let feeds = mpc::run::random_inputs(&bound, 9, &dims).unwrap();
                let label = format!("{name} {policy}{}", if train { " train" } else { "" });
                for op in check_program(&label, &program, &feeds) {
                    *seen.entry(op).or_default() += 1;
                }
            }
        }
    }
    println!("launches checked against the CPU by op: {seen:?}");
    let left: Vec<&String> = seen.keys().filter(|k| k.starts_with("not interpreted")).collect();
    assert!(left.is_empty(), "launches this file cannot check: {left:?}");
    // (The fixtures' Transposes are all read or written by their matrix products now; the single
    // ops below launch some.)
    for op in [
        "MatMul",
        "Gemm",
        "Gemm for cuBLASLt",
        "Gemm with a ReduceSum sibling",
        "MatMul through a permutation",
        "MatMul with a Transpose epilogue",
        "MatMul with a Add epilogue",
        "MatMul for cuBLASLt",
        "Conv",
        "ConvGrad",
    ] {
        assert!(seen.contains_key(op), "no {op} launch was checked: {seen:?}");
    }
}

/// The training step of a GPT-shaped model with its loss inside and no other output
/// (`tests/models/tiny_gpt_loss.onnx`): under mixed precision its forward loss reads the f16 or
/// bf16 logits widened and its gradient writes them low (the `_wide_` loss kernels), and
/// SoftmaxGrad reads the f16 or bf16 gradient and probabilities widened (in a fused chain, with
/// the scale's gradient and the Cast back, and on its own where fusion is off); with
/// `--fused-attention`, the attention kernels read the heads where they lie.
#[test]
fn the_plans_of_a_training_step_with_its_loss_inside_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    use mpc_passes::train::{Loss, TrainOptions};
    use mpc_runtime::program::{lower, LowerOptions};
    let mut kernels = std::collections::BTreeSet::new();
    let mut chains = std::collections::BTreeSet::new();
    let (mut gelu_grads, mut causal) = (0, 0);
    // The tiny GPT, and the same with F.scaled_dot_product_attention(is_causal) as PyTorch
    // exports it (its causal mask computed in the graph, folded when the step is lowered), and as
    // one ONNX Attention node (opset 23, expanded, its causal mask a constant).
    for (model, policy, unfused, fused_attention) in [
        ("tiny_gpt_loss", "fp32", false, false),
        ("tiny_gpt_loss", "mixed", false, false),
        ("tiny_gpt_loss", "mixed-bf16", false, false),
        ("tiny_gpt_loss", "mixed", true, false),
        ("tiny_gpt_loss", "mixed-bf16", true, false),
        ("tiny_gpt_loss", "mixed", false, true),
        ("tiny_gpt_loss", "mixed-bf16", false, true),
        ("tiny_gpt_sdpa_loss", "mixed", false, true),
        ("tiny_gpt_sdpa_loss", "mixed-bf16", false, true),
        ("tiny_gpt_attention23_loss", "mixed", false, true),
    ] {
        let path = fixture(model);
        let mut g = mpc::load(&path).unwrap();
        let t = TrainOptions { loss: Loss::Output("loss".into()), ..TrainOptions::default() };
        let opts = mpc::Options { policy: Some(policy.into()), train: Some(t), fused_attention, ..Default::default() };
        mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
        let dims: HashMap<String, u64> = [("batch".to_string(), 3)].into();
        let (bound, _) = mpc::summary::bind_inputs(&g, &dims).unwrap();
        let program = lower(&bound, CUDA, LowerOptions { unfused, ..Default::default() }).unwrap();
        let constant = |t: &TensorRef| program.constant(t);
        for l in &program.launches {
            chains.extend(l.chain.as_ref().map(|c| c.kind()));
            for c in &plan(l, &constant).unwrap().calls {
                match c {
                    Call::Kernel(k) => {
                        kernels.insert(k.name.clone());
                        // The causal mask applied by the kernels themselves (no mask read).
                        if k.name.starts_with("attention_") && k.args.last() == Some(&Arg::I32(1)) {
                            causal += 1;
                        }
                    }
                    // The GELU's gradient in the product that makes its dY (cuBLASLt's DGELU),
                    // its fallback the GEMM and the gradient's kernel.
                    Call::Lt(g) if g.gelu_grad.is_some() => {
                        assert!(g
                            .fallback
                            .iter()
                            .any(|f| matches!(f, Call::Kernel(k) if k.name.starts_with("train_gelu_grad_"))));
                        gelu_grads += 1;
                    }
                    _ => {}
                }
            }
        }
        let feeds = mpc::run::random_inputs(&bound, 5, &dims).unwrap();
        let how = match (unfused, fused_attention) {
            (true, _) => " unfused",
            (_, true) => " fused attention",
            _ => "",
        };
        check_program(&format!("{model} {policy} train{how}"), &program, &feeds);
    }
    for c in ["Fused(Cast+Mul+Add+Softmax+Cast)", "Fused(SoftmaxGrad+Mul+Cast)"] {
        assert!(chains.contains(c), "no {c}: {chains:?}");
    }
    // The fused attention's causal masks, found constant and applied by the kernels: two layers'
    // forward and backward (three kernels) under both low dtypes, of the first two models, and
    // under mixed of the third.
    assert_eq!(causal, 30, "the causal masks are read, not applied");
    // The fused programs' GELU gradients, one per layer under each policy.
    assert!(gelu_grads >= 3, "{gelu_grads} GELU gradients in products");
    for k in [
        "loss_softmax_ce_wide_f16_i64",
        "loss_softmax_ce_grad_wide_f16_i64",
        "loss_softmax_ce_wide_bf16_i64",
        "softmax_softmax_grad_wide_f16_f16",
        "softmax_softmax_grad_wide_bf16_bf16",
        "norm_layer_norm_f32_f32_yf16",
        "norm_layer_norm_f32_f32_ybf16",
        "norm_layer_norm_grad_f32_f32_dyf16",
        "norm_layer_norm_grad_params_f32_f32_dybf16",
        "train_adam_multi_f32",
        "attention_fwd_d16_f16",
        "attention_delta_f16",
        "attention_bwd_dkdv_d16_f16",
        "attention_bwd_dq_d16_bf16",
    ] {
        assert!(kernels.contains(k), "{k} never ran: {kernels:?}");
    }
}

/// Single ops with the awkward cases: broadcast batch dims, transposes, groups, dilations, pads,
/// output padding, negative steps, a Pad crop with a computed value.
#[test]
fn the_plans_of_awkward_single_ops_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let mut seen = std::collections::BTreeSet::new();
    let cases = [
        ("input %0 \"a\": f32[2,1,3,5]\n  input %1 \"b\": f32[1,4,5,2]\n  %2 \"y\": f32[2,4,3,2] = MatMul(%0, %1)\n  output %2", "MatMul"),
        // Operands read transposed (a fused Transpose of the last two axes), one broadcast.
        ("input %0 \"a\": f32[2,1,5,3]\n  input %1 \"b\": f16[4,2,5]\n  %2 \"at\": f32[2,1,3,5] = Transpose[perm=[0,1,3,2]](%0)\n  %3 \"bc\": f32[4,2,5] = Cast[to=1](%1)\n  %4 \"bt\": f32[4,5,2] = Transpose[perm=[0,2,1]](%3)\n  %5 \"y\": f32[2,4,3,2] = MatMul(%2, %4)\n  output %5", "MatMul"),
        ("input %0 \"a\": f16[3,4,6]\n  input %1 \"b\": f16[5,6]\n  %2 \"bt\": f16[6,5] = Transpose(%1)\n  %3 \"y\": f16[3,4,5] = MatMul(%0, %2)\n  output %3", "MatMul"),
        ("input %0 \"a\": f32[5]\n  input %1 \"b\": f32[3,5,2]\n  %2 \"y\": f32[3,2] = MatMul(%0, %1)\n  output %2", "MatMul"),
        // Products written through a Transpose (their epilogue): heads merged back (arrays of
        // addresses), a transposed product (rows contiguous), both, and a broadcast operand.
        ("input %0 \"a\": f16[2,3,5,4]\n  input %1 \"b\": f16[2,3,4,6]\n  %2 \"p\": f16[2,3,5,6] = MatMul(%0, %1)\n  %3 \"y\": f16[2,5,3,6] = Transpose[perm=[0,2,1,3]](%2)\n  output %3", "MatMul"),
        ("input %0 \"a\": f32[3,5,4]\n  input %1 \"b\": f32[3,4,6]\n  %2 \"p\": f32[3,5,6] = MatMul(%0, %1)\n  %3 \"y\": f32[3,6,5] = Transpose[perm=[0,2,1]](%2)\n  output %3", "MatMul"),
        ("input %0 \"a\": f16[2,3,5,4]\n  input %1 \"b\": f16[2,3,4,6]\n  %2 \"p\": f16[2,3,5,6] = MatMul(%0, %1)\n  %3 \"y\": f16[2,6,3,5] = Transpose[perm=[0,3,1,2]](%2)\n  output %3", "MatMul"),
        ("input %0 \"a\": f32[3,5,4]\n  input %1 \"b\": f32[2,3,4,6]\n  %2 \"p\": f32[2,3,5,6] = MatMul(%0, %1)\n  %3 \"y\": f32[3,5,2,6] = Transpose[perm=[1,2,0,3]](%2)\n  output %3", "MatMul"),
        ("input %0 \"a\": f32[1,3,5,4]\n  input %1 \"b\": f32[2,1,4,6]\n  %2 \"p\": f32[2,3,5,6] = MatMul(%0, %1)\n  %3 \"y\": f32[2,5,3,6] = Transpose[perm=[0,2,1,3]](%2)\n  output %3", "MatMul"),
        // Operands read through a permutation (attention's q and kᵀ split from [B, S, H, D]),
        // and both sides at once.
        ("input %0 \"q\": f16[2,5,3,4]\n  input %1 \"k\": f16[2,6,3,4]\n  %2 \"qt\": f16[2,3,5,4] = Transpose[perm=[0,2,1,3]](%0)\n  %3 \"kt\": f16[2,3,4,6] = Transpose[perm=[0,2,3,1]](%1)\n  %4 \"y\": f16[2,3,5,6] = MatMul(%2, %3)\n  output %4", "MatMul"),
        ("input %0 \"p\": f32[2,3,5,6]\n  input %1 \"v\": f32[2,6,3,4]\n  %2 \"vt\": f32[2,3,6,4] = Transpose[perm=[0,2,1,3]](%1)\n  %3 \"o\": f32[2,3,5,4] = MatMul(%0, %2)\n  %4 \"y\": f32[2,5,3,4] = Transpose[perm=[0,2,1,3]](%3)\n  output %4", "MatMul"),
        ("input %0 \"a\": f16[4,3,7]\n  input %1 \"b\": f16[7]\n  %2 \"y\": f16[4,3] = MatMul(%0, %1)\n  output %2", "MatMul"),
        ("input %0 \"a\": f32[5,3]\n  input %1 \"b\": f32[4,5]\n  input %2 \"c\": f32[4]\n  %3 \"y\": f32[3,4] = Gemm[transA=1, transB=1, alpha=0.5, beta=2.0](%0, %1, %2)\n  output %3", "Gemm"),
        ("input %0 \"x\": f32[2,4,7,6]\n  input %1 \"w\": f32[6,2,3,2]\n  input %2 \"b\": f32[6]\n  %3 \"y\": f32[2,6,4,5] = Conv[group=2, pads=[1,0,1,1], strides=[2,1], dilations=[1,2]](%0, %1, %2)\n  output %3", "Conv"),
        ("input %0 \"x\": f32[2,4,5]\n  input %1 \"w\": f32[4,3,3]\n  %2 \"y\": f32[2,6,11] = ConvTranspose[group=2, strides=[2], pads=[1,0], output_padding=[1]](%0, %1)\n  output %2", "ConvTranspose"),
        ("input %0 \"x\": f32[2,3,4]\n  %1 \"y\": f32[4,2,3] = Transpose[perm=[2,0,1]](%0)\n  output %1", "Transpose"),
        // Transposes that move the last axis, in 32 x 32 tiles with partial edges (attention's kᵀ
        // and its gradient).
        ("input %0 \"x\": f16[2,40,3,33]\n  %1 \"y\": f16[2,3,33,40] = Transpose[perm=[0,2,3,1]](%0)\n  output %1", "Transpose"),
        ("input %0 \"x\": f16[2,3,33,70]\n  %1 \"y\": f16[2,70,3,33] = Transpose[perm=[0,3,1,2]](%0)\n  output %1", "Transpose"),
        // Fused attention: partial query and key tiles, a mask broadcast over batch and heads; the
        // heads read where they lie in [B, S, H, D] (a head dim of 100: the kernels' 128); the
        // gradient with a mask per batch and a head dim of 8 (the kernels' 16); three dims.
        ("input %0 \"q\": f16[2,3,70,64]\n  input %1 \"k\": f16[2,3,45,64]\n  input %2 \"v\": f16[2,3,45,64]\n  input %3 \"m\": f32[70,45]\n  %4 \"y\": f16[2,3,70,64], %5 \"lse\": f32[2,3,70] = ai.mpc::Attention[scale=0.125](%0, %1, %2, %3)\n  output %4\n  output %5", "Attention"),
        ("input %0 \"q4\": bf16[2,40,2,100]\n  input %1 \"k4\": bf16[2,40,2,100]\n  input %2 \"v4\": bf16[2,40,2,100]\n  %3 \"q\": bf16[2,2,40,100] = Transpose[perm=[0,2,1,3]](%0)\n  %4 \"k\": bf16[2,2,40,100] = Transpose[perm=[0,2,1,3]](%1)\n  %5 \"v\": bf16[2,2,40,100] = Transpose[perm=[0,2,1,3]](%2)\n  %6 \"y\": bf16[2,2,40,100], %7 \"lse\": f32[2,2,40] = ai.mpc::Attention[scale=0.1](%3, %4, %5)\n  output %6\n  output %7", "Attention"),
        ("input %0 \"dy\": f16[2,2,33,8]\n  input %1 \"q\": f16[2,2,33,8]\n  input %2 \"k\": f16[2,2,50,8]\n  input %3 \"v\": f16[2,2,50,8]\n  input %4 \"m\": f32[2,1,33,50]\n  %5 \"y\": f16[2,2,33,8], %6 \"lse\": f32[2,2,33] = ai.mpc::Attention[scale=0.3](%1, %2, %3, %4)\n  %7 \"dq\": f16[2,2,33,8], %8 \"dk\": f16[2,2,50,8], %9 \"dv\": f16[2,2,50,8] = ai.mpc::AttentionGrad[scale=0.3](%0, %1, %2, %3, %5, %6, %4)\n  output %7\n  output %8\n  output %9", "AttentionGrad"),
        ("input %0 \"dy\": bf16[3,70,64]\n  input %1 \"q\": bf16[3,70,64]\n  input %2 \"k\": bf16[3,70,64]\n  input %3 \"v\": bf16[3,70,64]\n  %4 \"y\": bf16[3,70,64], %5 \"lse\": f32[3,70] = ai.mpc::Attention[scale=0.125](%1, %2, %3)\n  %6 \"dq\": bf16[3,70,64], %7 \"dk\": bf16[3,70,64], %8 \"dv\": bf16[3,70,64] = ai.mpc::AttentionGrad[scale=0.125](%0, %1, %2, %3, %4, %5)\n  output %6\n  output %7\n  output %8", "AttentionGrad"),
        ("input %0 \"dy\": f16[2,33,3,64]\n  input %1 \"q\": f16[2,33,3,64]\n  input %2 \"k\": f16[2,20,3,64]\n  input %3 \"v\": f16[2,20,3,64]\n  input %4 \"m\": f32[3,33,20]\n  %5 \"y\": f16[2,33,3,64], %6 \"lse\": f32[2,3,33] = ai.mpc::Attention[layout=\"bshd\", scale=0.125](%1, %2, %3, %4)\n  %7 \"dq\": f16[2,33,3,64], %8 \"dk\": f16[2,20,3,64], %9 \"dv\": f16[2,20,3,64] = ai.mpc::AttentionGrad[layout=\"bshd\", scale=0.125](%0, %1, %2, %3, %5, %6, %4)\n  output %7\n  output %8\n  output %9", "AttentionGrad"),
        ("input %0 \"x\": i64[65,3]\n  %1 \"y\": i64[3,65] = Transpose(%0)\n  output %1", "Transpose"),
        ("input %0 \"x\": f32[5,6]\n  init %1 \"s\" = i64[2]{4, 1}\n  init %2 \"e\" = i64[2]{0, 6}\n  init %3 \"ax\" = i64[2]{0, 1}\n  init %4 \"st\" = i64[2]{-2, 2}\n  %5 \"y\": f32[2,3] = Slice(%0, %1, %2, %3, %4)\n  output %5", "Slice"),
        ("input %0 \"a\": f32[2,3]\n  input %1 \"b\": f32[2,1]\n  %2 \"y\": f32[2,4] = Concat[axis=1](%0, %1)\n  output %2", "Concat"),
        ("input %0 \"x\": f32[3,1,4]\n  init %1 \"s\" = i64[4]{2, 3, 3, 1}\n  %2 \"y\": f32[2,3,3,4] = Expand(%0, %1)\n  output %2", "Expand"),
        ("input %0 \"x\": f32[3,4,5,2]\n  init %1 \"ax\" = i64[2]{0, 2}\n  %2 \"y\": f32[1,4,1,2] = ReduceSum(%0, %1)\n  output %2", "ReduceSum"),
        ("input %0 \"x\": f32[3,4,5,2]\n  init %1 \"ax\" = i64[2]{1, 2}\n  %2 \"y\": f32[3,2] = ReduceMax[keepdims=0](%0, %1)\n  output %2", "ReduceMax"),
        ("input %0 \"x\": f32[2,3,4]\n  %1 \"y\": f32[2,3,4] = Softmax[axis=1](%0)\n  output %1", "Softmax"),
        ("input %0 \"x\": f16[3,7]\n  %1 \"y\": f16[3,7] = LogSoftmax[axis=-1](%0)\n  output %1", "LogSoftmax"),
        ("input %0 \"x\": f32[2,5,40]\n  %1 \"y\": i64[2,40] = ArgMax[axis=1, keepdims=0, select_last_index=1](%0)\n  output %1", "ArgMax"),
        ("input %0 \"x\": f32[8]\n  init %1 \"i\" = i64[4,1]{0, 0, -1, 0}\n  init %2 \"u\" = f32[4]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[8] = ScatterND[reduction=\"add\"](%0, %1, %2)\n  output %3", "ScatterND"),
        ("input %0 \"x\": f16[3,2]\n  init %1 \"i\" = i64[2,1]{2, 0}\n  init %2 \"u\" = f16[2,2]{1.0, 2.0, 3.0, 4.0}\n  %3 \"y\": f16[3,2] = ScatterND(%0, %1, %2)\n  output %3", "ScatterND"),
        ("input %0 \"x\": f32[2,3]\n  init %1 \"i\" = i64[2,2]{2, 0, 2, -1}\n  init %2 \"u\" = f32[2,2]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[2,3] = ScatterElements[axis=1, reduction=\"add\"](%0, %1, %2)\n  output %3", "ScatterElements"),
        ("input %0 \"x\": i64[2,3]\n  init %1 \"i\" = i32[1,3]{1, 1, 0}\n  init %2 \"u\" = i64[1,3]{10, 20, 30}\n  %3 \"y\": i64[2,3] = ScatterElements[reduction=\"max\"](%0, %1, %2)\n  output %3", "ScatterElements"),
        ("input %0 \"x\": f32[2,3,4]\n  init %1 \"i\" = i64[2,2,1]{1, 0, 2, 2}\n  %2 \"y\": f32[2,2,4] = GatherND[batch_dims=1](%0, %1)\n  output %2", "GatherND"),
        ("input %0 \"x\": f32[3,4]\n  init %1 \"i\" = i64[2,2]{0, 3, 2, -1}\n  %2 \"y\": f32[2] = GatherND(%0, %1)\n  output %2", "GatherND"),
        ("input %0 \"x\": f32[5,3]\n  init %1 \"i\" = i64[2,2]{4, -1, 0, 2}\n  %2 \"y\": f32[2,2,3] = Gather(%0, %1)\n  output %2", "Gather"),
        ("input %0 \"x\": f32[3,4]\n  init %1 \"i\" = i64[2,4]{0, 2, 1, -1, 2, 2, 0, 1}\n  %2 \"y\": f32[2,4] = GatherElements(%0, %1)\n  output %2", "GatherElements"),
        ("input %0 \"x\": f32[2,3,7,6]\n  %1 \"y\": f32[2,3,4,3] = AveragePool[kernel_shape=[3,2], pads=[1,1,1,0], strides=[2,2], count_include_pad=1, ceil_mode=1](%0)\n  output %1", "AveragePool"),
        ("input %0 \"x\": f32[2,3,9]\n  %1 \"y\": f32[2,3,4] = MaxPool[kernel_shape=[2], dilations=[3], strides=[2], pads=[1,1]](%0)\n  output %1", "MaxPool"),
        ("input %0 \"x\": f32[3,4]\n  input %1 \"v\": f32[]\n  init %2 \"p\" = i64[4]{1, -1, 0, 2}\n  %3 \"y\": f32[4,5] = Pad(%0, %2, %1)\n  output %3", "Pad"),
        // Few long columns: the rows split, partials combined in a second pass.
        ("input %0 \"x\": f32[1024,40]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[40] = ReduceSum[keepdims=0](%0, %1)\n  output %2", "ReduceSum"),
        ("input %0 \"x\": f16[2,600,64]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f16[2,1,64] = ReduceMean(%0, %1)\n  output %2", "ReduceMean"),
        ("input %0 \"x\": f32[700,33]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[1,33] = ReduceMax(%0, %1)\n  output %2", "ReduceMax"),
        ("input %0 \"x\": f32[3,520,40]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f32[3,40] = ReduceL2[keepdims=0](%0, %1)\n  output %2", "ReduceL2"),
        // ReduceLogSum split over many rows (of positive values), and Mish's own kernel.
        ("input %0 \"x\": f32[1024,40]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"a\": f32[1024,40] = Abs(%0)\n  %3 \"y\": f32[40] = ReduceLogSum[keepdims=0](%2, %1)\n  output %3", "ReduceLogSum"),
        ("input %0 \"x\": f16[6,50]\n  %1 \"y\": f16[6,50] = Mish(%0)\n  output %1", "Mish"),
        ("input %0 \"dy\": f32[600,48]\n  input %1 \"x\": f32[600,48]\n  input %2 \"s\": f32[48]\n  %3 \"dx\": f32[600,48], %4 \"ds\": f32[48], %5 \"db\": f32[48] = ai.mpc::LayerNormalizationGrad[axis=-1](%0, %1, %2)\n  output %3\n  output %4\n  output %5", "LayerNormalizationGrad"),
        // Few channels of many elements: batch norm statistics in passes.
        ("input %0 \"x\": f32[4,3,80,80]\n  input %1 \"s\": f32[3]\n  input %2 \"b\": f32[3]\n  input %3 \"m\": f32[3]\n  input %4 \"v\": f32[3]\n  %5 \"y\": f32[4,3,80,80], %6 \"rm\": f32[3], %7 \"rv\": f32[3] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"dy\": f16[4,3,80,80]\n  input %1 \"x\": f16[4,3,80,80]\n  input %2 \"s\": f32[3]\n  %3 \"dx\": f16[4,3,80,80], %4 \"ds\": f16[3], %5 \"db\": f16[3] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5", "BatchNormalizationGrad"),
        ("input %0 \"x\": f32[8,50257]\n  init %1 \"l\" = i64[8]{0, 50256, 7, 31000, 12, 3, 50000, 9}\n  %2 \"y\": f32[] = SoftmaxCrossEntropyLoss[reduction=\"mean\"](%0, %1)\n  output %2", "SoftmaxCrossEntropyLoss"),
        // CumProd's gradient in both orders (an f64 scratch of the products), and CumProd on ints.
        ("input %0 \"dy\": f32[3,7,2]\n  input %1 \"x\": f32[3,7,2]\n  init %2 \"ax\" = i64[]{1}\n  %3 \"dx\": f32[3,7,2] = ai.mpc::CumProdGrad[exclusive=1](%0, %1, %2)\n  output %3", "CumProdGrad"),
        ("input %0 \"dy\": f16[5,4]\n  input %1 \"x\": f16[5,4]\n  init %2 \"ax\" = i64[]{0}\n  %3 \"dx\": f16[5,4] = ai.mpc::CumProdGrad[reverse=1](%0, %1, %2)\n  output %3", "CumProdGrad"),
        ("input %0 \"x\": i64[4,6]\n  init %1 \"ax\" = i64[]{-1}\n  %2 \"y\": i64[4,6] = CumProd(%0, %1)\n  output %2", "CumProd"),
        // RoiAlign's gradient by atomic additions: into dX (f32, max bins), and into an f32
        // workspace cast to f16 (averaged bins, adaptive sampling).
        ("input %0 \"dy\": f32[3,2,2,2]\n  input %1 \"x\": f32[2,2,5,6]\n  init %2 \"r\" = f32[3,4]{0.0, 0.0, 5.0, 4.0, 1.5, 0.5, 4.2, 3.9, -2.0, 3.0, 7.5, 6.5}\n  init %3 \"b\" = i64[3]{0, 1, 1}\n  %4 \"dx\": f32[2,2,5,6] = ai.mpc::RoiAlignGrad[mode=\"max\", output_height=2, output_width=2, sampling_ratio=2](%0, %1, %2, %3)\n  output %4", "RoiAlignGrad"),
        ("input %0 \"dy\": f16[3,2,3,2]\n  input %1 \"x\": f16[2,2,5,6]\n  init %2 \"r\" = f16[3,4]{0.0, 0.0, 5.0, 4.0, 1.5, 0.5, 4.25, 3.875, -2.0, 3.0, 7.5, 6.5}\n  init %3 \"b\" = i64[3]{1, 0, 1}\n  %4 \"dx\": f16[2,2,5,6] = ai.mpc::RoiAlignGrad[output_height=3, output_width=2](%0, %1, %2, %3)\n  output %4", "RoiAlignGrad"),
        // GELU's gradient 16 bytes at a time, and one element at a time.
        ("input %0 \"dy\": f16[64,96]\n  input %1 \"x\": f16[64,96]\n  %2 \"dx\": f16[64,96] = ai.mpc::GeluGrad[approximate=\"tanh\"](%0, %1)\n  output %2", "GeluGrad"),
        ("input %0 \"dy\": f32[7,9]\n  input %1 \"x\": f32[7,9]\n  %2 \"dx\": f32[7,9] = ai.mpc::GeluGrad(%0, %1)\n  output %2", "GeluGrad"),
        // Lone element-wise ops of many elements: generated kernels, 8 and 4 elements at a time.
        ("input %0 \"x\": f16[64,2048]\n  input %1 \"z\": f32[64,2048]\n  %2 \"r\": f16[64,2048] = Relu(%0)\n  %3 \"c\": f16[64,2048] = Cast[to=10](%1)\n  output %2\n  output %3", "Relu"),
        // Planes that are no whole number of 16-byte units: one element at a time.
        ("input %0 \"x\": f32[4,5,63,65]\n  input %1 \"s\": f32[5]\n  input %2 \"b\": f32[5]\n  input %3 \"m\": f32[5]\n  input %4 \"v\": f32[5]\n  %5 \"y\": f32[4,5,63,65], %6 \"rm\": f32[5], %7 \"rv\": f32[5] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"dy\": f16[4,5,63,65]\n  input %1 \"x\": f16[4,5,63,65]\n  input %2 \"s\": f32[5]\n  %3 \"dx\": f16[4,5,63,65], %4 \"ds\": f16[5], %5 \"db\": f16[5] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5", "BatchNormalizationGrad"),
        // Many channels, split in two (256 channels of 8192 elements).
        ("input %0 \"x\": f16[2,256,64,64]\n  input %1 \"s\": f32[256]\n  input %2 \"b\": f32[256]\n  input %3 \"m\": f32[256]\n  input %4 \"v\": f32[256]\n  %5 \"y\": f16[2,256,64,64], %6 \"rm\": f32[256], %7 \"rv\": f32[256] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"dy\": f32[2,256,64,64]\n  input %1 \"x\": f32[2,256,64,64]\n  input %2 \"s\": f32[256]\n  %3 \"dx\": f32[2,256,64,64], %4 \"ds\": f32[256], %5 \"db\": f32[256] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5", "BatchNormalizationGrad"),
        // f64 data: the norm and loss kernels compute and keep their statistics in f64; LayerNorm's
        // f32 Mean / InvStdDev (stash_type) are cast from them.
        ("input %0 \"x\": f64[3,2,5]\n  input %1 \"s\": f64[2,5]\n  input %2 \"b\": f64[2,5]\n  %3 \"y\": f64[3,2,5], %4 \"m\": f32[3,1,1], %5 \"r\": f32[3,1,1] = LayerNormalization[axis=1](%0, %1, %2)\n  output %3\n  output %4\n  output %5", "LayerNormalization"),
        ("input %0 \"x\": f64[2,3,4]\n  input %1 \"s\": f64[3]\n  input %2 \"b\": f64[3]\n  input %3 \"m\": f64[3]\n  input %4 \"v\": f64[3]\n  %5 \"y\": f64[2,3,4], %6 \"rm\": f64[3], %7 \"rv\": f64[3] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7", "BatchNormalization"),
        ("input %0 \"x\": f64[4,5,2]\n  init %1 \"l\" = i64[4,2]{0, 4, 2, 1, 3, 3, 4, 0}\n  init %2 \"w\" = f64[5]{1.0, 0.5, 2.0, 1.5, 0.25}\n  %3 \"y\": f64[] = SoftmaxCrossEntropyLoss[reduction=\"mean\", ignore_index=3](%0, %1, %2)\n  output %3", "SoftmaxCrossEntropyLoss"),
    ];
    for (body, op) in cases {
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  {body}\nend\n");
        let g = mpc_ir::text::parse(&text, None).unwrap_or_else(|e| panic!("{op}: {e}\n{text}"));
        let feeds = mpc::run::random_inputs(&g, 4, &HashMap::new()).unwrap();
        let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, std::path::Path::new(op)).unwrap();
        if op == "MatMul"
            && body.contains("Transpose")
            && !body.contains("%2 \"p\"")
            && !body.contains("\"q\"")
            && !body.contains("\"vt\"")
        {
            assert!(program.transposed > 0, "{body}: no operand is read transposed");
        }
        if op == "MatMul" && body.contains("%2 \"p\"") {
            assert_eq!(program.epilogues, 1, "{body}: the Transpose is not the product's epilogue");
        }
        if op == "Transpose" {
            let none = |_: &mpc_runtime::program::TensorRef| None;
            let tiled = program
                .launches
                .iter()
                .flat_map(|l| plan(l, &none).unwrap().calls)
                .any(|c| matches!(c, Call::Kernel(k) if k.name.starts_with("movement_transpose_")));
            assert!(tiled, "{body}: not copied in tiles");
        }
        let checked = check_program(op, &program, &feeds);
        let emulated = format!("emulated: {op}");
        assert!(checked.iter().any(|c| c == op || *c == emulated), "{op}: not checked ({checked:?})");
        seen.extend(checked);
    }
    for what in [
        "MatMul with a Transpose epilogue",
        "MatMul by arrays of addresses",
        "MatMul through a permutation",
        "Attention through a permutation",
    ] {
        assert!(seen.contains(what), "no {what}: {seen:?}");
    }
}

/// Each learning-rate schedule's kernel, run from its source, gives the CPU's rate at steps
/// across the warmup, the decay, its end and past it.
#[test]
fn the_learning_rate_schedules_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    for kind in ["constant", "linear", "cosine", "step", "one_cycle"] {
        let body = format!(
            "input %0 \"step\": i64[]\n  input %1 \"peak\": f32[]\n  \
             %2 \"lr\": f32[] = ai.mpc::LrSchedule[kind=\"{kind}\", warmup=30, total=200, min_ratio=0.05, step_size=25, gamma=0.5](%0, %1)\n  output %2"
        );
        let g = common::single_op(&body);
        for step in [0i64, 1, 29, 30, 31, 100, 199, 200, 250] {
            let feeds: HashMap<String, HostTensor> = [
                ("step".to_string(), HostTensor::from_i64(mpc_ir::DType::I64, vec![], vec![step])),
                ("peak".to_string(), HostTensor::from_f32(mpc_ir::DType::F32, vec![], vec![3e-4])),
            ]
            .into();
            let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, std::path::Path::new("lr")).unwrap();
            let checked = check_program(kind, &program, &feeds);
            assert!(checked.iter().any(|c| c == "LrSchedule"), "{kind} at {step}: not checked ({checked:?})");
        }
    }
}

/// Attention and its gradient of `[1, heads, s, d]` operands in `dtype` under a constant `[s, s]`
/// mask, each launch run from the kernels' source against the CPU; returns how many of the
/// attention kernel calls apply causality themselves (their last argument).
fn attention_under_a_constant_mask(label: &str, dtype: &str, heads: usize, s: usize, d: usize, mask: &[f64]) -> usize {
    let t = format!("{dtype}[1,{heads},{s},{d}]");
    let body = format!(
        "input %0 \"dy\": {t}\n  input %1 \"q\": {t}\n  input %2 \"k\": {t}\n  input %3 \"v\": {t}\n  \
         %5 \"y\": {t}, %6 \"lse\": f32[1,{heads},{s}] = ai.mpc::Attention[scale=0.25](%1, %2, %3)\n  \
         %7 \"dq\": {t}, %8 \"dk\": {t}, %9 \"dv\": {t} = ai.mpc::AttentionGrad[scale=0.25](%0, %1, %2, %3, %5, %6)\n  \
         output %5\n  output %6\n  output %7\n  output %8\n  output %9"
    );
    let mut g = common::single_op(&body);
    let mask = g.add_initializer("m", mpc_ir::Tensor::from_f64_as(mpc_ir::DType::F32, vec![s as u64, s as u64], mask));
    let nodes: Vec<_> = g.node_ids().collect();
    for n in nodes {
        match g.node(n).op {
            Op::Attention(_) => g.set_input(n, 3, Some(mask)),
            Op::AttentionGrad(_) => g.set_input(n, 6, Some(mask)),
            _ => {}
        }
    }
    let feeds = mpc::run::random_inputs(&g, 4, &HashMap::new()).unwrap();
    let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, std::path::Path::new(label)).unwrap();
    let checked = check_program(label, &program, &feeds);
    assert!(checked.iter().any(|c| c == "AttentionGrad"), "{checked:?}");
    let constant = |t: &TensorRef| program.constant(t);
    let calls: Vec<_> = program.launches.iter().flat_map(|l| plan(l, &constant).unwrap().calls).collect();
    calls
        .iter()
        .filter(
            |c| matches!(c, Call::Kernel(k) if k.name.starts_with("attention_") && k.args.last() == Some(&Arg::I32(1))),
        )
        .count()
}

/// A constant mask of float's lowest value (a padding mask as Hugging Face writes it) over all
/// keys but the first of some rows and every third key of the others: the kernels read it and
/// give those keys no weight, as the CPU does, forward and backward. (A row it masks wholly is not
/// here: the kernels' log-sum-exp of such a row, in base 2, is not the CPU's, though Y is.)
#[test]
fn attention_under_a_lowest_float_mask_computes_what_the_cpu_computes() {
    let _report = emu::Report;
    // Rows 0 to 2 see key 0 only; the others lose every third key (key 0 among them) to f32::MIN.
    let v: Vec<f64> = (0..40 * 40)
        .map(|e| if (e / 40 < 3 && e % 40 != 0) || (e / 40 >= 3 && e % 3 == 0) { f32::MIN as f64 } else { 0.0 })
        .collect();
    assert_eq!(attention_under_a_constant_mask("attention under f32::MIN", "f16", 2, 40, 16, &v), 0);
}

/// A causal mask over several query and key tiles (the last ones partial): the kernels apply it
/// themselves, skip the tiles above the diagonal, and the forward and dQ take their query tiles
/// in reverse order; all as the CPU computes with the mask read.
#[test]
fn attention_under_a_causal_mask_over_several_tiles_computes_what_the_cpu_computes() {
    let _report = emu::Report;
    let causal =
        |s: usize| -> Vec<f64> { (0..s * s).map(|e| if e % s > e / s { f64::NEG_INFINITY } else { 0.0 }).collect() };
    // Head dims 64 (query tiles of 64, key tiles of 64 forward and 32 in dK/dV) and 128 (key tiles
    // of 32 forward, query tiles of 16 in dK/dV): the forward, δ, dK/dV and dQ kernels, the
    // three causal ones each flagged.
    assert_eq!(attention_under_a_constant_mask("causal d64", "f16", 1, 150, 64, &causal(150)), 3);
    assert_eq!(attention_under_a_constant_mask("causal d128", "bf16", 2, 70, 128, &causal(70)), 3);
}

/// Training steps run end to end from the kernels' source: `steps` steps of `program`, every
/// launch's plan over one memory (the state carried from step to step, each next state copied
/// into its slot as a session does), beside the CPU device running the same steps. Returns each
/// state value and output after the last step: its name, its largest difference from the CPU's
/// and the CPU's largest magnitude. Where launch-by-launch checks start every launch
/// from the CPU's memory, this also sees a kernel that writes outside its outputs, and a
/// workspace, flag or address table that does not survive from one launch to the next.
fn run_steps(
    program: &Program,
    feeds: &HashMap<String, HostTensor>,
    steps: usize,
) -> Vec<(String, f64, f64, mpc_ir::DType)> {
    let mut dev = CpuDevice::default();
    let [mut arena, mut state, mut constants] = loaded(&mut dev, program, feeds);
    let mut regions = Regions { arena: &mut arena, state: &mut state, constants: &mut constants };
    dev.prepare(program, &mut regions).unwrap();
    let constant = |t: &TensorRef| program.constant(t);
    let plans: Vec<_> = program.launches.iter().map(|l| plan(l, &constant).unwrap()).collect();
    let mut mem = Memory { emulated: Some(emu::kernels(&plans)), ..copy_of(&mut dev, &mut regions) };
    fn region(m: &mut Memory, r: Region) -> &mut Vec<u8> {
        match r {
            Region::Arena => &mut m.arena,
            Region::State => &mut m.state,
            Region::Constants => &mut m.constants,
        }
    }
    for _ in 0..steps {
        // Each step is fed again: the inputs' bytes are the arena's, reused once read.
        for (name, place) in &program.inputs {
            let b = bytes(&feeds[name]);
            dev.write(regions.get_mut(Region::Arena), place.offset, &b).unwrap();
            mem.arena[place.offset as usize..][..b.len()].copy_from_slice(&b);
        }
        for (i, (l, p)) in program.launches.iter().zip(&plans).enumerate() {
            dev.launch(&mut regions, l).unwrap();
            // The arena bytes no value holds during the launch are poisoned, and hold its scratch
            // where they are enough, as on the CUDA device: a value the memory plan thinks dead
            // there, but read later, breaks the results.
            let (at, free) = program.free_during(i);
            mem.arena[at as usize..][..free as usize].fill(0xFF);
            // cuDNN's scratch (none here: the interpreter computes its results directly) past the
            // plan's own, by the device's rule.
            let convs = p.calls.iter().filter(|c| matches!(c, Call::Conv(_))).count();
            let need = p.scratch_bytes(&vec![Some(0); convs]);
            mem.work_in_arena = (need > 0 && need <= free).then_some(at);
            run_plan(&mut mem, p, true);
        }
        mem.work_in_arena = None;
        for s in program.state.iter().filter(|s| s.next != s.slot) {
            dev.copy(&mut regions, &s.next, &s.slot).unwrap();
            let v = region(&mut mem, s.next.region)[s.next.offset as usize..][..s.next.bytes() as usize].to_vec();
            region(&mut mem, s.slot.region)[s.slot.offset as usize..][..v.len()].copy_from_slice(&v);
        }
    }
    let named = program.state_layout.values.iter().chain(&program.outputs);
    named
        .filter(|(_, t)| t.dtype.is_float())
        .map(|(n, t)| {
            let got = &region(&mut mem, t.region)[t.offset as usize..][..t.bytes() as usize];
            let got = HostTensor::from_le_bytes(t.dtype, t.shape.clone(), got).f64s();
            let want = dev.read(regions.get_mut(t.region), t.offset, t.bytes()).unwrap();
            let want = HostTensor::from_le_bytes(t.dtype, t.shape.clone(), &want).f64s();
            let most = want.iter().fold(0f64, |a, v| a.max(v.abs()));
            let diff = got.iter().zip(&want).fold(0f64, |a, (g, w)| if g == w { a } else { a.max((g - w).abs()) });
            (n.clone(), diff, most, t.dtype)
        })
        .collect()
}

/// Three training steps of each trainable fixture (Adam; fp32, mixed and mixed-bf16) run from the
/// kernels' source reach the CPU's weights, moments and loss scale. Adam divides each gradient by
/// its own root mean square, so a gradient that is rounding noise (a bias feeding a
/// normalisation) moves its weight by up to the learning rate with either sign: the bound is
/// twice the rate times the steps (and an f16 or bf16 copy's rounding), or 1e-2 of the value's
/// largest magnitude where that is more.
#[test]
fn training_steps_run_from_the_kernels_source_as_on_the_cpu() {
    let _report = emu::Report;
    let mut runs = 0;
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let Some(g) = common::compiled(name, policy, true).ok() else { continue };
            let dims: HashMap<String, u64> = [("batch".to_string(), 4)].into();
            let (bound, _) = mpc::summary::bind_inputs(&g, &dims).unwrap();
            let Ok(program) = mpc::run::lower_bound(&bound, CUDA, None, None, &fixture(name)) else { continue };
            if program.host_reads > 0 || program.launches.iter().any(|l| l.branches.is_some()) {
                continue;
            }
            let feeds = mpc::run::random_inputs(&bound, 3, &dims).unwrap();
            let steps = 3;
            let lr = mpc_passes::train::TrainOptions::default().lr as f64;
            for (value, diff, most, dtype) in run_steps(&program, &feeds, steps) {
                let ulp = match dtype {
                    mpc_ir::DType::F16 => 2f64.powi(-10),
                    mpc_ir::DType::BF16 => 2f64.powi(-7),
                    _ => 0.0,
                };
                let bound = (1e-2 * most).max(2.0 * lr * steps as f64 + ulp * most);
                assert!(
                    diff <= bound,
                    "{name} {policy}: `{value}` differs by {diff:.3e} (largest magnitude {most:.3e}) after {steps} steps"
                );
            }
            runs += 1;
        }
    }
    assert!(runs >= 12, "only {runs} training programs ran");
}

/// Gradient accumulation's step (the sums, the count of micro-batches, the update and the loss
/// scale gated on the last one) run from the kernels' source: three micro-batches (an update after
/// the second, a sum held after the third) reach the CPU's state, under fp32 and mixed.
#[test]
fn accumulated_training_steps_run_from_the_kernels_source_as_on_the_cpu() {
    let _report = emu::Report;
    for policy in ["fp32", "mixed"] {
        let path = fixture("digits_mlp");
        let mut g = mpc::load(&path).unwrap();
        let t = mpc_passes::train::TrainOptions { accumulate: 2, ..Default::default() };
        let opts = mpc::Options { policy: Some(policy.into()), train: Some(t), ..Default::default() };
        mpc::compile(&mut g, &path, &opts, &mut |_, _| {}).unwrap();
        let dims: HashMap<String, u64> = [("batch".to_string(), 4)].into();
        let (bound, _) = mpc::summary::bind_inputs(&g, &dims).unwrap();
        let program = mpc::run::lower_bound(&bound, CUDA, None, None, &path).unwrap();
        let feeds = mpc::run::random_inputs(&bound, 3, &dims).unwrap();
        let lr = mpc_passes::train::TrainOptions::default().lr as f64;
        let results = run_steps(&program, &feeds, 3);
        let sums = results.iter().filter(|r| r.0.starts_with("mpc.grad_sum.") && r.2 > 0.0).count();
        assert!(sums >= 4, "{policy}: {sums} sums held after the third micro-batch");
        for (value, diff, most, _) in results {
            let bound = (1e-2 * most).max(2.0 * lr + 2f64.powi(-10) * most);
            assert!(diff <= bound, "{policy}: `{value}` differs by {diff:.3e} (largest magnitude {most:.3e})");
        }
    }
}

/// The single ops `cuda_vs_cpu` runs on a GPU at the sizes of the multi-pass and wide paths:
/// here their plans' kernels run from their source on the CPU (and are interpreted where this
/// file can), each launch against the CPU device.
#[test]
fn the_plans_of_large_single_ops_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    for body in common::LARGE_SINGLE_OPS {
        let g = common::single_op(body);
        let feeds = mpc::run::random_inputs(&g, 11, &HashMap::new()).unwrap();
        let program = mpc::run::lower_for_inputs(&g, &feeds, CUDA, std::path::Path::new("large_single_op")).unwrap();
        let t = std::time::Instant::now();
        let checked = check_program(body.lines().last().unwrap_or(body), &program, &feeds);
        println!("{:?}: {:.1} s", checked, t.elapsed().as_secs_f64());
    }
}

/// The ONNX conformance cases (where `MPC_ONNX_NODE_TESTS` points at them): each launch this
/// file can interpret computes on its plan what the CPU does.
#[test]
fn the_plans_of_the_conformance_cases_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let Some(cases) = common::conformance_cases() else { return };
    let (mut checked, mut skipped) = (0, 0);
    for common::ConformanceCase { name: label, model, graph: g, feeds } in &cases {
        let Ok(program) = mpc::run::lower_for_inputs(g, feeds, CUDA, model) else { continue };
        let constant = |t: &TensorRef| program.constant(t);
        let runs = program.host_reads == 0
            && program.launches.iter().all(|l| plan(l, &constant).is_ok())
            && mpc::run::run_once(g, feeds, model).is_ok();
        if !runs {
            skipped += 1;
            continue;
        }
        checked += check_program(label, &program, feeds).iter().filter(|o| !o.starts_with("not interpreted")).count();
    }
    println!("conformance launches checked against the CPU: {checked} ({skipped} cases skipped)");
    assert!(checked > 500, "only {checked} launches checked");
}

/// The wrong answers differential testing found (tests/models/differential): every case plans
/// for CUDA, and each launch computes on its plan what the CPU (which matches onnxruntime there)
/// does: the norms' statistics, Clip's NaN and bounds, the reductions over no axes.
#[test]
fn the_plans_of_the_differential_cases_compute_what_the_cpu_computes() {
    let _report = emu::Report;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/differential");
    let cases = common::cases_in(&root);
    assert!(cases.len() >= 31, "{} cases", cases.len());
    let mut checked = std::collections::BTreeSet::new();
    for common::ConformanceCase { name: label, model, graph: g, feeds } in &cases {
        let program = mpc::run::lower_for_inputs(g, feeds, CUDA, model).unwrap_or_else(|e| panic!("{label}: {e}"));
        checked.extend(check_program(label, &program, feeds));
    }
    for op in ["LayerNormalization", "InstanceNormalization", "Clip", "ReduceL2", "Slice"] {
        assert!(checked.contains(op), "no {op} launch checked: {checked:?}");
    }
}
