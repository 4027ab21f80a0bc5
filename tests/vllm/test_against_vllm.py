"""The plugin against a real vLLM 0.33 on the CPU: every parameter compared with DefaultModelLoader's.

One weightd (host backend) serves tiny checkpoints with the published
families' layouts. vLLM runs as one single-rank process and one two-rank
tensor-parallel group (two processes, gloo), each building every case's model
twice (tests/vllm/vllm_worker.py): once filled by vLLM's DefaultModelLoader,
once by the loader vLLM's registry returns for ``--load-format weightd``.
Every parameter must be byte-identical, each load must have taken the tier
the case is about (core.py), and the MoE layout weightd was asked for must
be the one vLLM's FusedMoE layers were built with.

By hand only (ctest -L vllm, see tests/vllm/run_vllm.py): vLLM is a 10 GB
install. process_weights_after_loading is not exercised, and FP8 layers are
built with vLLM's kernel choice stubbed out (see the worker).
"""
import json
import os
import re
import subprocess
import sys
import time

import pytest

import vllm_models
from weightd_vllm import ranks

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "python_vllm", "fixtures", "vllm-0.33-params.json")
WORKER = os.path.join(HERE, "vllm_worker.py")
RUN_TIMEOUT = int(os.environ.get("WD_VLLM_TIMEOUT", "1500"))

NOWHERE = "/nonexistent/weightd.sock"

