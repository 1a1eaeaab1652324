#!/usr/bin/env python3
"""Compile never writes what the ONNX checker rejects from an input it accepts.

    python3 fuzz/check_outputs.py [--mpc target/release/mpc] [--limit N] DIR...
    # needs onnx (.ci/requirements.txt); DIR: ONNX inputs, e.g. fuzz/corpus/onnx or a campaign's
    # fuzz/target/corpus/onnx

For every file in DIR that `onnx.checker.check_model(full_check=True)` accepts, runs
`mpc compile FILE --policy P -o OUT.onnx` for P in fp32 and mixed, and checks OUT with the same
checker. Prints each output the checker rejects and each exit code other than 0 and 2 (and 2 with
more than one line, or a compile past --timeout), then the counts; exits 1 if there was any. The
checker itself can spin on a malformed model: one that takes it past --checker-timeout seconds is
restarted, and that input is counted as not accepted ("checker timeouts").
"""

import argparse
import os
import select
import subprocess
import sys
import tempfile


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


WORKER = """
import sys, onnx
for line in sys.stdin:
    path = line.rstrip("\\n")
    try:
        onnx.checker.check_model(onnx.load(path), full_check=True)
        print("ok", flush=True)
    except Exception:
        print("no", flush=True)
"""


class Checker:
    """onnx.checker in a child process: on some malformed models it aborts the process."""

    def __init__(self, timeout):
        self.p = None
        self.timeout = timeout

    def accepts(self, path):
        """True or False; None when the checker took longer than the timeout."""
        if self.p is None or self.p.poll() is not None:
            self.p = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        try:
            self.p.stdin.write(path + "\n")
            self.p.stdin.flush()
            # One line answers each path, so nothing is left buffered between two questions.
            if not select.select([self.p.stdout], [], [], self.timeout)[0]:
                self.p.kill()
                self.p.wait()
                self.p = None
                return None
            return self.p.stdout.readline().strip() == "ok"
        except BrokenPipeError:
            return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    ap.add_argument("--limit", type=int, default=0, help="at most this many accepted inputs")
    ap.add_argument("--checker-timeout", type=float, default=20, help="seconds the checker may take on one model")
    ap.add_argument("--timeout", type=float, default=120, help="seconds one compile may take")
    args = ap.parse_args()
    files = sorted(os.path.join(d, f) for d in args.dirs for f in os.listdir(d))
    counts = {"inputs": len(files), "accepted": 0, "compiled": 0, "refused": 0, "bad": 0, "checker timeouts": 0}
    checker = Checker(args.checker_timeout)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.onnx")
        for f in files:
            accepted = checker.accepts(f)
            if accepted is None:
                counts["checker timeouts"] += 1
                print(f"{f}: the checker took more than {args.checker_timeout:g} s on the input (not counted)")
            if not accepted:
                continue
            counts["accepted"] += 1
            if args.limit and counts["accepted"] > args.limit:
                break
            for policy in ["fp32", "mixed"]:
                if os.path.exists(out):
                    os.remove(out)
                try:
                    r = subprocess.run([args.mpc, "compile", f, "--policy", policy, "-o", out],
                                       capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    counts["bad"] += 1
                    print(f"{f} ({policy}): compile took more than {args.timeout:g} s")
                    continue
                if r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1:
                    counts["refused"] += 1
                    continue
                if r.returncode != 0:
                    counts["bad"] += 1
                    print(f"{f} ({policy}): exit {r.returncode}: {r.stderr.strip()[:300]}")
                    continue
                counts["compiled"] += 1
                ok = checker.accepts(out)
                if ok is None:
                    counts["checker timeouts"] += 1
                    print(f"{f} ({policy}): the checker took more than {args.checker_timeout:g} s on the output")
                elif not ok:
                    counts["bad"] += 1
                    print(f"{f} ({policy}): the checker rejects the output")
    print(", ".join(f"{k} {v}" for k, v in counts.items()))
    sys.exit(1 if counts["bad"] else 0)


if __name__ == "__main__":
    main()
