"""Checkpoints written by `weightctl mkcheckpoint` load in the reference.

For every preset (with few layers, and the MoE presets with few routed
experts) each shard must deserialize, agree with `inspect --json` tensor for
tensor, and hold exactly the bytes the reference hands back; the index must map
every tensor to the shard holding it; no tensor may be all zero bytes; the seed
must decide the bytes. A --experts variant must hold exactly the first N
experts, a router of N rows and a config.json that says N.

The presets keep the published models' full widths, so these files are still
large (deepseek-v3 with 4 layers and 8 experts is about 6 GB, 3.7 GB of it the
embedding and lm_head); each test deletes what it wrote.
"""
import json
import math
import re
import shutil

import pytest

import stref

# (preset, layers, routed experts or None for a dense preset, layout).
# deepseek-v3 needs 4 layers: layers 0-2 are dense, layer 3 is the first MoE
# layer.
PRESETS = [
    ("qwen3-0.6b", 2, None, "single"),
    ("qwen3-4b", 2, None, "index"),
    ("qwen3-8b", 1, None, "index"),
    ("qwen3-30b-a3b", 1, 8, "index"),
    ("deepseek-v3", 4, 8, "index"),
]
MK_TIMEOUT_S = 600
PROBE = 4096

# The published MoE layouts: routed experts, hidden and expert widths, the
# first MoE layer, whether weights are FP8 with scale_inv tensors, the config
# key of the expert count, and the published shard count.
MOE = {
    "qwen3-30b-a3b": dict(experts=128, hidden=2048, inter=768, first_moe=0, fp8=False,
                          count_key="num_experts", shards=16),
    "deepseek-v3": dict(experts=256, hidden=7168, inter=2048, first_moe=3, fp8=True,
                        count_key="n_routed_experts", shards=163),
}

