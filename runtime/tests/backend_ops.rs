//! Op tests written once, instantiated for every device by `device_tests!` (the CUDA device will
//! add one line). Graphs are small, fully typed text-IR programs, lowered and run on the device;
//! every device must give these results.

use std::collections::HashMap;

use mpc_ir::{text, DType};
use mpc_runtime::device::Device;
use mpc_runtime::program::{lower, LowerOptions};
use mpc_runtime::session::Session;
use mpc_runtime::HostTensor;

fn graph(body: &str) -> mpc_ir::Graph {
    let src = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{body}\nend\n");
    text::parse(&src, None).expect("test graph parses")
}

fn run<D: Device>(device: D, body: &str, inputs: Vec<(&str, HostTensor)>) -> Vec<HostTensor> {
    let g = graph(body);
    let program = lower(&g, device.caps(), LowerOptions::default()).expect("lowers");
    let feeds: HashMap<String, HostTensor> = inputs.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
    let mut s = Session::new(device, program).expect("a session");
    s.run(&feeds).expect("runs").into_iter().map(|(_, t)| t).collect()
}

fn ones(dtype: DType, shape: Vec<usize>) -> HostTensor {
    let n = shape.iter().product();
    HostTensor::from_f64(dtype, shape, vec![1.0; n])
}

/// 4096 f16 ones sum to 4096 with f32 accumulation; f16 accumulation would stall at 2048.
pub fn f16_reduction_accumulates_in_f32<D: Device>(b: impl Fn() -> D) {
    let out = run(
        b(),
        "  input %0 \"x\": f16[4096]\n  %1 \"s\": f16[] = ReduceSum[keepdims=0](%0)\n  output %1",
        vec![("x", ones(DType::F16, vec![4096]))],
    );
    assert_eq!(out[0].f64s(), vec![4096.0]);
}

/// The same for a matrix product's inner dimension.
pub fn f16_matmul_accumulates_in_f32<D: Device>(b: impl Fn() -> D) {
    let out = run(
        b(),
        "  input %0 \"a\": f16[1,4096]\n  input %1 \"b\": f16[4096,1]\n  %2 \"c\": f16[1,1] = MatMul(%0, %1)\n  output %2",
        vec![("a", ones(DType::F16, vec![1, 4096])), ("b", ones(DType::F16, vec![4096, 1]))],
    );
    assert_eq!(out[0].f64s(), vec![4096.0]);
}

/// f16 results round on store: 1 + 2^-11 is not representable and rounds to 1.
pub fn f16_rounds_on_store<D: Device>(b: impl Fn() -> D) {
    let x = HostTensor::from_f64(DType::F16, vec![1], vec![1.0]);
    let e = HostTensor::from_f32(DType::F32, vec![1], vec![1.0 / 2048.0]);
    let body = "  input %0 \"x\": f16[1]\n  input %1 \"e\": f32[1]\n  %2 \"ec\": f16[1] = Cast[to=10](%1)\n  %3 \"y\": f16[1] = Add(%0, %2)\n  output %3";
    assert_eq!(run(b(), body, vec![("x", x), ("e", e)])[0].f64s(), vec![1.0]);
}

pub fn broadcasting_and_softmax<D: Device>(b: impl Fn() -> D) {
    let x = HostTensor::from_f32(DType::F32, vec![2, 3], vec![1.0, 2.0, 3.0, 1.0, 1.0, 1.0]);
    let bias = HostTensor::from_f32(DType::F32, vec![3], vec![0.0, 0.0, 1000.0]);
    let body = "  input %0 \"x\": f32[2,3]\n  input %1 \"b\": f32[3]\n  %2 \"s\": f32[2,3] = Add(%0, %1)\n  %3 \"p\": f32[2,3] = Softmax(%2)\n  output %3";
    let p = run(b(), body, vec![("x", x), ("b", bias)])[0].f64s();
    // Stable for large logits: the 1000 dominates each row.
    assert!((p[2] - 1.0).abs() < 1e-6 && (p[5] - 1.0).abs() < 1e-6, "{p:?}");
    assert!((p.iter().sum::<f64>() - 2.0).abs() < 1e-6);
}

pub fn conv_with_padding_and_stride<D: Device>(b: impl Fn() -> D) {
    // A 3x3 box filter over a 4x4 image of ones, padding 1, stride 2: corners see 4 ones, edges 6.
    let body = "  input %0 \"x\": f32[1,1,4,4]\n  input %1 \"w\": f32[1,1,3,3]\n  %2 \"y\": f32[1,1,2,2] = Conv[pads=[1, 1, 1, 1], strides=[2, 2]](%0, %1)\n  output %2";
    let y = run(b(), body, vec![("x", ones(DType::F32, vec![1, 1, 4, 4])), ("w", ones(DType::F32, vec![1, 1, 3, 3]))]);
    assert_eq!(y[0].shape, vec![1, 1, 2, 2]);
    assert_eq!(y[0].f64s(), vec![4.0, 6.0, 6.0, 9.0]);
}

