"""Restart survival (issue 18): sets kept in the service manager's fd store.

CI has no systemd, so the harness plays its fd store as docs/operations.md
("Restarts") describes it: a NOTIFY_SOCKET that keeps every descriptor sent
with FDSTORE=1 under its FDNAME (ignoring one that is the same file as a
stored one, as systemd does), drops those named by FDSTOREREMOVE=1, and
hands everything back at the next start at 3, 4, ... with LISTEN_FDS,
LISTEN_PID and LISTEN_FDNAMES, after the listening socket (socket
activation). FDSTORE=<max> in the environment announces the store, as
systemd 254+ does. The daemon runs the host backend, whose memfd slabs stand
in for VMM allocations.
"""
import os
import fcntl
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import shutil

import pytest

from conftest import REPO, SANITIZER_MARKS, SLOW, STOP_SECONDS, WEIGHTD, write_single, TINY_TENSORS
from test_service import EXEC_WITH_FDS
from wdclient import Checkpoint, Conn, WDError, map_readonly, ranges_equal, verify_attached, wait_until

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class FdStore:
    """systemd's notify socket with its file descriptor store."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.lock = threading.Condition()
        self.fds = []  # [name, fd], in the order stored
        self.messages = []
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _same_file(self, fd):
        st = os.fstat(fd)
        return any((os.fstat(f).st_dev, os.fstat(f).st_ino) == (st.st_dev, st.st_ino) for _, f in self.fds)

    def _run(self):
        room = socket.CMSG_SPACE(253 * 4)
        while not self.stopping:
            r, _, _ = select.select([self.sock], [], [], 0.05)
            if not r:
                continue
            data, anc, _, _ = self.sock.recvmsg(65536, room)
            got = []
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    n = len(payload) // 4
                    got += list(struct.unpack(f"{n}i", payload[: n * 4]))
            fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
            with self.lock:
                if fields.get("FDSTORE") == "1":
                    for fd in got:
                        if self._same_file(fd):
                            os.close(fd)
                        else:
                            self.fds.append([fields.get("FDNAME", "stored"), fd])
                    got = []
                if fields.get("FDSTOREREMOVE") == "1":
                    keep = []
                    for name, fd in self.fds:
                        if name == fields.get("FDNAME"):
                            os.close(fd)
                        else:
                            keep.append([name, fd])
                    self.fds = keep
                for fd in got:
                    os.close(fd)
                self.messages.append(fields)
                self.lock.notify_all()

    def names(self):
        with self.lock:
            return sorted(n for n, _ in self.fds)

    def wait_for(self, pred, what, start=0):
        deadline = time.monotonic() + 20 * SLOW
        with self.lock:
            while True:
                for m in self.messages[start:]:
                    if pred(m):
                        return m
                left = deadline - time.monotonic()
                assert left > 0, f"no {what}; got {self.messages}"
                self.lock.wait(left)

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.sock.close()
        for _, fd in self.fds:
            os.close(fd)
        self.fds = []


class Supervisor:
    """Starts and restarts one weightd the way systemd would, keeping its store."""

    def __init__(self, model_root, config=None, activate=True):
        """activate: pass a listening socket (socket activation); else the daemon binds its own."""
        self.dir = tempfile.mkdtemp(prefix="wdr-")
        self.model_root = model_root
        self.socket = os.path.join(self.dir, "weightd.sock")
        self.listener = None
        if activate:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.socket)
            self.listener.listen(64)
        self.store = FdStore(os.path.join(self.dir, "notify"))
        self.log_path = os.path.join(self.dir, "stderr.log")
        self.config = dict(config or {})
        self.proc = None
        self.starts = 0

    def start(self, extra_env=None):
        with self.store.lock:
            passed = list(self.store.fds)
        fds = ([self.listener.fileno()] if self.listener else []) + [fd for _, fd in passed]
        names = (["weightd.socket"] if self.listener else []) + [n for n, _ in passed]
        args = [WEIGHTD, "--backend", "host", "--model-root", self.model_root, "--socket", self.socket,
                "--set", "metrics_address="]
        for k, v in self.config.items():
            args += ["--set", f"{k}={v}"]
        e = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID",
                                                               "LISTEN_FDNAMES", "FDSTORE")}
        e.update({"NOTIFY_SOCKET": self.store.path, "FDSTORE": "64", "LISTEN_FDS": str(len(fds)),
                  "LISTEN_FDNAMES": ":".join(names)})
        e.update(extra_env or {})
        start = len(self.store.messages)
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-c", EXEC_WITH_FDS, ",".join(map(str, fds))] + args,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=e,
                                     pass_fds=fds)
        self.starts += 1
        try:
            self.store.wait_for(lambda m: m.get("READY") == "1", "READY=1", start)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.log_text()}") from None
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(STOP_SECONDS)
        self.log.close()
        assert rc == 0, self.log_text()
        marks = [m for m in SANITIZER_MARKS if m in self.log_text()]
        assert not marks, self.log_text()

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def connect(self):
        return Conn(self.socket, timeout=30 * SLOW)

    def status(self):
        with self.connect() as c:
            return c.status()

    def fd_count(self, clients=0):
        """The daemon's descriptors once only `clients` connections are open (besides the listening and notify sockets)."""
        wait_until(lambda: sum(t.startswith("socket:") for t in self.fd_targets()) == 2 + clients,
                   what="the daemon's client connections closed")
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def fd_targets(self):
        d = f"/proc/{self.proc.pid}/fd"
        out = []
        for n in os.listdir(d):
            try:
                out.append(os.readlink(os.path.join(d, n)))
            except OSError:
                pass
        return sorted(out)

    def cleanup(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.store.close()
        if self.listener is not None:
            self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def supervisor(model_root, binaries, request):
    made = []

    def make(**kw):
        s = Supervisor(model_root, **kw)
        made.append(s)
        return s

    yield make
    failed = getattr(request.node, "rep_call", None) is None or request.node.rep_call.failed
    for s in made:
        if failed and os.path.exists(s.log_path):
            print(f"---- weightd log ----\n{s.log_text()[-12000:]}")
        s.cleanup()


@pytest.fixture
def ckpt_copy(model_root):
    """A private tiny checkpoint (tests change its files), removed afterwards."""
    d = tempfile.mkdtemp(prefix="restart-", dir=model_root)
    write_single(d, TINY_TENSORS, seed=11)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def loads(st):
    return st["daemon"]["loads"]


def stored_slabs(store):
    return [n for n in store.names() if n.startswith("wd-slab-")]


def stored_descriptions(store):
    return [n for n in store.names() if n.startswith("wd-sets-")]


def test_sigkill_keeps_sets_leases_and_bytes(supervisor, tiny):
    """A client keeps reading a set through SIGKILL and restart; the set comes back without a load."""
    s = supervisor().start()
    assert "restart survival: on" in s.log_text()
    ck = Checkpoint(os.path.join(tiny["a"], "model.safetensors"))
    c = s.connect()
    att, fd = c.attach(path=tiny["a"])
    lease, set_id = att["lease"], att["set"]
    assert verify_attached(att, fd, ck) > 0
    wait_until(lambda: stored_slabs(s.store) == [f"wd-slab-{set_id}"], what="the slab in the store")
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description in the store")
    # A reader that checks the mapping all the time, while the daemon dies and comes back.
    mapping, _ = map_readonly(fd)
    table = {t["name"]: t for t in att["tensors"]}
    errors, rounds, stop = [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            for name, t in table.items():
                src, b, e = ck.tensor_bytes(name)
                if not ranges_equal(mapping, t["offset"], src, b, e - b):
                    errors.append(name)
            rounds[0] += 1

    th = threading.Thread(target=reader)
    th.start()
    before = rounds[0]
    s.kill()
    with pytest.raises(Exception):
        c.status()  # the connection is gone
    c.close()
    wait_until(lambda: rounds[0] > before + 2, what="reads after the kill")
    s.start()
    after_start = rounds[0]
    st = s.status()
    assert [x["set"] for x in st["sets"]] == [set_id], st["sets"]
    assert st["daemon"]["sets_readopted"] == 1 and loads(st) == 0, st["daemon"]
    assert [(l["lease"], l["recovered"]) for l in st["leases"]] == [(lease, True)]
    assert "re-adopted set " + set_id in s.log_text()
    # The holder (this process) reclaims its lease; a new attach is served from the re-adopted set.
    c2 = s.connect()
    rep = c2.call("reclaim", lease=lease)
    assert rep["reclaimed"] is True and rep["set"] == set_id
    att2, fd2 = c2.attach(path=tiny["a"])
    assert att2["set"] == set_id
    assert verify_attached(att2, fd2, ck) > 0
    os.close(fd2)
    st = s.status()
    assert loads(st) == 0, "the attach after the restart loaded the set again"
    assert {l["lease"]: l["recovered"] for l in st["leases"]}[lease] is False
    wait_until(lambda: rounds[0] > after_start + 2, what="reads after the restart")
    stop.set()
    th.join()
    assert errors == [], f"{len(errors)} tensors read wrong across the restart"
    mapping.close()
    os.close(fd)
    c2.close()
    s.stop()


def test_reclaim_refused_to_another_process(supervisor, tiny):
    s = supervisor().start()
    c = s.connect()
    att, fd = c.attach(path=tiny["b"])
    os.close(fd)
    s.kill()
    c.close()
    s.start()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from wdclient import Conn, WDError\n"
            "c = Conn(sys.argv[2])\n"
            "try:\n    c.call('reclaim', lease=sys.argv[3]); print('RECLAIMED')\n"
            "except WDError as e:\n    print(e.code, e.message)\n")
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), s.socket, att["lease"]],
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.stdout.startswith("PERMISSION"), r.stdout + r.stderr
    assert f"granted to uid {os.getuid()} pid {os.getpid()}" in r.stdout
    with s.connect() as c2:
        with pytest.raises(WDError) as e:
            c2.call("reclaim", lease="l999")
        assert e.value.code == "NOT_FOUND"
        assert c2.call("reclaim", lease=att["lease"])["reclaimed"] is True
    s.stop()


