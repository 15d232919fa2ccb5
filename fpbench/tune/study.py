"""One method's search: an Optuna study in the results database, its trials run as suite cells.

A trial's cells are the suite's cells of the method with the trial's values, the budget's rounds
and `train.validation` set (`--set` paths), stored under a suite name of their own,
`NAME+tune-<hash of the values>`, so tables never mix them with the suite's. Each evaluated round's
stored validation metric is reported to the trial (step: the cell's position times the rounds,
plus the round) and Optuna's pruner may stop it there; a stopped cell is stored `interrupted`, its
text saying "pruned after round k/N by the median rule ..." (never Ctrl-C's), and resumes if a
later trial draws the same values. The objective is the mean over the trial's cells
of the metric's stored summary (`<metric>_last<summary_window>`).

Resuming: a trial that was interrupted (Ctrl-C) or whose process died (its heartbeat went silent)
is failed by Optuna and enqueued again once with its values, so its cells resume from their
checkpoints; the study is done when `trials` of its trials are complete or pruned and no worker
is still running one (`settle`).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fpbench.engine.observer import Observer
from fpbench.engine.seeding import derive_seed
from fpbench.errors import FpbenchError
from fpbench.specs import RunConfig
from fpbench.store import Store
from fpbench.suites import load_suite
from fpbench.tune.space import Param, fingerprint

HEARTBEAT_S, GRACE_S = 30, 120  # a trial silent this long is a dead worker's: failed, retried
PRUNER_STARTUP = 2  # trials that complete before the median pruner prunes
BUSY_POLL_S = 2.0  # how often a trial looks again at a cell another worker is running


@dataclass(frozen=True)
class Budget:
    """What every method compared gets alike: trials, rounds, validation split, metric, seeds."""

    trials: int
    rounds: int
    validation: float
    metric: str = "acc_global"
    seed: int = 0  # the sampler's
    seeds: tuple[int, ...] | None = None  # the cells' seeds; None: the suite's

    def check(self) -> None:
        """Raises FpbenchError on a budget no search can run with."""
        if self.trials < 1:
            raise FpbenchError(f"--trials must be at least 1, got {self.trials}")
        if self.rounds < 1:
            raise FpbenchError(f"--rounds must be at least 1, got {self.rounds}")
        if not 0 < self.validation < 1:
            raise FpbenchError(
                f"--validation must be a fraction in (0, 1) of each client's train samples, "
                f"got {self.validation}"
            )

    @property
    def direction(self) -> str:
        return "minimize" if self.metric.startswith(("loss", "ece")) else "maximize"

    def text(self) -> str:
        """The budget as one line (stored with the study and in the tuned suite)."""
        seeds = "suite" if self.seeds is None else ",".join(map(str, self.seeds))
        return (
            f"trials={self.trials} rounds={self.rounds} validation={self.validation} "
            f"metric={self.metric} seeds={seeds} sampler-seed={self.seed}"
        )


class CellsFailed(Exception):
    """A trial's cell failed (a crash stored with the cell): the trial fails, not retried."""


class _Pruned(KeyboardInterrupt):
    """Raised in the round loop to stop a pruned trial's cell: stored `interrupted` (a later
    trial drawing the same values resumes it), its text saying it was pruned and by what rule,
    never "(Ctrl-C)" (see `fpbench.engine.runner`)."""

    def __init__(self, step: int, rule: str = "the tuner's pruner") -> None:
        super().__init__(step)
        self.step, self.rule = step, rule

    def stored_text(self, rounds: str) -> str:
        """The run's stored text; `rounds`: 'after round 2/3', as the runner says it."""
        return (
            f"pruned {rounds} by {self.rule}; not a failure: a trial with these values resumes it"
        )


def study_name(suite: str, label: str, space: tuple[Param, ...], budget: Budget) -> str:
    """The study's name: suite, method and a hash of all but the trial count (which may grow)."""
    what = [budget.rounds, budget.validation, budget.metric, budget.seed, budget.seeds]
    digest = hashlib.sha256(json.dumps([fingerprint(space), what]).encode()).hexdigest()[:10]
    return f"fpbench-tune:{suite}:{label}:{digest}"


def trial_cells(suite: str, label: str, values: dict[str, Any], budget: Budget) -> list[RunConfig]:
    """The cells of method `label` in `suite` with `values`, the budget's rounds and
    validation split set, named `NAME+tune-<hash of those>`."""
    sets = {**values, "train.rounds": budget.rounds, "train.validation": budget.validation}
    loaded = load_suite(suite, sets=sets, methods=[label])
    digest = hashlib.sha256(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:8]
    name = f"{load_suite(suite, methods=[label]).name}+tune-{digest}"
    cells = [
        c.model_copy(update={"suite": name})
        for c in loaded.cells
        if c.method.label == label and (budget.seeds is None or c.seed in budget.seeds)
    ]
    if not cells:
        raise FpbenchError(f"suite {suite}: method {label!r} has no cells of seeds {budget.seeds}")
    return cells


