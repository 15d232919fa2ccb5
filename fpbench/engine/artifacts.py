"""A finished run's trained state, kept beside its results database, and scoring it again.

When a run ends `done`, its last checkpoint (the server state after the last round: shared
parameters, every client's personal parameters, buffers) is moved from the checkpoint folder
to ``<db folder>/<db stem>-params/<run_key>.pt`` for a SQLite database, or
``<checkpoint dir>/params/<run_key>.pt`` for a database server. `fpbench export-params` writes
it as a NumPy ``.npz`` (`write_npz`); `fpbench evaluate` rebuilds the run's task and model from
its stored config, loads the state and evaluates it as the last round did (`rescore`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fpbench.engine import checkpoint as ckpt_io
from fpbench.errors import FpbenchError
from fpbench.methods.base import ServerState
from fpbench.specs import RunConfig
from fpbench.store import Store

FORMAT = "fpbench-params-1"


def params_path(url: str, checkpoint_dir: Path, run_key: str) -> Path:
    """Where a finished run's state is kept: beside a SQLite file, else in the checkpoints."""
    db = Store.sqlite_file(url)
    folder = db.parent / f"{db.stem}-params" if db is not None else checkpoint_dir / "params"
    return folder / f"{run_key}.pt"


def keep_params(url: str, checkpoint_dir: Path, run_key: str) -> Path | None:
    """Move a finished run's last checkpoint to `params_path` (None: it had none)."""
    source = ckpt_io.checkpoint_path(checkpoint_dir, run_key)
    if not source.is_file():
        return None
    target = params_path(url, checkpoint_dir, run_key)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(source, tmp)  # the checkpoint folder may be on another file system
    os.replace(tmp, target)
    source.unlink()
    return target


def load_params(
    url: str, checkpoint_dir: Path, run_key: str, device: torch.device
) -> ckpt_io.Checkpoint:
    """A finished run's kept state (or, for a run stopped right after finishing, its last
    checkpoint).

    Raises:
        FpbenchError: the run has no kept state (it ran before fpbench kept it, or the file
            was removed).
    """
    path = params_path(url, checkpoint_dir, run_key)
    for candidate in (path, ckpt_io.checkpoint_path(checkpoint_dir, run_key)):
        if candidate.is_file() and (ckpt := ckpt_io.load(candidate, run_key, device)):
            return ckpt
    raise FpbenchError(
        f"run {run_key} has no trained state at {path} (runs finished before fpbench kept it "
        "have none; run the cell again into a fresh database to get it)"
    )


def write_npz(ckpt: ckpt_io.Checkpoint, cfg: dict[str, Any], out: Path) -> None:
    """The state as a NumPy archive: `params/<name>` (shared, no client axis),
    `personal/<name>` (one row per client, client id = row), `buffers/<name>`, and `meta`, a
    JSON string (format, run_key, the last round from 0, the run's config). bf16 tensors are
    stored as float32. With model heterogeneity names are `<backbone>/<name>` per backbone."""
    arrays: dict[str, np.ndarray] = {}
    for part, tensors in ckpt.server.state_dict().items():
        for name, t in tensors.items():
            t = t.detach().cpu()
            arrays[f"{part}/{name}"] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    meta = {"format": FORMAT, "run_key": ckpt.run_key, "round": ckpt.round, "config": cfg}
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        np.savez(f, **arrays)


def read_npz(path: Path) -> tuple[ServerState, dict[str, Any]]:
    """The state and meta an `write_npz` archive holds."""
    with np.load(path, allow_pickle=False) as data:
        parts: dict[str, dict[str, torch.Tensor]] = {"params": {}, "personal": {}, "buffers": {}}
        for key in data.files:
            if key != "meta":
                part, _, name = key.partition("/")
                parts[part][name] = torch.from_numpy(data[key])
        return ServerState.from_state_dict(parts), json.loads(str(data["meta"]))


def rescore(
    cfg: RunConfig, ckpt: ckpt_io.Checkpoint, device: torch.device, split: str = "test"
) -> list:
    """Evaluate a kept state as the run's last round did: the per-client and aggregate metric
    rows (client_id or None, name, value, count) of `evaluate_populations`, computed in the
    cell's numerics (deterministic mode, threads, CPU linear backend).

    `split = "train"` scores the train split instead: each client on its own train samples
    (`acc_local`), and the whole train split where the test split would be (`acc_global`).
    """
    from fpbench.engine.cell import Cell
    from fpbench.engine.numerics import cell_numerics
    from fpbench.engine.populations import unpack
    from fpbench.engine.rounds import evaluate_populations

    with cell_numerics(cfg):
        cell = Cell.build(cfg, device, split=split)
        servers = unpack(ckpt.server.to(device), [pop.key for pop in cell.populations])
        return evaluate_populations(cell, servers, [], -1, cell.seen(ckpt.round))
