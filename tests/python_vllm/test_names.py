"""weightd output names and layouts -> vLLM 0.33 parameters (weightd_vllm.names): pure, against fixtures.

The fixture (fixtures/vllm-0.33-params.json) holds the parameters (names,
shapes, dtypes) of the tiny models as vLLM 0.33 builds them for each rank,
recorded from the real package by tests/vllm, which also checks that it
still matches. Here the plan the plugin asks for on each rank is built by
tests/python/layout_ref.py (weightd's presets from docs/protocol.md, written
independently of the daemon), renamed by names.to_vllm, and must give exactly
those parameters: fused qkv_proj / gate_up_proj / fused_qkv_a_proj, stacked
experts, the padded vocabulary, replicated kv heads.
"""
import pytest

import layout_ref
from conftest import vllm_fixture
from weightd_vllm import names

FIXTURE = vllm_fixture()
CASES = sorted(FIXTURE["cases"])


def _plan_kwargs(plan):
    kw = {k: v for k, v in plan.items() if k != "preset"}
    return dict(preset=plan["preset"], **kw)


def test_the_fixture_covers_dense_moe_mla_and_tp_ranks():
    models = {c["model"] for c in FIXTURE["cases"].values()}
    assert {"qwen3", "qwen3_moe_qk", "deepseek_v2", "deepseek_v3", "deepseek_v3_bf16", "qwen3_mqa"} <= models
    assert FIXTURE["vllm"].startswith("0.33.")
    plans = [c["plan"] for c in FIXTURE["cases"].values()]
    assert any(p["tp_size"] == 2 and p["tp_rank"] == 1 for p in plans)
    assert any(p.get("ep_size") == 2 for p in plans) and any("experts" in p for p in plans)
    fp8 = [c for c in FIXTURE["cases"].values() if c["model"] == "deepseek_v3"]
    assert fp8 and all(any(d == "F8_E4M3" for _, d in c["params"].values()) for c in fp8)
    assert all(any(n.endswith("w13_weight_scale_inv") for n in c["params"]) for c in fp8)


@pytest.mark.parametrize("case", CASES)
def test_plan_outputs_are_vllms_parameters(models, case):
    c = FIXTURE["cases"][case]
    ck = layout_ref.Checkpoint(models[c["model"]])
    outs = layout_ref.build(ck, **_plan_kwargs(c["plan"]))
    got = {names.to_vllm(n): [o.shape, o.dtype] for n, o in outs.items()}
    want = {n: [list(s), d] for n, (s, d) in c["params"].items()}
    # Everything vLLM has, weightd serves under that name with that shape and dtype.
    missing = sorted(set(want) - set(got))
    assert missing == [], missing
    wrong = {n: (got[n], want[n]) for n in want if got[n] != want[n]}
    assert wrong == {}, wrong
    # And weightd serves nothing else except what vLLM's models drop (a tied head's lm_head: none here).
    assert sorted(set(got) - set(want)) == []


def test_renames_are_each_others_inverse():
    pairs = [
        ("model.layers.3.mlp.experts.w13_weight", "model.layers.3.mlp.experts.routed_experts.w13_weight"),
        ("model.layers.3.mlp.experts.w2_weight", "model.layers.3.mlp.experts.routed_experts.w2_weight"),
        ("model.layers.3.mlp.experts.w13_weight_scale_inv",
         "model.layers.3.mlp.experts.routed_experts.w13_weight_scale_inv"),
        ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("model.layers.1.mlp.shared_experts.gate_up_proj.weight", "model.layers.1.mlp.shared_experts.gate_up_proj.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ]
    for wd, v in pairs:
        assert names.to_vllm(wd) == v
        assert names.to_weightd(v) == wd


CK = {
    "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.bias",
    "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias",
    "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
    "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
    "model.norm.weight",
} | {f"model.layers.1.mlp.experts.{e}.{m}.{s}" for e in range(3) for m in ("gate_proj", "up_proj", "down_proj")
     for s in ("weight", "weight_scale_inv")}


def test_checkpoint_sources():
    src = names.checkpoint_sources
    assert src("model.layers.0.self_attn.qkv_proj.weight", CK) == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]
    assert src("model.layers.0.self_attn.qkv_proj.bias", CK)[0] == "model.layers.0.self_attn.q_proj.bias"
    assert src("model.layers.0.mlp.gate_up_proj.weight", CK) == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert src("model.layers.1.self_attn.fused_qkv_a_proj.weight", CK) == [
        "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]
    # Experts in id order, gate before up within each; scales follow the suffix.
    assert src("model.layers.1.mlp.experts.routed_experts.w13_weight", CK) == [
        f"model.layers.1.mlp.experts.{e}.{m}.weight" for e in range(3) for m in ("gate_proj", "up_proj")]
    assert src("model.layers.1.mlp.experts.routed_experts.w2_weight_scale_inv", CK) == [
        f"model.layers.1.mlp.experts.{e}.down_proj.weight_scale_inv" for e in range(3)]
    many = {f"m.experts.{e}.down_proj.weight" for e in range(12)}
    assert src("m.experts.routed_experts.w2_weight", many) == [f"m.experts.{e}.down_proj.weight" for e in range(12)]
    assert src("model.norm.weight", CK) == ["model.norm.weight"]
    assert src("model.layers.0.self_attn.attn.k_scale", CK) == []
    # A model's own packed_modules_mapping adds fusions.
    assert src("model.layers.0.mlp.gu.weight", CK, {"gu": ["gate_proj", "up_proj"]}) == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]


@pytest.mark.parametrize("case", CASES)
def test_every_vllm_parameter_has_checkpoint_sources(models, case):
    """Tier 2 can build any parameter of these models from the checkpoint (what a fallback relies on)."""
    c = FIXTURE["cases"][case]
    ck = layout_ref.Checkpoint(models[c["model"]])
    for p in c["params"]:
        assert names.checkpoint_sources(p, ck.tensors), p
