"""A validation split carved from the clients' training data (`train.validation`, `fpbench tune`).

Each client gives a seeded `frac` of its train samples (at least one kept for training) to its
local validation set; the carved dataset's test split is the union of those samples, taken from
the train split, so the engine scores the validation split where it would score the test split
(local accuracy on a client's own validation samples, global accuracy on all of them) and never
reads a test-split sample.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from fpbench.data import ImageDataset
from fpbench.engine.seeding import derive_seed
from fpbench.partition import Client
from fpbench.partition.base import make_client, train_labels


def validation_indices(clients: list[Client], frac: float, seed: int) -> list[np.ndarray]:
    """Each client's validation samples (train-split indices): min(floor(frac * n + 0.5), n - 1)
    of its n train samples, drawn by a generator of its own from `seed` (the partition's draws
    are left as they were)."""
    out = []
    for c in clients:
        n = c.train_idx.size
        k = min(math.floor(frac * n + 0.5), max(n - 1, 0))
        order = np.random.default_rng(derive_seed(seed, "validation", c.id)).permutation(n)
        out.append(np.sort(c.train_idx[order[:k]]))
    return out


def carve_validation(
    data: ImageDataset, clients: list[Client], frac: float, seed: int
) -> tuple[ImageDataset, list[Client]]:
    """The dataset whose test split is the clients' validation samples (`validation_indices`,
    client by client), and the clients with those moved from `train_idx` to `test_idx`
    (indices into that split); `frac` 0: both unchanged."""
    if frac <= 0:
        return data, clients
    y = train_labels(data)
    carved = validation_indices(clients, frac, seed)
    at = np.cumsum([0, *(a.size for a in carved)])
    out = [
        make_client(c.id, np.setdiff1d(c.train_idx, carved[i]), np.arange(at[i], at[i + 1]), y,
                    data.num_classes, c.domain, c.heldout)
        for i, c in enumerate(clients)
    ]  # fmt: skip
    taken = torch.as_tensor(np.concatenate([np.zeros(0, dtype=np.int64), *carved]))
    val = dataclasses.replace(
        data,
        test_images=data.train_images[taken],
        test_labels=data.train_labels[taken],
        test_domains=None if data.train_domains is None else data.train_domains[taken],
        identity=None if data.identity is None else f"{data.identity}|val={frac}@{seed}",
    )
    return val, out
