"""docs/adding-a-method.md, step by step: its method file installed as a package of its own (an
entry point), its conformance and hand-checked tests run by pytest from a folder outside the
checkout, its suite run through the CLI and rendered as a table."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-a-method.md"
FPBENCH = [sys.executable, "-m", "fpbench"]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The doc's method file and pyproject, installed by pip into a folder of their own."""
    root = tmp_path_factory.mktemp("plugin")
    pkg, site = root / "pkg", root / "site"
    pkg.mkdir()
    (pkg / "cosine_vpt.py").write_text(_blocks("python")[0])
    (pkg / "pyproject.toml").write_text(_blocks("toml")[0])
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(site), str(pkg)],
        check=True,
        capture_output=True,
    )
    assert (site / "cosine_vpt.py").exists()
    return site


def _cli(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "COLUMNS": "200"}
    return subprocess.run(FPBENCH + args, cwd=cwd, env=env, capture_output=True, text=True)


def test_the_installed_method_is_listed_with_its_package(site, tmp_path):
    out = _cli(["list", "methods"], site, tmp_path)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "cosine-vpt" in line)
    assert "my-fpbench-methods" in row
    assert "Cosine VPT" in row
    fedvpt = next(line for line in out.stdout.splitlines() if " fedvpt " in line)
    assert "fpbench" in fedvpt and "my-fpbench-methods" not in fedvpt


# Slow (the guide's package installed and its tests run from a fresh folder, about 25 s): CI's
# `pytest -m slow` runs it; the default run keeps the installed package's listing and suite run.
@pytest.mark.slow
def test_the_doc_tests_pass_from_a_fresh_folder(site, tmp_path):
    """Step 3 as a plugin author runs it: the page's conftest and test module in a folder
    outside the checkout, fpbench and the method package installed, pytest run there."""
    conftest, test_module = _blocks("python")[1:3]
    (tmp_path / "conftest.py").write_text(conftest)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_cosine_vpt.py").write_text(test_module)
    command = shlex.split(_blocks("bash")[0].strip())
    assert command[0] == "pytest"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
        "FPBENCH_CACHE": str(tmp_path / "cache"),
    }
    out = subprocess.run(
        [sys.executable, "-m", *command, "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the four conformance checks (recalled == recomputed included: nothing to declare, nothing
    # skipped) and the page's own test
    assert re.search(r"\b5 passed\b", out.stdout), out.stdout[-2000:]


def test_the_suite_runs_and_gives_a_table_row(site, tmp_path):
    (tmp_path / "cosine-demo.toml").write_text(_blocks("toml")[1])
    commands = [shlex.split(line) for line in _blocks("bash")[1].splitlines()]
    assert [c[:2] for c in commands] == [["fpbench", "run"], ["fpbench", "table"]]
    run = _cli(commands[0][1:], site, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    with sqlite3.connect(tmp_path / "results" / "demo.db") as db:
        rows = db.execute("SELECT method, status FROM runs ORDER BY method").fetchall()
    assert rows == [("cosine-vpt+fedavg", "done"), ("cosine-vpt+fedprox", "done")]
    table = _cli(commands[1][1:], site, tmp_path)
    assert table.returncode == 0, table.stderr
    for strategy in ("fedavg", "fedprox"):  # the learner with two strategies, a row each
        row = next(line for line in table.stdout.splitlines() if f"+{strategy} " in line)
        assert f"| cosine-vpt | {strategy} |" in row
        assert len(re.findall(r"\d+\.\d", row)) >= 3  # global, mean local and worst accuracy
