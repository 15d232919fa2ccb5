"""Plain progress lines for `fpbench run` when stdout is not a terminal (cluster logs, tee).

One line per event, flushed at once, readable in a SLURM/Ray/submitit log or a `nohup` file:
a cell's start and end (status, wall time, final headline metrics), every evaluated round
(round i/N, global / local-mean / worst accuracy, training loss, elapsed, ETA) and the long
work outside the rounds (data preparation, frozen passes) with its progress, at most one line
per `every_s` seconds per stage. Implements `fpbench.engine.rounds.Observer` (duck-typed, so
the CLI's `--help` stays free of torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

HEADLINE = (
    ("acc_global", "global"),
    ("acc_local_mean", "local-mean"),
    ("acc_local_worst", "worst"),
)


def clock(seconds: float) -> str:
    """Seconds as h:mm:ss, or m:ss under an hour."""
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def headline(metrics: dict[str, float]) -> str:
    """'global 21.89%  local-mean 22.71%  worst 5.14%  loss 1.234' for the metrics present."""
    parts = [f"{label} {100 * metrics[k]:.2f}%" for k, label in HEADLINE if k in metrics]
    if "loss_train" in metrics:
        parts.append(f"loss {metrics['loss_train']:.4g}")
    return "  ".join(parts)


def cell_label(cfg: Any) -> str:
    return f"{cfg.method.label} / {cfg.dataset.label} / {cfg.partition.label} / seed {cfg.seed}"


class LineObserver:
    """Writes the progress of a suite's cells as plain lines to `stream`."""

    def __init__(
        self,
        stream: TextIO,
        total_cells: int,
        every_s: float = 10.0,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream, self.total, self.every_s, self.now = stream, total_cells, every_s, now
        self.ended = 0
        self.started: dict[str, tuple[float, int]] = {}  # run_key -> (time, first round)
        self.setup: dict[str, float] = {}  # run_key -> when its setup (data, frozen passes) began
        self.last: dict[str, dict[str, float]] = {}  # run_key -> last evaluated metrics
        self.stage_shown: dict[tuple[str, str], float] = {}  # (run_key, what) -> last line

    def _line(self, text: str) -> None:
        self.stream.write(f"{time.strftime('%H:%M:%S')} {text}\n")
        self.stream.flush()

    def cell_start(self, cfg: Any, start_round: int) -> None:
        self.started[cfg.run_key] = (self.now(), start_round)
        resumed = f", resuming after round {start_round}/{cfg.train.rounds}" if start_round else ""
        rounds = f"{cfg.train.rounds} round{'s' if cfg.train.rounds != 1 else ''}"
        self._line(f"start  {cell_label(cfg)} ({rounds}{resumed})")

    def round_end(self, cfg: Any, round_idx: int, metrics: dict[str, float]) -> None:
        if not metrics:
            return  # only evaluated rounds get a line
        self.last[cfg.run_key] = metrics
        t0, first = self.started.get(cfg.run_key, (self.now(), round_idx))
        elapsed = self.now() - t0
        done, total = round_idx + 1, cfg.train.rounds
        eta = elapsed / max(done - first, 1) * (total - done)
        self._line(
            f"round {done}/{total}  {cell_label(cfg)}  {headline(metrics)}  "
            f"elapsed {clock(elapsed)}  ETA {clock(eta)}"
        )

    def stage(self, cfg: Any, what: str, done: int, total: int) -> None:
        key = (cfg.run_key if cfg is not None else "", what)
        now = self.now()
        if cfg is not None:
            self.setup.setdefault(cfg.run_key, now)
        last = self.stage_shown.get(key)
        if 0 < done < total and last is not None and now - last < self.every_s:
            return
        self.stage_shown[key] = now
        where = f"  {cell_label(cfg)}" if cfg is not None else ""
        if done == 0:
            state = "started"
        elif done < total:
            state = f"{done}/{total}"
        else:
            state = f"{done}/{total} done" if total > 1 else "done"
        self._line(f"{what}: {state}{where}")

    def cell_end(self, result: Any) -> None:
        self.ended += 1
        cfg = result.cfg
        t0, _ = self.started.pop(cfg.run_key, (None, 0))
        t0 = self.setup.pop(cfg.run_key, t0)  # the wall time includes the cell's setup
        status = result.status
        if status == "skipped" and result.error is None:
            status = "skipped (already done)"
        elif result.error:
            status = f"{status}: {result.error}"
        wall = f" in {clock(self.now() - t0)}" if t0 is not None else ""
        final = headline(self.last.pop(cfg.run_key, {}))
        self._line(
            f"end    [{self.ended}/{self.total}] {cell_label(cfg)}  {status}{wall}"
            + (f"  {final}" if final and result.status == "done" else "")
        )
