"""What the Python GPU test and benchmark share: a weightd with the cuda backend, the package, a tiny Qwen3.

The daemon is the integration suite's Daemon (tests/integration/wdfixtures.py)
started with ``--backend cuda``. Binaries come from $WEIGHTD / $WEIGHTCTL,
libweightd from $WEIGHTD_LIB (default: build/).
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))
os.environ.setdefault("WEIGHTD_LIB", os.path.join(REPO, "build", "libweightd.so"))

sys.path.insert(0, os.path.join(REPO, "tests", "integration"))
import wdfixtures as fixtures  # noqa: E402  the integration suite's Daemon

WEIGHTCTL = fixtures.WEIGHTCTL


class CudaDaemon(fixtures.Daemon):
    """A weightd on a private socket with the cuda backend."""

    def argv(self):
        a = super().argv()
        a[a.index("--backend") + 1] = "cuda"
        return a


# ---- fixtures of the GPU test modules (each imports them: from wdgpu import work, daemon, client) ----


@pytest.fixture(scope="module")
def work(request):
    """A private directory with models/ for one test module, removed after it."""
    base = os.environ.get("WD_TEST_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    name = request.module.__name__.rsplit(".", 1)[-1].replace("_", "-")
    d = tempfile.mkdtemp(prefix=f"wd-{name}-", dir=base)
    os.makedirs(os.path.join(d, "models"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def daemon(work):
    """A weightd with the cuda backend serving work/models, stopped (and checked) after the module."""
    d = CudaDaemon(work, os.path.join(work, "models")).start()
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    """A weightd.Client of the module's daemon."""
    import weightd

    with weightd.Client(daemon.socket) as c:
        yield c


def mkcheckpoint(out, preset, seed=1, layers=None):
    """weightctl mkcheckpoint into out, unless it is there already; returns out."""
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cmd = [WEIGHTCTL, "mkcheckpoint", "--preset", preset, "--seed", str(seed), "--out", out]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return out


def save_tiny_qwen3(out, tied, seed=0, max_shard_size="300KB"):
    """A randomly initialised small Qwen3 written by save_pretrained in several shards with an index."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, vocab_size=1024, tie_word_embeddings=tied,
                      max_position_embeddings=512)
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out
