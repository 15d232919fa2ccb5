"""`fpbench db diff`: two results databases compared run by run, value by value, bit for bit."""

from __future__ import annotations

import math
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.store import Store
from fpbench.store.diff import diff, same_bits

runner = CliRunner()


def _db(path: Path, keys=("cell-a", "cell-b"), wall_s: float = 1.0, rounds=(0, 1)) -> Path:
    """Two runs of two rounds: a loss, bytes, an aggregate and two per-client metric rows each
    round (2 x (1 status + 2 x (3 round values + 3 x 2 metric values))) = 38 values)."""
    store = Store(f"sqlite:///{path}")
    for i, key in enumerate(keys):
        run = store.create_run(
            run_key=key, suite="s", method="m", dataset="d", partition="p", seed=i,
            config={}, fpbench_version="0", torch_version="0", device="cpu",
        )  # fmt: skip
        for r in rounds:
            metrics = [
                (None, "acc", 0.1 * (r + 1) + i, 20),
                (0, "acc", 0.3 + r, 10),
                (1, "acc", 1 / 3 + r, 10),
            ]
            store.write_round(
                run.id, r, loss_train=2.5 - r, wall_s=wall_s, bytes_up=100 * (r + 1),
                bytes_down=7, metrics=metrics,
            )  # fmt: skip
    store.close()
    return path


def _diff(a: Path, b: Path, **kw):
    with Store(f"sqlite:///{a}") as sa, Store(f"sqlite:///{b}") as sb:
        return diff(sa, sb, **kw)


def _run(a: Path, b: Path, *more: str):
    return runner.invoke(app, ["db", "diff", str(a), str(b), *more])


def test_identical_databases_match_every_value(tmp_path):
    a = _db(tmp_path / "a.db")
    b = _db(tmp_path / "b.db", wall_s=9.0)  # times are not results
    result = _run(a, b)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines == [
        f"runs in A ({a}): 2",
        f"runs in B ({b}): 2",
        "runs matched: 2",
        "values compared: 38",
        "values different: 0",
    ]


def test_a_changed_value_is_listed_and_fails(tmp_path):
    a = _db(tmp_path / "a.db")
    b = tmp_path / "b.db"
    shutil.copyfile(a, b)
    stored, changed = 1 / 3 + 1, math.nextafter(1 / 3 + 1, 2)  # the last bit differs
    with sqlite3.connect(b) as con:
        con.execute(
            "update metrics set value = ? where round = 1 and client_id = 1 and run_id = "
            "(select id from runs where run_key = 'cell-b')",
            (changed,),
        )
    result = _run(a, b)
    assert result.exit_code == 1, result.output
    assert "values compared: 38\nvalues different: 1\n" in result.output
    want = f"  cell-b round 1 metric acc client 1 value: {stored!r} != {changed!r}"
    assert want in result.output.splitlines()


def test_a_missing_run_and_a_missing_row_fail(tmp_path):
    a = _db(tmp_path / "a.db")
    b = _db(tmp_path / "b.db", keys=("cell-a",))
    with sqlite3.connect(b) as con:
        con.execute("delete from metrics where round = 0 and client_id = 0")
    result = _run(a, b)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[:5] == [
        f"runs in A ({a}): 2",
        f"runs in B ({b}): 1",
        "runs matched: 1",
        "values compared: 19",
        "values different: 2",
    ]
    assert lines[5:8] == ["runs only in A: 1", "  cell-b", "first 2 differences (A != B):"]
    assert lines[8:] == [
        "  cell-a round 0 metric acc client 0 count: 10 != (missing)",
        "  cell-a round 0 metric acc client 0 value: 0.3 != (missing)",
    ]


