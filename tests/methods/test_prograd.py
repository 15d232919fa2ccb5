"""ProGrad: the projection and the distillation by hand, the init from the template, and the
training loss's gradient against two separate backward passes per client."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, training_loss
from fpbench.methods.prograd import PROGRAD_TEMPLATES, ProGradConfig, distillation, project
from fpbench.testing import MethodConformance
from fpbench.testing.tiny import seeded_server, with_config
from tests.methods.common import features_as_images


def test_projection_by_hand():
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    g_kl = torch.tensor([[-1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    # row 0 conflicts: u = (-1, 1) / sqrt 2, g.u = -1 / sqrt 2: g - (g.u) u = (0.5, 0.5);
    # row 1 agrees and row 2 has no distillation gradient: g unchanged
    expected = torch.tensor([[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]])
    torch.testing.assert_close(project(g, g_kl, 1.0), expected)
    half = project(g[:1], g_kl[:1], 0.5)  # lambda 0.5 removes half the conflicting part
    torch.testing.assert_close(half, torch.tensor([[0.75, 0.25]]))


def test_distillation_by_hand():
    logits = torch.zeros(1, 2)
    teacher = torch.tensor([[0.0, math.log(3.0)]])  # softmax (1/4, 3/4); log softmax(0) = -ln 2
    torch.testing.assert_close(distillation(logits, teacher, 1.0), torch.tensor([math.log(2)]))
    # T = 2: the same cross-entropy against a flat student, times T^2
    torch.testing.assert_close(distillation(logits, teacher, 2.0), torch.tensor([4 * math.log(2)]))


def test_defaults_and_templates_are_the_official_ones():
    cfg = ProGradConfig()
    assert (cfg.n_ctx, cfg.init_from_template, cfg.lam, cfg.temperature) == (16, True, 1.0, 1.0)
    assert PROGRAD_TEMPLATES["oxford-pets"] == "a type of pet, a photo of a {}."
    assert PROGRAD_TEMPLATES["dtd"] == "a texture of {}."


def test_context_starts_as_zeros_then_the_template_words(tiny):
    _, _, method = tiny("prograd")
    ctx = seeded_server(method).params["ctx"]  # synthetic: "a photo of a {}."
    assert ctx.shape == (16, 32) and not ctx[:12].any()
    ids = method.backbone.tokenize(["a photo of a"])
    torch.testing.assert_close(ctx[12:], method.backbone.token_embed(ids)[0, 1:5])


@pytest.mark.parametrize("lam", [1.0, 0.3])
def test_loss_gradient_is_each_clients_projected_gradient(tiny, lam, monkeypatch):
    _, _, method = tiny("prograd")
    features_as_images(monkeypatch, method)  # x: image features
    method = with_config(method, n_ctx=4, lam=lam)
    start = seeded_server(method).params["ctx"]
    gen = torch.Generator().manual_seed(3)
    ctx = torch.stack([start + 0.3 * torch.randn(start.shape, generator=gen) for _ in range(2)])
    feats = torch.randn(5, 32, generator=gen)
    y = torch.tensor([0, 1, 2, 3, 4])
    rows = torch.tensor([0, 1, 0, 1, 1])
    leaf = ctx.clone().requires_grad_(True)
    out = method.forward({"ctx": leaf}, feats, rows, Context(training=True, labels=y))
    plain = method.forward({"ctx": ctx}, feats, rows, Context(training=True))  # no labels
    torch.testing.assert_close(out.logits, plain)  # the loss comes with CoOp's logits
    loss, _ = training_loss(out, y)
    # the engine's objective: each client's mean per-sample loss, summed over clients
    per_client = torch.stack([loss[rows == k].mean() for k in range(2)])
    per_client.sum().backward()
    scale = method.backbone.logit_scale
    text0 = F.normalize(
        method.backbone.encode_text(
            method.backbone.tokenize(
                [f"a photo of a {n.replace('_', ' ')}." for n in method.task.class_names]
            )
        ),
        dim=-1,
    )
    conflicts = 0
    for k in range(2):  # client k alone: two backward passes on its batch means, as Dassl does
        c = ctx[k : k + 1].clone().requires_grad_(True)
        x, t = feats[rows == k], y[rows == k]
        zero = torch.zeros(len(x), dtype=torch.long)
        logits = method.forward({"ctx": c}, x, zero, Context(training=True))
        teacher = scale * F.normalize(x, dim=-1) @ text0.T
        ce = F.cross_entropy(logits, t)
        kl = (-(F.softmax(teacher, -1) * F.log_softmax(logits, -1)).sum(1)).mean()
        (g_kl,) = torch.autograd.grad(kl, c, retain_graph=True)
        (g,) = torch.autograd.grad(ce, c)
        a, b = g.flatten(), g_kl.flatten()
        if torch.dot(a / a.norm(), b / b.norm()) < 0:
            u = b / b.norm()
            a, conflicts = a - lam * torch.dot(a, u) * u, conflicts + 1
        torch.testing.assert_close(leaf.grad[k].flatten(), a, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(loss[rows == k], F.cross_entropy(logits, t, reduction="none"))
    assert conflicts == 2  # these inputs exercise the projection for both clients


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestProGradConformance(MethodConformance):
    method = "prograd"
