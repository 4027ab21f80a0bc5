"""Tiny checkpoints with the published families' tensor names and dtypes.

Each model keeps the real checkpoints' names, dtypes and shape rules (a
Qwen3, Qwen2 and Llama dense model, a Qwen3-MoE, a DeepSeek-V3 with FP8
block-quantized linears) at widths small enough that a whole matrix of
tensor-parallel ranks loads in seconds. Bytes are seeded random numbers;
shards are written by the reference package (`stref.serialize`), with a
model.safetensors.index.json when a model has more than one shard.

    python3 tiny_models.py OUTDIR      writes every model under OUTDIR/NAME
"""
import json
import math
import os
import sys

import numpy as np

import stref

FP8_BLOCK = 128

# name -> what the model is. `layers` decoder layers; `shards` files.
MODELS = {
    # Qwen3-0.6B's head layout (16 query heads, 8 kv heads), narrow. vocab
    # 1000 is not a multiple of 64: the embedding is padded.
    "qwen3": dict(family="dense", model_type="qwen3", hidden=256, heads=16, kv_heads=8, head_dim=16,
                  inter=512, vocab=1000, layers=2, tied=False, qk_norm=True, bias=False, shards=3),
    "qwen3_tied": dict(family="dense", model_type="qwen3", hidden=256, heads=16, kv_heads=8, head_dim=16,
                       inter=512, vocab=1000, layers=2, tied=True, qk_norm=True, bias=False, shards=1),
    # Qwen2: q/k/v biases, no q_norm/k_norm; 4 kv heads, so tp 8 and 16
    # replicate them.
    "qwen2": dict(family="dense", model_type="qwen2", hidden=256, heads=16, kv_heads=4, head_dim=16,
                  inter=512, vocab=1000, layers=2, tied=False, qk_norm=False, bias=True, shards=1),
    # Llama with 12 query and 4 kv heads: tp 12 replicates kv heads three
    # ways; tp 3 and 6 divide the query heads but not the kv heads. vocab 960
    # is already a multiple of 64.
    "llama12": dict(family="dense", model_type="llama", hidden=192, heads=12, kv_heads=4, head_dim=16,
                    inter=384, vocab=960, layers=1, tied=False, qk_norm=False, bias=False, shards=1),
    "qwen3_moe": dict(family="qwen3_moe", model_type="qwen3_moe", hidden=256, heads=8, kv_heads=4,
                      head_dim=32, inter=512, moe_inter=128, experts=8, vocab=1000, layers=2,
                      tied=False, shards=2),
    "deepseek_v3": dict(family="deepseek_v3", model_type="deepseek_v3", hidden=512, heads=8,
                        q_lora_rank=256, kv_lora_rank=128, qk_nope=64, qk_rope=32, v_head=64,
                        first_k_dense=1, inter=1024, moe_inter=256, experts=8, shared=1, vocab=1000,
                        layers=2, tied=False, fp8=True, shards=2),
    # DeepSeek-V2-Lite's shape: no q LoRA (q_proj is column-parallel, nothing
    # to fuse into fused_qkv_a_proj), BF16, two shared experts; tp 8 divides.
    "deepseek_v2": dict(family="deepseek_v3", model_type="deepseek_v2", hidden=256, heads=8,
                        q_lora_rank=None, kv_lora_rank=128, qk_nope=32, qk_rope=16, v_head=32,
                        first_k_dense=1, inter=512, moe_inter=64, experts=8, shared=2, vocab=1000,
                        layers=2, tied=False, fp8=False, shards=1),
}

SEEDS = {name: 11 + i for i, name in enumerate(MODELS)}


# ---- layouts ------------------------------------------------------------------


def _linear(out, name, rows, cols, fp8):
    """A linear layer's weight (and its block scale when fp8)."""
    if fp8:
        out.append((name + ".weight", "F8_E4M3", [rows, cols]))
        out.append((name + ".weight_scale_inv", "F32",
                    [math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK)]))
    else:
        out.append((name + ".weight", "BF16", [rows, cols]))


