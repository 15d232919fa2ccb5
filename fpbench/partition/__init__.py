"""Client partitions: who holds which train samples and which local test samples.

Registered in `fpbench.registry.PARTITIONS`: `iid`, `pathological`, `dirichlet`, `pachinko`
(label skew), `natural` (the dataset's own users), `domain`, `domain-dirichlet` (feature
shift), `disjoint-classes` (few-shot class blocks, PromptFL / FedOTP / SDFed), `class-blocks`
(FedTPG's fixed-size label blocks). Each is a class with `name`, a `Config` (a
`PartitionConfig` subclass), `check(cfg, info)` and `split(cfg, data, rng)`.
`make_clients` runs one end to end: check, split, n-shot subsampling, held-out flags.

Local test sets: `pathological` follows SGPT's reference rule (floor(n_test_k * p) per dealt
class); `domain` gives each client its whole domain; every other partition deals each class's
(or (domain, class)'s) test samples in proportion to the clients' train shares of it (see
`local_test_sets`), disjoint across clients, so that a client with train data gets a test sample
whenever one can be spared. n-shot subsampling changes train sets only: local test sets keep the
distribution of the partition before subsampling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ValidationError

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition import class_blocks, domain, fewshot, label  # noqa: F401  (register)
from fpbench.partition.base import Client, Partition, PartitionConfig, make_client, train_labels
from fpbench.registry import PARTITIONS

__all__ = ["Client", "PartitionConfig", "make_clients", "resolve_config"]


def resolve_config(name: str, cfg: BaseModel | Mapping[str, Any] | None) -> PartitionConfig:
    """The partition's own `Config` from an instance, a mapping of knobs or None (defaults)."""
    part: Partition = PARTITIONS.get(name)
    if isinstance(cfg, part.Config):
        return cfg
    raw = cfg.model_dump() if isinstance(cfg, BaseModel) else dict(cfg or {})
    try:
        return part.Config.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "config"
        raise FpbenchError(f"partition.{field}: {err['msg']} (partition {name!r})") from None


def make_clients(
    name: str, cfg: BaseModel | Mapping[str, Any] | None, data: ImageDataset, seed: int
) -> list[Client]:
    """Partition `data` into clients with partition `name`, deterministically given `seed`.

    Runs `check`, then `split` with `np.random.default_rng(seed)`, then (same generator) keeps at
    most `shots` train samples per class per client and flags round(heldout_frac * N) clients
    (rounded half up, never all of them) as held out. `class_prior` is recomputed from the final
    train sets.

    Raises:
        FpbenchError: impossible knobs for this dataset, or a client left with fewer than
            `min_train` train samples.
    """
    part: Partition = PARTITIONS.get(name)
    cfg = resolve_config(name, cfg)
    part.check(cfg, DatasetInfo.of(data))
    rng = np.random.default_rng(seed)
    clients = part.split(cfg, data, rng)
    y = train_labels(data)
    if cfg.shots is not None:
        clients = [_keep_shots(c, y, cfg.shots, data.num_classes, rng) for c in clients]
    if not any(c.heldout for c in clients):  # a partition may choose its own held-out clients
        clients = _flag_heldout(clients, cfg.heldout_frac, rng)
    _check_min_train(clients, cfg.min_train, name)
    return clients


def _keep_shots(
    c: Client, y: np.ndarray, shots: int, num_classes: int, rng: np.random.Generator
) -> Client:
    """Keep a random `shots` train samples of each class (all of a class with fewer)."""
    idx = c.train_idx[rng.permutation(c.train_idx.size)]
    order = np.argsort(y[idx], kind="stable")
    idx, lab = idx[order], y[idx[order]]
    first = np.searchsorted(lab, lab, side="left")  # position of each label's first sample
    keep = idx[np.arange(idx.size) - first < shots]
    return make_client(c.id, keep, c.test_idx, y, num_classes, c.domain, c.heldout)


def _flag_heldout(clients: list[Client], frac: float, rng: np.random.Generator) -> list[Client]:
    n = len(clients)
    k = min(math.floor(frac * n + 0.5), n - 1)
    chosen = set(rng.choice(n, size=k, replace=False).tolist()) if k > 0 else set()
    return [dataclasses.replace(c, heldout=c.id in chosen) for c in clients]


def _check_min_train(clients: list[Client], min_train: int, name: str) -> None:
    small = [c for c in clients if c.train_idx.size < min_train]
    if small:
        c = small[0]
        raise FpbenchError(
            f"partition.min_train = {min_train}: client {c.id} of partition {name!r} has "
            f"{c.train_idx.size} train samples ({len(small)} clients below); use fewer clients, "
            "more shots or a larger dataset"
        )
