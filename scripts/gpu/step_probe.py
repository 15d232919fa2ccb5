#!/usr/bin/env python3
"""Where a paper cell's training round spends its GPU time, and what the frozen passes' precision
changes.

    python scripts/gpu/step_probe.py --json probe.json [--profile-out ops.txt]

On fake data of the real shape (`fpbench.measure.estimate.fake_dataset`) and random weights of
the real backbone, for sgpt-table1's SGPT cell at s = 10 (and fgpt-table1's first FGPT cell for
the key choice), through the engine's own round (`play_round`):

1. rounds of the cell, each timed (the round's new clients' frozen queries computed first, timed
   apart), one of them under torch.profiler: the device's busy fraction (kernel time / wall) and
   the op tables by device and by CPU time; the FLOPs of a round (torch's counter) and TFLOP/s;
2. the same round with deterministic mode off, and rounds with `runtime.compile` and with
   `runtime.precision = "bf16-frozen"` (alone and compiled);
3. the frozen Select queries of N samples computed in fp32, TF32 and bf16: time of each and how
   often the chosen group (nearest key; FGPT's top-k) differs from fp32's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import torch

from fpbench.engine.cell import Cell, sampling_schedule
from fpbench.engine.executor import derive_seed
from fpbench.engine.rounds import play_round
from fpbench.engine.runner import cell_numerics
from fpbench.engine.task import task_of
from fpbench.measure.estimate import _offline_args, fake_dataset, shape_of
from fpbench.methods.keys import select_groups
from fpbench.specs import Component
from fpbench.suites import load_suite

DEVICE = torch.device("cuda")
OVERRIDES: dict = {}  # --backbone / --max-steps, for a quick check on a small machine


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def cell(suite: str, method: str, label: str | None = None):
    """The suite's first cell of `method` (and partition `label`), offline, on DEVICE."""
    cells = [c for c in load_suite(suite).cells if c.method.name == method]
    cfg = _offline_args([c for c in cells if label in (None, c.partition.label)][0])
    train = cfg.train.model_copy(
        update={"eval_every": 10**9, "eval_last": 0, **OVERRIDES.get("train", {})}
    )
    rt = cfg.runtime.model_copy(update={"device": DEVICE.type})
    net = cfg.backbone.model_copy(update=OVERRIDES.get("backbone", {}))
    return cfg.model_copy(update={"train": train, "runtime": rt, "backbone": net})


def build(cfg):
    shape = shape_of(cfg)
    part = {"num_clients": shape.num_clients, "heldout_frac": shape.heldout_frac}
    iid = Component(name="iid", label="iid", args=part)
    task = task_of(fake_dataset(shape, DEVICE), iid, 0, DEVICE)
    cell = Cell.build(cfg, DEVICE, pretrained=False, task=task)
    share = shape.per_round / shape.trainable
    cell = cell.with_schedule(sampling_schedule(0, 8, task.trainable_clients(), share))
    gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "init-params"))
    server = cell.populations[0].method.init_server(gen).to(DEVICE)
    return shape, cell, server


def frozen_first(cell, r) -> float:
    """Compute round r's clients' frozen train values; seconds."""
    start = time.perf_counter()
    idx = torch.cat([cell.task.train_idx[c] for c in cell.schedule[r]])
    pop = cell.populations[0]
    gen = torch.Generator().manual_seed(0)
    for split in pop.inputs.discover(pop.method, pop.method.init_server(gen).to(DEVICE)):
        if split.what.endswith("(train)"):
            split[idx]
    sync()
    return time.perf_counter() - start


def timed_round(cell, server, r):
    start = time.perf_counter()
    server, _, _ = play_round(cell, server, r, [])
    sync()
    return server, time.perf_counter() - start


def busy_fraction(prof, wall_s: float) -> float:
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time for e in kernels) / 1e6 / wall_s


