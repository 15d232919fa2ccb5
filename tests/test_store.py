"""Tests for the results database facade (fpbench.store)."""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import sqlite3
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine, func, inspect, select, text, update
from sqlalchemy.exc import OperationalError, StatementError

from fpbench.errors import FpbenchError
from fpbench.store import (
    ClaimLost,
    RunRecord,
    Store,
    claim_is_live,
    claims,
    models,
    new_owner,
    ownership,
    repo,
    schema,
)
from fpbench.store.models import Run
from fpbench.store.repo import METRIC_COLUMNS, ROUND_COLUMNS, RUN_COLUMNS

VERSIONS = {"fpbench_version": "0.1.0", "torch_version": "2.3.0", "device": "cpu"}


def make_run(store: Store, run_key: str = "abcd1234ef", **labels: object) -> RunRecord:
    fields = {
        "suite": "label-het",
        "method": "sgpt",
        "dataset": "cifar100",
        "partition": "dir-0.1",
        "seed": 0,
        "config": {"lr": 0.1, "rounds": 3, "nested": {"k": [1, 2]}},
        **VERSIONS,
    }
    fields.update(labels)
    return store.create_run(run_key=run_key, **fields)


def write(store: Store, run_id: int, rnd: int, acc: float = 0.5, **kw: object) -> None:
    metrics = kw.pop(
        "metrics",
        [
            (None, "acc_global", acc, None),
            (0, "acc_local", acc - 0.1, 20),
            (1, "acc_local", acc, 30),
        ],
    )
    store.write_round(
        run_id, rnd, loss_train=1.0 / rnd, wall_s=2.0, bytes_up=100, bytes_down=200, metrics=metrics
    )


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "nested" / "dir" / "results.db"  # parents do not exist yet


@pytest.fixture
def store(db_path: Path) -> Store:
    with Store(Store.url_from_path_or_url(str(db_path))) as s:
        yield s


