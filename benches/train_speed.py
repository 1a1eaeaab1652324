#!/usr/bin/env python3
"""`mpc train` against PyTorch's CPU training loop on the digits MLP, FP32, side by side in one run.

    python3 benches/train_speed.py [--epochs 30] [--reps 5] [--threads N] [--no-build] [--mpc PATH]
    # needs numpy, onnx, safetensors (.ci/requirements.txt) and torch (.ci/bench-requirements.txt);
    # builds target/release/mpc first (cargo build --release) unless --no-build

The same model (tests/models/digits_mlp.onnx, 64-256-256-10, Gemm+Relu; torch builds it from
nn.Linear/nn.ReLU and loads the ONNX initializers, so both start from the same weights), the same
data (tests/data/digits.safetensors: the first 1500 samples train, the last 297 test), Adam lr 1e-3
(betas 0.9/0.999, eps 1e-8 on both sides), mean cross-entropy, batch 64, ceil(1500/64) = 24 steps
an epoch (the last one of 28 samples), a shuffled order each epoch (not the same order on both
sides), and the same number of threads: mpc's step runs its matrix products through matrixmultiply,
which uses MATMUL_NUM_THREADS or else the physical cores, at most 4; the script sets that variable
for mpc and torch.set_num_threads to the same number (default: what mpc would pick here). mpc's
element-wise ops and optimizer run on one thread; torch's may use all of them.

Measured, the two sides alternating for --reps repetitions, medians printed:
  - torch loop: time.perf_counter around the epochs (forward, backward, Adam step and loss.item()
    each step, as mpc reads its loss each step); model and optimizer built fresh each repetition,
    imports, data loading and the final evaluation outside. One torch run comes first as a warm-up
    (printed as "torch cold loop", not in the medians), so every timed torch repetition runs in a
    warm process; mpc's loop, a fresh process each time, includes its own first, slower epoch.
  - mpc whole process: wall time of `mpc train ... --policy fp32 --seed 7` as a subprocess (load,
    compile the training step, read the data, train, and the per-epoch evaluation that mpc does).
  - mpc loop: the sum over epochs of 1500 / the samples/s that mpc prints for each epoch (its timer
    covers the steps of the epoch, not the evaluation after it).
Prints both, the ratios mpc whole process / torch loop and mpc loop / torch loop (of the medians,
then of the fastest repetitions, steadier on a shared machine), and both sides'
test accuracy on the last 297 samples (about 92% after 30 epochs) as a sanity check. Run it on an
otherwise idle machine (the load average is printed): with another process busy on one of the
cores, torch's OpenMP threads wait on each other at every op and its loop gets many times slower.
"""

import argparse
import os
import re
import statistics
import subprocess
import time

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPC = os.path.join(ROOT, "target", "release", "mpc")
MODEL = os.path.join(ROOT, "tests", "models", "digits_mlp.onnx")
DATA = os.path.join(ROOT, "tests", "data", "digits.safetensors")
N_EVAL, BATCH, LR, SEED = 297, 64, 1e-3, 7


def mpc_default_threads():
    """What matrixmultiply picks: MATMUL_NUM_THREADS, else the physical cores (num_cpus), in 1..4."""
    env = os.environ.get("MATMUL_NUM_THREADS", "")
    if env.isdigit():
        return max(1, min(int(env), 4))
    cores, phys = set(), None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "physical id":
                    phys = val.strip()
                elif key.strip() == "core id":
                    cores.add((phys, val.strip()))
    except OSError:
        pass
    return max(1, min(len(cores) or os.cpu_count() or 1, 4))


def torch_model(inits):
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    # Gemm with transB=1: the ONNX weights are [out, in], nn.Linear's layout.
    state = {f"{2 * i}.{p}": torch.from_numpy(inits[f"fc{i + 1}.{p}"].copy()) for i in range(3) for p in ("weight", "bias")}
    model.load_state_dict(state)
    return model


