//! Every gradient rule against central finite differences, in f64.
//!
//! Each case builds a one-op (or few-op) graph whose float inputs are f64 parameters, reduces its
//! output to a scalar with a fixed random projection (`loss = Σ y ⊙ R`), generates the backward
//! graph with mpc's autodiff and runs it on the CPU device, and on the GPU too where one can be
//! opened. Each parameter element (up to 16 per parameter, spread over the tensor) is then nudged
//! by ±h and the loss re-run: the analytic gradient must match (L(p+h) − L(p−h)) / 2h.

use mpc_ir::attr::Attr;
use mpc_ir::{DType, Op, Tensor, ValueId};

mod attention;
mod harness;

use harness::*;

macro_rules! unary {
    ($($test:ident: $op:literal [$($k:literal = $v:expr),*] in $lo:literal..$hi:literal;)*) => {$(
        #[test]
        fn $test() {
            let mut c = Case::new(stringify!($test));
            let x = c.param_in("x", &[3, 5], $lo, $hi);
            let y = c.op1($op, &[$(($k, $v)),*], &[x]);
            c.check(y, TOL);
        }
    )*};
}

unary! {
    relu: "Relu" [] in -1.0..1.0;
    leaky_relu: "LeakyRelu" ["alpha" = Attr::Float(0.1)] in -1.0..1.0;
    sigmoid: "Sigmoid" [] in -3.0..3.0;
    tanh: "Tanh" [] in -2.0..2.0;
    erf: "Erf" [] in -2.0..2.0;
    gelu: "Gelu" [] in -3.0..3.0;
    gelu_tanh: "Gelu" ["approximate" = Attr::String("tanh".into())] in -3.0..3.0;
    sqrt: "Sqrt" [] in 0.5..2.0;
    exp: "Exp" [] in -1.0..1.0;
    log: "Log" [] in 0.5..2.0;
    neg: "Neg" [] in -1.0..1.0;
    abs: "Abs" [] in -1.0..1.0;
    reciprocal: "Reciprocal" [] in 0.5..2.0;
    identity: "Identity" [] in -1.0..1.0;
    dropout_inference: "Dropout" [] in -1.0..1.0;
    softmax: "Softmax" ["axis" = Attr::Int(-1)] in -2.0..2.0;
    softmax_axis0: "Softmax" ["axis" = Attr::Int(0)] in -2.0..2.0;
    log_softmax: "LogSoftmax" ["axis" = Attr::Int(1)] in -2.0..2.0;
    transpose: "Transpose" ["perm" = ints(&[1, 0])] in -1.0..1.0;
    flatten: "Flatten" ["axis" = Attr::Int(0)] in -1.0..1.0;
    // Every region: x < −3, the ramp, x > 3.
    hard_swish: "HardSwish" [] in -5.0..5.0;
    hard_sigmoid: "HardSigmoid" ["alpha" = Attr::Float(0.3), "beta" = Attr::Float(0.4)] in -4.0..4.0;
    softplus: "Softplus" [] in -3.0..3.0;
    mish: "Mish" [] in -3.0..3.0;
    softsign: "Softsign" [] in -3.0..3.0;
    sin: "Sin" [] in -3.0..3.0;
    cos: "Cos" [] in -3.0..3.0;
    elu: "Elu" ["alpha" = Attr::Float(0.7)] in -2.0..2.0;
    selu: "Selu" [] in -2.0..2.0;
    celu: "Celu" ["alpha" = Attr::Float(0.6)] in -2.0..2.0;
    tan: "Tan" [] in -1.2..1.2;
    sinh: "Sinh" [] in -2.0..2.0;
    cosh: "Cosh" [] in -2.0..2.0;
    asin: "Asin" [] in -0.9..0.9;
    acos: "Acos" [] in -0.9..0.9;
    atan: "Atan" [] in -3.0..3.0;
    asinh: "Asinh" [] in -3.0..3.0;
    acosh: "Acosh" [] in 1.2..3.0;
    atanh: "Atanh" [] in -0.9..0.9;
}

macro_rules! binary {
    ($($test:ident: $op:literal $a:expr, $b:expr, in $lo:literal..$hi:literal;)*) => {$(
        #[test]
        fn $test() {
            let mut c = Case::new(stringify!($test));
            let a = c.param_in("a", &$a, $lo, $hi);
            let b = c.param_in("b", &$b, $lo, $hi);
            let y = c.op1($op, &[], &[a, b]);
            c.check(y, TOL);
        }
    )*};
}

binary! {
    add_broadcast: "Add" [2, 3, 4], [3, 1], in -1.0..1.0;
    sub_broadcast: "Sub" [4], [2, 3, 4], in -1.0..1.0;
    mul_broadcast: "Mul" [2, 1, 4], [3, 1], in -1.0..1.0;
    div_broadcast: "Div" [2, 3], [3], in 0.5..2.0;
    pow: "Pow" [2, 3], [3], in 0.5..2.0;
    matmul_2d: "MatMul" [3, 4], [4, 5], in -1.0..1.0;
    matmul_batched: "MatMul" [2, 3, 4], [2, 4, 5], in -1.0..1.0;
    matmul_shared_weight: "MatMul" [2, 3, 4], [4, 5], in -1.0..1.0;
    matmul_broadcast_batch: "MatMul" [2, 1, 3, 4], [3, 4, 2], in -1.0..1.0;
    prelu_broadcast_slope: "PRelu" [2, 3, 4], [3, 1], in -1.0..1.0;
    max_broadcast: "Max" [3, 4], [4], in -1.0..1.0;
    min_broadcast: "Min" [3, 1], [3, 4], in -1.0..1.0;
}

#[test]
fn variadic_sum_mean_max_min() {
    for op in ["Sum", "Mean", "Max", "Min"] {
        let mut c = Case::new(op);
        let a = c.param("a", &[3, 4]);
        let b = c.param("b", &[4]);
        // Shifted, so that the broadcast input is the maximum (the minimum) somewhere.
        let d = if op == "Min" { c.param_in("d", &[3, 1], -3.0, 1.0) } else { c.param_in("d", &[3, 1], -1.0, 3.0) };
        let y = c.op1(op, &[], &[a, b, d]);
        c.check(y, TOL);
    }
}

