"""The binary tensor table and early attach, over the raw protocol (docs/protocol.md).

The early-attach tests hold the load at its window boundaries with the
daemon's test_load_gate (a FIFO: the load reads one byte before each 256 MiB
window it fills), so what they observe does not depend on timing: the test
lets one window through, the watermark must then stop exactly at that
window's end, and every tensor below it must already hold the file's bytes.
"""
import fcntl
import json
import mmap
import os
import shutil
import struct
import subprocess
import termios
import time

import pytest

import wdclient
from conftest import SLOW, WEIGHTCTL, write_single
from wdclient import Checkpoint, ProgressPage, WDError, parse_tensor_table, ranges_equal, read_fd, wait_until

WINDOW = 256 << 20  # the memcpy loader's window (test_load_gate's unit)
TABLE = ["tensor_table"]

try:
    F_SEAL_FUTURE_WRITE = fcntl.F_SEAL_FUTURE_WRITE
except AttributeError:
    F_SEAL_FUTURE_WRITE = 0x0010


def binary_attach(c, **fields):
    """attach on a connection that asked for the binary table: (reply, {"slab", "table", "page"} fds)."""
    m, fds = c.request("attach", **fields)
    if "error" in m:
        for fd in fds:
            os.close(fd)
        raise WDError(m)
    named = {"slab": fds[m["handles"][0]["fd_index"]]}
    if "tensor_table" in m:
        named["table"] = fds[m["tensor_table"]["fd_index"]]
    if "progress" in m:
        named["page"] = fds[m["progress"]["fd_index"]]
    assert sorted(named.values()) == sorted(fds), (m, fds)
    return m, named


def close_all(fds):
    for fd in fds.values():
        os.close(fd)


def table_of(m, fds):
    t = parse_tensor_table(read_fd(fds["table"], m["tensor_table"]["bytes"]))
    assert t["slab_bytes"] == m["bytes"]
    return t["tensors"]


def check_sealed_table(fd, size):
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    want = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    assert seals & want == want, hex(seals)
    assert os.fstat(fd).st_size == size
    with pytest.raises(OSError):
        os.pwrite(fd, b"x", 0)


def check_unwritable(fd, size):
    """Nobody but the daemon can write: no writable mapping, no write(2), no resize."""
    with pytest.raises(OSError):
        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    for bad in (lambda: os.pwrite(fd, b"x", 0), lambda: os.ftruncate(fd, 0)):
        with pytest.raises(OSError):
            bad()


# ---- the binary table ---------------------------------------------------------------------


def test_binary_table_equals_the_json_table(daemon, ckpt_sharded, tiny):
    """Same names, dtypes, shapes, offsets and sizes, in the same (slab) order; no JSON list."""
    for path in (ckpt_sharded, tiny["many"], tiny["a"]):
        with daemon.connect(features=TABLE) as b, daemon.connect() as j:
            m, fds = binary_attach(b, path=path, device=0)
            try:
                assert "tensors" not in m and m["tensor_table"]["version"] == 1
                check_sealed_table(fds["table"], m["tensor_table"]["bytes"])
                binary = table_of(m, fds)
                mj, fd = j.attach(set=m["set"])
                os.close(fd)
                assert binary == mj["tensors"]
                assert m["tensor_count"] == mj["tensor_count"] == len(binary)
            finally:
                close_all(fds)


def test_reply_size_does_not_grow_with_the_tensor_count(daemon, model_root):
    d = os.path.join(model_root, "table-size")
    few = write_single(os.path.join(d, "few"), [(f"w.{i}", "F16", [4]) for i in range(10)], 1)
    many = write_single(os.path.join(d, "many"), [(f"layers.{i}.weight", "F16", [4]) for i in range(5000)], 2)
    sizes = {}
    with daemon.connect(features=TABLE) as b, daemon.connect() as j:
        for name, path in (("few", few), ("many", many)):
            m, fds = binary_attach(b, path=path, device=0)
            assert len(table_of(m, fds)) == (10 if name == "few" else 5000)
            close_all(fds)
            sizes[name] = len(json.dumps(m, separators=(",", ":")))
            mj, fd = j.attach(set=m["set"])
            os.close(fd)
            sizes["json-" + name] = len(json.dumps(mj, separators=(",", ":")))
    assert abs(sizes["many"] - sizes["few"]) <= 16, sizes  # ids and sizes have more digits
    assert sizes["json-many"] > 100 * sizes["many"], sizes
    shutil.rmtree(d)


