"""Feature-shift datasets with one domain per client: Office-Caltech10 and DomainNet's 10 classes.

Two native layouts are read (``layout = "auto"`` takes the pickles when they are there):

* **FedBN pickles** (Li et al., ICLR 2021; the layout the SGPT code reads)::

      <root>/office_caltech_10/{amazon,caltech,dslr,webcam}_{train,test}.pkl
      <root>/DomainNet/{clipart,infograph,painting,quickdraw,real,sketch}_{train,test}.pkl

  Each pickle holds (image paths, text labels); the paths are relative to the data root
  (``office_caltech_10/amazon/back_pack/frame_0001.jpg``) and the images sit there.
* **Raw folders**: ``<root>/office_caltech_10/<domain>/<class>/*`` (no official split: a seeded,
  per-class `test_fraction` of each domain is its test split), and DomainNet as distributed,
  ``<root>/DomainNet/<domain>/<class>/*.jpg`` with the official split files
  ``<root>/DomainNet/<domain>_{train,test}.txt`` (lines ``<domain>/<class>/<file> <label>``), of
  which only the 10 classes below are kept.

Images differ in size and are resized once, at prepare time, to `image_size` squared with PIL's
bilinear filter (the SGPT code's Resize(224, 224)); greyscale images become RGB.

`sgpt_subset` reproduces the SGPT code's train sets (sgpt-reference-code.md 1.4-1.5): with m the
smallest train list over the domains, each domain trains on the first floor(f * m) items of its
train list, in list order (f = 0.5 for Office-Caltech10, 0.05 for DomainNet); test sets stay whole.
The reference code's [0, 1] input scaling (no normalization) is a backbone choice, not a data one.
Each domain's full train-list size is kept (`domain_train_sizes`): the SGPT code weighs a client
by it in FedAvg (`train.aggregation_weights = "domain_size"`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    Progress,
    RealConfig,
    RealDataset,
    decode_images,
    image_files,
    split_train_test,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

# The SGPT reference code feeds Office / DomainNet pixels in [0, 1] (no normalization): a
# backbone mean / std of these values reproduces it (sgpt-reference-code.md 1.4-1.5).
SGPT_UNIT_MEAN = (0.0, 0.0, 0.0)
SGPT_UNIT_STD = (1.0, 1.0, 1.0)
Items = tuple[list[Path], list[int]]  # image files, class indices


class FedBNConfig(RealConfig):
    layout: Literal["auto", "fedbn", "raw"] = Field(
        "auto", description="auto: FedBN pickles if present, else raw folders."
    )
    image_size: int = Field(224, ge=8, le=1024, description="Images are resized to this square.")
    sgpt_subset: bool = Field(False, description="Train on the SGPT code's first floor(f*m) items.")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="Raw Office folders: test share.")
    seed: int = Field(0, ge=0, description="Seed of the raw Office train/test split.")


class _DomainFolders(RealDataset):
    """A dataset of `domains` x `classes` in FedBN pickles or raw class folders."""

    folder: ClassVar[str]
    domains: ClassVar[tuple[str, ...]]
    classes: ClassVar[tuple[str, ...]]
    sgpt_fraction: ClassVar[float]
    approx_images: ClassVar[tuple[int, ...]]  # per domain (estimates only)
    Config = FedBNConfig

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / cls.folder

    @classmethod
    def has_pickles(cls, root: Path) -> bool:
        base = cls.raw_dir(root)
        return all(
            (base / f"{d}_{s}.pkl").is_file() for d in cls.domains for s in ("train", "test")
        )

    @classmethod
    def has_raw(cls, root: Path) -> bool:
        return all((cls.raw_dir(root) / d).is_dir() for d in cls.domains)

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return cls.has_pickles(root) or cls.has_raw(root)

    @classmethod
    def info(cls, cfg: FedBNConfig) -> DatasetInfo:
        """Sizes from `approx_images` (per domain) and a `test_fraction` split: approximate."""
        per_train = [round(n * (1 - cfg.test_fraction)) for n in cls.approx_images]
        train = sum(per_train)
        if cfg.sgpt_subset:
            train = len(per_train) * int(cls.sgpt_fraction * min(per_train))
        test = sum(cls.approx_images) - sum(per_train)
        return DatasetInfo(
            len(cls.classes), len(cls.domains), has_coarse=False,
            train_size=train, test_size=test, image_size=cfg.image_size, sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def raw_split(cls, root: Path, domain: str, cfg: FedBNConfig) -> tuple[Items, Items]:
        raise NotImplementedError

    @classmethod
    def lists(cls, cfg: FedBNConfig, root: Path) -> list[tuple[Items, Items]]:
        """(train, test) items per domain from the chosen layout."""
        layout = cfg.layout
        if layout == "auto":
            layout = "fedbn" if cls.has_pickles(root) else "raw"
        if layout == "fedbn" and not cls.has_pickles(root):
            raise FpbenchError(
                f"layout = 'fedbn' but the {cls.name} pickles are missing: {cls.hint}"
            )
        if layout == "fedbn":
            return [
                (cls.pickle_items(root, d, "train"), cls.pickle_items(root, d, "test"))
                for d in cls.domains
            ]
        if not cls.has_raw(root):
            raise cls.missing(root)
        return [cls.raw_split(root, d, cfg) for d in cls.domains]

    @classmethod
    def pickle_items(cls, root: Path, domain: str, split: str) -> Items:
        path = cls.raw_dir(root) / f"{domain}_{split}.pkl"
        paths, text_labels = np.load(path, allow_pickle=True)
        index = {c: k for k, c in enumerate(cls.classes)}
        unknown = sorted({str(t) for t in text_labels} - set(index))
        if unknown:
            raise FpbenchError(f"{path}: labels {unknown[:3]} are not among the {cls.name} classes")
        files = [_resolve(Path(root), path.parent, str(p)) for p in paths]
        return files, [index[str(t)] for t in text_labels]

    @classmethod
    def build(cls, cfg: FedBNConfig, root: Path, progress: Progress) -> ImageDataset:
        per_domain = cls.lists(cfg, root)
        full_sizes = torch.tensor([len(train[0]) for train, _ in per_domain], dtype=torch.long)
        if cfg.sgpt_subset:
            m = min(len(train[0]) for train, _ in per_domain)
            keep = int(np.floor(cls.sgpt_fraction * m))
            per_domain = [((tr[0][:keep], tr[1][:keep]), te) for tr, te in per_domain]
        out = {}
        for i, split in enumerate(("train", "test")):
            files = [f for lists in per_domain for f in lists[i][0]]
            labels = [y for lists in per_domain for y in lists[i][1]]
            doms = [d for d, lists in enumerate(per_domain) for _ in lists[i][0]]
            images = decode_images(files, cfg.image_size, progress, f"{cls.name} {split}")
            out[split] = (images, torch.tensor(labels), torch.tensor(doms))
        return ImageDataset(
            name=cls.name,
            train_images=out["train"][0],
            train_labels=out["train"][1].long(),
            test_images=out["test"][0],
            test_labels=out["test"][1].long(),
            class_names=list(cls.classes),
            train_domains=out["train"][2].long(),
            test_domains=out["test"][2].long(),
            domain_names=list(cls.domains),
            domain_train_sizes=full_sizes,
        )


def _resolve(root: Path, pkl_dir: Path, stored: str) -> Path:
    """An image path stored in a FedBN pickle, relative to the data root (or the pickle's dir)."""
    rel = stored.replace("\\", "/")
    for prefix in ("../data/", "./data/", "data/"):
        if rel.startswith(prefix):
            rel = rel[len(prefix) :]
    for base in (root, pkl_dir, pkl_dir.parent):
        if (base / rel).is_file():
            return base / rel
    raise FpbenchError(f"image {stored!r} listed in {pkl_dir} not found under {root}")


def _pick(files: list[Path], labels: list[int], idx: np.ndarray) -> Items:
    return [files[i] for i in idx], [labels[i] for i in idx]


@DATASETS.register()
class OfficeCaltech10(_DomainFolders):
    """Office-Caltech10: 4 domains (amazon, caltech, dslr, webcam) x 10 classes."""

    name = "office-caltech10"
    folder = "office_caltech_10"
    domains = ("amazon", "caltech", "dslr", "webcam")
    classes = (
        "back_pack",
        "bike",
        "calculator",
        "headphones",
        "keyboard",
        "laptop_computer",
        "monitor",
        "mouse",
        "mug",
        "projector",
    )
    sgpt_fraction = 0.5
    approx_images = (958, 1123, 157, 295)  # per domain, the standard release
    hint = (
        "get FedBN's office_caltech_10 folder (pickles + images, linked from the FedBN README at "
        "github.com/med-air/FedBN) or the raw class folders, and put it at <root>/office_caltech_10"
    )

    @classmethod
    def raw_split(cls, root: Path, domain: str, cfg: FedBNConfig) -> tuple[Items, Items]:
        files, labels = [], []
        for k, c in enumerate(cls.classes):
            found = image_files(cls.raw_dir(root) / domain / c)
            files, labels = files + found, labels + [k] * len(found)
        train, test = split_train_test(len(files), cfg.test_fraction, cfg.seed, np.array(labels))
        return _pick(files, labels, train), _pick(files, labels, test)


@DATASETS.register()
class DomainNet10(_DomainFolders):
    """DomainNet's 10-class subset (FedBN): 6 domains x 10 classes."""

    name = "domainnet10"
    folder = "DomainNet"
    domains = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")
    classes = (
        "bird",
        "feather",
        "headphones",
        "ice_cream",
        "teapot",
        "tiger",
        "whale",
        "windmill",
        "wine_glass",
        "zebra",
    )
    sgpt_fraction = 0.05
    approx_images = (3000,) * 6  # per domain: a rough guess, the files decide
    hint = (
        "get FedBN's DomainNet pickles + images (FedBN README, github.com/med-air/FedBN), or the "
        "six domain zips and <domain>_{train,test}.txt split files from "
        "http://ai.bu.edu/M3SDA/, extracted into <root>/DomainNet"
    )

    @classmethod
    def has_raw(cls, root: Path) -> bool:
        base = cls.raw_dir(root)
        return super().has_raw(root) and all(
            (base / f"{d}_{s}.txt").is_file() for d in cls.domains for s in ("train", "test")
        )

    @classmethod
    def raw_split(cls, root: Path, domain: str, cfg: FedBNConfig) -> tuple[Items, Items]:
        return cls.split_file(root, domain, "train"), cls.split_file(root, domain, "test")

    @classmethod
    def split_file(cls, root: Path, domain: str, split: str) -> Items:
        """The official split file's lines whose class folder is one of the 10 classes."""
        base = cls.raw_dir(root)
        index = {c: k for k, c in enumerate(cls.classes)}
        files, labels = [], []
        for line in (base / f"{domain}_{split}.txt").read_text().splitlines():
            rel = line.split()[0] if line.strip() else ""
            parts = rel.split("/")
            if len(parts) >= 3 and parts[-2] in index:
                files.append(base / rel)
                labels.append(index[parts[-2]])
        return files, labels
