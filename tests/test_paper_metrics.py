"""Every metric a paper table names is recorded by the method that fills the cell.

For each cell of `benchmarks/papers/*.toml` (all five papers) that fpbench fills and the paper
reports a value for, the suite cells it selects give a method (name and resolved args) and a
metric. Each distinct method is run on a tiny federation (synthetic data, `vit-test` /
`clip-test`, one round, held-out clients, two style domains) and must store every metric its
cells ask for. Derived metrics (`rounds_to_target`, ...) need their `target_metric`;
`acc_domain_<d>` needs some `acc_domain_*` (the domain names are the real dataset's).
Method args the tiny test backbone cannot take (blocks of ViT-B, timm select encoders, more
orthogonal keys than its width) fall back to the method's defaults for those args.
"""

from __future__ import annotations

import json
import zlib
from collections import defaultdict
from functools import cache
from typing import Any

import pytest

from fpbench.errors import FpbenchError
from fpbench.registry import METHODS
from fpbench.report.paper import DERIVED
from fpbench.store import Store
from fpbench.suites import expand_suite
from tests.test_paper_suites import WANTED, _matches, _suite

Key = tuple[str, str]  # (method name, resolved args as JSON)


def _needed(spec: dict[str, Any]) -> str:
    metric = str(spec["metric"])
    if metric in DERIVED:
        return str(spec.get("target_metric", "acc_global"))
    return "acc_domain_*" if metric.startswith("acc_domain_") else metric


@cache
def _required() -> dict[Key, dict[str, list[str]]]:
    """(method, args) -> metric -> the cells that want it."""
    out: dict[Key, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for suite, items in WANTED.items():
        cells = _suite(suite).cells
        for where, _, spec in items:
            for c in cells:
                if _matches(c, spec):
                    key = (c.method.name, json.dumps(c.method.args, sort_keys=True))
                    out[key][_needed(spec)].append(where)
    return {k: dict(v) for k, v in out.items()}


def _tiny_run(method: str, args: dict[str, Any], tmp_path) -> set[str]:
    """The metric names one round of `method` with `args` stores on a tiny federation."""
    clip = getattr(METHODS.get(method), "backbone_family", "vit") == "clip"
    raw = {
        "seeds": [0],
        "defaults": {
            "backbone": {"name": "clip-test" if clip else "vit-test"},
            "train": {"rounds": 1, "participation": 1.0, "batch_size": 8, "lr": 0.05},
            "dataset": {
                "num_classes": 6,
                "image_size": 16,
                "train_per_class": 12,
                "test_per_class": 6,
                "num_domains": 2,
            },
            "partition": {"num_clients": 6, "heldout_frac": 0.34},
        },
        "datasets": [{"name": "synthetic"}],
        "partitions": [{"name": "domain-dirichlet", "clients_per_domain": 3, "min_size": 2}],
        "methods": [{"name": method, **args}],
    }
    cfg = expand_suite(raw, name="tiny-metrics").cells[0]
    from fpbench.engine.runner import run_cell

    store = Store(f"sqlite:///{tmp_path / 'm.db'}")
    run_cell(cfg, store, checkpoint_dir=tmp_path / "ck")
    stored = set(store.metrics()["name"])
    rounds = store.rounds(int(store.runs()["id"].iloc[0]))
    if rounds["wall_s"].notna().any():  # the tables' `wall_s_per_round` reads the round rows
        stored.add("wall_s_per_round")
    return stored


def _fitting_args(method: str, args: dict[str, Any]) -> dict[str, Any]:
    """The cell's args, less those naming ViT-B blocks or a timm select encoder."""
    drop = {"select_encoder", "group_layer", "ccmp_layers", "g_layers", "e_layers", "preset"}
    drop |= {k for k in args if k.endswith(("_blocks", "_layers", "_layer"))}
    out = {k: v for k, v in args.items() if k not in drop}
    if out.get("num_groups", 0) > 16:  # orthogonal keys need G <= the tiny width (32)
        out["num_groups"] = 16
    if method == "gpt-fl":  # no generated images here: the server pretraining is left out
        out = {k: v for k, v in out.items() if k != "synthetic_dir"} | {"server_epochs": 0}
    return out


def _short(args_json: str) -> str:
    return f"{zlib.crc32(args_json.encode()) % 10**6}"


def _covered(needed: str, stored: set[str]) -> bool:
    if needed.endswith("*"):
        return any(s.startswith(needed[:-1]) for s in stored)
    return needed in stored or any(s.startswith(f"{needed}_last") for s in stored)


def test_the_collection_holds_table_11() -> None:
    """Not vacuous: FGPT Table 11's similarity metrics are among the required ones."""
    wanted = {m for metrics in _required().values() for m in metrics}
    assert {"sim_shared_prompt", "sim_group_prompt_local", "acc_heldout_mean"} <= wanted


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(_required()), ids=lambda k: f"{k[0]}-{_short(k[1])}")
def test_every_paper_metric_is_recorded(key: Key, tmp_path) -> None:
    method, args_json = key
    args = json.loads(args_json)
    try:
        stored = _tiny_run(method, args, tmp_path)
    except FpbenchError:  # args sized for ViT-B: the method's own defaults on the tiny backbone
        stored = _tiny_run(method, _fitting_args(method, args), tmp_path / "fit")
    missing = {m: w for m, w in _required()[key].items() if not _covered(m, stored)}
    assert not missing, f"{method} {args_json} lacks " + "; ".join(
        f"{m} (e.g. {w[0]})" for m, w in missing.items()
    )


@pytest.mark.parametrize("method", ["fgpt", "fed-dualprompt"])
def test_table_11_methods_record_their_similarities(method: str, tmp_path) -> None:
    """FGPT Table 11's rows (fast, default run): the metric names the paper spec asks for."""
    stored = _tiny_run(method, {}, tmp_path)
    assert {"sim_shared_prompt", "sim_group_prompt_global", "sim_group_prompt_local"} <= stored
    shared_only = _tiny_run("fgpt", {"num_groups": 0}, tmp_path / "g0")
    assert "sim_shared_prompt" in shared_only and "sim_group_prompt_local" not in shared_only
