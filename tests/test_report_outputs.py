"""Paper loading, the paper tables' renderings, `fpbench export`, `fpbench runs` and the
checkable sources: edge cases their mutation run (issue #31) found untested. Each expected value
is worked out by hand in the comment beside it."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from fpbench.report.paper import Results, fill_paper, load_paper
from fpbench.report.sources import anchors, form_problems, normalise, text_problems
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
