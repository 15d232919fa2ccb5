"""What the engine reports while it runs: progress callbacks, and how each cell ended.

Its own module so that the round loop (`rounds`), a cell's lifecycle (`runner`) and the
launchers (`dispatch`, `ray_tasks`, `submitit_jobs`) share these types without importing
each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from fpbench.specs import RunConfig


@dataclass(frozen=True)
class CellResult:
    """How a cell ended: done, skipped (already stored) or failed (with its error)."""

    cfg: RunConfig
    status: str  # done, skipped, failed
    error: str | None = None


class Observer:
    """Progress callbacks, no-ops here; the CLI's subclass shows rich progress bars."""

    def cell_start(self, cfg: RunConfig, start_round: int) -> None:
        """A cell starts training at `start_round` (> 0 when resumed)."""

    def round_end(self, cfg: RunConfig, round_idx: int, metrics: dict[str, float]) -> None:
        """A round is stored; `metrics` are its aggregates and `loss_train` if it was evaluated."""

    def stage(self, cfg: RunConfig | None, what: str, done: int, total: int) -> None:
        """Long work outside the rounds (data preparation, a frozen pass): `done` of `total`
        steps, 0 when it starts and `total` when it ends; `cfg` None for suite-wide work."""

    def cell_end(self, result: CellResult) -> None:
        """A cell finished, was skipped or failed."""
