"""`fpbench run`: a suite's cells through the chosen launcher, with progress and a summary."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from fpbench.cli.apps import app
from fpbench.cli.common import (
    DEFAULT_DB,
    DEFAULT_METRICS,
    DbOpt,
    SetOpt,
    SuiteOpt,
    console,
    err,
    fit_table,
    load_cells,
    open_store,
    parse_sets,
    plural,
    sqlite_missing,
    user_errors,
)
from fpbench.cli.run_log import LineObserver, headline
from fpbench.cli.signals import SignalWatch, sigterm_interrupts
from fpbench.errors import FpbenchError


class _ProgressObserver:
    """Rich progress: one bar over the suite's cells, one over the current cell's rounds, one
    over each frozen pass while it runs.

    Implements `fpbench.engine.rounds.Observer` (not subclassed, to keep `--help` free of torch).
    """

    def __init__(self, progress: Progress, total_cells: int) -> None:
        self.progress = progress
        self.cells = progress.add_task("cells", total=total_cells, shown="")
        self.rounds: dict[str, Any] = {}  # run_key -> rounds bar (several with --jobs)

    def cell_start(self, cfg, start_round: int) -> None:
        label = f"{cfg.method.label} / {cfg.dataset.label} / {cfg.partition.label} / s{cfg.seed}"
        self.rounds[cfg.run_key] = self.progress.add_task(
            f"  {label}", total=cfg.train.rounds, completed=start_round, shown=""
        )

    def round_end(self, cfg, round_idx: int, metrics: dict[str, float]) -> None:
        if cfg.run_key in self.rounds:
            bar = self.rounds[cfg.run_key]
            self.progress.update(bar, completed=round_idx + 1)
            if metrics:  # as the plain log: accuracies and loss (ETA: its own column)
                self.progress.update(bar, shown=headline(metrics))

    def stage(self, cfg, what: str, done: int, total: int) -> None:
        """A bar for long work outside the rounds (frozen passes, data, pretraining)."""
        key = f"{cfg.run_key if cfg is not None else ''}:{what}"
        if key not in self.rounds:
            self.rounds[key] = self.progress.add_task(f"  {what}", total=total, shown="")
        self.progress.update(self.rounds[key], completed=done)
        if done >= total:
            self.progress.remove_task(self.rounds.pop(key))

    def cell_end(self, result) -> None:
        if (bar := self.rounds.pop(result.cfg.run_key, None)) is not None:
            self.progress.remove_task(bar)
        self.progress.advance(self.cells)


@app.command(short_help="Run or resume every cell of a suite, skipping finished ones.")
@user_errors
def run(
    suite: SuiteOpt = "smoke",
    method: Annotated[
        list[str] | None, typer.Option(help="only these methods (repeatable)")
    ] = None,
    seed: Annotated[list[int] | None, typer.Option(help="only these seeds (repeatable)")] = None,
    dataset: Annotated[
        list[str] | None, typer.Option(help="only these datasets (name or label; repeatable)")
    ] = None,
    partition: Annotated[
        list[str] | None, typer.Option(help="only these partitions (label or name; repeatable)")
    ] = None,
    sets: SetOpt = None,
    db: DbOpt = DEFAULT_DB,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N")] = None,
    launcher: Annotated[
        str,
        typer.Option("--launcher", help="where cells run: local, submitit-local, slurm or ray"),
    ] = "local",
    client_executor: Annotated[
        str | None, typer.Option(help="client training: lockstep or reference")
    ] = None,
    deterministic: Annotated[
        bool | None,
        typer.Option(
            "--deterministic/--no-deterministic",
            help="deterministic kernels (default: the suite's runtime.deterministic, on): "
            "bit-identical results across processes, resumes and executors; off is faster",
        ),
    ] = None,
    frozen_precision: Annotated[
        str | None,
        typer.Option(help="frozen passes in fp32, tf32 or bf16 (runtime.frozen_precision)"),
    ] = None,
    jobs: Annotated[
        int, typer.Option(min=1, help="cells at once (worker processes; SLURM array parallelism)")
    ] = 1,
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="CPU threads each cell computes with (runtime.threads; default: the suite's, "
            "else all cores). Stored values are bit-identical among runs of one count",
        ),
    ] = None,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (--launcher ray); default: local Ray")
    ] = None,
    gpus_per_cell: Annotated[
        float,
        typer.Option(
            min=0, help="GPUs per cell (slurm, ray, submitit-local; 0 on submitit-local: all)"
        ),
    ] = 0,
    cpus_per_cell: Annotated[int, typer.Option(min=1, help="CPUs per cell (slurm, ray)")] = 1,
    timeout_min: Annotated[int, typer.Option(min=1, help="time limit per SLURM job")] = 1440,
    slurm_partition: Annotated[str | None, typer.Option(help="SLURM partition")] = None,
    job_dir: Annotated[Path, typer.Option(help="submitit's job files and logs")] = Path(
        "results/jobs"
    ),
    checkpoint_dir: Annotated[Path, typer.Option(help="where per-round checkpoints live")] = Path(
        "results/checkpoints"
    ),
    data_root: Annotated[
        Path | None, typer.Option(help="datasets root (default: $FPBENCH_DATA, else ./data)")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="list the cells, their status and missing data or weights"),
    ] = False,
    log: Annotated[
        list[str] | None,
        typer.Option(
            "--log",
            help="also log each cell's curves to tensorboard, wandb or mlflow (repeatable; "
            "optional extras; local launcher)",
        ),
    ] = None,
    log_dir: Annotated[
        Path, typer.Option(help="where --log writes (TensorBoard events, W&B files, mlruns)")
    ] = Path("results/logs"),
    retry_failed: Annotated[
        bool,
        typer.Option(
            "--retry-failed",
            help="rerun only the cells stored as failed, each from its last checkpoint; "
            "done, running, pending and never-run cells are skipped",
        ),
    ] = False,
) -> None:
    """Run (or resume) every cell of a suite; finished cells are skipped.

    Missing datasets, generated files and backbone weights are named in one error before
    anything is written.

    A --db containing {run_key} gives every cell its own SQLite file (see `fpbench db merge`).
    With --set, the cells are stored under the suite name NAME+PATH=VALUE,... (runtime.*
    paths excepted), so tables never mix them with the suite's own cells.
    """
    _passive_waits()  # before torch is imported
    from fpbench.backbones import missing_weights
    from fpbench.data.prepared import data_root as data_root_of
    from fpbench.data.prepared import require_present
    from fpbench.methods.fedmvp import require_descriptions
    from fpbench.methods.gpt_fl import require_generated
    from fpbench.store import Store

    loaded, cells = load_cells(suite, sets, method, seed, dataset, partition)
    if data_root is not None:  # read by every worker through the environment
        os.environ["FPBENCH_DATA"] = str(data_root.expanduser().absolute())
    given = {
        "device": device,
        "executor": client_executor,
        "deterministic": deterministic,
        "frozen_precision": frozen_precision,
        "threads": threads,
    }
    overridden = {path.removeprefix("runtime.") for path in parse_sets(sets)}  # --set wins
    runtime = {k: v for k, v in given.items() if v is not None and k not in overridden}
    if frozen_precision not in (None, "fp32", "tf32", "bf16"):
        raise FpbenchError(
            f"--frozen-precision must be fp32, tf32 or bf16, got {frozen_precision!r}"
        )
    if client_executor and client_executor not in ("lockstep", "reference"):
        raise FpbenchError(
            f"--client-executor must be lockstep or reference, got {client_executor!r}"
        )
    cells = [c.model_copy(update={"runtime": c.runtime.model_copy(update=runtime)}) for c in cells]
    if dry_run:
        _check_devices(cells)  # as the run would, before it builds anything
        _print_cells(loaded.name, cells, db)
        return
    from fpbench.cli.trackers import TrackingObserver, make_trackers

    trackers = make_trackers(log or [], log_dir)  # a missing package: before anything runs
    from fpbench.engine.dispatch import CELL_KEY, run_cells, validate  # imports torch
    from fpbench.engine.launch import Dispatch

    needed = [name for c in cells for name in _datasets_of(c)]  # cross-dataset targets too
    root = data_root_of()
    _all_present(  # before anything is written; every missing input named at once
        [lambda n=name: require_present([n], root) for name in dict.fromkeys(needed)]
        + [lambda: require_generated(cells), lambda: require_descriptions(cells)],
        missing_weights(cells),  # no loading, no download: files and the hub cache
    )
    url = Store.url_from_path_or_url(db if "://" in db else Path(db).absolute())
    dispatch = Dispatch(
        launcher=launcher,
        jobs=jobs,
        folder=job_dir.absolute(),
        address=address,
        gpus_per_cell=gpus_per_cell,
        cpus_per_cell=cpus_per_cell,
        timeout_min=timeout_min,
        slurm_partition=slurm_partition,
    )
    validate(dispatch)
    if retry_failed and not (cells := _retry_selection(loaded.name, cells, url)):
        return
    if CELL_KEY not in url:
        open_store(db).close()  # unreachable, foreign or read-only: fails here; creates nothing
    _require_writable_folder(checkpoint_dir, "--checkpoint-dir")  # before a run row is stored
    warn_if_oversubscribed(threads)
    live = console.is_terminal  # off a terminal (cluster logs, tee): plain lines, no bars
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[shown]}"),
        TimeRemainingColumn(),
    )
    signals = SignalWatch()
    try:
        with (
            sigterm_interrupts(signals),
            Progress(
                *columns, TimeElapsedColumn(), console=err, transient=False, disable=not live
            ) as progress,
        ):
            observer = (
                _ProgressObserver(progress, len(cells))
                if live
                else LineObserver(sys.stdout, len(cells))
            )
            if trackers:
                observer = TrackingObserver(observer, trackers)
            _pretrain_smoke_backbone(cells, observer)
            results = run_cells(
                cells,
                url,
                checkpoint_dir=checkpoint_dir.absolute(),
                dispatch=dispatch,
                observer=observer,
            )
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the cell is stored as interrupted
        said = str(e) if e.args else "interrupted; rerun the same command to resume"
        if signals.terminated:
            said = f"SIGTERM: {said}"
        err.print(said, highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(signals.exit_code) from None
    _report_results(loaded.name, results, loaded.name if sets else suite, db)


def _all_present(checks, known: Sequence[str] = ()) -> None:
    """Run every check; one error naming each missing dataset, file or backbone's weights
    (`known`: problems found already), not only the first."""
    problems = []
    for check in checks:
        try:
            check()
        except FpbenchError as e:
            problems.append(str(e))
    problems += known
    if len(problems) == 1:
        raise FpbenchError(problems[0])
    if problems:
        raise FpbenchError(f"{len(problems)} inputs are missing: " + "; ".join(problems))


def _check_devices(cells) -> None:
    """Each device the cells name exists here (`--device cuda` on a machine without CUDA)."""
    from fpbench.engine.build import resolve_device

    for name in sorted({c.runtime.device for c in cells}):
        resolve_device(name)


def _require_writable_folder(folder: Path, option: str) -> None:
    """Fail now where `folder` (or the nearest existing folder above it) cannot be written."""
    from fpbench.store.sqlite import folder_writable

    place = folder.resolve()
    while not place.exists():
        place = place.parent
    if not place.is_dir() or not folder_writable(place):
        raise FpbenchError(
            f"{option} {folder}: {place} is read-only or not a folder; name a writable one"
        )


def _passive_waits() -> None:
    """Threads waiting for work sleep instead of spinning (OpenMP reads this when torch loads).

    On a machine whose other load leaves fewer cores than a cell's threads, spinning threads
    take the cores from the ones with work: a round ran 8 to 25 times slower. Sleeping costs
    about 3% on an idle machine (`engine.dispatch._passive_omp_waits`) and changes no value. A
    value you set is kept; in a process that already loaded torch it is too late to matter.
    """
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def warn_if_oversubscribed(threads: int | None) -> None:
    """Warn when the machine's load average exceeds its cores: every thread then waits."""
    import torch

    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # not available on this platform
        return
    cores = os.cpu_count() or 1
    if load <= cores:
        return
    count = threads or torch.get_num_threads()
    console.print(  # on stdout, with the run's log: stderr is kept for the one error line
        f"[yellow]warning:[/] this machine is oversubscribed (load average {load:.1f} on {cores} "
        f"cores): each cell computes with {count} thread(s), which wait on each other, so rounds "
        "may run several times slower. Fewer threads (--threads 1) help; runs store bit-identical "
        "values only among runs of one thread count",
        highlight=False,
        soft_wrap=True,
    )


