#!/usr/bin/env python3
"""Generates the ONNX fixtures in this folder (deterministic: fixed seed).

    python3 tests/models/make_fixtures.py      # needs numpy and onnx

Each model is built with onnx.helper, checked with onnx.checker (full check) and written next to
this script. fixtures.json records, for every integer input, the range of valid values (token ids,
class labels), so that tests feeding random inputs stay in range. The Rust tests only read the
written files; Python is for generating them.
"""

import json
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = os.path.dirname(os.path.abspath(__file__))
rng = np.random.default_rng(20261121)
ranges = {}


def init(name, shape, scale=None, dtype=np.float32):
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    scale = scale if scale is not None else 1.0 / np.sqrt(fan_in)
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(dtype), name)


def const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.array(values, dtype=dtype), name)


def save(name, graph, opset, extra_opsets=(), producer="mpc-fixtures"):
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = helper.make_model(graph, opset_imports=opsets, producer_name=producer)
    model.ir_version = min(model.ir_version, 8 if opset >= 15 else 7)
    if not extra_opsets:
        onnx.checker.check_model(model, full_check=True)
    onnx.save(model, os.path.join(HERE, name + ".onnx"))


def mlp_nodes(x, weights=None):
    """The MLP 64-256-256-10 reading `x`; `weights(name, shape, fan_in, is_bias)` makes each
    initializer (default: normal, scaled by 1/sqrt(fan_in), biases by 0.01)."""
    weights = weights or (lambda name, shape, fan_in, is_bias: init(name, shape, 0.01 if is_bias else None))
    nodes = []
    dims = [64, 256, 256, 10]
    inits = []
    h = x
    for i in range(3):
        w, b = f"fc{i + 1}.weight", f"fc{i + 1}.bias"
        inits += [weights(w, [dims[i + 1], dims[i]], dims[i], False), weights(b, [dims[i + 1]], dims[i], True)]
        out = f"fc{i + 1}" if i < 2 else "logits"
        nodes.append(helper.make_node("Gemm", [h, w, b], [out], name=f"/fc{i + 1}/Gemm", transB=1))
        if i < 2:
            nodes.append(helper.make_node("Relu", [out], [f"relu{i + 1}"], name=f"/relu{i + 1}/Relu"))
            h = f"relu{i + 1}"
    return nodes, inits


def mlp():
    nodes, inits = mlp_nodes("x")
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits)
    save("mlp", g, 17)


def mlp_loss():
    nodes, inits = mlp_nodes("x")
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="/loss", reduction="mean"))
    g = helper.make_graph(
        nodes, "mlp_loss",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64]),
         helper.make_tensor_value_info("labels", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits)
    ranges["mlp_loss"] = {"labels": [0, 10]}
    save("mlp_loss", g, 17)


def bn_params(prefix, c):
    return [
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(c)).astype(np.float32), f"{prefix}.weight"),
        numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype(np.float32), f"{prefix}.bias"),
        numpy_helper.from_array((0.1 * rng.standard_normal(c)).astype(np.float32), f"{prefix}.running_mean"),
        numpy_helper.from_array((1 + 0.1 * rng.random(c)).astype(np.float32), f"{prefix}.running_var"),
    ]


def cnn_bn():
    """A digits-sized CNN with BatchNormalization in training mode (as torch exports it with
    training=TrainingMode.TRAINING): BN returns the batch-normalised output and the updated
    running statistics."""
    nodes, inits = [], []
    x, cin = "x", 1
    for i, cout in enumerate([8, 16]):
        p = f"conv{i + 1}"
        inits += [init(f"{p}.weight", [cout, cin, 3, 3]), init(f"{p}.bias", [cout], 0.01)]
        nodes.append(helper.make_node("Conv", [x, f"{p}.weight", f"{p}.bias"], [f"{p}_out"], name=f"/{p}/Conv",
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        b = f"bn{i + 1}"
        inits += bn_params(b, cout)
        nodes.append(helper.make_node(
            "BatchNormalization",
            [f"{p}_out", f"{b}.weight", f"{b}.bias", f"{b}.running_mean", f"{b}.running_var"],
            [f"{b}_out", f"{b}.running_mean_out", f"{b}.running_var_out"],
            name=f"/{b}/BatchNormalization", epsilon=1e-5, momentum=0.9, training_mode=1))
        nodes.append(helper.make_node("Relu", [f"{b}_out"], [f"relu{i + 1}"], name=f"/relu{i + 1}/Relu"))
        x, cin = f"relu{i + 1}", cout
        if i == 0:
            nodes.append(helper.make_node("MaxPool", [x], ["pool1"], name="/pool1/MaxPool", kernel_shape=[2, 2], strides=[2, 2]))
            x = "pool1"
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"], name="/gap/GlobalAveragePool"))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], name="/flatten/Flatten", axis=1))
    inits += [init("fc.weight", [10, 16]), init("fc.bias", [10], 0.01)]
    nodes.append(helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="/fc/Gemm", transB=1))
    g = helper.make_graph(
        nodes, "cnn_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10]),
         helper.make_tensor_value_info("bn1.running_mean_out", TensorProto.FLOAT, [8]),
         helper.make_tensor_value_info("bn1.running_var_out", TensorProto.FLOAT, [8])],
        inits)
    save("cnn_bn", g, 15)


