"""Turning an attached slab into arrays: the one module that knows numpy and torch.

A set is one slab of memory (host or CUDA) with tensors at offsets. The slab
is wrapped once, as a flat uint8 array or tensor that holds a reference to
the set's keeper; each tensor is then a view of it (slice, reinterpret the
dtype, reshape), so every array a caller gets keeps the set's mapping alive
through its base (numpy) or its storage (torch), and none copies.

- host slabs: numpy through ``__array_interface__`` (read-only), or torch CPU
  tensors made from that array;
- CUDA slabs: torch through ``__cuda_array_interface__``; torch places the
  tensor on the device that owns the pointer (the daemon names it by UUID;
  libweightd mapped it in that device's primary context). A VMM set
  (``cuda_vmm`` handles) and a legacy IPC set (``cuda_ipc``) are both plain
  device pointers here; a VMM set is mapped read-only where the driver
  allows, so a write to it fails in CUDA instead of changing shared weights.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Any

from .errors import by_name

# safetensors dtype -> (numpy dtype, ml_dtypes name or None, torch attribute).
# numpy dtype is the raw-width integer where numpy has no such type; with
# ml_dtypes installed its type is used instead. Sub-byte dtypes (F4, F6_*) have
# no entry: they come as flat uint8 arrays of their bytes.
DTYPES: dict[str, tuple[str, str | None, str]] = {
    "BOOL": ("bool", None, "bool"),
    "U8": ("uint8", None, "uint8"),
    "I8": ("int8", None, "int8"),
    "I16": ("int16", None, "int16"),
    "U16": ("uint16", None, "uint16"),
    "I32": ("int32", None, "int32"),
    "U32": ("uint32", None, "uint32"),
    "I64": ("int64", None, "int64"),
    "U64": ("uint64", None, "uint64"),
    "F16": ("float16", None, "float16"),
    "F32": ("float32", None, "float32"),
    "F64": ("float64", None, "float64"),
    "C64": ("complex64", None, "complex64"),
    "BF16": ("uint16", "bfloat16", "bfloat16"),
    "F8_E4M3": ("uint8", "float8_e4m3fn", "float8_e4m3fn"),
    "F8_E5M2": ("uint8", "float8_e5m2", "float8_e5m2"),
    "F8_E8M0": ("uint8", "float8_e8m0fnu", "float8_e8m0fnu"),
    "F8_E4M3FNUZ": ("uint8", "float8_e4m3fnuz", "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": ("uint8", "float8_e5m2fnuz", "float8_e5m2fnuz"),
}


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


class _HostBuffer:
    """A host slab as numpy sees it; holds the keeper for as long as any view lives."""

    def __init__(self, base: int, nbytes: int, keeper: object):
        self.__array_interface__ = {"data": (base, True), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.keeper = keeper


class _CudaBuffer:
    """A CUDA slab as torch sees it; torch's storage holds this object (and so the keeper)."""

    def __init__(self, base: int, nbytes: int, keeper: object):
        # torch refuses read-only CUDA arrays; the memory must not be written all the same.
        self.__cuda_array_interface__ = {"data": (base, False), "shape": (nbytes,), "typestr": "|u1", "version": 2}
        self.keeper = keeper


