"""Restart survival (issue 18): sets kept in the service manager's fd store.

CI has no systemd, so fdstore_harness.py plays its fd store as
docs/operations.md ("Restarts") describes it. The daemon runs the host
backend, whose memfd slabs stand in for VMM allocations.
"""
import fcntl
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading

import pytest

import fdstore_harness
from conftest import REPO, SANITIZER_MARKS, SLOW, STOP_SECONDS, WEIGHTD, write_single, TINY_TENSORS, _failed
from wdclient import Checkpoint, Conn, WDError, map_readonly, ranges_equal, verify_attached, wait_until, write_safetensors, xxh64

SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class Supervisor(fdstore_harness.Supervisor):
    """The harness's supervisor with the test run's binary, timeouts and sanitizer checks."""

    def __init__(self, model_root, **kw):
        super().__init__(WEIGHTD, model_root, timeout=20 * SLOW, stop_seconds=STOP_SECONDS, **kw)

    def stop(self):
        super().stop()
        marks = [m for m in SANITIZER_MARKS if m in self.log_text()]
        assert not marks, f"sanitizer report ({marks}):\n{self.log_text()}"

    def connect(self):
        return Conn(self.socket, timeout=30 * SLOW)

    def status(self):
        with self.connect() as c:
            return c.status()


@pytest.fixture
def supervisor(model_root, binaries, request):
    made = []

    def make(**kw):
        s = Supervisor(model_root, **kw)
        made.append(s)
        return s

    yield make
    failed = _failed(request)
    for s in made:
        if failed and os.path.exists(s.log_path):
            print(f"---- weightd log ----\n{s.log_text()[-12000:]}")
        s.cleanup()


@pytest.fixture
def ckpt_copy(model_root):
    """A private tiny checkpoint (tests change its files), removed afterwards."""
    d = tempfile.mkdtemp(prefix="restart-", dir=model_root)
    write_single(d, TINY_TENSORS, seed=11)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def loads(st):
    return st["daemon"]["loads"]


def stored_slabs(store):
    return [n for n in store.names() if n.startswith("wd-slab-")]


def stored_descriptions(store):
    return [n for n in store.names() if n.startswith("wd-sets-")]


def test_sigkill_keeps_sets_leases_and_bytes(supervisor, tiny):
    """A client keeps reading a set through SIGKILL and restart; the set comes back without a load."""
    s = supervisor().start()
    assert "restart survival: on" in s.log_text()
    ck = Checkpoint(os.path.join(tiny["a"], "model.safetensors"))
    c = s.connect()
    att, fd = c.attach(path=tiny["a"])
    lease, set_id = att["lease"], att["set"]
    assert verify_attached(att, fd, ck) > 0
    wait_until(lambda: stored_slabs(s.store) == [f"wd-slab-{set_id}"], what="the slab in the store")
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description in the store")
    # A reader that checks the mapping all the time, while the daemon dies and comes back.
    mapping, _ = map_readonly(fd)
    table = {t["name"]: t for t in att["tensors"]}
    errors, rounds, stop = [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            for name, t in table.items():
                src, b, e = ck.tensor_bytes(name)
                if not ranges_equal(mapping, t["offset"], src, b, e - b):
                    errors.append(name)
            rounds[0] += 1

    th = threading.Thread(target=reader)
    th.start()
    before = rounds[0]
    s.kill()
    with pytest.raises(Exception):
        c.status()  # the connection is gone
    c.close()
    wait_until(lambda: rounds[0] > before + 2, what="reads after the kill")
    s.start()
    after_start = rounds[0]
    st = s.status()
    assert [x["set"] for x in st["sets"]] == [set_id], st["sets"]
    assert st["daemon"]["sets_readopted"] == 1 and loads(st) == 0, st["daemon"]
    assert [(l["lease"], l["recovered"]) for l in st["leases"]] == [(lease, True)]
    assert "re-adopted set " + set_id in s.log_text()
    # The holder (this process) reclaims its lease; a new attach is served from the re-adopted set.
    c2 = s.connect()
    rep = c2.call("reclaim", lease=lease)
    assert rep["reclaimed"] is True and rep["set"] == set_id
    att2, fd2 = c2.attach(path=tiny["a"])
    assert att2["set"] == set_id
    assert verify_attached(att2, fd2, ck) > 0
    os.close(fd2)
    st = s.status()
    assert loads(st) == 0, "the attach after the restart loaded the set again"
    assert {l["lease"]: l["recovered"] for l in st["leases"]}[lease] is False
    wait_until(lambda: rounds[0] > after_start + 2, what="reads after the restart")
    stop.set()
    th.join()
    assert errors == [], f"{len(errors)} tensors read wrong across the restart"
    mapping.close()
    os.close(fd)
    c2.close()
    s.stop()


def test_reclaim_refused_to_another_process(supervisor, tiny):
    s = supervisor().start()
    c = s.connect()
    att, fd = c.attach(path=tiny["b"])
    os.close(fd)
    s.kill()
    c.close()
    s.start()
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from wdclient import Conn, WDError\n"
            "c = Conn(sys.argv[2])\n"
            "try:\n    c.call('reclaim', lease=sys.argv[3]); print('RECLAIMED')\n"
            "except WDError as e:\n    print(e.code, e.message)\n")
    r = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), s.socket, att["lease"]],
                       capture_output=True, text=True, timeout=60 * SLOW)
    assert r.stdout.startswith("PERMISSION"), r.stdout + r.stderr
    assert f"granted to uid {os.getuid()} pid {os.getpid()}" in r.stdout
    with s.connect() as c2:
        with pytest.raises(WDError) as e:
            c2.call("reclaim", lease="l999")
        assert e.value.code == "NOT_FOUND"
        assert c2.call("reclaim", lease=att["lease"])["reclaimed"] is True
    s.stop()


