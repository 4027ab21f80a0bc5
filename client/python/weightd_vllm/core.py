"""How one rank's parameters are filled from weightd: the decisions, without vLLM or torch.

The vLLM loader (loader.py) wraps a model as a :class:`Target` and calls
:func:`load`. Tests drive the same function with numpy "models" whose
parameters have vLLM's names and shapes. Three tiers, in order:

1. **Copied from the rank's set.** The rank's plan (ranks.py) is attached;
   every parameter whose weightd output (names.py) exists with the same shape,
   and a dtype that vLLM's own loaders would copy into it, is copied (device
   to device), or in ``shared`` mode made the set's memory where the target
   allows it.
2. **Through vLLM's load_weights, from weightd's tensors.** Parameters left
   over (a layout the preset does not produce: a quantised packing, an
   untied head, a renamed module) are built by the model's own
   ``load_weights`` from the checkpoint tensors they come from, which the
   daemon serves whole in a second, explicit plan.
3. **vLLM's default loader.** Whatever is still missing is named in one
   warning and loaded from the files by vLLM's default loader (only the
   checkpoint tensors tiers 1 and 2 did not consume), or, with
   ``fallback: false``, is an error.

When weightd cannot serve the rank at all (no daemon, no library, a layout
no preset produces, a plan the daemon refuses), one warning says why and the
default loader loads everything (or, without fallback, it is an error).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Protocol

from . import checkpoint, names
from .ranks import Unservable

log = logging.getLogger("weightd.vllm")

#: Floating dtypes vLLM's loaders convert between with ``copy_`` (``--dtype`` other than the checkpoint's).
CONVERTIBLE = frozenset({"BF16", "F16", "F32"})
#: How many names a warning lists before "and N more".
LISTED = 8


class Spec(NamedTuple):
    """A tensor's shape and safetensors dtype name."""

    shape: tuple
    dtype: str


class NotServed(RuntimeError):
    """Parameters weightd could not serve, with ``fallback: false``."""


class Target(Protocol):
    """A model as the loader sees it (vLLM's in loader.py, numpy fakes in the tests)."""

    def params(self) -> dict[str, Spec]:
        """Every parameter to fill, by name (vLLM's ``named_parameters()``)."""

    def copy(self, name: str, src: Any) -> None:
        """Copies `src` (a tensor of the attached set) into parameter `name`."""

    def share(self, name: str, src: Any) -> bool:
        """Makes parameter `name` the memory of `src`; False when that is not safe for it (it is copied)."""

    def exempt(self, name: str) -> bool:
        """True for a parameter no checkpoint provides (a KV-cache scale that keeps its default)."""

    def packed(self) -> Mapping[str, Iterable[str]]:
        """The model's ``packed_modules_mapping`` (fused module -> checkpoint modules)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> Optional[set]:
        """The model's own ``load_weights``; returns the parameter names it loaded (None: it does not say)."""

    def default_weights(self) -> Iterator[tuple[str, Any]]:
        """(checkpoint name, tensor) of every checkpoint tensor, read from the files by vLLM's default loader."""

    def default_load(self) -> None:
        """vLLM's default loader loads every parameter."""

    def sync(self) -> None:
        """Waits for the copies issued so far (before a set they read from is released)."""


@dataclass
class Report:
    """What one load did; ``warnings`` holds the warning it logged (at most one)."""

    plan: Optional[dict] = None
    set_id: Optional[str] = None
    copied: list = field(default_factory=list)
    shared: list = field(default_factory=list)
    via_load_weights: list = field(default_factory=list)
    via_default: list = field(default_factory=list)
    exempt: list = field(default_factory=list)
    unused_outputs: list = field(default_factory=list)
    bytes_copied: int = 0
    bytes_shared: int = 0
    fallback_reason: Optional[str] = None
    warnings: list = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        if self.fallback_reason is not None:
            return f"weightd served nothing ({self.fallback_reason}); vLLM's default loader loaded the model"
        parts = [f"{len(self.copied)} parameters copied ({self.bytes_copied / 2**20:.1f} MiB)"]
        if self.shared:
            parts.append(f"{len(self.shared)} shared ({self.bytes_shared / 2**20:.1f} MiB, zero copy)")
        if self.via_load_weights:
            parts.append(f"{len(self.via_load_weights)} through vLLM's load_weights from weightd tensors")
        if self.via_default:
            parts.append(f"{len(self.via_default)} by vLLM's default loader")
        return (f"weightd set {self.set_id} (plan {self.plan}): " + ", ".join(parts) +
                f" in {self.seconds:.2f} s")


