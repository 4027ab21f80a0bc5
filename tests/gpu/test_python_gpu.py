"""The Python binding and weightd.transformers.load_model with the cuda backend (a GPU host).

Run through run_python_gpu.py (ctest -L gpu), which skips without CUDA,
torch or transformers:
- every dtype as a torch CUDA tensor on the device the daemon names, bytes
  equal to the files, and the release rule with CUDA memory;
- a tiny Qwen3 written by save_pretrained in several shards with an index:
  load_model's logits bit-identical to from_pretrained's, tied and untied,
  parameters inside the daemon's slab, copy=True independent;
- a second process attaching the same resident set while the first runs;
- the Qwen3-4B layout from mkcheckpoint through load_model, every parameter
  against the files and the logits against from_pretrained's, bit for bit;
- handle kinds: the default daemon's sets come as cuda_vmm handles, and a
  fresh torch process reads one through the binding, bytes equal to the
  files; a daemon run with cuda_handles=legacy serves cuda_ipc sets to the
  same code; a raw client that lists no handle kinds in hello (as clients
  did before cuda_vmm) gets UNSUPPORTED naming cuda_handles.
"""
import hashlib
import gc
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import wdgpu  # noqa: E402
from wdgpu import client, daemon, work  # noqa: E402,F401  the module's daemon fixtures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import weightd  # noqa: E402
from weightd.transformers import load_model  # noqa: E402

sys.path.insert(0, os.path.join(wdgpu.REPO, "tests", "integration"))
import wdclient  # noqa: E402

IDS = [[1, 17, 300, 5, 99, 1000, 42, 7]]


def leases(c):
    return c.status()["daemon"]["leases"]


def logits_of(model, device):
    with torch.no_grad():
        return model(torch.tensor(IDS, device=device)).logits


def bits(t):
    """A tensor's bits, for comparisons that NaNs do not spoil."""
    return t.contiguous().view(torch.uint8)


def test_every_dtype_as_cuda_tensors(client, work):
    d = os.path.join(work, "models", "dtypes")
    os.makedirs(d, exist_ok=True)
    tensors = [("bf16", "BF16", [33, 8]), ("f16", "F16", [4, 4]), ("f32", "F32", [10]), ("f8", "F8_E4M3", [64, 2]),
               ("f8b", "F8_E5M2", [8]), ("i64", "I64", [3]), ("i32", "I32", [2, 2]), ("u8", "U8", [5]),
               ("i8", "I8", [5]), ("b", "BOOL", [6]), ("scalar", "F32", []), ("empty", "BF16", [0, 3])]
    wdclient.write_safetensors(os.path.join(d, "model.safetensors"), tensors, seed=5)
    ckpt = wdclient.Checkpoint(d)
    with client.attach(d, device=0) as s:
        assert s.memory == "cuda" and s.device == weightd._cuda.uuid_of(0)
        assert s.handle == "cuda_vmm" and isinstance(s.read_only, bool)
        assert s.torch_device == torch.device("cuda", 0)
        for name, dtype, shape in tensors:
            t = s[name]
            assert t.is_cuda and t.device == s.torch_device
            assert t.dtype == weightd._wrap.torch_dtype(dtype) and list(t.shape) == shape, name
            m, b, e = ckpt.tensor_bytes(name)
            assert bits(t.reshape(-1)).cpu().numpy().tobytes() == bytes(m[b:e]), name
            if t.numel():
                assert t.data_ptr() == s.info(name).data_ptr
    ckpt.close()


def test_cuda_release_is_deferred_while_a_tensor_lives(client, work):
    d = os.path.join(work, "models", "dtypes")
    s = client.attach(d, device=torch.device("cuda", 0))
    t = s["bf16"]
    before = bits(t).cpu()
    assert s.release() is False and leases(client) == 1
    torch.cuda.synchronize()
    assert torch.equal(bits(t).cpu(), before)
    del t
    gc.collect()
    assert leases(client) == 0


