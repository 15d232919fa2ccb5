"""Edge cases of fpbench/report that its mutation run (issue #31) found untested: each expected
value is worked out by hand in the comment beside it."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import tomllib
from scipy import stats

from fpbench.errors import FpbenchError
from fpbench.report.compare import compare_methods, paired_test
from fpbench.report.paper import (
    Cell,
    FilledTable,
    Line,
    Paper,
    PaperTable,
    Results,
    fill_paper,
    load_paper,
    load_results,
    parse_reported,
    scale_of,
)
from fpbench.report.paper_cells import decimals, diff_text, footer, ours_text, paper_text
from fpbench.report.protocol import (
    Block,
    Deviation,
    FedCell,
    Finding,
    Rule,
    check,
    check_paper,
    coverage,
    deviations,
    feeding_cells,
    load_protocol,
    paper_coverage,
    parse_protocol,
    same,
)
from fpbench.report.readings import Reading, load_readings, parse_readings
from fpbench.report.tables import (
    final_values,
    finished_only,
    flat_parts,
    format_cell,
    render,
    seeds_note,
    summary_stats,
    summary_table,
    t_interval,
    unfinished_note,
)
from fpbench.suites import expand_suite
from tests.conftest import TINY_SUITE_TOML
from tests.test_paper_protocols import TINY_PAPER, _paper
from tests.test_report import Rows

# -- protocol --------------------------------------------------------------------------------


def test_a_finding_names_a_declared_deviation_and_all_its_tables():
    finding = Finding(2, (1, 3), "s: m/d/p", "train.lr", 0.1, 0.2, "sec. 4", declared=True)
    assert str(finding) == (
        "table(s) 1,3, cell s: m/d/p: train.lr = 0.2, protocol declared deviation 0.1 (sec. 4)"
    )


def test_protocol_equality_never_compares_across_kinds():
    assert not same(1, "1") and not same([1], 1) and not same(1, [1])
    assert not same({"a": 1}, "a") and not same({"a": 1}, {"a": 2})
    assert not same({"a": 1}, {"b": 1}) and same({"a": [1, 2.0]}, {"a": [1.0, 2]})


def test_a_glob_rule_reports_every_cell_and_names_its_block(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        '[[protocol]]\ntables = [1]\nrules = [{ path = "train.augment.*", value = false, '
        'source = "s" }]\n',
    )
    found = check(paper, blocks, cells)  # rotate 0.0 is not False, in both cells
    assert sorted((f.block, f.cell, f.path) for f in found) == [
        (1, "tiny: fedvpt/synthetic/pathological", "train.augment.rotate"),
        (1, "tiny: head-tune/synthetic/pathological", "train.augment.rotate"),
    ]


def test_a_protocol_error_names_the_paper_block_and_tables(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        '[[protocol]]\ntables = [1]\nmatch = { method = "sgpt" }\n'
        'rules = [{ path = "train.rounds", value = 2, source = "x" }]\n',
    )
    with pytest.raises(FpbenchError, match=r"^tiny protocol block 1 \(tables \[1\]\): matches no"):
        check(paper, blocks, cells)

    paper, blocks, cells = _paper(
        tmp_path,
        '[[protocol]]\ntables = [1]\nrules = [{ path = "train.roundz", value = 2, source = "x" }]',
    )
    with pytest.raises(FpbenchError, match=r"^tiny protocol block 1 \(tables \[1\]\): path 'train"):
        check(paper, blocks, cells)


def test_every_rule_of_a_block_reports_its_findings(tmp_path):
    paper, blocks, cells = _paper(
        tmp_path,
        '[[protocol]]\ntables = [1]\nmatch = { method = "fedvpt" }\nrules = [\n'
        '  { path = "train.rounds", value = 3, source = "x" },\n'
        '  { path = "train.batch_size", value = 40, source = "y" },\n]\n',
    )
    assert [(f.path, f.got) for f in check(paper, blocks, cells)] == [
        ("train.rounds", 2), ("train.batch_size", 8),
    ]  # fmt: skip


def test_deviations_show_each_match_of_block_and_rule():
    dev = {"runs": 2, "reason": "r", "impossible": "i"}
    rows = deviations(parse_protocol({"protocol": [{
        "tables": [1, 2], "match": {"method": ["fed*", "sgpt"]},
        "rules": [
            {"path": "a", "value": 1, "source": "s", "deviation": dev,
             "match": {"method": "!fedvpt", "config": {"train": {"lr": 0.1, "rounds": 5}}}},
            {"path": "b", "value": [1, 2], "source": "s", "deviation": dev,
             "match": {"dataset": "c*"}},
        ],
    }]}))  # fmt: skip
    assert [(r["tables"], r["match"], r["paper"]) for r in rows] == [
        ("1, 2", "method=fed*,sgpt method=!fedvpt train.lr=0.1 train.rounds=5", "1"),
        ("1, 2", "method=fed*,sgpt dataset=c*", "[1, 2]"),
    ]


def test_check_paper_reads_paper_and_protocol_from_the_given_root(tmp_path):
    rule = (
        '[[protocol]]\ntables = [1]\nrules = [{ path = "train.rounds", value = 11, source = "x" }]'
    )
    (tmp_path / "tiny.toml").write_text(
        TINY_PAPER.replace('suite = "tiny"', 'suite = "smoke"') + rule + "\n"
    )
    found = check_paper("tiny", tmp_path)  # the smoke suite runs 10 rounds
    assert sorted(f.cell for f in found) == [
        f"smoke: {m}/synthetic/{p}" for m in ("fedvpt", "head-tune") for p in ("dir-0.3", "path-s4")
    ]
    assert {f.got for f in found} == {10}
    assert paper_coverage("tiny", tmp_path).kinds["train.rounds"] == "pinned"


def test_a_glob_rule_covers_the_paths_below_what_it_matches():
    rule = Rule("tra?n.augment", None, "", free="x")
    assert rule.covers("train.augment") and rule.covers("train.augment.rotate")
    assert not rule.covers("train.augmented")


def test_a_free_rule_parses_to_its_path_and_reason_only():
    block = {"tables": [1], "rules": [{"path": "runtime", "free": "why", "match": {"seed": 1}}]}
    with pytest.raises(FpbenchError) as err:
        parse_protocol({"protocol": [block]}, "x")
    assert str(err.value) == (
        "x protocol block 1 rule 1 (runtime): match takes labels suite, method, dataset, "
        "partition and config, got {'seed': 1}"
    )
    block["rules"][0]["match"] = {"method": "m"}
    (parsed,) = parse_protocol({"protocol": [block]}, "x")[0].rules
    assert parsed == Rule("runtime", None, "", {"method": ("m",)}, free="why")


@pytest.mark.parametrize(
    "rule, message",
    [
        ({"path": "a", "free": "why", "match": {"method": []}},
         "x protocol block 1 rule 1 (a): a match label needs at least one glob, got "
         "{'method': []}"),
        ({"path": "a", "value": 1, "source": "s", "match": {"dataset": []}},
         "x protocol block 1 rule 1 (a): a match label needs at least one glob, got "
         "{'dataset': []}"),
        ({"path": "a", "free": " "},
         'x protocol block 1 rule 1: a free rule is { path = "...", free = "why it cannot change '
         'the number" } (optional match); unknown []'),
        ({"path": "a", "value": 1, "source": "s", "vaule": 2},
         "x protocol block 1 rule 1: needs path, value, source (optional match, deviation), or "
         "path and free; unknown ['vaule'], missing []"),
        ({"path": "a", "value": 1, "source": "s", "deviation": {"runs": 2}},
         'x protocol block 1 rule 1 (a): deviation = { runs = ..., reason = "one line" } (and '
         'impossible = "why the stated value cannot run here", where the value is stated)'),
    ],
)  # fmt: skip
def test_a_malformed_rule_is_one_error_naming_block_rule_and_path(rule, message):
    with pytest.raises(FpbenchError) as err:
        parse_protocol({"protocol": [{"tables": [1], "rules": [rule]}]}, "x")
    assert str(err.value) == message


@pytest.mark.parametrize(
    "block, message",
    [
        ({"tables": [1], "rules": [], "tabels": [2]},
         "x protocol block 2: unknown key(s) ['tabels']; valid: match, rules, tables"),
        ({"tables": [1, "2"], "rules": []},
         "x protocol block 2: tables must be a non-empty list of table numbers"),
        ({"tables": [1]}, "x protocol block 2: no rules"),
        ({"tables": [1], "rules": [{"path": "a", "free": "-"}], "match": {"model": "x"}},
         "x protocol block 2: match takes labels suite, method, dataset, partition and config, "
         "got {'model': 'x'}"),
        ({"tables": [1], "rules": [{"path": "a", "free": "-"}], "match": {"config": {}}},
         "x protocol block 2: match config is a non-empty table, got {}"),
    ],
)  # fmt: skip
def test_a_malformed_block_is_one_error_naming_its_number(block, message):
    good = {"tables": [1], "rules": [{"path": "a", "free": "-"}]}
    with pytest.raises(FpbenchError) as err:
        parse_protocol({"protocol": [good, block]}, "x")
    assert str(err.value) == message


def test_a_protocol_error_names_the_paper_file_or_memory(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_PAPER + "[[protocol]]\ntables = [1]\n")
    with pytest.raises(FpbenchError, match=r"^tiny\.toml protocol block 1: no rules$"):
        load_protocol("tiny", tmp_path)
    with pytest.raises(FpbenchError, match=r"^<memory> protocol block 1: no rules$"):
        parse_protocol({"protocol": [{"tables": [1]}]})


def test_a_table_selects_cells_by_their_json_config_as_toml_writes_it(tmp_path):
    # the backbone's mean is a tuple in the config, a list in JSON and in TOML
    column = 'metric = "acc_global", config = { backbone = { mean = [0.5, 0.5, 0.5] } } }'
    (tmp_path / "tiny.toml").write_text(TINY_PAPER.replace('metric = "acc_global" }', column))
    suite = TINY_SUITE_TOML.replace(
        'backbone = { name = "vit-test" }',
        'backbone = { name = "vit-test", mean = [0.5, 0.5, 0.5], std = [0.2, 0.2, 0.2] }',
    )
    paper = load_paper("tiny", tmp_path)
    cells = feeding_cells(paper, {"tiny": expand_suite(tomllib.loads(suite), name="tiny")})
    assert sorted(c.method for c in cells) == ["fedvpt", "head-tune"]
    # a protocol block selects them by the same JSON config
    block = {
        "tables": [1],
        "match": {"config": {"backbone": {"mean": [0.5, 0.5, 0.5]}}},
        "rules": [{"path": "train.rounds", "value": 3, "source": "s"}],
    }
    found = check(paper, parse_protocol({"protocol": [block]}), cells)
    assert sorted((f.cell, f.got) for f in found) == [
        ("tiny: fedvpt/synthetic/pathological", 2), ("tiny: head-tune/synthetic/pathological", 2)
    ]  # fmt: skip


def _fed(tables: set[int]) -> FedCell:
    return FedCell("s", "m", "d", "p", 0, {"a": 1, "b": 2}, frozenset(tables))


def test_coverage_counts_only_the_blocks_of_the_tables_a_cell_feeds():
    blocks = [Block(1, (2,), (Rule("a", 1, "q"),)), Block(2, (1,), (Rule("b", 2, "q"),))]
    cov = coverage(None, blocks, [_fed({1})])
    assert cov.uncovered == [("s: m/d/p", "a")] and dict(cov.kinds) == {"b": "pinned"}


def test_a_path_both_pinned_and_declared_counts_as_declared():
    declared = Rule("a", 1, "q", deviation=Deviation(1, "why"))
    blocks = [Block(1, (1,), (Rule("a", 1, "q"), declared, Rule("*", None, "", free="x")))]
    cov = coverage(None, blocks, [_fed({1})])
    assert dict(cov.kinds) == {"a": "declared", "b": "free"}
    assert cov.counts() == {"pinned": 0, "declared": 1, "free": 1}


# -- compare ---------------------------------------------------------------------------------


def test_compare_keeps_the_cells_in_first_seen_order_within_a_metric():
    r = Rows()
    run = iter(range(1, 100))
    for ds in ("svhn", "cifar100"):  # svhn first: not alphabetical
        for method, v in (("fedavg", 0.5), ("sgpt", 0.6)):
            r.add(next(run), method, 0, 9, "acc_global", v, ds=ds)
    found = compare_methods(r.frame(), "fedavg", "sgpt", ["acc_global"])
    assert found["dataset"].tolist() == ["svhn", "cifar100"]


def test_paired_test_rejects_only_below_alpha():
    # differences 0.1, 0.05, 0.15, 0.1: at alpha = their p exactly, "no difference" stands and
    # the interval's low end is 0 (up to rounding)
    a, b = [0.1, 0.2, 0.3, 0.4], [0.2, 0.25, 0.45, 0.5]
    p = float(stats.ttest_rel(b, a).pvalue)
    got = paired_test(a, b, p)
    assert got["p"] == p and got["verdict"] == "within seed noise"
    assert got["ci_low"] == pytest.approx(0.0, abs=1e-12)


def test_paired_test_rounding_tolerance_is_relative_to_the_mean_and_at_least_1e_12():
    # differences 1000 and 1000 + 1e-10: sd 7.1e-11 is below 1e-12 * 1000, so they are equal
    big = paired_test([0.0, 0.0], [1000.0, 1000.0 + 1e-10])
    assert (big["std_diff"], big["t"], big["p"]) == (0.0, math.inf, 0.0)
    # differences 0.5 -+ 1.0607e-12: sd 1.5e-12 is above 1e-12 * max(0.5, 1), so it is kept
    d = 1.5e-12 / math.sqrt(2)
    small = paired_test([0.0, 0.0], [0.5 - d, 0.5 + d])
    assert small["std_diff"] == pytest.approx(1.5e-12, rel=1e-3)
    # differences 0 and 1.414213562373095e-12 (found by stepping through floats): their sd is
    # 1e-12 exactly, the tolerance itself, which still counts as rounding
    edge = paired_test([0.0, 0.0], [0.0, 1.414213562373095e-12])
    assert (edge["std_diff"], edge["t"], edge["p"]) == (0.0, math.inf, 0.0)


# -- paper: the derived metrics ----------------------------------------------------------------

DERIVED = """
paper = "toy"
[[tables]]
number = 1
caption = "toy"
suite = "toy"
rank = "none"
columns = [
  { key = "wall", label = "s/round", metric = "wall_s_per_round" },
  { key = "rounds", label = "rounds", metric = "rounds_to_target", target = 0.6 },
  { key = "secs", label = "secs", metric = "wall_s_to_target", target = 0.6 },
  { key = "bytes", label = "bytes", metric = "bytes_to_target", target = 0.6 },
  { key = "pooled", label = "p", metric = "rounds_to_target", target_metric = "acc_pooled" },
  { key = "any", label = "any", metric = "rounds_to_target" },
  { key = "params", label = "params", metric = "params_to_target", target = 0.6 },
]
rows = [{ key = "m", label = "M", method = "m", dataset = "d" }]
[tables.cells]
"m.pooled" = { target = 0.6 }
[tables.values]
m = ["-", "-", "-", "-", "-", "-", "-"]
"""


def _derived(tmp_path: Path, with_rounds: bool = True):
    (tmp_path / "toy.toml").write_text(DERIVED)
    rows, rounds = [], []
    curves = {  # run 1 of method m reaches 0.6 exactly at round 1; run 2 is another method's
        1: {"acc_global": [0.5, 0.6, 0.9, 0.7], "acc_pooled": [0.1, 0.2, 0.3, 0.65]},
        2: {"acc_global": [0.9, 0.9, 0.9, 0.9], "acc_pooled": [0.9, 0.9, 0.9, 0.9]},
    }
    for run_id, method in ((1, "m"), (2, "other")):
        for name, curve in curves[run_id].items():
            for rnd, value in enumerate(curve):
                rows.append({"run_id": run_id, "suite": "toy", "method": method, "dataset": "d",
                             "partition": "p", "seed": 0, "round": rnd, "name": name,
                             "value": value})  # fmt: skip
        for rnd, wall in enumerate([1.0, 2.0, 3.0, 10.0] if run_id == 1 else [100.0] * 4):
            rounds.append({"run_id": run_id, "round": rnd, "wall_s": wall,
                           "bytes_up": 10 * (rnd + 1), "bytes_down": 100 * (rnd + 1)})  # fmt: skip
    results = Results(pd.DataFrame(rows), {}, pd.DataFrame(rounds) if with_rounds else None)
    (filled,) = fill_paper(load_paper("toy", tmp_path), results)
    assert {c.std for c in filled.cells} == {None}  # one run each (or none): no std
    return {c.column: c.mean for c in filled.cells}


def test_derived_metrics_read_the_cells_own_curve_and_rounds(tmp_path):
    means = _derived(tmp_path)
    assert means["wall"] == 2.5  # median of run 1's 1, 2, 3, 10 s (run 2's 100 s left out)
    assert means["rounds"] == 2.0  # 0.6 reached (>=) at round 1: rounds 0 and 1
    assert means["secs"] == 3.0  # 1 + 2 s
    assert means["bytes"] == 330.0  # up 10 + 20, down 100 + 200
    assert means["pooled"] == 4.0  # acc_pooled first reaches 0.6 at round 3
    assert means["any"] == 1.0  # no target: 0, reached at round 0
    assert means["params"] == 75.0  # down 100 + 200 bytes / 4 to 1 client per round (default)


MARKS = """
paper = "toy"
[[tables]]
number = 1
caption = "toy"
suite = "toy"
columns = [
  { key = "acc", label = "Acc", dataset = "d", metric = "acc_global" },
  { key = "loss", label = "Loss", dataset = "d", metric = "loss", higher_is_better = false },
  { key = "solo", label = "Solo", dataset = "d", metric = "acc_pooled" },
]
rows = [
  { key = "a", label = "A", method = "a" },
  { key = "b", label = "B", method = "b" },
  { key = "c", label = "C", method = "c" },
  { key = "ref", label = "Reference" },
]
[tables.values]
a = ["60.0", "1.0", "<5"]
b = ["70.0", "2.0", "3.0"]
c = ["50.0", "-", "-"]
ref = ["55.0", "-", "-"]
"""


def test_marks_rank_each_column_by_its_direction_and_need_two_values(tmp_path):
    (tmp_path / "toy.toml").write_text(MARKS)
    runs = {
        "a": {"acc_global": 0.8, "loss": 0.3, "acc_pooled": 0.9},
        "b": {"acc_global": 0.6, "loss": 0.2},
        "c": {"acc_global": 0.7, "loss": 0.25},
    }
    rows = [{"run_id": i, "suite": "toy", "method": m, "dataset": "d", "partition": "p",
             "seed": 0, "round": 0, "name": name, "value": v}
            for i, m in enumerate(runs) for name, v in runs[m].items()]  # fmt: skip
    (filled,) = fill_paper(load_paper("toy", tmp_path), Results(pd.DataFrame(rows)))
    marks = {(c.row, c.column): (c.mark, c.paper_mark) for c in filled.cells}
    # no rank given: per column, the higher the better
    assert [marks[r, "acc"] for r in "abc"] == [("best", "second"), ("", "best"), ("second", "")]
    # loss: the lower the better (ours 0.3, 0.2, 0.25; the paper's 1.0, 2.0)
    assert [marks[r, "loss"] for r in "abc"] == [("", "best"), ("best", "second"), ("second", "")]
    # one value of ours (a) and one of the paper's (b; "<5" is a bound): nothing to rank
    assert [marks[r, "solo"] for r in "abc"] == [("", "")] * 3
    # a row without a method is the paper's reference: no run fills it
    assert {(c.n, c.runs, c.mean) for c in filled.cells if c.row == "ref"} == {(0, 0, None)}


def test_derived_metrics_without_round_rows_fill_nothing(tmp_path):
    assert set(_derived(tmp_path, with_rounds=False).values()) == {None}


class _TwoSuites:
    """A store holding run 1 of suite a and run 2 of suite b (what `load_results` reads)."""

    def metrics(self, suite=None):
        r = Rows()
        r.add(1 if suite == "a" else 2, "m", 0, 0, "acc_global", 0.5)
        return r.frame()

    def runs(self):
        return pd.DataFrame({"id": [1, 2], "status": ["done"] * 2, "last_round": [0, 0]})

    def get_run(self, i):
        return type("Run", (), {"config": {"seed": i}})()

    def rounds(self, i):
        return pd.DataFrame({"run_id": [i], "round": [0], "wall_s": [float(i)]})


def test_results_of_two_suites_stack_under_one_fresh_index():
    results = load_results(_TwoSuites(), ["a", "b"])
    metrics, rounds = results.metrics, results.rounds
    assert metrics["run_id"].tolist() == [1, 2] and metrics.index.tolist() == [0, 1]
    assert results.configs == {1: {"seed": 1}, 2: {"seed": 2}}
    assert rounds["wall_s"].tolist() == [1.0, 2.0] and rounds.index.tolist() == [0, 1]


def test_a_cells_config_merges_table_row_column_and_cell_later_winning():
    table = PaperTable(
        "p", 1, "", (Line("r", "R", fields={"config": {"train": {"local_epochs": 2}}}),),
        (Line("c", "C", fields={"metric": "loss", "config": {"train": {"lr": 0.2}}}),),
        {}, {"metric": "acc", "config": {"train": {"lr": 0.1, "rounds": 5}, "x": {"y": 1}}},
        {("r", "c"): {"config": {"x": 3}}},
    )  # fmt: skip
    row, col = table.rows[0], table.columns[0]
    assert table.spec(row, col) == {
        "metric": "loss",
        "config": {"train": {"lr": 0.2, "rounds": 5, "local_epochs": 2}, "x": 3},
    }


def test_a_row_or_column_keeps_key_label_and_group_apart_from_its_run_fields(tmp_path):
    column = '{ key = "acc", label = "Acc",'
    grouped = TINY_PAPER.replace(column, column + ' group = ["G"],')
    (tmp_path / "tiny.toml").write_text(grouped)
    table = load_paper("tiny", tmp_path).table(1)
    assert table.rows[0] == Line("ht", "Head", (), {"method": "head-tune"})
    assert table.columns == (
        Line("acc", "Acc", ("G",), {"dataset": "synthetic", "metric": "acc_global"}),
    )


def test_a_row_with_the_wrong_number_of_values_names_file_table_and_row(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_PAPER.replace('ht = ["50.0"]', 'ht = ["50.0", "1"]'))
    with pytest.raises(FpbenchError) as err:
        load_paper("tiny", tmp_path)
    assert str(err.value) == "tiny.toml table 1: row 'ht' needs 1 values, one per column"
    (tmp_path / "tiny.toml").write_text(TINY_PAPER.split("[tables.values]")[0])
    with pytest.raises(FpbenchError, match=r"^tiny\.toml table 1: row 'ht' needs 1 values"):
        load_paper("tiny", tmp_path)


def test_a_tables_own_fields_are_the_defaults_of_its_cells(tmp_path):
    fields = 'scale = 2.0\nunit = "s"\nrank = "row"\nhigher_is_better = false\n'
    fields += 'config = { train = { rounds = 2 } }\nnote = "n"\nrow_title = "Algo"\n'
    fields += 'suite = "tiny"\n'
    (tmp_path / "tiny.toml").write_text(TINY_PAPER.replace('suite = "tiny"\n', fields))
    table = load_paper("tiny", tmp_path).table(1)
    assert table.defaults == {
        "suite": "tiny", "scale": 2.0, "unit": "s", "rank": "row", "higher_is_better": False,
        "config": {"train": {"rounds": 2}},
    }  # fmt: skip
    labels = (table.paper, table.caption, table.note, table.row_title)
    assert labels == ("tiny", "tiny", "n", "Algo")
    (tmp_path / "tiny.toml").write_text(TINY_PAPER)
    plain = load_paper("tiny", tmp_path).table(1)
    assert (plain.note, plain.row_title) == ("", "Method")


# -- readings --------------------------------------------------------------------------------


def test_a_reading_keeps_its_reason_and_globs():
    blocks = [
        {"tables": [1], "metric": "acc_global", "source": "s", "columns": "c*"},
        {"tables": [2], "metric": "acc_pooled", "source": "t", "rows": ["a", "!b"],
         "reason": "why"},
    ]  # fmt: skip
    assert parse_readings({"readings": blocks}) == [
        Reading(1, (1,), ("c*",), (), "acc_global", "s", ""),
        Reading(2, (2,), (), ("a", "!b"), "acc_pooled", "t", "why"),
    ]


@pytest.mark.parametrize(
    "block, message",
    [
        ({"tables": [1], "metric": "m", "source": "s", "colour": 1},
         r"<memory> readings block 2: needs tables, metric, source \(optional columns, rows, "
         r"reason\); unknown \['colour'\], missing \[\]$"),
        ({"tables": [1], "metric": "m"},
         r"<memory> readings block 2: needs .*; unknown \[\], missing \['source'\]$"),
        ({"tables": ["1"], "metric": "m", "source": "s"},
         r"^<memory> readings block 2: tables must be a list of table numbers$"),
        ({"tables": [1], "metric": "m", "source": "s", "columns": 3},
         r"^<memory> readings block 2: columns is a glob or a list of globs, got 3$"),
        ({"tables": [1], "metric": "m", "source": "s", "rows": ["a", 2]},
         r"^<memory> readings block 2: rows is a glob or a list of globs, got \['a', 2\]$"),
    ],
)  # fmt: skip
def test_a_malformed_reading_is_one_clear_error_naming_its_block(block, message):
    good = {"tables": [1], "metric": "m", "source": "s"}
    with pytest.raises(FpbenchError, match=message):
        parse_readings({"readings": [good, block]})


def test_a_reading_error_names_the_paper_file(tmp_path):
    (tmp_path / "toy.toml").write_text('[[readings]]\ntables = [1]\nmetric = "m"\n')
    with pytest.raises(FpbenchError, match=r"^toy.toml readings block 1: needs "):
        load_readings("toy", tmp_path)


# -- paper cells -----------------------------------------------------------------------------


def _cell(reported: str, metric: str | None = "acc_global", **kw) -> Cell:
    spec = {"method": "m"} if metric is None else {"method": "m", "metric": metric}
    return Cell("r", "c", spec, parse_reported(reported), **kw)


@pytest.mark.parametrize(
    "reported, metric, places",
    [
        ("84.6", "acc_global", 1),  # as many as the paper prints
        ("84.612", "rounds_to_target", 3),
        ("7", "rounds_to_target", 0),  # a count printed whole: whole
        ("7", None, 0),  # no metric: not an accuracy
        ("7", "acc_global", 2),  # an accuracy printed whole: 2
        ("-", "rounds_to_target", 2),  # nothing printed: 2
    ],
)
def test_a_cell_shows_as_many_decimals_as_the_paper_prints(reported, metric, places):
    assert decimals(_cell(reported, metric)) == places


def test_a_cell_shows_its_std_only_over_several_runs():
    assert ours_text(_cell("84.6")) == "—"
    assert ours_text(_cell("84.6", mean=85.25, std=0.0, n=1)) == "85.2"
    assert ours_text(_cell("84.6", mean=85.25, std=None, n=2)) == "85.2"
    assert ours_text(_cell("84.6", mean=85.25, std=0.5, n=2)) == "85.2 ± 0.5"


def test_a_missing_cell_hint_names_every_config_path():
    spec = {"suite": "s", "method": "m", "dataset": "d", "metric": "acc_global",
            "config": {"train": {"local_epochs": 2, "lr": 0.1}}}  # fmt: skip
    cell = Cell("r", "c", spec, parse_reported("1.0"))
    assert cell.hint() == "needs suite s: m/d train.local_epochs=2 train.lr=0.1 · acc_global"


def test_hints_of_reference_cells_inputs_and_cells_without_a_suite():
    def hint(**spec) -> str:
        return Cell("r", "c", spec, parse_reported("1.0")).hint()

    assert hint(method="m") == "reference only (not produced by fpbench)"
    assert hint(metric="acc_global") == "reference only (not produced by fpbench)"
    assert hint(method="m", dataset="d", metric="acc_global") == "needs suite ?: m/d · acc_global"
    assert hint(method="m", dataset="d", metric="acc_global", needs="images") == (
        "needs images (suite ?: m/d)"
    )
    assert hint(suite="s", method="m", metric="acc_global", needs="images") == (
        "needs images (suite s: m)"
    )


def test_a_cell_without_a_paper_value_shows_no_difference():
    assert diff_text(_cell("-", mean=85.25, std=None, n=1)) == ""
    assert diff_text(_cell("84.6", mean=85.25, std=None, n=1)) == "+0.7"  # 0.65000000000001


def test_scale_is_the_cells_own_or_percent_for_accuracies():
    assert scale_of({"metric": "acc_global", "scale": 1}) == 1.0
    assert scale_of({"metric": "acc_global"}) == 100.0
    assert scale_of({"metric": "loss"}) == 1.0


def _filled(note: str) -> FilledTable:
    table = PaperTable("toy", 1, "c", (), (), {}, {}, {}, note=note)
    cells = [
        Cell("r1", "c", {"suite": "a", "method": "m", "metric": "acc"}, parse_reported("1"), 0.5,
             None, 1),
        Cell("r2", "c", {"suite": "c", "method": "m", "metric": "acc"}, parse_reported("-")),
        Cell("r3", "c", {"suite": "b", "method": "m", "metric": "acc"}, parse_reported("2")),
        Cell("r4", "c", {"method": "m", "metric": "acc"}, parse_reported("3")),
        Cell("r5", "c", {}, parse_reported("4")),  # reference only: not counted
    ]  # fmt: skip
    return FilledTable(Paper("toy", "t", "", (table,)), table, cells)


def test_the_footer_names_the_note_and_the_suites_still_to_run():
    filled = _filled("accuracy in %")
    assert filled.missing_suites() == ["b", "c"]
    assert footer(filled) == [
        "note: accuracy in %",
        "3 of 5 cells have no runs yet; fill: `fpbench run --suite b` and `fpbench run --suite c`",
    ]
    assert footer(_filled(""))[0].startswith("3 of 5 cells")
    assert [paper_text(c) for c in filled.cells[:2]] == ["1", "—"]


# -- tables ----------------------------------------------------------------------------------


def test_flat_parts_join_the_column_levels_for_the_terminal():
    table = pd.DataFrame(
        {("c10", "acc"): ["1", "2"], ("c10", "loss"): ["3", "4"]},
        index=pd.Index(["a", "b"], name="method"),
    )
    assert flat_parts(table) == (
        ["method"], ["c10 / acc", "c10 / loss"], [["a", "1", "3"], ["b", "2", "4"]]
    )  # fmt: skip


def test_latex_of_a_table_without_columns_has_one_header_line():
    table = pd.DataFrame(index=pd.Index(["a", "b"], name="method"))
    assert render(table, "latex") == (
        "\\begin{tabular}{l}\n\\toprule\nmethod \\\\\n\\midrule\na \\\\\nb \\\\\n"
        "\\bottomrule\n\\end{tabular}\n"
    )


def test_summary_stats_of_nothing_names_the_suite_to_run():
    with pytest.raises(
        FpbenchError, match="^no results for suite toy; run `fpbench run --suite toy"
    ):
        summary_stats(pd.DataFrame(), ["acc_global"], suite="toy")


def test_nothing_stored_at_all_names_the_command_to_run():
    with pytest.raises(
        FpbenchError,
        match=r"^no results in the database; run `fpbench run --suite <name>` first$",
    ):
        summary_stats(pd.DataFrame(), ["acc_global"])


def _seeded(counts: dict[str, int], part: str = "dir") -> pd.DataFrame:
    """acc_global rows of one run per seed: `counts` maps a method to its number of seeds."""
    r, run = Rows(), 0
    for method, n in counts.items():
        for seed in range(n):
            run += 1
            r.add(run, method, seed, 9, "acc_global", 0.5, ds="syn", part=part)
    return r.frame()


def test_seeds_note_lists_the_odd_cells_in_first_seen_order():
    # counts 2, 2, 1, 1: a tie of 1 and 2 seeds, the larger (2) is the usual count; zeta is
    # seen before alpha and listed first
    metrics = _seeded({"m1": 2, "m2": 2, "zeta": 1, "alpha": 1})
    assert seeds_note(metrics, ["acc_global"]) == (
        "each cell: mean ± std over 2 seeds, except zeta / syn / dir (acc_global): 1; "
        "alpha / syn / dir (acc_global): 1"
    )
    assert seeds_note(_seeded({"m1": 1}), ["acc_global"]) == "each cell: mean ± std over 1 seed"


def test_seeds_note_groups_only_by_the_labels_the_table_has():
    metrics = _seeded({"m1": 2, "m2": 2, "m3": 1}).drop(columns="partition")
    assert seeds_note(metrics, ["acc_global"]) == (
        "each cell: mean ± std over 2 seeds, except m3 / syn (acc_global): 1"
    )


@pytest.mark.parametrize("odd, more", [(6, ""), (7, "; and 1 more")])
def test_seeds_note_shows_six_odd_cells_then_counts_the_rest(odd, more):
    metrics = _seeded({**{f"u{i}": 2 for i in range(9)}, **{f"o{i}": 1 for i in range(odd)}})
    shown = "; ".join(f"o{i} / syn / dir (acc_global): 1" for i in range(6))
    assert seeds_note(metrics, ["acc_global"]) == (
        f"each cell: mean ± std over 2 seeds, except {shown}{more}"
    )


def _runs(n: int) -> pd.DataFrame:
    statuses = ["running", "failed", "interrupted", "running", "failed", "done", "pending"]
    return pd.DataFrame({
        "id": range(1, n + 1),
        "method": [f"m{i}" for i in range(n)],
        "dataset": ["syn"] * n,
        "partition": ["dir"] * n,
        "seed": [0] * n,
        "status": statuses[:n],
        "last_round": pd.array([3, None, 0, 5, 7, 9, None][:n], dtype="Int64"),
    })  # fmt: skip


def test_unfinished_runs_are_running_failed_or_interrupted_runs_with_rows():
    runs = _runs(7)  # run 2 failed before storing a round; 6 is done, 7 pending
    metrics = pd.DataFrame({"run_id": [1, 2, 3, 4, 5, 6, 7], "value": [0.0] * 7})
    kept, left_out = finished_only(metrics, runs)
    assert kept["run_id"].tolist() == [2, 6, 7] and left_out["id"].tolist() == [1, 3, 4, 5]


def test_the_unfinished_note_shows_four_runs_then_counts_the_rest():
    runs = _runs(6)
    assert unfinished_note(runs.iloc[[0, 1]]) == (
        "left out 2 unfinished runs: m0 / syn / dir / seed 0 (running, stored up to round 4); "
        "m1 / syn / dir / seed 0 (failed, no rounds stored)"
    )
    assert unfinished_note(runs) == (
        "left out 6 unfinished runs: m0 / syn / dir / seed 0 (running, stored up to round 4); "
        "m1 / syn / dir / seed 0 (failed, no rounds stored); "
        "m2 / syn / dir / seed 0 (interrupted, stored up to round 1); "
        "m3 / syn / dir / seed 0 (running, stored up to round 6), and 2 more"
    )
    assert unfinished_note(runs.iloc[:5], shown=5).endswith("(failed, stored up to round 8)")
    assert unfinished_note(runs.iloc[[2]]) == (
        "left out 1 unfinished run: m2 / syn / dir / seed 0 (interrupted, stored up to round 1)"
    )


def test_markdown_cells_keep_one_line():
    table = pd.DataFrame({"acc": ["a|b\nc"]}, index=pd.Index(["x"], name="method"))
    assert render(table, "md") == "| method | acc |\n| :-- | --: |\n| x | a\\|b c |\n"


def test_a_cell_shows_std_over_several_runs_and_its_interval_only_when_asked():
    assert format_cell(0.5, 0.1, 3, "acc_global") == "50.00 ± 10.00"
    assert format_cell(0.5, 0.0, 1, "acc_global") == "50.00"  # one run: no std, even a 0.0
    # std 0 over two seeds: the interval is the mean itself, in percent with two decimals
    assert format_cell(0.5, 0.0, 2, "acc_global", ci=True) == "50.00 ± 0.00 [50.00, 50.00]"


def test_a_table_orders_its_columns_label_by_label_in_first_seen_order():
    # first seen: dataset z before y, partition b before a, metric as given; the pairs seen
    # (z b), (y a), (y b), (z a) are ordered by dataset, then partition
    r = Rows()
    for run, (method, ds, part) in enumerate([("m", "z", "b"), ("m", "y", "a"), ("k", "y", "b"),
                                              ("k", "z", "a")]):  # fmt: skip
        r.add(run, method, 0, 9, "loss", 2.0, ds=ds, part=part)
        r.add(run, method, 0, 9, "acc_global", 0.5, ds=ds, part=part)
    table = summary_table(r.frame(), ["loss", "acc_global"])
    assert table.index.name == "method" and table.index.tolist() == ["m", "k"]
    assert [c[:2] for c in table.columns[::2]] == [("z", "b"), ("z", "a"), ("y", "b"), ("y", "a")]
    assert [c[2] for c in table.columns] == ["loss", "acc_global"] * 4
    assert table.loc["m"].tolist() == ["2", "50.00", "-", "-", "-", "-", "2", "50.00"]
    two = summary_table(r.frame(), ["loss"], index=("method", "partition"), columns=("dataset",))
    assert two.index.names == ["method", "partition"]
    assert two.index.tolist() == [("m", "b"), ("m", "a"), ("k", "b"), ("k", "a")]


def test_the_interval_needs_two_seeds_a_std_and_a_mean():
    assert t_interval(0.5, 0.1, 1) is None
    assert t_interval(0.5, float("nan"), 3) is None
    assert t_interval(float("nan"), 0.1, 3) is None
    low, high = t_interval(0.5, 0.1, 2)  # t_{0.975, 1} = 12.706: 0.5 -+ 12.706 * 0.1 / sqrt(2)
    assert (low, high) == pytest.approx((0.5 - 0.898464, 0.5 + 0.898464), abs=1e-6)


def test_a_runs_figure_never_reads_a_per_client_row():
    r = Rows()
    r.add(1, "m", 0, 9, "acc_global", 0.9, client=0)  # the same round, listed first
    r.add(1, "m", 0, 9, "acc_global", 0.5)
    assert final_values(r.frame(), ["acc_global"])["value"].tolist() == [0.5]


def test_grouping_by_a_label_the_table_lacks_is_one_clear_error():
    r = Rows()
    r.add(1, "m", 0, 9, "acc_global", 0.5)
    with pytest.raises(
        FpbenchError, match=r"^cannot group by \['nope'\]: the metric table has no such columns$"
    ):
        summary_stats(r.frame(), ["acc_global"], index=("nope",))


def test_final_values_stack_the_metrics_under_a_fresh_index_or_name_those_stored():
    r = Rows()
    r.add(1, "m", 0, 9, "loss", 2.0)
    r.add(1, "m", 0, 9, "acc_global", 0.5)
    values = final_values(r.frame(), ["acc_global", "loss"])
    assert values[["metric", "value"]].values.tolist() == [["acc_global", 0.5], ["loss", 2.0]]
    assert values.index.tolist() == [0, 1]  # not each metric's own 0
    with pytest.raises(
        FpbenchError, match=r"^no rows for metrics \['acc'\]; stored metrics: acc_global, loss$"
    ):
        final_values(r.frame(), ["acc"])


def test_only_per_client_rows_leave_no_metric_to_name():
    r = Rows()
    r.add(1, "m", 0, 9, "acc_global", 0.5, client=0)
    with pytest.raises(FpbenchError, match=r"; stored metrics: none$"):
        final_values(r.frame(), ["acc_global"])


def test_rendered_cells_leave_none_and_nan_empty_and_print_floats_to_six_digits():
    values = pd.Series([None, float("nan"), 0.123456789, 2.0, "x"], dtype=object)
    table = pd.DataFrame({"v": values}).set_axis(pd.Index(list("abcde"), name="k"))
    assert render(table, "csv") == "k,v\na,\nb,\nc,0.123457\nd,2\ne,x\n"


def test_a_two_level_row_index_renders_as_two_cells():
    table = pd.DataFrame(
        {"acc": ["1", "2"]},
        index=pd.MultiIndex.from_tuples([("m", "b"), ("k", "a")], names=["method", "part"]),
    )
    assert render(table, "csv") == "method,part,acc\nm,b,1\nk,a,2\n"


AVERAGES = """
paper = "avg"
title = "averages"
[[tables]]
number = 1
caption = "derived columns"
suite = "toy"
columns = [
  { key = "d1-base", label = "Base", dataset = "d1", metric = "acc_base" },
  { key = "d1-novel", label = "Novel", dataset = "d1", metric = "acc_novel" },
  { key = "d2-base", label = "Base", dataset = "d2", metric = "acc_base" },
  { key = "d2-novel", label = "Novel", dataset = "d2", metric = "acc_novel" },
  { key = "base", label = "Base", metric = "acc_base", mean_of = ["d1-base", "d2-base"] },
  { key = "novel", label = "Novel", metric = "acc_novel", mean_of = ["d1-novel", "d2-novel"] },
  { key = "hm", label = "H", metric = "acc_hm", hm_of = ["base", "novel"] },
]
rows = [{ key = "a", label = "A", method = "a" }, { key = "b", label = "B", method = "b" }]
[tables.values]
a = ["-", "-", "-", "-", "-", "-", "-"]
b = ["-", "-", "-", "-", "-", "-", "-"]
"""


def test_mean_of_and_hm_of_columns_average_the_row_and_take_the_hm_of_averages(tmp_path):
    (tmp_path / "avg.toml").write_text(AVERAGES)
    runs = {  # (method, dataset, seed): (base, novel); method b has no d2 run
        ("a", "d1", 0): (0.8, 0.6), ("a", "d1", 1): (0.6, 0.4), ("a", "d2", 0): (0.5, 0.2),
        ("b", "d1", 0): (0.9, 0.7),
    }  # fmt: skip
    rows = [{"run_id": i, "suite": "toy", "method": m, "dataset": d, "partition": "p",
             "seed": s, "round": 0, "name": name, "value": v}
            for i, ((m, d, s), (base, novel)) in enumerate(runs.items())
            for name, v in (("acc_base", base), ("acc_novel", novel))]  # fmt: skip
    (filled,) = fill_paper(load_paper("avg", tmp_path), Results(pd.DataFrame(rows)))
    got = {(c.row, c.column): c.mean for c in filled.cells}
    # a: d1 base (80 + 60) / 2 = 70, novel 50; d2 base 50, novel 20; averages 60 and 35
    assert got["a", "base"] == pytest.approx(60.0) and got["a", "novel"] == pytest.approx(35.0)
    assert got["a", "hm"] == pytest.approx(2 * 60 * 35 / 95)  # HM of the averages, not of HMs
    assert filled.cell("a", "hm").n == 1 and filled.cell("a", "base").std is None
    # b lacks d2: its averages (and their HM) stay empty instead of averaging what there is
    assert (got["b", "base"], got["b", "novel"], got["b", "hm"]) == (None, None, None)


def test_a_derived_column_naming_a_column_to_its_right_is_an_error(tmp_path):
    bad = AVERAGES.replace('mean_of = ["d1-base", "d2-base"]', 'mean_of = ["d1-base", "hm"]')
    (tmp_path / "avg.toml").write_text(bad)
    with pytest.raises(
        FpbenchError, match=r"column 'base': mean_of needs keys of columns to its left; \['hm'\]"
    ):
        fill_paper(load_paper("avg", tmp_path), Results(pd.DataFrame(columns=["run_id"])))
