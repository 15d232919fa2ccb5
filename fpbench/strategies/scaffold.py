"""SCAFFOLD (Karimireddy et al., "Stochastic Controlled Averaging for Federated Learning", ICML
2020), with option II's control-variate update.

The server keeps a control variate c per global tensor and one c_i per client (buffers
`scaffold.c.<param>` and `scaffold.ci.<param>`, (N, ...), zero at the start). A client's local
gradient is corrected by c - c_i: its loss gets the term <c - c_i, w>, whose gradient that is,
so under plain SGD each step is w -= lr (g + c - c_i) (under momentum, weight decay or gradient
clipping the correction passes through them too). After training, with y_i the client's result
and x the round's start,

    c_i+ = c_i - c + (x - y_i) / (sum of its steps' lr)      (K lr under a constant lr)
    c   += (1 / N) sum_i (c_i+ - c_i)                         (the round's clients)

and x becomes the learner's aggregate (the weighted mean of the y_i, global step size 1). Both
c and the c_i count as sent (down and up), which doubles the traffic, as in the paper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.lazy import torch
from fpbench.methods.base import Method, ServerState, Updates
from fpbench.registry import STRATEGIES
from fpbench.strategies.base import Strategy, buffer, global_floats

if TYPE_CHECKING:
    from torch import Tensor


@STRATEGIES.register()
class Scaffold(Strategy):
    """SCAFFOLD: FedAvg with control variates correcting each client's drift (option II)."""

    name = "scaffold"

    def client_step(
        self,
        server: ServerState,
        client_ids: Tensor,
        params: dict[str, Tensor],
        lr: float,
        active: Tensor,
    ) -> None:
        for n in global_floats(server):
            c, ci = server.buffers.get(f"scaffold.c.{n}"), server.buffers.get(f"scaffold.ci.{n}")
            if c is None or ci is None or n not in params or not params[n].requires_grad:
                continue  # round 1: every variate is zero
            w = params[n]
            corr = (c.unsqueeze(0) - ci[client_ids.to(ci.device)]).to(w)
            mask = active.to(w).view(-1, *[1] * (w.dim() - 1))
            with torch.no_grad():
                w.sub_(lr * mask * corr)

    def aggregate(
        self, method: Method, server: ServerState, updates: Updates, lr_steps: Tensor | None
    ) -> ServerState:
        if lr_steps is None:
            raise ValueError("scaffold needs each client's lr_steps (the executor's LocalResult)")
        new = method.aggregate(server, updates)
        buffers = dict(new.buffers)
        n_clients = method.task.num_clients
        ids = updates.client_ids
        for n in global_floats(server):
            x, y = server.params[n], updates.params[n].to(server.params[n])
            c = buffer(server, f"scaffold.c.{n}", x)
            ci = buffer(server, f"scaffold.ci.{n}", x.expand(n_clients, *x.shape))
            scale = lr_steps.to(x).view(-1, *[1] * x.dim())
            ci_new = ci[ids] - c + (x - y) / scale
            buffers[f"scaffold.c.{n}"] = c + (ci_new - ci[ids]).sum(0) / n_clients
            buffers[f"scaffold.ci.{n}"] = ci.index_copy(0, ids, ci_new)
        return ServerState(new.params, new.personal, buffers)

    def communication(
        self, method: Method, server: ServerState
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        down, up = method.communication(server)
        extra = {f"scaffold.c.{n}": server.params[n] for n in global_floats(server)}
        return {**down, **extra}, {**up, **extra}
