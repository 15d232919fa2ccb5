#!/usr/bin/env python3
"""Time fpbench's SGPT next to the official SGPT code (ubc-tea/SGPT) on one identical setting.

Both sides get the same fake CIFAR-100 (the release's native pickle format, N train / M test
images per class), the same random ViT weights (one Google-layout `.npz`, read by the official
code's `load_from` and by fpbench through timm), 10 clients of 10 classes each, 2 clients a round,
1 epoch per stage, batch 16, evaluation every round. The official code runs unchanged through the
timing scripts of the steering repo's `shared/peer-sgpt` (called by path, never copied); fpbench
runs the same setting as a suite written to the scratch folder, once per `--precision` (the
official code runs fp32). Prints wall time per round and per run of each side and the ratios
(official / fpbench: above 1 means fpbench is faster).

    python tests/peer/sgpt_side_by_side.py --peer /path/to/SGPT --setting tiny --rounds 1

Settings (the peer README's): `tiny` (ViT 192 wide, 3 heads, MLP 768, 4 blocks, patch 16: the
registered `vit-ti16-d4`; G = 4, shared blocks 0-1, group blocks 2-3) and `vit-b16` (ViT-B/16;
G = 20, shared blocks 0-3, group blocks 4-6). Both run with torch's default thread count; a
whole run is timed from the start of the peer's `main_prompt.py` and from fpbench's `run_cell`
(after the interpreter has imported torch on both sides) to the end of the last round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SETTINGS = {
    "tiny": {
        "arch": (192, 3, 768, 4, 16),
        "backbone": "vit-ti16-d4",
        "peer": ["--model_type", "ViT-tiny_16", "--key_prompt", "4"]
        + ["--share_blocks", "0", "1", "--share_blocks_g", "2", "3"],
        "tiny": ["--tiny", "192,3,768,4,16", "--config-name", "ViT-tiny_16"],
        "sgpt": {"num_groups": 4, "shared_layers": [0, 1], "group_layers": [2, 3]},
    },
    "vit-b16": {
        "arch": (768, 12, 3072, 12, 16),
        "backbone": "vit-b16-in21k",
        "peer": ["--model_type", "ViT-B_16", "--key_prompt", "20"]
        + ["--share_blocks", "0", "1", "2", "3", "--share_blocks_g", "4", "5", "6"],
        "tiny": ["--tiny", "none"],
        "sgpt": {"num_groups": 20, "shared_layers": [0, 1, 2, 3], "group_layers": [4, 5, 6]},
    },
}

SUITE = """name = "sgpt-side-by-side"
description = "fpbench's side of the side-by-side with the official SGPT code ({setting})"
seeds = [0]
[defaults]
partition = {{ num_clients = 10 }}
runtime = {{ device = "{device}", precision = "{precision}" }}
[defaults.backbone]  # the official code's CIFAR-100 normalisation
name = "{backbone}"
weights = "{weights}"
mean = [0.5071, 0.4865, 0.4409]
std = [0.2673, 0.2564, 0.2762]
[defaults.train]
rounds = {rounds}
participation = 0.2
local_epochs = 1
batch_size = 16
lr = 0.01
momentum = 0.9
weight_decay = 1e-5
eval_every = 1
eval_batch_size = 160
[[datasets]]
name = "cifar100"
[[partitions]]
name = "pathological"
s = 10
[[methods]]
name = "sgpt"
{sgpt}
"""

# fpbench's side, run in a fresh interpreter like the official code's: times run_cell
FPBENCH_SIDE = """
import json, sys, time
import torch
from pathlib import Path
from fpbench.engine.runner import run_cell
from fpbench.suites import load_suite
from fpbench.store import Store
suite, db, out = sys.argv[1:4]
cfg = load_suite(suite).cells[0]
store = Store(f"sqlite:///{db}")
start = time.perf_counter()
result = run_cell(cfg, store, checkpoint_dir=Path(db).parent / "checkpoints")
total = time.perf_counter() - start
run = store.find_run(cfg.run_key)
rounds = store.rounds(run.id)["wall_s"].tolist()
Path(out).write_text(json.dumps({"status": result.status, "total_s": total, "rounds_s": rounds,
                                 "threads": torch.get_num_threads()}))
