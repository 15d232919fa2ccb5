"""Which code produced a run: the git commit of fpbench's source tree, marked when it was dirty.

Stored with each run (`runs.git_commit`); not part of the run key, so runs of one config from
two commits stay one cell (a rerun skips it). None where fpbench is not a git checkout (an
installed wheel) or git is missing.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2]  # the checkout holding fpbench/


@functools.cache
def git_commit(folder: Path = SOURCE) -> str | None:
    """'<40 hex>' for a clean tree, '<40 hex>-dirty' when tracked files differ; None: no git."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "--verify", "HEAD")
    if not commit:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "fpbench")
    return f"{commit}-dirty" if dirty else commit
