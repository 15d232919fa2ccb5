"""Fold results databases into one, idempotently (e.g. one SQLite file per cell -> one database).

Runs are matched by `run_key`. A run new to the output is copied with its rounds and metrics;
a run the output already has is replaced only by a more complete copy (done beats not done,
then more rounds), so merging the same inputs again, in any order, changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from fpbench.errors import FpbenchError
from fpbench.store.models import Metric, Round, Run
from fpbench.store.repo import Store, _safe_url

RUN_FIELDS = [c.name for c in Run.__table__.columns if c.name != "id"]
ROUND_FIELDS = [c.name for c in Round.__table__.columns if c.name != "run_id"]
METRIC_FIELDS = [c.name for c in Metric.__table__.columns if c.name not in ("id", "run_id")]


@dataclass
class MergeStats:
    """What one merge did, counted in runs."""

    added: int = 0  # new to the output
    replaced: int = 0  # the output's copy was less complete
    unchanged: int = 0  # the output's copy was as complete or more

    def __str__(self) -> str:
        return f"{self.added} added, {self.replaced} replaced, {self.unchanged} unchanged"


@dataclass(frozen=True)
class _Copy:
    """One run read from an input: its row, rounds and metrics (dicts without ids)."""

    run: dict[str, Any]
    rounds: list[dict[str, Any]]
    metrics: list[dict[str, Any]]

    @property
    def rank(self) -> tuple[bool, int]:
        return (self.run["status"] == "done", len(self.rounds))


def merge_into(out: Store, src: Store) -> MergeStats:
    """Copy every run of `src` into `out` unless `out` already has it as complete or more."""
    if out.url == src.url:
        where = Store.sqlite_file(src.url) or _safe_url(src.url)
        raise FpbenchError(f"cannot merge {where} into itself; name another output")
    stats = MergeStats()
    if not src.has_schema():
        return stats
    with src._session() as s:
        ids = s.scalars(select(Run.id).order_by(Run.id)).all()
    for run_id in ids:  # one short transaction per run on each side
        with src._session() as s:
            copy = _read(s, run_id)
        out.ensure_schema()  # a new output is created with its first run
        with out._session.begin() as s:
            outcome = _write(s, copy)
        setattr(stats, outcome, getattr(stats, outcome) + 1)
    return stats


def _read(s: Session, run_id: int) -> _Copy:
    run = s.execute(select(*[getattr(Run, f) for f in RUN_FIELDS]).where(Run.id == run_id)).one()
    rounds = s.execute(
        select(*[getattr(Round, f) for f in ROUND_FIELDS]).where(Round.run_id == run_id)
    ).all()
    metrics = s.execute(
        select(*[getattr(Metric, f) for f in METRIC_FIELDS]).where(Metric.run_id == run_id)
    ).all()
    return _Copy(run._asdict(), [r._asdict() for r in rounds], [m._asdict() for m in metrics])


def _write(s: Session, copy: _Copy) -> str:
    """Apply one run to the output inside its transaction; returns the MergeStats field."""
    key = copy.run["run_key"]
    target = s.execute(select(Run.id, Run.status).where(Run.run_key == key)).one_or_none()
    if target is None:
        run_id = s.execute(insert(Run).values(**copy.run).returning(Run.id)).scalar_one()
        _insert_rows(s, run_id, copy)
        return "added"
    n_rounds = s.scalar(select(func.count()).where(Round.run_id == target.id)) or 0
    if copy.rank <= (target.status == "done", n_rounds):
        return "unchanged"
    s.execute(delete(Metric).where(Metric.run_id == target.id))
    s.execute(delete(Round).where(Round.run_id == target.id))
    s.execute(update(Run).where(Run.id == target.id).values(**copy.run))
    _insert_rows(s, target.id, copy)
    return "replaced"


def _insert_rows(s: Session, run_id: int, copy: _Copy) -> None:
    if copy.rounds:
        s.execute(insert(Round), [{**r, "run_id": run_id} for r in copy.rounds])
    if copy.metrics:
        s.execute(insert(Metric), [{**m, "run_id": run_id} for m in copy.metrics])
