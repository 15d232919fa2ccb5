"""Run one cell of a suite file in this (fresh) process; optionally SIGKILL it part way.

    python -m tests.repro_worker SUITE.toml DB CKPT [--method NAME] [--no-deterministic]
        [--kill-after-round K | --kill-at-step N]

`--kill-after-round K`: once round K is stored and checkpointed (a round boundary).
`--kill-at-step N`: at the N-th local training step of the run, inside a round.
Used by tests/test_reproducibility.py: each run gets its own process and PyTorch's default
thread count, as a user's run does.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import tomllib

from fpbench.engine import executor
from fpbench.engine.rounds import Observer
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from fpbench.suites import expand_suite


class _KillAfter(Observer):
    def __init__(self, k: int) -> None:
        self.k = k

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.k:
            os.kill(os.getpid(), signal.SIGKILL)


def _kill_at_step(n: int) -> None:
    step, calls = executor._step, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(*args, **kwargs)

    executor._step = counted


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("suite", type=Path)
    ap.add_argument("db")
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--method")
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--kill-after-round", type=int)
    ap.add_argument("--kill-at-step", type=int)
    a = ap.parse_args()
    cells = expand_suite(tomllib.loads(a.suite.read_text()), name="repro").cells
    observer = Observer() if a.kill_after_round is None else _KillAfter(a.kill_after_round)
    if a.kill_at_step is not None:
        _kill_at_step(a.kill_at_step)
    with Store(f"sqlite:///{a.db}") as store:
        for cfg in cells:
            if a.method in (None, cfg.method.name):
                if a.no_deterministic:
                    runtime = cfg.runtime.model_copy(update={"deterministic": False})
                    cfg = cfg.model_copy(update={"runtime": runtime})
                assert (
                    run_cell(cfg, store, checkpoint_dir=a.ckpt, observer=observer).status == "done"
                )


if __name__ == "__main__":
    main()
