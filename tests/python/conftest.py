"""pytest fixtures shared by the reference cross-checks."""
import os

import pytest

import stref


@pytest.fixture(scope="session")
def weightctl():
    """The weightctl under test; its absence is a failure, not a skip."""
    path = stref.weightctl_path()
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"weightctl not found at {path} (set WEIGHTCTL to the built binary)")
    return path
