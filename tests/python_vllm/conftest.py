"""Fixtures for the vLLM plugin's CI tests (no vLLM, no torch): daemons, the tiny models, the vLLM fixture.

The daemon fixtures are the integration suite's (a real weightd, host
backend, private socket): tests/integration/wdfixtures.py. The plugin
package (client/python/weightd_vllm) and the binding come from the source
tree; libweightd from $WEIGHTD_LIB (ctest sets it), else build/libweightd.so.
"""
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, os.path.join(REPO, "tests", "python"))
sys.path.insert(0, HERE)
os.environ.setdefault("WEIGHTD_LIB", os.path.join(REPO, "build", "libweightd.so"))

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
pytest.register_assert_rewrite("wdfixtures", "wdclient")  # its asserts say what they compared
from wdfixtures import *  # noqa: E402,F401,F403  the integration suite's daemon fixtures and hook

import vllm_models  # noqa: E402

#: Parameters of vLLM 0.33 models, recorded from the real package by tests/vllm (see its
#: test_fixture_matches_vllms_parameters): {"vllm": version, "cases": {"CASE/RANK": {model, plan, params}}}.
FIXTURE = os.path.join(HERE, "fixtures", "vllm-0.33-params.json")


def vllm_fixture():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def models(model_root):
    """Every tiny model the plugin is tested with, under the daemons' model root: {name: directory}."""
    return {name: vllm_models.write(model_root, name) for name in vllm_models.EXPERTS}


@pytest.fixture
def client(daemon):
    import weightd

    c = weightd.Client(daemon.socket)
    yield c
    c.close()
