"""`fpbench db merge`: per-cell databases folded into one database, idempotently."""

from __future__ import annotations

import datetime as dt
import os
import socket
import sqlite3
from pathlib import Path

import pandas as pd
import pytest
from sqlalchemy import update
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.rounds import Observer
from fpbench.engine.runner import run_cell
from fpbench.errors import FpbenchError
from fpbench.store import Store, claims
from fpbench.store.check import Problem, broken_runs, check
from fpbench.store.merge import merge_into
from fpbench.store.models import Run
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


# -- the store functions behind the commands, on hand-made databases ---------------------------


def _store_with(tmp_path: Path, name: str = "h.db") -> Store:
    return Store(f"sqlite:///{tmp_path / name}")


def _run(store: Store, key: str, rounds: int, status: str, **values) -> int:
    labels = dict(suite="s", method="m", dataset="d", partition="p", seed=0)
    versions = dict(fpbench_version="0", torch_version="0", device="cpu")
    cfg = {"train": {"rounds": rounds}}
    run_id = store.create_run(run_key=key, config=cfg, **labels, **versions).id
    with store._session.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status=status, **values))
    return run_id


def _round(store: Store, run_id: int, rnd: int, *, loss: bool = True, acc: bool = False,
           client_acc: bool = False) -> None:  # fmt: skip
    metrics = [(None, "loss_train", 0.5, None)] if loss else []
    metrics += [(None, "acc_global", 0.25, None)] if acc else []
    metrics += [(0, "acc_local", 0.25, 4)] if client_acc else []
    store.write_round(run_id, rnd, loss_train=0.5, wall_s=1, bytes_up=1, bytes_down=1,
                      metrics=metrics)  # fmt: skip


def test_check_names_each_problem_of_each_run_in_order(tmp_path, monkeypatch):
    now = dt.datetime.now(dt.timezone.utc)
    monkeypatch.setattr(claims, "_now", lambda: now)
    store = _store_with(tmp_path)
    assert check(store) == [] and broken_runs(store) == []  # no database yet
    fine = _run(store, "fine0000", 3, "done")
    for rnd in range(3):
        _round(store, fine, rnd, acc=rnd == 2)
    holes = _run(store, "hole0000", 3, "done")
    _round(store, holes, 0)
    _round(store, holes, 3, loss=False, acc=True)
    lastless = _run(store, "last0000", 2, "done")
    _round(store, lastless, 0, acc=True)
    _round(store, lastless, 1, client_acc=True)  # a loss and a client's metric: not evaluated
    many = _run(store, "many0000", 12, "done")
    nine = _run(store, "nine0000", 9, "done")
    eight = _run(store, "eigh0000", 8, "done")
    client_loss = _run(store, "clnt0000", 1, "done")
    only_a_client_s = [(0, "loss_train", 0.5, 4), (None, "acc_global", 0.5, None)]
    store.write_round(client_loss, 0, loss_train=0.5, wall_s=1, bytes_up=1, bytes_down=1,
                      metrics=only_a_client_s)  # fmt: skip
    gap = _run(store, "gapr0000", 5, "running")
    _round(store, gap, 0)
    _round(store, gap, 2)
    failed = _run(store, "fail0000", 2, "failed", error="boom")
    bare = _run(store, "bare0000", 2, "failed")
    stopped = _run(store, "stop0000", 2, "interrupted", error="interrupted at round 1 (Ctrl-C)")
    halted = _run(store, "halt0000", 2, "interrupted")
    _run(store, "pend0000", 2, "pending")
    me = f"{socket.gethostname()}:{os.getpid()}:ab"
    aging = _run(store, "aged0000", 2, "running", owner=me, heartbeat_at=now - dt.timedelta(0, 100))
    dead = f"{socket.gethostname()}:{2**22 + 7}:ab"  # beyond any pid: a process that is gone
    gone = _run(store, "gone0000", 2, "running", owner=dead, heartbeat_at=now)
    retry = "; `fpbench run --retry-failed` retries it"
    resume = "; rerun the suite to take it over and resume it"
    never = "it never sent a heartbeat"
    expected = [
        Problem(holes, "hole0000", "done", "done but rounds 2, 3 are missing", True),
        Problem(holes, "hole0000", "done", "rounds 4 lie beyond the configured 3", True),
        Problem(holes, "hole0000", "done", "rounds 4 have no loss_train metric", True),
        Problem(holes, "hole0000", "done", "the final round 3 has no evaluation metrics", True),
        Problem(lastless, "last0000", "done", "the final round 2 has no evaluation metrics", True),
        Problem(many, "many0000", "done",
                "done but rounds 1, 2, 3, 4, 5, 6, 7, 8, ... (12 in all) are missing", True),
        Problem(many, "many0000", "done", "the final round 12 has no evaluation metrics", True),
        Problem(nine, "nine0000", "done",
                "done but rounds 1, 2, 3, 4, 5, 6, 7, 8, ... (9 in all) are missing", True),
        Problem(nine, "nine0000", "done", "the final round 9 has no evaluation metrics", True),
        Problem(eight, "eigh0000", "done", "done but rounds 1, 2, 3, 4, 5, 6, 7, 8 are missing",
                True),
        Problem(eight, "eigh0000", "done", "the final round 8 has no evaluation metrics", True),
        Problem(client_loss, "clnt0000", "done", "rounds 1 have no loss_train metric", True),
        Problem(gap, "gapr0000", "running", f"stale: running, but {never}{resume}"),
        Problem(gap, "gapr0000", "running", "rounds 2 are missing below stored round 3", True),
        Problem(failed, "fail0000", "failed", f"failed: boom{retry}"),
        Problem(bare, "bare0000", "failed", f"failed: no error stored{retry}"),
        Problem(stopped, "stop0000", "interrupted",
                "interrupted at round 1 (Ctrl-C); rerun the suite to resume it"),
        Problem(halted, "halt0000", "interrupted", "interrupted; rerun the suite to resume it"),
    ]  # fmt: skip
    died = f"stale: running, but its process ({dead}) is gone{resume}"
    expected.append(Problem(gone, "gone0000", "running", died))
    assert check(store) == expected
    assert broken_runs(store) == [p for p in expected if p.broken]
    stale = Problem(aging, "aged0000", "running",
                    f"stale: running, but its last heartbeat was 100 s ago{resume}")  # fmt: skip
    assert check(store, claim_timeout=50) == [*expected[:-1], stale, expected[-1]]
    assert fine not in {p.run_id for p in check(store, claim_timeout=50)}


