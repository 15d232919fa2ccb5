"""`fpbench estimate`: what a suite will cost on this device, before anyone books it.

A suite's cells fall into a few shapes: everything that sets a cell's cost (backbone, method and
its settings, the dataset's image size and train / test sizes, clients, participation, batch,
local schedule, rounds, evaluations), not what sets its numbers (seeds, label skew, learning
rates). For each distinct shape, `measure` runs a round or two on fake data of the real shape
(random uint8 images of the dataset's size and count, from the dataset registry's metadata,
`fpbench.data.info.DatasetInfo`) with random weights of the real backbone (the architecture
built without loading weights: nothing downloads), split into the parts a run pays for:

* the frozen passes (features and queries of the trained clients' samples, once per sample,
  and of the test split at the first evaluation; see `fpbench.engine.inputs`),
* local training and aggregation of one round,
* one evaluation.

Each part runs through the engine's own code (`fpbench.engine.rounds.play_round` and
`evaluate_populations`) and as the cell computes (`fpbench.engine.numerics.cell_numerics`).

`project` turns them into a cell's time: setup + rounds x train round + evaluations x evaluation
+ the frozen passes over the samples the run is expected to touch (the clients sampled at least
once: N (1 - (1 - m/N)^R) of N clients, m per round, R rounds).

`batches` (`fpbench estimate --scaled N`) makes a suite's estimate cheap enough for hundreds of
shapes: each shape is timed twice, on N and on 2N batches per client with test splits of N and
2N evaluation batches, and the two give a round's fixed part and its cost per optimiser step,
and an evaluation's fixed part and its cost per test sample, which `rescale` carries to the
shape's counts; shapes that differ only in what is scaled (rounds, sizes, clients, epochs) or
in method settings share one measurement (`cost_group`, timed on the settings of the most
cells: `representatives`), and each architecture is built once (`Memo`).

Assumptions, printed with every estimate: clients hold equal shares of the train split (label
skew moves samples between clients, not the round's expected total); personal methods evaluate
every client as measured; a model-heterogeneity cell is timed with its default backbone for
every client; the device is as busy as during the measurement.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from fpbench.data.base import ImageDataset
from fpbench.registry import DATASETS, METHODS
from fpbench.specs import Component, RunConfig, Suite

ASSUMPTIONS = (
    "fake data of the real shape (dataset sizes from fpbench's dataset metadata; * = the "
    "standard release's, approximate) and random weights of the real backbone",
    "clients hold equal shares of the train split (label skew moves samples between clients, "
    "not a round's expected total)",
    "frozen passes cover the clients expected to be sampled at least once, and the test split",
    "model heterogeneity: every client timed with the suite's default backbone",
    "the device stays as busy as during the measurement (on a shared machine: as loaded)",
    "peak memory: as in the measured rounds and evaluation (CUDA: max allocated; CPU: the "
    "process's peak RSS)",
)
SCALED_ASSUMPTIONS = (
    "--scaled: a round is a fixed part plus a cost per optimiser step of a client, and an "
    "evaluation a fixed part plus a cost per test sample, fitted through the warm rounds and "
    "evaluations of N and 2N batches per client and of test samples (setup is not scaled: a "
    "setup that reads the whole train split is undercounted)",
    "--scaled: shapes of one backbone, method, class count, batch size and clients per round "
    "share one measurement, of the method settings that most of their cells use (others, such "
    "as ablations or prompt lengths, are not told apart); peak memory is that of the larger "
    "shrunk shape",
)


@dataclass(frozen=True)
class Shape:
    """Everything that sets a cell's cost."""

    backbone: str
    method: str
    method_args: str  # JSON of the method's settings
    dataset: str
    image_size: int
    num_classes: int
    train_size: int
    test_size: int
    sizes_exact: bool
    num_clients: int
    heldout_frac: float
    shots: int | None
    per_round: int
    batch_size: int
    local_epochs: int
    max_local_steps: int | None
    eval_batch_size: int
    rounds: int
    evals: int

    @property
    def trainable(self) -> int:
        """Clients that train (held-out ones are only evaluated)."""
        held = min(self.num_clients - 1, math.floor(self.heldout_frac * self.num_clients + 0.5))
        return self.num_clients - held

    @property
    def per_client(self) -> float:
        """Train samples of a client (equal shares; a few-shot split caps them)."""
        share = self.train_size / self.num_clients
        return share if self.shots is None else min(share, self.shots * self.num_classes)

    @property
    def local_steps(self) -> int:
        """A sampled client's optimiser steps in a round, counting `local_epochs` epochs."""
        steps = self.local_epochs * math.ceil(self.per_client / self.batch_size)
        return steps if self.max_local_steps is None else min(steps, self.max_local_steps)

    @property
    def expected_sampled(self) -> float:
        """Clients expected to be sampled at least once over the rounds."""
        n, m = self.trainable, self.per_round
        return n * (1 - (1 - m / n) ** self.rounds)


