"""The partition rules named for their sources: disjoint-classes' class blocks (array-split or
Dassl's round(C / N)) and dirichlet's scheme (NIID-Bench per-class shares or FedDyn per-client
priors); both defaults keep the run keys stored before the settings existed."""

from __future__ import annotations

import numpy as np
import pytest

from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.partition.fewshot import class_blocks
from fpbench.partition.label import prior_split
from fpbench.specs import Component, RunConfig
from tests.test_partition import assert_valid, make_data


def _classes(clients, data) -> list[list[int]]:
    y = data.train_labels.numpy()
    return [sorted(set(y[c.train_idx].tolist())) for c in clients]


# -- disjoint-classes: the class-block rule --------------------------------------------------


@pytest.mark.parametrize(
    ("C", "N", "sizes"),
    [
        (102, 10, [10] * 9 + [12]),  # Flowers102: round(10.2) = 10, the tail of 12 to the last
        (100, 40, [2] * 39 + [22]),  # round(2.5) = 2 (half to even), the last takes 22
        (7, 2, [4, 3]),  # round(3.5) = 4
        (10, 6, [2, 2, 2, 2, 2, 0]),  # round(1.67) = 2: the last block starts past the end
        (10, 10, [1] * 10),
    ],
)
def test_dassl_blocks_are_round_c_over_n_with_the_tail_last(C, N, sizes) -> None:
    blocks = class_blocks(np.arange(C) * 3, N, "dassl")  # any class order is kept as given
    assert [b.size for b in blocks] == sizes
    assert np.array_equal(np.concatenate(blocks), np.arange(C) * 3)


def test_array_split_blocks_differ_by_at_most_one() -> None:
    assert [b.size for b in class_blocks(np.arange(102), 10, "array-split")] == [11] * 2 + [10] * 8


def test_dassl_blocks_partition_the_classes_of_the_shuffle() -> None:
    data = make_data(num_classes=7, train_per=4, test_per=2)
    cfg = {"num_clients": 2, "class_seed": 2023, "blocks": "dassl"}
    clients = make_clients("disjoint-classes", cfg, data, seed=5)
    assert_valid(clients, data, 2)
    order = np.random.default_rng(2023).permutation(7)
    assert _classes(clients, data) == [sorted(order[:4].tolist()), sorted(order[4:].tolist())]
    y_test = data.test_labels.numpy()
    assert [sorted(set(y_test[c.test_idx].tolist())) for c in clients] == _classes(clients, data)
    plain = make_clients("disjoint-classes", {**cfg, "blocks": "array-split"}, data, seed=5)
    assert _classes(plain, data) == _classes(clients, data)  # 7 / 2: both give 4 and 3


def test_dassl_blocks_with_an_empty_client_fail_before_splitting() -> None:
    data = make_data(num_classes=10, train_per=2, test_per=1)
    with pytest.raises(FpbenchError) as info:
        make_clients("disjoint-classes", {"num_clients": 6, "blocks": "dassl"}, data, seed=0)
    assert str(info.value) == (
        "partition.blocks = 'dassl' with 6 clients and 10 classes: round(C / N) = 2 classes "
        "each leaves client 5 none; use fewer clients or blocks = 'array-split'"
    )


# -- dirichlet: the scheme -------------------------------------------------------------------


def test_feddyn_gives_equal_sizes_and_drops_the_remainder() -> None:
    data = make_data(num_classes=5, train_per=21, test_per=4)  # 105 samples, 4 clients: 26 each
    cfg = {"num_clients": 4, "alpha": 0.3, "scheme": "feddyn", "min_size": 0}
    clients = make_clients("dirichlet", cfg, data, seed=0)
    assert_valid(clients, data, 4)
    assert [c.train_idx.size for c in clients] == [26] * 4


def test_feddyn_is_seeded_and_differs_by_seed() -> None:
    data = make_data(num_classes=6, train_per=20, test_per=4)
    cfg = {"num_clients": 3, "alpha": 0.5, "scheme": "feddyn"}
    a, b = (make_clients("dirichlet", cfg, data, seed=1) for _ in range(2))
    assert all(np.array_equal(x.train_idx, y.train_idx) for x, y in zip(a, b, strict=True))
    assert all(np.array_equal(x.test_idx, y.test_idx) for x, y in zip(a, b, strict=True))
    c = make_clients("dirichlet", cfg, data, seed=2)
    assert any(not np.array_equal(x.train_idx, y.train_idx) for x, y in zip(a, c, strict=True))


