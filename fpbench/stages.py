"""Progress of the long work outside the round loop (data preparation, frozen passes).

The runner opens `reporting(callback)` around a cell's setup; code deep inside it (the frozen
feature pass in `fpbench.engine.inputs`) calls `report(what, done, total)` without knowing
who listens. Outside `reporting` a report goes nowhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Reporter = Callable[[str, int, int], None]  # (what, done, total)

_listener: ContextVar[Reporter | None] = ContextVar("fpbench_stage_listener", default=None)


@contextmanager
def reporting(callback: Reporter) -> Iterator[None]:
    """Send every `report` made inside this block to `callback`."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


def report(what: str, done: int, total: int) -> None:
    """`what` has finished `done` of `total` steps (0 when it starts, total when it ends)."""
    callback = _listener.get()
    if callback is not None:
        callback(what, done, total)