def test_clients_without_the_feature_get_json(daemon, tiny):
    with daemon.connect() as c, daemon.connect(features=["no_such_feature"]) as u:
        assert set(c.hello_reply["features"]) >= {"tensor_table", "early_attach"}
        for conn in (c, u):
            m, fds = conn.request("attach", path=tiny["a"], device=0)
            assert m.get("ok") and len(fds) == 1 and "tensor_table" not in m and "progress" not in m, m
            assert len(m["tensors"]) == m["tensor_count"] == 6
            os.close(fds[0])
        assert c.error("hello", protocol=1, features="tensor_table") in ("BAD_REQUEST", "PROTOCOL")


# ---- early attach -------------------------------------------------------------------------


class Gate:
    """The daemon's test_load_gate: the load passes one window per byte written; closing opens it."""

    def __init__(self, directory):
        self.path = os.path.join(directory, "gate")
        os.mkfifo(self.path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)  # keeps a writer: the gate starts closed

    def queued(self):
        n = struct.unpack("i", fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        return n

    def let_one_window_through(self):
        os.write(self.fd, b"w")

    def open(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def gated(start_daemon, workdir):
    """A daemon whose loads wait at the gate before every window."""
    import tempfile

    gate = Gate(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    d = start_daemon({"test_load_gate": gate.path})
    yield d, gate
    gate.open()


def test_cancel_of_a_queued_request_answers_it_and_it_never_runs(gated, ckpt_sharded):
    """A connection's 17th request waits in its queue behind 16 in flight (loads held at the gate);
    `cancel` by its id takes it out of the queue: CANCELED, "canceled before it started". The 16 loads
    and the connection go on as before."""
    d, gate = gated
    with d.connect() as c:
        loads = [c.start("load", path=ckpt_sharded, device=0) for _ in range(16)]  # the connection's limit in flight
        queued = c.start("open", path=ckpt_sharded)
        def queued_opens():
            return [r for r in d.status()["requests"] if r["op"] == "open" and r["state"] == "queued"]

        wait_until(lambda: len(queued_opens()) == 1, timeout=10 * SLOW, what="the 17th request in the connection's queue")
        rc = c.call("cancel", target=queued)
        assert rc["canceled"] is True, rc
        m, _ = c.wait(queued)
        assert m["error"]["code"] == "CANCELED" and "before it started" in m["error"]["message"], m
        assert queued_opens() == []
        assert c.call("cancel", target=queued)["canceled"] is False  # gone: nothing to cancel twice
        gate.open()
        for rid in loads:
            m, _ = c.wait(rid)
            assert m.get("ok") is True, m
        assert c.call("status")["ok"] is True  # the queue is usable after the cancel


def hold_after_first_window(m, fds, gate):
    """The early attach's page, once the load filled its first window and waits at the gate."""
    assert m["state"] == "loading", m
    page = ProgressPage(fds["page"])
    gate.let_one_window_through()
    wait_until(lambda: page.ready == WINDOW, timeout=60 * SLOW, what="the first window")
    return page


def check_newly_ready(slab, tensors, checked, ready, ckpt):
    """Compares the tensors (slab order) from number `checked` on that lie below `ready` with the files.

    Returns how many are checked now: each tensor is checked once, as soon as the watermark shows it.
    """
    while checked < len(tensors) and tensors[checked]["offset"] + tensors[checked]["nbytes"] <= ready:
        t = tensors[checked]
        src, b, e = ckpt.tensor_bytes(t["name"])
        assert ranges_equal(slab, t["offset"], src, b, e - b), f"{t['name']} differs from the file"
        checked += 1
    return checked


def slab_order(tensors):
    return sorted(tensors, key=lambda t: t["offset"])


def test_each_tensor_matches_the_file_as_soon_as_it_is_ready(gated, ckpt_sharded):
    d, gate = gated
    ckpt = Checkpoint(ckpt_sharded)
    with d.connect(features=TABLE) as c:
        m, fds = binary_attach(c, path=ckpt_sharded, device=0, early=True)
        try:
            assert m["state"] == "loading", m
            assert m["progress"]["bytes"] == 4096 and m["progress"]["version"] == 1
            total = m["bytes"]
            assert total > 2 * WINDOW, "the checkpoint must span several windows"
            tensors = slab_order(table_of(m, fds))
            # Nobody else can write the set while it loads, nor the page.
            seals = fcntl.fcntl(fds["slab"], fcntl.F_GET_SEALS)
            assert seals & F_SEAL_FUTURE_WRITE and seals & fcntl.F_SEAL_SHRINK, hex(seals)
            check_unwritable(fds["slab"], total)
            check_unwritable(fds["page"], 4096)
            page = ProgressPage(fds["page"])
            slab = mmap.mmap(fds["slab"], total, mmap.MAP_SHARED, mmap.PROT_READ)
            checked, stops, windows = 0, [], 0
            deadline = time.monotonic() + 120 * SLOW
            while True:
                seq, state, ready, page_total, error, msg = page.read()
                assert page_total == total and error == 0, page.read()
                # Every tensor below the watermark holds the file's bytes, checked as soon as it shows.
                checked = check_newly_ready(slab, tensors, checked, ready, ckpt)
                if state != "loading":
                    break
                # The load stops at each window's end until the next byte: the watermark is exactly there.
                # (At the end it is the set's size while the daemon still checks the files and seals.)
                if ready == windows * WINDOW < total and gate.queued() == 0:
                    if windows > 0:
                        stops.append(ready)
                    gate.let_one_window_through()
                    windows += 1
                assert time.monotonic() < deadline, f"stuck at {page.read()}"
                time.sleep(0.002)
            assert state == "ready", page.read()
            assert checked == len(tensors)
            assert stops == [k * WINDOW for k in range(1, len(stops) + 1)] and len(stops) >= 2, stops
            # Tensors past a stop were not ready there: at least one tensor lay wholly after each stop.
            assert all(any(t["offset"] >= s for t in tensors) for s in stops)
            slab.close()
            page.close()
            st = c.status()
            assert [s["state"] for s in st["sets"]] == ["ready"]
        finally:
            close_all(fds)
    ckpt.close()


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_load_that_fails_midway_is_seen_failed(gated, ckpt_small, model_root):
    d, gate = gated
    path = copy_checkpoint(ckpt_small, os.path.join(model_root, "early-fault"))
    shard = os.path.join(path, "model.safetensors")
    with d.connect(features=TABLE) as c:
        m, fds = binary_attach(c, path=path, device=0, early=True)
        try:
            page = hold_after_first_window(m, fds, gate)
            # The shard loses its data while the load waits at the gate; then the gate opens.
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
            os.truncate(shard, 8 + n)
            gate.open()
            wait_until(lambda: page.state != "loading", timeout=60 * SLOW, what="the load to end")
            _, state, ready, _, error, msg = page.read()
            assert state == "failed" and error == -20 and "truncated" in msg, page.read()  # FAULT
            assert ready == WINDOW
            # The set is gone from the daemon's list; its lease and memory stay until released.
            st = c.status()
            assert st["sets"] == [] and st["daemon"]["leases"] == 1 and st["devices"][0]["used"] == m["bytes"]
            # What was in place stays readable: the first tensor's bytes below the watermark.
            orig = Checkpoint(ckpt_small)
            first = slab_order(table_of(m, fds))[0]
            slab = mmap.mmap(fds["slab"], m["bytes"], mmap.MAP_SHARED, mmap.PROT_READ)
            src, b, e = orig.tensor_bytes(first["name"])
            n = min(e - b, WINDOW - first["offset"])
            assert n > 0 and ranges_equal(slab, first["offset"], src, b, n), "the bytes in place changed"
            slab.close()
            orig.close()
            page.close()
            assert c.call("release", lease=m["lease"])["released"] is True
            st = wait_until(lambda: (lambda s: s if s["devices"][0]["used"] == 0 else None)(c.status()),
                            timeout=10 * SLOW, what="the slab to be freed")
            assert st["daemon"]["leases"] == 0
        finally:
            close_all(fds)
    shutil.rmtree(path)


def test_a_load_of_a_replaced_shard_never_shows_the_whole_slab_ready(gated, ckpt_small, model_root):
    """The watermark reaches the end of the slab only after the check that no shard changed.

    The shard is replaced while the load waits at the gate; the load then
    copies every byte (from the old mapping) and fails STALE at its final
    check. Before: the whole slab was published ready before that check, so a
    wait for all of it succeeded for a load that failed."""
    d, gate = gated
    path = copy_checkpoint(ckpt_small, os.path.join(model_root, "early-stale"))
    shard = os.path.join(path, "model.safetensors")
    with d.connect(features=TABLE) as c:
        m, fds = binary_attach(c, path=path, device=0, early=True)
        try:
            assert m["state"] == "loading", m
            page = ProgressPage(fds["page"])
            shutil.copyfile(shard, shard + ".new")
            os.replace(shard + ".new", shard)
            gate.open()
            wait_until(lambda: page.state != "loading", timeout=60 * SLOW, what="the load to end")
            _, state, ready, _, error, msg = page.read()
            assert state == "failed" and "replaced" in msg, page.read()
            assert ready < m["bytes"], (ready, m["bytes"])
            page.close()
            assert c.call("release", lease=m["lease"])["released"] is True
        finally:
            close_all(fds)
    shutil.rmtree(path)


def test_another_clients_cancel_does_not_stop_an_early_attached_load(gated, ckpt_sharded):
    """A's early lease keeps the load going when B, who loads the same set, cancels its own load."""
    d, gate = gated
    with d.connect() as a, d.connect(features=TABLE) as b:
        a.start("load", id="L", path=ckpt_sharded, device=0)
        m, fds = binary_attach(b, path=ckpt_sharded, device=0, early=True)
        try:
            page = hold_after_first_window(m, fds, gate)
            assert a.call("cancel", target="L")["canceled"] is True
            r, _ = a.wait("L")
            assert r["error"]["code"] == "CANCELED", r
            gate.open()
            wait_until(lambda: page.state != "loading", timeout=60 * SLOW, what="the load to end")
            _, state, ready, total, error, _ = page.read()
            assert (state, ready, error) == ("ready", m["bytes"], 0), page.read()
            st = b.status()
            assert [s["state"] for s in st["sets"]] == ["ready"] and st["daemon"]["leases"] == 1, st
            page.close()
        finally:
            close_all(fds)
        assert b.call("release", lease=m["lease"])["released"] is True


def test_early_attach_of_a_ready_set_and_descriptor_counts(daemon, tiny):
    """A ready set attached early says so; repeated early attaches leave no descriptor behind."""
    with daemon.connect(features=TABLE) as c:
        set_id = c.call("load", path=tiny["many"], device=0)["set"]

        def cycle():
            m, fds = binary_attach(c, set=set_id, early=True)
            assert m["state"] == "ready" and len(fds) == 3
            page = ProgressPage(fds["page"])
            _, state, ready, total, error, _ = page.read()
            assert (state, ready, total, error) == ("ready", m["bytes"], m["bytes"], 0)
            page.close()
            close_all(fds)
            assert c.call("release", lease=m["lease"])["released"] is True

        for _ in range(20):
            cycle()
        before = daemon.fd_count()
        for _ in range(200):
            cycle()
        assert daemon.fd_count() == before


def test_staged_loads_raise_the_watermark_per_completed_window(start_daemon, ckpt_small):
    """The staged pipeline (forced on the host backend, 1 MiB slots): whole windows, each checked as it shows."""
    slot = 1 << 20
    d = start_daemon({"load_method": "staged", "staging_slot_bytes": "1MiB", "staging_slots": 2})
    ckpt = Checkpoint(ckpt_small)
    with d.connect(features=TABLE) as c:
        m, fds = binary_attach(c, path=ckpt_small, device=0, early=True)
        try:
            total = m["bytes"]
            tensors = slab_order(table_of(m, fds))
            page = ProgressPage(fds["page"])
            slab = mmap.mmap(fds["slab"], total, mmap.MAP_SHARED, mmap.PROT_READ)
            checked, seen = 0, set()
            deadline = time.monotonic() + 120 * SLOW
            while True:
                _, state, ready, _, error, _ = page.read()
                seen.add(ready)
                checked = check_newly_ready(slab, tensors, checked, ready, ckpt)
                if state != "loading":
                    break
                assert time.monotonic() < deadline, page.read()
                time.sleep(0.0005)
            assert (state, error, checked) == ("ready", 0, len(tensors)), page.read()
            assert all(r % slot == 0 or r == total for r in seen), sorted(r for r in seen if r % slot)
            slab.close()
            page.close()
        finally:
            close_all(fds)
    assert d.status()["sets"][0]["method"] == "staged"
    ckpt.close()


# ---- early attach of a rank's plan, staged on the staging schedule ------------------------------

SLOT = 1 << 20  # staging_slot_bytes below: the smallest the daemon takes
TP_PLAN = {"preset": "auto", "tp_size": 2, "tp_rank": 1}


@pytest.fixture(scope="module")
def qwen3_tp(model_root):
    """A two-layer Qwen3-shaped checkpoint (~38 MiB) whose TP=2 rank has column slices of 1-3 MiB.

    o_proj and down_proj are sliced along dim 1: rows of 1,024 and 1,536 bytes
    every 2,048 and 3,072, so staged_strided rows stages them as whole rows
    (and windows end inside them, off the slot's multiples).
    """
    d = os.path.join(model_root, "early-qwen3-tp")
    if os.path.exists(os.path.join(d, "config.json")):
        return d
    os.makedirs(d)
    H, I, V, NH, KV, HD, L = 1024, 1536, 2048, 8, 4, 128, 2
    tensors = [("model.embed_tokens.weight", "BF16", [V, H])]
    for i in range(L):
        p = f"model.layers.{i}."
        tensors += [(p + "input_layernorm.weight", "BF16", [H]),
                    (p + "post_attention_layernorm.weight", "BF16", [H]),
                    (p + "self_attn.q_proj.weight", "BF16", [NH * HD, H]),
                    (p + "self_attn.k_proj.weight", "BF16", [KV * HD, H]),
                    (p + "self_attn.v_proj.weight", "BF16", [KV * HD, H]),
                    (p + "self_attn.o_proj.weight", "BF16", [H, NH * HD]),
                    (p + "self_attn.q_norm.weight", "BF16", [HD]),
                    (p + "self_attn.k_norm.weight", "BF16", [HD]),
                    (p + "mlp.gate_proj.weight", "BF16", [I, H]),
                    (p + "mlp.up_proj.weight", "BF16", [I, H]),
                    (p + "mlp.down_proj.weight", "BF16", [H, I])]
    tensors += [("model.norm.weight", "BF16", [H]), ("lm_head.weight", "BF16", [V, H])]
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=17)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
                   "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
                   "vocab_size": V, "num_hidden_layers": L, "tie_word_embeddings": False}, f)
    return d


