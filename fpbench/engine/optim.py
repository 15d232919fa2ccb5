"""Optimisers over stacked client parameters (K, ...), with per-client state.

Each row k of every tensor belongs to client k. A step takes a (K,) boolean mask of the clients
that had a batch at this step: masked-out rows change nothing (parameter, momentum, step count,
weight decay). Per-client gradient clipping uses each client's own norm over all its tensors.
The update rules are torch.optim.SGD's and torch.optim.Adam's (L2 weight decay), so one client
alone (K = 1) follows exactly what a plain torch optimiser would do.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _rows(mask: Tensor, like: Tensor) -> Tensor:
    return mask.view(-1, *[1] * (like.dim() - 1))


class StackedOptimizer:
    def __init__(
        self,
        params: list[Tensor],
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
    ) -> None:
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.grad_clip = grad_clip
        k = params[0].shape[0]
        self.steps = torch.zeros(k, dtype=torch.long, device=params[0].device)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def clip_(self) -> None:
        """Scale each client's gradients so their joint norm is at most grad_clip."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.grad_clip is None or not grads:  # a group nothing reached this step
            return
        sq = sum(g.flatten(1).pow(2).sum(1) for g in grads)
        coef = (self.grad_clip / (sq.sqrt() + 1e-6)).clamp(max=1.0)  # (K,)
        for g in grads:
            g.mul_(_rows(coef, g))

    @torch.no_grad()
    def step(self, mask: Tensor) -> None:
        self.clip_()
        self.steps += mask.long()
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad
            if self.weight_decay:
                g = g + self.weight_decay * p
            update = self._update(i, p, g, mask)
            p.sub_(torch.where(_rows(mask, p), update, torch.zeros_like(update)))

    def _update(self, i: int, p: Tensor, g: Tensor, mask: Tensor) -> Tensor:
        raise NotImplementedError


class StackedSGD(StackedOptimizer):
    """SGD with momentum (torch semantics: the first step's buffer is the gradient itself)."""

    def __init__(
        self,
        params: list[Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
    ) -> None:
        super().__init__(params, lr, weight_decay, grad_clip)
        self.momentum = momentum
        self.bufs = [torch.zeros_like(p) for p in params]

    def _update(self, i: int, p: Tensor, g: Tensor, mask: Tensor) -> Tensor:
        if not self.momentum:
            return self.lr * g
        m = _rows(mask, p)
        first = _rows(self.steps == 1, p)
        buf = torch.where(first, g, self.momentum * self.bufs[i] + g)
        self.bufs[i] = torch.where(m, buf, self.bufs[i])
        return self.lr * buf


class StackedAdam(StackedOptimizer):
    """Adam with per-client step counts for the bias correction."""

    def __init__(
        self,
        params: list[Tensor],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        grad_clip: float | None = None,
    ) -> None:
        super().__init__(params, lr, weight_decay, grad_clip)
        self.betas, self.eps = betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in params]

    def _update(self, i: int, p: Tensor, g: Tensor, mask: Tensor) -> Tensor:
        b1, b2 = self.betas
        m = _rows(mask, p)
        self.exp_avg[i] = torch.where(m, b1 * self.exp_avg[i] + (1 - b1) * g, self.exp_avg[i])
        self.exp_avg_sq[i] = torch.where(
            m, b2 * self.exp_avg_sq[i] + (1 - b2) * g * g, self.exp_avg_sq[i]
        )
        t = self.steps.clamp(min=1).to(p.dtype)
        bc1 = _rows(1 - b1**t, p)
        bc2 = _rows(1 - b2**t, p)
        return self.lr * (self.exp_avg[i] / bc1) / ((self.exp_avg_sq[i] / bc2).sqrt() + self.eps)


def make_optimizer(
    name: str,
    params: list[Tensor],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    grad_clip: float | None,
    beta2: float = 0.999,
    eps: float = 1e-8,
) -> StackedOptimizer:
    """SGD (`momentum`) or Adam (betas (`momentum`, `beta2`), `eps`)."""
    if name == "sgd":
        return StackedSGD(params, lr, momentum, weight_decay, grad_clip)
    if name == "adam":
        return StackedAdam(
            params, lr, (momentum, beta2), eps, weight_decay=weight_decay, grad_clip=grad_clip
        )
    raise ValueError(f"unknown optimizer {name!r}")


class OptimizerGroup:
    """Several stacked optimisers stepped together (parameters with their own settings).

    Gradient clipping stays per optimiser: each clips its own tensors' joint per-client norm.
    """

    def __init__(self, optimizers: list[StackedOptimizer]) -> None:
        self.optimizers = optimizers
        self.base_lrs = [opt.lr for opt in optimizers]

    def scale_lr(self, factor: float) -> None:
        """Set every optimiser's lr to its lr at construction times `factor`."""
        for opt, lr in zip(self.optimizers, self.base_lrs, strict=True):
            opt.lr = lr * factor

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def step(self, mask: Tensor) -> None:
        for opt in self.optimizers:
            opt.step(mask)
