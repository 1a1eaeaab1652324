#!/usr/bin/env python3
"""Expected whole-model FP32 gradients from PyTorch autograd, for tests/train_grads.rs.

    python3 tests/models/make_grads.py      # needs numpy, onnx, torch, safetensors

For the MLP, CNN and transformer fixtures: reads the ONNX weights, rebuilds the same computation
with torch ops (node for node), draws fixed inputs, computes the loss mpc adds (cross-entropy on the
logits; for the transformer, whose output is not logits, the mean squared error against targets)
and writes the inputs, the loss and every parameter's gradient to grads/NAME.safetensors (for the
CNN also the batch-norm running statistics after the step, `state.NAME`). The Rust tests read only
those files.
"""

import os

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
torch.use_deterministic_algorithms(True)


def weights(name):
    m = onnx.load(os.path.join(HERE, name + ".onnx"))
    return {i.name: torch.tensor(numpy_helper.to_array(i).copy())
            for i in m.graph.initializer}


def params(w, names):
    for n in names:
        w[n].requires_grad_(True)
    return [w[n] for n in names]


def save(name, inputs, loss, w, names, state=None):
    loss.backward()
    out = {f"input.{k}": v.detach().numpy() for k, v in inputs.items()}
    for k, v in (state or {}).items():
        out[f"state.{k}"] = v.detach().numpy().astype(np.float32)
    out["loss"] = np.array(loss.item(), dtype=np.float32)
    for n in names:
        out[f"grad.{n}"] = w[n].grad.detach().numpy().astype(np.float32)
    save_file(out, os.path.join(HERE, "grads", name + ".safetensors"))
    print(name, "loss", loss.item(), "params", len(names))


def mlp(rng):
    w = weights("mlp")
    names = [f"fc{i}.{k}" for i in (1, 2, 3) for k in ("weight", "bias")]
    params(w, names)
    x = torch.tensor(rng.standard_normal((8, 64)).astype(np.float32))
    labels = torch.tensor(rng.integers(0, 10, 8), dtype=torch.int64)
    h = x
    for i in (1, 2, 3):
        h = F.linear(h, w[f"fc{i}.weight"], w[f"fc{i}.bias"])
        if i < 3:
            h = F.relu(h)
    save("mlp", {"x": x, "labels": labels}, F.cross_entropy(h, labels), w, names)


def cnn_bn(rng):
    w = weights("cnn_bn")
    names = [n for n in w if not n.endswith(("running_mean", "running_var"))]
    params(w, names)
    x = torch.tensor(rng.standard_normal((8, 1, 8, 8)).astype(np.float32))
    labels = torch.tensor(rng.integers(0, 10, 8), dtype=torch.int64)
    h = x
    state = {}
    for i in (1, 2):
        h = F.conv2d(h, w[f"conv{i}.weight"], w[f"conv{i}.bias"], padding=1)
        rm, rv = w[f"bn{i}.running_mean"].clone(), w[f"bn{i}.running_var"].clone()
        h = F.batch_norm(h, rm, rv, w[f"bn{i}.weight"], w[f"bn{i}.bias"], training=True, momentum=0.1, eps=1e-5)
        # The running statistics after the step (the variance updated with the unbiased one).
        state[f"bn{i}.running_mean"], state[f"bn{i}.running_var"] = rm, rv
        h = F.relu(h)
        if i == 1:
            h = F.max_pool2d(h, 2, 2)
    h = F.adaptive_avg_pool2d(h, 1).flatten(1)
    h = F.linear(h, w["fc.weight"], w["fc.bias"])
    save("cnn_bn", {"x": x, "labels": labels}, F.cross_entropy(h, labels), w, names, state)


def transformer(rng):
    w = weights("transformer")
    consts = {"attn.scale", "attn.causal_mask", "gelu.sqrt2", "gelu.one", "gelu.half", "heads_shape", "merge_shape"}
    names = [n for n in w if n not in consts]
    params(w, names)
    tokens = torch.tensor(rng.integers(0, 50, (4, 8)), dtype=torch.int64)
    targets = torch.tensor(rng.standard_normal((4, 8, 32)).astype(np.float32))
    b, s, d, heads = 4, 8, 32, 4
    h0 = w["embed.weight"][tokens] + w["pos.weight"]

    def lin(x, p):
        return x @ w[f"attn.{p}.weight"] + w[f"attn.{p}.bias"]

    q = lin(h0, "q").reshape(b, s, heads, d // heads).permute(0, 2, 1, 3)
    k = lin(h0, "k").reshape(b, s, heads, d // heads).permute(0, 2, 3, 1)
    v = lin(h0, "v").reshape(b, s, heads, d // heads).permute(0, 2, 1, 3)
    scores = (q @ k) * w["attn.scale"] + w["attn.causal_mask"]
    ctx = (torch.softmax(scores, -1) @ v).permute(0, 2, 1, 3).reshape(b, s, d)
    res1 = h0 + lin(ctx, "o")
    ln1 = F.layer_norm(res1, (d,), w["ln1.weight"], w["ln1.bias"], 1e-5)
    ff1 = ln1 @ w["ff1.weight"] + w["ff1.bias"]
    gelu = ff1 * (torch.erf(ff1 / w["gelu.sqrt2"]) + w["gelu.one"]) * w["gelu.half"]
    res2 = ln1 + (gelu @ w["ff2.weight"] + w["ff2.bias"])
    y = F.layer_norm(res2, (d,), w["ln2.weight"], w["ln2.bias"], 1e-5)
    save("transformer", {"tokens": tokens, "targets": targets}, F.mse_loss(y, targets), w, names)


if __name__ == "__main__":
    rng = np.random.default_rng(20261121)
    mlp(rng)
    cnn_bn(rng)
    transformer(rng)
