"""Open checkpoints are bounded (docs/reliability.md, "Open checkpoints"), status and /metrics stay bounded.

Each open checkpoint keeps its parsed headers and a mapping per shard; a
client can make any number of distinct checkpoints out of directories of
symlinks to one real file. These tests make such directories cheaply and
drive a real daemon to its bounds: a uid at its share is answered LIMIT
while another uid opens and loads, idle checkpoints are closed first (least
recently used), a resident set's never; status pages through everything
exactly once and /metrics keeps a bounded number of series. Each docstring
says how the daemon without the bounds failed it ("Before:").
"""
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

import pytest

import wdclient
from conftest import TINY_TENSORS, WEIGHTCTL, native_env, write_single
from wdclient import wait_until


def link_dirs(base, target_file, n, prefix="c"):
    """n distinct checkpoint directories under base, each a model.safetensors symlink to target_file."""
    out = []
    for i in range(n):
        d = os.path.join(base, f"{prefix}{i:04d}")
        os.makedirs(d, exist_ok=True)
        link = os.path.join(d, "model.safetensors")
        if not os.path.lexists(link):
            os.symlink(target_file, link)
        out.append(d)
    return out


@pytest.fixture
def linked(model_root, tiny):
    """A fresh directory under the root for checkpoints made of symlinks to tiny["a"]'s shard."""
    d = tempfile.mkdtemp(prefix="linked-", dir=model_root)
    yield d, os.path.join(tiny["a"], "model.safetensors")
    shutil.rmtree(d, ignore_errors=True)


def open_paths(st):
    return sorted(c["path"] for c in st["checkpoints"])


def all_pages(c, **first):
    """Every item of every status list, paging with the replies' "next" cursors; also the first reply."""
    rep = c.call("status", **first)
    got = {k: list(rep[k]) for k in ("checkpoints", "sets", "leases", "requests")}
    page = rep
    pages = 1
    while page.get("next"):
        page = c.call("status", after=page["next"], **{k: v for k, v in first.items() if k != "after"})
        pages += 1
        assert set(page) & set(got) <= set(rep["next"]), "a list that was complete came back"
        for k in got:
            got[k] += page.get(k, [])
    return rep, got, pages


