"""prefetch and page-cache residency as status reports it."""
import os
import shutil
import tempfile
import time

import pytest

from conftest import SLOW
from wdclient import write_safetensors

PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def cold_ckpt(model_root):
    """A checkpoint directory with a 48 MiB shard, written, flushed and dropped from the page cache (as far as the kernel lets us)."""
    d = tempfile.mkdtemp(prefix="pf-", dir=model_root)
    p = os.path.join(d, "model.safetensors")
    write_safetensors(p, [("a", "BF16", [4096, 4096]), ("b", "F32", [1024, 4096])], seed=5)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_prefetch_wait_makes_the_file_resident(daemon, cold_ckpt):
    size = os.path.getsize(os.path.join(cold_ckpt, "model.safetensors"))
    full_low = size // PAGE * PAGE
    full_high = (size + PAGE - 1) // PAGE * PAGE
    with daemon.connect() as c:
        before = c.call("open", path=cold_ckpt)["checkpoint"]["resident_bytes"]
        print("resident before prefetch", before, "of", size)
        assert 0 <= before <= full_high
        t0 = time.monotonic()
        ck = c.call("prefetch", path=cold_ckpt, wait=True)["checkpoint"]
        assert time.monotonic() - t0 < 60 * SLOW
        assert full_low <= ck["resident_bytes"] <= full_high, (ck, size, before)
        assert ck["prefetching"] is False and ck["pinned"] is False
        (st,) = c.status()["checkpoints"]
        assert full_low <= st["resident_bytes"] <= full_high, st
        assert st["path"] == os.path.realpath(cold_ckpt) and st["sets"] == 0
        assert "prefetched" in daemon.log_text()


def test_prefetch_without_wait_answers_at_once(daemon, cold_ckpt):
    size = os.path.getsize(os.path.join(cold_ckpt, "model.safetensors"))
    with daemon.connect() as c:
        ck = c.call("prefetch", path=cold_ckpt, pin=True)["checkpoint"]
        assert ck["pinned"] is False  # the host backend has no pinned tier
        # The background read finishes and residency shows it.
        deadline = time.monotonic() + 60 * SLOW
        while True:
            (st,) = c.status()["checkpoints"]
            if not st["prefetching"] and st["resident_bytes"] >= size // PAGE * PAGE:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        # A second prefetch with wait while nothing runs comes back too.
        ck = c.call("prefetch", path=cold_ckpt, wait=True)["checkpoint"]
        assert ck["resident_bytes"] >= size // PAGE * PAGE


def test_concurrent_prefetch_waits_all_answered(daemon, cold_ckpt):
    with daemon.connect() as a, daemon.connect() as b:
        ia = a.start("prefetch", path=cold_ckpt, wait=True)
        ib = b.start("prefetch", path=cold_ckpt, wait=True)
        ic = a.start("prefetch", path=cold_ckpt)
        for conn, rid in ((a, ia), (b, ib), (a, ic)):
            m, _ = conn.wait(rid)
            assert m.get("ok") is True, m