def _mlp(out, prefix, hidden, inter, fp8=False):
    _linear(out, prefix + ".gate_proj", inter, hidden, fp8)
    _linear(out, prefix + ".up_proj", inter, hidden, fp8)
    _linear(out, prefix + ".down_proj", hidden, inter, fp8)


def _gqa_attention(out, p, m):
    q, kv, h = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"]
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((f"{p}.self_attn.{proj}.weight", "BF16", [rows, h]))
        if m.get("bias"):
            out.append((f"{p}.self_attn.{proj}.bias", "BF16", [rows]))
    out.append((f"{p}.self_attn.o_proj.weight", "BF16", [h, q]))
    if m.get("qk_norm"):
        out.append((f"{p}.self_attn.q_norm.weight", "BF16", [m["head_dim"]]))
        out.append((f"{p}.self_attn.k_norm.weight", "BF16", [m["head_dim"]]))


def _mla_attention(out, p, m):
    h, nh, fp8 = m["hidden"], m["heads"], m["fp8"]
    qk = m["qk_nope"] + m["qk_rope"]
    if m["q_lora_rank"]:
        _linear(out, f"{p}.self_attn.q_a_proj", m["q_lora_rank"], h, fp8)
        out.append((f"{p}.self_attn.q_a_layernorm.weight", "BF16", [m["q_lora_rank"]]))
        _linear(out, f"{p}.self_attn.q_b_proj", nh * qk, m["q_lora_rank"], fp8)
    else:
        _linear(out, f"{p}.self_attn.q_proj", nh * qk, h, fp8)
    _linear(out, f"{p}.self_attn.kv_a_proj_with_mqa", m["kv_lora_rank"] + m["qk_rope"], h, fp8)
    out.append((f"{p}.self_attn.kv_a_layernorm.weight", "BF16", [m["kv_lora_rank"]]))
    _linear(out, f"{p}.self_attn.kv_b_proj", nh * (m["qk_nope"] + m["v_head"]), m["kv_lora_rank"], fp8)
    _linear(out, f"{p}.self_attn.o_proj", h, nh * m["v_head"], fp8)


def layout(m):
    """[(name, dtype, shape)] in checkpoint order for model description m."""
    out = []
    h = m["hidden"]
    out.append(("model.embed_tokens.weight", "BF16", [m["vocab"], h]))
    for i in range(m["layers"]):
        p = f"model.layers.{i}"
        if m["family"] == "deepseek_v3":
            _mla_attention(out, p, m)
            fp8 = m["fp8"]
            if i < m["first_k_dense"]:
                _mlp(out, p + ".mlp", h, m["inter"], fp8)
            else:
                for e in range(m["experts"]):
                    _mlp(out, f"{p}.mlp.experts.{e}", h, m["moe_inter"], fp8)
                out.append((f"{p}.mlp.gate.weight", "BF16", [m["experts"], h]))
                if m["model_type"] == "deepseek_v3":
                    out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", [m["experts"]]))
                _mlp(out, p + ".mlp.shared_experts", h, m["moe_inter"] * m["shared"], fp8)
        else:
            _gqa_attention(out, p, m)
            if m["family"] == "qwen3_moe":
                out.append((f"{p}.mlp.gate.weight", "BF16", [m["experts"], h]))
                for e in range(m["experts"]):
                    _mlp(out, f"{p}.mlp.experts.{e}", h, m["moe_inter"])
            else:
                _mlp(out, p + ".mlp", h, m["inter"])
        out.append((f"{p}.input_layernorm.weight", "BF16", [h]))
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", [h]))
    out.append(("model.norm.weight", "BF16", [h]))
    if not m["tied"]:
        out.append(("lm_head.weight", "BF16", [m["vocab"], h]))
    return out


