#!/usr/bin/env bash
# One GPU-host session in as few calls as its time allows: build this tree
# (Release, CUDA, sm_90) into build-gpu, optionally a second tree to compare
# against into build-base, run the GPU tests, then tests/gpu/speed.sh with
# the sections asked for. Run from the checkout's root on the GPU host, with
# the Debian packages carried in .devdeps (tests/gpu/fetch-deps.sh).
#
#   tests/gpu/session.sh build [BASELINE_SRC]   builds only
#   tests/gpu/session.sh test                   ctest -L gpu on build-gpu
#   tests/gpu/session.sh speed SECTIONS         speed.sh with only SECTIONS (e.g. XK),
#                                               section X against build-base
#
# Logs and results go to $OUT when it is set (speed.json, raw/, *.log).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=/dev/null
source .devdeps/env.sh
out=${OUT:-/tmp/weightd-session}
mkdir -p "$out"
jobs=$(nproc)
case "${1:-}" in
build)
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/cmake.log" 2>&1 &&
    cmake --build build-gpu -j "$jobs" >>"$out/cmake.log" 2>&1 || { tail -40 "$out/cmake.log"; exit 1; }
  echo "built build-gpu"
  if [ -n "${2:-}" ]; then
    cmake -S "$2" -B build-base -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 >"$out/cmake-base.log" 2>&1 &&
      cmake --build build-base -j "$jobs" --target weightd >>"$out/cmake-base.log" 2>&1 ||
      { tail -40 "$out/cmake-base.log"; exit 1; }
    echo "built build-base from $2"
  fi
  ;;
test)
  ctest --test-dir build-gpu -L gpu --output-on-failure 2>&1 | tee "$out/ctest-gpu.log" | tail -40
  exit "${PIPESTATUS[0]}"
  ;;
speed)
  all=XACDPISK
  skip=$(echo "$all" | tr -d "${2:?sections}")
  SPEED_SKIP=$skip SPEED_BASELINE=$PWD/build-base OUT=$out tests/gpu/speed.sh build-gpu /tmp/weightd-speed 2>&1 |
    tee "$out/speed.log" | tail -80
  exit "${PIPESTATUS[0]}"
  ;;
*)
  echo "usage: $0 build [BASELINE_SRC] | test | speed SECTIONS" >&2
  exit 2
  ;;
esac