# name -> (model, options). Single-rank cases, then two-rank ones.
WORLD1 = {
    "qwen3": ("qwen3", {}),
    "qwen3_tied": ("qwen3_tied", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama12", {}),
    "qwen3_moe": ("qwen3_moe_qk", {}),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3": ("deepseek_v3_bf16", {}),
    # FP8 block-quantised DeepSeek-V3 (weights F8_E4M3, weight_scale_inv F32), vLLM's kernel choice stubbed.
    "deepseek_v3_fp8": ("deepseek_v3", {"stub_fp8_kernels": True}),
    # Tier 2: these outputs hidden from the loader, so vLLM's load_weights builds them from weightd tensors.
    "tier2_o_proj": ("qwen3", {"hide": r"\.o_proj\."}),
    "tier2_qkv_experts": ("qwen3_moe_qk", {"hide": r"qkv_proj|w13_weight"}),
    "tier2_mla": ("deepseek_v3_bf16", {"hide": r"fused_qkv_a_proj|kv_b_proj|w2_weight"}),
    "tier2_fp8": ("deepseek_v3", {"hide": r"fused_qkv_a_proj|w13_weight", "stub_fp8_kernels": True}),
    # Tier 3: hidden, and their sources too: the default loader, with one warning.
    "tier3": ("qwen3", {"hide": r"\.o_proj\.", "nosources": r"\.o_proj\."}),
    "shared": ("qwen3", {"extra": {"mode": "shared"}}),
    "evict": ("qwen2", {"extra": {"keep_resident": False}}),
    "no_daemon": ("qwen3", {"extra": {"socket": NOWHERE}}),
    "no_daemon_strict": ("qwen3", {"extra": {"socket": NOWHERE, "fallback": False}, "expect_error": True}),
}
WORLD2 = {
    "tp2_qwen3": ("qwen3", {}),
    "tp2_qwen2": ("qwen2", {}),
    "tp2_mqa": ("qwen3_mqa", {}),  # one kv head, replicated on both ranks
    "tp2_moe": ("qwen3_moe_qk", {}),  # experts tensor-parallel
    "tp2_moe_ep": ("qwen3_moe_qk", {"ep": True}),
    # Round-robin asked for a model without expert groups: vLLM places linearly, and so must the plan.
    "tp2_moe_ep_rr": ("qwen3_moe_qk", {"ep": True, "placement": "round_robin"}),
    "tp2_deepseek_v3_ep_rr": ("deepseek_v3_bf16", {"ep": True, "placement": "round_robin"}),
    "tp2_moe_ep_tier2": ("qwen3_moe_qk", {"ep": True, "hide": r"w13_weight|w2_weight"}),
    "tp2_deepseek_v2_ep": ("deepseek_v2", {"ep": True}),
    "tp2_deepseek_v3": ("deepseek_v3_bf16", {}),
    "tp2_deepseek_v3_fp8": ("deepseek_v3", {"stub_fp8_kernels": True}),
    "tp2_deepseek_v3_fp8_ep": ("deepseek_v3", {"ep": True, "stub_fp8_kernels": True}),
}
PLAIN = {"qwen3", "qwen3_tied", "qwen2", "llama", "qwen3_moe", "deepseek_v2", "deepseek_v3", "deepseek_v3_fp8",
         "tp2_deepseek_v3_fp8", "tp2_deepseek_v3_fp8_ep", "evict",
         "tp2_qwen3", "tp2_qwen2", "tp2_mqa", "tp2_moe", "tp2_moe_ep", "tp2_moe_ep_rr", "tp2_deepseek_v2_ep",
         "tp2_deepseek_v3", "tp2_deepseek_v3_ep_rr"}


def _cases(table, root, socket):
    out = []
    for name, (model, o) in table.items():
        extra = {"socket": socket, **o.get("extra", {})}
        out.append({"name": name, "model": vllm_models.write(root, model), "extra": extra,
                    **{k: v for k, v in o.items() if k != "extra"}})
    return out


@pytest.fixture(scope="module")
def runs(workdir, model_root, binaries):
    """Runs both groups against one daemon; returns ({rank label: worker output}, the daemon's final status)."""
    import wdfixtures as fx

    d = fx.Daemon(workdir, model_root).start()
    try:
        procs = {}
        for world, table, port in ((1, WORLD1, 29611), (2, WORLD2, 29612)):
            spec = os.path.join(workdir, f"vllm-spec-{world}.json")
            with open(spec, "w") as f:
                json.dump({"world_size": world, "port": port, "cases": _cases(table, model_root, d.socket)}, f)
            for rank in range(world):
                out = os.path.join(workdir, f"vllm-out-{world}-{rank}.json")
                log = open(os.path.join(workdir, f"vllm-log-{world}-{rank}.txt"), "wb")
                p = subprocess.Popen([sys.executable, WORKER, spec, str(rank), out], stdout=log,
                                     stderr=subprocess.STDOUT)
                procs[f"w{world}r{rank}"] = (p, out, log)
        deadline = time.monotonic() + RUN_TIMEOUT
        results = {}
        for label, (p, out, log) in procs.items():
            try:
                rc = p.wait(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q, _, _ in procs.values():
                    q.kill()
                pytest.fail(f"vLLM worker {label} ran past {RUN_TIMEOUT} s")
            log.close()
            text = open(log.name, errors="replace").read()
            assert rc == 0 and os.path.exists(out), f"vLLM worker {label} exited {rc}:\n{text[-6000:]}"
            with open(out) as f:
                results[label] = json.load(f)
        status = d.status()
        d.assert_alive()
    finally:
        d.stop()
    return results, status


def _case(runs, label, name):
    results, _ = runs
    r = results[label]["cases"][name]
    assert "crash" not in r, r.get("crash")
    return r


def _labels(name):
    return ["w1r0"] if name in WORLD1 else ["w2r0", "w2r1"]


def test_vllm_finds_the_plugin(runs):
    c = runs[0]["w1r0"]["checks"]
    assert c["vllm_version"].startswith("0.33."), c
    assert c["interface_problems"] == [] and c["interface_warning"] is None, c  # the live interface check
    assert c["entry_point"] == "weightd_vllm:register"
    assert c["registry"] == "WeightdModelLoader"
    assert c["cli_load_format"] == "weightd" and c["cli_loader"] == "WeightdModelLoader"
    assert c["cli_extra"] == {"socket": NOWHERE, "mode": "copy"}


@pytest.mark.parametrize("name", sorted(set(WORLD1) | set(WORLD2)))
def test_parameters_equal_the_default_loaders(runs, name):
    for label in _labels(name):
        r = _case(runs, label, name)
        if WORLD1.get(name, (None, {}))[1].get("expect_error"):
            assert r["error"] and "NotServed" in r["error"] and "fallback is off" in r["error"], r["error"]
            continue
        assert r["error"] is None, f"{label}: {r['error']}"
        assert r["differ"] == [] and r["extra_params"] == [], f"{label}: {r['differ']} {r['extra_params']}"


@pytest.mark.parametrize("name", sorted(PLAIN))
def test_plain_loads_copy_every_parameter(runs, name):
    for label in _labels(name):
        r = _case(runs, label, name)
        rep = r["report"]
        assert rep["fallback_reason"] is None and rep["warnings"] == []
        assert rep["via_load_weights"] == [] and rep["via_default"] == [] and rep["exempt"] == []
        assert sorted(rep["copied"]) == sorted(r["params"]), label
        assert rep["plan"]["fuse"] is True


@pytest.mark.parametrize("name", ["tier2_o_proj", "tier2_qkv_experts", "tier2_mla", "tier2_fp8", "tp2_moe_ep_tier2"])
def test_tier2_goes_through_vllms_load_weights(runs, name):
    hide = (WORLD1.get(name) or WORLD2[name])[1]["hide"]
    for label in _labels(name):
        r = _case(runs, label, name)
        rep = r["report"]
        expect = sorted(p for p in r["params"] if re.search(hide, p.replace(".routed_experts", "")))
        assert expect and sorted(rep["via_load_weights"]) == expect
        assert rep["via_default"] == [] and rep["warnings"] == []
        assert sorted(rep["copied"] + rep["via_load_weights"]) == sorted(r["params"])


def test_tier3_names_the_parameters_in_one_warning(runs):
    r = _case(runs, "w1r0", "tier3")
    rep = r["report"]
    expect = sorted(p for p in r["params"] if ".o_proj." in p)
    assert rep["via_default"] == expect and len(rep["warnings"]) == 1
    assert all(p in rep["warnings"][0] for p in expect)
    assert sorted(rep["copied"] + rep["via_default"]) == sorted(r["params"])


def test_no_daemon_falls_back_with_one_warning(runs):
    rep = _case(runs, "w1r0", "no_daemon")["report"]
    assert rep["fallback_reason"] and len(rep["warnings"]) == 1 and "every parameter" in rep["warnings"][0]
    assert rep["copied"] == []


def test_shared_parameters_are_the_daemons_memory(runs):
    r = _case(runs, "w1r0", "shared")
    rep = r["report"]
    assert sorted(rep["shared"]) == sorted(r["params"]) and rep["copied"] == []
    assert r["shared_in_set"] and all("memfd:weightd-slab" in (m or "") for m in r["shared_in_set"].values()), \
        r["shared_in_set"]


def test_keep_resident_false_evicts_the_set(runs):
    _, status = runs
    evicted = _case(runs, "w1r0", "evict")["report"]["set_id"]
    kept = {_case(runs, label, "tp2_qwen2")["report"]["set_id"] for label in ("w2r0", "w2r1")}
    resident = {s["set"] for s in status["sets"]}
    assert evicted not in resident
    assert kept <= resident  # keep_resident defaults to true


MOE_CASES = ["qwen3_moe", "deepseek_v2", "tp2_moe", "tp2_moe_ep", "tp2_moe_ep_rr", "tp2_deepseek_v2_ep",
             "tp2_deepseek_v3", "tp2_deepseek_v3_ep_rr", "deepseek_v3_fp8", "tp2_deepseek_v3_fp8",
             "tp2_deepseek_v3_fp8_ep"]


@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_layout_is_the_one_vllm_built(runs, name):
    for label in _labels(name):
        r = _case(runs, label, name)
        moe, plan = r["moe"], r["report"]["plan"]
        assert moe, "no FusedMoE layer found"
        if moe["ep_size"] > 1:
            assert (plan["ep_size"], plan["ep_rank"]) == (moe["ep_size"], moe["ep_rank"])
            assert ranks.plan_experts(plan, 8) == moe["local_experts"]
        else:
            assert "ep_size" not in plan and (plan["tp_size"], plan["tp_rank"]) == (moe["tp_size"], moe["tp_rank"])


def test_round_robin_is_honoured_where_vllm_honours_it(runs):
    """DeepSeek-V3 has expert groups: vLLM places round-robin; Qwen3-MoE has none: vLLM falls back to linear."""
    rr = [_case(runs, lb, "tp2_deepseek_v3_ep_rr")["moe"]["local_experts"] for lb in ("w2r0", "w2r1")]
    assert rr == [[0, 2, 4, 6], [1, 3, 5, 7]]
    linear = [_case(runs, lb, "tp2_moe_ep_rr")["moe"]["local_experts"] for lb in ("w2r0", "w2r1")]
    assert linear == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_fixture_matches_vllms_parameters(runs):
    """tests/python_vllm/fixtures/vllm-0.33-params.json (the CI tests' fake models) is what vLLM builds."""
    results, _ = runs
    got = {}
    for label, res in sorted(results.items()):
        for name, r in res["cases"].items():
            if name in PLAIN and name != "evict":
                got[f"{name}/{label}"] = {"model": (WORLD1.get(name) or WORLD2[name])[0], "params": r["params"],
                                          "plan": r["report"]["plan"]}
    if os.environ.get("WD_VLLM_UPDATE_FIXTURE") == "1":
        os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
        with open(FIXTURE, "w") as f:
            json.dump({"vllm": results["w1r0"]["checks"]["vllm_version"], "cases": got}, f, indent=1, sort_keys=True)
    with open(FIXTURE) as f:
        fixture = json.load(f)
    assert fixture["cases"] == got
