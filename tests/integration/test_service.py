"""weightd under a service manager, with a harness that plays systemd's side.

CI has no systemd as PID 1, so the harness provides what systemd would: a
NOTIFY_SOCKET datagram socket that collects every notification (with the
sender's credentials, as systemd checks them for NotifyAccess=main), the
descriptors of socket activation at 3, 4, ... with LISTEN_FDS, LISTEN_PID
(the daemon's own pid: the harness execs it in the process it started) and
LISTEN_FDNAMES, a WATCHDOG_USEC deadline, and JOURNAL_STREAM naming the file
that stands in for the journal. The checks follow docs/operations.md
("Running as a service") and the issue "Service: systemd-native".
"""
import fcntl
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from conftest import REPO, SLOW, STOP_SECONDS, WEIGHTD, DaemonProcess, _failed
from wdclient import Conn, wait_until

from fdstore_harness import EXEC_WITH_FDS  # noqa: E402  (the shim that places LISTEN_FDS descriptors)

STATUS_RE = re.compile(r"^(\d+) set\(s\), (\d+\.\d\d) GiB resident, (\d+) load\(s\) running, (\d+) connection\(s\)$")
TIMESTAMP_RE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z weightd\[(error|warn|info|debug)\]: ")
JOURNAL_RE = re.compile(r"^<([0-7])>weightd\[(error|warn|info|debug)\]: ")
SEVERITY = {"error": 3, "warn": 4, "info": 6, "debug": 7}
# The interval at which STATUS= is refreshed (main.c).
STATUS_INTERVAL = 2.0
HAVE_NVIDIA_NODES = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))


def monotonic_usec():
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


# ---- systemd's side ----------------------------------------------------------------------


