"""Scrubbing resident sets (docs/reliability.md, "Scrubbing resident sets"), on the host backend.

A set's digests are recorded when it is loaded; a scrub hashes its tensors
again and names each one that differs. Corruption is injected as a client
with a writable handle would: the daemon runs with test_writable_slabs, so
the memfd an attach hands over can be mapped read-write (on a GPU, a legacy
cuda_ipc importer can always write). The oracles are tensor digests
(wdclient.tensor_digest: manifest.h's tree, from the python xxhash package)
over the slab's own bytes and over the checkpoint's files.
"""
import mmap
import os
import time
import urllib.request

import pytest

from cliutil import ctl
from wdclient import LEAF_BYTES, Checkpoint, Closed, WDError, tensor_digest

# scrub_reload off: a corrupt set stays listed, refusing leases (the reload has its own test).
WRITABLE = {"scrub": "on", "test_writable_slabs": "on", "scrub_duty": 0, "scrub_reload": "off"}


def table(att):
    return {t["name"]: t for t in att["tensors"]}


def load(c, path, **kw):
    return c.call("load", path=path, device=0, **kw)


def flip(fd, size, offset):
    """Flips one bit of the slab byte at offset through a read-write mapping of the attach's descriptor."""
    m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        m[offset] ^= 0x40
    finally:
        m.close()


def next_event(c):
    """The next unsolicited event on c: one a wait() put aside already, else the next frame."""
    for i, (m, fds) in enumerate(c.backlog):
        if "event" in m and "id" not in m:
            del c.backlog[i]
            return m
    return c.recv_msg()


FUSED = {"outputs": [
    {"name": "fused", "dtype": "BF16", "shape": [1513, 256],
     "pieces": [{"tensor": "embed.weight"}, {"tensor": "head.weight"}]},
    {"name": "half", "dtype": "BF16", "shape": [500, 256], "pieces": [{"tensor": "embed.weight", "end": 500}]},
    {"name": "odd", "dtype": "U8", "shape": [1001], "pieces": [{"tensor": "layers.0.odd"}]}]}


def dctl(d, *args):
    return ctl("--socket", d.socket, *args)


def test_digests_are_tensor_digests_of_the_slab_and_of_the_files(start_daemon, tiny):
    """The host hash op against tensor_digest of the slab bytes; whole tensors also equal the files' bytes.

    Tensors of one leaf and of several (embed.weight, head.weight: a tree, its last leaf short) are both there."""
    d = start_daemon(settings={"scrub": "on"})
    ckpt = Checkpoint(tiny["a"])
    with d.connect() as c:
        rep = load(c, tiny["a"])
        att, fd = c.attach(set=rep["set"])
        try:
            slab = os.pread(fd, att["bytes"], 0)
        finally:
            os.close(fd)
        got = c.call("scrub", set=rep["set"], digests=True)
        assert got["clean"] is True and got["mismatches"] == 0
        (s,) = got["sets"]
        assert s["set"] == rep["set"] and s["mismatches"] == []
        assert s["tensors"] == len(att["tensors"]) == rep["tensors"]
        assert s["bytes"] == sum(t["nbytes"] for t in att["tensors"])
        digests = {x["tensor"]: x["digest"] for x in s["digests"]}
        assert set(digests) == set(table(att))
        assert sum(t["nbytes"] > LEAF_BYTES for t in att["tensors"]) == 2
        for name, t in table(att).items():
            piece = slab[t["offset"]: t["offset"] + t["nbytes"]]
            assert digests[name] == tensor_digest(piece), name
            mp, b, e = ckpt.tensor_bytes(name)
            assert digests[name] == tensor_digest(mp[b:e]), name  # the whole plan: every output is a file tensor
        assert c.status()["sets"][0]["digests"] is True
    ckpt.close()


