"""What one cell of a filled paper table shows, in every format: fpbench's value, the paper's,
their difference, and the notes under the table (shared by `paper_render` and `paper_term`)."""

from __future__ import annotations

import re

from fpbench.report.paper import Cell, FilledTable
from fpbench.report.tables import is_percent

DASH = "—"
CLOSE = 1.0  # |difference| within which the terminal shows a value as reproduced


def decimals(cell: Cell) -> int:
    """As many decimals as the paper prints for this cell (2 when it prints none)."""
    m = re.search(r"\d+\.(\d+)", cell.reported.text)
    if m:
        return len(m.group(1))
    integer = cell.reported.value is not None and not is_percent(str(cell.spec.get("metric", "")))
    return 0 if integer else 2  # counts (rounds, seconds) as integers; accuracies with 2


def ours_text(cell: Cell) -> str:
    """fpbench's 'mean ± std' (std only with several runs), or '—' without runs."""
    if cell.mean is None:
        return DASH
    d = decimals(cell)
    text = f"{cell.mean:.{d}f}"
    return text + (f" ± {cell.std:.{d}f}" if cell.n > 1 and cell.std is not None else "")


def diff_text(cell: Cell) -> str:
    diff = cell.diff
    return "" if diff is None else f"{diff:+.{decimals(cell)}f}"


def paper_text(cell: Cell) -> str:
    return DASH if cell.reported.empty else cell.reported.text


def footer(filled: FilledTable) -> list[str]:
    """Notes under a table: the metric note, and how many cells still need runs."""
    lines = [f"note: {filled.table.note}"] if filled.table.note else []
    empty = [c for c in filled.cells if not c.n and c.spec.get("method") and c.spec.get("metric")]
    if empty:
        runs = " and ".join(f"`fpbench run --suite {s}`" for s in filled.missing_suites())
        lines.append(f"{len(empty)} of {len(filled.cells)} cells have no runs yet; fill: {runs}")
    return lines
