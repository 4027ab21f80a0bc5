"""One libweightd handle shared by a Client and the sets attached through it.

DESIGN: a weightd_client is single-threaded (weightd.h), so every call on it,
weightd_release of its sets included, runs under ``_Conn.lock``. Releases
come from two places: an explicit ``AttachedSet.release()`` (waits for the
lock like any call) and the finalizer of a set's keeper, which runs wherever
the last array of a set dies: on any thread, inside garbage collection, or
inside a progress callback of a call on this very handle. A finalizer never
waits: it queues the set in ``pending`` and drains the queue only if it can
take the lock at once; whoever holds the lock drains the queue when its call
ends. So a release never interleaves with another call's frames and no
thread blocks in a finalizer.

The handle itself is closed when the Client was closed (or dropped) and the
last keeper is gone; sets still queued then are released first. After
fork() the child gets fresh locks and its Client calls fail; a set's release
there only unmaps (libweightd's rule), and the parent's lease stays.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from contextlib import contextmanager
from typing import Iterator

from ._lib import lib
from .errors import Error, by_name, error_from_code

log = logging.getLogger("weightd")

# Every live handle, so that a forked child can reset their locks.
_conns: "weakref.WeakSet[_Conn]" = weakref.WeakSet()


def _release_now(set_ptr: int, client_ptr: int) -> Error | None:
    rc = lib.weightd_release(set_ptr)
    if rc == 0:
        return None
    return error_from_code(rc, "releasing a set: " + lib.weightd_last_error(client_ptr).decode(errors="replace"))


def _close_handle(ptr: int, pending: list[int]) -> None:
    """Finalizer of a _Conn: release what is still queued, then close the handle."""
    while pending:
        _release_now(pending.pop(), ptr)
    lib.weightd_close(ptr)


class _Conn:
    """A weightd_client pointer, its lock, and the sets waiting to be released."""

    def __init__(self, ptr: int, timeout_ms: int):
        self.ptr = ptr
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.owner: int | None = None  # the thread in a call, for a clear error on re-entry
        self.pending: list[int] = []
        self.keepers = 0  # sets whose memory may still be reachable
        self.count_lock = threading.Lock()  # guards keepers and pending; never held across a call
        self.closing = False
        self.timeout_ms = timeout_ms
        self.cancel_requested = False
        self.in_load = False
        self.finalizer = weakref.finalize(self, _close_handle, ptr, self.pending)
        self.finalizer.atexit = False  # at exit the kernel ends it all; nothing to run in a dying interpreter
        _conns.add(self)

    # ---- calls ---------------------------------------------------------------

    def check_usable(self) -> None:
        if self.pid != os.getpid():
            raise by_name["INVALID"](f"this weightd.Client belongs to process {self.pid}; "
                                     "after fork() make a new weightd.Client in the child")
        if self.closing or not self.finalizer.alive:
            raise by_name["CLOSED"]("this weightd.Client is closed")

    @contextmanager
    def call(self) -> Iterator[int]:
        """Holds the lock for one C call; yields the handle pointer."""
        self.check_usable()
        with self._held("a weightd.Client call was made from inside another call on the same client "
                        "(a progress callback cannot call its client)"):
            yield self.ptr

    @contextmanager
    def _held(self, reentered: str) -> Iterator[None]:
        """The lock, owned by this thread; the queued releases are done when it is let go."""
        me = threading.get_ident()
        if self.owner == me:
            raise by_name["INVALID"](reentered)
        with self.lock:
            self.owner = me
            try:
                yield
            finally:
                self.owner = None
                self._drain_locked()
        self.drain()  # what a finalizer queued after the last look

    def error(self, rc: int) -> Error:
        """The exception for rc with the handle's detail; call it while still holding the lock."""
        return error_from_code(rc, lib.weightd_last_error(self.ptr).decode(errors="replace"))

    # ---- releases --------------------------------------------------------------

    def add_keeper(self) -> None:
        with self.count_lock:
            self.keepers += 1

    def release_set(self, set_ptr: int) -> None:
        """A keeper's finalizer: release set_ptr now if the lock is free, else when it is."""
        with self.count_lock:
            self.pending.append(set_ptr)
            self.keepers -= 1
        self.drain()

    def drain(self, wait: bool = False) -> dict[int, Error]:
        """Releases the queued sets if the lock can be had (waiting for it when `wait`)."""
        failed: dict[int, Error] = {}
        while self.pending:
            if self.owner == threading.get_ident():
                return failed  # this thread's call drains when it ends
            if not self.lock.acquire(blocking=wait):
                return failed  # the holder drains when its call ends
            try:
                failed.update(self._drain_locked())
            finally:
                self.lock.release()
        return failed

    def _drain_locked(self) -> dict[int, Error]:
        failed = {}
        while self.pending:
            p = self.pending.pop()
            err = _release_now(p, self.ptr)
            if err is not None:
                log.warning("weightd: %s", err)
                failed[p] = err
        if self.closing and self.keepers == 0 and self.finalizer.alive:
            self.finalizer()
        return failed

    def close(self) -> None:
        """No more calls; the handle closes now, or once no set's memory is reachable."""
        with self._held("a weightd.Client cannot be closed from inside one of its calls"):
            self.closing = True


def _after_fork_in_child() -> None:
    for c in list(_conns):
        c.lock = threading.Lock()
        c.count_lock = threading.Lock()
        c.owner = None


os.register_at_fork(after_in_child=_after_fork_in_child)