#[test]
fn max_min_ties_split_the_gradient() {
    // At a tie the central difference is the mean of the one-sided slopes: each of the two equal
    // inputs gets half of dy, as torch.maximum gives it.
    for op in ["Max", "Min"] {
        let mut c = Case::new(&format!("{op}_ties"));
        let a = c.param("a", &[2, 3]);
        let values = c.g.constant(a).unwrap().clone();
        let b = c.g.add_initializer("b", values);
        c.params.push(b);
        let y = c.op1(op, &[], &[a, b]);
        c.check(y, TOL);
    }
}

#[test]
fn clip() {
    let mut c = Case::new("clip");
    let x = c.param_in("x", &[3, 5], -2.0, 2.0);
    let lo = c.tensor("lo", &[], -0.5, -0.5);
    let hi = c.tensor("hi", &[], 0.8, 0.8);
    let both = c.op1("Clip", &[], &[x, lo, hi]);
    let upper = c.op("Clip", &[], &[Some(x), None, Some(hi)], 1)[0];
    let y = c.op1("Add", &[], &[both, upper]);
    c.check(y, TOL);
}

#[test]
fn piecewise_constant_ops_pass_no_gradient() {
    // y = f(x)·x: only the second factor carries a gradient, d/dx = f(x) away from the jumps.
    for op in ["Floor", "Ceil", "Round", "Sign", "Hardmax"] {
        let mut c = Case::new(op);
        let x = c.param_in("x", &[3, 5], -2.0, 2.0);
        let f = if op == "Hardmax" { c.composite(op, &[], &[x]) } else { c.op1(op, &[], &[x]) };
        let y = c.op1("Mul", &[], &[f, x]);
        c.check(y, TOL);
    }
}

#[test]
fn composite_ops_differentiate_as_the_ops_they_are_made_of() {
    let f = Attr::Float;
    type Composite<'a> = (&'a str, Vec<(&'a str, Attr)>, Vec<u64>);
    let cases: Vec<Composite> = vec![
        ("ThresholdedRelu", vec![("alpha", f(0.2))], vec![3, 5]),
        ("Shrink", vec![("lambd", f(0.3)), ("bias", f(0.1))], vec![3, 5]),
        ("LpNormalization", vec![], vec![3, 5]),
        ("LpNormalization", vec![("axis", Attr::Int(0)), ("p", Attr::Int(1))], vec![3, 5]),
        ("MeanVarianceNormalization", vec![], vec![2, 3, 2, 2]),
        ("MeanVarianceNormalization", vec![("axes", ints(&[1]))], vec![2, 3, 4]),
        ("GlobalLpPool", vec![], vec![2, 2, 3, 3]),
        ("GlobalLpPool", vec![("p", Attr::Int(3))], vec![2, 2, 3]),
        ("LpPool", vec![("kernel_shape", ints(&[2, 2])), ("pads", ints(&[1, 0, 0, 1]))], vec![1, 2, 4, 5]),
        (
            "LpPool",
            vec![
                ("kernel_shape", ints(&[3])),
                ("strides", ints(&[2])),
                ("ceil_mode", Attr::Int(1)),
                ("p", Attr::Int(1)),
            ],
            vec![2, 2, 6],
        ),
        // Dilated ceil_mode windows needing an end pad of 2 past a kernel of 2: a Pad first.
        (
            "LpPool",
            vec![
                ("kernel_shape", ints(&[2, 2])),
                ("dilations", ints(&[2, 2])),
                ("strides", ints(&[3, 1])),
                ("ceil_mode", Attr::Int(1)),
            ],
            vec![1, 2, 4, 4],
        ),
    ];
    for (op, attrs, shape) in cases {
        let mut c = Case::new(&format!("{op}{attrs:?}"));
        let x = c.param("x", &shape);
        let y = c.composite(op, &attrs, &[x]);
        c.check(y, TOL);
    }
    // RMSNormalization over the last two axes, its scale trained too (stashed in f64: finite
    // differences need the precision).
    let mut c = Case::new("rms_normalization");
    let x = c.param("x", &[2, 3, 4]);
    let scale = c.param("scale", &[3, 4]);
    let attrs = [("axis", Attr::Int(1)), ("stash_type", Attr::Int(DType::F64.onnx_code() as i64))];
    let y = c.composite("RMSNormalization", &attrs, &[x, scale]);
    c.check(y, TOL);
    // ReverseSequence, batch-major, lengths from full to empty.
    let mut c = Case::new("reverse_sequence");
    let x = c.param("x", &[4, 3, 2]);
    let lens = c.ints("lens", &[4], &[3, 0, 1, 2]);
    let y = c.composite("ReverseSequence", &[("time_axis", Attr::Int(1)), ("batch_axis", Attr::Int(0))], &[x, lens]);
    c.check(y, TOL);
}

#[test]
fn grid_sample_differentiates_in_the_input_and_the_grid() {
    let text = |s: &str| Attr::String(s.into());
    for (mode, padding, align) in [
        ("bilinear", "zeros", 0),
        ("bilinear", "border", 1),
        ("bilinear", "reflection", 0),
        ("bicubic", "zeros", 0),
        ("bicubic", "reflection", 1),
        ("nearest", "zeros", 0),
    ] {
        let mut c = Case::new(&format!("grid_sample_{mode}_{padding}_{align}"));
        let x = c.param("x", &[2, 2, 3, 4]);
        // Nearest passes the grid no gradient (its taps are piecewise constant in it).
        let grid = match mode {
            "nearest" => c.tensor("grid", &[2, 2, 3, 2], -1.3, 1.3),
            _ => c.param_in("grid", &[2, 2, 3, 2], -1.3, 1.3),
        };
        let attrs = [("mode", text(mode)), ("padding_mode", text(padding)), ("align_corners", Attr::Int(align))];
        let y = c.composite("GridSample", &attrs, &[x, grid]);
        c.check(y, TOL);
    }
}

#[test]
fn a_parameter_read_only_through_floor_gets_no_gradient_and_no_error() {
    let mut c = Case::new("floor_only");
    let x = c.param("x", &[3, 4]);
    let f = c.op1("Floor", &[], &[x]);
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[f]);
    mpc_passes::infer_types(&mut c.g).unwrap();
    let seed = c.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
    let grads = mpc_passes::train::differentiate(&mut c.g, &[x], s, seed).unwrap();
    assert!(grads.is_empty(), "{grads:?}");
}

