"""What every launcher is told: a dispatch's settings (`Dispatch`) and the GPUs it may use.
`dispatch` imports a launcher only when it is chosen; the launchers (`ray_tasks`,
`submitit_jobs`) read these from here."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fpbench.store import CLAIM_TIMEOUT_S


@dataclass(frozen=True)
class Dispatch:
    """How cells are dispatched; nothing here changes a cell's results."""

    launcher: str = "local"  # where cells run (`--launcher`); not how clients train
    jobs: int = 1  # cells at once (local processes, submitit-local jobs, SLURM array parallelism)
    folder: Path = Path("results/jobs")  # submitit's pickles and logs
    address: str | None = None  # Ray cluster address; None starts a local Ray instance
    gpus_per_cell: float = 0.0
    cpus_per_cell: int = 1
    timeout_min: int = 24 * 60
    slurm_partition: str | None = None
    claim_timeout: float = CLAIM_TIMEOUT_S


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (all, where unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(torch.cuda.device_count())]
    return [i.strip() for i in visible.split(",") if i.strip()]
