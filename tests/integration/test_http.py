"""The HTTP endpoints against hostile connections, and labels and names made from hostile paths.

Connections: a burst of idle connections, more than metrics_connections,
and slowloris connections that drip a byte every 2 s (under the 5 s idle
timeout); the probes must go on being answered (a probe that gets no answer
within 10 s fails: no threshold on speed), and every slowloris connection
must be closed by the per-request deadline (metrics_request_timeout_ms).

Floods: processes opening connections from many 127.x addresses as fast
as they can, each sending a partial request and holding it, and
connections that pipeline requests and never read the answers, while
probes are sent one after another on new connections: every probe must be
answered 200 (a reset or a probe closed unanswered fails it).

Paths: a checkpoint reached through a symlink whose target name is not
UTF-8, one whose path has a '"' where the old 1 KiB label buffer ended, and
two long paths with a common 1 KiB prefix. The status reply must be valid
JSON (read by the strict client library through weightctl, and by Python's
json), /metrics valid UTF-8 parsed by prometheus_client's text parser, and
each checkpoint its own series labelled with its whole path.
"""
import collections
import hashlib
import json
import multiprocessing
import os
import socket
import struct
import subprocess
import time

import pytest

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError as e:  # CI installs it (tests/requirements.txt) and demands it
    if os.environ.get("WD_REQUIRE_REFERENCE") == "1":
        raise
    pytest.skip(f"cannot import prometheus_client ({e}): pip install -r tests/requirements.txt",
                allow_module_level=True)

from conftest import SLOW, TINY_TENSORS, WEIGHTCTL, write_single
from wdclient import wait_until

PROBE_TIMEOUT = 10 * SLOW  # a probe unanswered this long fails
PROBES = {"/healthz": 200, "/readyz": 200, "/metrics": 200}


# ---- HTTP by hand --------------------------------------------------------------------------


def address(d):
    host, port = d.metrics_address.rsplit(":", 1)
    return host, int(port)


def connect(d, source):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((source, 0))
    s.settimeout(PROBE_TIMEOUT)
    s.connect(address(d))
    return s


def probe(d, path, source="127.0.0.1"):
    """(status, body) of GET path on a new connection; fails when no whole answer comes within PROBE_TIMEOUT."""
    with connect(d, source) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        deadline = time.monotonic() + PROBE_TIMEOUT
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 16)
            except socket.timeout:
                break
            if not chunk:
                break
            reply += chunk
    head, sep, body = reply.partition(b"\r\n\r\n")
    assert sep, f"GET {path}: no answer within {PROBE_TIMEOUT} s (got {reply[:200]!r})"
    return int(head.split(b" ")[1]), body


def probe_all(d):
    for path, want in PROBES.items():
        status, body = probe(d, path)
        assert status == want, (path, status, body[:300])


def closed_by_peer(s):
    """Whether the daemon closed s (EOF or reset); never blocks."""
    try:
        s.setblocking(False)
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


# ---- connections ----------------------------------------------------------------------------


def test_idle_connections_expiring_together_leave_the_endpoints_up(start_daemon):
    """64 idle connections (metrics_connections) expire in one pass; the endpoints answer afterwards.

    Before: the library stopped polling its listen socket when the table was
    full and added it back only at the start of a later pass; the pass that
    closed every connection left none to come, so /healthz, /readyz and
    /metrics never answered again.
    """
    d = start_daemon(metrics=True)
    probe_all(d)
    idle = [connect(d, f"127.0.4.{1 + i}") for i in range(64)]
    try:
        wait_until(lambda: all(closed_by_peer(s) for s in idle), timeout=20 * SLOW,
                   what="the idle connections to be closed")
        probe_all(d)
    finally:
        for s in idle:
            s.close()
    d.check_serving()


def test_probes_answered_while_idle_connections_fill_the_table(start_daemon):
    """96 idle connections from 48 addresses (more than metrics_connections): probes are still answered.

    Before: the 64 held the table, a probe waited in the kernel's backlog
    for the idle timeout, and then the endpoints wedged as above.
    """
    d = start_daemon(metrics=True)
    idle = [connect(d, f"127.0.5.{1 + i % 48}") for i in range(96)]
    try:
        probe_all(d)
        # One address with more than its 32: the others' connections are not the ones that go.
        more = [connect(d, "127.0.5.200") for _ in range(40)]
        probe_all(d)
        wait_until(lambda: sum(closed_by_peer(s) for s in more) >= 40 - 32, timeout=10 * SLOW,
                   what="one address kept to 32 connections")
        for s in more:
            s.close()
    finally:
        for s in idle:
            s.close()
    d.check_serving()


