//! The CUDA device's plans, checked with no GPU: every launch of every fixture's inference and
//! training programs, under fp32, mixed and mixed-bf16, becomes kernels, GEMMs, copies and fills
//! ([`mpc_runtime::cuda::plan`]) that
//! - point only into the launch's own operands (or its workspace and aux bytes);
//! - give every GEMM leading dims and extents that fit the tensors it reads and writes;
//! - name kernels that exist in the cubins NVRTC builds, with exactly the parameter layout each
//!   kernel declares (count, offsets and sizes read from the cubin), when NVRTC is present
//!   (CI installs it and sets `MPC_REQUIRE_NVRTC=1`, so there this part cannot skip).
//!
//! What the plans compute is checked on a GPU, against the CPU (`device_tests!`, `per_device!`).

#![cfg(feature = "cuda")]

mod common;

use std::collections::{BTreeMap, HashMap};

use common::{fixture, FIXTURES};
use mpc_ir::{DType, Graph};
use mpc_runtime::cuda::cubin::{self, KernelParams};
use mpc_runtime::cuda::nvrtc;
use mpc_runtime::cuda::plan::{check_args, plan, Arg, Buf, Call, DnnOp, Gemm, GradOf, LaunchPlan, LtGemm, LtMask};
use mpc_runtime::program::{DeviceCaps, Launch, Operand, Program, Region, TensorRef};

const CUDA: DeviceCaps = DeviceCaps { name: "cuda", align: 256, memory: 1 << 40, fuse: true };

fn lowered(name: &str, g: &Graph) -> Option<Program> {
    let dims: HashMap<String, u64> = [("batch".to_string(), 4)].into();
    let (bound, _) = mpc::summary::bind_inputs(g, &dims).unwrap();
    // A fixture whose ops no device runs (the custom op) does not lower for any device.
    mpc::run::lower_bound(&bound, CUDA, None, None, &fixture(name)).ok()
}

fn all_launches(launches: &[Launch], out: &mut Vec<Launch>) {
    for l in launches {
        match &l.branches {
            Some(b) => {
                all_launches(&b.then_launches, out);
                all_launches(&b.else_launches, out);
            }
            None => out.push(l.clone()),
        }
    }
}

