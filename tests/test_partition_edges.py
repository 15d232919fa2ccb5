"""Label-skew partitions at their edges, each pinning what a surviving mutant changed (see
docs/mutation-equivalent.md for the mutants left alive and why)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fpbench.errors import FpbenchError
from fpbench.partition import _keep_shots, base, make_clients
from fpbench.partition.base import (
    _dirichlet_once,
    _largest_remainder,
    dirichlet_split,
    local_test_sets,
)
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


def test_local_test_sets_deal_each_key_s_samples_in_index_order_then_shuffled() -> None:
    """Two clients with equal train shares of keys 0 and 1 (100 test samples each): the pool of
    key k is `rng.permutation` of its test indices in ascending order, the first 50 go to
    client 0; a sort that is not stable would shuffle each pool differently per machine."""
    test_keys = np.arange(200) % 2
    parts = [np.array([0, 1]), np.array([2, 3])]
    tests = local_test_sets(parts, np.array([0, 1, 0, 1]), test_keys, np.random.default_rng(0))
    rng = np.random.default_rng(0)
    p0, p1 = (rng.permutation(np.flatnonzero(test_keys == k)) for k in (0, 1))
    assert tests[0].tolist() == p0[:50].tolist() + p1[:50].tolist()
    assert tests[1].tolist() == p0[50:].tolist() + p1[50:].tolist()


def test_local_test_sets_skip_keys_nobody_trains_on_and_deal_the_rest() -> None:
    """Key 1 has test samples but no train sample: nobody gets them, and keys after it are
    still dealt; key 2 has one train sample, so its holder gets both its test samples. Key 3
    has a train sample but no test sample."""
    train_keys = np.array([0, 0, 2, 3])
    test_keys = np.array([0, 1, 1, 2, 2, 0])
    parts = [np.array([0, 3]), np.array([1, 2])]
    tests = local_test_sets(parts, train_keys, test_keys, np.random.default_rng(0))
    first, second = np.random.default_rng(0).permutation([0, 5]).tolist()  # key 0, one each
    assert [sorted(t.tolist()) for t in tests] == [[first], sorted([second, 3, 4])]
    assert all(t.dtype == np.int64 for t in tests)


def test_local_test_sets_of_empty_splits_are_empty_index_arrays() -> None:
    rng = np.random.default_rng(0)
    none = np.empty(0, dtype=np.int64)
    no_test = local_test_sets([np.array([0]), none], np.array([0]), none, rng)
    no_train = local_test_sets([none, none], none, np.array([0, 1]), rng)
    for sets in (no_test, no_train):
        assert [t.tolist() for t in sets] == [[], []]
        assert all(t.dtype == np.int64 for t in sets)  # usable as indices


def test_a_client_without_a_test_sample_takes_one_of_its_most_frequent_key() -> None:
    """Client 1 trains on keys 1 (twice) and 2 (once), client 0 on 100 of each key; with 3 test
    samples per key client 1's quotas round to 0, so it takes one test sample of key 1."""
    train_keys = np.repeat([0, 1, 2], 100).tolist() + [1, 1, 2]
    parts = [np.arange(300), np.arange(300, 303)]
    test_keys = np.repeat([0, 1, 2], 3)
    tests = local_test_sets(parts, np.array(train_keys), test_keys, np.random.default_rng(0))
    assert [t.size for t in tests] == [8, 1] and test_keys[tests[1]].tolist() == [1]


def test_a_client_without_a_test_sample_breaks_ties_by_the_lowest_key() -> None:
    """Client 1 trains once on each of ten keys out of 17: all tied, it takes key 2, the first."""
    mine = [2, 3, 5, 7, 9, 10, 11, 14, 15, 16]
    train_keys = np.array(np.repeat(np.arange(17), 100).tolist() + mine)
    parts = [np.arange(1700), np.arange(1700, 1710)]
    test_keys = np.repeat(np.arange(17), 3)
    tests = local_test_sets(parts, train_keys, test_keys, np.random.default_rng(0))
    assert test_keys[tests[1]].tolist() == [2]


class ScriptedRng:
    """Identity permutations and the given Dirichlet shares, one per class in turn."""

    def __init__(self, *shares: list[float]) -> None:
        self.shares = [np.array(s) for s in shares]

    def permutation(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x).copy()

    def dirichlet(self, alpha: np.ndarray) -> np.ndarray:
        return self.shares.pop(0)


