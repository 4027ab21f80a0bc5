"""The plan flags and the `plan` and `export` commands of weightctl.

Covers the command line, not the presets' semantics (test_layouts.py
compares every preset with an independent reference): the plan flags and
their usage errors (exit 2, one line), the spec they make (checked through
the plan's canonical key), `weightctl plan` (per-output lines, totals, the
per-rank table, --json), and `weightctl export` (a valid safetensors
checkpoint: tensors in plan order, padded headers, the metadata, the greedy
shard rule, the index, config.json, stale files, refusals). The exported
bytes are compared with bytes re-derived here from `plan --json`'s piece
descriptions and the source files, and with the bytes a real daemon (host
backend) serves for the same plan; `attach --verify` must pass for a plan
and must catch a changed byte inside the rank's slice, and only there.

The checkpoint is qwen3-0.6b with one layer (654 MB, one file): 16 query
heads and 8 key/value heads of 128, hidden 1024, intermediate 3072, a
vocabulary of 151936 (a multiple of 64), tied embeddings.
"""
import array
import json
import mmap
import os
import shutil
import socket
import struct

import numpy as np
import pytest

import stref

HIDDEN, INTER, VOCAB, HEAD = 1024, 3072, 151936, 128
Q_ROWS, KV_ROWS = 16 * HEAD, 8 * HEAD
MB = 1 << 20


# ---- fixtures and helpers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ck(tmp_path_factory, weightctl):
    """qwen3-0.6b, one layer, under a directory that serves as the daemon's model root."""
    root = tmp_path_factory.mktemp("cli-plan")
    out = root / "models" / "q06"
    res = stref.run_ctl(["mkcheckpoint", "--preset", "qwen3-0.6b", "--layers", "1", "--out", str(out)], timeout=300)
    assert res.returncode == 0, res.describe()
    yield out
    shutil.rmtree(root, ignore_errors=True)


def ok(args, timeout=stref.CTL_TIMEOUT_S):
    res = stref.run_ctl([str(a) for a in args], timeout=timeout)
    assert res.returncode == 0, res.describe()
    return res


def plan_json(ck, *flags):
    return json.loads(ok(["plan", ck, "--json", *flags]).stdout)


def usage_error(args, *needles):
    """args must fail as a usage error: exit 2, one 'weightctl: ' line naming each needle."""
    res = stref.run_ctl([str(a) for a in args])
    assert res.returncode == 2, res.describe()
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightctl: "), res.describe()
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    assert res.stdout == "", res.describe()


def failure(args, *needles):
    """args must fail cleanly: exit 1, one 'weightctl: ' line naming each needle."""
    res = stref.run_ctl([str(a) for a in args])
    problem = stref.error_line_problem(res)
    assert problem is None, problem + "\n" + res.describe()
    for n in needles:
        assert n in res.stderr, f"{n!r} not in {res.stderr!r}"
    return res


def inspect(path):
    res, js = stref.inspect_json(path)
    assert js is not None, res.describe()
    return js


def read_file(path):
    with open(path, "rb") as f:
        return f.read()


class Source:
    """The checkpoint's tensors as numpy byte views (bytes, never values)."""

    def __init__(self, path):
        self.buf = np.memmap(path / "model.safetensors", dtype=np.uint8, mode="r")
        (n,) = struct.unpack("<Q", bytes(self.buf[:8]))
        self.header = json.loads(bytes(self.buf[8:8 + n]))
        self.header.pop("__metadata__", None)
        self.start = 8 + n

    def view(self, name):
        """The tensor as an array of shape + [bytes per element] (uint8)."""
        t = self.header[name]
        b, e = t["data_offsets"]
        size = stref.DTYPE_BITS[t["dtype"]] // 8
        return self.buf[self.start + b:self.start + e].reshape(list(t["shape"]) + [size])


