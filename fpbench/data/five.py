"""Five-dataset (Ebrahimi et al., ECCV 2020): SVHN, CIFAR-10, notMNIST, Fashion-MNIST, MNIST.

The five sources are the five domains, in that order, with disjoint label spaces: source d's
class k becomes class 10 * d + k (50 classes). Greyscale 28x28 sources are repeated to three
channels and zero-padded to 32x32 (their background is black, so padding adds no edge).

Native layouts (each source's own)::

    <root>/svhn/{train,test}_32x32.mat                 torchvision's SVHN (MATLAB; needs scipy)
    <root>/cifar-10-batches-py/...                     as for `cifar10`
    <root>/notMNIST_small/{A..J}/*.png                 the extracted notMNIST_small.tar.gz
    <root>/FashionMNIST/raw/{train,t10k}-*-ubyte       torchvision's FashionMNIST
    <root>/MNIST/raw/{train,t10k}-*-ubyte              torchvision's MNIST

notMNIST has no official split: a seeded, per-class 10 % is its test split (unreadable files of
the archive are skipped). Protocols: SGPT uses the sources' full train/test splits (default);
FGPT samples 1,000 images per source and splits them into train and test (`per_domain = 1000`;
the split share is not given in the paper, `test_fraction` defaults to 20 %). `test_per_source`
keeps that many random test images of each source (SGPT Table 1 in fpbench: 1,000, FGPT's count,
so each source's clients hold test sets of one size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from pydantic import Field, model_serializer

from fpbench.data.base import ImageDataset
from fpbench.data.cifar import CIFAR10_DIR, Cifar10, read_cifar10
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    Progress,
    RealConfig,
    RealDataset,
    download_archive,
    hwc_to_chw,
    no_progress,
    pad_to,
    sample_per_group,
    split_train_test,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

SOURCES = ("svhn", "cifar10", "notmnist", "fashion-mnist", "mnist")
NOTMNIST_DIR = "notMNIST_small"
NOTMNIST_URL = "http://yaroslavvb.com/upload/notMNIST/notMNIST_small.tar.gz"
LETTERS = "ABCDEFGHIJ"
Split: TypeAlias = "tuple[torch.Tensor, torch.Tensor]"  # (N, 3, 32, 32) uint8, (N,) int64


def read_svhn(root: Path, split: str) -> Split:
    """torchvision's SVHN file: X (32, 32, 3, N), y (N, 1) with digit 0 stored as 10."""
    try:
        from scipy.io import loadmat
    except ImportError:
        raise FpbenchError("reading SVHN's .mat files needs scipy: pip install scipy") from None
    mat = loadmat(str(Path(root) / "svhn" / f"{split}_32x32.mat"))
    x = np.transpose(mat["X"], (3, 0, 1, 2))  # (N, 32, 32, 3)
    y = mat["y"].astype(np.int64).reshape(-1) % 10
    return hwc_to_chw(x), torch.from_numpy(y)


def read_mnist_like(root: Path, cls_name: str, train: bool) -> Split:
    """MNIST / FashionMNIST through torchvision's classes (idx files in <root>/<Name>/raw)."""
    import torchvision.datasets as tvd

    try:
        ds = getattr(tvd, cls_name)(str(root), train=train, download=False)
    except RuntimeError as e:  # torchvision's "Dataset not found"
        raise FpbenchError(
            f"{cls_name} idx files not found in {root}/{cls_name}/raw: {e}"
        ) from None
    x = ds.data.to(torch.uint8)[:, None].expand(-1, 3, -1, -1)  # (N, 3, 28, 28)
    return pad_to(x, 32), ds.targets.to(torch.int64)


