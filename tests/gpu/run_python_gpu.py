#!/usr/bin/env python3
"""Runs the Python binding's GPU tests under pytest, for ctest (label gpu).

Exits 77 (ctest's skip) unless pytest, numpy, torch with a CUDA device and
transformers (with Qwen3) can be imported; otherwise runs pytest with the
arguments given and returns its status (5, nothing collected, becomes 1).
"""
import os
import sys

EXIT_SKIP = 77


def missing():
    try:
        import numpy  # noqa: F401
        import pytest  # noqa: F401
        import torch
        import transformers  # noqa: F401
        from transformers import Qwen3Config  # noqa: F401
    except ImportError as e:
        return f"{e} (pip install torch transformers numpy pytest)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def main(argv):
    why = missing()
    if why:
        print(f"run_python_gpu: {why}; skipping", file=sys.stderr)
        return EXIT_SKIP
    import pytest

    sys.dont_write_bytecode = True
    code = int(pytest.main(["-p", "no:cacheprovider", "-o", "tmp_path_retention_policy=failed"] + argv))
    return 1 if code == int(pytest.ExitCode.NO_TESTS_COLLECTED) else code


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main(sys.argv[1:]))
