"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

A client minimises its loss plus (mu / 2) ||w - w_global||^2 over the global tensors it trains,
w_global being the round's start; the server aggregates as FedAvg (Flower's FedProx is FedAvg on
the server, the term is the client's). Personal tensors have no global value and take no term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.methods.base import ServerState
from fpbench.registry import STRATEGIES
from fpbench.strategies.base import Strategy, StrategyConfig, global_floats

if TYPE_CHECKING:
    from torch import Tensor


class FedProxConfig(StrategyConfig):
    mu: float = Field(0.01, ge=0, description="proximal weight (Flower's proximal_mu)")


@STRATEGIES.register()
class FedProx(Strategy):
    """FedProx: FedAvg, and each client's loss + (mu / 2) ||w - w_global||^2."""

    name = "fedprox"
    Config = FedProxConfig

    def client_term(
        self, server: ServerState, client_ids: Tensor, params: dict[str, Tensor]
    ) -> Tensor | None:
        terms = [
            (params[n] - server.params[n].to(params[n])).pow(2).flatten(1).sum(1)
            for n in global_floats(server)
            if n in params and params[n].requires_grad
        ]
        if not terms:
            return None
        return 0.5 * self.cfg.mu * sum(terms)
