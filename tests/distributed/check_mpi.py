#!/usr/bin/env python3
"""Data-parallel training over MPI against one process (docs/data-parallel.md).

    python3 tests/distributed/check_mpi.py --mpc target/release/mpc   # an mpc built --features mpi

Trains the digits MLP with `mpiexec -n 2 mpc train --distributed --batch 32` and with one process
at `--batch 64` (the same samples in each global batch, the same seed), and compares the trained
weights rank 0 writes with the single process's: fp32 SGD over 30 epochs within 1e-6 relative L2,
every epoch's mean training loss and evaluation loss (from --log) within 1e-6 relative, mixed SGD
with dynamic loss scaling within 5e-3 (each rank rounds its weight gradients, sums over half the
batch, to f16, where one process rounds the whole batch's: 2^-11 apart each step; 1.7e-3 after the
135 steps here); the fp32 epoch lines must agree. Then `--shard-optimizer` (AdamW, fp32 and mixed)
on two ranks against the unsharded two: the same weights bit for bit, and each rank's training
state (`--stats`) half the unsharded one's but for the scalars every rank keeps. Last, the faults:
rank 1 stopped (SIGSTOP) in a long run ends it within 30 s with rank 0's one line naming the rank
and the step (`--collective-timeout 3`), and rank 1 killed (SIGKILL) ends it within 30 s. Exits 1
on a difference, 2 when mpiexec is missing.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "tests", "models", "digits_mlp.onnx")
DATA = os.path.join(ROOT, "tests", "data", "digits.safetensors")


def train(cmd, out):
    r = subprocess.run(cmd + ["-o", out], capture_output=True, text=True, timeout=600)
    train.stderr = r.stderr
    if r.returncode != 0:
        raise SystemExit(f"FAIL {' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def state_bytes(stderr):
    """The training state's bytes on rank 0, from `--stats`."""
    line = next(l for l in stderr.splitlines() if "training step:" in l)
    return int(line.split("state ", 1)[1].split(" ", 1)[0])


def weights(path):
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in onnx.load(path).graph.initializer}


def epoch_losses(log):
    """Each epoch's mean training loss and its evaluation loss, from a --log file (full precision)."""
    steps, evals = {}, []
    with open(log) as f:
        for line in f:
            r = json.loads(line)
            if "eval_loss" in r:
                evals.append(r["eval_loss"])
            elif not r["skipped"]:
                steps.setdefault(r["epoch"], []).append(r["loss"])
    return [sum(v) / len(v) for _, v in sorted(steps.items())], evals


def evals(stdout):
    """Each epoch line but its samples/s: the training loss (the mean over the ranks), the
    evaluation, the loss scale and the skipped steps."""
    return [line.rsplit(", ", 1)[0] for line in stdout.splitlines() if line.startswith("epoch")]


