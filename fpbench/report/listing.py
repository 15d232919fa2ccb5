"""`fpbench runs`: a database's runs with their headline metrics, as one DataFrame."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from fpbench.report.tables import final_values

HEADLINE = ("acc_global", "acc_local_mean", "acc_local_worst")
COLUMNS = [
    "id", "run_key", "suite", "method", "dataset", "partition", "seed", "status", "rounds",
    "wall_s", *HEADLINE, "git_commit",
]  # fmt: skip


def run_listing(
    store,
    *,
    suite: str | None = None,
    methods: Sequence[str] = (),
    statuses: Sequence[str] = (),
) -> pd.DataFrame:
    """One row per run (columns `COLUMNS`), ordered by id.

    `rounds` is the number of rounds stored (1-based: the last stored round's number); the
    headline columns hold each run's final value of that metric (its `_last<N>` summary when
    stored, else its last evaluation) as a fraction, NaN where the run has none yet.
    """
    runs = store.runs(suite=suite)
    if methods:
        runs = runs[runs["method"].isin(list(methods))]
    if statuses:
        runs = runs[runs["status"].isin(list(statuses))]
    runs = runs.assign(rounds=(runs["last_round"] + 1).astype("Int64"))
    for name in HEADLINE:
        runs[name] = float("nan")
    if len(runs):
        metrics = store.metrics(run_ids=list(runs["id"]))
        names = [n for n in HEADLINE if metrics["name"].str.startswith(n).any()]
        if names:
            finals = final_values(metrics, names)
            wide = finals.pivot(index="run_id", columns="metric", values="value")
            for name in names:
                runs[name] = runs["id"].map(wide[name]).astype("float64")
    return runs[COLUMNS].reset_index(drop=True)
