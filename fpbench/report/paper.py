"""The papers' result tables re-rendered from the results database beside their reported values.

A paper is a data file `benchmarks/papers/<paper>.toml`: per table its caption, rows, columns
(with column groups), the reported values (one string per cell: "mean ± std", "mean (spread)"
or a plain number; "-", "NA" or "N/A" where the paper leaves the cell empty) and which runs fill
each cell. A cell's run selection merges, later winning: the table's `suite`, `metric`,
`scale`, `unit`, `rank`, `higher_is_better`; the row's fields; the column's fields; and an
optional `[tables.cells]` entry "row.column". Selection fields are `suite`, `method`,
`dataset`, `partition` (run labels) and `config` (a nested table that must be contained in the
run's resolved config); `needs` names an input the runs need first, which an empty cell shows.
A metric is an aggregate name (its `_last<N>` summary is used) or a
derived one computed from the curve of `target_metric`: `rounds_to_target`,
`wall_s_to_target`, `bytes_to_target` (up + down), `params_to_target` (fp32 parameters sent
down to one client: bytes_down / 4 / the cell's `clients_per_round`); `wall_s_per_round` is the
median of a run's measured round times (a median, so the rounds that also evaluate do not weigh).
A column with `mean_of = [keys]` or `hm_of = [key, key]` selects no runs: it averages (or takes
the harmonic mean of) the row's values in those columns to its left (the field's "Average").

A `[[figures]]` entry (`name`, `suite`, `tables`, `caption`) names a suite that draws one of the
paper's figures (with `fpbench plot`) and the tables whose protocol its cells run: they are
checked as cells feeding those tables (`fpbench.report.protocol.feeding_cells`).

Adding a paper or table is a new data file or a new `[[tables]]` entry, not new code.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import tomllib

from fpbench.errors import FpbenchError
from fpbench.report.tables import final_values, is_percent
from fpbench.shipped import shipped_dir

PAPERS_DIR = shipped_dir() / "papers"
EMPTY = frozenset({"", "-", "–", "—", "NA", "N/A", "n/a"})
SELECT = ("suite", "method", "dataset", "partition")
DERIVED = ("rounds_to_target", "wall_s_to_target", "bytes_to_target", "params_to_target")
_NUMBER = re.compile(
    r"^(?P<bound>[<>]?)\s*(?P<value>-?\d+(?:\.\d+)?)\s*(?P<suffix>[kKMG%])?"
    r"\s*(?:±\s*(?P<pm>\d+(?:\.\d+)?)|\(\s*(?P<paren>\d+(?:\.\d+)?)\s*\))?$"
)


@dataclass(frozen=True)
class Reported:
    """One value as the paper prints it: `text`, and the number in it where there is one."""

    text: str
    value: float | None = None
    spread: float | None = None
    bound: str = ""

    @property
    def empty(self) -> bool:
        return self.text.strip() in EMPTY


def parse_reported(text: str) -> Reported:
    """'84.16 ± 0.24', '81.09 (0.40)', '7.7 M', '>100', '0.1M', 'NA' -> a Reported."""
    text = str(text).strip()
    m = _NUMBER.match(text)
    if text in EMPTY or m is None:
        return Reported(text)
    spread = m["pm"] or m["paren"]
    return Reported(
        text, float(m["value"]), None if spread is None else float(spread), m["bound"] or ""
    )


@dataclass(frozen=True)
class Line:
    """A row or a column of a paper table: its key, label, group path and run fields."""

    key: str
    label: str
    group: tuple[str, ...] = ()
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PaperTable:
    """One table of a paper: layout, reported values and how runs fill its cells."""

    paper: str
    number: int
    caption: str
    rows: tuple[Line, ...]
    columns: tuple[Line, ...]
    values: Mapping[tuple[str, str], Reported]
    defaults: Mapping[str, Any]
    cells: Mapping[tuple[str, str], Mapping[str, Any]]
    row_title: str = "Method"
    note: str = ""

    def count(self) -> int:
        """How many cells the paper fills (empty cells are not counted)."""
        return sum(not v.empty for v in self.values.values())

    def spec(self, row: Line, col: Line) -> dict[str, Any]:
        """The merged fields that select and scale this cell's runs."""
        out: dict[str, Any] = {}
        for part in (self.defaults, row.fields, col.fields, self.cells.get((row.key, col.key))):
            for k, v in (part or {}).items():
                out[k] = _merge(out[k], v) if k == "config" and k in out else v
        return out


