"""Where a suite's cells run: this process, a local process pool, SLURM via submitit, or Ray.

fpbench has no cluster code of its own. Every backend ends in `run_one` -> `run_cell` in some
process, so claims, resume and storage behave the same everywhere; the backend only decides
where that process is. A database URL containing `{run_key}` gives every cell its own SQLite
file (shared storage without a database server; fold them with `fpbench db merge`).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import shutil
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fpbench.engine.launch import Dispatch, visible_gpus
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import (
    CELL_KEY,
    Outcome,
    cell_url,
    finish,
    run_one,
    run_suite,
    set_worker_events,
    worker_cache,
)
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig
from fpbench.store import Store

LAUNCHERS = ("local", "submitit-local", "slurm", "ray")
ENGINES = {  # launcher -> (module it needs, fpbench's extra that installs it)
    "submitit-local": ("submitit", "slurm"),
    "slurm": ("submitit", "slurm"),
    "ray": ("ray", "ray"),
}


def run_cells(
    cells: list[RunConfig],
    url: str,
    *,
    checkpoint_dir: Path,
    dispatch: Dispatch = Dispatch(),
    observer: Observer | None = None,
) -> list[CellResult]:
    """Run or resume every cell with the chosen launcher; results follow the order of `cells`.

    Raises:
        FpbenchError: an unknown launcher, a missing optional engine, or a user error raised
            by a cell (missing data, unknown weights), which stops the dispatch.
    """
    observer = observer or Observer()
    validate(dispatch)
    cells = pin_threads(cells, dispatch)
    if dispatch.launcher == "local" and dispatch.jobs == 1:
        return _serial(cells, url, Path(checkpoint_dir), dispatch, observer)
    if dispatch.launcher == "local":
        run = _pool
    elif dispatch.launcher == "ray":
        from fpbench.engine.ray_tasks import run_ray as run
    else:
        from fpbench.engine.submitit_jobs import run_submitit as run
    done = _already_done(cells, url)
    skipped = {k: finish(c, ("skipped", None), observer) for k, c in done.items()}
    todo = [c for c in cells if c.run_key not in done]
    with _passive_omp_waits():
        ran = run(todo, url, Path(checkpoint_dir), dispatch, observer) if todo else []
    by_key = {**skipped, **{r.cfg.run_key: r for r in ran}}
    return [by_key[c.run_key] for c in cells]


def pin_threads(cells: list[RunConfig], dispatch: Dispatch) -> list[RunConfig]:
    """Deterministic cells without `runtime.threads` compute with this process's thread count.

    CPU matrix kernels split their work by threads, so a `--jobs` worker or Ray task with its
    share of the cores would store other last bits than a serial run. SLURM jobs and a Ray
    cluster run on other machines, where the count is theirs.
    """
    if dispatch.launcher == "slurm" or (dispatch.launcher == "ray" and dispatch.address):
        return cells
    threads = torch.get_num_threads()
    return [
        c.model_copy(update={"runtime": c.runtime.model_copy(update={"threads": threads})})
        if c.runtime.deterministic and c.runtime.threads is None
        else c
        for c in cells
    ]


@contextmanager
def _passive_omp_waits() -> Iterator[None]:
    """Worker processes started in the block sleep rather than spin while waiting for a thread.

    Several workers that each compute with all the cores (`pin_threads`) take turns on them;
    OpenMP's default spinning then about doubles their time (2 x 2 threads on 2 cores: 64 s
    against 30 s for the same work), sleeping costs about 3%. OpenMP reads the setting when a
    process loads it, so it is set here, before the workers start; a value you set is kept.
    """
    before = os.environ.get("OMP_WAIT_POLICY")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_WAIT_POLICY", None)


def validate(dispatch: Dispatch) -> None:
    """Check the launcher and what it needs, before anything is written.

    Raises:
        FpbenchError: an unknown launcher, --jobs < 1, a missing optional engine, no sbatch.
    """
    if dispatch.launcher not in LAUNCHERS:
        raise FpbenchError(
            f"--launcher {dispatch.launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}"
        )
    if dispatch.jobs < 1:
        raise FpbenchError(f"--jobs must be at least 1, got {dispatch.jobs}")
    module, extra = ENGINES.get(dispatch.launcher, (None, None))
    if module and not _importable(module):
        raise FpbenchError(
            f"--launcher {dispatch.launcher} needs {module}: pip install {module} "
            f"(or fpbench's `{extra}` extra)"
        )
    if dispatch.launcher == "slurm" and shutil.which("sbatch") is None:
        raise FpbenchError(
            "--launcher slurm needs SLURM's sbatch on PATH; use --launcher submitit-local here"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _already_done(cells: list[RunConfig], url: str) -> dict[str, RunConfig]:
    """Cells already done in the shared database: no worker is started for them."""
    if CELL_KEY in url:
        return {}
    with Store(url) as store:
        return {
            c.run_key: c
            for c in cells
            if (r := store.find_run(c.run_key)) is not None and r.status == "done"
        }


def failed_cells(cells: list[RunConfig], url: str) -> list[RunConfig]:
    """The cells stored as failed (`fpbench run --retry-failed`); creates no database."""
    failed = []
    for cfg in cells:
        cell = cell_url(url, cfg)
        if (path := Store.sqlite_file(cell)) is not None and not path.is_file():
            continue  # never run
        with Store(cell) as store:
            record = store.find_run(cfg.run_key)
        if record is not None and record.status == "failed":
            failed.append(cfg)
    return failed


# -- local: in this process, or a pool of worker processes ------------------------------------


def _serial(
    cells: list[RunConfig], url: str, ckpt: Path, dispatch: Dispatch, observer: Observer
) -> list[CellResult]:
    if CELL_KEY not in url:
        with Store(url) as store:
            cache = worker_cache()  # shared by the cells
            return run_suite(cells, store, checkpoint_dir=ckpt, observer=observer, cache=cache)
    args = (str(ckpt), dispatch.claim_timeout, observer)
    return [finish(cfg, run_one(cfg, url, *args), observer) for cfg in cells]


_busy = False  # a pool worker is running a cell (Ctrl-C stores it) or waiting for one


def _on_sigint_in_worker(signum: int, frame: object) -> None:
    """Ctrl-C, or the driver passing on SIGTERM: a running cell is stored as interrupted; an
    idle worker has nothing to store and exits quietly instead of printing a traceback."""
    if _busy:
        raise KeyboardInterrupt
    os._exit(128 + signum)  # no finalizers: nothing of an idle worker's is left to flush


def _run_in_worker(*args: Any) -> Outcome:
    global _busy
    _busy = True
    try:
        return run_one(*args)
    finally:
        _busy = False


def _init_worker(events: Any, threads: int, gpu_slots: list[str], counter: Any) -> None:
    signal.signal(signal.SIGINT, _on_sigint_in_worker)
    torch.set_num_threads(threads)  # N workers share the cores instead of oversubscribing
    set_worker_events(events)
    if gpu_slots:  # several runs per GPU, workers spread over the visible GPUs
        with counter.get_lock():
            index, counter.value = counter.value, counter.value + 1
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu_slots[index % len(gpu_slots)]


def _gpu_slots() -> list[str]:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return []
    return visible_gpus()


def _pool(
    cells: list[RunConfig], url: str, ckpt: Path, dispatch: Dispatch, observer: Observer
) -> list[CellResult]:
    """`dispatch.jobs` cells at once in spawned worker processes."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // dispatch.jobs)
    init = (events, threads, _gpu_slots(), ctx.Value("i", 0))
    by_key = {c.run_key: c for c in cells}
    results: dict[str, CellResult] = {}
    pool = ProcessPoolExecutor(dispatch.jobs, ctx, initializer=_init_worker, initargs=init)
    try:
        futures = {
            pool.submit(_run_in_worker, c, url, str(ckpt), dispatch.claim_timeout): c for c in cells
        }
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            forward_events(events, by_key, observer)
            for future in done:
                cfg = futures[future]
                results[cfg.run_key] = finish(cfg, _outcome(future), observer)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return [results[c.run_key] for c in cells]


def _outcome(future: Future[Outcome]) -> Outcome:
    try:
        return future.result()
    except Exception as e:  # the worker process died (killed, out of memory)
        return ("failed", f"worker process died: {type(e).__name__}: {e}")


def forward_events(events: Any, by_key: dict[str, RunConfig], observer: Observer) -> None:
    """Replay the progress events workers queued so far on the driver's observer."""
    handlers: dict[str, Callable[..., None]] = {
        "start": lambda cfg, r, _m: observer.cell_start(cfg, r),
        "round": observer.round_end,
        "stage": lambda cfg, done, m: observer.stage(cfg, m["what"], done, m["total"]),
    }
    while True:
        try:
            kind, key, round_idx, metrics = events.get_nowait()
        except queue.Empty:
            return
        if key in by_key:
            handlers[kind](by_key[key], round_idx, metrics)
