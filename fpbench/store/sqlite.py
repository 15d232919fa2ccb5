"""How fpbench connects to a SQLite file: the pragmas and transaction mode of every connection,
for the store and for a database being created (`fpbench.store.ownership`)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event


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