@dataclass(frozen=True)
class Figure:
    """A figure of the paper drawn from `suite`, whose cells run the protocol of `tables`."""

    name: str
    suite: str
    tables: tuple[int, ...]
    caption: str = ""


@dataclass(frozen=True)
class Paper:
    name: str
    title: str
    source: str
    tables: tuple[PaperTable, ...]
    figures: tuple[Figure, ...] = ()

    def table(self, number: int) -> PaperTable:
        for t in self.tables:
            if t.number == number:
                return t
        have = ", ".join(str(t.number) for t in self.tables)
        raise FpbenchError(f"paper {self.name} has no table {number}; --table is one of {have}")


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return {**a, **{k: _merge(a[k], v) if k in a else v for k, v in b.items()}}
    return b


# -- loading ---------------------------------------------------------------------------------


def list_papers(root: Path = PAPERS_DIR) -> list[str]:
    """Names of the papers with a data file under `root`."""
    return sorted(p.stem for p in root.glob("*.toml"))


def paper_data(name: str, root: Path = PAPERS_DIR) -> dict[str, Any]:
    """The parsed `<root>/<name>.toml` (tables, protocol and readings read from it).

    Raises:
        FpbenchError: unknown paper, or a file that is not valid TOML.
    """
    path = root / f"{name}.toml"
    if not path.is_file():
        raise FpbenchError(f"unknown paper {name!r}; choose one of {', '.join(list_papers(root))}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise FpbenchError(f"{path} is not valid TOML: {exc}") from exc


def load_paper(name: str, root: Path = PAPERS_DIR) -> Paper:
    """Read and check `<root>/<name>.toml`.

    Raises:
        FpbenchError: unknown paper, or a table whose rows do not match its columns.
    """
    path = root / f"{name}.toml"
    data = paper_data(name, root)
    tables = tuple(sorted((_table(name, path, t) for t in data.get("tables", [])),
                          key=lambda t: t.number))  # fmt: skip
    numbers = {t.number for t in tables}
    figures = tuple(_figure(path, f, numbers) for f in data.get("figures", []))
    return Paper(name, data.get("title", name), data.get("source", ""), tables, figures)


def _figure(path: Path, f: Mapping[str, Any], numbers: set[int]) -> Figure:
    where = f"{path.name} figure {f.get('name', '?')!r}"
    unknown = sorted(set(f) - {"name", "suite", "tables", "caption"})
    if unknown or not {"name", "suite", "tables"} <= set(f):
        raise FpbenchError(
            f"{where}: needs name, suite and tables (and a caption); got {sorted(f)}"
        )
    tables = tuple(int(n) for n in f["tables"])
    if not tables or set(tables) - numbers:
        raise FpbenchError(f"{where}: tables {list(tables)}; the paper has {sorted(numbers)}")
    return Figure(str(f["name"]), str(f["suite"]), tables, str(f.get("caption", "")))


def _line(d: Mapping[str, Any]) -> Line:
    fields = {k: v for k, v in d.items() if k not in ("key", "label", "group")}
    return Line(str(d["key"]), str(d["label"]), tuple(d.get("group", ())), fields)


def _table(paper: str, path: Path, t: Mapping[str, Any]) -> PaperTable:
    where = f"{path.name} table {t.get('number')}"
    rows, cols = tuple(map(_line, t["rows"])), tuple(map(_line, t["columns"]))
    values = {}
    for row in rows:
        cells = t.get("values", {}).get(row.key)
        if cells is None or len(cells) != len(cols):
            raise FpbenchError(f"{where}: row {row.key!r} needs {len(cols)} values, one per column")
        for col, text in zip(cols, cells, strict=True):
            values[(row.key, col.key)] = parse_reported(text)
    overrides = {tuple(k.split(".", 1)): v for k, v in t.get("cells", {}).items()}
    keep = ("suite", "metric", "scale", "unit", "rank", "higher_is_better", "config")
    return PaperTable(
        paper=paper,
        number=int(t["number"]),
        caption=t.get("caption", ""),
        rows=rows,
        columns=cols,
        values=values,
        defaults={k: t[k] for k in keep if k in t},
        cells=overrides,
        row_title=t.get("row_title", "Method"),
        note=t.get("note", ""),
    )


# -- fpbench's values --------------------------------------------------------------------------


@dataclass(frozen=True)
class Results:
    """What the renderer reads from the store: metric rows, run configs, per-round scalars."""

    metrics: pd.DataFrame
    configs: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    rounds: pd.DataFrame | None = None


def load_results(store: Any, suites: list[str] | None = None) -> Results:
    """Aggregate metric rows, configs and rounds of the runs of `suites` (all when None); a run
    still going, failed or interrupted fills no cell (`tables.finished_only`)."""
    from fpbench.report.tables import finished_only

    parts = [store.metrics(suite=s) for s in suites] if suites else [store.metrics()]
    metrics = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()
    if len(metrics):
        metrics = finished_only(metrics, store.runs())[0]
    ids = sorted(set(metrics["run_id"])) if len(metrics) else []
    configs = {i: store.get_run(i).config for i in ids}
    rounds = [store.rounds(i).assign(run_id=i) for i in ids]
    return Results(metrics, configs, pd.concat(rounds, ignore_index=True) if rounds else None)


@dataclass(frozen=True)
class Cell:
    """One rendered cell: the paper's value and fpbench's mean ± std over `n` runs."""

    row: str
    column: str
    spec: Mapping[str, Any]
    reported: Reported
    mean: float | None = None
    std: float | None = None
    n: int = 0
    mark: str = ""  # "best" / "second" among fpbench's values
    paper_mark: str = ""  # the same among the paper's values
    runs: int = 0  # stored runs the cell selects, with or without its metric
    not_computed: str = ""  # the runs' train.full_split_clients where it left the metric out

    @property
    def diff(self) -> float | None:
        if self.mean is None or self.reported.value is None:
            return None
        return self.mean - self.reported.value

    def hint(self) -> str:
        """Which suite and cell would fill this one."""
        spec = self.spec
        if not spec.get("method") or not spec.get("metric"):
            return "reference only (not produced by fpbench)"
        labels = "/".join(str(spec[k]) for k in ("method", "dataset", "partition") if k in spec)
        if spec.get("needs"):  # an input the runs need first (e.g. GPT-FL's generated images)
            return f"needs {spec['needs']} (suite {spec.get('suite', '?')}: {labels})"
        extra = f" {_flat(spec['config'])}" if spec.get("config") else ""
        if self.runs and not self.n and self.not_computed:
            return f"{self.runs} run(s) of {labels}{extra} did not compute {spec['metric']} " + (
                f"(train.full_split_clients = {self.not_computed})"
            )
        if self.runs and not self.n:
            return f"{self.runs} run(s) of {labels}{extra} lack metric {spec['metric']}"
        return f"needs suite {spec.get('suite', '?')}: {labels}{extra} · {spec['metric']}"


def _flat(config: Mapping[str, Any], prefix: str = "") -> str:
    """{"train": {"local_epochs": 2}} -> "train.local_epochs=2"."""
    parts = []
    for k, v in config.items():
        if isinstance(v, Mapping):
            parts.append(_flat(v, f"{prefix}{k}."))
        else:
            parts.append(f"{prefix}{k}={v}")
    return " ".join(parts)


def scale_of(spec: Mapping[str, Any]) -> float:
    """Factor from stored values to the paper's units (accuracy fractions -> percent)."""
    if "scale" in spec:
        return float(spec["scale"])
    return 100.0 if is_percent(str(spec.get("metric", ""))) else 1.0


def _matching_runs(results: Results, spec: Mapping[str, Any]) -> list[int]:
    df = results.metrics
    if df.empty or not spec.get("method") or not spec.get("metric"):
        return []
    mask = pd.Series(True, index=df.index)
    for k in SELECT:
        if k in spec and k in df.columns:
            mask &= df[k] == spec[k]
    ids = list(dict.fromkeys(df.loc[mask, "run_id"]))
    want = spec.get("config")
    return [i for i in ids if not want or _contains(results.configs.get(i, {}), want)]


def _contains(have: Any, want: Any) -> bool:
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            k in have and _contains(have[k], v) for k, v in want.items()
        )
    return have == want


