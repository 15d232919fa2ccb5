"""Plain per-round lines off a terminal, and the end-of-run summary with the next commands."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from types import SimpleNamespace

from typer.testing import CliRunner

from fpbench import stages
from fpbench.cli import app
from fpbench.cli.run_log import LineObserver, clock, headline
from fpbench.cli.summary import next_commands
from fpbench.engine import runner
from tests.conftest import TINY_SUITE_TOML

STAMP = r"\d\d:\d\d:\d\d "


def _cfg(rounds: int = 10) -> SimpleNamespace:
    return SimpleNamespace(
        run_key="k1",
        seed=0,
        method=SimpleNamespace(label="fedvpt"),
        dataset=SimpleNamespace(label="cifar100"),
        partition=SimpleNamespace(label="s=10"),
        train=SimpleNamespace(rounds=rounds),
    )


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_clock_and_headline():
    assert clock(0) == "0:00" and clock(75.4) == "1:15" and clock(3725) == "1:02:05"
    metrics = {"acc_global": 0.2189, "acc_local_mean": 0.5, "acc_local_worst": 0.0514}
    assert headline(metrics | {"loss_train": 1.23456}) == (
        "global 21.89%  local-mean 50.00%  worst 5.14%  loss 1.235"
    )


def test_rounds_cells_and_eta():
    out, now = io.StringIO(), Clock()
    log = LineObserver(out, total_cells=3, now=now)
    cfg = _cfg(rounds=10)
    log.stage(cfg, "preparing data", 0, 1)
    now.t += 5  # setup: in the cell's wall time, not in the rounds' ETA
    log.stage(cfg, "preparing data", 1, 1)
    log.cell_start(cfg, 2)  # resumed: rounds 3.. run here
    now.t += 30
    log.round_end(cfg, 3, {})  # not evaluated: no line
    log.round_end(cfg, 4, {"acc_global": 0.25, "acc_local_worst": 0.1, "loss_train": 2.0})
    now.t += 10
    log.cell_end(SimpleNamespace(cfg=cfg, status="done", error=None))
    lines = out.getvalue().splitlines()[2:]
    assert len(lines) == 3 and all(re.match(STAMP, line) for line in lines)
    assert lines[0].endswith(
        "start  fedvpt / cifar100 / s=10 / seed 0 (10 rounds, resuming after round 2/10)"
    )
    # 3 rounds (2, 3, 4) in 30 s: 10 s a round, 5 rounds to go
    assert lines[1][9:] == (
        "round 5/10  fedvpt / cifar100 / s=10 / seed 0  global 25.00%  worst 10.00%  "
        "loss 2  elapsed 0:30  ETA 0:50"
    )
    assert lines[2][9:] == (
        "end    [1/3] fedvpt / cifar100 / s=10 / seed 0  done in 0:45  global 25.00%  "
        "worst 10.00%  loss 2"
    )


def test_skipped_and_failed_cells_say_why():
    out = io.StringIO()
    log = LineObserver(out, total_cells=2, now=Clock())
    log.cell_end(SimpleNamespace(cfg=_cfg(), status="skipped", error=None))
    log.cell_end(SimpleNamespace(cfg=_cfg(), status="failed", error="NonFiniteLoss: nan"))
    lines = [line[9:] for line in out.getvalue().splitlines()]
    assert lines == [
        "end    [1/2] fedvpt / cifar100 / s=10 / seed 0  skipped (already done)",
        "end    [2/2] fedvpt / cifar100 / s=10 / seed 0  failed: NonFiniteLoss: nan",
    ]


def test_stage_progress_is_throttled():
    out, now = io.StringIO(), Clock()
    log = LineObserver(out, total_cells=1, every_s=10, now=now)
    with stages.reporting(lambda what, done, total: log.stage(_cfg(), what, done, total)):
        stages.report("frozen cls features (train split)", 0, 300)
        for done in (100, 200):  # 4 and 8 s after the last line: within 10 s, dropped
            now.t += 4
            stages.report("frozen cls features (train split)", done, 300)
        now.t += 20
        stages.report("frozen cls features (train split)", 250, 300)
        stages.report("frozen cls features (train split)", 300, 300)
    stages.report("outside", 0, 1)  # nobody listens: nothing happens
    states = [line[9:].split("  ")[0] for line in out.getvalue().splitlines()]
    assert states == [
        "frozen cls features (train split): started",
        "frozen cls features (train split): 250/300",
        "frozen cls features (train split): 300/300 done",
    ]


def test_next_commands_name_the_suite_and_db():
    assert next_commands("smoke", "results/x.db") == [
        "fpbench table --suite smoke --db results/x.db",
        "fpbench plot tradeoff --suite smoke --db results/x.db --out results/smoke-tradeoff.png",
        "fpbench report --suite smoke --db results/x.db --out results/smoke-report",
        "fpbench runs --suite smoke --db results/x.db",
    ]
    assert (
        next_commands("my dir/s.toml", "a.db")[0]
        == "fpbench table --suite 'my dir/s.toml' --db a.db"
    )


def _tiny(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "tiny.toml").write_text(TINY_SUITE_TOML)


def test_piped_run_prints_rounds_summary_and_next_commands(tmp_path, monkeypatch):
    """CliRunner's stdout is no terminal: plain lines, then the table and the next commands."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runner, "_worker", {})  # no frozen features kept from earlier tests
    _tiny(tmp_path)
    result = CliRunner().invoke(app, ["run", "--suite", "tiny", "--db", "r.db"])
    assert result.exit_code == 0, result.output
    out = result.output
    for method in ("head-tune", "fedvpt"):
        cell = f"{method} / synthetic / pathological / seed 0"
        assert re.search(STAMP + f"start  {re.escape(cell)} \\(2 rounds\\)", out)
        for i in (1, 2):
            assert re.search(
                STAMP + f"round {i}/2  {re.escape(cell)}  global \\d+\\.\\d\\d%  local-mean "
                r"\d+\.\d\d%  worst \d+\.\d\d%  loss \S+  elapsed \d:\d\d  ETA \d:\d\d",
                out,
            )
        assert re.search(STAMP + r"end    \[\d/2\] " + re.escape(cell) + "  done in", out)
    assert "frozen cls (train): started" in out
    assert "preparing data: done" in out
    table = CliRunner().invoke(app, ["table", "--suite", "tiny", "--db", "r.db"])
    assert table.stdout.strip() in out  # the same table as `fpbench table --suite`
    assert "next:\n  fpbench table --suite tiny --db r.db\n" in out
    assert "fpbench report --suite tiny --db r.db --out results/tiny-report" in out


