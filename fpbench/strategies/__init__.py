"""Federation strategies, a grid axis of their own (`fpbench list strategies`).

A suite's method entry may name one: ``strategy = { name = "fedprox", mu = 0.01 }``, or a
suite lists ``[[strategies]]`` to cross every method with every strategy. Without one, a cell
runs its method's own federation (FedAvg for every method that keeps the default `aggregate`).
"""

from fpbench.registry import STRATEGIES
from fpbench.specs import StrategyRef
from fpbench.strategies import fedotp, fedprox, scaffold, server_opt  # noqa: F401  (register)
from fpbench.strategies.base import (
    FedAvg,
    Strategy,
    StrategyConfig,
    learner_of,
    own_aggregate,
    strategy_label,
)

__all__ = [
    "FedAvg", "Strategy", "StrategyConfig", "build_strategy", "learner_of", "own_aggregate",
    "strategy_label",
]  # fmt: skip


def build_strategy(ref: StrategyRef | None) -> Strategy:
    """The strategy a cell's `method.strategy` names (None: FedAvg, the method's own)."""
    if ref is None:
        return FedAvg()
    cls = STRATEGIES.get(ref.name)
    return cls(cls.Config(**ref.args))
