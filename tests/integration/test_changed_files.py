"""Shards replaced or truncated under the daemon: never stale bytes, never a crash."""
import json
import os
import shutil
import tempfile

import pytest

from conftest import SLOW, mkcheckpoint
from wdclient import Checkpoint, first_difference, verify_attached, wait_until, write_safetensors

SAMPLE = ["model.norm.weight", "model.layers.0.mlp.down_proj.weight"]


@pytest.fixture
def scratch(model_root, workdir):
    """A fresh directory under the model root, and one outside it for staging."""
    d = tempfile.mkdtemp(prefix="chg-", dir=model_root)
    s = tempfile.mkdtemp(prefix="stage-", dir=workdir)
    yield d, s
    shutil.rmtree(d, ignore_errors=True)
    shutil.rmtree(s, ignore_errors=True)


def tensors_differ(old, new, name):
    """Whether the tensor's bytes differ between two checkpoints (so the test can tell them apart)."""
    om, ob, oe = old.tensor_bytes(name)
    nm, nb, ne = new.tensor_bytes(name)
    assert oe - ob == ne - nb
    return first_difference(om, ob, nm, nb, oe - ob) is not None


def test_replaced_single_shard_serves_new_bytes(daemon, scratch):
    target, stage = scratch
    ck_dir = mkcheckpoint(os.path.join(target, "q"), "qwen3-0.6b", 1, seed=11)
    new_dir = mkcheckpoint(os.path.join(stage, "q"), "qwen3-0.6b", 1, seed=12)
    old = Checkpoint(ck_dir)  # keeps the old file mapped after it is replaced
    with daemon.connect() as c:
        c.call("open", path=ck_dir)
        r1 = c.call("load", path=ck_dir)
        att1, fd1 = c.attach(set=r1["set"])
        try:
            verify_attached(att1, fd1, old, names=SAMPLE)
        finally:
            os.close(fd1)
        c.call("release", lease=att1["lease"])

        os.rename(os.path.join(new_dir, "model.safetensors"), os.path.join(ck_dir, "model.safetensors"))
        new = Checkpoint(ck_dir)
        assert all(tensors_differ(old, new, n) for n in SAMPLE)

        r2 = c.call("load", path=ck_dir)
        assert r2["set"] != r1["set"] and r2["shared"] is False, (r1, r2)
        att2, fd2 = c.attach(set=r2["set"])
        try:
            assert verify_attached(att2, fd2, new) == new.payload_bytes()
        finally:
            os.close(fd2)
        # attach by path also finds the new set, not the stale one.
        att3, fd3 = c.attach(path=ck_dir, device=0)
        os.close(fd3)
        assert att3["set"] == r2["set"]
        # The set built from the old file stays as it was.
        att4, fd4 = c.attach(set=r1["set"])
        try:
            verify_attached(att4, fd4, old, names=SAMPLE)
        finally:
            os.close(fd4)
        st = c.status()
        assert [ck["path"] for ck in st["checkpoints"]] == [os.path.realpath(ck_dir)]
    old.close()
    new.close()


def write_index_checkpoint(d, seed):
    """Three shards and an index, written here (small)."""
    os.makedirs(d, exist_ok=True)
    shards = {
        "model-00001-of-00003.safetensors": [("embed.weight", "BF16", [512, 128]), ("norm.weight", "F32", [128])],
        "model-00002-of-00003.safetensors": [("layers.0.w", "F16", [128, 384]), ("layers.0.b", "U8", [999])],
        "model-00003-of-00003.safetensors": [("head.weight", "BF16", [300, 128])],
    }
    wm = {}
    for fname, tensors in shards.items():
        write_safetensors(os.path.join(d, fname), tensors, seed=seed)
        for t in tensors:
            wm[t[0]] = fname
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return d


