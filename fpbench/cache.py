"""fpbench's cache folder: what it holds, how big it is, and emptying it (`fpbench cache`).

The folder is `$FPBENCH_CACHE`, else `~/.cache/fpbench`. fpbench writes there:

* `frozen/<backbone>--<feature>/<hash>.pt`: frozen features and queries
  (`fpbench.engine.frozen_cache`; `runtime.feature_cache_dir` may put them elsewhere),
* `<backbone>-<hash>[-<hash>].pth` (and `.lock`, `.partial`): weights it made itself
  (`vit-smoke`'s offline pretraining, the seeded tiny CLIPs),
* `open_clip_configs/<name>.json`: the tiny CLIPs' model configs.

Only files of those names, in those places, are counted as fpbench's and removed by `clear`
(which looks nowhere else); anything else in the folder is listed as not fpbench's and left
alone.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fpbench.backbones.smoke import default_cache_dir

FROZEN = "frozen"
_FROZEN_FILE = re.compile(r"^[0-9a-f]{32}\.pt(\.\d+-[0-9a-f]{8}\.tmp)?$")
# <backbone>-<hash>[-<hash>].pth: vit-smoke's name carries its recipe's and numerics' digests
_WEIGHTS_FILE = re.compile(
    r"^(?P<name>.+?)(?:-[0-9a-f]{10,12})+\.pth(\.lock|\.partial|\..+\.tmp)?$"
)
_CONFIG_FILE = re.compile(r"^[A-Za-z0-9_.-]+\.json(\.\d+\.tmp)?$")
_CLIP_CONFIGS = "open_clip_configs"
OTHER = "not fpbench's (kept)"


def cache_dir() -> Path:
    """fpbench's cache folder: `$FPBENCH_CACHE`, else `~/.cache/fpbench`."""
    return default_cache_dir()


def frozen_dir(setting: str | None = None) -> Path:
    """Where frozen values are kept: `runtime.feature_cache_dir`, else `<cache>/frozen`."""
    return Path(setting).expanduser() if setting else cache_dir() / FROZEN


@dataclass(frozen=True)
class Usage:
    """Files of one kind and their size."""

    kind: str
    files: int
    bytes: int


def _files(folder: Path) -> Iterator[Path]:
    for root, _, names in os.walk(folder):
        for name in names:
            yield Path(root) / name


def _frozen_kind(path: Path, frozen: Path) -> str | None:
    """`frozen <kind>` for a frozen entry directly in a kind folder of `frozen`, else None."""
    if path.parent.parent == frozen and _FROZEN_FILE.match(path.name):
        return f"frozen {path.parent.name}"
    return None


def _kind(path: Path, root: Path, frozen: Path) -> str:
    if (kind := _frozen_kind(path, frozen)) is not None:
        return kind
    if path.parent == root and (m := _WEIGHTS_FILE.match(path.name)):
        from fpbench.registry import BACKBONES

        if m.group("name") in BACKBONES.names():
            return "backbone weights"
    if path.parent == root / _CLIP_CONFIGS and _CONFIG_FILE.match(path.name):
        return "open_clip configs"
    return OTHER


def usage(root: Path | None = None, frozen: Path | None = None) -> list[Usage]:
    """Files and bytes per kind under `root` (the cache folder) and `frozen` (the frozen
    values' folder, by default `<root>/frozen`), kinds in name order."""
    root = root or cache_dir()
    frozen = frozen or root / FROZEN
    found: dict[str, list[int]] = {}
    for folder in dict.fromkeys([root, frozen]):  # a frozen folder outside root too
        if not folder.is_dir():
            continue
        for path in _files(folder):
            if folder == frozen != root and path.is_relative_to(root):
                continue  # inside root: counted there
            try:
                size = path.lstat().st_size
            except OSError:
                continue
            entry = found.setdefault(_kind(path, root, frozen), [0, 0])
            entry[0] += 1
            entry[1] += size
    return [Usage(k, n, b) for k, (n, b) in sorted(found.items())]


def clear(root: Path | None = None, frozen: Path | None = None, only_frozen: bool = False) -> Usage:
    """Remove fpbench's files under `root` and `frozen` (only the frozen values with
    `only_frozen`), then the folders they leave empty; returns what was removed."""
    root = root or cache_dir()
    frozen = frozen or root / FROZEN
    files = size = 0
    emptied: set[Path] = {root / FROZEN, root / _CLIP_CONFIGS}  # folders fpbench makes
    for path in _candidates(root, frozen, only_frozen):
        kind = _kind(path, root, frozen)
        if kind == OTHER or (only_frozen and not kind.startswith("frozen ")):
            continue
        try:
            n = path.lstat().st_size
            path.unlink()
        except FileNotFoundError:
            continue
        files, size = files + 1, size + n
        emptied.add(path.parent)
    for folder in sorted(emptied, key=lambda p: len(p.parts), reverse=True):  # deepest first
        with contextlib.suppress(OSError):
            folder.rmdir()  # only where empty
    return Usage("removed", files, size)


def _candidates(root: Path, frozen: Path, only_frozen: bool) -> list[Path]:
    """The only places fpbench writes: files in `frozen`'s kind folders and, unless
    `only_frozen`, `root`'s own files and its `open_clip_configs` (nothing else is walked)."""
    folders = _dirs(frozen)
    if not only_frozen:
        folders += [root, root / _CLIP_CONFIGS]
    return [p for folder in dict.fromkeys(folders) for p in _dirs(folder, files=True)]


def _dirs(folder: Path, files: bool = False) -> list[Path]:
    """The sub-folders (or with `files`, the files) directly in `folder`."""
    try:
        return [p for p in folder.iterdir() if (p.is_file() or p.is_symlink()) == files]
    except OSError:
        return []
