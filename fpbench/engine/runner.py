"""A cell's lifecycle (claim, build, run its rounds, record the outcome), the loop over a
suite's cells, and `run_one`: the task every launcher runs for one cell, in whichever process,
with `finish`, the driver's end of it."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from traceback import format_exc
from typing import Any

import torch

import fpbench
from fpbench import stages
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.artifacts import keep_params
from fpbench.engine.build import resolve_device, resolve_precision
from fpbench.engine.cell import Cell
from fpbench.engine.cost import PeakMemory
from fpbench.engine.frozen_cache import effective_precision
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.numerics import cell_numerics
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.rounds import run_rounds
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig
from fpbench.store import CLAIM_TIMEOUT_S, ClaimLost, Store, claim_is_live, new_owner


class CellInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a cell; it is stored as 'interrupted' and a rerun resumes it."""

    def __init__(self, cfg: RunConfig, round_idx: int | None) -> None:
        super().__init__(cfg.run_key)
        self.cfg, self.round = cfg, round_idx  # round None: while the cell was being prepared

    def __str__(self) -> str:
        where = "while preparing" if self.round is None else f"{rounds_stored(self)} of"
        return (
            f"interrupted {where} cell {cell_label(self.cfg)} ({self.cfg.run_key}); "
            "rerun the same command to resume"
        )


_exit_reasons: list[str] = []  # why this process was asked to exit (SystemExit) mid-cell


def note_exit(reason: str) -> None:
    """Say why the SystemExit about to stop this process's cell comes (e.g. "SLURM preempted or
    timed out the job; requeued"): the cell is stored `interrupted` with it, not `failed`."""
    _exit_reasons.append(reason)


def rounds_stored(stop: CellInterrupted) -> str:
    """'after round 2/3' (rounds counted from 1, as progress shows them) or 'before round 1/3'."""
    total = stop.cfg.train.rounds
    return f"after round {stop.round}/{total}" if stop.round else f"before round 1/{total}"


def run_suite(
    cells: list[RunConfig],
    store: Store,
    *,
    checkpoint_dir: Path,
    observer: Observer | None = None,
    cache: FeatureCache | None = None,
) -> list[CellResult]:
    """Run or resume every cell; finished cells are skipped, a failed one does not stop the rest."""
    observer = observer or Observer()
    results = []
    for cfg in cells:
        try:
            result = run_cell(
                cfg, store, checkpoint_dir=checkpoint_dir, observer=observer, cache=cache
            )
        except FpbenchError:
            raise
        except Exception as e:  # a crashed run is recorded as failed; the suite goes on
            result = CellResult(cfg, "failed", error_text(e))
        observer.cell_end(result)
        results.append(result)
    return results


def run_cell(
    cfg: RunConfig,
    store: Store,
    *,
    checkpoint_dir: Path,
    observer: Observer | None = None,
    cache: FeatureCache | None = None,
    claim_timeout: float = CLAIM_TIMEOUT_S,
) -> CellResult:
    """Run or resume one cell. Missing data or weights raise before anything is written.

    The cell is claimed atomically first (see `fpbench.store`): a cell another live
    driver is running is skipped, and a claim silent for `claim_timeout` seconds is taken over.
    It computes in deterministic mode unless `runtime.deterministic` is off (see
    `fpbench.determinism`); every launcher comes through here.

    Raises:
        FpbenchError: missing data or weights, or an op with no deterministic kernel.
    """
    observer = observer or Observer()
    on_stage = getattr(observer, "stage", Observer().stage)  # duck-typed observers may lack it
    stage = lambda what, done, total: on_stage(cfg, what, done, total)  # noqa: E731
    try:
        with cell_numerics(cfg), stages.reporting(stage):
            return _run_cell(cfg, store, checkpoint_dir, observer, cache, claim_timeout)
    except CellInterrupted:
        raise
    except KeyboardInterrupt:
        raise CellInterrupted(cfg, None) from None


