"""Manifests (common/manifest.h): `weightctl manifest` and `weightctl verify`, and the daemon's
`verify: on_load`.

The oracle is independent of the C code: the PyPI xxhash package computes every chunk, tensor and
file digest from the files here (tensor digests are manifest.h's tree of 256 KiB leaves:
wdclient.tensor_digest), and hashlib their SHA-256s. The content id, which needs the layout
id, is compared with the one the daemon computes itself while a whole prefetch digests the files
(daemon/state/registry_pin.c, a separate code path). Corruption is a byte flipped at a known
offset, inside a known tensor, and each check must name that file, that chunk and that tensor.
"""
import hashlib
import json
import os
import shutil
import struct
import subprocess
import time
import urllib.request

import pytest

from wdclient import LEAF_BYTES, WDError, verify_attached, write_safetensors, tensor_digest, Checkpoint
from wdfixtures import WEIGHTCTL, native_env

try:
    import xxhash
except ImportError as e:  # a missing oracle fails the tests; nothing is skipped
    xxhash = None
    XXHASH_ERROR = e

CHUNK = 4 << 20
MANIFEST = "weightd.manifest.json"

# Two shards of a few chunks each, tensors crossing chunk boundaries, one empty tensor.
SHARDS = {
    "model-00001-of-00002.safetensors": [("embed.weight", "BF16", [3000, 1024]), ("norm.weight", "F32", [1024]),
                                         ("empty", "F16", [0, 7])],
    "model-00002-of-00002.safetensors": [("layers.0.w", "F16", [2048, 1536]), ("layers.0.b", "U8", [12345]),
                                         ("head.weight", "BF16", [1000, 1024])],
}


def need_xxhash():
    if xxhash is None:
        pytest.fail(f"the xxhash package is needed as the digest oracle ({XXHASH_ERROR}): "
                    "pip install -r tests/requirements.txt")


def write_checkpoint(d, seed=1):
    os.makedirs(d, exist_ok=True)
    weight_map = {}
    for shard, tensors in SHARDS.items():
        write_safetensors(os.path.join(d, shard), tensors, seed=seed)
        weight_map.update({name: shard for name, _, _ in tensors})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return 8 + n, h


