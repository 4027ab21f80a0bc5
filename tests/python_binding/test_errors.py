"""Errors as exceptions: one class per C code (checked against the header), the daemon's codes and messages."""
import os
import pickle
import re
import subprocess
import sys

import pytest

import weightd
from conftest import REPO

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
