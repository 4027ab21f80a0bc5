"""Client.load_group (weightd_load_group through ctypes) against a daemon presenting several host devices:
every rank's set with its bytes, devices as arguments, per-rank failures on the raised error, progress."""
import pytest

import weightd
from conftest import file_bytes
from wdclient import Checkpoint


@pytest.fixture
def two(start_daemon):
    d = start_daemon(settings={"host_devices": 2, "metrics_address": ""})
    c = weightd.Client(d.socket)
    yield d, c
    c.close()


def test_load_group_ranks(two, dense_ckpt):
    d, c = two
    uuids = [x["uuid"] for x in d.status()["devices"]]
    seen = []
    ranks = c.load_group(dense_ckpt, tp_size=2, progress=lambda done, total: seen.append((done, total)))
    assert [(r["rank"], r["tp_rank"], r["ep_rank"], r["device"]) for r in ranks] == [(0, 0, 0, uuids[0]),
                                                                                   (1, 1, 0, uuids[1])]
    assert all(r["error"] is None and r["source"] == "host" and r["method"] == "memcpy" and r["bytes"] > 0
               for r in ranks)
    assert seen and all(done <= total for done, total in seen)
    # Each rank holds its half of the column-parallel q_proj (16 heads of 16, 8 each), bytes from the file.
    name = "model.layers.0.self_attn.q_proj.weight"
    ckpt = Checkpoint(dense_ckpt)
    whole = file_bytes(ckpt, name)
    for r in ranks:
        with c.attach(set_id=r["set"]) as s:
            assert s[name].shape == (128, 256)
            half = len(whole) // 2
            assert s[name].tobytes() == whole[r["tp_rank"] * half:(r["tp_rank"] + 1) * half]
    ckpt.close()
    # Devices as arguments: both ranks onto device 1, fused.
    ranks = c.load_group(dense_ckpt, tp_size=2, devices=[1, "1"], fuse=True)
    assert [r["device"] for r in ranks] == [uuids[1]] * 2
    with c.attach(set_id=ranks[0]["set"]) as s:
        assert "model.layers.0.self_attn.qkv_proj.weight" in s


def test_load_group_errors(two, dense_ckpt):
    d, c = two
    with pytest.raises(weightd.BadRequestError, match="lists 1 device"):
        c.load_group(dense_ckpt, tp_size=2, devices=[0])
    with pytest.raises(weightd.BadPlanError, match="tp_size 3") as e:
        c.load_group(dense_ckpt, tp_size=3)
    assert e.value.ranks == []  # nothing was planned, nothing loaded
    with pytest.raises(TypeError):
        c.load_group(dense_ckpt, plan={"preset": "dense"}, preset="dense")
    with pytest.raises(ValueError):
        c.load_group(dense_ckpt, tp_size=2, devices=[0, None])
    assert d.status()["sets"] == []
