"""PEP-FedPT's DomainNet partition: k clients per domain with s of its classes each, and held-out
clients one per domain."""

from __future__ import annotations

import numpy as np
import pytest

from fpbench.errors import FpbenchError
from fpbench.partition import base, make_clients
from tests.test_partition import make_data


@pytest.fixture(scope="module")
def data():
    return make_data(num_classes=6, train_per=24, test_per=12, num_domains=2)


def test_each_client_holds_s_classes_of_its_own_domain_and_one_per_domain_is_held_out(data):
    cfg = {"num_clients": 6, "clients_per_domain": 3, "s": 2, "heldout_per_domain": 1}
    clients = make_clients("domain-pathological", cfg, data, seed=0)
    d_train, d_test = base.domains_of(data)
    y, y_test = base.train_labels(data), base.test_labels(data)
    for c in clients:
        assert c.domain == c.id // 3
        assert len(set(y[c.train_idx])) == 2 and set(y_test[c.test_idx]) <= set(y[c.train_idx])
        assert (d_train[c.train_idx] == c.domain).all() and (d_test[c.test_idx] == c.domain).all()
    assert [sum(c.heldout for c in clients if c.domain == d) for d in (0, 1)] == [1, 1]
    everything = np.concatenate([c.train_idx for c in clients])
    assert len(everything) == len(set(everything.tolist()))  # disjoint


def test_held_out_per_domain_replaces_heldout_frac_and_bad_knobs_fail(data):
    with pytest.raises(FpbenchError, match="heldout_frac = 0"):
        make_clients(
            "domain-pathological",
            {"num_clients": 6, "clients_per_domain": 3, "s": 2, "heldout_per_domain": 1,
             "heldout_frac": 0.1},
            data,
            seed=0,
        )  # fmt: skip
    with pytest.raises(FpbenchError, match="multiple of the number of classes"):
        make_clients("domain-pathological", {"num_clients": 6, "clients_per_domain": 3, "s": 3},
                     data, seed=0)  # fmt: skip


def test_its_errors_say_what_to_set(data):
    def error(cfg: dict, dataset=data) -> str:
        with pytest.raises(FpbenchError) as info:
            make_clients("domain-pathological", cfg, dataset, seed=0)
        return str(info.value)

    assert error({"num_clients": 5, "clients_per_domain": 3, "s": 2}) == (
        "partition.num_clients = 5 must equal clients_per_domain x domains (3 x 2) for partition "
        "'domain-pathological'; set partition.num_clients = 6"
    )
    assert error({"num_clients": 6, "clients_per_domain": 3, "s": 2, "heldout_per_domain": 3}) == (
        "partition.heldout_per_domain needs heldout_frac = 0 and fewer than clients_per_domain (3) "
        "held-out clients per domain"
    )
    assert error({"num_clients": 3, "clients_per_domain": 3}, make_data(num_classes=6)) == (
        "partition 'domain-pathological' needs a dataset with several domains; this one has 1: "
        "use a label-skew partition such as 'dirichlet'"
    )


def test_every_class_per_client_is_allowed(data):
    """s = C: each client of a domain then holds a share of every class of it."""
    clients = make_clients(
        "domain-pathological", {"num_clients": 4, "clients_per_domain": 2, "s": 6}, data, 0
    )
    y = base.train_labels(data)
    assert [sorted(set(y[c.train_idx].tolist())) for c in clients] == [list(range(6))] * 4


@pytest.mark.parametrize("seed", range(6))
def test_held_out_clients_per_domain_are_distinct(data, seed: int):
    cfg = {"num_clients": 6, "clients_per_domain": 3, "s": 2, "heldout_per_domain": 2}
    clients = make_clients("domain-pathological", cfg, data, seed=seed)
    assert [sum(c.heldout for c in clients if c.domain == d) for d in (0, 1)] == [2, 2]


def test_shots_keep_each_client_s_domain_and_held_out_flag(data):
    cfg = {"num_clients": 6, "clients_per_domain": 3, "s": 2, "heldout_per_domain": 1}
    full = make_clients("domain-pathological", cfg, data, seed=1)
    few = make_clients("domain-pathological", {**cfg, "shots": 2}, data, seed=1)
    assert [c.domain for c in few] == [0, 0, 0, 1, 1, 1]
    assert [c.heldout for c in few] == [c.heldout for c in full]
    assert [sum(c.heldout for c in few if c.domain == d) for d in (0, 1)] == [1, 1]
