"""FedEM: the E-step by hand, the weighted loss, M-step and mixture prediction."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.fedem import responsibilities

from ..conftest import seeded_server


def test_fedem_e_step_by_hand():
    log_pi = torch.tensor([[0.5, 0.25, 0.25]]).log()
    losses = torch.tensor([[math.log(2), 0.0, math.log(4)]])
    # q ∝ pi * exp(-loss) = (1/4, 1/4, 1/16) -> (4/9, 4/9, 1/9)
    q = responsibilities(log_pi, losses)
    torch.testing.assert_close(q, torch.tensor([[4 / 9, 4 / 9, 1 / 9]]))


def test_fedem_weighted_loss_m_step_and_mixture_prediction(tiny):
    _, task, method = tiny("fedem")
    server = seeded_server(method)
    m = method.cfg.learners
    assert server.personal["pi"].shape == (task.num_clients, m)
    ids = torch.tensor([1])
    params = method.client_params(server, ids)
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.zeros(4, dtype=torch.long)
    ctx = Context(training=True, labels=y)
    per_learner = method.learner_logits(params, x, rows)  # (B, M, C)
    losses = F.cross_entropy(per_learner.flatten(0, 1), y.repeat_interleave(m), reduction="none")
    q = responsibilities(torch.full((4, m), 1.0 / m).log(), losses.view(4, m))
    out = method.forward(params, x, rows, ctx)  # the E-step's weighted loss, no mixture logits
    assert out.logits is None and out.aux_loss is None
    loss, stats = training_loss(out, y)
    torch.testing.assert_close(loss, (q * losses.view(4, m)).sum(1))
    torch.testing.assert_close(stats["q_sum"], q.sum(0, keepdim=True))
    # M-step: pi = mean responsibility of the round's samples
    stats = {"q_sum": torch.tensor([[2.0, 1.0, 1.0]])}
    new = method.aggregate(server, Updates(params, ids, torch.tensor([4.0]), stats))
    torch.testing.assert_close(new.personal["pi"][1], torch.tensor([0.5, 0.25, 0.25]))
    assert torch.equal(new.personal["pi"][0], server.personal["pi"][0])
    # prediction: log sum_m pi_m softmax(f_m(x)); a one-hot pi picks one learner
    new.personal["pi"][1] = torch.tensor([0.0, 1.0, 0.0])
    ev = method.client_params(new, ids, training=False)
    logits = method.forward(ev, x, rows, Context(training=False))
    torch.testing.assert_close(logits, per_learner[:, 1].log_softmax(-1), atol=1e-5, rtol=1e-5)
    down, up = method.communication(new)
    assert set(down) == set(up) == {"prompts", "head_w", "head_b"}
