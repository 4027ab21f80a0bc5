"""The daemon's limits (issue "Hardening I"): what one client can make it hold,
and what happens at each limit. Every test here fails on the daemon before the
limits (d6b73c0), or, for the few that guard a flaw of their first
implementation, on that; the docstrings say how ("Before:").

The limits and their defaults are listed in docs/reliability.md. Memory is
measured as RssAnon (the daemon's heap: memfd slabs and mapped shards are not
in it) and VmHWM (the peak, reset through /proc/PID/clear_refs); under ASan the
allocator keeps freed memory in quarantine, so those checks are skipped there.
"""
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import ASAN, SLOW, WEIGHTCTL, write_single
from wdclient import Closed, Conn, frame, wait_until, write_safetensors

MiB = 1 << 20
FD_SLACK = 4  # descriptors a test's own extra connections may add


# ---- helpers ---------------------------------------------------------------------


def sync(c, tag="sync"):
    """Returns once the daemon has read every frame c sent before this call.

    cancel skips the connection's queue and is answered as soon as it is read;
    its target names no request, so it cancels nothing.
    """
    c.send({"op": "cancel", "id": tag, "target": "no-such-request"})
    m, fds = c.wait(tag)
    assert m.get("canceled") is False and not fds, m


def fresh_client_answers(d, timeout=5.0 * SLOW):
    """A new connection gets hello and status answered within timeout."""
    with Conn(d.socket, timeout=timeout) as c:
        assert c.status()["daemon"]["pid"] == d.pid


def pad_request(op, rid, nbytes, **fields):
    """A request frame of exactly nbytes of JSON: fields plus a "pad" array of zeros.

    An array of single-digit numbers is the densest JSON there is (a tree node
    for every two bytes), so it costs the parser the most memory per byte.
    """
    head = {"op": op, "id": rid}
    head.update(fields)
    text = frame(head)[4:]
    prefix = text[:-1] + b',"pad":['
    room = nbytes - len(prefix) - 2
    assert room >= 1
    body = prefix + b"0," * ((room - 1) // 2) + b"0" + b" " * ((room - 1) % 2) + b"]}"
    assert len(body) == nbytes, (len(body), nbytes)
    return frame(body)


def leases_of(c):
    return c.status()["daemon"]["leases"]


class Flood:
    """A thread sending one frame over and over on a connection that never reads."""

    def __init__(self, conn, data, count):
        self.conn = conn
        self.sent = 0
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(data, count), daemon=True)
        self.thread.start()

    def _run(self, data, count):
        try:
            for _ in range(count):
                self.conn.sock.sendall(data)
                self.sent += 1
        except OSError as e:  # the test shut the socket down
            self.error = e

    def stop(self):
        try:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.thread.join(30)
        assert not self.thread.is_alive()
        self.conn.close()


@pytest.fixture(scope="module")
def huge_table(model_root):
    """A checkpoint whose attach reply (its tensor table) is over the 16 MiB frame limit.

    64,000 one-byte tensors with 200-byte names: about 17 MB of table.
    """
    tensors = [(f"layers.{i}." + "w" * 200, "U8", [1]) for i in range(64000)]
    return write_single(os.path.join(model_root, "huge-table"), tensors, seed=11)


# ---- 1. descriptors: queued replies hold a bounded number ------------------------


def test_unread_attach_replies_hold_bounded_descriptors(daemon, tiny):
    """A client pipelines thousands of attaches and never reads: every queued reply
    holds a descriptor, and max_queued_fds (default 64) bounds them; other
    clients are served throughout.

    Before: the daemon read on and queued one memfd per reply: 19,846
    descriptors here (22,000 in the report), up to RLIMIT_NOFILE."""
    with daemon.connect() as c:
        set_id = c.call("load", path=tiny["a"])["set"]
        base = daemon.fd_count()
        greedy = daemon.connect()
        flood = Flood(greedy, frame({"op": "attach", "set": set_id}), 20000)
        try:
            worst = base
            deadline = time.monotonic() + 3 * SLOW
            while time.monotonic() < deadline:
                worst = max(worst, daemon.fd_count())
                fresh_client_answers(daemon)
                time.sleep(0.05)
            worst = max(worst, daemon.fd_count())
            assert worst <= base + 64 + FD_SLACK, (
                f"the daemon's descriptors went from {base} to {worst} for one client's unread replies")
            assert flood.thread.is_alive(), "the flood ended: the daemon read every request of a client that never reads"
        finally:
            flood.stop()
        wait_until(lambda: daemon.fd_count() == base, timeout=10 * SLOW, what="descriptors back to the start")
        assert leases_of(c) == 0


def test_descriptors_are_counted_against_the_process_limit(start_daemon, tiny):
    """Several clients that never read, under a low RLIMIT_NOFILE: attaches past the
    process's budget are answered LIMIT, the daemon never runs out of descriptors,
    and a new client's hello is answered.

    Before: the unread replies took every descriptor (the limit here is 256),
    accept failed with EMFILE, and a new client got no answer."""
    d = start_daemon(nofile=(256, 256))
    with d.connect() as c:
        set_id = c.call("load", path=tiny["many"])["set"]
        floods = []
        try:
            for _ in range(6):
                floods.append(Flood(d.connect(), frame({"op": "attach", "set": set_id}), 400))
            deadline = time.monotonic() + 3 * SLOW
            worst = 0
            while time.monotonic() < deadline:
                worst = max(worst, d.fd_count())
                fresh_client_answers(d)
                time.sleep(0.1)
            assert worst < 256 - 16, f"the daemon used {worst} of its 256 descriptors"
            assert "Too many open files" not in d.log_text()
        finally:
            for f in floods:
                f.stop()
        fresh_client_answers(d)


# ---- 1, 3 and 5: a reply over a limit is LIMIT, echoes its id, leaves no lease -----


