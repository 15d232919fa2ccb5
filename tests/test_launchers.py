"""The launchers' wiring, with fakes in place of Ray, submitit's executors and the process pool:
which cells each one submits, with what arguments, what comes back and how failures surface.
The real engines run in tests/test_scale.py (slow: whole tiny suites)."""

from __future__ import annotations

import importlib.machinery
import os
import queue
import signal
import sys
import time
import types
from concurrent.futures import Future
from contextlib import contextmanager

import pytest
import torch

from fpbench.engine import dispatch, runner
from fpbench.engine.launch import Dispatch
from fpbench.engine.observer import CellResult, Observer
from fpbench.errors import FpbenchError
from fpbench.store import Store
from fpbench.store.claims import new_owner
from tests.conftest import tiny_config


def _cells(n: int = 3) -> list:
    base = tiny_config()
    return [base.model_copy(update={"seed": s}) for s in range(n)]


class Recorder(Observer):
    """Every call the driver makes on its observer, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def cell_start(self, cfg, start_round):
        self.calls.append(("start", cfg.seed, start_round))

    def round_end(self, cfg, round_idx, metrics):
        self.calls.append(("round", cfg.seed, round_idx, metrics))

    def stage(self, cfg, what, done, total):
        self.calls.append(("stage", cfg.seed, what, done, total))

    def cell_end(self, result):
        self.calls.append(("end", result.cfg.seed, result.status, result.error))


def _stored(url: str, cfg, status: str) -> None:
    """A run of `cfg` stored with a final `status`."""
    with Store(url) as store:
        run = store.create_run(
            run_key=cfg.run_key,
            suite=cfg.suite,
            method=cfg.method.name,
            dataset=cfg.dataset.name,
            partition=cfg.partition.name,
            seed=cfg.seed,
            config={},
            fpbench_version="0",
            torch_version="0",
            device="cpu",
        )
        owner = new_owner()
        assert store.claim_run(run.id, owner)
        assert store.finish_run(run.id, owner, status)


# -- Ray ------------------------------------------------------------------------------------


class _Ref:
    def __init__(self, cfg) -> None:
        self.cfg = cfg


class FakeRay(types.ModuleType):
    """`ray` as `run_ray` uses it: tasks end last-submitted first, outcomes by the cell's seed."""

    def __init__(self, outcomes: dict, initialized: bool = False) -> None:
        super().__init__("ray")
        self.__spec__ = importlib.machinery.ModuleSpec("ray", None)
        self.outcomes, self.initialized, self.calls = outcomes, initialized, []

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, **kwargs) -> None:
        self.calls.append(("init", kwargs))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))

    def remote(self, **kwargs):
        self.calls.append(("remote", kwargs))
        ray = self

        def wrap(fn):
            class Task:
                def remote(self, *args):
                    ray.calls.append(("submit", fn, args[0].seed, *args[1:]))
                    return _Ref(args[0])

            return Task()

        return wrap

    def wait(self, pending, num_returns, timeout):
        self.calls.append(("wait", [r.cfg.seed for r in pending], num_returns, timeout))
        return [pending[-1]], pending[:-1]

    def get(self, ref):
        out = self.outcomes[ref.cfg.seed]
        if isinstance(out, Exception):
            raise out
        return out


def test_ray_submits_every_cell_as_a_task_and_reports_each_as_it_ends(tmp_path, monkeypatch):
    from fpbench.engine import ray_tasks

    cells = _cells()
    died = RuntimeError("the worker died\nTraceback ...")
    ray = FakeRay({0: ("done", None), 1: died, 2: ("failed", "boom")})
    monkeypatch.setitem(sys.modules, "ray", ray)
    d = Dispatch(launcher="ray", jobs=3, cpus_per_cell=2, gpus_per_cell=0.5, claim_timeout=7.0)
    obs = Recorder()
    results = ray_tasks.run_ray(cells, "sqlite:///x.db", tmp_path / "ck", d, obs)
    failed = "Ray task failed: RuntimeError: the worker died"
    assert results == [
        CellResult(cells[0], "done", None),
        CellResult(cells[1], "failed", failed),
        CellResult(cells[2], "failed", "boom"),
    ]
    ck = str(tmp_path / "ck")
    assert ray.calls == [
        ("init", {"num_cpus": 3, "include_dashboard": False, "log_to_driver": False}),
        ("remote", {"num_cpus": 2, "num_gpus": 0.5}),
        *[("submit", runner.run_one, s, "sqlite:///x.db", ck, 7.0) for s in range(3)],
        ("wait", [0, 1, 2], 1, 1.0),
        ("wait", [0, 1], 1, 1.0),
        ("wait", [0], 1, 1.0),
        ("shutdown",),
    ]
    assert obs.calls == [("end", 2, "failed", "boom"), ("end", 1, "failed", failed)] + [
        ("end", 0, "done", None)
    ]


