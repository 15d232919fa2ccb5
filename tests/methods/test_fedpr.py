"""FedPR: the projection of local prompt updates away from the global prompts."""

from __future__ import annotations

import math

import torch

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Updates
from fpbench.methods.fedpr import null_space_projector, project, project_straight_through


def _round(method, task, cfg, server):
    ids = task.trainable_clients()
    return train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=cfg.seed)


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


def test_fedpr_head_takes_its_own_optimiser_the_prompts_keep_the_runs(tiny):
    """FedPR's Adam 0.1 is for its prompts; the head it lacks trains with its own settings."""
    from fpbench.engine.executor import phase_optimizer
    from fpbench.engine.optim import StackedAdam, StackedSGD

    cfg, _, method = tiny("fedpr", optimizer="adam", lr=0.1, lr_decay=0.5)
    method.cfg = method.Config(head_optimizer="sgd", head_lr=0.03, head_weight_decay=1e-5)
    server = method.init_server(torch.Generator().manual_seed(0))
    params = method.client_params(server, torch.tensor([0, 1]))
    (phase,) = method.phases(1, tuple(params))
    assert set(phase.trainable) == {"prompt_update", "head_w", "head_b"}
    tensors = [params[n] for n in phase.trainable]
    group = phase_optimizer(cfg.train, tensors, phase, lr=0.05)  # round 1: x 0.5
    by_tensor = {id(t): opt for opt in group.optimizers for t in opt.params}
    names = ("prompt_update", "head_w", "head_b")
    prompt, head_w, head_b = (by_tensor[id(params[n])] for n in names)
    assert isinstance(prompt, StackedAdam) and prompt.lr == 0.05
    for head in (head_w, head_b):
        assert isinstance(head, StackedSGD)
        assert (head.lr, head.momentum, head.weight_decay) == (0.015, 0.9, 1e-5)
    method.cfg = method.Config()  # "run": the head shares the run's optimiser
    (phase,) = method.phases(1, tuple(params))
    assert dict(phase.optimizers) == {}
    group = phase_optimizer(cfg.train, tensors, phase, lr=0.05)
    (only,) = group.optimizers
    assert isinstance(only, StackedAdam) and len(only.params) == 3
