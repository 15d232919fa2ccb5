"""Command functions behind `fpbench report` and `fpbench plot partition`.

Nothing heavy is imported before a command runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fpbench.cli.apps import app, plot_app
from fpbench.cli.common import (
    DEFAULT_DB,
    DbOpt,
    SuiteOpt,
    console,
    open_store,
    save_figure,
    suite_name,
    user_errors,
)


@app.command("report", short_help="One self-contained HTML page of a suite's results.")
@user_errors
def report(
    suite: SuiteOpt,
    out: Annotated[Path, typer.Option(help="folder for index.html and its PNGs")],
    db: DbOpt = DEFAULT_DB,
) -> None:
    """One self-contained HTML page of a suite: runs, versions, devices, tables and plots."""
    from fpbench.report.html import build_report, write_report

    name = suite_name(suite)
    with open_store(db, must_exist=True) as store:
        metrics, runs = store.metrics(suite=name), store.runs(suite=name)
    page = write_report(build_report(metrics, runs, name), out)
    console.print(f"wrote {page}")


@plot_app.command(
    "partition", short_help="Per-client class histogram of a partition (SGPT Fig. 7)."
)
@user_errors
def plot_partition(
    suite: SuiteOpt,
    out: Annotated[
        Path, typer.Option(help="output image (.png also writes a .pdf beside it; .pdf, .svg)")
    ],
    dataset: Annotated[str | None, typer.Option(help="dataset label (default: first)")] = None,
    partition: Annotated[str | None, typer.Option(help="partition label (default: first)")] = None,
    seed: Annotated[int | None, typer.Option(help="seed (default: the suite's first)")] = None,
    kind: Annotated[
        str, typer.Option(help="auto (bars up to 20 classes), bars or heatmap")
    ] = "auto",
) -> None:
    """Per-client class histogram of a suite's partition (SGPT Fig. 7), before any run."""
    from fpbench.data.prepared import data_root, require_present
    from fpbench.report.partition_plot import partition_figure, select_cell, suite_partition
    from fpbench.suites import load_suite

    cell = select_cell(load_suite(suite).cells, dataset, partition, seed)
    require_present([cell.dataset.name], data_root())
    save_figure(partition_figure(suite_partition(cell), kind), out, pdf_beside=True)
