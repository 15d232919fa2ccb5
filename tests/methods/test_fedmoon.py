"""FedMOON: MOON's contrastive loss by hand; previous prompts stay local."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.engine.executor import train_clients
from fpbench.methods.base import Context, Updates, as_logits, training_loss
from fpbench.methods.fedmoon import model_contrastive_loss


def _round(method, task, cfg, server):
    ids = task.trainable_clients()
    return train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=cfg.seed)


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
    ctx = Context(training=True, labels=y)
    ce = F.cross_entropy(as_logits(method.forward(params, x, rows, ctx)), y, reduction="none")
    # prev = global = initial prompts: the contrastive term is log 2 for every sample
    loss, _ = training_loss(method.forward(params, x, rows, ctx), y)
    torch.testing.assert_close(loss, ce + math.log(2.0))
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