def test_ray_joins_a_running_instance_or_a_cluster_address_and_stops_only_its_own(
    tmp_path, monkeypatch
):
    from fpbench.engine import ray_tasks

    cells = _cells(1)
    joined = FakeRay({0: ("done", None)}, initialized=True)
    monkeypatch.setitem(sys.modules, "ray", joined)
    d = Dispatch(launcher="ray", address="ray://head:10001")
    assert [r.status for r in ray_tasks.run_ray(cells, "u", tmp_path, d, Observer())] == ["done"]
    assert [c[0] for c in joined.calls] == ["remote", "submit", "wait"]  # no init, no shutdown
    cluster = FakeRay({0: ("error", "no such dataset")})
    monkeypatch.setitem(sys.modules, "ray", cluster)
    with pytest.raises(FpbenchError, match="^no such dataset$"):  # a user error stops it all
        ray_tasks.run_ray(cells, "u", tmp_path, d, Observer())
    assert cluster.calls[0] == (
        "init",
        {"address": "ray://head:10001", "include_dashboard": False, "log_to_driver": False},
    )
    assert cluster.calls[-1] == ("shutdown",)  # also when a cell stops the dispatch


# -- submitit -------------------------------------------------------------------------------


class FakeJob:
    """Done on its `polls`-th `done()`; `result()` returns or raises `outcome`."""

    def __init__(self, log: list, cfg, outcome, polls: int, job_id: str) -> None:
        self.log, self.cfg, self.outcome, self.polls, self.job_id = log, cfg, outcome, polls, job_id

    def done(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def result(self):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


class FakeExecutor:
    """submitit's executor as `submitit_jobs` uses it; outcomes and polls by the cell's seed."""

    made: list = []

    def __init__(self, folder, cluster=None, *, outcomes=None, polls=None) -> None:
        self.folder, self.cluster, self.params, self.log = folder, cluster, [], []
        self.outcomes, self.polls, self.in_batch = outcomes or {}, polls or {}, False
        FakeExecutor.made.append(self)

    def update_parameters(self, **kwargs) -> None:
        self.params.append(kwargs)

    @contextmanager
    def batch(self):
        self.in_batch = True
        self.log.append("batch")
        yield
        self.log.append("end batch")
        self.in_batch = False

    def submit(self, fn, cfg, *args):
        self.log.append(("submit", type(fn).__name__, cfg.seed, *args, self.in_batch))
        out = self.outcomes.get(cfg.seed, ("done", None))
        return FakeJob(self.log, cfg, out, self.polls.get(cfg.seed, 1), f"77_{cfg.seed}")


@pytest.fixture
def fake_submitit(monkeypatch):
    """submitit's executors replaced by `FakeExecutor`, `time.sleep` logged on the last one."""
    from fpbench.engine import submitit_jobs

    FakeExecutor.made = []
    settings: dict = {}

    def make(folder, cluster=None):
        return FakeExecutor(folder, cluster, **settings)

    monkeypatch.setattr(submitit_jobs.submitit, "AutoExecutor", make)
    monkeypatch.setattr(submitit_jobs.submitit, "LocalExecutor", make)
    monkeypatch.setattr(
        submitit_jobs.time, "sleep", lambda s: FakeExecutor.made[-1].log.append(("sleep", s))
    )
    return submitit_jobs, settings


def test_slurm_submits_one_array_of_cell_jobs_with_the_dispatchs_resources(tmp_path, fake_submitit):
    jobs, settings = fake_submitit
    cells = _cells()
    settings.update(
        outcomes={1: TimeoutError("  out of time\nslurmstepd: ..."), 2: RuntimeError("")},
        polls={0: 3, 1: 1, 2: 2},
    )
    d = Dispatch(
        launcher="slurm",
        jobs=4,
        folder=tmp_path,
        cpus_per_cell=3,
        gpus_per_cell=0.5,
        timeout_min=90,
        slurm_partition="gpu",
        claim_timeout=5.0,
    )
    obs = Recorder()
    results = jobs.run_submitit(cells, "sqlite:///s.db", tmp_path / "ck", d, obs)
    assert results == [
        CellResult(cells[0], "done", None),
        CellResult(cells[1], "failed", "job 77_1 failed: out of time"),
        CellResult(cells[2], "failed", "job 77_2 failed: RuntimeError"),
    ]
    (ex,) = FakeExecutor.made
    assert (ex.folder, ex.cluster) == (tmp_path / "%j", "slurm")
    assert ex.params == [
        {
            "name": "fpbench",
            "timeout_min": 90,
            "cpus_per_task": 3,
            "gpus_per_node": 1,
            "slurm_array_parallelism": 4,
            "slurm_partition": "gpu",
        }
    ]
    ck = str(tmp_path / "ck")
    submits = [("submit", "CellJob", s, "sqlite:///s.db", ck, 5.0, True) for s in range(3)]
    assert ex.log == ["batch", *submits, "end batch", ("sleep", 0.5), ("sleep", 0.5)]
    assert [c[1] for c in obs.calls] == [1, 2, 0]  # reported as they end


def test_slurm_without_a_partition_leaves_it_to_the_cluster(tmp_path, fake_submitit):
    jobs, _ = fake_submitit
    d = Dispatch(launcher="slurm", folder=tmp_path, gpus_per_cell=2)
    assert [r.status for r in jobs.run_submitit(_cells(1), "u", tmp_path, d, Observer())] == [
        "done"
    ]
    (ex,) = FakeExecutor.made
    assert ex.params == [
        {
            "name": "fpbench",
            "timeout_min": 24 * 60,
            "cpus_per_task": 1,
            "gpus_per_node": 2,
            "slurm_array_parallelism": 1,
        }
    ]


def test_submitit_local_keeps_at_most_jobs_cells_running_and_gives_them_the_drivers_gpus(
    tmp_path, fake_submitit, monkeypatch
):
    jobs, settings = fake_submitit
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")
    settings.update(polls={0: 2, 1: 2, 2: 2})
    cells = _cells()
    d = Dispatch(launcher="submitit-local", jobs=2, folder=tmp_path, timeout_min=30)
    obs = Recorder()
    results = jobs.run_submitit(cells, "u", tmp_path / "ck", d, obs)
    assert results == [CellResult(c, "done", None) for c in cells]
    (ex,) = FakeExecutor.made
    assert (ex.folder, ex.cluster) == (tmp_path / "%j", None)
    assert ex.params == [{"gpus_per_node": 2, "visible_gpus": (1, 3)}, {"timeout_min": 30}]
    sub = [
        ("submit", "CellJob", s, "u", str(tmp_path / "ck"), d.claim_timeout, False)
        for s in range(3)
    ]
    # two at once; the third when both have ended; a sleep after each poll that left one running
    assert ex.log == [sub[0], sub[1], ("sleep", 0.5), sub[2], ("sleep", 0.5)]
    assert [c[1] for c in obs.calls] == [0, 1, 2]


def test_submitit_local_with_gpus_per_cell_asks_for_whole_gpus(tmp_path, fake_submitit):
    jobs, _ = fake_submitit
    d = Dispatch(launcher="submitit-local", folder=tmp_path, gpus_per_cell=1.5, timeout_min=5)
    jobs.run_submitit(_cells(1), "u", tmp_path, d, Observer())
    assert FakeExecutor.made[0].params == [{"gpus_per_node": 2}, {"timeout_min": 5}]


def test_submitit_local_refuses_gpus_named_otherwise_than_by_index(monkeypatch):
    from fpbench.engine.submitit_jobs import driver_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 1, 3,")
    assert driver_gpus() == [1, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-5e1f")
    with pytest.raises(FpbenchError) as e:
        driver_gpus()
    assert str(e.value) == (
        "--launcher submitit-local gives its jobs GPUs by index, but "
        "CUDA_VISIBLE_DEVICES='1,GPU-5e1f' names them otherwise; use indices, or --launcher local"
    )


def test_a_cell_job_runs_its_cell_with_the_arguments_it_was_submitted_with(monkeypatch):
    from fpbench.engine import submitit_jobs

    seen = []
    monkeypatch.setattr(submitit_jobs, "run_one", lambda *a: seen.append(a) or ("done", "x"))
    cfg = _cells(1)[0]
    assert submitit_jobs.CellJob()(cfg, "u", "ck", 3.0) == ("done", "x")
    assert seen == [(cfg, "u", "ck", 3.0)]


# -- dispatch: choosing the launcher --------------------------------------------------------


def test_validate_names_what_is_wrong_before_anything_runs(monkeypatch, tmp_path):
    with pytest.raises(FpbenchError) as e:
        dispatch.validate(Dispatch(launcher="dask"))
    assert (
        str(e.value) == "--launcher 'dask' is unknown; use one of local, submitit-local, slurm, ray"
    )
    with pytest.raises(FpbenchError) as e:
        dispatch.validate(Dispatch(jobs=0))
    assert str(e.value) == "--jobs must be at least 1, got 0"
    dispatch.validate(Dispatch(jobs=1))
    monkeypatch.setitem(sys.modules, "ray", None)  # not installed
    with pytest.raises(FpbenchError) as e:
        dispatch.validate(Dispatch(launcher="ray"))
    assert str(e.value) == "--launcher ray needs ray: pip install ray (or fpbench's `ray` extra)"
    monkeypatch.setitem(sys.modules, "submitit", None)
    with pytest.raises(FpbenchError) as e:
        dispatch.validate(Dispatch(launcher="submitit-local"))
    assert str(e.value) == (
        "--launcher submitit-local needs submitit: pip install submitit "
        "(or fpbench's `slurm` extra)"
    )
    monkeypatch.delitem(sys.modules, "submitit")
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch
    with pytest.raises(FpbenchError) as e:
        dispatch.validate(Dispatch(launcher="slurm"))
    assert str(e.value) == (
        "--launcher slurm needs SLURM's sbatch on PATH; use --launcher submitit-local here"
    )
    (tmp_path / "sbatch").write_text("#!/bin/sh\n")
    (tmp_path / "sbatch").chmod(0o755)
    dispatch.validate(Dispatch(launcher="slurm"))
    dispatch.validate(Dispatch(launcher="submitit-local"))


def test_importable_is_false_for_a_missing_module_or_one_without_a_spec(monkeypatch):
    assert dispatch._importable("json")
    assert not dispatch._importable("fpbench_no_such_module")
    assert not dispatch._importable("fpbench_no_such_module.sub")  # its parent is missing
    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # __spec__ None
    assert not dispatch._importable("ray")


def test_pin_threads_gives_deterministic_cells_this_process_thread_count_except_elsewhere(
    monkeypatch,
):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 5)
    base = _cells(1)[0]
    pinned = base.model_copy(update={"runtime": base.runtime.model_copy(update={"threads": 2})})
    loose = base.model_copy(
        update={"runtime": base.runtime.model_copy(update={"deterministic": False})}
    )
    cells = [base, pinned, loose]
    for d in (Dispatch(), Dispatch(launcher="ray"), Dispatch(launcher="submitit-local")):
        out = dispatch.pin_threads(cells, d)
        assert [c.runtime.threads for c in out] == [5, 2, None]
        assert out[0].runtime.model_dump() == {**base.runtime.model_dump(), "threads": 5}
        assert out[1] is pinned and out[2] is loose
    for d in (Dispatch(launcher="slurm"), Dispatch(launcher="ray", address="head:6379")):
        assert dispatch.pin_threads(cells, d) is cells


def test_worker_processes_wait_passively_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with dispatch._passive_omp_waits():
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with dispatch._passive_omp_waits():
        assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@pytest.mark.parametrize("launcher", ["ray", "slurm", "submitit-local", "local"])
def test_run_cells_hands_the_launcher_only_the_cells_not_done_and_keeps_their_order(
    launcher, tmp_path, monkeypatch
):
    from fpbench.engine import ray_tasks, submitit_jobs

    cells = _cells()
    url = f"sqlite:///{tmp_path / 'r.db'}"
    _stored(url, cells[1], "done")
    _stored(url, cells[2], "failed")  # rerun
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setitem(sys.modules, "ray", FakeRay({}))
    monkeypatch.setattr(dispatch.shutil, "which", lambda name: f"/usr/bin/{name}")
    handed = []

    def launcher_named(name):
        def run(todo, url_, ckpt, d, observer):
            env = os.environ.get("OMP_WAIT_POLICY")
            handed.append((name, [c.seed for c in todo], url_, ckpt, d, env))
            assert all(c.runtime.threads == (None if launcher == "slurm" else 3) for c in todo)
            observer.cell_end(CellResult(todo[0], "done"))
            return [CellResult(c, "done") for c in reversed(todo)]

        return run

    monkeypatch.setattr(ray_tasks, "run_ray", launcher_named("ray"))
    monkeypatch.setattr(submitit_jobs, "run_submitit", launcher_named("submitit"))
    monkeypatch.setattr(dispatch, "_pool", launcher_named("pool"))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    d = Dispatch(launcher=launcher, jobs=2)
    obs = Recorder()
    results = dispatch.run_cells(
        cells, url, checkpoint_dir=str(tmp_path / "ck"), dispatch=d, observer=obs
    )
    assert [(r.cfg.seed, r.status) for r in results] == [(0, "done"), (1, "skipped"), (2, "done")]
    threads = None if launcher == "slurm" else 3
    one = cells[1].model_copy(
        update={"runtime": cells[1].runtime.model_copy(update={"threads": threads})}
    )
    assert results[1] == CellResult(one, "skipped", None)
    name = {"ray": "ray", "local": "pool"}.get(launcher, "submitit")
    assert handed == [(name, [0, 2], url, tmp_path / "ck", d, "PASSIVE")]
    assert obs.calls == [("end", 1, "skipped", None), ("end", 0, "done", None)]
    assert "OMP_WAIT_POLICY" not in os.environ


def test_run_cells_starts_no_launcher_when_every_cell_is_done(tmp_path, monkeypatch):
    cells = [
        c.model_copy(update={"runtime": c.runtime.model_copy(update={"threads": 1})})
        for c in _cells(2)
    ]
    url = f"sqlite:///{tmp_path / 'r.db'}"
    for cfg in cells:
        _stored(url, cfg, "done")
    monkeypatch.setattr(dispatch, "_pool", lambda *a: pytest.fail("a pool was started"))
    results = dispatch.run_cells(cells, url, checkpoint_dir=tmp_path, dispatch=Dispatch(jobs=2))
    assert results == [CellResult(c, "skipped", None) for c in cells]


def test_per_cell_databases_are_not_opened_by_the_driver(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path}/cell-{{run_key}}.db"
    assert dispatch._already_done(_cells(), url) == {}
    assert list(tmp_path.iterdir()) == []


def test_failed_cells_are_the_stored_failures_and_no_database_is_made(tmp_path):
    cells = _cells(4)
    url = f"sqlite:///{tmp_path}/cell-{{run_key}}.db"
    for cfg, status in zip(cells[1:], ("failed", "done", "failed"), strict=True):
        _stored(dispatch.cell_url(url, cfg), cfg, status)
    assert dispatch.failed_cells(cells, url) == [cells[1], cells[3]]
    assert not (tmp_path / f"cell-{cells[0].run_key}.db").exists()  # never run: not made
    assert dispatch.failed_cells(cells, "sqlite://") == []  # in memory: nothing stored
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    _stored(shared, cells[2], "failed")
    assert dispatch.failed_cells(cells, shared) == [cells[2]]


# -- dispatch: local ------------------------------------------------------------------------


def test_a_serial_run_shares_one_store_and_cache_or_opens_each_cells_database(
    tmp_path, monkeypatch
):
    cells, obs = _cells(2), Recorder()
    seen = []

    def suite(cells_, store, *, checkpoint_dir, observer, cache):
        seen.append((cells_, str(store.url), checkpoint_dir, observer, cache))
        return ["r"]

    monkeypatch.setattr(dispatch, "run_suite", suite)
    url = f"sqlite:///{tmp_path / 's.db'}"
    d = Dispatch(claim_timeout=9.0)
    assert dispatch._serial(cells, url, tmp_path / "ck", d, obs) == ["r"]
    assert seen == [(cells, url, tmp_path / "ck", obs, runner.worker_cache())]
    ran = []
    monkeypatch.setattr(dispatch, "run_one", lambda *a: ran.append(a) or ("failed", "x"))
    per_cell = f"sqlite:///{tmp_path}/c-{{run_key}}.db"
    out = dispatch._serial(cells, per_cell, tmp_path / "ck", d, obs)
    assert out == [CellResult(c, "failed", "x") for c in cells]
    assert ran == [(c, per_cell, str(tmp_path / "ck"), 9.0, obs) for c in cells]
    assert obs.calls == [("end", 0, "failed", "x"), ("end", 1, "failed", "x")]


def test_run_cells_runs_one_local_job_in_this_process(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(dispatch, "_serial", lambda *a: seen.append(a) or ["r"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    cells = _cells(1)
    assert dispatch.run_cells(cells, "u", checkpoint_dir=str(tmp_path)) == ["r"]
    ((handed, url, ckpt, d, observer),) = seen
    assert [c.runtime.threads for c in handed] == [4]
    assert (url, ckpt, d, type(observer)) == ("u", tmp_path, Dispatch(), Observer)


def test_a_pool_worker_takes_its_threads_queue_and_the_next_gpu(monkeypatch):
    import multiprocessing as mp

    threads, handlers = [], {}
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(dispatch.signal, "signal", handlers.__setitem__)  # not pytest's own
    monkeypatch.setattr(runner, "_worker", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    counter = mp.get_context("fork").Value("i", 0)
    gpus = []
    for _ in range(3):
        dispatch._init_worker("events", 2, ["4", "6"], counter)
        gpus.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert (threads, gpus, counter.value) == ([2, 2, 2], ["4", "6", "4"], 3)
    assert runner._worker == {"events": "events"}
    assert handlers == {signal.SIGINT: dispatch._on_sigint_in_worker}
    dispatch._init_worker("q", 1, [], counter)  # one GPU or none: left as it is
    assert (os.environ["CUDA_VISIBLE_DEVICES"], counter.value) == ("4", 3)


def test_sigint_stops_a_workers_cell_as_ctrl_c_and_an_idle_worker_quietly(monkeypatch):
    seen = []
    monkeypatch.setattr(dispatch, "run_one", lambda *a: seen.append(a) or ("done", None))
    assert dispatch._run_in_worker("cfg", "url") == ("done", None)
    assert (seen, dispatch._busy) == ([("cfg", "url")], False)  # idle again after the cell

    def interrupted(*a):
        assert dispatch._busy  # a cell is running: Ctrl-C reaches it
        dispatch._on_sigint_in_worker(signal.SIGINT, None)

    monkeypatch.setattr(dispatch, "run_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dispatch._run_in_worker("cfg")
    exits = []
    monkeypatch.setattr(dispatch.os, "_exit", exits.append)  # waiting for a cell: nothing to
    dispatch._on_sigint_in_worker(signal.SIGINT, None)  # store, the worker exits at once
    assert exits == [130]


def test_sigint_to_an_idle_pool_worker_exits_it_130_without_a_traceback(capfd):
    """What the driver's SIGTERM sends every worker: one waiting for its next cell (in
    `call_queue.get`) used to print a KeyboardInterrupt traceback (CI, 2026-12-02)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    init = (ctx.Queue(), 1, [], ctx.Value("i", 0))
    pool = ProcessPoolExecutor(1, ctx, initializer=dispatch._init_worker, initargs=init)
    try:
        assert pool.submit(os.getpid).result(timeout=120) > 0  # started, now idle
        (worker,) = pool._processes.values()
        os.kill(worker.pid, signal.SIGINT)
        # the executor's own thread reaps its dead worker too: a join here can race its waitpid
        # (ECHILD, exitcode still None), so wait until the status is recorded by either
        deadline = time.monotonic() + 60
        while worker.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.exitcode == 130
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize(
    ("available", "count", "slots"), [(False, 4, []), (True, 1, []), (True, 2, ["3", "5"])]
)
def test_gpu_slots_only_with_two_gpus_or_more(available, count, slots, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert dispatch._gpu_slots() == slots


class FakeContext:
    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.values: list = []

    def Queue(self):  # noqa: N802  (multiprocessing's name)
        return self.events

    def Value(self, kind, start):  # noqa: N802
        self.values.append((kind, start))
        return ("counter", kind, start)


class FakePool:
    """`ProcessPoolExecutor` as `_pool` uses it: runs `fn` at once and queues a worker's events."""

    made: list = []

    def __init__(self, workers, ctx, *, initializer, initargs) -> None:
        self.args, self.submitted, self.shut = (workers, ctx, initializer, initargs), [], None
        FakePool.made.append(self)

    def submit(self, fn, cfg, *args):
        self.submitted.append((fn, cfg.seed, *args))
        events = self.args[3][0]
        events.put(("start", cfg.run_key, 0, {}))
        events.put(("stage", cfg.run_key, 2, {"what": "frozen", "total": 4}))
        events.put(("round", cfg.run_key, 1, {"acc": 0.5}))
        events.put(("round", "another suite's cell", 1, {}))
        future: Future = Future()
        if cfg.seed == 1:
            future.set_exception(MemoryError("out of memory"))
        else:
            future.set_result(("done", None))
        return future

    def shutdown(self, wait, cancel_futures):
        self.shut = (wait, cancel_futures)


def test_a_pool_runs_each_cell_in_a_worker_and_replays_its_progress(tmp_path, monkeypatch):
    ctx = FakeContext()
    contexts = []
    monkeypatch.setattr(
        dispatch, "mp", types.SimpleNamespace(get_context=lambda m: contexts.append(m) or ctx)
    )
    FakePool.made = []
    monkeypatch.setattr(dispatch, "ProcessPoolExecutor", FakePool)
    monkeypatch.setattr(dispatch, "_gpu_slots", lambda: ["0", "1"])
    monkeypatch.setattr(dispatch.os, "cpu_count", lambda: 8)
    waits = []
    real_wait = dispatch.wait

    def wait(pending, timeout, return_when):
        waits.append((len(pending), timeout, return_when))
        return real_wait(pending, timeout=timeout, return_when=return_when)

    monkeypatch.setattr(dispatch, "wait", wait)
    cells, obs = _cells(), Recorder()
    d = Dispatch(jobs=3, claim_timeout=4.0)
    results = dispatch._pool(cells, "u", tmp_path, d, obs)
    died = "worker process died: MemoryError: out of memory"
    assert results == [
        CellResult(cells[0], "done", None),
        CellResult(cells[1], "failed", died),
        CellResult(cells[2], "done", None),
    ]
    (pool,) = FakePool.made
    assert contexts == ["spawn"] and ctx.values == [("i", 0)]
    assert pool.args == (
        3,
        ctx,
        dispatch._init_worker,
        (ctx.events, 2, ["0", "1"], ("counter", "i", 0)),
    )
    run = dispatch._run_in_worker
    assert pool.submitted == [(run, s, "u", str(tmp_path), 4.0) for s in range(3)]
    assert waits == [(3, 0.25, "FIRST_COMPLETED")]
    assert pool.shut == (True, True)
    progress = [("start", 0), ("stage", "frozen", 2, 4), ("round", 1, {"acc": 0.5})]
    replay = [
        (kind, s, *rest) for s in range(3) for kind, *rest in progress
    ]  # the events of every cell, then the ends
    assert obs.calls[:9] == replay
    assert sorted(obs.calls[9:], key=lambda c: c[1]) == [
        ("end", 0, "done", None),
        ("end", 1, "failed", died),
        ("end", 2, "done", None),
    ]


def test_a_pool_on_a_machine_of_unknown_size_gives_each_worker_one_thread(tmp_path, monkeypatch):
    ctx = FakeContext()
    monkeypatch.setattr(dispatch, "mp", types.SimpleNamespace(get_context=lambda m: ctx))
    FakePool.made = []
    monkeypatch.setattr(dispatch, "ProcessPoolExecutor", FakePool)
    monkeypatch.setattr(dispatch.os, "cpu_count", lambda: None)
    dispatch._pool(_cells(1), "u", tmp_path, Dispatch(jobs=2), Observer())
    assert FakePool.made[0].args[3][1] == 1
