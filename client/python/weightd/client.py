"""weightd.Client: a connection to the daemon, its ops as methods."""
from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Any, Iterable, Optional, Union

from . import _cuda
from ._conn import _Conn
from ._lib import ATTACH_EARLY, PROGRESS_FN, GroupOptions, GroupRank, LoadOptions, has, lib
from .errors import by_name, error_from_code
from .progress import Progress, ProgressFn, resolve
from .sets import TENSOR_TYPES, AttachedSet

__all__ = ["Client", "plan_from_args"]

Device = Union[None, str, int, Any]  # Any: a torch.device

_SET_ID_LEN = 64


def plan_from_args(plan: Optional[dict] = None, *, preset: Optional[str] = None, tp_size: Optional[int] = None,
                   tp_rank: Optional[int] = None, ep_size: Optional[int] = None, ep_rank: Optional[int] = None,
                   experts: Optional[Iterable[int]] = None, fuse: bool = False) -> Optional[dict]:
    """The plan object a load sends (docs/protocol.md, "Plans"); None means the daemon's default (whole).

    ``plan`` is a whole plan object (a preset with its fields, or explicit
    ``outputs``) and excludes the other arguments. Without it, any of the
    tp/ep/experts/fuse arguments make a preset plan (``preset`` defaults to
    ``"auto"`` then). The daemon checks the values and names a bad one.
    """
    layout = {"tp_size": tp_size, "tp_rank": tp_rank, "ep_size": ep_size, "ep_rank": ep_rank,
              "experts": sorted(experts) if experts is not None else None, "fuse": True if fuse else None}
    given = {k: v for k, v in layout.items() if v is not None}
    if plan is not None:
        if given or preset is not None:
            raise TypeError(f"plan= cannot be combined with {', '.join(sorted(given) or ['preset'])}: "
                            "write them in the plan")
        if not isinstance(plan, dict):
            raise TypeError(f"plan must be a dict, not {type(plan).__name__}")
        return plan
    if preset is None and not given:
        return None
    return {"preset": preset or "auto", **given}


def _current_torch_index() -> int:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.current_device())
    return 0


class _Call:
    """One cancelable call's progress trampoline: runs the user's callback, turns cancel into a stop.

    A cancel (Client.cancel from another thread, or an exception in the
    callback, KeyboardInterrupt included) sets the handle's timeout to 1 ms from
    inside the callback; the running call then stops waiting, and libweightd
    cancels the load in the daemon (weightd.h, weightd_set_timeout).
    """

    def __init__(self, conn: _Conn, fn: Optional[ProgressFn], load: bool):
        self.conn = conn
        self.fn = fn
        self.load = load  # Client.cancel() applies to loads only
        self.exc: Optional[BaseException] = None
        self.cfn = PROGRESS_FN(self._event)

    def _event(self, done: int, total: int, _arg: Any) -> None:
        if self.fn is not None and self.exc is None and not self.conn.cancel_requested:
            try:
                self.fn(done, total)
            except BaseException as e:  # noqa: BLE001 - re-raised after the C call returns
                self.exc = e
        if self.exc is not None or self.conn.cancel_requested:
            lib.weightd_set_timeout(self.conn.ptr, 1)

    def __enter__(self) -> "_Call":
        self.conn.cancel_requested = False
        self.conn.in_load = self.load
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.in_load = False
        lib.weightd_set_timeout(self.conn.ptr, self.conn.timeout_ms)
        close = getattr(self.fn, "close", None)
        if close is not None:
            close()

    def check(self, rc: int) -> None:
        """Raises what stopped the call: the callback's exception, a cancel, or rc's error."""
        canceled = self.conn.cancel_requested
        self.conn.cancel_requested = False
        if self.exc is not None:
            raise self.exc
        if rc == by_name["TIMEOUT"].code and canceled:
            raise by_name["CANCELED"]("the load was canceled by Client.cancel()")
        if rc != 0:
            raise self.conn.error(rc)


