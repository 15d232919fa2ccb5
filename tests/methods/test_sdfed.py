"""SDFed: the projector, the losses of Eq. 14, variable lengths and ablations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates, as_logits, training_loss
from fpbench.methods.sdfed import projector, separation_loss, stretch_loss

from ..conftest import seeded_server, tiny_config
from .common import both_executors_agree, features_as_images, stacked_constants


def test_sdfed_shares_only_the_global_prompt(tiny):
    _, _, method = tiny("sdfed")
    server = seeded_server(method)
    assert set(server.params) == {"global_prompt"}
    assert server.params["global_prompt"].shape == (8, method.backbone.ctx_dim)
    down, up = method.communication(server)
    assert set(down) == set(up) == {"global_prompt"}
    trained = method.client_params(server, torch.tensor([1, 3]))
    trained["local_prompt"] = trained["local_prompt"] + 1.0
    trained["global_prompt"] = stacked_constants(server.params, [2.0, 5.0])["global_prompt"]
    new = method.aggregate(
        server, Updates(trained, torch.tensor([1, 3]), torch.tensor([1.0, 3.0]), {})
    )
    torch.testing.assert_close(new.params["global_prompt"], torch.full((8, 32), 4.25))
    assert torch.equal(new.personal["local_prompt"][3], trained["local_prompt"][1])
    assert torch.equal(new.personal["local_prompt"][0], server.personal["local_prompt"][0])
    assert torch.equal(new.personal["local_len"], server.personal["local_len"])


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


def _train_loss(method, params, feats, y, rows) -> torch.Tensor:
    """The per-sample loss the engine trains on: of the forward given the batch's labels."""
    loss, _ = training_loss(method.forward(params, feats, rows, Context(True, labels=y)), y)
    return loss


def _removal_projector(g: torch.Tensor, n_drop: int) -> torch.Tensor:
    """I - (the top n_drop eigenvectors of G^T G) (m, m), computed without the SVD."""
    _, vecs = torch.linalg.eigh(g.double().T @ g.double())  # ascending eigenvalues
    top = vecs[:, g.shape[-1] - n_drop :]  # (m, n_drop)
    return (torch.eye(g.shape[-1], dtype=torch.float64) - top @ top.T).float()


def test_sdfed_loss_is_the_sum_of_eq_14(tiny, monkeypatch):
    _, task, method = tiny("sdfed")
    features_as_images(monkeypatch, method)
    # lambda = 0.2: floor(0.2 * 32) = 6 <= S_s = 8 directions go, all in G_s's row space, so the
    # projector is unique and an eigendecomposition of G^T G must give the same one
    method.cfg = method.Config(lam=0.2)
    server = seeded_server(method)
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
    out = _train_loss(method, params, feats, y, rows)
    torch.testing.assert_close(out, total, atol=1e-4, rtol=1e-4)


def test_sdfed_variable_local_lengths(tiny):
    cfg = tiny_config("sdfed")
    _, task, method = tiny("sdfed")
    method.cfg = method.Config(local_len_range=(4, 64))
    server = seeded_server(method)
    lens = server.personal["local_len"]
    assert ((lens >= 4) & (lens <= 64)).all() and server.personal["local_prompt"].shape[1] == max(
        lens
    )
    method.cfg = method.Config(local_lengths=[4, 64])
    assert seeded_server(method).personal["local_len"].tolist() == [4, 64, 4, 64]
    assert cfg.method.args["lam"] == 0.6 and cfg.method.args["gamma"] == 0.8


def test_sdfed_random_lengths_executors_agree(tiny):
    cfg, task, method = tiny("sdfed", batch_size=64)
    method.cfg = method.Config(local_len_range=(2, 12))
    server = seeded_server(method)
    assert len(set(server.personal["local_len"].tolist())) > 1
    both_executors_agree(method, task, cfg, server)


@pytest.mark.parametrize(("pfhf", "srlp", "irdc"), [(False, True, True), (True, True, False)])
def test_sdfed_ablations(tiny, pfhf, srlp, irdc, monkeypatch):
    _, task, method = tiny("sdfed")
    features_as_images(monkeypatch, method)
    method.cfg = method.Config(pfhf=pfhf, srlp=srlp, irdc=irdc)
    server = seeded_server(method)
    trainable = method.phases(1, tuple(server.params))[0].trainable
    assert ("local_prompt" in trainable) == pfhf
    params = method.client_params(server, torch.tensor([0]))
    feats, y, rows = torch.randn(3, 32), torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long)
    logits = method.forward(params, feats, rows, Context(training=False))
    loss = _train_loss(method, params, feats, y, rows)
    train = method.forward(params, feats, rows, Context(training=True, labels=y))
    torch.testing.assert_close(as_logits(train), logits)  # the training forward's logits too
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


@pytest.mark.parametrize("target", ["fixed", "through"])
def test_stretch_term_treats_the_projection_as_a_fixed_target(tiny, target, monkeypatch):
    """App. C.4, eq. 25: grad_G L_str = 2 J_d(G)^T (d(G) - d(G~)), G~ held fixed; the option
    "through" differentiates d(G~) too. The gradient of the local prompt under the method's loss
    of the whole eq. 14 is rebuilt by hand with d(G~_c) detached (or not)."""
    _, _, method = tiny("sdfed")
    features_as_images(monkeypatch, method)
    method.cfg = method.Config(lam=0.2, stretch_target=target)
    server = seeded_server(method)
    params = method.client_params(server, torch.tensor([0]))
    gen = torch.Generator().manual_seed(3)
    params["global_prompt"] = torch.randn(params["global_prompt"].shape, generator=gen)
    local = torch.randn(params["local_prompt"].shape, generator=gen).requires_grad_(True)
    feats, y, rows = torch.randn(2, 32, generator=gen), torch.tensor([0, 1]), torch.zeros(2).long()
    loss = _train_loss(method, {**params, "local_prompt": local}, feats, y, rows)
    (got,) = torch.autograd.grad(loss.sum(), local)
    # by hand: the same loss with d(G~_c) detached (or not), built from the layout
    layout, loc = method.layout(8), local.detach().clone().requires_grad_(True)
    g = params["global_prompt"][0]
    t_g = layout.text_features(method.backbone, g[None])[0]
    t_l = layout.text_features(method.backbone, loc[0][None])[0]
    t_r = layout.text_features(method.backbone, (loc[0] @ projector(g, 0.2))[None])[0]
    if target == "fixed":
        t_r = t_r.detach()
    f = F.normalize(feats, dim=-1)
    scale = method.backbone.logit_scale
    ce = F.cross_entropy(scale * f @ t_g.T, y, reduction="sum")
    ce = ce + F.cross_entropy(scale * f @ t_l.T, y, reduction="sum")
    reg = ((t_l - t_r) ** 2).sum(-1).mean() + F.relu(0.8 - (t_l - t_g).norm(dim=-1)).mean()
    (want,) = torch.autograd.grad(ce + 2 * reg, loc, retain_graph=True)  # reg joins each sample
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)
    # the two readings differ by more than the tolerance: the target's own gradient
    t_r = layout.text_features(method.backbone, (loc[0] @ projector(g, 0.2))[None])[0]
    through, fixed = (
        torch.autograd.grad(((t_l - t) ** 2).sum(-1).mean(), loc, retain_graph=True)[0]
        for t in (t_r, t_r.detach())
    )
    assert (through - fixed).abs().max() > 100 * 1e-6