def listing(items: list) -> str:
    """The first LISTED items, then how many more."""
    shown = ", ".join(items[:LISTED])
    return shown + (f" and {len(items) - LISTED} more" if len(items) > LISTED else "")


@dataclass
class Assignment:
    """Which set output fills which parameter, and why the others are not filled."""

    copies: list  # (parameter, output)
    unserved: dict  # parameter -> why
    unused: list  # outputs no parameter takes


def assign(params: Mapping[str, Spec], outputs: Mapping[str, Spec],
           to_output: Callable[[str], str] = names.to_weightd) -> Assignment:
    """Pairs each parameter with the output of its weightd name when shapes agree and dtypes copy."""
    copies, unserved, used = [], {}, set()
    for p, ps in params.items():
        o = to_output(p)
        os_ = outputs.get(o)
        if os_ is None:
            unserved[p] = "not in the set"
        elif tuple(os_.shape) != tuple(ps.shape):
            unserved[p] = f"shape {list(ps.shape)}, the set's {o} is {list(os_.shape)}"
        elif os_.dtype != ps.dtype and not (os_.dtype in CONVERTIBLE and ps.dtype in CONVERTIBLE):
            unserved[p] = f"dtype {ps.dtype}, the set's {o} is {os_.dtype}"
        else:
            copies.append((p, o))
            used.add(o)
    return Assignment(copies, unserved, [o for o in outputs if o not in used])


def _nbytes(t: Any) -> int:
    n = getattr(t, "nbytes", None)
    if n is None:  # torch before 2.1 has no Tensor.nbytes
        n = t.numel() * t.element_size()
    return int(n)


def serve(target: Target, client: Any, path: str, plan: dict, *, device: Any = None, mode: str = "copy",
          fallback: bool = True, keep_resident: bool = True, tensor_type: str = "auto",
          warn: Callable[[str], None] = log.warning) -> Report:
    """Fills `target` from the set of `plan` (tiers 1-3 above). weightd errors of the first attach propagate."""
    t0 = time.monotonic()
    report = Report(plan=plan)
    s = client.attach(path, device=device, tensor_type=tensor_type, plan=plan)
    report.set_id = s.id
    try:
        params = target.params()
        outputs = {i.name: Spec(tuple(i.shape), i.dtype) for i in s.infos()}
        a = assign(params, outputs)
        report.unused_outputs = a.unused
        for p, o in a.copies:
            src = s[o]
            if mode == "shared" and params[p].dtype == outputs[o].dtype and target.share(p, src):
                report.shared.append(p)
                report.bytes_shared += _nbytes(src)
            else:
                target.copy(p, src)
                report.copied.append(p)
                report.bytes_copied += _nbytes(src)
        src = None
    finally:
        target.sync()
        s.release()  # shared parameters keep the lease until they die (the binding's rule)
    if mode == "copy" and not keep_resident:
        _evict(client, s.id)

    left = {p: why for p, why in a.unserved.items() if not target.exempt(p)}
    report.exempt = sorted(p for p in a.unserved if p not in left)
    table = None
    if left:
        table = checkpoint.tensor_table(path)
        left = _through_load_weights(target, client, path, device, tensor_type, table, left, report)
    if left:
        why = "; ".join(f"{p}: {r}" for p, r in list(left.items())[:LISTED])
        message = (f"weightd: {len(left)} parameter(s) not served by weightd: {listing(sorted(left))} ({why})")
        if not fallback:
            raise NotServed(message + "; fallback is off")
        warn(message + "; loading them with vLLM's default loader")
        report.warnings.append(message)
        consumed = _consumed(target, table, report.copied + report.shared + report.via_load_weights)
        target.load_weights((n, t) for n, t in target.default_weights() if n not in consumed)
        report.via_default = sorted(left)
    report.seconds = time.monotonic() - t0
    return report