class _Pruning(Observer):
    """Reports each evaluated round's stored metric to the trial; stops the cell if pruned."""

    def __init__(self, trial: Any, metric: str, cells: list[RunConfig], store: Store) -> None:
        self.trial, self.metric, self.store = trial, metric, store
        self.offset = {c.run_key: i * c.train.rounds for i, c in enumerate(cells)}
        self.reported: dict[int, float] = {}  # step -> the value reported there
        self.pruned: int | None = None  # the step it was pruned at
        self.pruned_text = ""  # where and why, for the trial's `pruned` user attribute

    def cell_start(self, cfg: RunConfig, start_round: int) -> None:
        if start_round:  # resumed: the rounds stored before
            self._feed(cfg)

    def round_end(self, cfg: RunConfig, round_idx: int, metrics: dict[str, float]) -> None:
        if self.metric in metrics:
            self._feed(cfg)

    def _feed(self, cfg: RunConfig) -> None:
        for r, value in stored_curve(self.store, cfg.run_key, self.metric):
            step = self.offset[cfg.run_key] + r
            if step not in self.reported:
                self.reported[step] = value
                self.trial.report(value, step)
                if self.trial.should_prune():
                    from fpbench.engine.runner import cell_label

                    self.pruned = step
                    rule = self._rule(step)
                    self.pruned_text = (
                        f"pruned after round {r + 1}/{cfg.train.rounds} of {cell_label(cfg)} "
                        f"by {rule}"
                    )
                    raise _Pruned(step, rule)

    def _rule(self, step: int) -> str:
        """The rule that pruned at `step`, with what Optuna's MedianPruner compares there: the
        trial's best value so far and the median of the complete trials' values at that step."""
        rule = f"the median rule (Optuna's MedianPruner, after {PRUNER_STARTUP} complete trials)"
        study = getattr(self.trial, "study", None)
        if study is None:
            return rule
        from optuna.trial import TrialState

        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        values = [t.intermediate_values[step] for t in done if step in t.intermediate_values]
        values = [v for v in values if math.isfinite(v)]
        if not values:
            return rule
        maximize = study.direction.name == "MAXIMIZE"
        best = (max if maximize else min)(self.reported.values())
        return (
            f"{rule}: at step {step} trial {self.trial.number}'s best {self.metric} so far was "
            f"{best:.4g}, the median of {len(values)} complete trial(s) there "
            f"{statistics.median(values):.4g}"
        )


def stored_curve(store: Store, run_key: str, metric: str) -> list[tuple[int, float]]:
    """(round, value) of a run's stored per-round aggregate `metric`, in round order."""
    record = store.find_run(run_key)
    if record is None:
        return []
    df = store.metrics(run_ids=[record.id], names=[metric])
    df = df[df["round"].notna()]
    return [(int(r), float(v)) for r, v in zip(df["round"], df["value"], strict=True)]


def objective_value(store: Store, cells: list[RunConfig], metric: str) -> float:
    """The mean over `cells` of their stored `<metric>_last<summary_window>`."""
    values = []
    for c in cells:
        name = f"{metric}_last{c.train.summary_window}"
        record = store.find_run(c.run_key)
        df = store.metrics(run_ids=[record.id], names=[name]) if record else None
        if df is None or df.empty or record.status != "done":
            raise CellsFailed(f"cell {c.run_key} stored no {name} (is --metric {metric} right?)")
        values.append(float(df["value"].iloc[-1]))
    return sum(values) / len(values)


def open_study(url: str, name: str, budget: Budget, worker: int = 0) -> Any:
    """The study `name` in the database at `url` (created, or loaded to resume); parallel
    workers each draw with a sampler seed of their own (`worker`), else they draw alike."""
    import warnings

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", "Argument ``heartbeat_interval``", category=Warning)
    with Store(url) as store:  # fpbench's tables first: a database of Optuna's alone is foreign
        store.ensure_schema()
    storage = _storage(url)
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        load_if_exists=True,
        direction=budget.direction,
        sampler=optuna.samplers.TPESampler(seed=_sampler_seed(budget.seed, worker)),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=PRUNER_STARTUP),
    )
    study.set_user_attr("budget", budget.text())
    return study


def _sampler_seed(seed: int, worker: int) -> int:
    """Worker 0 draws with `seed` itself; others with seeds derived from it."""
    return seed if worker == 0 else derive_seed(seed, "worker", worker) % 2**32


