import pytest
import torch

from fpbench.engine.optim import StackedAdam, StackedSGD


def _run_plain(opt_cls, kwargs, p0, grads, clip=None):
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], **kwargs)
    for g in grads:
        opt.zero_grad()
        p.grad = g.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_([p], clip)
        opt.step()
    return p.detach()


@pytest.mark.parametrize("clip", [None, 0.5])
def test_sgd_rows_match_torch_sgd(clip):
    torch.manual_seed(0)
    p0 = torch.randn(3, 4)
    grads = [torch.randn(3, 4) for _ in range(4)]
    p = p0.clone()
    opt = StackedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.01, grad_clip=clip)
    for g in grads:
        p.grad = g.clone()
        opt.step(torch.ones(3, dtype=torch.bool))
    for k in range(3):
        ref = _run_plain(
            torch.optim.SGD,
            dict(lr=0.1, momentum=0.9, weight_decay=0.01),
            p0[k],
            [g[k] for g in grads],
            clip,
        )
        torch.testing.assert_close(p[k], ref)


def test_adam_rows_match_torch_adam():
    torch.manual_seed(1)
    p0 = torch.randn(2, 5)
    grads = [torch.randn(2, 5) for _ in range(3)]
    p = p0.clone()
    opt = StackedAdam([p], lr=0.01, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step(torch.ones(2, dtype=torch.bool))
    for k in range(2):
        ref = _run_plain(
            torch.optim.Adam, dict(lr=0.01, weight_decay=0.1), p0[k], [g[k] for g in grads]
        )
        torch.testing.assert_close(p[k], ref)


def test_masked_rows_do_not_change_and_resume_like_alone():
    """A client masked out of a step keeps parameter and momentum; its later steps match alone."""
    torch.manual_seed(2)
    p0 = torch.randn(2, 3)
    g = [torch.randn(2, 3) for _ in range(3)]
    p = p0.clone()
    opt = StackedSGD([p], lr=0.1, momentum=0.9, weight_decay=0.1)
    masks = [torch.tensor([True, True]), torch.tensor([True, False]), torch.tensor([True, True])]
    for gi, m in zip(g, masks, strict=True):
        p.grad = gi.clone()
        before = p[1].clone()
        opt.step(m)
        if not m[1]:
            torch.testing.assert_close(p[1], before)
    ref = _run_plain(
        torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.1), p0[1], [g[0][1], g[2][1]]
    )
    torch.testing.assert_close(p[1], ref)


def test_per_client_clipping_uses_each_clients_norm():
    p = torch.zeros(2, 2)
    opt = StackedSGD([p], lr=1.0, grad_clip=1.0)
    p.grad = torch.tensor([[3.0, 4.0], [0.3, 0.4]])  # norms 5 and 0.5
    opt.step(torch.ones(2, dtype=torch.bool))
    torch.testing.assert_close(p, -torch.tensor([[0.6, 0.8], [0.3, 0.4]]), atol=1e-6, rtol=0)
