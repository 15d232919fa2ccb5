"""CIFAR-10 and CIFAR-100 (Krizhevsky, 2009), read from the python-pickle batches.

Native layout (what torchvision downloads and extracts)::

    <root>/cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta}
    <root>/cifar-100-python/{train, test, meta}

Each batch is a pickled dict with ``data`` (N, 3072) uint8 in channel-major order and the labels
(``labels``; CIFAR-100: ``fine_labels`` and ``coarse_labels``). CIFAR-100 keeps its 20
superclasses as `coarse_of_class` (for the Pachinko partition and SGPT's clustering ablation).
Downloads go through torchvision's dataset classes, which check the archives' md5 sums.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import Progress, RealConfig, RealDataset, read_pickle
from fpbench.errors import FpbenchError
from fpbench.registry import DATASETS

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
CIFAR10_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
# Input normalization of the SGPT reference code for CIFAR (sgpt-reference-code.md 1.3): CIFAR-100
# statistics instead of the backbone's own; give them as the backbone's mean / std to reproduce it.
SGPT_CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
SGPT_CIFAR_STD = (0.2673, 0.2564, 0.2762)


def _images(batch: dict, path: Path) -> np.ndarray:
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise FpbenchError(f"{path}: expected CIFAR data of shape (N, 3072), got {data.shape}")
    return data.reshape(-1, 3, 32, 32)


def _names(meta: dict, key: bytes) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in meta[key]]


def read_cifar10(folder: Path, progress: Progress) -> ImageDataset:
    """Read the CIFAR-10 python batches in `folder` into an ImageDataset."""
    xs, ys = [], []
    for i, name in enumerate(CIFAR10_TRAIN):
        progress("cifar10 batches", i, len(CIFAR10_TRAIN) + 1)
        batch = read_pickle(folder / name)
        xs.append(_images(batch, folder / name))
        ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
    test = read_pickle(folder / "test_batch")
    progress("cifar10 batches", len(CIFAR10_TRAIN) + 1, len(CIFAR10_TRAIN) + 1)
    return ImageDataset(
        name=Cifar10.name,
        train_images=torch.from_numpy(np.concatenate(xs)),
        train_labels=torch.from_numpy(np.concatenate(ys)),
        test_images=torch.from_numpy(_images(test, folder / "test_batch")),
        test_labels=torch.as_tensor(test[b"labels"], dtype=torch.int64),
        class_names=_names(read_pickle(folder / "batches.meta"), b"label_names"),
    )


def read_cifar100(folder: Path, progress: Progress) -> ImageDataset:
    """Read the CIFAR-100 python files in `folder`; coarse labels become `coarse_of_class`."""
    progress("cifar100 files", 0, 2)
    train = read_pickle(folder / "train")
    test = read_pickle(folder / "test")
    progress("cifar100 files", 2, 2)
    fine = np.asarray(train[b"fine_labels"], dtype=np.int64)
    coarse = np.asarray(train[b"coarse_labels"], dtype=np.int64)
    meta = read_pickle(folder / "meta")
    return ImageDataset(
        name=Cifar100.name,
        train_images=torch.from_numpy(_images(train, folder / "train")),
        train_labels=torch.from_numpy(fine),
        test_images=torch.from_numpy(_images(test, folder / "test")),
        test_labels=torch.as_tensor(test[b"fine_labels"], dtype=torch.int64),
        class_names=_names(meta, b"fine_label_names"),
        coarse_of_class=torch.from_numpy(coarse_of_class(fine, coarse, 100, folder)),
    )


def coarse_of_class(
    fine: np.ndarray, coarse: np.ndarray, num_classes: int, where: Path
) -> np.ndarray:
    """The coarse label of each fine class; an error if a fine class maps to two coarse ones."""
    table = np.full(num_classes, -1, dtype=np.int64)
    table[fine] = coarse
    if (table[fine] != coarse).any() or (table < 0).any():
        raise FpbenchError(f"{where}: fine and coarse labels are inconsistent or incomplete")
    return table


def _torchvision_download(cls_name: str, root: Path) -> None:
    import torchvision.datasets as tvd

    root.mkdir(parents=True, exist_ok=True)
    getattr(tvd, cls_name)(str(root), train=True, download=True)


@DATASETS.register()
class Cifar10(RealDataset):
    """CIFAR-10: 10 classes, 50,000 train / 10,000 test images of 32x32."""

    name = "cifar10"
    downloadable = True
    hint = (
        "download cifar-10-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and "
        f"extract it so that <root>/{CIFAR10_DIR}/data_batch_1 exists"
    )

    class Config(RealConfig):
        pass

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / CIFAR10_DIR

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        folder = cls.raw_dir(root)
        return all((folder / f).is_file() for f in [*CIFAR10_TRAIN, "test_batch", "batches.meta"])

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        return DatasetInfo(10, 1, False, train_size=50_000, test_size=10_000, image_size=32)

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        return read_cifar10(cls.raw_dir(root), progress)

    @classmethod
    def download(cls, root: Path) -> None:
        _torchvision_download("CIFAR10", Path(root))


@DATASETS.register()
class Cifar100(RealDataset):
    """CIFAR-100: 100 classes in 20 superclasses, 50,000 train / 10,000 test images of 32x32."""

    name = "cifar100"
    downloadable = True
    hint = (
        "download cifar-100-python.tar.gz from https://www.cs.toronto.edu/~kriz/cifar.html and "
        f"extract it so that <root>/{CIFAR100_DIR}/train exists"
    )

    class Config(RealConfig):
        pass

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / CIFAR100_DIR

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return all((cls.raw_dir(root) / f).is_file() for f in ("train", "test", "meta"))

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        return DatasetInfo(100, 1, True, train_size=50_000, test_size=10_000, image_size=32)

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        return read_cifar100(cls.raw_dir(root), progress)

    @classmethod
    def download(cls, root: Path) -> None:
        _torchvision_download("CIFAR100", Path(root))