def derive(src, out):
    """The bytes of one `plan --json` output, from its piece descriptions alone."""
    row = stref.tensor_bytes(out["dtype"], [1] + out["shape"][1:]) if out["shape"] else 0
    parts = []
    for p in out["pieces"]:
        if "zeros" in p:
            parts.append(bytes(p["zeros"] * row))
            continue
        v = src.view(p["tensor"])
        index = [slice(None)] * v.ndim
        index[p["dim"]] = slice(p["start"], p["end"])
        parts.append(np.ascontiguousarray(v[tuple(index)]).tobytes())
    data = b"".join(parts)
    assert len(data) == out["nbytes"], (out["name"], len(data), out["nbytes"])
    return data


def greedy_files(outputs, limit):
    """save_pretrained's rule, written here: lists of output names per file."""
    files, size = [[]], 0
    for o in outputs:
        if files[-1] and size + o["nbytes"] > limit:
            files.append([])
            size = 0
        files[-1].append(o["name"])
        size += o["nbytes"]
    return files


def read_export(out_dir):
    """{file: (ordered header entries, metadata, data bytes)} after checking each file with the reference."""
    files = {}
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".safetensors"):
            continue
        buf = read_file(out_dir / name)
        ref = stref.reference(buf)
        assert ref.ok, f"{name}: the reference refuses it: {ref.error}"
        (n,) = struct.unpack("<Q", buf[:8])
        assert (8 + n) % 8 == 0, f"{name}: header of {n} bytes is not padded to 8"
        header = json.loads(buf[8:8 + n])  # keeps the file's order
        meta = header.pop("__metadata__")
        files[name] = (list(header.items()), meta, buf[8 + n:])
    return files


def check_export(ck, out_dir, plan, limit=4_000_000_000):
    """Everything export promises for plan, against the files in out_dir."""
    outs = plan["outputs"]
    want_files = greedy_files(outs, limit)
    names = ["model.safetensors"] if len(want_files) == 1 else [
        f"model-{k + 1:05d}-of-{len(want_files):05d}.safetensors" for k in range(len(want_files))]
    files = read_export(out_dir)
    assert sorted(files) == names, (sorted(files), names)
    src = Source(ck)
    by_name = {o["name"]: o for o in outs}
    order = []
    for fname, group in zip(names, want_files):
        entries, meta, data = files[fname]
        assert [e[0] for e in entries] == group, f"{fname}: tensors or order differ from the plan's"
        assert sorted(meta) == ["format", "weightd_plan", "weightd_source"] and meta["format"] == "pt", meta
        assert json.loads(meta["weightd_plan"]) == plan["key"], meta
        assert meta["weightd_source"] == os.path.realpath(ck), meta
        off = 0
        for name, t in entries:
            o = by_name[name]
            assert t["dtype"] == o["dtype"] and t["shape"] == o["shape"], (name, t, o)
            assert t["data_offsets"] == [off, off + o["nbytes"]], (name, t["data_offsets"], off)
            assert data[off:off + o["nbytes"]] == derive(src, o), f"{fname}: bytes of {name} differ"
            off += o["nbytes"]
        assert off == len(data)
        order += [e[0] for e in entries]
    assert order == [o["name"] for o in outs]
    index = out_dir / "model.safetensors.index.json"
    if len(names) == 1:
        assert not index.exists()
    else:
        idx = json.loads(read_file(index))
        assert idx["metadata"]["total_size"] == plan["payload_bytes"]
        assert list(idx["weight_map"]) == sorted(by_name)
        assert idx["weight_map"] == {n: names[k] for k, g in enumerate(want_files) for n in g}
    assert read_file(out_dir / "config.json") == read_file(ck / "config.json")
    js = inspect(out_dir)
    assert js["tensor_count"] == len(outs) and js["total_bytes"] == plan["payload_bytes"]
    assert not [f for f in os.listdir(out_dir) if f.endswith(".tmp")]


# ---- the daemon -------------------------------------------------------------------------------


