"""`fpbench db ...`: maintenance commands for results databases."""

from __future__ import annotations

from typing import Annotated

import typer

from fpbench.cli.apps import db_app
from fpbench.cli.common import console, user_errors
from fpbench.errors import FpbenchError


def _existing(db: str) -> str:
    """The URL of an input database; a SQLite path must exist (it is not created)."""
    from fpbench.store import Store

    url = Store.url_from_path_or_url(db)
    if (path := Store.sqlite_file(url)) is not None and not path.is_file():
        raise FpbenchError(f"no results database at {db}; check the input paths")
    return url


@db_app.command("merge")
@user_errors
def merge(
    out: Annotated[str, typer.Argument(help="output database: a path or SQLAlchemy URL")],
    inputs: Annotated[list[str], typer.Argument(help="input databases (paths or URLs)")],
) -> None:
    """Fold databases into OUT (created if missing); merging again changes nothing.

    A run OUT already has is replaced only by a more complete copy (done, then more rounds).
    Inputs holding a broken run (see `fpbench db check`) are refused before anything is written.
    """
    from fpbench.store import Store
    from fpbench.store.check import broken_runs
    from fpbench.store.merge import MergeStats, merge_into

    urls = [_existing(db) for db in inputs]  # every input checked before OUT is touched
    for db, url in zip(inputs, urls, strict=True):
        with Store(url) as src:  # readable, not of a newer schema version, no broken runs
            if broken := broken_runs(src):
                p = broken[0]
                more = f" (and {len(broken) - 1} more problems)" if len(broken) > 1 else ""
                raise FpbenchError(
                    f"{db}: run {p.run_id} {p.run_key} ({p.status}): {p.message}{more}; "
                    f"nothing merged (see `fpbench db check {db}`)"
                )
    total = MergeStats()
    with Store(Store.url_from_path_or_url(out)) as target:
        for db, url in zip(inputs, urls, strict=True):
            with Store(url) as src:
                stats = merge_into(target, src)
            console.print(f"{db}: {stats}", highlight=False, soft_wrap=True)
            for field in ("added", "replaced", "unchanged"):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
    console.print(f"[bold]{out}[/]: {total} (runs)", highlight=False, soft_wrap=True)


@db_app.command("check")
@user_errors
def check(
    db: Annotated[str, typer.Argument(help="database to check: a path or SQLAlchemy URL")],
) -> None:
    """Verify rounds have no gaps and every done run has all its rounds and metrics; list
    failed, interrupted and stale runs.

    Exit code 1 when there are problems.
    """
    from fpbench.store import Store
    from fpbench.store.check import check as find_problems

    with Store(_existing(db)) as store:
        problems = find_problems(store)
        n_runs = len(store.runs())
    if not problems:
        console.print(f"{db}: {n_runs} runs, no problems", highlight=False, soft_wrap=True)
        return
    console.print(f"{db}: {len(problems)} problems in {n_runs} runs", highlight=False)
    for p in problems:
        line = f"  run {p.run_id} {p.run_key} ({p.status}): {p.message}"
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    raise typer.Exit(1)
