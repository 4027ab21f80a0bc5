"""Errors: :class:`Error` and one subclass per code of the C error table.

The subclasses are generated at import time by asking libweightd for every
code's wire name (``weightd_err_name``) and message (``weightd_strerror``),
so this list cannot drift from ``WEIGHTD_ERRNO_MAP`` in weightd.h. A code
``BAD_HEADER`` becomes ``BadHeaderError``: each ``_``-separated word
capitalised, joined, ``Error`` appended (``IO`` gives ``IoError``,
``DEVICE_NOMEM`` gives ``DeviceNomemError``).

Every instance carries ``code`` (the negative C number), ``name`` (the wire
name) and ``message`` (the daemon's or the library's detail, e.g. which file
and which tensor)::

    try:
        client.load("/models/broken")
    except weightd.BadHeaderError as e:
        print(e.name, e.message)

A code with a built-in counterpart (:data:`BUILTIN_BASES`) also subclasses
that built-in, so ``except TimeoutError`` catches ``weightd.TimeoutError``
and ``except PermissionError`` catches ``weightd.PermissionError``.
"""
from __future__ import annotations

import builtins

from ._lib import lib

__all__ = ["Error", "by_name", "by_code", "error_from_code", "BUILTIN_BASES"]

# Codes are small positive numbers negated; the table has 30 today. Scanning a
# wider range keeps codes added later (and any gap left by a retired one).
_SCAN = 256

#: Wire name -> the built-in exception its class also derives from. The
#: generated class keeps the built-in's name, so a caller that catches the
#: built-in catches weightd's too, and ``str(e)`` is still "NAME: detail".
BUILTIN_BASES: dict[str, type[BaseException]] = {
    "TIMEOUT": builtins.TimeoutError,
    "PERMISSION": builtins.PermissionError,
}


class Error(Exception):
    """A weightd error: a daemon reply, a library failure, or a misuse caught here.

    Attributes: ``code`` (negative int, as the C functions return it),
    ``name`` (the wire name, "NOT_FOUND"), ``message`` (the detail).
    """

    code: int = 0
    name: str = "UNKNOWN"
    description: str = "unknown error"

    def __init__(self, message: str = "", code: int | None = None):
        if code is not None:
            self.code = code
            self.name = lib.weightd_err_name(code).decode()
        self.message = message or self.description
        super().__init__(f"{self.name}: {self.message}")

    def __reduce__(self):
        return (error_from_code, (self.code, self.message))


def _class_name(wire_name: str) -> str:
    return "".join(w.capitalize() for w in wire_name.split("_")) + "Error"


def _generate() -> tuple[dict[str, type[Error]], dict[int, type[Error]]]:
    names: dict[str, type[Error]] = {}
    codes: dict[int, type[Error]] = {}
    for n in range(1, _SCAN):
        wire = lib.weightd_err_name(-n).decode()
        if wire == "UNKNOWN":
            continue
        bases = (Error, BUILTIN_BASES[wire]) if wire in BUILTIN_BASES else (Error,)
        cls = type(_class_name(wire), bases, {
            "code": -n,
            "name": wire,
            "description": lib.weightd_strerror(-n).decode(),
            "__doc__": f"{wire} ({-n}): {lib.weightd_strerror(-n).decode()}.",
            "__module__": __name__,
        })
        names[wire] = cls
        codes[-n] = cls
    return names, codes


#: wire name -> class, e.g. by_name["BUSY"] is BusyError.
by_name, by_code = _generate()
globals().update({cls.__name__: cls for cls in by_name.values()})
__all__ += [cls.__name__ for cls in by_name.values()]


def error_from_code(code: int, message: str = "") -> Error:
    """The exception for a C return code (or a wire code's number)."""
    cls = by_code.get(code)
    if cls is None:
        return Error(message, code=code)
    return cls(message)
