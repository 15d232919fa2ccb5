"""Client dropout (`train.dropout`): who fails to report, and that only the rest aggregate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from fpbench.engine.cell import dropout_positions, sampling_schedule
from fpbench.engine.runner import run_cell
from fpbench.engine.seeding import derive_seed
from fpbench.methods.fedvpt import FedVPT
from fpbench.specs import TrainConfig
from fpbench.store import Store
from fpbench.suites import expand_suite
from fpbench.testing import TINY


def test_floor_of_the_rest_reports_as_in_flip_and_at_least_one():
    assert [len(p) for p in dropout_positions(3, 4, 10, 0.3)] == [3, 3, 3, 3]  # 7 report
    assert [len(p) for p in dropout_positions(3, 2, 10, 0.25)] == [3, 3]  # floor(7.5) = 7 report
    assert [len(p) for p in dropout_positions(3, 2, 2, 0.95)] == [1, 1]  # floor(0.1) -> 1 reports
    assert dropout_positions(3, 2, 1, 0.9) == [set(), set()]  # the only client reports
    assert [len(p) for p in dropout_positions(3, 2, 3, 0.5)] == [2, 2]  # floor(1.5) = 1 reports


def test_dropout_is_drawn_from_the_seed_alone():
    # positions: numpy's choice(m, k) of the run's "client-dropout" stream, round after round
    rng = np.random.default_rng(derive_seed(5, "client-dropout"))
    expected = [set(rng.choice(8, 4, replace=False).tolist()) for _ in range(3)]
    assert dropout_positions(5, 3, 8, 0.5) == expected
    assert dropout_positions(6, 3, 8, 0.5) != expected  # another seed, other failures
    # the same positions fail whichever clients the partition made trainable
    a = sampling_schedule(5, 3, list(range(8)), 1.0, 0.5)
    b = sampling_schedule(5, 3, list(range(10, 18)), 1.0, 0.5)
    full_a = sampling_schedule(5, 3, list(range(8)), 1.0)
    full_b = sampling_schedule(5, 3, list(range(10, 18)), 1.0)
    for r in range(3):  # the reporting ones: each sample less the same positions
        assert a[r] == [c for i, c in enumerate(full_a[r]) if i not in expected[r]]
        assert b[r] == [c for i, c in enumerate(full_b[r]) if i not in expected[r]]
    # no dropout: the schedule of before (same draw)
    assert sampling_schedule(5, 3, list(range(8)), 0.5, 0.0) == sampling_schedule(
        5, 3, list(range(8)), 0.5
    )


def test_dropout_must_be_below_one():
    with pytest.raises(ValidationError):
        TrainConfig(dropout=1.0)
    with pytest.raises(ValidationError):
        TrainConfig(dropout=-0.1)
    assert TrainConfig(dropout=0.0) == TrainConfig()


def test_dropout_zero_keeps_run_keys_and_a_fraction_changes_them():
    raw = {**TINY, "defaults": {**TINY["defaults"]}}
    base = expand_suite(raw, name="t").cells[0]
    same = base.model_copy(update={"train": base.train.model_copy(update={"dropout": 0.0})})
    other = base.model_copy(update={"train": base.train.model_copy(update={"dropout": 0.5})})
    assert same.run_key == base.run_key and "dropout" not in base.identity()["train"]
    assert other.run_key != base.run_key and other.identity()["train"]["dropout"] == 0.5


def test_only_reporting_clients_reach_aggregate(tmp_path, monkeypatch):
    """Seed 6, 6 clients all sampled, dropout 0.5: 3 fail each round, the other 3 aggregate in
    the sampled order; `loss_train` is counted over them."""
    defaults = {
        **TINY["defaults"],
        "partition": {"num_clients": 6, "heldout_frac": 0.0},
        "train": {**TINY["defaults"]["train"], "participation": 1.0, "dropout": 0.5},
    }
    raw = {**TINY, "seeds": [6], "defaults": defaults}
    cfg = expand_suite(raw, name="dropout").cells[0]
    seen: list[list[int]] = []
    aggregate = FedVPT.aggregate

    def spy(self, server, updates):
        seen.append(updates.client_ids.tolist())
        return aggregate(self, server, updates)

    monkeypatch.setattr(FedVPT, "aggregate", spy)
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        rows = store.metrics(aggregate_only=False)
    full = sampling_schedule(6, 3, list(range(6)), 1.0)
    rng = np.random.default_rng(derive_seed(6, "client-dropout"))
    gone = [set(rng.choice(6, 3, replace=False).tolist()) for _ in range(3)]
    expected = [
        [c for i, c in enumerate(ids) if i not in g] for ids, g in zip(full, gone, strict=True)
    ]
    assert seen == expected
    assert all(len(ids) == math.floor((1 - 0.5) * 6) for ids in seen)
    loss = rows[rows["name"] == "loss_train"]
    assert loss["count"].tolist() == [3, 3, 3]
