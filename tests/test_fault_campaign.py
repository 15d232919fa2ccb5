"""Fault-injection campaign: after every fault the rerun completes and the database equals an
uninterrupted run's bit for bit, with nothing lost, duplicated or marked done that is not.

Every run is `fpbench run` in a fresh process (`tests/fault_worker.py`) with PyTorch's default
thread count, on a tiny two-cell suite (head-tune and fedvpt, 3 rounds). Faults: kill -9 between
rounds, inside a round, inside a database commit, while a checkpoint is written, inside the
commit that marks a cell done and while a new database file is created; Ctrl-C; a full disk
(patched writers: checkpoint and database); a locked database; two drivers on one database; a
corrupted checkpoint; a PostgreSQL server dropping every connection mid-run (where
FPBENCH_TEST_PG_URL is set, as in .ci/run). The counts (faults injected, runs compared, values
compared, differences) are printed at the end and written to `campaign.json` in the session's
temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from fpbench.store import Store
from fpbench.store.check import broken_runs, check
from tests.conftest import TINY_SUITE_TOML

pytestmark = pytest.mark.slow

SUITE = TINY_SUITE_TOML.replace("rounds = 2", "rounds = 3")
TIMEOUT_S = 600
COUNTS = {"faults injected": 0, "runs compared": 0, "values compared": 0, "differences": 0}
PG_URL = os.environ.get("FPBENCH_TEST_PG_URL")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("campaign")
    (path / "tiny.toml").write_text(SUITE)
    yield path
    report = json.dumps(COUNTS, indent=1)
    (tmp_path_factory.getbasetemp() / "campaign.json").write_text(report)
    print(f"\nfault-injection campaign: {COUNTS}")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path)}


def _command(fault: str, k: int, db: str, *extra: str) -> list[str]:
    args = ["--suite", "tiny.toml", "--db", db, "--checkpoint-dir", "ck", *extra]
    return [sys.executable, "-m", "tests.fault_worker", fault, str(k), "--", *args]


def _run(folder: Path, fault: str, k: int, db: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(fault, k, db, *extra),
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _start(folder: Path, fault: str, k: int, db: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        _command(fault, k, db, *extra),
        cwd=folder,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _url(folder: Path, db: str) -> str:
    return db if "://" in db else f"sqlite:///{folder / db}"


def rows(url: str) -> dict[str, list[tuple]]:
    """Every stored metric and round scalar, keyed by run key and then by round and name."""
    engine = create_engine(url)
    try:
        with engine.connect() as con:
            metrics = con.execute(
                text(
                    "select run_key, round, coalesce(client_id, -1), name, value, count "
                    "from metrics join runs on runs.id = metrics.run_id order by 1, 2, 3, 4"
                )
            ).all()
            scalars = con.execute(
                text(
                    "select run_key, round, loss_train, bytes_up, bytes_down from rounds "
                    "join runs on runs.id = rounds.run_id order by 1, 2"
                )
            ).all()
    finally:
        engine.dispose()
    out: dict[str, list[tuple]] = {}
    for row in [*metrics, *scalars]:
        out.setdefault(row[0], []).append(tuple(row))
    return out


@pytest.fixture(scope="module")
def reference(folder) -> dict[str, list[tuple]]:
    done = _run(folder, "none", 0, "reference.db", "--checkpoint-dir", "ck-ref")
    assert done.returncode == 0, done.stderr
    return rows(_url(folder, "reference.db"))


def _settle(folder: Path, db: str, *extra: str) -> None:
    """Rerun the same command until it succeeds (once is expected; twice allowed for PG)."""
    for _ in range(2):
        again = _run(folder, "none", 0, db, *extra)
        if again.returncode == 0:
            return
    raise AssertionError(f"the rerun failed: {again.stdout}\n{again.stderr}")


def _compare(folder: Path, db: str, reference, keys: list[str] | None = None) -> None:
    """The database equals the reference's runs bit for bit; all done, nothing left behind."""
    url = _url(folder, db)
    got = rows(url)
    keys = keys if keys is not None else sorted(got)
    with Store(url) as store:
        runs = store.runs()
        problems = check(store)
    assert sorted(runs["run_key"]) == sorted(keys), "runs lost or duplicated"
    assert set(runs["status"]) == {"done"}
    assert problems == [], problems
    for key in keys:
        want, have = reference[key], got.get(key, [])
        COUNTS["runs compared"] += 1
        COUNTS["values compared"] += sum(len(r) - 4 if len(r) == 6 else len(r) - 2 for r in want)
        differ = len(set(want) ^ set(have)) + abs(len(want) - len(have))
        COUNTS["differences"] += differ
        assert have == want, f"{key}: {differ} rows differ"
    # a database server's kept trained states live in its checkpoint folder's params/
    # (fpbench.engine.artifacts): they are meant to stay
    left = [p for p in (folder / "ck").rglob("*") if p.is_file() and p.parent.name != "params"]
    assert not left, f"a done cell's checkpoint files were left behind: {left}"
    assert not list(folder.glob(".*.creating*")), "a half-made database was left behind"


