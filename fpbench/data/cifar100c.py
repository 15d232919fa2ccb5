"""CIFAR-100-C (Hendrycks and Dietterich, ICLR 2019) as a 10-domain dataset (FGPT's protocol).

Native layout (the extracted ``CIFAR-100-C.tar``)::

    <root>/CIFAR-100-C/<corruption>.npy     uint8 (5 * 10,000, 32, 32, 3): the CIFAR-100 test set
                                             under severities 1..5, stacked in that order
    <root>/CIFAR-100-C/labels.npy           (5 * 10,000,) fine labels, the same for every file

FGPT (sec. 4): "take the first 10 domains and randomly sample 1,000 images from each domain",
10,000 images over 100 classes. Domains here are the first 10 corruptions in the benchmark's
canonical order (noise, blur, weather). The paper does not say which severities or how the
10,000 images are split into train and test: by default all five severities are eligible and a
seeded, per-domain stratified 20 % goes to test (`test_fraction`). Class names come from
CIFAR-100's meta file when ``<root>/cifar-100-python/meta`` is present.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import Field, field_validator

from fpbench.data.base import ImageDataset
from fpbench.data.cifar import CIFAR100_DIR
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    Progress,
    RealConfig,
    RealDataset,
    download_archive,
    hwc_to_chw,
    pickle_field,
    read_pickle,
    sample_per_group,
    split_train_test,
    text,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

FOLDER = "CIFAR-100-C"
URL = "https://zenodo.org/record/3555552/files/CIFAR-100-C.tar"
MD5 = "11f0ed0f1191edbf9fa23466ae6021d3"
CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
    "speckle_noise",
    "gaussian_blur",
    "spatter",
    "saturate",
)
SEVERITIES = 5


def _sample_domain(
    path: Path, labels: np.ndarray, cfg: Cifar100C.Config, d: int
) -> tuple[np.ndarray, np.ndarray]:
    """`per_domain` random (image, label) rows of one corruption file, from allowed severities."""
    images = np.load(path, mmap_mode="r")  # (5 * n, 32, 32, 3)
    if images.shape[0] != labels.shape[0] or images.shape[0] % SEVERITIES:
        raise FpbenchError(f"{path}: {images.shape[0]} images but {labels.shape[0]} labels")
    block = images.shape[0] // SEVERITIES
    rows = np.concatenate([np.arange((s - 1) * block, s * block) for s in cfg.severities])
    pick = rows[sample_per_group(np.zeros(rows.size, np.int64), cfg.per_domain, cfg.seed, d)]
    return np.asarray(images[pick]), labels[pick]


def _class_names(root: Path) -> list[str]:
    """CIFAR-100's fine class names when its meta file is there, else placeholders."""
    meta_file = Path(root) / CIFAR100_DIR / "meta"
    if not meta_file.is_file():
        return [f"class{c:02d}" for c in range(100)]
    return [text(n) for n in pickle_field(read_pickle(meta_file), "fine_label_names", meta_file)]


@DATASETS.register()
class Cifar100C(RealDataset):
    """CIFAR-100-C: 10 corruption domains x 1,000 sampled images, 100 classes (FGPT)."""

    name = "cifar100-c"
    downloadable = True
    hint = f"download {URL} and extract it so that <root>/{FOLDER}/labels.npy exists"

    class Config(RealConfig):
        corruptions: tuple[str, ...] = Field(CORRUPTIONS[:10], description="Domains, in order.")
        severities: tuple[int, ...] = Field((1, 2, 3, 4, 5), description="Eligible severities.")
        per_domain: int | None = Field(1000, ge=1, description="Images sampled per domain.")
        test_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Share kept for test.")
        seed: int = Field(0, ge=0, description="Seed of the sampling and the train/test split.")

        @field_validator("corruptions")
        @classmethod
        def _known(cls, v: tuple[str, ...]) -> tuple[str, ...]:
            bad = [c for c in v if c not in CORRUPTIONS]
            if bad or not v or len(set(v)) != len(v):
                raise ValueError(f"corruptions must be distinct names from {CORRUPTIONS}")
            return v

        @field_validator("severities")
        @classmethod
        def _severities(cls, v: tuple[int, ...]) -> tuple[int, ...]:
            if not v or any(s not in range(1, SEVERITIES + 1) for s in v) or len(set(v)) != len(v):
                raise ValueError("severities must be distinct values in 1..5")
            return tuple(sorted(v))

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / FOLDER

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return (cls.raw_dir(root) / "labels.npy").is_file()

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        total = len(cfg.corruptions) * (cfg.per_domain or 10_000)  # 10,000 per severity
        test = round(total * cfg.test_fraction)
        return DatasetInfo(
            100, len(cfg.corruptions), has_coarse=False,
            train_size=total - test, test_size=test, image_size=32,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        folder = cls.raw_dir(root)
        labels = np.load(folder / "labels.npy").astype(np.int64)
        xs, ys, ds = [], [], []
        for d, corruption in enumerate(cfg.corruptions):
            progress("cifar100-c domains", d, len(cfg.corruptions))
            path = folder / f"{corruption}.npy"
            if not path.is_file():
                raise FpbenchError(f"{path} is missing: {cls.hint}")
            x, y = _sample_domain(path, labels, cfg, d)
            xs, ys, ds = [*xs, x], [*ys, y], [*ds, np.full(y.size, d, np.int64)]
        progress("cifar100-c domains", len(cfg.corruptions), len(cfg.corruptions))
        x, y, dom = np.concatenate(xs), np.concatenate(ys), np.concatenate(ds)
        train, test = split_train_test(y.size, cfg.test_fraction, cfg.seed, dom)
        images = hwc_to_chw(x)
        return ImageDataset(
            name=cls.name,
            train_images=images[train],
            train_labels=torch.from_numpy(y[train]),
            test_images=images[test],
            test_labels=torch.from_numpy(y[test]),
            class_names=_class_names(root),
            train_domains=torch.from_numpy(dom[train]),
            test_domains=torch.from_numpy(dom[test]),
            domain_names=list(cfg.corruptions),
        )

    @classmethod
    def download(cls, root: Path) -> None:
        download_archive(URL, Path(root), MD5)
