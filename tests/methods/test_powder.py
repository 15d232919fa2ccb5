"""Powder: generation weights, aggregation, evaluation and distillation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Context, Updates, training_loss
from fpbench.methods.powder import generation_weights

from ..conftest import seeded_server
from .common import features_as_images


def test_generation_weights_by_hand():
    query = torch.tensor([[1.0, 0.0]])
    cands = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    w = generation_weights(query, cands, torch.tensor([[True, True, True]]), tau=0.5)
    # cosines 1, 0 and 1/sqrt(2) over tau 0.5: softmax(2, sqrt(2)) over the correlated two
    a, b = math.exp(2), math.exp(2**0.5)
    torch.testing.assert_close(w, torch.tensor([[a / (a + b), 0, b / (a + b)]]))
    w = generation_weights(query, cands, torch.tensor([[True, True, False]]), tau=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 0, 0]]))  # the third is masked out


def test_powder_generation_aggregation_and_eval(tiny):
    _, task, method = tiny("powder")
    server = seeded_server(method)
    g = server.params["ctx"]
    first = method.client_params(server, torch.tensor([0, 1]))
    assert torch.equal(first["ctx"], g.expand(2, *g.shape)) and torch.equal(
        first["start_ctx"], first["ctx"]
    )
    trained = {"ctx": torch.stack([torch.full_like(g, 1.0), torch.full_like(g, 4.0)])}
    new = method.aggregate(
        server, Updates(trained, torch.tensor([0, 2]), torch.tensor([30.0, 10.0]), {})
    )
    torch.testing.assert_close(new.params["ctx"], torch.full_like(g, 1.75))  # step 2: FedAvg
    assert torch.equal(new.buffers["pool"][2], trained["ctx"][1])  # step 1: the task's prompt
    assert new.buffers["pool_seen"].tolist() == [1, 0, 1, 0]
    # client 1's start prompt mixes G and the seen tasks 0, 2 with the prior-correlation weights
    priors = task.priors.float()
    fed = (task.train_sizes.float() / task.train_sizes.sum()) @ priors
    w = generation_weights(priors[1:2], torch.stack([fed, priors[0], priors[2]]),
                           torch.ones(1, 3, dtype=torch.bool), method.cfg.tau)[0]  # fmt: skip
    expected = w[0] * 1.75 + w[1] * 1.0 + w[2] * 4.0
    start = method.client_params(new, torch.tensor([1]))["ctx"][0]
    torch.testing.assert_close(start, torch.full_like(g, float(expected)))
    # client 0 excludes its own row: G and task 2 only
    start0 = method.client_params(new, torch.tensor([0]))["ctx"][0]
    assert start0.min() >= 1.75 - 1e-6 and start0.max() <= 4.0 + 1e-6
    evals = method.client_params(new, torch.tensor([0, 1]), training=False)["ctx"]
    assert torch.equal(evals[0], trained["ctx"][0]) and torch.allclose(evals[1], start)
    down, up = method.communication(new)
    assert set(down) == set(up) == {"ctx"} and down["ctx"].shape == g.shape


def test_powder_distillation_vanishes_at_the_start_prompt(tiny, monkeypatch):
    _, task, method = tiny("powder")
    features_as_images(monkeypatch, method)
    params = method.client_params(seeded_server(method), torch.tensor([0]))
    feats, y = torch.randn(4, 32), torch.tensor([0, 1, 2, 3])
    rows = torch.zeros(4, dtype=torch.long)
    logits = method.forward(params, feats, rows, Context(training=False))  # the bare logits
    ce = F.cross_entropy(logits, y, reduction="none")
    train = Context(training=True, labels=y)
    torch.testing.assert_close(training_loss(method.forward(params, feats, rows, train), y)[0], ce)
    params["ctx"] = params["ctx"] + 0.1 * torch.randn_like(params["ctx"])
    moved = method.forward(params, feats, rows, Context(training=False))
    teacher = method.forward({"ctx": params["start_ctx"]}, feats, rows, Context(training=False))
    kl = (teacher.softmax(-1) * (teacher.log_softmax(-1) - moved.log_softmax(-1))).sum(-1)
    out = training_loss(method.forward(params, feats, rows, train), y)[0]
    torch.testing.assert_close(out, F.cross_entropy(moved, y, reduction="none") + kl)
    assert (kl > 0).all()
