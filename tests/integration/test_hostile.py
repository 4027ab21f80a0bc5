"""Hostile and broken clients. After each one a normal request on a new
connection must succeed, and the daemon must still be alive.

One daemon serves the module's cases (frame_timeout_ms=500,
max_queued_output=1MiB), so that damage a case leaves behind shows in the
cases after it; it must exit cleanly at the end. A case that kills it fails,
and the next case gets a fresh daemon.
"""
import os
import random
import socket
import struct
import threading
import time

import pytest

from conftest import SLOW, Daemon, _failed
from wdclient import MAX_FRAME, Closed, Conn, frame, wait_until

FRAME_TIMEOUT_MS = 500


class ModuleDaemon:
    """The module's daemon; replaced by a fresh one if a test killed it."""

    def __init__(self, workdir, model_root):
        self.args = (workdir, model_root)
        self.d = None

    def start(self):
        self.d = Daemon(*self.args, settings={"frame_timeout_ms": FRAME_TIMEOUT_MS, "max_queued_output": "1MiB"})
        self.d.start()
        return self.d


@pytest.fixture(scope="module")
def hd(workdir, model_root, binaries, tiny, outside_dir):
    m = ModuleDaemon(workdir, model_root)
    m.start()
    yield m
    try:
        m.d.stop()
    finally:
        m.d.kill()


@pytest.fixture
def daemon_ok(hd, request):
    """The module's daemon, checked alive and serving after the test.

    A test that kills the daemon fails here, at its own teardown; the next test
    gets a fresh daemon, so one crash is reported once.
    """
    if not hd.d.alive():
        hd.d.kill()
        hd.start()
    d = hd.d
    yield d
    if _failed(request):
        print(f"---- log of weightd (pid {d.pid}) ----\n{d.log_tail(60)}")
    d.check_serving()


def closed_with(c, codes, timeout=5.0 * SLOW):
    """The connection gets exactly one error frame with a code in codes, then EOF."""
    got = c.expect_closed(timeout)
    assert len(got) == 1, got
    assert "error" in got[0], got
    assert got[0]["error"]["code"] in codes, got
    return got[0]


def one_reply(c):
    return c.recv_msg()


# ---- framing ---------------------------------------------------------------------


@pytest.mark.parametrize("hello", [False, True])
def test_garbage_bytes(daemon_ok, hello):
    c = daemon_ok.connect(hello=hello)
    c.send_raw(b"GET / HTTP/1.1\r\nHost: weightd\r\n\r\n")
    err = closed_with(c, {"PROTOCOL"})
    assert "id" not in err
    c.close()


def test_random_binary_garbage(daemon_ok):
    """Random bytes, then end of input: whatever comes back is an error, then EOF."""
    rnd = random.Random(7)
    for i in range(40):
        c = daemon_ok.connect(hello=bool(i % 2))
        c.send_raw(rnd.randbytes(rnd.randrange(1, 4096)))
        c.sock.shutdown(socket.SHUT_WR)
        got = c.expect_closed(5 * SLOW)
        assert len(got) <= 1, got
        for m in got:
            assert "error" in m and m["error"]["code"] in ("PROTOCOL", "BAD_REQUEST"), m
        c.close()
    daemon_ok.check_serving()


@pytest.mark.parametrize("length", [MAX_FRAME + 1, 0x7FFFFFFF, 0xFFFFFFFF])
def test_length_prefix_over_limit(daemon_ok, length):
    c = daemon_ok.connect()
    t0 = time.monotonic()
    c.send_raw(struct.pack("<I", length))  # no body: refused on the prefix alone
    closed_with(c, {"PROTOCOL", "LIMIT"})
    assert time.monotonic() - t0 < 2.0 * SLOW


MAX_REQUEST = 4 << 20  # max_request_bytes' default


def test_request_of_exactly_the_limit_is_served(daemon_ok):
    c = daemon_ok.connect()
    head = b'{"op":"status","id":77,"pad":"'
    tail = b'"}'
    body = head + b"x" * (MAX_REQUEST - len(head) - len(tail)) + tail
    assert len(body) == MAX_REQUEST
    c.send_raw(frame(body))
    m = one_reply(c)
    assert m.get("id") == 77 and m.get("ok") is True, m
    assert c.call("status")["daemon"]["pid"] == daemon_ok.pid
    c.close()