def test_flipped_byte_is_named_and_the_set_refuses_leases(start_daemon, tiny):
    d = start_daemon(settings=WRITABLE)
    with d.connect() as holder, d.connect() as other:
        rep = load(holder, tiny["b"])
        att, fd = holder.attach(set=rep["set"])
        t = table(att)["layers.0.odd"]
        try:
            before = os.pread(fd, t["nbytes"], t["offset"])
            flip(fd, att["bytes"], t["offset"] + 17)
            after = os.pread(fd, t["nbytes"], t["offset"])
        finally:
            os.close(fd)
        assert before != after
        r = dctl(d, "scrub", rep["set"])
        assert r.code == 1, r.describe()
        assert "tensor 'layers.0.odd' differs" in r.out and r.out.count("differs") == 1, r.describe()
        got = other.call("scrub", set=rep["set"])
        assert got["clean"] is False and got["mismatches"] == 1
        (m,) = got["sets"][0]["mismatches"]
        assert m == {"tensor": "layers.0.odd", "expected": tensor_digest(before), "found": tensor_digest(after)}
        # The holder is told once, when the first scrub found it.
        ev = next_event(holder)
        assert ev["event"] == "corrupt" and ev["set"] == rep["set"] and ev["tensors"] == ["layers.0.odd"], ev
        (s,) = other.status()["sets"]
        assert s["corrupt"] == ["layers.0.odd"]
        r = dctl(d, "status")
        assert r.code == 0, r.describe()
        assert "CORRUPT (a scrub found changed; new leases refused): layers.0.odd" in r.out, r.describe()
        with pytest.raises(WDError) as e:
            other.attach(set=rep["set"])
        assert e.value.code == "BAD_CHECKSUM" and "layers.0.odd" in e.value.message
        assert other.error("attach", path=tiny["b"], device=0) == "BAD_CHECKSUM"  # the same set, by path
        assert other.error("load", path=tiny["b"], device=0) == "BAD_CHECKSUM"  # a load finds it: not served
        g, _ = other.request("load_group", path=tiny["b"], group={"tp_size": 1}, plan={"preset": "whole"})
        assert g["error"]["code"] == "BAD_CHECKSUM" and "layers.0.odd" in g["error"]["message"], g
        # The corrupt set goes once released; a new load is clean.
        holder.call("release", lease=att["lease"])
        assert other.call("evict", set=rep["set"])["evicted"] == [rep["set"]]
        again = load(other, tiny["b"])
        assert again["set"] != rep["set"]
        assert other.call("scrub", set=again["set"])["clean"] is True


def page_flags(fd):
    """The flags word of a progress page (offset 36, docs/protocol.md)."""
    m = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ)
    try:
        assert m[0:4] == b"WDPP"
        return int.from_bytes(m[36:40], "little")
    finally:
        m.close()


