"""Random valid ONNX graphs over the ops mpc runs (see ir/src/ops.rs, `define_ops!`).

`generate(seed)` returns a `Case`: the model (checked by onnx.checker with full_check, which runs
onnx shape inference in strict mode) and a feed for each graph input. Every node is built by an op
generator that picks operands from the values made so far (or makes new inputs and initializers),
then runs onnx shape inference on that one node to learn its outputs' types: the generator never
computes a shape itself, so the declared output types are onnx's. Integer values whose contents
are known when the graph is built (Shape, constants, arithmetic on them) carry their value, so that
later nodes can read them as shapes, axes or repeats.
"""

import hashlib

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as h
from onnx import numpy_helper as nh


class Reject(Exception):
    """This node (or graph) cannot be built from these choices; try another."""


NP2ONNX = {
    np.dtype("float32"): TP.FLOAT, np.dtype("float16"): TP.FLOAT16, np.dtype("float64"): TP.DOUBLE,
    np.dtype("int64"): TP.INT64, np.dtype("int32"): TP.INT32, np.dtype("int8"): TP.INT8,
    np.dtype("uint8"): TP.UINT8, np.dtype("bool"): TP.BOOL, np.dtype("int16"): TP.INT16,
    np.dtype("uint16"): TP.UINT16, np.dtype("uint32"): TP.UINT32, np.dtype("uint64"): TP.UINT64,
}
ONNX2NP = {v: k for k, v in NP2ONNX.items()}
F32, F16, F64 = np.dtype("float32"), np.dtype("float16"), np.dtype("float64")
I64, I32, BOOL = np.dtype("int64"), np.dtype("int32"), np.dtype("bool")
FLOATS = (F32, F16, F64)
INTS = (I64, I32)
UINTS = tuple(np.dtype(t) for t in ("uint8", "uint16", "uint32", "uint64"))
ALL_INTS = INTS + tuple(np.dtype(t) for t in ("int16", "int8")) + UINTS
I64_MIN, I64_MAX = -(2 ** 63), 2 ** 63 - 1

OPSETS = [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28]
OPSET_WEIGHTS = [4, 4, 4, 4, 32, 32, 6, 7, 7, 3, 4, 3, 3, 3, 2, 4]


def ir_version(opset):
    return 8 if opset <= 18 else (9 if opset <= 20 else 10)


class Val:
    __slots__ = ("name", "dt", "shape", "value", "bound", "kind", "uses")

    def __init__(self, name, dt, shape, value=None, bound=np.inf, kind="node"):
        self.name, self.dt, self.shape = name, np.dtype(dt), tuple(int(d) for d in shape)
        self.value, self.bound, self.kind, self.uses = value, bound, kind, 0

    @property
    def rank(self):
        return len(self.shape)

    @property
    def numel(self):
        return int(np.prod(self.shape, dtype=np.int64))


def data_bound(a):
    if a.size == 0 or a.dtype == BOOL:
        return 1.0
    if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
        return np.inf
    return float(np.max(np.abs(a.astype(np.float64))))


class Case:
    def __init__(self, model, feeds, opset, seed, profile):
        self.model, self.feeds, self.opset, self.seed, self.profile = model, feeds, opset, seed, profile

    @property
    def ops(self):
        return [n.op_type for n in self.model.graph.node]