def test_per_uid_share_refuses_with_limit_and_symlinked_dirs_are_one(start_daemon, linked, tiny):
    """A uid past max_open_checkpoints_per_uid whose checkpoints are all busy is answered LIMIT, naming it.

    Checkpoints reached through symlinked directories that resolve to one
    that is open are that checkpoint, and cost nothing more. Before: every
    open succeeded, however many (8,000 opens of a 2,000-tensor header took
    2.35 GB), and symlinked directories were already one entry.
    """
    base, shard = linked
    d = start_daemon({"max_open_checkpoints_per_uid": 3, "checkpoint_idle_ms": 0})
    dirs = link_dirs(base, shard, 4)
    with d.connect() as c:
        sets = [c.call("load", path=p)["set"] for p in dirs[:3]]  # three busy checkpoints: resident sets
        err = c.request("open", path=dirs[3])[0]["error"]
        assert err["code"] == "LIMIT", err
        assert "max_open_checkpoints_per_uid" in err["message"] and dirs[3] in err["message"], err
        # Symlinks to a directory that is open already: the same checkpoint, no new charge.
        for i in range(5):
            alias = os.path.join(base, f"alias{i}")
            os.symlink(dirs[0], alias)
            assert c.call("open", path=alias)["checkpoint"]["path"] == os.path.realpath(dirs[0])
        st = c.status()
        assert open_paths(st) == sorted(os.path.realpath(p) for p in dirs[:3])
        assert st["daemon"]["checkpoints"]["refused"] == 1
        assert st["daemon"]["checkpoints"]["open"] == 3
        assert st["daemon"]["checkpoints"]["charged_bytes"] > 0
        # The resident sets' checkpoints were never closed: every set still attaches.
        for s in sets:
            att, fd = c.attach(set=s)
            os.close(fd)
            c.call("release", lease=att["lease"])
        # Once a set goes, its checkpoint is idle and makes room.
        c.call("evict", set=sets[0])
        assert c.call("open", path=dirs[3])["checkpoint"]["path"] == os.path.realpath(dirs[3])
        assert os.path.realpath(dirs[0]) not in open_paths(c.status())
    assert "to make room under max_open_checkpoints_per_uid" in d.log_text()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_another_uid_opens_and_loads_while_one_is_at_its_share(start_daemon, linked):
    """While root holds its whole share busy (LIMIT for its next open), nobody still opens and loads.

    Before: nothing bounded one uid, so the daemon ran out of memory or of
    vm.max_map_count for everyone (another client's load failed).
    """
    from test_peers import HELLO, as_nobody

    base, shard = linked
    shared = tempfile.mkdtemp(prefix="wdi-shared-")  # /tmp: a directory nobody may read
    try:
        os.chmod(shared, 0o755)
        write_single(os.path.join(shared, "mine"), TINY_TENSORS, 7)
        os.chmod(os.path.join(shared, "mine"), 0o755)
        os.chmod(os.path.join(shared, "mine", "model.safetensors"), 0o644)
        d = start_daemon({"max_open_checkpoints_per_uid": 2, "checkpoint_idle_ms": 0, "socket_mode": "0666"},
                         public=True, roots=[os.path.dirname(base), shared])
        dirs = link_dirs(base, shard, 3)
        with d.connect() as c:
            for p in dirs[:2]:
                c.call("load", path=p)
            assert c.error("open", path=dirs[2]) == "LIMIT"
            ours = os.path.join(shared, "mine")
            got = as_nobody(d.socket, [HELLO, {"op": "open", "id": 2, "path": ours},
                                       {"op": "load", "id": 3, "path": ours}])
            got = [m for m in got if "event" not in m]  # the load's progress events
            assert got[1].get("ok") is True, got
            assert got[2].get("ok") is True and got[2]["tensors"] == len(TINY_TENSORS), got
            assert c.error("open", path=dirs[2]) == "LIMIT"  # root's share is still full
            assert len(c.status()["checkpoints"]) == 3
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_idle_checkpoints_closed_least_recently_used_first(start_daemon, linked):
    """At max_open_checkpoints_per_uid the least recently used idle checkpoint is closed to make room.

    Before: none was closed, and the open count grew without bound.
    """
    base, shard = linked
    d = start_daemon({"max_open_checkpoints_per_uid": 3, "checkpoint_idle_ms": 0})
    a, b, cc, dd = link_dirs(base, shard, 4)
    with d.connect() as c:
        for p in (a, b, cc):
            c.call("open", path=p)
        c.call("open", path=a)  # a is used again: b is now the least recently used
        c.call("open", path=dd)
        assert open_paths(c.status()) == sorted(os.path.realpath(p) for p in (a, cc, dd))
        c.call("open", path=b)  # b again: now cc goes
        assert open_paths(c.status()) == sorted(os.path.realpath(p) for p in (a, dd, b))
        assert c.status()["daemon"]["checkpoints"]["closed_for_room"] == 2
    assert f"closed {os.path.realpath(b)}: idle" in d.log_text()


def test_total_bound_never_closes_a_resident_sets_checkpoint(start_daemon, linked):
    """At max_open_checkpoints, busy checkpoints (a resident set) are kept and the open is answered LIMIT.

    Before: the third checkpoint opened beside the other two.
    """
    base, shard = linked
    d = start_daemon({"max_open_checkpoints": 2, "checkpoint_idle_ms": 0})
    a, b, cc = link_dirs(base, shard, 3)
    with d.connect() as c:
        sa = c.call("load", path=a)["set"]
        sb = c.call("load", path=b)["set"]
        err = c.request("load", path=cc)[0]["error"]
        assert err["code"] == "LIMIT" and "max_open_checkpoints" in err["message"], err
        st = c.status()
        assert open_paths(st) == sorted(os.path.realpath(p) for p in (a, b))
        assert sorted(s["set"] for s in st["sets"]) == sorted([sa, sb])
        c.call("evict", set=sb)
        c.call("load", path=cc)  # b is idle now: closed for cc
        assert open_paths(c.status()) == sorted(os.path.realpath(p) for p in (a, cc))


