"""cancel, evict, and eviction under the device memory budget."""
import os

from conftest import SLOW
from wdclient import Checkpoint, frame, verify_attached, wait_until

SAMPLE = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"]


def no_sets_left(c):
    st = c.status()
    return st if st["sets"] == [] else None


def test_cancel_a_running_load(start_daemon, ckpt_sharded):
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_sharded)
    total = ckpt.payload_bytes()
    with d.connect() as c:
        c.start("load", id="a", path=ckpt_sharded, device=0)
        first, _ = c.recv()  # the first progress event: the load has begun
        assert first.get("id") == "a" and first.get("event") == "progress", first
        assert first["bytes_total"] == total and first["bytes_done"] < total
        rep = c.call("cancel", target="a")
        assert rep["canceled"] is True
        m, _ = c.wait("a")
        assert m.get("error", {}).get("code") == "CANCELED", m
        st = wait_until(lambda: no_sets_left(c), timeout=30 * SLOW, what="the canceled set to go away")
        assert st["devices"][0]["used"] == 0 and st["daemon"]["leases"] == 0
        # Nothing is poisoned: the same load now completes, with the right bytes.
        att, fd = c.attach(path=ckpt_sharded, device=0)
        try:
            verify_attached(att, fd, ckpt, names=SAMPLE)
        finally:
            os.close(fd)
    assert "canceled" in d.log_text()
    ckpt.close()


def test_cancel_while_opening(daemon, ckpt_small):
    """A cancel that arrives with the load (still resolving and opening) stops it there."""
    with daemon.connect() as c:
        c.send_raw(b"".join([
            frame({"op": "load", "id": "a", "path": ckpt_small, "device": 0}),
            frame({"op": "cancel", "id": "c", "target": "a"}),
        ]))
        rc, _ = c.wait("c")
        assert rc.get("canceled") is True, rc
        ra, _ = c.wait("a")
        assert ra.get("error", {}).get("code") == "CANCELED", ra
        st = wait_until(lambda: no_sets_left(c), timeout=30 * SLOW, what="no set left")
        assert st["daemon"]["leases"] == 0


def test_cancel_one_of_two_waiters(start_daemon, ckpt_sharded):
    """The load goes on for the other requester; a cancel cannot reach another connection's request."""
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_sharded)
    with d.connect() as a, d.connect() as b:
        a.start("load", id="x", path=ckpt_sharded, device=0)
        first, _ = a.recv()
        assert first.get("event") == "progress"
        b.start("load", id="x", path=ckpt_sharded, device=0)
        first_b, _ = b.recv()
        assert first_b.get("event") == "progress"
        # A cancel names a request of its own connection: a's "x", not b's.
        assert a.call("cancel", target="nonexistent")["canceled"] is False
        assert a.call("cancel", target="x")["canceled"] is True
        ma, _ = a.wait("x")
        assert ma["error"]["code"] == "CANCELED"
        mb, _ = b.wait("x")
        assert mb.get("ok") is True, mb
        att, fd = b.attach(set=mb["set"])
        try:
            verify_attached(att, fd, ckpt)
        finally:
            os.close(fd)
        st = b.status()
        assert [s["state"] for s in st["sets"]] == ["ready"]
    ckpt.close()


def test_evict_leased_is_busy_and_evict_by_device(daemon, tiny):
    with daemon.connect() as c:
        sa = c.call("load", path=tiny["a"])["set"]
        sb = c.call("load", path=tiny["b"])["set"]
        sc = c.call("load", path=tiny["c"])["set"]
        assert len({sa, sb, sc}) == 3
        att, fd = c.attach(set=sa)
        os.close(fd)
        assert c.error("evict", set=sa) == "BUSY"
        ev = c.call("evict", device=0)["evicted"]
        assert sorted(ev) == sorted([sb, sc]), ev
        st = c.status()
        assert [s["set"] for s in st["sets"]] == [sa]
        assert st["devices"][0]["used"] == st["sets"][0]["bytes"]
        assert c.call("evict", device=st["devices"][0]["uuid"])["evicted"] == []
        assert c.error("evict", set=sa) == "BUSY"
        c.call("release", lease=att["lease"])
        assert c.call("evict", set=sa)["evicted"] == [sa]
        assert c.error("evict", set=sa) == "NOT_FOUND"
        st = c.status()
        assert st["sets"] == [] and st["devices"][0]["used"] == 0


def set_bytes(start_daemon, path):
    d = start_daemon()
    with d.connect() as c:
        n = c.call("load", path=path)["bytes"]
    d.stop()
    return n


