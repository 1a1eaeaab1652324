//! The GPU against the CPU reference, on the fixtures: every inference output under fp32, mixed
//! and mixed-bf16 within its dtype's tolerance; 50 training steps of every trainable fixture
//! tracking the CPU's losses (relative difference at most 1e-3 under fp32, 1e-2 under mixed, 2e-2 under mixed-bf16);
//! two GPU runs giving the same bits. Each test skips with one line where no GPU can be opened.

#![cfg(feature = "cuda")]

mod common;

use std::collections::HashMap;

use common::{fixture, FIXTURES};
use mpc_ir::Graph;
use mpc_runtime::cuda::device::CudaDevice;
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::session::Session;
use mpc_runtime::{Comparison, HostTensor, Tolerance};

fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped on cuda: {e}");
            None
        }
    }
}

fn dims(batch: u64) -> HashMap<String, u64> {
    [("batch".to_string(), batch)].into()
}

#[test]
fn every_fixture_runs_on_the_gpu_as_on_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let (mut compared, mut bad) = (0, Vec::new());
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            let Some(g) = common::compiled(name, policy, false).ok() else { continue };
            let feeds = mpc::run::random_inputs(&g, 5, &dims(8)).unwrap();
            let path = fixture(name);
            let cpu = match mpc::run::run_once_on(CpuDevice::default(), &g, &feeds, &path) {
                Ok(o) => o,
                // What no device runs (the custom op) is refused alike.
                Err(e) => {
                    let gpu = mpc::run::run_once_on(CudaDevice::new(0).unwrap(), &g, &feeds, &path);
                    assert!(gpu.is_err(), "{name} {policy}: the CPU refuses ({e}) and the GPU runs");
                    continue;
                }
            };
            let cuda = mpc::run::run_once_on(CudaDevice::new(0).unwrap(), &g, &feeds, &path)
                .unwrap_or_else(|e| panic!("{name} {policy}: {e}"));
            let again = mpc::run::run_once_on(CudaDevice::new(0).unwrap(), &g, &feeds, &path).unwrap();
            for (((n, c), (_, x)), (_, y)) in cpu.iter().zip(&cuda).zip(&again) {
                // A whole network: the policy's low dtype's preset (another summation order in
                // every matrix product), with element bounds ten times looser than one op's.
                let low = match policy {
                    "fp32" => c.dtype(),
                    "mixed" if c.dtype().is_float() => mpc_ir::DType::F16,
                    _ if c.dtype().is_float() => mpc_ir::DType::BF16,
                    _ => c.dtype(),
                };
                let t = Tolerance::for_dtype(low);
                let tol = Tolerance { rtol: 10.0 * t.rtol, atol: 10.0 * t.atol, rel_l2: t.rel_l2 };
                match within(tol, low, x, c) {
                    Ok(cmp) => println!("{name} {policy} `{n}`: {cmp:?}"),
                    Err(e) => bad.push(format!("{name} {policy} `{n}`: {e}")),
                }
                if x != y {
                    bad.push(format!("{name} {policy} `{n}`: two GPU runs differ"));
                }
                compared += 1;
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(compared >= 20, "only {compared} outputs compared");
}

/// The losses of `steps` training steps of `g` on `device`, on the same batches.
fn losses<D: Device>(device: D, g: &Graph, name: &str, steps: u64) -> Vec<f64> {
    losses_with(device, g, name, steps, true)
}

fn losses_with<D: Device>(device: D, g: &Graph, name: &str, steps: u64, capture: bool) -> Vec<f64> {
    let (bound, _) = mpc::summary::bind_inputs(g, &dims(16)).unwrap();
    let program = mpc::run::lower_bound(&bound, device.caps(), None, None, &fixture(name)).unwrap();
    let loss = bound.name(bound.train.as_ref().and_then(|t| t.loss).expect("a loss")).to_string();
    let mut s = Session::new(device, program).unwrap();
    s.set_capture(capture);
    (0..steps)
        .map(|step| {
            let inputs = mpc::run::random_inputs(&bound, 100 + step, &dims(16)).unwrap();
            s.feed(0, &inputs).unwrap();
            s.step(0).unwrap();
            s.read(0, &loss).unwrap().f64s()[0]
        })
        .collect()
}

