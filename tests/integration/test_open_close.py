"""open is idempotent; close drops only what nothing uses."""
import os

from wdclient import wait_until


def test_open_is_idempotent_and_close_drops(daemon, tiny, model_root):
    link = os.path.join(model_root, "tiny-a-link")
    os.symlink(tiny["a"], link)
    try:
        with daemon.connect() as c:
            a = c.call("open", path=tiny["a"])["checkpoint"]
            b = c.call("open", path=link)["checkpoint"]
            assert a["path"] == b["path"] == os.path.realpath(tiny["a"])
            assert len(c.status()["checkpoints"]) == 1
            rep = c.call("close", path=link)
            assert rep["closed"] is True
            assert c.status()["checkpoints"] == []
            assert c.error("close", path=tiny["a"]) == "NOT_FOUND"
    finally:
        os.unlink(link)


def test_close_refused_while_a_set_or_load_needs_it(start_daemon, tiny, ckpt_small):
    d = start_daemon({"fill_threads": 1})
    with d.connect() as c:
        s = c.call("load", path=tiny["a"])["set"]
        assert c.error("close", path=tiny["a"]) == "BUSY"
        c.call("evict", set=s)
        assert c.call("close", path=tiny["a"])["closed"] is True
        # While a load runs.
        c.start("load", id="L", path=ckpt_small, device=0)
        first, _ = c.recv()
        assert first.get("event") == "progress"
        assert c.error("close", path=ckpt_small) == "BUSY"
        m, _ = c.wait("L")
        assert m.get("ok") is True, m
        assert c.error("close", path=ckpt_small) == "BUSY"
        c.call("evict", set=m["set"])
        assert c.call("close", path=ckpt_small)["closed"] is True
        st = c.status()
        assert st["checkpoints"] == [] and st["sets"] == []
        # A closed checkpoint opens again.
        c.call("load", path=tiny["a"])
        wait_until(lambda: len(c.status()["checkpoints"]) == 1, what="the checkpoint to be open again")


def test_close_is_not_refused_while_another_clients_status_runs(daemon, tiny):
    """status measures every open checkpoint on a job, holding a reference to each: a close meanwhile
    must not answer BUSY (before: 18 of 200 closes did, "in use by 1 resident set(s) or running
    operation(s)", with no set resident)."""
    busy = []
    with daemon.connect() as a, daemon.connect() as b:
        for i in range(200):
            b.call("open", path=tiny["a"])
            a.send({"op": "status", "id": 1000 + i})  # in flight while the close is asked
            m, _ = b.request("close", path=tiny["a"])
            if "error" in m:
                busy.append(m["error"])
            a.wait(1000 + i)
            if "error" in m:  # still open: close it for the next round
                wait_until(lambda: "error" not in b.request("close", path=tiny["a"])[0], what="the close")
    assert busy == [], busy[:3]
