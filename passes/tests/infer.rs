//! Type and shape inference rules on small graphs written in text IR.

use mpc_ir::text;
use mpc_passes::infer_types;

/// Infers a graph given as text-IR body lines and returns the type of the value named `name`.
fn infer(body: &str, name: &str) -> Result<String, String> {
    let src = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 18\ngraph \"t\"\n{body}\nend\n");
    let mut g = text::parse(&src, None).map_err(|e| e.to_string())?;
    infer_types(&mut g).map_err(|e| e.to_string())?;
    let printed = text::print(&g, text::TensorMode::Inline).unwrap().text;
    // Declarations read `%N "name": type`; a type has no spaces, and a comma may follow it.
    let decl = format!(" \"{name}\": ");
    let at = printed.find(&decl).ok_or_else(|| format!("no `{name}` in\n{printed}"))?;
    let rest = &printed[at..];
    let ty = rest.split(": ").nth(1).unwrap_or("").split_whitespace().next().unwrap_or("");
    Ok(ty.trim_end_matches(',').to_string())
}

#[test]
fn broadcasting_keeps_symbols_and_rejects_mismatches() {
    let g = "  input %0 \"a\": f32[batch,1,4]\n  input %1 \"b\": f32[3,1]\n  %2 \"c\": ? = Add(%0, %1)\n  output %2";
    assert_eq!(infer(g, "c").unwrap(), "f32[batch,3,4]");
    let bad = "  input %0 \"a\": f32[2,4]\n  input %1 \"b\": f32[3,4]\n  %2 \"c\": ? = Add(%0, %1)\n  output %2";
    assert!(infer(bad, "c").unwrap_err().contains("cannot be broadcast"));
    let dtypes = "  input %0 \"a\": f32[2]\n  input %1 \"b\": f16[2]\n  %2 \"c\": ? = Mul(%0, %1)\n  output %2";
    assert!(infer(dtypes, "c").unwrap_err().contains("input 1 is f16 but input 0 is f32"));
}

#[test]
fn reshape_resolves_dynamic_batch_through_shape_arithmetic() {
    // x: [batch, 8, 16] → Reshape(x, Concat(Shape(x)[0:1], [-1])) → [batch, 128]
    let g = "  input %0 \"x\": f32[batch,8,16]
  init %1 \"zero\" = i64[1]{0}
  init %2 \"one\" = i64[1]{1}
  init %3 \"minus1\" = i64[1]{-1}
  %4 \"s\": ? = Shape(%0)
  %5 \"b\": ? = Slice(%4, %1, %2)
  %6 \"t\": ? = Concat[axis=0](%5, %3)
  %7 \"y\": ? = Reshape(%0, %6)
  output %7";
    assert_eq!(infer(g, "y").unwrap(), "f32[batch,128]");
}

#[test]
fn reshape_zero_copies_and_minus_one_infers() {
    let g = "  input %0 \"x\": f32[batch,8,32]\n  init %1 \"s\" = i64[4]{0, 0, 4, -1}\n  %2 \"y\": ? = Reshape(%0, %1)\n  output %2";
    assert_eq!(infer(g, "y").unwrap(), "f32[batch,8,4,8]");
    let bad =
        "  input %0 \"x\": f32[2,3]\n  init %1 \"s\" = i64[2]{4, -1}\n  %2 \"y\": ? = Reshape(%0, %1)\n  output %2";
    assert!(infer(bad, "y").unwrap_err().contains("cannot reshape"));
    // A target that holds a traced length (nn.MultiheadAttention's head split, legacy export): at
    // another length the counts differ by a constant factor, either way round; where the length
    // is still a symbol they may agree.
    let held = |x: &str| {
        format!(
            "  input %0 \"x\": f32[{x}]\n  input %1 \"b\": f32[batch]\n  %2 \"n\": i64[1] = Shape(%1)
  init %3 \"l\" = i64[1]{{8}}\n  init %4 \"k\" = i64[1]{{2}}\n  init %5 \"h\" = i64[1]{{16}}
  %6 \"m\": i64[1] = Mul(%2, %4)\n  %7 \"t\": i64[3] = Concat[axis=0](%3, %6, %5)
  %8 \"y\": ? = Reshape(%0, %7)\n  output %8"
        )
    };
    let e = infer(&held("4,batch,32"), "y").unwrap_err();
    assert!(e.contains("cannot reshape [4,batch,32] (128*batch elements) into [8,2*batch,16]"), "{e}");
    assert!(infer(&held("16,batch,32"), "y").unwrap_err().contains("cannot reshape"));
    assert_eq!(infer(&held("seq,batch,32"), "y").unwrap(), "f32[8,\"2*batch\",16]");
}

