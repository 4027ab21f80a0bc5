"""Checkpoints written by `weightctl mkcheckpoint` load in the reference.

For every preset (with few layers) each shard must deserialize, agree with
`inspect --json` tensor for tensor, and hold exactly the bytes the reference
hands back; the index must map every tensor to the shard holding it; no tensor
may be all zero bytes; the seed must decide the bytes.

The presets keep the published models' full widths, so these files are large
(deepseek-v3 with 4 layers is about 16 GiB); each test deletes what it wrote.
"""
import json
import math
import re
import shutil

import pytest

import stref

# (preset, layers, layout). deepseek-v3 needs 4 layers: layers 0-2 are dense,
# layer 3 is the first MoE layer.
PRESETS = [
    ("qwen3-0.6b", 2, "single"),
    ("qwen3-4b", 2, "index"),
    ("qwen3-8b", 1, "index"),
    ("qwen3-30b-a3b", 1, "index"),
    ("deepseek-v3", 4, "index"),
]
MK_TIMEOUT_S = 600
PROBE = 4096


def mkcheckpoint(out, preset, layers, seed):
    res = stref.run_ctl(["mkcheckpoint", "--preset", preset, "--out", str(out), "--layers", str(layers),
                         "--seed", str(seed)], timeout=MK_TIMEOUT_S)
    assert res.returncode == 0, res.describe()
    return out


def all_zero(data):
    """True when data (a bytes-like object) holds only zero bytes."""
    n = len(data)
    if n == 0:
        return False
    head = bytes(data[:PROBE])
    if head.count(0) != len(head):
        return False
    return bytes(data).count(0) == n


def verify_checkpoint(ckpt, layout):
    """Every check that needs only the files; returns inspect's JSON."""
    res, js = stref.inspect_json(ckpt)
    assert js is not None, "weightctl refused a checkpoint mkcheckpoint wrote\n" + res.describe()
    assert js["layout"] == layout
    bad, refs, zero = [], [], []
    names_by_file = {}
    for i, shard in enumerate(js["shards"]):
        path = ckpt / shard["file"]
        buf = path.read_bytes()

        def check_nonzero(name, data):
            if all_zero(data):
                zero.append(name)

        ref = stref.reference(buf, on_tensor=check_nonzero)
        del buf
        assert ref.ok, f"the reference refuses {shard['file']}: {ref.error}"
        refs.append(ref)
        names_by_file[shard["file"]] = set(ref.tensors)
        bad += [f"{shard['file']}: {b}" for b in stref.compare_shard(ref, shard, i, js["tensors"],
                                                                       expect_file=shard["file"])]
    bad += stref.compare_totals(js, refs)
    assert not bad, "weightctl disagrees with the reference:\n  " + "\n  ".join(bad[:40])
    assert not zero, f"{len(zero)} tensors are all zero bytes, e.g. {zero[:5]}"

    union = [n for names in names_by_file.values() for n in names]
    assert len(union) == len(set(union)), "a tensor appears in two shards"
    if layout == "index":
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        wmap = index["weight_map"]
        assert set(wmap) == set(union), (
            f"weight_map and shards differ: only in the map {sorted(set(wmap) - set(union))[:5]}, "
            f"only in shards {sorted(set(union) - set(wmap))[:5]}")
        wrong = [n for f, names in names_by_file.items() for n in names if wmap[n] != f]
        assert not wrong, f"weight_map points elsewhere for {wrong[:5]}"
        assert set(wmap.values()) == set(names_by_file), "the index names files inspect did not list"
        total = index.get("metadata", {}).get("total_size")
        assert total == js["total_bytes"], f"index total_size {total}, tensor bytes {js['total_bytes']}"
    else:
        assert [s["file"] for s in js["shards"]] == ["model.safetensors"]
    return js


def verify_config(ckpt, js, layers):
    """inspect's config agrees with config.json where they share a field."""
    cfg = json.loads((ckpt / "config.json").read_text())
    got = js["config"]
    assert isinstance(got, dict), f"config {got!r} although config.json exists"
    assert got.get("num_hidden_layers") == layers == cfg["num_hidden_layers"]
    for k, v in got.items():
        if k in cfg and not isinstance(v, (dict, list)):
            assert v == cfg[k], f"config {k}: weightctl {v!r}, config.json {cfg[k]!r}"


