"""weightctl against a real daemon: leases you can see, cancel from another process and on
Ctrl-C (through a pseudo-terminal), progress only on a terminal, prewarm and its exit codes,
health, one JSON object for every outcome, and errors that say what to do.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import pytest

from cliutil import PtyRun, ctl, json_error, json_out, one_error_line, weightd
from conftest import SLOW, WEIGHTCTL
from wdclient import Conn, frame, wait_until

# Loads slow enough to be interrupted: one fill thread, through the staging slots.
SLOW_LOADS = {"fill_threads": 1, "load_method": "staged", "staging_slot_bytes": "1MiB"}


def dctl(d, *args, **kw):
    return ctl("--socket", d.socket, *args, **kw)


def ok(res):
    assert res.code == 0, res.describe()
    return res


def no_sets(d):
    st = d.status()
    return st if not st["sets"] and not st["requests"] else None


def request_of(d, pid, op):
    """The daemon-wide id of pid's running request op, once status lists it."""
    for r in d.status()["requests"]:
        if r["pid"] == pid and r["op"] == op and r["state"] == "running":
            return r["request"]
    return None


# ---- leases you can see ------------------------------------------------------------------------


def test_status_lists_leases_and_evict_names_holders(daemon, tiny):
    with Conn(daemon.socket, client="engine-7 rank 3") as eng:
        att, fd = eng.attach(path=tiny["a"], device=0)
        os.close(fd)
        lease, set_id = att["lease"], att["set"]
        st = json_out(ok(dctl(daemon, "--json", "status")))
        (l,) = st["leases"]
        assert l["lease"] == lease and l["set"] == set_id, l
        assert l["pid"] == os.getpid() and l["uid"] == os.getuid(), l
        assert l["client_name"] == "engine-7 rank 3" and l["age_s"] >= 0, l
        text = ok(dctl(daemon, "status")).out
        assert re.search(rf"^  {lease} +set {set_id} +pid {os.getpid()} +uid {os.getuid()} .*"
                         r"client 'engine-7 rank 3' \(self-reported\)", text, re.M), text
        # evict's BUSY says who holds the set and how to end the lease.
        res = dctl(daemon, "evict", set_id)
        line = one_error_line(res, 1, "BUSY", lease, f"pid {os.getpid()}", "engine-7 rank 3", "self-reported",
                              "weightctl release")
        assert f"set {set_id}" in line
        msg = json_error(dctl(daemon, "--json", "evict", set_id), "BUSY", 1)
        assert lease in msg
        # release takes the id status lists (root may end another connection's lease).
        res = ok(dctl(daemon, "release", lease))
        assert res.out == f"released lease {lease}\n"
        assert json_out(ok(dctl(daemon, "--json", "status")))["leases"] == []
        assert ok(dctl(daemon, "evict", set_id)).out == f"evicted {set_id}\n"


def test_load_source_flag(daemon, tiny):
    """weightctl load --source: says what read the bytes; --json carries read_from; a bad value is refused."""
    res = ok(dctl(daemon, "load", tiny["b"], "--source", "direct"))
    assert "read through direct\n" in res.out, res.describe()
    rep = json_out(ok(dctl(daemon, "--json", "load", tiny["c"], "--source", "mmap")))
    assert rep["read_from"] == "mmap" and set(rep["read_bytes"]) == {"mmap"}, rep
    res = dctl(daemon, "load", tiny["a"], "--source", "tape")
    one_error_line(res, 1, "BAD_REQUEST", "field 'source'", "auto, mmap, direct")


