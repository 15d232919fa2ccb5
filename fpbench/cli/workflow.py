"""`fpbench runs`, `export` and `compare`: what a researcher does with the stored runs."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fpbench.cli.apps import app
from fpbench.cli.common import (
    DEFAULT_DB,
    DEFAULT_METRICS,
    DbOpt,
    SuiteOpt,
    console,
    fit_table,
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


@app.command("runs", short_help="List a database's runs with their headline accuracies.")
@user_errors
def runs(
    suite: RunsSuiteOpt = None,
    method: RunsMethodOpt = None,
    status: Annotated[
        list[str] | None,
        typer.Option(
            help="only runs with this status: done, failed, running, stale, interrupted or "
            "pending (repeatable)"
        ),
    ] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="term (a table), csv or json (every listed column, accuracies as "
            "fractions, as stored)",
        ),
    ] = "term",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """List the runs stored in a database, with their headline accuracies.

    Per run: id, key, cell, status, rounds stored and the final global / local-mean / worst
    accuracy (%); `fpbench show RUN` shows one."""
    import pandas as pd

    from fpbench.report.listing import HEADLINE, run_listing

    check_statuses(status)
    name = suite_name(suite) if suite else None
    with open_store(db, must_exist=True) as store:
        listing = run_listing(store, suite=name, methods=method or (), statuses=status or ())
    if fmt not in ("term", "csv", "json"):
        raise FpbenchError(f"--format must be term, csv or json, got {fmt!r}")
    if fmt == "csv":
        print(listing.to_csv(index=False, lineterminator="\n"), end="")
        return
    if fmt == "json":
        print(listing.to_json(orient="records", indent=1))
        return
    if listing.empty:
        console.print(
            f"no runs in {db} match" if (suite or method or status) else f"no runs in {db}"
        )
        return
    suites = sorted(set(listing["suite"]))
    where = f" (suite {suites[0]})" if len(suites) == 1 else ""
    table = fit_table(f"{len(listing)} run{'s' if len(listing) != 1 else ''} in {db}{where}")
    number = {"justify": "right", "no_wrap": True}
    parts = (
        ("method", "dataset", "partition") if where else ("suite", "method", "dataset", "partition")
    )
    table.add_column("id", **number)
    table.add_column("key", no_wrap=True)  # `show` takes the id or the key
    table.add_column(" / ".join(parts), overflow="fold", ratio=1)
    for head in ("seed", "status", "rounds", "wall s", "glob", "mean", "worst"):
        table.add_column(head, **(number if head != "status" else {"no_wrap": True}))
    for row in listing.itertuples(index=False):
        table.add_row(
            str(row.id),
            row.run_key[:8],
            " / ".join(str(getattr(row, c)) for c in parts),
            str(row.seed),
            row.status,
            "-" if pd.isna(row.rounds) else str(row.rounds),
            "-" if pd.isna(row.wall_s) else f"{row.wall_s:.1f}",
            *(percent(getattr(row, h)) for h in HEADLINE),
        )
    console.print(table)
    console.print(
        "glob / mean / worst: the run's final global, local-mean and local-worst accuracy (%); "
        "rounds: how many are stored; `fpbench show ID` shows one",
        highlight=False,
    )


def check_statuses(statuses: list[str] | None) -> None:
    """Refuse a --status no run can have (a typo would list nothing and exit 0)."""
    from fpbench.store.models import STATUSES

    valid = (*STATUSES, "stale")
    if bad := [s for s in statuses or [] if s not in valid]:
        raise FpbenchError(f"--status {bad[0]!r} is no run status; valid: {', '.join(valid)}")


class ExportFormat(str, Enum):
    csv = "csv"
    parquet = "parquet"


@app.command("export", short_help="Write per-round and per-client metrics as CSV or Parquet.")
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

    check_statuses(status)
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


@app.command("compare", short_help="Compare two methods seed by seed (paired t-test).")
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
    from fpbench.report.tables import SHORT_METRICS, is_percent

    name = suite_name(suite)
    with open_store(db, must_exist=True) as store:
        frame = with_stored_federation(store, store.metrics(suite=name))
    found = compare_methods(
        frame, method_a, method_b, metric or DEFAULT_METRICS, alpha=alpha, suite=name
    )
    level = f"{100 * (1 - alpha):g}%"
    table = fit_table(
        f"suite {name}: B = {method_b} vs A = {method_a}, paired by seed (paired t-test, "
        f"alpha {alpha:g}; {level} t-interval of the mean difference)"
    )
    fed = federation_of(frame, method_a, method_b)  # (learner, strategy) of A and B, if known
    number = {"justify": "right", "no_wrap": True}
    table.add_column("dataset / partition", overflow="fold", ratio=1)
    table.add_column("metric")
    for head in ("n", "A", "B", "B - A"):
        table.add_column(head, **number)
    table.add_column(f"{level} CI", **number)
    table.add_column("p", **number)
    table.add_column("verdict")
    per_seed = []
    for row in found.itertuples(index=False):
        scale = 100.0 if is_percent(row.metric) else 1.0
        ci = (
            "-"
            if pd.isna(row.ci_low)
            else f"[{row.ci_low * scale:+.2f}, {row.ci_high * scale:+.2f}]"
        )
        metric_name = SHORT_METRICS.get(row.metric, row.metric)
        table.add_row(
            f"{row.dataset} / {row.partition}",
            metric_name,
            str(len(row.seeds)),
            f"{row.mean_a * scale:.2f}",
            f"{row.mean_b * scale:.2f}",
            f"{row.mean_diff * scale:+.2f}",
            ci,
            "-" if pd.isna(row.p) else f"{row.p:.3g}",
            row.verdict,
        )
        diffs = ", ".join(
            f"{s}: {d * scale:+.2f}" for s, d in zip(row.seeds, row.diffs, strict=True)
        )
        per_seed.append(f"  {row.dataset} / {row.partition} {metric_name}: {diffs}")
    console.print(table)
    shown = sorted({row.metric for row in found.itertuples()} & set(SHORT_METRICS))
    legend = ", ".join(f"{SHORT_METRICS[m]} = {m}" for m in shown)
    console.print(
        f"A = {method_a}, B = {method_b}; n: seeds paired; B - A: their mean difference"
        + (f"; {legend}" if legend else "")
        + "; accuracies in percentage points. B - A per seed:",
        highlight=False,
    )
    for line in per_seed:
        console.print(line, highlight=False)
    if fed:
        (learner_a, strategy_a), (learner_b, strategy_b) = fed
        console.print(
            f"learner: A {learner_a}, B {learner_b}; strategy: A {strategy_a}, B {strategy_b}",
            highlight=False,
        )