def _retry_selection(suite: str, cells: list, url: str) -> list:
    """The failed cells among `cells`, announced; an empty list when there is nothing to retry."""
    from fpbench.engine.dispatch import failed_cells

    failed = failed_cells(cells, url)
    others = len(cells) - len(failed)
    if failed:
        console.print(f"retrying {len(failed)} failed cell(s) of suite {suite}; {others} skipped")
    else:
        console.print(f"suite {suite}: no failed cells to retry ({others} skipped)")
    return failed


def _pretrain_smoke_backbone(cells, observer) -> None:
    """Pretrain `vit-smoke` once (cached), showing progress, before the cells need it."""
    from fpbench.backbones.smoke import ensure_pretrained
    from fpbench.registry import BACKBONES

    if not any(
        BACKBONES.get(c.backbone.name).pretrained == "smoke" and not c.backbone.weights
        for c in cells
    ):
        return

    def show(step: int, total: int, loss: float) -> None:
        observer.stage(None, "pretraining vit-smoke (once)", step, total)

    import torch

    # with the cells' thread count: the weights' bits depend on it, and so does their cache key
    own = torch.get_num_threads()
    torch.set_num_threads(next((c.runtime.threads for c in cells if c.runtime.threads), own))
    try:
        ensure_pretrained(progress=show)
    finally:
        torch.set_num_threads(own)


