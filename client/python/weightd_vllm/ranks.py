"""One vLLM rank's weightd plan, from vLLM's parallel layout (pure functions; vLLM is read only in from_vllm).

vLLM 0.33 lays a model out over its ranks like this (vllm/distributed/parallel_state.py,
model_executor/layers/fused_moe/config.py ``FusedMoEParallelConfig.make``,
fused_moe/expert_map_manager.py ``determine_expert_map``):

- attention, dense MLPs, shared experts and the vocabulary are split over the
  tensor-parallel group (``tp_size``, ``tp_rank``); data-parallel and
  prefill-context-parallel ranks hold copies;
- MoE experts are split over the flattened group of ``dp × pcp × tp`` ranks,
  rank ``dp_rank·pcp·tp + pcp_rank·tp + tp_rank``: without expert
  parallelism every expert is tensor-parallel over that group; with
  ``--enable-expert-parallel`` each rank holds whole experts — ``linear``
  placement: a contiguous run, the first ``E mod n`` ranks one more;
  ``round_robin``: experts ``rank, rank + n, ...``. vLLM uses round-robin
  only where it supports it and silently falls back to linear elsewhere
  (expert_map_manager.py ``determine_expert_placement_strategy``): the model
  must have more than one expert group, and with all-to-all kernels (EP with
  dp > 1, pcp > 1 or sequence-parallel MoE) the backend must be
  ``deepep_low_latency`` or ``nixl_ep`` (:func:`effective_placement`);
- pipeline parallelism gives each rank a range of layers.

weightd's presets (docs/protocol.md, "Plans") have one ``tp_size`` for
attention and dense experts, whole experts with ``ep_size`` > 1, and no layer
ranges. So :func:`plan_for` serves every layout except three, which raise
:class:`Unservable` (the loader then falls back, saying why): pipeline
parallelism, MoE tensor parallelism wider than attention's (dp or pcp > 1
without expert parallelism), and EPLB's redundant experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

PLACEMENTS = ("linear", "round_robin")
#: All-to-all backends that keep round-robin routing tables (``needs_round_robin_routing_tables``).
ROUND_ROBIN_BACKENDS = ("deepep_low_latency", "nixl_ep")


class Unservable(Exception):
    """weightd cannot produce this rank's layout (or cannot be reached); the message says why."""


@dataclass(frozen=True)
class Parallel:
    """The parallel layout of one vLLM rank (the fields of vLLM's parallel state that weights depend on)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0
    pcp_size: int = 1
    pcp_rank: int = 0
    enable_expert_parallel: bool = False
    enable_eplb: bool = False
    expert_placement: str = "linear"
    all2all_backend: str = "allgather_reducescatter"

    def all2all_kernels(self) -> bool:
        """vLLM's ``use_all2all_kernels``: EP with dp > 1, pcp > 1 or sequence-parallel MoE (which needs dp > 1)."""
        return self.enable_expert_parallel and (self.dp_size > 1 or self.pcp_size > 1)

    def moe_group(self) -> tuple[int, int]:
        """(size, rank) of the flattened dp × pcp × tp group MoE layers are split over."""
        size = self.dp_size * self.pcp_size * self.tp_size
        rank = self.dp_rank * self.pcp_size * self.tp_size + self.pcp_rank * self.tp_size + self.tp_rank
        return size, rank


def local_experts(num_experts: int, ep_size: int, ep_rank: int, placement: str = "linear") -> list[int]:
    """The global ids of the experts an expert-parallel rank holds, ascending (vLLM's placement rules)."""
    if placement == "round_robin":
        return list(range(ep_rank, num_experts, ep_size))
    base, extra = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, extra)
    return list(range(start, start + base + (1 if ep_rank < extra else 0)))


def effective_placement(p: Parallel, ep_size: int, expert_groups: int = 1) -> str:
    """The expert placement vLLM 0.33 actually uses for the requested one (round-robin falls back to linear)."""
    if p.expert_placement != "round_robin":
        return p.expert_placement
    if ep_size <= 1 or expert_groups <= 1 or p.enable_eplb:
        return "linear"
    if p.all2all_kernels() and p.all2all_backend not in ROUND_ROBIN_BACKENDS:
        return "linear"
    return "round_robin"


