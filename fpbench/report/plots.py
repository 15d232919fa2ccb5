"""Figures from the metric table: the global-vs-worst-local trade-off and learning curves.

Pure functions on DataFrames shaped like `Store.metrics()` that return a matplotlib `Figure`
built with the object API on an Agg canvas (no pyplot, no global state, no display). Only the
CLI saves figures (`fig.savefig(path)`).
"""

from __future__ import annotations

import math

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from fpbench.errors import FpbenchError
from fpbench.report.tables import final_values, is_percent, no_results_error

PANEL_KEYS = ["dataset", "partition"]
MAX_PANEL_COLS = 3
MARKERS = "osD^vP*Xh<>p"
FEW_POINTS = 25
LABELS = {
    "acc_global": "global accuracy",
    "acc_pooled": "pooled accuracy",
    "acc_local_mean": "mean local accuracy",
    "acc_local_worst": "worst local accuracy",
    "acc_heldout_mean": "mean held-out accuracy",
    "acc_heldout_worst": "worst held-out accuracy",
    "loss_train": "training loss",
}


def axis_label(metric: str) -> str:
    """Readable axis label, with (%) for accuracies."""
    label = LABELS.get(metric, metric.replace("_", " "))
    return f"{label} (%)" if is_percent(metric) else label


def _scale(metric: str) -> float:
    return 100.0 if is_percent(metric) else 1.0


def _panels(n: int, *, width: float = 4.5, height: float = 3.8) -> tuple[Figure, list[Axes]]:
    """A figure on an Agg canvas with `n` subplots in a grid of at most 3 columns."""
    ncols = min(n, MAX_PANEL_COLS)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n)]
    return fig, axes


def _styles(methods: pd.Series) -> dict[str, tuple[str, str]]:
    """(color, marker) per method, fixed across panels, in first-seen order."""
    return {
        str(m): (f"C{i % 10}", MARKERS[i % len(MARKERS)]) for i, m in enumerate(pd.unique(methods))
    }


def _panel_groups(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per (dataset, partition), in first-seen order."""
    keys = [k for k in PANEL_KEYS if k in df.columns]
    if not keys:
        return [("", df)]
    groups = df.groupby(keys, sort=False)
    return [(" / ".join(str(k) for k in key), rows) for key, rows in groups]


def _require(df: pd.DataFrame, suite: str | None) -> pd.DataFrame:
    if df.empty:
        raise no_results_error(suite)
    if "client_id" in df.columns:
        df = df[df["client_id"].isna()]
    return df


def tradeoff(
    metrics: pd.DataFrame,
    *,
    x: str = "acc_global",
    y: str = "acc_local_worst",
    suite: str | None = None,
) -> Figure:
    """SGPT Fig. 1 style trade-off: one labelled marker per method (mean over seeds).

    Each run contributes its `_last<N>` summary of `x` and `y` (else its last value); error bars
    show the std over seeds when a method has more than one. One subplot per
    (dataset, partition).

    Raises:
        FpbenchError: no rows, or no run has both metrics.
    """
    values = final_values(_require(metrics, suite), [x, y], suite=suite)
    labels = [c for c in ["method", *PANEL_KEYS] if c in values.columns]
    wide = values.pivot_table(index=["run_id", *labels], columns="metric", values="value")
    wide = wide.reindex(columns=[x, y]).dropna().reset_index()
    if wide.empty:
        raise FpbenchError(f"no run has both {x!r} and {y!r}; pick other metrics with --x/--y")
    groups, styles = _panel_groups(wide), _styles(wide["method"])
    fig, axes = _panels(len(groups))
    for ax, (title, rows) in zip(axes, groups, strict=True):
        _tradeoff_panel(ax, rows, x, y, styles)
        ax.set_title(title)
    return fig


def _tradeoff_panel(
    ax: Axes, rows: pd.DataFrame, x: str, y: str, styles: dict[str, tuple[str, str]]
) -> None:
    """One marker with std error bars per method, annotated with its name."""
    stats = rows.groupby("method", sort=False)[[x, y]].agg(["mean", "std", "count"])
    sx, sy = _scale(x), _scale(y)
    for i, (method, row) in enumerate(stats.iterrows()):
        color, marker = styles[str(method)]
        several = row[(x, "count")] > 1
        mx, my = row[(x, "mean")] * sx, row[(y, "mean")] * sy
        ax.errorbar(
            mx,
            my,
            xerr=row[(x, "std")] * sx if several else None,
            yerr=row[(y, "std")] * sy if several else None,
            fmt=marker,
            color=color,
            markersize=8,
            capsize=3,
            label=str(method),
        )
        # staggered offsets keep the names of (nearly) coinciding methods readable
        offset = (6, 6 - 12 * (i % 3))
        ax.annotate(str(method), (mx, my), xytext=offset, textcoords="offset points")
    ax.set_xlabel(axis_label(x))
    ax.set_ylabel(axis_label(y))
    ax.grid(alpha=0.3)
    ax.margins(0.15)


def curves(
    metrics: pd.DataFrame, metric: str = "acc_global", *, suite: str | None = None
) -> Figure:
    """`metric` against round: one line per method (mean over seeds, std shaded).

    One subplot per (dataset, partition).

    Raises:
        FpbenchError: no rows, or no rows for `metric`.
    """
    aggregates = _require(metrics, suite)
    df = aggregates[aggregates["name"] == metric]
    if df.empty:
        known = ", ".join(sorted(set(aggregates["name"])))
        raise FpbenchError(f"no rows for metric {metric!r}; stored metrics: {known}")
    groups, styles = _panel_groups(df), _styles(df["method"])
    fig, axes = _panels(len(groups))
    for ax, (title, rows) in zip(axes, groups, strict=True):
        _curves_panel(ax, rows, metric, styles)
        ax.set_title(title)
    return fig


def _curves_panel(
    ax: Axes, rows: pd.DataFrame, metric: str, styles: dict[str, tuple[str, str]]
) -> None:
    """One mean line per method with a shaded +-std band where several seeds exist."""
    scale = _scale(metric)
    for method, part in rows.groupby("method", sort=False):
        color, marker = styles[str(method)]
        stats = part.groupby("round")["value"].agg(["mean", "std", "count"]).sort_index()
        rounds, mean = stats.index.to_numpy(), stats["mean"].to_numpy() * scale
        few = len(rounds) <= FEW_POINTS  # markers only where they do not clutter the line
        ax.plot(rounds, mean, color=color, marker=marker if few else None, label=str(method))
        std = stats["std"].where(stats["count"] > 1).fillna(0.0).to_numpy() * scale
        if (std > 0).any():
            ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(axis_label(metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
