"""``--load-format weightd``: a vLLM model loader over weightd (the glue; core.py decides).

Each worker builds its model as vLLM does (``BaseModelLoader.load_model``),
then :meth:`WeightdModelLoader.load_weights` asks weightd for this rank's
plan (its TP/EP ranks from vLLM's parallel state, its GPU by UUID), attaches
the set, copies the tensors into the parameters device to device, and hands
back to ``load_model``, which runs vLLM's ``process_weights_after_loading``
(quantisation repacking and the like) as after any load. What weightd cannot
serve goes through the model's own ``load_weights`` from weightd's tensors,
then through vLLM's default loader (core.py).

Before the worker's memory snapshot, vLLM asks
:meth:`get_external_weight_memory`; the loader loads the rank's set there
(so it is resident before the snapshot) and answers with the bytes the
daemon holds on this GPU, which vLLM then leaves out of its own budget.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from vllm.config import LoadConfig, ModelConfig, VllmConfig, get_current_vllm_config, replace
from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from . import checkpoint, compat, core, options, ranks
from .core import Spec

logger = init_logger("vllm.weightd")

#: Architectures whose parameters were compared, tensor by tensor, with what
#: vLLM 0.33's DefaultModelLoader fills from the same checkpoint (tests/vllm).
#: Any other architecture is loaded by the default loader, with one warning.
VERIFIED_ARCHITECTURES = frozenset({
    "Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
})

#: Quantisation methods whose process_weights_after_loading, in vLLM 0.33 on
#: CUDA, neither writes into the weight nor keeps it (UnquantizedLinearMethod
#: does nothing there; UnquantizedEmbeddingMethod acts on CPU only). In
#: ``shared`` mode only parameters of these modules (and of modules without a
#: quantisation method or post-processing hook, such as RMSNorm) stay the
#: daemon's memory; the rest are copied.
SHAREABLE_METHODS = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})

_dtype_names: Optional[dict] = None


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (the binding's table), or its text for others."""
    global _dtype_names
    if _dtype_names is None:
        try:
            from weightd._wrap import DTYPES
        except ImportError:
            return str(dtype)
        _dtype_names = {getattr(torch, attr): name for name, (_, _, attr) in DTYPES.items()
                        if hasattr(torch, attr)}
    return _dtype_names.get(dtype, str(dtype))


def placed_experts(model: nn.Module) -> Optional[list[int]]:
    """The global ids of the experts vLLM placed on this rank, in local order (its first MoE layer).

    None for a model without MoE layers. vLLM 0.33's ``RoutedExperts`` keeps
    an ``expert_map_manager`` whose ``expert_map`` maps global to local ids
    (None without expert parallelism: every expert is local).
    """
    for module in model.modules():
        manager = getattr(module, "expert_map_manager", None)
        if manager is None:
            continue
        emap = manager.expert_map
        if emap is None:
            return list(range(int(manager.global_num_experts)))
        local = [(int(l), g) for g, l in enumerate(emap.tolist()) if l >= 0]
        return [g for _, g in sorted(local)]
    return None


