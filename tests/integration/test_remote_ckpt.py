"""Remote checkpoints opened by URL (daemon/remote/rckpt.h) against a real S3 server.

tests/remote_probe opens checkpoints uploaded to SeaweedFS (signatures enforced) with range GETs:
the index, every shard's header and the manifest beside them, validated by the same code as local
files. Its verdicts are compared with the files: the layout id with the one `weightctl manifest`
computes from the local copy, each tensor's bytes (SHA-256) with the local file's, a damaged header
refused with the code and the rule a local open gives. An anonymous http:// bucket is read unsigned;
a bucket read unsigned where signatures are enforced is refused with the server's status.
"""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from wdclient import write_safetensors
from wdfixtures import REPO, SLOW, WEIGHTCTL

sys.path.insert(0, os.path.dirname(__file__))
from test_remote_creds import Probe, quiet  # noqa: E402

sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
import s3server  # noqa: E402

SHARDS = {
    "model-00001-of-00002.safetensors": [("embed.weight", "BF16", (64, 48)), ("layers.0.w", "F32", (33, 17)),
                                         ("layers.0.b", "F16", (7,))],
    "model-00002-of-00002.safetensors": [("layers.1.w", "BF16", (96, 40)), ("lm_head.weight", "F32", (5, 3, 2)),
                                         ("empty", "F32", (0, 4))],
}
SIGNED = dict(AWS_ACCESS_KEY_ID=s3server.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=s3server.SECRET_KEY,
              AWS_REGION=s3server.REGION)


def write_checkpoint(d, seed=3):
    os.makedirs(d, exist_ok=True)
    weight_map = {}
    for shard, tensors in SHARDS.items():
        write_safetensors(os.path.join(d, shard), tensors, seed=seed)
        weight_map.update({name: shard for name, _, _ in tensors})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, f)
    return d


def upload(s3, bucket, prefix, d):
    s3.create_bucket(bucket)
    for name in sorted(os.listdir(d)):
        s3.put(bucket, f"{prefix}/{name}", os.path.join(d, name))


