"""BPL: the KL term and the mean prediction by hand, both posteriors' forward on the tiny CLIP
against an independent computation, the per-round Monte Carlo buffer, and the conformance kit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Output, Updates
from fpbench.methods.bpl import BPLConfig, kl_to_standard_normal, mean_prediction
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images


def test_kl_by_hand_and_by_torch_distributions():
    # dim 1: N(0, 1) -> 0; dim 2: N(1, 2) -> (2 + 1 - 1 - ln 2) / 2; mean over the two
    mu, logvar = torch.tensor([0.0, 1.0]), torch.tensor([0.0, math.log(2.0)])
    want = (2.0 - math.log(2.0)) / 4
    torch.testing.assert_close(kl_to_standard_normal(mu, logvar), torch.tensor(want))
    post = torch.distributions.Normal(mu, logvar.exp().sqrt())
    prior = torch.distributions.Normal(torch.zeros(2), torch.ones(2))
    torch.testing.assert_close(
        kl_to_standard_normal(mu, logvar), torch.distributions.kl_divergence(post, prior).mean()
    )


def test_mean_prediction_is_the_log_of_the_mean_softmax():
    # sample 1: softmax (1/2, 1/2); sample 2: logits (ln 3, 0) -> (3/4, 1/4); mean (5/8, 3/8)
    logits = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]])  # (L=2, B=1, C=2)
    torch.testing.assert_close(mean_prediction(logits), torch.tensor([[5 / 8, 3 / 8]]).log())


def test_defaults_are_the_official_scripts():
    cfg = BPLConfig()
    assert (cfg.ctx_init, cfg.vpt_type, cfg.n_samples, cfg.kl_weight) == (
        "a photo of a",
        "coopvpt",
        10,
        0.001,
    )


def _shifted_logits(method, ctx, bias, feats):
    """exp(scale) * cos(x_b, text of ctx + bias_lb), by the CoOp text features: (L, B, C)."""
    out = []
    for bias_l in bias:  # (B, d)
        text = method.text_features(ctx + bias_l[:, None])  # (B, C, E)
        out.append(method.backbone.logit_scale * torch.einsum("be,bce->bc", feats, text))
    return torch.stack(out)


def test_coopvpt_forward_by_hand(tiny, monkeypatch):
    _, _, method = tiny("bpl")
    features_as_images(monkeypatch, method)
    method = with_config(method, n_samples=3, kl_weight=0.5)
    server = seeded_server(method)
    d = method.backbone.ctx_dim
    assert set(server.params) == {"ctx", "mean_posterior", "std_posterior"}
    assert server.params["mean_posterior"].tolist() == [0.0] * d
    gen = torch.Generator().manual_seed(3)
    ctx = server.params["ctx"][None].repeat(2, 1, 1)
    params = {
        "ctx": ctx + 0.01 * torch.randn(2, 4, d, generator=gen),
        "mean_posterior": 0.1 * torch.randn(2, d, generator=gen),
        "std_posterior": -2.0 + torch.rand(2, d, generator=gen),
    }  # fmt: skip
    eps = torch.randn(3, d, generator=gen)
    feats = torch.randn(4, 32, generator=gen)
    rows, labels = torch.tensor([1, 0, 0, 1]), torch.tensor([0, 5, 2, 3])
    out = method.forward(params, feats, rows, Context(True, labels=labels, buffers={"eps": eps}))
    assert isinstance(out, Output)
    x = F.normalize(feats, dim=-1)
    mu, logvar = params["mean_posterior"][rows], params["std_posterior"][rows]  # (B, d)
    bias = mu + eps[:, None] * torch.exp(0.5 * logvar)  # (L, B, d)
    logits = _shifted_logits(method, params["ctx"][rows], bias, x)
    want = torch.log(F.softmax(logits, dim=-1).mean(0))
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    kl = 0.5 * (logvar.exp() + mu**2 - 1 - logvar).mean(-1)
    torch.testing.assert_close(out.aux_loss, 0.5 * kl, atol=1e-6, rtol=1e-5)
    evaluated = method.forward(params, feats, rows, Context(False, buffers={"eps": eps}))
    torch.testing.assert_close(evaluated, out.logits)


def test_cocoopvpt_posterior_is_two_elu_mlps_of_the_image_feature(tiny, monkeypatch):
    _, _, method = tiny("bpl")
    features_as_images(monkeypatch, method)
    method = with_config(method, vpt_type="cocoopvpt", n_samples=2)
    params = {k: v[None] for k, v in seeded_server(method).params.items()}  # K = 1
    assert params["mean_w1"].shape == (1, 16, 32) and params["logvar_w3"].shape == (1, 32, 16)
    gen = torch.Generator().manual_seed(4)
    eps = torch.randn(2, method.backbone.ctx_dim, generator=gen)
    feats = torch.randn(3, 32, generator=gen)
    rows, labels = torch.zeros(3, dtype=torch.long), torch.tensor([1, 1, 4])
    out = method.forward(params, feats, rows, Context(True, labels=labels, buffers={"eps": eps}))
    x = F.normalize(feats, dim=-1)

    def mlp(head):
        p = {k.split("_")[1]: v[0] for k, v in params.items() if k.startswith(head)}
        h = F.elu(F.linear(x, p["w1"], p["b1"]))
        return F.linear(F.elu(F.linear(h, p["w2"], p["b2"])), p["w3"], p["b3"])

    mu, logvar = mlp("mean"), mlp("logvar")
    bias = mu + eps[:, None] * torch.exp(0.5 * logvar)
    logits = _shifted_logits(method, params["ctx"][0].expand(3, -1, -1), bias, x)
    want = torch.log(F.softmax(logits, dim=-1).mean(0))
    torch.testing.assert_close(out.logits, want, atol=1e-5, rtol=1e-5)
    kl = 0.5 * (logvar.exp() + mu**2 - 1 - logvar).mean(-1)  # per image
    torch.testing.assert_close(out.aux_loss, 0.001 * kl, atol=1e-6, rtol=1e-5)


def test_the_draws_are_a_server_buffer_renewed_each_round_from_the_seed(tiny):
    _, _, method = tiny("bpl")
    method = with_config(method, n_samples=3)
    server = seeded_server(method)
    buf = server.buffers
    seed = int(buf["eps_seed"])
    first = torch.randn(3, method.backbone.ctx_dim, generator=torch.Generator().manual_seed(
        seed * 1_000_003))  # fmt: skip
    torch.testing.assert_close(buf["eps"], first)
    assert int(buf["eps_round"]) == 0
    assert torch.equal(seeded_server(method).buffers["eps"], buf["eps"])  # same run seed
    trained = {k: torch.stack([v, v + 1.0]) for k, v in server.params.items()}
    new = method.aggregate(server, Updates(trained, torch.tensor([0, 1]), torch.tensor([1.0, 3.0])))
    torch.testing.assert_close(new.params["ctx"], server.params["ctx"] + 0.75)  # FedAvg
    second = torch.randn(3, method.backbone.ctx_dim, generator=torch.Generator().manual_seed(
        seed * 1_000_003 + 1))  # fmt: skip
    assert int(new.buffers["eps_round"]) == 1
    torch.testing.assert_close(new.buffers["eps"], second)


def test_a_forward_without_the_draws_is_an_error(tiny):
    _, task, method = tiny("bpl")
    params = {k: v[None] for k, v in seeded_server(method).params.items()}
    x = method.backbone.preprocess(task.data.train_images[:2])
    with pytest.raises(ValueError, match="eps"):
        method.forward(params, x, torch.zeros(2, dtype=torch.long), Context(False))


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestBPLConformance(MethodConformance):
    method = "bpl"
