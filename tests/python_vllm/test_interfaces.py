"""The vLLM interface check (weightd_vllm.interfaces, compat) against the facts recorded from real wheels.

tests/fixtures/vllm/vllm-X.json hold, for every object the plugin uses, the
facts tests/python/record_vllm_interfaces.py read from vLLM X's wheel (ast,
nothing installed). The same check the plugin runs at import over the live
vLLM runs here over each fixture; mutated copies stand in for a release
that changed one interface. The reader itself (SourceTree) and the live
adapter (compat.LiveInterface) are checked on a small source tree of the
test's own, where both must give the same facts.
"""
import copy
import glob
import json
import os
import subprocess
import sys

import pytest

from weightd_vllm import compat, interfaces

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
FIXTURES = sorted(glob.glob(os.path.join(REPO, "tests", "fixtures", "vllm", "vllm-*.json")))
BASE = "vllm.model_executor.model_loader.base_loader"
DEFAULT = "vllm.model_executor.model_loader.default_loader"


def load(path):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(autouse=True)
def fresh_outcome():
    compat.reset()
    yield
    compat.reset()


def test_fixtures_of_both_releases_are_present():
    assert [load(p)["vllm"] for p in FIXTURES] == ["0.33.0", "0.34.0"], FIXTURES
    # The tested series are exactly the fixtures' (they cannot drift apart).
    assert tuple(compat.series(load(p)["vllm"]) for p in FIXTURES) == compat.TESTED


@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_each_recorded_release_passes_silently(path):
    data = load(path)
    assert data["wheel"].startswith(f"vllm-{data['vllm']}-") and data["wheel"].endswith(".whl")
    assert len(data["sha256"]) == 64 and int(data["sha256"], 16) >= 0
    assert data["recorded_by"] == "tests/python/record_vllm_interfaces.py"
    # Every need was recorded (a need added later without re-recording would show here).
    assert set(data["objects"]) == {f"{n.module}:{n.name}" for n in interfaces.NEEDS}
    assert all(data["objects"][k] is not None for k in data["objects"]), \
        [k for k, v in data["objects"].items() if v is None]
    assert interfaces.check(interfaces.FixtureInterface(data)) == []
    warnings = []
    a = compat.require(interfaces.FixtureInterface(data), warn=warnings.append)
    assert a.error is None and a.warning is None and warnings == []


def mutated(edit, version="0.34.0"):
    data = copy.deepcopy(load(FIXTURES[-1]))
    data["vllm"] = version
    edit(data["objects"])
    return interfaces.FixtureInterface(data)


def _rename(objects, old, new):
    objects[new] = objects.pop(old)


def _drop_param(objects, key, param):
    objects[key]["params"].remove(param)