def oracle(d):
    """{shard: (chunk digests, tensor digests in data-offset order, file digest, sha256)} from the files."""
    need_xxhash()
    out = {}
    for shard in SHARDS:
        data = open(os.path.join(d, shard), "rb").read()
        chunks = [xxhash.xxh3_128(data[i:i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK)]
        start, h = header(os.path.join(d, shard))
        ts = sorted(h.values(), key=lambda t: t["data_offsets"][0])
        tensors = [tensor_digest(data[start + t["data_offsets"][0]:start + t["data_offsets"][1]]) for t in ts]
        whole = xxhash.xxh3_128(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()
        out[shard] = (chunks, tensors, whole, hashlib.sha256(data).hexdigest())
    return out


def ctl(*args, check=None):
    r = subprocess.run([WEIGHTCTL, *args], capture_output=True, text=True, timeout=300, env=native_env())
    if check is not None:
        assert r.returncode == check, f"weightctl {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def chunk_bytes_text(path, off):
    """How the chunk holding file offset off is named: "bytes LO-HI" (the last chunk is short)."""
    lo = off // CHUNK * CHUNK
    return f"bytes {lo}-{min(lo + CHUNK, os.path.getsize(path)) - 1}"


def tensor_offset(d, shard, name, within=0):
    """The file offset of byte `within` of tensor `name` in shard."""
    start, h = header(os.path.join(d, shard))
    return start + h[name]["data_offsets"][0] + within


def metric(d, name):
    """The value of an unlabelled sample on the daemon's /metrics."""
    text = urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} on /metrics")


@pytest.fixture
def ckpt(model_root, request):
    d = write_checkpoint(os.path.join(model_root, "mf-" + request.node.name[:40]))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- weightctl manifest / verify ----------------------------------------------------------


def test_manifest_digests_match_an_independent_oracle(ckpt, daemon):
    r = ctl("manifest", ckpt, check=0)
    assert os.path.join(ckpt, MANIFEST) in r.stdout
    m = json.load(open(os.path.join(ckpt, MANIFEST)))
    assert (m["format"], m["version"], m["hash"], m["chunk_bytes"]) == ("weightd-manifest", 2, "xxh3-128", CHUNK)
    assert m["leaf_bytes"] == LEAF_BYTES
    want = oracle(ckpt)
    assert [f["name"] for f in m["files"]] == list(SHARDS)
    for f in m["files"]:
        chunks, tensors, whole, _ = want[f["name"]]
        assert f["size"] == os.path.getsize(os.path.join(ckpt, f["name"]))
        assert len(chunks) >= 2  # the chunking is exercised, not one short chunk
        assert f["chunks"] == chunks
        assert f["tensors"] == tensors
        assert f["digest"] == whole
    # Trees and plain digests both: tensors of many whole leaves, of many with a short last one, and of one.
    sizes = [e - b for s in SHARDS for b, e in (v["data_offsets"] for v in header(os.path.join(ckpt, s))[1].values())]
    assert sum(n > LEAF_BYTES for n in sizes) == 3 and sum(n > LEAF_BYTES and n % LEAF_BYTES != 0 for n in sizes) == 2
    assert sum(n <= LEAF_BYTES for n in sizes) == 3
    # The content id from the layout id and the file digests (docs/architecture.md, "Identity").
    h = hashlib.sha256(b"weightd-content-v1" + bytes.fromhex(m["layout_id"]) + struct.pack("<Q", len(SHARDS)))
    for f in m["files"]:
        h.update(bytes.fromhex(want[f["name"]][2]))
    assert m["content_id"] == h.hexdigest()
    # The daemon's prefetch digests the files by its own reads, chunk by chunk in parallel: the same ids.
    with daemon.connect() as c:
        c.call("prefetch", path=ckpt, wait=True)
        deadline = time.monotonic() + 60
        while True:
            st = [k for k in c.status()["checkpoints"] if k["path"] == os.path.realpath(ckpt)]
            if (st and st[0]["content_id"]) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert st and st[0]["content_id"] == m["content_id"], st
        assert st[0]["layout_id"] == m["layout_id"]


def test_verify_passes_then_names_a_flipped_byte(ckpt):
    ctl("manifest", ckpt, check=0)
    r = ctl("verify", ckpt, check=0)
    assert "match the manifest" in r.stdout
    shard = "model-00002-of-00002.safetensors"
    off = tensor_offset(ckpt, shard, "layers.0.w", within=5_000_000)
    flip(os.path.join(ckpt, shard), off)
    r = ctl("verify", ckpt, check=1)
    lo = off // CHUNK * CHUNK
    path = os.path.join(ckpt, shard)
    line = f"{path}: {chunk_bytes_text(path, off)} differ from the manifest (tensors: layers.0.w)"
    assert line in r.stderr, r.stderr
    assert "BAD_CHECKSUM" in r.stderr or "1 of 2 file(s) differ (1 of" in r.stderr, r.stderr
    r = ctl("--json", "verify", ckpt, check=1)
    out = json.loads(r.stdout)
    assert out["ok"] is False and out["chunks_differing"] == 1 and out["error"]["code"] == "BAD_CHECKSUM"
    assert [f["chunks_differ"] for f in out["files"]] == [[], [lo]]


def test_verify_sha256_list(ckpt, tmp_path):
    want = oracle(ckpt)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("".join(f"{want[s][3]}  {s}\n" for s in SHARDS))
    r = ctl("verify", ckpt, "--sha256", str(sums), check=0)  # no manifest: the list alone
    assert "match the SHA-256 list" in r.stdout
    # A wrong digest for one file names that file; a file missing from the list fails too.
    bad = want["model-00001-of-00002.safetensors"][3][:-1] + ("0" if want["model-00001-of-00002.safetensors"][3][-1] != "0" else "1")
    sums.write_text(f"{bad} *model-00001-of-00002.safetensors\n")
    r = ctl("verify", ckpt, "--sha256", str(sums), check=1)
    assert "model-00001-of-00002.safetensors: SHA-256 differs from the list" in r.stderr, r.stderr
    assert "model-00002-of-00002.safetensors: SHA-256 is not in the list" in r.stderr, r.stderr
    sums.write_text("not a digest line\n")
    r = ctl("verify", ckpt, "--sha256", str(sums), check=2)
    assert "line 1" in r.stderr


def test_sha256_names_shared_by_two_shards(model_root, tmp_path):
    """Shards a/model.safetensors and b/model.safetensors: each is matched by its own name in the index,
    never by the other's last component; a list naming other files of the repository changes nothing."""
    d = os.path.join(model_root, "mf-twins")
    try:
        weight_map = {}
        for sub, seed in (("a", 1), ("b", 2)):
            os.makedirs(os.path.join(d, sub))
            write_safetensors(os.path.join(d, sub, "model.safetensors"), [(f"{sub}.w", "F32", [5000])], seed=seed)
            weight_map[f"{sub}.w"] = f"{sub}/model.safetensors"
        json.dump({"weight_map": weight_map}, open(os.path.join(d, "model.safetensors.index.json"), "w"))
        sums = {s: hashlib.sha256(open(os.path.join(d, s, "model.safetensors"), "rb").read()).hexdigest() for s in "ab"}
        lst = tmp_path / "SUMS"
        lst.write_text(f"{sums['a']}  a/model.safetensors\n{sums['b']}  b/model.safetensors\n"
                       f"{'0' * 64}  original/model.safetensors\n")
        ctl("verify", d, "--sha256", str(lst), check=0)
        # Two lines for one shard with different digests: refused, naming it.
        lst.write_text(f"{sums['a']}  a/model.safetensors\n{sums['b']}  a/model.safetensors\n")
        r = ctl("verify", d, "--sha256", str(lst), check=2)
        assert "line 2 gives a/model.safetensors another SHA-256" in r.stderr, r.stderr
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_verify_without_manifest_or_list_is_a_usage_error(ckpt):
    r = ctl("verify", ckpt, check=2)
    assert MANIFEST in r.stderr


# ---- the daemon ---------------------------------------------------------------------------------


def test_on_load_checks_the_files(start_daemon, ckpt):
    ctl("manifest", ckpt, check=0)
    d = start_daemon(settings={"verify": "on_load"}, metrics=True)
    with d.connect() as c:
        r = c.call("load", path=ckpt)
        att, fd = c.attach(set=r["set"])
        try:
            assert verify_attached(att, fd, Checkpoint(ckpt)) > 0
        finally:
            os.close(fd)
        c.call("release", lease=att["lease"])
        c.call("evict", set=r["set"])
        c.call("close", path=ckpt)
    assert metric(d, "weightd_verified_chunks_total") == sum(len(v[0]) for v in oracle(ckpt).values())
    assert metric(d, "weightd_verify_mismatches_total") == 0
    # A byte flipped in the files (the manifest made before): the load fails naming the file and its chunk.
    shard = "model-00001-of-00002.safetensors"
    off = tensor_offset(ckpt, shard, "embed.weight", within=4_300_000)
    flip(os.path.join(ckpt, shard), off)
    with d.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("load", path=ckpt)
        assert e.value.code == "BAD_CHECKSUM", e.value.reply
        msg = e.value.reply["error"]["message"]
        assert f"{shard}: {chunk_bytes_text(os.path.join(ckpt, shard), off)} differ from {MANIFEST}" in msg, msg
        assert c.status()["sets"] == [] or all(s["state"] != "ready" for s in c.status()["sets"])
    assert "differ from weightd.manifest.json (verify on_load)" in d.log_tail(50)
    assert metric(d, "weightd_verify_mismatches_total") >= 1


def test_on_load_without_a_manifest_checks_nothing(start_daemon, ckpt):
    d = start_daemon(settings={"verify": "on_load"}, metrics=True)
    with d.connect() as c:
        c.call("load", path=ckpt)
    assert metric(d, "weightd_verified_chunks_total") == 0


def test_off_by_default_and_a_foreign_manifest_refused(daemon, start_daemon, ckpt, model_root):
    ctl("manifest", ckpt, check=0)
    flip(os.path.join(ckpt, "model-00002-of-00002.safetensors"),
         tensor_offset(ckpt, "model-00002-of-00002.safetensors", "head.weight", within=10))
    with daemon.connect() as c:
        r = c.call("load", path=ckpt)  # verify and scrub are off: the manifest is read and checked, the bytes are not
        c.call("evict", set=r["set"])
        c.call("close", path=ckpt)
    # With scrub on, every output that is a whole tensor is checked against the manifest's tensor digest once
    # loaded (the set's own digests; test_scrub.py), whatever verify says.
    scrubbing = start_daemon(settings={"scrub": "on"})
    with scrubbing.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("load", path=ckpt)
        assert e.value.code == "BAD_CHECKSUM"
        assert f"tensor 'head.weight' as loaded differs from {MANIFEST}" in e.value.message
        assert c.status()["sets"] == []
        c.call("close", path=ckpt)
    # A manifest of other files (another layout) makes every open fail, naming it.
    other = os.path.join(model_root, "mf-other")
    try:
        os.makedirs(other)
        write_safetensors(os.path.join(other, "model.safetensors"), [("x", "F32", [1000])], seed=3)
        ctl("manifest", other, check=0)
        shutil.copy(os.path.join(other, MANIFEST), os.path.join(ckpt, MANIFEST))
    finally:
        shutil.rmtree(other, ignore_errors=True)
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert e.value.code == "BAD_CHECKSUM"
        assert f"{MANIFEST}: describes another layout" in e.value.reply["error"]["message"]
    # Malformed: not JSON, then a chunk list of the wrong length.
    open(os.path.join(ckpt, MANIFEST), "w").write("{\"format\": ")
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert e.value.code == "BAD_CHECKSUM" and f"{MANIFEST}: not JSON" in e.value.reply["error"]["message"]
    ctl("manifest", ckpt, check=0)
    m = json.load(open(os.path.join(ckpt, MANIFEST)))
    m["files"][1]["chunks"].pop()
    json.dump(m, open(os.path.join(ckpt, MANIFEST), "w"))
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert "model-00002-of-00002.safetensors: \"chunks\" is not" in e.value.reply["error"]["message"]
    # A key given twice, and a file far longer than a manifest of these files can be: refused before parsing.
    ctl("manifest", ckpt, check=0)
    text = open(os.path.join(ckpt, MANIFEST)).read()
    open(os.path.join(ckpt, MANIFEST), "w").write(text.replace('"version":2', '"version":2,"version":2', 1))
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert '"version" is given twice' in e.value.reply["error"]["message"]
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        f.write("[" + "0," * 4_000_000 + "0]")
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert "more than a manifest of these files can be" in e.value.reply["error"]["message"]


def test_a_version_1_manifest_is_refused_until_written_again(daemon, ckpt):
    """A manifest of the plain tensor digests (version 1, as written before the tree): every open and
    `weightctl verify` refuse it, saying to write it again; `weightctl manifest` does, and it is read."""
    need_xxhash()
    ctl("manifest", ckpt, check=0)
    path = os.path.join(ckpt, MANIFEST)
    m = json.load(open(path))
    v1 = json.loads(json.dumps(m))  # a deep copy
    v1["version"] = 1
    del v1["leaf_bytes"]
    data = {s: open(os.path.join(ckpt, s), "rb").read() for s in SHARDS}
    for f in v1["files"]:
        start, h = header(os.path.join(ckpt, f["name"]))
        ts = sorted(h.values(), key=lambda t: t["data_offsets"][0])
        f["tensors"] = [xxhash.xxh3_128(data[f["name"]][start + t["data_offsets"][0]:start + t["data_offsets"][1]])
                        .hexdigest() for t in ts]
    assert v1["files"][0]["tensors"] != m["files"][0]["tensors"]  # embed.weight: plain is not the tree
    json.dump(v1, open(path, "w"))
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("open", path=ckpt)
        assert e.value.code == "BAD_CHECKSUM"
        msg = e.value.reply["error"]["message"]
        assert f"{MANIFEST}: version is 1, not 2" in msg and "write it again with `weightctl manifest`" in msg, msg
    r = ctl("verify", ckpt)
    assert r.returncode != 0 and "write it again with `weightctl manifest`" in r.stderr, r.stderr
    ctl("manifest", ckpt, check=0)
    assert json.load(open(path)) == m
    with daemon.connect() as c:
        c.call("open", path=ckpt)
    ctl("verify", ckpt, check=0)
