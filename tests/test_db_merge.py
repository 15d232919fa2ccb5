"""`fpbench db merge`: per-cell databases folded into one database, idempotently."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.rounds import Observer
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from tests.conftest import tiny_config

runner = CliRunner()
RUN_FIELDS = ["run_key", "status", "method", "seed", "wall_s", "error", "finished_at"]


class _Stop(Exception):
    pass


class _StopAfterFirstRound(Observer):
    def round_end(self, cfg, round_idx, metrics):
        raise _Stop()


def _results(db: Path) -> pd.DataFrame:
    store = Store(f"sqlite:///{db}")
    keys = store.runs().set_index("id")["run_key"]
    m = store.metrics(aggregate_only=False)
    m.insert(0, "run_key", m["run_id"].map(keys))
    order = ["run_key", "round", "client_id", "name"]
    return m.drop(columns="run_id").sort_values(order, na_position="first").reset_index(drop=True)


def _runs(db: Path) -> pd.DataFrame:
    runs = Store(f"sqlite:///{db}").runs()
    return runs[RUN_FIELDS + ["last_round"]].sort_values("run_key").reset_index(drop=True)


def _counts(db: Path) -> tuple[int, ...]:
    with sqlite3.connect(db) as con:
        tables = ("runs", "rounds", "metrics")
        return tuple(con.execute(f"select count(*) from {t}").fetchone()[0] for t in tables)


@pytest.fixture(scope="module")
def cells(tmp_path_factory) -> dict[str, Path]:
    """Per-cell databases: head-tune done, fedvpt done, and fedvpt stopped after round 0."""
    folder = tmp_path_factory.mktemp("cells")
    dbs = {name: folder / f"{name}.db" for name in ("head", "vpt", "vpt-partial")}
    for name, method in [("head", "head-tune"), ("vpt", "fedvpt")]:
        store = Store(f"sqlite:///{dbs[name]}")
        cfg = tiny_config(method, rounds=2)
        assert run_cell(cfg, store, checkpoint_dir=folder).status == "done"
    partial = Store(f"sqlite:///{dbs['vpt-partial']}")
    with pytest.raises(_Stop):
        run_cell(
            tiny_config("fedvpt", rounds=2),
            partial,
            checkpoint_dir=folder / "partial",
            observer=_StopAfterFirstRound(),
        )
    return dbs


def merge(out: Path, *inputs: Path):
    return runner.invoke(app, ["db", "merge", str(out), *map(str, inputs)])


def test_merge_folds_cells_into_one_database_and_again_changes_nothing(tmp_path, cells):
    out = tmp_path / "all.db"
    first = merge(out, cells["head"], cells["vpt"])
    assert first.exit_code == 0, first.output
    assert "2 added, 0 replaced, 0 unchanged" in first.output
    expected = pd.concat([_results(cells["head"]), _results(cells["vpt"])])
    order = ["run_key", "round", "client_id", "name"]
    expected = expected.sort_values(order, na_position="first").reset_index(drop=True)
    pd.testing.assert_frame_equal(_results(out), expected)
    both = pd.concat([_runs(cells["head"]), _runs(cells["vpt"])])
    pd.testing.assert_frame_equal(_runs(out), both.sort_values("run_key").reset_index(drop=True))
    counts = _counts(out)
    again = merge(out, cells["vpt"], cells["head"], cells["vpt"])
    assert again.exit_code == 0 and "0 added, 0 replaced, 3 unchanged" in again.output
    assert _counts(out) == counts


def test_a_more_complete_copy_replaces_a_partial_one_never_the_reverse(tmp_path, cells):
    out = tmp_path / "m.db"
    assert merge(out, cells["vpt-partial"]).exit_code == 0
    assert _runs(out)["status"].tolist() == ["failed"] and _runs(out)["last_round"][0] == 0
    replaced = merge(out, cells["vpt"])
    assert "0 added, 1 replaced, 0 unchanged" in replaced.output
    kept = merge(out, cells["vpt-partial"])
    assert "0 added, 0 replaced, 1 unchanged" in kept.output
    pd.testing.assert_frame_equal(_results(out), _results(cells["vpt"]))
    pd.testing.assert_frame_equal(_runs(out), _runs(cells["vpt"]))


def test_bad_inputs_exit_2_and_write_nothing(tmp_path, cells):
    out = tmp_path / "never.db"
    missing = merge(out, cells["head"], tmp_path / "nope.db")
    assert missing.exit_code == 2 and "no results database at" in missing.output
    assert "Traceback" not in missing.output and not out.exists()
    itself = merge(cells["head"], cells["head"])
    assert itself.exit_code == 2 and "into itself" in itself.output
    usage = runner.invoke(app, ["db", "merge", str(out)])
    assert usage.exit_code == 2 and not out.exists()


def test_db_check_passes_complete_runs_and_names_each_problem(tmp_path, cells):
    out = tmp_path / "c.db"
    assert merge(out, cells["head"], cells["vpt"]).exit_code == 0
    ok = runner.invoke(app, ["db", "check", str(out)])
    assert ok.exit_code == 0 and "2 runs, no problems" in ok.output
    with sqlite3.connect(out) as con:  # lose round 1 of one done run, and its metrics
        run_id = con.execute("select min(id) from runs").fetchone()[0]
        con.execute("delete from metrics where run_id = ? and round = 1", (run_id,))
        con.execute("delete from rounds where run_id = ? and round = 1", (run_id,))
        stuck = "update runs set status = 'running', heartbeat_at = NULL where id != ?"
        con.execute(stuck, (run_id,))
    bad = runner.invoke(app, ["db", "check", str(out)])
    assert bad.exit_code == 1, bad.output
    assert "done but rounds 2 are missing" in bad.output  # rounds numbered from 1
    assert "the final round 2 has no evaluation metrics" in bad.output
    assert "stale: running, but it never sent a heartbeat" in bad.output
    partial = runner.invoke(app, ["db", "check", str(cells["vpt-partial"])])
    assert partial.exit_code == 1 and "failed: _Stop" in partial.output
    missing = runner.invoke(app, ["db", "check", str(tmp_path / "none.db")])
    assert missing.exit_code == 2 and not (tmp_path / "none.db").exists()