def test_replaced_middle_shard_of_an_index(daemon, scratch):
    target, stage = scratch
    ck_dir = write_index_checkpoint(os.path.join(target, "idx"), seed=1)
    new_dir = write_index_checkpoint(os.path.join(stage, "idx"), seed=2)
    old = Checkpoint(ck_dir)
    with daemon.connect() as c:
        r1 = c.call("load", path=ck_dir)
        shard = "model-00002-of-00003.safetensors"
        os.rename(os.path.join(new_dir, shard), os.path.join(ck_dir, shard))
        new = Checkpoint(ck_dir)
        assert tensors_differ(old, new, "layers.0.w") and not tensors_differ(old, new, "head.weight")
        att, fd = c.attach(path=ck_dir, device=0)
        try:
            assert att["set"] != r1["set"]
            assert verify_attached(att, fd, new) == new.payload_bytes()
        finally:
            os.close(fd)
    old.close()
    new.close()


def test_rewritten_in_place_same_size(daemon, scratch):
    """A shard rewritten in place (same inode and size, new mtime) is not served stale."""
    target, _ = scratch
    ck_dir = os.path.join(target, "inplace")
    os.makedirs(ck_dir)
    p = os.path.join(ck_dir, "model.safetensors")
    tensors = [("w", "F32", [256, 256]), ("b", "U8", [4000])]
    write_safetensors(p, tensors, seed=1)
    with daemon.connect() as c:
        r1 = c.call("load", path=ck_dir)
        tmp = p + ".new"
        write_safetensors(tmp, tensors, seed=2)
        with open(tmp, "rb") as f:
            data = f.read()
        os.unlink(tmp)
        st0 = os.stat(p)
        with open(p, "r+b") as f:
            f.write(data)
        os.utime(p, ns=(st0.st_atime_ns, st0.st_mtime_ns + 2_000_000_000))
        assert os.stat(p).st_ino == st0.st_ino
        new = Checkpoint(ck_dir)
        att, fd = c.attach(path=ck_dir, device=0)
        try:
            assert att["set"] != r1["set"]
            verify_attached(att, fd, new)
        finally:
            os.close(fd)
        new.close()


def test_truncated_after_open_before_load(daemon, scratch, tiny):
    target, _ = scratch
    ck_dir = mkcheckpoint(os.path.join(target, "q"), "qwen3-0.6b", 1, seed=21)
    shard = os.path.join(ck_dir, "model.safetensors")
    with daemon.connect() as c:
        other = c.call("load", path=tiny["a"])["set"]
        c.call("open", path=ck_dir)
        os.truncate(shard, os.path.getsize(shard) // 2)
        code = c.error("load", path=ck_dir)
        assert code in ("FAULT", "STALE", "BAD_SIZE"), code
        assert c.error("attach", path=ck_dir, device=0) in ("FAULT", "STALE", "BAD_SIZE")
        st = c.status()
        assert [s["set"] for s in st["sets"]] == [other]
        assert all(ck["path"] != os.path.realpath(ck_dir) for ck in st["checkpoints"])
        # The daemon serves on, other sets included.
        ck = Checkpoint(tiny["a"])
        att, fd = c.attach(set=other)
        try:
            verify_attached(att, fd, ck)
        finally:
            os.close(fd)
        ck.close()
    daemon.check_serving()


def test_truncated_while_loading(start_daemon, scratch, tiny):
    target, _ = scratch
    ck_dir = mkcheckpoint(os.path.join(target, "q"), "qwen3-0.6b", 1, seed=31)
    shard = os.path.join(ck_dir, "model.safetensors")
    d = start_daemon({"fill_threads": 1})
    with d.connect() as c:
        c.start("load", id="L", path=ck_dir, device=0)
        first, _ = c.recv()
        assert first.get("event") == "progress", first
        os.truncate(shard, os.path.getsize(shard) // 2)
        m, _ = c.wait("L")
        assert "error" in m and m["error"]["code"] in ("FAULT", "STALE"), m
        st = wait_until(lambda: (lambda s: s if s["sets"] == [] else None)(c.status()), timeout=30 * SLOW,
                        what="no set left")
        assert st["devices"][0]["used"] == 0 and st["daemon"]["leases"] == 0
        # A new client loads something else.
        ck = Checkpoint(tiny["b"])
        with d.connect() as c2:
            att, fd = c2.attach(path=tiny["b"], device=0)
            try:
                verify_attached(att, fd, ck)
            finally:
                os.close(fd)
        ck.close()
    d.assert_alive()