#[test]
fn training_on_the_gpu_tracks_the_cpu() {
    if gpu().is_none() {
        return;
    }
    // 50 steps; fewer under a sanitizer, which runs each kernel far slower
    // (`MPC_TRACK_STEPS`, set by benches/gpu_session.sh's sanitizer_all).
    let steps: u64 = std::env::var("MPC_TRACK_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(50).max(1);
    let last = steps as usize - 1;
    let mut tracked = 0;
    let mut failures = Vec::new();
    // bf16 keeps 8 significant bits to f16's 11: its rounding unit is 8 times as large, and one
    // rounding that falls the other way on the GPU (cuBLAS sums in another order than the CPU's
    // matrix product) moves every later step more than under f16. Hence its wider bound.
    for name in FIXTURES.iter().chain(&["digits_mlp"]) {
        for (policy, bound) in [("fp32", 1e-3), ("mixed", 1e-2), ("mixed-bf16", 2e-2)] {
            let Some(g) = common::compiled(name, policy, true).ok() else { continue };
            let cpu = losses(CpuDevice::default(), &g, name, steps);
            let cuda = losses(CudaDevice::new(0).unwrap(), &g, name, steps);
            let again = losses(CudaDevice::new(0).unwrap(), &g, name, steps);
            let worst = cpu.iter().zip(&cuda).map(|(a, b)| (a - b).abs() / a.abs().max(1e-6)).fold(0.0, f64::max);
            println!(
                "{name} {policy}: loss {:.5} -> {:.5} (cpu {:.5} -> {:.5}), worst relative difference {worst:.2e}",
                cuda[0], cuda[last], cpu[0], cpu[last]
            );
            if worst > bound {
                failures.push(format!(
                    "{name} {policy}: the GPU's losses leave the CPU's by {worst:.2e} (bound {bound:.0e})"
                ));
            }
            if cuda != again {
                failures.push(format!("{name} {policy}: two GPU runs differ"));
            }
            tracked += 1;
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert_eq!(tracked, 18, "training fixtures compared");
}

/// A recorded and replayed step (a CUDA graph) gives the bits of launching every kernel.
#[test]
fn graph_replay_gives_the_bits_of_plain_launches() {
    if gpu().is_none() {
        return;
    }
    for name in ["transformer", "cnn_bn"] {
        let g = common::compiled(name, "mixed", true).unwrap();
        let replayed = losses_with(CudaDevice::new(0).unwrap(), &g, name, 20, true);
        let launched = losses_with(CudaDevice::new(0).unwrap(), &g, name, 20, false);
        assert_eq!(replayed, launched, "{name}");
    }
}

/// A GPU step reads nothing back and allocates nothing; the state keeps its addresses.
#[test]
fn gpu_steps_neither_allocate_nor_wait() {
    if gpu().is_none() {
        return;
    }
    let g = common::compiled("transformer", "mixed", true).unwrap();
    let (bound, _) = mpc::summary::bind_inputs(&g, &dims(16)).unwrap();
    let dev = CudaDevice::new(0).unwrap();
    let program = mpc::run::lower_bound(&bound, dev.caps(), None, None, &fixture("transformer")).unwrap();
    let mut s = Session::new(dev, program).unwrap();
    let inputs = mpc::run::random_inputs(&bound, 1, &dims(16)).unwrap();
    for _ in 0..5 {
        s.feed(0, &inputs).unwrap();
        s.step(0).unwrap();
    }
    let st = s.stats(0);
    println!("transformer mixed on cuda: {st:?}, {:?}", s.counters());
    assert_eq!(s.counters().replays, 4, "step 2 is recorded and replayed, steps 3 to 5 replay it");
    assert_eq!(st.allocations_in_steps, 0);
    assert_eq!(st.host_reads_per_step, 0);
}

/// Where cuDNN is found, every convolution of a training step (forward, data and filter
/// gradients) is prepared as cuDNN calls; where it is not (or `MPC_CUDNN=0`), none is and the
/// im2col plans run. Either way the step computes what the CPU does (the fixture tests above).
#[test]
fn convolutions_go_to_cudnn_where_it_is_found() {
    let Some(dev) = gpu() else { return };
    let found = dev.cudnn().map_err(str::to_string);
    let g = common::compiled("cnn_bn", "mixed", true).unwrap();
    let (bound, _) = mpc::summary::bind_inputs(&g, &dims(16)).unwrap();
    let program = mpc::run::lower_bound(&bound, dev.caps(), None, None, &fixture("cnn_bn")).unwrap();
    let convs =
        program.launches.iter().filter(|l| matches!(l.op, mpc_ir::Op::Conv(_) | mpc_ir::Op::ConvGrad(_))).count();
    let mut s = Session::new(dev, program).unwrap();
    let inputs = mpc::run::random_inputs(&bound, 1, &dims(16)).unwrap();
    s.feed(0, &inputs).unwrap();
    s.step(0).unwrap();
    let c = s.counters();
    for why in s.device().cudnn_refusals() {
        println!("refused by cuDNN: {why}");
    }
    println!(
        "cnn_bn mixed training step: {convs} convolution launches; cuDNN: {found:?}; prepared as cuDNN calls: {}, refused by cuDNN: {}",
        c.dnn_convolutions, c.dnn_fallbacks
    );
    if found.is_ok() {
        assert_eq!((c.dnn_convolutions, c.dnn_fallbacks), (convs as u64, 0));
    } else {
        assert_eq!(c.dnn_convolutions, 0);
    }
}

/// Where cuBLASLt is found, every dense layer's product of a training step (a Gemm with a bias
/// vector, or with a Relu as its epilogue) is prepared as one cuBLASLt call; where it is not (or
/// `MPC_CUBLASLT=0`), none is and the fallbacks run. Either way the step computes what the CPU
/// does (the fixture tests above).
#[test]
fn dense_layers_go_to_cublaslt_where_it_is_found() {
    let Some(dev) = gpu() else { return };
    let found = dev.cublaslt().map_err(str::to_string);
    let g = common::compiled("mlp", "mixed", true).unwrap();
    let (bound, _) = mpc::summary::bind_inputs(&g, &dims(16)).unwrap();
    let program = mpc::run::lower_bound(&bound, dev.caps(), None, None, &fixture("mlp")).unwrap();
    let none = |_: &mpc_runtime::program::TensorRef| None;
    let lts = program
        .launches
        .iter()
        .filter(|l| {
            mpc_runtime::cuda::plan::plan(l, &none)
                .is_ok_and(|p| p.calls.iter().any(|c| matches!(c, mpc_runtime::cuda::plan::Call::Lt(_))))
        })
        .count();
    assert!(lts > 0, "the mlp fixture's training step has no product for cuBLASLt");
    let mut s = Session::new(dev, program).unwrap();
    let inputs = mpc::run::random_inputs(&bound, 1, &dims(16)).unwrap();
    s.feed(0, &inputs).unwrap();
    s.step(0).unwrap();
    let c = s.counters();
    for why in s.device().cublaslt_refusals() {
        println!("refused by cuBLASLt: {why}");
    }
    println!(
        "mlp mixed training step: {lts} products with a bias or ReLU; cuBLASLt: {found:?}; prepared as cuBLASLt calls: {}, refused: {}",
        c.lt_gemms, c.lt_fallbacks
    );
    if found.is_ok() {
        assert_eq!((c.lt_gemms, c.lt_fallbacks), (lts as u64, 0));
    } else {
        assert_eq!(c.lt_gemms, 0);
    }
}

/// The tiny GPT with its loss inside (a tanh GELU in each layer, whose gradient is the epilogue
/// of the Gemm that makes its dY: cuBLASLt's `DGELU` where it is found, else the GEMM and the
/// GeluGrad kernel): its losses over 20 training steps on the GPU track the CPU's, and the step
/// says how many of its products cuBLASLt took and why it refused any.
#[test]
fn a_gpt_step_with_its_gelu_gradients_in_products_tracks_the_cpu() {
    if gpu().is_none() {
        return;
    }
    let steps: u64 = std::env::var("MPC_TRACK_STEPS").ok().and_then(|s| s.parse().ok()).unwrap_or(20).clamp(1, 20);
    // Also with F.scaled_dot_product_attention as PyTorch exports it (as its steps, and as one ONNX
    // Attention node at opset 23), fused (its causal mask applied by the kernels).
    for (model, policy, bound, fused) in [
        ("tiny_gpt_loss", "fp32", 1e-3, false),
        ("tiny_gpt_loss", "mixed", 1e-2, false),
        ("tiny_gpt_loss", "mixed-bf16", 2e-2, false),
        ("tiny_gpt_loss", "mixed", 1e-2, true),
        ("tiny_gpt_loss", "mixed-bf16", 2e-2, true),
        ("tiny_gpt_sdpa_loss", "mixed", 1e-2, true),
        ("tiny_gpt_sdpa_loss", "mixed-bf16", 2e-2, true),
        ("tiny_gpt_attention23_loss", "mixed", 1e-2, true),
    ] {
        let g = common::compiled_with(model, policy, true, fused).unwrap();
        let policy = if fused { format!("{policy} with the fused attention") } else { policy.to_string() };
        let cpu = losses(CpuDevice::default(), &g, model, steps);
        let cuda = losses(CudaDevice::new(0).unwrap(), &g, model, steps);
        let worst = cpu.iter().zip(&cuda).map(|(a, b)| (a - b).abs() / a.abs().max(1e-6)).fold(0.0, f64::max);
        let (bound_g, _) = mpc::summary::bind_inputs(&g, &dims(16)).unwrap();
        let program =
            mpc::run::lower_bound(&bound_g, CudaDevice::new(0).unwrap().caps(), None, None, &fixture(model)).unwrap();
        let gelu_grads =
            program.launches.iter().filter(|l| matches!(l.epilogue, Some(mpc_ir::Op::GeluGrad(_)))).count();
        let mut s = Session::new(CudaDevice::new(0).unwrap(), program).unwrap();
        s.feed(0, &mpc::run::random_inputs(&bound_g, 1, &dims(16)).unwrap()).unwrap();
        s.step(0).unwrap();
        for why in s.device().cublaslt_refusals() {
            println!("refused by cuBLASLt: {why}");
        }
        let c = s.counters();
        println!(
            "{model} {policy}: loss {:.5} -> {:.5} (cpu {:.5} -> {:.5}), worst relative difference {worst:.2e}; \
             {gelu_grads} GELU gradients in products; cuBLASLt calls {}, refused {}",
            cuda[0],
            cuda[steps as usize - 1],
            cpu[0],
            cpu[steps as usize - 1],
            c.lt_gemms,
            c.lt_fallbacks
        );
        assert!(gelu_grads > 0, "{model} {policy}: no GELU gradient in a product");
        assert!(worst <= bound, "{model} {policy}: the GPU's losses leave the CPU's by {worst:.2e}");
    }
}

/// The fused attention's kernels at the sizes of real models against the CPU: GPT-2's head dim 64
/// over 512 positions with a constant causal mask (applied by the kernels, the tiles above the
/// diagonal skipped) and with the same mask as an input (read), a head dim of 128, and one of 40
/// (the kernels' 64, its columns padded), the forward and the gradient, in f16 and bf16; each
/// output within its dtype's relative L2 error.
#[test]
fn fused_attention_at_model_sizes_computes_what_the_cpu_computes() {
    if gpu().is_none() {
        return;
    }
    let mut bad = Vec::new();
    // Under a sanitizer (`MPC_SMALL_ATTENTION`, set by benches/gpu_session.sh's attention part),
    // which runs each kernel far slower: the same kinds of case over a few tiles.
    let cases = if std::env::var_os("MPC_SMALL_ATTENTION").is_some() {
        vec![
            ("f16", [1, 2, 150, 64], Some(true)),
            ("bf16", [1, 2, 150, 64], Some(false)),
            ("f16", [1, 1, 70, 128], None),
            ("bf16", [1, 2, 40, 40], None),
        ]
    } else {
        vec![
            ("f16", [2, 4, 512, 64], Some(true)),
            ("bf16", [2, 4, 512, 64], Some(true)),
            ("f16", [2, 4, 512, 64], Some(false)),
            ("f16", [1, 2, 300, 128], None),
            ("bf16", [1, 3, 200, 40], None),
        ]
    };
    for (dt, [b, h, s, d], causal) in cases {
        let label = format!(
            "{dt} [{b},{h},{s},{d}] {}",
            match causal {
                Some(true) => "causal (constant)",
                Some(false) => "causal (an input)",
                None => "no mask",
            }
        );
        let body = format!(
            "input %0 \"dy\": {dt}[{b},{h},{s},{d}]\n  input %1 \"q\": {dt}[{b},{h},{s},{d}]\n  \
             input %2 \"k\": {dt}[{b},{h},{s},{d}]\n  input %3 \"v\": {dt}[{b},{h},{s},{d}]\n  \
             %5 \"y\": {dt}[{b},{h},{s},{d}], %6 \"lse\": f32[{b},{h},{s}] = ai.mpc::Attention[scale=0.125](%1, %2, %3)\n  \
             %7 \"dq\": {dt}[{b},{h},{s},{d}], %8 \"dk\": {dt}[{b},{h},{s},{d}], %9 \"dv\": {dt}[{b},{h},{s},{d}] = \
             ai.mpc::AttentionGrad[scale=0.125](%0, %1, %2, %3, %5, %6)\n  \
             output %5\n  output %6\n  output %7\n  output %8\n  output %9"
        );
        let mut g = common::single_op(&body);
        let mut feeds = mpc::run::random_inputs(&g, 17, &HashMap::new()).unwrap();
        if let Some(constant) = causal {
            let v: Vec<f64> =
                (0..s).flat_map(|i| (0..s).map(move |j| if j <= i { 0.0 } else { f64::NEG_INFINITY })).collect();
            let mask = if constant {
                g.add_initializer("m", mpc_ir::Tensor::from_f64_as(mpc_ir::DType::F32, vec![s as u64, s as u64], &v))
            } else {
                feeds.insert("m".into(), HostTensor::from_f64(mpc_ir::DType::F32, vec![s, s], v));
                g.add_input("m", mpc_ir::TypeInfo::new(mpc_ir::DType::F32, mpc_ir::Shape::fixed(&[s as u64, s as u64])))
            };
            let nodes: Vec<_> = g.node_ids().collect();
            for n in nodes {
                let slot = match g.node(n).op {
                    mpc_ir::Op::Attention(_) => 3,
                    mpc_ir::Op::AttentionGrad(_) => 6,
                    _ => continue,
                };
                g.set_input(n, slot, Some(mask));
            }
        }
        let path = std::path::Path::new("attention");
        let cpu = mpc::run::run_once_on(CpuDevice::default(), &g, &feeds, path).unwrap();
        let cuda = match mpc::run::run_once_on(CudaDevice::new(0).unwrap(), &g, &feeds, path) {
            Ok(o) => o,
            Err(e) => {
                bad.push(format!("{label}: {e}"));
                continue;
            }
        };
        for ((n, c), (_, x)) in cpu.iter().zip(&cuda) {
            let t =
                Tolerance { rtol: f64::INFINITY, atol: f64::INFINITY, rel_l2: Tolerance::for_dtype(c.dtype()).rel_l2 };
            match t.check(x, c) {
                Ok(cmp) => println!("attention {label} `{n}`: relative L2 {:.2e}", cmp.rel_l2),
                Err(e) => bad.push(format!("{label} `{n}`: {e}")),
            }
        }
    }
    assert!(bad.is_empty(), "{} of the outputs differ:\n{}", bad.len(), bad.join("\n"));
}

/// Single ops at sizes that take the GPU's multi-pass paths (few long columns, LayerNorm's
/// parameter gradients over many tokens, batch norm over few channels of many elements, an
/// update reading an f16 gradient with its loss scale, broadcasts against a scalar and a row),
/// each against the CPU within its dtype's tolerance. The fixtures are too small to reach them.
#[test]
fn large_single_ops_take_the_split_paths_as_the_cpu_computes() {
    if gpu().is_none() {
        return;
    }
    let mut bad = Vec::new();
    for body in common::LARGE_SINGLE_OPS {
        let g = common::single_op(body);
        let feeds = mpc::run::random_inputs(&g, 11, &HashMap::new()).unwrap();
        let path = std::path::Path::new("large_single_op");
        let cpu =
            mpc::run::run_once_on(CpuDevice::default(), &g, &feeds, path).unwrap_or_else(|e| panic!("{e}\n{body}"));
        let cuda = match mpc::run::run_once_on(CudaDevice::new(0).unwrap(), &g, &feeds, path) {
            Ok(o) => o,
            Err(e) => {
                bad.push(format!("{e}\n{body}"));
                continue;
            }
        };
        for ((n, c), (_, x)) in cpu.iter().zip(&cuda) {
            let t = Tolerance::for_dtype(c.dtype());
            let t = Tolerance { atol: t.atol.max(sum_atol(&g, &feeds, n)), ..t };
            match within(t, c.dtype(), x, c) {
                Ok(cmp) => println!("`{n}` ({}{:?}): {cmp:?}", c.dtype(), c.shape),
                Err(e) => bad.push(format!("`{n}`: {e}\n{body}")),
            }
        }
    }
    assert!(bad.is_empty(), "{} of the outputs differ:\n{}", bad.len(), bad.join("\n"));
}

/// What an output that sums K terms of its op's first input may differ by when they are added
/// in another order (the CPU's and the GPU's split passes): a few rounding units of f32 at the
/// size of the terms' absolute sum, however much of it cancels. The sums: ReduceSum's output and
/// the normalisations' parameter gradients (whose terms are dy times a normalised value of
/// order one). 0 for any other output.
fn sum_atol(g: &Graph, feeds: &HashMap<String, HostTensor>, n: &str) -> f64 {
    let sums = |op: &str, slot: usize| match op {
        "ReduceSum" => slot == 0,
        "LayerNormalizationGrad" | "BatchNormalizationGrad" => slot == 1 || slot == 2,
        _ => false,
    };
    let found = g.node_ids().map(|id| g.node(id)).find_map(|x| {
        let slot = x.outputs().iter().position(|&o| &*g.value(o).name == n)?;
        sums(x.op.op_type(), slot).then_some((x, slot))
    });
    let Some((node, slot)) = found else { return 0.0 };
    let Some(x) = node.input(0).and_then(|v| feeds.get(&*g.value(v).name)) else { return 0.0 };
    let out = g.value(node.outputs()[slot]).ty.shape.as_ref().and_then(|s| s.numel()).unwrap_or(1).max(1);
    let abs_sum_per_output = x.f64s().iter().map(|a| a.abs()).sum::<f64>() / out as f64;
    4.0 * f32::EPSILON as f64 * abs_sum_per_output
}

/// `got` against `want` within `t`, or else differing only where an intermediate of `dtype` was
/// rounded one unit apart and then cancelled (an Add after a rounding, a normalisation of values
/// rounded to f16): at most 0.1% of the elements out of bounds, none by more than four units in
/// the last place of `dtype` at the tensor's largest magnitude. A wrong kernel misses by more, or
/// in more places.
fn within(t: Tolerance, dtype: mpc_ir::DType, got: &HostTensor, want: &HostTensor) -> Result<Comparison, String> {
    let e = match t.check(got, want) {
        Ok(c) => return Ok(c),
        Err(e) => e,
    };
    let unit = match dtype {
        mpc_ir::DType::F16 => 2f64.powi(-10),
        mpc_ir::DType::BF16 => 2f64.powi(-7),
        mpc_ir::DType::F32 => 2f64.powi(-23),
        _ => return Err(e),
    };
    let c = t.measure(got, want);
    let most = want.f64s().iter().filter(|v| v.is_finite()).fold(0f64, |a, v| a.max(v.abs()));
    let flips = c.outliers * 1000 <= want.len() && c.max_abs <= 4.0 * unit * most && c.rel_l2 <= t.rel_l2;
    if flips {
        Ok(c)
    } else {
        Err(e)
    }
}
