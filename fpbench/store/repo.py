"""The results-database facade: the only way the engine, reports and CLI touch the store.

Every method opens and commits its own short transaction and returns plain dataclasses or
pandas DataFrames, never ORM rows, so callers never hold a session.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd
from sqlalchemy import Engine, create_engine, delete, func, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from fpbench.errors import FpbenchError
from fpbench.store.claims import ClaimMixin, shown_status, touch_or_raise
from fpbench.store.models import Metric, Round, Run
from fpbench.store.ownership import State, create, probe, sqlite_path
from fpbench.store.provenance import git_commit as source_commit
from fpbench.store.schema import check_version, database_id, needs_upgrade, upgrade
from fpbench.store.sqlite import (
    configure_sqlite,
    folder_writable,
    in_memory_copy,
    read_only_engine,
)

MIN_KEY_PREFIX = 4
RUN_COLUMNS = [
    "id", "run_key", "suite", "method", "dataset", "partition", "seed", "status", "error",
    "created_at", "finished_at", "wall_s", "fpbench_version", "torch_version", "device",
    "peak_mem_bytes", "round_flops", "git_commit",
]  # fmt: skip
METRIC_COLUMNS = [
    "run_id", "suite", "method", "dataset", "partition", "seed", "round", "client_id", "name",
    "value", "count",
]  # fmt: skip
ROUND_COLUMNS = ["run_id", "round", "loss_train", "wall_s", "bytes_up", "bytes_down"]

MetricRow = tuple[int | None, str, float, int | None]  # (client_id, name, value, count)


@dataclass(frozen=True)
class RunRecord:
    """A run as stored, with its config parsed back from JSON."""

    id: int
    run_key: str
    suite: str
    method: str
    dataset: str
    partition: str
    seed: int
    status: str
    config: dict[str, Any]
    error: str | None
    created_at: dt.datetime
    finished_at: dt.datetime | None
    wall_s: float | None
    fpbench_version: str
    torch_version: str
    device: str
    owner: str | None = None  # the claim: who runs (or ran) it, and its last heartbeat
    heartbeat_at: dt.datetime | None = None
    traceback: str | None = None  # of a failed run
    peak_mem_bytes: int | None = None  # what it cost (fpbench.engine.cost)
    round_flops: int | None = None
    git_commit: str | None = None  # the source it ran (`fpbench.store.provenance`)


def _record(run: Run) -> RunRecord:
    # every RunRecord field is a Run column of the same name, except the parsed config
    values = {f.name: getattr(run, f.name) for f in fields(RunRecord) if f.name != "config"}
    return RunRecord(config=json.loads(run.config_json), **values)


def _reason(exc: BaseException) -> str:
    """First line of the underlying driver error, without SQLAlchemy's boilerplate."""
    inner = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
    text = str(inner).strip() or type(inner).__name__
    return text.splitlines()[0]


def _driver_hint(url: str, exc: BaseException) -> str:
    """What to install when the URL's database driver is missing."""
    if not isinstance(exc, ImportError):
        return ""
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        return ""
    if backend == "postgresql":
        return (
            "; install fpbench's PostgreSQL driver with pip install 'fpbench[postgres]' and "
            "name it in the URL: postgresql+psycopg://USER:PASSWORD@HOST/DB"
        )
    return f"; install the Python driver of {backend} that this URL names"


