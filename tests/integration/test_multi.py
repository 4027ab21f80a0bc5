"""Several devices on one daemon (docs/multi-gpu.md), on the host backend presenting several
(host_devices): topology in status and hello, whole groups (load_group: every rank's set, each
verified against the files by `weightctl attach --verify`, progress per rank, failures per rank,
cancel, a client that goes away), replicas copied from a peer's copy (and from host memory when
peers are off or absent), striped loads (which device moved which range), and weightctl load
--all-ranks."""
import json
import os
import subprocess
import threading

import pytest

from conftest import SLOW, WEIGHTCTL
from wdclient import Checkpoint, WDError, verify_attached, wait_until


def devices_settings(n, **more):
    s = {"host_devices": n, "metrics_address": ""}
    s.update(more)
    return s


def ctl(d, *args, check=True):
    r = subprocess.run([WEIGHTCTL, "--socket", d.socket, *args], capture_output=True, text=True, timeout=300 * SLOW)
    if check:
        assert r.returncode == 0, f"weightctl {' '.join(args)}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def verify_set(d, set_id):
    """weightctl attach SET --verify: every byte of the set against its plan rebuilt from the files."""
    r = ctl(d, "--json", "attach", set_id, "--verify")
    out = json.loads(r.stdout)
    assert out["set"] == set_id and out["verified"]["tensors"] > 0, out
    return out


def uuids(c):
    return [x["uuid"] for x in c.hello_reply["devices"]]


# ---- topology ------------------------------------------------------------------------------


def test_topology_in_status_and_hello(start_daemon):
    d = start_daemon(settings=devices_settings(3, host_peers="0-1"))
    with d.connect() as c:
        devs = c.hello_reply["devices"]
        assert [x["index"] for x in devs] == [0, 1, 2]
        assert set(c.hello_reply["features"]) >= {"tensor_table", "early_attach", "load_group", "topology"}
        u = uuids(c)
        assert u[1] == u[0] + "-1" and u[2] == u[0] + "-2"
        st = c.status()
        for i, dev in enumerate(st["devices"]):
            assert dev["numa_node"] == -1 and dev["link_rate"] == 1 and dev["link_rate_measured"] is False
            peers = {p["index"]: p for p in dev["peers"]}
            assert sorted(peers) == [j for j in range(3) if j != i]
            for j, p in peers.items():
                want = {i, j} == {0, 1}
                assert p["access"] is want and p["link"] == ("host" if want else "none"), (i, p)
                assert p["uuid"] == u[j]
        topo = st["topology"]
        assert topo["active"] is True and topo["replicas"] == "auto" and topo["striping"] == "off"
        assert topo["link_rates_measured"] is False
        assert topo["busy"] == [0, 0, 0] and topo["stripe_min_bytes"] == 512 << 20
        assert isinstance(topo["numa_nodes"], list)


def test_one_device_status_unchanged(daemon):
    """One device: no peers listed, and the multi-device paths inactive (nothing to do)."""
    with daemon.connect() as c:
        st = c.status()
        (dev,) = st["devices"]
        assert dev["peers"] == [] and dev["index"] == 0 and "-" not in dev["uuid"][len("host-"):]
        assert st["topology"]["active"] is False and st["topology"]["busy"] == [0]


def test_bad_multi_settings_refused(workdir, binaries):
    sock = os.path.join(workdir, "refused.sock")
    for settings, text in (({"host_devices": 2, "host_peers": "0-2"}, "host_peers"),
                           ({"host_devices": 2, "link_rates": "51.6"}, "1 rate(s) given for 2 device(s)"),
                           ({"striping": "on"}, "'on' is not one of auto, off")):
        argv = [binaries["weightd"], "--foreground", "--socket", sock, "--backend", "host"]
        for k, v in dict(settings, metrics_address="").items():
            argv += ["--set", f"{k}={v}"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30 * SLOW)
        assert r.returncode != 0 and text in r.stderr + r.stdout, (settings, r.returncode, r.stderr)


# ---- groups --------------------------------------------------------------------------------


