#!/usr/bin/env python3
"""mpc's CPU runtime against onnxruntime's CPU provider, FP32 forward, side by side in one run.

    python3 benches/runtime_speed.py          # needs numpy, onnxruntime, safetensors (.ci/requirements.txt)

For the MLP, CNN and transformer fixtures at batch 64, with the same inputs and the same number of
threads (all cores for both): onnxruntime's median `run` after warm-up, and `mpc run --repeat N`'s
median run (the graph compiled once, weights resident). Prints both and the ratio mpc / onnxruntime
(target: at most 2x on the GEMM-bound models).
"""

import os
import re
import statistics
import subprocess
import tempfile
import time

import numpy as np
import onnxruntime as ort
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPC = os.path.join(ROOT, "target", "release", "mpc")
RUNS = 50
FIXTURES = {"mlp": {}, "cnn_bn": {}, "transformer": {"tokens": 50}}


def main():
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "mpc"], cwd=ROOT, check=True)
    threads = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    print(f"batch 64, {threads} threads, median of {RUNS} runs after warm-up")
    with tempfile.TemporaryDirectory() as tmp:
        for name, int_hi in FIXTURES.items():
            model = os.path.join(ROOT, "tests", "models", name + ".onnx")
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.log_severity_level = 3
            sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
            feeds = {}
            for i in sess.get_inputs():
                shape = [d if isinstance(d, int) else 64 for d in i.shape]
                if i.type == "tensor(int64)":
                    feeds[i.name] = rng.integers(0, int_hi.get(i.name, 2), size=shape).astype(np.int64)
                else:
                    feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
            for _ in range(5):
                sess.run(None, feeds)
            times = []
            for _ in range(RUNS):
                t = time.perf_counter()
                sess.run(None, feeds)
                times.append(time.perf_counter() - t)
            ort_ms = statistics.median(times) * 1e3
            inputs = os.path.join(tmp, name + ".safetensors")
            save_file({k: np.array(v, order="C") for k, v in feeds.items()}, inputs)
            r = subprocess.run([MPC, "run", model, "--inputs", inputs, "--repeat", str(RUNS)], capture_output=True, text=True, check=True)
            mpc_ms = float(re.search(r"median run ([0-9.]+) ms", r.stderr).group(1))
            print(f"{name:12s} onnxruntime {ort_ms:8.3f} ms   mpc {mpc_ms:8.3f} ms   mpc/onnxruntime {mpc_ms / ort_ms:5.2f}x")


if __name__ == "__main__":
    main()
