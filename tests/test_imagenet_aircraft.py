"""ImageNet, its four shifts and FGVC-Aircraft, read from miniature files in their native
layouts (CoOp's DATASETS.md): labels, class names, CoOp's few-shot draw, and clear errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from PIL import Image

from fpbench.data import imagenet as inet
from fpbench.data.aircraft import FGVCAircraft
from fpbench.data.prepared import PREPARED_DIR
from fpbench.errors import FpbenchError
from fpbench.registry import DATASETS

WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361"]  # sorted, as ImageNet's
NAMES = ["tench", "goldfish", "great white shark", "tiger shark"]


def write_image(path: Path, value: int, size: tuple[int, int] = (16, 12)) -> None:
    """A flat image whose red channel encodes `value` (8 levels apart, survives JPEG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (8 * value + 20, 90, 30)).save(path, quality=98)


def red(x: torch.Tensor) -> list[int]:
    return [round((float(v) - 20) / 8) for v in x[:, 0].float().mean(dim=(1, 2))]


def write_classnames(folder: Path, wnids=WNIDS, names=NAMES) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "classnames.txt").write_text(
        "".join(f"{w} {n}\n" for w, n in zip(wnids, names, strict=True))
    )


def write_imagenet(root: Path, per_train=(5, 3, 6, 2), per_val=2) -> None:
    base = root / "imagenet"
    write_classnames(base)
    for k, w in enumerate(WNIDS):
        for i in range(per_train[k]):  # red = 10 k + i: class and index recoverable
            write_image(base / "images" / "train" / w / f"{w}_{i:04d}.JPEG", 3 * k + i)
        for i in range(per_val):
            write_image(base / "images" / "val" / w / f"ILSVRC2012_val_{k}{i}.JPEG", 3 * k + i)


def test_coop_fewshot_draw_is_dassls_rule() -> None:
    """random.sample per label in label order from one Random(seed); a short class whole."""
    per_class = [list("abcde"), list("xyz"), list("pqrstu")]
    got = inet.coop_fewshot(per_class, shots=4, seed=3)
    rng = random.Random(3)
    want = (
        [i for i in rng.sample(range(5), 4)] + [5, 6, 7] + [8 + i for i in rng.sample(range(6), 4)]
    )
    assert got == want
    assert inet.coop_fewshot(per_class, 4, 3) == got and inet.coop_fewshot(per_class, 4, 4) != got


def test_imagenet_reads_only_the_sampled_train_images(tmp_path, monkeypatch) -> None:
    write_imagenet(tmp_path)
    opened: list[Path] = []
    real = inet.decode_images

    def spy(files, *a, **k):
        opened.extend(files)
        return real(files, *a, **k)

    monkeypatch.setattr(inet, "decode_images", spy)
    cfg = inet.ImageNet.Config(image_size=8, shots=2, shots_seed=1)
    data = inet.ImageNet.load(cfg, tmp_path)
    assert DATASETS.get("imagenet") is inet.ImageNet
    assert data.class_names == NAMES and data.num_classes == 4
    assert data.train_labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    per_class = [
        [f"{w}_{i:04d}" for i in range(n)] for w, n in zip(WNIDS, (5, 3, 6, 2), strict=True)
    ]
    keep = inet.coop_fewshot(per_class, 2, 1)
    flat = [i for k, n in enumerate((5, 3, 6, 2)) for i in [3 * k + j for j in range(n)]]
    assert red(data.train_images) == [flat[i] for i in keep]  # the drawn images, in draw order
    train_opened = [p for p in opened if "train" in p.parts]
    assert len(train_opened) == 8  # of 16 train files, only the 8 drawn were decoded
    assert data.test_labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert red(data.test_images) == [0, 1, 3, 4, 6, 7, 9, 10]
    other = inet.ImageNet.load(inet.ImageNet.Config(image_size=8, shots=2, shots_seed=2), tmp_path)
    assert red(other.train_images) != red(data.train_images)  # another seed, another draw
    assert len(list((tmp_path / PREPARED_DIR).glob("imagenet-*.pt"))) == 2
    assert (
        inet.ImageNet.info(cfg).train_size == 2000 and inet.ImageNet.info(cfg).test_size == 50_000
    )


