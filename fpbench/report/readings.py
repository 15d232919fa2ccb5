"""Which metric each column of a paper table reads, as data, and the check that holds the tables
to it.

A paper data file (`benchmarks/papers/<paper>.toml`) carries `[[readings]]` blocks beside its
`[[tables]]` and `[[protocol]]`: `tables` (numbers), optional `columns` and `rows` (fnmatch globs
over the column and row keys, "!" excludes, default all), the `metric` those cells read, its
`source` (a checkable one, see `fpbench.report.sources`) and optionally a `reason` (why that
metric is the paper's reading). Every cell fpbench fills (its spec names
a suite, a method and a metric) must be covered by exactly one reading, and read its metric.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fpbench.errors import FpbenchError
from fpbench.report.paper import PAPERS_DIR, Paper, paper_data


@dataclass(frozen=True)
class Reading:
    """One `[[readings]]` block: the metric the selected cells read, and why."""

    index: int
    tables: tuple[int, ...]
    columns: tuple[str, ...]
    rows: tuple[str, ...]
    metric: str
    source: str
    reason: str = ""

    def selects(self, table: int, row: str, column: str) -> bool:
        from fpbench.report.protocol import _label_matches

        return (
            table in self.tables
            and _label_matches(column, self.columns)
            and _label_matches(row, self.rows)
        )


def load_readings(name: str, root: Path = PAPERS_DIR) -> list[Reading]:
    """The `[[readings]]` blocks of paper `name` (empty when it has none).

    Raises:
        FpbenchError: unknown paper, or a malformed block.
    """
    return parse_readings(paper_data(name, root), f"{name}.toml")


def parse_readings(data: Mapping[str, Any], where: str = "<memory>") -> list[Reading]:
    """Readings from a parsed paper data file."""
    return [_reading(i, r, where) for i, r in enumerate(data.get("readings", []))]


def _reading(i: int, raw: Mapping[str, Any], where: str) -> Reading:
    at = f"{where} readings block {i + 1}"
    keys = {"tables", "columns", "rows", "metric", "source", "reason"}
    unknown, missing = sorted(set(raw) - keys), [k for k in ("tables", "metric", "source")
                                                 if not raw.get(k)]  # fmt: skip
    if unknown or missing:
        raise FpbenchError(
            f"{at}: needs tables, metric, source (optional columns, rows, reason); "
            f"unknown {unknown}, missing {missing}"
        )
    if not all(isinstance(t, int) for t in raw["tables"]):
        raise FpbenchError(f"{at}: tables must be a list of table numbers")
    globs = {k: raw.get(k, []) for k in ("columns", "rows")}
    for k, v in globs.items():
        if isinstance(v, str):
            globs[k] = [v]
        elif not isinstance(v, list) or not all(isinstance(g, str) for g in v):
            raise FpbenchError(f"{at}: {k} is a glob or a list of globs, got {v!r}")
    return Reading(
        i + 1, tuple(raw["tables"]), tuple(globs["columns"]), tuple(globs["rows"]),
        str(raw["metric"]), str(raw["source"]), str(raw.get("reason", "")),
    )  # fmt: skip


def check_readings(paper: Paper, readings: list[Reading]) -> list[str]:
    """Every filled cell of `paper` without a reading, with two, or reading another metric, and
    every reading that selects no filled cell (one line each)."""
    problems: list[str] = []
    used: set[int] = set()
    for table in paper.tables:
        for row in table.rows:
            for col in table.columns:
                spec = table.spec(row, col)
                if not (spec.get("suite") and spec.get("method") and spec.get("metric")):
                    continue
                at = f"{paper.name} table {table.number} cell {row.key}.{col.key}"
                mine = [r for r in readings if r.selects(table.number, row.key, col.key)]
                used |= {r.index for r in mine}
                if not mine:
                    problems.append(f"{at} reads {spec['metric']} without a reading rule")
                elif len(mine) > 1:
                    blocks = ", ".join(str(r.index) for r in mine)
                    problems.append(f"{at}: more than one reading rule (blocks {blocks})")
                elif mine[0].metric != spec["metric"]:
                    problems.append(
                        f"{at} reads {spec['metric']}, its reading rule (block "
                        f"{mine[0].index}) says {mine[0].metric} ({mine[0].source})"
                    )
    problems += [
        f"{paper.name} readings block {r.index} selects no filled cell"
        for r in readings
        if r.index not in used
    ]
    return problems
