"""The op generators of gen.py: each adds one node (or a few) to a Gen, choosing operands and
attributes at their edges, and raises Reject when its choices do not fit."""

import numpy as np
from onnx import numpy_helper as nh

from gen import (ALL_INTS, BOOL, F16, F32, I32, I64, I64_MAX, I64_MIN, INTS, NP2ONNX, UINTS, Reject, Val,
                 broadcastable, data_bound)


UNARY_F = ["Gelu", "Abs", "Neg", "Sqrt", "Exp", "Log", "Reciprocal", "Erf", "Tanh", "Sigmoid", "Relu", "Floor",
           "Ceil", "Round", "Sign", "Sin", "Cos", "Softsign", "Softplus", "HardSwish", "Elu", "LeakyRelu",
           "Selu", "HardSigmoid", "IsNaN", "IsInf", "Identity", "Gelu", "Celu", "Tan", "Sinh", "Cosh", "Asin",
           "Acos", "Atan", "Asinh", "Acosh", "Atanh", "Mish"]
BOUND1 = {"Tanh", "Sigmoid", "Sin", "Cos", "Erf", "Softsign", "Sign"}
BOUND2 = {"Atan", "Asin", "Acos"}  # |atan| < pi/2, |asin| <= pi/2, acos <= pi (or NaN)
KEEP_BOUND = {"Abs", "Neg", "Relu", "Floor", "Ceil", "Round", "Identity"}
POSITIVE = {"Sqrt", "Log", "Reciprocal"}


def op_unary(g):
    op = g.choice(UNARY_F)
    if op == "Gelu" and g.opset < 20:
        op = "Erf"
    if op == "HardSwish" and g.opset < 14:
        op = "HardSigmoid"
    if op == "Mish" and g.opset < 18:
        op = "Softplus"
    attrs = {}
    if op == "Celu" and g.opset < 12:
        op = "Elu"
    if op == "Elu":
        attrs["alpha"] = g.choice([1.0, 0.5, 2.0, 0.0])
    elif op == "Celu" and g.chance(0.7):
        attrs["alpha"] = g.choice([1.0, 0.5, 2.0, 1e-3])
    elif op == "LeakyRelu":
        attrs["alpha"] = g.choice([0.01, 0.2, -0.5, 1.5, 0.0])
    elif op == "Selu" and g.chance(0.5):
        attrs.update(alpha=g.choice([1.0, 2.0, 0.5]), gamma=g.choice([1.0, 3.0, 0.5]))
    elif op == "HardSigmoid" and g.chance(0.7):
        attrs.update(alpha=g.choice([0.2, 1.0, -0.5, 0.0]), beta=g.choice([0.5, 0.0, 1.0, -1.0]))
    elif op == "IsInf" and g.chance(0.5):
        attrs.update(detect_negative=g.randint(0, 1), detect_positive=g.randint(0, 1))
    elif op == "Gelu" and g.chance(0.5):
        attrs["approximate"] = g.choice(["none", "tanh"])
    if op in ("Abs", "Neg", "Sign", "Identity", "Relu") and g.chance(0.15):
        x = g.pick(lambda v: v.rank <= 4, dts=INTS) or g.fresh(g.choice(INTS), g.shape())
    else:
        x = g.float_val(positive=op in POSITIVE and g.chance(0.6))
    b = x.bound
    bound = (1.0 if np.isfinite(b) else np.inf) if op in BOUND1 else (b + 1 if op in KEEP_BOUND else np.inf)
    if op in BOUND2:
        bound = 4.0
    g.node(op, [x], bound=bound, **attrs)


def op_not(g):
    x = g.pick(lambda v: True, dts=[BOOL]) or g.fresh(BOOL, g.shape())
    g.node("Not", [x], bound=1.0)


def op_dropout(g):
    x = g.float_val()
    ins = [x]
    if g.chance(0.5):
        ins.append(g.const(np.array(g.choice([0.0, 0.5, 0.9]), F32), F32) if g.chance(0.8) else None)
        if g.chance(0.5):
            ins.append(g.const(np.array(False), BOOL))
    g.node("Dropout", ins, n_out=2 if g.chance(0.3) else 1, bound=x.bound,
           seed=g.randint(0, 5) if g.chance(0.2) else None)


def op_binary(g):
    op = g.choice(["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod", "PRelu"], [5, 4, 5, 4, 2, 2, 2, 1, 1])
    use_int = op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Mod") and g.chance(0.2)
    dts = list(INTS) if use_int else g.floats
    a = g.pick(lambda v: v.rank <= 4, dts=dts, fresh_p=0.1)
    if a is None:
        a = g.fresh(g.choice(dts), g.shape())
    if op == "PRelu":
        s = a.shape[g.randint(0, a.rank):] if a.rank else ()
        s = tuple(1 if g.chance(0.3) else d for d in s)
        b = g.fresh(a.dt, s, init_p=0.6, param=True)
    elif op in ("Div", "Mod") and use_int:
        b = g.fresh(a.dt, g.bcast_shape(a.shape), nonzero=True)
    else:
        bs = g.bcast_shape(a.shape)
        b = g.pick(lambda v: v.shape == bs and v is not a, dts=[a.dt], fresh_p=0.4)
        if b is None:
            b = g.fresh(a.dt, bs, positive=op == "Pow" and g.chance(0.3))
        if g.chance(0.5):
            a, b = b, a
    attrs = {}
    if op == "Mod":
        attrs["fmod"] = 1 if a.dt.kind == "f" else g.randint(0, 1)
    bound = {"Add": a.bound + b.bound, "Sub": a.bound + b.bound, "Mul": a.bound * b.bound,
             "Max": max(a.bound, b.bound), "Min": max(a.bound, b.bound)}.get(op, np.inf)
    g.node(op, [a, b], bound=bound, **attrs)


def op_variadic(g):
    op = g.choice(["Sum", "Mean", "Max", "Min"])
    a = g.float_val()
    ins = [a] + [g.operand_like(g.bcast_shape(a.shape), a.dt) for _ in range(g.randint(0, 2))]
    g.node(op, ins, bound=sum(v.bound for v in ins))


