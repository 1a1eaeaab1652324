"""Running a graph: onnxruntime (the oracle), mpc (`mpc run`, `mpc compile`), and comparing them."""

import os
import re
import signal
import subprocess
import warnings

import numpy as np
import onnx
from safetensors.numpy import load_file, save_file

try:
    import onnxruntime as ort

    # Kernel constructors log to the default logger (RoiAlign warns of its max mode each time).
    ort.set_default_logger_severity(3)
except ImportError:  # pragma: no cover
    ort = None


class OracleError(Exception):
    pass


PHASE = None  # a shared buffer naming what the worker process is doing (campaign.Worker)


def phase(name):
    if PHASE is not None:
        PHASE.value = name.encode()[:79]


def session(model_bytes):
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 4
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def ort_run(model_bytes, feeds, sess=None):
    """{output name: array} as onnxruntime computes it; OracleError when it refuses or fails."""
    phase("onnxruntime")
    try:
        s = sess or session(model_bytes)
        names = [o.name for o in s.get_outputs()]
        return dict(zip(names, s.run(None, feeds))), s
    except Exception as e:
        raise OracleError(first_line(str(e)))


def simulate_f16(model):
    """The model with every float16 value held in float32 and rounded to float16 by an explicit
    Cast pair after the node that makes it: each op computes in float32 on float16 values and its
    result is rounded once, which is what ONNX asks of an op on float16 (and what mpc's CPU device
    does). onnxruntime's own CPU float16 is not that: it runs ops that have no float16 kernel in
    float32 behind inserted Casts, and drops a graph's Cast pairs around them
    (docs/differential.md), so float16 graphs go to the oracle in this form. Graph inputs and
    outputs keep their dtypes."""
    F16, F32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    inferred = onnx.shape_inference.infer_shapes(model)
    g0 = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(g0.value_info) + list(g0.input) + list(g0.output)}
    types.update({t.name: t.data_type for t in g0.initializer})
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    to32 = lambda t: onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float32), t.name)
    for t in g.initializer:
        if t.data_type == F16:
            t.CopyFrom(to32(t))
    rename = {}
    nodes = []
    for vi in g.input:
        if vi.type.tensor_type.elem_type == F16:
            rename[vi.name] = vi.name + "__f32"
            nodes.append(onnx.helper.make_node("Cast", [vi.name], [vi.name + "__f32"], to=F32))
    outputs16 = {vi.name for vi in g.output if vi.type.tensor_type.elem_type == F16}
    for n in g.node:
        n2 = onnx.NodeProto()
        n2.CopyFrom(n)
        for i, x in enumerate(n2.input):
            if x in rename:
                n2.input[i] = rename[x]
        for a in n2.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F16:
                a.t.CopyFrom(to32(a.t))
        if n2.op_type == "Clip" and types.get(n.output[0]) == F16:
            # An absent bound is float16's largest finite value (an infinity becomes it, as
            # onnxruntime's float16 Clip and mpc do), not float32's.
            ins = list(n2.input) + [""] * (3 - len(n2.input))
            for k, v in ((1, -65504.0), (2, 65504.0)):
                if not ins[k]:
                    ins[k] = f"{n2.output[0]}__f16_bound{k}"
                    g.initializer.append(onnx.numpy_helper.from_array(np.array(v, np.float32), ins[k]))
            del n2.input[:]
            n2.input.extend(ins)
        cast16 = n2.op_type == "Cast" and any(a.name == "to" and a.i == F16 for a in n2.attribute)
        tail = []
        for i, o in enumerate(n2.output):
            if not o or types.get(o) != F16:
                continue
            final = o + "__f32" if o in outputs16 else o
            rename[o] = final
            n2.output[i] = o + "__sim"
            if cast16:
                tail.append(onnx.helper.make_node("Cast", [o + "__sim"], [final], to=F32))
            else:
                tail.append(onnx.helper.make_node("Cast", [o + "__sim"], [o + "__r16"], to=F16))
                tail.append(onnx.helper.make_node("Cast", [o + "__r16"], [final], to=F32))
            if o in outputs16:
                tail.append(onnx.helper.make_node("Cast", [final], [o], to=F16))
        nodes.append(n2)
        nodes.extend(tail)
    del g.node[:]
    g.node.extend(nodes)
    del g.value_info[:]
    return m


def explicit_same_pads(model):
    """The model with MaxPool, AveragePool, LpPool and Conv nodes whose auto_pad is SAME_UPPER or
    SAME_LOWER given the explicit pads the ONNX spec computes for them: onnxruntime's own SAME
    padding is wrong when a dilation is above 1 or a kernel is smaller than its stride (a wrong
    output size, wrong values or a refusal; docs/differential.md), while its explicit pads agree
    with the spec's formula in every case tried. None when no node needs it."""
    ops = ("MaxPool", "AveragePool", "LpPool", "Conv")
    if not any(n.op_type in ops and any(a.name == "auto_pad" and a.s.startswith(b"SAME") for a in n.attribute)
               for n in model.graph.node):
        return None
    inferred = onnx.shape_inference.infer_shapes(model)
    g0 = inferred.graph
    shapes = {vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
              for vi in list(g0.value_info) + list(g0.input) + list(g0.output)}
    shapes.update({t.name: list(t.dims) for t in g0.initializer})
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        attrs = {a.name: a for a in n.attribute}
        if n.op_type not in ops or "auto_pad" not in attrs or not attrs["auto_pad"].s.startswith(b"SAME"):
            continue
        xs = shapes.get(n.input[0])
        if not xs or any(d is None for d in xs):
            continue
        sp = xs[2:]
        if "kernel_shape" in attrs:
            k = list(attrs["kernel_shape"].ints)
        else:
            ws = shapes.get(n.input[1])
            if not ws or any(d is None for d in ws):
                continue
            k = ws[2:]
        s = list(attrs["strides"].ints) if "strides" in attrs else [1] * len(sp)
        d = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * len(sp)
        upper = attrs["auto_pad"].s == b"SAME_UPPER"
        begin, end = [], []
        for i, x in enumerate(sp):
            out = -(-x // s[i])
            total = max(0, (out - 1) * s[i] + (k[i] - 1) * d[i] + 1 - x)
            b = total // 2 if upper else total - total // 2
            begin.append(b)
            end.append(total - b)
        keep = [a for a in n.attribute if a.name not in ("auto_pad", "pads")]
        del n.attribute[:]
        n.attribute.extend(keep + [onnx.helper.make_attribute("pads", begin + end)])
    return m


def non_negative_resize_axes(model):
    """The model with each Resize's negative `axes` counted from the front: the reference
    evaluator fails on negative ones ("axes don't match array"), which the spec allows."""
    if not any(n.op_type == "Resize" and any(a.name == "axes" and any(v < 0 for v in a.ints) for a in n.attribute)
               for n in model.graph.node):
        return model
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return model
    g0 = inferred.graph
    ranks = {vi.name: len(vi.type.tensor_type.shape.dim) for vi in list(g0.value_info) + list(g0.input)
             if vi.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in g0.initializer})
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        r = ranks.get(n.input[0]) if n.op_type == "Resize" and n.input else None
        for a in n.attribute:
            if r is not None and a.name == "axes":
                fixed = [v + r if v < 0 else v for v in a.ints]
                del a.ints[:]
                a.ints.extend(fixed)
    return m


def oracle_model(model):
    """What onnxruntime runs for `model`: the model, with SAME padding made explicit
    (explicit_same_pads) and float16 simulated (simulate_f16) where it needs them."""
    m = explicit_same_pads(model) or model
    return simulate_f16(m) if has_dtype(m, onnx.TensorProto.FLOAT16) else m


def oracle_run(model, feeds):
    """onnxruntime's outputs for `model` (float16 simulated): {name: array}; OracleError."""
    try:
        m = oracle_model(model)
    except Exception as e:
        raise OracleError(f"simulate_f16: {first_line(str(e))}")
    return ort_run(m.SerializeToString(), feeds)[0]


def reference_run(model, feeds, timeout=20):
    """The onnx reference evaluator (a second opinion), or None when it fails."""
    from onnx.reference import ReferenceEvaluator

    def alarm(*_):
        raise TimeoutError()

    phase("onnx reference evaluator")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            # its SAME padding fails too (a kernel of 1: "tuple index out of range"); the spec's pads
            # made explicit are the same graph
            ref = ReferenceEvaluator(non_negative_resize_axes(explicit_same_pads(model) or model))
            outs = ref.run(None, feeds)
        return {o.name: np.asarray(a) for o, a in zip(model.graph.output, outs)}
    except Exception:
        return None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def first_line(s):
    for line in s.splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


class MpcResult:
    def __init__(self, status, outputs=None, rc=0, message=""):
        self.status, self.outputs, self.rc, self.message = status, outputs or {}, rc, message

    def signature(self):
        """What tells one crash from another: the panic's location file and message head."""
        m = re.search(r"panicked at ([^:\n]+):\d+:\d+:\s*\n?(.*)", self.message)
        if m:
            return f"panic {m.group(1)}: {normalise(m.group(2))[:80]}"
        return f"exit {self.rc}: {normalise(first_line(self.message))[:80]}"


def run_process(cmd, timeout):
    """(exit code, stderr, stdout), or (None, "", "") past the timeout. The binary may be replaced
    by a build while a campaign runs: while it cannot be started, this waits and tries again."""
    import time
    for attempt in range(60):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
            return p.returncode, p.stderr, p.stdout
        except subprocess.TimeoutExpired:
            return None, "", ""
        except OSError:  # ENOENT, ETXTBSY, EACCES while the linker writes it
            if attempt == 59:
                raise
            time.sleep(1)


def mpc_run(mpc, model_path, feeds, work, policy="fp32", timeout=30):
    inp = os.path.join(work, "inputs.safetensors")
    out = os.path.join(work, "outputs.safetensors")
    if os.path.exists(out):
        os.remove(out)
    phase("mpc run")
    save_file({k: np.require(v, requirements="C") for k, v in feeds.items()}, inp)
    rc, err, _ = run_process([mpc, "run", model_path, "--inputs", inp, "-o", out, "--policy", policy], timeout)
    failed = exit_result("run", rc, err, timeout)
    if failed:
        return failed
    try:
        outs = load_file(out)
    except Exception as e:
        return MpcResult("crash", rc=rc, message=f"unreadable outputs: {e}")
    return MpcResult("ok", outputs=outs, rc=0)


def mpc_compile(mpc, model_path, out_path, policy="mixed", timeout=30):
    if os.path.exists(out_path):
        os.remove(out_path)
    rc, err, _ = run_process([mpc, "compile", model_path, "--policy", policy, "-o", out_path], timeout)
    return exit_result("compile", rc, err, timeout) or MpcResult("ok")


def exit_result(command, rc, err, timeout):
    """How an `mpc COMMAND` process ended, unless it succeeded: a timeout, a refusal (exit 2, one
    line) or a crash (any other exit)."""
    if rc is None:
        return MpcResult("timeout", message=f"mpc {command} took over {timeout} s")
    if rc == 2:
        return MpcResult("refused", rc=rc, message=first_line(err))
    if rc != 0:
        return MpcResult("crash", rc=rc, message=err[-3000:])
    return None


def normalise(msg):
    """A refusal message without the parts that differ from graph to graph (paths, names,
    numbers), so that messages group by reason."""
    msg = re.sub(r"(/[^\s:'\"`]+)+", "FILE", msg)
    msg = re.sub(r"[`'\"][^`'\"]*[`'\"]", "'…'", msg)
    msg = re.sub(r"\b[nvxwck]\d+\b", "NAME", msg)
    msg = re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "N", msg)
    msg = re.sub(r"\[[N, ]*\]", "[…]", msg)
    return msg.strip()