class NotifySocket:
    """A NOTIFY_SOCKET: every datagram, with the time it came and its sender's pid.

    messages is a list of (monotonic seconds, sender pid, {KEY: VALUE}, raw text).
    on_ready, when set, runs in the reader thread as soon as a READY=1 arrives,
    before anything else is read: what it sees is the state at READY.
    """

    def __init__(self, path, on_ready=None):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.messages = []
        self.cond = threading.Condition()
        self.on_ready = on_ready
        self.ready_probe = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        cmsg_room = socket.CMSG_SPACE(253 * 4) + socket.CMSG_SPACE(struct.calcsize("3i"))
        while not self.stopping:
            r, _, _ = select.select([self.sock], [], [], 0.05)
            if not r:
                continue
            data, anc, _, _ = self.sock.recvmsg(65536, cmsg_room)
            pid = None
            for level, kind, payload in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", payload[:12])[0]
                elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    n = len(payload) // 4
                    for fd in struct.unpack(f"{n}i", payload[: n * 4]):
                        os.close(fd)
            text = data.decode()
            fields = {}
            for line in text.split("\n"):
                if "=" in line:
                    k, v = line.split("=", 1)
                    fields[k] = v
            if fields.get("READY") == "1" and self.on_ready is not None and self.ready_probe is None:
                self.ready_probe = self.on_ready()
            with self.cond:
                self.messages.append((time.monotonic(), pid, fields, text))
                self.cond.notify_all()

    def snapshot(self):
        with self.cond:
            return list(self.messages)

    def wait_for(self, pred, timeout, after=0, what="a notification"):
        """The index and fields of the first message from index `after` on for which pred(fields) holds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for i in range(after, len(self.messages)):
                    if pred(self.messages[i][2]):
                        return i, self.messages[i][2]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout:.1f} s; got {[m[3] for m in self.messages]}")
                self.cond.wait(left)

    def close(self):
        self.stopping = True
        self.thread.join(5)
        self.sock.close()


class Service(DaemonProcess):
    """One weightd started as systemd would start it (see the module's docstring).

    The directory is short (a socket path holds 108 bytes) and private to the
    test; stderr (and stdout) go to self.log_path, which stands in for the
    journal or a terminal.
    """

    def __init__(self, model_root):
        self.dir = tempfile.mkdtemp(prefix="wds-")
        self.model_root = model_root
        self.socket = os.path.join(self.dir, "weightd.sock")
        self.log_path = os.path.join(self.dir, "stderr.log")
        self.notify = None
        self.proc = None
        self.owned = []  # descriptors and sockets the harness holds

    # ---- what is passed ----

    def listener(self, name="weightd.sock", listen=True, kind=socket.SOCK_STREAM):
        """A Unix socket bound in the service's directory (listening unless told not to)."""
        path = os.path.join(self.dir, name)
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(path)
        if listen:
            s.listen(16)
        self.owned.append(s)
        return s, path

    def pipe(self):
        r, w = os.pipe()
        self.owned += [r, w]
        return r, w

    def default_args(self, socket_path=None, backend="host", roots=True):
        a = ["--socket", socket_path or self.socket]
        if backend:
            a += ["--backend", backend]
        if roots:
            a += ["--model-root", self.model_root]
        return a

    def start(self, args, *, notify=True, foreground=False, fds=(), names=None, watchdog_usec=None,
              watchdog_pid=None, journal=False, env=None, wait_ready=True, timeout=None, on_ready=None):
        """Starts weightd with args (after the binary); fds are passed at 3, 4, ... named by names.

        on_ready runs in the notify reader the moment READY=1 arrives (see NotifySocket).
        """
        argv = [WEIGHTD] + (["--foreground"] if foreground else []) + list(args)
        e = dict(os.environ)
        for k in ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID",
                  "JOURNAL_STREAM", "WEIGHTD_SOCKET"):
            e.pop(k, None)
        asan = e.get("ASAN_OPTIONS", "")
        if "detect_leaks" not in asan:
            e["ASAN_OPTIONS"] = (asan + ":" if asan else "") + "detect_leaks=1"
        e.setdefault("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        if notify:
            self.notify = NotifySocket(os.path.join(self.dir, "notify"), on_ready)
            e["NOTIFY_SOCKET"] = self.notify.path
        if watchdog_usec is not None:
            e["WATCHDOG_USEC"] = str(watchdog_usec)
        if watchdog_pid is not None:
            e["WATCHDOG_PID"] = str(watchdog_pid)
        fds = [f if isinstance(f, int) else f.fileno() for f in fds]
        if fds:
            e["LISTEN_FDS"] = str(len(fds))
            if names is not None:
                e["LISTEN_FDNAMES"] = ":".join(names)
        self.log = open(self.log_path, "ab")
        if journal:
            st = os.fstat(self.log.fileno())
            e["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        e.update(env or {})
        self.proc = subprocess.Popen([sys.executable, "-c", EXEC_WITH_FDS, ",".join(map(str, fds))] + argv,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=e,
                                     pass_fds=fds)
        if notify and wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout=None, after=0):
        timeout = timeout or 20 * SLOW
        try:
            return self.notify.wait_for(lambda m: m.get("READY") == "1", timeout, after, "READY=1")
        except AssertionError as e:
            raise AssertionError(f"{e}\nweightd (status {self.proc.poll()}):\n{self.log_text()}") from None

    def log_lines(self):
        return self.log_text().splitlines()

    def wait_log(self, text, timeout=None, source=None):
        source = source or self.log_text
        wait_until(lambda: text in source(), timeout=timeout or 10 * SLOW, what=f"'{text}' in the log")

    def connect(self, path=None, hello=True):
        return Conn(path or self.socket, hello=hello, timeout=30 * SLOW)

    def status(self, path=None):
        with self.connect(path) as c:
            return c.status()

    def hup(self, timeout=None):
        """SIGHUP; waits for RELOADING=1 and the READY=1 after it; returns the RELOADING fields."""
        timeout = timeout or 20 * SLOW
        start = len(self.notify.snapshot())
        self.proc.send_signal(signal.SIGHUP)
        i, reloading = self.notify.wait_for(lambda m: m.get("RELOADING") == "1", timeout, start, "RELOADING=1")
        self.notify.wait_for(lambda m: m.get("READY") == "1", timeout, i + 1, "READY=1 after RELOADING=1")
        return reloading

    def stop(self, sig=signal.SIGTERM, expect=0):
        """Signals the daemon; it must exit with expect, in time, without a sanitizer report."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"weightd did not exit within {STOP_SECONDS} s of signal {sig}:\n{self.log_text()}")
        assert rc == expect, f"weightd exited with {rc}, expected {expect}:\n{self.log_text()}"
        assert not self.sanitizer_report(), f"sanitizer report:\n{self.log_text()}"
        return rc

    def notifications_from_main_pid(self):
        """Every notification came from the started process (NotifyAccess=main)."""
        msgs = self.notify.snapshot()
        assert all(m[1] == self.pid for m in msgs), [(m[1], m[3]) for m in msgs]
        return msgs

    def cleanup(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.notify is not None:
            self.notify.close()
        for o in self.owned:
            try:
                o.close() if hasattr(o, "close") else os.close(o)
            except OSError:
                pass
        if getattr(self, "log", None) is not None:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def service(model_root, binaries, request):
    """A factory: service() -> a Service not yet started; each is killed and removed at the end."""
    made = []

    def make():
        s = Service(model_root)
        made.append(s)
        return s

    yield make
    failed = _failed(request)
    for s in made:
        if failed and s.proc is not None:
            print(f"---- stderr of weightd (pid {s.pid}) ----\n{s.log_text()[-12000:]}")
            if s.notify is not None:
                print("---- notifications ----\n" + "\n".join(repr(m[3]) for m in s.notify.snapshot()))
        s.cleanup()


def write_config(path, cfg):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        if isinstance(cfg, str):
            f.write(cfg)
        else:
            json.dump(cfg, f)
    os.replace(tmp, path)


def status_fields(line):
    m = STATUS_RE.match(line)
    assert m, f"STATUS={line!r} is not the documented form"
    return {"sets": int(m.group(1)), "gib": float(m.group(2)), "loads": int(m.group(3)),
            "connections": int(m.group(4))}


# ---- readiness --------------------------------------------------------------------------


def test_ready_only_once_listening(service):
    """READY=1 comes once, after the socket accepts: a connect made the moment it
    arrives succeeds. A STATUS= line a person can read comes before it."""
    s = service()

    def probe():
        # What is true the moment READY=1 arrives: the start-up line (logged once
        # the backend is up and the socket listens) is out, and a connect succeeds.
        if "listening on " + s.socket not in s.log_text():
            return "READY=1 before the start-up line"
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            c.connect(s.socket)
            return "connected"
        except OSError as e:
            return f"connect failed: {e}"
        finally:
            c.close()

    s.start(s.default_args(), wait_ready=False, on_ready=probe)
    i, _ = s.wait_ready()
    assert s.notify.ready_probe == "connected", s.notify.ready_probe
    msgs = s.notifications_from_main_pid()
    before = [m[2] for m in msgs[:i]]
    assert not any("READY" in m for m in before), before
    statuses = [m["STATUS"] for m in before if "STATUS" in m]
    assert statuses, f"no STATUS= before READY=1: {[m[3] for m in msgs]}"
    assert status_fields(statuses[-1]) == {"sets": 0, "gib": 0.0, "loads": 0, "connections": 0}
    st = s.status()
    assert st["daemon"]["pid"] == s.pid
    time.sleep(0.3)
    assert sum(1 for m in s.notify.snapshot() if m[2].get("READY") == "1") == 1
    s.stop()


def test_no_ready_when_start_fails(service):
    """A daemon that cannot start (here: its socket's directory does not exist) never says READY=1 and exits 1."""
    s = service()
    s.start(s.default_args(socket_path=os.path.join(s.dir, "missing", "weightd.sock")), wait_ready=False)
    assert s.proc.wait(20 * SLOW) == 1, s.log_text()
    time.sleep(0.2)
    assert not any("READY" in m[2] for m in s.notify.snapshot()), s.notify.snapshot()
    assert "cannot start" in s.log_text()
    assert not s.sanitizer_report(), s.log_text()


def test_never_forks_under_notify_socket(service):
    """Without --foreground but with NOTIFY_SOCKET the daemon does not detach: the
    process the harness started is the daemon, and it sends the notifications."""
    s = service()
    s.start(s.default_args())
    time.sleep(0.2)
    assert s.proc.poll() is None, f"the started process exited ({s.proc.returncode}): it forked\n{s.log_text()}"
    assert s.status()["daemon"]["pid"] == s.pid
    s.notifications_from_main_pid()
    s.stop()


def test_status_lines_follow_state(service, tiny):
    """STATUS= says sets, GiB resident, loads running and connections; it follows
    a load and a client leaving within a few 2 s refreshes, and is not resent unchanged."""
    s = service()
    s.start(s.default_args())
    c = s.connect()
    rep = c.call("load", path=tiny["a"])
    assert rep["bytes"] > 0
    # Refreshed every 2 s: "1 set(s)" with our connection within a few refreshes.
    i, m = s.notify.wait_for(lambda m: m.get("STATUS", "").startswith("1 set(s)"), 3 * STATUS_INTERVAL * SLOW + 2,
                             what="STATUS=1 set(s)")
    f = status_fields(m["STATUS"])
    assert f["loads"] == 0 and f["connections"] == 1, m
    c.close()
    s.notify.wait_for(lambda m: m.get("STATUS", "").endswith(" 0 connection(s)"), 3 * STATUS_INTERVAL * SLOW + 2,
                      after=i + 1, what="STATUS with 0 connections after the client left")
    # An unchanged line is not sent again.
    before = len([m for m in s.notify.snapshot() if "STATUS" in m[2]])
    time.sleep(2 * STATUS_INTERVAL + 0.5)
    assert len([m for m in s.notify.snapshot() if "STATUS" in m[2]]) == before
    s.stop()


# ---- the watchdog -------------------------------------------------------------------------


def test_watchdog_pings_at_half_the_interval(service):
    """WATCHDOG_USEC=400000: WATCHDOG=1 again and again from the main pid, and the daemon keeps serving.

    How often is left to the clock: the counts and gaps a loaded (or sanitizer) machine
    produces say nothing about the daemon. What a bug changes: no pings at all (the variable
    not parsed, or the timer not started), pings from another pid, or pings that stop.
    """
    s = service()
    s.start(s.default_args(), watchdog_usec=400000)
    t0 = time.monotonic()

    def pings():
        return [m for m in s.notifications_from_main_pid() if m[2].get("WATCHDOG") == "1" and m[0] >= t0]

    wait_until(lambda: len(pings()) >= 3, timeout=60 * SLOW, what="three watchdog pings")
    seen = len(pings())
    s.status()  # the loop answers between pings
    wait_until(lambda: len(pings()) > seen, timeout=60 * SLOW, what="the pings to go on after a call")
    s.stop()


def test_watchdog_only_for_this_process(service):
    """WATCHDOG_PID naming another process means the watchdog is not ours: no pings."""
    s = service()
    s.start(s.default_args(), watchdog_usec=200000, watchdog_pid=os.getpid())
    time.sleep(1.0)
    assert not any("WATCHDOG" in m[2] for m in s.notify.snapshot())
    s.stop()


# ---- reload ---------------------------------------------------------------------------------


def test_reload_notifications(service):
    """SIGHUP: RELOADING=1 with MONOTONIC_USEC (now, on CLOCK_MONOTONIC) in one datagram, then READY=1."""
    s = service()
    s.start(s.default_args())
    for _ in range(2):
        t_before = monotonic_usec()
        m = s.hup()
        t_after = monotonic_usec()
        assert "MONOTONIC_USEC" in m, m
        assert t_before <= int(m["MONOTONIC_USEC"]) <= t_after, (t_before, m, t_after)
        assert s.status()["daemon"]["pid"] == s.pid
    s.notifications_from_main_pid()
    s.stop()


def reload_config(s, cfg):
    path = os.path.join(s.dir, "weightd.json")
    write_config(path, cfg)
    return ["--config", path, "--socket", s.socket, "--backend", "host"]


def debug_lines(text):
    return [l for l in text.splitlines() if "weightd[debug]" in l]


def test_reload_budget_and_log_level(service, tiny):
    """A reload that shrinks device_memory_budget evicts the unleased set and keeps
    the leased one, its lease and its connection; log_level debug takes effect;
    new requests follow the new budget."""
    s = service()
    cfg = {"model_roots": [s.model_root], "log_level": "info", "device_memory_budget": "1GiB"}
    s.start(reload_config(s, cfg))
    holder = s.connect()
    la = holder.call("load", path=tiny["a"])
    att, fd = holder.attach(path=tiny["b"], device=0)
    os.close(fd)
    size = la["bytes"]
    assert len(s.status()["sets"]) == 2
    assert not debug_lines(s.log_text())
    cfg.update(device_memory_budget=str(size + size // 2), log_level="debug")
    write_config(os.path.join(s.dir, "weightd.json"), cfg)
    s.hup()
    log = s.log_text()
    assert "reload: 'device_memory_budget' changed" in log and "reload: 'log_level' changed" in log, log
    assert "reload: evicted 1 unleased set(s) to fit device_memory_budget" in log, log
    assert "reload: 2 key(s) applied, 0 kept until a restart" in log, log
    st = holder.status()  # the connection made before the reload is still served
    assert [x["set"] for x in st["sets"]] == [att["set"]], st["sets"]
    assert st["sets"][0]["leases"] == 1
    with s.connect() as c:
        assert c.error("load", path=tiny["a"]) == "DEVICE_NOMEM"
    wait_until(lambda: any("connection from pid" in l for l in debug_lines(s.log_text())), timeout=5 * SLOW,
               what="a debug line after the reload")
    holder.call("release", lease=att["lease"])
    holder.close()
    s.stop()


def test_reload_model_roots(service, tiny, outside_dir):
    """New model roots apply to new requests that name a path (an open checkpoint
    included); resident sets stay, and attaching one by its id still works."""
    s = service()
    cfg = {"model_roots": [s.model_root]}
    s.start(reload_config(s, cfg))
    holder = s.connect()
    sa = holder.call("load", path=tiny["a"])["set"]
    outside = os.path.join(outside_dir, "secret.safetensors")
    with s.connect() as c:
        assert c.error("load", path=outside) == "PATH_DENIED"
    cfg["model_roots"] = [outside_dir]
    write_config(os.path.join(s.dir, "weightd.json"), cfg)
    s.hup()
    with s.connect() as c:
        assert c.error("load", path=tiny["a"]) == "PATH_DENIED"
        att, fd = c.attach(set=sa)
        os.close(fd)
        c.call("release", lease=att["lease"])
        assert c.call("load", path=outside)["bytes"] > 0
    assert sorted(x["path"] for x in holder.status()["sets"]) == sorted([tiny["a"], outside])
    holder.close()
    s.stop()


@pytest.mark.parametrize("broken,why", [
    ('{"log_level": "debug", ', "weightd.json:1:24: unexpected end of input in object"),
    ({"log_level": "debug", "bogus_key": 1}, "unknown key 'bogus_key'"),
    ({"log_level": "debug", "job_threads": 0}, "config 'job_threads': '0' is not an integer between 1 and 256"),
])
def test_reload_broken_config_keeps_the_old_one(service, tiny, broken, why):
    s = service()
    cfg = {"model_roots": [s.model_root], "log_level": "info"}
    s.start(reload_config(s, cfg))
    holder = s.connect()
    holder.call("load", path=tiny["a"])
    write_config(os.path.join(s.dir, "weightd.json"), broken)
    s.hup()
    log = s.log_text()
    lines = [l for l in log.splitlines() if "reload failed, the running configuration is kept" in l]
    assert len(lines) == 1 and why in lines[0] and "weightd[warn]" in lines[0], log
    # Still serving, sets kept, the old log level kept (no debug line for a new connection).
    assert s.status()["daemon"]["pid"] == s.pid
    assert len(holder.status()["sets"]) == 1
    assert not debug_lines(s.log_text()), debug_lines(s.log_text())
    # A good file applies at the next reload.
    cfg["log_level"] = "debug"
    write_config(os.path.join(s.dir, "weightd.json"), cfg)
    s.hup()
    s.status()
    assert debug_lines(s.log_text())
    holder.close()
    s.stop()


def test_reload_reports_keys_it_keeps(service):
    """A key that is not reloadable (job_threads) keeps its running value, with a warning."""
    s = service()
    cfg = {"model_roots": [s.model_root], "job_threads": 4}
    s.start(reload_config(s, cfg))
    threads = len(os.listdir(f"/proc/{s.pid}/task"))
    cfg["job_threads"] = 2
    write_config(os.path.join(s.dir, "weightd.json"), cfg)
    s.hup()
    log = s.log_text()
    assert re.search(r"weightd\[warn\]: reload: 'job_threads' changed, but only a restart applies it: "
                     r"the running value is kept", log), log
    assert "reload: 0 key(s) applied, 1 kept until a restart" in log, log
    assert len(os.listdir(f"/proc/{s.pid}/task")) == threads
    s.stop()


# ---- stopping ---------------------------------------------------------------------------------


def test_sigterm_stopping_and_the_passed_socket_survives(service):
    """SIGTERM: STOPPING=1, exit 0; the socket passed at start is served, and is
    neither unlinked nor shut down (systemd keeps it for the next start)."""
    s = service()
    lsock, path = s.listener("passed.sock")
    s.start(s.default_args(socket_path=os.path.join(s.dir, "own.sock")), fds=[lsock], names=["weightd.socket"])
    assert s.status(path)["daemon"]["pid"] == s.pid
    assert "serving the socket passed at start" in s.log_text()
    assert not os.path.exists(os.path.join(s.dir, "own.sock")), "the daemon bound a socket of its own"
    n = len(s.notify.snapshot())
    s.stop()
    s.notify.wait_for(lambda m: m.get("STOPPING") == "1", 2, after=n, what="STOPPING=1")
    s.notifications_from_main_pid()
    assert os.path.exists(path), "the passed socket was unlinked"
    # Still listening: a new client is accepted by the harness, which holds it.
    lsock.settimeout(5)
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(path)
    a, _ = lsock.accept()
    a.close()
    c.close()
    assert lsock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1


def pipe_inode(fd):
    return f"pipe:[{os.fstat(fd).st_ino}]"


def test_fdnames_pick_the_named_socket(service):
    """LISTEN_FDNAMES names each descriptor: the one named weightd.socket is served,
    wherever it is in the list, and the others are closed."""
    s = service()
    r, _ = s.pipe()
    lsock, path = s.listener("passed.sock")
    s.start(s.default_args(socket_path=os.path.join(s.dir, "own.sock")), fds=[r, lsock],
            names=["other", "weightd.socket"])
    assert s.status(path)["daemon"]["pid"] == s.pid
    assert "closing descriptor 3 ('other') passed at start" in s.log_text()
    targets = s.fd_targets()
    assert pipe_inode(r) not in targets.values(), targets
    assert 4 in targets and targets[4].startswith("socket:"), targets
    assert not os.path.exists(os.path.join(s.dir, "own.sock"))
    s.stop()
    assert os.path.exists(path)


def test_socket_fd_name_is_configurable(service):
    """socket_fd_name picks another name; a socket with the default name is then not ours."""
    s = service()
    first, first_path = s.listener("first.sock")
    second, second_path = s.listener("second.sock")
    s.start(s.default_args() + ["--set", "socket_fd_name=engines"], fds=[first, second],
            names=["weightd.socket", "engines"])
    assert s.status(second_path)["daemon"]["pid"] == s.pid
    assert "closing descriptor 3 ('weightd.socket') passed at start" in s.log_text()
    s.stop()


def test_descriptors_for_another_pid_are_left_alone(service):
    """LISTEN_PID names another process: the descriptors are not the daemon's to
    take or close (they stay open), and it binds its own socket."""
    s = service()
    lsock, path = s.listener("passed.sock")
    s.start(s.default_args(), fds=[lsock], names=["weightd.socket"], env={"WDTEST_LISTEN_PID": "1"})
    assert f"socket:[{os.fstat(lsock.fileno()).st_ino}]" in s.fd_targets().values()
    log = s.log_text()
    assert "listening on " + s.socket in log and "passed at start" not in log, log
    assert s.status()["daemon"]["pid"] == s.pid
    s.stop()


@pytest.mark.parametrize("kind", ["pipe", "unlistened", "datagram", "tcp"])
def test_passed_descriptor_that_is_no_listening_unix_socket(service, kind):
    """A descriptor named weightd.socket that is not a listening Unix stream socket
    is ignored with a warning (and closed); the daemon binds its own socket."""
    s = service()
    if kind == "pipe":
        fd, _ = s.pipe()
    elif kind == "unlistened":
        fd, _ = s.listener("unlistened.sock", listen=False)
    elif kind == "datagram":
        fd, _ = s.listener("dgram.sock", listen=False, kind=socket.SOCK_DGRAM)
    else:
        fd = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        fd.bind(("127.0.0.1", 0))
        fd.listen(4)
        s.owned.append(fd)
    s.start(s.default_args(), fds=[fd], names=["weightd.socket"])
    log = s.log_text()
    assert re.search(r"weightd\[warn\]: descriptor 3 \('weightd.socket'\) passed at start is not a listening Unix "
                     r"stream socket: ignored", log), log
    assert "closing descriptor 3 ('weightd.socket') passed at start" in log, log
    assert "listening on " + s.socket in log
    assert s.status()["daemon"]["pid"] == s.pid
    fileno = fd if isinstance(fd, int) else fd.fileno()
    ours = f"{'pipe' if kind == 'pipe' else 'socket'}:[{os.fstat(fileno).st_ino}]"
    assert ours not in s.fd_targets().values(), "the ignored descriptor was kept open"
    s.stop()
    assert not os.path.exists(s.socket), "the daemon's own socket was left behind"


# ---- logging ---------------------------------------------------------------------------------


def test_journald_priority_prefixes(service, tiny):
    """With JOURNAL_STREAM naming stderr, every line starts with "<N>", N the
    syslog severity of its level; backend auto without NVIDIA device nodes is a
    warning ("<4>"), never an info line."""
    s = service()
    backend = "host" if HAVE_NVIDIA_NODES else None
    s.start(s.default_args(backend=backend) + ["--log-level", "debug"], notify=False, foreground=True,
            journal=True)
    s.wait_log("logging to journald")
    with s.connect() as c:
        c.call("load", path=tiny["a"])
    s.stop()
    lines = s.log_lines()
    assert lines
    for line in lines:
        m = JOURNAL_RE.match(line)
        assert m, f"a line without its priority prefix: {line!r}\n{s.log_text()}"
        assert int(m.group(1)) == SEVERITY[m.group(2)], line
    assert any(l.startswith("<6>weightd[info]: stopped") for l in lines), lines
    assert any(l.startswith("<7>weightd[debug]: connection from pid") for l in lines), lines
    if not HAVE_NVIDIA_NODES:
        assert [l for l in lines if "backend auto" in l] == [
            l for l in lines if l.startswith("<4>weightd[warn]: backend auto: no NVIDIA device nodes")], lines
        assert any("backend auto" in l for l in lines), lines


@pytest.mark.parametrize("journal_stream", [None, "0:0"])
def test_timestamps_without_journald(service, journal_stream):
    """Without JOURNAL_STREAM, or with one that names another file, lines carry a timestamp and no prefix."""
    s = service()
    env = {"JOURNAL_STREAM": journal_stream} if journal_stream else {}
    s.start(s.default_args(backend=None), notify=False, foreground=True, env=env)
    s.wait_log("weightd: listening on " + s.socket)
    s.stop()
    lines = [l for l in s.log_lines() if l != "weightd: listening on " + s.socket]
    assert lines
    for line in lines:
        assert TIMESTAMP_RE.match(line), f"{line!r}\n{s.log_text()}"
    if not HAVE_NVIDIA_NODES:
        assert any(re.search(r"weightd\[warn\]: backend auto: no NVIDIA device nodes", l) for l in lines), lines


def test_log_file_and_rotation(service):
    """log_file: lines go to the file; after it is renamed, SIGHUP reopens it by name."""
    s = service()
    log_file = os.path.join(s.dir, "weightd.log")
    s.start(s.default_args() + ["--set", "log_file=" + log_file])
    read = lambda p: open(p).read() if os.path.exists(p) else ""  # noqa: E731
    assert "logging to file" in read(log_file)
    assert all(TIMESTAMP_RE.match(l) for l in read(log_file).splitlines())
    assert "weightd[" not in s.log_text(), "log lines went to stderr as well"
    os.rename(log_file, log_file + ".1")
    s.hup()
    assert "SIGHUP: reloading" in read(log_file + ".1")
    assert os.path.exists(log_file), "SIGHUP did not reopen the log file"
    s.hup()
    assert "SIGHUP: reloading" in read(log_file)
    s.stop()
    assert "stopped" in read(log_file) and "stopped" not in read(log_file + ".1")


def test_log_file_fifo_without_reader_is_refused_at_start(service):
    """A log_file that is a FIFO nobody reads is refused at once with the reason.
    Before: the daemon opened it blocking and waited for a reader forever."""
    s = service()
    fifo = os.path.join(s.dir, "log.fifo")
    os.mkfifo(fifo)
    s.start(s.default_args() + ["--set", "log_file=" + fifo], wait_ready=False)
    try:
        rc = s.proc.wait(20 * SLOW)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"weightd hangs opening a FIFO with no reader:\n{s.log_text()}") from None
    assert rc == 1, s.log_text()
    assert f"weightd: log_file {fifo}: a FIFO with no reader" in s.log_text(), s.log_text()


def test_log_file_that_is_a_device_is_refused(service):
    """A log_file that is neither a regular file nor a FIFO (here a character device) is refused."""
    s = service()
    s.start(s.default_args() + ["--set", "log_file=/dev/null"], wait_ready=False)
    assert s.proc.wait(20 * SLOW) == 1, s.log_text()
    assert "weightd: log_file /dev/null: a character device, not a regular file or a FIFO" in s.log_text(), \
        s.log_text()


def test_reload_to_a_fifo_without_reader_keeps_serving(service):
    """SIGHUP with log_file now a FIFO with no reader: the reload says so, logging stays in the
    old file and the daemon serves on. Before: the reload blocked the event loop in open()."""
    s = service()
    old = os.path.join(s.dir, "weightd.log")
    fifo = os.path.join(s.dir, "log.fifo")
    os.mkfifo(fifo)
    cfg = {"model_roots": [s.model_root], "log_file": old}
    s.start(reload_config(s, cfg))
    cfg["log_file"] = fifo
    write_config(os.path.join(s.dir, "weightd.json"), cfg)
    s.hup()
    assert s.status()["daemon"]["pid"] == s.pid
    text = open(old).read()
    assert f"log_file {fifo}: a FIFO with no reader" in text and "logging stays where it was (file)" in text, text
    s.stop()
    assert "stopped" in open(old).read()


def test_log_file_fifo_whose_reader_stops_reading(service):
    """A FIFO with a reader is a log_file; when the reader stops reading and the pipe is full,
    lines are dropped and the daemon serves on. Before: a full pipe blocked the event loop."""
    s = service()
    fifo = os.path.join(s.dir, "log.fifo")
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    s.owned.append(reader)
    fcntl.fcntl(reader, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)  # one page: quick to fill
    s.start(s.default_args() + ["--set", "log_file=" + fifo, "--log-level", "debug"])
    first = os.read(reader, 65536).decode()
    assert "logging to file" in first, first
    # Each connection logs debug lines; never read, the page fills after a few dozen.
    for _ in range(200):
        assert s.status()["daemon"]["pid"] == s.pid
    s.stop()


def wait_gone(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def detached_env(s):
    """The environment of a daemon started by hand: no service manager, no journal; sanitizer
    reports of the detached daemon go to files, not to the terminal it left."""
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    env.pop("JOURNAL_STREAM", None)
    env["ASAN_OPTIONS"] = env.get("ASAN_OPTIONS", "detect_leaks=1") + ":log_path=" + os.path.join(s.dir, "asan")
    env["UBSAN_OPTIONS"] = env.get("UBSAN_OPTIONS", "print_stacktrace=1") + ":log_path=" + os.path.join(s.dir, "ubsan")
    return env


class SyslogSocket:
    """A syslog daemon's datagram socket: every datagram it gets, as text."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.path = path

    def text(self):
        out = []
        while True:
            r, _, _ = select.select([self.sock], [], [], 0)
            if not r:
                return "\n".join(out)
            out.append(self.sock.recv(65536).decode(errors="replace"))

    def close(self):
        self.sock.close()


@pytest.mark.parametrize("with_log_file", [True, False])
def test_detached_never_writes_to_the_terminal(service, with_log_file):
    """Detached (no --foreground, no NOTIFY_SOCKET): the starting command exits 0
    once the socket is ready, and the daemon keeps no descriptor of the terminal
    (here a pipe, which reaches end-of-file): its lines go to log_file, else syslog
    (here a syslog socket of the test's, so that the run does not depend on /dev/log)."""
    s = service()
    log_file = os.path.join(s.dir, "weightd.log")
    syslog = SyslogSocket(os.path.join(s.dir, "syslog"))
    s.owned.append(syslog)
    args = s.default_args() + ["--set", "syslog_socket=" + syslog.path]
    args += ["--set", "log_file=" + log_file] if with_log_file else []
    env = detached_env(s)
    p = subprocess.Popen([WEIGHTD] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=env)
    pid = None
    try:
        assert p.wait(20 * SLOW) == 0
        out = b""
        deadline = time.monotonic() + 5 * SLOW
        eof = False
        while time.monotonic() < deadline:
            r, _, _ = select.select([p.stdout], [], [], 0.1)
            if r:
                chunk = os.read(p.stdout.fileno(), 65536)
                if not chunk:
                    eof = True
                    break
                out += chunk
        pid = s.status()["daemon"]["pid"]
        assert pid != p.pid
        assert eof, f"the detached daemon (pid {pid}) still holds the terminal's descriptors: {out!r}"
        assert b"weightd[" not in out, out
        if with_log_file:
            text = open(log_file).read()
            assert "logging to file" in text, text
        else:
            text = syslog.text()
            assert re.search(rf"^<30>weightd\[{pid}\]: weightd .* logging to syslog$", text, re.M), text
        os.kill(pid, signal.SIGTERM)
        assert wait_gone(pid, STOP_SECONDS), f"pid {pid} did not exit"
        if with_log_file:
            assert "stopped" in open(log_file).read()
        else:
            assert f"<30>weightd[{pid}]: stopped" in syslog.text()
        reports = [f for f in os.listdir(s.dir) if f.startswith(("asan", "ubsan"))]
        assert not reports, [open(os.path.join(s.dir, f)).read() for f in reports]
        assert not os.path.exists(s.socket)
    finally:
        p.stdout.close()
        if p.poll() is None:
            p.kill()
            p.wait()
        if pid is not None:  # the detached daemon is not our child: leave nothing running
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_detached_without_syslog_logs_to_stderr_and_says_so(service):
    """Detached with no syslog socket to reach (a container without /dev/log) and no log_file:
    the daemon says so on stderr before it detaches, keeps stderr as its log (stdout is let
    go), and its lines, through the stop, go there. Before: they went nowhere."""
    s = service()
    missing = os.path.join(s.dir, "no-syslog")
    args = s.default_args() + ["--set", "syslog_socket=" + missing]
    err_path = os.path.join(s.dir, "stderr.txt")
    with open(err_path, "wb") as err:
        p = subprocess.Popen([WEIGHTD] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                             env=detached_env(s))
    pid = None
    try:
        assert p.wait(20 * SLOW) == 0, open(err_path).read()
        pid = s.status()["daemon"]["pid"]
        r, _, _ = select.select([p.stdout], [], [], 5 * SLOW)
        assert r and os.read(p.stdout.fileno(), 65536) == b"", "the detached daemon kept stdout"
        text = open(err_path).read()
        why = f"the syslog socket {missing} cannot be reached: No such file or directory"
        assert f"weightd: {why}: logging to stderr, which the detached daemon keeps open" in text, text
        assert re.search(rf"weightd\[info\]: weightd .* logging to stderr \({re.escape(why)}\)$", text, re.M), text
        os.kill(pid, signal.SIGTERM)
        assert wait_gone(pid, STOP_SECONDS), f"pid {pid} did not exit"
        assert TIMESTAMP_RE.match(open(err_path).read().splitlines()[-1]) and \
            open(err_path).read().splitlines()[-1].endswith("weightd[info]: stopped"), open(err_path).read()
    finally:
        p.stdout.close()
        if p.poll() is None:
            p.kill()
            p.wait()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the shipped configurations --------------------------------------------------------------


def config_keys():
    """The keys of the config table, from weightd --help."""
    out = subprocess.run([WEIGHTD, "--help"], capture_output=True, text=True, timeout=30).stdout
    keys = re.findall(r"^  ([a-z_]+)\s+default ", out, re.M)
    assert len(keys) > 20, out
    return keys


@pytest.mark.parametrize("name", ["weightd.json.example", "weightd.json"])
def test_shipped_configs_start(service, name):
    """systemd/weightd.json.example (every key) and the installed weightd.json are
    configurations the daemon accepts; only the host paths are changed here (the
    socket and the model roots, which must exist), and the backend forced to host."""
    with open(os.path.join(REPO, "systemd", name)) as f:
        cfg = json.load(f)
    if name.endswith(".example"):
        assert sorted(cfg) == sorted(config_keys()), "the example does not have every key"
    s = service()
    assert "model_roots" in cfg and "socket" in cfg
    cfg["model_roots"] = [s.model_root]
    cfg["socket"] = s.socket
    if cfg.get("log_file"):
        cfg["log_file"] = os.path.join(s.dir, "weightd.log")
    path = os.path.join(s.dir, name)
    write_config(path, cfg)
    s.start(["--config", path, "--backend", "host"])
    assert s.status()["daemon"]["pid"] == s.pid
    s.stop()
