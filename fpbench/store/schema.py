"""The results database's schema version and its automatic, additive upgrade.

Version 1 had `runs`, `rounds` and `metrics` only. Version 2 adds the claim columns (`owner`,
`heartbeat_at`) and `traceback` to `runs`, and the `meta` table that records the version.
Version 3 admits the status `interrupted` (a cell stopped by Ctrl-C, resumed by a rerun): the
only change is the wider CHECK constraint on `runs.status`. `meta` also holds the database's
identity (`database_id`, a random uuid written once), to which checkpoints are bound: a
checkpoint is only ever resumed into the database it was written for.
Opening a database upgrades an older one in place (columns are only ever added, a constraint
only widened); a newer one is refused before anything is written, because this fpbench would
not know what its extra tables, columns and statuses mean.

Later nullable columns that an older fpbench can ignore are added the same way without a new
version: `peak_mem_bytes` and `round_flops` (what a run cost, `fpbench.engine.cost`), and
`git_commit` (the source it ran, `fpbench.store.provenance`).
"""

from __future__ import annotations

import uuid

from sqlalchemy import Engine, insert, inspect, select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from fpbench.errors import FpbenchError
from fpbench.store.models import STATUS_CHECK, Base, Meta, Run

SCHEMA_VERSION = 3
VERSION_KEY = "schema_version"
DATABASE_ID_KEY = "database_id"
# runs columns newer than version 1
ADDED_COLUMNS = (
    "owner", "heartbeat_at", "traceback", "peak_mem_bytes", "round_flops", "git_commit",
)  # fmt: skip


def stored_version(engine: Engine) -> int | None:
    """The database's schema version; None for an empty database, 1 before `meta` existed."""
    tables = set(inspect(engine).get_table_names())
    if "runs" not in tables:
        return None
    if "meta" not in tables:
        return 1
    with engine.connect() as con:
        value = con.scalar(select(Meta.value).where(Meta.key == VERSION_KEY))
    try:
        return 1 if value is None else int(value)
    except ValueError:
        raise FpbenchError(f"unreadable schema version {value!r} in its meta table") from None


def check_version(engine: Engine) -> None:
    """Refuse a database written by a newer fpbench (call before writing anything).

    Raises:
        FpbenchError: the stored schema version is newer than this fpbench's.
    """
    version = stored_version(engine)
    if version is not None and version > SCHEMA_VERSION:
        raise FpbenchError(
            f"schema version {version} is newer than this fpbench's ({SCHEMA_VERSION}); "
            "upgrade fpbench (pip install -U fpbench) to use it"
        )


def needs_upgrade(engine: Engine) -> bool:
    """Whether `upgrade` would change this fpbench database (an older version, a missing column)."""
    tables = set(inspect(engine).get_table_names())
    if "meta" not in tables or set(ADDED_COLUMNS) - _run_columns(engine):
        return True
    if any(t.name not in tables for t in Base.metadata.sorted_tables):
        return True
    return stored_version(engine) != SCHEMA_VERSION


def upgrade(engine: Engine) -> None:
    """Add the tables and columns an older fpbench database lacks; record the current version."""
    _create_missing_tables(engine)
    for name in [c for c in ADDED_COLUMNS if c not in _run_columns(engine)]:
        column = Run.__table__.c[name]
        ddl = f"ALTER TABLE runs ADD COLUMN {name} {column.type.compile(dialect=engine.dialect)}"
        try:
            with engine.begin() as con:
                con.execute(text(ddl))
        except SQLAlchemyError:
            if name not in _run_columns(engine):  # not a concurrent upgrade by another process
                raise
    _admit_interrupted(engine)
    _stamp(engine)


def _admit_interrupted(engine: Engine) -> None:
    """Widen the CHECK on `runs.status` of a version 1 or 2 database to admit 'interrupted'.

    SQLite cannot alter a constraint; its documented way for a change that leaves every stored
    row valid is to edit the table's SQL in `sqlite_schema` and bump the schema version
    (https://www.sqlite.org/lang_altertable.html, "making other kinds of table schema changes").
    """
    version = stored_version(engine)
    if version is None or version >= 3:
        return
    if engine.dialect.name == "sqlite":
        with engine.begin() as con:
            sql = con.scalar(text("SELECT sql FROM sqlite_master WHERE name = 'runs'"))
            wider = sql.replace("'failed')", "'failed', 'interrupted')", 1)
            if "'interrupted'" in sql or wider == sql:
                return  # done by another process meanwhile, or not the constraint fpbench made
            schema_version = con.scalar(text("PRAGMA schema_version"))
            con.exec_driver_sql("PRAGMA writable_schema = ON")
            try:
                update_sql = (
                    "UPDATE sqlite_master SET sql = :sql WHERE type = 'table' AND name = 'runs'"
                )
                con.execute(text(update_sql), {"sql": wider})
                con.exec_driver_sql(f"PRAGMA schema_version = {int(schema_version) + 1}")
            finally:
                con.exec_driver_sql("PRAGMA writable_schema = OFF")
        return
    with engine.begin() as con:
        con.execute(text("ALTER TABLE runs DROP CONSTRAINT IF EXISTS ck_runs_status"))
        con.execute(text(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK ({STATUS_CHECK})"))


def database_id(engine: Engine) -> str:
    """The database's identity; one is stamped first if it has none (an older fpbench's)."""
    with engine.connect() as con:
        found = con.scalar(select(Meta.value).where(Meta.key == DATABASE_ID_KEY))
    if found is not None:
        return found
    try:
        with engine.begin() as con:
            con.execute(insert(Meta).values(key=DATABASE_ID_KEY, value=uuid.uuid4().hex))
    except IntegrityError:
        pass  # another process stamped it first: theirs is the identity
    with engine.connect() as con:
        return con.scalar(select(Meta.value).where(Meta.key == DATABASE_ID_KEY))


def _create_missing_tables(engine: Engine, attempts: int = 3) -> None:
    """create_all, retried: several workers may upgrade one database at once."""
    if {t.name for t in Base.metadata.sorted_tables} <= set(inspect(engine).get_table_names()):
        return
    for attempt in range(attempts):
        try:
            Base.metadata.create_all(engine)
            return
        except (IntegrityError, DBAPIError):
            if attempt == attempts - 1:
                raise


def _stamp(engine: Engine) -> None:
    """Write SCHEMA_VERSION into `meta` (several workers may do so at once)."""
    with engine.connect() as con:
        current = con.scalar(select(Meta.value).where(Meta.key == VERSION_KEY))
    if current == str(SCHEMA_VERSION):
        return
    row = {"key": VERSION_KEY, "value": str(SCHEMA_VERSION)}
    try:
        with engine.begin() as con:
            stmt = update(Meta).where(Meta.key == VERSION_KEY).values(value=row["value"])
            if con.execute(stmt).rowcount == 0:
                con.execute(insert(Meta).values(**row))
    except IntegrityError:
        pass  # another process inserted the same row first


def _run_columns(engine: Engine) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns("runs")}
