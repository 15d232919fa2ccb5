"""`fpbench tune`: search methods' hyperparameters with one budget; the best become a suite."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fpbench.cli.apps import app
from fpbench.cli.common import DEFAULT_DB, DbOpt, SuiteOpt, console, err, user_errors
from fpbench.errors import FpbenchError


@app.command(short_help="Search each method's hyperparameters (Optuna), one budget.")
@user_errors
def tune(
    suite: SuiteOpt = "smoke",
    method: Annotated[
        list[str] | None,
        typer.Option(help="the methods to tune (labels, repeatable; default: every method)"),
    ] = None,
    trials: Annotated[int, typer.Option(help="trials per method (complete or pruned)")] = 20,
    rounds: Annotated[
        int | None, typer.Option(help="rounds of every trial (default: the suite's)")
    ] = None,
    validation: Annotated[
        float,
        typer.Option(help="fraction of each client's train samples scored instead of the test"),
    ] = 0.2,
    metric: Annotated[
        str, typer.Option(help="the validation metric searched and pruned on")
    ] = "acc_global",
    seed: Annotated[
        list[int] | None, typer.Option(help="only the cells of these seeds (repeatable)")
    ] = None,
    sampler_seed: Annotated[int, typer.Option(help="seed of Optuna's TPE sampler")] = 0,
    worker: Annotated[
        int,
        typer.Option(
            min=0,
            help="this process's number among parallel workers sharing the study (each its "
            "own, e.g. $SLURM_ARRAY_TASK_ID): their samplers draw apart",
        ),
    ] = 0,
    space: Annotated[
        Path | None,
        typer.Option(
            help="search spaces file (default: fpbench's own, fpbench/tune/search-spaces.toml)"
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="the tuned suite file (default: benchmarks/NAME+tuned.toml)"),
    ] = None,
    db: DbOpt = DEFAULT_DB,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N")] = None,
    threads: Annotated[
        int | None,
        typer.Option(min=1, help="CPU threads each cell computes with (runtime.threads)"),
    ] = None,
    checkpoint_dir: Annotated[Path, typer.Option(help="where per-round checkpoints live")] = Path(
        "results/checkpoints"
    ),
) -> None:
    """Search each method's hyperparameters (Optuna) with one budget for all of them.

    Every method gets the same trials, rounds, seeds and metric, scored on a validation split
    carved from each client's train samples (train.validation), never the test split; trials
    are pruned on the stored per-round metric. The study lives in --db (a PostgreSQL URL lets
    several `fpbench tune` processes share it), and rerunning the command resumes it. The best
    values of each method become the suite NAME+tuned (labels LABEL+tuned), written to --out:
    run it with `fpbench run --suite NAME+tuned`.
    """
    import importlib.util

    from fpbench.store import Store
    from fpbench.suites import load_suite

    if importlib.util.find_spec("optuna") is None:
        raise FpbenchError("fpbench tune needs Optuna: pip install 'fpbench[tune]'")
    from fpbench.tune.best import tuned_suite, write_toml
    from fpbench.tune.space import SHIPPED, space_for
    from fpbench.tune.study import Budget, CellsFailed, best_trial, trial_cells, tune_method

    loaded = load_suite(suite)
    labels = list(dict.fromkeys(c.method.label for c in loaded.cells))
    chosen = method or labels
    unknown = [m for m in chosen if m not in labels]
    if unknown:
        raise FpbenchError(
            f"method {unknown[0]!r} is not in suite {loaded.name} "
            f"(its methods: {', '.join(labels)})"
        )
    suite_rounds = {c.train.rounds for c in loaded.cells if c.method.label in chosen}
    if rounds is None and len(suite_rounds) > 1:
        raise FpbenchError(
            f"the methods of suite {loaded.name} run {sorted(suite_rounds)} rounds: give "
            "--rounds, the one budget every method is tuned with"
        )
    budget = Budget(
        trials=trials,
        rounds=rounds if rounds is not None else suite_rounds.pop(),
        validation=validation,
        metric=metric,
        seed=sampler_seed,
        seeds=tuple(sorted(set(seed))) if seed else None,
    )
    budget.check()
    space_file = space or SHIPPED
    by_label = {c.method.label: c.method.name for c in loaded.cells}
    spaces = {m: space_for(by_label[m], space_file) for m in chosen}  # all checked up front
    for m, params in spaces.items():  # every path settable, every range's values valid
        for pick in ("low", "high"):
            values = {p.path: p.example if pick == "low" else p.last for p in params}
            trial_cells(suite, m, values, budget)
    out = out or Path("benchmarks") / f"{loaded.name}+tuned.toml"
    existing = _read_tuned(out)
    tuned_suite(suite, {m: {} for m in chosen}, budget.text(), existing)  # the file can be made
    url = Store.url_from_path_or_url(db if "://" in db else Path(db).absolute())
    console.print(
        f"tuning {', '.join(chosen)} of suite {loaded.name}: {budget.text()}",
        highlight=False,
        soft_wrap=True,
    )

    def show(trial, done: int, total: int) -> None:
        shown = " ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        ended = (
            f"{metric} {trial.value:.4f}"
            if trial.value is not None and trial.state.name == "COMPLETE"
            else trial.user_attrs.get("pruned") or trial.state.name.lower()
        )
        console.print(
            f"{label} trial {trial.number}: {shown} -> {ended} ({done}/{total} done)",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )

    best = {}
    try:
        for label in chosen:
            study = tune_method(
                suite,
                label,
                spaces[label],
                budget,
                url,
                checkpoint_dir=checkpoint_dir.absolute(),
                worker=worker,
                runtime={k: v for k, v in (("device", device), ("threads", threads)) if v},
                on_trial=show,
            )
            top = best_trial(study, trials)
            best[label] = top.params
            console.print(
                f"{label}: best trial {top.number}, {metric} {top.value:.4f} on validation",
                highlight=False,
                soft_wrap=True,
            )
    except KeyboardInterrupt:
        err.print("interrupted; rerun the same command to resume the search", highlight=False)
        raise typer.Exit(130) from None
    except CellsFailed as e:
        err.print(f"[red]failed:[/] {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    write_toml(tuned_suite(suite, best, budget.text(), existing), out)
    console.print(f"wrote {out}; next: fpbench run --suite {out}", highlight=False, soft_wrap=True)


def _read_tuned(path: Path) -> dict | None:
    """An earlier tuned suite file at `path`, if any."""
    import tomllib

    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FpbenchError(f"cannot read the tuned suite {path}: {e}") from None


def _short(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
