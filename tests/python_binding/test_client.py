"""weightd.Client's ops: plans and devices as arguments, progress, cancel, threads, fork, a killed attacher."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import weightd
from conftest import REPO, SLOW, file_bytes, leases, wait_leases
from wdclient import Checkpoint, wait_until


def set_plan(daemon, sid):
    (s,) = [x for x in daemon.status()["sets"] if x["set"] == sid]
    return s["plan"]


def test_load_source(client, daemon, dense_ckpt):
    """Client.load(source=...): the daemon reads through it; the bytes are the files'."""
    sid = client.load(dense_ckpt, tp_size=2, tp_rank=0, source="direct")
    (s,) = [x for x in daemon.status()["sets"] if x["set"] == sid]
    assert s["read_from"] == "direct" and set(s["read_bytes"]) == {"direct"}, s
    with pytest.raises(weightd.BadRequestError, match="source"):
        client.load(dense_ckpt, source="tape")


def test_plan_from_keyword_arguments(client, daemon, dense_ckpt):
    sid = client.load(dense_ckpt, tp_size=2, tp_rank=1)
    plan = set_plan(daemon, sid)  # the daemon's canonical form: the preset resolved, defaults filled in
    assert (plan["preset"], plan["tp_size"], plan["tp_rank"], plan["fuse"]) == ("dense", 2, 1, False)
    with client.attach(set_id=sid) as s:
        assert s["model.layers.0.self_attn.q_proj.weight"].shape == (128, 256)  # 16 heads x 16 / 2
        assert s["model.layers.0.self_attn.o_proj.weight"].shape == (256, 128)
    sid2 = client.load(dense_ckpt, preset="dense", tp_size=2, tp_rank=0, fuse=True)
    plan = set_plan(daemon, sid2)
    assert (plan["preset"], plan["tp_size"], plan["tp_rank"], plan["fuse"]) == ("dense", 2, 0, True)
    with client.attach(set_id=sid2) as s:
        assert "model.layers.0.self_attn.qkv_proj.weight" in s
    assert client.load(dense_ckpt) not in (sid, sid2)  # the whole plan: another set
    with pytest.raises(TypeError, match="plan="):
        client.load(dense_ckpt, plan={"preset": "whole"}, tp_size=2)
    with pytest.raises(TypeError):
        client.load(dense_ckpt, plan=[1])
    assert weightd.plan_from_args(ep_size=4, ep_rank=1, experts=[3, 1]) == \
        {"preset": "auto", "ep_size": 4, "ep_rank": 1, "experts": [1, 3]}
    assert weightd.plan_from_args() is None and weightd.plan_from_args(preset="whole") == {"preset": "whole"}


def test_explicit_plan(client, dense_ckpt):
    name = "model.layers.0.mlp.gate_proj.weight"
    plan = {"outputs": [{"name": "half", "dtype": "BF16", "shape": [256, 256],
                         "pieces": [{"tensor": name, "dim": 0, "start": 256, "end": 512}]}]}
    ckpt = Checkpoint(dense_ckpt)
    with client.attach(dense_ckpt, plan=plan) as s:
        assert list(s) == ["half"]
        whole = file_bytes(ckpt, name)
        assert s["half"].tobytes() == whole[len(whole) // 2:]
    ckpt.close()


def test_device_arguments(client, daemon, tiny):
    uuid = daemon.status()["devices"][0]["uuid"]
    assert client.backend == "host"
    assert client.device_arg(uuid) == uuid
    assert client.device_arg(0) == "0" and client.device_arg(None) is None
    with pytest.raises(TypeError):
        client.device_arg(True)
    with pytest.raises(TypeError):
        client.device_arg(1.5)
    for dev in (0, uuid, "0", None):
        with client.attach(tiny["a"], device=dev) as s:
            assert s.device == uuid
    with pytest.raises(weightd.NotFoundError):
        client.load(tiny["a"], device=3)
    torch = pytest.importorskip("torch")
    assert client.device_arg(torch.device("cpu")) is None
    with pytest.raises(ValueError):
        client.device_arg(torch.device("meta"))


def test_progress_callback_and_tqdm(client, ckpt_for_slow_load, capsys):
    seen = []
    sid = client.load(ckpt_for_slow_load, progress=lambda done, total: seen.append((done, total)))
    assert seen, "no progress event"
    total = seen[0][1]
    assert all(t == total for _, t in seen) and total >= os.path.getsize(
        os.path.join(ckpt_for_slow_load, "model.safetensors")) - 2 ** 20
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] <= total
    client.evict(sid)
    import tqdm  # noqa: F401  tests/requirements.txt installs it: missing, the test fails
    client.load(ckpt_for_slow_load, progress=True)
    err = capsys.readouterr().err
    assert "weightd load" in err and "B/s" in err, err


