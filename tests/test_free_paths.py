"""Every free path of the paper and suite protocols is proven free: perturbed on the cell's
offline twin (`fpbench.report.free_proof`), the stored results stay bit-identical.

The default run proves, for each protocol, a few cells that together carry every (rule, path) pair
its free rules cover; the slow sweep proves one cell of every distinct twin. The machinery is
held to catching a free path that changes a number (TPFL's `eval_last` as it was marked, and a
learning rate)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from fpbench.report.free_proof import (
    free_paths,
    offline_twin,
    perturbation,
    perturbations,
    prove,
)
from fpbench.report.paper import list_papers, load_paper
from fpbench.report.protocol import FedCell, feeding_cells, load_protocol, parse_protocol
from fpbench.report.suite_protocol import list_suite_protocols, load_suite_protocol, suite_cells

SUITE = "suite:"  # a suite protocol's name here: "suite:flip-compare"


@cache
def _cells(paper: str) -> tuple[FedCell, ...]:
    if paper.startswith(SUITE):
        return tuple(suite_cells(paper.removeprefix(SUITE)))
    return tuple(feeding_cells(load_paper(paper)))


@cache
def _blocks(paper: str) -> list:
    if paper.startswith(SUITE):
        return load_suite_protocol(paper.removeprefix(SUITE)).blocks
    return load_protocol(paper)


def _pairs(blocks, cell) -> set[tuple[int, str, str]]:
    return {(f.block, f.rule.path, f.path) for f in free_paths(blocks, cell)}


def covering_cells(paper: str) -> list[FedCell]:
    """Few cells that together carry every (block, rule, path) free pair of the paper (greedy,
    the cell carrying the most uncovered pairs first)."""
    blocks = _blocks(paper)
    todo = set().union(*(_pairs(blocks, c) for c in _cells(paper)))
    chosen = []
    while todo:
        best = max(_cells(paper), key=lambda c: len(_pairs(blocks, c) & todo))
        chosen.append(best)
        todo -= _pairs(blocks, best)
    return chosen


def _distinct_twins(paper: str) -> list[FedCell]:
    """One cell per distinct offline twin (labels, suite names and seeds aside: a path is free
    of a seed's draw as of any other)."""
    seen: dict[str, FedCell] = {}
    for cell in _cells(paper):
        twin = offline_twin(cell.config)
        twin = {k: v for k, v in twin.items() if k not in ("suite", "seed")}
        for part in ("dataset", "partition", "method"):
            twin[part] = {k: v for k, v in twin[part].items() if k != "label"}
        seen.setdefault(json.dumps(twin, sort_keys=True), cell)
    return list(seen.values())


# SDFed's covering cells include the model-heterogeneous runs (a ResNet CLIP, 10 clients): ~1 min
PROTOCOLS = [*list_papers(), *(SUITE + s for s in list_suite_protocols())]
QUICK = [pytest.param(p, marks=pytest.mark.slow) if p == "sdfed" else p for p in PROTOCOLS]


@pytest.mark.parametrize("paper", QUICK)
def test_every_free_path_of_the_paper_is_proven_free(paper, tmp_path):
    blocks = _blocks(paper)
    problems = []
    for i, cell in enumerate(covering_cells(paper)):
        problems += prove(cell, blocks, tmp_path / str(i)).problems
    assert not problems, f"{paper}:\n  " + "\n  ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("paper", PROTOCOLS)
def test_every_free_path_of_every_distinct_twin_is_proven_free(paper, tmp_path):
    blocks = _blocks(paper)
    problems = []
    for i, cell in enumerate(_distinct_twins(paper)):
        problems += prove(cell, blocks, tmp_path / str(i)).problems
    assert not problems, f"{paper}:\n  " + "\n  ".join(problems)


def _tpfl_cell() -> FedCell:
    return next(c for c in _cells("tpfl") if c.method == "promptfl")


def _free_block(rules: str) -> list:
    import tomllib

    return parse_protocol(tomllib.loads(f"[[protocol]]\ntables = [1, 2]\nrules = [{rules}]\n"))


def test_the_proof_names_a_free_path_that_changes_stored_values(tmp_path: Path):
    # TPFL's eval_last as main marked it free (5 -> 6 scores round 5 of the twin's 11 as well),
    # and a learning rate; the label stays free
    blocks = _free_block(
        '{ path = "train.eval_last", free = "x" }, { path = "train.lr", free = "y" }, '
        '{ path = "method.label", free = "z" }'
    )
    proof = prove(_tpfl_cell(), blocks, tmp_path)
    assert sorted(proof.changes) == ["train.eval_last", "train.lr"]
    assert [p.value for p in proof.perturbed] == ["promptfl-perturbed", 0.002, 6]
    assert (
        "round 5 metric acc_global aggregate value: (missing) != "
        in proof.changes["train.eval_last"][1]
    )
    (lr,) = [p for p in proof.problems if "train.lr" in p]
    assert lr.startswith(
        "clip-fewshot: promptfl/caltech101/few-shot: train.lr is free but changes stored "
        "values when set to 0.002: round 1 loss_train: "
    )


def test_a_free_path_the_twin_cannot_carry_is_reported_not_passed():
    sgpt = next(c for c in _cells("sgpt") if c.dataset == "five-dataset")
    blocks = _free_block('{ path = "dataset.args.notmnist_test_fraction", free = "x" }')
    twin = offline_twin(sgpt.config)
    (p,) = perturbations(twin, free_paths(blocks, sgpt))
    assert p.problem == "the offline twin has no such path (a setting of the real dataset)"


@pytest.mark.parametrize(
    "value, annotation, want",
    [
        (True, bool, False),
        ("fp32", "Literal", "bf16"),
        (160, int, 161),
        (None, int | None, 1),
        (1.0, float, 2.0),
        (0.0, float, 0.5),
        ("coop", str, "coop-perturbed"),
    ],
)
def test_a_perturbation_is_derived_from_the_field(value, annotation, want):
    from typing import Literal

    if annotation == "Literal":
        annotation = Literal["fp32", "bf16"]
    assert perturbation(value, annotation) == want


def test_a_rule_may_name_its_perturbation_and_the_twin_keeps_the_recipe():
    cell = _tpfl_cell()
    blocks = _free_block('{ path = "train.lr_decay", free = "unused", perturb = 0.5 }')
    (p,) = perturbations(offline_twin(cell.config), free_paths(blocks, cell))
    assert (p.value, p.problem) == (0.5, "")
    twin = offline_twin(cell.config)
    assert twin["train"] == {**cell.config["train"], "rounds": 3, "eval_last": 2,
                             "summary_window": 2}  # fmt: skip
    assert twin["method"] == cell.config["method"] and twin["backbone"]["name"] == "clip-test"
    # TPFL's Dassl class blocks: 3 clients of the twin's 6 classes (4 would leave one none)
    assert (twin["dataset"]["name"], twin["partition"]["args"]["num_clients"]) == ("synthetic", 3)


def test_a_held_out_domain_twin_holds_out_a_synthetic_style_domain():
    """clip-lodo's cells hold out a real dataset's domain: the twin holds out d1 of three."""
    from fpbench.specs import RunConfig

    cell = next(c for c in _cells(SUITE + "clip-lodo") if c.dataset == "officehome-no-art")
    assert cell.config["evaluation"]["domain"] == "Art"
    twin = offline_twin(cell.config)
    assert twin["evaluation"] == {**cell.config["evaluation"], "domain": "d1"}
    assert twin["dataset"]["args"]["num_domains"] == 3
    assert RunConfig.model_validate(twin).evaluation.domain == "d1"
