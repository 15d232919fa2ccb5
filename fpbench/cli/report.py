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
        Path,
        typer.Option(
            help="output image (.png also writes a .pdf beside it; .pdf, .svg); with several "
            "partitions, one file each named OUT-<dataset>-<partition>[-s<seed>], or, for a "
            "folder (no extension), DIR/<dataset>-<partition>[-s<seed>].png"
        ),
    ],
    dataset: Annotated[str | None, typer.Option(help="only this dataset label")] = None,
    partition: Annotated[str | None, typer.Option(help="only this partition label")] = None,
    seed: Annotated[int | None, typer.Option(help="only this seed")] = None,
    kind: Annotated[
        str, typer.Option(help="auto (bars up to 20 classes), bars or heatmap")
    ] = "auto",
) -> None:
    """Per-client class histograms of a suite's partitions (SGPT Fig. 7), before any run.

    Draws every distinct (dataset, partition, seed) of the suite, or those --dataset,
    --partition and --seed keep: one figure each. Seeds that deal the same per-client counts
    share one figure, its title naming them; -s<seed> is in a file's name only where the seeds
    of its dataset and partition draw different figures. One figure alone is written to --out.
    """
    from fpbench.data.prepared import data_root, require_present
    from fpbench.report.partition_plot import partition_figure, select_cells, suite_partitions
    from fpbench.suites import load_suite

    cells = select_cells(load_suite(suite).cells, dataset, partition, seed)
    require_present([c.dataset.name for c in cells], data_root())  # before any is drawn
    views = suite_partitions(cells)
    for name, view in views:
        path = _partition_out(out, name, len(views))
        save_figure(partition_figure(view, kind), path, pdf_beside=True)


def _partition_out(out: Path, name: str, count: int) -> Path:
    """Where partition `name` goes: `out` itself when it is the only one and a file name."""
    if out.is_dir() or not out.suffix:  # a folder
        return out / f"{name}.png"
    return out if count == 1 else out.with_name(f"{out.stem}-{name}{out.suffix}")
