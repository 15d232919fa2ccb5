"""Each method's training budget in a suite, against the others': who trains much less.

A cell's budget is the training samples its mean client processes over the run:
rounds x min(local_epochs x n, max_local_steps x batch_size), n the mean client's train size
(the dataset's train size, or shots x classes with `partition.shots`, over the clients, less
the held-out ones). A method's fraction is its budget over the median budget of the trained
methods of the same dataset, partition, backbone and seed. A suite's protocol may state
`min_budget_fraction` and name, in `[short_budget]`, the methods allowed below it, with why
(`fpbench.report.suite_protocol`); `fpbench table --suite` prints those notes.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

UNTRAINED = frozenset({"zero-shot"})  # methods that train nothing: no budget to compare


@dataclass(frozen=True)
class Budget:
    method: str  # label
    fraction: float  # of the median budget of its group, the lowest over its groups
    samples: float  # the mean client's training samples over the run, in that group


def cell_budget(cfg: Any) -> float:
    """Training samples the mean client of `cfg` processes over the run."""
    from fpbench.registry import DATASETS

    ds = DATASETS.get(cfg.dataset.name)
    info = ds.info(ds.Config(**cfg.dataset.args))
    p = cfg.partition.args
    train = info.train_size
    if p.get("shots"):
        train = min(train, p["shots"] * info.num_classes)
    clients = max(1, round(p.get("num_clients", 1) * (1 - p.get("heldout_frac", 0.0))))
    n = train / p.get("num_clients", 1) if p.get("num_clients") else train / clients
    t = cfg.train
    per_round = t.local_epochs * n
    if t.max_local_steps is not None:
        per_round = min(per_round, t.max_local_steps * t.batch_size)
    return t.rounds * per_round


def budgets(cells: Iterable[Any]) -> list[Budget]:
    """Every trained method's lowest budget fraction over its groups, lowest first."""
    groups: dict[tuple, list[tuple[str, float]]] = {}
    for cfg in cells:
        if cfg.method.name in UNTRAINED:
            continue
        key = (cfg.dataset.label, cfg.partition.label, cfg.backbone.name, cfg.seed)
        groups.setdefault(key, []).append((cfg.method.label, cell_budget(cfg)))
    low: dict[str, Budget] = {}
    for members in groups.values():
        median = statistics.median(b for _, b in members)
        for label, b in members:
            frac = b / median if median else 1.0
            if label not in low or frac < low[label].fraction:
                low[label] = Budget(label, frac, b)
    return sorted(low.values(), key=lambda b: (b.fraction, b.method))


def budget_problems(
    cells: Iterable[Any], min_fraction: float | None, allowed: Mapping[str, str]
) -> list[str]:
    """Each method below `min_fraction` of the median budget that `allowed` does not name,
    and each name of `allowed` that is not below it."""
    if min_fraction is None:
        return []
    found = budgets(cells)
    short = {b.method for b in found if b.fraction < min_fraction}
    out = [
        f"{b.method} trains {b.fraction:.0%} of the median budget (< {min_fraction:.0%}) and its "
        "protocol's [short_budget] does not say why"
        for b in found
        if b.method in short and b.method not in allowed
    ]
    out += [
        f"[short_budget] names {m}, which trains at least {min_fraction:.0%} of the median"
        for m in sorted(set(allowed) - short)
    ]
    return out


def budget_notes(
    cells: Iterable[Any], min_fraction: float, allowed: Mapping[str, str]
) -> list[str]:
    """One line per method below `min_fraction` of the median budget, with its reason."""
    return [
        f"note: {b.method} trains {b.fraction:.0%} of the median budget: "
        f"{allowed.get(b.method, 'no reason given')}"
        for b in budgets(cells)
        if b.fraction < min_fraction
    ]
