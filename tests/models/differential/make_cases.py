#!/usr/bin/env python3
"""Wrong answers that differential testing against onnxruntime found, one case per class, in the
layout of the ONNX backend node tests:

    NAME/model.onnx
    NAME/test_data_set_0/input_J.pb, output_J.pb

The expected outputs are onnxruntime's (CPU, graph optimisations off), except where a case says
its oracle is numpy in float64 (the LayerNormalization precision cases: onnxruntime itself is
within 3e-5 there, the exact answer within 1e-7). The campaign of fuzz/differential writes the
cases it minimises in the same layout beside these. `cargo test --test runtime_conformance
differential` runs them all (tests/runtime_conformance.rs); `tests/interop/check_onnx.py
conformance tests/models/differential` compiles each with every policy and checks what mpc writes.

    python3 tests/models/differential/make_cases.py   # needs numpy, onnx, onnxruntime
"""

import os
import shutil

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

HERE = os.path.dirname(os.path.abspath(__file__))
NP = {np.float32: T.FLOAT, np.int64: T.INT64, np.longlong: T.INT64, np.float64: T.DOUBLE, np.float16: T.FLOAT16}


def model(nodes, inputs, outputs, inits=(), opset=18, results=None):
    """inputs: [(name, array)]; outputs: names, typed from `results` (arrays) when given. The
    inputs' shapes and dtypes come from their data."""
    ins = [h.make_tensor_value_info(n, NP[a.dtype.type], list(a.shape)) for n, a in inputs]
    if results is None:
        outs = [h.make_empty_tensor_value_info(n) for n in outputs]
    else:
        outs = [h.make_tensor_value_info(n, NP[r.dtype.type], list(r.shape)) for n, r in zip(outputs, results)]
    g = h.make_graph(nodes, "case", ins, outs, initializer=[nh.from_array(a, n) for n, a in inits])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8 if opset <= 18 else 9
    if results is not None:
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True)
        onnx.checker.check_model(m, full_check=True)
    return m


def onnxruntime(m, inputs):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, dict(inputs))


def write(name, m, inputs, outputs):
    folder = os.path.join(HERE, name)
    data = os.path.join(folder, "test_data_set_0")
    os.makedirs(data)
    onnx.save(m, os.path.join(folder, "model.onnx"))
    for kind, values in (("input", [a for _, a in inputs]), ("output", outputs)):
        for j, a in enumerate(values):
            with open(os.path.join(data, f"{kind}_{j}.pb"), "wb") as f:
                f.write(nh.from_array(np.asarray(a)).SerializeToString())


def case(name, nodes, inputs, outputs, inits=(), opset=18, oracle=None, symbolic=None):
    """symbolic: {input: [dim names]}, the input declared with those dims instead of its data's."""
    first = model(nodes, inputs, outputs, inits, opset)
    want = oracle(*[a for _, a in inputs]) if oracle else onnxruntime(first, inputs)
    m = model(nodes, inputs, outputs, inits, opset, want)
    for vi in m.graph.input:
        for d, name in zip(vi.type.tensor_type.shape.dim, (symbolic or {}).get(vi.name, [])):
            d.dim_param = name
    write(name, m, inputs, want)


def reductions(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    empty = np.zeros((0,), np.int64)
    # noop_with_empty_axes=1: nothing reduced, but |x|, sqrt(x²) and x² still applied.
    for op in ["ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ReduceMax", "ReduceProd"]:
        case(f"{op.lower()}_noop_without_axes", [h.make_node(op, ["x"], ["y"], noop_with_empty_axes=1)],
             [("x", x)], ["y"])
        case(f"{op.lower()}_noop_with_empty_axes", [h.make_node(op, ["x", "axes"], ["y"], noop_with_empty_axes=1, keepdims=0)],
             [("x", x)], ["y"], inits=[("axes", empty)])


def slices(rng):
    x = np.arange(10, dtype=np.float32)
    big = np.iinfo(np.int64)
    # A negative step from a start before the first element: the first element alone.
    for name, s, e, st in [("slice_negative_step_start_below_dim", -15, big.min, -1),
                           ("slice_negative_step_start_and_end_below_dim", -15, -20, -2),
                           ("slice_negative_step_start_past_end", 25, -20, -3)]:
        case(name, [h.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])], [("x", x)], ["y"],
             inits=[("s", np.array([s])), ("e", np.array([e])), ("a", np.array([0])), ("st", np.array([st]))])
    x2 = rng.standard_normal((4, 5)).astype(np.float32)
    case("slice_negative_steps_two_axes", [h.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])], [("x", x2)], ["y"],
         inits=[("s", np.array([-9, 7])), ("e", np.array([big.min, -9])), ("a", np.array([1, 0])), ("st", np.array([-2, -1]))])


