"""A database fpbench did not create is never written, and none is created before a first row."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from sqlalchemy import create_engine, inspect, text
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.store import Store
from tests.conftest import TINY_SUITE_TOML, error_messages


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _one_error_line(stderr: str, expected: str) -> None:
    """Nothing but one `error:` message, wrapped to the width (its later lines indented)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[0].startswith("error: ") and all(x.startswith("  ") for x in lines[1:]), stderr
    (message,) = error_messages(stderr)
    assert expected in message, stderr


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    return tmp_path


def _other_programs_runs(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT, started REAL)")
        con.execute("INSERT INTO runs (name, started) VALUES ('training job', 1.5)")
    con.close()


def _unrelated_tables(path: Path) -> None:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        con.execute("CREATE TABLE tags (note INTEGER, tag TEXT)")
        con.execute("INSERT INTO notes (body) VALUES ('keep me')")
    con.close()


def _empty_file(path: Path) -> None:
    path.write_bytes(b"")


FOREIGN = {
    "own-runs-table": (
        _other_programs_runs,
        "is not an fpbench results database (its tables: runs",
    ),
    "unrelated-tables": (
        _unrelated_tables,
        "is not an fpbench results database (its tables: notes",
    ),
    "empty-file": (_empty_file, "is an existing file without fpbench's tables"),
}


def _fpbench_db(path: Path) -> None:
    with Store(f"sqlite:///{path}") as store:
        fields = dict(suite="s", method="m", dataset="d", partition="p", seed=0)
        versions = dict(fpbench_version="0", torch_version="0", device="cpu")
        store.create_run(run_key="k" * 16, config={"train": {"rounds": 1}}, **fields, **versions)


@pytest.mark.parametrize("kind", list(FOREIGN))
def test_a_foreign_database_is_refused_by_every_command_and_left_unchanged(workdir, kind):
    make, expected = FOREIGN[kind]
    db = workdir / "other.db"
    make(db)
    before = db.read_bytes()
    _fpbench_db(workdir / "good.db")
    commands = [
        ["run", "--suite", "tiny.toml", "--db", str(db)],
        ["run", "--suite", "tiny.toml", "--db", str(db), "--dry-run"],
        ["show", "1", "--db", str(db)],
        ["table", "--suite", "tiny", "--db", str(db)],
        ["db", "check", str(db)],
        ["db", "merge", "merged.db", str(db)],  # as an input
        ["db", "merge", str(db), "good.db"],  # as the output
    ]
    for args in commands:
        code, _, stderr = _cli(*args)
        assert code == 2, (args, stderr)
        _one_error_line(stderr, expected)
        assert "fpbench writes only databases it created" in error_messages(stderr)[0]
        assert db.read_bytes() == before, args  # byte for byte
        assert sorted(p.name for p in workdir.glob("other.db*")) == ["other.db"], args
    assert not (workdir / "merged.db").exists()
    assert not list(workdir.rglob("*.pt"))


def test_opening_a_missing_database_creates_nothing_until_its_first_row(tmp_path):
    path = tmp_path / "new" / "x.db"
    with Store(f"sqlite:///{path}") as store:
        assert store.find_run("k" * 16) is None and store.runs().empty
        assert not path.parent.exists()
    _fpbench_db(path)
    assert path.is_file() and not list(path.parent.glob(".*creating*"))
    with Store(f"sqlite:///{path}") as store:
        assert len(store.runs()) == 1 and len(store.database_id) == 32


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_a_gpu_leaves_no_database_behind(workdir):
    code, _, stderr = _cli(
        "run", "--suite", "tiny.toml", "--db", "results/x.db", "--device", "cuda"
    )
    assert code == 2, stderr
    assert "cuda" in stderr.lower()
    assert not (workdir / "results").exists()


def test_a_corrupt_dataset_leaves_no_database_behind(workdir):
    raw = workdir / "data" / "cifar-10-batches-py"
    raw.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (raw / name).write_bytes(b"\x80\x04not a pickle at all")
    lines = TINY_SUITE_TOML.replace('"synthetic"', '"cifar10"').splitlines()
    suite = "\n".join(line for line in lines if not line.startswith("dataset = {"))
    suite = suite.replace("num_clients = 4", "num_clients = 10")
    (workdir / "cifar.toml").write_text(suite)
    code, _, stderr = _cli("run", "--suite", "cifar.toml", "--db", "results/x.db")
    assert code == 2, stderr
    _one_error_line(stderr, "data_batch_1")
    assert not (workdir / "results").exists()


def test_a_postgres_database_of_another_program_is_refused_and_an_empty_one_created_late(pg_url):
    engine = create_engine(pg_url)
    with Store(pg_url) as store:  # empty: nothing is created by opening or reading it
        assert store.find_run("k" * 16) is None
    assert inspect(engine).get_table_names() == []
    with engine.begin() as con:
        con.execute(text("CREATE TABLE runs (id serial PRIMARY KEY, name text)"))
    with pytest.raises(FpbenchError, match="is not an fpbench results database"):
        Store(pg_url)
    assert inspect(engine).get_table_names() == ["runs"]
    with engine.begin() as con:
        con.execute(text("DROP TABLE runs"))
    engine.dispose()
    with Store(pg_url) as store:
        fields = dict(suite="s", method="m", dataset="d", partition="p", seed=0)
        versions = dict(fpbench_version="0", torch_version="0", device="cpu")
        store.create_run(run_key="k" * 16, config={}, **fields, **versions)
        assert len(store.database_id) == 32
