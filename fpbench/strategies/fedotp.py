"""FedOTP's aggregation (Li et al., CVPR 2024) for a learner with several prompts.

A learner whose prompts sit in one tensor with a leading prompts axis (PLOT's `ctx`, (N, n, d))
shares the first `shared` prompts and keeps the rest per client: the tensor becomes personal
(one row per client, the learner's inference personal), the server averages the shared prompts
of the round's clients by the aggregation weights and writes them into every client's row, and
each client keeps its own other prompts (FedOTP's federated_main.py: `ctx[:avg_prompt]`
averaged, `ctx[avg_prompt:num_prompt]` local). Only the shared prompts are sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.methods.base import Method, ServerState, Updates
from fpbench.methods.helpers import weighted_mean
from fpbench.registry import STRATEGIES
from fpbench.strategies.base import Strategy, StrategyConfig

if TYPE_CHECKING:
    from torch import Tensor


class FedOTPConfig(StrategyConfig):
    tensor: str = Field("ctx", description="the learner's tensor of prompts (N, ...)")
    shared: int = Field(1, ge=1, description="leading prompts averaged (FedOTP's avg_prompt)")


@STRATEGIES.register()
class FedOTPAggregation(Strategy):
    """FedOTP's aggregation: a several-prompt tensor's first prompts shared, the rest personal."""

    name = "fedotp"
    Config = FedOTPConfig

    def bind(self, method: Method) -> None:
        method.personal = frozenset(method.personal | {self.cfg.tensor})
        if not method.inference.startswith("personal"):
            method.inference = "personal"

    def _check_shape(self, rows: Tensor) -> None:
        if rows.dim() < 3 or rows.shape[1] <= self.cfg.shared:
            raise FpbenchError(
                f"strategy fedotp: tensor {self.cfg.tensor!r} must hold more than shared = "
                f"{self.cfg.shared} prompts along its first axis; its shape is "
                f"{tuple(rows.shape[1:])}"
            )

    def aggregate(
        self, method: Method, server: ServerState, updates: Updates, lr_steps: Tensor | None
    ) -> ServerState:
        name, s = self.cfg.tensor, self.cfg.shared
        if name not in server.personal:
            raise FpbenchError(f"strategy fedotp: the learner has no tensor {name!r}")
        self._check_shape(server.personal[name])
        new = method.aggregate(server, updates)
        trained = updates.params[name]
        w = (updates.weights / updates.weights.sum()).to(trained.dtype)
        rows = new.personal[name].clone()
        rows[:, :s] = weighted_mean(trained[:, :s], w).to(rows)
        return ServerState(new.params, {**new.personal, name: rows}, new.buffers)

    def communication(
        self, method: Method, server: ServerState
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        down, up = method.communication(server)
        part = {self.cfg.tensor: server.personal[self.cfg.tensor][0, : self.cfg.shared]}
        return {**down, **part}, {**up, **part}
