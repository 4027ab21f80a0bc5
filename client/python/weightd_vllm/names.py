"""weightd output names <-> vLLM parameter names (0.33 and 0.34), and the checkpoint tensors a parameter is built from.

weightd's fused presets name their outputs as vLLM's layers name their
parameters (docs/protocol.md, "Plans"): ``self_attn.qkv_proj.weight``,
``mlp.gate_up_proj.weight``, ``self_attn.fused_qkv_a_proj.weight``, norms,
embeddings and the rest keep their names. The one difference in vLLM 0.33 is
the MoE layer: its experts live in a ``RoutedExperts`` module under the
``experts`` runner, so weightd's ``mlp.experts.w13_weight`` is vLLM's
``mlp.experts.routed_experts.w13_weight`` (and ``w2_``, and their
``_scale_inv`` block scales). The table below is that rule; the tests check
it against the parameters a real vLLM 0.33 model has (tests/vllm), and at
start-up interfaces.py checks that the vLLM running still names them so
(``MoERunner.routed_experts``, the models' ``packed_modules_mapping``).
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional

#: weightd output name -> vLLM parameter name, for vLLM 0.33 (first match applies).
TO_VLLM = (
    (re.compile(r"^(.*\.experts)\.(w13|w2)_(.+)$"), r"\1.routed_experts.\2_\3"),
)
#: The inverse rules: vLLM parameter name -> weightd output name.
TO_WEIGHTD = (
    (re.compile(r"^(.*\.experts)\.routed_experts\.(w13|w2)_(.+)$"), r"\1.\2_\3"),
)

#: Fused vLLM modules and the checkpoint modules they are made of (a model's own
#: ``packed_modules_mapping`` is added to these).
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
#: Stacked expert parameters (``w13_<suffix>``, ``w2_<suffix>``) and the per-expert modules they hold.
STACKED = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}

_EXPERT = re.compile(r"^(.*\.experts)\.(w13|w2)_(.+)$")


def _apply(rules, name: str) -> str:
    for pattern, repl in rules:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def to_vllm(output: str) -> str:
    """The vLLM 0.33 parameter name of a weightd output."""
    return _apply(TO_VLLM, output)


def to_weightd(param: str) -> str:
    """The weightd output name that serves a vLLM 0.33 parameter."""
    return _apply(TO_WEIGHTD, param)


def checkpoint_sources(param: str, checkpoint: Iterable[str],
                       packed: Optional[Mapping[str, Iterable[str]]] = None) -> list[str]:
    """The checkpoint tensors vLLM's own ``load_weights`` builds parameter `param` from (those that exist).

    ``qkv_proj.weight`` comes from ``q_proj.weight``, ``k_proj.weight`` and
    ``v_proj.weight``; an expert stack ``experts.routed_experts.w13_<s>``
    from every expert's ``gate_proj.<s>`` and ``up_proj.<s>``; any other
    parameter from the tensor of its own name. `packed` adds a model's
    ``packed_modules_mapping``. An empty list: the checkpoint has nothing for it.
    """
    names = checkpoint if isinstance(checkpoint, (set, frozenset, dict)) else set(checkpoint)
    name = to_weightd(param)
    m = _EXPERT.match(name)
    if m:
        base, stack, suffix = m.groups()
        pattern = re.compile(re.escape(base) + r"\.(\d+)\.(" + "|".join(STACKED[stack]) + r")\." +
                             re.escape(suffix) + "$")
        found = [(int(x.group(1)), STACKED[stack].index(x.group(2)), n)
                 for n in names for x in [pattern.match(n)] if x]
        return [n for _, _, n in sorted(found)]
    table = {k: tuple(v) for k, v in PACKED.items()}
    for k, v in (packed or {}).items():
        table[k] = tuple(v)
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in table:
        out = [f"{parent}.{part}.{leaf}" if parent else f"{part}.{leaf}" for part in table[last]]
        return [n for n in out if n in names]
    return [name] if name in names else []
