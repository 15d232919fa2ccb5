"""A filled paper table for a terminal of a given width (`fpbench table --paper --format term`).

Wide tables are stacked: the columns are cut into panels that fit the width, never mixing two
top-level column groups (a dataset) in one panel, and every panel repeats the row labels; the
group is the panel's title. A header word wider than its column is abbreviated to its initials
and explained in a legend under the table. Cells are three short lines (fpbench's value, the
paper's, the difference); a cell without runs shows only the paper's value, and which suites
fill the empty cells is said once, under the table.
"""

from __future__ import annotations

import re
from typing import Any

from fpbench.packing import consecutive_chunks
from fpbench.report.paper import Cell, FilledTable, Line
from fpbench.report.paper_cells import CLOSE, DASH, diff_text, footer, ours_text, paper_text

PADDING = 3  # rich's cell padding (1 + 1) and the column rule


def cell_lines(cell: Cell) -> list[tuple[str, str]]:
    """The (text, style) lines of one cell."""
    paper = ("paper " + paper_text(cell), _style(cell.paper_mark))
    if cell.mean is None:
        return [(DASH, "dim"), paper]
    lines = [(ours_text(cell), _style(cell.mark)), paper]
    if cell.diff is not None:
        lines.append((f"Δ {diff_text(cell)}", "green" if abs(cell.diff) <= CLOSE else "yellow"))
    return lines


def _style(mark: str) -> str:
    return {"best": "bold", "second": "underline"}.get(mark, "")


def abbreviate(text: str) -> str:
    """'Worst Local' -> 'WL', 'Office-Caltech10 (%)' -> 'OC10': initials, numbers kept."""
    words = re.findall(r"[A-Za-z]+|\d+(?:\.\d+)?", text)
    return "".join(w if w[0].isdigit() else w[0].upper() for w in words) or text[:3]


def panels(filled: FilledTable, width: int) -> list[tuple[str, list[Line]]]:
    """(title, columns) of each panel: consecutive columns of one top group that fit `width`."""
    t = filled.table
    label_w = max([len(t.row_title or "")] + [len(r.label) for r in t.rows])
    room = width - (label_w + PADDING + 1)
    groups: dict[str, list[Line]] = {}
    for col in t.columns:
        groups.setdefault(col.group[0] if col.group else "", []).append(col)
    out: list[tuple[str, list[Line]]] = []
    for title, cols in groups.items():
        needs = [_content_width(filled, c) + PADDING for c in cols]
        count = len(consecutive_chunks(needs, room))
        size = -(-len(cols) // count)  # the same number of panels, evenly filled
        even = [list(range(i, min(i + size, len(cols)))) for i in range(0, len(cols), size)]
        if any(sum(needs[i] for i in chunk) > room for chunk in even):
            even = consecutive_chunks(needs, room)
        out += [(title, [cols[i] for i in chunk]) for chunk in even]
    return out


def _content_width(filled: FilledTable, col: Line) -> int:
    cells = [filled.cell(r.key, col.key) for r in filled.table.rows]
    return max([6] + [len(text) for c in cells for text, _ in cell_lines(c)])


def header(col: Line, width: int, legend: dict[str, str]) -> str:
    """The column's group path below its panel title and its label, one part per line."""
    parts = [*col.group[1:], col.label]
    shown = []
    for part in parts:
        if len(part) > width:
            short = abbreviate(part)
            legend.setdefault(short, part)
            part = short
        shown.append(part)
    return "\n".join(shown)


def to_terminal(filled: FilledTable, width: int = 80) -> Any:
    """A rich renderable: the title, one table per panel, then legend and notes, all `width`
    columns wide at most."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = filled.table
    legend: dict[str, str] = {}
    parts: list[Any] = [Text(filled.title, style="bold")]
    for title, cols in panels(filled, width):
        table = Table(title=title or None, show_lines=True, title_justify="left")
        table.add_column(t.row_title or "", no_wrap=True)
        for col in cols:
            w = _content_width(filled, col)
            table.add_column(header(col, w, legend), justify="right", min_width=w)
        for row in t.rows:
            cells = [_text(filled.cell(row.key, c.key)) for c in cols]
            table.add_row(row.label, *cells)
        parts.append(table)
    notes = [f"{k} = {v}" for k, v in legend.items()]
    if notes:
        parts.append(Text("legend: " + "; ".join(notes), style="dim"))
    parts += [Text(line) for line in footer(filled)]
    return Group(*parts)


def _text(cell: Cell) -> Any:
    from rich.text import Text

    out = Text(justify="right")
    for i, (text, style) in enumerate(cell_lines(cell)):
        out.append(("\n" if i else "") + text, style=style)
    return out
