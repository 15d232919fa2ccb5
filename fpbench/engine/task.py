"""A run's task: the dataset on the device and its clients, built from a RunConfig."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fpbench.data import ImageDataset
from fpbench.data.prepared import data_root
from fpbench.partition import Client, make_clients
from fpbench.registry import DATASETS
from fpbench.specs import Component, RunConfig


@dataclass
class Task:
    """Images stay uint8 on the device; clients index into them."""

    data: ImageDataset
    clients: list[Client]
    train_idx: list[Tensor]  # per client, on the device
    test_idx: list[Tensor]
    priors: Tensor  # (N, C)
    train_sizes: Tensor  # (N,)
    heldout: Tensor  # (N,) bool

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def trainable_clients(self) -> list[int]:
        return [c.id for c in self.clients if not c.heldout]


@lru_cache(maxsize=2)
def _load(name: str, args_json: str, root: Path) -> ImageDataset:
    dataset = DATASETS.get(name)
    return dataset.load(dataset.Config(**json.loads(args_json)), root)


def load_dataset(comp: Component) -> ImageDataset:
    """The dataset of a component, from the data root ($FPBENCH_DATA, else ./data)."""
    return _load(comp.name, json.dumps(comp.args, sort_keys=True), data_root())


def build_task(cfg: RunConfig, device: torch.device) -> Task:
    """Load (or reuse) the dataset, partition it, and move images and indices to `device`."""
    return task_of(load_dataset(cfg.dataset), cfg.partition, cfg.seed, device)


def task_of(data: ImageDataset, partition: Component, seed: int, device: torch.device) -> Task:
    """Partition `data` with `partition` and move images and indices to `device`."""
    clients = make_clients(partition.name, partition.args, data, seed=seed)
    on_device = dataclasses.replace(
        data,
        train_images=data.train_images.to(device),
        train_labels=data.train_labels.to(device),
        test_images=data.test_images.to(device),
        test_labels=data.test_labels.to(device),
    )
    return Task(
        data=on_device,
        clients=clients,
        train_idx=[_indices(c.train_idx, device) for c in clients],
        test_idx=[_indices(c.test_idx, device) for c in clients],
        priors=torch.as_tensor(
            np.stack([c.class_prior for c in clients]), dtype=torch.float32, device=device
        ),
        train_sizes=torch.tensor([len(c.train_idx) for c in clients], dtype=torch.float32),
        heldout=torch.tensor([c.heldout for c in clients]),
    )


def _indices(idx: np.ndarray, device: torch.device) -> Tensor:
    """A client's (read-only) index array as a long tensor on the device (copied: writable)."""
    return torch.tensor(idx, dtype=torch.long, device=device)
