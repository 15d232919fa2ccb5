"""Command functions behind `fpbench table --paper` and `fpbench plot heldout|sweep|heatmap|comm`.

`fpbench table` (fpbench.cli.results) hands `--paper` here; nothing heavy is imported before a
command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from fpbench.cli.apps import plot_app
from fpbench.cli.common import (
    DEFAULT_DB,
    DbOpt,
    SuiteOpt,
    console,
    err,
    open_store,
    save_figure,
    sqlite_missing,
    suite_name,
    user_errors,
    write_or_print,
)
from fpbench.errors import FpbenchError

OutOpt = Annotated[
    Path, typer.Option(help="output image (.png also writes a .pdf beside it; .pdf, .svg)")
]
MetricOpt = Annotated[str, typer.Option(help="metric on the value axis")]


def paper_renderables(
    db: str, paper: str, table: int | None, fmt: str, width: int | None = None
) -> list[Any]:
    """Each requested table of `paper`, filled from `db` (an absent database fills nothing)."""
    import pandas as pd

    from fpbench.report.paper import Results, fill_paper, load_paper, load_results
    from fpbench.report.paper_render import render
    from fpbench.store.repo import METRIC_COLUMNS

    spec = load_paper(paper)
    chosen = [spec.table(table)] if table is not None else list(spec.tables)
    suites = sorted({str(t.defaults["suite"]) for t in chosen if "suite" in t.defaults})
    if sqlite_missing(db):
        results = Results(pd.DataFrame(columns=METRIC_COLUMNS))
    else:
        with open_store(db, read_only=True) as store:
            results = load_results(store, suites)
    return [render(filled, fmt, width) for filled in fill_paper(spec, results, table)]


def show_paper_tables(db: str, paper: str, table: int | None, fmt: str, out: Path | None) -> None:
    """Print the paper's tables (or write them to `out`): fpbench's values beside the paper's."""
    from rich.console import Console

    target = Console(record=True, width=220) if out else console
    parts = paper_renderables(db, paper, table, fmt, target.width)  # term: fit the terminal
    if sqlite_missing(db):
        err.print(
            f"no results database at {db}: the paper's values only (fpbench run fills it; "
            "--db names another)",
            highlight=False,
            soft_wrap=True,
        )
    if fmt != "term":
        write_or_print("\n".join(parts), out)
        return
    for part in parts:
        target.print(part)
    if out:
        write_or_print(target.export_text(), out)


def show_deviations(paper: str, fmt: str, out: Path | None) -> None:
    """Print every deviation `paper`'s protocol declares (what fpbench runs instead, and why):
    first the departures from values the paper or its code states (each with why it cannot run
    here), then fpbench's choices where the sources are silent; then their counts per suite and
    how many config paths of the feeding cells are pinned, declared and free."""
    from fpbench.report.paper import load_paper
    from fpbench.report.protocol import deviations, feeding_cells, load_protocol

    spec = load_paper(paper)  # unknown paper: one clear line
    blocks = load_protocol(paper)
    if not blocks:
        write_or_print(f"paper {paper} has no [[protocol]] blocks", out)
        return
    rows = _by_kind(deviations(blocks))
    cells = feeding_cells(spec)
    counts = f"{deviation_line(paper, blocks, cells)}\n{coverage_line(paper, spec, blocks, cells)}"
    _deviation_table(f"paper {paper}", rows, counts, fmt, out)


def show_suite_deviations(suite: str, fmt: str, out: Path | None) -> None:
    """`show_deviations` for a suite's own protocol (`fpbench.report.suite_protocol`)."""
    from fpbench.report.suite_protocol import load_suite_protocol, suite_cells, suite_deviations

    proto = load_suite_protocol(suite)  # no protocol: one clear line
    cells = suite_cells(suite)
    counts = coverage_line(suite, proto.paper, proto.blocks, cells)
    _deviation_table(f"suite {suite}", suite_deviations(proto), counts, fmt, out)


