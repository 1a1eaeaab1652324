#!/usr/bin/env bash
# The GPU checks of mpc, for a machine with an NVIDIA GPU, the CUDA driver and toolkit, Python with
# PyTorch, and no Rust. Build on a machine with Rust, run on the GPU machine:
#
#   benches/gpu_session.sh build          release mpc and the test executables into gpu-bin/
#                                         (ignored by git), with the conformance cases, the
#                                         kernels compiled for sm_90 (NVRTC from .ci/nvrtc, as
#                                         .ci/run installs it) and the folder the tests were
#                                         built in
#                                         and gpu-pack/gpu-bin.tar.xz, the same packed (about a
#                                         sixth of the size) to carry to the GPU machine
#   benches/gpu_session.sh PARTS [OUTDIR] on the GPU machine, with gpu-bin/ (or gpu-pack/) beside
#                                         the sources; PARTS is one part or several joined by
#                                         commas (devices,tests):
#       devices     mpc devices, nvidia-smi, the CUDA libraries found
#       tests       every device test on the GPU against the CPU (backend_ops, program, train,
#                   cuda_vs_cpu, runtime_conformance on the ONNX cases, cli, gradients)
#       attention   the fused attention on the GPU: its kernels at model sizes and the tiny GPTs
#                   trained fused against the CPU, then racecheck and memcheck over its kernels
#       variants    the program tests and the
#                   fixtures again with each switch that changes bits (MPC_FMAD=1,
#                   MPC_SCRATCH_IN_ARENA=0, MPC_CUBLASLT=0, MPC_WIDE=0, MPC_FUSE=0), and both
#                   sanitizers over the program tests
#       sanitizer   compute-sanitizer memcheck and racecheck over the GPU op tests and the fixtures
#       sanitizer_all  both tools over the GPU training, program and fixture tests too (slow)
#       bench       benches/gpu_vs_torch.py: mpc bench against PyTorch fp32 / AMP on the same GPU
#       all         all of the above (longer than one 10-minute call: run the parts one by one)
#   Logs go to OUTDIR (default: gpu-out/), one file per step, and a summary line per step to
#   OUTDIR/summary.txt. Where $OUT is set and no OUTDIR is given, the logs are written elsewhere and
#   packed at the end into $OUT/logs.tgz, with $OUT/summary.txt beside it (few files come back).
#   MPC_GPU_DEADLINE=S stops the steps S seconds after the start (each step is killed at the
#   deadline and the next ones are skipped), so that one call of a limited length still returns
#   its logs. MPC_BENCH_ARGS adds arguments to benches/gpu_vs_torch.py (--models mlp,gpt).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
BIN="$ROOT/gpu-bin"
PART="${1:-all}"

if [ "$PART" = build ]; then
  set -e
  rm -rf "$BIN"
  mkdir -p "$BIN"
  cargo build --release --bin mpc
  cp target/release/mpc "$BIN/mpc"
  # The test executables, by target name.
  cargo test --release --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, shutil, sys