/// The programs of every fixture, policy and mode that lower, by a label.
fn programs() -> Vec<(String, Program)> {
    let mut out = Vec::new();
    for name in FIXTURES {
        for policy in ["fp32", "mixed", "mixed-bf16"] {
            for train in [false, true] {
                let Some(g) = common::compiled(name, policy, train).ok() else { continue };
                if let Some(p) = lowered(name, &g) {
                    out.push((format!("{name} {policy}{}", if train { " train" } else { "" }), p));
                }
            }
        }
    }
    // A GPT-shaped training step with its loss inside (a tanh GELU's gradient in a product).
    // And with its attention fused (`--fused-attention`): the attention kernels' structs; also
    // with F.scaled_dot_product_attention as PyTorch exports it (as its steps, and as one ONNX
    // Attention node at opset 23).
    for (model, policy, fused) in [
        ("tiny_gpt_loss", "fp32", false),
        ("tiny_gpt_loss", "mixed", false),
        ("tiny_gpt_loss", "mixed-bf16", false),
        ("tiny_gpt_loss", "mixed", true),
        ("tiny_gpt_loss", "mixed-bf16", true),
        ("tiny_gpt_sdpa_loss", "mixed", true),
        ("tiny_gpt_sdpa_loss", "mixed-bf16", true),
        ("tiny_gpt_attention23_loss", "mixed", true),
    ] {
        let g = common::compiled_with(model, policy, true, fused).unwrap();
        if let Some(p) = lowered(model, &g) {
            let how = if fused { " fused attention" } else { "" };
            out.push((format!("{model} {policy} train{how}"), p));
        }
    }
    // Single ops at shapes the fixtures are too small to reach: batch norms in passes, their
    // elements 16 bytes at a time (f16 planes of 56 × 56) and one at a time (planes of 4095).
    let bn = |dtype: &str, shape: &str, c: usize| {
        format!(
            "input %0 \"x\": {dtype}[{shape}]\n  input %1 \"s\": f32[{c}]\n  input %2 \"b\": f32[{c}]\n  \
             input %3 \"m\": f32[{c}]\n  input %4 \"v\": f32[{c}]\n  input %5 \"dy\": {dtype}[{shape}]\n  \
             %6 \"y\": {dtype}[{shape}], %7 \"rm\": f32[{c}], %8 \"rv\": f32[{c}] = \
             BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  \
             %9 \"dx\": {dtype}[{shape}], %10 \"ds\": {dtype}[{c}], %11 \"db\": {dtype}[{c}] = \
             ai.mpc::BatchNormalizationGrad(%5, %0, %1)\n  output %6\n  output %7\n  output %8\n  output %9\n  \
             output %10\n  output %11"
        )
    };
    // And an f16 chain over whole 16-byte units, with a bias broadcast (8 elements at a time).
    let chain = "input %0 \"x\": f16[64,256]\n  input %1 \"y\": f16[64,256]\n  input %2 \"b\": f16[256]\n  \
                 %3 \"s\": f16[64,256] = Add(%0, %1)\n  %4 \"t\": f16[64,256] = Add(%3, %2)\n  \
                 %5 \"r\": f16[64,256] = Relu(%4)\n  output %5"
        .to_string();
    let singles = [
        ("bn f16 56x56", bn("f16", "2,256,56,56", 256)),
        ("bn f32 63x65", bn("f32", "4,5,63,65", 5)),
        ("chain f16", chain),
        ("lone", "input %0 \"x\": f16[64,2048]\n  input %1 \"z\": f32[64,2048]\n  %2 \"r\": f16[64,2048] = Relu(%0)\n  %3 \"c\": f16[64,2048] = Cast[to=10](%1)\n  output %2\n  output %3".to_string()),
    ];
    for (label, body) in singles {
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  {body}\nend\n");
        let path = common::scratch("cuda_plan_single").join(format!("{}.mpcir", label.replace(' ', "_")));
        std::fs::write(&path, text).unwrap();
        let g = mpc::load(&path).unwrap();
        let p = mpc_runtime::program::lower(&g, CUDA, Default::default()).unwrap();
        out.push((label.to_string(), p));
    }
    out
}

/// The end of the operand of `l` that holds byte `offset` of `region`.
fn operand_end(l: &Launch, region: Region, offset: u64) -> Option<u64> {
    // A multi-tensor launch's operands are its members', and a sibling's are the launch's.
    let ins = l.parts().into_iter().flat_map(|m| m.operands()).filter_map(Operand::tensor);
    ins.chain(l.parts().into_iter().flat_map(|m| m.outputs.iter().chain(&m.relu_mask)))
        .filter(|t: &&TensorRef| t.region == region && t.offset <= offset && offset < t.offset + t.bytes().max(1))
        .map(|t| t.offset + t.bytes())
        .max()
}

/// Bytes available from `b` to the end of what it points into.
fn room(l: &Launch, p: &LaunchPlan, b: Buf) -> Result<u64, String> {
    match b {
        Buf::Tensor(r, o) => operand_end(l, r, o).map(|e| e - o).ok_or_else(|| format!("{b:?} is in no operand")),
        Buf::Work(o) if o < p.workspace => Ok(p.workspace - o),
        Buf::Aux(o) if (o as usize) < p.aux.len() => Ok(p.aux.len() as u64 - o),
        Buf::Flag => Ok(4),
        _ => Err(format!("{b:?} lies past the launch's workspace and aux bytes")),
    }
}

