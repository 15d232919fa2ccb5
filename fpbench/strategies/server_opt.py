"""Server optimisers: FedAvgM (Hsu et al. 2019) and FedAdam, FedYogi, FedAdagrad (Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021), as Flower ships them.

Each round the learner's aggregate gives the averaged global tensors; their difference from the
round's start, delta = avg - x, is the pseudo-gradient (with the sign that moves towards the
average) that a server optimiser steps with. Personal rows and buffers are the aggregate's. The
optimisers' state (momentum, first and second moments, the round count) lives in the server's
buffers, `<strategy>.<m|v|t>.<param>`, so that a resumed run continues it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Method, ServerState, Updates
from fpbench.registry import STRATEGIES
from fpbench.strategies.base import Strategy, StrategyConfig, buffer, global_floats

if TYPE_CHECKING:
    from torch import Tensor


class ServerOptimizer(Strategy):
    """A server step on delta = avg - x per global tensor; subclasses write `step`."""

    def aggregate(
        self, method: Method, server: ServerState, updates: Updates, lr_steps: Tensor | None
    ) -> ServerState:
        avg = method.aggregate(server, updates)
        params, buffers = dict(avg.params), dict(avg.buffers)
        t_name = f"{self.name}.t"
        t = int(server.buffers[t_name]) + 1 if t_name in server.buffers else 1
        for name in global_floats(server):
            x = server.params[name]
            state = {k: buffer(server, f"{self.name}.{k}.{name}", x) for k in self.state_keys}
            params[name], new = self.step(x, avg.params[name] - x, state, t)
            buffers.update({f"{self.name}.{k}.{name}": v for k, v in new.items()})
        buffers[t_name] = torch.tensor(t)
        return ServerState(params, avg.personal, buffers)

    state_keys: tuple[str, ...] = ()

    def step(
        self, x: Tensor, delta: Tensor, state: dict[str, Tensor], t: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The new value of a tensor at x given its pseudo-gradient, and its new state."""
        raise NotImplementedError


class FedAvgMConfig(StrategyConfig):
    server_lr: float = Field(1.0, gt=0, description="server learning rate (Flower's 1.0)")
    momentum: float = Field(0.9, ge=0, lt=1, description="server momentum beta")


@STRATEGIES.register()
class FedAvgM(ServerOptimizer):
    """FedAvgM: server momentum, v = beta v + (x - avg); x = x - server_lr v."""

    name = "fedavgm"
    Config = FedAvgMConfig
    state_keys = ("m",)

    def step(self, x, delta, state, t):
        v = self.cfg.momentum * state["m"] - delta
        return x - self.cfg.server_lr * v, {"m": v}


class AdaptiveConfig(StrategyConfig):
    eta: float = Field(0.1, gt=0, description="server learning rate")
    beta_1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    beta_2: float = Field(0.99, ge=0, lt=1, description="second-moment decay")
    tau: float = Field(1e-9, gt=0, description="adaptivity (the denominator's epsilon)")


class Adaptive(ServerOptimizer):
    """m = b1 m + (1 - b1) delta; v = second_moment(v, delta); x = x + lr_t m / (sqrt v + tau)."""

    state_keys = ("m", "v")

    def step(self, x, delta, state, t):
        c = self.cfg
        m = c.beta_1 * state["m"] + (1 - c.beta_1) * delta
        v = self.second_moment(state["v"], delta)
        return x + self.lr(t) * m / (v.sqrt() + c.tau), {"m": m, "v": v}

    def lr(self, t: int) -> float:
        return self.cfg.eta

    def second_moment(self, v: Tensor, delta: Tensor) -> Tensor:
        raise NotImplementedError


class FedAdamConfig(AdaptiveConfig):
    bias_correction: bool = Field(
        True,
        description="scale eta by sqrt(1 - b2^(t+1)) / (1 - b1^(t+1)) in round t (from 1), as "
        "Flower's FedAdam; false: Reddi et al.'s Algorithm 2, without",
    )


@STRATEGIES.register()
class FedAdam(Adaptive):
    """FedAdam: Adam on the server, v = b2 v + (1 - b2) delta^2 (Flower's defaults).

    Flower's defaults: eta 0.1, betas 0.9 / 0.99, tau 1e-9, moments starting at 0."""

    name = "fedadam"
    Config = FedAdamConfig

    def lr(self, t: int) -> float:
        c = self.cfg
        if not c.bias_correction:
            return c.eta
        return c.eta * (1 - c.beta_2 ** (t + 1)) ** 0.5 / (1 - c.beta_1 ** (t + 1))

    def second_moment(self, v, delta):
        return self.cfg.beta_2 * v + (1 - self.cfg.beta_2) * delta * delta


class FedYogiConfig(AdaptiveConfig):
    eta: float = Field(0.01, gt=0, description="server learning rate (Flower's 1e-2)")
    tau: float = Field(1e-3, gt=0, description="adaptivity (Flower's 1e-3)")


@STRATEGIES.register()
class FedYogi(Adaptive):
    """FedYogi: Yogi on the server, v = v - (1 - b2) delta^2 sign(v - delta^2).

    Flower's defaults: eta 0.01, betas 0.9 / 0.99, tau 1e-3."""

    name = "fedyogi"
    Config = FedYogiConfig

    def second_moment(self, v, delta):
        d2 = delta * delta
        return v - (1 - self.cfg.beta_2) * d2 * torch.sign(v - d2)


class FedAdagradConfig(StrategyConfig):
    eta: float = Field(0.1, gt=0, description="server learning rate")
    beta_1: float = Field(0.0, ge=0, lt=1, description="first-moment decay (Flower's 0)")
    tau: float = Field(1e-9, gt=0, description="adaptivity (the denominator's epsilon)")


@STRATEGIES.register()
class FedAdagrad(Adaptive):
    """FedAdagrad: Adagrad on the server, v = v + delta^2 (Flower's defaults).

    Flower's defaults: eta 0.1, beta_1 0, tau 1e-9."""

    name = "fedadagrad"
    Config = FedAdagradConfig

    def second_moment(self, v, delta):
        return v + delta * delta
