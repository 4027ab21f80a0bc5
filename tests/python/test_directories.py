"""Checkpoint directories through `weightctl inspect`.

Shards are written by the reference package; the directory around them (index,
symlinks, missing pieces) is laid out here. Valid layouts must be reported as
the reference reads each shard; broken ones must fail with one
'weightctl: ' line naming what is wrong.
"""
import hashlib
import json
import os

import stref

SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def shard_bytes(names, seed=0, dtype="BF16"):
    return stref.serialize({n: (dtype, [2, 3], stref.fill(12, seed + i)) for i, n in enumerate(names)},
                           {"format": "pt"})


def write_index(d, weight_map, total_size=None):
    index = {"metadata": {"total_size": total_size if total_size is not None else 12 * len(weight_map)},
             "weight_map": weight_map}
    (d / INDEX).write_text(json.dumps(index, indent=2))


def two_shard_checkpoint(d):
    """A valid two-shard checkpoint: a, b in shard 1; c in shard 2."""
    d.mkdir(parents=True, exist_ok=True)
    (d / SHARD1).write_bytes(shard_bytes(["a", "b"]))
    (d / SHARD2).write_bytes(shard_bytes(["c"], seed=5))
    write_index(d, {"a": SHARD1, "b": SHARD1, "c": SHARD2})
    return d


def assert_matches_shards(d, js, layout):
    """inspect --json of directory d agrees with the reference on every shard."""
    assert js["layout"] == layout, js["layout"]
    bad, refs = [], []
    for i, shard in enumerate(js["shards"]):
        ref = stref.reference((d / shard["file"]).read_bytes())
        assert ref.ok, ref.error
        refs.append(ref)
        bad += stref.compare_shard(ref, shard, i, js["tensors"])
    bad += stref.compare_totals(js, refs)
    assert not bad, "\n  ".join(bad)


def test_index_checkpoint(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    res, js = stref.inspect_json(d)
    assert js is not None, res.describe()
    assert sorted(s["file"] for s in js["shards"]) == [SHARD1, SHARD2]
    assert_matches_shards(d, js, "index")
    assert js["tensor_count"] == 3 and js["config"] is None


def test_missing_shard(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    (d / SHARD2).unlink()
    stref.expect_error(d, SHARD2)


def test_tensor_in_index_absent_from_shard(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    write_index(d, {"a": SHARD1, "b": SHARD1, "c": SHARD2, "ghost.weight": SHARD2})
    stref.expect_error(d, "ghost.weight")


def test_tensor_in_two_shards(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    (d / SHARD2).write_bytes(shard_bytes(["c", "a"], seed=5))
    stref.expect_error(d, "'a'")


def test_weight_map_dotdot_refused(tmp_path, weightctl):
    """A weight_map entry with a '..' component is refused even when the file is valid."""
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(shard_bytes(["c"], seed=5))
    for i, target in enumerate(["../outside.safetensors", "sub/../" + SHARD2, "../ckpt2/" + SHARD2]):
        d = two_shard_checkpoint(tmp_path / f"ckpt{i}")
        (d / "sub").mkdir()
        write_index(d, {"a": SHARD1, "b": SHARD1, "c": target})
        res = stref.expect_error(d)
        assert ".." in res.stderr, f"{target}: the message does not show the path: {res.stderr!r}"


def test_weight_map_absolute_refused(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    write_index(d, {"a": SHARD1, "b": SHARD1, "c": str(d / SHARD2)})
    assert os.path.isabs(str(d / SHARD2))
    stref.expect_error(d)


def test_hugging_face_cache_layout(tmp_path, weightctl):
    """snapshots/<rev>/<name> -> ../../blobs/<sha256>: inspected through the links."""
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / ("0123456789abcdef" * 3)[:40]
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snap.name)
    files = {SHARD1: shard_bytes(["a", "b"]), SHARD2: shard_bytes(["c"], seed=5),
             INDEX: json.dumps({"metadata": {"total_size": 36},
                                "weight_map": {"a": SHARD1, "b": SHARD1, "c": SHARD2}}).encode()}
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        os.symlink(f"../../blobs/{sha}", snap / name)
    res, js = stref.inspect_json(snap)
    assert js is not None, "weightctl refused a Hugging Face cache snapshot\n" + res.describe()
    assert sorted(s["file"] for s in js["shards"]) == [SHARD1, SHARD2]
    assert_matches_shards(snap, js, "index")


def test_linked_file_keeps_its_name(tmp_path, weightctl):
    """A bare file path that is a symlink into blobs/ is reported under the name given."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    data = shard_bytes(["c"], seed=5)
    sha = hashlib.sha256(data).hexdigest()
    (blobs / sha).write_bytes(data)
    os.symlink(f"../../blobs/{sha}", snap / SHARD2)
    files = {SHARD2: data}
    res, js = stref.inspect_json(snap / SHARD2)
    assert js is not None, res.describe()
    assert js["layout"] == "file" and js["shards"][0]["file"] == SHARD2
    bad = stref.compare_file(stref.reference(files[SHARD2]), js, SHARD2)
    assert not bad, bad


def test_bare_file(tmp_path, weightctl):
    path = tmp_path / "weights.safetensors"
    buf = shard_bytes(["x", "y"])
    path.write_bytes(buf)
    res, js = stref.inspect_json(path)
    assert js is not None, res.describe()
    assert not stref.compare_file(stref.reference(buf), js, path.name)


def test_single_file_directory(tmp_path, weightctl):
    d = tmp_path / "single"
    d.mkdir()
    (d / "model.safetensors").write_bytes(shard_bytes(["x", "y", "z"]))
    res, js = stref.inspect_json(d)
    assert js is not None, res.describe()
    assert [s["file"] for s in js["shards"]] == ["model.safetensors"]
    assert_matches_shards(d, js, "single")


def test_empty_directory(tmp_path, weightctl):
    d = tmp_path / "empty"
    d.mkdir()
    stref.expect_error(d)


def test_nonexistent_path(tmp_path, weightctl):
    stref.expect_error(tmp_path / "no-such-checkpoint", "no-such-checkpoint")


def test_invalid_index(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    (d / INDEX).write_text('{"weight_map": {"a": ')
    stref.expect_error(d, INDEX)
    (d / INDEX).write_text('{"metadata": {}}')
    stref.expect_error(d, INDEX)


def test_invalid_shard_in_index(tmp_path, weightctl):
    d = two_shard_checkpoint(tmp_path / "ckpt")
    buf = bytearray((d / SHARD2).read_bytes())
    buf[8] = ord("[")  # the header no longer starts an object
    (d / SHARD2).write_bytes(bytes(buf))
    assert not stref.reference(bytes(buf)).ok
    stref.expect_error(d, SHARD2)
