"""What is specific to the global-model baselines: FedPR, FedMix, FedMoon, Fed-DualPrompt."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.errors import FpbenchError
from fpbench.methods.base import Context, Updates, as_logits
from fpbench.methods.fed_dualprompt import DualPromptConfig, default_layers, select_prompts
from fpbench.methods.fedmix import fedmix_loss
from fpbench.methods.fedmoon import model_contrastive_loss
from fpbench.methods.fedpr import null_space_projector, project, project_straight_through


def _round(method, task, cfg, server):
    ids = task.trainable_clients()
    return train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=cfg.seed)


# -- FedPR -------------------------------------------------------------------------------------
def test_projector_drops_the_dominant_directions():
    prompts = torch.tensor([[[2.0, 0, 0, 0], [0, 1.0, 0, 0]]])  # (L=1, p=2, d=4)
    plain = null_space_projector(prompts, keep_ratio=0.75, normalize=False)  # drops 1 of 4
    torch.testing.assert_close(plain[0], torch.diag(torch.tensor([0.0, 1, 1, 1])))
    two = null_space_projector(prompts, keep_ratio=0.5, normalize=False)  # drops 2 of 4
    torch.testing.assert_close(two[0], torch.diag(torch.tensor([0.0, 0, 1, 1])))
    normed = null_space_projector(prompts, keep_ratio=0.75)  # FedPR: over the Frobenius norm
    torch.testing.assert_close(normed, plain / math.sqrt(3))
    update = torch.ones(1, 1, 1, 4)  # (K, L, p, d)
    torch.testing.assert_close(project(update, plain), torch.tensor([[[[0.0, 1, 1, 1]]]]))


def test_projector_of_a_rotated_prompt_removes_its_direction():
    v = torch.tensor([1.0, 1.0, 0, 0]) / math.sqrt(2)
    proj = null_space_projector(3 * v.view(1, 1, 4), keep_ratio=0.75, normalize=False)[0]
    expected = torch.tensor(
        [[0.5, -0.5, 0, 0], [-0.5, 0.5, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]]
    )  # I - v v^T
    torch.testing.assert_close(proj, expected)


def test_straight_through_projection_passes_the_raw_gradient():
    proj = torch.diag(torch.tensor([0.0, 1, 1])).unsqueeze(0)  # (L=1, 3, 3)
    update = torch.tensor([[[[1.0, 2.0, 3.0]]]], requires_grad=True)  # (K, L, p, d)
    out = project_straight_through(update, proj)
    torch.testing.assert_close(out.detach(), torch.tensor([[[[0.0, 2.0, 3.0]]]]))
    grad = torch.tensor([[[[5.0, -1.0, 2.0]]]])
    (out * grad).sum().backward()
    torch.testing.assert_close(update.grad, grad)  # the optimiser sees the unprojected gradient


def test_fedpr_local_prompt_change_is_orthogonal_to_the_global_prompts(tiny):
    cfg, task, method = tiny("fedpr", optimizer="adam", lr=0.1)
    server = method.init_server(torch.Generator().manual_seed(0))
    assert torch.equal(server.buffers["projector"][0], torch.eye(method.backbone.embed_dim))
    proj = null_space_projector(server.params["prompts"], 0.8)
    server.buffers = {"projector": proj}
    local = _round(method, task, cfg, server)
    change = project(local.params["prompt_update"], proj)  # (K, L, p=1, d)
    assert change.abs().amax() > 1e-4
    # p = 1: each layer's row space is the prompt itself, and it is among the dropped directions
    along = torch.einsum("klpd,lqd->klpq", change, server.params["prompts"])
    torch.testing.assert_close(along, torch.zeros_like(along), atol=1e-6, rtol=0)
    weights = task.train_sizes[local.client_ids]
    new = method.aggregate(server, Updates(local.params, local.client_ids, weights, local.stats))
    w = weights / weights.sum()
    expected = server.params["prompts"] + torch.einsum("k,klpd->lpd", w, change)
    torch.testing.assert_close(new.params["prompts"], expected)
    torch.testing.assert_close(new.buffers["projector"], null_space_projector(expected, 0.8))


# -- FedMix ------------------------------------------------------------------------------------
def test_fedmix_loss_matches_its_formula_on_a_linear_model():
    lam = 0.1
    w = torch.tensor([[1.0, 0, 0], [0, 0, 0]])  # logits = W x; (C=2, d=3)
    x_in = ((1 - lam) * torch.tensor([[0.0, 1.0, 2.0]])).requires_grad_()  # logits (0, 0)
    y = torch.tensor([0])
    mix_image = torch.tensor([2.0, 0, 0])
    mix_label = torch.tensor([0.25, 0.75])
    loss = fedmix_loss(x_in @ w.T, x_in, y, mix_image, mix_label, lam)
    # CE = log 2 for both labels; d CE / d x = W^T (p - e_y) = (-0.5, 0, 0); <., x_bar> = -1
    expected = (1 - lam) * math.log(2) + lam * math.log(2) + lam * (1 - lam) * (-1.0)
    torch.testing.assert_close(loss, torch.tensor([expected]))


def test_fedmix_loss_is_global_mixup_to_first_order():
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(5, 4, generator=gen), torch.randn(3, 5, generator=gen)
    x, x_bar = torch.randn(6, 4, generator=gen), torch.randn(4, generator=gen)
    y, y_bar = torch.randint(0, 3, (6,), generator=gen), torch.tensor([0.2, 0.5, 0.3])

    def f(inp):
        return torch.tanh(inp @ w1.T) @ w2.T

    def error(lam):
        mixed = f((1 - lam) * x + lam * x_bar)
        exact = (1 - lam) * F.cross_entropy(mixed, y, reduction="none") - lam * (
            F.log_softmax(mixed, -1) * y_bar
        ).sum(-1)
        x_in = ((1 - lam) * x).requires_grad_()
        approx = fedmix_loss(f(x_in), x_in, y, x_bar, y_bar, lam)
        return (approx - exact).abs().max().item()

    assert error(0.02) < 0.3 * error(0.04)  # the error is O(lam^2)


def test_fedmix_shares_each_trainable_clients_mean_once(tiny):
    _, task, method = tiny("fedmix")
    server = method.init_server(torch.Generator().manual_seed(0))
    buf = server.buffers
    sharing = [c for c in task.trainable_clients() if len(task.train_idx[c])]
    assert len(buf["mean_images"]) == len(sharing) < task.num_clients  # held-out share nothing
    images = task.data.train_images
    for row, c in enumerate(sharing):
        mean = images[task.train_idx[c]].double().mean(0)
        assert (buf["mean_images"][row].double() - mean).abs().max() <= 0.5
        torch.testing.assert_close(buf["mean_labels"][row], task.priors[c])
    torch.testing.assert_close(buf["mix_label"], task.priors[sharing].mean(0))
    pre = method.backbone.preprocess(buf["mean_images"]).mean(0)
    torch.testing.assert_close(buf["mix_image"], pre)
    down, up = method.communication(server)
    assert down["mean_images"].shape[0] == len(sharing) and up["mean_images"].shape[0] == 1
    ids = torch.tensor(sharing[:2])
    trained = method.client_params(server, ids)
    new = method.aggregate(server, Updates(trained, ids, torch.ones(2), {}))
    down, up = method.communication(new)
    assert set(down) == set(up) == set(new.params)  # later rounds: prompts and head only


# -- FedMoon -----------------------------------------------------------------------------------
def test_model_contrastive_loss_by_hand():
    z = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    z_glob = torch.tensor([[2.0, 0.0], [0.0, 1.0]])  # cosines 1 and 0.8
    z_prev = torch.tensor([[0.0, 3.0], [0.0, 1.0]])  # cosines 0 and 0.8
    loss = model_contrastive_loss(z, z_glob, z_prev, tau=0.5)
    expected = torch.tensor([math.log(1 + math.exp(-2.0)), math.log(2.0)])
    torch.testing.assert_close(loss, expected)
    z = z.clone().requires_grad_()
    model_contrastive_loss(z, z_glob, z_prev, tau=0.5)[0].backward()
    assert z.grad[0] @ (z_glob[0] - z_prev[0]) < 0  # descent moves z towards the global


def test_fedmoon_round_one_term_is_constant_and_prev_prompts_stay_local(tiny):
    cfg, task, method = tiny("fedmoon")
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = torch.tensor(task.trainable_clients())
    params = method.client_params(server, ids)
    idx = torch.cat([task.train_idx[c][:3] for c in ids.tolist()])
    rows = torch.arange(len(ids)).repeat_interleave(3)
    x, y = method.backbone.preprocess(task.data.train_images[idx]), task.data.train_labels[idx]
    ctx = Context(training=True)
    ce = F.cross_entropy(as_logits(method.forward(params, x, rows, ctx)), y, reduction="none")
    # prev = global = initial prompts: the contrastive term is log 2 for every sample
    torch.testing.assert_close(method.loss(params, x, y, rows, ctx), ce + math.log(2.0))
    local = _round(method, task, cfg, server)
    new = method.aggregate(
        server, Updates(local.params, local.client_ids, torch.ones(len(ids)), {})
    )
    prev = new.personal["prev_prompts"]
    torch.testing.assert_close(prev[local.client_ids], local.params["prompts"])
    for c in set(range(task.num_clients)) - set(ids.tolist()):
        assert torch.equal(prev[c], server.personal["prev_prompts"][c])
    down, up = method.communication(new)
    assert "prev_prompts" not in down and "prev_prompts" not in up


# -- Fed-DualPrompt ----------------------------------------------------------------------------
def test_keys_select_by_cosine_not_dot_product():
    keys = torch.tensor([[[10.0, 0.0], [0.0, 0.1], [-1.0, 0.0]]])  # (K=1, M=3, d=2)
    query = torch.tensor([[1.0, 1.2], [3.0, 0.1], [-1.0, -0.5]])
    index, match = select_prompts(keys, query, torch.zeros(3, dtype=torch.long))
    assert index.tolist() == [1, 0, 2]  # a dot product would pick key 0 for the first
    cosines = [1.2 / math.hypot(1, 1.2), 3 / math.hypot(3, 0.1), 1 / math.hypot(1, 0.5)]
    expected = torch.tensor(cosines)
    torch.testing.assert_close(match, expected)


def test_key_loss_moves_only_the_selected_key_towards_its_query():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]], requires_grad=True)
    query = torch.tensor([[1.0, 0.5]])  # client row 1 selects key 0
    _, match = select_prompts(keys, query, torch.tensor([1]))
    (1 - match).sum().backward()
    assert torch.count_nonzero(keys.grad[0]) == 0 and torch.count_nonzero(keys.grad[1, 1]) == 0
    stepped = keys.detach() - 0.1 * keys.grad
    assert F.cosine_similarity(stepped[1, 0], query[0], 0) > match.detach()[0]


def test_default_blocks_follow_dualprompt_and_scale_with_depth():
    assert default_layers(12) == ((0, 1), (2, 3, 4))
    assert default_layers(2) == ((0,), (1,))
    assert default_layers(4) == ((0,), (1,))
    with pytest.raises(FpbenchError):
        default_layers(1)


def test_each_sample_uses_the_e_prompt_of_its_key(tiny):
    _, task, method = tiny("fed-dualprompt")
    params = method.client_params(
        method.init_server(torch.Generator().manual_seed(0)), torch.tensor([0])
    )
    x = method.backbone.preprocess(task.data.train_images[:4])
    rows = torch.zeros(4, dtype=torch.long)
    query = method.backbone.forward_features(x).cls
    params["e_keys"] = torch.zeros_like(params["e_keys"])
    params["e_keys"][0, 3] = query.mean(0)  # every sample picks E-prompt 3
    base = method.forward(params, x, rows, Context(training=False)).logits
    other = dict(params, e_prompts=params["e_prompts"].clone())
    bump = torch.randn(params["e_prompts"].shape[2:], generator=torch.Generator().manual_seed(1))
    other["e_prompts"][0, 5] += bump  # not a constant shift: LayerNorm would remove that
    torch.testing.assert_close(method.forward(other, x, rows, Context(training=False)).logits, base)
    chosen = dict(params, e_prompts=params["e_prompts"].clone())
    chosen["e_prompts"][0, 3] += bump
    g, e = chosen["g_prompts"][0], chosen["e_prompts"][0, 3]  # the selected E-prompt, by hand
    prompts = {b: g[i].expand(4, -1, -1) for i, b in enumerate(method.g_layers)}
    prompts |= {b: e[i].expand(4, -1, -1) for i, b in enumerate(method.e_layers)}
    cls = method.backbone.forward_features(x, prompts, style="deep").cls
    expected = cls @ params["head_w"][0].T + params["head_b"][0]
    out = method.forward(chosen, x, rows, Context(training=False))
    torch.testing.assert_close(out.logits, expected)


def test_dualprompt_config_errors_name_the_fix(tiny):
    _, _, method = tiny("fed-dualprompt")
    cls = type(method)
    with pytest.raises(FpbenchError, match="g_len"):
        cls(DualPromptConfig(g_len=3), method.backbone, method.task)
    with pytest.raises(FpbenchError, match="e_layers"):
        cls(DualPromptConfig(e_layers=(5,)), method.backbone, method.task)