def test_unread_attaches_over_max_queued_fds_get_limit_and_no_lease(start_daemon, tiny):
    """max_queued_fds=4 and a client that reads nothing until it has sent 40
    attaches by path: they all finish together, when the set is loaded, so
    their replies pile up unread. Some are LIMIT (without a descriptor), the
    others carry one, and the client holds exactly as many leases as it got
    descriptors.

    Before: no limit; every attach got a descriptor (and a lease)."""
    d = start_daemon({"max_queued_fds": 4})
    with d.connect() as c:
        # Integer and string ids alternate: both must be echoed in a LIMIT reply.
        ids = [i if i % 2 else f"a{i}" for i in range(100, 140)]
        # A 37 KB reply each (400 tensors): the socket buffer holds only a few.
        c.send_raw(b"".join(frame({"op": "attach", "id": i, "path": tiny["many"]}) for i in ids))
        time.sleep(0.5 * SLOW)  # let the replies pile up unread
        ok = limited = 0
        for i in ids:
            m, fds = c.wait(i)
            for fd in fds:
                os.close(fd)
            if m.get("ok"):
                assert len(fds) == 1, m
                ok += 1
            else:
                assert m["error"]["code"] == "LIMIT" and not fds, m
                assert "max_queued_fds" in m["error"]["message"], m
                assert type(m["id"]) is type(i), m
                limited += 1
        assert limited > 0, "no attach was refused: the replies did not pile up"
        st = c.status()
        assert st["daemon"]["leases"] == ok, f"{ok} attaches succeeded but {st['daemon']['leases']} leases exist"
        assert st["sets"][0]["leases"] == ok


def test_reply_over_frame_limit_is_limit_for_integer_and_string_ids(daemon, huge_table):
    """An attach whose reply would be over 16 MiB is answered LIMIT, with its id
    echoed, integer or string; the connection stays open and no lease is created.

    Before: an integer id (what libweightd sends) closed the connection ("out of
    memory serialising a reply"); a string id got LIMIT but left a lease behind
    that its client never learnt of."""
    with daemon.connect() as c:
        set_id = c.call("load", path=huge_table)["set"]
        for rid in (4503599627370497, "huge"):
            m, fds = c.request("attach", id=rid, set=set_id)
            for fd in fds:
                os.close(fd)
            assert m.get("error", {}).get("code") == "LIMIT", m
            assert m["id"] == rid and type(m["id"]) is type(rid), m
            assert not fds
            st = c.status()  # the same connection still answers
            assert st["daemon"]["leases"] == 0, f"attach {rid!r} answered LIMIT left a lease: {st['sets']}"
            assert st["sets"][0]["leases"] == 0
        assert c.call("evict", set=set_id)["evicted"] == [set_id]


def test_weightctl_gets_limit_not_closed(start_daemon, tiny):
    """libweightd (integer ids) gets the LIMIT error for an over-limit reply.

    libweightd asks for the binary tensor table, so its attach replies stay
    small whatever the table's size; the limit they meet here is
    max_queued_fds, at 1, below the reply's two descriptors (slab and table).

    Before: weightctl failed with CLOSED."""
    d = start_daemon(settings={"max_queued_fds": 1})
    with d.connect() as c:
        set_id = c.call("load", path=tiny["a"])["set"]
        r = subprocess.run([WEIGHTCTL, "--socket", d.socket, "attach", set_id], capture_output=True,
                           text=True, timeout=60 * SLOW)
        assert r.returncode == 1, r
        assert "LIMIT" in r.stderr or "limit" in r.stderr, r.stderr
        assert "CLOSED" not in r.stderr and "closed" not in r.stderr, r.stderr
        assert leases_of(c) == 0


# ---- 2. out of descriptors at accept -----------------------------------------------


def test_descriptor_limit_is_raised_to_the_hard_limit(start_daemon):
    """The daemon raises RLIMIT_NOFILE's soft limit to the hard one at start.

    Before: it ran with the soft limit it was given (systemd's 1024)."""
    d = start_daemon(nofile=(256, 4096))
    with open(f"/proc/{d.pid}/limits") as f:
        line = next(x for x in f if x.startswith("Max open files"))
    assert line.split()[3:5] == ["4096", "4096"], line


def test_connections_leave_descriptors_for_the_daemons_work(start_daemon, tiny):
    """With RLIMIT_NOFILE at 64, at most 32 connections are served (a quarter of
    the limit, at least 64 or half, is kept for the daemon's own descriptors):
    the others get LIMIT, and a served client can still have a checkpoint
    opened and loaded (a shard and a slab) while every connection is taken.

    Before: the daemon accepted connections until accept failed with EMFILE
    (53 here), leaving none to open shards or create slabs; the first
    implementation of the limits still did (a connection storm made loads fail
    with "memfd_create: Too many open files")."""
    d = start_daemon(nofile=(64, 64))
    peers = []
    try:
        for _ in range(60):
            peers.append(Conn(d.socket, hello=False, timeout=20 * SLOW))
        served = []
        refused = 0
        for p in peers:
            try:
                p.send({"op": "hello", "id": 1, "protocol": 1})
            except OSError:
                pass  # refused and closed already: the refusal is still there to read
        for p in peers:
            try:
                m = p.recv_msg()
            except Closed:
                m = {}
            if m.get("ok"):
                served.append(p)
            else:
                assert m.get("error", {}).get("code") == "LIMIT", m
                refused += 1
        assert len(served) == 32 and refused == 28, (len(served), refused)
        c = served[0]
        assert c.call("load", path=tiny["c"], device=0)["set"]
        # A reply descriptor would take a connection's place: LIMIT, never a failure to create it.
        m, fds = c.request("attach", path=tiny["c"], device=0)
        for fd in fds:
            os.close(fd)
        assert m.get("ok") or m["error"]["code"] == "LIMIT", m
        assert "Too many open files" not in d.log_text()
    finally:
        for p in peers:
            p.close()
    fresh_client_answers(d)