class Slab:
    """One attached slab as a flat uint8 array (`flat`); `view()` makes each tensor from it."""

    lib = ""

    def __init__(self, flat: Any):
        self.flat = flat
        self._dtypes: dict[str, Any] = {}

    def dtype(self, name: str, dtype: str) -> Any:
        """The array dtype for a safetensors dtype (False: sub-byte, raw bytes), cached."""
        dt = self._dtypes.get(dtype)
        if dt is None:
            dt = self._dtypes[dtype] = self._dtype_of(dtype)
        if dt is None:
            raise by_name["UNSUPPORTED"](f"tensor '{name}': dtype {dtype} has no {self.lib} type here; "
                                         "AttachedSet.info() gives its address and size")
        return dt

    def _dtype_of(self, dtype: str) -> Any:
        raise NotImplementedError

    def view(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
        """The tensor at [offset, offset + nbytes) as `dtype` and `shape` (a view, never a copy)."""
        raise NotImplementedError


# ---- numpy --------------------------------------------------------------------


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype for a safetensors dtype (False: sub-byte, raw bytes)."""
    import numpy as np

    row = DTYPES.get(dtype)
    if row is None:
        return False
    raw, ml_name, _ = row
    if ml_name is not None:
        ml = _optional("ml_dtypes")
        if ml is not None and hasattr(ml, ml_name):
            return np.dtype(getattr(ml, ml_name))
    return np.dtype(raw)


class NumpySlab(Slab):
    lib = "numpy"

    def _dtype_of(self, dtype: str) -> Any:
        return numpy_dtype(dtype)

    def view(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
        import numpy as np

        dt = self.dtype(name, dtype)
        if dt is False:
            return self.flat[offset:offset + nbytes]
        # One constructor: the array's base is the slab, which holds the keeper.
        return np.ndarray(shape, dtype=dt, buffer=self.flat, offset=offset)


def host_numpy(base: int, nbytes: int, keeper: object) -> NumpySlab:
    """A host slab as a read-only numpy uint8 array whose views are the tensors."""
    import numpy as np

    if nbytes == 0:
        flat = np.empty(0, dtype=np.uint8)
        flat.flags.writeable = False
    else:
        flat = np.asarray(_HostBuffer(base, nbytes, keeper))
    return NumpySlab(flat)


# ---- torch --------------------------------------------------------------------


def torch_dtype(dtype: str) -> Any:
    """The torch dtype for a safetensors dtype (None: not in this torch; False: sub-byte)."""
    import torch

    row = DTYPES.get(dtype)
    if row is None:
        return False
    return getattr(torch, row[2], None)


class TorchSlab(Slab):
    """Tensors are as_strided views of one typed view of the slab per dtype (one op per tensor)."""

    lib = "torch"

    def _dtype_of(self, dtype: str) -> Any:
        dt = torch_dtype(dtype)
        if not dt:
            return dt
        size = self.flat.new_empty((), dtype=dt, device="meta").element_size()
        n = self.flat.numel()
        return dt, size, self.flat.narrow(0, 0, n - n % size).view(dt)

    def view(self, name: str, dtype: str, shape: tuple[int, ...], offset: int, nbytes: int) -> Any:
        dt = self.dtype(name, dtype)
        if dt is False:
            return self.flat.narrow(0, offset, nbytes)
        _, size, typed = dt
        strides = []
        step = 1
        for d in reversed(shape):
            strides.append(step)
            step *= d
        if offset % size:
            raise by_name["PROTOCOL"](f"tensor '{name}' lies at offset {offset}, not a multiple of its "
                                      f"{size}-byte elements")
        return typed.as_strided(shape, strides[::-1], offset // size)


def host_torch(base: int, nbytes: int, keeper: object) -> TorchSlab:
    """A host slab as a CPU torch tensor over the same memory (through numpy)."""
    import torch

    arr = host_numpy(base, nbytes, keeper).flat
    with warnings.catch_warnings():
        # The array is read-only, as the memory is; torch has no read-only tensors.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(arr)
    return TorchSlab(flat)


def cuda_torch(base: int, nbytes: int, keeper: object, index: int) -> TorchSlab:
    """A CUDA slab as a torch uint8 tensor on device `index` (this process's numbering)."""
    import torch

    if nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
    else:
        device = torch.device("cuda", index)
        # The device is named, so that a default device set with torch.set_default_device cannot move it.
        with torch.cuda.device(index):
            flat = torch.as_tensor(_CudaBuffer(base, nbytes, keeper), device=device)
        if flat.device != device or flat.data_ptr() != base:
            raise by_name["DEVICE"](f"torch did not wrap the set's memory in place on {device} "
                                    f"(it made a tensor on {flat.device} at {flat.data_ptr():#x}, the set is at "
                                    f"{base:#x}): the memory is mapped in another device's context")
    return TorchSlab(flat)