def test_idle_timer_closes_unused_checkpoints_only(start_daemon, linked):
    """checkpoint_idle_ms closes a checkpoint nothing uses; one with a resident set stays.

    Before: the key did not exist (the daemon refused to start with it), and
    open checkpoints were kept until an explicit close.
    """
    base, shard = linked
    d = start_daemon({"checkpoint_idle_ms": 200})
    a, b = link_dirs(base, shard, 2)
    with d.connect() as c:
        c.call("open", path=a)
        s = c.call("load", path=b)["set"]
        wait_until(lambda: open_paths(c.status()) == [os.path.realpath(b)], timeout=30,
                   what="the unused checkpoint to be closed")
        assert c.status()["daemon"]["checkpoints"]["closed_idle"] == 1
        c.call("evict", set=s)
        wait_until(lambda: c.status()["checkpoints"] == [], timeout=30, what="the evicted set's checkpoint to close")
    assert "unused for" in d.log_text()


def test_memory_share_counts_parsed_headers(start_daemon, model_root, tiny):
    """A checkpoint whose parsed header passes checkpoint_memory_per_uid is refused with LIMIT and not kept.

    Before: headers were not charged at all; a small checkpoint still opens.
    """
    big = write_single(tempfile.mkdtemp(prefix="big-", dir=model_root),
                       [(f"layers.{i}.w", "F16", [2, 2]) for i in range(12000)], 3)
    try:
        d = start_daemon({"checkpoint_memory_per_uid": "1MiB"})
        with d.connect() as c:
            err = c.request("open", path=big)[0]["error"]
            assert err["code"] == "LIMIT" and "checkpoint_memory_per_uid" in err["message"], err
            c.call("open", path=tiny["a"])
            st = c.status()
            assert open_paths(st) == [os.path.realpath(tiny["a"])]
            assert 0 < st["daemon"]["checkpoints"]["charged_bytes"] < 1 << 20
    finally:
        shutil.rmtree(big, ignore_errors=True)


def test_status_pages_list_every_checkpoint_and_set_once(start_daemon, linked):
    """status pages by limit and cursor: every checkpoint and set exactly once, totals and left_out exact.

    Before: status listed everything in one reply, which at ~60,000 checkpoints
    passed the 16 MiB reply limit for everyone, and walked every checkpoint
    against every cached measurement.
    """
    base, shard = linked
    d = start_daemon()
    dirs = link_dirs(base, shard, 23)
    with d.connect() as c:
        for p in dirs:
            c.call("open", path=p)
        sets = {c.call("load", path=p)["set"] for p in dirs[:9]}
        first, got, pages = all_pages(c, limit=4)
        assert first["totals"]["checkpoints"] == 23 and first["totals"]["sets"] == 9
        assert len(first["checkpoints"]) == 4 and first["left_out"]["checkpoints"] == 19
        assert first["left_out"]["sets"] == 5 and "leases" not in first["left_out"]
        assert pages == 6
        paths = [x["path"] for x in got["checkpoints"]]
        assert sorted(paths) == sorted(os.path.realpath(p) for p in dirs) and len(set(paths)) == 23
        assert sorted(x["set"] for x in got["sets"]) == sorted(sets)
        # Newest first, as the default reply, which lists all of them here and leaves nothing out.
        whole = c.status()
        assert [x["path"] for x in whole["checkpoints"]] == paths
        assert "next" not in whole and whole["totals"]["checkpoints"] == 23
        assert [x["sets"] for x in whole["checkpoints"]].count(1) == 9
        for bad in ({"limit": 0}, {"limit": 1025}, {"after": {"sets": -1}}, {"after": 3}):
            assert c.error("status", **bad) == "BAD_REQUEST", bad


