//! Whole-graph validation at import: every standard node is checked against its op's signature at
//! the model's opset (arity, attributes, dtypes), subgraphs like the main graph, and attribute and
//! constant-operand values before anything runs. Each case: one line naming the file and node,
//! exit 2, nothing written.

mod common;

use common::onnx::{i64_tensor, model, node, rejects, tensor_vi, write};
use common::{mpc, scratch};
use mpc_ir::onnx::proto::{self, attribute_type as at, AttributeProto, ModelProto, NodeProto};
use prost::Message;

fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto { name: name.into(), r#type: at::INT, i, ..Default::default() }
}

fn with_attrs(mut n: NodeProto, attrs: Vec<AttributeProto>) -> NodeProto {
    n.attribute = attrs;
    n
}

fn at_opset(bytes: Vec<u8>, opset: i64) -> Vec<u8> {
    let mut m = ModelProto::decode(bytes.as_slice()).unwrap();
    m.opset_import[0].version = opset;
    m.encode_to_vec()
}

#[test]
fn nodes_are_checked_against_their_op_signature() {
    let d = scratch("validation_signature");
    let w = proto::TensorProto {
        name: "w".into(),
        data_type: 1,
        dims: vec![3, 3],
        float_data: vec![0.5; 9],
        ..Default::default()
    };
    let relu_bogus = with_attrs(node("Relu", &["x"], &["y"]), vec![attr_int("bogus", 1)]);
    let gemm_alpha = with_attrs(node("Gemm", &["x", "w"], &["y"]), vec![attr_int("alpha", 2)]);
    let untyped =
        with_attrs(node("Relu", &["x"], &["y"]), vec![AttributeProto { name: "t".into(), ..Default::default() }]);
    let auto_pad =
        AttributeProto { name: "auto_pad".into(), r#type: at::STRING, s: "MIDDLE".into(), ..Default::default() };
    let kernel = AttributeProto { name: "kernel_shape".into(), r#type: at::INTS, ints: vec![2], ..Default::default() };
    let mut transpose = node("Transpose", &["x"], &["y"]);
    transpose.attribute =
        vec![AttributeProto { name: "perm".into(), r#type: at::INTS, ints: vec![1, 1], ..Default::default() }];
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("too_few", model(vec![node("Gemm", &["x"], &["y"])], vec![]), "Gemm (opset 13) takes 2 to 3 inputs, not 1"),
        ("too_many", model(vec![node("Relu", &["x", "x"], &["y"])], vec![]), "Relu (opset 14) takes 1 input, not 2"),
        (
            "empty_required",
            model(vec![node("Gemm", &["x", ""], &["y"])], vec![]),
            "input 1 (`B`) is required but empty",
        ),
        ("unknown_attr", model(vec![relu_bogus], vec![]), "Relu (opset 14) has no attribute `bogus`"),
        (
            "mistyped_attr",
            model(vec![gemm_alpha], vec![w.clone()]),
            "attribute `alpha` of Gemm (opset 13) is int where float",
        ),
        ("untyped_attr", model(vec![untyped], vec![]), "attribute `t` has no valid type (code 0)"),
        (
            "unknown_op",
            model(vec![node("Frobnicate", &["x"], &["y"])], vec![]),
            "no op `Frobnicate` in the ai.onnx domain",
        ),
        (
            "too_new",
            model(vec![node("Gelu", &["x"], &["y"])], vec![]),
            "Gelu is an op of opset 20 and later; the model imports opset 17",
        ),
        (
            "dtypes",
            model(vec![node("Add", &["x", "i"], &["y"])], vec![i64_tensor("i", &[1])]),
            "input 1 is i64 but input 0 is f32",
        ),
        (
            "index_dtype",
            model(vec![node("Gather", &["x", "w"], &["y"])], vec![w]),
            "input 1 (`indices`) is f32, which `Tind` does not allow",
        ),
        (
            "enum_value",
            model(vec![with_attrs(node("MaxPool", &["x"], &["y"]), vec![auto_pad, kernel])], vec![]),
            "`auto_pad` is \"MIDDLE\"",
        ),
        ("perm", model(vec![transpose], vec![]), "perm [1, 1] repeats an axis"),
    ];
    for (name, bytes, expect) in cases {
        let e = rejects(&d, &write(&d, &format!("{name}.onnx"), &bytes), expect);
        assert!(e.contains("node "), "{name}: the node is not named: {e}");
    }
    // Removed or renamed attributes count at the model's opset: Squeeze-11 has `axes`, -13 not.
    let squeeze = AttributeProto { name: "axes".into(), r#type: at::INTS, ints: vec![0], ..Default::default() };
    let sq = model(vec![with_attrs(node("Squeeze", &["x"], &["y"]), vec![squeeze])], vec![]);
    rejects(&d, &write(&d, "squeeze13.onnx", &sq), "Squeeze (opset 13) has no attribute `axes`");
    let out = d.join("squeeze11.out.onnx");
    let ok = write(&d, "squeeze11.onnx", &at_opset(sq, 11));
    let r = mpc(&["compile", ok.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    // Squeezing axis 0 of [2,3] is wrong for another reason, found later: the schema let it through.
    assert!(String::from_utf8_lossy(&r.stderr).contains("cannot squeeze axis 0"), "{r:?}");
}

#[test]
fn inputs_must_say_their_element_type() {
    let d = scratch("validation_elem_type");
    let mut m = ModelProto::decode(model(vec![node("Relu", &["x"], &["y"])], vec![]).as_slice()).unwrap();
    m.graph.as_mut().unwrap().input[0] = tensor_vi("x", 0, &[2, 3]);
    rejects(&d, &write(&d, "elem0.onnx", &m.encode_to_vec()), "input `x` has no element type");
}

#[test]
fn outputs_are_listed_once() {
    let d = scratch("validation_outputs");
    let mut m = ModelProto::decode(model(vec![node("Relu", &["x"], &["y"])], vec![]).as_slice()).unwrap();
    let g = m.graph.as_mut().unwrap();
    g.output.push(g.output[0].clone());
    rejects(&d, &write(&d, "twice.onnx", &m.encode_to_vec()), "graph output `y` is listed more than once");
}

/// An If whose `then_branch` holds `body` (its `else_branch` a valid one).
fn if_model(then_branch: Vec<u8>) -> Vec<u8> {
    let branch = |g: Vec<u8>, name: &str| AttributeProto {
        name: name.into(),
        r#type: at::GRAPH,
        g: Some(g.into()),
        ..Default::default()
    };
    let good = proto::GraphProto {
        name: "else".into(),
        node: vec![node("Neg", &["x"], &["e"])],
        output: vec![tensor_vi("e", 1, &[2, 3])],
        ..Default::default()
    };
    let cond = proto::TensorProto { name: "c".into(), data_type: 9, int32_data: vec![1], ..Default::default() };
    let mut n = node("If", &["c"], &["y"]);
    n.attribute = vec![branch(then_branch, "then_branch"), branch(good.encode_to_vec(), "else_branch")];
    model(vec![n], vec![cond])
}

#[test]
fn subgraphs_are_checked_like_the_main_graph() {
    let d = scratch("validation_subgraphs");
    let body = |nodes: Vec<NodeProto>| {
        proto::GraphProto {
            name: "then".into(),
            node: nodes,
            output: vec![tensor_vi("t", 1, &[2, 3])],
            ..Default::default()
        }
        .encode_to_vec()
    };
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "undefined",
            if_model(body(vec![node("Add", &["x", "ghost"], &["t"])])),
            "`then_branch` reads `ghost`, which is not defined",
        ),
        ("corrupt", if_model(vec![0x0a, 0xff, 0xff, 0xff]), "`then_branch` is not a valid graph"),
        ("bad_node", if_model(body(vec![node("Relu", &["x", "x"], &["t"])])), "Relu (opset 14) takes 1 input, not 2"),
        ("no_output", if_model(body(vec![node("Relu", &["x"], &["r"])])), "`then_branch`"),
    ];
    for (name, bytes, expect) in cases {
        let e = rejects(&d, &write(&d, &format!("{name}.onnx"), &bytes), expect);
        assert!(e.contains("`If_y` (If)"), "{name}: the If is not named: {e}");
    }
    // The same If with a valid branch compiles, and its output passes back through the reader.
    let ok = write(&d, "ok.onnx", &if_model(body(vec![node("Relu", &["x"], &["t"])])));
    let out = d.join("ok.out.onnx");
    let r = mpc(&["compile", ok.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(mpc(&["inspect", out.to_str().unwrap()]).status.success());
}

/// Values the attributes and constant operands cannot take, in the text IR: refused before
/// running, naming the node.
#[test]
fn attribute_and_operand_values_are_checked_before_running() {
    let d = scratch("validation_values");
    let cases = [
        ("tile", "init %1 \"r\" = i64[2]{-1, 2}\n  %2 \"y\": ? = Tile(%0, %1) @\"n\"", "repeats has -1"),
        (
            "pad",
            "init %1 \"p\" = i64[4]{-3, 0, 0, 0}\n  %2 \"y\": ? = Pad(%0, %1) @\"n\"",
            "pads -3 and 0 on axis 0 of size 2",
        ),
        (
            "unsqueeze",
            "init %1 \"a\" = i64[2]{0, 0}\n  %2 \"y\": ? = Unsqueeze(%0, %1) @\"n\"",
            "axes [0, 0] repeat an axis",
        ),
        ("const_shape", "init %1 \"s\" = i64[1]{-5}\n  %2 \"y\": ? = ConstantOfShape(%1) @\"n\"", "the shape has -5"),
        ("lrn", "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = LRN[size=0](%0) @\"n\"", "size is 0; it must be at least 1"),
        ("conv", "init %1 \"w\" = f32[1,2,1]{1, 2}\n  %2 \"y\": ? = Conv[group=0](%0, %1) @\"n\"", "group is 0"),
        (
            "pool",
            "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = MaxPool[kernel_shape=[2], strides=[0]](%0) @\"n\"",
            "strides [0] has 0",
        ),
        (
            "einsum_operands",
            "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = Einsum[equation=\"ij,jk->ik\"](%0) @\"n\"",
            "has 2 operands but the node 1 inputs",
        ),
        (
            "einsum_label",
            "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = Einsum[equation=\"ij->ijk\"](%0) @\"n\"",
            "output label `k` is in no operand",
        ),
        (
            "einsum_rank",
            "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = Einsum[equation=\"ijk->k\"](%0) @\"n\"",
            "operand 0 has 3 labels but rank 2",
        ),
    ];
    // Ranks and operand shapes the kernels rely on (each of these once panicked or ran on garbage).
    let x = |shape: &str, rest: &str| format!("input %0 \"x\": f32[{shape}]\n  {rest}");
    let ranks = [
        ("convt_rank0", x("", "init %1 \"w\" = f32[1,1,1]{1}\n  %2 \"y\": ? = ConvTranspose(%0, %1) @\"n\""), "must have one rank, 3 or more"),
        ("convt_group", x("2,3,4", "init %1 \"w\" = f32[3,1,2]{1,1,1,1,1,1}\n  %2 \"y\": ? = ConvTranspose[group=2](%0, %1) @\"n\""), "input has 3 channels"),
        ("convt_outpad", x("1,2,4", "init %1 \"w\" = f32[2,1,2]{1,1,1,1}\n  %2 \"y\": ? = ConvTranspose[output_padding=[5], strides=[2]](%0, %1) @\"n\""), "output_padding 5 must be less"),
        ("conv_bias", x("1,2,4", "init %1 \"w\" = f32[1,2,1]{1,1}\n  init %3 \"b\" = f32[2]{1,1}\n  %2 \"y\": ? = Conv(%0, %1, %3) @\"n\""), "bias [2] is not [1]"),
        ("layernorm", x("2,3", "init %1 \"s\" = f32[2]{1,1}\n  %2 \"y\": ? = LayerNormalization[axis=0](%0, %1) @\"n\""), "input 1 is [2], not the 6 values"),
        ("sce_targets", x("2,3", "init %1 \"l\" = i64[2,3]{0,1,2,0,1,2}\n  %2 \"y\": ? = SoftmaxCrossEntropyLoss(%0, %1) @\"n\""), "the targets [2,3] do not match"),
        ("sce_rank1", x("2", "init %1 \"l\" = i64[2]{0,1}\n  %2 \"y\": ? = SoftmaxCrossEntropyLoss(%0, %1) @\"n\""), "need rank 2 or more"),
        ("pool_pads", x("1,2,4", "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = MaxPool[kernel_shape=[2], pads=[5, 5]](%0) @\"n\""), "must each be less than the kernel"),
        ("resize_sizes", x("2,3", "init %1 \"s\" = i64[2]{1,-2}\n  %2 \"y\": ? = Resize(%0, _, _, %1) @\"n\""), "sizes has -2"),
        ("resize_scales", x("2,3", "init %1 \"s\" = f32[2]{1,-2}\n  %2 \"y\": ? = Resize(%0, _, %1) @\"n\""), "scales has -2"),
        ("batchnorm", x("2,3,4", "init %1 \"s\" = f32[2]{1,1}\n  %2 \"y\": ? = BatchNormalization(%0, %1, %1, %1, %1) @\"n\""), "the scale is [2] where the input's 3 channels"),
        ("groupnorm", x("1,4,3", "init %1 \"s\" = f32[2]{1,1}\n  %2 \"y\": ? = GroupNormalization[num_groups=2](%0, %1, %1) @\"n\""), "the scale is [2] where the input's 4 channels"),
        ("pad_edge", x("0,3", "init %1 \"p\" = i64[4]{1,1,1,1}\n  %2 \"y\": ? = Pad[mode=\"edge\"](%0, %1) @\"n\""), "Edge padding of 1 on axis 0 of size 0"),
        ("instancenorm", x("3", "init %1 \"s\" = f32[3]{1,1,1}\n  %2 \"y\": ? = InstanceNormalization(%0, %1, %1) @\"n\""), "the input is [3], not [batch, channels"),
        ("gather_elements", x("2,3", "init %1 \"i\" = i64[2,3]{0,1,2,3,4,5}\n  %2 \"y\": ? = GatherElements[axis=1](%0, %1) @\"n\""), "index 3 is out of range for axis 1"),
        ("mpc_arity", x("2,3", "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = ai.mpc::AdamUpdate[lr=0.1](%0) @\"n\""), "ai.mpc::AdamUpdate takes 6 to 9 inputs, not 1"),
        ("argmax_empty", x("0,3", "init %1 \"u\" = f32[]{1}\n  %2 \"y\": ? = ArgMax(%0) @\"n\""), "is empty: there is no index"),
    ];
    let cases = cases.map(|(n, body, e)| (n, x("2,3", body), e)).into_iter().chain(ranks);
    for (name, body, expect) in cases {
        let text = format!("mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  {body}\n  output %2\nend\n");
        let model = write(&d, &format!("{name}.mpcir"), text.as_bytes());
        let out = d.join(format!("{name}.out.safetensors"));
        let r = mpc(&["run", model.to_str().unwrap(), "--random-inputs", "1", "-o", out.to_str().unwrap()]);
        let e = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{name}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{name}: {e}");
        assert!(e.contains(expect) && e.contains("`n`"), "{name}: expected `{expect}` in {e}");
        assert!(!out.exists(), "{name}: an output was written");
    }
}

/// Inputs that bind one symbolic dim to two sizes (labels with another batch than the images)
/// are refused before running, naming the input.
#[test]
fn a_symbolic_dim_binds_one_size() {
    let d = scratch("validation_symbols");
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  input %0 \"x\": f32[b,3]\n  input %1 \"z\": f32[b,3]\n  %2 \"y\": ? = Add(%0, %1) @\"n\"\n  output %2\nend\n";
    let model = write(&d, "sym.mpcir", text.as_bytes());
    let t = |n: usize| mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, vec![n, 3], vec![1.0; n * 3]);
    let inputs = d.join("in.safetensors");
    mpc::run::write_safetensors(&inputs, &[("x".into(), t(2)), ("z".into(), t(4))]).unwrap();
    let out = d.join("out.safetensors");
    let r = mpc(&["run", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap(), "-o", out.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{e}");
    let blame = "input `z` axis 0 is 4 where the model's `b` is 2 (bound by input `x` axis 0)";
    assert!(e.contains("sym.mpcir") && e.contains(blame) && e.trim().lines().count() == 1, "{e}");
    assert!(!out.exists());
}

/// Data of another sequence length than the model's other input: `run` names both inputs and
/// axes; `train` of a language model with labels of another length than its tokens names the
/// labels and the input that bound the length.
#[test]
fn a_sequence_length_the_data_disagrees_on_names_both_inputs() {
    let d = scratch("validation_seq");
    let text = "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  input %0 \"x\": f32[batch,seq,4]\n  input %1 \"mask\": f32[batch,seq]\n  init %2 \"ax\" = i64[1]{2}\n  %3 \"m\": ? = Unsqueeze(%1, %2) @\"u\"\n  %4 \"y\": ? = Mul(%0, %3) @\"n\"\n  output %4\nend\n";
    let model = write(&d, "masked.mpcir", text.as_bytes());
    let t = |shape: Vec<usize>| {
        let n = shape.iter().product();
        mpc_runtime::HostTensor::from_f64(mpc_ir::DType::F32, shape, vec![1.0; n])
    };
    let inputs = d.join("in.safetensors");
    mpc::run::write_safetensors(&inputs, &[("x".into(), t(vec![2, 6, 4])), ("mask".into(), t(vec![2, 5]))]).unwrap();
    let r = mpc(&["run", model.to_str().unwrap(), "--inputs", inputs.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{e}");
    let blame = "input `mask` axis 1 is 5 where the model's `seq` is 6 (bound by input `x` axis 1)";
    assert!(e.contains(blame) && e.trim().lines().count() == 1, "{e}");

    let emb: Vec<String> = (0..32).map(|i| format!("{:.2}", (i % 7) as f32 * 0.1 - 0.3)).collect();
    let w: Vec<String> = (0..32).map(|i| format!("{:.2}", (i % 5) as f32 * 0.1 - 0.2)).collect();
    let lm = format!(
        "mpcir 1\nmodel ir_version=8\nopset \"\" 17\ngraph \"t\"\n  input %0 \"ids\": i64[batch,seq]\n  init %1 \"emb\" = f32[8,4]{{{}}}\n  %2 \"h\": ? = Gather(%1, %0) @\"g\"\n  init %3 \"w\" = f32[4,8]{{{}}}\n  %4 \"logits\": ? = MatMul(%2, %3) @\"mm\"\n  output %4\nend\n",
        emb.join(", "),
        w.join(", ")
    );
    let model = write(&d, "lm.mpcir", lm.as_bytes());
    let ids = |shape: Vec<usize>| {
        let n: usize = shape.iter().product();
        mpc_runtime::HostTensor::from_i64(mpc_ir::DType::I64, shape, (0..n as i64).map(|i| i % 8).collect())
    };
    let data = d.join("lm.safetensors");
    mpc::run::write_safetensors(&data, &[("ids".into(), ids(vec![4, 6])), ("labels".into(), ids(vec![4, 5]))]).unwrap();
    let args = ["train", model.to_str().unwrap(), "--data", data.to_str().unwrap(), "--loss", "cross-entropy:axis=-1"];
    let r = mpc(&[&args[..], &["--epochs", "1", "--batch", "2"]].concat());
    let e = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(2), "{e}");
    assert!(e.contains("input `labels` axis 1 is 5") && e.contains("input `ids` axis 1"), "{e}");
    assert_eq!(e.trim().lines().count(), 1, "{e}");
    // Labels of the tokens' length train.
    mpc::run::write_safetensors(&data, &[("ids".into(), ids(vec![4, 6])), ("labels".into(), ids(vec![4, 6]))]).unwrap();
    let r = mpc(&[&args[..], &["--epochs", "1", "--batch", "2"]].concat());
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}
