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
