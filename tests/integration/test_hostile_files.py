"""Files that try to wedge the daemon or read through it: FIFOs named as
shards, and a checkpoint's config.json or index linked to a file outside the
model root. Every answer comes at once, names the file and the rule, and never
quotes or betrays what lies outside the root; the daemon keeps serving and
stops cleanly."""
import json
import os
import shutil
import socket
import tempfile
import time

import pytest

from conftest import SLOW
from wdclient import write_safetensors

T = [("w", "F32", [16, 16]), ("b", "U8", [10])]
PROMPT = 5.0 * SLOW


@pytest.fixture
def scratch(model_root, outside_dir):
    """A fresh directory under the model root, and one outside it."""
    made = [tempfile.mkdtemp(prefix=p, dir=parent) for p, parent in (("hf-", model_root), ("hf-out-", outside_dir))]
    yield made
    for d in made:
        shutil.rmtree(d, ignore_errors=True)


def index_with(d, name, make):
    """A checkpoint: a.safetensors (w, b) and shard `name` for tensor x, made by make(path)."""
    os.makedirs(d)
    write_safetensors(os.path.join(d, "a.safetensors"), T, seed=1)
    make(os.path.join(d, name))
    wm = {"w": "a.safetensors", "b": "a.safetensors", "x": name}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return d


def reply_within(conn, rid, seconds):
    conn.settimeout(seconds)
    try:
        m, fds = conn.wait(rid)
    except socket.timeout:
        pytest.fail(f"no reply within {seconds} s")
    for fd in fds:
        os.close(fd)
    return m


def test_fifo_shards_answer_at_once(start_daemon, scratch, tiny):
    """Two indexes naming FIFOs (one per control thread) and a shard linked to a
    FIFO outside the root: each open is refused at once, and meanwhile another
    client's status and open are answered; SIGTERM then stops the daemon."""
    root, out = scratch
    d = start_daemon()
    fifo_dirs = [index_with(os.path.join(root, f"fifo{i}"), "x.safetensors", os.mkfifo) for i in range(2)]
    outside_fifo = os.path.join(out, "fifo")
    os.mkfifo(outside_fifo)
    linked = index_with(os.path.join(root, "linked"), "x.safetensors", lambda p: os.symlink(outside_fifo, p))
    conns = [d.connect() for _ in range(3)]
    try:
        rids = [c.start("open", path=p) for c, p in zip(conns, fifo_dirs + [linked])]
        t0 = time.monotonic()
        with d.connect(timeout=PROMPT) as other:
            assert other.status()["daemon"]["pid"] == d.pid
            other.call("open", path=tiny["a"])
        assert time.monotonic() - t0 < PROMPT
        got = [reply_within(c, rid, PROMPT) for c, rid in zip(conns, rids)]
    finally:
        for c in conns:
            c.close()
    for m in got[:2]:
        assert m["error"]["code"] == "INVALID", m
        assert "x.safetensors: not a regular file" in m["error"]["message"], m
    assert got[2]["error"]["code"] == "PATH_DENIED", got[2]
    assert "x.safetensors" in got[2]["error"]["message"] and out not in got[2]["error"]["message"], got[2]
    d.stop()
    assert d.stop_seconds < PROMPT


SECRETS = {
    "json": '{"model_type": "SECRET-TYPE-1234", "weight_map": {"SECRET-NAME-5678": "../SECRET-FILE"}}',
    "shadow": "root:$6$SECRET-HASH-9012:19000:0:99999:7:::\n",
}


@pytest.mark.parametrize("member", ["config.json", "model.safetensors.index.json"])
def test_links_out_of_the_root_are_refused_without_leaking(daemon, scratch, member):
    """config.json or the index linked to a file outside the root: PATH_DENIED
    naming the file, the same answer whatever the target holds and whether it
    exists, and no byte of it in the reply (the old daemon read both: a
    config's model_type decided later errors, an index's entries were quoted,
    and "not valid JSON" told that the file existed)."""
    root, out = scratch
    targets = []
    for name, text in SECRETS.items():
        p = os.path.join(out, name)
        with open(p, "w") as f:
            f.write(text)
        targets.append(p)
    targets.append(os.path.join(out, "does-not-exist"))
    answers = []
    with daemon.connect() as c:
        for i, target in enumerate(targets):
            d = os.path.join(root, f"ck{i}")
            os.makedirs(d)
            write_safetensors(os.path.join(d, "model.safetensors" if member == "config.json" else "a.safetensors"),
                              T, seed=2)
            os.symlink(target, os.path.join(d, member))
            for op, extra in (("open", {}), ("load", {"plan": {"preset": "auto"}})):
                m, fds = c.request(op, path=d, **extra)
                for fd in fds:
                    os.close(fd)
                assert "error" in m, m
                err = m["error"]
                assert err["code"] == "PATH_DENIED", (target, op, m)
                assert member in err["message"] and "outside the model roots" in err["message"], m
                assert "SECRET" not in err["message"] and out not in err["message"], m
                answers.append(err["message"].replace(d, "CKPT"))
        assert c.status()["checkpoints"] == []
    assert len(set(answers)) == 1, answers
    daemon.check_serving()


def test_bad_index_verdict_is_remembered(start_daemon, scratch):
    """An index that disagrees with its 40,000-tensor shard: the first open pays
    for reading the header (the old check was quadratic: seconds), a repeated
    open of the unchanged files answers from the remembered verdict (the
    daemon's debug log says so), and a rewritten index is judged afresh."""
    daemon = start_daemon(log_level="debug")
    remembered = "refused from the remembered verdict"
    root, _ = scratch
    d = os.path.join(root, "big")
    os.makedirs(d)
    n = 40000
    tensors = [(f"t.{i:06d}", "U8", [1]) for i in range(n)]
    write_safetensors(os.path.join(d, "s.safetensors"), tensors, seed=3)
    idx = os.path.join(d, "model.safetensors.index.json")

    def write_index(names):
        with open(idx + ".tmp", "w") as f:
            json.dump({"weight_map": {name: "s.safetensors" for name in names}}, f)
        os.replace(idx + ".tmp", idx)

    write_index(t[0] for t in tensors[:-1])  # leaves out the last tensor
    times, messages = [], []
    with daemon.connect() as c:
        for _ in range(3):
            t0 = time.monotonic()
            m, _ = c.request("open", path=d)
            times.append(time.monotonic() - t0)
            assert m["error"]["code"] == "BAD_INDEX", m
            messages.append(m["error"]["message"])
        assert "'t.039999' of shard s.safetensors is missing from weight_map" in messages[0]
        assert messages[1] == messages[0] == messages[2]
        assert times[0] < 10 * SLOW, times
        assert daemon.log_text().count(remembered) == 2
        write_index(t[0] for t in tensors[1:])  # now leaves out the first
        m, _ = c.request("open", path=d)
        assert "'t.000000' of shard s.safetensors is missing" in m["error"]["message"], m
        assert daemon.log_text().count(remembered) == 2
        write_index(t[0] for t in tensors)
        assert c.call("open", path=d)["checkpoint"]["tensors"] == n