def _through_load_weights(target: Target, client: Any, path: str, device: Any, tensor_type: str,
                          table: dict, left: dict, report: Report) -> dict:
    """Tier 2: the checkpoint tensors of the leftover parameters, whole from weightd, into load_weights."""
    packed = target.packed()
    sources = {p: names.checkpoint_sources(p, table, packed) for p in left}
    feed = sorted({n for srcs in sources.values() for n in srcs})
    if not feed:
        return {p: why + "; the checkpoint has no tensor for it" for p, why in left.items()}
    try:
        s = client.attach(path, device=device, tensor_type=tensor_type, plan=checkpoint.whole_plan(feed, table))
    except Exception as e:  # noqa: BLE001 - any refusal leaves these parameters to the default loader
        if not _is_weightd_error(e):
            raise
        return {p: f"{why}; weightd could not serve its source tensors whole: {e}" for p, why in left.items()}
    try:
        loaded = target.load_weights((n, s[n]) for n in feed)
    finally:
        target.sync()
        s.release()
    out = {}
    for p, why in left.items():
        if sources[p] and (loaded is None or p in loaded):
            report.via_load_weights.append(p)
        else:
            out[p] = why + ("; vLLM's load_weights did not fill it" if sources[p] else
                            "; the checkpoint has no tensor for it")
    return out


def _consumed(target: Target, table: Optional[dict], served: list) -> set:
    """The checkpoint tensors the served parameters were built from (the default loader skips them)."""
    if table is None:
        return set()
    packed = target.packed()
    return {n for p in served for n in names.checkpoint_sources(p, table, packed)}


def _evict(client: Any, set_id: str) -> None:
    try:
        client.evict(set_id)
    except Exception as e:  # noqa: BLE001 - another engine holding the set is not an error
        if not _is_weightd_error(e):
            raise
        log.info("weightd: set %s stays resident: %s", set_id, e)


def _is_weightd_error(e: BaseException) -> bool:
    try:
        import weightd
    except ImportError:
        return False
    return isinstance(e, weightd.Error)


def fallback_errors() -> tuple:
    """The exceptions that mean "weightd cannot serve this rank" (not bugs)."""
    errs: list = [Unservable, ImportError, OSError]
    try:
        import weightd

        errs.append(weightd.Error)
    except ImportError:
        pass
    return tuple(errs)


def load(target: Target, serve_rank: Callable[[], Report], *, fallback: bool = True,
         warn: Callable[[str], None] = log.warning) -> Report:
    """Runs `serve_rank`; when weightd cannot serve the rank at all, the default loader loads everything.

    ``serve_rank`` plans, connects and calls :func:`serve`; an Unservable,
    ImportError (no libweightd), OSError or weightd.Error from it means
    weightd cannot serve: one warning names the reason and
    ``target.default_load()`` runs (``fallback`` False: NotServed is raised).
    """
    t0 = time.monotonic()
    try:
        return serve_rank()
    except fallback_errors() as e:
        reason = f"{type(e).__name__}: {e}" if not isinstance(e, Unservable) else str(e)
        message = f"weightd: not served: every parameter ({reason})"
        if not fallback:
            raise NotServed(message + "; fallback is off") from e
        warn(message + "; loading the model with vLLM's default loader")
        target.default_load()
        report = Report(fallback_reason=reason, warnings=[message])
        report.via_default = sorted(target.params())
        report.seconds = time.monotonic() - t0
        return report