def test_run_piped_to_a_file_in_a_subprocess(tmp_path):
    _tiny(tmp_path)
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        subprocess.run(
            [sys.executable, "-m", "fpbench", "run", "--suite", "tiny", "--method", "fedvpt"],
            cwd=tmp_path,
            stdout=f,
            stderr=subprocess.STDOUT,
            check=True,
        )
    text = log.read_text()
    assert re.search(STAMP + r"round 2/2  fedvpt / synthetic / pathological / seed 0  global", text)
    assert "suite tiny: 1 cell ran, 0 already done, 0 failed" in text
    assert "fpbench table --suite tiny --db results/fpbench.db" in text


def test_terminal_bars_for_frozen_passes_come_and_go():
    from rich.progress import Progress

    from fpbench.cli.run import _ProgressObserver

    with Progress(disable=True) as progress:
        bars = _ProgressObserver(progress, total_cells=1)
        bars.stage(_cfg(), "frozen cls features (train split)", 0, 300)
        (task,) = [t for t in progress.tasks if "frozen" in t.description]
        bars.stage(_cfg(), "frozen cls features (train split)", 120, 300)
        assert (task.completed, task.total) == (120, 300)
        bars.stage(_cfg(), "frozen cls features (train split)", 300, 300)
        assert [t.description for t in progress.tasks] == ["cells"]
