"""Fixtures for the vLLM plugin's CI tests (no vLLM, no torch): daemons, the tiny models, the vLLM fixture.

The daemon fixtures are the integration suite's (a real weightd, host
backend, private socket), loaded as tests/python_binding does. The plugin
package (client/python/weightd_vllm) and the binding come from the source
tree; libweightd from $WEIGHTD_LIB (ctest sets it), else build/libweightd.so.
"""
import importlib.util
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

_spec = importlib.util.spec_from_file_location("wd_integration_fixtures",
                                               os.path.join(REPO, "tests", "integration", "conftest.py"))
fixtures = importlib.util.module_from_spec(_spec)
sys.modules["wd_integration_fixtures"] = fixtures
_spec.loader.exec_module(fixtures)

pytest_runtest_makereport = fixtures.pytest_runtest_makereport
_time_limit = fixtures._time_limit
binaries = fixtures.binaries
workdir = fixtures.workdir
model_root = fixtures.model_root
start_daemon = fixtures.start_daemon
daemon = fixtures.daemon

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
