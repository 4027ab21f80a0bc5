"""weightd.transformers.load_model on the host backend (CPU tensors): skipped without torch and transformers.

The GPU version of these checks, with the cuda backend, is tests/gpu/test_python_gpu.py.
"""
import gc
import json
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import weightd  # noqa: E402
from conftest import leases  # noqa: E402
from weightd.transformers import load_model  # noqa: E402

IDS = [[1, 17, 300, 5, 99, 200, 42, 7]]


def dtype_kwargs():
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.bfloat16}


def tiny_model(tied):
    """A small Qwen3 (Qwen2 where this transformers has no Qwen3), randomly initialised, in BF16."""
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=320, tie_word_embeddings=tied, max_position_embeddings=128)
    if hasattr(transformers, "Qwen3ForCausalLM"):
        cfg, cls = transformers.Qwen3Config(head_dim=16, **kw), transformers.Qwen3ForCausalLM
    else:
        cfg, cls = transformers.Qwen2Config(**kw), transformers.Qwen2ForCausalLM
    torch.manual_seed(1)
    return cls(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def saved(request, model_root):
    path = os.path.join(model_root, f"py-transformers-{request.param}")
    tiny_model(request.param).save_pretrained(path, max_shard_size="40KB", safe_serialization=True)
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) >= 3
    return path, request.param


def logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits


def test_load_model_matches_from_pretrained(client, daemon, saved):
    path, tied = saved
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs()).eval()
    model = load_model(path, client=client)
    assert isinstance(model, transformers.PreTrainedModel) and not model.training
    assert torch.equal(logits(ref), logits(model))
    emb = model.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is emb) == tied
    assert leases(daemon) == 1
    with client.attach(path, tensor_type="torch") as s:  # the same set: the parameters are its memory
        for name, p in model.named_parameters():
            assert s.base <= p.data_ptr() < s.base + s.nbytes, name
            assert not p.requires_grad and p.device.type == "cpu"
    del model, emb, p  # p: the loop's last parameter, which holds the set too
    gc.collect()
    assert leases(daemon) == 0


def test_copy_gives_the_model_its_own_memory(client, daemon, saved):
    path, _ = saved
    model = load_model(path, socket=daemon.socket, copy=True)
    assert leases(daemon) == 0  # the set was released before load_model returned
    with client.attach(path) as s:
        for p in model.parameters():
            assert not (s.base <= p.data_ptr() < s.base + s.nbytes)
            assert p.requires_grad
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, **dtype_kwargs()).eval()
    assert torch.equal(logits(ref), logits(model))
    with torch.no_grad():
        next(model.parameters()).add_(1)  # its own memory may be written


def test_a_set_that_does_not_fit_the_model(client, saved, tiny):
    path, _ = saved
    cfg = transformers.AutoConfig.from_pretrained(path)
    with pytest.raises(weightd.BadPlanError, match="missing from the set"):
        load_model(tiny["a"], client=client, config=cfg)