def dctl(d, *args):
    """weightctl against the test daemon; must succeed."""
    return ok(["--socket", d.socket, *args], timeout=120)


def dctl_result(d, *args):
    return stref.run_ctl(["--socket", d.socket, *map(str, args)], timeout=120)


@pytest.fixture
def daemon(ck):
    d = stref.Daemon(ck.parent)
    yield d
    complaint = d.stop()
    assert complaint is None, complaint


def attach_raw(sock_path, req):
    """attach over the raw protocol: (reply, the slab mapped read-only)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.settimeout(120)
    fds = []

    def recv_frame():
        def exact(n):
            buf = b""
            while len(buf) < n:
                data, anc, _, _ = s.recvmsg(n - len(buf), socket.CMSG_SPACE(16 * 4))
                for level, kind, cdata in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(cdata[:len(cdata) - len(cdata) % 4])
                        fds.extend(a)
                assert data, "the daemon closed the connection"
                buf += data
            return buf
        (n,) = struct.unpack("<I", exact(4))
        return json.loads(exact(n))

    def call(obj):
        body = json.dumps(obj).encode()
        s.sendall(struct.pack("<I", len(body)) + body)
        while True:
            m = recv_frame()
            if m.get("id") == obj["id"] and "event" not in m:
                return m

    try:
        assert call({"op": "hello", "id": 1, "protocol": 1}).get("ok"), "hello failed"
        reply = call(dict(req, op="attach", id=2))
        assert reply.get("ok"), reply
        assert len(fds) == 1, fds
        size = os.fstat(fds[0]).st_size
        return reply, mmap.mmap(fds[0], size, mmap.MAP_SHARED, mmap.PROT_READ), s
    finally:
        for fd in fds:
            os.close(fd)


# ---- flags and the spec ------------------------------------------------------------------


USAGE_ERRORS = [
    (["--tp-size", "2", "--tp-rank", "2"], ["--tp-rank 2 must be below --tp-size 2"]),
    (["--tp-rank", "1"], ["--tp-rank 1 needs --tp-size"]),
    (["--tp-size", "0", "--tp-rank", "0"], ["--tp-size must be at least 1"]),
    (["--tp-size", "-1"], ["--tp-size", "non-negative", "'-1'"]),
    (["--tp-size", "2x"], ["--tp-size", "'2x'"]),
    (["--tp-size", "9007199254740992"], ["--tp-size"]),
    (["--tp-size", "2", "--tp-size", "2"], ["--tp-size is given twice"]),
    (["--tp-size"], ["--tp-size needs a value"]),
    (["--ep-size", "4", "--ep-rank", "4"], ["--ep-rank 4 must be below --ep-size 4"]),
    (["--experts", "0,1"], ["--experts", "--ep-size"]),
    (["--ep-size", "1", "--experts", "0"], ["--experts", "--ep-size"]),
    (["--ep-size", "2", "--experts", "0,,1"], ["--experts", "'0,,1'"]),
    (["--ep-size", "2", "--experts", "0,a"], ["--experts", "'0,a'"]),
    (["--ep-size", "2", "--experts", "3,1,3"], ["expert 3 twice"]),
    (["--preset", "nope"], ["unknown preset 'nope'"]),
    (["--preset", "whole", "--fuse"], ["--preset whole"]),
    (["--preset", "whole", "--tp-size", "2", "--tp-rank", "0"], ["--preset whole"]),
    (["--preset", "auto", "--plan", "PLANFILE"], ["--plan FILE and --preset"]),
    (["--plan", "PLANFILE", "--tp-size", "2", "--tp-rank", "0"], ["--plan FILE cannot be combined"]),
]


@pytest.mark.parametrize("flags,needles", USAGE_ERRORS, ids=[" ".join(f) for f, _ in USAGE_ERRORS])
def test_flag_errors(tmp_path, weightctl, flags, needles):
    """Malformed plan flags: exit 2 and one line, for every command that takes them, before any work."""
    plan_file = tmp_path / "p.json"
    plan_file.write_text('{"preset": "whole"}')
    flags = [str(plan_file) if f == "PLANFILE" else f for f in flags]
    missing = tmp_path / "no-such-checkpoint"
    for cmd in (["plan", missing], ["export", missing, "--out", tmp_path / "o"], ["load", missing],
                ["attach", missing]):
        # load and attach parse their flags before connecting: no daemon is needed to refuse them.
        usage_error(["--socket", tmp_path / "no.sock"] + cmd + flags, *needles)
    assert not (tmp_path / "o").exists()


def test_rank_needed(tmp_path, weightctl):
    """A size without its rank is a table for plan, a usage error for load, attach and export."""
    for cmd in (["load", "x/y"], ["attach", "x/y"], ["export", "x/y", "--out", tmp_path / "o"]):
        usage_error(cmd + ["--tp-size", "4"], "--tp-size 4 needs --tp-rank (0 to 3)")
        usage_error(cmd + ["--ep-size", "2"], "--ep-size 2 needs --ep-rank (0 to 1)")


def test_attach_set_refuses_plan_flags(weightctl):
    usage_error(["attach", "s1", "--tp-size", "2", "--tp-rank", "0"], "plan flags go with a checkpoint PATH")


def test_unreadable_plan_file(tmp_path, ck):
    failure(["plan", ck, "--plan", tmp_path / "missing.json"], "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    failure(["plan", ck, "--plan", bad], "a plan is one JSON object")


SPECS = [
    ([], {"preset": "whole"}),
    (["--preset", "whole"], {"preset": "whole"}),
    (["--tp-size", "2", "--tp-rank", "1"], {"preset": "dense", "tp_size": 2, "tp_rank": 1}),
    (["--fuse"], {"preset": "dense", "fuse": True}),
    (["--preset", "dense", "--tp-size", "4", "--tp-rank", "3", "--fuse"],
     {"preset": "dense", "tp_size": 4, "tp_rank": 3, "fuse": True}),
    (["--preset", "auto", "--tp-size", "1", "--tp-rank", "0", "--ep-size", "1", "--ep-rank", "0"],
     {"preset": "dense"}),
]


@pytest.mark.parametrize("flags,want", SPECS, ids=[" ".join(f) or "none" for f, _ in SPECS])
def test_spec(ck, flags, want):
    """The flags make the spec they say (seen through the plan's canonical key; auto is dense here)."""
    key = plan_json(ck, *flags)["key"]
    if want["preset"] == "whole":
        assert key == want
        return
    defaults = {"tp_size": 1, "tp_rank": 0, "ep_size": 1, "ep_rank": 0, "fuse": False}
    full = dict(defaults, **want)
    assert key["preset"] == full["preset"] and "experts" not in key, key
    assert {k: key.get(k, d) for k, d in defaults.items()} == {k: full[k] for k in defaults}, key


def test_plan_file_same_as_flags(tmp_path, ck):
    """--plan FILE with a preset object gives the plan the flags give."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"preset": "auto", "tp_size": 2, "tp_rank": 1, "fuse": True}))
    assert plan_json(ck, "--plan", f) == plan_json(ck, "--tp-size", "2", "--tp-rank", "1", "--fuse")


# ---- weightctl plan ------------------------------------------------------------------------------


def totals(stdout):
    """The totals block of plan's output: {label: int}."""
    out = {}
    for line in stdout.splitlines():
        for label in ("outputs", "payload bytes", "slab bytes", "read bytes"):
            if line.startswith(label + " ") and not line.startswith("  "):
                out[label] = int(line[len(label):].split()[0])
    return out


def test_plan_whole(ck):
    """The whole plan: every tensor once, in file order, its bytes read once."""
    js = inspect(ck)
    res = ok(["plan", ck])
    lines = res.stdout.splitlines()
    assert lines[0] == f"plan {{\"preset\":\"whole\"}} for {ck}", lines[0]
    body = [l for l in lines if l.startswith("  ")]
    assert [l.split()[0] for l in body] == [t["name"] for t in js["tensors"]]
    for l, t in zip(body, js["tensors"]):
        f = l.split()
        assert f[1] == t["dtype"] and int(f[-2]) == t["data_offsets"][1] - t["data_offsets"][0], l
        assert f[-1] == ".".join(t["name"].split(".")[-2:]), l  # a whole tensor: its own name, no slice
    t = totals(res.stdout)
    assert t == {"outputs": 14, "payload bytes": js["total_bytes"], "slab bytes": t["slab bytes"],
                 "read bytes": js["total_bytes"]}, t
    assert t["slab bytes"] >= t["payload bytes"]
    assert f"of the checkpoint's {js['total_bytes']} " in res.stdout


def test_plan_auto_one_rank(ck):
    """auto, tp 2 rank 1, fused: the fused outputs, their sources, the totals."""
    res = ok(["plan", ck, "--tp-size", "2", "--tp-rank", "1", "--fuse"])
    rows = {l.split()[0]: l for l in res.stdout.splitlines() if l.startswith("  ")}
    qkv = rows["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.split()[1:4] == ["BF16", "[2048,", "1024]"], qkv
    assert qkv.endswith("q_proj.weight[1024:2048 of dim 0] + k_proj.weight[512:1024 of dim 0] + "
                        "v_proj.weight[512:1024 of dim 0]"), qkv
    assert rows["model.layers.0.mlp.down_proj.weight"].endswith("down_proj.weight[1536:3072 of dim 1]")
    assert rows["model.layers.0.mlp.gate_up_proj.weight"].endswith(
        "gate_proj.weight[1536:3072 of dim 0] + up_proj.weight[1536:3072 of dim 0]")
    assert rows["model.embed_tokens.weight"].endswith("embed_tokens.weight[75968:151936 of dim 0]")
    assert rows["model.norm.weight"].endswith("  norm.weight")
    assert "lm_head.weight" not in rows  # tied: only embed_tokens is served
    js = plan_json(ck, "--tp-size", "2", "--tp-rank", "1", "--fuse")
    t = totals(res.stdout)
    assert t["outputs"] == len(js["outputs"]) == len(rows) == 10
    assert t["payload bytes"] == js["payload_bytes"] == sum(o["nbytes"] for o in js["outputs"])
    assert t["slab bytes"] == js["slab_bytes"]
    assert t["read bytes"] == t["payload bytes"]  # no padding rows: 151936 is a multiple of 64


def test_plan_json_global_flag(ck):
    """`weightctl --json plan` is `plan --json`."""
    a = ok(["--json", "plan", ck, "--tp-size", "2", "--tp-rank", "0"]).stdout
    b = ok(["plan", ck, "--tp-size", "2", "--tp-rank", "0", "--json"]).stdout
    assert a == b and json.loads(a)["key"]["tp_rank"] == 0


def table(stdout):
    """The per-rank rows of plan's table: [(rank, outputs, payload, slab, read)] and the 'all ranks' sums."""
    rows, sums = [], None
    for line in stdout.splitlines():
        f = line.split()
        if line.startswith("  all ranks"):
            sums = tuple(int(x) for x in f[2:5])
        elif line.startswith("  ") and f[0].isdigit():
            rows.append(tuple(int(x) for x in f[:5]))
    return rows, sums


@pytest.mark.parametrize("tp", [2, 4, 16])
def test_plan_bytes_per_rank(ck, tp):
    """--tp-size N alone: one row per rank; together they cover TP 1, replicated tensors once per rank."""
    one = plan_json(ck, "--preset", "auto")
    res = ok(["plan", ck, "--tp-size", tp])
    assert "bytes per rank" in res.stdout.splitlines()[0]
    rows, sums = table(res.stdout)
    assert [r[0] for r in rows] == list(range(tp))
    for r in rows:
        js = plan_json(ck, "--tp-size", tp, "--tp-rank", r[0])
        assert r[1:] == (len(js["outputs"]), js["payload_bytes"], js["slab_bytes"], js["payload_bytes"]), r
    assert sums == tuple(sum(r[k] for r in rows) for k in (2, 3, 4))
    # Replicated: the norms. With tp > 8 kv heads, k_proj and v_proj are replicated in groups.
    norms = sum(o["nbytes"] for o in one["outputs"] if o["name"].endswith("norm.weight"))
    kv = 2 * KV_ROWS * HIDDEN * 2
    extra_kv = kv * (tp // 8) - kv if tp > 8 else 0
    assert sums[0] >= one["payload_bytes"]
    assert sums[0] == one["payload_bytes"] + (tp - 1) * norms + extra_kv, (sums, one["payload_bytes"], norms)
    doc = json.loads(ok(["plan", ck, "--tp-size", tp, "--json"]).stdout)
    assert [(r["tp_rank"], r["outputs"], r["payload_bytes"], r["slab_bytes"], r["read_bytes"])
            for r in doc["ranks"]] == rows
    assert doc["checkpoint_bytes"] == inspect(ck)["total_bytes"]


def test_plan_refused(tmp_path, ck):
    """A plan that does not fit: exit 1, one line naming the tensor (plan and export alike)."""
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"outputs": [{
        "name": "x", "dtype": "BF16", "shape": [4096, HIDDEN],
        "pieces": [{"tensor": "model.layers.0.self_attn.q_proj.weight", "dim": 0, "start": 0, "end": 4096}]}]}))
    for cmd in (["plan", ck], ["export", ck, "--out", tmp_path / "o"]):
        failure(cmd + ["--plan", f], "model.layers.0.self_attn.q_proj.weight", "BAD_PLAN")
    failure(["plan", ck, "--tp-size", "3", "--tp-rank", "0"], "BAD_PLAN")
    failure(["plan", ck, "--tp-size", "3"], "BAD_PLAN")
    assert not (tmp_path / "o").exists()


