"""vit-smoke's pretraining resumes after an interruption, and its cache is keyed by everything
that decides the weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fpbench.backbones import smoke
from tests.test_vit import TINY_RECIPE

RECIPE = dataclasses.replace(TINY_RECIPE, steps=6)


class _Stop(KeyboardInterrupt):
    pass


def test_an_interrupted_pretraining_resumes_to_the_same_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(smoke, "SAVE_EVERY", 2)
    whole = smoke.pretrain(RECIPE)

    def stop_at_5(step, total, loss):
        if step == 5:
            raise _Stop

    with pytest.raises(_Stop):
        smoke.ensure_pretrained(tmp_path, stop_at_5, RECIPE)
    partial = list(tmp_path.glob("vit-smoke-*.pth.partial"))
    assert len(partial) == 1 and torch.load(partial[0], weights_only=True)["step"] == 4
    assert not list(tmp_path.glob("vit-smoke-*.pth"))
    steps: list[int] = []
    path = smoke.ensure_pretrained(tmp_path, lambda s, n, loss: steps.append(s), RECIPE)
    assert steps == [5, 6]  # resumed after step 4, not from the start
    resumed = torch.load(path, weights_only=True)
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert not partial[0].exists()


def test_an_unreadable_partial_state_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setattr(smoke, "SAVE_EVERY", 2)
    target = tmp_path / f"vit-smoke-{RECIPE.digest()}-{smoke.numerics_digest()}.pth.partial"
    target.write_bytes(b"cut short by a full disk")
    steps: list[int] = []
    path = smoke.ensure_pretrained(tmp_path, lambda s, n, loss: steps.append(s), RECIPE)
    assert steps == [1, 2, 3, 4, 5, 6]
    whole = smoke.pretrain(RECIPE)
    assert all(torch.equal(torch.load(path, weights_only=True)[k], v) for k, v in whole.items())


def test_the_cache_key_covers_threads_kernels_and_versions(tmp_path, monkeypatch):
    base = smoke.numerics()
    assert set(base) == {"threads", "cpu", "torch", "timm", "numpy", "format"}
    assert base["threads"] == torch.get_num_threads() and base["torch"] == torch.__version__
    assert smoke.numerics_digest(1) != smoke.numerics_digest(2)
    path = smoke.ensure_pretrained(tmp_path, None, TINY_RECIPE)
    assert path.name == f"vit-smoke-{TINY_RECIPE.digest()}-{smoke.numerics_digest()}.pth"
    monkeypatch.setattr(smoke, "PRETRAIN_FORMAT", smoke.PRETRAIN_FORMAT + 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    trained: list[int] = []
    other = smoke.ensure_pretrained(tmp_path, lambda s, n, loss: trained.append(s), TINY_RECIPE)
    assert other != path and trained  # trained for these numerics, not reused silently