#[test]
fn symbolic_dims_are_expressions_that_divide_exactly() {
    // The dynamo exporter's head split: [8*batch,96] into [-1,8,96].
    let g = "  input %0 \"x\": f32[\"8*batch\",96]\n  init %1 \"s\" = i64[3]{-1, 8, 96}\n  %2 \"y\": ? = Reshape(%0, %1)\n  output %2";
    assert_eq!(infer(g, "y").unwrap(), "f32[batch,8,96]");
    // And back: [batch,8,96] flattened over the first two dims.
    let g = "  input %0 \"x\": f32[batch,8,96]\n  init %1 \"s\" = i64[2]{-1, 96}\n  %2 \"y\": ? = Reshape(%0, %1)\n  output %2";
    assert_eq!(infer(g, "y").unwrap(), "f32[\"8*batch\",96]");
    // A -1 that only some batch sizes fill is left open, not refused.
    let g =
        "  input %0 \"x\": f32[batch,6]\n  init %1 \"s\" = i64[2]{-1, 4}\n  %2 \"y\": ? = Reshape(%0, %1)\n  output %2";
    assert_eq!(infer(g, "y").unwrap(), "f32[?,4]");
}

#[test]
fn shape_arithmetic_carries_expressions_through_every_integer_op() {
    // Shape → Gather → Mul/Sub → Unsqueeze → Concat → Reshape, Range over a size, and the
    // legacy exporter's Where(Equal(shape, -1), 1, shape) guard in front of Expand.
    let g = "  input %0 \"x\": f32[batch,seq,32]
  init %1 \"i0\" = i64[]{0}
  init %2 \"i1\" = i64[]{1}
  init %3 \"four\" = i64[]{4}
  init %4 \"ax0\" = i64[1]{0}
  init %5 \"m1\" = i64[1]{-1}
  init %6 \"eight\" = i64[1]{8}
  init %22 \"two\" = i64[1]{2}
  %7 \"s\": ? = Shape(%0)
  %8 \"b\": ? = Gather(%7, %1)
  %9 \"t\": ? = Gather(%7, %2)
  %10 \"b4\": ? = Mul(%8, %3)
  %11 \"t1\": ? = Sub(%9, %2)
  %12 \"b4v\": ? = Unsqueeze(%10, %4)
  %13 \"t1v\": ? = Unsqueeze(%11, %4)
  %14 \"shape\": ? = Concat[axis=0](%12, %5, %6)
  %15 \"y\": ? = Reshape(%0, %14)
  %16 \"r\": ? = Range(%1, %9, %2)
  %23 \"tv\": ? = Unsqueeze(%9, %4)
  %17 \"want\": ? = Concat[axis=0](%5, %23)
  %18 \"ones\": ? = ConstantOfShape[value=i64[1]{1}](%22)
  %19 \"is_m1\": ? = Equal(%17, %5)
  %20 \"fixed\": ? = Where(%19, %18, %17)
  %21 \"e\": ? = Expand(%16, %20)
  output %15
  output %21
  output %13";
    assert_eq!(infer(g, "y").unwrap(), "f32[\"4*batch\",seq,8]");
    assert_eq!(infer(g, "r").unwrap(), "i64[seq]");
    assert_eq!(infer(g, "t1v").unwrap(), "i64[1]");
    assert_eq!(infer(g, "e").unwrap(), "i64[1,seq]");
}

