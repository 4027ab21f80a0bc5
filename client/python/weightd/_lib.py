"""Finding libweightd and declaring its C interface (client/include/weightd.h) for ctypes.

This module is the only place that knows the C signatures. It loads the
library once, at import, from the first of:

1. ``$WEIGHTD_LIB`` when set: that path and nothing else, so that a wrong
   setting is reported instead of silently replaced by another copy;
2. a ``libweightd.so*`` beside this package (where a build or a wheel put it);
3. ``ctypes.util.find_library("weightd")`` (the ldconfig cache);
4. the system loader: ``libweightd.so.0``, then ``libweightd.so``
   (``LD_LIBRARY_PATH``, the default directories).

When none loads, :class:`LibraryNotFound` (an ``ImportError``) names every
place tried and why each failed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os

__all__ = ["lib", "path", "LibraryNotFound", "Tensor", "LoadOptions", "GroupOptions", "GroupRank", "PROGRESS_FN",
           "MEMORY_HOST", "MEMORY_CUDA", "HANDLE_KINDS", "SET_STATES", "ATTACH_EARLY", "has"]

#: The library's soname major version this package speaks (SOVERSION in CMakeLists.txt).
ABI_MAJOR = 0


class LibraryNotFound(ImportError):
    """libweightd could not be loaded; the message lists every place tried."""


# ---- the C types -------------------------------------------------------------

#: weightd_progress_fn: void (*)(uint64_t bytes_done, uint64_t bytes_total, void *arg)
PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)

MEMORY_HOST = 1
MEMORY_CUDA = 2

#: enum weightd_handle_kind -> the handle kind's wire name.
HANDLE_KINDS = {1: "fd", 2: "cuda_ipc", 3: "cuda_vmm"}

#: enum weightd_set_state -> its name.
SET_STATES = {1: "loading", 2: "ready", 3: "failed", 4: "canceled"}

#: WEIGHTD_ATTACH_EARLY, a weightd_load_options flag.
ATTACH_EARLY = 1


class Tensor(ctypes.Structure):
    """struct weightd_tensor (struct_size-versioned: set to ctypes.sizeof on construction)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("dtype", ctypes.c_char_p),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("offset", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
    ]

    def __init__(self) -> None:
        super().__init__(ctypes.sizeof(Tensor))


class LoadOptions(ctypes.Structure):
    """struct weightd_load_options (struct_size-versioned: set it to ctypes.sizeof)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("device", ctypes.c_char_p),
        ("plan_json", ctypes.c_char_p),
        ("progress", PROGRESS_FN),
        ("progress_arg", ctypes.c_void_p),
        ("flags", ctypes.c_uint),
        ("source", ctypes.c_char_p),
    ]


class GroupOptions(ctypes.Structure):
    """struct weightd_group_options (struct_size-versioned: set it to ctypes.sizeof)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("tp_size", ctypes.c_uint),
        ("ep_size", ctypes.c_uint),
        ("devices", ctypes.POINTER(ctypes.c_char_p)),
        ("ndevices", ctypes.c_size_t),
        ("plan_json", ctypes.c_char_p),
        ("progress", PROGRESS_FN),
        ("progress_arg", ctypes.c_void_p),
    ]


class GroupRank(ctypes.Structure):
    """struct weightd_group_rank (struct_size-versioned: set it to ctypes.sizeof)."""

    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rank", ctypes.c_uint),
        ("tp_rank", ctypes.c_uint),
        ("ep_rank", ctypes.c_uint),
        ("device", ctypes.c_char_p),
        ("set_id", ctypes.c_char_p),
        ("error", ctypes.c_int),
        ("message", ctypes.c_char_p),
        ("method", ctypes.c_char_p),
        ("source", ctypes.c_char_p),
        ("bytes", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
    ]


_client_p = ctypes.c_void_p
_set_p = ctypes.c_void_p
_group_p = ctypes.c_void_p
_c = ctypes

