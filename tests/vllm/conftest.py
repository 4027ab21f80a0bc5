"""Fixtures for the tests against a real vLLM: the integration suite's daemons (host backend).

Run with a python that has vLLM 0.33 and this repository's client/python
installed (its entry point is how vLLM finds the plugin); see
tests/vllm/run_vllm.py. libweightd comes from $WEIGHTD_LIB (ctest sets it).
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "python_vllm"))
sys.path.insert(0, HERE)
os.environ.setdefault("WEIGHTD_LIB", os.path.join(REPO, "build", "libweightd.so"))

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
pytest.register_assert_rewrite("wdfixtures", "wdclient")  # its asserts say what they compared
from wdfixtures import *  # noqa: E402,F401,F403  the integration suite's daemon fixtures and hook
