"""Hand-written differential cases: graphs that pin an op's edges (dtypes, broadcasting, the
values where implementations differ), written as reproducers under tests/models/differential
with onnxruntime's outputs as the expected ones (the same layout as minimize.write_repro).

    python3 fuzz/differential/hand_cases.py [NAME ...]   # all cases, or the named ones
"""

import os
import sys

import numpy as np
import onnx
from onnx import helper as h
from onnx import numpy_helper as nh

from gen import NP2ONNX, ir_version
from harness import OracleError, oracle_run

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "models", "differential")
ONNX_OF = {**NP2ONNX, **{np.dtype(t): getattr(onnx.TensorProto, t.upper())
                         for t in ("uint16", "uint32", "uint64", "int16")}}


def one_node(op, feeds, opset, out_dtype=None, out_shape=None, consts=None, **attrs):
    """A model of one `op` node over `feeds` (graph inputs) and `consts` (initializers); the
    output's shape is the feeds' broadcast unless `out_shape` says otherwise."""
    consts = consts or {}
    names = list(feeds) + list(consts)
    first = np.asarray(next(iter(feeds.values())))
    out = onnx.TensorProto.UNDEFINED if out_dtype is None else ONNX_OF[np.dtype(out_dtype)]
    out = out or ONNX_OF[first.dtype]
    graph = h.make_graph(
        [h.make_node(op, names, ["y"], **attrs)], op.lower(),
        [h.make_tensor_value_info(k, ONNX_OF[np.asarray(v).dtype], np.asarray(v).shape) for k, v in feeds.items()],
        [h.make_tensor_value_info("y", out, out_shape or np.broadcast_shapes(*(np.shape(v) for v in feeds.values())))],
        initializer=[nh.from_array(np.asarray(v), k) for k, v in consts.items()])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=ir_version(opset))
    onnx.checker.check_model(model, full_check=True)
    return model