def test_unreclaimed_leases_end_after_the_grace_period(supervisor, tiny):
    s = supervisor(config={"restart_grace_ms": 300}).start()
    c = s.connect()
    att, fd = c.attach(path=tiny["c"])
    os.close(fd)
    s.kill()
    c.close()
    s.start()
    wait_until(lambda: "nobody reclaimed ended" in s.log_text(), what="the grace period's end")
    st = s.status()
    assert st["leases"] == []
    assert [x["set"] for x in st["sets"]] == [att["set"]]  # the set stays, unleased
    with s.connect() as c2:
        with pytest.raises(WDError) as e:
            c2.call("reclaim", lease=att["lease"])
        assert e.value.code == "NOT_FOUND"
    s.stop()


def test_changed_checkpoint_is_not_readopted(supervisor, ckpt_copy):
    s = supervisor().start()
    with s.connect() as c:
        att, fd = c.attach(path=ckpt_copy)
        os.close(fd)
        c.call("release", lease=att["lease"])
    wait_until(lambda: len(stored_slabs(s.store)) == 1, what="the slab in the store")
    s.kill()
    shard = os.path.join(ckpt_copy, "model.safetensors")
    write_single(ckpt_copy, TINY_TENSORS, seed=12)  # same size, new bytes: a new file
    s.start()
    text = s.log_text()
    assert f"set {att['set']} of {os.path.realpath(ckpt_copy)} is not re-adopted: the checkpoint changed" in text, text
    assert "model.safetensors" in text.split("is not re-adopted")[1].splitlines()[0]
    st = s.status()
    assert st["sets"] == [] and st["daemon"]["sets_readopted"] == 0
    wait_until(lambda: stored_slabs(s.store) == [], what="the stale slab removed from the store")
    # A new attach loads the new bytes.
    with s.connect() as c:
        att2, fd2 = c.attach(path=ckpt_copy)
        assert verify_attached(att2, fd2, Checkpoint(shard)) > 0
        os.close(fd2)
    assert loads(s.status()) == 1
    s.stop()


def replace_description(store, data):
    """Puts data, as a sealed memfd, in place of the stored description (same name)."""
    with store.lock:
        (i, (name, fd)), = [(i, e) for i, e in enumerate(store.fds) if e[0].startswith("wd-sets-")]
        os.close(fd)
        m = os.memfd_create("corrupt", os.MFD_ALLOW_SEALING)
        os.write(m, data)
        fcntl.fcntl(m, fcntl.F_ADD_SEALS, SEALS)
        store.fds[i] = [name, m]


