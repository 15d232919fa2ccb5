"""`fpbench bench`: training, head-tuning and evaluation throughput of the engine.

Measures on one backbone (random weights: speed does not depend on their values) and a synthetic
federation of `clients` clients with `steps` minibatches of `batch` samples each:

* local-training samples/s of one FedVPT round with the reference executor (one client at a
  time) and the lockstep executor (all clients in one pass), and their ratio;
* head-tune's per-round time with frozen features computed on the fly vs cached, and the ratio;
* FedRep's per-round time (10 head-only epochs, then 1 prompt epoch) with the head phase's
  backbone outputs recomputed every epoch vs kept for the phase (`fpbench.backbones.recall`), and
  the ratio;
* evaluation samples/s (one pass over the test split);
* on CUDA, the achieved TFLOP/s of the lockstep step and its fraction of the device's bf16 peak.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode

from fpbench.engine.build import resolve_device, resolve_precision
from fpbench.engine.cell import Cell
from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import train_clients
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.engine.precision import autocast
from fpbench.suites import expand_suite

# Dense bf16 tensor-core peaks (FLOP/s), from the vendors' data sheets.
BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
    "RTX 4090": 165e12,
}


def bench(
    backbone: str = "vit-smoke",
    clients: int = 5,
    batch: int = 32,
    steps: int = 4,
    device: str = "auto",
    precision: str = "auto",
    repeats: int = 3,
) -> dict[str, object]:
    """Run the benchmark; returns the figures (see the module docstring)."""
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    cfg = _config(backbone, clients, batch, steps, dev, prec)
    cell = Cell.build(cfg, dev, pretrained=False)
    task, fedvpt = cell.task, cell.populations[0].method
    ids = task.trainable_clients()
    samples = sum(len(task.train_idx[c]) for c in ids)
    out: dict[str, object] = {
        "backbone": backbone,
        "device": str(dev),
        "precision": prec,
        "clients": clients,
        "batch": batch,
        "steps": steps,
    }
    server = fedvpt.init_server(torch.Generator().manual_seed(0))
    seconds = {}
    for executor in ("reference", "lockstep"):
        seconds[executor] = _time(
            lambda e=executor: train_clients(
                fedvpt,
                server,
                task,
                ids,
                cfg.train,
                round_idx=0,
                seed=0,
                executor=e,
                precision=prec,
            ),
            dev,
            repeats,
        )
        out[f"train_samples_per_s_{executor}"] = samples / seconds[executor]
    out["lockstep_vs_reference"] = (
        out["train_samples_per_s_lockstep"] / out["train_samples_per_s_reference"]
    )
    out.update(_headtune(cfg, task, dev, prec, ids, repeats))
    out.update(_resume(cfg, task, dev, prec, ids, repeats))
    test_s = _time(
        lambda: evaluate(fedvpt, server, task, cfg.train.eval_batch_size, precision=prec),
        dev,
        repeats,
    )
    out["eval_samples_per_s"] = len(task.data.test_labels) / test_s
    if dev.type == "cuda":
        out.update(_flops(fedvpt, server, task, ids, cfg, prec, dev, seconds["lockstep"]))
    return out


def _config(backbone: str, clients: int, batch: int, steps: int, dev: torch.device, prec: str):
    per_class = math.ceil(clients * batch * steps / 10)
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": backbone},
            "dataset": {"num_classes": 10, "train_per_class": per_class, "test_per_class": 100},
            "partition": {"num_clients": clients},
            "train": {"rounds": 1, "batch_size": batch, "eval_batch_size": 4 * batch},
            "runtime": {"device": str(dev), "precision": prec},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "iid"}],
        "methods": [{"name": "fedvpt"}],
    }
    return expand_suite(raw, name="bench").cells[0]


def _with_method(cfg, task, dev: torch.device, name: str):
    """The config with another method (default args), and that method built."""
    method_cfg = cfg.method.model_copy(update={"name": name, "args": {}})
    cfg = cfg.model_copy(update={"method": method_cfg})
    return cfg, Cell.build(cfg, dev, pretrained=False, task=task).populations[0].method


def _headtune(
    cfg, task, dev: torch.device, prec: str, ids: list[int], repeats: int
) -> dict[str, float]:
    cfg, method = _with_method(cfg, task, dev, "head-tune")
    server = method.init_server(torch.Generator().manual_seed(0))
    start = time.perf_counter()
    with autocast(dev, prec):
        cached = Inputs.of(method, task, FeatureCache(), cfg.train.eval_batch_size)
        for split in cached.discover(method, server):  # computed lazily otherwise: all, now
            split[:]
    _sync(dev)
    build_s = time.perf_counter() - start
    on_the_fly = Inputs.of(method, task)
    times = {}
    for name, inputs in (("uncached", on_the_fly), ("cached", cached)):
        times[name] = _time(
            lambda i=inputs: train_clients(
                method, server, task, ids, cfg.train, round_idx=0, seed=0, inputs=i, precision=prec
            ),
            dev,
            repeats,
        )
    return {
        "headtune_round_s_uncached": times["uncached"],
        "headtune_round_s_cached": times["cached"],
        "headtune_cached_speedup": times["uncached"] / times["cached"],
        "headtune_cache_build_s": build_s,
    }


def _resume(
    cfg, task, dev: torch.device, prec: str, ids: list[int], repeats: int
) -> dict[str, float]:
    cfg, method = _with_method(cfg, task, dev, "fedrep")
    server = method.init_server(torch.Generator().manual_seed(0))
    times = {
        name: _time(
            lambda r=reuse: train_clients(
                method, server, task, ids, cfg.train, round_idx=0, seed=0,
                precision=prec, reuse_frozen=r,
            ),
            dev,
            repeats,
        )
        for name, reuse in (("recomputed", False), ("cached", True))
    }  # fmt: skip
    return {
        "fedrep_round_s_recomputed": times["recomputed"],
        "fedrep_round_s_cached": times["cached"],
        "hidden_cache_speedup": times["recomputed"] / times["cached"],
    }


def _flops(
    method, server, task, ids, cfg, prec: str, dev: torch.device, seconds: float
) -> dict[str, object]:
    """FLOPs of one lockstep round, counted by torch, over its measured `seconds`."""
    with FlopCounterMode(display=False) as counter:
        train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, precision=prec)
    achieved = counter.get_total_flops() / seconds
    name = torch.cuda.get_device_name(dev)
    peak = next((v for k, v in BF16_PEAK.items() if k in name), None)
    return {
        "gpu": name,
        "tflops": achieved / 1e12,
        "bf16_peak_fraction": achieved / peak if peak else None,
    }


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], object], dev: torch.device, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call."""
    fn()
    _sync(dev)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]
