"""FedOTP: transport plans by hand; the local prompt stays on the client."""

from __future__ import annotations

import math

import torch

from fpbench.methods.base import Context, Updates
from fpbench.methods.fedotp import transport_plan

from ..conftest import seeded_server
from .common import stacked_constants


def test_unbalanced_plan_moves_rho_of_the_mass_within_the_patch_marginal():
    sim = torch.rand(3, 7, 2, generator=torch.Generator().manual_seed(0)) * 2 - 1  # (B, M, N)
    plan = transport_plan(sim.double(), 0.8, 0.1, 1e-12, 5000)
    torch.testing.assert_close(plan.sum(-2), torch.full((3, 2), 0.4, dtype=torch.float64))
    torch.testing.assert_close(plan.sum((-1, -2)), torch.full((3,), 0.8, dtype=torch.float64))
    assert (plan.sum(-1) <= 1 / 7 + 1e-9).all() and (plan >= 0).all()


def test_balanced_plan_meets_both_marginals():
    sim = torch.rand(2, 5, 3, generator=torch.Generator().manual_seed(1)) * 2 - 1
    plan = transport_plan(sim.double(), 0.8, 0.1, 1e-12, 5000, balanced=True)
    torch.testing.assert_close(plan.sum(-1), torch.full((2, 5), 0.2, dtype=torch.float64))
    torch.testing.assert_close(plan.sum(-2), torch.full((2, 3), 1 / 3, dtype=torch.float64))


def test_plan_of_one_prompt_and_uniform_similarity_is_uniform():
    plan = transport_plan(torch.zeros(1, 4, 1), 0.8, 0.01, 1e-6, 100)
    torch.testing.assert_close(plan, torch.full((1, 4, 1), 0.2))  # rho / M on every patch


def test_unbalanced_plan_of_a_2x2_case_by_hand():
    # S = I, eps = 0.5: K = [[1, k], [k, 1]] with k = e^-2; a = 1/2, b = rho / 2 = 0.4. By
    # symmetry u and v are constant; u = min(a / ((1 + k) v), 1) reaches its cap 1 after a few
    # steps, then v = b / (1 + k): T = K * 0.4 / (1 + k), rows sum to 0.4 <= a, columns to b
    k = math.exp(-2.0)
    plan = transport_plan(torch.eye(2, dtype=torch.float64)[None], 0.8, 0.5, 1e-12, 1000)
    expected = torch.tensor([[1.0, k], [k, 1.0]], dtype=torch.float64) * 0.4 / (1 + k)
    torch.testing.assert_close(plan[0], expected)
    # balanced: both marginals 1/2, T = K / (2 (1 + k))
    plan = transport_plan(torch.eye(2, dtype=torch.float64)[None], 0.8, 0.5, 1e-12, 1000, True)
    torch.testing.assert_close(plan[0], expected / 0.4 / 2)


def test_fedotp_local_prompt_never_leaves_the_client(tiny):
    _, task, method = tiny("fedotp")
    server = seeded_server(method)
    assert set(server.params) == {"global_ctx"} and set(server.personal) == {"local_ctx"}
    down, up = method.communication(server)
    assert set(down) == set(up) == {"global_ctx"}
    ids = torch.tensor([0, 2])
    trained = method.client_params(server, ids)
    trained["global_ctx"] = stacked_constants(server.params, [1.0, 4.0])["global_ctx"]
    trained["local_ctx"] = trained["local_ctx"] + torch.tensor([10.0, 20.0]).view(2, 1, 1)
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0]), {}))
    torch.testing.assert_close(
        new.params["global_ctx"], torch.full_like(server.params["global_ctx"], 1.75)
    )
    # each participant's local prompt comes back only to its own row; the others keep theirs
    assert torch.equal(new.personal["local_ctx"][0], trained["local_ctx"][0])
    assert torch.equal(new.personal["local_ctx"][2], trained["local_ctx"][1])
    for c in (1, 3):
        assert torch.equal(new.personal["local_ctx"][c], server.personal["local_ctx"][c])
    # and the global prompt carries nothing of the local ones (it is the weighted mean of 1 and 4)
    params = method.client_params(new, torch.tensor([1, 2]))
    assert torch.equal(params["local_ctx"][0], server.personal["local_ctx"][1])
    x = method.backbone.preprocess(task.data.train_images[:3])
    logits = method.forward(params, x, torch.tensor([0, 1, 1]), Context(training=False))
    # the score is a sum of plan * cosine with total plan mass rho: |logit| <= scale * rho
    assert logits.abs().max() <= method.backbone.logit_scale * 0.8 + 1e-4
