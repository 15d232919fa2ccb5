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
from fpbench.engine.eval_modes import EvalSet, split_for
from fpbench.engine.validation import carve_validation
from fpbench.errors import FpbenchError
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
    aggregation_sizes: Tensor | None = None  # (N,) FedAvg weights; None: train_sizes
    # what the run's evaluation mode scores beside it (`fpbench.engine.eval_modes`), on the device
    eval_sets: tuple[EvalSet, ...] = ()
    # set on a task of clients without local data: what scores them (e.g. an evaluation mode),
    # for the error of a method that draws client data at evaluation; None: they have theirs
    no_local_data: str | None = None

    @property
    def aggregation_weights(self) -> Tensor:
        """(N,) each client's FedAvg weight (unnormalised)."""
        return self.train_sizes if self.aggregation_sizes is None else self.aggregation_sizes

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
    """Load (or reuse) the dataset, partition it, and move images and indices to `device`.

    Under an evaluation mode the partition sees the mode's training data (base classes, the
    domains not held out) and the task carries the sets the mode scores besides.
    """
    data, extra = split_for(cfg.evaluation, load_dataset(cfg.dataset), load_dataset)
    if cfg.train.validation and cfg.evaluation is not None:
        raise FpbenchError(
            f"train.validation = {cfg.train.validation} scores a split carved from the train "
            f"data; evaluation mode {cfg.evaluation.mode!r} scores its own sets: use one of them"
        )
    task = task_of(
        data,
        cfg.partition,
        cfg.seed,
        device,
        cfg.train.aggregation_weights,
        validation=cfg.train.validation,
    )
    task.eval_sets = tuple(dataclasses.replace(e, data=e.data.moved(device)) for e in extra)
    return task


def on_train_split(task: Task) -> Task:
    """The task with its train split in the test split's place (and each client's train
    samples as its local test set), for scoring a trained state on the data it trained on."""
    data = task.data
    swapped = dataclasses.replace(
        data,
        test_images=data.train_images,
        test_labels=data.train_labels,
        test_domains=data.train_domains,
    )
    return dataclasses.replace(task, data=swapped, test_idx=list(task.train_idx))


def task_of(
    data: ImageDataset,
    partition: Component,
    seed: int,
    device: torch.device,
    aggregation_weights: str = "train_size",
    validation: float = 0.0,
) -> Task:
    """Partition `data` with `partition` and move images and indices to `device`; with
    `validation` > 0 the test split is one carved from the clients' train data
    (`fpbench.engine.validation`)."""
    clients = make_clients(partition.name, partition.args, data, seed=seed)
    data, clients = carve_validation(data, clients, validation, seed)
    on_device = data.moved(device)
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
        aggregation_sizes=aggregation_sizes(aggregation_weights, data, clients),
    )


def aggregation_sizes(rule: str, data: ImageDataset, clients: list[Client]) -> Tensor | None:
    """FedAvg weights (N,) under `rule`; None for "train_size" (the clients' train sizes).

    "domain_size": each client weighs its domain's full train-list size divided by the number of
    clients of that domain (the SGPT code's weights on Office-Caltech10 / DomainNet).

    Raises:
        FpbenchError: the dataset records no domain sizes, or a client has no domain.
    """
    if rule == "train_size":
        return None
    if data.domain_train_sizes is None:
        raise FpbenchError(
            f"train.aggregation_weights = 'domain_size' needs a dataset that records its domains' "
            f"full sizes; {data.name} does not (a file prepared before they were recorded: "
            "delete it and prepare again)"
        )
    domains = [c.domain for c in clients]
    if any(d is None for d in domains):
        raise FpbenchError(
            "train.aggregation_weights = 'domain_size' needs a per-domain partition (domain, "
            "domain-dirichlet)"
        )
    per_domain = {d: domains.count(d) for d in set(domains)}
    sizes = [float(data.domain_train_sizes[d]) / per_domain[d] for d in domains]
    return torch.tensor(sizes, dtype=torch.float32)


def _indices(idx: np.ndarray, device: torch.device) -> Tensor:
    """A client's (read-only) index array as a long tensor on the device (copied: writable)."""
    return torch.tensor(idx, dtype=torch.long, device=device)
