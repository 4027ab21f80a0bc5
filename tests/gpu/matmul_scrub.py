#!/usr/bin/env python3
"""What the background scrub costs an engine's kernels: an 8192x8192 BF16 matmul loop on the GPU timed
while a daemon's background scrub runs over a resident set, against the same loop while that daemon is
stopped (SIGSTOP: no scrub kernel can start), alternating, in one process (issue: Integrity, target <= 1%).

The daemon must run with scrub on and its default scrub_duty, with a set resident on the same GPU, and
scrub_interval_ms at its minimum (1): the scrub then hashes one set after another, limited only by the duty
cycle, the most the default duty lets it take (at the default interval, 60 s, a 0.3 s loop would almost
never meet a scrub). Each run is `--iters` matmuls, each timed with CUDA events; a run's figure is the
median iteration, and the result compares the medians of the runs of each kind.

    python3 tests/gpu/matmul_scrub.py --pid PID --metrics http://127.0.0.1:PORT/metrics \
        [--runs 7] [--iters 200] [--json-out FILE]

Prints one line per run and one JSON object: each kind's per-run medians, their medians, the slowdown in
percent and the bytes the daemon's scrubs hashed meanwhile (its metrics).
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request


def scrubbed_bytes(url):
    """The daemon's weightd_scrubbed_bytes_total (its metrics endpoint), or None when it cannot be read."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("weightd_scrubbed_bytes_total "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def loop(torch, a, b, iters):
    """Median milliseconds of one matmul over iters of them, each timed with CUDA events."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for s, e in ev:
        s.record()
        torch.matmul(a, b)
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pid", type=int, required=True, help="the daemon whose background scrub runs")
    ap.add_argument("--metrics", required=True, help="the daemon's metrics URL (http://127.0.0.1:PORT/metrics)")
    ap.add_argument("--runs", type=int, default=7, help="runs of each kind, alternating")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    import torch

    torch.manual_seed(0)
    a = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):  # clocks up, cuBLAS's choice made
        loop(torch, a, b, args.iters)
    before = scrubbed_bytes(args.metrics)
    res = {"scrub": [], "paused": []}
    try:
        for i in range(2 * args.runs):
            kind = "scrub" if i % 2 == 0 else "paused"
            if kind == "paused":
                os.kill(args.pid, signal.SIGSTOP)
                time.sleep(0.05)  # a scrub kernel begun before the stop ends
            try:
                ms = loop(torch, a, b, args.iters)
            finally:
                if kind == "paused":
                    os.kill(args.pid, signal.SIGCONT)
            res[kind].append(ms)
            print(f"run {i}: {kind:6s} median {ms:.4f} ms per matmul", flush=True)
            time.sleep(0.2)
    finally:
        os.kill(args.pid, signal.SIGCONT)
    after = scrubbed_bytes(args.metrics)
    on, off = statistics.median(res["scrub"]), statistics.median(res["paused"])
    out = {"n": args.n, "iters": args.iters, "runs": args.runs, "device": torch.cuda.get_device_name(),
           "median_ms": {"scrub": on, "paused": off}, "runs_ms": res,
           "slowdown_percent": 100.0 * (on - off) / off,
           "scrubbed_bytes_during": None if before is None or after is None else after - before}
    print(json.dumps(out))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
