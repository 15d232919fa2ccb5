"""Random resized crop (CoOp / Dassl's RandomResizedCrop) on the device: torchvision's box rule
on hand-checked draws, torchvision's resize of the box, its place before the flip, the same
views in both executors and after a resume, and features computed from each view, never from
the frozen store of the un-augmented images."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import torchvision.transforms.functional as tvf
from pydantic import ValidationError
from torchvision.transforms import InterpolationMode

from fpbench.engine.augment import CROP_TRIES, augment, crop_boxes, draws_needed, resized_crops
from fpbench.engine.executor import train_clients
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.engine.runner import run_cell
from fpbench.specs import Augment
from fpbench.store import Store
from tests.conftest import Crash, CrashAfter, tiny_config

MEAN, STD = (0.5, 0.25, 0.0), (0.5, 0.5, 1.0)
DEFAULT = ((0.08, 1.0), (3 / 4, 4 / 3))


def _draws(*attempts: tuple[float, float], top: float = 0.0, left: float = 0.0) -> torch.Tensor:
    """One sample's crop draws: the given attempts, the rest repeating the last, then the box's
    position draws."""
    pairs = list(attempts) + [attempts[-1]] * (CROP_TRIES - len(attempts))
    return torch.tensor([[v for p in pairs for v in p] + [top, left]])


def test_a_sample_takes_flip_rotation_and_crop_draws():
    assert draws_needed(Augment(hflip=True)) == 2
    assert draws_needed(Augment(crop=True)) == 2 + 2 * CROP_TRIES + 2


def test_box_by_hand_area_aspect_and_position():
    """100 x 100, area share 0.08 + 0.92 * 0.5 = 0.54 -> 5400 px, aspect exp(0) = 1 (the middle
    of log 3/4 .. log 4/3): w = h = round(73.48) = 73; top = floor(0.5 * 28) = 14, left =
    floor(0.25 * 28) = 7."""
    box = crop_boxes(_draws((0.5, 0.5), top=0.5, left=0.25), 100, 100, *DEFAULT)
    assert box.tolist() == [[14, 7, 73, 73]]


def test_the_first_box_that_fits_is_taken():
    """Attempt 0: the whole area at aspect 4/3 gives w = round(11.55) = 12 > 10, rejected;
    attempt 1: area 8 at aspect 1 gives w = h = round(2.83) = 3; top = floor(0.999 * 8) = 7."""
    box = crop_boxes(_draws((1.0 - 1e-9, 1.0 - 1e-9), (0.0, 0.5), top=0.999), 10, 10, *DEFAULT)
    assert box.tolist() == [[7, 0, 3, 3]]


def test_without_a_fitting_box_the_centre_clamped_to_the_ratio():
    """Aspect 2 at full area never fits a square: the fallback box is the full width and
    round(10 / 2) = 5 rows, centred (top (10 - 5) // 2 = 2)."""
    box = crop_boxes(_draws((0.3, 0.7)), 10, 10, (1.0, 1.0), (2.0, 2.0))
    assert box.tolist() == [[2, 0, 5, 10]]
    box = crop_boxes(_draws((0.3, 0.7)), 10, 10, (1.0, 1.0), (1.0, 1.0))
    assert box.tolist() == [[0, 0, 10, 10]]


def test_boxes_stay_inside_and_spread_over_the_scale_range():
    u = torch.rand(4000, 2 * CROP_TRIES + 2, generator=torch.Generator().manual_seed(0))
    top, left, h, w = crop_boxes(u, 32, 24, *DEFAULT).T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 32).all()
    assert (left + w <= 24).all() and (h > 0).all() and (w > 0).all()
    share = (h * w).double() / (32 * 24)
    assert share.min() < 0.12 and share.max() > 0.9


def test_the_box_is_resized_as_torchvision_resizes_it():
    x = torch.rand(2, 3, 12, 12, generator=torch.Generator().manual_seed(1))
    boxes = torch.tensor([[1, 2, 5, 7], [0, 0, 12, 12]])
    out = resized_crops(x, boxes)
    for img, got, (t, left, h, w) in zip(x, out, boxes.tolist(), strict=True):
        want = tvf.resized_crop(img, t, left, h, w, [12, 12], InterpolationMode.BICUBIC,
                                antialias=False)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(out[1], x[1])  # the whole image at its own size is itself


def test_crop_then_flip_and_the_pixel_range_clamp():
    x = torch.rand(1, 3, 12, 12, generator=torch.Generator().manual_seed(2))
    x = (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    u = torch.cat([torch.tensor([[0.1, 0.0]]), _draws((0.2, 0.6), top=0.3, left=0.8)], 1)
    out = augment(x, Augment(crop=True, hflip=True), u, MEAN, STD)
    box = crop_boxes(u[:, 2:], 12, 12, *DEFAULT)
    lo = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1)
    hi = ((1 - torch.tensor(MEAN)) / torch.tensor(STD)).view(1, 3, 1, 1)
    want = resized_crops(x, box).clamp(lo, hi).flip(-1)  # u[:, 0] = 0.1 < 0.5: flipped
    assert torch.equal(out, want)
    assert not torch.equal(want, resized_crops(x, box).flip(-1))  # bicubic overshoot clamped