def norm_reference(x, scale, bias, axes, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * scale + bias).astype(np.float32)


def norms(rng):
    # BERT's epsilon over a constant row of 768: the output is the bias.
    x = np.stack([np.full(768, 0.3), np.full(768, -1234.5), np.full(768, 7.0)]).astype(np.float32)
    s = (1 + 0.1 * rng.standard_normal(768)).astype(np.float32)
    b = rng.standard_normal(768).astype(np.float32)
    ln = lambda eps: (lambda x, *_: [norm_reference(x, s, b, -1, eps)])
    case("layer_norm_constant_rows_bert_epsilon",
         [h.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-12)],
         [("x", x)], ["y"], inits=[("s", s), ("b", b)], opset=17, oracle=ln(1e-12))
    # A large mean and a small spread.
    x = (1000 + 0.01 * rng.standard_normal((4, 768))).astype(np.float32)
    case("layer_norm_large_mean_small_spread",
         [h.make_node("LayerNormalization", ["x", "s", "b"], ["y"], axis=-1, epsilon=1e-12)],
         [("x", x)], ["y"], inits=[("s", s), ("b", b)], opset=17, oracle=ln(1e-12))
    # The same rows through the other normalisations of one shared statistics routine.
    x = (500 + 0.01 * rng.standard_normal((2, 4, 96))).astype(np.float32)
    x[1, 2] = 3.25
    sc, bc = np.array([1.0, 0.5, 2.0, 1.5], np.float32), np.array([0.1, -0.2, 0.3, 0.0], np.float32)
    inst = lambda x: [norm_reference(x, sc[:, None], bc[:, None], -1, 1e-12)]
    case("instance_norm_large_mean_small_spread",
         [h.make_node("InstanceNormalization", ["x", "s", "b"], ["y"], epsilon=1e-12)],
         [("x", x)], ["y"], inits=[("s", sc), ("b", bc)], opset=17, oracle=inst)

    def group(x):
        g = x.reshape(2, 2, 2 * 96)
        mean = g.astype(np.float64).mean(-1, keepdims=True)
        var = ((g - mean) ** 2).mean(-1, keepdims=True)
        y = ((g - mean) / np.sqrt(var + 1e-12)).reshape(2, 4, 96) * sc[:, None] + bc[:, None]
        return [y.astype(np.float32)]
    case("group_norm_large_mean_small_spread",
         [h.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=2, epsilon=1e-12)],
         [("x", x)], ["y"], inits=[("s", sc), ("b", bc)], opset=21, oracle=group)


