#!/usr/bin/env python3
"""One vLLM rank on the CPU, for tests/vllm: loads each case's model twice and compares the parameters.

    python vllm_worker.py SPEC.json RANK OUT.json

SPEC: {"world_size": N, "port": P, "cases": [case, ...]}; each case is
{"name", "model" (a checkpoint directory), "ep" (bool), "placement",
"extra" (the --model-loader-extra-config object), "hide" (a regex: set
outputs hidden from the loader, so those parameters take tier 2),
"nosources" (a regex: parameters whose checkpoint sources are hidden too, so
they take tier 3), "expect_error" (bool), "stub_fp8_kernels" (bool: see
below)}.

For each case the worker joins an N-rank gloo group (vLLM's CPU platform,
VLLM_TARGET_DEVICE=cpu), initialises vLLM's model-parallel groups under the
case's VllmConfig, builds the model class twice, fills one with vLLM's
DefaultModelLoader (``load_format="auto"``) and the other with the loader
``get_model_loader`` returns for ``load_format="weightd"`` (found through
the plugin's entry point), and compares every parameter byte for byte.
``process_weights_after_loading`` is not run: on this CUDA build it needs
vLLM's compiled CPU kernels (vllm._C), which the wheel does not carry.

FP8 layers cannot even be built on a CPU: their constructors pick a GEMM
kernel (``init_fp8_linear_kernel``, ``select_fp8_moe_backend``) and none
exists here. With "stub_fp8_kernels" those two choices return placeholders;
everything the load touches (the parameters, their shapes and dtypes,
their weight loaders) is vLLM's own. Nothing is ever run through the stubs.

OUT gets {"checks": {...}, "cases": {name: {...}}}.
"""
import json
import os
import re
import sys
import time
import traceback

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(REPO, "client", "python"))

import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.config import (DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig,  # noqa: E402
                         set_current_vllm_config)
from vllm.distributed.parallel_state import (destroy_model_parallel, init_distributed_environment,  # noqa: E402
                                             initialize_model_parallel)
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()  # what every vLLM process does: the entry point registers "weightd"

from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402

from weightd_vllm import core, names  # noqa: E402
from weightd_vllm.loader import dtype_name  # noqa: E402


def raw(t):
    """The bytes of a tensor as an integer tensor of its element width (NaN patterns compare equal)."""
    t = t.detach().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def build(loader, vllm_config, model_config):
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        return loader.create_model(vllm_config=vllm_config, model_config=model_config)


def checks(spec):
    """The plugin as vLLM finds it: entry point, registry, the CLI flags."""
    from importlib.metadata import entry_points

    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    extra = {"socket": "/nonexistent/weightd.sock", "mode": "copy"}
    args = parser.parse_args(["--model", spec["cases"][0]["model"], "--load-format", "weightd",
                              "--model-loader-extra-config", json.dumps(extra)])
    lc = EngineArgs.from_cli_args(args).create_load_config()
    from weightd_vllm import compat

    a = compat.assessment()  # the check register() ran over this vLLM (live objects and installed files)
    return {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
            "interface_problems": [str(p) for p in a.problems], "interface_warning": a.warning,
            "entry_point": eps.get("weightd"),
            "registry": type(get_model_loader(LoadConfig(load_format="weightd"))).__name__,
            "cli_load_format": lc.load_format, "cli_extra": lc.model_loader_extra_config,
            "cli_loader": type(get_model_loader(lc)).__name__}


