#!/usr/bin/env python3
"""ctest's entry to the tests against a real vLLM (label vllm; not run in CI).

    cmake -B build -DWEIGHTD_VLLM_PYTHON=/path/to/venv/bin/python && ctest --test-dir build -L vllm

WD_VLLM_PYTHON names a python with vLLM 0.33, pytest, and this repository's
client/python installed (``pip install --no-deps -e client/python``: vLLM
finds the plugin through that distribution's entry point). Without it the
test reports a skip (77). With it, a python that lacks any of those is a
failure that says which. Arguments go to pytest.
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
EXIT_SKIP = 77

PROBE = r"""
import sys
from importlib.metadata import entry_points
try:
    import vllm, pytest
except ImportError as e:
    sys.exit(f"cannot import {e.name}: install vllm==0.33.* and pytest into this python")
if not vllm.__version__.startswith("0.33."):
    sys.exit(f"vLLM {vllm.__version__} is installed; these tests are for 0.33")
if "weightd" not in {e.name for e in entry_points(group="vllm.general_plugins")}:
    sys.exit("the weightd distribution is not installed here: pip install --no-deps -e client/python")
"""


def main(argv):
    python = os.environ.get("WD_VLLM_PYTHON", "")
    if not python:
        print("vllm tests: skipped: no vLLM python configured (cmake -DWEIGHTD_VLLM_PYTHON=PYTHON, "
              "see tests/vllm/run_vllm.py)")
        return EXIT_SKIP
    r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"vllm tests: {python}: {(r.stderr or r.stdout).strip().splitlines()[-1]}", file=sys.stderr)
        return 1
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    args = [python, "-m", "pytest", "-p", "no:cacheprovider", HERE] + list(argv)
    return subprocess.call(args, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
