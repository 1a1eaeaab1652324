//! ONNX conformance cases on the CPU runtime.
//!
//! Every case of `MPC_ONNX_NODE_TESTS` (set by `.ci/run`; skipped with a message when absent) is
//! imported, compiled with `--policy fp32`, lowered to a program for its own inputs (their shapes
//! bound, the inputs that set shapes taken as values, constants folded) and run on the CPU device;
//! outputs
//! must match the expected ones within `Tolerance::ONNX` (floats: rtol 1e-3 / atol 1e-5) or exactly. Cases that use an op or
//! dtype mpc does not run yet are skipped with the reason. While kernels are being completed,
//! `tests/runtime_known_failures.txt` lists the cases that fail today: the test fails on any failure
//! not listed there (a regression) and on any listed case that now passes (the list must shrink).

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use common::{numbered, read_pb};

use mpc_runtime::device::Device;
use mpc_runtime::{HostTensor, RuntimeError, Tolerance};

enum Outcome {
    Pass,
    Skip(String),
    Fail(String),
}

/// Floats within the ONNX backend tests' bounds, everything else exactly. 16-bit floats also
/// within their own rounding: the numpy reference rounds every step to them, where mpc's CPU
/// computes inside in f32 and rounds the result once.
fn close(got: &HostTensor, want: &HostTensor) -> Result<(), String> {
    let tol = match want.dtype() {
        d @ (mpc_ir::DType::F16 | mpc_ir::DType::BF16) => {
            let (onnx, own) = (Tolerance::ONNX, Tolerance::for_dtype(d));
            Tolerance {
                rtol: onnx.rtol.max(own.rtol),
                atol: onnx.atol.max(own.atol),
                rel_l2: onnx.rel_l2.max(own.rel_l2),
            }
        }
        d if d.is_float() => Tolerance::ONNX,
        _ => Tolerance::EXACT,
    };
    tol.check(got, want).map(|_| ())
}

/// Runs through a lowered program on the CPU device. `Err(Ok(_))`: lowering failed with this
/// message.
fn run<D: Device>(
    device: D,
    g: &mpc_ir::Graph,
    feeds: &HashMap<String, HostTensor>,
    model: &Path,
) -> Result<Vec<(String, HostTensor)>, Result<String, RuntimeError>> {
    match mpc::run::run_once_on(device, g, feeds, model) {
        Ok(o) => Ok(o),
        Err(mpc::Error::Run { source, .. }) => Err(Err(source)),
        Err(e) => Err(Ok(e.to_string())),
    }
}

fn run_case<D: Device>(dir: &Path, device: &impl Fn() -> D) -> Outcome {
    run_case_within(dir, device, close)
}

/// [`run_case`], each output compared with its expected one by `close`.
fn run_case_within<D: Device>(
    dir: &Path,
    device: &impl Fn() -> D,
    close: impl Fn(&HostTensor, &HostTensor) -> Result<(), String>,
) -> Outcome {
    let model = dir.join("model.onnx");
    let mut g = match mpc::load(&model) {
        Ok(g) => g,
        Err(e) if e.to_string().contains("not supported") => return Outcome::Skip("import: unsupported dtype".into()),
        Err(e) => return Outcome::Fail(format!("import: {e}")),
    };
    if let Err(e) = mpc::compile(&mut g, &model, &mpc::Options::default(), &mut |_, _| {}) {
        return Outcome::Fail(format!("compile: {e}"));
    }
    let mut sets: Vec<_> =
        std::fs::read_dir(dir).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
    sets.sort();
    for set in sets {
        let ins: Result<Vec<HostTensor>, String> = numbered(&set, "input_").iter().map(|p| read_pb(p)).collect();
        let outs: Result<Vec<HostTensor>, String> = numbered(&set, "output_").iter().map(|p| read_pb(p)).collect();
        let (ins, outs) = match (ins, outs) {
            (Ok(i), Ok(o)) => (i, o),
            (Err(e), _) | (_, Err(e)) if e.contains("not supported") => {
                return Outcome::Skip("test data: unsupported dtype".into())
            }
            (Err(e), _) | (_, Err(e)) => return Outcome::Fail(format!("test data: {e}")),
        };
        let feeds: HashMap<String, HostTensor> =
            g.inputs().iter().zip(ins).map(|(&v, t)| (g.name(v).to_string(), t)).collect();
        let got = match run(device(), &g, &feeds, &model) {
            Ok(o) => o,
            Err(Err(RuntimeError::Unsupported { msg, .. })) => return Outcome::Skip(msg),
            Err(Err(e)) => return Outcome::Fail(e.to_string()),
            Err(Ok(e)) => return Outcome::Fail(e),
        };
        for ((name, got), want) in got.iter().zip(&outs) {
            if let Err(e) = close(got, want) {
                return Outcome::Fail(format!("output `{name}`: {e}"));
            }
        }
    }
    Outcome::Pass
}

