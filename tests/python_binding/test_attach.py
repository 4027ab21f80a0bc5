"""Attached host sets through the binding: every tensor's bytes, dtype and shape against the files."""
import numpy as np
import pytest

import weightd
from conftest import ALL_DTYPES, file_bytes
from weightd import _wrap
from wdclient import Checkpoint

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

# What numpy type each dtype must come as, with and without ml_dtypes (docs/python.md).
RAW = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "U16": np.uint16, "I32": np.int32,
       "U32": np.uint32, "I64": np.int64, "U64": np.uint64, "F16": np.float16, "F32": np.float32,
       "F64": np.float64, "C64": np.complex64, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8}
ML = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def expected_numpy_dtype(dtype):
    if ml_dtypes is not None and dtype in ML:
        return np.dtype(getattr(ml_dtypes, ML[dtype]))
    return np.dtype(RAW[dtype])


def check_every_tensor(s, ckpt):
    """Each array: the file's bytes, the header's shape, the documented dtype, read-only, inside the slab."""
    assert len(s) == len(ckpt.where) and set(s) == set(ckpt.where)
    for name in ckpt.where:
        h = ckpt.header(name)
        a = s[name]
        assert isinstance(a, np.ndarray)
        assert a.dtype == expected_numpy_dtype(h["dtype"]), (name, a.dtype)
        assert list(a.shape) == h["shape"], name
        assert a.tobytes() == file_bytes(ckpt, name), f"{name}: bytes differ from the file"
        assert not a.flags.writeable
        info = s.info(name)
        assert info.dtype == h["dtype"] and list(info.shape) == h["shape"]
        assert info.data_ptr == s.base + info.offset
        if a.size:
            assert a.__array_interface__["data"][0] == info.data_ptr  # a view, not a copy


def test_every_dtype_every_byte(client, dtypes_ckpt):
    ckpt = Checkpoint(dtypes_ckpt)
    with client.attach(dtypes_ckpt) as s:
        assert s.memory == "host" and s.tensor_type == "numpy"
        assert s.handle == "fd" and s.read_only is True
        assert s.device.startswith("host-")
        check_every_tensor(s, ckpt)
        assert s["t.scalar"].shape == () and s["t.empty"].shape == (0, 4)
        assert s["t.bool"].dtype == np.bool_
    ckpt.close()


def test_raw_width_without_ml_dtypes(client, dtypes_ckpt, monkeypatch):
    """BF16 and FP8 come as uint16 / uint8 of the same bytes when ml_dtypes is not installed."""
    monkeypatch.setattr(_wrap, "_optional", lambda name: None)
    ckpt = Checkpoint(dtypes_ckpt)
    with client.attach(dtypes_ckpt) as s:
        for name, dtype, shape in ALL_DTYPES:
            a = s[name]
            assert a.dtype == np.dtype(RAW[dtype]), (name, a.dtype)
            assert a.tobytes() == file_bytes(ckpt, name)
    ckpt.close()


def test_sharded_checkpoint_every_byte(client, sharded_ckpt):
    ckpt = Checkpoint(sharded_ckpt)
    assert len(ckpt.shards) == 3
    with client.attach(sharded_ckpt, progress=None) as s:
        check_every_tensor(s, ckpt)
        # slab order is the daemon's table order; the mapping's order is the same.
        assert list(s) == [i.name for i in s.infos()]
        assert sorted(i.offset for i in s.infos()) == [i.offset for i in s.infos()]
    ckpt.close()


def test_mapping_behaviour(client, tiny):
    with client.attach(tiny["a"]) as s:
        assert "embed.weight" in s and "nope" not in s and 3 not in s
        with pytest.raises(KeyError):
            s["nope"]
        with pytest.raises(KeyError):
            s.info("nope")
        a = s["embed.weight"]
        assert s["embed.weight"] is a  # made once, then cached
        assert s.get("nope") is None
        assert dict(s.items()).keys() == set(s.names())
        with pytest.raises(ValueError):
            a[0, 0] = 1  # read-only
        assert s != {} and s == s
        assert "attached" in repr(s)
    assert "released" in repr(s)


def test_attach_by_set_id_shares_one_mapping(client, daemon, tiny):
    sid = client.load(tiny["b"])
    with client.attach(set_id=sid) as s1, client.attach(set_id=sid) as s2:
        assert s1.id == s2.id == sid and s1.lease != s2.lease
        assert s1.base == s2.base  # libweightd maps a set once per process
        assert s1["head.weight"].tobytes() == s2["head.weight"].tobytes()
        assert daemon.status()["sets"][0]["leases"] == 2
    with pytest.raises(TypeError):
        client.attach(tiny["b"], set_id=sid)
    with pytest.raises(TypeError):
        client.attach(set_id=sid, tp_size=2)
    with pytest.raises(ValueError):
        client.attach(set_id=sid, tensor_type="jax")


def test_host_set_as_torch_cpu_tensors(client, dtypes_ckpt):
    torch = pytest.importorskip("torch")
    ckpt = Checkpoint(dtypes_ckpt)
    with client.attach(dtypes_ckpt, tensor_type="torch") as s:
        assert s.torch_device == torch.device("cpu")
        for name, dtype, shape in ALL_DTYPES:
            want = _wrap.torch_dtype(dtype)
            if want is None:  # this torch has no such type: a clear error
                with pytest.raises(weightd.UnsupportedError, match=dtype):
                    s[name]
                continue
            t = s[name]
            assert t.dtype == want and list(t.shape) == shape, name
            raw = t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).view(torch.uint8)
            assert raw.numpy().tobytes() == file_bytes(ckpt, name), name
            if t.numel():
                assert t.data_ptr() == s.info(name).data_ptr
    ckpt.close()


def test_attach_many_tensors_is_lazy(client, model_root):
    """9,435 tensors (the Qwen3-30B-A3B cut's count): attach makes no arrays; names and finds are fast."""
    import os
    import time

    import wdclient

    d = os.path.join(model_root, "py-many")
    os.makedirs(d)
    n = 9435
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"),
                               [(f"model.layers.{i // 100}.t{i}.weight", "F16", [2, 4]) for i in range(n)], seed=3)
    sid = client.load(d)
    t0 = time.perf_counter()
    s = client.attach(set_id=sid)
    attach_s = time.perf_counter() - t0
    with s:
        assert len(s) == n and s._cache == {}
        t0 = time.perf_counter()
        names = s.names()
        names_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name in names:
            assert name in s
        find_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        arrays = [s[name] for name in names]
        wrap_s = time.perf_counter() - t0
        assert len(arrays) == n and arrays[-1].shape == (2, 4)
    print(f"\n{n} tensors: attach {attach_s * 1e3:.1f} ms, names() {names_s * 1e3:.1f} ms, "
          f"{n} finds {find_s * 1e3:.1f} ms, {n} arrays {wrap_s * 1e3:.1f} ms")
    # The figures are printed, not asserted (timing thresholds flake on shared machines); docs/python.md has them.
