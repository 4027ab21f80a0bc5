#!/usr/bin/env bash
# Reproduces docs/benchmarks.md on a GPU host: generates the Qwen3-4B layout
# (7.49 GiB, 3 shards, 398 tensors), starts weightd with the cuda backend on a
# private socket (cuda_handles=vmm, the default; pin off, so that staged loads
# stay staged: the default pin policy would register the checkpoint after the
# first one), runs weightd-bench (table, then JSON) and stops the daemon; then
# starts a second daemon with cuda_handles=legacy (pin off too) and times
# attaching there alone (weightd-bench --attach-only), and prints both attach
# figures side by side, and draws the charts of both JSON files into
# WORK_DIR/charts (tests/gpu/charts.py). Both daemons run without metrics
# (metrics_address=).
# tests/gpu/speed.sh measures the default configuration, strided staging,
# peers, DeepSeek-V3 and the cold path.
#
#   tests/gpu/bench.sh BUILD_DIR WORK_DIR [RUNS] [extra weightd-bench flags...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$1 work=$2 runs=${3:-5}
shift 3 || shift $#
mkdir -p "$work"
ckpt=$work/qwen3-4b
[ -f "$ckpt/model.safetensors.index.json" ] || "$build/weightctl" mkcheckpoint --preset qwen3-4b --seed 1 --out "$ckpt"
sync # loads timed while the generated checkpoint is written back run at half speed (tests/gpu/speed.sh)

pid=
stop_daemon() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi
}
trap stop_daemon EXIT

# start_daemon HANDLES: a weightd with cuda_handles=HANDLES and pin off on $work/weightd-HANDLES.sock
start_daemon() {
  sock=$work/weightd-$1.sock
  rm -f "$sock"
  "$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" \
    --set "cuda_handles=$1" --set pin=off --set metrics_address= 2>"$work/weightd-$1.log" &
  pid=$!
  for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
}

echo "== cuda_handles=vmm (the default): loads and attach"
start_daemon vmm
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" "$@"
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" --json "$@" > "$work/bench.json"
cat "$work/bench.json"
grep -E "loaded set|registered|staging|handles" "$work/weightd-vmm.log" | tail -n 30 || true
stop_daemon

echo "== cuda_handles=legacy: attach only"
start_daemon legacy
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" --attach-only "$@"
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" --attach-only --json "$@" \
  > "$work/bench-legacy.json"
cat "$work/bench-legacy.json"
stop_daemon

echo "== attach from a fresh process with a context, to usable pointers (medians)"
python3 - "$work/bench.json" "$work/bench-legacy.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    b = json.load(open(path))
    print(f"  {b['attach_handles']:9s} attach {b['attach_s'] * 1e3:7.3f} ms   round trip {b['attach_roundtrip_s'] * 1e3:7.3f} ms"
          f"   open {b['attach_open_s'] * 1e3:7.3f} ms   (target for cuda_vmm: <= 1 ms at 398 tensors)")
PY

echo "== charts (tests/gpu/charts.py) beside the JSON"
python3 "$here/charts.py" --out "$work/charts" "$work/bench.json" "$work/bench-legacy.json"
