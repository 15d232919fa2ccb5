"""Per-round checkpoints: server state and metric history, written atomically.

A checkpoint belongs to one run of one database: it lives under a folder named by the database's
identity (`<checkpoint_dir>/<database_id>/<run_key>.pt`, see `folder_for`) and records the
database and run it was written for (`binding`), so a run is never resumed from a checkpoint of
another database, nor of an earlier run of the same key.

A checkpoint that cannot be read (corrupt, truncated by a full disk, unreadable, from an
incompatible version) is ignored with a warning: the cell restarts from round 0, which gives the
same final results, only later. Its file is replaced by the next round's checkpoint.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fpbench.methods.base import ServerState

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    run_key: str
    round: int  # the last completed round
    server: ServerState
    history: list[dict[str, float]]  # aggregates of each evaluated round so far
    elapsed_s: float


def checkpoint_path(folder: Path, run_key: str) -> Path:
    return folder / f"{run_key}.pt"


def folder_for(checkpoint_dir: Path, database_id: str) -> Path:
    """The checkpoint folder of one database (`database_id`: `Store.database_id`)."""
    return Path(checkpoint_dir) / database_id


def binding(database_id: str, run_id: int) -> str:
    """What a checkpoint records about its run: the database identity and the run's id."""
    return f"{database_id}:{run_id}"


def saved_round(path: Path) -> tuple[int, str | None] | None:
    """(last completed round, binding) of a readable checkpoint file, else None (cheap: mmap)."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(blob["round"]), blob.get("binding")
    except Exception:  # noqa: BLE001 - missing or unreadable: `load` says so when it matters
        return None


def save(path: Path, ckpt: Checkpoint, bound_to: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        k: {n: t.detach().cpu() for n, t in d.items()} for k, d in ckpt.server.state_dict().items()
    }
    blob = {
        "run_key": ckpt.run_key,
        "round": ckpt.round,
        "server": state,
        "history": ckpt.history,
        "elapsed_s": ckpt.elapsed_s,
        "binding": bound_to,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load(
    path: Path, run_key: str, device: torch.device, bound_to: str | None = None
) -> Checkpoint | None:
    """The checkpoint of this run, or None: no file, another run's, or unreadable (warned).

    `bound_to`: the `binding` of the run resuming; a checkpoint written for another is ignored.
    """
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location=device, weights_only=True)
        if blob.get("run_key") != run_key:
            return None
        if bound_to is not None and blob.get("binding") != bound_to:
            log.warning(
                "ignoring checkpoint %s: it was written for %s, not for this run (%s); "
                "the run restarts",
                path,
                blob.get("binding"),
                bound_to,
            )
            return None
        return Checkpoint(
            run_key,
            int(blob["round"]),
            ServerState.from_state_dict(blob["server"]),
            list(blob["history"]),
            float(blob["elapsed_s"]),
        )
    except Exception as e:  # noqa: BLE001 - any unreadable file means: start over
        log.warning(
            "ignoring unreadable checkpoint %s (%s); the run restarts", path, type(e).__name__
        )
        return None