def test_request_over_the_limit_is_refused_from_its_prefix(daemon_ok):
    c = daemon_ok.connect()
    # Only the 4-byte prefix is sent: the daemon refuses before any of the body arrives.
    c.send_raw(struct.pack("<I", MAX_REQUEST + 1))
    closed_with(c, {"PROTOCOL"})
    assert daemon_ok.status()["daemon"]["pid"] == daemon_ok.pid


@pytest.mark.parametrize("hello", [False, True])
def test_zero_length_frame(daemon_ok, hello):
    c = daemon_ok.connect(hello=hello)
    c.send_raw(struct.pack("<I", 0))
    closed_with(c, {"PROTOCOL"})


@pytest.mark.parametrize("cut", [2, 4, 9])
def test_frame_cut_then_close(daemon_ok, cut):
    c = daemon_ok.connect()
    c.send_raw(frame({"op": "status", "id": 1})[:cut])
    c.close()


def test_request_before_hello(daemon_ok):
    for op in ("status", "load", "shutdown", "open"):
        c = daemon_ok.connect(hello=False)
        c.send({"op": op, "id": 3, "path": "/x"})
        err = closed_with(c, {"PROTOCOL"})
        assert err["id"] == 3
    daemon_ok.assert_alive()


def test_invalid_json_before_hello_closes(daemon_ok):
    c = daemon_ok.connect(hello=False)
    c.send_raw(frame(b'{"op":"hello",'))
    closed_with(c, {"BAD_REQUEST", "PROTOCOL"})


def test_protocol_version_99(daemon_ok):
    c = daemon_ok.connect(hello=False)
    m, _ = c.request("hello", protocol=99)
    assert m["error"]["code"] == "VERSION", m
    # Still no hello: anything else is a protocol error, but hello may be retried.
    c2 = daemon_ok.connect(hello=False)
    m, _ = c2.request("hello", protocol=99)
    assert m["error"]["code"] == "VERSION"
    assert c2.call("hello", protocol=1)["protocol"] == 1
    assert c2.status()["daemon"]["pid"] == daemon_ok.pid
    c2.close()
    m, _ = c.request("status")
    assert m["error"]["code"] == "PROTOCOL"
    c.expect_closed()


# ---- malformed requests after hello: answered, and the connection stays usable ----


BAD_BODIES = [
    (b'{"op":', "BAD_REQUEST", None),
    (b'{"op":"status",}', "BAD_REQUEST", None),
    (b"[1,2,3]", "BAD_REQUEST", None),
    (b'"status"', "BAD_REQUEST", None),
    (b"null", "BAD_REQUEST", None),
    (b'{"op":"frobnicate","id":5}', "BAD_REQUEST", 5),
    (b'{"id":6}', "BAD_REQUEST", 6),
    (b'{"op":7,"id":7}', "BAD_REQUEST", 7),
    (b'{"op":null,"id":"eight"}', "BAD_REQUEST", "eight"),
    (b'{"op":["status"],"id":9}', "BAD_REQUEST", 9),
    (b'{"op":"status","op":"shutdown","id":10}', "BAD_REQUEST", None),
    (b'{"op":"st\\u0000atus","id":11}', "BAD_REQUEST", None),
    (b'{"op":"status","id":"\xff\xfe"}', "BAD_REQUEST", None),
    (b'{"op":"status","id":9007199254740992}', "BAD_REQUEST", None),
    (b'{"op":"status","id":1.5}', "BAD_REQUEST", None),
    (b'{"op":"status","id":{"a":1}}', "BAD_REQUEST", None),
    (b'{"op":"status","id":"' + b"i" * 129 + b'"}', "BAD_REQUEST", None),
    (b'{"op":"status","id":12,"x":' + b"[" * 100000 + b"]" * 100000 + b"}", "BAD_REQUEST", None),
    (b'{"op":"status","id":13,"x":' + b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"}", "BAD_REQUEST", None),
    (b'{"op":"status","id":14}  x', "BAD_REQUEST", None),
]


@pytest.mark.parametrize("body,code,rid", BAD_BODIES, ids=[f"body{i}" for i in range(len(BAD_BODIES))])
def test_malformed_request(daemon_ok, body, code, rid):
    c = daemon_ok.connect()
    c.send_raw(frame(body))
    m = one_reply(c)
    assert "error" in m and m["error"]["code"] == code, m
    if rid is not None:
        assert m.get("id") == rid, m
    else:
        assert "id" not in m, m
    assert isinstance(m["error"]["message"], str) and m["error"]["message"]
    # The same connection still works.
    assert c.call("status")["daemon"]["pid"] == daemon_ok.pid
    c.close()