#[test]
fn expand_and_constant_of_shape_keep_the_rank_of_a_computed_shape() {
    let g = "  input %0 \"x\": f32[1,4]\n  input %1 \"s\": i64[3]\n  %2 \"y\": ? = Expand(%0, %1)\n  %3 \"z\": ? = ConstantOfShape(%1)\n  output %2\n  output %3";
    assert_eq!(infer(g, "y").unwrap(), "f32[?,?,4]");
    assert_eq!(infer(g, "z").unwrap(), "f32[?,?,?]");
}

#[test]
fn matmul_gemm_conv_pool() {
    let mm = "  input %0 \"a\": f32[b,4,2,3]\n  input %1 \"w\": f32[3,5]\n  %2 \"y\": ? = MatMul(%0, %1)\n  output %2";
    assert_eq!(infer(mm, "y").unwrap(), "f32[b,4,2,5]");
    let mm_bad = "  input %0 \"a\": f32[2,3]\n  input %1 \"w\": f32[4,5]\n  %2 \"y\": ? = MatMul(%0, %1)\n  output %2";
    assert!(infer(mm_bad, "y").unwrap_err().contains("inner dimensions differ: 3 and 4"));
    let gemm = "  input %0 \"a\": f32[n,64]\n  input %1 \"w\": f32[10,64]\n  %2 \"y\": ? = Gemm[transB=1](%0, %1)\n  output %2";
    assert_eq!(infer(gemm, "y").unwrap(), "f32[n,10]");
    let conv = "  input %0 \"x\": f32[n,3,224,224]\n  input %1 \"w\": f32[64,3,7,7]
  %2 \"y\": ? = Conv[pads=[3, 3, 3, 3], strides=[2, 2]](%0, %1)
  %3 \"p\": ? = MaxPool[kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]](%2)
  output %3";
    assert_eq!(infer(conv, "y").unwrap(), "f32[n,64,112,112]");
    assert_eq!(infer(conv, "p").unwrap(), "f32[n,64,56,56]");
    let groups = "  input %0 \"x\": f32[1,4,8,8]\n  input %1 \"w\": f32[8,3,3,3]\n  %2 \"y\": ? = Conv[group=2](%0, %1)\n  output %2";
    assert!(infer(groups, "y").unwrap_err().contains("4 channels but the weight expects 6"));
    let ceil = "  input %0 \"x\": f32[1,1,5,5]\n  %1 \"y\": ? = MaxPool[ceil_mode=1, kernel_shape=[2, 2], strides=[2, 2]](%0)\n  output %1";
    assert_eq!(infer(ceil, "y").unwrap(), "f32[1,1,3,3]");
}

#[test]
fn reductions_squeeze_unsqueeze_split_slice() {
    let g = "  input %0 \"x\": f32[2,3,4]
  init %1 \"ax\" = i64[1]{-1}
  %2 \"r\": ? = ReduceMean[keepdims=0](%0, %1)
  %3 \"u\": ? = Unsqueeze(%2, %1)
  %4 \"q\": ? = Squeeze(%3, %1)
  init %5 \"sp\" = i64[2]{1, 2}
  %6 \"a\": ?, %7 \"b\": ? = Split[axis=1](%0, %5)
  init %8 \"st\" = i64[1]{-3}
  init %9 \"en\" = i64[1]{100}
  %10 \"s\": ? = Slice(%0, %8, %9, %1)
  output %4, %6, %7, %10";
    assert_eq!(infer(g, "q").unwrap(), "f32[2,3]");
    assert_eq!(infer(g, "u").unwrap(), "f32[2,3,1]");
    assert_eq!(infer(g, "q").unwrap(), "f32[2,3]");
    assert_eq!(infer(g, "a").unwrap(), "f32[2,1,4]");
    assert_eq!(infer(g, "b").unwrap(), "f32[2,2,4]");
    assert_eq!(infer(g, "s").unwrap(), "f32[2,3,3]");
    let bad = "  input %0 \"x\": f32[2,3]\n  init %1 \"ax\" = i64[1]{1}\n  %2 \"q\": ? = Squeeze(%0, %1)\n  output %2";
    assert!(infer(bad, "q").unwrap_err().contains("cannot squeeze axis 1 of size 3"));
}