def test_corrupt_set_is_retired_and_loaded_again(start_daemon, tiny):
    """scrub_reload on (the default): the holder is told (event, page flag), the set leaves the list, a new set with
    the files' bytes takes its place for the next attach by path, and the old memory goes with its last lease."""
    d = start_daemon(settings={"scrub": "on", "test_writable_slabs": "on", "scrub_duty": 0})
    ckpt = Checkpoint(tiny["b"])
    with d.connect(features=["progress_page"]) as holder, d.connect() as other:
        rep = load(holder, tiny["b"])
        att, fds = holder.request("attach", set=rep["set"])
        assert att.get("ok") and len(fds) == 2 and att["progress"]["fd_index"] == 1, att
        slab_fd, page_fd = fds
        assert page_flags(page_fd) == 0
        t = table(att)["layers.0.odd"]
        flip(slab_fd, att["bytes"], t["offset"] + 3)
        got = other.call("scrub", set=rep["set"])
        assert got["clean"] is False and got["mismatches"] == 1
        ev = next_event(holder)
        assert ev["event"] == "corrupt" and ev["set"] == rep["set"] and ev["reload"] is True, ev
        assert ev["tensors"] == ["layers.0.odd"]
        assert page_flags(page_fd) == 1
        # Off the list at once; its replacement loads (it may be ready already: the checkpoint is tiny).
        sets = other.status()["sets"]
        assert rep["set"] not in [s["set"] for s in sets], sets
        assert other.error("attach", set=rep["set"]) == "NOT_FOUND"
        assert other.error("scrub", set=rep["set"]) == "NOT_FOUND"
        new, nfd = other.attach(path=tiny["b"], device=0)
        try:
            assert new["set"] != rep["set"]
            slab = os.pread(nfd, new["bytes"], 0)
        finally:
            os.close(nfd)
        for name, x in table(new).items():
            mp, b, e = ckpt.tensor_bytes(name)
            assert slab[x["offset"]: x["offset"] + x["nbytes"]] == mp[b:e], name
        assert other.call("scrub", set=new["set"])["clean"] is True
        assert f"set {rep['set']} (corrupt) loaded again as set {new['set']}" in d.log_text()
        # Both copies count against the device while the holder keeps the old one, which status counts apart.
        dev = other.status()["devices"][0]
        assert dev["used"] == att["bytes"] + new["bytes"], dev
        assert dev["unlisted_sets"] == 1 and dev["unlisted_bytes"] == att["bytes"], dev
        # The holder still maps the old memory (with its flipped byte) until it releases it.
        assert os.pread(slab_fd, 1, t["offset"] + 3) != ckpt_byte(ckpt, "layers.0.odd", 3)
        os.close(slab_fd)
        os.close(page_fd)
        assert holder.call("release", lease=att["lease"]).get("ok")
        st = other.status()
        (s,) = st["sets"]
        assert s["set"] == new["set"] and "corrupt" not in s
        assert st["devices"][0]["used"] == new["bytes"]  # the retired set's memory went with its last lease
        assert st["devices"][0]["unlisted_sets"] == 0 and st["devices"][0]["unlisted_bytes"] == 0
    ckpt.close()
    d.check_serving()


def test_replica_of_a_changed_copy_fails(start_daemon, tiny):
    """A replica copied device to device must hash to its source's recorded digests: a source changed since its
    load (not scrubbed yet) fails the replica with BAD_CHECKSUM instead of becoming a second wrong copy."""
    d = start_daemon(settings={"scrub": "on", "test_writable_slabs": "on", "scrub_duty": 0, "host_devices": 2,
                               "metrics_address": ""})
    with d.connect() as c:
        first = c.call("load", path=tiny["b"], device=0, plan={"preset": "whole"})
        att, fd = c.attach(set=first["set"])
        try:
            flip(fd, att["bytes"], table(att)["embed.weight"]["offset"] + 5)
        finally:
            os.close(fd)
        m, _ = c.request("load", path=tiny["b"], device=1, plan={"preset": "whole"})
        assert m["error"]["code"] == "BAD_CHECKSUM", m
        assert "'embed.weight' as copied from device 0's copy" in m["error"]["message"], m
        assert [s["set"] for s in c.status()["sets"]] == [first["set"]]  # the failed replica left nothing
        c.call("release", lease=att["lease"])
        # An unchanged source gives a replica whose every output matches.
        c.call("evict", set=first["set"])
        first = c.call("load", path=tiny["b"], device=0, plan={"preset": "whole"})
        second = c.call("load", path=tiny["b"], device=1, plan={"preset": "whole"})
        assert second["method"] == "peer", second
        assert c.call("scrub", set=second["set"])["clean"] is True


def ckpt_byte(ckpt, name, i):
    mp, b, e = ckpt.tensor_bytes(name)
    return mp[b + i: b + i + 1]


def test_untouched_sets_scrub_clean(start_daemon, tiny):
    d = start_daemon(settings=WRITABLE)
    with d.connect() as c:
        sets = [load(c, tiny[n])["set"] for n in ("a", "b", "many")]
        sets.append(load(c, tiny["a"], plan=FUSED)["set"])
        r = dctl(d, "scrub")
        assert r.code == 0, r.describe()
        for s in sets:
            assert f"set {s}:" in r.out and "clean" in r.out
        assert "CORRUPT" not in r.out
        got = c.call("scrub")
        assert got["clean"] is True and sorted(x["set"] for x in got["sets"]) == sorted(sets)
        assert all("corrupt" not in s for s in c.status()["sets"])