IDS = [9007199254740991, -9007199254740991, 0, 12345678901234, "a\"b\\c\u00e9\U0001F600\n\t", "", "x" * 128,
       "\u2028"]


def test_ids_echoed_exactly(daemon_ok):
    """Every reply echoes its request's id unchanged, on success and on error."""
    c = daemon_ok.connect()
    for rid in IDS:
        for req in ({"op": "status", "id": rid}, {"op": "evict", "id": rid, "set": "nope"},
                    {"op": "frobnicate", "id": rid}):
            c.send(req)
            m = c.recv_msg()
            assert m.get("id") == rid and type(m["id"]) is type(rid), (req, m)
    c.close()


def wrong_fields(tiny):
    p = tiny["a"]
    return [
        ("open", {"path": 5}, {"BAD_REQUEST"}),
        ("open", {}, {"BAD_REQUEST"}),
        ("open", {"path": None}, {"BAD_REQUEST"}),
        ("open", {"path": ["a"]}, {"BAD_REQUEST"}),
        ("load", {"path": 5, "device": 0}, {"BAD_REQUEST"}),
        ("load", {"path": p, "device": {}}, {"BAD_REQUEST"}),
        ("load", {"path": p, "device": [0]}, {"BAD_REQUEST"}),
        ("load", {"path": p, "device": True}, {"BAD_REQUEST"}),
        ("load", {"path": p, "plan": "whole"}, {"BAD_REQUEST"}),
        ("load", {"path": p, "plan": ["whole"]}, {"BAD_REQUEST"}),
        ("load", {"path": p, "plan": {"preset": 3}}, {"BAD_PLAN", "BAD_REQUEST"}),
        ("load", {"path": p, "plan": {"preset": "tp8"}}, {"BAD_PLAN"}),
        ("attach", {"set": 5}, {"BAD_REQUEST"}),
        ("attach", {"set": "s999999"}, {"NOT_FOUND"}),
        ("attach", {"path": p, "device": {}}, {"BAD_REQUEST"}),
        ("release", {"lease": 5}, {"BAD_REQUEST"}),
        ("release", {}, {"BAD_REQUEST"}),
        ("release", {"lease": "l999999"}, {"NOT_FOUND"}),
        ("evict", {}, {"BAD_REQUEST"}),
        ("evict", {"set": 1}, {"BAD_REQUEST"}),
        ("evict", {"set": "nope"}, {"NOT_FOUND"}),
        ("evict", {"device": {}}, {"BAD_REQUEST"}),
        ("cancel", {}, {"BAD_REQUEST"}),
        ("cancel", {"target": {}}, {"BAD_REQUEST"}),
        ("prefetch", {"path": p, "wait": "yes"}, {"BAD_REQUEST"}),
        ("prefetch", {"path": p, "pin": 1}, {"BAD_REQUEST"}),
        ("close", {"path": 1}, {"BAD_REQUEST"}),
        ("hello", {"protocol": "1"}, {"BAD_REQUEST"}),
        ("hello", {}, {"BAD_REQUEST"}),
    ]


def test_missing_and_mistyped_fields(daemon_ok, tiny):
    c = daemon_ok.connect()
    failures = []
    for op, fields, codes in wrong_fields(tiny):
        m, fds = c.request(op, **fields)
        for fd in fds:
            os.close(fd)
        if "error" not in m or m["error"]["code"] not in codes:
            failures.append(f"{op} {fields}: want {sorted(codes)}, got {m}")
    assert not failures, "\n".join(failures)
    st = c.status()
    assert st["sets"] == [] or all(s["leases"] == 0 for s in st["sets"])
    c.close()


ABSURD_DEVICES = [
    (999999, {"NOT_FOUND"}),
    (1, {"NOT_FOUND"}),
    (-1, {"NOT_FOUND", "BAD_REQUEST"}),
    ("GPU-nonexistent", {"NOT_FOUND"}),
    ("host-", {"NOT_FOUND"}),
    ("", {"NOT_FOUND", "BAD_REQUEST"}),
    ("99999999999999999999999", {"NOT_FOUND", "BAD_REQUEST"}),
    ("-1", {"NOT_FOUND", "BAD_REQUEST"}),
    ("x" * 5000, {"NOT_FOUND", "BAD_REQUEST"}),
    # Not integers, or integers no JSON reader keeps exactly: refused as malformed
    # (docs/protocol-framing.md, "The envelope").
    (1.5, {"BAD_REQUEST"}),
    (2 ** 64, {"BAD_REQUEST"}),
    (2 ** 53, {"BAD_REQUEST"}),
    (1e300, {"BAD_REQUEST"}),
]


