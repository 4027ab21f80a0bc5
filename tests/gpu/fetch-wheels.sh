#!/usr/bin/env bash
# Downloads the wheels of the loaders tests/gpu/peers.py times beside weightd
# (and their dependencies other than torch, which the GPU host has) into
# .wheels/, which git ignores: run it where PyPI is reachable, copy the tree
# to the GPU host, and there install them with the line it prints.
#
#   tests/gpu/fetch-wheels.sh [PYTHON_VERSION]      (default 3.12; x86_64 Linux)
#
# The versions are those of docs/benchmarks.md's peers. InstantTensor and
# fastsafetensors are compiled against a torch: InstantTensor 0.2.2 needs
# torch >= 2.8 on the host.
set -euo pipefail
py=${1:-3.12}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=$root/.wheels
mkdir -p "$out"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
peers=(instanttensor==0.2.2 fastsafetensors==0.5.0 runai-model-streamer==0.17.1 safetensors==0.8.0)
# The loaders themselves, without their dependencies (which name torch)...
pip download --quiet --no-deps --only-binary=:all: --python-version "$py" "${plat[@]}" -d "$out" "${peers[@]}"
# ...and what they need besides torch: fastsafetensors needs typer, the streamer humanize and numpy.
pip download --quiet --only-binary=:all: --python-version "$py" "${plat[@]}" -d "$out" "typer>=0.9.0" humanize numpy
ls -1 "$out"
echo
echo "on the GPU host, from the checkout's root:"
echo "  python3 -m pip install --no-index --find-links .wheels ${peers[*]}"
