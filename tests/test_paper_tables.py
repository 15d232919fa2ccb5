"""Paper tables: the transcribed reference values, and their rendering beside fpbench's runs."""

from __future__ import annotations

import io
import math

import pandas as pd
import pytest
from rich.console import Console

from fpbench.errors import FpbenchError
from fpbench.report import paper_render
from fpbench.report.paper import fill_paper, list_papers, load_paper, load_results, parse_reported
from fpbench.store import Store

# The tables the papers print, and the cells each leaves empty (counted by hand in the texts
# under ../shared/papers: "-", "NA", "N/A", "–"). Every other cell must carry a value.
TABLES = {
    "sgpt": [1, 2, 3, 4, 5],
    "fgpt": [1, 2, 3, 4, 6, 7, 8, 9, 10, 11],
    "pep-fedpt": [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    "sdfed": [1, 2, 3, 4, 5, 6, 7],
    "tpfl": [1, 2],
}
SHAPES = {  # (rows, columns) of each printed table
    "sgpt": {1: (8, 9), 2: (7, 12), 3: (5, 2), 4: (3, 2), 5: (1, 4)},
    "fgpt": {1: (5, 7), 2: (1, 4), 3: (5, 2), 4: (4, 1), 6: (2, 3), 7: (2, 7), 8: (4, 7), 9: (2, 3),
             10: (5, 5), 11: (4, 4)},
    "pep-fedpt": {1: (8, 8), 2: (8, 10), 3: (8, 4), 4: (2, 2), 5: (2, 2), 6: (5, 3), 8: (2, 4),
                  9: (2, 3), 10: (2, 3), 11: (2, 3), 12: (3, 1), 13: (3, 1), 14: (8, 4),
                  15: (8, 3), 16: (8, 4), 17: (3, 3)},
    "sdfed": {1: (6, 10), 2: (6, 10), 3: (6, 8), 4: (6, 5), 5: (4, 2), 6: (5, 5), 7: (7, 2)},
    "tpfl": {1: (4, 7), 2: (4, 7)},
}  # fmt: skip
EMPTY_CELLS = {("fgpt", 1): 1, ("fgpt", 10): 3, ("fgpt", 11): 3, ("pep-fedpt", 3): 2,
               ("pep-fedpt", 14): 2, ("sdfed", 5): 1}  # fmt: skip
# fpbench's reference rows beside a paper's own (issue #34): the paper prints none, so every
# cell of theirs is empty; the CLIP tables comparing methods carry them
REFERENCE_ROWS = {"zero-shot", "centralized"}
WITH_REFERENCE_ROWS = {("sdfed", 1): 2, ("sdfed", 2): 2, ("sdfed", 3): 2, ("sdfed", 4): 1,
                       ("sdfed", 7): 2, ("tpfl", 1): 2, ("tpfl", 2): 2}  # fmt: skip


def test_every_listed_table_is_transcribed_with_all_its_values():
    assert set(list_papers()) >= set(TABLES)
    for name, numbers in TABLES.items():
        paper = load_paper(name)
        assert [t.number for t in paper.tables] == numbers, name
        for t in paper.tables:
            rows, cols = SHAPES[name][t.number]
            printed = [r for r in t.rows if r.key not in REFERENCE_ROWS]
            assert (len(printed), len(t.columns)) == (rows, cols), (name, t.number)
            ours = [r for r in t.rows if r.key in REFERENCE_ROWS]
            assert len(ours) == WITH_REFERENCE_ROWS.get((name, t.number), 0), (name, t.number)
            assert all(t.values[(r.key, c.key)].empty for r in ours for c in t.columns)
            assert t.count() == rows * cols - EMPTY_CELLS.get((name, t.number), 0), (name, t.number)


def _value(paper: str, number: int, row: str, col: str):
    return load_paper(paper).table(number).values[(row, col)]


def test_spot_values_match_the_papers():
    assert _value("sgpt", 1, "sgpt", "cifar100-global-s10").value == 84.64
    assert _value("sgpt", 2, "fedpr", "office-webcam").value == 96.61
    pep = _value("pep-fedpt", 1, "pep-fedpt", "cifar100-path-s10-mean")
    assert (pep.value, pep.spread) == (95.46, 0.16)
    assert _value("pep-fedpt", 6, "fedpr", "rounds").bound == ">"
    assert _value("fgpt", 1, "five", "fgpt-u").empty
    assert _value("sdfed", 7, "sdfed-fixed", "cifar10").value == 95.21
    assert _value("tpfl", 2, "promptfl", "eurosat").value == 33.4


def _row(paper: str, number: int, row: str) -> list[str]:
    t = load_paper(paper).table(number)
    return [t.values[(row, c.key)].text for c in t.columns]


def test_values_repeated_across_tables_agree():
    """Papers repeat cells across tables; independent transcriptions must agree."""
    t1 = load_paper("pep-fedpt").table(1).values
    t4 = load_paper("pep-fedpt").table(4).values
    assert t4[("shared-ccmp", "pathological")] == t1[("pep-fedpt", "cifar100-path-s10-mean")]
    assert t4[("only-shared", "dirichlet")] == t1[("fedvpt", "cifar100-dir-0.3-mean")]
    t2 = load_paper("pep-fedpt").table(2).values
    t10 = load_paper("pep-fedpt").table(10).values
    assert t10[("only-shared", "domainnet")] == t2[("fedvpt", "domainnet-mean")]
    assert _row("fgpt", 8, "s10-e5") == _row("fgpt", 1, "cifar100-s10")
    assert _row("fgpt", 8, "s5-e5") == _row("fgpt", 1, "cifar100-s5")
    assert _row("sdfed", 6, "all") == _row("sdfed", 1, "sdfed")[::2]
    assert _row("pep-fedpt", 15, "pep-fedpt")[2] == _row("pep-fedpt", 2, "pep-fedpt")[9]


@pytest.mark.parametrize(
    ("paper", "number", "domains", "avg"),
    [
        ("sgpt", 2, [f"office-{d}" for d in ("amazon", "caltech", "dslr", "webcam")], "office-avg"),
        ("sdfed", 2, [f"{d}-vit" for d in ("product", "clipart", "real-world", "art")], "avg-vit"),
        (
            "sdfed",
            2,
            [f"{d}-rn50" for d in ("product", "clipart", "real-world", "art")],
            "avg-rn50",
        ),
        ("sdfed", 3, [f"{d}-vit" for d in ("webcam", "amazon", "dslr")], "avg-vit"),
        ("sdfed", 3, [f"{d}-rn50" for d in ("webcam", "amazon", "dslr")], "avg-rn50"),
    ],
)
def test_average_columns_are_the_mean_of_their_domain_columns(paper, number, domains, avg):
    """One client per domain: the paper's average is the plain mean, so column order is right."""
    t = load_paper(paper).table(number)
    for row in (r for r in t.rows if r.key not in REFERENCE_ROWS):
        values = [t.values[(row.key, d)].value for d in domains]
        assert sum(values) / len(values) == pytest.approx(t.values[(row.key, avg)].value, abs=0.011)


@pytest.mark.parametrize(
    ("text", "value", "spread", "bound"),
    [
        ("84.16 ± 0.24", 84.16, 0.24, ""),
        ("81.09 (0.40)", 81.09, 0.40, ""),
        ("77.51(0.24)", 77.51, 0.24, ""),
        ("7.7 M", 7.7, None, ""),
        (">100", 100.0, None, ">"),
        ("0", 0.0, None, ""),
        ("18.31 + 74.39 * T", None, None, ""),
        ("NA", None, None, ""),
    ],
)
def test_parse_reported(text, value, spread, bound):
    r = parse_reported(text)
    assert (r.value, r.spread, r.bound) == (value, spread, bound)
    assert r.empty == (text == "NA")


# -- rendering from a results database ---------------------------------------------------------


def _run(store: Store, suite, method, seed, final, *, ds="cifar100", part="path-s10", cfg=None):
    rec = store.create_run(
        run_key=f"{suite}-{method}-{ds}-{part}-{seed}-{cfg}",
        suite=suite, method=method, dataset=ds, partition=part, seed=seed,
        config=cfg or {"train": {"local_epochs": 5}},
        fpbench_version="test", torch_version="test", device="cpu",
    )  # fmt: skip
    names = ("acc_global", "acc_pooled")  # SGPT's and FGPT's accuracy columns read acc_pooled
    for rnd, acc in enumerate(final):
        metrics = [(None, name, acc, None) for name in names]
        if rnd == len(final) - 1:
            mean = sum(final) / len(final)
            metrics += [(None, f"{name}_last10", mean, None) for name in names]
        store.write_round(rec.id, rnd, loss_train=1.0, wall_s=2.0, bytes_up=400, bytes_down=800,
                          metrics=metrics)  # fmt: skip
    return rec.id


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """SGPT Table 1 cells: sgpt on 2 seeds (85 %, 86 %), fedvpt 80 %, head-tune 70 %; made
    once, the tests only read it."""
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('sgpt') / 'r.db'}")
    _run(store, "sgpt-table1", "sgpt", 0, [0.80, 0.90])  # mean of the window: 0.85
    _run(store, "sgpt-table1", "sgpt", 1, [0.86])
    _run(store, "sgpt-table1", "fedvpt", 0, [0.80])
    _run(store, "sgpt-table1", "head-tune", 0, [0.70])
    _run(store, "other-suite", "fedmix", 0, [0.99])  # another suite: must not fill a cell
    yield store
    store.close()


