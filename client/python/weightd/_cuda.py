"""This process's CUDA devices by UUID, through the CUDA driver (libcuda.so.1) and ctypes.

The daemon names devices by UUID ("GPU-8f0e..."); this process numbers them
0, 1, ... after its own CUDA_VISIBLE_DEVICES, as torch does (torch's index i
is the driver's ordinal i). These two functions translate. The driver is
loaded on first use, so nothing here runs on a machine without one.
"""
from __future__ import annotations

import ctypes
import threading

from .errors import by_name

_lock = threading.Lock()
_driver: ctypes.CDLL | None = None
_uuids: list[str] | None = None


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


def _format(b: bytes) -> str:
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise by_name["DEVICE"](f"{what} failed with CUDA driver error {rc}")


def uuids() -> list[str]:
    """The UUIDs of this process's CUDA devices, by ordinal (cached after the first call)."""
    global _driver, _uuids
    with _lock:
        if _uuids is not None:
            return _uuids
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise by_name["UNSUPPORTED"](f"the CUDA driver (libcuda.so.1) cannot be loaded: {e}") from None
        _check(_driver.cuInit(0), "cuInit")
        n = ctypes.c_int()
        _check(_driver.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        get_uuid = getattr(_driver, "cuDeviceGetUuid_v2", None) or _driver.cuDeviceGetUuid
        out = []
        for i in range(n.value):
            dev = ctypes.c_int()
            _check(_driver.cuDeviceGet(ctypes.byref(dev), i), "cuDeviceGet")
            u = _CUuuid()
            _check(get_uuid(ctypes.byref(u), dev), "cuDeviceGetUuid")
            out.append(_format(bytes(u.bytes)))
        _uuids = out
        return out


def uuid_of(index: int) -> str:
    """The UUID of this process's CUDA device `index` (torch's numbering)."""
    u = uuids()
    if not 0 <= index < len(u):
        raise by_name["NOT_FOUND"](f"this process has {len(u)} CUDA device(s); there is no device {index}")
    return u[index]


def index_of(uuid: str) -> int:
    """This process's index (torch's numbering) of the device with that UUID."""
    u = uuids()
    if uuid in u:
        return u.index(uuid)
    raise by_name["NOT_FOUND"](f"device {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES); "
                               f"it sees {', '.join(u) or 'none'}")
