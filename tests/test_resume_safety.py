"""Never store a wrong result: checkpoints bound to their database, rounds without gaps."""

from __future__ import annotations

import datetime as dt
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine import rounds
from fpbench.engine.rounds import Observer
from fpbench.engine.runner import run_cell
from fpbench.errors import FpbenchError
from fpbench.report.html import build_report
from fpbench.report.tables import finished_only, seeds_note, summary_table, unfinished_note
from fpbench.store import Store
from fpbench.suites import load_suite
from tests.conftest import TINY_SUITE_TOML, tiny_config

ROUNDS = 3


class _Stop(Exception):
    pass


class _StopAfter(Observer):
    """Stops the cell once round `k` is stored and checkpointed."""

    def __init__(self, k: int) -> None:
        self.k = k

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.k:
            raise _Stop


def _store(path: Path) -> Store:
    return Store(f"sqlite:///{path}")


def rows(db: Path) -> list[tuple]:
    """Every stored metric and round scalar of every run, keyed by run key, never by id."""
    with sqlite3.connect(db) as con:
        metrics = con.execute(
            "select run_key, round, coalesce(client_id, -1), name, value, count from metrics "
            "join runs on runs.id = metrics.run_id order by 1, 2, 3, 4"
        ).fetchall()
        scalars = con.execute(
            "select run_key, round, loss_train, bytes_up, bytes_down from rounds "
            "join runs on runs.id = rounds.run_id order by 1, 2"
        ).fetchall()
    return metrics + scalars


def _rounds(db: Path) -> list[int]:
    with sqlite3.connect(db) as con:
        return [r[0] for r in con.execute("select round from rounds order by 1")]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The cell run once, uninterrupted."""
    folder = tmp_path_factory.mktemp("whole")
    with _store(folder / "whole.db") as store:
        cfg = tiny_config(rounds=ROUNDS)
        assert run_cell(cfg, store, checkpoint_dir=folder / "ck").status == "done"
    return folder / "whole.db"


def _stopped(db: Path, ck: Path, k: int = 1) -> None:
    with _store(db) as store, pytest.raises(_Stop):
        run_cell(tiny_config(rounds=ROUNDS), store, checkpoint_dir=ck, observer=_StopAfter(k))


def test_a_checkpoint_never_crosses_databases(tmp_path, whole):
    """The issue's case: a stopped into a.db, then the same cell into b.db from the same folder."""
    ck = tmp_path / "ck"
    _stopped(tmp_path / "a.db", ck)
    with _store(tmp_path / "b.db") as b:
        assert run_cell(tiny_config(rounds=ROUNDS), b, checkpoint_dir=ck).status == "done"
    assert _rounds(tmp_path / "b.db") == [0, 1, 2]  # all rounds: not resumed from a's round 1
    assert rows(tmp_path / "b.db") == rows(whole)
    with _store(tmp_path / "a.db") as a:  # a resumes from its own checkpoint
        assert run_cell(tiny_config(rounds=ROUNDS), a, checkpoint_dir=ck).status == "done"
    assert rows(tmp_path / "a.db") == rows(whole)


def test_checkpoints_live_under_their_databases_identity(tmp_path):
    ck = tmp_path / "ck"
    _stopped(tmp_path / "a.db", ck)
    with _store(tmp_path / "a.db") as a:
        identity = a.database_id
        run_id = a.find_run(tiny_config(rounds=ROUNDS).run_key).id
    assert len(identity) == 32 and int(identity, 16) >= 0
    path = ckpt_io.checkpoint_path(ck / identity, tiny_config(rounds=ROUNDS).run_key)
    assert [p.relative_to(ck) for p in ck.rglob("*.pt")] == [path.relative_to(ck)]
    assert ckpt_io.saved_round(path) == (1, f"{identity}:{run_id}")
    with _store(tmp_path / "a.db") as again:  # the identity is stored: it survives reopening
        assert again.database_id == identity


def test_a_resume_refuses_a_checkpoint_ahead_of_the_database(tmp_path):
    db, ck = tmp_path / "a.db", tmp_path / "ck"
    _stopped(db, ck)
    with sqlite3.connect(db) as con:  # the database lost round 0 (restored from a backup, say)
        con.execute("delete from metrics where round = 0")
        con.execute("delete from rounds where round = 0")
    with _store(db) as store, pytest.raises(FpbenchError) as info:
        run_cell(tiny_config(rounds=ROUNDS), store, checkpoint_dir=ck)
    message = str(info.value)
    assert message.startswith("cannot resume cell fedvpt / synthetic / ")
    assert "is at round 1 but the database lacks rounds 0; delete the checkpoint" in message
    assert _rounds(db) == [1]  # nothing written