def resblock():
    c = 16
    nodes, inits = [], []
    h = "x"
    for i in range(2):
        p, b = f"conv{i + 1}", f"bn{i + 1}"
        inits += [init(f"{p}.weight", [c, c, 3, 3])] + bn_params(b, c)
        nodes.append(helper.make_node("Conv", [h, f"{p}.weight"], [f"{p}_out"], name=f"/{p}/Conv",
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]))
        nodes.append(helper.make_node(
            "BatchNormalization",
            [f"{p}_out", f"{b}.weight", f"{b}.bias", f"{b}.running_mean", f"{b}.running_var"],
            [f"{b}_out"], name=f"/{b}/BatchNormalization", epsilon=1e-5))
        if i == 0:
            nodes.append(helper.make_node("Relu", [f"{b}_out"], ["relu1"], name="/relu1/Relu"))
            h = "relu1"
    nodes.append(helper.make_node("Add", ["bn2_out", "x"], ["sum"], name="/add/Add"))
    nodes.append(helper.make_node("Relu", ["sum"], ["y"], name="/relu2/Relu"))
    g = helper.make_graph(
        nodes, "resblock",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", c, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", c, 8, 8])],
        inits)
    save("resblock", g, 13)


def transformer():
    """One pre-norm-free encoder layer as exporters write it: embedding Gather, Q/K/V MatMuls,
    Reshape/Transpose into heads, scaled scores with a causal -1e9 mask, Softmax, output projection,
    residual + LayerNormalization, an Erf-based GELU feed-forward, residual + LayerNormalization."""
    vocab, seq, d, heads, ff = 50, 8, 32, 4, 64
    dh = d // heads
    n, inits = [], []
    N = helper.make_node
    inits += [init("embed.weight", [vocab, d], 1.0), init("pos.weight", [seq, d], 0.1)]
    n.append(N("Gather", ["embed.weight", "tokens"], ["emb"], name="/embed/Gather", axis=0))
    n.append(N("Add", ["emb", "pos.weight"], ["h0"], name="/pos/Add"))
    for p in ["q", "k", "v", "o"]:
        inits += [init(f"attn.{p}.weight", [d, d]), init(f"attn.{p}.bias", [d], 0.01)]
    inits += [const("heads_shape", [0, 0, heads, dh]), const("merge_shape", [0, 0, d])]
    for p in ["q", "k", "v"]:
        n.append(N("MatMul", ["h0", f"attn.{p}.weight"], [f"{p}_mm"], name=f"/attn/{p}/MatMul"))
        n.append(N("Add", [f"{p}_mm", f"attn.{p}.bias"], [f"{p}_lin"], name=f"/attn/{p}/Add"))
        n.append(N("Reshape", [f"{p}_lin", "heads_shape"], [f"{p}_heads"], name=f"/attn/{p}/Reshape"))
        perm = [0, 2, 3, 1] if p == "k" else [0, 2, 1, 3]
        n.append(N("Transpose", [f"{p}_heads"], [f"{p}_t"], name=f"/attn/{p}/Transpose", perm=perm))
    mask = np.triu(np.full((seq, seq), -1e9, dtype=np.float32), k=1)
    inits += [numpy_helper.from_array(np.array(1 / np.sqrt(dh), dtype=np.float32), "attn.scale"),
              numpy_helper.from_array(mask, "attn.causal_mask")]
    n.append(N("MatMul", ["q_t", "k_t"], ["scores"], name="/attn/scores/MatMul"))
    n.append(N("Mul", ["scores", "attn.scale"], ["scaled"], name="/attn/scale/Mul"))
    n.append(N("Add", ["scaled", "attn.causal_mask"], ["masked"], name="/attn/mask/Add"))
    n.append(N("Softmax", ["masked"], ["probs"], name="/attn/Softmax", axis=-1))
    n.append(N("MatMul", ["probs", "v_t"], ["ctx"], name="/attn/ctx/MatMul"))
    n.append(N("Transpose", ["ctx"], ["ctx_t"], name="/attn/ctx/Transpose", perm=[0, 2, 1, 3]))
    n.append(N("Reshape", ["ctx_t", "merge_shape"], ["ctx_m"], name="/attn/ctx/Reshape"))
    n.append(N("MatMul", ["ctx_m", "attn.o.weight"], ["o_mm"], name="/attn/o/MatMul"))
    n.append(N("Add", ["o_mm", "attn.o.bias"], ["attn_out"], name="/attn/o/Add"))
    n.append(N("Add", ["h0", "attn_out"], ["res1"], name="/res1/Add"))
    inits += [numpy_helper.from_array(np.ones(d, np.float32), "ln1.weight"),
              numpy_helper.from_array(np.zeros(d, np.float32), "ln1.bias"),
              numpy_helper.from_array(np.ones(d, np.float32), "ln2.weight"),
              numpy_helper.from_array(np.zeros(d, np.float32), "ln2.bias")]
    n.append(N("LayerNormalization", ["res1", "ln1.weight", "ln1.bias"], ["ln1"], name="/ln1/LayerNormalization",
               axis=-1, epsilon=1e-5))
    inits += [init("ff1.weight", [d, ff]), init("ff1.bias", [ff], 0.01),
              init("ff2.weight", [ff, d]), init("ff2.bias", [d], 0.01),
              numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "gelu.sqrt2"),
              numpy_helper.from_array(np.array(1.0, np.float32), "gelu.one"),
              numpy_helper.from_array(np.array(0.5, np.float32), "gelu.half")]
    n.append(N("MatMul", ["ln1", "ff1.weight"], ["ff1_mm"], name="/ff1/MatMul"))
    n.append(N("Add", ["ff1_mm", "ff1.bias"], ["ff1"], name="/ff1/Add"))
    n.append(N("Div", ["ff1", "gelu.sqrt2"], ["g_div"], name="/gelu/Div"))
    n.append(N("Erf", ["g_div"], ["g_erf"], name="/gelu/Erf"))
    n.append(N("Add", ["g_erf", "gelu.one"], ["g_add"], name="/gelu/Add"))
    n.append(N("Mul", ["ff1", "g_add"], ["g_mul"], name="/gelu/Mul"))
    n.append(N("Mul", ["g_mul", "gelu.half"], ["gelu"], name="/gelu/Mul_1"))
    n.append(N("MatMul", ["gelu", "ff2.weight"], ["ff2_mm"], name="/ff2/MatMul"))
    n.append(N("Add", ["ff2_mm", "ff2.bias"], ["ff2"], name="/ff2/Add"))
    n.append(N("Add", ["ln1", "ff2"], ["res2"], name="/res2/Add"))
    n.append(N("LayerNormalization", ["res2", "ln2.weight", "ln2.bias"], ["y"], name="/ln2/LayerNormalization",
               axis=-1, epsilon=1e-5))
    g = helper.make_graph(
        n, "transformer",
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, d])],
        inits)
    ranges["transformer"] = {"tokens": [0, vocab]}
    save("transformer", g, 17)


