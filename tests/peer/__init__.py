"""What the differential tests against official code share: a script of tests/peer loaded by
path, its cases as test parameters (those named fast in the default run, the rest marked slow),
and a case run, or skipped with the line saying how to get its checkout."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPTS = Path(__file__).parent  # the harnesses beside this file


def load_script(name: str) -> ModuleType:
    """tests/peer/`name`.py, loaded by path (a fresh module each call)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case_params(harness: ModuleType, fast: set[str]) -> list[Any]:
    """A test parameter per case of `harness`, marked slow unless named in `fast`."""
    assert fast <= set(harness.CASES), fast - set(harness.CASES)
    return [
        pytest.param(
            name, marks=() if name in fast else pytest.mark.slow, id=name.replace(" ", "-")
        )
        for name in harness.CASES
    ]


def run_case(harness: ModuleType, name: str, folder: Path) -> dict[str, float]:
    """The largest differences of case `name`; skips with the harness's line saying what is
    absent where the case cannot run here."""
    kind, _ = harness.CASES[name]
    if line := harness.why_not(kind):
        pytest.skip(line)
    return harness.run(name, folder)