# ---- weightctl export --------------------------------------------------------------------------


def test_export_round_trip(tmp_path, ck, daemon):
    """Every rank of tp 2 (fused), one file and sharded: valid files, and the daemon's bytes."""
    limit = 10_000_000
    for rank in (0, 1):
        flags = ["--tp-size", "2", "--tp-rank", str(rank), "--fuse"]
        plan = plan_json(ck, *flags)
        single, sharded = tmp_path / f"r{rank}", tmp_path / f"r{rank}-sharded"
        res = ok(["export", ck, *flags, "--out", single])
        assert f"{len(plan['outputs'])} tensors, {plan['payload_bytes']} bytes" in res.stdout, res.stdout
        check_export(ck, single, plan)
        ok(["export", ck, *flags, "--out", sharded, "--max-shard-bytes", limit, "--threads", "3"])
        check_export(ck, sharded, plan, limit)
        assert len(greedy_files(plan["outputs"], limit)) == 4  # embed_tokens alone, over the limit

        # The daemon's set for the same plan holds the same bytes.
        reply, slab, conn = attach_raw(daemon.socket, {"path": str(ck), "device": 0, "plan": plan["key"]})
        try:
            assert [t["name"] for t in reply["tensors"]] == [o["name"] for o in plan["outputs"]]
            entries, _, data = read_export(single)["model.safetensors"]
            for t, (name, e) in zip(reply["tensors"], entries):
                b, x = e["data_offsets"]
                assert slab[t["offset"]:t["offset"] + t["nbytes"]] == data[b:x], f"rank {rank}: {name} differs"
        finally:
            slab.close()
            conn.close()
        # And so does the CLI: attach by path with the same flags verifies every byte.
        res = dctl(daemon, "attach", ck, *flags, "--verify")
        assert f"verified {len(plan['outputs'])} tensors, {plan['payload_bytes']} bytes" in res.stdout