@dataclass(frozen=True)
class Measurement:
    """Seconds measured on fake data of a shape."""

    setup_s: float  # building the method and its server state (e.g. a prototype warm start)
    train_round_s: float  # local training + aggregation of one round (frozen work excluded)
    eval_s: float  # one evaluation (the test split's frozen pass excluded)
    frozen_per_sample_s: float  # one train sample's frozen features (0: none)
    test_frozen_s: float  # the test split's frozen pass
    device: str
    # the peak memory of the measured rounds (CUDA: max allocated; CPU: peak RSS), which a cell
    # of the shape is expected to reach too (fpbench.engine.cost.PeakMemory)
    peak_mem_bytes: int | None = None


@dataclass(frozen=True)
class Estimate:
    shape: Shape
    label: str  # the method label of the shape's first cell
    cells: int
    measured: Measurement | None
    cell_s: float | None
    error: str | None = None

    @property
    def total_s(self) -> float | None:
        return None if self.cell_s is None else self.cell_s * self.cells


@dataclass
class Memo:
    """What `estimate` reuses across shapes (and suites, when passed along): each
    architecture's random weights, built once and copied per shape, and with `batches` each
    cost group's measurements with the shrunk shapes they timed (or why they failed)."""

    backbones: dict[Any, torch.nn.Module] = field(default_factory=dict)
    groups: dict[tuple, list[tuple[Shape, Measurement]] | str] = field(default_factory=dict)


def shrunk(shape: Shape, batches: int) -> Shape:
    """`shape` with `batches` batches per client (fewer where a client holds less) and at most
    `batches` evaluation batches of test samples (2 a client, where that is more): what a
    scaled estimate times."""
    per_client = max(1, min(math.floor(shape.per_client), batches * shape.batch_size))
    return replace(
        shape,
        train_size=per_client * shape.num_clients,
        # at least 2 test samples a client, for a method that scores each client on its own
        test_size=min(shape.test_size, max(batches * shape.eval_batch_size, 2 * shape.num_clients)),
        shots=None,
    )