common::per_device!(conformance_cases => conformance_cases_on, differential_cases => differential_cases_on);

/// Floats within a tight bound (fp32's own rounding over a few operations), everything else
/// exactly: what the differential cases are held to.
const DIFFERENTIAL: Tolerance = Tolerance { rtol: 1e-5, atol: 1e-5, rel_l2: 1e-5 };

/// The wrong answers differential testing found (tests/models/differential: each class a case, in
/// the backend tests' layout, expected outputs from onnxruntime or, where a case says so, numpy in
/// float64): every case runs and matches, none may be skipped.
fn differential_cases_on<D: Device>(device: impl Fn() -> D) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/differential");
    let mut cases: Vec<_> = std::fs::read_dir(&root).unwrap().flatten().map(|e| e.path()).collect();
    cases.sort();
    let mut failed = Vec::new();
    let mut passed = 0;
    for case in cases.iter().filter(|c| c.join("model.onnx").is_file()) {
        let name = case.file_name().unwrap_or_default().to_string_lossy().to_string();
        match run_case_within(case, &device, |got, want| match want.dtype() {
            d if d.is_float() => DIFFERENTIAL.check(got, want).map(|_| ()),
            _ => Tolerance::EXACT.check(got, want).map(|_| ()),
        }) {
            Outcome::Pass => passed += 1,
            Outcome::Skip(why) | Outcome::Fail(why) => failed.push(format!("{name}: {why}")),
        }
    }
    for f in &failed {
        eprintln!("FAIL {f}");
    }
    eprintln!("differential: {passed} passed, {} failed", failed.len());
    assert!(failed.is_empty(), "{} differential cases fail:\n{}", failed.len(), failed.join("\n"));
    assert!(passed >= 117, "only {passed} differential cases ran");
}

