"""SQLAlchemy 2.0 models of the results database: `runs`, `rounds`, `metrics` and `meta`.

Other tools read these tables directly, so names and columns are a contract (see DESIGN.md).
Datetimes are stored as UTC and read back as timezone-aware UTC on every backend.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[dt.datetime]):
    """A datetime stored as naive UTC and returned as aware UTC (SQLite drops time zones)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass an aware (UTC) datetime")
        return value.astimezone(dt.timezone.utc).replace(tzinfo=None)

    def process_result_value(
        self, value: dt.datetime | None, dialect: Dialect
    ) -> dt.datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Base(DeclarativeBase):
    """Declarative base whose MetaData names every constraint and index predictably."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


STATUSES = ("pending", "running", "done", "failed", "interrupted")  # interrupted: by Ctrl-C
STATUS_CHECK = f"status IN ({', '.join(repr(s) for s in STATUSES)})"


class Run(Base):
    """One (suite, method, dataset, partition, seed) cell with its fully resolved config."""

    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(STATUS_CHECK, name="status"),
        Index(None, "suite", "method"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_key: Mapped[str] = mapped_column(String(128), unique=True)
    suite: Mapped[str] = mapped_column(String(255))
    method: Mapped[str] = mapped_column(String(255))
    dataset: Mapped[str] = mapped_column(String(255))
    partition: Mapped[str] = mapped_column(String(255))
    seed: Mapped[int] = mapped_column(Integer)
    config_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="pending")
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    wall_s: Mapped[float | None] = mapped_column(Float)
    fpbench_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    device: Mapped[str] = mapped_column(String(255))
    # the claim of a running cell: who runs it and when it last proved alive (store/claims.py)
    owner: Mapped[str | None] = mapped_column(String(255))
    heartbeat_at: Mapped[dt.datetime | None] = mapped_column(UTCDateTime)
    traceback: Mapped[str | None] = mapped_column(Text)  # of a failed run, with `error`
    # what the run cost (fpbench/engine/cost.py): peak device memory (CUDA: max allocated;
    # CPU: peak RSS) and the FLOPs of its first round
    peak_mem_bytes: Mapped[int | None] = mapped_column(BigInteger)
    round_flops: Mapped[int | None] = mapped_column(BigInteger)
    git_commit: Mapped[str | None] = mapped_column(String(64))  # store/provenance.py


class Round(Base):
    """Per-round scalars of one run; (run_id, round) is the primary key, hence unique."""

    __tablename__ = "rounds"

    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    loss_train: Mapped[float | None] = mapped_column(Float)
    wall_s: Mapped[float] = mapped_column(Float)
    bytes_up: Mapped[int] = mapped_column(BigInteger)
    bytes_down: Mapped[int] = mapped_column(BigInteger)


class Metric(Base):
    """Long-format metric rows; `client_id` is NULL for aggregates over clients.

    SQL unique constraints treat NULLs as distinct, so a partial unique index keeps aggregate
    rows unique too; `Store.write_round` additionally replaces a round's rows as a whole.
    """

    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "client_id", "name"),
        Index(
            "uq_metrics_run_id_round_name_aggregate",
            "run_id",
            "round",
            "name",
            unique=True,
            sqlite_where=text("client_id IS NULL"),
            postgresql_where=text("client_id IS NULL"),
        ),
        Index(None, "name"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int] = mapped_column(Integer)
    client_id: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    count: Mapped[int | None] = mapped_column(Integer)


class Meta(Base):
    """Key/value facts about the database itself, e.g. `schema_version` (store/schema.py)."""

    __tablename__ = "meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
