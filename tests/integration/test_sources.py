"""Where a load's bytes come from, through the real daemon: the `source` load
option, the `source`, `root_sources` and `auto_direct_bytes` settings, the
fallback where O_DIRECT is refused, the page cache a direct load leaves
alone, and the checkpoint identities (layout id, content id) status shows.

The layout and content ids are recomputed here from the files, from the
encoding docs/architecture.md ("Identity") gives, with the xxhash package's
XXH3-128: an oracle independent of the daemon's code.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import tempfile

import pytest
import xxhash

from conftest import SLOW, WEIGHTD
from wdclient import Checkpoint, verify_attached, write_safetensors

PAGE = os.sysconf("SC_PAGE_SIZE")
CHUNK = 4 << 20
TENSORS = [("embed", "BF16", [1000, 513]), ("w.0", "F32", [300, 301]), ("w.1", "F16", [4097, 3]), ("norm", "BF16", [777])]


# ---- the ids, recomputed ---------------------------------------------------------------------


def _u64(v):
    return struct.pack("<Q", v)


def _str(b):
    return _u64(len(b)) + b


def shard_files(d):
    """The checkpoint's shard files in its order, and its layout kind (0 index, 1 single, 2 file)."""
    ix = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(os.path.join(d, "model.safetensors")):
        return ["model.safetensors"], 1
    with open(ix) as f:
        wm = json.load(f)["weight_map"]
    return sorted(set(wm.values())), 0


def layout_id(d):
    files, kind = shard_files(d)
    h = hashlib.sha256(b"weightd-layout-v1" + _u64(kind) + _u64(len(files)))
    where = {}
    for i, rel in enumerate(files):
        p = os.path.join(d, rel)
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            hdr = json.loads(f.read(n))
        meta = hdr.pop("__metadata__", None) or {}
        h.update(_str(rel.encode()) + _u64(os.path.getsize(p)) + _u64(8 + n) + _u64(len(hdr)))
        for name in sorted(hdr, key=lambda s: s.encode()):
            t = hdr[name]
            h.update(_str(name.encode()) + _str(t["dtype"].encode()) + _u64(len(t["shape"])))
            h.update(b"".join(_u64(x) for x in t["shape"]) + _u64(t["data_offsets"][0]) + _u64(t["data_offsets"][1]))
            where[name] = i
        h.update(_u64(len(meta)))
        for k in sorted(meta, key=lambda s: s.encode()):
            h.update(_str(k.encode()) + _str(meta[k].encode()))
    h.update(_u64(len(where)))
    for name in sorted(where, key=lambda s: s.encode()):
        h.update(_str(name.encode()) + _u64(where[name]))
    return h.hexdigest()


def content_id(d):
    files, _ = shard_files(d)
    h = hashlib.sha256(b"weightd-content-v1" + bytes.fromhex(layout_id(d)) + _u64(len(files)))
    for rel in files:
        chunks = b""
        with open(os.path.join(d, rel), "rb") as f:
            while True:
                b = f.read(CHUNK)
                if not b:
                    break
                chunks += xxhash.xxh3_128(b).digest()
        h.update(xxhash.xxh3_128(chunks).digest())
    return h.hexdigest()


