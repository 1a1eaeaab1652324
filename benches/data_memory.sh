#!/usr/bin/env bash
# The resident memory of `mpc train` does not grow with the dataset: the digits MLP trained for
# the same steps from 3 shards of 1 GiB each and from one 30 MiB file, peak resident set of each.
#
#   benches/data_memory.sh [DIR]      (default: a fresh temporary folder, removed afterwards)
#
# Needs target/release/mpc (cargo build --release) and GNU time (/usr/bin/time).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir"
python3 benches/make_shards.py "$dir/big" 3.1G 3
python3 benches/make_shards.py "$dir/small" 30M 1
peak() {
    /usr/bin/time -f "%M" -o "$dir/rss" target/release/mpc train tests/models/digits_mlp.onnx \
        --policy mixed --batch 256 --max-steps 3000 --data "$@" > /dev/null
    echo $(( $(cat "$dir/rss") / 1024 ))
}
big=$(peak "$dir/big-*.safetensors")
small=$(peak "$dir/small-0.safetensors")
echo "peak resident memory: 3 shards of $(du -cm "$dir"/big-*.safetensors | tail -1 | cut -f1) MiB: $big MiB; one of $(du -m "$dir/small-0.safetensors" | cut -f1) MiB: $small MiB; difference $((big - small)) MiB"