@pytest.mark.parametrize(
    ("second", "last", "want"),
    [
        # client 1 holds 6 = 12 / 2 after class 1: closed, class 2 all goes to client 0
        ([0.0, 1.0], [0.25, 0.75], [[0, 1, 8, 9, 10, 11], [2, 3, 4, 5, 6, 7]]),
        # client 0 closed and the only open client's share is 0: the drawn shares are used
        ([1.0, 0.0], [1.0, 0.0], [[0, 1, 4, 5, 6, 7, 8, 9, 10, 11], [2, 3]]),
    ],
)
def test_dirichlet_gives_nothing_more_to_a_client_holding_an_equal_share(
    second, last, want
) -> None:
    y = np.repeat([0, 1, 2], 4)
    rng = ScriptedRng([0.5, 0.5], second, last)
    parts = _dirichlet_once(np.arange(12), y, 2, 0.5, rng)
    assert [p.tolist() for p in parts] == want


def test_dirichlet_min_size_is_reached_exactly_or_said_impossible() -> None:
    """4 samples, 2 clients, min_size 2: only a 2/2 cut is accepted; 5 samples are not enough
    for min_size 3."""
    labels = np.zeros(4, dtype=np.int64)
    rng = ScriptedRng([0.9, 0.1], [0.5, 0.5])
    parts = dirichlet_split(np.arange(4), labels, 2, 0.5, 2, 5, rng)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3]]
    with pytest.raises(FpbenchError) as info:
        dirichlet_split(np.arange(4), labels, 2, 0.5, 2, 2, ScriptedRng([0.9, 0.1], [1.0, 0.0]))
    assert str(info.value) == (
        "partition.min_size = 2: no Dirichlet(alpha=0.5) split gave every client at least 2 "
        "train samples in 2 tries (partition.max_retries); lower min_size, raise alpha or use "
        "fewer clients"
    )
    with pytest.raises(FpbenchError, match=r"min_size = 3 is impossible: 2 clients x 3 > 5"):
        dirichlet_split(np.arange(5), np.zeros(5, np.int64), 2, 0.5, 3, 5, ScriptedRng())


def test_largest_remainder_gives_tied_remainders_to_the_first() -> None:
    """Nine weights of 2 and eight of 1 (sum 26), 6 to give: every 2 has remainder 6 * 2 / 26,
    the largest; the first six of them get one each."""
    twos = [0, 1, 3, 4, 7, 10, 11, 13, 16]
    w = np.array([2.0 if i in twos else 1.0 for i in range(17)])
    assert np.flatnonzero(_largest_remainder(6, w)).tolist() == twos[:6]


@pytest.mark.parametrize(
    ("parts", "n_test", "sizes"),
    [
        # clients 0 and 2 get nothing by quota; each takes one from client 1, the largest
        ([[0], list(range(1, 101)), [101]], 4, [1, 2, 1]),
        ([list(range(100)), [100]], 2, [1, 1]),  # a donor with two gives one
        ([list(range(100)), [100]], 1, [1, 0]),  # a donor with one keeps it
    ],
)
def test_the_fix_up_takes_from_the_largest_holder_while_it_keeps_one(parts, n_test, sizes):
    n_train = sum(len(p) for p in parts)
    tests = local_test_sets(
        [np.array(p) for p in parts],
        np.zeros(n_train, np.int64),
        np.zeros(n_test, np.int64),
        np.random.default_rng(0),
    )
    assert [t.size for t in tests] == sizes
    assert sorted(np.concatenate(tests).tolist()) == list(range(n_test))


def test_clients_hold_int64_indices_and_a_read_only_prior() -> None:
    labels = np.array([0, 1, 1, 2])
    c = base.make_client(3, np.array([3, 1, 2]), np.empty(0), labels, 4, domain=1, heldout=True)
    assert c.train_idx.tolist() == [1, 2, 3] and c.test_idx.dtype == np.int64
    assert c.class_prior.tolist() == [0.0, 2 / 3, 1 / 3, 0.0]
    assert not c.class_prior.flags.writeable and not c.train_idx.flags.writeable
    assert (c.id, c.domain, c.heldout) == (3, 1, True)
    data = make_data(num_classes=2, train_per=2, test_per=2)
    assert base.train_labels(data).dtype == np.int64 and base.test_labels(data).dtype == np.int64


def test_min_train_error_names_the_first_small_client_and_the_partition() -> None:
    data = make_data(num_classes=2, train_per=2, test_per=1)
    with pytest.raises(FpbenchError) as info:
        make_clients("disjoint-classes", {"num_clients": 2, "shots": 1, "min_train": 2}, data, 0)
    assert str(info.value) == (
        "partition.min_train = 2: client 0 of partition 'disjoint-classes' has 1 train samples "
        "(2 clients below); use fewer clients, more shots or a larger dataset"
    )
