"""Loads from an object store: the daemon fetches a checkpoint named by URL from its remote roots.

A real S3 server (SeaweedFS, signatures enforced) holds checkpoints the tests upload; the daemon
(host backend) is started with --remote-root and the credentials in its environment. Every set
loaded from a URL is compared with the files: whole checkpoints byte for byte against the local
copy, tensor-parallel ranks (column slices: strided reads) byte for byte against the same plan
loaded from the local copy, with the in-place copy and the staged pipeline. URLs outside the
remote roots are refused before anything is fetched; an object replaced after the open fails the
next load with STALE and the checkpoint is opened again.
"""
import json
import os
import subprocess
import sys
import signal
import tempfile
import threading
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from wdclient import Checkpoint, WDError, map_readonly, verify_attached, write_safetensors
from wdfixtures import REPO, SLOW, WEIGHTCTL, WEIGHTD

sys.path.insert(0, os.path.dirname(__file__))
from test_early_attach import qwen3_tp  # noqa: E402,F401  (a fixture: a Qwen3-shaped checkpoint, ~38 MiB)
from test_remote_ckpt import SIGNED, upload, write_checkpoint  # noqa: E402
from test_fetch import merged_requests  # noqa: E402  (fetch.h's merge rule, written from its contract)

sys.path.insert(0, os.path.join(REPO, "tests", "remote"))
import s3server  # noqa: E402
from faultproxy import FaultProxy, Rule  # noqa: E402


@pytest.fixture
def store(tmp_path):
    with s3server.SeaweedS3(tmp_path / "seaweedfs", start_timeout=90 * SLOW) as s3:
        yield s3


