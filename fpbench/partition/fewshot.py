"""Disjoint class subsets per client: the few-shot protocol of PromptFL / FedOTP / SDFed.

Dassl's ``generate_federated_fewshot_dataset`` (clip-prompt-learning spec, section 4.1): the
classes are shuffled and cut into one block per client; a client trains on its classes (n shots
of each with ``partition.shots``) and its local test set is every test image of its classes.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition.base import Client, PartitionConfig, make_client, test_labels, train_labels
from fpbench.registry import PARTITIONS


@PARTITIONS.register("disjoint-classes")
class DisjointClasses:
    """Each client owns a disjoint block of classes: all their train and test samples.

    `blocks` cuts the shuffled classes (`class_blocks`): "array-split" (`np.array_split`, sizes
    differ by at most one) or "dassl" (Dassl's ``generate_federated_fewshot_dataset``, as in
    PromptFL / FedOTP / FedPGP: round(C / N) classes, Python's half-to-even rounding, to each
    client and the tail to the last one; with C = 102, N = 10 that is ten, ..., ten, twelve,
    where "array-split" gives ten or eleven). `class_seed` fixes the class shuffle apart from
    the run seed (FedOTP / FedPGP reseed with 2023); None draws it from the run's generator.
    """

    name = "disjoint-classes"

    class Config(PartitionConfig):
        class_seed: int | None = Field(
            None, ge=0, description="Seed of the class shuffle; None: the run seed's generator."
        )
        blocks: Literal["array-split", "dassl"] = Field(
            "array-split",
            description="how the shuffled classes are cut: array-split (sizes differ by at most "
            "one) or dassl (round(C / N) each, the tail to the last client; PromptFL / FedOTP)",
        )

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        if cfg.blocks == "dassl":
            sizes = [b.size for b in class_blocks(np.arange(info.num_classes), cfg.num_clients,
                                                  "dassl")]  # fmt: skip
            if 0 in sizes:
                raise FpbenchError(
                    f"partition.blocks = 'dassl' with {cfg.num_clients} clients and "
                    f"{info.num_classes} classes: round(C / N) = {sizes[0]} classes each leaves "
                    f"client {sizes.index(0)} none; use fewer clients or blocks = 'array-split'"
                )
        if cfg.num_clients > info.num_classes:
            raise FpbenchError(
                f"partition.num_clients = {cfg.num_clients} exceeds the number of classes "
                f"({info.num_classes}) for partition 'disjoint-classes'; use at most "
                f"{info.num_classes} clients"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        y, y_test = train_labels(data), test_labels(data)
        shuffle = rng if cfg.class_seed is None else np.random.default_rng(cfg.class_seed)
        blocks = class_blocks(shuffle.permutation(data.num_classes), cfg.num_clients, cfg.blocks)
        return [
            make_client(
                i,
                np.flatnonzero(np.isin(y, block)),
                np.flatnonzero(np.isin(y_test, block)),
                y,
                data.num_classes,
            )
            for i, block in enumerate(blocks)
        ]


def class_blocks(classes: np.ndarray, num_clients: int, rule: str) -> list[np.ndarray]:
    """`classes` (in their shuffled order) cut into one block per client by `rule`.

    "array-split": `np.array_split`. "dassl": client u < N - 1 gets classes[u * k : (u + 1) * k]
    with k = round(C / N) (half to even, as Python's `round`), the last client classes[(N-1)*k:];
    a block starting past the end is empty.
    """
    if rule == "array-split":
        return np.array_split(classes, num_clients)
    k = round(classes.size / num_clients)
    cuts = [min(u * k, classes.size) for u in range(1, num_clients)]
    return np.split(classes, cuts)
