"""ATPFL: aggregation, InfoNCE by hand, the contrastive loss and executor equivalence."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.atpfl import info_nce
from fpbench.methods.base import Context, Updates, as_logits, training_loss

from ..conftest import seeded_server
from .common import both_executors_agree, stacked_constants


def test_atpfl_aggregate_stores_previous_prompts_and_globals(tiny):
    _, task, method = tiny("atpfl")
    server = seeded_server(method)
    trained = stacked_constants(server.params, [1.0, 4.0])
    ids = torch.tensor([0, 2])
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0]), {}))
    assert new.personal["has_prev"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert torch.equal(new.personal["prev_ctx"][2], trained["ctx"][1])
    assert torch.equal(new.personal["prev_visual"][1], server.personal["prev_visual"][1])
    for k, v in new.params.items():
        torch.testing.assert_close(v, torch.full_like(v, 1.75))
        assert torch.equal(new.buffers[f"global_{k}"], v)
    down, up = method.communication(new)
    assert set(down) == set(up) == {"ctx", "visual_prompt"}


def test_info_nce_by_hand():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    pos = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    neg = torch.tensor([[0.0, 3.0], [1.0, 0.0]])
    out = info_nce(z, pos, neg, 0.5)
    # row 0: cos+ = 1, cos- = 0 -> -log(e^2 / (e^2 + 1)); row 1: cos+ = cos- -> log 2
    torch.testing.assert_close(out, torch.tensor([math.log(1 + math.exp(-2.0)), math.log(2.0)]))


def test_atpfl_loss_adds_contrast_only_with_a_previous_prompt(tiny):
    _, task, method = tiny("atpfl")
    server = seeded_server(method)
    ids = torch.tensor([0, 1])
    params = method.client_params(server, ids)
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.tensor([0, 0, 1, 1])
    ctx = Context(training=True, labels=y, buffers=server.buffers)
    ce = F.cross_entropy(as_logits(method.forward(params, x, rows, ctx)), y, reduction="none")
    loss, _ = training_loss(method.forward(params, x, rows, ctx), y)
    torch.testing.assert_close(loss, ce)  # round 0: no negative
    # previous prompt != global prompt: the global one must be the positive, the previous one
    # the negative (the terms written out by hand, so swapping the roles fails)
    gen = torch.Generator().manual_seed(3)
    params["prev_ctx"] = params["ctx"] + 0.5 * torch.randn(params["ctx"].shape, generator=gen)
    params["prev_visual"] = torch.randn(params["visual_prompt"].shape, generator=gen)
    params["has_prev"] = torch.tensor([1.0, 0.0])
    params["ctx"] = params["ctx"] + 0.2 * torch.randn(params["ctx"].shape, generator=gen)
    params["visual_prompt"] = 0.3 * torch.randn(params["visual_prompt"].shape, generator=gen)
    out = training_loss(method.forward(params, x, rows, ctx), y)[0]
    ce = F.cross_entropy(as_logits(method.forward(params, x, rows, ctx)), y, reduction="none")
    t = method.cfg.temperature

    def l_con(z, glob, prev):  # -log e^(cos(z, g)/T) / (e^(cos(z, g)/T) + e^(cos(z, p)/T))
        pos = torch.exp(F.cosine_similarity(z, glob, dim=-1) / t)
        return -torch.log(pos / (pos + torch.exp(F.cosine_similarity(z, prev, dim=-1) / t)))

    text = method.text_features(params["ctx"][:1])[0]  # client 0's class texts (C, E)
    text_g = method.text_features(server.buffers["global_ctx"][None])[0]
    text_p = method.text_features(params["prev_ctx"][:1])[0]
    con_t = l_con(text, text_g, text_p).mean()
    img = method.image_features(x[:2], params["visual_prompt"][:1].expand(2, -1, -1))
    img_g = method.image_features(x[:2], server.buffers["global_visual_prompt"].expand(2, -1, -1))
    img_p = method.image_features(x[:2], params["prev_visual"][:1].expand(2, -1, -1))
    con = con_t + l_con(img, img_g, img_p)  # samples 0, 1 belong to client 0
    expected = ce + method.cfg.mu * torch.cat([con, torch.zeros(2)])  # client 1: no previous
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert (out[:2] - ce[:2] - math.log(2.0) * method.cfg.mu * 2).abs().min() > 1e-3


def test_atpfl_second_round_executors_agree(tiny):
    cfg, task, method = tiny("atpfl", batch_size=64)  # one step per client: fast
    server = seeded_server(method)
    ids = torch.tensor(task.trainable_clients())
    trained = method.client_params(server, ids)
    trained = {k: v + 0.05 * torch.randn_like(v) if k in ("ctx", "visual_prompt") else v
               for k, v in trained.items()}  # fmt: skip
    server = method.aggregate(server, Updates(trained, ids, task.train_sizes[ids], {}))
    server.params = {k: v + 0.05 * torch.randn_like(v) for k, v in server.params.items()}
    local = both_executors_agree(method, task, cfg, server)
    assert torch.isfinite(local.loss).all()
