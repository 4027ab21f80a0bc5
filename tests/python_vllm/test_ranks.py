"""vLLM's parallel layout -> the weightd plan of each rank (weightd_vllm.ranks, .prewarm): pure functions.

The expected values are vLLM 0.33's, as its documentation of
FusedMoEParallelConfig.make (model_executor/layers/fused_moe/config.py) and
determine_expert_map state them; the expert ranges are also checked against
tests/python/layout_ref.py, which implements weightd's presets from
docs/protocol.md on its own. tests/vllm checks the same against the MoE
layers a real vLLM builds.
"""
import json
import subprocess
import sys

import pytest

import layout_ref
from weightd_vllm import prewarm
from weightd_vllm.ranks import (Parallel, Unservable, effective_placement, expert_groups, local_experts,
                                num_experts, plan_experts, plan_for)


def test_dense_ranks_are_tensor_parallel_only():
    for tp in (1, 2, 4, 8):
        for r in range(tp):
            assert plan_for(Parallel(tp_size=tp, tp_rank=r)) == \
                {"preset": "auto", "tp_size": tp, "tp_rank": r, "fuse": True}
    # Data-parallel and context-parallel replicas hold the same weights as their tp rank.
    assert plan_for(Parallel(tp_size=2, tp_rank=1, dp_size=4, dp_rank=3, pcp_size=2, pcp_rank=1)) == \
        {"preset": "auto", "tp_size": 2, "tp_rank": 1, "fuse": True}
    assert plan_for(Parallel(tp_size=2, tp_rank=1), preset="dense")["preset"] == "dense"


# vLLM's own table (FusedMoEParallelConfig.make's docstring): (tp, dp, ep enabled) -> per device
# (tp_rank, dp_rank) -> MoE (tp size, tp rank, ep size, ep rank).
VLLM_MOE_TABLE = [
    (2, 1, False, {(0, 0): (2, 0, 1, 0), (1, 0): (2, 1, 1, 0)}),
    (2, 1, True, {(0, 0): (1, 0, 2, 0), (1, 0): (1, 0, 2, 1)}),
    (1, 2, True, {(0, 0): (1, 0, 2, 0), (0, 1): (1, 0, 2, 1)}),
    (2, 2, True, {(0, 0): (1, 0, 4, 0), (1, 0): (1, 0, 4, 1), (0, 1): (1, 0, 4, 2), (1, 1): (1, 0, 4, 3)}),
]


@pytest.mark.parametrize("tp,dp,ep,devices", VLLM_MOE_TABLE)
def test_moe_ranks_follow_vllms_table(tp, dp, ep, devices):
    for (tp_rank, dp_rank), (mtp, mtp_rank, esize, erank) in devices.items():
        plan = plan_for(Parallel(tp_size=tp, tp_rank=tp_rank, dp_size=dp, dp_rank=dp_rank,
                                 enable_expert_parallel=ep), num_experts=8)
        # Attention is always over vLLM's tp group.
        assert (plan["tp_size"], plan["tp_rank"]) == (tp, tp_rank)
        if esize > 1:
            assert (plan["ep_size"], plan["ep_rank"]) == (esize, erank)
        else:
            assert "ep_size" not in plan and (mtp, mtp_rank) == (tp, tp_rank)


def test_moe_tensor_parallel_wider_than_attention_is_refused():
    # vLLM's table: tp 2, dp 2, no EP -> experts tensor-parallel over 4 devices, attention over 2.
    with pytest.raises(Unservable, match=r"dp × pcp × tp = 4 .* tp = 2"):
        plan_for(Parallel(tp_size=2, dp_size=2, dp_rank=1), num_experts=8)
    with pytest.raises(Unservable, match="pcp"):
        plan_for(Parallel(tp_size=1, pcp_size=2), num_experts=8)


def test_unservable_layouts_say_why():
    with pytest.raises(Unservable, match="pipeline parallelism"):
        plan_for(Parallel(tp_size=2, pp_size=2))
    with pytest.raises(Unservable, match="EPLB"):
        plan_for(Parallel(tp_size=2, enable_expert_parallel=True, enable_eplb=True), num_experts=8)
    with pytest.raises(Unservable, match="16 expert-parallel ranks for 8 experts"):
        plan_for(Parallel(tp_size=8, dp_size=2, enable_expert_parallel=True), num_experts=8)
    with pytest.raises(Unservable, match="placement"):
        plan_for(Parallel(tp_size=2, enable_expert_parallel=True, expert_placement="zigzag"), num_experts=8)
    with pytest.raises(ValueError, match="tp_size"):
        plan_for(Parallel(tp_size=0))
    # EPLB matters only where there are experts.
    assert plan_for(Parallel(enable_eplb=True))["tp_size"] == 1


@pytest.mark.parametrize("experts,ep", [(8, 2), (8, 3), (10, 4), (128, 16), (5, 5), (7, 2)])
def test_linear_placement_matches_the_presets_contiguous_experts(experts, ep):
    seen = []
    for r in range(ep):
        mine = local_experts(experts, ep, r)
        ref = layout_ref._Builder.local_experts(_Stub(ep, r), experts)
        assert mine == ref, (r, mine, ref)
        seen += mine
    assert seen == list(range(experts))