fn conformance_cases_on<D: Device>(device: impl Fn() -> D) {
    let Some(root) = std::env::var_os("MPC_ONNX_NODE_TESTS") else {
        eprintln!("skipped: set MPC_ONNX_NODE_TESTS to the onnx-node-tests folder to run the conformance cases");
        return;
    };
    let known: BTreeSet<String> = include_str!("runtime_known_failures.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let mut cases: Vec<_> =
        std::fs::read_dir(&root).expect("read MPC_ONNX_NODE_TESTS").flatten().map(|e| e.path()).collect();
    cases.sort();
    let (mut passed, mut skipped) = (Vec::new(), BTreeMap::<String, usize>::new());
    let mut failed: BTreeMap<String, String> = BTreeMap::new();
    for case in cases.iter().filter(|c| c.join("model.onnx").is_file()) {
        let name = case.file_name().unwrap_or_default().to_string_lossy().to_string();
        match run_case(case, &device) {
            Outcome::Pass => passed.push(name),
            Outcome::Skip(why) => *skipped.entry(why).or_default() += 1,
            Outcome::Fail(why) => {
                failed.insert(name, why);
            }
        }
    }
    let mut reasons: Vec<_> = skipped.iter().collect();
    reasons.sort_by(|a, b| b.1.cmp(a.1));
    for (why, n) in reasons {
        eprintln!("skipped {n:4}: {why}");
    }
    let new: Vec<_> = failed.iter().filter(|(n, _)| !known.contains(*n)).collect();
    for (n, why) in &new {
        eprintln!("FAIL {n}: {why}");
    }
    let fixed: Vec<_> = passed.iter().filter(|n| known.contains(*n)).collect();
    eprintln!(
        "runtime conformance: {} passed, {} failed ({} known), {} skipped",
        passed.len(),
        failed.len(),
        failed.len() - new.len(),
        skipped.values().sum::<usize>()
    );
    assert!(passed.len() > 900, "only {} cases passed: is MPC_ONNX_NODE_TESTS the right folder?", passed.len());
    assert!(new.is_empty(), "{} conformance cases fail that are not in tests/runtime_known_failures.txt", new.len());
    assert!(fixed.is_empty(), "these now pass; remove them from tests/runtime_known_failures.txt: {fixed:?}");
}

/// How much of the conformance suite the CUDA device can run, known with no GPU: every case that
/// lowers for the CUDA device's alignment is planned launch by launch ([`mpc_runtime::cuda::plan`]),
/// and the ops it has no kernel for yet are counted. (What the plans compute is checked by
/// `conformance_cases` on a GPU.)
#[cfg(feature = "cuda")]
#[test]
fn cuda_plans_cover_the_conformance_cases() {
    use mpc_runtime::program::{DeviceCaps, Launch, TensorRef};
    let Some(cases) = common::conformance_cases() else { return };
    fn flat(ls: &[Launch], out: &mut Vec<Launch>) {
        for l in ls {
            match &l.branches {
                Some(b) => {
                    flat(&b.then_launches, out);
                    flat(&b.else_launches, out);
                }
                None => out.push(l.clone()),
            }
        }
    }
    let caps = DeviceCaps { name: "cuda", align: 256, memory: 1 << 40, fuse: true };
    // Each kernel call against the parameters its cubin declares, where NVRTC is present.
    let mut kernels = BTreeMap::new();
    if mpc_runtime::cuda::nvrtc::version().and_then(|_| mpc_runtime::cuda::nvrtc::include_dir()).is_ok() {
        for (family, source) in mpc_runtime::cuda::nvrtc::FAMILIES {
            let c = mpc_runtime::cuda::nvrtc::compile(family, source, "sm_90", false).unwrap();
            kernels.extend(mpc_runtime::cuda::cubin::kernels(&c.cubin).unwrap());
        }
    }
    let mut abi = Vec::new();
    // Fused chains' generated kernels, compiled together after the walk.
    let mut fused: BTreeMap<String, (String, mpc_runtime::cuda::plan::Kernel)> = BTreeMap::new();
    let (mut lowered, mut planned) = (0, 0);
    let mut missing: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for common::ConformanceCase { name, model, graph: g, feeds } in &cases {
        let Ok(program) = mpc::run::lower_for_inputs(g, feeds, caps, model) else { continue };
        lowered += 1;
        let constant = |t: &TensorRef| program.constant(t);
        let mut launches = Vec::new();
        flat(&program.launches, &mut launches);
        let mut ok = true;
        for l in &launches {
            if let Ok(p) = mpc_runtime::cuda::plan::plan(l, &constant) {
                for k in p.kernels() {
                    if k.fused.is_some() {
                        fused.entry(k.name.clone()).or_insert_with(|| (name.clone(), k.clone()));
                        continue;
                    }
                    let checked = match kernels.get(&k.name) {
                        Some(d) => mpc_runtime::cuda::plan::check_args(&k.name, &k.args, d),
                        None if kernels.is_empty() => Ok(()),
                        None => Err(format!("no kernel {}", k.name)),
                    };
                    if let Err(e) = checked {
                        abi.push(format!("{name}: {e}"));
                    }
                }
            }
            if let Err(e) = mpc_runtime::cuda::plan::plan(l, &constant) {
                let op = e.split(" has no CUDA kernel").next().filter(|_| e.contains("has no CUDA kernel"));
                let key = op.map_or_else(|| format!("{}: {e}", l.op.op_type()), |o| format!("{o}: no kernel yet"));
                missing.entry(key).or_default().push(name.clone());
                ok = false;
                break;
            }
        }
        planned += ok as usize;
    }
    if !kernels.is_empty() {
        let source: String = fused.values().map(|(_, k)| k.fused.as_ref().unwrap().source.as_str()).collect();
        let c = mpc_runtime::cuda::nvrtc::compile("fused", &source, "sm_90", false).unwrap();
        let declared = mpc_runtime::cuda::cubin::kernels(&c.cubin).unwrap();
        for (kernel, (case, k)) in &fused {
            let checked = match declared.get(kernel) {
                Some(d) => mpc_runtime::cuda::plan::check_args(kernel, &k.args, d),
                None => Err(format!("no kernel {kernel}")),
            };
            if let Err(e) = checked {
                abi.push(format!("{case}: {e}"));
            }
        }
        eprintln!("cuda plans: {} fused chains' kernels compiled and checked", fused.len());
    }
    let mut reasons: Vec<_> = missing.iter().collect();
    reasons.sort_by_key(|r| std::cmp::Reverse(r.1.len()));
    for (why, names) in &reasons {
        eprintln!("cuda unplanned {:4}: {why} (e.g. {})", names.len(), names[0]);
    }
    eprintln!(
        "cuda plans: {planned} of the {lowered} conformance cases that lower plan every launch{}",
        if kernels.is_empty() {
            " (kernel parameters not checked: no NVRTC)"
        } else {
            "; every kernel call matches its cubin"
        }
    );
    assert!(abi.is_empty(), "{}", abi.join("\n"));
    assert!(lowered > 900, "only {lowered} cases lowered: is MPC_ONNX_NODE_TESTS the right folder?");
    assert!(planned >= 928, "only {planned} of {lowered} cases plan on cuda (928 did)");
}

/// ONNX's own cases of its `Attention` operator (opset 23 and later, what torch.onnx writes for
/// scaled_dot_product_attention from opset 23), which the onnx-node-tests set leaves out:
/// tests/models/onnx_attention, made by its make_cases.py with the onnx package's numpy
/// reference. Expanded by the `expand-attention` pass into standard ops, every case without a KV
/// cache matches the reference on the CPU device; a cache (`past_key`, `nonpad_kv_seqlen`) leaves
/// the node opaque, and those cases say so.
#[test]
fn onnx_attention_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/onnx_attention");
    let mut cases: Vec<_> = std::fs::read_dir(&root).unwrap().flatten().map(|e| e.path()).collect();
    cases.sort();
    let (mut passed, mut failed, mut skipped) = (0, Vec::new(), BTreeMap::<String, usize>::new());
    for case in cases.iter().filter(|c| c.join("model.onnx").is_file()) {
        let name = case.file_name().unwrap_or_default().to_string_lossy().to_string();
        match run_case(case, &mpc_runtime::device::CpuDevice::default) {
            Outcome::Pass => passed += 1,
            Outcome::Skip(why) if why.contains("opaque op ::Attention") => {
                // Opaque only where the node has a cache: an input past V and the mask.
                let g = mpc::load(&case.join("model.onnx")).unwrap();
                let cache = g.node_ids().any(|n| (4..g.node(n).inputs().len()).any(|i| g.node(n).input(i).is_some()));
                assert!(cache, "{name}: the node stays opaque without a cache");
                *skipped
                    .entry("a KV cache (past_key or nonpad_kv_seqlen): the node stays opaque".into())
                    .or_default() += 1
            }
            Outcome::Skip(why) => *skipped.entry(why).or_default() += 1,
            Outcome::Fail(why) => failed.push(format!("{name}: {why}")),
        }
    }
    for (why, n) in &skipped {
        eprintln!("skipped {n:4}: {why}");
    }
    for f in &failed {
        eprintln!("FAIL {f}");
    }
    eprintln!("onnx attention: {passed} passed, {} failed, {} skipped", failed.len(), skipped.values().sum::<usize>());
    assert!(failed.is_empty(), "{} Attention cases fail", failed.len());
    assert_eq!(passed, 59, "Attention cases passed");
}

