"""Where fpbench's shipped suites and paper data live.

The repository keeps them at its top level (`benchmarks/`, `benchmarks/papers/`); a wheel or a
non-editable install carries the same files as the package data `fpbench.benchmarks` (mapped in
pyproject.toml), read through `importlib.resources`. A source checkout (PYTHONPATH or an
editable install without that mapping) reads the folder beside the package.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent / "benchmarks"


def shipped_dir() -> Path:
    """The folder of the shipped suite files (`<it>/papers/` holds the paper data)."""
    try:
        root = resources.files("fpbench.benchmarks")
    except ModuleNotFoundError:  # a source checkout: the package has no `benchmarks` beside it
        return _CHECKOUT
    return _as_path(root)


def _as_path(root: resources.abc.Traversable) -> Path:
    """A real folder of the installed package data (wheels install as plain files).

    A namespace package's root (no `__init__.py`) is a MultiplexedPath over its folders, whose
    entries are plain paths: the folder is their parent.
    """
    if isinstance(root, Path):
        return root
    for entry in root.iterdir():
        if isinstance(entry, Path):
            return entry.parent
    return _CHECKOUT
