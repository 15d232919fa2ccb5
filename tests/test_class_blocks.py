"""FedTPG's class-block partition: client counts and blocks as its server makes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.errors import FpbenchError
from fpbench.partition import make_clients
from fpbench.partition.class_blocks import ClassBlocks, fedtpg_blocks, fedtpg_clients


@pytest.mark.parametrize(
    ("classes", "k", "clients"),
    # FedTPG's base classes (ceil(C / 2)) at 20 a client; 2.5 and 0.5 round to even
    [(50, 20, 2), (51, 20, 3), (19, 20, 1), (24, 20, 1), (98, 20, 5), (199, 20, 10),
     (1000, 5, 200), (10, 20, 1), (30, 20, 2), (70, 20, 4)],
)  # fmt: skip
def test_fedtpg_client_counts(classes, k, clients) -> None:
    assert fedtpg_clients(classes, k) == clients


def test_fedtpg_blocks_follow_labels_and_last_takes_the_tail() -> None:
    blocks = fedtpg_blocks(50, 20)
    assert [b.tolist() for b in blocks] == [list(range(20)), list(range(20, 50))]
    assert [len(b) for b in fedtpg_blocks(51, 20)] == [20, 20, 11]
    assert [b.tolist() for b in fedtpg_blocks(7, 20)] == [list(range(7))]


def _data(classes: int, per_train: int, per_test: int) -> ImageDataset:
    y = torch.arange(classes).repeat_interleave(per_train)
    y_test = torch.arange(classes).repeat_interleave(per_test)
    return ImageDataset(
        name="blocks",
        train_images=torch.zeros(len(y), 3, 2, 2, dtype=torch.uint8),
        train_labels=y,
        test_images=torch.zeros(len(y_test), 3, 2, 2, dtype=torch.uint8),
        test_labels=y_test,
        class_names=[f"c{k}" for k in range(classes)],
    )


def test_clients_hold_their_blocks_with_shots_and_all_their_test_images() -> None:
    data = _data(5, per_train=4, per_test=3)
    args = {"num_clients": 2, "classes_per_client": 2, "shots": 3}  # 5 / 2 rounds to 2
    clients = make_clients("class-blocks", args, data, seed=0)
    y, yt = data.train_labels.numpy(), data.test_labels.numpy()
    assert [sorted(set(y[c.train_idx])) for c in clients] == [[0, 1], [2, 3, 4]]
    assert [
        np.bincount(y[c.train_idx])[c.train_idx.size and y[c.train_idx].min() :].tolist()
        for c in clients
    ] == [[3, 3], [3, 3, 3]]
    assert [yt[c.test_idx].tolist() for c in clients] == [
        [0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3, 4, 4, 4],
    ]  # fmt: skip
    again = make_clients("class-blocks", args, data, seed=0)
    assert all(
        np.array_equal(a.train_idx, b.train_idx) for a, b in zip(clients, again, strict=True)
    )


def test_wrong_client_count_names_fedtpgs() -> None:
    cfg = ClassBlocks.Config(num_clients=10, classes_per_client=20)
    with pytest.raises(FpbenchError, match="make 3 clients.*num_clients = 3, not 10"):
        ClassBlocks.check(cfg, DatasetInfo(51, 1, False))