def test_weightctl_status_pages_past_its_default(start_daemon, linked):
    """weightctl status says how many a cut list holds; --all lists every one.

    Before: every checkpoint was in the one reply, with no totals.
    """
    base, shard = linked
    d = start_daemon()
    dirs = link_dirs(base, shard, 300)
    with d.connect() as c:
        for p in dirs:
            c.call("open", path=p)
    env = dict(native_env(), WEIGHTD_SOCKET=d.socket)
    r = subprocess.run([WEIGHTCTL, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "checkpoints (256 of 300; --all lists every one)" in r.stdout, r.stdout[:2000]
    r = subprocess.run([WEIGHTCTL, "--json", "status", "--all"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    paths = [x["path"] for x in st["checkpoints"]]
    assert len(paths) == len(set(paths)) == 300 and "next" not in st


def test_metrics_series_bounded(start_daemon, model_root):
    """/metrics gives the 32 largest checkpoints series of their own and sums the rest.

    Before: one series per open checkpoint, and each checkpoint looked up
    against every cached measurement (2.5 s per scrape at 58,000).
    """
    base = tempfile.mkdtemp(prefix="sizes-", dir=model_root)
    try:
        dirs = [write_single(os.path.join(base, f"k{i:02d}"), [("w", "U8", [1000 + 8 * i])], i) for i in range(40)]
        d = start_daemon(metrics=True)
        with d.connect() as c:
            for p in dirs:
                c.call("open", path=p)
            st = c.status()
        sizes = {x["path"]: os.path.getsize(os.path.join(x["path"], "model.safetensors")) for x in st["checkpoints"]}
        with urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=30) as f:
            text = f.read().decode()
        series = [line for line in text.splitlines() if line.startswith("weightd_checkpoint_bytes{")]
        assert len(series) == 32, series
        listed = {line.split('path="', 1)[1].split('"', 1)[0] for line in series}
        assert listed == set(sorted(sizes, key=sizes.get)[-32:])

        def value(name):
            return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])

        assert value("weightd_checkpoints_unlisted") == 8
        assert value("weightd_checkpoints_unlisted_bytes") == sum(sorted(sizes.values())[:8])
        assert value("weightd_checkpoints_open") == 40
        assert value("weightd_checkpoint_charged_bytes") == st["daemon"]["checkpoints"]["charged_bytes"]
        # The same bound in the status reply's metrics.
        assert len(st["metrics"]["weightd_checkpoint_bytes"]["samples"]) == 32
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_attach_by_path_reuses_the_plan_and_sees_changed_files(start_daemon, model_root):
    """A second attach by path finds the resident set through the plan memo; a rewritten file still reloads.

    Before: every attach by path built the plan again over every tensor
    (10-17 ms at 20,000 tensors against 3.4 ms by id), and status had no
    plans_reused.
    """
    tensors = [(f"layers.{i}.w", "F16", [4, 4 + i % 3]) for i in range(300)]
    ck = write_single(tempfile.mkdtemp(prefix="memo-", dir=model_root), tensors, 1)
    try:
        d = start_daemon()
        with d.connect() as c:
            def attach(**kw):
                att, fd = c.attach(path=ck, device=0, **kw)
                return att, fd

            def reused():
                return c.status()["daemon"]["checkpoints"]["plans_reused"]

            a1, fd1 = attach()
            assert reused() == 0
            a2, fd2 = attach()
            assert a2["set"] == a1["set"] and reused() == 1
            a3, fd3 = attach(plan={"preset": "whole"})  # written otherwise: built once, then remembered
            assert a3["set"] == a1["set"] and reused() == 1
            a4, fd4 = attach(plan={"preset": "whole"})
            assert a4["set"] == a1["set"] and reused() == 2
            for a, fd in ((a1, fd1), (a2, fd2), (a3, fd3), (a4, fd4)):
                os.close(fd)
                c.call("release", lease=a["lease"])
            # The file rewritten (other bytes, a new mtime): the next attach by path loads it again.
            shard = os.path.join(ck, "model.safetensors")
            st0 = os.stat(shard)
            wdclient.write_safetensors(shard, tensors, seed=2)
            os.utime(shard, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))
            a5, fd5 = attach()
            try:
                assert a5["set"] != a1["set"]
                tensor = next(t for t in a5["tensors"] if t["name"] == "layers.7.w")
                got = os.pread(fd5, tensor["nbytes"], tensor["offset"])
                sh = wdclient.Shard(shard)
                b, e = sh.tensor_range("layers.7.w")
                assert got == sh.map[b:e]
                sh.close()
            finally:
                os.close(fd5)
                c.call("release", lease=a5["lease"])
    finally:
        shutil.rmtree(ck, ignore_errors=True)
