"""`fpbench db ...`: maintenance commands for results databases."""

from __future__ import annotations

from typing import Annotated

import typer

from fpbench.cli.apps import db_app
from fpbench.cli.common import console, plural, user_errors
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
    """
    from fpbench.store import Store
    from fpbench.store.merge import MergeStats, merge_into

    urls = [_existing(db) for db in inputs]  # every input checked before OUT is touched
    for url in urls:
        Store(url).close()  # readable, and not of a newer schema version
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
    """Verify every done run has all its rounds and metrics; list failed and stuck runs.

    Exit code 1 when there are problems.
    """
    from fpbench.store import Store
    from fpbench.store.check import check as find_problems

    with Store(_existing(db)) as store:
        problems = find_problems(store)
        n_runs = len(store.runs())
    if not problems:
        line = f"{db}: {plural(n_runs, 'run')}, no problems"
        console.print(line, highlight=False, soft_wrap=True)
        return
    line = f"{db}: {plural(len(problems), 'problem')} in {plural(n_runs, 'run')}"
    console.print(line, highlight=False)
    for p in problems:
        line = f"  run {p.run_id} {p.run_key} ({p.status}): {p.message}"
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    raise typer.Exit(1)
