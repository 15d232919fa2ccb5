"""`fpbench runs`, `export` and `compare`: what a researcher does with the stored runs."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from fpbench.cli.apps import app
from fpbench.cli.common import DEFAULT_DB, DbOpt, console, open_store, suite_name, user_errors


def percent(value: float) -> str:
    """A fraction as percent with two decimals; '-' for a missing value."""
    return "-" if value != value else f"{100 * value:.2f}"  # NaN != NaN


@app.command("runs")
@user_errors
def runs(
    suite: Annotated[
        str | None, typer.Option("--suite", "-s", help="only this suite's runs (name or .toml)")
    ] = None,
    method: Annotated[
        list[str] | None, typer.Option(help="only these methods (labels; repeatable)")
    ] = None,
    status: Annotated[
        list[str] | None,
        typer.Option(help="only runs with this status: done, failed, running, ... (repeatable)"),
    ] = None,
    db: DbOpt = DEFAULT_DB,
) -> None:
    """List the runs stored in a database: id, key, cell, status, rounds and headline
    accuracies (final values, %); `fpbench show RUN` shows one."""
    import pandas as pd

    from fpbench.report.listing import HEADLINE, run_listing

    name = suite_name(suite) if suite else None
    with open_store(db, must_exist=True) as store:
        listing = run_listing(store, suite=name, methods=method or (), statuses=status or ())
    if listing.empty:
        console.print(
            f"no runs in {db} match" if (suite or method or status) else f"no runs in {db}"
        )
        return
    table = Table(title=f"{len(listing)} run{'s' if len(listing) != 1 else ''} in {db}")
    heads = {
        "acc_global": "global %",
        "acc_local_mean": "local mean %",
        "acc_local_worst": "worst %",
    }
    columns = ["id", "suite", "method", "dataset", "partition", "seed", "status"]
    for col in ["id", "key", *columns[1:], "rounds", "wall s", *(heads[h] for h in HEADLINE)]:
        right = col in ("id", "seed", "rounds", "wall s") or col.endswith("%")
        table.add_column(col, justify="right" if right else "left", no_wrap=True)
    for row in listing.itertuples(index=False):
        table.add_row(
            str(row.id),
            row.run_key[:8],
            *(str(getattr(row, c)) for c in columns[1:]),
            "-" if pd.isna(row.rounds) else str(row.rounds),
            "-" if pd.isna(row.wall_s) else f"{row.wall_s:.1f}",
            *(percent(getattr(row, h)) for h in HEADLINE),
        )
    print_wide(table)


def print_wide(table: Table) -> None:
    """Print `table` at its natural width (off a terminal too, where rich assumes 80 columns)."""
    from rich.console import Console
    from rich.measure import Measurement

    width = Measurement.get(console, console.options.update(max_width=10_000), table).maximum
    if console.is_terminal or width <= console.width:
        console.print(table)
    else:
        Console(width=width).print(table)
