"""The vLLM interfaces the plugin uses, and the one check that says whether a vLLM still has them.

:data:`NEEDS` lists every vLLM object the plugin touches (read from
loader.py, ranks.py and names.py): the loader registry and base class, the
default loader it falls back to, the configs it reads, the parallel-state
calls, the MoE objects whose attributes give the experts placed on a rank,
the quantisation methods that register the expert stacks' parameter names,
and, for each verified architecture, the registry entry and the
``packed_modules_mapping`` its fused parameter names come from.

:func:`check` compares those needs with an :class:`Interface`, something
that answers ``lookup(module, qualname)`` with the *facts* of one object
(:func:`describe` reads them from its source with ``ast``):

- a function: ``{"kind": "function", "params": [...], "registers": [...],
  "calls": [...]}`` (its parameter names in order, the names it passes to
  ``register_parameter``, the functions and methods it calls);
- a class: ``{"kind": "class", "members": [...], "packed": {...}}`` (what it
  and its vLLM bases define or assign to ``self``, and its
  ``packed_modules_mapping``);
- a dict constant: ``{"kind": "value", "entries": {...}}``.

Two interfaces exist: compat.LiveInterface, over the vLLM this process
imported (each object found by import and attribute, its facts read from its
own source), and :class:`FixtureInterface`, over facts recorded from a wheel
(tests/fixtures/vllm, written by tests/python/record_vllm_interfaces.py).
Both feed the same :func:`check`. Pure: imports neither vLLM nor torch.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

# ---- what the plugin needs ---------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """One vLLM object the plugin uses, and what about it must hold (each empty tuple: nothing asked)."""

    module: str
    name: str  # a qualified name inside module: "BaseModelLoader.load_model"
    kind: str  # "function", "class" or "value"
    why: str  # what the plugin uses it for (part of the message when it changed)
    params: tuple = ()  # function: these parameter names, in this order
    calls: tuple = ()  # function: it calls these
    registers: tuple = ()  # function: it registers parameters of these names
    members: tuple = ()  # class: it has these attributes
    packed: tuple = ()  # class: (fused module, (checkpoint modules, ...)) pairs of its packed_modules_mapping
    entries: tuple = ()  # value: (key, value) pairs of the dict

    @property
    def where(self) -> str:
        return f"{self.module}.{self.name}"


ML = "vllm.model_executor.model_loader"
BASE = f"{ML}.base_loader"
DEFAULT = f"{ML}.default_loader"
FMOE = "vllm.model_executor.layers.fused_moe"
MODELS = "vllm.model_executor.models"


def _fn(module: str, name: str, why: str, params: tuple = (), **kw: Any) -> Need:
    return Need(module, name, "function", why, params=params, **kw)


def _cls(module: str, name: str, why: str, members: tuple = (), **kw: Any) -> Need:
    return Need(module, name, "class", why, members=members, **kw)


_LOADER = (
    _fn(ML, "register_model_loader", "registers --load-format weightd", ("load_format",)),
    _fn(ML, "get_model_loader", "constructs the registered loader from a LoadConfig", ("load_config",)),
    _cls(BASE, "BaseModelLoader", "the class WeightdModelLoader derives from",
         ("load_config", "download_model", "load_weights", "load_model", "get_external_weight_memory")),
    _fn(BASE, "BaseModelLoader.__init__", "WeightdModelLoader.__init__ calls it", ("self", "load_config")),
    _fn(BASE, "BaseModelLoader.download_model", "overridden", ("self", "model_config")),
    _fn(BASE, "BaseModelLoader.load_weights", "overridden: it fills the parameters",
        ("self", "model", "model_config")),
    _fn(BASE, "BaseModelLoader.load_model", "overridden and called: it builds the model, then load_weights",
        ("self", "vllm_config", "model_config", "prefix"), calls=("load_weights",)),
    _fn(BASE, "BaseModelLoader.get_external_weight_memory",
        "overridden: the set is loaded there, before the worker's memory snapshot", ("self", "vllm_config")),
    _fn("vllm.v1.worker.gpu_worker", "Worker.init_device",
        "the GPU worker asks the loader for its external weight memory there",
        calls=("get_external_weight_memory",)),
    _fn(DEFAULT, "DefaultModelLoader.__init__", "the fallback loader", ("self", "load_config")),
    _fn(DEFAULT, "DefaultModelLoader.load_weights", "the fallback for a whole rank",
        ("self", "model", "model_config")),
    _fn(DEFAULT, "DefaultModelLoader.get_all_weights", "the fallback's checkpoint tensors, for the rest",
        ("self", "model_config", "model")),
    _fn(DEFAULT, "DefaultModelLoader.download_model", "download_model delegates to it", ("self", "model_config")),
)

_CONFIG = (
    _cls("vllm.config", "LoadConfig", "the loader's options and the fallback's config",
         ("load_format", "model_loader_extra_config")),
    _fn("vllm.config", "replace", "the fallback's LoadConfig (load_format auto)", ("dataclass_instance",)),
    _fn("vllm.config", "get_current_vllm_config", "load_weights finds the parallel config"),
    _cls("vllm.config", "ModelConfig", "the checkpoint path and config.json", ("model", "hf_config")),
    _cls("vllm.config", "VllmConfig", "the model and parallel configs", ("model_config", "parallel_config")),
    _cls("vllm.config", "ParallelConfig", "the rank's layout (ranks.from_vllm)",
         ("data_parallel_size", "prefill_context_parallel_size", "enable_expert_parallel", "enable_eplb",
          "expert_placement_strategy", "all2all_backend")),
    _fn("vllm.logger", "init_logger", "the plugin's log lines", ("name",)),
)

_PARALLEL = tuple(
    _fn("vllm.distributed", name, "the rank's layout (ranks.from_vllm)")
    for name in ("get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank", "get_pp_group",
                 "get_dp_group", "get_pcp_group")
) + (
    _cls("vllm.distributed.parallel_state", "GroupCoordinator", "the groups' sizes and ranks",
         ("world_size", "rank_in_group")),
)

_LAYERS = (
    _cls("vllm.model_executor.layers.quantization.kv_cache", "BaseKVCacheMethod",
         "KV-cache scales no checkpoint carries are exempt"),
    _cls("vllm.model_executor.layers.linear", "UnquantizedLinearMethod",
         "shared mode keeps these modules' weights the daemon's", ("process_weights_after_loading",)),
    _cls("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod",
         "shared mode keeps these modules' weights the daemon's", ("process_weights_after_loading",)),
    _cls(f"{FMOE}.runner.moe_runner", "MoERunner",
         "a MoE layer's experts sit in its routed_experts (vLLM's experts.routed_experts.* names)",
         ("routed_experts",)),
    _cls(f"{FMOE}.routed_experts", "RoutedExperts", "the experts vLLM placed on the rank",
         ("expert_map_manager", "global_num_experts")),
    _cls(f"{FMOE}.expert_map_manager", "ExpertMapManager", "the experts vLLM placed on the rank",
         ("expert_map", "global_num_experts")),
    _fn(f"{FMOE}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod.create_weights",
        "the expert stacks' parameter names", registers=("w13_weight", "w2_weight")),
    _fn("vllm.model_executor.layers.quantization.fp8", "Fp8MoEMethod.create_weights",
        "the FP8 expert stacks' parameter names", registers=("w13_weight", "w2_weight")),
)

#: The verified architectures (loader.VERIFIED_ARCHITECTURES): vLLM's registry entry of each, and the
#: fused modules of its packed_modules_mapping that weightd's fused outputs are named after (names.PACKED).
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("qwen3", (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   ("gate_up_proj", ("gate_proj", "up_proj")))),
    "Qwen2ForCausalLM": ("qwen2", (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   ("gate_up_proj", ("gate_proj", "up_proj")))),
    "LlamaForCausalLM": ("llama", (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                   ("gate_up_proj", ("gate_proj", "up_proj")))),
    "Qwen3MoeForCausalLM": ("qwen3_moe", (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                          ("gate_up_proj", ("gate_proj", "up_proj")))),
    "DeepseekV2ForCausalLM": ("deepseek_v2", (("gate_up_proj", ("gate_proj", "up_proj")),
                                              ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")))),
    "DeepseekV3ForCausalLM": ("deepseek_v2", (("gate_up_proj", ("gate_proj", "up_proj")),
                                              ("fused_qkv_a_proj", ("q_a_proj", "kv_a_proj_with_mqa")))),
}

_MODELS = (
    Need(f"{MODELS}.registry", "_TEXT_GENERATION_MODELS", "value", "the verified architectures' model classes",
         entries=tuple((arch, (mod, arch)) for arch, (mod, _) in ARCHITECTURES.items())),
) + tuple(
    _cls(f"{MODELS}.{mod}", arch, "its parameter names: fused modules, load_weights",
         ("load_weights", "packed_modules_mapping"), packed=packed)
    for arch, (mod, packed) in ARCHITECTURES.items()
)

_PLUGINS = (
    _fn("vllm.plugins", "load_general_plugins", "vLLM calls register() through the vllm.general_plugins group",
        calls=("load_plugins_by_group",)),
)

#: Every vLLM interface the plugin uses.
NEEDS: tuple = _LOADER + _CONFIG + _PARALLEL + _LAYERS + _MODELS + _PLUGINS

# ---- the facts of an object, from its source -----------------------------------------------


def _params(node: ast.AST) -> list[str]:
    a = node.args
    out = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        out.append("*" + a.vararg.arg)
    out += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        out.append("**" + a.kwarg.arg)
    return out


def _called(call: ast.Call) -> Optional[str]:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _literal(node: ast.AST) -> Any:
    """The JSON form of a literal (tuples become lists); raises ValueError for anything else."""
    def j(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [j(x) for x in v]
        if isinstance(v, dict):
            return {k: j(x) for k, x in v.items()}
        return v
    return j(ast.literal_eval(node))


def _function(node: ast.AST) -> dict:
    registers, calls = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            name = _called(n)
            if name:
                calls.add(name)
            if name == "register_parameter" and n.args and isinstance(n.args[0], ast.Constant) \
                    and isinstance(n.args[0].value, str):
                registers.add(n.args[0].value)
    return {"kind": "function", "params": _params(node), "registers": sorted(registers), "calls": sorted(calls)}


def _is_self_attr(t: ast.AST, attr: Optional[str] = None) -> bool:
    return (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            and (attr is None or t.attr == attr))


def _class(node: ast.ClassDef) -> dict:
    members, packed = set(), {}
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(stmt.name)
        targets = stmt.targets if isinstance(stmt, ast.Assign) else \
            [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        for t in targets:
            if isinstance(t, ast.Name):
                members.add(t.id)
                if t.id == "packed_modules_mapping" and isinstance(stmt.value, ast.Dict):
                    for k, v in zip(stmt.value.keys, stmt.value.values):
                        try:
                            packed[_literal(k)] = _literal(v)
                        except (ValueError, TypeError, SyntaxError):
                            continue
    for n in ast.walk(node):
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if _is_self_attr(t):
                members.add(t.attr)
            # self.packed_modules_mapping["K"] = [...] (DeepSeek sets its fused modules in __init__)
            if isinstance(t, ast.Subscript) and _is_self_attr(t.value, "packed_modules_mapping") \
                    and isinstance(n, ast.Assign):
                try:
                    packed[_literal(t.slice)] = _literal(n.value)
                except (ValueError, TypeError, SyntaxError):
                    continue
    return {"kind": "class", "members": sorted(members), "packed": packed}


def _value(node: ast.AST) -> Optional[dict]:
    if not isinstance(node, ast.Dict):
        return None
    entries = {}
    for k, v in zip(node.keys, node.values):
        try:
            entries[_literal(k)] = _literal(v)
        except (ValueError, TypeError, SyntaxError):
            continue  # an entry that is not a literal is not a fact the checks use
    return {"kind": "value", "entries": entries}


def describe(node: ast.AST) -> Optional[dict]:
    """The facts of one definition node (a def, a class, or a dict constant's value); None for other nodes."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _function(node)
    if isinstance(node, ast.ClassDef):
        return _class(node)
    return _value(node)


def merge(classes: list) -> dict:
    """The facts of a class from its own and its vLLM bases' facts, most basic first (later ones win)."""
    members, packed = set(), {}
    for facts in classes:
        members.update(facts["members"])
        packed.update(facts["packed"])
    return {"kind": "class", "members": sorted(members), "packed": packed}


def value_facts(obj: Any) -> Optional[dict]:
    """The facts of a live dict constant (its entries that are JSON literals, tuples as lists)."""
    if not isinstance(obj, dict):
        return None
    src = ast.parse(repr({k: v for k, v in obj.items() if _plain(k) and _plain(v)}), mode="eval").body
    return _value(src)


def _plain(v: Any) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return isinstance(v, (str, int, float, bool, type(None)))

# ---- a vLLM's source tree ----------------------------------------------------------------------


class SourceTree:
    """The facts of vLLM's objects read from its source files, without importing them.

    `read(relpath)` gives a file's text ("vllm/config/load.py") or None when
    there is no such file: from a wheel (the recorder) or the installed
    package (compat.LiveInterface, for modules this process has not
    imported). Names are followed through ``from X import name``, ``from X
    import *`` and a class's bases, as Python would find them.
    """

    def __init__(self, read: Any):
        self.read = read
        self._trees: dict = {}

    def _module(self, module: str) -> Optional[ast.Module]:
        if module not in self._trees:
            base = module.replace(".", "/")
            text = self.read(base + ".py")
            if text is None:
                text = self.read(base + "/__init__.py")
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]

    @staticmethod
    def _absolute(module: str, node: ast.ImportFrom, package: bool) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        keep = len(parts) - node.level + (1 if package else 0)
        return ".".join(parts[:keep] + ([node.module] if node.module else []))

    def find(self, module: str, name: str, _seen: Optional[set] = None) -> Optional[tuple]:
        """(module, node) of top-level `name` in `module` (a def, a class or an assigned value), or None."""
        seen = _seen if _seen is not None else set()
        if (module, name) in seen:
            return None
        seen.add((module, name))
        tree = self._module(module)
        if tree is None:
            return None
        package = self.read(module.replace(".", "/") + "/__init__.py") is not None
        found = None
        for stmt in tree.body:  # the last binding wins, as at run time
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                found = (module, stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets) and stmt.value is not None:
                    found = (module, stmt.value)
            elif isinstance(stmt, ast.ImportFrom):
                src = self._absolute(module, stmt, package)
                for alias in stmt.names:
                    if alias.name == "*":
                        hit = self.find(src, name, seen)
                        if hit is not None:
                            found = hit
                    elif (alias.asname or alias.name) == name:
                        found = self.find(src, alias.name, seen)
        return found

    def _member(self, module: str, cls: ast.ClassDef, name: str) -> Optional[ast.AST]:
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                return stmt
        for base_module, base in self._bases(module, cls):
            hit = self._member(base_module, base, name)
            if hit is not None:
                return hit
        return None

    def _bases(self, module: str, cls: ast.ClassDef) -> list:
        out = []
        for b in cls.bases:
            if isinstance(b, ast.Name):
                hit = self.find(module, b.id)
                if hit is not None and isinstance(hit[1], ast.ClassDef):
                    out.append(hit)
        return out

    def _class_facts(self, module: str, cls: ast.ClassDef) -> dict:
        chain = []  # most basic first, as merge() wants

        def walk(m: str, c: ast.ClassDef) -> None:
            for bm, b in reversed(self._bases(m, c)):
                walk(bm, b)
            chain.append(describe(c))
        walk(module, cls)
        return merge(chain)

    def lookup(self, module: str, name: str) -> Optional[dict]:
        head, *rest = name.split(".")
        hit = self.find(module, head)
        if hit is None:
            return None
        where, node = hit
        for part in rest:
            if not isinstance(node, ast.ClassDef):
                return None
            found = self._member(where, node, part)
            if found is None:
                return None
            node = found
        if isinstance(node, ast.ClassDef):
            return self._class_facts(where, node)
        return describe(node)