class Client:
    """A connection to weightd.

    ``socket`` None tries $WEIGHTD_SOCKET alone when it is set, else
    /run/weightd/weightd.sock, then the per-user socket (as libweightd does:
    a named socket is the only one tried, and a daemon run by another user
    than this one, root or the service user is refused with ConnectError). ``timeout`` (seconds) bounds each
    wait for the daemon's next frame; None waits forever.

    The handle is locked around every call, so a Client may be shared by
    threads (calls run one at a time). After fork() the child must make its
    own Client. Close it with :meth:`close` or a ``with`` block; sets whose
    arrays are still referenced keep the connection (and their leases) open
    until those arrays are gone.
    """

    def __init__(self, socket: Optional[str] = None, *, timeout: Optional[float] = None):
        ptr = ctypes.c_void_p()
        rc = lib.weightd_connect(os.fsencode(socket) if socket is not None else None, ctypes.byref(ptr))
        if rc != 0:
            err = error_from_code(rc, lib.weightd_last_error(ptr).decode(errors="replace") if ptr.value else "")
            lib.weightd_close(ptr)
            raise err
        timeout_ms = int(timeout * 1000) if timeout else 0
        self._conn: Optional[_Conn] = _Conn(ptr.value, timeout_ms)
        lib.weightd_set_timeout(ptr.value, timeout_ms)
        #: The daemon's backend: "host" or "cuda".
        self.backend: str = lib.weightd_backend(ptr.value).decode()

    # ---- lifetime -------------------------------------------------------------------

    @property
    def _c(self) -> _Conn:
        if self._conn is None:
            raise by_name["CLOSED"]("this weightd.Client is closed")
        return self._conn

    def close(self) -> None:
        """Closes the connection (now, or once the last array of its sets is gone)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<weightd.Client backend={self.backend} {'closed' if self._conn is None else 'open'}>"

    # ---- arguments ------------------------------------------------------------------

    def device_arg(self, device: Device) -> Optional[str]:
        """The device text sent to the daemon for a ``device=`` argument.

        A str is sent as it is (a UUID, or the daemon's own index as text). An
        int or a torch.device is this process's CUDA device (torch's
        numbering) and is sent as its UUID. None is torch's current device
        (0 without torch). On the host backend there is only host memory: an
        int is the daemon's index, None and ``cpu`` mean its default.
        """
        if isinstance(device, str):
            return device
        if device is None:
            return _cuda.uuid_of(_current_torch_index()) if self.backend == "cuda" else None
        if isinstance(device, bool):
            raise TypeError("device must be a str, an int or a torch.device, not a bool")
        if isinstance(device, int):
            index = device
        elif hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
            if device.type == "cpu" and self.backend != "cuda":
                return None
            if device.type != "cuda":
                raise ValueError(f"the daemon's {self.backend} backend cannot load onto {device}")
            index = device.index if device.index is not None else _current_torch_index()
        else:
            raise TypeError(f"device must be a str, an int or a torch.device, not {type(device).__name__}")
        if self.backend != "cuda":
            return str(index)
        return _cuda.uuid_of(index)

    # ---- ops --------------------------------------------------------------------------

    def open(self, path: Union[str, os.PathLike]) -> None:
        """Opens (validates and maps) a checkpoint in the daemon."""
        with self._c.call() as c:
            rc = lib.weightd_open(c, os.fsencode(path))
            if rc != 0:
                raise self._c.error(rc)

    def prefetch(self, path: Union[str, os.PathLike], *, pin: bool = False, wait: bool = False) -> None:
        """Warms a checkpoint in the page cache (``pin``: the pinned tier; ``wait``: until done)."""
        with self._c.call() as c:
            rc = lib.weightd_prefetch(c, os.fsencode(path), int(pin), int(wait))
            if rc != 0:
                raise self._c.error(rc)

    def load(self, path: Union[str, os.PathLike], *, device: Device = None, progress: Progress = None,
             plan: Optional[dict] = None, preset: Optional[str] = None, tp_size: Optional[int] = None,
             tp_rank: Optional[int] = None, ep_size: Optional[int] = None, ep_rank: Optional[int] = None,
             experts: Optional[Iterable[int]] = None, fuse: bool = False, source: Optional[str] = None) -> str:
        """Loads one rank's tensors of a checkpoint onto a device; returns the resident set's id.

        The plan comes from ``plan=`` or the tp/ep/fuse arguments
        (:func:`plan_from_args`). ``progress``: a callable(bytes_done,
        bytes_total), True for a tqdm bar, or None. ``source``: where a new
        load reads the files ("mmap", "direct" or "auto"; None: the daemon's
        setting). :meth:`cancel` from another thread (or an exception raised
        by the callback) stops it.
        """
        spec = plan_from_args(plan, preset=preset, tp_size=tp_size, tp_rank=tp_rank, ep_size=ep_size,
                              ep_rank=ep_rank, experts=experts, fuse=fuse)
        dev = self.device_arg(device)
        conn = self._c
        call = _Call(conn, resolve(progress, f"weightd load {os.fspath(path)}"), load=True)
        opts = LoadOptions(ctypes.sizeof(LoadOptions), dev.encode() if dev is not None else None,
                           json.dumps(spec).encode() if spec is not None else None, call.cfn, None, 0,
                           source.encode() if source is not None else None)
        out = ctypes.create_string_buffer(_SET_ID_LEN)
        with conn.call() as c, call:
            rc = lib.weightd_load(c, os.fsencode(path), ctypes.byref(opts), out, _SET_ID_LEN)
            call.check(rc)
        return out.value.decode()

    def load_group(self, path: Union[str, os.PathLike], *, tp_size: int = 1, ep_size: int = 1,
                   devices: Optional[Iterable[Device]] = None, progress: Progress = None, plan: Optional[dict] = None,
                   preset: Optional[str] = None, fuse: bool = False) -> list[dict]:
        """Loads every rank of a tensor/expert-parallel group, each onto its device, at once.

        The group has ``max(tp_size, ep_size)`` ranks; rank r holds tp_rank
        ``r % tp_size`` and ep_rank ``r % ep_size`` (vLLM's layout). ``devices``
        gives one device per rank (as :meth:`device_arg` reads each); None lets
        the daemon put rank r on its device ``r % count``. ``plan`` (or
        ``preset``/``fuse``) is a preset plan without sizes or ranks. Returns one
        dict per rank: rank, tp_rank, ep_rank, device (UUID), set, method,
        source ("host" or "peer:<uuid>"), bytes, seconds. When a rank fails, its
        error is raised, with every rank's result (failed ones carry "error")
        in the exception's ``ranks``; the ranks that loaded stay resident.
        """
        if not has("weightd_load_group"):
            raise by_name["UNSUPPORTED"]("this libweightd has no weightd_load_group: update the library")
        spec = plan_from_args(plan, preset=preset, fuse=fuse)
        conn = self._c
        devs = [self.device_arg(d) for d in devices] if devices is not None else None
        if devs is not None and any(d is None for d in devs):
            raise ValueError("each of devices must name a device (None is not one here)")
        dev_array = (ctypes.c_char_p * len(devs))(*[d.encode() for d in devs]) if devs is not None else None
        call = _Call(conn, resolve(progress, f"weightd load_group {os.fspath(path)}"), load=True)
        opts = GroupOptions(ctypes.sizeof(GroupOptions), tp_size, ep_size, dev_array, len(devs) if devs else 0,
                            json.dumps(spec).encode() if spec is not None else None, call.cfn, None)
        group = ctypes.c_void_p()
        with conn.call() as c, call:
            rc = lib.weightd_load_group(c, os.fsencode(path), ctypes.byref(opts), ctypes.byref(group))
            try:
                ranks = []
                for i in range(lib.weightd_group_size(group) if group.value else 0):
                    r = GroupRank(ctypes.sizeof(GroupRank))
                    lib.weightd_group_rank(group, i, ctypes.byref(r))
                    ranks.append({"rank": r.rank, "tp_rank": r.tp_rank, "ep_rank": r.ep_rank,
                                  "device": r.device.decode(), "set": r.set_id.decode() or None,
                                  "method": r.method.decode() or None, "source": r.source.decode() or None,
                                  "bytes": r.bytes, "seconds": r.seconds,
                                  "error": error_from_code(r.error, r.message.decode(errors="replace"))
                                  if r.error else None})
            finally:
                lib.weightd_group_free(group)
            try:
                call.check(rc)
            except Exception as e:
                e.ranks = ranks  # type: ignore[attr-defined]
                raise
        return ranks

    def attach(self, path: Union[str, os.PathLike, None] = None, *, set_id: Optional[str] = None,
               device: Device = None, progress: Progress = None, tensor_type: str = "auto",
               plan: Optional[dict] = None, early: bool = False, **layout: Any) -> AttachedSet:
        """Attaches a resident set: by ``set_id``, or by ``path`` (loaded first if needed).

        With a path, the device, plan and progress arguments are those of
        :meth:`load`. ``tensor_type``: "auto" (torch for CUDA sets, numpy for
        host sets), "numpy" or "torch" (host sets as CPU tensors).

        ``early=True`` returns as soon as the set's memory exists, while it
        may still load (progress is reported until then): wait for a tensor
        with :meth:`AttachedSet.wait`, or iterate
        :meth:`AttachedSet.ready_tensors`, before reading its values.
        """
        if (path is None) == (set_id is None):
            raise TypeError("attach takes a checkpoint path or set_id=, exactly one of them")
        if tensor_type not in TENSOR_TYPES:
            raise ValueError(f"tensor_type must be one of {', '.join(TENSOR_TYPES)}, not {tensor_type!r}")
        if early and not has("weightd_attach_early"):
            raise by_name["UNSUPPORTED"]("early attach needs a newer libweightd (weightd_attach_early)")
        if set_id is not None:
            if device is not None or plan is not None or layout or progress is not None:
                raise TypeError("attach(set_id=...) takes no device, plan or progress: the set has them")
            return self._attach_id(set_id, tensor_type, early)
        if early:
            return self._attach_path_early(path, device, progress, tensor_type, plan, layout)
        # A load then an attach by id: the load is cancelable and reports progress. The set could be
        # evicted in between (another load needing room); then it is loaded once more.
        for attempt in range(2):
            sid = self.load(path, device=device, progress=progress, plan=plan, **layout)
            try:
                return self._attach_id(sid, tensor_type)
            except by_name["NOT_FOUND"]:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _attach_path_early(self, path: Union[str, os.PathLike], device: Device, progress: Progress,
                           tensor_type: str, plan: Optional[dict], layout: dict) -> AttachedSet:
        spec = plan_from_args(plan, **layout)
        dev = self.device_arg(device)
        conn = self._c
        call = _Call(conn, resolve(progress, f"weightd attach {os.fspath(path)}"), load=False)
        opts = LoadOptions(ctypes.sizeof(LoadOptions), dev.encode() if dev is not None else None,
                           json.dumps(spec).encode() if spec is not None else None, call.cfn, None, ATTACH_EARLY)
        out = ctypes.c_void_p()
        with conn.call() as c, call:
            rc = lib.weightd_attach_path(c, os.fsencode(path), ctypes.byref(opts), ctypes.byref(out))
            if rc == 0 and call.exc is not None:  # the progress callback raised: give the set back
                lib.weightd_set_timeout(c, conn.timeout_ms)  # the callback set 1 ms to stop the call
                lib.weightd_release(out.value)
            call.check(rc)
        return self._wrap_set(conn, out.value, tensor_type)

    def _attach_id(self, set_id: str, tensor_type: str, early: bool = False) -> AttachedSet:
        out = ctypes.c_void_p()
        conn = self._c
        fn = lib.weightd_attach_early if early else lib.weightd_attach
        with conn.call() as c:
            rc = fn(c, set_id.encode(), ctypes.byref(out))
            if rc != 0:
                raise conn.error(rc)
        return self._wrap_set(conn, out.value, tensor_type)

    def _wrap_set(self, conn: _Conn, ptr: int, tensor_type: str) -> AttachedSet:
        out = ctypes.c_void_p(ptr)
        try:
            return AttachedSet(conn, out.value, tensor_type)
        except BaseException:
            with conn.call():
                lib.weightd_release(out.value)
            raise

    def release(self, s: Union[AttachedSet, str]) -> bool:
        """Releases an attached set (see :meth:`AttachedSet.release`), or a lease by id (raw op)."""
        if isinstance(s, AttachedSet):
            return s.release()
        return bool(self.request({"op": "release", "lease": s})["released"])

    def evict(self, set_id: Optional[str] = None, *, device: Device = None) -> list[str]:
        """Frees an unleased set, or every unleased set of a device; returns the ids evicted."""
        if (set_id is None) == (device is None):
            raise TypeError("evict takes a set id or device=, exactly one of them")
        req: dict[str, Any] = {"op": "evict"}
        if set_id is not None:
            req["set"] = set_id
        else:
            req["device"] = self.device_arg(device)
        return list(self.request(req)["evicted"])

    def cancel(self) -> bool:
        """Asks the load running on this client (in another thread) to stop.

        It stops at the daemon's next progress event (about 100 ms) and raises
        CanceledError in that thread. Returns False when no load is running.
        A load that finished meanwhile is not undone.
        """
        conn = self._c
        if not conn.in_load:
            return False
        conn.cancel_requested = True
        return True

    _STATUS_LISTS = ("checkpoints", "sets", "leases", "requests")

    def status(self, *, limit: Optional[int] = None, after: Optional[dict] = None, all_pages: bool = False) -> dict:
        """The daemon's status: daemon, devices, checkpoints, sets, leases, requests (docs/protocol.md).

        Each list is a page (the newest ``limit`` items, 256 by default);
        ``totals`` counts every list, and a cut list has its cursor in
        ``next``, which ``after`` takes for the next page. ``all_pages=True``
        asks for every page and returns one status listing everything.
        """
        req: dict[str, Any] = {"op": "status"}
        if limit is not None:
            req["limit"] = limit
        if after is not None:
            req["after"] = after
        reply = self.request(req)
        while all_pages and reply.get("next"):
            page = self.request({**req, "after": reply.pop("next")})
            for name in self._STATUS_LISTS:
                reply.setdefault(name, []).extend(page.get(name, []))
            if page.get("next"):
                reply["next"] = page["next"]
        if all_pages:
            reply.pop("left_out", None)
        return reply

    def request(self, req: dict, *, progress: Progress = None) -> dict:
        """Sends one raw request (a dict with "op") and returns the reply; an error reply raises.

        Descriptors that come with a reply are closed: use :meth:`attach` to map a set.
        """
        text = json.dumps(req).encode()
        reply = ctypes.c_void_p()
        conn = self._c
        call = _Call(conn, resolve(progress, f"weightd {req.get('op', 'request')}"), load=req.get("op") == "load")
        with conn.call() as c, call:
            rc = lib.weightd_request(c, text, ctypes.byref(reply), call.cfn, None)
            try:
                data = json.loads(ctypes.string_at(reply.value)) if reply.value else None
            finally:
                lib.weightd_free(reply)
            call.check(rc)
        return data
