"""Invalid checkpoints are refused with the right code; the daemon serves on and
does not remember a failure once the files are fixed."""
import json
import os
import shutil
import struct

import pytest

from wdclient import Checkpoint, verify_attached, write_safetensors

T = [("w", "F32", [16, 16]), ("b", "U8", [10])]


def header(h, payload=b""):
    t = json.dumps(h).encode()
    return struct.pack("<Q", len(t)) + t + payload


def single(d, data):
    os.makedirs(d)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(data)


def index(d, weight_map, shards=(), raw=None):
    os.makedirs(d)
    for s in shards:
        write_safetensors(os.path.join(d, s), T, seed=1)
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write(raw if raw is not None else json.dumps({"metadata": {}, "weight_map": weight_map}))


def build_cases(root, outside_file):
    """{name: (path, expected code)}."""
    c = {}

    def add(name, code, make, *args):
        d = os.path.join(root, name)
        make(d, *args)
        c[name] = (d, code)

    add("empty", "BAD_HEADER", single, b"")
    add("short", "BAD_HEADER", single, b"\x05\x00\x00")
    add("huge_header_length", "BAD_HEADER", single, struct.pack("<Q", 2 ** 63) + b"{}")
    add("header_past_end", "BAD_HEADER", single, struct.pack("<Q", 1000) + b"{}")
    add("header_not_json", "BAD_HEADER", single, struct.pack("<Q", 8) + b'{"a":   ')
    add("header_array", "BAD_HEADER", single, header([1, 2]))
    add("data_past_end", "BAD_SIZE", single,
        header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8))
    add("overlap", "BAD_TENSOR", single,
        header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "v": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, b"\0" * 24))
    add("unknown_dtype", "BAD_TENSOR", single,
        header({"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16))
    add("shape_mismatch", "BAD_TENSOR", single,
        header({"w": {"dtype": "F32", "shape": [5], "data_offsets": [0, 16]}}, b"\0" * 16))
    add("index_missing_shard", "NOT_FOUND", index, {"w": "a.safetensors", "b": "nope.safetensors"},
        ["a.safetensors"])
    add("index_not_json", "BAD_INDEX", index, None, ["a.safetensors"], '{"weight_map": ')
    add("index_incomplete", "BAD_INDEX", index, {"w": "a.safetensors"}, ["a.safetensors"])
    rel = os.path.relpath(outside_file, os.path.join(root, "index_traversal"))
    add("index_traversal", "PATH_DENIED", index, {"z": rel})
    add("index_absolute", "PATH_DENIED", index, {"z": outside_file})

    def index_link(d):
        index(d, {"z": "s.safetensors"})
        os.symlink(outside_file, os.path.join(d, "s.safetensors"))

    add("index_shard_symlink_out", "PATH_DENIED", index_link)

    def single_link(d):
        os.makedirs(d)
        os.symlink(outside_file, os.path.join(d, "model.safetensors"))

    add("single_symlink_out", "PATH_DENIED", single_link)

    def bad_config(d):
        os.makedirs(d)
        write_safetensors(os.path.join(d, "model.safetensors"), T, seed=1)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"a":')

    add("bad_config", "BAD_CONFIG", bad_config)
    add("no_model_files", "NOT_FOUND", os.makedirs)
    return c


@pytest.fixture(scope="module")
def bad_cases(model_root, outside_dir):
    root = os.path.join(model_root, "bad")
    os.makedirs(root)
    yield build_cases(root, os.path.join(outside_dir, "secret.safetensors"))
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("op", ["open", "load", "attach", "prefetch"])
def test_invalid_checkpoints_refused(daemon, bad_cases, op):
    failures = []
    with daemon.connect() as c:
        for name, (path, code) in sorted(bad_cases.items()):
            got = c.error(op, path=path)
            if got != code:
                failures.append(f"{op} {name}: {got}, want {code}")
        st = c.status()
        assert st["checkpoints"] == [] and st["sets"] == [], st
    daemon.check_serving()
    assert not failures, "\n".join(failures)


def error_message(c, op, **fields):
    m, fds = c.request(op, **fields)
    for fd in fds:
        os.close(fd)
    assert "error" in m, m
    return m["error"]["code"], m["error"]["message"]


def test_messages_name_the_checkpoint_and_say_what_is_wrong(daemon, bad_cases, model_root):
    """What a user reads: a file of another kind is "not a safetensors file" (never the number its first
    8 bytes make, nor its bytes); a truncated index says where; each names the checkpoint's directory
    and the member at fault; outside the roots nothing is said about the file."""
    d = os.path.join(model_root, "bad", "pytorch_zip")
    single(d, b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + b"\0" * 64)  # what a torch.save .bin starts with
    cut = os.path.join(model_root, "bad", "index_cut")
    index(cut, None, ["a.safetensors"], '{"metadata": {}, "weight_map": {"w": "a.safetensors", "b": "a.safet')
    try:
        with daemon.connect() as c:
            for op in ("load", "open"):
                code, msg = error_message(c, op, path=d)
                real = os.path.realpath(d)
                assert code == "BAD_HEADER" and msg.startswith(f"{real}: model.safetensors: not a safetensors file"), msg
                assert str(struct.unpack("<Q", b"PK\x03\x04\x14\x00\x00\x00")[0]) not in msg and "PK" not in msg, msg
                code, msg = error_message(c, op, path=cut)
                assert code == "BAD_INDEX" and msg == (
                    f"{os.path.realpath(cut)}: model.safetensors.index.json: not valid JSON: at byte 59: "
                    "unterminated string: the input ends at byte 67"), msg
            code, msg = error_message(c, "load", path=bad_cases["huge_header_length"][0])
            assert "not a safetensors file" in msg and str(2 ** 63) not in msg, msg
            code, msg = error_message(c, "load", path=bad_cases["index_shard_symlink_out"][0])
            assert code == "PATH_DENIED" and "secret" not in msg, msg
    finally:
        shutil.rmtree(d)
        shutil.rmtree(cut)
    daemon.check_serving()


def test_fixed_checkpoint_opens_after_failure(daemon, model_root):
    d = os.path.join(model_root, "fixme")
    single(d, header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8))
    with daemon.connect() as c:
        assert c.error("load", path=d) == "BAD_SIZE"
        write_safetensors(os.path.join(d, "model.safetensors"), T, seed=9)
        ckpt = Checkpoint(d)
        att, fd = c.attach(path=d, device=0)
        try:
            verify_attached(att, fd, ckpt)
        finally:
            os.close(fd)
        ckpt.close()
    shutil.rmtree(d)
