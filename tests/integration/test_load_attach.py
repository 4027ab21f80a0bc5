"""open, load and attach of generated checkpoints, every byte compared with the files."""
import os
import subprocess

import pytest

from conftest import WEIGHTCTL
from wdclient import Checkpoint, check_sealed, verify_attached


def check_open_reply(ck, path, ckpt, layout, shards):
    assert ck["path"] == os.path.realpath(path)
    assert ck["layout"] == layout
    assert ck["shards"] == shards
    assert ck["tensors"] == len(ckpt.where)
    assert ck["bytes"] == ckpt.payload_bytes()
    assert ck["pinned"] is False


def check_load_reply(c, rep, ckpt, shared=False):
    dev = c.hello_reply["devices"][0]
    assert rep["device"] == dev["uuid"] and dev["uuid"].startswith("host-")
    assert rep["tensors"] == len(ckpt.where)
    assert rep["bytes"] >= ckpt.payload_bytes()
    assert rep["shared"] is shared
    assert rep["method"] == "memcpy"
    assert isinstance(rep["set"], str) and rep["set"]


def check_progress(events, total):
    assert events, "a load sent no progress event"
    done = [e["bytes_done"] for e in events]
    assert all(e["event"] == "progress" and e["bytes_total"] == total for e in events), events
    assert done == sorted(done) and done[-1] <= total, done


def test_single_file_checkpoint_every_byte(daemon, ckpt_small):
    ckpt = Checkpoint(ckpt_small)
    with daemon.connect() as c:
        assert c.hello_reply["protocol"] == 1 and c.hello_reply["backend"] == "host"
        assert c.hello_reply["pid"] == daemon.pid
        ck = c.call("open", path=ckpt_small)["checkpoint"]
        check_open_reply(ck, ckpt_small, ckpt, "single", 1)
        rid = c.start("load", path=ckpt_small, device=0, plan={"preset": "whole"})
        rep, fds = c.wait(rid)
        assert not fds and rep.get("ok"), rep
        check_load_reply(c, rep, ckpt)
        check_progress(c.events[rid], ckpt.payload_bytes())
        att, fd = c.attach(set=rep["set"])
        try:
            assert att["set"] == rep["set"] and att["bytes"] == rep["bytes"]
            assert att["device"] == rep["device"]
            check_sealed(fd, att["bytes"])
            n = verify_attached(att, fd, ckpt)
            assert n == ckpt.payload_bytes()
        finally:
            os.close(fd)
        st = c.status()
        (s,) = st["sets"]
        assert s["set"] == rep["set"] and s["state"] == "ready" and s["leases"] == 1
        assert s["plan"] == {"preset": "whole"} and s["bytes"] == rep["bytes"]
        assert c.call("release", lease=att["lease"])["released"] is True
        assert c.status()["sets"][0]["leases"] == 0
    ckpt.close()


def test_sharded_index_checkpoint_every_byte(daemon, ckpt_sharded):
    ckpt = Checkpoint(ckpt_sharded)
    assert len(ckpt.shards) == 3
    with daemon.connect() as c:
        # attach by path loads first.
        att, fd = c.attach(path=ckpt_sharded, device="0", plan={"preset": "whole"})
        try:
            check_sealed(fd, att["bytes"])
            assert verify_attached(att, fd, ckpt) == ckpt.payload_bytes()
        finally:
            os.close(fd)
        st = c.status()
        (ck,) = st["checkpoints"]
        check_open_reply(ck, ckpt_sharded, ckpt, "index", 3)
        (s,) = st["sets"]
        assert s["set"] == att["set"] and s["leases"] == 1
        # A load by UUID finds the same set.
        rep = c.call("load", path=ckpt_sharded, device=att["device"])
        assert rep["set"] == att["set"] and rep["shared"] is True
    ckpt.close()


def test_file_path_checkpoint(daemon, tiny):
    """A bare .safetensors file as the checkpoint (the "file" layout)."""
    ckpt = Checkpoint(tiny["file"])
    with daemon.connect() as c:
        ck = c.call("open", path=tiny["file"])["checkpoint"]
        check_open_reply(ck, tiny["file"], ckpt, "file", 1)
        att, fd = c.attach(path=tiny["file"])
        try:
            check_sealed(fd, att["bytes"])
            assert verify_attached(att, fd, ckpt) == ckpt.payload_bytes()
        finally:
            os.close(fd)
    ckpt.close()


def test_weightctl_attach_verify(daemon, ckpt_sharded):
    """The CLI against the same daemon: load, then attach --verify of every byte."""
    env = dict(os.environ, WEIGHTD_SOCKET=daemon.socket)
    for args in (["load", ckpt_sharded], ["attach", "--verify", ckpt_sharded], ["status"]):
        r = subprocess.run([WEIGHTCTL, "--socket", daemon.socket] + args, capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, f"weightctl {args}: {r.returncode}\n{r.stdout}{r.stderr}"
    st = daemon.status()
    assert len(st["sets"]) == 1 and st["sets"][0]["leases"] == 0


@pytest.mark.parametrize("writes", ["auto", "cached", "streaming", "write_combined"])
def test_staged_load_every_byte_each_staging_write(start_daemon, ckpt_sharded, writes):
    """Staged loads through small slots with each staging_writes mode; status says the staging settings."""
    d = start_daemon({"load_method": "staged", "staging_slots": 3, "staging_slot_bytes": "1MiB",
                      "staging_writes": writes})
    ckpt = Checkpoint(ckpt_sharded)
    with d.connect() as c:
        daemon_st = c.status()["daemon"]
        assert (daemon_st["staging_slots"], daemon_st["staging_slot_bytes"], daemon_st["staging_writes"]) == \
            (3, 1 << 20, writes)
        att, fd = c.attach(path=ckpt_sharded, device="0", plan={"preset": "whole"})
        try:
            assert c.status()["sets"][0]["method"] == "staged"
            assert verify_attached(att, fd, ckpt) == ckpt.payload_bytes()
        finally:
            os.close(fd)
    ckpt.close()
