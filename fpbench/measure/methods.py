"""`fpbench bench --methods PATTERN`: one round and one evaluation of every registered method,
timed on the tiny federation of the conformance tests, to compare two commits method by method.

Each method runs on the tiny federation of `fpbench.tiny`, the conformance tests' one (synthetic
data, 6 classes of 16 px, 4 clients, one held out, batch 8, one local epoch) with the test-sized
backbone of its family (`vit-test`, or `clip-test` for a CLIP method), through the engine's own
code: the cell as the engine builds it (`fpbench.engine.cell.Cell`, frozen values kept in
memory), a round of local training of every trainable client with the run's executor and the
aggregation (`fpbench.engine.rounds.play_round`), and one evaluation
(`evaluate_populations`), all as the cell computes (`fpbench.engine.numerics.cell_numerics`).
The first round and evaluation, which also compute the frozen passes and warm up, are timed
apart; then the same round (same server state, same clients) and the same evaluation are
timed `repeats` times each and their medians reported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpbench.registry import METHODS
from fpbench.specs import RunConfig
from fpbench.suites import expand_suite
from fpbench.tiny import tiny_backbone, tiny_suite


@dataclass(frozen=True)
class MethodTime:
    """Seconds of one method's round and evaluation (None and `error` where it failed)."""

    method: str
    backbone: str
    round_s: float | None  # median of the repeated rounds (frozen values already kept)
    round_cpu_s: float | None  # their median CPU seconds (all threads; steadier on a busy CPU)
    eval_s: float | None  # median of the repeated evaluations
    first_round_s: float | None  # the first round: its frozen passes and warm-up included
    first_eval_s: float | None  # the first evaluation: the test split's frozen passes included
    error: str | None = None


def tiny_cell(method: str, device: torch.device, precision: str) -> RunConfig:
    """The tiny federation's cell of `method` on this device, evaluated only when asked."""
    raw = tiny_suite(method, eval_every=10**9, eval_last=0)
    runtime = {"device": str(device), "precision": precision, "cache_features": "memory"}
    raw["defaults"]["runtime"] = runtime
    return expand_suite(raw, name="bench-methods").cells[0]


def time_method(cfg: RunConfig, device: torch.device, repeats: int) -> MethodTime:
    """Time one method's cell (see the module docstring)."""
    from fpbench.engine.cell import Cell
    from fpbench.engine.numerics import cell_numerics
    from fpbench.engine.rounds import evaluate_populations, play_round
    from fpbench.engine.seeding import derive_seed
    from fpbench.measure.estimate import _offline_args

    cfg = _offline_args(cfg)
    with cell_numerics(cfg):
        cell = Cell.build(cfg, device, pretrained=False)
        cell = cell.with_schedule([cell.task.trainable_clients()])  # every client trains
        (population,) = cell.populations
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "init-params"))
        server = population.method.init_server(gen).to(device)
        trained, first_round, _ = _timed(lambda: play_round(cell, server, 0, [])[0], device)
        servers = {population.key: trained}
        evaluate = lambda: evaluate_populations(cell, servers, [], 0, cell.seen(0))  # noqa: E731
        _, first_eval, _ = _timed(evaluate, device)
        rounds = [
            _timed(lambda: play_round(cell, server, 0, []), device)[1:] for _ in range(repeats)
        ]
        evals = [_timed(evaluate, device)[1] for _ in range(repeats)]
    return MethodTime(
        method=cfg.method.name,
        backbone=cfg.backbone.name,
        round_s=_median([wall for wall, _ in rounds]),
        round_cpu_s=_median([cpu for _, cpu in rounds]),
        eval_s=_median(evals),
        first_round_s=first_round,
        first_eval_s=first_eval,
    )


def method_times(
    pattern: str = "*",
    device: torch.device | None = None,
    precision: str = "auto",
    repeats: int = 3,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[MethodTime]:
    """Each registered method matching `pattern` (fnmatch, e.g. 'sgpt*'), timed in name order;
    a method that fails is reported with its error and the others still run.

    Raises:
        ValueError: no registered method matches `pattern`.
    """
    device = device or torch.device("cpu")
    names = METHODS.names(pattern)
    if not names:
        raise ValueError(f"no registered method matches {pattern!r}; see `fpbench list methods`")
    out = []
    for i, name in enumerate(names):
        if progress is not None:
            progress(i, len(names), name)
        try:
            out.append(time_method(tiny_cell(name, device, precision), device, repeats))
        except Exception as e:  # one method that cannot run here does not stop the others
            backbone = tiny_backbone(name)
            error = f"{type(e).__name__}: {e}"
            out.append(MethodTime(name, backbone, None, None, None, None, None, error))
    return out


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float, float]:
    """`fn()`'s result, its wall seconds and this process's CPU seconds, the device
    synchronised."""
    start, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start, time.process_time() - cpu


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def total(times: list[MethodTime], field: str) -> float:
    """The sum of one field over the methods that ran (NaN where none did)."""
    values = [getattr(t, field) for t in times if t.error is None]
    return math.fsum(values) if values else math.nan