def plan_images(path, plan, ckpt):
    """{output name: (offset, the bytes the slab must hold there)}, from the plan weightctl builds here."""
    args = [WEIGHTCTL, "plan", path, "--json", "--preset", plan["preset"],
            "--tp-size", str(plan["tp_size"]), "--tp-rank", str(plan["tp_rank"])]
    desc = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    images = {}
    for o in desc["outputs"]:
        parts = []
        for pc in o["pieces"]:
            assert "tensor" in pc, pc  # no padding in these plans
            src, b, _ = ckpt.tensor_bytes(pc["tensor"])
            h = ckpt.header(pc["tensor"])
            shape, dim = h["shape"], pc["dim"]
            inner = wdclient.DTYPE_BYTES[h["dtype"]]
            for n in shape[dim + 1:]:
                inner *= n
            outer = 1
            for n in shape[:dim]:
                outer *= n
            row = shape[dim] * inner
            for r in range(outer):
                parts.append(src[b + r * row + pc["start"] * inner:b + r * row + pc["end"] * inner])
        image = b"".join(parts)
        assert len(image) == o["nbytes"], o["name"]
        images[o["name"]] = (o["offset"], image)
    return images


@pytest.mark.parametrize("strided", ["gather", "rows"])
def test_staged_rank_plan_window_by_window(start_daemon, workdir, qwen3_tp, strided):
    """A TP rank staged on the host backend, held at every window of the staging schedule by the gate.

    At each stop every byte below the watermark holds the rank's bytes, the
    tensor cut by the watermark included (rows staged whole end windows
    inside a tensor); in gather mode the stops are the slot's multiples, in
    rows mode the schedule's own window ends.
    """
    import tempfile

    gate = Gate(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    d = start_daemon({"load_method": "staged", "staging_slot_bytes": "1MiB", "staging_slots": 2,
                      "staged_strided": strided, "test_load_gate": gate.path})
    ckpt = Checkpoint(qwen3_tp)
    images = plan_images(qwen3_tp, TP_PLAN, ckpt)
    try:
        with d.connect(features=TABLE) as c:
            m, fds = binary_attach(c, path=qwen3_tp, device=0, plan=TP_PLAN, early=True)
            try:
                assert m["state"] == "loading", m
                total = m["bytes"]
                assert total > 8 * SLOT, total
                tensors = slab_order(table_of(m, fds))
                assert {t["name"]: (t["offset"], t["nbytes"]) for t in tensors} == \
                    {n: (off, len(img)) for n, (off, img) in images.items()}
                page = ProgressPage(fds["page"])
                slab = mmap.mmap(fds["slab"], total, mmap.MAP_SHARED, mmap.PROT_READ)
                checked, stops = 0, []
                deadline = time.monotonic() + 120 * SLOW

                def check_below(ready):
                    nonlocal checked
                    # Whole tensors once each, as they show; then the prefix of the one the watermark cuts.
                    while checked < len(tensors) and tensors[checked]["offset"] + tensors[checked]["nbytes"] <= ready:
                        t = tensors[checked]
                        off, img = images[t["name"]]
                        assert slab[off:off + len(img)] == img, f"{t['name']} differs below the watermark {ready}"
                        checked += 1
                    if checked < len(tensors) and tensors[checked]["offset"] < ready:
                        off, img = images[tensors[checked]["name"]]
                        n = ready - off
                        assert slab[off:ready] == img[:n], f"{tensors[checked]['name']}: its first {n} bytes differ"

                last, started = 0, False
                while True:
                    _, state, ready, _, error, msg = page.read()
                    assert error == 0, msg
                    assert ready >= last
                    if state != "loading":
                        break
                    # Held at the gate: the byte taken, the watermark moved once (to the window's end) and stays.
                    if gate.queued() == 0 and (ready != last or not started):
                        started = True
                        check_below(ready)
                        if ready > 0:
                            stops.append(ready)
                        last = ready
                        if ready == total:  # the last window is in: the daemon checks the files and seals
                            wait_until(lambda: page.state != "loading", timeout=30 * SLOW, what="the end")
                            continue
                        time.sleep(0.005)
                        assert page.read()[2] == ready, "the watermark moved while the load waited at the gate"
                        gate.let_one_window_through()
                    assert time.monotonic() < deadline, f"stuck at {page.read()}"
                    time.sleep(0.001)
                assert state == "ready", page.read()
                check_below(total)
                assert checked == len(tensors)
                steps = [b - a for a, b in zip([0] + stops, stops)]
                assert all(0 < s <= SLOT for s in steps), steps
                if strided == "gather":
                    assert stops == [min(k * SLOT, total) for k in range(1, len(stops) + 1)], stops
                else:
                    # Windows of whole rows deliver only the rank's part of what they stage.
                    assert any(s % SLOT and s != total for s in stops), stops
                    assert len(stops) > (total + SLOT - 1) // SLOT, (len(stops), total)
                slab.close()
                page.close()
            finally:
                close_all(fds)
        st = d.status()
        assert [(s["state"], s["method"]) for s in st["sets"]] == [("ready", "staged")], st["sets"]
    finally:
        gate.open()
        ckpt.close()


# ---- a client that never reads: progress events are dropped, not queued ------------------------


def metric(st, name):
    fam = st["metrics"].get(name)
    return None if fam is None else fam["samples"][0]["value"]


def test_progress_for_a_client_that_never_reads_stays_bounded(start_daemon, workdir, ckpt_sharded, model_root):
    """Progress ticks for a client that never reads: its queue stays under max_queued_output.

    Its queue is first filled past half the limit with large attach replies (the
    JSON table of 5,000 tensors), while four gated loads tick every 100 ms. A
    daemon that queued the ticks (or, past the limit, a LIMIT error for each)
    grew the queue without end. The stream stays in step: each load gets its
    progress events, then exactly one final reply.
    """
    import socket
    import tempfile

    cap = 1 << 20
    gate = Gate(tempfile.mkdtemp(prefix="gate-", dir=workdir))
    d = start_daemon({"test_load_gate": gate.path, "max_queued_output": "1MiB"})
    try:
        with d.connect() as mute, d.connect() as o:
            gate.let_one_window_through()  # the only load yet: the small set loads whole
            many = write_single(os.path.join(model_root, "never-reads"),
                                [(f"layers.{i}.weight", "F16", [4]) for i in range(5000)], 5)
            big = o.call("load", path=many, device=0)["set"]
            mute.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            loads = [mute.start("load", id=f"L{i}", path=ckpt_sharded, device=0) for i in range(4)]
            for i in range(30):
                mute.start("attach", id=f"A{i}", set=big)
            st = wait_until(lambda: (lambda s: s if (metric(s, "weightd_progress_events_dropped_total") or 0) >= 40
                                     or (metric(s, "weightd_reply_bytes_queued") or cap + 1) > cap else None)(o.status()),
                            timeout=120 * SLOW, what="progress events to be dropped or the queue to pass the limit")
            queued = metric(st, "weightd_reply_bytes_queued")
            assert queued is not None and queued <= cap, queued
            gate.open()
            mute.settimeout(120 * SLOW)
            final = {}
            while not all(rid in final for rid in loads):
                m, fds = mute.recv()
                for fd in fds:
                    os.close(fd)
                rid = m.get("id")
                assert rid not in final, ("a frame after the final reply", str(m)[:200])
                if "event" not in m:
                    final[rid] = m.get("ok") is True or m["error"]["code"] == "LIMIT"
            assert all(final.values()), final
            assert metric(o.status(), "weightd_reply_bytes_queued") < cap
        shutil.rmtree(os.path.join(model_root, "never-reads"))
    finally:
        gate.open()
