//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod onnx;
pub mod training;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const FIXTURES: [&str; 8] =
    ["mlp", "mlp_loss", "cnn_bn", "resblock", "transformer", "opset9", "custom_op", "control_flow"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models").join(format!("{name}.onnx"))
}

/// The fixture `name` compiled under `policy`: the inference graph, or with `train` the training
/// step (the batch freed from the export; the loss on the first output, or the model's own `loss`
/// output where it has one).
pub fn compiled(name: &str, policy: &str, train: bool) -> Result<mpc_ir::Graph, mpc::Error> {
    compiled_with(name, policy, train, false)
}

/// [`compiled`], with its attention chains fused (`--fused-attention`) where `fused_attention`.
pub fn compiled_with(
    name: &str,
    policy: &str,
    train: bool,
    fused_attention: bool,
) -> Result<mpc_ir::Graph, mpc::Error> {
    use mpc_passes::train::{Loss, TrainOptions};
    let path = fixture(name);
    let mut g = mpc::load(&path)?;
    if train {
        mpc::train::free_batch(&mut g);
    }
    let loss =
        if name.ends_with("_loss") { Loss::Output("loss".into()) } else { Loss::CrossEntropy(Default::default()) };
    let t = train.then(|| TrainOptions { loss, ..TrainOptions::default() });
    let opts = mpc::Options { policy: Some(policy.into()), train: t, fused_attention, ..Default::default() };
    mpc::compile(&mut g, &path, &opts, &mut |_, _| {})?;
    Ok(g)
}

/// A fresh scratch folder for one test.
pub fn scratch(test: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(test);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

pub fn mpc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mpc")).args(args).output().expect("run mpc")
}

pub fn settings() -> insta::Settings {
    let mut s = insta::Settings::clone_current();
    s.set_snapshot_path(Path::new(env!("CARGO_MANIFEST_DIR")).join("snapshots"));
    s.set_prepend_module_to_snapshot(false);
    s.set_omit_expression(true);
    s
}

/// Instantiates each `name => generic test function` once per device, the function receiving a
/// factory of fresh devices: the CPU, and the first GPU, whose tests skip with one line where
/// none can be used (no driver, no GPU, no NVRTC) and so hold the GPU to the CPU's results
/// wherever there is one.
#[allow(unused_macros)]
macro_rules! per_device {
    ($($name:ident => $f:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() {
                    super::$f(mpc_runtime::device::CpuDevice::default)
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(
                #[test]
                fn $name() {
                    if let Err(e) = mpc_runtime::cuda::device::CudaDevice::new(0) {
                        eprintln!("skipped on cuda: {e}");
                        return;
                    }
                    super::$f(|| mpc_runtime::cuda::device::CudaDevice::new(0).expect("the GPU opened a moment ago"))
                }
            )*
        }
    };
}
#[allow(unused_imports)]
pub(crate) use per_device;

/// y = x·W against targets x·W*, W all `w0` and W* all `target_w`, the data written to `dir`.
/// With `loss_factor` the model computes its own loss, `factor · mean((y − t)²)`, as output `loss`.
pub fn regression(dir: &Path, w0: f32, target_w: f32, n: usize, loss_factor: Option<f32>) -> (PathBuf, PathBuf) {
    let mut g = mpc_ir::Graph::new("regression");
    let batch = mpc_ir::Shape(vec![mpc_ir::Dim::sym("batch"), mpc_ir::Dim::Fixed(16)]);
    let x = g.add_input("x", mpc_ir::TypeInfo::new(mpc_ir::DType::F32, batch.clone()));
    let w = g.add_initializer("w", mpc_ir::Tensor::from_f32(vec![16, 16], &vec![w0; 256]));
    let (_, y) = g.add_op("matmul", mpc_ir::Op::MatMul, &[Some(x), Some(w)], 1);
    match loss_factor {
        None => g.add_output(y[0]),
        Some(c) => {
            let t = g.add_input("targets", mpc_ir::TypeInfo::new(mpc_ir::DType::F32, batch));
            let k = g.add_initializer("factor", mpc_ir::Tensor::from_f32(vec![], &[c]));
            let (_, d) = g.add_op("sub", mpc_ir::Op::Sub, &[Some(y[0]), Some(t)], 1);
            let (_, sq) = g.add_op("square", mpc_ir::Op::Mul, &[Some(d[0]), Some(d[0])], 1);
            let attrs = mpc_ir::ops::ReduceAttrs { keepdims: false, noop_with_empty_axes: false };
            let (_, m) = g.add_op("mean", mpc_ir::Op::ReduceMean(attrs), &[Some(sq[0])], 1);
            let (_, l) = g.add_op("loss", mpc_ir::Op::Mul, &[Some(m[0]), Some(k)], 1);
            g.add_output(l[0]);
        }
    }
    let model = dir.join("regression.onnx");
    mpc::save(&g, &model, mpc::Format::Onnx).unwrap();
    let mut seed = 12345u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 11) as f64 / (1u64 << 53) as f64
    };
    let xs: Vec<f64> = (0..n * 16).map(|_| next() * 2.0 - 1.0).collect();
    let ts: Vec<f64> = (0..n)
        .flat_map(|r| {
            let s: f64 = xs[r * 16..(r + 1) * 16].iter().sum::<f64>() * target_w as f64;
            vec![s; 16]
        })
        .collect();
    let data = dir.join("data.safetensors");
    mpc::run::write_safetensors(
        &data,
        &[
            ("x".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![n, 16], xs)),
            ("targets".into(), mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![n, 16], ts)),
        ],
    )
    .unwrap();
    (model, data)
}