class LoadGate:
    """The daemon's test_load_gate (a FIFO a load reads one byte from before each window): held shut
    while this end is open, so a load stays in its state "loading" until open() is called."""

    def __init__(self, directory):
        self.path = os.path.join(directory, "gate")
        os.mkfifo(self.path)
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)

    def open(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@pytest.fixture
def gated(start_daemon, tmp_path):
    gate = LoadGate(str(tmp_path))
    d = start_daemon({"test_load_gate": gate.path})
    yield d, gate
    gate.open()


def set_line(text, set_id):
    lines = [l for l in text.splitlines() if l.startswith(f"  {set_id} ")]
    assert len(lines) == 1, text
    return lines[0]


def test_status_of_a_loading_set(gated, ckpt_sharded):
    """A set still loading has no "seconds" in the status JSON, and weightctl says how far it got,
    never "loaded in 0.000 s" (which it printed before); once ready it says how long it took."""
    d, gate = gated
    with d.connect() as c:
        rid = c.start("load", path=ckpt_sharded, device=0)
        wait_until(lambda: [x for x in d.status()["sets"] if x["state"] == "loading"], timeout=30 * SLOW,
                   what="the set listed as loading")
        (x,) = json_out(ok(dctl(d, "--json", "status")))["sets"]
        assert x["state"] == "loading" and "seconds" not in x and x["bytes_done"] < x["bytes"], x
        line = set_line(ok(dctl(d, "status")).out, x["set"])
        assert "loaded in" not in line and re.search(r" loading .* of [\d.]+ [KMG]iB loaded  on ", line), line
        gate.open()
        m, _ = c.wait(rid)
        assert m.get("ok") is True, m
    (x,) = json_out(ok(dctl(d, "--json", "status")))["sets"]
    assert x["state"] == "ready" and x["seconds"] == pytest.approx(m["seconds"], abs=1e-3), x
    assert re.search(r" ready .* loaded in \d+\.\d{3} s  on ", set_line(ok(dctl(d, "status")).out, x["set"]))


def test_shutdown_during_a_load_is_said_once(gated, ckpt_sharded):
    """weightctl prints its command's name once, also when the library's message starts with it
    (before: "weightctl: load: load: the daemon is shutting down")."""
    d, gate = gated
    loader = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", ckpt_sharded], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    wait_until(lambda: request_of(d, loader.pid, "load"), timeout=30 * SLOW, what="the load to be listed")
    d.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: canceling loads" in d.log_text(), timeout=30 * SLOW, what="the stop to begin")
    gate.open()
    out, err = loader.communicate(timeout=60 * SLOW)
    assert loader.returncode == 1 and out == "", (out, err)
    assert err == "weightctl: load: the daemon is shutting down (SHUTDOWN)\n", err


# ---- cancel ---------------------------------------------------------------------------------


def test_cancel_from_another_process(start_daemon, ckpt_sharded):
    """A load started by one weightctl is canceled by another, by the id status lists."""
    d = start_daemon(SLOW_LOADS)
    for attempt in range(5):
        loader = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", ckpt_sharded], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        rid = wait_until(lambda: request_of(d, loader.pid, "load") or (loader.poll() is not None and "done"),
                         timeout=30 * SLOW, interval=0.005, what="the load to be listed")
        if rid == "done":  # finished before we saw it: try again
            loader.communicate()
            ok(dctl(d, "evict", "--device", "0"))
            continue
        res = dctl(d, "--json", "cancel", rid)
        out, err = loader.communicate(timeout=60 * SLOW)
        if res.code == 1 and "NOT_FOUND" in res.out:  # finished meanwhile
            ok(dctl(d, "evict", "--device", "0"))
            continue
        assert json_out(ok(res)) == {"ok": True, "canceled": [{"canceled": True, "request": rid, "op": "load"}]}
        assert loader.returncode == 1, out + err
        assert "CANCELED" in err and out == "", err
        wait_until(lambda: no_sets(d), timeout=30 * SLOW, what="the canceled set to go")
        assert f"request {rid} (load of pid {loader.pid}) canceled by pid" in d.log_text()
        return
    pytest.fail("five loads finished before they could be canceled")


def test_cancel_errors(daemon):
    msg = json_error(dctl(daemon, "--json", "cancel", "r999999"), "NOT_FOUND", 1)
    assert "r999999" in msg
    one_error_line(dctl(daemon, "cancel", "banana"), 1, "NOT_FOUND", "'banana'")
    one_error_line(dctl(daemon, "cancel"), 2, "cancel needs REQUEST")
    with daemon.connect() as c:  # the protocol: one form or the other
        m, _ = c.request("cancel", request="r1", target=1)
        assert m["error"]["code"] == "BAD_REQUEST" and "not both" in m["error"]["message"], m


def test_ctrl_c_cancels_a_load_on_a_terminal(start_daemon, ckpt_sharded):
    """Ctrl-C during load cancels the load in the daemon (it used to go on); the terminal shows progress."""
    d = start_daemon(SLOW_LOADS)
    for attempt in range(5):
        run = PtyRun("--socket", d.socket, "load", ckpt_sharded)
        # The progress line: a carriage return, the bar, GiB figures.
        drawn = run.read_until(rb"\rload \[[#.]+\] +\d+%  [\d.]+ of [\d.]+ GiB", 60)
        if drawn:
            run.signal(signal.SIGINT)
        code = run.wait()
        text = run.text()
        if code == 0:  # the load finished first
            ok(dctl(d, "evict", "--device", "0"))
            continue
        assert drawn, text
        assert code == 1 and "load: interrupted; canceled (CANCELED)" in text, text
        wait_until(lambda: no_sets(d), timeout=30 * SLOW, what="the canceled set to go")
        assert "canceled by pid" in d.log_text()
        return
    pytest.fail("five loads finished before Ctrl-C reached them")