def read_notmnist(root: Path, test_fraction: float, seed: int) -> tuple[Split, Split]:
    """notMNIST_small's letter folders, split per class with a seeded `test_fraction`."""
    from PIL import Image, UnidentifiedImageError

    images, labels = [], []
    for k, letter in enumerate(LETTERS):
        for path in sorted((Path(root) / NOTMNIST_DIR / letter).glob("*.png")):
            try:
                with Image.open(path) as img:
                    images.append(np.asarray(img.convert("L"), dtype=np.uint8))
            except (OSError, UnidentifiedImageError):
                continue  # the archive holds a few empty / truncated files
            labels.append(k)
    if not images:
        raise FpbenchError(f"no readable notMNIST images under {Path(root) / NOTMNIST_DIR}")
    x, y = pad_to(hwc_to_chw(np.stack(images)), 32), np.asarray(labels, np.int64)
    train, test = split_train_test(y.size, test_fraction, seed, y)
    return (x[train], torch.from_numpy(y[train])), (x[test], torch.from_numpy(y[test]))


def _cifar10(root: Path) -> tuple[Split, Split]:
    data = read_cifar10(Path(root) / CIFAR10_DIR, no_progress)
    return (data.train_images, data.train_labels), (data.test_images, data.test_labels)


def _present(root: Path) -> dict[str, bool]:
    root = Path(root)
    return {
        "svhn": all((root / "svhn" / f"{s}_32x32.mat").is_file() for s in ("train", "test")),
        "cifar10": Cifar10.raw_present(root),
        "notmnist": (root / NOTMNIST_DIR / "A").is_dir(),
        "fashion-mnist": _idx_present(root / "FashionMNIST" / "raw"),
        "mnist": _idx_present(root / "MNIST" / "raw"),
    }


def _idx_present(raw: Path) -> bool:
    names = [
        f"{p}-{k}-idx{d}-ubyte"
        for p in ("train", "t10k")
        for k, d in (("images", 3), ("labels", 1))
    ]
    return all((raw / n).is_file() for n in names)


def read_source(name: str, root: Path, cfg: FiveDataset.Config) -> tuple[Split, Split]:
    """(train, test) of one source, with its own labels 0..9."""
    if name == "svhn":
        return read_svhn(root, "train"), read_svhn(root, "test")
    if name == "cifar10":
        return _cifar10(root)
    if name == "notmnist":
        return read_notmnist(root, cfg.notmnist_test_fraction, cfg.seed)
    tv = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST"}[name]
    return read_mnist_like(root, tv, True), read_mnist_like(root, tv, False)


def _subsample(train: Split, cfg: FiveDataset.Config, d: int) -> tuple[Split, Split]:
    """FGPT: `per_domain` random train images of a source, split into train and test."""
    x, y = train
    keep = sample_per_group(np.zeros(len(y), np.int64), cfg.per_domain, cfg.seed, d)
    tr, te = split_train_test(keep.size, cfg.test_fraction, cfg.seed + d)
    return (x[keep[tr]], y[keep[tr]]), (x[keep[te]], y[keep[te]])