def local_manifest(d, out):
    r = subprocess.run([WEIGHTCTL, "manifest", d, "--out", out], capture_output=True, text=True, timeout=120 * SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        return json.load(f)


def tensor_sha(d, shard, name):
    with open(os.path.join(d, shard), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
        b, e = h[name]["data_offsets"]
        f.seek(8 + n + b)
        return hashlib.sha256(f.read(e - b)).hexdigest()


@pytest.fixture
def store(tmp_path):
    with s3server.SeaweedS3(tmp_path / "seaweedfs", anonymous_read=["public"], start_timeout=90 * SLOW) as s3:
        yield s3


def probe(store, home, unsigned=False):
    env = quiet(AWS_ENDPOINT_URL_S3=store.endpoint, **SIGNED)
    if unsigned:
        env["WD_PROBE_UNSIGNED"] = "1"
    return Probe(env, home)


def test_index_checkpoint_opened_and_read_by_range(store, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    upload(store, "ckpt", "org/m", d)
    mf = local_manifest(d, str(tmp_path / "weightd.manifest.json"))
    total = sum(os.path.getsize(os.path.join(d, s)) for s in SHARDS)
    ntensors = sum(len(t) for t in SHARDS.values())
    p = probe(store, tmp_path)
    try:
        a = p.ask("open s3://ckpt/org/m")
        words = a.split()
        assert words[0] == "ok", a
        assert words[1:4] == ["index", "2", str(ntensors)], a
        # The layout id of the remote headers equals the one computed from the local files.
        assert words[4] == mf["layout_id"], (a, mf["layout_id"])
        data_bytes = total - sum(8 + int.from_bytes(open(os.path.join(d, s), "rb").read(8), "little")
                                 for s in SHARDS)
        assert int(words[5]) in (total, data_bytes), (a, total, data_bytes)
        # A trailing slash names the same directory.
        assert p.ask("open s3://ckpt/org/m/").split()[:5] == words[:5]
        for shard, tensors in SHARDS.items():
            for name, _, _ in tensors:
                assert p.ask(f"tensor s3://ckpt/org/m {name}") == f"ok {tensor_sha(d, shard, name)}", name
        assert p.ask("tensor s3://ckpt/org/m no.such").startswith("error NOT_FOUND ")
    finally:
        p.close()


def test_single_file_and_missing_objects(store, tmp_path):
    d = str(tmp_path / "one")
    os.makedirs(d)
    write_safetensors(os.path.join(d, "model.safetensors"), SHARDS["model-00001-of-00002.safetensors"], seed=9)
    upload(store, "ckpt", "single", d)
    p = probe(store, tmp_path)
    try:
        # The file named, and its directory (no index: model.safetensors).
        for url, layout in (("s3://ckpt/single/model.safetensors", "file"), ("s3://ckpt/single", "single")):
            a = p.ask(f"open {url}")
            assert a.split()[:4] == ["ok", layout, "1", "3"], (url, a)
        assert p.ask("tensor s3://ckpt/single layers.0.w") == \
            f"ok {tensor_sha(d, 'model.safetensors', 'layers.0.w')}"
        # Beside an index, model.safetensors is what is read, as in a local directory.
        store.put("ckpt", "single/model.safetensors.index.json", b'{"weight_map": {"x": "missing.safetensors"}}')
        assert p.ask("open s3://ckpt/single").split()[:4] == ["ok", "single", "1", "3"]
        # Nothing there: NOT_FOUND naming the URL, never a partial open.
        a = p.ask("open s3://ckpt/nothing-here")
        assert a.startswith("error NOT_FOUND "), a
        assert "s3://ckpt/nothing-here" in a, a
    finally:
        p.close()


def test_damaged_header_refused_as_a_local_open_refuses_it(store, tmp_path):
    d = write_checkpoint(str(tmp_path / "bad"))
    shard = os.path.join(d, "model-00002-of-00002.safetensors")
    raw = bytearray(open(shard, "rb").read())
    # The header gives lm_head.weight a range that runs past the file's end and is longer than its shape.
    n = int.from_bytes(raw[:8], "little")
    text = raw[8:8 + n].decode()
    h = json.loads(text)
    begin = h["lm_head.weight"]["data_offsets"][0]
    h["lm_head.weight"]["data_offsets"] = [begin, len(raw) - 8 - n + 8]
    new = json.dumps(h, separators=(",", ":")).encode()
    new += b" " * (-len(new) % 8)
    open(shard, "wb").write(len(new).to_bytes(8, "little") + new + raw[8 + n:])
    local = subprocess.run([WEIGHTCTL, "--json", "manifest", d, "--out", str(tmp_path / "x.json")], capture_output=True,
                           text=True, timeout=60 * SLOW)
    assert local.returncode != 0, local.stdout
    upload(store, "ckpt", "bad", d)
    p = probe(store, tmp_path)
    try:
        a = p.ask("open s3://ckpt/bad")
    finally:
        p.close()
    # The same code and the same rule from both, each with its own name for the file.
    e = json.loads(local.stdout.splitlines()[0])["error"]
    code, msg = e["code"], e["message"]
    assert msg.startswith(d + ": model-00002-of-00002.safetensors: "), msg
    rule = msg[len(d) + 2:]
    assert a.startswith(f"error {code} "), (code, a)
    assert a.endswith(rule), (rule, a)
    assert "s3://ckpt/bad" in a, a


def test_foreign_manifest_beside_the_index_refused(store, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    other = write_checkpoint(str(tmp_path / "other"), seed=4)
    # A manifest of other bytes with these headers: the layout matches, the content does not.
    local_manifest(other, os.path.join(d, "weightd.manifest.json"))
    upload(store, "ckpt", "mf", d)
    p = probe(store, tmp_path)
    try:
        assert p.ask("open s3://ckpt/mf").split()[0] == "ok"
        # Its digests are refused when bytes are checked against them, which is the integrity work's;
        # a manifest of another layout is refused at open.
        third = str(tmp_path / "third")
        os.makedirs(third)
        write_safetensors(os.path.join(third, "model.safetensors"), SHARDS["model-00002-of-00002.safetensors"])
        local_manifest(third, str(tmp_path / "third.json"))
        store.put("ckpt", "mf/weightd.manifest.json", str(tmp_path / "third.json"))
        a = p.ask("open s3://ckpt/mf")
        assert a.startswith("error BAD_CHECKSUM "), a
        assert "weightd.manifest.json" in a, a
    finally:
        p.close()


def test_http_anonymous_bucket_and_signed_only_bucket(store, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    upload(store, "public", "m", d)
    upload(store, "ckpt", "m", d)
    p = probe(store, tmp_path, unsigned=True)
    try:
        a = p.ask(f"open {store.endpoint}/public/m")
        assert a.split()[:4] == ["ok", "index", "2", "6"], a
        assert p.ask(f"tensor {store.endpoint}/public/m layers.1.w") == \
            f"ok {tensor_sha(d, 'model-00002-of-00002.safetensors', 'layers.1.w')}"
        # Unsigned where the store wants signatures: refused with its status, naming the URL.
        a = p.ask(f"open {store.endpoint}/ckpt/m")
        assert a.startswith("error ") and "403" in a and f"{store.endpoint}/ckpt/m" in a, a
    finally:
        p.close()
