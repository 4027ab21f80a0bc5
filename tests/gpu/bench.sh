#!/usr/bin/env bash
# Reproduces docs/benchmarks.md on a GPU host: generates the Qwen3-4B layout
# (7.49 GiB, 3 shards), starts weightd with the cuda backend on a private
# socket (pin off, so that staged loads stay staged: the default pin policy
# would register the checkpoint after the first one), runs weightd-bench
# (table, then JSON) and stops the daemon. tests/gpu/speed.sh measures the
# default configuration, strided staging, peers, DeepSeek-V3 and the cold path.
#
#   tests/gpu/bench.sh BUILD_DIR WORK_DIR [RUNS] [extra weightd-bench flags...]
set -euo pipefail
build=$1 work=$2 runs=${3:-5}
shift 3 || shift $#
mkdir -p "$work"
ckpt=$work/qwen3-4b
[ -f "$ckpt/model.safetensors.index.json" ] || "$build/weightctl" mkcheckpoint --preset qwen3-4b --seed 1 --out "$ckpt"
sock=$work/weightd.sock
"$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" --set pin=off 2>"$work/weightd.log" &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" "$@"
"$build/weightd-bench" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" --json "$@" > "$work/bench.json"
cat "$work/bench.json"
grep -E "loaded set|registered|staging" "$work/weightd.log" | tail -n 30
