"""On-device augmentation: the flip and rotation themselves, their seeded draws, the executors."""

from __future__ import annotations

import pytest
import torch

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