#[test]
fn gemm_all_transposes() {
    for (ta, tb) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
        let mut c = Case::new(&format!("gemm_{ta}{tb}"));
        let a = c.param(if ta == 1 { "at" } else { "a" }, if ta == 1 { &[4, 3] } else { &[3, 4] });
        let b = c.param(if tb == 1 { "bt" } else { "b" }, if tb == 1 { &[5, 4] } else { &[4, 5] });
        let bias = c.param("c", &[5]);
        let attrs = [
            ("transA", Attr::Int(ta)),
            ("transB", Attr::Int(tb)),
            ("alpha", Attr::Float(0.5)),
            ("beta", Attr::Float(2.0)),
        ];
        let y = c.op("Gemm", &attrs, &[Some(a), Some(b), Some(bias)], 1)[0];
        c.check(y, TOL);
    }
}

#[test]
fn conv_strided_padded_grouped() {
    let mut c = Case::new("conv");
    let x = c.param("x", &[2, 4, 5, 5]);
    let w = c.param("w", &[6, 2, 3, 3]);
    let b = c.param("b", &[6]);
    let attrs = [("pads", ints(&[1, 0, 1, 1])), ("strides", ints(&[2, 1])), ("group", Attr::Int(2))];
    let y = c.op("Conv", &attrs, &[Some(x), Some(w), Some(b)], 1)[0];
    c.check(y, TOL);
}

#[test]
fn conv_dilated() {
    let mut c = Case::new("conv_dilated");
    let x = c.param("x", &[1, 2, 6, 6]);
    let w = c.param("w", &[3, 2, 2, 2]);
    let y = c.op1("Conv", &[("dilations", ints(&[2, 2]))], &[x, w]);
    c.check(y, TOL);
}

#[test]
fn conv_transpose() {
    let grouped = vec![
        ("strides", ints(&[2, 2])),
        ("pads", ints(&[1, 0, 0, 1])),
        ("output_padding", ints(&[1, 0])),
        ("group", Attr::Int(2)),
    ];
    let same = vec![("strides", ints(&[2, 2])), ("auto_pad", Attr::String("SAME_UPPER".into()))];
    let dilated = vec![("dilations", ints(&[2, 1])), ("output_shape", ints(&[4, 4]))];
    // An output_padding of the stride or more (torch allows it below the dilation): output
    // positions no input reaches.
    let padded_past = vec![("dilations", ints(&[2, 3])), ("output_padding", ints(&[1, 2])), ("strides", ints(&[1, 2]))];
    // The bias has the output channels: w's second dim times the groups.
    for (name, attrs, w, bias) in [
        ("grouped", grouped, [4, 3, 3, 3], Some(6)),
        ("same_upper", same, [4, 2, 3, 3], None),
        ("dilated_output_shape", dilated, [4, 2, 2, 2], Some(2)),
        ("output_padding_past_the_stride", padded_past, [4, 2, 3, 2], Some(2)),
    ] {
        let mut c = Case::new(&format!("conv_transpose_{name}"));
        let x = c.param("x", &[2, 4, 3, 4]);
        let w = c.param("w", &w);
        let b = bias.map(|n| c.param("b", &[n]));
        let y = c.op("ConvTranspose", &attrs, &[Some(x), Some(w), b], 1)[0];
        c.check(y, TOL);
    }
}

/// An output_shape past the full output: positions no input reaches (it was refused as "not the
/// adjoint of a Conv").
#[test]
fn conv_transpose_past_the_full_output() {
    let mut c = Case::new("conv_transpose_past_the_full_output");
    let x = c.param("x", &[1, 2, 3]);
    let w = c.param("w", &[2, 1, 2]);
    let y = c.op1("ConvTranspose", &[("output_shape", ints(&[6]))], &[x, w]);
    c.check(y, TOL);
}

#[test]
fn batch_norm_training() {
    let mut c = Case::new("batch_norm");
    let x = c.param("x", &[3, 2, 2, 2]);
    let s = c.param("scale", &[2]);
    let b = c.param("bias", &[2]);
    let m = c.tensor("mean", &[2], 0.0, 0.1);
    let v = c.tensor("var", &[2], 1.0, 1.1);
    let attrs = [("training_mode", Attr::Int(1)), ("epsilon", Attr::Float(1e-3))];
    let y = c.op("BatchNormalization", &attrs, &[Some(x), Some(s), Some(b), Some(m), Some(v)], 3)[0];
    c.check(y, TOL);
}

#[test]
fn layer_norm() {
    let mut c = Case::new("layer_norm");
    let x = c.param("x", &[2, 3, 4]);
    let s = c.param("scale", &[4]);
    let b = c.param("bias", &[4]);
    let y = c.op("LayerNormalization", &[("epsilon", Attr::Float(1e-3))], &[Some(x), Some(s), Some(b)], 1)[0];
    c.check(y, TOL);
}

#[test]
fn layer_norm_two_axes() {
    let mut c = Case::new("layer_norm_two_axes");
    let x = c.param("x", &[2, 3, 4]);
    let s = c.param("scale", &[3, 4]);
    let y = c.op("LayerNormalization", &[("axis", Attr::Int(1))], &[Some(x), Some(s)], 1)[0];
    c.check(y, TOL);
}

#[test]
fn instance_norm() {
    let mut c = Case::new("instance_norm");
    let x = c.param("x", &[2, 3, 2, 3]);
    let s = c.param("scale", &[3]);
    let b = c.param("bias", &[3]);
    let y = c.op1("InstanceNormalization", &[("epsilon", Attr::Float(1e-3))], &[x, s, b]);
    c.check(y, TOL);
}

#[test]
fn group_norm() {
    for shape in [&[2, 4, 2, 3][..], &[3, 6]] {
        let mut c = Case::new(&format!("group_norm{shape:?}"));
        let x = c.param("x", shape);
        let s = c.param("scale", &shape[1..2]);
        let b = c.param("bias", &shape[1..2]);
        let attrs = [("num_groups", Attr::Int(2)), ("epsilon", Attr::Float(1e-3))];
        let y = c.op1("GroupNormalization", &attrs, &[x, s, b]);
        c.check(y, TOL);
    }
}

