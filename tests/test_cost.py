"""What a run costs: its peak memory and the FLOPs of a round, stored with it and shown."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine import cost, runner
from fpbench.engine.cell import sampling_schedule
from fpbench.engine.cost import PeakMemory, count_flops, uncounted
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.runner import run_cell
from fpbench.engine.task import build_task
from fpbench.store import ClaimLost, Store
from fpbench.testing.tiny import cell_of
from fpbench.units import human_bytes, human_flops
from tests.conftest import tiny_config

VERSIONS = {"fpbench_version": "0", "torch_version": "0", "device": "cpu"}
MiB = 2**20


def test_flops_of_products_are_counted_and_frozen_work_left_out() -> None:
    x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
    with count_flops() as flops:
        x @ w.T  # 2 * 8 * 64 * 32
        with uncounted():
            x @ w.T  # a frozen pass: not counted
        torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")  # oneDNN's linear too
        x + 1  # elementwise: not counted
    assert flops.total == 2 * (2 * 8 * 64 * 32)
    with uncounted():  # harmless outside a count
        x @ w.T


def _reference(method: str, **train):
    cfg = tiny_config(method, **train)
    return cfg.model_copy(
        update={"runtime": cfg.runtime.model_copy(update={"executor": "reference"})}
    )


def test_a_run_stores_the_flops_of_its_first_round_by_hand(tmp_path) -> None:
    """head-tune trains a linear head (d -> C) on cached features: per train sample a forward
    (2dC) and a weight gradient (2dC); FedAvg of K clients' (C x d + C) parameters; evaluation
    passes the test split through the global head once (2dC a sample)."""
    cfg = _reference("head-tune", rounds=2)
    task = build_task(cfg, torch.device("cpu"))
    d, c, m = 32, task.data.num_classes, len(task.data.test_labels)  # vit-test: width 32
    clients = sampling_schedule(cfg.seed, 2, task.trainable_clients(), 0.75)[0]
    n = sum(len(task.train_idx[k]) for k in clients)
    expected = n * 4 * d * c + 2 * len(clients) * (c * d + c) + m * 2 * d * c
    for name in ("cold", "warm"):  # the frozen cls features of the cold run are not counted
        store = Store(f"sqlite:///{tmp_path}/{name}.db")
        assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
        assert store.find_run(cfg.run_key).round_flops == expected


def test_only_the_first_round_is_counted_and_kept(tmp_path, monkeypatch) -> None:
    cfg = tiny_config("fedvpt", rounds=2)
    store = Store(f"sqlite:///{tmp_path}/r.db")
    counted = []
    real = cost.count_flops

    def spy():
        counted.append(1)
        return real()

    monkeypatch.setattr("fpbench.engine.rounds.count_flops", spy)
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    first = store.find_run(cfg.run_key).round_flops
    assert counted == [1] and first > 0  # one round counted, not both
    run = store.find_run(cfg.run_key)
    store.record_cost(run.id, round_flops=1)  # kept once stored
    assert store.find_run(cfg.run_key).round_flops == first


def test_peak_memory_on_the_cpu_starts_anew_with_each_cell() -> None:
    first = PeakMemory(torch.device("cpu"))
    first.start()
    big = torch.ones(256 * MiB // 4)  # 256 MiB, written
    high = first.read()
    del big
    second = PeakMemory(torch.device("cpu"))
    second.start()
    assert first.source == second.source == "vmhwm"  # Linux: the high-water mark is reset
    assert high - second.read() > 200 * MiB


def _fixed_peak(monkeypatch, value: int) -> None:
    monkeypatch.setattr(runner.PeakMemory, "read", lambda self: value)


def test_a_run_stores_its_peak_memory_done_or_failed(tmp_path, monkeypatch) -> None:
    _fixed_peak(monkeypatch, 123_456_789)
    cfg = tiny_config("fedvpt", rounds=1)
    store = Store(f"sqlite:///{tmp_path}/r.db")
    assert run_cell(cfg, store, checkpoint_dir=tmp_path).status == "done"
    assert store.find_run(cfg.run_key).peak_mem_bytes == 123_456_789

    def crash(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr("fpbench.engine.rounds.play_round", crash)
    other = tiny_config("fedvpt", rounds=2)
    with pytest.raises(RuntimeError, match="out of memory"):
        run_cell(other, store, checkpoint_dir=tmp_path)
    failed = store.find_run(other.run_key)
    assert failed.status == "failed" and failed.peak_mem_bytes == 123_456_789


def test_record_cost_keeps_the_largest_peak_and_the_first_flops(tmp_path) -> None:
    store = Store(f"sqlite:///{tmp_path}/r.db")
    run = store.create_run(
        run_key="k" * 16, suite="s", method="m", dataset="d", partition="p", seed=0, config={},
        **VERSIONS,
    )  # fmt: skip
    assert (run.peak_mem_bytes, run.round_flops) == (None, None)
    store.record_cost(run.id, peak_mem_bytes=100, round_flops=7)
    store.record_cost(run.id, peak_mem_bytes=50, round_flops=9)  # a resumed session
    store.record_cost(run.id, peak_mem_bytes=300)
    got = store.get_run(run.id)
    assert (got.peak_mem_bytes, got.round_flops) == (300, 7)
    with pytest.raises(ClaimLost):
        store.record_cost(run.id, peak_mem_bytes=1, owner="not the owner")
    frame = store.runs()
    assert frame.loc[0, "peak_mem_bytes"] == 300 and frame.loc[0, "round_flops"] == 7


def test_an_older_database_gets_the_cost_columns(tmp_path) -> None:
    db = tmp_path / "old.db"
    with Store(f"sqlite:///{db}") as store:
        store.create_run(
            run_key="k" * 16, suite="s", method="m", dataset="d", partition="p", seed=0,
            config={}, **VERSIONS,
        )  # fmt: skip
    with sqlite3.connect(db) as con:
        for column in ("peak_mem_bytes", "round_flops"):
            con.execute(f"ALTER TABLE runs DROP COLUMN {column}")
    with Store(f"sqlite:///{db}") as store:
        run = store.find_run("k" * 16)
        assert (run.peak_mem_bytes, run.round_flops) == (None, None)
        store.record_cost(run.id, peak_mem_bytes=5, round_flops=6)
        assert store.find_run("k" * 16).round_flops == 6


def test_merge_carries_the_cost(tmp_path) -> None:
    from fpbench.store.merge import merge_into

    src = Store(f"sqlite:///{tmp_path}/a.db")
    run = src.create_run(
        run_key="k" * 16, suite="s", method="m", dataset="d", partition="p", seed=0, config={},
        **VERSIONS,
    )  # fmt: skip
    src.record_cost(run.id, peak_mem_bytes=2**33, round_flops=3 * 10**15)
    out = Store(f"sqlite:///{tmp_path}/b.db")
    merge_into(out, src)
    got = out.find_run("k" * 16)
    assert (got.peak_mem_bytes, got.round_flops) == (2**33, 3 * 10**15)


def test_units_for_people() -> None:
    assert human_bytes(None) == "-" and human_bytes(1000) == "1,000 B"
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(3 * 2**30) == "3.00 GiB"
    assert human_bytes(2**41) == "2.00 TiB"
    assert human_flops(None) == "-" and human_flops(2.5e12) == "2.50 TFLOP"
    assert human_flops(999) == "999 FLOP" and human_flops(4e15) == "4.00 PFLOP"


def _stored_run(tmp_path: Path) -> Path:
    db = tmp_path / "results.db"
    with Store(f"sqlite:///{db}") as store:
        run = store.create_run(
            run_key="c" * 16, suite="tiny", method="m", dataset="d", partition="p", seed=0,
            config={}, **VERSIONS,
        )  # fmt: skip
        store.write_round(
            run.id, 0, loss_train=1.0, wall_s=1.0, bytes_up=1, bytes_down=1,
            metrics=[(None, "acc_global", 0.5, None)],
        )  # fmt: skip
        store.record_cost(run.id, peak_mem_bytes=3 * 2**30 // 2, round_flops=2_500_000_000_000)
    return db


def test_show_prints_the_cost(tmp_path) -> None:
    db = _stored_run(tmp_path)
    result = CliRunner().invoke(app, ["show", "1", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "peak memory=1.50 GiB FLOPs of a round=2.50 TFLOP" in result.output


def test_the_html_report_lists_each_run_s_cost(tmp_path) -> None:
    from fpbench.report.html import _runs_table, build_report

    db = _stored_run(tmp_path)
    with Store(f"sqlite:///{db}") as store:
        page = build_report(store.metrics(suite="tiny"), store.runs("tiny"), "tiny").html
    assert "<th>peak memory</th>" in page and "<th>FLOPs / round</th>" in page
    assert "<td>1.50 GiB</td>" in page and "<td>2.50 TFLOP</td>" in page
    frame = pd.DataFrame({"id": [1], "peak_mem_bytes": [None], "round_flops": [None]})
    assert "<td></td>" in _runs_table(frame)  # not measured: blank


def test_estimate_reports_the_peak_memory_it_expects(tmp_path, monkeypatch) -> None:
    from tests.conftest import TINY_SUITE_TOML

    monkeypatch.setattr(PeakMemory, "read", lambda self: 3 * 2**30)
    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE_TOML)
    args = ["estimate", "--suite", str(suite), "--device", "cpu", "--rounds", "1"]
    result = CliRunner().invoke(app, [*args, "--max-shapes", "1"])
    assert result.exit_code == 0, result.output
    assert "┃ peak mem ┃" in result.output
    assert "\npeak memory of a cell: 3.00 GiB\n" in result.output


def test_estimate_measures_peak_memory_over_its_fake_data(tmp_path) -> None:
    from fpbench.measure.estimate import estimate
    from fpbench.suites import load_suite
    from tests.conftest import TINY_SUITE_TOML

    suite = tmp_path / "tiny.toml"
    suite.write_text(TINY_SUITE_TOML)
    before = _rss()
    (found, *_) = estimate(load_suite(str(suite)), torch.device("cpu"), rounds=1, max_shapes=1)
    # the high-water mark from the measurement's start: at least the RSS then, at most the mark
    # now (nothing reset it since)
    assert 0.9 * before <= found.measured.peak_mem_bytes <= cost._vmhwm()


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_counting_changes_no_stored_value(tmp_path, monkeypatch) -> None:
    """Round 0 under the FLOP counter stores what it stores without it, bit for bit."""
    from contextlib import contextmanager

    cfg = tiny_config("sgpt", rounds=1)

    def stored(name: str) -> list:
        db = tmp_path / f"{name}.db"
        with Store(f"sqlite:///{db}") as store:
            assert run_cell(cfg, store, checkpoint_dir=tmp_path / name).status == "done"
        with sqlite3.connect(db) as con:
            return con.execute(
                "SELECT round, client_id, name, value FROM metrics ORDER BY round, client_id, name"
            ).fetchall()

    counted = stored("counted")

    @contextmanager
    def nothing():
        yield None

    monkeypatch.setattr("fpbench.engine.rounds.count_flops", nothing)
    assert stored("plain") == counted


def test_the_count_equals_pytorch_s_flop_counter_on_a_round(tiny) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from fpbench.engine.build import build_populations
    from fpbench.engine.rounds import play_round
    from fpbench.engine.runner import cell_numerics

    cfg, task, _ = tiny("sgpt")
    with cell_numerics(cfg):
        pops = build_populations(cfg, task, torch.device("cpu"), FeatureCache())
        server = pops[0].method.init_server(torch.Generator().manual_seed(0))
        ids = task.trainable_clients()
        play_round(cell_of(cfg, task, pops, ids), server, 0, [])  # the frozen passes, first
        with count_flops() as ours:
            play_round(cell_of(cfg, task, pops, ids), server, 1, [])
        with FlopCounterMode(display=False) as theirs:
            play_round(cell_of(cfg, task, pops, ids), server, 1, [])
    assert ours.total == theirs.get_total_flops() > 0