def test_status_and_show_limit(tmp_path):
    a = _db(tmp_path / "a.db")
    b = tmp_path / "b.db"
    shutil.copyfile(a, b)
    with sqlite3.connect(b) as con:
        con.execute("update runs set status = 'failed'")
        con.execute("update rounds set loss_train = NULL where round = 0")
    found = _diff(a, b, keep=3)
    assert (found.compared, found.different, len(found.first)) == (38, 4, 3)
    assert [(d.run_key, d.what, d.a, d.b) for d in found.first] == [
        ("cell-a", "round 0 loss_train", "2.5", "None"),
        ("cell-a", "status", "'pending'", "'failed'"),
        ("cell-b", "round 0 loss_train", "2.5", "None"),
    ]


def test_differences_are_listed_round_by_round_in_number_order(tmp_path):
    a = _db(tmp_path / "a.db", keys=("cell-a",), rounds=(2, 10))
    b = _db(tmp_path / "b.db", keys=("cell-a", "cell-c"), rounds=(2, 10))
    with sqlite3.connect(b) as con:
        con.execute("update rounds set loss_train = 0.0 where run_id = 1")
        con.execute("update metrics set value = 5.0 where round = 2 and client_id is null")
    with sqlite3.connect(a) as con:
        con.execute("delete from metrics where round = 10 and client_id = 1")
    found = _diff(a, b)
    assert (found.only_a, found.only_b, found.matched, found.different) == ([], ["cell-c"], 1, 5)
    # round 2 before round 10; within a round, loss_train before the metrics (by name)
    assert [(d.what, d.a, d.b) for d in found.first] == [
        ("round 2 loss_train", "0.5", "0.0"),
        ("round 2 metric acc aggregate value", repr(0.1 * 3), "5.0"),
        ("round 10 loss_train", "-7.5", "0.0"),
        ("round 10 metric acc client 1 count", "(missing)", "10"),
        ("round 10 metric acc client 1 value", "(missing)", repr(1 / 3 + 10)),
    ]


def test_the_first_twenty_differences_are_kept_by_default(tmp_path):
    a = _db(tmp_path / "a.db")
    b = tmp_path / "b.db"
    shutil.copyfile(a, b)
    with sqlite3.connect(b) as con:
        con.execute("update metrics set value = value + 1, count = count + 1")
    found = _diff(a, b)
    assert (found.different, len(found.first)) == (24, 20)  # 2 runs x 2 rounds x 3 rows x 2


def test_missing_database_is_refused_and_nothing_is_created(tmp_path):
    a = _db(tmp_path / "a.db")
    result = _run(a, tmp_path / "none.db")
    assert result.exit_code != 0
    assert "no results database at" in result.output
    assert not (tmp_path / "none.db").exists()


@pytest.mark.parametrize(
    ("x", "y", "same"),
    [(0.1, 0.1, True), (0.0, -0.0, False), (1, 1.0, True), (None, None, True), ("a", "a", True),
     (None, 0.0, False), (0.1 + 0.2, 0.3, False), (5, 6, False)],
)  # fmt: skip
def test_same_bits(x, y, same):
    assert same_bits(x, y) is same


@pytest.mark.slow  # one fpbench process per suite
def test_offline_suites_script_runs_exactly_the_suites_that_need_no_download(tmp_path):
    """scripts/offline_suites.sh picks suites by name (smoke*, *-smoke): that is every shipped
    suite that `fpbench list suites` calls offline, and only those (here with --dry-run)."""
    from fpbench.cli.results import suite_row
    from fpbench.suites import list_suites

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "FPBENCH_SUITES"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = tmp_path / "out"
    result = subprocess.run(
        [root / "scripts" / "offline_suites.sh", out, "--dry-run"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (line,) = [s for s in result.stdout.splitlines() if s.startswith("suites: ")]
    offline = [s for s in list_suites() if suite_row(s)[1] == "[green]offline[/]"]
    assert line.split()[1:] == offline
    assert [s.removeprefix("== ") for s in result.stdout.splitlines() if s[:3] == "== "] == offline
    refused = subprocess.run(
        [root / "scripts" / "offline_suites.sh", root / "benchmarks"], capture_output=True,
        text=True, env=env,
    )  # fmt: skip
    assert refused.returncode == 2 and "is not empty" in refused.stderr
