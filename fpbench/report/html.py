"""`fpbench report`: one self-contained HTML page with a suite's tables and plots.

The page carries a header naming the runs behind it (their keys, status, cost, fpbench / torch
versions and devices), one summary table per metric (mean ± std over seeds of each run's final
value and the 95% Student-t interval of the mean, as `fpbench table --ci` prints it) and the
trade-off and learning-curve plots. Plots are embedded as base64 PNGs, so the page is a single
file that can be mailed or attached; the same PNGs are also written beside it for reuse.
`build_report` is pure (DataFrames in, text and bytes out); `write_report` writes the files.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from fpbench.errors import FpbenchError
from fpbench.report import plots
from fpbench.report.tables import (
    finished_only,
    no_results_error,
    seeds_note,
    summary_table,
    unfinished_note,
)
from fpbench.units import human_bytes, human_flops

TABLE_METRICS = (
    "acc_global",
    "acc_local_mean",
    "acc_local_worst",
    "acc_heldout_mean",
    "acc_heldout_worst",
    "ece_global",
    "ece_local_mean",
    "acc_base",  # the evaluation modes (fpbench.engine.eval_modes), where stored
    "acc_novel",
    "acc_hm",
    "acc_xd_mean",
    "acc_lodo",
    "params_trainable",
)
DOMAIN_METRIC = r"acc_domain_[0-9a-z-]+"  # fpbench.engine.metrics.domain_accuracies
CURVE_METRICS = ("acc_global", "acc_local_mean", "acc_local_worst", "loss_train")
RUN_COLUMNS = [
    "id", "run_key", "method", "dataset", "partition", "seed", "status", "rounds", "wall_s",
    *("global %", "local mean %", "local worst %"),
    "peak_mem_bytes", "round_flops", "fpbench_version", "torch_version", "device",
]  # fmt: skip
COST_HEADERS = {"peak_mem_bytes": "peak memory", "round_flops": "FLOPs / round"}
INDEX_FILE = "index.html"
CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f3f3f3; } td:first-child, th:first-child { text-align: left; }
.meta { color: #555; } .missing { color: #a33; }
.plots { display: flex; flex-wrap: wrap; gap: 1rem; align-items: flex-start; }
figure { margin: 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; }
table.runs { font-size: 0.8rem; display: block; max-width: 100%; overflow-x: auto; }
table.runs th, table.runs td { padding: 0.2rem 0.4rem; }
"""


@dataclass(frozen=True)
class Report:
    """The rendered page and the PNGs it embeds (file name -> bytes)."""

    html: str
    images: dict[str, bytes] = field(default_factory=dict)


