//! `mpc_runtime::build` on its own: a graph with symbolic dims lowered for the tensors fed to it
//! (a Reshape's shape read from a fed input becoming a constant), run, and the data that does not
//! fit named by input and axis.

use std::collections::HashMap;

use mpc_runtime::build::{self, BuildError};
use mpc_runtime::device::Device;
use mpc_runtime::HostTensor;

fn graph() -> mpc_ir::Graph {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"g\"\n  input %0 \"x\": f32[batch,seq]\n  \
                input %1 \"shape\": i64[2]\n  %2 \"y\": ? = Relu(%0)\n  %3 \"z\": ? = Reshape(%2, %1)\n  \
                output %3\nend\n";
    mpc_ir::text::parse(text, None).unwrap()
}

fn feeds(rows: usize, cols: usize, shape: [i64; 2]) -> HashMap<String, HostTensor> {
    let x: Vec<f32> = (0..rows * cols).map(|i| i as f32 - 5.0).collect();
    HashMap::from([
        ("x".to_string(), HostTensor::from_f32(mpc_ir::DType::F32, vec![rows, cols], x)),
        ("shape".to_string(), HostTensor::from_i64(mpc_ir::DType::I64, vec![2], shape.to_vec())),
    ])
}

#[test]
fn a_symbolic_graph_lowers_and_runs_for_what_is_fed() {
    let g = graph();
    let f = feeds(3, 4, [2, 6]);
    assert_eq!(build::input_dims(&g, &f).unwrap(), HashMap::from([("batch".into(), 3), ("seq".into(), 4)]));
    let out = build::run_once(&g, &f).unwrap();
    assert_eq!(out[0].1.shape, [2, 6]);
    assert_eq!(out[0].1.f64s()[..7], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
    let (bound, used) = build::bind_inputs(&g, &HashMap::from([("batch".into(), 8)])).unwrap();
    assert_eq!(used.get("seq"), Some(&1), "an unbound dim is 1");
    let unknown = mpc_ir::Shape(vec![mpc_ir::Dim::Unknown; 2]);
    assert_eq!(bound.ty(bound.outputs()[0]).shape, Some(unknown), "the Reshape's sizes wait for its shape");
}

#[test]
fn data_that_does_not_fit_is_one_line_naming_the_input_and_axis() {
    let g = graph();
    let mut f = feeds(3, 4, [2, 6]);
    f.insert("x".into(), HostTensor::from_f32(mpc_ir::DType::F32, vec![12], vec![0.0; 12]));
    match build::input_dims(&g, &f) {
        Err(BuildError::Data(m)) => assert!(m.contains("input `x` has 1 axes [12], the model declares 2"), "{m}"),
        other => panic!("{other:?}"),
    }
    f.remove("shape");
    assert!(matches!(build::lower_for_inputs(&g, &f, mpc_runtime::device::CpuDevice::default().caps()),
        Err(BuildError::Run(mpc_runtime::RuntimeError::MissingInput(n))) if n == "shape"));
}