def test_crop_settings_are_checked_and_dumped_only_with_the_crop_on():
    assert Augment().model_dump(mode="json") == {"hflip": False, "rotate": 0.0}
    on = Augment(crop=True, hflip=True).model_dump(mode="json")
    assert on == {"hflip": True, "rotate": 0.0, "crop": True, "crop_scale": [0.08, 1.0],
                  "crop_ratio": [0.75, 4 / 3]}  # fmt: skip
    assert Augment.model_validate(on) == Augment(crop=True, hflip=True)
    for bad in ({"crop_scale": (0.5, 0.2)}, {"crop_scale": (0.0, 1.0)}, {"crop_ratio": (0, 1)}):
        with pytest.raises(ValidationError, match="augment.crop_"):
            Augment(crop=True, **bad)


def test_run_keys_without_the_crop_stay_and_with_it_change(tiny):
    cfg, _, _ = tiny("fedvpt", augment={"hflip": True})
    assert cfg.identity()["train"]["augment"] == {"hflip": True, "rotate": 0.0}
    on, _, _ = tiny("fedvpt", augment={"hflip": True, "crop": True})
    assert on.identity()["train"]["augment"]["crop"] is True and on.run_key != cfg.run_key


@pytest.mark.parametrize("method", ["fedvpt", "promptfl"])
def test_cropped_training_is_the_same_in_both_executors_and_differs_from_plain(tiny, method):
    cfg, task, m = tiny(method, local_epochs=2)
    server = m.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()
    crop = cfg.train.model_copy(update={"augment": Augment(crop=True, hflip=True)})
    kw = dict(round_idx=1, seed=0)
    lock = train_clients(m, server, task, ids, crop, executor="lockstep", **kw)
    ref = train_clients(m, server, task, ids, crop, executor="reference", **kw)
    plain = train_clients(m, server, task, ids, cfg.train, **kw)
    for name in lock.params:
        torch.testing.assert_close(lock.params[name], ref.params[name], rtol=1e-4, atol=2e-5)
    assert any(not torch.allclose(lock.params[n], plain.params[n]) for n in lock.params)


def test_cropped_views_never_read_the_frozen_store(tiny):
    """PromptFL's image features are frozen work: without augmentation the store serves them.
    With the crop, a run with the store trains exactly as one without it; had the store's
    un-augmented features been used, the two would differ (and the stored run would train as
    the plain one does)."""
    cfg, task, m = tiny("promptfl", local_epochs=2)
    server = m.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()
    crop = cfg.train.model_copy(update={"augment": Augment(crop=True)})
    stored = Inputs.of(m, task, FeatureCache(), batch_size=16)
    runs = {
        (aug, name): train_clients(
            m, server, task, ids, train, round_idx=0, seed=0, inputs=inputs
        ).params
        for aug, train in (("crop", crop), ("plain", cfg.train))
        for name, inputs in (("stored", stored), ("fresh", Inputs.of(m, task)))
    }
    for n in runs["crop", "fresh"]:
        assert torch.equal(runs["crop", "stored"][n], runs["crop", "fresh"][n])
        torch.testing.assert_close(runs["plain", "stored"][n], runs["plain", "fresh"][n])
    assert stored.splits  # the store served the plain run
    assert any(
        not torch.allclose(runs["crop", "stored"][n], runs["plain", "stored"][n])
        for n in runs["crop", "fresh"]
    )


def _table(store: Store) -> pd.DataFrame:
    m = store.metrics(aggregate_only=False)
    return m.sort_values(["round", "client_id", "name"], na_position="first").reset_index(drop=True)


def test_a_resumed_cropped_run_sees_the_same_views(tmp_path):
    cfg = tiny_config(rounds=3, augment={"crop": True, "hflip": True})
    whole = Store(f"sqlite:///{tmp_path / 'whole.db'}")
    assert run_cell(cfg, whole, checkpoint_dir=tmp_path / "ck1").status == "done"
    split = Store(f"sqlite:///{tmp_path / 'split.db'}")
    with pytest.raises(Crash):
        run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2", observer=CrashAfter(1))
    assert run_cell(cfg, split, checkpoint_dir=tmp_path / "ck2").status == "done"
    a, b = _table(whole), _table(split)
    pd.testing.assert_frame_equal(a.drop(columns="run_id"), b.drop(columns="run_id"))
    plain = Store(f"sqlite:///{tmp_path / 'plain.db'}")
    run_cell(tiny_config(rounds=3), plain, checkpoint_dir=tmp_path / "ck3")
    assert not _table(plain)["value"].equals(a["value"])
