"""docs/adding-a-method.md, step by step: its method file installed as a package of its own (an
entry point), its hand-checked test, its suite run through the CLI and rendered as a table."""

from __future__ import annotations

import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from fpbench.registry import METHODS, load_plugins

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
    (pkg / "trimmed_vpt.py").write_text(_blocks("python")[0])
    (pkg / "pyproject.toml").write_text(_blocks("toml")[0])
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(site), str(pkg)],
        check=True,
        capture_output=True,
    )
    assert (site / "trimmed_vpt.py").exists()
    return site


def _cli(args: list[str], site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "COLUMNS": "200"}
    return subprocess.run(FPBENCH + args, cwd=cwd, env=env, capture_output=True, text=True)


def test_the_installed_method_is_listed_with_its_package(site, tmp_path):
    out = _cli(["list", "methods"], site, tmp_path)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "trimmed-vpt" in line)
    assert "my-fpbench-methods" in row
    assert "Trimmed-mean FedVPT" in row
    fedvpt = next(line for line in out.stdout.splitlines() if " fedvpt " in line)
    assert "fpbench" in fedvpt and "my-fpbench-methods" not in fedvpt


def test_the_doc_test_passes(site, tiny, monkeypatch):
    load_plugins()  # the built-in ones first, without the folder below
    monkeypatch.setattr(METHODS, "_items", dict(METHODS._items))  # registered for this test only
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "trimmed_vpt", raising=False)
    import trimmed_vpt  # noqa: F401  (registers trimmed-vpt)

    namespace: dict = {}
    exec(_blocks("python")[1], namespace)
    namespace["test_trimmed_mean_drops_the_extremes"](tiny)
    sys.modules.pop("trimmed_vpt")


def test_the_suite_runs_and_gives_a_table_row(site, tmp_path):
    (tmp_path / "trimmed-demo.toml").write_text(_blocks("toml")[1])
    commands = [shlex.split(line) for line in _blocks("bash")[0].splitlines()]
    assert [c[:2] for c in commands] == [["fpbench", "run"], ["fpbench", "table"]]
    run = _cli(commands[0][1:], site, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    with sqlite3.connect(tmp_path / "results" / "demo.db") as db:
        rows = db.execute("SELECT method, status FROM runs ORDER BY method").fetchall()
    assert rows == [("fedvpt", "done"), ("trimmed-vpt", "done")]
    table = _cli(commands[1][1:], site, tmp_path)
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if "trimmed-vpt" in line)
    assert len(re.findall(r"\d+\.\d", row)) >= 3  # global, mean local and worst accuracy
