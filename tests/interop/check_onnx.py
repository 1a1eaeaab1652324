#!/usr/bin/env python3
"""Interop check: what mpc writes is valid ONNX and computes what the original computes.

    python3 tests/interop/check_onnx.py --mpc target/release/mpc fixtures
    python3 tests/interop/check_onnx.py --mpc target/release/mpc conformance DIR
    python3 tests/interop/check_onnx.py --mpc target/release/mpc runtime
    python3 tests/interop/check_onnx.py --mpc target/release/mpc training
    python3 tests/interop/check_onnx.py --mpc target/release/mpc zoo

`fixtures`: every tests/models/*.onnx is compiled with each policy. The output must pass
onnx.checker.check_model(full_check=True). With `--policy fp32` it must give the original's outputs
in onnxruntime on random inputs (relative L2 error <= 1e-6); with `--policy mixed` it must run in
onnxruntime, keep the original's output names and dtypes, have no NaN/Inf, and stay within relative
L2 error 1e-2 of the original. (`mixed-bf16` and `fp16` are checked by the checker only here:
onnxruntime has no CPU kernels for bf16, and their numbers are checked on mpc's own runtime.)

`conformance`: every case of ONNX's operator conformance suite in DIR (NAME/model.onnx with
test_data_set_*/input_*.pb, output_*.pb) is compiled the same way and run on its own inputs; the
outputs must equal the original's in onnxruntime (same tolerance) and the suite's expected outputs
(rtol 1e-3, atol 1e-5 for floats, exact otherwise). Cases mpc rejects as unsupported (dtypes such as
strings or float8) and cases onnxruntime cannot run even in their original form are skipped, with
the reason. Prints passed / skipped / failed counts; exits 1 on any failure.

`runtime`: every fixture is run by `mpc run` (mpc's CPU runtime) on random inputs: `fp32` must match
onnxruntime on the original model (relative L2 <= 1e-4), `mixed` must match onnxruntime running mpc's
own exported mixed model (<= 5e-3: same casts, same numbers), `mixed-bf16` must match fp32 (<= 3e-2).
Fixtures with an op the runtime cannot run yet are skipped with the reason.

`training`: the training graphs of the fixtures (`compile --train`, each policy) pass the checker.

`zoo`: every export in tests/models/zoo (BERT, GPT-2, Llama, ViT, ... by both torch exporters)
compiled `--policy mixed` passes the checker and matches the original in onnxruntime (relative L2
<= 1e-2, no NaN/Inf); its training step (`--train --policy mixed`, the family's loss) passes the
checker wherever mpc builds one (the exports it cannot train yet are listed with mpc's reason).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def rel_l2(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        same = np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(a[~np.isnan(a)], b[~np.isnan(b)])
        return 0.0 if same else float("inf")
    denom = np.linalg.norm(b)
    diff = np.linalg.norm(a - b)
    return diff / denom if denom > 0 else diff


def session(path):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # Graph optimisations off: compare the models as written, not onnxruntime's rewrites of them.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])


def compile_model(mpc, src, out, policy="fp32"):
    r = subprocess.run([mpc, "compile", src, "--policy", policy, "-o", out], capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


# Policy → (tolerance on relative L2 error against the original, or None for checker-only).
POLICIES = {"fp32": 1e-6, "mixed": 1e-2, "mixed-bf16": None, "fp16": None}


def random_inputs(sess, ranges, rng, batch=3, seq=None):
    """Random inputs, the leading symbolic dims `batch` and the others `seq` (else `batch`)."""
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else (batch if k == 0 or seq is None else seq) for k, d in enumerate(i.shape)]
        dt = ORT_TYPES[i.type]
        if np.issubdtype(dt, np.integer):
            lo, hi = ranges.get(i.name, [0, 4])
            feeds[i.name] = rng.integers(lo, hi, size=shape).astype(dt)
        elif dt == np.bool_:
            feeds[i.name] = np.asarray(rng.random(shape) > 0.5)
        else:
            feeds[i.name] = rng.standard_normal(shape).astype(dt)
    return feeds


def check_fixtures(mpc):
    meta = json.load(open(os.path.join(ROOT, "tests", "models", "fixtures.json")))
    rng = np.random.default_rng(0)
    passed = failed = 0
    models = sorted(glob.glob(os.path.join(ROOT, "tests", "models", "*.onnx")))
    with tempfile.TemporaryDirectory() as tmp:
        for src in models:
            name = os.path.splitext(os.path.basename(src))[0]
            a = session(src)
            feeds = random_inputs(a, meta["int_input_ranges"].get(name, {}), rng)
            expected = a.run(None, feeds)
            for policy, tol in POLICIES.items():
                label = f"{name} --policy {policy}"
                out = os.path.join(tmp, f"{name}.{policy}.onnx")
                rc, err = compile_model(mpc, src, out, policy)
                if rc != 0:
                    print(f"FAIL {label}: mpc exited {rc}: {err}")
                    failed += 1
                    continue
                try:
                    onnx.checker.check_model(onnx.load(out), full_check=True)
                    if tol is None:
                        print(f"ok   {label}: checker passed")
                        passed += 1
                        continue
                    b = session(out)
                    if [(o.name, o.type) for o in a.get_outputs()] != [(o.name, o.type) for o in b.get_outputs()]:
                        raise AssertionError("output names or dtypes differ from the original's")
                    got = b.run(None, feeds)
                    for y in got:
                        if y.dtype.kind == "f" and not np.isfinite(y).all():
                            raise AssertionError("NaN or Inf in the outputs")
                    worst = max(rel_l2(y, x) for x, y in zip(expected, got))
                    if worst > tol:
                        raise AssertionError(f"relative L2 error {worst:.3g} > {tol:g}")
                    print(f"ok   {label}: checker passed, onnxruntime max relative L2 error {worst:.3g} (limit {tol:g})")
                    passed += 1
                except Exception as e:  # noqa: BLE001 - report every failure the same way
                    print(f"FAIL {label}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                    failed += 1
    print(f"fixtures: {passed} passed, {failed} failed")
    return failed == 0


def mpc_run(mpc, model, inputs, out, policy):
    r = subprocess.run([mpc, "run", model, "--policy", policy, "--inputs", inputs, "-o", out], capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


def check_runtime(mpc):
    from safetensors.numpy import load_file, save_file

    meta = json.load(open(os.path.join(ROOT, "tests", "models", "fixtures.json")))
    rng = np.random.default_rng(1)
    passed = failed = skipped = 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(glob.glob(os.path.join(ROOT, "tests", "models", "*.onnx"))):
            name = os.path.splitext(os.path.basename(src))[0]
            a = session(src)
            feeds = random_inputs(a, meta["int_input_ranges"].get(name, {}), rng, batch=4)
            inputs = os.path.join(tmp, name + ".in.safetensors")
            save_file({k: np.array(v, order="C") for k, v in feeds.items()}, inputs)  # keeps 0-d arrays 0-d
            names = [o.name for o in a.get_outputs()]
            reference = dict(zip(names, a.run(None, feeds)))
            mixed_onnx = os.path.join(tmp, name + ".mixed.onnx")
            results = {}
            try:
                for policy in ["fp32", "mixed", "mixed-bf16"]:
                    out = os.path.join(tmp, f"{name}.{policy}.out.safetensors")
                    rc, err = mpc_run(mpc, src, inputs, out, policy)
                    if rc != 0 and ("cannot run" in err or "not implemented" in err):
                        raise LookupError(err.split(": ", 2)[-1])
                    if rc != 0:
                        raise AssertionError(f"mpc run --policy {policy} exited {rc}: {err}")
                    results[policy] = load_file(out)
                rc, err = compile_model(mpc, src, mixed_onnx, "mixed")
                if rc != 0:
                    raise AssertionError(err)
                ort_mixed = dict(zip(names, session(mixed_onnx).run(None, feeds)))
                checks = [
                    ("fp32 vs onnxruntime", results["fp32"], reference, 1e-4),
                    ("mixed vs onnxruntime on mpc's mixed model", results["mixed"], ort_mixed, 5e-3),
                    ("mixed-bf16 vs fp32", results["mixed-bf16"], results["fp32"], 3e-2),
                ]
                worst = []
                for label, got, want, tol in checks:
                    err = max(rel_l2(got[k], want[k]) for k in names)
                    if err > tol:
                        raise AssertionError(f"{label}: relative L2 error {err:.3g} > {tol:g}")
                    worst.append(f"{label} {err:.2g}")
                print(f"ok   {name}: " + "; ".join(worst))
                passed += 1
            except LookupError as e:
                print(f"skip {name}: {e}")
                skipped += 1
            except Exception as e:  # noqa: BLE001
                print(f"FAIL {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                failed += 1
    print(f"runtime: {passed} passed, {failed} failed, {skipped} skipped")
    return failed == 0


def load_case(case_dir):
    sets = []
    for d in sorted(glob.glob(os.path.join(case_dir, "test_data_set_*"))):
        ins = [numpy_helper.to_array(onnx.load_tensor(p)) for p in sorted(glob.glob(os.path.join(d, "input_*.pb")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
        outs = [numpy_helper.to_array(onnx.load_tensor(p)) for p in sorted(glob.glob(os.path.join(d, "output_*.pb")), key=lambda p: int(p.rsplit("_", 1)[1][:-3]))]
        sets.append((ins, outs))
    return sets


def close(actual, expected):
    if expected.dtype.kind in "fc":
        a = np.asarray(actual, dtype=np.float64)
        e = np.asarray(expected, dtype=np.float64)
        return a.shape == e.shape and np.allclose(a, e, rtol=1e-3, atol=1e-5, equal_nan=True)
    return np.array_equal(actual, expected)


def check_conformance(mpc, root):
    counts = Counter()
    skipped = Counter()
    failures = []
    cases = sorted(d for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, "model.onnx")))
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            src = os.path.join(root, case, "model.onnx")
            out = os.path.join(tmp, case + ".onnx")
            rc, err = compile_model(mpc, src, out)
            if rc != 0:
                if "not supported" in err:
                    counts["skipped"] += 1
                    # "mpc: PATH: value `x`: REASON" -> REASON
                    skipped["mpc: " + err.rsplit(": ", 1)[-1]] += 1
                else:
                    counts["failed"] += 1
                    failures.append(f"{case}: mpc exited {rc}: {err}")
                continue
            try:
                a = session(src)
            except Exception as e:  # noqa: BLE001
                counts["skipped"] += 1
                skipped["onnxruntime cannot load the original"] += 1
                continue
            try:
                onnx.checker.check_model(onnx.load(out), full_check=True)
                b = session(out)
                for ins, expected in load_case(os.path.join(root, case)):
                    feeds = {i.name: x for i, x in zip(a.get_inputs(), ins)}
                    try:
                        ra = a.run(None, feeds)
                    except Exception:  # noqa: BLE001
                        raise LookupError("onnxruntime cannot run the original")
                    rb = b.run(None, {i.name: x for i, x in zip(b.get_inputs(), ins)})
                    for x, y, e in zip(ra, rb, expected):
                        if x.dtype.kind in "fc":
                            if rel_l2(y, x) > 1e-6:
                                raise AssertionError(f"differs from the original by relative L2 {rel_l2(y, x):.3g}")
                        elif not np.array_equal(x, y):
                            raise AssertionError("differs from the original")
                        if close(x, e) and not close(y, e):
                            raise AssertionError("differs from the expected output")
                counts["passed"] += 1
            except LookupError as e:
                counts["skipped"] += 1
                skipped[str(e)] += 1
            except Exception as e:  # noqa: BLE001
                counts["failed"] += 1
                failures.append(f"{case}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for f in failures:
        print("FAIL", f)
    for reason, n in skipped.most_common():
        print(f"skipped {n:4d}: {reason}")
    print(f"conformance: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return counts["failed"] == 0


def check_training(mpc):
    """Training graphs (mpc compile --train) pass the checker: ai.mpc ops are a custom domain, the
    rest must be valid ONNX with consistent types."""
    cases = [("mlp", []), ("cnn_bn", []), ("transformer", ["--loss", "mse", "--labels", "targets"])]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in cases:
            for policy in ["fp32", "mixed", "mixed-bf16"]:
                out = os.path.join(tmp, f"{name}-{policy}-train.onnx")
                cmd = [mpc, "compile", os.path.join(ROOT, "tests", "models", name + ".onnx"), "--policy", policy, "--train", "-o", out]
                r = subprocess.run(cmd + extra, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"FAIL {name} {policy} --train: {r.stderr.strip()}")
                    ok = False
                    continue
                try:
                    m = onnx.load(out)
                    onnx.checker.check_model(m, full_check=True)
                except Exception as e:  # noqa: BLE001 - report whatever the checker says
                    print(f"FAIL {name} {policy} --train: checker: {e}")
                    ok = False
                    continue
                state = [p.value for p in m.metadata_props if p.key == "mpc.train.state"]
                pairs = state[0].count("->") if state else 0
                print(f"ok   {name} {policy} --train: {len(m.graph.node)} nodes, {pairs} state pairs, checker passed")
    return ok


def trained_elsewhere(mpc, src, stem, family, zoo, tmp, other):
    """Trains `src` a few mixed steps on the family's committed batch (sequence 8), writes the
    trained model, and runs it at the sequence of `other` in mpc and in onnxruntime."""
    from safetensors.numpy import load_file, save_file
    grads = load_file(os.path.join(zoo, stem.split(".")[0] + ".grads.safetensors"))
    data = os.path.join(tmp, stem + ".data.safetensors")
    save_file({k[len("input."):]: v for k, v in grads.items() if k.startswith("input.")}, data)
    trained = os.path.join(tmp, stem + ".trained.onnx")
    cmd = [mpc, "train", src, "--data", data, "--policy", "mixed", "--epochs", "3", "--batch", "2",
           "--loss", family["loss"], "--labels", family["labels"], "-o", trained]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise AssertionError(f"train exited {r.returncode}: {r.stderr.strip()}")
    feeds, outs = os.path.join(tmp, stem + ".in5.safetensors"), os.path.join(tmp, stem + ".out5.safetensors")
    save_file(other, feeds)
    rc, err = mpc_run(mpc, trained, feeds, outs, "fp32")
    if rc != 0:
        raise AssertionError(f"run of the trained model exited {rc}: {err}")
    t = session(trained)
    want = t.run(None, other)
    got = load_file(outs)
    far = max(rel_l2(got[o.name], w) for o, w in zip(t.get_outputs(), want))
    if far > 1e-5:
        raise AssertionError(f"the trained model at sequence 5: mpc vs onnxruntime relative L2 {far:.3g}")
    return f"; trained at 8, run at 5 as onnxruntime runs it ({far:.1g})"


def check_zoo(mpc):
    zoo = os.path.join(ROOT, "tests", "models", "zoo")
    meta = json.load(open(os.path.join(zoo, "zoo.json")))
    rng = np.random.default_rng(2)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(glob.glob(os.path.join(zoo, "*.onnx"))):
            stem = os.path.basename(src)[:-5]
            family = meta[stem.split(".")[0]]
            a = session(src)
            # The exports' sequence of 8 (a legacy nn.MultiheadAttention export holds the length it
            # was traced at), and for those exported with a dynamic sequence another one after.
            feeds = random_inputs(a, family["int_inputs"], rng, seq=8)
            expected = a.run(None, feeds)
            out = os.path.join(tmp, stem + ".mixed.onnx")
            step = os.path.join(tmp, stem + ".train.onnx")
            try:
                rc, err = compile_model(mpc, src, out, "mixed")
                if rc != 0:
                    raise AssertionError(f"mpc exited {rc}: {err}")
                onnx.checker.check_model(onnx.load(out), full_check=True)
                got = session(out).run(None, feeds)
                if any(y.dtype.kind == "f" and not np.isfinite(y).all() for y in got):
                    raise AssertionError("NaN or Inf in the outputs")
                worst = max(rel_l2(y, x) for x, y in zip(expected, got))
                if worst > 1e-2:
                    raise AssertionError(f"relative L2 error {worst:.3g} > 0.01")
                at_five = ""
                if family.get("axes") == "batch+seq":
                    other = random_inputs(a, family["int_inputs"], rng, seq=5)
                    try:
                        want = a.run(None, other)
                    except Exception:  # noqa: BLE001 - the original's own limit, reported
                        at_five = "; at sequence 5 the original fails in onnxruntime too (the exporter held its traced length)"
                    else:
                        far = max(rel_l2(y, x) for x, y in zip(want, session(out).run(None, other)))
                        if far > 1e-2:
                            raise AssertionError(f"at sequence 5: relative L2 error {far:.3g} > 0.01")
                        at_five = f"; at sequence 5 {far:.2g}"
                        at_five += trained_elsewhere(mpc, src, stem, family, zoo, tmp, other)
                cmd = [mpc, "compile", src, "--policy", "mixed", "--train", "--loss", family["loss"],
                       "--labels", family["labels"], "-o", step]
                r = subprocess.run(cmd, capture_output=True, text=True)
                bound = ""
                if r.returncode == 2 and "`compile --dim seq=N` gives it" in r.stderr:
                    # An RNN over a symbolic sequence unrolls for the length it is given.
                    r = subprocess.run(cmd + ["--dim", "seq=8"], capture_output=True, text=True)
                    bound = " (--dim seq=8)"
                if r.returncode == 2:
                    train = "training step: not built (" + r.stderr.strip().split(": ", 2)[-1] + ")"
                elif r.returncode != 0:
                    raise AssertionError(f"compile --train exited {r.returncode}: {r.stderr.strip()}")
                else:
                    onnx.checker.check_model(onnx.load(step), full_check=True)
                    train = f"training step{bound}: checker passed"
                print(f"ok   {stem}: mixed checker passed, onnxruntime relative L2 {worst:.2g}{at_five}; {train}")
            except Exception as e:  # noqa: BLE001 - report every failure the same way
                print(f"FAIL {stem}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                ok = False
    return ok


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    p.add_argument("what", choices=["fixtures", "conformance", "runtime", "training", "zoo"])
    p.add_argument("dir", nargs="?")
    a = p.parse_args()
    if a.what == "fixtures":
        ok = check_fixtures(a.mpc)
    elif a.what == "runtime":
        ok = check_runtime(a.mpc)
    elif a.what == "training":
        ok = check_training(a.mpc)
    elif a.what == "zoo":
        ok = check_zoo(a.mpc)
    else:
        ok = check_conformance(a.mpc, a.dir)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
