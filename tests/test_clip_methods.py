"""The CLIP prompt methods: hand-checked math and executor equivalence beyond round 0."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.errors import FpbenchError
from fpbench.methods.atpfl import info_nce
from fpbench.methods.base import Context, Updates, as_logits
from fpbench.methods.coop import CoOpModel
from fpbench.methods.fedotp import transport_plan
from fpbench.methods.sdfed import projector, separation_loss, stretch_loss

from .conftest import tiny_config


def _server(method):
    return method.init_server(torch.Generator().manual_seed(0))


def _constant(server_params, values):
    return {
        k: torch.stack([torch.full_like(v, x) for x in values]) for k, v in server_params.items()
    }


# -- aggregation --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["promptfl", "tpfl"])
def test_prompts_are_averaged_by_sample_size(tiny, name):
    _, _, method = tiny(name)
    server = _server(method)
    expected = {"promptfl": {"ctx"}, "tpfl": {"ctx", "visual_prompt"}}[name]
    assert set(server.params) == expected
    trained = _constant(server.params, [1.0, 4.0])
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]))
    )
    for v in new.params.values():  # (30 * 1 + 10 * 4) / 40
        torch.testing.assert_close(v, torch.full_like(v, 1.75))


def test_coop_local_keeps_everything_private(tiny):
    _, _, method = tiny("coop-local")
    server = _server(method)
    assert server.params == {} and method.communication(server) == ({}, {})
    assert method.inference == "personal" and set(server.personal) == {"ctx"}


def test_atpfl_aggregate_stores_previous_prompts_and_globals(tiny):
    _, task, method = tiny("atpfl")
    server = _server(method)
    trained = _constant(server.params, [1.0, 4.0])
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


def test_sdfed_shares_only_the_global_prompt(tiny):
    _, _, method = tiny("sdfed")
    server = _server(method)
    assert set(server.params) == {"global_prompt"}
    assert server.params["global_prompt"].shape == (8, method.backbone.ctx_dim)
    down, up = method.communication(server)
    assert set(down) == set(up) == {"global_prompt"}
    trained = method.client_params(server, torch.tensor([1, 3]))
    trained["local_prompt"] = trained["local_prompt"] + 1.0
    trained["global_prompt"] = _constant(server.params, [2.0, 5.0])["global_prompt"]
    new = method.aggregate(
        server, Updates(trained, torch.tensor([1, 3]), torch.tensor([1.0, 3.0]), {})
    )
    torch.testing.assert_close(new.params["global_prompt"], torch.full((8, 32), 4.25))
    assert torch.equal(new.personal["local_prompt"][3], trained["local_prompt"][1])
    assert torch.equal(new.personal["local_prompt"][0], server.personal["local_prompt"][0])
    assert torch.equal(new.personal["local_len"], server.personal["local_len"])


# -- InfoNCE ------------------------------------------------------------------------------------
def test_info_nce_by_hand():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    pos = torch.tensor([[2.0, 0.0], [1.0, 0.0]])
    neg = torch.tensor([[0.0, 3.0], [1.0, 0.0]])
    out = info_nce(z, pos, neg, 0.5)
    # row 0: cos+ = 1, cos- = 0 -> -log(e^2 / (e^2 + 1)); row 1: cos+ = cos- -> log 2
    torch.testing.assert_close(out, torch.tensor([math.log(1 + math.exp(-2.0)), math.log(2.0)]))


def test_atpfl_loss_adds_contrast_only_with_a_previous_prompt(tiny):
    _, task, method = tiny("atpfl")
    server = _server(method)
    ids = torch.tensor([0, 1])
    params = method.client_params(server, ids)
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.tensor([0, 0, 1, 1])
    ctx = Context(training=True, buffers=server.buffers)
    ce = F.cross_entropy(as_logits(method.forward(params, x, rows, ctx)), y, reduction="none")
    torch.testing.assert_close(method.loss(params, x, y, rows, ctx), ce)  # round 0: no negative
    # previous prompt != global prompt: the global one must be the positive, the previous one
    # the negative (the terms written out by hand, so swapping the roles fails)
    gen = torch.Generator().manual_seed(3)
    params["prev_ctx"] = params["ctx"] + 0.5 * torch.randn(params["ctx"].shape, generator=gen)
    params["prev_visual"] = torch.randn(params["visual_prompt"].shape, generator=gen)
    params["has_prev"] = torch.tensor([1.0, 0.0])
    params["ctx"] = params["ctx"] + 0.2 * torch.randn(params["ctx"].shape, generator=gen)
    params["visual_prompt"] = 0.3 * torch.randn(params["visual_prompt"].shape, generator=gen)
    out = method.loss(params, x, y, rows, ctx)
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


# -- SDFed's subspace refinement and losses -----------------------------------------------------
def test_projector_removes_the_top_floor_lambda_m_directions():
    g = torch.tensor([[0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 2.0]])  # S = 2, m = 4
    # floor(0.25 * 4) = 1: only the top direction (e2, sigma = 3) goes
    torch.testing.assert_close(projector(g, 0.25), torch.diag(torch.tensor([1.0, 0, 1, 1])))
    # floor(0.5 * 4) = 2: e2 and e4 (sigma = 2) go
    torch.testing.assert_close(projector(g, 0.5), torch.diag(torch.tensor([1.0, 0, 1, 0])))
    r = projector(g, 0.75)  # floor(3) directions go: e2, e4 and one of e1 / e3
    assert torch.linalg.matrix_rank(r) == 1 and r[1].abs().max() < 1e-6


def test_projector_is_an_orthogonal_projector_killing_the_global_row_space():
    g = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    r = projector(g, 0.6)  # floor(0.6 * 32) = 19 directions removed, 13 kept
    torch.testing.assert_close(r, r.T)
    torch.testing.assert_close(r @ r, r, atol=1e-5, rtol=0)
    assert torch.linalg.matrix_rank(r) == 32 - 19
    torch.testing.assert_close(g @ r, torch.zeros(8, 32), atol=1e-5, rtol=0)
    local = torch.randn(5, 32)
    assert (local @ r).norm() <= local.norm()  # non-expansive (Lemma 2)


def test_stretch_and_separation_losses_by_hand():
    local = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # (C = 2, E = 2)
    refined = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    assert stretch_loss(local, refined).item() == pytest.approx(1.0)  # (2 + 0) / 2
    global_ = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # distances sqrt(2) and 0
    assert separation_loss(local, global_, 0.8).item() == pytest.approx(0.4)  # (0 + 0.8) / 2
    assert separation_loss(local, global_, 2.0).item() == pytest.approx((2 - 2**0.5 + 2) / 2)


def _removal_projector(g: torch.Tensor, n_drop: int) -> torch.Tensor:
    """I - (the top n_drop eigenvectors of G^T G) (m, m), computed without the SVD."""
    _, vecs = torch.linalg.eigh(g.double().T @ g.double())  # ascending eigenvalues
    top = vecs[:, g.shape[-1] - n_drop :]  # (m, n_drop)
    return (torch.eye(g.shape[-1], dtype=torch.float64) - top @ top.T).float()


def test_sdfed_loss_is_the_sum_of_eq_14(tiny):
    _, task, method = tiny("sdfed")
    # lambda = 0.2: floor(0.2 * 32) = 6 <= S_s = 8 directions go, all in G_s's row space, so the
    # projector is unique and an eigendecomposition of G^T G must give the same one
    method.cfg = method.Config(lam=0.2)
    server = _server(method)
    params = method.client_params(server, torch.tensor([0, 2]))
    gen = torch.Generator().manual_seed(5)
    params["global_prompt"] = torch.randn(params["global_prompt"].shape, generator=gen)
    params["local_prompt"] = torch.randn(params["local_prompt"].shape, generator=gen)
    feats = torch.randn(4, method.backbone.embed_dim)  # cached image features
    y, rows = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 1, 0])
    layout = method.layout(8)
    scale = method.backbone.logit_scale
    f = F.normalize(feats, dim=-1)
    total = torch.zeros(4)
    for i in range(4):
        k = int(rows[i])
        g, loc = params["global_prompt"][k], params["local_prompt"][k]
        r = _removal_projector(g, 6)
        assert (g @ r).abs().max() < 0.5 * g.abs().max()  # most of G_s is gone, not all (S > 6)
        t_g = layout.text_features(method.backbone, g[None])[0]
        t_l = layout.text_features(method.backbone, loc[None])[0]
        t_r = layout.text_features(method.backbone, (loc @ r)[None])[0]
        ce = sum(F.cross_entropy(scale * f[i] @ t.T, y[i]) for t in (t_g, t_l))
        reg = ((t_l - t_r) ** 2).sum(-1).mean() + F.relu(0.8 - (t_l - t_g).norm(dim=-1)).mean()
        total[i] = ce + reg
    out = method.loss(params, feats, y, rows, Context(training=True))
    torch.testing.assert_close(out, total, atol=1e-4, rtol=1e-4)


def test_sdfed_variable_local_lengths(tiny):
    cfg = tiny_config("sdfed")
    _, task, method = tiny("sdfed")
    method.cfg = method.Config(local_len_range=(4, 64))
    server = _server(method)
    lens = server.personal["local_len"]
    assert ((lens >= 4) & (lens <= 64)).all() and server.personal["local_prompt"].shape[1] == max(
        lens
    )
    method.cfg = method.Config(local_lengths=[4, 64])
    assert _server(method).personal["local_len"].tolist() == [4, 64, 4, 64]
    assert cfg.method.args["lam"] == 0.6 and cfg.method.args["gamma"] == 0.8


# -- executor equivalence where the conformance test's round 0 does not reach -------------------
def _both_executors(method, task, cfg, server):
    ids = task.trainable_clients()
    out = [
        train_clients(method, server, task, ids, cfg.train, round_idx=1, seed=0, executor=e)
        for e in ("reference", "lockstep")
    ]
    for k in out[0].params:
        torch.testing.assert_close(out[1].params[k], out[0].params[k], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out[1].loss, out[0].loss, atol=1e-5, rtol=1e-5)
    return out[1]


def test_atpfl_second_round_executors_agree(tiny):
    cfg, task, method = tiny("atpfl", batch_size=64)  # one step per client: fast
    server = _server(method)
    ids = torch.tensor(task.trainable_clients())
    trained = method.client_params(server, ids)
    trained = {k: v + 0.05 * torch.randn_like(v) if k in ("ctx", "visual_prompt") else v
               for k, v in trained.items()}  # fmt: skip
    server = method.aggregate(server, Updates(trained, ids, task.train_sizes[ids], {}))
    server.params = {k: v + 0.05 * torch.randn_like(v) for k, v in server.params.items()}
    local = _both_executors(method, task, cfg, server)
    assert torch.isfinite(local.loss).all()


def test_sdfed_random_lengths_executors_agree(tiny):
    cfg, task, method = tiny("sdfed", batch_size=64)
    method.cfg = method.Config(local_len_range=(2, 12))
    server = _server(method)
    assert len(set(server.personal["local_len"].tolist())) > 1
    _both_executors(method, task, cfg, server)


@pytest.mark.parametrize(("pfhf", "srlp", "irdc"), [(False, True, True), (True, True, False)])
def test_sdfed_ablations(tiny, pfhf, srlp, irdc):
    _, task, method = tiny("sdfed")
    method.cfg = method.Config(pfhf=pfhf, srlp=srlp, irdc=irdc)
    server = _server(method)
    trainable = method.phases(1, tuple(server.params))[0].trainable
    assert ("local_prompt" in trainable) == pfhf
    params = method.client_params(server, torch.tensor([0]))
    feats, y, rows = torch.randn(3, 32), torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long)
    logits = method.forward(params, feats, rows, Context(training=False))
    loss = method.loss(params, feats, y, rows, Context(training=True))
    ce = F.cross_entropy(logits, y, reduction="none")
    if not pfhf:  # global prompt only: CoOp's logits of the global prompt, built by hand
        g = params["global_prompt"][0]
        t_g = method.layout(8).text_features(method.backbone, g[None])[0]  # (C, E)
        ref = method.backbone.logit_scale * F.normalize(feats, dim=-1) @ t_g.T
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, F.cross_entropy(ref, y, reduction="none"))
    else:  # projected local prompt at inference, CE(local) + CE(global), no regularisers
        g = params["global_prompt"][0]
        local = params["local_prompt"][0] @ projector(g, 0.6)
        t = method.layout(8).text_features(method.backbone, local[None])[0]
        ref = method.backbone.logit_scale * F.normalize(feats, dim=-1) @ t.T
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)
        t_g = method.text_features(params["global_prompt"])
        ce_g = F.cross_entropy(method.logits(F.normalize(feats, dim=-1), t_g, rows), y,
                               reduction="none")  # fmt: skip
        torch.testing.assert_close(loss, ce + ce_g)


def test_clip_methods_refuse_a_vit_backbone(tiny):
    _, task, vit_method = tiny("fedvpt")
    _, _, clip_method = tiny("promptfl")
    with pytest.raises(FpbenchError, match="needs a CLIP backbone"):
        type(clip_method)(clip_method.cfg, vit_method.backbone, clip_method.task)
    assert issubclass(type(clip_method), CoOpModel)


# -- FedOTP's transport plan --------------------------------------------------------------------
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
    server = _server(method)
    assert set(server.params) == {"global_ctx"} and set(server.personal) == {"local_ctx"}
    down, up = method.communication(server)
    assert set(down) == set(up) == {"global_ctx"}
    ids = torch.tensor([0, 2])
    trained = method.client_params(server, ids)
    trained["global_ctx"] = _constant(server.params, [1.0, 4.0])["global_ctx"]
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