"""


def run(cmd: list[str], **kw) -> None:
    shown = ["<fpbench side>" if "\n" in str(c) else str(c) for c in cmd]
    print("$", " ".join(shown), file=sys.stderr, flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def prepare(scripts: Path, scratch: Path, setting: dict, train: int, test: int) -> Path:
    """Fake CIFAR-100 and the random .npz, shared by both sides; returns the .npz."""
    py = sys.executable
    run([py, "-B", scripts / "make_fake_cifar100.py", "--root", scratch / "data"]
        + ["--train-per-class", train, "--test-per-class", test])  # fmt: skip
    hidden, heads, mlp, layers, patch = setting["arch"]
    npz = scratch / f"vit-{hidden}-{layers}.npz"
    run([py, "-B", scripts / "make_fake_vit_npz.py", "--out", npz, "--hidden", hidden]
        + ["--heads", heads, "--mlp", mlp, "--layers", layers, "--patch", patch])  # fmt: skip
    return npz


def official(scripts: Path, peer: Path, scratch: Path, setting: dict, npz: Path, args) -> dict:
    """The official code's timings (run_peer.py's JSON)."""
    out, logs = scratch / "peer.json", scratch / "peer-logs"
    cmd = [sys.executable, "-B", scripts / "run_peer.py", "--peer", peer, *setting["tiny"]]
    cmd += ["--timings", out, "--log", scratch / "peer.log", "--"]
    cmd += ["--dataset", "cifar100", "--partition", "noniid-labeluni", "--device", args.device]
    cmd += [*setting["peer"], "--pretrained_dir", npz, "--datadir", scratch / "data"]
    cmd += ["--logdir", logs, "--n_parties", "10", "--cls_num", "10", "--sample", "0.2"]
    cmd += ["--epochs", "1", "--batch-size", "16", "--comm_round", args.rounds, "--test_round"]
    cmd += ["1", "--avg_key", "--rho", "0.9", "--moment", "0.5", "--lr", "0.01", "--init_seed", "0"]
    with open(scratch / "peer.err", "w") as err:
        run(cmd, stdout=subprocess.DEVNULL, stderr=err)
    found = json.loads(out.read_text())
    return {"total_s": found["total_s"], "rounds_s": [r["wall_s"] for r in found["rounds"]]}


def ours(scratch: Path, setting: dict, npz: Path, args, precision: str) -> dict:
    """fpbench's timings on the same data and weights, at this precision."""
    sgpt = "\n".join(f"{k} = {json.dumps(v)}" for k, v in setting["sgpt"].items())
    suite = scratch / "side-by-side.toml"
    suite.write_text(
        SUITE.format(
            setting=args.setting, backbone=setting["backbone"], weights=npz, rounds=args.rounds,
            device=args.device, precision=precision, sgpt=sgpt,
        )
    )  # fmt: skip
    out = scratch / f"fpbench-{precision}.json"
    env = {**os.environ, "FPBENCH_DATA": str(scratch / "data"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-c", FPBENCH_SIDE, suite, scratch / f"fpbench-{precision}.db", out]
    run(cmd, env=env, cwd=scratch)
    found = json.loads(out.read_text())
    if found["status"] != "done":
        sys.exit(f"fpbench's run ended {found['status']}")
    return found


def report(peer: dict, mine: dict[str, dict], args) -> str:
    """The table: the official code's seconds, then fpbench's and the ratio at each precision."""

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def row(name: str, pick) -> str:
        cells = [f"{name:18} {pick(peer):11.2f}"]
        cells += [f"{pick(m):10.2f} {pick(peer) / pick(m):6.2f}" for m in mine.values()]
        return " ".join(cells)

    head = [f"{'':18} {'official s':>11}"]
    head += [f"{'fpbench ' + p:>10} {'ratio':>6}" for p in mine]
    lines = [
        f"SGPT side by side: setting {args.setting}, {args.rounds} round(s), device "
        f"{args.device}, {args.train_per_class} train / {args.test_per_class} test per class",
        " ".join(head),
        row("whole run", lambda d: d["total_s"]),
        row("per round (mean)", lambda d: mean(d["rounds_s"])),
    ]
    lines += [row(f"round {r}", lambda d, r=r: d["rounds_s"][r]) for r in range(args.rounds)]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", type=Path, required=True, help="checkout of ubc-tea/SGPT")
    ap.add_argument(
        "--peer-scripts", type=Path, default=REPO.parent / "shared" / "peer-sgpt",
        help="the steering repo's shared/peer-sgpt (default: ../shared/peer-sgpt)",
    )  # fmt: skip
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="tiny")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of each run (1 or 3 in README)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda, for both sides")
    ap.add_argument(
        "--precision", nargs="+", default=["auto"], choices=["auto", "fp32", "bf16", "bf16-frozen"],
        help="fpbench's precision(s), one run each (auto: bf16 on CUDA; the official code: fp32)",
    )  # fmt: skip
    ap.add_argument("--train-per-class", type=int, default=5)
    ap.add_argument("--test-per-class", type=int, default=2)
    ap.add_argument("--scratch", type=Path, help="work folder outside any git repo (default: tmp)")
    ap.add_argument("--json", type=Path, help="also write both sides' timings here")
    args = ap.parse_args()
    for path, what in ((args.peer / "main_prompt.py", "--peer"), (args.peer_scripts, "scripts")):
        if not path.exists():
            sys.exit(f"{path} not found: give {what} (see the README's speed section)")
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="sgpt-side-by-side-"))
    scratch.mkdir(parents=True, exist_ok=True)
    setting = SETTINGS[args.setting]
    start = time.perf_counter()
    npz = prepare(args.peer_scripts, scratch, setting, args.train_per_class, args.test_per_class)
    peer = official(args.peer_scripts, args.peer, scratch, setting, npz, args)
    mine = {p: ours(scratch, setting, npz, args, p) for p in args.precision}
    print(report(peer, mine, args))
    print(f"(both sides in {time.perf_counter() - start:.0f} s; scratch {scratch})")
    if args.json:
        args.json.write_text(json.dumps({"official": peer, "fpbench": mine}, indent=2))


if __name__ == "__main__":
    main()
