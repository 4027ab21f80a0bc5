"""Which socket a client reaches, and which daemon it accepts behind it.

A socket named explicitly (--socket, $WEIGHTD_SOCKET, the API's argument) is
the only one tried. Without one, the per-user socket outside
$XDG_RUNTIME_DIR lives in a private directory, /tmp/weightd-$UID/, that the
daemon creates 0700 and that daemon and client both refuse when another user
owns it, its mode is not 0700 or it is a symbolic link. Whatever the path,
the client checks the SO_PEERCRED uid of the process that listens: its own,
root or the service user `weightd`, nothing else (docs/reliability.md, "Who
can reach the socket").

The tests that run daemons and clients under other uids need root; they use
uids with no account (so no one else's files are in the way) and nobody.
"""
import os
import pwd
import random
import shutil
import socket
import stat
import subprocess
import tempfile

import pytest

from cliutil import NOBODY, ctl, json_error, json_out
from conftest import SLOW, WEIGHTD

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run daemons and clients as other uids")

# Neither XDG_RUNTIME_DIR (empty counts as unset) nor WEIGHTD_SOCKET (cliutil removes it): the per-user fallback.
NO_XDG = {"XDG_RUNTIME_DIR": ""}


def service_socket_absent():
    """The search tries the service's socket first: these tests need it absent to reach the fallback."""
    if os.path.exists("/run/weightd/weightd.sock"):
        pytest.skip("/run/weightd/weightd.sock exists on this machine: the search would reach it first")


@pytest.fixture
def lone_uid():
    """A uid with no account and no /tmp/weightd-UID* of its own; those are removed at the end."""
    rng = random.Random()
    for _ in range(1000):
        uid = rng.randrange(200000, 300000)
        try:
            pwd.getpwuid(uid)
            continue
        except KeyError:
            pass
        paths = [f"/tmp/weightd-{uid}", f"/tmp/weightd-{uid}.sock"]
        if not any(os.path.lexists(p) for p in paths):
            break
    else:
        pytest.fail("no free uid found")
    yield uid
    for p in paths:
        if os.path.islink(p) or (os.path.lexists(p) and not os.path.isdir(p)):
            os.unlink(p)
        elif os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)


def weightd_as(uid, timeout=20):
    """Runs weightd as uid with its default socket (no --socket, no XDG_RUNTIME_DIR); returns the process.

    A refused start ends at once; one that wrongly starts is stopped and fails the caller's assertions.
    """
    env = dict(os.environ, **NO_XDG)
    env.pop("WEIGHTD_SOCKET", None)
    argv = [WEIGHTD, "--foreground", "--backend", "host", "--set", "metrics_address="]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout * SLOW, env=env,
                              stdin=subprocess.DEVNULL, user=uid, group=uid, extra_groups=[])
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"weightd as uid {uid} started although it should have refused:\n{e.stderr}")


# ---- a socket named explicitly is the only one tried ------------------------------------------------


