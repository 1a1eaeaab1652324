"""Shrinking a failing graph to a small reproducer, and writing reproducers.

A reduced graph is a subset of the original's nodes: a node that is dropped has each of its
outputs that a kept node reads turned into a graph input fed with the value onnxruntime computed
for it in the original graph (small integer and bool values become initializers, as the shape
operands they usually are), and the graph's outputs are any of the kept values. The predicate
says whether a reduced graph still fails the same way; the search first tries the single node
that localisation blames, then greedily moves the output upstream and cuts nodes off the inputs'
side until nothing more can go.
"""

import hashlib
import json
import os
import time

import numpy as np
import onnx
from onnx import helper as h
from onnx import numpy_helper as nh

from gen import NP2ONNX
from harness import OracleError, oracle_run


def with_all_values(model):
    """The model with the output of every node that the graph's outputs depend on (typed by
    shape inference where it can) as a graph output, and the names in order. (A dead node stays dead: mpc
    removes it, and it may be one mpc would refuse.)"""
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {vi.name: vi for vi in list(inferred.graph.value_info) + list(model.graph.output)}
    need = {o.name for o in model.graph.output}
    live = set()
    for i in reversed(range(len(model.graph.node))):
        n = model.graph.node[i]
        if need & set(n.output):
            live.add(i)
            need.update(x for x in n.input if x)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    del m.graph.output[:]
    names = []
    for i, n in enumerate(model.graph.node):
        if i not in live:
            continue
        for o in n.output:
            if o and o not in names:
                # A value shape inference leaves untyped (after a function op such as
                # GroupNormalization-21) is an output of unknown type: both sides type it.
                names.append(o)
                m.graph.output.append(types[o] if o in types else onnx.helper.make_empty_tensor_value_info(o))
    return m, names


def all_values(model, feeds):
    """{value: array} for every graph input, initializer and node output, by onnxruntime; when it
    refuses the whole graph (a crash that only mpc sees), node by node, leaving out the values of
    the nodes it refuses and of what they feed."""
    vals = dict(feeds)
    for t in model.graph.initializer:
        vals[t.name] = nh.to_array(t)
    m, _ = with_all_values(model)
    try:
        vals.update(oracle_run(m, feeds))
        return vals
    except OracleError:
        pass
    types = {vi.name: vi for vi in m.graph.output}
    for n in model.graph.node:
        if any(x and x not in vals for x in n.input) or not all(o in types for o in n.output if o):
            continue
        ins = list(dict.fromkeys(x for x in n.input if x))
        one = h.make_model(h.make_graph(
            [n], "one", [h.make_tensor_value_info(x, NP2ONNX[np.asarray(vals[x]).dtype], np.asarray(vals[x]).shape)
                         for x in ins],
            [types[o] for o in n.output if o]), opset_imports=list(model.opset_import), ir_version=model.ir_version)
        try:
            vals.update(oracle_run(one, {x: vals[x] for x in ins}))
        except OracleError:
            continue
    return vals


class Reduced:
    """A sub-graph of `base`: kept node indices and output names."""

    def __init__(self, base, feeds, values, keep, outputs, types=None):
        self.base, self.feeds, self.values, self.types = base, feeds, values, types or {}
        self.keep, self.outputs = sorted(set(keep)), list(dict.fromkeys(outputs))

    def key(self):
        return (tuple(self.keep), tuple(self.outputs))

    def build(self):
        """(model, feeds) after pruning what the outputs do not need; None if nothing is left."""
        g = self.base.graph
        nodes = [g.node[i] for i in self.keep]
        produced = {o: i for i, n in zip(self.keep, nodes) for o in n.output}
        outputs = [o for o in self.outputs if o in produced]
        if not outputs:
            return None
        need, live = set(outputs), []
        for i, n in reversed(list(zip(self.keep, nodes))):
            if any(o in need for o in n.output):
                live.append(n)
                need.update(x for x in n.input if x)
        live.reverse()
        produced = {o for n in live for o in n.output}
        reads = [x for n in live for x in n.input if x and x not in produced]
        reads = list(dict.fromkeys(reads))
        orig_inputs = {vi.name: vi for vi in g.input}
        orig_inits = {t.name: t for t in g.initializer}
        inputs, inits, feeds = [], [], {}
        for name in reads:
            if name in orig_inits:
                inits.append(orig_inits[name])
            elif name in orig_inputs:
                inputs.append(orig_inputs[name])
                feeds[name] = self.feeds[name]
            elif name not in self.values:
                return None  # onnxruntime could not compute it
            else:
                a = np.asarray(self.values[name])
                if a.dtype.kind in "iub" and a.size <= 64:
                    inits.append(nh.from_array(a, name))
                else:
                    inputs.append(h.make_tensor_value_info(name, NP2ONNX[a.dtype], a.shape))
                    feeds[name] = a
        if any(o not in self.values and o not in self.types for o in outputs):
            return None

        def model(symbolic):
            outs = []
            for o in outputs:
                if o in self.values:
                    a = np.asarray(self.values[o])
                    elem, dims = NP2ONNX[a.dtype], list(a.shape)
                else:  # onnxruntime refused to compute it: onnx's type
                    elem, dims = self.types[o]
                shape = [f"{o}_d{i}" for i in range(len(dims))] if symbolic or None in dims else dims
                outs.append(h.make_tensor_value_info(o, elem, shape))
            graph = h.make_graph(live, "repro", inputs, outs, initializer=inits)
            return h.make_model(graph, opset_imports=list(self.base.opset_import), ir_version=self.base.ir_version,
                                producer_name="mpc-differential")
        m = model(False)
        try:
            onnx.checker.check_model(m, full_check=True)
        except Exception:
            # onnx shape inference and onnxruntime disagree on an output's shape: declare it
            # with symbolic dims, which both accept
            m = model(True)
        return m, feeds


