import pytest
import torch

from fpbench.engine.optim import OptimizerGroup, StackedAdam, StackedSGD, make_optimizer


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


def test_a_clipped_group_that_no_gradient_reached_steps_nothing():
    p, q = torch.ones(2, 3), torch.ones(2, 2)
    opt = StackedSGD([p, q], lr=1.0, momentum=0.9, grad_clip=1.0)
    opt.step(torch.ones(2, dtype=torch.bool))  # a gate that this round's forwards skipped
    torch.testing.assert_close((p, q), (torch.ones(2, 3), torch.ones(2, 2)), atol=0, rtol=0)
    q.grad = torch.tensor([[0.0, 2.0], [0.0, 0.5]])  # p still without one: q alone is clipped
    opt.step(torch.ones(2, dtype=torch.bool))
    want = torch.tensor([[1.0, 1.0 - 2.0 / (2.0 + 1e-6)], [1.0, 0.5]])
    torch.testing.assert_close(q, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("name", "torch_cls", "torch_kw"),
    [
        ("sgd", torch.optim.SGD, dict(momentum=0.8)),
        ("adam", torch.optim.Adam, dict(betas=(0.8, 0.999))),
    ],
)
@pytest.mark.parametrize("clip", [None, 0.5])
def test_make_optimizer_hands_on_every_setting(name, torch_cls, torch_kw, clip):
    """`make_optimizer` as the executor calls it: lr, momentum (Adam's beta1, here not its
    default 0.9; beta2 0.999), weight decay and clipping all reach the stacked optimiser, row
    for row a torch one."""
    torch.manual_seed(3)
    p0 = torch.randn(2, 4)
    grads = [torch.randn(2, 4) for _ in range(3)]
    p = p0.clone()
    opt = make_optimizer(name, [p], lr=0.05, momentum=0.8, weight_decay=0.1, grad_clip=clip)
    for g in grads:
        p.grad = g.clone()
        opt.step(torch.ones(2, dtype=torch.bool))
    for k in range(2):
        kw = dict(lr=0.05, weight_decay=0.1, **torch_kw)
        ref = _run_plain(torch_cls, kw, p0[k], [g[k] for g in grads], clip)
        torch.testing.assert_close(p[k], ref)
    with pytest.raises(ValueError, match="^unknown optimizer 'lion'$"):
        make_optimizer("lion", [p], lr=0.05, momentum=0.9, weight_decay=0.0, grad_clip=None)


def test_adam_masked_rows_do_not_change_and_resume_like_alone():
    """Adam's moments and step count (its bias correction) stay put for a masked-out client."""
    torch.manual_seed(4)
    p0 = torch.randn(2, 3)
    g = [torch.randn(2, 3) for _ in range(3)]
    p = p0.clone()
    opt = StackedAdam([p], lr=0.01, weight_decay=0.1)
    masks = [torch.tensor([False, True]), torch.tensor([True, False]), torch.tensor([True, True])]
    for gi, m in zip(g, masks, strict=True):
        p.grad = gi.clone()
        before = p.clone()
        opt.step(m)
        for k in (0, 1):
            if not m[k]:
                assert torch.equal(p[k], before[k])
    assert opt.steps.tolist() == [2, 2]
    for k, steps in ((0, [1, 2]), (1, [0, 2])):
        ref = _run_plain(
            torch.optim.Adam, dict(lr=0.01, weight_decay=0.1), p0[k], [g[i][k] for i in steps]
        )
        torch.testing.assert_close(p[k], ref)


def test_a_group_scales_each_optimisers_own_lr():
    """`scale_lr` sets each optimiser's lr to its own base lr times the factor (not compounded);
    `step` and `zero_grad` reach every optimiser."""
    a, b = torch.zeros(1, 2), torch.zeros(1, 2)
    group = OptimizerGroup([StackedSGD([a], lr=0.1), StackedSGD([b], lr=1.0)])
    group.scale_lr(0.5)
    group.scale_lr(0.5)
    assert [opt.lr for opt in group.optimizers] == [0.05, 0.5]
    a.grad, b.grad = torch.ones(1, 2), torch.ones(1, 2)
    group.step(torch.ones(1, dtype=torch.bool))
    torch.testing.assert_close(torch.cat([a, b]), torch.tensor([[-0.05] * 2, [-0.5] * 2]))
    group.zero_grad()
    assert a.grad is None and b.grad is None


def test_defaults_are_torchs_and_tiny_gradients_move_adam_like_torch():
    """Left at their defaults (no momentum, no weight decay; Adam's betas and eps), the stacked
    optimisers follow torch's. Adam on gradients near its eps (1e-9): eps is added to the
    root of the second moment, not subtracted (that would turn the step around)."""
    torch.manual_seed(5)
    p0 = torch.randn(2, 3)
    for cls, torch_cls, scale in (
        (StackedSGD, torch.optim.SGD, 1.0),
        (StackedAdam, torch.optim.Adam, 1e-9),
    ):
        grads = [scale * torch.randn(2, 3) for _ in range(3)]
        p = p0.clone()
        opt = cls([p], lr=0.01)
        for g in grads:
            p.grad = g.clone()
            opt.step(torch.ones(2, dtype=torch.bool))
        for k in range(2):
            ref = _run_plain(torch_cls, dict(lr=0.01), p0[k], [g[k] for g in grads])
            torch.testing.assert_close(p[k] - p0[k], ref - p0[k], rtol=1e-4, atol=1e-9)


def test_clipping_leaves_a_tiny_gradient_alone():
    """A gradient far below the clip norm (here 1e-7, under the 1e-6 guard) is not scaled."""
    p = torch.zeros(1, 2)
    opt = StackedSGD([p], lr=1.0, grad_clip=1.0)
    p.grad = torch.tensor([[6e-8, 8e-8]])
    opt.step(torch.ones(1, dtype=torch.bool))
    torch.testing.assert_close(p, -torch.tensor([[6e-8, 8e-8]]), rtol=1e-6, atol=0)
