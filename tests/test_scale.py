"""Scale-out and result safety: atomic cell claims, `--jobs`, executors, kill -9, PostgreSQL."""

from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from sqlalchemy import event, update
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.dispatch import run_cells
from fpbench.engine.launch import Dispatch
from fpbench.engine.rounds import Observer
from fpbench.engine.runner import run_cell, run_suite
from fpbench.errors import FpbenchError
from fpbench.store import Store
from fpbench.store.claims import ClaimLost, new_owner, owner_is_gone
from fpbench.store.models import Run
from fpbench.suites import expand_suite
from tests.conftest import TINY_SUITE_TOML, tiny_config

SUITE = TINY_SUITE_TOML
KILL_ROUNDS = 4


def _sqlite(path: Path) -> Store:
    return Store(f"sqlite:///{path}")


def _new_run(store: Store, key: str = "k") -> int:
    fields = dict(suite="s", method="m", dataset="d", partition="p", seed=0, config={})
    versions = dict(fpbench_version="0", torch_version="0", device="cpu")
    return store.create_run(run_key=key, **fields, **versions).id


def _set_claim(store: Store, run_id: int, owner: str, age_s: float = 0.0) -> None:
    """Pretend `owner` holds the run with a heartbeat `age_s` seconds old."""
    beat = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=age_s)
    stmt = update(Run).where(Run.id == run_id)
    with store._session.begin() as s:
        s.execute(stmt.values(status="running", owner=owner, heartbeat_at=beat))


def _results(store: Store) -> pd.DataFrame:
    """Every metric row keyed by run_key (ids differ between databases), in a fixed order."""
    keys = store.runs().set_index("id")["run_key"]
    m = store.metrics(aggregate_only=False)
    m.insert(0, "run_key", m["run_id"].map(keys))
    order = ["run_key", "round", "client_id", "name"]
    return m.drop(columns="run_id").sort_values(order, na_position="first").reset_index(drop=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


# -- claims ---------------------------------------------------------------------------------


def test_a_claim_is_exclusive_until_its_heartbeat_goes_stale(tmp_path):
    store = _sqlite(tmp_path / "c.db")
    run_id = _new_run(store)
    a, b = new_owner(), new_owner()
    assert a != b
    assert store.claim_run(run_id, a) and not store.claim_run(run_id, b)
    assert store.claim_run(run_id, a)  # re-claiming one's own run is fine
    _set_claim(store, run_id, a, age_s=100)
    assert not store.claim_run(run_id, b, timeout_s=600)  # 100 s old: still alive
    assert store.claim_run(run_id, b, timeout_s=50)  # older than the timeout: taken over
    record = store.find_run("k")
    assert (record.status, record.owner) == ("running", b)
    # the old owner can neither beat, nor write a round, nor finish
    assert not store.heartbeat(run_id, a)
    with pytest.raises(ClaimLost):
        store.write_round(run_id, 0, loss_train=1.0, wall_s=0.1, bytes_up=1, bytes_down=1,
                          metrics=[(None, "acc_global", 0.5, None)], owner=a)  # fmt: skip
    assert store.last_round(run_id) is None
    assert not store.finish_run(run_id, a, "done")
    assert store.heartbeat(run_id, b) and store.finish_run(run_id, b, "done", wall_s=1.5)
    _set_claim(store, run_id, b, age_s=10_000)
    with store._session.begin() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status="done"))
    assert not store.claim_run(run_id, new_owner(), timeout_s=1)  # done is never reclaimed


def test_a_dead_local_owner_is_taken_over_at_once(tmp_path):
    store = _sqlite(tmp_path / "c.db")
    run_id = _new_run(store)
    host = socket.gethostname()
    dead, alive, remote = f"{host}:{_dead_pid()}:x", f"{host}:{os.getpid()}:y", "elsewhere:1:z"
    assert owner_is_gone(dead) and not owner_is_gone(alive) and not owner_is_gone(remote)
    for holder, expected in [(alive, False), (remote, False), (dead, True)]:
        _set_claim(store, run_id, holder)  # fresh heartbeat in every case
        assert store.claim_run(run_id, new_owner()) is expected, holder


def test_a_requeued_slurm_job_takes_over_its_own_claim(tmp_path, monkeypatch):
    store = _sqlite(tmp_path / "c.db")
    run_id = _new_run(store)
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued once
    _set_claim(store, run_id, "node1:999999:aa:job=77_3")  # before preemption, other node
    assert store.claim_run(run_id, new_owner())
    _set_claim(store, run_id, "node1:999999:aa:job=77_4")  # another array task: alive
    assert not store.claim_run(run_id, new_owner())


