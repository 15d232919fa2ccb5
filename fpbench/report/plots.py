"""Figures from the metric table: trade-offs, learning curves, sweeps, heatmaps, communication.

Pure functions on DataFrames shaped like `Store.metrics()` that return a matplotlib `Figure`
built with the object API on an Agg canvas (no pyplot, no global state, no display). Only the
CLI saves figures (`fig.savefig(path)`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

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
    "ece_global": "expected calibration error (global)",
    "ece_local_mean": "mean local expected calibration error",
    "acc_base": "base-class accuracy",
    "acc_novel": "novel-class accuracy",
    "acc_hm": "base-novel harmonic mean",
    "acc_xd_mean": "mean cross-dataset accuracy",
    "acc_lodo": "held-out domain accuracy",
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
    values = final_values(metrics, [x, y], suite=suite)
    labels = [c for c in ["method", *PANEL_KEYS] if c in values.columns]
    wide = values.pivot_table(index=["run_id", *labels], columns="metric", values="value")
    wide = wide.reindex(columns=[x, y])
    short = wide[wide.isna().any(axis=1)]
    lacking = sorted({str(m) for m in short.index.get_level_values("method")})
    wide = wide.dropna().reset_index()
    if wide.empty:
        raise FpbenchError(f"no run has both {x!r} and {y!r}; pick other metrics with --x/--y")
    groups, styles = _panel_groups(wide), _styles(wide["method"])
    fig, axes = _panels(len(groups))
    for ax, (title, rows) in zip(axes, groups, strict=True):
        _tradeoff_panel(ax, rows, x, y, styles)
        ax.set_title(title)
    _suptitle(fig, f"{LABELS.get(y, y)} vs {LABELS.get(x, x)}", suite)
    if lacking:  # a run that did not compute a metric (e.g. train.full_split_clients = "none")
        note = f"not shown, runs without {x} or {y}: {', '.join(lacking)}"
        fig.text(0.01, 0.005, note, fontsize=7, ha="left", va="bottom")
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


ROUND_AXIS = "round (1 = the first)"


def curves(
    metrics: pd.DataFrame, metric: str = "acc_global", *, suite: str | None = None
) -> Figure:
    """`metric` against round: one line per method (mean over seeds, std shaded).

    One subplot per (dataset, partition). Rounds are numbered from 1, as in every view (the
    database's `round` counts from 0).

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
    _suptitle(fig, f"{LABELS.get(metric, metric)} per round", suite)
    return fig


def _curves_panel(
    ax: Axes, rows: pd.DataFrame, metric: str, styles: dict[str, tuple[str, str]]
) -> None:
    """One mean line per method with a shaded +-std band where several seeds exist."""
    scale = _scale(metric)
    for method, part in rows.groupby("method", sort=False):
        color, marker = styles[str(method)]
        stats = part.groupby("round")["value"].agg(["mean", "std", "count"]).sort_index()
        rounds, mean = stats.index.to_numpy() + 1, stats["mean"].to_numpy() * scale
        few = len(rounds) <= FEW_POINTS  # markers only where they do not clutter the line
        ax.plot(rounds, mean, color=color, marker=marker if few else None, label=str(method))
        std = stats["std"].where(stats["count"] > 1).fillna(0.0).to_numpy() * scale
        if (std > 0).any():
            ax.fill_between(rounds, mean - std, mean + std, color=color, alpha=0.2)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(ROUND_AXIS)
    ax.set_ylabel(axis_label(metric))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


# -- held-out, sweeps, heatmaps, communication ---------------------------------------------------


def _suptitle(fig: Figure, what: str, suite: str | None) -> None:
    fig.suptitle(f"{what}\nsuite {suite}" if suite else what, fontsize="medium")


def heldout(
    metrics: pd.DataFrame,
    *,
    x: str = "acc_local_mean",
    y: str = "acc_heldout_mean",
    suite: str | None = None,
) -> Figure:
    """PEP-FedPT Fig. 11: participating-client (x) vs held-out-client (y) accuracy per method.

    Methods with personal inference have no held-out accuracy and are left out.
    """
    fig = tradeoff(metrics, x=x, y=y, suite=suite)
    _suptitle(fig, "participating vs held-out client accuracy", suite)
    return fig


def config_value(config: Mapping[str, Any], param: str) -> Any:
    """`param` in a run config: a dotted path ("train.local_epochs", list items by position:
    "method.args.local_lengths.2") or a key found anywhere."""
    node: Any = config
    for part in param.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, Mapping) and part in node:
            node = node[part]
        else:
            return _find_key(config, param.rsplit(".", 1)[-1])
    return node