# ---- interfaces and the check ------------------------------------------------------------------


class Interface(Protocol):
    """A vLLM as the check sees it."""

    def version(self) -> str:
        """vLLM's version string ("0.34.0")."""

    def lookup(self, module: str, name: str) -> Optional[dict]:
        """The facts of `module`'s `name` (a dotted qualified name); None when there is no such object."""


class FixtureInterface:
    """Facts recorded from a vLLM wheel (tests/fixtures/vllm/*.json), answered as the live vLLM would."""

    def __init__(self, data: dict):
        self.data = data

    def version(self) -> str:
        return str(self.data["vllm"])

    def lookup(self, module: str, name: str) -> Optional[dict]:
        return self.data["objects"].get(f"{module}:{name}")


@dataclass
class Problem:
    """One need a vLLM does not meet: the object's dotted name and what changed about it."""

    where: str
    what: str
    why: str = field(default="")

    def __str__(self) -> str:
        return f"{self.where}: {self.what} (the plugin uses it: {self.why})"


def _compare(need: Need, facts: dict) -> list[str]:
    out = []
    if facts.get("kind") != need.kind:
        return [f"is a {facts.get('kind')}, no longer a {need.kind}"]
    if need.params:
        have = facts["params"]
        gone = [p for p in need.params if p not in have]
        for p in gone:
            out.append(f"parameter {p!r} is gone (now ({', '.join(have)}))")
        if not gone and [have.index(p) for p in need.params] != sorted(have.index(p) for p in need.params):
            out.append(f"parameters reordered: ({', '.join(have)}), was ({', '.join(need.params)})")
    for c in need.calls:
        if c not in facts["calls"]:
            out.append(f"no longer calls {c}")
    for r in need.registers:
        if r not in facts["registers"]:
            out.append(f"no longer registers parameter {r!r}")
    for m in need.members:
        if m not in facts["members"]:
            out.append(f"attribute {m!r} is gone")
    for module, parts in need.packed:
        got = facts["packed"].get(module)
        if got != list(parts):
            out.append(f"packed_modules_mapping[{module!r}] is {got}, not {list(parts)}")
    for key, value in need.entries:
        got = facts["entries"].get(key)
        if got != list(value):
            out.append(f"[{key!r}] is {got}, not {list(value)}")
    return out


