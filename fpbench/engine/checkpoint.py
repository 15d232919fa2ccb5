"""Per-round checkpoints: server state and metric history, written atomically.

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


def save(path: Path, ckpt: Checkpoint) -> None:
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
    }
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load(path: Path, run_key: str, device: torch.device) -> Checkpoint | None:
    """The checkpoint of this run, or None: no file, another run's, or unreadable (warned)."""
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location=device, weights_only=True)
        if blob.get("run_key") != run_key:
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