#[test]
fn group_norm_as_torch_exports_it() {
    // Reshape to [N, G, -1], InstanceNormalization with unit scale, reshape back, then the affine.
    let mut c = Case::new("group_norm_exported");
    let x = c.param("x", &[2, 4, 3, 2]);
    let groups = c.ints("groups", &[3], &[0, 2, -1]);
    let xr = c.op1("Reshape", &[], &[x, groups]);
    let ones = c.tensor("ones", &[2], 1.0, 1.0);
    let zeros = c.tensor("zeros", &[2], 0.0, 0.0);
    let n = c.op1("InstanceNormalization", &[], &[xr, ones, zeros]);
    let back = c.ints("back", &[4], &[2, 4, 3, 2]);
    let n = c.op1("Reshape", &[], &[n, back]);
    let s = c.param("scale", &[4, 1, 1]);
    let b = c.param("bias", &[4, 1, 1]);
    let t = c.op1("Mul", &[], &[n, s]);
    let y = c.op1("Add", &[], &[t, b]);
    c.check(y, TOL);
}

#[test]
fn shape_ops() {
    let mut c = Case::new("shape_ops");
    let x = c.param("x", &[2, 3, 4]);
    let s = c.ints("shape", &[2], &[6, 4]);
    let r = c.op1("Reshape", &[], &[x, s]);
    let ax = c.ints("axes", &[1], &[0]);
    let u = c.op1("Unsqueeze", &[], &[r, ax]);
    let q = c.op1("Squeeze", &[], &[u, ax]);
    let e = c.ints("expand", &[3], &[2, 6, 4]);
    let y = c.op1("Expand", &[], &[q, e]);
    c.check(y, TOL);
}

#[test]
fn concat_split_slice() {
    let mut c = Case::new("concat_split_slice");
    let a = c.param("a", &[2, 3]);
    let b = c.param("b", &[2, 2]);
    let cat = c.op1("Concat", &[("axis", Attr::Int(1))], &[a, b]);
    let sizes = c.ints("sizes", &[2], &[1, 4]);
    let parts = c.op("Split", &[("axis", Attr::Int(1))], &[Some(cat), Some(sizes)], 2);
    // Only the second part is read: the first gets a zero gradient.
    let (st, en, ax) = (c.ints("starts", &[1], &[1]), c.ints("ends", &[1], &[-1]), c.ints("sl_axes", &[1], &[1]));
    let y = c.op("Slice", &[], &[Some(parts[1]), Some(st), Some(en), Some(ax)], 1)[0];
    c.check(y, TOL);
}

#[test]
fn slice_with_bounds_computed_from_the_shape() {
    // Llama's rotate_half: x[..., half:] and x[..., :half] with half = shape[-1] / 2, and a
    // negative start computed the same way.
    let mut c = Case::new("slice_computed");
    let x = c.param("x", &[2, 6]);
    let shape = c.op1("Shape", &[], &[x]);
    let (one, two, zero_ax) = (c.ints("one", &[1], &[1]), c.ints("two", &[1], &[2]), c.ints("axis0", &[1], &[0]));
    let last = c.op1("Gather", &[("axis", Attr::Int(0))], &[shape, one]);
    let half = c.op1("Div", &[], &[last, two]);
    let neg = c.op1("Neg", &[], &[half]);
    // The axes as the legacy exporter writes them for `weight[:n]`: Unsqueeze of a scalar.
    let big = c.ints("big", &[1], &[i64::MAX]);
    let ax_scalar = c.ints("ax_scalar", &[], &[1]);
    let ax = c.op1("Unsqueeze", &[], &[ax_scalar, zero_ax]);
    let hi = c.op("Slice", &[], &[Some(x), Some(half), Some(big), Some(ax)], 1)[0];
    let lo = c.op("Slice", &[], &[Some(x), Some(zero_ax), Some(neg), Some(ax)], 1)[0];
    let y = c.op1("Concat", &[("axis", Attr::Int(1))], &[hi, lo]);
    c.check(y, TOL);
}

#[test]
fn gather_embedding_with_repeats() {
    let mut c = Case::new("gather");
    let table = c.param("table", &[5, 3]);
    let idx = c.ints("idx", &[2, 3], &[0, 4, 4, 1, 0, 4]);
    let y = c.op1("Gather", &[], &[table, idx]);
    c.check(y, TOL);
}

#[test]
fn where_select() {
    let mut c = Case::new("where");
    let a = c.param("a", &[2, 3]);
    let b = c.param("b", &[3]);
    let zero = c.tensor("zero", &[], 0.0, 0.0);
    let cond = c.op1("Greater", &[], &[a, zero]);
    let y = c.op1("Where", &[], &[cond, a, b]);
    c.check(y, TOL);
}

#[test]
fn pooling() {
    for (op, attrs) in [
        ("MaxPool", vec![("kernel_shape", ints(&[2, 2])), ("strides", ints(&[2, 2]))]),
        ("MaxPool", vec![("kernel_shape", ints(&[3, 3])), ("pads", ints(&[1, 1, 1, 1]))]),
        (
            "AveragePool",
            vec![("kernel_shape", ints(&[3, 3])), ("strides", ints(&[2, 2])), ("pads", ints(&[1, 1, 1, 1]))],
        ),
        (
            "AveragePool",
            vec![("kernel_shape", ints(&[2, 2])), ("pads", ints(&[1, 1, 0, 0])), ("count_include_pad", Attr::Int(1))],
        ),
    ] {
        let mut c = Case::new(&format!("{op}{attrs:?}"));
        let x = c.param("x", &[2, 2, 5, 5]);
        let y = c.op1(op, &attrs, &[x]);
        c.check(y, TOL);
    }
}

#[test]
fn global_max_pool() {
    let mut c = Case::new("global_max_pool");
    let x = c.param("x", &[2, 3, 3, 4]);
    let y = c.op1("GlobalMaxPool", &[], &[x]);
    c.check(y, TOL);
}

#[test]
fn trilu() {
    for (upper, k) in [(1, Some(1)), (0, Some(-1)), (0, None)] {
        let mut c = Case::new(&format!("trilu_{upper}_{k:?}"));
        let x = c.param("x", &[2, 3, 4]);
        let k = k.map(|k| c.ints("k", &[], &[k]));
        let y = c.op("Trilu", &[("upper", Attr::Int(upper))], &[Some(x), k], 1)[0];
        c.check(y, TOL);
    }
}