fn check_gemm(l: &Launch, p: &LaunchPlan, g: &Gemm) -> Result<(), String> {
    if let Some(arrays) = g.pointers {
        // Each matrix of the arrays of addresses as a product of one.
        let one = Gemm { batch: 1, pointers: None, stride_a: 0, stride_b: 0, stride_c: 0, ..g.clone() };
        for bi in 0..g.batch as u64 {
            let [a, b, c] = arrays.map(|at| match at {
                Buf::Aux(at) => p.addresses.iter().find(|&&(o, _)| o == at + 8 * bi).map(|&(_, b)| b),
                _ => None,
            });
            let (Some(a), Some(b), Some(c)) = (a, b, c) else {
                return Err(format!("matrix {bi} of a batched GEMM has no address"));
            };
            check_gemm(l, p, &Gemm { a, b, c, ..one.clone() })?;
        }
        return Ok(());
    }
    let operand = |name: &str, b: Buf, trans: bool, rows: i64, cols: i64, ld: i64, stride: i64| {
        let es = if name == "C" { g.c_dtype.size() } else { g.dtype.size() } as i64;
        let (r, c) = if trans { (cols, rows) } else { (rows, cols) };
        if ld < r.max(1) {
            return Err(format!("{name}: leading dim {ld} below its {r} rows"));
        }
        let extent = ((g.batch - 1) * stride + (c - 1) * ld + r) * es;
        let have = room(l, p, b)? as i64;
        if extent > have {
            return Err(format!("{name}: {extent} bytes read or written where {have} are there"));
        }
        Ok(())
    };
    operand("A", g.a, g.trans_a, g.m, g.k, g.lda, g.stride_a)?;
    operand("B", g.b, g.trans_b, g.k, g.n, g.ldb, g.stride_b)?;
    operand("C", g.c, false, g.m, g.n, g.ldc, g.stride_c)
}

fn check_plan(l: &Launch, p: &LaunchPlan) -> Result<(), String> {
    check_calls(l, p, &p.calls)
}

fn check_calls(l: &Launch, p: &LaunchPlan, calls: &[Call]) -> Result<(), String> {
    for c in calls {
        match c {
            Call::Kernel(k) => {
                for a in &k.args {
                    if let Arg::Ptr(b) = a {
                        room(l, p, *b).map_err(|e| format!("{}: {e}", k.name))?;
                    }
                }
                if k.block.iter().product::<u32>() > 256 || k.grid.contains(&0) {
                    return Err(format!("{}: grid {:?}, block {:?}", k.name, k.grid, k.block));
                }
            }
            Call::Gemm(g) => check_gemm(l, p, g)?,
            Call::Copy { from, to, bytes } => {
                if room(l, p, *from)? < *bytes || room(l, p, *to)? < *bytes {
                    return Err(format!("a copy of {bytes} bytes overruns {from:?} or {to:?}"));
                }
            }
            Call::Fill { to, bytes, .. } => {
                if room(l, p, *to)? < *bytes {
                    return Err(format!("a fill of {bytes} bytes overruns {to:?}"));
                }
            }
            Call::Conv(conv) => {
                // Each operand holds its shape's bytes; the fallback is checked as any plan.
                let bytes = |s: [i64; 4]| s.iter().product::<i64>() as u64 * conv.dtype.size() as u64;
                let (x, w, y) = (bytes(conv.x), bytes(conv.w), bytes(conv.y));
                for op in &conv.ops {
                    let operands = match *op {
                        DnnOp::Forward { x: a, w: b, y: c } => [(a, x), (b, w), (c, y)],
                        DnnOp::BackwardData { w: a, dy: b, dx: c } => [(a, w), (b, y), (c, x)],
                        DnnOp::BackwardFilter { x: a, dy: b, dw: c } => [(a, x), (b, y), (c, w)],
                    };
                    for (b, need) in operands {
                        if room(l, p, b)? < need {
                            return Err(format!("cuDNN {op:?}: {need} bytes at {b:?} overrun it"));
                        }
                    }
                }
                // The fallback's scratch lies past the plan's own, which leaves it out.
                let with_columns = LaunchPlan { workspace: conv.fallback_workspace, ..p.clone() };
                check_calls(l, &with_columns, &conv.fallback)?;
            }
            Call::Lt(lt) => {
                // The product's operands as any GEMM's, its bias one value per row.
                if lt.gemm.batch != 1 || lt.gemm.beta != 0.0 {
                    return Err(format!("cuBLASLt: a batch of {} with beta {}", lt.gemm.batch, lt.gemm.beta));
                }
                check_gemm(l, p, &lt.gemm)?;
                let bgrad = lt.bgrad.map(|(b, of)| (b, if of == GradOf::A { lt.gemm.m } else { lt.gemm.n }));
                let vectors = [(lt.bias, lt.gemm.m), (bgrad.map(|b| b.0), bgrad.map_or(0, |b| b.1))];
                for (b, len) in vectors.into_iter().filter_map(|(b, len)| Some((b?, len))) {
                    let need = len as u64 * lt.gemm.c_dtype.size() as u64;
                    if room(l, p, b)? < need {
                        return Err(format!("cuBLASLt: a vector of {need} bytes at {b:?} overruns it"));
                    }
                }
                // The ReLU mask: `ld` bits for each of D's n columns.
                if let Some(mask) = lt.mask {
                    if mask.ld < lt.gemm.m || mask.ld % 128 != 0 {
                        return Err(format!("cuBLASLt: a mask of {} bits a column for {} rows", mask.ld, lt.gemm.m));
                    }
                    let need = (mask.ld * lt.gemm.n / 8) as u64;
                    if room(l, p, mask.buf)? < need {
                        return Err(format!("cuBLASLt: a mask of {need} bytes at {:?} overruns it", mask.buf));
                    }
                }
                // The GELU's input: D's layout, `ld` elements for each of D's n columns.
                if let Some(h) = lt.gelu_grad {
                    if h.ld < lt.gemm.m {
                        return Err(format!(
                            "cuBLASLt: a GELU input of {} elements a column for {} rows",
                            h.ld, lt.gemm.m
                        ));
                    }
                    let need = ((lt.gemm.n - 1) * h.ld + lt.gemm.m) as u64 * lt.gemm.c_dtype.size() as u64;
                    if room(l, p, h.buf)? < need {
                        return Err(format!("cuBLASLt: a GELU input of {need} bytes at {:?} overruns it", h.buf));
                    }
                }
                check_calls(l, p, &lt.fallback)?;
            }
        }
    }
    Ok(())
}

