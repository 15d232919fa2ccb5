"""The CoOp few-shot datasets (Zhou et al., IJCV 2022), read with CoOp's split files.

Each dataset is its native image folder plus CoOp's ``split_zhou_<Name>.json`` (from the Google
Drive links in CoOp's DATASETS.md, github.com/KaiyangZhou/CoOp), a JSON object with ``train``,
``val`` and ``test`` lists of ``[relative image path, label, class name]``::

    <root>/caltech-101/101_ObjectCategories/...     + split_zhou_Caltech101.json
    <root>/oxford_pets/images/...                   + split_zhou_OxfordPets.json
    <root>/stanford_cars/{cars_train,cars_test}/... + split_zhou_StanfordCars.json
    <root>/oxford_flowers/jpg/...                   + split_zhou_OxfordFlowers.json
    <root>/food-101/images/...                      + split_zhou_Food101.json
    <root>/sun397/SUN397/...                        + split_zhou_SUN397.json
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
from typing import Any, ClassVar, NamedTuple

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


class CoopRow(NamedTuple):
    """One CoOp dataset: the constants its `CoopFewShot` class is made of."""

    cls: str  # the class's name in this module
    name: str  # registry name
    sizes: tuple[int, int, int]  # train / val / test items of the split file
    folder: str
    image_dir: str  # "" when the split's paths are relative to `folder`
    split_file: str
    num_classes: int
    images_from: str
    doc: str  # one line for `fpbench list datasets`


COOP_DATASETS = (
    CoopRow(
        "Caltech101", "caltech101", (4_128, 1_649, 2_465), "caltech-101", "101_ObjectCategories",
        "split_zhou_Caltech101.json", 100,
        "101_ObjectCategories.tar.gz from data.caltech.edu/records/mzrjq-6wc02",
        "Caltech101 (CoOp split): 100 classes, 4,128 / 1,649 / 2,465 train / val / test.",
    ),
    CoopRow(
        "OxfordPets", "oxford-pets", (2_944, 736, 3_669), "oxford_pets", "images",
        "split_zhou_OxfordPets.json", 37, "images.tar.gz from www.robots.ox.ac.uk/~vgg/data/pets",
        "Oxford-IIIT Pets (CoOp split): 37 classes, 2,944 / 736 / 3,669.",
    ),
    CoopRow(
        "StanfordCars", "stanford-cars", (6_509, 1_635, 8_041), "stanford_cars", "",
        "split_zhou_StanfordCars.json", 196,
        "the cars_train/ and cars_test/ folders of Stanford Cars",
        "Stanford Cars (CoOp split; paths include cars_train/ and cars_test/): 196 classes.",
    ),
    CoopRow(
        "Flowers102", "flowers102", (4_093, 1_633, 2_463), "oxford_flowers", "jpg",
        "split_zhou_OxfordFlowers.json", 102,
        "102flowers.tgz from www.robots.ox.ac.uk/~vgg/data/flowers/102",
        "Oxford Flowers-102 (CoOp's random 50/20/30 split): 102 classes, 4,093 / 1,633 / 2,463.",
    ),
    CoopRow(
        "Food101", "food101", (50_500, 20_200, 30_300), "food-101", "images",
        "split_zhou_Food101.json", 101,
        "food-101.tar.gz from data.vision.ee.ethz.ch/cvl/datasets_extra/food-101",
        "Food-101 (CoOp's random 50/20/30 split): 101 classes, 50,500 / 20,200 / 30,300.",
    ),
    CoopRow(
        "SUN397", "sun397", (15_880, 3_970, 19_850), "sun397", "SUN397",
        "split_zhou_SUN397.json", 397,
        "SUN397.tar.gz from vision.princeton.edu/projects/2010/SUN, which extracts to SUN397/",
        "SUN397 (CoOp's split of Training_01 / Testing_01): 397 classes, 15,880 / 3,970 / 19,850.",
    ),
    CoopRow(
        "DTD", "dtd", (2_820, 1_128, 1_692), "dtd", "images",
        "split_zhou_DescribableTextures.json", 47,
        "dtd-r1.0.1.tar.gz from www.robots.ox.ac.uk/~vgg/data/dtd",
        "Describable Textures (CoOp's random 50/20/30 split): 47 classes, 2,820 / 1,128 / 1,692.",
    ),
    CoopRow(
        "EuroSAT", "eurosat", (13_500, 5_400, 8_100), "eurosat", "2750",
        "split_zhou_EuroSAT.json", 10,
        "EuroSAT.zip (RGB) from github.com/phelber/EuroSAT, which extracts to 2750/",
        "EuroSAT RGB (CoOp's random 50/20/30 split, CoOp's class names): 10 classes.",
    ),
    CoopRow(
        "UCF101", "ucf101", (7_639, 1_898, 3_783), "ucf101", "UCF-101-midframes",
        "split_zhou_UCF101.json", 101, f"UCF-101-midframes.zip, Google Drive link in {COOP_DOCS}",
        "UCF101 middle frames (CoOp split of trainlist01 / testlist01): 101 classes.",
    ),
)  # fmt: skip


def _register(row: CoopRow) -> type[CoopFewShot]:
    """The row's dataset class, registered and bound to its name in this module (pickling
    finds it there)."""
    attrs = {k: v for k, v in row._asdict().items() if k not in ("cls", "doc")}
    cls = type(row.cls, (CoopFewShot,), {**attrs, "__doc__": row.doc, "__module__": __name__})
    globals()[row.cls] = DATASETS.register()(cls)
    return cls


for _row in COOP_DATASETS:
    _register(_row)