def test_out_of_descriptors_at_accept_refuses_without_spinning(start_daemon, model_root):
    """More connections than descriptors: the extra peers get a LIMIT frame, the
    daemon does not spin (CPU over 3 s stays low), the episode is logged once,
    and once connections close a new client is served. (The daemon holds
    resident sets here, each with its shard and its slab, until a dozen
    descriptors are left, so that they run out before the connections reach
    the daemon's descriptor budget: 24 of 48.)

    Before: accept failed with EMFILE in a loop at 100% of a core, logging
    "accept: Too many open files" tens of thousands of times, and the waiting
    peers never got an answer."""
    limit = 48
    files = os.path.join(model_root, "many-files")
    os.makedirs(files, exist_ok=True)
    for i in range(limit):
        write_safetensors(os.path.join(files, f"f{i}.safetensors"), [("w", "F32", [4])], seed=i)
    d = start_daemon(nofile=(limit, limit))
    with d.connect() as c:
        for i in range(limit):
            if d.fd_count() >= limit - 11:  # c's own descriptor among them
                break
            c.call("load", path=os.path.join(files, f"f{i}.safetensors"))
    base = d.fd_count()
    assert limit - 12 <= base < limit - 4, base
    room = limit - base  # connections it can hold (its reserve descriptor is in base)
    peers = []
    try:
        for _ in range(room + 20):
            peers.append(Conn(d.socket, hello=False, timeout=20 * SLOW))
        cpu0 = d.cpu_seconds()
        time.sleep(3)
        cpu = d.cpu_seconds() - cpu0
        assert cpu < 0.5, f"the daemon used {cpu:.2f} s of CPU in 3 s while out of descriptors"
        served = refused = 0
        for p in peers:
            try:
                p.send({"op": "hello", "id": 1, "protocol": 1})
            except OSError:
                pass  # refused and closed already: the refusal is still there to read
            try:
                m = p.recv_msg()
            except Closed:
                m = {}
            if m.get("ok"):
                served += 1
            else:
                assert m.get("error", {}).get("code") == "LIMIT", m
                assert "id" not in m, m
                with pytest.raises(Closed):
                    p.recv_msg()
                refused += 1
        assert served + refused == len(peers)
        assert refused >= 10 and served >= 1, (served, refused)
        d.assert_alive()
        episodes = d.log_text().count("Too many open files")
        assert episodes == 1, f"the out-of-descriptors episode was logged {episodes} times"
    finally:
        for p in peers:
            p.close()
    wait_until(lambda: d.fd_count() <= base + 1, timeout=10 * SLOW, what="the connections to close")
    fresh_client_answers(d)
    assert "accepting again" in d.log_text()


# ---- 4. request memory -----------------------------------------------------------


def reset_peak(d):
    with open(f"/proc/{d.pid}/clear_refs", "w") as f:
        f.write("5")


@pytest.mark.skipif(ASAN, reason="the ASan allocator keeps freed memory in quarantine")
def test_large_request_leaves_no_memory_behind(daemon):
    """A request of max_request_bytes (4 MiB) of the densest JSON is answered; what
    parsing it took is given back.

    Before: three 4 MiB requests left 164 MiB resident (a 16 MiB one, 650 MB),
    with the first implementation as well."""
    with daemon.connect() as c:
        c.call("status")
        before = daemon.rss_anon_kib()
        for i in range(3):
            c.send_raw(pad_request("status", 70 + i, 4 * MiB))
            m = c.recv_msg()
            assert m.get("id") == 70 + i and m.get("ok") is True, m
        c.call("status")  # the request is freed right after its reply is queued: this reply comes after that
        grown = [0]

        # The bug kept 164 MiB. What stays after a trim depends on how fragmented the
        # parse threads' malloc arenas are: a bound of 16 MiB failed once on a loaded
        # machine; 48 MiB still fails on the bug by more than a factor of three.
        def given_back():
            grown[0] = daemon.rss_anon_kib() - before
            return grown[0] < 48 * 1024

        try:
            wait_until(given_back, timeout=5 * SLOW, what="the memory of large requests to be given back")
        except AssertionError:
            raise AssertionError(f"RssAnon stays {grown[0]} KiB above its value before three 4 MiB requests")


def test_request_memory_bounds_many_large_requests(start_daemon):
    """Eight connections pipeline sixteen 256 KiB requests each (the densest JSON):
    the daemon's peak memory stays within request_memory (64 MiB here) plus the
    frames being read (not measured under ASan), and another client's status is
    answered throughout.

    Before: no budget (a peak of 154 MiB here). The first implementation
    charged 32 bytes per request byte, under what parsing takes (a peak of
    106 MiB), and large requests could take the whole budget, so that a small
    status waited up to 9 s behind them."""
    budget = 64 * MiB
    req = 256 * 1024
    # frame_timeout_ms bounds a frame's wait for memory (then LIMIT); under ASan these requests wait longer.
    d = start_daemon({"request_memory": budget, "max_request_bytes": req, "frame_timeout_ms": 600000})
    with d.connect() as c:
        c.call("status")
        base = d.proc_status("VmRSS")
        reset_peak(d)
        conns = [d.connect() for _ in range(8)]
        for k in conns:
            # A socket's timeout bounds a whole sendall (4 MiB here, sent as the daemon takes it in): under
            # ASan on a busy machine that is more than a minute, and a sender that gave up midway would leave
            # its frame cut short.
            k.settimeout(600)
        data = b"".join(pad_request("status", i, req) for i in range(16))
        senders = [threading.Thread(target=k.sock.sendall, args=(data,)) for k in conns]
        for t in senders:
            t.start()
        worst = 0.0
        replies = [0] * len(conns)

        def drain(i, k):
            for _ in range(16):
                m = k.recv_msg()
                assert m.get("ok") is True, m
                replies[i] += 1

        readers = [threading.Thread(target=drain, args=(i, k)) for i, k in enumerate(conns)]
        for t in readers:
            t.start()
        while any(t.is_alive() for t in readers):
            t0 = time.monotonic()
            c.call("status")
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
        for t in senders + readers:
            t.join()
        assert replies == [16] * len(conns), replies
        peak = d.proc_status("VmHWM") - base
        frames = 8 * 2 * req // 1024  # each connection's read buffer and a frame held for memory
        if not ASAN:
            assert peak <= budget // 1024 + frames + 16 * 1024, f"peak grew by {peak} KiB for a {budget // MiB} MiB budget"
        assert worst < 5.0 * SLOW, f"a status waited {worst:.2f} s behind other clients' large requests"
        for k in conns:
            k.close()


