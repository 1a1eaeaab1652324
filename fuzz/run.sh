#!/usr/bin/env bash
# Builds the fuzz targets and runs each for SECONDS (default 60) on JOBS processes (default 1).
#   fuzz/run.sh [SECONDS] [JOBS]
#   fuzz/run.sh --ci       each target from the committed seeds only, libFuzzer seed 1, at most
#                          RUNS executions and 50 s: the same inputs on every run (CI's campaign)
# Exits non-zero when a target finds a crash, a hang or a memory blow-up; the input that did it
# is left in fuzz/artifacts/. The working corpus grows in fuzz/target/corpus/ (the committed seeds
# in fuzz/corpus/ are not changed); the number of executions is printed per target.
#
# The build is libFuzzer (the libfuzzer-sys crate) with SanitizerCoverage on the stable compiler:
# no nightly and no cargo-fuzz are needed. Panics abort, debug assertions and overflow checks are on.
set -euo pipefail
cd "$(dirname "$0")"
CI=0
if [ "${1:-}" = "--ci" ]; then
  CI=1
  shift
fi
SECONDS_EACH="${1:-60}"
JOBS="${2:-1}"
[ $CI = 1 ] && SECONDS_EACH=50
TARGET=x86_64-unknown-linux-gnu
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
cargo build --release --bins --target "$TARGET" --quiet
mkdir -p artifacts
status=0
for t in onnx text; do
  work="target/corpus/$t"
  extra=()
  if [ $CI = 1 ]; then
    work="target/ci-corpus/$t"
    rm -rf "$work"
    # Executions per target: about 40 s on one core of a CI machine.
    runs=$([ "$t" = text ] && echo 300000 || echo 40000)
    extra=(-seed=1 -runs="$runs")
  fi
  mkdir -p "$work"
  cp -n corpus/$t/* "$work"/ 2>/dev/null || true
  log="target/fuzz-$t.log"
  rm -f "$log" fuzz-*.log
  set +e
  if [ $CI = 1 ]; then
    "target/$TARGET/release/$t" "${extra[@]}" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix=artifacts/ "$work" > "$log" 2>&1
  elif [ "$JOBS" -gt 1 ]; then
    "target/$TARGET/release/$t" -fork="$JOBS" -ignore_crashes=0 -max_total_time="$SECONDS_EACH" -timeout=10 \
      -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix=artifacts/ "$work" > "$log" 2>&1
  else
    "target/$TARGET/release/$t" -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix=artifacts/ "$work" > "$log" 2>&1
  fi
  rc=$?
  set -e
  execs=$(grep -E "stat::number_of_executed_units|#[0-9]+.*DONE" "$log" | tail -1)
  echo "$t: exit $rc; $execs"
  if [ $rc -ne 0 ]; then
    grep -E "panicked|ERROR|Test unit written|SUMMARY" -A2 "$log" | head -12
    status=1
  fi
done
exit $status