def test_unreclaimed_leases_end_after_the_grace_period(supervisor, tiny):
    s = supervisor(config={"restart_grace_ms": 300}).start()
    c = s.connect()
    att, fd = c.attach(path=tiny["c"])
    os.close(fd)
    s.kill()
    c.close()
    s.start()
    wait_until(lambda: "nobody reclaimed ended" in s.log_text(), what="the grace period's end")
    st = s.status()
    assert st["leases"] == []
    assert [x["set"] for x in st["sets"]] == [att["set"]]  # the set stays, unleased
    with s.connect() as c2:
        with pytest.raises(WDError) as e:
            c2.call("reclaim", lease=att["lease"])
        assert e.value.code == "NOT_FOUND"
    s.stop()


def test_changed_checkpoint_is_not_readopted(supervisor, ckpt_copy):
    s = supervisor().start()
    with s.connect() as c:
        att, fd = c.attach(path=ckpt_copy)
        os.close(fd)
        c.call("release", lease=att["lease"])
    wait_until(lambda: len(stored_slabs(s.store)) == 1, what="the slab in the store")
    s.kill()
    shard = os.path.join(ckpt_copy, "model.safetensors")
    write_single(ckpt_copy, TINY_TENSORS, seed=12)  # same size, new bytes: a new file
    s.start()
    text = s.log_text()
    assert f"set {att['set']} of {os.path.realpath(ckpt_copy)} is not re-adopted: the checkpoint changed" in text, text
    assert "model.safetensors" in text.split("is not re-adopted")[1].splitlines()[0]
    st = s.status()
    assert st["sets"] == [] and st["daemon"]["sets_readopted"] == 0
    wait_until(lambda: stored_slabs(s.store) == [], what="the stale slab removed from the store")
    # A new attach loads the new bytes.
    with s.connect() as c:
        att2, fd2 = c.attach(path=ckpt_copy)
        assert verify_attached(att2, fd2, Checkpoint(shard)) > 0
        os.close(fd2)
    assert loads(s.status()) == 1
    s.stop()


