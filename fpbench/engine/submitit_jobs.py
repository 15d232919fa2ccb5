"""Cells as SLURM jobs through submitit (`--launcher slurm`), or as local submitit jobs.

`--launcher submitit-local` runs the same path on this machine (one subprocess per cell, at
most `--jobs` at once). On SLURM the cells form one job array whose parallelism is `--jobs`; a
preempted or timed-out job is requeued (`Checkpointable`) and resumes from its last round.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import submitit  # optional extra; `dispatch.validate` checks it is installed

from fpbench.engine.launch import Dispatch, visible_gpus
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import Outcome, finish, note_exit, run_one
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig

POLL_S = 0.5


class CellJob(submitit.helpers.Checkpointable):
    """One cell as a submitit job; requeued with the same arguments when preempted.

    On preemption or near its time limit SLURM signals the job; submitit calls `checkpoint`,
    requeues the job and exits it (SystemExit) in the middle of the cell's round: the cell is
    stored `interrupted` (not `failed`) with that reason, and the requeued job, the same job id
    with a higher SLURM_RESTART_COUNT, takes its claim over at once and resumes from the last
    stored round (`fpbench.store.claims.owner_is_gone`).
    """

    def __call__(
        self, cfg: RunConfig, url: str, checkpoint_dir: str, claim_timeout: float
    ) -> Outcome:
        return run_one(cfg, url, checkpoint_dir, claim_timeout)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Requeue with the same arguments (the cell resumes from its stored rounds)."""
        note_exit("SLURM preempted or timed out the job; requeued")
        return super().checkpoint(*args, **kwargs)


def run_submitit(
    cells: list[RunConfig], url: str, ckpt: Path, dispatch: Dispatch, observer: Observer
) -> list[CellResult]:
    """Submit the cells and wait for them, reporting each as it ends."""
    executor = _executor(dispatch)
    args = (url, str(ckpt), dispatch.claim_timeout)
    if dispatch.launcher == "slurm":
        with executor.batch():
            jobs = [executor.submit(CellJob(), cfg, *args) for cfg in cells]
        return _wait(list(zip(cells, jobs, strict=True)), observer)
    return _rolling(cells, executor, args, dispatch.jobs, observer)


def _executor(dispatch: Dispatch) -> Any:
    gpus = math.ceil(dispatch.gpus_per_cell)
    if dispatch.launcher == "submitit-local":
        local = submitit.LocalExecutor(folder=dispatch.folder / "%j")
        if gpus == 0:  # the GPUs `--launcher local` would use, not none
            visible = driver_gpus()
            local.update_parameters(gpus_per_node=len(visible), visible_gpus=tuple(visible))
        else:
            local.update_parameters(gpus_per_node=gpus)
        local.update_parameters(timeout_min=dispatch.timeout_min)
        return local
    executor = submitit.AutoExecutor(folder=dispatch.folder / "%j", cluster="slurm")
    params: dict[str, Any] = {
        "name": "fpbench",
        "timeout_min": dispatch.timeout_min,
        "cpus_per_task": dispatch.cpus_per_cell,
        "gpus_per_node": gpus,
        "slurm_array_parallelism": dispatch.jobs,
    }
    if dispatch.slurm_partition:
        params["slurm_partition"] = dispatch.slurm_partition
    executor.update_parameters(**params)
    return executor


def driver_gpus() -> list[int]:
    """The GPUs this process sees, by the indices a local job's CUDA_VISIBLE_DEVICES takes.

    submitit's local jobs see only the GPUs they are given (none by default), so without this
    `--launcher submitit-local` would run every cell on the CPU of a GPU machine.
    """
    ids = visible_gpus()
    if not all(i.isdigit() for i in ids):
        raise FpbenchError(
            f"--launcher submitit-local gives its jobs GPUs by index, but CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r} names them otherwise; use indices, "
            "or --launcher local"
        )
    return [int(i) for i in ids]


def _rolling(
    cells: list[RunConfig], executor: Any, args: tuple, window: int, observer: Observer
) -> list[CellResult]:
    """At most `window` local jobs at once (submitit's local executor has no limit of its own)."""
    todo, running, results = list(cells), [], {}
    while todo or running:
        while todo and len(running) < window:
            cfg = todo.pop(0)
            running.append((cfg, executor.submit(CellJob(), cfg, *args)))
        running = _collect(running, results, observer)
    return [results[c.run_key] for c in cells]


def _wait(pairs: list[tuple[RunConfig, Any]], observer: Observer) -> list[CellResult]:
    results: dict[str, CellResult] = {}
    running = pairs
    while running:
        running = _collect(running, results, observer)
    return [results[cfg.run_key] for cfg, _ in pairs]


def _collect(running: list, results: dict[str, CellResult], observer: Observer) -> list:
    """Record the finished jobs; return the ones still running (after a short sleep)."""
    still = []
    for cfg, job in running:
        if job.done():
            results[cfg.run_key] = finish(cfg, _outcome(job), observer)
        else:
            still.append((cfg, job))
    if still:
        time.sleep(POLL_S)
    return still


def _outcome(job: Any) -> Outcome:
    try:
        return job.result()
    except Exception as e:  # the job died: killed, out of time, node failure
        first = str(e).strip().splitlines()
        return ("failed", f"job {job.job_id} failed: {first[0] if first else type(e).__name__}")
