"""Which vLLM this plugin is written against, and the check that refuses any other.

The plugin uses these interfaces of vLLM 0.33 (read from its source, not copied):

- ``vllm.model_executor.model_loader.register_model_loader`` and
  ``get_model_loader`` (vllm/model_executor/model_loader/__init__.py): the
  registry that ``--load-format`` names are looked up in;
- ``BaseModelLoader`` (model_loader/base_loader.py): ``__init__(load_config)``,
  the abstract ``download_model(model_config)`` and
  ``load_weights(model, model_config)``, ``load_model(vllm_config,
  model_config, prefix)`` (build, ``load_weights``, then
  ``process_weights_after_loading``), and
  ``get_external_weight_memory(vllm_config)``, which the GPU worker
  (vllm/v1/worker/gpu_worker.py) calls before its memory snapshot;
- ``DefaultModelLoader`` (model_loader/default_loader.py): the fallback, its
  ``load_weights`` and ``get_all_weights(model_config, model)`` iterator;
- ``LoadConfig.model_loader_extra_config`` (vllm/config/load.py), the
  ``--model-loader-extra-config`` JSON;
- the parallel state (vllm/distributed/parallel_state.py):
  ``get_tensor_model_parallel_world_size/rank``, ``get_pp_group``,
  ``get_dp_group``, ``get_pcp_group``, and ``ParallelConfig``'s
  ``enable_expert_parallel``, ``enable_eplb``, ``expert_placement_strategy``;
  the MoE layout rules of ``FusedMoEParallelConfig.make`` and
  ``determine_expert_map`` (model_executor/layers/fused_moe/);
- a model's ``named_parameters()``, ``load_weights(iterable of (name,
  tensor))`` and ``packed_modules_mapping``, and the parameter names of
  vLLM 0.33's layers (``qkv_proj``, ``gate_up_proj``,
  ``experts.routed_experts.w13_weight`` ...: see names.py);
- the plugin entry point group ``vllm.general_plugins`` (vllm/plugins/__init__.py).

Any other minor version is refused with :func:`problem`'s message unless
``WEIGHTD_VLLM_ANY_VERSION=1`` is set (then a warning is logged instead).
"""
from __future__ import annotations

import os
import re
from typing import Optional

#: The vLLM release series this plugin is written and tested against.
TARGET = (0, 33)
TARGET_TEXT = "0.33"
OVERRIDE_ENV = "WEIGHTD_VLLM_ANY_VERSION"


def parse(version: str) -> Optional[tuple[int, int]]:
    """(major, minor) of a version string such as "0.33.0", "0.33.1rc1" or "0.33.0+cu130"; None if unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def problem(version: str) -> Optional[str]:
    """None when `version` is in the targeted series, else the message that says why it is refused."""
    if parse(version) == TARGET:
        return None
    return (f"weightd's vLLM loader (--load-format weightd) is written against vLLM {TARGET_TEXT}.x, and this is "
            f"vLLM {version or 'of unknown version'}: the loader interface it relies on (BaseModelLoader, "
            f"get_external_weight_memory, the parameter names of fused and expert layers) differs between "
            f"releases. Install vllm=={TARGET_TEXT}.* or a weightd written for this vLLM; "
            f"{OVERRIDE_ENV}=1 tries anyway (unsupported).")


def override() -> bool:
    """True when the user asked to run against an untested vLLM version."""
    return os.environ.get(OVERRIDE_ENV, "") not in ("", "0")
