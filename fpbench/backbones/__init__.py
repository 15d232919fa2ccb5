"""Frozen backbones: registered `BackboneSpec`s and `create_backbone`.

| name | timm model | weights |
|---|---|---|
| vit-test | tiny ViT (16 px, patch 8, width 32, 2 blocks) | seeded random init |
| vit-smoke | small ViT (32 px, patch 8, width 128, 4 blocks) | pretrained offline by fpbench |
| vit-ti16-d4 | vit_tiny_patch16_224 with 4 blocks (benchmarks) | seeded random init, or a file |
| vit-b16-in21k | vit_base_patch16_224.orig_in21k (SGPT, FGPT, PEP-FedPT) | hub |
| vit-b16-augreg-in21k | vit_base_patch16_224.augreg_in21k | hub |
| vit-s16-augreg-in21k | vit_small_patch16_224.augreg_in21k | hub |
| clip-test, clip-test-rn | tiny open_clip CLIP (ViT / ModifiedResNet) | seeded random, as a file |
| clip-vit-b16, clip-rn50 | open_clip ViT-B-16-quickgelu / RN50-quickgelu | OpenAI (hub or file) |

Every backbone can instead load a local weights file (`weights=`), through the same timm (ViT)
or open_clip (CLIP) loading path. Unregistered models are named `timm:<model>` (any timm
VisionTransformer) or `open_clip:<arch>@<tag>` (`fpbench.backbones.custom`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fpbench.backbones.catalog import (
    CLIP_SPECS,
    VIT_SPECS,
    VIT_TEST_ARCH,
    BackboneSpec,
    ClipSpec,
    _hub_reachable,
)
from fpbench.backbones.custom import RESOLVERS
from fpbench.registry import BACKBONES

if TYPE_CHECKING:
    from fpbench.backbones.clip import PromptedCLIP
    from fpbench.backbones.vit import PromptedViT

__all__ = [
    "VIT_TEST_ARCH",
    "BackboneSpec",
    "ClipSpec",
    "PromptedCLIP",
    "PromptedViT",
    "ViTFeatures",
    "create_backbone",
    "missing_weights",
    "preprocess_images",
]

# The models import torch; they are imported when first named (PEP 562), not with the registry.
_MODELS = {
    "PromptedViT": "vit",
    "ViTFeatures": "vit",
    "preprocess_images": "vit",
    "PromptedCLIP": "clip",
}


def __getattr__(name: str) -> Any:
    if name in _MODELS:
        return getattr(importlib.import_module(f"{__name__}.{_MODELS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _spec in (*VIT_SPECS, *CLIP_SPECS):
    BACKBONES.register()(_spec)
for _prefix, _resolve in RESOLVERS.items():  # timm:NAME, open_clip:ARCH@TAG
    BACKBONES.add_resolver(_prefix, _resolve)


def create_backbone(
    name: str,
    weights: str | Path | None = None,
    cache_dir: Path | None = None,
    pretrained: bool = True,
) -> PromptedViT | PromptedCLIP:
    """Build a registered backbone, frozen and in eval mode.

    Args:
        name: Registry name (`fpbench list backbones`), `timm:<model>` or
            `open_clip:<arch>@<tag>`.
        weights: A local weights file (.pth/.pt/.bin/.safetensors/.npz) loaded through timm's
            file loader instead of the backbone's default weights.
        cache_dir: fpbench's cache folder, where `vit-smoke` keeps its self-pretrained weights
            (default `$FPBENCH_CACHE` or `~/.cache/fpbench`). Hub weights use the Hugging Face
            cache (`HF_HOME`).
        pretrained: False builds the architecture with seeded random weights (benchmarks).

    Raises:
        FpbenchError: unknown name, missing or unfitting weights file, hub weights unavailable.
    """
    return BACKBONES.get(name).create(weights=weights, cache_dir=cache_dir, pretrained=pretrained)


def missing_weights(cells: Iterable[Any]) -> list[str]:
    """One message per distinct backbone of `cells` (model_het profiles' too) whose weights
    are not here: a `backbone.weights` file that does not exist, or hub weights neither in the
    local Hugging Face cache nor downloadable (no network, or HF_HUB_OFFLINE). Loads nothing
    and downloads nothing; the hub is probed (once) only for weights not cached. Backbones
    built offline (vit-test, vit-smoke, clip-test, ...) need nothing."""
    refs = {}
    for cfg in cells:
        profiles = cfg.model_het.profiles if cfg.model_het else ()
        for ref in (cfg.backbone, *(p.backbone for p in profiles if p.backbone)):
            refs.setdefault((ref.name, ref.weights), ref)
    reachable = functools.cache(_hub_reachable)
    found = (BACKBONES.get(name).missing(weights, reachable) for name, weights in refs)
    return list(dict.fromkeys(m for m in found if m is not None))
