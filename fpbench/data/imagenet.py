"""ImageNet (ILSVRC-2012) and its four distribution shifts, in CoOp's layout (Zhou et al., IJCV
2022, DATASETS.md; github.com/KaiyangZhou/CoOp `datasets/imagenet*.py`)::

    <root>/imagenet/images/{train,val}/n01440764/...   + classnames.txt
    <root>/imagenetv2/imagenetv2-matched-frequency-format-val/{0..999}/...   + classnames.txt
    <root>/imagenet-sketch/images/n01440764/...        + classnames.txt
    <root>/imagenet-adversarial/imagenet-a/n01498041/... (200 folders)   + classnames.txt
    <root>/imagenet-rendition/imagenet-r/n01443537/...   (200 folders)   + classnames.txt

`classnames.txt` is CoOp's (CLIP's clean ImageNet names): one line per class, ``<wnid> <name>``,
in wnid order; the shifts use the same file. Labels follow CoOp's loaders: ImageNet and
ImageNet-Sketch number the sorted wnid folders; ImageNet-V2 names its folders by label;
ImageNet-A and -R number their 200 sorted wnid folders 0..199 and carry those 200 names, so a
prompt is scored over the subset's classes (CoOp's `imagenet_a.py`, `imagenet_r.py`).

ImageNet's train split is read few-shot: `shots` images of each class, drawn as CoOp draws its
`split_fewshot/shot_<K>-seed_<S>.pkl` (Dassl's `generate_fewshot_dataset`: per label in label
order, `random.sample` of the class's images, seeded by `shots_seed`), from the file listing
sorted by name (CoOp lists folders in the file system's order, which no two machines share).
Only the sampled images are decoded; the 1.28M others are never opened. The test split is the
50,000 val images. The four shifts are test-only: their train split is empty and a run cannot
train on them (they are `evaluation.targets` of cross-dataset / domain-generalisation suites).
Images are decoded as CLIP's test transform sees them: shorter side to `image_size` (bicubic),
centred square crop.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    IMAGE_SUFFIXES,
    Progress,
    RealConfig,
    RealDataset,
    decode_images,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

COOP_DOCS = "github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"
CLASSNAMES = "classnames.txt"
CLASSNAMES_HINT = f"classnames.txt (CoOp's, Google Drive link in {COOP_DOCS})"


def read_classnames(path: Path) -> dict[str, str]:
    """wnid -> class name of a CoOp `classnames.txt` (``<wnid> <name words>`` per line)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise FpbenchError(f"cannot read {path}: {e}") from None
    names: dict[str, str] = {}
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        wnid, _, name = line.strip().partition(" ")
        if not name.strip():
            raise FpbenchError(f"{path}:{i}: expected '<wnid> <class name>', got {line!r}")
        names[wnid] = " ".join(name.split())
    return names


