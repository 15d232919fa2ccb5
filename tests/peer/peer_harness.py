"""What the differential checks against official code (`official*.py`, `clip_reference.py`
beside this file) share: where the checkouts are, the line saying how to get an absent one,
loading a sibling script by path, and the loop that prints every case's largest differences.

A script imports it after putting its own folder on `sys.path` (run by path, as the tests load
them, that folder is not on it)."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEER = REPO.parent / "peer"
HOW = "git clone https://github.com/{repo} {path} (or set {var})"


def checkout(var: str, name: str) -> Path:
    """Where an official checkout is: $`var`, else `name` in the folder `peer` beside the
    repository."""
    return Path(os.environ.get(var, PEER / name))


def not_found(path: Path, repo: str, var: str) -> str:
    """The line saying that the checkout of GitHub's `repo` is not at `path`, and how to get it."""
    return f"official checkout not found at {path}: " + HOW.format(repo=repo, path=path, var=var)


def missing(path: Path, repo: str, var: str, *needed: str) -> str | None:
    """`not_found` where any of `needed` (default: `trainers` and `clip`, Dassl's layout) is not
    below `path`, else None."""
    if all((path / n).exists() for n in needed or ("trainers", "clip")):
        return None
    return not_found(path, repo, var)


def sibling(name: str) -> ModuleType:
    """The script `name`.py of this folder, loaded by path (a fresh module each call)."""
    spec = importlib.util.spec_from_file_location(f"fpbench_peer_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_cases(
    cases: dict[str, tuple[str, dict]],
    run: Callable[[str, Path], dict[str, float]],
    why_not: Callable[[str], str | None],
    width: int,
) -> None:
    """Run every case in one thread and print its largest differences, or why it is skipped."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, _) in cases.items():
            if line := why_not(kind):
                print(f"{name:{width}s} skipped: {line}")
                continue
            diffs = run(name, Path(tmp))
            print(f"{name:{width}s} " + "  ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
