#!/usr/bin/env python3
"""The stress and fault harness: many clients, misbehaving and faulty, against
one weightd on a private socket (host backend), with low descriptor and memory
limits. docs/reliability.md describes it and gives its figures.

What runs, in order:
  1. A daemon under a short chaos round; a load started, then SIGTERM mid-load:
     it must exit 0 in time, leaving no socket file. A new daemon is started.
  2. A warm-up round, then a settle round: the daemon's descriptor count and
     RssAnon are taken as the baseline.
  3. ROUNDS chaos rounds. In each, WORKERS threads run OPS random operations
     (open, close, prefetch, load, attach, release, evict, status, cancel with
     random plans; dropped connections, malformed and large requests, frames
     that stall), while clients pipeline requests and never read, client
     processes holding leases are SIGKILLed, and a connection storm runs the
     daemon out of descriptors. Between rounds: a shard truncated under a load
     (FAULT), a shard replaced under a load (STALE), the device budget
     exhausted by a leased set (DEVICE_NOMEM).
  4. A settle round: descriptors must equal the baseline exactly, RssAnon come
     back to within 16 MiB of it, the leases be exactly those of the
     well-behaved clients; the daemon must stop cleanly (status 0, no
     sanitizer report).

Throughout, a well-behaved client (the probe) sends status every 100 ms and
must be answered within DEADLINE; it and an idle engine hold leases that must
never be lost (released at the end, and the engine's bytes checked against
the files); every worker's lease must still be there when it releases it; a
worker's connection may close only after it broke the protocol on purpose.

usage: run_stress.py [--rounds N] [--workers N] [--ops N] [--seed S] [--report FILE]
Environment: WEIGHTD, WEIGHTCTL (the binaries), WD_TEST_TMP (scratch space),
WD_STRESS_ROUNDS / WD_STRESS_OPS (override the defaults; the ASan build runs
fewer by default), WD_STRESS_DEADLINE (the probe's deadline in seconds, 15,
times 3 under ASan), WD_STRESS_REPORT (a file for the figures). Exit status 0 when every check held, 1 otherwise,
also when the Python test dependencies are missing (a test whose dependency is missing fails).
"""
import argparse
import collections
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
INTEGRATION = os.path.join(HERE, "..", "integration")
sys.path.insert(0, INTEGRATION)

try:
    import wdfixtures  # noqa: E402  the Daemon launcher and the generator wrapper
    import wdclient  # noqa: E402
except ImportError as e:  # pytest missing: wdfixtures needs it
    print(f"run_stress: cannot import the integration helpers: {e}; failing (pip install -r tests/requirements.txt)",
          file=sys.stderr)
    sys.exit(1)

from wdclient import Closed, Conn, frame  # noqa: E402

SLOW = wdfixtures.SLOW
# The probe's status must be answered within this. Generous: CI runs the harness beside other suites on
# two cores, where a status that takes 20 ms alone has been seen to take 9 s; a daemon that stalls or
# drops the probe misses it by far.
DEADLINE = float(os.environ.get("WD_STRESS_DEADLINE", "15")) * SLOW
CALL_TIMEOUT = 60.0 * SLOW  # any single request of a worker
MiB = 1 << 20
RSS_TOLERANCE_KIB = 16 * 1024
TIME_LIMIT = int(os.environ.get("WD_STRESS_TIME_LIMIT", "600"))  # the whole run, seconds (ctest allows 900)

# Low limits, so that the chaos reaches them.
SETTINGS = {
    "device_memory_budget": "800MiB",  # the big checkpoint whole (654 MiB) fits; with one rank (178 MiB) it does not
    "max_connections": 400,  # more than the descriptors: a storm runs the daemon out of them
    "reserved_connections": 8,
    "max_queued_fds": 8,
    "max_queued_output": "1MiB",
    "request_memory": "16MiB",
    "max_request_bytes": "64KiB",
    "idle_timeout_ms": 3000,
    "frame_timeout_ms": 1000,
    "fill_threads": 2,
    "job_threads": 2,
}
NOFILE = (256, 256)
LARGE_REQUEST = 60 * 1024  # under max_request_bytes

