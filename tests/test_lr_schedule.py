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
