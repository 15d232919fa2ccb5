"""FGVC-Aircraft (Maji et al., 2013) at CoOp's level: the 100 variants, with the release's own
train / val / test lists (CoOp `datasets/fgvc_aircraft.py`, DATASETS.md)::

    <root>/fgvc_aircraft/images/<id>.jpg
    <root>/fgvc_aircraft/variants.txt                 one variant name a line: labels in order
    <root>/fgvc_aircraft/images_variant_{train,val,test}.txt   ``<id> <variant name>`` a line

That is the `data/` folder of fgvc-aircraft-2013b.tar.gz renamed `fgvc_aircraft/`. The variant
names are the class names as CoOp keeps them ("707-320", "A340-500"). Images are decoded as
CLIP's test transform sees them (shorter side to `image_size`, bicubic, centred square crop):
CoOp crops nothing off the bottom banner the release leaves on every photo, and nor does fpbench.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from fpbench.data.base import ImageDataset
from fpbench.data.info import DatasetInfo
from fpbench.data.prepared import Progress, RealConfig, RealDataset, decode_images
from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.registry import DATASETS

URL = "https://www.robots.ox.ac.uk/~vgg/data/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz"
SPLITS = {"train": "images_variant_train.txt", "val": "images_variant_val.txt",
          "test": "images_variant_test.txt"}  # fmt: skip


class AircraftConfig(RealConfig):
    image_size: int = Field(
        224, ge=8, le=1024, description="Shorter side resized to this, then a centred square crop."
    )
    val_in_train: bool = Field(False, description="Add the release's val list to train.")


def read_list(path: Path, label_of: dict[str, int]) -> list[tuple[str, int]]:
    """(image id, label) of each ``<id> <variant>`` line of a split list."""
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        image, _, variant = line.strip().partition(" ")
        if variant not in label_of:
            raise FpbenchError(f"{path}:{i}: variant {variant!r} is not in variants.txt")
        rows.append((image, label_of[variant]))
    return rows


@DATASETS.register()
class FGVCAircraft(RealDataset):
    """FGVC-Aircraft variants (CoOp): 100 classes, 3,334 / 3,333 / 3,333 train / val / test."""

    name = "fgvc-aircraft"
    Config = AircraftConfig
    hint = (
        f"extract {URL.rsplit('/', 1)[1]} ({URL}), keep its data/ folder and rename it to "
        "<root>/fgvc_aircraft/ (images/, variants.txt, images_variant_*.txt)"
    )

    @classmethod
    def raw_dir(cls, root: Path) -> Path:
        return Path(root) / "fgvc_aircraft"

    @classmethod
    def raw_present(cls, root: Path) -> bool:
        d = cls.raw_dir(root)
        return (d / "images").is_dir() and all(
            (d / f).is_file() for f in ("variants.txt", *SPLITS.values())
        )

    @classmethod
    def info(cls, cfg: AircraftConfig) -> DatasetInfo:
        return DatasetInfo(
            100, 1, has_coarse=False, train_size=3_334 + 3_333 * cfg.val_in_train,
            test_size=3_333, image_size=cfg.image_size,
        )  # fmt: skip

    @classmethod
    def build(cls, cfg: AircraftConfig, root: Path, progress: Progress) -> ImageDataset:
        d = cls.raw_dir(root)
        names = [n.strip() for n in (d / "variants.txt").read_text().splitlines() if n.strip()]
        label_of = {n: k for k, n in enumerate(names)}
        lists = {s: read_list(d / f, label_of) for s, f in SPLITS.items()}
        parts = {
            "train": lists["train"] + (lists["val"] if cfg.val_in_train else []),
            "test": lists["test"],
        }
        out = {}
        for split, rows in parts.items():
            files = [d / "images" / f"{image}.jpg" for image, _ in rows]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FpbenchError(
                    f"fgvc-aircraft: {len(missing)} images of the {split} list are missing, "
                    f"e.g. {missing[0]}; {cls.hint}"
                )
            images = decode_images(
                files, cfg.image_size, progress, f"fgvc-aircraft {split}", crop=True
            )
            out[split] = (images, torch.tensor([y for _, y in rows], dtype=torch.int64))
        return ImageDataset(
            name=cls.name,
            train_images=out["train"][0],
            train_labels=out["train"][1],
            test_images=out["test"][0],
            test_labels=out["test"][1],
            class_names=names,
        )
