#!/usr/bin/env python3
"""Time a paper-sized run: SGPT on CIFAR-100, s = 10, the cell of `sgpt-table1`, on fake data of
the real shape (50,000 / 10,000 images in the release's pickle format) and random ViT-B/16
weights (saved to a file and loaded through the real loading path).

    python scripts/gpu/paper_run.py --rounds 10 --scratch /tmp/paper-run --json run.json

Everything but the weights, the data and the number of rounds is the suite's: 100 clients, 5 a
round, 5 + 5 local epochs, batch 40, evaluation every 5th round and each of the last 10. The
first `--rounds` rounds run (evaluation every 5th; the last-10 rule is left out so that the
measured rounds mix training and evaluation as the whole run does) and the whole run is
extrapolated: setup + round 0 + the first evaluated round (it computes the test split's frozen
queries, once) + the other training and evaluated rounds at their measured means. A client's
first round computes its frozen queries too, and the first rounds sample more new clients than
the later ones, so the extrapolation is an upper bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # for tests.test_datasets' native-format writer

from fpbench.engine.rounds import Observer, should_eval  # noqa: E402
from fpbench.store import Store  # noqa: E402
from fpbench.suites import load_suite  # noqa: E402


class Rounds(Observer):
    """Prints each round's time as it ends (the log survives a timeout)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def round_end(self, cfg, round_idx, metrics) -> None:
        now = time.perf_counter()
        acc = metrics.get("acc_global")
        shown = "" if acc is None else f" acc_global {acc:.4f}"
        print(f"round {round_idx}: {now - self.last:.2f} s{shown}", flush=True)
        self.last = now


def paper_cell(
    backbone: str,
    weights: Path,
    rounds: int,
    device: str,
    deterministic: bool,
    precision: str = "auto",
    compiled: bool = False,
):
    """sgpt-table1's SGPT cell at s = 10 with this backbone, its weights, rounds, device,
    deterministic mode, precision and compilation."""
    cells = load_suite("sgpt-table1").cells
    (cfg,) = [c for c in cells if c.method.name == "sgpt" and c.partition.label == "path-s10"]
    train = cfg.train.model_copy(update={"rounds": rounds, "eval_last": 0})
    net = cfg.backbone.model_copy(update={"name": backbone, "weights": str(weights)})
    runtime = cfg.runtime.model_copy(
        update={
            "device": device,
            "deterministic": deterministic,
            "precision": precision,
            "compile": compiled,
        }
    )
    return cfg, cfg.model_copy(update={"train": train, "backbone": net, "runtime": runtime})


def data_root(scratch: Path, per_class: tuple[int, int]) -> Path:
    return scratch / f"data-{per_class[0]}-{per_class[1]}"


def prepare(scratch: Path, per_class: tuple[int, int], backbone: str) -> Path:
    """The fake CIFAR-100 (train / test images per class) and a random weights file."""
    import torch

    from fpbench.backbones import create_backbone
    from tests.test_datasets import write_cifar100

    if not (data_root(scratch, per_class) / "cifar-100-python" / "meta").exists():
        write_cifar100(data_root(scratch, per_class), *per_class)
    weights = scratch / f"{backbone}-random.pth"
    if not weights.exists():
        vit = create_backbone(backbone, pretrained=False).vit  # the seeded random init
        torch.save(vit.state_dict(), weights)
    return weights


@contextlib.contextmanager
def profiled(path: Path | None):
    """torch.profiler around the run, its op tables (by device time, by CPU time) to `path`."""
    if path is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    table = prof.key_averages()
    path.write_text(
        table.table(sort_by="self_device_time_total", row_limit=40)
        + "\n"
        + table.table(sort_by="self_cpu_time_total", row_limit=25)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rounds", type=int, default=10, help="rounds to run (of 60; 6 or more to extrapolate)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backbone", default="vit-b16-in21k", help="another only for a quick check")
    ap.add_argument("--profile", type=Path, help="profile the run; op tables to this file")
    ap.add_argument(
        "--no-deterministic", dest="deterministic", action="store_false",
        help="runtime.deterministic = false (to measure what the mode costs)",
    )  # fmt: skip
    ap.add_argument("--precision", default="auto", help="runtime.precision (auto: bf16 on CUDA)")
    ap.add_argument("--compile", action="store_true", help="runtime.compile = true")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/fpbench-paper-run"))
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument(
        "--per-class", type=int, nargs=2, default=(500, 100), metavar=("TRAIN", "TEST"),
        help="fake images per class (the real shape: 500 100; fewer for a quick check)",
    )  # fmt: skip
    args = ap.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    weights = prepare(args.scratch, tuple(args.per_class), args.backbone)
    os.environ["FPBENCH_DATA"] = str(data_root(args.scratch, tuple(args.per_class)))
    full, cfg = paper_cell(
        args.backbone,
        weights,
        args.rounds,
        args.device,
        args.deterministic,
        args.precision,
        args.compile,
    )
    from fpbench.engine.runner import run_cell

    db, ck = args.scratch / "paper-run.db", args.scratch / "ck"
    db.unlink(missing_ok=True)  # a fresh run each time: a stored one would be skipped
    shutil.rmtree(ck, ignore_errors=True)
    store = Store(f"sqlite:///{db}")
    start = time.perf_counter()
    with profiled(args.profile):
        result = run_cell(cfg, store, checkpoint_dir=ck, observer=Rounds())
    total = time.perf_counter() - start
    if result.status != "done":
        sys.exit(f"the run ended {result.status}: {result.error}")
    walls = store.rounds(store.find_run(cfg.run_key).id)["wall_s"].tolist()
    evaluated = [r for r in range(1, len(walls)) if should_eval(r, cfg.train)]
    trained = [r for r in range(1, len(walls)) if r not in evaluated]
    mean = lambda rs: sum(walls[r] for r in rs) / len(rs) if rs else None  # noqa: E731
    n_eval = sum(should_eval(r, full.train) for r in range(full.train.rounds))
    setup = total - sum(walls)
    later = evaluated[1:] or evaluated  # after the first, which computes the test queries
    whole = None  # needs a measured training round and evaluated round after round 0
    if trained and evaluated:
        whole = setup + walls[0] + walls[evaluated[0]]
        whole += (full.train.rounds - n_eval - 1) * mean(trained) + (n_eval - 1) * mean(later)
    figures = {
        "rounds_run": len(walls),
        "setup_s": setup,
        "round0_s": walls[0],
        "train_round_s": mean(trained),
        "first_eval_round_s": walls[evaluated[0]] if evaluated else None,
        "eval_round_s": mean(later),
        "rounds_s": walls,
        "full_rounds": full.train.rounds,
        "full_evaluated_rounds": n_eval,
        "full_run_s_extrapolated": whole,
    }
    for k, v in figures.items():
        print(f"{k:24} {v:.2f}" if isinstance(v, float) else f"{k:24} {v}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
