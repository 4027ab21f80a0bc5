"""The metrics endpoints (GET /metrics, /healthz, /readyz) and the status reply's "metrics" object.

A daemon started with metrics=True serves them on a loopback port of its own.
/metrics is read with prometheus_client's text parser, an implementation of
the exposition format independent of the daemon's; every family is then
compared with the status reply's "metrics" object sample by sample, and with
what the test itself did: the loads and their bytes, the evictions, every
error reply it received. The probes are checked while the backend is unusable
(the daemon out of descriptors), the endpoints off and moved by a reload, and
hostile HTTP clients must never delay the Unix-socket clients.
"""
import collections
import http.client
import json
import math
import mmap
import os
import re
import resource
import signal
import socket
import threading
import time

import pytest

# A missing dependency fails the run (pip install -r tests/requirements.txt), never skips it.
from prometheus_client.parser import text_string_to_metric_families

import wdclient
from conftest import REPO, SLOW, TINY_TENSORS, free_port, write_single
from wdclient import frame, wait_until

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Every family the daemon exports, with its label names (docs/operations.md lists them).
FAMILIES = {
    "weightd_loads_total": ("counter", {"result", "method"}),
    "weightd_load_duration_seconds": ("histogram", set()),
    "weightd_loaded_bytes_total": ("counter", set()),
    "weightd_read_bytes_total": ("counter", {"source"}),
    "weightd_last_load_gib_per_second": ("gauge", set()),
    "weightd_verified_chunks_total": ("counter", set()),
    "weightd_verify_mismatches_total": ("counter", set()),
    "weightd_scrubbed_bytes_total": ("counter", set()),
    "weightd_scrub_mismatches_total": ("counter", set()),
    "weightd_sets_corrupt": ("gauge", set()),
    "weightd_evictions_total": ("counter", {"reason"}),
    "weightd_sets_readopted_total": ("counter", set()),
    "weightd_resident_sets": ("gauge", {"device", "state"}),
    "weightd_resident_bytes": ("gauge", {"device"}),
    "weightd_device_budget_bytes": ("gauge", {"device"}),
    "weightd_device_memory_bytes": ("gauge", {"device"}),
    "weightd_device_free_bytes": ("gauge", {"device"}),
    "weightd_leases": ("gauge", set()),
    "weightd_checkpoints_open": ("gauge", set()),
    "weightd_checkpoint_bytes": ("gauge", {"path"}),
    "weightd_checkpoint_page_cache_bytes": ("gauge", {"path"}),
    "weightd_checkpoints_unlisted": ("gauge", set()),
    "weightd_checkpoints_unlisted_bytes": ("gauge", set()),
    "weightd_checkpoints_unlisted_page_cache_bytes": ("gauge", set()),
    "weightd_checkpoint_charged_bytes": ("gauge", set()),
    "weightd_checkpoint_mappings": ("gauge", set()),
    "weightd_checkpoints_closed_total": ("counter", {"reason"}),
    "weightd_checkpoint_opens_refused_total": ("counter", set()),
    "weightd_plans_reused_total": ("counter", set()),
    "weightd_pinned_bytes": ("gauge", set()),
    "weightd_pin_budget_bytes": ("gauge", set()),
    "weightd_errors_total": ("counter", {"code"}),
    "weightd_connections": ("gauge", set()),
    "weightd_requests_total": ("counter", set()),
    "weightd_requests_in_flight": ("gauge", set()),
    "weightd_reply_bytes_queued": ("gauge", set()),
    "weightd_reply_disconnects_total": ("counter", {"limit"}),
    "weightd_progress_events_dropped_total": ("counter", set()),
    "weightd_open_fds": ("gauge", set()),
    "weightd_max_fds": ("gauge", set()),
    "weightd_ready": ("gauge", set()),
    "weightd_build_info": ("gauge", {"version", "backend"}),
    "weightd_uptime_seconds": ("gauge", set()),
}
RESULTS = {"ok", "failed", "canceled"}
METHODS = {"memcpy", "staged", "direct", "peer", "striped"}  # peer, striped: replicas and striped loads (docs/multi-gpu.md)
REASONS = {"budget", "device_full", "request", "reload"}
# Every error code of the table (docs/protocol.md), each with its own sample.
CODES = {"IO", "NOMEM", "INVALID", "NOT_FOUND", "BAD_HEADER", "BAD_TENSOR", "BAD_SIZE", "BAD_INDEX",
         "BAD_CONFIG", "PATH_DENIED", "BAD_REQUEST", "PROTOCOL", "VERSION", "PERMISSION", "BUSY", "CANCELED",
         "DEVICE", "DEVICE_NOMEM", "STALE", "FAULT", "BAD_PLAN", "CONNECT", "CLOSED", "TIMEOUT", "UNSUPPORTED",
         "SHUTDOWN", "LIMIT", "BAD_CHECKSUM", "INTERNAL", "BAD_TABLE"}


