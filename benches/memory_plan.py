#!/usr/bin/env python3
"""mpc's memory and floors for the GPU benchmark's training steps, computed without a GPU or PyTorch.

    python3 benches/memory_plan.py [--mpc target/release/mpc] [--models gpt,mlp,resnet50] [--tiny]
                                   [--bandwidth 3.35e12] [--f16-rate 757e12] [--f32-rate 51.6e12]
    # needs numpy and onnx (.ci/requirements.txt)

Builds the models of benches/gpu_vs_torch.py in ONNX directly, with the ops PyTorch's exporter
writes for them there (opset 17: Linear on 3-D input as MatMul of the weight's Transpose + Add, the
tanh GELU as its nine nodes, the loss inside the GPT, ResNet-50's batch norms in training mode; the
shape arithmetic that mpc folds when lowering is written as constants), with random weights, and
prints for fp32 and mixed what `mpc inspect MODEL --memory --train` plans for the training step at
the benchmark's batch: the arena (activations), the state (masters, moments, the step's
low-precision weights) and the constants. Their sum is the "mpc memory" column of
benches/gpu_vs_torch.py (arena + state + constants, CUDA's 256-byte alignment aside), so the memory
targets' mpc side is checked here; what a CUDA run allocates beside it (cuBLAS's workspace, launch
scratch that the arena's free bytes do not hold) is printed under it, and `mpc bench` reports the
whole as `allocated_bytes`.

It also prints each step's two floors from the same plan: the bytes its launches must move (each
tensor a launch reads or writes, once) over the device's bandwidth, and its matrix-product FLOPs
over the device's rates (by default H100 SXM's HBM3 bandwidth from its data sheet, and the f16
and f32 rates `mpc bench` measured on the H100 of docs/gpu-performance.md).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Builder:
    def __init__(self, seed=0):
        self.nodes, self.inits, self.n = [], [], 0
        self.rng = np.random.default_rng(seed)

    def name(self, base):
        self.n += 1
        return f"{base}_{self.n}"

    def init(self, base, value):
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, base, *shape):
        return self.init(base, (self.rng.standard_normal(shape) * 0.02).astype(np.float32))

    def op(self, op_type, inputs, n_out=1, **attrs):
        outs = [self.name(op_type) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name("/" + op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def scalar(self, v):
        return self.init("c", np.array(v, dtype=np.float32))

    def ints(self, *v):
        return self.init("i", np.array(v, dtype=np.int64))

    def linear(self, x, d_in, d_out, bias=True):
        # nn.Linear on a sequence, as torch.onnx exports it in training mode (no constant folding):
        # the weight stored [out, in] and transposed in the graph, the bias added first.
        y = self.op("MatMul", [x, self.op("Transpose", [self.weight("W", d_out, d_in)], perm=[1, 0])])
        return self.op("Add", [self.init("b", np.zeros(d_out, np.float32)), y]) if bias else y

    def layer_norm(self, x, d):
        return self.op("LayerNormalization", [x, self.init("g", np.ones(d, np.float32)),
                                              self.init("beta", np.zeros(d, np.float32))], axis=-1, epsilon=1e-5)

    def gelu_tanh(self, x):
        # torch.onnx's symbolic_opset9 gelu(approximate="tanh").
        cube = self.op("Mul", [x, self.op("Mul", [x, x])])
        inner = self.op("Add", [x, self.op("Mul", [self.scalar(0.044715), cube])])
        t = self.op("Tanh", [self.op("Mul", [self.scalar((2 / np.pi) ** 0.5), inner])])
        return self.op("Mul", [self.scalar(0.5), self.op("Mul", [x, self.op("Add", [self.scalar(1.0), t])])])

    def model(self, inputs, outputs, path):
        g = helper.make_graph(self.nodes, "bench", inputs, outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="memory_plan.py",
                              ir_version=8)
        onnx.save(m, path, save_as_external_data=True, location=os.path.basename(path) + ".data")


def gpt(path, tiny):
    vocab, seq, d, layers, heads = (128, 16, 32, 2, 2) if tiny else (50257, 512, 768, 12, 12)
    b = Builder()
    x = b.op("Add", [b.op("Gather", [b.weight("tok", vocab, d), "tokens"]),
                     b.op("Slice", [b.weight("pos", seq, d), b.ints(0), b.ints(seq), b.ints(0)])])
    # The causal mask as nanoGPT and torch.nn.Transformer write it: -inf above the diagonal.
    mask = b.init("mask", np.triu(np.full((seq, seq), -np.inf, np.float32), 1))
    hd = d // heads
    for _ in range(layers):
        q, k, v = b.op("Split", [b.linear(b.layer_norm(x, d), d, 3 * d), b.ints(d, d, d)], n_out=3, axis=2)
        heads4 = b.ints(0, 0, heads, hd)
        q = b.op("Transpose", [b.op("Reshape", [q, heads4])], perm=[0, 2, 1, 3])
        kt = b.op("Transpose", [b.op("Reshape", [k, heads4])], perm=[0, 2, 3, 1])
        v = b.op("Transpose", [b.op("Reshape", [v, heads4])], perm=[0, 2, 1, 3])
        att = b.op("Add", [b.op("Mul", [b.op("MatMul", [q, kt]), b.scalar(hd ** -0.5)]), mask])
        y = b.op("MatMul", [b.op("Softmax", [att], axis=-1), v])
        y = b.op("Reshape", [b.op("Transpose", [y], perm=[0, 2, 1, 3]), b.ints(0, 0, d)])
        x = b.op("Add", [x, b.linear(y, d, d)])
        x = b.op("Add", [x, b.linear(b.gelu_tanh(b.linear(b.layer_norm(x, d), d, 4 * d)), 4 * d, d)])
    logits = b.linear(b.layer_norm(x, d), d, vocab, bias=False)
    flat = b.op("Reshape", [logits, b.ints(-1, vocab)])
    loss = b.op("SoftmaxCrossEntropyLoss", [flat, b.op("Reshape", ["labels", b.ints(-1)])], reduction="mean")
    b.nodes[-1].output[0] = "loss"
    ints = lambda n: helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", seq])
    b.model([ints("tokens"), ints("labels")], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], path)
    return 2 if tiny else 8, ["--loss", "output:loss"]


def mlp(path, tiny):
    width, classes = (64, 16) if tiny else (8192, 8192)
    b = Builder()
    x = "x"
    for _ in range(4):
        x = b.op("Relu", [b.op("Gemm", [x, b.weight("W", width, width), b.init("b", np.zeros(width, np.float32))],
                               transB=1)])
    b.op("Gemm", [x, b.weight("W", classes, width), b.init("b", np.zeros(classes, np.float32))], transB=1)
    b.nodes[-1].output[0] = "logits"
    io = lambda n, w: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", w])
    b.model([io("x", width)], [io("logits", classes)], path)
    return 32 if tiny else 8192, ["--loss", "cross-entropy"]


def resnet50(path, tiny):
    # torchvision's resnet50 (resnet18's basic blocks with --tiny), exported in training mode:
    # BatchNormalization with training_mode=1 and its running statistics as outputs.
    side, classes = (32, 1000) if tiny else (224, 1000)
    b = Builder()

    def conv(x, cin, cout, k, stride=1):
        w = b.init("W", (b.rng.standard_normal((cout, cin, k, k)) * (2 / (cin * k * k)) ** 0.5).astype(np.float32))
        return b.op("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride], pads=[k // 2] * 4)

    def bn(x, c):
        ones, zeros = np.ones(c, np.float32), np.zeros(c, np.float32)
        ins = [x, b.init("g", ones), b.init("beta", zeros), b.init("mean", zeros), b.init("var", ones)]
        return b.op("BatchNormalization", ins, n_out=3, epsilon=1e-5, momentum=0.9, training_mode=1)[0]

    def block(x, cin, width, stride, bottleneck):
        cout = width * 4 if bottleneck else width
        if bottleneck:
            y = b.op("Relu", [bn(conv(x, cin, width, 1), width)])
            y = b.op("Relu", [bn(conv(y, width, width, 3, stride), width)])
            y = bn(conv(y, width, cout, 1), cout)
        else:
            y = b.op("Relu", [bn(conv(x, cin, width, 3, stride), width)])
            y = bn(conv(y, width, width, 3), width)
        if stride != 1 or cin != cout:
            x = bn(conv(x, cin, cout, 1, stride), cout)
        return b.op("Relu", [b.op("Add", [y, x])]), cout

    x = b.op("Relu", [bn(conv("x", 3, 64, 7, 2), 64)])
    x = b.op("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    c, bottleneck = 64, not tiny
    for i, (n, width) in enumerate(zip([2, 2, 2, 2] if tiny else [3, 4, 6, 3], [64, 128, 256, 512])):
        for j in range(n):
            x, c = block(x, c, width, 2 if j == 0 and i > 0 else 1, bottleneck)
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
    b.op("Gemm", [x, b.weight("W", classes, c), b.init("b", np.zeros(classes, np.float32))], transB=1)
    b.nodes[-1].output[0] = "logits"
    b.model([helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, side, side])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], path)
    return 2 if tiny else 64, ["--loss", "cross-entropy"]


def plan(mpc, path, policy, batch, loss):
    cmd = [mpc, "inspect", path, "--memory", "--train", *loss, "--optimizer", "adamw", "--policy", policy,
           "--batch", str(batch)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr.strip()}")
    m = re.search(r"state (\d+), constants (\d+)\), peak activations (\d+) bytes", r.stdout)
    state, constants, arena = map(int, m.groups())
    scratch = re.search(r"CUDA scratch: (\d+) bytes with every convolution through cuDNN.*cuBLAS's workspace (\d+) bytes",
                        r.stdout)
    scratch = tuple(map(int, scratch.groups())) if scratch else (0, 0)
    t = re.search(r"in all \((\d+) bytes\), by (\d+) launches; matrix products: (.*)", r.stdout)
    flops = {d: float(v) * {"T": 1e12, "G": 1e9, "M": 1e6, "": 1}[u]
             for d, v, u in re.findall(r"(\w+) ([\d.]+) ([TGM]?) ?FLOP", t.group(3))}
    return arena, state, constants, int(t.group(1)), int(t.group(2)), flops, scratch


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mpc", default=os.path.join(ROOT, "target", "release", "mpc"))
    ap.add_argument("--models", default="gpt,mlp,resnet50")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s for the memory floor")
    ap.add_argument("--f16-rate", type=float, default=757e12, help="f16/bf16 matrix-product FLOP/s")
    ap.add_argument("--f32-rate", type=float, default=51.6e12, help="f32 matrix-product FLOP/s")
    ap.add_argument("--keep", metavar="DIR", help="write the models as DIR/NAME.onnx and keep them")
    args = ap.parse_args()
    mib = lambda b: b / 2**20
    with tempfile.TemporaryDirectory(prefix="mpc-memory-") as tmp:
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
            tmp = args.keep
        for name in args.models.split(","):
            path = os.path.join(tmp, f"{name}.onnx")
            batch, loss = {"gpt": gpt, "mlp": mlp, "resnet50": resnet50}[name](path, args.tiny)
            totals, arenas = {}, {}
            for policy in ["fp32", "mixed"]:
                arena, state, constants, traffic, launches, flops, (scratch, blas) = plan(
                    args.mpc, path, policy, batch, loss)
                totals[policy] = arena + state + constants
                arenas[policy] = arena
                print(f"{name} (batch {batch}) {policy:5}: arena {mib(arena):9.1f} MiB, state {mib(state):8.1f} MiB, "
                      f"constants {mib(constants):6.1f} MiB, total {mib(totals[policy]):9.1f} MiB")
                print(f"{'':>{len(name) + 16}} on CUDA also: cuBLAS's workspace {mib(blas):.1f} MiB, and at most "
                      f"{mib(scratch):.1f} MiB of launch scratch (none where the arena's free bytes hold it), "
                      f"cuDNN's algorithms' scratch where they do not")
                rate = {"f16": args.f16_rate, "bf16": args.f16_rate, "f32": args.f32_rate}
                compute = sum(f / rate.get(d, args.f32_rate) for d, f in flops.items()) * 1e3
                tflop = ", ".join(f"{d} {f / 1e12:.3f}" for d, f in flops.items())
                print(f"{'':>{len(name) + 16}} floors: memory {traffic / 2**30:.2f} GiB -> "
                      f"{traffic / args.bandwidth * 1e3:.2f} ms, compute {tflop} TFLOP -> {compute:.2f} ms, "
                      f"{launches} launches")
            print(f"{name}: mixed / fp32 {totals['mixed'] / totals['fp32']:.2f}x "
                  f"(the activations' arena {arenas['mixed'] / arenas['fp32']:.2f}x)")


if __name__ == "__main__":
    main()
