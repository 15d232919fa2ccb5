"""Per-FedAvg (first-order): a FedAvg-trained start point that one local step personalises.

Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020), first-order (FO-MAML)
version, as SGPT's baseline, on the FedVPT model (VPT-shallow prompts and a linear head on a
frozen ViT). Client, each local step: split its minibatch into two halves D (inner) and D'
(outer); theta' = theta - alpha * grad L_D(theta) per client (one functional pass, per-row
gradients of the stacked parameters); the step's loss is L_D'(theta') with theta' depending on
theta through the identity only (first order), so the engine's optimiser applies
beta * grad L_D'(theta'), beta being the benchmark's learning rate. The paper draws D and D'
as two independent batches; a client with a one-sample batch has an empty D (a plain step).
Server: FedAvg of prompts and head by client train size. Evaluation: each client first takes
one SGD step of size alpha on `adapt_batch` of its train samples (a fixed draw per client),
in its evaluation `client_params` (the engine's `draw`); held-out clients are not applicable
(personal).

Defaults (fpbench's; the original MLP/CNN values do not transfer to prompts): alpha = 0.01,
`adapt_batch` = 32; prompt length 5, fpbench's VPT-shallow default.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output, ServerState
from fpbench.methods.fedvpt import VPTConfig, VPTModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class PerFedAvgConfig(VPTConfig):
    alpha: float = Field(0.01, gt=0, description="inner (personalisation) step size")
    adapt_batch: int = Field(32, ge=1, description="train samples of the step before evaluation")


def per_client_mean(values: Tensor, client_index: Tensor, k: int) -> Tensor:
    """Mean (K,) of per-sample values (B,) over each row's samples (0 for a row without any)."""
    counts = torch.zeros(k, device=values.device).index_add_(
        0, client_index, torch.ones_like(values)
    )
    sums = torch.zeros(k, device=values.device, dtype=values.dtype).index_add(
        0, client_index, values
    )
    return sums / counts.clamp(min=1)


def inner_half(client_index: Tensor) -> Tensor:
    """(B,) bool: the first floor(n_k / 2) samples of each row k, in batch order, form D."""
    order = torch.arange(len(client_index), device=client_index.device)
    same = client_index.unsqueeze(0) == client_index.unsqueeze(1)  # (B, B)
    rank = (same & (order.unsqueeze(0) < order.unsqueeze(1))).sum(1)  # earlier samples of my row
    n = same.sum(1)
    return rank < n // 2


@METHODS.register()
class PerFedAvg(VPTModel):
    name = "per-fedavg"
    Config = PerFedAvgConfig
    inference = "personal"

    def inner_step(
        self, params: dict[str, Tensor], x: Tensor, y: Tensor, client_index: Tensor, ctx: Context
    ) -> dict[str, Tensor]:
        """theta - alpha * grad of each row's mean loss on (x, y); gradients detached."""
        k = next(iter(params.values())).shape[0]
        names = [n for n, p in params.items() if p.requires_grad]
        if len(y) == 0 or not names:
            return dict(params)
        logits = super().forward(params, x, client_index, ctx)
        loss = per_client_mean(F.cross_entropy(logits, y, reduction="none"), client_index, k)
        grads = torch.autograd.grad(loss.sum(), [params[n] for n in names])
        step = dict(zip(names, grads, strict=True))
        return {
            n: p - self.cfg.alpha * step[n].detach() if n in step else p for n, p in params.items()
        }

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """FedVPT's logits; in training, the meta-step's loss (B,): zero on the inner half D,
        the adapted parameters' cross-entropy on D' (no logits: D is never scored)."""
        if ctx.labels is None:
            return super().forward(params, x, client_index, ctx)
        y = ctx.labels
        inner = inner_half(client_index)
        adapted = self.inner_step(params, x[inner], y[inner], client_index[inner], ctx)
        outer = ~inner
        per = F.cross_entropy(
            super().forward(adapted, x[outer], client_index[outer], ctx),
            y[outer],
            reduction="none",
        )
        # the engine averages over all B_k samples of a row: rescale so it is the mean over D'
        rows = client_index[outer]
        n_all = torch.bincount(client_index, minlength=int(client_index.max()) + 1)
        n_out = torch.bincount(rows, minlength=len(n_all))
        out = torch.zeros(len(y), device=per.device, dtype=per.dtype)
        scale = (n_all / n_out.clamp(min=1))[rows].to(per.dtype)
        return Output(None, loss=out.masked_scatter(outer, per * scale))

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """At evaluation, each client's params after one step on `adapt_batch` of its train
        samples (`draw`), taken on the batch's device; unchanged without `draw`."""
        params = super().client_params(server, client_ids, training, draw)
        if training or draw is None:
            return params
        x, y, client_index = draw(self.cfg.adapt_batch)
        leaves = {n: p.to(x.device).detach().requires_grad_() for n, p in params.items()}
        ctx = Context(training=False, buffers=server.buffers)
        adapted = self.inner_step(leaves, x, y, client_index, ctx)
        return {n: p.detach() for n, p in adapted.items()}
