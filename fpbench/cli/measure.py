"""`fpbench bench` and `fpbench estimate`: the thin commands over `fpbench.measure`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fpbench import stages
from fpbench.cli.apps import app
from fpbench.cli.common import (
    SetOpt,
    SuiteOpt,
    console,
    err,
    load_cells,
    plural,
    user_errors,
    wrap,
    write_or_print,
)
from fpbench.errors import FpbenchError


@app.command("bench", short_help="Time the executors, caches and evaluation on this machine.")
@user_errors
def bench_cmd(
    backbone: Annotated[str, typer.Option(help="backbone to measure")] = "vit-smoke",
    clients: Annotated[int, typer.Option(min=1, help="clients trained per round")] = 5,
    batch: Annotated[int, typer.Option(min=1, help="minibatch size per client")] = 32,
    steps: Annotated[int, typer.Option(min=1, help="minibatches per client per round")] = 4,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    precision: Annotated[str, typer.Option(help="auto, fp32, bf16 or bf16-frozen")] = "auto",
    repeats: Annotated[int, typer.Option(min=1, help="timed repeats (median)")] = 3,
    methods: Annotated[
        str | None,
        typer.Option(
            metavar="PATTERN",
            help="instead: time a round and an evaluation of every registered method matching "
            "PATTERN ('*': all) on the tiny test federation",
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="also write the figures here")
    ] = None,
) -> None:
    """Throughput of the executors, caches and evaluation on this machine.

    The reference and lockstep executors, the feature and hidden-state caches and evaluation,
    with random weights. With --methods PATTERN: seconds per round and per evaluation of each
    matching method on the conformance tests' tiny federation (exit code 1 if one fails)."""
    from fpbench.measure.bench import bench
    from fpbench.registry import BACKBONES

    BACKBONES.get(backbone)
    _check_precision(precision)
    if methods is not None:
        if (backbone, clients, batch, steps) != ("vit-smoke", 5, 32, 4):
            raise FpbenchError(
                "--methods times the tiny test federation: --backbone, --clients, --batch and "
                "--steps do not apply"
            )
        _bench_methods(methods, device, precision, repeats, json_out)
        return
    figures = bench(backbone, clients, batch, steps, device, precision, repeats)
    table = Table(title=f"fpbench bench: {backbone}, {clients} clients x {batch} x {steps} steps")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, f"{value:,.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    if json_out:
        write_or_print(json.dumps(figures, indent=2), json_out)


def _bench_methods(
    pattern: str, device: str, precision: str, repeats: int, json_out: Path | None
) -> None:
    from dataclasses import asdict

    from fpbench.engine.build import resolve_device
    from fpbench.measure.methods import method_times, total

    dev = resolve_device(device)

    def show(i: int, n: int, name: str) -> None:
        err.print(f"timing method {i + 1}/{n}: {name}", highlight=False)

    try:
        found = method_times(pattern, dev, precision, repeats, show)
    except ValueError as e:
        raise FpbenchError(str(e)) from None
    table = Table(title=f"fpbench bench --methods {pattern}: tiny federation on {dev}")
    table.add_column("method")
    table.add_column("backbone")
    for name in ("s/round", "CPU s/round", "s/eval", "first round s", "first eval s"):
        table.add_column(name, justify="right")
    fields = ("round_s", "round_cpu_s", "eval_s", "first_round_s", "first_eval_s")
    for t in found:
        table.add_row(t.method, t.backbone, *(_s3(getattr(t, f)) for f in fields))
    ran = sum(t.error is None for t in found)
    table.add_row(f"all ({ran})", "", *(_s3(total(found, f)) for f in fields), end_section=True)
    console.print(table)
    console.print(
        f"medians of {plural(repeats, 'repeat')} after the first (wall and, for rounds, this "
        "process's CPU seconds); first: with its frozen passes and warm-up"
    )
    failed = [t for t in found if t.error]
    for t in failed:
        err.print(f"method {t.method} not timed: {t.error}", highlight=False, markup=False)
    if json_out:
        write_or_print(json.dumps([asdict(t) for t in found], indent=2), json_out)
    if failed:
        raise typer.Exit(1)


def _s3(seconds: float | None) -> str:
    return "-" if seconds is None or seconds != seconds else f"{seconds:,.3f}"


def _check_precision(precision: str) -> None:
    if precision not in ("auto", "fp32", "bf16", "bf16-frozen"):
        raise FpbenchError(
            f"--precision must be auto, fp32, bf16 or bf16-frozen, got {precision!r}"
        )


def _h(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 3600:,.3f}"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:,.2f}"


