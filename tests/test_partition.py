"""Client partitions: invariants for every partition, then each protocol's own rules."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fpbench.data.base import ImageDataset
from fpbench.errors import FpbenchError
from fpbench.partition import Client, make_clients, resolve_config
from fpbench.partition.base import _largest_remainder, local_test_sets
from fpbench.partition.label import _deal_classes
from fpbench.registry import PARTITIONS


def make_data(
    num_classes: int = 20,
    train_per: int = 60,
    test_per: int = 24,
    num_domains: int = 1,
    coarse: int | None = 4,
    shuffle_seed: int = 0,
) -> ImageDataset:
    """Tiny zero images; labels shuffled; domain = position within the class % num_domains."""
    g = torch.Generator().manual_seed(shuffle_seed)

    def split(per: int) -> tuple[torch.Tensor, torch.Tensor]:
        perm = torch.randperm(num_classes * per, generator=g)
        labels = torch.arange(num_classes).repeat_interleave(per)[perm]
        domains = (torch.arange(per).repeat(num_classes) % num_domains)[perm]
        return labels, domains

    (y, d), (yt, dt) = split(train_per), split(test_per)
    multi = num_domains > 1
    return ImageDataset(
        name="tiny",
        train_images=torch.zeros(len(y), 3, 1, 1, dtype=torch.uint8),
        train_labels=y,
        test_images=torch.zeros(len(yt), 3, 1, 1, dtype=torch.uint8),
        test_labels=yt,
        class_names=[f"c{i}" for i in range(num_classes)],
        train_domains=d if multi else None,
        test_domains=dt if multi else None,
        domain_names=[f"d{i}" for i in range(num_domains)] if multi else None,
        coarse_of_class=torch.arange(num_classes) * coarse // num_classes if coarse else None,
    )


DATA = make_data(num_domains=3)  # 20 classes, 1200 train / 480 test, 3 domains, 4 coarse groups
USERS = 8  # natural clients: train sample i belongs to user (i * 7) % 8
DATA.train_users = torch.arange(len(DATA.train_labels)) * 7 % USERS
CASES: dict[str, dict] = {
    "iid": {},
    "pathological": {"s": 4},
    "dirichlet": {"alpha": 0.5, "min_size": 5},
    "pachinko": {"beta": 0.5},
    "domain": {"num_clients": 3},
    "domain-dirichlet": {"num_clients": 6, "clients_per_domain": 2, "min_size": 5},
    "domain-pathological": {"num_clients": 12, "clients_per_domain": 4, "s": 5},
    "natural": {"num_clients": USERS},
    "disjoint-classes": {},
    "class-blocks": {"num_clients": 4, "classes_per_client": 5},
}
NAMES = sorted(CASES)


def y_train(data: ImageDataset = DATA) -> np.ndarray:
    return data.train_labels.numpy()


def y_test(data: ImageDataset = DATA) -> np.ndarray:
    return data.test_labels.numpy()


def assert_valid(clients: list[Client], data: ImageDataset, num_clients: int) -> None:
    """Invariants every partition must satisfy."""
    y = data.train_labels.numpy()
    assert [c.id for c in clients] == list(range(num_clients))
    for split, n in (("train_idx", len(y)), ("test_idx", len(data.test_labels))):
        idx = [getattr(c, split) for c in clients]
        assert all(i.dtype == np.int64 and not i.flags.writeable for i in idx)
        every = np.concatenate(idx)
        assert every.size == np.unique(every).size, f"{split} sets overlap"
        assert every.size == 0 or (every.min() >= 0 and every.max() < n)
    for c in clients:
        counts = np.bincount(y[c.train_idx], minlength=data.num_classes)
        assert c.class_prior.dtype == np.float64 and c.class_prior.shape == (data.num_classes,)
        assert math.isclose(c.class_prior.sum(), 1.0)
        want = counts / counts.sum() if counts.sum() else np.full(len(counts), 1 / len(counts))
        np.testing.assert_allclose(c.class_prior, want)


def test_every_registered_partition_is_tested() -> None:
    assert set(PARTITIONS.names()) == set(CASES)


@pytest.mark.parametrize("name", NAMES)
def test_invariants(name: str) -> None:
    cfg = resolve_config(name, CASES[name])
    clients = make_clients(name, cfg, DATA, seed=0)
    assert_valid(clients, DATA, cfg.num_clients)
    assert all(c.train_idx.size > 0 and c.test_idx.size > 0 for c in clients)
    assert not any(c.heldout for c in clients)


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_clients(name: str) -> None:
    a = make_clients(name, {**CASES[name], "heldout_frac": 0.3}, DATA, seed=5)
    b = make_clients(name, {**CASES[name], "heldout_frac": 0.3}, DATA, seed=5)
    for ca, cb in zip(a, b, strict=True):
        assert np.array_equal(ca.train_idx, cb.train_idx)
        assert np.array_equal(ca.test_idx, cb.test_idx)
        assert (ca.heldout, ca.domain) == (cb.heldout, cb.domain)


# 'domain' and 'natural' clients are fixed by the data, 'class-blocks' by the labels
FIXED = ("domain", "natural", "class-blocks")


@pytest.mark.parametrize("name", [n for n in NAMES if n not in FIXED])
def test_different_seeds_differ(name: str) -> None:
    a = make_clients(name, CASES[name], DATA, seed=0)
    b = make_clients(name, CASES[name], DATA, seed=1)
    assert any(not np.array_equal(ca.train_idx, cb.train_idx) for ca, cb in zip(a, b, strict=True))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("frac", [0.3, 0.99])
def test_heldout_flags_only_add_flags(name: str, frac: float) -> None:
    plain = make_clients(name, CASES[name], DATA, seed=2)
    held = make_clients(name, {**CASES[name], "heldout_frac": frac}, DATA, seed=2)
    n = len(plain)
    assert sum(c.heldout for c in held) == min(math.floor(frac * n + 0.5), n - 1)
    for p, h in zip(plain, held, strict=True):  # flags are drawn after the split: same data
        assert np.array_equal(p.train_idx, h.train_idx)
        assert np.array_equal(p.test_idx, h.test_idx)


@pytest.mark.parametrize("name", NAMES)
def test_shots_keep_at_most_n_per_class(name: str) -> None:
    y = y_train()
    full = make_clients(name, CASES[name], DATA, seed=3)
    few = make_clients(name, {**CASES[name], "shots": 3}, DATA, seed=3)
    assert_valid(few, DATA, len(full))
    for f, s in zip(full, few, strict=True):
        assert np.isin(s.train_idx, f.train_idx).all()
        want = np.minimum(np.bincount(y[f.train_idx], minlength=20), 3)
        assert np.array_equal(np.bincount(y[s.train_idx], minlength=20), want)
        assert np.array_equal(s.test_idx, f.test_idx)  # local test sets are not subsampled


@pytest.mark.parametrize("name", [n for n in NAMES if n not in ("pathological", "domain")])
def test_local_test_sets_follow_train_shares(name: str) -> None:
    clients = make_clients(name, CASES[name], DATA, seed=4)
    C = DATA.num_classes
    domained = name.startswith("domain")
    key_tr = y_train() + (C * DATA.train_domains.numpy() if domained else 0)
    key_te = y_test() + (C * DATA.test_domains.numpy() if domained else 0)
    n_keys = int(key_tr.max()) + 1
    train = np.stack([np.bincount(key_tr[c.train_idx], minlength=n_keys) for c in clients])
    test = np.stack([np.bincount(key_te[c.test_idx], minlength=n_keys) for c in clients])
    n_test = np.bincount(key_te, minlength=n_keys)
    expected = n_test * train / train.sum(0)
    assert np.abs(test - expected).max() < 2  # rounding (< 1) plus the non-empty fix-up (1)
    assert test.sum() == len(key_te)  # every test sample is given out


# --- pathological --------------------------------------------------------------------------


def test_natural_clients_are_the_users() -> None:
    clients = make_clients("natural", CASES["natural"], DATA, seed=0)
    users = DATA.train_users.numpy()
    for c in clients:
        assert np.array_equal(c.train_idx, np.flatnonzero(users == c.id))


def test_natural_needs_users_and_their_number() -> None:
    with pytest.raises(FpbenchError, match="set num_clients = 8"):
        make_clients("natural", {"num_clients": 5}, DATA, seed=0)
    with pytest.raises(FpbenchError, match="no.*train_users|has none"):
        make_clients("natural", {"num_clients": 8}, make_data(), seed=0)


def test_pathological_class_counts_and_passes() -> None:
    y = y_train()
    clients = make_clients("pathological", {"s": 4}, DATA, seed=0)
    held = [set(np.unique(y[c.train_idx]).tolist()) for c in clients]
    assert all(len(h) == 4 for h in held)
    per_class = np.bincount(np.concatenate([list(h) for h in held]), minlength=20)
    assert per_class.tolist() == [2] * 20  # c = s * N / K = 4 * 10 / 20
    # classes are dealt in passes: clients 0-4 and 5-9 each cover all 20 classes once
    assert set().union(*held[:5]) == set(range(20)) == set().union(*held[5:])


@pytest.mark.parametrize(("K", "N", "s"), [(20, 10, 4), (3, 3, 2), (7, 14, 3)])
def test_pathological_sizes_follow_the_reference_rule(K: int, N: int, s: int) -> None:
    """Train / test counts are floor(n_k * p) of the same dealt portion p (SGPT reference)."""
    data = make_data(num_classes=K, train_per=50, test_per=10, coarse=None)
    clients = make_clients("pathological", {"num_clients": N, "s": s}, data, seed=9)
    deal = _deal_classes(K, N, s, np.random.default_rng(9))  # the split's first draws
    y, yt = y_train(data), y_test(data)
    for c, pairs in zip(clients, deal, strict=True):
        assert len({k for k, _ in pairs}) == s
        train, test = (
            np.bincount(y[c.train_idx], minlength=K),
            np.bincount(yt[c.test_idx], minlength=K),
        )
        for k, p in pairs:
            assert 0.4 / (0.4 + 0.6 * (s * N // K - 1)) <= p <= 1.0
            assert (train[k], test[k]) == (math.floor(50 * p), math.floor(10 * p))
        assert train.sum() == sum(math.floor(50 * p) for _, p in pairs)
    portions = np.zeros(K)
    for pairs in deal:
        for k, p in pairs:
            portions[k] += p
    np.testing.assert_allclose(portions, 1.0)  # each class's portions are normalised


def test_pathological_tiny_hand_checked_case() -> None:
    """K=4, N=2, s=2: c=1, so each class goes whole (p=1) to exactly one client."""
    data = make_data(num_classes=4, train_per=5, test_per=3, coarse=None)
    y, yt = y_train(data), y_test(data)
    a, b = make_clients("pathological", {"num_clients": 2, "s": 2}, data, seed=0)
    for c in (a, b):
        classes = np.unique(y[c.train_idx])
        assert classes.size == 2 and c.train_idx.size == 10 and c.test_idx.size == 6
        assert set(np.unique(yt[c.test_idx])) == set(classes)
        np.testing.assert_allclose(c.class_prior[classes], [0.5, 0.5])
    assert np.intersect1d(y[a.train_idx], y[b.train_idx]).size == 0


def test_pathological_matches_the_reference_statistics_on_cifar100_shape() -> None:
    """CIFAR-100 sizes, N=100, s=50: the spec's replay gives 475.1 train / 7,461 test in total."""
    data = make_data(num_classes=100, train_per=500, test_per=100, coarse=None)
    clients = make_clients("pathological", {"num_clients": 100, "s": 50}, data, seed=0)
    train = np.array([c.train_idx.size for c in clients])
    test = sum(c.test_idx.size for c in clients)
    assert 470 < train.mean() < 480 and 7300 < test < 7650