def test_imagenet_errors_say_what_is_missing(tmp_path) -> None:
    with pytest.raises(FpbenchError) as e:
        inet.ImageNet.load(inet.ImageNet.Config(), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "classnames.txt" in msg and "images/" in msg and "CoOp" in msg
    write_imagenet(tmp_path)
    (tmp_path / "imagenet" / "classnames.txt").write_text("n01440764 tench\n")
    with pytest.raises(FpbenchError, match=r"unknown \['n01443537'"):
        inet.ImageNet.load(inet.ImageNet.Config(image_size=8), tmp_path)
    write_classnames(tmp_path / "imagenet")
    for f in (tmp_path / "imagenet" / "images" / "val" / WNIDS[1]).iterdir():
        f.unlink()
    (tmp_path / "imagenet" / "images" / "val" / WNIDS[1]).rmdir()
    with pytest.raises(FpbenchError, match="one folder per wnid"):
        inet.ImageNet.load(inet.ImageNet.Config(image_size=8), tmp_path)
    assert not (tmp_path / PREPARED_DIR).exists()


@pytest.mark.parametrize("cls", [inet.ImageNetSketch, inet.ImageNetA, inet.ImageNetR])
def test_shift_with_wnid_folders(cls, tmp_path) -> None:
    """Sorted wnid folders numbered from 0 (A and R: a subset of ImageNet's classes)."""
    write_classnames(tmp_path / cls.folder)
    subset = WNIDS[1:] if cls in (inet.ImageNetA, inet.ImageNetR) else WNIDS
    for w in reversed(subset):  # written in reverse: numbering is by sorted name
        for i in range(2):
            write_image(cls.images_root(tmp_path) / w / f"{i}.jpg", 10 * WNIDS.index(w) // 3 + i)
    (cls.images_root(tmp_path) / "README.txt").write_text("not an image folder")
    data = cls.load(cls.Config(image_size=8), tmp_path)
    assert data.class_names == [NAMES[WNIDS.index(w)] for w in subset]
    assert data.test_labels.tolist() == [k for k in range(len(subset)) for _ in range(2)]
    assert red(data.test_images) == [10 * WNIDS.index(w) // 3 + i for w in subset for i in range(2)]
    assert data.train_images.shape == (0, 3, 8, 8) and data.train_labels.numel() == 0
    assert cls.info(cls.Config()).train_size == 0


def test_imagenet_v2_label_folders(tmp_path) -> None:
    cls = inet.ImageNetV2
    write_classnames(tmp_path / cls.folder)
    for k in range(4):
        write_image(cls.images_root(tmp_path) / str(k) / "a.jpeg", 2 * k)
    data = cls.load(cls.Config(image_size=8), tmp_path)
    assert data.class_names == NAMES and data.test_labels.tolist() == [0, 1, 2, 3]
    assert red(data.test_images) == [0, 2, 4, 6]
    (cls.images_root(tmp_path) / "3" / "a.jpeg").unlink()
    (cls.images_root(tmp_path) / "3").rmdir()
    with pytest.raises(FpbenchError, match=r"no label folders \['3'\]"):
        cls.load(cls.Config(image_size=16), tmp_path)


def test_a_run_cannot_train_on_a_shift() -> None:
    from fpbench.suites import expand_suite

    with pytest.raises(FpbenchError, match="test-only.*evaluation.targets"):
        expand_suite(
            {
                "name": "x",
                "datasets": [{"name": "imagenet-a"}],
                "partitions": [{"name": "iid", "num_clients": 2}],
                "methods": [{"name": "promptfl"}],
                "defaults": {"backbone": {"name": "clip-vit-b16"}},
            },
            name="x",
        )


def test_fgvc_aircraft_variant_lists(tmp_path) -> None:
    d = tmp_path / "fgvc_aircraft"
    variants = ["707-320", "A340-500", "Cessna 172"]
    d.mkdir()
    (d / "variants.txt").write_text("\n".join(variants) + "\n")
    rows = {
        "train": [(1001, 2), (1002, 0), (1003, 1)],
        "val": [(2001, 1)],
        "test": [(3001, 0), (3002, 2)],
    }
    for split, items in rows.items():
        (d / f"images_variant_{split}.txt").write_text(
            "".join(f"{i:07d} {variants[y]}\n" for i, y in items)
        )
        for i, y in items:
            write_image(d / "images" / f"{i:07d}.jpg", 3 * y + (i % 2))
    data = FGVCAircraft.load(FGVCAircraft.Config(image_size=8), tmp_path)
    assert data.class_names == variants
    assert data.train_labels.tolist() == [2, 0, 1] and data.test_labels.tolist() == [0, 2]
    assert red(data.train_images) == [7, 0, 4] and red(data.test_images) == [1, 6]
    more = FGVCAircraft.load(FGVCAircraft.Config(image_size=8, val_in_train=True), tmp_path)
    assert more.train_labels.tolist() == [2, 0, 1, 1]
    (d / "images_variant_test.txt").write_text("3001 747-400\n")
    with pytest.raises(FpbenchError, match="variant '747-400' is not in variants.txt"):
        FGVCAircraft.load(FGVCAircraft.Config(image_size=16), tmp_path)