def _line(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    """The line through (x0, y0) and (x1, y1) at x: a fixed part plus a slope, each at least 0
    (a slope below zero, from noise, counts as none; equal x0 and x1 give y1)."""
    slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 > x0 else 0.0
    return max(y1 - slope * x1, 0.0) + slope * x


def rescale(timed: list[tuple[Shape, Measurement]], target: Shape) -> Measurement:
    """Two measurements of shrunk shapes (fewer, then more steps and test samples) carried over
    to `target`: a round as a fixed part plus a cost per optimiser step, an evaluation as a
    fixed part (e.g. a personal method's per-client text features) plus a cost per test sample,
    each fitted through the two (`_line`); the test split's frozen pass by the ratio of test
    samples; per-sample frozen work, setup and peak memory as the larger one measured."""
    (small, a), (big, b) = timed
    steps = (small.local_steps, big.local_steps)
    tests = (small.test_size, big.test_size)
    return replace(
        b,
        train_round_s=_line(
            steps[0], a.train_round_s, steps[1], b.train_round_s, target.local_steps
        ),
        eval_s=_line(tests[0], a.eval_s, tests[1], b.eval_s, target.test_size),
        test_frozen_s=b.test_frozen_s * target.test_size / big.test_size,
    )


def cost_group(shape: Shape) -> tuple:
    """What a scaled measurement is shared by: the shape less what `rescale` scales (sizes,
    rounds, clients, epochs) and less the method's settings (`representatives` picks those
    it is timed on)."""
    return (
        shape.backbone,
        shape.method,
        shape.image_size,
        shape.num_classes,
        shape.batch_size,
        shape.per_round,
        shape.eval_batch_size,
    )


def representatives(planned: list[tuple[Shape, RunConfig, int]]) -> dict[tuple, tuple]:
    """Each cost group's (shape, cell) to time: of the method settings in the group, those of
    the most cells, the earliest in `planned` on a tie (put a paper's main tables first)."""
    cells: dict[tuple, int] = {}
    first: dict[tuple, tuple[Shape, RunConfig]] = {}
    for shape, cfg, n in planned:
        key = (cost_group(shape), shape.method_args)
        cells[key] = cells.get(key, 0) + n
        first.setdefault(key, (shape, cfg))
    out: dict[tuple, tuple] = {}
    for key in sorted(cells, key=lambda k: -cells[k]):  # stable: ties keep their order
        out.setdefault(key[0], first[key])
    return out


def dataset_shape(dataset: Component) -> tuple[int, int, int, int, bool]:
    """(image size, classes, train size, test size, exact) of a dataset from its metadata."""
    cls = DATASETS.get(dataset.name)
    info = cls.info(cls.Config(**dataset.args))
    if None in (info.train_size, info.test_size, info.image_size):
        raise ValueError(f"dataset {dataset.name!r} declares no sizes in its info()")
    return info.image_size, info.num_classes, info.train_size, info.test_size, info.sizes_exact


def shape_of(cfg: RunConfig) -> Shape:
    """The cost shape of a cell."""
    from fpbench.engine.rounds import should_eval

    size, classes, train, test, exact = dataset_shape(cfg.dataset)
    part, t = cfg.partition.args, cfg.train
    clients = cfg.model_het.num_clients if cfg.model_het else part.get("num_clients", 10)
    heldout = part.get("heldout_frac", 0.0)
    shape = Shape(
        backbone=cfg.backbone.name,
        method=cfg.method.name,
        method_args=json.dumps(cfg.method.args, sort_keys=True),
        dataset=cfg.dataset.name,
        image_size=size,
        num_classes=classes,
        train_size=train,
        test_size=test,
        sizes_exact=exact,
        num_clients=clients,
        heldout_frac=heldout,
        shots=part.get("shots"),
        per_round=1,
        batch_size=t.batch_size,
        local_epochs=t.local_epochs,
        max_local_steps=t.max_local_steps,
        eval_batch_size=t.eval_batch_size,
        rounds=t.rounds,
        evals=sum(should_eval(r, t) for r in range(t.rounds)),
    )
    return replace(shape, per_round=max(1, math.floor(t.participation * shape.trainable + 1e-9)))


def plan(suite: Suite) -> list[tuple[Shape, RunConfig, int]]:
    """The suite's distinct shapes, each with its first cell and its number of cells."""
    found: dict[Shape, tuple[RunConfig, int]] = {}
    for cfg in suite.cells:
        shape = shape_of(cfg)
        first, n = found.get(shape, (cfg, 0))
        found[shape] = (first, n + 1)
    return [(s, cfg, n) for s, (cfg, n) in found.items()]


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device` (CPU: the kernel's MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def fake_dataset(shape: Shape, device: torch.device, seed: int = 0) -> ImageDataset:
    """Random uint8 images of the shape's sizes, made on `device`, and balanced labels.

    Raises MemoryError, before allocating, where the images would not leave half of the
    device's free memory for the model and its activations."""
    side, c = shape.image_size, shape.num_classes
    need, free = (shape.train_size + shape.test_size) * 3 * side * side, free_bytes(device)
    if need > free / 2:
        raise MemoryError(
            f"the fake {shape.dataset} images ({shape.train_size + shape.test_size:,} of "
            f"{side}px) take {need / 2**30:.1f} GiB, over half of the {free / 2**30:.1f} GiB "
            f"free on {device}: estimate this shape on a device with more memory"
        )
    gen = torch.Generator(device=device).manual_seed(seed)

    def images(n: int) -> torch.Tensor:
        size = (n, 3, side, side)
        return torch.randint(0, 256, size, generator=gen, device=device, dtype=torch.uint8)

    return ImageDataset(  # labels on the CPU, as a loader gives them (task_of moves them)
        name=f"fake-{shape.dataset}",
        train_images=images(shape.train_size),
        train_labels=torch.arange(shape.train_size) % c,
        test_images=images(shape.test_size),
        test_labels=torch.arange(shape.test_size) % c,
        class_names=[f"class {k}" for k in range(c)],
        coarse_of_class=torch.arange(c) * min(c, 20) // c,
        identity=f"fake:{seed}:{device}:{side}:{shape.train_size}:{shape.test_size}:{c}",
    )


def _offline_args(cfg: RunConfig) -> RunConfig:
    """The cell with every method setting that would load weights turned off (e.g. FGPT's
    pretrained timm select encoder), so nothing downloads, and FedMVP's fake classes with the
    one empty description each (fake data has no attribute descriptions: its cross-attention is
    measured on C keys, the official files give about 10 C)."""
    fields = METHODS.get(cfg.method.name).Config.model_fields
    args = dict(cfg.method.args)
    for key, value in (("select_pretrained", False), ("missing_descriptions", "class-name")):
        if key in fields:
            args[key] = value
    return cfg.model_copy(update={"method": cfg.method.model_copy(update={"args": args})})


def measure(
    shape: Shape,
    cfg: RunConfig,
    device: torch.device,
    precision: str,
    rounds: int = 2,
    memo: Memo | None = None,
    warm: bool = False,
) -> Measurement:
    """Time the parts of `rounds` rounds of the cell on fake data (see the module docstring),
    through the engine's own round (`fpbench.engine.rounds.play_round`). A round's time is
    the mean of the rounds, or with `warm` the fastest (the first pays one-time warm-up)."""
    from fpbench.engine.cell import Cell, sampling_schedule
    from fpbench.engine.cost import PeakMemory
    from fpbench.engine.rounds import evaluate_populations, play_round
    from fpbench.engine.seeding import derive_seed
    from fpbench.engine.task import task_of

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: the hub is never needed
    gc.collect()  # what an earlier shape left is not this shape's peak
    peak = PeakMemory(device)
    peak.start()
    part = {"num_clients": shape.num_clients, "heldout_frac": shape.heldout_frac}
    if shape.shots is not None:
        part["shots"] = shape.shots
    iid = Component(name="iid", label="iid", args=part)
    task = task_of(fake_dataset(shape, device), iid, 0, device)
    train = cfg.train.model_copy(  # the measured rounds evaluate only when asked to
        update={"rounds": max(cfg.train.rounds, rounds + 1), "eval_every": 10**9, "eval_last": 0}
    )
    runtime = cfg.runtime.model_copy(  # fake features are kept in memory, never on disk
        update={"precision": precision, "cache_features": cfg.runtime.cache_features and "memory"}
    )
    cfg = _offline_args(cfg).model_copy(
        update={"train": train, "runtime": runtime, "model_het": None}
    )  # a model-heterogeneity cell: every client on the default backbone
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    backbones = None if memo is None else memo.backbones
    cell = Cell.build(cfg, device, pretrained=False, backbones=backbones, task=task)
    share = shape.per_round / shape.trainable
    cell = cell.with_schedule(sampling_schedule(0, rounds, task.trainable_clients(), share))
    (population,) = cell.populations
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "init-params"))
    server = population.method.init_server(gen).to(device)
    sync()
    setup = time.perf_counter() - start
    splits = {s.what: s for s in population.inputs.discover(population.method, server)}
    frozen_s, frozen_n, train_s = 0.0, 0, []
    for r, ids in enumerate(cell.schedule):
        idx = torch.cat([task.train_idx[c] for c in ids])
        start = time.perf_counter()
        before = sum(s.computed for s in splits.values())
        for what, split in splits.items():
            if what.endswith("(train)"):
                split[idx]
        sync()
        frozen_s += time.perf_counter() - start
        frozen_n += sum(s.computed for s in splits.values()) - before
        start = time.perf_counter()
        server, _, _ = play_round(cell, server, r, [])
        sync()
        train_s.append(time.perf_counter() - start)
    start = time.perf_counter()
    for what, split in splits.items():
        if what.endswith("(test)"):
            split[:]
    sync()
    test_frozen = time.perf_counter() - start
    start = time.perf_counter()
    evaluate_populations(cell, {"": server}, [], 0, cell.seen(rounds - 1))
    sync()
    return Measurement(
        setup_s=setup,
        train_round_s=min(train_s) if warm else sum(train_s) / len(train_s),
        eval_s=time.perf_counter() - start,
        frozen_per_sample_s=frozen_s / frozen_n if frozen_n else 0.0,
        test_frozen_s=test_frozen,
        device=str(device),
        peak_mem_bytes=peak.read(),
    )


def frozen_s(shape: Shape, m: Measurement) -> float:
    """A cell's frozen passes: the train samples it is expected to touch, and the test split."""
    return m.frozen_per_sample_s * shape.expected_sampled * shape.per_client + m.test_frozen_s


def project(shape: Shape, m: Measurement) -> float:
    """A cell's projected seconds from its shape and a measurement."""
    return m.setup_s + shape.rounds * m.train_round_s + shape.evals * m.eval_s + frozen_s(shape, m)


def _measured(
    timed: list[Shape], cfg: RunConfig, device: torch.device, precision: str, rounds: int,
    memo: Memo, warm: bool,
) -> list[tuple[Shape, Measurement]] | str:  # fmt: skip
    """Each of `timed` measured in turn as the cell computes (the later ones one round: the
    first ran their kernels), or why that failed: one shape that cannot run here does not stop
    the others."""
    from fpbench.engine.numerics import cell_numerics

    try:
        with cell_numerics(cfg):
            return [
                (t, measure(t, cfg, device, precision, 1 if k else rounds, memo, warm))
                for k, t in enumerate(timed)
            ]
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def estimate(
    suite: Suite,
    device: torch.device | None,
    precision: str = "auto",
    rounds: int = 2,
    max_shapes: int | None = None,
    progress: Any = None,
    batches: int | None = None,
    memo: Memo | None = None,
    deadline: float | None = None,
) -> list[Estimate]:
    """Each shape's estimate; `device` None plans only (no measurement, nothing built).

    `max_shapes` measures only the first that many shapes (the others are listed unmeasured);
    `progress(i, n, shape)` is called before each measurement. `batches` scales (see the module
    docstring); `memo` carries what is reused into the next call; past `deadline`
    (`time.monotonic()`) no new measurement starts and the rest are listed with that error.
    """
    from fpbench.engine.build import resolve_precision

    memo = Memo() if memo is None else memo
    shapes = plan(suite)
    timed_as = representatives(shapes) if batches else {}
    out = []
    for i, (shape, cfg, n) in enumerate(shapes):
        if device is None or (max_shapes is not None and i >= max_shapes):
            out.append(Estimate(shape, cfg.method.label, n, None, None))
            continue
        group = cost_group(shape) if batches else None
        if group is None or group not in memo.groups:
            if deadline is not None and time.monotonic() > deadline:
                out.append(Estimate(shape, cfg.method.label, n, None, None, "out of time"))
                continue
            if progress is not None:
                progress(i, len(shapes), shape)
            dtype = resolve_precision(precision, device)
            if group is None:
                found = _measured([shape], cfg, device, dtype, rounds, memo, warm=False)
            else:
                rep, rep_cfg = timed_as[group]
                timed = [shrunk(rep, batches), shrunk(rep, 2 * batches)]
                found = memo.groups[group] = _measured(
                    timed, rep_cfg, device, dtype, rounds, memo, warm=True
                )
        else:
            found = memo.groups[group]
        if isinstance(found, str):
            out.append(Estimate(shape, cfg.method.label, n, None, None, found))
            continue
        m = found[0][1] if group is None else rescale(found, shape)
        out.append(Estimate(shape, cfg.method.label, n, m, project(shape, m)))
    return out


def as_dict(e: Estimate) -> dict[str, Any]:
    """An estimate as plain JSON-able data."""
    return {
        "shape": asdict(e.shape),
        "label": e.label,
        "cells": e.cells,
        "measured": asdict(e.measured) if e.measured else None,
        "cell_s": e.cell_s,
        "total_s": e.total_s,
        "error": e.error,
    }