def opset9():
    """Opset-9 forms: ConstantOfShape weights, attribute-form Unsqueeze/Squeeze/ReduceMean/Slice/Clip,
    Softmax's 2-D coercion with axis=1, Upsample with a scales input, Dropout with a ratio attribute."""
    N = helper.make_node
    shape_w = const("w_shape", [3, 4])
    n = [
        N("ConstantOfShape", ["w_shape"], ["w"], name="w_fill",
          value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.5])),
        N("MatMul", ["x", "w"], ["h"], name="matmul"),
        N("Unsqueeze", ["h"], ["u"], name="unsqueeze", axes=[0]),
        N("Slice", ["h"], ["s"], name="slice", starts=[1], ends=[3], axes=[1]),
        N("Clip", ["s"], ["c"], name="clip", min=-1.0, max=1.0),
        N("Softmax", ["c"], ["probs"], name="softmax", axis=1),
        N("ReduceMean", ["u"], ["r"], name="reduce", axes=[2], keepdims=0),
        N("Squeeze", ["r"], ["q"], name="squeeze", axes=[0]),
        N("Dropout", ["q"], ["dq"], name="dropout", ratio=0.25),
        N("Upsample", ["img", "scales"], ["up"], name="upsample", mode="nearest"),
    ]
    inits = [shape_w, numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    g = helper.make_graph(
        n, "opset9",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [2, 2]),
         helper.make_tensor_value_info("dq", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("up", TensorProto.FLOAT, [1, 1, 4, 4])],
        inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)], producer_name="mpc-fixtures")
    model.ir_version = 4
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, os.path.join(HERE, "opset9.onnx"))