def conv_transposes(rng):
    x = np.arange(1, 4, dtype=np.float32).reshape(1, 1, 3)
    for pad in ["SAME_UPPER", "SAME_LOWER"]:
        for k, stride in [(1, 3), (2, 3), (5, 2)]:
            w = rng.standard_normal((1, 2, k)).astype(np.float32)
            case(f"conv_transpose_{pad.lower()}_kernel_{k}_stride_{stride}",
                 [h.make_node("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[k], strides=[stride], auto_pad=pad)],
                 [("x", x)], ["y"], inits=[("w", w)])


def clips(rng):
    x = np.array([np.nan, -2.0, 0.5, np.inf, -np.inf, 3.0, np.nan], np.float32)
    lo, hi = np.array(-1.0, np.float32), np.array(1.0, np.float32)
    case("clip_nan_both_bounds", [h.make_node("Clip", ["x", "lo", "hi"], ["y"])], [("x", x)], ["y"], inits=[("lo", lo), ("hi", hi)])
    case("clip_nan_max_only", [h.make_node("Clip", ["x", "", "hi"], ["y"])], [("x", x)], ["y"], inits=[("hi", hi)])
    case("clip_nan_min_only", [h.make_node("Clip", ["x", "lo"], ["y"])], [("x", x)], ["y"], inits=[("lo", lo)])
    case("clip_nan_no_bounds", [h.make_node("Clip", ["x"], ["y"])], [("x", x)], ["y"])


def opset_raise(rng):
    # An opset-17 graph whose Split is equal (no `split`): written at opset 18 it must say
    # num_outputs (a Gelu raises the written opset to 20).
    x = rng.standard_normal((2, 6)).astype(np.float32)
    case("split_equal_opset_17_written_later",
         [h.make_node("Split", ["x"], ["a", "b"], axis=1),
          h.make_node("ReduceMean", ["a"], ["m"], axes=[1], keepdims=1),
          h.make_node("Mul", ["b", "m"], ["y0"]),
          h.make_node("Erf", ["y0"], ["y"])],
         [("x", x)], ["y"], opset=17)


def found_by_the_campaign(rng):
    # Infinite maxima in ReduceLogSumExp: +inf gives inf, a row of -inf gives -inf (not NaN).
    x = np.array([[np.inf, 1.0, 2.0], [-np.inf, -np.inf, -np.inf], [0.5, np.inf, -np.inf]], np.float32)
    case("reducelogsumexp_infinite_maxima", [h.make_node("ReduceLogSumExp", ["x", "axes"], ["y"], keepdims=0)],
         [("x", x)], ["y"], inits=[("axes", np.array([1]))])
    # MaxPool's Indices of a window of -inf: its first element (onnxruntime gives that index, and
    # -FLT_MAX for the value, which the spec does not: the values here are numpy's).
    x = np.full((1, 1, 2, 4), -np.inf, np.float32)
    x[0, 0, 1, 2] = 3.0

    def pooled(x):
        v = x.reshape(2, 2, 2).max(axis=-1).reshape(1, 1, 2, 2)
        idx = np.array([0, 2, 4, 6], np.int64).reshape(1, 1, 2, 2)
        idx[0, 0, 1, 1] = 6
        return [v, idx]
    case("maxpool_indices_of_a_window_of_minus_infinity",
         [h.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[1, 2], strides=[1, 2])],
         [("x", x)], ["y", "i"], oracle=pooled)
    # A Slice whose starts, ends, axes and steps are graph inputs runs (it was refused, with no reason).
    x = rng.standard_normal((4, 6)).astype(np.float32)
    case("slice_of_bounds_given_as_inputs", [h.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])],
         [("x", x), ("s", np.array([5, 3])), ("e", np.array([-7, 0])), ("a", np.array([1, 0])), ("st", np.array([-2, -1]))],
         ["y"])
    # Flatten of an empty tensor folded from constants: [0, 1], not [0, 0].
    case("flatten_of_an_empty_folded_range",
         [h.make_node("Range", ["a", "b", "d"], ["r"]), h.make_node("Flatten", ["r"], ["y"])],
         [("b", np.array(-1.0, np.float32))], ["y"],
         inits=[("a", np.array(2.0, np.float32)), ("d", np.array(0.75, np.float32))], opset=17)


