"""Summary tables from the metric table: mean +- std over seeds (optionally with the 95%
Student-t confidence interval of the mean), rendered to Markdown, CSV, LaTeX.

Pure functions on DataFrames shaped like `Store.metrics()`; nothing here opens the database or
writes files. A run's figure for a metric is its `<name>_last<N>` summary row (mean over the last
N evaluated rounds, N = 10 by default) when present, else the metric's value at the last round
it was recorded.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import pandas as pd

from fpbench.errors import FpbenchError

SUMMARY_PATTERN = r"_last\d+"
FORMATS = ("md", "csv", "latex")
MISSING = "-"
RUN_LABELS = ["suite", "method", "learner", "strategy", "dataset", "partition", "seed"]


def no_results_error(suite: str | None = None) -> FpbenchError:
    """The error for an empty selection, naming the command that fills it."""
    if suite:
        return FpbenchError(
            f"no results for suite {suite}; run `fpbench run --suite {suite}` first"
        )
    return FpbenchError("no results in the database; run `fpbench run --suite <name>` first")


UNFINISHED = ("running", "stale", "failed", "interrupted")  # started, not done (pending: no rows)


def finished_only(metrics: pd.DataFrame, runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the metric rows without those of unfinished runs, the unfinished runs with rows): a
    table never shows a cell's value while its run is still at round 2 of 10. `runs` is shaped
    like `Store.runs()`; a run fpbench started writes rows only once it is 'running'."""
    unfinished = runs[runs["status"].isin(UNFINISHED) & runs["last_round"].notna()]
    return metrics[~metrics["run_id"].isin(unfinished["id"])], unfinished


def unfinished_note(left_out: pd.DataFrame, shown: int = 4) -> str | None:
    """'left out 2 unfinished runs: fedvpt / synthetic / dir / seed 1 (running, stored up to
    round 3), ...' (rounds counted from 1, as progress shows them), or None when every run is
    done."""
    if left_out.empty:
        return None
    parts = []
    for r in left_out.head(shown).itertuples():
        stored = (
            "no rounds stored"
            if pd.isna(r.last_round)
            else f"stored up to round {r.last_round + 1}"
        )
        cell = f"{r.method} / {r.dataset} / {r.partition} / seed {r.seed}"
        parts.append(f"{cell} ({r.status}, {stored})")
    more = f", and {len(left_out) - shown} more" if len(left_out) > shown else ""
    noun = "run" if len(left_out) == 1 else "runs"
    return f"left out {len(left_out)} unfinished {noun}: {'; '.join(parts)}{more}"


def seeds_note(
    metrics: pd.DataFrame,
    metric_names: Sequence[str],
    *,
    index: Sequence[str] = ("method",),
    columns: Sequence[str] = ("dataset", "partition"),
) -> str:
    """How many seeds (runs) each cell averages: 'each cell: mean ± std over 3 seeds', or the
    cells whose count differs from the most common one."""
    values = final_values(metrics, metric_names)
    keys = [k for k in (*index, *columns) if k in values.columns]
    n = values.groupby([*keys, "metric"], sort=False)["run_id"].nunique()
    usual = int(n.mode().max())  # the most common count; of a tie, the larger
    odd = n[n != usual]
    text = f"each cell: mean ± std over {usual} seed{'s' if usual != 1 else ''}"
    if odd.empty:
        return text
    cells = [f"{' / '.join(map(str, k[:-1]))} ({k[-1]}): {count}" for k, count in odd.items()]
    shown = "; ".join(cells[:6]) + (f"; and {len(cells) - 6} more" if len(cells) > 6 else "")
    return f"{text}, except {shown}"


def is_percent(metric: str) -> bool:
    """Accuracies are stored as fractions and shown as percent; other metrics as they are."""
    return metric.startswith("acc")


def final_values(
    metrics: pd.DataFrame, metric_names: Sequence[str], *, suite: str | None = None
) -> pd.DataFrame:
    """One value per (run, metric): the `_last<N>` summary if stored, else the last round's value.

    Returns:
        Columns run_id, the run labels present in `metrics`, metric, value.

    Raises:
        FpbenchError: `metrics` is empty, or none of `metric_names` has any rows.
    """
    if metrics.empty:
        raise no_results_error(suite)
    df = metrics.reset_index(drop=True)
    if "client_id" in df.columns:
        df = df[df["client_id"].isna()]
    parts = [_final_of(df, name) for name in metric_names]
    out = pd.concat(parts, ignore_index=True)
    if out.empty:
        known = ", ".join(sorted(set(df["name"]))) or "none"
        raise FpbenchError(f"no rows for metrics {list(metric_names)}; stored metrics: {known}")
    return out


