"""Plan presets (docs/protocol.md, "Plans") against an independent reference.

The tiny checkpoints of tiny_models.py (the published families' tensor names
and dtypes at small widths) are exported rank by rank with
`weightctl export CHECKPOINT [plan flags] --out DIR`; every output tensor
(name, dtype, shape, bytes) must be what layout_ref.py computes from the
document alone, and the set of names must match exactly. Independently of
the reference, the ranks of a split must reassemble each TP=1 tensor, every
FP8 block of an output must be a block of the checkpoint with its own scale,
and a split the document says cannot be served must be refused (exit 1, one
line naming the tensor or the rule) by `weightctl plan` and `export` alike.
An explicit plan (--plan FILE) built from the reference's pieces must give
the same bytes; a few plans go through a real daemon (host backend) too.
"""
import array
import hashlib
import json
import mmap
import os
import shutil
import socket
import struct

import numpy as np
import pytest

import layout_ref as L
import stref
import tiny_models

# ---- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Every tiny model, written once: {name: directory}."""
    root = tmp_path_factory.mktemp("tiny-models")
    return tiny_models.write_all(str(root))


_CK = {}


def ckpt(models, name):
    """The reference's view of model name (read once per session)."""
    if name not in _CK:
        _CK[name] = L.Checkpoint(models[name])
    return _CK[name]


# ---- specs, flags and exports -------------------------------------------------------


def make_spec(preset="auto", tp=1, tpr=0, ep=1, epr=0, experts=None, fuse=False):
    return dict(preset=preset, tp_size=tp, tp_rank=tpr, ep_size=ep, ep_rank=epr, experts=experts, fuse=fuse)


def flags(spec):
    """weightctl plan flags for spec (sizes of 1 are left out, as a user would)."""
    f = ["--preset", spec["preset"]]
    if spec["tp_size"] != 1 or spec["tp_rank"]:
        f += ["--tp-size", str(spec["tp_size"]), "--tp-rank", str(spec["tp_rank"])]
    if spec["ep_size"] != 1 or spec["ep_rank"]:
        f += ["--ep-size", str(spec["ep_size"]), "--ep-rank", str(spec["ep_rank"])]
    if spec["experts"] is not None:
        f += ["--experts", ",".join(str(e) for e in spec["experts"])]
    if spec["fuse"]:
        f.append("--fuse")
    return f


def spec_json(spec):
    """The spec as a plan object (docs/protocol.md's preset form)."""
    return {k: v for k, v in spec.items() if v is not None}


def reference(ck, spec):
    return L.build(ck, spec["preset"], spec["tp_size"], spec["tp_rank"], spec["ep_size"], spec["ep_rank"],
                   spec["experts"], spec["fuse"])


def describe_spec(spec):
    s = f"{spec['preset']} tp {spec['tp_size']}/{spec['tp_rank']}"
    if spec["ep_size"] != 1 or spec["experts"] is not None:
        s += f" ep {spec['ep_size']}/{spec['ep_rank']}"
    if spec["experts"] is not None:
        s += f" experts {spec['experts']}"
    return s + (" fused" if spec["fuse"] else "")


class Exported:
    """What export wrote: {name: (dtype, shape, bytes)} and the shards' metadata."""

    def __init__(self, out_dir):
        files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
        index = os.path.join(out_dir, "model.safetensors.index.json")
        assert files, f"export wrote no .safetensors file in {out_dir}: {os.listdir(out_dir)}"
        if os.path.exists(index):
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
            assert sorted(set(wmap.values())) == files, (sorted(set(wmap.values())), files)
        else:
            assert files == ["model.safetensors"], files
            wmap = None
        self.tensors = {}
        self.metadata = []
        for fname in files:
            with open(os.path.join(out_dir, fname), "rb") as f:
                buf = f.read()
            ref = stref.reference(buf)
            assert ref.ok, f"{fname} written by export is not valid safetensors: {ref.error}"
            self.metadata.append(ref.metadata)
            start = 8 + ref.n
            for name, t in ref.tensors.items():
                assert name not in self.tensors, f"{name} written twice"
                if wmap is not None:
                    assert wmap.get(name) == fname, f"index maps {name} to {wmap.get(name)}, it is in {fname}"
                self.tensors[name] = (t.dtype, t.shape, buf[start + t.begin:start + t.end])
        if wmap is not None:
            assert set(wmap) == set(self.tensors), "index and shards list different tensors"

    def array(self, name):
        dtype, shape, data = self.tensors[name]
        size = stref.DTYPE_BITS[dtype] // 8
        return np.frombuffer(data, dtype=L._UINT[size]).reshape(shape)


def export(tmp_path, ck_path, spec, tag=None):
    """Runs export for spec into a fresh directory; returns (CtlResult, out dir)."""
    out = tmp_path / (tag or ("x" + hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]))
    if out.exists():
        shutil.rmtree(out)
    res = stref.run_ctl(["export", str(ck_path)] + flags(spec) + ["--out", str(out)])
    return res, out


