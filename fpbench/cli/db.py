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


def _same_database(a: str, b: str) -> bool:
    """Whether two URLs name one database (SQLite paths compared as resolved files)."""
    from fpbench.store import Store

    fa, fb = Store.sqlite_file(a), Store.sqlite_file(b)
    if fa is not None and fb is not None:
        return fa.expanduser().resolve() == fb.expanduser().resolve()
    return a == b


@db_app.command("merge", short_help="Fold databases into OUT; merging again changes nothing.")
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
        if _same_database(url, Store.url_from_path_or_url(out)):
            raise FpbenchError(f"cannot merge {db} into itself (it is OUT); name another output")
    for db, url in zip(inputs, urls, strict=True):
        with Store(
            url, read_only=True
        ) as src:  # readable, not of a newer schema version, no broken runs
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
            with Store(url, read_only=True) as src:
                stats = merge_into(target, src)
            copied = _copy_params(url, target.url)
            more = f", {copied} trained state(s) copied" if copied else ""
            console.print(f"{db}: {stats}{more}", highlight=False, soft_wrap=True)
            for field in ("added", "replaced", "unchanged"):
                setattr(total, field, getattr(total, field) + getattr(stats, field))
    console.print(f"[bold]{out}[/]: {total} (runs)", highlight=False, soft_wrap=True)


def _copy_params(src_url: str, out_url: str) -> int:
    """Copy the kept trained states beside a SQLite input to beside a SQLite OUT (those OUT
    lacks); how many were copied."""
    import shutil

    from fpbench.engine.artifacts import params_path
    from fpbench.store import Store

    src, out = Store.sqlite_file(src_url), Store.sqlite_file(out_url)
    if src is None or out is None:
        return 0
    folder = params_path(src_url, src.parent, "x").parent
    copied = 0
    for kept in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
        target = params_path(out_url, out.parent, kept.stem)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kept, target.with_suffix(".tmp"))
            target.with_suffix(".tmp").replace(target)
            copied += 1
    return copied


@db_app.command("check", short_help="Verify every run's rounds and list unfinished runs.")
@user_errors
def check(
    db: Annotated[str, typer.Argument(help="database to check: a path or SQLAlchemy URL")],
) -> None:
    """Verify every run's rounds (no gaps; a done run complete) and list unfinished runs.

    A done run must hold all its rounds, their losses and its final evaluation; failed,
    interrupted and stale runs are listed.

    Exit code 1 when there are problems.
    """
    from fpbench.store import Store
    from fpbench.store.check import check as find_problems

    with Store(_existing(db), read_only=True) as store:
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


@db_app.command("diff")
@user_errors
def diff(
    a: Annotated[str, typer.Argument(help="first database: a path or SQLAlchemy URL")],
    b: Annotated[str, typer.Argument(help="second database: a path or SQLAlchemy URL")],
    show: Annotated[int, typer.Option(min=0, help="differences listed (the first N)")] = 20,
) -> None:
    """Whether two databases hold the same results, bit for bit.

    Runs are matched by run key; of each pair the status, every round's loss and bytes and every
    metric row (value and count) are compared exactly. Times, memory and FLOPs are not compared.

    Exit code 1 when a run is in one database only or any value differs.
    """
    from fpbench.store import Store
    from fpbench.store.diff import diff as compare

    url_a, url_b = _existing(a), _existing(b)
    with Store(url_a, read_only=True) as sa, Store(url_b, read_only=True) as sb:
        found = compare(sa, sb, keep=show)
    for line in (
        f"runs in A ({a}): {found.runs_a:,}",
        f"runs in B ({b}): {found.runs_b:,}",
        f"runs matched: {found.matched:,}",
        f"values compared: {found.compared:,}",
        f"values different: {found.different:,}",
    ):
        console.print(line, highlight=False, soft_wrap=True, markup=False)
    for side, keys in (("A", found.only_a), ("B", found.only_b)):
        if keys:
            console.print(f"runs only in {side}: {len(keys):,}", highlight=False)
            for key in keys[:show]:
                console.print(f"  {key}", highlight=False, soft_wrap=True, markup=False)
    if found.first:
        console.print(f"first {plural(len(found.first), 'difference')} (A != B):")
        for d in found.first:
            line = f"  {d.run_key} {d.what}: {d.a} != {d.b}"
            console.print(line, highlight=False, soft_wrap=True, markup=False)
    if not found.same:
        raise typer.Exit(1)


@db_app.command("delete", short_help="Delete runs with their rounds and metrics (reset or drop).")
@user_errors
def delete(
    runs: Annotated[
        list[str], typer.Argument(metavar="RUN...", help="run ids or run_key prefixes")
    ],
    db: Annotated[str, typer.Option("--db", help="results database: a path or SQLAlchemy URL")] = (
        "results/fpbench.db"
    ),
    yes: Annotated[bool, typer.Option("--yes", help="delete; without it, only list them")] = False,
) -> None:
    """Delete runs with their rounds and metrics, to run them afresh (reset) or drop them.

    Without --yes, lists what would go. A running run whose claim is live is refused. A rerun of
    the suite runs a deleted cell from round 0: its old checkpoint is bound to the deleted run
    and ignored.
    """
    from fpbench.cli.common import open_store
    from fpbench.store import claim_is_live

    with open_store(db, must_exist=True, read_only=False) as store:
        records = list({r.id: r for r in (store.get_run(ref) for ref in runs)}.values())
        for r in records:
            if claim_is_live(r):
                raise FpbenchError(
                    f"run {r.id} ({r.run_key}) is running in a live process ({r.owner}); "
                    "stop it first"
                )
        for r in records:
            cell = f"{r.method} / {r.dataset} / {r.partition} / seed {r.seed}"
            said = "deleted" if yes else "would delete"
            console.print(
                f"{said} run {r.id} {r.run_key} ({r.suite}: {cell}, {r.status})",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
            if yes:
                store.delete_run(r.id)
    if not yes:
        console.print("nothing deleted: add --yes to delete", highlight=False)
