#!/usr/bin/env python3
"""Runs the reference cross-checks under pytest, for ctest.

Exit codes: pytest's own (0 when every test passed), 77 (ctest's skip code)
when pytest, numpy or the pinned safetensors package is missing, 1 in that case too
when WD_REQUIRE_REFERENCE=1 (CI sets it, so a missing reference fails there).
pytest's 5 ("no tests collected") is turned into 1: a run that checks
nothing must not pass.

Arguments are passed to pytest unchanged; a test's tmp_path is removed
when it ends unless its body failed (tmp_path_retention_policy=failed). When WD_TEST_TMP is set, pytest's
temporary directories go under it (WD_TEST_TMP/pytest-reference).
"""
import os
import sys

REFERENCE_VERSION = "0.8.0"
EXIT_SKIP = 77


def unavailable(why):
    """Reports a missing prerequisite; skips, or fails when CI demands it."""
    if os.environ.get("WD_REQUIRE_REFERENCE") == "1":
        print(f"run_pytest: {why} (WD_REQUIRE_REFERENCE=1: failing)", file=sys.stderr)
        return 1
    print(f"run_pytest: {why}; skipping (pip install -r tests/requirements.txt)", file=sys.stderr)
    return EXIT_SKIP


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
