"""The offline twins of the CLIP ground's protocol suites (few-shot, base-to-novel over the
eleven, ImageNet to its shifts), end to end through the CLI."""

from __future__ import annotations

import pytest

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


def test_smoke_clip_ground_fewshot(tmp_path, monkeypatch):
    runs = _run("smoke-clip-ground-fewshot", tmp_path, monkeypatch)
    assert set(runs) == {
        "coop/synthetic-1shot",
        "coop/synthetic-2shot",
        "zero-shot/synthetic-2shot",
    }
    shots = {k: r["config"]["partition"]["args"]["shots"] for k, r in runs.items()}
    assert shots == {
        "coop/synthetic-1shot": 1,
        "coop/synthetic-2shot": 2,
        "zero-shot/synthetic-2shot": 2,
    }
    for run in runs.values():
        assert _integral(run["agg"][1]["acc_global"], 12)  # 6 classes x 2 test images


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
