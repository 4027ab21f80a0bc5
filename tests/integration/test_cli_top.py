"""`weightctl top` in a real terminal: tmux runs it against a daemon whose load is held at the
daemon's test_load_gate (a FIFO: the load reads one byte before each 256 MiB window), so what the
frame must show does not depend on timing. `tmux capture-pane -p` reads what a user sees: the load
in flight with its checkpoint and bytes done, then the set ready with its lease and holder, the
budgets; a smaller pane gets a frame fitted to it; q quits and restores the terminal. Without a
terminal (and with --once) one frame is printed. A missing tmux fails the test.
"""
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from conftest import SLOW, WEIGHTCTL
from test_early_attach import WINDOW, Gate
from wdclient import wait_until


def tmux_binary():
    t = shutil.which("tmux")
    if t is None:
        pytest.fail("tmux is needed to test weightctl top in a terminal (Debian: tmux)")
    return t


class Pane:
    """One tmux server of its own (-L), one session running cmd in a pane of cols x rows."""

    def __init__(self, workdir, cmd, cols=220, rows=45):
        self.tmux = tmux_binary()
        self.sock = os.path.join(workdir, f"tmux-{os.getpid()}-{time.monotonic_ns()}")
        self.run("new-session", "-d", "-s", "top", "-x", str(cols), "-y", str(rows), cmd)

    def run(self, *args):
        r = subprocess.run([self.tmux, "-S", self.sock, *args], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, f"tmux {' '.join(args)}: {r.stderr}"
        return r.stdout

    def text(self):
        return self.run("capture-pane", "-p", "-t", "top")

    def wait_for(self, pred, what):
        seen = []

        def ok():
            seen[:] = [self.text()]
            return pred(seen[0])

        try:
            wait_until(ok, timeout=30 * SLOW, what=what)
        except AssertionError as e:
            raise AssertionError(f"{e}\n---- the pane ----\n{seen[0] if seen else ''}") from None
        return seen[0]

    def close(self):
        subprocess.run([self.tmux, "-S", self.sock, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def gated(start_daemon, workdir):
    gate = Gate(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    d = start_daemon({"test_load_gate": gate.path})
    yield d, gate
    gate.open()


def test_top_shows_a_load_in_flight_then_the_set_and_its_holder(gated, ckpt_small, workdir):
    d, gate = gated
    path = os.path.realpath(ckpt_small)
    marker = os.path.join(workdir, "top-exit")
    pane = Pane(workdir, f"{WEIGHTCTL} --socket {d.socket} top --interval 0.2; echo top exited $? > {marker}; sleep 60")
    try:
        with d.connect() as c:
            rid = c.start("load", path=ckpt_small, device=0)
            gate.let_one_window_through()
            shown = pane.wait_for(lambda t: f"{path}  256.0 MiB of" in t, "the load in flight, one window done")
            lines = shown.splitlines()
            head = lines.index("LOADS IN FLIGHT")
            assert lines[0].startswith("weightd ") and f"pid {d.pid}" in lines[0]
            assert any(line.strip().startswith("device 0 host memory") for line in lines), shown
            # The frame against the daemon's own status of the same moment (the gate holds the load still).
            with d.connect() as s:
                st = s.call("status")
            ld = [x for x in st["sets"] if x["state"] == "loading"]
            assert len(ld) == 1 and ld[0]["bytes_done"] == WINDOW, ld
            ld = ld[0]
            # Status says where the load reads: host memory through the mmap source, one window's file bytes so far.
            assert ld["source"] == "host" and ld["reading"] == "mmap", ld
            assert list(ld["read_bytes"]) == ["mmap"] and 0 < ld["read_bytes"]["mmap"] <= WINDOW, ld
            row = lines[head + 1].split()
            assert row[:2] == [ld["set"], path], lines[head + 1]
            share = f"({100 * WINDOW / ld['bytes']:3.0f}%)"  # as the frame formats it (%3.0f)
            assert share in lines[head + 1], (share, lines[head + 1])
            assert "GiB/s" in lines[head + 1] and lines[head + 1].endswith(f"on {ld['device']}  from host mmap"), \
                lines[head + 1]
            cb = st["daemon"]["checkpoints"]
            assert (f"open checkpoints {cb['open']} of {cb['max_open']}," in shown and cb["open"] == 1
                    and f"{cb['mappings']} of {cb['max_mappings']} mappings" in shown), shown
            gate.open()
            m, _ = c.wait(rid)
            assert m.get("ok") is True, m
            att, fd = c.attach(set=m["set"])
            try:
                shown = pane.wait_for(lambda t: f"lease {att['lease']} held by pid {os.getpid()}" in t,
                                      "the set ready with its lease's holder")
                sets = shown.splitlines()[shown.splitlines().index("SETS") + 1]
                assert sets.split()[:2] == [m["set"], "ready"] and "1 lease(s)" in sets and path in sets, sets
                assert "LOADS IN FLIGHT\n  none" in shown
                cks = shown.splitlines()[shown.splitlines().index("CHECKPOINTS") + 1]
                assert cks.startswith(f"  {path}  ") and "0 B pinned" in cks and cks.endswith(", 1 set(s)"), cks
                # A pane of 8 rows: the frame is cut to it and says how much did not fit.
                pane.run("resize-window", "-t", "top", "-x", "70", "-y", "8")
                small = pane.wait_for(lambda t: "more line(s): a taller terminal shows them" in t, "the frame refitted")
                assert all(len(line) <= 70 for line in small.splitlines()), small
                assert len([line for line in small.splitlines() if line.strip()]) <= 8
            finally:
                os.close(fd)
        pane.run("send-keys", "-t", "top", "q")
        wait_until(lambda: os.path.exists(marker), timeout=10 * SLOW, what="top to quit on q")
        assert open(marker).read().strip() == "top exited 0"
        restored = pane.wait_for(lambda t: "BUDGETS" not in t, "the main screen back")
        assert "SETS" not in restored
    finally:
        pane.close()


def test_top_once_without_a_terminal(daemon, tiny):
    with daemon.connect() as c:
        s = c.call("load", path=tiny["a"], device=0)["set"]
    r = subprocess.run([WEIGHTCTL, "--socket", daemon.socket, "top"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("weightd ") and "BUDGETS" in lines and "CHECKPOINTS" in lines
    assert any(line.split()[:2] == [s, "ready"] for line in lines), r.stdout
    assert os.path.realpath(tiny["a"]) in r.stdout
    r = subprocess.run([WEIGHTCTL, "--socket", os.path.join(os.path.dirname(daemon.socket), "none.sock"), "top",
                        "--once"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "top: daemon unreachable" in r.stderr, (r.returncode, r.stderr)
