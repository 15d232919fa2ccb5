"""The local learning-rate schedules (exp, cosine) by hand and in the optimiser."""

from __future__ import annotations

import math

import pytest
import torch

from fpbench.engine.executor import round_lr, train_clients
from fpbench.specs import TrainConfig

from .conftest import seeded_server, tiny_config


def test_round_lr_exp_and_cosine_by_hand():
    exp = TrainConfig(lr=0.1, lr_decay=0.5, rounds=4)
    assert [round_lr(exp, r) for r in (0, 3)] == pytest.approx([0.1, 0.0125])
    cos = TrainConfig(lr=0.1, lr_decay=0.5, rounds=4, lr_schedule="cosine")  # lr_decay ignored
    expected = [
        0.1,
        0.1 * (1 + math.cos(math.pi / 4)) / 2,
        0.05,
        0.1 * (1 - math.cos(math.pi / 4)) / 2,
        0.0,
    ]
    assert [round_lr(cos, r) for r in range(5)] == pytest.approx(expected)


def test_default_schedule_keeps_old_run_keys_and_cosine_changes_them():
    base = tiny_config("promptfl")
    identity = base.identity()
    assert "lr_schedule" not in identity["train"] and base.train.lr_schedule == "exp"
    cosine = tiny_config("promptfl", lr_schedule="cosine")
    assert cosine.identity()["train"]["lr_schedule"] == "cosine"
    assert cosine.run_key != base.run_key


def test_cosine_reaches_the_optimiser(tiny):
    cfg, task, method = tiny("promptfl", lr_schedule="cosine", rounds=2)
    server = seeded_server(method)
    ids = task.trainable_clients()[:1]
    last = train_clients(method, server, task, ids, cfg.train, round_idx=2, seed=0)  # lr 0
    assert torch.equal(last.params["ctx"][0], server.params["ctx"])
    first = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    assert not torch.equal(first.params["ctx"][0], server.params["ctx"])


def test_cosine_local_anneals_over_each_rounds_local_epochs(tiny, monkeypatch):
    """PromptFL's code counts MAX_EPOCH in local epochs: Dassl's cosine stepped per epoch, over
    the round's epochs, from the full lr in every round (TPFL's other reading of max_epoch)."""
    from fpbench.engine.optim import OptimizerGroup

    seen: list[float] = []
    step = OptimizerGroup.step

    def spy(self, mask):
        seen.append(self.optimizers[0].lr)
        step(self, mask)

    monkeypatch.setattr(OptimizerGroup, "step", spy)
    cfg, task, method = tiny("promptfl", lr_schedule="cosine-local", lr=0.1, local_epochs=3)
    server = seeded_server(method)
    ids = task.trainable_clients()[:1]
    for round_idx in (0, 1):  # the same in every round
        seen.clear()
        train_clients(method, server, task, ids, cfg.train, round_idx=round_idx, seed=0)
        per_epoch = len(seen) // 3
        assert per_epoch >= 1 and len(seen) == 3 * per_epoch
        want = [
            0.1,
            0.1 * (1 + math.cos(math.pi / 3)) / 2,
            0.1 * (1 + math.cos(2 * math.pi / 3)) / 2,
        ]
        assert seen == pytest.approx([w for w in want for _ in range(per_epoch)])
    assert round_lr(cfg.train, 7) == 0.1