def test_pathological_check_errors_name_the_field() -> None:
    with pytest.raises(FpbenchError, match=r"partition\.s = 30 is larger .* classes \(20\)"):
        make_clients("pathological", {"s": 30}, DATA, seed=0)
    with pytest.raises(FpbenchError, match=r"partition\.num_clients = 10 .* multiple of 20"):
        make_clients("pathological", {"s": 3}, DATA, seed=0)


# --- dirichlet ----------------------------------------------------------------------------


def mean_entropy(clients: list[Client]) -> float:
    p = np.stack([c.class_prior for c in clients])
    return float(-(p * np.log(np.where(p > 0, p, 1))).sum(1).mean())


def test_dirichlet_small_alpha_is_more_skewed() -> None:
    skewed = make_clients("dirichlet", {"alpha": 0.05, "min_size": 1}, DATA, seed=0)
    flat = make_clients("dirichlet", {"alpha": 100.0, "min_size": 1}, DATA, seed=0)
    assert mean_entropy(skewed) + 1.0 < mean_entropy(flat)
    assert mean_entropy(flat) > 0.95 * np.log(20)


def test_dirichlet_all_train_samples_and_min_size() -> None:
    clients = make_clients("dirichlet", {"alpha": 0.3, "min_size": 40}, DATA, seed=1)
    assert sum(c.train_idx.size for c in clients) == 1200
    assert min(c.train_idx.size for c in clients) >= 40