def read_description(store):
    with store.lock:
        (fd,) = [fd for name, fd in store.fds if name.startswith("wd-sets-")]
        return os.pread(fd, 1 << 20, 0)


def newest_description(store):
    """The stored description of the highest generation: between storing one and removing the one before,
    the daemon's store holds both."""
    with store.lock:
        gen, fd = max((int(name[len("wd-sets-"):]), fd) for name, fd in store.fds if name.startswith("wd-sets-"))
        return os.pread(fd, 1 << 20, 0)


def _sets_of(data, store):
    """A version-3 set description cut at its sets: (header, [(fields before the ids, ids, shards, table)],
    leases), each set's tensor table read from the memfd the description names in the store."""
    (nsets,) = struct.unpack_from("<I", data, 32)
    at, sets = 48, []

    def take_str(at):
        (n,) = struct.unpack_from("<I", data, at)
        return at + 4 + n, data[at + 4:at + 4 + n].decode()

    for _ in range(nsets):
        start = at
        for _ in range(3):
            at, _ = take_str(at)  # id, path, uuid
        at += 4 + 8 + 8 + 16  # handle kind, slab bytes, allocation bytes, allocation id
        at, _ = take_str(take_str(at)[0])  # store name, plan key
        ids = data[at:at + 68]
        at += 68
        head = data[start:at - 68]
        (nshards,) = struct.unpack_from("<I", data, at)
        tail_start = at
        at += 4
        for _ in range(nshards):
            at = take_str(at)[0] + 32
        shards = data[tail_start:at]
        at, tname = take_str(at)
        tlen, tsum = struct.unpack_from("<QQ", data, at)
        at += 16
        table = stored_table(store, tname)
        assert len(table) == tlen and xxh64(table) == tsum
        sets.append((head, ids, shards, table))
    return data[:48], sets, data[at:]


def stored_table(store, name):
    with store.lock:
        (fd,) = [fd for n, fd in store.fds if n == name]
        return os.pread(fd, os.fstat(fd).st_size, 0)


def _describe(header, version, sets, leases):
    """Writes a description of the given parts as `version` 1 (without ids) or 2 (tables inline), with its
    size and checksum."""
    body = bytearray()
    for head, ids, shards, table in sets:
        body += head + (ids if version >= 2 else b"") + shards + struct.pack("<Q", len(table))
        body += b"\0" * ((8 - (48 + len(body)) % 8) % 8) + table
    body += leases
    h = bytearray(header)
    struct.pack_into("<IIQ", h, 8, version, 48, 48 + len(body))
    struct.pack_into("<Q", h, 40, xxh64(bytes(body)))
    return bytes(h) + bytes(body)


def _restart_with(s, tiny, rewrite, before_start=None):
    """A set loaded and its lease released, the daemon killed, its description rewritten (and before_start
    run), the daemon started."""
    with s.connect() as c:
        att, fd = c.attach(path=tiny["a"])
        os.close(fd)
        c.call("release", lease=att["lease"])
    wait_until(lambda: s.status()["leases"] == [] and len(stored_slabs(s.store)) == 1
               and len(stored_descriptions(s.store)) == 1, what="the slab and one description in the store")
    s.kill()
    header, sets, leases = _sets_of(read_description(s.store), s.store)
    replace_description(s.store, rewrite(header, sets, leases))
    if before_start is not None:
        before_start()
    s.start()
    return att["set"]


def test_description_of_an_earlier_daemon_is_readopted(supervisor, tiny):
    """A version-1 description (no ids, as weightd wrote before them) re-adopts its sets by file identity."""
    s = supervisor().start()
    set_id = _restart_with(s, tiny, lambda h, sets, leases: _describe(h, 1, sets, leases))
    text = s.log_text()
    assert f"re-adopted set {set_id}" in text and "described by an earlier weightd without content ids" in text, text
    st = s.status()
    assert [x["set"] for x in st["sets"]] == [set_id] and loads(st) == 0
    with s.connect() as c:  # and the next description is version 3 again
        att, fd = c.attach(path=tiny["a"])
        os.close(fd)
    wait_until(lambda: struct.unpack_from("<I", newest_description(s.store), 8)[0] == 3, what="a version-3 description")
    s.stop()


