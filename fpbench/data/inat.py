"""iNaturalist-User-120k (Hsu, Qi and Brown, ECCV 2020): iNaturalist 2017 split by photographer.

The dataset defines its own clients: every train image carries the id of the user who took it,
kept as `train_users` (0..U-1, in order of first appearance in the split file). PEP-FedPT keeps
the users with at least 16 train images (`min_user_samples`): about 1,018 clients, 1,203 classes.

Native layout::

    <root>/inaturalist/inaturalist-user-120k/federated_train*.csv   columns user_id,image_id,class
    <root>/inaturalist/inaturalist-user-120k/test.csv               columns image_id,class
    <root>/inaturalist/train_val_images/<supercategory>/<species>/<image_id>.jpg

The split files come from http://storage.googleapis.com/gresearch/federated-vision-datasets/
inaturalist-user-120k.zip, the images from the iNaturalist 2017 competition
(github.com/visipedia/inat_comp, ``train_val_images.tar.gz``). An optional ``label`` column (the
original species label) gives the class names. Images are resized once, at prepare time, to
`image_size` squared (memory: N x 3 x S x S bytes, about 150 KB per image at 224 px).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import Progress, RealConfig, RealDataset, decode_images
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

FOLDER = "inaturalist"
IMAGES = "train_val_images"
NUM_CLASSES = 1203
SPLIT_URL = (
    "http://storage.googleapis.com/gresearch/federated-vision-datasets/inaturalist-user-120k.zip"
)


def _read_csv(path: Path, need: tuple[str, ...]) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    missing = [c for c in need if rows and c not in rows[0]]
    if not rows or missing:
        raise FpbenchError(f"{path}: expected a csv with columns {', '.join(need)}")
    return rows


def _image_index(folder: Path, progress: Progress) -> dict[str, Path]:
    """image_id (file stem) -> file, over the whole image tree (walked once)."""
    progress("inaturalist: indexing images", 0, 1)
    index = {p.stem: p for p in (folder / IMAGES).rglob("*.jpg")}
    progress("inaturalist: indexing images", 1, 1)
    return index


def _files(rows: list[dict[str, str]], index: dict[str, Path], where: Path) -> list[Path]:
    absent = [r["image_id"] for r in rows if r["image_id"] not in index]
    if absent:
        raise FpbenchError(
            f"{len(absent)} images of {where.name} (e.g. {absent[0]}) are not under "
            f"{where.parent.parent / IMAGES}; extract iNaturalist 2017's train_val_images there"
        )
    return [index[r["image_id"]] for r in rows]


def _labels(rows: list[dict[str, str]], where: Path) -> np.ndarray:
    y = np.array([int(r["class"]) for r in rows], dtype=np.int64)
    if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise FpbenchError(f"{where}: class ids must lie in 0..{NUM_CLASSES - 1}")
    return y


def _class_names(rows: list[dict[str, str]]) -> list[str]:
    names = [f"class{k:04d}" for k in range(NUM_CLASSES)]
    for r in rows:
        if r.get("label"):
            names[int(r["class"])] = r["label"]
    return names


def _users(rows: list[dict[str, str]]) -> np.ndarray:
    """Each row's user as 0..U-1 in order of first appearance."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(r["user_id"], len(ids)) for r in rows], dtype=np.int64)


@DATASETS.register()
class INaturalistUser120k(RealDataset):
    """iNaturalist-User-120k: per-user federated split of iNaturalist 2017, 1,203 classes."""

    name = "inat-user-120k"
    hint = (
        f"extract {SPLIT_URL} into <root>/{FOLDER}/ and iNaturalist 2017's train_val_images "
        f"(github.com/visipedia/inat_comp) into <root>/{FOLDER}/{IMAGES}"
    )

    class Config(RealConfig):
        split_dir: str = Field("inaturalist-user-120k", description="Folder of the split csvs.")
        train_csv: str | None = Field(None, description="None: the one federated_train*.csv.")
        min_user_samples: int = Field(16, ge=1, description="Drop users with fewer train images.")
        image_size: int = Field(224, ge=8, le=1024, description="Images resized to this square.")

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / FOLDER

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        split = cls.raw_dir(root) / cls.Config().split_dir
        return (split / "test.csv").is_file() and (cls.raw_dir(root) / IMAGES).is_dir()

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        # sizes: the split's release, before users under min_user_samples are dropped
        return DatasetInfo(
            NUM_CLASSES, 1, has_coarse=False, train_size=120_300, test_size=35_641,
            image_size=cfg.image_size, sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def train_csv(cls, cfg: Config, root: Path) -> Path:
        split = cls.raw_dir(root) / cfg.split_dir
        if cfg.train_csv is not None:
            return split / cfg.train_csv
        found = sorted(split.glob("federated_train*.csv"))
        if len(found) != 1:
            raise FpbenchError(
                f"{split}: found {len(found)} federated_train*.csv files; set train_csv to one"
            )
        return found[0]

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        train_path = cls.train_csv(cfg, root)
        test_path = train_path.parent / "test.csv"
        if not train_path.is_file() or not test_path.is_file():
            raise cls.missing(root)
        train = _read_csv(train_path, ("user_id", "image_id", "class"))
        test = _read_csv(test_path, ("image_id", "class"))
        users = _users(train)
        counts = np.bincount(users)
        train = [r for r, u in zip(train, users, strict=True) if counts[u] >= cfg.min_user_samples]
        if not train:
            raise FpbenchError(f"no user of {train_path} has {cfg.min_user_samples} train images")
        index = _image_index(cls.raw_dir(root), progress)
        size = cfg.image_size
        return ImageDataset(
            name=cls.name,
            train_images=decode_images(_files(train, index, train_path), size, progress, "train"),
            train_labels=torch.from_numpy(_labels(train, train_path)),
            test_images=decode_images(_files(test, index, test_path), size, progress, "test"),
            test_labels=torch.from_numpy(_labels(test, test_path)),
            class_names=_class_names(train + test),
            train_users=torch.from_numpy(_users(train)),
        )
