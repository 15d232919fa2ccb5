"""Disjoint class subsets per client: the few-shot protocol of PromptFL / FedOTP / SDFed.

Dassl's ``generate_federated_fewshot_dataset`` (clip-prompt-learning spec, section 4.1): the
classes are shuffled and cut into one block per client; a client trains on its classes (n shots
of each with ``partition.shots``) and its local test set is every test image of its classes.
"""

from __future__ import annotations

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

    Blocks are `np.array_split` of the shuffled classes, so sizes differ by at most one (Dassl
    gives round(C / N) to each client and the tail to the last one; with C = 102, N = 10 that is
    ten, ten, ..., twelve, here ten or eleven). `class_seed` fixes the class shuffle apart from
    the run seed (FedOTP / FedPGP reseed with 2023); None draws it from the run's generator.
    """

    name = "disjoint-classes"

    class Config(PartitionConfig):
        class_seed: int | None = Field(
            None, ge=0, description="Seed of the class shuffle; None: the run seed's generator."
        )

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
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
        blocks = np.array_split(shuffle.permutation(data.num_classes), cfg.num_clients)
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
