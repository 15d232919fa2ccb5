"""`fpbench bench`: training and evaluation throughput of this machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fpbench.cli.apps import app
from fpbench.cli.common import (
    console,
    user_errors,
    write_or_print,
)
from fpbench.errors import FpbenchError


@app.command("bench")
@user_errors
def bench_cmd(
    backbone: Annotated[str, typer.Option(help="backbone to measure")] = "vit-smoke",
    clients: Annotated[int, typer.Option(min=1, help="clients trained per round")] = 5,
    batch: Annotated[int, typer.Option(min=1, help="minibatch size per client")] = 32,
    steps: Annotated[int, typer.Option(min=1, help="minibatches per client per round")] = 4,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    precision: Annotated[str, typer.Option(help="auto, fp32, bf16 or bf16-frozen")] = "auto",
    repeats: Annotated[int, typer.Option(min=1, help="timed repeats (median)")] = 3,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="also write the figures here")
    ] = None,
) -> None:
    """Throughput of the executors, caches and evaluation on this machine.

    The reference and lockstep executors, the feature and hidden-state caches and evaluation,
    with random weights."""
    from fpbench.bench import bench
    from fpbench.registry import BACKBONES

    BACKBONES.get(backbone)
    if precision not in ("auto", "fp32", "bf16", "bf16-frozen"):
        raise FpbenchError(
            f"--precision must be auto, fp32, bf16 or bf16-frozen, got {precision!r}"
        )
    figures = bench(backbone, clients, batch, steps, device, precision, repeats)
    table = Table(title=f"fpbench bench: {backbone}, {clients} clients x {batch} x {steps} steps")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if json_out:
        write_or_print(json.dumps(figures, indent=2), json_out)
