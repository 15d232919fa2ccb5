"""PLOT: plans and logits by hand, the reference's stopping rule, per-client prompts, FedAvg."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates
from fpbench.methods.fedotp import transport_plan
from fpbench.testing import MethodConformance

from ..conftest import seeded_server, with_config
from .common import stacked_constants


@pytest.mark.slow  # tests/test_methods.py runs the same checks on every method by default
class TestPLOTConformance(MethodConformance):
    method = "plot"


def test_balanced_plan_of_a_2x2_case_and_one_step_watching_u():
    # S = I, eps = 0.5: K = [[1, k], [k, 1]], k = e^-2; uniform marginals 1/2: T = K / (2 (1 + k))
    k = math.exp(-2.0)
    sim = torch.eye(2, dtype=torch.float64)[None]
    plan = transport_plan(sim, 1.0, 0.5, 1e-12, 1000, balanced=True, watch="u")
    kern = torch.tensor([[1.0, k], [k, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(plan[0], kern / (2 * (1 + k)))
    # from u = v = 1 on an asymmetric S: step 1 changes u by 0.581 and v by 0.145 (mean abs),
    # step 2 changes u by 0.032. With thresh 0.3, watching v stops after step 1, watching u (the
    # reference) after step 2: each gives that step's plan u_t K v_t, written out here
    sim = torch.tensor([[[1.0, 0.2], [0.5, 0.9]]], dtype=torch.float64)
    kern = torch.exp(-(1 - sim[0]) / 0.5)
    u1 = 0.5 / kern.sum(1)
    v1 = 0.5 / (kern.T @ u1)
    u2 = 0.5 / (kern @ v1)
    v2 = 0.5 / (kern.T @ u2)
    assert float((u1 - 1).abs().mean()) > 0.3 > float((v1 - 1).abs().mean())
    assert float((u2 - u1).abs().mean()) < 0.3
    stop_v = transport_plan(sim, 1.0, 0.5, 0.3, 50, True, watch="v")
    stop_u = transport_plan(sim, 1.0, 0.5, 0.3, 50, True, watch="u")
    torch.testing.assert_close(stop_v[0], u1[:, None] * kern * v1[None])
    torch.testing.assert_close(stop_u[0], u2[:, None] * kern * v2[None])


def test_one_prompt_gives_the_mean_local_similarity(tiny):
    # N = 1: the plan's single column carries every patch's whole mass 1/M, so the logit is
    # exp(scale) * the mean over patches of cos(patch, class prompt)
    _, task, method = tiny("plot")
    method = with_config(method, n_prompts=1, n_ctx=4)
    params = method.client_params(seeded_server(method), torch.tensor([0]))
    assert params["ctx"].shape == (1, 1, 4, method.backbone.ctx_dim)
    x = method.backbone.preprocess(task.data.train_images[:3])
    with torch.no_grad():
        got = method.forward(params, x, torch.zeros(3, dtype=torch.long), Context(False))
        local = F.normalize(method.backbone.encode_image_tokens(x)[:, 1:], dim=-1)  # (B, M, E)
        text = method.layout.text_features(method.backbone, params["ctx"][0])[0]  # (C, E)
    want = method.backbone.logit_scale * (local @ text.T).mean(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_global_logits_add_the_pooled_feature_against_the_mean_prompt(tiny):
    _, task, method = tiny("plot")
    on = with_config(method, add_global_logits=True)
    params = method.client_params(seeded_server(method), torch.tensor([0]))
    x = method.backbone.preprocess(task.data.train_images[:2])
    rows = torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        extra = on.forward(params, x, rows, Context(False)) - method.forward(
            params, x, rows, Context(False)
        )
        pooled = F.normalize(method.backbone.encode_image(x), dim=-1)
        mean = F.normalize(method.text_features(params["ctx"])[0].mean(0), dim=-1)  # (C, E)
    torch.testing.assert_close(extra, method.backbone.logit_scale * pooled @ mean.T,
                               atol=1e-4, rtol=1e-5)  # fmt: skip


def test_each_sample_uses_its_clients_prompts_and_all_are_averaged(tiny):
    _, task, method = tiny("plot")
    server = seeded_server(method)
    assert set(server.params) == {"ctx"} and server.params["ctx"].shape[:2] == (4, 16)
    two = method.client_params(server, torch.tensor([0, 1]))
    two["ctx"][1] += 0.05 * torch.randn_like(two["ctx"][1])
    x = method.backbone.preprocess(task.data.train_images[:4])
    rows = torch.tensor([1, 0, 1, 0])
    with torch.no_grad():
        both = method.forward(two, x, rows, Context(False))
        for k in (0, 1):
            alone = method.forward({"ctx": two["ctx"][k : k + 1]}, x, rows * 0, Context(False))
            torch.testing.assert_close(both[rows == k], alone[rows == k], atol=1e-5, rtol=1e-5)
    trained = stacked_constants(server.params, [1.0, 4.0])
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]))
    )
    torch.testing.assert_close(new.params["ctx"], torch.full_like(new.params["ctx"], 1.75))