@pytest.fixture(scope="module")
def sgpt_t1(db):
    return fill_paper(load_paper("sgpt"), load_results(db), 1)[0]


def test_cells_show_mean_std_over_seeds_paper_value_and_difference(sgpt_t1):
    cell = sgpt_t1.cell("sgpt", "cifar100-global-s10")
    assert cell.n == 2
    assert cell.mean == pytest.approx(85.5)
    assert cell.std == pytest.approx(math.sqrt(0.5))  # sample std of 85 and 86
    assert cell.diff == pytest.approx(85.5 - 84.64)
    assert paper_render.ours_text(cell) == "85.50 ± 0.71"
    assert paper_render.diff_text(cell) == "+0.86"
    single = sgpt_t1.cell("fedvpt", "cifar100-global-s10")
    assert (single.n, paper_render.ours_text(single)) == (1, "80.00")


def test_missing_cells_name_the_suite_and_cell_that_fill_them(sgpt_t1):
    fedmix = sgpt_t1.cell("fedmix", "cifar100-global-s10")
    assert fedmix.n == 0 and fedmix.mean is None
    assert "sgpt-table1" in fedmix.hint() and "fedmix/cifar100/path-s10" in fedmix.hint()
    other = sgpt_t1.cell("sgpt", "cifar100-global-s50")  # same method, other partition
    assert other.n == 0 and "path-s50" in other.hint()
    md = paper_render.to_markdown(sgpt_t1)
    assert "`fpbench run --suite sgpt-table1`" in md