# Codes a worker may get for a well-formed request while others misbehave.
ALLOWED = {"LIMIT", "BUSY", "NOT_FOUND", "CANCELED", "DEVICE_NOMEM"}
BIG_PLANS = [None, {"preset": "auto", "tp_size": 2, "tp_rank": 0},
             {"preset": "dense", "tp_size": 2, "tp_rank": 1, "fuse": True}]


class Failure(Exception):
    pass


LIVE = []  # daemons to kill if the run overruns its time limit
CHILDREN = set()  # client processes running now


class Stats:
    """Counters shared by every thread (under one lock), and the failures seen."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ops = collections.Counter()
        self.codes = collections.Counter()
        self.events = collections.Counter()
        self.failures = []
        self.probe_latency = []

    def op(self, name, code="ok"):
        with self.lock:
            self.ops[name] += 1
            self.codes[code] += 1

    def event(self, name, n=1):
        with self.lock:
            self.events[name] += n

    def fail(self, what):
        what = f"[{time.strftime('%H:%M:%S')}] {what}"
        with self.lock:
            if len(self.failures) < 50:
                self.failures.append(what)
        print(f"run_stress: FAILURE: {what}", file=sys.stderr, flush=True)


# ---- connections ------------------------------------------------------------------


def connect(h, timeout=CALL_TIMEOUT):
    """A connection past hello; retries while the daemon refuses (LIMIT: connection storm)."""
    deadline = time.monotonic() + CALL_TIMEOUT
    while True:
        try:
            return Conn(h.daemon.socket, timeout=timeout, client="stress")
        except wdclient.WDError as e:
            if e.code != "LIMIT":
                raise Failure(f"hello refused with {e.code}: {e.message}")
        except (Closed, ConnectionResetError, BrokenPipeError):
            pass  # refused before hello was read: the LIMIT frame may have been lost with it
        h.stats.event("connect_refused")
        if time.monotonic() > deadline:
            raise Failure(f"no connection accepted within {CALL_TIMEOUT:.0f} s")
        time.sleep(0.05)


def result(m):
    """The code of a final reply: "ok" or the error code."""
    if m.get("ok") is True:
        return "ok"
    return m.get("error", {}).get("code", "?")


# ---- workers ----------------------------------------------------------------------


class Worker(threading.Thread):
    """One client running random operations; it breaks the protocol only on purpose."""

    OPS = [("status", 12), ("open", 4), ("close", 2), ("prefetch", 4), ("load_tiny", 14), ("load_big", 3),
           ("attach_path", 12), ("attach_set", 6), ("release", 12), ("evict", 4), ("cancel", 4),
           ("drop", 4), ("large", 3), ("garbage", 3), ("protocol", 2), ("stall", 1)]

    def __init__(self, h, name, nops, seed):
        super().__init__(name=name, daemon=True)
        self.h = h
        self.nops = nops
        self.rnd = random.Random(seed)
        self.conn = None
        self.leases = []

    def run(self):
        names = [o for o, _ in self.OPS]
        weights = [w for _, w in self.OPS]
        try:
            for _ in range(self.nops):
                if self.h.stop.is_set():
                    break
                if self.conn is None:
                    self.conn = connect(self.h)
                    self.leases = []
                op = self.rnd.choices(names, weights)[0]
                try:
                    getattr(self, "op_" + op)()
                except Failure as e:
                    self.h.stats.fail(f"{self.name} {op}: {e}")
                    self.reset()
                except (Closed, OSError) as e:
                    self.h.stats.fail(f"{self.name} {op}: the connection failed unprovoked: {e!r}")
                    self.reset()
            self.release_all()
        except Failure as e:
            self.h.stats.fail(f"{self.name}: {e}")
        except Exception as e:  # a bug in the harness must fail the run, not hide
            self.h.stats.fail(f"{self.name}: {e!r}")
        finally:
            self.reset()

    def reset(self):
        if self.conn is not None:
            self.conn.close()
        self.conn = None
        self.leases = []

    # ---- helpers ----

    def request(self, op, allowed=ALLOWED, **fields):
        """Sends op, returns (code, reply, fds); fails on a code outside allowed."""
        m, fds = self.conn.request(op, **fields)
        code = result(m)
        self.h.stats.op(op, code)
        if code != "ok" and code not in allowed:
            for fd in fds:
                os.close(fd)
            raise Failure(f"{op} {fields} got {code}: {m.get('error', {}).get('message')}")
        return code, m, fds

    def some_set(self):
        sets = self.conn.status()["sets"]
        return self.rnd.choice(sets)["set"] if sets else "s0"

    def tiny(self):
        return self.rnd.choice(self.h.tiny_paths)

    def keep_lease(self, code, m, fds, path=None):
        if code == "ok":
            if len(fds) != 1:
                raise Failure(f"attach carried {len(fds)} descriptors")
            if path is not None and self.rnd.random() < 0.1:
                wdclient.verify_attached(m, fds[0], self.h.ckpts[path])
            self.leases.append(m["lease"])
        for fd in fds:
            os.close(fd)

    def release_all(self):
        while self.leases and self.conn is not None:
            self.op_release()

    # ---- operations ----

    def op_status(self):
        self.request("status")

    def op_open(self):
        self.request("open", path=self.tiny() if self.rnd.random() < 0.8 else self.h.big)

    def op_close(self):
        self.request("close", path=self.tiny())

    def op_prefetch(self):
        self.request("prefetch", path=self.tiny() if self.rnd.random() < 0.7 else self.h.big, wait=True)

    def op_load_tiny(self):
        self.request("load", path=self.tiny(), device=0)

    def op_load_big(self):
        plan = self.rnd.choice(BIG_PLANS)
        self.request("load", path=self.h.big, **({"plan": plan} if plan else {}))

    def op_attach_path(self):
        path = self.tiny()
        self.keep_lease(*self.request("attach", path=path, device=0), path=path)

    def op_attach_set(self):
        self.keep_lease(*self.request("attach", set=self.some_set()))

    def op_release(self):
        if not self.leases:
            return self.op_status()
        lease = self.leases.pop(self.rnd.randrange(len(self.leases)))
        code, m, _ = self.request("release", allowed=set(), lease=lease)
        if m.get("released") is not True:
            raise Failure(f"release of {lease}: {m}")

    def op_evict(self):
        self.request("evict", set=self.some_set())

    def op_cancel(self):
        rid = f"c{self.rnd.randrange(1 << 30)}"
        plan = self.rnd.choice(BIG_PLANS)
        self.conn.start("load", id=rid, path=self.h.big, **({"plan": plan} if plan else {}))
        time.sleep(self.rnd.random() * 0.3)
        code, m, _ = self.request("cancel", target=rid)
        if m.get("canceled") not in (True, False):
            raise Failure(f"cancel reply {m}")
        final, _ = self.conn.wait(rid)
        code = result(final)
        self.h.stats.op("load", code)
        if code != "ok" and code not in ALLOWED:
            raise Failure(f"canceled load got {code}: {final}")

    def op_drop(self):
        """A request sent, then the connection closed before its reply."""
        what = self.rnd.choice(["load", "attach", "prefetch"])
        path = self.h.big if self.rnd.random() < 0.3 else self.tiny()
        self.conn.start(what, path=path, device=0)
        if self.rnd.random() < 0.5:
            time.sleep(self.rnd.random() * 0.2)
        self.h.stats.op("drop", "dropped")
        self.reset()

    def op_large(self):
        """A request near max_request_bytes (the densest JSON): charged, parsed, answered."""
        body = b'{"op":"status","id":"large","pad":[' + b"0," * (LARGE_REQUEST // 2) + b"0]}"
        self.conn.send_raw(frame(body))
        m, _ = self.conn.wait("large")
        code = result(m)
        self.h.stats.op("large", code)
        if code != "ok":
            raise Failure(f"a large status got {m}")

    def op_garbage(self):
        body = self.rnd.choice([b'{"op":', b"[1,2]", b'{"op":"frobnicate","id":"g"}', b'{"op":"load","path":5}'])
        self.conn.send_raw(frame(body))
        m = self.conn.recv_msg()
        code = result(m)
        self.h.stats.op("garbage", code)
        if code != "BAD_REQUEST":
            raise Failure(f"malformed request {body!r} got {m}")

    def op_protocol(self):
        """A frame of length 0: one PROTOCOL error, then the daemon closes the connection."""
        self.conn.send_raw(struct.pack("<I", 0))
        got = self.conn.expect_closed(10 * SLOW)
        self.h.stats.op("protocol", result(got[0]) if got else "closed")
        if len(got) > 1 or (got and result(got[0]) != "PROTOCOL"):
            raise Failure(f"a zero-length frame got {got}")
        self.reset()

    def op_stall(self):
        """Half a frame, then nothing: closed after frame_timeout_ms."""
        self.conn.send_raw(frame({"op": "status", "id": "stall"})[:9])
        got = self.conn.expect_closed(10 * SLOW)
        self.h.stats.op("stall", result(got[0]) if got else "closed")
        if not got or result(got[0]) != "PROTOCOL":
            raise Failure(f"a stalled frame got {got}")
        self.reset()


# ---- the other actors -------------------------------------------------------------------


class Probe(threading.Thread):
    """The well-behaved client: a lease held throughout, and a status every 100 ms within DEADLINE."""

    def __init__(self, h):
        super().__init__(name="probe", daemon=True)
        self.h = h
        self.conn = Conn(h.daemon.socket, timeout=DEADLINE * 4, client="probe")
        att, fd = self.conn.attach(path=h.tiny_paths[0], device=0)
        os.close(fd)
        self.lease = att["lease"]
        self.set = att["set"]
        self.halt = threading.Event()
        self.last_connections = None

    def run(self):
        while not self.halt.is_set():
            t0 = time.monotonic()
            try:
                st = self.conn.status()
            except Exception as e:
                if not self.halt.is_set():
                    self.h.stats.fail(f"probe: status failed: {e!r}")
                return
            dt = time.monotonic() - t0
            with self.h.stats.lock:
                self.h.stats.probe_latency.append(dt)
            if dt > DEADLINE:
                self.h.stats.fail(f"probe: status took {dt:.2f} s (deadline {DEADLINE:.1f} s)")
            self.last_connections = st["daemon"]["connections"]
            mine = [s for s in st["sets"] if s["set"] == self.set]
            if not mine or mine[0]["leases"] < 1:
                self.h.stats.fail(f"probe: its set {self.set} lost its lease: {mine}")
            self.halt.wait(0.1)

    def finish(self):
        self.halt.set()
        self.join(DEADLINE * 5)


def never_reader(h, rnd):
    """Pipelines attaches and statuses, never reads, holds a while, closes."""
    while not h.stop.is_set():
        try:
            c = connect(h)
        except Failure as e:
            h.stats.fail(f"never-reader: {e}")
            return
        burst = b"".join(frame({"op": "attach", "set": h.probe.set}) + frame({"op": "status"}) for _ in range(100))
        c.sock.settimeout(0.2)
        try:
            c.sock.sendall(burst)
        except (socket.timeout, OSError):
            pass  # the daemon stopped reading it: that is the point
        h.stats.event("never_read_bursts")
        h.stop.wait(0.5 + rnd.random() * 1.5)
        c.close()


def killer(h, rnd):
    """Client processes that attach (holding a lease, the slab mapped), SIGKILLed at random moments."""
    script = os.path.join(INTEGRATION, "client_proc.py")
    while not h.stop.is_set():
        p = subprocess.Popen([sys.executable, script, h.daemon.socket, "attach", rnd.choice(h.tiny_paths)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        CHILDREN.add(p)
        if rnd.random() < 0.7:
            guard = threading.Timer(30 * SLOW, p.kill)  # never wait on a child that hangs
            guard.start()
            p.stdout.readline()  # its lease is held
            guard.cancel()
        else:
            time.sleep(rnd.random() * 0.05)  # somewhere in connect, hello or attach
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        CHILDREN.discard(p)
        h.stats.event("clients_killed")
        h.stop.wait(0.2 + rnd.random() * 0.5)  # each is a Python process: starting it costs a core for a while


def storm(h, n=240, hold=1.0):
    """More connections than descriptors: the daemon refuses the rest with LIMIT and keeps serving."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(h.daemon.socket)
        except OSError:
            s.close()
            break
        socks.append(s)
    time.sleep(hold)
    refused = 0
    for s in socks:
        s.setblocking(False)
        try:
            data = s.recv(4096)
            if b'"LIMIT"' in data:
                refused += 1
        except OSError:
            pass
        s.close()
    h.stats.event("storm_connections", len(socks))
    h.stats.event("storm_refused", refused)
    return refused


