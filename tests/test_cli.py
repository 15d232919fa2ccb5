"""End to end through the real CLI on a tiny suite (synthetic data, test-sized ViT)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.suites import SUITE_DIR
from tests.conftest import TINY_SUITE_TOML

SUITE = TINY_SUITE_TOML

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def counts(db: Path) -> tuple[int, int, int]:
    with sqlite3.connect(db) as con:
        return tuple(
            con.execute(f"select count(*) from {t}").fetchone()[0]
            for t in ("runs", "rounds", "metrics")
        )


@pytest.fixture
def ran(workdir):
    result = invoke("run", "--suite", "tiny")
    assert result.exit_code == 0, result.output
    return workdir


def test_run_fills_database_and_second_run_adds_nothing(ran):
    db = ran / "results" / "fpbench.db"
    runs, rounds, metrics = counts(db)
    assert (runs, rounds) == (2, 4) and metrics > 0
    with sqlite3.connect(db) as con:
        assert {r[0] for r in con.execute("select status from runs")} == {"done"}
        names = {r[0] for r in con.execute("select name from metrics where client_id is null")}
        per_client = con.execute("select count(*) from metrics where client_id is not null")
        assert per_client.fetchone()[0] > 0
    assert {"acc_global", "acc_local_worst", "acc_pooled", "acc_global_last10"} <= names
    again = invoke("run", "--suite", "tiny")
    assert again.exit_code == 0 and "2 already done" in again.output
    assert counts(db) == (runs, rounds, metrics)


def test_dry_run_lists_cells_and_status(ran):
    result = invoke("run", "--suite", "tiny", "--dry-run", "--method", "fedvpt")
    assert result.exit_code == 0
    assert "fedvpt" in result.output and "done" in result.output
    assert "head-tune" not in result.output
    assert "built-in" in result.output  # the data column: synthetic needs no files


def test_dry_run_says_which_data_is_missing(workdir, monkeypatch):
    monkeypatch.setenv("FPBENCH_DATA", str(workdir / "no-data"))
    suite = workdir / "cifar.toml"
    cifar = SUITE.replace('name = "synthetic"', 'name = "cifar10"').replace("s = 3", "s = 5")
    suite.write_text("\n".join(x for x in cifar.splitlines() if not x.startswith("dataset =")))
    result = invoke("run", "--suite", str(suite), "--dry-run")
    assert result.exit_code == 0, result.output
    assert "missing" in result.output and "fpbench data status" in result.output


@pytest.mark.parametrize("name", sorted(p.stem for p in SUITE_DIR.glob("*.toml")))
def test_every_shipped_suite_validates_and_dry_runs(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FPBENCH_DATA", str(tmp_path / "no-data"))
    result = invoke("run", "--suite", name, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "new" in result.output and not (tmp_path / "results").exists()


def test_dry_run_writes_nothing(workdir):
    assert invoke("run", "--suite", "tiny", "--dry-run").exit_code == 0
    assert not (workdir / "results").exists()


@pytest.mark.parametrize(
    "fmt, needle", [("md", "| fedvpt"), ("csv", "fedvpt,"), ("latex", "\\toprule")]
)
def test_table_formats(ran, fmt, needle):
    result = invoke("table", "--suite", "tiny", "--format", fmt)
    assert result.exit_code == 0, result.output
    assert needle in result.output and "head-tune" in result.output


def test_plots_write_pngs(ran):
    for args in (["tradeoff"], ["curves", "--metric", "acc_local_mean"]):
        out = ran / f"{args[0]}.png"
        result = invoke("plot", *args, "--suite", "tiny", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert out.read_bytes()[:4] == b"\x89PNG"


def test_show_and_list(ran):
    shown = invoke("show", "1")
    assert shown.exit_code == 0 and "status=done" in shown.output and "acc_global" in shown.output
    for what, needle in [
        ("methods", "VPT-shallow prompts"),
        ("datasets", "synthetic"),
        ("partitions", "dirichlet"),
        ("backbones", "vit-smoke"),
        ("suites", "tiny"),
    ]:
        result = invoke("list", what)
        assert result.exit_code == 0 and needle in result.output


BAD_SUITES = {
    "unknown method": ('name = "fedvtp"', "unknown method 'fedvtp'"),
    "unknown dataset arg": ('name = "synthetic"\nx = 1', "dataset.x"),
    "unknown dataset": ('name = "cifar1000"', "unknown dataset 'cifar1000'"),
    "impossible s": ("s = 3", "s = 30", "larger than"),
    "participation": ("participation = 0.75", "participation = 1.5", "train.participation"),
    "rounds": ("rounds = 2", "rounds = 0", "train.rounds"),
    "unknown backbone": ('"vit-test"', '"vit-nope"', "unknown backbone"),
    "malformed": ("[[datasets]]", "[[datasets]", "line"),
}


@pytest.mark.parametrize("case", sorted(BAD_SUITES))
def test_bad_suites_exit_2_with_one_line_and_write_nothing(workdir, case):
    spec = BAD_SUITES[case]
    if len(spec) == 2:
        text = (
            SUITE.replace('name = "fedvpt"', spec[0], 1)
            if "method" in case
            else SUITE.replace('name = "synthetic"', spec[0], 1)
        )
        needle = spec[1]
    else:
        text, needle = SUITE.replace(spec[0], spec[1], 1), spec[2]
    (workdir / "bad.toml").write_text(text)
    result = invoke("run", "--suite", str(workdir / "bad.toml"))
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert not (workdir / "results").exists()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--suite", "nope"], "unknown suite 'nope'"),
        (["run", "--suite", "tiny", "--method", "sgpt"], "not in suite tiny"),
        (["run", "--suite", "tiny", "--db", "nosuchdialect://x"], "cannot open results database"),
        (["table", "--suite", "tiny"], "no results database"),
    ],
)
def test_bad_arguments_exit_2(workdir, args, needle):
    result = invoke(*args)
    assert result.exit_code == 2 and needle in result.output
    assert not (workdir / "results").exists()


def test_console_script_reports_errors_without_traceback(workdir):
    proc = subprocess.run(
        [sys.executable, "-m", "fpbench", "run", "--suite", "nope"],
        capture_output=True,
        text=True,
        cwd=workdir,
    )
    assert proc.returncode == 2
    assert "unknown suite" in proc.stderr and "Traceback" not in proc.stderr
    first, *rest = proc.stderr.strip().splitlines()  # one message, wrapped to 80 columns
    assert first.startswith("error: unknown suite 'nope'. Valid: ")
    assert all(line.startswith("  ") and len(line) <= 80 for line in [first, *rest][1:])
    assert len(first) <= 80


def test_list_filters_by_pattern_and_lists_presets(monkeypatch):
    from fpbench.methods.sgpt import SGPT_PRESETS

    monkeypatch.setenv("COLUMNS", "250")  # one table row per line
    sgpt = invoke("list", "methods", "sgpt*")
    assert sgpt.exit_code == 0, sgpt.output
    names = [line.split("│")[1].strip() for line in sgpt.output.splitlines() if "│" in line]
    assert names == ["sgpt", *(f"sgpt preset={p}" for p in SGPT_PRESETS)]
    office = next(line for line in sgpt.output.splitlines() if "sgpt preset=office " in line)
    assert "num_groups=4" in office and "query_layer=5" in office
    every = invoke("list", "methods", "--presets")
    assert every.exit_code == 0
    assert "fgpt preset=" in every.output and "pep-fedpt preset=" in every.output
    plain = invoke("list", "methods")
    assert "preset=" not in plain.output and "fedvpt-d" in plain.output
    for args, needle in [
        (("datasets", "--presets"), "--presets lists methods' presets"),
        (("methods", "sgtp*"), "no methods match 'sgtp*'"),
    ]:
        bad = invoke("list", *args)
        assert bad.exit_code == 2 and needle in bad.output, bad.output
