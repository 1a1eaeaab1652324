#!/usr/bin/env python3
"""A model of the data-parallel training step on N GPUs, from the measured one-GPU step.

    python3 benches/scaling_model.py [--busbw GBPS] [--gpus N] [--latency-us US]
    # Python 3's standard library only; runs nothing, measures nothing

For the GPU benchmark's GPT-2-small shape (seq 512, batch 8 per GPU) and ResNet-50 (224², batch 64
per GPU), under mixed with AdamW, it predicts the step at N GPUs with the same batch per GPU:

    t(N) = t_compute + t_comm - overlap

- t_compute: the one-GPU step mpc measured (docs/gpu-performance.md).
- t_comm, the step as lowered now (docs/data-parallel.md): every gradient all-reduced in FP32
  (widened first, before unscaling: passes/src/train/optimizer.rs, `all_reduced`), and every batch
  norm's running statistics beside them: a ring all-reduce of S bytes takes
  2(N-1)/N x S / busbw. With --shard-optimizer, each gradient is reduce-scattered in FP32 and each
  weight the forward pass reads is all-gathered (its f16 copy where it has one, else its FP32
  master: passes/src/train/shard.rs, `low_copy`): (N-1)/N x (gradient bytes + weight bytes) / busbw,
  the running statistics still all-reduced. busbw is the bus bandwidth of nccl-tests
  (doc/PERFORMANCE.md there), whose factors 2(N-1)/N and (N-1)/N these are.
- overlap: none, or at most the backward pass's share of the step (the gradients' reductions
  running under the backward pass, as DDP's buckets do; the sharded step's gathers, which the
  forward pass waits for, are not overlapped).

Efficiency is t(1) / t(N): the share of N times one GPU's samples per second that N GPUs give.
These are predictions. mpc's CUDA device has no collectives yet (no NCCL): no multi-GPU step has
been measured. The model counts bytes only; each collective's fixed latency is left out unless
--latency-us gives one (the step all-reduces the gradients in buckets of at most 25 MiB, as
TrainOptions::bucket_bytes fills them, each running statistic alone, and under --shard-optimizer
one collective per tensor).

Without --busbw and --gpus it prints two cases: 8 GPUs of one NVLink node, and 16 GPUs in 2 nodes
joined by one 400 Gb/s InfiniBand port each. With either, one case (8 GPUs, 400 GB/s by default).
"""

import argparse

# The one-GPU step, mpc mixed, AdamW, median of 20 steps after 5 on an H200 (141 GB HBM3e):
# docs/gpu-performance.md, "The second measurement (2026-11-28, H200)", the table's
# "mpc mixed" column, rows (b) (line 63) and (c) (line 64).
GPT_STEP_MS = 23.43
RESNET50_STEP_MS = 18.06

# The backward pass's share of the step, which bounds the overlap: 2 of the step's 3 units of
# matrix-product and convolution FLOPs (docs/gpu-performance.md, "Floors and the first
# measurement", line 19: "three times the forward pass"). An estimate of the time's share, not a
# measurement of it: ResNet-50's profile puts the backward ops it lists (ConvGrad,
# BatchNormalizationGrad, MaxPoolGrad) at 56% of its step (the same file, line 104); GPT's has no
# such split. The last gradients are reduced after the backward pass ends, so the full overlap
# is a bound the step does not reach.
BACKWARD_SHARE = 2 / 3

# The benchmark's GPT (benches/gpu_vs_torch.py: `models`, line 124; `Gpt`, lines 93-114; `Block`,
# lines 70-90): vocabulary 50257, sequence 512, width 768, 12 layers; its LM head a Linear of its
# own (`self.head`, line 103), not tied to the token embedding.
GPT = dict(vocab=50257, seq=512, d=768, layers=12)

# torchvision's resnet50(num_classes=1000) (benches/gpu_vs_torch.py, line 136; written out as ONNX
# in benches/memory_plan.py, `resnet50`): bottleneck blocks [3, 4, 6, 3] of widths 64-512.
RESNET50 = dict(blocks=(3, 4, 6, 3), widths=(64, 128, 256, 512), classes=1000)

