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

fn f32s(shape: &[usize], v: &[f32]) -> HostTensor {
    HostTensor::from_f32(DType::F32, shape.to_vec(), v.to_vec())
}

/// The error a run stops at (lowering and the session must succeed: the data is what is wrong).
fn run_err<D: Device>(device: D, body: &str, inputs: Vec<(&str, HostTensor)>) -> String {
    let g = graph(body);
    let program = lower(&g, device.caps(), LowerOptions::default()).expect("lowers");
    let feeds: HashMap<String, HostTensor> = inputs.into_iter().map(|(n, t)| (n.to_string(), t)).collect();
    let mut s = Session::new(device, program).expect("a session");
    s.run(&feeds).expect_err("an index out of range must fail").to_string()
}

// The expected values of the index-op tests below are the outputs of the ONNX reference
// implementation (`onnx.reference.ReferenceEvaluator`, onnx 1.23, opset 18) on the same inputs.

/// GatherND of slices and of elements, with negative indices, batch_dims 0 and 1, int64 and int32
/// indices, float and integer data.
pub fn gather_nd_slices_elements_and_batch_dims<D: Device>(b: impl Fn() -> D) {
    let x8 = f32s(&[2, 2, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]);
    let slices = "  input %0 \"x\": f32[2,2,2]\n  init %1 \"i\" = i64[2,1]{1, -2}\n  %2 \"y\": f32[2,2,2] = GatherND(%0, %1)\n  output %2";
    let y = run(b(), slices, vec![("x", x8.clone())]);
    assert_eq!(y[0].shape, vec![2, 2, 2]);
    assert_eq!(y[0].f64s(), vec![4., 5., 6., 7., 0., 1., 2., 3.]);
    let elements = "  input %0 \"x\": f32[2,2]\n  init %1 \"i\" = i64[2,2]{0, 0, 1, -1}\n  %2 \"y\": f32[2] = GatherND(%0, %1)\n  output %2";
    let y = run(b(), elements, vec![("x", f32s(&[2, 2], &[0., 1., 2., 3.]))]);
    assert_eq!(y[0].f64s(), vec![0., 3.]);
    let batched = "  input %0 \"x\": f32[2,2,2]\n  init %1 \"i\" = i64[2,1]{1, 0}\n  %2 \"y\": f32[2,2] = GatherND[batch_dims=1](%0, %1)\n  output %2";
    let y = run(b(), batched, vec![("x", x8)]);
    assert_eq!(y[0].shape, vec![2, 2]);
    assert_eq!(y[0].f64s(), vec![2., 3., 4., 5.]);
    let ints = "  input %0 \"x\": i64[2,2,2]\n  init %1 \"i\" = i64[2,1,2]{0, 1, 1, -2}\n  %2 \"y\": i64[2,1] = GatherND[batch_dims=1](%0, %1)\n  output %2";
    let y = run(b(), ints, vec![("x", HostTensor::from_i64(DType::I64, vec![2, 2, 2], (0..8).collect()))]);
    assert_eq!(y[0].dtype(), DType::I64);
    assert_eq!(y[0].i64s(), Some(vec![1, 6]));
}

/// ScatterND replacing elements and rows (a negative index among them), and adding, max-ing and
/// multiplying into duplicate indices.
pub fn scatter_nd_replaces_and_reduces<D: Device>(b: impl Fn() -> D) {
    let x = f32s(&[8], &[1., 2., 3., 4., 5., 6., 7., 8.]);
    let none = "  input %0 \"x\": f32[8]\n  init %1 \"i\" = i64[4,1]{4, 3, -7, 7}\n  init %2 \"u\" = f32[4]{9.0, 10.0, 11.0, 12.0}\n  %3 \"y\": f32[8] = ScatterND(%0, %1, %2)\n  output %3";
    assert_eq!(run(b(), none, vec![("x", x.clone())])[0].f64s(), vec![1., 11., 3., 10., 9., 6., 7., 12.]);
    let add = "  input %0 \"x\": f32[8]\n  init %1 \"i\" = i64[4,1]{0, 0, -1, 0}\n  init %2 \"u\" = f32[4]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[8] = ScatterND[reduction=\"add\"](%0, %1, %2)\n  output %3";
    assert_eq!(run(b(), add, vec![("x", x)])[0].f64s(), vec![71., 2., 3., 4., 5., 6., 7., 38.]);
    let x6 = f32s(&[3, 2], &[0., 1., 2., 3., 4., 5.]);
    let rows = |reduction: &str, i: &str, u: &str| {
        format!("  input %0 \"x\": f32[3,2]\n  init %1 \"i\" = i64[2,1]{{{i}}}\n  init %2 \"u\" = f32[2,2]{{{u}}}\n  %3 \"y\": f32[3,2] = ScatterND{reduction}(%0, %1, %2)\n  output %3")
    };
    let y = |body: String| run(b(), &body, vec![("x", x6.clone())])[0].f64s();
    assert_eq!(y(rows("", "2, 0", "10.0, 11.0, 12.0, 13.0")), vec![12., 13., 2., 3., 10., 11.]);
    assert_eq!(y(rows("[reduction=\"add\"]", "1, 1", "10.0, 11.0, 12.0, 13.0")), vec![0., 1., 24., 27., 4., 5.]);
    assert_eq!(y(rows("[reduction=\"max\"]", "1, 1", "10.0, -11.0, 12.0, 13.0")), vec![0., 1., 12., 13., 4., 5.]);
    assert_eq!(y(rows("[reduction=\"mul\"]", "1, 1", "10.0, -11.0, 2.0, 13.0")), vec![0., 1., 40., -429., 4., 5.]);
}