def test_export_whole_is_a_copy(tmp_path, ck):
    """The whole plan exports every tensor as the file holds it, with the plan in the metadata."""
    out = tmp_path / "whole"
    ok(["export", ck, "--out", out])
    src = stref.reference(read_file(ck / "model.safetensors"))
    entries, meta, data = read_export(out)["model.safetensors"]
    assert json.loads(meta["weightd_plan"]) == {"preset": "whole"}
    got = stref.reference(read_file(out / "model.safetensors"))
    assert sorted(got.tensors) == sorted(src.tensors)
    buf = read_file(ck / "model.safetensors")
    for name, t in got.tensors.items():
        s = src.tensors[name]
        assert (t.dtype, t.shape) == (s.dtype, s.shape)
        assert data[t.begin:t.end] == buf[8 + src.n + s.begin:8 + src.n + s.end], name


def test_export_directory_rules(tmp_path, ck):
    """Stale files of an earlier export go; foreign files and the checkpoint's own directory are refused."""
    out = tmp_path / "o"
    flags = ["--tp-size", "2", "--tp-rank", "0"]
    ok(["export", ck, *flags, "--out", out, "--max-shard-bytes", 50_000_000])
    assert "model.safetensors.index.json" in os.listdir(out)
    ok(["export", ck, *flags, "--out", out])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    (out / "notes.txt").write_text("mine")
    failure(["export", ck, *flags, "--out", out], "notes.txt")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]
    failure(["export", ck, *flags, "--out", ck], "own directory")
    res = stref.run_ctl(["export", str(ck), *flags])
    assert res.returncode == 2 and "--out DIR is required" in res.stderr, res.describe()
    usage_error(["export", ck, *flags, "--out", out, "--max-shard-bytes", "0"], "--max-shard-bytes")
    usage_error(["export", ck, *flags, "--out", out, "--threads", "65"], "--threads")


