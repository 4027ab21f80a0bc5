"""Clients sharing one resident set: identical loads, concurrent loads, 64 attachers."""
import os
import threading

from conftest import SLOW
from wdclient import Checkpoint, check_sealed, verify_attached, wait_until


def test_two_clients_share_one_set(daemon, tiny):
    ckpt = Checkpoint(tiny["a"])
    with daemon.connect() as a, daemon.connect() as b:
        ra = a.call("load", path=tiny["a"], device=0)
        rb = b.call("load", path=tiny["a"], device=0, plan={"preset": "whole"})
        assert ra["shared"] is False and rb["shared"] is True
        assert ra["set"] == rb["set"] and ra["bytes"] == rb["bytes"]
        att_a, fa = a.attach(set=ra["set"])
        att_b, fb = b.attach(path=tiny["a"], device=0)
        try:
            assert att_a["set"] == att_b["set"] == ra["set"]
            assert att_a["lease"] != att_b["lease"]
            # Both descriptors name the same memory: same inode.
            assert os.fstat(fa).st_ino == os.fstat(fb).st_ino
            verify_attached(att_a, fa, ckpt)
            verify_attached(att_b, fb, ckpt)
        finally:
            os.close(fa)
            os.close(fb)
        st = a.status()
        assert len(st["sets"]) == 1 and st["sets"][0]["leases"] == 2
        assert st["daemon"]["leases"] == 2
        assert b.call("release", lease=att_b["lease"])["released"] is True
        assert b.error("release", lease=att_b["lease"]) == "NOT_FOUND"
        assert a.status()["sets"][0]["leases"] == 1
    assert daemon.status()["sets"][0]["leases"] == 0
    assert daemon.log_text().count("loaded set ") == 1


def test_concurrent_identical_loads_load_once(start_daemon, ckpt_small):
    """Two loads sent at once (one still opening or loading when the other arrives) make one set."""
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_small)
    with d.connect() as a, d.connect() as b:
        ia = a.start("load", path=ckpt_small, device=0)
        ib = b.start("load", path=ckpt_small, device="0")
        ra, _ = a.wait(ia)
        rb, _ = b.wait(ib)
        assert ra.get("ok") and rb.get("ok"), (ra, rb)
        assert ra["set"] == rb["set"]
        assert sorted([ra["shared"], rb["shared"]]) == [False, True], (ra, rb)
        att, fd = a.attach(set=ra["set"])
        try:
            verify_attached(att, fd, ckpt, names=["model.norm.weight", "lm_head.weight"])
        finally:
            os.close(fd)
        st = a.status()
        assert len(st["sets"]) == 1, st["sets"]
        assert st["sets"][0]["leases"] == 1
        assert st["devices"][0]["used"] == ra["bytes"]
    assert d.log_text().count("loaded set ") == 1, d.log_tail()
    ckpt.close()


def test_shared_flag_goes_to_the_joiner(start_daemon, ckpt_sharded):
    """The request that started a load gets shared: false; one that joined it while
    it was loading gets shared: true (docs/protocol.md, load)."""
    d = start_daemon({"fill_threads": 1})
    with d.connect() as a, d.connect() as b:
        a.start("load", id="first", path=ckpt_sharded, device=0)
        ev, _ = a.recv()
        assert ev.get("event") == "progress"
        assert [s["state"] for s in b.status()["sets"]] == ["loading"]
        b.start("load", id="second", path=ckpt_sharded, device=0)
        ev, _ = b.recv()
        assert ev.get("event") == "progress"  # b waits for the same set
        ra, _ = a.wait("first")
        rb, _ = b.wait("second")
        assert ra["set"] == rb["set"]
        assert (ra["shared"], rb["shared"]) == (False, True), (ra, rb)
    assert d.log_text().count("loaded set ") == 1


def test_64_concurrent_attachers(daemon, tiny):
    n = 64
    ckpt = Checkpoint(tiny["b"])
    with daemon.connect() as ctl:
        set_id = ctl.call("load", path=tiny["b"])["set"]
        base_fds = daemon.fd_count()
        attached = threading.Barrier(n + 1, timeout=60 * SLOW)
        counted = threading.Barrier(n + 1, timeout=60 * SLOW)
        released = threading.Barrier(n + 1, timeout=60 * SLOW)
        errors = []
        compared = []

        def client(i):
            try:
                with daemon.connect() as c:
                    if i % 2:
                        att, fd = c.attach(set=set_id)
                    else:
                        att, fd = c.attach(path=tiny["b"], device=0)
                    try:
                        attached.wait()
                        counted.wait()
                        check_sealed(fd, att["bytes"])
                        compared.append(verify_attached(att, fd, ckpt, names=["embed.weight", "layers.0.odd"]))
                    finally:
                        os.close(fd)
                    c.call("release", lease=att["lease"])
                    released.wait()
            except BaseException as e:  # report every thread's failure
                errors.append(f"client {i}: {e!r}")
                for b in (attached, counted, released):
                    b.abort()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        try:
            attached.wait()
            st = ctl.status()
            assert st["sets"][0]["leases"] == n, st["sets"]
            assert st["daemon"]["leases"] == n
            assert st["daemon"]["connections"] == n + 1
            assert daemon.fd_count() == base_fds + n  # one socket per client
            counted.wait()
            released.wait()
            st = ctl.status()
            assert st["sets"][0]["leases"] == 0, st["sets"]
        finally:
            for t in threads:
                t.join(60 * SLOW)
        assert not errors, "\n".join(errors)
        assert len(compared) == n and len(set(compared)) == 1 and compared[0] > 0
        wait_until(lambda: ctl.status()["daemon"]["connections"] == 1, what="connections back to 1")
        assert ctl.status()["sets"][0]["leases"] == 0
        wait_until(lambda: daemon.fd_count() == base_fds, what="daemon descriptors back to the start")
    ckpt.close()


def test_attach_by_set_id_while_loading(start_daemon, ckpt_sharded):
    """attach of a set that is still loading waits for it; progress events come meanwhile."""
    d = start_daemon({"fill_threads": 1})
    ckpt = Checkpoint(ckpt_sharded)
    total = ckpt.payload_bytes()
    with d.connect() as a, d.connect() as b:
        a.start("load", id="L", path=ckpt_sharded, device=0)
        first, _ = a.recv()
        assert first.get("event") == "progress" and first["bytes_total"] == total
        (s,) = b.status()["sets"]
        assert s["state"] == "loading" and 0 <= s["bytes_done"] <= total, s
        rid = b.start("attach", set=s["set"])
        att, fds = b.wait(rid)
        assert att.get("ok") is True and len(fds) == 1, att
        try:
            assert att["set"] == s["set"]
            verify_attached(att, fds[0], ckpt, names=["model.norm.weight", "model.embed_tokens.weight"])
        finally:
            os.close(fds[0])
        rep, _ = a.wait("L")
        assert rep.get("ok") is True and rep["set"] == s["set"], rep
        events = [first] + a.events.get("L", [])
        done = [e["bytes_done"] for e in events]
        assert done == sorted(done) and all(e["bytes_total"] == total for e in events), events
        if rep["seconds"] > 0.5:  # progress comes about every 100 ms while bytes move
            assert len(events) >= 3, (rep["seconds"], events)
            assert 0 < max(done[1:]) <= total, done
        st = b.status()
        assert st["sets"][0]["state"] == "ready" and st["sets"][0]["leases"] == 1
    ckpt.close()