def plan_for(p: Parallel, *, num_experts: int = 0, expert_groups: int = 1, preset: str = "auto") -> dict:
    """The weightd plan object (a preset with fuse) for rank `p` of a model with `num_experts` routed experts.

    `expert_groups` is the model's number of expert groups (DeepSeek's
    ``n_group``), which decides whether vLLM honours round-robin placement.
    Raises Unservable when the presets cannot produce the layout vLLM builds.
    """
    for name in ("tp_size", "pp_size", "dp_size", "pcp_size"):
        if getattr(p, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(p, name)}")
    if p.pp_size > 1:
        raise Unservable(f"pipeline parallelism (pp {p.pp_size}): weightd's presets have no layer ranges, so "
                         f"every rank would load every layer")
    plan: dict[str, Any] = {"preset": preset, "tp_size": p.tp_size, "tp_rank": p.tp_rank}
    if num_experts > 0:
        size, rank = p.moe_group()
        if p.enable_eplb:
            raise Unservable("EPLB (--enable-eplb): redundant expert slots are not a weightd layout")
        if size > 1 and p.enable_expert_parallel:
            if p.expert_placement not in PLACEMENTS:
                raise Unservable(f"expert placement {p.expert_placement!r} is not one of {', '.join(PLACEMENTS)}")
            if size > num_experts:
                raise Unservable(f"{size} expert-parallel ranks for {num_experts} experts: some ranks hold none")
            plan["ep_size"] = size
            plan["ep_rank"] = rank
            if effective_placement(p, size, expert_groups) == "round_robin" and size < num_experts:
                plan["experts"] = local_experts(num_experts, size, rank, "round_robin")
        elif size != p.tp_size:
            raise Unservable(f"MoE experts are tensor-parallel over dp × pcp × tp = {size} ranks while attention "
                             f"is over tp = {p.tp_size}; a preset has one tp_size (use --enable-expert-parallel)")
    plan["fuse"] = True
    return plan


def plan_experts(plan: dict, num_experts: int) -> Optional[list[int]]:
    """The global ids of the whole experts a plan gives its rank, in stacking order; None: all, TP-sliced."""
    if plan.get("ep_size", 1) <= 1:
        return None
    if "experts" in plan:
        return sorted(plan["experts"])
    return local_experts(num_experts, plan["ep_size"], plan["ep_rank"])


def from_vllm(vllm_config: Any) -> Parallel:
    """This process's layout from vLLM's initialised parallel state and its ParallelConfig."""
    from vllm.distributed import (get_dp_group, get_pcp_group, get_pp_group, get_tensor_model_parallel_rank,
                                  get_tensor_model_parallel_world_size)

    pc = vllm_config.parallel_config
    tp_size = get_tensor_model_parallel_world_size()
    dp_size = int(getattr(pc, "data_parallel_size", 1) or 1)
    pcp_size = int(getattr(pc, "prefill_context_parallel_size", 1) or 1)
    return Parallel(
        tp_size=tp_size,
        tp_rank=get_tensor_model_parallel_rank() if tp_size > 1 else 0,
        pp_size=get_pp_group().world_size,
        dp_size=dp_size,
        dp_rank=get_dp_group().rank_in_group if dp_size > 1 else 0,
        pcp_size=pcp_size,
        pcp_rank=get_pcp_group().rank_in_group if pcp_size > 1 else 0,
        enable_expert_parallel=bool(getattr(pc, "enable_expert_parallel", False)),
        enable_eplb=bool(getattr(pc, "enable_eplb", False)),
        expert_placement=str(getattr(pc, "expert_placement_strategy", "linear")),
        all2all_backend=str(getattr(pc, "all2all_backend", "allgather_reducescatter")),
    )


def _text(config: Optional[dict]) -> dict:
    config = config or {}
    return config["text_config"] if isinstance(config.get("text_config"), dict) else config


def expert_groups(config: Optional[dict]) -> int:
    """The model's number of expert groups (DeepSeek's ``n_group``; 1 when it has none)."""
    v = _text(config).get("n_group")
    return v if isinstance(v, int) and v > 0 else 1


def num_experts(config: Optional[dict]) -> int:
    """The routed-expert count config.json declares (0 for a dense model)."""
    text = _text(config)
    for key in ("num_experts", "n_routed_experts", "num_local_experts"):
        v = text.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return 0