def budget_lines(suite: str) -> list[str]:
    """Notes on the methods of `suite` that train less than its protocol's stated fraction of
    the median budget (none without a protocol or a fraction)."""
    from fpbench.report.budget import budget_notes
    from fpbench.report.suite_protocol import PROTOCOLS_DIR, load_suite_protocol
    from fpbench.suites import load_suite

    if not (PROTOCOLS_DIR / f"{suite}.toml").is_file():
        return []
    proto = load_suite_protocol(suite)
    if proto.min_budget_fraction is None:
        return []
    return budget_notes(load_suite(suite).cells, proto.min_budget_fraction, proto.short_budget)


def _deviation_table(
    what: str, rows: list[dict[str, str]], counts: str, fmt: str, out: Path | None
) -> None:
    import pandas as pd

    from fpbench.report.tables import render

    paper = what.split(" ", 1)[1]
    if not rows:
        write_or_print(f"{what}: no declared deviations\n\n{counts}", out)
        return
    frame = pd.DataFrame(rows)
    if fmt != "term":  # after the table; comment lines in CSV
        tail = (
            "\n".join(f"# {line}" for line in counts.splitlines())
            if fmt == "csv"
            else (f"\n{counts}")
        )
        write_or_print(f"{render(frame, fmt).rstrip()}\n{tail}", out)
        return
    from rich.console import Console
    from rich.table import Table

    anchor = "the paper's" if what.startswith("paper") else "its anchor's"
    table = Table(title=f"{paper}: declared deviations from {anchor} protocol")
    for col in frame.columns:
        table.add_column(col, overflow="fold", no_wrap=col in ("kind", "tables", "path", "paper"))
    for row in rows:
        table.add_row(*row.values())
    target = Console(record=True, width=220) if out else console
    target.print(table)
    target.print(counts, highlight=False, soft_wrap=True)
    if out:
        write_or_print(target.export_text(), out)