def refusal_reason(msg, words=9):
    """The first words of a refusal, normalised: the key its count is reported under."""
    m = normalise(msg)
    m = re.sub(r"^(error:\s*)?(FILE:?\s*)?", "", m)
    return " ".join(m.split()[:words])


# ---------------------------------------------------------------------- comparing
TIGHT = {"f": (1e-5, 1e-4), np.dtype("float16"): (1e-3, 2e-3)}
LOOSE = {"f": (1e-3, 1e-2), np.dtype("float16"): (2e-3, 1e-2)}


def tolerance(dt, loose):
    table = LOOSE if loose else TIGHT
    return table.get(np.dtype(dt), table["f"])


def close_mask(got, want, atol, rtol):
    g = got.astype(np.float64)
    w = want.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        ok = (g == w) | (np.isnan(g) & np.isnan(w))
        fin = np.isfinite(g) & np.isfinite(w)
        ok |= fin & (np.abs(g - w) <= atol + rtol * np.abs(w))
    return ok


def diff(got, want, loose=False, scale=1.0):
    """None when `got` is `want` within tolerance (times `scale`), else a dict saying how it
    differs."""
    if got is None:
        return {"reason": "missing output"}
    if got.dtype != want.dtype:
        return {"reason": f"dtype {got.dtype} != {want.dtype}"}
    if got.shape != want.shape:
        return {"reason": f"shape {list(got.shape)} != {list(want.shape)}"}
    if want.dtype.kind == "f":
        atol, rtol = tolerance(want.dtype, loose)
        bad = ~close_mask(got, want, atol * scale, rtol * scale)
    else:
        bad = got != want
    if not bad.any():
        return None
    i = tuple(int(j) for j in np.argwhere(bad)[0])
    g64, w64 = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore"):
        err = np.where(bad, np.abs(g64 - w64), 0)
    return {"reason": "values", "count": int(bad.sum()), "total": int(bad.size), "index": list(i),
            "got": repr(got[i].item()), "want": repr(want[i].item()),
            "max_abs": float(np.nanmax(err)) if np.isfinite(err).any() else float("nan"), "mask": bad}


def compare(got, want, loose=False, names=None, scale=1.0):
    """{output: diff} for the outputs that differ."""
    out = {}
    for name in names or want:
        d = diff(got.get(name), want[name], loose, scale)
        if d is not None:
            out[name] = d
    return out


PERTURB = {np.dtype("float32"): 1e-6, np.dtype("float16"): 2e-3, np.dtype("float64"): 1e-13}


def perturbable(name):
    """Graph inputs and initializers holding data (not shapes, axes or scales)."""
    return name[:1] in ("x", "w", "v")


def perturbed_model(model, rng, eps_scale):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        if perturbable(t.name):
            a = onnx.numpy_helper.to_array(t)
            if a.dtype.kind == "f" and a.size:
                t.CopyFrom(onnx.numpy_helper.from_array(jitter(a, rng, eps_scale), t.name))
    return m


def jitter(a, rng, eps_scale):
    eps = PERTURB.get(a.dtype, 1e-6) * eps_scale
    with np.errstate(invalid="ignore", over="ignore"):
        # np.asarray: a 0-d array times a 0-d array is a numpy scalar, which onnxruntime refuses as a feed
        return np.asarray(a * (1 + eps * rng.uniform(-1, 1, size=a.shape))).astype(a.dtype)


