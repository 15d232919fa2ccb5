"""Office31 (Saenko et al., ECCV 2010) and OfficeHome (Venkateswara et al., CVPR 2017), raw folders.

Native layouts (as the archives extract; the first folder name found is used)::

    <root>/office31/{amazon,dslr,webcam}/images/<class>/*.jpg     (or <domain>/<class>/*.jpg)
    <root>/OfficeHomeDataset_10072016/{Art,Clipart,Product,Real World}/<class>/*.jpg
        (also accepted: <root>/OfficeHome/ or <root>/office_home/, and Real_World)

Neither dataset has an official train/test split: a seeded, per-(domain, class) `test_fraction`
of each domain is its test split (the SDFed / IJCAI-25 protocols split each domain themselves).
Class names are the folder names with underscores as spaces (CLIP prompts need clean words), in
sorted folder order. Images are resized once, at prepare time, by `resize`: "squash" (the
default) to `image_size` squared (PIL bilinear, the aspect lost), or "crop", CLIP's and CoOp's
test transform: the shorter side to `image_size` (bicubic), then the centred square (SDFed's
protocol cites it). Greyscale images become RGB. Domains are partitioned with
``domain-dirichlet``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

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


class OfficeConfig(RealConfig):
    image_size: int = Field(224, ge=8, le=1024, description="Images are resized to this square.")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="Test share of each domain x class.")
    seed: int = Field(0, ge=0, description="Seed of the train/test split.")
    resize: Literal["squash", "crop"] = Field(
        "squash",
        description="squash: resized to the square (PIL bilinear); crop: shorter side to "
        "image_size (bicubic), then the centred square (CLIP's / CoOp's test transform)",
    )

    later_fields: ClassVar[dict[str, Any]] = {"resize": "squash"}


class _OfficeFolders(RealDataset):
    """Domain folders of class folders; `classes` are the folder names in sorted order."""

    folders: ClassVar[tuple[str, ...]]  # candidate dataset folder names under the root
    domains: ClassVar[tuple[tuple[str, ...], ...]]  # per domain: accepted folder names
    domain_names: ClassVar[tuple[str, ...]]
    classes: ClassVar[tuple[str, ...]]
    approx_images: ClassVar[int]  # the standard release's image count (estimates only)
    Config = OfficeConfig

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        for name in cls.folders:
            if (Path(root) / name).is_dir():
                return Path(root) / name
        return Path(root) / cls.folders[0]

    @classmethod
    def domain_dir(cls, root: Path, d: int) -> Path | None:
        """The folder holding domain d's class folders (inside `images/` when there is one)."""
        for name in cls.domains[d]:
            path = cls.raw_dir(root) / name
            if path.is_dir():
                return path / "images" if (path / "images").is_dir() else path
        return None

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return all(cls.domain_dir(root, d) is not None for d in range(len(cls.domains)))

    @classmethod
    def info(cls, cfg: OfficeConfig) -> DatasetInfo:
        """Sizes: the standard release's image count split by `test_fraction` (approximate)."""
        test = round(cls.approx_images * cfg.test_fraction)
        return DatasetInfo(
            len(cls.classes), len(cls.domains), has_coarse=False,
            train_size=cls.approx_images - test, test_size=test, image_size=cfg.image_size,
            sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def domain_items(cls, root: Path, d: int) -> tuple[list[Path], list[int]]:
        """Image files and class indices of domain d; an unknown class folder is an error."""
        folder = cls.domain_dir(root, d)
        if folder is None:
            raise cls.missing(root)
        index = {c: k for k, c in enumerate(cls.classes)}
        files, labels = [], []
        for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
            if sub.name not in index:
                raise FpbenchError(
                    f"{sub}: {sub.name!r} is not one of the {len(cls.classes)} {cls.name} classes"
                )
            found = image_files(sub)
            files += found
            labels += [index[sub.name]] * len(found)
        return files, labels

    @classmethod
    def build(cls, cfg: OfficeConfig, root: Path, progress: Progress) -> ImageDataset:
        split: dict[str, tuple[list[Path], list[int], list[int]]] = {
            "train": ([], [], []),
            "test": ([], [], []),
        }
        for d in range(len(cls.domains)):
            files, labels = cls.domain_items(root, d)
            tr, te = split_train_test(len(files), cfg.test_fraction, cfg.seed, np.array(labels))
            for name, idx in (("train", tr), ("test", te)):
                split[name][0].extend(files[i] for i in idx)
                split[name][1].extend(labels[i] for i in idx)
                split[name][2].extend([d] * len(idx))
        out = {}
        for name, (files, labels, doms) in split.items():
            images = decode_images(
                files, cfg.image_size, progress, f"{cls.name} {name}", crop=cfg.resize == "crop"
            )
            out[name] = (images, torch.tensor(labels, dtype=torch.int64), torch.tensor(doms))
        return ImageDataset(
            name=cls.name,
            train_images=out["train"][0],
            train_labels=out["train"][1],
            test_images=out["test"][0],
            test_labels=out["test"][1],
            class_names=[c.replace("_", " ") for c in cls.classes],
            train_domains=out["train"][2].long(),
            test_domains=out["test"][2].long(),
            domain_names=list(cls.domain_names),
        )


@DATASETS.register()
class Office31(_OfficeFolders):
    """Office31: 3 domains (amazon, dslr, webcam) x 31 office object classes, 4,110 images."""

    name = "office31"
    approx_images = 4_110
    folders = ("office31", "Office31", "office-31", "OFFICE31")
    domains = (("amazon",), ("dslr",), ("webcam",))
    domain_names = ("amazon", "dslr", "webcam")
    classes = (
        "back_pack", "bike", "bike_helmet", "bookcase", "bottle", "calculator", "desk_chair",
        "desk_lamp", "desktop_computer", "file_cabinet", "headphones", "keyboard",
        "laptop_computer", "letter_tray", "mobile_phone", "monitor", "mouse", "mug",
        "paper_notebook", "pen", "phone", "printer", "projector", "punchers", "ring_binder",
        "ruler", "scissors", "speaker", "stapler", "tape_dispenser", "trash_can",
    )  # fmt: skip
    hint = (
        "download Office31 (domain_adaptation_images.tar.gz, linked from "
        "faculty.cc.gatech.edu/~judy/domainadapt) and extract it so that "
        "<root>/office31/amazon/images/<class>/ exists (likewise dslr, webcam)"
    )


@DATASETS.register()
class OfficeHome(_OfficeFolders):
    """OfficeHome: 4 domains (Art, Clipart, Product, Real World) x 65 classes, 15,588 images."""

    name = "officehome"
    approx_images = 15_588
    folders = ("OfficeHomeDataset_10072016", "OfficeHome", "office_home", "officehome")
    domains = (("Art",), ("Clipart",), ("Product",), ("Real World", "Real_World"))
    domain_names = ("Art", "Clipart", "Product", "Real World")
    classes = (
        "Alarm_Clock", "Backpack", "Batteries", "Bed", "Bike", "Bottle", "Bucket", "Calculator",
        "Calendar", "Candles", "Chair", "Clipboards", "Computer", "Couch", "Curtains",
        "Desk_Lamp", "Drill", "Eraser", "Exit_Sign", "Fan", "File_Cabinet", "Flipflops",
        "Flowers", "Folder", "Fork", "Glasses", "Hammer", "Helmet", "Kettle", "Keyboard",
        "Knives", "Lamp_Shade", "Laptop", "Marker", "Monitor", "Mop", "Mouse", "Mug", "Notebook",
        "Oven", "Pan", "Paper_Clip", "Pen", "Pencil", "Postit_Notes", "Printer", "Push_Pin",
        "Radio", "Refrigerator", "Ruler", "Scissors", "Screwdriver", "Shelf", "Sink", "Sneakers",
        "Soda", "Speaker", "Spoon", "TV", "Table", "Telephone", "ToothBrush", "Toys", "Trash_Can",
        "Webcam",
    )  # fmt: skip
    hint = (
        "download OfficeHomeDataset_10072016.zip (www.hemanthdv.org/officeHomeDataset.html) and "
        "extract it so that <root>/OfficeHomeDataset_10072016/Art/<class>/ exists (likewise "
        "Clipart, Product, Real World)"
    )
