"""The tiny checkpoints the vLLM plugin is tested with: tests/python/tiny_models.py's, and three variants.

- ``qwen3_moe_qk``: the Qwen3-MoE model with q_norm/k_norm, as the published
  Qwen3-MoE checkpoints have them (vLLM's Qwen3-MoE layer requires them);
- ``qwen3_mqa``: a Qwen3 with one key/value head, so that tp 2 replicates it;
- ``deepseek_v3_bf16``: DeepSeek-V3's layout (q LoRA, so a fused_qkv_a_proj;
  the noaux_tc router with its e_score_correction_bias, two expert groups) in
  BF16, which vLLM builds on a CPU (its FP8 layers need GPU kernels).

    import vllm_models
    path = vllm_models.write(root, "qwen3_moe_qk")
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import tiny_models  # noqa: E402

VARIANTS = {
    "qwen3_moe_qk": dict(tiny_models.MODELS["qwen3_moe"], qk_norm=True),
    "qwen3_mqa": dict(tiny_models.MODELS["qwen3"], kv_heads=1, shards=1),
    "deepseek_v3_bf16": dict(tiny_models.MODELS["deepseek_v3"], fp8=False),
}
for _i, (_name, _m) in enumerate(VARIANTS.items()):
    tiny_models.MODELS.setdefault(_name, _m)
    tiny_models.SEEDS.setdefault(_name, 101 + _i)

#: config.json changes of the variants (tiny_models gives non-FP8 DeepSeeks V2's softmax router).
# Two expert groups, so that vLLM honours round-robin expert placement for it.
CONFIG = {"deepseek_v3_bf16": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1}}

#: What each model is, for the tests: dense or MoE (its routed experts).
EXPERTS = {"qwen3": 0, "qwen3_tied": 0, "qwen2": 0, "llama12": 0, "qwen3_mqa": 0,
           "qwen3_moe_qk": 8, "deepseek_v2": 8, "deepseek_v3": 8, "deepseek_v3_bf16": 8}


def write(root, name):
    """Writes model `name` under root (once); returns its directory."""
    path = os.path.join(root, name)
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        tiny_models.write_model(path, name)
        if name in CONFIG:
            with open(config) as f:
                c = json.load(f)
            c.update(CONFIG[name])
            with open(config, "w") as f:
                json.dump(c, f, indent=2)
    return path
