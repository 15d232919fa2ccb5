"""The task every launcher runs for one cell (`run_one`, in whichever process) and the driver's
end of it (`finish`), with the settings of a dispatch; `dispatch` and the launchers it starts
(`ray_tasks`, `submitit_jobs`) import them from here, never from each other."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fpbench.engine.inputs import FeatureCache
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import error_text, run_cell
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig
from fpbench.store import CLAIM_TIMEOUT_S, Store

CELL_KEY = "{run_key}"  # placeholder in a database URL: one database per cell

Outcome = tuple[str, str | None]  # (done | skipped | failed | error, message)


@dataclass(frozen=True)
class Dispatch:
    """How cells are dispatched; nothing here changes a cell's results."""

    launcher: str = "local"  # where cells run (`--launcher`); not how clients train
    jobs: int = 1  # cells at once (local processes, submitit-local jobs, SLURM array parallelism)
    folder: Path = Path("results/jobs")  # submitit's pickles and logs
    address: str | None = None  # Ray cluster address; None starts a local Ray instance
    gpus_per_cell: float = 0.0
    cpus_per_cell: int = 1
    timeout_min: int = 24 * 60
    slurm_partition: str | None = None
    claim_timeout: float = CLAIM_TIMEOUT_S


def cell_url(url: str, cfg: RunConfig) -> str:
    """The database of one cell: `url` with `{run_key}` filled in."""
    return url.replace(CELL_KEY, cfg.run_key)


_worker: dict[str, Any] = {}  # per worker process: the event queue and the feature cache


class _QueueObserver(Observer):
    """Forwards a worker's progress to the driver."""

    def __init__(self, events: Any) -> None:
        self.events = events

    def cell_start(self, cfg: RunConfig, start_round: int) -> None:
        self.events.put(("start", cfg.run_key, start_round, {}))

    def round_end(self, cfg: RunConfig, round_idx: int, metrics: dict[str, float]) -> None:
        self.events.put(("round", cfg.run_key, round_idx, metrics))

    def stage(self, cfg: RunConfig | None, what: str, done: int, total: int) -> None:
        if cfg is not None:
            self.events.put(("stage", cfg.run_key, done, {"what": what, "total": total}))


def run_one(
    cfg: RunConfig,
    url: str,
    checkpoint_dir: str,
    claim_timeout: float = CLAIM_TIMEOUT_S,
    observer: Observer | None = None,
) -> Outcome:
    """Run one cell in this process and return (status, message); never raises for a cell."""
    events = _worker.get("events")
    if observer is None:
        observer = _QueueObserver(events) if events is not None else Observer()
    try:
        with Store(cell_url(url, cfg)) as store:
            result = run_cell(
                cfg,
                store,
                checkpoint_dir=Path(checkpoint_dir),
                observer=observer,
                cache=worker_cache(),
                claim_timeout=claim_timeout,
            )
    except FpbenchError as e:
        return ("error", str(e))
    except Exception as e:  # recorded as failed in the database by run_cell
        return ("failed", error_text(e))
    return (result.status, result.error)


def finish(cfg: RunConfig, outcome: Outcome, observer: Observer) -> CellResult:
    """The driver's end of one cell: a user error stops everything, the rest is reported."""
    status, message = outcome
    if status == "error":
        raise FpbenchError(message or "a cell failed with a user error")
    result = CellResult(cfg, status, message)
    observer.cell_end(result)
    return result


def worker_cache() -> FeatureCache:
    """This process's feature cache, shared by the cells it runs."""
    return _worker.setdefault("cache", FeatureCache())


def set_worker_events(events: Any) -> None:
    """A pool worker's queue, to which its cells' progress goes."""
    _worker["events"] = events


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all, where unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    return [i.strip() for i in visible.split(",") if i.strip()]