#[test]
fn einsum() {
    // Batched matmul, attention scores, a label summed over one operand alone, an outer product, a
    // one-operand transpose with a summed label, an implicit scalar output.
    for (eq, shapes) in [
        ("bij,bjk->bik", &[&[2, 3, 4][..], &[2, 4, 5]][..]),
        ("bhqd,bhkd->bhqk", &[&[2, 2, 3, 4], &[2, 2, 5, 4]]),
        ("ij,jk->k", &[&[3, 4], &[4, 5]]),
        ("i,j->ij", &[&[3], &[4]]),
        ("ijk->kj", &[&[2, 3, 4]]),
        ("ij,ij", &[&[3, 4], &[3, 4]]),
    ] {
        let mut c = Case::new(&format!("einsum_{eq}"));
        let xs: Vec<ValueId> = shapes.iter().enumerate().map(|(i, s)| c.param(&format!("x{i}"), s)).collect();
        let y = c.op1("Einsum", &[("equation", Attr::String(eq.into()))], &xs);
        c.check(y, TOL);
    }
}

#[test]
fn einsum_with_a_diagonal_is_refused() {
    let mut c = Case::new("einsum_diagonal");
    let x = c.param("x", &[3, 3]);
    let y = c.op1("Einsum", &[("equation", Attr::String("ii->i".into()))], &[x]);
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[y]);
    mpc_passes::infer_types(&mut c.g).unwrap();
    let seed = c.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
    let err = mpc_passes::train::differentiate(&mut c.g, &[x], s, seed).unwrap_err().to_string();
    assert!(err.contains("Einsum `ii->i`") && err.contains("repeated"), "{err}");
}

