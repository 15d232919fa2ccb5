"""Tests for the results database facade (fpbench.store)."""

from __future__ import annotations

import datetime as dt
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text

from fpbench.errors import FpbenchError
from fpbench.store import RunRecord, Store
from fpbench.store.repo import METRIC_COLUMNS

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