def _storage(url: str, attempts: int = 5) -> Any:
    """Optuna's storage at `url`, retried: workers starting together race to create its tables
    (on PostgreSQL, its enum types), and the losers see the winner's half-made schema."""
    import optuna
    from sqlalchemy.exc import DBAPIError, IntegrityError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(
                url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S
            )
        except (IntegrityError, DBAPIError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def finished(study: Any) -> list[Any]:
    """The study's complete and pruned trials, in trial order."""
    from optuna.trial import TrialState

    states = (TrialState.COMPLETE, TrialState.PRUNED)
    return sorted(study.get_trials(deepcopy=False, states=states), key=lambda t: t.number)


def best_trial(study: Any, trials: int) -> Any:
    """The best complete trial among the first `trials` finished ones (parallel workers may
    finish a few more; every method is judged on the same count)."""
    counted = [t for t in finished(study)[:trials] if t.value is not None]
    from optuna.trial import TrialState

    done = [t for t in counted if t.state == TrialState.COMPLETE and math.isfinite(t.value)]
    if not done:
        raise FpbenchError(f"study {study.study_name}: no complete trial among the first {trials}")
    pick = max if study.direction.name == "MAXIMIZE" else min
    return pick(done, key=lambda t: (t.value, -t.number))


def tune_method(
    suite: str,
    label: str,
    space: tuple[Param, ...],
    budget: Budget,
    url: str,
    *,
    checkpoint_dir: Path,
    worker: int = 0,
    runtime: dict[str, Any] | None = None,
    on_trial: Callable[[Any, int, int], None] = lambda trial, done, total: None,
) -> Any:
    """Run (or resume) method `label`'s study until `budget.trials` trials are complete or
    pruned; returns the study. `on_trial(trial, done, total)` follows each trial this process
    ran (`done`: the study's finished trials). `runtime`: settings of the cells' `runtime`
    (device, threads), which change no result and no run key.

    Raises:
        CellsFailed: a trial's cell failed.
        KeyboardInterrupt: Ctrl-C (the trial is failed and is enqueued again on the next run).
    """
    import optuna

    from fpbench.engine.dispatch import run_cells

    study = open_study(url, study_name(suite, label, space, budget), budget, worker)
    store = Store(url)

    def objective(trial: optuna.Trial) -> float:
        values = {p.path: p.suggest(trial) for p in space}
        cells = [
            c.model_copy(update={"runtime": c.runtime.model_copy(update=runtime or {})})
            for c in trial_cells(suite, label, values, budget)
        ]
        trial.set_user_attr("suite", cells[0].suite)
        watcher = _Pruning(trial, budget.metric, cells, store)
        while True:  # a cell another worker runs (it drew the same values): wait for it
            try:
                results = run_cells(cells, url, checkpoint_dir=checkpoint_dir, observer=watcher)
            except KeyboardInterrupt:
                if watcher.pruned is None:
                    raise
                trial.set_user_attr("pruned", watcher.pruned_text)
                raise optuna.TrialPruned(watcher.pruned_text) from None
            failed = [r for r in results if r.status == "failed"]
            if failed:
                trial.set_user_attr("failed", failed[0].error)
                raise CellsFailed(f"trial {trial.number}: cell failed: {failed[0].error}")
            if not any(r.status == "skipped" and r.error for r in results):
                try:
                    return objective_value(store, cells, budget.metric)
                except CellsFailed as e:  # e.g. a --metric the runs do not store
                    trial.set_user_attr("failed", str(e))
                    raise
            time.sleep(BUSY_POLL_S)

    ended: list[Any] = []  # this worker's trials (others' run beside them)

    try:
        while len(finished(study)) < budget.trials:
            requeue(study)
            study.optimize(
                objective,
                n_trials=1,
                catch=(CellsFailed,),
                callbacks=[lambda study, trial: ended.append(trial)],
            )
            last = ended[-1]
            if "failed" in last.user_attrs:
                raise CellsFailed(f"trial {last.number} of {label}: {last.user_attrs['failed']}")
            on_trial(last, len(finished(study)), budget.trials)
        settle(study)
    finally:
        store.close()
    return study


def settle(study: Any, poll_s: float = 1.0) -> None:
    """Wait for the trials other workers are running (failed by Optuna once their heartbeat has
    been silent for `GRACE_S`), so that every worker judges the same first trials."""
    import optuna
    from optuna.trial import TrialState

    while study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        optuna.storages.fail_stale_trials(study)
        time.sleep(poll_s)


def requeue(study: Any) -> list[int]:
    """Enqueue once, with the same values, every failed trial that no cell failure ended
    (interrupted, or failed by Optuna as a dead worker's); returns their numbers."""
    from optuna.trial import TrialState

    done = set(study.user_attrs.get("requeued", []))
    again = [
        t
        for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        if t.number not in done and "failed" not in t.user_attrs
    ]
    for t in again:
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number}, skip_if_exists=False)
    if again:
        study.set_user_attr("requeued", sorted(done | {t.number for t in again}))
    return [t.number for t in again]
