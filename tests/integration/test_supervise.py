"""weightd without systemd: deploy/weightd-supervise, the plain supervisor, and the container's
entrypoint as deploy/Containerfile declares it.

The supervisor runs the real daemon (host backend) on a private socket. A
SIGKILL'd daemon comes back with a new pid on the same socket and serves (a
checkpoint loads and attaches with every byte compared, /readyz answers 200),
but with no sets: without a service manager's fd store nothing survives, as
the docs say. `weightctl shutdown` (exit 0) is not restarted; SIGTERM to the
supervisor stops the daemon in order and leaves nothing running; a daemon that
cannot start is given up after the start limit. The counts of starts and the
outcomes are asserted, never how long anything took.
"""
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request

import pytest

from wdfixtures import REPO, TINY_TENSORS, WEIGHTCTL, WEIGHTD, free_port, native_env

SUPERVISE = os.path.join(REPO, "deploy", "weightd-supervise")
WAIT_STEPS = 600          # polls of 0.1 s for a daemon to answer (a bound, not an assertion)


class Supervised:
    """weightd-supervise running weightd with flags; its stderr (and the daemon's) in a log."""

    def __init__(self, workdir, flags, env=None):
        self.dir = tempfile.mkdtemp(prefix="sv-", dir=workdir)
        self.socket = os.path.join(self.dir, "wd.sock")
        flags = [f.replace("{socket}", self.socket) for f in flags]
        self.log_path = os.path.join(self.dir, "log")
        e = native_env()
        e.update(WEIGHTD_BIN=WEIGHTD, WEIGHTD_RESTART_SEC="0")
        e.update(env or {})
        e.pop("NOTIFY_SOCKET", None)
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["sh", SUPERVISE] + flags, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=e)

    def log_text(self):
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def ctl(self, *args, check=True):
        r = subprocess.run([WEIGHTCTL, "--socket", self.socket, "--json"] + list(args), capture_output=True,
                           text=True, timeout=120, env=native_env())
        if check:
            assert r.returncode == 0, f"weightctl {' '.join(args)}: {r.stdout}{r.stderr}\n{self.log_text()}"
        return r

    def status(self):
        return json.loads(self.ctl("status").stdout)

    def wait_serving(self, not_pid=None):
        """The status of the daemon once one answers on the socket (one whose pid is not not_pid)."""
        for _ in range(WAIT_STEPS):
            assert self.proc.poll() is None, f"the supervisor exited {self.proc.returncode}:\n{self.log_text()}"
            r = self.ctl("status", check=False)
            if r.returncode == 0:
                st = json.loads(r.stdout)
                if st["daemon"]["pid"] != not_pid:
                    return st
            time.sleep(0.1)
        raise AssertionError(f"no daemon answered on {self.socket}:\n{self.log_text()}")

    def wait_exit(self):
        try:
            return self.proc.wait(timeout=120)
        finally:
            self.log.close()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.wait_exit()


@pytest.fixture
def supervise(workdir, binaries):
    started = []

    def start(flags, env=None):
        s = Supervised(workdir, flags, env)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def daemon_flags(model_root, port=None):
    """The daemon's flags: host backend, the supervised socket, the metrics port or none."""
    return ["--backend", "host", "--socket", "{socket}", "--model-root", model_root,
            "--set", f"metrics_address=127.0.0.1:{port}" if port else "metrics_address="]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_killed_daemon_comes_back_and_serves(supervise, workdir, model_root, tiny):
    port = free_port()
    s = supervise(daemon_flags(model_root, port))
    first = s.wait_serving()
    pid1 = first["daemon"]["pid"]
    s.ctl("load", tiny["a"])
    assert len(s.status()["sets"]) == 1

    os.kill(pid1, signal.SIGKILL)
    second = s.wait_serving(not_pid=pid1)
    pid2 = second["daemon"]["pid"]
    assert pid2 != pid1 and not alive(pid1)
    assert second["daemon"]["socket"] == s.socket
    # No fd store outside a service manager: the set did not survive.
    assert second["sets"] == []
    # It serves: a load and an attach that compares every byte with the files, and the probes.
    r = s.ctl("attach", tiny["a"], "--verify")
    out = json.loads(r.stdout)   # exit 0: every byte equals the files' (else exit 1)
    assert out["verified"]["tensors"] == out["tensors"] == len(TINY_TENSORS), r.stdout
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as resp:
        assert resp.status == 200
    log = s.log_text()
    assert f"weightd (pid {pid1}) was killed by signal 9; restarting" in log, log
    assert log.count("started weightd, pid") == 2, log

    # weightctl shutdown: exit 0, not restarted.
    s.ctl("shutdown")
    assert s.wait_exit() == 0, s.log_text()
    assert f"weightd (pid {pid2}) exited 0: not restarted" in s.log_text()
    assert not alive(pid2)
    assert not os.path.exists(s.socket)


def test_sigterm_stops_daemon_and_supervisor(supervise, workdir, model_root, tiny):
    s = supervise(daemon_flags(model_root))
    pid = s.wait_serving()["daemon"]["pid"]
    s.proc.send_signal(signal.SIGHUP)          # passed on: the daemon reloads and keeps serving
    for _ in range(WAIT_STEPS):
        if "reload:" in s.log_text():
            break
        time.sleep(0.1)
    assert re.search(r"reload: \d+ key\(s\) applied", s.log_text()), s.log_text()
    assert s.status()["daemon"]["pid"] == pid
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit() == 0, s.log_text()
    assert f"weightd (pid {pid}) stopped with status 0" in s.log_text()
    assert not alive(pid)
    assert s.log_text().count("started weightd, pid") == 1


def test_start_limit_gives_up(supervise, workdir):
    bad = os.path.join(workdir, "bad-supervise.json")
    with open(bad, "w") as f:
        f.write('{"bogus_key": 1}\n')
    s = supervise(["--config", bad, "--backend", "host"],
                  env={"WEIGHTD_START_LIMIT_BURST": "3", "WEIGHTD_START_LIMIT_INTERVAL": "100000"})
    assert s.wait_exit() == 1
    log = s.log_text()
    assert log.count("started weightd, pid") == 3, log
    assert log.count("unknown key 'bogus_key'") == 3, log
    assert "weightd was started 3 times within 100000 s; giving up" in log, log


def test_usage_error_is_not_restarted(supervise):
    s = supervise(["--foregrund"])
    assert s.wait_exit() == 2
    log = s.log_text()
    assert log.count("started weightd, pid") == 1 and "exited 2 (a usage error): not restarted" in log, log


def test_bad_supervisor_setting_is_named(supervise):
    s = supervise(["--backend", "host"], env={"WEIGHTD_RESTART_SEC": "soon"})
    assert s.wait_exit() == 2
    assert "restart_sec must be a whole number of seconds or starts, not 'soon'" in s.log_text()
    assert "started weightd" not in s.log_text()
