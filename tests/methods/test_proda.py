"""ProDA: the surrogate's variance and the diversity loss by hand and by FLiP's covariance form,
the training forward's wiring on the tiny CLIP, one prompt as CoOp, and the conformance kit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output
from fpbench.methods.proda import ProDAConfig, prompt_diversity, surrogate_variance
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images


def test_surrogate_variance_by_hand():
    # K = 1 client, P = 2 prompts, C = 2 classes, E = 1: deviations +-(0.5, -0.25); x = 2, y = 0.
    # sigma_0 = 0; sigma_1 = x^2 * ((0.5 + 0.25)^2 + (-0.5 - 0.25)^2) / (P + 1) = 4 * 1.125 / 3
    dev = torch.tensor([[[[0.5], [-0.25]], [[-0.5], [0.25]]]])  # (1, 2, 2, 1)
    sigma = surrogate_variance(torch.tensor([[2.0]]), dev, torch.tensor([0]), torch.tensor([0]))
    torch.testing.assert_close(sigma, torch.tensor([[0.0, 1.5]]))


def test_surrogate_variance_is_flips_per_dimension_covariance_form():
    # FLiP writes sigma_c = R[y, y] + R[c, c] - 2 R[y, c] with R[i, k] = sum_d x_d^2 Cov_d[i, k]
    # and Cov_d[i, k] = sum_p dev[p, i, d] dev[p, k, d] / (P + 1): the same numbers, per client row
    gen = torch.Generator().manual_seed(0)
    k, p, c, e, b = 2, 3, 4, 5, 6
    dev = torch.randn(k, p, c, e, generator=gen)
    feats = torch.randn(b, e, generator=gen)
    labels = torch.tensor([0, 3, 1, 2, 2, 0])
    rows = torch.tensor([1, 0, 1, 1, 0, 0])
    want = torch.empty(b, c)
    for i in range(b):
        d = dev[rows[i]]  # (P, C, E)
        cov = torch.einsum("pie,pke->eik", d, d) / (p + 1)  # (E, C, C)
        r = torch.einsum("e,eik->ik", feats[i] ** 2, cov)
        y = labels[i]
        want[i] = r[y, y] + r.diagonal() - 2 * r[y]
    got = surrogate_variance(feats, dev, labels, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_diversity_is_the_mean_absolute_off_diagonal_cosine():
    # P = 3 unit vectors: cosines 0.6 (p0, p1), -0.8 (p0, p2), 0 (p1, p2): mean |.| = 1.4 / 3
    f = torch.tensor([[[0.6, 0.8], [1.0, 0.0], [-0.8, 0.6]]])
    torch.testing.assert_close(prompt_diversity(f), torch.tensor([(0.6 + 0.8 + 0.0) / 3]))
    assert prompt_diversity(f[:, :1]).tolist() == [0.0]  # one prompt: no pairs


def test_defaults():
    cfg = ProDAConfig()
    assert (cfg.n_ctx, cfg.n_prompts, cfg.w) == (4, 4, 1.0)


def test_training_forward_adds_the_surrogate_and_each_rows_diversity(tiny, monkeypatch):
    _, _, method = tiny("proda")
    features_as_images(monkeypatch, method)  # x: image features
    method = with_config(method, n_prompts=3, w=2.0)
    server = seeded_server(method)
    assert server.params["ctx"].shape == (3, 4, method.backbone.ctx_dim)
    ctx = torch.stack([server.params["ctx"], server.params["ctx"] * 1.5])  # K = 2
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(4, 32, generator=gen)
    rows, labels = torch.tensor([1, 0, 0, 1]), torch.tensor([2, 0, 5, 1])
    out = method.forward({"ctx": ctx}, feats, rows, Context(training=True, labels=labels))
    assert isinstance(out, Output)
    # by open_clip's towers: every prompt's class features, their mean, the per-sample variance
    model, tok, bb = method.backbone.model, method.backbone.tokenizer, method.backbone
    text = torch.stack([method.text_features(ctx[:, p]) for p in range(3)], 1)  # (K, P, C, E)
    x = F.normalize(feats, dim=-1)
    mean = text.mean(1)
    s = bb.logit_scale
    base = s * torch.einsum("be,bce->bc", x, mean[rows])
    want = torch.empty_like(base)
    for i in range(4):
        dev = text[rows[i]] - mean[rows[i]]  # (P, C, E)
        gap = dev - dev[:, labels[i] : labels[i] + 1]  # (P, C, E)
        want[i] = base[i] + 0.5 * s**2 * (x[i] ** 2 * gap**2).sum((0, 2)) / 4
    torch.testing.assert_close(out.logits, want, atol=1e-4, rtol=1e-5)
    # the class-free prompts "X X X X." through open_clip's text tower, with the context swapped in
    ids = tok(["X X X X."], 77)
    emb = model.token_embedding(ids).expand(6, -1, -1).clone()
    emb[:, 1:5] = ctx.flatten(0, 1)
    free = F.normalize(bb.encode_prompts(emb, ids.expand(6, -1), truncate=True), dim=-1)
    free = free.view(2, 3, -1)
    cos = free @ free.transpose(1, 2)
    div = torch.stack([(cos[j].abs().sum() - cos[j].diagonal().abs().sum()) / 6 for j in range(2)])
    torch.testing.assert_close(out.aux_loss, 2.0 * div[rows], atol=1e-5, rtol=1e-5)
    # evaluation: the mean features alone
    eval_logits = method.forward({"ctx": ctx}, feats, rows, Context(training=False))
    torch.testing.assert_close(eval_logits, base, atol=1e-4, rtol=1e-5)


def test_one_prompt_is_coop(tiny, monkeypatch):
    # FLiP's run (--num_prompt 1): no variance, no diversity; the logits are PromptFL's (CoOp)
    _, _, method = tiny("proda")
    features_as_images(monkeypatch, method)
    method = with_config(method, n_prompts=1)
    ctx = seeded_server(method).params["ctx"].unsqueeze(0)  # (K=1, P=1, n, d)
    feats = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    rows, labels = torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2])
    out = method.forward({"ctx": ctx}, feats, rows, Context(training=True, labels=labels))
    coop = method.logits(F.normalize(feats, dim=-1), method.text_features(ctx[:, 0]), rows)
    torch.testing.assert_close(out.logits, coop)
    assert out.aux_loss.tolist() == [0.0, 0.0, 0.0]


def test_training_forward_without_labels_is_an_error(tiny, monkeypatch):
    _, _, method = tiny("proda")
    features_as_images(monkeypatch, method)
    ctx = seeded_server(method).params["ctx"].unsqueeze(0)
    with pytest.raises(ValueError, match="labels"):
        method.forward({"ctx": ctx}, torch.randn(2, 32), torch.zeros(2, dtype=torch.long),
                       Context(training=True))  # fmt: skip


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestProDAConformance(MethodConformance):
    method = "proda"