def test_request_memory_freed_early_wakes_other_connections(start_daemon, tiny):
    """Loads drop their request text once planned. Memory freed that way must let
    connections waiting for request memory go on.

    Nine connections send a large load each, all read in one turn of the loop
    (the daemon is stopped while they are sent): request_memory (16 MiB) holds
    a few of them, the others wait for memory. Every one must be answered.

    Before (the first implementation): memory a load gave back early woke no
    one, and the waiting connections were never answered."""
    req = 64 * 1024
    d = start_daemon({"request_memory": 16 * MiB, "max_request_bytes": req})
    with d.connect() as c:
        c.call("load", path=tiny["b"])
    conns = [d.connect() for _ in range(9)]
    try:
        os.kill(d.pid, signal.SIGSTOP)
        try:
            for k in conns:
                k.send_raw(pad_request("load", "big", req - 4096, path=tiny["b"]))
        finally:
            os.kill(d.pid, signal.SIGCONT)
        for k in conns:
            k.settimeout(10 * SLOW)
            m, _ = k.wait("big")
            assert m.get("ok") is True, m
    finally:
        for k in conns:
            k.close()


@pytest.mark.skipif(ASAN, reason="the ASan allocator keeps freed memory in quarantine")
def test_requests_joining_a_load_hold_no_request_text(start_daemon, ckpt_sharded):
    """Requests that join a load in progress keep only their id while they wait.

    Four connections each send a 1 MiB load of the set being loaded (a parse
    tree of about 50 MiB each). Once each has had a progress event (it waits
    for the set), RssAnon comes back to within 32 MiB of its value before,
    while the load still runs.

    Before: each kept its whole request until the load ended (3 GiB for six
    16 MiB requests in the report; 156 MiB here). The first implementation
    freed it but left it resident."""
    d = start_daemon({"fill_threads": 1})
    with d.connect() as c, d.connect() as watcher:
        c.call("open", path=ckpt_sharded)
        c.call("status")
        before = d.rss_anon_kib()
        for attempt in range(3):
            c.start("load", id="first", path=ckpt_sharded)
            first, _ = c.recv()
            assert first.get("event") == "progress", first
            joiners = [d.connect() for _ in range(4)]
            for k in joiners:
                k.send_raw(pad_request("load", "join", 1 * MiB, path=ckpt_sharded))
            waiting = 0
            for k in joiners:
                m, _ = k.recv()
                assert m.get("id") == "join", m
                waiting += m.get("event") == "progress"

            def measured():
                grown = d.rss_anon_kib() - before
                loading = any(s["state"] == "loading" for s in watcher.status()["sets"])
                return (grown, loading) if grown < 32 * 1024 or not loading else None

            grown, loading = wait_until(measured, timeout=60 * SLOW, what="the load to end")
            assert c.wait("first")[0].get("ok") is True
            for k in joiners:
                m, _ = k.wait("join")
                assert m.get("ok") is True, m
                k.close()
            if waiting == len(joiners):
                break
            for st in c.status()["sets"]:  # a joiner found the set ready: not a measurement, again
                c.call("evict", set=st["set"])
        else:
            pytest.skip("each load ended before all four joiners waited")
        assert grown < 32 * 1024, f"RssAnon stayed {grown} KiB above its value while four requests waited"


# ---- 6. idle connections, reserved connections ----------------------------------------


def test_idle_connection_without_lease_is_closed(start_daemon, tiny):
    """idle_timeout_ms closes a connection with no lease and nothing in progress; one
    that holds a lease stays however long it is idle.

    Before: idle connections were never closed."""
    d = start_daemon({"idle_timeout_ms": 300})
    engine = d.connect()
    att, fd = engine.attach(path=tiny["a"], device=0)
    os.close(fd)
    idle = d.connect()
    silent = Conn(d.socket, hello=False)
    t0 = time.monotonic()
    assert idle.expect_closed(10 * SLOW) == []
    assert silent.expect_closed(10 * SLOW) == []
    assert time.monotonic() - t0 >= 0.25
    time.sleep(1.0)  # more than three idle timeouts
    st = engine.status()
    assert st["daemon"]["leases"] == 1 and st["sets"][0]["leases"] == 1
    # Without its lease, the engine's connection is idle like any other.
    engine.call("release", lease=att["lease"])
    assert engine.expect_closed(10 * SLOW) == []
    for k in (engine, idle, silent):
        k.close()


def hold_request_memory(d, set_id, nbytes, holders=4):
    """Connections that each hold one queued request of nbytes while the set loads.

    Each sends 16 attaches of the loading set (CONN_MAX_INFLIGHT: they wait and,
    waiting, hold no request memory), then a padded status that queues behind
    them, its memory charged until one of them ends. Returns the connections.
    """
    conns = []
    for _ in range(holders):  # each connects just before it sends: an idle one would be closed
        k = d.connect()
        for i in range(16):
            k.send({"op": "attach", "id": f"A{i}", "set": set_id})
        k.send_raw(pad_request("status", "Q", nbytes))
        sync(k)
        conns.append(k)
    return conns


def finish_holders(holders):
    """Waits for every request of hold_request_memory's connections and closes them."""
    for k in holders:
        for i in range(16):
            m, fds = k.wait(f"A{i}")
            for fd in fds:
                os.close(fd)
            assert m.get("ok") is True, m
        assert k.wait("Q")[0].get("ok") is True
        k.close()


