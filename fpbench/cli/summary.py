"""What `fpbench run` prints when it ends: the suite's table and the commands to go on with."""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def next_commands(suite: str, db: str) -> list[str]:
    """The table, plot, report and runs commands for `suite`'s results in `db`, ready to
    paste."""
    s, d = shlex.quote(suite), shlex.quote(db)
    stem = shlex.quote(f"results/{suite.rsplit('/', 1)[-1].removesuffix('.toml')}")
    return [
        f"fpbench table --suite {s} --db {d}",
        f"fpbench plot tradeoff --suite {s} --db {d} --out {stem}-tradeoff.png",
        f"fpbench report --suite {s} --db {d} --out {stem}-report",
        f"fpbench runs --suite {s} --db {d}",
    ]


def summary_text(db: str, suite: str, metrics: Sequence[str]) -> str | None:
    """The suite's summary table as `fpbench table --suite` prints it (None: nothing stored)."""
    from fpbench.cli.common import open_store, suite_name
    from fpbench.report.tables import render, summary_table

    with open_store(db, must_exist=True) as store:
        frame = store.metrics(suite=suite_name(suite))
    if frame.empty:
        return None
    return render(summary_table(frame, list(metrics)), "md")