def test_fused_piece_flip_names_the_output(start_daemon, tiny):
    """A fused output (two file tensors concatenated) has digests of its own pieces, not of the files."""
    d = start_daemon(settings=WRITABLE)
    with d.connect() as c:
        rep = load(c, tiny["c"], plan=FUSED)
        att, fd = c.attach(set=rep["set"])
        t = table(att)["fused"]
        try:
            slab = os.pread(fd, att["bytes"], 0)
            flip(fd, att["bytes"], t["offset"] + t["nbytes"] - 1)  # in head.weight's piece
        finally:
            os.close(fd)
        got = c.call("scrub", set=rep["set"], digests=True)
        (s,) = got["sets"]
        assert [m["tensor"] for m in s["mismatches"]] == ["fused"]
        (m,) = s["mismatches"]
        assert m["expected"] == tensor_digest(slab[t["offset"]: t["offset"] + t["nbytes"]])
        ckpt = Checkpoint(tiny["c"])
        try:
            mp, b, e = ckpt.tensor_bytes("embed.weight")
            half = table(att)["half"]
            assert {x["tensor"]: x["digest"] for x in s["digests"]}["half"] == tensor_digest(mp[b: b + half["nbytes"]])
        finally:
            ckpt.close()


def metrics(d):
    with urllib.request.urlopen(f"http://{d.metrics_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_background_scrub_finds_it(start_daemon, tiny):
    d = start_daemon(settings={"scrub": "on", "test_writable_slabs": "on", "scrub_duty": 100, "scrub_interval_ms": 10,
                               "scrub_reload": "off"}, metrics=True)
    with d.connect() as c:
        clean = load(c, tiny["a"])["set"]
        rep = load(c, tiny["c"])
        att, fd = c.attach(set=rep["set"])
        t = table(att)["embed.weight"]
        try:
            flip(fd, att["bytes"], t["offset"])
        finally:
            os.close(fd)
        # Polled until the background scrub gets there (the test's time limit bounds it).
        while True:
            sets = {s["set"]: s for s in c.status()["sets"]}
            if "corrupt" in sets[rep["set"]]:
                break
            time.sleep(0.05)
        assert sets[rep["set"]]["corrupt"] == ["embed.weight"]
        assert "corrupt" not in sets[clean]
        ev = next_event(c)
        assert ev["event"] == "corrupt" and ev["tensors"] == ["embed.weight"]
        assert c.error("attach", set=rep["set"]) == "BAD_CHECKSUM"
        m = metrics(d)
        assert m["weightd_scrub_mismatches_total"] >= 1
        assert m["weightd_scrubbed_bytes_total"] >= t["nbytes"]
        assert m["weightd_sets_corrupt"] == 1
        assert "tensor 'embed.weight' changed since it was loaded" in d.log_text()


def test_scrub_errors_and_a_set_held_while_scrubbed(start_daemon, tiny):
    d = start_daemon(settings=WRITABLE)
    with d.connect() as c:
        assert c.error("scrub", set="s999") == "NOT_FOUND"
        assert c.error("scrub", set=7) == "BAD_REQUEST"
        assert c.error("scrub", digests="yes") == "BAD_REQUEST"
        rep = load(c, tiny["many"])
        # Pipelined: an eviction that arrives while the scrub holds the set is refused, or comes after it.
        sid = c.start("scrub", set=rep["set"])
        eid = c.start("evict", set=rep["set"])
        scrubbed, _ = c.wait(sid)
        evicted, _ = c.wait(eid)
        assert scrubbed.get("ok") and scrubbed["clean"] is True, scrubbed
        if "error" in evicted:
            assert evicted["error"]["code"] == "BUSY" and "scrubbed" in evicted["error"]["message"]
            assert c.call("evict", set=rep["set"])["evicted"] == [rep["set"]]
        else:
            assert evicted["evicted"] == [rep["set"]]
        assert c.status()["sets"] == []
        assert c.call("scrub") == {"id": c.next_id - 1, "ok": True, "clean": True, "mismatches": 0, "skipped": 0,
                                   "sets": []}
    d.check_serving()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_who_may_scrub_is_who_may_see_the_set(start_daemon):
    """nobody scrubs the set of a checkpoint it may read, not one of a root-only checkpoint (PERMISSION by id,
    left out of a scrub of every set, as status leaves it out)."""
    import shutil
    import tempfile

    from test_access import SETTINGS, as_client, private_checkpoint
    from wdfixtures import TINY_TENSORS, write_single

    tree = tempfile.mkdtemp(prefix="wds-")
    try:
        os.chmod(tree, 0o755)
        private = private_checkpoint(tree)
        public = write_single(os.path.join(tree, "public"), TINY_TENSORS, 14)
        d = start_daemon(dict(SETTINGS, scrub="on"), roots=[tree], public=True)
        with d.connect() as root:
            sid = load(root, private)["set"]
            pid = load(root, public)["set"]
            _, got = as_client(d.socket, [{"op": "scrub", "id": 10, "set": sid},
                                          {"op": "scrub", "id": 11, "set": pid},
                                          {"op": "scrub", "id": 12},
                                          {"op": "status", "id": 13}])
            assert got[10]["error"]["code"] == "PERMISSION" and sid in got[10]["error"]["message"], got
            assert got[11]["ok"] is True and [s["set"] for s in got[11]["sets"]] == [pid], got
            assert [s["set"] for s in got[12]["sets"]] == [pid], got
            assert [s["set"] for s in got[13]["sets"]] == [pid], got
            # root (an admin) scrubs both.
            assert sorted(s["set"] for s in root.call("scrub")["sets"]) == sorted([sid, pid])
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def test_stopping_while_scrubs_run(start_daemon, tiny):
    """A daemon stopped with scrubs queued and running (asked for, and in the background) exits cleanly: each
    scrub is answered (done, or CANCELED), nothing leaks (the ASan build's report is checked at exit)."""
    d = start_daemon(settings={"scrub": "on", "scrub_duty": 50, "scrub_interval_ms": 1})
    with d.connect() as c:
        sets = [load(c, tiny[n])["set"] for n in ("a", "b", "c", "many")]
        ids = [c.start("scrub") for _ in range(8)] + [c.start("scrub", set=s) for s in sets]
        d.proc.send_signal(15)
        try:
            for rid in ids:
                m, _ = c.wait(rid)
                # BUSY: a named scrub of a set whose scrub (asked for by a scrub of every set) is queued already.
                assert m.get("ok") is True or m["error"]["code"] in ("CANCELED", "SHUTDOWN", "BUSY"), m
        except (Closed, OSError):  # the connection closed as the daemon stopped: the rest were never answered
            pass
    assert d.wait_exit(60) == 0, d.log_tail()
    d.check_exit(0)


def test_scrub_off_by_default_says_so(start_daemon, tiny):
    """The default: no digests, a named scrub UNSUPPORTED saying why, and a scrub of every set not clean."""
    d = start_daemon()
    with d.connect() as c:
        sid = load(c, tiny["a"])["set"]
        assert c.status()["daemon"]["scrub"] == "off"
        with pytest.raises(WDError) as e:
            c.call("scrub", set=sid)
        assert e.value.code == "UNSUPPORTED" and "scrubbing is off" in e.value.message, e.value.reply
        got = c.call("scrub")
        assert got["clean"] is False and got["skipped"] == 1 and got["mismatches"] == 0, got
    r = dctl(d, "scrub")
    assert r.code == 1 and "scrubbing is off" in r.out, r.describe()