def _report_results(suite: str, results, suite_arg: str, db: str) -> None:
    counts = {s: sum(r.status == s for r in results) for s in ("done", "skipped", "failed")}
    busy = sum(r.status == "skipped" and r.error is not None for r in results)
    console.print(
        f"suite [bold]{suite}[/]: {plural(counts['done'], 'cell')} ran, "
        f"{counts['skipped'] - busy} already done, {counts['failed']} failed"
        + (f", {busy} skipped (claimed by another driver)" if busy else "")
    )
    for r in results:
        if r.status == "failed":
            err.print(
                f"[red]failed:[/] {r.cfg.method.label} / {r.cfg.dataset.label} / "
                f"{r.cfg.partition.label} / seed {r.cfg.seed}: {escape(str(r.error))}",
                highlight=False,
                soft_wrap=True,
            )
    _print_summary(suite_arg, db)
    if counts["failed"]:
        raise typer.Exit(1)


def _print_summary(suite: str, db: str) -> None:
    """The suite's table (as `fpbench table --suite`) and the commands to go on with."""
    from fpbench.cli.summary import next_commands, summary_text

    if "{run_key}" in db:  # one file per cell: the tables need them merged first
        console.print(f"next: fpbench db merge results/merged.db {db.replace('{run_key}', '*')}")
        return
    if console.is_terminal:  # fitted to the screen, as `fpbench table --format term`
        _print_term_summary(suite, db)
    elif (text := summary_text(db, suite, DEFAULT_METRICS)) is not None:
        print(text)  # Markdown in the README's form: a log or a pipe keeps it whole
    console.print("next:", highlight=False)
    for command in next_commands(suite, db):
        console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)


