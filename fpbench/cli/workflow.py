"""`fpbench runs`, `export` and `compare`: what a researcher does with the stored runs."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fpbench.cli.apps import app
from fpbench.cli.common import (
    DEFAULT_DB,
    DEFAULT_METRICS,
    DbOpt,
    SuiteOpt,
    console,
    open_store,
    suite_name,
    user_errors,
)
from fpbench.errors import FpbenchError


def percent(value: float) -> str:
    """A fraction as percent with two decimals; '-' for a missing value."""
    return "-" if value != value else f"{100 * value:.2f}"  # NaN != NaN


RunsSuiteOpt = Annotated[
    str | None, typer.Option("--suite", "-s", help="only this suite's runs (name or .toml)")
]
RunsMethodOpt = Annotated[
    list[str] | None, typer.Option(help="only these methods (labels; repeatable)")
]


@app.command("runs")
@user_errors
def runs(
    suite: RunsSuiteOpt = None,
    method: RunsMethodOpt = None,
    status: Annotated[
        list[str] | None,
        typer.Option(help="only runs with this status: done, failed, running, ... (repeatable)"),
    ] = None,
    db: DbOpt = DEFAULT_DB,
) -> None:
    """List the runs stored in a database, with their headline accuracies.

    Per run: id, key, cell, status, rounds stored and the final global / local-mean / worst
    accuracy (%); `fpbench show RUN` shows one."""
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


class ExportFormat(str, Enum):
    csv = "csv"
    parquet = "parquet"


@app.command("export")
@user_errors
def export(
    out: Annotated[Path, typer.Argument(help="folder for runs, rounds and clients .csv/.parquet")],
    suite: RunsSuiteOpt = None,
    method: RunsMethodOpt = None,
    status: Annotated[
        list[str] | None, typer.Option(help="only runs with this status (repeatable)")
    ] = None,
    run: Annotated[
        list[str] | None,
        typer.Option("--run", help="only these runs: id or run_key prefix (repeatable)"),
    ] = None,
    fmt: Annotated[
        ExportFormat,
        typer.Option("--format", help="csv, or parquet (pip install 'fpbench[parquet]')"),
    ] = ExportFormat.csv,
    force: Annotated[bool, typer.Option("--force", help="overwrite an earlier export")] = False,
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Write runs' per-round and per-client metrics as CSV or Parquet tables.

    runs.* (one row per run), rounds.* (round scalars and aggregate metrics) and clients.*
    (per-client metrics). Values are the database's: accuracies as fractions, rounds counted
    from 0."""
    from fpbench.report.export import export_tables, write_tables
    from fpbench.report.listing import run_listing

    name = suite_name(suite) if suite else None
    with open_store(db, must_exist=True) as store:
        listing = run_listing(store, suite=name, methods=method or (), statuses=status or ())
        ids = list(listing["id"])
        if run:
            wanted = {store.get_run(ref).id for ref in run}
            ids = [i for i in ids if i in wanted]
        if not ids:
            raise FpbenchError(f"no runs in {db} match the filters; see `fpbench runs`")
        tables = export_tables(store, ids)
    for path in write_tables(tables, out, fmt.value, force=force):
        rows = len(tables[path.stem])
        console.print(f"wrote {path} ({rows} row{'s' if rows != 1 else ''})", highlight=False)


@app.command("compare")
@user_errors
def compare(
    method_a: Annotated[str, typer.Argument(metavar="A", help="method label (the baseline)")],
    method_b: Annotated[str, typer.Argument(metavar="B", help="method label compared with A")],
    suite: SuiteOpt,
    metric: Annotated[list[str] | None, typer.Option(help="metric(s) (repeatable)")] = None,
    alpha: Annotated[float, typer.Option(help="level of the paired t-test")] = 0.05,
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Compare two methods on the same cells, seed by seed (paired t-test).

    Per-seed differences B - A of each run's final value, their mean with its Student-t
    interval, a paired two-sided t-test (scipy) and whether the gap exceeds seed noise
    (p < alpha). Accuracies in percentage points."""
    import pandas as pd

    from fpbench.cli.summary import with_stored_federation
    from fpbench.report.compare import compare_methods, federation_of
    from fpbench.report.tables import is_percent

    name = suite_name(suite)
    with open_store(db, must_exist=True) as store:
        frame = with_stored_federation(store, store.metrics(suite=name))
    found = compare_methods(
        frame, method_a, method_b, metric or DEFAULT_METRICS, alpha=alpha, suite=name
    )
    level = f"{100 * (1 - alpha):g}%"
    table = Table(
        title=f"suite {name}: B = {method_b} vs A = {method_a}, paired by seed "
        f"(paired t-test, alpha {alpha:g}; {level} t-interval of the mean difference)"
    )
    fed = federation_of(frame, method_a, method_b)  # (learner, strategy) of A and B, if known
    heads = ["dataset / partition", "metric", "seeds"]
    if fed:
        heads += ["learner A / B", "strategy A / B"]
    left = len(heads)
    heads += [method_a, method_b, "B - A per seed", "mean B - A", f"{level} CI", "p", "verdict"]
    for i, head in enumerate(heads):
        table.add_column(head, justify="left" if i < left or i == len(heads) - 1 else "right")
    for row in found.itertuples(index=False):
        scale = 100.0 if is_percent(row.metric) else 1.0
        ci = (
            "-"
            if pd.isna(row.ci_low)
            else f"[{row.ci_low * scale:+.2f}, {row.ci_high * scale:+.2f}]"
        )
        table.add_row(
            f"{row.dataset} / {row.partition}",
            row.metric,
            ", ".join(map(str, row.seeds)),
            *([f"{fed[0][0]} / {fed[1][0]}", f"{fed[0][1]} / {fed[1][1]}"] if fed else []),
            f"{row.mean_a * scale:.2f}",
            f"{row.mean_b * scale:.2f}",
            " ".join(f"{d * scale:+.2f}" for d in row.diffs),
            f"{row.mean_diff * scale:+.2f}",
            ci,
            "-" if pd.isna(row.p) else f"{row.p:.3g}",
            row.verdict,
        )
    print_wide(table)