def test_a_cell_whose_runs_lack_its_metric_says_so(tmp_path):
    """FGPT Table 11: a run of the cell without `sim_shared_prompt` is named, not hidden."""
    store = Store(f"sqlite:///{tmp_path / 'r.db'}")
    cfg = {"train": {"local_epochs": 2}}
    _run(store, "fgpt-table8", "fgpt", 0, [0.78], cfg=cfg)  # stores accuracies only
    t11 = fill_paper(load_paper("fgpt"), load_results(store), 11)[0]
    shared, acc = t11.cell("fgpt", "shared"), t11.cell("fgpt", "acc")
    assert (shared.n, shared.runs, acc.n) == (0, 1, 1)
    assert shared.hint() == (
        "1 run(s) of fgpt/cifar100/path-s10 train.local_epochs=2 lack metric sim_shared_prompt"
    )
    assert "needs suite" in t11.cell("fed-dualprompt", "shared").hint()  # no run at all
    store.close()


def test_best_and_second_best_per_column(sgpt_t1):
    marks = {c.row: c.mark for c in sgpt_t1.cells if c.column == "cifar100-global-s10"}
    assert marks["sgpt"] == "best" and marks["fedvpt"] == "second"
    assert marks["head-tune"] == "" and marks["fedmix"] == ""
    paper = {c.row: c.paper_mark for c in sgpt_t1.cells if c.column == "cifar100-global-s10"}
    assert paper["sgpt"] == "best" and paper["fedpr"] == "second"  # 84.64, 81.42


