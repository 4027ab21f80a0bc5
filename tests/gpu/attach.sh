#!/usr/bin/env bash
# Attach and early-attach figures on a GPU host (docs/benchmarks.md, "Attach"):
# generates what it needs under WORK_DIR, starts weightd with the cuda backend
# on a private socket, and for each layout runs weightd-bench --attach-only
# (fresh processes with a CUDA context attaching the resident set, to usable
# pointers) and then --early with the model's own preset (fresh processes
# attaching the set while it loads: when the first layer is usable, when the
# whole set is), prints one table and draws WORK_DIR/charts/attach-vs-tensors.svg
# (tests/gpu/charts.py):
#
#   qwen3-4b               398 tensors, 7.49 GiB    (target: attach <= 1 ms)
#   qwen3-30b-a3b, 24 l.  9,435 tensors, 29 GiB     (target: attach <= 2 ms)
#   deepseek-v3 EP8 rank  ~11,000 tensors           (target: attach <= 5 ms; from
#                         `weightctl mkcheckpoint --sparse`)
#   early attach: first layer usable within 10% of the whole load's time
#
#   tests/gpu/attach.sh BUILD_DIR WORK_DIR [RUNS]
#
# About 3 minutes on an H200 host with the checkpoints already generated; the
# first run writes ~37 GiB (a few minutes more, disk permitting).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$1 work=$2 runs=${3:-5}
mkdir -p "$work"
work=$(cd "$work" && pwd)
ctl=$build/weightctl

gen() { # gen DIR ARGS...: a checkpoint, generated once
  local out=$1
  shift
  [ -f "$out/model.safetensors.index.json" ] || [ -f "$out/model.safetensors" ] ||
    "$ctl" mkcheckpoint "$@" --seed 1 --out "$out"
}
gen "$work/qwen3-4b" --preset qwen3-4b
gen "$work/qwen3-30b-a3b-24l" --preset qwen3-30b-a3b --layers 24
# name|checkpoint|plan for attach|plan for early attach (the model's own preset: layer order)|prefetch first
layouts=("qwen3-4b|$work/qwen3-4b|{\"preset\":\"whole\"}|{\"preset\":\"auto\"}|yes"
         "qwen3-30b-a3b-24l|$work/qwen3-30b-a3b-24l|{\"preset\":\"whole\"}|{\"preset\":\"auto\"}|yes")
if "$ctl" mkcheckpoint --help 2>&1 | grep -q -- "--sparse"; then
  # The DeepSeek-V3 layout, sparse (holes read as zeros): one EP8 rank, ~11,000 tensors.
  gen "$work/deepseek-v3-sparse" --preset deepseek-v3 --sparse
  ep='{"preset":"auto","ep_size":8,"ep_rank":0}'
  layouts+=("deepseek-v3-ep8-rank0|$work/deepseek-v3-sparse|$ep|$ep|no") # 673 GB of holes: no prefetch
else
  echo "== deepseek-v3 EP8 rank: skipped (this weightctl has no mkcheckpoint --sparse)"
fi

sock=$work/weightd-attach.sock
pid=
stop_daemon() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi
}
trap stop_daemon EXIT
rm -f "$sock"
"$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" 2>"$work/weightd-attach.log" &
pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done

results=()
for l in "${layouts[@]}"; do
  IFS='|' read -r name path plan early_plan warm <<<"$l"
  echo "== $name"
  if [ "$warm" = yes ]; then "$build/weightctl" --socket "$sock" prefetch "$path" --wait >/dev/null; fi
  "$build/weightd-bench" --checkpoint "$path" --socket "$sock" --runs "$runs" --plan "$plan" --attach-only --json \
    >"$work/attach-$name.json"
  "$build/weightd-bench" --checkpoint "$path" --socket "$sock" --runs 3 --plan "$early_plan" --attach-only --early \
    --json >"$work/early-$name.json"
  cat "$work/attach-$name.json" "$work/early-$name.json"
  results+=("$name|$work/attach-$name.json|$work/early-$name.json")
  # The next layout needs the GPU's memory.
  "$build/weightctl" --socket "$sock" evict --device 0 >/dev/null || true
done
stop_daemon

echo "== attach from a fresh process with a context, to usable pointers (medians); early attach"
python3 - "${results[@]}" <<'PY'
import json, sys
targets = {"qwen3-4b": 1.0, "qwen3-30b-a3b-24l": 2.0, "deepseek-v3-ep8-rank0": 5.0}
print(f"{'layout':24s} {'tensors':>8s} {'attach':>9s} {'target':>7s} {'of which open':>14s} "
      f"{'first layer':>12s} {'whole load':>11s} {'ratio':>6s}")
for arg in sys.argv[1:]:
    name, a, e = arg.split("|")
    a, e = json.load(open(a)), json.load(open(e))
    t = targets.get(name)
    ok = "" if t is None else ("ok" if a["attach_s"] * 1e3 <= t else "MISSED")
    print(f"{name:24s} {a['attach_tensors']:8d} {a['attach_s'] * 1e3:7.3f}ms {t or 0:5.1f}ms "
          f"{a['attach_open_s'] * 1e3:12.3f}ms {e['early_first_layer_s'] * 1e3:10.1f}ms "
          f"{e['early_all_s'] * 1e3:9.1f}ms {100 * e['early_first_layer_ratio']:5.1f}% {ok}")
print("targets: attach <= 1 ms at 398 tensors, <= 2 ms at 9,435, <= 5 ms at ~11,000; "
      "first layer usable within 10% of the whole load (both timed from the attach call)")
PY

# Attach time against the tensor count, from the attach-only runs (the early ones attach while loading).
python3 "$here/charts.py" --out "$work/charts" "$work"/attach-*.json
