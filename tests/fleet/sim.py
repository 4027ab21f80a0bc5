#!/usr/bin/env python3
"""A flow-level model of a fleet scaling out for one checkpoint: N nodes, an object store, and the
nodes' daemons serving each other the ranges they hold. Standard library only; deterministic (the
only randomness is a seeded hash). docs/fleet-model.md explains the model and quotes its numbers.

    python3 tests/fleet/sim.py [--nodes 256 --ckpt-gb 1000 ...] [--strategy s3|peers|peers-naive|all] [--json]
    python3 tests/fleet/sim.py --sweep [--json]      where each target fails, parameter by parameter

What is modelled. Every node needs the whole checkpoint (its 8 GPUs hold 1/8 each, TP or EP: the
node as a whole needs every byte), cut into ranges of --range-mib, the unit a node asks a source
for. A node comes up at its wave's arrival time (--waves, --wave-gap), then fetches ranges:

  from the object store   one stream per node, a range at a time over --store-conns connections of
                          --store-conn-mbps each; the store's egress is shared by every node and is
                          at most min(--store-gbps, --store-rps x --request-mib x --prefixes) (the
                          request-rate limit turned into bytes per second)
  from peers              --peer-lanes concurrent ranges per node, each from one peer at most
                          --peer-conn-gbps; a peer serves at most its --serve-gbps (default its NIC)

A node's ingress is min(its NIC, --gpus x --pcie-gibps): the ranges go on to its GPUs as they come.
Every --dt seconds each node shares its ingress max-min among its flows (their caps), and then
each sender (the store, every peer) shares its egress max-min among what the receivers asked of
it; a flow moves at that rate until the next step. A flow that finishes a range within a step
goes on to its next range at the same rate until the step ends (for a peer lane, from the new
range's sender: within one step a sender can be over its egress by what such lanes move).

Strategies:
  s3           every node fetches every range from the store.
  peers        rendezvous spreading: a range some peer holds is fetched from the holder that
               ranks highest for (content id, range) by HRW (highest random weight); a range no
               peer holds is fetched from the store only by its owner, the node up that ranks
               highest for it, once (a claimed range is not fetched again), so the store sends
               each range about once; a node with nothing to fetch waits.
  peers-naive  the same peer choice, but a node fetches from the store any range no peer holds
               when it gets to it (nothing says a range is already being fetched): what "peers,
               then the store" gives without owners.
--seeds K adds K nodes that hold the whole checkpoint at time 0 (nodes already serving it).

Outputs: time until every node's ranges are resident (from the first arrival), each node's load
time (from its own arrival: p50, p99, max), store egress in copies of the checkpoint, the most
bytes one peer served, and the targets of issue 31: egress <= 2 copies, and the slowest node's load
time <= 1.5 x one node's load from its fastest source (the checkpoint over the best of the store's
and a peer's rate for a node alone).
"""
import argparse
import bisect
import hashlib
import heapq
import json
import math
import sys

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30

STRATEGIES = ("s3", "peers", "peers-naive")

# The inputs, one table: name, default, and what it is with where it comes from (docs/fleet-model.md
# gives the same list). It feeds the command line's flags and --help.
INPUTS = [
    ("nodes", 256, "nodes that load the checkpoint (issue 31)"),
    ("ckpt_gb", 1000.0, "checkpoint size, GB: 1T parameters in FP8 (issue 31)"),
    ("gpus", 8, "GPUs per node (assumption: an 8-GPU node)"),
    ("pcie_gibps", 51.6, "host-to-device per GPU, measured (docs/benchmarks.md, H200 and H100)"),
    ("nic_gbps", 200.0, "front-end NIC per node, Gbit/s, each direction (assumption)"),
    ("serve_gbps", 0.0, "a daemon's serving cap, Gbit/s; 0: its NIC (assumption)"),
    ("store_gbps", 800.0, "the store's aggregate egress, Gbit/s (assumption)"),
    ("store_rps", 5500.0, "GETs per second per prefix (AWS S3's published guideline)"),
    ("request_mib", 16.0, "bytes per range GET (AWS's guideline: 8-16 MB)"),
    ("prefixes", 1, "prefixes the shards are spread over"),
    ("store_conns", 64, "store connections per node (assumption; weightd's default is 16)"),
    ("store_conn_mbps", 96.0, "MB/s per store connection: Run:ai's 15 GB in 4.88 s over 32 (published)"),
    ("peer_lanes", 4, "ranges in flight from peers per node (assumption)"),
    ("peer_conn_gbps", 50.0, "Gbit/s per peer connection (assumption: one TCP stream)"),
    ("serve_slots", 4, "ranges a daemon serves at once; a busy holder sends the asker down the HRW order (0: no limit)"),
    ("range_mib", 512.0, "the unit of rendezvous and of a request to a source"),
    ("waves", 4, "the autoscaler brings nodes up in this many equal waves"),
    ("wave_gap", 10.0, "seconds between waves"),
    ("seeds", 0, "nodes holding the whole checkpoint at time 0"),
    ("dt", 0.05, "seconds per allocation step"),
    ("seed", 31, "the hash seed (the content id's stand-in)"),
]
DEFAULTS = {k: v for k, v, _ in INPUTS}



