"""Same seed, same numbers: bit-identical stored metrics across processes, resumes and executors.

Every run here is a fresh process with PyTorch's default thread count, as a user's run is: with
one thread the scheduling-dependent kernels that deterministic mode replaces never show. The
suite holds one tiny cell per method family (a ViT prompt method, SGPT, a personal method, a
CLIP method); metrics are compared exactly, straight from the SQLite files.

`FPBENCH_TEST_DETERMINISTIC=0 pytest tests/test_reproducibility.py` runs every cell with
`runtime.deterministic = false`, to see these tests fail without the mode.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.determinism import deterministic, nondeterministic_op
from fpbench.engine.dispatch import Dispatch, pin_threads, run_cells
from fpbench.errors import FpbenchError
from tests.conftest import tiny_config

# Three clients a round whose minibatches (30 + 30 + ~13) split unevenly between threads, so
# without the mode two threads add into the same prompt rows in a scheduling-dependent order.
SUITE = """
name = "repro"
seeds = [0]
[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 6, image_size = 16, train_per_class = 40, test_per_class = 6 }
partition = { num_clients = 4, heldout_frac = 0.25 }
train = { rounds = 3, participation = 1.0, local_epochs = 2, batch_size = 30, lr = 0.05 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "dirichlet"
alpha = 1.0
[[methods]]
name = "fedvpt"
prompt_len = 50
[[methods]]
name = "sgpt"
[[methods]]
name = "fedrep"
[[methods]]
name = "promptfl"
overrides = { backbone = { name = "clip-test" } }
"""
METHODS = ("fedvpt", "sgpt", "fedrep", "promptfl")
MODE_OFF = os.environ.get("FPBENCH_TEST_DETERMINISTIC") == "0"
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("repro")
    (folder / "benchmarks").mkdir()
    (folder / "benchmarks" / "repro.toml").write_text(SUITE)
    return folder


def _worker(workdir: Path, db: str, *args: str) -> subprocess.CompletedProcess:
    """`tests/repro_worker.py` in a fresh process (default threads) on the suite."""
    off = ["--no-deterministic"] if MODE_OFF else []
    cmd = [sys.executable, "-m", "tests.repro_worker", "benchmarks/repro.toml", db, "ck", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # PyTorch's default thread count
        env.pop(var, None)
    return subprocess.run(
        cmd + off, cwd=workdir, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def _cli(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    off = ["--no-deterministic"] if MODE_OFF else []
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return subprocess.run(
        [sys.executable, "-m", "fpbench", "run", "--suite", "repro", *args, *off],
        cwd=workdir,
        env={**env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def _rows(db: Path, method: str | None = None) -> list[tuple]:
    """Every stored metric (value and count) and round scalar, keyed by method, never by id."""
    where = "" if method is None else f"where runs.method = '{method}'"
    with sqlite3.connect(db) as con:
        metrics = con.execute(
            "select runs.method, round, coalesce(client_id, -1), name, value, count "
            f"from metrics join runs on runs.id = metrics.run_id {where} order by 1, 2, 3, 4"
        ).fetchall()
        rounds = con.execute(
            "select runs.method, round, loss_train, bytes_up, bytes_down "
            f"from rounds join runs on runs.id = rounds.run_id {where} order by 1, 2"
        ).fetchall()
    return metrics + rounds


def _differences(got: list[tuple], want: list[tuple]) -> str:
    """Which rows differ, for the failure message (exact comparison)."""
    if [r[:4] for r in got] != [r[:4] for r in want]:
        return "the stored rows differ (missing or extra)"
    diff = [(w[:4], w[4], g[4]) for g, w in zip(got, want, strict=True) if g != w]
    worst = max((abs(g - w) for _, w, g in diff if g is not None and w is not None), default=0)
    return f"{len(diff)} of {len(want)} values differ (largest by {worst:.3g}); first: {diff[:3]}"


@pytest.fixture(scope="module")
def reference(workdir) -> Path:
    """Every cell of the suite run once, uninterrupted, in its own process."""
    result = _worker(workdir, "ref.db")
    assert result.returncode == 0, result.stderr
    return workdir / "ref.db"


# Slow (two fresh processes over every method's cell, about 30 s with the reference run): the
# default run keeps tests/test_scale.py's worker-process equalities on the tiny suite.
@pytest.mark.slow
def test_two_fresh_processes_store_bit_identical_metrics(workdir, reference):
    result = _worker(workdir, "again.db")
    assert result.returncode == 0, result.stderr
    for method in METHODS:
        got, want = _rows(workdir / "again.db", method), _rows(reference, method)
        assert want and got == want, f"{method}: {_differences(got, want)}"


# Slow: the round boundary (the mid-round kill stays in the default run; tests/test_scale.py's
# SIGKILL cases cover the boundary on the tiny suite there); both run in CI's `pytest -m slow`.
@pytest.mark.parametrize(
    "kill, stored",
    [
        pytest.param(("--kill-after-round", "1"), [0, 1], marks=pytest.mark.slow),
        # slow too: tests/test_scale.py's SIGKILL cases resume in the default run
        pytest.param(("--kill-at-step", "7"), [0], marks=pytest.mark.slow),
    ],
    ids=["round-boundary", "mid-round"],
)
def test_kill_9_then_resume_equals_uninterrupted(workdir, reference, kill, stored):
    db = f"kill-{kill[0][2:]}.db"
    killed = _worker(workdir, db, "--method", "fedvpt", *kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with sqlite3.connect(workdir / db) as con:  # 4 steps a round: step 7 is in round 1
        assert [r[0] for r in con.execute("select round from rounds order by 1")] == stored
    resumed = _worker(workdir, db, "--method", "fedvpt")
    assert resumed.returncode == 0, resumed.stderr
    got, want = _rows(workdir / db), _rows(reference, "fedvpt")
    assert got == want, _differences(got, want)


# Slow (every method's cell through each launcher, 30 s): the default run keeps
# tests/test_scale.py's jobs-2 and submitit-local equalities on the tiny suite.
@pytest.mark.slow
@pytest.mark.parametrize(
    "executor",
    [["--jobs", "2"], ["--launcher", "submitit-local", "--jobs", "2"]],
    ids=["jobs-2", "submitit-local"],
)
def test_executors_store_what_the_serial_run_stores(workdir, reference, executor):
    if "submitit-local" in executor:
        pytest.importorskip("submitit")
    db = "submitit.db" if "submitit-local" in executor else "jobs.db"
    result = _cli(workdir, *executor, "--db", db, "--job-dir", "jobs")
    assert result.returncode == 0, result.stdout + result.stderr
    got, want = _rows(workdir / db), _rows(reference)
    assert got == want, _differences(got, want)


@pytest.mark.slow
def test_ray_stores_what_the_serial_run_stores(workdir, reference):
    pytest.importorskip("ray", reason="ray is not installed (CI installs it for -m slow)")
    result = _cli(workdir, "--launcher", "ray", "--jobs", "2", "--db", "ray.db")
    assert result.returncode == 0, result.stdout + result.stderr
    got, want = _rows(workdir / "ray.db"), _rows(reference)
    assert got == want, _differences(got, want)


# -- the mode itself, in this process ----------------------------------------------------------


def _state() -> tuple:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def test_the_mode_is_on_inside_and_the_old_state_comes_back():
    before = _state()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    with deterministic(True):
        assert _state() == (True, False, True, False)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.utils.deterministic.fill_uninitialized_memory is False  # no NaN fill
    assert _state() == before
    assert torch.utils.deterministic.fill_uninitialized_memory is fill
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with deterministic(False):
            assert not torch.are_deterministic_algorithms_enabled()
        assert _state()[:2] == (True, True)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_an_op_without_a_deterministic_kernel_is_named_with_the_way_out():
    x = torch.zeros(4)
    with pytest.raises(FpbenchError) as info, deterministic(True):
        x.put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))  # put_ without accumulate
    assert str(info.value).startswith("put_ has no deterministic implementation")
    assert "runtime.deterministic = false" in str(info.value)
    assert nondeterministic_op(RuntimeError("shape mismatch")) is None
    with deterministic(False):  # off: the op runs
        x.put_(torch.tensor([1]), torch.tensor([2.0]))
    assert x.tolist() == [0.0, 2.0, 0.0, 0.0]


def test_the_mode_is_a_runtime_field_on_by_default_outside_the_run_key():
    cfg = tiny_config()
    off = cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"deterministic": False})}
    )
    assert cfg.runtime.deterministic is True
    assert off.run_key == cfg.run_key


def test_the_mode_computes_with_the_cells_thread_count():
    own = torch.get_num_threads()
    with deterministic(True, threads=3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == own
    with deterministic(True):
        assert torch.get_num_threads() == own  # unset: the process's own count


def test_local_executors_pin_deterministic_cells_to_the_drivers_thread_count(monkeypatch):
    """--jobs workers and local Ray tasks compute with the driver's count, not their share:
    CPU matrix kernels split their work by threads, so the last bits depend on it."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    cfg = tiny_config()
    runtime = lambda **kw: cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update=kw)})  # noqa: E731
    off, own = runtime(deterministic=False), runtime(threads=2)
    for dispatch in (Dispatch(jobs=2), Dispatch("submitit-local"), Dispatch("ray")):
        pinned = pin_threads([cfg, off, own], dispatch)
        assert [c.runtime.threads for c in pinned] == [7, None, 2]
        assert pinned[0].run_key == cfg.run_key
    for elsewhere in (Dispatch("slurm"), Dispatch("ray", address="ray://head:10001")):
        assert pin_threads([cfg], elsewhere)[0].runtime.threads is None  # the job's own count