def layer_indexes(names):
    return sorted({int(m.group(1)) for n in names for m in [re.match(r"model\.layers\.(\d+)\.", n)] if m})


@pytest.mark.parametrize("preset,layers,layout", PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_loads_in_reference(tmp_path, weightctl, preset, layers, layout):
    ckpt = tmp_path / preset
    try:
        mkcheckpoint(ckpt, preset, layers, seed=1)
        js = verify_checkpoint(ckpt, layout)
        verify_config(ckpt, js, layers)
        names = [t["name"] for t in js["tensors"]]
        assert layer_indexes(names) == list(range(layers))
        if preset == "deepseek-v3":
            verify_deepseek_fp8(js)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def verify_deepseek_fp8(js):
    """FP8 weights are F8_E4M3, each with an F32 [ceil(N/128), ceil(K/128)] scale_inv."""
    by_name = {t["name"]: t for t in js["tensors"]}
    scales = [n for n in by_name if n.endswith(".weight_scale_inv")]
    fp8 = [n for n, t in by_name.items() if t["dtype"].startswith("F8_")]
    assert scales and fp8
    for n in fp8:
        assert by_name[n]["dtype"] == "F8_E4M3", (n, by_name[n]["dtype"])
        assert n + "_scale_inv" in by_name, f"{n} has no scale_inv"
    for s in scales:
        w = by_name.get(s[: -len("_scale_inv")])
        assert w is not None, f"{s} has no weight"
        assert w["dtype"] == "F8_E4M3", (w["name"], w["dtype"])
        sc = by_name[s]
        assert sc["dtype"] == "F32", (s, sc["dtype"])
        rows, cols = w["shape"]
        assert sc["shape"] == [math.ceil(rows / 128), math.ceil(cols / 128)], (s, sc["shape"], w["shape"])
    assert len(scales) == len(fp8)
    # Both kinds of layer exist: dense MLPs in 0-2, routed experts from layer 3.
    assert "model.layers.0.mlp.gate_proj.weight" in by_name
    assert "model.layers.3.mlp.experts.0.gate_proj.weight" in by_name
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in by_name
    assert not [n for n in by_name if re.match(r"model\.layers\.[0-2]\.mlp\.experts\.", n)]
    assert "model.layers.3.mlp.gate_proj.weight" not in by_name


def tensor_spans(ckpt):
    """{tensor name: (shard file, first byte, end byte in the file)} from inspect --json."""
    res, js = stref.inspect_json(ckpt)
    assert js is not None, res.describe()
    spans = {}
    for t in js["tensors"]:
        shard = js["shards"][t["shard"]]
        lo, hi = t["data_offsets"]
        spans[t["name"]] = (shard["file"], shard["data_start"] + lo, shard["data_start"] + hi)
    return spans


def shard_files(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if p.name.endswith(".safetensors"))


@pytest.mark.parametrize("preset,layers", [("qwen3-0.6b", 1), ("qwen3-4b", 1)])
def test_seed_decides_bytes(tmp_path, weightctl, preset, layers):
    """The same seed writes identical files; another seed changes every tensor."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    try:
        mkcheckpoint(a, preset, layers, seed=7)
        mkcheckpoint(b, preset, layers, seed=7)
        mkcheckpoint(c, preset, layers, seed=8)
        files = sorted(p.name for p in a.iterdir())
        assert files == sorted(p.name for p in b.iterdir()) == sorted(p.name for p in c.iterdir())
        for name in files:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"seed 7 twice: {name} differs"
        spans_a, spans_c = tensor_spans(a), tensor_spans(c)
        assert spans_a.keys() == spans_c.keys()
        same = []
        for name in shard_files(a):
            x, y = memoryview((a / name).read_bytes()), memoryview((c / name).read_bytes())
            for t, (f, lo, hi) in spans_a.items():
                if f != name or hi == lo:
                    continue
                f2, lo2, hi2 = spans_c[t]
                if x[lo:hi] == y[lo2:hi2]:
                    same.append(t)
        assert not same, f"seeds 7 and 8 wrote identical bytes for {same[:5]}"
    finally:
        for d in (a, b, c):
            shutil.rmtree(d, ignore_errors=True)