def relevant(need: Need, facts: Optional[dict]) -> Optional[dict]:
    """`facts` cut to what `need` asks about (the recorder keeps only these: the fixtures stay small)."""
    if facts is None or facts.get("kind") != need.kind:
        return facts
    out: dict = {"kind": facts["kind"]}
    if need.kind == "function":
        out["params"] = facts["params"]
        out["calls"] = [c for c in facts["calls"] if c in need.calls]
        out["registers"] = [r for r in facts["registers"] if r in need.registers]
    elif need.kind == "class":
        out["members"] = [m for m in facts["members"] if m in need.members]
        out["packed"] = {k: v for k, v in facts["packed"].items() if k in dict(need.packed)}
    else:
        keys = dict(need.entries)
        out["entries"] = {k: v for k, v in facts["entries"].items() if k in keys}
    return out


def check(iface: Interface, needs: tuple = NEEDS) -> list[Problem]:
    """Every need `iface` does not meet, in NEEDS order (empty: the plugin can run on it)."""
    problems = []
    for need in needs:
        try:
            facts = iface.lookup(need.module, need.name)
        except Exception as e:  # noqa: BLE001 - a module that fails to import is a changed interface too
            problems.append(Problem(need.where, f"cannot be read ({type(e).__name__}: {e})", need.why))
            continue
        if facts is None:
            problems.append(Problem(need.where, "is gone", need.why))
            continue
        problems += [Problem(need.where, what, need.why) for what in _compare(need, facts)]
    return problems