def config(m):
    """config.json for model description m (the fields the real ones carry)."""
    c = {"model_type": m["model_type"], "hidden_size": m["hidden"], "num_hidden_layers": m["layers"],
         "num_attention_heads": m["heads"], "vocab_size": m["vocab"],
         "tie_word_embeddings": m["tied"], "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
         "max_position_embeddings": 4096, "hidden_act": "silu"}
    fam = m["family"]
    if fam in ("dense", "qwen3_moe"):
        c.update(num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"], intermediate_size=m["inter"],
                 rope_theta=1000000.0)
        c["architectures"] = [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[m["model_type"]]]
        if m["model_type"] == "qwen2":
            c.pop("head_dim")  # Qwen2 configs derive it from hidden / heads
        if fam == "qwen3_moe":
            c.update(num_experts=m["experts"], moe_intermediate_size=m["moe_inter"], num_experts_per_tok=2,
                     decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    else:
        c.update(architectures=["DeepseekV3ForCausalLM" if m["model_type"] == "deepseek_v3"
                                else "DeepseekV2ForCausalLM"], num_key_value_heads=m["heads"],
                 q_lora_rank=m["q_lora_rank"], kv_lora_rank=m["kv_lora_rank"],
                 qk_nope_head_dim=m["qk_nope"], qk_rope_head_dim=m["qk_rope"], v_head_dim=m["v_head"],
                 first_k_dense_replace=m["first_k_dense"], intermediate_size=m["inter"],
                 moe_intermediate_size=m["moe_inter"], n_routed_experts=m["experts"],
                 n_shared_experts=m["shared"], num_experts_per_tok=2, n_group=1, topk_group=1,
                 moe_layer_freq=1, routed_scaling_factor=2.5, scoring_func="sigmoid",
                 topk_method="noaux_tc", norm_topk_prob=True, rope_theta=10000)
        if m["fp8"]:
            c["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
        else:
            c.update(scoring_func="softmax", topk_method="greedy")
    return c


# ---- bytes --------------------------------------------------------------------


def tensor_data(rng, dtype, shape):
    """Random bytes; F32 tensors get positive finite values (scales, biases)."""
    n = stref.tensor_bytes(dtype, shape)
    if dtype == "F32":
        count = n // 4
        return rng.uniform(1e-4, 1e-1, size=count).astype("<f4").tobytes()
    return rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()


def split_shards(entries, count):
    """entries cut into count runs of about equal bytes, in order."""
    if count <= 1:
        return [entries]
    total = sum(stref.tensor_bytes(d, s) for _, d, s in entries)
    runs, cur, acc = [], [], 0
    for e in entries:
        cur.append(e)
        acc += stref.tensor_bytes(e[1], e[2])
        if len(runs) < count - 1 and acc >= total * (len(runs) + 1) / count:
            runs.append(cur)
            cur = []
    runs.append(cur)
    assert len(runs) == count and all(runs), [len(r) for r in runs]
    return runs


def write_model(path, name, seed=None):
    """Writes model `name` into directory path; returns path."""
    m = MODELS[name]
    seed = SEEDS[name] if seed is None else seed
    rng = np.random.default_rng(seed)
    entries = layout(m)
    os.makedirs(path, exist_ok=True)
    data = {n: (d, s, tensor_data(rng, d, s)) for n, d, s in entries}
    runs = split_shards(entries, m["shards"])
    if len(runs) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(runs):05d}.safetensors" for i in range(len(runs))]
    weight_map = {}
    for fname, run in zip(files, runs):
        buf = stref.serialize({n: data[n] for n, _, _ in run}, {"format": "pt"})
        with open(os.path.join(path, fname), "wb") as f:
            f.write(buf)
        for n, _, _ in run:
            weight_map[n] = fname
    if len(runs) > 1:
        total = sum(len(v[2]) for v in data.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(m), f, indent=2)
    return path


def write_all(root):
    """Every model under root/NAME; returns {name: path}."""
    return {name: write_model(os.path.join(root, name), name) for name in MODELS}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: tiny_models.py OUTDIR")
    for n, p in write_all(sys.argv[1]).items():
        size = sum(os.path.getsize(os.path.join(p, f)) for f in os.listdir(p))
        print(f"{n}: {p} ({size} bytes)")
