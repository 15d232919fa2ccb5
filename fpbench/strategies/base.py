"""A federation strategy: what the server does with a round's uploads, and what a client adds
to its objective.

A learner (a `Method`) owns its parameters and its forward; a strategy owns the federation
around them. The server step starts from the learner's `aggregate` (FedAvg by the weights,
personal rows written back, unless the learner has its own rule) and may move the global
parameters further (a server optimiser), keep state of its own (in `ServerState.buffers`, names
`<strategy>.<what>.<param>`, so that checkpoints carry it), or keep part of a tensor per client
(FedOTP). A client may add a term to its per-client loss (`client_term`: FedProx's proximal
term) or move its tensors after each optimiser step (`client_step`: SCAFFOLD's correction).

A learner that overrides `aggregate` (its federation is its contribution, as SGPT's) takes only
`fedavg`, which then means its own rule; `check` refuses the rest at suite load.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict

from fpbench.errors import FpbenchError
from fpbench.methods.base import Method, ServerState, Updates
from fpbench.registry import STRATEGIES

if TYPE_CHECKING:
    from torch import Tensor


class StrategyConfig(BaseModel):
    """Base of every strategy's typed, frozen settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Strategy:
    """The federation of a cell: the server step and a client's extra term (default FedAvg)."""

    name: ClassVar[str]
    Config: ClassVar[type[StrategyConfig]] = StrategyConfig

    def __init__(self, cfg: StrategyConfig | None = None) -> None:
        self.cfg = cfg if cfg is not None else self.Config()

    @classmethod
    def check(cls, learner: type[Method]) -> None:
        """Raise FpbenchError where `learner` cannot take this strategy (at suite load)."""
        if own_aggregate(learner):
            raise FpbenchError(
                f"method {learner.name!r} federates by its own aggregate and takes only "
                f"strategy 'fedavg' (its own rule), not {cls.name!r}"
            )

    def bind(self, method: Method) -> None:
        """Adjust a built learner instance before its server state is made (default: none)."""

    def aggregate(
        self, method: Method, server: ServerState, updates: Updates, lr_steps: Tensor | None
    ) -> ServerState:
        """The new server state. `lr_steps` (K,): the sum over each client's optimiser steps
        of the run's lr in that step (K * lr under a constant lr), for control variates."""
        return method.aggregate(server, updates)

    def client_term(
        self, server: ServerState, client_ids: Tensor, params: dict[str, Tensor]
    ) -> Tensor | None:
        """A per-client term (K,) added to each client's mean loss at every local step, from the
        tensors being trained (`params`, (K, ...)); None: nothing to add."""
        return None

    def client_step(
        self,
        server: ServerState,
        client_ids: Tensor,
        params: dict[str, Tensor],
        lr: float,
        active: Tensor,
    ) -> None:
        """Move the trained tensors (`params`, (K, ...)) in place after each optimiser step of
        the `active` (K,) rows, `lr` the step's run lr (default: nothing)."""

    def communication(
        self, method: Method, server: ServerState
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Tensors (down, up) exchanged per participating client: the learner's."""
        return method.communication(server)


@STRATEGIES.register()
class FedAvg(Strategy):
    """FedAvg: the learner's aggregate (the uploads' weighted mean, or the learner's own rule).

    McMahan et al., AISTATS 2017."""

    name = "fedavg"

    @classmethod
    def check(cls, learner: type[Method]) -> None:
        return None


def own_aggregate(learner: type[Method]) -> bool:
    """Whether `learner` federates by an `aggregate` of its own."""
    return inspect.getattr_static(learner, "aggregate") is not Method.__dict__["aggregate"]


def learner_of(cls: type[Method]) -> str:
    """The registered learner a method is a preset of (PromptFL: `coop`), else its own name: a
    subclass of a registered method that only renames it (name and docstring) is a preset."""
    base = cls.__bases__[0]
    renames = set(vars(cls)) <= {"name", "__doc__", "__module__", "__qualname__"}
    if renames and isinstance(getattr(base, "name", None), str) and base.name != cls.name:
        return learner_of(base)
    return cls.name


def strategy_label(config: dict) -> str:
    """The strategy a stored run config ran: its name, `fedavg` for a method on the default
    aggregate, `own` for one that federates by its own."""
    from fpbench.registry import METHODS

    ref = config["method"].get("strategy")
    if ref:
        return ref["name"]
    return "own" if own_aggregate(METHODS.get(config["method"]["name"])) else "fedavg"


def global_floats(server: ServerState) -> list[str]:
    """The names of the server's global floating-point tensors, which strategies move."""
    return [n for n, t in server.params.items() if t.is_floating_point()]


def buffer(server: ServerState, name: str, like: Tensor) -> Tensor:
    """The strategy buffer `name`, or zeros shaped like `like` before its first round."""
    found = server.buffers.get(name)
    return like.new_zeros(like.shape) if found is None else found
