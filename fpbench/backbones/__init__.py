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

from pathlib import Path

from fpbench.backbones.clip import CLIP_SPECS, PromptedCLIP
from fpbench.backbones.custom import RESOLVERS
from fpbench.backbones.smoke import SMOKE_ARCH, SMOKE_MEAN, SMOKE_STD, SMOKE_TIMM_NAME
from fpbench.backbones.vit import BackboneSpec, PromptedViT, ViTFeatures, preprocess_images
from fpbench.registry import BACKBONES

__all__ = [
    "VIT_TEST_ARCH",
    "BackboneSpec",
    "PromptedCLIP",
    "PromptedViT",
    "ViTFeatures",
    "create_backbone",
    "preprocess_images",
]

VIT_TEST_ARCH = dict(
    img_size=16, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0,
    dynamic_img_size=False,
)  # fmt: skip

_SPECS = (
    BackboneSpec(
        name="vit-test",
        timm_name="test_vit",
        timm_kwargs=VIT_TEST_ARCH,
        description="Test-sized ViT (16 px, 2 blocks, width 32), seeded random init",
        pretrained="none",
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
    ),
    BackboneSpec(
        name="vit-smoke",
        timm_name=SMOKE_TIMM_NAME,
        timm_kwargs=SMOKE_ARCH,
        description="Small ViT (32 px, 4 blocks, width 128) pretrained offline on synthetic data",
        pretrained="smoke",
        mean=SMOKE_MEAN,
        std=SMOKE_STD,
    ),
    BackboneSpec(
        name="vit-ti16-d4",
        timm_name="vit_tiny_patch16_224",
        timm_kwargs={"depth": 4},
        description="ViT-Ti/16 cut to 4 blocks (224 px, width 192), seeded random init or a "
        "weights file: the tiny side-by-side setting with the official SGPT code",
        pretrained="none",
    ),
    BackboneSpec(
        name="vit-b16-in21k",
        timm_name="vit_base_patch16_224.orig_in21k",
        description="ViT-B/16, original Google ImageNet-21k weights (SGPT/FGPT/PEP-FedPT)",
        pretrained="hub",
    ),
    BackboneSpec(
        name="vit-b16-augreg-in21k",
        timm_name="vit_base_patch16_224.augreg_in21k",
        description="ViT-B/16, AugReg ImageNet-21k weights",
        pretrained="hub",
    ),
    BackboneSpec(
        name="vit-s16-augreg-in21k",
        timm_name="vit_small_patch16_224.augreg_in21k",
        description="ViT-S/16, AugReg ImageNet-21k weights",
        pretrained="hub",
    ),
)
for _spec in (*_SPECS, *CLIP_SPECS):
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