#[test]
fn resize() {
    let text = |s: &str| Attr::String(s.into());
    let modes = |coords: &str, nearest: &str| {
        vec![("coordinate_transformation_mode", text(coords)), ("nearest_mode", text(nearest))]
    };
    let linear = |coords: &str| vec![("mode", text("linear")), ("coordinate_transformation_mode", text(coords))];
    // Nearest whole-block copies (summed back): torch's nearest (asymmetric, floor) by scales,
    // nearest-exact (half_pixel, rounding) by sizes, half_pixel_symmetric rounding up, scales on
    // named axes. Then copies that are not blocks, and linear, through the taps' matrices:
    // half_pixel with floor, a downscale, blocks along one axis but not the other, linear upscales
    // and a linear downscale.
    type Resize<'a> = (&'a str, Vec<(&'a str, Attr)>, &'a [f32], &'a [i64]);
    let cubic = |extra: &[(&'static str, Attr)]| [vec![("mode", text("cubic"))], extra.to_vec()].concat();
    let cases: [Resize; 16] = [
        ("asymmetric_floor", modes("asymmetric", "floor"), &[1.0, 1.0, 2.0, 3.0], &[]),
        ("half_pixel_sizes", vec![], &[], &[2, 2, 6, 6]),
        ("half_pixel_symmetric_ceil", modes("half_pixel_symmetric", "round_prefer_ceil"), &[1.0, 1.0, 3.0, 4.0], &[]),
        ("axes", vec![("axes", ints(&[-2, -1]))], &[3.0, 2.0], &[]),
        ("half_pixel_floor", modes("half_pixel", "floor"), &[1.0, 1.0, 2.0, 3.0], &[]),
        ("nearest_downscale", vec![], &[], &[2, 2, 1, 2]),
        ("nearest_block_and_not", vec![], &[1.0, 1.0, 2.0, 1.5], &[]),
        ("linear_half_pixel", linear("half_pixel"), &[1.0, 1.0, 2.0, 2.0], &[]),
        ("linear_pytorch_half_pixel_channels", linear("pytorch_half_pixel"), &[1.0, 2.0, 1.5, 1.0], &[]),
        ("linear_align_corners", linear("align_corners"), &[], &[2, 2, 3, 5]),
        ("linear_downscale", linear("asymmetric"), &[1.0, 1.0, 0.5, 0.7], &[]),
        // Cubic (four taps, edge inputs repeated or excluded), antialiased downscales (wider
        // filters) and an aspect-ratio policy: all through the taps' matrices too.
        ("cubic_half_pixel", cubic(&[]), &[1.0, 1.0, 2.0, 1.5], &[]),
        (
            "cubic_exclude_outside",
            cubic(&[("exclude_outside", Attr::Int(1)), ("cubic_coeff_a", Attr::Float(-0.5))]),
            &[1.0, 1.0, 1.5, 2.0],
            &[],
        ),
        (
            "linear_antialias",
            [linear("half_pixel"), vec![("antialias", Attr::Int(1))]].concat(),
            &[1.0, 1.0, 0.5, 0.7],
            &[],
        ),
        ("cubic_antialias", cubic(&[("antialias", Attr::Int(1))]), &[1.0, 1.0, 1.0, 0.4], &[]),
        (
            "keep_aspect_not_larger",
            [linear("half_pixel"), vec![("keep_aspect_ratio_policy", text("not_larger")), ("axes", ints(&[2, 3]))]]
                .concat(),
            &[],
            &[4, 4],
        ),
    ];
    for (name, attrs, scales, sizes) in cases {
        let mut c = Case::new(&format!("resize_{name}"));
        let x = c.param("x", &[2, 2, 2, 3]);
        let scales = (!scales.is_empty())
            .then(|| c.g.add_initializer("scales", Tensor::from_f32(vec![scales.len() as u64], scales)));
        let sizes = (!sizes.is_empty()).then(|| c.ints("sizes", &[sizes.len() as u64], sizes));
        let y = c.op("Resize", &attrs, &[Some(x), None, scales, sizes], 1)[0];
        c.check(y, TOL);
    }
    // tf_crop_and_resize: a region of interest reaching past the input on the last axis (those
    // outputs are the extrapolation value, no gradient), linear and cubic.
    for mode in ["linear", "cubic"] {
        let mut c = Case::new(&format!("resize_tf_crop_and_resize_{mode}"));
        let x = c.param("x", &[1, 2, 3, 4]);
        let attrs = [
            ("mode", text(mode)),
            ("coordinate_transformation_mode", text("tf_crop_and_resize")),
            ("extrapolation_value", Attr::Float(-2.0)),
        ];
        let roi = [0.0f32, 0.0, 0.1, -0.4, 1.0, 1.0, 0.8, 1.3];
        let roi = c.g.add_initializer("roi", Tensor::from_f32(vec![8], &roi));
        let scales = c.g.add_initializer("scales", Tensor::from_f32(vec![4], &[1.0, 1.0, 2.0, 1.5]));
        let y = c.op("Resize", &attrs, &[Some(x), Some(roi), Some(scales)], 1)[0];
        c.check(y, TOL);
    }
}

#[test]
fn global_average_pool_and_reductions() {
    let mut c = Case::new("reductions");
    let x = c.param("x", &[2, 3, 2, 2]);
    let gap = c.op1("GlobalAveragePool", &[], &[x]);
    let ax = c.ints("axes", &[1], &[1]);
    let m = c.op1("ReduceMean", &[("keepdims", Attr::Int(0))], &[gap, ax]);
    let ax2 = c.ints("axes2", &[1], &[-1]);
    let s = c.op1("ReduceSum", &[], &[x, ax2]);
    let t = c.op1("ReduceMean", &[], &[s]);
    let y = c.op1("Add", &[], &[m, t]);
    c.check(y, TOL);
}

#[test]
fn other_reductions() {
    // Over one axis without keeping it, and over all axes keeping them.
    for op in ["ReduceMax", "ReduceMin", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceProd"] {
        let mut c = Case::new(op);
        let x = c.param_in("x", &[2, 3, 4], -1.5, 1.5);
        let ax = c.ints("axes", &[1], &[1]);
        let one = c.op1(op, &[("keepdims", Attr::Int(0))], &[x, ax]);
        let all = c.op1(op, &[], &[x]);
        let y = c.op1("Add", &[], &[one, all]);
        c.check(y, TOL);
    }
}

#[test]
fn reductions_over_no_axes_with_noop_with_empty_axes() {
    // Nothing reduced, the element-wise part still applied: 2x, sign(x), x/|x| (and dy itself for
    // the identities). Away from 0, where |x| has no derivative.
    let values = [0.5, -0.25, 0.75, -1.5, 1.25, 0.3, -0.6, 2.0, -1.1, 0.4, 0.9, -0.8];
    for op in ["ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceMax", "ReduceSum"] {
        let mut c = Case::new(&format!("{op}_noop"));
        let x = c.g.add_initializer("x", Tensor::from_f64_as(DType::F64, vec![3, 4], &values));
        c.params.push(x);
        let y = c.op1(op, &[("noop_with_empty_axes", Attr::Int(1))], &[x]);
        c.check(y, TOL);
    }
}

#[test]
fn reduce_log_sum() {
    // Over one axis, over all axes, and over none with noop_with_empty_axes (log x); on positive
    // values, where the log of the sum is defined.
    let mut c = Case::new("ReduceLogSum");
    let x = c.param_in("x", &[2, 3, 4], 0.25, 2.0);
    let ax = c.ints("axes", &[1], &[1]);
    let one = c.op1("ReduceLogSum", &[("keepdims", Attr::Int(0))], &[x, ax]);
    let all = c.op1("ReduceLogSum", &[], &[x]);
    let none = c.op1("ReduceLogSum", &[("noop_with_empty_axes", Attr::Int(1))], &[x]);
    let y = c.op1("Add", &[], &[one, all]);
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[none, ax]);
    let y = c.op1("Add", &[], &[y, s]);
    c.check(y, TOL);
}

#[test]
fn reductions_at_ties_and_zeros() {
    // Ties split dy (the central difference is the mean of the one-sided slopes); a product with
    // one zero in its row gets the product of the rest there, with two zeros nothing.
    let values = [0.5, -0.25, 0.75, 0.75, 0.0, 0.5, 2.0, -1.5, 0.0, 0.5, 0.0, 1.5];
    for op in ["ReduceMax", "ReduceMin", "ReduceProd"] {
        let mut c = Case::new(&format!("{op}_ties"));
        let v = if op == "ReduceMin" { values.map(|v: f64| -v) } else { values };
        let x = c.g.add_initializer("x", Tensor::from_f64_as(DType::F64, vec![3, 4], &v));
        c.params.push(x);
        let ax = c.ints("axes", &[1], &[1]);
        let y = c.op1(op, &[], &[x, ax]);
        c.check(y, TOL);
    }
}

#[test]
fn cumsum() {
    for (exclusive, reverse) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let mut c = Case::new(&format!("cumsum_{exclusive}{reverse}"));
        let x = c.param("x", &[3, 4]);
        let ax = c.ints("axis", &[], &[1]);
        let y = c.op1("CumSum", &[("exclusive", Attr::Int(exclusive)), ("reverse", Attr::Int(reverse))], &[x, ax]);
        c.check(y, TOL);
    }
}

/// CumProd, also where x holds zeros (one, two in a line, one first or last): a rule that divides
/// the later products by x_j is NaN or wrong there.
#[test]
fn cumprod() {
    #[rustfmt::skip]
    let x = [
        0.9, -0.7, 0.5, 1.2, -0.4,
        0.8, 0.0, -1.1, 0.6, 0.7,
        0.0, 0.5, 0.0, -0.9, 1.3,
        -0.6, 1.1, 0.4, 0.9, 0.0,
    ];
    for (exclusive, reverse) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let mut c = Case::new(&format!("cumprod_{exclusive}{reverse}"));
        let x = c.param_of("x", &[4, 5], &x);
        let ax = c.ints("axis", &[], &[1]);
        let y = c.op1("CumProd", &[("exclusive", Attr::Int(exclusive)), ("reverse", Attr::Int(reverse))], &[x, ax]);
        c.check(y, TOL);
    }
    // Along the first axis of three (a line of the middle one).
    let mut c = Case::new("cumprod_axis0");
    let x = c.param("x", &[3, 2, 2]);
    let ax = c.ints("axis", &[], &[0]);
    let y = c.op1("CumProd", &[], &[x, ax]);
    c.check(y, TOL);
}

