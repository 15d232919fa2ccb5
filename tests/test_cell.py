"""`Cell.build`: a cell built once, with its resolved precision, its seed set, its task (the
config's, the train split swapped in, or one given) and its client schedule."""

from __future__ import annotations

import pytest
import torch

from fpbench.engine import cell as cell_module
from fpbench.engine.cell import Cell, sampling_schedule
from fpbench.engine.seeding import derive_seed
from fpbench.engine.task import build_task
from fpbench.errors import FpbenchError
from fpbench.testing.tiny import tiny_config

CPU = torch.device("cpu")


def test_a_cell_holds_its_schedule_seen_clients_precision_and_seed(fpbench_cache):
    cfg = tiny_config(rounds=4, participation=0.34)
    torch.manual_seed(12345)
    cell = Cell.build(cfg, CPU)
    assert torch.initial_seed() == derive_seed(cfg.seed, "torch")
    assert cfg.runtime.precision == "auto" and cell.precision == "fp32"  # "auto" on the CPU
    assert cell.task.trainable_clients() == [1, 2, 3]
    assert cell.schedule == sampling_schedule(cfg.seed, 4, [1, 2, 3], 0.34) == [[2], [3], [2], [3]]
    assert (cell.seen(0), cell.seen(1), cell.seen(3)) == ([2], [2, 3], [2, 3])
    (pop,) = cell.populations
    assert pop.inputs.task is cell.task and pop.method.task.num_clients == 4
    other = cell.with_schedule([[1], [3, 1]])
    assert (other.seen(0), other.seen(1), other.task) == ([1], [1, 3], cell.task)


def test_a_cell_is_built_on_a_given_task_or_on_the_train_split(fpbench_cache, monkeypatch):
    cfg = tiny_config()
    task = build_task(cfg, CPU)
    monkeypatch.setattr(cell_module, "build_task", lambda *a: pytest.fail("task built again"))
    given = Cell.build(cfg, CPU, task=task)
    assert given.task is task and given.populations[0].inputs.task is task
    monkeypatch.setattr(cell_module, "build_task", lambda *a: task)
    swapped = Cell.build(cfg, CPU, split="train")
    assert swapped.task.data.test_images is task.data.train_images
    assert swapped.populations[0].inputs.task is swapped.task


def test_an_unknown_split_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(cell_module, "build_task", lambda *a: pytest.fail("built"))
    with pytest.raises(FpbenchError, match="^--split must be test or train, got 'val'$"):
        Cell.build(tiny_config(), CPU, split="val")
