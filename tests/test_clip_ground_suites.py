"""The offline twins of the CLIP ground's protocol suites (few-shot, base-to-novel over the
eleven, ImageNet to its shifts), end to end through the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.suites import load_suite
from tests.test_clip_eval_suites import _integral, _run


def test_smoke_clip_ground_base2novel(tmp_path, monkeypatch):
    runs = _run("smoke-clip-ground-base2novel", tmp_path, monkeypatch)
    labels = ["zero-shot", "coop", "kgcoop", "fedtpg", "centralized"]
    assert set(runs) == {f"{label}/synthetic" for label in labels}
    for run in runs.values():
        agg = run["agg"][1]
        base, novel = agg["acc_base"], agg["acc_novel"]
        assert agg["acc_hm"] == pytest.approx(2 * base * novel / (base + novel))
        # 4 novel classes x 2 test images, 4 base classes x 2: counts for a global model
        assert _integral(novel, 8) and _integral(base, 8)
    # FedTPG's blocks of 2 base labels: client 0 holds labels 0-1, client 1 labels 2-3, each
    # scored on every test image of its classes (2 classes x 2 images)
    rows = runs["coop/synthetic"]["clients"]
    counts = {c: n for r, c, name, _, n in rows if r == 1 and name == "acc_local"}
    assert counts == {0: 4, 1: 4}


def test_smoke_clip_xdomain(tmp_path, monkeypatch):
    runs = _run("smoke-clip-xdomain", tmp_path, monkeypatch)
    assert set(runs) == {"zero-shot/synthetic", "coop/synthetic", "fedtpg/synthetic"}
    for run in runs.values():
        assert [t["label"] for t in run["config"]["evaluation"]["targets"]] == [
            "shift-v2", "shift-a",
        ]  # fmt: skip
        agg = run["agg"][1]
        v2, a = agg["acc_xd_shift-v2"], agg["acc_xd_shift-a"]
        assert agg["acc_xd_mean"] == pytest.approx((v2 + a) / 2)
        assert _integral(v2, 18) and _integral(a, 8)  # 6 x 3 and 4 x 2 test images
    counts = {
        c: n
        for r, c, name, _, n in runs["coop/synthetic"]["clients"]
        if r == 1 and name == "acc_local"
    }
    assert counts == {0: 4, 1: 4, 2: 4}  # 3 clients of 2 classes, 2 test images each


def test_smoke_clip_ground_fewshot_and_its_curves(tmp_path, monkeypatch):
    """One dataset label across the shot grids (the curves' panels), the shots in the config."""
    from fpbench.report.paper import load_results
    from fpbench.report.plots import sweep
    from fpbench.store import Store

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", "--suite", "smoke-clip-ground-fewshot"])
    assert result.exit_code == 0, result.output
    res = load_results(Store(f"sqlite:///{tmp_path / 'results' / 'fpbench.db'}"))
    shots = {
        (res.configs[i]["method"]["label"], res.configs[i]["partition"]["args"]["shots"]): i
        for i in res.configs
    }
    assert set(shots) == {("coop", 1), ("coop", 2), ("zero-shot", 2)}
    assert set(res.metrics["dataset"]) == {"synthetic"}
    fig = sweep(res.metrics, res.configs, "partition.args.shots", suite="smoke-clip-ground-fewshot")
    (ax,) = [a for a in fig.axes if a.has_data()]  # one panel: the dataset, every shot count
    lines = {c.get_label(): c.lines[0].get_xydata().tolist() for c in ax.containers}
    finals = res.metrics[(res.metrics["name"] == "acc_global_last1")].set_index("run_id")["value"]
    assert lines["promptfl"] == [
        [1.0, 100 * finals[shots["coop", 1]]], [2.0, 100 * finals[shots["coop", 2]]],
    ]  # fmt: skip
    assert lines["zero-shot"] == [[2.0, 100 * finals[shots["zero-shot", 2]]]]


@pytest.mark.parametrize(
    ("suite", "cells"),
    [("clip-xdataset", 15), ("clip-xdomain", 15), ("clip-ground-base2novel", 165),
     ("clip-ground-fewshot", 693)],
)  # fmt: skip
def test_the_ground_suites_train_as_fedtpg_and_flip(suite, cells):
    """The real suites resolve (every cell's partition checked against its dataset's classes)."""
    loaded = load_suite(suite)
    assert len(loaded.cells) == cells
    datasets = {c.dataset.name for c in loaded.cells}
    if suite in ("clip-xdataset", "clip-xdomain"):
        assert datasets == {"imagenet"}
        assert {c.partition.args["num_clients"] for c in loaded.cells} == {200}
        assert {c.dataset.args["shots"] for c in loaded.cells} == {8}
    else:
        eleven = {"imagenet", "caltech101", "oxford-pets", "stanford-cars", "flowers102",
                  "food101", "fgvc-aircraft", "sun397", "dtd", "eurosat", "ucf101"}  # fmt: skip
        assert datasets == eleven
    evaluation = loaded.cells[0].evaluation
    targets = {t.name for t in evaluation.targets} if evaluation else set()
    if suite == "clip-xdomain":
        assert targets == {"imagenet-v2", "imagenet-sketch", "imagenet-a", "imagenet-r"}
    if suite == "clip-xdataset":
        assert len(targets) == 10 and "imagenet" not in targets


def _finals(folder) -> dict[tuple[str, int], float]:
    """(method label, shots) -> the final acc_global of each run in `folder`'s database."""
    from fpbench.report.paper import load_results
    from fpbench.store import Store

    res = load_results(Store(f"sqlite:///{folder / 'results' / 'fpbench.db'}"))
    last = res.metrics[res.metrics["name"] == "acc_global_last1"].set_index("run_id")["value"]
    return {
        (c["method"]["label"], c["partition"]["args"]["shots"]): float(last[i])
        for i, c in res.configs.items()
    }


def _twin_paper(tmp_path, swaps: dict[str, str]):
    """clip-ground's tables read from the offline twins: `swaps` renames suite, partition,
    dataset and target names in the data file (a tiny run fills what the real suite would)."""
    from fpbench.report.paper import PAPERS_DIR, load_paper

    text = (PAPERS_DIR / "clip-ground.toml").read_text()
    for a, b in swaps.items():
        text = text.replace(a, b)
    (tmp_path / "ground.toml").write_text(text)
    return load_paper("ground", tmp_path)


def _filled(tmp_path, paper, number: int):
    from fpbench.report.paper import fill_paper, load_results
    from fpbench.store import Store

    store = Store(f"sqlite:///{tmp_path / 'results' / 'fpbench.db'}")
    (filled,) = fill_paper(paper, load_results(store), number)
    return filled


def test_ground_tables_render_the_twins_value_by_value(tmp_path, monkeypatch):
    runs = _run("smoke-clip-ground-base2novel", tmp_path, monkeypatch)
    paper = _twin_paper(tmp_path, {
        '"clip-ground-base2novel"': '"smoke-clip-ground-base2novel"',
        '"20-classes"': '"2-classes"', 'dataset = "imagenet"': 'dataset = "synthetic"',
    })  # fmt: skip
    table = _filled(tmp_path, paper, 1)
    for label in ("zero-shot", "coop", "kgcoop", "fedtpg", "centralized"):
        agg = runs[f"{label}/synthetic"]["agg"][1]
        for col, metric in (("base", "acc_base"), ("novel", "acc_novel"), ("hm", "acc_hm")):
            cell = table.cell(label, f"imagenet-{col}")
            assert cell.n == 1 and cell.mean == pytest.approx(100 * agg[metric]), (label, col)
        assert table.cell(label, "avg-hm").mean is None  # ten datasets have no run here


def test_ground_fewshot_and_xdomain_tables_render_the_twins(tmp_path, monkeypatch):
    (tmp_path / "f").mkdir()
    (tmp_path / "x").mkdir()
    monkeypatch.chdir(tmp_path / "f")
    assert CliRunner().invoke(app, ["run", "--suite", "smoke-clip-ground-fewshot"]).exit_code == 0
    finals = _finals(tmp_path / "f")
    paper = _twin_paper(tmp_path, {
        '"clip-ground-fewshot"': '"smoke-clip-ground-fewshot"',
        'name = "imagenet" } } }': 'name = "synthetic" } } }',
    })  # fmt: skip
    table = _filled(tmp_path / "f", paper, 4)
    for row, key in (("coop-1", ("coop", 1)), ("coop-2", ("coop", 2))):
        assert table.cell(row, "imagenet").mean == pytest.approx(100 * finals[key])
    assert table.cell("zero-shot", "imagenet").n == 0  # 16 shots in the real suite, 2 here
    xdomain = _run("smoke-clip-xdomain", tmp_path / "x", monkeypatch)
    paper = _twin_paper(tmp_path, {
        '"clip-xdomain"': '"smoke-clip-xdomain"', '"5-classes"': '"2-classes"',
        'dataset = "imagenet"': 'dataset = "synthetic"', "acc_xd_imagenet-v2": "acc_xd_shift-v2",
        "acc_xd_imagenet-a": "acc_xd_shift-a",
    })  # fmt: skip
    table = _filled(tmp_path / "x", paper, 3)
    for label in ("zero-shot", "coop", "fedtpg"):
        agg = xdomain[f"{label}/synthetic"]["agg"][1]
        assert table.cell(label, "imagenet").mean == pytest.approx(100 * agg["acc_global"])
        assert table.cell(label, "imagenet-v2").mean == pytest.approx(100 * agg["acc_xd_shift-v2"])
        assert table.cell(label, "imagenet-a").mean == pytest.approx(100 * agg["acc_xd_shift-a"])
        assert table.cell(label, "average").mean == pytest.approx(100 * agg["acc_xd_mean"])
        assert table.cell(label, "imagenet-sketch").n == 0
