"""SGPT appendix D.2: the congruence of Select's groups with centralised k-means."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fpbench.engine.inputs import Inputs
from fpbench.engine.rounds import view_of_test
from fpbench.engine.runner import run_cell
from fpbench.methods.base import TaskInfo
from fpbench.methods.clustering import (
    _centres,
    cluster_accuracy,
    congruence,
    contingency,
    kmeans,
    overlap,
)
from fpbench.methods.sgpt import SGPTConfig
from fpbench.registry import METHODS
from fpbench.store import Store
from fpbench.suites import load_suite

from ..conftest import tiny_config, with_config

KM = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def test_contingency_is_normalised_by_the_sample_count():
    table = contingency(KM, torch.tensor([0, 0, 0, 1, 1, 1, 1, 1]), 2, 2)
    torch.testing.assert_close(table, torch.tensor([[3 / 8, 1 / 8], [0.0, 4 / 8]]).double())
    assert float(table.sum()) == pytest.approx(1.0)


def test_identical_partitions_up_to_relabelling_overlap_fully():
    relabelled = torch.tensor([2, 2, 2, 2, 0, 0, 0, 0])  # cluster 0 -> group 2, 1 -> group 0
    assert overlap(KM, relabelled, 2, 3) == pytest.approx(1.0)
    acc, score = congruence(KM, relabelled, KM, 2, 3, 2)  # k-means == classes: Q = 1
    assert (acc, score) == (pytest.approx(1.0), pytest.approx(1.0))


def test_known_confusion_gives_known_score():
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])  # one sample of cluster 0 strays
    # Acc_overlap = 3/8 + 4/8; classes split each cluster in halves: Q = 2/8 + 2/8
    classes = torch.tensor([0, 0, 1, 1, 1, 1, 0, 0])
    acc, score = congruence(KM, groups, classes, 2, 2, 2)
    assert acc == pytest.approx(7 / 8)
    assert score == pytest.approx((7 / 8) / (1 / 2))
    _, perfect_q = congruence(KM, groups, KM, 2, 2, 2)
    assert perfect_q == pytest.approx(7 / 8)


def test_rows_are_kmeans_clusters_so_one_group_for_all_overlaps_fully():
    """The paper's literal order: a collapse onto one group scores Acc_overlap = 1."""
    one_group = torch.zeros(8, dtype=torch.long)
    assert overlap(KM, one_group, 2, 4) == pytest.approx(1.0)
    assert overlap(one_group, KM, 4, 2) == pytest.approx(0.5)  # the other order would not


def _blobs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    centres = torch.tensor([[10.0, 0.0], [0.0, 10.0], [-10.0, -10.0]])
    truth = torch.arange(3).repeat_interleave(20)  # (60,)
    return centres[truth] + torch.randn(60, 2, generator=gen), truth


def test_kmeans_recovers_separated_blobs_and_is_deterministic():
    x, truth = _blobs()
    labels, centres = kmeans(x, 3, seed=0)
    assert overlap(truth, labels, 3, 3) == pytest.approx(1.0)
    assert overlap(labels, truth, 3, 3) == pytest.approx(1.0)
    for c in range(3):  # each centre is its cluster's mean
        torch.testing.assert_close(centres[c], x[labels == c].mean(0))
    again, _ = kmeans(x, 3, seed=0)
    assert torch.equal(labels, again)


def test_empty_cluster_keeps_its_centre():
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    old = torch.tensor([[9.0, 9.0], [5.0, 5.0]])
    new = _centres(x, torch.tensor([1, 1]), old)
    torch.testing.assert_close(new, torch.tensor([[9.0, 9.0], [1.0, 0.0]]))


def _sgpt(tiny, **args):
    _, task, base = tiny("sgpt")
    args = {"cluster_metric": True, **args}  # the diagnostics under test (off by default)
    return with_config(base, **args)


