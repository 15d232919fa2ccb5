"""How fpbench connects to a SQLite file: the pragmas and transaction mode of every connection,
for the store and for a database being created (`fpbench.store.ownership`), and read-only
connections for the commands that only read (a database in a read-only folder included)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.pool import StaticPool


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions begin in _sqlite_on_begin
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=30000")  # several processes may share one file
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _sqlite_on_begin(conn: Any) -> None:
    # take the write lock up front: a deferred transaction that reads, then writes after another
    # process wrote fails at once with "database is locked" instead of waiting for busy_timeout
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def configure_sqlite(engine: Engine) -> Engine:
    """WAL mode, a busy timeout, foreign keys and write-locking transactions on every connection."""
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def read_only_uri(path: Path) -> str:
    """A URI that opens `path` without writing a byte (`mode=ro`). In a folder this process
    cannot write to (an archive, a shared mount) SQLite could not make the WAL's `-shm` file, so
    a database left without a `-wal` (every closed one) is opened `immutable` instead."""
    uri = f"{path.absolute().as_uri()}?mode=ro"
    if not folder_writable(path.absolute().parent) and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    return uri


def folder_writable(folder: Path) -> bool:
    """Whether a file can be made in `folder` (tried, not guessed from permission bits: a
    read-only mount refuses even root)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _read_only_on_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout=30000")
    finally:
        cursor.close()


def read_only_engine(path: Path) -> Engine:
    """An engine reading the SQLite file `path` read-only (`read_only_uri`); any write fails."""
    uri = read_only_uri(path)
    engine = create_engine(
        "sqlite://", creator=lambda: sqlite3.connect(uri, uri=True, check_same_thread=False)
    )
    event.listen(engine, "connect", _read_only_on_connect)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


def in_memory_copy(path: Path) -> Engine:
    """A private in-memory copy of the SQLite file `path` (read read-only), for reading an older
    database the current schema needs upgraded without writing to the original."""
    source = sqlite3.connect(read_only_uri(path), uri=True)
    copy = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        source.backup(copy)
    finally:
        source.close()
    engine = create_engine("sqlite://", creator=lambda: copy, poolclass=StaticPool)
    event.listen(engine, "connect", _read_only_on_connect)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine
