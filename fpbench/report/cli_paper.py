"""Command functions behind `fpbench table --paper` and `fpbench plot heldout|sweep|heatmap|comm`.

fpbench/cli.py stays thin: its `table` command hands `--paper` here, and
`register_plot_commands` adds the plot commands to its `plot` group with the CLI's own helpers
(error handling, opening the store, resolving a suite name, saving a figure) passed in, so this
module never imports the CLI. Nothing heavy is imported before a command runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fpbench.errors import FpbenchError

DEFAULT_DB = "results/fpbench.db"
DbOpt = Annotated[str, typer.Option("--db", help="results database: a path or SQLAlchemy URL")]
SuiteOpt = Annotated[str, typer.Option("--suite", "-s", help="suite name or path to a .toml")]
OutOpt = Annotated[
    Path, typer.Option(help="output image (.png also writes a .pdf beside it; .pdf, .svg)")
]
MetricOpt = Annotated[str, typer.Option(help="metric on the value axis")]


def _store_or_none(db: str):
    """The results store, or None where `db` names a SQLite file that does not exist yet."""
    from fpbench.store import Store

    url = Store.url_from_path_or_url(db)
    if url.startswith("sqlite:///") and not Path(url[len("sqlite:///") :]).exists():
        return None
    return Store(url)


def paper_renderables(db: str, paper: str, table: int | None, fmt: str) -> list[Any]:
    """Each requested table of `paper`, filled from `db` (an absent database fills nothing)."""
    import pandas as pd

    from fpbench.report.paper import Results, fill_paper, load_paper, load_results
    from fpbench.report.paper_render import render
    from fpbench.store.repo import METRIC_COLUMNS

    spec = load_paper(paper)
    chosen = [spec.table(table)] if table is not None else list(spec.tables)
    suites = sorted({str(t.defaults["suite"]) for t in chosen if "suite" in t.defaults})
    store = _store_or_none(db)
    if store is None:
        results = Results(pd.DataFrame(columns=METRIC_COLUMNS))
    else:
        with store:
            results = load_results(store, suites)
    return [render(filled, fmt) for filled in fill_paper(spec, results, table)]


def show_paper_tables(
    db: str, paper: str, table: int | None, fmt: str, out: Path | None, console: Any
) -> None:
    """Print the paper's tables (or write them to `out`): fpbench's values beside the paper's."""
    from rich.console import Console

    parts = paper_renderables(db, paper, table, fmt)
    if fmt == "term":
        target = Console(record=True, width=220) if out else console
        for part in parts:
            target.print(part)
        text = target.export_text() if out else ""
    else:
        text = "\n".join(parts)
        if not out:
            print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        console.print(f"wrote {out}")


def _frames(store: Any, suite: str):
    from fpbench.report.paper import load_results

    results = load_results(store, [suite])
    if results.metrics.empty:
        raise FpbenchError(f"no results for suite {suite}; run `fpbench run --suite {suite}` first")
    return results


def register_plot_commands(
    plot_app: typer.Typer,
    *,
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
    open_store: Callable[..., Any],
    suite_name: Callable[[str], str],
    save: Callable[[Any, Path], None],
    console: Any,
) -> None:
    """Add `heldout`, `sweep`, `heatmap` and `comm` to the CLI's `plot` group."""

    def both(fig: Any, out: Path) -> None:
        save(fig, out)
        if out.suffix.lower() == ".png":
            save(fig, out.with_suffix(".pdf"))

    def load(db: str, suite: str):
        name = suite_name(suite)
        return name, _frames(open_store(db, must_exist=True), name)

    @plot_app.command("heldout")
    @wrap
    def plot_heldout(
        suite: SuiteOpt,
        out: OutOpt,
        x: MetricOpt = "acc_local_mean",
        y: MetricOpt = "acc_heldout_mean",
        db: DbOpt = DEFAULT_DB,
    ) -> None:
        """Participating-client vs held-out-client accuracy, one marker per method."""
        from fpbench.report.plots import heldout

        name, res = load(db, suite)
        both(heldout(res.metrics, x=x, y=y, suite=name), out)

    @plot_app.command("sweep")
    @wrap
    def plot_sweep(
        suite: SuiteOpt,
        out: OutOpt,
        param: Annotated[str, typer.Option(help="config key swept, e.g. train.local_epochs")],
        metric: MetricOpt = "acc_global",
        db: DbOpt = DEFAULT_DB,
    ) -> None:
        """A metric against a swept hyperparameter read from each run's config."""
        from fpbench.report.plots import sweep

        name, res = load(db, suite)
        both(sweep(res.metrics, res.configs, param, metric, suite=name), out)

    @plot_app.command("heatmap")
    @wrap
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

        name, res = load(db, suite)
        both(heatmap(res.metrics, res.configs, x, y, metric, suite=name), out)

    @plot_app.command("comm")
    @wrap
    def plot_comm(
        suite: SuiteOpt,
        out: OutOpt,
        metric: MetricOpt = "acc_global",
        target: Annotated[
            float | None, typer.Option(help="target accuracy (percent or fraction)")
        ] = None,
        db: DbOpt = DEFAULT_DB,
    ) -> None:
        """Accuracy vs cumulative bytes; with --target, rounds/time/bytes to reach it."""
        from fpbench.report.plots import comm, to_target

        name, res = load(db, suite)
        goal = None if target is None else (target / 100 if target > 1 else target)
        both(comm(res.metrics, res.rounds, metric, target=goal, suite=name), out)
        if goal is not None:
            console.print(_target_table(to_target(res.metrics, res.rounds, metric, goal), goal))


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
