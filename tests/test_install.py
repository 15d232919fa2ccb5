"""The wheel carries the shipped suites and paper data; fpbench finds them outside the checkout."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from importlib import resources
from pathlib import Path

import pytest
import tomllib

import fpbench
from fpbench import shipped
from fpbench.report.paper import PAPERS_DIR, list_papers
from fpbench.report.suite_protocol import PROTOCOLS_DIR, list_suite_protocols
from fpbench.suites import SUITE_DIR, find_suite, list_suites

ROOT = Path(__file__).resolve().parent.parent


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_subpackage_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's explicit list would be left out of the wheel."""
    pkg = Path(fpbench.__file__).parent
    found = {"fpbench"} | {
        "fpbench." + ".".join(p.parent.relative_to(pkg).parts)
        for p in pkg.rglob("*.py")
        if p.parent != pkg and "__pycache__" not in p.parts
    }
    listed = set(_setuptools_config()["packages"])
    assert listed - found == {
        "fpbench.benchmarks", "fpbench.benchmarks.papers", "fpbench.benchmarks.protocols",
    }  # fmt: skip
    assert found <= listed


def test_benchmarks_folder_is_mapped_as_package_data():
    cfg = _setuptools_config()
    assert cfg["package-dir"] == {"fpbench.benchmarks": "benchmarks"}
    assert cfg["package-data"]["fpbench.benchmarks"] == ["*.toml"]
    assert cfg["package-data"]["fpbench.benchmarks.papers"] == ["*.toml"]
    assert cfg["package-data"]["fpbench.benchmarks.protocols"] == ["*.toml"]


def test_benchmarks_folder_holds_suite_and_paper_data_only():
    """Scripts live in scripts/: the wheel ships only benchmarks/'s .toml files, and a suite is
    any .toml there."""
    files = {
        p.relative_to(ROOT / "benchmarks").as_posix()
        for p in (ROOT / "benchmarks").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    suites = {f"{name}.toml" for name in list_suites()}
    papers = {f"papers/{name}.toml" for name in list_papers()}
    protocols = {f"protocols/{name}.toml" for name in [*list_suite_protocols(), "recipes"]}
    assert files == (suites & files) | papers | protocols


def test_checkout_reads_the_top_level_benchmarks_folder():
    assert SUITE_DIR == ROOT / "benchmarks"
    assert PAPERS_DIR == ROOT / "benchmarks" / "papers"
    assert "smoke" in list_suites() and "sgpt" in list_papers()


def test_installed_package_data_wins(tmp_path, monkeypatch):
    """Installed, `fpbench.benchmarks` is a namespace package of plain files."""
    data = tmp_path / "site" / "uxpkg" / "benchmarks"
    (data / "papers").mkdir(parents=True)
    (data / "smoke.toml").write_text('name = "smoke"\n')
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    root = resources.files("uxpkg.benchmarks")
    assert not isinstance(root, Path)  # a MultiplexedPath, as for the wheel's folder
    assert shipped._as_path(root) == data
    monkeypatch.setattr(shipped.resources, "files", lambda name: root)
    assert shipped.shipped_dir() == data


def test_user_suites_still_win(tmp_path, monkeypatch):
    own = tmp_path / "mine"
    own.mkdir()
    (own / "smoke.toml").write_text('name = "smoke"\n')
    monkeypatch.setenv("FPBENCH_SUITES", str(own))
    assert find_suite("smoke") == own / "smoke.toml"
    monkeypatch.delenv("FPBENCH_SUITES")
    monkeypatch.chdir(tmp_path)
    assert find_suite("smoke") == SUITE_DIR / "smoke.toml"
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "smoke.toml").write_text('name = "smoke"\n')
    assert find_suite("smoke").resolve() == (tmp_path / "benchmarks" / "smoke.toml").resolve()
    assert find_suite("mine/smoke.toml") == Path("mine/smoke.toml")


@pytest.mark.slow
def test_wheel_holds_suites_and_papers(tmp_path):
    """The built wheel ships every suite and paper file (CI also installs and runs it).

    Built with this environment's setuptools (no build isolation), so that it needs no package
    index (a GPU machine may have none)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("fpbench-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    suites = {f"fpbench/benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("*.toml")}
    papers = {f"fpbench/benchmarks/papers/{p.name}" for p in PAPERS_DIR.glob("*.toml")}
    protocols = {f"fpbench/benchmarks/protocols/{p.name}" for p in PROTOCOLS_DIR.glob("*.toml")}
    assert suites and papers and protocols and suites | papers | protocols <= names
    assert "fpbench/cli/__init__.py" in names and "fpbench/engine/runner.py" in names
