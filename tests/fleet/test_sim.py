"""tests/fleet/sim.py, the fleet scale-out model, against what its rules imply: every node gets exactly the
checkpoint's bytes, all-from-S3 sends N copies, the owners' rule sends one, rendezvous picks are stable and
spread, one node alone loads in exactly size / its narrowest bandwidth, bad parameters are refused by name;
and docs/fleet-model.md quotes what the simulator prints for the commands it names (the whole results
table, and the sweep's rows on either side of every failure point it states).
"""
import io
import os
import re
import shlex
import sys
from contextlib import redirect_stdout

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import sim  # noqa: E402

MiB = 1 << 20
SMALL = dict(nodes=16, ckpt_gb=32.0, range_mib=256.0, waves=2, wave_gap=2.0, dt=0.02)


@pytest.mark.parametrize("strategy", sim.STRATEGIES)
@pytest.mark.parametrize("waves,seeds", [(1, 0), (4, 0), (2, 2)])
def test_every_node_gets_exactly_the_checkpoint(strategy, waves, seeds):
    r = sim.simulate(SMALL, strategy, waves=waves, seeds=seeds)
    size = r["ckpt_bytes"]
    assert size == 32_000_000_000
    assert r["delivered"] == [size] * 16
    assert sum(r["from_store"]) == round(r["egress_copies"] * size)
    assert r["load_max_s"] >= r["load_p99_s"] >= r["load_p50_s"] > 0
    if seeds:
        assert r["egress_copies"] == 0 or strategy == "s3"


def test_all_from_s3_sends_n_copies():
    r = sim.simulate(SMALL, "s3")
    assert r["egress_copies"] == 16.0
    assert r["peak_served_gb"] == 0
    assert not r["egress_ok"]


def test_owners_send_one_copy_and_without_owners_more():
    # All nodes at once: nobody holds anything, so without owners every node starts on the store.
    owners = sim.simulate(SMALL, "peers", waves=1)
    naive = sim.simulate(SMALL, "peers-naive", waves=1)
    assert owners["egress_copies"] == 1.0
    assert naive["egress_copies"] > 1.2
    assert owners["egress_ok"]


def test_hrw_is_stable_and_spread():
    m, n = 20000, 64
    top = [max(range(n), key=lambda i, r=r: sim.hrw_score(7, r, i)) for r in range(m)]
    again = [max(range(n), key=lambda i, r=r: sim.hrw_score(7, r, i)) for r in range(m)]
    assert top == again
    counts = [top.count(i) for i in range(n)]
    mean = m / n
    assert max(counts) <= 1.3 * mean and min(counts) >= 0.7 * mean, counts
    # A node joining takes ranges only for itself: every other range keeps its holder.
    grown = [max(range(n + 1), key=lambda i, r=r: sim.hrw_score(7, r, i)) for r in range(m)]
    moved = [r for r in range(m) if grown[r] != top[r]]
    assert all(grown[r] == n for r in moved)
    assert 0.7 * m / (n + 1) <= len(moved) <= 1.3 * m / (n + 1)
    # Another content id ranks differently.
    assert [max(range(n), key=lambda i, r=r: sim.hrw_score(8, r, i)) for r in range(200)] != top[:200]


def test_serving_is_spread_over_uniform_holders():
    # Eight seeds hold everything and eight nodes load at once: what the seeds serve is spread evenly
    # among them (the loaders serve each other too, later, as they come to hold ranges).
    r = sim.simulate(dict(SMALL, nodes=8, waves=1, seeds=8, serve_slots=0), "peers")
    assert r["egress_copies"] == 0.0
    seeds = r["served"][8:]
    mean = sum(seeds) / 8
    assert mean > 0.5 * r["ckpt_bytes"]
    assert max(seeds) <= 1.3 * mean and min(seeds) >= 0.7 * mean, seeds


