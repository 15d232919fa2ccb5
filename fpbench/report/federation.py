"""Learner and strategy as columns of a suite's results (`fpbench table`, `fpbench compare`).

A run's method label names a cell; what federated it is in its stored config: the learner (the
registered method, or the learner a preset renames: PromptFL's `coop`) and the strategy
(`fedavg` for a method on the default aggregate, `own` for one with its own). The columns are
added where some run of the frame names a strategy, so that a suite without strategies keeps
its tables as they were.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from fpbench.registry import METHODS
from fpbench.strategies import learner_of, strategy_label

COLUMNS = ("learner", "strategy")


def with_federation(frame: pd.DataFrame, configs: Mapping[int, dict[str, Any]]) -> pd.DataFrame:
    """`frame` (with a run_id column) with `learner` and `strategy` columns, from each run's
    stored config; unchanged where no run names a strategy."""
    if frame.empty or not any(c.get("method", {}).get("strategy") for c in configs.values()):
        return frame
    learner = {i: _learner(c["method"]["name"]) for i, c in configs.items()}
    strategy = {i: strategy_label(c) for i, c in configs.items()}
    return frame.assign(
        learner=frame["run_id"].map(learner), strategy=frame["run_id"].map(strategy)
    )


def table_index(frame: pd.DataFrame) -> Sequence[str]:
    """A summary table's row labels: the method, with its learner and strategy where known."""
    return ("method", *COLUMNS) if set(COLUMNS) <= set(frame.columns) else ("method",)


def _learner(name: str) -> str:
    return learner_of(METHODS.get(name)) if name in METHODS else name
