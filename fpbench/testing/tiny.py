"""A tiny federation on synthetic data with the test-sized ViT, and its pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fpbench.engine.build import build_method
from fpbench.engine.task import build_task
from fpbench.registry import METHODS
from fpbench.specs import RunConfig
from fpbench.suites import expand_suite

TINY = {
    "seeds": [0],
    "defaults": {
        "backbone": {"name": "vit-test"},
        "train": {
            "rounds": 3,
            "participation": 0.75,
            "batch_size": 8,
            "lr": 0.05,
            "eval_batch_size": 64,
        },
        "dataset": {"num_classes": 6, "image_size": 16, "train_per_class": 12, "test_per_class": 6},
        "partition": {"num_clients": 4, "heldout_frac": 0.25},
    },
    "datasets": [{"name": "synthetic"}],
    "partitions": [{"name": "dirichlet", "alpha": 0.5, "min_size": 4}],
    "methods": [{"name": "fedvpt"}],
}


# The same tiny federation as a suite file: 2 methods x 1 partition x 1 seed, 2 rounds.
TINY_SUITE_TOML = """
name = "tiny"
seeds = [0]
[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 6, image_size = 16, train_per_class = 12, test_per_class = 6 }
partition = { num_clients = 4, heldout_frac = 0.25 }
train = { rounds = 2, participation = 0.75, batch_size = 8, lr = 0.05 }
[[datasets]]
name = "synthetic"
[[partitions]]
name = "pathological"
s = 3
[[methods]]
name = "head-tune"
[[methods]]
name = "fedvpt"
"""

# Method args the tiny federation needs offline (GPT-FL has no generated images here)
OFFLINE_ARGS = {
    "gpt-fl": {"server_epochs": 0},
    # deep prompts: clip-test has 2 layers per tower (the defaults prompt 9 of ViT-B/16's 12)
    "maple": {"prompt_depth": 2},
    "promptsrc": {"prompt_depth_text": 2, "prompt_depth_vision": 2},
    # clip-test's features are 32 wide: the gate pools every 2nd (the default 128 needs >= 128)
    "pfedmoap": {"gating_embed_dim": 16, "gating_heads": 4},
}


def seeded_server(method):
    """The method's initial server state with seed 0."""
    return method.init_server(torch.Generator().manual_seed(0))


def with_config(method, **args):
    """The same method class on the same backbone and task, with config `args`."""
    return type(method)(method.Config(**args), method.backbone, method.task)


def tiny_config(method: str = "fedvpt", **train) -> RunConfig:
    """The tiny federation's run config for a registered method, with `train` overrides; a
    method whose `backbone_family` is "clip" gets the test-sized CLIP."""
    raw = {**TINY, "methods": [{"name": method, **OFFLINE_ARGS.get(method, {})}]}
    raw["defaults"] = {**TINY["defaults"], "train": {**TINY["defaults"]["train"], **train}}
    if METHODS.get(method).backbone_family == "clip":
        raw["defaults"]["backbone"] = {"name": "clip-test"}
    return expand_suite(raw, name="tiny").cells[0]


@pytest.fixture
def fpbench_cache(tmp_path_factory, monkeypatch) -> Path:
    """An fpbench cache folder of the test's own (frozen values, seeded weights), in and below
    its process; the vit-smoke weights already made in the real one are linked in, not
    retrained."""
    real = Path(os.environ.get("FPBENCH_CACHE") or Path.home() / ".cache" / "fpbench")
    folder = tmp_path_factory.mktemp("fpbench-cache")
    for weights in real.glob("vit-smoke-*.pth"):
        (folder / weights.name).symlink_to(weights)
    monkeypatch.setenv("FPBENCH_CACHE", str(folder))
    return folder


@pytest.fixture
def tiny(fpbench_cache) -> Callable:
    """`tiny(method, **train)` -> (cfg, task, method) of the tiny federation, on the CPU."""

    def make(method: str = "fedvpt", **train):
        cfg = tiny_config(method, **train)
        task = build_task(cfg, torch.device("cpu"))
        return cfg, task, build_method(cfg, task, torch.device("cpu"))

    return make