def edges(dt):
    """Values at an integer dtype's edges: 0, ±1, its minimum and maximum, and a few between."""
    i = np.iinfo(dt)
    return np.array([0, 1, i.max, i.min, i.max // 3, 5, 12, i.min + 1 if i.min else 2], dtype=dt)


def bitwise_cases():
    cases = {}
    for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor"):
        for dt in ("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"):
            a = edges(dt).reshape(2, 4)
            b = np.roll(edges(dt), 3)[:4]  # broadcast over the rows
            cases[f"{op.lower()}_{dt}"] = (one_node(op, {"a": a, "b": b}, 18), {"a": a, "b": b})
    for dt in ("int64", "int32", "int8", "uint64", "uint16", "uint8"):
        x = edges(dt).reshape(2, 2, 2)
        cases[f"bitwisenot_{dt}"] = (one_node("BitwiseNot", {"x": x}, 18), {"x": x})
    for direction in ("LEFT", "RIGHT"):
        for dt in ("uint64", "uint32", "uint16", "uint8"):
            bits = np.iinfo(dt).bits
            x = edges(dt)
            # Shifts of 0, 1, the width less one, the width, past it, and past 64.
            s = np.array([0, 1, bits - 1, bits, bits + 1, 3, 64, 200 % (np.iinfo(dt).max + 1)], dtype=dt)
            cases[f"bitshift_{direction.lower()}_{dt}"] = (
                one_node("BitShift", {"x": x, "s": s}, 11, direction=direction), {"x": x, "s": s})
        # Opset 28's signed shifts: arithmetic to the right; negative amounts and amounts of the
        # width or more leave the sign's fill.
        for dt in ("int64", "int32", "int16", "int8"):
            bits = np.iinfo(dt).bits
            x = edges(dt)
            s = np.array([0, 1, bits - 1, bits, bits + 1, -1, 3, -100], dtype=dt)
            cases[f"bitshift_{direction.lower()}_{dt}"] = (
                one_node("BitShift", {"x": x, "s": s}, 28, direction=direction), {"x": x, "s": s})
        # A scalar shift broadcast over a matrix.
        x = edges("uint32").reshape(2, 4)
        s = np.array(4, np.uint32)
        cases[f"bitshift_{direction.lower()}_scalar"] = (
            one_node("BitShift", {"x": x, "s": s}, 11, direction=direction), {"x": x, "s": s})
    return cases


def cumulative_cases():
    """CumProd (opset 26) and CumSum: zeros and signs in float lines, every attribute pair, and
    integers that wrap (int64 sums and products past its range, uint32 and uint64)."""
    cases = {}
    x = np.array([[0.9, -0.7, 0.0, 1.2, -0.4, 3.0], [0.8, 2.0, -1.1, 0.6, 0.0, 0.7]], np.float32)
    axis = np.array(1, np.int64)
    for ex in (0, 1):
        for rev in (0, 1):
            cases[f"cumprod_f32_{ex}{rev}"] = (
                one_node("CumProd", {"x": x}, 26, consts={"axis": axis}, exclusive=ex, reverse=rev), {"x": x})
    big = np.array([2 ** 62, 3, -5, 2 ** 40, 7, -(2 ** 61)], np.int64)
    for op in ("CumProd", "CumSum"):
        opset = 26 if op == "CumProd" else 14
        cases[f"{op.lower()}_int64_wraps"] = (one_node(op, {"x": big}, opset, consts={"axis": np.array(0, np.int64)}),
                                             {"x": big})
        for dt in ("uint32", "uint64", "int32"):
            v = np.array([np.iinfo(dt).max, 3, 2, np.iinfo(dt).max // 5, 9, 1], dtype=dt).reshape(2, 3)
            cases[f"{op.lower()}_{dt}_wraps"] = (
                one_node(op, {"x": v}, opset, consts={"axis": np.array(-1, np.int64)}, reverse=1), {"x": v})
    return cases


def wide_composite_cases():
    """The FP16 composites whose sums overflow FP16 before their result does (computed in FP32,
    rounded once): |x|^3 of 48 is past 65504, and so is a sum of squares of 300. (The checker
    rejects an FP16 MeanVarianceNormalization: its function body's Pow is typed float.)"""
    x = np.array([[[48.25, -40.0], [3.0, 0.5]], [[-47.0, 1.0], [0.25, -2.0]]], np.float16)
    big = np.array([[300.0, -310.0, 5.0, 290.0], [-1.0, 2.0, 400.0, -420.0]], np.float16).reshape(1, 2, 2, 2)
    return {
        "globallppool_f16_cubes": (one_node("GlobalLpPool", {"x": x}, 18, out_shape=[2, 2, 1], p=3), {"x": x}),
        "lppool_f16_cubes": (one_node("LpPool", {"x": x}, 18, out_shape=[2, 2, 1], kernel_shape=[2], p=3),
                             {"x": x}),
        "lpnormalization_f16_squares": (one_node("LpNormalization", {"x": big}, 18, axis=1), {"x": big}),
    }


def lp_pool_pad_cases():
    """LpPool whose ceil_mode windows, dilated past the kernel, need more end padding than the
    kernel (2 with a kernel of 2 and a dilation of 2): the pool's zeros come from a Pad."""
    x = np.linspace(-3, 4, 2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    attrs = dict(kernel_shape=[2, 2], dilations=[2, 2], strides=[3, 1], ceil_mode=1, out_shape=[2, 3, 2, 2])
    return {f"lppool_dilated_ceil_p{p}": (one_node("LpPool", {"x": x}, 18, p=p, **attrs), {"x": x}) for p in (1, 2, 3)}


def roi_align_cases():
    """RoiAlign: rois inside, past the edges, malformed (x2 < x1) and smaller than a pixel; both
    modes; sampling_ratio 0 (adaptive) and 2; both coordinate modes and opset 10's; a scale."""
    rng = np.random.default_rng(16)
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    rois = np.array([[0.0, 0.0, 7.0, 5.0], [1.5, 0.5, 4.2, 3.9], [-2.0, 3.0, 9.5, 7.5],
                     [5.0, 4.0, 2.0, 1.0], [3.3, 2.2, 3.4, 2.3], [0.0, 0.0, 16.0, 12.0]], np.float32)
    batch = np.array([0, 1, 1, 0, 1, 0], np.int64)
    feeds = {"x": x, "rois": rois}
    cases = {}
    for mode in ("avg", "max"):
        for ratio in (0, 2):
            for coords in ("half_pixel", "output_half_pixel"):
                name = f"roialign_{mode}_{ratio}_{coords}"
                cases[name] = (one_node("RoiAlign", feeds, 16, out_shape=[6, 3, 3, 2], consts={"batch": batch},
                                        mode=mode, sampling_ratio=ratio, output_height=3, output_width=2,
                                        coordinate_transformation_mode=coords), feeds)
    cases["roialign_opset10_scaled"] = (
        one_node("RoiAlign", feeds, 10, out_shape=[6, 3, 2, 2], consts={"batch": batch}, output_height=2,
                 output_width=2, spatial_scale=0.5), feeds)
    return cases


def mish_log_sum_cases():
    """Mish (opset 18) over large and small values, and ReduceLogSum in its attribute (opset 13)
    and input (opset 18) forms, kept and dropped dims, and no axes with and without noop."""
    x = np.array([[-30.0, -5.0, -1.0, -0.1, 0.0], [0.1, 1.0, 5.0, 20.0, 90.0]], np.float32)
    p = np.abs(np.random.default_rng(3).standard_normal((2, 3, 4))).astype(np.float32) + 0.1
    cases = {"mish": (one_node("Mish", {"x": x}, 18), {"x": x})}
    cases["reducelogsum_attr_axes"] = (one_node("ReduceLogSum", {"x": p}, 13, out_shape=[2, 1, 4], axes=[1]), {"x": p})
    cases["reducelogsum_input_axes"] = (
        one_node("ReduceLogSum", {"x": p}, 18, out_shape=[3], consts={"axes": np.array([0, -1], np.int64)},
                 keepdims=0), {"x": p})
    cases["reducelogsum_all"] = (one_node("ReduceLogSum", {"x": p}, 18, out_shape=[1, 1, 1]), {"x": p})
    cases["reducelogsum_noop"] = (
        one_node("ReduceLogSum", {"x": p}, 18, out_shape=[2, 3, 4], consts={"axes": np.array([], np.int64)},
                 noop_with_empty_axes=1), {"x": p})
    return cases


def split_to_sequence_cases():
    """torch.chunk and torch.split as the legacy exporter writes them: SplitToSequence read by
    SequenceAt at known positions (negative ones too), with a scalar size (chunks of 3 of 7), a
    vector of sizes, and none (keepdims 0: each element, the axis squeezed)."""
    x = np.arange(2 * 7, dtype=np.float32).reshape(2, 7)
    cases = {}
    forms = {"scalar": (np.array(3, np.int64), [(0, (2, 3)), (-1, (2, 1)), (1, (2, 3))], {}),
             "sizes": (np.array([4, 1, 2], np.int64), [(2, (2, 2)), (0, (2, 4))], {}),
             "none": (None, [(3, (2,)), (-2, (2,))], {"keepdims": 0})}
    for name, (split, reads, attrs) in forms.items():
        inits = [] if split is None else [nh.from_array(split, "split")]
        nodes = [h.make_node("SplitToSequence", ["x"] + ([] if split is None else ["split"]), ["seq"], axis=1, **attrs)]
        outs = []
        for j, (k, shape) in enumerate(reads):
            inits.append(nh.from_array(np.array(k, np.int64), f"k{j}"))
            nodes.append(h.make_node("SequenceAt", ["seq", f"k{j}"], [f"y{j}"]))
            outs.append(h.make_tensor_value_info(f"y{j}", onnx.TensorProto.FLOAT, shape))
        graph = h.make_graph(nodes, "chunks", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, x.shape)], outs,
                             initializer=inits)
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], ir_version=ir_version(17))
        onnx.checker.check_model(model, full_check=True)
        cases[f"splittosequence_{name}"] = (model, {"x": x})
    return cases


CASES = [bitwise_cases, cumulative_cases, wide_composite_cases, roi_align_cases, mish_log_sum_cases,
         split_to_sequence_cases, lp_pool_pad_cases]


def write(name, model, feeds):
    """ROOT/<name>/model.onnx and test_data_set_0/{input,output}_J.pb (outputs: onnxruntime's);
    OracleError, and nothing written, where onnxruntime refuses the model."""
    want = oracle_run(model, feeds)
    data = os.path.join(ROOT, name, "test_data_set_0")
    os.makedirs(data, exist_ok=True)
    onnx.save(model, os.path.join(ROOT, name, "model.onnx"))
    for j, vi in enumerate(model.graph.input):
        with open(os.path.join(data, f"input_{j}.pb"), "wb") as f:
            f.write(nh.from_array(np.asarray(feeds[vi.name]), vi.name).SerializeToString())
    for j, vi in enumerate(model.graph.output):
        with open(os.path.join(data, f"output_{j}.pb"), "wb") as f:
            f.write(nh.from_array(np.asarray(want[vi.name]), vi.name).SerializeToString())


def main(names):
    for make in CASES:
        for name, (model, feeds) in make().items():
            if not names or name in names:
                try:
                    write(name, model, feeds)
                    print(name)
                except OracleError as e:
                    print(f"{name}: not written, onnxruntime refuses it: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