def test_description_with_another_layout_id_is_dropped(supervisor, tiny):
    """A described layout id that is not the checkpoint's: the set is dropped, never mismatched."""
    s = supervisor().start()

    def tamper(h, sets, leases):
        head, ids, shards, table = sets[0]
        ids = bytes([ids[0] ^ 1]) + ids[1:]
        return _describe(h, 2, [(head, ids, shards, table)] + sets[1:], leases)

    set_id = _restart_with(s, tiny, tamper)
    text = s.log_text()
    assert f"set {set_id} of {os.path.realpath(tiny['a'])} is not re-adopted: the checkpoint changed while the " \
           f"daemon was down: its layout id differs from the described one" in text, text
    assert s.status()["sets"] == []
    s.stop()


def test_description_with_an_id_past_the_counter_is_rejected(supervisor, tiny):
    """A set id whose number is past 2^63 - 1 (here 2^64 - 1) is refused with the rule: taken
    over, it wrapped the daemon's id counter, so that new sets got ids given already."""
    s = supervisor().start()
    huge = b"s18446744073709551615"

    def rename(h, sets, leases):
        head, ids, shards, table = sets[0]
        (n,) = struct.unpack_from("<I", head, 0)
        head = struct.pack("<I", len(huge)) + huge + head[4 + n:]
        return _describe(h, 2, [(head, ids, shards, table)] + sets[1:], leases)

    _restart_with(s, tiny, rename)
    text = s.log_text()
    assert "rejected, starting with no sets: set 0: id 's18446744073709551615' is not 's' and a number from 1 " \
           "to 9223372036854775807" in text, text
    st = s.status()
    assert st["sets"] == [] and st["daemon"]["sets_readopted"] == 0
    with s.connect() as c:
        assert c.call("load", path=tiny["a"])["set"] == "s1"
    s.stop()


def test_an_id_at_the_counter_max_is_the_last_given(supervisor, tiny):
    """A description whose set id is the largest (s9223372036854775807) is re-adopted; no id past it is given
    (a new set or lease is LIMIT), so the next description stays readable and the set survives a second
    restart. Before: the next set was s9223372036854775808, and the following restart rejected the whole
    description, losing every set."""
    s = supervisor().start()
    top = b"s9223372036854775807"

    def rename(h, sets, leases):
        """The set's id, and its slab's store name with it (as the daemon names them), become the last."""
        head, ids, shards, table = sets[0]
        strs, at = [], 0
        for _ in range(3):  # id, path, uuid
            (n,) = struct.unpack_from("<I", head, at)
            strs.append(head[at + 4:at + 4 + n])
            at += 4 + n
        fixed = head[at:at + 36]  # handle kind, slab bytes, allocation bytes, allocation id
        at += 36
        (n,) = struct.unpack_from("<I", head, at)
        rest = head[at + 4 + n:]  # the plan key
        enc = lambda b: struct.pack("<I", len(b)) + b
        head = enc(top) + enc(strs[1]) + enc(strs[2]) + fixed + enc(b"wd-slab-" + top) + rest
        return _describe(h, 2, [(head, ids, shards, table)] + sets[1:], leases)

    def renamed_store():
        with s.store.lock:
            for e in s.store.fds:
                if e[0] == "wd-slab-s1":
                    e[0] = "wd-slab-" + top.decode()

    set_id = _restart_with(s, tiny, rename, before_start=renamed_store)
    assert set_id == "s1"
    assert [x["set"] for x in s.status()["sets"]] == [top.decode()]
    with s.connect() as c:
        err = c.error("load", path=tiny["b"])
        assert err == "LIMIT", err
        m, _ = c.request("attach", path=tiny["a"])  # the re-adopted set: a lease would need an id too
        assert m.get("error", {}).get("code") == "LIMIT" and "no lease id is left" in m["error"]["message"], m
    s.kill()
    s.start()
    assert [x["set"] for x in s.status()["sets"]] == [top.decode()]
    s.stop()