@pytest.mark.parametrize("tied", [False, True])
def test_load_model_logits_bit_identical(client, work, tied):
    from transformers import AutoModelForCausalLM

    path = wdgpu.save_tiny_qwen3(os.path.join(work, "models", f"tiny-qwen3-{tied}"), tied)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) >= 3, "save_pretrained wrote too few shards"
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    model = load_model(path, client=client, device=0)
    assert isinstance(model, transformers.PreTrainedModel) and not model.training
    want = logits_of(ref, "cuda:0")
    got = logits_of(model, "cuda:0")
    assert torch.equal(want, got)
    emb = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is emb) == tied
    with client.attach(path, device=0) as s:  # the same set: the parameters are its memory
        for name, p in model.named_parameters():
            assert s.base <= p.data_ptr() < s.base + s.nbytes, name
            assert not p.requires_grad
    assert leases(client) == 1  # the model's
    copy = load_model(path, client=client, device=0, copy=True)
    assert torch.equal(logits_of(copy, "cuda:0"), want)
    for p in copy.parameters():
        assert not (s.base <= p.data_ptr() < s.base + s.nbytes)
    assert leases(client) == 1  # the copy holds none
    del model, emb, p  # p: the loop's last parameter, which holds the set too
    gc.collect()
    assert leases(client) == 0


SECOND = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
from weightd.transformers import load_model
model = load_model(sys.argv[2], socket=sys.argv[1], device=0)
with torch.no_grad():
    out = model(torch.tensor(json.loads(sys.argv[4]), device="cuda:0")).logits
print(json.dumps({"logits": out.float().cpu().view(-1).tolist()}))
"""


def test_second_process_attaches_the_same_resident_set(client, daemon, work):
    path = wdgpu.save_tiny_qwen3(os.path.join(work, "models", "tiny-qwen3-False"), False)
    model = load_model(path, client=client, device=0)
    want = logits_of(model, "cuda:0").float().cpu().view(-1).tolist()
    sets = client.status()["sets"]
    r = subprocess.run([sys.executable, "-c", SECOND, daemon.socket, path, os.path.join(wdgpu.REPO, "client", "python"),
                        json.dumps(IDS)], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["logits"] == want
    after = client.status()["sets"]
    assert [x["set"] for x in after] == [x["set"] for x in sets]  # the child loaded nothing new
    assert [x["leases"] for x in after] == [x["leases"] for x in sets]  # and its lease ended with it
    assert model.lm_head.weight.is_cuda
    del model
    gc.collect()


def test_qwen3_4b_layout_through_load_model(client, work):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = wdgpu.mkcheckpoint(os.path.join(work, "models", "qwen3-4b"), "qwen3-4b")
    model = load_model(path, client=client, device=0)
    params = dict(model.named_parameters())
    assert len(params) == 398
    ckpt = wdclient.Checkpoint(path)
    for fname in ckpt.shards:
        with safe_open(os.path.join(path, fname), framework="pt", device="cuda:0") as f:
            for name in f.keys():
                assert torch.equal(bits(params[name]), bits(f.get_tensor(name))), name
    ckpt.close()
    got = logits_of(model, "cuda:0")
    del params, model
    gc.collect()
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda:0").eval()
    assert torch.equal(bits(logits_of(ref, "cuda:0")), bits(got))


REMAPPED = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3])
import weightd
with weightd.Client(sys.argv[1]) as c, c.attach(sys.argv[2], device=0) as s:
    t = s["bf16"]
    print(json.dumps({"uuid": s.device, "mine": weightd._cuda.uuid_of(0), "device": str(t.device),
                      "sum": float(t.float().nan_to_num().sum())}))
"""


