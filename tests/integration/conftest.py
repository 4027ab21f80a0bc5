"""The integration suite's fixtures: those of wdfixtures.py (a real weightd on a private socket).

They live in wdfixtures.py so that the other host-backend suites (the Python
binding's, the vLLM plugin's, the GPU suites) use the same ones; see its
docstring.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from wdfixtures import *  # noqa: E402,F401,F403  the fixtures, the hook and the helpers tests import