def test_cancel_from_another_thread(start_daemon, ckpt_for_slow_load):
    d = start_daemon({"fill_threads": 1})
    c = weightd.Client(d.socket)
    started = threading.Event()
    result = {}

    def run():
        try:
            result["set"] = c.load(ckpt_for_slow_load, progress=lambda done, total: started.set())
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    assert c.cancel() is False  # nothing running
    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60 * SLOW)
    assert c.cancel() is True
    t.join(60 * SLOW)
    assert isinstance(result.get("error"), weightd.CanceledError), result
    # The handle is usable, and the daemon stopped the load: its set is gone, never ready.
    wait_until(lambda: all(s["state"] not in ("loading", "canceling") for s in c.status()["sets"]),
               timeout=30 * SLOW, what="the canceled load to stop")
    assert all(s["state"] == "failed" for s in c.status()["sets"]), c.status()["sets"]
    sid = c.load(ckpt_for_slow_load)
    assert c.status()["sets"][0]["set"] == sid
    c.close()


def test_exception_in_progress_callback_cancels_and_propagates(start_daemon, ckpt_for_slow_load):
    d = start_daemon({"fill_threads": 1})
    with weightd.Client(d.socket) as c:
        class Stop(Exception):
            pass

        def boom(done, total):
            raise Stop("from the callback")

        with pytest.raises(Stop):
            c.attach(ckpt_for_slow_load, progress=boom)
        assert c.status()["daemon"]["leases"] == 0
        wait_until(lambda: all(s["state"] not in ("loading", "canceling") for s in c.status()["sets"]),
                   timeout=30 * SLOW, what="the canceled load to stop")
        assert all(s["state"] == "failed" for s in c.status()["sets"]), c.status()["sets"]


def test_threads_share_one_client(client, tiny):
    errors = []
    sid = client.load(tiny["a"])

    def work():
        try:
            for _ in range(20):
                assert client.status()["daemon"]["connections"] >= 1
                with client.attach(set_id=sid) as s:
                    assert s["layers.0.bias"].shape == (3, 5)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120 * SLOW)
    assert not errors, errors


def test_open_prefetch_evict_request(client, daemon, tiny):
    client.open(tiny["c"])
    client.prefetch(tiny["c"], wait=True)
    st = client.status()
    (ck,) = [x for x in st["checkpoints"] if x["path"] == os.path.realpath(tiny["c"])]
    assert ck["tensors"] == 6
    sid = client.load(tiny["c"])
    assert client.evict(sid) == [sid]
    sid = client.load(tiny["c"])
    assert client.evict(device=0) == [sid]
    with pytest.raises(TypeError):
        client.evict()
    rep = client.request({"op": "open", "path": os.path.realpath(tiny["c"])})
    assert rep["ok"] is True and rep["checkpoint"]["layout"] == "single"
    # a relative path is made absolute against our working directory, as libweightd does
    cwd = os.getcwd()
    os.chdir(os.path.dirname(tiny["c"]))
    try:
        client.open(os.path.basename(tiny["c"]))
    finally:
        os.chdir(cwd)


