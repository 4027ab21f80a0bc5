"""A stand-in for systemd's side of restart survival, shared by tests/integration/test_restart.py and
tests/gpu/restart.py: the notify socket with its file descriptor store, and a supervisor that starts and
restarts weightd with the stored descriptors passed back (docs/operations.md, "Restarts").

FdStore keeps every descriptor sent with FDSTORE=1 under its FDNAME (one that is the same file as a
stored one is dropped, as systemd does), drops those named by FDSTOREREMOVE=1, and records every
notification. Supervisor passes them back at 3, 4, ... with LISTEN_FDS, LISTEN_PID (the daemon's own
pid: a small exec shim) and LISTEN_FDNAMES, after the listening socket when it plays socket activation,
and announces the store with FDSTORE=<max> as systemd 254+ does.
"""
import os
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

# Puts the descriptors listed in argv[1] (comma-separated) at 3, 4, ... in that
# order, sets LISTEN_PID to this process's pid (or to $WDTEST_LISTEN_PID), and
# execs argv[2:]: the pid the harness started is then the daemon's, as under
# systemd. test_service.py uses it too.
EXEC_WITH_FDS = r"""
import fcntl, os, sys
src = [int(x) for x in sys.argv[1].split(",") if x]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in src]
for fd in src:
    os.close(fd)
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i)
    os.close(fd)
if src:
    os.environ["LISTEN_PID"] = os.environ.pop("WDTEST_LISTEN_PID", str(os.getpid()))
os.execv(sys.argv[2], sys.argv[2:])
"""


def wait_until(pred, timeout=10.0, interval=0.02, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class FdStore:
    """systemd's notify socket with its file descriptor store."""

    def __init__(self, path, max_fds=None):
        """max_fds: FileDescriptorStoreMax=; a descriptor past it is closed and its name recorded in refused,
        as systemd refuses it (EXFULL)."""
        self.path = path
        self.max_fds = max_fds
        self.refused = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.lock = threading.Condition()
        self.fds = []  # [name, fd], in the order stored
        self.messages = []
        self.times = []  # when each message came (time.monotonic)
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
            # Read and apply under the lock, so that drain() never sees a datagram read and not yet applied.
            with self.lock:
                try:
                    data, anc, _, _ = self.sock.recvmsg(65536, room, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                got = []
                for level, kind, payload in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        n = len(payload) // 4
                        got += list(struct.unpack(f"{n}i", payload[: n * 4]))
                fields = dict(line.split("=", 1) for line in data.decode().split("\n") if "=" in line)
                if fields.get("FDSTORE") == "1":
                    for fd in got:
                        if self._same_file(fd):
                            os.close(fd)
                        elif self.max_fds is not None and len(self.fds) >= self.max_fds:
                            self.refused.append(fields.get("FDNAME", "stored"))
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
                self.times.append(time.monotonic())
                self.lock.notify_all()

    def drain(self):
        """Returns once every notification sent so far is applied (systemd reads a dead service's
        notifications before it restarts it)."""
        while True:
            with self.lock:
                r, _, _ = select.select([self.sock], [], [], 0)
                if not r:
                    return
            time.sleep(0.005)

    def names(self):
        with self.lock:
            return sorted(n for n, _ in self.fds)

    def wait_for(self, pred, what, start=0, timeout=60.0):
        deadline = time.monotonic() + timeout
        with self.lock:
            while True:
                for i in range(start, len(self.messages)):
                    if pred(self.messages[i]):
                        self.last_time = self.times[i]
                        return self.messages[i]
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

    def __init__(self, weightd, model_root, config=None, activate=True, backend="host", timeout=60.0,
                 stop_seconds=60.0, fdstore_max=64):
        """activate: pass a listening socket (socket activation); else the daemon binds its own."""
        self.weightd = weightd
        self.backend = backend
        self.timeout = timeout
        self.stop_seconds = stop_seconds
        self.dir = tempfile.mkdtemp(prefix="wdr-")
        self.model_root = model_root
        self.socket = os.path.join(self.dir, "weightd.sock")
        self.listener = None
        if activate:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(self.socket)
            self.listener.listen(64)
        self.fdstore_max = fdstore_max  # announced with FDSTORE= and enforced, as FileDescriptorStoreMax=
        self.store = FdStore(os.path.join(self.dir, "notify"), fdstore_max)
        self.log_path = os.path.join(self.dir, "stderr.log")
        self.config = dict(config or {})
        self.proc = None
        self.starts = 0

    def start(self, extra_env=None):
        self.store.drain()
        with self.store.lock:
            passed = list(self.store.fds)
        fds = ([self.listener.fileno()] if self.listener else []) + [fd for _, fd in passed]
        names = (["weightd.socket"] if self.listener else []) + [n for n, _ in passed]
        args = [self.weightd, "--backend", self.backend, "--model-root", self.model_root, "--socket", self.socket,
                "--set", "metrics_address="]
        for k, v in self.config.items():
            args += ["--set", f"{k}={v}"]
        e = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID",
                                                               "LISTEN_FDNAMES", "FDSTORE")}
        e.update({"NOTIFY_SOCKET": self.store.path, "FDSTORE": str(self.fdstore_max), "LISTEN_FDS": str(len(fds)),
                  "LISTEN_FDNAMES": ":".join(names)})
        e.update(extra_env or {})
        start = len(self.store.messages)
        self.log = open(self.log_path, "ab")
        self.spawned = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", EXEC_WITH_FDS, ",".join(map(str, fds))] + args,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=e,
                                     pass_fds=fds)
        self.starts += 1
        try:
            self.store.wait_for(lambda m: m.get("READY") == "1", "READY=1", start, self.timeout)
            self.ready_at = self.store.last_time  # when READY=1 came (time.monotonic)
        except AssertionError as err:
            raise AssertionError(f"{err}\n{self.log_text()}") from None
        return self

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        # What the dead daemon sent is in the store before kill() returns: a test that edits the store
        # next (a corrupt description) must not race a notification still queued on the socket.
        self.store.drain()

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(self.stop_seconds)
        self.log.close()
        assert rc == 0, self.log_text()

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def fd_count(self, clients=0):
        """The daemon's descriptors once only `clients` connections are open (besides the listening and notify sockets)."""
        wait_until(lambda: sum(t.startswith("socket:") for t in self.fd_targets()) == 2 + clients,
                   timeout=self.timeout, what="the daemon's client connections closed")
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
