"""`acc_domain_<d>` and `params_trainable`: the pure functions and what a real run stores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpbench.backbones import create_backbone
from fpbench.engine.metrics import (
    EvalCounts,
    aggregates,
    domain_accuracies,
    domain_key,
    params_trainable,
)
from fpbench.engine.runner import run_cell
from fpbench.methods.fedvpt import FedVPT
from fpbench.store import Store
from fpbench.suites import expand_suite


def counts() -> EvalCounts:
    # clients 0, 1: domain 0; clients 2, 3: domain 1 (3 held out); client 4: domain 2, no test
    return EvalCounts(
        correct_local=np.array([9, 6, 2, 1, 0]),
        total_local=np.array([10, 10, 8, 4, 0]),
        heldout=np.array([False, False, False, True, False]),
        global_acc=np.array([0.5]),
        global_total=40,
    )


def test_domain_accuracies_hand_checked():
    out = domain_accuracies(counts(), [0, 0, 1, 1, 2], ["Clipart", "Real World", "sketch"])
    # domain 0: mean(0.9, 0.6); domain 1: client 2 only (3 is held out); domain 2: no test set
    assert out == pytest.approx({"acc_domain_clipart": 0.75, "acc_domain_real-world": 0.25})


def test_domain_accuracies_mean_of_clients_not_pooled():
    # pooled over domain 0 would be 15/20 as well; make the sizes differ to tell them apart
    ev = counts()
    ev = EvalCounts(
        np.array([9, 1, 2, 1, 0]), np.array([10, 2, 8, 4, 0]), ev.heldout, ev.global_acc, 40
    )
    out = domain_accuracies(ev, [0, 0, 1, 1, 2], ["a", "b", "c"])
    assert out["acc_domain_a"] == pytest.approx((0.9 + 0.5) / 2)
    assert out["acc_domain_a"] != pytest.approx(10 / 12)


def test_no_domains_no_metrics():
    assert domain_accuracies(counts(), [None] * 5, None) == {}
    assert domain_accuracies(counts(), [None] * 5, ["a", "b"]) == {}


def test_domain_means_average_to_local_mean_when_domains_are_equal_sized():
    ev = counts()
    out = domain_accuracies(ev, [0, 0, 1, 1, 1], ["a", "b"])
    # domain a: 2 clients, b: 1 participating client with a test set -> weights 2:1
    assert (2 * out["acc_domain_a"] + out["acc_domain_b"]) / 3 == pytest.approx(
        aggregates(ev)["acc_local_mean"]
    )


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("Real World", "real-world"),
        ("real_world", "real-world"),
        ("DSLR", "dslr"),
        ("d0", "d0"),
        (" (Real World) ", "real-world"),
    ],
)
def test_domain_key(name, key):
    assert domain_key(name) == key


def test_params_trainable_counts_one_personal_row():
    params = {"prompts": torch.zeros(4, 8), "head_b": torch.zeros(3)}
    personal = {"head_w": torch.zeros(10, 3, 8)}  # 10 clients, (3, 8) each
    assert params_trainable(params, personal) == 4 * 8 + 3 + 3 * 8
    assert params_trainable({}, {}) == 0


def _domain_cell():
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "vit-test"},
            "train": {"rounds": 2, "participation": 1.0, "batch_size": 8, "eval_every": 1},
            "dataset": {
                "num_classes": 4,
                "image_size": 16,
                "train_per_class": 8,
                "test_per_class": 4,
                "num_domains": 2,
            },
            "partition": {"num_clients": 4, "heldout_frac": 0.0},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "domain-dirichlet", "clients_per_domain": 2, "min_size": 2}],
        "methods": [{"name": "fedvpt"}],
    }
    return expand_suite(raw, name="metrics-extra").cells[0]


def test_run_stores_domain_accuracies_and_params_trainable(tmp_path):
    cell = _domain_cell()
    cfg = cell.model_copy(update={"runtime": cell.runtime.model_copy(update={"device": "cpu"})})
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        rows = store.metrics(aggregate_only=False)
    params = rows[rows["name"] == "params_trainable"]
    assert list(params["round"]) == [0]  # stored once
    p = FedVPT.Config(**cfg.method.args).prompt_len
    d = create_backbone(cfg.backbone.name, pretrained=False).embed_dim
    assert params["value"].iloc[0] == p * d + 4 * d + 4  # prompts (p, d) + head (C, d) + (C,)
    for r in (0, 1):
        this = rows[rows["round"] == r]
        local = this[this["name"] == "acc_local"].set_index("client_id")["value"]
        for dom, clients in (("d0", [0, 1]), ("d1", [2, 3])):
            got = this[(this["name"] == f"acc_domain_{dom}") & this["client_id"].isna()]
            assert got["value"].iloc[0] == pytest.approx(local[clients].mean())
    window = cfg.train.summary_window
    assert len(rows[rows["name"] == f"acc_domain_d0_last{window}"]) == 1
