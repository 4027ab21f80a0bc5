"""Errors that say where and what to do: configuration files (line and column, did-you-mean,
strict types, budgets above the machine), and permissions, run as an unprivileged user
(a child dropped to nobody: these need root and skip elsewhere).
"""
import os
import re
import subprocess

import pytest

from cliutil import NOBODY, ctl, json_error, json_out, one_error_line, weightd
from conftest import SLOW, WEIGHTCTL, WEIGHTD
from wdclient import wait_until

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")


# ---- the configuration file ---------------------------------------------------------------------


@pytest.mark.parametrize("text,message", [
    ('{\n  "backend": "host",\n  "job_threads": 4,\n}\n', ":4:1: trailing comma"),
    ('{\n  "model_root": ["/models"]\n}\n', ":2:3: unknown key 'model_root'; did you mean 'model_roots'?"),
    ('{"backend": "host",\n "job_threads": "4"}', ":2:17: 'job_threads' must be a number, not a string"),
    ('{"allowed_uids": ["1000"]}', ":1:19: 'allowed_uids' entry 0 must be a numeric id (a number), not string"),
    ('{"socket_mode": 432}', ":1:17: 'socket_mode' must be a string of octal digits"),
    ('{"log_level": "loud"}', ":1:15: config 'log_level': 'loud' is not one of error, warn, info, debug"),
    ('{"staging_writes": "fast"}',
     ":1:20: config 'staging_writes': 'fast' is not one of auto, cached, streaming, write_combined"),
    ('{"backend": "host", "backend": "cuda"}', ":1:21: 'backend' is given twice (first at line 1)"),
    ('[1, 2]', ":1:1: the configuration must be a JSON object, not array"),
    ('{"fill_threads": 01}', ":1:18: invalid number (leading zero)"),
])
def test_config_errors_say_where(tmp_path, text, message):
    path = tmp_path / "weightd.json"
    path.write_text(text)
    res = weightd("--config", path, "--foreground", "--socket", tmp_path / "s.sock")
    assert res.code == 1, res.describe()
    lines = res.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"weightd: {path}{message}"), res.describe()


def test_config_types_that_are_meant(tmp_path):
    """Strict types keep what is meant: sizes as "64MiB" or a number, modes as octal text, ids as numbers."""
    path = tmp_path / "ok.json"
    path.write_text('{"staging_slot_bytes": "2MiB", "max_queued_output": 67108864, "socket_mode": "0640",\n'
                    ' "allowed_uids": [0, 4242], "job_threads": 3, "backend": "host", "metrics_address": ""}')
    sock = tmp_path / "s.sock"
    p = subprocess.Popen([WEIGHTD, "--config", str(path), "--foreground", "--socket",
                          str(sock)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: sock.exists() or p.poll() is not None, timeout=30 * SLOW, what="weightd to listen")
        assert p.poll() is None, p.communicate()[0]
        assert oct(os.stat(sock).st_mode & 0o777) == "0o640"
    finally:
        p.terminate()
        out = p.communicate(timeout=30 * SLOW)[0]
    assert p.returncode == 0, out


def test_budget_above_the_machine_is_capped(start_daemon):
    d = start_daemon({"device_memory_budget": "100TiB", "host_pin_budget": "100TiB"})
    log = d.log_text()
    dev = d.status()["devices"][0]
    gib = dev["memory_total"] / (1 << 30)
    m = re.search(r"weightd\[warn\]: device_memory_budget \(102400\.00 GiB\) is more than device 0 \(host memory\) "
                  r"has \(([\d.]+) GiB\): capped at ([\d.]+) GiB", log)
    assert m and abs(float(m.group(1)) - gib) < 0.01 and m.group(1) == m.group(2), log
    assert re.search(r"weightd\[warn\]: host_pin_budget \(102400\.00 GiB\) is more than this machine's memory "
                     r"\([\d.]+ GiB\): capped at [\d.]+ GiB", log), log
    assert dev["budget"] == dev["memory_total"], dev


# ---- permissions, as nobody ----------------------------------------------------------------------


@needs_root
def test_socket_permission_names_owner_group_mode_and_keys(start_daemon):
    d = start_daemon({"socket_mode": "0600"}, public=True)
    res = ctl("--socket", d.socket, "status", user=NOBODY)
    line = one_error_line(res, 3, f"permission denied on {d.socket}", "owned by root(0)", "mode 0600",
                          f"you are uid {NOBODY}", "socket_group", "socket_mode")
    assert "groups" in line
    msg = json_error(ctl("--json", "--socket", d.socket, "status", user=NOBODY), "CONNECT", 3)
    assert "mode 0600" in msg


@needs_root
def test_daemon_refusal_names_the_keys(start_daemon):
    d = start_daemon({"allowed_uids": "4242", "socket_mode": "0666"}, public=True)
    res = ctl("--socket", d.socket, "status", user=NOBODY)
    one_error_line(res, 1, f"uid {NOBODY}", "allowed_uids", "allowed_gids", "PERMISSION")


@needs_root
def test_cancel_of_another_uids_request_is_refused(start_daemon, ckpt_sharded):
    d = start_daemon({"allowed_uids": str(NOBODY), "socket_mode": "0666", "fill_threads": 1,
                      "load_method": "staged", "staging_slot_bytes": "1MiB"}, public=True)
    for attempt in range(5):
        loader = subprocess.Popen([WEIGHTCTL, "--socket", d.socket, "load", ckpt_sharded], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

        def listed():
            for r in d.status()["requests"]:
                if r["pid"] == loader.pid and r["op"] == "load":
                    return r["request"]
            return "done" if loader.poll() is not None else None

        rid = wait_until(listed, timeout=30 * SLOW, interval=0.005, what="the load to be listed")
        res = ctl("--socket", d.socket, "cancel", rid, user=NOBODY) if rid != "done" else None
        loader.communicate(timeout=60 * SLOW)
        if res is None or "NOT_FOUND" in res.err:
            ctl("--socket", d.socket, "evict", "--device", "0")
            continue
        one_error_line(res, 1, "PERMISSION", f"request {rid} belongs to uid 0")
        assert loader.returncode == 0, "nobody's cancel stopped root's load"
        return
    pytest.fail("five loads finished before nobody's cancel reached them")


# ---- paths the client cannot make absolute --------------------------------------------------------


def test_a_relative_path_with_no_working_directory_is_refused(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    # The working directory is removed under the command: getcwd fails, and the relative path
    # must not travel as it is (the daemon would resolve it in its own directory).
    p = subprocess.run(["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" --socket "$3" open model-x', "sh",
                        str(gone), WEIGHTCTL, str(tmp_path / "none.sock")], capture_output=True, text=True,
                       timeout=60 * SLOW)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "model-x" in p.stderr and "cannot make the path absolute" in p.stderr, p.stderr


def test_a_relative_path_too_long_to_make_absolute_is_refused(tmp_path):
    name = "d" * 5000
    res = ctl("--socket", tmp_path / "none.sock", "open", name)
    one_error_line(res, 1, "path too long", name[:40])
