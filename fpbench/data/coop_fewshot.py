"""The CoOp few-shot datasets (Zhou et al., IJCV 2022), read with CoOp's split files.

Each dataset is its native image folder plus CoOp's ``split_zhou_<Name>.json`` (from the Google
Drive links in CoOp's DATASETS.md, github.com/KaiyangZhou/CoOp), a JSON object with ``train``,
``val`` and ``test`` lists of ``[relative image path, label, class name]``::

    <root>/caltech-101/101_ObjectCategories/...     + split_zhou_Caltech101.json
    <root>/oxford_pets/images/...                   + split_zhou_OxfordPets.json
    <root>/stanford_cars/{cars_train,cars_test}/... + split_zhou_StanfordCars.json
    <root>/oxford_flowers/jpg/...                   + split_zhou_OxfordFlowers.json
    <root>/food-101/images/...                      + split_zhou_Food101.json
    <root>/dtd/images/...                           + split_zhou_DescribableTextures.json
    <root>/eurosat/2750/...                         + split_zhou_EuroSAT.json
    <root>/ucf101/UCF-101-midframes/...             + split_zhou_UCF101.json

The split file is the single source of truth: labels are its integer labels (0..C-1, every one
present), class names its names with underscores as spaces (CLIP prompts need clean words).
The ``train`` list is the train split (``val_in_train`` adds ``val``; CoOp builds but never uses
its few-shot val set), ``test`` the test split. n-shot sampling is the partition's job
(``partition.shots``). Images are decoded once at prepare time the way CLIP's test transform
sees them: the shorter side resized to `image_size` (bicubic), then a centred square crop.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import Progress, RealConfig, RealDataset, decode_images
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

COOP_DOCS = "github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"
Item = tuple[str, int, str]  # relative image path, label, class name


class CoopConfig(RealConfig):
    image_size: int = Field(
        224, ge=8, le=1024, description="Shorter side resized to this, then a centred square crop."
    )
    val_in_train: bool = Field(False, description="Add the split file's val list to train.")


def clean_name(name: str) -> str:
    """A class name as CLIP prompts want it: underscores as spaces, single-spaced."""
    return " ".join(name.replace("_", " ").split())


def read_split(path: Path) -> dict[str, list[Item]]:
    """The train / val / test item lists of a CoOp split file, checked."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FpbenchError(f"cannot read split file {path}: {e}") from None
    if not isinstance(raw, dict) or not {"train", "test"} <= raw.keys():
        raise FpbenchError(f"split file {path}: expected an object with 'train', 'val', 'test'")
    out: dict[str, list[Item]] = {}
    for split in ("train", "val", "test"):
        items = []
        for row in raw.get(split, []):
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[1], int)):
                raise FpbenchError(f"split file {path}: bad {split} entry {row!r}")
            items.append((str(row[0]), int(row[1]), str(row[2])))
        out[split] = items
    return out


def class_names(split: dict[str, list[Item]], where: Path) -> list[str]:
    """Clean class names in label order; every label 0..C-1 must map to exactly one name."""
    names: dict[int, str] = {}
    for items in split.values():
        for rel, label, name in items:
            if names.setdefault(label, name) != name:
                raise FpbenchError(
                    f"split file {where}: label {label} is named both {names[label]!r} and "
                    f"{name!r} (at {rel})"
                )
    if sorted(names) != list(range(len(names))):
        missing = sorted(set(range(max(names, default=-1) + 1)) - set(names))
        raise FpbenchError(f"split file {where}: labels must be 0..C-1; missing {missing[:5]}")
    return [clean_name(names[k]) for k in range(len(names))]


class CoopFewShot(RealDataset):
    """A CoOp dataset: `folder/image_dir` images listed by `folder/split_file`."""

    folder: ClassVar[str]
    image_dir: ClassVar[str]  # "" when the split's paths are relative to `folder`
    split_file: ClassVar[str]
    num_classes: ClassVar[int]  # of the real split file (the partition checks use it)
    sizes: ClassVar[tuple[int, int, int]]  # train / val / test items of the split file
    images_from: ClassVar[str]  # where the images come from, for the missing-data hint
    Config = CoopConfig

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"<root>/{cls.folder}/{cls.image_dir}".rstrip("/")
        cls.hint = (
            f"put the images ({cls.images_from}) at {where}/ and {cls.split_file} (Google "
            f"Drive link in {COOP_DOCS}) at <root>/{cls.folder}/{cls.split_file}"
        )

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / cls.folder

    @classmethod
    def images_root(cls, root: Path) -> Path:
        return cls.raw_dir(root) / cls.image_dir if cls.image_dir else cls.raw_dir(root)

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return (cls.raw_dir(root) / cls.split_file).is_file() and cls.images_root(root).is_dir()

    @classmethod
    def info(cls, cfg: CoopConfig) -> DatasetInfo:
        train, val, test = cls.sizes
        return DatasetInfo(
            cls.num_classes, 1, has_coarse=False, train_size=train + val * cfg.val_in_train,
            test_size=test, image_size=cfg.image_size,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: CoopConfig, root: Path, progress: Progress) -> ImageDataset:
        path = cls.raw_dir(root) / cls.split_file
        split = read_split(path)
        names = class_names(split, path)
        base = cls.images_root(root)
        train = split["train"] + (split["val"] if cfg.val_in_train else [])
        parts = {"train": train, "test": split["test"]}
        out = {}
        for name, items in parts.items():
            files = [base / rel for rel, _, _ in items]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FpbenchError(
                    f"{cls.name}: {len(missing)} images of the {name} split are missing under "
                    f"{base}, e.g. {missing[0]}; {cls.hint}"
                )
            what = f"{cls.name} {name}"
            images = decode_images(files, cfg.image_size, progress, what, crop=True)
            out[name] = (images, torch.tensor([y for _, y, _ in items], dtype=torch.int64))
        return ImageDataset(
            name=cls.name,
            train_images=out["train"][0],
            train_labels=out["train"][1],
            test_images=out["test"][0],
            test_labels=out["test"][1],
            class_names=names,
        )


