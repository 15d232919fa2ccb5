"""Helpers shared by the per-method test files."""

from __future__ import annotations

import torch

from fpbench.engine.executor import LocalResult, train_clients


def stacked_constants(server_params: dict, values: list[float]) -> dict[str, torch.Tensor]:
    """Each server parameter stacked once per value (K = len(values)), filled with it."""
    return {
        k: torch.stack([torch.full_like(v, x) for x in values]) for k, v in server_params.items()
    }


def both_executors_agree(method, task, cfg, server) -> LocalResult:
    """Round 1 of local training under both client executors, checked equal; the lockstep one."""
    ids = task.trainable_clients()
    out = [
        train_clients(method, server, task, ids, cfg.train, round_idx=1, seed=0, executor=e)
        for e in ("reference", "lockstep")
    ]
    for k in out[0].params:
        torch.testing.assert_close(out[1].params[k], out[0].params[k], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[1].loss, out[0].loss, atol=1e-5, rtol=1e-5)
    return out[1]


def assert_presets_are_rows(config_cls, presets: dict, rows: dict) -> None:
    """Every preset of `config_cls` is exactly its paper row written out: the defaults with the
    row's values (and the preset's name) over them, and no preset without a row."""
    assert set(presets) == set(rows)
    defaults = config_cls().model_dump()
    for name, row in rows.items():
        got = config_cls(preset=name).model_dump()
        assert got == {**defaults, **row, "preset": name}, name


def features_as_images(monkeypatch, method) -> None:
    """In this test a forward's x holds CLIP image features (B, E): the unprompted image tower
    passes them through (as the engine's frozen store would hand over kept features)."""
    encode = method.backbone.encode_image
    monkeypatch.setattr(
        method.backbone,
        "encode_image",
        lambda x, pixel_prompt=None: x if pixel_prompt is None else encode(x, pixel_prompt),
    )
