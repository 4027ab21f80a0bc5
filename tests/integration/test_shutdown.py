"""Stopping the daemon: the shutdown op, SIGTERM during a load, SIGINT."""
import os
import signal
import subprocess
import time

from conftest import SLOW, STOP_SECONDS, WEIGHTCTL
from wdclient import Closed, Conn


def frames_until_eof(c, timeout):
    c.settimeout(timeout)
    got = []
    try:
        while True:
            got.append(c.recv_msg())
    except Closed:
        return got


def test_shutdown_op(daemon, tiny):
    attached = daemon.connect()
    att, fd = attached.attach(path=tiny["a"], device=0)
    os.close(fd)
    idle = daemon.connect()
    with daemon.connect() as c:
        t0 = time.monotonic()
        rep = c.call("shutdown")
        assert rep["stopping"] is True
        rest = frames_until_eof(c, STOP_SECONDS)
        assert all(m.get("event") == "shutdown" for m in rest), rest
    for other in (attached, idle):
        got = frames_until_eof(other, STOP_SECONDS)
        assert [m.get("event") for m in got] == ["shutdown"], got
        assert "id" not in got[0]
        other.close()
    rc = daemon.wait_exit(STOP_SECONDS)
    assert rc is not None, f"weightd still runs {STOP_SECONDS} s after shutdown:\n{daemon.log_tail()}"
    assert time.monotonic() - t0 < STOP_SECONDS
    daemon.check_exit(0)
    assert not os.path.exists(daemon.socket), "the socket file was left behind"
    assert "shutdown requested by pid" in daemon.log_text()


def test_weightctl_shutdown(daemon):
    r = subprocess.run([WEIGHTCTL, "--socket", daemon.socket, "shutdown"], capture_output=True, text=True,
                       timeout=30 * SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert daemon.wait_exit(STOP_SECONDS) is not None, daemon.log_tail()
    daemon.check_exit(0)
    assert not os.path.exists(daemon.socket)


def test_sigterm_during_load(start_daemon, ckpt_sharded):
    d = start_daemon({"fill_threads": 1})
    c = d.connect()
    c.start("load", id="L", path=ckpt_sharded, device=0)
    first, _ = c.recv()
    assert first.get("event") == "progress" and first["bytes_done"] < first["bytes_total"], first
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    got = frames_until_eof(c, STOP_SECONDS * 2)
    c.close()
    # Progress, then the shutdown event or an error for the load; never a finished load.
    finals = [m for m in got if "event" not in m]
    assert all("error" in m and m["error"]["code"] in ("CANCELED", "SHUTDOWN") for m in finals), got
    assert finals or any(m.get("event") == "shutdown" for m in got), got
    rc = d.wait_exit(STOP_SECONDS)
    assert rc is not None, f"weightd did not exit within {STOP_SECONDS} s of SIGTERM during a load:\n{d.log_tail()}"
    assert time.monotonic() - t0 < STOP_SECONDS
    d.check_exit(0)
    assert not os.path.exists(d.socket)


def test_sigint_with_leases_and_sets(daemon, tiny):
    with daemon.connect() as c:
        for k in ("a", "b"):
            att, fd = c.attach(path=tiny[k], device=0)
            os.close(fd)
        daemon.stop(signal.SIGINT)
    assert not os.path.exists(daemon.socket)


def test_new_connections_refused_while_stopping(start_daemon, ckpt_sharded):
    """Once stopping, the daemon accepts no new connection; idle ones get the shutdown event."""
    d = start_daemon({"fill_threads": 1})
    c = d.connect()
    watcher = d.connect()
    c.start("load", id="L", path=ckpt_sharded, device=0)
    c.recv()
    d.proc.send_signal(signal.SIGTERM)
    got = frames_until_eof(watcher, STOP_SECONDS)
    assert [m.get("event") for m in got] == ["shutdown"], got
    # The listening socket is gone before the connections are closed.
    try:
        late = Conn(d.socket, hello=True, timeout=5)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    else:
        late.close()
        raise AssertionError("a new connection was accepted while the daemon was stopping")
    assert d.wait_exit(STOP_SECONDS) is not None
    d.check_exit(0)
    c.close()
    watcher.close()