def image_list(folder: Path) -> list[Path]:
    """The image files directly in `folder`, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def class_folders(folder: Path) -> list[str]:
    """The sorted names of the sub-folders of `folder` (CoOp's `listdir_nohidden(sort=True)`)."""
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def coop_fewshot(per_class: Sequence[Sequence[Path]], shots: int, seed: int) -> list[int]:
    """Indices into the concatenation of `per_class` (label order) of CoOp's few-shot draw:
    for each label in order, `random.sample(items, shots)` from one `random.Random(seed)`, or
    every item of a class with fewer (Dassl `generate_fewshot_dataset`, repeat=False)."""
    rng = random.Random(seed)
    out, start = [], 0
    for items in per_class:
        picked = range(len(items)) if len(items) < shots else rng.sample(range(len(items)), shots)
        out.extend(start + i for i in picked)
        start += len(items)
    return out


class ImageNetConfig(RealConfig):
    image_size: int = Field(
        224, ge=8, le=1024, description="Shorter side resized to this, then a centred square crop."
    )
    shots: int = Field(
        16,
        ge=1,
        le=1300,
        description="Train images per class, drawn as CoOp's few-shot split (only these are read).",
    )
    shots_seed: int = Field(
        1, ge=0, description="Seed of the few-shot draw (CoOp's SEED: 1, 2, 3)."
    )


class ShiftConfig(RealConfig):
    image_size: int = Field(
        224, ge=8, le=1024, description="Shorter side resized to this, then a centred square crop."
    )


class _ImageNetFamily(RealDataset):
    """Shared layout: `<root>/<folder>/<image_dir>` of class folders + `<folder>/classnames.txt`."""

    folder: ClassVar[str]
    image_dir: ClassVar[str]
    num_classes: ClassVar[int]
    test_size: ClassVar[int]
    images_from: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "images_from" not in vars(cls):  # an abstract layer (`_Shift`)
            return
        cls.hint = (
            f"put {cls.images_from} at <root>/{cls.folder}/{cls.image_dir}/ and "
            f"{CLASSNAMES_HINT} at <root>/{cls.folder}/{CLASSNAMES} ({COOP_DOCS})"
        )

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / cls.folder

    @classmethod
    def images_root(cls, root: Path) -> Path:
        return cls.raw_dir(root) / cls.image_dir

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        return (cls.raw_dir(root) / CLASSNAMES).is_file() and cls.images_root(root).is_dir()

    @classmethod
    def classes(cls, root: Path) -> tuple[list[str], list[str]]:
        """(folder of each label, class name of each label), CoOp's numbering."""
        names = read_classnames(cls.raw_dir(root) / CLASSNAMES)
        folders = class_folders(cls.images_root(root))
        unknown = [f for f in folders if f not in names]
        if unknown:
            raise FpbenchError(
                f"{cls.name}: folders {unknown[:3]} under {cls.images_root(root)} are not in "
                f"{cls.raw_dir(root) / CLASSNAMES}"
            )
        return folders, [names[f] for f in folders]

    @classmethod
    def _decode(
        cls, per_class: list[list[Path]], keep: list[int] | None, cfg, progress, what: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        files = [f for items in per_class for f in items]
        labels = [y for y, items in enumerate(per_class) for _ in items]
        if keep is not None:
            files, labels = [files[i] for i in keep], [labels[i] for i in keep]
        images = decode_images(files, cfg.image_size, progress, what, crop=True)
        return images, torch.tensor(labels, dtype=torch.int64)


class _Shift(_ImageNetFamily):
    """A test-only ImageNet shift: every image is test, the train split is empty."""

    Config = ShiftConfig

    @classmethod
    def info(cls, cfg: ShiftConfig) -> DatasetInfo:
        return DatasetInfo(
            cls.num_classes, 1, has_coarse=False, train_size=0, test_size=cls.test_size,
            image_size=cfg.image_size, sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: ShiftConfig, root: Path, progress: Progress) -> ImageDataset:
        folders, names = cls.classes(root)
        base = cls.images_root(root)
        per_class = [image_list(base / f) for f in folders]
        images, labels = cls._decode(per_class, None, cfg, progress, f"{cls.name} test")
        empty = torch.zeros(0, 3, cfg.image_size, cfg.image_size, dtype=torch.uint8)
        return ImageDataset(
            name=cls.name,
            train_images=empty,
            train_labels=torch.zeros(0, dtype=torch.int64),
            test_images=images,
            test_labels=labels,
            class_names=names,
        )


@DATASETS.register()
class ImageNet(_ImageNetFamily):
    """ImageNet ILSVRC-2012 (CoOp layout): 1,000 classes; `shots` train images a class (CoOp's
    few-shot draw, only those read), the 50,000 val images as test."""

    name = "imagenet"
    folder, image_dir = "imagenet", "images"
    num_classes, test_size = 1000, 50_000
    images_from = "ILSVRC-2012's train/ and val/ (val sorted into wnid folders, as CoOp's)"
    Config = ImageNetConfig

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        images = cls.images_root(root)
        return (cls.raw_dir(root) / CLASSNAMES).is_file() and all(
            (images / s).is_dir() for s in ("train", "val")
        )

    @classmethod
    def classes(cls, root: Path) -> tuple[list[str], list[str]]:
        names = read_classnames(cls.raw_dir(root) / CLASSNAMES)
        folders = class_folders(cls.images_root(root) / "train")
        if folders != sorted(names):
            missing = sorted(set(names) - set(folders))[:3]
            extra = sorted(set(folders) - set(names))[:3]
            raise FpbenchError(
                f"imagenet: the train folders must be the {len(names)} wnids of "
                f"{cls.raw_dir(root) / CLASSNAMES} (missing {missing}, unknown {extra})"
            )
        return folders, [names[f] for f in folders]

    @classmethod
    def info(cls, cfg: ImageNetConfig) -> DatasetInfo:
        return DatasetInfo(
            cls.num_classes, 1, has_coarse=False, train_size=cls.num_classes * cfg.shots,
            test_size=cls.test_size, image_size=cfg.image_size, sizes_exact=False,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: ImageNetConfig, root: Path, progress: Progress) -> ImageDataset:
        folders, names = cls.classes(root)
        base = cls.images_root(root)
        train = [image_list(base / "train" / f) for f in folders]
        keep = coop_fewshot(train, cfg.shots, cfg.shots_seed)
        test = []
        for f in folders:
            if not (base / "val" / f).is_dir():
                raise FpbenchError(
                    f"imagenet: no val folder {base / 'val' / f}: CoOp's layout sorts the val "
                    "images into one folder per wnid"
                )
            test.append(image_list(base / "val" / f))
        train_x, train_y = cls._decode(train, keep, cfg, progress, f"imagenet {cfg.shots}-shot")
        test_x, test_y = cls._decode(test, None, cfg, progress, "imagenet val")
        return ImageDataset(
            name=cls.name,
            train_images=train_x,
            train_labels=train_y,
            test_images=test_x,
            test_labels=test_y,
            class_names=names,
        )


@DATASETS.register()
class ImageNetV2(_Shift):
    """ImageNet-V2 matched frequency (test only): 1,000 classes, 10,000 images."""

    name = "imagenet-v2"
    folder, image_dir = "imagenetv2", "imagenetv2-matched-frequency-format-val"
    num_classes, test_size = 1000, 10_000
    images_from = "imagenetv2-matched-frequency.tar.gz (github.com/modestyachts/ImageNetV2)"

    @classmethod
    def classes(cls, root: Path) -> tuple[list[str], list[str]]:
        """Folders are named by label 0..999; names in classnames.txt's order (CoOp's)."""
        names = list(read_classnames(cls.raw_dir(root) / CLASSNAMES).values())
        folders = [str(k) for k in range(len(names))]
        absent = [f for f in folders if not (cls.images_root(root) / f).is_dir()]
        if absent:
            raise FpbenchError(
                f"imagenet-v2: no label folders {absent[:3]} under {cls.images_root(root)}"
            )
        return folders, names


@DATASETS.register()
class ImageNetSketch(_Shift):
    """ImageNet-Sketch (test only): 1,000 classes, 50,889 images."""

    name = "imagenet-sketch"
    folder, image_dir = "imagenet-sketch", "images"
    num_classes, test_size = 1000, 50_889
    images_from = "ImageNet-Sketch's class folders (github.com/HaohanWang/ImageNet-Sketch)"


@DATASETS.register()
class ImageNetA(_Shift):
    """ImageNet-A (test only): 200 of ImageNet's classes, numbered 0..199, 7,500 images."""

    name = "imagenet-a"
    folder, image_dir = "imagenet-adversarial", "imagenet-a"
    num_classes, test_size = 200, 7_500
    images_from = "imagenet-a.tar (github.com/hendrycks/natural-adv-examples)"


@DATASETS.register()
class ImageNetR(_Shift):
    """ImageNet-R (test only): 200 of ImageNet's classes, numbered 0..199, 30,000 images."""

    name = "imagenet-r"
    folder, image_dir = "imagenet-rendition", "imagenet-r"
    num_classes, test_size = 200, 30_000
    images_from = "imagenet-r.tar (github.com/hendrycks/imagenet-r)"