def unexplained(model, feeds, want, got, diffs, loose=False, trials=6, seed=0):
    """The outputs in `diffs` whose difference is not explained by conditioning. A difference is
    explained when every element that differs is one that onnxruntime itself moves by about as
    much (or flips, for integers and bools) when the float inputs move by a few ulps: the graph is
    ill-conditioned there and the difference is rounding, not a bug."""
    values = {n for n, d in diffs.items() if d["reason"] == "values"}
    left = {n: d for n, d in diffs.items() if n not in values}
    if not values:
        return left
    rng = np.random.default_rng(seed)
    eps_scale = 1000.0 if loose else 1.0
    pert = {name: np.zeros(want[name].shape, dtype=np.float64) for name in values}
    flips = {name: np.zeros(want[name].shape, dtype=bool) for name in values}
    base = oracle_model(model)
    for _ in range(trials):
        m = perturbed_model(base, rng, eps_scale)
        f = {k: (jitter(v, rng, eps_scale) if v.dtype.kind == "f" and perturbable(k) else v) for k, v in feeds.items()}
        try:
            out, _ = ort_run(m.SerializeToString(), f)
        except OracleError:
            continue
        for name in values:
            o, w = out.get(name), want[name]
            if o is None or o.shape != w.shape:
                continue
            if w.dtype.kind == "f":
                o64, w64 = o.astype(np.float64), w.astype(np.float64)
                with np.errstate(invalid="ignore"):
                    nan_flip = np.isnan(o64) != np.isnan(w64)
                    inf_flip = (np.isinf(o64) | np.isinf(w64)) & (o64 != w64)
                    d = np.where(nan_flip | inf_flip, np.inf, np.abs(o64 - w64))
                d = np.nan_to_num(d, nan=0.0)
                pert[name] = np.maximum(pert[name], d)
            else:
                flips[name] |= o != w
    for name in values:
        d = diffs[name]
        mask, w, g = d["mask"], want[name], got[name]
        if w.dtype.kind == "f":
            atol, rtol = tolerance(w.dtype, loose)
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                dm = np.where(np.isnan(g64) != np.isnan(w64), np.inf, np.abs(g64 - w64))
                dm = np.nan_to_num(dm, nan=0.0, posinf=np.inf)
                ok = dm <= atol + rtol * np.abs(np.nan_to_num(w64)) + 4 * pert[name]
            if not ok[mask].all():
                left[name] = d
        elif not flips[name][mask].all():
            left[name] = d
    return left


def in_float64(model):
    """The model with every float32 tensor (inputs, outputs, values, initializers, Constant
    values) in float64: the reference evaluator's result of it, rounded to float32, is the
    exact answer to a float32 graph's rounding error."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for t in g.initializer:
        if t.data_type == onnx.TensorProto.FLOAT:
            t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t).astype(np.float64), t.name))
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == onnx.TensorProto.FLOAT:
                a.i = onnx.TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == onnx.TensorProto.FLOAT:
                a.t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(a.t).astype(np.float64)))
    return m


def exact_opinion(model, feeds, want, got, names):
    """Which side the float64 evaluation of a float32 graph (the reference evaluator on
    in_float64(model)) takes: "mpc", "onnxruntime", "neither", or "failed"."""
    f64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    ref = reference_run(in_float64(model), f64)
    if ref is None or any(n not in ref or np.asarray(ref[n]).shape != want[n].shape for n in names):
        return "failed"
    ref = {n: np.asarray(ref[n]).astype(want[n].dtype) for n in names}
    if not compare(got, ref, names=names):
        return "mpc"
    if not compare(ref, want, names=names):
        return "onnxruntime"
    return "neither"


def second_opinion(model, feeds, want, got, names, loose=False):
    """Which side the onnx reference evaluator takes on these outputs: "mpc", "onnxruntime",
    "neither", or "failed" when it cannot run the graph."""
    ref = reference_run(model, feeds)
    if ref is None or any(n not in ref for n in names):
        return "failed"
    ref = {n: np.asarray(ref[n]).astype(want[n].dtype) if np.asarray(ref[n]).shape == want[n].shape
           else np.asarray(ref[n]) for n in names}
    if not compare(got, ref, loose=loose, names=names, scale=10.0):
        return "mpc"
    if not compare(ref, want, loose=loose, names=names, scale=10.0):
        return "onnxruntime"
    return "neither"


def has_dtype(model, elem_type):
    g = model.graph
    if any(t.data_type == elem_type for t in g.initializer):
        return True
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.tensor_type.elem_type == elem_type:
            return True
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == elem_type:
                return True
    return False