/// ONNX Attention's causal mask over sequence lengths known only when the graph runs (made from
/// the shapes, not a constant): the outputs of the same inputs with the lengths fixed.
#[test]
fn onnx_attention_causal_over_symbolic_lengths() {
    let run = |len: &str| {
        let body = format!(
            "input %0 \"q\": f32[1,2,{len},8]\n  input %1 \"k\": f32[1,2,{len},8]\n  input %2 \"v\": f32[1,2,{len},8]\n  \
             %3 \"y\": f32[1,2,{len},8] = ::Attention[is_causal=1](%0, %1, %2)\n  output %3"
        );
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 23\ngraph \"t\"\n  {body}\nend\n");
        let mut g = mpc_ir::text::parse(&text, None).unwrap();
        let model = Path::new("attention");
        mpc::compile(&mut g, model, &mpc::Options::default(), &mut |_, _| {}).unwrap();
        let constant = g.initializers().any(|v| g.name(v).ends_with(".position_mask"));
        let dims: HashMap<String, u64> = [("s".to_string(), 5)].into();
        let feeds = mpc::run::random_inputs(&g, 7, &dims).unwrap();
        (mpc::run::run_once(&g, &feeds, model).unwrap().remove(0).1, constant)
    };
    let ((fixed, constant), (symbolic, computed)) = (run("5"), run("s"));
    assert!(constant && !computed, "the fixed lengths' mask a constant, the symbolic ones' computed");
    mpc_runtime::Tolerance { rtol: 1e-6, atol: 1e-7, rel_l2: 1e-6 }.check(&symbolic, &fixed).unwrap();
}
