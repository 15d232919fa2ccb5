"""CoCoOp: the meta-net shift by hand, each image's own prompts, and the official defaults."""

from __future__ import annotations

import pytest
import torch

from fpbench.methods.base import Context
from fpbench.methods.cocoop import CoCoOpConfig
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server
from tests.methods.common import features_as_images


def test_defaults_are_the_official_config():
    cfg = CoCoOpConfig()
    assert (cfg.n_ctx, cfg.ctx_init, cfg.reduction) == (4, "a photo of a", 16)


def test_parameters_and_meta_net_shift_by_hand(tiny):
    _, _, method = tiny("cocoop")
    p = seeded_server(method).params
    shapes = {k: tuple(v.shape) for k, v in p.items()}
    assert shapes == {"ctx": (4, 32), "meta_w1": (2, 32), "meta_b1": (2,),
                      "meta_w2": (32, 2), "meta_b2": (32,)}  # fmt: skip
    w1 = torch.tensor([[[1.0, -1.0], [0.5, 0.5]]])  # (K=1, h=2, E=2)
    b1 = torch.tensor([[0.0, -2.0]])
    w2 = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]])  # (K=1, d=3, h=2)
    b2 = torch.tensor([[0.1, 0.2, 0.3]])
    feats = torch.tensor([[2.0, 1.0], [1.0, 3.0]])
    params = {"meta_w1": w1, "meta_b1": b1, "meta_w2": w2, "meta_b2": b2}
    out = method.shift(params, feats, torch.zeros(2, dtype=torch.long))
    # image 0: h = relu([1, 1.5 - 2]) = [1, 0] -> [1, 3, 0] + b2
    # image 1: h = relu([-2, 2 - 2]) = [0, 0] -> b2
    torch.testing.assert_close(out, torch.tensor([[1.1, 3.2, 0.3], [0.1, 0.2, 0.3]]))


def test_each_image_is_scored_with_its_own_shifted_prompts(tiny, monkeypatch):
    _, _, method = tiny("cocoop")
    features_as_images(monkeypatch, method)  # x: image features
    p = seeded_server(method).params
    k2 = {k: torch.stack([v, v * 1.5]) for k, v in p.items()}  # two clients' rows
    feats = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    rows = torch.tensor([0, 1, 1])
    got = method.forward(k2, feats, rows, Context(training=True))
    scale = method.backbone.logit_scale
    for b in range(3):  # one image at a time: CoOp's text features of ctx + pi(f)
        r = rows[b]
        f = torch.nn.functional.normalize(feats[b], dim=-1)
        h = torch.relu(k2["meta_w1"][r] @ f + k2["meta_b1"][r])
        bias = k2["meta_w2"][r] @ h + k2["meta_b2"][r]
        text = method.text_features((k2["ctx"][r] + bias).unsqueeze(0))[0]  # (C, E)
        torch.testing.assert_close(got[b], scale * text @ f, atol=1e-4, rtol=1e-5)
    # a meta-net that outputs zero: CoOp's (PromptFL's) logits of the same context
    zero = {
        **k2,
        "meta_w2": torch.zeros_like(k2["meta_w2"]),
        "meta_b2": torch.zeros_like(k2["meta_b2"]),
    }
    coop = method.logits(method.image_features(feats), method.text_features(k2["ctx"]), rows)
    torch.testing.assert_close(method.forward(zero, feats, rows, Context(False)), coop)


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestCoCoOpConformance(MethodConformance):
    method = "cocoop"