# Bus bandwidths (assumptions, not measurements):
# - one HGX node of 8 H100/H200 SXM GPUs, NVLink 4 through NVSwitch: 450 GB/s per GPU each way
#   (900 GB/s both ways, NVIDIA's figure); nccl-tests' all-reduce bus bandwidth on such a node is
#   reported between about 350 and 480 GB/s; 400 GB/s here;
# - two nodes joined by one 400 Gb/s InfiniBand port each: 50 GB/s at line rate, 48 GB/s here.
NVLINK_BUSBW_GBPS = 400.0
IB_BUSBW_GBPS = 48.0

F32, F16 = 4, 2  # bytes per element


def gpt_tensors(vocab, seq, d, layers):
    """(elements, bytes of the weight the forward pass reads under mixed) of each parameter."""
    matrix = lambda n: (n, F16 * n)  # a product's weight: its f16 copy is gathered
    # Embeddings, biases, LayerNorm scales and shifts: the f32 master. (A bias added in f16 has
    # an f16 copy instead: all of GPT's biases, 82,944 elements, at 2 B would gather 0.04% less.)
    master = lambda n: (n, F32 * n)
    out = [master(vocab * d), master(seq * d)]  # tok, pos
    for _ in range(layers):
        out += [master(d), master(d), master(d), master(d)]  # ln1, ln2 (weight, bias)
        for d_in, d_out in ((d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)):  # qkv, proj, fc, out
            out += [matrix(d_in * d_out), master(d_out)]
    out += [master(d), master(d), matrix(d * vocab)]  # ln, head (no bias)
    return out, []


def resnet50_tensors(blocks, widths, classes):
    """(elements, gathered bytes) of each parameter, and the running statistics' elements."""
    params, stats = [], []

    def conv(cin, cout, k):
        params.append((cin * cout * k * k, F16 * cin * cout * k * k))

    def bn(c):
        params.extend([(c, F32 * c)] * 2)  # scale and bias stay f32
        stats.extend([c, c])  # running mean and variance

    conv(3, 64, 7)
    bn(64)
    c = 64
    for i, (n, w) in enumerate(zip(blocks, widths)):
        for j in range(n):
            stride = 2 if j == 0 and i > 0 else 1
            for cin, cout, k in ((c, w, 1), (w, w, 3), (w, 4 * w, 1)):
                conv(cin, cout, k)
                bn(cout)
            if stride != 1 or c != 4 * w:  # the downsample: a 1x1 convolution and its batch norm
                conv(c, 4 * w, 1)
                bn(4 * w)
            c = 4 * w
    params += [(c * classes, F16 * c * classes), (classes, F16 * classes)]  # fc (Gemm): weight, bias
    return params, stats


BUCKET_BYTES = 25 << 20  # TrainOptions::bucket_bytes' default (passes/src/train/mod.rs)


def buckets(params):
    """How many all-reduces the gradients take: filled in reverse order as
    `all_reduced_in_buckets` (passes/src/train/optimizer.rs) fills them, FP32 bytes each."""
    filled = []
    for e, _ in reversed(params):
        if filled and filled[-1] + F32 * e <= BUCKET_BYTES:
            filled[-1] += F32 * e
        else:
            filled.append(F32 * e)
    return len(filled)