def _print_term_summary(suite: str, db: str) -> None:
    from fpbench.cli.common import suite_name
    from fpbench.cli.results import _print_term
    from fpbench.cli.summary import finished_results
    from fpbench.report.tables import summary_table

    frame, notes = finished_results(db, suite, DEFAULT_METRICS)
    if frame.empty:
        return
    title = f"suite {suite_name(suite)}: mean ± std over seeds"
    _print_term(summary_table(frame, DEFAULT_METRICS), title, None)
    for note in notes:
        console.print(note, highlight=False, markup=False)


def _datasets_of(cfg) -> list[str]:
    """The datasets a cell reads: its own, then its cross-dataset targets'."""
    targets = cfg.evaluation.targets if cfg.evaluation is not None else ()
    return [cfg.dataset.name, *(t.name for t in targets)]


def _data_text(states: list[str]) -> str:
    """The cell's data column: its own dataset's state, or "missing" where a target's is."""
    return "missing" if "missing" in states else states[0]


def _print_cells(suite: str, cells, db: str) -> None:
    from fpbench.backbones import missing_weights
    from fpbench.data.prepared import data_root, dataset_state

    # no database yet: every cell is new, and a dry run creates nothing
    store = None if sqlite_missing(db) else open_store(db, read_only=True)
    table = fit_table(f"suite {suite}: {plural(len(cells), 'cell')}")
    for col in ("run_key", "method", "dataset", "partition", "seed", "status", "data"):
        fixed = col in ("run_key", "seed", "status")
        table.add_column(
            col, no_wrap=fixed, overflow="fold", justify="right" if col == "seed" else "left"
        )
    root = data_root()
    data = {name: dataset_state(name, root) for c in cells for name in _datasets_of(c)}
    statuses = set()
    for c in cells:
        record = store.find_run(c.run_key) if store else None
        status = _status_text(record)
        statuses.add(status)
        table.add_row(
            c.run_key,
            c.method.label,
            c.dataset.label,
            c.partition.label,
            str(c.seed),
            status,
            _data_text([data[name] for name in _datasets_of(c)]),
        )
    console.print(table)
    if "stale" in statuses:
        console.print(
            "stale: running, but its process is gone or its heartbeat stopped; a rerun takes "
            "it over and resumes it (see `fpbench db check`)"
        )
    if "interrupted" in statuses:
        console.print("interrupted: stopped by Ctrl-C or SIGTERM; a rerun resumes it")
    if "missing" in data.values():
        console.print(f"data missing under {root}: see `fpbench data status`")
    for problem in missing_weights(cells):  # as the run would refuse them, before the cells
        console.print(f"weights missing: {problem}", highlight=False, markup=False)


def _status_text(record) -> str:
    """A run's status for --dry-run: 'stale' for a running run whose process died."""
    from fpbench.store.claims import CLAIM_TIMEOUT_S, stale_reason

    if record is None:
        return "new"
    if stale_reason(record.status, record.owner, record.heartbeat_at, CLAIM_TIMEOUT_S):
        return "stale"
    return record.status
