#!/usr/bin/env python3
"""Differential check of mpc's training gradients against PyTorch autograd on small random modules.

    python3 fuzz/differential/torch_modules.py --mpc target/release/mpc --graphs N --seed S --out DIR
    python3 fuzz/differential/torch_modules.py --mpc target/release/mpc --seed S --only I --out DIR
    python3 fuzz/differential/torch_modules.py --mpc target/release/mpc --module DESC.json --out DIR
    python3 fuzz/differential/torch_modules.py --mpc target/release/mpc --graphs N --seed S \\
        --write-cases tests/models/torch_modules
    python3 fuzz/differential/torch_modules.py --mpc target/release/mpc --replay tests/models/torch_modules [--promote]

Each module (deterministic from (seed, index)) is a random composition of 2-8 blocks over a
tracked shape (Linear, convolutions, norms, pools, activations, attention, indexing, ...), from a
float input [B, F], [B, C, L] or [B, C, H, W] or integer ids [B, L] through nn.Embedding, ending in
a head for cross-entropy (classes on axis 1) or a mean squared error against targets of the
output's shape. Both torch exporters write it, with a dynamic batch: `legacy` (dynamo=False,
without constant folding), `dynamo_raw` (dynamo=True without its optimizer) and `dynamo` (after
the optimizer, torch's default); `mpc train --policy fp32 --optimizer sgd --max-steps 1` takes one
step on each, B samples in one batch. Every trained initializer's
update w0 - w1 is compared with lr times torch's gradient (float64 autograd, the module in train
mode), keyed by initializer name or by value (equal, reshaped or transposed); BatchNorm's running
statistics with torch's after the same forward pass; the loss mpc prints with torch's.

Replay (`--replay`) needs only numpy, onnx and safetensors: it reruns the committed cases that
`--write-cases` wrote and exits 1 when one that matched no longer does, or a known failure crashes.
docs/differential.md ("Training gradients against PyTorch") says what is compared and why.
"""

import argparse
import contextlib
import copy
import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

import harness as hs  # noqa: E402

try:  # only generating and exporting need torch; --replay does not
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    Module = nn.Module
except ImportError:  # pragma: no cover
    torch = nn = F = None
    Module = object

ROOT = os.path.dirname(os.path.dirname(HERE))
OPSET = 18
EXPORTERS = ("legacy", "dynamo", "dynamo_raw")
# A parameter's update must be within this relative L2 distance of lr * torch's gradient. The
# reference is float64 autograd, mpc computes in float32: the error of a gradient of these tiny
# modules (reductions over at most a few hundred terms, a few layers) is a few float32 ulps
# relative, about 1e-6; BatchNorm/LayerNorm over 2-4 samples and softmax saturation amplify it
# perhaps 10-30 times. 1e-4 (the zoo's bound, tests/zoo.rs) leaves a margin of more than 3 on
# top, while a wrong rule (a missing term, a transposed or mis-scaled gradient) is off by 1e-2 or
# more. The learning rate (choose_lr) makes lr * gradient at least 1000 times each weight, so
# the float32 rounding of w1 (half an ulp of |w1|, about 6e-8 of the update) is not the error.
REL_L2 = 1e-4
# A gradient that vanishes in exact arithmetic (a bias before a BatchNorm, a bias under a
# softmax) is rounding in both: it must be rounding-sized in mpc too, judged against the largest
# gradient of the module (tests/zoo.rs).
VANISH = 1e-6
MPC_TIMEOUT = 60
warnings.filterwarnings("ignore")


def ri(rng, a, b):
    return int(rng.integers(a, b + 1))


def pick(rng, xs):
    return xs[int(rng.integers(len(xs)))]


def coin(rng, p=0.5):
    return bool(rng.random() < p)


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def axis(rng, s, least=1):
    """A non-batch axis whose size is at least `least`, or None."""
    ok = [d for d in range(1, len(s)) if s[d] >= least]
    return pick(rng, ok) if ok else None


# ---------------------------------------------------------------------- blocks
# A block is {"type": NAME, "args": {...}}; DRAW[NAME](rng, shape) draws its arguments for an input
# of `shape` (the batch first) or returns None when the block does not apply there; MAKE[NAME](args)
# builds the nn.Module. The output shape is found by running the block.
DRAW, MAKE = {}, {}


def block(name):
    def deco(fn):
        DRAW[name] = fn
        return fn
    return deco


class Fn(Module):
    """A stateless function of x: FN[kind](x, **args)."""

    def __init__(self, kind, args):
        super().__init__()
        self.kind, self.args = kind, dict(args)

    def forward(self, x):
        return FN[self.kind](x, **self.args)


def _split_cat(x, sizes, order, dim):
    parts = torch.split(x, sizes, dim)
    return torch.cat([parts[i] for i in order], dim)


def _glu(x, dim):
    a, b = x.chunk(2, dim)
    return a * torch.sigmoid(b)


FN = {
    "div_abs": lambda x: x / (1 + x.abs()),
    "clamp": lambda x, lo, hi: x.clamp(lo, hi),
    "pow2": lambda x: x.pow(2),
    "sqrt1": lambda x: torch.sqrt(x * x + 1),
    "gauss": lambda x: torch.exp(-x * x),
    "log1p_abs": lambda x: torch.log1p(x.abs()),
    "where": lambda x, t, a: torch.where(x > t, x, a * x),
    "reduce": lambda x, op, dim, keep: getattr(torch, op)(x, dim=dim, keepdim=keep),
    "mean_rest": lambda x: x.mean(dim=tuple(range(2, x.dim()))),
    "flatten": lambda x, a, b: x.flatten(a, b),
    "unflatten": lambda x, dim, sizes: x.unflatten(dim, sizes),
    "reshape": lambda x, lead, rest: x.reshape(-1 if lead == "-1" else x.shape[0], *rest),
    "permute": lambda x, perm: x.permute(0, *perm),
    "transpose": lambda x, a, b: x.transpose(a, b),
    "interpolate": lambda x, mode, scale, size, align: F.interpolate(x, size=size, scale_factor=scale, mode=mode,
                                                                     align_corners=align),
    "flip": lambda x, dims: torch.flip(x, dims),
    "slice": lambda x, dim, start, stop, step: x[(slice(None),) * dim + (slice(start, stop, step),)],
    "chunk_cat": lambda x, n, dim: torch.cat(x.chunk(n, dim)[::-1], dim),
    "split_cat": _split_cat,
    "glu": _glu,
    "softmax": lambda x, dim: F.softmax(x, dim=dim),
    "log_softmax": lambda x, dim: F.log_softmax(x, dim=dim),
    "cumsum": lambda x, dim: x.cumsum(dim),
    "normalize": lambda x, dim: F.normalize(x, dim=dim),
}


def fn_block(name, draw):
    """A block that is the function FN[name] with the drawn arguments."""
    DRAW[name] = draw
    MAKE[name] = lambda a, name=name: Fn(name, a)


@block("linear")
def d_linear(rng, s):
    return {"i": s[-1], "o": ri(rng, 2, 8), "bias": coin(rng, 0.8)}


MAKE["linear"] = lambda a: nn.Linear(a["i"], a["o"], bias=a["bias"])


