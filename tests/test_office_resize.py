"""Office31 / OfficeHome resize rule (`resize`): squashed to the square (PIL bilinear, the
default and its prepared-cache key unchanged) or CLIP's bicubic shorter-side resize and centre
crop, on banded images whose centre holds the class colour."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from PIL import Image

from fpbench.data.office import Office31
from fpbench.data.prepared import FORMAT, config_key, square_crop
from tests.test_clip_datasets import colour, write_banded

DIRS = ["office31/amazon", "office31/dslr", "office31/webcam"]


def _write(root) -> None:
    for domain in DIRS:
        for k, c in enumerate(Office31.classes[:2]):
            for i in range(3):
                write_banded(root / domain / c / f"img{i}.png", k)


@pytest.mark.parametrize("resize", ["squash", "crop"])
def test_office_images_by_the_resize_rule(resize, tmp_path) -> None:
    _write(tmp_path)
    data = Office31.load(Office31.Config(image_size=12, resize=resize), tmp_path)
    img = np.asarray(data.train_images[0].permute(1, 2, 0))  # (12, 12, 3)
    k = int(data.train_labels[0])
    src = Image.open(tmp_path / DIRS[0] / Office31.classes[k] / "img0.png").convert("RGB")
    if resize == "crop":  # 24 x 12 -> shorter side 12 already: the centred 12 x 12, all colour
        assert np.array_equal(img, np.asarray(square_crop(src, 12)))
        assert (img == np.asarray(colour(k), dtype=np.uint8)).all()
    else:  # squashed: the black and white bands stay at the sides
        assert np.array_equal(img, np.asarray(src.resize((12, 12), Image.BILINEAR)))
        assert img[:, 0].max() < 40 and img[:, -1].min() > 215


def test_the_default_keeps_the_prepared_key_and_crop_gets_its_own() -> None:
    old = '{"image_size":224,"test_fraction":0.2,"seed":0}'  # the config before `resize`
    want = hashlib.sha256(f"{FORMAT}:{old}".encode()).hexdigest()[:10]
    assert config_key(Office31.Config()) == want == config_key(Office31.Config(resize="squash"))
    assert config_key(Office31.Config(resize="crop")) != want