def test_dirichlet_impossible_min_size_fails_fast() -> None:
    with pytest.raises(FpbenchError, match=r"partition\.min_size = 121 is impossible"):
        make_clients("dirichlet", {"min_size": 121}, DATA, seed=0)  # 10 x 121 > 1200
    start = time.perf_counter()
    with pytest.raises(FpbenchError, match=r"partition\.min_size = 115: .* in 5 tries"):
        make_clients("dirichlet", {"alpha": 0.01, "min_size": 115, "max_retries": 5}, DATA, 0)
    assert time.perf_counter() - start < 2.0


# --- pachinko -----------------------------------------------------------------------------


def coarse_shares(clients: list[Client], data: ImageDataset = DATA) -> np.ndarray:
    coarse = data.coarse_of_class.numpy()
    return np.stack([np.bincount(coarse, weights=c.class_prior, minlength=4) for c in clients])


def test_pachinko_assigns_everything_in_equal_quotas() -> None:
    clients = make_clients("pachinko", {"beta": 0.001, "beta_f": 0.001}, DATA, seed=0)
    sizes = [c.train_idx.size for c in clients]
    assert sum(sizes) == 1200 and max(sizes) - min(sizes) <= 1


def test_pachinko_beta_controls_coarse_skew() -> None:
    skewed = coarse_shares(make_clients("pachinko", {"beta": 0.01}, DATA, seed=0))
    flat = coarse_shares(make_clients("pachinko", {"beta": 100.0}, DATA, seed=0))
    assert skewed.max(1).mean() > 0.6 and flat.max(1).mean() < 0.4


