#!/usr/bin/env python3
"""Runs a Python test suite under pytest, for ctest (the reference cross-checks, the integration
and CLI suites, the binding's).

Exit codes: pytest's own (0 when every test passed), and 1 when pytest,
numpy or the pinned safetensors package is missing: a test whose
dependency is missing fails (it used to exit 77, ctest's skip code, and a
machine without pytest reported "100% tests passed" having run none of
them). pytest's 5 ("no tests collected") is turned into 1: a run that
checks nothing must not pass.

Arguments are passed to pytest unchanged; a test's tmp_path is removed
when it ends unless its body failed (tmp_path_retention_policy=failed). When WD_TEST_TMP is set, pytest's
temporary directories go under it (WD_TEST_TMP/pytest-reference).
"""
import os
import sys

REFERENCE_VERSION = "0.8.0"


def unavailable(why):
    """Reports a missing prerequisite: the run fails."""
    print(f"run_pytest: {why}; failing: the tests need it (pip install -r tests/requirements.txt)", file=sys.stderr)
    return 1


def main(argv):
    try:
        import pytest
    except ImportError as e:
        return unavailable(f"cannot import pytest: {e}")
    try:
        import safetensors
    except ImportError as e:
        return unavailable(f"cannot import safetensors: {e}")
    try:
        import numpy  # noqa: F401 - the plan reference's byte views
    except ImportError as e:
        return unavailable(f"cannot import numpy: {e}")
    version = getattr(safetensors, "__version__", None)
    if version != REFERENCE_VERSION:
        return unavailable(f"safetensors {version} is installed, the reference is {REFERENCE_VERSION}")

    # Keep the source tree clean: no .pyc files, no .pytest_cache. A passing
    # test's tmp_path is removed when it ends (some write GiBs of checkpoints;
    # kept, two builds' worth filled a CI disk); a test whose body fails keeps its
    # tmp_path to read (pytest removes it after a setup or teardown error).
    sys.dont_write_bytecode = True
    args = ["-p", "no:cacheprovider", "-o", "tmp_path_retention_policy=failed"] + list(argv)
    tmp = os.environ.get("WD_TEST_TMP")
    if tmp and not any(a == "--basetemp" or a.startswith("--basetemp=") for a in argv):
        os.makedirs(tmp, exist_ok=True)
        args.insert(0, "--basetemp=" + os.path.join(tmp, "pytest-reference"))
    code = int(pytest.main(args))
    if code == int(pytest.ExitCode.NO_TESTS_COLLECTED):
        print("run_pytest: pytest collected no tests; failing", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