def _final_of(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """Per run: the last `<name>_last<N>` row, or else the last `<name>` row."""
    is_summary = df["name"].str.fullmatch(re.escape(name) + SUMMARY_PATTERN)
    summary = _last_row_per_run(df[is_summary])
    plain = _last_row_per_run(df[df["name"] == name])
    plain = plain[~plain["run_id"].isin(summary["run_id"])]
    both = pd.concat([summary, plain]).sort_index()  # keep the input's run order
    labels = [c for c in RUN_LABELS if c in df.columns]
    out = both[["run_id", *labels, "value"]].assign(metric=name)
    return out[["run_id", *labels, "metric", "value"]]


def _last_row_per_run(df: pd.DataFrame) -> pd.DataFrame:
    return df.loc[df.groupby("run_id", sort=False)["round"].idxmax()] if len(df) else df


Order = Mapping[str, Sequence[object]]


CI_LEVEL = 0.95


def t_interval(
    mean: float, std: float, n: int, level: float = CI_LEVEL
) -> tuple[float, float] | None:
    """The Student-t confidence interval of a mean over `n` seeds with sample std `std`:
    mean ± t_{(1+level)/2, n-1} * std / sqrt(n). None for fewer than two seeds."""
    from scipy import stats

    if n < 2 or pd.isna(std) or pd.isna(mean):
        return None
    half = float(stats.t.ppf((1 + level) / 2, n - 1)) * float(std) / float(n) ** 0.5
    return float(mean) - half, float(mean) + half


def summary_stats(
    metrics: pd.DataFrame,
    metric_names: Sequence[str],
    *,
    index: Sequence[str] = ("method",),
    columns: Sequence[str] = ("dataset", "partition"),
    order: Order | None = None,
    ddof: int = 1,
    suite: str | None = None,
) -> pd.DataFrame:
    """Mean, std (sample std, `ddof`) and n over runs (seeds) of each run's final value.

    Args:
        order: explicit label order per column, e.g. {"method": ["fedavg", "sgpt"]}; unlisted
            labels follow in first-seen order. Metrics follow `metric_names`.

    Returns:
        Long frame with the `index` and `columns` labels, metric, mean, std, n, ci_low and
        ci_high (the 95% Student-t interval of the mean, NaN under two seeds; fractions, not
        percent).
    """
    values = final_values(metrics, metric_names, suite=suite)
    keys = [*index, *columns]
    codes = _codes(values, keys, metric_names, order or {})
    stats = _stats(values, [*keys, "metric"], ddof, codes)
    ci = [t_interval(m, s, n) or (float("nan"),) * 2 for m, s, n in _msn(stats)]
    return stats.assign(ci_low=[c[0] for c in ci], ci_high=[c[1] for c in ci])


def _msn(stats: pd.DataFrame):
    return zip(stats["mean"], stats["std"], stats["n"], strict=True)


def _codes(
    values: pd.DataFrame, keys: Sequence[str], metric_names: Sequence[str], order: Order
) -> dict[str, dict[object, int]]:
    """Sort position of every label: given order first, then first-seen order."""
    missing = [k for k in keys if k not in values.columns]
    if missing:
        raise FpbenchError(f"cannot group by {missing}: the metric table has no such columns")
    codes = {}
    for key in keys:
        seen = list(order.get(key, ())) + list(pd.unique(values[key]))
        codes[key] = {label: i for i, label in enumerate(dict.fromkeys(seen))}
    codes["metric"] = {name: i for i, name in enumerate(metric_names)}
    return codes


def _sorted(frame: pd.DataFrame, codes: dict[str, dict[object, int]]) -> pd.DataFrame:
    keys = list(frame.columns.intersection(list(codes), sort=False))
    out = frame.sort_values(keys, key=lambda col: col.map(codes[col.name]), kind="stable")
    return out.reset_index(drop=True)


def _stats(
    values: pd.DataFrame, keys: list[str], ddof: int, codes: dict[str, dict[object, int]]
) -> pd.DataFrame:
    grouped = values.groupby(keys, sort=False)["value"]
    stats = grouped.agg(mean="mean", std=lambda v: v.std(ddof=ddof), n="count").reset_index()
    return _sorted(stats, codes)


def format_cell(mean: float, std: float, n: int, metric: str, *, ci: bool = False) -> str:
    """'83.41 ± 0.52' for accuracies (percent); the std is omitted for a single run.

    With `ci`, the 95% Student-t interval of the mean follows: '83.41 ± 0.52 [82.12, 84.70]'
    (two or more seeds). Other metrics print whole numbers as integers (`params_trainable`
    2580, not 2580.00).
    """
    if pd.isna(mean):
        return MISSING
    percent = is_percent(metric)
    scale = 100.0 if percent else 1.0
    text = _number(mean * scale, percent)
    if n > 1 and not pd.isna(std):
        text += f" ± {_number(std * scale, percent)}"
    if ci and (interval := t_interval(mean, std, n)) is not None:
        low, high = (_number(v * scale, percent) for v in interval)
        text += f" [{low}, {high}]"
    return text


def _number(value: float, percent: bool) -> str:
    if not percent and float(value).is_integer():
        return f"{int(value)}"
    return f"{value:.2f}"


def summary_table(
    metrics: pd.DataFrame,
    metric_names: Sequence[str],
    *,
    index: Sequence[str] = ("method",),
    columns: Sequence[str] = ("dataset", "partition"),
    order: Order | None = None,
    ddof: int = 1,
    suite: str | None = None,
    ci: bool = False,
) -> pd.DataFrame:
    """Paper-style table of "mean ± std" strings (percent for accuracies) over seeds; with
    `ci`, each followed by the 95% Student-t confidence interval of the mean, "[low, high]".

    Rows: the `index` labels (methods), in `order` or first-seen order. Columns: a MultiIndex
    of the `columns` labels plus the metric, e.g. (dataset, partition, metric), metrics in the
    order given. Missing cells are "-". See `summary_stats` for the numbers behind it.
    """
    values = final_values(metrics, metric_names, suite=suite)
    codes = _codes(values, [*index, *columns], metric_names, order or {})
    col_keys = [*columns, "metric"]
    stats = _stats(values, [*index, *col_keys], ddof, codes)
    cells = [
        format_cell(m, s, n, name, ci=ci)
        for m, s, n, name in zip(
            stats["mean"], stats["std"], stats["n"], stats["metric"], strict=True
        )
    ]
    table = stats.assign(cell=cells).pivot(index=list(index), columns=col_keys, values="cell")
    rows = _sorted(stats[list(index)].drop_duplicates(), codes)
    cols = _sorted(stats[col_keys].drop_duplicates(), codes)
    table = table.reindex(index=_as_index(rows), columns=pd.MultiIndex.from_frame(cols))
    return table.fillna(MISSING)


def _as_index(frame: pd.DataFrame) -> pd.Index:
    if frame.shape[1] == 1:
        return pd.Index(frame.iloc[:, 0], name=frame.columns[0])
    return pd.MultiIndex.from_frame(frame)


# -- rendering -------------------------------------------------------------------------------


def render(table: pd.DataFrame, fmt: str) -> str:
    """Render a table as Markdown ("md"), CSV ("csv") or LaTeX booktabs ("latex").

    Raises:
        FpbenchError: unknown `fmt`.
    """
    renderers = {"md": _to_markdown, "csv": _to_csv, "latex": _to_latex}
    if fmt not in renderers:
        raise FpbenchError(f"unknown table format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return renderers[fmt](table)


def _cell(value: object) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _parts(table: pd.DataFrame) -> tuple[list[str], list[tuple[str, ...]], list[list[str]]]:
    """(index names, column label tuples, body rows with index cells first)."""
    show_index = any(name is not None for name in table.index.names)
    index_names = [str(n) for n in table.index.names] if show_index else []
    columns = [tuple(str(x) for x in (c if isinstance(c, tuple) else (c,))) for c in table.columns]
    rows = []
    for key, row in zip(table.index, table.itertuples(index=False), strict=True):
        keys = list(key) if isinstance(key, tuple) else [key]
        rows.append([_cell(k) for k in keys][: len(index_names)] + [_cell(v) for v in row])
    return index_names, columns, rows


def flat_parts(table: pd.DataFrame) -> tuple[list[str], list[str], list[list[str]]]:
    """(index names, column headers joined by " / ", body rows) for a terminal table."""
    index_names, columns, rows = _parts(table)
    return index_names, [" / ".join(c) for c in columns], rows


SHORT_METRICS = {
    "acc_global": "global",
    "acc_local_mean": "local mean",
    "acc_local_worst": "local worst",
}


def readable_parts(table: pd.DataFrame) -> tuple[list[str], list[str], list[list[str]], str]:
    """(index names, headers, body rows, legend) for a table read by a person, in the README's
    form: header levels every column shares (one dataset) left out and named in the legend,
    metrics by their short names (`path-s4 global`, `path-s4 local mean`)."""
    index_names, columns, rows = _parts(table)
    depth = max((len(c) for c in columns), default=0)
    shared = [i for i in range(depth - 1) if len({c[i] for c in columns if len(c) == depth}) == 1]
    headers, shortened = [], {}
    for c in columns:
        kept = [x for i, x in enumerate(c) if i not in shared or len(c) != depth]
        if kept and kept[-1] in SHORT_METRICS:
            shortened[SHORT_METRICS[kept[-1]]] = kept[-1]
            kept[-1] = SHORT_METRICS[kept[-1]]
        headers.append(" ".join(kept))
    legend = [f"{short} = {name}" for short, name in shortened.items()]
    if shared and columns:
        legend.insert(0, "all columns: " + " / ".join(columns[0][i] for i in shared))
    return index_names, headers, rows, "; ".join(legend)


def _to_csv(table: pd.DataFrame) -> str:
    index_names, columns, rows = _parts(table)
    header = index_names + ["/".join(c) for c in columns]
    flat = pd.DataFrame(rows, columns=header)
    return flat.to_csv(index=False, lineterminator="\n")


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _to_markdown(table: pd.DataFrame) -> str:
    index_names, columns, rows = _parts(table)
    header = index_names + [" / ".join(c) for c in columns]
    align = [":--"] * len(index_names) + ["--:"] * len(columns)
    lines = [header, align, *rows]
    return "\n".join("| " + " | ".join(_md_escape(c) for c in line) + " |" for line in lines) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "±": r"$\pm$",
}


def _tex(text: str) -> str:
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def _spans(labels: list[tuple[str, ...]], level: int) -> list[tuple[str, int, int]]:
    """Runs of equal column prefixes at `level`: (label, first column, width)."""
    spans: list[tuple[str, int, int]] = []
    for i, label in enumerate(labels):
        prefix = label[: level + 1]
        if spans and labels[spans[-1][1]][: level + 1] == prefix:
            text, start, width = spans[-1]
            spans[-1] = (text, start, width + 1)
        else:
            spans.append((label[level], i, 1))
    return spans


def _latex_header(index_names: list[str], columns: list[tuple[str, ...]]) -> list[str]:
    n_levels = max((len(c) for c in columns), default=1)
    offset = len(index_names)
    lines = []
    for level in range(n_levels):
        last = level == n_levels - 1
        lead = [_tex(n) if last else "" for n in index_names]
        cells, rules = [], []
        for text, start, width in _spans(columns, level):
            cells.append(
                _tex(text) if width == 1 else rf"\multicolumn{{{width}}}{{c}}{{{_tex(text)}}}"
            )
            if not last:
                rules.append(rf"\cmidrule(lr){{{offset + start + 1}-{offset + start + width}}}")
        lines.append(" & ".join(lead + cells) + r" \\")
        if rules:
            lines.append(" ".join(rules))
    return lines


def _to_latex(table: pd.DataFrame) -> str:
    index_names, columns, rows = _parts(table)
    spec = "l" * len(index_names) + "r" * len(columns)
    body = [" & ".join(_tex(c) for c in row) + r" \\" for row in rows]
    lines = [
        rf"\begin{{tabular}}{{{spec}}}",
        r"\toprule",
        *_latex_header(index_names, columns),
        r"\midrule",
        *body,
        r"\bottomrule",
        r"\end{tabular}",
    ]
    return "\n".join(lines) + "\n"