def replace_description(store, data):
    """Puts data, as a sealed memfd, in place of the stored description (same name)."""
    with store.lock:
        (i, (name, fd)), = [(i, e) for i, e in enumerate(store.fds) if e[0].startswith("wd-sets-")]
        os.close(fd)
        m = os.memfd_create("corrupt", os.MFD_ALLOW_SEALING)
        os.write(m, data)
        fcntl.fcntl(m, fcntl.F_ADD_SEALS, SEALS)
        store.fds[i] = [name, m]


def read_description(store):
    with store.lock:
        (fd,) = [fd for name, fd in store.fds if name.startswith("wd-sets-")]
        return os.pread(fd, 1 << 20, 0)


@pytest.mark.parametrize("how", ["flipped", "truncated", "magic", "unsealed"])
def test_corrupt_description_starts_empty(supervisor, tiny, how):
    s = supervisor().start()
    with s.connect() as c:
        att, fd = c.attach(path=tiny["a"])
        os.close(fd)
    wait_until(lambda: len(stored_slabs(s.store)) == 1, what="the slab in the store")
    s.kill()
    data = bytearray(read_description(s.store))
    if how == "flipped":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncated":
        data = data[: len(data) - 9]
    elif how == "magic":
        data[0:8] = b"NOTADESC"
    if how == "unsealed":
        with s.store.lock:
            (i,) = [i for i, e in enumerate(s.store.fds) if e[0].startswith("wd-sets-")]
            os.close(s.store.fds[i][1])
            m = os.memfd_create("unsealed")
            os.write(m, bytes(data))
            s.store.fds[i][1] = m
    else:
        replace_description(s.store, bytes(data))
    s.start()
    text = s.log_text()
    assert "rejected, starting with no sets" in text, text
    st = s.status()
    assert st["sets"] == [] and st["leases"] == []
    wait_until(lambda: stored_slabs(s.store) == [], what="the unusable slab removed from the store")
    assert len(stored_descriptions(s.store)) == 1
    s.stop()