def waterfill(caps, capacity):
    """Returns the max-min fair shares of capacity among flows with these caps (same order)."""
    n = len(caps)
    out = [0.0] * n
    if n == 0:
        return out
    order = sorted(range(n), key=lambda i: caps[i])
    left = capacity
    for k, i in enumerate(order):
        share = left / (n - k)
        give = caps[i] if caps[i] < share else share
        out[i] = give
        left -= give
    return out


def hrw_score(seed, rng, node):
    """The rendezvous weight of node for range rng of the content id named by seed."""
    h = hashlib.blake2b(b"%d/%d/%d" % (seed, rng, node), digest_size=8).digest()
    return int.from_bytes(h, "big")


def percentile(sorted_vals, q):
    """The nearest-rank q-th percentile of an ascending list."""
    if not sorted_vals:
        return 0.0
    k = max(0, min(len(sorted_vals) - 1, math.ceil(q / 100.0 * len(sorted_vals)) - 1))
    return sorted_vals[k]


class Flow:
    """One transfer in progress: a range from a sender (-1: the store) to a receiver."""
    __slots__ = ("rng", "sender", "left", "cap", "rate")

    def __init__(self, rng, sender, left, cap):
        self.rng, self.sender, self.left, self.cap, self.rate = rng, sender, left, cap, 0.0


class Node:
    __slots__ = ("idx", "arrival", "up", "done", "state", "missing", "store_q", "store_flow",
                 "lanes", "avail", "from_store", "from_peers", "served", "seed_node")

    def __init__(self, idx, arrival, m, seed_node):
        self.idx, self.arrival, self.seed_node = idx, arrival, seed_node
        self.up = seed_node
        self.done = 0.0 if seed_node else None
        self.state = bytearray([2 if seed_node else 0]) * m  # 0 missing, 1 in flight, 2 held
        self.missing = 0 if seed_node else m
        self.store_q = []          # ranges this node may fetch from the store, in order (a stack: last first)
        self.store_flow = None
        self.lanes = []
        self.avail = []            # heap of (this node's order key, range) held by some peer
        self.from_store = 0
        self.from_peers = 0
        self.served = 0