def first_difference(a, b):
    n = min(len(a), len(b))
    for i in range(0, n, 4096):
        if a[i:i + 4096] != b[i:i + 4096]:
            for k in range(i, min(i + 4096, n)):
                if a[k] != b[k]:
                    return k
    return n


def compare(got, ck, want):
    """Mismatches between exported tensors and the reference's outputs."""
    bad = []
    names_got, names_want = set(got.tensors), set(want)
    if names_got != names_want:
        bad.append(f"output names differ: missing {sorted(names_want - names_got)[:8]}, "
                   f"unexpected {sorted(names_got - names_want)[:8]}")
    for name in sorted(names_got & names_want):
        dtype, shape, data = got.tensors[name]
        w = want[name]
        if (dtype, list(shape)) != (w.dtype, w.shape):
            bad.append(f"{name}: {dtype} {shape}, reference {w.dtype} {w.shape}")
            continue
        ref = L.materialize(ck, w)
        if bytes(data) != ref:
            k = first_difference(bytes(data), ref)
            pieces = [p.spec() for p in w.pieces][:6]
            bad.append(f"{name}: bytes differ from byte {k} of {len(ref)} (reference pieces {pieces})")
    return bad


def check_metadata(exp, spec, config):
    """Every shard's __metadata__.weightd_plan is the spec (defaults may be left out)."""
    defaults = dict(tp_size=1, tp_rank=0, ep_size=1, ep_rank=0, experts=None, fuse=False)
    for meta in exp.metadata:
        assert meta and "weightd_plan" in meta, f"no weightd_plan in the metadata: {meta}"
        plan = json.loads(meta["weightd_plan"])
        assert isinstance(plan, dict), plan
        for k, d in defaults.items():
            got, want = plan.get(k, d), spec[k]
            if k == "experts" and got is not None and want is not None:
                # The document does not order the list; a canonical form may sort it.
                got, want = sorted(got), sorted(want)
            assert got == want, f"weightd_plan {k}: {plan.get(k, d)!r}, expected {spec[k]!r}: {plan}"
        fam = L.family_of(config, spec["preset"])
        assert plan.get("preset") in (spec["preset"], fam), plan


def export_and_compare(tmp_path, models, model, spec, tag=None):
    """Exports one rank, checks it against the reference; returns the Exported."""
    ck = ckpt(models, model)
    want = reference(ck, spec)
    res, out = export(tmp_path, models[model], spec, tag)
    assert res.returncode == 0, f"{model} {describe_spec(spec)}: export failed\n" + res.describe()
    got = Exported(out)
    bad = compare(got, ck, want)
    assert not bad, f"{model} {describe_spec(spec)}: export disagrees with the reference:\n  " + \
        "\n  ".join(bad[:30])
    check_metadata(got, spec, ck.config)
    shutil.rmtree(out)
    return got


# ---- independent checks on the C's outputs ------------------------------------------


def column_names(name):
    """How a tensor of the tiny families splits under TP, by its name (no reference involved)."""
    base = name[:-len("_scale_inv")] if name.endswith("_scale_inv") else name
    if base in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    for s in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
        if base.endswith("self_attn." + s):
            return "kv"
    for s in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "q_b_proj.weight", "kv_b_proj.weight",
              "gate_proj.weight", "up_proj.weight"):
        if base.endswith(s):
            return "column"
    for s in ("o_proj.weight", "down_proj.weight"):
        if base.endswith(s):
            return "row"
    return "replicated"


def reassemble(ck, ranks, tp, kv_heads):
    """Checks unfused ranks [Exported per tp rank] put back together give every TP=1 tensor.

    Column-parallel outputs concatenate on dimension 0, row-parallel on 1;
    of replicated kv heads only each head's first holder counts, the others
    must equal it; replicated tensors must equal the source on every rank;
    vocab shards concatenate to the padded table: the source, then zeros.
    Experts (ep 1) are split like dense MLPs. Returns a list of mismatches.
    """
    bad = []
    for name, src in ck.tensors.items():
        present = [name in r.tensors for r in ranks]
        if not any(present):
            continue  # not served (tied lm_head)
        if not all(present):
            bad.append(f"{name}: on ranks {[i for i, p in enumerate(present) if p]} only")
            continue
        want = ck.array(name)
        kind = column_names(name)
        parts = [r.array(name) for r in ranks]
        if kind == "replicated":
            for i, p in enumerate(parts):
                if p.shape != want.shape or not np.array_equal(p, want):
                    bad.append(f"{name}: rank {i} differs from the replicated source")
            continue
        if kind == "kv" and tp > kv_heads:
            rep = tp // kv_heads
            for i, p in enumerate(parts):
                if not np.array_equal(p, parts[i - i % rep]):
                    bad.append(f"{name}: rank {i} differs from rank {i - i % rep}, which holds the same kv head")
            parts = parts[::rep]
        axis = 1 if kind == "row" else 0
        try:
            whole = np.concatenate(parts, axis=axis)
        except ValueError as e:
            bad.append(f"{name}: ranks do not concatenate: {e}")
            continue
        if kind == "vocab":
            v = want.shape[0]
            if whole.shape[0] % 64 or whole.shape[0] < v or whole.shape[0] - v >= 64:
                bad.append(f"{name}: padded table of {whole.shape[0]} rows for a vocabulary of {v}")
                continue
            if np.any(whole[v:]):
                bad.append(f"{name}: padding rows are not zero")
            whole = whole[:v]
        if whole.shape != want.shape or not np.array_equal(whole, want):
            bad.append(f"{name}: ranks concatenated on dimension {axis} differ from the source "
                       f"({whole.shape} vs {want.shape})")
    return bad


