"""Label-skew partitions at their edges, each pinning what a surviving mutant changed (see
docs/mutation-equivalent.md for the mutants left alive and why)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fpbench.errors import FpbenchError
from fpbench.partition import _keep_shots, base, make_clients
from fpbench.partition.label import _joint
from tests.test_partition import assert_valid, make_data


def test_pathological_with_every_class_per_client() -> None:
    """s = K is allowed: each client then holds every class."""
    data = make_data(num_classes=3, train_per=12, test_per=6)
    clients = make_clients("pathological", {"num_clients": 2, "s": 3}, data, seed=0)
    y = data.train_labels.numpy()
    assert [sorted(set(y[c.train_idx].tolist())) for c in clients] == [[0, 1, 2]] * 2


def test_pathological_error_names_a_whole_number_of_clients() -> None:
    with pytest.raises(FpbenchError, match=r"use num_clients a multiple of 20$"):
        make_clients("pathological", {"s": 3}, make_data(), seed=0)
    with pytest.raises(FpbenchError, match=r"use num_clients a multiple of 5$"):
        make_clients("pathological", {"s": 4, "num_clients": 6}, make_data(), seed=0)


def test_pathological_class_shared_by_three_clients_is_split_disjointly() -> None:
    """c = s * N / K = 3 clients per class: the third takes what the first two left."""
    data = make_data(num_classes=2, train_per=30, test_per=12)
    clients = make_clients("pathological", {"num_clients": 6, "s": 1}, data, seed=0)
    assert_valid(clients, data, 6)
    assert sum(c.train_idx.size for c in clients) >= 60 - 6  # floors drop at most one each


def test_pachinko_error_says_what_to_use() -> None:
    want = (
        r"^partition 'pachinko' needs coarse labels \(coarse_of_class\); this dataset has "
        r"none: use partition 'dirichlet'$"
    )
    with pytest.raises(FpbenchError, match=want):
        make_clients("pachinko", {}, make_data(coarse=None), seed=0)


def test_pachinko_quotas_of_an_uneven_split_still_assign_everything() -> None:
    data = make_data(num_classes=4, train_per=25, test_per=4, coarse=2)  # 100 over 3 clients
    clients = make_clients("pachinko", {"num_clients": 3}, data, seed=0)
    assert sorted(c.train_idx.size for c in clients) == [33, 33, 34]


def test_pachinko_with_one_coarse_group_still_skews_the_fine_labels() -> None:
    data = make_data(num_classes=10, train_per=100, coarse=1)  # one group of 10 classes
    clients = make_clients("pachinko", {"num_clients": 20, "beta_f": 0.01}, data, 0)  # quota 50
    top = np.stack([c.class_prior for c in clients]).max(1)
    assert top.mean() > 0.6  # near-uniform fine shares would give about 0.2


def test_joint_by_hand_with_groups_of_different_sizes() -> None:
    """theta (1/2, 1/2) over a group of 1 class and a group of 3: the class of the small group
    gets 1/2, each of the other three 1/6 (phi uniform); closing class 3 renormalises its group."""
    coarse = np.array([0, 1, 1, 1])
    theta, phi = np.array([0.5, 0.5]), np.array([1.0, 1 / 3, 1 / 3, 1 / 3])
    joint = _joint(theta, phi, coarse, np.ones(4, dtype=bool))
    np.testing.assert_allclose(joint, [0.5, 1 / 6, 1 / 6, 1 / 6])
    joint = _joint(theta, phi, coarse, np.array([True, True, True, False]))
    np.testing.assert_allclose(joint, [0.5, 0.25, 0.25, 0.0])
    joint = _joint(theta, phi, coarse, np.array([False, True, False, True]))  # group 0 closed
    np.testing.assert_allclose(joint, [0.0, 0.5, 0.0, 0.5])


def test_natural_with_no_users_says_so() -> None:
    data = make_data(num_classes=2, train_per=3, test_per=1)
    empty = dataclasses.replace(
        data,
        train_images=data.train_images[:0],
        train_labels=data.train_labels[:0],
        train_users=torch.zeros(0, dtype=torch.long),
    )
    with pytest.raises(FpbenchError, match="has 0 users: set num_clients = 0"):
        make_clients("natural", {"num_clients": 1, "min_train": 0}, empty, seed=0)


def test_disjoint_classes_with_one_class_per_client_and_its_error() -> None:
    data = make_data(num_classes=4, train_per=5, test_per=2)
    clients = make_clients("disjoint-classes", {"num_clients": 4}, data, seed=0)
    y = data.train_labels.numpy()
    assert sorted(y[c.train_idx][0] for c in clients) == [0, 1, 2, 3]
    assert all(len(set(y[c.train_idx].tolist())) == 1 for c in clients)
    with pytest.raises(FpbenchError) as info:
        make_clients("disjoint-classes", {"num_clients": 5}, data, seed=0)
    assert str(info.value) == (
        "partition.num_clients = 5 exceeds the number of classes (4) for partition "
        "'disjoint-classes'; use at most 4 clients"
    )


def test_disjoint_classes_class_seed_fixes_the_blocks_whatever_the_run_seed() -> None:
    data = make_data(num_classes=12, train_per=3, test_per=1)
    y = data.train_labels.numpy()
    want = np.array_split(np.random.default_rng(2023).permutation(12), 3)
    for seed in (0, 1):
        clients = make_clients(
            "disjoint-classes", {"num_clients": 3, "class_seed": 2023}, data, seed
        )
        assert [sorted(set(y[c.train_idx].tolist())) for c in clients] == [
            sorted(b.tolist()) for b in want
        ]


def test_domains_of_needs_both_splits_and_gives_int64() -> None:
    data = make_data(num_classes=2, train_per=4, test_per=2, num_domains=2)
    d_train, d_test = base.domains_of(data)
    assert d_train.dtype == np.int64 and d_test.dtype == np.int64
    assert np.array_equal(d_test, data.test_domains.numpy())
    for half in ({"test_domains": None}, {"train_domains": None}):
        with pytest.raises(FpbenchError) as info:
            base.domains_of(dataclasses.replace(data, **half))
        assert str(info.value) == "dataset 'tiny' has no per-sample domains"


def test_shots_keep_the_first_of_each_class_in_the_drawn_order() -> None:
    """The kept samples are the first `shots` of each class in `rng.permutation` order: a
    stable sort, so one seed keeps the same samples on every machine."""
    y = np.repeat([0, 1], 100)
    c = base.make_client(0, np.arange(200), np.arange(4), y, 2)
    kept = _keep_shots(c, y, 3, 2, np.random.default_rng(7))
    drawn = np.arange(200)[np.random.default_rng(7).permutation(200)]
    want = [i for k in (0, 1) for i in drawn[y[drawn] == k][:3]]
    assert kept.train_idx.tolist() == sorted(want)
    assert kept.test_idx.tolist() == [0, 1, 2, 3] and kept.class_prior.tolist() == [0.5, 0.5]
