"""Render filled paper tables (`fpbench.report.paper`) to the terminal, Markdown, CSV or LaTeX.

Every cell shows fpbench's value (mean ± std over seeds) beside the paper's value and the
difference; a cell without runs names the suite and cell that would fill it (in the terminal,
once under the table). Best and second
best values (per column, or per row where the paper ranks methods along a row) are bold and
underlined, for fpbench's values and for the paper's.
"""

from __future__ import annotations

import io
from typing import Any

import pandas as pd

from fpbench.errors import FpbenchError
from fpbench.report.paper import Cell, FilledTable
from fpbench.report.paper_cells import DASH, diff_text, footer, ours_text, paper_text
from fpbench.report.paper_term import to_terminal
from fpbench.report.tables import _latex_header, _tex

FORMATS = ("term", "md", "csv", "latex")


def render(filled: FilledTable, fmt: str, width: int | None = None) -> Any:
    """A rich renderable for "term" (fitting `width` columns, default 80), else a string
    (Markdown, CSV, LaTeX).

    Raises:
        FpbenchError: unknown `fmt`.
    """
    renderers = {
        "term": lambda f: to_rich(f, width),
        "md": to_markdown,
        "csv": to_csv,
        "latex": to_latex,
    }
    if fmt not in renderers:
        raise FpbenchError(f"unknown table format {fmt!r}; choose one of {', '.join(FORMATS)}")
    return renderers[fmt](filled)


# -- terminal ------------------------------------------------------------------------------------


def to_rich(filled: FilledTable, width: int | None = None) -> Any:
    """A rich renderable at most `width` columns wide (`fpbench.report.paper_term`)."""
    return to_terminal(filled, width or 80)


# -- markdown --------------------------------------------------------------------------------------


def _md_mark(text: str, mark: str) -> str:
    return {"best": f"**{text}**", "second": f"<u>{text}</u>"}.get(mark, text)


def _md_cell(cell: Cell) -> str:
    paper = _md_mark(paper_text(cell), cell.paper_mark)
    if cell.mean is None:
        return f"{DASH} (paper {paper}; {cell.hint()})"
    diff = f", Δ {diff_text(cell)}" if cell.diff is not None else ""
    return f"{_md_mark(ours_text(cell), cell.mark)} (paper {paper}{diff})"


def to_markdown(filled: FilledTable) -> str:
    t = filled.table
    header = [t.row_title or ""] + [" / ".join([*c.group, c.label]) for c in t.columns]
    align = _md_row([":--"] + ["--:"] * len(t.columns))
    lines = [f"**{filled.title}**", "", _md_row(header), align]
    for row in t.rows:
        cells = [_md_cell(filled.cell(row.key, c.key)) for c in t.columns]
        lines.append(_md_row([row.label, *cells]))
    notes = footer(filled)
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


# -- csv -------------------------------------------------------------------------------------------

CSV_COLUMNS = [
    "paper", "table", "row", "column", "suite", "method", "dataset", "partition", "metric",
    "fpbench_mean", "fpbench_std", "n_runs", "paper_text", "paper_value", "paper_spread",
    "diff", "mark", "paper_mark", "hint",
]  # fmt: skip


def to_csv(filled: FilledTable) -> str:
    """Long format: one line per cell with the numbers behind it."""
    records = []
    for c in filled.cells:
        records.append(
            {
                "paper": filled.paper.name,
                "table": filled.table.number,
                "row": c.row,
                "column": c.column,
                **{k: c.spec.get(k, "") for k in ("suite", "method", "dataset", "partition")},
                "metric": c.spec.get("metric", ""),
                "fpbench_mean": c.mean,
                "fpbench_std": c.std,
                "n_runs": c.n,
                "paper_text": c.reported.text,
                "paper_value": c.reported.value,
                "paper_spread": c.reported.spread,
                "diff": c.diff,
                "mark": c.mark,
                "paper_mark": c.paper_mark,
                "hint": "" if c.n else c.hint(),
            }
        )
    buf = io.StringIO()
    pd.DataFrame(records, columns=CSV_COLUMNS).to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()


# -- latex -----------------------------------------------------------------------------------------


def _tex_mark(text: str, mark: str) -> str:
    return {"best": rf"\textbf{{{text}}}", "second": rf"\underline{{{text}}}"}.get(mark, text)


def _tex_cell(cell: Cell) -> str:
    paper = _tex_mark(_tex(paper_text(cell)), cell.paper_mark)
    if cell.mean is None:
        return f"-- / {paper}"
    diff = f" ({_tex(diff_text(cell))})" if cell.diff is not None else ""
    return f"{_tex_mark(_tex(ours_text(cell)), cell.mark)} / {paper}{diff}"


def to_latex(filled: FilledTable) -> str:
    """booktabs tabular, cells 'fpbench / paper (difference)'; missing cells as comments."""
    t = filled.table
    depth = max(len(c.group) for c in t.columns) + 1
    labels = [("",) * (depth - 1 - len(c.group)) + (*c.group, c.label) for c in t.columns]
    body = []
    for row in t.rows:
        cells = [_tex_cell(filled.cell(row.key, c.key)) for c in t.columns]
        body.append(" & ".join([_tex(row.label), *cells]) + r" \\")
    missing = [f"% no runs for {c.row}/{c.column}: {c.hint()}" for c in filled.cells if not c.n]
    lines = [
        f"% {filled.title}",
        rf"\begin{{tabular}}{{l{'r' * len(t.columns)}}}",
        r"\toprule",
        *_latex_header([t.row_title or ""], labels),
        r"\midrule",
        *body,
        r"\bottomrule",
        r"\end{tabular}",
        *missing,
    ]
    return "\n".join(lines) + "\n"