class Gen:
    MAX_NUMEL = 6000

    def __init__(self, rng, opset, profile):
        self.rng, self.opset, self.profile = rng, opset, profile
        self.nodes, self.inputs, self.inits, self.vals = [], [], [], []
        self.feeds = {}
        self.count = 0
        self.specials = rng.random() < 0.15
        self.floats = [F32] + ([F64] if profile == "f64" else []) + ([F16] if profile == "f16" else [])

    # ------------------------------------------------------------------ names, choices
    def name(self, prefix):
        self.count += 1
        return f"{prefix}{self.count}"

    def chance(self, p):
        return self.rng.random() < p

    def choice(self, seq, p=None):
        if p is not None:
            p = np.asarray(p, dtype=np.float64)
            p = p / p.sum()
        return seq[int(self.rng.choice(len(seq), p=p))]

    def randint(self, lo, hi):
        """An integer in [lo, hi]."""
        return int(self.rng.integers(lo, hi + 1))

    def float_dt(self):
        if len(self.floats) > 1 and self.chance(0.3):
            return self.choice(self.floats[1:])
        return F32

    def dim(self):
        if self.chance(0.02):
            return 0
        return self.choice([1, 2, 3, 4, 5, 6], [3, 4, 4, 3, 2, 1])

    def shape(self, rank=None, lo=0, hi=4):
        if rank is None:
            rank = self.choice(list(range(lo, hi + 1)), [1, 3, 4, 4, 3, 1][lo:hi + 1])
        return tuple(self.dim() for _ in range(rank))

    # ------------------------------------------------------------------ data
    def data(self, dt, shape, positive=False, nonzero=False, lo=-5, hi=5, param=False):
        """Random data; `param`: a weight or statistic, never NaN or Inf (implementations may
        fold parameters, e.g. a batch norm's scale into its shift, which changes what an Inf
        becomes)."""
        return np.asarray(self._data(np.dtype(dt), tuple(shape), positive, nonzero, lo, hi, param))

    def _data(self, dt, shape, positive, nonzero, lo, hi, param):
        rng = self.rng
        if dt == BOOL:
            return np.asarray(rng.random(shape) < 0.5)
        if dt.kind in "iu":
            if positive:
                lo = max(lo, 1)
            a = np.asarray(rng.integers(lo, hi + 1, size=shape))
            if nonzero:
                a[a == 0] = 1
            return a.astype(dt)
        scale = self.choice([1.0, 3.0, 0.1, 10.0, 100.0], [6, 2, 2, 1, 1])
        if dt == F16:
            scale = min(scale, 10.0)
        a = np.asarray(rng.standard_normal(shape) * scale)
        if positive:
            a = np.abs(a) + 0.05
        elif nonzero:
            a[np.abs(a) < 1e-3] = 0.5
        if self.specials and not param and a.size and self.chance(0.5):
            specials = [np.nan, np.inf, -np.inf, -0.0, 0.0]
            if not positive:
                specials += [1e6, -1e6, 1e-40] if dt != F16 else [65504.0, -65504.0, 6e-8]
            k = self.randint(1, max(1, a.size // 4))
            flat = a.reshape(-1)
            for i in rng.choice(a.size, size=k):
                flat[i] = self.choice(specials)
        with np.errstate(over="ignore"):
            return a.astype(dt)

    def new_input(self, dt, shape, data=None, **kw):
        a = self.data(dt, shape, **kw) if data is None else np.asarray(data, dtype=dt)
        v = Val(self.name("x"), dt, shape, kind="input", bound=data_bound(a))
        self.inputs.append(v)
        self.feeds[v.name] = a
        self.vals.append(v)
        return v

    def new_init(self, a, prefix="w"):
        a = np.asarray(a)
        v = Val(self.name(prefix), a.dtype, a.shape, value=a, kind="init", bound=data_bound(a))
        self.inits.append(v)
        return v

    def fresh(self, dt, shape, init_p=0.3, **kw):
        """New data: a graph input, or an initializer (weights)."""
        if self.chance(init_p):
            v = self.new_init(self.data(dt, shape, **kw))
            self.vals.append(v)
            return v
        return self.new_input(dt, shape, **kw)

    def const(self, a, dt=I64):
        """A host operand (axes, shapes, pads...): an initializer, sometimes a Constant node,
        rarely a graph input (mpc takes shape inputs as values)."""
        a = np.asarray(a, dtype=dt)
        r = self.rng.random()
        if r < 0.1:
            v = Val(self.name("k"), a.dtype, a.shape, value=a, kind="node", bound=data_bound(a))
            self.nodes.append(h.make_node("Constant", [], [v.name], name=self.name("n"),
                                          value=nh.from_array(a, v.name)))
            return v
        if r < 0.14:  # "s": never perturbed (harness.perturbable)
            v = Val(self.name("s"), a.dtype, a.shape, value=a, kind="input", bound=data_bound(a))
            self.inputs.append(v)
            self.feeds[v.name] = a
            return v
        return self.new_init(a, prefix="c")

    # ------------------------------------------------------------------ picking operands
    def pick(self, pred=lambda v: True, dts=None, fresh_p=0.0):
        """An existing value satisfying pred (node outputs not yet read preferred), or None."""
        if self.chance(fresh_p):
            return None
        cands = [v for v in self.vals if (dts is None or v.dt in dts) and pred(v)]
        if not cands:
            return None
        w = np.array([4.0 if (v.kind == "node" and v.uses == 0) else 1.0 for v in cands])
        w[-min(len(w), 3):] *= 2.0
        return cands[int(self.rng.choice(len(cands), p=w / w.sum()))]

    def float_val(self, lo=0, hi=4, pred=lambda v: True, fresh_p=0.15, dts=None, **kw):
        dts = dts or self.floats
        v = self.pick(lambda v: lo <= v.rank <= hi and pred(v), dts=dts, fresh_p=fresh_p)
        if v is None:
            v = self.fresh(self.choice(dts) if self.chance(0.3) else dts[0], self.shape(lo=lo, hi=hi), **kw)
        return v

    def operand_like(self, shape, dt, **kw):
        """An operand of exactly this shape and dtype: an existing one, else new data."""
        v = self.pick(lambda v: v.shape == tuple(shape) and v.kind != "init", dts=[dt], fresh_p=0.3)
        return v if v is not None else self.fresh(dt, shape, **kw)

    def bcast_shape(self, shape):
        """A shape that broadcasts with `shape` (either way)."""
        s = list(shape)
        if s and self.chance(0.4):
            s = s[self.randint(0, len(s)):]
        s = [1 if self.chance(0.3) else d for d in s]
        if self.chance(0.1) and len(s) < 4:
            s = [self.choice([1, 2])] + s
        return tuple(s)

    # ------------------------------------------------------------------ nodes
    def node(self, op, ins, n_out=1, bound=np.inf, same_as=None, **attrs):
        """Adds a node; returns its output Vals (types from onnx shape inference; `same_as`: the
        input whose type the outputs have, for an op onnx infers nothing for, such as the
        function op GroupNormalization-21)."""
        outs = [self.name("v") for _ in range(n_out)]
        in_names = ["" if v is None else v.name for v in ins]
        while in_names and in_names[-1] == "":
            in_names.pop()
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = h.make_node(op, in_names, outs, name=self.name("n"), **attrs)
        gin, inits, seen = [], [], set()
        for v in ins:
            if v is None or v.name in seen:
                continue
            seen.add(v.name)
            if v.value is not None:
                inits.append(nh.from_array(v.value, v.name))
            else:
                gin.append(h.make_tensor_value_info(v.name, NP2ONNX[v.dt], v.shape))
        m = h.make_model(h.make_graph([node], "one", gin, [], initializer=inits),
                         opset_imports=[h.make_opsetid("", self.opset)], ir_version=ir_version(self.opset))
        try:
            onnx.checker.check_model(m)
            m = onnx.shape_inference.infer_shapes(m, check_type=True, strict_mode=True, data_prop=True)
        except Exception as e:
            raise Reject(f"{op}: {str(e).splitlines()[0][:200]}")
        infos = {vi.name: vi for vi in m.graph.value_info}
        result = []
        for o in outs:
            vi = infos.get(o)
            if (vi is None or not vi.type.tensor_type.HasField("shape")) and same_as is not None:
                vi = h.make_tensor_value_info(o, NP2ONNX[ins[same_as].dt], ins[same_as].shape)
            if vi is None or not vi.type.tensor_type.HasField("shape"):
                raise Reject(f"{op}: output type unknown")
            tt = vi.type.tensor_type
            if tt.elem_type not in ONNX2NP:
                raise Reject(f"{op}: output dtype {tt.elem_type}")
            dims = []
            for d in tt.shape.dim:
                if not d.HasField("dim_value") or d.dim_value < 0:
                    raise Reject(f"{op}: output shape not static")
                dims.append(d.dim_value)
            v = Val(o, ONNX2NP[tt.elem_type], dims, bound=bound)
            if v.numel > self.MAX_NUMEL:
                raise Reject(f"{op}: output too large")
            result.append(v)
        # Values known at build time (shape arithmetic): evaluate the node now.
        if op == "Shape":
            result[0].value = np.array(ins[0].shape[attrs.get("start", 0):attrs.get("end", None)], np.int64)
            result[0].bound = data_bound(result[0].value)
        elif op == "Size":
            result[0].value = np.array(ins[0].numel, np.int64)
            result[0].bound = float(ins[0].numel)
        elif op != "Dropout" and all(v is None or v.value is not None for v in ins) \
                and all(r.numel <= 64 and r.dt.kind in "ib" for r in result):
            try:
                vals = eval_node(m, outs)
            except Exception as e:
                raise Reject(f"{op}: evaluation failed: {str(e).splitlines()[0][:120]}")
            for r, a in zip(result, vals):
                r.value = a
                r.bound = data_bound(a)
        for v in ins:
            if v is not None:
                v.uses += 1
        self.nodes.append(node)
        self.vals.extend(result)
        return result

    # ------------------------------------------------------------------ the graph
    def finish(self, seed):
        used = {i for n in self.nodes for i in n.input}
        produced = [o for n in self.nodes for o in n.output]
        vals = {v.name: v for v in self.vals}
        outs = [o for o in produced if o not in used and o in vals]
        extra = [o for o in produced if o in used and o in vals and self.chance(0.1)]
        outs = list(dict.fromkeys(outs + extra))[:8]
        if not outs:
            raise Reject("no outputs")
        inputs = [v for v in self.inputs if v.name in used]
        inits = [v for v in self.inits if v.name in used]
        graph = h.make_graph(
            list(self.nodes), "fuzz",
            [h.make_tensor_value_info(v.name, NP2ONNX[v.dt], v.shape) for v in inputs],
            [h.make_tensor_value_info(o, NP2ONNX[vals[o].dt], vals[o].shape) for o in outs],
            initializer=[nh.from_array(v.value, v.name) for v in inits])
        model = h.make_model(graph, opset_imports=[h.make_opsetid("", self.opset)],
                             ir_version=ir_version(self.opset), producer_name="mpc-differential")
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception as e:
            raise Reject(f"graph: {str(e).splitlines()[0][:200]}")
        feeds = {v.name: self.feeds[v.name] for v in inputs}
        return Case(model, feeds, self.opset, seed, self.profile)


_EVAL_CACHE = {}


def eval_node(model, outs):
    import onnxruntime as ort
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    vis = {vi.name: vi for vi in m.graph.value_info}
    m.graph.output.extend([vis[o] for o in outs])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 4
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {}
    for gi in m.graph.input:
        raise Reject("eval with graph inputs")
    return s.run(None, feeds)


def broadcastable(a, b):
    for x, y in zip(reversed(a), reversed(b)):
        if x != y and x != 1 and y != 1:
            return False
    return True


def generate(seed, stats=None):
    """The graph of `seed` (a tuple of ints), or raises Reject after too many failed tries."""
    rng = np.random.default_rng(list(seed))
    opset = int(rng.choice(OPSETS, p=np.array(OPSET_WEIGHTS) / sum(OPSET_WEIGHTS)))
    profile = rng.choice(["f32", "f64", "f16"], p=[0.88, 0.06, 0.06])
    g = Gen(rng, opset, str(profile))
    # Focus: most graphs favour a few ops, so that chains of one kind appear.
    from gen_ops import OPS, OP_FUNCS, OP_WEIGHTS
    weights = OP_WEIGHTS.copy()
    if g.chance(0.7):
        for i in rng.choice(len(OPS), size=3, replace=False):
            weights[i] *= 6
        weights /= weights.sum()
    target = int(rng.choice([1, 2, 3, 5, 8, 12, 20, 30], p=[.12, .12, .13, .16, .17, .14, .1, .06]))
    for _ in range(g.randint(1, 2)):
        g.fresh(F32 if g.chance(0.85) else g.float_dt(), g.shape(), init_p=0.0)
    tries = 0
    while len(g.nodes) < target and tries < target * 8:
        tries += 1
        f = OP_FUNCS[int(rng.choice(len(OPS), p=weights))]
        n_nodes, n_vals, n_in, n_init, count = len(g.nodes), len(g.vals), len(g.inputs), len(g.inits), g.count
        try:
            f(g)
        except Reject as e:
            if stats is not None:
                stats[f.__name__ + ": " + str(e)[:60]] = stats.get(f.__name__ + ": " + str(e)[:60], 0) + 1
            # roll back what a failed generator left half made
            del g.nodes[n_nodes:]
            del g.vals[n_vals:]
            for v in g.inputs[n_in:]:
                g.feeds.pop(v.name, None)
            del g.inputs[n_in:]
            del g.inits[n_init:]
            continue
    if not g.nodes:
        raise Reject("empty graph")
    return g.finish(seed)


def model_hash(model):
    return hashlib.sha1(model.SerializeToString()).hexdigest()[:8]
