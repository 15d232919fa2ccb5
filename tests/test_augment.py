"""On-device augmentation: the flip and rotation themselves, their seeded draws, the executors."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.functional as tvf
from torchvision.transforms import InterpolationMode

from fpbench.engine.augment import augment, uniforms
from fpbench.engine.executor import train_clients
from fpbench.specs import Augment

MEAN, STD = (0.5, 0.25, 0.0), (0.5, 0.5, 1.0)


def _images(b: int = 3, s: int = 8) -> torch.Tensor:
    return torch.randn(b, 3, s, s, generator=torch.Generator().manual_seed(0))


def test_flip_follows_the_draws():
    x = _images()
    u = torch.tensor([[0.1, 0.5], [0.9, 0.5], [0.49, 0.5]])
    out = augment(x, Augment(hflip=True), u, MEAN, STD)
    assert torch.equal(out[0], x[0].flip(-1)) and torch.equal(out[2], x[2].flip(-1))
    assert torch.equal(out[1], x[1])


def test_rotation_by_90_degrees_is_rot90_and_by_0_is_identity():
    x = _images()
    u = torch.tensor([[0.9, 1.0], [0.9, 0.5], [0.9, 0.0]])  # +90, 0, -90 degrees
    out = augment(x, Augment(rotate=90), u, MEAN, STD)
    assert torch.equal(out[1], x[1])
    k = 1 if torch.equal(out[0], torch.rot90(x[0], 1, (-2, -1))) else 3  # either direction
    assert torch.equal(out[0], torch.rot90(x[0], k, (-2, -1)))
    assert torch.equal(out[2], torch.rot90(x[2], 4 - k, (-2, -1)))  # the opposite one


def test_rotation_fills_corners_with_black():
    x = _images(1, 16)
    out = augment(x, Augment(rotate=45), torch.tensor([[0.9, 1.0]]), MEAN, STD)
    black = -torch.tensor(MEAN) / torch.tensor(STD)
    torch.testing.assert_close(out[0, :, 0, 0], black)
    torch.testing.assert_close(out[0, :, -1, -1], black)
    assert torch.equal(out[0, :, 8, 8], x[0, :, 8, 8]) or torch.equal(
        out[0, :, 7, 7], x[0, :, 7, 7]
    )  # the centre stays


def test_draws_are_seeded_by_seed_and_index_and_spread():
    idx = torch.arange(20_000)
    u = uniforms(torch.full_like(idx, 12345), idx, 2)
    assert torch.equal(u, uniforms(torch.full_like(idx, 12345), idx, 2))
    assert not torch.equal(u, uniforms(torch.full_like(idx, 12346), idx, 2))
    assert torch.equal(u[5:10], uniforms(torch.full((5,), 12345), idx[5:10], 2))  # per sample
    assert ((u >= 0) & (u < 1)).all()
    assert u.mean(0).sub(0.5).abs().max() < 0.01  # ~uniform
    assert abs((u[:, 0] < 0.5).float().mean().item() - 0.5) < 0.01
    assert abs(torch.corrcoef(u.T)[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(torch.stack([u[:-1, 0], u[1:, 0]]))[0, 1].item()) < 0.02


@pytest.mark.parametrize("method", ["fedvpt", "head-tune"])
def test_augmented_training_is_the_same_in_both_executors_and_differs_from_plain(tiny, method):
    cfg, task, m = tiny(method, local_epochs=2)
    server = m.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()
    aug = cfg.train.model_copy(update={"augment": Augment(hflip=True, rotate=30)})
    kw = dict(round_idx=1, seed=0)
    lock = train_clients(m, server, task, ids, aug, executor="lockstep", **kw)
    ref = train_clients(m, server, task, ids, aug, executor="reference", **kw)
    plain = train_clients(m, server, task, ids, cfg.train, **kw)
    for name in lock.params:
        torch.testing.assert_close(lock.params[name], ref.params[name], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(lock.params[n], plain.params[n]) for n in lock.params)


def test_augment_is_left_out_of_run_keys_at_its_default(tiny):
    cfg, _, _ = tiny("fedvpt")
    assert "augment" not in cfg.identity()["train"]
    on = cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"augment": Augment(hflip=True)})}
    )
    assert on.identity()["train"]["augment"] == {"hflip": True, "rotate": 0.0}
    assert on.run_key != cfg.run_key


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32, written out on Python ints (the published constants)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_draws_are_lowbias32_of_seed_index_and_draw_number():
    """Draw j of a sample is lowbias32(base + (j + 1) * 0x9E3779B9) / 2**32 with base =
    lowbias32(lowbias32(seed) ^ index), on the low 32 bits of seed and index: a stored run's
    views depend on these constants, so any change to them shows here."""
    seeds = [0, 7, 2**32 + 7, 2**40 + 12345, 987654321]
    idx = [0, 3, 3, 2**33 + 1, 123456]
    got = uniforms(torch.tensor(seeds), torch.tensor(idx), 3)
    for row, (s, i) in enumerate(zip(seeds, idx, strict=True)):
        base = _lowbias32(_lowbias32(s % 2**32) ^ (i % 2**32))
        want = [_lowbias32((base + (j + 1) * 0x9E3779B9) % 2**32) / 2**32 for j in range(3)]
        assert got[row].tolist() == pytest.approx(want, abs=2**-24)
    assert torch.equal(got[1], got[2])  # only the seed's low 32 bits count


def _unmix(y: int) -> int:
    """The inverse of `_lowbias32`."""
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 2**32)) % 2**32
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 2**32)) % 2**32
    return y ^ (y >> 16)


def test_a_draw_at_the_top_of_the_hash_stays_below_one():
    """The sample whose first draw hashes to 2**32 - 1 (found by inverting the hash) gets the
    largest float32 below 1, not 1.0 (which float32 rounding would give): draws are in [0, 1)."""
    base = (_unmix(2**32 - 1) - 0x9E3779B9) % 2**32
    idx = _unmix(base)  # seed 0 hashes to 0
    assert _lowbias32((_lowbias32(_lowbias32(0) ^ idx) + 0x9E3779B9) % 2**32) == 2**32 - 1
    u = uniforms(torch.tensor([0]), torch.tensor([idx]), 1)
    assert u.dtype == torch.float32 and u.item() == 1 - 2**-24


def test_flip_probability_is_below_one_half():
    """A draw of exactly 0.5 does not flip: flips are the draws in [0, 0.5)."""
    x = _images(1)
    out = augment(x, Augment(hflip=True), torch.tensor([[0.5, 0.5]]), MEAN, STD)
    assert torch.equal(out, x)


@pytest.mark.parametrize(
    ("rotate", "u", "degrees"), [(30, 1.0, 30), (30, 0.0, -30), (30, 0.75, 15), (1, 1.0, 1)]
)
def test_rotation_is_torchvisions_with_black_fill(rotate, u, degrees):
    """The rotation is torchvision's `rotate` (nearest, no expansion) by (2u - 1) * rotate
    degrees, counter-clockwise, filled with black: what SGPT's `RandomRotation` does.
    A 64-pixel image, so that even 1 degree moves its corner pixels."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out = augment(x, Augment(rotate=rotate), torch.tensor([[0.9, u]] * 2), MEAN, STD)
    black = [-m / s for m, s in zip(MEAN, STD, strict=True)]
    want = tvf.rotate(x, degrees, interpolation=InterpolationMode.NEAREST, fill=black)
    assert not torch.equal(want, x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