def paths_of(c):
    return sorted(os.path.basename(s["path"]) for s in c.status()["sets"])


def test_budget_for_one_set(start_daemon, tiny):
    size = set_bytes(start_daemon, tiny["a"])
    assert size == set_bytes(start_daemon, tiny["b"])
    d = start_daemon({"device_memory_budget": str(size + size // 2)})
    ckpt_b = Checkpoint(tiny["b"])
    with d.connect() as c:
        sa = c.call("load", path=tiny["a"])["set"]
        # Unleased: the second checkpoint's load evicts the first.
        rb = c.call("load", path=tiny["b"])
        assert paths_of(c) == ["tiny_b"]
        assert c.status()["devices"][0]["used"] == size
        assert c.error("attach", set=sa) == "NOT_FOUND"
        # Leased: no room, and nothing is evicted.
        att, fd = c.attach(set=rb["set"])
        assert c.error("load", path=tiny["a"]) == "DEVICE_NOMEM"
        assert c.error("attach", path=tiny["a"], device=0) == "DEVICE_NOMEM"
        st = c.status()
        assert [s["set"] for s in st["sets"]] == [rb["set"]] and st["devices"][0]["used"] == size
        try:
            verify_attached(att, fd, ckpt_b)
        finally:
            os.close(fd)
        c.call("release", lease=att["lease"])
        c.call("load", path=tiny["a"])
        assert paths_of(c) == ["tiny_a"]
    ckpt_b.close()


def test_budget_evicts_least_recently_used(start_daemon, tiny):
    size = set_bytes(start_daemon, tiny["a"])
    d = start_daemon({"device_memory_budget": str(2 * size + size // 2)})
    with d.connect() as c:
        c.call("load", path=tiny["a"])
        c.call("load", path=tiny["b"])
        # Touch a: b is now the least recently used.
        att, fd = c.attach(path=tiny["a"], device=0)
        os.close(fd)
        c.call("release", lease=att["lease"])
        c.call("load", path=tiny["c"])
        assert paths_of(c) == ["tiny_a", "tiny_c"]
        # Touch c by loading it again: a is now the oldest.
        assert c.call("load", path=tiny["c"])["shared"] is True
        c.call("load", path=tiny["b"])
        assert paths_of(c) == ["tiny_b", "tiny_c"]
        assert c.status()["devices"][0]["used"] == 2 * size


def test_request_joining_a_canceled_load_is_not_canceled(start_daemon, ckpt_sharded):
    """A cancel stops a load only for the requests that asked; one that joins the
    same set right after (here an attach by set id, in the same write as the
    cancel) must still get the set (docs/protocol.md, cancel: "The load itself
    stops only if no other request is waiting for the same set")."""
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_sharded)
    with d.connect() as c:
        c.start("load", id="L", path=ckpt_sharded, device=0)
        first, _ = c.recv()
        assert first.get("event") == "progress"
        (s,) = c.status()["sets"]
        assert s["state"] == "loading"
        c.send_raw(frame({"op": "cancel", "id": "C", "target": "L"}) +
                   frame({"op": "attach", "id": "A", "set": s["set"]}))
        rc, _ = c.wait("C")
        assert rc.get("canceled") is True, rc
        rl, _ = c.wait("L")
        assert rl["error"]["code"] == "CANCELED", rl
        ra, fds = c.wait("A")
        try:
            assert ra.get("ok") is True, f"attach that joined after the cancel got {ra}"
            verify_attached(ra, fds[0], ckpt, names=SAMPLE)
        finally:
            for fd in fds:
                os.close(fd)
    ckpt.close()


def test_cancel_reaches_a_busy_connection(start_daemon, ckpt_sharded):
    """A cancel pipelined behind the connection's in-progress requests still
    cancels (docs/protocol.md: requests may be pipelined; cancel stops this
    connection's load). Here 16 loads of one set are in progress when it comes."""
    d = start_daemon({"fill_threads": 1})
    with d.connect() as c:
        loads = [frame({"op": "load", "id": i, "path": ckpt_sharded, "device": 0}) for i in range(1, 17)]
        c.send_raw(b"".join(loads) + frame({"op": "cancel", "id": "C", "target": 1}))
        rc, _ = c.wait("C")
        assert rc.get("canceled") is True, f"the cancel came too late: {rc}"
        r1, _ = c.wait(1)
        assert r1.get("error", {}).get("code") == "CANCELED", r1
        sets = set()
        for i in range(2, 17):
            m, _ = c.wait(i)
            assert m.get("ok") is True, m
            sets.add(m["set"])
        assert len(sets) == 1