@pytest.fixture
def gate(workdir):
    import tempfile

    from test_early_attach import Gate

    g = Gate(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    yield g
    g.open()


def test_waiting_requests_hold_no_request_memory(start_daemon, tiny, gate):
    """Requests that wait for a set hold no request memory: four connections
    whose large requests wait cannot keep a fifth client's status from being
    answered.

    A load waits at the test gate. A connection sends a 60 KiB load of it (it
    joins the load), four others an attach of the loading set each, 60 KiB
    (charged 3.75 MiB, 15 MiB of the 16 MiB of request_memory together). A
    sixth connection's status of 32 KiB (2 MiB) must be answered ok while they
    all wait.

    Before: an attach by set id kept its whole request while it waited, so the
    four held 15 MiB and the status waited until the load ended (here: for
    ever, the gate is closed and frame_timeout_ms long)."""
    req = 64 * 1024
    d = start_daemon({"request_memory": 16 * MiB, "max_request_bytes": req, "frame_timeout_ms": 600000,
                      "test_load_gate": gate.path})
    with d.connect() as c:
        c.start("load", id="L", path=tiny["a"])
        set_id = wait_until(lambda: [s["set"] for s in c.status()["sets"] if s["state"] == "loading"],
                            timeout=30 * SLOW, what="the load to start")[0]
        waiters = []
        k = d.connect()
        k.send_raw(pad_request("load", "J", req - 4096, path=tiny["a"]))
        sync(k)
        waiters.append((k, "J"))
        for rid in ("A1", "A2", "A3", "A4"):
            k = d.connect()
            k.send_raw(pad_request("attach", rid, req - 4096, set=set_id))
            sync(k)
            waiters.append((k, rid))
        with Conn(d.socket, timeout=30 * SLOW) as late:
            late.send_raw(pad_request("status", "S", 32 * 1024))
            m, _ = late.wait("S")
            assert m.get("ok") is True, m
            assert [s["state"] for s in m["sets"]] == ["loading"], m["sets"]
        gate.open()
        assert c.wait("L")[0].get("ok") is True
        for k, rid in waiters:
            m, fds = k.wait(rid)
            for fd in fds:
                os.close(fd)
            assert m.get("ok") is True, m
            k.close()


def test_request_waiting_for_memory_is_not_idle(start_daemon, tiny, gate):
    """A connection whose request waits for request memory is not idle: it is
    answered once memory frees, however long past idle_timeout_ms that is.

    Four connections each queue a status of 60 KiB behind 16 attaches of a set
    held at the test gate: together they hold most of request_memory (16 MiB);
    a fifth connection's small status is answered, then its large one waits
    for their memory until the gate opens (after more than three idle
    timeouts).

    Before (the first implementation): a request held back for memory did not
    count as in progress, and its connection was closed as idle."""
    req = 64 * 1024
    d = start_daemon({"request_memory": 16 * MiB, "max_request_bytes": req, "idle_timeout_ms": 300,
                      "frame_timeout_ms": 600000, "test_load_gate": gate.path})
    with d.connect() as c:
        c.start("load", id="L", path=tiny["a"])
        set_id = wait_until(lambda: [s["set"] for s in c.status()["sets"] if s["state"] == "loading"],
                            timeout=30 * SLOW, what="the load to start")[0]
        holders = hold_request_memory(d, set_id, req - 4096)
        late = d.connect()
        late.send_raw(frame({"op": "status", "id": "small"}) + pad_request("status", "big", req - 4096))
        assert late.wait("small")[0].get("ok") is True
        time.sleep(1.0)  # more than three idle timeouts
        assert [s["state"] for s in c.status()["sets"]] == ["loading"]
        gate.open()
        late.settimeout(60 * SLOW)
        m, _ = late.wait("big")
        assert m.get("ok") is True, m
        assert c.wait("L")[0].get("ok") is True
        finish_holders(holders)
        late.close()


def test_request_waiting_for_memory_gets_limit_after_frame_timeout(start_daemon, tiny, gate):
    """Waiting for request memory is bounded: a frame that gets none within
    frame_timeout_ms is answered LIMIT with its id, and its connection goes on.

    Four connections each hold 3.75 MiB of request_memory (16 MiB) with a
    queued 60 KiB status behind attaches of a set held at the test gate; a
    fifth connection's statuses of 32 KiB (2 MiB), integer id, and then one
    with a string id, are answered LIMIT, and the next is answered once
    memory frees.

    Before: the status waited, unanswered, until the gate opened (for ever)."""
    req = 64 * 1024
    d = start_daemon({"request_memory": 16 * MiB, "max_request_bytes": req, "frame_timeout_ms": 500,
                      "test_load_gate": gate.path})
    with d.connect() as c:
        c.start("load", id="L", path=tiny["a"])
        set_id = wait_until(lambda: [s["set"] for s in c.status()["sets"] if s["state"] == "loading"],
                            timeout=30 * SLOW, what="the load to start")[0]
        holders = hold_request_memory(d, set_id, req - 4096)
        with Conn(d.socket, timeout=60 * SLOW) as late:
            late.send_raw(pad_request("status", 7, 32 * 1024) + pad_request("status", "s", 32 * 1024))
            for rid in (7, "s"):
                m, fds = late.recv()
                assert m.get("id") == rid and m["error"]["code"] == "LIMIT" and not fds, m
            gate.open()
            assert c.wait("L")[0].get("ok") is True
            finish_holders(holders)
            late.send_raw(pad_request("status", "after", 32 * 1024))
            assert late.wait("after")[0].get("ok") is True


# ---- 7. SIGHUP -------------------------------------------------------------------------


def test_sighup_never_kills(daemon, tiny):
    """SIGHUP leaves the daemon running, its socket in place and its leases held.

    Before: the daemon died of it (status 129), leaving the socket file behind."""
    with daemon.connect() as c:
        att, fd = c.attach(path=tiny["a"], device=0)
        os.close(fd)
        for _ in range(3):
            daemon.proc.send_signal(signal.SIGHUP)
            time.sleep(0.1)
        daemon.assert_alive()
        assert os.path.exists(daemon.socket)
        st = c.status()
        assert st["daemon"]["leases"] == 1
        fresh_client_answers(daemon)
    assert "SIGHUP" in daemon.log_text()


def test_reload_applies_the_frame_limit_to_connections_open_before_it(start_daemon, workdir):
    """A reload that lowers max_request_bytes applies to connections opened
    before it too: their next longer frame is refused from its length prefix
    (PROTOCOL, closed), as a new connection's is.

    Before: a connection kept the limit of the configuration it was accepted
    under; its 512 KiB request, charged 32 MiB against a quarter of the new
    16 MiB request_memory, waited for memory that could never be enough."""
    import json

    config = os.path.join(workdir, "frame-reload.json")

    def write_config(**keys):
        with open(config + ".tmp", "w") as f:
            json.dump(keys, f)
        os.replace(config + ".tmp", config)

    write_config(max_request_bytes=1 * MiB, request_memory=256 * MiB)
    d = start_daemon(config=config)
    with d.connect() as old:
        old.send_raw(pad_request("status", "before", 512 * 1024))
        assert old.wait("before")[0].get("ok") is True
        write_config(max_request_bytes=64 * 1024, request_memory=16 * MiB)
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "SIGHUP: reloading" in d.log_text(), timeout=10 * SLOW, what="the reload")
        assert old.status()["daemon"]["pid"] == d.pid  # read after the reload: the loop handled the signal
        for k in (old, d.connect()):
            k.settimeout(10 * SLOW)
            try:
                k.send_raw(pad_request("status", "big", 512 * 1024))
            except BrokenPipeError:  # refused from the length prefix, closed before the rest was sent
                pass
            m, _ = k.recv()
            assert m.get("error", {}).get("code") == "PROTOCOL", m
            assert k.expect_closed(10 * SLOW) == []
            k.close()
    d.check_serving()