def test_descriptor_counts_stay_flat(supervisor, tiny):
    """1000 attach/release cycles without a restart, then 20 restarts: no descriptor accumulates."""
    s = supervisor().start()
    c = s.connect()
    att, fd = c.attach(path=tiny["a"])
    os.close(fd)
    c.call("release", lease=att["lease"])
    wait_until(lambda: stored_slabs(s.store) == [f"wd-slab-{att['set']}"], what="the slab in the store")
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
    base_daemon, base_store = s.fd_count(clients=1), s.store.names()
    for _ in range(1000):
        a, f = c.attach(path=tiny["a"])
        os.close(f)
        c.call("release", lease=a["lease"])
    c.status()
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
    assert s.fd_count(clients=1) == base_daemon
    assert [n for n in s.store.names() if not n.startswith("wd-sets-")] == \
        [n for n in base_store if not n.startswith("wd-sets-")]
    c.close()
    c = s.connect()  # holds a lease through the restarts
    held, f = c.attach(path=tiny["b"])
    os.close(f)
    wait_until(lambda: len(stored_slabs(s.store)) == 2, what="two slabs stored")
    counts, stores = [], []
    for i in range(20):
        if i % 2:
            s.stop()
        else:
            s.kill()
        s.start()
        st = s.status()
        assert sorted(x["set"] for x in st["sets"]) == sorted([att["set"], held["set"]])
        assert loads(st) == 0
        wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
        counts.append(s.fd_count())
        stores.append(len(s.store.names()))
    c.close()
    assert len(set(counts)) == 1, counts
    assert stores == [3] * 20, stores
    s.stop()


# ---- the clients: libweightd through the Python binding ------------------------------------


def binding():
    """The weightd package over the libweightd built next to WEIGHTD."""
    lib = os.path.join(os.path.dirname(WEIGHTD), "libweightd.so")
    if not os.path.exists(lib):
        pytest.skip(f"no {lib}")
    os.environ.setdefault("WEIGHTD_LIB", lib)
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    try:
        import numpy  # noqa: F401
        import weightd
    except ImportError as e:
        pytest.skip(f"the Python binding cannot load here: {e}")
    return weightd


def tensor_bytes(s, name):
    import numpy
    return numpy.ascontiguousarray(s[name]).view(numpy.uint8).tobytes()


def test_binding_reconnects_and_reclaims(supervisor, tiny):
    """After SIGKILL: calls fail with CONNECT while the daemon is gone; once it is back the next call
    reconnects and reclaims the lease; the set's arrays read the file's bytes throughout."""
    weightd = binding()
    # Without socket activation a daemon that is gone refuses connections at once (with it, the manager's
    # listening socket accepts and a call waits for the daemon to come back, up to the client's timeout).
    s = supervisor(activate=False).start()
    ck = Checkpoint(os.path.join(tiny["a"], "model.safetensors"))
    names = ["layers.0.odd", "layers.0.norm.weight", "layers.0.bias"]

    def check(ws):
        for n in names:
            src, b, e = ck.tensor_bytes(n)
            assert tensor_bytes(ws, n) == bytes(src[b:e]), n

    client = weightd.Client(s.socket)
    ws = client.attach(tiny["a"])
    check(ws)
    lease = [l for l in s.status()["leases"]][0]["lease"]
    s.kill()
    check(ws)  # the mapping outlives the daemon
    with pytest.raises(weightd.Error) as e:
        client.status()
    assert e.value.name in ("CONNECT", "CLOSED"), e.value
    with pytest.raises(weightd.Error) as e:  # still gone: each call tries once, and fails the same way
        client.status()
    assert e.value.name == "CONNECT", e.value
    s.start()
    st = client.status()  # reconnects, reclaims
    assert [(l["lease"], l["recovered"], l["pid"]) for l in st["leases"]] == [(lease, False, os.getpid())]
    assert st["daemon"]["loads"] == 0
    check(ws)
    ws.release()
    assert s.status()["leases"] == []
    client.close()
    s.stop()
