"""Cells as Ray tasks (`--launcher ray`) on an existing cluster (`--address`) or a local one.

Each cell is one task with `--gpus-per-cell` (fractions pack several runs on one GPU) and
`--cpus-per-cell`; fpbench must be installed on the Ray workers. Without an address a local Ray
instance with `--jobs` CPUs is started and shut down afterwards.
"""

from __future__ import annotations

from pathlib import Path

from fpbench.engine.launch import Dispatch
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import finish, run_one
from fpbench.specs import RunConfig

POLL_S = 1.0


def run_ray(
    cells: list[RunConfig], url: str, ckpt: Path, dispatch: Dispatch, observer: Observer
) -> list[CellResult]:
    """Submit every cell as a Ray task and report each as it ends."""
    import ray  # optional extra; `dispatch.validate` checks it is installed

    started = not ray.is_initialized()
    if started:
        kwargs = {"address": dispatch.address} if dispatch.address else {"num_cpus": dispatch.jobs}
        ray.init(**kwargs, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=dispatch.cpus_per_cell, num_gpus=dispatch.gpus_per_cell)(run_one)
        refs = {task.remote(c, url, str(ckpt), dispatch.claim_timeout): c for c in cells}
        results: dict[str, CellResult] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=POLL_S)
            for ref in done:
                results[refs[ref].run_key] = finish(refs[ref], _outcome(ray, ref), observer)
    finally:
        if started:
            ray.shutdown()
    return [results[c.run_key] for c in cells]


def _outcome(ray, ref) -> tuple[str, str | None]:
    try:
        return ray.get(ref)
    except Exception as e:  # the worker died or the task could not run
        return ("failed", f"Ray task failed: {type(e).__name__}: {str(e).splitlines()[0]}")
