//! What fusion promises, on programs built by the runtime alone (text-IR graphs, typed and
//! lowered by `mpc_runtime::build`): element-wise runs and epilogues write what is read after
//! them and give the unfused program's bits. (Fusion over the compiled fixtures: the root crate's
//! tests/program.)

use std::collections::HashMap;

use mpc_ir::Graph;
use mpc_runtime::device::{CpuDevice, Device};
use mpc_runtime::program::{Operand, Program};
use mpc_runtime::session::Session;

/// The text-IR model `text`, lowered for the CPU with fusion and without.
fn fused_and_plain(text: &str) -> (Graph, Program, Program) {
    let g = mpc_ir::text::parse(text, None).unwrap();
    let caps = CpuDevice::default().caps();
    let lowered = |unfused| {
        let opts = mpc_runtime::program::LowerOptions { unfused, ..Default::default() };
        mpc_runtime::program::lower(&g, caps, opts).unwrap()
    };
    let (fused, plain) = (lowered(false), lowered(true));
    (g, fused, plain)
}

/// Runs both programs on the same random inputs: the same outputs, bit for bit.
fn same_outputs(g: &Graph, fused: Program, plain: Program) {
    let inputs = mpc_runtime::build::random_inputs(g, 3, &HashMap::new()).unwrap();
    let run = |p: Program| Session::new(CpuDevice::default(), p).unwrap().run(&inputs).unwrap();
    let (x, y) = (run(fused), run(plain));
    assert_eq!(x.len(), g.outputs().len());
    for ((n, a), (m, b)) in x.iter().zip(&y) {
        assert_eq!(n, m);
        if let Err(e) = mpc_runtime::Tolerance::EXACT.check(a, b) {
            panic!("{n}: {e}");
        }
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
    let (g, fused, plain) = fused_and_plain(text);
    assert_eq!((fused.launches.len(), plain.launches.len()), (2, 4));
    let chain = fused.launches[0].chain.as_ref().unwrap();
    assert_eq!(fused.launches[0].kind(), "Fused(Cast+Add+Tanh)");
    assert_eq!(chain.outputs, vec![1, 2], "the Add's and the Tanh's results are written");
    let written: Vec<&str> = fused.buffers.iter().flat_map(|b| b.values.iter().map(|v| v.1.as_str())).collect();
    assert!(!written.contains(&"c") && written.contains(&"a"), "{written:?}");
    same_outputs(&g, fused, plain);
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
    let (g, fused, plain) = fused_and_plain(text);
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
    let (g, fused, plain) = fused_and_plain(text);
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
    let (g, fused, plain) = fused_and_plain(text);
    let kinds: Vec<String> = fused.launches.iter().map(|l| l.kind()).collect();
    assert_eq!(kinds, ["MatMul", "MatMul", "Neg", "Add"], "{kinds:?}");
    assert!(matches!(fused.launches[0].epilogue, Some(mpc_ir::Op::Add)));
    assert!(matches!(&fused.launches[0].epilogue_operand, Some(Operand::Device(t)) if t.shape == [6]));
    assert!(fused.launches[1].epilogue.is_none(), "`c` is made after `u`");
    assert_eq!(plain.launches.len(), 5);
    same_outputs(&g, fused, plain);
}

/// Mish is one op of the chains (its functor `U_mish` in kernels/common.cuh): an Add, a Mish and
/// a Mul on f16 activations are one fused launch, with the unfused program's bits.
#[test]
fn mish_fuses_into_a_chain() {
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 18\ngraph \"g\"\n  input %0 \"x\": f16[4,8]\n  \
                input %1 \"b\": f16[8]\n  %2 \"a\": f16[4,8] = Add(%0, %1)\n  \
                %3 \"m\": f16[4,8] = Mish(%2)\n  %4 \"y\": f16[4,8] = Mul(%3, %0)\n  output %4\nend\n";
    let (g, fused, plain) = fused_and_plain(text);
    assert_eq!((fused.launches.len(), plain.launches.len()), (1, 3));
    assert_eq!(fused.launches[0].kind(), "Fused(Add+Mish+Mul)");
    same_outputs(&g, fused, plain);
}