def test_absurd_device(daemon_ok, tiny):
    c = daemon_ok.connect()
    failures = []
    for op in ("load", "attach", "evict"):
        for device, codes in ABSURD_DEVICES:
            fields = {"device": device} if op == "evict" else {"path": tiny["a"], "device": device}
            code = c.error(op, **fields)
            if code not in codes:
                failures.append(f"{op} device={str(device)[:30]!r}: {code}, want one of {sorted(codes)}")
    assert c.status()["sets"] == []
    c.close()
    assert not failures, "\n".join(failures)


def test_absurd_values(daemon_ok, tiny):
    c = daemon_ok.connect()
    assert c.error("open", path="/" + "a" * 100000) in {"NOT_FOUND", "BAD_REQUEST", "INVALID", "IO"}
    assert c.error("open", path="") in {"NOT_FOUND", "BAD_REQUEST", "INVALID"}
    assert c.error("open", path=tiny["a"] + "\n") in {"NOT_FOUND", "BAD_REQUEST"}
    assert c.error("hello", protocol=2 ** 64) == "BAD_REQUEST"
    assert c.error("hello", protocol=-1) == "BAD_REQUEST"
    assert c.error("hello", protocol=2) == "VERSION"
    m, _ = c.request("cancel", target=2 ** 60)
    assert m.get("canceled") is False or m.get("error", {}).get("code") == "BAD_REQUEST", m
    assert c.call("cancel", target="nothing")["canceled"] is False
    assert c.call("status")["daemon"]["pid"] == daemon_ok.pid
    c.close()


# ---- paths ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def path_cases(model_root, outside_dir, tiny):
    d = os.path.join(model_root, "links")
    os.makedirs(d, exist_ok=True)
    out_ck = os.path.join(outside_dir, "secret.safetensors")
    link_out = os.path.join(d, "to-outside.safetensors")
    link_out_dir = os.path.join(d, "outside-dir")
    link_in = os.path.join(d, "to-inside")
    for src, dst in ((out_ck, link_out), (outside_dir, link_out_dir), (tiny["a"], link_in)):
        if not os.path.lexists(dst):
            os.symlink(src, dst)
    rel = os.path.relpath(outside_dir, model_root)
    return {
        "outside": out_ck,
        "etc": "/etc/passwd",
        "link": link_out,
        "link_dir_file": os.path.join(link_out_dir, "secret.safetensors"),
        "dotdot": os.path.join(model_root, rel, "secret.safetensors"),
        "dotdot2": os.path.join(model_root, "tiny", "..", "..", "outside", "secret.safetensors"),
        "root_parent": os.path.join(model_root, ".."),
        "inside_link": link_in,
    }


PATH_CASES = ["outside", "etc", "link", "link_dir_file", "dotdot", "dotdot2", "root_parent"]


@pytest.mark.parametrize("op", ["open", "prefetch", "load", "attach", "close"])
def test_path_outside_root_denied(daemon_ok, path_cases, op):
    c = daemon_ok.connect()
    failures = []
    for which in PATH_CASES:
        path = path_cases[which]
        code = c.error(op, path=path)
        if code != "PATH_DENIED":
            failures.append(f"{op} {path} ({which}): {code}, want PATH_DENIED")
    st = c.status()
    assert st["sets"] == []
    assert all(os.path.commonpath([ck["path"], daemon_ok.model_root]) == daemon_ok.model_root
               for ck in st["checkpoints"]), st["checkpoints"]
    c.close()
    assert not failures, "\n".join(failures)


def test_symlink_inside_root_resolves(daemon_ok, path_cases, tiny):
    c = daemon_ok.connect()
    ck = c.call("open", path=path_cases["inside_link"])["checkpoint"]
    assert ck["path"] == os.path.realpath(tiny["a"])
    c.close()


# ---- descriptors sent to the daemon --------------------------------------------------


def pipe_was_dropped(w):
    """True when nobody holds the read end of the pipe any more (the write gets EPIPE)."""
    try:
        os.write(w, b"x")
    except BrokenPipeError:
        return True
    return False


