"""The tiny federation (synthetic data, 6 classes of 16 px, 4 clients, one held out, batch 8)
that the conformance kit (`fpbench.testing`) and `fpbench bench --methods` both run, as suite
data; torch- and pytest-free, so both can import it."""

from __future__ import annotations

from typing import Any

from fpbench.registry import METHODS

TINY: dict[str, Any] = {
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

# Method args the tiny federation needs offline
OFFLINE_ARGS: dict[str, dict[str, Any]] = {
    "gpt-fl": {"server_epochs": 0},  # GPT-FL has no generated images here
    # deep prompts: clip-test has 2 layers per tower (the defaults prompt 9 of ViT-B/16's 12)
    "maple": {"prompt_depth": 2},
    "promptsrc": {"prompt_depth_text": 2, "prompt_depth_vision": 2},
    # clip-test's features are 32 wide: the gate pools every 2nd (the default 128 needs >= 128)
    "pfedmoap": {"gating_embed_dim": 16, "gating_heads": 4},
    # FedMVP's attribute descriptions: none for the synthetic classes (its module docstring)
    "fedmvp": {"missing_descriptions": "class-name"},
}

# The test-sized backbone of each backbone family (any other family gets vit-test)
TEST_BACKBONES = {"vit": "vit-test", "clip": "clip-test"}


def tiny_backbone(method: str) -> str:
    """The test-sized backbone of a registered method's `backbone_family`."""
    return TEST_BACKBONES.get(METHODS.get(method).backbone_family, "vit-test")


def tiny_suite(method: str, **train: Any) -> dict[str, Any]:
    """The tiny federation as a raw suite of one registered method: its offline args, the
    test-sized backbone of its family, and `train` overrides."""
    defaults = {
        **TINY["defaults"],
        "backbone": {"name": tiny_backbone(method)},
        "train": {**TINY["defaults"]["train"], **train},
    }
    return {
        **TINY,
        "defaults": defaults,
        "methods": [{"name": method, **OFFLINE_ARGS.get(method, {})}],
    }