/// RoiAlign's dX: averaged bins (adaptive and fixed sampling, rois past the edges and smaller
/// than a pixel) and max bins; the rois are positions, not trained.
#[test]
fn roi_align() {
    #[rustfmt::skip]
    let rois = [
        0.0, 0.0, 5.0, 4.0,
        1.5, 0.5, 4.2, 3.9,
        -2.0, 3.0, 7.5, 6.5,
        2.3, 2.2, 2.4, 2.3,
    ];
    for (mode, ratio) in [("avg", 0), ("avg", 2), ("max", 2)] {
        let mut c = Case::new(&format!("roi_align_{mode}_{ratio}"));
        let x = c.param("x", &[2, 2, 5, 6]);
        let r = c.g.add_initializer("rois", Tensor::from_f64_as(DType::F64, vec![4, 4], &rois));
        let b = c.ints("batch", &[4], &[0, 1, 1, 0]);
        let attrs = [
            ("mode", Attr::String(mode.into())),
            ("sampling_ratio", Attr::Int(ratio)),
            ("output_height", Attr::Int(3)),
            ("output_width", Attr::Int(2)),
        ];
        let y = c.op1("RoiAlign", &attrs, &[x, r, b]);
        c.check(y, TOL);
    }
}

#[test]
fn tile() {
    let mut c = Case::new("tile");
    let x = c.param("x", &[2, 3, 2]);
    let reps = c.ints("repeats", &[3], &[2, 1, 3]);
    let y = c.op1("Tile", &[], &[x, reps]);
    c.check(y, TOL);
}

#[test]
fn pad_and_crop() {
    // Padded at both ends of one axis and cropped at the start of another, then on named axes.
    let mut c = Case::new("pad");
    let x = c.param("x", &[2, 3, 4]);
    let pads = c.ints("pads", &[6], &[0, 1, -1, 0, 2, 0]);
    let value = c.tensor("value", &[], 0.5, 0.5);
    let p = c.op("Pad", &[], &[Some(x), Some(pads), Some(value)], 1)[0];
    let (two, axes) = (c.ints("two", &[4], &[1, -2, 2, 1]), c.ints("axes", &[2], &[0, 2]));
    let y = c.op("Pad", &[], &[Some(p), Some(two), None, Some(axes)], 1)[0];
    c.check(y, TOL);
}

#[test]
fn pad_reflect_edge_and_wrap() {
    // Each mode past the axis once (reflect twice round on the short axis), a crop at one end,
    // and on named axes: every output element adds its gradient back to the one it copies.
    for mode in ["reflect", "edge", "wrap"] {
        let mut c = Case::new(&format!("pad_{mode}"));
        let x = c.param("x", &[2, 3, 4]);
        let pads = c.ints("pads", &[6], &[0, 5, 2, 1, 2, -1]);
        let p = c.op("Pad", &[("mode", Attr::String(mode.into()))], &[Some(x), Some(pads)], 1)[0];
        let (two, axes) = (c.ints("two", &[4], &[1, 3, 0, 2]), c.ints("axes", &[2], &[0, -1]));
        let y = c.op("Pad", &[("mode", Attr::String(mode.into()))], &[Some(p), Some(two), None, Some(axes)], 1)[0];
        c.check(y, TOL);
    }
}

#[test]
fn slice_with_steps() {
    // x[::2, ::-1] and x[3:0:-2] on the last axis: strided and reversed slices (torch.flip).
    let mut c = Case::new("slice_steps");
    let x = c.param("x", &[5, 3, 4]);
    let (st, en) = (c.ints("starts", &[2], &[0, -1]), c.ints("ends", &[2], &[i64::MAX, i64::MIN]));
    let (ax, steps) = (c.ints("axes", &[2], &[0, 1]), c.ints("steps", &[2], &[2, -1]));
    let a = c.op("Slice", &[], &[Some(x), Some(st), Some(en), Some(ax), Some(steps)], 1)[0];
    let (st2, en2) = (c.ints("starts2", &[1], &[3]), c.ints("ends2", &[1], &[0]));
    let (ax2, steps2) = (c.ints("axes2", &[1], &[-1]), c.ints("steps2", &[1], &[-2]));
    let b = c.op("Slice", &[], &[Some(x), Some(st2), Some(en2), Some(ax2), Some(steps2)], 1)[0];
    let sa = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[a]);
    let sb = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[b]);
    let y = c.op1("Mul", &[], &[sa, sb]);
    c.check(y, TOL);
}

#[test]
fn modulo() {
    for fmod in [0, 1] {
        let mut c = Case::new(&format!("mod_{fmod}"));
        let a = c.param_in("a", &[3, 4], -3.0, 3.0);
        let b = c.param_in("b", &[4], 0.7, 1.3);
        let y = c.op1("Mod", &[("fmod", Attr::Int(fmod))], &[a, b]);
        c.check(y, TOL);
    }
}

#[test]
fn top_k() {
    // The largest 2 of 4 along the middle axis, and the smallest 3 along the last: the gradient
    // reaches the picked elements only (random values: no ties, so finite differences keep the pick).
    for (axis, k, largest) in [(1, 2, 1), (-1, 3, 0)] {
        let mut c = Case::new(&format!("top_k_{k}"));
        let x = c.param("x", &[2, 4, 5]);
        let kv = c.ints("k", &[1], &[k]);
        let y = c.op("TopK", &[("axis", Attr::Int(axis)), ("largest", Attr::Int(largest))], &[Some(x), Some(kv)], 2)[0];
        c.check(y, TOL);
    }
}

#[test]
fn gather_elements() {
    // Repeated and negative indices along the middle axis; fewer rows than the data.
    let mut c = Case::new("gather_elements");
    let x = c.param("x", &[2, 3, 2]);
    let idx = c.ints("idx", &[1, 4, 2], &[0, 2, -1, 1, 2, 2, 0, -3]);
    let y = c.op1("GatherElements", &[("axis", Attr::Int(1))], &[x, idx]);
    c.check(y, TOL);
}

#[test]
fn gather_nd() {
    // Slices and single elements, a repeated and a negative index.
    let mut c = Case::new("gather_nd");
    let x = c.param("x", &[3, 4, 2]);
    let rows = c.ints("rows", &[3, 1], &[2, 0, 2]);
    let y = c.op1("GatherND", &[], &[x, rows]);
    c.check(y, TOL);
    let mut c = Case::new("gather_nd_elements");
    let x = c.param("x", &[3, 4]);
    let at = c.ints("at", &[2, 2, 2], &[0, 1, -1, 3, 2, 2, 0, 1]);
    let y = c.op1("GatherND", &[], &[x, at]);
    c.check(y, TOL);
}