def test_slowloris_is_closed_by_the_request_deadline(start_daemon):
    """80 connections dripping a header byte every 2 s: each is closed by the deadline; probes are answered.

    Before: the only limit was 5 s without a byte, so every connection was
    held for as long as it dripped, the table stayed full and no probe was
    answered.
    """
    d = start_daemon(metrics=True, settings={"metrics_request_timeout_ms": 3000})
    slow = [connect(d, f"127.0.6.{1 + i % 40}") for i in range(80)]
    open_ = set(range(len(slow)))
    try:
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        # Drip for up to 30 s; the deadline is 3 s, so all must have gone long before.
        stop = time.monotonic() + 30 * SLOW
        while open_ and time.monotonic() < stop:
            probe_all(d)
            for i in list(open_):
                if closed_by_peer(slow[i]):
                    open_.discard(i)
                    continue
                try:
                    slow[i].send(b"a")
                except OSError:
                    open_.discard(i)
            time.sleep(2)
        assert not open_, f"{len(open_)} of {len(slow)} slowloris connections still open after 30 s"
        probe_all(d)
    finally:
        for s in slow:
            s.close()
    d.check_serving()


FLOOD_PROCESSES = 3
FLOOD_SOURCES = [f"127.{a}.{b}.{c}" for a in (7, 8) for b in (1, 2) for c in (1, 2, 3, 4)]  # 16, in 4 /24s
FLOOD_HELD = 96  # each flooder's connections open at once; the oldest is closed for the next
FLOOD_PARTIAL = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"  # never the blank line that ends it


def flood(address_, sources, stop, made, cut):
    """In a child process: connect, send a partial request, hold it, as fast as possible, until stop.

    made counts the connections made; cut those of them the daemon closed
    before the flooder dropped them (so the flood did pass the limit).
    Connections are dropped with a reset, so no port waits in TIME_WAIT.
    """
    held = collections.deque()
    n = 0
    while not stop.is_set():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            s.bind((sources[n % len(sources)], 0))
            s.settimeout(PROBE_TIMEOUT)
            s.connect(address_)
            s.sendall(FLOOD_PARTIAL)
        except OSError:
            s.close()
            continue
        n += 1
        with made.get_lock():
            made.value += 1
        held.append(s)
        if len(held) > FLOOD_HELD:
            old = held.popleft()
            if closed_by_peer(old):
                with cut.get_lock():
                    cut.value += 1
            old.close()
    for s in held:
        s.close()


def probe_outcome(d, path):
    """The status of GET path on a new connection, or what went wrong instead (a reset, no answer)."""
    try:
        return probe(d, path)[0]
    except AssertionError:
        return "unanswered"
    except OSError as e:
        return type(e).__name__


@pytest.mark.parametrize("connections", [4, 64])
def test_probes_answered_through_a_connect_flood(start_daemon, connections):
    """Three processes flood partial requests from 16 addresses; 1500 probes in a row are each answered 200.

    Before: each newcomer past the limit closed, as it was accepted, the
    connection whose request had waited longest, whatever its state, so a
    probe accepted just before a burst of the flood's connections was closed
    before its request was read (seen: with a limit of 4, 60 to 240 of the
    1500 unanswered; with 64 none here, 26 of 40,455 in the review's run).
    Reading a batch's requests before making room was not enough alone: a
    probe accepted between its connect and its send was still closed (1 to
    8 of 1500), hence the kernel's deferred accept.
    """
    d = start_daemon(metrics=True, settings={"metrics_connections": connections})
    ctx = multiprocessing.get_context("fork")
    stop, made, cut = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0)
    flooders = [ctx.Process(target=flood, args=(address(d), FLOOD_SOURCES[i::FLOOD_PROCESSES], stop, made, cut))
                for i in range(FLOOD_PROCESSES)]
    for p in flooders:
        p.start()
    try:
        wait_until(lambda: made.value >= 10 * connections + 100, timeout=30 * SLOW, what="the flood to start")
        outcomes = collections.Counter(probe_outcome(d, "/healthz") for _ in range(1500))
    finally:
        stop.set()
        for p in flooders:
            p.join(timeout=30 * SLOW)
            if p.is_alive():
                p.kill()
    assert cut.value > 0, f"the flood ({made.value} connections) never passed the limit"
    assert outcomes == {200: 1500}, f"probes during a flood of {made.value} connections: {dict(outcomes)}"
    probe_all(d)
    d.check_serving()


HOARDED = 1000  # /metrics requests each hoarder pipelines: some 7.7 MB of answers, past any socket's buffers