/// One tensor of an ONNX conformance case (`input_0.pb`, `output_0.pb`, ...).
pub fn read_pb(p: &Path) -> Result<mpc_runtime::value::HostTensor, String> {
    let bytes = std::fs::read(p).map_err(|e| e.to_string())?;
    let t = mpc_ir::onnx::decode_tensor(bytes.into()).map_err(|e| e.to_string())?;
    Ok(mpc_runtime::value::HostTensor::from(&t))
}

/// The files `<prefix><n>.pb` of `dir`, by n.
pub fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let n = name.strip_prefix(prefix)?.strip_suffix(".pb")?.parse().ok()?;
            Some((n, e.path()))
        })
        .collect();
    v.sort();
    v.into_iter().map(|(_, p)| p).collect()
}

/// An ONNX conformance case whose model mpc imports and compiles (default options) and whose
/// first input set decodes.
pub struct ConformanceCase {
    pub name: String,
    pub model: PathBuf,
    pub graph: mpc_ir::Graph,
    /// The first input set, by the graph's input names.
    pub feeds: std::collections::HashMap<String, mpc_runtime::value::HostTensor>,
}

/// The cases of `MPC_ONNX_NODE_TESTS` that [`ConformanceCase`] describes, by name; `None`, with a
/// line saying so, when the variable is not set.
pub fn conformance_cases() -> Option<Vec<ConformanceCase>> {
    let Some(root) = std::env::var_os("MPC_ONNX_NODE_TESTS") else {
        eprintln!("skipped: set MPC_ONNX_NODE_TESTS to the onnx-node-tests folder to run the conformance cases");
        return None;
    };
    Some(cases_in(Path::new(&root)))
}