def minimise(model, feeds, predicate, first_node=None, budget_s=60.0, max_tests=200):
    """The smallest reduced graph found for which predicate(model, feeds) is true, as
    (model, feeds, evidence), or None when even the whole graph no longer fails."""
    values = all_values(model, feeds)
    types = {}
    for vi in with_all_values(model)[0].graph.output:
        tt = vi.type.tensor_type
        types[vi.name] = (tt.elem_type, [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim])
    start = time.time()
    tests = {}

    def R(keep, outputs):
        return Reduced(model, feeds, values, keep, outputs, types)

    def test(r):
        k = r.key()
        if k in tests:
            return tests[k]
        if len(tests) >= max_tests or time.time() - start > budget_s:
            return None
        built = r.build()
        ev = predicate(*built) if built is not None else None
        tests[k] = ev
        return ev

    n = len(model.graph.node)
    all_outs = [o.name for o in model.graph.output]
    best = R(range(n), all_outs)
    ev = test(best)
    if not ev:
        return None
    # The node localisation blames, alone.
    if first_node is not None:
        r = R([first_node], list(model.graph.node[first_node].output))
        e = test(r)
        if e:
            best, ev = r, e
    changed = True
    while changed and len(best.keep) > 1:
        changed = False
        # Fewer outputs: each output alone.
        if len(best.outputs) > 1:
            for o in best.outputs:
                r = R(best.keep, [o])
                e = test(r)
                if e:
                    best, ev, changed = r, e, True
                    break
        # The output moved upstream: the earliest value that still fails.
        for i in best.keep:
            outs = [o for o in model.graph.node[i].output if o]
            if set(outs) & set(best.outputs) or not outs:
                continue
            r = R([j for j in best.keep if j <= i], outs)
            e = test(r)
            if e:
                best, ev, changed = r, e, True
                break
        # Nodes cut off: halves first, then one at a time.
        keep = best.keep
        chunks = [keep[:len(keep) // 2]] if len(keep) > 3 else []
        chunks += [[i] for i in keep]
        for chunk in chunks:
            rest = [j for j in keep if j not in chunk]
            if not rest:
                continue
            r = R(rest, best.outputs)
            e = test(r)
            if e:
                best, ev, changed = r, e, True
                break
        # Prune what the kept outputs do not read, so the next round sees the real size.
        built = best.build()
        if built is not None:
            names = {n.name for n in built[0].graph.node}
            best = R([j for j in best.keep if model.graph.node[j].name in names],
                           best.outputs)
    m, f = best.build()
    return m, f, ev


def failing_node(model, output_names):
    """The node that makes the first of these outputs."""
    for n in model.graph.node:
        if set(n.output) & set(output_names):
            return n
    return model.graph.node[-1] if len(model.graph.node) else None


def node_summary(node):
    if node is None:
        return {}
    attrs = {}
    for a in node.attribute:
        v = h.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode(errors="replace")
        elif isinstance(v, onnx.TensorProto):
            v = nh.to_array(v).tolist()
        elif isinstance(v, list):
            v = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in v]
        attrs[a.name] = v
    return {"op": node.op_type, "attrs": attrs}


def write_repro(outdir, model, feeds, kind, info, extra_models=None):
    """OUTDIR/<op>_<hash>/model.onnx and test_data_set_0/{input,output}_J.pb (outputs:
    onnxruntime's), plus info.json; returns the folder."""
    try:
        want = oracle_run(model, feeds)
    except OracleError:
        want = {}
    op = info.get("node", {}).get("op") or "graph"
    digest = hashlib.sha1(model.SerializeToString()).hexdigest()[:6]
    folder = os.path.join(outdir, f"{op}_{digest}")
    data = os.path.join(folder, "test_data_set_0")
    os.makedirs(data, exist_ok=True)
    onnx.save(model, os.path.join(folder, "model.onnx"))
    for j, vi in enumerate(model.graph.input):
        with open(os.path.join(data, f"input_{j}.pb"), "wb") as f:
            f.write(nh.from_array(np.asarray(feeds[vi.name]), vi.name).SerializeToString())
    for j, vi in enumerate(model.graph.output):
        if vi.name in want:
            with open(os.path.join(data, f"output_{j}.pb"), "wb") as f:
                f.write(nh.from_array(np.asarray(want[vi.name]), vi.name).SerializeToString())
    for name, m in (extra_models or {}).items():
        if m is not None:
            onnx.save(m, os.path.join(folder, name))
    info = dict(info, kind=kind, nodes=len(model.graph.node),
                opset=max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0))
    with open(os.path.join(folder, "info.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    return folder, info


def load_repro(folder):
    """(model, feeds, expected outputs) of a reproducer folder."""
    model = onnx.load(os.path.join(folder, "model.onnx"))
    data = os.path.join(folder, "test_data_set_0")
    feeds, want = {}, {}
    for j, vi in enumerate(model.graph.input):
        t = onnx.TensorProto()
        with open(os.path.join(data, f"input_{j}.pb"), "rb") as f:
            t.ParseFromString(f.read())
        feeds[vi.name] = nh.to_array(t)
    for j, vi in enumerate(model.graph.output):
        p = os.path.join(data, f"output_{j}.pb")
        if os.path.exists(p):
            t = onnx.TensorProto()
            with open(p, "rb") as f:
                t.ParseFromString(f.read())
            want[vi.name] = nh.to_array(t)
    return model, feeds, want
