"""Attached sets: a read-only mapping of tensor name -> array over the daemon's memory.

Lifetime rule (deferred release): every array handed out keeps the set's
mapping and lease alive. ``release()`` (or leaving the ``with`` block) ends
the set's use through this object at once; the lease itself ends as soon as
no array of the set is referenced any more — at once when none is, otherwise
when the last one is garbage collected. ``release()`` says which happened.
So no Python code can touch memory the daemon may have freed.

Early attach (``Client.attach(..., early=True)``): the set may still be
loading. Its table is complete and ``s[name]`` gives a view at once, but a
tensor's values are in place only once :meth:`AttachedSet.wait` returned for
it; :meth:`AttachedSet.ready_tensors` yields the tensors in slab order as
they come in. Waiting touches no connection: any thread may wait.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Iterator, NamedTuple

from . import _cuda, _wrap
from ._conn import _Conn
from ._lib import HANDLE_KINDS, MEMORY_CUDA, MEMORY_HOST, SET_STATES, Tensor, has, lib
from .errors import by_name, error_from_code

__all__ = ["AttachedSet", "TensorInfo"]

TENSOR_TYPES = ("auto", "numpy", "torch")


class TensorInfo(NamedTuple):
    """One tensor of a set as the daemon describes it; ``data_ptr`` is a host or device address."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    data_ptr: int


class _Keeper:
    """Alive while the set object or any of its arrays is; its finalizer releases the set."""

    __slots__ = ("__weakref__",)


def _info(t: Tensor) -> TensorInfo:
    return TensorInfo(t.name.decode(), t.dtype.decode(), tuple(t.shape[:t.ndim]), t.offset, t.nbytes,
                      t.data or 0)