class _Stub:
    """The fields layout_ref._Builder.local_experts reads."""

    def __init__(self, ep, epr, experts=None):
        self.ep, self.epr, self.experts = ep, epr, experts

    def problem(self, *a):
        raise AssertionError(a)


def test_round_robin_placement_lists_the_experts():
    assert [local_experts(8, 3, r, "round_robin") for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    plan = plan_for(Parallel(tp_size=2, tp_rank=1, enable_expert_parallel=True, expert_placement="round_robin"),
                    num_experts=8, expert_groups=8)
    assert plan == {"preset": "auto", "tp_size": 2, "tp_rank": 1, "ep_size": 2, "ep_rank": 1,
                    "experts": [1, 3, 5, 7], "fuse": True}
    assert plan_experts(plan, 8) == [1, 3, 5, 7]


# vLLM 0.33 honours round-robin only with expert groups, and with all-to-all kernels (EP with
# dp or pcp > 1) only on the deepep_low_latency and nixl_ep backends (expert_map_manager.py).
@pytest.mark.parametrize("groups,dp,backend,want", [
    (1, 1, "allgather_reducescatter", "linear"),
    (8, 1, "allgather_reducescatter", "round_robin"),
    (8, 2, "allgather_reducescatter", "linear"),
    (8, 2, "deepep_high_throughput", "linear"),
    (8, 2, "deepep_low_latency", "round_robin"),
    (8, 2, "nixl_ep", "round_robin"),
])
def test_round_robin_falls_back_to_linear_where_vllm_does(groups, dp, backend, want):
    p = Parallel(tp_size=2, dp_size=dp, enable_expert_parallel=True, expert_placement="round_robin",
                 all2all_backend=backend)
    assert effective_placement(p, p.moe_group()[0], groups) == want
    plan = plan_for(p, num_experts=16, expert_groups=groups)
    assert ("experts" in plan) == (want == "round_robin")
    assert plan_experts(plan, 16) == local_experts(16, plan["ep_size"], 0, want)


def test_plan_experts():
    assert plan_experts({"tp_size": 2, "tp_rank": 1}, 8) is None
    assert plan_experts({"ep_size": 3, "ep_rank": 2}, 10) == [7, 8, 9]
    assert plan_experts({"ep_size": 3, "ep_rank": 0}, 10) == [0, 1, 2, 3]


def test_num_experts_from_config():
    assert num_experts({"model_type": "qwen3", "num_hidden_layers": 2}) == 0
    assert num_experts({"model_type": "qwen3_moe", "num_experts": 128}) == 128
    assert num_experts({"model_type": "deepseek_v3", "n_routed_experts": 256}) == 256
    assert num_experts({"model_type": "mixtral", "num_local_experts": 8}) == 8
    assert num_experts({"text_config": {"num_experts": 64}}) == 64
    assert num_experts(None) == 0
    assert expert_groups({"n_group": 8}) == 8 and expert_groups({"model_type": "qwen3_moe"}) == 1


def test_prewarm_layout_is_vllms_rank_order():
    loads = prewarm.layout(tp_size=2, dp_size=2, enable_expert_parallel=True, num_experts=8)
    assert [ld.rank for ld in loads] == [0, 1, 2, 3]
    assert [(ld.parallel.dp_rank, ld.parallel.tp_rank) for ld in loads] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [(ld.plan["tp_rank"], ld.plan["ep_rank"]) for ld in loads] == [(0, 0), (1, 1), (0, 2), (1, 3)]
    assert {ld.plan["ep_size"] for ld in loads} == {4}
    # The same plans the workers compute (ranks.plan_for) - the set identity depends on it.
    for ld in loads:
        assert ld.plan == plan_for(ld.parallel, num_experts=8)
    with pytest.raises(Unservable):
        prewarm.layout(tp_size=2, pp_size=2)


def test_prewarm_commands():
    ld = prewarm.layout(tp_size=2, enable_expert_parallel=True, expert_placement="round_robin", num_experts=4,
                        expert_groups=2)[1]
    assert prewarm.weightctl_command("/m", ld, "GPU-1") == \
        "weightctl load /m --device GPU-1 --preset auto --tp-size 2 --tp-rank 1 --ep-size 2 --ep-rank 1 " \
        "--experts 1,3 --fuse"


def test_prewarm_cli_dry_run(models):
    out = subprocess.run([sys.executable, "-m", "weightd_vllm", "prewarm", models["qwen3_moe_qk"], "-tp", "2",
                          "--enable-expert-parallel", "--dry-run"], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [(x["rank"], x["device"], x["plan"]["ep_rank"]) for x in lines] == [(0, 0, 0), (1, 1, 1)]
    bad = subprocess.run([sys.executable, "-m", "weightd_vllm", "prewarm", models["qwen3"], "-pp", "2",
                          "--dry-run"], capture_output=True, text=True, env=_env(), timeout=60)
    assert bad.returncode == 1 and "pipeline parallelism" in bad.stderr


def _env():
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.path.join(here, "..", "..", "client", "python"),
                PYTHONDONTWRITEBYTECODE="1")