# name: (restype, argtypes), in the order of weightd.h.
_SIGNATURES = {
    "weightd_strerror": (_c.c_char_p, [_c.c_int]),
    "weightd_err_name": (_c.c_char_p, [_c.c_int]),
    "weightd_version": (_c.c_uint, []),
    "weightd_version_string": (_c.c_char_p, []),
    "weightd_connect": (_c.c_int, [_c.c_char_p, _c.POINTER(_client_p)]),
    "weightd_close": (None, [_client_p]),
    "weightd_last_error": (_c.c_char_p, [_client_p]),
    "weightd_backend": (_c.c_char_p, [_client_p]),
    "weightd_set_timeout": (None, [_client_p, _c.c_int]),
    "weightd_open": (_c.c_int, [_client_p, _c.c_char_p]),
    "weightd_prefetch": (_c.c_int, [_client_p, _c.c_char_p, _c.c_int, _c.c_int]),
    "weightd_load": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(LoadOptions), _c.c_char_p, _c.c_size_t]),
    "weightd_attach": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(_set_p)]),
    "weightd_attach_path": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(LoadOptions), _c.POINTER(_set_p)]),
    "weightd_release": (_c.c_int, [_set_p]),
    "weightd_evict": (_c.c_int, [_client_p, _c.c_char_p]),
    "weightd_request": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(_c.c_void_p), PROGRESS_FN, _c.c_void_p]),
    "weightd_free": (None, [_c.c_void_p]),
    "weightd_set_id": (_c.c_char_p, [_set_p]),
    "weightd_set_lease": (_c.c_char_p, [_set_p]),
    "weightd_set_device": (_c.c_char_p, [_set_p]),
    "weightd_set_memory_kind": (_c.c_int, [_set_p]),
    "weightd_set_base": (_c.c_void_p, [_set_p]),
    "weightd_set_bytes": (_c.c_uint64, [_set_p]),
    "weightd_set_tensor_count": (_c.c_size_t, [_set_p]),
    "weightd_set_tensor": (_c.c_int, [_set_p, _c.c_size_t, _c.POINTER(Tensor)]),
    "weightd_set_find": (_c.c_int, [_set_p, _c.c_char_p, _c.POINTER(Tensor)]),
}

# Functions added since the first release: declared when the library has them,
# so that this package still loads an older libweightd (see has()).
_OPTIONAL = {
    "weightd_set_handle_kind": (_c.c_int, [_set_p]),
    "weightd_set_read_only": (_c.c_int, [_set_p]),
    "weightd_attach_early": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(_set_p)]),
    "weightd_set_state": (_c.c_int, [_set_p]),
    "weightd_set_ready_bytes": (_c.c_uint64, [_set_p]),
    "weightd_set_load_error": (_c.c_char_p, [_set_p]),
    "weightd_set_corrupt": (_c.c_int, [_set_p]),
    "weightd_set_wait": (_c.c_int, [_set_p, _c.c_char_p, _c.c_int]),
    "weightd_set_wait_tensor": (_c.c_int, [_set_p, _c.c_size_t, _c.c_int]),
    "weightd_load_group": (_c.c_int, [_client_p, _c.c_char_p, _c.POINTER(GroupOptions), _c.POINTER(_group_p)]),
    "weightd_group_size": (_c.c_size_t, [_group_p]),
    "weightd_group_rank": (_c.c_int, [_group_p, _c.c_size_t, _c.POINTER(GroupRank)]),
    "weightd_group_free": (None, [_group_p]),
}


# ---- finding the library -------------------------------------------------------


def _candidates() -> list[tuple[str, str]]:
    """(how it was found, what to pass to dlopen), in the order they are tried."""
    env = os.environ.get("WEIGHTD_LIB")
    if env:
        return [("$WEIGHTD_LIB", env)]
    out = []
    here = os.path.dirname(os.path.abspath(__file__))
    for p in sorted(glob.glob(os.path.join(here, "libweightd.so*"))):
        out.append(("beside the package", p))
    found = ctypes.util.find_library("weightd")
    if found:
        out.append(("ctypes.util.find_library", found))
    for name in (f"libweightd.so.{ABI_MAJOR}", "libweightd.so"):
        out.append(("the system loader", name))
    return out


def _declare(dll: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(dll, name)  # AttributeError: not a libweightd this package can use
        fn.restype = restype
        fn.argtypes = argtypes
    for name, (restype, argtypes) in _OPTIONAL.items():
        fn = getattr(dll, name, None)
        if fn is not None:
            fn.restype = restype
            fn.argtypes = argtypes


def _load() -> tuple[ctypes.CDLL, str]:
    tried = []
    for how, p in _candidates():
        try:
            dll = ctypes.CDLL(p)
        except OSError as e:
            tried.append(f"{p} ({how}): {e}")
            continue
        try:
            _declare(dll)
        except AttributeError as e:
            tried.append(f"{p} ({how}): not a libweightd this package can use: {e}")
            continue
        major = dll.weightd_version() >> 16
        if major != ABI_MAJOR:
            tried.append(f"{p} ({how}): version {dll.weightd_version_string().decode()}, "
                         f"this package needs {ABI_MAJOR}.x")
            continue
        return dll, p
    raise LibraryNotFound(
        "weightd: cannot load libweightd; tried:\n  " + "\n  ".join(tried)
        + "\nInstall it (cmake --install BUILD) or set WEIGHTD_LIB to the path of libweightd.so.")


lib, path = _load()


def has(name: str) -> bool:
    """True when the loaded libweightd has the (optional) function name."""
    return getattr(lib, name, None) is not None
