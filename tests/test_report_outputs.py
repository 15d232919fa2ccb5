"""Paper loading, the paper tables' renderings, `fpbench export`, `fpbench runs` and the
checkable sources: edge cases their mutation run (issue #31) found untested. Each expected value
is worked out by hand in the comment beside it."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from fpbench.errors import FpbenchError
from fpbench.report import export, paper_term
from fpbench.report.export import LABELS, export_tables, write_tables
from fpbench.report.listing import COLUMNS, run_listing
from fpbench.report.paper import (
    Cell,
    FilledTable,
    Line,
    Paper,
    PaperTable,
    Results,
    fill_paper,
    load_paper,
    parse_reported,
)
from fpbench.report.paper_render import CSV_COLUMNS, render
from fpbench.report.sources import anchors, form_problems, normalise, text_problems
from fpbench.store import Store
from fpbench.store.repo import ROUND_COLUMNS
from tests.test_paper_protocols import TINY_PAPER

# -- paper.py ----------------------------------------------------------------------------------


def test_a_rank_group_of_one_cell_marks_nothing(tmp_path: Path):
    one_row = TINY_PAPER.replace('  { key = "vpt", label = "VPT", method = "fedvpt" },\n', "")
    (tmp_path / "tiny.toml").write_text(one_row.replace('vpt = ["60.0"]\n', ""))
    row = {"run_id": 1, "suite": "tiny", "method": "head-tune", "dataset": "synthetic",
           "partition": "p", "seed": 0, "round": 0, "name": "acc_global", "value": 0.5}  # fmt: skip
    rows = [row]
    (filled,) = fill_paper(load_paper("tiny", tmp_path), Results(pd.DataFrame(rows)))
    (cell,) = filled.cells  # one column, one row: a group of one, nothing to rank it against
    assert (cell.mean, cell.reported.value, cell.mark, cell.paper_mark) == (50.0, 50.0, "", "")


def test_a_papers_title_source_and_tables_default_when_left_out(tmp_path: Path):
    titled = TINY_PAPER.replace('title = "tiny"', 'title = "A tiny paper"')
    (tmp_path / "tiny.toml").write_text(titled.replace('caption = "tiny"\n', ""))  # no source
    tiny = load_paper("tiny", tmp_path)
    assert (tiny.name, tiny.title, tiny.source, len(tiny.tables)) == ("tiny", "A tiny paper", "", 1)
    assert tiny.tables[0].caption == ""  # a table without a caption
    (tmp_path / "bare.toml").write_text('source = "arXiv 1"\n')  # no title, no tables
    assert load_paper("bare", tmp_path) == Paper("bare", "bare", "arXiv 1", ())
    with pytest.raises(FpbenchError) as err:
        load_paper("nope", tmp_path)
    assert str(err.value) == "unknown paper 'nope'; choose one of bare, tiny"


def test_a_cell_entry_splits_at_the_first_dot_only(tmp_path: Path):
    # the column key "dir-0.3" holds a dot: "ht.dir-0.3" is row "ht", column "dir-0.3"
    dotted = TINY_PAPER.replace('key = "acc"', 'key = "dir-0.3"')
    (tmp_path / "tiny.toml").write_text(dotted + '[tables.cells]\n"ht.dir-0.3" = { seed = 1 }\n')
    table = load_paper("tiny", tmp_path).table(1)
    assert table.cells == {("ht", "dir-0.3"): {"seed": 1}}
    assert table.spec(table.rows[0], table.columns[0])["seed"] == 1


# -- sources.py --------------------------------------------------------------------------------


def test_a_source_without_an_anchor_says_what_it_needs():
    plain = "source 'sec. 4.1' has no quote (\"...\") or file:line reference"
    assert form_problems("sec. 4.1") == [plain]
    assert form_problems("sec. 4.1", unstated=True) == [
        plain + ", or 'silent: where the paper is silent'"
    ]
    # "silent:" is a source only where the rule's paper value is unstated (not by default)
    assert form_problems("silent: sec. 4.1") == ["source 'silent: sec. 4.1' has no quote "
                                                 "(\"...\") or file:line reference"]  # fmt: skip


def test_anchors_come_in_the_order_they_start_and_a_quote_may_touch_its_reference():
    # a reference inside a quote starts after it and ends before it: the quote comes first
    assert [a.kind for a in anchors('"see a.md:3 here"')] == ["quote", "ref"]
    ref, quote = anchors('a.md:3"x"')  # no space between: the quote still follows a.md:3
    assert quote.ref == ref and (ref.file, ref.first, ref.last) == ("a.md", 3, 3)


def test_normalise_joins_whitespace_and_keeps_or_drops_a_line_end_hyphen():
    assert normalise(" few-\n  shot \t data\n\n") == "few-shot data"  # the hyphen kept
    assert normalise("proto- \ntypes  here", join_hyphens=True) == "prototypes here"
    assert normalise("a -\nb and a-b") == "a - b and a-b"  # only a word's hyphen ends a line


def test_quotes_after_a_reference_are_read_in_exactly_its_lines(tmp_path: Path):
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers" / "ref.md").write_text("one\n--comm_round 60\nthree\n")
    paper = "The clients train E = 5 epochs."
    # lines 1-2 joined by a line break, which a quote reads as a space; line 3 is the last
    assert text_problems('ref.md:1-2 "one --comm_round 60"; ref.md:3', paper, tmp_path) == []
    assert text_problems('ref.md:2 "one"; ref.md:2-3 "one"', paper, tmp_path) == [
        "quote 'one' does not occur in ref.md:2",  # line 2 only, not the line before
        "quote 'one' does not occur in ref.md:2-3",
    ]
    # a quote after a bad reference is reported with the reference only, and the check goes on
    assert text_problems('ref.md:9 "x"; nope.md:1 "y"; "E = 6"', paper, tmp_path) == [
        "reference ref.md:9-9: the file has 3 lines",
        f"reference nope.md:1: no such file under {tmp_path}/{{specs,papers}}",
        "quote 'E = 6' does not occur in the paper",
    ]


# -- paper_render.py and paper_term.py: one small table in every format -------------------------

TOY = """
title = "a toy"
[[tables]]
number = 2
caption = "toy & co"
suite = "toy"
note = "accuracy in %"
row_title = "Algo"
columns = [
  { key = "x", label = "Accuracy, global", group = ["G"], dataset = "d", metric = "acc_global" },
  { key = "y", label = "worst local (%)", dataset = "e", metric = "acc_global" },
  { key = "z", label = "held-out|clients", dataset = "e", metric = "acc_pooled" },
]
rows = [
  { key = "a", label = "A_1", method = "a", partition = "p" },
  { key = "b", label = "B", method = "b", partition = "p" },
  { key = "ref", label = "Ref" },
]
[tables.values]
a = ["80.0 ± 1.0", "-", "-"]
b = ["70.0", "60.0", "-"]
ref = ["75.0", "N/A", "-"]
"""


def _toy(tmp_path: Path) -> FilledTable:
    """Column x: a's two seeds 81 and 83 (mean 82, std 1.41), b 70; column y: a 50 only."""
    (tmp_path / "toy.toml").write_text(TOY)
    runs = [("a", "d", 0, 0.81), ("a", "d", 1, 0.83), ("b", "d", 0, 0.70), ("a", "e", 0, 0.5)]
    rows = [{"run_id": i, "suite": "toy", "method": m, "dataset": ds, "partition": "p",
             "seed": seed, "round": 0, "name": "acc_global", "value": v}
            for i, (m, ds, seed, v) in enumerate(runs)]  # fmt: skip
    (filled,) = fill_paper(load_paper("toy", tmp_path), Results(pd.DataFrame(rows)))
    return filled