def op_compare(g):
    op = g.choice(["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
    dts = g.floats + list(INTS) + ([BOOL] if op == "Equal" else [])
    a = g.pick(lambda v: v.rank <= 4, dts=dts, fresh_p=0.1) or g.fresh(F32, g.shape())
    bs = g.bcast_shape(a.shape)
    b = g.pick(lambda v: v.shape == bs and v is not a, dts=[a.dt], fresh_p=0.3) or g.fresh(a.dt, bs)
    if g.chance(0.5):
        a, b = b, a
    g.node(op, [a, b], bound=1.0)


def op_logical(g):
    op = g.choice(["And", "Or", "Xor"])
    a = g.pick(dts=[BOOL]) or g.fresh(BOOL, g.shape())
    b = g.operand_like(g.bcast_shape(a.shape), BOOL)
    g.node(op, [a, b], bound=1.0)


def int_edges(g, dt, shape):
    """Integers of `dt`: small ones, and some at the dtype's edges (its minimum and maximum)."""
    info = np.iinfo(dt)
    edges = [int(info.min), int(info.max), int(info.max) // 3, int(info.min) + 1 if info.min else 1]
    small = g.rng.integers(-5 if info.min else 0, 6, size=int(np.prod(shape, dtype=np.int64)))
    flat = [g.choice(edges) if g.chance(0.25) else int(v) for v in small]
    return np.array(flat, dtype=dt).reshape(shape)


def op_bitwise(g):
    shift = g.opset < 18 or g.chance(0.35)
    op = "BitShift" if shift else g.choice(["BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot"])
    dts = UINTS if shift else ALL_INTS
    a = g.pick(lambda v: v.rank <= 4, dts=dts, fresh_p=0.4)
    if a is None:
        dt = g.choice(dts)
        shape = g.shape()
        a = g.new_input(dt, shape, data=int_edges(g, dt, shape))
    if op == "BitwiseNot":
        g.node(op, [a])
        return
    bs = g.bcast_shape(a.shape)
    if shift:
        bits = np.iinfo(a.dt).bits
        s = g.rng.choice([0, 1, 2, 3, bits - 1, bits, bits + 1, 64, 100], size=bs).astype(a.dt)
        b = g.new_init(s, prefix="c") if g.chance(0.5) else g.new_input(a.dt, bs, data=s)
    else:
        b = g.pick(lambda v: v.shape == bs and v is not a, dts=[a.dt], fresh_p=0.4)
        b = b or g.new_input(a.dt, bs, data=int_edges(g, a.dt, bs))
        if g.chance(0.5):
            a, b = b, a
    g.node(op, [a, b], direction=g.choice(["LEFT", "RIGHT"]) if shift else None)


def op_where(g):
    x = g.pick(lambda v: v.rank <= 4, dts=g.floats + list(INTS) + [BOOL], fresh_p=0.1) or g.fresh(F32, g.shape())
    c = g.pick(lambda v: v.rank <= 4 and broadcastable(v.shape, x.shape), dts=[BOOL], fresh_p=0.3)
    c = c or g.fresh(BOOL, g.bcast_shape(x.shape))
    y = g.operand_like(g.bcast_shape(x.shape), x.dt)
    if g.chance(0.5):
        x, y = y, x
    g.node("Where", [c, x, y], bound=max(x.bound, y.bound))


def op_clip(g):
    x = g.float_val() if g.chance(0.85) else (g.pick(dts=INTS) or g.fresh(I64, g.shape()))
    lo = hi = None
    if g.chance(0.7):
        lo = g.choice([-1.0, 0.0, -0.5, 2.0, -3.0])
    if g.chance(0.7):
        hi = g.choice([1.0, 0.5, 6.0, -1.0, 3.0])
    cv = lambda c: (g.const(np.array(c, x.dt), x.dt) if g.chance(0.8) else g.fresh(x.dt, (), init_p=0.0))
    ins = [x, None if lo is None else cv(lo), None if hi is None else cv(hi)]
    b = max(abs(lo if lo is not None else -np.inf), abs(hi if hi is not None else np.inf))
    g.node("Clip", ins, bound=min(b, x.bound) if np.isfinite(x.bound) else np.inf)


def op_cast(g):
    x = g.pick(lambda v: v.rank <= 4, fresh_p=0.05)
    if x is None:
        x = g.fresh(F32, g.shape())
    targets = list(g.floats) + [F16, I64, I32, BOOL]
    if x.dt.kind == "f" and not x.bound < 1e6:
        targets = [t for t in targets if t.kind in "fb"]
    to = g.choice(targets)
    g.node("Cast", [x], bound=x.bound if to != BOOL else 1.0, to=NP2ONNX[to])


REDUCES = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1",
           "ReduceL2", "ReduceLogSumExp", "ReduceLogSum"]


def op_reduce(g):
    op = g.choice(REDUCES)
    if op in ("ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd") and g.chance(0.15):
        x = g.pick(lambda v: v.rank <= 4, dts=INTS) or g.fresh(I64, g.shape())
    else:
        x = g.float_val()
    r = x.rank
    attrs = {}
    if g.chance(0.6):
        attrs["keepdims"] = g.randint(0, 1)
    mode = g.choice(["subset", "none", "empty"], [6, 2, 1])
    axes = None
    if mode == "subset" and r:
        k = g.randint(1, r)
        axes = [int(a) - (r if g.chance(0.3) else 0) for a in g.rng.choice(r, size=k, replace=False)]
    elif mode == "empty":
        axes = []
    input_form = g.opset >= 18 or op == "ReduceSum"
    if input_form and (g.chance(0.5) or mode != "subset"):
        attrs["noop_with_empty_axes"] = g.randint(0, 1)
    ins = [x]
    if axes is not None:
        if input_form:
            ins.append(g.const(np.array(axes, np.int64)))
        elif axes:
            attrs["axes"] = axes
    g.node(op, ins, bound=x.bound if op in ("ReduceMax", "ReduceMin") else np.inf, **attrs)


def op_softmax(g):
    op = g.choice(["Softmax", "LogSoftmax"])
    x = g.float_val(lo=1)
    attrs = {"axis": g.randint(-x.rank, x.rank - 1)} if g.chance(0.7) else {}
    g.node(op, [x], bound=1.0 if op == "Softmax" else np.inf, **attrs)


def op_cumsum(g):
    x = g.float_val(lo=1) if g.chance(0.8) else (g.pick(lambda v: v.rank >= 1, dts=INTS) or g.fresh(I64, g.shape(lo=1)))
    ax = g.randint(-x.rank, x.rank - 1)
    axis = g.const(np.array(ax, g.choice([I64, I32])), g.choice([I64, I32]))
    attrs = {}
    if g.chance(0.5):
        attrs["exclusive"] = g.randint(0, 1)
    if g.chance(0.5):
        attrs["reverse"] = g.randint(0, 1)
    # CumProd is an op since opset 26: the same inputs and attributes.
    g.node("CumProd" if g.opset >= 26 and g.chance(0.4) else "CumSum", [x, axis], **attrs)


def op_arg(g):
    op = g.choice(["ArgMax", "ArgMin"])
    x = g.float_val(lo=1, pred=lambda v: all(d > 0 for d in v.shape)) if g.chance(0.85) else \
        (g.pick(lambda v: v.rank >= 1 and v.numel > 0, dts=INTS) or g.fresh(I64, g.shape(lo=1), lo=0, hi=2))
    attrs = {}
    if g.chance(0.8):
        attrs["axis"] = g.randint(-x.rank, x.rank - 1)
    if g.chance(0.5):
        attrs["keepdims"] = g.randint(0, 1)
    if g.chance(0.5):
        attrs["select_last_index"] = g.randint(0, 1)
    g.node(op, [x], **attrs)


def op_topk(g):
    x = g.float_val(lo=1) if g.chance(0.85) else (g.pick(lambda v: v.rank >= 1, dts=INTS) or
                                                  g.fresh(I64, g.shape(lo=1), lo=-3, hi=3))
    axis = g.randint(-x.rank, x.rank - 1)
    n = x.shape[axis]
    k = g.const(np.array([g.randint(0, n)]))
    attrs = {"axis": axis if g.chance(0.7) else None}
    if g.opset >= 11 and g.chance(0.5):
        attrs["largest"] = g.randint(0, 1)
    if g.opset < 10:
        g.node("TopK", [x], n_out=2, bound=x.bound, k=int(k.value[0]) if k.value is not None else 1, **attrs)
    else:
        g.node("TopK", [x, k], n_out=2, bound=x.bound, **attrs)


def op_onehot(g):
    depth = g.randint(1, 5)
    idx = g.pick(lambda v: v.rank <= 3, dts=[I64]) or g.fresh(I64, g.shape(hi=3), lo=-depth - 1, hi=depth)
    values = g.const(np.array(g.choice([[0.0, 1.0], [-1.0, 2.5], [0.5, 0.5]])), F32)
    r = idx.rank + 1
    axis = g.randint(-r, r - 1) if g.chance(0.6) else None
    g.node("OneHot", [idx, g.const(np.array(depth)), values], bound=2.5, axis=axis)


def op_depth_space(g):
    b = g.choice([1, 2, 3], [1, 3, 1])
    if g.chance(0.5):
        x = g.pick(lambda v: v.rank == 4 and v.shape[1] % (b * b) == 0) or \
            g.fresh(g.floats[0], (g.dim(), b * b * g.choice([1, 2]), g.dim(), g.dim()))
        mode = g.choice(["DCR", "CRD"]) if g.chance(0.7) else None
        g.node("DepthToSpace", [x], bound=x.bound, blocksize=b, mode=mode)
    else:
        x = g.pick(lambda v: v.rank == 4 and v.shape[2] % b == 0 and v.shape[3] % b == 0) or \
            g.fresh(g.floats[0], (g.dim(), g.dim(), b * g.choice([1, 2]), b * g.choice([1, 2])))
        g.node("SpaceToDepth", [x], bound=x.bound, blocksize=b)


def op_matmul(g):
    a = g.float_val(lo=1, fresh_p=0.2)
    if a.rank == 1:
        k = a.shape[0]
        batch = ()
    else:
        k = a.shape[-1]
        batch = a.shape[:-2]
    n = g.dim() or 1
    if g.chance(0.15):
        bshape = (k,)
    else:
        bb = batch[g.randint(0, len(batch)):] if batch else ()
        bb = tuple(1 if g.chance(0.3) else d for d in bb)
        bshape = bb + (k, n)
    b = g.pick(lambda v: v.shape == bshape and v is not a, dts=[a.dt], fresh_p=0.5) or g.fresh(a.dt, bshape, init_p=0.5)
    g.node("MatMul", [a, b])


def op_gemm(g):
    dt = g.float_dt()
    a = g.pick(lambda v: v.rank == 2, dts=[dt], fresh_p=0.2) or g.fresh(dt, g.shape(2))
    ta, tb = g.randint(0, 1), g.randint(0, 1)
    m, k = (a.shape[1], a.shape[0]) if ta else a.shape
    n = g.dim() or 1
    b = g.fresh(dt, (n, k) if tb else (k, n), init_p=0.6)
    ins = [a, b]
    if g.chance(0.7) or g.opset < 11:
        cs = g.choice([(), (n,), (1, n), (m, 1), (m, n), (1, 1)])
        ins.append(g.fresh(dt, cs, init_p=0.6))
    attrs = {"transA": ta if ta or g.chance(0.5) else None, "transB": tb if tb or g.chance(0.5) else None}
    if g.chance(0.4):
        attrs["alpha"] = g.choice([0.5, 2.0, -1.0, 0.0, 1e-3])
    if g.chance(0.4) and len(ins) == 3:
        attrs["beta"] = g.choice([0.5, 2.0, -1.0, 0.0])
    g.node("Gemm", ins, **attrs)


EINSUMS = ["ij,jk->ik", "bij,bjk->bik", "ij->ji", "ij->", "i,i->", "ij,ij->ij", "i,j->ij", "bhqd,bhkd->bhqk",
           "ijk->kij", "ij,j->i", "ij->i", "abc,cd->abd", "ij,kj->ik", "bi,bi->b", "ij,jk,kl->il", "ij,jk",
           "ii->i", "ijk->j", "bqhd,bkhd->bhqk"]


def op_einsum(g):
    eq = g.choice(EINSUMS)
    lhs = eq.split("->")[0].split(",")
    dims = {c: g.dim() or 1 for c in "abcdhijklqz"}
    if eq == "ii->i":
        pass
    a = g.pick(lambda v: v.rank == len(lhs[0]), dts=g.floats, fresh_p=0.3)
    if a is not None:
        if eq == "ii->i" and a.shape[0] != a.shape[1]:
            a = None
        else:
            for c, d in zip(lhs[0], a.shape):
                dims[c] = d
    ops = [a or g.fresh(F32, tuple(dims[c] for c in lhs[0]))]
    for term in lhs[1:]:
        ops.append(g.fresh(ops[0].dt, tuple(dims[c] for c in term), init_p=0.4))
    g.node("Einsum", ops, equation=eq)


def spatial_input(g, lo=3, hi=4):
    x = g.pick(lambda v: lo <= v.rank <= hi and all(d > 0 for d in v.shape[1:]) and v.numel <= 2000,
               dts=g.floats, fresh_p=0.25)
    if x is None:
        r = g.choice(list(range(lo, hi + 1)))
        n = 0 if g.chance(0.03) else g.choice([1, 2])
        x = g.fresh(g.float_dt(), (n, g.choice([1, 2, 3, 4])) + tuple(g.randint(1, 7) for _ in range(r - 2)),
                    init_p=0.0)
    return x


def conv_geometry(g, sp, transpose=False, pool=False):
    k = [g.randint(1, min(3, d + 2) if not pool else max(1, min(3, d))) for d in sp]
    attrs = {}
    if g.chance(0.5) or not pool:
        attrs["kernel_shape"] = k if pool or g.chance(0.5) else None
    if g.chance(0.5):
        attrs["strides"] = [g.choice([1, 1, 2, 3]) for _ in sp]
    if g.chance(0.3) and (not pool or g.opset >= 10):
        attrs["dilations"] = [g.choice([1, 1, 2]) for _ in sp]
    mode = g.choice(["pads", "none", "SAME_UPPER", "SAME_LOWER", "VALID", "NOTSET"], [4, 3, 2, 2, 1, 1])
    if mode == "pads":
        attrs["pads"] = [g.randint(0, kk - 1 if pool else kk) for kk in k] * 2
        if g.chance(0.5):
            attrs["pads"] = [g.randint(0, kk - 1 if pool else kk) for kk in k + k]
    elif mode != "none":
        attrs["auto_pad"] = mode
    return k, attrs


def op_conv(g):
    x = spatial_input(g, 3, 5 if g.chance(0.1) else 4)
    c = x.shape[1]
    group = g.choice([d for d in range(1, c + 1) if c % d == 0]) if g.chance(0.3) else 1
    m = group * g.randint(1, 3)
    k, attrs = conv_geometry(g, x.shape[2:])
    w = g.fresh(x.dt, (m, c // group) + tuple(k), init_p=0.7, param=True)
    ins = [x, w] + ([g.fresh(x.dt, (m,), init_p=0.7, param=True)] if g.chance(0.5) else [])
    if group > 1 or g.chance(0.2):
        attrs["group"] = group
    g.node("Conv", ins, **attrs)


def op_conv_transpose(g):
    x = spatial_input(g, 3, 4)
    c = x.shape[1]
    group = g.choice([d for d in range(1, c + 1) if c % d == 0]) if g.chance(0.2) else 1
    m = group * g.randint(1, 3)
    k, attrs = conv_geometry(g, x.shape[2:], transpose=True)
    strides = attrs.get("strides") or [1] * len(k)
    dil = attrs.get("dilations") or [1] * len(k)
    if g.chance(0.3):
        attrs["output_padding"] = [g.randint(0, max(s, d) - 1) for s, d in zip(strides, dil)]
    if g.chance(0.15):
        attrs["output_shape"] = [d * s + g.randint(0, s - 1) for d, s in zip(x.shape[2:], strides)]
        attrs.pop("pads", None)
    w = g.fresh(x.dt, (c, m // group) + tuple(k), init_p=0.7, param=True)
    ins = [x, w] + ([g.fresh(x.dt, (m,), init_p=0.7, param=True)] if g.chance(0.5) else [])
    if group > 1:
        attrs["group"] = group
    g.node("ConvTranspose", ins, **attrs)


def op_pool(g):
    op = g.choice(["MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LRN"], [4, 4, 1, 1, 1])
    x = spatial_input(g, 3, 5 if g.chance(0.1) else 4)
    if op.startswith("Global"):
        g.node(op, [x])
        return
    if op == "LRN":
        if x.rank != 4:
            raise Reject("LRN needs 4-D")
        g.node("LRN", [x], size=g.choice([1, 3, 5, 2]), alpha=g.choice([1e-4, 0.1, None]),
               beta=g.choice([0.75, 0.5, None]), bias=g.choice([1.0, 2.0, None]))
        return
    k, attrs = conv_geometry(g, x.shape[2:], pool=True)
    attrs["kernel_shape"] = k
    if op == "AveragePool" and g.opset < 19:
        attrs.pop("dilations", None)
    if g.chance(0.3) and not attrs.get("auto_pad", "NOTSET").startswith("SAME"):
        # (with SAME, onnx shape inference applies ceil_mode and onnxruntime does not)
        attrs["ceil_mode"] = 1
    if op == "AveragePool" and g.chance(0.5):
        attrs["count_include_pad"] = g.randint(0, 1)
    n_out = 1
    if op == "MaxPool" and g.chance(0.1):
        n_out = 2
        if g.chance(0.5):
            attrs["storage_order"] = g.randint(0, 1)
    g.node(op, [x], n_out=n_out, **attrs)


def op_batchnorm(g):
    x = g.float_val(lo=2, pred=lambda v: v.shape[1] > 0)
    c = x.shape[1]
    w = lambda **kw: g.fresh(x.dt, (c,), init_p=0.8, param=True, **kw)
    ins = [x, w(), w(), w(), w(positive=True)]
    g.node("BatchNormalization", ins, epsilon=g.choice([1e-5, 1e-3, 1e-12, 0.0, None]),
           momentum=g.choice([0.9, None]))


def op_layernorm(g):
    if g.opset < 17:
        raise Reject("LayerNormalization needs opset 17")
    x = g.float_val(lo=1)
    axis = g.randint(-x.rank, x.rank - 1) if g.chance(0.7) else None
    ns = x.shape[-1 if axis is None else axis:]
    ins = [x, g.fresh(x.dt, ns, init_p=0.8, param=True)]
    if g.chance(0.6):
        ins.append(g.fresh(x.dt, ns, init_p=0.8, param=True))
    n_out = 1 if g.chance(0.9) else g.randint(2, 3)
    g.node("LayerNormalization", ins, n_out=n_out, axis=axis,
           epsilon=g.choice([1e-5, 1e-6, 1e-12, 0.1, None]))


def op_groupnorm(g):
    if g.opset < 21:  # GroupNormalization-18 is deprecated: onnx.checker refuses it
        raise Reject("GroupNormalization needs opset 21")
    x = g.float_val(lo=3, pred=lambda v: v.shape[1] > 0)
    c = x.shape[1]
    if c == 0:  # a fresh input (the predicate only filters existing values)
        raise Reject("GroupNormalization of no channel")
    ng = g.choice([d for d in range(1, c + 1) if c % d == 0])
    ps = (c,) if g.opset >= 21 else (ng,)
    ins = [x, g.fresh(x.dt, ps, init_p=0.8, param=True), g.fresh(x.dt, ps, init_p=0.8, param=True)]
    g.node("GroupNormalization", ins, same_as=0, num_groups=ng, epsilon=g.choice([1e-5, 1e-12, 0.1, None]))


def op_instancenorm(g):
    x = g.float_val(lo=3, pred=lambda v: v.shape[1] > 0)
    c = x.shape[1]
    ins = [x, g.fresh(x.dt, (c,), init_p=0.8, param=True), g.fresh(x.dt, (c,), init_p=0.8, param=True)]
    g.node("InstanceNormalization", ins, epsilon=g.choice([1e-5, 1e-12, 0.1, None]))


def factor(g, n, rank):
    """`rank` dims whose product is n."""
    dims = [1] * rank
    if rank == 0:
        return dims
    if n == 0:
        dims = [g.randint(1, 3) for _ in range(rank)]
        dims[g.randint(0, rank - 1)] = 0
        return dims
    p = 2
    while n > 1:
        while n % p:
            p += 1
        dims[g.randint(0, rank - 1)] *= p
        n //= p
    return dims


def op_reshape(g):
    x = g.pick(lambda v: v.rank <= 5) or g.fresh(F32, g.shape())
    n = x.numel
    rank = g.randint(1 if n != 1 else 0, 4)
    dims = factor(g, n, rank)
    allowzero = g.randint(0, 1) if g.chance(0.3) and g.opset >= 14 else None
    spec = list(dims)
    if n > 0 and spec and g.chance(0.4):
        spec[g.randint(0, rank - 1)] = -1
    if not allowzero:
        for i in range(min(rank, x.rank)):
            if spec[i] == x.shape[i] and spec[i] != -1 and g.chance(0.3):
                spec[i] = 0
    if allowzero and n == 0 and -1 in spec:
        raise Reject("allowzero with -1 and zero")
    g.node("Reshape", [x, shape_operand(g, spec)], bound=x.bound, allowzero=allowzero)


def shape_operand(g, spec):
    """The i64 vector `spec` as a host operand, sometimes computed by a Shape → Gather → Concat
    chain as exporters write it."""
    spec = list(spec)
    src = g.pick(lambda v: v.rank >= 1 and v.kind != "init")
    if src is not None and spec and g.chance(0.25):
        sh = g.node("Shape", [src])[0]
        parts = []
        for d in spec:
            hits = [i for i, s in enumerate(src.shape) if s == d and d > 0]
            if hits and g.chance(0.7):
                idx = g.const(np.array([g.choice(hits)], np.int64))
                parts.append(g.node("Gather", [sh, idx], axis=0)[0])
            else:
                parts.append(g.const(np.array([d], np.int64)))
        if len(parts) == 1:
            return parts[0]
        return g.node("Concat", parts, axis=0)[0]
    return g.const(np.array(spec, np.int64))


def op_transpose(g):
    x = g.pick(lambda v: v.rank <= 5) or g.fresh(F32, g.shape())
    perm = [int(p) for p in g.rng.permutation(x.rank)]
    g.node("Transpose", [x], bound=x.bound, perm=perm if perm and g.chance(0.85) else None)


def op_squeeze(g):
    x = g.pick(lambda v: 1 in v.shape, fresh_p=0.1) or g.fresh(F32, g.shape(lo=1) + (1,))
    ones = [i for i, d in enumerate(x.shape) if d == 1]
    ins = [x]
    if ones and g.chance(0.8):
        k = g.randint(1, len(ones))
        axes = [int(a) - (x.rank if g.chance(0.3) else 0) for a in g.rng.choice(ones, size=k, replace=False)]
        ins.append(g.const(np.array(axes, np.int64)))
    g.node("Squeeze", ins, bound=x.bound)


def op_unsqueeze(g):
    x = g.pick(lambda v: v.rank <= 3) or g.fresh(F32, g.shape(hi=3))
    k = g.randint(1, 2)
    r = x.rank + k
    axes = [int(a) - (r if g.chance(0.3) else 0) for a in g.rng.choice(r, size=k, replace=False)]
    g.node("Unsqueeze", [x, g.const(np.array(axes, np.int64))], bound=x.bound)


def op_flatten(g):
    x = g.pick(lambda v: v.rank >= 1) or g.fresh(F32, g.shape(lo=1))
    g.node("Flatten", [x], bound=x.bound, axis=g.randint(-x.rank, x.rank) if g.chance(0.8) else None)


def op_concat(g):
    x = g.pick(lambda v: v.rank >= 1) or g.fresh(F32, g.shape(lo=1))
    axis = g.randint(-x.rank, x.rank - 1)
    ins = [x]
    for _ in range(g.randint(0, 3)):
        s = list(x.shape)
        s[axis] = g.choice([0, 1, 2, 3, s[axis]], [1, 3, 3, 2, 3])
        ins.append(g.operand_like(s, x.dt))
    g.node("Concat", ins, bound=max(v.bound for v in ins), axis=axis)


def op_split(g):
    x = g.pick(lambda v: v.rank >= 1 and max(v.shape) >= 1) or g.fresh(F32, g.shape(lo=1))
    axis = g.randint(-x.rank, x.rank - 1)
    d = x.shape[axis]
    form = g.choice(["split", "equal", "num_outputs"], [4, 2, 0] if g.opset < 18 else [4, 0, 3])
    attrs = {"axis": axis if g.chance(0.8) else None}
    if axis != 0 and attrs["axis"] is None:
        attrs["axis"] = axis
    ins = [x]
    if form == "split":
        n = g.randint(1, 4)
        parts = [0] * n
        for _ in range(d):
            parts[g.randint(0, n - 1)] += 1
        ins.append(g.const(np.array(parts, np.int64)))
    elif form == "num_outputs":
        n = g.randint(1, max(1, min(4, d)))
        attrs["num_outputs"] = n
    else:
        divs = [k for k in range(1, 5) if d % k == 0] if d else [1, 2]
        n = g.choice(divs)
    g.node("Split", ins, n_out=n, bound=x.bound, **attrs)


def slice_bound(g, d):
    return g.choice([I64_MIN, -1000, -d - 1, -d, -d + 1, -1, 0, 1, d - 1, d, d + 1, 1000, I64_MAX],
                    [1, 1, 1, 1, 2, 3, 4, 3, 2, 3, 1, 1, 1])


def op_slice(g):
    x = g.pick(lambda v: v.rank >= 1) or g.fresh(F32, g.shape(lo=1))
    r = x.rank
    k = g.randint(1, r)
    axes = [int(a) for a in g.rng.choice(r, size=k, replace=False)]
    starts, ends, steps = [], [], []
    for a in axes:
        d = x.shape[a]
        st = g.choice([1, 1, 1, 2, 3, -1, -1, -2, -3])
        s0, e0 = slice_bound(g, d), slice_bound(g, d)
        if g.chance(0.5):  # usually something in range
            s0, e0 = (g.randint(0, max(d - 1, 0)), g.randint(0, d)) if st > 0 else (g.randint(-1, max(d - 1, -1)), g.randint(-d - 1, d - 1))
        starts.append(s0)
        ends.append(e0)
        steps.append(st)
    idt = g.choice([I64, I64, I32])
    if idt == I32:
        clamp = lambda xs: [int(np.clip(v, -2 ** 31, 2 ** 31 - 1)) for v in xs]
        starts, ends = clamp(starts), clamp(ends)
    ins = [x, g.const(np.array(starts), idt), g.const(np.array(ends), idt)]
    explicit_axes = g.chance(0.7) or axes != list(range(k))
    steps_needed = any(s != 1 for s in steps) or g.chance(0.3)
    if explicit_axes or steps_needed:
        neg = g.chance(0.3)
        ins.append(g.const(np.array([a - r if neg else a for a in axes]), idt) if explicit_axes or
                   axes != list(range(k)) else None)
        if ins[-1] is None and axes != list(range(k)):
            raise Reject("axes needed")
    if steps_needed:
        ins.append(g.const(np.array(steps), idt))
    g.node("Slice", ins, bound=x.bound)


def indices(g, d, shape, dt=None, negative=True):
    dt = dt or g.choice([I64, I64, I32])
    if d == 0:
        shape = tuple(0 if i == 0 else s for i, s in enumerate(shape)) if shape else None
        if shape is None:
            raise Reject("no index into an empty dim")
    a = g.rng.integers(-d if negative and g.chance(0.5) else 0, max(d, 1), size=shape).astype(dt)
    if g.chance(0.5):
        return g.new_init(a, prefix="c") if g.chance(0.5) else g.const(a, dt)
    v = Val(g.name("x"), dt, a.shape, kind="input", bound=data_bound(a))
    g.inputs.append(v)
    g.feeds[v.name] = a
    return v


def op_gather(g):
    op = g.choice(["Gather", "GatherElements", "GatherND"], [4, 2, 2])
    x = g.pick(lambda v: v.rank >= 1) or g.fresh(F32, g.shape(lo=1))
    r = x.rank
    if op == "Gather":
        axis = g.randint(-r, r - 1)
        ish = g.shape(lo=0, hi=2)
        ish = tuple(max(1, s) for s in ish)
        idx = indices(g, x.shape[axis], ish)
        g.node("Gather", [x, idx], bound=x.bound, axis=axis if g.chance(0.8) or axis else None)
    elif op == "GatherElements":
        axis = g.randint(-r, r - 1)
        ish = list(x.shape)
        ish[axis] = g.randint(1, 4)
        idx = indices(g, x.shape[axis], tuple(ish))
        g.node("GatherElements", [x, idx], bound=x.bound, axis=axis if g.chance(0.8) or axis else None)
    else:
        b = g.randint(0, min(1, r - 1))
        k = g.randint(1, r - b)
        ish = tuple(x.shape[:b]) + tuple(g.randint(1, 3) for _ in range(g.randint(0, 1))) + (k,)
        parts = [g.rng.integers(0, max(x.shape[b + j], 1), size=ish[:-1]) for j in range(k)]
        if any(x.shape[b + j] == 0 for j in range(k)):
            raise Reject("GatherND into an empty dim")
        a = np.stack(parts, axis=-1).astype(np.int64)
        idx = g.new_init(a, prefix="c") if g.chance(0.5) else g.const(a)
        g.node("GatherND", [x, idx], bound=x.bound, batch_dims=b if b else None)


def op_scatter(g):
    op = g.choice(["ScatterND", "ScatterElements"])
    x = g.pick(lambda v: v.rank >= 1 and v.numel > 0) or g.fresh(F32, tuple(max(1, d) for d in g.shape(lo=1)))
    r = x.rank
    reds = ["none"] + (["add", "mul"] if g.opset >= 16 else []) + (["max", "min"] if g.opset >= 18 else [])
    red = g.choice(reds)
    if op == "ScatterND":
        k = g.randint(1, r)
        space = int(np.prod(x.shape[:k]))
        n = g.randint(1, min(4, space))
        flat = g.rng.choice(space, size=n, replace=red != "none" and g.chance(0.3))
        idx = np.stack(np.unravel_index(flat, x.shape[:k]), axis=-1).astype(np.int64)
        upd = g.fresh(x.dt, (n,) + x.shape[k:])
        g.node("ScatterND", [x, g.const(idx), upd], bound=np.inf, reduction=red if red != "none" or g.chance(0.2) else None)
    else:
        axis = g.randint(-r, r - 1)
        ush = [g.randint(1, d) for d in x.shape]
        d = x.shape[axis]
        ush[axis] = g.randint(1, d)
        ish = tuple(ush)
        cols = [g.rng.permutation(d)[:ush[axis]] for _ in range(int(np.prod(ish)) // ush[axis])]
        a = np.moveaxis(np.array(cols).reshape(tuple(s for i, s in enumerate(ish) if i != axis % r) + (ush[axis],)), -1, axis % r)
        if g.chance(0.3):
            a = a - d * (g.rng.random(a.shape) < 0.5)
        upd = g.fresh(x.dt, ish)
        g.node("ScatterElements", [x, g.const(a.astype(np.int64)), upd], axis=axis,
               reduction=red if red != "none" or g.chance(0.2) else None)


def op_pad(g):
    x = g.pick(lambda v: 1 <= v.rank <= 4) or g.fresh(F32, g.shape(lo=1))
    modes = ["constant", "reflect", "edge"] + (["wrap"] if g.opset >= 19 else [])
    mode = g.choice(modes, [4, 2, 2, 1][:len(modes)])
    r = x.rank
    axes = list(range(r))
    if g.opset >= 18 and g.chance(0.3):
        axes = sorted(int(a) for a in g.rng.choice(r, size=g.randint(1, r), replace=False))
    pads = []
    for side in range(2):
        for a in axes:
            d = x.shape[a]
            if mode == "constant":
                p = g.choice([0, 1, 2, 3, -1]) if d >= 2 else g.choice([0, 1, 2])
            elif mode == "reflect":
                p = g.randint(0, max(0, d - 1))
            elif mode == "wrap":
                p = g.randint(0, d)
            else:
                p = g.randint(0, 2) if d > 0 else 0
            pads.append(p)
    ins = [x, g.const(np.array(pads, np.int64))]
    if mode == "constant" and g.chance(0.5):
        ins.append(g.const(np.array(g.choice([0.0, 1.5, -2.0]) if x.dt.kind == "f" else 3, x.dt), x.dt))
    elif len(axes) != r:
        ins.append(None)
    if len(axes) != r:
        ins.append(g.const(np.array([a - r if g.chance(0.3) else a for a in axes], np.int64)))
    g.node("Pad", ins, bound=max(x.bound, 3.0), mode=mode if mode != "constant" or g.chance(0.3) else None)


def op_tile(g):
    x = g.pick(lambda v: 1 <= v.rank <= 4 and v.numel <= 200) or g.fresh(F32, g.shape(lo=1))
    reps = [g.choice([1, 1, 2, 3, 0], [4, 4, 3, 1, 1]) for _ in range(x.rank)]
    g.node("Tile", [x, g.const(np.array(reps, np.int64))], bound=x.bound)


def op_expand(g):
    x = g.pick(lambda v: v.rank <= 3 and v.numel <= 200) or g.fresh(F32, g.shape(hi=3))
    s = [g.dim() if d == 1 and g.chance(0.6) else (1 if g.chance(0.2) else d) for d in x.shape]
    s = [g.dim() for _ in range(g.randint(0, 2))] + s
    g.node("Expand", [x, shape_operand(g, s)], bound=x.bound)


def op_resize(g):
    mode = g.choice(["nearest", "linear", "cubic"], [5, 5, 1])
    if mode == "nearest":
        x = g.float_val(lo=1, hi=4, fresh_p=0.2)
    else:
        x = g.pick(lambda v: v.rank in (2, 4), dts=g.floats) or g.fresh(F32, g.shape(g.choice([2, 4])))
    r = x.rank
    coords = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize"] + \
        (["half_pixel_symmetric"] if g.opset >= 19 else [])
    coord = g.choice(coords, [3, 2, 2, 2, 1, 2][:len(coords)])
    attrs = {"mode": mode if mode != "nearest" or g.chance(0.5) else None,
             "coordinate_transformation_mode": coord if coord != "half_pixel" or g.chance(0.3) else None}
    if mode == "nearest" and g.chance(0.6):
        attrs["nearest_mode"] = g.choice(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"])
    if mode == "cubic" and g.chance(0.5):
        attrs["cubic_coeff_a"] = g.choice([-0.5, -0.75])
        attrs["exclude_outside"] = g.randint(0, 1)
    axes = list(range(r))
    if mode != "nearest":
        axes = list(range(r - 2, r))
        if r == 4 and g.opset >= 18 and g.chance(0.5):
            attrs["axes"] = [2, 3] if g.chance(0.5) else [-2, -1]
        else:
            axes = list(range(r))
    elif g.opset >= 18 and g.chance(0.3):
        axes = sorted(int(a) for a in g.rng.choice(r, size=g.randint(1, r), replace=False))
        attrs["axes"] = axes
    roi = None
    if coord == "tf_crop_and_resize":
        lo = [g.choice([0.0, 0.1, 0.25, -0.2]) for _ in axes]  # past the input: extrapolated
        hi = [g.choice([1.0, 0.9, 0.6, 1.3]) for _ in axes]
        roi = g.const(np.array(lo + hi, F32), F32)
        if g.chance(0.5):
            attrs["extrapolation_value"] = g.choice([0.0, -1.0])
    full = "axes" not in attrs and mode != "nearest"
    if g.chance(0.5):
        sc = [1.0 if (full and i < r - 2) else g.choice([0.5, 1.0, 1.5, 2.0, 3.0, 0.75, 1.3]) for i in range(len(axes))]
        if not full and mode != "nearest":
            sc = [g.choice([0.5, 1.0, 1.5, 2.0, 3.0, 0.75, 1.3]) for _ in axes]
        ins = [x, roi, g.const(np.array(sc, F32), F32)]
    else:
        sz = [x.shape[a] if (full and i < r - 2) else g.randint(1, 8) for i, a in enumerate(axes)]
        ins = [x, roi, None, g.const(np.array(sz, np.int64))]
        if g.opset >= 18 and g.chance(0.2):
            attrs["keep_aspect_ratio_policy"] = g.choice(["not_larger", "not_smaller"])
    if g.opset >= 18 and mode != "nearest" and g.chance(0.1):
        attrs["antialias"] = 1
    g.node("Resize", ins, **attrs)


def op_range(g):
    if g.chance(0.5):
        dt = g.choice([I64, I32])
        start, delta = g.randint(-5, 5), g.choice([1, 2, 3, -1, -2])
        limit = start + delta * g.randint(-1, 10)
    else:
        dt = F32
        start, delta = g.choice([0.0, -1.5, 2.0, 0.25]), g.choice([0.5, 1.0, -0.75, 0.3])
        limit = start + delta * g.choice([-1.0, 0.0, 3.0, 4.5, 7.2])
    ins = [g.const(np.array(v, dt), dt) for v in (start, limit, delta)]
    g.node("Range", ins)


def op_shape(g):
    x = g.pick() or g.fresh(F32, g.shape())
    if g.chance(0.3):
        g.node("Size", [x])
        return
    attrs = {}
    if g.opset >= 15 and g.chance(0.4):
        attrs["start"] = g.randint(-x.rank - 1, x.rank + 1)
        if g.chance(0.5):
            attrs["end"] = g.randint(-x.rank - 1, x.rank + 1)
    g.node("Shape", [x], **attrs)


def op_constant_of_shape(g):
    shape = [g.dim() for _ in range(g.randint(0, 3))]
    src = g.pick(lambda v: v.value is not None and v.rank == 1 and v.dt == I64 and 0 <= v.value.min(initial=0)
                 and v.value.size <= 4 and int(np.prod(v.value)) <= 500)
    shp = src if src is not None and g.chance(0.5) else g.const(np.array(shape, np.int64))
    val = None
    if g.chance(0.7):
        dt = g.choice([F32, I64, I32, BOOL, F16])
        val = nh.from_array(np.array([g.choice([0, 1, -2.5, 7]) if dt != BOOL else True], dt))
    g.node("ConstantOfShape", [shp], value=val)


def op_constant(g):
    if g.chance(0.3) and g.opset >= 12:
        kind = g.choice(["value_float", "value_floats", "value_int", "value_ints"])
        v = {"value_float": 1.5, "value_floats": [1.0, -2.0, 0.5], "value_int": 3, "value_ints": [1, 2, 3]}[kind]
        g.node("Constant", [], **{kind: v})
        return
    dt = g.choice([F32, F32, I64, BOOL])
    g.node("Constant", [], value=nh.from_array(g.data(dt, g.shape(hi=2))))


def op_trilu(g):
    if g.opset < 14:
        raise Reject("Trilu needs opset 14")
    x = g.pick(lambda v: 2 <= v.rank <= 4) or g.fresh(F32, g.shape(lo=2))
    ins = [x]
    if g.chance(0.6):
        ins.append(g.const(np.array(g.randint(-4, 4), np.int64)))
    g.node("Trilu", ins, bound=x.bound, upper=g.randint(0, 1) if g.chance(0.7) else None)


def op_loss(g):
    op = g.choice(["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
    n, c = g.randint(1, 4), g.randint(1, 5)
    extra = (g.randint(1, 3),) if g.chance(0.3) else ()
    x = g.pick(lambda v: v.rank == 2 + len(extra) and v.shape[1] > 0, dts=g.floats)
    if x is None:
        x = g.fresh(F32, (n, c) + extra)
    n, c, extra = x.shape[0], x.shape[1], x.shape[2:]
    attrs = {}
    lab = g.rng.integers(0, c, size=(n,) + extra)
    if g.chance(0.3):
        ii = g.choice([-100, 0, 1])
        attrs["ignore_index"] = ii
        lab[g.rng.random(lab.shape) < 0.3] = ii
    labels = g.fresh(I64, lab.shape, init_p=0.0)
    g.feeds[labels.name] = lab.astype(np.int64)
    ins = [x, labels]
    if g.chance(0.3):
        ins.append(g.fresh(x.dt, (c,), init_p=0.8, positive=True, param=True))
    if g.chance(0.7):
        attrs["reduction"] = g.choice(["none", "sum", "mean"])
    n_out = 2 if op == "SoftmaxCrossEntropyLoss" and g.chance(0.3) else 1
    g.node(op, ins, n_out=n_out, **attrs)


def op_shape_chain(g):
    """Shape arithmetic: Shape → Gather/Slice → Mul/Add/Concat, then used as a shape."""
    x = g.pick(lambda v: v.rank >= 2 and v.kind != "init") or g.fresh(F32, g.shape(lo=2))
    sh = g.node("Shape", [x])[0]
    head = g.node("Slice", [sh, g.const(np.array([0])), g.const(np.array([1]))])[0]
    rest = g.node("Slice", [sh, g.const(np.array([1])), g.const(np.array([I64_MAX]))])[0]
    prod = g.node("ReduceProd", [rest], keepdims=1)[0]
    target = g.node("Concat", [head, prod], axis=0)[0]
    g.node("Reshape", [x, target], bound=x.bound)


def op_shrink(g):
    x = g.float_val()
    if g.opset >= 10 and g.chance(0.4):
        g.node("ThresholdedRelu", [x], bound=x.bound, alpha=g.choice([1.0, 0.0, -0.5, 2.0, None]))
    else:
        bias = g.choice([0.0, 0.5, -1.0, None])
        g.node("Shrink", [x], bound=x.bound + abs(bias or 0.0), lambd=g.choice([0.5, 0.0, 1.0, None]), bias=bias)


def op_hardmax(g):
    x = g.float_val(lo=1, pred=lambda v: all(d > 0 for d in v.shape))
    attrs = {"axis": g.randint(-x.rank, x.rank - 1)} if g.chance(0.7) else {}
    g.node("Hardmax", [x], bound=1.0, **attrs)


def op_lp_norm(g):
    x = g.float_val(lo=1)
    axis = g.randint(-x.rank, x.rank - 1) if g.chance(0.7) else None
    g.node("LpNormalization", [x], bound=1.0, axis=axis, p=g.choice([1, 2, None]))


def op_lp_pool(g):
    x = spatial_input(g, 3, 4)
    p = g.choice([1, 2, 3, None], [2, 2, 1, 2])
    if g.chance(0.3):
        g.node("GlobalLpPool", [x], p=p)
        return
    k, attrs = conv_geometry(g, x.shape[2:], pool=True)
    attrs["kernel_shape"] = k
    if g.opset < 18:
        attrs.pop("dilations", None)
    elif g.chance(0.3) and not attrs.get("auto_pad", "NOTSET").startswith("SAME"):
        attrs["ceil_mode"] = 1
    g.node("LpPool", [x], p=p, **attrs)


def op_eye_like(g):
    x = g.pick(lambda v: v.rank == 2) or g.fresh(g.choice([F32, I64]), (g.dim(), g.dim()))
    dtype = g.choice([None, NP2ONNX[F32], NP2ONNX[I64], NP2ONNX[I32], NP2ONNX[F16]])
    g.node("EyeLike", [x], bound=1.0, dtype=dtype, k=g.choice([0, 1, -1, 2, -3, None]))


def op_reverse_sequence(g):
    x = g.pick(lambda v: v.rank >= 2 and v.numel > 0) or g.fresh(g.float_dt(), g.shape(lo=2))
    time = g.randint(0, 1)
    steps, batch = x.shape[time], x.shape[1 - time]
    lens = g.const(np.array([g.randint(0, steps) for _ in range(batch)]))
    g.node("ReverseSequence", [x, lens], bound=x.bound, time_axis=time, batch_axis=1 - time)


def op_rms_norm(g):
    if g.opset < 23:
        raise Reject("RMSNormalization needs opset 23")
    x = g.float_val(lo=1)
    axis = g.randint(-x.rank, x.rank - 1) if g.chance(0.7) else None
    scale = g.fresh(x.dt, x.shape[-1 if axis is None else axis:], init_p=0.8, param=True)
    g.node("RMSNormalization", [x, scale], axis=axis, epsilon=g.choice([1e-5, 1e-6, 0.1, None]))


def op_grid_sample(g):
    if g.opset < 16:
        raise Reject("GridSample needs opset 16")
    x = spatial_input(g, 4, 5 if g.opset >= 20 else 4)
    old = g.opset < 20
    modes = (["bilinear", "nearest"] if old else ["linear", "nearest"]) + \
        ([("bicubic" if old else "cubic")] if x.rank == 4 else [])
    mode = g.choice(modes)
    out = (x.shape[0],) + tuple(g.randint(1, 4) for _ in range(x.rank - 2)) + (x.rank - 2,)
    grid = g.fresh(x.dt, out)
    g.node("GridSample", [x, grid], mode=mode if g.chance(0.8) else None,
           padding_mode=g.choice(["zeros", "border", "reflection", None]), align_corners=g.choice([0, 1, None]))


def op_roi_align(g):
    x = spatial_input(g, 4, 4)
    if x.shape[0] == 0 or 0 in x.shape[2:] or x.dt == F16:
        raise Reject("RoiAlign of an empty plane or of float16 (onnxruntime has no float16 kernel)")
    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    r = g.randint(1, 4)
    scale = g.choice([1.0, 0.5, 2.0])
    corners = g.rng.uniform(-2.0, max(h, w) / scale + 2.0, size=(r, 4))
    if g.chance(0.7):  # mostly well-formed: x1 <= x2, y1 <= y2
        corners = np.concatenate([np.minimum(corners[:, :2], corners[:, 2:]), np.maximum(corners[:, :2], corners[:, 2:])], 1)
    rois = g.const(corners.astype(x.dt), x.dt)
    batch = g.const(g.rng.integers(0, n, size=r), I64)
    coords = g.choice(["half_pixel", "output_half_pixel", None]) if g.opset >= 16 else None
    g.node("RoiAlign", [x, rois, batch], mode=g.choice(["avg", "max", None]), output_height=g.randint(1, 4),
           output_width=g.randint(1, 4), sampling_ratio=g.choice([0, 0, 1, 2, None]),
           spatial_scale=scale if scale != 1.0 or g.chance(0.5) else None, coordinate_transformation_mode=coords)


OPS = [  # (generator, weight)
    (op_unary, 14), (op_not, 1), (op_dropout, 1), (op_binary, 14), (op_variadic, 2), (op_compare, 3),
    (op_logical, 1), (op_where, 3), (op_clip, 3), (op_cast, 3), (op_reduce, 8), (op_softmax, 3),
    (op_cumsum, 2), (op_arg, 2), (op_matmul, 5), (op_gemm, 3), (op_einsum, 2), (op_conv, 4),
    (op_conv_transpose, 2), (op_pool, 4), (op_batchnorm, 2), (op_layernorm, 3), (op_groupnorm, 4),
    (op_instancenorm, 1), (op_reshape, 4), (op_transpose, 3), (op_squeeze, 2), (op_unsqueeze, 2),
    (op_flatten, 1), (op_concat, 3), (op_split, 3), (op_slice, 4), (op_gather, 4), (op_scatter, 2),
    (op_pad, 3), (op_tile, 1), (op_expand, 2), (op_resize, 3), (op_range, 1), (op_shape, 2),
    (op_constant_of_shape, 1), (op_constant, 1), (op_trilu, 1), (op_loss, 1), (op_shape_chain, 1),
    (op_topk, 2), (op_onehot, 1), (op_depth_space, 1), (op_shrink, 2), (op_hardmax, 1), (op_lp_norm, 1),
    (op_lp_pool, 2), (op_eye_like, 1), (op_reverse_sequence, 1), (op_rms_norm, 2), (op_grid_sample, 2),
    (op_bitwise, 2), (op_roi_align, 2),
]
OP_FUNCS = [f for f, _ in OPS]
OP_WEIGHTS = np.array([w for _, w in OPS], dtype=np.float64) / sum(w for _, w in OPS)