def d_conv(rng, s, nd, transpose=False):
    if len(s) != 2 + nd:
        return None
    c = s[1]
    g = pick(rng, divisors(c)) if coin(rng, 0.3) else 1
    k, stride, dil = ri(rng, 1, 3), ri(rng, 1, 2), pick(rng, [1, 1, 2])
    a = {"i": c, "o": g * ri(rng, 1, max(1, 8 // g)), "k": k, "stride": stride, "dilation": dil, "groups": g,
         "bias": coin(rng, 0.8)}
    if transpose:
        a["padding"] = ri(rng, 0, dil * (k - 1))
        a["output_padding"] = ri(rng, 0, max(stride, dil) - 1)
        return a
    a["padding"] = "same" if stride == 1 and coin(rng, 0.2) else ri(rng, 0, dil * (k - 1))
    a["mode"] = pick(rng, ["reflect", "replicate", "circular"]) if a["padding"] != 0 and coin(rng, 0.1) else "zeros"
    return a


def make_conv(a, nd):
    cls = [nn.Conv1d, nn.Conv2d][nd - 1]
    return cls(a["i"], a["o"], a["k"], stride=a["stride"], padding=a["padding"], dilation=a["dilation"],
               groups=a["groups"], bias=a["bias"], padding_mode=a["mode"])


def make_conv_t(a, nd):
    cls = [nn.ConvTranspose1d, nn.ConvTranspose2d][nd - 1]
    return cls(a["i"], a["o"], a["k"], stride=a["stride"], padding=a["padding"], output_padding=a["output_padding"],
               dilation=a["dilation"], groups=a["groups"], bias=a["bias"])


for _nd in (1, 2):
    DRAW[f"conv{_nd}d"] = lambda rng, s, nd=_nd: d_conv(rng, s, nd)
    MAKE[f"conv{_nd}d"] = lambda a, nd=_nd: make_conv(a, nd)
    DRAW[f"conv_transpose{_nd}d"] = lambda rng, s, nd=_nd: d_conv(rng, s, nd, transpose=True)
    MAKE[f"conv_transpose{_nd}d"] = lambda a, nd=_nd: make_conv_t(a, nd)


@block("batch_norm")
def d_batch_norm(rng, s):
    return {"c": s[1], "rank": len(s), "momentum": pick(rng, [0.1, 0.3]), "eps": pick(rng, [1e-5, 1e-3]),
            "affine": coin(rng, 0.85)}


MAKE["batch_norm"] = lambda a: (nn.BatchNorm2d if a["rank"] == 4 else nn.BatchNorm1d)(
    a["c"], eps=a["eps"], momentum=a["momentum"], affine=a["affine"])


@block("layer_norm")
def d_layer_norm(rng, s):
    n = pick(rng, [1, 1, 2]) if len(s) >= 3 else 1
    if np.prod(s[-n:]) < 2:
        return None
    return {"shape": list(s[-n:]), "affine": coin(rng, 0.85), "bias": coin(rng, 0.8)}


MAKE["layer_norm"] = lambda a: nn.LayerNorm(a["shape"], elementwise_affine=a["affine"], bias=a["bias"])


@block("group_norm")
def d_group_norm(rng, s):
    return {"groups": pick(rng, divisors(s[1])), "c": s[1], "affine": coin(rng, 0.85)} if len(s) >= 3 else None


MAKE["group_norm"] = lambda a: nn.GroupNorm(a["groups"], a["c"], affine=a["affine"])


@block("instance_norm")
def d_instance_norm(rng, s):
    return {"c": s[1], "rank": len(s)} if len(s) in (3, 4) and int(np.prod(s[2:])) > 1 else None


MAKE["instance_norm"] = lambda a: (nn.InstanceNorm2d if a["rank"] == 4 else nn.InstanceNorm1d)(a["c"], affine=True)


@block("rms_norm")
def d_rms_norm(rng, s):
    return {"d": s[-1], "eps": 1e-6} if hasattr(nn, "RMSNorm") else None


MAKE["rms_norm"] = lambda a: nn.RMSNorm(a["d"], eps=a["eps"])


@block("max_pool")
def d_max_pool(rng, s):
    if len(s) not in (3, 4):
        return None
    k = ri(rng, 2, 3)
    return {"nd": len(s) - 2, "k": k, "stride": ri(rng, 1, k), "padding": ri(rng, 0, k // 2),
            "dilation": pick(rng, [1, 1, 2]), "ceil": coin(rng, 0.3)}


MAKE["max_pool"] = lambda a: [nn.MaxPool1d, nn.MaxPool2d][a["nd"] - 1](
    a["k"], a["stride"], a["padding"], dilation=a["dilation"], ceil_mode=a["ceil"])


@block("avg_pool")
def d_avg_pool(rng, s):
    if len(s) not in (3, 4):
        return None
    k = ri(rng, 2, 3)
    return {"nd": len(s) - 2, "k": k, "stride": ri(rng, 1, k), "padding": ri(rng, 0, k // 2),
            "ceil": coin(rng, 0.3), "count_pad": coin(rng)}


MAKE["avg_pool"] = lambda a: [nn.AvgPool1d, nn.AvgPool2d][a["nd"] - 1](
    a["k"], a["stride"], a["padding"], ceil_mode=a["ceil"], count_include_pad=a["count_pad"])


@block("adaptive_pool")
def d_adaptive_pool(rng, s):
    if len(s) not in (3, 4):
        return None
    size = [pick(rng, divisors(d)) if coin(rng, 0.7) else ri(rng, 1, d) for d in s[2:]]
    return {"nd": len(s) - 2, "size": size, "max": coin(rng, 0.25)}


def make_adaptive(a):
    cls = {(1, False): nn.AdaptiveAvgPool1d, (2, False): nn.AdaptiveAvgPool2d,
           (1, True): nn.AdaptiveMaxPool1d, (2, True): nn.AdaptiveMaxPool2d}[(a["nd"], a["max"])]
    return cls(a["size"][0] if a["nd"] == 1 else tuple(a["size"]))


MAKE["adaptive_pool"] = make_adaptive

ACTIVATIONS = {
    "relu": lambda a: nn.ReLU(), "gelu": lambda a: nn.GELU(), "gelu_tanh": lambda a: nn.GELU("tanh"),
    "silu": lambda a: nn.SiLU(), "tanh": lambda a: nn.Tanh(), "sigmoid": lambda a: nn.Sigmoid(),
    "elu": lambda a: nn.ELU(a["alpha"]), "leaky_relu": lambda a: nn.LeakyReLU(a["alpha"]),
    "softplus": lambda a: nn.Softplus(a["beta"]), "hardswish": lambda a: nn.Hardswish(),
    "hardsigmoid": lambda a: nn.Hardsigmoid(), "mish": lambda a: nn.Mish(), "celu": lambda a: nn.CELU(a["alpha"]),
    "selu": lambda a: nn.SELU(), "prelu": lambda a: nn.PReLU(a["n"]),
}


@block("activation")
def d_activation(rng, s):
    name = pick(rng, sorted(ACTIVATIONS))
    return {"name": name, "alpha": pick(rng, [0.1, 0.5, 1.5]), "beta": pick(rng, [1.0, 2.0]),
            "n": s[1] if coin(rng) else 1}


MAKE["activation"] = lambda a: ACTIVATIONS[a["name"]](a)


@block("elementwise")
def d_elementwise(rng, s):
    kind = pick(rng, ["div_abs", "clamp", "pow2", "sqrt1", "gauss", "log1p_abs", "where"])
    args = {}
    if kind == "clamp":
        args = {"lo": pick(rng, [None, -1.0, -0.5]), "hi": pick(rng, [None, 0.5, 1.0])}
        if args["lo"] is None and args["hi"] is None:
            args["lo"] = -0.5
    elif kind == "where":
        args = {"t": pick(rng, [0.0, 0.3]), "a": pick(rng, [0.1, -0.5])}
    return {"kind": kind, "args": args}


MAKE["elementwise"] = lambda a: Fn(a["kind"], a["args"])


class Gate(Module):
    """x * Linear(x): a product of two branches (GLU and SwiGLU style)."""

    def __init__(self, d, bias):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=bias)

    def forward(self, x):
        return x * self.lin(x)


@block("mul")
def d_mul(rng, s):
    return {"d": s[-1], "bias": coin(rng)}


MAKE["mul"] = lambda a: Gate(a["d"], a["bias"])


@block("reduce")
def d_reduce(rng, s):
    d = axis(rng, s, least=2)
    if d is None:
        return None
    return {"op": pick(rng, ["mean", "sum", "amax"]), "dim": d, "keep": coin(rng) or len(s) == 2}


fn_block("reduce", d_reduce)


def d_reshape(rng, s):
    r = len(s)
    opts = []
    if r >= 3:
        a = ri(rng, 1, r - 2)
        opts.append(("flatten", {"a": a, "b": a + 1}))
    split = [d for d in range(1, r) if len(divisors(s[d])) > 2 and r < 4]
    if split:
        d = pick(rng, split)
        p = pick(rng, divisors(s[d])[1:-1])
        opts.append(("unflatten", {"dim": d, "sizes": [p, s[d] // p]}))
    n = int(np.prod(s[1:]))
    rest = [n // f for f in divisors(n) if f > 1 and f <= 8 and n // f <= 8 and n // f > 1]
    if rest:
        f = pick(rng, rest)
        opts.append(("reshape", {"lead": pick(rng, ["-1", "batch"]), "rest": [f, n // f]}))
    if not opts:
        return None
    kind, args = pick(rng, opts)
    return {"kind": kind, "args": args}


DRAW["reshape"] = d_reshape
MAKE["reshape"] = lambda a: Fn(a["kind"], a["args"])


@block("permute")
def d_permute(rng, s):
    r = len(s)
    if r < 3:
        return None
    if coin(rng):
        a, b = (int(v) for v in rng.choice(np.arange(1, r), 2, replace=False))
        return {"kind": "transpose", "args": {"a": a, "b": b}}
    perm = list(range(1, r))
    while perm == list(range(1, r)):
        perm = [int(v) for v in rng.permutation(np.arange(1, r))]
    return {"kind": "permute", "args": {"perm": perm}}


MAKE["permute"] = lambda a: Fn(a["kind"], a["args"])


def d_interpolate(rng, s):
    if len(s) not in (3, 4):
        return None
    mode = pick(rng, ["nearest", "linear" if len(s) == 3 else "bilinear"])
    align = coin(rng) if mode != "nearest" else None
    if coin(rng):
        return {"mode": mode, "scale": 2.0, "size": None, "align": align}
    return {"mode": mode, "scale": None, "size": [ri(rng, 2, 8) for _ in s[2:]], "align": align}


fn_block("interpolate", d_interpolate)
fn_block("flip", lambda rng, s: {"dims": sorted({axis(rng, s) for _ in range(ri(rng, 1, 2))})})


class Gather(Module):
    """torch.gather along `dim` with an index buffer, expanded to the batch."""

    def __init__(self, dim, index):
        super().__init__()
        self.dim = dim
        self.register_buffer("idx", torch.tensor(index, dtype=torch.int64))

    def forward(self, x):
        return x.gather(self.dim, self.idx.expand(x.shape[0], *self.idx.shape[1:]))


@block("gather")
def d_gather(rng, s):
    d = axis(rng, s)
    shape = [1] + list(s[1:])
    shape[d] = ri(rng, 1, s[d] + 1)
    return {"dim": d, "index": rng.integers(0, s[d], shape).tolist()}


MAKE["gather"] = lambda a: Gather(a["dim"], a["index"])


class IndexSelect(Module):
    def __init__(self, dim, index):
        super().__init__()
        self.dim = dim
        self.register_buffer("idx", torch.tensor(index, dtype=torch.int64))

    def forward(self, x):
        return x.index_select(self.dim, self.idx)


@block("index_select")
def d_index_select(rng, s):
    d = axis(rng, s)
    return {"dim": d, "index": rng.integers(0, s[d], ri(rng, 1, s[d] + 1)).tolist()}


MAKE["index_select"] = lambda a: IndexSelect(a["dim"], a["index"])


def d_slice(rng, s):
    d = axis(rng, s, least=3)
    if d is None:
        return None
    return {"dim": d, "start": ri(rng, 0, 1), "stop": pick(rng, [None, -1, s[d]]), "step": pick(rng, [1, 2, 2, 3])}


fn_block("slice", d_slice)


def d_chunk_cat(rng, s):
    d = axis(rng, s, least=2)
    return None if d is None else {"n": ri(rng, 2, min(3, s[d])), "dim": d}


fn_block("chunk_cat", d_chunk_cat)


def d_split_cat(rng, s):
    d = axis(rng, s, least=2)
    if d is None:
        return None
    cut = sorted({ri(rng, 1, s[d] - 1) for _ in range(ri(rng, 1, 2))})
    sizes = [b - a for a, b in zip([0] + cut, cut + [s[d]])]
    order = [int(v) for v in rng.permutation(len(sizes))]
    return {"sizes": sizes, "order": order, "dim": d}


fn_block("split_cat", d_split_cat)


def d_glu(rng, s):
    ok = [d for d in range(1, len(s)) if s[d] % 2 == 0]
    return {"dim": pick(rng, ok)} if ok else None


fn_block("glu", d_glu)
def d_axis(rng, s):
    d = axis(rng, s, least=2)  # over one element, these are constants
    return None if d is None else {"dim": d}


for _name in ("softmax", "log_softmax", "cumsum", "normalize"):
    fn_block(_name, d_axis)


def causal(t):
    return torch.triu(torch.ones(t, t, dtype=torch.bool), 1)


class Mha(Module):
    """nn.MultiheadAttention as self-attention, batch first or not, optionally causal."""

    def __init__(self, e, heads, batch_first, bias, mask_t, need_weights):
        super().__init__()
        self.bf, self.nw = batch_first, need_weights
        self.attn = nn.MultiheadAttention(e, heads, bias=bias, batch_first=batch_first)
        self.register_buffer("mask", causal(mask_t) if mask_t else None)

    def forward(self, x):
        if not self.bf:
            x = x.transpose(0, 1)
        y = self.attn(x, x, x, attn_mask=self.mask, need_weights=self.nw)[0]
        return y if self.bf else y.transpose(0, 1)


@block("mha")
def d_mha(rng, s):
    if len(s) != 3:
        return None
    return {"e": s[2], "heads": pick(rng, divisors(s[2])[:3]), "batch_first": coin(rng), "bias": coin(rng, 0.8),
            "mask_t": s[1] if coin(rng) else 0, "need_weights": coin(rng, 0.3)}


MAKE["mha"] = lambda a: Mha(a["e"], a["heads"], a["batch_first"], a["bias"], a["mask_t"], a["need_weights"])


class Encoder(Module):
    def __init__(self, e, heads, ff, act, norm_first, batch_first):
        super().__init__()
        self.bf = batch_first
        self.layer = nn.TransformerEncoderLayer(e, heads, ff, dropout=0.0, activation=act, batch_first=batch_first,
                                                norm_first=norm_first)

    def forward(self, x):
        if not self.bf:
            return self.layer(x.transpose(0, 1)).transpose(0, 1)
        return self.layer(x)


@block("encoder")
def d_encoder(rng, s):
    if len(s) != 3:
        return None
    return {"e": s[2], "heads": pick(rng, divisors(s[2])[:3]), "ff": ri(rng, 4, 8), "act": pick(rng, ["relu", "gelu"]),
            "norm_first": coin(rng), "batch_first": coin(rng)}


MAKE["encoder"] = lambda a: Encoder(a["e"], a["heads"], a["ff"], a["act"], a["norm_first"], a["batch_first"])


class MaskedAttention(Module):
    """Single-head causal attention by hand: scores.masked_fill(mask, -inf), softmax, times V."""

    def __init__(self, e, t, fill):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(e, e), nn.Linear(e, e), nn.Linear(e, e)
        self.fill, self.scale = fill, e ** -0.5
        self.register_buffer("mask", causal(t))

    def forward(self, x):
        s = self.q(x) @ self.k(x).transpose(-2, -1) * self.scale
        return s.masked_fill(self.mask, self.fill).softmax(-1) @ self.v(x)


@block("masked_attention")
def d_masked_attention(rng, s):
    return {"e": s[2], "t": s[1], "fill": pick(rng, [float("-inf"), -1e9])} if len(s) == 3 else None


MAKE["masked_attention"] = lambda a: MaskedAttention(a["e"], a["t"], a["fill"])


@block("pixel_shuffle")
def d_pixel_shuffle(rng, s):
    if len(s) != 4:
        return None
    if s[1] % 4 == 0 and coin(rng):
        return {"unshuffle": False}
    return {"unshuffle": True} if s[2] % 2 == 0 and s[3] % 2 == 0 and s[1] <= 4 else None


MAKE["pixel_shuffle"] = lambda a: nn.PixelUnshuffle(2) if a["unshuffle"] else nn.PixelShuffle(2)


class Residual(Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = nn.Sequential(*[make(b) for b in inner])

    def forward(self, x):
        return x + self.inner(x)


@block("residual")
def d_residual(rng, s):
    d = s[-1]
    h = ri(rng, 2, 8)
    inner = pick(rng, [
        [{"type": "linear", "args": {"i": d, "o": d, "bias": True}}],
        [{"type": "linear", "args": {"i": d, "o": h, "bias": True}}, {"type": "activation", "args": {"name": "gelu"}},
         {"type": "linear", "args": {"i": h, "o": d, "bias": coin(rng)}}],
    ] + [[{"type": "layer_norm", "args": {"shape": [d], "affine": True, "bias": True}},
          {"type": "linear", "args": {"i": d, "o": d, "bias": False}}]] * (d >= 2))
    if len(s) in (3, 4) and coin(rng, 0.4):
        k = pick(rng, [1, 3])
        conv = {"i": s[1], "o": s[1], "k": k, "stride": 1, "padding": k // 2, "dilation": 1, "groups": 1,
                "bias": True, "mode": "zeros"}
        inner = [{"type": f"conv{len(s) - 2}d", "args": conv}, {"type": "activation", "args": {"name": "relu"}}]
    return {"inner": inner}


MAKE["residual"] = lambda a: Residual(a["inner"])
MAKE["embedding"] = lambda a: nn.Embedding(a["vocab"], a["d"], padding_idx=a["padding_idx"])


def make(b):
    return MAKE[b["type"]](b["args"])


def tags(b):
    """The block's type and its variants, as the report groups them."""
    t, a = b["type"], b["args"]
    out = [t]
    if t in ("activation", "elementwise"):
        out.append(f"{t}:{a.get('name') or a.get('kind')}")
    elif t.startswith("conv"):
        out += [f"{t}:groups"] * (a["groups"] > 1) + [f"{t}:dilation"] * (a["dilation"] > 1)
        out += [f"{t}:stride"] * (a["stride"] > 1) + [f"{t}:{a.get('mode')}"] * (a.get("mode", "zeros") != "zeros")
        out += [f"{t}:same"] * (a["padding"] == "same") + [f"{t}:output_padding"] * (a.get("output_padding", 0) > 0)
    elif t in ("reduce",):
        out.append(f"reduce:{a['op']}")
    elif t in ("reshape", "permute", "elementwise"):
        out.append(f"{t}:{a['kind']}")
    elif t == "interpolate":
        out.append(f"interpolate:{a['mode']}" + (":align" if a["align"] else ""))
    elif t == "slice":
        out.append("slice:step" if a["step"] > 1 else "slice:plain")
    elif t == "mha":
        out += ["mha:batch_first" if a["batch_first"] else "mha:seq_first"] + ["mha:causal"] * bool(a["mask_t"])
    elif t == "encoder":
        out += ["encoder:batch_first" if a["batch_first"] else "encoder:seq_first"] + \
            ["encoder:norm_first"] * a["norm_first"]
    elif t == "adaptive_pool":
        out.append("adaptive_pool:max" if a["max"] else "adaptive_pool:avg")
    elif t == "pixel_shuffle":
        out.append("pixel_unshuffle" if a["unshuffle"] else "pixel_shuffle")
    elif t == "batch_norm":
        out.append(f"batch_norm:{a['rank']}d")
    elif t == "residual":
        out += [tg for inner in a["inner"] for tg in tags(inner)]
    return out


def module_tags(desc):
    return sorted({tg for b in desc["blocks"] + desc["head"] for tg in tags(b)})


# ---------------------------------------------------------------------- modules
class Net(Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList([make(b) for b in blocks])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class Reject(Exception):
    pass


def make_input(desc):
    rng = np.random.default_rng([desc["data_seed"], 0])
    inp = desc["input"]
    shape = [desc["batch"]] + inp["shape"]
    if inp["kind"] == "ids":
        return torch.tensor(rng.integers(0, inp["vocab"], shape), dtype=torch.int64)
    return torch.tensor(rng.standard_normal(shape).astype(np.float32))


def make_targets(desc, out):
    """Labels for cross-entropy (classes on axis 1 of the output) or targets of the output's shape."""
    rng = np.random.default_rng([desc["data_seed"], 1])
    if desc["loss"] == "mse":
        return torch.tensor(rng.standard_normal(tuple(out.shape)).astype(np.float32))
    return torch.tensor(rng.integers(0, out.shape[1], (out.shape[0],) + tuple(out.shape[2:])), dtype=torch.int64)


def norm_rows(b, x):
    """The rows a norm block normalises (the last axis of the result), or None for other blocks."""
    t, a = b["type"], b["args"]
    if t == "instance_norm":
        return x.flatten(2)
    if t == "group_norm":
        return x.reshape(x.shape[0], a["groups"], -1)
    if t == "layer_norm":
        return x.flatten(x.dim() - len(a["shape"]))
    if t == "batch_norm":
        return x.transpose(0, 1).flatten(1)
    return None


def probe(b, x, head=False):
    """The output of block b on x (eval and train mode must both run), or Reject. Dims stay at
    most 16 and a sample at most 512 values (a head may flatten up to 512)."""
    rows = norm_rows(b, x)
    # A norm of a row whose values are all equal (an interpolated or gathered copy of one value)
    # is a constant, and its gradient is rounding amplified by 1/sqrt(eps) (to 0.05 of the largest
    # through three of them): no test of mpc.
    if rows is not None and bool((rows.var(-1, unbiased=False) <= 1e-6 * rows.pow(2).mean(-1) + 1e-12).any()):
        raise Reject("a norm of a constant row")
    try:
        m = make(b)
        with torch.no_grad():
            y = m.eval()(x)
            m.train()(x)
    except Exception as e:
        raise Reject(str(e)[:100])
    if y.dtype != torch.float32 or y.dim() < 2 or min(y.shape) < 1 or max(y.shape[1:]) > (512 if head else 16) or \
            y[0].numel() > 512 or not torch.isfinite(y).all() or y.abs().max() > 1e3:
        raise Reject("shape or values out of range")
    return y


# How often each block type is drawn (1 when not named): the forms that mpc refuses whole modules
# for (a Slice with steps, a gather, RMSNorm that the legacy exporter cannot write) are drawn
# less, so that they hide less of the rest; PixelShuffle more, as it applies to few shapes.
WEIGHTS = {"flip": 0.5, "slice": 0.6, "rms_norm": 0.5, "gather": 0.6, "pixel_shuffle": 2.0}
INPUTS = ("vec", "seq", "img", "ids")


def generate(seed, index, single=None):
    """The module description of (seed, index): input, body blocks, head, loss, batch, seeds.
    `single` = (block type, input kind): a module of that one block (and the head) instead."""
    rng = np.random.default_rng([seed, index, 1] if single else [seed, index])
    kind = single[1] if single else pick(rng, list(INPUTS))
    shape = {"vec": lambda: [ri(rng, 2, 8)], "seq": lambda: [ri(rng, 1, 6), ri(rng, 4, 8)],
             "img": lambda: [ri(rng, 1, 4), ri(rng, 4, 7), ri(rng, 4, 7)], "ids": lambda: [ri(rng, 3, 8)]}[kind]()
    desc = {"seed": seed, "index": index, "input": {"kind": kind, "shape": shape}, "batch": ri(rng, 2, 4),
            "loss": "mse" if coin(rng, 0.35) else "cross-entropy", "blocks": [], "head": [],
            "torch_seed": (seed * 1000003 + index) % 2**31, "data_seed": (seed * 7919 + index) % 2**31}
    if single:
        desc["single"] = single[0]
    if kind == "ids":
        desc["input"]["vocab"] = ri(rng, 5, 12)
    x = make_input(desc)
    if single and kind != "ids":
        # a parameter before the block, so that its input's gradient is asked for too
        b = {"type": "linear", "args": {"i": shape[-1], "o": shape[-1], "bias": True}}
        desc["blocks"].append(b)
        x = probe(b, x)
    if kind == "ids":
        # (no padding_idx: ONNX cannot say that the padding row gets no gradient, docs)
        b = {"type": "embedding", "args": {"vocab": desc["input"]["vocab"], "d": ri(rng, 2, 8), "padding_idx": None}}
        desc["blocks"].append(b)
        x = probe(b, x)
    want = len(desc["blocks"]) + 1 if single else ri(rng, 2, 8) + (kind == "ids")
    names = [single[0]] if single else sorted(DRAW)
    p = np.array([WEIGHTS.get(n, 1.0) for n in names])
    for _ in range(80):
        if len(desc["blocks"]) >= want:
            break
        name = names[int(rng.choice(len(names), p=p / p.sum()))]
        args = DRAW[name](rng, tuple(x.shape))
        if args is None:
            continue
        b = {"type": name, "args": args}
        try:
            x = probe(b, x)
        except Reject:
            continue
        desc["blocks"].append(b)
    if len(desc["blocks"]) < want:
        raise Reject(f"fewer than {want} blocks applied")
    desc["head"] = draw_head(rng, desc, tuple(x.shape))
    if not desc["head"] and not any(p.numel() for b in desc["blocks"] for p in make(b).parameters()):
        desc["head"] = [{"type": "linear", "args": {"i": int(x.shape[-1]), "o": ri(rng, 1, 4), "bias": True}}]
    for b in desc["head"]:
        x = probe(b, x, head=True)
    return desc


def singles(draws):
    """(index, (block type, input kind)) of the --singles run: each block type alone on each input
    kind, `draws` times."""
    out = []
    for t in sorted(DRAW):
        for kind in INPUTS:
            for _ in range(draws):
                out.append((len(out), (t, kind)))
    return out


def draw_head(rng, desc, s):
    if desc["loss"] == "mse":
        return [{"type": "linear", "args": {"i": s[-1], "o": ri(rng, 1, 4), "bias": True}}] if coin(rng, 0.3) else []
    k = ri(rng, 2, 5)
    r = len(s)
    lin = lambda i: {"type": "linear", "args": {"i": i, "o": k, "bias": True}}  # noqa: E731
    opts = ["flatten"] * (r >= 3 and int(np.prod(s[1:])) <= 256) + ["mean"] * (r >= 3) + ["class_axis"] * (r in (3, 4))
    if r == 2 or not opts:
        return ([{"type": "reshape", "args": {"kind": "flatten", "args": {"a": 1, "b": -1}}}] if r > 2 else []) + \
            [lin(int(np.prod(s[1:])))]
    how = pick(rng, opts)
    if how == "flatten":
        return [{"type": "reshape", "args": {"kind": "flatten", "args": {"a": 1, "b": -1}}}, lin(int(np.prod(s[1:])))]
    if how == "mean":
        return [{"type": "mean_rest", "args": {}}, lin(s[1])]
    conv = {"i": s[1], "o": k, "k": 1, "stride": 1, "padding": 0, "dilation": 1, "groups": 1, "bias": True,
            "mode": "zeros"}
    return [{"type": f"conv{r - 2}d", "args": conv}]


MAKE["mean_rest"] = lambda a: Fn("mean_rest", a)


def build(desc):
    """The module of a description, with trained-looking weights: every parameter moved off its
    initialisation (no norm scale left at 1, no bias at 0, no two parameters equal), running
    statistics too (as tests/models/zoo/make_zoo.py)."""
    torch.manual_seed(desc["torch_seed"])
    net = Net(desc["blocks"] + desc["head"])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
        for name, b in net.named_buffers():
            if name.endswith("running_mean"):
                b.add_(0.1 * torch.randn_like(b))
            elif name.endswith("running_var"):
                b.mul_(1 + 0.2 * torch.rand_like(b))
    return net.eval()


# ---------------------------------------------------------------------- torch's side
def torch_step(net, x, y, loss_kind, dtype):
    """(loss, {param: grad}, {running statistic: value after the step}) of one training-mode
    forward and backward pass of a copy of `net` in `dtype`."""
    ref = copy.deepcopy(net).to(dtype).train()
    out = ref(x.to(dtype) if x.dtype.is_floating_point else x)
    if loss_kind == "mse":
        loss = F.mse_loss(out, y.to(dtype))
    else:
        loss = F.cross_entropy(out, y)
    loss.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy() for n, p in ref.named_parameters()}
    buffers = {n: b.numpy() for n, b in ref.named_buffers() if n.endswith(("running_mean", "running_var"))}
    return float(loss.item()), grads, buffers


def conditioning(g64, g32):
    """{param: relative error of torch's own float32 gradient against float64} (with the rule for
    vanishing gradients): how far rounding alone moves each gradient."""
    largest = max((norm(g) for g in g64.values()), default=0.0)
    out = {}
    for n, g in g64.items():
        if norm(g) <= VANISH * largest:
            out[n] = norm(g32[n]) / largest if largest else 0.0
        else:
            out[n] = norm(g32[n].astype(np.float64) - g) / norm(g)
    return out


def reference(desc, net):
    """Torch's one training step in float64: (x, targets, loss, {param: grad}, {buffer: value after
    the step}, {param: the tolerance its gradient is judged at})."""
    x = make_input(desc)
    with torch.no_grad():
        out = net.eval()(x)  # eval: a train-mode pass would move the running statistics
    y = make_targets(desc, out)
    loss, grads, buffers = torch_step(net, x, y, desc["loss"], torch.float64)
    if not any(norm(g) for g in grads.values()):
        raise Reject("every gradient is zero")
    _, g32, _ = torch_step(net, x, y, desc["loss"], torch.float32)
    # An ill-conditioned gradient (a norm's scale whose effect a second norm removes but for its
    # epsilon) is judged at ten times the error of torch's own float32 gradient, when that is
    # above REL_L2 / 10.
    tol = {n: 10 * e for n, e in conditioning(grads, g32).items() if 10 * e > REL_L2}
    return x.numpy(), y.numpy(), loss, grads, buffers, tol


@contextlib.contextmanager
def quiet():
    """The exporters' chatter (Python's and the C++ side's stdout and stderr) swallowed."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved + [null]:
            os.close(fd)


def alarm(seconds):
    def raise_timeout(*_):
        raise TimeoutError(f"export took over {seconds} s")
    signal.signal(signal.SIGALRM, raise_timeout)
    signal.alarm(seconds)


def export_all(net, x, folder, in_name, exporters):
    """{exporter: (path, note) or the exception it raised}. `legacy`: torch.onnx.export(dynamo=False,
    do_constant_folding=False), the batch a dynamic axis; `dynamo_raw`: dynamo=True, optimize=False
    (as torch.onnx documents export for training), the batch a torch.export.Dim; `dynamo`: the same
    program after its optimizer (what dynamo=True gives by default). Where the dynamic batch fails
    the dynamo export is retried with a static one, and the note says so."""
    out = {}
    for e in exporters:
        os.makedirs(os.path.join(folder, e), exist_ok=True)
    paths = {e: os.path.join(folder, e, "model.onnx") for e in EXPORTERS}
    if "legacy" in exporters:
        try:
            alarm(120)
            with quiet():
                torch.onnx.export(net, (x,), paths["legacy"], dynamo=False, opset_version=OPSET,
                                  do_constant_folding=False, input_names=[in_name], output_names=["y"],
                                  dynamic_axes={in_name: {0: "batch"}, "y": {0: "batch"}})
            out["legacy"] = (paths["legacy"], "")
        except Exception as e:
            out["legacy"] = e
        finally:
            signal.alarm(0)
    dyn = [e for e in exporters if e != "legacy"]
    if dyn:
        def program(dynamic):
            shapes = ({0: torch.export.Dim("batch", min=1, max=1024)},) if dynamic else None
            return torch.onnx.export(net, (x,), dynamo=True, optimize=False, opset_version=OPSET,
                                     input_names=[in_name], output_names=["y"], dynamic_shapes=shapes, verbose=False)
        note = ""
        try:
            alarm(180)
            try:
                with quiet():
                    prog = program(True)
            except Exception as e:
                first = hs.first_line(str(e))
                with quiet():
                    prog = program(False)
                note = f"static batch (the dynamic one failed: {type(e).__name__}: {first[:120]})"
            if "dynamo_raw" in dyn:
                prog.save(paths["dynamo_raw"])
                out["dynamo_raw"] = (paths["dynamo_raw"], note)
            if "dynamo" in dyn:
                try:
                    with quiet():
                        prog.optimize()
                    prog.save(paths["dynamo"])
                    out["dynamo"] = (paths["dynamo"], note)
                except Exception as e:
                    out["dynamo"] = e
        except Exception as e:
            for d in dyn:
                out.setdefault(d, e)
        finally:
            signal.alarm(0)
    for e, r in list(out.items()):
        if not isinstance(r, tuple):
            continue
        try:
            onnx.checker.check_model(onnx.load(r[0]))
        except Exception as ex:
            out[e] = RuntimeError(f"onnx.checker: {hs.first_line(str(ex))}")
            continue
        try:
            # onnx shape inference is wrong on some pools (ceil_mode, docs/differential.md): a
            # disagreement is a note, and mpc still gets the model
            onnx.checker.check_model(onnx.load(r[0]), full_check=True)
        except Exception as ex:
            out[e] = (r[0], "; ".join(x for x in (r[1], f"onnx full check: {hs.first_line(str(ex))[:160]}") if x))
    return out


def expected_for(model, named, grads, buffers, tol):
    """Maps each float initializer of the export to the parameter it holds: by name, else the only
    parameter equal to it (reshaped: a GroupNorm scale written [C, 1, 1]) or transposed (a Linear
    weight the legacy exporter stores as its transpose). Returns ({key: gradient in the
    initializer's layout, and tol.INIT where it is judged at a wider tolerance}, {buffer key:
    torch's value after the step}, parameters with no initializer)."""
    exp, buf, found = {}, {}, set()
    tols = {}
    for init in model.graph.initializer:
        a = numpy_helper.to_array(init)
        if a.dtype.kind != "f" or a.size == 0:
            continue
        name = init.name
        if name in named and named[name].shape == a.shape and np.array_equal(named[name], a):
            exp[f"grad.{name}"] = grads[name]
            found.add(name)
            if name in tol:
                tols[f"tol.{name}"] = np.array(tol[name])
            continue
        if name in buffers and buffers[name].shape == a.shape:
            buf[f"buffer.{name}"] = buffers[name]
            continue
        hits = []
        for p, w in named.items():
            if w.size == a.size and np.array_equal(w.reshape(a.shape), a):
                hits.append((f"grad.{name}", p, grads[p].reshape(a.shape)))
            elif w.ndim == 2 and w.T.shape == a.shape and np.array_equal(w.T, a):
                hits.append((f"gradT.{name}", p, grads[p].T))
        if len(hits) == 1:
            key, p, g = hits[0]
            exp[key] = np.ascontiguousarray(g)
            found.add(p)
            if p in tol:
                tols[f"tol.{name}"] = np.array(tol[p])
    exp.update(tols)
    lost = sorted(p for p, w in named.items() if p not in found and w.size)
    return ({k: v.astype(np.float32) for k, v in exp.items()}, {k: v.astype(np.float32) for k, v in buf.items()},
            lost)


def choose_lr(named, grads):
    """A learning rate making lr * gradient at least 1000 times each parameter's norm (those whose
    gradient does not vanish), so that the float32 rounding of w1 is not the error; a power of 10."""
    norm = lambda v: float(np.sqrt(np.sum(np.square(v, dtype=np.float64))))  # noqa: E731
    largest = max((norm(g) for g in grads.values()), default=0.0)
    ratio = [norm(named[p]) / norm(g) for p, g in grads.items() if norm(g) >= VANISH * largest and norm(g) > 0]
    need = 1e3 * max(ratio, default=1.0)
    return float(10.0 ** min(10, max(0, int(np.ceil(np.log10(max(need, 1e-30)))))))


# ---------------------------------------------------------------------- mpc's side
def scalar(v):
    return float(np.asarray(v).reshape(-1)[0])


def norm(v):
    return float(np.sqrt(np.sum(np.square(v.astype(np.float64)))))


def one_step(mpc, model_path, data, expected, meta, work):
    """mpc's one SGD step on `model_path` against torch's. `data`: the graph inputs and the labels
    or targets; `expected`: grad.* / gradT.* (torch's gradient in each initializer's layout),
    buffer.* (running statistics after the step) and `loss`. Returns a dict: status (match,
    mismatch, refused, crash, timeout), worst (the largest relative error), param (where), message."""
    data_path = os.path.join(work, "data.safetensors")
    out = os.path.join(work, "trained.onnx")
    if os.path.exists(out):
        os.remove(out)
    save_file({k: np.ascontiguousarray(v) for k, v in data.items()}, data_path)
    cmd = [mpc, "train", os.path.abspath(model_path), "--data", data_path, "--policy", "fp32", "--optimizer", "sgd",
           "--lr", repr(meta["lr"]), "--batch", str(meta["batch"]), "--epochs", "1", "--max-steps", "1",
           "--loss", meta["loss"], "--labels", meta["labels"], "-o", out]
    rc, err, stdout = hs.run_process(cmd, MPC_TIMEOUT)
    failed = hs.exit_result("train", rc, err, MPC_TIMEOUT)
    if failed:
        res = {"status": failed.status, "message": failed.message}
        if failed.status == "crash":
            res["signature"] = failed.signature()
        elif failed.status == "refused":
            res["message"] = re.sub(r"^mpc:\s*", "", failed.message).replace(os.path.abspath(model_path), "MODEL")
        return res
    notes = [line.strip() for line in err.splitlines() if line.strip()]
    m = re.search(r"loss (\S+), skipped (\d+)", stdout)
    if not m:
        return {"status": "crash", "message": f"no loss line in mpc's output: {stdout[-300:]!r}",
                "signature": "no loss line"}
    loss, skipped = float(m.group(1).rstrip(",")), int(m.group(2))
    try:
        trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    except Exception as e:
        return {"status": "crash", "message": f"unreadable trained model: {e}", "signature": "unreadable trained model"}
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(model_path).graph.initializer}
    res = {"status": "match", "loss": loss, "notes": notes[:5]}
    problems = []
    want_loss = scalar(expected["loss"])
    # mpc prints the loss with 4 decimals
    if skipped or not abs(loss - want_loss) <= 5.1e-5 + 1e-5 * abs(want_loss):
        problems.append((float("inf"), "loss", f"loss {loss} (skipped {skipped}) where torch has {want_loss:.6f}"))
    lr = meta["lr"]
    grads = {k.split(".", 1)[1]: v for k, v in expected.items() if k.startswith(("grad.", "gradT."))}
    largest = max((norm(lr * g.astype(np.float64)) for g in grads.values()), default=0.0)
    worst, where, share, ill = 0.0, None, 0.0, []
    for name, g in grads.items():
        want = lr * g.astype(np.float64)
        if name not in trained or name not in before:
            problems.append((float("inf"), name, f"no initializer `{name}` in the trained model"))
            continue
        got = before[name].astype(np.float64) - trained[name].astype(np.float64)
        if got.shape != want.shape:
            problems.append((float("inf"), name, f"`{name}`: shape {list(got.shape)} != {list(want.shape)}"))
            continue
        if norm(want) < VANISH * largest:
            rel = norm(got) / largest if largest else norm(got)
        else:
            rel = norm(got - want) / norm(want)
        if not np.isfinite(rel):
            rel = float("inf")
        bound = scalar(expected.get(f"tol.{name}", REL_L2))
        if bound > REL_L2 and rel > REL_L2:
            ill.append(name)
        if where is None or rel / bound > share:
            worst, where, share = rel, name, rel / bound
        if rel > bound:
            problems.append((rel / bound, name, f"d loss / d `{name}`: relative error {rel:.2e}" +
                             (f" (ill-conditioned: judged at {bound:.1e})" if bound > REL_L2 else "")))
    for key, v in expected.items():
        if not key.startswith("buffer."):
            continue
        name = key[len("buffer."):]
        if name not in trained:
            continue  # mpc need not write running statistics it does not keep
        step_torch = v.astype(np.float64) - before[name].astype(np.float64)
        step_mpc = trained[name].astype(np.float64) - before[name].astype(np.float64)
        rel = norm(step_mpc - step_torch) / max(norm(step_torch), 1e-30)
        if rel > REL_L2:
            problems.append((rel / REL_L2, name, f"running statistic `{name}`: relative error {rel:.2e} of its update"))
    known = set(grads) | {k[len("buffer."):] for k in expected if k.startswith("buffer.")}
    extra = [n for n, w in before.items() if n not in known and n in trained and w.dtype.kind == "f"
             and w.shape == trained[n].shape and not np.array_equal(w, trained[n])]
    if extra and not meta.get("lost"):
        problems.append((float("inf"), extra[0], f"trains initializers torch does not: {extra}"))
    res["worst"], res["param"] = worst, where
    if ill:
        res["ill_conditioned"] = ill
    if problems:
        problems.sort(key=lambda p: -p[0])
        res.update(status="mismatch", message=problems[0][2], param=problems[0][1],
                   problems=[p[2] for p in problems[:6]])
    return res


# ---------------------------------------------------------------------- one module
def meta_of(desc, lr, labels_name):
    return {"lr": lr, "batch": desc["batch"], "loss": desc["loss"], "labels": labels_name}


def check_module(desc, mpc, work, exporters=EXPORTERS, keep=None):
    """Builds, exports and checks one module; a dict of what happened, by exporter. `keep`: a
    folder where the exports, data and expected gradients are written (files for each exporter)."""
    res = {"index": desc.get("index"), "desc": desc, "tags": module_tags(desc), "exporters": {}}
    net = build(desc)
    x, y, loss, grads, buffers, tol = reference(desc, net)
    named = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
    in_name = "ids" if desc["input"]["kind"] == "ids" else "x"
    labels_name = "targets" if desc["loss"] == "mse" else "labels"
    lr = choose_lr(named, grads)
    res.update(lr=lr, torch_loss=loss, input=in_name, labels=labels_name, params=len(named))
    data = {in_name: x, labels_name: y}
    res["files"] = {}
    t0 = time.time()
    exports = export_all(net, torch.from_numpy(x), work, in_name, exporters)
    res["export_s"] = round(time.time() - t0, 2)
    for exporter in exporters:
        r = res["exporters"][exporter] = {}
        got = exports[exporter]
        if isinstance(got, Exception):
            r.update(status="export_failed", message=f"{type(got).__name__}: {hs.first_line(str(got))}")
            continue
        path, r["note"] = got
        d = os.path.dirname(path)
        model = onnx.load(path)
        exp, buf, lost = expected_for(model, named, grads, buffers, tol)
        tensors = {f"input.{k}": v for k, v in data.items()}
        tensors.update(exp)
        tensors.update(buf)
        tensors["loss"] = np.array(loss, dtype=np.float32)
        meta = dict(meta_of(desc, lr, labels_name), lost=lost)
        r.update(one_step(mpc, path, data, tensors, meta, d))
        if lost:
            r["lost"] = lost
            if r["status"] in ("match", "mismatch"):
                r["mpc"] = {"status": r["status"], "message": r.get("message", "")}
                r["status"], r["message"] = "export_lost", f"export lost parameter(s) {lost}"
        res["files"][exporter] = (model, tensors)
        if keep and r["status"] not in ("match",):
            save_case(keep, desc, exporter, path, tensors, res, r)
    return res


def save_case(folder, desc, exporter, path, tensors, res, r):
    d = os.path.join(folder, "cases", f"{desc.get('index', 'module')}.{exporter}")
    os.makedirs(d, exist_ok=True)
    shutil.copy(path, os.path.join(d, "model.onnx"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items() if k.startswith("input.")},
              os.path.join(d, "data.safetensors"))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(d, "expected.safetensors"))
    info = {"exporter": exporter, "result": {k: v for k, v in r.items()}, "lr": res["lr"], "batch": desc["batch"],
            "loss": desc["loss"], "labels": res["labels"], "torch_loss": res["torch_loss"], "module": desc,
            "command": f"mpc train model.onnx --data data.safetensors --policy fp32 --optimizer sgd --lr {res['lr']!r} "
                       f"--batch {desc['batch']} --epochs 1 --max-steps 1 --loss {desc['loss']} "
                       f"--labels {res['labels']} -o trained.onnx",
            "rerun": "python3 fuzz/differential/torch_modules.py --module info.json --out DIR"}
    with open(os.path.join(d, "info.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)


# ---------------------------------------------------------------------- the report
def summarise(results, generated, gave_up, wall, errors=0):
    """The counts and failure groups of a run, as a dict (report.json) and text."""
    c = {"generated": generated, "generator gave up": gave_up, "harness errors": errors,
         "modules checked": len(results)}
    exported = {e: 0 for e in EXPORTERS}
    static = {e: 0 for e in EXPORTERS}
    status = {}
    groups = {}  # (kind, key) -> {"count", "exporters", "modules", "common", "examples"}
    tag_runs, tag_bad = {}, {}
    for res in results:
        for e, r in res["exporters"].items():
            st = r["status"]
            status.setdefault(st, {e2: 0 for e2 in EXPORTERS})[e] += 1
            if st != "export_failed":
                exported[e] += 1
                static[e] += "static batch" in (r.get("note") or "")
                for tg in res["tags"]:
                    tag_runs[tg] = tag_runs.get(tg, 0) + 1
            if st == "match":
                continue
            if st == "export_failed":
                key = r["message"][:110]
            elif st == "refused":
                key = hs.refusal_reason(re.sub(r"^MODEL:\s*", "", r["message"]), 10)
            elif st == "crash":
                key = r.get("signature", "")
            elif st == "mismatch":
                key = re.sub(r"`[^`]*`", "`…`", r["message"].split(":")[0])
                for tg in res["tags"]:
                    tag_bad[tg] = tag_bad.get(tg, 0) + 1
            elif st == "export_lost":
                key = "export lost parameter"
            else:
                key = st
            g = groups.setdefault((st, key), {"count": 0, "exporters": {}, "modules": [], "common": None,
                                              "examples": []})
            g["count"] += 1
            g["exporters"][e] = g["exporters"].get(e, 0) + 1
            if res["index"] not in g["modules"]:
                g["modules"].append(res["index"])
            g["common"] = set(res["tags"]) if g["common"] is None else g["common"] & set(res["tags"])
            if len(g["examples"]) < 3:
                g["examples"].append({"index": res["index"], "exporter": e, "message": r.get("message", "")[:400],
                                      "worst": r.get("worst"), "param": r.get("param"), "tags": res["tags"]})
    c["exported"] = exported
    c["exported with a static batch (dynamic failed)"] = static
    c["by status"] = status
    lines = [f"generated                {generated} modules ({gave_up} given up by the generator, {errors} harness "
             f"errors), {wall:.0f} s"]
    lines.append("exported                 " + ", ".join(f"{e} {exported[e]}" for e in EXPORTERS) +
                 "  (static batch: " + ", ".join(f"{e} {static[e]}" for e in EXPORTERS) + ")")
    names = [("match", "matched"), ("mismatch", "mismatched"), ("refused", "mpc refused"), ("crash", "crashed"),
             ("timeout", "timeouts"), ("export_failed", "export failed"), ("export_lost", "export lost parameter")]
    ill = {e: sum(1 for res in results if res["exporters"].get(e, {}).get("status") == "match"
                  and res["exporters"][e].get("ill_conditioned")) for e in EXPORTERS}
    c["matched, ill-conditioned"] = ill
    every = sum(1 for res in results if all(r["status"] == "match" for r in res["exporters"].values()))
    lines.append(f"modules matching on every exporter: {every} of {len(results)}")
    for st, label in names:
        n = status.get(st, {})
        lines.append(f"{label:24s} " + ", ".join(f"{e} {n.get(e, 0)}" for e in EXPORTERS))
        if st == "match":
            lines.append("  ill-conditioned        " + ", ".join(f"{e} {ill[e]}" for e in EXPORTERS) +
                         "  (matched within 10x torch's own float32 error, above 1e-4)")
        for (kind, key), g in sorted(groups.items(), key=lambda kv: -kv[1]["count"]):
            if kind != st:
                continue
            ex = ", ".join(f"{k} {v}" for k, v in g["exporters"].items())
            lines.append(f"    {g['count']:3d}  {key[:100]}  [{ex}] modules {g['modules'][:8]}")
            lines.append(f"         common blocks: {', '.join(sorted(g['common'] or [])) or '-'}")
            if kind == "mismatch":
                for x in g["examples"]:
                    lines.append(f"         module {x['index']} {x['exporter']}: worst `{x['param']}` "
                                 f"{x['message'][:120]}")
    if tag_bad:
        lines.append("mismatches by block (exports holding the block that mismatched / that mpc was given)")
        for tg, n in sorted(tag_bad.items(), key=lambda kv: -kv[1] / tag_runs[kv[0]]):
            lines.append(f"    {tg:28s} {n}/{tag_runs[tg]}")
    lines.append("blocks in exported modules: " + ", ".join(f"{tg} {n}" for tg, n in sorted(tag_runs.items())))
    out = {"counts": c, "groups": [{"kind": k, "key": key, **{kk: (sorted(vv) if kk == "common" else vv)
                                                             for kk, vv in g.items()}}
                                   for (k, key), g in groups.items()]}
    return out, "\n".join(lines)


def module_line(res):
    parts = []
    for e, r in res["exporters"].items():
        st = r["status"]
        if st == "match":
            parts.append(f"{e} match {r['worst']:.1e}")
        elif st == "mismatch":
            parts.append(f"{e} MISMATCH {r['message'][:90]}")
        else:
            parts.append(f"{e} {st.upper()} {r.get('message', '')[:90]}")
    return f"{res['index']:5}  {' '.join(b['type'] for b in res['desc']['blocks'] + res['desc']['head'])[:70]}\n" \
           f"       " + "\n       ".join(parts)


def strip_result(res):
    out = {k: v for k, v in res.items() if k != "files"}
    out["exporters"] = {e: {k: v for k, v in r.items()} for e, r in res["exporters"].items()}
    return out


def run_campaign(args, mpc, indices):
    outdir = os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="mpc-torch-modules-")
    results, gave_up, errors, start = [], 0, 0, time.time()
    try:
        for i in indices:
            try:
                if args.module:
                    desc = load_module(args.module)
                elif args.singles:
                    desc = generate(args.seed, i, dict(singles(args.singles))[i])
                else:
                    desc = generate(args.seed, i)
            except Reject:
                gave_up += 1
                continue
            shutil.rmtree(os.path.join(work, "m"), ignore_errors=True)
            try:
                res = check_module(desc, mpc, os.path.join(work, "m"), args.exporters, keep=outdir)
            except Reject:
                gave_up += 1
                continue
            except Exception as e:  # a bug of this script: counted apart
                import traceback
                print(f"{i}: harness error {type(e).__name__}: {e}\n{traceback.format_exc()[-800:]}", flush=True)
                errors += 1
                continue
            results.append(res)
            print(module_line(res), flush=True)
            if args.write_cases:
                keep_files(res)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    generated = len(results) + gave_up + errors
    report, text = summarise(results, generated, gave_up, time.time() - start, errors)
    report["failing modules"] = [strip_result(r) for r in results
                                 if any(x["status"] != "match" for x in r["exporters"].values())]
    report["matched modules"] = [{"index": r["index"], "tags": r["tags"]} for r in results
                                 if all(x["status"] == "match" for x in r["exporters"].values())]
    print(text)
    with open(os.path.join(outdir, "report.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(outdir, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return results


def load_module(spec):
    """A module description from a JSON file or string (as report.json and cases.json hold it)."""
    text = open(spec).read() if os.path.exists(spec) else spec
    desc = json.loads(text)
    if "module" in desc and "blocks" not in desc["module"]:  # a case of cases.json
        n = desc["module"]["head_blocks"]
        k = len(desc["blocks"]) - n
        desc = dict(desc["module"], blocks=desc["blocks"][:k], head=desc["blocks"][k:])
    desc = desc.get("module", desc)
    for k, v in (("index", 0), ("seed", None), ("batch", 3), ("loss", "cross-entropy"), ("head", []),
                 ("torch_seed", 0), ("data_seed", 0)):
        desc.setdefault(k, v)
    return desc


# ---------------------------------------------------------------------- committed cases
def strip_metadata(model):
    """The model without the exporters' per-node metadata and doc strings (the dynamo exporter's
    stack traces): the same graph in a fraction of the bytes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    for vi in list(m.graph.value_info):
        del vi.metadata_props[:]
    return m


def keep_files(res):
    """Keeps the stripped exports and expected tensors of a module in memory (as bytes) for
    --write-cases to choose from."""
    res["blobs"] = {}
    for e, (model, tensors) in res.get("files", {}).items():
        res["blobs"][e] = (strip_metadata(model).SerializeToString(), tensors)
    res.pop("files", None)


def merge_tensors(blobs):
    """One grads file for both exports: tensors of equal keys must agree, or None."""
    out = {}
    for _, tensors in blobs.values():
        for k, v in tensors.items():
            if k in out and (out[k].shape != v.shape or not np.array_equal(out[k], v)):
                return None
            out[k] = v
    return out


def write_cases(args, mpc, results):
    """Chooses about 36 matching modules covering the block vocabulary (smallest first) and one or
    two of each failure class, and writes them with cases.json."""
    folder = args.write_cases
    os.makedirs(folder, exist_ok=True)
    cands, known = [], {}
    for r in results:
        blobs = r.get("blobs", {})
        ok = [e for e, x in r["exporters"].items() if x["status"] == "match" and e in blobs]
        bad = [e for e, x in r["exporters"].items() if x["status"] in ("mismatch", "refused", "crash", "timeout")
               and e in blobs]
        tensors = merge_tensors({e: blobs[e] for e in ok + bad})
        if tensors is None:
            continue
        size = sum(len(blobs[e][0]) for e in ok + bad) + sum(v.nbytes for v in tensors.values())
        if ok:
            cands.append((size, r, ok, bad, tensors))
        for e in bad:
            x = r["exporters"][e]
            key = (x["status"], hs.refusal_reason(re.sub(r"^MODEL:\s*", "", x.get("message", "")), 8)
                   if x["status"] == "refused"
                   else re.sub(r"`[^`]*`", "", x.get("message", "").split(":")[0]))
            known.setdefault(key, []).append((size, r, e, tensors))
    chosen, taken, covered, total = [], set(), set(), 0
    budget = args.cases_bytes
    cands.sort(key=lambda c: c[0])
    while len(chosen) < args.cases:
        best = None
        for c in cands:
            if c[1]["index"] in taken or total + c[0] > budget * 0.8:
                continue
            gain = len(set(c[1]["tags"]) - covered)
            score = (gain > 0, gain / c[0])
            if best is None or score > best[0]:
                best = (score, c)
        if best is None:
            break
        chosen.append(best[1])
        taken.add(best[1][1]["index"])
        covered |= set(best[1][1]["tags"])
        total += best[1][0]
    known_chosen = []
    for key, items in sorted(known.items()):
        for size, r, e, tensors in sorted(items, key=lambda t: t[0])[:2]:
            if total + size <= budget:
                known_chosen.append((size, r, e, tensors))
                total += size
    meta = {"written_by": "fuzz/differential/torch_modules.py --write-cases", "seed": args.seed,
            "graphs": args.graphs, "torch": torch.__version__, "onnx": onnx.__version__,
            "tolerance": {"relative_l2": REL_L2, "vanishing": VANISH}, "cases": {}, "known": {}}
    for f in os.listdir(folder):
        if f.endswith((".onnx", ".safetensors")):
            os.remove(os.path.join(folder, f))
    def write(r, exporters, tensors):
        name = f"m{args.seed}_{r['index']:04d}"
        for e in exporters:
            with open(os.path.join(folder, f"{name}.{e}.onnx"), "wb") as f:
                f.write(r["blobs"][e][0])
        grads = os.path.join(folder, f"{name}.grads.safetensors")
        old = load_file(grads) if os.path.exists(grads) else {}
        old.update(tensors)
        save_file({k: np.ascontiguousarray(v) for k, v in old.items()}, grads)
        return name

    def entry(r):
        module = {k: v for k, v in r["desc"].items() if k not in ("blocks", "head")}
        module["head_blocks"] = len(r["desc"]["head"])
        return {"blocks": r["desc"]["blocks"] + r["desc"]["head"], "module": module, "tags": r["tags"],
                "loss": r["desc"]["loss"], "labels": r["labels"], "input": r["input"], "lr": r["lr"],
                "batch": r["desc"]["batch"], "torch_loss": r["torch_loss"]}

    for size, r, ok, bad, tensors in chosen:
        name = write(r, ok, tensors)
        meta["cases"][name] = dict(entry(r), exporters=ok,
                                   worst={e: r["exporters"][e]["worst"] for e in ok})
    for size, r, e, tensors in known_chosen:
        name = write(r, [e], tensors)
        x = r["exporters"][e]
        k = meta["known"].setdefault(name, dict(entry(r), exporters={}))
        k["exporters"][e] = {"status": x["status"], "message": x.get("message", ""), "worst": x.get("worst")}
    meta["cases"] = dict(sorted(meta["cases"].items()))
    meta["known"] = dict(sorted(meta["known"].items()))
    with open(os.path.join(folder, "cases.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    print(f"wrote {len(meta['cases'])} matching modules and {len(meta['known'])} known failures to {folder} "
          f"({size / 1024:.0f} KB); block tags covered: {len(covered)} of "
          f"{len({t for r in results for t in r['tags']})}")


def replay(args, mpc):
    """Reruns the committed cases: one line each; 1 when a case that matched no longer matches or a
    known failure now crashes."""
    folder = args.replay
    with open(os.path.join(folder, "cases.json")) as f:
        meta = json.load(f)
    work = tempfile.mkdtemp(prefix="mpc-torch-modules-")
    bad, start, promoted = 0, time.time(), []
    try:
        for section in ("cases", "known"):
            for name, case in meta[section].items():
                tensors = load_file(os.path.join(folder, f"{name}.grads.safetensors"))
                data = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
                m = meta_of(case["module"], case["lr"], case["labels"])
                exporters = case["exporters"]
                for e in exporters:
                    path = os.path.join(folder, f"{name}.{e}.onnx")
                    inits = {t.name for t in onnx.load(path).graph.initializer}
                    own = {k: v for k, v in tensors.items() if not k.startswith(("grad.", "gradT.", "buffer.", "tol."))
                           or k.split(".", 1)[1] in inits}
                    r = one_step(mpc, path, data, own, m, work)
                    line, fail = replay_line(section, case, e, r)
                    bad += fail
                    print(f"{name}.{e:7s} {line}", flush=True)
                    if section == "known" and r["status"] == "match":
                        promoted.append((name, e, r.get("worst", 0.0)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = sum(len(c["exporters"]) for s in ("cases", "known") for c in meta[s].values())
    print(f"{n} exports replayed in {time.time() - start:.0f} s; {bad} failing")
    if args.promote and promoted:
        promote(meta, promoted)
        with open(os.path.join(folder, "cases.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(f"promoted {len(promoted)} known failures that now match to cases: "
              + ", ".join(f"{m}.{e}" for m, e, _ in promoted))
    return bad


def promote(meta, promoted):
    """Moves each (module, exporter) of `promoted` from `known` to `cases`, where a regression of
    it fails the replay; a module none of whose exporters is left known leaves `known`."""
    for name, e, worst in promoted:
        known = meta["known"][name]
        case = meta["cases"].get(name)
        if case is None:
            case = {k: v for k, v in known.items() if k != "exporters"}
            case["exporters"], case["worst"] = [], {}
            meta["cases"][name] = case
        case["exporters"].append(e)
        case["worst"] = dict(case.get("worst") or {}, **{e: worst})
        del known["exporters"][e]
        if not known["exporters"]:
            del meta["known"][name]
    meta["cases"] = dict(sorted(meta["cases"].items()))


def replay_line(section, case, e, r):
    st = r["status"]
    what = {"match": f"match (worst {r.get('worst', 0):.1e})", "mismatch": f"MISMATCH {r.get('message', '')}",
            "refused": f"REFUSED {r.get('message', '')}", "crash": f"CRASH {r.get('signature', '')}",
            "timeout": "TIMEOUT"}[st]
    if section == "cases":
        return what, st != "match"
    was = case["exporters"][e]
    if st == "match":
        return f"now matches (was {was['status']}: {was['message'][:80]})", False
    if st == was["status"]:
        return f"still {'refused' if st == 'refused' else st + 'es' if st == 'mismatch' else st}: " \
               f"{what.split(' ', 1)[-1][:140]}", st in ("crash", "timeout")
    return f"{what} (was {was['status']}: {was['message'][:80]})", st in ("crash", "timeout")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    ap.add_argument("--graphs", type=int, default=100, help="modules to generate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=int, help="check only module number I of the seed")
    ap.add_argument("--module", metavar="JSON", help="check a module description (a file or a JSON string, as "
                                                     "report.json and cases.json hold them)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "mpc-torch-modules"),
                    help="report.txt, report.json, and cases/INDEX.EXPORTER/ for each failure")
    ap.add_argument("--write-cases", metavar="DIR",
                    help="write matching modules (and known failures) as committed cases")
    ap.add_argument("--cases", type=int, default=36, help="matching modules --write-cases keeps")
    ap.add_argument("--cases-bytes", type=int, default=1_400_000, help="the most bytes --write-cases writes")
    ap.add_argument("--replay", metavar="DIR", help="rerun committed cases (needs no torch)")
    ap.add_argument("--promote", action="store_true",
                    help="with --replay: move the known failures that now match to the matching cases")
    ap.add_argument("--singles", type=int, metavar="N", default=0,
                    help="instead of random compositions: each block type alone (with a head) on each input "
                         "kind, N draws each")
    ap.add_argument("--exporters", default=",".join(EXPORTERS),
                    help="a comma-separated subset of " + ", ".join(EXPORTERS))
    args = ap.parse_args()
    args.exporters = [e for e in EXPORTERS if e in args.exporters.split(",")]
    if not os.path.exists(args.mpc):
        ap.error(f"no mpc binary at {args.mpc}")
    mpc = os.path.abspath(args.mpc)
    if args.replay:
        sys.exit(1 if replay(args, mpc) else 0)
    if torch is None:
        ap.error("generating modules needs torch (only --replay does not)")
    if args.only is not None:
        indices = [args.only]
    elif args.module:
        indices = [0]
    elif args.singles:
        indices = [i for i, _ in singles(args.singles)]
    else:
        indices = range(args.graphs)
    results = run_campaign(args, mpc, indices)
    if args.write_cases:
        write_cases(args, mpc, results)


if __name__ == "__main__":
    main()
