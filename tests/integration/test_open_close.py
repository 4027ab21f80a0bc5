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