def test_markdown_shows_marks_differences_hints_and_notes(tmp_path: Path):
    # x: ours 82 (best) and 70 (second), the paper's 80 (best), 75 (second, Ref), 70;
    # y and z: one value each at most, nothing ranked; "|" escaped; 3 cells with a method lack
    # runs (a/z has a run without acc_pooled)
    assert render(_toy(tmp_path), "md") == (
        "**TOY Table 2: toy & co**\n"
        "\n"
        "| Algo | G / Accuracy, global | worst local (%) | held-out\\|clients |\n"
        "| :-- | --: | --: | --: |\n"
        "| A_1 | **82.0 ± 1.4** (paper **80.0 ± 1.0**, Δ +2.0) | 50.00 (paper —) "
        "| — (paper —; 1 run(s) of a/e/p lack metric acc_pooled) |\n"
        "| B | <u>70.0</u> (paper 70.0, Δ +0.0) "
        "| — (paper 60.0; needs suite toy: b/e/p · acc_global) "
        "| — (paper —; needs suite toy: b/e/p · acc_pooled) |\n"
        "| Ref | — (paper <u>75.0</u>; reference only (not produced by fpbench)) "
        "| — (paper —; reference only (not produced by fpbench)) "
        "| — (paper —; reference only (not produced by fpbench)) |\n"
        "\n"
        "note: accuracy in %\n"
        "3 of 9 cells have no runs yet; fill: `fpbench run --suite toy`\n"
    )