@pytest.mark.parametrize("where", ["hello", "after_hello", "mid_frame", "many"])
def test_descriptors_refused_and_closed(daemon_ok, where):
    base = daemon_ok.quiet_fd_count()
    c = daemon_ok.connect(hello=where != "hello")
    r, w = os.pipe()
    pipe_ino = os.fstat(r).st_ino
    extra = []
    try:
        if where == "hello":
            c.send({"op": "hello", "id": 1, "protocol": 1}, fds=[r])
        elif where == "after_hello":
            c.send({"op": "status", "id": 1}, fds=[r])
        elif where == "mid_frame":
            f = frame({"op": "status", "id": 1})
            c.send_raw(f[:6])
            time.sleep(0.05)
            c.send_raw(f[6:], fds=[r])
        else:
            extra = [os.dup(r) for _ in range(40)]
            c.send({"op": "status", "id": 1}, fds=[r] + extra)
        os.close(r)
        for fd in extra:
            os.close(fd)
        r = None
        extra = []
        got = c.expect_closed(5 * SLOW)
        assert len(got) == 1 and got[0]["error"]["code"] == "PROTOCOL", got
        wait_until(lambda: pipe_was_dropped(w), timeout=5, what="the daemon to close the descriptor it was sent")
        assert f"pipe:[{pipe_ino}]" not in daemon_ok.fd_targets().values()
        assert daemon_ok.quiet_fd_count() == base
    finally:
        for fd in [w] + ([r] if r is not None else []) + extra:
            os.close(fd)
        c.close()


# ---- many connections ---------------------------------------------------------------


def test_2000_connect_close_cycles(daemon_ok):
    base = daemon_ok.quiet_fd_count()
    for i in range(2000):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(daemon_ok.socket)  # blocking: waits while the listen backlog is full
        s.settimeout(10)
        if i % 4 == 1:
            s.sendall(frame({"op": "hello", "id": 1, "protocol": 1}))
        elif i % 4 == 2:
            s.sendall(frame({"op": "hello", "id": 1, "protocol": 1}) + frame({"op": "status", "id": 2}))
        s.close()
    wait_until(lambda: daemon_ok.status()["daemon"]["connections"] == 1, timeout=20 * SLOW,
               what="connections back to 1")
    assert daemon_ok.quiet_fd_count() == base


# ---- slow and greedy clients ---------------------------------------------------------