def with_roots(start_daemon, store, roots, settings=None, **kw):
    """A daemon whose remote roots are `roots` (through --set, as a flag would)."""
    env = dict(SIGNED, AWS_ENDPOINT_URL_S3=store.endpoint, AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent-wd-test", AWS_CONFIG_FILE="/nonexistent-wd-test")
    d = start_daemon(settings=settings, env=env, extra_args=[a for r in roots for a in ("--remote-root", r)], **kw)
    return d


def slab_bytes(c, **fields):
    att, fd = c.attach(**fields)
    try:
        m, size = map_readonly(fd)
        try:
            return att, bytes(m[:att["bytes"]])
        finally:
            m.close()
    finally:
        os.close(fd)


def test_whole_checkpoint_from_s3_equals_the_files(start_daemon, store, model_root, tmp_path):
    d = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    upload(store, "ckpt", "org/m", d)
    wd = with_roots(start_daemon, store, ["s3://ckpt/org"], metrics=True)
    url = "s3://ckpt/org/m"
    ck = Checkpoint(d)
    with wd.connect() as c:
        rep = c.call("load", path=url, device=0)
        assert rep["read_from"] == "remote", rep
        assert rep["read_bytes"] == {"remote": ck.payload_bytes()}, rep
        att, fd = c.attach(path=url)
        try:
            assert verify_attached(att, fd, ck) == ck.payload_bytes()
        finally:
            os.close(fd)
        st = c.status()
        (s,) = st["sets"]
        assert s["path"] == url and s["read_from"] == "remote", s
        (entry,) = [x for x in st["checkpoints"] if x["path"] == url]
        assert entry["origin"] == "remote", entry
        # The same layout id as the local copy's.
        local = c.call("open", path=d)["checkpoint"]
        assert entry["layout_id"] == local["layout_id"], (entry, local)
        assert local["origin"] == "files", local
        # The engine's counters: at least the payload, the headers and the index were fetched; nothing in flight.
        remote = st["daemon"]["remote"]
        assert remote["roots"] == ["s3://ckpt/org"] and remote["credentials"] == "environment", remote
        assert remote["bytes"] > ck.payload_bytes() and remote["in_flight"] == 0, remote
        assert remote["responses"]["2xx"] > 0 and remote["responses"]["5xx"] == 0, remote
        # The metrics say the same.
        text = urllib.request.urlopen(f"http://{wd.metrics_address}/metrics", timeout=30).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        (b,) = fams["weightd_remote_bytes"].samples
        assert b.value >= remote["bytes"], (b, remote)
        by_source = {x.labels["source"]: x.value for x in fams["weightd_read_bytes"].samples}
        assert by_source["remote"] == ck.payload_bytes(), by_source
    assert f"remote root s3://ckpt/org" in wd.log_text()
    assert "credentials from environment" in wd.log_text()


@pytest.mark.parametrize("method,tp", [("auto", 2), ("staged", 2), ("staged", 4)])
def test_tp_rank_from_s3_equals_the_local_rank(start_daemon, store, qwen3_tp, method, tp):
    upload(store, "ckpt", "qwen3-tp", qwen3_tp)
    wd = with_roots(start_daemon, store, ["s3://ckpt/qwen3-tp"], settings={"load_method": method})
    url = "s3://ckpt/qwen3-tp"
    for rank in (0, tp - 1):
        plan = {"preset": "auto", "tp_size": tp, "tp_rank": rank}
        with wd.connect() as c:
            lrep = c.call("load", path=qwen3_tp, device=0, plan=plan)
            rrep = c.call("load", path=url, device=0, plan=plan)
            assert rrep["read_from"] == "remote" and set(rrep["read_bytes"]) == {"remote"}, rrep
            # Exactly the rank's bytes were fetched: what the local load read from its files.
            assert sum(rrep["read_bytes"].values()) == sum(lrep["read_bytes"].values()), (lrep, rrep)
            assert rrep["payload_bytes"] < Checkpoint(qwen3_tp).payload_bytes()
            if method == "staged":
                assert rrep["method"] == "staged", rrep
            la, lb = slab_bytes(c, path=qwen3_tp, plan=plan)
            ra, rb = slab_bytes(c, path=url, plan=plan)
            assert [(t["name"], t["offset"]) for t in la["tensors"]] == [(t["name"], t["offset"]) for t in ra["tensors"]]
            assert lb == rb, f"rank {rank}: the remote slab differs from the local one"
            # Column slices come as whole rows in few requests, never a request per row.
            st = c.status()["daemon"]["remote"]
            assert st["responses"]["2xx"] < 200, st


def test_urls_outside_the_remote_roots_are_refused(start_daemon, store, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    upload(store, "ckpt", "allowed/m", d)
    upload(store, "ckpt", "allowed2/m", d)
    upload(store, "other", "m", d)
    wd = with_roots(start_daemon, store, ["s3://ckpt/allowed"])
    with wd.connect() as c:
        for url in ("s3://ckpt/allowed2/m", "s3://other/m", f"{store.endpoint}/ckpt/allowed/m",
                    "s3://ckpt/allowed/../allowed2/m"):
            with pytest.raises(WDError) as e:
                c.call("load", path=url, device=0)
            assert e.value.code in ("PATH_DENIED", "INVALID"), (url, e.value.reply)
            if e.value.code == "PATH_DENIED":
                assert "not within the remote roots" in e.value.message, e.value.message
        assert c.call("load", path="s3://ckpt/allowed/m", device=0)["read_from"] == "remote"
    # Nothing outside the roots was asked of the store: only the allowed checkpoint's objects.
    assert "allowed2" not in wd.log_text()


def test_no_remote_roots_means_no_fetch(daemon, store):
    with daemon.connect() as c:
        with pytest.raises(WDError) as e:
            c.call("load", path="s3://ckpt/anything", device=0)
        assert e.value.code == "PATH_DENIED", e.value.reply
        assert "none is configured" in e.value.message, e.value.message


def test_object_replaced_after_open_is_stale_then_reopened(start_daemon, store, tmp_path):
    d = write_checkpoint(str(tmp_path / "m"))
    upload(store, "ckpt", "r/m", d)
    wd = with_roots(start_daemon, store, ["s3://ckpt/r"])
    url = "s3://ckpt/r/m"
    with wd.connect() as c:
        first = c.call("load", path=url, device=0)
        c.call("evict", set=first["set"])
        # The second shard replaced by other bytes of the same layout.
        other = write_checkpoint(str(tmp_path / "other"), seed=8)
        store.put("ckpt", "r/m/model-00002-of-00002.safetensors",
                  os.path.join(other, "model-00002-of-00002.safetensors"))
        # Checked a moment ago (REG_REMOTE_RECHECK_MS), the open checkpoint is used: its load finds the object
        # changed (If-Match), fails naming it, and the next request asks the store again and reopens it.
        with pytest.raises(WDError) as e:
            c.call("load", path=url, device=0)
        assert e.value.code == "STALE" and "model-00002-of-00002.safetensors" in e.value.message, e.value.reply
        rep = c.call("load", path=url, device=0)
        att, fd = c.attach(path=url)
        try:
            mixed = Checkpoint(d)
            new = Checkpoint(other)
            table = {t["name"]: t for t in att["tensors"]}
            m, _ = map_readonly(fd)
            try:
                for name in ("layers.1.w", "lm_head.weight"):
                    src, b, e = new.tensor_bytes(name)
                    t = table[name]
                    assert m[t["offset"]:t["offset"] + e - b] == src[b:e], name
                src, b, e = mixed.tensor_bytes("embed.weight")
                assert m[table["embed.weight"]["offset"]:table["embed.weight"]["offset"] + e - b] == src[b:e]
            finally:
                m.close()
        finally:
            os.close(fd)
    assert "changed since it was opened" in wd.log_text() or "reopening" in wd.log_text(), wd.log_tail(40)


@pytest.fixture
def qwen3_moe(model_root):
    """A one-layer Qwen3-MoE-shaped checkpoint (~62 MiB): 8 experts of 6 MiB, the router and attention before
    them in the file and a norm after, so that an EP=2 rank's tensors touch in the file: rank 0 reads the
    attention, the router and experts 0-3 as one run, then the tail norms and heads."""
    d = os.path.join(model_root, "remote-qwen3-moe")
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    os.makedirs(d)
    H, I, V, NH, KV, HD, E = 1024, 1024, 2048, 8, 4, 128, 8
    p = "model.layers.0."
    tensors = [("model.embed_tokens.weight", "BF16", [V, H]), (p + "input_layernorm.weight", "BF16", [H]),
               (p + "self_attn.q_proj.weight", "BF16", [NH * HD, H]), (p + "self_attn.k_proj.weight", "BF16", [KV * HD, H]),
               (p + "self_attn.v_proj.weight", "BF16", [KV * HD, H]), (p + "self_attn.o_proj.weight", "BF16", [H, NH * HD]),
               (p + "self_attn.q_norm.weight", "BF16", [HD]), (p + "self_attn.k_norm.weight", "BF16", [HD]),
               (p + "mlp.gate.weight", "BF16", [E, H])]
    for e in range(E):
        tensors += [(p + f"mlp.experts.{e}.gate_proj.weight", "BF16", [I, H]),
                    (p + f"mlp.experts.{e}.up_proj.weight", "BF16", [I, H]),
                    (p + f"mlp.experts.{e}.down_proj.weight", "BF16", [H, I])]
    tensors += [(p + "post_attention_layernorm.weight", "BF16", [H]), ("model.norm.weight", "BF16", [H]),
                ("lm_head.weight", "BF16", [V, H])]
    write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=29)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H,
                   "moe_intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
                   "vocab_size": V, "num_hidden_layers": 1, "num_experts": E, "num_experts_per_tok": 2,
                   "tie_word_embeddings": False}, f)
    return d


