"""Per-method round time on the tiny federation: one lockstep round, with the run's frozen store.

For every registered method (or those named), on the conformance kit's tiny federation (4 clients,
synthetic data, the test-sized ViT or CLIP, CPU): one warm-up round fills the frozen store, then
`--repeats` rounds are timed (median), and the samples that pass through the backbone's first
block (ViT) or the image tower's first convolution (CLIP) in one round are counted (a speed
measure that does not depend on the machine's load). Uses only what the engine had before and
after issue #32, so the same script measures both:

    PYTHONPATH=<checkout> python scripts/method_round_times.py --out times.json [names...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def _counter(backbone) -> tuple[list[int], object]:
    """A hook counting the samples through the first backbone block (ViT) or the image tower's
    first convolution (CLIP: every image path starts there)."""
    seen = [0]
    module = backbone.vit.blocks[0] if hasattr(backbone, "vit") else backbone.model.visual.conv1
    hook = module.register_forward_hook(
        lambda _m, args, _o: seen.__setitem__(0, seen[0] + args[0].shape[0])
    )
    return seen, hook


def measure(name: str, repeats: int) -> dict[str, float]:
    from fpbench.engine.cell import Cell
    from fpbench.engine.executor import train_clients
    from fpbench.engine.inputs import FeatureCache
    from fpbench.testing.tiny import seeded_server, tiny_config

    cfg = tiny_config(name, local_epochs=2)
    cell = Cell.build(cfg, torch.device("cpu"), cache=FeatureCache())
    task, (population,) = cell.task, cell.populations
    method, inputs = population.method, population.inputs
    server = seeded_server(method)
    ids = task.trainable_clients()

    def one_round() -> None:
        train_clients(method, server, task, ids, cfg.train, round_idx=0, seed=0, inputs=inputs)

    one_round()  # warm-up: fills the frozen store
    seen, hook = _counter(method.backbone)
    try:
        times = []
        for _ in range(repeats):
            seen[0] = 0
            start = time.perf_counter()
            one_round()
            times.append(time.perf_counter() - start)
    finally:
        hook.remove()
    return {"round_s": statistics.median(times), "backbone_samples": seen[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="methods (default: every registered one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("FPBENCH_CACHE", tempfile.mkdtemp(prefix="fpbench-times-"))
    torch.set_num_threads(1)
    from fpbench.registry import METHODS

    results = {}
    for name in args.names or METHODS.names():
        results[name] = measure(name, args.repeats)
        r = results[name]
        print(f"{name:24s} {r['round_s'] * 1000:9.1f} ms  {r['backbone_samples']:6d} samples")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