# ---- HTTP -------------------------------------------------------------------------------


class Http:
    """One HTTP/1.1 connection to the daemon's endpoints (kept alive), optionally from a given loopback source."""

    def __init__(self, address, source=None, timeout=None):
        host, port = address.rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=timeout or 10 * SLOW,
                                               source_address=(source, 0) if source else None)

    def get(self, path, method="GET"):
        """(status, body as text, response).

        The daemon closes a connection idle for 5 s; as a scraper does, this
        then asks again on a new one (local_port() tells).
        """
        try:
            self.conn.request(method, path)
            r = self.conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.conn.close()
            self.conn.request(method, path)
            r = self.conn.getresponse()
        return r.status, r.read().decode(), r

    def local_port(self):
        """The connection's local port; it must still be open (kept alive)."""
        assert self.conn.sock is not None, "the daemon closed the connection after answering"
        return self.conn.sock.getsockname()[1]

    def close(self):
        self.conn.close()


def get(address, path, source=None):
    h = Http(address, source)
    try:
        return h.get(path)[:2]
    finally:
        h.close()


def scrape(h):
    status, body, r = h.get("/metrics")
    assert status == 200, body
    assert r.getheader("Content-Type") == CONTENT_TYPE
    return body


# ---- the two views as one shape -------------------------------------------------------------
#
# {family name as the daemon writes it: {"type", "help", "samples": {(sample name, labels): value}}},
# labels being a sorted tuple of (name, value) pairs.


def from_text(text):
    out = {}
    for f in text_string_to_metric_families(text):
        # The parser names a counter's family without its _total suffix.
        name = f.name + "_total" if f.type == "counter" else f.name
        assert name not in out, f"family {name} twice"
        samples = {}
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, f"sample {key} twice"
            samples[key] = s.value
        out[name] = {"type": f.type, "help": f.documentation, "samples": samples}
    return out


def from_json(metrics):
    out = {}
    for name, f in metrics.items():
        samples = {}
        suffix = "_bucket" if f["type"] == "histogram" else ""
        for s in f["samples"]:
            key = (name + suffix, tuple(sorted(s["labels"].items())))
            assert key not in samples, f"sample {key} twice"
            samples[key] = s["value"]
        if f["type"] == "histogram":
            samples[(name + "_sum", ())] = f["sum"]
            samples[(name + "_count", ())] = f["count"]
        out[name] = {"type": f["type"], "help": f["help"], "samples": samples}
    return out


def value(fams, family, sample=None, **labels):
    """One sample's value (sample defaults to the family's name)."""
    return fams[family]["samples"][(sample or family, tuple(sorted(labels.items())))]


def by_label(fams, family, label):
    """{label value: sample value} of a family with one label."""
    return {dict(k[1])[label]: v for k, v in fams[family]["samples"].items()}


