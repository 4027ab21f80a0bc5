"""``python -m weightd_vllm prewarm PATH [vLLM's parallel flags]``: load a vLLM layout's sets ahead of a start.

Exit codes as weightctl's: 0 success, 1 the operation failed, 2 usage error.
"""
from __future__ import annotations

import argparse
import json
import sys

from .prewarm import layout_for, prewarm, weightctl_command
from .ranks import PLACEMENTS, Unservable


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m weightd_vllm",
                                 description="Load every rank's weightd set of a vLLM layout before vLLM starts.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prewarm", help="load (or with --dry-run print) each rank's set")
    p.add_argument("path", help="the checkpoint directory, as vLLM and the daemon see it")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    p.add_argument("--enable-expert-parallel", "-ep", action="store_true")
    p.add_argument("--expert-placement-strategy", choices=PLACEMENTS, default="linear")
    p.add_argument("--all2all-backend", default="allgather_reducescatter",
                   help="as vLLM's flag: it decides whether round-robin placement is honoured")
    p.add_argument("--preset", default="auto", help="the plan preset (as the extra-config key preset)")
    p.add_argument("--devices", help="comma-separated devices of ranks 0, 1, ... (UUIDs or this process's "
                                     "CUDA indices); default: rank i on CUDA device i")
    p.add_argument("--socket", help="the daemon's socket (default: libweightd's search)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each rank's plan and the equivalent weightctl command; load nothing")
    return ap


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    try:
        loads = layout_for(a.path, tp_size=a.tensor_parallel_size, dp_size=a.data_parallel_size,
                           pp_size=a.pipeline_parallel_size, pcp_size=a.prefill_context_parallel_size,
                           enable_expert_parallel=a.enable_expert_parallel,
                           expert_placement=a.expert_placement_strategy, all2all_backend=a.all2all_backend,
                           preset=a.preset)
    except (Unservable, ValueError) as e:
        print(f"weightd_vllm: this layout is not served by weightd: {e}", file=sys.stderr)
        return 1
    devices = None
    if a.devices:
        devices = [int(d) if d.isdigit() else d for d in a.devices.split(",")]
        if len(devices) != len(loads):
            print(f"weightd_vllm: --devices names {len(devices)} devices for {len(loads)} ranks", file=sys.stderr)
            return 2
    if a.dry_run:
        for load in loads:
            dev = devices[load.rank] if devices else load.rank
            print(json.dumps({"rank": load.rank, "device": dev, "plan": load.plan}))
            print("  " + weightctl_command(a.path, load, dev))
        return 0
    import weightd

    try:
        with weightd.Client(a.socket) as c:
            for load, set_id in prewarm(c, a.path, loads, devices):
                print(f"rank {load.rank}: set {set_id} plan {json.dumps(load.plan)}")
    except weightd.Error as e:
        print(f"weightd_vllm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