def expert_union(ck, ranks):
    """Checks ep ranks [Exported, unfused] hold every expert tensor exactly once, whole."""
    bad = []
    seen = {}
    for i, r in enumerate(ranks):
        for name in r.tensors:
            if ".mlp.experts." in name:
                if name in seen:
                    bad.append(f"{name}: on ep ranks {seen[name]} and {i}")
                seen[name] = i
                if r.tensors[name][2] != ck.raw(name):
                    bad.append(f"{name}: ep rank {i} does not hold it whole")
    want = {n for n in ck.tensors if ".mlp.experts." in n}
    if set(seen) != want:
        bad.append(f"experts: missing {sorted(want - set(seen))[:5]}, unexpected {sorted(set(seen) - want)[:5]}")
    return bad


def fp8_blocks(ck, got):
    """Every block of every FP8 output is a block of the checkpoint, with that block's scale."""
    block = L.block_size(ck)
    b0, b1 = block
    table = {}
    for name, t in ck.tensors.items():
        if t.dtype != "F8_E4M3":
            continue
        w, s = ck.array(name), ck.array(name + "_scale_inv")
        for i in range(0, w.shape[0], b0):
            for j in range(0, w.shape[1], b1):
                key = (w[i:i + b0, j:j + b1].shape, w[i:i + b0, j:j + b1].tobytes())
                table[key] = (name, i // b0, j // b1, int(s[i // b0, j // b1]))
    bad, checked = [], 0
    for name, (dtype, shape, _) in got.tensors.items():
        if dtype != "F8_E4M3":
            continue
        sname = name + "_scale_inv"
        if sname not in got.tensors:
            bad.append(f"{name}: no {sname}")
            continue
        w, s = got.array(name), got.array(sname)
        if w.ndim == 2:
            w, s = w[None], s[None]
        for e in range(w.shape[0]):
            want_shape = (-(-w.shape[1] // b0), -(-w.shape[2] // b1))
            if s[e].shape != want_shape:
                bad.append(f"{sname}: scale shape {s[e].shape} for a weight of {w[e].shape}")
                break
            for i in range(0, w.shape[1], b0):
                for j in range(0, w.shape[2], b1):
                    blk = w[e, i:i + b0, j:j + b1]
                    hit = table.get((blk.shape, blk.tobytes()))
                    checked += 1
                    if hit is None:
                        bad.append(f"{name}[{e}] block ({i // b0},{j // b1}) is no block of the checkpoint")
                    elif int(s[e, i // b0, j // b1]) != hit[3]:
                        bad.append(f"{sname}[{e}] ({i // b0},{j // b1}) is not the scale of {hit[0]} "
                                   f"block ({hit[1]},{hit[2]})")
    return bad, checked


# ---- the matrix ----------------------------------------------------------------------

DENSE_TP = {"qwen3": [1, 2, 4, 8, 16], "qwen3_tied": [1, 2, 4, 8, 16], "qwen2": [1, 2, 4, 8, 16],
            "llama12": [1, 2, 4, 12]}
# (tp, ep) pairs per MoE model.
MOE_SPLITS = {
    "qwen3_moe": [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (1, 3), (1, 8), (2, 8), (8, 8)],
    "deepseek_v3": [(1, 1), (2, 1), (1, 2), (2, 2), (1, 8), (2, 8)],
    "deepseek_v2": [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 8)],
}
MAX_RANKS = 16

DENSE_CASES = [(m, tp, fuse) for m, tps in DENSE_TP.items() for tp in tps for fuse in (False, True)]
MOE_CASES = [(m, tp, ep, fuse) for m, splits in MOE_SPLITS.items() for tp, ep in splits for fuse in (False, True)]


def rank_pairs(tp, ep):
    """The (tp_rank, ep_rank) pairs exported: all, or for big products every tp
    rank at ep rank 0 and every ep rank at tp rank 0."""
    if tp * ep <= MAX_RANKS:
        return [(t, e) for t in range(tp) for e in range(ep)]
    return sorted({(t, 0) for t in range(tp)} | {(0, e) for e in range(ep)})


@pytest.mark.parametrize("model,tp,fuse", DENSE_CASES, ids=[f"{m}-tp{t}-{'fused' if f else 'unfused'}"
                                                           for m, t, f in DENSE_CASES])
def test_dense(tmp_path, models, weightctl, model, tp, fuse):
    """Every rank of a dense model; unfused ranks reassemble each TP=1 tensor."""
    ranks = [export_and_compare(tmp_path, models, model, make_spec(tp=tp, tpr=r, fuse=fuse)) for r in range(tp)]
    if not fuse:
        ck = ckpt(models, model)
        bad = reassemble(ck, ranks, tp, ck.config["num_key_value_heads"])
        assert not bad, f"{model} tp {tp}: ranks do not reassemble the checkpoint:\n  " + "\n  ".join(bad[:20])


@pytest.mark.parametrize("model,tp,ep,fuse", MOE_CASES, ids=[f"{m}-tp{t}-ep{e}-{'fused' if f else 'unfused'}"
                                                            for m, t, e, f in MOE_CASES])
def test_moe(tmp_path, models, weightctl, model, tp, ep, fuse):
    """Ranks of an MoE model: TP x EP; reassembly across TP (ep 1) and across EP."""
    ck = ckpt(models, model)
    got = {}
    for t, e in rank_pairs(tp, ep):
        got[(t, e)] = export_and_compare(tmp_path, models, model,
                                         make_spec(tp=tp, tpr=t, ep=ep, epr=e, fuse=fuse))
    if L.block_size(ck):
        for key, exp in got.items():
            bad, checked = fp8_blocks(ck, exp)
            assert checked > 0
            assert not bad, f"{model} {key}: FP8 blocks:\n  " + "\n  ".join(bad[:20])
    if fuse:
        return
    if ep == 1:
        kv = ck.config.get("num_key_value_heads") or ck.config["num_attention_heads"]
        bad = reassemble(ck, [got[(t, 0)] for t in range(tp)], tp, kv)
        assert not bad, f"{model} tp {tp}: ranks do not reassemble the checkpoint:\n  " + "\n  ".join(bad[:20])
    else:
        bad = expert_union(ck, [got[(0, e)] for e in range(ep)])
        assert not bad, f"{model} ep {ep}: experts:\n  " + "\n  ".join(bad[:20])


# Fused lists are ascending: the document does not say whether stacking follows
# the list's order or the experts' ids.
EXPERT_LISTS = [
    ("qwen3_moe", 1, 2, 1, [1, 5, 6], False),
    ("qwen3_moe", 1, 2, 0, [1, 5, 6], True),
    ("qwen3_moe", 2, 4, 3, [7], True),
    ("qwen3_moe", 1, 8, 2, [6, 2], False),
    ("deepseek_v3", 2, 2, 1, [0, 3, 4, 7], True),
    ("deepseek_v3", 1, 8, 5, [2], False),
]


@pytest.mark.parametrize("model,tp,ep,epr,experts,fuse", EXPERT_LISTS,
                         ids=[f"{m}-tp{t}-ep{e}r{r}-{'_'.join(map(str, x))}-{'fused' if f else 'unfused'}"
                              for m, t, e, r, x, f in EXPERT_LISTS])
def test_expert_lists(tmp_path, models, weightctl, model, tp, ep, epr, experts, fuse):
    """--experts LIST: exactly those experts, whole (fused lists are ascending, so either order rule holds)."""
    for t in range(tp):
        export_and_compare(tmp_path, models, model,
                           make_spec(tp=tp, tpr=t, ep=ep, epr=epr, experts=experts, fuse=fuse))


def test_fp8_fused_layout(tmp_path, models, weightctl):
    """DeepSeek FP8, tp 2, fused: the shapes vLLM's parameters have (a spot check of the reference too)."""
    ck = ckpt(models, "deepseek_v3")
    want = reference(ck, make_spec(tp=2, tpr=1, fuse=True))
    shapes = {n: (o.dtype, o.shape) for n, o in want.items()}
    a = "model.layers.0.self_attn."
    assert shapes[a + "fused_qkv_a_proj.weight"] == ("F8_E4M3", [256 + 160, 512])
    assert shapes[a + "fused_qkv_a_proj.weight_scale_inv"] == ("F32", [4, 4])
    assert shapes[a + "q_b_proj.weight"] == ("F8_E4M3", [384, 256])
    assert shapes[a + "q_b_proj.weight_scale_inv"] == ("F32", [3, 2])
    assert shapes[a + "kv_b_proj.weight"] == ("F8_E4M3", [512, 128])
    assert shapes[a + "o_proj.weight_scale_inv"] == ("F32", [4, 2])
    assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == ("F8_E4M3", [1024, 512])
    assert shapes["model.layers.0.mlp.gate_up_proj.weight_scale_inv"] == ("F32", [8, 4])
    m = "model.layers.1.mlp."
    assert shapes[m + "experts.w13_weight"] == ("F8_E4M3", [8, 256, 512])
    assert shapes[m + "experts.w13_weight_scale_inv"] == ("F32", [8, 2, 4])
    assert shapes[m + "experts.w2_weight"] == ("F8_E4M3", [8, 512, 128])
    assert shapes[m + "experts.w2_weight_scale_inv"] == ("F32", [8, 4, 1])
    assert shapes[m + "shared_experts.gate_up_proj.weight"] == ("F8_E4M3", [256, 512])
    assert shapes[m + "gate.e_score_correction_bias"] == ("F32", [8])
    assert shapes["model.embed_tokens.weight"] == ("BF16", [512, 512])
    export_and_compare(tmp_path, models, "deepseek_v3", make_spec(tp=2, tpr=1, fuse=True))


def test_whole_preset(tmp_path, models, weightctl):
    """--preset whole: every tensor whole, under its own name."""
    for model in ("qwen3", "deepseek_v3"):
        export_and_compare(tmp_path, models, model, make_spec(preset="whole"))


def test_export_shards(tmp_path, models, weightctl):
    """export --max-shard-bytes: several files and an index, the same tensors."""
    ck = ckpt(models, "deepseek_v3")
    spec = make_spec(tp=2, tpr=1, fuse=True)
    want = reference(ck, spec)
    out = tmp_path / "sharded"
    res = stref.run_ctl(["export", models["deepseek_v3"]] + flags(spec) +
                        ["--out", str(out), "--max-shard-bytes", "1000000"])
    assert res.returncode == 0, res.describe()
    assert (out / "model.safetensors.index.json").exists(), os.listdir(out)
    got = Exported(out)
    assert len(got.metadata) > 1
    bad = compare(got, ck, want)
    assert not bad, "\n  ".join(bad[:30])
    check_metadata(got, spec, ck.config)


@pytest.mark.parametrize("model,preset", [("qwen2", "dense"), ("llama12", "dense"), ("qwen3_moe", "qwen3_moe"),
                                          ("deepseek_v3", "deepseek_v3"), ("deepseek_v2", "deepseek_v3")])
def test_named_family(tmp_path, models, weightctl, model, preset):
    """A family named outright gives what auto chooses from model_type."""
    export_and_compare(tmp_path, models, model, make_spec(preset=preset, tp=2, tpr=1, fuse=True))


# ---- refusals ----------------------------------------------------------------------------

# (model, spec, why) the document refuses.
REFUSED = [
    ("qwen3", make_spec(tp=3, tpr=1), "16 query heads do not divide by 3"),
    ("qwen3", make_spec(tp=32, tpr=0), "16 query heads do not divide by 32"),
    ("qwen3_moe", make_spec(tp=16, tpr=15, fuse=True), "8 query heads do not divide by 16"),
    ("llama12", make_spec(tp=3, tpr=0), "tp 3 < 4 kv heads, which it does not divide"),
    ("llama12", make_spec(tp=6, tpr=5, fuse=True), "tp 6 > 4 kv heads, not a multiple of them"),
    ("llama12", make_spec(tp=8, tpr=0), "12 query heads do not divide by 8"),
    ("deepseek_v3", make_spec(tp=4, tpr=1), "q_b_proj rows 768/4 = 192: off the 128-row FP8 blocks"),
    ("deepseek_v3", make_spec(tp=4, tpr=0, ep=2, epr=1, fuse=True), "q_b_proj off FP8 blocks (experts whole)"),
    ("deepseek_v3", make_spec(tp=8, tpr=7), "q_b_proj and o_proj off FP8 blocks"),
    ("qwen3_moe", make_spec(ep=2, epr=0, experts=[3, 8]), "expert 8 of 8"),
    ("deepseek_v3", make_spec(ep=8, epr=1, experts=[9]), "expert 9 of 8"),
]


def refusal_problem(res, needles):
    problem = stref.error_line_problem(res)
    if problem is not None:
        return problem
    low = res.stderr.lower()
    if not any(n.lower() in low for n in needles):
        return f"the message names none of {needles[:8]}: {res.stderr!r}"
    return None


@pytest.mark.parametrize("model,spec,why", REFUSED, ids=[f"{m}-{describe_spec(s)}".replace(" ", "_")
                                                         for m, s, _ in REFUSED])
def test_refused(tmp_path, models, weightctl, model, spec, why):
    """The reference refuses it, and so do plan and export: exit 1, one line naming it."""
    ck = ckpt(models, model)
    with pytest.raises(L.Impossible) as exc:
        reference(ck, spec)
    needles = exc.value.needles()
    res = stref.run_ctl(["plan", models[model]] + flags(spec))
    p = refusal_problem(res, needles)
    assert p is None, f"plan {describe_spec(spec)} ({why}): {p}\n" + res.describe()
    res, out = export(tmp_path, models[model], spec)
    p = refusal_problem(res, needles)
    assert p is None, f"export {describe_spec(spec)} ({why}): {p}\n" + res.describe()
    assert not out.exists() or not any(out.iterdir()), f"a refused export left files: {os.listdir(out)}"


# Specs the command line cannot express (it refuses them as usage errors)
# handed over in a plan file: the plan builder must refuse them itself.
REFUSED_FILES = [
    ("qwen3", {"preset": "auto", "tp_size": 2, "tp_rank": 2}, ["tp_rank"]),
    ("qwen3_moe", {"preset": "auto", "ep_size": 2, "ep_rank": 2}, ["ep_rank"]),
    ("qwen3", {"preset": "auto", "tp_size": 0, "tp_rank": 0}, ["tp_size"]),
    ("qwen3_moe", {"preset": "qwen3_moe", "tp_size": 8, "tp_rank": 0, "ep_size": 2, "ep_rank": 9}, ["ep_rank"]),
]


@pytest.mark.parametrize("model,plan,needles", REFUSED_FILES)
def test_refused_plan_file(tmp_path, models, weightctl, model, plan, needles):
    spec = {k: plan.get(k, v) for k, v in make_spec().items()}
    with pytest.raises(L.Impossible):
        reference(ckpt(models, model), spec)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))
    for cmd in (["plan", models[model], "--plan", str(f)],
                ["export", models[model], "--plan", str(f), "--out", str(tmp_path / "out")]):
        res = stref.run_ctl(cmd)
        p = refusal_problem(res, needles)
        assert p is None, f"{cmd[0]} --plan {plan}: {p}\n" + res.describe()


def test_usage_refusals(tmp_path, models, weightctl):
    """Flag combinations the command line refuses before planning: exit 2."""
    m = models["qwen3_moe"]
    for extra in (["--tp-size", "2", "--tp-rank", "2"], ["--ep-size", "2", "--ep-rank", "5"],
                  ["--experts", "1,2"], ["--ep-size", "2", "--experts", "1,1"]):
        res = stref.run_ctl(["export", m, "--out", str(tmp_path / "o")] + extra)
        assert res.returncode == 2, res.describe()
        assert res.stderr.startswith("weightctl: "), res.describe()


# ---- explicit plans ------------------------------------------------------------------------

EXPLICIT = [
    ("qwen3", make_spec(tp=16, tpr=13, fuse=True)),  # kv head 6 replicated, vocab rows past 1000 zero
    ("qwen2", make_spec(tp=8, tpr=3)),
    ("qwen3_moe", make_spec(tp=2, tpr=1, fuse=True)),  # stacked, sliced experts
    ("deepseek_v3", make_spec(tp=2, tpr=1, ep=2, epr=0, fuse=True)),  # FP8 scales fused and stacked
]


@pytest.mark.parametrize("model,spec", EXPLICIT, ids=[f"{m}-{describe_spec(s)}".replace(" ", "_")
                                                      for m, s in EXPLICIT])
def test_explicit_plan(tmp_path, models, weightctl, model, spec):
    """The reference's outputs written as an explicit plan export to the same bytes."""
    ck = ckpt(models, model)
    want = reference(ck, spec)
    plan = L.explicit_plan(want)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))
    out = tmp_path / "out"
    res = stref.run_ctl(["export", models[model], "--plan", str(f), "--out", str(out)])
    assert res.returncode == 0, res.describe()
    got = Exported(out)
    bad = compare(got, ck, want)
    assert not bad, "explicit plan: " + "\n  ".join(bad[:30])
    # The preset and the explicit plan describe the same outputs.
    res = stref.run_ctl(["plan", models[model], "--plan", str(f), "--json"])
    assert res.returncode == 0, res.describe()
    described = json.loads(res.stdout)
    names = [o["name"] for o in described["outputs"]]
    assert sorted(names) == sorted(want), (sorted(set(names) ^ set(want)))[:10]