def test_a_checkpoint_of_an_earlier_run_of_the_key_is_ignored(tmp_path, whole, caplog):
    """The run's row deleted and the cell run again: the old run's checkpoint is not its own."""
    db, ck = tmp_path / "a.db", tmp_path / "ck"
    _stopped(db, ck)
    with sqlite3.connect(db) as con:  # the run's rows deleted, its id taken by another run
        con.execute("delete from metrics")
        con.execute("delete from rounds")
        con.execute("update runs set run_key = 'another'")
    with _store(db) as store:
        assert run_cell(tiny_config(rounds=ROUNDS), store, checkpoint_dir=ck).status == "done"
    assert rows(db) == rows(whole)
    assert "was written for" in caplog.text and "the run restarts" in caplog.text


def test_db_check_finds_gaps_and_merge_refuses_them(tmp_path):
    db, ck = tmp_path / "a.db", tmp_path / "ck"
    _stopped(db, ck)
    with sqlite3.connect(db) as con:
        con.execute("delete from metrics where round = 0")
        con.execute("delete from rounds where round = 0")
    runner = CliRunner()
    check = runner.invoke(app, ["db", "check", str(db)])
    assert check.exit_code == 1
    assert "rounds 1 are missing below stored round 2" in " ".join(check.output.split())
    before = db.read_bytes()
    out = tmp_path / "out.db"
    merged = runner.invoke(app, ["db", "merge", str(out), str(db)])
    assert merged.exit_code == 2, merged.output
    said = " ".join(merged.output.split())  # the error wrapped to the width
    assert "rounds 1 are missing below stored round 2; nothing merged" in said
    assert not out.exists() and db.read_bytes() == before


# -- interruptions: Ctrl-C, a dead process ------------------------------------------------------


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "data"))
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    return tmp_path


def _ctrl_c_in_round(monkeypatch, k: int) -> None:
    play = rounds.play_round

    def play_round(cell, server, r, *args, **kwargs):
        if r == k:
            raise KeyboardInterrupt
        return play(cell, server, r, *args, **kwargs)

    monkeypatch.setattr(rounds, "play_round", play_round)


def test_ctrl_c_says_where_stores_interrupted_and_exits_130_then_a_rerun_resumes(
    workdir, monkeypatch
):
    run = ("run", "--suite", "tiny.toml", "--method", "fedvpt", "--checkpoint-dir", "ck")
    code, _, stderr = _cli(*run, "--db", "whole.db")
    assert code == 0, stderr
    with monkeypatch.context() as patched:
        _ctrl_c_in_round(patched, 1)
        code, _, stderr = _cli(*run, "--db", "x.db")
    assert code == 130, stderr
    key = load_suite("tiny.toml").cells[1].run_key
    said = (
        f"interrupted after round 1/2 of cell fedvpt / synthetic / pathological / seed 0 ({key}); "
        "rerun the same command to resume"
    )
    assert [line for line in stderr.splitlines() if line.strip()][-1] == said, stderr
    assert "Traceback" not in stderr
    with _store(workdir / "x.db") as store:
        record = store.find_run(key)
    assert (record.status, record.error, record.traceback) == (
        "interrupted",
        "interrupted after round 1/2 (Ctrl-C)",
        None,
    )
    assert _rounds(workdir / "x.db") == [0]
    code, stdout, _ = _cli(*run, "--db", "x.db", "--dry-run")
    assert (
        re.search(r"  interrupted  ", stdout)  # the status whole, never cut
        and "interrupted: stopped by Ctrl-C or SIGTERM" in stdout
    )
    check = CliRunner().invoke(app, ["db", "check", "x.db"])
    assert (
        check.exit_code == 1
        and "interrupted after round 1/2 (Ctrl-C); rerun the suite" in check.output
    )
    code, stdout, stderr = _cli(*run, "--db", "x.db")
    assert code == 0, stderr
    assert rows(workdir / "x.db") == rows(workdir / "whole.db")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_whose_process_died_shows_as_stale_and_is_taken_over(workdir):
    """What kill -9 leaves: a 'running' run with a fresh heartbeat whose process is gone."""
    code, _, stderr = _cli("run", "--suite", "tiny.toml", "--method", "fedvpt", "--db", "x.db")
    assert code == 0, stderr
    dead = f"{socket.gethostname()}:{_dead_pid()}:deadbeef"
    with sqlite3.connect(workdir / "x.db") as con:
        con.execute("delete from metrics where round = 1")
        con.execute("delete from rounds where round = 1")
        con.execute(
            "update runs set status = 'running', owner = ?, heartbeat_at = ?",
            (dead, dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)),
        )
    check = CliRunner().invoke(app, ["db", "check", "x.db"])
    assert check.exit_code == 1
    assert f"stale: running, but its process ({dead}) is gone" in check.output
    _, stdout, _ = _cli("run", "--suite", "tiny.toml", "--db", "x.db", "--dry-run")
    assert re.search(r"  stale  ", stdout) and "stale: running, but its process is gone" in stdout
    # every view says stale, as `db check` does, never `running` for a dead process
    views = {
        "runs": ["runs", "--db", "x.db"],
        "show": ["show", "1", "--db", "x.db"],
        "table": ["table", "--suite", "tiny.toml", "--db", "x.db"],
    }
    said = {name: _cli(*args) for name, args in views.items()}
    assert said["runs"][0] == said["show"][0] == 0, said  # table: nothing finished to show
    assert " stale " in said["runs"][1] and " running " not in said["runs"][1]
    assert "status=stale" in said["show"][1]
    assert f"stale: running, but its process ({dead}) is gone" in said["show"][1]
    assert "(stale, stored up to round 1)" in " ".join(said["table"][2].split())
    from fpbench.report import html

    with _store(workdir / "x.db") as store:
        header = html._header(store.runs(suite="tiny"), "tiny", dt.datetime.now())
    assert "1 stale" in header and "running" not in header
    assert _cli("runs", "--status", "stale", "--db", "x.db")[1].count(" stale ") == 1
    code, stdout, stderr = _cli("run", "--suite", "tiny.toml", "--method", "fedvpt", "--db", "x.db")
    assert code == 0 and "1 cell ran, 0 already done" in stdout, stdout + stderr
    assert _rounds(workdir / "x.db") == [0, 1]