def test_half_frame_then_silence(daemon_ok):
    c = daemon_ok.connect()
    f = frame({"op": "status", "id": 1})
    t0 = time.monotonic()
    c.send_raw(f[: len(f) // 2])
    # Meanwhile another client is served at once.
    with daemon_ok.connect() as other:
        t1 = time.monotonic()
        assert other.call("status")["daemon"]["connections"] == 2
        assert time.monotonic() - t1 < 0.4 * SLOW, "the daemon waited for the silent client"
    got = c.expect_closed(10 * SLOW)
    waited = time.monotonic() - t0
    assert FRAME_TIMEOUT_MS / 1000 * 0.8 <= waited <= FRAME_TIMEOUT_MS / 1000 + 2.0 * SLOW, waited
    # The documented codes a daemon sends (TIMEOUT is a client-side code).
    assert len(got) <= 1
    for m in got:
        assert m["error"]["code"] == "PROTOCOL", m


def test_busy_stream_of_prompt_frames_is_not_timed_out(daemon_ok):
    """The frame timeout runs from a frame's first byte (docs/protocol.md, Frames).

    This client keeps a frame in flight at every moment, but finishes each one
    within 50 ms: the second half of a frame goes out with the first half of the
    next. It must be served for as long as it keeps this up (here 3x the
    timeout), not cut off when the daemon has seen partial frames for
    frame_timeout_ms in a row.
    """
    c = daemon_ok.connect()
    frames = [frame({"op": "status", "id": i}) for i in range(1, 200)]
    half = len(frames[0]) // 2
    c.send_raw(frames[0][:half])
    t0 = time.monotonic()
    sent = 0
    try:
        while time.monotonic() - t0 < 3 * FRAME_TIMEOUT_MS / 1000:
            time.sleep(0.05)
            c.send_raw(frames[sent][half:] + frames[sent + 1][:half])
            sent += 1
            m = c.recv_msg()
            assert m.get("id") == sent and m.get("ok") is True, m
    except (Closed, BrokenPipeError, ConnectionResetError, AssertionError) as e:
        raise AssertionError(f"cut off after {time.monotonic() - t0:.2f} s and {sent} prompt frames: {e}") from e
    c.send_raw(frames[sent][half:])
    assert c.recv_msg().get("id") == sent + 1
    c.close()


def test_pipelining_client_that_never_reads(daemon_ok, tiny):
    """A client that pipelines requests and never reads is not served further, not dropped.

    Once its unread replies pass half of max_queued_output the daemon stops reading its
    requests (its sends then block in the kernel); others are answered throughout, and
    the daemon's memory stays bounded."""
    with daemon_ok.connect() as c:
        c.call("open", path=tiny["a"])  # makes every status reply larger
    greedy = daemon_ok.connect()
    greedy.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stop = threading.Event()
    sent = [0]

    def flood():
        req = frame({"op": "status", "id": 1})
        batch = req * 200
        try:
            while not stop.is_set() and sent[0] < 200000:
                greedy.sock.sendall(batch)
                sent[0] += 200
        except OSError:  # closed by the test below
            pass

    t = threading.Thread(target=flood)
    t.start()
    try:
        worst = 0.0
        rss = []
        with daemon_ok.connect() as other:
            deadline = time.monotonic() + 10 * SLOW
            while time.monotonic() < deadline:
                t1 = time.monotonic()
                st = other.call("status")
                worst = max(worst, time.monotonic() - t1)
                rss.append(daemon_ok.rss_kib())
                time.sleep(0.05)
            assert st["daemon"]["connections"] == 2, "the client that does not read was dropped"
            assert t.is_alive(), "the flood ended: the daemon kept reading a client that never reads"
        assert worst < 5.0 * SLOW, f"a status took {worst:.2f} s while another client flooded"
        # Bounded: what it holds for the flooder is its queued replies (64 MiB at most).
        assert max(rss) - rss[0] < 96 * 1024, rss
    finally:
        stop.set()
        greedy.sock.shutdown(socket.SHUT_RDWR)
        t.join(60)
        greedy.close()
    wait_until(lambda: daemon_ok.status()["daemon"]["connections"] == 1, what="the flooder's connection to close")


def test_pipelined_burst_does_not_starve_others(start_daemon, ckpt_small):
    """One client's burst of pipelined requests must not hold up another client's request.

    The burst client reads its replies; it is not misbehaving, only busy. With a
    real checkpoint open each status costs the daemon a mincore() walk, so a
    daemon that runs every queued request of one connection before a request of
    another keeps the second client waiting for the whole burst.
    """
    d = start_daemon()
    n = 1500
    with d.connect() as busy, d.connect() as other:
        busy.call("open", path=ckpt_small)
        t0 = time.monotonic()
        other.call("status")
        single = time.monotonic() - t0
        # A hello is answered as soon as it is read: its reply means the daemon
        # has taken in (and queued) every request sent before it.
        busy.sock.sendall(frame({"op": "status", "id": 1}) * n + frame({"op": "hello", "id": "sync", "protocol": 1}))
        busy.settimeout(300)
        got = 0
        while True:
            m = busy.recv_msg()
            if m.get("id") == "sync":
                break
            got += 1
        t1 = time.monotonic()
        other.call("status")
        waited = time.monotonic() - t1
        for _ in range(n - got):
            m = busy.recv_msg()
            assert m.get("ok") is True, m
        burst = time.monotonic() - t0
        assert waited < 1.5, (f"a status waited {waited:.2f} s behind another client's burst of {n} "
                              f"({n - got} still queued; one status alone: {single * 1000:.1f} ms, "
                              f"the whole burst: {burst:.2f} s)")


def test_connection_limit(start_daemon):
    d = start_daemon({"max_connections": 8, "reserved_connections": 0})
    conns = [d.connect() for _ in range(8)]
    try:
        extra = Conn(d.socket, hello=False, timeout=5 * SLOW)
        got = extra.expect_closed(5 * SLOW)
        assert len(got) == 1 and got[0]["error"]["code"] == "LIMIT", got
        for c in conns:
            assert c.status()["daemon"]["connections"] == 8
    finally:
        for c in conns[:2]:
            c.close()
    wait_until(lambda: conns[2].status()["daemon"]["connections"] == 6, what="two connections to close")
    with d.connect() as c:
        assert c.status()["daemon"]["connections"] == 7
    for c in conns[2:]:
        c.close()