def test_load_group_every_rank(start_daemon, ckpt_small):
    d = start_daemon(settings=devices_settings(2))
    with d.connect() as c:
        u = uuids(c)
        rid = c.start("load_group", path=ckpt_small, plan={"fuse": True}, group={"tp_size": 2})
        rep, fds = c.wait(rid)
        assert not fds and rep.get("ok") is True, rep
        assert rep["group"] == {"tp_size": 2, "ep_size": 1, "ranks": 2}
        ranks = rep["ranks"]
        assert [(r["rank"], r["tp_rank"], r["ep_rank"], r["device"]) for r in ranks] == [(0, 0, 0, u[0]), (1, 1, 0, u[1])]
        assert rep["bytes"] == sum(r["bytes"] for r in ranks) and rep["seconds"] > 0
        for r in ranks:
            assert r["source"] == "host" and r["method"] == "memcpy" and r["shared"] is False
        # Progress: summed over the ranks, each listed; never past the total.
        ev = c.events[rid]
        assert ev and all(len(e["ranks"]) == 2 for e in ev)
        assert all(e["bytes_done"] == sum(x["bytes_done"] for x in e["ranks"]) for e in ev)
        assert all(e["bytes_done"] <= e["bytes_total"] <= rep["bytes"] for e in ev)
        sets = {s["set"]: s for s in c.status()["sets"]}
        for r in ranks:
            plan = sets[r["set"]]["plan"]
            assert plan["tp_size"] == 2 and plan["tp_rank"] == r["tp_rank"] and plan["fuse"] is True
            assert sets[r["set"]]["device"] == r["device"] and sets[r["set"]]["source"] == "host"
            verify_set(d, r["set"])
        # The same group again: every rank already resident, shared.
        again = c.call("load_group", path=ckpt_small, plan={"preset": "auto", "fuse": True}, group={"tp_size": 2})
        assert [r["set"] for r in again["ranks"]] == [r["set"] for r in ranks]
        assert all(r["shared"] for r in again["ranks"])


def test_load_group_ranks_on_one_device(start_daemon, ckpt_small):
    """Two ranks onto one device (the one-GPU case): two sets there, each with its own bytes."""
    d = start_daemon(settings=devices_settings(2))
    with d.connect() as c:
        rep = c.call("load_group", path=ckpt_small, group={"tp_size": 2, "devices": ["1", 1]})
        assert [r["device"] for r in rep["ranks"]] == [uuids(c)[1]] * 2
        assert rep["ranks"][0]["set"] != rep["ranks"][1]["set"]
        for r in rep["ranks"]:
            verify_set(d, r["set"])


def test_load_group_world_of_tp_and_ep(start_daemon, tiny):
    """tp_size 1 and ep_size 1 is one rank; with a whole plan the group is a plain load."""
    d = start_daemon(settings=devices_settings(3))
    with d.connect() as c:
        rep = c.call("load_group", path=tiny["a"], plan={"preset": "whole"}, group={"devices": [2]})
        (r,) = rep["ranks"]
        assert r["device"] == uuids(c)[2] and r["tp_rank"] == 0 and r["ep_rank"] == 0


def test_load_group_bad_requests(start_daemon, ckpt_small):
    d = start_daemon(settings=devices_settings(2))
    with d.connect() as c:
        cases = [
            ({}, "BAD_REQUEST", "group"),
            ({"group": {"tp_size": 0}}, "BAD_REQUEST", "at least 1"),
            ({"group": {"tp_size": 2, "ep_size": 3}}, "BAD_REQUEST", "multiple of the smaller"),
            ({"group": {"tp_size": 2, "devices": [0]}}, "BAD_REQUEST", "lists 1 device(s) for 2 rank(s)"),
            ({"group": {"tp_size": 2, "devices": "0,1"}}, "BAD_REQUEST", "must be a list"),
            ({"group": {"tp_size": 2, "devices": [0, 5]}}, "NOT_FOUND", "group.devices[1]"),
            ({"group": {"tp_size": 2}, "plan": {"tp_rank": 1}}, "BAD_REQUEST", "plan.tp_rank"),
            ({"group": {"tp_size": 2}, "plan": {"outputs": []}}, "BAD_REQUEST", "plan.outputs"),
            ({"group": {"tp_size": 2}, "plan": {"preset": "whole"}}, "BAD_PLAN", "rank 0"),
            ({"group": {"tp_size": 3}}, "BAD_PLAN", "tp_size 3"),
        ]
        for fields, code, text in cases:
            m, fds = c.request("load_group", path=ckpt_small, **fields)
            assert m.get("error", {}).get("code") == code, (fields, m)
            assert text in m["error"]["message"], (fields, m)
        assert c.status()["sets"] == []  # a group that does not plan loads nothing
        d.check_serving()


