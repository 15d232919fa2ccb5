"""What the ViT paper suites run for the cells the review found wrong (beside the protocols)."""

from __future__ import annotations

from fpbench.report.paper import load_paper
from fpbench.report.protocol import feeding_cells
from fpbench.suites import load_suite


def _column_cells(paper: str, number: int, column: str):
    """The suite cells a column of a paper table selects, per row."""
    table = load_paper(paper).table(number)
    col = next(c for c in table.columns if c.key == column)
    suite = load_suite(str(table.spec(table.rows[0], col)["suite"]))
    out = []
    for row in table.rows:
        spec = table.spec(row, col)
        out += [c for c in suite.cells if all(
            spec.get(k) in (None, getattr(c, k).label) for k in ("method", "dataset", "partition")
        )]  # fmt: skip
    return out


def test_fgpt_pt_fedavg_is_fgpt_with_one_group_in_tables_1_7_8():
    """Table 11 defines PT-FedAvg: prompts at FGPT's shared and group positions, FedAvg."""
    for number in (1, 7, 8):
        cells = _column_cells("fgpt", number, "fedvpt")
        assert cells, number
        for c in cells:
            assert (c.method.name, c.method.args["num_groups"]) == ("fgpt", 1), (number, c)


def test_fgpt_table_11_pt_fedavg_row_is_fgpt_with_one_group():
    table = load_paper("fgpt").table(11)
    row = next(r for r in table.rows if r.key == "pt-fedavg")
    fed = [c for c in feeding_cells(load_paper("fgpt")) if 11 in c.tables]
    mine = [c for c in fed if c.method == table.spec(row, table.columns[0])["method"]]
    assert mine and all(
        c.config["method"]["name"] == "fgpt" and c.config["method"]["args"]["num_groups"] == 1
        for c in mine
    )


def test_sgpt_suites_give_fedvpt_one_prompt_token():
    """SGPT's implementation details: prompt length 1 for every method, FedVPT included."""
    for name in ("sgpt-table1", "sgpt-table2", "label-het", "feature-het"):
        cells = [c for c in load_suite(name).cells if c.method.name == "fedvpt"]
        assert cells and all(c.method.args["prompt_len"] == 1 for c in cells), name


def test_fedpr_trains_with_its_own_adam_in_sgpts_suites_and_sgd_in_pep_fedpts():
    """SGPT gives no optimiser for FedPR (its own code's Adam runs); PEP-FedPT's A.3.2 states
    SGD with momentum as the default optimiser, so its suites run it (issue 44); feature-het's
    60-client grid is PEP-FedPT Table 2's, on its recipe."""

    def fedpr(name: str, pep: bool) -> list:
        """FedPR's cells of `name`; in feature-het those of PEP-FedPT's grid or of SGPT's."""
        return [
            c for c in load_suite(name).cells if c.method.name == "fedpr"
            and (name != "feature-het" or (c.partition.label == "domain-60") == pep)
        ]  # fmt: skip

    for name in ("sgpt-table1", "sgpt-table2", "label-het", "feature-het"):
        cells = fedpr(name, pep=False)
        assert cells, name
        for c in cells:
            assert (c.train.optimizer, c.train.lr, c.train.weight_decay) == ("adam", 0.1, 0.0)
    for name in ("heldout", "pep-table1", "pep-table2", "pep-table16", "feature-het"):
        cells = fedpr(name, pep=True)
        assert cells, name
        for c in cells:
            assert (c.train.optimizer, c.train.lr, c.train.momentum) == ("sgd", 0.1, 0.9)