def run_values(results: Results, spec: Mapping[str, Any]) -> list[float]:
    """One value per matching run, in the paper's units."""
    ids = _matching_runs(results, spec)
    if not ids:
        return []
    metric = str(spec["metric"])
    if metric == "wall_s_per_round":
        raw = [_median_round_time(results, i) for i in ids]
    elif metric in DERIVED:
        raw = [_to_target(results, i, spec) for i in ids]
    else:
        rows = results.metrics[results.metrics["run_id"].isin(ids)]
        try:
            raw = list(final_values(rows, [metric])["value"])
        except FpbenchError:
            return []
    return [v * scale_of(spec) for v in raw if v is not None and not math.isnan(v)]


def _median_round_time(results: Results, run_id: int) -> float | None:
    if results.rounds is None:
        return None
    times = results.rounds.loc[results.rounds["run_id"] == run_id, "wall_s"]
    return float(times.median()) if len(times) else None


def _to_target(results: Results, run_id: int, spec: Mapping[str, Any]) -> float | None:
    """Rounds, seconds, bytes or parameters spent until `target_metric` first reaches `target`."""
    metric, target = spec.get("target_metric", "acc_global"), float(spec.get("target", 0))
    df = results.metrics
    curve = df[(df["run_id"] == run_id) & (df["name"] == metric)].sort_values("round")
    hit = curve[curve["value"] >= target]
    if hit.empty or results.rounds is None:
        return None
    last = int(hit["round"].iloc[0])
    spent = results.rounds[(results.rounds["run_id"] == run_id) & (results.rounds["round"] <= last)]
    total_bytes = float(spent["bytes_up"].sum() + spent["bytes_down"].sum())
    kind = spec["metric"]
    if kind == "rounds_to_target":
        return float(last + 1)  # rounds are counted from 0
    if kind == "wall_s_to_target":
        return float(spent["wall_s"].sum())
    if kind == "params_to_target":  # fp32 parameters sent to one client, summed over rounds
        return float(spent["bytes_down"].sum()) / 4 / float(spec.get("clients_per_round", 1))
    return total_bytes