def test_feddyn_follows_each_clients_prior() -> None:
    """Near one-hot priors on different classes: each client takes exactly its class. Near
    uniform priors: every client's class shares are near 1 / C. (The priors are the first draw
    of the generator, so the test redraws them.)"""
    y = np.repeat(np.arange(2), 1000)
    for seed in range(20):
        priors = np.random.default_rng(seed).dirichlet(np.full(2, 1e-3), size=2)
        if priors[0].argmax() != priors[1].argmax() and priors.max(1).min() > 1 - 1e-9:
            break
    parts = prior_split(y, 2, 2, 1e-3, 0, np.random.default_rng(seed))
    for part, prior in zip(parts, priors, strict=True):
        assert np.bincount(y[part], minlength=2)[prior.argmax()] == 1000
    y = np.repeat(np.arange(4), 3000)
    parts = prior_split(y, 4, 3, 1e6, 0, np.random.default_rng(0))
    for part in parts:
        assert part.size == 4000
        np.testing.assert_allclose(np.bincount(y[part], minlength=4) / 4000, 0.25, atol=0.02)


def test_feddyn_hand_checked_cases() -> None:
    """Two classes of two samples, two clients: every sample goes out once. A client with all
    prior mass on one class takes it until it runs out, then the other's (the restriction)."""
    y = np.array([0, 0, 1, 1])
    parts = prior_split(y, 2, 2, 1.0, 0, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == [0, 1, 2, 3] and [p.size for p in parts] == [
        2,
        2,
    ]
    one = prior_split(np.array([0, 1, 1, 1]), 2, 1, 1e-6, 0, np.random.default_rng(0))
    assert sorted(one[0].tolist()) == [0, 1, 2, 3]  # one client takes everything


def test_feddyn_too_small_for_min_size() -> None:
    data = make_data(num_classes=2, train_per=5, test_per=1)
    with pytest.raises(FpbenchError) as info:
        make_clients("dirichlet", {"num_clients": 4, "scheme": "feddyn"}, data, seed=0)
    assert str(info.value) == (
        "partition.min_size = 10: scheme 'feddyn' gives each of 4 clients 2 train samples; "
        "lower min_size or use fewer clients"
    )


def test_niid_bench_stays_the_default_and_per_class() -> None:
    data = make_data(num_classes=6, train_per=20, test_per=4)
    cfg = {"num_clients": 3, "alpha": 0.5, "min_size": 2}
    plain = make_clients("dirichlet", cfg, data, seed=4)
    named = make_clients("dirichlet", {**cfg, "scheme": "niid-bench"}, data, seed=4)
    assert all(np.array_equal(x.train_idx, y.train_idx) for x, y in zip(plain, named, strict=True))
    assert sum(c.train_idx.size for c in plain) == 120  # every sample dealt (sizes vary)


# -- run keys --------------------------------------------------------------------------------


def _cfg(partition: str, **args) -> RunConfig:
    from fpbench.suites import _validate_components

    cfg = RunConfig(
        suite="s",
        seed=0,
        dataset=Component(name="synthetic", label="d"),
        partition=Component(name=partition, label="p", args=args),
        method={"name": "head-tune", "label": "m"},
    )
    return _validate_components(cfg, "test")


@pytest.mark.parametrize(
    ("partition", "key", "default", "other"),
    [("disjoint-classes", "blocks", "array-split", "dassl"),
     ("dirichlet", "scheme", "niid-bench", "feddyn")],
)  # fmt: skip
def test_rules_are_in_the_config_and_left_out_of_run_keys_at_their_default(
    partition, key, default, other
) -> None:
    before = _cfg(partition)
    assert before.model_dump(mode="json")["partition"]["args"][key] == default  # seen by checks
    assert key not in before.identity()["partition"]["args"]
    assert before.run_key == _cfg(partition, **{key: default}).run_key
    changed = _cfg(partition, **{key: other})
    assert changed.identity()["partition"]["args"][key] == other
    assert changed.run_key != before.run_key
