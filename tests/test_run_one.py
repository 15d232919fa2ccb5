"""The task every launcher runs for one cell (`fpbench.engine.runner.run_one`), checked directly:
what `run_one` hands `run_cell` and returns, what the driver's `finish` does with it, the
events a worker sends, its shared feature cache, and the GPUs a process sees. `run_cell` is
replaced by a recorder, so no cell trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fpbench.engine import runner
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.launch import Dispatch, visible_gpus
from fpbench.engine.observer import CellResult, Observer
from fpbench.engine.runner import cell_url, finish, run_one, set_worker_events, worker_cache
from fpbench.errors import FpbenchError
from tests.conftest import tiny_config


class _Events:
    """A queue's `put`, recorded."""

    def __init__(self) -> None:
        self.got: list[tuple] = []

    def put(self, event: tuple) -> None:
        self.got.append(event)


class _Ends(Observer):
    def __init__(self) -> None:
        self.ended: list[CellResult] = []

    def cell_end(self, result: CellResult) -> None:
        self.ended.append(result)


@pytest.fixture
def worker(monkeypatch):
    """A fresh per-process state (no events queue, no cache), as in a new worker."""
    state: dict = {}
    monkeypatch.setattr(runner, "_worker", state)
    return state


@pytest.fixture
def calls(monkeypatch):
    """`run_cell` replaced: records its arguments (and the store's URL) and returns `done`."""
    seen: list[dict] = []

    def fake(cfg, store, **kwargs):
        seen.append({"cfg": cfg, "url": store.url, **kwargs})
        return CellResult(cfg, "done", None)

    monkeypatch.setattr(runner, "run_cell", fake)
    return seen


def test_dispatch_defaults_run_one_local_cell_at_a_time():
    d = Dispatch()
    assert (d.launcher, d.jobs, d.folder, d.address) == ("local", 1, Path("results/jobs"), None)
    assert (d.gpus_per_cell, d.cpus_per_cell, d.timeout_min) == (0.0, 1, 1440)
    assert (d.slurm_partition, d.claim_timeout) == (None, 600.0)


def test_cell_url_fills_the_run_key_placeholder():
    cfg = tiny_config()
    assert cell_url("sqlite:///out/{run_key}.db", cfg) == f"sqlite:///out/{cfg.run_key}.db"
    assert cell_url("sqlite:///out/all.db", cfg) == "sqlite:///out/all.db"


def test_run_one_hands_run_cell_the_cells_database_folder_cache_and_claim_timeout(
    worker, calls, tmp_path
):
    cfg = tiny_config()
    url = f"sqlite:///{tmp_path}/{{run_key}}.db"
    observer = Observer()
    assert run_one(cfg, url, str(tmp_path / "ck"), 12.5, observer) == ("done", None)
    (call,) = calls
    assert call["cfg"] is cfg and call["url"] == f"sqlite:///{tmp_path}/{cfg.run_key}.db"
    assert call["checkpoint_dir"] == tmp_path / "ck" and isinstance(call["checkpoint_dir"], Path)
    assert call["observer"] is observer and call["claim_timeout"] == 12.5
    assert isinstance(call["cache"], FeatureCache) and call["cache"] is worker["cache"]
    run_one(cfg, url, str(tmp_path / "ck"))  # the next cell of this process: the same cache
    assert calls[1]["cache"] is call["cache"] and calls[1]["claim_timeout"] == 600.0


def test_run_one_without_an_observer_sends_a_workers_progress_to_its_queue(worker, calls, tmp_path):
    cfg = tiny_config()
    url = f"sqlite:///{tmp_path}/r.db"
    run_one(cfg, url, str(tmp_path))
    assert type(calls[0]["observer"]) is Observer  # no queue: progress goes nowhere
    events = _Events()
    set_worker_events(events)
    assert worker["events"] is events
    run_one(cfg, url, str(tmp_path))
    sent = calls[1]["observer"]
    assert isinstance(sent, runner._QueueObserver) and sent.events is events


def test_the_queue_observer_sends_start_round_and_stage_events_of_its_cell():
    cfg, events = tiny_config(), _Events()
    obs = runner._QueueObserver(events)
    obs.cell_start(cfg, 3)
    obs.round_end(cfg, 4, {"acc": 0.5})
    obs.stage(cfg, "frozen cls (train)", 7, 9)
    obs.stage(None, "suite-wide data", 1, 2)  # no cell: nothing to send
    assert events.got == [
        ("start", cfg.run_key, 3, {}),
        ("round", cfg.run_key, 4, {"acc": 0.5}),
        ("stage", cfg.run_key, 7, {"what": "frozen cls (train)", "total": 9}),
    ]


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (FpbenchError("bad method arg"), ("error", "bad method arg")),
        (ValueError("nan loss"), ("failed", "ValueError: nan loss")),
    ],
)
def test_run_one_returns_a_cells_error_instead_of_raising(
    worker, monkeypatch, tmp_path, error, outcome
):
    def fail(*args, **kwargs):
        raise error

    monkeypatch.setattr(runner, "run_cell", fail)
    assert run_one(tiny_config(), f"sqlite:///{tmp_path}/r.db", str(tmp_path)) == outcome


def test_run_one_returns_a_skipped_cells_status_and_message(worker, monkeypatch, tmp_path):
    cfg = tiny_config()
    monkeypatch.setattr(
        runner, "run_cell", lambda cfg, store, **kw: CellResult(cfg, "skipped", "claimed")
    )
    assert run_one(cfg, f"sqlite:///{tmp_path}/r.db", str(tmp_path)) == ("skipped", "claimed")


def test_finish_reports_a_cell_and_stops_at_a_user_error():
    cfg, observer = tiny_config(), _Ends()
    result = finish(cfg, ("failed", "ValueError: nan loss"), observer)
    assert result == CellResult(cfg, "failed", "ValueError: nan loss")
    assert observer.ended == [result]
    assert finish(cfg, ("done", None), observer) == CellResult(cfg, "done", None)
    with pytest.raises(FpbenchError, match="^bad method arg$"):
        finish(cfg, ("error", "bad method arg"), observer)
    with pytest.raises(FpbenchError, match="^a cell failed with a user error$"):
        finish(cfg, ("error", None), observer)
    assert len(observer.ended) == 2  # a user error is raised, not reported as a cell's end


def test_worker_cache_is_one_per_process(worker):
    cache = worker_cache()
    assert isinstance(cache, FeatureCache) and worker == {"cache": cache}
    assert worker_cache() is cache


def test_visible_gpus_are_cuda_visible_devices_else_every_card(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert visible_gpus() == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 2, 5,,")
    assert visible_gpus() == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