def test_csv_has_one_line_per_cell_with_its_numbers(tmp_path: Path):
    ref = "reference only (not produced by fpbench)"
    assert render(_toy(tmp_path), "csv").splitlines() == [
        "paper,table,row,column,suite,method,dataset,partition,metric,fpbench_mean,fpbench_std,"
        "n_runs,paper_text,paper_value,paper_spread,diff,mark,paper_mark,hint",
        "toy,2,a,x,toy,a,d,p,acc_global,82.0,1.4142135623730951,2,80.0 ± 1.0,80.0,1.0,2.0,best,"
        "best,",  # std of 81 and 83 over n - 1: sqrt(2)
        "toy,2,a,y,toy,a,e,p,acc_global,50.0,,1,-,,,,,,",
        "toy,2,a,z,toy,a,e,p,acc_pooled,,,0,-,,,,,,1 run(s) of a/e/p lack metric acc_pooled",
        "toy,2,b,x,toy,b,d,p,acc_global,70.0,,1,70.0,70.0,,0.0,second,,",
        "toy,2,b,y,toy,b,e,p,acc_global,,,0,60.0,60.0,,,,,needs suite toy: b/e/p · acc_global",
        "toy,2,b,z,toy,b,e,p,acc_pooled,,,0,-,,,,,,needs suite toy: b/e/p · acc_pooled",
        f"toy,2,ref,x,toy,,d,,acc_global,,,0,75.0,75.0,,,,second,{ref}",  # no method: ""
        f"toy,2,ref,y,toy,,e,,acc_global,,,0,N/A,,,,,,{ref}",
        f"toy,2,ref,z,toy,,e,,acc_pooled,,,0,-,,,,,,{ref}",
    ]


def test_latex_marks_escapes_and_lists_the_missing_cells_as_comments(tmp_path: Path):
    ref = "reference only (not produced by fpbench)"
    assert render(_toy(tmp_path), "latex") == "\n".join([
        "% TOY Table 2: toy & co",
        r"\begin{tabular}{lrrr}",
        r"\toprule",
        r" & G & \multicolumn{2}{c}{} \\",  # two levels: the group, then the labels
        r"\cmidrule(lr){2-2} \cmidrule(lr){3-4}",
        r"Algo & Accuracy, global & worst local (\%) & held-out|clients \\",
        r"\midrule",
        r"A\_1 & \textbf{82.0 $\pm$ 1.4} / \textbf{80.0 $\pm$ 1.0} (+2.0) & 50.00 / — & -- / — \\",
        r"B & \underline{70.0} / 70.0 (+0.0) & -- / 60.0 & -- / — \\",
        r"Ref & -- / \underline{75.0} & -- / — & -- / — \\",
        r"\bottomrule",
        r"\end{tabular}",
        "% no runs for a/z: 1 run(s) of a/e/p lack metric acc_pooled",
        "% no runs for b/y: needs suite toy: b/e/p · acc_global",
        "% no runs for b/z: needs suite toy: b/e/p · acc_pooled",
        f"% no runs for ref/x: {ref}",
        f"% no runs for ref/y: {ref}",
        f"% no runs for ref/z: {ref}",
    ]) + "\n"  # fmt: skip


