"""Clients that die: their leases end, their loads finish or stop cleanly, the daemon serves on."""
import json
import os
import select
import signal
import subprocess
import sys

from conftest import HERE, SLOW
from wdclient import Checkpoint, verify_attached, wait_until

CLIENT = os.path.join(HERE, "client_proc.py")


class Child:
    """A client_proc.py process whose milestones are read line by line."""

    def __init__(self, sock, mode, path):
        self.proc = subprocess.Popen([sys.executable, CLIENT, sock, mode, path], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)

    def milestone(self, timeout=60 * SLOW):
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert r, f"the client said nothing within {timeout} s"
        line = self.proc.stdout.readline()
        assert line, f"the client exited: {self.proc.wait()} {self.proc.stderr.read().decode()}"
        return json.loads(line)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc.stdout.close()
        self.proc.stderr.close()


def test_killed_attached_client_leaves_no_lease(daemon, tiny):
    with daemon.connect() as c:
        base_fds = daemon.fd_count()
        child = Child(daemon.socket, "attach", tiny["a"])
        try:
            got = child.milestone()
            st = c.status()
            (s,) = st["sets"]
            assert s["set"] == got["set"] and s["leases"] == 1
            assert st["daemon"]["connections"] == 2
            assert c.error("evict", set=s["set"]) == "BUSY"
        finally:
            child.kill()
        wait_until(lambda: c.status()["daemon"]["connections"] == 1, what="the killed client's connection to close")
        st = c.status()
        assert st["sets"][0]["leases"] == 0 and st["daemon"]["leases"] == 0
        assert c.call("evict", set=got["set"])["evicted"] == [got["set"]]
        st = c.status()
        assert st["sets"] == [] and st["devices"][0]["used"] == 0
        wait_until(lambda: daemon.fd_count() == base_fds, what="the daemon's descriptors back to the start")


def test_client_killed_while_loading(start_daemon, ckpt_small):
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_small)
    child = Child(d.socket, "load", ckpt_small)
    try:
        got = child.milestone()
        assert got["total"] == ckpt.payload_bytes()
    finally:
        child.kill()
    with d.connect() as c:
        st = c.status()  # served while the orphaned load runs or right after it
        assert len(st["sets"]) <= 1

        def settled():
            s = c.status()
            return s if all(x["state"] != "loading" for x in s["sets"]) else None

        st = wait_until(settled, timeout=60 * SLOW, what="the orphaned load to finish or stop")
        assert st["daemon"]["leases"] == 0
        assert all(x["state"] == "ready" and x["leases"] == 0 for x in st["sets"]), st["sets"]
        wait_until(lambda: c.status()["daemon"]["connections"] == 1, what="the killed client's connection to close")
        # A new client gets the set (resident already, or loaded anew).
        att, fd = c.attach(path=ckpt_small, device=0)
        try:
            verify_attached(att, fd, ckpt, names=["model.norm.weight", "model.layers.0.mlp.down_proj.weight"])
        finally:
            os.close(fd)
        st = c.status()
        assert len(st["sets"]) == 1 and st["sets"][0]["leases"] == 1
    d.assert_alive()
    ckpt.close()