def run_torch(inits, x, y, n_train, epochs):
    """Returns (loop seconds, test accuracy)."""
    model = torch_model(inits)
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(SEED)
    steps = -(-n_train // BATCH)
    model.train()
    t = time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(n_train, generator=gen)
        total = 0.0
        for k in range(steps):
            idx = order[k * BATCH:(k + 1) * BATCH]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
    secs = time.perf_counter() - t
    model.eval()
    with torch.no_grad():
        acc = (model(x[n_train:]).argmax(1) == y[n_train:]).float().mean().item()
    return secs, acc


def run_mpc(mpc, epochs, threads, n_train):
    """Returns (whole-process seconds, loop seconds from the per-epoch samples/s, test accuracy)."""
    cmd = [mpc, "train", MODEL, "--data", DATA, "--policy", "fp32", "--optimizer", "adam", "--lr", str(LR),
           "--epochs", str(epochs), "--batch", str(BATCH), "--eval-split", str(N_EVAL), "--seed", str(SEED)]
    env = dict(os.environ, MATMUL_NUM_THREADS=str(threads))
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"mpc train failed ({r.returncode}):\n{r.stderr}")
    rates = [float(m) for m in re.findall(r"^epoch \d+:.*?([0-9.]+) samples/s$", r.stdout, re.M)]
    if len(rates) != epochs:
        raise SystemExit(f"expected {epochs} epoch lines with samples/s from mpc train, got:\n{r.stdout}")
    acc = float(re.search(r"^test accuracy: ([0-9.]+)%", r.stdout, re.M).group(1)) / 100
    return wall, sum(n_train / s for s in rates), acc


def spread(xs, fmt="{:.3f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="for both sides (default: what mpc picks here)")
    ap.add_argument("--no-build", action="store_true", help="use target/release/mpc as it is")
    ap.add_argument("--mpc", default=MPC, help="the mpc binary (implies --no-build)")
    args = ap.parse_args()
    if not args.no_build and args.mpc == MPC:
        subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "mpc"], cwd=ROOT, check=True)
    if not os.path.exists(args.mpc):
        raise SystemExit(f"{args.mpc} is missing: run `cargo build --release`")
    threads = args.threads or mpc_default_threads()
    torch.set_num_threads(threads)

    data = load_file(DATA)
    x = torch.from_numpy(np.ascontiguousarray(data["images"], dtype=np.float32))
    y = torch.from_numpy(np.ascontiguousarray(data["labels"], dtype=np.int64))
    n_train = x.shape[0] - N_EVAL
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(MODEL).graph.initializer}

    steps = -(-n_train // BATCH)
    print(f"digits MLP 64-256-256-10, fp32, Adam lr {LR:g}, batch {BATCH}, {args.epochs} epochs x {steps} steps "
          f"({n_train} train / {N_EVAL} test), {threads} threads (torch {torch.__version__}: "
          f"{torch.get_num_threads()} intra-op; mpc MATMUL_NUM_THREADS={threads}), "
          f"median (min-max) of {args.reps} interleaved reps, load average {os.getloadavg()[0]:.2f}")
    cold, _ = run_torch(inits, x, y, n_train, args.epochs)
    t_loop, m_wall, m_loop, t_acc, m_acc = [], [], [], [], []
    for _ in range(args.reps):
        secs, acc = run_torch(inits, x, y, n_train, args.epochs)
        t_loop.append(secs)
        t_acc.append(acc)
        wall, loop, acc = run_mpc(args.mpc, args.epochs, threads, n_train)
        m_wall.append(wall)
        m_loop.append(loop)
        m_acc.append(acc)

    tl = statistics.median(t_loop)
    print(f"torch cold loop     {cold:.3f} s (the first in this process, not in the medians)")
    print(f"torch loop          {spread(t_loop)} s   {args.epochs * n_train / tl:8.0f} samples/s")
    print(f"mpc whole process   {spread(m_wall)} s")
    print(f"mpc loop            {spread(m_loop)} s   {args.epochs * n_train / statistics.median(m_loop):8.0f} samples/s")
    print(f"mpc/torch: whole process / loop {statistics.median(m_wall) / tl:5.2f}x   "
          f"loop / loop {statistics.median(m_loop) / tl:5.2f}x   (fastest / fastest: {min(m_wall) / min(t_loop):.2f}x, "
          f"{min(m_loop) / min(t_loop):.2f}x)")
    pct = lambda xs: " ".join(sorted({f"{a * 100:.2f}%" for a in xs}))  # noqa: E731
    print(f"test accuracy       mpc {pct(m_acc)}   torch {pct(t_acc)}   (load average now {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