FULL_SPLIT_METRICS = frozenset({"acc_global", "f1_macro_global", "ece_global"})


def _full_split_setting(results: Results, ids: list[int], metric: str) -> str:
    """The runs' `train.full_split_clients` where it is not "all" and the metric is one of the
    full-split metrics it can leave out ("" otherwise)."""
    if metric not in FULL_SPLIT_METRICS and not metric.startswith(tuple(FULL_SPLIT_METRICS)):
        return ""
    settings = {
        str(results.configs.get(i, {}).get("train", {}).get("full_split_clients", "all"))
        for i in ids
    }
    settings.discard("all")
    return ", ".join(sorted(settings))


def fill(table: PaperTable, results: Results) -> list[Cell]:
    """Every cell of `table` with fpbench's mean ± std over runs, then best/second marks.

    A column with `mean_of` (column keys) is the mean of the row's values in those columns, one
    with `hm_of` (two column keys) their harmonic mean (CoCoOp's average H: the HM of the
    averaged base and novel accuracies); each is filled only where all its inputs are.
    """
    cells = []
    for row in table.rows:
        done: dict[str, Cell] = {}
        for col in table.columns:
            spec = table.spec(row, col)
            reported = table.values[(row.key, col.key)]
            if DERIVED_COLUMN & spec.keys():
                done[col.key] = _derived(row.key, col.key, spec, reported, done)
                continue
            vals = run_values(results, spec)
            mean = sum(vals) / len(vals) if vals else None
            std = pd.Series(vals).std(ddof=1) if len(vals) > 1 else None
            ids = _matching_runs(results, spec)
            why = "" if vals else _full_split_setting(results, ids, str(spec.get("metric", "")))
            done[col.key] = Cell(
                row.key, col.key, spec, reported, mean, std, len(vals), runs=len(ids),
                not_computed=why,
            )  # fmt: skip
        cells.extend(done.values())
    return _marked(_marked(cells, "mean", "mark"), "paper", "paper_mark")