def custom_op():
    """A model with an op from a custom domain (com.microsoft::Gelu, which onnxruntime implements)."""
    N = helper.make_node
    inits = [init("w1", [16, 32]), init("w2", [32, 8])]
    n = [
        N("MatMul", ["x", "w1"], ["h"], name="/fc1/MatMul"),
        N("Gelu", ["h"], ["g"], name="/act/Gelu", domain="com.microsoft"),
        N("MatMul", ["g", "w2"], ["y"], name="/fc2/MatMul"),
    ]
    g = helper.make_graph(
        n, "custom_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        inits, value_info=[helper.make_tensor_value_info("g", TensorProto.FLOAT, ["batch", 32])])
    save("custom_op", g, 17, extra_opsets=[("com.microsoft", 1)])


def control_flow():
    """An If whose branches read a main-graph initializer (`scale`) from the outer scope: opaque to
    mpc, which must keep `scale` alive and the node's outer-scope reads in order."""
    N = helper.make_node
    then_g = helper.make_graph([N("Mul", ["h", "scale"], ["t_out"], name="then_mul")], "then", [],
                               [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, ["batch", 4])])
    else_g = helper.make_graph([N("Sub", ["h", "scale"], ["e_out"], name="else_sub")], "else", [],
                               [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, ["batch", 4])])
    inits = [init("w", [4, 4]), numpy_helper.from_array(np.array([2.0], np.float32), "scale")]
    n = [
        N("MatMul", ["x", "w"], ["h"], name="matmul"),
        N("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
    ]
    g = helper.make_graph(
        n, "control_flow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits)
    save("control_flow", g, 17)


def digits_mlp():
    """The README's demo: an MLP 64-256-256-10 for the digits data (input `images`, as the data
    file names it), initialised as torch.nn.Linear is: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    def uniform(name, shape, fan_in, is_bias):
        bound = 1.0 / np.sqrt(fan_in)
        return numpy_helper.from_array(rng.uniform(-bound, bound, shape).astype(np.float32), name)

    nodes, inits = mlp_nodes("images", uniform)
    g = helper.make_graph(
        nodes, "digits_mlp",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        inits)
    save("digits_mlp", g, 17)


def indexing():
    """The index ops with their attributes: GatherND with batch_dims (the dynamo exporter's
    attention masks), ScatterND adding into a duplicate index, ScatterElements taking the max along
    axis 1, negative indices among them; a MatMul after them gives the mixed policy a low op. Its
    values do not draw from `rng`, so that it is the same whether made alone or with the rest."""
    N = helper.make_node
    inits = [
        const("gather_idx", [[[1], [3], [-1]], [[0], [2], [-4]]]),
        const("scatter_nd_idx", [[0, 1], [0, 1], [1, -1]]),
        const("scatter_nd_upd", np.linspace(-1, 1, 18).reshape(3, 6), np.float32),
        const("scatter_el_idx", [[[0, 1, 2, -1, -2, -3]], [[2, 2, 0, 0, 1, 1]]]),
        const("scatter_el_upd", np.linspace(2, -2, 12).reshape(2, 1, 6), np.float32),
        const("w", 0.4 * np.cos(np.arange(30)).reshape(6, 5), np.float32),
    ]
    n = [
        N("GatherND", ["x", "gather_idx"], ["rows"], name="/mask/GatherND", batch_dims=1),
        N("ScatterND", ["rows", "scatter_nd_idx", "scatter_nd_upd"], ["added"], name="/ScatterND", reduction="add"),
        N("ScatterElements", ["added", "scatter_el_idx", "scatter_el_upd"], ["maxed"], name="/ScatterElements",
          axis=1, reduction="max"),
        N("MatMul", ["maxed", "w"], ["y"], name="/proj/MatMul"),
    ]
    g = helper.make_graph(
        n, "indexing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5])],
        inits)
    save("indexing", g, 18)


if __name__ == "__main__":
    for make in [mlp, mlp_loss, cnn_bn, resblock, transformer, opset9, custom_op, control_flow, digits_mlp, indexing]:
        make()
    with open(os.path.join(HERE, "fixtures.json"), "w") as f:
        json.dump({"int_input_ranges": ranges}, f, indent=2, sort_keys=True)
        f.write("\n")
    print("wrote", ", ".join(sorted(p for p in os.listdir(HERE) if p.endswith(".onnx"))))