#[test]
fn scatter_nd_and_scatter_elements() {
    for reduction in ["none", "add"] {
        let attrs = [("reduction", Attr::String(reduction.into()))];
        let mut c = Case::new(&format!("scatter_nd_{reduction}"));
        let data = c.param("data", &[4, 3]);
        let updates = c.param("updates", &[2, 3]);
        let idx = c.ints("idx", &[2, 1], &[3, 1]);
        let y = c.op("ScatterND", &attrs, &[Some(data), Some(idx), Some(updates)], 1)[0];
        c.check(y, TOL);
        let mut c = Case::new(&format!("scatter_elements_{reduction}"));
        let data = c.param("data", &[3, 4]);
        let updates = c.param("updates", &[2, 4]);
        let idx = c.ints("idx", &[2, 4], &[0, 2, 1, -1, 1, 0, 2, 0]);
        let mut attrs = attrs.to_vec();
        attrs.push(("axis", Attr::Int(0)));
        let y = c.op("ScatterElements", &attrs, &[Some(data), Some(idx), Some(updates)], 1)[0];
        c.check(y, TOL);
    }
}

#[test]
fn lrn() {
    for size in [1, 3, 4] {
        let mut c = Case::new(&format!("lrn_{size}"));
        let x = c.param("x", &[2, 5, 2, 2]);
        let attrs = [("size", Attr::Int(size)), ("alpha", Attr::Float(0.5)), ("beta", Attr::Float(0.75))];
        let y = c.op1("LRN", &attrs, &[x]);
        c.check(y, TOL);
    }
}

#[test]
fn cast_round_trip() {
    // Through f32: a large step (exact for this quadratic) keeps f32 rounding out of the
    // differences; the tolerance is f32's.
    let mut c = Case::new("cast");
    c.h = 1e-2;
    let x = c.param("x", &[3, 4]);
    let down = c.op1("Cast", &[("to", Attr::Int(DType::F32.onnx_code() as i64))], &[x]);
    let sq = c.op1("Mul", &[], &[down, down]);
    let y = c.op1("Cast", &[("to", Attr::Int(DType::F64.onnx_code() as i64))], &[sq]);
    c.check(y, 2e-3);
}

#[test]
fn softmax_cross_entropy_loss() {
    for reduction in ["mean", "sum"] {
        let mut c = Case::new(&format!("sce_{reduction}"));
        let x = c.param("scores", &[4, 5]);
        let labels = c.ints("labels", &[4], &[0, 3, 4, 3]);
        let attrs = [("reduction", Attr::String(reduction.into()))];
        let y = c.op1("SoftmaxCrossEntropyLoss", &attrs, &[x, labels]);
        c.check(y, TOL);
    }
}

#[test]
fn softmax_cross_entropy_loss_spatial_ignore_index() {
    let mut c = Case::new("sce_spatial");
    let x = c.param("scores", &[2, 3, 4]);
    let labels = c.ints("labels", &[2, 4], &[0, 1, 2, -1, 2, 2, -1, 0]);
    let attrs = [("ignore_index", Attr::Int(-1))];
    let y = c.op1("SoftmaxCrossEntropyLoss", &attrs, &[x, labels]);
    c.check(y, TOL);
}

#[test]
fn negative_log_likelihood_loss() {
    let mut c = Case::new("nll");
    let x = c.param("scores", &[4, 5]);
    let ls = c.op1("LogSoftmax", &[("axis", Attr::Int(1))], &[x]);
    let labels = c.ints("labels", &[4], &[1, 1, 4, 0]);
    let y = c.op1("NegativeLogLikelihoodLoss", &[], &[ls, labels]);
    c.check(y, TOL);
}

#[test]
fn fan_out_gradients_are_summed() {
    let mut c = Case::new("fan_out");
    let x = c.param("x", &[3, 3]);
    let a = c.op1("Tanh", &[], &[x]);
    let b = c.op1("MatMul", &[], &[x, a]);
    let y = c.op1("Add", &[], &[b, x]);
    c.check(y, TOL);
}

#[test]
fn an_op_without_a_rule_is_an_error_naming_it() {
    let mut c = Case::new("no_rule");
    let x = c.param("x", &[3, 4]);
    let custom =
        mpc_ir::Opaque { domain: "com.example".into(), op_type: "Custom".into(), attrs: vec![], explicit_inputs: 1 };
    let (_, outs) = c.g.add_op("custom", Op::Opaque(Box::new(custom)), &[Some(x)], 1);
    c.g.set_ty(outs[0], mpc_ir::TypeInfo::new(DType::F64, mpc_ir::Shape::fixed(&[3, 4])));
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[outs[0]]);
    mpc_passes::infer_types(&mut c.g).unwrap();
    let seed = c.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
    let err = mpc_passes::train::differentiate(&mut c.g, &[x], s, seed).unwrap_err().to_string();
    assert!(err.contains("com.example::Custom has no gradient rule") && err.contains("custom"), "{err}");
}

#[test]
fn training_mode_dropout_is_refused_not_treated_as_identity() {
    let mut c = Case::new("dropout_training");
    let x = c.param("x", &[3, 4]);
    let ratio = c.tensor("ratio", &[], 0.5, 0.5);
    let on = c.g.add_initializer("on", Tensor::from_i64(vec![], &[1]).to_dtype(DType::Bool));
    let y = c.op("Dropout", &[], &[Some(x), Some(ratio), Some(on)], 1)[0];
    let s = c.op1("ReduceSum", &[("keepdims", Attr::Int(0))], &[y]);
    mpc_passes::infer_types(&mut c.g).unwrap();
    let seed = c.g.add_initializer("seed", Tensor::from_f64_as(DType::F64, vec![], &[1.0]));
    let err = mpc_passes::train::differentiate(&mut c.g, &[x], s, seed).unwrap_err().to_string();
    assert!(err.contains("Dropout in training mode"), "{err}");
}

#[test]
fn seeded_dropout() {
    // The mask is a function of (key, seed, element), so the step is deterministic and finite
    // differences see the same mask the backward pass reads.
    let mut c = Case::new("seeded_dropout");
    let x = c.param("x", &[6, 8]);
    let ratio = c.tensor("ratio", &[], 0.3, 0.3);
    let key = c.g.add_initializer("key", Tensor::from_i64(vec![], &[41]));
    let op = Op::from_mpc_attrs("SeededDropout", vec![("seed".to_string(), Attr::Int(5))]).unwrap().unwrap();
    let (_, outs) = c.g.add_op("drop", op, &[Some(x), Some(ratio), Some(key)], 2);
    c.check(outs[0], 1e-6);
}