def test_timeout_bounds_each_wait(tmp_path):
    """A peer that answers hello and then nothing: a call gives TimeoutError after `timeout`."""
    import socket
    import struct

    path = str(tmp_path / "mute.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        n = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))[0]
        hello = json.loads(conn.recv(n, socket.MSG_WAITALL))
        body = json.dumps({"id": hello["id"], "ok": True, "protocol": 1, "backend": "host", "version": "0"}).encode()
        conn.sendall(struct.pack("<I", len(body)) + body)
        conn.recv(1 << 16)  # the next request, never answered
        time.sleep(2)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        c = weightd.Client(path, timeout=0.2)
        with pytest.raises(weightd.TimeoutError, match="0.2|200 ms"):
            c.status()
        c.close()
    finally:
        t.join()
        srv.close()


def test_fork_child_may_read_but_not_call(client, daemon, tiny):
    ckpt = Checkpoint(tiny["a"])
    s = client.attach(tiny["a"])
    a = s["embed.weight"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(r)
            out = {"bytes_ok": a.tobytes() == file_bytes(ckpt, "embed.weight")}
            try:
                client.status()
            except weightd.InvalidError as e:
                out["call"] = e.message
            with weightd.Client(daemon.socket) as c2, c2.attach(tiny["a"]) as s2:
                out["own_lease"] = s2.lease
                out["own_ok"] = s2["head.weight"].tobytes() == file_bytes(ckpt, "head.weight")
            del a
            s.release()  # in the child: unmaps only, the parent's lease stays
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = json.loads(f.read() or "{}")
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, out
    assert out["bytes_ok"] and out["own_ok"] and out["own_lease"] != s.lease
    assert "fork()" in out["call"] and str(os.getpid()) in out["call"]
    assert leases(daemon) == 1  # the parent's lease survived the child's release
    assert a.tobytes() == file_bytes(ckpt, "embed.weight")
    assert client.status()["daemon"]["leases"] == 1
    del a
    s.release()
    assert leases(daemon) == 0
    ckpt.close()


CHILD = r"""
import sys, weightd
c = weightd.Client(sys.argv[1])
s = c.attach(sys.argv[2])
arrays = [s[n] for n in s]
print(s.lease, sum(a.nbytes for a in arrays), flush=True)
sys.stdin.read()
"""


def test_process_killed_while_attached(daemon, tiny):
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "client", "python"))
    p = subprocess.Popen([sys.executable, "-c", CHILD, daemon.socket, tiny["b"]], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=env, text=True)
    try:
        line = p.stdout.readline().split()
        assert len(line) == 2, line
        assert leases(daemon) == 1
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()
    wait_leases(daemon, 0, "leases after the attached process was killed")
    st = daemon.status()
    assert st["sets"][0]["leases"] == 0
    with daemon.connect() as raw:
        assert raw.call("evict", set=st["sets"][0]["set"])["evicted"]


def test_status_pages(client, daemon, tiny):
    """Client.status pages with limit and after; all_pages=True merges every page into one status."""
    sids = [client.load(tiny[k]) for k in ("a", "b", "c", "many")]
    first = client.status(limit=1)
    assert len(first["checkpoints"]) == 1 and first["totals"]["checkpoints"] == 4
    assert first["left_out"] == {"checkpoints": 3, "sets": 3}
    second = client.status(limit=1, after=first["next"])
    assert set(second) >= {"checkpoints", "sets"} and "leases" not in second
    assert second["checkpoints"][0]["path"] != first["checkpoints"][0]["path"]
    merged = client.status(limit=1, all_pages=True)
    assert sorted(s["set"] for s in merged["sets"]) == sorted(sids)
    assert len({c["path"] for c in merged["checkpoints"]}) == 4
    assert "next" not in merged and "left_out" not in merged
    with pytest.raises(weightd.BadRequestError, match="limit"):
        client.status(limit=0)