@pytest.mark.parametrize("generation", ["99999999999999999999", "18446744073709551615", "+7"])
def test_generation_past_the_counter_does_not_outrank_the_description(supervisor, tiny, generation):
    """A stored name wd-sets-<generation> whose number overflows, is past 2^63 - 1 or is not a
    plain number is no candidate: the valid description is re-adopted and the name removed.
    Before: strtoull read it as 2^64 - 1, it outranked the valid one, and the sets were lost."""
    s = supervisor().start()
    with s.connect() as c:
        att, fd = c.attach(path=tiny["a"])
        os.close(fd)
        c.call("release", lease=att["lease"])
    wait_until(lambda: s.status()["leases"] == [] and len(stored_slabs(s.store)) == 1
               and len(stored_descriptions(s.store)) == 1, what="the slab and one description in the store")
    s.kill()
    forged = "wd-sets-" + generation
    m = os.memfd_create("forged", os.MFD_ALLOW_SEALING)
    os.write(m, b"WDSETDSC" + b"\xff" * 40)
    fcntl.fcntl(m, fcntl.F_ADD_SEALS, SEALS)
    with s.store.lock:
        s.store.fds.append([forged, m])
    s.start()
    text = s.log_text()
    assert f"descriptor '{forged}' passed at start: not a generation from 1 to 9223372036854775807; ignored" \
        in text, text
    assert f"re-adopted set {att['set']}" in text, text
    assert [x["set"] for x in s.status()["sets"]] == [att["set"]]
    wait_until(lambda: forged not in s.store.names(), what="the forged name removed from the store")
    assert len(stored_descriptions(s.store)) == 1
    s.stop()