# ---- 8. a reply describes the state at the time it is sent ------------------------------


def test_canceled_load_is_never_listed_as_loading(start_daemon, ckpt_small):
    """Thirty load/cancel races: once a load is answered CANCELED, status (sent after
    that reply) lists its set as gone or "canceling", never "loading".

    Before: the set was listed as "loading" until its job returned."""
    d = start_daemon({"fill_threads": 1})
    seen = {"canceled": 0, "listed": 0}
    with d.connect() as c:
        c.call("open", path=ckpt_small)
        for i in range(30):
            rid = f"L{i}"
            c.start("load", id=rid, path=ckpt_small)
            time.sleep((i % 6) * 0.02)
            c.call("cancel", target=rid)
            m, _ = c.wait(rid)
            st = c.status()
            mine = [s for s in st["sets"] if s["path"] == ckpt_small]
            if m.get("error", {}).get("code") == "CANCELED":
                seen["canceled"] += 1
                seen["listed"] += bool(mine)
                assert all(s["state"] == "canceling" for s in mine), f"round {i}: after CANCELED, {mine}"
            else:
                assert m.get("ok") is True, m
            wait_until(lambda: not [s for s in c.status()["sets"] if s["state"] != "ready"],
                       timeout=30 * SLOW, what="the canceled load to stop")
            for s in c.status()["sets"]:
                c.call("evict", set=s["set"])
        assert seen["canceled"] >= 10, seen


# ---- 9. request ids are compared exactly ------------------------------------------------


BIG = 1 << 52


def test_cancel_matches_integer_ids_exactly_in_progress(daemon, tiny):
    """Two loads in progress with ids 2^52+2 and 2^52+1; cancel 2^52+2 cancels that one.

    Before: ids were compared with a floating-point tolerance, and the cancel
    stopped 2^52+1 (the newer request, found first)."""
    with daemon.connect() as c:
        c.send_raw(frame({"op": "load", "id": BIG + 2, "path": tiny["c"]}) +
                   frame({"op": "load", "id": BIG + 1, "path": tiny["c"]}) +
                   frame({"op": "cancel", "id": "C", "target": BIG + 2}))
        rc, _ = c.wait("C")
        assert rc.get("canceled") is True, rc
        a, _ = c.wait(BIG + 2)
        b, _ = c.wait(BIG + 1)
        assert a.get("error", {}).get("code") == "CANCELED", a
        assert b.get("ok") is True, b


def test_cancel_matches_integer_ids_exactly_in_queue(daemon, tiny):
    """Sixteen loads fill the connection; 2^52+1 and 2^52+2 wait in its queue;
    cancel 2^52+2 takes exactly that one out. A string id never matches an
    integer one.

    Before: the queue was searched with the same tolerance, and 2^52+1 (queued
    first) was canceled instead."""
    with daemon.connect() as c:
        busy = [frame({"op": "load", "id": i, "path": tiny["c"]}) for i in range(16)]
        c.send_raw(b"".join(busy) +
                   frame({"op": "load", "id": BIG + 1, "path": tiny["c"]}) +
                   frame({"op": "load", "id": BIG + 2, "path": tiny["c"]}) +
                   frame({"op": "cancel", "id": "C", "target": BIG + 2}) +
                   frame({"op": "cancel", "id": "S", "target": str(BIG + 1)}))
        rc, _ = c.wait("C")
        assert rc.get("canceled") is True, rc
        rs, _ = c.wait("S")
        assert rs.get("canceled") is False, rs
        a, _ = c.wait(BIG + 1)
        b, _ = c.wait(BIG + 2)
        assert a.get("ok") is True, a
        assert b.get("error", {}).get("code") == "CANCELED", b
        for i in range(16):
            assert c.wait(i)[0].get("ok") is True


# ---- 10. unread replies across connections: the daemon's budget and one uid's share ------
#
# Replies queued for clients that never read were bounded per connection
# (max_queued_output) and in nothing else: a uid could hold that much on every
# connection it may open (~62 GiB with the defaults). The replies here are
# attaches of a checkpoint of 9,000 tensors by set id, about 1 MB of JSON
# tensor table each, several times what the kernel's socket buffer holds, so
# most of each waits in the daemon's queue while its client does not read.

WIDE_TENSORS = 9000
NOBODY = 65534


@pytest.fixture(scope="module")
def public_wide():
    """A model root other users can read, holding the wide checkpoint: {"root", "path"}."""
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="wdpub-")
    os.chmod(root, 0o755)
    path = os.path.join(root, "wide")
    os.makedirs(path)
    os.chmod(path, 0o755)
    write_safetensors(os.path.join(path, "model.safetensors"),
                      [(f"layers.{i}.mlp.experts.gate_up_proj.weight", "U8", [1]) for i in range(WIDE_TENSORS)],
                      seed=21)
    os.chmod(os.path.join(path, "model.safetensors"), 0o644)
    yield {"root": root, "path": path}
    shutil.rmtree(root, ignore_errors=True)


def metric_value(st, name, **labels):
    """A sample of a metrics family in a status reply (0 when the family has no such sample)."""
    for s in st["metrics"].get(name, {}).get("samples", []):
        if all(s["labels"].get(k) == v for k, v in labels.items()):
            return s["value"]
    return 0