DERIVED_COLUMN = frozenset({"mean_of", "hm_of"})


def _derived(
    row: str, col: str, spec: Mapping[str, Any], reported: Reported, done: Mapping[str, Cell]
) -> Cell:
    """A `mean_of` / `hm_of` cell from the row's cells to its left (no std: not a run value)."""
    kind = "mean_of" if "mean_of" in spec else "hm_of"
    keys = list(spec[kind])
    unknown = [k for k in keys if k not in done]
    if unknown or (kind == "hm_of" and len(keys) != 2):
        raise FpbenchError(
            f"column {col!r}: {kind} needs {'two ' if kind == 'hm_of' else ''}keys of columns to "
            f"its left; {unknown or keys} are not"
        )
    inputs = [done[k] for k in keys]
    values = [c.mean for c in inputs]
    mean = None
    if values and all(v is not None for v in values):
        if kind == "mean_of":
            mean = sum(values) / len(values)
        else:
            a, b = values
            mean = 2 * a * b / (a + b) if a + b else 0.0
    n = min(c.n for c in inputs) if mean is not None else 0
    return Cell(row, col, spec, reported, mean, None, n, runs=min(c.runs for c in inputs))


def _marked(cells: list[Cell], source: str, target: str) -> list[Cell]:
    """Mark the best and second-best value of each rank group (a column or a row)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, c in enumerate(cells):
        rank = c.spec.get("rank", "column")
        if rank in ("column", "row"):
            groups.setdefault((rank, c.column if rank == "column" else c.row), []).append(i)
    out = list(cells)
    for members in groups.values():
        values = {i: _value(cells[i], source) for i in members}
        values = {i: v for i, v in values.items() if v is not None}
        sign = 1 if cells[members[0]].spec.get("higher_is_better", True) else -1
        ordered = sorted(set(values.values()), key=lambda v: -sign * v)
        for i, v in values.items():
            if len(values) > 1 and v in ordered[:2]:
                mark = "best" if v == ordered[0] else "second"
                out[i] = _replace(out[i], **{target: mark})
    return out


def _value(cell: Cell, source: str) -> float | None:
    if source == "mean":
        return cell.mean
    r = cell.reported
    return None if r.value is None or r.bound else r.value


def _replace(cell: Cell, **kw: Any) -> Cell:
    from dataclasses import replace

    return replace(cell, **kw)


def fill_paper(paper: Paper, results: Results, number: int | None = None) -> list[FilledTable]:
    """Fill every table of `paper` (or only table `number`)."""
    tables = [paper.table(number)] if number is not None else list(paper.tables)
    return [FilledTable(paper, t, fill(t, results)) for t in tables]


@dataclass(frozen=True)
class FilledTable:
    paper: Paper
    table: PaperTable
    cells: list[Cell]

    def cell(self, row: str, column: str) -> Cell:
        return next(c for c in self.cells if c.row == row and c.column == column)

    @property
    def title(self) -> str:
        return f"{self.paper.name.upper()} Table {self.table.number}: {self.table.caption}"

    def missing_suites(self) -> list[str]:
        return sorted({str(c.spec["suite"]) for c in self.cells if not c.n and "suite" in c.spec})