def _run_cell(
    cfg: RunConfig,
    store: Store,
    checkpoint_dir: Path,
    observer: Observer,
    cache: FeatureCache | None,
    claim_timeout: float,
) -> CellResult:
    record = store.find_run(cfg.run_key)
    if record is not None and record.status == "done":
        return CellResult(cfg, "skipped")
    if record is not None and claim_is_live(record, claim_timeout):  # before building anything
        return CellResult(cfg, "skipped", "claimed by another driver")
    if record is not None:  # a record means the database exists: its identity creates nothing
        folder = ckpt_io.folder_for(checkpoint_dir, store.database_id)
        check_resumable(cfg, store, record.id, folder)
    device = resolve_device(cfg.runtime.device)
    peak = PeakMemory(device)
    peak.start()
    try:  # reports reach the observer's `stage` (run_cell); so do the frozen passes' later
        cell = Cell.build(cfg, device, cache=cache)
    except Exception as e:
        if not isinstance(e, FpbenchError):  # a crash (a bug, out of memory) is recorded
            record = record or _create_record(cfg, store, device)
            _record_failure(store, record.id, e, claim_timeout)
        raise
    record = record or _create_record(cfg, store, device)  # the first write: creates the database
    folder = ckpt_io.folder_for(checkpoint_dir, store.database_id)
    owner = new_owner()
    if not store.claim_run(record.id, owner, timeout_s=claim_timeout):
        return CellResult(cfg, "skipped", "claimed by another driver")
    try:
        with store.keep_alive(record.id, owner, claim_timeout / 4):
            elapsed = run_rounds(cell, store, record.id, folder, observer, owner)
    except ClaimLost as e:
        return CellResult(cfg, "skipped", str(e))
    except (KeyboardInterrupt, SystemExit) as e:  # Ctrl-C, SIGTERM as `fpbench run` raises
        last = store.last_round(record.id)  # it, or an exit asked for (submitit's requeue)
        interrupted = CellInterrupted(cfg, 0 if last is None else last + 1)
        why = getattr(e, "signal_name", "Ctrl-C")
        if isinstance(e, SystemExit):
            why = _exit_reasons[-1] if _exit_reasons else f"exit {e.code} asked for"
        message = f"interrupted {rounds_stored(interrupted)} ({why})"
        if callable(own := getattr(e, "stored_text", None)):  # a stop with its own words
            message = own(rounds_stored(interrupted))  # (a tune trial pruned)
        store.finish_run(record.id, owner, "interrupted", error=message)
        if isinstance(e, SystemExit):
            raise  # the process exits as asked; the cell is resumable, not failed
        raise interrupted from None
    except BaseException as e:
        with contextlib.suppress(Exception):  # never masking what ended the cell
            store.record_cost(record.id, peak_mem_bytes=peak.read(), owner=owner)
        store.finish_run(record.id, owner, "failed", error=error_text(e), traceback=format_exc())
        raise
    try:
        store.record_cost(record.id, peak_mem_bytes=peak.read(), owner=owner)
    except ClaimLost as e:
        return CellResult(cfg, "skipped", str(e))
    if not store.finish_run(record.id, owner, "done", wall_s=elapsed):
        return CellResult(cfg, "skipped", "claim taken over by another driver")
    keep_params(store.url, folder, cfg.run_key)  # the trained state, beside the db
    torn = ckpt_io.checkpoint_path(folder, cfg.run_key).with_suffix(".tmp")
    torn.unlink(missing_ok=True)  # a checkpoint write cut short by a kill
    return CellResult(cfg, "done")


def check_resumable(cfg: RunConfig, store: Store, run_id: int, folder: Path) -> None:
    """Refuse to resume from a checkpoint whose earlier rounds the database does not hold.

    Raises:
        FpbenchError: the cell's checkpoint is at round k but rounds 0..k are not all stored.
    """
    path = ckpt_io.checkpoint_path(folder, cfg.run_key)
    found = ckpt_io.saved_round(path)
    if found is None or found[1] not in (None, ckpt_io.binding(store.database_id, run_id)):
        return  # none, unreadable or another run's: `load` ignores it and the cell restarts
    missing = sorted(set(range(found[0] + 1)) - set(store.round_numbers(run_id)))
    if missing:
        raise FpbenchError(
            f"cannot resume cell {cell_label(cfg)} ({cfg.run_key}): its checkpoint {path} is at "
            f"round {found[0]} but the database lacks rounds {_span(missing)}; delete the "
            "checkpoint to run the cell again from round 0"
        )


def cell_label(cfg: RunConfig) -> str:
    """'method / dataset / partition / seed N', as progress and errors name a cell."""
    return f"{cfg.method.label} / {cfg.dataset.label} / {cfg.partition.label} / seed {cfg.seed}"


def _span(rounds: list[int]) -> str:
    if len(rounds) > 1 and rounds == list(range(rounds[0], rounds[-1] + 1)):
        return f"{rounds[0]}-{rounds[-1]}"
    return ", ".join(map(str, rounds))


def error_text(e: BaseException) -> str:
    """How a crashed cell's error is stored and reported: 'Type: message'."""
    return f"{type(e).__name__}: {e}"


def _record_failure(store: Store, run_id: int, e: BaseException, claim_timeout: float) -> None:
    """Mark a run failed with the exception being handled, unless another driver holds it."""
    owner = new_owner()
    if store.claim_run(run_id, owner, timeout_s=claim_timeout):
        store.finish_run(run_id, owner, "failed", error=error_text(e), traceback=format_exc())


def _create_record(cfg: RunConfig, store: Store, device: torch.device):
    return store.ensure_run(
        run_key=cfg.run_key,
        suite=cfg.suite,
        method=cfg.method.label,
        dataset=cfg.dataset.label,
        partition=cfg.partition.label,
        seed=cfg.seed,
        config=stored_config(cfg, device),
        fpbench_version=fpbench.__version__,
        torch_version=torch.__version__,
        device=_device_name(device, cfg),
    )


def stored_config(cfg: RunConfig, device: torch.device) -> dict:
    """The resolved config a run is stored with: its runtime (executor, precision, ...) and
    train settings (`unseen_clients`, ...) included, the precision as it computes on `device`
    ("auto" resolved to bf16 or fp32), so each run records the numerics its numbers came from."""
    config = cfg.model_dump(mode="json")
    if config["method"]["strategy"] is None:  # the method's own federation, as before the field
        del config["method"]["strategy"]
    config["runtime"]["precision"] = resolve_precision(cfg.runtime.precision, device)
    return config


def _device_name(device: torch.device, cfg: RunConfig) -> str:
    """The device and the numerics it ran with, e.g. 'NVIDIA H200 (bf16)', or with frozen
    passes not in fp32 'NVIDIA H200 (bf16, frozen tf32)'."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    numerics = resolve_precision(cfg.runtime.precision, device)
    frozen = effective_precision(cfg.runtime.frozen_precision, device)
    return f"{name} ({numerics}{'' if frozen == 'fp32' else f', frozen {frozen}'})"


CELL_KEY = "{run_key}"  # placeholder in a database URL: one database per cell

Outcome = tuple[str, str | None]  # (done | skipped | failed | error, message)


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
