"""Leak checks: the daemon's descriptors, RSS and objects stay flat over many cycles.

RSS is compared between a warmed-up point and the end of the run, with a
tolerance of a few MiB for allocator noise. Under ASan the allocator keeps
freed memory in quarantine, so RSS is not compared there: LeakSanitizer
checks at exit instead (a daemon fixture fails on any report).
"""
import os

import pytest

from conftest import ASAN
from wdclient import Checkpoint, verify_attached, wait_until

RSS_TOLERANCE_KIB = 4 * 1024


def snapshot(d, c):
    st = c.status()
    return {
        "fds": d.fd_count(),
        "rss": d.rss_kib(),
        "sets": [(s["set"], s["leases"], s["state"]) for s in st["sets"]],
        "leases": st["daemon"]["leases"],
        "connections": st["daemon"]["connections"],
        "checkpoints": len(st["checkpoints"]),
        "used": st["devices"][0]["used"],
    }


def check_flat(before, after, what):
    for k in ("fds", "sets", "leases", "connections", "checkpoints", "used"):
        assert after[k] == before[k], f"{what}: {k} went from {before[k]} to {after[k]}"
    if not ASAN:
        grew = after["rss"] - before["rss"]
        assert grew < RSS_TOLERANCE_KIB, f"{what}: RSS grew by {grew} KiB ({before['rss']} -> {after['rss']})"


def attach_release(c, set_id, check=None):
    att, fd = c.attach(set=set_id)
    try:
        if check is not None:
            check(att, fd)
    finally:
        os.close(fd)
    assert c.call("release", lease=att["lease"])["released"] is True


def test_1000_attach_release_cycles_one_connection(daemon, tiny):
    ckpt = Checkpoint(tiny["many"])
    with daemon.connect() as c:
        set_id = c.call("load", path=tiny["many"])["set"]
        first = [None]

        def check(att, fd):
            if first[0] is None:
                first[0] = verify_attached(att, fd, ckpt)

        for _ in range(200):
            attach_release(c, set_id, check)
        assert first[0] == ckpt.payload_bytes()
        before = snapshot(daemon, c)
        assert before["leases"] == 0 and before["sets"] == [(set_id, 0, "ready")]
        for _ in range(800):
            attach_release(c, set_id)
        after = snapshot(daemon, c)
        check_flat(before, after, "800 attach/release cycles")
    wait_until(lambda: daemon.status()["daemon"]["connections"] == 1, what="connections back to 1")
    ckpt.close()


def test_300_connect_attach_close_cycles(daemon, tiny):
    with daemon.connect() as ctl:
        set_id = ctl.call("load", path=tiny["many"])["set"]

        def cycle(i):
            with daemon.connect() as c:
                att, fd = c.attach(set=set_id) if i % 2 else c.attach(path=tiny["many"], device=0)
                os.close(fd)
                # closing without release ends the lease

        for i in range(60):
            cycle(i)
        wait_until(lambda: ctl.status()["daemon"]["connections"] == 1, what="connections back to 1")
        before = snapshot(daemon, ctl)
        assert before["leases"] == 0
        for i in range(240):
            cycle(i)
        wait_until(lambda: ctl.status()["daemon"]["connections"] == 1, what="connections back to 1")
        wait_until(lambda: daemon.fd_count() == before["fds"], timeout=5, what="descriptors back to the start")
        after = snapshot(daemon, ctl)
        check_flat(before, after, "240 connect/attach/close cycles")


def test_load_evict_cycles(daemon, tiny):
    """Sets that come and go leave no memfd, mapping or memory behind."""
    with daemon.connect() as c:
        def cycle(i):
            path = tiny["a"] if i % 2 else tiny["b"]
            rep = c.call("load", path=path, device=0)
            att, fd = c.attach(set=rep["set"])
            os.close(fd)
            assert c.error("evict", set=rep["set"]) == "BUSY"
            c.call("release", lease=att["lease"])
            assert c.call("evict", set=rep["set"])["evicted"] == [rep["set"]]

        for i in range(30):
            cycle(i)
        before = snapshot(daemon, c)
        assert before["sets"] == [] and before["used"] == 0
        maps_before = len(open(f"/proc/{daemon.pid}/maps").readlines())
        for i in range(120):
            cycle(i)
        after = snapshot(daemon, c)
        check_flat(before, after, "120 load/attach/evict cycles")
        maps_after = len(open(f"/proc/{daemon.pid}/maps").readlines())
        assert maps_after <= maps_before + 4, f"mappings grew from {maps_before} to {maps_after}"
        assert not any("weightd-slab" in t for t in daemon.fd_targets().values())


@pytest.mark.parametrize("n", [200])
def test_failed_requests_leave_nothing(daemon, tiny, n):
    """Requests that fail on the way (bad plan, missing file, denied path) hold nothing."""
    with daemon.connect() as c:
        c.call("open", path=tiny["a"])

        def burst():
            for i in range(n):
                assert c.error("load", path=tiny["a"], plan={"preset": "nope"}) == "BAD_PLAN"
                assert c.error("load", path=tiny["a"] + ".missing") == "NOT_FOUND"
                assert c.error("attach", set="s0") == "NOT_FOUND"
                assert c.error("open", path="/etc/hostname") in ("PATH_DENIED", "NOT_FOUND")

        burst()
        before = snapshot(daemon, c)
        burst()
        burst()
        after = snapshot(daemon, c)
        check_flat(before, after, f"{3 * n * 4} failed requests")