def _console_text(renderable, width: int = 80) -> str:
    console = Console(record=True, width=width, color_system=None, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_the_terminal_stacks_groups_abbreviates_headers_and_explains_them(tmp_path: Path):
    # x's header is exactly as wide as its widest line ("paper 80.0 ± 1.0", 16): kept; y's and
    # z's are wider than theirs (10 and 7): initials of the words, explained in the legend
    text = _console_text(render(_toy(tmp_path), "term", 80))
    assert text == "\n".join([
        "TOY Table 2: toy & co",
        "G                          ",
        "┏━━━━━━┳━━━━━━━━━━━━━━━━━━┓",
        "┃ Algo ┃ Accuracy, global ┃",
        "┡━━━━━━╇━━━━━━━━━━━━━━━━━━┩",
        "│ A_1  │       82.0 ± 1.4 │",
        "│      │ paper 80.0 ± 1.0 │",
        "│      │           Δ +2.0 │",
        "├──────┼──────────────────┤",
        "│ B    │             70.0 │",
        "│      │       paper 70.0 │",
        "│      │           Δ +0.0 │",
        "├──────┼──────────────────┤",
        "│ Ref  │                — │",
        "│      │       paper 75.0 │",
        "└──────┴──────────────────┘",
        "┏━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━┓",
        "┃ Algo ┃         WL ┃     HOC ┃",
        "┡━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━┩",
        "│ A_1  │      50.00 │       — │",
        "│      │    paper — │ paper — │",
        "├──────┼────────────┼─────────┤",
        "│ B    │          — │       — │",
        "│      │ paper 60.0 │ paper — │",
        "├──────┼────────────┼─────────┤",
        "│ Ref  │          — │       — │",
        "│      │    paper — │ paper — │",
        "└──────┴────────────┴─────────┘",
        "legend: WL = worst local (%); HOC = held-out|clients",
        "note: accuracy in %",
        "3 of 9 cells have no runs yet; fill: `fpbench run --suite toy`",
    ]) + "\n"  # fmt: skip


def test_terminal_cells_and_titles_carry_their_styles(tmp_path: Path):
    filled = _toy(tmp_path)
    lines = {(r, c): paper_term.cell_lines(filled.cell(r, c)) for r, c in [("a", "x"), ("b", "x")]}
    # best bold, second underlined, for ours and the paper's; |Δ| > 1 yellow, within it green
    assert lines["a", "x"] == [
        ("82.0 ± 1.4", "bold"), ("paper 80.0 ± 1.0", "bold"), ("Δ +2.0", "yellow"),
    ]  # fmt: skip
    assert lines["b", "x"] == [("70.0", "underline"), ("paper 70.0", ""), ("Δ +0.0", "green")]
    assert paper_term.cell_lines(filled.cell("ref", "x")) == [
        ("—", "dim"),
        ("paper 75.0", "underline"),
    ]
    one_off = Cell("r", "c", {"metric": "acc_global"}, parse_reported("70.0"), mean=71.0, n=1)
    assert paper_term.cell_lines(one_off)[2] == ("Δ +1.0", "green")  # |Δ| = 1 still green
    text = paper_term._text(filled.cell("a", "x"))  # one rich Text, its lines styled in turn
    assert (text.plain, text.justify) == ("82.0 ± 1.4\npaper 80.0 ± 1.0\nΔ +2.0", "right")
    spans = [(text.plain[s.start : s.end], s.style) for s in text.spans]
    assert spans == [("82.0 ± 1.4", "bold"), ("\npaper 80.0 ± 1.0", "bold"), ("\nΔ +2.0", "yellow")]
    title, panel, _, legend, note, todo = paper_term.to_terminal(filled, 80).renderables
    assert (title.plain, title.style) == ("TOY Table 2: toy & co", "bold")
    assert (legend.style, note.style, todo.style) == ("dim", "", "")
    assert [(c.header, c.justify, c.no_wrap) for c in panel.columns] == [
        ("Algo", "left", True), ("Accuracy, global", "right", False),
    ]  # fmt: skip


def _wide(texts: list[str]) -> FilledTable:
    """One row "A" without runs; a column per paper text, each cell 'paper <text>' wide."""
    cols = tuple(Line(f"c{i}", f"C{i}") for i in range(len(texts)))
    values = {("a", c.key): parse_reported(t) for c, t in zip(cols, texts, strict=True)}
    table = PaperTable("w", 1, "wide", (Line("a", "A"),), cols, values, {}, {})
    cells = [Cell("a", c.key, {}, values["a", c.key]) for c in cols]
    return FilledTable(Paper("w", "w", "", (table,)), table, cells)


def test_a_panel_takes_the_columns_that_fit_the_width_left_by_the_row_labels():
    # "Method" (6) + rich's 3 + the outer rule: 70 columns left of 80, 71 of 81; the two
    # columns need "paper " + 26 and + 27 characters, 3 more each: 35 + 36 = 71
    filled = _wide(["x" * 26, "y" * 27])
    assert [len(cols) for _, cols in paper_term.panels(filled, 80)] == [1, 1]
    assert [len(cols) for _, cols in paper_term.panels(filled, 81)] == [2]
    at_80, at_81 = (_console_text(paper_term.to_terminal(filled, w), 120) for w in (80, 81))
    assert at_80 != at_81
    assert _console_text(render(filled, "term")) == at_80  # 80 columns unless told
    assert _console_text(paper_term.to_terminal(filled)) == at_80
    assert _console_text(render(filled, "term", 81), 120) == at_81


def test_abbreviations_need_letters_of_either_case():
    assert paper_term.abbreviate("held-out clients") == "HOC"
    assert paper_term.abbreviate("±%%!") == "±%%"  # no word at all: its first three characters


def test_an_unknown_table_format_names_the_formats(tmp_path: Path):
    with pytest.raises(FpbenchError) as err:
        render(_toy(tmp_path), "html")
    assert str(err.value) == "unknown table format 'html'; choose one of term, md, csv, latex"


def test_a_table_without_notes_ends_with_its_last_row(tmp_path: Path):
    (tmp_path / "tiny.toml").write_text(TINY_PAPER)
    rows = [{"run_id": i, "suite": "tiny", "method": m, "dataset": "synthetic", "partition": "p",
             "seed": 0, "round": 0, "name": "acc_global", "value": v}
            for i, (m, v) in enumerate([("head-tune", 0.5), ("fedvpt", 0.6)])]  # fmt: skip
    (filled,) = fill_paper(load_paper("tiny", tmp_path), Results(pd.DataFrame(rows)))
    assert render(filled, "md").endswith("| VPT | **60.0** (paper **60.0**, Δ +0.0) |\n")
    assert render(filled, "latex").endswith("\\bottomrule\n\\end{tabular}\n")


def test_the_csv_of_a_table_without_rows_is_its_header():
    table = PaperTable("e", 1, "empty", (), (Line("c", "C"),), {}, {}, {})
    filled = FilledTable(Paper("e", "e", "", (table,)), table, [])
    assert render(filled, "csv") == ",".join(CSV_COLUMNS) + "\n"
    # a cell whose spec names no labels and no metric: those fields empty
    cell = Cell("r", "c", {}, parse_reported("-"))
    filled = FilledTable(Paper("e", "e", "", (table,)), table, [cell])
    assert render(filled, "csv").splitlines()[1] == (
        "e,1,r,c,,,,,,,,0,-,,,,,,reference only (not produced by fpbench)"
    )


# -- export.py and listing.py ------------------------------------------------------------------


def _store(tmp_path: Path) -> Store:
    """Runs 1 (two rounds, the second unevaluated) and 3 (none) of method m in suite s, run 2
    of method o with a metric of its own, run 4 in suite t."""
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    for key, suite, method, seed in [("k1", "s", "m", 0), ("k2", "s", "o", 1), ("k3", "s", "m", 2),
                                     ("k4", "t", "m", 0)]:  # fmt: skip
        store.create_run(run_key=key, suite=suite, method=method, dataset="d", partition="p",
                         seed=seed, config={"b": 1, "a": {"y": 2, "x": 1}}, fpbench_version="v",
                         torch_version="v", device="cpu")  # fmt: skip
    # an aggregate stored with a count: the rounds table leaves the count out
    evaluated = [
        (None, "acc_global", 0.5, 30),
        (0, "acc_local", 0.4, 10),
        (1, "acc_local", 0.6, 20),
    ]
    store.write_round(1, 0, loss_train=1.0, wall_s=2.0, bytes_up=10, bytes_down=20,
                      metrics=evaluated)  # fmt: skip
    store.write_round(1, 1, loss_train=0.5, wall_s=3.0, bytes_up=10, bytes_down=20, metrics=[])
    store.write_round(2, 0, loss_train=0.7, wall_s=1.0, bytes_up=1, bytes_down=2,
                      metrics=[(None, "acc_extra", 0.9, None)])  # fmt: skip
    store.write_round(4, 0, loss_train=0.7, wall_s=1.0, bytes_up=1, bytes_down=2,
                      metrics=[(None, "acc_global", 0.8, None)])  # fmt: skip
    return store


def test_export_tables_hold_only_the_asked_runs_every_round_and_each_clients_count(tmp_path):
    with _store(tmp_path) as store:
        tables = export_tables(store, [1, 3])
    runs, rounds, clients = tables["runs"], tables["rounds"], tables["clients"]
    assert runs["id"].tolist() == [1, 3] and runs.index.tolist() == [0, 1]
    assert "index" not in runs.columns
    assert runs["config_json"].tolist() == ['{"a": {"x": 1, "y": 2}, "b": 1}'] * 2
    assert list(rounds.columns) == [*LABELS, "round", "loss_train", "wall_s", "bytes_up",
                                    "bytes_down", "acc_global"]  # fmt: skip
    # run 1's two rounds (the unevaluated one kept, NaN), nothing of run 3 (no rounds)
    assert rounds[["run_id", "round", "loss_train"]].values.tolist() == [[1, 0, 1.0], [1, 1, 0.5]]
    assert rounds["acc_global"].tolist()[0] == 0.5 and math.isnan(rounds["acc_global"][1])
    assert list(clients.columns) == [*LABELS, "round", "client_id", "acc_local", "acc_local_count"]
    assert clients[["client_id", "acc_local", "acc_local_count"]].values.tolist() == [
        [0, 0.4, 10], [1, 0.6, 20],
    ]  # fmt: skip
    assert (clients["round"].dtype, clients["client_id"].dtype) == ("int64", "int64")


def test_export_of_runs_without_rounds_is_empty_tables_with_their_columns(tmp_path):
    with _store(tmp_path) as store:
        tables = export_tables(store, [3])
    assert list(tables["rounds"].columns) == [*LABELS, *ROUND_COLUMNS[1:]]
    assert list(tables["clients"].columns) == [*LABELS, "round", "client_id"]
    assert len(tables["rounds"]) == len(tables["clients"]) == 0
    assert tables["rounds"]["round"].dtype == "int64"  # a Parquet schema as with rows


def test_write_tables_makes_the_folder_and_refuses_to_overwrite_unasked(tmp_path):
    tables = {"runs": pd.DataFrame({"x": [1, 2]}), "rounds": pd.DataFrame({"y": [0.5]})}
    out = tmp_path / "a" / "b"
    assert write_tables(tables, out, "csv") == [out / "runs.csv", out / "rounds.csv"]
    assert (out / "runs.csv").read_text() == "x\n1\n2\n"  # no index column
    with pytest.raises(FpbenchError) as err:
        write_tables(tables, out, "csv")
    assert str(err.value) == f"{out}/runs.csv, {out}/rounds.csv already there; --force overwrites"
    tables["runs"] = pd.DataFrame({"x": [3]})
    write_tables(tables, out, "csv", force=True)
    assert (out / "runs.csv").read_text() == "x\n3\n"
    with pytest.raises(FpbenchError) as err:
        write_tables(tables, out, "xlsx")
    assert str(err.value) == "unknown export format 'xlsx'; choose one of csv, parquet"


def test_parquet_needs_pyarrow_and_writes_each_table_to_its_file(tmp_path, monkeypatch):
    tables = {"runs": pd.DataFrame({"x": [1]})}
    monkeypatch.setattr(export, "has_pyarrow", lambda: False)
    with pytest.raises(FpbenchError) as err:
        write_tables(tables, tmp_path, "parquet")
    assert str(err.value) == "--format parquet needs pyarrow: pip install 'fpbench[parquet]'"
    written = []
    monkeypatch.setattr(export, "has_pyarrow", lambda: True)
    monkeypatch.setattr(pd.DataFrame, "to_parquet", lambda self, *a, **kw: written.append((a, kw)))
    write_tables(tables, tmp_path, "parquet")  # (pyarrow itself is an optional extra)
    assert written == [((tmp_path / "runs.parquet",), {"index": False})]


def test_has_pyarrow_finds_an_importable_pyarrow(tmp_path, monkeypatch):
    (tmp_path / "pyarrow").mkdir()
    (tmp_path / "pyarrow" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert export.has_pyarrow()


def test_the_run_listing_of_a_suite_counts_rounds_and_reads_final_values(tmp_path):
    with _store(tmp_path) as store:
        listing = run_listing(store, suite="s")
    assert list(listing.columns) == COLUMNS and listing.index.tolist() == [0, 1, 2]
    assert listing["id"].tolist() == [1, 2, 3]  # run 4 is suite t's
    assert listing["rounds"].tolist() == [2, 1, pd.NA]  # run 3 has no round yet
    assert listing["acc_global"].tolist()[0] == 0.5  # its last evaluation (round 0)
    assert listing["acc_global"][1:].isna().all()


def test_panels_are_even_where_they_fit_else_as_full_as_fits():
    # row labels "Method" (6) + 4 leave 60 of 70 columns; a column needs "paper " + its text
    # + 3: 11 characters need 20, 31 need 40. Three 20s and a 40: 2 panels either way, and
    # the even ones (20 + 20, 20 + 40 = 60, just fitting) win over the greedy ones (60, 40)
    even = paper_term.panels(_wide(["a" * 11] * 3 + ["b" * 31]), 70)
    assert [[c.key for c in cols] for _, cols in even] == [["c0", "c1"], ["c2", "c3"]]
    # "-" needs 10, 41 characters 50: the greedy panels are 10 + 10, 50, 50 (three), and
    # three even ones of two (10 + 10, 50 + 50) do not fit: the greedy ones are shown
    full = paper_term.panels(_wide(["-", "-", "c" * 41, "d" * 41]), 70)
    assert [[c.key for c in cols] for _, cols in full] == [["c0", "c1"], ["c2"], ["c3"]]


def test_a_header_shows_the_group_path_below_the_panel_title_one_part_a_line():
    legend: dict[str, str] = {}
    col = Line("c", "Accuracy", ("CIFAR", "Dir 0.3"))
    assert paper_term.header(col, 7, legend) == "Dir 0.3\nA"
    assert legend == {"A": "Accuracy"}


def test_an_empty_row_title_leaves_the_label_column_untitled(tmp_path: Path):
    (tmp_path / "tiny.toml").write_text(TINY_PAPER.replace('suite = "tiny"', 'row_title = ""'))
    (filled,) = fill_paper(load_paper("tiny", tmp_path), Results(pd.DataFrame(columns=["run_id"])))
    assert render(filled, "md").splitlines()[2] == "|  | Acc |"
    assert render(filled, "latex").splitlines()[3] == r" & Acc \\"
    panel = paper_term.to_terminal(filled, 80).renderables[1]
    assert [c.header for c in panel.columns] == ["", "Acc"]


def test_a_metric_named_like_a_round_column_or_a_label_keeps_one_row_and_both_values(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        labels = {"suite": "s", "method": "m", "dataset": "d", "partition": "p", "seed": 7}
        store.create_run(run_key="k", config={}, fpbench_version="v", torch_version="v",
                         device="cpu", **labels)  # fmt: skip
        odd = [(None, "wall_s", 9.0, None), (0, "seed", 3.0, None)]
        store.write_round(1, 0, loss_train=1.0, wall_s=2.0, bytes_up=1, bytes_down=1, metrics=odd)
        tables = export_tables(store, [1])
    rounds, clients = tables["rounds"], tables["clients"]
    # pandas keeps both under suffixes: the round's 2 s (_x) and the metric's 9 (_y)
    assert rounds[["round", "wall_s_x", "wall_s_y"]].values.tolist() == [[0, 2.0, 9.0]]
    assert clients[["seed_x", "client_id", "seed_y"]].values.tolist() == [[7, 0, 3.0]]