/// The cases in `root` (the backend node tests' layout) that import, compile and have inputs.
pub fn cases_in(root: &Path) -> Vec<ConformanceCase> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(root)
        .unwrap_or_else(|e| panic!("{}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    dirs.sort();
    let mut out = Vec::new();
    for case in dirs.iter().filter(|c| c.join("model.onnx").is_file()) {
        let model = case.join("model.onnx");
        let Ok(mut graph) = mpc::load(&model) else { continue };
        if mpc::compile(&mut graph, &model, &mpc::Options::default(), &mut |_, _| {}).is_err() {
            continue;
        }
        let Some(set) = std::fs::read_dir(case).into_iter().flatten().flatten().map(|e| e.path()).find(|p| p.is_dir())
        else {
            continue;
        };
        let Ok(ins) = numbered(&set, "input_").iter().map(|p| read_pb(p)).collect::<Result<Vec<_>, _>>() else {
            continue;
        };
        let feeds = graph.inputs().iter().zip(ins).map(|(&v, t)| (graph.name(v).to_string(), t)).collect();
        let name = case.file_name().unwrap_or_default().to_string_lossy().to_string();
        out.push(ConformanceCase { name, model, graph, feeds });
    }
    out
}

/// Single ops at sizes that take the GPU's multi-pass and wide paths (few long columns, LayerNorm's
/// parameter gradients over many tokens, batch norm over few channels of many elements, an
/// update reading an f16 gradient with its loss scale, broadcasts against a scalar and a row):
/// `cuda_vs_cpu` runs them on a GPU, `cuda_plan_semantics` runs their plans' kernels on the CPU.
/// The fixtures are too small to reach these paths.
pub const LARGE_SINGLE_OPS: [&str; 36] = [
    // The dtype variants the benchmarks' steps launch besides the f32/f16 ones above: bf16 batch
    // norms split over 256 channels, column sums of f16 and bf16 over many rows (a bias
    // gradient), LayerNorm's split parameter sums reading a bf16 dy, GatherGrad's f32 sums.
    "input %0 \"x\": bf16[2,256,64,64]\n  input %1 \"s\": f32[256]\n  input %2 \"b\": f32[256]\n  input %3 \"m\": f32[256]\n  input %4 \"v\": f32[256]\n  %5 \"y\": bf16[2,256,64,64], %6 \"rm\": f32[256], %7 \"rv\": f32[256] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dy\": bf16[2,256,64,64]\n  input %1 \"x\": bf16[2,256,64,64]\n  input %2 \"s\": f32[256]\n  %3 \"dx\": bf16[2,256,64,64], %4 \"ds\": bf16[256], %5 \"db\": bf16[256] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5",
    "input %0 \"x\": f16[4096,96]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f16[96] = ReduceSum[keepdims=0](%0, %1)\n  output %2",
    "input %0 \"x\": bf16[4096,96]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": bf16[96] = ReduceSum[keepdims=0](%0, %1)\n  output %2",
    "input %0 \"dy\": bf16[600,48]\n  input %1 \"x\": f32[600,48]\n  input %2 \"s\": f32[48]\n  %3 \"dyw\": f32[600,48] = Cast[to=1](%0)\n  %4 \"dx\": f32[600,48], %5 \"ds\": f32[48], %6 \"db\": f32[48] = ai.mpc::LayerNormalizationGrad[axis=-1](%3, %1, %2)\n  output %4\n  output %5\n  output %6",
    "input %0 \"dy\": f32[8,300,16]\n  init %1 \"a\" = i64[]{0}\n  init %2 \"b\" = i64[]{2400}\n  init %3 \"c\" = i64[]{1}\n  %4 \"r\": i64[2400] = Range(%1, %2, %3)\n  init %5 \"m\" = i64[]{499}\n  %6 \"j\": i64[2400] = Mod(%4, %5)\n  init %7 \"sh\" = i64[2]{8, 300}\n  %8 \"i\": i64[8,300] = Reshape(%6, %7)\n  init %9 \"s\" = i64[2]{500, 16}\n  %10 \"dx\": f32[500,16] = ai.mpc::GatherGrad[axis=0](%0, %8, %9)\n  output %10",
    // An embedding's gradient over 2400 tokens (more than 64: keys sorted in chunks of 2048 and
    // merged, then one sum per segment), the indices spread over 1000 rows with repeats.
    "input %0 \"dy\": f16[8,300,48]\n  init %1 \"a\" = i64[]{0}\n  init %2 \"b\" = i64[]{2400}\n  init %3 \"c\" = i64[]{1}\n  %4 \"r\": i64[2400] = Range(%1, %2, %3)\n  init %5 \"k\" = i64[]{7}\n  %6 \"r7\": i64[2400] = Mul(%4, %5)\n  init %7 \"m\" = i64[]{997}\n  %8 \"j\": i64[2400] = Mod(%6, %7)\n  init %9 \"sh\" = i64[2]{8, 300}\n  %10 \"i\": i64[8,300] = Reshape(%8, %9)\n  init %11 \"s\" = i64[2]{1000, 48}\n  %12 \"dx\": f16[1000,48] = ai.mpc::GatherGrad[axis=0](%0, %10, %11)\n  output %12",
    // LayerNorm's gradient over many tokens with its f16 dy read widened (mixed GPT's).
    "input %0 \"dy\": f16[600,48]\n  input %1 \"x\": f32[600,48]\n  input %2 \"s\": f32[48]\n  %3 \"dyw\": f32[600,48] = Cast[to=1](%0)\n  %4 \"dx\": f32[600,48], %5 \"ds\": f32[48], %6 \"db\": f32[48] = ai.mpc::LayerNormalizationGrad[axis=-1](%3, %1, %2)\n  output %4\n  output %5\n  output %6",
    "input %0 \"x\": f32[1024,40]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[40] = ReduceSum[keepdims=0](%0, %1)\n  output %2",
    "input %0 \"x\": f16[2,600,64]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f16[2,1,64] = ReduceMean(%0, %1)\n  output %2",
    "input %0 \"x\": f32[3,520,40]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"y\": f32[3,40] = ReduceL2[keepdims=0](%0, %1)\n  output %2",
    "input %0 \"x\": f32[4096,768]\n  init %1 \"ax\" = i64[1]{0}\n  %2 \"y\": f32[768] = ReduceSum[keepdims=0](%0, %1)\n  output %2",
    "input %0 \"dy\": f32[600,48]\n  input %1 \"x\": f32[600,48]\n  input %2 \"s\": f32[48]\n  %3 \"dx\": f32[600,48], %4 \"ds\": f32[48], %5 \"db\": f32[48] = ai.mpc::LayerNormalizationGrad[axis=-1](%0, %1, %2)\n  output %3\n  output %4\n  output %5",
    "input %0 \"x\": f32[4,3,80,80]\n  input %1 \"s\": f32[3]\n  input %2 \"b\": f32[3]\n  input %3 \"m\": f32[3]\n  input %4 \"v\": f32[3]\n  %5 \"y\": f32[4,3,80,80], %6 \"rm\": f32[3], %7 \"rv\": f32[3] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dy\": f16[4,3,80,80]\n  input %1 \"x\": f16[4,3,80,80]\n  input %2 \"s\": f32[3]\n  %3 \"dx\": f16[4,3,80,80], %4 \"ds\": f16[3], %5 \"db\": f16[3] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5",
    // A language model's loss over rows of 50,257 scores: the max and the sum in one pass.
    "input %0 \"x\": f32[8,50257]\n  init %1 \"l\" = i64[8]{0, 50256, 7, 31000, 12, 3, 50000, 9}\n  %2 \"y\": f32[] = SoftmaxCrossEntropyLoss[reduction=\"mean\"](%0, %1)\n  output %2",
    // GELU's gradient 16 bytes at a time, and one element at a time.
    "input %0 \"dy\": f16[64,96]\n  input %1 \"x\": f16[64,96]\n  %2 \"dx\": f16[64,96] = ai.mpc::GeluGrad[approximate=\"tanh\"](%0, %1)\n  output %2",
    "input %0 \"dy\": f32[7,9]\n  input %1 \"x\": f32[7,9]\n  %2 \"dx\": f32[7,9] = ai.mpc::GeluGrad(%0, %1)\n  output %2",
    // Lone element-wise ops of many elements: generated kernels, 8 and 4 elements at a time.
    "input %0 \"x\": f16[64,2048]\n  input %1 \"z\": f32[64,2048]\n  %2 \"r\": f16[64,2048] = Relu(%0)\n  %3 \"c\": f16[64,2048] = Cast[to=10](%1)\n  output %2\n  output %3",
    // Planes of 4095 elements: the passes move one element at a time, not 16 bytes.
    "input %0 \"x\": f32[4,5,63,65]\n  input %1 \"s\": f32[5]\n  input %2 \"b\": f32[5]\n  input %3 \"m\": f32[5]\n  input %4 \"v\": f32[5]\n  %5 \"y\": f32[4,5,63,65], %6 \"rm\": f32[5], %7 \"rv\": f32[5] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dy\": f16[4,5,63,65]\n  input %1 \"x\": f16[4,5,63,65]\n  input %2 \"s\": f32[5]\n  %3 \"dx\": f16[4,5,63,65], %4 \"ds\": f16[5], %5 \"db\": f16[5] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5",
    // Many channels of many elements: the passes split each channel three ways (ResNet's
    // 256 channels of 56 × 56, at batch 4).
    "input %0 \"x\": f16[4,256,56,56]\n  input %1 \"s\": f32[256]\n  input %2 \"b\": f32[256]\n  input %3 \"m\": f32[256]\n  input %4 \"v\": f32[256]\n  %5 \"y\": f16[4,256,56,56], %6 \"rm\": f32[256], %7 \"rv\": f32[256] = BatchNormalization[training_mode=1](%0, %1, %2, %3, %4)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dy\": f16[4,256,56,56]\n  input %1 \"x\": f16[4,256,56,56]\n  input %2 \"s\": f32[256]\n  %3 \"dx\": f16[4,256,56,56], %4 \"ds\": f16[256], %5 \"db\": f16[256] = ai.mpc::BatchNormalizationGrad(%0, %1, %2)\n  output %3\n  output %4\n  output %5",
    // A residual block's batch norm, Add and Relu (ResNet's): its passes 16 bytes at a time, one
    // block per channel, and inference.
    "input %0 \"x\": f16[4,256,56,56]\n  input %1 \"r\": f16[4,256,56,56]\n  input %2 \"s\": f32[256]\n  input %3 \"b\": f32[256]\n  input %4 \"m\": f32[256]\n  input %5 \"v\": f32[256]\n  %6 \"y\": f16[4,256,56,56], %7 \"rm\": f32[256], %8 \"rv\": f32[256] = BatchNormalization[training_mode=1](%0, %2, %3, %4, %5)\n  %9 \"a\": f16[4,256,56,56] = Add(%1, %6)\n  %10 \"o\": f16[4,256,56,56] = Relu(%9)\n  output %10\n  output %7\n  output %8",
    "input %0 \"x\": f32[2,8,7,9]\n  input %1 \"r\": f32[2,8,7,9]\n  input %2 \"s\": f32[8]\n  input %3 \"b\": f32[8]\n  input %4 \"m\": f32[8]\n  input %5 \"v\": f32[8]\n  %6 \"y\": f32[2,8,7,9], %7 \"rm\": f32[8], %8 \"rv\": f32[8] = BatchNormalization[training_mode=1](%0, %2, %3, %4, %5)\n  %9 \"a\": f32[2,8,7,9] = Add(%6, %1)\n  %10 \"o\": f32[2,8,7,9] = Relu(%9)\n  output %10\n  output %7\n  output %8",
    "input %0 \"x\": f16[2,8,7,9]\n  input %1 \"r\": f16[2,8,7,9]\n  input %2 \"s\": f16[8]\n  input %3 \"b\": f16[8]\n  input %4 \"m\": f16[8]\n  input %5 \"v\": f16[8]\n  %6 \"y\": f16[2,8,7,9] = BatchNormalization(%0, %2, %3, %4, %5)\n  %7 \"a\": f16[2,8,7,9] = Add(%6, %1)\n  %8 \"o\": f16[2,8,7,9] = Relu(%7)\n  output %8",
    // A batch norm's gradient reading its dy through the ReLU's gradient (ResNet's blocks): in
    // passes 16 bytes at a time, in passes one element at a time, and one block per channel.
    "input %0 \"dr\": f16[4,256,56,56]\n  input %1 \"r\": f16[4,256,56,56]\n  input %2 \"x\": f16[4,256,56,56]\n  input %3 \"s\": f32[256]\n  %4 \"dy\": f16[4,256,56,56] = ai.mpc::ReluGrad(%0, %1)\n  %5 \"dx\": f16[4,256,56,56], %6 \"ds\": f16[256], %7 \"db\": f16[256] = ai.mpc::BatchNormalizationGrad(%4, %2, %3)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dr\": f32[4,5,63,65]\n  input %1 \"r\": f32[4,5,63,65]\n  input %2 \"x\": f32[4,5,63,65]\n  input %3 \"s\": f32[5]\n  %4 \"dy\": f32[4,5,63,65] = ai.mpc::ReluGrad(%0, %1)\n  %5 \"dx\": f32[4,5,63,65], %6 \"ds\": f32[5], %7 \"db\": f32[5] = ai.mpc::BatchNormalizationGrad(%4, %2, %3)\n  output %5\n  output %6\n  output %7",
    "input %0 \"dr\": f16[2,8,7,9]\n  input %1 \"r\": f16[2,8,7,9]\n  input %2 \"x\": f16[2,8,7,9]\n  input %3 \"s\": f32[8]\n  %4 \"dy\": f16[2,8,7,9] = ai.mpc::ReluGrad(%0, %1)\n  %5 \"dx\": f16[2,8,7,9], %6 \"ds\": f16[8], %7 \"db\": f16[8] = ai.mpc::BatchNormalizationGrad(%4, %2, %3)\n  output %5\n  output %6\n  output %7",
    "input %0 \"x\": f16[8,512,96]\n  input %1 \"s\": f16[]\n  %2 \"y\": f16[8,512,96] = Mul(%0, %1)\n  output %2",
    "input %0 \"x\": f32[8,512,96]\n  input %1 \"b\": f32[96]\n  %2 \"y\": f32[8,512,96] = Add(%0, %1)\n  output %2",
    // Attention-sized transposes that move the last axis (32 x 32 tiles), and products read
    // and written through permutations (arrays of matrix addresses).
    "input %0 \"x\": f16[8,512,12,64]\n  %1 \"y\": f16[8,12,64,512] = Transpose[perm=[0,2,3,1]](%0)\n  output %1",
    "input %0 \"x\": f32[2,12,64,100]\n  %1 \"y\": f32[2,100,12,64] = Transpose[perm=[0,3,1,2]](%0)\n  output %1",
    "input %0 \"q\": f16[2,128,4,64]\n  input %1 \"k\": f16[2,128,4,64]\n  %2 \"qt\": f16[2,4,128,64] = Transpose[perm=[0,2,1,3]](%0)\n  %3 \"kt\": f16[2,4,64,128] = Transpose[perm=[0,2,3,1]](%1)\n  %4 \"s\": f16[2,4,128,128] = MatMul(%2, %3)\n  %5 \"y\": f16[2,128,4,128] = Transpose[perm=[0,2,1,3]](%4)\n  output %5",
    // The finite check of many gradients in chunks, 16 bytes at a time with a scalar tail: an Inf
    // inside an f16 tensor's wide part, a NaN in the last element of an f32 tensor of 70,001
    // (the tail), and none.
    "input %0 \"a\": f16[300000]\n  input %1 \"b\": f32[70001]\n  input %2 \"c\": bf16[999]\n  init %3 \"s\" = i64[]{0}\n  init %4 \"e\" = i64[]{300000}\n  init %5 \"one\" = i64[]{1}\n  %6 \"r\": i64[300000] = Range(%3, %4, %5)\n  init %7 \"k\" = i64[]{234567}\n  %8 \"hit\": bool[300000] = Equal(%6, %7)\n  init %9 \"z\" = f16[]{0}\n  init %10 \"o\" = f16[]{1}\n  %11 \"inf\": f16[] = Div(%10, %9)\n  %12 \"a2\": f16[300000] = Where(%8, %11, %0)\n  init %13 \"e2\" = i64[]{70001}\n  %14 \"r2\": i64[70001] = Range(%3, %13, %5)\n  init %15 \"k2\" = i64[]{70000}\n  %16 \"hit2\": bool[70001] = Equal(%14, %15)\n  init %17 \"zf\" = f32[]{0}\n  %18 \"nan\": f32[] = Div(%17, %17)\n  %19 \"b2\": f32[70001] = Where(%16, %18, %1)\n  %20 \"inf_in_a\": bool[] = ai.mpc::AllFinite(%12, %1, %2)\n  %21 \"nan_in_b\": bool[] = ai.mpc::AllFinite(%0, %19, %2)\n  %22 \"none\": bool[] = ai.mpc::AllFinite(%0, %1, %2)\n  output %20\n  output %21\n  output %22",
    // The second moment must not be negative: |v|.
    "input %0 \"p\": f32[300,7]\n  input %1 \"g\": f16[300,7]\n  input %2 \"m\": f32[300,7]\n  input %3 \"v\": f32[300,7]\n  init %4 \"t\" = i64[]{3}\n  init %5 \"ok\" = bool[]{1}\n  init %6 \"inv\" = f32[]{0.0078125}\n  %7 \"va\": f32[300,7] = Abs(%3)\n  %8 \"p2\": f32[300,7], %9 \"m2\": f32[300,7], %10 \"v2\": f32[300,7] = ai.mpc::AdamUpdate[lr=0.001, decoupled=1](%0, %1, %2, %7, %4, %5, %6)\n  output %8\n  output %9\n  output %10",
];

/// A one-graph model of text IR `body` (ONNX opset 17 and ai.mpc 1).
pub fn single_op(body: &str) -> mpc_ir::Graph {
    let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\nopset \"ai.mpc\" 1\ngraph \"t\"\n  {body}\nend\n");
    mpc_ir::text::parse(&text, None).unwrap_or_else(|e| panic!("{e}\n{text}"))
}