def test_interrupt_while_the_command_reports(start_daemon, ckpt_sharded):
    """Ctrl-C cancels a load; the command, not the watcher, reports it, however long that takes.

    weightctl's stderr is a pipe that is full (the test drains it only later),
    so after the canceled load returns, the command blocks writing its error
    for longer than the watcher's grace period (5 s). The watcher must not
    report and exit as well: the command is no longer in a call to the daemon.
    """
    import fcntl
    import threading

    d = start_daemon(SLOW_LOADS)
    for attempt in range(5):
        r, w = os.pipe()
        fcntl.fcntl(w, 1031, 4096)  # F_SETPIPE_SZ: one page
        os.write(w, b"x" * 4096)  # full: weightctl's first write to stderr blocks
        loader = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", ckpt_sharded], stdout=subprocess.PIPE,
                                  stderr=w)
        os.close(w)
        rid = wait_until(lambda: request_of(d, loader.pid, "load") or (loader.poll() is not None and "done"),
                         timeout=30 * SLOW, interval=0.005, what="the load to be listed")
        if rid != "done":
            loader.send_signal(signal.SIGINT)
            wait_until(lambda: request_of(d, loader.pid, "load") is None, timeout=30 * SLOW,
                       what="the load to be canceled")
            time.sleep(7)  # past the watcher's grace period, with the command blocked on stderr
        chunks = []
        reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(r, 65536), b"")))
        reader.start()
        out, _ = loader.communicate(timeout=60 * SLOW)
        reader.join(timeout=60 * SLOW)
        os.close(r)
        err = b"".join(chunks)[4096:].decode()
        if loader.returncode == 0:  # the load finished first
            ok(dctl(d, "evict", "--device", "0"))
            continue
        assert rid != "done", err
        assert loader.returncode == 1, err
        assert err == "weightctl: load: interrupted; canceled (CANCELED)\n", err
        assert out == b"", out
        wait_until(lambda: no_sets(d), timeout=30 * SLOW, what="the canceled set to go")
        return
    pytest.fail("five loads finished before Ctrl-C reached them")


def test_progress_only_on_a_terminal(start_daemon, ckpt_small):
    d = start_daemon(SLOW_LOADS)
    # Pipes: the summary alone, no progress line.
    res = ok(dctl(d, "load", ckpt_small))
    assert "\r" not in res.err and "\r" not in res.out and res.err == "", res.describe()
    assert re.match(r"set s\d+ on host-\w+\n  \d+ tensors, \d+ bytes \([\d.]+ MiB\) in [\d.]+ s, [\d.]+ GiB/s",
                    res.out), res.out
    ok(dctl(d, "evict", "--device", "0"))
    # A terminal with --json: no progress either, one JSON object.
    run = PtyRun("--socket", d.socket, "--json", "load", ckpt_small)
    assert run.wait() == 0, run.text()
    assert "\r" not in run.text().replace("\r\n", "\n"), repr(run.text())
    obj = json.loads(run.text().strip())
    assert obj["ok"] is True and "id" not in obj
    # Numbers: exact integers, at most 6 significant digits otherwise, never an exponent.
    raw = run.text().strip()
    for m in re.finditer(r'"(seconds|alloc_seconds|gib_per_s)":([^,}]+)', raw):
        v = m.group(2)
        assert re.fullmatch(r"\d+(\.\d+)?", v), raw
        assert len(v.replace(".", "").lstrip("0")) <= 6, raw


def test_writers_show_progress_on_a_terminal(tmp_path, ckpt_small):
    """mkcheckpoint and export (seconds of writing) draw bytes, rate and time left; nothing through pipes."""
    run = PtyRun("mkcheckpoint", "--preset", "qwen3-0.6b", "--layers", "1", "--out", tmp_path / "mk")
    assert run.wait(300) == 0, run.text()
    text = run.text()
    assert re.search(r"\rmkcheckpoint \[[#.]+\] +\d+%  [\d.]+ of 0\.61 GiB", text), repr(text[-2000:])
    assert re.search(r"[\d.]+ GiB/s", text) and re.search(r"wrote qwen3-0\.6b .* GiB/s, \d+ threads?", text), text
    shutil.rmtree(tmp_path / "mk")  # 0.6 GiB each: one at a time on a CI disk
    res = ctl("mkcheckpoint", "--preset", "qwen3-0.6b", "--layers", "1", "--out", tmp_path / "mk2", timeout=300)
    assert res.code == 0 and res.err == "" and "\r" not in res.out, res.describe()
    shutil.rmtree(tmp_path / "mk2")
    run = PtyRun("export", ckpt_small, "--out", tmp_path / "ex", "--threads", "1")
    assert run.wait(300) == 0, run.text()
    assert re.search(r"\rexport \[[#.]+\] +\d+%  [\d.]+ of 0\.61 GiB", run.text()), repr(run.text()[-2000:])
    assert "GB/s" not in run.text() and re.search(r"exported plan .* GiB/s", run.text(), re.S), run.text()


