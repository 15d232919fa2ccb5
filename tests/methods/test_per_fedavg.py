"""Per-FedAvg: the inner half, first-order MAML and the step before evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fpbench.engine.evaluate import evaluate
from fpbench.methods.base import Context, training_loss
from fpbench.methods.per_fedavg import inner_half

from ..conftest import seeded_server, with_config


def test_per_fedavg_inner_half_is_the_first_half_of_each_clients_samples():
    rows = torch.tensor([0, 1, 0, 0, 1, 1, 1, 2])
    assert inner_half(rows).tolist() == [True, True, False, False, True, False, False, False]


def test_per_fedavg_meta_gradient_is_first_order_maml(tiny):
    _, task, method = tiny("per-fedavg")
    method = with_config(method, alpha=0.5)
    server = seeded_server(method)
    params = {
        k: v.requires_grad_() for k, v in method.client_params(server, torch.tensor([0])).items()
    }
    x = method.backbone.preprocess(task.data.train_images[:4])
    y = task.data.train_labels[:4]
    rows = torch.zeros(4, dtype=torch.long)
    out = method.forward(params, x, rows, Context(training=True, labels=y))
    assert out.logits is None and out.loss[:2].tolist() == [0.0, 0.0]  # D is not scored
    training_loss(out, y)[0].mean().backward()  # the engine's per-client mean
    got = {k: v.grad.clone() for k, v in params.items()}

    # by hand: theta' = theta - alpha grad L(theta; first two); expect grad L(theta'; last two)
    theta = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    inner = F.cross_entropy(method.forward(theta, x[:2], rows[:2], Context(training=True)), y[:2])
    grads = torch.autograd.grad(inner, list(theta.values()))
    adapted = {
        k: (v - 0.5 * g).detach().requires_grad_()
        for (k, v), g in zip(theta.items(), grads, strict=True)
    }
    F.cross_entropy(
        method.forward(adapted, x[2:], rows[2:], Context(training=True)), y[2:]
    ).backward()
    for k in got:
        torch.testing.assert_close(got[k], adapted[k].grad, atol=1e-6, rtol=1e-5)
    # and it is not the plain gradient of the outer half at theta
    plain = F.cross_entropy(method.forward(theta, x[2:], rows[2:], Context(training=True)), y[2:])
    plain = torch.autograd.grad(plain, list(theta.values()))
    assert any(not torch.allclose(got[k], g, atol=1e-5) for k, g in zip(theta, plain, strict=True))


def test_per_fedavg_takes_one_local_step_before_evaluation(tiny):
    cfg, task, method = tiny("per-fedavg")
    method = with_config(method, adapt_batch=5)
    server = seeded_server(method)
    seen = []
    plain = method.client_params

    def spy(server, ids, training=True, draw=None):
        def drawn(n):
            assert n == 5  # the config's adapt_batch
            x, y, rows = draw(n)
            seen.append((rows.clone(), y.clone()))
            return x, y, rows

        out = plain(server, ids, training, drawn)
        start = plain(server, ids, training)  # no draw: the start point
        assert all(not torch.equal(out[k], start[k]) for k in start)  # one step moved them
        return out

    method.client_params = spy
    evaluate(method, server, task, cfg.train.eval_batch_size)
    rows = torch.cat([r for r, _ in seen])
    per_row = [int((r == k).sum()) for r, _ in seen for k in range(int(r.max()) + 1)]
    assert len(per_row) == len(task.trainable_clients())
    assert all(
        n == min(5, len(task.train_idx[c]))
        for n, c in zip(per_row, task.trainable_clients(), strict=True)
    )
    assert rows.numel() > 0
    # the step itself: theta - alpha * grad of each row's mean loss
    x = method.backbone.preprocess(task.data.train_images[:3])
    y = task.data.train_labels[:3]
    start = plain(server, torch.tensor([0]), training=False)
    rows = torch.zeros(3, dtype=torch.long)
    stepped = plain(server, torch.tensor([0]), training=False, draw=lambda n: (x, y, rows))
    theta = {k: v.clone().requires_grad_() for k, v in start.items()}
    F.cross_entropy(
        method.forward(theta, x, torch.zeros(3, dtype=torch.long), Context(training=True)), y
    ).backward()
    for k in theta:
        torch.testing.assert_close(stepped[k], start[k] - 0.01 * theta[k].grad)
    assert not any(v.requires_grad for v in stepped.values())  # detached: nothing to backprop
    # in training a draw is never taken (the engine hands none; one given is not called)
    trained = plain(server, torch.tensor([0]), training=True, draw=lambda n: 1 / 0)
    assert all(torch.equal(trained[k], start[k]) for k in start)
