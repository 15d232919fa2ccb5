"""FedMix: the mixup loss by hand and the clients' shared mean images."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fpbench.methods.base import Updates
from fpbench.methods.fedmix import fedmix_loss


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