def _race(url: str, run_id: int, n: int) -> list[bool]:
    """n drivers (own engines, own connections) claim the same run at the same moment."""
    stores = [Store(url) for _ in range(n)]
    barrier, wins = threading.Barrier(n), [False] * n

    def claim(i: int) -> None:
        barrier.wait()
        wins[i] = stores[i].claim_run(run_id, new_owner())

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in stores:
        s.close()
    return wins


def test_concurrent_claims_have_exactly_one_winner(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.db'}"
    run_id = _new_run(Store(url))
    assert sum(_race(url, run_id, 6)) == 1


def test_keep_alive_refreshes_the_heartbeat_from_a_thread(tmp_path):
    store = _sqlite(tmp_path / "c.db")
    run_id, owner = _new_run(store), new_owner()
    assert store.claim_run(run_id, owner)
    _set_claim(store, run_id, owner, age_s=1000)
    with store.keep_alive(run_id, owner, interval_s=0.02):
        time.sleep(0.3)
    age = dt.datetime.now(dt.timezone.utc) - store.find_run("k").heartbeat_at
    assert age < dt.timedelta(seconds=30)


def test_sqlite_writers_in_parallel_never_see_database_is_locked(tmp_path):
    """Separate engines (as separate processes would have) write and read one file at once."""
    url = f"sqlite:///{tmp_path / 'w.db'}"
    stores = [Store(url) for _ in range(4)]
    ids = [_new_run(stores[0], key=f"k{i}") for i in range(4)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        owner = new_owner()
        try:
            assert stores[i].claim_run(ids[i], owner)
            for r in range(15):
                rows = [(c, "acc", 0.1 * c, 5) for c in range(20)] + [(None, "acc", 0.5, None)]
                stores[i].write_round(ids[i], r, loss_train=1.0, wall_s=0.0, bytes_up=1,
                                      bytes_down=1, metrics=rows, owner=owner)  # fmt: skip
                stores[i].runs()  # readers interleave with the writers
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert len(stores[0].metrics(aggregate_only=False)) == 4 * 15 * 21


# -- run_cell with claims ---------------------------------------------------------------------


class _Stop(Exception):
    pass


class _StopAfter(Observer):
    def __init__(self, round_idx: int) -> None:
        self.round_idx = round_idx

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.round_idx:
            raise _Stop()


def test_run_cell_skips_a_live_claim_and_takes_over_a_stale_one(tmp_path):
    cfg = tiny_config(rounds=2)
    store, ck = _sqlite(tmp_path / "r.db"), tmp_path / "ck"
    with pytest.raises(_Stop):
        run_cell(cfg, store, checkpoint_dir=ck, observer=_StopAfter(0))
    run_id = store.find_run(cfg.run_key).id
    _set_claim(store, run_id, "elsewhere:1:z")
    result = run_cell(cfg, store, checkpoint_dir=ck)
    assert result.status == "skipped" and "another driver" in result.error
    assert store.last_round(run_id) == 0 and store.find_run(cfg.run_key).status == "running"
    _set_claim(store, run_id, "elsewhere:1:z", age_s=1000)
    assert run_cell(cfg, store, checkpoint_dir=ck, claim_timeout=600).status == "done"
    record = store.find_run(cfg.run_key)
    assert record.status == "done" and record.owner != "elsewhere:1:z"
    assert store.rounds(run_id)["round"].tolist() == [0, 1]


# -- kill -9 at several points, then resume ---------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pd.DataFrame:
    folder = tmp_path_factory.mktemp("whole")
    store = _sqlite(folder / "whole.db")
    assert run_cell(tiny_config(rounds=KILL_ROUNDS), store, checkpoint_dir=folder).status == "done"
    return _results(store)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _killed_child(db: str, ckpt: str, point: str, k: int, cache: str) -> None:
    """Run the cell in a fresh process that SIGKILLs itself at `point` of round `k`."""
    os.environ["FPBENCH_CACHE"] = cache  # the test's own; the fork server keeps the first one's
    cfg = tiny_config(rounds=KILL_ROUNDS)
    store, observer = _sqlite(Path(db)), Observer()
    if point == "after-round":  # round k stored and checkpointed
        observer = _KillAt(k)
    elif point == "before-checkpoint":  # round k stored, its checkpoint not yet written
        save = ckpt_io.save
        ckpt_io.save = lambda path, c, *bound: _die() if c.round == k else save(path, c, *bound)
    elif point == "mid-transaction":  # round k's rows sent, the commit never happens
        write = store.write_round
        armed = threading.Event()

        def write_round(run_id, round, **kw):
            if round == k:
                armed.set()
            write(run_id, round, **kw)

        store.write_round = write_round
        event.listen(store._engine, "commit", lambda conn: _die() if armed.is_set() else None)
    run_cell(cfg, store, checkpoint_dir=Path(ckpt), observer=observer)


class _KillAt(Observer):
    def __init__(self, k: int) -> None:
        self.k = k

    def round_end(self, cfg, round_idx, metrics):
        if round_idx == self.k:
            _die()


@pytest.mark.parametrize(
    "point, k", [("mid-transaction", 1), ("before-checkpoint", 2), ("after-round", 0)]
)
def test_sigkill_at_any_point_then_rerun_gives_identical_rows(tmp_path, uninterrupted, point, k):
    db, ck = tmp_path / "split.db", tmp_path / "ck"
    # not fork: a forked child cannot use CUDA this process did. A fork server is a fresh
    # process like spawn's, but it imports torch and fpbench once for the three kills (~4 s each)
    server = mp.get_context("forkserver")
    server.set_forkserver_preload([__name__, "torch._inductor.config"])  # the latter: 1.5 s
    args = (str(db), str(ck), point, k, os.environ["FPBENCH_CACHE"])
    proc = server.Process(target=_killed_child, args=args)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    store = _sqlite(db)
    cfg = tiny_config(rounds=KILL_ROUNDS)
    record = store.find_run(cfg.run_key)
    assert record.status == "running"  # the killed owner never released its claim
    expected_last = k if point != "mid-transaction" else k - 1
    assert store.last_round(record.id) == expected_last
    # the same command again: the dead owner's claim is taken over, the run resumes
    assert run_cell(cfg, store, checkpoint_dir=ck).status == "done"
    pd.testing.assert_frame_equal(
        _results(store), uninterrupted, check_exact=True
    )  # nothing missing or doubled
    assert store.rounds(record.id)["round"].tolist() == list(range(KILL_ROUNDS))


# -- executors -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> tuple[list, pd.DataFrame]:
    """The tiny suite's cells and their rows from a plain serial run."""
    import tomllib

    folder = tmp_path_factory.mktemp("serial")
    cells = list(expand_suite(tomllib.loads(SUITE), name="tiny").cells)
    store = _sqlite(folder / "serial.db")
    assert {r.status for r in run_suite(cells, store, checkpoint_dir=folder)} == {"done"}
    return cells, _results(store)


def test_jobs_2_runs_cells_in_worker_processes_like_a_serial_run(workdir, serial):
    runner = CliRunner()
    result = runner.invoke(app, ["run", "--suite", "tiny", "--jobs", "2", "--db", "p.db"])
    assert result.exit_code == 0, result.output
    assert "2 cells ran, 0 already done, 0 failed" in result.output
    store = _sqlite(workdir / "p.db")
    pd.testing.assert_frame_equal(_results(store), serial[1], check_exact=True)
    assert set(store.runs()["status"]) == {"done"}
    assert not list((workdir / "results" / "checkpoints").rglob("*.pt"))
    again = runner.invoke(app, ["run", "--suite", "tiny", "--jobs", "2", "--db", "p.db"])
    assert again.exit_code == 0 and "0 cells ran, 2 already done" in again.output


def test_per_cell_databases_hold_one_run_each(tmp_path, serial):
    cells, rows = serial
    url = f"sqlite:///{tmp_path}/cell-{{run_key}}.db"
    results = run_cells(cells, url, checkpoint_dir=tmp_path / "ck")
    assert [r.status for r in results] == ["done", "done"]
    for cfg in cells:
        store = _sqlite(tmp_path / f"cell-{cfg.run_key}.db")
        assert store.runs()["run_key"].tolist() == [cfg.run_key]
        expected = rows[rows["run_key"] == cfg.run_key].reset_index(drop=True)
        pd.testing.assert_frame_equal(_results(store), expected, check_exact=True)


@pytest.mark.slow  # the launcher's wiring: tests/test_launchers.py (fakes)
def test_submitit_local_executor_matches_serial(tmp_path, serial):
    pytest.importorskip("submitit")
    cells, rows = serial
    url = f"sqlite:///{tmp_path / 's.db'}"
    Store(url).close()
    dispatch = Dispatch(launcher="submitit-local", jobs=2, folder=tmp_path / "jobs")
    results = run_cells(cells, url, checkpoint_dir=tmp_path / "ck", dispatch=dispatch)
    assert [r.status for r in results] == ["done", "done"], results
    pd.testing.assert_frame_equal(_results(_sqlite(tmp_path / "s.db")), rows, check_exact=True)


def _job_sees() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow  # the launcher's wiring: tests/test_launchers.py (fakes)
def test_submitit_local_jobs_see_the_drivers_gpus(tmp_path, monkeypatch):
    """submitit's local jobs see no GPU unless given some: by default they get the driver's."""
    pytest.importorskip("submitit")
    from fpbench.engine.submitit_jobs import _executor, driver_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert driver_gpus() == [2, 3]
    job = _executor(Dispatch(launcher="submitit-local", folder=tmp_path)).submit(_job_sees)
    assert job.result() == "2,3"
    one = Dispatch(launcher="submitit-local", folder=tmp_path, gpus_per_cell=1)
    assert _executor(one).submit(_job_sees).result() == "0"  # submitit's own choice
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert driver_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert driver_gpus() == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5e1f")
    with pytest.raises(FpbenchError, match="by index"):
        driver_gpus()


@pytest.mark.slow
def test_ray_executor_matches_serial(tmp_path, serial):
    pytest.importorskip("ray")
    cells, rows = serial
    url = f"sqlite:///{tmp_path / 'r.db'}"
    Store(url).close()
    dispatch = Dispatch(launcher="ray", jobs=2)
    results = run_cells(cells, url, checkpoint_dir=tmp_path / "ck", dispatch=dispatch)
    assert [r.status for r in results] == ["done", "done"], results
    pd.testing.assert_frame_equal(_results(_sqlite(tmp_path / "r.db")), rows, check_exact=True)


def test_unknown_launcher_and_missing_engine_are_user_errors(workdir, monkeypatch):
    runner = CliRunner()
    bad = runner.invoke(app, ["run", "--suite", "tiny", "--launcher", "dask"])
    assert bad.exit_code == 2 and "--launcher 'dask' is unknown" in bad.output
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    missing = runner.invoke(app, ["run", "--suite", "tiny", "--launcher", "ray"])
    assert missing.exit_code == 2 and "needs ray: pip install ray" in missing.output
    monkeypatch.setenv("PATH", str(workdir))  # no sbatch here
    slurm = runner.invoke(app, ["run", "--suite", "tiny", "--launcher", "slurm"])
    assert slurm.exit_code == 2 and ("sbatch on PATH" in slurm.output or "submitit" in slurm.output)
    assert not (workdir / "results").exists()  # nothing written


# -- PostgreSQL ------------------------------------------------------------------------------


def test_postgres_claims_race_and_workers_write_concurrently(pg_url, serial, tmp_path):
    cells, rows = serial
    store = Store(pg_url)
    assert sum(_race(pg_url, _new_run(store, key="race"), 6)) == 1
    more = [c.model_copy(update={"seed": 1}) for c in cells]  # 4 cells, 3 workers at once
    dispatch = Dispatch(jobs=3)
    results = run_cells(cells + more, pg_url, checkpoint_dir=tmp_path, dispatch=dispatch)
    assert [r.status for r in results] == ["done"] * 4
    got = _results(store)
    pd.testing.assert_frame_equal(
        got[got["run_key"].isin(rows["run_key"])].reset_index(drop=True), rows, check_exact=True
    )
    runs = store.runs().set_index("run_key")
    for cfg in more:
        assert runs.loc[cfg.run_key, "status"] == "done"
        assert store.rounds(int(runs.loc[cfg.run_key, "id"]))["round"].tolist() == [0, 1]


def _pool_workers(driver: int) -> list[int]:
    """Worker processes the driver spawned (not multiprocessing's resource tracker)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == driver and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_sigkill_of_a_jobs_worker_then_rerun_matches_serial(workdir):
    """The real thing: `fpbench run --jobs 2`, one worker killed mid-run, the command rerun."""
    suite = SUITE.replace("rounds = 2", "rounds = 6")
    (workdir / "benchmarks" / "tiny.toml").write_text(suite)
    cmd = [sys.executable, "-m", "fpbench", "run", "--suite", "tiny", "--jobs", "2", "--db", "k.db"]
    driver = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    store, deadline = None, time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        if (workdir / "k.db").exists():
            store = store or _sqlite(workdir / "k.db")
            runs = store.runs()
            if (runs["last_round"].fillna(-1) >= 1).any() and _pool_workers(driver.pid):
                os.kill(_pool_workers(driver.pid)[0], signal.SIGKILL)
                break
        time.sleep(0.05)
    out = driver.communicate(timeout=300)[0].decode()
    assert driver.returncode == 1 and "worker process died" in out, out
    again = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    import tomllib

    cells = list(expand_suite(tomllib.loads(suite), name="tiny").cells)
    serial = _sqlite(workdir / "serial.db")
    run_suite(cells, serial, checkpoint_dir=workdir / "serial-ck")
    pd.testing.assert_frame_equal(
        _results(_sqlite(workdir / "k.db")), _results(serial), check_exact=True
    )