def test_named_socket_is_the_only_one_tried(daemon, workdir):
    """Before: a dead $WEIGHTD_SOCKET fell through to the next sockets of the search, so weightctl reached
    the daemon on the per-user socket (here $XDG_RUNTIME_DIR/weightd.sock) and exited 0."""
    service_socket_absent()
    fallback = {"XDG_RUNTIME_DIR": daemon.dir}  # the daemon's socket is DIR/weightd.sock: the per-user socket
    # The fallback does answer when nothing is named.
    st = json_out(ctl("--json", "status", env=fallback))
    assert st["daemon"]["pid"] == daemon.pid
    dead = os.path.join(workdir, "no-daemon-here.sock")
    for how in ({"WEIGHTD_SOCKET": dead}, {"--socket": dead}):
        args = ["--socket", dead] if "--socket" in how else []
        env = dict(fallback, **{k: v for k, v in how.items() if k == "WEIGHTD_SOCKET"})
        msg = json_error(ctl("--json", *args, "status", env=env), "CONNECT", 3)
        assert dead in msg, (how, msg)
        assert daemon.socket not in msg and "/run/weightd" not in msg, (how, msg)
    # A stale socket file there (a daemon that died) is no reason to look elsewhere either.
    stale = os.path.join(workdir, "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    try:
        msg = json_error(ctl("--json", "status", env=dict(fallback, WEIGHTD_SOCKET=stale)), "CONNECT", 3)
        assert f"no daemon is listening at $WEIGHTD_SOCKET={stale}" in msg, msg
        assert daemon.socket not in msg, msg
    finally:
        os.unlink(stale)


# ---- the per-user directory ------------------------------------------------------------------------


@needs_root
def test_fallback_directory_is_private(lone_uid, start_daemon):
    """Before: the daemon listened on /tmp/weightd-UID.sock, a name in world-writable /tmp, and never
    said /tmp/weightd-UID/weightd.sock."""
    service_socket_absent()
    uid = lone_uid
    d = start_daemon(user=uid, socket=f"/tmp/weightd-{uid}/weightd.sock", socket_flag=False, env=NO_XDG)
    st = os.lstat(f"/tmp/weightd-{uid}")
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700, st
    assert not os.path.lexists(f"/tmp/weightd-{uid}.sock")
    got = json_out(ctl("--json", "status", user=uid, env=NO_XDG))
    assert got["daemon"]["pid"] == d.pid and got["daemon"]["socket"] == d.socket, got


def squat(kind, uid):
    """Prepares /tmp/weightd-UID as a squatter would, or as a mistake leaves it; returns what the refusal names."""
    path = f"/tmp/weightd-{uid}"
    if kind == "another owner":
        os.mkdir(path, 0o700)
        os.chown(path, NOBODY, NOBODY)
        return [path, f"owned by uid {NOBODY} (nobody)", f"not by uid {uid}"]
    if kind == "mode":
        os.mkdir(path)
        os.chmod(path, 0o755)
        os.chown(path, uid, uid)
        return [path, "mode 0755", "0700"]
    if kind == "symlink":
        target = tempfile.mkdtemp(prefix="wd-squat-")
        os.chown(target, uid, uid)
        os.symlink(target, path)
        return [path, "symbolic link"]
    assert kind == "file"
    with open(path, "w"):
        pass
    os.chown(path, NOBODY, NOBODY)
    return [path, "not a directory"]


@needs_root
@pytest.mark.parametrize("kind", ["another owner", "mode", "symlink", "file"])
def test_squatted_fallback_directory_is_refused(lone_uid, kind):
    """Before: neither the daemon nor the client looked at /tmp/weightd-UID/ (the daemon started, on
    /tmp/weightd-UID.sock), so a directory another user made there would have been used."""
    service_socket_absent()
    uid = lone_uid
    needles = squat(kind, uid)
    target = os.path.realpath(f"/tmp/weightd-{uid}") if kind == "symlink" else None
    try:
        res = weightd_as(uid)
        assert res.returncode == 1, res.stderr
        for n in needles:
            assert n in res.stderr, (n, res.stderr)
        msg = json_error(ctl("--json", "status", user=uid, env=NO_XDG), "CONNECT", 3)
        for n in needles:
            assert n in msg, (n, msg)
        if target is not None:
            assert os.listdir(target) == [], "something was created through the symbolic link"
    finally:
        if target is not None:
            shutil.rmtree(target, ignore_errors=True)


# ---- the daemon behind the socket ---------------------------------------------------------------


@needs_root
def test_squatter_on_the_old_name_gets_nothing(lone_uid, start_daemon):
    """Another user's daemon listening on /tmp/weightd-UID.sock, the old per-user name.

    Before: the victim's daemon refused to start (another weightd is listening on /tmp/weightd-UID.sock)
    and the victim's weightctl attached to the squatter's daemon.
    """
    service_socket_absent()
    uid = lone_uid
    squatter = start_daemon({"socket_mode": "0666"}, user=NOBODY, socket=f"/tmp/weightd-{uid}.sock")
    mine = start_daemon(user=uid, socket=f"/tmp/weightd-{uid}/weightd.sock", socket_flag=False, env=NO_XDG)
    got = json_out(ctl("--json", "status", user=uid, env=NO_XDG))
    assert got["daemon"]["pid"] == mine.pid, (got["daemon"], squatter.pid)


@needs_root
def test_daemon_of_another_user_is_refused(lone_uid, start_daemon):
    """A daemon whose SO_PEERCRED uid is neither the client's, root nor the service user's is refused.

    Before: every client attached to it (exit 0) and would have mapped the memory it served.
    """
    uid = lone_uid
    other = start_daemon({"socket_mode": "0666"}, user=NOBODY, public=True)
    for who in (uid, 0):
        for how in ("--socket", "WEIGHTD_SOCKET"):
            args = ["--socket", other.socket] if how == "--socket" else []
            env = {"WEIGHTD_SOCKET": other.socket} if how == "WEIGHTD_SOCKET" else None
            msg = json_error(ctl("--json", *args, "status", user=who, env=env), "CONNECT", 3)
            for n in (other.socket, f"uid {NOBODY} (nobody)", f"pid {other.pid}", "service user weightd"):
                assert n in msg, (who, how, n, msg)
    # The same daemon serves its own uid.
    assert json_out(ctl("--json", "--socket", other.socket, "status", user=NOBODY))["daemon"]["pid"] == other.pid
