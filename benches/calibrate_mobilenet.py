#!/usr/bin/env python3
"""Calibration on a freshly initialised torchvision MobileNetV3-small.

    python3 benches/calibrate_mobilenet.py [--mpc target/release/mpc]
    # needs torch, torchvision, onnx, numpy, safetensors (.ci/bench-requirements.txt and torchvision)

Exports `torchvision.models.mobilenet_v3_small()` with its default initialisation (logits of about
1e-9), draws 64 calibration samples and 4 other test inputs, and runs `mpc run` under fp32, mixed,
and mixed with `--calibrate`. Prints each one's relative L2 error against fp32, how many Conv and Gemm
nodes calibration keeps in FP32, and what calibration cost (`--stats`).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torchvision
from safetensors.numpy import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    a = p.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "mobilenet_v3_small.onnx")
        m = torchvision.models.mobilenet_v3_small().eval()
        torch.onnx.export(m, (torch.randn(1, 3, 224, 224),), model, dynamo=False, opset_version=18,
                          input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
        calib, inputs = os.path.join(tmp, "calib.safetensors"), os.path.join(tmp, "inputs.safetensors")
        save_file({"x": rng.standard_normal((64, 3, 224, 224)).astype(np.float32)}, calib)
        save_file({"x": rng.standard_normal((4, 3, 224, 224)).astype(np.float32)}, inputs)

        def run(*extra):
            out = os.path.join(tmp, "out.safetensors")
            r = subprocess.run([a.mpc, "run", model, "--inputs", inputs, "-o", out, "--stats", *extra],
                               capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"mpc run {' '.join(extra)}: {r.stderr.strip()}")
            return load_file(out)["logits"].astype(np.float64), r.stderr

        fp32, _ = run("--policy", "fp32")
        print(f"fp32 logits: max |x| {np.abs(fp32).max():.3g}")
        ranges = os.path.join(tmp, "ranges.json")
        for label, extra in [("mixed", ["--policy", "mixed"]),
                             ("mixed --calibrate", ["--policy", "mixed", "--calibrate", calib, "--ranges-out", ranges])]:
            y, err = run(*extra)
            rel = np.linalg.norm(y - fp32) / np.linalg.norm(fp32)
            print(f"{label}: relative L2 error {rel:.3g} against fp32; logits max |x| {np.abs(y).max():.3g}")
            for line in err.splitlines():
                if "calibration:" in line:
                    print("  " + line.removeprefix("mpc:").strip())
        r = subprocess.run([a.mpc, "inspect", model, "--policy", "mixed", "--ranges-in", ranges, "--explain"],
                           capture_output=True, text=True)
        rows = [l.split() for l in r.stdout.splitlines() if l.startswith("# /")]
        for op in ("Conv", "Gemm"):
            mine = [row for row in rows if len(row) > 3 and row[2] == op]
            kept = [row for row in mine if row[3] == "f32"]
            print(f"{op}: {len(kept)} of {len(mine)} kept in FP32 by calibration")
        pinned = sum(1 for l in r.stdout.splitlines() if re.search(r"\scalibration: ", l))
        print(f"nodes calibration pins (computing or reading a value FP16 breaks): {pinned}")


if __name__ == "__main__":
    main()
