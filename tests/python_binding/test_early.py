"""Early attach and the binary tensor table through the binding (and so through libweightd).

Timing decides only how far a load has come when the attach returns, never
what is checked: each tensor's bytes are compared with the file as soon as
the binding reports it ready, and the daemon's test gate holds a load midway
where a test needs one stopped there.
"""
import os
import signal
import threading

import pytest

import weightd
from conftest import SLOW, file_bytes, wait_leases
from wdclient import Checkpoint, Conn, wait_until


def test_binary_table_gives_the_json_tables_tensors(client, daemon, ckpt_small, sharded_ckpt):
    """libweightd reads the binary table; a raw client without the feature gets JSON: the same entries."""
    for path in (ckpt_small, sharded_ckpt):
        with client.attach(path) as s, Conn(daemon.socket) as raw:
            m, fd = raw.attach(set=s.id)
            os.close(fd)
            assert [(i.name, i.dtype, list(i.shape), i.offset, i.nbytes) for i in s.infos()] == [
                (t["name"], t["dtype"], t["shape"], t["offset"], t["nbytes"]) for t in m["tensors"]]
            for t in m["tensors"]:
                assert s.info(t["name"]).offset == t["offset"]
            assert "no.such.tensor" not in s
            raw.call("release", lease=m["lease"])


def test_ready_tensors_match_the_files_as_they_come(client, ckpt_small):
    ckpt = Checkpoint(ckpt_small)
    evicted = client.evict(device=0)  # a fresh load, whatever ran before
    assert isinstance(evicted, list)
    with client.attach(ckpt_small, early=True) as s:
        assert s.state in ("loading", "ready")
        seen = []
        for name, a in s.ready_tensors(timeout=60 * SLOW):
            info = s.info(name)
            assert s.ready_bytes >= info.offset + info.nbytes
            assert a.tobytes() == file_bytes(ckpt, name), f"{name} differs from the file when reported ready"
            seen.append(name)
        assert seen == [i.name for i in sorted(s.infos(), key=lambda i: i.offset)]
        s.wait(timeout=60 * SLOW)
        assert s.state == "ready" and s.ready_bytes == s.nbytes and s.load_error == ""
        with pytest.raises(KeyError):
            s.wait("no.such.tensor")
    ckpt.close()


def test_early_attach_of_a_resident_set_is_ready(client, sharded_ckpt):
    sid = client.load(sharded_ckpt)
    with client.attach(set_id=sid, early=True) as s:
        assert s.state == "ready" and s.ready_bytes == s.nbytes
        s.wait("model.norm.weight", timeout=0)
        s.wait(timeout=0)


def test_another_clients_cancel_leaves_the_early_set_loading(gated_daemon, ckpt_small):
    """The early lease keeps the load going when the other request for the same set is canceled."""
    d, gate = gated_daemon
    with weightd.Client(d.socket) as c, Conn(d.socket) as raw:
        raw.start("load", id="L", path=ckpt_small, device=0)
        s = c.attach(ckpt_small, early=True)
        try:
            assert s.state == "loading"
            first = min(s.infos(), key=lambda i: i.offset)
            with pytest.raises(weightd.TimeoutError):
                s.wait(first.name, timeout=0.05)  # the gate holds the first window
            assert raw.call("cancel", target="L")["canceled"] is True
            os.close(gate)  # opens the gate
            s.wait(timeout=60 * SLOW)
            assert s.state == "ready"
        finally:
            s.release()
        wait_leases(d, 0)
        assert [x["state"] for x in d.status()["sets"]] == ["ready"]


def test_a_wait_ends_when_the_daemon_dies_mid_load(gated_daemon, ckpt_small):
    d, gate = gated_daemon
    with weightd.Client(d.socket) as c:
        s = c.attach(ckpt_small, early=True)
        try:
            assert s.state == "loading"
            outcome = []

            def waiter():
                try:
                    s.wait()
                    outcome.append("returned")
                except weightd.Error as e:
                    outcome.append(e)

            t = threading.Thread(target=waiter, daemon=True)
            t.start()
            d.expect_exit = -signal.SIGKILL
            d.proc.send_signal(signal.SIGKILL)  # the gate holds the first window: the page says "loading" for good
            t.join(timeout=60 * SLOW)  # a bound against hanging, not a measure of speed
            assert not t.is_alive(), "the wait did not notice that the daemon died"
            assert len(outcome) == 1 and isinstance(outcome[0], weightd.ClosedError), outcome
            assert "exited" in str(outcome[0])
            assert s.state == "failed" and "exited" in s.load_error
            with pytest.raises(weightd.ClosedError):
                s.wait(min(s.infos(), key=lambda i: i.offset).name, timeout=60 * SLOW)
        finally:
            s.release()
