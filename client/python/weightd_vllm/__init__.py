"""weightd as a vLLM load format: ``vllm serve MODEL --load-format weightd``.

vLLM finds this plugin through the ``vllm.general_plugins`` entry point
(``weightd = "weightd_vllm:register"``, declared by the weightd
distribution) and calls :func:`register` in every process it starts;
``register`` adds the ``weightd`` load format to vLLM's loader registry.

This is a top-level package of its own, not ``weightd.vllm``: importing it
(and registering) neither imports torch nor loads libweightd, so a node
without the library still starts vLLM, and ``--load-format weightd`` then
falls back to vLLM's default loader with one warning that says why.

Runs on every vLLM whose interfaces it uses are unchanged (interfaces.py
lists them, compat.py decides; tested with 0.33 and 0.34); the pure parts
(ranks.py, names.py, options.py, checkpoint.py, core.py, interfaces.py)
import neither vLLM nor torch. docs/vllm.md is the user's guide.
"""
from __future__ import annotations

import logging

from . import compat

__all__ = ["register", "LOAD_FORMAT"]

LOAD_FORMAT = "weightd"

log = logging.getLogger("vllm.weightd")
_registered = False


def register() -> None:
    """Checks vLLM's interfaces and registers the ``weightd`` load format (idempotent; never raises).

    The check (compat.assessment, interfaces.NEEDS) runs here, once per
    process. On a vLLM whose interfaces changed, the loader refuses at
    construction (``--load-format weightd``) with a message naming each
    changed interface; on an untested release that passes, it runs with one
    warning. When the loader cannot even be imported (a class it derives
    from moved), nothing is registered and the error logged here names what
    changed. An exception here would stop every vLLM start on the machine,
    even those not using weightd, so failures are logged instead.
    """
    global _registered
    if _registered:
        return
    try:
        from vllm.model_executor.model_loader import register_model_loader

        from .loader import WeightdModelLoader
    except Exception as e:  # noqa: BLE001 - see the docstring
        why = ""
        try:
            why = compat.assessment().error or ""
        except Exception:  # noqa: BLE001 - the import error alone is then the message
            pass
        log.error("weightd: the vLLM load format could not be registered: %s: %s%s", type(e).__name__, e,
                  f" ({why})" if why else "")
        return
    try:
        compat.assessment()
    except Exception as e:  # noqa: BLE001 - see the docstring; the loader's construction checks again
        log.error("weightd: vLLM's interfaces could not be checked: %s: %s", type(e).__name__, e)
    register_model_loader(LOAD_FORMAT)(WeightdModelLoader)
    _registered = True