#[test]
fn layer_norm_outputs_and_casts() {
    let g = "  input %0 \"x\": f16[b,s,32]\n  input %1 \"g\": f16[32]
  %2 \"y\": ?, %3 \"mean\": ?, %4 \"rstd\": ? = LayerNormalization(%0, %1)
  %5 \"c\": ? = Cast[to=1](%2)
  output %2, %3, %4, %5";
    assert_eq!(infer(g, "y").unwrap(), "f16[b,s,32]");
    assert_eq!(infer(g, "mean").unwrap(), "f32[b,s,1]");
    assert_eq!(infer(g, "c").unwrap(), "f32[b,s,32]");
}

#[test]
fn legacy_softmax_folds_only_when_its_axis_is_the_last_dim() {
    use mpc_passes::{Context, PassManager, Pipeline};
    let body = |axis: i64| {
        format!(
            "  input %0 \"x\": f32[2,3,4]\n  %1 \"f\": ? = Flatten[axis={axis}](%0)\n  %2 \"s\": ? = Softmax(%1)\n  %3 \"shape\": ? = Shape(%0)\n  %4 \"y\": ? = Reshape(%2, %3)\n  output %4"
        )
    };
    let run = |axis: i64| {
        let src = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n{}\nend\n", body(axis));
        let mut g = text::parse(&src, None).unwrap();
        PassManager::pipeline(Pipeline::Inference).run(&mut g, &Context::default(), &mut |_, _| {}).unwrap();
        g.node_ids().map(|n| g.node(n).op.op_type().to_string()).collect::<Vec<_>>()
    };
    assert_eq!(run(2), vec!["Softmax"], "axis 2 of rank 3 is the last dim");
    assert_eq!(run(1).len(), 4, "axis 1 of rank 3 must keep the 2-D coercion");
}

#[test]
fn windows_follow_the_one_geometry() {
    // ceil_mode keeps a last window that starts inside the input (at index 3 here): [1,1,3], the
    // size the CPU kernel produces (the runtime tests run the same node).
    let pool = "  input %0 \"x\": f32[1,1,4]\n  %1 \"y\": ? = MaxPool[ceil_mode=1, kernel_shape=[2], pads=[1, 0], strides=[2]](%0)\n  output %1";
    assert_eq!(infer(pool, "y").unwrap(), "f32[1,1,3]");
    let same = "  input %0 \"x\": f32[1,1,5]\n  %1 \"y\": ? = AveragePool[auto_pad=\"SAME_LOWER\", kernel_shape=[4], strides=[2]](%0)\n  output %1";
    assert_eq!(infer(same, "y").unwrap(), "f32[1,1,3]");
    let zero = "  input %0 \"x\": f32[1,1,5]\n  %1 \"y\": ? = MaxPool[kernel_shape=[2], strides=[0]](%0)\n  output %1";
    assert!(infer(zero, "y").unwrap_err().contains("strides [0] has 0; each must be at least 1"));
    let bad =
        "  input %0 \"x\": f32[1,1,5]\n  %1 \"y\": ? = MaxPool[auto_pad=\"SAME\", kernel_shape=[2]](%0)\n  output %1";
    assert!(infer(bad, "y").unwrap_err().contains("SAME_UPPER"));
}

#[test]
fn resize_sizes_and_scales_name_the_axes_attribute_gives() {
    let sizes = "  input %0 \"x\": f32[n,3,4,5]\n  init %1 \"s\" = i64[2]{8, 15}
  %2 \"y\": ? = Resize[axes=[2, -1]](%0, _, _, %1)\n  output %2";
    assert_eq!(infer(sizes, "y").unwrap(), "f32[n,3,8,15]");
    let scales = "  input %0 \"x\": f32[n,3,4,5]\n  init %1 \"s\" = f32[2]{2, 3}
  %2 \"y\": ? = Resize[axes=[2, 3]](%0, _, %1)\n  output %2";
    assert_eq!(infer(scales, "y").unwrap(), "f32[n,3,8,15]");
    // torch.onnx's legacy F.interpolate(scale_factor=2): the scales a Concat of two Constants.
    let concat = "  input %0 \"x\": f32[n,5,5]
  %1 \"a\": f32[2] = Constant[value=f32[2]{1, 1}]()
  %2 \"b\": f32[1] = Constant[value=f32[1]{2}]()
  %3 \"s\": f32[3] = Concat[axis=0](%1, %2)
  %4 \"y\": ? = Resize(%0, _, %3)\n  output %4";
    assert_eq!(infer(concat, "y").unwrap(), "f32[n,5,10]");
}