def rank_pid(rank, mpc):
    """The pid of the mpc process mpiexec started as `rank` (MPICH's PMI_RANK), or None."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        if f"PMI_RANK={rank}".encode() in env and cmd and os.path.basename(cmd[0]) == os.path.basename(mpc).encode():
            return int(pid)
    return None


def fault(mpiexec, mpc, sig):
    """A long 2-rank run whose rank 1 gets `sig` once training is under way: how long the run
    took to end after it, its exit code and stderr."""
    cmd = [mpiexec, "-n", "2", mpc, "train", MODEL, "--data", DATA, "--epochs", "100000", "--batch", "32",
           "--distributed", "--collective-timeout", "3"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid = None
    for _ in range(200):
        time.sleep(0.05)
        pid = pid or rank_pid(1, mpc)
        if pid and p.stdout.readline().startswith("epoch"):
            break
    if pid is None:
        p.kill()
        raise SystemExit("FAIL: rank 1's process not found")
    os.kill(pid, sig)
    t0 = time.time()
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    if sig == signal.SIGSTOP:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return time.time() - t0, p.returncode, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    a = ap.parse_args()
    mpiexec = shutil.which("mpiexec")
    if not mpiexec:
        print("mpiexec not found (MPICH: apt-get install mpich)")
        return 2
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for policy, extra, tol, epochs in [("fp32", ["--optimizer", "sgd", "--lr", "0.1"], 1e-6, 30),
                                           ("mixed", ["--optimizer", "sgd", "--lr", "0.1", "--loss-scale", "dynamic"],
                                            5e-3, 3)]:
            base = [a.mpc, "train", MODEL, "--data", DATA, "--policy", policy, "--epochs", str(epochs),
                    "--eval-split", "0.2", "--seed", "7"] + extra
            logs = [os.path.join(tmp, f"{n}.jsonl") for n in ("one", "two")]
            one = train(base + ["--batch", "64", "--log", logs[0]], os.path.join(tmp, "one.onnx"))
            two = train([mpiexec, "-n", "2"] + base + ["--batch", "32", "--distributed", "--log", logs[1]],
                        os.path.join(tmp, "two.onnx"))
            w1, w2 = weights(os.path.join(tmp, "one.onnx")), weights(os.path.join(tmp, "two.onnx"))
            worst = max(np.linalg.norm(w1[k] - w2[k]) / max(np.linalg.norm(w1[k]), 1e-30) for k in w1)
            (l1, e1), (l2, e2) = epoch_losses(logs[0]), epoch_losses(logs[1])
            losses = max(abs(x - y) / abs(x) for x, y in zip(l1 + e1, l2 + e2))
            same_evals = evals(one) == evals(two)
            good = worst <= tol and (policy != "fp32" or (same_evals and losses <= 1e-6 and len(l1) == epochs))
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {policy}: 2 ranks x 32 vs 1 x 64, {epochs} epochs: weights within "
                  f"{worst:.2g} (relative L2, at most {tol:g}); epoch and evaluation losses within {losses:.2g}; "
                  f"epoch lines {'equal' if same_evals else 'differ'}")
            if not same_evals:
                print("     one process: " + " | ".join(evals(one)) + "\n     two ranks:   " + " | ".join(evals(two)))
        for policy in ["fp32", "mixed"]:
            base = [mpiexec, "-n", "2", a.mpc, "train", MODEL, "--data", DATA, "--policy", policy, "--epochs", "3",
                    "--eval-split", "0.2", "--seed", "7", "--optimizer", "adamw", "--batch", "32", "--distributed",
                    "--stats"]
            whole = train(base, os.path.join(tmp, "whole.onnx"))
            whole_bytes = state_bytes(train.stderr)
            sharded = train(base + ["--shard-optimizer"], os.path.join(tmp, "sharded.onnx"))
            sharded_bytes = state_bytes(train.stderr)
            w1, w2 = weights(os.path.join(tmp, "whole.onnx")), weights(os.path.join(tmp, "sharded.onnx"))
            same = all(np.array_equal(w1[k], w2[k]) for k in w1)
            halved = sharded_bytes <= whole_bytes // 2 + 256
            good = same and halved and evals(whole) == evals(sharded)
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {policy}: --shard-optimizer on 2 ranks, AdamW, 3 epochs: weights "
                  f"{'the same bits' if same else 'differ'}; state per rank {sharded_bytes} B of {whole_bytes} B")
    took, code, err = fault(mpiexec, a.mpc, signal.SIGSTOP)
    ours = [l for l in err.splitlines() if l.startswith("mpc: rank 0: step ")]
    good = took <= 30 and code != 0 and len(ours) == 1 and "waited 3s for the other ranks" in ours[0]
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} rank 1 stopped: the run ended {took:.1f} s later, exit {code}: "
          f"{ours[0] if ours else err.strip()[-300:]}")
    took, code, err = fault(mpiexec, a.mpc, signal.SIGKILL)
    good = took <= 30 and code != 0
    ok &= good
    print(f"{'ok  ' if good else 'FAIL'} rank 1 killed: the run ended {took:.1f} s later, exit {code}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