def refused_forms(rng):
    # Forms mpc refused that users export (issue: the ops users export that mpc refuses).
    # Einsum with an ellipsis: batched products, a batch diagonal, broadcasting against a 1.
    a, b = rng.standard_normal((2, 3, 4, 5)).astype(np.float32), rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    case("einsum_ellipsis_batch_matmul", [h.make_node("Einsum", ["a", "b"], ["y"], equation="...ij,...jk->...ik")],
         [("a", a), ("b", b)], ["y"])
    d = rng.standard_normal((2, 3, 3)).astype(np.float32)
    case("einsum_ellipsis_batch_diagonal", [h.make_node("Einsum", ["d"], ["y"], equation="...ii->...i")],
         [("d", d)], ["y"])
    p, q = rng.standard_normal((1, 4, 3, 5)).astype(np.float32), rng.standard_normal((2, 1, 5)).astype(np.float32)
    case("einsum_ellipsis_implicit_broadcast", [h.make_node("Einsum", ["p", "q"], ["y"], equation="...ij,...j")],
         [("p", p), ("q", q)], ["y"])
    # Pools whose window is past the padded input: one window of what there is, or none.
    x = rng.standard_normal((1, 2, 4)).astype(np.float32)
    case("maxpool_window_past_the_input", [h.make_node("MaxPool", ["x"], ["y"], kernel_shape=[5], strides=[2])],
         [("x", x)], ["y"])
    case("averagepool_window_past_the_input_ceil",
         [h.make_node("AveragePool", ["x"], ["y"], kernel_shape=[6], strides=[3], pads=[1, 0], ceil_mode=1)],
         [("x", x)], ["y"])
    case("averagepool_window_past_the_input_empty", [h.make_node("AveragePool", ["x"], ["y"], kernel_shape=[5])],
         [("x", x)], ["y"])
    # The trigonometric and hyperbolic ops, and Celu, over their domains (and NaN beyond them).
    wide = rng.uniform(-3, 3, (3, 4)).astype(np.float32)
    unit = rng.uniform(-1.2, 1.2, (3, 4)).astype(np.float32)
    above = rng.uniform(0.5, 4, (3, 4)).astype(np.float32)
    huge = np.array([1.0, 2.0, 1e10, 3e19, 1.8e38, np.float32(3.4028235e38)], np.float32)  # acosh past x*x's range
    for op, x in [("Tan", rng.uniform(-1.4, 1.4, (3, 4)).astype(np.float32)), ("Sinh", wide), ("Cosh", wide),
                  ("Asin", unit), ("Acos", unit), ("Atan", wide), ("Asinh", np.concatenate([wide.ravel(), huge])),
                  ("Acosh", np.concatenate([above.ravel(), huge])), ("Atanh", unit)]:
        case(op.lower(), [h.make_node(op, ["x"], ["y"])], [("x", x)], ["y"])
    case("celu", [h.make_node("Celu", ["x"], ["y"], alpha=0.5)], [("x", wide)], ["y"])
    # Pixel shuffle both ways, both DepthToSpace modes.
    x = rng.standard_normal((2, 8, 3, 2)).astype(np.float32)
    for mode in ("DCR", "CRD"):
        case(f"depthtospace_{mode.lower()}", [h.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode=mode)],
             [("x", x)], ["y"])
    x = rng.standard_normal((2, 3, 4, 6)).astype(np.float32)
    case("spacetodepth", [h.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)], [("x", x)], ["y"])
    empty = np.zeros((1, 4, 0, 2), np.float32)  # a computed dim of 0 is a size, not Reshape's "copy"
    case("depthtospace_empty_height", [h.make_node("DepthToSpace", ["x"], ["y"], blocksize=2)], [("x", empty)], ["y"])
    # OneHot: negative indices counted from depth, out of range ones all off; along axis 1.
    idx = np.array([[0, 3, -1], [-4, 4, -5]], np.int64)
    case("onehot_negative_and_out_of_range", [h.make_node("OneHot", ["i", "d", "v"], ["y"])],
         [("i", idx)], ["y"], inits=[("d", np.array(4, np.int64)), ("v", np.array([0.5, 2.0], np.float32))])
    # TopK: ties in index order, both directions, along an inner axis, integers; k as the opset-9
    # attribute. (No NaN here: onnxruntime orders it its own way; mpc puts it first, as torch.)
    x = np.array([[3, 1, 3, 2, 5], [0, 0, -1, 4, 4], [2, 2, 2, 2, 2]], np.float32)
    for largest in (1, 0):
        case(f"topk_ties_largest_{largest}", [h.make_node("TopK", ["x", "k"], ["v", "i"], largest=largest)],
             [("x", x)], ["v", "i"], inits=[("k", np.array([3], np.int64))])
    x3 = rng.standard_normal((2, 5, 3)).astype(np.float32)
    case("topk_middle_axis", [h.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)], [("x", x3)], ["v", "i"],
         inits=[("k", np.array([2], np.int64))])
    xi = rng.integers(-50, 50, (3, 6)).astype(np.int64)
    case("topk_int64", [h.make_node("TopK", ["x", "k"], ["v", "i"])], [("x", xi)], ["v", "i"],
         inits=[("k", np.array([4], np.int64))])
    case("topk_opset_9_attribute", [h.make_node("TopK", ["x"], ["v", "i"], k=2)], [("x", x3)], ["v", "i"], opset=9)
    # Resize: cubic (coordinate modes, cubic_coeff_a, exclude_outside), antialiased downsampling
    # (linear, cubic), and the aspect-ratio policies.
    img = rng.standard_normal((1, 2, 6, 7)).astype(np.float32)
    for name, attrs, scales, sizes, axes in [
            ("resize_cubic_half_pixel", dict(mode="cubic"), [1, 1, 2, 1.5], None, None),
            ("resize_cubic_align_corners", dict(mode="cubic", coordinate_transformation_mode="align_corners"),
             [1, 1, 0.5, 2], None, None),
            ("resize_cubic_asymmetric_a_half", dict(mode="cubic", coordinate_transformation_mode="asymmetric",
                                                    cubic_coeff_a=-0.5), [1, 1, 1.7, 0.6], None, None),
            ("resize_cubic_exclude_outside", dict(mode="cubic", exclude_outside=1), [1, 1, 2, 1.5], None, None),
            ("resize_cubic_pytorch_sizes", dict(mode="cubic", coordinate_transformation_mode="pytorch_half_pixel"),
             None, [1, 2, 3, 9], None),
            ("resize_linear_antialias", dict(mode="linear", antialias=1), [1, 1, 0.5, 0.6], None, None),
            ("resize_cubic_antialias", dict(mode="cubic", antialias=1), [1, 1, 0.5, 0.4], None, None),
            ("resize_linear_antialias_up_and_down", dict(mode="linear", antialias=1), [1, 1, 1.5, 0.3], None, None),
            ("resize_keep_aspect_not_larger", dict(mode="linear", keep_aspect_ratio_policy="not_larger"),
             None, [4, 4], [2, 3]),
            ("resize_keep_aspect_not_smaller", dict(mode="nearest", keep_aspect_ratio_policy="not_smaller"),
             None, [4, 4], [2, 3])]:
        ins = ["x", "", "s" if scales else ""] + (["z"] if sizes else [])
        inits = ([("s", np.array(scales, np.float32))] if scales else []) + \
                ([("z", np.array(sizes, np.int64))] if sizes else [])
        if axes:
            attrs = dict(attrs, axes=axes)
        case(name, [h.make_node("Resize", ins, ["y"], **attrs)], [("x", img)], ["y"], inits=inits, opset=19)
    # Reflect padding past the axis reflects again (numpy, the reference evaluator; onnxruntime
    # refuses it): the oracle is numpy.
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    case("pad_reflect_past_the_axis", [h.make_node("Pad", ["x", "p"], ["y"], mode="reflect")], [("x", x)], ["y"],
         inits=[("p", np.array([0, 4, 1, 5], np.int64))],
         oracle=lambda x: [np.pad(x, [(0, 1), (4, 5)], mode="reflect")])
    # A Conv whose bias is a graph input of symbolic length: checked once the data binds it.
    x, w = rng.standard_normal((1, 2, 5)).astype(np.float32), rng.standard_normal((3, 2, 2)).astype(np.float32)
    case("conv_bias_of_symbolic_length", [h.make_node("Conv", ["x", "w", "b"], ["y"])],
         [("x", x), ("b", np.array([0.5, -1.0, 2.0], np.float32))], ["y"], inits=[("w", w)], symbolic={"b": ["c"]})
    fidx = np.array([[1.0, 0.0], [2.0, 2.0]], np.float32)
    case("onehot_float_indices_axis_1", [h.make_node("OneHot", ["i", "d", "v"], ["y"], axis=1)],
         [("i", fidx)], ["y"], inits=[("d", np.array([3.0], np.float32)), ("v", np.array([-1.0, 7.0], np.float32))])


