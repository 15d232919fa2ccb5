#!/usr/bin/env python3
"""What counting a round's FLOPs costs: the same round timed plainly and under
`fpbench.engine.cost.count_flops` (PyTorch's FlopCounterMode), alternately, on synthetic data
with random weights of the backbone.

    python scripts/cost_overhead.py --backbone vit-test --image-size 16
    python scripts/cost_overhead.py --backbone vit-b16-in21k --image-size 32 --device cuda

Frozen work is done before the timing (a warm-up round), so each timed round is training,
aggregation and an evaluation. Prints each repetition and the ratio of the medians; with
`--flop-counter-mode`, PyTorch's own `FlopCounterMode` is timed beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
from torch.utils.flop_counter import FlopCounterMode

from fpbench.engine.build import resolve_device
from fpbench.engine.cell import Cell
from fpbench.engine.cost import count_flops
from fpbench.engine.inputs import FeatureCache
from fpbench.engine.rounds import play_round
from fpbench.engine.runner import cell_numerics
from fpbench.suites import expand_suite


def config(args: argparse.Namespace):
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": args.backbone},
            "runtime": {"device": args.device},
            "train": {"rounds": 3, "batch_size": args.batch, "participation": 1.0},
            "dataset": {
                "num_classes": 10,
                "image_size": args.image_size,
                "train_per_class": args.per_class,
                "test_per_class": args.per_class // 2,
            },  # fmt: skip
            "partition": {"num_clients": args.clients},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "iid"}],
        "methods": [{"name": args.method}],
    }
    return expand_suite(raw, name="cost-overhead").cells[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="sgpt")
    ap.add_argument("--backbone", default="vit-test")
    ap.add_argument("--image-size", type=int, default=16)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-class", type=int, default=20, help="train images per class")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--flop-counter-mode", action="store_true", help="also time FlopCounterMode")
    args = ap.parse_args()
    cfg = config(args)
    device = resolve_device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with cell_numerics(cfg):
        cell = Cell.build(cfg, device, cache=FeatureCache(), pretrained=False)
        cell = cell.with_schedule([cell.task.trainable_clients()] * 2)  # every client, twice
        server = cell.populations[0].method.init_server(torch.Generator().manual_seed(0))
        server = server.to(device)
        play_round(cell, server, 0, [])  # warm-up: the frozen passes
        ways = {"plain": nullcontext, "counted": count_flops}
        if args.flop_counter_mode:
            ways["FlopCounterMode"] = lambda: FlopCounterMode(display=False)
        times: dict[str, list[float]] = {way: [] for way in ways}
        flops = 0
        for rep in range(args.reps):
            for way, mode in ways.items():
                sync()
                start = time.perf_counter()
                with mode() as found:
                    play_round(cell, server, 1, [])
                sync()
                times[way].append(time.perf_counter() - start)
                flops = found.total if way == "counted" else flops
                print(f"rep {rep} {way}: {times[way][-1]:.3f} s")
    median = {way: statistics.median(t) for way, t in times.items()}
    shown = ", ".join(
        f"{m:.3f} s {way}" + ("" if way == "plain" else f" ({m / median['plain']:.2f}x)")
        for way, m in median.items()
    )
    print(
        f"{args.method} on {args.backbone} ({args.image_size}px, {device}), medians of "
        f"{args.reps}: a round {shown}; {flops / 1e9:,.2f} GFLOP"
    )


if __name__ == "__main__":
    main()