# Each: an edit standing in for a release that changed one interface, and the text the refusal must hold.
CHANGES = {
    "method renamed": (
        lambda o: _rename(o, f"{BASE}:BaseModelLoader.get_external_weight_memory",
                          f"{BASE}:BaseModelLoader.external_weight_memory"),
        f"{BASE}.BaseModelLoader.get_external_weight_memory: is gone"),
    "parameter removed": (
        lambda o: _drop_param(o, f"{DEFAULT}:DefaultModelLoader.get_all_weights", "model_config"),
        f"{DEFAULT}.DefaultModelLoader.get_all_weights: parameter 'model_config' is gone (now (self, model))"),
    "parameters reordered": (
        lambda o: o[f"{BASE}:BaseModelLoader.load_weights"].update(params=["self", "model_config", "model"]),
        f"{BASE}.BaseModelLoader.load_weights: parameters reordered: (self, model_config, model)"),
    "parallel-state call gone": (
        lambda o: o.__setitem__("vllm.distributed:get_pcp_group", None),
        "vllm.distributed.get_pcp_group: is gone"),
    "config field gone": (
        lambda o: o["vllm.config:ParallelConfig"]["members"].remove("expert_placement_strategy"),
        "vllm.config.ParallelConfig: attribute 'expert_placement_strategy' is gone"),
    "routed experts moved": (
        lambda o: o["vllm.model_executor.layers.fused_moe.runner.moe_runner:MoERunner"]["members"].remove(
            "routed_experts"),
        "MoERunner: attribute 'routed_experts' is gone"),
    "fused module renamed": (
        lambda o: o["vllm.model_executor.models.qwen3:Qwen3ForCausalLM"]["packed"].update(
            qkv_proj=None, fused_qkv_proj=["q_proj", "k_proj", "v_proj"]),
        "Qwen3ForCausalLM: packed_modules_mapping['qkv_proj'] is None, not ['q_proj', 'k_proj', 'v_proj']"),
    "expert stack renamed": (
        lambda o: o["vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
                    "UnquantizedFusedMoEMethod.create_weights"].update(registers=["w2_weight"]),
        "UnquantizedFusedMoEMethod.create_weights: no longer registers parameter 'w13_weight'"),
    "architecture moved": (
        lambda o: o["vllm.model_executor.models.registry:_TEXT_GENERATION_MODELS"]["entries"].update(
            DeepseekV3ForCausalLM=["deepseek_v3", "DeepseekV3ForCausalLM"]),
        "_TEXT_GENERATION_MODELS: ['DeepseekV3ForCausalLM'] is ['deepseek_v3', 'DeepseekV3ForCausalLM'], "
        "not ['deepseek_v2', 'DeepseekV3ForCausalLM']"),
    "caller gone": (
        lambda o: o["vllm.v1.worker.gpu_worker:Worker.init_device"].update(calls=[]),
        "vllm.v1.worker.gpu_worker.Worker.init_device: no longer calls get_external_weight_memory"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_interface_is_refused_naming_it(change):
    edit, text = CHANGES[change]
    iface = mutated(edit)
    problems = interfaces.check(iface)
    assert len(problems) == 1, [str(p) for p in problems]
    with pytest.raises(RuntimeError) as ei:
        compat.require(iface, warn=pytest.fail)
    msg = str(ei.value)
    assert text in msg and "vLLM 0.34.0" in msg and "1 of the vLLM interfaces" in msg, msg
    assert problems[0].why in msg  # it says what the plugin uses the object for
    with pytest.raises(RuntimeError):  # refused again, without checking again
        compat.require()


def test_a_newer_release_that_passes_warns_once():
    iface = mutated(lambda o: None, version="0.35.1")
    warnings = []
    for _ in range(3):
        a = compat.require(iface, warn=warnings.append)
        assert a.error is None and a.version == "0.35.1"
    assert len(warnings) == 1, warnings
    assert "vLLM 0.35.1 is not a release" in warnings[0] and "0.33.x, 0.34.x" in warnings[0], warnings[0]
    assert f"{len(interfaces.NEEDS)} checked" in warnings[0]


def test_a_newer_release_that_changed_one_is_refused_not_warned():
    iface = mutated(lambda o: o.__setitem__(f"{BASE}:BaseModelLoader", None), version="0.35.0")
    with pytest.raises(RuntimeError, match=rf"vLLM 0\.35\.0: 1 of .*{BASE}\.BaseModelLoader: is gone"):
        compat.require(iface, warn=pytest.fail)


@pytest.mark.parametrize("version,want", [("0.34.0", "0.34"), ("0.33.2rc1", "0.33"), ("v0.33.0+cu130", "0.33"),
                                          ("1.0.0", "1.0"), ("dev", None), ("", None)])
def test_series(version, want):
    assert compat.series(version) == want


# ---- the reader and the live adapter, on a source tree of the test's own -----------------------

TREE = {
    "vllm/__init__.py": "__version__ = '9.9.0'\n",
    "vllm/base.py": (
        "import torch.nn as nn\n"
        "class Root:\n"
        "    shared = 1\n"
        "    def __init__(self, load_config):\n"
        "        self.load_config = load_config\n"
        "    def load_model(self, vllm_config, model_config, prefix=''):\n"
        "        self.load_weights(None, model_config)\n"
    ),
    "vllm/impl.py": (
        "from .base import Root as Renamed\n"
        "def helper(a, /, b, *rest, c=1, **kw):\n"
        "    layer.register_parameter('w13_weight', a)\n"
        "    layer.register_parameter(f'w2_{b}', a)\n"
        "class Model(Renamed):\n"
        "    packed_modules_mapping = {'qkv_proj': ['q_proj', 'k_proj', 'v_proj']}\n"
        "    def __init__(self, config):\n"
        "        self.packed_modules_mapping['fused_qkv_a_proj'] = ['q_a_proj', 'kv_a_proj_with_mqa']\n"
        "        self.layers: list = []\n"
        "TABLE = {'A': ('impl', 'Model'), 'B': ('x', make())}\n"
    ),
    "vllm/pkg/__init__.py": "from .inner import *\nfrom vllm.impl import helper as exported\n",
    "vllm/pkg/inner.py": "def get_group():\n    return None\n",
}


def test_the_reader_follows_imports_bases_and_members():
    tree = interfaces.SourceTree(TREE.get)
    f = tree.lookup("vllm.impl", "helper")
    assert f == {"kind": "function", "params": ["a", "b", "*rest", "c", "**kw"], "registers": ["w13_weight"],
                 "calls": ["register_parameter"]}
    assert tree.lookup("vllm.pkg", "exported") == f  # an alias re-exported from another module
    assert tree.lookup("vllm.pkg", "get_group")["params"] == []  # through from .inner import *
    c = tree.lookup("vllm.impl", "Model")
    assert c["members"] == ["__init__", "layers", "load_config", "load_model", "packed_modules_mapping", "shared"]
    assert c["packed"] == {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                           "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}
    m = tree.lookup("vllm.impl", "Model.load_model")  # a method found on the base class
    assert m["params"] == ["self", "vllm_config", "model_config", "prefix"] and "load_weights" in m["calls"]
    assert tree.lookup("vllm.impl", "TABLE") == {"kind": "value", "entries": {"A": ["impl", "Model"]}}
    assert tree.lookup("vllm.impl", "Model.gone") is None and tree.lookup("vllm.impl", "Gone") is None
    assert tree.lookup("vllm.nowhere", "x") is None


def test_the_live_adapter_gives_the_readers_facts(tmp_path):
    """compat.LiveInterface over the imported package (attributes, live sources) and over files not imported."""
    for rel, text in TREE.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    queries = [("vllm.impl", "helper"), ("vllm.pkg", "exported"), ("vllm.pkg", "get_group"), ("vllm.impl", "Model"),
               ("vllm.impl", "Model.load_model"), ("vllm.impl", "TABLE"), ("vllm.impl", "Gone")]
    code = ("import json, sys, types\n"
            "sys.modules['torch'] = types.ModuleType('torch'); sys.modules['torch.nn'] = types.ModuleType('nn')\n"
            "import builtins; builtins.make = lambda: 0; builtins.layer = None\n"
            "from weightd_vllm import compat\n"
            "live = compat.LiveInterface()\n"
            f"queries = {queries!r}\n"
            "before = [live.lookup(m, n) for m, n in queries]  # nothing imported yet: read from the files\n"
            "import vllm.impl, vllm.pkg\n"
            "after = [live.lookup(m, n) for m, n in queries]  # imported: the live objects\n"
            "print(json.dumps({'version': live.version(), 'before': before, 'after': after}))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.path.join(REPO, "client", "python")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    tree = interfaces.SourceTree(TREE.get)
    want = [tree.lookup(m, n) for m, n in queries]
    assert got["version"] == "9.9.0"
    assert got["before"] == want
    # Imported, a dict constant is its evaluated value: entries the reader leaves out (not literals) are there too;
    # the check compares only the keys a need names, which both give alike.
    table = queries.index(("vllm.impl", "TABLE"))
    assert got["after"][table] == {"kind": "value", "entries": {"A": ["impl", "Model"], "B": ["x", 0]}}
    assert [g for i, g in enumerate(got["after"]) if i != table] == [w for i, w in enumerate(want) if i != table]