# ---- faults between rounds -----------------------------------------------------------------


def copy_victim(h, swap=True):
    """A fresh copy of the big checkpoint's shard, put in place as the victim (a new inode) when swap."""
    tmp = h.victim_file + ".new"
    shutil.copyfile(h.big_file, tmp)
    if swap:
        os.replace(tmp, h.victim_file)


def load_then(h, c, act):
    """Starts a load of the victim, runs act() once it has begun, returns its final code."""
    rid = f"v{time.monotonic_ns()}"
    c.start("load", id=rid, path=h.victim)
    first, _ = c.recv()
    begun = first.get("event") == "progress"
    if begun:
        act()
    final = first if not begun else c.wait(rid)[0]
    return result(final), begun


# Each fault opens its connections only once its files are ready: a connection
# left idle while a file is copied (seconds on a busy machine) is closed by
# idle_timeout_ms, as it should be.


def fault_truncate(h):
    size = os.path.getsize(h.victim_file)
    with connect(h) as c:
        wait_quiet(c)
        evict_path(c, h.victim)
        code, begun = load_then(h, c, lambda: os.truncate(h.victim_file, size // 3))
        h.stats.event(f"truncate_{code}")
        if begun and code not in ("FAULT", "STALE", "ok"):
            raise Failure(f"a load whose shard was truncated got {code}")
    copy_victim(h)
    with connect(h) as c:
        restored = result(c.request("load", path=h.victim)[0])
        if restored != "ok":
            raise Failure(f"the restored victim loads with {restored}")
    return code


def fault_replace(h):
    copy_victim(h, swap=False)
    with connect(h) as c:
        wait_quiet(c)
        evict_path(c, h.victim)
        code, begun = load_then(h, c, lambda: os.replace(h.victim_file + ".new", h.victim_file))
        h.stats.event(f"replace_{code}")
        if begun and code not in ("STALE", "ok"):
            raise Failure(f"a load whose shard was replaced got {code}")
        return code


def fault_device_nomem(h):
    """A leased set fills the budget; another big set cannot fit: DEVICE_NOMEM, nothing evicted that is leased."""
    with connect(h) as c:
        wait_quiet(c)
        att, fd = c.attach(path=h.big, device=0)
        os.close(fd)
        m, _ = c.request("load", path=h.big, plan={"preset": "auto", "tp_size": 2, "tp_rank": 0})
        code = result(m)
        h.stats.event(f"nomem_{code}")
        if code != "DEVICE_NOMEM":
            raise Failure(f"a load past the device budget got {code}")
        st = c.status()
        if not any(s["set"] == att["set"] and s["leases"] == 1 for s in st["sets"]):
            raise Failure("the leased big set was evicted")
        c.call("release", lease=att["lease"])
        return code


def wait_quiet(c, connections=None):
    """Waits until no job runs and no set is loading (and, if given, that many connections are open)."""

    def quiet():
        st = c.status()
        if st["daemon"]["jobs"] or any(s["state"] != "ready" for s in st["sets"]):
            return None
        return st if connections is None or st["daemon"]["connections"] == connections else None

    return wdclient.wait_until(quiet, timeout=60 * SLOW, interval=0.05,
                               what="jobs to finish" + (f" and {connections} connections" if connections else ""))


def evict_path(c, path):
    for s in c.status()["sets"]:
        if s["path"] == os.path.realpath(path):
            c.request("evict", set=s["set"])


# ---- the harness ---------------------------------------------------------------------------


class Harness:
    def __init__(self, args, workdir):
        self.args = args
        self.workdir = workdir
        self.stats = Stats()
        self.stop = threading.Event()
        self.daemon = None
        self.models = os.path.join(workdir, "models")
        os.makedirs(self.models)
        self.tiny_paths = []
        for name, seed in (("a", 1), ("b", 2), ("c", 3)):
            self.tiny_paths.append(wdfixtures.write_single(os.path.join(self.models, f"tiny_{name}"),
                                                           wdfixtures.TINY_TENSORS, seed))
        many = [(f"layers.{i}.w", "F16", [16, 8 + i % 7]) for i in range(400)]
        self.tiny_paths.append(wdfixtures.write_single(os.path.join(self.models, "many"), many, 4))
        self.ckpts = {p: wdclient.Checkpoint(p) for p in self.tiny_paths}
        self.big = wdfixtures.mkcheckpoint(os.path.join(self.models, "qwen3-0.6b-l2"), "qwen3-0.6b", 2)
        self.big_file = os.path.join(self.big, "model.safetensors")
        self.victim = os.path.join(self.models, "victim")
        os.makedirs(self.victim)
        self.victim_file = os.path.join(self.victim, "model.safetensors")
        copy_victim(self)

    def start_daemon(self):
        self.daemon = wdfixtures.Daemon(self.workdir, self.models, settings=SETTINGS, nofile=NOFILE)
        LIVE.append(self.daemon)
        return self.daemon.start()

    # ---- rounds ----

    def chaos_round(self, seed, nops, storms=1):
        """WORKERS workers, two never-readers, the killer, and storms; returns the seconds it took."""
        self.stop.clear()
        t0 = time.monotonic()
        workers = [Worker(self, f"w{seed}.{i}", nops, seed * 1000 + i) for i in range(self.args.workers)]
        rnd = random.Random(seed)
        others = [threading.Thread(target=never_reader, args=(self, random.Random(seed + 1)), daemon=True),
                  threading.Thread(target=never_reader, args=(self, random.Random(seed + 2)), daemon=True),
                  threading.Thread(target=killer, args=(self, random.Random(seed + 3)), daemon=True)]
        for t in workers + others:
            t.start()
        for _ in range(storms):
            time.sleep(1.0 + rnd.random())
            storm(self)
        for w in workers:
            w.join()
        self.stop.set()
        for t in others:
            t.join(30 * SLOW)
            if t.is_alive():
                self.stats.fail(f"{t.name} did not stop")
        return time.monotonic() - t0

    def settle(self):
        """No chaos client left, no job running, no unleased set, no checkpoint without a set."""
        with Conn(self.daemon.socket, timeout=CALL_TIMEOUT, client="settle") as c:
            wait_quiet(c, connections=3)  # the probe, the engine and this one
            c.call("evict", device=0)
            for ck in c.status()["checkpoints"]:
                if ck["sets"] == 0:
                    c.request("close", path=ck["path"])
            st = c.status()
            if st["daemon"]["leases"] != 3:
                raise Failure(f"after settling {st['daemon']['leases']} leases exist, want the probe's one and the "
                              "engine's two")
        # Let this connection go on the daemon's side, and the heap of large requests be returned (250 ms).
        wdclient.wait_until(lambda: self.probe.last_connections == 2, timeout=10 * SLOW, what="2 connections")
        time.sleep(0.5)
        return st

    def snapshot(self):
        return {"fds": self.daemon.fd_count(), "rss_anon_kib": self.daemon.rss_anon_kib()}


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def run(args):
    base = os.environ.get("WD_TEST_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="wds-", dir=base)
    report = {"rounds": args.rounds, "workers": args.workers, "ops_per_worker": args.ops, "seed": args.seed,
              "asan": wdfixtures.ASAN}
    h = None
    t_start = time.monotonic()
    try:
        h = Harness(args, workdir)

        # 1. A short chaos round, then SIGTERM in the middle of a load.
        d1 = h.start_daemon()
        h.probe = Probe(h)
        h.probe.start()
        h.chaos_round(args.seed + 1, max(5, args.ops // 4), storms=0)
        h.probe.finish()
        # The round's loads end after their clients went (canceled, or finishing their window): until then
        # they hold device budget, and the load below could find no room (DEVICE_NOMEM) instead of running.
        wdclient.wait_until(lambda: all(x["state"] not in ("loading", "canceling") for x in d1.status()["sets"]),
                            timeout=60 * SLOW,
                            what="the chaos round's loads to end")
        with Conn(d1.socket, timeout=DEADLINE * 4) as c:
            # A plan no worker loads (BIG_PLANS), so that this load cannot find its set ready.
            c.start("load", id="L", path=h.big, plan={"preset": "dense", "tp_size": 2, "tp_rank": 1})
            first, _ = c.recv()
            t0 = time.monotonic()
            d1.proc.send_signal(signal.SIGTERM)
            got = c.expect_closed(wdfixtures.STOP_SECONDS * 2) + [first]
            rc = d1.wait_exit(wdfixtures.STOP_SECONDS)
            if rc != 0:
                raise Failure(f"SIGTERM mid-load: the daemon exited with {rc}:\n{d1.log_tail()}")
            d1.check_exit(0)
            if os.path.exists(d1.socket):
                raise Failure("SIGTERM mid-load left the socket file behind")
            finals = [m for m in got if "event" not in m]
            if not all(result(m) in ("CANCELED", "SHUTDOWN") for m in finals):
                raise Failure(f"a load running at SIGTERM got {finals}")
            report["sigterm_stop_s"] = round(time.monotonic() - t0, 3)
        h.probe.conn.close()

        # 2. A new daemon, a warm-up round, the baseline.
        d = h.start_daemon()
        h.probe = Probe(h)
        engine = Conn(d.socket, timeout=DEADLINE * 4, client="engine")
        engine_sets = []
        for path in (h.tiny_paths[1], h.tiny_paths[3]):
            att, fd = engine.attach(path=path, device=0)
            engine_sets.append((att, fd, path))
        h.probe.start()
        h.chaos_round(args.seed + 2, max(10, args.ops // 2))
        fault_truncate(h)
        fault_replace(h)
        fault_device_nomem(h)
        h.settle()
        base_snap = h.snapshot()
        report["baseline"] = base_snap

        # 3. Chaos.
        t_chaos = time.monotonic()
        ops_before = sum(h.stats.ops.values())
        faults = []
        for r in range(args.rounds):
            h.chaos_round(args.seed + 10 + r, args.ops)
            for fault in (fault_truncate, fault_replace, fault_device_nomem):
                try:
                    faults.append(f"{fault.__name__}:{fault(h)}")
                except Failure as e:
                    h.stats.fail(f"{fault.__name__}: {e}")
            d.assert_alive()
        chaos_s = time.monotonic() - t_chaos
        chaos_ops = sum(h.stats.ops.values()) - ops_before
        report["chaos_seconds"] = round(chaos_s, 1)
        report["chaos_ops"] = chaos_ops
        report["ops_per_s"] = round(chaos_ops / chaos_s, 1)
        report["faults"] = faults

        # 4. Settle and compare.
        h.settle()
        # Closed connections may take a moment to go on the daemon's side; RssAnon waits for the trim.
        settled = time.monotonic() + 10 * SLOW
        while time.monotonic() < settled:
            now = h.snapshot()
            if now["fds"] == base_snap["fds"] and (
                    wdfixtures.ASAN or now["rss_anon_kib"] <= base_snap["rss_anon_kib"] + RSS_TOLERANCE_KIB):
                break
            time.sleep(0.1)
        final = h.snapshot()
        report["final"] = final
        h.probe.finish()
        if final["fds"] != base_snap["fds"]:
            h.stats.fail(f"descriptors: {base_snap['fds']} after warm-up, {final['fds']} after the chaos: "
                         f"{sorted(d.fd_targets().values())}")
        grew = final["rss_anon_kib"] - base_snap["rss_anon_kib"]
        if not wdfixtures.ASAN and grew > RSS_TOLERANCE_KIB:
            h.stats.fail(f"RssAnon grew by {grew} KiB over the chaos (tolerance {RSS_TOLERANCE_KIB} KiB)")
        # The engine sat idle through it all with its leases (never timed out): its bytes and leases are intact.
        for att, fd, path in engine_sets:
            wdclient.verify_attached(att, fd, h.ckpts[path])
            os.close(fd)
            if engine.call("release", lease=att["lease"])["released"] is not True:
                h.stats.fail(f"the engine's lease {att['lease']} was lost")
        if h.probe.conn.call("release", lease=h.probe.lease)["released"] is not True:
            h.stats.fail("the probe's lease was lost")
        engine.close()
        h.probe.conn.close()
        d.stop()
        report["log_out_of_descriptor_episodes"] = d.log_text().count("Too many open files")
    except Exception as e:  # Failure, AssertionError from the helpers, or a broken connection
        if h is not None:
            h.stats.fail(f"{type(e).__name__}: {e}")
        else:
            print(f"run_stress: FAILURE: {e}", file=sys.stderr)
            return 1
    finally:
        if h is not None:
            h.stop.set()
            if getattr(h, "probe", None) is not None:
                h.probe.halt.set()  # what follows kills the daemon: that is no failure of the probe's
        for p in list(CHILDREN):
            p.kill()
        for dm in LIVE:
            if dm.alive():
                print(f"---- log of weightd (pid {dm.pid}) ----\n{dm.log_tail(60)}", file=sys.stderr)
            dm.kill()
    if h is None:
        return 1
    st = h.stats
    lat = st.probe_latency
    report.update({
        "seconds": round(time.monotonic() - t_start, 1),
        "ops": dict(st.ops), "codes": dict(st.codes), "events": dict(st.events),
        "probe_status_count": len(lat), "probe_status_max_s": round(max(lat, default=0), 3),
        "probe_status_p99_s": round(percentile(lat, 0.99), 3), "failures": st.failures,
    })
    text = json.dumps(report, sort_keys=True)
    print("stress: " + text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    if st.failures:
        print(f"run_stress: {len(st.failures)} failure(s)", file=sys.stderr)
        return 1
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def main():
    asan = wdfixtures.ASAN
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=int(os.environ.get("WD_STRESS_ROUNDS", "2" if asan else "4")))
    p.add_argument("--workers", type=int, default=6)
    p.add_argument("--ops", type=int, default=int(os.environ.get("WD_STRESS_OPS", "15" if asan else "60")))
    p.add_argument("--seed", type=int, default=int(os.environ.get("WD_STRESS_SEED", "1")))
    p.add_argument("--report", default=os.environ.get("WD_STRESS_REPORT"))
    args = p.parse_args()

    def overrun():
        print(f"run_stress: over the time limit of {TIME_LIMIT} s; stacks follow", file=sys.stderr, flush=True)
        import faulthandler
        faulthandler.dump_traceback(all_threads=True)
        for dm in LIVE:
            if dm.alive():
                print(f"---- log of weightd (pid {dm.pid}) ----\n{dm.log_tail(60)}", file=sys.stderr, flush=True)
                dm.proc.kill()
        for c in list(CHILDREN):
            c.kill()
        os._exit(1)

    watchdog = threading.Timer(TIME_LIMIT, overrun)
    watchdog.daemon = True
    watchdog.start()
    rc = run(args)
    watchdog.cancel()
    return rc


if __name__ == "__main__":
    sys.exit(main())
