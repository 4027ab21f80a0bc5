"""Handle kinds: what hello's "handles" list negotiates, on the host backend.

A set's handle kind is fixed when it is allocated (host sets: "fd"); a client
says in hello which kinds it can open, and an attach of a set whose kind it
did not list is UNSUPPORTED, before any lease or descriptor is made. A client
that lists nothing is taken to speak ["fd", "cuda_ipc"] (every client before
the field existed), names this daemon does not know are ignored, and the
field's type is checked strictly. The GPU side (cuda_vmm against cuda_ipc) is
in tests/gpu.
"""
import os
import subprocess

import pytest

from conftest import WEIGHTD
from wdclient import WDError, check_sealed


def attach_reply(c, **fields):
    """attach: (reply, fds) for success and error replies alike."""
    return c.request("attach", **fields)


def test_hello_without_handles_keeps_working_for_host_sets(daemon, tiny):
    with daemon.connect() as c:
        assert c.hello_reply["devices"][0]["handles"] == "fd"
        att, fd = c.attach(path=tiny["a"], device=0)
        try:
            (h,) = att["handles"]
            assert h == {"kind": "fd", "fd_index": 0, "bytes": att["bytes"]}
            check_sealed(fd, att["bytes"])
        finally:
            os.close(fd)
        st = c.status()
        assert st["devices"][0]["handles"] == "fd"
        (s,) = st["sets"]
        assert s["handles"] == "fd" and s["leases"] == 1


@pytest.mark.parametrize("handles", [["cuda_ipc"], ["cuda_vmm", "cuda_ipc"], []])
def test_a_kind_the_client_does_not_accept_is_unsupported(daemon, tiny, handles):
    with daemon.connect(handles=handles) as c, daemon.connect() as watcher:
        set_id = c.call("load", path=tiny["b"], device=0)["set"]  # loading needs no handle
        for how in ({"set": set_id}, {"path": tiny["b"], "device": 0}):
            rep, fds = attach_reply(c, **how)
            assert fds == [], "a refused attach carried a descriptor"
            assert rep["error"]["code"] == "UNSUPPORTED", rep
            msg = rep["error"]["message"]
            assert f"set {set_id} is shared through fd handles" in msg, msg
            accepted = ", ".join(k for k in ("fd", "cuda_ipc", "cuda_vmm") if k in handles) or "none"
            assert f"its hello accepts: {accepted})" in msg, msg
            assert "cuda_handles" not in msg  # no daemon setting changes a host set's kind
        st = watcher.status()
        (s,) = st["sets"]
        assert s["set"] == set_id and s["state"] == "ready" and s["leases"] == 0
        assert st["daemon"]["leases"] == 0
        # The connection stays usable: a refused attach is an ordinary error.
        assert c.status()["daemon"]["pid"] == daemon.pid


def test_names_the_daemon_does_not_know_are_ignored(daemon, tiny):
    with daemon.connect(handles=["cuda_fabric", "fd", "gpu_dmabuf_v2"]) as c:
        att, fd = c.attach(path=tiny["a"], device=0)
        os.close(fd)
        assert att["handles"][0]["kind"] == "fd"
    with daemon.connect(handles=["cuda_fabric"]) as c:
        with pytest.raises(WDError) as e:
            c.attach(path=tiny["a"], device=0)
        assert e.value.code == "UNSUPPORTED" and "its hello accepts: none)" in e.value.message


def test_a_listed_fd_is_accepted_whatever_else_is_listed(daemon, tiny):
    for handles in (["fd"], ["cuda_vmm", "fd"], ["fd", "fd"]):
        with daemon.connect(handles=handles) as c:
            att, fd = c.attach(path=tiny["c"], device=0)
            os.close(fd)
            assert att["handles"][0]["kind"] == "fd"


@pytest.mark.parametrize("bad, field", [("fd", "'handles'"), ({"fd": 1}, "'handles'"), ([1], "'handles[0]'"),
                                        (["fd", None], "'handles[1]'"), (None, "'handles'")])
def test_handles_must_be_a_list_of_strings(daemon, bad, field):
    with daemon.connect(hello=False) as c:
        rep, _ = c.request("hello", protocol=1, handles=bad)
        assert rep["error"]["code"] == "BAD_REQUEST", rep
        assert f"field {field}" in rep["error"]["message"]
        # hello may be sent again, correctly.
        assert c.call("hello", protocol=1, handles=["fd"])["ok"] is True
        assert c.status()["daemon"]["pid"] == daemon.pid


def test_the_cuda_handles_setting(start_daemon, tiny):
    """Enumerated and checked at start; the host backend serves fd handles whatever it says."""
    d = start_daemon(settings={"cuda_handles": "legacy"})
    with d.connect() as c:
        att, fd = c.attach(path=tiny["a"], device=0)
        os.close(fd)
        assert att["handles"][0]["kind"] == "fd"
    r = subprocess.run([WEIGHTD, "--foreground", "--backend", "host", "--set", "cuda_handles=both"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert "config 'cuda_handles': 'both' is not one of vmm, legacy" in r.stderr, r.stderr
    h = subprocess.run([WEIGHTD, "--help"], capture_output=True, text=True, timeout=30).stdout
    (line,) = [ln for ln in h.splitlines() if ln.strip().startswith("cuda_handles")]
    assert "default vmm" in line and "[reloadable]" not in line