def check_exposition(text, fams):
    """The text is well formed beyond what the parser forgives, and every family is as documented."""
    assert text.endswith("\n")
    declared = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            declared.append(line.split()[2])
        elif line.startswith("# TYPE "):
            assert line.split()[2] == declared[-1], f"TYPE without its HELP: {line}"
        else:
            assert not line.startswith("#") and line, f"unexpected line {line!r}"
            name = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            assert name.startswith(declared[-1]), f"sample {name} outside its family {declared[-1]}"
    assert len(declared) == len(set(declared)) == len(fams)
    assert set(fams) == set(FAMILIES), f"families: {sorted(set(fams) ^ set(FAMILIES))}"
    for name, f in fams.items():
        typ, labels = FAMILIES[name]
        assert f["type"] == typ, (name, f["type"])
        assert f["help"] and f["help"].endswith("."), (name, f["help"])
        for (sname, slabels), v in f["samples"].items():
            names = {k for k, _ in slabels}
            if typ == "histogram":
                assert sname in (name + "_bucket", name + "_sum", name + "_count"), sname
                assert names == ({"le"} if sname.endswith("_bucket") else set()), (sname, names)
            else:
                assert sname == name, sname
                assert names == labels, (name, names)
            if typ == "counter":
                assert v >= 0 and v == int(v), (sname, slabels, v)
    for name, (typ, _) in FAMILIES.items():
        if typ == "histogram":
            check_histogram(fams, name)


def check_histogram(fams, name):
    """Buckets in increasing order of le, cumulative, the last +Inf and equal to _count."""
    samples = fams[name]["samples"]
    buckets = [(dict(k[1])["le"], v) for k, v in samples.items() if k[0] == name + "_bucket"]
    les = [float(le) for le, _ in buckets]
    assert buckets[-1][0] == "+Inf" and math.isinf(les[-1])
    assert les == sorted(les) and len(set(les)) == len(les), les
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), f"{name}: buckets not cumulative: {buckets}"
    count = samples[(name + "_count", ())]
    total = samples[(name + "_sum", ())]
    assert counts[-1] == count, f"{name}: +Inf bucket {counts[-1]} != count {count}"
    assert total >= 0 and (count == 0) == (total == 0), (count, total)


# Samples whose value moves between two collections without anything happening (free
# memory: a health probe that a collection started may measure it in between).
MOVING = {"weightd_uptime_seconds", "weightd_open_fds", "weightd_reply_bytes_queued", "weightd_requests_in_flight", "weightd_device_free_bytes"}


def check_same(json_fams, text_fams):
    """The status reply's "metrics" and /metrics, collected moments apart, family by family and sample by sample."""
    assert set(json_fams) == set(text_fams)
    for name in json_fams:
        j, t = json_fams[name], text_fams[name]
        assert (j["type"], j["help"]) == (t["type"], t["help"]), name
        assert set(j["samples"]) == set(t["samples"]), (name, set(j["samples"]) ^ set(t["samples"]))
        if name in MOVING:
            continue
        for key, v in j["samples"].items():
            assert t["samples"][key] == pytest.approx(v, rel=1e-12, abs=0), (key, v, t["samples"][key])


# ---- the daemon's listening sockets -------------------------------------------------------------