def test_device_numbering_follows_cuda_visible_devices(daemon, work):
    """With the GPUs reordered for the caller, device=0 is the caller's first GPU, named by UUID."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    order = ",".join(str(i) for i in reversed(range(torch.cuda.device_count())))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=order)
    d = os.path.join(work, "models", "dtypes")
    r = subprocess.run([sys.executable, "-c", REMAPPED, daemon.socket, d, os.path.join(wdgpu.REPO, "client", "python")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.splitlines()[-1])
    last = torch.cuda.device_count() - 1
    assert out["uuid"] == out["mine"] == weightd._cuda.uuid_of(last)  # our last GPU is its first
    assert out["device"] == "cuda:0"


# ---- handle kinds ---------------------------------------------------------------------------

def files_digest(path, names):
    """SHA-256 over the named tensors' bytes in the files, in that order."""
    ckpt = wdclient.Checkpoint(path)
    h = hashlib.sha256()
    for name in names:
        m, b, e = ckpt.tensor_bytes(name)
        h.update(bytes(m[b:e]))
    ckpt.close()
    return h.hexdigest()


READER = r"""
import hashlib, json, sys, torch
sys.path.insert(0, sys.argv[3])
import weightd
names = json.loads(sys.argv[4])
with weightd.Client(sys.argv[1]) as c, c.attach(sys.argv[2], device=0) as s:
    h = hashlib.sha256()
    for n in names:
        h.update(s[n].contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    print(json.dumps({"handle": s.handle, "read_only": s.read_only, "memory": s.memory, "sha256": h.hexdigest(),
                      "device": str(s[names[0]].device)}))
"""

NAMES = ["bf16", "f16", "f32", "f8", "i64", "u8", "b", "scalar"]


def read_in_fresh_process(socket, path):
    r = subprocess.run([sys.executable, "-c", READER, socket, path, os.path.join(wdgpu.REPO, "client", "python"),
                        json.dumps(NAMES)], capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def test_a_fresh_torch_process_reads_a_vmm_set(client, daemon, work):
    d = os.path.join(work, "models", "dtypes")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        pytest.skip("needs test_every_dtype_as_cuda_tensors's checkpoint")
    out = read_in_fresh_process(daemon.socket, d)
    assert out["handle"] == "cuda_vmm" and out["memory"] == "cuda" and out["device"] == "cuda:0"
    assert out["sha256"] == files_digest(d, NAMES)
    assert leases(client) == 0  # the child's lease ended with it


def test_a_legacy_daemon_serves_cuda_ipc_sets_to_the_same_code(work):
    d = os.path.join(work, "models", "dtypes")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        pytest.skip("needs test_every_dtype_as_cuda_tensors's checkpoint")
    legacy = wdgpu.CudaDaemon(work, os.path.join(work, "models"), settings={"cuda_handles": "legacy"}).start()
    try:
        with weightd.Client(legacy.socket) as c:
            with c.attach(d, device=0) as s:
                assert s.handle == "cuda_ipc" and s.read_only is False
                for name in NAMES:
                    m = s[name]
                    assert m.is_cuda
                assert c.status()["devices"][0]["handles"] == "cuda_ipc"
        out = read_in_fresh_process(legacy.socket, d)
        assert out["handle"] == "cuda_ipc" and out["sha256"] == files_digest(d, NAMES)
    finally:
        legacy.stop()


def test_a_client_that_lists_no_handle_kinds_gets_unsupported(client, daemon, work):
    d = os.path.join(work, "models", "dtypes")
    if not os.path.exists(os.path.join(d, "model.safetensors")):
        pytest.skip("needs test_every_dtype_as_cuda_tensors's checkpoint")
    with wdclient.Conn(daemon.socket) as old:  # hello without "handles", as clients spoke before cuda_vmm
        rep, fds = old.request("attach", path=d, device=0)
        assert fds == [] and rep["error"]["code"] == "UNSUPPORTED", rep
        assert "cuda_vmm" in rep["error"]["message"] and '"cuda_handles": "legacy"' in rep["error"]["message"]
    assert leases(client) == 0
