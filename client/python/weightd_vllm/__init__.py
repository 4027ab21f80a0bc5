"""weightd as a vLLM load format: ``vllm serve MODEL --load-format weightd``.

vLLM finds this plugin through the ``vllm.general_plugins`` entry point
(``weightd = "weightd_vllm:register"``, declared by the weightd
distribution) and calls :func:`register` in every process it starts;
``register`` adds the ``weightd`` load format to vLLM's loader registry.

This is a top-level package of its own, not ``weightd.vllm``: importing it
(and registering) neither imports torch nor loads libweightd, so a node
without the library still starts vLLM, and ``--load-format weightd`` then
falls back to vLLM's default loader with one warning that says why.

Written against vLLM 0.33 (compat.py lists the interfaces used); the pure
parts (ranks.py, names.py, options.py, checkpoint.py, core.py) import
neither vLLM nor torch. docs/vllm.md is the user's guide.
"""
from __future__ import annotations

import logging

from . import compat

__all__ = ["register", "LOAD_FORMAT"]

LOAD_FORMAT = "weightd"

log = logging.getLogger("vllm.weightd")
_registered = False


def register() -> None:
    """Registers the ``weightd`` load format with vLLM (idempotent; never raises).

    On a vLLM outside the targeted series the registered loader refuses at
    construction with a message naming both versions, unless
    ``WEIGHTD_VLLM_ANY_VERSION=1``. An exception here would stop every vLLM
    start on the machine, even those not using weightd, so failures are
    logged instead.
    """
    global _registered
    if _registered:
        return
    try:
        import vllm
        from vllm.model_executor.model_loader import register_model_loader

        why = compat.problem(getattr(vllm, "__version__", ""))
        if why and not compat.override():
            from .loader import RefusingModelLoader as cls
        else:
            if why:
                log.warning("%s (%s=1: trying anyway)", why, compat.OVERRIDE_ENV)
            from .loader import WeightdModelLoader as cls
        register_model_loader(LOAD_FORMAT)(cls)
        _registered = True
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.error("weightd: the vLLM load format could not be registered: %s: %s", type(e).__name__, e)
