#!/usr/bin/env python3
"""Exports the architecture zoo: tiny models people train, written by both torch exporters.

    python3 tests/models/zoo/make_zoo.py [NAME ...]   # needs torch, torchvision, transformers,
                                                     # onnx, onnxscript, numpy, safetensors

Each family (BERT, DistilBERT, GPT-2, Llama, ViT, a MobileNetV3, a UNet, a GroupNorm CNN, an LSTM
classifier, a bidirectional GRU classifier, a classifier on torch's nn.TransformerEncoder batch
first and not, torchvision's VisionTransformer) is built with random weights from a tiny config
(GPT-2, BERT, Llama and ViT also as initialised, `*_fresh`: equal norm scales, zero biases;
GPT-NeoX and Gemma only so, exported as for training: no constant folding, no optimizer), then
exported twice: `NAME.legacy.onnx` (`torch.onnx.export(..., dynamo=False)`, the batch a dynamic
axis) and `NAME.dynamo.onnx` (`dynamo=True`, the batch a dynamic dim). BERT, DistilBERT, GPT-2,
Llama, the LSTM, the GRU (`*_seq`) and the TransformerEncoders are exported with a dynamic sequence
too (`dynamic_axes={NAME: {0: "batch", 1: "seq"}}`, or a `seq` Dim), as their documentation shows. Dropout probabilities are 0 so that
a training step is deterministic; models are exported in eval mode, as users export them.

For each family `NAME.grads.safetensors` holds fixed inputs (`input.*`), the loss mpc adds to the
model's first output (cross-entropy, over the last axis for the language models; mean squared
error against `input.targets` for the UNet) and PyTorch autograd's gradient of every parameter in
training mode, keyed by the name of the ONNX initializer that holds it (`grad.NAME`; an exporter
that stores a weight transposed, as the legacy one does for a Linear without bias, gets the
transposed gradient under that initializer's name, `gradT.NAME`); a fresh family's gradients are
also keyed by the module's parameter names. `zoo.json` records the loss, the valid range of each
integer input and, for a fresh family, how many parameters torch trains. The Rust tests read only the written files.
"""

import json
import os
import sys
import warnings

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OPSET = 18
B, T = 2, 8
warnings.filterwarnings("ignore")


def tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, num_labels=3,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(cfg)


def tiny_distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=16, num_labels=3, dropout=0.0,
                           attention_dropout=0.0, seq_classif_dropout=0.0)
    return DistilBertForSequenceClassification(cfg)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return GPT2LMHeadModel(cfg)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                      use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def tiny_gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, use_cache=False,
                        hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForCausalLM(cfg)


def tiny_gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    cfg = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=16, use_cache=False)
    return GemmaForCausalLM(cfg)


def tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=64, num_labels=3,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(cfg)


def tiny_mobilenet():
    from functools import partial
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3
    c = partial(InvertedResidualConfig, width_mult=1.0)
    setting = [c(8, 3, 8, 8, True, "RE", 2, 1), c(8, 3, 24, 12, False, "RE", 2, 1),
               c(12, 5, 32, 16, True, "HS", 2, 1)]
    return MobileNetV3(setting, last_channel=32, num_classes=3, dropout=0.0)


class TinyUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down1 = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.fuse = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU())
        self.side = nn.Conv2d(16, 8, 1)
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        u = self.up(b) + F.interpolate(self.side(b), scale_factor=2.0, mode="nearest")
        return self.head(self.fuse(torch.cat([a, u], dim=1)))


class GroupNormCnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8)
        self.c2, self.n2 = nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16)
        self.fc = nn.Linear(16, 3)

    def forward(self, x):
        h = F.silu(self.n1(self.c1(x)))
        h = F.silu(self.n2(self.c2(h)))
        return self.fc(h.mean(dim=(2, 3)))


class LstmClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.fc = nn.Linear(24, 3)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.fc(h[:, -1])