def predict(step_ms, tensors, gpus, busbw_gbps, latency_us, shard):
    params, stats = tensors
    n = gpus
    busbw = busbw_gbps * 1e9
    grad_bytes = F32 * sum(e for e, _ in params)
    weight_bytes = sum(b for _, b in params)
    stat_bytes = F32 * sum(stats)
    ring = 2 * (n - 1) / n
    half = (n - 1) / n
    if shard:
        # Reduce-scatter of the gradients (overlappable), all-gather of the weights (not), the
        # running statistics all-reduced, and one all-reduce of the finite flag.
        t_under_bwd = (half * grad_bytes + ring * stat_bytes) / busbw
        t_before_fwd = half * weight_bytes / busbw
        calls_under, calls_before = len(params) + len(stats) + 1, len(params)
    else:
        t_under_bwd = ring * (grad_bytes + stat_bytes) / busbw
        t_before_fwd = 0.0
        calls_under, calls_before = buckets(params) + len(stats), 0
    t_under_bwd = t_under_bwd * 1e3 + calls_under * latency_us * 1e-3
    t_before_fwd = t_before_fwd * 1e3 + calls_before * latency_us * 1e-3
    comm = t_under_bwd + t_before_fwd
    no_overlap = step_ms + comm
    full = step_ms + t_before_fwd + max(0.0, t_under_bwd - BACKWARD_SHARE * step_ms)
    # Bytes each GPU sends (and receives) in the step's collectives.
    moved = (half * (grad_bytes + weight_bytes) + ring * stat_bytes) if shard else ring * (grad_bytes + stat_bytes)
    return dict(moved=moved, comm=comm, none=no_overlap, full=full, calls=calls_under + calls_before)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busbw", type=float, metavar="GBPS", help="bus bandwidth in GB/s (default: the two cases)")
    ap.add_argument("--gpus", type=int, metavar="N", help="GPUs, one rank each (default: the two cases)")
    ap.add_argument("--latency-us", type=float, default=0.0, metavar="US",
                    help="fixed cost of each collective call in µs (default 0: bandwidth only)")
    a = ap.parse_args()
    if a.gpus is not None and a.gpus < 1 or a.busbw is not None and a.busbw <= 0:
        ap.error("--gpus must be at least 1 and --busbw positive")
    if a.busbw is None and a.gpus is None:
        cases = [(8, NVLINK_BUSBW_GBPS, "1 node, NVLink"), (16, IB_BUSBW_GBPS, "2 nodes, 400 Gb/s IB")]
    else:
        cases = [(a.gpus or 8, a.busbw or NVLINK_BUSBW_GBPS, "")]
    models = [("GPT-2-small shape, seq 512, batch 8/GPU", GPT_STEP_MS, gpt_tensors(**GPT)),
              ("ResNet-50, 224², batch 64/GPU", RESNET50_STEP_MS, resnet50_tensors(**RESNET50))]

    for name, step, tensors in models:
        params, stats = tensors
        calls = [predict(step, tensors, 2, 1.0, 0.0, shard)["calls"] for shard in (False, True)]
        print(f"{name}: {sum(e for e, _ in params):,} parameters in {len(params)} tensors"
              + (f", {sum(stats):,} running statistics in {len(stats)}" if stats else "")
              + f"; FP32 gradients {F32 * sum(e for e, _ in params) / 1e6:.1f} MB; one GPU {step:.2f} ms;"
              + f" collective calls per step {calls[0]} ({calls[1]} sharded)")
    print(f"(overlap at most the backward pass, {BACKWARD_SHARE:.0%} of the step; collective latency "
          + (f"{a.latency_us:g} µs per call)" if a.latency_us else "not counted)"))
    print()
    print("| model | collectives | GPUs | busbw | sent per GPU | t_comm | step, no overlap | efficiency "
          "| step, full overlap | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, step, tensors in models:
        for shard in (False, True):
            for gpus, busbw, where in cases:
                p = predict(step, tensors, gpus, busbw, a.latency_us, shard)
                label = name.split(",")[0]
                kind = "`--shard-optimizer`" if shard else "all-reduce"
                at = f"{busbw:g} GB/s" + (f" ({where})" if where else "")
                print(f"| {label} | {kind} | {gpus} | {at} | {p['moved'] / 1e6:.0f} MB | {p['comm']:.2f} ms "
                      f"| {p['none']:.2f} ms | {step / p['none']:.0%} | {p['full']:.2f} ms | {step / p['full']:.0%} |")


if __name__ == "__main__":
    main()