def test_merge_into_copies_new_runs_and_replaces_only_by_more_complete_ones(tmp_path):
    a, b, out = (_store_with(tmp_path, f"{n}.db") for n in ("a", "b", "out"))
    with pytest.raises(FpbenchError, match="into itself"):
        merge_into(a, _store_with(tmp_path, "a.db"))
    assert str(merge_into(out, a)) == "0 added, 0 replaced, 0 unchanged"  # a has no database
    assert not (tmp_path / "out.db").exists()
    # a: run x done with 2 rounds, run y pending with 1; b: x with 1 round, y done with 2
    for store, (x_status, x_rounds), (y_status, y_rounds) in [
        (a, ("done", 2), ("pending", 1)),
        (b, ("done", 1), ("done", 2)),
    ]:
        x = _run(store, "xxxx0000", 2, x_status, wall_s=float(x_rounds))
        y = _run(store, "yyyy0000", 2, y_status, wall_s=float(y_rounds))
        for run_id, n in ((x, x_rounds), (y, y_rounds)):
            for rnd in range(n):
                _round(store, run_id, rnd, acc=True, client_acc=True)
    first = merge_into(out, a)
    assert (first.added, first.replaced, first.unchanged) == (2, 0, 0)
    second = merge_into(out, b)
    assert str(second) == "0 added, 1 replaced, 1 unchanged"
    runs = out.runs().set_index("run_key")
    assert runs["status"].to_dict() == {"xxxx0000": "done", "yyyy0000": "done"}
    assert runs["wall_s"].to_dict() == {"xxxx0000": 2.0, "yyyy0000": 2.0}
    assert runs["last_round"].tolist() == [1, 1]
    rows = out.metrics(aggregate_only=False)
    assert len(rows) == 2 * 2 * 3  # 2 runs x 2 rounds x (loss, acc, one client's acc)
    assert rows.groupby("run_id").size().tolist() == [6, 6]
    assert _counts(tmp_path / "out.db") == (2, 4, 12)
    assert str(merge_into(out, b)) == "0 added, 0 replaced, 2 unchanged"
    assert str(merge_into(out, a)) == "0 added, 0 replaced, 2 unchanged"
    assert _counts(tmp_path / "out.db") == (2, 4, 12)
    # a copy with more rounds beats one with fewer at the same status
    c = _store_with(tmp_path, "c.db")
    longer = _run(c, "xxxx0000", 2, "done", wall_s=9.0)
    for rnd in range(3):
        _round(c, longer, rnd)
    assert str(merge_into(out, c)) == "0 added, 1 replaced, 0 unchanged"
    assert out.runs().set_index("run_key")["wall_s"]["xxxx0000"] == 9.0
    assert out.round_numbers(out.find_run("xxxx0000").id) == [0, 1, 2]


def test_merge_counts_only_the_output_copy_s_own_rounds(tmp_path):
    out, src = _store_with(tmp_path, "out.db"), _store_with(tmp_path, "src.db")
    x = _run(out, "xxxx0000", 3, "done")
    _round(out, x, 0)
    y = _run(out, "yyyy0000", 3, "done")
    for rnd in range(3):
        _round(out, y, rnd)
    _run(out, "zzzz0000", 3, "pending")  # no rounds yet
    for key, n in (("xxxx0000", 2), ("zzzz0000", 1)):
        run_id = _run(src, key, 3, "done" if key == "xxxx0000" else "pending")
        for rnd in range(n):
            _round(src, run_id, rnd)
    assert str(merge_into(out, src)) == "0 added, 2 replaced, 0 unchanged"
    assert out.round_numbers(out.find_run("xxxx0000").id) == [0, 1]
    assert out.round_numbers(out.find_run("zzzz0000").id) == [0]