class GruClassifier(nn.Module):
    """A bidirectional, batch-first GRU: both directions, and torch's linear_before_reset."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.gru = nn.GRU(16, 12, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(24, 3)

    def forward(self, tokens):
        h, _ = self.gru(self.emb(tokens))
        return self.fc(h.mean(dim=1))


class EncoderClassifier(nn.Module):
    """torch's nn.TransformerEncoder (nn.MultiheadAttention inside), batch-first or not."""

    def __init__(self, batch_first=True, padded=False):
        super().__init__()
        self.batch_first, self.padded = batch_first, padded
        self.emb = nn.Embedding(64, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.fc = nn.Linear(32, 3)

    def forward(self, tokens):
        x = self.emb(tokens)
        if not self.batch_first:
            x = x.transpose(0, 1)
        # Token 0 is padding: attention skips it (nn.MultiheadAttention's key padding mask).
        h = self.enc(x, src_key_padding_mask=tokens == 0) if self.padded else self.enc(x)
        if not self.batch_first:
            h = h.transpose(0, 1)
        return self.fc(h.mean(dim=1))


def tiny_torchvision_vit():
    from torchvision.models.vision_transformer import VisionTransformer
    return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32,
                             mlp_dim=64, num_classes=3)


class BiLstmTagger(nn.Module):
    """Two stacked bidirectional LSTM layers tagging every token (5 tags)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.lstm = nn.LSTM(16, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(24, 5)

    def forward(self, tokens):
        h, _ = self.lstm(self.emb(tokens))
        return self.fc(h)


def tokens(rng, vocab=64):
    return torch.tensor(rng.integers(0, vocab, (B, T)), dtype=torch.int64)


def image(rng, c, hw):
    return torch.tensor(rng.standard_normal((B, c, hw, hw)).astype(np.float32))


class Logits(nn.Module):
    """A Hugging Face model's logits as its only output."""

    def __init__(self, m, mask=False):
        super().__init__()
        self.m, self.mask = m, mask

    def forward(self, x):
        # The language models get an all-ones attention mask, as a tokenizer's batch has; without
        # one, transformers looks for packed sequences with an op the legacy exporter lacks.
        if self.mask:
            return self.m(x, attention_mask=torch.ones_like(x)).logits
        return self.m(x).logits


# name -> (builder, input name, input maker, loss, label maker)
FAMILIES = {
    "bert": (lambda: Logits(tiny_bert()), "input_ids", tokens, "ce", lambda r: r.integers(0, 3, B)),
    "distilbert": (lambda: Logits(tiny_distilbert()), "input_ids", tokens, "ce", lambda r: r.integers(0, 3, B)),
    "gpt2": (lambda: Logits(tiny_gpt2(), mask=True), "input_ids", tokens, "lm", lambda r: r.integers(0, 64, (B, T))),
    "llama": (lambda: Logits(tiny_llama(), mask=True), "input_ids", tokens, "lm", lambda r: r.integers(0, 64, (B, T))),
    "vit": (lambda: Logits(tiny_vit()), "pixel_values", lambda r: image(r, 3, 16), "ce", lambda r: r.integers(0, 3, B)),
    "mobilenet": (tiny_mobilenet, "x", lambda r: image(r, 3, 32), "ce", lambda r: r.integers(0, 3, B)),
    "unet": (TinyUNet, "x", lambda r: image(r, 1, 16), "mse", None),
    "groupnorm": (GroupNormCnn, "x", lambda r: image(r, 3, 8), "ce", lambda r: r.integers(0, 3, B)),
    "lstm": (LstmClassifier, "tokens", tokens, "ce", lambda r: r.integers(0, 3, B)),
    "gru": (GruClassifier, "tokens", tokens, "ce", lambda r: r.integers(0, 3, B)),
}
# As initialised, not perturbed: the dynamo exporter keeps one initializer for the equal norm scales
# and shifts, and drops the zero biases of the projections, which mpc must train apart and give back.
FRESH = {"gpt2_fresh", "bert_fresh", "llama_fresh", "vit_fresh", "gpt_neox_fresh", "gemma_fresh"}
for fresh in FRESH - {"gpt_neox_fresh", "gemma_fresh"}:
    FAMILIES[fresh] = FAMILIES[fresh.removesuffix("_fresh")]
FAMILIES["gpt_neox_fresh"] = (lambda: Logits(tiny_gpt_neox(), mask=True), "input_ids", tokens, "lm",
                              lambda r: r.integers(0, 64, (B, T)))
