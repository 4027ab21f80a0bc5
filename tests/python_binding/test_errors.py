"""Errors as exceptions: one class per C code (checked against the header), the daemon's codes and messages."""
import builtins
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

import weightd
import wdclient
from conftest import REPO, SLOW

HEADER = os.path.join(REPO, "client", "include", "weightd.h")


def header_table():
    """(name, number, message) of every XX(...) row of WEIGHTD_ERRNO_MAP, read from the header itself."""
    with open(HEADER) as f:
        text = f.read()
    rows = re.findall(r'XX\(\s*([A-Z_0-9]+)\s*,\s*(\d+)\s*,\s*"([^"]*)"\s*\)', text)
    assert len(rows) >= 29, rows
    return [(n, int(k), m) for n, k, m in rows]


def test_every_c_code_has_a_class():
    table = header_table()
    assert set(weightd.by_name) == {n for n, _, _ in table}
    for name, num, message in table:
        cls = weightd.by_name[name]
        assert issubclass(cls, weightd.Error) and cls is not weightd.Error
        assert cls.code == -num and cls.name == name and cls.description == message
        assert weightd.by_code[-num] is cls
        assert getattr(weightd, cls.__name__) is cls and getattr(weightd.errors, cls.__name__) is cls
        assert cls.__name__ == "".join(w.capitalize() for w in name.split("_")) + "Error"
        e = weightd.error_from_code(-num, "detail")
        assert type(e) is cls and e.code == -num and e.name == name and e.message == "detail"
        assert str(e) == f"{name}: detail"
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and again.message == "detail"
    # TIMEOUT and PERMISSION also derive from the built-ins of their names; no other code does.
    assert weightd.errors.BUILTIN_BASES == {"TIMEOUT": builtins.TimeoutError, "PERMISSION": builtins.PermissionError}
    for name, cls in weightd.by_name.items():
        builtin = weightd.errors.BUILTIN_BASES.get(name)
        if builtin is None:
            assert not issubclass(cls, OSError), name
            continue
        assert issubclass(cls, builtin) and cls.__name__ == builtin.__name__, name
        e = cls("detail")
        assert str(e) == f"{name}: detail" and e.message == "detail" and e.code == cls.code
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is cls and isinstance(again, builtin) and again.message == "detail"
    assert weightd.TimeoutError is not builtins.TimeoutError and weightd.PermissionError is not builtins.PermissionError
    unknown = weightd.error_from_code(-9999, "x")
    assert type(unknown) is weightd.Error and unknown.name == "UNKNOWN"


def test_connect_failure_names_the_socket(tmp_path):
    sock = str(tmp_path / "none.sock")
    with pytest.raises(weightd.ConnectError) as ei:
        weightd.Client(sock)
    assert sock in ei.value.message and ei.value.code == weightd.ConnectError.code


def test_named_socket_is_the_only_one_tried(daemon, tmp_path, monkeypatch):
    """Before: a $WEIGHTD_SOCKET with no daemon behind it fell through to the per-user socket and connected."""
    if os.path.exists("/run/weightd/weightd.sock"):
        pytest.skip("/run/weightd/weightd.sock exists on this machine: the search would reach it first")
    monkeypatch.setenv("XDG_RUNTIME_DIR", daemon.dir)  # its socket, DIR/weightd.sock, is the per-user one
    monkeypatch.delenv("WEIGHTD_SOCKET", raising=False)
    with weightd.Client() as c:
        assert c.backend == "host"
    dead = str(tmp_path / "none.sock")
    monkeypatch.setenv("WEIGHTD_SOCKET", dead)
    with pytest.raises(weightd.ConnectError) as ei:
        weightd.Client()
    assert dead in ei.value.message and daemon.socket not in ei.value.message, ei.value.message


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a daemon as another uid")
def test_daemon_of_another_user_is_refused(start_daemon):
    """Before: the client connected to a daemon run by nobody, which could serve it memory of its own."""
    d = start_daemon({"socket_mode": "0666"}, user=65534, public=True)
    with pytest.raises(weightd.ConnectError) as ei:
        weightd.Client(d.socket)
    for needle in (d.socket, "uid 65534 (nobody)", f"pid {d.pid}"):
        assert needle in ei.value.message, ei.value.message


def test_daemon_errors_carry_code_and_message(client, daemon, tiny, outside_dir, dense_ckpt, model_root):
    with pytest.raises(weightd.NotFoundError, match="s404"):
        client.attach(set_id="s404")
    with pytest.raises(weightd.PathDeniedError) as ei:
        client.load(os.path.join(outside_dir, "secret.safetensors"))
    assert ei.value.name == "PATH_DENIED" and ei.value.message
    with pytest.raises(weightd.BadPlanError, match="tp"):
        client.load(dense_ckpt, tp_size=3, tp_rank=0)  # 16 query heads do not divide by 3
    with pytest.raises(weightd.BadPlanError, match="tp_rank"):
        client.load(dense_ckpt, plan={"preset": "dense", "tp_size": 2, "tp_rank": -1})
    bad = os.path.join(model_root, "py-bad-header")
    os.makedirs(bad)
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write((16).to_bytes(8, "little") + b"{not json at all")
    with pytest.raises(weightd.BadHeaderError, match="model.safetensors"):
        client.open(bad)
    sid = client.load(tiny["a"])
    with client.attach(set_id=sid):
        with pytest.raises(weightd.BusyError):
            client.evict(sid)
    with pytest.raises(weightd.BadRequestError, match="frobnicate"):
        client.request({"op": "frobnicate"})
    assert client.status()["daemon"]["pid"] == daemon.pid  # the handle survived every error


