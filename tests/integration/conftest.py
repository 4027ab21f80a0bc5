"""The integration suite's fixtures: those of wdfixtures.py (a real weightd on a private socket).

They live in wdfixtures.py so that the other suites (the Python binding's,
the vLLM plugin's; the GPU suites' Daemon) use the same ones; see its
docstring.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

pytest.register_assert_rewrite("wdfixtures", "wdclient")  # its asserts say what they compared
from wdfixtures import *  # noqa: E402,F401,F403  the fixtures, the hook and the helpers tests import