def queued(st):
    return metric_value(st, "weightd_reply_bytes_queued")


def hung_up(conn):
    """Whether the daemon closed its end of conn (seen without reading what is still buffered)."""
    import select

    p = select.poll()
    p.register(conn.sock, select.POLLRDHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))


class Observer:
    """A root connection that reads its replies, and counts the requests it sent since it started."""

    def __init__(self, d):
        self.c = d.connect()
        self.reset()

    def reset(self):
        """Counts from now on."""
        self.first = self.c.status()
        self.calls = 1

    def status(self):
        self.calls += 1
        return self.c.status()

    def started_since(self, st):
        """Requests started by everyone else since this observer began."""
        return metric_value(st, "weightd_requests_total") - metric_value(self.first, "weightd_requests_total") - (
            self.calls - 1)

    def close(self):
        self.c.close()


def check_wide_attach(m, sid):
    assert m.get("ok") is True, str(m)[:300]
    assert m["set"] == sid and m["tensor_count"] == WIDE_TENSORS and len(m["tensors"]) == WIDE_TENSORS, str(m)[:300]


class NobodyHoarders:
    """n connections of uid nobody, in a forked child, each sending one attach of set sid and reading nothing
    until finish(); finish() reads every connection to its reply or EOF and returns, per connection,
    {"reply": the final reply or None, "eof": whether the daemon closed it}."""

    def __init__(self, sock, n, sid):
        self.r, w = os.pipe()
        go_r, self.go_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: never returns into pytest
            code = 0
            try:
                os.close(self.r)
                os.close(self.go_w)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                conns = [Conn(sock, timeout=60, client=f"nobody-{i}") for i in range(n)]
                for i, c in enumerate(conns):
                    c.send({"op": "attach", "id": f"N{i}", "set": sid})
                os.write(w, b"s")
                os.read(go_r, 1)
                out = []
                for i, c in enumerate(conns):
                    try:
                        m, fds = c.wait(f"N{i}")
                        for fd in fds:
                            os.close(fd)
                        if m.get("ok"):
                            m = {"ok": True, "set": m["set"], "tensor_count": m["tensor_count"],
                                 "tensors": len(m["tensors"])}
                        out.append({"reply": m, "eof": False})
                    except Closed:
                        out.append({"reply": None, "eof": True})
                os.write(w, json.dumps(out).encode())
            except BaseException as e:  # report, never raise into the parent's test
                os.write(w, json.dumps({"child_error": repr(e)}).encode())
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        os.close(go_r)
        assert os.read(self.r, 1) == b"s", "the nobody child failed before sending its attaches"

    def finish(self):
        os.write(self.go_w, b"g")
        os.close(self.go_w)
        data = b""
        while True:
            chunk = os.read(self.r, 1 << 16)
            if not chunk:
                break
            data += chunk
        os.close(self.r)
        _, status = os.waitpid(self.pid, 0)
        got = json.loads(data)
        assert status == 0 and isinstance(got, list), got
        return got


def as_nobody_reader(sock, sid):
    """A client of uid nobody that reads its replies: hello, status, attach, status, all answered rightly."""
    from test_peers import as_nobody

    got = as_nobody(sock, [{"op": "hello", "id": 1, "protocol": 1}, {"op": "status", "id": 2},
                           {"op": "attach", "id": 3, "set": sid}, {"op": "status", "id": 4}])
    by_id = {m.get("id"): m for m in got}
    assert not any(m.get("eof") for m in got), ("the reading client of another uid was closed", str(got)[:500])
    assert by_id[1].get("ok") is True and by_id[2].get("ok") is True and by_id[4].get("ok") is True, str(got)[:500]
    check_wide_attach(by_id[3], sid)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")


@needs_root
def test_unread_replies_of_many_connections_stay_within_max_total_queued_output(start_daemon, public_wide):
    """Sixteen root connections each send an attach (a 1 MB reply) and never
    read, under max_total_queued_output=4MiB: the daemon's queued replies stay
    within it at every look, the connections holding the most are closed (their
    sockets see EOF, counted in weightd_reply_disconnects_total{limit="total"}
    and logged with pid, uid, client and bytes), and a client of another uid
    (nobody) that reads its replies gets every answer right throughout, its
    1 MB attach included.

    Before: nothing bounded the total: sixteen connections queued about 13 MB
    (each within its own max_queued_output) and none was closed."""
    budget = 4 * MiB
    d = start_daemon({"max_total_queued_output": "4MiB", "allowed_uids": str(NOBODY), "socket_mode": "0666"},
                     public=True, roots=[public_wide["root"]])
    obs = Observer(d)
    hoarders = []
    try:
        sid = obs.c.call("load", path=public_wide["path"])["set"]
        worst = 0
        for i in range(16):
            hoarders.append(Conn(d.socket, client=f"hoarder-{i}"))
        obs.reset()
        for i, h in enumerate(hoarders):
            h.send({"op": "attach", "id": f"H{i}", "set": sid})
            if i % 4 == 3:
                st = wait_until(lambda: (lambda s: s if obs.started_since(s) >= i + 1 else None)(obs.status()),
                                timeout=30 * SLOW, what="the hoarders' attaches to start")
                worst = max(worst, queued(st))
                as_nobody_reader(d.socket, sid)
                worst = max(worst, queued(obs.status()))
        assert worst <= budget, f"{worst} reply bytes queued, over max_total_queued_output ({budget})"
        obs.status()  # a status counts the closes made for the replies queued before its own
        n = metric_value(obs.status(), "weightd_reply_disconnects_total", limit="total")
        assert n > 0, "no connection was closed: the budget did not bind"
        closed = wait_until(lambda: (lambda got: got if len(got) == n else None)(
            [i for i, h in enumerate(hoarders) if hung_up(h)]), timeout=10 * SLOW, what=f"{n} hoarders to see EOF")
        log = d.log_text()
        for i in closed:
            assert f"uid 0 (client 'hoarder-{i}')" in log, log[-3000:]
        for i, h in enumerate(hoarders):
            if i in closed:
                h.expect_closed(10 * SLOW)
            else:
                m, fds = h.wait(f"H{i}")
                for fd in fds:
                    os.close(fd)
                check_wide_attach(m, sid)
        assert queued(obs.status()) == 0
        as_nobody_reader(d.socket, sid)
    finally:
        for h in hoarders:
            h.close()
        obs.close()