def tcp_listening_ports(pid):
    """The TCP ports the process listens on (its sockets that /proc/net/tcp{,6} show in LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def refused(address):
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


# ---- checkpoints ---------------------------------------------------------------------------------


def tiny_qwen3(d):
    """A one-layer Qwen3-shaped checkpoint of about 100 KiB with its config.json, for a TP plan."""
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    os.makedirs(d)
    H, I, V, NH, KV, HD = 64, 128, 128, 4, 2, 16
    layer = "model.layers.0."
    tensors = [("model.embed_tokens.weight", "BF16", [V, H]),
               (layer + "input_layernorm.weight", "BF16", [H]),
               (layer + "post_attention_layernorm.weight", "BF16", [H]),
               (layer + "self_attn.q_proj.weight", "BF16", [NH * HD, H]),
               (layer + "self_attn.k_proj.weight", "BF16", [KV * HD, H]),
               (layer + "self_attn.v_proj.weight", "BF16", [KV * HD, H]),
               (layer + "self_attn.o_proj.weight", "BF16", [H, NH * HD]),
               (layer + "self_attn.q_norm.weight", "BF16", [HD]),
               (layer + "self_attn.k_norm.weight", "BF16", [HD]),
               (layer + "mlp.gate_proj.weight", "BF16", [I, H]),
               (layer + "mlp.up_proj.weight", "BF16", [I, H]),
               (layer + "mlp.down_proj.weight", "BF16", [H, I]),
               ("model.norm.weight", "BF16", [H]),
               ("lm_head.weight", "BF16", [V, H])]
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=11)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
                   "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
                   "vocab_size": V, "num_hidden_layers": 1, "tie_word_embeddings": False}, f)
    return d


@pytest.fixture(scope="module")
def qwen3(model_root):
    return tiny_qwen3(os.path.join(model_root, "metrics-qwen3"))


# ---- the tests ---------------------------------------------------------------------------------


def test_probes_and_exposition(start_daemon):
    """/healthz, /readyz, /metrics on one kept-alive connection; the exposition is well formed and documented."""
    d = start_daemon(metrics=True)
    h = Http(d.metrics_address)
    status, body, r = h.get("/healthz")
    assert (status, body, r.getheader("Connection")) == (200, "ok\n", None)
    port = h.local_port()
    assert h.get("/readyz")[:2] == (200, "ready\n")
    text = scrape(h)
    status, body, r = h.get("/metrics", method="HEAD")
    assert (status, body, r.getheader("Content-Type")) == (200, "", CONTENT_TYPE)
    status, body, _ = h.get("/nope")
    assert status == 404 and "/metrics" in body
    # Every answer so far came on one connection: the daemon keeps it alive.
    assert h.local_port() == port
    status, body, _ = h.get("/metrics", method="POST")
    assert (status, body) == (405, "only GET and HEAD\n")
    h.close()

    fams = from_text(text)
    check_exposition(text, fams)
    assert by_label(fams, "weightd_evictions_total", "reason") == dict.fromkeys(REASONS, 0)
    assert by_label(fams, "weightd_errors_total", "code") == dict.fromkeys(CODES, 0)
    loads = fams["weightd_loads_total"]["samples"]
    assert {tuple(v for _, v in k[1]) for k in loads} == {(m, r) for r in RESULTS for m in METHODS}
    assert set(loads.values()) == {0}
    st = d.status()
    uuid = st["devices"][0]["uuid"]
    assert by_label(fams, "weightd_resident_bytes", "device") == {uuid: 0}
    assert {dict(k[1])["state"] for k in fams["weightd_resident_sets"]["samples"]} == {"loading", "ready"}
    assert value(fams, "weightd_build_info", version=st["daemon"]["version"], backend="host") == 1
    assert value(fams, "weightd_ready") == 1
    # The status reply carries the same families.
    assert set(st["metrics"]) == set(FAMILIES)
    # Every family is documented.
    with open(os.path.join(REPO, "docs", "operations.md")) as f:
        doc = f.read()
    missing = [n for n in FAMILIES if f"`{n}`" not in doc]
    assert not missing, f"not in docs/operations.md: {missing}"


def count_error(errors, c, code, op, **fields):
    got = c.error(op, **fields)
    assert got == code, (op, fields, got)
    errors[code] += 1


def test_metrics_agree_with_status_and_truth(start_daemon, tiny, qwen3, model_root):
    """After loads, a lease, an eviction, a cancel and errors of known codes, /metrics == status == what was done."""
    d = start_daemon({"socket_mode": "0666"}, metrics=True, public=True)
    h = Http(d.metrics_address)
    errors = collections.Counter()
    tp_plan = {"preset": "auto", "tp_size": 2, "tp_rank": 0}
    with d.connect() as c:
        whole = c.call("load", path=tiny["a"], device=0)
        tp = c.call("load", path=qwen3, device=0, plan=tp_plan)
        assert whole["method"] == tp["method"] == "memcpy" and not whole["shared"] and not tp["shared"]
        ck = wdclient.Checkpoint(qwen3)
        assert tp["payload_bytes"] < ck.payload_bytes()  # rank 0 of 2: a part
        ck.close()
        _, fd = c.attach(set=whole["set"])  # the lease lasts as long as the connection
        os.close(fd)
        assert c.call("evict", set=tp["set"])["evicted"] == [tp["set"]]
        # A path label that needs escaping in the text format (\\, \", \n) and none in JSON.
        odd = write_single(os.path.join(model_root, 'metrics "odd" back\\slash\nline'), TINY_TENSORS, 6)
        c.call("open", path=odd)

        count_error(errors, c, "NOT_FOUND", "load", path=os.path.join(model_root, "no-such-checkpoint"), device=0)
        count_error(errors, c, "NOT_FOUND", "attach", set="s999999")
        count_error(errors, c, "BAD_REQUEST", "load", path=42)
        count_error(errors, c, "BAD_PLAN", "load", path=tiny["a"], device=0, plan={"preset": "nope"})
        count_error(errors, c, "PATH_DENIED", "open", path="/etc")
        count_error(errors, c, "BUSY", "evict", set=whole["set"])
        if os.geteuid() == 0:  # another uid may not stop the daemon
            from test_peers import as_nobody
            got = as_nobody(d.socket, [{"op": "hello", "id": 1, "protocol": 1}, {"op": "shutdown", "id": 2}])
            assert got[1]["error"]["code"] == "PERMISSION", got
            errors["PERMISSION"] += 1
        # A load canceled as it starts.
        c.send_raw(frame({"op": "load", "id": "x", "path": tiny["b"], "device": 0})
                   + frame({"op": "cancel", "id": "cx", "target": "x"}))
        assert c.wait("cx")[0].get("canceled") is True
        assert c.wait("x")[0]["error"]["code"] == "CANCELED"
        errors["CANCELED"] += 1
        wait_until(lambda: len(c.status()["sets"]) == 1, timeout=10 * SLOW, what="the canceled set to go")

        # Page-cache residency is measured on a job: the first collection after an open starts it.
        st = c.status()
        paths = {ck["path"] for ck in st["checkpoints"]}
        assert {os.path.realpath(tiny["a"]), os.path.realpath(qwen3), os.path.realpath(odd)} <= paths

        def measured():
            return set(by_label(from_text(scrape(h)), "weightd_checkpoint_page_cache_bytes", "path")) == paths

        wait_until(measured, timeout=5 * SLOW, what="page-cache residency of every open checkpoint")

        # The two views, back to back on the same connections.
        st = c.status()
        text = scrape(h)
        json_fams, fams = from_json(st["metrics"]), from_text(text)
        check_exposition(text, fams)
        check_same(json_fams, fams)
        fds_now = d.fd_count()

        # ... and against what happened.
        uuid = st["devices"][0]["uuid"]
        loads = {(dict(k[1])["result"], dict(k[1])["method"]): v
                 for k, v in fams["weightd_loads_total"]["samples"].items()}
        assert loads[("ok", "memcpy")] == 2
        assert sum(v for (r, _), v in loads.items() if r == "ok") == 2
        assert sum(v for (r, _), v in loads.items() if r == "failed") == 0
        assert loads[("canceled", "staged")] == loads[("canceled", "direct")] == 0
        assert value(fams, "weightd_loaded_bytes_total") == whole["payload_bytes"] + tp["payload_bytes"]
        h_count = value(fams, "weightd_load_duration_seconds", "weightd_load_duration_seconds_count")
        h_sum = value(fams, "weightd_load_duration_seconds", "weightd_load_duration_seconds_sum")
        assert h_count == 2
        assert h_sum == pytest.approx(whole["seconds"] + tp["seconds"], rel=1e-6)
        assert value(fams, "weightd_last_load_gib_per_second") == pytest.approx(tp["gib_per_s"], rel=1e-3)
        assert by_label(fams, "weightd_evictions_total", "reason") == {"budget": 0, "device_full": 0, "request": 1,
                                                                      "reload": 0}
        ready = [s for s in st["sets"] if s["state"] == "ready"]
        assert [s["set"] for s in ready] == [whole["set"]]
        assert value(fams, "weightd_resident_bytes", device=uuid) == sum(s["bytes"] for s in ready) == whole["bytes"]
        assert value(fams, "weightd_resident_sets", device=uuid, state="ready") == 1
        assert value(fams, "weightd_resident_sets", device=uuid, state="loading") == 0
        assert value(fams, "weightd_leases") == st["daemon"]["leases"] == 1
        dev = st["devices"][0]
        assert value(fams, "weightd_device_memory_bytes", device=uuid) == dev["memory_total"]
        for fs in (json_fams, fams):
            assert 0 < value(fs, "weightd_device_free_bytes", device=uuid) <= dev["memory_total"]
        # The host backend's budget: half of memory when device_memory_budget is 0.
        assert dev["budget"] == 0
        assert value(fams, "weightd_device_budget_bytes", device=uuid) == dev["memory_total"] // 2
        assert value(fams, "weightd_checkpoints_open") == len(st["checkpoints"])
        sizes = by_label(fams, "weightd_checkpoint_bytes", "path")
        cached = by_label(fams, "weightd_checkpoint_page_cache_bytes", "path")
        page = os.sysconf("SC_PAGE_SIZE")
        for ck in st["checkpoints"]:
            size = os.path.getsize(os.path.join(ck["path"], "model.safetensors"))
            assert sizes[ck["path"]] == size
            # Measured alike by the status job, in whole pages of the files.
            assert 0 < cached[ck["path"]] == ck["resident_bytes"] <= -(-size // page) * page
        assert value(fams, "weightd_pinned_bytes") == 0
        assert value(fams, "weightd_pin_budget_bytes") == dev["memory_total"] // 2
        assert by_label(fams, "weightd_errors_total", "code") == {code: errors[code] for code in CODES}
        assert value(fams, "weightd_connections") == st["daemon"]["connections"] == 1
        # The status request was in flight while it collected; nothing is while /metrics is.
        assert value(json_fams, "weightd_requests_in_flight") == 1
        assert value(fams, "weightd_requests_in_flight") == 0
        assert abs(value(fams, "weightd_open_fds") - fds_now) <= 1
        with open(f"/proc/{d.pid}/limits") as f:
            nofile = int(next(line for line in f if line.startswith("Max open files")).split()[3])
        assert value(fams, "weightd_max_fds") == nofile
        assert value(fams, "weightd_ready") == 1
        assert value(fams, "weightd_build_info", version=st["daemon"]["version"], backend="host") == 1
        up_json, up_text = value(json_fams, "weightd_uptime_seconds"), value(fams, "weightd_uptime_seconds")
        assert up_json == pytest.approx(st["daemon"]["uptime_s"], abs=0.01)
        assert 0 <= up_text - up_json < 5 * SLOW

        # One more request counts once.
        before = value(from_text(scrape(h)), "weightd_requests_total")
        c.call("health")
        assert value(from_text(scrape(h)), "weightd_requests_total") == before + 1
    h.close()


def test_readyz_fails_while_the_backend_is_unusable(start_daemon):
    """Out of descriptors, the host backend cannot read /proc/meminfo: /readyz 503 with the reason, then 200 again.

    Clients cannot run the daemon out of descriptors (connections and queued replies stay within its
    descriptor budget: docs/reliability.md, test_limits.py), so the test lowers the running daemon's
    soft RLIMIT_NOFILE to 0 (prlimit), which fails every descriptor it would open, and raises it back.
    """
    nofile = 48
    d = start_daemon(metrics=True, nofile=nofile)
    h = Http(d.metrics_address)  # opened now: no descriptor is needed to ask it later
    assert h.get("/readyz")[:2] == (200, "ready\n")
    held = d.connect()
    assert held.call("health") == {"id": held.next_id - 1, "ok": True, "ready": True}
    assert value(from_text(scrape(h)), "weightd_max_fds") == nofile
    try:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (0, nofile))
        # The health probe runs at most every 5 s, started by the health op (here) or
        # /readyz (below) when due. /healthz starts none: it keeps the HTTP connection open.
        deadline = time.monotonic() + 12 * SLOW
        while True:
            assert h.get("/healthz")[:2] == (200, "ok\n")
            rep = held.call("health")
            if not rep["ready"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert rep["ready"] is False, rep
        assert "/proc/meminfo" in rep["reason"], rep
        status, body, _ = h.get("/readyz")
        assert (status, body) == (503, f"not ready: {rep['reason']}\n")
        fams = from_text(scrape(h))
        assert value(fams, "weightd_ready") == 0
        assert value(fams, "weightd_open_fds") == nofile  # none can be opened to count them with: the limit
        assert value(from_json(held.status()["metrics"]), "weightd_ready") == 0
        assert "backend stopped answering" in d.log_text()
    finally:
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (nofile, nofile))
    deadline = time.monotonic() + 12 * SLOW
    while True:
        status, body, _ = h.get("/readyz")
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (status, body) == (200, "ready\n")
    assert held.call("health")["ready"] is True
    assert value(from_text(scrape(h)), "weightd_ready") == 1
    held.close()
    h.close()


def test_free_memory_is_measured_without_status(start_daemon):
    """weightd_device_free_bytes follows the device's memory through the health probes, with no status call."""
    d = start_daemon(metrics=True)
    h = Http(d.metrics_address)
    uuid = next(iter(by_label(from_text(scrape(h)), "weightd_device_free_bytes", "device")))

    def free():
        return value(from_text(scrape(h)), "weightd_device_free_bytes", device=uuid)

    before = free()
    # Memory this process really uses, so that the host's MemAvailable surely moves
    # (other processes move it too, either way: the test asks only that the figure follows).
    taken = 256 << 20
    buf = mmap.mmap(-1, taken)
    try:
        chunk = b"\x01" * (16 << 20)
        for _ in range(taken // len(chunk)):
            buf.write(chunk)
        # The next probe is due at most 5 s after the last; a scrape starts it, a later one shows it.
        wait_until(lambda: free() != before, timeout=15 * SLOW, interval=0.5,
                   what="the free memory to be measured again")
    finally:
        buf.close()
    st = d.status()  # only now
    assert 0 < free() <= st["devices"][0]["memory_total"]
    h.close()


def test_endpoints_off_when_unset(start_daemon):
    """metrics_address "" (the tests' default): no TCP port at all; status still has the figures."""
    on = start_daemon(metrics=True)
    port = int(on.metrics_address.rsplit(":", 1)[1])
    assert tcp_listening_ports(on.pid) == {port}  # the check sees a port when there is one
    d = start_daemon()
    assert d.metrics_address == "" and "metrics_address=" in d.argv()
    assert tcp_listening_ports(d.pid) == set()
    assert "metrics and probes" not in d.log_text()
    st = d.status()
    assert set(st["metrics"]) == set(FAMILIES)
    assert from_json(st["metrics"])["weightd_ready"]["samples"] == {("weightd_ready", ()): 1}


def test_reload_moves_the_endpoints(start_daemon, workdir):
    """metrics_address from the config file: SIGHUP moves the endpoints to a new port, then turns them off."""
    p1 = free_port()
    p2 = free_port()
    while p2 == p1:
        p2 = free_port()
    a1, a2 = f"127.0.0.1:{p1}", f"127.0.0.1:{p2}"
    config = os.path.join(workdir, f"metrics-reload-{p1}.json")

    def write_config(address):
        with open(config + ".tmp", "w") as f:
            json.dump({"metrics_address": address}, f)
        os.replace(config + ".tmp", config)

    write_config(a1)
    d = start_daemon({"metrics_address": None}, config=config)
    assert get(a1, "/healthz") == (200, "ok\n")
    assert tcp_listening_ports(d.pid) == {p1}

    write_config(a2)
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: tcp_listening_ports(d.pid) == {p2}, timeout=5 * SLOW, what="the endpoints to move")
    assert get(a2, "/healthz") == (200, "ok\n")
    assert get(a2, "/readyz") == (200, "ready\n")
    assert refused(a1)

    write_config("")
    d.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: tcp_listening_ports(d.pid) == set(), timeout=5 * SLOW, what="the endpoints to close")
    assert refused(a2)
    assert d.log_text().count("SIGHUP: reloading") == 2
    d.check_serving()