def _by_kind(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The deviation rows with their kind first: departures from stated values, then silent
    choices (`fpbench.report.protocol.deviation_kind`: a paper value of "unstated")."""
    from fpbench.report.protocol import SILENT, STATED, UNSTATED

    kinds = [{"kind": SILENT if r["paper"] == UNSTATED else STATED, **r} for r in rows]
    return [r for r in kinds if r["kind"] == STATED] + [r for r in kinds if r["kind"] == SILENT]


def deviation_line(paper: str, blocks: list[Any], cells: list[Any]) -> str:
    """'sgpt deviations: 3 from stated values (impossible here), 52 silent choices; per suite
    (stated/silent): sgpt-table1 2/40, ...'."""
    from fpbench.report.protocol import SILENT, STATED, deviation_counts

    n = deviation_counts(blocks, cells)
    suites = ", ".join(
        f"{suite} {c[STATED]}/{c[SILENT]}" for suite, c in sorted(n.items()) if suite != "all"
    )
    return (
        f"{paper} deviations: {n['all'][STATED]} from stated values (impossible here), "
        f"{n['all'][SILENT]} silent choices; per suite (stated/silent): {suites}"
    )


def coverage_line(paper: str, spec: Any, blocks: list[Any], cells: list[Any]) -> str:
    """'sgpt: 97 config paths of 49 feeding cells: 60 pinned, 20 declared, 17 free' (and how
    many (cell, path) pairs no rule covers, when any)."""
    from fpbench.report.protocol import coverage

    cov = coverage(spec, blocks, cells)
    n = cov.counts()
    line = (
        f"{paper}: {len(cov.paths)} config paths of {len(cells)} feeding cells: "
        f"{n['pinned']} pinned, {n['declared']} declared, {n['free']} free"
    )
    if cov.uncovered:
        paths = sorted({p for _, p in cov.uncovered})
        line += f"; {len(paths)} paths uncovered in some cell ({', '.join(paths[:5])}"
        line += ", ...)" if len(paths) > 5 else ")"
    return line


def _load(db: str, suite: str):
    """The suite's stored name and its `Results`; no results is an error."""
    from fpbench.report.paper import load_results
    from fpbench.report.tables import no_results_error

    name = suite_name(suite)
    with open_store(db, must_exist=True) as store:
        results = load_results(store, [name])
    if results.metrics.empty:
        raise no_results_error(name)
    return name, results


@plot_app.command("heldout", short_help="Participating vs held-out client accuracy per method.")
@user_errors
def plot_heldout(
    suite: SuiteOpt,
    out: OutOpt,
    x: Annotated[
        str, typer.Option(help="metric on the x axis: the participating clients' accuracy")
    ] = "acc_local_mean",
    y: Annotated[
        str, typer.Option(help="metric on the y axis: the held-out clients' accuracy")
    ] = "acc_heldout_mean",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Participating-client vs held-out-client accuracy, one marker per method."""
    from fpbench.report.plots import heldout

    name, res = _load(db, suite)
    save_figure(heldout(res.metrics, x=x, y=y, suite=name), out, pdf_beside=True)


@plot_app.command("sweep", short_help="A metric against a swept hyperparameter (from run configs).")
@user_errors
def plot_sweep(
    suite: SuiteOpt,
    out: OutOpt,
    param: Annotated[str, typer.Option(help="config key swept, e.g. train.local_epochs")],
    metric: MetricOpt = "acc_global",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """A metric against a swept hyperparameter read from each run's config."""
    from fpbench.report.plots import sweep

    name, res = _load(db, suite)
    save_figure(sweep(res.metrics, res.configs, param, metric, suite=name), out, pdf_beside=True)


@plot_app.command(
    "heatmap", short_help="A metric over a 2-D grid of hyperparameters (SDFed Fig. 5)."
)
@user_errors
def plot_heatmap(
    suite: SuiteOpt,
    out: OutOpt,
    x: Annotated[str, typer.Option(help="config key on the x axis")],
    y: Annotated[str, typer.Option(help="config key on the y axis")],
    metric: MetricOpt = "acc_global",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """A metric over a 2-D grid of hyperparameters (SDFed Fig. 5)."""
    from fpbench.report.plots import heatmap

    name, res = _load(db, suite)
    save_figure(heatmap(res.metrics, res.configs, x, y, metric, suite=name), out, pdf_beside=True)


@plot_app.command("comm", short_help="Accuracy vs cumulative bytes, or the cost to reach --target.")
@user_errors
def plot_comm(
    suite: SuiteOpt,
    out: OutOpt,
    metric: MetricOpt = "acc_global",
    target: Annotated[
        float | None,
        typer.Option(help="target accuracy: a percent (60) or a fraction (0.6); at most 100%"),
    ] = None,
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Accuracy vs cumulative bytes; with --target, rounds/time/bytes to reach it."""
    from fpbench.report.plots import comm, to_target

    goal = None if target is None else accuracy_target(target, metric)
    name, res = _load(db, suite)
    save_figure(
        comm(res.metrics, res.rounds, metric, target=goal, suite=name), out, pdf_beside=True
    )
    if goal is not None:
        console.print(_target_table(to_target(res.metrics, res.rounds, metric, goal), goal))


def accuracy_target(target: float, metric: str) -> float:
    """`--target` as the stored value: 60 and 0.6 both mean 60% of an accuracy; above 100% no
    accuracy reaches, so it is refused (150 meant 1.5 = 150% before)."""
    from fpbench.report.tables import is_percent

    if not is_percent(metric):
        return target
    if not 0 < target <= 100:
        raise FpbenchError(
            f"--target {target:g}: an accuracy target is a percent in (0, 100] or a fraction "
            "in (0, 1], e.g. 60 or 0.6"
        )
    return target / 100 if target > 1 else target


def _target_table(frame: Any, goal: float) -> Any:
    from rich.table import Table

    table = Table(title=f"to reach {goal:.2%}")
    for col in ("method", "dataset", "partition", "reached", "rounds", "wall_s", "MB"):
        table.add_column(
            col, justify="left" if col in ("method", "dataset", "partition") else "right"
        )
    for row in frame.itertuples(index=False):
        nums = [row.rounds, row.wall_s, row.bytes / 1e6]
        cells = ["-" if n != n else f"{n:,.1f}" for n in nums]  # NaN: never reached
        table.add_row(row.method, row.dataset, row.partition, f"{row.reached}/{row.runs}", *cells)
    return table
