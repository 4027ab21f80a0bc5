"""Progress of a load: a callback ``fn(bytes_done, bytes_total)``, or a tqdm bar.

``progress=`` of :meth:`weightd.Client.load` and :meth:`weightd.Client.attach`
takes None (no progress), a callable, or True: a tqdm bar on stderr when tqdm
is installed, nothing otherwise. The daemon sends an event about every 100 ms
while bytes move, so a set that is resident already reports nothing.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

ProgressFn = Callable[[int, int], None]
Progress = Union[None, bool, ProgressFn]

__all__ = ["ProgressFn", "Progress", "TqdmProgress", "resolve"]


class TqdmProgress:
    """A progress callback that draws a tqdm bar, made on the first event (its total is known then)."""

    def __init__(self, desc: str):
        self.desc = desc
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=self.desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def resolve(progress: Progress, desc: str) -> Optional[ProgressFn]:
    """The callable for a ``progress=`` argument (None when there is nothing to call)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            return None
        return TqdmProgress(desc)
    if callable(progress):
        return progress
    raise TypeError(f"progress must be None, a bool or a callable(bytes_done, bytes_total), not {progress!r}")
