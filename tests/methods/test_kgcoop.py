"""KgCoOp: the knowledge-guided distance by hand, its anchor from open_clip's own towers, and
the aux loss the forward adds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output
from fpbench.methods.kgcoop import KGCOOP_TEMPLATES, KgCoOpConfig, knowledge_distance
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images


def test_distance_by_hand_code_cosine_and_paper_squared_l2():
    text = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # (K=1, C=2, E=2)
    anchor = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    # cos = 1 and 0.8: 1 - 0.9; squared distances 0 and 0.6^2 + 0.2^2 = 0.4: mean 0.2
    torch.testing.assert_close(knowledge_distance(text, anchor), torch.tensor([0.1]))
    torch.testing.assert_close(knowledge_distance(text, anchor, "squared-l2"), torch.tensor([0.2]))


def test_defaults_are_the_official_scripts():
    cfg = KgCoOpConfig()
    assert (cfg.ctx_init, cfg.w, cfg.distance, cfg.class_token_position) == (
        "a photo of a",
        8.0,
        "cosine",
        "end",
    )
    assert KGCOOP_TEMPLATES["dtd"] == "a photo of a {}, a type of texture."
    assert KGCOOP_TEMPLATES["oxford-pets"] == "a photo of a {}, a type of pet."


def test_training_forward_adds_w_times_each_rows_distance_to_the_template(tiny, monkeypatch):
    _, task, method = tiny("kgcoop")
    features_as_images(monkeypatch, method)  # x: image features
    method = with_config(method, w=3.0)
    server = seeded_server(method)
    assert set(server.params) == {"ctx"} and server.params["ctx"].shape[0] == 4  # a photo of a
    ctx = torch.stack([server.params["ctx"], server.params["ctx"] + 0.05])  # K = 2
    feats = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([1, 0, 1])
    out = method.forward({"ctx": ctx}, feats, rows, Context(training=True))
    assert isinstance(out, Output)
    # the anchor by open_clip: "a photo of a {}." (synthetic has no CoOp template)
    model, tok = method.backbone.model, method.backbone.tokenizer
    ids = tok([f"a photo of a {n.replace('_', ' ')}." for n in method.task.class_names], 77)
    with torch.no_grad():
        anchor = F.normalize(model.encode_text(ids), dim=-1)
    text = method.text_features(ctx)
    cos = F.cosine_similarity(text, anchor.unsqueeze(0), dim=-1).mean(-1)  # (K,)
    torch.testing.assert_close(out.aux_loss, 3.0 * (1 - cos)[rows], atol=1e-5, rtol=1e-5)
    eval_logits = method.forward({"ctx": ctx}, feats, rows, Context(training=False))
    torch.testing.assert_close(eval_logits, out.logits)


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestKgCoOpConformance(MethodConformance):
    method = "kgcoop"