def _safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def _open_engine(url: str, read_only: bool = False) -> tuple[Engine, State]:
    """The engine and what the database holds; a database that is not fpbench's is refused and
    a missing one is not created (see `fpbench.store.ownership`). `read_only`: an existing
    SQLite file is read without writing a byte (one of an older schema through an upgraded
    in-memory copy); else one in a folder that cannot be written is refused now."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = configure_sqlite(create_engine(parsed))
    else:  # a server restarted between two transactions: reconnect instead of failing the cell
        engine = create_engine(parsed, pool_pre_ping=True)
    try:
        state = probe(engine)  # reads only
        path = sqlite_path(engine)
        if state is State.FPBENCH and path is not None and read_only:
            engine.dispose()
            engine = read_only_engine(path)
            check_version(engine)
            if needs_upgrade(engine):
                engine.dispose()
                engine = in_memory_copy(path)
                upgrade(engine)
        elif state is State.FPBENCH:
            if path is not None:
                _require_writable(path)
            check_version(engine)  # a newer database is refused before anything is written
            upgrade(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine, state


def _require_writable(path: Path) -> None:
    """Refuse, before anything is stored, a database this process could read but not write."""
    folder = path.resolve().parent
    if not folder_writable(folder):
        raise FpbenchError(
            f"its folder {folder} is read-only (an archive or a shared mount?): commands that "
            "only read it (runs, show, table, compare, export, report, plot, db check, db diff) "
            "open it read-only; to run or merge into it, copy it to a writable folder"
        )
    if not os.access(path, os.W_OK):
        raise FpbenchError(
            f"the file is read-only: commands that only read it open it read-only; to run or "
            f"merge into it, make it writable (chmod u+w {path}) or copy it"
        )


def _metric_dicts(run_id: int, round_: int, rows: Iterable[MetricRow]) -> list[dict[str, Any]]:
    """Normalize metric tuples to insert dicts; reject duplicates and NaN values."""
    out, seen = [], set()
    for client_id, name, value, count in rows:
        key = (client_id, name)
        if key in seen:
            raise ValueError(f"metric {name!r} for client {client_id} given twice in one round")
        seen.add(key)
        if math.isnan(value):
            raise ValueError(f"metric {name!r} for client {client_id} is NaN; omit it instead")
        out.append(
            {
                "run_id": run_id,
                "round": round_,
                "client_id": None if client_id is None else int(client_id),
                "name": str(name),
                "value": float(value),
                "count": None if count is None else int(count),
            }
        )
    return out


class Store(ClaimMixin):
    """Results database: runs, per-round scalars and long-format metrics.

    Args:
        url: any SQLAlchemy URL; SQLite files get WAL mode and foreign keys. A database that is
            not fpbench's is refused unchanged; a new one (a missing SQLite file and its parent
            folder, or an empty server database) is created only when the first run is written.
        read_only: for commands that only read: an existing SQLite file is opened without
            writing a byte, so one in a read-only folder (an archive, a shared mount) opens.
            Without it, such a database is refused at once, before anything is stored.

    Raises:
        FpbenchError: the database cannot be opened, or is not fpbench's (or, without
            `read_only`, is a SQLite file in a folder that cannot be written).
    """

    def __init__(self, url: str, *, read_only: bool = False):
        self.url, self.read_only = url, read_only
        with self._errors():
            self._engine, self._state = _open_engine(url, read_only)
        self._session = sessionmaker(self._engine, expire_on_commit=False)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except FpbenchError as exc:
            raise FpbenchError(f"results database {_safe_url(self.url)}: {exc}") from exc
        except (SQLAlchemyError, sqlite3.Error, OSError, ValueError, ImportError) as exc:
            raise FpbenchError(
                f"cannot open results database {_safe_url(self.url)}: {_reason(exc)}"
                + _driver_hint(self.url, exc)
            ) from exc

    def has_schema(self, *, create_now: bool = False) -> bool:
        """Whether fpbench's tables exist (made by another process meanwhile, or, with
        `create_now`, by this call: only a write about to happen may create the database)."""
        if self._state is State.ABSENT:
            with self._errors():
                self._state = probe(self._engine)
                if self._state is State.FPBENCH:  # made by another process meanwhile
                    check_version(self._engine)
                if self._state is State.ABSENT and create_now:
                    create(self._engine)
                    self._state = State.FPBENCH
        return self._state is State.FPBENCH

    def ensure_schema(self) -> None:
        """Create the database now if it does not exist yet (just before a first write)."""
        self.has_schema(create_now=True)

    def close(self) -> None:
        """Release pooled connections (the Store is unusable afterwards)."""
        self._engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({_safe_url(self.url)!r})"

    @property
    def database_id(self) -> str:
        """This database's identity (a uuid in `meta`), to which checkpoints are bound."""
        self.ensure_schema()
        if getattr(self, "_database_id", None) is None:
            self._database_id = database_id(self._engine)
        return self._database_id

    @staticmethod
    def url_from_path_or_url(s: str | os.PathLike[str]) -> str:
        """Turn a file path into a SQLite URL; a string containing '://' passes through."""
        s = os.fspath(s)
        if "://" in s:
            return s
        return f"sqlite:///{os.path.expanduser(s)}"

    @staticmethod
    def sqlite_file(url: str) -> Path | None:
        """The file a `sqlite:///PATH` URL names (it may not exist yet); None for other URLs."""
        prefix = "sqlite:///"
        return Path(url[len(prefix) :]) if url.startswith(prefix) else None

    # -- runs ---------------------------------------------------------------------------------

    def find_run(self, run_key: str) -> RunRecord | None:
        """The run with exactly this key, or None."""
        if not self.has_schema():
            return None
        with self._session() as s:
            run = s.scalar(select(Run).where(Run.run_key == run_key))
            return None if run is None else _record(run)

    def create_run(
        self,
        *,
        run_key: str,
        suite: str,
        method: str,
        dataset: str,
        partition: str,
        seed: int,
        config: dict[str, Any],
        fpbench_version: str,
        torch_version: str,
        device: str,
        git_commit: str | None | bool = True,
    ) -> RunRecord:
        """Insert a new run with status 'pending'. `git_commit`: True (default) stores fpbench's
        own commit (`fpbench.store.provenance`); a string or None is stored as given.

        Raises:
            FpbenchError: a run with this key already exists.
        """
        self.ensure_schema()
        run = Run(
            run_key=run_key,
            suite=suite,
            method=method,
            dataset=dataset,
            partition=partition,
            seed=int(seed),
            config_json=json.dumps(config, sort_keys=True),
            status="pending",
            created_at=dt.datetime.now(dt.timezone.utc),
            fpbench_version=fpbench_version,
            torch_version=torch_version,
            device=device,
            git_commit=source_commit() if git_commit is True else git_commit or None,
        )
        try:
            with self._session.begin() as s:
                s.add(run)
        except IntegrityError as exc:
            raise FpbenchError(
                f"run_key {run_key!r} already exists; use find_run to resume it"
            ) from exc
        return _record(run)

    @staticmethod
    def _get(s: Session, run_id: int) -> Run:
        run = s.get(Run, run_id)
        if run is None:
            raise FpbenchError(f"no run with id {run_id}; see `fpbench runs`")
        return run

    def runs(self, suite: str | None = None) -> pd.DataFrame:
        """One row per run (config omitted) plus `last_round` (None before any round); a
        'running' run whose process died or whose heartbeat stopped has status 'stale', as every
        view shows it (`shown_status`)."""
        if not self.has_schema():
            empty = pd.DataFrame(columns=[*RUN_COLUMNS, "last_round"])
            return empty.astype({"last_round": "Int64"})
        last = (
            select(Round.run_id, func.max(Round.round).label("last_round"))
            .group_by(Round.run_id)
            .subquery()
        )
        cols = [getattr(Run, c) for c in RUN_COLUMNS]
        claim = [Run.owner, Run.heartbeat_at]
        stmt = select(*cols, last.c.last_round, *claim).outerjoin(last, last.c.run_id == Run.id)
        if suite is not None:
            stmt = stmt.where(Run.suite == suite)
        with self._session() as s:
            rows = s.execute(stmt.order_by(Run.id)).all()
        df = pd.DataFrame([r[:-2] for r in rows], columns=[*RUN_COLUMNS, "last_round"])
        df["status"] = [shown_status(r.status, r.owner, r.heartbeat_at) for r in rows]
        return df.astype({"last_round": "Int64"})

    def get_run(self, ref: str | int) -> RunRecord:
        """A run by numeric id, or by a unique prefix (>= 4 characters) of its run key.

        A numeric ref that is not an id is tried as a key prefix (keys are hex hashes).

        Raises:
            FpbenchError: no run matches, or the prefix matches several runs.
        """
        ref = str(ref).strip()
        if not self.has_schema():
            raise FpbenchError(f"no run {ref!r}: the database holds no runs yet")
        with self._session() as s:
            if ref.isdigit() and (run := s.get(Run, int(ref))) is not None:
                return _record(run)
            if len(ref) < MIN_KEY_PREFIX:
                raise FpbenchError(
                    f"no run {ref!r}: give a run id or at least {MIN_KEY_PREFIX} characters "
                    "of a run key (see `fpbench runs`)"
                )
            stmt = select(Run).where(Run.run_key.startswith(ref, autoescape=True)).limit(6)
            found = s.scalars(stmt).all()
        if not found:
            raise FpbenchError(f"no run with id or key prefix {ref!r}; see `fpbench runs`")
        if len(found) > 1:
            keys = ", ".join(r.run_key for r in found[:5])
            raise FpbenchError(f"run key prefix {ref!r} is ambiguous ({keys}, ...): give more")
        return _record(found[0])

    def record_cost(
        self,
        run_id: int,
        *,
        peak_mem_bytes: int | None = None,
        round_flops: int | None = None,
        owner: str | None = None,
    ) -> None:
        """Store what a run cost: its peak memory (the largest of its sessions') and the
        FLOPs of a round (kept once stored). `owner`: as in `write_round`."""
        with self._session.begin() as s:
            run = self._get(s, run_id)
            if owner is not None:
                touch_or_raise(s, run_id, owner)
            if peak_mem_bytes is not None:
                run.peak_mem_bytes = max(int(peak_mem_bytes), run.peak_mem_bytes or 0)
            if round_flops is not None and run.round_flops is None:
                run.round_flops = int(round_flops)

    # -- rounds and metrics --------------------------------------------------------------------

    def write_round(
        self,
        run_id: int,
        round: int,
        *,
        loss_train: float | None,
        wall_s: float,
        bytes_up: int,
        bytes_down: int,
        metrics: Iterable[MetricRow],
        owner: str | None = None,
    ) -> None:
        """Write one round's scalars and metric rows, replacing any earlier copy of that round.

        Args:
            metrics: (client_id or None for aggregates, name, value, count or None) tuples.
            owner: the claim owner (see `claim_run`); when given, the round is written only
                while that claim holds (ClaimLost otherwise) and its heartbeat is refreshed.
        """
        metric_rows = _metric_dicts(int(run_id), int(round), metrics)
        self.ensure_schema()
        loss = None if loss_train is None or math.isnan(loss_train) else float(loss_train)
        with self._session.begin() as s:
            self._get(s, run_id)
            if owner is not None:
                touch_or_raise(s, run_id, owner)
            s.execute(delete(Metric).where(Metric.run_id == run_id, Metric.round == round))
            s.execute(delete(Round).where(Round.run_id == run_id, Round.round == round))
            s.execute(
                insert(Round).values(
                    run_id=run_id,
                    round=int(round),
                    loss_train=loss,
                    wall_s=float(wall_s),
                    bytes_up=int(bytes_up),
                    bytes_down=int(bytes_down),
                )
            )
            if metric_rows:
                s.execute(insert(Metric), metric_rows)

    def delete_run(self, run_id: int) -> None:
        """Remove a run with its rounds and metrics (a rerun of its suite runs it afresh)."""
        with self._session.begin() as s:
            s.execute(delete(Metric).where(Metric.run_id == run_id))
            s.execute(delete(Round).where(Round.run_id == run_id))
            s.execute(delete(Run).where(Run.id == run_id))

    def truncate_after(self, run_id: int, round: int) -> None:
        """Delete rounds and metrics with round > `round` (before resuming from a checkpoint)."""
        if not self.has_schema():
            return
        with self._session.begin() as s:
            s.execute(delete(Metric).where(Metric.run_id == run_id, Metric.round > round))
            s.execute(delete(Round).where(Round.run_id == run_id, Round.round > round))

    def last_round(self, run_id: int) -> int | None:
        """The highest round written for this run, or None."""
        if not self.has_schema():
            return None
        with self._session() as s:
            return s.scalar(select(func.max(Round.round)).where(Round.run_id == run_id))

    def round_numbers(self, run_id: int) -> list[int]:
        """The rounds stored for this run, ascending."""
        if not self.has_schema():
            return []
        stmt = select(Round.round).where(Round.run_id == run_id).order_by(Round.round)
        with self._session() as s:
            return list(s.scalars(stmt))

    def rounds(self, run_id: int) -> pd.DataFrame:
        """Per-round scalars of one run, ordered by round."""
        if not self.has_schema():
            return pd.DataFrame(columns=ROUND_COLUMNS)
        stmt = select(*[getattr(Round, c) for c in ROUND_COLUMNS]).where(Round.run_id == run_id)
        with self._session() as s:
            rows = s.execute(stmt.order_by(Round.round)).all()
        return pd.DataFrame(rows, columns=ROUND_COLUMNS)

    def metrics(
        self,
        *,
        suite: str | None = None,
        run_ids: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        aggregate_only: bool = True,
    ) -> pd.DataFrame:
        """Metric rows joined with their run labels (columns `METRIC_COLUMNS`).

        Args:
            suite: only runs of this suite.
            run_ids: only these runs.
            names: only these metric names (exact, e.g. "acc_global_last10").
            aggregate_only: only rows with client_id NULL (aggregates over clients).
        """
        if not self.has_schema():
            return _metric_frame([])
        run_cols = [Run.suite, Run.method, Run.dataset, Run.partition, Run.seed]
        metric_cols = [Metric.round, Metric.client_id, Metric.name, Metric.value, Metric.count]
        stmt = select(Metric.run_id, *run_cols, *metric_cols).join(Run, Run.id == Metric.run_id)
        if suite is not None:
            stmt = stmt.where(Run.suite == suite)
        if run_ids is not None:
            stmt = stmt.where(Metric.run_id.in_([int(i) for i in run_ids]))
        if names is not None:
            stmt = stmt.where(Metric.name.in_(list(names)))
        if aggregate_only:
            stmt = stmt.where(Metric.client_id.is_(None))
        order = (Metric.run_id, Metric.round, Metric.client_id, Metric.name)
        with self._session() as s:
            rows = s.execute(stmt.order_by(*order)).all()
        return _metric_frame(rows)


def _metric_frame(rows: Sequence[Any]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=METRIC_COLUMNS)
    return df.astype({"client_id": "Int64", "count": "Int64", "value": "float64"})