def hoard(d, source):
    """A connection that pipelines HOARDED requests for /metrics and reads none of the answers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((source, 0))
    s.settimeout(PROBE_TIMEOUT)
    s.connect(address(d))
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * HOARDED)
    return s


def ended(s):
    """Whether the daemon closed s, reading what it holds to find out; never blocks."""
    s.setblocking(False)
    try:
        while s.recv(1 << 20):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_connections_that_keep_asking_do_not_keep_probes_out(start_daemon):
    """24 connections pipelining 1000 requests each and reading nothing; 50 probes in a row are each answered 200.

    A connection being answered is never closed to make room while it is on
    its first answer, but one answering a later request, or whose client is
    not reading, is. Otherwise these 24 would fill the library's table
    (metrics_connections 4 and a batch of 16) for the whole
    metrics_request_timeout_ms (here 600 s), and every newcomer would be
    refused (seen with every answering connection spared).
    """
    d = start_daemon(metrics=True, settings={"metrics_connections": 4, "metrics_request_timeout_ms": 600000})
    hoarders = [hoard(d, f"127.0.9.{1 + i}") for i in range(24)]
    try:
        outcomes = collections.Counter(probe_outcome(d, "/healthz") for _ in range(50))
        assert outcomes == {200: 50}, f"probes beside 24 connections that keep asking: {dict(outcomes)}"
        closed = sum(ended(s) for s in hoarders)
        assert closed >= 24 - 4, f"only {closed} of 24 connections past metrics_connections 4 closed"
    finally:
        for s in hoarders:
            s.close()
    probe_all(d)
    d.check_serving()


# ---- labels and names from paths ------------------------------------------------------------


def scrape(d):
    """The text of /metrics, which must be UTF-8, and its families by name."""
    status, body = probe(d, "/metrics")
    assert status == 200, body[:300]
    text = body.decode("utf-8")  # strict: raises on anything that is not UTF-8
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def path_labels(fams, family="weightd_checkpoint_bytes"):
    return [s.labels["path"] for s in fams[family].samples]


def json_path_labels(st, family="weightd_checkpoint_bytes"):
    return [s["labels"]["path"] for s in st["metrics"][family]["samples"]]


def ctl_status(d):
    """weightctl status --json, through the strict client library; the parsed reply."""
    r = subprocess.run([WEIGHTCTL, "--socket", d.socket, "status", "--json"], capture_output=True, timeout=60 * SLOW)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    return json.loads(r.stdout)


def test_paths_that_are_not_utf8(start_daemon, model_root):
    """Checkpoints reached through symlinks whose targets are not UTF-8: valid JSON, valid /metrics, two series.

    Before: the status reply's "metrics" object carried the path's bytes as
    they were, so weightctl status failed with "not a JSON object
    (PROTOCOL)", Python's json could not decode it, and /metrics was not
    UTF-8. Replies now replace each ill-formed subpart with U+FFFD, as
    Python's errors="replace" does; a label also carries a hash of the
    original bytes, so that two paths differing only there stay two series.
    """
    root = os.fsencode(os.path.realpath(model_root))
    targets = [root + b"/http-\xff\xfe-a", root + b"/http-\xff\xfd-a"]  # the same once replaced
    links = []
    for i, t in enumerate(targets):
        write_single(os.fsdecode(t), TINY_TENSORS, 20 + i)
        link = os.path.join(model_root, f"http-link-{i}")
        os.symlink(os.fsdecode(t), link)
        links.append(link)
    shown = [t.decode("utf-8", "replace") for t in targets]
    assert shown[0] == shown[1]
    d = start_daemon(metrics=True)
    with d.connect() as c:
        for link in links:
            c.call("open", path=link)
        st = c.status()
    assert sorted(k["path"] for k in st["checkpoints"]) == sorted(shown)
    assert sorted(k["path"] for k in ctl_status(d)["checkpoints"]) == sorted(shown)
    _, fams = scrape(d)
    labels = path_labels(fams)
    assert len(labels) == 2 and len(set(labels)) == 2, labels
    for label in labels:
        assert label.startswith(shown[0] + " (not UTF-8: ") and len(label) == len(shown[0]) + 30, label
        assert all(ch in "0123456789abcdef" for ch in label[-17:-1]) and label.endswith(")"), label
    assert sorted(json_path_labels(st)) == sorted(labels)
    d.check_serving()


def long_path(root, name, length, mark=None):
    """root/name/... of at least length bytes in components of at most 200; mark, when given, at byte length."""
    p = os.path.join(root, name)
    while len(p) < length - 200:
        p += "/" + "a" * 199
    p += "/" + "b" * (length - len(p) - 1)
    assert len(p) == length
    return p + (mark or "")


def test_long_labels_are_whole_and_distinct(start_daemon, model_root):
    """A '"' at byte 1015 of a path, and two paths sharing their first 1100 bytes: whole, distinct labels.

    Before: a sample's labels were written into 1 KiB: the escape of a '"'
    at byte 1015 of the path took the last two bytes and the label lost its
    closing quote (the exposition did not parse), and two paths alike in
    their first ~1 KiB became one series.
    """
    root = os.path.realpath(model_root)
    quoted = long_path(root, "http-q", 1015, mark='"then \\ and\nmore')
    prefix = long_path(root, "http-p", 1100)
    paths = [quoted, prefix + "/one", prefix + "/two"]
    for i, p in enumerate(paths):
        write_single(p, TINY_TENSORS, 30 + i)
    d = start_daemon(metrics=True)
    with d.connect() as c:
        for p in paths:
            c.call("open", path=p)
        st = c.status()
    text, fams = scrape(d)
    assert sorted(path_labels(fams)) == sorted(paths)
    assert sorted(json_path_labels(st)) == sorted(paths)
    assert sorted(k["path"] for k in ctl_status(d)["checkpoints"]) == sorted(paths)
    # The escapes themselves, as the format writes them.
    assert 'path="' + quoted.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"' in text
    d.check_serving()
