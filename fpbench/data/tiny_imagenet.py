"""Tiny-ImageNet (Le and Yang, 2015): 200 ImageNet classes, 64x64 images.

Native layout (the extracted ``tiny-imagenet-200.zip``)::

    <root>/tiny-imagenet-200/wnids.txt                       200 WordNet ids, one per line
    <root>/tiny-imagenet-200/words.txt                       "<wnid>\\t<names, comma separated>"
    <root>/tiny-imagenet-200/train/<wnid>/images/*.JPEG      500 per class
    <root>/tiny-imagenet-200/val/images/*.JPEG               10,000
    <root>/tiny-imagenet-200/val/val_annotations.txt         "<file>\\t<wnid>\\t<bbox x4>"

The labelled validation split is the test split (the official test split has no labels). Class
order is the order of ``wnids.txt``; class names are the first synonym in ``words.txt``. A few
images are greyscale JPEGs; they are converted to RGB.
"""

from __future__ import annotations

from pathlib import Path

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import (
    Progress,
    RealConfig,
    RealDataset,
    decode_images,
    download_archive,
)
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

FOLDER = "tiny-imagenet-200"
URL = "http://cs231n.stanford.edu/tiny-imagenet-200.zip"
MD5 = "90528d7ca1a48142e341f4ef8d21d0de"


def _wnids(folder: Path) -> list[str]:
    return [w.strip() for w in (folder / "wnids.txt").read_text().splitlines() if w.strip()]


def _class_names(folder: Path, wnids: list[str]) -> list[str]:
    words: dict[str, str] = {}
    if (folder / "words.txt").is_file():
        for line in (folder / "words.txt").read_text().splitlines():
            wnid, _, names = line.partition("\t")
            words[wnid.strip()] = names.split(",")[0].strip()
    return [words.get(w) or w for w in wnids]


def _train_files(folder: Path, wnids: list[str]) -> tuple[list[Path], list[int]]:
    paths, labels = [], []
    for c, wnid in enumerate(wnids):
        files = sorted((folder / "train" / wnid / "images").glob("*.JPEG"))
        paths += files
        labels += [c] * len(files)
    return paths, labels


def _val_files(folder: Path, wnids: list[str]) -> tuple[list[Path], list[int]]:
    index = {w: c for c, w in enumerate(wnids)}
    paths, labels = [], []
    for line in (folder / "val" / "val_annotations.txt").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 2:
            continue
        if parts[1] not in index:
            raise FpbenchError(f"val_annotations.txt: wnid {parts[1]!r} is not in wnids.txt")
        paths.append(folder / "val" / "images" / parts[0])
        labels.append(index[parts[1]])
    return paths, labels


@DATASETS.register()
class TinyImageNet(RealDataset):
    """Tiny-ImageNet: 200 classes, 100,000 train / 10,000 val (used as test) images of 64x64."""

    name = "tiny-imagenet"
    downloadable = True
    hint = f"download {URL} and extract it so that <root>/{FOLDER}/wnids.txt exists"

    class Config(RealConfig):
        pass

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / FOLDER

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        folder = cls.raw_dir(root)
        return (folder / "wnids.txt").is_file() and (folder / "val/val_annotations.txt").is_file()

    @classmethod
    def info(cls, cfg: Config) -> DatasetInfo:
        return DatasetInfo(200, 1, False, train_size=100_000, test_size=10_000, image_size=64)

    @classmethod
    def build(cls, cfg: Config, root: Path, progress: Progress) -> ImageDataset:
        folder = cls.raw_dir(root)
        wnids = _wnids(folder)
        train_paths, train_y = _train_files(folder, wnids)
        val_paths, val_y = _val_files(folder, wnids)
        return ImageDataset(
            name=cls.name,
            train_images=decode_images(train_paths, None, progress, "tiny-imagenet train"),
            train_labels=torch.tensor(train_y, dtype=torch.int64),
            test_images=decode_images(val_paths, None, progress, "tiny-imagenet val"),
            test_labels=torch.tensor(val_y, dtype=torch.int64),
            class_names=_class_names(folder, wnids),
        )

    @classmethod
    def download(cls, root: Path) -> None:
        download_archive(URL, Path(root), MD5)