def test_a_version_2_database_is_upgraded_to_admit_interrupted(tmp_path):
    db = tmp_path / "v2.db"
    with _store(db) as store:
        fields = dict(suite="s", method="m", dataset="d", partition="p", seed=0)
        versions = dict(fpbench_version="0", torch_version="0", device="cpu")
        store.create_run(run_key="k" * 16, config={}, **fields, **versions)
    con = sqlite3.connect(db)  # what version 2 made: the narrower CHECK
    version = con.execute("pragma schema_version").fetchone()[0]
    con.execute("pragma writable_schema = on")
    con.execute(
        "update sqlite_master set sql = replace(sql, ', ''interrupted''', '') where name = 'runs'"
    )
    con.execute(f"pragma schema_version = {version + 1}")
    con.execute("update meta set value = '2' where key = 'schema_version'")
    con.commit()
    con.close()
    con = sqlite3.connect(db)
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        con.execute("update runs set status = 'interrupted'")
    con.close()
    with _store(db) as store:
        assert store.claim_run(1, "me")
        assert store.finish_run(1, "me", "interrupted", error="interrupted at round 0 (Ctrl-C)")
        assert store.find_run("k" * 16).status == "interrupted"
        assert store.claim_run(1, "another")  # an interrupted run is resumed by the next driver
    with sqlite3.connect(db) as con:
        assert con.execute("pragma integrity_check").fetchall() == [("ok",)]
        assert con.execute("select value from meta where key = 'schema_version'").fetchone() == (
            "3",
        )
        with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
            con.execute("update runs set status = 'bogus'")


# -- tables: unfinished runs left out, saying so; how many seeds a cell averages ---------------


