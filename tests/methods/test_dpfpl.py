"""DP-FPL: Gram-Schmidt, the factorisation, the factors' gradient and the clipping by hand;
seeded draws; the noise scale; uniform server mean; both executors agree with privacy on."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates
from fpbench.methods.dpfpl import clip_rows, factorize, full_grad, gram_schmidt, low_rank
from tests.methods.common import features_as_images

from ..conftest import seeded_server, with_config
from .common import both_executors_agree, stacked_constants


def test_gram_schmidt_by_hand():
    # (3, 4) -> (0.6, 0.8); (1, 2) - 2.2 (0.6, 0.8) = (-0.32, 0.24) -> (-0.8, 0.6)
    m = torch.tensor([[3.0, 1.0], [4.0, 2.0]])
    torch.testing.assert_close(gram_schmidt(m), torch.tensor([[0.6, -0.8], [0.8, 0.6]]))


def test_factorisation_has_orthonormal_factors_and_the_context_is_the_local_prompt():
    gen = torch.Generator().manual_seed(0)
    local, v0 = torch.randn(2, 6, 10, generator=gen), torch.randn(2, 10, 3, generator=gen)
    u, v = factorize(local, v0)
    eye = torch.eye(3).expand(2, 3, 3)
    torch.testing.assert_close(u.transpose(-1, -2) @ u, eye)
    torch.testing.assert_close(v @ v.transpose(-1, -2), eye)
    # u spans local v0's columns; v = GS(local^T u)^T
    proj = u @ u.transpose(-1, -2)
    torch.testing.assert_close(proj @ (local @ v0), local @ v0, atol=1e-5, rtol=1e-5)
    z = torch.zeros_like(u)
    out = low_rank(local, u, v, z, torch.zeros_like(v), None)
    torch.testing.assert_close(out, local)


def test_full_gradient_by_hand():
    # a = g_u / 10 = (1, 2)^T, b = g_v / 10 = (3, 4, 5); a v + u b + u u^T a v
    u, v = torch.tensor([[1.0], [0.0]]), torch.tensor([[1.0, 0.0, 0.0]])
    gu, gv = torch.tensor([[10.0], [20.0]]), torch.tensor([[30.0, 40.0, 50.0]])
    expected = torch.tensor([[5.0, 4.0, 5.0], [2.0, 0.0, 0.0]])
    torch.testing.assert_close(full_grad(u, v, gu, gv), expected)


def test_clip_rows_by_hand():
    g = torch.tensor([[[3.0, 4.0]], [[0.6, 0.8]]])  # norms 5 and 1
    torch.testing.assert_close(clip_rows(g, 2.0), torch.tensor([[[1.2, 1.6]], [[0.6, 0.8]]]))


def test_local_gradient_is_the_factors_clipped_noised_gradient():
    gen = torch.Generator().manual_seed(1)
    local = torch.randn(1, 4, 6, generator=gen).requires_grad_(True)
    u, v = factorize(local.detach(), torch.randn(1, 6, 2, generator=gen))
    w = torch.randn(1, 4, 6, generator=gen) * 5  # dL/d(context) = w
    nu, nv = torch.randn(1, 4, 2, generator=gen), torch.randn(1, 2, 6, generator=gen)
    (low_rank(local, u, v, nu, nv, 0.5) * w).sum().backward()
    gu, gv = w @ v.transpose(-1, -2), u.transpose(-1, -2) @ w
    assert float(gu.norm()) > 0.5 and float(gv.norm()) > 0.5  # both get clipped
    gu, gv = gu * (0.5 / gu.norm()) + nu, gv * (0.5 / gv.norm()) + nv
    torch.testing.assert_close(local.grad, full_grad(u, v, gu, gv))


def test_noise_scale_and_seeded_draws(tiny):
    _, _, method = tiny("dp-fpl")
    assert method.noise_std == 0.0
    dp = with_config(method, epsilon=0.5)
    sigma = math.sqrt(100 * math.log(1e5)) / 0.5
    assert math.isclose(dp.noise_std, sigma * 10 / 32)
    key = torch.tensor([7, 2, 3])
    a, b = dp.draws(key, 16, 32), dp.draws(key, 16, 32)
    assert all(torch.equal(a[k], b[k]) for k in a) and set(a) == {"v0", "u", "v", "global"}
    other = dp.draws(torch.tensor([7, 1, 3]), 16, 32)  # another client: other draws
    assert not torch.equal(a["v0"], other["v0"])
    n = dp.task.num_clients
    big = dp.draws(key, 400, 32)["global"]  # the server's N(0, (std/N)^2) split over N clients
    torch.testing.assert_close(float(big.std()), dp.noise_std / math.sqrt(n), rtol=0.03, atol=0)


def test_evaluation_uses_global_plus_local_and_the_mean_is_uniform(tiny, monkeypatch):
    _, task, method = tiny("dp-fpl")
    server = seeded_server(method)
    assert set(server.params) == {"global_ctx"} and set(server.personal) == {"local_ctx"}
    params = method.client_params(server, torch.tensor([1]), training=False)
    clip = method.backbone
    x = clip.forward_features(clip.preprocess(task.data.train_images[:2])).cls
    features_as_images(monkeypatch, method)  # from here x holds image features
    logits = method.forward(params, x, torch.zeros(2, dtype=torch.long), Context(training=False))
    ctx = params["global_ctx"] + params["local_ctx"]
    text = method.text_features(ctx)[0]
    torch.testing.assert_close(logits, clip.logit_scale * F.normalize(x, dim=-1) @ text.T)
    ids = torch.tensor([0, 2])
    trained = method.client_params(server, ids)
    trained["global_ctx"] = stacked_constants(server.params, [1.0, 4.0])["global_ctx"]
    trained["local_ctx"] = trained["local_ctx"] + 3.0
    new = method.aggregate(server, Updates(trained, ids, torch.tensor([30.0, 10.0])))
    torch.testing.assert_close(
        new.params["global_ctx"], torch.full_like(trained["global_ctx"][0], 2.5)
    )
    assert torch.equal(new.personal["local_ctx"][2], trained["local_ctx"][1])
    assert int(new.buffers["dp_round"]) == 1 and torch.equal(
        new.buffers["dp_seed"], server.buffers["dp_seed"]
    )
    assert method.client_params(new, ids)["dp_key"][:, 1:].tolist() == [[0, 1], [2, 1]]


def test_executors_agree_with_privacy_on(tiny):
    cfg, task, method = tiny("dp-fpl", local_epochs=1)
    dp = with_config(method, epsilon=0.5, clip=0.05)
    out = both_executors_agree(dp, task, cfg, seeded_server(dp))
    assert torch.isfinite(out.loss).all()