FAMILIES["gemma_fresh"] = (lambda: Logits(tiny_gemma(), mask=True), "input_ids", tokens, "lm",
                           lambda r: r.integers(0, 64, (B, T)))
FAMILIES["encoder"] = (EncoderClassifier, "tokens", tokens, "ce", lambda r: r.integers(0, 3, B))
FAMILIES["encoder_seq_first"] = (lambda: EncoderClassifier(False), "tokens", tokens, "ce",
                                 lambda r: r.integers(0, 3, B))
def padded_tokens(rng):
    t = tokens(rng)
    t[t == 0] = 1
    t[0, -3:] = 0  # the first sequence is 5 tokens long, padded to 8
    return t


FAMILIES["encoder_padded"] = (lambda: EncoderClassifier(padded=True), "tokens", padded_tokens, "ce",
                              lambda r: r.integers(0, 3, B))
FAMILIES["tv_vit"] = (tiny_torchvision_vit, "x", lambda r: image(r, 3, 16), "ce", lambda r: r.integers(0, 3, B))
# The axes each family's exports leave dynamic (the batch when not named here): the sequence too,
# as the exporters' documentation shows for text models, or none (a fixed batch).
AXES = {}
for base in ["bert", "distilbert", "gpt2", "llama", "lstm", "gru"]:
    FAMILIES[f"{base}_seq"] = FAMILIES[base]
    AXES[f"{base}_seq"] = "batch+seq"
for base in ["encoder", "encoder_seq_first", "encoder_padded"]:
    AXES[base] = "batch+seq"
# torch.export cannot export the stacked bidirectional LSTM (its dynamo export fails in torch).
FAMILIES["bilstm_tagger"] = (BiLstmTagger, "tokens", tokens, "lm", lambda r: r.integers(0, 5, (B, T)))
AXES["bilstm_tagger"] = "batch+seq"
LEGACY_ONLY = {"bilstm_tagger"}
# Exported with a fixed batch (no dynamic axes), by the legacy exporter: the batch is built into
# shape operands and constants, which training frees.
for base in ["bert", "gpt2", "vit", "lstm"]:
    FAMILIES[f"{base}_fixed"] = FAMILIES[base]
    AXES[f"{base}_fixed"] = "none"
# Exported as torch.onnx documents for training: the legacy exporter without constant folding and
# the dynamo exporter without its optimizer. Optimised, a fresh model loses parameters that no
# metadata gives back: the optimizer merges GPT-NeoX's two LayerNorms of one input (its parallel
# block) into one node, and both exporters fold Gemma's `1 + weight` norms (weight zero) into
# constants.
FOR_TRAINING = {"gpt_neox_fresh", "gemma_fresh"}


def export(model, x, in_name, path, dynamo, for_training=False, axes="batch"):
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    if axes != "batch":
        if dynamo:
            dims = {}
            if axes == "batch+seq":
                dims = {0: torch.export.Dim("batch", min=1, max=1024), 1: torch.export.Dim("seq", min=2, max=16)}
            prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=OPSET, input_names=[in_name],
                                     output_names=["logits"], dynamic_shapes=(dims,) if dims else None, verbose=False)
            prog.optimize()
            prog.save(path)
        else:
            dims = {in_name: {0: "batch", 1: "seq"}, "logits": {0: "batch"}} if axes == "batch+seq" else None
            torch.onnx.export(model, (x,), path, dynamo=False, opset_version=OPSET, input_names=[in_name],
                              output_names=["logits"], dynamic_axes=dims)
    elif for_training:
        if dynamo:
            batch = torch.export.Dim("batch", min=1, max=1024)
            prog = torch.onnx.export(model, (x,), dynamo=True, optimize=False, opset_version=OPSET,
                                     input_names=[in_name], output_names=["logits"],
                                     dynamic_shapes=({0: batch},), verbose=False)
            prog.save(path)
        else:
            torch.onnx.export(model, (x,), path, dynamo=False, opset_version=OPSET, input_names=[in_name],
                              output_names=["logits"], dynamic_axes={in_name: {0: "batch"}, "logits": {0: "batch"}},
                              do_constant_folding=False)
    elif has_bn and not dynamo:
        # Exported in eval mode, the legacy exporter folds BatchNormalization into the
        # convolutions: a model to train is exported in training mode, as torch.onnx documents.
        torch.onnx.export(model.train(), (x,), path, dynamo=False, opset_version=OPSET, input_names=[in_name],
                          output_names=["logits"], dynamic_axes={in_name: {0: "batch"}, "logits": {0: "batch"}},
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
        model.eval()
    elif dynamo:
        batch = torch.export.Dim("batch", min=1, max=1024)
        prog = torch.onnx.export(model, (x,), dynamo=True, opset_version=OPSET, input_names=[in_name],
                                 output_names=["logits"], dynamic_shapes=({0: batch},), verbose=False)
        prog.optimize()
        prog.save(path)
    else:
        torch.onnx.export(model, (x,), path, dynamo=False, opset_version=OPSET, input_names=[in_name],
                          output_names=["logits"], dynamic_axes={in_name: {0: "batch"}, "logits": {0: "batch"}})
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    return m


def loss_of(kind, out, labels):
    if kind == "ce":
        return F.cross_entropy(out, labels)
    if kind == "lm":
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), labels.reshape(-1), ignore_index=-100)
    return F.mse_loss(out, labels)