@pytest.fixture
def models(model_root):
    """a: a checkpoint; a_copy: the same bytes elsewhere; tuned: the same layout, other bytes; multi: two shards."""
    top = tempfile.mkdtemp(prefix="src-", dir=model_root)
    out = {}
    for name, seed in (("a", 1), ("tuned", 2)):
        out[name] = os.path.join(top, name)
        os.makedirs(out[name])
        write_safetensors(os.path.join(out[name], "model.safetensors"), TENSORS, seed=seed, metadata={"format": "pt"})
    out["a_copy"] = os.path.join(top, "a_copy")
    shutil.copytree(out["a"], out["a_copy"])
    out["multi"] = os.path.join(top, "multi")
    os.makedirs(out["multi"])
    wm = {}
    for i, part in enumerate((TENSORS[:2], TENSORS[2:])):
        rel = f"model-0000{i + 1}-of-00002.safetensors"
        write_safetensors(os.path.join(out["multi"], rel), part, seed=3)
        wm.update({t[0]: rel for t in part})
    with open(os.path.join(out["multi"], "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    yield out
    shutil.rmtree(top, ignore_errors=True)


def test_layout_and_content_ids(daemon, models):
    """The layout id is known at open; the content id once a whole prefetch has digested the files; both match
    the recomputed ones, copies share both, a fine-tune shares only the layout id."""
    with daemon.connect() as c:
        ids = {}
        for name in ("a", "a_copy", "tuned", "multi"):
            ck = c.call("open", path=models[name])["checkpoint"]
            assert ck["layout_id"] == layout_id(models[name]), name
            assert ck["content_id"] is None, ck  # nothing has read the whole files yet
            ck = c.call("prefetch", path=models[name], wait=True)["checkpoint"]
            assert ck["content_id"] == content_id(models[name]), name
            ids[name] = (ck["layout_id"], ck["content_id"])
        assert ids["a"] == ids["a_copy"]
        assert ids["a"][0] == ids["tuned"][0] and ids["a"][1] != ids["tuned"][1]
        assert ids["multi"][0] != ids["a"][0]
        # Status shows them for checkpoints and for their sets.
        rep = c.call("load", path=models["a"])
        st = c.status()
        (s,) = [x for x in st["sets"] if x["set"] == rep["set"]]
        assert (s["layout_id"], s["content_id"]) == ids["a"]
        assert {ck["path"]: (ck["layout_id"], ck["content_id"]) for ck in st["checkpoints"]}[
            os.path.realpath(models["tuned"])] == ids["tuned"]
    assert "content id " + ids["a"][1] in daemon.log_text()


@pytest.mark.parametrize("source", ["mmap", "direct", "auto"])
def test_load_source_option(start_daemon, models, source):
    """A load's source option chooses how its bytes are read; the reply says what read them, the bytes match."""
    d = start_daemon(settings={"auto_direct_bytes": "1"})  # auto: always past the threshold
    want = {"mmap": "mmap", "direct": "direct", "auto": "pagecache+direct"}[source]
    with d.connect() as c:
        rep = c.call("load", path=models["multi"], source=source)
        assert rep["read_from"] == want, rep
        read = rep["read_bytes"]
        assert sum(read.values()) == Checkpoint(models["multi"]).payload_bytes(), read
        if source == "direct":
            assert set(read) == {"direct"}
        att, fd = c.attach(path=models["multi"])
        assert att["set"] == rep["set"]
        assert verify_attached(att, fd, Checkpoint(models["multi"])) == Checkpoint(models["multi"]).payload_bytes()
        os.close(fd)
        st = c.status()
        (s,) = st["sets"]
        assert s["read_from"] == want


def test_bad_source_is_refused(daemon, models):
    with daemon.connect() as c:
        m, _ = c.request("load", path=models["a"], source="tape")
        e = m["error"]
        assert e["code"] == "BAD_REQUEST" and "field 'source'" in e["message"] and "auto, mmap, direct" in e["message"]
        assert c.error("load", path=models["a"], source=7) == "BAD_REQUEST"
        assert c.status()["sets"] == []


def test_root_sources(start_daemon, models, model_root):
    """root_sources gives a directory its own source; the longest match wins; elsewhere 'source' applies."""
    top = os.path.dirname(models["a"])
    d = start_daemon(settings={"root_sources": f"direct:{top}", "source": "mmap"})
    with d.connect() as c:
        assert c.call("load", path=models["a"])["read_from"] == "direct"
        assert c.call("load", path=models["a"], source="mmap", plan={"outputs": [
            {"name": "n", "dtype": "BF16", "shape": [777], "pieces": [{"tensor": "norm"}]}]})["read_from"] == "mmap"
    assert "read through source direct" in d.log_text()


def test_bad_root_sources_refuse_to_start(workdir, model_root):
    for entry, msg in (("tape:/", "'tape' is not one of auto, mmap, direct"), ("direct", "not SOURCE:DIR"),
                       ("direct:/no/such/dir", "root_sources entry 0: /no/such/dir")):
        sock = os.path.join(tempfile.mkdtemp(prefix="rs-", dir=workdir), "s.sock")
        r = subprocess.run([WEIGHTD, "--foreground", "--backend", "host", "--socket", sock, "--model-root", model_root,
                            "--set", "metrics_address=", "--set", f"root_sources={entry}"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30 * SLOW)
        assert r.returncode != 0 and msg in r.stderr, (entry, r.returncode, r.stderr)


def test_refused_odirect_falls_back_to_mmap(start_daemon, models):
    d = start_daemon(settings={"test_refuse_odirect": "on"})
    with d.connect() as c:
        rep = c.call("load", path=models["a"], source="direct")
        assert rep["read_from"] == "mmap" and set(rep["read_bytes"]) == {"mmap"}, rep
        att, fd = c.attach(path=models["a"])
        assert verify_attached(att, fd, Checkpoint(os.path.join(models["a"], "model.safetensors"))) > 0
        os.close(fd)
    assert "the filesystem refuses O_DIRECT (test_refuse_odirect): reading through the page cache (mmap) instead" \
        in d.log_text()


def _evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_direct_load_leaves_the_page_cache_alone(daemon, model_root):
    """A cold 48 MiB checkpoint loaded with O_DIRECT: the page cache holds no more of it after than before."""
    top = tempfile.mkdtemp(prefix="cold-", dir=model_root)
    p = os.path.join(top, "model.safetensors")
    write_safetensors(p, [("a", "BF16", [4096, 4096]), ("b", "F32", [1024, 4095])], seed=9)
    _evict(p)
    try:
        with daemon.connect() as c:
            before = c.call("open", path=top)["checkpoint"]["resident_bytes"]
            rep = c.call("load", path=top, source="direct")
            assert rep["read_from"] == "direct"
            (ck,) = [x for x in c.status()["checkpoints"] if x["path"] == os.path.realpath(top)]
            after = ck["resident_bytes"]
            print("page cache before", before, "after", after)
            assert after <= before, (before, after)
            att, fd = c.attach(path=top)
            assert verify_attached(att, fd, Checkpoint(p)) > 0
            os.close(fd)
    finally:
        shutil.rmtree(top, ignore_errors=True)