#[test]
fn closed_attributes_are_checked_when_parsed() {
    let two = "  input %0 \"x\": f32[2,3]\n  %1 \"y\": ? = ReduceMax[keepdims=2](%0)\n  output %1";
    assert!(infer(two, "y").unwrap_err().contains("`keepdims` is 2 where int 0 or 1 was expected"));
    let mode = "  input %0 \"x\": f32[1,1,2,2]\n  %1 \"y\": ? = Resize[mode=\"bicubic\"](%0)\n  output %1";
    assert!(infer(mode, "y").unwrap_err().contains("`mode` is \"bicubic\" where one of nearest, linear, cubic"));
}

#[test]
fn gather_nd_shapes_follow_the_last_index_dim_and_batch_dims() {
    let gnd = |data: &str, idx: &str, attrs: &str| {
        format!(
            "  input %0 \"x\": {data}\n  input %1 \"i\": {idx}\n  %2 \"y\": ? = GatherND{attrs}(%0, %1)\n  output %2"
        )
    };
    // indices.shape[:-1] + data.shape[batch_dims + k:]
    assert_eq!(infer(&gnd("f32[3,5,6]", "i64[4,2]", ""), "y").unwrap(), "f32[4,6]");
    assert_eq!(infer(&gnd("f32[3,5,6]", "i64[4,1]", ""), "y").unwrap(), "f32[4,5,6]");
    assert_eq!(infer(&gnd("f16[batch,5,6]", "i64[batch,seq,1]", "[batch_dims=1]"), "y").unwrap(), "f16[batch,seq,6]");
    // The dynamo exporter's attention mask: batch dims known on one side only.
    assert_eq!(infer(&gnd("bool[2,5,6]", "i64[?,7,2]", "[batch_dims=1]"), "y").unwrap(), "bool[2,7]");
    // An unknown k leaves the rank open unless one data dim is left past the batch dims.
    assert_eq!(infer(&gnd("f32[3,5]", "i64[4,?]", ""), "y").unwrap(), "f32");
    assert_eq!(infer(&gnd("f32[8]", "i64[4,?]", ""), "y").unwrap(), "f32[4]");
    assert_eq!(infer(&gnd("f32[2,8]", "i64[2,3,?]", "[batch_dims=1]"), "y").unwrap(), "f32[2,3]");
    let err = |g: String| infer(&g, "y").unwrap_err();
    assert!(err(gnd("f32[3,5]", "i64[4,3]", "")).contains("indices' last dim is 3; it must be from 1 to 2"));
    assert!(err(gnd("f32[2,5]", "i64[3,1]", "[batch_dims=1]")).contains("batch dims of data and indices differ"));
    assert!(err(gnd("f32[2,5]", "i64[2,1]", "[batch_dims=2]")).contains("batch_dims 2 needs"));
    assert!(err(gnd("f32[2,5]", "f32[2,1]", ""))
        .contains("input 1 (`indices`) is f32, which `tensor(int64)` does not allow"));
}

