"""The vLLM plugin's copy path on a GPU, without vLLM (which does not travel to the GPU host).

weightd_vllm.core.serve fills a torch "model" on cuda:0 whose parameters have
vLLM 0.33's names, shapes and dtypes (tests/python_vllm/fixtures, recorded
from the real package) from a cuda-backend set, exactly as the vLLM loader
does (loader.py's VllmTarget: ``param.data.copy_(src, non_blocking=True)``,
``torch.cuda.synchronize()`` before the set is released):

- the rank's device is named by UUID (Client.device_arg), every parameter
  holds exactly the bytes tests/python/layout_ref.py computes from the files
  (dense, MoE under EP, FP8 DeepSeek-V3), and the lease ends after the copy;
- shared mode leaves parameters in the daemon's memory, holding the lease;
- the daemon's ``used`` bytes for the device (what get_external_weight_memory
  reports to vLLM) cover the resident sets;
- a measurement: the Qwen3-8B layout (16.4 GB), resident, attached and copied
  device to device into preallocated parameters (the cost of a restart or a
  role switch once the set is resident). Printed, and written to
  $WD_VLLM_GPU_OUT when set.

Run through run_python_gpu.py (ctest -L gpu), which skips without CUDA or torch.
"""
import json
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import wdgpu  # noqa: E402
from wdgpu import client, daemon, work  # noqa: E402,F401  the module's daemon fixtures

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

sys.path.insert(0, os.path.join(wdgpu.REPO, "tests", "python"))
sys.path.insert(0, os.path.join(wdgpu.REPO, "tests", "python_vllm"))

import layout_ref  # noqa: E402
import vllm_models  # noqa: E402
from weightd_vllm import core, names  # noqa: E402
from weightd_vllm.core import Spec  # noqa: E402

FIXTURE = os.path.join(wdgpu.REPO, "tests", "python_vllm", "fixtures", "vllm-0.33-params.json")
TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn}
CASES = ["qwen3/w1r0", "tp2_moe_ep/w2r1", "tp2_deepseek_v2_ep/w2r0", "deepseek_v3_fp8/w1r0",
         "tp2_deepseek_v3_fp8_ep/w2r1"]


def bits(t):
    return t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()


class TorchModel:
    """core.Target over torch tensors on cuda:0 (``tensors``), filled as loader.VllmTarget fills vLLM's."""

    def __init__(self, specs):
        self.specs = {n: Spec(tuple(s), d) for n, (s, d) in specs.items()}
        self.tensors = {n: torch.zeros(s, dtype=TORCH[d], device="cuda:0") for n, (s, d) in specs.items()}

    def params(self):
        return dict(self.specs)

    def copy(self, name, src):
        with torch.no_grad():
            self.tensors[name].copy_(src, non_blocking=True)

    def share(self, name, src):
        if src.device != self.tensors[name].device:
            return False
        self.tensors[name] = src
        return True

    def exempt(self, name):
        return False

    def packed(self):
        return {}

    def load_weights(self, weights):
        raise AssertionError("nothing should reach load_weights here")

    def default_weights(self):
        raise AssertionError("nothing should reach the default loader here")

    def default_load(self):
        raise AssertionError("nothing should reach the default loader here")

    def sync(self):
        torch.cuda.synchronize()


def file_tensor(path, name):
    """One tensor of a checkpoint directory, read by the reference safetensors package."""
    from safetensors import safe_open

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(path, shard), framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def fixture():
    with open(FIXTURE) as f:
        return json.load(f)["cases"]


def _model_dir(work, name):
    return vllm_models.write(os.path.join(work, "models"), name)


@pytest.mark.parametrize("case", CASES)
def test_copy_on_the_gpu(client, work, fixture, case):
    c = fixture[case]
    path = _model_dir(work, c["model"])
    t = TorchModel(c["params"])
    dev = client.device_arg(torch.device("cuda", 0))
    assert dev.startswith("GPU-")
    rep = core.serve(t, client, path, c["plan"], device=dev, tensor_type="torch")
    assert sorted(rep.copied) == sorted(c["params"]) and rep.warnings == []
    assert client.status()["daemon"]["leases"] == 0  # released after the synchronize
    ck = layout_ref.Checkpoint(path)
    outs = layout_ref.build(ck, **c["plan"])
    want = {names.to_vllm(n): layout_ref.materialize(ck, o) for n, o in outs.items()}
    for n, p in t.tensors.items():
        assert p.is_cuda and bits(p) == want[n], n


def test_shared_mode_keeps_the_daemons_memory(client, work, fixture):
    c = fixture["qwen3/w1r0"]
    path = _model_dir(work, c["model"])
    t = TorchModel(c["params"])
    rep = core.serve(t, client, path, c["plan"], device=client.device_arg(0), mode="shared", tensor_type="torch")
    assert sorted(rep.shared) == sorted(c["params"]) and rep.copied == []
    assert client.status()["daemon"]["leases"] == 1  # the shared parameters hold the set
    ck = layout_ref.Checkpoint(path)
    outs = layout_ref.build(ck, **c["plan"])
    for n, o in outs.items():
        assert bits(t.tensors[names.to_vllm(n)]) == layout_ref.materialize(ck, o)
    t.tensors.clear()
    assert client.status()["daemon"]["leases"] == 0


def test_the_daemons_used_bytes_cover_its_sets(client, work, fixture):
    c = fixture["tp2_moe_ep/w2r1"]
    dev = client.device_arg(0)
    client.load(_model_dir(work, c["model"]), device=dev, plan=c["plan"])
    st = client.status()
    used = [d["used"] for d in st["devices"] if d["uuid"] == dev]
    assert used and used[0] >= sum(s["bytes"] for s in st["sets"] if s["device"] == dev) > 0


def test_measure_resident_attach_and_copy(client, work):
    """Qwen3-8B's layout, one rank: load (cold, then resident), attach, copy into preallocated parameters."""
    path = wdgpu.mkcheckpoint(os.path.join(work, "models", "qwen3-8b"), "qwen3-8b")
    plan = {"preset": "auto", "tp_size": 1, "tp_rank": 0, "fuse": True}
    dev = client.device_arg(0)
    t0 = time.perf_counter()
    sid = client.load(path, device=dev, plan=plan)
    cold = time.perf_counter() - t0
    out = {"checkpoint": "qwen3-8b (mkcheckpoint)", "plan": plan, "first_load_s": cold, "runs": []}
    params = None
    for run in range(3):
        t0 = time.perf_counter()
        assert client.load(path, device=dev, plan=plan) == sid
        t1 = time.perf_counter()
        s = client.attach(set_id=sid)
        t2 = time.perf_counter()
        infos = s.infos()
        if params is None:
            params = {i.name: torch.empty(i.nbytes, dtype=torch.uint8, device="cuda:0") for i in infos}
        for i in infos:
            params[i.name].copy_(s[i.name].reshape(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        nbytes = sum(i.nbytes for i in infos)
        s.release()
        out["runs"].append({"resident_load_s": t1 - t0, "attach_s": t2 - t1, "copy_s": t3 - t2,
                            "tensors": len(infos), "bytes": nbytes, "copy_gb_per_s": nbytes / (t3 - t2) / 1e9})
    for name in ("model.norm.weight", "model.layers.35.mlp.down_proj.weight"):
        assert bits(params[name]) == bits(file_tensor(path, name)), name
    print(json.dumps(out, indent=1))
    dest = os.environ.get("WD_VLLM_GPU_OUT")
    if dest:
        with open(dest, "w") as f:
            json.dump(out, f, indent=1)
