"""Whether this vLLM can run the plugin: its interfaces checked, not its version number.

The plugin runs on every vLLM whose interfaces it uses are unchanged
(interfaces.NEEDS: the loader registry and base class, the default loader,
the configs, the parallel-state calls, the MoE objects, the parameter-name
rules of the verified architectures). :func:`assessment` runs
interfaces.check over :class:`LiveInterface`, the vLLM this process
imported, once per process (``register()`` runs it when vLLM loads the
plugin; the loader's construction raises or warns by :func:`require`):

- an interface changed: the loader refuses, with a message naming each
  object and what changed about it;
- every interface unchanged on a release of a tested series
  (:data:`TESTED`): it runs silently;
- every interface unchanged on any other release: it runs, with one warning
  per process naming the version and the tested series.

There is no override: a vLLM that fails the checks lacks something the
loader calls, and a vLLM that passes them needs none.
"""
from __future__ import annotations

import ast
import inspect
import logging
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional

from . import interfaces

#: The vLLM release series the plugin was run against (tests/vllm) and whose wheels the CI
#: fixtures were recorded from (tests/fixtures/vllm); tests/python_vllm checks the two agree.
TESTED = ("0.33", "0.34")

log = logging.getLogger("vllm.weightd")


def series(version: str) -> Optional[str]:
    """"MAJOR.MINOR" of a version string such as "0.34.0", "0.34.1rc1" or "v0.33.0+cu130"; None if unreadable."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version or "")
    return f"{int(m.group(1))}.{int(m.group(2))}" if m else None


@dataclass
class Assessment:
    """The check's outcome for one vLLM: its version, what changed, and the error or warning to give."""

    version: str
    problems: list = field(default_factory=list)

    @property
    def error(self) -> Optional[str]:
        if not self.problems:
            return None
        return (f"weightd's vLLM loader (--load-format weightd) cannot run on vLLM {self.version or '(unknown)'}: "
                f"{len(self.problems)} of the vLLM interfaces it uses changed: "
                + "; ".join(str(p) for p in self.problems)
                + f". Install a vLLM whose interfaces match (tested: {', '.join(s + '.x' for s in TESTED)}) or a "
                  f"weightd written for this one.")

    @property
    def warning(self) -> Optional[str]:
        if self.problems or series(self.version) in TESTED:
            return None
        return (f"weightd: vLLM {self.version or '(unknown)'} is not a release the loader was tested with "
                f"({', '.join(s + '.x' for s in TESTED)}); every vLLM interface it uses is unchanged "
                f"({len(interfaces.NEEDS)} checked), so it runs")


def assess(iface: interfaces.Interface) -> Assessment:
    """interfaces.check over `iface`, with the error or warning it calls for."""
    return Assessment(iface.version(), interfaces.check(iface))


_assessed: Optional[Assessment] = None
_warned = False


def assessment(iface: Optional[interfaces.Interface] = None) -> Assessment:
    """This process's vLLM, checked once (register() does it at import); later calls return the first outcome.

    `iface` replaces the live vLLM (tests).
    """
    global _assessed
    if _assessed is None:
        _assessed = assess(iface if iface is not None else LiveInterface())
    return _assessed


def require(iface: Optional[interfaces.Interface] = None, warn: Any = None) -> Assessment:
    """What the loader calls before it runs: raises RuntimeError naming what changed; warns once per process
    for an untested release that passed the checks."""
    global _warned
    a = assessment(iface)
    if a.error:
        raise RuntimeError(a.error)
    if a.warning and not _warned:
        _warned = True
        (warn or log.warning)(a.warning)
    return a


def reset() -> None:
    """Forgets the outcome (tests: the next call checks again, and may warn again)."""
    global _assessed, _warned
    _assessed, _warned = None, False


# ---- the live vLLM -----------------------------------------------------------------------------


def _source_node(obj: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(obj))).body[0]


def _from_vllm(cls: type) -> bool:
    return (getattr(cls, "__module__", "") or "").split(".")[0] == "vllm"


class LiveInterface:
    """The vLLM this process runs, as interfaces.check sees it.

    An object of a module this process has imported is found by attribute,
    and its facts are read from its own source (a class's from its vLLM
    bases' too, in MRO order). A module not imported yet is not imported
    for the check (that would import every verified model and the GPU
    worker into every process): its objects are read from the installed
    package's files with the recorder's reader (interfaces.SourceTree).
    """

    def __init__(self) -> None:
        import vllm

        self._vllm = vllm
        roots = [os.path.dirname(p) for p in getattr(vllm, "__path__", [])]

        def read(rel: str) -> Optional[str]:
            for root in roots:
                path = os.path.join(root, rel)
                if os.path.isfile(path):
                    with open(path, encoding="utf-8") as f:
                        return f.read()
            return None

        self._tree = interfaces.SourceTree(read)

    def version(self) -> str:
        return str(getattr(self._vllm, "__version__", ""))

    def lookup(self, module: str, name: str) -> Optional[dict]:
        mod = sys.modules.get(module)
        if mod is None:
            return self._tree.lookup(module, name)
        obj: Any = mod
        for part in name.split("."):
            if not hasattr(obj, part):
                return None
            obj = getattr(obj, part)
        return self.facts(obj)

    @staticmethod
    def facts(obj: Any) -> Optional[dict]:
        """The facts of a live object: a class, a function or method, a property, or a dict constant."""
        if inspect.isclass(obj):
            chain = []
            for c in reversed(obj.__mro__):
                if not _from_vllm(c):
                    continue
                try:
                    chain.append(interfaces.describe(_source_node(c)))
                except (OSError, TypeError):
                    if c is obj:
                        raise  # the class itself must be readable; a base without source adds nothing
            return interfaces.merge(chain)
        if isinstance(obj, property):
            obj = obj.fget
        if callable(obj):
            return interfaces.describe(_source_node(inspect.unwrap(obj)))
        return interfaces.value_facts(obj)
