"""Scaling benchmark: one train round and one evaluated round as the federation grows.

For a method on a synthetic federation of `clients` clients (fake images, a test split growing
with the clients, `sampled` clients trained a round whatever the federation's size), prints one
JSON line: the seconds of a train round (`train_clients` over the sampled clients), of an
evaluation (`evaluate` of every client, as an evaluated round adds it), and the process's peak
resident memory. One measurement a process, so the peak is that configuration's; it imports only
what fpbench's engine had before this file, so the same file times older code:

    python fpbench/measure/scaling.py --method fedrep --clients 100
    /work/main/.venv/bin/python fpbench/measure/scaling.py --method fedrep --clients 100

`scripts/scaling_bench.sh` runs the grid, both codes interleaved on the same load.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import time

import torch


def config(
    method: str,
    clients: int,
    sampled: int,
    backbone: str,
    classes: int,
    train_per_client: int,
    test_per_client: int,
    batch: int,
    eval_batch: int,
):
    """The run config of one synthetic federation (one round, one local epoch)."""
    from fpbench.suites import expand_suite

    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": backbone},
            "dataset": {
                "num_classes": classes,
                "train_per_class": math.ceil(clients * train_per_client / classes),
                "test_per_class": math.ceil(clients * test_per_client / classes),
            },
            "partition": {"num_clients": clients},
            "train": {
                "rounds": 1,
                "participation": min(1.0, sampled / clients),
                "batch_size": batch,
                "eval_batch_size": eval_batch,
            },
            "runtime": {"device": "cpu", "precision": "fp32"},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "iid"}],
        "methods": [{"name": method}],
    }
    return expand_suite(raw, name="scaling").cells[0]


def measure(args: argparse.Namespace) -> dict[str, object]:
    from fpbench.engine.build import build_method
    from fpbench.engine.evaluate import evaluate
    from fpbench.engine.executor import train_clients
    from fpbench.engine.task import build_task

    torch.manual_seed(0)
    cfg = config(
        args.method,
        args.clients,
        args.sampled,
        args.backbone,
        args.classes,
        args.train_per_client,
        args.test_per_client,
        args.batch,
        args.eval_batch,
    )
    dev = torch.device("cpu")
    task = build_task(cfg, dev)
    method = build_method(cfg, task, dev, pretrained=False)
    server = method.init_server(torch.Generator().manual_seed(0))
    ids = task.trainable_clients()[: args.sampled]
    before = _peak_mb()
    start = time.perf_counter()
    result = train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0)
    train_s = time.perf_counter() - start
    del result
    start = time.perf_counter()
    if args.full_split is None:
        evaluate(method, server, task, cfg.train.eval_batch_size)
    else:  # train.full_split_clients (not in older code)
        full = args.full_split if args.full_split in ("all", "none") else int(args.full_split)
        evaluate(method, server, task, cfg.train.eval_batch_size, full_split=full)
    eval_s = time.perf_counter() - start
    return {
        "method": args.method,
        "clients": args.clients,
        "sampled": len(ids),
        "full_split": args.full_split or "all",
        "test": len(task.data.test_labels),
        "train_round_s": round(train_s, 3),
        "eval_s": round(eval_s, 3),
        "evaluated_round_s": round(train_s + eval_s, 3),
        "peak_mb_built": round(before, 1),
        "peak_mb": round(_peak_mb(), 1),
    }


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="fedrep")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--sampled", type=int, default=10, help="clients trained a round")
    p.add_argument("--backbone", default="vit-smoke")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-per-client", type=int, default=60)
    p.add_argument("--test-per-client", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=256)
    p.add_argument("--full-split", default=None, help="train.full_split_clients (newer code)")
    print(json.dumps(measure(p.parse_args())), flush=True)


if __name__ == "__main__":
    main()