def build_report(
    metrics: pd.DataFrame, runs: pd.DataFrame, suite: str, *, now: dt.datetime | None = None
) -> Report:
    """The report page of `suite` from its metric rows and its runs (`Store.runs(suite)`).

    Raises:
        FpbenchError: the suite has no metric rows.
    """
    if metrics.empty:
        raise no_results_error(suite)
    runs = with_final_accuracies(runs, metrics)  # every run's, as `fpbench runs` shows them
    metrics, left_out = finished_only(metrics, runs)  # tables and plots: done runs only
    unfinished = unfinished_note(left_out)
    if metrics.empty:
        raise FpbenchError(f"no finished runs of suite {suite} yet ({unfinished})")
    now = now or dt.datetime.now(dt.UTC)
    images: dict[str, bytes] = {}
    body = [
        _header(runs, suite, now),
        "<h2>Summary tables</h2>",
        _note(
            "Mean ± std over seeds of each run's final value (the mean over the last evaluated "
            "rounds), then in brackets the 95% confidence interval of the mean over seeds "
            "(Student t, two or more seeds); accuracies in percent; unfinished runs left out."
        ),
        *([_note(unfinished, "missing")] if unfinished else []),
        *_tables(metrics, suite),
        "<h2>Plots</h2>",
        '<div class="plots">',
        *_figures(metrics, suite, images),
        "</div>",
    ]
    title = f"fpbench report: suite {suite}"
    page = (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{_esc(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
    return Report(page, images)


def write_report(report: Report, out_dir: Path) -> Path:
    """Write `index.html` and the PNGs into `out_dir`; returns the page's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in report.images.items():
        (out_dir / name).write_bytes(data)
    page = out_dir / INDEX_FILE
    page.write_text(report.html, encoding="utf-8")
    return page


def _esc(text: object) -> str:
    return html.escape(str(text))


def _note(text: str, cls: str = "meta") -> str:
    return f'<p class="{cls}">{_esc(text)}</p>'


def _distinct(runs: pd.DataFrame, column: str) -> str:
    values = [str(v) for v in pd.unique(runs[column].dropna())] if column in runs else []
    return ", ".join(values) or "unknown"


def _header(runs: pd.DataFrame, suite: str, now: dt.datetime) -> str:
    """Title, provenance (versions, devices, status counts) and the table of runs."""
    status = runs["status"].value_counts() if len(runs) else pd.Series(dtype=int)
    counts = ", ".join(f"{n} {s}" for s, n in status.items()) or "none"
    n_runs = f"{len(runs)} run{'s' if len(runs) != 1 else ''}"
    lines = [
        f"<h1>fpbench report: suite {_esc(suite)}</h1>",
        _note(f"generated {now:%Y-%m-%d %H:%M} UTC from {n_runs} ({counts})"),
        '<ul class="provenance">',
        f"<li>fpbench: {_esc(_distinct(runs, 'fpbench_version'))}</li>",
        f"<li>torch: {_esc(_distinct(runs, 'torch_version'))}</li>",
        f"<li>devices: {_esc(_distinct(runs, 'device'))}</li>",
        "</ul>",
        "<details open><summary>Runs</summary>",
        _runs_table(runs),
        "</details>",
    ]
    return "\n".join(lines)


FINAL_HEADERS = {
    "acc_global": "global %",
    "acc_local_mean": "local mean %",
    "acc_local_worst": "local worst %",
}


def with_final_accuracies(runs: pd.DataFrame, metrics: pd.DataFrame) -> pd.DataFrame:
    """`runs` with each run's final headline accuracies (%, two decimals; '' for none yet), one
    column per headline metric stored."""
    from fpbench.report.tables import final_values

    names = [n for n in FINAL_HEADERS if metrics["name"].str.startswith(n).any()]
    if not names or runs.empty:
        return runs
    wide = final_values(metrics, names).pivot(index="run_id", columns="metric", values="value")
    out = runs.copy()
    for name in names:
        values = out["id"].map(wide[name]) if name in wide else pd.Series(float("nan"), out.index)
        out[FINAL_HEADERS[name]] = values.map(lambda v: "" if pd.isna(v) else f"{100 * v:.2f}")
    return out


def _runs_table(runs: pd.DataFrame) -> str:
    """The runs, `rounds` being how many are stored (the last is round `rounds`, from 1; 0 before
    the first)."""
    if "last_round" in runs:
        runs = runs.assign(rounds=(runs["last_round"] + 1).fillna(0).astype("Int64"))
    shown = runs.reindex(columns=[c for c in RUN_COLUMNS if c in runs.columns])
    if "wall_s" in shown:
        shown = shown.assign(wall_s=shown["wall_s"].map(lambda v: "" if pd.isna(v) else f"{v:.1f}"))
    for column, fmt in (("peak_mem_bytes", human_bytes), ("round_flops", human_flops)):
        if column in shown:
            shown[column] = shown[column].map(lambda v, f=fmt: "" if pd.isna(v) else f(float(v)))
    shown = shown.rename(columns=COST_HEADERS)
    return shown.to_html(index=False, classes="runs", border=0, na_rep="", escape=True)


def _tables(metrics: pd.DataFrame, suite: str) -> list[str]:
    """One table per stored metric (per-domain ones too): methods x (dataset / partition)."""
    stored = set(metrics["name"])
    domains = sorted(n for n in stored if re.fullmatch(DOMAIN_METRIC, n))
    parts = []
    for metric in [*TABLE_METRICS, *domains]:
        if metric not in stored and not any(n.startswith(f"{metric}_last") for n in stored):
            continue
        table = summary_table(metrics, [metric], suite=suite, ci=True)
        table.columns = [" / ".join(str(x) for x in col[:-1]) for col in table.columns]
        parts.append(f"<h3>{_esc(plots.axis_label(metric))}</h3>")
        # the row labels as a first column: one header row, as in the terminal table
        parts.append(table.reset_index().to_html(index=False, classes="summary", border=0))
        parts.append(_note(seeds_note(metrics, [metric])))
    return parts or [_note("no summary metrics stored", "missing")]


Plot = tuple[str, str, Callable[[], Figure]]  # file name, caption, builder


def _plot_specs(metrics: pd.DataFrame, suite: str) -> list[Plot]:
    specs: list[Plot] = [
        (
            "tradeoff.png",
            "Global accuracy vs worst local accuracy, one marker per method (SGPT Fig. 1).",
            lambda: plots.tradeoff(metrics, suite=suite),
        )
    ]
    stored = set(metrics["name"])
    for metric in [m for m in CURVE_METRICS if m in stored]:
        specs.append(
            (
                f"curves-{metric}.png",
                f"{plots.axis_label(metric).capitalize()} against round, mean over seeds.",
                lambda m=metric: plots.curves(metrics, m, suite=suite),
            )
        )
    return specs


def _figures(metrics: pd.DataFrame, suite: str, images: dict[str, bytes]) -> list[str]:
    """Each plot as an embedded PNG, or a line saying why it could not be drawn."""
    parts = []
    for name, caption, build in _plot_specs(metrics, suite):
        try:
            png = _png(build())
        except FpbenchError as e:
            parts.append(_note(f"{name}: not drawn: {e}", "missing"))
            continue
        images[name] = png
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{_esc(caption)}">'
            f"<figcaption>{_esc(caption)} ({_esc(name)})</figcaption></figure>"
        )
    return parts


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()