@pytest.fixture(scope="module")
def fedvpt_key(folder) -> list[str]:
    from fpbench.suites import load_suite

    cells = load_suite(str(folder / "tiny.toml")).cells
    return [c.run_key for c in cells if c.method.name == "fedvpt"]


def _after_fault(folder: Path, db: str, key: str, status: str | None) -> None:
    """What a fault may leave: unfinished rows, never a broken run nor a false 'done'."""
    COUNTS["faults injected"] += 1
    if not (folder / db).exists():
        return
    with Store(_url(folder, db)) as store:
        assert broken_runs(store) == []
        record = store.find_run(key)
    if status is None:
        assert record is None or record.status != "done"
    else:
        assert record is not None and record.status == status


KILLS = [
    ("kill-after-round", 0),
    ("kill-after-round", 1),
    ("kill-after-round", 2),
    ("kill-at-step", 2),
    ("kill-at-step", 5),
    ("kill-in-commit", 0),
    ("kill-in-commit", 2),
    ("kill-in-checkpoint", 0),
    ("kill-in-checkpoint", 1),
    ("kill-in-finish", 0),
    ("kill-in-create", 0),
]


@pytest.mark.parametrize("fault, k", KILLS, ids=[f"{f}-{k}" for f, k in KILLS])
def test_kill_9_then_rerun_equals_the_uninterrupted_run(folder, reference, fedvpt_key, fault, k):
    db = f"{fault}-{k}.db"
    killed = _run(folder, fault, k, db, "--method", "fedvpt")
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    _after_fault(folder, db, fedvpt_key[0], "running" if fault == "kill-in-finish" else None)
    _settle(folder, db, "--method", "fedvpt")
    _compare(folder, db, reference, fedvpt_key)


def test_ctrl_c_then_rerun(folder, reference, fedvpt_key):
    stopped = _run(folder, "ctrl-c", 1, "ctrl-c.db", "--method", "fedvpt")
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    assert "interrupted after round 1/3 of cell fedvpt / synthetic / pathological / seed 0" in (
        " ".join(stopped.stderr.split())
    )
    _after_fault(folder, "ctrl-c.db", fedvpt_key[0], "interrupted")
    _settle(folder, "ctrl-c.db", "--method", "fedvpt")
    _compare(folder, "ctrl-c.db", reference, fedvpt_key)


def test_sigterm_then_rerun(folder, reference, fedvpt_key):
    """SIGTERM (SLURM's time limit, scancel, timeout) is Ctrl-C: stored interrupted, exit 143."""
    stopped = _run(folder, "sigterm", 1, "sigterm.db", "--method", "fedvpt")
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    said = " ".join(stopped.stderr.split())
    assert said.startswith("SIGTERM: interrupted after round 1/3 of cell fedvpt / synthetic"), said
    assert "Traceback" not in said
    _after_fault(folder, "sigterm.db", fedvpt_key[0], "interrupted")
    with Store(_url(folder, "sigterm.db")) as store:
        assert store.find_run(fedvpt_key[0]).error == "interrupted after round 1/3 (SIGTERM)"
    _settle(folder, "sigterm.db", "--method", "fedvpt")
    _compare(folder, "sigterm.db", reference, fedvpt_key)


def test_sigterm_from_outside_stops_every_worker_of_a_pool(folder, reference):
    """`kill PID` (or `timeout`) on a `--jobs 2` driver: its workers stop too, storing their
    cells interrupted, not `running`; the rerun completes them to the uninterrupted rows."""
    driver = _start(folder, "slow-rounds", 1, "pool.db", "--jobs", "2")
    for line in driver.stdout:  # plain log lines off a terminal: a cell has started (its row
        if line.split()[1:2] == ["start"]:  # is claimed), its rounds (1 s late each) not yet run
            break
    driver.send_signal(signal.SIGTERM)
    _, stderr = driver.communicate(timeout=TIMEOUT_S)
    COUNTS["faults injected"] += 1
    assert driver.returncode == 143, stderr
    assert "SIGTERM: interrupted" in stderr and "Traceback" not in stderr
    with Store(_url(folder, "pool.db")) as store:
        statuses = set(store.runs()["status"])
    # no cell is left looking alive; one whose worker was stopped before its first round
    # stored nothing more is shown stale (a dead owner), and the rerun takes both over
    assert "running" not in statuses and statuses & {"interrupted", "stale"}, statuses
    _settle(folder, "pool.db", "--jobs", "2")
    _compare(folder, "pool.db", reference)