def test_pachinko_beta_f_controls_fine_skew_within_a_group() -> None:
    def fine_top_share(beta_f: float) -> float:
        data = make_data(num_classes=20, train_per=100, coarse=4)  # quota 50 < 100 per class
        cfg = {"num_clients": 40, "beta": 0.001, "beta_f": beta_f}
        clients = make_clients("pachinko", cfg, data, seed=0)
        p = np.stack([c.class_prior for c in clients]).reshape(40, 4, 5)  # (N, G, fine)
        g = coarse_shares(clients, data).argmax(1)  # each client's main group
        top = p[np.arange(40), g]  # (N, 5)
        return float((top.max(1) / top.sum(1)).mean())

    assert fine_top_share(0.01) > 0.6 and fine_top_share(1000.0) < 0.35


def test_pachinko_needs_coarse_labels() -> None:
    with pytest.raises(FpbenchError, match="pachinko.*coarse"):
        make_clients("pachinko", {}, make_data(coarse=None), seed=0)


# --- domains ------------------------------------------------------------------------------


def test_domain_clients_hold_their_whole_domain() -> None:
    d_tr, d_te = DATA.train_domains.numpy(), DATA.test_domains.numpy()
    for c in make_clients("domain", {"num_clients": 3}, DATA, seed=0):
        assert np.array_equal(c.train_idx, np.flatnonzero(d_tr == c.domain))
        assert np.array_equal(c.test_idx, np.flatnonzero(d_te == c.domain))
    assert [c.domain for c in make_clients("domain", {"num_clients": 3}, DATA, 0)] == [0, 1, 2]


