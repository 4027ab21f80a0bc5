#!/usr/bin/env bash
# Builds weightd and runs the whole test suite twice: a Release build with GCC
# (with the CUDA backend when the toolkit is present; GPU tests skip without a
# GPU), and an AddressSanitizer + UndefinedBehaviorSanitizer build with clang
# and CUDA off. Both builds treat warnings as errors (WEIGHTD_WERROR; a user's
# build does not). Then the libFuzzer targets (tests/fuzz) are built with clang
# under ASan + UBSan and each runs for WD_FUZZ_SECONDS (default 60) from its
# seeds. Any failure, sanitizer finding or fuzzer crash fails the run.
#
# Needs: cmake, gcc, clang with its sanitizer and libFuzzer runtimes (libclang-rt-14-dev),
# pkg-config, libuv1-dev, libcjson-dev, python3 with venv (the README's test
# command installs them). The Python reference tools (tests/requirements.txt)
# go into ./.venv.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc 2>/dev/null || echo 2)

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -r tests/requirements.txt

echo "== build (release, gcc) =="
CC=gcc cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DWEIGHTD_WERROR=ON -DWEIGHTD_PYTHON="$PWD/.venv/bin/python"
cmake --build build -j "$jobs"
echo "== tests (release) =="
df -h . | tail -n 1 | awk '{print "disk: " $4 " free"}'
ctest --test-dir build --output-on-failure -j "$jobs"
rm -rf build/tests/tmp   # the release run's scratch (checkpoints); a failed run keeps it to read

echo "== build (ASan + UBSan, clang, CUDA off) =="
CC=clang cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DWEIGHTD_SANITIZE=ON -DWEIGHTD_CUDA=OFF -DWEIGHTD_WERROR=ON \
  -DWEIGHTD_PYTHON="$PWD/.venv/bin/python"
cmake --build build-asan -j "$jobs"
echo "== tests (ASan + UBSan) =="
df -h . | tail -n 1 | awk '{print "disk: " $4 " free"}'
ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1 \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"
rm -rf build-asan/tests/tmp

echo "== build (libFuzzer targets, clang, ASan + UBSan) =="
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=Debug -DWEIGHTD_FUZZ=ON -DWEIGHTD_CUDA=OFF -DWEIGHTD_WERROR=ON \
  -DWEIGHTD_TESTS=OFF
cmake --build build-fuzz -j "$jobs" --target fuzz
echo "== fuzzing (${WD_FUZZ_SECONDS:-60} s per target) =="
tests/fuzz/run.sh build-fuzz "${WD_FUZZ_SECONDS:-60}" "$jobs"