# ---- attach --verify ---------------------------------------------------------------------------


def test_verify_uses_the_plan(tmp_path, ck, daemon):
    """attach SET --verify checks the set against its plan: a changed byte in the rank's slice fails, one outside passes."""
    copy = ck.parent / "q06-verify"
    shutil.copytree(ck, copy)
    try:
        flags = ["--tp-size", "2", "--tp-rank", "1"]
        dctl(daemon, "load", copy, *flags)
        sets = json.loads(dctl(daemon, "--json", "status").stdout)["sets"]
        (s,) = [x for x in sets if x["path"] == os.path.realpath(copy)]
        assert s["plan"]["tp_rank"] == 1
        dctl(daemon, "attach", s["set"], "--verify")

        src = Source(copy)
        name = "model.layers.0.mlp.down_proj.weight"
        t = src.header[name]
        base = src.start + t["data_offsets"][0]
        del src

        def rewrite(offset):
            # A new file renamed over the old one: the daemon's mapping keeps the old bytes.
            buf = bytearray(read_file(copy / "model.safetensors"))
            buf[offset] ^= 0xFF
            tmp = copy / "model.safetensors.new"
            tmp.write_bytes(buf)
            os.rename(tmp, copy / "model.safetensors")

        rewrite(base + 100)  # row 0, column 50: rank 0's half of the row-parallel down_proj
        res = dctl_result(daemon, "attach", s["set"], "--verify")
        assert res.returncode == 0, res.describe()
        rewrite(base + 2 * (INTER // 2) + 6)  # row 0, column 1539: rank 1's half
        res = dctl_result(daemon, "attach", s["set"], "--verify")
        problem = stref.error_line_problem(res)
        assert problem is None, problem + "\n" + res.describe()
        assert f"tensor '{name}' differs" in res.stderr and "at byte 6 of the tensor" in res.stderr, res.stderr
    finally:
        shutil.rmtree(copy, ignore_errors=True)
