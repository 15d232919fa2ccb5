"""Paper protocols: every suite cell feeding a paper table runs the protocol its paper declares.

Each paper data file with `[[protocol]]` blocks is checked against the suites that feed its
tables (a difference passes only as a declared deviation); the checker itself is tested on a tiny
in-memory paper and suite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.report.paper import PAPERS_DIR, list_papers, load_paper
from fpbench.report.protocol import (
    check,
    check_paper,
    deviations,
    feeding_cells,
    load_protocol,
    parse_protocol,
    same,
)
from fpbench.suites import expand_suite
from tests.conftest import TINY_SUITE_TOML

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
        'deviation = { runs = %d, reason = "memory" } }'
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


def test_protocol_equality():
    assert same(1.0, 1) and same([0.5, 1], (0.5, 1.0)) and same(None, "null")
    assert not same(0.01, 0.0100001) and not same(True, 1) and not same([1, 2], [1])
    assert not same(0.0, "null") and not same("none", "null")


# -- the CLI ----------------------------------------------------------------------------------


def test_cli_lists_the_declared_deviations_of_a_paper():
    result = CliRunner().invoke(app, ["table", "--paper", "sgpt", "--deviations"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line]
    assert lines[0].split("|")[1:-1] == [
        " tables ", " match ", " path ", " paper ", " source ", " fpbench runs ", " reason ",
    ]  # fmt: skip
    want = [r["path"] for r in deviations(load_protocol("sgpt"))]
    assert [line.split("|")[3].strip() for line in lines[2:]] == want
    (alpha,) = [line for line in lines if "partition.args.alpha" in line]
    assert [c.strip() for c in alpha.split("|")[1:7]] == [
        "1", "dataset=five-dataset", "partition.args.alpha", "unstated", "sec. 5.1", "1000.0",
    ]  # fmt: skip


def test_cli_deviations_without_a_paper_is_one_clear_error():
    result = CliRunner().invoke(app, ["table", "--deviations"])
    assert result.exit_code == 2
    assert "--deviations needs --paper NAME" in result.output
    result = CliRunner().invoke(app, ["table", "--paper", "nope", "--deviations"])
    assert result.exit_code == 2 and "unknown paper 'nope'" in result.output