class Fleet:
    """One run of one strategy over one set of parameters (a dict with DEFAULTS' keys)."""

    def __init__(self, p, strategy):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy {strategy!r}: expected one of {', '.join(STRATEGIES)}")
        for key in ("nodes", "ckpt_gb", "gpus", "pcie_gibps", "nic_gbps", "store_gbps", "store_rps",
                    "request_mib", "prefixes", "store_conns", "store_conn_mbps", "peer_lanes",
                    "peer_conn_gbps", "range_mib", "waves", "dt"):
            if not p[key] > 0:
                raise ValueError(f"{key.replace('_', '-')} must be > 0 (got {p[key]})")
        if p["wave_gap"] < 0 or p["seeds"] < 0 or p["serve_gbps"] < 0 or p["serve_slots"] < 0:
            raise ValueError("wave-gap, seeds, serve-gbps and serve-slots must be >= 0")
        self.p, self.strategy = p, strategy
        self.size = int(p["ckpt_gb"] * GB)
        self.range_bytes = int(p["range_mib"] * MiB)
        self.m = -(-self.size // self.range_bytes)
        self.ingress = min(p["nic_gbps"] * GB / 8, p["gpus"] * p["pcie_gibps"] * GiB)
        self.egress = (p["serve_gbps"] or p["nic_gbps"]) * GB / 8
        self.store_cap = min(p["store_gbps"] * GB / 8,
                             p["store_rps"] * p["request_mib"] * MiB * p["prefixes"])
        self.store_flow_cap = p["store_conns"] * p["store_conn_mbps"] * 1e6
        self.peer_cap = p["peer_conn_gbps"] * GB / 8
        n, k = int(p["nodes"]), int(p["seeds"])
        waves = int(p["waves"])
        self.nodes = [Node(i, (i * waves // n) * p["wave_gap"], self.m, False) for i in range(n)]
        self.nodes += [Node(n + j, 0.0, self.m, True) for j in range(k)]
        self.loaders = self.nodes[:n]
        self.holders = [k] * self.m          # how many nodes hold each range
        self.claimed = bytearray(self.m)
        self.serving = [0] * len(self.nodes)  # peer ranges each node is serving now     # peers: a store fetch of the range has started
        self.store_bytes = 0
        self.t = 0.0
        self.seed = int(p["seed"])
        self.ranking = None
        if strategy != "s3":
            # Each range's HRW order over every node (loaders and seeds): the first holder in it
            # serves the range, the first loader up in it owns the range's store fetch.
            self.ranking = []
            self.held_ranks = []  # per range, the HRW ranks of its holders, ascending
            self.rank_of = []     # per range, each node's HRW rank
            everyone = range(len(self.nodes))
            for r in range(self.m):
                order = sorted(everyone, key=lambda i, r=r: -hrw_score(self.seed, r, i))
                self.ranking.append(order)
                pos = [0] * len(order)
                for k, i in enumerate(order):
                    pos[i] = k
                self.rank_of.append(pos)
                self.held_ranks.append(sorted(k for k, i in enumerate(order) if self.nodes[i].seed_node))

    def rsize(self, r):
        return min(self.range_bytes, self.size - r * self.range_bytes)

    def order_key(self, node, r):
        """A node's own order over ranges (a seeded hash), so nodes ask for different ranges first."""
        return hrw_score(self.seed ^ 0x5EED, r, node)

    # ---- arrivals and what a node may fetch -------------------------------------------------

    def arrive(self, nd):
        nd.up = True
        if self.strategy == "s3":
            nd.store_q = list(range(self.m - 1, -1, -1))
            return
        key = self.order_key
        nd.avail = [(key(nd.idx, r), r) for r in range(self.m) if self.holders[r] > 0]
        heapq.heapify(nd.avail)
        if self.strategy == "peers-naive":
            nd.store_q = sorted(range(self.m), key=lambda r: -key(nd.idx, r))

    def assign_owners(self):
        """peers: gives every range no one holds or has claimed to its owner's store queue."""
        for nd in self.loaders:
            nd.store_q = []
        nodes = self.nodes
        for r in range(self.m):
            if self.holders[r] or self.claimed[r]:
                continue
            for i in self.ranking[r]:
                o = nodes[i]
                if o.up and not o.seed_node:
                    o.store_q.append(r)
                    break
        for nd in self.loaders:
            nd.store_q.reverse()

    def next_store_range(self, nd):
        while nd.store_q:
            r = nd.store_q.pop()
            if nd.state[r] != 0:
                continue
            if self.strategy != "s3" and self.holders[r] > 0:
                continue  # a peer has it: the peer lanes fetch it
            if self.strategy == "peers":
                if self.claimed[r]:
                    continue
                self.claimed[r] = 1
            return r
        return None

    def next_peer_range(self, nd):
        """The next range nd fetches from a peer and the peer: the first holder in the range's HRW
        order that has a serving slot free; a range whose holders are all busy waits its turn."""
        slots = self.p["serve_slots"]
        busy, found, tries = [], None, 0
        while nd.avail and found is None and tries < 16:
            item = heapq.heappop(nd.avail)
            r = item[1]
            if nd.state[r] != 0:
                continue
            tries += 1
            order = self.ranking[r]
            for k in self.held_ranks[r]:
                i = order[k]
                if not slots or self.serving[i] < slots:
                    found = (r, i)
                    break
            else:
                busy.append(item)
        for item in busy:
            heapq.heappush(nd.avail, item)
        if found:
            self.serving[found[1]] += 1
        return found

    def start_flows(self, nd):
        if nd.store_flow is None:
            r = self.next_store_range(nd)
            if r is not None:
                nd.state[r] = 1
                nd.store_flow = Flow(r, -1, float(self.rsize(r)), self.store_flow_cap)
        if self.strategy != "s3":
            while len(nd.lanes) < self.p["peer_lanes"]:
                got = self.next_peer_range(nd)
                if got is None:
                    break
                r, s = got
                nd.state[r] = 1
                nd.lanes.append(Flow(r, s, float(self.rsize(r)), self.peer_cap))

    def complete(self, nd, f, when):
        r = f.rng
        size = self.rsize(r)
        nd.state[r] = 2
        nd.missing -= 1
        if f.sender < 0:
            nd.from_store += size
            self.store_bytes += size
        else:
            nd.from_peers += size
            self.nodes[f.sender].served += size
            self.serving[f.sender] -= 1
        self.holders[r] += 1
        if self.strategy != "s3":
            bisect.insort(self.held_ranks[r], self.rank_of[r][nd.idx])
        if self.holders[r] == 1 and self.strategy != "s3":
            key = self.order_key
            for o in self.loaders:
                if o.up and o.state[r] == 0:
                    heapq.heappush(o.avail, (key(o.idx, r), r))
        if nd.missing == 0:
            nd.done = when

    # ---- one step -----------------------------------------------------------------------------

    def allocate(self, active):
        store_flows, by_sender = [], {}
        for nd in active:
            flows = ([nd.store_flow] if nd.store_flow else []) + nd.lanes
            for f, d in zip(flows, waterfill([f.cap for f in flows], self.ingress)):
                f.rate = d
                if f.sender < 0:
                    store_flows.append(f)
                else:
                    by_sender.setdefault(f.sender, []).append(f)
        for group, cap in [(store_flows, self.store_cap)] + [(g, self.egress) for g in by_sender.values()]:
            for f, a in zip(group, waterfill([f.rate for f in group], cap)):
                f.rate = a

    def advance(self, nd, f, h):
        """Moves flow f for h seconds at its rate; returns the flow that goes on (or None)."""
        t0, budget, rate = self.t, f.rate * h, f.rate
        used = 0.0
        while f is not None and f.left <= budget - used + 1.0:  # within a byte: done
            used += f.left
            self.complete(nd, f, t0 + used / rate)
            if f.sender < 0:
                r = self.next_store_range(nd)
                nxt = Flow(r, -1, float(self.rsize(r)), f.cap) if r is not None else None
            else:
                got = self.next_peer_range(nd)
                nxt = Flow(got[0], got[1], float(self.rsize(got[0])), f.cap) if got else None
            if nxt is not None:
                nd.state[nxt.rng] = 1
                nxt.rate = rate
            f = nxt
        if f is not None:
            f.left -= budget - used
        return f

    def run(self):
        pending = sorted(self.loaders, key=lambda nd: (nd.arrival, nd.idx))
        pi = 0
        self.t = pending[0].arrival if pending else 0.0
        steps = 0
        while True:
            arrived = False
            while pi < len(pending) and pending[pi].arrival <= self.t + 1e-12:
                self.arrive(pending[pi])
                pi += 1
                arrived = True
            if arrived and self.strategy == "peers":
                self.assign_owners()
            active = [nd for nd in self.loaders if nd.up and nd.done is None]
            if not active and pi == len(pending):
                break
            for nd in active:
                self.start_flows(nd)
            self.allocate(active)
            nxt_arrival = pending[pi].arrival - self.t if pi < len(pending) else math.inf
            moving = [nd for nd in active if nd.store_flow or nd.lanes]
            if self.strategy == "s3":
                # Rates change only when a node arrives or finishes: step to the next of those.
                h = min([nxt_arrival] + [self.s3_left(nd) / nd.store_flow.rate
                                         for nd in moving if nd.store_flow.rate > 0])
            else:
                h = min(self.p["dt"], nxt_arrival)
            if not moving:
                if nxt_arrival == math.inf:
                    raise RuntimeError(f"{self.strategy}: no node can make progress at t={self.t:.3f} s")
                h = nxt_arrival
            for nd in moving:
                if nd.store_flow:
                    nd.store_flow = self.advance(nd, nd.store_flow, h)
                nd.lanes = [g for g in (self.advance(nd, f, h) for f in nd.lanes) if g is not None]
            self.t += h
            steps += 1
            if steps > 10_000_000:
                raise RuntimeError(f"{self.strategy}: no end after {steps} steps (t={self.t:.3f} s)")
        return self.result(steps)

    def s3_left(self, nd):
        """Bytes a node still needs when all of them come from its one store stream."""
        left = nd.store_flow.left
        q = nd.store_q
        if q and q[0] == self.m - 1 and self.size % self.range_bytes:
            left += self.rsize(self.m - 1) + (len(q) - 1) * self.range_bytes
        else:
            left += len(q) * self.range_bytes
        return left

    # ---- results ------------------------------------------------------------------------------

    def single_node_seconds(self):
        """One node alone, from its fastest source: the store's rate or a peer's, for this node."""
        store = min(self.ingress, self.store_flow_cap, self.store_cap)
        peer = min(self.ingress, self.egress, self.p["peer_lanes"] * self.peer_cap)
        return self.size / max(store, peer), {"store": store, "peer": peer}

    def result(self, steps):
        loads = sorted(nd.done - nd.arrival for nd in self.loaders)
        first = min(nd.arrival for nd in self.loaders)
        t1, rates = self.single_node_seconds()
        peers = [nd.served for nd in self.nodes]
        mean_served = sum(peers) / len(peers)
        worst = loads[-1]
        egress = self.store_bytes / self.size
        return {
            "strategy": self.strategy,
            "nodes": len(self.loaders),
            "seeds": int(self.p["seeds"]),
            "ranges": self.m,
            "all_resident_s": max(nd.done for nd in self.loaders) - first,
            "last_arrival_s": max(nd.arrival for nd in self.loaders) - first,
            "load_p50_s": percentile(loads, 50),
            "load_p99_s": percentile(loads, 99),
            "load_max_s": worst,
            "single_node_s": t1,
            "single_node_source_gbps": {k: v * 8 / GB for k, v in rates.items()},
            "time_ratio": worst / t1,
            "egress_copies": egress,
            "peak_served_gb": max(peers) / GB,
            "peak_served_over_mean": (max(peers) / mean_served) if mean_served else 0.0,
            "delivered": [nd.from_store + nd.from_peers for nd in self.loaders],
            "from_store": [nd.from_store for nd in self.loaders],
            "served": peers,
            "ckpt_bytes": self.size,
            "egress_ok": egress <= 2.0,
            "time_ok": worst <= 1.5 * t1,
            "steps": steps,
        }


def simulate(params=None, strategy="peers", **overrides):
    """Runs one strategy; params and overrides are DEFAULTS' keys. Returns the result dict."""
    p = dict(DEFAULTS)
    p.update(params or {})
    p.update(overrides)
    return Fleet(p, strategy).run()


# ---- the sweep: where each target fails -------------------------------------------------------

# Each swept parameter with the values tried (from the defaults' side outwards). Everything else
# stays at the command line's values.
SWEEPS = [
    ("store_gbps", [800, 200, 100, 50, 25]),
    ("nic_gbps", [400, 200, 100, 50]),
    ("wave_gap", [0, 10, 40, 80]),
    ("waves", [1, 4, 16]),
    ("store_conns", [64, 16, 4]),
    ("seeds", [0, 1, 4]),
    ("serve_slots", [4, 16, 0]),
]


def sweep(params, strategy="peers"):
    """Runs strategy over each swept parameter's values; returns rows and each parameter's first failures."""
    rows, bounds = [], []
    for key, values in SWEEPS:
        first_fail = {"time": None, "egress": None}
        for v in values:
            r = simulate(params, strategy, **{key: v})
            rows.append({"param": key, "value": v, "time_ratio": r["time_ratio"], "egress_copies": r["egress_copies"],
                         "all_resident_s": r["all_resident_s"], "load_max_s": r["load_max_s"],
                         "time_ok": r["time_ok"], "egress_ok": r["egress_ok"]})
            for t, ok in (("time", r["time_ok"]), ("egress", r["egress_ok"])):
                if not ok and first_fail[t] is None:
                    first_fail[t] = v
        bounds.append({"param": key, "time_fails_at": first_fail["time"], "egress_fails_at": first_fail["egress"]})
    return rows, bounds


# ---- the command line -------------------------------------------------------------------------

def fmt(v):
    return "-" if v is None else (f"{v:g}" if isinstance(v, (int, float)) else str(v))


def print_results(results):
    print("| strategy | all resident | load p50 | load p99 | load max | vs one node | store egress | peak served by one peer | targets |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        ok = ("time met" if r["time_ok"] else "time missed") + ", " + ("egress met" if r["egress_ok"] else "egress missed")
        print(f"| {r['strategy']} | {r['all_resident_s']:.1f} s | {r['load_p50_s']:.1f} s | {r['load_p99_s']:.1f} s"
              f" | {r['load_max_s']:.1f} s | {r['time_ratio']:.2f}x | {r['egress_copies']:.2f} copies"
              f" | {r['peak_served_gb']:.0f} GB ({r['peak_served_over_mean']:.2f}x mean) | {ok} |")
    r = results[0]
    src = r["single_node_source_gbps"]
    print(f"\none node alone, fastest source: {r['single_node_s']:.1f} s (store {src['store']:.1f} Gbit/s,"
          f" peer {src['peer']:.1f} Gbit/s); {r['ranges']} ranges; last node up at {r['last_arrival_s']:.1f} s")


def print_sweep(rows, bounds):
    print("| parameter | value | load max / one node | store egress | all resident | targets |")
    print("|---|---|---|---|---|---|")
    for w in rows:
        ok = ("time met" if w["time_ok"] else "time missed") + ", " + ("egress met" if w["egress_ok"] else "egress missed")
        print(f"| {w['param'].replace('_', '-')} | {fmt(w['value'])} | {w['time_ratio']:.2f}x | {w['egress_copies']:.2f} copies"
              f" | {w['all_resident_s']:.1f} s | {ok} |")
    print("\n| parameter | time target fails at | egress target fails at |")
    print("|---|---|---|")
    for b in bounds:
        print(f"| {b['param'].replace('_', '-')} | {fmt(b['time_fails_at'])} | {fmt(b['egress_fails_at'])} |")


def parse_args(argv):
    ap = argparse.ArgumentParser(description="Fleet scale-out model: all-from-S3 against peers with rendezvous spreading.")
    for key, val, what in INPUTS:
        ap.add_argument("--" + key.replace("_", "-"), type=type(val), default=val, metavar="N",
                        help=f"{what.replace('%', '%%')} (default {val})")
    ap.add_argument("--strategy", default="all", choices=STRATEGIES + ("all",))
    ap.add_argument("--sweep", action="store_true", help="find where each target fails (strategy peers)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def main(argv):
    a = parse_args(argv)
    params = {k: getattr(a, k) for k in DEFAULTS}
    try:
        if a.sweep:
            rows, bounds = sweep(params, "peers" if a.strategy == "all" else a.strategy)
            if a.json:
                print(json.dumps({"params": params, "rows": rows, "bounds": bounds}, indent=1))
            else:
                print_sweep(rows, bounds)
            return 0
        names = STRATEGIES if a.strategy == "all" else (a.strategy,)
        results = [simulate(params, s) for s in names]
    except (ValueError, RuntimeError) as e:
        print(f"sim.py: {e}", file=sys.stderr)
        return 2
    if a.json:
        for r in results:
            del r["delivered"], r["from_store"], r["served"]
        print(json.dumps({"params": params, "results": results}, indent=1))
    else:
        print_results(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