def _frames() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Runs 1-3 of fedvpt (seeds 0-2) and run 4 of sgpt (seed 0); run 3 stopped at round 1."""
    runs = pd.DataFrame(
        {
            "id": [1, 2, 3, 4, 5],
            "method": ["fedvpt", "fedvpt", "fedvpt", "sgpt", "sgpt"],
            "dataset": ["syn"] * 5,
            "partition": ["dir"] * 5,
            "seed": [0, 1, 2, 0, 1],
            "status": ["done", "done", "interrupted", "done", "pending"],
            "last_round": pd.array([9, 9, 1, 9, None], dtype="Int64"),
        }
    )
    metrics = pd.DataFrame(
        {
            "run_id": [1, 2, 3, 4],
            "method": ["fedvpt", "fedvpt", "fedvpt", "sgpt"],
            "dataset": ["syn"] * 4,
            "partition": ["dir"] * 4,
            "seed": [0, 1, 2, 0],
            "round": [9, 9, 1, 9],
            "client_id": pd.array([None] * 4, dtype="Int64"),
            "name": ["acc_global"] * 4,
            "value": [0.5, 0.7, 0.1, 0.8],
            "count": pd.array([None] * 4, dtype="Int64"),
        }
    )
    return metrics, runs


def test_unfinished_runs_are_left_out_of_tables_saying_so():
    metrics, runs = _frames()
    kept, left_out = finished_only(metrics, runs)
    assert kept["run_id"].tolist() == [1, 2, 4] and left_out["id"].tolist() == [3]
    table = summary_table(kept, ["acc_global"])
    assert table.loc["fedvpt"].tolist() == ["60.00 ± 14.14"]  # seeds 0 and 1, not seed 2's 10%
    assert unfinished_note(left_out) == (
        "left out 1 unfinished run: fedvpt / syn / dir / seed 2 (interrupted, stored up to round 2)"
    )
    assert unfinished_note(left_out.iloc[:0]) is None
    assert seeds_note(kept, ["acc_global"]) == (
        "each cell: mean ± std over 2 seeds, except sgpt / syn / dir (acc_global): 1"
    )
    assert seeds_note(kept[kept["method"] == "fedvpt"], ["acc_global"]) == (
        "each cell: mean ± std over 2 seeds"
    )


def test_table_of_a_suite_with_an_interrupted_seed_shows_the_finished_ones(workdir, monkeypatch):
    suite = TINY_SUITE_TOML.replace("seeds = [0]", "seeds = [0, 1]")
    (workdir / "tiny.toml").write_text(suite)
    run = ("run", "--suite", "tiny.toml", "--method", "fedvpt")
    assert _cli(*run, "--seed", "0", "--db", "x.db")[0] == 0
    assert _cli(*run, "--seed", "0", "--db", "seed0.db")[0] == 0
    with monkeypatch.context() as patched:
        _ctrl_c_in_round(patched, 1)
        assert _cli(*run, "--seed", "1", "--db", "x.db")[0] == 130
    code, stdout, stderr = _cli("table", "--suite", "tiny.toml", "--db", "x.db")
    assert code == 0, stderr
    assert stdout == _cli("table", "--suite", "tiny.toml", "--db", "seed0.db")[1]
    assert stderr.splitlines() == [
        "all columns: synthetic / pathological; global = acc_global; local mean = "
        "acc_local_mean; local worst = acc_local_worst (%)",
        "each cell: mean ± std over 1 seed",
        "left out 1 unfinished run: fedvpt / synthetic / pathological / seed 1 (interrupted, "
        "stored up to round 1)",
    ]
    with _store(workdir / "x.db") as store:
        page = build_report(store.metrics(suite="tiny"), store.runs(suite="tiny"), "tiny").html
    assert "left out 1 unfinished run: fedvpt / synthetic / pathological / seed 1" in page
    assert "each cell: mean ± std over 1 seed" in page


def test_sigterm_is_stored_as_interrupted_exits_143_and_a_rerun_resumes(workdir, monkeypatch):
    """What SLURM's time limit, scancel, `timeout` and `docker stop` send, handled as Ctrl-C."""
    import os
    import signal

    run = ("run", "--suite", "tiny.toml", "--method", "fedvpt", "--checkpoint-dir", "ck")
    assert _cli(*run, "--db", "whole.db")[0] == 0
    play = rounds.play_round

    def play_round(cell, server, r, *args, **kwargs):
        if r == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return play(cell, server, r, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(rounds, "play_round", play_round)
        code, _, stderr = _cli(*run, "--db", "x.db")
    assert code == 143, stderr
    key = load_suite("tiny.toml").cells[1].run_key
    assert [line for line in stderr.splitlines() if line.strip()][-1] == (
        f"SIGTERM: interrupted after round 1/2 of cell fedvpt / synthetic / pathological / "
        f"seed 0 ({key}); rerun the same command to resume"
    )
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    with _store(workdir / "x.db") as store:
        record = store.find_run(key)
    assert (record.status, record.error) == ("interrupted", "interrupted after round 1/2 (SIGTERM)")
    assert _rounds(workdir / "x.db") == [0]
    assert _cli(*run, "--db", "x.db")[0] == 0
    assert rows(workdir / "x.db") == rows(workdir / "whole.db")
