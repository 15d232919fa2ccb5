"""Paper tables in an 80-column terminal: stacked panels, abbreviated headers, hints once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from rich.console import Console

from fpbench.report import paper_term
from fpbench.report.paper import Results, fill_paper, list_papers, load_paper, load_results
from fpbench.report.paper_render import render
from fpbench.store import Store
from fpbench.store.repo import METRIC_COLUMNS
from tests.test_paper_tables import _run


def _text(renderable, width: int = 80) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def _empty(paper: str):
    import pandas as pd

    return fill_paper(load_paper(paper), Results(pd.DataFrame(columns=METRIC_COLUMNS)))


def test_abbreviate_keeps_initials_and_numbers():
    assert paper_term.abbreviate("Worst Local") == "WL"
    assert paper_term.abbreviate("Office-Caltech10 (%)") == "OC10"
    assert paper_term.abbreviate("CIFAR-100 (Dir-0.3)") == "C100D0.3"


def test_wide_table_is_stacked_in_even_panels_per_dataset():
    (t1,) = fill_paper(load_paper("sgpt"), Results(_no_metrics()), 1)
    shown = [(title, [c.key for c in cols]) for title, cols in paper_term.panels(t1, 80)]
    assert [title for title, _ in shown] == ["CIFAR-100 (%)"] * 2 + ["Five-Dataset (%)"]
    assert [len(cols) for _, cols in shown] == [3, 3, 3]  # 6 CIFAR columns: 3 + 3, not 4 + 2
    assert [k for _, cols in shown for k in cols] == [c.key for c in t1.table.columns]
    wide = paper_term.panels(t1, 400)  # room for all: one panel per dataset
    assert [len(cols) for _, cols in wide] == [6, 3]


def _no_metrics():
    import pandas as pd

    return pd.DataFrame(columns=METRIC_COLUMNS)


@pytest.mark.parametrize("paper", list_papers())
def test_every_paper_table_fits_80_columns_with_hints_once(paper):
    for filled in _empty(paper):
        text = _text(render(filled, "term", 80))
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= 80, filled.title
        assert "…" not in text  # nothing truncated
        assert "needs suite" not in text  # no per-cell hint
        flat = " ".join(text.split())  # a long suite name wraps at the space before it
        for suite in filled.missing_suites():
            assert flat.count(f"`fpbench run --suite {suite}`") == 1
        legend = next((line for line in lines if line.startswith("legend: ")), "")
        legend_text = " ".join(lines[lines.index(legend) :]) if legend else ""
        for col in filled.table.columns:
            for part in [*col.group[1:], col.label]:
                short = paper_term.abbreviate(part)
                assert part in text or f"{short} = " in legend_text, (filled.title, part)


def test_filled_cells_show_value_paper_and_difference_at_80_columns(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        _run(store, "sgpt-table1", "sgpt", 0, [0.80, 0.90])
        _run(store, "sgpt-table1", "sgpt", 1, [0.86])
        (t1,) = fill_paper(load_paper("sgpt"), load_results(store), 1)
    text = _text(render(t1, "term", 80))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "85.50 ± 0.71" in text and "paper 84.64" in text and "Δ +0.86" in text
    assert "71 of 72 cells have no runs yet; fill: `fpbench run --suite sgpt-table1`" in text


def test_cli_paper_table_at_80_columns():
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fpbench",
            "table",
            "--paper",
            "sgpt",
            "--table",
            "1",
            "--format",
            "term",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    assert max(len(line) for line in out.splitlines()) <= 80
    assert out.count("`fpbench run --suite sgpt-table1`") == 1
    assert "Worst Local" in out and "paper 86.72" in out