def test_a_wait_past_its_timeout_is_caught_as_the_builtin_timeout_error(gated_daemon, ckpt_small):
    """The gate holds the load: waiting 0.05 s for its first tensor expires, and `except TimeoutError` catches it.

    (A Client's own timeout does not expire on a held load: the daemon's progress events restart it.)
    """
    d, gate = gated_daemon
    with weightd.Client(d.socket) as c:
        s = c.attach(ckpt_small, early=True)
        try:
            assert s.state == "loading"
            first = min(s.infos(), key=lambda i: i.offset)
            caught = None
            try:
                s.wait(first.name, timeout=0.05)
            except builtins.TimeoutError as e:
                caught = e
            assert caught is not None, "the held load's first tensor came"
            assert type(caught) is weightd.TimeoutError and isinstance(caught, weightd.Error)
            assert caught.name == "TIMEOUT" and caught.code == -24 and "0.05" in caught.message, caught.message
            os.close(gate)  # the gate opens: the same load finishes
            s.wait(timeout=60 * SLOW)
            assert s.state == "ready"
        finally:
            s.release()
        assert c.status()["daemon"]["pid"] == d.pid  # the daemon and the handle still serve


NOBODY = 65534


def _attach_as_nobody(sock, set_id):
    """In a forked child running as nobody: attach `set_id`; returns what the child's except clauses saw."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = {}
            try:
                with weightd.Client(sock) as c:
                    c.attach(set_id=set_id).release()
                out["caught"] = "nothing"
            except builtins.PermissionError as e:
                out.update(caught="PermissionError", weightd=isinstance(e, weightd.PermissionError),
                           error=isinstance(e, weightd.Error), name=e.name, message=e.message)
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
                out["caught"] = f"{type(e).__name__}: {e}"
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, data
    return json.loads(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_an_attach_refused_for_permission_is_caught_as_the_builtin_permission_error(start_daemon):
    """nobody attaches the set of a root-only checkpoint: `except PermissionError` catches the daemon's refusal."""
    tree = tempfile.mkdtemp(prefix="wde-")
    try:
        os.chmod(tree, 0o755)
        ck = os.path.join(tree, "private")
        os.makedirs(ck)
        wdclient.write_safetensors(os.path.join(ck, "model.safetensors"), [("w", "F32", [4, 4])], seed=3)
        os.chmod(ck, 0o700)
        d = start_daemon({"allowed_uids": str(NOBODY), "socket_mode": "0666"}, roots=[tree], public=True)
        with weightd.Client(d.socket) as c:
            sid = c.load(ck)
        got = _attach_as_nobody(d.socket, sid)
        assert got.get("caught") == "PermissionError", got
        assert got["weightd"] and got["error"] and got["name"] == "PERMISSION", got
        assert sid in got["message"] and ck in got["message"], got
        wdclient.wait_until(lambda: d.status()["daemon"]["leases"] == 0, timeout=10 * SLOW, what="no leases")
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def _import_in_subprocess(env, code="import weightd"):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                          cwd="/")


def test_library_lookup_reports_every_place_tried(tmp_path):
    pkg = os.path.join(REPO, "client", "python")
    env = dict(os.environ, PYTHONPATH=pkg, WEIGHTD_LIB=str(tmp_path / "missing.so"))
    r = _import_in_subprocess(env)
    assert r.returncode != 0
    assert "LibraryNotFound" in r.stderr and "missing.so ($WEIGHTD_LIB)" in r.stderr
    assert "set WEIGHTD_LIB" in r.stderr
    env.pop("WEIGHTD_LIB")
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    r = _import_in_subprocess(env)
    if r.returncode == 0:
        pytest.skip("a libweightd is installed system-wide: the not-found message cannot be provoked")
    assert "libweightd.so.0 (the system loader)" in r.stderr, r.stderr


def test_library_beside_the_package_is_found(tmp_path):
    import shutil

    src = os.path.join(REPO, "client", "python", "weightd")
    dst = tmp_path / "weightd"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.environ["WEIGHTD_LIB"], dst / "libweightd.so.0")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("WEIGHTD_LIB")
    r = _import_in_subprocess(env, "import weightd; print(weightd.library_path); print(weightd.library_version())")
    assert r.returncode == 0, r.stderr
    path, version = r.stdout.split()
    assert path == str(dst / "libweightd.so.0") and re.fullmatch(r"\d+\.\d+\.\d+", version)
