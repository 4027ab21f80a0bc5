"""weightd: attach weights the weightd daemon holds, as zero-copy torch tensors or numpy arrays.

    import weightd
    with weightd.Client() as c, c.attach("/models/qwen3-4b", device=0) as s:
        w = s["model.embed_tokens.weight"]        # a torch CUDA tensor over the daemon's memory

The package is pure Python over libweightd (ctypes); it finds the library
through $WEIGHTD_LIB, beside the package, or the system loader (see _lib.py).
torch and numpy are imported only when arrays are made. docs/python.md has
the whole story: the lifetime rules, dtypes, fork, errors, the transformers
loader (weightd.transformers.load_model).
"""
from __future__ import annotations

from . import errors
from ._lib import LibraryNotFound
from ._lib import path as library_path
from .client import Client, plan_from_args
from .errors import Error, by_code, by_name, error_from_code
from .sets import AttachedSet, TensorInfo

__version__ = "0.1.0"

# The generated error classes (BusyError, NotFoundError, ...) at the package's top level.
globals().update({cls.__name__: cls for cls in by_name.values()})


def library_version() -> str:
    """The version of the libweightd this package loaded."""
    from ._lib import lib

    return lib.weightd_version_string().decode()


def __getattr__(name: str) -> type[Error]:
    """For type checkers: the generated error classes are attributes of this module."""
    raise AttributeError(f"module 'weightd' has no attribute {name!r}")


__all__ = ["Client", "AttachedSet", "TensorInfo", "Error", "LibraryNotFound", "by_name", "by_code",
           "error_from_code", "plan_from_args", "library_path", "library_version", "errors"]
__all__ += [cls.__name__ for cls in by_name.values()]