@app.command("estimate")
@user_errors
def estimate_cmd(
    suite: SuiteOpt = "smoke",
    method: Annotated[
        list[str] | None, typer.Option(help="only these methods' shapes (repeatable)")
    ] = None,
    sets: SetOpt = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    precision: Annotated[str, typer.Option(help="auto, fp32, bf16 or bf16-frozen")] = "auto",
    rounds: Annotated[int, typer.Option(min=1, help="rounds measured per shape")] = 2,
    max_shapes: Annotated[
        int | None, typer.Option(min=0, help="measure only the first N shapes")
    ] = None,
    dry: Annotated[
        bool, typer.Option("--dry", help="list the shapes only: nothing is built or run")
    ] = False,
    scaled: Annotated[
        int | None,
        typer.Option(
            min=1,
            metavar="N",
            help="time N and 2N batches per client and scale by the step and test-sample "
            "counts; shapes differing only in sizes, rounds, epochs or method settings share "
            "one measurement (minutes for a whole paper; see the assumptions printed)",
        ),
    ] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="also write the estimates here")
    ] = None,
) -> None:
    """What a suite will cost on this device, in device-hours.

    Each distinct cell shape runs a round or two on fake data of the real shape with random
    weights of the real backbone (nothing downloads), projected to the suite's device-hours."""
    from fpbench.engine.build import resolve_device
    from fpbench.measure.estimate import ASSUMPTIONS, SCALED_ASSUMPTIONS, as_dict, estimate
    from fpbench.units import human_bytes

    _check_precision(precision)
    loaded, cells = load_cells(suite, sets, method)
    if method:
        loaded = loaded.model_copy(update={"cells": tuple(cells)})
    dev = None if dry else resolve_device(device)
    with err.status("") as status:  # a spinner on a terminal; in a log, lines as stages end
        shown = [""]

        def show(i: int, n: int, shape) -> None:
            shown[0] = f"measuring shape {i + 1}/{n}: {shape.method} on {shape.backbone}"
            if err.is_terminal:
                status.update(shown[0])
            else:
                err.print(shown[0], highlight=False)

        def stage(what: str, done: int, total: int) -> None:  # frozen passes, warm starts
            if err.is_terminal:
                status.update(f"{shown[0]}, {what} {done:,}/{total:,}")
            elif done == total:
                err.print(f"  {what}: {total:,} done", highlight=False)

        with stages.reporting(stage):
            found = estimate(loaded, dev, precision, rounds, max_shapes, show, batches=scaled)
    _print_estimates(loaded.name, found, "plan only" if dev is None else str(dev))
    measured = [e for e in found if e.total_s is not None]
    cells = sum(e.cells for e in found)
    if measured:
        total = sum(e.total_s for e in measured)
        some = sum(e.cells for e in measured)
        scope = "" if some == cells else f" (the {some} of {cells} cells measured)"
        peak = max((e.measured.peak_mem_bytes or 0 for e in measured), default=0)
        console.print(f"suite {loaded.name}: {total / 3600:,.3f} device-hours on {dev}{scope}")
        console.print(f"peak memory of a cell: {human_bytes(peak or None)}")
    for e in found:
        if e.error:
            err.print(f"shape {e.shape.method} / {e.shape.backbone} not measured: {e.error}")
    told = ASSUMPTIONS + (SCALED_ASSUMPTIONS if scaled else ())
    console.print("assumptions:", highlight=False)
    for line in (x for a in told for x in wrap(a, console.width, "    ", first="  - ")):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if json_out:
        write_or_print(json.dumps([as_dict(e) for e in found], indent=2), json_out)


def _print_estimates(suite: str, found: list, where: str) -> None:
    """The estimates' table with each shape in its row where that fits the width; else the
    shapes numbered in the table and each described whole below it, wrapped at ' | '."""
    described = [describe(e) for e in found]
    table = _table(suite, found, where, described)
    if console.measure(table, options=console.options.update_width(10**6)).maximum <= console.width:
        console.print(table)
        return
    console.print(_table(suite, found, where, None))
    console.print("shapes:", highlight=False)
    room = len(str(len(found)))
    for i, text in enumerate(described, 1):
        for line in wrap_shape(text, console.width, f"  {i:>{room}}  ", " " * (room + 4)):
            console.print(line, highlight=False, markup=False, soft_wrap=True)


def _table(suite: str, found: list, where: str, described: list[str] | None) -> Table:
    """The estimates, a row a shape: its description (`described`) or its number."""
    from fpbench.measure.estimate import frozen_s
    from fpbench.units import human_bytes

    table = Table(title=f"fpbench estimate: {suite} ({plural(len(found), 'shape')}, {where})")
    if described is None:
        table.add_column("shape", justify="right", no_wrap=True)
    else:
        table.add_column("shape")
    for name in ("cells", "s/round", "s/eval", "frozen s", "peak mem", "h/cell", "h total"):
        table.add_column(name, justify="right", no_wrap=True)  # numbers whole
    for i, e in enumerate(found):
        s, m = e.shape, e.measured
        frozen = None if m is None else frozen_s(s, m)
        table.add_row(
            str(i + 1) if described is None else described[i],
            str(e.cells),
            _s(m.train_round_s if m else None),
            _s(m.eval_s if m else None),
            _s(frozen),
            human_bytes(m.peak_mem_bytes if m else None),
            _h(e.cell_s),
            _h(e.total_s),
        )
    return table


def wrap_shape(text: str, width: int, first: str, indent: str) -> list[str]:
    """A shape's description in lines of at most `width`, broken after a ' |' (a part wider
    than the room broken at its spaces); `first` starts the first line, `indent` the rest."""
    parts = text.split(" | ")
    lines, line, lead = [], "", first
    for i, part in enumerate(parts):
        tail = "" if i == len(parts) - 1 else " |"
        if line and len(lead + line + " | " + part + tail) > width:
            lines.append(lead + line + " |")
            line, lead = "", indent
        line = f"{line} | {part}" if line else part
    lines.append(lead + line)
    out: list[str] = []
    for x in lines:  # a part wider than the room on its own line, at its spaces
        out += (
            [x]
            if len(x) <= width
            else wrap(x.strip(), width, indent, x[: len(x) - len(x.lstrip())])
        )
    return out


def describe(e) -> str:
    """One shape in a line: method, backbone, data, federation, local schedule, rounds."""
    s = e.shape
    exact = "" if s.sizes_exact else "*"
    steps = f" <={s.max_local_steps} steps" if s.max_local_steps else ""
    return (
        f"{e.label} | {s.backbone} | {s.dataset} {s.image_size}px "
        f"{s.train_size:,}/{s.test_size:,}{exact} | {s.per_round}/{s.num_clients} clients | "
        f"b{s.batch_size} x {s.local_epochs} ep{steps} | {s.rounds} rounds, {s.evals} evals"
    )
