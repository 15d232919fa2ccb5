"""Paper protocols: every suite cell feeding a paper table runs the protocol its paper declares.

Each paper data file with `[[protocol]]` blocks is checked against the suites that feed its
tables (a difference passes only as a declared deviation); the checker itself is tested on a tiny
in-memory paper and suite.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.report.paper import PAPERS_DIR, list_papers, load_paper
from fpbench.report.protocol import (
    UNSTATED,
    check,
    check_paper,
    coverage,
    deviation_counts,
    deviations,
    feeding_cells,
    leaf_paths,
    load_protocol,
    paper_coverage,
    parse_protocol,
    same,
)
from fpbench.report.readings import check_readings, load_readings
from fpbench.report.sources import anchors, find_text, form_problems, occurs, text_problems
from fpbench.suites import expand_suite
from tests.conftest import TINY_SUITE_TOML

SHARED = Path(__file__).parents[1].parent / "shared"  # CI: a copy beside the clone, read-only

WITH_PROTOCOL = [
    p
    for p in list_papers()
    if tomllib.loads((PAPERS_DIR / f"{p}.toml").read_text()).get("protocol")
]


def test_sgpt_has_a_protocol():
    assert "sgpt" in WITH_PROTOCOL


@pytest.mark.parametrize("paper", WITH_PROTOCOL)
def test_every_cell_feeding_the_paper_runs_its_protocol(paper):
    findings = check_paper(paper)
    assert not findings, f"{paper}: undeclared differences:\n" + "\n".join(map(str, findings))


@pytest.mark.parametrize("paper", WITH_PROTOCOL)
def test_every_deviation_carries_a_reason_and_a_source(paper):
    for row in deviations(load_protocol(paper)):
        assert row["reason"].strip() and row["source"].strip(), row


@cache
def _coverage(paper: str):
    return paper_coverage(paper)


@pytest.mark.parametrize("paper", list_papers())
def test_every_path_of_every_feeding_cell_is_pinned_declared_or_free(paper):
    cov = _coverage(paper)
    by_path: dict[str, list[str]] = {}
    for cell, path in cov.uncovered:
        by_path.setdefault(path, []).append(cell)
    lines = [f"{p}  ({len(c)} cells, e.g. {c[0]})" for p, c in sorted(by_path.items())]
    assert not lines, f"{paper}: {len(lines)} paths no rule covers:\n  " + "\n  ".join(lines)


@pytest.mark.parametrize("paper", list_papers())
def test_precision_and_executor_are_held_to_the_reference_not_freed(paper):
    kinds = _coverage(paper).kinds
    for path in ("precision", "executor", "frozen_precision", "device", "threads", "compile",
                 "deterministic", "cpu_linear"):  # fmt: skip
        assert kinds[f"runtime.{path}"] != "free", path  # each changes the last bits
    partial = any(c.config["train"]["participation"] < 1 for c in feeding_cells(load_paper(paper)))
    if partial:  # clients may go unsampled: how they are scored is a protocol choice
        assert kinds["train.unseen_clients"] != "free"


@pytest.mark.parametrize("paper", list_papers())
def test_every_filled_column_reads_a_declared_metric(paper):
    problems = check_readings(load_paper(paper), load_readings(paper))
    assert not problems, "\n".join(problems)


def _sources(paper: str) -> list[tuple[str, str, bool]]:
    """(where, source, unstated) of every pinned or declared rule and every reading."""
    out = [
        (f"block {b.index} {r.path}", r.source, r.value == UNSTATED)
        for b in load_protocol(paper)
        for r in b.rules
        if r.free is None
    ]
    return out + [(f"reading {r.index}", r.source, False) for r in load_readings(paper)]


@pytest.mark.parametrize("paper", list_papers())
def test_every_source_quotes_the_paper_or_names_a_file_and_line(paper):
    bad = [f"{w}: {p}" for w, s, u in _sources(paper) for p in form_problems(s, unstated=u)]
    assert not bad, f"{paper}:\n  " + "\n  ".join(bad)


@pytest.mark.skipif(
    not ((SHARED / "papers").is_dir() and (SHARED / "specs").is_dir()),
    reason=f"needs the paper texts and specs at {SHARED}/papers and /specs (../shared beside "
    "the clone)",
)
@pytest.mark.parametrize("paper", list_papers())
def test_every_quote_occurs_in_its_text_and_every_reference_exists(paper):
    text = find_text(load_paper(paper).source, SHARED).read_text()  # a paper, or a spec's notes
    bad = [f"{w}: {p}" for w, s, _ in _sources(paper) for p in text_problems(s, text, SHARED)]
    assert not bad, f"{paper}:\n  " + "\n  ".join(bad)


# -- the checker on a tiny paper ---------------------------------------------------------------

TINY_PAPER = """
paper = "tiny"
title = "tiny"
[[tables]]
number = 1
caption = "tiny"
suite = "tiny"
columns = [{ key = "acc", label = "Acc", dataset = "synthetic", metric = "acc_global" }]
rows = [
  { key = "ht", label = "Head", method = "head-tune" },
  { key = "vpt", label = "VPT", method = "fedvpt" },
]
[tables.values]
ht = ["50.0"]
vpt = ["60.0"]
"""


def _paper(tmp_path: Path, protocol: str):
    (tmp_path / "tiny.toml").write_text(TINY_PAPER + protocol)
    paper = load_paper("tiny", tmp_path)
    suite = expand_suite(tomllib.loads(TINY_SUITE_TOML), name="tiny")
    cells = feeding_cells(paper, {"tiny": suite})
    return paper, load_protocol("tiny", tmp_path), cells


def test_the_cells_feeding_a_table_are_those_its_rows_and_columns_select(tmp_path):
    _, _, cells = _paper(tmp_path, "")
    assert sorted((c.method, c.dataset, c.partition, c.seed) for c in cells) == [
        ("fedvpt", "synthetic", "pathological", 0),
        ("head-tune", "synthetic", "pathological", 0),
    ]
    assert all(c.tables == {1} for c in cells)


def test_a_figures_suite_feeds_the_tables_whose_protocol_it_names(tmp_path):
    figure = '\n[[figures]]\nname = "Fig. 2"\nsuite = "sweep"\ntables = [1]\n'
    (tmp_path / "tiny.toml").write_text(
        TINY_PAPER.replace("\n[[tables]]", figure + "[[tables]]", 1)
    )
    paper = load_paper("tiny", tmp_path)
    assert [(f.name, f.suite, f.tables) for f in paper.figures] == [("Fig. 2", "sweep", (1,))]
    tiny = expand_suite(tomllib.loads(TINY_SUITE_TOML), name="tiny")
    sweep = expand_suite(tomllib.loads(TINY_SUITE_TOML), name="sweep")  # every cell, none picked
    cells = feeding_cells(paper, {"tiny": tiny, "sweep": sweep})
    fed = sorted((c.suite, c.method) for c in cells if c.suite == "sweep")
    assert fed == sorted(("sweep", c.method.label) for c in sweep.cells)
    assert all(c.tables == {1} for c in cells)
    rule = (
        '[[protocol]]\ntables = [1]\nrules = [{ path = "train.rounds", value = 3, source = "s" }]\n'
    )
    found = check(paper, parse_protocol(tomllib.loads(rule)), cells)
    assert {(f.cell.split(":")[0], f.path, f.got) for f in found} == {
        ("tiny", "train.rounds", 2), ("sweep", "train.rounds", 2),
    }  # fmt: skip


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('name = "F"\nsuite = "s"\ntables = [9]', r"figure 'F': tables \[9\]; the paper has \[1\]"),
        ('name = "F"\nsuite = "s"', r"figure 'F': needs name, suite and tables"),
        ('name = "F"\nsuite = "s"\ntables = [1]\nplot = "x"', "needs name, suite and tables"),
    ],
)
def test_a_malformed_figure_entry_is_one_clear_error(tmp_path, entry, message):
    text = TINY_PAPER.replace("\n[[tables]]", f"\n[[figures]]\n{entry}\n[[tables]]", 1)
    (tmp_path / "tiny.toml").write_text(text)
    with pytest.raises(FpbenchError, match=message):
        load_paper("tiny", tmp_path)


def test_the_sweep_suites_run_their_tables_protocol():
    """TPFL Figs. 2-3 and SDFed Figs. 5-6 are checked as Table 1 / Table 3 cells: a sweep cell
    cut by numpy's blocks where PromptFL's rule can run is a finding (it was, before #44)."""
    paper = load_paper("tpfl")
    cells = feeding_cells(paper)
    sweep = [c for c in cells if c.suite == "clip-fewshot-sweeps"]
    assert len(sweep) == 3 * (5 + 10) and {c.tables for c in sweep} == {frozenset({1})}
    assert not check(paper, load_protocol("tpfl"), cells)
    cut = [c for c in sweep if c.partition == "clients-10"]
    moved = [
        replace(c, config={**c.config, "partition": {**c.config["partition"], "args": {
            **c.config["partition"]["args"], "blocks": "array-split"}}})
        for c in cut
    ]  # fmt: skip
    found = check(paper, load_protocol("tpfl"), [c for c in cells if c not in cut] + moved)
    assert {(f.path, f.got, f.expected) for f in found} == {
        ("partition.args.blocks", "array-split", "dassl")
    }
    sdfed = [c for c in feeding_cells(load_paper("sdfed")) if c.suite == "sdfed-sweeps"]
    assert len(sdfed) == 64 * 5 and {c.tables for c in sdfed} == {frozenset({3})}


def test_matching_values_pass(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
rules = [
  { path = "train.rounds", value = 2, source = "s1" },
  { path = "train.lr", value = 0.05000000000001, source = "s2" },
  { path = "partition.args.s", value = 3, source = "s3" },
  { path = "backbone.mean", value = "null", source = "s4" },
  { path = "seeds", value = [0], source = "s5" },
  { path = "method.args.prompt_len", value = 5, source = "s6", match = { method = "fed*" } },
]
""",
    )
    assert check(paper, blocks, cells) == []


def test_an_undeclared_difference_fails_and_names_path_table_and_cell(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
match = { method = "fedvpt" }
rules = [{ path = "train.batch_size", value = 40, source = "sec. 5" }]
""",
    )
    (finding,) = check(paper, blocks, cells)
    assert (finding.path, finding.tables, finding.got, finding.expected) == (
        "train.batch_size", (1,), 8, 40,
    )  # fmt: skip
    assert str(finding) == (
        "table(s) 1, cell tiny: fedvpt/synthetic/pathological: train.batch_size = 8, "
        "protocol paper value 40 (sec. 5)"
    )


def test_a_declared_deviation_passes_only_with_its_runs_value(tmp_path):
    rule = (
        '{ path = "train.batch_size", value = 40, source = "sec. 5", '
        'deviation = { runs = %d, reason = "memory", impossible = "no GPU has 80 GB" } }'
    )
    ok = f"[[protocol]]\ntables = [1]\nrules = [{rule % 8}]\n"
    paper, blocks, cells = _paper(tmp_path, ok)
    assert check(paper, blocks, cells) == []
    paper, blocks, cells = _paper(tmp_path, ok.replace(rule % 8, rule % 16))
    found = check(paper, blocks, cells)
    assert [(f.got, f.expected, f.declared) for f in found] == [(8, 16, True)] * 2
    assert deviations(blocks) == [{
        "tables": "1", "match": "all", "path": "train.batch_size", "paper": "40",
        "source": "sec. 5", "fpbench runs": "16", "reason": "memory",
        "impossible here": "no GPU has 80 GB",
    }]  # fmt: skip


def test_seeds_are_the_sorted_seeds_of_each_cell(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
rules = [{ path = "seeds", value = [0, 1, 2], source = "sec. 5" }]
""",
    )
    found = check(paper, blocks, cells)
    assert sorted((f.cell, f.got) for f in found) == [
        ("tiny: fedvpt/synthetic/pathological", [0]),
        ("tiny: head-tune/synthetic/pathological", [0]),
    ]


@pytest.mark.parametrize(
    "protocol, message",
    [
        ('rules = [{ path = "train.roundz", value = 2, source = "x" }]', "'train.roundz' is not"),
        ('match = { method = "sgpt" }\nrules = [{ path = "train.rounds", value = 2, source = "" }]',
         "matches no suite cell"),
        ('rules = [{ path = "train.rounds", value = 2, source = "x", match = { dataset = "c*" } }]',
         "rule train.rounds: matches no suite cell"),
    ],
)  # fmt: skip
def test_a_typo_or_a_block_matching_nothing_is_an_error(tmp_path, protocol, message):
    paper, blocks, cells = _paper(tmp_path, f"[[protocol]]\ntables = [1]\n{protocol}\n")
    with pytest.raises(FpbenchError, match=message):
        check(paper, blocks, cells)


@pytest.mark.parametrize(
    "block, message",
    [
        ({"tables": [1], "rules": [{"path": "a", "value": 1}]}, "missing \\['source'\\]"),
        ({"tables": [1], "rules": [{"path": "a", "value": "unstated", "source": "-"}]},
         "needs a deviation"),
        ({"tables": [1], "rules": [{"path": "a", "value": 1, "source": "-",
                                    "deviation": {"runs": 2}}]}, "reason"),
        ({"tables": [], "rules": [{"path": "a", "value": 1, "source": "-"}]}, "tables"),
        ({"tables": [1], "match": {"model": "x"}, "rules": [{"path": "a", "value": 1,
                                                             "source": "-"}]}, "match takes"),
    ],
)  # fmt: skip
def test_malformed_blocks_are_one_clear_error(block, message):
    with pytest.raises(FpbenchError, match=message):
        parse_protocol({"protocol": [block]})


def test_a_deviation_from_a_stated_value_needs_an_impossible_reason():
    stated = {"path": "a", "value": 1, "source": "-", "deviation": {"runs": 2, "reason": "r"}}
    with pytest.raises(FpbenchError, match='states 1, so it is run; .* needs impossible = "'):
        parse_protocol({"protocol": [{"tables": [1], "rules": [stated]}]})
    silent = {**stated, "value": "unstated"}  # where the sources are silent: no reason needed
    (block,) = parse_protocol({"protocol": [{"tables": [1], "rules": [silent]}]})
    assert block.rules[0].deviation.impossible is None
    blank = {**stated, "deviation": {"runs": 2, "reason": "r", "impossible": " "}}
    with pytest.raises(FpbenchError, match="needs impossible"):
        parse_protocol({"protocol": [{"tables": [1], "rules": [blank]}]})


@pytest.mark.parametrize("paper", WITH_PROTOCOL)
def test_no_paper_declares_a_stated_value_without_saying_why_it_cannot_run(paper):
    for block in load_protocol(paper):  # parse_protocol refuses it; the rows say it
        for rule in block.rules:
            if rule.deviation is not None and rule.value != UNSTATED:
                assert rule.deviation.impossible, (paper, block.index, rule.path)


def test_the_stated_values_issue_44_names_are_run_not_declared():
    def rules(paper, path, method):
        return [
            r for b in load_protocol(paper) for r in b.rules
            if r.path == path and method in str(r.match.get("method", ""))
        ]  # fmt: skip

    (fedvpt,) = rules("pep-fedpt", "method.args.prompt_len", "'fedvpt',")
    assert (fedvpt.value, fedvpt.deviation) == (1, None)
    (baselines,) = rules("sgpt", "method.args.prompt_len", "fedem")
    assert (baselines.value, baselines.deviation) == (1, None)
    (visual,) = rules("tpfl", "method.args.visual_optimizer", "tpfl")
    assert (visual.value, visual.deviation) == ("shared", None)
    assert check_paper("pep-fedpt") == [] and check_paper("sgpt") == [] == check_paper("tpfl")


def test_deviation_counts_split_stated_from_silent_per_suite(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
rules = [
  { path = "train.batch_size", value = 40, source = "s", match = { method = "fedvpt" }, DEV },
  { path = "train.rounds", value = "unstated", source = "x", deviation = SILENT },
]
""".replace("DEV", 'deviation = { runs = 8, reason = "r", impossible = "i" }').replace(
            "SILENT", '{ runs = 2, reason = "r" }'
        ),
    )
    assert deviation_counts(blocks, cells) == {
        "all": {"stated": 1, "silent": 1}, "tiny": {"stated": 1, "silent": 1},
    }  # fmt: skip


def test_a_block_naming_a_table_the_paper_lacks_is_an_error(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [7]
rules = [{ path = "train.rounds", value = 2, source = "x" }]
""",
    )
    with pytest.raises(FpbenchError, match="no table \\[7\\]"):
        check(paper, blocks, cells)


def test_match_takes_glob_lists_and_negations(tmp_path):
    rule = '{ path = "train.batch_size", value = 40, source = "x", match = { method = %s } }'
    for match, hits in [('"fed*"', 1), ('["head-*", "fedvpt"]', 2), ('"!fedvpt"', 1),
                        ('["*", "!head-tune", "!fedvpt"]', None)]:  # fmt: skip
        paper, blocks, cells = _paper(
            tmp_path, f"[[protocol]]\ntables = [1]\nrules = [{rule % match}]\n"
        )
        if hits is None:
            with pytest.raises(FpbenchError, match="matches no suite cell"):
                check(paper, blocks, cells)
        else:
            assert len(check(paper, blocks, cells)) == hits, match


def test_match_config_selects_cells_by_their_resolved_config(tmp_path):
    rule = (
        '{ path = "train.batch_size", value = 40, source = "x", '
        "match = { method = %s, config = { method = { name = %s } } } }"
    )
    for method, name, hits in [('"*"', '"fedvpt"', 1), ('"head-*"', '"fedvpt"', None)]:
        paper, blocks, cells = _paper(
            tmp_path, f"[[protocol]]\ntables = [1]\nrules = [{rule % (method, name)}]\n"
        )
        if hits is None:
            with pytest.raises(FpbenchError, match="matches no suite cell"):
                check(paper, blocks, cells)
        else:
            assert [f.cell for f in check(paper, blocks, cells)] == [
                "tiny: fedvpt/synthetic/pathological"
            ]
    assert deviations(parse_protocol({"protocol": [{"tables": [1], "rules": [{
        "path": "a", "value": 1, "source": "s",
        "deviation": {"runs": 2, "reason": "r", "impossible": "i"},
        "match": {"config": {"train": {"local_epochs": 2}}},
    }]}]}))[0]["match"] == "train.local_epochs=2"  # fmt: skip
    with pytest.raises(FpbenchError, match="non-empty table"):
        parse_protocol({"protocol": [{"tables": [1], "match": {"config": 2}, "rules": [
            {"path": "a", "value": 1, "source": "s"}]}]})  # fmt: skip


def test_protocol_equality():
    assert same(1.0, 1) and same([0.5, 1], (0.5, 1.0)) and same(None, "null")
    assert not same(0.01, 0.0100001) and not same(True, 1) and not same([1, 2], [1])
    assert not same(0.0, "null") and not same("none", "null")


# -- completeness on the tiny paper ----------------------------------------------------------


def test_leaf_paths_descend_mappings_and_keep_lists_and_none_as_leaves():
    config = {"a": {"b": 1, "c": [1, 2], "d": {}}, "e": None, "seed": 0}
    assert leaf_paths(config) == {"a.b": 1, "a.c": [1, 2], "e": None, "seed": 0}


def test_coverage_names_every_uncovered_path_and_counts_the_kinds(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
rules = [
  { path = "train.rounds", value = 2, source = "s" },
  { path = "train.batch_size", value = 40, source = "s", DEV },
  { path = "seeds", value = [0], source = "s" },
  { path = "runtime.*", free = "how the run executes" },
  { path = "train", free = "everything else of train", match = { method = "fedvpt" } },
]
""".replace("DEV", 'deviation = { runs = 8, reason = "r", impossible = "i" }').replace(
            "SILENT", '{ runs = 2, reason = "r" }'
        ),
    )
    cov = coverage(paper, blocks, cells)
    uncovered = {p for _, p in cov.uncovered}
    assert "train.lr" in uncovered and "method.name" in uncovered and "seed" not in uncovered
    assert not any(p.startswith("runtime.") for p in uncovered)
    # train.lr is free for fedvpt, uncovered for head-tune only
    assert [c for c, p in cov.uncovered if p == "train.lr"] == [
        "tiny: head-tune/synthetic/pathological"
    ]
    assert (cov.kinds["train.rounds"], cov.kinds["train.batch_size"], cov.kinds["seed"]) == (
        "pinned", "declared", "pinned",
    )  # fmt: skip
    assert cov.kinds["runtime.precision"] == "free" and cov.kinds["train.lr"] == "free"
    n = cov.counts()
    assert n["pinned"] == 2 and n["declared"] == 1
    assert n["free"] == len(cov.kinds) - 3


def test_a_glob_rule_with_a_value_checks_every_path_it_covers(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        """
[[protocol]]
tables = [1]
match = { method = "head-tune" }
rules = [{ path = "train.augment.*", value = false, source = "s" }]
""",
    )
    (finding,) = check(paper, blocks, cells)  # hflip is False; rotate 0.0 is not False
    assert (finding.path, finding.got) == ("train.augment.rotate", 0.0)


@pytest.mark.parametrize(
    "rule, message",
    [
        ('{ path = "train.nothing*", free = "x" }', "covers no path"),
        ('{ path = "train.nothing", free = "x" }', "covers no path"),
    ],
)
def test_a_free_rule_covering_nothing_is_an_error(tmp_path, rule, message):
    paper, blocks, cells = _paper(tmp_path, f"[[protocol]]\ntables = [1]\nrules = [{rule}]\n")
    with pytest.raises(FpbenchError, match=message):
        check(paper, blocks, cells)


@pytest.mark.parametrize(
    "rule",
    [
        {"path": "a", "free": ""},
        {"path": "a", "free": "x", "value": 1},
        {"free": "x"},
    ],
)
def test_a_malformed_free_rule_is_one_clear_error(rule):
    with pytest.raises(FpbenchError, match="free rule"):
        parse_protocol({"protocol": [{"tables": [1], "rules": [rule]}]})


# -- metric readings on the tiny paper -------------------------------------------------------


def _readings(tmp_path: Path, readings: str) -> list[str]:
    (tmp_path / "tiny.toml").write_text(TINY_PAPER + readings)
    return check_readings(load_paper("tiny", tmp_path), load_readings("tiny", tmp_path))


def test_a_column_reading_its_declared_metric_passes(tmp_path):
    reading = '[[readings]]\ntables = [1]\nmetric = "acc_global"\nsource = \'"x"\'\n'
    assert _readings(tmp_path, reading) == []


def test_a_column_without_a_reading_or_reading_another_metric_fails(tmp_path):
    assert _readings(tmp_path, "") == [
        "tiny table 1 cell ht.acc reads acc_global without a reading rule",
        "tiny table 1 cell vpt.acc reads acc_global without a reading rule",
    ]
    wrong = '[[readings]]\ntables = [1]\nrows = "vpt"\nmetric = "acc_pooled"\nsource = "q"\n'
    other = '[[readings]]\ntables = [1]\nrows = "!vpt"\nmetric = "acc_global"\nsource = "q"\n'
    assert _readings(tmp_path, wrong + other) == [
        "tiny table 1 cell vpt.acc reads acc_global, its reading rule (block 1) says acc_pooled (q)"
    ]
    stale = '[[readings]]\ntables = [1]\ncolumns = "nope"\nmetric = "m"\nsource = "q"\n'
    both = '[[readings]]\ntables = [1]\nmetric = "acc_global"\nsource = "q"\n'
    assert _readings(tmp_path, both + both + stale) == [
        "tiny table 1 cell ht.acc: more than one reading rule (blocks 1, 2)",
        "tiny table 1 cell vpt.acc: more than one reading rule (blocks 1, 2)",
        "tiny readings block 3 selects no filled cell",
    ]


# -- checkable sources -----------------------------------------------------------------------


def test_a_source_needs_a_quote_or_a_file_and_line():
    assert form_problems('sec. 5.1: "E = 5"') == []
    assert form_problems("sgpt-reference-code.md:301 (train.sh)") == []
    assert form_problems("sec. 5.1") and form_problems("ref 3.5")
    assert form_problems("silent: sec. 4.1 gives no batch size", unstated=True) == []
    assert form_problems("silent: sec. 4.1", unstated=False)
    assert form_problems("silent:", unstated=True)


def test_anchors_tie_a_quote_to_the_reference_it_follows():
    found = anchors('a.md:3-4 "x y"; sec. 2 "z"')
    assert [(a.kind, a.text, a.file, a.first, a.last) for a in found] == [
        ("ref", "", "a.md", 3, 4), ("quote", "x y", "", 0, 0), ("quote", "z", "", 0, 0),
    ]  # fmt: skip
    assert found[1].ref == found[0] and found[2].ref is None


def test_quotes_match_up_to_whitespace_and_hyphenated_line_breaks_only():
    text = "We train for 60 rounds\nwith local epochs E = 5 on proto-\ntypes and few-\nshot data."
    assert occurs("60 rounds with local epochs E = 5", text)
    assert occurs("on prototypes", text) and occurs("few-shot data", text)
    assert not occurs("60 rounds with local epochs E=5", text)
    assert not occurs("50 rounds", text)


def test_text_problems_check_quotes_against_the_paper_or_the_referenced_lines(tmp_path):
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "ref.md").write_text("one\n--comm_round 60\nthree\n")
    paper = "The clients train E = 5 epochs."
    ok = 'sec. 1: "E = 5 epochs"; ref.md:2 "--comm_round 60"'
    assert text_problems(ok, paper, tmp_path) == []
    assert text_problems('ref.md:1 "--comm_round 60"', paper, tmp_path) == [
        "quote '--comm_round 60' does not occur in ref.md:1"
    ]
    assert text_problems('"E = 6"; ref.md:4; nope.md:1', paper, tmp_path) == [
        "quote 'E = 6' does not occur in the paper",
        "reference ref.md:4-4: the file has 3 lines",
        f"reference nope.md:1: no such file under {tmp_path}/{{specs,papers}}",
    ]


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_lists_the_declared_deviations_of_a_paper():
    result = CliRunner().invoke(app, ["table", "--paper", "sgpt", "--deviations"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line]
    assert lines[0].split("|")[1:-1] == [
        " kind ", " tables ", " match ", " path ", " paper ", " source ", " fpbench runs ",
        " reason ", " impossible here ",
    ]  # fmt: skip
    rows = deviations(load_protocol("sgpt"))
    stated = [r["path"] for r in rows if r["paper"] != UNSTATED]
    silent = [r["path"] for r in rows if r["paper"] == UNSTATED]
    assert [line.split("|")[4].strip() for line in lines[2:-2]] == stated + silent
    kinds = [line.split("|")[1].strip() for line in lines[2:-2]]
    assert kinds == ["stated"] * len(stated) + ["silent"] * len(silent)
    assert lines[-2].startswith(
        f"sgpt deviations: {len(stated)} from stated values (impossible here), "
        f"{len(silent)} silent choices; per suite (stated/silent): sgpt-ablations "
    )
    cov = paper_coverage("sgpt")
    n = cov.counts()
    assert lines[-1] == (
        f"sgpt: {len(cov.paths)} config paths of {len(feeding_cells(load_paper('sgpt')))} "
        f"feeding cells: {n['pinned']} pinned, {n['declared']} declared, {n['free']} free"
    )
    (alpha,) = [line for line in lines if "partition.args.alpha" in line]
    assert [c.strip() for c in alpha.split("|")[1:8]] == [
        "silent", "1", "dataset=five-dataset", "partition.args.alpha", "unstated",
        'sec. 5.1: "with every 4 clients originating from the same dataset"', "1000.0",
    ]  # fmt: skip


def test_cli_deviations_csv_keeps_the_counts_in_a_comment_line():
    result = CliRunner().invoke(
        app, ["table", "--paper", "tpfl", "--deviations", "--format", "csv"]
    )
    assert result.exit_code == 0, result.output
    *rows, last = result.output.strip().splitlines()
    n = paper_coverage("tpfl").counts()
    assert last.startswith("# tpfl: ") and last.endswith(
        f"{n['pinned']} pinned, {n['declared']} declared, {n['free']} free"
    )
    assert rows[0] == "kind,tables,match,path,paper,source,fpbench runs,reason,impossible here"
    assert rows[-1].startswith("# tpfl deviations: 2 from stated values (impossible here), ")


def test_cli_deviations_without_a_paper_is_one_clear_error():
    result = CliRunner().invoke(app, ["table", "--deviations"])
    assert result.exit_code == 2
    assert "--deviations needs --paper NAME" in result.output
    result = CliRunner().invoke(app, ["table", "--paper", "nope", "--deviations"])
    assert result.exit_code == 2 and "unknown paper 'nope'" in result.output
