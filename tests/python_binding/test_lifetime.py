"""The release rule: an array keeps its set's mapping and lease alive; release is deferred until none is left."""
import gc
import threading
import weakref

import pytest

import weightd
from conftest import file_bytes, leases, wait_leases
from wdclient import Checkpoint


def test_release_without_arrays_ends_the_lease_at_once(client, daemon, tiny):
    s = client.attach(tiny["a"])
    assert leases(daemon) == 1 and s.lease_held
    assert s.release() is True
    assert leases(daemon) == 0 and s.released and not s.lease_held
    assert s.release() is True  # again: only reports
    with pytest.raises(weightd.InvalidError, match="released"):
        s["embed.weight"]


def test_release_while_referenced_is_deferred_until_the_last_array_dies(client, daemon, tiny):
    ckpt = Checkpoint(tiny["a"])
    s = client.attach(tiny["a"])
    a = s["embed.weight"]
    view = a[3:7, ::2]  # a view of a view keeps it too
    ref_a = weakref.ref(a)
    assert s.release() is False
    assert s.released and s.lease_held
    assert leases(daemon) == 1
    assert a.tobytes() == file_bytes(ckpt, "embed.weight")  # still mapped, still right
    del a
    gc.collect()
    assert ref_a() is None
    assert leases(daemon) == 1 and s.lease_held  # the view still holds it
    expect = view.tobytes()
    del view
    gc.collect()
    assert leases(daemon) == 0 and not s.lease_held
    assert s.release() is True
    assert expect  # the view was readable until the end
    ckpt.close()


def test_dropping_the_set_object_keeps_arrays_valid(client, daemon, tiny):
    ckpt = Checkpoint(tiny["c"])
    s = client.attach(tiny["c"])
    arrays = [s[n] for n in ("embed.weight", "layers.0.bias")]
    ref_s = weakref.ref(s)
    del s
    gc.collect()
    assert ref_s() is None and leases(daemon) == 1
    assert arrays[1].tobytes() == file_bytes(ckpt, "layers.0.bias")
    arrays.pop()
    gc.collect()
    assert leases(daemon) == 1
    arrays.clear()
    gc.collect()
    assert leases(daemon) == 0
    ckpt.close()


def test_with_block_releases(client, daemon, tiny):
    with client.attach(tiny["a"]) as s:
        s["head.weight"]
        assert leases(daemon) == 1
    assert leases(daemon) == 0 and s.released


def test_close_with_live_arrays_keeps_the_connection_until_they_die(daemon, tiny):
    c = weightd.Client(daemon.socket)
    s = c.attach(tiny["b"])
    a = s["embed.weight"]
    del s
    c.close()
    with pytest.raises(weightd.ClosedError):
        c.status()
    st = daemon.status()
    assert st["daemon"]["leases"] == 1 and st["daemon"]["connections"] == 2
    assert a.shape == (1000, 256)
    del a
    gc.collect()
    wait_leases(daemon, 0)
    with daemon.connect() as raw:
        import wdclient

        wdclient.wait_until(lambda: raw.status()["daemon"]["connections"] == 1, what="the closed client's socket")


def test_release_from_a_finalizer_while_another_thread_calls(start_daemon, tiny, ckpt_for_slow_load):
    """The last array dies while the handle is busy in another thread: the release waits for that call."""
    d = start_daemon({"fill_threads": 1})
    c = weightd.Client(d.socket)
    s = c.attach(tiny["a"])
    a = s["embed.weight"]
    s.release()
    events = []
    dropped = threading.Event()

    def on_progress(done, total):
        events.append(done)
        if len(events) == 1:
            t = threading.Thread(target=drop)
            t.start()
            t.join()

    def drop():
        nonlocal a
        del a
        gc.collect()
        dropped.set()  # the finalizer ran here and queued the release; it must not block

    c.load(ckpt_for_slow_load, progress=on_progress)
    assert dropped.is_set() and events
    wait_leases(d, 0)  # drained when the load's call ended
    assert c.status()["daemon"]["leases"] == 0
    c.close()


def test_release_from_inside_a_progress_callback(client, daemon, tiny, ckpt_for_slow_load):
    s = client.attach(tiny["a"])
    holder = [s["embed.weight"]]
    s.release()

    def on_progress(done, total):
        holder.clear()
        gc.collect()

    client.load(ckpt_for_slow_load, progress=on_progress)
    assert leases(daemon) == 0


def test_calling_the_client_from_its_progress_callback_is_refused(client, ckpt_for_slow_load):
    seen = []

    def on_progress(done, total):
        with pytest.raises(weightd.InvalidError, match="progress callback"):
            client.status()
        seen.append(done)

    client.load(ckpt_for_slow_load, progress=on_progress)
    assert seen
    assert client.status()["sets"]
