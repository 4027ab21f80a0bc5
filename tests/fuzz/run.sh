#!/usr/bin/env bash
# Runs every libFuzzer target of a WEIGHTD_FUZZ build (or the TARGETs named)
# for SECONDS each, from the seeds in tests/fuzz/corpus/<target> with
# tests/fuzz/<target>.dict, JOBS targets at a time (default: one per CPU).
#
#   tests/fuzz/run.sh BUILD SECONDS [JOBS [TARGET...]]
#
# A crash, leak, sanitizer report, out-of-memory or slow input (over 25 s)
# fails the run; the input that did it is kept under BUILD/fuzz-run/artifacts/
# and the target's log under BUILD/fuzz-run/logs/. Inputs that found new
# coverage go to BUILD/fuzz-run/corpus/<target> (never into the tree). One
# line per target: executions, coverage (cov: edges, ft: features), result.
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 BUILD SECONDS [JOBS [TARGET...]]" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
secs=$2
jobs=${3:-$(nproc 2>/dev/null || echo 2)}
here=$(cd "$(dirname "$0")" && pwd)
targets=(header index frame request plan table setdesc manifest) # as WD_FUZZ_TARGETS in CMakeLists.txt
if [ $# -gt 3 ]; then
  shift 3
  for t in "$@"; do
    case " ${targets[*]} " in
    *" $t "*) ;;
    *) echo "$0: no fuzz target '$t' (targets: ${targets[*]})" >&2; exit 2 ;;
    esac
  done
  targets=("$@")
fi
out=$build/fuzz-run
mkdir -p "$out/corpus" "$out/artifacts" "$out/logs"

run_one() {
  local t=$1
  mkdir -p "$out/corpus/$t"
  local rc=0
  ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    "$build/tests/fuzz/fuzz_$t" -max_total_time="$secs" -timeout=25 -rss_limit_mb=2048 -print_final_stats=1 \
    -dict="$here/$t.dict" -artifact_prefix="$out/artifacts/$t-" "$out/corpus/$t" "$here/corpus/$t" \
    >"$out/logs/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$out/logs/$t.rc"
}

for t in "${targets[@]}"; do
  if [ ! -x "$build/tests/fuzz/fuzz_$t" ]; then
    echo "$build/tests/fuzz/fuzz_$t is missing: configure with CC=clang -DWEIGHTD_FUZZ=ON and build --target fuzz" >&2
    exit 2
  fi
done
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_one "$t" &
  running=$((running + 1))
done
wait || true

failed=0
printf '%-8s %12s %8s %8s  %s\n' target executions cov ft result
for t in "${targets[@]}"; do
  log=$out/logs/$t.log
  rc=$(cat "$out/logs/$t.rc" 2>/dev/null || echo 1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  final=$(grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$final")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$final")
  if [ "$rc" = 0 ]; then
    result=ok
  else
    result="FAILED (exit $rc; see $log)"
    failed=1
  fi
  printf '%-8s %12s %8s %8s  %s\n' "$t" "${execs:-?}" "${cov:-?}" "${ft:-?}" "$result"
done
if [ "$failed" != 0 ]; then
  for t in "${targets[@]}"; do
    if [ "$(cat "$out/logs/$t.rc" 2>/dev/null || echo 1)" != 0 ]; then
      echo "---- fuzz_$t ----"
      tail -60 "$out/logs/$t.log"
    fi
  done
  exit 1
fi