def test_load_group_one_rank_fails(start_daemon, ckpt_small):
    """A rank that does not fit fails alone: the reply is its error, with every rank's result."""
    d = start_daemon(settings=devices_settings(2, device_memory_budget="300MiB"))
    with d.connect() as c:
        u = uuids(c)
        # A leased set of about 160 MiB on device 1 leaves too little there for a second rank.
        att, fd = c.attach(path=ckpt_small, device=1, plan={"preset": "auto", "tp_size": 2, "tp_rank": 0})
        os.close(fd)
        m, _ = c.request("load_group", path=ckpt_small, plan={"fuse": True}, group={"tp_size": 2})
        assert m["error"]["code"] == "DEVICE_NOMEM", m
        assert m["error"]["message"].startswith("rank 1 (tp_rank 1 of 2, ep_rank 0 of 1) on device 1: "), m
        ok, bad = m["ranks"]
        assert ok["device"] == u[0] and ok["set"] and "error" not in ok
        assert bad["device"] == u[1] and bad["error"]["code"] == "DEVICE_NOMEM" and "set" not in bad
        verify_set(d, ok["set"])  # the rank that loaded stays resident
        c.call("release", lease=att["lease"])


def test_load_group_cancel_and_client_gone(start_daemon, ckpt_small):
    d = start_daemon(settings=devices_settings(2))
    with d.connect() as c:
        rid = c.start("load_group", path=ckpt_small, group={"tp_size": 2})
        cancel = c.call("cancel", target=rid)
        rep, _ = c.wait(rid)
        if cancel["canceled"]:
            assert rep["error"]["code"] == "CANCELED", rep
        else:  # it had finished already
            assert rep.get("ok") is True, rep
    # A client that goes away while its group loads: the daemon finishes the loads and keeps serving.
    c = d.connect()
    c.start("load_group", path=ckpt_small, plan={"fuse": True}, group={"tp_size": 2})
    c.close()
    with d.connect() as c2:
        wait_until(lambda: all(s["state"] == "ready" for s in c2.status()["sets"])
                   and c2.status()["topology"]["busy"] == [0, 0], timeout=30 * SLOW, what="the loads to end")
    d.check_serving()


def test_weightctl_load_all_ranks(start_daemon, ckpt_small):
    d = start_daemon(settings=devices_settings(2))
    r = ctl(d, "load", ckpt_small, "--all-ranks", "--tp-size", "2", "--fuse")
    assert "group of 2 ranks (tp_size 2, ep_size 1)" in r.stdout, r.stdout
    assert r.stdout.count("(memcpy, from host)") == 2, r.stdout
    r = ctl(d, "--json", "load", ckpt_small, "--all-ranks", "--tp-size", "2", "--devices", "1,0")
    rep = json.loads(r.stdout)
    with d.connect() as c:
        assert [x["device"] for x in rep["ranks"]] == [uuids(c)[1], uuids(c)[0]]
    for args, text in ((["--all-ranks", "--tp-size", "2", "--tp-rank", "1"], "not --tp-rank"),
                       (["--devices", "0,1"], "--devices lists one device per rank"),
                       (["--all-ranks", "--device", "0"], "not --device"),
                       (["--all-ranks", "--devices", "0,,1"], "--devices wants")):
        r = ctl(d, "load", ckpt_small, *args, check=False)
        assert r.returncode == 2 and text in r.stderr, (args, r.returncode, r.stderr)
    r = ctl(d, "load", ckpt_small, "--all-ranks", "--tp-size", "2", "--devices", "0,9", check=False)
    assert r.returncode == 1 and "group.devices[1]" in r.stderr, r.stderr


def test_weightctl_prewarm_all_ranks(start_daemon, ckpt_small):
    """prewarm --all-ranks: each rank on its device, byte for byte; a second run shares them, loads nothing."""
    d = start_daemon(settings=devices_settings(2))
    rep = json.loads(ctl(d, "--json", "prewarm", ckpt_small, "--all-ranks", "--tp-size", "2", "--devices", "1,0").stdout)
    with d.connect() as c:
        assert [x["device"] for x in rep["ranks"]] == [uuids(c)[1], uuids(c)[0]]
    assert [x["tp_rank"] for x in rep["ranks"]] == [0, 1], rep
    for x in rep["ranks"]:
        verify_set(d, x["set"])
    again = json.loads(ctl(d, "--json", "prewarm", ckpt_small, "--all-ranks", "--tp-size", "2", "--devices", "1,0").stdout)
    assert [x["set"] for x in again["ranks"]] == [x["set"] for x in rep["ranks"]], again
    assert all(x["shared"] for x in again["ranks"]), again
    for args, text in ((["--all-ranks", "--device", "0"], "not --device"),
                       (["--devices", "0,1"], "--devices lists one device per rank")):
        r = ctl(d, "prewarm", ckpt_small, *args, check=False)
        assert r.returncode == 2 and text in r.stderr, (args, r.returncode, r.stderr)


