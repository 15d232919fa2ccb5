"""Fixed-size class blocks in label order: FedTPG's clients (Qiu et al., ICLR 2024).

FedTPG's server (boschresearch/FedTPG `federated/server.py:97-128`, `init_server`) gives a
dataset of m classes `np.around(m / k)` clients (at least one; numpy rounds halves to even), the
client i the labels `[i k, (i + 1) k)` in label order, and the last client every label from
its block start on. A client trains on its classes (n shots of each with `partition.shots`) and
its local test set is every test image of its classes. Nothing is shuffled: the blocks follow
the labels.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition.base import Client, PartitionConfig, make_client, test_labels, train_labels
from fpbench.registry import PARTITIONS


def fedtpg_clients(num_classes: int, per_client: int) -> int:
    """How many clients FedTPG makes of `num_classes` labels: np.around(m / k), at least 1."""
    return max(1, int(np.around(num_classes / per_client)))


def fedtpg_blocks(num_classes: int, per_client: int) -> list[np.ndarray]:
    """The label block of each client (the last one takes the tail)."""
    n = fedtpg_clients(num_classes, per_client)
    starts = [i * per_client for i in range(n)]
    ends = [*starts[1:], num_classes]
    return [np.arange(s, e) for s, e in zip(starts, ends, strict=True)]


@PARTITIONS.register("class-blocks")
class ClassBlocks:
    """Each client owns `classes_per_client` consecutive labels (FedTPG's split, no shuffle).

    `num_clients` must be FedTPG's count for the dataset, round(C / classes_per_client).
    """

    name = "class-blocks"

    class Config(PartitionConfig):
        classes_per_client: int = Field(
            20, ge=1, description="Labels per client (FedTPG's --num_cls_per_client)."
        )

    @staticmethod
    def check(cfg: Config, info: DatasetInfo) -> None:
        want = fedtpg_clients(info.num_classes, cfg.classes_per_client)
        if cfg.num_clients != want:
            raise FpbenchError(
                f"partition 'class-blocks': {info.num_classes} classes in blocks of "
                f"{cfg.classes_per_client} make {want} clients (FedTPG's np.around(C / k)); "
                f"set partition.num_clients = {want}, not {cfg.num_clients}"
            )

    @staticmethod
    def split(cfg: Config, data: ImageDataset, rng: np.random.Generator) -> list[Client]:
        del rng  # nothing is drawn
        y, y_test = train_labels(data), test_labels(data)
        return [
            make_client(
                i,
                np.flatnonzero(np.isin(y, block)),
                np.flatnonzero(np.isin(y_test, block)),
                y,
                data.num_classes,
            )
            for i, block in enumerate(fedtpg_blocks(data.num_classes, cfg.classes_per_client))
        ]