def grads_by_initializer(m, named):
    """Maps each float initializer of `m` to the gradient of the parameter it holds: the one of
    the same name, else the only one equal to it, reshaped, or transposed (as the legacy exporter
    writes a Linear without bias)."""
    out = {}
    for init in m.graph.initializer:
        a = numpy_helper.to_array(init)
        if a.dtype != np.float32 or a.ndim == 0:
            continue
        if init.name in named:
            out[f"grad.{init.name}"] = named[init.name].grad.numpy().astype(np.float32)
            continue
        found = []
        for p in named.values():
            w = p.detach().numpy()
            if w.size == a.size and np.array_equal(w.reshape(a.shape), a):
                # Equal, or reshaped (a GroupNorm scale written as [C, 1, 1]).
                found.append(p.grad.numpy().reshape(a.shape))
            elif w.ndim == 2 and w.T.shape == a.shape and np.array_equal(w.T, a):
                found.append(p.grad.numpy().T)
        for p in named.values():
            rows = row_slice(p.detach().numpy(), a)
            if rows is not None:
                found.append(p.grad.numpy()[rows].reshape(a.shape))
        if len(found) == 1:
            out[f"grad.{init.name}"] = np.ascontiguousarray(found[0]).astype(np.float32)
            continue
        for value, grad in recurrent_forms(named):
            if value.shape == a.shape and np.array_equal(value, a):
                out[f"grad.{init.name}"] = grad.astype(np.float32)
    return out


def row_slice(w, a):
    """The rows `start:start+n` of the matrix `w` that `a` holds (an embedding lookup of fixed
    positions the dynamo exporter folded into a constant), or None."""
    if w.ndim != 2 or a.size % w.shape[1] or a.size == w.size or a.size == 0:
        return None
    rows = a.reshape(-1, w.shape[1])
    hits = np.nonzero((w == rows[0]).all(axis=1))[0]
    if len(hits) != 1 or hits[0] + len(rows) > len(w) or not np.array_equal(w[hits[0]:hits[0] + len(rows)], rows):
        return None
    return slice(hits[0], hits[0] + len(rows))


def recurrent_forms(named):
    """The weights of an nn.LSTM or nn.GRU (one layer, either direction) as the exporters write
    them, with their gradients: ONNX orders an LSTM's gates i, o, f, c where torch has i, f, g, o,
    a GRU's z, r, h where torch has r, z, n; stacks the directions on a new first axis; and
    concatenates the two biases."""
    def onnx_order(t):
        h = t.shape[0]
        if h % 4 == 0 and h // 4 == hidden:
            i, f, g, o = np.split(t, 4)
            return np.concatenate([i, o, f, g])
        r, z, n = np.split(t, 3)
        return np.concatenate([z, r, n])

    out = []
    for name in named:
        # Every layer of a stacked RNN (`weight_hh_l0`, `weight_hh_l1`, ...).
        layer = name.rsplit(".weight_hh_l", 1)
        if len(layer) != 2 or not layer[1].isdigit():
            continue
        prefix, l = layer[0] + ".", "l" + layer[1]
        hidden = named[name].shape[1]
        dirs = [""] + (["_reverse"] if f"{prefix}weight_hh_{l}_reverse" in named else [])

        def stacked(kinds, of):
            parts = [np.concatenate([onnx_order(of(named[f"{prefix}{k}_{l}{d}"])) for k in kinds]) for d in dirs]
            return np.stack(parts)

        for kinds in (["weight_ih"], ["weight_hh"], ["bias_ih", "bias_hh"]):
            if all(f"{prefix}{k}_{l}" in named for k in kinds):
                out.append((stacked(kinds, lambda p: p.detach().numpy()), stacked(kinds, lambda p: p.grad.numpy())))
    return out


