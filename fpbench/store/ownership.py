"""Whose database is this? fpbench writes only databases it created, and creates them late.

`probe` looks at a database without writing a byte (a SQLite file through a read-only
connection, since even fpbench's WAL pragma rewrites a file's header) and says whether it holds
fpbench's schema, nothing yet, or something else, which is refused. `create` makes a new
database's schema in one step, just before its first row is written: a new SQLite file is built
beside its final name and linked into place, so no other process ever sees it half made, and any
file found at that name, even an empty one, is someone else's.
"""

from __future__ import annotations

import os
import sqlite3
import tempfile
import uuid
from enum import Enum
from pathlib import Path

from sqlalchemy import Engine, create_engine, insert, inspect, text
from sqlalchemy.exc import DBAPIError, IntegrityError

from fpbench.errors import FpbenchError
from fpbench.store.models import Base, Meta, Metric, Round, Run
from fpbench.store.schema import ADDED_COLUMNS, DATABASE_ID_KEY, SCHEMA_VERSION, VERSION_KEY
from fpbench.store.sqlite import configure_sqlite, read_only_uri

# what every fpbench database has had since version 1
REQUIRED = {
    Run.__tablename__: {c.name for c in Run.__table__.columns} - set(ADDED_COLUMNS),
    Round.__tablename__: {c.name for c in Round.__table__.columns},
    Metric.__tablename__: {c.name for c in Metric.__table__.columns},
}
ADVICE = "fpbench writes only databases it created: name another --db (a new file) or delete it"


class State(Enum):
    ABSENT = "absent"  # no database yet (a missing SQLite file, an empty server database)
    FPBENCH = "fpbench"  # fpbench's schema, of any version


def sqlite_path(engine: Engine) -> Path | None:
    """The file of a file-backed SQLite engine, else None (other backends, in-memory)."""
    url = engine.url
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def probe(engine: Engine) -> State:
    """The database's state, read without writing anything.

    Raises:
        FpbenchError: it is not fpbench's (other tables, an empty existing file).
        sqlite3.DatabaseError: the file is no SQLite database at all.
    """
    path = sqlite_path(engine)
    if path is not None:
        if not path.exists():
            _check_creatable(path)
            return State.ABSENT
        tables, version_stamped = _sqlite_tables(path)
        if not tables:
            raise FpbenchError(f"{path} is an existing file without fpbench's tables; {ADVICE}")
    else:
        tables, version_stamped = _tables(engine)
        if not tables:
            return State.ABSENT
    missing = {t: cols - tables.get(t, set()) for t, cols in REQUIRED.items()}
    if version_stamped or not any(missing.values()):
        return State.FPBENCH
    lacking = ", ".join(
        f"{t} ({', '.join(sorted(cols))})" if t in tables else t
        for t, cols in missing.items()
        if cols
    )
    listed = ", ".join(sorted(tables)[:6]) + (", ..." if len(tables) > 6 else "")
    raise FpbenchError(
        f"{path or 'the database'} is not an fpbench results database (its tables: {listed}; "
        f"it lacks {lacking}); {ADVICE}"
    )


def _check_creatable(path: Path) -> None:
    """Fail now, not at the first write, where the file could never be made; leaves nothing.

    Raises:
        OSError: the nearest existing folder above `path` is a file, or no file can be made in it.
    """
    place = path.absolute().parent
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        raise NotADirectoryError(f"{place} is a file, not a folder")
    with tempfile.TemporaryFile(dir=place):  # unnamed where the OS allows, removed on close
        pass


def _sqlite_tables(path: Path) -> tuple[dict[str, set[str]], bool]:
    con = sqlite3.connect(read_only_uri(path), uri=True)
    try:
        names = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        tables = {n: {r[1] for r in con.execute(f'PRAGMA table_info("{n}")')} for n in names}
        stamped = _stamped(tables) and bool(
            con.execute("SELECT 1 FROM meta WHERE key = ?", (VERSION_KEY,)).fetchone()
        )
    finally:
        con.close()
    return tables, stamped


def _tables(engine: Engine) -> tuple[dict[str, set[str]], bool]:
    found = inspect(engine)
    tables = {n: {c["name"] for c in found.get_columns(n)} for n in found.get_table_names()}
    if not _stamped(tables):
        return tables, False
    with engine.connect() as con:
        row = con.execute(text("SELECT 1 FROM meta WHERE key = :k"), {"k": VERSION_KEY}).first()
    return tables, row is not None


def _stamped(tables: dict[str, set[str]]) -> bool:
    return "runs" in tables and {"key", "value"} <= tables.get("meta", set())


def create(engine: Engine) -> None:
    """Create fpbench's schema in a database `probe` found ABSENT (or another process just made).

    Raises:
        FpbenchError: someone else's database appeared at that place meanwhile.
    """
    path = sqlite_path(engine)
    if path is None:
        _create_in_place(engine)
    elif not path.exists():
        _create_file(engine, path)
    if probe(engine) is not State.FPBENCH:  # made by another process meanwhile: theirs?
        raise FpbenchError(f"could not create the results database {path or engine.url}")


def _schema(con) -> None:
    """Tables and the meta stamp, inside the caller's transaction."""
    Base.metadata.create_all(con)
    con.execute(
        insert(Meta),
        [
            {"key": VERSION_KEY, "value": str(SCHEMA_VERSION)},
            {"key": DATABASE_ID_KEY, "value": uuid.uuid4().hex},
        ],
    )


def _create_in_place(engine: Engine, attempts: int = 3) -> None:
    for attempt in range(attempts):
        try:
            with engine.begin() as con:
                if "runs" in inspect(con).get_table_names():
                    return  # another process created it first
                _schema(con)
            return
        except (IntegrityError, DBAPIError):  # several workers creating at once
            if attempt == attempts - 1:
                raise


def _remove_abandoned(path: Path) -> None:
    """Delete what a process killed while creating `path` left beside it (its pid is gone)."""
    for leftover in path.parent.glob(f".{path.name}.*.creating*"):
        pid = leftover.name[len(path.name) + 2 :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and Path("/proc/self").exists():
            leftover.unlink(missing_ok=True)


def _create_file(engine: Engine, path: Path) -> None:
    """Build the new file beside `path`, then link it into place unless one appeared there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.creating")
    try:
        building = configure_sqlite(create_engine(f"sqlite:///{tmp}"))
        try:
            with building.begin() as con:
                _schema(con)
        finally:
            building.dispose()  # the last connection closes: the WAL is folded into the file
        try:
            os.link(tmp, path)  # never replaces: a file that appeared meanwhile wins
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links
            if not path.exists():
                os.replace(tmp, path)
    finally:
        for leftover in (tmp, Path(f"{tmp}-wal"), Path(f"{tmp}-shm")):
            leftover.unlink(missing_ok=True)
