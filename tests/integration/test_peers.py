"""Peer credentials: who may connect, and what another user may do.

These tests run clients under another uid (a forked child that drops to
nobody), so they need root; elsewhere they skip.
"""
import json
import os
import subprocess

import pytest

from conftest import WEIGHTCTL
from wdclient import Closed, Conn

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")

def as_nobody(sock, reqs, until_eof=False, groups=()):
    """Runs reqs in a forked child under uid nobody: every frame it got, then {"eof": True} on EOF.

    until_eof: after the last reply, keep reading until the daemon closes. groups: its supplementary groups.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = []
            try:
                c = Conn(sock, hello=False, timeout=20)
                for req in reqs:
                    try:
                        c.send(req)
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # refused at once: the error frame may still be there to read
                    while True:
                        m = c.recv_msg()
                        out.append(m)
                        if "event" not in m:
                            break
                while until_eof:
                    out.append(c.recv_msg())
            except Closed:
                out.append({"eof": True})
            os.write(w, json.dumps(out).encode())
        except BaseException as e:  # report, never raise into the parent's test
            os.write(w, json.dumps([{"child_error": repr(e)}]).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while True:
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    got = json.loads(data)
    assert status == 0, got
    return got


HELLO = {"op": "hello", "id": 1, "protocol": 1}


def test_peer_not_allowed_is_refused(start_daemon):
    d = start_daemon({"allowed_uids": "4242", "socket_mode": "0666"}, public=True)
    got = as_nobody(d.socket, [HELLO], until_eof=True)
    assert got[0].get("error", {}).get("code") == "PERMISSION", got
    assert got[1:] == [{"eof": True}], got
    assert "refused pid" in d.log_text()
    assert d.status()["daemon"]["connections"] == 1


def test_allowed_peer_may_not_shutdown_or_release_others_leases(start_daemon, tiny):
    d = start_daemon({"allowed_uids": str(NOBODY), "socket_mode": "0666"}, public=True)
    with d.connect() as owner:
        att, fd = owner.attach(path=tiny["a"], device=0)
        os.close(fd)
        got = as_nobody(d.socket, [HELLO, {"op": "status", "id": 2},
                                   {"op": "release", "id": 3, "lease": att["lease"]},
                                   {"op": "shutdown", "id": 4}])
        by_id = {m.get("id"): m for m in got}
        assert by_id[1].get("ok") is True and by_id[2].get("ok") is True, got
        assert by_id[3]["error"]["code"] == "PERMISSION", got
        assert by_id[4]["error"]["code"] == "PERMISSION", got
        st = owner.status()
        assert st["sets"][0]["leases"] == 1
        d.assert_alive()
        # The daemon's own uid may release any lease (for a client that is stuck).
        with d.connect() as admin:
            assert admin.call("release", lease=att["lease"])["released"] is True
        assert owner.status()["sets"][0]["leases"] == 0


def test_who_may_evict(start_daemon, tiny):
    """A set is evicted by its loader, root, the daemon's user or a member of admin_gids; nobody else."""
    d = start_daemon({"allowed_uids": str(NOBODY), "socket_mode": "0666", "admin_gids": "4343"}, public=True)
    with d.connect() as owner:
        sid = owner.call("load", path=tiny["a"])["set"]  # unleased: evictable, but not by anyone
        got = as_nobody(d.socket, [HELLO, {"op": "evict", "id": 2, "set": sid},
                                   {"op": "evict", "id": 3, "device": 0}])
        by_id = {m.get("id"): m for m in got}
        assert by_id[2]["error"]["code"] == "PERMISSION", got
        assert "loaded by another user" in by_id[2]["error"]["message"] and "admin_gids" in by_id[2]["error"]["message"]
        assert by_id[3].get("ok") is True and by_id[3]["evicted"] == [], got  # the device's sets: only its own
        assert [s["set"] for s in owner.status()["sets"]] == [sid]
        # A member of admin_gids (a supplementary group) may.
        got = as_nobody(d.socket, [HELLO, {"op": "evict", "id": 2, "set": sid}], groups=(4343,))
        assert got[1].get("ok") is True and got[1]["evicted"] == [sid], got
        assert owner.status()["sets"] == []
        # Its loader may, and root may.
        sid = owner.call("load", path=tiny["b"])["set"]
        assert owner.call("evict", set=sid)["evicted"] == [sid]


class NobodyConnections:
    """n connections held open by a forked child running as nobody, each past hello.

    Entering waits until all are open (or fails with what the child saw);
    leaving closes them and reaps the child.
    """

    def __init__(self, sock, n):
        self.sock = sock
        self.n = n

    def __enter__(self):
        ready_r, ready_w = os.pipe()
        self.hold_r, self.hold_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(ready_r)
                os.close(self.hold_w)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                conns = []
                try:
                    for _ in range(self.n):
                        conns.append(Conn(self.sock, timeout=20))
                    os.write(ready_w, b"ok")
                except BaseException as e:
                    os.write(ready_w, repr(e).encode())
                    code = 1
                os.close(ready_w)
                os.read(self.hold_r, 1)  # until the parent closes its end
            finally:
                os._exit(code)
        os.close(ready_w)
        os.close(self.hold_r)
        said = os.read(ready_r, 4096).decode()
        os.close(ready_r)
        if said != "ok":
            self.__exit__()
            raise AssertionError(f"the child running as nobody could not open {self.n} connections: {said}")
        return self

    def __exit__(self, *exc):
        os.close(self.hold_w)
        os.waitpid(self.pid, 0)


def test_root_is_served_beyond_max_connections(start_daemon):
    """max_connections held by an unprivileged user's idle connections: root still
    connects (reserved_connections, default 16, are for root and the daemon's
    uid) and weightctl status works; another unprivileged peer is refused.

    Before: root got LIMIT like anyone else, so twenty idle sockets of one user
    locked the operator's weightctl status out."""
    d = start_daemon({"max_connections": 4, "socket_mode": "0666"}, public=True)
    with NobodyConnections(d.socket, 4):
        with Conn(d.socket, timeout=10) as root:
            assert root.status()["daemon"]["connections"] == 5
            r = subprocess.run([WEIGHTCTL, "--socket", d.socket, "status"], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r
        got = as_nobody(d.socket, [HELLO], until_eof=True)
        assert got[0].get("error", {}).get("code") == "LIMIT", got
        assert got[1:] == [{"eof": True}], got
