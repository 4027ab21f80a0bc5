"""The keys of ``--model-loader-extra-config`` for ``--load-format weightd``: one table.

    vllm serve /models/qwen3-30b-a3b --load-format weightd \\
        --model-loader-extra-config '{"socket": "/run/weightd/weightd.sock", "mode": "copy"}'

Every key is optional. An unknown key, or a value of the wrong type, is a
ValueError naming the key (a misspelt option is never ignored).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

MODES = ("copy", "shared")


@dataclass(frozen=True)
class Key:
    name: str
    types: tuple
    default: Any
    help: str
    choices: Optional[tuple] = None


#: name, accepted types, default, meaning. docs/vllm.md lists the same table.
KEYS = (
    Key("socket", (str, type(None)), None,
        "the daemon's socket; default: $WEIGHTD_SOCKET alone when set, else /run/weightd/weightd.sock, "
        "then the per-user socket"),
    Key("path", (str, type(None)), None,
        "the checkpoint directory as the daemon sees it; default: vLLM's model path (a local directory)"),
    Key("mode", (str,), "copy",
        "copy: parameters are vLLM's own memory, filled device to device from the set; shared: parameters "
        "whose post-processing leaves them untouched stay the daemon's memory (zero copy)", MODES),
    Key("fallback", (bool,), True,
        "when weightd cannot serve a parameter (or anything), load it with vLLM's default loader and warn "
        "once; false: fail instead"),
    Key("preset", (str,), "auto", "the plan preset: auto (from config.json), dense, qwen3_moe, deepseek_v3"),
    Key("keep_resident", (bool,), True,
        "copy mode: leave the rank's set resident in the daemon after the copy (a restart or role switch "
        "then attaches it); false: evict it when no one else holds it"),
    Key("timeout", (int, float, type(None)), None, "seconds to wait for each frame of the daemon; none: no limit"),
)


@dataclass(frozen=True)
class Options:
    socket: Optional[str] = None
    path: Optional[str] = None
    mode: str = "copy"
    fallback: bool = True
    preset: str = "auto"
    keep_resident: bool = True
    timeout: Optional[float] = None


assert [k.name for k in KEYS] == [f.name for f in fields(Options)]


def parse(extra: Any) -> Options:
    """Options from vLLM's ``model_loader_extra_config`` (a dict; None means {})."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"--model-loader-extra-config for --load-format weightd must be a JSON object, "
                         f"not {type(extra).__name__}")
    known = {k.name: k for k in KEYS}
    unknown = sorted(set(extra) - set(known))
    if unknown:
        raise ValueError(f"--load-format weightd: unknown --model-loader-extra-config key(s) {', '.join(unknown)}; "
                         f"known: {', '.join(known)}")
    values = {}
    for name, value in extra.items():
        k = known[name]
        # bool is an int in Python: a bool where a number is wanted (or the reverse) is refused.
        if not isinstance(value, k.types) or (isinstance(value, bool) and bool not in k.types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in k.types)
            raise ValueError(f"--load-format weightd: {name} must be {want}, not {value!r}")
        if k.choices and value not in k.choices:
            raise ValueError(f"--load-format weightd: {name} must be one of {', '.join(k.choices)}, not {value!r}")
        if name == "timeout" and value is not None and value <= 0:
            raise ValueError(f"--load-format weightd: timeout must be positive, not {value!r}")
        values[name] = value
    return Options(**values)
