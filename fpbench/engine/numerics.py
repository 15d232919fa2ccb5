"""How a cell computes: its deterministic mode and thread count, and its CPU linear layers'
backend; the same for training (`runner`), re-scoring (`artifacts`) and timing (`estimate`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fpbench.backbones.frozen_linear import cpu_linear
from fpbench.determinism import deterministic
from fpbench.specs import RunConfig


@contextmanager
def cell_numerics(cfg: RunConfig) -> Iterator[None]:
    """How a cell computes (also where `fpbench estimate` times it): its deterministic mode and
    thread count, and its CPU linear layers' backend."""
    with (
        deterministic(cfg.runtime.deterministic, cfg.runtime.threads),
        cpu_linear(cfg.runtime.cpu_linear),
    ):
        yield