/// ScatterElements along axis 0 and 1 (a negative index among them), and adding into duplicate
/// indices, for float and integer data.
pub fn scatter_elements_on_each_axis_and_adds<D: Device>(b: impl Fn() -> D) {
    let axis0 = "  input %0 \"x\": f32[3,3]\n  init %1 \"i\" = i64[2,3]{1, 0, 2, 0, 2, 1}\n  init %2 \"u\" = f32[2,3]{1.0, 1.1, 1.2, 2.0, 2.1, 2.2}\n  %3 \"y\": f32[3,3] = ScatterElements(%0, %1, %2)\n  output %3";
    let y = run(b(), axis0, vec![("x", f32s(&[3, 3], &[0.; 9]))]);
    assert_eq!(y[0].f32s().unwrap(), vec![2.0, 1.1, 0.0, 1.0, 0.0, 2.2, 0.0, 2.1, 1.2]);
    let row = f32s(&[1, 5], &[1., 2., 3., 4., 5.]);
    let axis1 = "  input %0 \"x\": f32[1,5]\n  init %1 \"i\" = i64[1,2]{1, -2}\n  init %2 \"u\" = f32[1,2]{1.1, 2.1}\n  %3 \"y\": f32[1,5] = ScatterElements[axis=1](%0, %1, %2)\n  output %3";
    assert_eq!(run(b(), axis1, vec![("x", row.clone())])[0].f32s().unwrap(), vec![1.0, 1.1, 3.0, 2.1, 5.0]);
    let add = "  input %0 \"x\": f32[1,5]\n  init %1 \"i\" = i64[1,2]{1, 1}\n  init %2 \"u\" = f32[1,2]{1.1, 2.1}\n  %3 \"y\": f32[1,5] = ScatterElements[axis=1, reduction=\"add\"](%0, %1, %2)\n  output %3";
    assert_eq!(run(b(), add, vec![("x", row)])[0].f32s().unwrap(), vec![1.0, 5.2, 3.0, 4.0, 5.0]);
    let add2 = "  input %0 \"x\": f32[2,3]\n  init %1 \"i\" = i64[2,2]{2, 0, 2, -1}\n  init %2 \"u\" = f32[2,2]{10.0, 20.0, 30.0, 40.0}\n  %3 \"y\": f32[2,3] = ScatterElements[axis=1, reduction=\"add\"](%0, %1, %2)\n  output %3";
    let y = run(b(), add2, vec![("x", f32s(&[2, 3], &[0., 1., 2., 3., 4., 5.]))]);
    assert_eq!(y[0].f64s(), vec![20., 1., 12., 3., 4., 75.]);
    let ints = "  input %0 \"x\": i64[2,3]\n  init %1 \"i\" = i32[1,3]{1, 1, 0}\n  init %2 \"u\" = i64[1,3]{10, 20, 30}\n  %3 \"y\": i64[2,3] = ScatterElements[reduction=\"add\"](%0, %1, %2)\n  output %3";
    let y = run(b(), ints, vec![("x", HostTensor::from_i64(DType::I64, vec![2, 3], (0..6).collect()))]);
    assert_eq!(y[0].i64s(), Some(vec![0, 1, 32, 13, 24, 5]));
}

/// f16 scatter-adds accumulate in f32 and round once: 4096 ones added into one element give 4096,
/// where f16 accumulation would stall at 2048 (mpc's rule for every reduction; numpy's float16,
/// and so the ONNX reference, would give 2048).
pub fn f16_scatter_add_accumulates_in_f32<D: Device>(b: impl Fn() -> D) {
    let body = "  input %0 \"x\": f16[1]\n  input %1 \"i\": i64[4096,1]\n  input %2 \"u\": f16[4096]\n  %3 \"y\": f16[1] = ScatterND[reduction=\"add\"](%0, %1, %2)\n  output %3";
    let i = HostTensor::from_i64(DType::I64, vec![4096, 1], vec![0; 4096]);
    let x = HostTensor::from_f64(DType::F16, vec![1], vec![0.0]);
    let y = run(b(), body, vec![("x", x), ("i", i), ("u", ones(DType::F16, vec![4096]))]);
    assert_eq!(y[0].f64s(), vec![4096.0]);
}

