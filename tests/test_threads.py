"""`fpbench run --threads`, passive waiting and the oversubscription warning: robust on a busy
machine, with the stored values those of the thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.engine.runner import run_cell
from fpbench.store import Store
from fpbench.suites import load_suite
from tests.conftest import TINY_SUITE_TOML
from tests.test_resume_safety import rows

WARNING = "warning: this machine is oversubscribed (load average 10.0 on 2 cores)"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    return tmp_path


def _busy(monkeypatch, load: float) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def test_threads_option_is_stored_and_computes_as_that_count(workdir, monkeypatch):
    _busy(monkeypatch, 10.0)
    args = ["run", "--suite", "tiny.toml", "--method", "fedvpt", "--threads", "1", "--db", "t.db"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert WARNING + ": each cell computes with 1 thread(s)" in " ".join(result.stdout.split())
    with Store(f"sqlite:///{workdir / 't.db'}") as store:
        (record,) = [store.find_run(k) for k in store.runs()["run_key"]]
    assert record.config["runtime"]["threads"] == 1
    cfg = next(c for c in load_suite("tiny.toml").cells if c.method.name == "fedvpt")
    one = cfg.model_copy(update={"runtime": cfg.runtime.model_copy(update={"threads": 1})})
    assert one.run_key == cfg.run_key  # the count is how it computes, not what it is
    with Store(f"sqlite:///{workdir / 'direct.db'}") as store:
        assert run_cell(one, store, checkpoint_dir=workdir / "ck").status == "done"
    assert rows(workdir / "t.db") == rows(workdir / "direct.db")


def test_no_warning_on_a_machine_with_cores_to_spare(workdir, monkeypatch):
    _busy(monkeypatch, 0.5)
    args = ["run", "--suite", "tiny.toml", "--method", "head-tune", "--db", "t.db"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "oversubscribed" not in result.output


def _policy(env: dict[str, str]) -> str:
    code = (
        "import os, sys; from fpbench.cli.run import _passive_waits; _passive_waits(); "
        "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_threads_wait_asleep_unless_told_otherwise():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert _policy(env) == "PASSIVE False"  # set before torch is loaded
    assert _policy({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE False"


def test_the_threads_option_rejects_zero(workdir):
    result = CliRunner().invoke(app, ["run", "--suite", "tiny.toml", "--threads", "0"])
    assert result.exit_code == 2 and not (workdir / "results").exists()


@pytest.mark.slow
def test_the_wait_policy_changes_no_stored_value(tmp_path):
    """Spinning (ACTIVE) and sleeping (PASSIVE, fpbench's default) threads store the same bits."""
    (tmp_path / "tiny.toml").write_text(TINY_SUITE_TOML)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    for policy, db in ((None, "passive.db"), ("ACTIVE", "active.db")):
        run = [sys.executable, "-m", "fpbench", "run", "--suite", "tiny.toml", "--threads", "2"]
        done = subprocess.run(
            [*run, "--db", db],
            cwd=tmp_path,
            env={**env, "OMP_WAIT_POLICY": policy} if policy else env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
    assert rows(tmp_path / "passive.db") == rows(tmp_path / "active.db")
