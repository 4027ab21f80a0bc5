"""Prewarming a vLLM layout: load every rank's set before the engine starts (the role-switch recipe).

A prefill/decode role switch restarts vLLM with another parallel layout
(say, prefill at ``-tp 8`` and decode at ``-dp 8 --enable-expert-parallel``).
When an autoscaler has already loaded the new layout's sets, each worker's
``--load-format weightd`` load finds its set resident: the switch costs an
attach and a device-to-device copy instead of a read of the checkpoint.
:func:`layout` computes each rank's plan and GPU exactly as the workers will
(ranks.plan_for); :func:`prewarm` loads them.

    python -m weightd_vllm prewarm /models/qwen3-30b-a3b --tensor-parallel-size 1 \\
        --data-parallel-size 8 --enable-expert-parallel

A rank's GPU is vLLM's default placement on one node: rank
``((dp_rank · pp + pp_rank) · pcp + pcp_rank) · tp + tp_rank`` (vLLM's
``DP × PP × PCP × TP`` rank order, vllm/distributed/parallel_state.py) runs
on CUDA device ``rank`` of its ``CUDA_VISIBLE_DEVICES``; ``devices=`` names
them otherwise.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from .ranks import Parallel, expert_groups, num_experts, plan_for


@dataclass(frozen=True)
class RankLoad:
    """One rank of a layout: its index (its default CUDA device), its layout and its weightd plan."""

    rank: int
    parallel: Parallel
    plan: dict


def layout(*, tp_size: int, dp_size: int = 1, pcp_size: int = 1, pp_size: int = 1,
           enable_expert_parallel: bool = False, expert_placement: str = "linear",
           all2all_backend: str = "allgather_reducescatter", num_experts: int = 0, expert_groups: int = 1,
           preset: str = "auto") -> list[RankLoad]:
    """Every rank of a vLLM layout on one node, in vLLM's rank order; raises Unservable as plan_for does."""
    out = []
    for dp_rank in range(dp_size):
        for pp_rank in range(pp_size):
            for pcp_rank in range(pcp_size):
                for tp_rank in range(tp_size):
                    p = Parallel(tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size, dp_size=dp_size,
                                 dp_rank=dp_rank, pcp_size=pcp_size, pcp_rank=pcp_rank,
                                 enable_expert_parallel=enable_expert_parallel, expert_placement=expert_placement,
                                 all2all_backend=all2all_backend)
                    rank = ((dp_rank * pp_size + pp_rank) * pcp_size + pcp_rank) * tp_size + tp_rank
                    out.append(RankLoad(rank, p, plan_for(p, num_experts=num_experts, expert_groups=expert_groups,
                                                          preset=preset)))
    return out


def read_config(path: str) -> dict:
    """config.json of the checkpoint directory (empty when there is none)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def weightctl_command(path: str, load: RankLoad, device: Any) -> str:
    """The ``weightctl load`` command line that loads the same set."""
    p = load.plan
    args = ["weightctl", "load", path, "--device", str(device), "--preset", p["preset"],
            "--tp-size", str(p["tp_size"]), "--tp-rank", str(p["tp_rank"])]
    if "ep_size" in p:
        args += ["--ep-size", str(p["ep_size"]), "--ep-rank", str(p["ep_rank"])]
    if "experts" in p:
        args += ["--experts", ",".join(str(e) for e in p["experts"])]
    if p.get("fuse"):
        args.append("--fuse")
    return " ".join(args)


def prewarm(client: Any, path: str, loads: Sequence[RankLoad], devices: Optional[Sequence[Any]] = None,
            progress: Any = None) -> list[tuple[RankLoad, str]]:
    """Loads each rank's set onto its device; returns (rank, set id) pairs.

    ``devices[i]`` is rank i's device (a UUID, or this process's CUDA index);
    default: CUDA device ``rank`` of this process, as vLLM places ranks.
    """
    out = []
    for load in loads:
        device = devices[load.rank] if devices is not None else load.rank
        out.append((load, client.load(path, device=device, plan=load.plan, progress=progress)))
    return out


def layout_for(path: str, **kw: Any) -> list[RankLoad]:
    """layout() with the expert count and groups read from the checkpoint's config.json."""
    config = read_config(path)
    return layout(num_experts=num_experts(config), expert_groups=expert_groups(config), **kw)
