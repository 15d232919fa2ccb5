"""What the CLI says agrees with what it does (issue 48's contradictions), through the real CLI
on small hand-made databases and the tiny suite."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from fpbench.cli import app
from tests.conftest import TINY_SUITE_TOML
from tests.test_workflow import fake_db

runner = CliRunner()
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def one_line(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    return tmp_path


@no_cuda
def test_set_runtime_device_wins_over_the_device_flag(tiny):
    """README: --set applies after everything else, --device included."""
    got = invoke("run", "--suite", "tiny.toml", "--device", "cpu", "--set", "runtime.device=cuda")
    assert got.exit_code == 2, got.output
    assert "device 'cuda' requested but CUDA is not available" in one_line(got.stderr)
    assert not (tiny / "results").exists()  # nothing stored
    kept = invoke("run", "--suite", "tiny.toml", "--dry-run", "--set", "runtime.device=cpu")
    assert kept.exit_code == 0, kept.output  # and a --set alone is what the cells run on


@no_cuda
def test_a_dry_run_checks_the_device_as_the_run_would(tiny):
    got = invoke("run", "--suite", "tiny.toml", "--dry-run", "--device", "cuda")
    assert got.exit_code == 2, got.output
    assert "CUDA is not available; use --device cpu" in one_line(got.stderr)
    bad = invoke("run", "--suite", "tiny.toml", "--dry-run", "--device", "tpu")
    assert bad.exit_code == 2 and "invalid device 'tpu'" in one_line(bad.stderr)


def test_runs_and_export_refuse_an_unknown_status(tmp_path):
    db = str(tmp_path / "s.db")
    fake_db(tmp_path / "s.db", {("a", 0): [0.5]})
    for command in (["runs"], ["export", str(tmp_path / "out")]):
        got = invoke(*command, "--status", "bogus", "--db", db)
        assert got.exit_code == 2, got.output
        assert one_line(got.stderr) == (
            "error: --status 'bogus' is no run status; valid: pending, running, done, failed, "
            "interrupted, stale"
        )
    assert invoke("runs", "--status", "done", "--db", db).exit_code == 0


def test_compare_counts_the_seeds_it_pairs(tmp_path):
    values = {(m, s): [0.1 * (s + 1) + (0.2 if m == "b" else 0.0)] for m in "ab" for s in (3, 5, 7)}
    db = fake_db(tmp_path / "s.db", values)
    got = invoke("compare", "a", "b", "--suite", "s", "--db", db.removeprefix("sqlite:///"))
    assert got.exit_code == 0, got.output
    row = next(line.strip() for line in got.stdout.splitlines() if "  global  " in line)
    assert row.split()[:5] == ["d", "/", "p", "global", "3"]  # how many seeds, not the ids
    assert "seeds paired" in got.stdout and "3: +20.00, 5: +20.00, 7: +20.00" in got.stdout


def test_table_ci_with_one_seed_says_there_is_no_interval(tmp_path):
    db = str(tmp_path / "s.db")
    fake_db(tmp_path / "s.db", {("a", 0): [0.5], ("b", 0): [0.6]})
    got = invoke("table", "--suite", "s", "--ci", "--format", "term", "--db", db)
    assert got.exit_code == 0, got.output
    assert "suite s: mean ± std over seeds" in got.stdout and "t-interval" not in got.stdout
    assert one_line(got.stderr).startswith(
        "--ci: every cell has one seed, so no confidence interval (it needs two)"
    )
    two = str(tmp_path / "two.db")
    fake_db(tmp_path / "two.db", {("a", 0): [0.5], ("a", 1): [0.7]})
    got = invoke("table", "--suite", "s", "--ci", "--format", "term", "--db", two)
    assert "[95% t-interval]" in got.stdout and "--ci:" not in got.stderr


def test_plot_comm_refuses_a_target_above_100_percent(tmp_path):
    db = str(tmp_path / "s.db")
    fake_db(tmp_path / "s.db", {("a", 0): [0.5, 0.6]})
    png = str(tmp_path / "c.png")
    got = invoke("plot", "comm", "--suite", "s", "--out", png, "--target", "150", "--db", db)
    assert got.exit_code == 2, got.output
    assert "--target 150: an accuracy target is a percent in (0, 100]" in one_line(got.stderr)
    for target in ("55", "0.55"):  # both mean 55%: run 1 reaches it at its second round
        got = invoke("plot", "comm", "--suite", "s", "--out", png, "--target", target, "--db", db)
        assert got.exit_code == 0 and "to reach 55.00%" in got.stdout, got.output


def test_merging_a_database_into_itself_names_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fake_db(tmp_path / "m2.db", {("a", 0): [0.5]})
    for same in ("m2.db", "./m2.db", str(tmp_path / "m2.db")):
        got = invoke("db", "merge", "m2.db", same)
        assert got.exit_code == 2, got.output
        said = one_line(got.stderr)
        assert said == f"error: cannot merge {same} into itself (it is OUT); name another output"
        assert "Store(" not in said