def test_hostile_http_clients_never_delay_the_socket(start_daemon):
    """Slowloris, a huge header and 1000 connection attempts: Unix-socket status calls go on being answered."""
    d = start_daemon(metrics=True)
    host, port = d.metrics_address.rsplit(":", 1)
    port = int(port)
    baseline = d.quiet_fd_count()
    answered, failures = [], []
    stop = threading.Event()

    def probe():
        try:
            # A loop blocked by an HTTP client leaves a call unanswered: the Conn's timeout
            # turns that into a failure (how fast answers come is the machine's business).
            with d.connect(timeout=30 * SLOW) as c:
                while not stop.is_set():
                    st = c.status()
                    answered.append(st["daemon"]["pid"] == d.pid)
                    time.sleep(0.02)
        except Exception as e:  # reported by the main thread
            failures.append(repr(e))

    def connect(source, blocking=True):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        if blocking:
            s.settimeout(5)
            s.connect((host, port))
        else:
            s.setblocking(False)
            s.connect_ex((host, port))
        return s

    def closed_by_peer(s):
        try:
            s.setblocking(False)
            return s.recv(1 << 16) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    prober = threading.Thread(target=probe)
    prober.start()
    idle = slow = burst = []
    try:
        # An idle connection is dropped after the 5 s timeout.
        idle = [connect("127.0.0.5")]
        t_idle = time.monotonic()
        # Slowloris: more connections than one address may hold, each dripping a header.
        slow = [connect("127.0.0.2") for _ in range(40)]
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        # A header larger than a connection's 32 KiB: refused, and closed.
        with connect("127.0.0.3") as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
            reply = b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                reply += chunk
        assert reply.split(b"\r\n")[0] in (b"HTTP/1.1 431 Request Header Fields Too Large",
                                           b"HTTP/1.1 413 Request Entity Too Large"), reply[:200]
        # 1000 connection attempts from 200 addresses, held for a second.
        burst = [connect(f"127.0.1.{1 + i % 200}", blocking=False) for i in range(1000)]
        time.sleep(1)
        for s in burst:
            s.close()
        # The drip goes on past the idle timeout.
        for _ in range(6):
            for s in slow:
                try:
                    s.send(b"a")
                except OSError:
                    pass
            time.sleep(1)
        dropped = sum(closed_by_peer(s) for s in slow)
        assert dropped >= 40 - 32, f"only {dropped} of 40 slowloris connections refused (32 per address)"
        assert closed_by_peer(idle[0]), f"an idle connection was kept {time.monotonic() - t_idle:.1f} s"
        # Another address is still served while one holds its 32.
        assert get(d.metrics_address, "/healthz", source="127.0.0.1") == (200, "ok\n")
    finally:
        for s in idle + slow + burst:
            s.close()
        stop.set()
        prober.join()
    assert not failures, failures
    assert len(answered) > 50 and all(answered), answered
    # Every HTTP connection is gone again.
    wait_until(lambda: d.quiet_fd_count() == baseline, timeout=10 * SLOW, what="descriptors back to the baseline")
    assert get(d.metrics_address, "/healthz") == (200, "ok\n")
    d.check_serving()