class VllmTarget:
    """A vLLM model as core.Target: its parameters, its load_weights, vLLM's default loader."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, default_loader: Any):
        self.model = model
        self.model_config = model_config
        self.default_loader = default_loader
        self._params = dict(model.named_parameters())  # tied parameters appear once
        self._owner = {}
        for mname, module in model.named_modules():
            for pname, _ in module.named_parameters(recurse=False):
                self._owner[f"{mname}.{pname}" if mname else pname] = module

    def params(self) -> dict[str, Spec]:
        return {n: Spec(tuple(p.shape), dtype_name(p.dtype)) for n, p in self._params.items()}

    def copy(self, name: str, src: Any) -> None:
        with torch.no_grad():
            self._params[name].data.copy_(src, non_blocking=True)

    def share(self, name: str, src: Any) -> bool:
        p, module = self._params[name], self._owner.get(name)
        if src.device != p.device or src.dtype != p.dtype:
            return False
        method = getattr(module, "quant_method", None)
        if method is None:
            if hasattr(module, "process_weights_after_loading"):
                return False
        elif type(method).__name__ not in SHAREABLE_METHODS:
            return False
        p.data = src
        return True

    def exempt(self, name: str) -> bool:
        from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

        return isinstance(getattr(self._owner.get(name), "quant_method", None), BaseKVCacheMethod)

    def packed(self) -> dict:
        return dict(getattr(self.model, "packed_modules_mapping", None) or {})

    def load_weights(self, weights: Any) -> Optional[set]:
        loaded = self.model.load_weights(weights)
        return set(loaded) if loaded is not None else None

    def default_weights(self) -> Iterator[tuple[str, Any]]:
        return self.default_loader.get_all_weights(self.model_config, self.model)

    def default_load(self) -> None:
        self.default_loader.load_weights(self.model, self.model_config)

    def sync(self) -> None:
        if any(p.is_cuda for p in self._params.values()):
            torch.cuda.synchronize()


class WeightdModelLoader(BaseModelLoader):
    """The model loader registered as ``weightd`` (``vllm serve MODEL --load-format weightd``)."""

    def __init__(self, load_config: LoadConfig):
        compat.require(warn=logger.warning)  # refuses a vLLM whose interfaces changed, naming them
        super().__init__(load_config)
        self.options = options.parse(load_config.model_loader_extra_config)
        self.report: Optional[core.Report] = None
        self._vllm_config: Optional[VllmConfig] = None

    # ---- helpers ----------------------------------------------------------------------

    def _default_loader(self) -> DefaultModelLoader:
        return DefaultModelLoader(replace(self.load_config, load_format="auto", model_loader_extra_config={}))

    def _client(self) -> Any:
        import weightd

        return weightd.Client(self.options.socket, timeout=self.options.timeout)

    def _path(self, model_config: ModelConfig) -> str:
        path = self.options.path or model_config.model
        if checkpoint.is_url(path):  # the daemon fetches it from its remote roots
            return path
        if not os.path.isdir(path):
            raise ranks.Unservable(f"{path!r} is not a local directory: the daemon reads checkpoints from its "
                                   f"model roots (set the checkpoint's directory with the extra-config key path)")
        return path

    def _plan(self, vllm_config: VllmConfig, model_config: ModelConfig, model: Optional[nn.Module] = None) -> dict:
        """This rank's plan; with the built model, also checked against the experts vLLM placed here."""
        archs = list(getattr(model_config, "architectures", None) or [])
        if not any(a in VERIFIED_ARCHITECTURES for a in archs):
            raise ranks.Unservable(f"architecture {', '.join(archs) or '(none)'} is not one whose parameters were "
                                   f"checked against vLLM's own loader "
                                   f"({', '.join(sorted(VERIFIED_ARCHITECTURES))})")
        config = model_config.hf_config.to_dict()
        experts = ranks.num_experts(config)
        plan = ranks.plan_for(ranks.from_vllm(vllm_config), num_experts=experts,
                              expert_groups=ranks.expert_groups(config), preset=self.options.preset)
        placed = placed_experts(model) if model is not None else None
        if placed is not None:
            want = ranks.plan_experts(plan, experts)
            if placed != (want if want is not None else list(range(experts))):
                raise ranks.Unservable(f"vLLM placed experts {placed} on this rank, the plan {plan} gives "
                                       f"{want if want is not None else 'all'}")
        return plan

    @staticmethod
    def _device(client: Any, params_device: torch.device) -> Any:
        """The device= of this rank's load: its GPU (sent by UUID), or the host daemon's default."""
        if client.backend == "cuda":
            if params_device.type != "cuda":
                raise ranks.Unservable(f"the daemon loads into GPU memory and this vLLM's parameters are on "
                                       f"{params_device}")
            return client.device_arg(params_device)
        return None  # a host set: copied host to the parameters' device

    # ---- BaseModelLoader ----------------------------------------------------------------

    def download_model(self, model_config: ModelConfig) -> None:
        self._default_loader().download_model(model_config)

    def get_external_weight_memory(self, vllm_config: VllmConfig) -> int:
        """Loads this rank's set now, before the GPU worker's memory snapshot; returns the daemon's bytes here.

        The daemon's memory on this GPU (this set, and sets prewarmed for
        another role) is outside vLLM's allocator: vLLM subtracts it from its
        ``--gpu-memory-utilization`` budget. 0 when weightd cannot serve
        (load_weights then falls back and says why).
        """
        if not torch.cuda.is_available():
            return 0
        try:
            model_config = vllm_config.model_config
            path, plan = self._path(model_config), self._plan(vllm_config, model_config)
            with self._client() as c:
                if c.backend != "cuda":
                    return 0
                dev = c.device_arg(torch.device("cuda", torch.cuda.current_device()))
                if self.options.mode == "shared" or self.options.keep_resident:
                    c.load(path, device=dev, plan=plan)
                used = [d.get("used", 0) for d in c.status()["devices"] if d.get("uuid") == dev]
                return int(used[0]) if used else 0
        except core.fallback_errors() as e:
            logger.info("weightd: no external weight memory reported (%s)", e)
            return 0

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        self._vllm_config = vllm_config
        return super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        vllm_config = self._vllm_config or get_current_vllm_config()
        target = VllmTarget(model, model_config, self._default_loader())
        opts = self.options

        def serve_rank() -> core.Report:
            path, plan = self._path(model_config), self._plan(vllm_config, model_config, model)
            client = self._client()
            try:
                device = self._device(client, next(model.parameters()).device)
                return core.serve(target, client, path, plan, device=device, mode=opts.mode,
                                  fallback=opts.fallback, keep_resident=opts.keep_resident, tensor_type="torch",
                                  warn=logger.warning)
            finally:
                client.close()  # deferred while shared parameters hold the set

        self.report = core.load(target, serve_rank, fallback=opts.fallback, warn=logger.warning)
        logger.info("%s", self.report.summary())