class AttachedSet(Mapping):
    """A resident set attached to this process: ``s[name]`` is a zero-copy array of the tensor.

    CUDA sets give torch CUDA tensors on the device the daemon loaded (found by
    UUID, whatever CUDA_VISIBLE_DEVICES says); host sets give read-only numpy
    arrays (or CPU torch tensors with ``tensor_type="torch"``). Arrays are made
    on first access and cached. The memory is shared with every other process
    attached to the set: never write to it.

    Use it as a context manager, or call :meth:`release`.
    """

    def __init__(self, conn: _Conn, ptr: int, tensor_type: str):
        self._conn: _Conn | None = conn
        self._ptr: int | None = ptr
        self.id: str = lib.weightd_set_id(ptr).decode()
        self.lease: str = lib.weightd_set_lease(ptr).decode()
        self.device: str = lib.weightd_set_device(ptr).decode()
        kind = lib.weightd_set_memory_kind(ptr)
        self.memory: str = {MEMORY_HOST: "host", MEMORY_CUDA: "cuda"}.get(kind, f"unknown ({kind})")
        #: How the memory reached this process: "fd" (host), "cuda_vmm" or "cuda_ipc" (legacy);
        #: None with a libweightd too old to say.
        self.handle: str | None = None
        #: True when this process cannot write the memory (host sets; VMM sets where the driver
        #: granted a read-only mapping). A legacy IPC set's memory is writable: never write to it.
        self.read_only: bool | None = None
        if has("weightd_set_handle_kind"):
            self.handle = HANDLE_KINDS.get(lib.weightd_set_handle_kind(ptr))
            self.read_only = bool(lib.weightd_set_read_only(ptr))
        self.nbytes: int = lib.weightd_set_bytes(ptr)
        self.base: int = lib.weightd_set_base(ptr) or 0
        self._count: int = lib.weightd_set_tensor_count(ptr)
        if tensor_type == "auto":
            tensor_type = "torch" if self.memory == "cuda" else "numpy"
        if self.memory == "cuda" and tensor_type != "torch":
            raise by_name["INVALID"](f"set {self.id} is in CUDA memory: tensor_type must be 'torch'")
        self.tensor_type = tensor_type
        self._keeper: _Keeper | None = _Keeper()
        conn.add_keeper()
        self._finalizer = weakref.finalize(self._keeper, conn.release_set, ptr)
        self._finalizer.atexit = False
        self._slab: _wrap.Slab | None = None
        self._cache: dict[str, Any] = {}
        self._names: list[str] | None = None
        # Every read of _ptr and the C call on it count as a reader; release() waits for readers
        # in progress, so that no call reads a set it freed (waits come back within a slice).
        self._readers_cv = threading.Condition()
        self._readers = 0

    # ---- state ------------------------------------------------------------------

    @property
    def released(self) -> bool:
        """True once :meth:`release` was called (the lease may outlive it while arrays do)."""
        return self._ptr is None

    @property
    def lease_held(self) -> bool:
        """True until the last array is gone (the release itself may then wait for a running call)."""
        return self._finalizer.alive

    def _live(self) -> int:
        if self._ptr is None:
            raise by_name["INVALID"](f"set {self.id} was released; its arrays stay valid, the set gives no more")
        return self._ptr

    @contextmanager
    def _reading(self) -> Iterator[int]:
        """The set's pointer, valid until the block ends: release() waits for the block."""
        with self._readers_cv:
            ptr = self._live()
            self._readers += 1
        try:
            yield ptr
        finally:
            with self._readers_cv:
                self._readers -= 1
                self._readers_cv.notify_all()

    # ---- early attach: the load's progress ---------------------------------------

    @property
    def state(self) -> str:
        """"loading", "ready", "failed" or "canceled" (a set not attached early is "ready")."""
        if not has("weightd_set_state"):
            return "ready"
        with self._reading() as ptr:
            return SET_STATES.get(lib.weightd_set_state(ptr), "failed")

    @property
    def ready_bytes(self) -> int:
        """Slab bytes in place: a tensor is ready once its offset + nbytes is at most this."""
        if not has("weightd_set_ready_bytes"):
            return self.nbytes
        with self._reading() as ptr:
            return lib.weightd_set_ready_bytes(ptr)

    @property
    def load_error(self) -> str:
        """The daemon's message when the load failed or was canceled, else ""."""
        if not has("weightd_set_load_error"):
            return ""
        with self._reading() as ptr:
            return lib.weightd_set_load_error(ptr).decode(errors="replace")

    @property
    def corrupt(self) -> bool:
        """True once a scrub in the daemon found this set's bytes changed since its load: release it and attach
        again by path (with ``scrub_reload`` on, the daemon is loading a good copy already)."""
        if not has("weightd_set_corrupt"):
            return False
        with self._reading() as ptr:
            return bool(lib.weightd_set_corrupt(ptr))

    # Waits run in slices, so that Ctrl-C and release() from another thread get through.
    _SLICE_MS = 100

    def _wait(self, call: Any, what: str, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._reading() as ptr:
                left = self._SLICE_MS if deadline is None else max(0, min(self._SLICE_MS, int((deadline - time.monotonic()) * 1000)))
                rc = call(ptr, left)
            if rc == 0:
                return
            name = lib.weightd_err_name(rc).decode()
            if name == "TIMEOUT" and (deadline is None or time.monotonic() < deadline):
                continue
            if name == "NOT_FOUND":
                raise KeyError(what)
            detail = self.load_error if name != "TIMEOUT" else f"{what} not ready within {timeout} s"
            raise error_from_code(rc, f"set {self.id}: {detail or lib.weightd_strerror(rc).decode()}")

    def wait(self, name: str | None = None, timeout: float | None = None) -> None:
        """Waits until the tensor ``name`` is in place (None: the whole set, which must end ready).

        Raises KeyError for no such tensor, ``weightd.TimeoutError`` after
        ``timeout`` seconds, or the load's error (``CanceledError``,
        ``FaultError``, ...) when it failed first. A tensor once in place stays
        so. A set that was not attached early returns at once.
        """
        if not has("weightd_set_wait"):
            return
        key = None if name is None else name.encode()
        self._wait(lambda ptr, ms: lib.weightd_set_wait(ptr, key, ms), name or "the set", timeout)

    def ready_tensors(self, timeout: float | None = None) -> Iterator[tuple[str, Any]]:
        """Yields (name, tensor) in slab order, each as soon as its bytes are in place.

        ``timeout`` bounds the wait for each tensor. The load's error is raised
        when it fails before a tensor is in place.
        """
        names = self.names()
        for i, name in enumerate(names):
            if has("weightd_set_wait_tensor"):
                self._wait(lambda ptr, ms, i=i: lib.weightd_set_wait_tensor(ptr, i, ms), name, timeout)
            yield name, self[name]

    # ---- the mapping --------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name in self._cache:
            return True
        with self._reading() as ptr:
            return lib.weightd_set_find(ptr, name.encode(), Tensor()) == 0

    def __getitem__(self, name: str) -> Any:
        t = self._cache.get(name)
        if t is not None:
            return t
        with self._reading() as ptr:
            info = Tensor()  # one per call: a set may be read from several threads
            if not isinstance(name, str) or lib.weightd_set_find(ptr, name.encode(), info) != 0:
                raise KeyError(name)
            slab = self._slab or self._make_slab()
            t = slab.view(name, info.dtype.decode(), tuple(info.shape[:info.ndim]), info.offset, info.nbytes)
            self._cache[name] = t
            return t

    # Identity, not Mapping's element-wise comparison of arrays.
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def _entries(self, convert: Any) -> list[Any]:
        """convert(entry) for the table's entries in slab order (read while the set cannot go)."""
        with self._reading() as ptr:
            t = Tensor()
            out = []
            for i in range(self._count):
                lib.weightd_set_tensor(ptr, i, t)
                out.append(convert(t))
            return out

    def names(self) -> list[str]:
        """Every tensor's name, in slab order (read from the table once)."""
        if self._names is None:
            self._names = self._entries(lambda t: t.name.decode())
        return list(self._names)

    def info(self, name: str) -> TensorInfo:
        """The table entry of one tensor (no array is made)."""
        t = Tensor()
        with self._reading() as ptr:
            if lib.weightd_set_find(ptr, name.encode(), t) != 0:
                raise KeyError(name)
            return _info(t)

    def infos(self) -> list[TensorInfo]:
        """Every table entry, in slab order."""
        return self._entries(_info)

    def _make_slab(self) -> _wrap.Slab:
        keeper = self._keeper
        if keeper is None:
            raise by_name["INVALID"](f"set {self.id} was released; its arrays stay valid, the set gives no more")
        if self.memory == "cuda":
            self._slab = _wrap.cuda_torch(self.base, self.nbytes, keeper, _cuda.index_of(self.device))
        elif self.memory == "host" and self.tensor_type == "torch":
            self._slab = _wrap.host_torch(self.base, self.nbytes, keeper)
        elif self.memory == "host":
            self._slab = _wrap.host_numpy(self.base, self.nbytes, keeper)
        else:
            raise by_name["UNSUPPORTED"](f"set {self.id}: memory kind {self.memory} cannot be wrapped")
        return self._slab

    @property
    def torch_device(self) -> Any:
        """The torch device of the set's tensors (``cuda:N`` in this process's numbering, or ``cpu``)."""
        import torch

        if self.memory == "cuda":
            return torch.device("cuda", _cuda.index_of(self.device))
        return torch.device("cpu")

    # ---- release --------------------------------------------------------------------

    def release(self) -> bool:
        """Ends this object's use of the set; returns True if the lease ended now.

        It returns False when arrays of the set are still referenced: the lease
        then ends when the last of them is garbage collected. Calling it again
        only reports the state.
        """
        if self._ptr is None:
            return not self._finalizer.alive
        with self._readers_cv:
            ptr, conn = self._ptr, self._conn
            self._ptr = None
            self._conn = None
            while self._readers:  # a read on another thread ends; a wait within a slice
                self._readers_cv.wait()
        self._cache.clear()
        self._slab = None
        self._keeper = None  # the finalizer runs here if no array holds the keeper
        if self._finalizer.alive:
            return False
        failed = conn.drain(wait=True)
        if ptr in failed:
            raise failed[ptr]
        return True

    def __enter__(self) -> "AttachedSet":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._ptr is None else "attached"
        return (f"<weightd.AttachedSet {self.id} lease {self.lease} on {self.device} ({self.memory}, {self.handle}), "
                f"{self._count} tensors, {self.nbytes} bytes, {state}>")