def run_case(case, world, rank):
    mc = ModelConfig(model=case["model"], tokenizer=case["model"], skip_tokenizer_init=True, dtype="bfloat16",
                     enforce_eager=True)

    def config(load_config):
        pc = ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=case.get("ep", False),
                            expert_placement_strategy=case.get("placement", "linear"))
        return VllmConfig(model_config=mc, parallel_config=pc, load_config=load_config,
                          device_config=DeviceConfig(device="cpu"))

    ref_cfg = config(LoadConfig(load_format="auto"))
    wd_cfg = config(LoadConfig(load_format="weightd", model_loader_extra_config=case.get("extra", {})))
    with set_current_vllm_config(wd_cfg):
        destroy_model_parallel()
        initialize_model_parallel(world, 1)
        ref_loader, wd_loader = get_model_loader(ref_cfg.load_config), get_model_loader(wd_cfg.load_config)
        ref = build(ref_loader, ref_cfg, mc)
        with set_current_vllm_config(ref_cfg):
            ref_loader.load_weights(ref, mc)
        model = build(wd_loader, wd_cfg, mc)
        moe = {}
        for n, mod in model.named_modules():
            em = getattr(mod, "expert_map_manager", None)
            if em is not None:
                pcfg = mod.moe_config.moe_parallel_config
                emap = getattr(em, "_expert_map", None)
                moe = {"tp_size": pcfg.tp_size, "tp_rank": pcfg.tp_rank, "ep_size": pcfg.ep_size,
                       "ep_rank": pcfg.ep_rank, "local_experts": sorted(int(i) for i in range(len(emap)) if emap[i] >= 0)
                       if emap is not None else None}
                break
        error = None
        t0 = time.monotonic()
        try:
            wd_loader._vllm_config = wd_cfg
            wd_loader.load_weights(model, mc)
        except Exception as e:  # noqa: BLE001 - reported to the test
            error = f"{type(e).__name__}: {e}"
        seconds = time.monotonic() - t0
    ref_params = dict(ref.named_parameters())
    got = dict(model.named_parameters())
    differ = sorted(n for n in ref_params if n not in got or got[n].shape != ref_params[n].shape
                    or got[n].dtype != ref_params[n].dtype or not torch.equal(raw(got[n]), raw(ref_params[n])))
    r = wd_loader.report
    return {
        "params": {n: [list(p.shape), dtype_name(p.dtype)] for n, p in ref_params.items()},
        "extra_params": sorted(set(got) - set(ref_params)),
        "differ": differ,
        "error": error,
        "moe": moe,
        "seconds": seconds,
        "report": None if r is None else {
            "plan": r.plan, "set_id": r.set_id, "copied": r.copied, "shared": r.shared, "via_load_weights": r.via_load_weights,
            "via_default": r.via_default, "exempt": r.exempt, "unused_outputs": r.unused_outputs,
            "warnings": r.warnings, "fallback_reason": r.fallback_reason,
            "bytes_copied": r.bytes_copied, "bytes_shared": r.bytes_shared},
        "shared_in_set": _shared_in_set(model, r),
    }


def _mapping(ptr):
    """The pathname of the mapping of this process that holds address ptr ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return None


def _shared_in_set(model, report):
    """For shared parameters: the mapping their memory is in (the daemon's memfd when shared)."""
    if report is None or not report.shared:
        return {}
    return {n: _mapping(p.data_ptr()) for n, p in model.named_parameters() if n in report.shared}


def _stub_fp8_kernels():
    """Lets vLLM build its FP8 layers on a CPU (kernel choices only; see the module docstring)."""
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

    saved = fp8.init_fp8_linear_kernel, fp8.select_fp8_moe_backend
    fp8.init_fp8_linear_kernel = lambda **kw: object()
    fp8.select_fp8_moe_backend = lambda **kw: (next(iter(Fp8MoeBackend)), None)

    def undo():
        fp8.init_fp8_linear_kernel, fp8.select_fp8_moe_backend = saved
    return undo


def patch(case):
    """Applies the case's hide / nosources regexes to the plugin's decisions (this process only)."""
    hide, nosrc = case.get("hide"), case.get("nosources")
    orig_assign, orig_sources = core.assign, names.checkpoint_sources
    undo_fp8 = _stub_fp8_kernels() if case.get("stub_fp8_kernels") else (lambda: None)
    if hide:
        core.assign = lambda params, outputs, to_output=names.to_weightd: orig_assign(
            params, {k: v for k, v in outputs.items() if not re.search(hide, k)}, to_output)
    if nosrc:
        names.checkpoint_sources = lambda p, ck, packed=None: (
            [] if re.search(nosrc, p) else orig_sources(p, ck, packed))

    def undo():
        core.assign, names.checkpoint_sources = orig_assign, orig_sources
        undo_fp8()
    return undo


def main(spec_path, rank, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    world = spec["world_size"]
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{spec['port']}", backend="gloo")
    out = {"checks": checks(spec) if rank == 0 else {}, "cases": {}}
    for case in spec["cases"]:
        undo = patch(case)
        try:
            out["cases"][case["name"]] = run_case(case, world, rank)
        except Exception:  # noqa: BLE001 - the traceback goes to the test
            out["cases"][case["name"]] = {"crash": traceback.format_exc()}
        finally:
            undo()
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
