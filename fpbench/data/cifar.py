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

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    Progress,
    RealConfig,
    RealDataset,
    pickle_field,
    read_pickle,
    text,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
CIFAR10_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
# Input normalization of the SGPT reference code for CIFAR (sgpt-reference-code.md 1.3): CIFAR-100
# statistics instead of the backbone's own; give them as the backbone's mean / std to reproduce it.
SGPT_CIFAR_MEAN = (0.5071, 0.4865, 0.4409)
SGPT_CIFAR_STD = (0.2673, 0.2564, 0.2762)


def _images(batch: dict, path: Path) -> np.ndarray:
    data = np.asarray(pickle_field(batch, "data", path), dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise FpbenchError(
            f"malformed dataset file {path}: expected CIFAR data of shape (N, 3072), "
            f"got {data.shape}"
        )
    return data.reshape(-1, 3, 32, 32)


def _labels(batch: dict, key: str, path: Path, count: int) -> np.ndarray:
    """Integer labels `key` of a batch, one per image."""
    labels = np.asarray(pickle_field(batch, key, path))
    if labels.shape != (count,) or not np.issubdtype(labels.dtype, np.integer):
        raise FpbenchError(
            f"malformed dataset file {path}: {key!r} should be {count} integer labels, "
            f"got {labels.dtype} of shape {labels.shape}"
        )
    return labels.astype(np.int64)


def _names(meta: dict, key: str, path: Path) -> list[str]:
    return [text(n) for n in pickle_field(meta, key, path)]


def _split(folder: Path, name: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels `key` of one batch file (bytes or str keys)."""
    batch = read_pickle(folder / name)
    images = _images(batch, folder / name)
    return images, _labels(batch, key, folder / name, len(images))


def read_cifar10(folder: Path, progress: Progress) -> ImageDataset:
    """Read the CIFAR-10 python batches in `folder` into an ImageDataset."""
    xs, ys = [], []
    for i, name in enumerate(CIFAR10_TRAIN):
        progress("cifar10 batches", i, len(CIFAR10_TRAIN) + 1)
        x, y = _split(folder, name, "labels")
        xs.append(x)
        ys.append(y)
    test_x, test_y = _split(folder, "test_batch", "labels")
    progress("cifar10 batches", len(CIFAR10_TRAIN) + 1, len(CIFAR10_TRAIN) + 1)
    meta = folder / "batches.meta"
    return ImageDataset(
        name=Cifar10.name,
        train_images=torch.from_numpy(np.concatenate(xs)),
        train_labels=torch.from_numpy(np.concatenate(ys)),
        test_images=torch.from_numpy(test_x),
        test_labels=torch.from_numpy(test_y),
        class_names=_names(read_pickle(meta), "label_names", meta),
    )


def read_cifar100(folder: Path, progress: Progress) -> ImageDataset:
    """Read the CIFAR-100 python files in `folder`; coarse labels become `coarse_of_class`."""
    progress("cifar100 files", 0, 2)
    train_x, fine = _split(folder, "train", "fine_labels")
    coarse = _labels(read_pickle(folder / "train"), "coarse_labels", folder / "train", len(fine))
    test_x, test_y = _split(folder, "test", "fine_labels")
    progress("cifar100 files", 2, 2)
    meta = folder / "meta"
    return ImageDataset(
        name=Cifar100.name,
        train_images=torch.from_numpy(train_x),
        train_labels=torch.from_numpy(fine),
        test_images=torch.from_numpy(test_x),
        test_labels=torch.from_numpy(test_y),
        class_names=_names(read_pickle(meta), "fine_label_names", meta),
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