# ---- replicas ------------------------------------------------------------------------------


def load_whole(c, path, device):
    return c.call("load", path=path, device=device, plan={"preset": "whole"})


def test_replica_copied_from_peer(start_daemon, ckpt_small):
    ck = Checkpoint(ckpt_small)
    d = start_daemon(settings=devices_settings(3))
    with d.connect() as c:
        u = uuids(c)
        first = load_whole(c, ckpt_small, 0)
        assert first["method"] == "memcpy" and first["source"] == "host"
        second = load_whole(c, ckpt_small, 2)
        assert second["set"] != first["set"] and second["device"] == u[2]
        assert second["method"] == "peer" and second["source"] == "peer:" + u[0], second
        att, fd = c.attach(set=second["set"])
        try:
            assert verify_attached(att, fd, ck) == ck.payload_bytes()
        finally:
            os.close(fd)
        st = c.status()
        sets = {s["set"]: s for s in st["sets"]}
        assert sets[second["set"]]["source"] == "peer:" + u[0] and sets[second["set"]]["method"] == "peer"
        loads = {(x["labels"]["result"], x["labels"]["method"]): x["value"]
                 for x in st["metrics"]["weightd_loads_total"]["samples"]}
        assert loads[("ok", "peer")] == 1 and loads[("ok", "memcpy")] == 1, loads
        assert sets[first["set"]]["source"] == "host"
        # The copy holds nothing: the first set may go now.
        assert c.call("evict", set=first["set"])["evicted"] == [first["set"]]
    ck.close()


@pytest.mark.parametrize("settings", [{"host_peers": "none"}, {"replicas": "off"}])
def test_replica_from_host_without_peers(start_daemon, tiny, settings):
    d = start_daemon(settings=devices_settings(2, **settings))
    with d.connect() as c:
        load_whole(c, tiny["a"], 0)
        rep = load_whole(c, tiny["a"], 1)
        assert rep["method"] == "memcpy" and rep["source"] == "host", rep


# ---- striping --------------------------------------------------------------------------------


def test_striped_load_ranges(start_daemon, ckpt_small):
    ck = Checkpoint(ckpt_small)
    d = start_daemon(settings=devices_settings(3, striping="auto", stripe_min_bytes=0, staging_slot_bytes="4MiB"))
    with d.connect() as c:
        u = uuids(c)
        assert c.status()["topology"]["striping"] == "auto"
        rep = load_whole(c, ckpt_small, 2)
        assert rep["method"] == "striped" and rep["source"] == "host", rep
        links = rep["links"]
        assert [x["device"] for x in links] == [u[2], u[0], u[1]]  # the target's own link first
        at = 0
        for x in links:
            assert x["offset"] == at and x["bytes"] > 0
            at += x["bytes"]
        assert at == rep["bytes"]
        for x in links[:-1]:
            assert (x["offset"] + x["bytes"]) % (4 << 20) == 0  # cut at whole windows
        assert all(abs(x["bytes"] - rep["bytes"] / 3) <= 4 << 20 for x in links)  # equal, unmeasured rates
        att, fd = c.attach(set=rep["set"])
        try:
            assert verify_attached(att, fd, ck) == ck.payload_bytes()
        finally:
            os.close(fd)
        (s,) = c.status()["sets"]
        assert s["method"] == "striped" and s["links"] == links
    r = ctl(d, "status")
    assert "striped from host, over the host links of 3 devices" in r.stdout, r.stdout
    ck.close()


def test_concurrent_loads_to_two_devices(start_daemon, ckpt_small, ckpt_sharded):
    """Two clients load onto two devices at once: both finish with every byte."""
    d = start_daemon(settings=devices_settings(2))
    results = {}

    def run(i, path):
        with d.connect() as c:
            results[i] = load_whole(c, path, i)

    ts = [threading.Thread(target=run, args=(0, ckpt_small)), threading.Thread(target=run, args=(1, ckpt_sharded))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    with d.connect() as c:
        u = uuids(c)
        for i, path in ((0, ckpt_small), (1, ckpt_sharded)):
            assert results[i]["device"] == u[i] and results[i]["source"] == "host"
            ck = Checkpoint(path)
            att, fd = c.attach(set=results[i]["set"])
            try:
                assert verify_attached(att, fd, ck) == ck.payload_bytes()
            finally:
                os.close(fd)
                ck.close()
            c.call("release", lease=att["lease"])
        with pytest.raises(WDError):
            c.call("load_group", path=ckpt_small, group={"tp_size": 2, "devices": [0, 7]})