def test_prefetch_wait_progress_and_cancel(start_daemon, ckpt_sharded):
    """prefetch --wait: progress events from the daemon, and a cancel that stops it."""
    d = start_daemon({"fill_threads": 1})
    run = PtyRun("--socket", d.socket, "prefetch", ckpt_sharded, "--wait")
    code = run.wait()
    assert code == 0 and "prefetched " in run.text(), run.text()
    with d.connect() as c:
        # Canceled while the checkpoint is still being opened: it answers CANCELED and reads nothing.
        c.send_raw(b"".join([frame({"op": "prefetch", "id": "p", "path": ckpt_sharded, "wait": True}),
                             frame({"op": "cancel", "id": "c", "target": "p"})]))
        rc, _ = c.wait("c")
        assert rc.get("canceled") is True, rc
        m, _ = c.wait("p")
        assert m.get("error", {}).get("code") == "CANCELED", m
        # Events, when the read lasts long enough to send any, count the shards' bytes.
        total = sum(os.path.getsize(os.path.join(ckpt_sharded, f)) for f in os.listdir(ckpt_sharded)
                    if f.endswith(".safetensors"))
        rid = c.start("prefetch", path=ckpt_sharded, wait=True)
        m, _ = c.wait(rid)
        assert m.get("ok") is True, m
        for e in c.events.get(rid, []):
            assert e["event"] == "progress" and e["bytes_total"] == total and 0 <= e["bytes_done"] <= total, e


# ---- prewarm --------------------------------------------------------------------------------


def test_prewarm_is_idempotent(start_daemon, ckpt_small):
    d = start_daemon()
    first = json_out(ok(dctl(d, "--json", "prewarm", ckpt_small, "--device", "0")))
    assert first["ok"] is True and first["prefetched"] is True, first
    assert first["plan"] == {"preset": "whole"} and first["path"] == os.path.realpath(ckpt_small)
    (s,) = first["sets"]
    assert s["resident_before"] is False and re.fullmatch(r"s\d+", s["set"]) and s["device"].startswith("host-")
    assert set(first["timings"]) == {"open_s", "prefetch_s", "load_s", "total_s"}
    # Again: resident already, nothing read or loaded.
    t0 = time.monotonic()
    again = json_out(ok(dctl(d, "--json", "prewarm", ckpt_small, "--device", s["device"])))
    assert again["prefetched"] is False and again["sets"][0]["resident_before"] is True, again
    assert "set" not in again["sets"][0]
    assert time.monotonic() - t0 < 10 * SLOW
    st = d.status()
    assert len(st["sets"]) == 1 and st["sets"][0]["set"] == s["set"]
    text = ok(dctl(d, "prewarm", ckpt_small)).out
    assert "already resident" in text, text


def test_prewarm_plan_and_exit_codes(start_daemon, ckpt_small, tmp_path):
    d = start_daemon(SLOW_LOADS)
    # A plan: one rank of two, and a second run of it is resident.
    r = json_out(ok(dctl(d, "--json", "prewarm", ckpt_small, "--tp-size", "2", "--tp-rank", "1")))
    assert r["plan"]["tp_rank"] == 1 and r["plan"]["preset"] == "dense", r
    assert json_out(ok(dctl(d, "--json", "prewarm", ckpt_small, "--tp-size=2", "--tp-rank=1")))["prefetched"] is False
    # 2: usage; 1: the daemon refuses (no such device); 3: no daemon; 4: timeout.
    json_error(dctl(d, "--json", "prewarm", ckpt_small, "--tp-size", "2"), "USAGE", 2)
    json_error(dctl(d, "--json", "prewarm", ckpt_small, "--device", "7"), "NOT_FOUND", 1)
    json_error(ctl("--json", "--socket", tmp_path / "none.sock", "prewarm", ckpt_small), "CONNECT", 3)
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    msg = json_error(ctl("--json", "--socket", stale, "prewarm", ckpt_small), "CONNECT", 3)
    assert f"no daemon is listening at {stale}" in msg
    msg = json_error(dctl(d, "--json", "prewarm", ckpt_small, "--tp-size", "4", "--tp-rank", "3", "--timeout", "30ms"),
                     "TIMEOUT", 4)
    assert "0.03 s" in msg, msg
    # What it started was canceled (a load whose bytes were all in already may still finish).
    wait_until(lambda: not d.status()["requests"], timeout=30 * SLOW, what="the timed-out request to end")
    d.check_serving()