@DATASETS.register()
class Caltech101(CoopFewShot):
    """Caltech101 (CoOp split): 100 classes, 4,128 / 1,649 / 2,465 train / val / test."""

    name = "caltech101"
    sizes = (4_128, 1_649, 2_465)
    folder = "caltech-101"
    image_dir = "101_ObjectCategories"
    split_file = "split_zhou_Caltech101.json"
    num_classes = 100
    images_from = "101_ObjectCategories.tar.gz from data.caltech.edu/records/mzrjq-6wc02"


@DATASETS.register()
class OxfordPets(CoopFewShot):
    """Oxford-IIIT Pets (CoOp split): 37 classes, 2,944 / 736 / 3,669."""

    name = "oxford-pets"
    sizes = (2_944, 736, 3_669)
    folder = "oxford_pets"
    image_dir = "images"
    split_file = "split_zhou_OxfordPets.json"
    num_classes = 37
    images_from = "images.tar.gz from www.robots.ox.ac.uk/~vgg/data/pets"


@DATASETS.register()
class StanfordCars(CoopFewShot):
    """Stanford Cars (CoOp split; paths include cars_train/ and cars_test/): 196 classes."""

    name = "stanford-cars"
    sizes = (6_509, 1_635, 8_041)
    folder = "stanford_cars"
    image_dir = ""
    split_file = "split_zhou_StanfordCars.json"
    num_classes = 196
    images_from = "the cars_train/ and cars_test/ folders of Stanford Cars"


@DATASETS.register()
class Flowers102(CoopFewShot):
    """Oxford Flowers-102 (CoOp's random 50/20/30 split): 102 classes, 4,093 / 1,633 / 2,463."""

    name = "flowers102"
    sizes = (4_093, 1_633, 2_463)
    folder = "oxford_flowers"
    image_dir = "jpg"
    split_file = "split_zhou_OxfordFlowers.json"
    num_classes = 102
    images_from = "102flowers.tgz from www.robots.ox.ac.uk/~vgg/data/flowers/102"


@DATASETS.register()
class Food101(CoopFewShot):
    """Food-101 (CoOp's random 50/20/30 split): 101 classes, 50,500 / 20,200 / 30,300."""

    name = "food101"
    sizes = (50_500, 20_200, 30_300)
    folder = "food-101"
    image_dir = "images"
    split_file = "split_zhou_Food101.json"
    num_classes = 101
    images_from = "food-101.tar.gz from data.vision.ee.ethz.ch/cvl/datasets_extra/food-101"


@DATASETS.register()
class DTD(CoopFewShot):
    """Describable Textures (CoOp's random 50/20/30 split): 47 classes, 2,820 / 1,128 / 1,692."""

    name = "dtd"
    sizes = (2_820, 1_128, 1_692)
    folder = "dtd"
    image_dir = "images"
    split_file = "split_zhou_DescribableTextures.json"
    num_classes = 47
    images_from = "dtd-r1.0.1.tar.gz from www.robots.ox.ac.uk/~vgg/data/dtd"


@DATASETS.register()
class EuroSAT(CoopFewShot):
    """EuroSAT RGB (CoOp's random 50/20/30 split, CoOp's class names): 10 classes."""

    name = "eurosat"
    sizes = (13_500, 5_400, 8_100)
    folder = "eurosat"
    image_dir = "2750"
    split_file = "split_zhou_EuroSAT.json"
    num_classes = 10
    images_from = "EuroSAT.zip (RGB) from github.com/phelber/EuroSAT, which extracts to 2750/"


@DATASETS.register()
class UCF101(CoopFewShot):
    """UCF101 middle frames (CoOp split of trainlist01 / testlist01): 101 classes."""

    name = "ucf101"
    sizes = (7_639, 1_898, 3_783)
    folder = "ucf101"
    image_dir = "UCF-101-midframes"
    split_file = "split_zhou_UCF101.json"
    num_classes = 101
    images_from = f"UCF-101-midframes.zip, Google Drive link in {COOP_DOCS}"
