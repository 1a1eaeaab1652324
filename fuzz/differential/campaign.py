#!/usr/bin/env python3
"""Differential testing of mpc against onnxruntime on small random ONNX graphs.

    python3 fuzz/differential/campaign.py --mpc target/release/mpc --graphs N --seed S [--out DIR]
        [--time-budget SECONDS] [--jobs J] [--ci] [--only I] [--replay DIR...]

Each graph (gen.py) runs in onnxruntime (CPU, graph optimisations off) and in `mpc run --policy
fp32`; outputs are compared tightly (floats |got-want| <= 1e-5 + 1e-4|want|, NaN == NaN, integers,
bools, shapes and dtypes exactly). A graph that matches is then compiled with `mpc compile
--policy mixed`; the written model must pass onnx.checker (full_check), and onnxruntime and `mpc
run` on it must agree within an fp16 tolerance (1e-3 + 1e-2|want|). A difference that onnxruntime
itself shows when the float inputs move by a few ulps is counted as ill-conditioned, not as a
mismatch. onnxruntime gets SAME padding made explicit and float16 simulated in float32 with
explicit rounding, where its own are wrong (harness.oracle_model). Every mismatch, crash and invalid model written is shrunk (minimize.py) to a reproducer
in the ONNX backend node-test layout under --out. See docs/differential.md.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import numpy as np  # noqa: E402
import onnx  # noqa: E402

import gen  # noqa: E402
import harness as hs  # noqa: E402
import minimize as mz  # noqa: E402
from report import Report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))

# The --ci run: its seed and size (about 2-3 minutes on one core; docs/differential.md).
CI_SEED = 1
CI_GRAPHS = 3500


# ---------------------------------------------------------------------- one graph
class Outcome:
    def __init__(self, kind, **detail):
        self.kind, self.detail = kind, detail

    def __bool__(self):
        return True


def evaluate_fp32(model, feeds, mpc, work, second_opinion=True):
    """The fp32 verdict: oracle_refused, refused, crash, timeout, mismatch, ill_conditioned,
    onnx_shape (mpc agrees with onnxruntime on an output's shape, onnx shape inference does not)
    or matched. mpc runs even when the oracle refuses the graph, so a crash is found anyway. A
    mismatch says which side the onnx reference evaluator takes (`reference`)."""
    try:
        want, oracle_error = hs.oracle_run(model, feeds), None
    except hs.OracleError as e:
        want, oracle_error = None, str(e)
    path = os.path.join(work, "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    r = hs.mpc_run(mpc, path, feeds, work)
    if r.status in ("crash", "timeout"):
        return Outcome(r.status, message=r.message, signature=r.signature() if r.status == "crash" else "timeout",
                       oracle_refused=want is None)
    if want is None:
        return Outcome("oracle_refused", message=oracle_error, mpc=r.status)
    if r.status == "refused":
        return Outcome("refused", message=r.message)
    diffs = hs.compare(r.outputs, want)
    if not diffs:
        shapes = onnx_shape_disagreements(model, r.outputs)
        if shapes:
            return Outcome("onnx_shape", want=want, got=r.outputs, shapes=shapes,
                           reference=hs.second_opinion(model, feeds, want, r.outputs, list(shapes))
                           if second_opinion else "not asked")
        return Outcome("matched", want=want, got=r.outputs)
    diffs = hs.unexplained(model, feeds, want, r.outputs, diffs)
    if not diffs:
        return Outcome("ill_conditioned", want=want, got=r.outputs)
    ref = hs.second_opinion(model, feeds, want, r.outputs, list(diffs)) if second_opinion else "not asked"
    return Outcome("mismatch", want=want, got=r.outputs, diffs=diffs, reference=ref)


def onnx_shape_disagreements(model, got):
    """{output: (onnx's shape, the shape mpc and onnxruntime computed)} where onnx shape
    inference gives another static shape."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = list(m.graph.output)
    del m.graph.output[:]
    for o in outs:  # each output read by an Identity, so that inference types it in value_info
        m.graph.node.append(onnx.helper.make_node("Identity", [o.name], [o.name + "__chk"]))
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(o)
        vi.name = o.name + "__chk"
        del vi.type.tensor_type.shape.dim[:]
        vi.type.tensor_type.ClearField("shape")
        m.graph.output.append(vi)
    try:
        inferred = onnx.shape_inference.infer_shapes(m)
    except Exception:
        return {}
    found = {}
    for vi in inferred.graph.value_info:
        if vi.name in got and vi.type.tensor_type.HasField("shape"):
            dims = vi.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                shape = [d.dim_value for d in dims]
                if shape != list(got[vi.name].shape):
                    found[vi.name] = (shape, list(got[vi.name].shape))
    return found


def evaluate_mixed(model, feeds, mpc, work):
    """The mixed verdict: mixed_refused, mixed_crash, mixed_timeout, invalid_model,
    mixed_oracle_refused, mixed_mismatch, mixed_ill_conditioned or mixed_matched."""
    src = os.path.join(work, "model.onnx")
    with open(src, "wb") as f:
        f.write(model.SerializeToString())
    out = os.path.join(work, "mixed.onnx")
    r = hs.mpc_compile(mpc, src, out)
    if r.status == "refused":
        return Outcome("mixed_refused", message=r.message)
    if r.status in ("crash", "timeout"):
        return Outcome("mixed_" + r.status, stage="compile", message=r.message,
                       signature="compile " + (r.signature() if r.status == "crash" else "timeout"))
    try:
        mixed = onnx.load(out)
    except Exception as e:
        return Outcome("invalid_model", message=f"onnx.load: {hs.first_line(str(e))}", mixed=None)
    hs.phase("onnx.checker")
    try:
        onnx.checker.check_model(mixed, full_check=True)
    except Exception as e:
        return Outcome("invalid_model", message=hs.first_line(str(e)), mixed=mixed)
    try:
        want = hs.oracle_run(mixed, feeds)
    except hs.OracleError as e:
        return Outcome("mixed_oracle_refused", message=str(e), mixed=mixed)
    r = hs.mpc_run(mpc, out, feeds, work)
    if r.status == "refused":
        return Outcome("mixed_refused", message="run: " + r.message, mixed=mixed)
    if r.status in ("crash", "timeout"):
        return Outcome("mixed_" + r.status, stage="run", message=r.message, mixed=mixed,
                       signature="run mixed " + (r.signature() if r.status == "crash" else "timeout"))
    diffs = hs.compare(r.outputs, want, loose=True)
    if not diffs:
        return Outcome("mixed_matched", mixed=mixed)
    diffs = hs.unexplained(mixed, feeds, want, r.outputs, diffs, loose=True)
    if not diffs:
        return Outcome("mixed_ill_conditioned", mixed=mixed)
    ref = hs.second_opinion(mixed, feeds, want, r.outputs, list(diffs), loose=True)
    if ref == "mpc":  # onnxruntime's CPU float16 is not faithful: docs/differential.md
        return Outcome("mixed_oracle_disagrees", mixed=mixed, diffs=diffs)
    return Outcome("mixed_mismatch", mixed=mixed, want=want, got=r.outputs, diffs=diffs, reference=ref)


def localise(model, feeds, mpc, work):
    """(index, facts) of the first node (in order) whose output mpc gets wrong when every value is
    an output, or (None, {}). The facts: whether that node's float inputs hold NaN or Inf (as
    onnxruntime computes them), its small integer and 1-D float inputs' values ("ints", "floats"),
    the largest finite magnitude among its float inputs ("largest"), their shapes as computed
    ("shapes", where shape inference may not know them), and, when the node
    alone (fed onnxruntime's values) still mismatches, the reference evaluator's side on it
    ("reference")."""
    try:
        m, names = mz.with_all_values(model)
        o = evaluate_fp32(m, feeds, mpc, work, second_opinion=False)
    except Exception:
        return None, {}
    if o.kind != "mismatch":
        return None, {}
    bad = set(o.detail["diffs"])
    values = dict(feeds)
    values.update({t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    values.update(o.detail["want"])
    for i, n in enumerate(model.graph.node):
        if not bad & set(n.output):
            continue
        ins = [np.asarray(values[x]) if x in values else None for x in n.input]
        got = o.detail["got"]

        def same(x):
            if x not in got or x not in o.detail["want"]:
                return True  # a graph input or initializer: both read the same data
            a, b = np.asarray(got[x]), np.asarray(o.detail["want"][x])
            return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()  # -0 != 0
        fl = [a for a in ins if a is not None and a.dtype.kind == "f"]
        facts = {"nan": bool(any(np.isnan(a).any() for a in fl)), "inf": bool(any(np.isinf(a).any() for a in fl)),
                 "ints": {j: a.tolist() for j, a in enumerate(ins) if a is not None and a.dtype.kind in "iu"
                          and a.size <= 16},
                 "floats": {j: a.tolist() for j, a in enumerate(ins) if a is not None and a.dtype.kind == "f"
                            and a.ndim == 1 and a.size <= 16},
                 "shapes": [list(a.shape) if a is not None else None for a in ins],
                 "largest": max([float(np.abs(a[np.isfinite(a)]).max()) for a in fl if np.isfinite(a).any()],
                                default=0.0),
                 "inputs_exact": all(same(x) for x in n.input if x)}
        try:
            single = mz.Reduced(model, feeds, values, [i], list(n.output)).build()
            if single is not None:
                one = evaluate_fp32(*single, mpc, work)
                facts["alone"] = one.kind
                if one.kind == "mismatch":
                    facts["reference"] = one.detail["reference"]
                    facts["exact"] = hs.exact_opinion(single[0], single[1], one.detail["want"], one.detail["got"],
                                                      list(one.detail["diffs"]))
                elif one.kind == "ill_conditioned":
                    # Jittered inputs move onnxruntime as far, but mpc's inputs were the same bits
                    # (a constant row whose variance is exactly 0): the reference evaluator still says
                    # which side the node is on
                    diffs = hs.compare(one.detail["got"], one.detail["want"])
                    facts["reference"] = hs.second_opinion(single[0], single[1], one.detail["want"],
                                                           one.detail["got"], list(diffs)) if diffs else "mpc"
                    if diffs:
                        facts["exact"] = hs.exact_opinion(single[0], single[1], one.detail["want"],
                                                          one.detail["got"], list(diffs))
        except Exception:
            pass
        return i, facts
    return None, {}


def shape_culprit(model, feeds):
    """The first node one of whose outputs onnxruntime computes with another static shape than
    onnx shape inference gives, or None."""
    try:
        values = mz.all_values(model, feeds)
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:
        return None
    shapes = {}
    for vi in inferred.graph.value_info:
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = [d.dim_value for d in dims]
    for n in model.graph.node:
        for out in n.output:
            if out in shapes and out in values and shapes[out] != list(np.shape(values[out])):
                return n
    return None


def upstream_close(model, i, outcome):
    """Whether no input of node i is an output of the whole graph that mpc got wrong (they are
    within tolerance when localise blamed node i; this guards the case where node i's inputs are
    graph outputs too)."""
    bad = set(outcome.detail.get("diffs", {}))
    return not any(x in bad for x in model.graph.node[i].input)


def strip(diffs):
    return {k: {kk: vv for kk, vv in d.items() if kk != "mask"} for k, d in diffs.items()}


def check_graph(seed, index, mpc, work, mixed=True):
    """Generates graph (seed, index) and checks it; a plain dict (it crosses processes)."""
    res = {"index": index}
    hs.phase("generator")
    try:
        case = gen.generate((seed, index))
    except gen.Reject as e:
        res["kind"] = "generator_rejected"
        res["message"] = str(e)
        return res
    res["opset"], res["ops"] = case.opset, case.ops
    o = evaluate_fp32(case.model, case.feeds, mpc, work)
    res["kind"] = o.kind
    res["message"] = o.detail.get("message", "")
    res["signature"] = o.detail.get("signature", "")
    res["oracle_refused"] = o.detail.get("oracle_refused", False)
    if o.kind in ("mismatch", "crash", "timeout"):
        res["model"], res["feeds"] = case.model.SerializeToString(), case.feeds
        if o.kind == "mismatch":
            res["diffs"] = strip(o.detail["diffs"])
            i, flags = localise(case.model, case.feeds, mpc, work)
            res["first_node"] = i
            res["node_inputs"] = flags
            if flags.get("alone") in ("matched", "ill_conditioned") and not flags.get("inputs_exact") and \
                    all(d["reason"] == "values" for d in o.detail["diffs"].values()) and \
                    upstream_close(case.model, i, o):
                # The failing node, fed onnxruntime's values of its inputs, gives onnxruntime's
                # result, and mpc's values of those inputs differ from them but within tolerance:
                # the node amplifies rounding that came from upstream (a Floor of -3e-8 against
                # one of 0). (Had they been the same bits, the node would fail only in context:
                # folding, fusion or memory reuse; that stays a mismatch.)
                res["kind"] = "ill_conditioned"
                res["amplified"] = case.model.graph.node[i].op_type
                return res
            node = case.model.graph.node[i] if i is not None else mz.failing_node(case.model, list(o.detail["diffs"]))
            res["node"] = node_info(case.model, node)
            res["reference"] = flags.get("reference", o.detail["reference"])
            res["f16"] = hs.has_dtype(case.model, onnx.TensorProto.FLOAT16)
        return res
    if o.kind == "onnx_shape":
        res["model"], res["feeds"] = case.model.SerializeToString(), case.feeds
        res["shapes"] = o.detail["shapes"]
        res["reference"] = o.detail["reference"]
        res["node"] = node_info(case.model, shape_culprit(case.model, case.feeds)
                                or mz.failing_node(case.model, list(o.detail["shapes"])))
        return res
    if o.kind != "matched" or not mixed:
        return res
    mo = evaluate_mixed(case.model, case.feeds, mpc, work)
    res["mixed"] = mo.kind
    res["mixed_message"] = mo.detail.get("message", "")
    res["mixed_signature"] = mo.detail.get("signature", "")
    if mo.kind in ("mixed_mismatch", "mixed_crash", "invalid_model", "mixed_oracle_disagrees"):
        res["model"], res["feeds"] = case.model.SerializeToString(), case.feeds
        if mo.kind in ("mixed_mismatch", "mixed_oracle_disagrees"):
            res["diffs"] = strip(mo.detail["diffs"])
            mixed_model = mo.detail["mixed"]
            node = mz.failing_node(mixed_model, list(mo.detail["diffs"]))
            res["node"] = node_info(mixed_model, node)
    return res


def node_info(model, node):
    info = mz.node_summary(node)
    if node is None:
        return info
    types = {}
    try:
        inf = onnx.shape_inference.infer_shapes(model)
        for vi in list(inf.graph.value_info) + list(inf.graph.input) + list(inf.graph.output):
            tt = vi.type.tensor_type
            types[vi.name] = (onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name,
                              [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])
        for t in inf.graph.initializer:
            types[t.name] = (onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name, list(t.dims))
    except Exception:
        pass
    info["inputs"] = [types.get(x, (None, None))[0] if x else None for x in node.input]
    info["input_shapes"] = [types.get(x, (None, None))[1] if x else None for x in node.input]
    return info


# ---------------------------------------------------------------------- minimising one failure
def predicate_for(kind, signature, mpc, work, reference=None):
    """Whether a reduced graph fails as the original did: the same kind, and for a crash the
    same signature, for a mismatch the same side of the reference evaluator (with mpc, or not)."""
    def pred(model, feeds):
        try:
            onnx.checker.check_model(model, full_check=True)
        except Exception:
            return None
        try:
            if kind in ("mismatch", "crash", "timeout", "onnx_shape"):
                careful = reference in ("mpc", "onnxruntime")
                o = evaluate_fp32(model, feeds, mpc, work, second_opinion=careful)
                if o.kind != kind:
                    return None
                # a mismatch the reference put on mpc's side (or on onnxruntime's) does not move
                # to the other side (where it cannot say, anything goes)
                opposite = {"mpc": "onnxruntime", "onnxruntime": "mpc"}.get(reference)
                if careful and kind in ("mismatch", "onnx_shape") and o.detail["reference"] == opposite:
                    return None
            else:
                if evaluate_fp32(model, feeds, mpc, work).kind not in ("matched", "ill_conditioned"):
                    return None
                o = evaluate_mixed(model, feeds, mpc, work)
                if o.kind != kind:
                    return None
            if kind in ("crash", "mixed_crash") and o.detail.get("signature") != signature:
                return None
            if kind == "invalid_model" and hs.refusal_reason(o.detail["message"], 6) != signature:
                return None
            return o
        except Exception:
            return None
    return pred


def shrink(res, mpc, work, outdir, seed, budget_s):
    model = onnx.load_from_string(res["model"])
    feeds = res["feeds"]
    kind = res.get("mixed") if res["kind"] == "matched" else res["kind"]
    signature = res.get("signature") or res.get("mixed_signature")
    if kind == "invalid_model":
        signature = hs.refusal_reason(res["mixed_message"], 6)
    pred = predicate_for(kind, signature, mpc, work, res.get("reference"))
    found = None
    try:
        found = mz.minimise(model, feeds, pred, first_node=res.get("first_node"), budget_s=budget_s)
    except Exception as e:  # a reproducer of the whole graph is still worth writing
        print(f"  minimising graph {res['index']} failed: {e}", file=sys.stderr)
    if found is None:
        m, f, o = model, feeds, pred(model, feeds)
    else:
        m, f, o = found
    if not o:
        return None
    info = {"seed": seed, "index": res["index"], "rerun": f"--seed {seed} --only {res['index']}",
            "original_nodes": len(model.graph.node), "allowlisted": res.get("allowlisted")}
    extra = {}
    if kind == "onnx_shape":
        info["node"] = node_info(m, mz.failing_node(m, list(o.detail["shapes"])))
        info["shapes"] = {k: {"onnx": v[0], "mpc and onnxruntime": v[1]} for k, v in o.detail["shapes"].items()}
        ref = o.detail.get("reference")
        if ref in (None, "not asked"):
            ref = hs.second_opinion(m, f, o.detail["want"], o.detail["got"], list(o.detail["shapes"]))
        info["reference"] = ref
    elif kind in ("mismatch", "mixed_mismatch"):
        diffs = o.detail["diffs"]
        target = o.detail["mixed"] if kind == "mixed_mismatch" else m
        info["node"] = node_info(target, mz.failing_node(target, list(diffs)))
        info["diffs"] = strip(diffs)
        if kind == "mismatch":
            ref = o.detail.get("reference")
            if ref in (None, "not asked"):
                ref = hs.second_opinion(m, f, o.detail["want"], o.detail["got"], list(diffs))
            info["reference"] = ref
    else:
        info["node"] = node_info(m, m.graph.node[-1] if len(m.graph.node) else None)
        info["message"] = o.detail.get("message", "")[-2000:]
        info["signature"] = signature
        if kind == "invalid_model":
            extra["mixed.onnx"] = o.detail.get("mixed")
    if kind == "mixed_mismatch":
        # The model compared is mpc's mixed rewrite: it is the reproducer's model.onnx.
        extra["source.onnx"] = m
        m = o.detail["mixed"]
        info["reference"] = o.detail.get("reference")
        info["command"] = ("mpc run model.onnx --inputs IN.safetensors --policy fp32 (model.onnx is "
                           "`mpc compile source.onnx --policy mixed`), against onnxruntime, fp16 tolerance")
    elif kind in ("mixed_crash", "invalid_model"):
        info["command"] = "mpc compile model.onnx --policy mixed -o mixed.onnx"
    else:
        info["command"] = "mpc run model.onnx --inputs IN.safetensors --policy fp32"
    return mz.write_repro(outdir, m, f, kind, info, extra)


# ---------------------------------------------------------------------- the campaign
class Worker:
    """A child process that checks graphs and shrinks failures, so that an oracle that dies
    (onnxruntime segfaults on some graphs with empty dims) takes only the child with it."""

    def __init__(self, mpc, mixed):
        import multiprocessing as mp
        self.ctx = mp.get_context("fork")
        self.mpc, self.mixed = mpc, mixed
        self.phase = self.ctx.Array("c", 80)
        self.start()

    def start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=worker_loop, args=(child, self.mpc, self.mixed, self.phase), daemon=True)
        self.proc.start()
        child.close()

    def send(self, request):
        self.phase.value = b""
        self.conn.send(request)

    def receive(self, timeout):
        """The reply, or ("died", why) after restarting the child."""
        try:
            if self.conn.poll(timeout):
                return self.conn.recv()
            why = f"no answer in {timeout:.0f} s"
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            why = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
        phase = self.phase.value.decode(errors="replace")
        self.stop()
        self.start()
        return ("died", f"{phase or 'worker'} died ({why})")

    def stop(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def worker_loop(conn, mpc, mixed, phase):
    hs.PHASE = phase
    work = tempfile.mkdtemp(prefix="mpc-diff-")
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                return
            if req[0] == "check":
                try:
                    res = check_graph(req[1], req[2], mpc, work, mixed)
                except Exception:  # a bug of the harness: counted apart, with its traceback
                    import traceback
                    res = {"index": req[2], "kind": "harness_error", "message": traceback.format_exc()[-1500:]}
                conn.send(res)
            elif req[0] == "shrink":
                try:
                    _, res, outdir, seed, budget = req
                    conn.send(shrink(res, mpc, work, outdir, seed, budget))
                except Exception as e:
                    conn.send(("failed", f"{type(e).__name__}: {e}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def died(index, why):
    """The result of a graph whose worker died: the oracle is what crashes (mpc runs in its own
    process), so it counts as refused by the oracle."""
    return {"index": index, "kind": "oracle_refused", "message": f"oracle crashed: {why}"}


def campaign(args):
    import multiprocessing.connection as mpc_conn
    mpc = os.path.abspath(args.mpc)
    outdir = os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    report = Report()
    start = time.time()
    indices = iter([args.only] if args.only is not None else range(args.graphs))
    workers = [Worker(mpc, not args.no_mixed) for _ in range(max(1, args.jobs))]
    busy = {}  # worker -> ("check", index) or ("shrink", res, key)
    last, stopping = start, False

    def feed(w):
        nonlocal stopping
        if stopping:
            return
        i = next(indices, None)
        if i is None:
            stopping = True
            return
        w.send(("check", args.seed, i))
        busy[w] = (("check", i), time.time())

    def handle(w, reply):
        job = busy.pop(w)[0]
        if job[0] == "shrink":
            res, key, cls = job[1], job[2], job[3]
            if reply and reply[0] not in ("died", "failed"):
                folder, info = reply
                cls["repros"].append(os.path.relpath(folder, outdir))
                print(f"  graph {res['index']}: {key[0]} {key[1][:80]} -> {folder} "
                      f"({info.get('nodes', '?')} of {info['original_nodes']} nodes)", flush=True)
            elif reply:
                print(f"  graph {res['index']}: {key[0]} {key[1][:80]}: minimising {reply[0]}: {reply[1]}", flush=True)
            feed(w)
            return
        res = reply if isinstance(reply, dict) else died(job[1], reply[1])
        key = report.add(res)
        if key is not None:
            shown = key if key[0] != "allowed" else ("allowed", key[1] + " " + key[2], "")
            cls = report.classes.setdefault((shown[0], shown[1]), {"count": 0, "first": res["index"], "repros": [],
                                                                   "graphs": []})
            cls["count"] += 1
            if len(cls["graphs"]) < 20:
                cls["graphs"].append(res["index"])
            pending = sum(1 for j, _ in busy.values() if j[0] == "shrink" and j[3] is cls)
            if len(cls["repros"]) + pending < args.repros_per_class and key[0] != "timeout":
                w.send(("shrink", res, outdir, args.seed, args.shrink_budget))
                busy[w] = (("shrink", res, key, cls), time.time())
                return
        feed(w)

    try:
        for w in workers:
            feed(w)
        while busy:
            ready = mpc_conn.wait([w.conn for w in busy], timeout=5)
            for w, (job, t0) in list(busy.items()):
                limit = args.shrink_budget * 3 + 120 if job[0] == "shrink" else 600
                if w.conn in ready:
                    handle(w, w.receive(limit))
                elif time.time() - t0 > limit:
                    handle(w, w.receive(0))
            now = time.time()
            if now - last > args.progress:
                last = now
                c = report.c
                print(f"[{now - start:6.0f} s] {c['generated']} graphs: {c['matched']} matched, "
                      f"{c['mismatched']} mismatched, {c['mpc refused']} refused, {c['crashed']} crashed, "
                      f"{c['oracle refused']} oracle refused", flush=True)
            if args.time_budget and now - start > args.time_budget and not stopping:
                print(f"time budget of {args.time_budget:.0f} s spent", flush=True)
                stopping = True
    finally:
        for w in workers:
            w.stop()
    wall = time.time() - start
    text = report.text(wall)
    print(text)
    with open(os.path.join(outdir, "report.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(outdir, "report.json"), "w") as f:
        json.dump(report.json(wall), f, indent=1, default=str)
    failures = report.c["crashed"] + report.c["mismatched"] + report.c["invalid models written"] + \
        report.c["mixed crashed"]
    return failures


def replay(args):
    """Reruns reproducer folders against the current mpc: FIXED or STILL FAILS each."""
    mpc = os.path.abspath(args.mpc)
    work = tempfile.mkdtemp(prefix="mpc-diff-")
    still = 0
    folders = []
    for d in args.replay:
        if os.path.exists(os.path.join(d, "model.onnx")):
            folders.append(d)
        else:
            folders += sorted(os.path.join(d, e) for e in os.listdir(d) if os.path.exists(os.path.join(d, e, "model.onnx")))
    for folder in folders:
        with open(os.path.join(folder, "info.json")) as f:
            info = json.load(f)
        model, feeds, _ = mz.load_repro(folder)
        kind = info["kind"]
        if kind == "mixed_mismatch":
            model = onnx.load(os.path.join(folder, "source.onnx"))
        sig = info.get("signature")
        if kind == "invalid_model":
            sig = hs.refusal_reason(info.get("message", ""), 6)
        o = predicate_for(kind, sig, mpc, work, info.get("reference") if kind == "mismatch" else None)(model, feeds)
        still += bool(o)
        allowed = f"  (allowlisted: {info['allowlisted']})" if info.get("allowlisted") else ""
        print(f"{'STILL FAILS' if o else 'FIXED      '}  {kind:15s} {os.path.basename(folder)}{allowed}")
    shutil.rmtree(work, ignore_errors=True)
    print(f"{still} of {len(folders)} still fail")
    return still


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    ap.add_argument("--graphs", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "mpc-differential"),
                    help="where reproducers and report.txt/report.json go")
    ap.add_argument("--ci", action="store_true",
                    help=f"seed {CI_SEED}, {CI_GRAPHS} graphs; exit 1 on a crash, an fp32 mismatch outside the "
                         "allowlist, or an invalid model written")
    ap.add_argument("--time-budget", type=float, default=0, help="stop starting graphs after this many seconds")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--only", type=int, help="check only graph number I of the seed")
    ap.add_argument("--no-mixed", action="store_true", help="skip the mixed-precision check")
    ap.add_argument("--repros-per-class", type=int, default=2, help="reproducers written per failure class")
    ap.add_argument("--shrink-budget", type=float, default=60, help="seconds spent minimising one failure")
    ap.add_argument("--progress", type=float, default=30, help="seconds between progress lines")
    ap.add_argument("--replay", nargs="+", metavar="DIR", help="rerun reproducers instead of a campaign")
    args = ap.parse_args()
    if not os.path.exists(args.mpc):
        ap.error(f"no mpc binary at {args.mpc}")
    if args.replay:
        sys.exit(1 if replay(args) else 0)
    if args.ci:
        args.seed, args.graphs, args.jobs = CI_SEED, CI_GRAPHS, 1
    failures = campaign(args)
    if args.ci and failures:
        print(f"--ci: {failures} failures (crashes, fp32 mismatches outside the allowlist, invalid models written)")
        sys.exit(1)


if __name__ == "__main__":
    main()