def probe_rounds(cfg, out: dict, profile_out: Path | None) -> None:
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with cell_numerics(cfg):
        shape, cell, server = build(cfg)
        rounds = []
        for r in range(3):
            fz = frozen_first(cell, r)
            server, s = timed_round(cell, server, r)
            rounds.append({"round": r, "frozen_s": fz, "train_s": s})
            print(f"round {r}: frozen {fz:.2f} s, train {s:.2f} s", flush=True)
        r = 3
        frozen_first(cell, r)
        with FlopCounterMode(display=False) as counter:
            play_round(cell, server, r, [])
        flops = counter.get_total_flops()
        _, s = timed_round(cell, server, r)
        out["round_flops"] = flops
        out["round_s"] = s
        out["tflops"] = flops / s / 1e12
        print(f"round {r} again: {s:.2f} s, {flops / 1e12:.1f} TFLOP, {flops / s / 1e12:.0f} "
              "TFLOP/s", flush=True)  # fmt: skip
        frozen_first(cell, 4)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, s = timed_round(cell, server, 4)
        out["profiled_round_s"] = s
        out["busy_fraction"] = busy_fraction(prof, s)
        print(f"profiled round: {s:.2f} s, device busy {out['busy_fraction']:.0%}", flush=True)
        table = prof.key_averages()
        text = table.table(sort_by="self_device_time_total", row_limit=30)
        text += "\n" + table.table(sort_by="self_cpu_time_total", row_limit=25)
        if profile_out:
            profile_out.write_text(text)
        print(table.table(sort_by="self_device_time_total", row_limit=18), flush=True)
        print(table.table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
        out["rounds"] = rounds
    with contextlib.suppress(Exception):
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        frozen_first(cell, 5)
        _, s = timed_round(cell, server, 5)
        out["nondeterministic_round_s"] = s
        print(f"round, deterministic mode off: {s:.2f} s", flush=True)


@contextlib.contextmanager
def precision(kind: str):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = kind == "tf32"
    dev = DEVICE.type
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if kind == "bf16" else None
    try:
        with ctx or torch.autocast(dev, enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def probe_select(cfg, n: int, topk: int, out: dict, name: str) -> None:
    """Queries of n train samples at three precisions: time and changed choices."""
    with cell_numerics(cfg):
        _, cell, server = build(cfg)
        task, method = cell.task, cell.populations[0].method
        fn = method.query  # Select's frozen query (SGPT, FGPT)
        keys = server.params["keys"] if "keys" in server.params else server.buffers["keys"]
        keys = keys.reshape(-1, keys.shape[-1]).float()
        images = task.data.train_images[:n]
        res = {}
        for kind in ("fp32", "tf32", "bf16"):
            qs = []
            sync()
            start = time.perf_counter()
            with precision(kind), torch.no_grad():
                for part in images.split(cfg.train.eval_batch_size):
                    qs.append(fn(method.backbone.preprocess(part)).float())
            sync()
            q = torch.cat(qs)
            res[kind] = (time.perf_counter() - start, q)
        base = select_groups(res["fp32"][1], keys, topk)
        fig = {"samples": n, "groups": len(keys), "topk": topk}
        for kind, (s, q) in res.items():
            picks = select_groups(q, keys, topk)
            fig[f"{kind}_s"] = s
            fig[f"{kind}_changed"] = float((picks != base).any(1).float().mean())
            fig[f"{kind}_rel_err"] = float((q - res["fp32"][1]).norm() / res["fp32"][1].norm())
        out[name] = fig
        print(name, json.dumps(fig), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--profile-out", type=Path)
    ap.add_argument("--select-samples", type=int, default=8192)
    ap.add_argument(
        "--skip",
        nargs="*",
        default=[],
        help="steps to leave out: rounds select-sgpt select-fgpt bf16+compile bf16-frozen "
        "bf16-frozen+compile bf16-frozen+cudnn bf16-frozen+compile+cudnn",
    )
    ap.add_argument("--round-flops", type=float, help="a round's FLOPs, where rounds is skipped")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backbone", help="another backbone (a quick check only)")
    ap.add_argument("--max-steps", type=int, help="train.max_local_steps (a quick check only)")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if args.backbone:
        OVERRIDES["backbone"] = {"name": args.backbone}
    OVERRIDES["round_flops"] = args.round_flops
    if args.max_steps:
        OVERRIDES["train"] = {"max_local_steps": args.max_steps}
    gpu = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    out: dict = {"gpu": gpu, "torch": torch.__version__}
    sgpt = cell("sgpt-table1", "sgpt", "path-s10")
    steps = [
        ("rounds", lambda: probe_rounds(sgpt, out, args.profile_out)),
        ("select-sgpt", lambda: probe_select(sgpt, args.select_samples, 1, out, "select_sgpt")),
        (
            "select-fgpt",
            lambda: probe_select(
                cell("fgpt-table1", "fgpt"), args.select_samples, 1, out, "select_fgpt"
            ),
        ),  # fmt: skip
        ("bf16+compile", lambda: probe_variant(sgpt, out, "bf16", True)),
        ("bf16-frozen", lambda: probe_variant(sgpt, out, "bf16-frozen", False)),
        ("bf16-frozen+compile", lambda: probe_variant(sgpt, out, "bf16-frozen", True, 3, True)),
        (
            "bf16-frozen+cudnn",
            lambda: probe_variant(sgpt, out, "bf16-frozen", False, 2, True, "cudnn"),
        ),  # fmt: skip
        (
            "bf16-frozen+compile+cudnn",
            lambda: probe_variant(sgpt, out, "bf16-frozen", True, 3, False, "cudnn"),
        ),  # fmt: skip
    ]
    for name, fn in steps:
        if name in args.skip:
            continue
        start = time.perf_counter()
        try:
            fn()
        except Exception as e:  # one probe that fails does not stop the others
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"
            print(f"{name} failed: {type(e).__name__}: {e}", flush=True)
        print(f"== {name} took {time.perf_counter() - start:.1f} s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(out, indent=2, default=str))


@contextlib.contextmanager
def attention(backend: str | None):
    """SDPA with `backend` first ("cudnn"), or PyTorch's own choice (None)."""
    if backend is None:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        yield


def probe_variant(
    cfg,
    out: dict,
    precision: str,
    compiled: bool,
    rounds: int = 3,
    profiled: bool = False,
    sdpa: str | None = None,
) -> None:
    """`rounds` rounds of the cell at this precision, compiled or not, attention `sdpa`: each
    round's seconds (the first includes compiling) and, with the baseline's FLOPs, TFLOP/s of
    the fastest after the first; the last round played twice from one state (bit-identical
    parameters: deterministic); `profiled`: that round under torch.profiler, its op table."""
    runtime = cfg.runtime.model_copy(update={"compile": compiled, "precision": precision})
    cfg = cfg.model_copy(update={"runtime": runtime})
    name = f"{precision}{'+compile' if compiled else ''}{f'+{sdpa}' if sdpa else ''}"
    with cell_numerics(cfg), attention(sdpa):
        _, cell, server = build(cfg)
        times = []
        for r in range(rounds):
            frozen_first(cell, r)
            server, s = timed_round(cell, server, r)
            times.append(s)
            print(f"{name} round {r}: {s:.2f} s", flush=True)
        frozen_first(cell, rounds)
        once = timed_round(cell, server, rounds)[0]
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                twice, s = timed_round(cell, server, rounds)
            print(f"{name} profiled round: {s:.2f} s, busy {busy_fraction(prof, s):.0%}")
            table = prof.key_averages()
            print(table.table(sort_by="self_device_time_total", row_limit=22), flush=True)
        else:
            twice = timed_round(cell, server, rounds)[0]
        same = all(torch.equal(once.params[k], twice.params[k]) for k in once.params)
    fig: dict = {"round_s": times, "deterministic": same}
    out.setdefault("round_flops", OVERRIDES.get("round_flops"))
    if out["round_flops"]:
        fig["tflops"] = out["round_flops"] / min(times[1:] or times) / 1e12
    out.setdefault("variants", {})[name] = fig
    print(name, json.dumps(fig), flush=True)


if __name__ == "__main__":
    main()