def make(name, meta):
    build, in_name, make_input, loss_kind, make_labels = FAMILIES[name]
    torch.manual_seed(20261123)
    rng = np.random.default_rng(20261123)
    model = build().eval()
    # Trained-looking weights: no parameter left at a constant initialisation (norm scales of 1,
    # biases of 0), so that every gradient is checked against values of its own. The fresh
    # families keep the initialisation, as a model trained from scratch is exported.
    if name not in FRESH:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    x = make_input(rng)
    if loss_kind == "mse":
        with torch.no_grad():
            labels = torch.tensor(rng.standard_normal(tuple(model(x).shape)).astype(np.float32))
    else:
        labels = torch.tensor(make_labels(rng), dtype=torch.int64)
        if loss_kind == "lm":
            labels[0, :2] = -100  # ignored positions, as a padded batch has
    models = {}
    folded = []
    legacy_only = AXES.get(name) == "none" or name in LEGACY_ONLY
    for dynamo in (False,) if legacy_only else (False, True):
        exporter = "dynamo" if dynamo else "legacy"
        path = os.path.join(HERE, f"{name}.{exporter}.onnx")
        models[dynamo] = export(model, x, in_name, path, dynamo, name in FOR_TRAINING, AXES.get(name, "batch"))
        print(f"{os.path.basename(path)}: {os.path.getsize(path) // 1024} KB, "
              f"{len(models[dynamo].graph.node)} nodes")
        # The dynamo exporter folds BatchNormalization into the convolutions even from training
        # mode: that export is a different model to train, and its gradients are not torch's.
        if any(isinstance(m, nn.BatchNorm2d) for m in model.modules()) and \
                not any(n.op_type == "BatchNormalization" for n in models[dynamo].graph.node):
            folded.append(exporter)
    model.train()
    named = dict(model.named_parameters())
    loss = loss_of(loss_kind, model(x), labels)
    loss.backward()
    tensors = {f"input.{in_name}": x.numpy()}
    tensors["input.targets" if loss_kind == "mse" else "input.labels"] = labels.numpy()
    tensors["loss"] = np.array(loss.item(), dtype=np.float32)
    for dynamo, m in models.items():
        if ("dynamo" if dynamo else "legacy") in folded:
            continue
        for k, v in grads_by_initializer(m, named).items():
            tensors.setdefault(k, v)
    if name in FRESH:
        # Also by the module's names: the parameters that the exporter merged or dropped have no
        # initializer of their own in the file, and mpc gives them those names.
        for k, p in named.items():
            tensors.setdefault(f"grad.{k}", p.grad.numpy().astype(np.float32))
    save_file(tensors, os.path.join(HERE, f"{name}.grads.safetensors"))
    ints = {in_name: [0, 64]} if x.dtype == torch.int64 else {}
    meta[name] = {"input": in_name, "loss": {"ce": "cross-entropy", "lm": "cross-entropy:axis=-1",
                                             "mse": "mse"}[loss_kind],
                  "labels": "targets" if loss_kind == "mse" else "labels", "int_inputs": ints,
                  "batch_norm_folded": folded, "axes": AXES.get(name, "batch"),
                  "exporters": ["legacy"] if legacy_only else ["legacy", "dynamo"],
                  "torch_loss": loss.item()}
    if name in FRESH:
        meta[name]["parameters"] = len(named)


def main():
    names = sys.argv[1:] or list(FAMILIES)
    path = os.path.join(HERE, "zoo.json")
    meta = json.load(open(path)) if os.path.exists(path) else {}
    for name in names:
        make(name, meta)
    with open(path, "w") as f:
        json.dump(dict(sorted(meta.items())), f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
