#!/usr/bin/env bash
# A dry run of tests/gpu/speed.sh on a machine without a GPU: the daemon's
# cuda backend and weightd-bench run against tests/gpu/fake_cudart.c (device
# memory is host memory, copies are memcpy), on small checkpoints, without
# the attach phase (an IPC handle cannot be opened in another process here).
# It finds the scripts' and the bench's bugs before the one GPU session; its
# timings mean nothing.
#
#   tests/gpu/dryrun.sh BUILD_DIR WORK_DIR      (BUILD_DIR built with CUDA)
set -euo pipefail
build=$1 work=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cuda_inc=${CUDA_HOME:-/usr/local/cuda}/include
mkdir -p "$work/fakecuda"
echo 'libcudart.so.13 { global: *; };' >"$work/fakecuda/ver.map"
cc -O2 -shared -fPIC -I"$cuda_inc" -Wl,--version-script="$work/fakecuda/ver.map" -Wl,-soname,libcudart.so.13 \
  -o "$work/fakecuda/libcudart.so.13" "$here/fake_cudart.c" -lpthread
export LD_LIBRARY_PATH=$work/fakecuda${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export SPEED_PRESET=${SPEED_PRESET:-qwen3-0.6b} SPEED_RUNS=${SPEED_RUNS:-2} SPEED_NO_ATTACH=1
export SPEED_DSV3_LAYERS=${SPEED_DSV3_LAYERS:-5} SPEED_DSV3_EXPERTS=${SPEED_DSV3_EXPERTS:-16}
exec "$here/speed.sh" "$build" "$work"