def raw(db_path: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(sql).fetchall()


def test_url_from_path_or_url() -> None:
    assert Store.url_from_path_or_url("results/x.db") == "sqlite:///results/x.db"
    assert Store.url_from_path_or_url("/abs/x.db") == "sqlite:////abs/x.db"
    assert Store.url_from_path_or_url(Path("a/b.db")) == "sqlite:///a/b.db"
    pg = "postgresql+psycopg://user@host/db"
    assert Store.url_from_path_or_url(pg) == pg


def test_creates_parent_folder_tables_and_wal_with_the_first_run(
    store: Store, db_path: Path
) -> None:
    assert store.find_run("abcd1234ef") is None and store.runs().empty and store.metrics().empty
    assert not db_path.parent.parent.exists()  # opening and reading create nothing
    make_run(store)
    assert db_path.exists()
    assert sorted(p.name for p in db_path.parent.iterdir()) == [
        "results.db",
        "results.db-shm",
        "results.db-wal",
    ]  # no temporary file left
    tables = {r[0] for r in raw(db_path, "SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"runs", "rounds", "metrics"} <= tables
    assert raw(db_path, "PRAGMA journal_mode") == [("wal",)]
    with store._engine.connect() as conn:
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_create_and_find_run(store: Store) -> None:
    assert store.find_run("abcd1234ef") is None
    before = dt.datetime.now(dt.timezone.utc)
    run = make_run(store)
    assert run.status == "pending" and run.finished_at is None and run.error is None
    assert run.config == {"lr": 0.1, "rounds": 3, "nested": {"k": [1, 2]}}
    found = store.find_run("abcd1234ef")
    assert found == run
    assert found.created_at.tzinfo is not None
    assert before <= found.created_at <= dt.datetime.now(dt.timezone.utc)
    assert (found.method, found.seed, found.device) == ("sgpt", 0, "cpu")


def test_run_key_is_unique(store: Store) -> None:
    make_run(store)
    with pytest.raises(FpbenchError, match="already exists"):
        make_run(store, seed=1)
    assert len(store.runs()) == 1


def test_write_round_is_idempotent(store: Store, db_path: Path) -> None:
    run = make_run(store)
    write(store, run.id, 1, acc=0.5)
    write(store, run.id, 1, acc=0.5)
    assert raw(db_path, "SELECT COUNT(*) FROM rounds") == [(1,)]
    assert raw(db_path, "SELECT COUNT(*) FROM metrics WHERE client_id IS NULL") == [(1,)]
    assert raw(db_path, "SELECT COUNT(*) FROM metrics WHERE client_id IS NOT NULL") == [(2,)]
    # A rewrite replaces the round as a whole: new values, dropped rows are gone.
    write(store, run.id, 1, metrics=[(None, "acc_global", 0.7, None)])
    df = store.metrics(aggregate_only=False)
    assert len(df) == 1 and df["client_id"].isna().all()
    assert (df["name"].iloc[0], df["value"].iloc[0]) == ("acc_global", 0.7)


def test_aggregate_rows_unique_in_the_database(store: Store, db_path: Path) -> None:
    run = make_run(store)
    write(store, run.id, 1)
    dup = f"INSERT INTO metrics (run_id, round, client_id, name, value) VALUES ({run.id}, 1, NULL, 'acc_global', 0.1)"  # noqa: E501
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        raw(db_path, dup)
    per_client = dup.replace("NULL", "0").replace("acc_global", "acc_local")
    with pytest.raises(sqlite3.IntegrityError, match="UNIQUE"):
        raw(db_path, per_client)


def test_write_round_rejects_duplicates_nan_and_unknown_run(store: Store) -> None:
    run = make_run(store)
    twice = [(None, "acc_global", 0.5, None), (None, "acc_global", 0.6, None)]
    with pytest.raises(ValueError, match="given twice"):
        write(store, run.id, 1, metrics=twice)
    with pytest.raises(ValueError, match="NaN"):
        write(store, run.id, 1, metrics=[(None, "acc_global", float("nan"), None)])
    with pytest.raises(FpbenchError, match="no run with id 42"):
        write(store, 42, 1)
    assert store.last_round(run.id) is None  # failed writes left nothing behind
    store.write_round(
        run.id, 1, loss_train=float("nan"), wall_s=1, bytes_up=0, bytes_down=0, metrics=[]
    )
    assert store.rounds(run.id)["loss_train"].isna().all()


def test_truncate_after_and_last_round(store: Store) -> None:
    run, other = make_run(store), make_run(store, run_key="ffff0000")
    for rnd in range(1, 6):
        write(store, run.id, rnd)
    write(store, other.id, 7)
    assert store.last_round(run.id) == 5
    store.truncate_after(run.id, 3)
    assert store.last_round(run.id) == 3
    assert store.rounds(run.id)["round"].tolist() == [1, 2, 3]
    assert sorted(set(store.metrics(run_ids=[run.id], aggregate_only=False)["round"])) == [1, 2, 3]
    assert store.last_round(other.id) == 7  # other runs untouched


def test_rounds_frame(store: Store) -> None:
    run = make_run(store)
    write(store, run.id, 2)
    write(store, run.id, 1)
    df = store.rounds(run.id)
    assert list(df.columns) == ["run_id", "round", "loss_train", "wall_s", "bytes_up", "bytes_down"]
    assert df["round"].tolist() == [1, 2]
    assert df["loss_train"].tolist() == [1.0, 0.5]
    assert df["bytes_down"].tolist() == [200, 200]


def test_metrics_filters_and_columns(store: Store) -> None:
    a = make_run(store)
    b = make_run(store, run_key="beef0001", method="fedavg", seed=1)
    c = make_run(store, run_key="cafe0002", suite="other")
    for run in (a, b, c):
        write(store, run.id, 1, acc=0.5 + run.id / 10)
    df = store.metrics()
    assert list(df.columns) == METRIC_COLUMNS
    assert len(df) == 3 and df["client_id"].isna().all()
    assert df.set_index("run_id")["value"].to_dict() == pytest.approx({1: 0.6, 2: 0.7, 3: 0.8})
    assert df.loc[df["run_id"] == b.id, ["method", "seed"]].values.tolist() == [["fedavg", 1]]
    assert set(store.metrics(suite="label-het")["run_id"]) == {a.id, b.id}
    assert set(store.metrics(run_ids=[c.id])["run_id"]) == {c.id}
    assert store.metrics(run_ids=[]).empty
    every = store.metrics(aggregate_only=False, run_ids=[a.id])
    assert sorted(every["name"]) == ["acc_global", "acc_local", "acc_local"]
    clients = every.dropna(subset=["client_id"])
    assert clients[["client_id", "count"]].values.tolist() == [[0, 20], [1, 30]]
    only = store.metrics(names=["acc_local"], aggregate_only=False)
    assert set(only["name"]) == {"acc_local"} and len(only) == 6
    assert list(store.metrics(suite="nope").columns) == METRIC_COLUMNS


def test_runs_frame(store: Store) -> None:
    assert store.runs().empty and "run_key" in store.runs().columns
    a = make_run(store)
    make_run(store, run_key="beef0001", suite="other")
    write(store, a.id, 4)
    df = store.runs()
    assert df["run_key"].tolist() == ["abcd1234ef", "beef0001"]
    assert "config_json" not in df.columns and "config" not in df.columns
    assert df["last_round"].tolist()[0] == 4 and df["last_round"].isna().tolist() == [False, True]
    assert store.runs(suite="other")["run_key"].tolist() == ["beef0001"]


def test_get_run_by_id_and_prefix(store: Store) -> None:
    a = make_run(store, run_key="abcd1234ef")
    b = make_run(store, run_key="abcd9999ef")
    digits = make_run(store, run_key="98765abc")
    assert store.get_run(str(a.id)) == a
    assert store.get_run(b.id) == b
    assert store.get_run("abcd12") == a
    assert store.get_run("9876") == digits  # not an id: tried as a key prefix
    with pytest.raises(FpbenchError, match="ambiguous"):
        store.get_run("abcd")
    with pytest.raises(FpbenchError, match="no run with id or key prefix 'zzzz'"):
        store.get_run("zzzz")
    with pytest.raises(FpbenchError, match="at least 4 characters"):
        store.get_run("abc")
    with pytest.raises(FpbenchError, match="no run"):
        store.get_run("77")
    with pytest.raises(FpbenchError, match="no run with id or key prefix 'ab%d'"):
        store.get_run("ab%d")  # LIKE wildcards are matched literally


@pytest.mark.parametrize(
    "url",
    [
        "not a url",
        "nosuchdialect://host/db",
        "sqlite:///{tmp}/afile/x.db",
        "sqlite:///{tmp}/junk.db",
    ],
)
def test_open_failures_raise_fpbench_error(tmp_path: Path, url: str) -> None:
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "junk.db").write_bytes(b"this is not a database" * 200)
    url = url.format(tmp=tmp_path)
    with pytest.raises(FpbenchError) as info:
        Store(url)
    message = str(info.value)
    assert message.startswith(f"cannot open results database {url}: ")
    assert "\n" not in message and len(message) > len(url) + 32


def test_password_is_hidden_in_errors() -> None:
    with pytest.raises(FpbenchError) as info:
        Store("nosuchdialect://user:s3cret@host/db")
    assert "s3cret" not in str(info.value)


def test_data_survive_reopening(db_path: Path) -> None:
    url = Store.url_from_path_or_url(str(db_path))
    with Store(url) as s:
        run = make_run(s)
        write(s, run.id, 1)
    with Store(url) as s:
        assert s.find_run(run.run_key) == run
        assert s.last_round(run.id) == 1


# -- claims: who runs a cell, and when a claim is taken over ------------------------------------


def _exited_child() -> int:
    """The pid of a child that has exited and is not reaped yet (a zombie); reap it after."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while not claims._is_zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.001)
    return pid


def _set_claim(store: Store, run_id: int, **values: object) -> None:
    with store._session.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(**values))


def test_new_owner_names_host_pid_and_slurm_job(monkeypatch) -> None:
    for name in (
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)
    host, pid, rand = new_owner().split(":")
    assert (host, pid) == (socket.gethostname(), str(os.getpid()))
    assert len(rand) == 8 and int(rand, 16) >= 0 and new_owner() != new_owner()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert new_owner().endswith(":job=77") and new_owner().count(":") == 3
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "5")
    assert new_owner().endswith(":job=5_")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert new_owner().endswith(":job=5_3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")  # requeued twice
    assert new_owner().endswith(":job=5_3:restart=2")


def test_owner_is_gone_only_for_a_dead_process_of_this_host_or_this_slurm_job(monkeypatch) -> None:
    for name in (
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "SLURM_JOB_ID",
        "SLURM_RESTART_COUNT",
    ):
        monkeypatch.delenv(name, raising=False)
    host = socket.gethostname()
    assert not claims.owner_is_gone(None) and not claims.owner_is_gone("")
    assert not claims.owner_is_gone(f"{host}:{os.getpid()}:abcd")  # alive
    assert not claims.owner_is_gone(f"{host}:x{os.getpid()}:abcd")  # no pid
    zombie = _exited_child()
    try:
        assert claims._is_zombie(zombie)
        assert claims.owner_is_gone(f"{host}:{zombie}:abcd")  # killed, not reaped yet
        assert not claims.owner_is_gone(f"other-{host}:{zombie}:abcd")  # not this host's
    finally:
        os.waitpid(zombie, 0)
    assert claims.owner_is_gone(f"{host}:{zombie}:abcd")  # reaped: no such process
    assert claims.owner_is_gone(f"{host}:{zombie}:abcd:job=12")  # of a SLURM job, not this one
    assert not claims._is_zombie(os.getpid()) and not claims._is_zombie(zombie)
    other_job = f"elsewhere:{os.getpid()}:abcd:job=9"
    assert not claims.owner_is_gone(other_job)
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    assert not claims.owner_is_gone(other_job)  # this job's own incarnation, on another host
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert claims.owner_is_gone(other_job)  # this job was requeued: its earlier run is gone
    assert not claims.owner_is_gone(f"elsewhere:{os.getpid()}:abcd:job=91")


def test_claim_is_live_and_stale_reason(monkeypatch) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    monkeypatch.setattr(claims, "_now", lambda: now)
    me = f"{socket.gethostname()}:{os.getpid()}:abcd"

    def rec(status: str, age_s: float | None, owner: str = me) -> SimpleNamespace:
        beat = None if age_s is None else now - dt.timedelta(seconds=age_s)
        return SimpleNamespace(status=status, heartbeat_at=beat, owner=owner)

    assert claim_is_live(rec("running", 5))
    assert claim_is_live(rec("running", 595))
    assert not claim_is_live(rec("running", 605))
    assert claim_is_live(rec("running", 50), timeout_s=60)
    assert not claim_is_live(rec("running", 70), timeout_s=60)
    assert not claim_is_live(rec("running", None))
    assert not claim_is_live(rec("done", 5)) and not claim_is_live(rec("pending", 5))
    assert not claim_is_live(rec("running", 5, owner=f"{socket.gethostname()}:{2**22 + 7}:ab"))

    def why(status: str, owner: str | None, age_s: float | None, timeout: float = 60):
        return claims.stale_reason(status, owner, rec(status, age_s).heartbeat_at, timeout)

    assert why("running", me, 5) is None and why("done", None, None) is None
    assert why("running", me, None) == "it never sent a heartbeat"
    assert why("running", me, 100) == "its last heartbeat was 100 s ago"
    assert why("running", me, 100, timeout=200) is None
    assert why("running", me, 60, timeout=60) is None  # as old as the timeout: still fresh
    assert claim_is_live(rec("running", 60), timeout_s=60)
    gone = f"{socket.gethostname()}:{2**22 + 7}:ab"
    assert why("running", gone, 5) == f"its process ({gone}) is gone"


def test_claims_are_exclusive_until_stale_or_the_owner_is_gone(store: Store) -> None:
    assert not store.claim_run(1, "a")  # no database yet
    run = make_run(store)
    assert store.claim_run(run.id, "a")
    rec = store.find_run(run.run_key)
    assert (rec.status, rec.owner, rec.finished_at) == ("running", "a", None)
    assert rec.heartbeat_at is not None
    assert not store.claim_run(run.id, "b")  # held, fresh heartbeat
    assert store.claim_run(run.id, "a")  # its owner re-claims it
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=100)
    _set_claim(store, run.id, heartbeat_at=old)
    assert not store.claim_run(run.id, "b", timeout_s=200)
    assert store.claim_run(run.id, "b", timeout_s=50)  # stale: taken over
    assert store.find_run(run.run_key).owner == "b"
    _set_claim(store, run.id, heartbeat_at=None)
    assert store.claim_run(run.id, "c")  # no heartbeat at all
    dead = f"{socket.gethostname()}:{2**22 + 7}:ab"
    _set_claim(store, run.id, owner=dead)  # fresh heartbeat, dead process
    assert store.claim_run(run.id, "d")
    assert store.find_run(run.run_key).owner == "d"
    assert not store.claim_run(run.id + 1, "d")  # no such run
    for status in ("failed", "interrupted", "pending"):
        _set_claim(store, run.id, status=status, owner="x", error="boom", traceback="tb")
        assert store.claim_run(run.id, "e")
        rec = store.find_run(run.run_key)
        assert (rec.status, rec.owner, rec.error, rec.traceback) == ("running", "e", None, None)
    _set_claim(store, run.id, status="done", owner="e")
    assert not store.claim_run(run.id, "e") and store.find_run(run.run_key).status == "done"


def test_heartbeat_finish_and_writes_need_the_claim(store: Store) -> None:
    assert not store.heartbeat(1, "a") and not store.finish_run(1, "a", "done")
    run = make_run(store)
    assert store.claim_run(run.id, "a")
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=100)
    _set_claim(store, run.id, heartbeat_at=old)
    assert not store.heartbeat(run.id, "b")
    assert store.find_run(run.run_key).heartbeat_at == old
    assert store.heartbeat(run.id, "a")
    assert store.find_run(run.run_key).heartbeat_at > old + dt.timedelta(seconds=99)
    store.write_round(run.id, 0, loss_train=1.0, wall_s=1.0, bytes_up=1, bytes_down=2,
                      metrics=[], owner="a")  # fmt: skip
    with pytest.raises(ClaimLost, match=f"run {run.id}: claim of b was taken over"):
        store.write_round(run.id, 1, loss_train=1.0, wall_s=1.0, bytes_up=1, bytes_down=2,
                          metrics=[], owner="b")  # fmt: skip
    with pytest.raises(ClaimLost):
        store.record_cost(run.id, peak_mem_bytes=5, owner="b")
    assert store.round_numbers(run.id) == [0]
    assert not store.finish_run(run.id, "b", "done")
    assert store.finish_run(run.id, "a", "failed", error="boom", wall_s=3, traceback="tb")
    rec = store.find_run(run.run_key)
    assert (rec.status, rec.error, rec.traceback, rec.wall_s) == ("failed", "boom", "tb", 3.0)
    assert rec.finished_at is not None and rec.owner == "a"
    assert not store.finish_run(run.id, "a", "done")  # no longer running
    assert not store.heartbeat(run.id, "a")
    assert store.claim_run(run.id, "a")
    assert store.find_run(run.run_key).finished_at is None  # a retry is not finished
    assert store.finish_run(run.id, "a", "done")
    rec = store.find_run(run.run_key)
    assert (rec.status, rec.error, rec.traceback, rec.wall_s) == ("done", None, None, 3.0)


def test_keep_alive_beats_until_the_block_ends(store: Store) -> None:
    run = make_run(store)
    assert store.claim_run(run.id, "a")
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=100)
    _set_claim(store, run.id, heartbeat_at=old)
    with store.keep_alive(run.id, "a", interval_s=0.01):
        deadline = time.monotonic() + 10
        while store.find_run(run.run_key).heartbeat_at == old and time.monotonic() < deadline:
            time.sleep(0.01)
    assert store.find_run(run.run_key).heartbeat_at > old
    assert not any(t.name.startswith("fpbench-heartbeat") for t in threading.enumerate())
    _set_claim(store, run.id, heartbeat_at=old)
    with store.keep_alive(run.id, "a", interval_s=60):
        pass  # ends at once, without waiting for the interval
    assert store.find_run(run.run_key).heartbeat_at == old


def test_ensure_run_returns_the_run_another_driver_created(store: Store) -> None:
    first = make_run(store)
    fields = {
        "suite": "x", "method": "x", "dataset": "x", "partition": "x", "seed": 3,
        "config": {}, **VERSIONS,
    }  # fmt: skip
    assert store.ensure_run(run_key=first.run_key, **fields) == first
    made = store.ensure_run(run_key="beef0001", **fields)
    assert (made.run_key, made.seed, made.status) == ("beef0001", 3, "pending")
    with pytest.raises(TypeError):
        store.ensure_run(run_key="beef0002", nonsense=1, **fields)


def test_record_cost_keeps_the_peak_and_the_first_flops(store: Store) -> None:
    run = make_run(store)
    store.record_cost(run.id)
    assert (
        store.find_run(run.run_key).peak_mem_bytes,
        store.find_run(run.run_key).round_flops,
    ) == (
        None,
        None,
    )
    store.record_cost(run.id, peak_mem_bytes=0)
    assert store.find_run(run.run_key).peak_mem_bytes == 0
    store.record_cost(run.id, peak_mem_bytes=500, round_flops=7)
    store.record_cost(run.id, peak_mem_bytes=300, round_flops=9)
    rec = store.find_run(run.run_key)
    assert (rec.peak_mem_bytes, rec.round_flops) == (500, 7)
    store.record_cost(run.id, peak_mem_bytes=800)
    assert store.find_run(run.run_key).peak_mem_bytes == 800
    with pytest.raises(FpbenchError, match="no run with id 99"):
        store.record_cost(99, peak_mem_bytes=1)


# -- schema versions and upgrades ----------------------------------------------------------------


def _downgrade(db_path: Path, version: int) -> None:
    """Make an fpbench database look as version 1 or 2 made it."""
    con = sqlite3.connect(db_path)
    try:
        for column in schema.ADDED_COLUMNS:
            if version == 1 or column in ("peak_mem_bytes", "round_flops"):
                con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
        if version == 1:
            con.execute("DROP TABLE meta")
        else:
            con.execute(f"UPDATE meta SET value = '{version}' WHERE key = 'schema_version'")
        current = con.execute("PRAGMA schema_version").fetchone()[0]
        con.execute("PRAGMA writable_schema = ON")
        narrow = "UPDATE sqlite_master SET sql = replace(sql, ', ''interrupted''', '') WHERE name = 'runs'"  # noqa: E501
        con.execute(narrow)
        con.execute(f"PRAGMA schema_version = {current + 1}")
        con.commit()
    finally:
        con.close()


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_database_is_upgraded_in_place(db_path: Path, version: int) -> None:
    url = Store.url_from_path_or_url(db_path)
    with Store(url) as s:
        run = make_run(s)
        write(s, run.id, 1)
        identity = s.database_id if version == 2 else None
    _downgrade(db_path, version)
    engine = create_engine(url)
    try:
        assert schema.stored_version(engine) == version
    finally:
        engine.dispose()
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        raw(db_path, "UPDATE runs SET status = 'interrupted'")
    with Store(url) as s:
        rec = s.find_run(run.run_key)
        assert (rec.id, rec.owner, rec.peak_mem_bytes, rec.status) == (
            run.id,
            None,
            None,
            "pending",
        )
        assert s.claim_run(run.id, "me") and s.finish_run(run.id, "me", "interrupted")
        s.record_cost(run.id, peak_mem_bytes=10, round_flops=20)
        rec = s.find_run(run.run_key)
        assert (rec.status, rec.owner, rec.peak_mem_bytes, rec.round_flops) == (
            "interrupted", "me", 10, 20,
        )  # fmt: skip
        ident = s.database_id
        assert len(ident) == 32 and int(ident, 16) >= 0
        assert identity is None or ident == identity  # version 2 already had one
        assert s.last_round(run.id) == 1
    assert raw(db_path, "SELECT value FROM meta WHERE key = 'schema_version'") == [("3",)]
    assert raw(db_path, "PRAGMA integrity_check") == [("ok",)]
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        raw(db_path, "UPDATE runs SET status = 'bogus'")
    with Store(url) as s:
        assert s.database_id == ident  # stamped once
    sql = raw(db_path, "SELECT sql FROM sqlite_master WHERE name = 'runs'")[0][0]
    assert sql.count("'interrupted'") == 1


def test_stored_version_and_a_newer_database_is_refused(db_path: Path) -> None:
    url = Store.url_from_path_or_url(db_path)
    db_path.parent.mkdir(parents=True)
    empty = create_engine("sqlite://")
    assert schema.stored_version(empty) is None
    schema.check_version(empty)  # nothing stored: nothing refused
    empty.dispose()
    with Store(url) as s:
        make_run(s)
    engine = create_engine(url)
    try:
        assert schema.stored_version(engine) == schema.SCHEMA_VERSION == 3
        for value, expected in [("2", 2), ("4", 4)]:
            raw(db_path, f"UPDATE meta SET value = '{value}' WHERE key = 'schema_version'")
            assert schema.stored_version(engine) == expected
        with pytest.raises(FpbenchError) as info:
            Store(url)
        assert str(info.value) == (
            f"results database {url}: schema version 4 is newer than this fpbench's (3); "
            "upgrade fpbench (pip install -U fpbench) to use it"
        )
        raw(db_path, "UPDATE meta SET value = 'x1' WHERE key = 'schema_version'")
        with pytest.raises(FpbenchError, match="unreadable schema version 'x1' in its meta table"):
            schema.stored_version(engine)
        raw(db_path, "DELETE FROM meta WHERE key = 'schema_version'")
        assert schema.stored_version(engine) == 1
        raw(db_path, "UPDATE meta SET value = 'x' WHERE key = 'database_id'")
        with Store(url) as s:  # upgraded: stamped again, its identity kept
            assert s.database_id == "x"
        assert schema.stored_version(engine) == 3
        raw(db_path, "DELETE FROM meta WHERE key = 'database_id'")
        with Store(url) as s:  # an older fpbench's database gets an identity once
            ident = s.database_id
            assert len(ident) == 32 and s.database_id == ident
        assert raw(db_path, "SELECT value FROM meta WHERE key = 'database_id'") == [(ident,)]
    finally:
        engine.dispose()


# -- whose database: refused, absent, created late ----------------------------------------------


def test_sqlite_path_of_each_kind_of_url() -> None:
    def path(url: str) -> Path | None:
        engine = create_engine(url)
        try:
            return ownership.sqlite_path(engine)
        finally:
            engine.dispose()

    assert path("sqlite:///a/b.db") == Path("a/b.db")
    assert path("sqlite:///~/b.db") == Path.home() / "b.db"
    assert path("sqlite://") is None and path("sqlite:///:memory:") is None
    assert path("sqlite:///file:x.db?uri=true") is None


def test_foreign_databases_are_refused_naming_their_tables(tmp_path: Path) -> None:
    def refusal(name: str, *sql: str) -> str:
        db = tmp_path / name
        db.touch()
        with sqlite3.connect(db) as con:
            for statement in sql:
                con.execute(statement)
        before = db.read_bytes()
        with pytest.raises(FpbenchError) as info:
            Store(f"sqlite:///{db}")
        assert db.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == sorted(
            names
        )
        return str(info.value).split(": ", 1)[1]

    advice = ownership.ADVICE
    names = ["empty.db"]
    assert (
        refusal("empty.db")
        == f"{tmp_path / 'empty.db'} is an existing file without fpbench's tables; {advice}"
    )  # noqa: E501
    names.append("notes.db")
    assert refusal("notes.db", "CREATE TABLE notes (x)") == (
        f"{tmp_path / 'notes.db'} is not an fpbench results database (its tables: notes; "
        f"it lacks runs, rounds, metrics); {advice}"
    )
    names.append("many.db")
    many = [f"CREATE TABLE t{i} (x)" for i in range(7)] + ["CREATE TABLE rounds (run_id, round)"]
    assert refusal("many.db", *many) == (
        f"{tmp_path / 'many.db'} is not an fpbench results database (its tables: rounds, t0, t1, "
        "t2, t3, t4, ...; it lacks runs, rounds (bytes_down, bytes_up, loss_train, wall_s), "
        f"metrics); {advice}"
    )
    names.append("stamp.db")
    # an unstamped database with every table and column since version 1 is fpbench's (version 1)
    v1 = ownership.REQUIRED
    tables = [f"CREATE TABLE {t} ({', '.join(sorted(cols))})" for t, cols in v1.items()]
    db = tmp_path / "v1.db"
    with sqlite3.connect(db) as con:
        for statement in tables:
            con.execute(statement)
    assert ownership.probe(create_engine(f"sqlite:///{db}")) is ownership.State.FPBENCH
    names.append("v1.db")
    # a meta table with the version key makes a database fpbench's whatever else it lacks
    stamped = ["CREATE TABLE runs (id)", "CREATE TABLE meta (key, value)"]
    with sqlite3.connect(tmp_path / "stamp.db") as con:
        for statement in stamped:
            con.execute(statement)
        con.execute("INSERT INTO meta VALUES ('schema_version', '3')")
    assert ownership.probe(create_engine(f"sqlite:///{tmp_path / 'stamp.db'}")) is (
        ownership.State.FPBENCH
    )
    unstamped = tmp_path / "unstamped.db"
    with sqlite3.connect(unstamped) as con:
        for statement in stamped:
            con.execute(statement)
        con.execute("INSERT INTO meta VALUES ('other', '3')")
    with pytest.raises(FpbenchError, match=r"it lacks runs \(.*dataset.*\), rounds, metrics"):
        ownership.probe(create_engine(f"sqlite:///{unstamped}"))


def test_a_database_in_memory_or_on_a_server_is_probed_and_created_in_place() -> None:
    engine = create_engine("sqlite://")  # no file: as a server database is reached
    try:
        assert ownership.probe(engine) is ownership.State.ABSENT
        ownership.create(engine)
        assert ownership.probe(engine) is ownership.State.FPBENCH
        ownership.create(engine)  # made by another process first: nothing changes
        with engine.connect() as con:
            stamps = con.execute(text("SELECT key, value FROM meta ORDER BY key")).all()
        assert [k for k, _ in stamps] == ["database_id", "schema_version"]
        assert stamps[1][1] == "3"
    finally:
        engine.dispose()
    foreign = create_engine("sqlite://")
    try:
        with foreign.begin() as con:
            con.execute(text("CREATE TABLE notes (x)"))
        with pytest.raises(FpbenchError, match=r"^the database is not an fpbench results"):
            ownership.probe(foreign)
    finally:
        foreign.dispose()


def test_creating_a_file_removes_only_what_dead_creators_left(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    dead = 2**22 + 7
    left = [
        db_path.parent / f".results.db.{dead}-abcd1234.creating",
        db_path.parent / f".results.db.{dead}-abcd1234.creating-wal",
        db_path.parent / f".results.db.{os.getpid()}-abcd1234.creating",  # alive: in progress
        db_path.parent / f".other.db.{dead}-abcd1234.creating",  # another database's
        db_path.parent / f".results.db.x{dead}-abcd1234.creating",  # no pid
    ]
    for path in left:
        path.write_text("")
    with Store(Store.url_from_path_or_url(db_path)) as s:
        make_run(s)
        kept = sorted(p.name for p in db_path.parent.iterdir())
    assert kept == sorted(
        [p.name for p in left[2:]] + ["results.db", "results.db-shm", "results.db-wal"]
    )


def test_open_errors_name_the_driver_error_and_what_to_install(db_path: Path) -> None:
    wrapped = OperationalError("SELECT 1", {}, sqlite3.OperationalError("disk I/O error\nmore"))
    assert repo._reason(wrapped) == "disk I/O error"
    assert repo._reason(ValueError("  two\nlines ")) == "two"
    assert repo._reason(ValueError("")) == "ValueError"
    missing = ImportError("No module named 'psycopg2'")
    postgres = (
        "; install fpbench's PostgreSQL driver with pip install 'fpbench[postgres]' and "
        "name it in the URL: postgresql+psycopg://USER:PASSWORD@HOST/DB"
    )
    assert repo._driver_hint("postgresql://u@h/db", missing) == postgres
    assert repo._driver_hint("postgresql+psycopg2://u@h/db", missing) == postgres
    other = "; install the Python driver of mysql that this URL names"
    assert repo._driver_hint("mysql://u@h/db", missing) == other
    assert repo._driver_hint("mysql://u@h/db", ValueError("x")) == ""
    assert repo._driver_hint("not a url", missing) == ""
    url = Store.url_from_path_or_url(db_path)
    with Store(url) as s:
        assert repr(s) == f"Store({url!r})"
    with Store("sqlite://") as s:
        assert repr(s) == "Store('sqlite://')"


def test_every_connection_waits_for_locks_and_takes_the_write_lock_up_front(
    store: Store, db_path: Path
) -> None:
    make_run(store)
    with store._engine.connect() as conn:
        pragmas = [
            conn.exec_driver_sql(f"PRAGMA {p}").scalar() for p in ("busy_timeout", "synchronous")
        ]  # noqa: E501
    assert pragmas == [30000, 1]  # 30 s; 1 is NORMAL
    other = sqlite3.connect(db_path, timeout=0)
    try:
        with store._session.begin() as s:  # reads only, yet holds the write lock
            assert s.scalar(select(func.count()).select_from(Run)) == 1
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("UPDATE runs SET error = 'x'")
        other.execute("UPDATE runs SET error = 'x'")  # free again once it ends
        other.commit()
    finally:
        other.close()
    assert store.find_run("abcd1234ef").error == "x"


def test_datetimes_are_stored_as_utc_and_naive_ones_refused(store: Store) -> None:
    run = make_run(store)
    plus2 = dt.timezone(dt.timedelta(hours=2))
    beat = dt.datetime(2026, 1, 2, 12, 30, tzinfo=plus2)
    _set_claim(store, run.id, heartbeat_at=beat)
    got = store.find_run(run.run_key).heartbeat_at
    assert got == beat and got.tzinfo == dt.timezone.utc and got.hour == 10
    with store._engine.connect() as conn:  # stored naive, in UTC
        stored = conn.execute(text("SELECT heartbeat_at FROM runs")).scalar()
    assert str(stored).startswith("2026-01-02 10:30:00")
    with pytest.raises(StatementError, match="naive datetime"):
        _set_claim(store, run.id, heartbeat_at=dt.datetime(2026, 1, 2, 12, 30))
    _set_claim(store, run.id, heartbeat_at=None)
    assert store.find_run(run.run_key).heartbeat_at is None
    utc = models.UTCDateTime()
    aware = dt.datetime(2026, 1, 2, 12, 30, tzinfo=plus2)
    assert utc.process_result_value(aware, None) == aware  # a server that keeps the zone
    assert utc.process_result_value(aware, None).tzinfo == dt.timezone.utc
    assert utc.process_bind_param(None, None) is None


def _zombie_named(name: str) -> int:
    """A zombie child whose command name is `name` (it may hold ')' and spaces)."""
    pid = os.fork()
    if pid == 0:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
        os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().startswith(f"{pid} ({name}) Z "):
                break
        time.sleep(0.001)
    return pid


def test_a_zombie_is_found_whatever_its_name() -> None:
    pid = _zombie_named("x) y Q")
    try:
        with open(f"/proc/{pid}/stat") as f:
            assert f.read().startswith(f"{pid} (x) y Q) Z ")
        assert claims._is_zombie(pid)
        assert claims.owner_is_gone(f"{socket.gethostname()}:{pid}:ab")
    finally:
        os.waitpid(pid, 0)


@pytest.mark.parametrize("failures", [0, 2, 3])
def test_creating_a_schema_in_place_retries_twice(failures: int) -> None:
    """Several workers creating one database at once: a failed attempt is retried, twice."""
    calls = []

    def flaky(real):
        def attempt(*args, **kwargs):
            calls.append(1)
            if len(calls) <= failures:
                raise OperationalError("CREATE TABLE", {}, sqlite3.OperationalError("locked"))
            return real(*args, **kwargs)

        return attempt

    for module, name, target in [
        (ownership, "_schema", ownership),
        (schema.Base.metadata, "create_all", schema),
    ]:
        calls.clear()
        patch = pytest.MonkeyPatch()  # undone per target, leaving the test's fixtures alone
        patch.setattr(module, name, flaky(getattr(module, name)))
        engine = create_engine("sqlite://")
        try:
            make = (
                ownership._create_in_place if target is ownership else schema._create_missing_tables
            )
            if failures == 3:
                with pytest.raises(OperationalError, match="locked"):
                    make(engine)
            else:
                make(engine)
                assert {"runs", "meta"} <= set(inspect(engine).get_table_names())
            assert len(calls) == min(failures + 1, 3)
        finally:
            engine.dispose()
            patch.undo()


def test_a_server_database_is_fpbench_s_by_its_version_stamp() -> None:
    def probe(*sql: str) -> ownership.State:
        engine = create_engine("sqlite://")
        try:
            with engine.begin() as con:
                for statement in sql:
                    con.execute(text(statement))
            return ownership.probe(engine)
        finally:
            engine.dispose()

    stamped = ["CREATE TABLE runs (id)", "CREATE TABLE meta (key, value)"]
    version = "INSERT INTO meta VALUES ('schema_version', '3')"
    assert probe(*stamped, version) is ownership.State.FPBENCH
    with pytest.raises(FpbenchError, match=r"lacks runs \(.*\), rounds, metrics"):
        probe(*stamped, "INSERT INTO meta VALUES ('other', '3')")
    with pytest.raises(FpbenchError, match="lacks"):
        probe(*stamped)


def test_frames_of_nothing_keep_their_columns(store: Store) -> None:
    assert list(store.rounds(1).columns) == ROUND_COLUMNS  # no database yet
    assert str(store.runs()["last_round"].dtype) == "Int64"  # as when runs are stored
    assert store.round_numbers(1) == [] and store.last_round(1) is None
    with pytest.raises(FpbenchError, match="^no run '12': the database holds no runs yet$"):
        store.get_run(" 12 ")
    run = make_run(store)
    assert list(store.rounds(run.id).columns) == ROUND_COLUMNS and store.rounds(run.id).empty
    assert list(store.runs().columns) == [*RUN_COLUMNS, "last_round"]
    assert list(store.runs(suite="nope").columns) == [*RUN_COLUMNS, "last_round"]
    assert list(store.metrics().columns) == METRIC_COLUMNS


def test_get_run_errors_show_what_was_asked_and_up_to_five_keys(store: Store) -> None:
    for i in range(7):
        make_run(store, run_key=f"abcd{i}fff")
    with pytest.raises(FpbenchError) as info:
        store.get_run("abcd")
    keys = ", ".join(f"abcd{i}fff" for i in range(5))
    assert str(info.value) == f"run key prefix 'abcd' is ambiguous ({keys}, ...): give more"
    with pytest.raises(FpbenchError) as info:
        store.get_run("ab")
    assert str(info.value) == (
        "no run 'ab': give a run id or at least 4 characters of a run key (see `fpbench runs`)"
    )


def test_truncate_after_leaves_other_runs_metrics(store: Store) -> None:
    run, other = make_run(store), make_run(store, run_key="ffff0000")
    for rnd in (1, 2, 3):
        write(store, run.id, rnd)
        write(store, other.id, rnd)
    store.truncate_after(run.id, 1)
    rounds = store.metrics(aggregate_only=False).groupby("run_id")["round"].unique()
    assert [sorted(r) for r in rounds] == [[1], [1, 2, 3]]
    assert store.round_numbers(other.id) == [1, 2, 3]


def test_a_claim_exactly_as_old_as_the_timeout_still_holds(store: Store, monkeypatch) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    monkeypatch.setattr(claims, "_now", lambda: now)
    run = make_run(store)
    assert store.claim_run(run.id, "a")
    _set_claim(store, run.id, heartbeat_at=now - dt.timedelta(seconds=60))
    assert not store.claim_run(run.id, "b", timeout_s=60)
    assert store.claim_run(run.id, "b", timeout_s=59.999)


def test_taking_over_from_a_dead_owner_starts_a_fresh_heartbeat(store: Store, monkeypatch) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    monkeypatch.setattr(claims, "_now", lambda: now)
    run = make_run(store)
    dead = f"{socket.gethostname()}:{2**22 + 7}:ab"
    _set_claim(store, run.id, status="running", owner=dead, heartbeat_at=now)
    _set_claim(store, run.id, heartbeat_at=now - dt.timedelta(seconds=5))
    assert store.claim_run(run.id, "me")
    rec = store.find_run(run.run_key)
    assert (rec.owner, rec.status, rec.heartbeat_at) == ("me", "running", now)


def test_owner_is_gone_only_looks_and_trusts_what_it_may_not_signal(monkeypatch) -> None:
    host = socket.gethostname()
    pid = os.fork()
    if pid == 0:  # a live process that a real signal would end
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        time.sleep(60)
        os._exit(0)
    try:
        assert not claims.owner_is_gone(f"{host}:{pid}:ab")
        time.sleep(0.05)
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)  # still alive: it was only probed
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def forbidden(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", forbidden)  # another user's process
    assert not claims.owner_is_gone(f"{host}:{2**22 + 7}:ab")


def test_find_run_of_an_unknown_key_is_none(store: Store) -> None:
    make_run(store)
    assert store.find_run("nope") is None


def test_a_round_without_a_training_loss_stores_none(store: Store, db_path: Path) -> None:
    run = make_run(store)
    store.write_round(run.id, 0, loss_train=None, wall_s=1, bytes_up=0, bytes_down=0, metrics=[])
    store.write_round(run.id, 1, loss_train=0.25, wall_s=1, bytes_up=0, bytes_down=0, metrics=[])
    assert raw(db_path, "SELECT round, loss_train FROM rounds ORDER BY round") == [
        (0, None),
        (1, 0.25),
    ]


def test_sqlite_file_and_the_package_s_lazy_names() -> None:
    assert Store.sqlite_file("sqlite:///a/b.db") == Path("a/b.db")
    assert Store.sqlite_file("sqlite:////abs/b.db") == Path("/abs/b.db")
    assert Store.sqlite_file("postgresql://u@h/db") is None
    assert Store.sqlite_file("sqlite://") is None
    import fpbench.store as package

    assert package.Store is Store and package.CLAIM_TIMEOUT_S == 600.0
    with pytest.raises(AttributeError, match="^module 'fpbench.store' has no attribute 'nope'$"):
        package.nope  # noqa: B018


def test_a_run_s_config_is_stored_as_sorted_json(store: Store, db_path: Path) -> None:
    make_run(store)
    stored = raw(db_path, "SELECT config_json, status FROM runs")
    assert stored == [('{"lr": 0.1, "nested": {"k": [1, 2]}, "rounds": 3}', "pending")]


def test_an_upgrade_racing_another_process_for_a_column_is_no_error(db_path, monkeypatch) -> None:
    url = Store.url_from_path_or_url(db_path)
    with Store(url) as s:
        make_run(s)
    real = schema._run_columns
    calls = []

    def racing(engine):  # the first look misses `owner`, which another process then added
        calls.append(1)
        return real(engine) - ({"owner"} if len(calls) == 1 else set())

    monkeypatch.setattr(schema, "_run_columns", racing)
    engine = create_engine(url)
    try:
        schema.upgrade(engine)  # its ALTER TABLE fails: the column is there now
        monkeypatch.setattr(schema, "_run_columns", lambda e: real(e) - {"owner"})
        with pytest.raises(OperationalError, match="duplicate column"):
            schema.upgrade(engine)  # a column that cannot be added and is not there: an error
    finally:
        engine.dispose()


def test_a_file_system_without_hard_links_gets_the_new_file_moved_into_place(
    db_path: Path, monkeypatch
) -> None:
    def no_links(src, dst) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with Store(Store.url_from_path_or_url(db_path)) as s:
        make_run(s)
        assert s.find_run("abcd1234ef") is not None
    assert sorted(p.name for p in db_path.parent.iterdir()) == ["results.db"]


def test_a_database_made_meanwhile_by_another_process_is_checked_then_used(db_path: Path) -> None:
    url = Store.url_from_path_or_url(db_path)
    with Store(url) as late, Store(url) as early:
        make_run(early)  # creates it; `late` opened it while absent
        assert late.has_schema() and late.find_run("abcd1234ef") is not None
    (db_path.parent / "afile").write_text("x")
    with pytest.raises(FpbenchError) as info:
        Store(f"sqlite:///{db_path.parent}/afile/x.db")
    assert str(info.value).endswith(f"{db_path.parent / 'afile'} is a file, not a folder")


def test_create_says_so_when_no_database_appeared(db_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ownership, "_create_file", lambda engine, path: None)
    engine = create_engine(Store.url_from_path_or_url(db_path))
    try:
        with pytest.raises(
            FpbenchError, match=f"^could not create the results database {db_path}$"
        ):
            ownership.create(engine)
    finally:
        engine.dispose()


def test_a_foreign_database_s_tables_are_cut_after_six(tmp_path: Path) -> None:
    def listed(count: int) -> str:
        db = tmp_path / f"t{count}.db"
        with sqlite3.connect(db) as con:
            for i in range(count):
                con.execute(f"CREATE TABLE t{i} (x)")
        with pytest.raises(FpbenchError) as info:
            ownership.probe(create_engine(f"sqlite:///{db}"))
        return str(info.value).split("its tables: ")[1].split("; it lacks")[0]

    assert listed(6) == "t0, t1, t2, t3, t4, t5"
    assert listed(7) == "t0, t1, t2, t3, t4, t5, ..."


def test_the_probe_reads_a_file_through_a_read_only_uri_and_leaves_no_stray_file(
    db_path: Path, tmp_path: Path, monkeypatch
) -> None:
    with Store(Store.url_from_path_or_url(str(db_path))) as made:
        make_run(made)
    opened: list[tuple[str, dict]] = []
    connect = sqlite3.connect

    def spy(target: str, **kwargs):
        opened.append((target, kwargs))
        return connect(target, **kwargs)

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # a file name taken as a path would be made here
    monkeypatch.setattr(ownership.sqlite3, "connect", spy)
    before = db_path.read_bytes()
    engine = create_engine(f"sqlite:///{db_path}")
    try:
        assert ownership.probe(engine) is ownership.State.FPBENCH
    finally:
        engine.dispose()
    # without uri=True a SQLite built without SQLITE_USE_URI takes "file:...?mode=ro" as a name
    assert opened == [(f"{db_path.absolute().as_uri()}?mode=ro", {"uri": True})]
    assert list(cwd.iterdir()) == []  # beside the file only SQLite's own WAL companions
    assert {p.name for p in db_path.parent.iterdir()} <= {
        f"results.db{s}" for s in ("", "-wal", "-shm")
    }
    assert db_path.read_bytes() == before


def test_a_server_url_gets_an_engine_that_pings_before_reuse(monkeypatch) -> None:
    pytest.importorskip("psycopg")
    monkeypatch.setattr(repo, "probe", lambda engine: ownership.State.ABSENT)  # no server here
    store = Store("postgresql+psycopg://user@db.invalid/results")
    try:
        engine = store._engine
        assert engine.url.render_as_string() == "postgresql+psycopg://user@db.invalid/results"
        assert engine.pool._pre_ping is True
    finally:
        store._engine.dispose()
