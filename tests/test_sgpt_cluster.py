"""SGPT appendix D.2: the congruence of Select's groups with centralised k-means."""

from __future__ import annotations

import pytest
import torch

from fpbench.methods.sgpt import SGPTConfig, _centres, congruence, contingency, kmeans, overlap
from fpbench.registry import METHODS

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
    return METHODS.get("sgpt")(SGPTConfig(**args), base.backbone, base.task)


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
