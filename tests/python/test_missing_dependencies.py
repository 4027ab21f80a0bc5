"""A Python test whose dependency is missing fails; it is never a skip that ctest counts as passed.

The Python suites run under tests/python/run_pytest.py (tests/CMakeLists.txt). Here it is run with
an interpreter that cannot import pytest (this one with -I -S: the standard library only), directly
and through ctest in a scratch build directory configured with that interpreter, and each run must
fail and say what is missing. GPU tests are the exception the project allows: they skip (77) on a
machine without a GPU, through their own runner (tests/gpu/run_python_gpu.py), untouched here.
"""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
RUN_PYTEST = os.path.join(HERE, "run_pytest.py")
# The tests registered with run_pytest.py or run_stress.py: each must fail without pytest.
PYTHON_TESTS = ["reference_python", "integration_host", "cli_host", "stress_host", "python_binding", "python_vllm"]


def bare_python(tmp_path):
    """A wrapper that runs this interpreter without site-packages (no pytest, numpy, safetensors)."""
    path = tmp_path / "bare-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    path.chmod(0o755)
    probe = subprocess.run([str(path), "-c", "import pytest"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0, "the bare interpreter can import pytest: this test cannot check anything"
    return str(path)


def env_without_demands():
    """The environment of a developer's run: WD_REQUIRE_REFERENCE, which CI sets, is not what makes it fail."""
    env = dict(os.environ)
    env.pop("WD_REQUIRE_REFERENCE", None)
    return env


def test_run_pytest_fails_without_pytest(tmp_path):
    p = subprocess.run([bare_python(tmp_path), RUN_PYTEST, "-q", HERE], capture_output=True, text=True,
                       timeout=120, env=env_without_demands())
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "run_pytest: cannot import pytest" in p.stderr and "pip install -r tests/requirements.txt" in p.stderr, \
        p.stderr


def test_ctest_fails_without_pytest(tmp_path):
    """ctest over the Python tests of a build configured with a Python that has no pytest fails, and
    lists each of them as failed (before: every one was skipped and ctest said 100% passed)."""
    cmake, ctest = shutil.which("cmake"), shutil.which("ctest")
    assert cmake and ctest, "cmake and ctest must be on PATH"
    build = tmp_path / "build"
    cfg = subprocess.run([cmake, "-S", REPO, "-B", str(build), "-DWEIGHTD_CUDA=OFF",
                          "-DWEIGHTD_PYTHON=" + bare_python(tmp_path)], capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout + cfg.stderr
    regex = "^(" + "|".join(PYTHON_TESTS) + ")$"
    p = subprocess.run([ctest, "--test-dir", str(build), "-R", regex, "--output-on-failure"], capture_output=True,
                       text=True, timeout=600, env=env_without_demands())
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "0 tests failed" not in out and "Skipped" not in out, out
    for name in PYTHON_TESTS:
        assert any(name in line and "Failed" in line for line in out.splitlines()), f"{name} did not fail:\n{out}"