@pytest.mark.parametrize("how", ["flipped", "truncated", "magic", "unsealed"])
def test_corrupt_description_starts_empty(supervisor, tiny, how):
    s = supervisor().start()
    with s.connect() as c:
        att, fd = c.attach(path=tiny["a"])
        os.close(fd)
    # Closing the connection drops its lease, and the daemon stores a new generation of the
    # description, then removes the old one: a kill in between (a crash) leaves both. Wait until
    # the lease is gone (the new generation is sent by then) and one description is stored.
    wait_until(lambda: s.status()["leases"] == [] and len(stored_slabs(s.store)) == 1
               and len(stored_descriptions(s.store)) == 1, what="the slab and one description in the store")
    s.kill()
    data = bytearray(read_description(s.store))
    if how == "flipped":
        data[len(data) // 2] ^= 0xFF
    elif how == "truncated":
        data = data[: len(data) - 9]
    elif how == "magic":
        data[0:8] = b"NOTADESC"
    if how == "unsealed":
        with s.store.lock:
            (i,) = [i for i, e in enumerate(s.store.fds) if e[0].startswith("wd-sets-")]
            os.close(s.store.fds[i][1])
            m = os.memfd_create("unsealed")
            os.write(m, bytes(data))
            s.store.fds[i][1] = m
    else:
        replace_description(s.store, bytes(data))
    s.start()
    text = s.log_text()
    assert "rejected, starting with no sets" in text, text
    st = s.status()
    assert st["sets"] == [] and st["leases"] == []
    wait_until(lambda: stored_slabs(s.store) == [], what="the unusable slab removed from the store")
    assert len(stored_descriptions(s.store)) == 1
    s.stop()


def test_descriptor_counts_stay_flat(supervisor, tiny):
    """1000 attach/release cycles without a restart, then 20 restarts: no descriptor accumulates."""
    s = supervisor().start()
    c = s.connect()
    att, fd = c.attach(path=tiny["a"])
    os.close(fd)
    c.call("release", lease=att["lease"])
    wait_until(lambda: stored_slabs(s.store) == [f"wd-slab-{att['set']}"], what="the slab in the store")
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
    base_daemon, base_store = s.fd_count(clients=1), s.store.names()
    for _ in range(1000):
        a, f = c.attach(path=tiny["a"])
        os.close(f)
        c.call("release", lease=a["lease"])
    c.status()
    wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
    assert s.fd_count(clients=1) == base_daemon
    assert [n for n in s.store.names() if not n.startswith("wd-sets-")] == \
        [n for n in base_store if not n.startswith("wd-sets-")]
    c.close()
    c = s.connect()  # holds a lease through the restarts
    held, f = c.attach(path=tiny["b"])
    os.close(f)
    wait_until(lambda: len(stored_slabs(s.store)) == 2, what="two slabs stored")
    counts, stores = [], []
    for i in range(20):
        if i % 2:
            s.stop()
        else:
            s.kill()
        s.start()
        st = s.status()
        assert sorted(x["set"] for x in st["sets"]) == sorted([att["set"], held["set"]])
        assert loads(st) == 0
        wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
        counts.append(s.fd_count())
        stores.append(len(s.store.names()))
    c.close()
    assert len(set(counts)) == 1, counts
    assert stores == [5] * 20, stores  # one description, and per set its slab and its tensor table
    s.stop()


def test_sets_past_the_store_limit_are_not_stored_and_the_rest_survive(supervisor, model_root):
    """A store of 8 descriptors (FileDescriptorStoreMax=8, announced as FDSTORE=8) holds the description and
    three sets (a slab and a table each) with one place free for the next description: a fourth set is not
    stored (logged once), and a restart re-adopts the three and their leases. Before: the fourth set's
    descriptors and the new description were refused by the manager, the old description was removed, and
    the restart re-adopted nothing."""
    s = supervisor(fdstore_max=8).start()
    cks = []
    for i in range(4):
        d = os.path.join(model_root, f"store-cap-{i}")
        write_single(d, TINY_TENSORS, seed=40 + i)
        cks.append(d)
    try:
        c = s.connect()
        leases = []
        for d in cks[:3]:
            att, fd = c.attach(path=d)
            os.close(fd)
            leases.append(att)
        fourth = c.call("load", path=cks[3])["set"]  # a prewarm: resident, no lease
        c.status()
        s.store.drain()
        wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
        assert s.store.refused == [], s.store.refused  # the daemon never offered more than the store holds
        text = s.log_text()
        assert f"set {fourth} will not survive a restart: the fd store is full (7 of 8 descriptors" in text, text
        assert text.count(f"set {fourth} will not survive a restart") == 1
        s.kill()
        s.start()
        st = s.status()
        assert sorted(x["set"] for x in st["sets"]) == sorted(a["set"] for a in leases) and loads(st) == 0
        assert sorted(x["lease"] for x in st["leases"]) == sorted(a["lease"] for a in leases)
        s.stop()
    finally:
        for d in cks:
            shutil.rmtree(d, ignore_errors=True)


def stored_messages(store, prefix):
    """How many descriptors named prefix... the daemon has stored so far."""
    with store.lock:
        return sum(1 for m in store.messages if m.get("FDSTORE") == "1" and m.get("FDNAME", "").startswith(prefix))


def test_lease_changes_store_small_descriptions(supervisor, model_root):
    """A set of 20,000 tensors: its tensor table is stored once, beside its slab, and a lease change stores a
    description of a few hundred bytes (before: every change wrote every set's table again, about a megabyte
    here); a connection that closes with 300 leases stores one or two descriptions (before: 300)."""
    path = os.path.join(model_root, "many-tensors.safetensors")
    write_safetensors(path, [(f"model.layers.{i}.w", "F32", [2]) for i in range(20000)])
    try:
        s = supervisor().start()
        with s.connect() as c:
            att, fd = c.attach(path=path)
            os.close(fd)
            wait_until(lambda: len(stored_slabs(s.store)) == 1 and len(stored_descriptions(s.store)) == 1,
                       what="the slab and one description in the store")
            table = stored_table(s.store, f"wd-table-{att['set']}")
            assert len(table) > 20000 * 8, len(table)  # the table holds every tensor
            before = stored_messages(s.store, "wd-table-")
            c.call("release", lease=att["lease"])
            a2, fd = c.attach(path=path)
            os.close(fd)
            wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
            assert len(read_description(s.store)) < 4096
            assert stored_messages(s.store, "wd-table-") == before  # stored once
            holder = s.connect()
            for _ in range(300):
                _, f = holder.attach(path=path)
                os.close(f)
            wait_until(lambda: s.status()["totals"]["leases"] == 301, what="301 leases")
            wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
            n0 = stored_messages(s.store, "wd-sets-")
            holder.close()
            wait_until(lambda: [x["lease"] for x in s.status()["leases"]] == [a2["lease"]], what="one lease left")
            wait_until(lambda: len(stored_descriptions(s.store)) == 1, what="one description")
            assert stored_messages(s.store, "wd-sets-") - n0 <= 2
        s.kill()
        s.start()  # and what it stored re-adopts
        st = s.status()
        assert [x["set"] for x in st["sets"]] == [att["set"]] and loads(st) == 0
        with s.connect() as c:
            a3, fd = c.attach(path=path)
            os.close(fd)
            assert a3["set"] == att["set"] and len(a3["tensors"]) == 20000
        s.stop()
    finally:
        os.unlink(path)


# ---- the clients: libweightd through the Python binding ------------------------------------


def binding():
    """The weightd package over the libweightd built next to WEIGHTD."""
    lib = os.path.join(os.path.dirname(WEIGHTD), "libweightd.so")
    if not os.path.exists(lib):
        pytest.skip(f"no {lib}")
    os.environ.setdefault("WEIGHTD_LIB", lib)
    sys.path.insert(0, os.path.join(REPO, "client", "python"))
    try:
        import numpy  # noqa: F401
        import weightd
    except ImportError as e:
        pytest.skip(f"the Python binding cannot load here: {e}")
    return weightd


def tensor_bytes(s, name):
    import numpy
    return numpy.ascontiguousarray(s[name]).view(numpy.uint8).tobytes()


def test_binding_reconnects_and_reclaims(supervisor, tiny):
    """After SIGKILL: calls fail with CONNECT while the daemon is gone; once it is back the next call
    reconnects and reclaims the lease; the set's arrays read the file's bytes throughout."""
    weightd = binding()
    # Without socket activation a daemon that is gone refuses connections at once (with it, the manager's
    # listening socket accepts and a call waits for the daemon to come back, up to the client's timeout).
    s = supervisor(activate=False).start()
    ck = Checkpoint(os.path.join(tiny["a"], "model.safetensors"))
    names = ["layers.0.odd", "layers.0.norm.weight", "layers.0.bias"]

    def check(ws):
        for n in names:
            src, b, e = ck.tensor_bytes(n)
            assert tensor_bytes(ws, n) == bytes(src[b:e]), n

    client = weightd.Client(s.socket)
    ws = client.attach(tiny["a"])
    check(ws)
    lease = [l for l in s.status()["leases"]][0]["lease"]
    s.kill()
    check(ws)  # the mapping outlives the daemon
    with pytest.raises(weightd.Error) as e:
        client.status()
    assert e.value.name in ("CONNECT", "CLOSED"), e.value
    with pytest.raises(weightd.Error) as e:  # still gone: each call tries once, and fails the same way
        client.status()
    assert e.value.name == "CONNECT", e.value
    s.start()
    st = client.status()  # reconnects, reclaims
    assert [(l["lease"], l["recovered"], l["pid"]) for l in st["leases"]] == [(lease, False, os.getpid())]
    assert st["daemon"]["loads"] == 0
    check(ws)
    ws.release()
    assert s.status()["leases"] == []
    client.close()
    s.stop()


@pytest.mark.parametrize("activate", [True, False])
def test_idle_binding_reconnects_on_its_first_call(supervisor, tiny, activate):
    """A client idle through SIGKILL and restart (as an engine running forward passes is): its first call
    after the restart succeeds, on a new connection, with its lease reclaimed; no call fails."""
    weightd = binding()
    s = supervisor(activate=activate).start()
    client = weightd.Client(s.socket)
    ws = client.attach(tiny["a"])
    lease = s.status()["leases"][0]["lease"]
    s.kill()
    s.start()
    st = client.status()  # the old connection is closed: noticed before sending, reconnected, reclaimed
    assert [(l["lease"], l["recovered"], l["pid"]) for l in st["leases"]] == [(lease, False, os.getpid())]
    assert st["daemon"]["loads"] == 0
    ws.release()
    assert s.status()["leases"] == []
    client.close()
    s.stop()