def test_every_format_carries_values_and_marks(sgpt_t1):
    md = paper_render.render(sgpt_t1, "md")
    assert "**85.50 ± 0.71** (paper **84.64**, Δ +0.86)" in md
    assert "<u>80.00</u> (paper 80.79, Δ -0.79)" in md
    tex = paper_render.render(sgpt_t1, "latex")
    assert r"\textbf{85.50 $\pm$ 0.71} / \textbf{84.64} (+0.86)" in tex
    assert r"\multicolumn{6}{c}{CIFAR-100 (\%)}" in tex
    csv = pd.read_csv(io.StringIO(paper_render.render(sgpt_t1, "csv")))
    assert len(csv) == 8 * 9
    row = csv[(csv["row"] == "sgpt") & (csv["column"] == "cifar100-global-s10")].iloc[0]
    assert (row["n_runs"], row["mark"], row["paper_value"]) == (2, "best", 84.64)
    assert row["fpbench_mean"] == pytest.approx(85.5) and row["diff"] == pytest.approx(0.86)
    console = Console(record=True, width=400)
    console.print(paper_render.render(sgpt_t1, "term"))
    text = console.export_text()
    assert "85.50 ± 0.71" in text and "paper 84.64" in text and "Δ +0.86" in text
    with pytest.raises(FpbenchError, match="format"):
        paper_render.render(sgpt_t1, "html")


LAYOUT = """
paper = "toy"
[[tables]]
number = 1
caption = "toy"
suite = "toy"
rank = "row"
columns = [
  { key = "e2", label = "E = 2", method = "m", config = { train = { local_epochs = 2 } } },
  { key = "e5", label = "E = 5", method = "m", config = { train = { local_epochs = 5 } } },
  { key = "rounds", label = "rounds", method = "m", metric = "rounds_to_target", rank = "none" },
  { key = "params", label = "params", method = "m", metric = "params_to_target", rank = "none" },
]
rows = [{ key = "c", label = "C", dataset = "cifar100", metric = "acc_global", target = 0.85 }]
[tables.values]
c = ["70.0", "80.0 ± 1.0", "2", "-"]
[tables.cells]
"c.params" = { clients_per_round = 2 }
"""


def test_config_filters_rank_per_row_and_target_metrics(tmp_path):
    (tmp_path / "toy.toml").write_text(LAYOUT)
    paper = load_paper("toy", root=tmp_path)
    assert paper.table(1).count() == 3
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        _run(store, "toy", "m", 0, [0.5, 0.9, 0.7], cfg={"train": {"local_epochs": 2}})
        _run(store, "toy", "m", 0, [0.8], cfg={"train": {"local_epochs": 5}})
        filled = fill_paper(paper, load_results(store))[0]
    assert filled.cell("c", "e2").mean == pytest.approx(70.0)  # only the E = 2 run
    assert filled.cell("c", "e5").mean == pytest.approx(80.0)
    assert [filled.cell("c", k).mark for k in ("e2", "e5")] == ["second", "best"]
    # E = 2 run first reaches 85 % at round 1: 2 rounds of 800 bytes down to 2 clients per round
    # = 200 fp32 params per client; the E = 5 run never does and contributes nothing
    assert filled.cell("c", "rounds").mean == 2.0 and filled.cell("c", "rounds").n == 1
    assert filled.cell("c", "params").mean == pytest.approx(2 * 800 / 4 / 2)
    assert filled.cell("c", "rounds").mark == ""


def test_unknown_paper_or_table_is_one_clear_error(tmp_path):
    with pytest.raises(FpbenchError, match="unknown paper 'nope'.*sgpt"):
        load_paper("nope")
    with pytest.raises(FpbenchError, match="no table 7; --table is one of 1, 2, 3, 4, 5"):
        load_paper("sgpt").table(7)
    (tmp_path / "bad.toml").write_text(LAYOUT.replace('"2", "-"]', '"2"]'))
    with pytest.raises(FpbenchError, match="row 'c' needs 4 values"):
        load_paper("bad", root=tmp_path)
    (tmp_path / "broken.toml").write_text("tables = [")
    with pytest.raises(FpbenchError, match="broken.toml is not valid TOML"):
        load_paper("broken", root=tmp_path)