def test_round_metric_of_a_collapsed_select_is_one_over_q(tiny):
    method = _sgpt(tiny, num_groups=3)
    server = method.init_server(torch.Generator().manual_seed(0))
    queries, km, classes = method.cluster
    assert len(queries) == len(km) == len(classes) > 0
    mean = queries.mean(0)  # queries are ReLU'd: every one has cos > 0 with it, <= 0 with -mean
    server.params["keys"] = torch.stack([-mean, mean, -mean])
    out = method.round_metrics(server)
    q = overlap(classes, km, method.task.num_classes, 3)
    assert out["cluster_overlap"] == pytest.approx(1.0)
    assert out["congruence_kmeans"] == pytest.approx(1.0 / q)
    largest = torch.bincount(km, minlength=3).max() / len(km)  # one row: the biggest cluster
    assert out["cluster_purity"] == pytest.approx(float(largest))


def test_metric_switch_and_sample_cap(tiny):
    assert _sgpt(tiny, cluster_metric=False).round_metrics(None) == {}
    assert _sgpt(tiny, preset="shared-only").cluster is None  # no keys, no groups
    capped = _sgpt(tiny, num_groups=2, cluster_samples=5)
    assert len(capped.cluster[0]) == 5
    heldout = capped.task.heldout.nonzero().flatten().tolist()
    held_idx = torch.cat([capped.task.train_idx[c] for c in heldout])
    full = _sgpt(tiny, num_groups=2, cluster_samples=10_000)
    sharing = sum(len(i) for c, i in enumerate(full.task.train_idx) if c not in heldout)
    assert len(held_idx) > 0 and len(full.cluster[0]) == sharing  # held-out clients excluded


# -- Table 4's acc_cluster: Select's groups against the coarse labels of the test set ---------
def test_cluster_accuracy_of_a_perfect_grouping_up_to_relabelling_is_one():
    coarse = torch.tensor([0, 0, 1, 1, 2, 2])
    relabelled = torch.tensor([2, 2, 0, 0, 1, 1])  # group 2 = class 0, 0 = 1, 1 = 2
    assert cluster_accuracy(relabelled, coarse, 3, 3) == pytest.approx(1.0)
    assert cluster_accuracy(relabelled, coarse, 5, 3) == pytest.approx(1.0)  # unused groups


def test_cluster_accuracy_matches_one_to_one_not_by_majority():
    coarse = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])  # group 0: 3 x class 0; 1: 3 x 0, 2 x 1
    # both groups' majority is class 0 (6/8), but one-to-one: 0 -> 0, 1 -> 1 gives 3 + 2
    assert cluster_accuracy(groups, coarse, 2, 2) == pytest.approx(5 / 8)
    fewer_groups = torch.tensor([0, 0, 1, 1, 1, 1])  # 2 groups, 3 classes: one class unmatched
    three = torch.tensor([0, 0, 1, 1, 2, 2])
    assert cluster_accuracy(fewer_groups, three, 2, 3) == pytest.approx(4 / 6)
    collapsed = torch.zeros(8, dtype=torch.long)  # one group: the largest class's share
    assert cluster_accuracy(collapsed, torch.arange(4).repeat(2), 4, 4) == pytest.approx(1 / 4)


def _test_split(method, task):
    """The engine's view of the tiny task's test split for `method` (no feature cache)."""
    return view_of_test(task, Inputs.of(method, task))


def test_acc_cluster_of_a_collapsed_select_is_the_largest_coarse_share(tiny):
    _, task, _ = tiny("sgpt")
    method = _sgpt(tiny, num_groups=3)
    test = _test_split(method, task)
    queries, labels = test(method.query)
    assert len(queries) == len(task.data.test_labels) and torch.equal(labels, task.data.test_labels)
    server = method.init_server(torch.Generator().manual_seed(0))
    mean = queries.mean(0)  # ReLU'd queries: every test sample picks the middle key
    server.params["keys"] = torch.stack([-mean, mean, -mean])
    # synthetic: 6 classes in coarse groups [0, 0, 1, 2, 2, 3], equally many test samples each
    assert method.task.coarse_of_class.tolist() == [0, 0, 1, 2, 2, 3]
    assert method.round_metrics(server, test)["acc_cluster"] == pytest.approx(2 / 6)
    assert "acc_cluster" not in method.round_metrics(server)  # no test split, no score


def test_the_method_never_holds_the_test_split_and_a_run_records_acc_cluster(tmp_path):
    assert not {"test_images", "test_labels"} & {f.name for f in dataclasses.fields(TaskInfo)}
    cfg = tiny_config("sgpt", rounds=2)
    cfg = cfg.model_copy(
        update={"method": cfg.method.model_copy(update={"args": {**cfg.method.args,
                "num_groups": 3, "cluster_metric": True}})}
    )  # fmt: skip
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path / "ck").status == "done"
        metrics = store.metrics()
    rounds = metrics[metrics["name"] == "acc_cluster"]["round"].tolist()
    assert rounds == [0, 1]  # every round, through the engine


def test_no_coarse_labels_no_acc_cluster(tiny):
    _, task, base = tiny("sgpt")
    flat = dataclasses.replace(base.task, coarse_of_class=None)
    method = METHODS.get("sgpt")(SGPTConfig(num_groups=3, cluster_metric=True), base.backbone, flat)
    server = method.init_server(torch.Generator().manual_seed(0))
    out = method.round_metrics(server, _test_split(method, task))
    assert "acc_cluster" not in out
    assert "congruence_kmeans" in out  # the other metrics are still there
    never = lambda fn: pytest.fail("test queries computed")  # noqa: E731
    for off in (_sgpt(tiny, preset="shared-only"), _sgpt(tiny, cluster_metric=False)):
        gen = torch.Generator().manual_seed(0)
        assert "acc_cluster" not in off.round_metrics(off.init_server(gen), never)


# -- the diagnostics run only where a suite reports them ------------------------------------


def test_diagnostics_are_off_by_default_and_cost_no_frozen_pass(tiny, monkeypatch):
    sgpt = METHODS.get("sgpt")
    calls = []
    query = sgpt.query
    monkeypatch.setattr(sgpt, "query", lambda self, x: calls.append(len(x)) or query(self, x))
    _, task, base = tiny("sgpt")
    method = sgpt(SGPTConfig(), base.backbone, base.task)
    assert not SGPTConfig().cluster_metric and calls == []  # built without a frozen pass
    assert method.round_metrics(method.init_server(torch.Generator().manual_seed(0))) == {}
    sgpt(SGPTConfig(cluster_metric=True), base.backbone, base.task)  # k-means reference only
    assert sum(calls) == sum(len(task.train_idx[c]) for c in task.trainable_clients())


@pytest.mark.parametrize(
    ("suite", "reporting"),
    [
        ("sgpt-ablations", {"sgpt-keys-fedavg", "sgpt-keys-qg", "sgpt-keys-qg-momentum"}),
        ("sgpt-ablations-smoke", {"sgpt-keys-fedavg", "sgpt-keys-qg", "sgpt-keys-qg-momentum"}),
        (
            "sgpt-sweeps-smoke",
            {f"sgpt-key-momentum-{a}" for a in ("0", "0.25", "0.75", "0.9")}
            | {"sgpt-momentum-0.5"},
        ),
    ],
)
def test_only_the_cells_of_table_4_and_fig_6a_record_the_diagnostics(suite, reporting):
    cells = load_suite(suite).cells
    on = {c.method.label for c in cells if c.method.args.get("cluster_metric")}
    assert on == reporting
    assert len(on) < len({c.method.label for c in cells})  # the other rows pay nothing


def test_an_empty_test_split_gives_no_test_view(tiny):
    _, task, method = tiny("sgpt")
    data = dataclasses.replace(
        task.data, test_images=task.data.test_images[:0], test_labels=task.data.test_labels[:0]
    )
    assert view_of_test(dataclasses.replace(task, data=data), Inputs.of(method, task)) is None