def file_ranges(ckpt_dir, plan):
    """The file ranges of shard model.safetensors that a plan of whole tensors reads ((offset, length),
    ascending), from the plan weightctl builds here and the file's header."""
    args = [WEIGHTCTL, "plan", ckpt_dir, "--json", "--preset", plan["preset"], "--ep-size", str(plan["ep_size"]),
            "--ep-rank", str(plan["ep_rank"])]
    desc = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    with open(os.path.join(ckpt_dir, "model.safetensors"), "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    out = set()
    for o in desc["outputs"]:
        for pc in o["pieces"]:
            h = hdr[pc["tensor"]]
            b, e = h["data_offsets"]
            assert pc["dim"] == 0 and pc["start"] == 0 and pc["end"] == h["shape"][0], pc  # whole tensors only
            out.add((8 + n + b, e - b))
    return sorted(out)


def test_ep_rank_reads_merged_as_the_rule_says(start_daemon, store, qwen3_moe):
    """An EP=2 rank's tensors that touch in the file are fetched as one run cut into 8 MiB parts (fetch.h's
    merge rule): the Range headers the store saw during the load are exactly the rule's, no byte outside
    the rank's tensors, and the slab equals the same plan loaded from the files."""
    upload(store, "ckpt", "moe", qwen3_moe)
    with FaultProxy("127.0.0.1", store.port, []) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/moe"])
        url = "s3://ckpt/moe"
        for rank in (0, 1):
            plan = {"preset": "auto", "ep_size": 2, "ep_rank": rank}
            ranges = file_ranges(qwen3_moe, plan)
            want = merged_requests(ranges, 8 << 20)
            assert len(want) < len(ranges), (want, ranges)  # the plan's ranges do merge
            with wd.connect() as c:
                c.call("open", path=url)
                asked = len(proxy.log())
                rrep = c.call("load", path=url, device=0, plan=plan)
                seen = [e for e in proxy.log()[asked:] if e["method"] == "GET" and "range" in e["headers"]]
                got = sorted(tuple(int(x) for x in e["headers"]["range"].removeprefix("bytes=").split("-"))
                             for e in seen)
                assert got == sorted(want), (rank, got, want)
                assert all(e["path"].endswith("/model.safetensors") for e in seen)
                assert sum(rrep["read_bytes"].values()) == sum(n for _, n in ranges), rrep
                lrep = c.call("load", path=qwen3_moe, device=0, plan=plan)
                la, lb = slab_bytes(c, path=qwen3_moe, plan=plan)
                ra, rb = slab_bytes(c, path=url, plan=plan)
                assert [(t["name"], t["offset"]) for t in la["tensors"]] == [(t["name"], t["offset"]) for t in ra["tensors"]]
                assert lb == rb, f"EP rank {rank}: the remote slab differs from the local one"
                assert sum(lrep["read_bytes"].values()) == sum(rrep["read_bytes"].values())


# ---- faults: the fault proxy between the daemon and the store ---------------------------------------


def proxied(start_daemon, store, proxy, roots, settings=None):
    env = dict(SIGNED, AWS_ENDPOINT_URL_S3=proxy.url, AWS_EC2_METADATA_DISABLED="true",
               AWS_SHARED_CREDENTIALS_FILE="/nonexistent-wd-test", AWS_CONFIG_FILE="/nonexistent-wd-test")
    return start_daemon(settings=settings, env=env, extra_args=[a for r in roots for a in ("--remote-root", r)],
                        metrics=True)


def test_load_through_5xx_429_and_dropped_bodies_equals_the_local_rank(start_daemon, store, qwen3_tp):
    upload(store, "ckpt", "faulty", qwen3_tp)
    rules = [Rule("status", status=503, method="GET", path="model.safetensors", skip=3, times=2),
             Rule("status", status=429, method="GET", path="model.safetensors", skip=6, times=1),
             Rule("drop", after_bytes=1000, method="GET", path="model.safetensors", skip=8, times=2),
             Rule("drop", after_bytes=0, reset=True, method="GET", path="model.safetensors", skip=12, times=1)]
    with FaultProxy("127.0.0.1", store.port, rules) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/faulty"], settings={"load_method": "staged"})
        plan = {"preset": "auto", "tp_size": 2, "tp_rank": 1}
        with wd.connect() as c:
            lrep = c.call("load", path=qwen3_tp, device=0, plan=plan)
            rrep = c.call("load", path="s3://ckpt/faulty", device=0, plan=plan)
            assert sum(rrep["read_bytes"].values()) == sum(lrep["read_bytes"].values()), (lrep, rrep)
            _, lb = slab_bytes(c, path=qwen3_tp, plan=plan)
            _, rb = slab_bytes(c, path="s3://ckpt/faulty", plan=plan)
            assert lb == rb, "bytes read through the faults differ from the local rank's"
            remote = c.status()["daemon"]["remote"]
        # Every rule fired, and each fault was tried again.
        assert [r.applied for r in rules] == [2, 1, 2, 1], [(r, r.applied) for r in rules]
        # The three answers (503, 503, 429) are always the engine's retries; a connection reset before any
        # response may instead be resent by libcurl itself on a reused connection, which the engine does not see.
        assert remote["retries"] >= 3, remote
        assert remote["responses"]["5xx"] >= 2 and remote["responses"]["4xx"] >= 1, remote


def test_object_replaced_mid_load_fails_the_load_naming_it(start_daemon, store, qwen3_tp, tmp_path):
    upload(store, "ckpt", "swap", qwen3_tp)
    other = str(tmp_path / "other.safetensors")
    data = bytearray(open(os.path.join(qwen3_tp, "model.safetensors"), "rb").read())
    data[-1] ^= 0xFF  # the same header, another last byte: another object
    open(other, "wb").write(bytes(data))
    replaced = []

    def swap():
        if not replaced:
            store.put("ckpt", "swap/model.safetensors", other)
            replaced.append(True)

    rules = [Rule("replace", action=swap, method="GET", path="model.safetensors", skip=4, times=1)]
    with FaultProxy("127.0.0.1", store.port, rules) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/swap"], settings={"load_method": "staged"})
        with wd.connect() as c:
            with pytest.raises(WDError) as e:
                c.call("load", path="s3://ckpt/swap", device=0)
            assert e.value.code == "STALE", e.value.reply
            assert "s3://ckpt/swap/model.safetensors" in e.value.message, e.value.message
            assert not c.status()["sets"], "a load that failed left a set"
            # The next load opens the new object and holds its bytes.
            c.call("load", path="s3://ckpt/swap", device=0)
            att, fd = c.attach(path="s3://ckpt/swap")
            try:
                m, _ = map_readonly(fd)
                try:
                    (t,) = [t for t in att["tensors"] if t["name"] == "lm_head.weight"]
                    end = t["offset"] + 2 * t["shape"][0] * t["shape"][1]  # BF16
                    assert m[end - 1] == data[-1], "the reopened checkpoint does not hold the new bytes"
                finally:
                    m.close()
            finally:
                os.close(fd)
    assert replaced


def test_every_op_and_weightctl_take_a_url(start_daemon, store, model_root, tmp_path):
    d = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    upload(store, "ckpt", "ops/m", d)
    wd = with_roots(start_daemon, store, ["s3://ckpt/ops"])
    url = "s3://ckpt/ops/m"
    with wd.connect() as c:
        ck = c.call("open", path=url)["checkpoint"]
        assert ck["path"] == url and ck["origin"] == "remote" and ck["shards"] == 2, ck
        # A remote checkpoint keeps nothing warm on the node (no node cache yet): prefetch says so.
        with pytest.raises(WDError) as e:
            c.call("prefetch", path=url, wait=True)
        assert e.value.code == "UNSUPPORTED" and url in e.value.message, e.value.reply
        c.call("close", path=url)
        assert url not in [x["path"] for x in c.status()["checkpoints"]]
    # weightctl sends the URL as it is (a path it would make absolute).
    env = dict(os.environ, WEIGHTD_SOCKET=wd.socket)
    r = subprocess.run([WEIGHTCTL, "--json", "load", url], capture_output=True, text=True, env=env,
                       timeout=120 * SLOW)
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads(r.stdout.splitlines()[-1])
    assert rep["read_from"] == "remote", rep
    # prewarm: opened and loaded, never prefetched (nothing local to read ahead); again, the set is shared.
    for _ in range(2):
        r = subprocess.run([WEIGHTCTL, "--json", "prewarm", url], capture_output=True, text=True, env=env,
                           timeout=120 * SLOW)
        assert r.returncode == 0, r.stdout + r.stderr
        pw = json.loads(r.stdout.splitlines()[-1])
        assert pw["prefetched"] is False and pw["sets"][0]["set"] == rep["set"], pw
        assert pw["sets"][0]["shared"] is True, pw
    ck = Checkpoint(d)
    with wd.connect() as c:
        att, fd = c.attach(path=url)
        try:
            assert verify_attached(att, fd, ck) == ck.payload_bytes()
        finally:
            os.close(fd)
    # Commands that read the files on this machine refuse a URL, saying so (usage: exit 2).
    for args in (["plan", url], ["inspect", url], ["export", url, "--out", "/tmp/x"], ["manifest", url],
                 ["verify", url], ["attach", "--verify", url]):
        r = subprocess.run([WEIGHTCTL, *args], capture_output=True, text=True, env=env, timeout=60 * SLOW)
        assert r.returncode == 2 and "is a URL" in r.stderr, (args, r.returncode, r.stderr)


def test_https_endpoint_with_http2_and_its_ca(start_daemon, qwen3_tp, tmp_path):
    with s3server.SeaweedS3(tmp_path / "seaweedfs-tls", tls=True, start_timeout=90 * SLOW) as tls:
        upload(tls, "ckpt", "tls", qwen3_tp)
        env = dict(SIGNED, AWS_ENDPOINT_URL_S3=tls.https_endpoint, AWS_EC2_METADATA_DISABLED="true",
                   AWS_SHARED_CREDENTIALS_FILE="/nonexistent-wd-test", AWS_CONFIG_FILE="/nonexistent-wd-test")
        plan = {"preset": "auto", "tp_size": 2, "tp_rank": 0}
        # Without the test CA the server's certificate is refused, naming the URL.
        wd = start_daemon(env=env, extra_args=["--remote-root", "s3://ckpt/tls"])
        with wd.connect() as c:
            with pytest.raises(WDError) as e:
                c.call("load", path="s3://ckpt/tls", device=0, plan=plan)
            assert "s3://ckpt/tls" in e.value.message and "certificate" in e.value.message, e.value.reply
        wd.stop()
        # With it: the rank over TLS, on HTTP/2, equal to the local rank.
        wd = start_daemon(env=env, settings={"remote_ca_file": tls.ca_file},
                          extra_args=["--remote-root", "s3://ckpt/tls"])
        with wd.connect() as c:
            lrep = c.call("load", path=qwen3_tp, device=0, plan=plan)
            rrep = c.call("load", path="s3://ckpt/tls", device=0, plan=plan)
            assert sum(rrep["read_bytes"].values()) == sum(lrep["read_bytes"].values())
            _, lb = slab_bytes(c, path=qwen3_tp, plan=plan)
            _, rb = slab_bytes(c, path="s3://ckpt/tls", plan=plan)
            assert lb == rb
            remote = c.status()["daemon"]["remote"]
            # Every response came over HTTP/2 (the 404 of the absent manifest too).
            answered = sum(v for k, v in remote["responses"].items() if k != "none")
            assert remote["responses"]["2xx"] > 0 and remote["http2_responses"] == answered, remote


# ---- http(s) roots with a bearer token ---------------------------------------------------------


def test_http_root_with_a_bearer_token(start_daemon, qwen3_tp, tmp_path):
    token = "wd-test-" + os.urandom(12).hex()
    tok = tmp_path / "token"
    tok.write_text(token + "\n")
    with s3server.SeaweedS3(tmp_path / "s3-public", anonymous_read=["public"], start_timeout=90 * SLOW) as s3:
        upload(s3, "public", "m", qwen3_tp)
        gate = Rule("require_bearer", token=token, times=None)
        with FaultProxy("127.0.0.1", s3.port, [gate]) as proxy:
            root = f"{proxy.url}/public"
            url = f"{root}/m"
            plan = {"preset": "auto", "tp_size": 2, "tp_rank": 1}
            # Without the token: the server's 401, naming the URL.
            wd = start_daemon(extra_args=["--remote-root", root])
            with wd.connect() as c:
                with pytest.raises(WDError) as e:
                    c.call("load", path=url, device=0, plan=plan)
                assert "401" in e.value.message and url in e.value.message, e.value.reply
            wd.stop()
            # With it: every request carries it, and the rank equals the local one.
            wd = start_daemon(settings={"remote_bearer_token_files": f"{root}={tok}"}, extra_args=["--remote-root", root])
            asked = len(proxy.log())
            with wd.connect() as c:
                lrep = c.call("load", path=qwen3_tp, device=0, plan=plan)
                rrep = c.call("load", path=url, device=0, plan=plan)
                assert sum(rrep["read_bytes"].values()) == sum(lrep["read_bytes"].values())
                _, lb = slab_bytes(c, path=qwen3_tp, plan=plan)
                _, rb = slab_bytes(c, path=url, plan=plan)
                assert lb == rb
                st = json.dumps(c.status())
            seen = proxy.log()[asked:]
            assert seen and all(e["headers"].get("authorization") == f"Bearer {token}" for e in seen), seen[:3]
            assert all(e["status"] != 401 for e in seen)
            # The secret is in no log line and no status.
            assert token not in wd.log_text() and token not in st
            assert "requests carry its bearer token" in wd.log_text()


def test_bad_remote_configuration_refuses_to_start(workdir, model_root, tmp_path):
    secret = "wd-secret-" + os.urandom(8).hex()
    spaced = tmp_path / "spaced"
    spaced.write_text(f"{secret} more\n")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    cases = [
        (["--remote-root", "ftp://host/x"], "remote root"),
        (["--remote-root", "s3://b/x?versionId=1"], "remote root"),
        (["--remote-root", "https://h.example/m", "--set", "remote_bearer_token_files=https://other.example/m=/x"],
         "is not one of the http(s) remote roots"),
        (["--remote-root", "https://h.example/m", "--set", f"remote_bearer_token_files=https://h.example/m={spaced}"],
         "must be one line of printable ASCII"),
        (["--remote-root", "https://h.example/m", "--set", f"remote_bearer_token_files=https://h.example/m={empty}"],
         "is empty"),
        (["--remote-root", "https://h.example/m", "--set",
          f"remote_bearer_token_files=https://h.example/m={tmp_path / 'missing'}"], "missing"),
        (["--set", f"remote_bearer_token_files=https://h.example/m={spaced}"], "no remote_roots are configured"),
    ]
    for args, msg in cases:
        sock = os.path.join(tempfile.mkdtemp(prefix="rr-", dir=workdir), "s.sock")
        r = subprocess.run([WEIGHTD, "--foreground", "--backend", "host", "--socket", sock, "--model-root", model_root,
                            "--set", "metrics_address=", *args], stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=30 * SLOW, env=dict(os.environ, AWS_EC2_METADATA_DISABLED="true"))
        assert r.returncode != 0 and msg in r.stderr, (args, r.returncode, r.stderr)
        assert secret not in r.stderr, r.stderr


# ---- ranges checked against the manifest ---------------------------------------------------------


def test_corrupted_ranges_caught_by_the_manifest(start_daemon, store, qwen3_tp, tmp_path):
    """A byte flipped in flight: with a manifest it is caught, fetched again, and the load holds the right
    bytes (or fails naming the bytes when every fetch is corrupted); without one it would be kept."""
    mf = str(tmp_path / "weightd.manifest.json")
    r = subprocess.run([WEIGHTCTL, "manifest", qwen3_tp, "--out", mf], capture_output=True, text=True,
                       timeout=120 * SLOW)
    assert r.returncode == 0, r.stderr
    upload(store, "ckpt", "plain", qwen3_tp)
    upload(store, "ckpt", "checked", qwen3_tp)
    store.put("ckpt", "checked/weightd.manifest.json", mf)
    plan = {"preset": "auto", "tp_size": 2, "tp_rank": 0}
    flip = Rule("flip", offset=12345, method="GET", path="model.safetensors", skip=3, times=1)
    with FaultProxy("127.0.0.1", store.port, [flip]) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt"], settings={"load_method": "staged"})
        with wd.connect() as c:
            lrep = c.call("load", path=qwen3_tp, device=0, plan=plan)
            _, lb = slab_bytes(c, path=qwen3_tp, plan=plan)
            # Caught and fetched again: the right bytes, one mismatch counted.
            rep = c.call("load", path="s3://ckpt/checked", device=0, plan=plan)
            assert flip.applied == 1
            ra, rb = slab_bytes(c, path="s3://ckpt/checked", plan=plan)
            assert rb == lb, "a corrupted range was kept although the manifest names its digest"
            assert sum(rep["read_bytes"].values()) == sum(lrep["read_bytes"].values())
            (s,) = [x for x in c.status()["sets"] if x["set"] == rep["set"]]
            text = urllib.request.urlopen(f"http://{wd.metrics_address}/metrics", timeout=30).read().decode()
            fams = {f.name: f for f in text_string_to_metric_families(text)}
            assert fams["weightd_verify_mismatches"].samples[0].value == 1, fams["weightd_verify_mismatches"]
            assert fams["weightd_verified_chunks"].samples[0].value >= 2
            assert "differ from weightd.manifest.json: fetching them again" in wd.log_text()
            # Every fetch corrupted: the load fails naming the URL, the file and the bytes; nothing stays.
            c.call("release", lease=ra["lease"])
            c.call("evict", set=rep["set"])
            proxy.set_rules([Rule("flip", offset=777, method="GET", path="model.safetensors", times=None)])
            with pytest.raises(WDError) as e:
                c.call("load", path="s3://ckpt/checked", device=0, plan=plan)
            assert e.value.code == "BAD_CHECKSUM", e.value.reply
            m = e.value.message
            assert "s3://ckpt/checked" in m and "model.safetensors" in m and "fetched twice" in m, m
            assert not [x for x in c.status()["sets"] if x["path"] == "s3://ckpt/checked"]
            # Without a manifest nothing can tell: the flipped byte is kept (why a manifest should be published).
            proxy.set_rules([Rule("flip", offset=5, method="GET", path="model.safetensors", skip=3, times=1)])
            c.call("load", path="s3://ckpt/plain", device=0, plan=plan)
            _, pb = slab_bytes(c, path="s3://ckpt/plain", plan=plan)
            assert pb != lb


def test_store_outage_leaves_resident_sets_attachable(start_daemon, store, model_root, tmp_path):
    """Once its objects cannot be checked (the store answers 503), an open remote checkpoint is served as opened:
    a resident set stays attachable; a changed object would still be caught by If-Match on any read."""
    d = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    upload(store, "ckpt", "outage/m", d)
    with FaultProxy("127.0.0.1", store.port, []) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/outage"])
        url = "s3://ckpt/outage/m"
        with wd.connect() as c:
            rep = c.call("load", path=url, device=0)
            proxy.set_rules([Rule("status", status=503, times=None)])
            time.sleep(10.5)  # past REG_REMOTE_RECHECK_MS: the next request asks the store, which cannot answer
            att, fd = c.attach(path=url)
            try:
                assert att["set"] == rep["set"]
                assert verify_attached(att, fd, Checkpoint(d)) == Checkpoint(d).payload_bytes()
            finally:
                os.close(fd)
        assert proxy.count(method="HEAD", status=503) > 0
        assert "cannot check its objects now" in wd.log_text()


def test_stalled_store_holds_up_neither_local_opens_nor_the_stop(start_daemon, store, qwen3_tp, model_root, tmp_path):
    """Remote opens wait on their own pool: two that stall leave local opens served at once; SIGTERM ends the
    daemon without waiting for the stalled server (its requests are aborted)."""
    for i in range(2):
        upload(store, "ckpt", f"slow/m{i}", qwen3_tp)
    local = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    with FaultProxy("127.0.0.1", store.port, [Rule("stall", seconds=300, method="HEAD", times=None)]) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/slow"])
        done = []

        def remote_open(i):
            try:
                with wd.connect() as c:
                    c.call("open", path=f"s3://ckpt/slow/m{i}")
                done.append(("ok", i))
            except Exception as e:  # the stop's CANCELED, or the connection closing
                done.append((type(e).__name__, i))

        ts = [threading.Thread(target=remote_open, args=(i,), daemon=True) for i in range(2)]
        for t in ts:
            t.start()
        with wd.connect() as c:  # until both remote opens wait on the stalled server
            for _ in range(600):
                if c.status()["daemon"]["remote"]["in_flight"] >= 2:
                    break
                time.sleep(0.05)
            assert c.status()["daemon"]["remote"]["in_flight"] >= 2
        with wd.connect() as c:
            c.call("open", path=local)  # served while the remote ones still wait
        assert done == [], done
        wd.proc.send_signal(signal.SIGTERM)
        assert wd.proc.wait(timeout=120 * SLOW) == 0  # well before the 300 s stall ends
        wd.stopped = True
        for t in ts:
            t.join(timeout=60)
        assert len(done) == 2 and all(k != "ok" for k, _ in done), done


def test_objects_without_validators_are_refused(start_daemon, store, model_root, tmp_path):
    """A server that gives neither ETag nor Last-Modified: a changed object could not be told apart mid-load."""
    d = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    upload(store, "ckpt", "noval/m", d)
    strip = Rule("strip_response_headers", names=["ETag", "Last-Modified"], times=None)
    with FaultProxy("127.0.0.1", store.port, [strip]) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/noval"])
        with wd.connect() as c:
            with pytest.raises(WDError) as e:
                c.call("open", path="s3://ckpt/noval/m")
            assert e.value.code == "UNSUPPORTED" and "no ETag or Last-Modified" in e.value.message, e.value.reply
            assert "s3://ckpt/noval/m" in e.value.message


def test_optional_files_refused_403_are_absent(start_daemon, store, model_root, tmp_path):
    """AWS answers 403 (not 404) for a missing key to a caller without s3:ListBucket."""
    d = write_checkpoint(os.path.join(model_root, "remote-" + tmp_path.name))
    os.unlink(os.path.join(d, "config.json"))
    upload(store, "ckpt", "aws/m", d)
    rules = [Rule("status", status=403, path="weightd.manifest.json", times=None),
             Rule("status", status=403, path="/config.json", times=None),
             Rule("status", status=403, path="/model.safetensors", method="HEAD", times=None)]
    with FaultProxy("127.0.0.1", store.port, rules) as proxy:
        wd = proxied(start_daemon, store, proxy, ["s3://ckpt/aws"])
        with wd.connect() as c:
            ck = c.call("open", path="s3://ckpt/aws/m")["checkpoint"]
            assert ck["layout"] == "index" and ck["shards"] == 2, ck
        # The index itself refused is an error naming it.
        proxy.set_rules([Rule("status", status=403, path="index.json", times=None)])
        with wd.connect() as c:
            with pytest.raises(WDError) as e:
                c.call("open", path="s3://ckpt/aws/m2")
            assert "403" in e.value.message or e.value.code in ("PERMISSION", "NOT_FOUND"), e.value.reply