def test_explicit_plan_shape_mismatch(tmp_path, models, weightctl):
    """An explicit output whose pieces do not add up to its shape is refused, naming it."""
    ck = ckpt(models, "qwen3")
    want = reference(ck, make_spec(tp=2, tpr=0))
    name = "model.layers.0.self_attn.q_proj.weight"
    spec = want[name].spec()
    spec["shape"] = [spec["shape"][0] + 1, spec["shape"][1]]
    f = tmp_path / "plan.json"
    f.write_text(json.dumps({"outputs": [spec]}))
    res = stref.run_ctl(["plan", models["qwen3"], "--plan", str(f)])
    p = refusal_problem(res, [name])
    assert p is None, p + "\n" + res.describe()


# ---- plan --json against the reference -------------------------------------------------------

DESCRIBED = [("qwen3", make_spec(tp=16, tpr=15, fuse=True)), ("qwen2", make_spec(tp=8, tpr=6)),
             ("qwen3_tied", make_spec(tp=4, tpr=3)), ("qwen3_moe", make_spec(tp=4, tpr=2, ep=1, fuse=True)),
             ("qwen3_moe", make_spec(tp=2, tpr=1, ep=3, epr=2, fuse=True)),
             ("deepseek_v3", make_spec(tp=2, tpr=0, fuse=True)), ("deepseek_v2", make_spec(tp=8, tpr=5))]