def _find_key(node: Any, key: str) -> Any:
    if isinstance(node, Mapping):
        if key in node and not isinstance(node[key], Mapping):
            return node[key]
        for value in node.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def _with_params(
    metrics: pd.DataFrame,
    configs: Mapping[int, Mapping[str, Any]],
    params: Sequence[str],
    metric: str,
    suite: str | None,
) -> pd.DataFrame:
    """Final `metric` per run with its method name (from the config) and `params` columns."""
    values = final_values(metrics, [metric], suite=suite)
    for p in params:
        values[p] = [config_value(configs.get(i, {}), p) for i in values["run_id"]]
    values["family"] = [
        config_value(configs.get(i, {}), "method.name") or m
        for i, m in zip(values["run_id"], values["method"], strict=True)
    ]
    values = values.dropna(subset=list(params))
    if values.empty:
        raise FpbenchError(
            f"no run config has {' and '.join(map(repr, params))}; name a config key, "
            "e.g. train.local_epochs or num_groups"
        )
    return values


def sweep(
    metrics: pd.DataFrame,
    configs: Mapping[int, Mapping[str, Any]],
    param: str,
    metric: str = "acc_global",
    *,
    suite: str | None = None,
) -> Figure:
    """`metric` (mean ± std over seeds) against a swept config value, one line per method.

    Runs are grouped by their method name from the config, so differently labelled runs of
    one method (e.g. one label per group count) form one line. One subplot per
    (dataset, partition).
    """
    values = _with_params(metrics, configs, [param], metric, suite)
    groups, styles = _panel_groups(values), _styles(values["family"])
    fig, axes = _panels(len(groups))
    for ax, (title, rows) in zip(axes, groups, strict=True):
        for family, part in rows.groupby("family", sort=False):
            stats = part.groupby(param)["value"].agg(["mean", "std"]).sort_index()
            color, marker = styles[str(family)]
            ax.errorbar(
                _positions(stats.index),
                stats["mean"] * _scale(metric),
                yerr=stats["std"].fillna(0.0) * _scale(metric),
                color=color,
                marker=marker,
                capsize=3,
                label=str(family),
            )
        _ticks(ax, rows[param])
        ax.set(title=title, xlabel=param, ylabel=axis_label(metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _suptitle(fig, f"{LABELS.get(metric, metric)} vs {param}", suite)
    return fig


def _positions(index: pd.Index) -> list[float]:
    """Numeric sweep values as they are; categorical ones at 0, 1, 2, ..."""
    if pd.api.types.is_numeric_dtype(index):
        return [float(v) for v in index]
    return list(range(len(index)))


def _ticks(ax: Axes, values: pd.Series) -> None:
    labels = sorted(pd.unique(values), key=lambda v: (str(type(v)), v))
    if not pd.api.types.is_numeric_dtype(values):
        ax.set_xticks(range(len(labels)), [str(v) for v in labels])
    elif all(float(v).is_integer() for v in labels):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def heatmap(
    metrics: pd.DataFrame,
    configs: Mapping[int, Mapping[str, Any]],
    x: str,
    y: str,
    metric: str = "acc_global",
    *,
    suite: str | None = None,
) -> Figure:
    """SDFed Fig. 5 style: `metric` (mean over seeds) over a 2-D grid of config values.

    One annotated panel per (method, dataset, partition); empty grid points stay blank.
    """
    values = _with_params(metrics, configs, [x, y], metric, suite)
    keys = [k for k in ["family", *PANEL_KEYS] if k in values.columns]
    panels = list(values.groupby(keys, sort=False))
    fig, axes = _panels(len(panels))
    for ax, (key, rows) in zip(axes, panels, strict=True):
        grid = rows.pivot_table(index=y, columns=x, values="value", aggfunc="mean")
        grid = grid.sort_index().sort_index(axis=1) * _scale(metric)
        image = ax.imshow(grid.to_numpy(dtype=float), cmap="viridis", origin="lower")
        _annotate(ax, grid)
        ax.set_xticks(range(grid.shape[1]), [str(v) for v in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [str(v) for v in grid.index])
        ax.set(title=" / ".join(map(str, key)), xlabel=x, ylabel=y)
        fig.colorbar(image, ax=ax, label=axis_label(metric))
    _suptitle(fig, f"{LABELS.get(metric, metric)} over {x} x {y}", suite)
    return fig


def _annotate(ax: Axes, grid: pd.DataFrame) -> None:
    """Each grid value in its cell, dark on the bright half of the colour map."""
    low, high = grid.min().min(), grid.max().max()
    middle = (low + high) / 2
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            v = grid.iat[i, j]
            if not pd.isna(v):
                color = "k" if high > low and v > middle else "w"
                ax.text(j, i, f"{v:.1f}", ha="center", va="center", color=color, fontsize=8)


def cumulative_cost(metrics: pd.DataFrame, rounds: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Per run and evaluated round: `metric` with the bytes and seconds spent up to that round.

    Args:
        rounds: per-round scalars with a run_id column (bytes_up, bytes_down, wall_s).
    """
    costs = rounds.sort_values(["run_id", "round"]).copy()
    costs["bytes"] = costs["bytes_up"] + costs["bytes_down"]
    costs[["bytes", "wall_s"]] = costs.groupby("run_id")[["bytes", "wall_s"]].cumsum()
    curve = metrics[(metrics["name"] == metric) & metrics["client_id"].isna()]
    curve = curve[[c for c in ["run_id", "method", *PANEL_KEYS, "round", "value"] if c in curve]]
    return curve.merge(costs[["run_id", "round", "bytes", "wall_s"]], on=["run_id", "round"])


def to_target(metrics: pd.DataFrame, rounds: pd.DataFrame, metric: str, target: float):
    """Rounds, seconds and bytes until `metric` first reaches `target` (a fraction for accuracies).

    Returns:
        One row per (method, dataset, partition): reached (runs that got there / runs), and the
        mean rounds, wall_s and bytes over the runs that reached it (NaN where none did).
    """
    cost = cumulative_cost(metrics, rounds, metric)
    hit = cost[cost["value"] >= target].sort_values("round").groupby("run_id").head(1)
    keys = ["method", *PANEL_KEYS]
    runs = cost.groupby(keys, sort=False)["run_id"].nunique().rename("runs")
    reached = hit.assign(rounds=hit["round"] + 1).groupby(keys, sort=False)
    table = reached[["rounds", "wall_s", "bytes"]].mean().join(reached["run_id"].count())
    table = runs.to_frame().join(table.rename(columns={"run_id": "reached"})).reset_index()
    return table.fillna({"reached": 0}).astype({"reached": int})


def comm(
    metrics: pd.DataFrame,
    rounds: pd.DataFrame,
    metric: str = "acc_global",
    *,
    target: float | None = None,
    suite: str | None = None,
) -> Figure:
    """`metric` against cumulative bytes communicated (up + down), one line per method.

    Seeds are averaged per round. With `target`, a dashed line marks it and a star each
    method's first crossing (PEP-FedPT Table 6).
    """
    cost = cumulative_cost(_require(metrics, suite), rounds, metric)
    if cost.empty:
        raise FpbenchError(f"no evaluated rounds of {metric!r} with communication records")
    groups, styles = _panel_groups(cost), _styles(cost["method"])
    fig, axes = _panels(len(groups))
    for ax, (title, rows) in zip(axes, groups, strict=True):
        for method, part in rows.groupby("method", sort=False):
            mean = part.groupby("round")[["bytes", "value"]].mean().sort_index()
            color, marker = styles[str(method)]
            x, y = mean["bytes"] / 1e6, mean["value"] * _scale(metric)
            ax.plot(x, y, color=color, marker=marker, markersize=4, label=str(method))
            if target is not None and (y >= target * _scale(metric)).any():
                first = (y >= target * _scale(metric)).to_numpy().argmax()
                ax.plot(x.iloc[first], y.iloc[first], "*", color=color, markersize=14)
        if target is not None:
            ax.axhline(target * _scale(metric), color="grey", linestyle="--", linewidth=1)
        ax.set(title=title, xlabel="cumulative communication (MB, up + down)")
        ax.set_ylabel(axis_label(metric))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    _suptitle(fig, f"{LABELS.get(metric, metric)} vs communication", suite)
    return fig