# config.json values every --experts variant written here must carry.
# num_experts_per_tok is min(8, N). DeepSeek's published grouping (n_group 8,
# topk_group 4) would leave groups of one expert for N = 8, which its router
# cannot score (it sums each group's two best), so the variant has one group.
VARIANT_CONFIG = {
    ("qwen3-30b-a3b", 8): {"num_experts": 8, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
    ("qwen3-30b-a3b", 3): {"num_experts": 3, "num_experts_per_tok": 3, "moe_intermediate_size": 768},
    ("deepseek-v3", 8): {"n_routed_experts": 8, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
                         "n_shared_experts": 1, "moe_intermediate_size": 2048},
}


def mkcheckpoint(out, preset, layers, seed, experts=None):
    args = ["mkcheckpoint", "--preset", preset, "--out", str(out), "--layers", str(layers), "--seed", str(seed)]
    if experts is not None:
        args += ["--experts", str(experts)]
    res = stref.run_ctl(args, timeout=MK_TIMEOUT_S)
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


def list_row(preset, layers, experts):
    """The row `mkcheckpoint --list` prints for this variant, as {column: text}."""
    args = ["mkcheckpoint", "--list", "--preset", preset, "--layers", str(layers)]
    if experts is not None:
        args += ["--experts", str(experts)]
    res = stref.run_ctl(args)
    assert res.returncode == 0, res.describe()
    lines = res.stdout.splitlines()
    assert len(lines) == 2, res.describe()
    row = dict(zip(lines[0].split(), lines[1].split()))
    assert row.get("PRESET") == preset, res.describe()
    return row


def verify_list(js, preset, layers, experts):
    """--list describes the variant that was written."""
    row = list_row(preset, layers, experts)
    published = MOE[preset]["experts"] if preset in MOE else None
    assert row["LAYERS"] == str(layers)
    assert row["EXPERTS"] == str(experts or published or "-"), row
    assert int(row["TENSORS"]) == len(js["tensors"]), row
    assert int(row["PAYLOAD_BYTES"]) == js["total_bytes"], row
    assert int(row["SHARDS"]) == len(js["shards"]), row


def verify_experts(ckpt, js, preset, layers, n):
    """A variant with the first n routed experts: names, shapes, router, shards, config."""
    moe = MOE[preset]
    hidden, inter = moe["hidden"], moe["inter"]
    by_name = {t["name"]: t for t in js["tensors"]}
    moe_layers = range(moe["first_moe"], layers)
    assert moe_layers, "the variant has no MoE layer to check"
    kinds = ("weight", "weight_scale_inv") if moe["fp8"] else ("weight",)
    want = {f"model.layers.{i}.mlp.experts.{e}.{proj}.{k}"
            for i in moe_layers for e in range(n) for proj in ("gate_proj", "up_proj", "down_proj") for k in kinds}
    got = {name for name in by_name if ".mlp.experts." in name}
    assert got == want, (f"expert tensors differ: missing {sorted(want - got)[:5]}, "
                         f"unexpected {sorted(got - want)[:5]}")
    weight_dtype = "F8_E4M3" if moe["fp8"] else "BF16"
    for i in moe_layers:
        for e in (0, n - 1):
            up, down = by_name[f"model.layers.{i}.mlp.experts.{e}.up_proj.weight"], \
                by_name[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"]
            assert (up["shape"], down["shape"]) == ([inter, hidden], [hidden, inter]), (up, down)
            assert up["dtype"] == down["dtype"] == weight_dtype
        gate = by_name[f"model.layers.{i}.mlp.gate.weight"]
        assert (gate["dtype"], gate["shape"]) == ("BF16", [n, hidden]), gate
        bias = by_name.get(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
        if preset == "deepseek-v3":
            assert bias is not None and (bias["dtype"], bias["shape"]) == ("F32", [n]), bias
            # The shared expert stays at its published width.
            for proj, shape in (("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]),
                                ("down_proj", [hidden, inter])):
                t = by_name.get(f"model.layers.{i}.mlp.shared_experts.{proj}.weight")
                assert t is not None and (t["dtype"], t["shape"]) == (weight_dtype, shape), (proj, t)
        else:
            assert bias is None
    # A shrunk model keeps the published shard count, capped by the tensor count.
    assert len(js["shards"]) == min(moe["shards"], len(js["tensors"])), len(js["shards"])
    cfg = json.loads((ckpt / "config.json").read_text())
    expect = VARIANT_CONFIG[(preset, n)]
    assert cfg[moe["count_key"]] == n
    wrong = {k: (cfg.get(k), v) for k, v in expect.items() if cfg.get(k) != v}
    assert not wrong, f"config.json (got, want): {wrong}"


@pytest.mark.parametrize("preset,layers,experts,layout", PRESETS, ids=[p[0] for p in PRESETS])
def test_preset_loads_in_reference(tmp_path, weightctl, preset, layers, experts, layout):
    ckpt = tmp_path / preset
    try:
        mkcheckpoint(ckpt, preset, layers, seed=1, experts=experts)
        js = verify_checkpoint(ckpt, layout)
        verify_config(ckpt, js, layers)
        verify_list(js, preset, layers, experts)
        names = [t["name"] for t in js["tensors"]]
        assert layer_indexes(names) == list(range(layers))
        if experts is not None:
            verify_experts(ckpt, js, preset, layers, experts)
        if preset == "deepseek-v3":
            verify_deepseek_fp8(js, experts or MOE[preset]["experts"])
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def test_experts_below_experts_per_token(tmp_path, weightctl):
    """Fewer experts than a token is routed to: num_experts_per_tok follows N down."""
    ckpt = tmp_path / "qwen3-30b-a3b-e3"
    try:
        mkcheckpoint(ckpt, "qwen3-30b-a3b", 1, seed=1, experts=3)
        js = verify_checkpoint(ckpt, "index")
        verify_config(ckpt, js, 1)
        verify_list(js, "qwen3-30b-a3b", 1, 3)
        verify_experts(ckpt, js, "qwen3-30b-a3b", 1, 3)
        assert js["config"].get("num_experts_per_tok") == 3, js["config"]
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


@pytest.mark.parametrize("args,why", [
    (["--preset", "deepseek-v3", "--experts", "0"], "1 to 256"),
    (["--preset", "deepseek-v3", "--experts", "257"], "1 to 256"),
    (["--preset", "qwen3-30b-a3b", "--experts", "0"], "1 to 128"),
    (["--preset", "qwen3-30b-a3b", "--experts", "129"], "1 to 128"),
    (["--preset", "qwen3-0.6b", "--experts", "1"], "dense"),
    (["--preset", "qwen3-8b", "--layers", "1", "--experts", "8"], "dense"),
], ids=["deepseek-0", "deepseek-257", "qwen3-moe-0", "qwen3-moe-129", "qwen3-0.6b-dense", "qwen3-8b-dense"])
@pytest.mark.parametrize("mode", ["write", "list"])
def test_experts_refused(tmp_path, weightctl, args, why, mode):
    """A bad --experts fails before anything is written, with one stderr line saying why."""
    out = tmp_path / "out"
    extra = ["--out", str(out)] if mode == "write" else ["--list"]
    res = stref.run_ctl(["mkcheckpoint"] + args + extra)
    assert res.returncode in (1, 2), res.describe()
    lines = res.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line: {res.describe()}"
    assert lines[0].startswith("weightctl: ") and "--experts" in lines[0] and why in lines[0], res.describe()
    assert res.stdout == "", res.describe()
    assert not out.exists(), "a refused run created its output directory"


def verify_deepseek_fp8(js, experts):
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
    assert f"model.layers.3.mlp.experts.{experts - 1}.down_proj.weight" in by_name
    assert f"model.layers.3.mlp.experts.{experts}.down_proj.weight" not in by_name
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
        # Two checkpoints on disk at a time (up to 0.9 GiB each): b goes before c is written.
        mkcheckpoint(a, preset, layers, seed=7)
        mkcheckpoint(b, preset, layers, seed=7)
        files = sorted(p.name for p in a.iterdir())
        assert files == sorted(p.name for p in b.iterdir())
        for name in files:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"seed 7 twice: {name} differs"
        shutil.rmtree(b)
        mkcheckpoint(c, preset, layers, seed=8)
        assert files == sorted(p.name for p in c.iterdir())
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