#[test]
fn scatters_give_the_data_type_and_check_updates() {
    let snd = |data: &str, idx: &str, upd: &str| {
        format!("  input %0 \"x\": {data}\n  input %1 \"i\": {idx}\n  input %2 \"u\": {upd}\n  %3 \"y\": ? = ScatterND[reduction=\"add\"](%0, %1, %2)\n  output %3")
    };
    assert_eq!(infer(&snd("f32[batch,4,5]", "i64[3,2]", "f32[3,5]"), "y").unwrap(), "f32[batch,4,5]");
    assert_eq!(infer(&snd("i64[4,5]", "i64[2,2,1]", "i64[2,2,5]"), "y").unwrap(), "i64[4,5]");
    let err = |g: String| infer(&g, "y").unwrap_err();
    assert!(
        err(snd("f32[4,5]", "i64[3,1]", "f32[3,4]")).contains("updates and indices[:-1] + data[k:] differ: 4 and 5")
    );
    assert!(err(snd("f32[4,5]", "i64[3,2]", "f32[3,5]"))
        .contains("updates are [3,5]; data [4,5] and indices [3,2] make them [3]"));
    assert!(err(snd("f32[4,5]", "i64[3,3]", "f32[3]")).contains("more than the rank of data"));
    assert!(err(snd("f32[4,5]", "i64[3,1]", "f16[3,5]")).contains("input 2 is f16 but input 0 is f32"));
    let sel = |data: &str, idx: &str, upd: &str| {
        format!("  input %0 \"x\": {data}\n  input %1 \"i\": {idx}\n  input %2 \"u\": {upd}\n  %3 \"y\": ? = ScatterElements[axis=-1](%0, %1, %2)\n  output %3")
    };
    assert_eq!(infer(&sel("bf16[b,8]", "i32[b,3]", "bf16[b,3]"), "y").unwrap(), "bf16[b,8]");
    assert!(err(sel("f32[4,5]", "i64[4]", "f32[4]")).contains("must have the rank of data"));
    assert!(err(sel("f32[4,5]", "i64[4,2]", "f32[4,3]")).contains("indices and updates dims differ: 2 and 3"));
    assert!(err(sel("f32[4,5]", "f32[4,2]", "f32[4,2]"))
        .contains("input 1 (`indices`) is f32, which `Tind` does not allow"));
}

#[test]
fn scatter_reductions_are_a_closed_set() {
    // ScatterND's indices are [1,1] (one tuple of one coordinate), ScatterElements' [1].
    let g = |op: &str| {
        let i = if op.starts_with("ScatterND") { "i64[1,1]" } else { "i64[1]" };
        format!("  input %0 \"x\": f32[4]\n  init %1 \"i\" = {i}{{0}}\n  init %2 \"u\" = f32[1]{{1.0}}\n  %3 \"y\": ? = {op}(%0, %1, %2)\n  output %3")
    };
    for op in ["ScatterND", "ScatterElements"] {
        let e = infer(&g(&format!("{op}[reduction=\"sum\"]")), "y").unwrap_err();
        assert!(e.contains("`reduction` is \"sum\" where one of none, add, mul, max, min was expected"), "{e}");
        for r in ["none", "add", "mul", "max", "min"] {
            assert_eq!(infer(&g(&format!("{op}[reduction=\"{r}\"]")), "y").unwrap(), "f32[4]", "{op} {r}");
        }
    }
    let e = infer(&g("ScatterND[reduction=1]"), "y").unwrap_err();
    assert!(e.contains("`reduction` is 1 where one of none"), "{e}");
}

#[test]
fn instance_norm_scale_and_bias_hold_one_value_per_channel() {
    let ok = "  input %0 \"x\": f32[n,2,16]\n  init %1 \"s\" = f32[2]{1.0, 1.0}\n  init %2 \"b\" = f32[2]{0.0, 0.0}\n  %3 \"y\": ? = InstanceNormalization(%0, %1, %2)\n  output %3";
    assert_eq!(infer(ok, "y").unwrap(), "f32[n,2,16]");
    let bad = "  input %0 \"x\": f32[n,2,16]\n  init %1 \"s\" = f32[1]{1.0}\n  init %2 \"b\" = f32[2]{0.0, 0.0}\n  %3 \"y\": ? = InstanceNormalization(%0, %1, %2)\n  output %3";
    assert!(infer(bad, "y").unwrap_err().contains("the scale is [1] where the input's 2 channels need [2]"));
}