want = {"backend_ops", "program", "train", "cuda_vs_cpu", "runtime_conformance", "cli", "cuda_plan", "gradients"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("executable") and t.get("name") in want and "test" in t.get("kind", []):
        shutil.copy(m["executable"], sys.argv[1] + "/" + t["name"])
        print("gpu-bin/" + t["name"])
' "$BIN"
  # Line tables make each executable about 45 MB; the carried folder must stay under 64 MiB.
  strip --strip-debug "$BIN"/*
  # The kernels compiled for the lent GPUs (H100 and H200: sm_90) ahead, so that no GPU minute goes
  # to NVRTC: the plan test compiles every family for sm_90 into this cache.
  LD_LIBRARY_PATH="$ROOT/.ci/nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XDG_CACHE_HOME="$BIN/cache" \
    "$BIN/cuda_plan" > /dev/null
  # And as MPC_FMAD=1 compiles them (the variants part runs tests with it).
  MPC_FMAD=1 LD_LIBRARY_PATH="$ROOT/.ci/nvrtc/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" XDG_CACHE_HOME="$BIN/cache" \
    "$BIN/cuda_plan" > /dev/null
  rm "$BIN/cuda_plan"   # it needs no GPU, and the carried folder must stay under 64 MiB
  # The tests find fixtures and the mpc binary under the folder they were built in.
  echo "$ROOT" > "$BIN/built_in"
  if [ -d ../shared/onnx-node-tests ]; then
    tar -C ../shared -cJf "$BIN/onnx-node-tests.tar.xz" onnx-node-tests
  fi
  du -sh "$BIN"
  mkdir -p "$ROOT/gpu-pack"
  tar -C "$ROOT" -cf - gpu-bin | xz -T2 -6 > "$ROOT/gpu-pack/gpu-bin.tar.xz"
  du -sh "$ROOT/gpu-pack"
  exit 0
fi

PACK=""
if [ -n "${2:-}" ]; then
  OUTDIR="$2"
elif [ -n "${OUT:-}" ]; then
  OUTDIR="$(mktemp -d)/gpu-logs"
  PACK="$OUT"
else
  OUTDIR="$ROOT/gpu-out"
fi
mkdir -p "$OUTDIR"
SUMMARY="$OUTDIR/summary.txt"
END_AT=$((SECONDS + ${MPC_GPU_DEADLINE:-1000000}))
if [ ! -x "$BIN/mpc" ] && [ -f "$ROOT/gpu-pack/gpu-bin.tar.xz" ]; then
  tar -C "$ROOT" -xJf "$ROOT/gpu-pack/gpu-bin.tar.xz"
fi
[ -x "$BIN/mpc" ] || { echo "gpu-bin/mpc is missing: run benches/gpu_session.sh build first (on a machine with Rust)"; exit 2; }

# ---- the CUDA libraries: the driver's libcuda where the loader finds it, then the toolkit's lib
# folder, then wherever libcublas, libnvrtc and libcudnn (PyTorch's wheel) are. Never a `stubs` folder: its libcuda answers
# every call with CUDA_ERROR_STUB_LIBRARY.
libs=()
driver="$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 /{print $NF; exit}')"
[ -n "$driver" ] && libs+=("$(dirname "$driver")")
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && libs+=("$d")
done
while IFS= read -r f; do
  libs+=("$(dirname "$f")")
done < <(find / -xdev \( -name 'libcublas.so*' -o -name 'libnvrtc.so*' -o -name 'libcublasLt.so*' -o -name 'libcudnn.so*' \) 2>/dev/null | grep -v /stubs/ | sort -u)
LD_LIBRARY_PATH="$(printf '%s\n' "${libs[@]}" | awk '!seen[$0]++' | paste -sd:)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
[ -f /usr/local/cuda/include/cuda_fp16.h ] && export MPC_CUDA_INCLUDE=/usr/local/cuda/include
export PATH="/usr/local/cuda/bin:$PATH"
export XDG_CACHE_HOME="$BIN/cache"

# ---- the folder the tests were built in points here, with the mpc binary where cargo left it.
built_in="$(cat "$BIN/built_in")"
if [ "$built_in" != "$ROOT" ] && [ ! -e "$built_in" ]; then
  mkdir -p "$(dirname "$built_in")"
  ln -s "$ROOT" "$built_in"
fi
mkdir -p "$ROOT/target/release"
cp -f "$BIN/mpc" "$ROOT/target/release/mpc"
if [ -f "$BIN/onnx-node-tests.tar.xz" ] && [ ! -d "$BIN/onnx-node-tests" ]; then
  tar -C "$BIN" -xJf "$BIN/onnx-node-tests.tar.xz"
fi
export MPC_ONNX_NODE_TESTS="$BIN/onnx-node-tests"

step() {  # step NAME COMMAND...: runs it, logs it, records its exit status and time
  local name="$1"
  shift
  local t0=$SECONDS
  local left=$((END_AT - SECONDS))
  if [ "$left" -le 5 ]; then
    echo "$name: skipped, past the deadline" | tee -a "$SUMMARY"
    return 0
  fi
  timeout -k 5 "$left" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc, $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  grep -E "^test result|^runtime conformance|^cuda plans|panicked|FAIL|skipped on cuda|out of rtol|differ" "$OUTDIR/$name.log" | head -30
  return 0
}

part_devices() {
  step nvidia-smi nvidia-smi
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$OUTDIR/libraries.log"
  step devices "$BIN/mpc" devices
  cat "$OUTDIR/devices.log"
}

part_tests() {
  step backend_ops "$BIN/backend_ops" cuda:: --nocapture --test-threads=1
  step cuda_vs_cpu "$BIN/cuda_vs_cpu" --nocapture --test-threads=1
  # The same with convolutions as im2col + GEMM and dense layers as a broadcast, a GEMM and a
  # ReLU, as on a machine without cuDNN and cuBLASLt.
  MPC_CUDNN=0 MPC_CUBLASLT=0 step cuda_vs_cpu_without_cudnn "$BIN/cuda_vs_cpu" --nocapture --test-threads=1
  step program "$BIN/program" cuda:: --nocapture --test-threads=1
  step train "$BIN/train" cuda:: --nocapture --test-threads=1
  step runtime_conformance "$BIN/runtime_conformance" cuda:: --nocapture --test-threads=1
  step cli "$BIN/cli" device_cuda --nocapture
  # Every gradient rule against finite differences, on the CPU and then on the GPU.
  step gradients "$BIN/gradients" --nocapture --test-threads=1
}

part_attention() {  # the fused attention's first run on hardware
  step attention "$BIN/cuda_vs_cpu" fused_attention a_gpt_step --nocapture --test-threads=1
  # Its kernels (shared-memory tiles, cp.async, ldmatrix) under both sanitizers, over a few tiles
  # (MPC_SMALL_ATTENTION: the sanitizers run each kernel far slower).
  if command -v compute-sanitizer > /dev/null; then
    MPC_SMALL_ATTENTION=1 step racecheck_attention compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/cuda_vs_cpu" fused_attention --test-threads=1
    MPC_SMALL_ATTENTION=1 step memcheck_attention compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_vs_cpu" fused_attention --test-threads=1
  fi
}

part_variants() {  # the bitwise and whole-network tests again under each switch, to tell causes apart
  MPC_FMAD=1 step program_fmad "$BIN/program" cuda:: --nocapture --test-threads=1
  MPC_SCRATCH_IN_ARENA=0 step program_no_scratch_in_arena "$BIN/program" cuda:: --nocapture --test-threads=1
  MPC_CUBLASLT=0 step program_no_cublaslt "$BIN/program" cuda:: --nocapture --test-threads=1
  MPC_WIDE=0 step program_narrow "$BIN/program" cuda:: --nocapture --test-threads=1
  MPC_FMAD=1 step fixtures_fmad "$BIN/cuda_vs_cpu" every_fixture --nocapture --test-threads=1
  MPC_FUSE=0 step fixtures_unfused "$BIN/cuda_vs_cpu" every_fixture --nocapture --test-threads=1
  MPC_CUBLASLT=0 step fixtures_no_cublaslt "$BIN/cuda_vs_cpu" every_fixture --nocapture --test-threads=1
  if command -v compute-sanitizer > /dev/null; then
    step racecheck_program compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/program" cuda:: --test-threads=1
    step memcheck_program compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/program" cuda:: --test-threads=1
  fi
}

part_sanitizer() {
  if ! command -v compute-sanitizer > /dev/null; then
    echo "sanitizer: compute-sanitizer not found" | tee -a "$SUMMARY"
    return 0
  fi
  step memcheck compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/backend_ops" cuda:: --test-threads=1
  step racecheck compute-sanitizer --tool racecheck --error-exitcode 9 "$BIN/backend_ops" cuda:: --test-threads=1
  step memcheck_fixtures compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/cuda_vs_cpu" every_fixture --test-threads=1
}

part_sanitizer_all() {  # both tools over every GPU test but the conformance cases and gradients
  # Under a sanitizer each kernel runs far slower: the loss tracking takes 3 steps instead of 50,
  # and the 30 epochs of digits training are left to memcheck (racecheck took over 10 minutes).
  for tool in memcheck racecheck; do
    local skip=()
    [ $tool = racecheck ] && skip=(--skip digits)
    MPC_TRACK_STEPS=3 step "${tool}_cuda_vs_cpu" compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/cuda_vs_cpu" --test-threads=1
    step "${tool}_train" compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/train" cuda:: "${skip[@]}" --test-threads=1
    step "${tool}_program" compute-sanitizer --tool $tool --error-exitcode 9 "$BIN/program" cuda:: --test-threads=1
  done
}

part_bench() {
  mkdir -p "$OUTDIR/bench"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 step gpu_vs_torch python3 -W ignore benches/gpu_vs_torch.py --mpc "$BIN/mpc" --out "$OUTDIR/bench" ${MPC_BENCH_ARGS:-}
  tail -40 "$OUTDIR/gpu_vs_torch.log"
  # Each step's floors at the copy bandwidth the run measured (mpc's own plans: no GPU needed).
  local bw
  bw=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["copy_tb_s"] * 1e12)' \
    "$OUTDIR/bench/gpu_vs_torch.json" 2>/dev/null || echo 3.35e12)
  step memory_plan python3 benches/memory_plan.py --mpc "$BIN/mpc" --bandwidth "$bw"
  cat "$OUTDIR/memory_plan.log"
}

IFS=, read -ra parts <<< "$PART"
for p in "${parts[@]}"; do
  case "$p" in
    devices) part_devices ;;
    tests) part_tests ;;
    attention) part_attention ;;
    sanitizer) part_sanitizer ;;
    variants) part_variants ;;
    sanitizer_all) part_sanitizer_all ;;
    bench) part_bench ;;
    all) part_devices; part_tests; part_attention; part_sanitizer; part_bench ;;
    *) echo "unknown part $p (build, devices, tests, attention, variants, sanitizer, sanitizer_all, bench, all)"; exit 2 ;;
  esac
done
if [ -n "$PACK" ]; then
  tar -C "$OUTDIR" -czf "$PACK/logs.tgz" .
  cp "$SUMMARY" "$PACK/summary.txt"
fi