/// Every kernel of every family, with its parameter layout, or why NVRTC cannot be used.
fn cubin_kernels() -> Result<BTreeMap<String, KernelParams>, String> {
    nvrtc::version().and_then(|_| nvrtc::include_dir()).map_err(|e| e.to_string())?;
    let mut all = BTreeMap::new();
    for (family, source) in nvrtc::FAMILIES {
        let c = nvrtc::compile(family, source, "sm_90", false).map_err(|e| e.to_string())?;
        all.extend(cubin::kernels(&c.cubin)?);
    }
    Ok(all)
}

#[test]
fn every_fixture_launch_plans_into_kernels_that_exist_with_their_declared_parameters() {
    let programs = programs();
    assert!(programs.len() >= 30, "only {} programs lowered", programs.len());
    let kernels = match cubin_kernels() {
        Ok(k) => Some(k),
        Err(e) if std::env::var_os("MPC_REQUIRE_NVRTC").is_none() => {
            println!("cuda plans: kernel parameters not checked (skipped: {e})");
            None
        }
        Err(e) => panic!("{e}"),
    };
    let (mut launches, mut calls, mut checked) = (0, 0, 0);
    let mut failures = Vec::new();
    let mut used = std::collections::BTreeSet::new();
    // Fused chains' generated kernels, compiled together after the walk.
    let mut fused: BTreeMap<String, (String, mpc_runtime::cuda::plan::Kernel)> = BTreeMap::new();
    for (label, program) in &programs {
        let constant = |t: &TensorRef| program.constant(t);
        let mut ls = Vec::new();
        all_launches(&program.launches, &mut ls);
        for l in &ls {
            launches += 1;
            let p = match plan(l, &constant) {
                Ok(p) => p,
                Err(e) => {
                    failures.push(format!("{label}: {} ({}): {e}", l.node, l.op.op_type()));
                    continue;
                }
            };
            if let Err(e) = check_plan(l, &p) {
                failures.push(format!("{label}: {} ({}): {e}", l.node, l.op.op_type()));
            }
            calls += p.calls.len();
            for k in p.kernels() {
                used.insert(k.name.clone());
                if k.fused.is_some() {
                    fused.entry(k.name.clone()).or_insert_with(|| (format!("{label}: {}", l.node), k.clone()));
                    continue;
                }
                let Some(kernels) = &kernels else { continue };
                let Some(declared) = kernels.get(&k.name) else {
                    failures.push(format!("{label}: {}: no kernel {}", l.node, k.name));
                    continue;
                };
                if let Err(e) = check_args(&k.name, &k.args, declared) {
                    failures.push(format!("{label}: {}: {e}", l.node));
                }
                checked += 1;
            }
        }
    }
    // Every generated kernel compiles (for sm_80 and sm_90) and takes what its plan passes.
    if kernels.is_some() {
        let source: String = fused.values().map(|(_, k)| k.fused.as_ref().unwrap().source.as_str()).collect();
        for arch in ["sm_80", "sm_90"] {
            let c = nvrtc::compile("fused", &source, arch, true).unwrap_or_else(|e| panic!("fused kernels: {e}"));
            failures.extend(c.log.lines().filter(|l| l.contains("warning")).map(|w| format!("fused {arch}: {w}")));
            // ptxas's report: no generated kernel spills.
            for r in nvrtc::kernel_reports(&c.log) {
                if r.spill_stores > 0 || r.spill_loads > 0 {
                    failures.push(format!("fused {arch}: {} spills: {r:?}", r.name));
                }
            }
            let declared = cubin::kernels(&c.cubin).unwrap();
            for (name, (at, k)) in &fused {
                match declared.get(name) {
                    Some(d) => check_args(name, &k.args, d).unwrap_or_else(|e| failures.push(format!("{at}: {e}"))),
                    None => failures.push(format!("{at}: no kernel {name}")),
                }
                checked += 1;
            }
        }
    }
    // Chains that take 8 and 4 elements at a time, and one at a time, were all compiled above.
    let widths: std::collections::BTreeSet<usize> =
        fused.values().map(|(_, k)| k.fused.as_ref().unwrap().vector).collect();
    println!(
        "cuda plans: {} programs, {launches} launches, {calls} calls, {} distinct kernels ({} of them fused chains, \
         taking {widths:?} elements at a time), {checked} kernel launches checked against the cubins",
        programs.len(),
        used.len(),
        fused.len()
    );
    assert!(widths.len() == 3 || kernels.is_none(), "fused chains take {widths:?} elements at a time");
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn matmul_plans_follow_numpy_broadcasting() {
    let t = |offset: u64, shape: &[usize]| TensorRef {
        region: Region::Arena,
        offset,
        dtype: DType::F16,
        shape: shape.to_vec(),
    };
    let launch = |a: &[usize], b: &[usize], y: &[usize]| {
        Launch::new(
            "mm",
            mpc_ir::Op::MatMul,
            vec![Operand::Device(t(0, a)), Operand::Device(t(1 << 20, b))],
            vec![t(2 << 20, y)],
        )
    };
    let none = |_: &TensorRef| None;
    let gemm = |p: &LaunchPlan| match p.calls.last() {
        Some(Call::Gemm(g)) => g.clone(),
        c => panic!("{c:?}"),
    };
    // A batch of matrices times one weight: one product of all 15 rows (cuBLAS's n, the rows of
    // the row-major result).
    let l = launch(&[3, 5, 7], &[7, 2], &[3, 5, 2]);
    let p = plan(&l, &none).unwrap();
    let g = gemm(&p);
    assert_eq!((g.m, g.n, g.k, g.batch, g.ldb, g.ldc), (2, 15, 7, 1, 7, 2));
    check_plan(&l, &p).unwrap();
    // The same read transposed (stored [3, 7, 5]): a batch of 3, the transpose flag on cuBLAS's
    // second operand with the stored row length as leading dim.
    let mut l = launch(&[3, 7, 5], &[7, 2], &[3, 5, 2]);
    l.inputs[0] = Operand::Transposed(t(0, &[3, 7, 5]));
    let p = plan(&l, &none).unwrap();
    let g = gemm(&p);
    assert_eq!((g.m, g.n, g.k, g.batch, g.trans_a, g.trans_b, g.ldb), (2, 5, 7, 3, false, true, 5));
    assert_eq!((g.stride_a, g.stride_b, g.stride_c), (0, 35, 10));
    check_plan(&l, &p).unwrap();
    // Batch dims that broadcast both ways: the left operand is expanded first.
    let l = launch(&[2, 1, 5, 7], &[1, 3, 7, 2], &[2, 3, 5, 2]);
    let p = plan(&l, &none).unwrap();
    assert_eq!(p.calls.len(), 3, "{:?}", p.calls);
    let g = gemm(&p);
    assert_eq!((g.batch, g.stride_a, g.stride_b), (6, 14, 35));
    check_plan(&l, &p).unwrap();
    // Vectors: [7] · [7, 2] is one row.
    let l = launch(&[7], &[7, 2], &[2]);
    let g = gemm(&plan(&l, &none).unwrap());
    assert_eq!((g.m, g.n, g.k, g.batch), (2, 1, 7, 1));
}

/// A dense layer's Gemm with a bias vector (C of [n] or [1, n], beta 1), and its Relu where the
/// lowering made it the launch's epilogue, is one cuBLASLt product whose fallback is the
/// broadcast, a GEMM with beta 1 and an in-place ReLU; a C of full rows is not a bias.
#[test]
fn gemm_bias_and_relu_plan_as_one_cublaslt_product() {
    let t = |offset: u64, shape: &[usize]| TensorRef {
        region: Region::Arena,
        offset,
        dtype: DType::F16,
        shape: shape.to_vec(),
    };
    let launch = |c: &[usize], relu: bool| Launch {
        node: "fc".into(),
        op: mpc_ir::Op::Gemm(mpc_ir::ops::GemmAttrs { transB: true, ..Default::default() }),
        inputs: vec![
            Operand::Device(t(0, &[6, 5])),
            Operand::Device(t(1 << 20, &[3, 5])),
            Operand::Device(t(2 << 20, c)),
        ],
        outputs: vec![t(3 << 20, &[6, 3])],
        branches: None,
        chain: None,
        epilogue: relu.then_some(mpc_ir::Op::Relu),
        epilogue_operand: None,
        epilogue_then: None,
        group: Vec::new(),
        sibling: None,
        relu_mask: None,
        relu_prologue: None,
        unread: Vec::new(),
    };
    let none = |_: &TensorRef| None;
    let names = |calls: &[Call]| -> Vec<String> {
        calls
            .iter()
            .map(|c| match c {
                Call::Kernel(k) => k.name.clone(),
                Call::Gemm(g) => format!("gemm beta {}", g.beta),
                c => format!("{c:?}"),
            })
            .collect()
    };
    for (c, relu) in [(&[3][..], true), (&[1, 3][..], true), (&[3][..], false)] {
        let l = launch(c, relu);
        let p = plan(&l, &none).unwrap();
        check_plan(&l, &p).unwrap();
        let [Call::Lt(lt)] = p.calls.as_slice() else { panic!("{c:?}, relu {relu}: {:?}", p.calls) };
        assert_eq!(
            (lt.bias, lt.relu, lt.gemm.beta, lt.bgrad),
            (Some(Buf::Tensor(Region::Arena, 2 << 20)), relu, 0.0, None)
        );
        assert_eq!((lt.gemm.m, lt.gemm.n, lt.gemm.k, lt.gemm.trans_a), (3, 6, 5, true));
        let mut want = vec!["gemm beta 1".to_string()];
        if relu {
            want.push("elementwise_relu_f16".into());
        }
        let fallback = names(&lt.fallback);
        assert!(fallback[0].starts_with("movement_copy"), "the broadcast first: {fallback:?}");
        assert_eq!(fallback[1..], want);
    }
    // C over whole rows: the broadcast, beta 1 and the ReLU, without cuBLASLt.
    let l = launch(&[6, 3], true);
    let p = plan(&l, &none).unwrap();
    check_plan(&l, &p).unwrap();
    assert!(!p.calls.iter().any(|c| matches!(c, Call::Lt(_))), "{:?}", p.calls);
    assert_eq!(names(&p.calls)[1..], ["gemm beta 1", "elementwise_relu_f16"]);
}

/// A ReLU mask shared by a dense layer's forward Gemm (bias and ReLU) and the backward Gemm that
/// applies the ReLU's gradient as it writes dY: the forward product writes the bits, the
/// backward reads them, both with the column-major result's rows (the 200 features) padded to
/// 256 bits. The backward's fallback is the GEMM and the ReluGrad kernel over the ReLU's output;
/// without a mask the backward is no cuBLASLt product at all.
#[test]
fn a_relu_and_its_gradient_share_a_bit_mask_in_cublaslt_products() {
    let t = |offset: u64, dtype: DType, shape: &[usize]| TensorRef {
        region: Region::Arena,
        offset,
        dtype,
        shape: shape.to_vec(),
    };
    let f16 = |offset: u64, shape: &[usize]| t(offset, DType::F16, shape);
    let mask = t(9 << 20, DType::U8, &[6, 32]);
    assert_eq!(mask.bytes(), mpc_runtime::program::relu_mask_bytes(6, 200));
    let (x, w, b, y) = (f16(0, &[6, 5]), f16(1 << 20, &[200, 5]), f16(2 << 20, &[200]), f16(3 << 20, &[6, 200]));
    let mut forward = Launch::new(
        "fc",
        mpc_ir::Op::Gemm(mpc_ir::ops::GemmAttrs { transB: true, ..Default::default() }),
        vec![Operand::Device(x), Operand::Device(w), Operand::Device(b)],
        vec![y.clone()],
    );
    forward.epilogue = Some(mpc_ir::Op::Relu);
    forward.relu_mask = Some(mask.clone());
    // dY = dZ W2 for the next layer's W2 [7, 200]: its ReluGrad with Y as the epilogue's operand.
    let (dz, w2, dy) = (f16(4 << 20, &[6, 7]), f16(5 << 20, &[7, 200]), f16(6 << 20, &[6, 200]));
    let mut backward = Launch::new(
        "fc2.grad",
        mpc_ir::Op::Gemm(mpc_ir::ops::GemmAttrs::default()),
        vec![Operand::Device(dz), Operand::Device(w2)],
        vec![dy],
    );
    backward.epilogue = Some(mpc_ir::Op::ReluGrad);
    backward.epilogue_operand = Some(Operand::Device(y));
    backward.relu_mask = Some(mask);
    let none = |_: &TensorRef| None;
    let lt = |l: &Launch| -> LtGemm {
        let p = plan(l, &none).unwrap();
        check_plan(l, &p).unwrap();
        let [Call::Lt(lt)] = p.calls.as_slice() else { panic!("{}: {:?}", l.node, p.calls) };
        (**lt).clone()
    };
    let want = Some(LtMask { buf: Buf::Tensor(Region::Arena, 9 << 20), ld: 256 });
    let f = lt(&forward);
    assert_eq!((f.relu, f.relu_grad, f.mask, f.gemm.m), (true, false, want, 200));
    let g = lt(&backward);
    assert_eq!((g.relu, g.relu_grad, g.mask, g.bias, g.gemm.m, g.gemm.n), (false, true, want, None, 200, 6));
    let names: Vec<String> = g
        .fallback
        .iter()
        .map(|c| match c {
            Call::Kernel(k) => k.name.clone(),
            c => format!("{}", matches!(c, Call::Gemm(_))),
        })
        .collect();
    assert_eq!(names, ["true", "train_relu_grad_f16"]);
    // Without the mask: the plain calls only.
    backward.relu_mask = None;
    let p = plan(&backward, &none).unwrap();
    check_plan(&backward, &p).unwrap();
    assert!(matches!(p.calls.as_slice(), [Call::Gemm(_), Call::Kernel(k)] if k.name == "train_relu_grad_f16"));
}

/// A weight gradient's Gemm (`transA`, over the rows) with its bias gradient as the launch's
/// sibling is one cuBLASLt product with a bias-gradient epilogue: of cuBLAS's B where dY is the
/// Gemm's first operand (`dW = dYᵀ X`), of its A where dY is the second (`dW = Xᵀ dY`); the
/// fallback is the product and the ReduceSum's own calls.
#[test]
fn a_weight_gradient_sums_its_bias_gradient_in_one_cublaslt_product() {
    let t = |offset: u64, shape: &[usize]| TensorRef {
        region: Region::Arena,
        offset,
        dtype: DType::F16,
        shape: shape.to_vec(),
    };
    let none = |_: &TensorRef| None;
    let axes = mpc_runtime::HostTensor::from_i64(DType::I64, vec![2], vec![0, 1]);
    // dY [2, 3, 4] (rows 6) at 0, X [6, 5] at 1 MiB, dW at 2 MiB, db [4] at 3 MiB.
    for dy_slot in [0, 1] {
        let (dy2, x) = (Operand::Device(t(0, &[6, 4])), Operand::Device(t(1 << 20, &[6, 5])));
        let (inputs, dw) = if dy_slot == 0 { (vec![dy2, x], [4, 5]) } else { (vec![x, dy2], [5, 4]) };
        let sibling = Launch::new(
            "db",
            mpc_ir::Op::ReduceSum(mpc_ir::ops::ReduceAttrs { keepdims: false, ..Default::default() }),
            vec![Operand::Device(t(0, &[2, 3, 4])), Operand::Host(axes.clone())],
            vec![t(3 << 20, &[4])],
        );
        let l = Launch {
            node: "dW".into(),
            op: mpc_ir::Op::Gemm(mpc_ir::ops::GemmAttrs { transA: true, beta: 0.0, ..Default::default() }),
            inputs,
            outputs: vec![t(2 << 20, &dw)],
            branches: None,
            chain: None,
            epilogue: None,
            epilogue_operand: None,
            epilogue_then: None,
            group: Vec::new(),
            sibling: Some(Box::new(sibling)),
            relu_mask: None,
            relu_prologue: None,
            unread: Vec::new(),
        };
        let p = plan(&l, &none).unwrap();
        check_plan(&l, &p).unwrap();
        let [Call::Lt(lt)] = p.calls.as_slice() else { panic!("dY in slot {dy_slot}: {:?}", p.calls) };
        let of = if dy_slot == 0 { GradOf::B } else { GradOf::A };
        assert_eq!((lt.bias, lt.relu, lt.bgrad), (None, false, Some((Buf::Tensor(Region::Arena, 3 << 20), of))));
        assert!(matches!(lt.fallback.first(), Some(Call::Gemm(_))), "{:?}", lt.fallback);
        let reduce = lt.fallback[1..].iter().any(|c| matches!(c, Call::Kernel(k) if k.name.starts_with("reduce_sum")));
        assert!(reduce, "the fallback sums dY: {:?}", lt.fallback);
        // With a ReLU epilogue the product takes no bias gradient: the sibling's own calls follow
        // the product, outside its fallback (as `plan` adds any sibling its launch did not take).
        let relu = Launch { epilogue: Some(mpc_ir::Op::Relu), ..l };
        let p = plan(&relu, &none).unwrap();
        check_plan(&relu, &p).unwrap();
        let [Call::Lt(lt), after @ ..] = p.calls.as_slice() else { panic!("{:?}", p.calls) };
        assert_eq!((lt.relu, lt.bgrad), (true, None));
        assert!(after.iter().any(|c| matches!(c, Call::Kernel(k) if k.name.starts_with("reduce_sum"))), "{after:?}");
    }
}

/// A first convolution's input gradient, which nothing reads (the lowering marks it unread), is
/// not computed: the ConvGrad's plan asks cuDNN for the filter gradient only, and its fallback
/// runs no col2im; every other ConvGrad computes both.
#[test]
fn an_unread_input_gradient_of_a_convolution_is_not_computed() {
    let g = common::compiled("cnn_bn", "mixed", true).unwrap();
    let p = lowered("cnn_bn", &g).expect("cnn_bn lowers");
    let none = |_: &TensorRef| None;
    let (mut skipped, mut both) = (0, 0);
    for l in p.launches.iter().filter(|l| matches!(l.op, mpc_ir::Op::ConvGrad(_))) {
        let plan = plan(l, &none).unwrap();
        let Some(Call::Conv(conv)) = plan.calls.iter().find(|c| matches!(c, Call::Conv(_))) else {
            panic!("{}: no cuDNN call", l.node)
        };
        let data = conv.ops.iter().any(|o| matches!(o, DnnOp::BackwardData { .. }));
        let filter = conv.ops.iter().any(|o| matches!(o, DnnOp::BackwardFilter { .. }));
        let col2im = conv.fallback.iter().any(|c| matches!(c, Call::Kernel(k) if k.name.starts_with("im2col_col2im")));
        assert!(filter, "{}", l.node);
        if l.unread.contains(&0) {
            assert!(!data && !col2im, "{}: computes the dX nothing reads", l.node);
            skipped += 1;
        } else {
            assert!(data && col2im, "{}", l.node);
            both += 1;
        }
    }
    assert_eq!(skipped, 1, "the first convolution's dX");
    assert!(both > 0);
}
