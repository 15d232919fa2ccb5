"""`fpbench list`, `show`, `table` and `plot tradeoff|curves`: what is registered and what was
stored."""

from __future__ import annotations

import fnmatch
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from fpbench.cli.apps import app, plot_app
from fpbench.cli.common import (
    DEFAULT_DB,
    DEFAULT_METRICS,
    DbOpt,
    PlotOutOpt,
    SuiteOpt,
    console,
    err,
    open_store,
    print_error,
    save_figure,
    suite_name,
    user_errors,
    write_or_print,
)
from fpbench.errors import FpbenchError


class Listable(str, Enum):
    suites = "suites"
    methods = "methods"
    datasets = "datasets"
    partitions = "partitions"
    backbones = "backbones"
    strategies = "strategies"


@app.command("list", short_help="List registered suites, methods, datasets, partitions, etc.")
@user_errors
def list_(
    what: Annotated[Listable, typer.Argument(help="what to list")],
    pattern: Annotated[
        str, typer.Argument(help="only names matching this glob, e.g. 'sgpt*' (with presets)")
    ] = "*",
    presets: Annotated[
        bool, typer.Option("--presets", help="methods: list each one's named presets too")
    ] = False,
) -> None:
    """List the registered suites, methods, datasets, partitions, backbones or strategies.

    Components of other installed packages (entry points `fpbench.methods`, ...) are listed
    with the package they come from. A method's presets (paper rows, `preset = "name"` in a
    suite) are listed under it with `--presets`, or when a pattern narrows the list. A
    strategy is listed with its settings' defaults (`strategy = { name = "fedprox", mu = 0.01 }`
    in a method entry)."""
    from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, STRATEGIES
    from fpbench.suites import list_suites

    if presets and what is not Listable.methods:
        raise FpbenchError(f"--presets lists methods' presets; {what.value} have none")

    table = Table(title=what.value)
    table.add_column("name", no_wrap=True)  # names whole: never cut, never folded
    if what is Listable.suites:
        names = _matching(list_suites(), pattern, what)
        table.add_column("cells", justify="right", no_wrap=True)
        # "needs" beside the description only where both get room; else under it
        apart = console.width >= WIDE_SUITES + max(map(len, names))
        if apart:
            table.add_column("needs", overflow="fold")
        table.add_column("description" if apart else "description, needs", overflow="fold")
        for name in names:
            cells, needs, description = suite_row(name)
            if apart:
                table.add_row(name, cells, needs, description)
            else:
                said = needs if needs.startswith("[") else f"needs: {needs}"  # offline, invalid
                table.add_row(name, cells, "\n".join(filter(None, [description, said])))
        console.print(table)
        return
    registry = {
        "methods": METHODS,
        "datasets": DATASETS,
        "partitions": PARTITIONS,
        "backbones": BACKBONES,
        "strategies": STRATEGIES,
    }[what.value]
    rows = [
        (name, _summary_line(registry.get(name)), registry.source(name))
        for name in _matching(registry.names(), pattern, what)
    ]
    if what is Listable.strategies:
        rows = [(n, d + _settings(STRATEGIES.get(n)), s) for n, d, s in rows]
    if what is Listable.methods and (presets or pattern != "*"):
        rows = [r for row in rows for r in [row, *preset_rows(row[0], row[2])]]
    if what is Listable.backbones:  # fpbench.backbones.custom
        rows += [
            ("timm:<model>", "any timm ViT, e.g. timm:deit_small_patch16_224.fb_in1k", "timm"),
            (
                "open_clip:<arch>@<tag>",
                "any CLIP, e.g. open_clip:ViT-B-32@laion2b_s34b_b79k",
                "open_clip",
            ),
        ]
    table.add_column("description", overflow="fold")  # a word wider than the column folds
    table.add_column("source", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _settings(strategy: Any) -> str:
    """A strategy's settings and their defaults, e.g. ' Settings: mu=0.01.'"""
    fields = strategy.Config.model_fields
    shown = ", ".join(f"{k}={f.default!r}" for k, f in fields.items())
    return escape(f" Settings: {shown}.") if shown else " No settings."


def _matching(names: list[str], pattern: str, what: Listable) -> list[str]:
    """The names that match a glob; none is a user error (a typo, most likely)."""
    found = fnmatch.filter(names, pattern)
    if not found:
        raise FpbenchError(
            f"no {what.value} match {pattern!r}; `fpbench list {what.value}` lists all"
        )
    return found


def preset_rows(method: str, source: str) -> list[tuple[str, str, str]]:
    """One row per named preset of a method's config: `method preset=NAME` and its settings."""
    from fpbench.registry import METHODS

    table = getattr(METHODS.get(method).Config, "PRESETS", {})
    return [
        (f"{method} preset={name}", escape(", ".join(f"{k}={v!r}" for k, v in row.items())) or
         "(the defaults)", source)
        for name, row in table.items()
    ]  # fmt: skip


def suite_row(name: str) -> tuple[str, str, str]:
    """(cells, what it needs, description) of a suite: "offline" when every dataset is
    generated and every backbone is built without downloaded weights, else the datasets whose
    files and the backbones whose weights it needs (`fpbench data status`)."""
    from fpbench.data.prepared import real_dataset
    from fpbench.registry import BACKBONES
    from fpbench.suites import load_suite

    try:
        suite = load_suite(name)
    except FpbenchError as e:
        return "-", f"[red]invalid[/]: {escape(str(e))}", ""
    names = {c.dataset.name for c in suite.cells} | {
        t.name for c in suite.cells if c.evaluation for t in c.evaluation.targets
    }  # cross-dataset targets are read too
    data = sorted(n for n in names if real_dataset(n))
    refs = {c.backbone for c in suite.cells} | {
        p.backbone for c in suite.cells if c.model_het for p in c.model_het.profiles if p.backbone
    }
    weights = sorted(
        {r.name for r in refs if r.weights or BACKBONES.get(r.name).pretrained not in OFFLINE}
    )
    needs = [*(f"data {', '.join(data)}" for _ in data[:1])]
    needs += [f"weights {', '.join(weights)}" for _ in weights[:1]]
    first = suite.description.strip().splitlines()[0] if suite.description.strip() else ""
    return str(len(suite.cells)), "; ".join(needs) or "[green]offline[/]", escape(first)


WIDE_SUITES = 100  # columns, besides the longest name, for `list suites`' needs beside the text
OFFLINE = ("none", "smoke", "seeded")  # built without downloaded weights (catalog `pretrained`)


def _summary_line(obj: Any) -> str:
    """A component's description: the first paragraph of its own, its docstring's or its
    module's, its lines joined (a docstring's first line can end mid-sentence)."""
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    for text in (getattr(obj, "description", None), obj.__doc__, getattr(module, "__doc__", None)):
        if isinstance(text, str) and text.strip():
            return " ".join(text.strip().split("\n\n")[0].split())
    return ""


@app.command(short_help="Show one run: identity, status, cost, config, final metrics.")
@user_errors
def show(
    run_ref: Annotated[str, typer.Argument(metavar="RUN", help="run id or run_key prefix")],
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Show one run: its identity, status, what it cost, its config and final metrics."""
    from fpbench.store.claims import CLAIM_TIMEOUT_S, stale_reason
    from fpbench.units import human_bytes, human_flops

    store = open_store(db, must_exist=True)
    record = store.get_run(run_ref)
    stale = stale_reason(record.status, record.owner, record.heartbeat_at, CLAIM_TIMEOUT_S)
    console.print(
        f"[bold]run {record.id}[/] {record.run_key}  status={'stale' if stale else record.status}  "
        f"suite={record.suite} method={record.method} dataset={record.dataset} "
        f"partition={record.partition} seed={record.seed}"
    )
    console.print(
        f"device={record.device} torch={record.torch_version} "
        f"fpbench={record.fpbench_version} git={record.git_commit or '-'} "
        f"wall_s={record.wall_s or 0:.1f}"
    )
    console.print(
        f"peak memory={human_bytes(record.peak_mem_bytes)} "
        f"FLOPs of a round={human_flops(record.round_flops)}"
    )
    if stale:
        console.print(f"stale: running, but {stale}; a rerun takes it over and resumes it")
    if record.error:
        print_error(record.error)
    if record.traceback:
        err.print(record.traceback.rstrip(), markup=False, highlight=False)
    console.print_json(json.dumps(record.config))
    metrics = store.metrics(run_ids=[record.id])
    if not metrics.empty:
        from fpbench.report.tables import is_percent

        last = metrics[metrics["round"] == metrics["round"].max()]
        total = record.config.get("train", {}).get("rounds")
        done = int(last["round"].iloc[0]) + 1  # views number rounds from 1
        table = Table(title=f"aggregates at round {done}" + (f"/{total}" if total else ""))
        table.add_column("metric")
        table.add_column("value", justify="right")
        for name, value in sorted(zip(last["name"], last["value"], strict=True)):
            shown = f"{100 * value:.2f}%" if is_percent(name) else f"{value:.4g}"
            table.add_row(name, shown)
        console.print(table)


class TableFormat(str, Enum):
    md = "md"
    csv = "csv"
    latex = "latex"
    term = "term"


@app.command(short_help="Mean ± std over seeds of each method's final metrics.")
@user_errors
def table(
    suite: Annotated[str | None, typer.Option("--suite", "-s", help="suite name or .toml")] = None,
    metric: Annotated[list[str] | None, typer.Option(help="metric(s) (repeatable)")] = None,
    fmt: Annotated[
        TableFormat, typer.Option("--format", help="md, csv, latex, or term (a terminal table)")
    ] = TableFormat.md,
    ci: Annotated[
        bool,
        typer.Option(
            "--ci", help="also the 95% Student-t confidence interval of the mean over seeds"
        ),
    ] = False,
    out: Annotated[Path | None, typer.Option(help="write to this file instead of stdout")] = None,
    db: DbOpt = DEFAULT_DB,
    paper: Annotated[
        str | None, typer.Option(help="a paper's tables: sgpt, fgpt, pep-fedpt, sdfed, tpfl")
    ] = None,
    table_no: Annotated[
        int | None, typer.Option("--table", help="only this table of --paper")
    ] = None,
    deviations: Annotated[
        bool,
        typer.Option(
            "--deviations",
            help="with --paper (or --suite, a suite with its own protocol): list where "
            "fpbench's protocol departs from its anchor",
        ),
    ] = False,
) -> None:
    """Mean ± std over seeds of each method's final metrics, accuracies in percent.

    A run's final value is its mean over the last train.summary_window evaluations (10 by
    default; the smoke suites use 3), else its last evaluation. --ci adds the 95% Student-t
    confidence interval of the mean over seeds, [low, high] (two or more seeds).
    With --paper: the paper's tables in its layout, fpbench's values beside the paper's.
    With --paper --deviations: every declared deviation from the paper's protocol (table(s),
    cells, config path, the paper's value and source, what fpbench runs, and why); with
    --suite --deviations the same for a suite's own protocol (benchmarks/protocols/). A suite
    whose protocol states a minimum budget fraction notes each method that trains less.
    """
    from fpbench.report.tables import render, summary_table

    if deviations:
        if not paper and not suite:
            raise FpbenchError("--deviations needs --paper NAME or --suite NAME")
        from fpbench.cli.paper import show_deviations, show_suite_deviations

        if paper:
            show_deviations(paper, fmt.value, out)
        else:
            show_suite_deviations(suite_name(suite), fmt.value, out)
        return
    if paper:
        from fpbench.cli.paper import show_paper_tables

        show_paper_tables(db, paper, table_no, fmt.value, out)
        return
    if suite is None:
        raise FpbenchError("give --suite NAME (a suite's summary) or --paper NAME (its tables)")
    from fpbench.cli.summary import finished_results

    name = suite_name(suite)
    frame, notes = finished_results(db, suite, metric or DEFAULT_METRICS)
    if frame.empty and notes:  # runs stored, none done yet
        raise FpbenchError(
            f"no finished runs of suite {suite} yet ({notes[-1]}); "
            f"`fpbench run --suite {suite}` finishes them"
        )
    if ci and not frame.empty and frame.groupby(CELL)["seed"].nunique().max() < 2:
        ci = False  # a Student-t interval needs two seeds: say so instead of a bare title
        notes = ["--ci: every cell has one seed, so no confidence interval (it needs two)", *notes]
    from fpbench.report.federation import table_index

    index = table_index(frame)
    summary = summary_table(frame, metric or DEFAULT_METRICS, index=index, suite=name, ci=ci)
    if fmt is TableFormat.term:
        _print_term(
            summary,
            f"suite {name}: mean ± std over seeds" + (", [95% t-interval]" if ci else ""),
            out,
        )
    elif fmt is TableFormat.md:  # the README's form, its legend a note on stderr
        from fpbench.cli.summary import readme_markdown

        text, legend = readme_markdown(summary)
        write_or_print(text, out)
        notes = [legend, *notes] if legend else notes
    else:
        write_or_print(render(summary, fmt.value), out)
    from fpbench.cli.paper import budget_lines

    for note in notes + budget_lines(name):  # on stderr: the table stays clean to redirect
        err.print(note, highlight=False, soft_wrap=True, markup=False)


CELL = ["method", "dataset", "partition"]


def _print_term(summary: Any, title: str, out: Path | None) -> None:
    """A summary table as a rich terminal table fitted to the width, headed as in the README
    (`path-s4 local mean`), with its legend (recorded to `out` when given)."""
    from rich.console import Console

    from fpbench.cli.common import fit_table
    from fpbench.report.tables import readable_parts

    index_names, headers, rows, legend = readable_parts(summary)
    table = fit_table(title)
    for i, head in enumerate([*index_names, *headers]):
        left = i < len(index_names)
        table.add_column(head, justify="left" if left else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    target = Console(record=True, width=220) if out else console
    target.print(table)
    if legend:
        target.print(legend + " (%)", highlight=False)
    if out:
        write_or_print(target.export_text(), out)


def _suite_metrics(db: str, suite: str) -> tuple[str, Any]:
    """The suite's stored name and its metric rows (`Store.metrics`) from `db`."""
    with open_store(db, must_exist=True) as store:
        name = suite_name(suite)
        return name, store.metrics(suite=name)


@plot_app.command("tradeoff", short_help="Global vs worst local accuracy per method (SGPT Fig. 1).")
@user_errors
def plot_tradeoff(
    suite: SuiteOpt,
    out: PlotOutOpt,
    x: Annotated[str, typer.Option(help="metric on the x axis")] = "acc_global",
    y: Annotated[str, typer.Option(help="metric on the y axis")] = "acc_local_worst",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Global accuracy (x) vs worst local accuracy (y), one marker per method (SGPT Fig. 1)."""
    from fpbench.report.plots import tradeoff

    name, frame = _suite_metrics(db, suite)
    save_figure(tradeoff(frame, x=x, y=y, suite=name), out, pdf_beside=True)


@plot_app.command("curves")
@user_errors
def plot_curves(
    suite: SuiteOpt,
    out: PlotOutOpt,
    metric: Annotated[str, typer.Option(help="metric to plot against rounds")] = "acc_global",
    db: DbOpt = DEFAULT_DB,
) -> None:
    """A metric against communication rounds, one line per method."""
    from fpbench.report.plots import curves

    name, frame = _suite_metrics(db, suite)
    save_figure(curves(frame, metric, suite=name), out, pdf_beside=True)