def composites(rng):
    """The standard ops mpc writes out as the ops they are made of (passes/src/composite)."""
    x = np.concatenate([rng.standard_normal((3, 5)), [[0.5, -0.5, 1.0, 0.0, -2.0]]]).astype(np.float32)
    case("thresholdedrelu", [h.make_node("ThresholdedRelu", ["x"], ["y"], alpha=0.5)], [("x", x)], ["y"], opset=22)
    case("shrink_soft", [h.make_node("Shrink", ["x"], ["y"], lambd=0.5, bias=0.5)], [("x", x)], ["y"], opset=9)
    case("shrink_hard", [h.make_node("Shrink", ["x"], ["y"])], [("x", x)], ["y"])
    ties = np.array([[1, 3, 3, 2], [0, 0, 0, 0], [-1, -5, -1, 7]], np.float32)
    x3 = rng.standard_normal((2, 3, 4)).astype(np.float32)
    case("hardmax_ties", [h.make_node("Hardmax", ["x"], ["y"])], [("x", ties)], ["y"], opset=13)
    case("hardmax_middle_axis", [h.make_node("Hardmax", ["x"], ["y"], axis=1)], [("x", x3)], ["y"], opset=13)
    case("hardmax_opset_11_flattened", [h.make_node("Hardmax", ["x"], ["y"], axis=1)], [("x", x3)], ["y"], opset=11)
    rows = np.concatenate([x3.reshape(6, 4), np.zeros((1, 4), np.float32)])
    for p in (1, 2):
        case(f"lpnormalization_p{p}_zero_row", [h.make_node("LpNormalization", ["x"], ["y"], p=p)],
             [("x", rows)], ["y"], opset=22)
    case("lpnormalization_axis_0", [h.make_node("LpNormalization", ["x"], ["y"], axis=0)], [("x", x3)], ["y"])
    img = rng.standard_normal((1, 2, 5, 6)).astype(np.float32)
    for name, attrs in [("lppool_p2", dict(kernel_shape=[2, 2])),
                        ("lppool_p1_pads_strides", dict(kernel_shape=[3, 2], strides=[2, 2], pads=[1, 0, 1, 1], p=1)),
                        ("lppool_p3_same_upper", dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER", p=3)),
                        ("lppool_ceil_mode", dict(kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1)),
                        ("lppool_dilations", dict(kernel_shape=[2, 2], dilations=[2, 2]))]:
        case(name, [h.make_node("LpPool", ["x"], ["y"], **attrs)], [("x", img)], ["y"], opset=18)
    short = np.arange(16, dtype=np.float32).reshape(2, 4, 2)  # a window of 3 over 2: no output
    case("lppool_window_past_the_input_empty", [h.make_node("LpPool", ["x"], ["y"], kernel_shape=[2], dilations=[2])],
         [("x", short)], ["y"], opset=18)
    case("hardmax_empty_axis", [h.make_node("Hardmax", ["x"], ["y"])], [("x", np.zeros((3, 0), np.float32))], ["y"],
         opset=13)
    for p in (1, 2, 3):
        case(f"globallppool_p{p}", [h.make_node("GlobalLpPool", ["x"], ["y"], p=p)], [("x", img)], ["y"])
    big = (rng.standard_normal((2, 3, 4, 4)) + 8).astype(np.float32)
    case("meanvariancenormalization", [h.make_node("MeanVarianceNormalization", ["x"], ["y"])], [("x", big)], ["y"],
         opset=9)  # onnx's checker fails on the opset-13 function body's Constant
    case("meanvariancenormalization_last_axes", [h.make_node("MeanVarianceNormalization", ["x"], ["y"], axes=[1, 2])],
         [("x", x3)], ["y"], opset=9)
    scale = rng.standard_normal((4,)).astype(np.float32)
    case("rmsnormalization", [h.make_node("RMSNormalization", ["x", "s"], ["y"])], [("x", x3)], ["y"],
         inits=[("s", scale)], opset=23)
    case("rmsnormalization_axis_1_f16", [h.make_node("RMSNormalization", ["x", "s"], ["y"], axis=1, epsilon=1e-3)],
         [("x", x3.astype(np.float16))], ["y"], inits=[("s", scale.astype(np.float16))], opset=23)
    case("eyelike_k_minus_1", [h.make_node("EyeLike", ["x"], ["y"], k=-1)], [("x", x)], ["y"])
    case("eyelike_int64_k_2", [h.make_node("EyeLike", ["x"], ["y"], k=2, dtype=T.INT64)], [("x", x)], ["y"])
    seq = rng.standard_normal((4, 3, 2)).astype(np.float32)
    case("reversesequence_time_major", [h.make_node("ReverseSequence", ["x", "l"], ["y"])], [("x", seq)], ["y"],
         inits=[("l", np.array([4, 2, 1], np.int64))])
    case("reversesequence_batch_major", [h.make_node("ReverseSequence", ["x", "l"], ["y"], time_axis=1, batch_axis=0)],
         [("x", seq)], ["y"], inits=[("l", np.array([3, 0, 1, 2], np.int64))])


def crops(rng):
    # Resize tf_crop_and_resize: a region of interest inside the input on one axis and past it on
    # the other (the extrapolation value there; one output lands on the input's first element
    # by float32 rounding as onnxruntime computes it), each mode; on two named axes.
    x = np.arange(1, 13, dtype=np.float32).reshape(1, 1, 3, 4)
    roi = np.array([0, 0, 0.2, -0.3, 1, 1, 0.9, 1.2], np.float32)
    crop = dict(coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-7.0)
    for mode in ("nearest", "linear", "cubic"):
        case(f"resize_tf_crop_and_resize_{mode}", [h.make_node("Resize", ["x", "r", "s"], ["y"], mode=mode, **crop)],
             [("x", x)], ["y"], inits=[("r", roi), ("s", np.array([1, 1, 2, 1.5], np.float32))], opset=19)
    case("resize_tf_crop_and_resize_axes_sizes",
         [h.make_node("Resize", ["x", "r", "", "z"], ["y"], mode="linear", axes=[3, 2], **crop)],
         [("x", x)], ["y"], inits=[("r", np.array([0.25, -0.5, 0.75, 0.5], np.float32)),
                                   ("z", np.array([5, 1], np.int64))], opset=19)



def grid_samples(rng):
    """GridSample (passes/src/composite/grid_sample.rs): grids reaching past the input, every mode
    and padding, both corner alignments; a 3-D volume."""
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    grid = rng.uniform(-1.6, 1.6, (2, 3, 6, 2)).astype(np.float32)
    grid[0, 0, :4] = [[-1, -1], [1, 1], [0.25, -0.75], [-0.6, 0.2]]  # corners, and nearest's halves
    for mode, padding, align in [("bilinear", "zeros", 0), ("bilinear", "border", 1), ("bilinear", "reflection", 0),
                                 ("nearest", "zeros", 0), ("nearest", "reflection", 1), ("nearest", "border", 0),
                                 ("bicubic", "zeros", 0), ("bicubic", "border", 0), ("bicubic", "reflection", 1),
                                 ("bilinear", "reflection", 1)]:
        case(f"gridsample_{mode}_{padding}_align_{align}",
             [h.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding, align_corners=align)],
             [("x", x), ("g", grid)], ["y"], opset=16)
    vol = rng.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    vgrid = rng.uniform(-1.3, 1.3, (1, 2, 3, 4, 3)).astype(np.float32)
    for mode, padding in [("linear", "zeros"), ("nearest", "reflection")]:
        case(f"gridsample_3d_{mode}_{padding}",
             [h.make_node("GridSample", ["x", "g"], ["y"], mode=mode, padding_mode=padding)],
             [("x", vol), ("g", vgrid)], ["y"], opset=20)


def main():
    for entry in os.listdir(HERE):
        if os.path.isdir(os.path.join(HERE, entry)):
            shutil.rmtree(os.path.join(HERE, entry))
    rng = np.random.default_rng(38)
    for make in (reductions, slices, norms, conv_transposes, clips, opset_raise, found_by_the_campaign,
                 refused_forms, composites, crops, grid_samples):
        make(rng)
    n = sum(os.path.isdir(os.path.join(HERE, e)) for e in os.listdir(HERE))
    print(f"{n} cases, onnx {onnx.__version__}, onnxruntime {ort.__version__}")


if __name__ == "__main__":
    main()