@pytest.mark.parametrize("over", [
    dict(),                              # the store's 64 connections are the narrowest: 6.1 GB/s
    dict(store_conns=1024),              # then the NIC: 200 Gbit/s
    dict(store_conns=1024, store_gbps=80.0),   # then the store's aggregate
    dict(store_conns=1024, store_rps=100.0),   # then its request rate: 100 x 16 MiB per second
    dict(store_conns=1024, nic_gbps=4000.0, pcie_gibps=1.0),  # then the GPUs' links: 8 x 1 GiB/s
])
def test_one_node_from_the_store_takes_size_over_its_narrowest_bandwidth(over):
    p = dict(nodes=1, waves=1, ckpt_gb=10.0, **over)
    q = dict(sim.DEFAULTS, **p)
    rate = min(q["store_conns"] * q["store_conn_mbps"] * 1e6, q["nic_gbps"] * 1e9 / 8, q["store_gbps"] * 1e9 / 8,
               q["store_rps"] * q["request_mib"] * MiB, q["gpus"] * q["pcie_gibps"] * (1 << 30))
    for strategy in sim.STRATEGIES:
        r = sim.simulate(p, strategy)
        assert r["load_max_s"] == pytest.approx(10e9 / rate, rel=1e-9)
        assert r["egress_copies"] == 1.0


def test_one_node_from_one_seed_takes_size_over_the_narrower_nic():
    # 16 ranges of 500 MB over 4 lanes: every lane carries 4 ranges at a quarter of the rate.
    p = dict(nodes=1, waves=1, seeds=1, ckpt_gb=8.0, range_mib=500e6 / MiB, nic_gbps=100.0)
    r = sim.simulate(p, "peers")
    assert r["ranges"] == 16
    assert r["load_max_s"] == pytest.approx(8e9 / (100e9 / 8), rel=1e-9)
    assert r["egress_copies"] == 0.0
    assert r["single_node_s"] == pytest.approx(r["load_max_s"], rel=1e-9)


@pytest.mark.parametrize("args,named", [
    (["--nodes", "0"], "nodes"), (["--range-mib", "-1"], "range-mib"), (["--wave-gap", "-3"], "wave-gap"),
])
def test_bad_parameters_are_refused_by_name(args, named, capsys):
    assert sim.main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "sim.py:" in err


# ---- the doc quotes the simulator -----------------------------------------------------------------

DOC = os.path.join(ROOT, "docs", "fleet-model.md")
BLOCK = re.compile(r"<!-- sim: (?P<cmd>[^\n]*?) -->\n(?P<body>.*?)<!-- /sim -->", re.S)


def doc_blocks():
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    blocks = [(m["cmd"], m["body"]) for m in BLOCK.finditer(text)]
    assert len(blocks) == 2, "docs/fleet-model.md should quote the results and the sweep"
    return blocks


def argv_of(cmd):
    words = shlex.split(cmd)
    assert words[:2] == ["python3", "tests/fleet/sim.py"], cmd
    return words[2:]


def printed(argv):
    out = io.StringIO()
    with redirect_stdout(out):
        assert sim.main(argv) == 0
    return out.getvalue()


def test_doc_quotes_the_results_table():
    cmd, body = doc_blocks()[0]
    assert "--sweep" not in cmd
    assert body.strip() == printed(argv_of(cmd)).strip()


def test_doc_quotes_the_sweeps_failure_points():
    cmd, body = doc_blocks()[1]
    argv = argv_of(cmd)
    assert "--sweep" in argv
    a = sim.parse_args(argv)
    params = {k: getattr(a, k) for k in sim.DEFAULTS}
    lines = body.strip().splitlines()
    rows = {}
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("parameter", "---"):
            rows[(cells[0], cells[1])] = ln.strip()
    bounds = {}
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        if len(cells) == 3 and cells[0] not in ("parameter", "---"):
            bounds[cells[0]] = cells[1:]
    assert [k for k, _ in sim.SWEEPS] == [b.replace("-", "_") for b in bounds]
    assert len(rows) == sum(len(v) for _, v in sim.SWEEPS)
    checked = 0
    for key, values in sim.SWEEPS:
        name = key.replace("_", "-")
        for target, fails_at in zip(("time", "egress"), bounds[name]):
            if fails_at == "-":
                continue
            i = [sim.fmt(v) for v in values].index(fails_at)
            # The first failing value and the one before it, rerun: each row as the doc prints it.
            for v in values[max(0, i - 1):i + 1]:
                r = sim.simulate(params, "peers", **{key: v})
                ok = ("time met" if r["time_ok"] else "time missed") + ", " + (
                    "egress met" if r["egress_ok"] else "egress missed")
                line = (f"| {name} | {sim.fmt(v)} | {r['time_ratio']:.2f}x | {r['egress_copies']:.2f} copies"
                        f" | {r['all_resident_s']:.1f} s | {ok} |")
                assert rows[(name, sim.fmt(v))] == line
                assert (r[target + "_ok"]) == (v != values[i])
                checked += 1
    assert checked >= 2