@pytest.mark.parametrize("fault", ["disk-full-checkpoint", "disk-full-db"])
def test_a_full_disk_fails_the_cell_and_the_rerun_completes(folder, reference, fedvpt_key, fault):
    full = _run(folder, fault, 1, f"{fault}.db", "--method", "fedvpt")
    assert full.returncode == 1, full.stdout + full.stderr
    said = " ".join((full.stdout + full.stderr).split())
    assert "No space left on device" in said or "database or disk is full" in said, said
    _after_fault(folder, f"{fault}.db", fedvpt_key[0], "failed")
    _settle(folder, f"{fault}.db", "--method", "fedvpt")
    _compare(folder, f"{fault}.db", reference, fedvpt_key)


def test_a_corrupted_checkpoint_restarts_the_cell(folder, reference, fedvpt_key):
    killed = _run(folder, "kill-after-round", 1, "corrupt.db", "--method", "fedvpt")
    assert killed.returncode == -signal.SIGKILL
    (checkpoint,) = (folder / "ck").rglob(f"{fedvpt_key[0]}.pt")
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # cut short
    _after_fault(folder, "corrupt.db", fedvpt_key[0], None)
    _settle(folder, "corrupt.db", "--method", "fedvpt")
    _compare(folder, "corrupt.db", reference, fedvpt_key)


LOCKER = """
import os, pathlib, sqlite3, sys, time
while not os.path.exists(sys.argv[1]):  # connecting first would create an empty file
    time.sleep(0.05)
uri = pathlib.Path(sys.argv[1]).as_uri() + "?mode=rw"
con = sqlite3.connect(uri, uri=True, timeout=60, isolation_level=None)
while True:
    try:
        if con.execute("select count(*) from rounds").fetchone()[0] >= 1:
            break
    except sqlite3.OperationalError:
        pass
    time.sleep(0.05)
con.execute("BEGIN EXCLUSIVE")
print("locked", time.time(), flush=True)
time.sleep(5)
con.execute("COMMIT")
print("released", time.time(), flush=True)
"""


def test_a_locked_database_is_waited_for(folder, reference, fedvpt_key):
    worker = _start(folder, "none", 0, "locked.db", "--method", "fedvpt")
    locker = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(folder / "locked.db")], stdout=subprocess.PIPE, text=True
    )
    out, err = worker.communicate(timeout=TIMEOUT_S)
    finished = time.time()
    said = locker.communicate(timeout=60)[0].split()
    COUNTS["faults injected"] += 1
    assert worker.returncode == 0, out + err
    assert said[0] == "locked" and said[2] == "released" and float(said[3]) < finished
    _compare(folder, "locked.db", reference, fedvpt_key)


def test_two_drivers_on_one_database_run_each_cell_once(folder, reference):
    drivers = [_start(folder, "none", 0, "two.db") for _ in range(2)]
    outputs = [d.communicate(timeout=TIMEOUT_S) for d in drivers]
    COUNTS["faults injected"] += 1
    for driver, (out, err) in zip(drivers, outputs, strict=True):
        assert driver.returncode == 0, out + err
    ran = sum(int(re.search(r"suite tiny: (\d+) cells? ran", out)[1]) for out, _ in outputs)
    assert ran == 2, outputs  # each cell run by exactly one driver
    _compare(folder, "two.db", reference, sorted(reference))


def test_postgres_dropping_every_connection_mid_run(folder, reference, fedvpt_key, pg_database):
    """What a server restart does to a client: every connection is cut between two rounds."""
    url, name = pg_database
    worker = _start(folder, "none", 0, url, "--method", "fedvpt")
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    watch = create_engine(url)
    cut = 0
    deadline = time.time() + TIMEOUT_S
    while worker.poll() is None and time.time() < deadline:
        try:
            with watch.connect() as con:
                stored = con.execute(text("select count(*) from rounds")).scalar()
        except Exception:  # noqa: BLE001 - tables not created yet
            stored = 0
        if stored >= 1:
            with admin.connect() as con:
                cut = con.execute(
                    text(
                        "select count(pg_terminate_backend(pid)) from pg_stat_activity "
                        "where datname = :db and pid <> pg_backend_pid()"
                    ),
                    {"db": name},
                ).scalar()
            break
        time.sleep(0.1)
    watch.dispose()
    admin.dispose()
    out, err = worker.communicate(timeout=TIMEOUT_S)
    COUNTS["faults injected"] += 1
    assert cut >= 1, "no connection was cut (the run ended first)"
    if worker.returncode != 0:
        _settle(folder, url, "--method", "fedvpt")
    _compare(folder, url, reference, fedvpt_key)


def test_zz_campaign_found_no_difference():
    """Runs last in this module: the campaign's counts, with no difference anywhere."""
    print(f"\nfault-injection campaign: {COUNTS}")
    assert COUNTS["differences"] == 0
