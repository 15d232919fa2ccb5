"""The tiny federation of `fpbench.tiny` as run configs, and its pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fpbench.engine.cell import Cell
from fpbench.engine.populations import Population
from fpbench.engine.task import Task
from fpbench.specs import RunConfig
from fpbench.suites import expand_suite
from fpbench.tiny import OFFLINE_ARGS, TINY, tiny_suite  # noqa: F401  (re-exported)

# The same tiny federation as a suite file: 2 methods x 1 partition x 1 seed, 2 rounds.
TINY_SUITE_TOML = """
name = "tiny"
seeds = [0]
[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 6, image_size = 16, train_per_class = 12, test_per_class = 6 }
partition = { num_clients = 4, heldout_frac = 0.25 }
train = { rounds = 2, participation = 0.75, batch_size = 8, lr = 0.05 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "pathological"
s = 3
[[methods]]
name = "head-tune"
[[methods]]
name = "fedvpt"
"""


def seeded_server(method):
    """The method's initial server state with seed 0."""
    return method.init_server(torch.Generator().manual_seed(0))


def with_config(method, **args):
    """The same method class on the same backbone and task, with config `args`."""
    return type(method)(method.Config(**args), method.backbone, method.task)


def tiny_config(method: str = "fedvpt", **train) -> RunConfig:
    """The tiny federation's run config for a registered method, with `train` overrides; a
    method whose `backbone_family` is "clip" gets the test-sized CLIP."""
    return expand_suite(tiny_suite(method, **train), name="tiny").cells[0]


def cell_of(
    cfg: RunConfig,
    task: Task,
    populations: list[Population],
    ids: list[int],
    precision: str = "fp32",
) -> Cell:
    """A cell of parts built apart, every round's clients `ids` (a test playing one round)."""
    schedule = [list(ids)] * max(cfg.train.rounds, 1)
    return Cell(cfg, task.priors.device, precision, task, tuple(populations), schedule)


@pytest.fixture
def fpbench_cache(tmp_path_factory, monkeypatch) -> Path:
    """An fpbench cache folder of the test's own (frozen values, seeded weights), in and below
    its process; the vit-smoke weights already made in the real one are linked in, not
    retrained."""
    real = Path(os.environ.get("FPBENCH_CACHE") or Path.home() / ".cache" / "fpbench")
    folder = tmp_path_factory.mktemp("fpbench-cache")
    for weights in real.glob("vit-smoke-*.pth"):
        (folder / weights.name).symlink_to(weights)
    monkeypatch.setenv("FPBENCH_CACHE", str(folder))
    return folder


@pytest.fixture
def tiny(fpbench_cache) -> Callable:
    """`tiny(method, **train)` -> (cfg, task, method) of the tiny federation, on the CPU."""

    def make(method: str = "fedvpt", **train):
        cfg = tiny_config(method, **train)
        cell = Cell.build(cfg, torch.device("cpu"))
        return cfg, cell.task, cell.populations[0].method

    return make