pub fn runs_are_deterministic<D: Device>(b: impl Fn() -> D) {
    let x = HostTensor::from_f32(
        DType::F32,
        vec![64, 64],
        (0..4096).map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5).collect(),
    );
    let body = "  input %0 \"x\": f32[64,64]\n  %1 \"y\": f32[64,64] = MatMul(%0, %0)\n  %2 \"s\": f32[] = ReduceSum[keepdims=0](%1)\n  output %2";
    let a = run(b(), body, vec![("x", x.clone())]);
    let c = run(b(), body, vec![("x", x)]);
    assert_eq!(a, c);
}

/// The ONNX spec's examples: linear (half_pixel) and nearest upsampling of [[1, 2], [3, 4]].
pub fn resize_linear_and_nearest<D: Device>(b: impl Fn() -> D) {
    let x = HostTensor::from_f32(DType::F32, vec![1, 1, 2, 2], vec![1.0, 2.0, 3.0, 4.0]);
    let linear = "  input %0 \"x\": f32[1,1,2,2]\n  init %1 \"s\" = f32[4]{1.0, 1.0, 2.0, 2.0}\n  %2 \"y\": f32[1,1,4,4] = Resize[mode=\"linear\"](%0, _, %1)\n  output %2";
    let y = run(b(), linear, vec![("x", x.clone())]);
    let want = [1.0, 1.25, 1.75, 2.0, 1.5, 1.75, 2.25, 2.5, 2.5, 2.75, 3.25, 3.5, 3.0, 3.25, 3.75, 4.0];
    assert_eq!(y[0].f64s(), want.to_vec());
    let nearest = "  input %0 \"x\": f32[1,1,2,2]\n  init %1 \"s\" = f32[4]{1.0, 1.0, 2.0, 3.0}\n  %2 \"y\": f32[1,1,4,6] = Resize(%0, _, %1)\n  output %2";
    let y = run(b(), nearest, vec![("x", x)]);
    assert_eq!(y[0].shape, vec![1, 1, 4, 6]);
    let want = [1., 1., 1., 2., 2., 2., 1., 1., 1., 2., 2., 2., 3., 3., 3., 4., 4., 4., 3., 3., 3., 4., 4., 4.];
    assert_eq!(y[0].f64s(), want.to_vec());
}

/// MaxPool with ceil_mode keeps a last window that starts inside the input (the shape inference
/// predicts, `[1,1,3]`); the padding never wins a max.
pub fn max_pool_ceil_mode<D: Device>(b: impl Fn() -> D) {
    let x = HostTensor::from_f64(DType::F32, vec![1, 1, 4], vec![-1.0, -2.0, -3.0, -4.0]);
    let out = run(
        b(),
        "  input %0 \"x\": f32[1,1,4]\n  %1 \"y\": f32[1,1,3] = MaxPool[ceil_mode=1, kernel_shape=[2], pads=[1, 0], strides=[2]](%0)\n  output %1",
        vec![("x", x)],
    );
    assert_eq!(out[0].shape, vec![1, 1, 3]);
    assert_eq!(out[0].f64s(), vec![-1.0, -2.0, -4.0]);
}

macro_rules! device_tests {
    ($name:ident: $device:expr) => {
        mod $name {
            #[test]
            fn f16_reduction_accumulates_in_f32() {
                super::f16_reduction_accumulates_in_f32(|| $device)
            }
            #[test]
            fn f16_matmul_accumulates_in_f32() {
                super::f16_matmul_accumulates_in_f32(|| $device)
            }
            #[test]
            fn f16_rounds_on_store() {
                super::f16_rounds_on_store(|| $device)
            }
            #[test]
            fn broadcasting_and_softmax() {
                super::broadcasting_and_softmax(|| $device)
            }
            #[test]
            fn conv_with_padding_and_stride() {
                super::conv_with_padding_and_stride(|| $device)
            }
            #[test]
            fn resize_linear_and_nearest() {
                super::resize_linear_and_nearest(|| $device)
            }
            #[test]
            fn max_pool_ceil_mode() {
                super::max_pool_ceil_mode(|| $device)
            }
            #[test]
            fn runs_are_deterministic() {
                super::runs_are_deterministic(|| $device)
            }
        }
    };
}

device_tests!(cpu: mpc_runtime::device::CpuDevice::default());