@DATASETS.register()
class FiveDataset(RealDataset):
    """Five-dataset: SVHN, CIFAR-10, notMNIST, Fashion-MNIST, MNIST as 5 domains, 50 classes."""

    name = "five-dataset"
    downloadable = True
    hint = (
        "put SVHN (torchvision) in <root>/svhn, CIFAR-10 in <root>/cifar-10-batches-py, "
        "notMNIST_small.tar.gz extracted in <root>/notMNIST_small, and torchvision's "
        "FashionMNIST and MNIST in <root>/FashionMNIST/raw and <root>/MNIST/raw"
    )

    class Config(RealConfig):
        per_domain: int | None = Field(
            None, ge=2, description="Sample this many images per source (FGPT: 1000); None: all."
        )
        test_fraction: float = Field(0.2, gt=0, lt=1, description="Test share with per_domain.")
        notmnist_test_fraction: float = Field(0.1, gt=0, lt=1, description="notMNIST test share.")
        seed: int = Field(0, ge=0, description="Seed of the notMNIST split and the sampling.")
        test_per_source: int | None = Field(
            None,
            ge=1,
            description="Keep this many random test images of each source (seeded): equal "
            "client test sets, as SGPT Table 1's Global = Local needs; None: the whole split.",
        )

        @model_serializer(mode="wrap")
        def _later_field(self, handler: Any) -> dict[str, Any]:
            out = handler(self)  # added later: at None left out, so older run keys stay
            if out.get("test_per_source", 0) is None:
                del out["test_per_source"]
            return out

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root)

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return all(_present(root).values())

    @classmethod
    def missing(cls, root: Path) -> FpbenchError:
        absent = [k for k, ok in _present(root).items() if not ok]
        return FpbenchError(
            f"dataset 'five-dataset' is missing {', '.join(absent)} under {root}: {cls.hint}"
        )

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        if cfg.per_domain is None:  # the sources' splits; notMNIST_small's 18,724 split here
            notmnist_test = round(18_724 * cfg.notmnist_test_fraction)
            train = 73_257 + 50_000 + 18_724 - notmnist_test + 60_000 + 60_000
            test = 26_032 + 10_000 + notmnist_test + 10_000 + 10_000
        else:
            test = len(SOURCES) * round(cfg.per_domain * cfg.test_fraction)
            train = len(SOURCES) * cfg.per_domain - test
        if cfg.test_per_source is not None:  # each source's test split holds more
            test = min(test, len(SOURCES) * cfg.test_per_source)
        return DatasetInfo(
            10 * len(SOURCES), len(SOURCES), has_coarse=True,
            train_size=train, test_size=test, image_size=32, sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        keys = ("xtr", "ytr", "dtr", "xte", "yte", "dte")
        parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for d, source in enumerate(SOURCES):
            progress("five-dataset sources", d, len(SOURCES))
            train, test = read_source(source, root, cfg)
            if cfg.per_domain is not None:
                train, test = _subsample(train, cfg, d)
            if cfg.test_per_source is not None:
                keep = sample_per_group(np.zeros(len(test[1]), np.int64), cfg.test_per_source,
                                        cfg.seed, 100 + d)  # fmt: skip
                test = (test[0][keep], test[1][keep])
            for key, (x, y) in (("tr", train), ("te", test)):
                parts[f"x{key}"].append(x)
                parts[f"y{key}"].append(y + 10 * d)
                parts[f"d{key}"].append(torch.full((len(y),), d, dtype=torch.int64))
        progress("five-dataset sources", len(SOURCES), len(SOURCES))
        cat = {k: torch.cat(v) for k, v in parts.items()}
        return ImageDataset(
            name=cls.name,
            train_images=cat["xtr"],
            train_labels=cat["ytr"],
            test_images=cat["xte"],
            test_labels=cat["yte"],
            class_names=_class_names(),
            train_domains=cat["dtr"],
            test_domains=cat["dte"],
            domain_names=list(SOURCES),
            coarse_of_class=torch.arange(10 * len(SOURCES)) // 10,
        )

    @classmethod
    def download(cls, root: Path) -> None:
        import torchvision.datasets as tvd

        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        for split in ("train", "test"):
            tvd.SVHN(str(root / "svhn"), split=split, download=True)
        Cifar10.download(root)
        if not (root / NOTMNIST_DIR / "A").is_dir():
            download_archive(NOTMNIST_URL, root)
        for name in ("FashionMNIST", "MNIST"):
            for train in (True, False):
                getattr(tvd, name)(str(root), train=train, download=True)


def _class_names() -> list[str]:
    cifar = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship"]
    fashion = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker"]
    names = {
        "svhn": [str(k) for k in range(10)],
        "cifar10": [*cifar, "truck"],
        "notmnist": list(LETTERS),
        "fashion-mnist": [*fashion, "bag", "ankle-boot"],
        "mnist": [str(k) for k in range(10)],
    }
    return [f"{source}/{n}" for source in SOURCES for n in names[source]]
