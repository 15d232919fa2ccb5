"""One cell, built once: its config, device, numerics, task, populations and client schedule.

Everything that needs a cell (the round loop, evaluation, re-scoring a kept state, estimates,
the benchmarks, the conformance kit) builds it here and asks it, never rebuilding a part.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch

from fpbench import stages
from fpbench.engine.build import build_populations, resolve_device, resolve_precision
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.populations import Population
from fpbench.engine.seeding import derive_seed
from fpbench.engine.task import Task, build_task, on_train_split
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig


@dataclass(frozen=True)
class Cell:
    """A built cell: what its rounds, evaluations and measurements read."""

    cfg: RunConfig
    device: torch.device
    precision: str  # `runtime.precision` as it computes on `device` ("auto" resolved)
    task: Task
    populations: tuple[Population, ...]
    schedule: list[list[int]]  # per round, the clients that report

    @classmethod
    def build(
        cls,
        cfg: RunConfig,
        device: torch.device | None = None,
        *,
        cache: FeatureCache | None = None,
        pretrained: bool = True,
        backbones: dict | None = None,
        split: str = "test",
        task: Task | None = None,
    ) -> Cell:
        """The cell of `cfg` on `device` (default: `runtime.device`), torch's global seed set
        from the cell's seed first. `pretrained=False`: random weights, `backbones` keeping
        each architecture built once (`fpbench estimate`); `split="train"` scores the train
        split where the test split would be (`task.on_train_split`); `task`: one built
        elsewhere (`fpbench estimate`'s fake data) instead of the config's.

        Raises:
            FpbenchError: missing data or weights, or impossible settings.
        """
        if split not in ("test", "train"):
            raise FpbenchError(f"--split must be test or train, got {split!r}")
        device = resolve_device(cfg.runtime.device) if device is None else device
        precision = resolve_precision(cfg.runtime.precision, device)
        torch.manual_seed(derive_seed(cfg.seed, "torch"))
        if task is None:
            stages.report("preparing data", 0, 1)
            task = build_task(cfg, device)
            stages.report("preparing data", 1, 1)
        if split == "train":
            task = on_train_split(task)
        populations = build_populations(
            cfg, task, device, cache, pretrained, backbones, precision=precision
        )
        train = cfg.train
        schedule = sampling_schedule(
            cfg.seed, train.rounds, task.trainable_clients(), train.participation, train.dropout
        )
        return cls(cfg, device, precision, task, tuple(populations), schedule)

    def with_schedule(self, schedule: list[list[int]]) -> Cell:
        """The cell with other rounds' clients (a measurement's own draw)."""
        return dataclasses.replace(self, schedule=schedule)

    def seen(self, r: int) -> list[int]:
        """The clients sampled in round r or any earlier one."""
        return sorted({c for ids in self.schedule[: r + 1] for c in ids})


def sampling_schedule(
    seed: int, rounds: int, clients: list[int], participation: float, dropout: float = 0.0
) -> list[list[int]]:
    """The clients of every round that report, pre-drawn from the seed so every method sees the
    same ones: m = floor(participation * N) sampled, then `dropout_positions` of them fail."""
    rng = np.random.default_rng(derive_seed(seed, "client-sampling"))
    m = max(1, math.floor(participation * len(clients) + 1e-9))
    sampled = [[int(c) for c in rng.choice(clients, m, replace=False)] for _ in range(rounds)]
    if dropout == 0:
        return sampled
    failed = dropout_positions(seed, rounds, m, dropout)
    return [
        [c for i, c in enumerate(ids) if i not in gone]
        for ids, gone in zip(sampled, failed, strict=True)
    ]


def dropout_positions(seed: int, rounds: int, m: int, dropout: float) -> list[set[int]]:
    """Per round, the positions in the round's sample of m clients that fail to report: all but
    max(1, floor((1 - dropout) * m)) of them, uniformly at random (FLiP's count of reporting
    clients, 0-ml/flip flcore/servers/server_base.py:205-206, with at least one reporting).

    Drawn from the seed alone (its own stream, "client-dropout"), so that the draw is the same
    whatever the partition, the sampling, or the method.
    """
    rng = np.random.default_rng(derive_seed(seed, "client-dropout"))
    k = m - max(1, math.floor((1 - dropout) * m + 1e-9))
    return [{int(i) for i in rng.choice(m, k, replace=False)} for _ in range(rounds)]
