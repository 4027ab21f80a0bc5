"""Fixtures for the Python binding's tests: the integration suite's daemons, and the package.

The daemon fixtures (a real weightd with the host backend on a private
socket, stopped and checked after each test) are those of
tests/integration/wdfixtures.py, imported here. The
package comes from client/python; libweightd from $WEIGHTD_LIB (ctest sets
it to the build's), else build/libweightd.so.
"""
import json
import os
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
sys.path.insert(0, HERE)
os.environ.setdefault("WEIGHTD_LIB", os.path.join(REPO, "build", "libweightd.so"))

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
pytest.register_assert_rewrite("wdfixtures", "wdclient")  # its asserts say what they compared
from wdfixtures import *  # noqa: E402,F401,F403  the integration suite's daemon fixtures and hook

import weightd  # noqa: E402
import wdclient  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_for_slow_load(ckpt_small):
    """A checkpoint whose load (650 MB) sends several progress events and takes about a second."""
    return ckpt_small


@pytest.fixture
def gated_daemon(start_daemon, workdir):
    """A daemon whose loads wait at every window for a byte on a FIFO: (daemon, the FIFO's fd).

    Writing a byte lets one window through; closing the fd opens the gate for good.
    """
    path = os.path.join(tempfile.mkdtemp(prefix="gate-", dir=workdir), "gate")
    os.mkfifo(path)
    fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
    d = start_daemon({"test_load_gate": path})
    yield d, fd
    try:
        os.close(fd)
    except OSError:
        pass


@pytest.fixture
def client(daemon):
    """A weightd.Client connected to the test's daemon."""
    c = weightd.Client(daemon.socket)
    yield c
    c.close()


def leases(daemon):
    """The daemon's lease count, asked on a connection of its own (the raw protocol client)."""
    return daemon.status()["daemon"]["leases"]


def wait_leases(daemon, n, what="the lease count"):
    return wdclient.wait_until(lambda: leases(daemon) == n, timeout=10 * SLOW, what=f"{what} to be {n}")


# Every dtype the daemon serves whole, with a shape each; sub-byte ones come as bytes.
ALL_DTYPES = [
    ("t.bool", "BOOL", [3, 5]), ("t.u8", "U8", [7]), ("t.i8", "I8", [2, 3]), ("t.i16", "I16", [4, 4]),
    ("t.u16", "U16", [9]), ("t.i32", "I32", [2, 2, 2]), ("t.u32", "U32", [5]), ("t.i64", "I64", [3, 5]),
    ("t.u64", "U64", [2]), ("t.f16", "F16", [16, 3]), ("t.bf16", "BF16", [33, 8]), ("t.f32", "F32", [10, 10]),
    ("t.f64", "F64", [4]), ("t.f8e4m3", "F8_E4M3", [128, 2]),
    ("t.f8e5m2", "F8_E5M2", [64]), ("t.scalar", "F32", []), ("t.empty", "BF16", [0, 4]),
]


@pytest.fixture(scope="session")
def dtypes_ckpt(model_root):
    """A single-file checkpoint with one tensor of every dtype, a scalar and an empty tensor."""
    d = os.path.join(model_root, "py-dtypes")
    os.makedirs(d)
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), ALL_DTYPES, seed=11)
    return d


def write_sharded(d, tensors, shards, seed):
    """A checkpoint of `shards` files and an index; returns the directory."""
    os.makedirs(d)
    weight_map = {}
    per = -(-len(tensors) // shards)
    for k in range(shards):
        part = tensors[k * per:(k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        wdclient.write_safetensors(os.path.join(d, fname), part, seed=seed)
        weight_map.update({name: fname for name, _, _ in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d


@pytest.fixture(scope="session")
def sharded_ckpt(model_root):
    """Three shards and an index, BF16/F32 tensors with a model's names."""
    tensors = [("model.embed_tokens.weight", "BF16", [500, 64])]
    for i in range(4):
        p = f"model.layers.{i}."
        tensors += [(p + "self_attn.q_proj.weight", "BF16", [64, 64]), (p + "mlp.down_proj.weight", "BF16", [64, 96]),
                    (p + "input_layernorm.weight", "F32", [64])]
    tensors += [("model.norm.weight", "F32", [64]), ("lm_head.weight", "BF16", [500, 64])]
    return write_sharded(os.path.join(model_root, "py-sharded"), tensors, 3, seed=12)


def dense_config(hidden=256, heads=16, kv_heads=8, head_dim=16, inter=512, vocab=1000, layers=1):
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "intermediate_size": inter, "vocab_size": vocab, "num_hidden_layers": layers,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.fixture(scope="session")
def dense_ckpt(model_root):
    """A one-layer Qwen3-shaped checkpoint with config.json, small enough to plan in milliseconds."""
    cfg = dense_config()
    h, hd, q, kv, i, v = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]
    p = "model.layers.0."
    tensors = [("model.embed_tokens.weight", "BF16", [v, h]),
               (p + "self_attn.q_proj.weight", "BF16", [q * hd, h]), (p + "self_attn.k_proj.weight", "BF16", [kv * hd, h]),
               (p + "self_attn.v_proj.weight", "BF16", [kv * hd, h]), (p + "self_attn.o_proj.weight", "BF16", [h, q * hd]),
               (p + "self_attn.q_norm.weight", "BF16", [hd]), (p + "self_attn.k_norm.weight", "BF16", [hd]),
               (p + "mlp.gate_proj.weight", "BF16", [i, h]), (p + "mlp.up_proj.weight", "BF16", [i, h]),
               (p + "mlp.down_proj.weight", "BF16", [h, i]), (p + "input_layernorm.weight", "BF16", [h]),
               (p + "post_attention_layernorm.weight", "BF16", [h]), ("model.norm.weight", "BF16", [h]),
               ("lm_head.weight", "BF16", [v, h])]
    d = os.path.join(model_root, "py-dense")
    os.makedirs(d)
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=13)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def file_bytes(ckpt, name):
    """The bytes of tensor `name` in the checkpoint's files."""
    m, b, e = ckpt.tensor_bytes(name)
    return bytes(m[b:e])