def test_workers_started_for_the_executors_sleep_while_they_wait(monkeypatch, tmp_path):
    """OpenMP reads its wait policy when a worker loads it: set before the workers start."""
    seen = []

    def pool(*_):
        seen.append(os.environ.get("OMP_WAIT_POLICY"))
        raise KeyboardInterrupt  # the environment comes back however the run ends

    monkeypatch.setattr("fpbench.engine.dispatch._pool", pool)
    url, ck = f"sqlite:///{tmp_path / 'w.db'}", tmp_path / "ck"
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(KeyboardInterrupt):
        run_cells([tiny_config()], url, checkpoint_dir=ck, dispatch=Dispatch(jobs=2))
    assert seen == ["PASSIVE"] and "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # yours is kept
    with pytest.raises(KeyboardInterrupt):
        run_cells([tiny_config()], url, checkpoint_dir=ck, dispatch=Dispatch(jobs=2))
    assert seen == ["PASSIVE", "ACTIVE"] and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_no_deterministic_is_stored_with_the_run(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    args = ["run", "--suite", "repro", "--method", "fedvpt", "--db", "flag.db"]
    result = CliRunner().invoke(app, [*args, "--no-deterministic", "--checkpoint-dir", "ckf"])
    assert result.exit_code == 0, result.output
    with sqlite3.connect(workdir / "flag.db") as con:
        query = "select json_extract(config_json, '$.runtime.deterministic') from runs"
        stored = con.execute(query)
        assert stored.fetchall() == [(0,)]  # SQLite's JSON false
    assert not torch.are_deterministic_algorithms_enabled()  # nothing leaks out of the run