def test_the_connections_holding_the_most_unread_replies_are_closed_first(start_daemon, workdir, public_wide):
    """Four connections hold 1, 2, 3 and 4 unread attach replies (1 MB each);
    then max_total_queued_output is lowered by reload, each time just under what
    they hold, and a reply of a client that reads is queued: each time exactly
    the connection holding the most is closed (4, then 3, then 2), the others
    stay open, and the last one still gets its reply, whole; the closed
    connections' leases, sockets and queued descriptors are all freed.

    Before: no connection was ever closed for the total."""
    config = os.path.join(workdir, "output-budget.json")

    def reload(**keys):
        with open(config + ".tmp", "w") as f:
            json.dump(keys, f)
        os.replace(config + ".tmp", config)
        n = d.log_text().count("key(s) applied")
        d.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: d.log_text().count("key(s) applied") > n, timeout=10 * SLOW, what="the reload")

    with open(config, "w") as f:
        json.dump({"max_total_queued_output": "1GiB"}, f)
    d = start_daemon(config=config, roots=[public_wide["root"]])
    obs = Observer(d)
    hoarders = []
    try:
        sid = obs.c.call("load", path=public_wide["path"])["set"]
        base_fds = d.fd_count()
        for k in range(1, 5):
            h = Conn(d.socket, client=f"hoarder-{k}")
            h.send_raw(b"".join(frame({"op": "attach", "id": f"H{k}.{j}", "set": sid}) for j in range(k)))
            hoarders.append(h)
        wait_until(lambda: obs.status()["daemon"]["leases"] == 1 + 2 + 3 + 4, timeout=30 * SLOW,
                   what="every attach to be answered")
        for k in (4, 3, 2):
            total = queued(obs.status())
            reload(max_total_queued_output=int(total) - 1)
            obs.status()  # its reply needs room
            wait_until(lambda: hung_up(hoarders[k - 1]), timeout=10 * SLOW, what=f"hoarder-{k} to be closed")
            assert [hung_up(h) for h in hoarders] == [j >= k for j in range(1, 5)], f"closing for hoarder-{k}"
            assert queued(obs.status()) < total
            line = [ln for ln in d.log_text().splitlines() if f"(client 'hoarder-{k}')" in ln]
            assert len(line) == 1 and "uid 0" in line[0] and "max_total_queued_output" in line[0], line
        st = obs.status()
        assert metric_value(st, "weightd_reply_disconnects_total", limit="total") == 3
        assert st["daemon"]["leases"] == 1  # the closed connections' leases are released
        for h in hoarders[1:]:
            h.expect_closed(10 * SLOW)
        m, fds = hoarders[0].wait("H1.0")
        for fd in fds:
            os.close(fd)
        check_wide_attach(m, sid)
        hoarders[0].close()
        # What the closed connections' replies held is freed: their sockets and the descriptors queued in them.
        wait_until(lambda: d.fd_count() == base_fds, timeout=10 * SLOW, what="the descriptors to be back to the start")
        assert queued(obs.status()) == 0
    finally:
        for h in hoarders:
            h.close()
        obs.close()


@needs_root
def test_one_uid_holds_at_most_its_share_of_queued_replies(start_daemon, public_wide):
    """max_uid_queued_output=2MiB: six connections of uid nobody each send an
    attach (a 1 MB reply) and never read. Their replies queue until the uid's
    share would pass: the rest are answered LIMIT, naming the share, and hold no
    lease. A root connection that never reads is exempt (it holds more than
    the share), and a root client that reads is answered rightly.

    Before: the uid had no share: all six replies queued (about 5 MB)."""
    share = 2 * MiB
    d = start_daemon({"max_uid_queued_output": "2MiB", "allowed_uids": str(NOBODY), "socket_mode": "0666"},
                     public=True, roots=[public_wide["root"]])
    obs = Observer(d)
    root_hoarder = None
    try:
        sid = obs.c.call("load", path=public_wide["path"])["set"]
        obs.reset()

        def answered(n):
            """A status once n requests of the others were started and every one was answered."""
            st = obs.status()
            done = obs.started_since(st) >= n and metric_value(st, "weightd_requests_in_flight") <= 1
            return st if done else None

        nobody = NobodyHoarders(d.socket, 6, sid)
        st = wait_until(lambda: answered(6 + 6), timeout=30 * SLOW, what="the six attaches to be answered")
        assert queued(st) <= share, f"uid nobody holds {queued(st)} reply bytes, over its share ({share})"
        nobody_leases = st["daemon"]["leases"]
        # Root is exempt from the share: three unread replies, all queued.
        root_hoarder = Conn(d.socket, client="root-hoarder")
        root_hoarder.send_raw(b"".join(frame({"op": "attach", "id": f"R{j}", "set": sid}) for j in range(3)))
        st = wait_until(lambda: answered(12 + 1 + 3), timeout=30 * SLOW, what="root's attaches to be answered")
        assert st["daemon"]["leases"] == nobody_leases + 3, "root's replies were limited by a share"
        assert queued(st) > share
        m, fds = obs.c.request("attach", set=sid)
        for fd in fds:
            os.close(fd)
        check_wide_attach(m, sid)
        got = nobody.finish()
        assert not any(g["eof"] for g in got), got
        ok = [g["reply"] for g in got if g["reply"].get("ok")]
        limited = [g["reply"] for g in got if not g["reply"].get("ok")]
        assert len(ok) == nobody_leases and ok and limited, got
        for m in ok:
            assert m["tensor_count"] == WIDE_TENSORS and m["tensors"] == WIDE_TENSORS, m
        for m in limited:
            assert m["error"]["code"] == "LIMIT" and "max_uid_queued_output" in m["error"]["message"], m
        for j in range(3):
            m, fds = root_hoarder.wait(f"R{j}")
            for fd in fds:
                os.close(fd)
            check_wide_attach(m, sid)
    finally:
        if root_hoarder is not None:
            root_hoarder.close()
        obs.close()