def test_domain_dirichlet_clients_stay_in_their_domain() -> None:
    d_tr, d_te = DATA.train_domains.numpy(), DATA.test_domains.numpy()
    clients = make_clients("domain-dirichlet", CASES["domain-dirichlet"], DATA, seed=0)
    assert [c.domain for c in clients] == [0, 0, 1, 1, 2, 2]
    for c in clients:
        assert (d_tr[c.train_idx] == c.domain).all() and (d_te[c.test_idx] == c.domain).all()
    assert sum(c.train_idx.size for c in clients) == 1200


@pytest.mark.parametrize(
    ("name", "cfg", "pattern"),
    [
        ("domain", {}, r"partition\.num_clients = 10 must equal the number of domains \(3\)"),
        ("domain-dirichlet", {}, r"partition\.num_clients = 10 .* \(2 x 3\)"),
        ("domain-dirichlet", {"num_clients": 9, "clients_per_domain": 3, "alpha": -1}, "alpha"),
    ],
)
def test_domain_check_errors(name: str, cfg: dict, pattern: str) -> None:
    with pytest.raises(FpbenchError, match=pattern):
        make_clients(name, cfg, DATA, seed=0)


@pytest.mark.parametrize(
    ("name", "cfg"), [("domain", {"num_clients": 1}), ("domain-dirichlet", {"num_clients": 2})]
)
def test_domain_partitions_need_domains(name: str, cfg: dict) -> None:
    with pytest.raises(FpbenchError, match=f"partition '{name}' needs .* several domains"):
        make_clients(name, cfg, make_data(), seed=0)


# --- configs, helpers, properties ----------------------------------------------------------


def test_config_errors_name_the_field() -> None:
    with pytest.raises(FpbenchError, match=r"partition\.alpah"):
        make_clients("dirichlet", {"alpah": 1.0}, DATA, seed=0)
    with pytest.raises(FpbenchError, match=r"partition\.heldout_frac"):
        make_clients("iid", {"heldout_frac": 1.0}, DATA, seed=0)
    with pytest.raises(FpbenchError, match="unknown partition"):
        make_clients("dirichlett", {}, DATA, seed=0)


def test_min_train_guards_empty_clients() -> None:
    with pytest.raises(FpbenchError, match=r"partition\.min_train = 1: client \d+ .* 0 train"):
        make_clients("iid", {"num_clients": 1300}, DATA, seed=0)


def test_largest_remainder_hand_checked() -> None:
    assert _largest_remainder(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]
    assert _largest_remainder(7, np.array([0.5, 0.25, 0.25])).tolist() == [3, 2, 2]
    assert _largest_remainder(7, np.array([0.6, 0.3, 0.1])).tolist() == [4, 2, 1]


def test_local_test_sets_give_a_sample_to_clients_with_none() -> None:
    """Quotas 3*100/101 -> 3 and 3*1/101 -> 0; the fix-up moves one sample to client 1."""
    train_keys = np.zeros(101, dtype=np.int64)
    parts = [np.arange(100), np.array([100]), np.empty(0, dtype=np.int64)]
    tests = local_test_sets(parts, train_keys, np.zeros(3, np.int64), np.random.default_rng(0))
    assert [t.size for t in tests] == [2, 1, 0]
    assert sorted(np.concatenate(tests).tolist()) == [0, 1, 2]


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["iid", "dirichlet", "pachinko"]),
    num_classes=st.integers(2, 8),
    train_per=st.integers(5, 30),
    test_per=st.integers(1, 10),
    num_clients=st.integers(1, 6),
    alpha=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**32),
)
def test_label_partitions_property(
    name: str,
    num_classes: int,
    train_per: int,
    test_per: int,
    num_clients: int,
    alpha: float,
    seed: int,
) -> None:
    data = make_data(num_classes, train_per, test_per, coarse=min(2, num_classes))
    knobs = {"alpha": alpha, "min_size": 0} if name == "dirichlet" else {}
    knobs = {"beta": alpha} if name == "pachinko" else knobs
    cfg = {"num_clients": num_clients, "min_train": 0, **knobs}
    clients = make_clients(name, cfg, data, seed)
    assert_valid(clients, data, num_clients)
    assert sum(c.train_idx.size for c in clients) == num_classes * train_per
    assert sum(c.test_idx.size for c in clients) == num_classes * test_per