@pytest.mark.parametrize("model,spec", DESCRIBED, ids=[f"{m}-{describe_spec(s)}".replace(" ", "_")
                                                       for m, s in DESCRIBED])
def test_plan_json(models, weightctl, model, spec):
    """plan --json lists the reference's outputs: names, dtypes, shapes, bytes and pieces."""
    ck = ckpt(models, model)
    want = reference(ck, spec)
    res = stref.run_ctl(["plan", models[model]] + flags(spec) + ["--json"])
    assert res.returncode == 0, res.describe()
    js = json.loads(res.stdout)
    got = {o["name"]: o for o in js["outputs"]}
    assert set(got) == set(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    bad = []
    for name, w in want.items():
        g = got[name]
        if (g["dtype"], g["shape"], g["nbytes"]) != (w.dtype, w.shape, w.nbytes):
            bad.append(f"{name}: {g['dtype']} {g['shape']} {g['nbytes']}, reference {w.dtype} {w.shape} {w.nbytes}")
        elif g["pieces"] != [p.spec() for p in w.pieces]:
            bad.append(f"{name}: pieces {g['pieces'][:4]}, reference {[p.spec() for p in w.pieces][:4]}")
    assert js["payload_bytes"] == sum(w.nbytes for w in want.values())
    assert not bad, "\n  ".join(bad[:20])


# ---- self-checks of the reference (no weightctl) -----------------------------------------------


@pytest.mark.parametrize("model", sorted(tiny_models.MODELS))
def test_reference_partitions(models, model):
    """The reference's own TP ranks cover every source byte exactly as the rules say."""
    ck = ckpt(models, model)
    tps = DENSE_TP.get(model) or sorted({tp for tp, ep in MOE_SPLITS[model] if ep == 1})
    for tp in tps:
        ranks = []
        for r in range(tp):
            outs = reference(ck, make_spec(tp=tp, tpr=r))
            ranks.append(_Materialized(ck, outs))
        kv = ck.config.get("num_key_value_heads") or ck.config["num_attention_heads"]
        bad = reassemble(ck, ranks, tp, kv)
        assert not bad, f"tp {tp}: " + "\n  ".join(bad[:10])
        if L.block_size(ck):
            for r in ranks:
                bad, checked = fp8_blocks(ck, r)
                assert checked and not bad, bad[:5]
    total1 = sum(o.nbytes for o in reference(ck, make_spec()).values())
    assert total1 >= sum(t.end - t.begin for t in ck.tensors.values())


class _Materialized:
    """The reference's outputs in Exported's form."""

    def __init__(self, ck, outs):
        self.tensors = {n: (o.dtype, o.shape, L.materialize(ck, o)) for n, o in outs.items()}

    array = Exported.array


def test_reference_fused_is_unfused_concatenated(models):
    """A fused output's bytes are its parts' unfused outputs, in order (per expert when stacked)."""
    for model, spec in (("qwen2", make_spec(tp=8, tpr=5)), ("qwen3_moe", make_spec(tp=2, tpr=1)),
                        ("deepseek_v3", make_spec(tp=2, tpr=1))):
        ck = ckpt(models, model)
        un = reference(ck, spec)
        fu = reference(ck, dict(spec, fuse=True))
        for name, o in fu.items():
            if name in un:
                assert L.materialize(ck, o) == L.materialize(ck, un[name]), name
                continue
            parts = [un[p.tensor] if p.tensor in un else None for p in o.pieces]
            assert all(parts), name
            assert L.materialize(ck, o) == b"".join(L.materialize(ck, x) for x in parts), name


# ---- the daemon ---------------------------------------------------------------------------------


class Client:
    """The protocol as docs/protocol.md writes it: length-prefixed JSON, fds on the first byte."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.sock.settimeout(60)
        self.next = 1
        assert "ok" in self.call({"op": "hello", "protocol": 1, "client": "test_layouts"})[0]

    def _recv(self, n, fds):
        buf = b""
        while len(buf) < n:
            data, anc, flags, _ = self.sock.recvmsg(n - len(buf), socket.CMSG_SPACE(16 * 4))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(cdata[:len(cdata) - len(cdata) % 4])
                    fds.extend(a)
            assert data, "the daemon closed the connection"
            buf += data
        return buf

    def call(self, req):
        req = dict(req, id=self.next)
        self.next += 1
        body = json.dumps(req).encode()
        self.sock.sendall(struct.pack("<I", len(body)) + body)
        while True:
            fds = []
            (n,) = struct.unpack("<I", self._recv(4, fds))
            msg = json.loads(self._recv(n, fds))
            if msg.get("event") is None:
                assert msg.get("id") == req["id"], msg
                return msg, fds
            for fd in fds:
                os.close(fd)

    def close(self):
        self.sock.close()


# The daemon with its default load path (the host backend copies into the
# slab), and forced through the staging slots with strided pieces gathered
# on the CPU or staged as whole source rows (2D copies out of the slot).
DAEMON_CONFIGS = {
    "memcpy": (),
    "staged-gather": ("--set", "load_method=staged", "--set", "staged_strided=gather", "--set", "staging_slot_bytes=1MiB"),
    "staged-rows": ("--set", "load_method=staged", "--set", "staged_strided=rows", "--set", "staging_slot_bytes=1MiB"),
}


@pytest.fixture(scope="module", params=sorted(DAEMON_CONFIGS))
def daemon(request, models, weightctl):
    if not os.access(stref.weightd_path(), os.X_OK):
        pytest.fail(f"weightd not found at {stref.weightd_path()} (set WEIGHTD to the built binary)")
    root = os.path.dirname(models["qwen3"])
    d = stref.Daemon(root, DAEMON_CONFIGS[request.param])
    d.config = request.param
    yield d
    complaint = d.stop()
    assert complaint is None, complaint


DAEMON_CASES = [
    ("qwen3", make_spec(tp=2, tpr=1, fuse=True)),
    ("qwen2", make_spec(tp=16, tpr=9)),
    ("qwen3_moe", make_spec(tp=2, tpr=0, ep=2, epr=1, fuse=True)),
    ("qwen3_moe", make_spec(ep=2, epr=0, experts=[2, 3, 7], fuse=True)),
    ("deepseek_v3", make_spec(tp=2, tpr=1, fuse=True)),
    ("deepseek_v2", make_spec(tp=4, tpr=3, ep=1, fuse=True)),
]


def attach_and_compare(daemon, ck, plan, want, what):
    c = Client(daemon.socket)
    try:
        reply, fds = c.call({"op": "attach", "path": ck.path, "device": 0, "plan": plan})
        try:
            assert reply.get("ok") is True, f"{what}: attach failed: {reply}"
            assert len(fds) == 1 and reply["handles"][0]["kind"] == "fd", reply["handles"]
            size = os.fstat(fds[0]).st_size
            m = mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ)
            try:
                table = {t["name"]: t for t in reply["tensors"]}
                assert set(table) == set(want), (sorted(set(table) - set(want))[:5],
                                                 sorted(set(want) - set(table))[:5])
                bad = []
                for name, w in want.items():
                    t = table[name]
                    if (t["dtype"], t["shape"], t["nbytes"]) != (w.dtype, w.shape, w.nbytes):
                        bad.append(f"{name}: {t['dtype']} {t['shape']}, reference {w.dtype} {w.shape}")
                    elif m[t["offset"]:t["offset"] + t["nbytes"]] != L.materialize(ck, w):
                        bad.append(f"{name}: bytes differ ({daemon.config})")
                assert not bad, f"{what}: the attached set disagrees with the reference:\n  " + "\n  ".join(bad[:20])
            finally:
                m.close()
        finally:
            for fd in fds:
                os.close(fd)
        status, _ = c.call({"op": "status"})
        methods = [x.get("method") for x in status["sets"] if x["set"] == reply["set"]]
        assert methods == ["staged" if daemon.config.startswith("staged") else "memcpy"], (daemon.config, methods)
        rel, _ = c.call({"op": "release", "lease": reply["lease"]})
        assert rel.get("ok"), rel
    finally:
        c.close()


@pytest.mark.parametrize("model,spec", DAEMON_CASES, ids=[f"{m}-{describe_spec(s)}".replace(" ", "_")
                                                          for m, s in DAEMON_CASES])
def test_daemon_attach(daemon, models, model, spec):
    """attach with a preset plan: the memfd holds the reference's bytes at the table's offsets."""
    ck = ckpt(models, model)
    attach_and_compare(daemon, ck, spec_json(spec), reference(ck, spec), f"{model} {describe_spec(spec)}")


def test_daemon_explicit_plan(daemon, models):
    ck = ckpt(models, "deepseek_v3")
    want = reference(ck, make_spec(tp=2, tpr=0, ep=8, epr=3, fuse=True))
    attach_and_compare(daemon, ck, L.explicit_plan(want), want, "explicit plan")


def test_daemon_bad_plan(daemon, models):
    """An impossible split is BAD_PLAN from the daemon too."""
    c = Client(daemon.socket)
    try:
        for model, spec in (("deepseek_v3", make_spec(tp=4, tpr=1)), ("llama12", make_spec(tp=6, tpr=2))):
            reply, fds = c.call({"op": "load", "path": models[model], "device": 0, "plan": spec_json(spec)})
            for fd in fds:
                os.close(fd)
            assert reply.get("error", {}).get("code") == "BAD_PLAN", reply
    finally:
        c.close()


def test_weightctl_attach_verify(daemon, models):
    """weightctl attach PATH with plan flags and --verify against the files."""
    for model, extra in (("qwen3", ["--tp-size", "2", "--tp-rank", "1", "--fuse"]),
                         ("deepseek_v3", ["--tp-size", "2", "--tp-rank", "0", "--ep-size", "2", "--ep-rank", "1",
                                          "--fuse"])):
        res = stref.run_ctl(["--socket", daemon.socket, "attach", models[model]] + extra + ["--verify"])
        assert res.returncode == 0, res.describe() + "\n" + daemon.log_text()[-2000:]