def test_health(daemon, tmp_path):
    assert ok(dctl(daemon, "health")).out == "ready\n"
    assert json_out(ok(dctl(daemon, "--json", "health"))) == {"ok": True, "ready": True}
    json_error(ctl("--json", "--socket", tmp_path / "none.sock", "health"), "CONNECT", 3)


# ---- --json for every outcome ------------------------------------------------------------------


def test_json_for_every_error_path(daemon, tiny, outside_dir, tmp_path):
    """Every failure, local or the daemon's, prints exactly one error object on stdout."""
    cases = [
        (["load", tiny["a"], "--tp-sise", "2"], "USAGE", 2),
        (["load"], "USAGE", 2),
        (["frobnicate"], "USAGE", 2),
        (["load", tiny["a"], "--tp-size", "2", "--tp-rank", "5"], "USAGE", 2),
        (["evict"], "USAGE", 2),
        (["evict", "s404"], "NOT_FOUND", 1),
        (["attach", "s404"], "NOT_FOUND", 1),
        (["release", "l404"], "NOT_FOUND", 1),
        (["load", os.path.join(outside_dir, "secret.safetensors")], "PATH_DENIED", 1),
        (["open", str(tmp_path / "missing")], None, 1),
        (["shutdown", "--timeout", "x"], "USAGE", 2),
        (["inspect", str(tmp_path / "missing")], "NOT_FOUND", 1),
        (["plan", tiny["a"], "--plan", str(tmp_path / "missing.json")], "FAILED", 1),
        (["export", tiny["a"]], "USAGE", 2),
        (["mkcheckpoint", "--preset", "nope", "--out", str(tmp_path / "o")], "USAGE", 2),
    ]
    for args, code, exit_code in cases:
        res = dctl(daemon, "--json", *args)
        assert res.code == exit_code, res.describe()
        obj = json_out(res)
        assert set(obj) == {"error"}, res.describe()
        if code is not None:
            assert obj["error"]["code"] == code, res.describe()
        assert obj["error"]["message"], res.describe()
    # Unreachable and timed out, without a daemon to answer.
    json_error(ctl("--json", "--socket", tmp_path / "none.sock", "status"), "CONNECT", 3)
    json_error(ctl("status", "--json", "--socket", tmp_path / "none.sock"), "CONNECT", 3)
    # Successes print one object without the internal request id.
    for args in (["status"], ["open", tiny["b"]], ["prefetch", tiny["b"], "--wait"], ["health"],
                 ["plan", tiny["a"]], ["inspect", tiny["a"]]):
        obj = json_out(ok(dctl(daemon, "--json", *args)))
        assert "error" not in obj


# ---- errors that say what to do -----------------------------------------------------------------


def test_socket_errors_name_the_socket(tmp_path):
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    line = one_error_line(ctl("--socket", stale, "status"), 3, f"no daemon is listening at {stale}", "start weightd")
    assert "Connection refused" not in line
    one_error_line(ctl("--socket", tmp_path / "none.sock", "status"), 3, f"{tmp_path}/none.sock: no such socket",
                   "is weightd running?")


def test_daemon_socket_in_a_missing_directory(tmp_path):
    res = weightd("--foreground", "--backend", "host", "--socket", f"{tmp_path}/nodir/w.sock")
    assert res.code == 1, res.describe()
    assert f"socket {tmp_path}/nodir/w.sock: {tmp_path}/nodir: No such file or directory" in res.err, res.err
    assert ".tmp" not in res.err, res.err


def test_missing_socket_group_is_a_warning(start_daemon):
    d = start_daemon({"socket_group": "no-such-group-wd"})
    log = d.log_text()
    assert "weightd[warn]: socket_group 'no-such-group-wd' does not exist" in log, log
    assert "create the group" in log


def test_demo_dir_that_cannot_be_made(tmp_path):
    res = ctl("demo", "--dir", tmp_path / "missing" / "sub")
    one_error_line(res, 1, "cannot create the directory", str(tmp_path / "missing" / "sub"))
    assert "kept" not in res.out + res.err
