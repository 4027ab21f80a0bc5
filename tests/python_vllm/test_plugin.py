"""The plugin's options and registration, without vLLM (pure; subprocesses for imports; the interface
check is test_interfaces.py)."""
import json
import os
import subprocess
import sys

import pytest

from weightd_vllm import options

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.abspath(os.path.join(HERE, "..", "..", "client", "python"))


def test_defaults():
    o = options.parse({})
    assert o == options.parse(None) == options.Options()
    assert (o.socket, o.path, o.mode, o.fallback, o.preset, o.keep_resident, o.timeout) == \
        (None, None, "copy", True, "auto", True, None)


def test_every_key():
    o = options.parse({"socket": "/run/w.sock", "path": "/models/x", "mode": "shared", "fallback": False,
                       "preset": "qwen3_moe", "keep_resident": False, "timeout": 30})
    assert (o.socket, o.path, o.mode, o.fallback, o.preset, o.keep_resident, o.timeout) == \
        ("/run/w.sock", "/models/x", "shared", False, "qwen3_moe", False, 30)


@pytest.mark.parametrize("extra,match", [
    ({"sokcet": "/x"}, "unknown .* key.*sokcet"),
    ({"mode": "zero_copy"}, "mode must be one of copy, shared"),
    ({"fallback": "yes"}, "fallback must be bool"),
    ({"fallback": 1}, "fallback must be bool"),
    ({"timeout": True}, "timeout must be"),
    ({"timeout": -1}, "timeout must be positive"),
    ({"socket": 3}, "socket must be str or null"),
    ([("mode", "copy")], "must be a JSON object"),
])
def test_mistakes_name_the_key(extra, match):
    with pytest.raises(ValueError, match=match):
        options.parse(extra)


def test_the_table_is_the_documentation():
    doc = open(os.path.join(HERE, "..", "..", "docs", "vllm.md")).read()
    for k in options.KEYS:
        assert f"`{k.name}`" in doc, k.name


def _run(code, **env):
    e = dict(os.environ, PYTHONPATH=PKG, PYTHONDONTWRITEBYTECODE="1")
    e.update(env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=60)
    assert r.returncode == 0, r.stderr
    return r


def test_importing_and_registering_load_neither_torch_nor_libweightd():
    # WEIGHTD_LIB pointing nowhere: `import weightd` would raise LibraryNotFound.
    r = _run("import sys, json, logging\n"
             "logging.basicConfig(level=logging.INFO)\n"
             "import weightd_vllm, weightd_vllm.core, weightd_vllm.ranks, weightd_vllm.names\n"
             "weightd_vllm.register()\n"
             "weightd_vllm.register()\n"
             "print(json.dumps(sorted(m for m in ('torch', 'weightd', 'vllm') if m in sys.modules)))\n",
             WEIGHTD_LIB="/nonexistent/libweightd.so")
    assert json.loads(r.stdout.strip().splitlines()[-1]) == []
    # Without vLLM, register() logs why instead of raising (vLLM calls it in every process it starts).
    if not _has("vllm"):
        assert r.stderr.count("could not be registered") == 2 and "No module named 'vllm'" in r.stderr


def test_register_never_raises_when_the_loader_cannot_be_imported(tmp_path):
    """A stand-in vllm package (0.32, a registry, nothing else): register() logs why and registers nothing."""
    if _has("torch") or _has("vllm"):
        pytest.skip("the stand-in vLLM is for machines without torch and vLLM")
    fake = tmp_path / "fake"
    (fake / "vllm" / "model_executor" / "model_loader").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("__version__ = '0.32.0'\n")
    (fake / "vllm" / "model_executor" / "__init__.py").write_text("")
    (fake / "vllm" / "model_executor" / "model_loader" / "__init__.py").write_text(
        "REG = {}\n"
        "def register_model_loader(name):\n"
        "    def wrap(cls):\n"
        "        REG[name] = cls\n"
        "        return cls\n"
        "    return wrap\n")
    # loader.py needs torch and vLLM's classes: here, its import fails, and register() says so.
    r = _run("import logging; logging.basicConfig()\n"
             "import weightd_vllm; weightd_vllm.register()\n"
             "from vllm.model_executor.model_loader import REG; print(sorted(REG))\n",
             PYTHONPATH=f"{fake}{os.pathsep}{PKG}")
    assert r.stdout.strip().splitlines()[-1] == "[]"
    assert "could not be registered" in r.stderr and "torch" in r.stderr


def _has(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0