/// An index out of range, read from run-time data, is an error naming the node, the index and
/// the axis: never a panic, never a read or write out of bounds.
pub fn index_out_of_range_is_an_error_naming_the_node<D: Device>(b: impl Fn() -> D) {
    let x = f32s(&[2, 2], &[0., 1., 2., 3.]);
    let i = |v: &[i64]| HostTensor::from_i64(DType::I64, vec![v.len(), 1], v.to_vec());
    let cases = [
        ("  input %0 \"x\": f32[2,2]\n  input %1 \"i\": i64[2,1]\n  %2 \"y\": f32[2,2] = GatherND(%0, %1) @\"gnd\"\n  output %2", "`gnd` (GatherND)", i(&[0, 2])),
        ("  input %0 \"x\": f32[2,2]\n  input %1 \"i\": i64[1,1]\n  init %2 \"u\" = f32[1,2]{5.0, 6.0}\n  %3 \"y\": f32[2,2] = ScatterND(%0, %1, %2) @\"snd\"\n  output %3", "`snd` (ScatterND)", i(&[-3])),
        ("  input %0 \"x\": f32[2,2]\n  input %1 \"i\": i64[1,2]\n  init %2 \"u\" = f32[1,2]{5.0, 6.0}\n  %3 \"y\": f32[2,2] = ScatterElements[axis=1](%0, %1, %2) @\"sel\"\n  output %3", "`sel` (ScatterElements)", HostTensor::from_i64(DType::I64, vec![1, 2], vec![0, 9])),
        ("  input %0 \"x\": f32[2,2]\n  input %1 \"i\": i64[2,1]\n  %2 \"y\": f32[2,1] = GatherElements(%0, %1) @\"gel\"\n  output %2", "`gel` (GatherElements)", i(&[1, -3])),
    ];
    for (body, node, idx) in cases {
        let e = run_err(b(), body, vec![("x", x.clone()), ("i", idx)]);
        assert!(e.contains(node) && e.contains("out of range"), "{e}");
        assert_eq!(e.lines().count(), 1, "{e}");
    }
}

/// Each op test on one device. `ready` says whether the device can be opened here (else every
/// test skips with one line).
macro_rules! device_tests {
    ($name:ident: $device:expr) => {
        device_tests!($name: $device, ready: Ok::<(), String>(()));
    };
    ($name:ident: $device:expr, ready: $ready:expr) => {
        mod $name {
            fn skip() -> bool {
                match $ready {
                    Ok(()) => false,
                    Err(e) => {
                        eprintln!("skipped on {}: {e}", stringify!($name));
                        true
                    }
                }
            }
            #[test]
            fn f16_reduction_accumulates_in_f32() {
                if skip() {
                    return;
                }
                super::f16_reduction_accumulates_in_f32(|| $device)
            }
            #[test]
            fn f16_matmul_accumulates_in_f32() {
                if skip() {
                    return;
                }
                super::f16_matmul_accumulates_in_f32(|| $device)
            }
            #[test]
            fn f16_rounds_on_store() {
                if skip() {
                    return;
                }
                super::f16_rounds_on_store(|| $device)
            }
            #[test]
            fn broadcasting_and_softmax() {
                if skip() {
                    return;
                }
                super::broadcasting_and_softmax(|| $device)
            }
            #[test]
            fn conv_with_padding_and_stride() {
                if skip() {
                    return;
                }
                super::conv_with_padding_and_stride(|| $device)
            }
            #[test]
            fn resize_linear_and_nearest() {
                if skip() {
                    return;
                }
                super::resize_linear_and_nearest(|| $device)
            }
            #[test]
            fn max_pool_ceil_mode() {
                if skip() {
                    return;
                }
                super::max_pool_ceil_mode(|| $device)
            }
            #[test]
            fn gather_nd_slices_elements_and_batch_dims() {
                if skip() {
                    return;
                }
                super::gather_nd_slices_elements_and_batch_dims(|| $device)
            }
            #[test]
            fn scatter_nd_replaces_and_reduces() {
                if skip() {
                    return;
                }
                super::scatter_nd_replaces_and_reduces(|| $device)
            }
            #[test]
            fn scatter_elements_on_each_axis_and_adds() {
                if skip() {
                    return;
                }
                super::scatter_elements_on_each_axis_and_adds(|| $device)
            }
            #[test]
            fn f16_scatter_add_accumulates_in_f32() {
                if skip() {
                    return;
                }
                super::f16_scatter_add_accumulates_in_f32(|| $device)
            }
            #[test]
            fn index_out_of_range_is_an_error_naming_the_node() {
                if skip() {
                    return;
                }
                super::index_out_of_range_is_an_error_naming_the_node(|| $device)
            }
            #[test]
            fn runs_are_deterministic() {
                if skip() {
                    return;
                }
                super::runs_are_deterministic(|| $device)
            }
        }
    };
}

device_tests!(cpu: mpc_runtime::device::CpuDevice::default());
#[cfg(feature = "cuda")]
device_tests!(
    cuda: mpc_runtime::cuda::device::CudaDevice::new(0).expect("the GPU opened a moment ago"),
    ready: mpc_runtime::cuda::device::CudaDevice::new(0).map(drop).map_err(|e| e.to_string())
);
