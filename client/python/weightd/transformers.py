"""A transformers model whose parameters are the daemon's memory: ``load_model(path)``.

    from weightd.transformers import load_model
    model = load_model("/models/qwen3-4b", device=0)     # zero-copy, GPU memory of the daemon
    logits = model(input_ids).logits

The model is built from config.json alone: the checkpoint's files are never
read here (the daemon has them), and no parameter memory is kept or
initialised: parameters are put on the meta device, then replaced by
the set's tensors (:func:`empty_parameters`). Buffers (rotary tables) are
computed as the model's own constructor does and moved to the set's device. It serves architectures
whose checkpoint tensors map 1:1 to parameter names; tied output embeddings
are tied to the input embeddings, as ``from_pretrained`` does.

Parameters are shared with every other process attached to the set and
must not be written: they have ``requires_grad=False``. ``copy=True`` gives
the model its own memory instead (one device-to-device copy per tensor),
with ``requires_grad=True``, and releases the set before returning.
"""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator, Optional

from .client import Client, Device
from .errors import by_name
from .progress import Progress

__all__ = ["load_model", "empty_parameters"]

log = logging.getLogger("weightd")


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Modules built inside keep their parameters on the meta device; buffers stay real.

    Each parameter is moved to meta as it is registered, before any
    initialisation runs on it (initialising a meta tensor does nothing), so
    the only memory a parameter ever had is its constructor's uninitialised
    ``torch.empty``, freed at once. Buffers (rotary tables) are computed as
    the constructors compute them. It patches
    ``torch.nn.Module.register_parameter`` while it lasts (as accelerate's
    ``init_empty_weights`` does): build nothing in other threads meanwhile.
    """
    import torch

    register = torch.nn.Module.register_parameter

    def to_meta(module: Any, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _build(config: Any, model_class: Any, dtype: Any) -> Any:
    """The model for config, parameters on meta, built under the default dtype `dtype`."""
    import torch

    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    old = torch.get_default_dtype()
    if dtype is not None and dtype.is_floating_point:
        torch.set_default_dtype(dtype)
    try:
        with empty_parameters(), _no_init_weights():
            if hasattr(model_class, "from_config"):
                model = model_class.from_config(config)
            else:
                model = model_class(config)
    finally:
        torch.set_default_dtype(old)
    return model


def _no_init_weights() -> Any:
    """transformers' switch that skips weight initialisation, where this version has one."""
    try:
        from transformers.modeling_utils import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _floating_dtype(s: Any) -> Any:
    """The dtype the model is built in: the input embedding's, else the first floating tensor's."""
    from ._wrap import torch_dtype

    infos = s.infos()
    embeds = [i for i in infos if "embed_tokens" in i.name]
    for info in embeds + infos:
        dt = torch_dtype(info.dtype)
        if dt and dt.is_floating_point:
            return dt
    return None


def _tied(model: Any, config: Any) -> Optional[tuple[Any, Any]]:
    """(output embeddings module, input embeddings module) when the config ties them."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False):
        return None
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None:
        return None
    return out, inp


def _assign(model: Any, s: Any, copy: bool, device: Any) -> None:
    """Replaces every parameter by the set's tensor of the same name; moves buffers to device."""
    import torch

    tied = _tied(model, model.config)
    missing, wrong = [], []
    used = set()
    for mname, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None:
                continue
            full = f"{mname}.{pname}" if mname else pname
            if tied is not None and module is tied[0] and pname == "weight":
                continue  # tied below
            try:
                t = s[full]
            except KeyError:
                missing.append(full)
                continue
            used.add(full)
            if tuple(t.shape) != tuple(param.shape):
                wrong.append(f"{full}: the set has {tuple(t.shape)}, the model wants {tuple(param.shape)}")
                continue
            if copy:
                t = t.clone()
            module._parameters[pname] = torch.nn.Parameter(t, requires_grad=copy)
        for bname, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[bname] = buf.to(device)
    if tied is not None:
        tied[0].weight = tied[1].weight
    if missing or wrong:
        problems = [f"missing from the set: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"] \
            if missing else []
        problems += wrong[:8]
        raise by_name["BAD_PLAN"]("the set does not fit the model: " + "; ".join(problems))
    unused = len(s) - len(used)
    if unused:
        log.info("weightd: %d tensors of set %s are not parameters of the model", unused, s.id)


def load_model(path: str | os.PathLike, *, client: Optional[Client] = None, socket: Optional[str] = None,
               device: Device = None, copy: bool = False, model_class: Any = None, config: Any = None,
               progress: Progress = None, **plan: Any) -> Any:
    """A transformers ``PreTrainedModel`` for the checkpoint at `path`, weights from weightd.

    client / socket: the connection to use (default: a new Client on
    `socket`; the connection stays open while the model's parameters do).
    device, progress and the plan arguments are those of
    :meth:`weightd.Client.attach`. model_class: the class to build
    (default ``AutoModelForCausalLM``); config: a config to use instead of
    reading ``path/config.json``. copy: give the model its own memory.

    The model is in eval mode; its parameter dtypes are the checkpoint's.
    Raises BadPlanError when the set's tensors do not match the model's
    parameters (names or shapes).
    """
    from transformers import AutoConfig, GenerationConfig

    if config is None:
        config = AutoConfig.from_pretrained(os.fspath(path))
    own = client is None
    c = Client(socket) if own else client
    try:
        s = c.attach(path, device=device, progress=progress, tensor_type="torch", **plan)
    finally:
        if own:
            c.close()  # the connection lives on while the set's tensors do
    with s:
        model = _build(config, model_class, _floating_dtype(s))
        _assign(model, s, copy, s.torch_device)
    with contextlib.suppress(OSError, ValueError):
        model.generation_config = GenerationConfig.from_pretrained(os.fspath(path))
    model.eval()
    return model
