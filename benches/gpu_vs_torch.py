#!/usr/bin/env python3
"""A mixed-precision training step of mpc against PyTorch's on the same device, side by side.

    python3 benches/gpu_vs_torch.py [--device cuda|cpu] [--models mlp,gpt,gpt-sdpa,resnet50,digits]
                                    [--steps 20] [--warmup 5] [--tiny] [--mpc PATH] [--out DIR]
                                    [--no-compile] [--compile-modes M,...] [--no-profile] [--no-ab]
                                    [--export DIR]
    # needs torch, torchvision, onnx, numpy; builds nothing: give --mpc (default target/release/mpc)

Each model is built in PyTorch, exported to ONNX by this script (torch.onnx, the legacy exporter,
batch as a dynamic axis, BatchNormalization in training mode) and trained for the same steps at
the same batch on the same device in the same run:
  (a) mlp: 4 layers of 8192 (Linear + ReLU), batch 8192, cross-entropy over 8192 classes;
  (b) gpt: a GPT-2-small-shaped decoder (12 layers, d 768, 12 heads, vocabulary 50257,
      sequence 512, batch 8) with its loss inside the exported graph (`--loss output:loss`),
      its attention written as its steps (nanoGPT without flash); gpt-sdpa: the same with
      F.scaled_dot_product_attention(is_causal=True), which PyTorch runs with its flash-attention
      kernels (the PyTorch GPT users run today) and exports as its steps;
  (c) resnet50: torchvision's ResNet-50 at 224x224, batch 64, cross-entropy over 1000 classes;
  (d) digits: the digits MLP (64-256-256-10, batch 64): launch-bound.
PyTorch runs fp32, AMP fp16 (autocast + GradScaler) and AMP bf16 (autocast), each with
torch.optim.AdamW(fused=True) on CUDA, timed with CUDA events around whole steps (forward,
backward, optimizer step, zero_grad) and the median taken after --warmup steps; peak memory is
torch.cuda.max_memory_allocated. torch.compile runs beside them where it compiles. mpc runs
`mpc bench MODEL --train --optimizer adamw --device DEVICE --policies fp32,mixed,mixed-bf16 --json`
at the same batch and steps, and its memory is every device allocation its run made (the
program's arena, state and constants, its workspace, cuDNN's within it, and cuBLAS's: what
max_memory_allocated counts on PyTorch's side; where the JSON lacks it, arena + state + constants,
the plan); with
`--profile` (unless --no-profile) it also times each launch of one more step, and the script prints
mpc's eight longest ops per policy (op, dtype, share of the step, launches).
The script prints one table per model and the ratios mpc/PyTorch for step time and peak memory,
and writes everything as JSON under --out. Options mpc does not turn on by default run beside
(WITH_VARIANTS: both GPTs' mixed and mixed-bf16 steps with `--fused-attention` too), with their ratios
to the default step, to PyTorch's and, for memory, to mpc fp32's.

--tiny shrinks every model (for checking the script on a machine without a GPU: --device cpu,
where PyTorch has no fp16 autocast, so only fp32 and bf16 run there).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mlp(nn.Module):
    def __init__(self, width, layers, classes):
        super().__init__()
        dims = [width] * (layers + 1)
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return self.head(x)


class Block(nn.Module):
    def __init__(self, d, heads, sdpa):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        if self.sdpa:  # PyTorch's fused attention (flash-attention kernels on CUDA)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5 + mask
            y = att.softmax(-1) @ v
        y = y.transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    """GPT-2's shape (pre-norm blocks, learned positions, tanh GELU), its loss inside. Its attention
    as its steps (nanoGPT's without flash: the products, the scale, the causal mask, the softmax),
    or with `sdpa` as F.scaled_dot_product_attention(is_causal=True), which PyTorch runs with its
    flash-attention kernels and exports as its steps."""

    def __init__(self, vocab, seq, d, layers, heads, sdpa=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, sdpa) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        # The causal mask as nanoGPT and torch.nn.Transformer write it: -inf above the diagonal.
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, tokens, labels):
        s = tokens.shape[1]
        x = self.tok(tokens) + self.pos.weight[:s]
        for blk in self.blocks:
            x = blk(x, self.mask[:s, :s])
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def models(tiny):
    """name -> (build, batch, inputs(batch, device), how mpc takes the loss)."""
    import torchvision

    def ints(hi, *shape):
        return lambda b, dev: torch.randint(0, hi, (b, *shape), device=dev)

    width, classes = (64, 16) if tiny else (8192, 8192)
    vocab, seq, d, layers, heads = (128, 16, 32, 2, 2) if tiny else (50257, 512, 768, 12, 12)
    side = 32 if tiny else 224

    def tokens(b, dev):
        return [torch.randint(0, vocab, (b, seq), device=dev), torch.randint(0, vocab, (b, seq), device=dev)]

    return {
        "mlp": (lambda: Mlp(width, 4, classes), 32 if tiny else 8192,
                lambda b, dev: [torch.randn(b, width, device=dev)], ints(classes), ["--loss", "cross-entropy"]),
        "gpt": (lambda: Gpt(vocab, seq, d, layers, heads), 2 if tiny else 8, tokens, None, ["--loss", "output:loss"]),
        "gpt-sdpa": (lambda: Gpt(vocab, seq, d, layers, heads, sdpa=True), 2 if tiny else 8, tokens, None,
                     ["--loss", "output:loss"]),
        "resnet50": (lambda: (torchvision.models.resnet18 if tiny else torchvision.models.resnet50)(num_classes=1000),
                     2 if tiny else 64, lambda b, dev: [torch.randn(b, 3, side, side, device=dev)], ints(1000),
                     ["--loss", "cross-entropy"]),
        "digits": (lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)),
                   64, lambda b, dev: [torch.randn(b, 64, device=dev)], ints(10), ["--loss", "cross-entropy"]),
    }


def export(name, model, example, path):
    """ONNX with the batch as a dynamic axis (and the loss as the output when the model has it)."""
    gpt = name.startswith("gpt")
    names = ["tokens", "labels"] if gpt else ["x"]
    outputs = ["loss"] if gpt else ["logits"]
    axes = {n: {0: "batch"} for n in names}
    if not gpt:
        axes["logits"] = {0: "batch"}
    torch.onnx.export(model.train(), tuple(example), path, dynamo=False, opset_version=17, input_names=names,
                      output_names=outputs, dynamic_axes=axes, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)


def torch_step_times(model, inputs, labels, mode, steps, warmup, device, compiled):
    """Median step (ms) and peak memory (bytes) of PyTorch training in `mode`."""
    cuda = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    scaler = torch.amp.GradScaler(device, enabled=(mode == "amp-fp16"))
    dtype = {"amp-fp16": torch.float16, "amp-bf16": torch.bfloat16}.get(mode)
    fwd = torch.compile(model) if compiled else model

    def step():
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = fwd(*inputs)
            loss = out if labels is None else F.cross_entropy(out, labels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            step()
            ms = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(ms)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return statistics.median(times), peak


def copy_rate():
    """The device's memory bandwidth in TB/s, bytes read plus bytes written, on a 1 GiB
    device-to-device copy of random data (the median of 20 after 3 warm-ups, CUDA events)."""
    x = torch.rand(2**28, device="cuda")
    y = torch.empty_like(x)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    assert torch.equal(x, y)
    del x, y
    torch.cuda.empty_cache()
    return 2 * 2**30 / (statistics.median(times) * 1e-3) / 1e12


# The A/B runs: mpc mixed without one speed-up, beside the run with it.
AB_VARIANTS = [
    ("cudnn", ("resnet50",), {"MPC_CUDNN": "0"}, "with cuDNN convolutions / without (im2col + GEMM)"),
    ("fusion", ("gpt", "resnet50"), {"MPC_FUSE": "0"},
     "fused (chains, epilogues, bias gradients, permuted reads, multi-tensor updates) / without (MPC_FUSE=0)"),
    ("cublaslt", ("mlp",), {"MPC_CUBLASLT": "0"}, "with cuBLASLt epilogues / without (MPC_CUBLASLT=0)"),
    ("relu_mask", ("mlp",), {"MPC_RELU_MASK": "0"},
     "ReLU gradients from cuBLASLt's bit-masks / from the ReLU's output (MPC_RELU_MASK=0)"),
    ("cudnn_deterministic", ("resnet50",), {"MPC_CUDNN_DETERMINISTIC": "0"},
     "deterministic cuDNN algorithms / any (MPC_CUDNN_DETERMINISTIC=0, PyTorch's default)"),
    ("wide", ("gpt", "resnet50"), {"MPC_WIDE": "0"},
     "8- and 16-byte accesses (chains, batch norms, copies) / one element at a time (MPC_WIDE=0)"),
]


# Options not on by default, each measured beside the default run where its models run (also with
# --no-ab): (key, models, mpc's arguments, what the ratio compares).
WITH_VARIANTS = [
    ("fused_attention", ("gpt", "gpt-sdpa"), ["--fused-attention"],
     "with the fused attention (--fused-attention) / without"),
]


def mpc_bench(mpc, path, loss, batch, steps, warmup, device, profile, policies="fp32,mixed,mixed-bf16", env=None,
              extra=()):
    cmd = [mpc, "bench", path, "--train", *loss, "--optimizer", "adamw", "--lr", "1e-4", "--device", device,
           "--policies", policies, "--batch", str(batch), "--steps", str(steps),
           "--untimed", str(warmup), "--json"] + (["--profile"] if profile else []) + list(extra)
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if r.returncode != 0:
        return {"error": r.stderr.strip()}
    return {row["policy"]: row for row in json.loads(r.stdout)["rows"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="mlp,gpt,gpt-sdpa,resnet50,digits")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--compile-modes", default="fp32,amp-fp16,amp-bf16",
                    help="the PyTorch modes also timed under torch.compile (e.g. amp-fp16,amp-bf16: the AMP "
                         "steps the issue compares against, in less time)")
    ap.add_argument("--no-profile", action="store_true", help="skip mpc's per-op profile of one step")
    ap.add_argument("--no-ab", action="store_true",
                    help="skip mpc mixed without each of its speed-ups (the A/B runs of AB_VARIANTS)")
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--export", metavar="DIR",
                    help="only write each model's ONNX export as DIR/NAME.onnx (no GPU needed), then stop")
    args = ap.parse_args()
    dev = args.device
    torch.manual_seed(0)
    if args.export:
        os.makedirs(args.export, exist_ok=True)
        for name in args.models.split(","):
            build, _, make_inputs, _, _ = models(args.tiny)[name]
            path = os.path.join(args.export, f"{name}.onnx")
            export(name, build(), make_inputs(2, "cpu"), path)
            print(path)
        return
    if dev == "cuda":
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    results = {}
    if dev == "cuda":
        results["copy_tb_s"] = copy_rate()
        print(f"device-to-device copy: {results['copy_tb_s']:.2f} TB/s (bytes read + written)")
    lines = []  # the ratio lines of every model, printed again at the end
    exports = tempfile.mkdtemp(prefix="mpc-bench-")  # the ONNX files stay out of --out
    for name in args.models.split(","):
        build, batch, make_inputs, make_labels, loss = models(args.tiny)[name]
        path = os.path.join(exports, f"bench_{name}{'_tiny' if args.tiny else ''}.onnx")
        model = build()
        export(name, model, make_inputs(2, "cpu"), path)
        model = model.to(dev)
        inputs = make_inputs(batch, dev)
        labels = make_labels(batch, dev) if make_labels else None
        modes = ["fp32", "amp-fp16", "amp-bf16"] if dev == "cuda" else ["fp32", "amp-bf16"]
        torch_rows = {}
        for mode in modes:
            compile_too = not args.no_compile and mode in args.compile_modes.split(",")
            for compiled in [False] + ([True] if compile_too else []):
                key = mode + (" compile" if compiled else "")
                try:
                    torch_rows[key] = torch_step_times(model, inputs, labels, mode, args.steps, args.warmup, dev, compiled)
                except Exception as e:  # torch.compile is not available everywhere
                    torch_rows[key] = (None, None)
                    print(f"{name}: torch {key}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        mpc = mpc_bench(args.mpc, path, loss, batch, args.steps, args.warmup, dev, not args.no_profile)
        # mpc mixed without one of its speed-ups, in the same run: (key, models, environment,
        # what the ratio compares).
        without = {}
        for key, names, env, what in AB_VARIANTS:
            if name in names and dev == "cuda" and not args.no_ab:
                without[key] = (what, mpc_bench(args.mpc, path, loss, batch, args.steps, args.warmup, dev, False,
                                                "mixed", env))
        with_ = {}
        for key, names, extra, what in WITH_VARIANTS:
            if name in names:
                with_[key] = (what, mpc_bench(args.mpc, path, loss, batch, args.steps, args.warmup, dev,
                                              not args.no_profile, "mixed,mixed-bf16", None, extra))
        os.remove(path)
        results[name] = {"batch": batch, "torch": torch_rows, "mpc": mpc,
                         **{f"mpc_without_{k}": v for k, (_, v) in without.items()},
                         **{f"mpc_with_{k}": v for k, (_, v) in with_.items()}}
        with open(os.path.join(args.out, "gpu_vs_torch.json"), "w") as f:  # after each model
            json.dump(results, f, indent=1)
        print(f"\n{name} (batch {batch}) on {dev}")
        for key, (ms, peak) in torch_rows.items():
            mem = f"{peak / 2**20:10.1f} MiB" if peak else ""
            print(f"  torch {key:<18} {ms if ms is not None else float('nan'):10.3f} ms {mem}")
        if "error" in mpc:
            print(f"  mpc: {mpc['error']}")
            lines.append(f"{name}: mpc failed: {mpc['error'][:200]}")
            continue
        for policy, row in mpc.items():
            mem = mpc_memory(row) / 2**20
            plan = (row["arena_bytes"] + row["state_bytes"] + row["constants_bytes"]) / 2**20
            used = row.get("device_memory_used")
            alloc = f" (driver: {used / 2**20:.1f} MiB more in use)" if used is not None else ""
            if "workspace_bytes" in row:
                alloc += (f", workspace {row['workspace_bytes'] / 2**20:.1f} MiB "
                          f"({row['scratch_in_arena']} launches' scratch in the arena)")
            convs = row.get("cudnn_convolutions", 0) + row.get("cudnn_refused", 0)
            dnn = f", cuDNN {row['cudnn_convolutions']} of {convs} convolutions" if convs else ""
            lts = row.get("cublaslt_gemms", 0) + row.get("cublaslt_refused", 0)
            dnn += f", cuBLASLt {row['cublaslt_gemms']} of {lts} products with an epilogue" if lts else ""
            print(f"  mpc   {policy:<18} {row['step_ms_median']:10.3f} ms {mem:10.1f} MiB (plan {plan:.1f}){alloc}"
                  f"  {row['tflops']:.3f} TFLOP/s ({100 * row['share_of_peak']:.1f}% of the measured GEMM rate){dnn}")
        for what, rows in without.values():
            if rows and "mixed" in rows and "mixed" in mpc:
                ms = rows["mixed"]["step_ms_median"]
                line = (f"mpc mixed {what}: {mpc['mixed']['step_ms_median'] / ms:.2f}x "
                        f"({ms:.3f} ms and {rows['mixed']['launches_per_step']} launches without)")
                print("  " + line)
                lines.append(f"{name}: {line}")
        for what, rows in with_.values():
            if "error" in rows:
                line = f"mpc {what}: failed: {rows['error'][:200]}"
                print("  " + line)
                lines.append(f"{name}: {line}")
                continue
            for policy, row in rows.items():
                if policy not in mpc:
                    continue
                base = mpc[policy]
                line = (f"mpc {policy} {what}: step {row['step_ms_median'] / base['step_ms_median']:.2f}x "
                        f"({row['step_ms_median']:.3f} ms, {row['launches_per_step']} launches), "
                        f"memory {mpc_memory(row) / mpc_memory(base):.2f}x "
                        f"(activations' arena {row['arena_bytes'] / 2**20:.1f} MiB)")
                print("  " + line)
                lines.append(f"{name}: {line}")
                for ours, theirs in [("mixed", "amp-fp16"), ("mixed-bf16", "amp-bf16")]:
                    ms, peak = torch_rows.get(theirs, (None, None))
                    if ours == policy and ms:
                        mem = f", memory {mpc_memory(row) / peak:.2f}x" if peak else ""
                        line = (f"mpc {ours} with the fused attention / torch {theirs}: "
                                f"step {row['step_ms_median'] / ms:.2f}x{mem}")
                        print("  " + line)
                        lines.append(f"{name}: {line}")
                if "fp32" in mpc and policy == "mixed":
                    line = (f"mpc mixed with the fused attention: memory {mpc_memory(row) / mpc_memory(mpc['fp32']):.2f}x "
                            f"mpc fp32's (activations' arena {row['arena_bytes'] / mpc['fp32']['arena_bytes']:.2f}x)")
                    print("  " + line)
                    lines.append(f"{name}: {line}")
                if row.get("profile"):
                    top = ", ".join(f"{o['op']} {o['dtype']} {100 * o['share']:.0f}% ({o['launches']}, "
                                    f"{o.get('gb_per_s', 0):.0f} GB/s)" for o in row["profile"][:8])
                    print(f"  mpc   {policy} with the fused attention by op: {top}")
        for policy, row in mpc.items():
            if row.get("profile"):
                top = ", ".join(f"{o['op']} {o['dtype']} {100 * o['share']:.0f}% ({o['launches']}, "
                                f"{o.get('gb_per_s', 0):.0f} GB/s)" for o in row["profile"][:8])
                print(f"  mpc   {policy} by op: {top}")
        pairs = [("fp32", "fp32"), ("mixed", "amp-fp16"), ("mixed-bf16", "amp-bf16")]
        for ours, theirs in pairs + [(o, t + " compile") for o, t in pairs]:
            ms, peak = torch_rows.get(theirs, (None, None))
            row = mpc.get(ours)
            if ms and row:
                mem = mpc_memory(row)
                ratio_mem = f", memory {mem / peak:.2f}x" if peak else ""
                line = f"mpc {ours} / torch {theirs}: step {row['step_ms_median'] / ms:.2f}x{ratio_mem}"
                print("  " + line)
                lines.append(f"{name}: {line} ({row['step_ms_median']:.3f} ms vs {ms:.3f} ms)")
        if "fp32" in mpc and "mixed" in mpc:
            line = (f"mpc mixed speed-up over its fp32: {mpc['fp32']['step_ms_median'] / mpc['mixed']['step_ms_median']:.2f}x, "
                    f"memory {mpc_memory(mpc['mixed']) / mpc_memory(mpc['fp32']):.2f}x its fp32's "
                    f"(activations' arena {mpc['mixed']['arena_bytes'] / mpc['fp32']['arena_bytes']:.2f}x, "
                    f"training state {mpc['mixed']['state_bytes'] / 2**20:.1f} against "
                    f"{mpc['fp32']['state_bytes'] / 2**20:.1f} MiB)")
            print("  " + line)
            lines.append(f"{name}: {line}")
    print("\nsummary")
    for line in lines:
        print("  " + line)
    os.rmdir(exports)


def mpc_memory(row):
    """mpc's device memory for a policy: every allocation of its run where the JSON has it."""
    if "allocated_bytes" in row:
        return row["allocated_bytes"]
    return row["arena_bytes"] + row["state_bytes"] + row["constants_bytes"]


if __name__ == "__main__":
    main()
