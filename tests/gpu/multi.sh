#!/usr/bin/env bash
# The multi-GPU work on whatever GPUs this host has, in about two minutes on
# one H200: the GPU test of the multi-device paths (tests/gpu/test_gpu_multi.c:
# peer operations in process, a TP=2 group on GPU 0 verified byte for byte, no
# peer -> no replica, no striping), then a weightd with replicas and striping
# on and weightd-bench's multi-GPU modes (all, replica and striped print
# "needs >= 2 GPUs" and skip on one GPU; group runs: TP=2 on GPU r, or both
# ranks on GPU 0), and weightctl load --all-ranks. JSON results go to
# WORK_DIR/multi-*.json.
#
#   tests/gpu/multi.sh BUILD_DIR WORK_DIR [RUNS]
set -euo pipefail
build=$(realpath "$1") work=$2 runs=${3:-3}
mkdir -p "$work"
work=$(realpath "$work")
ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "== $ngpus GPU(s)"

echo "== test_gpu_multi"
WEIGHTD=$build/weightd WEIGHTCTL=$build/weightctl WD_TEST_TMP=$work/tmp "$build/tests/test_gpu_multi"

ckpt=$work/qwen3-4b-18l
[ -f "$ckpt/model.safetensors.index.json" ] ||
  "$build/weightctl" mkcheckpoint --preset qwen3-4b --layers 18 --seed 1 --out "$ckpt" >/dev/null

sock=$work/weightd-multi.sock
pid=
stop_daemon() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=; fi
}
trap stop_daemon EXIT
rm -f "$sock"
"$build/weightd" --foreground --backend cuda --socket "$sock" --model-root "$work" --set metrics_address= \
  --set replicas=auto --set striping=auto --set stripe_min_bytes=256MiB 2>"$work/weightd-multi.log" &
pid=$!
for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
"$build/weightctl" --socket "$sock" prefetch "$ckpt" --wait >/dev/null

group_plan='{"preset":"auto","fuse":true}'
for mode in all replica striped; do
  echo "== weightd-bench --multi $mode"
  "$build/weightd-bench" --multi "$mode" --checkpoint "$ckpt" --socket "$sock" --runs "$runs"
  "$build/weightd-bench" --multi "$mode" --checkpoint "$ckpt" --socket "$sock" --runs "$runs" --json \
    >"$work/multi-$mode.json"
done
echo "== weightd-bench --multi group (TP=2)"
"$build/weightd-bench" --multi group --tp-size 2 --plan "$group_plan" --checkpoint "$ckpt" --socket "$sock" --runs "$runs"
"$build/weightd-bench" --multi group --tp-size 2 --plan "$group_plan" --checkpoint "$ckpt" --socket "$sock" \
  --runs "$runs" --json >"$work/multi-group.json"

echo "== weightctl load --all-ranks (both ranks on GPU 0), then status"
"$build/weightctl" --socket "$sock" evict --device 0 >/dev/null
"$build/weightctl" --socket "$sock" load "$ckpt" --all-ranks --tp-size 2 --fuse --devices 0,0
"$build/weightctl" --socket "$sock" status | sed -n '1,12p'
grep -E "striping|peers|NUMA|copy from|striped load" "$work/weightd-multi.log" | tail -n 20 || true
stop_daemon
cat "$work"/multi-*.json
