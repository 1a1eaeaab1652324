#!/usr/bin/env python3
"""Writes a digits-shaped training set as safetensors shards, for the data-memory benchmark.

    python3 benches/make_shards.py OUT_PREFIX TOTAL_BYTES SHARDS

writes OUT_PREFIX-0.safetensors ... OUT_PREFIX-(SHARDS-1).safetensors holding, together, about
TOTAL_BYTES (suffixes K, M, G) of samples: `images` f32 [n, 64] and `labels` i64 [n] (0..9), the
tensors tests/models/digits_mlp.onnx trains on. The values are a block of 4096 random samples
repeated (the benchmark measures memory, not learning); every sample has its own bytes in the file.
Standard library only.
"""
import array
import json
import random
import struct
import sys

SAMPLE = 64 * 4 + 8
BLOCK = 4096


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def write_shard(path, n, images, labels):
    header = {
        "images": {"dtype": "F32", "shape": [n, 64], "data_offsets": [0, n * 256]},
        "labels": {"dtype": "I64", "shape": [n], "data_offsets": [n * 256, n * 264]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for tensor, per in ((images, 256), (labels, 8)):
            whole, rest = divmod(n, BLOCK)
            for _ in range(whole):
                f.write(tensor)
            f.write(tensor[: rest * per])


def main():
    prefix, total, shards = sys.argv[1], size(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(0)
    images = array.array("f", (rng.uniform(0.0, 16.0) for _ in range(BLOCK * 64))).tobytes()
    labels = array.array("q", (rng.randrange(10) for _ in range(BLOCK))).tobytes()
    per_shard = total // SAMPLE // shards
    for k in range(shards):
        write_shard(f"{prefix}-{k}.safetensors", per_shard, images, labels)
    print(f"{shards} shards of {per_shard} samples ({per_shard * SAMPLE / (1 << 20):.0f} MiB each)")


if __name__ == "__main__":
    main()
