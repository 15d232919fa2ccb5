"""Backbones a suite names without registering them: any timm ViT, any open_clip CLIP.

* ``timm:<model>``: a timm model name with its pretrained tag, e.g.
  ``timm:vit_small_patch16_224.augreg_in21k``, ``timm:deit_small_patch16_224.fb_in1k``,
  ``timm:vit_small_patch14_dinov2.lvd142m``. Built by `BackboneSpec`: hub weights or a
  ``weights`` file, input normalisation from the model's pretrained config.
* ``open_clip:<arch>@<tag>``: an open_clip architecture and pretrained tag, e.g.
  ``open_clip:ViT-B-32@laion2b_s34b_b79k``; ``open_clip:<arch>`` needs a ``weights`` file.
  Built by `ClipSpec`, normalisation from the tag's pretrained config.

Only what the prompt adapters can prompt is accepted (checked before anything runs, without
weights): a timm `VisionTransformer` with a class token, an open_clip CLIP with its own text
tower and its own image tower (ViT or ModifiedResNet). Anything else is one clear error.
"""

from __future__ import annotations

import difflib
import functools

from fpbench.backbones.catalog import BackboneSpec, ClipSpec
from fpbench.errors import FpbenchError


@functools.lru_cache(maxsize=64)
def timm_backbone(model: str) -> BackboneSpec:
    """The spec of timm model `model` (`timm:` names); an unpromptable one raises."""
    import timm
    import torch
    from timm.models.vision_transformer import VisionTransformer

    arch = model.split(".")[0]
    if not timm.is_model(arch):
        close = difflib.get_close_matches(arch, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise FpbenchError(f"unknown timm model {model!r}{hint}")
    try:
        with torch.device("meta"):  # the architecture only: no memory, no weights
            net = timm.create_model(model, pretrained=False, num_classes=0)
    except Exception as e:
        raise FpbenchError(f"timm model {model!r} cannot be built: {e}") from None
    if not isinstance(net, VisionTransformer) or net.cls_token is None:
        vit = isinstance(net, VisionTransformer)
        why = "has no class token" if vit else f"is a {type(net).__name__}, not a ViT"
        raise FpbenchError(
            f"timm model {model!r} {why}; fpbench's prompt adapters need a timm "
            "VisionTransformer with a class token (ViT, DeiT, DINOv2, AugReg, ...)"
        )
    kwargs = {"dynamic_img_size": False} if getattr(net, "dynamic_img_size", False) else {}
    return BackboneSpec(
        name=f"timm:{model}",
        timm_name=model,
        timm_kwargs=kwargs,
        description=f"timm {model}, named in the suite",
        pretrained="hub",
    )


@functools.lru_cache(maxsize=64)
def open_clip_backbone(name: str) -> ClipSpec:
    """The spec of `arch[@tag]` (`open_clip:` names); an unpromptable one raises."""
    import open_clip

    arch, _, tag = name.partition("@")
    if arch not in open_clip.list_models():
        close = difflib.get_close_matches(arch, open_clip.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise FpbenchError(f"unknown open_clip model {arch!r}{hint}")
    tags = open_clip.list_pretrained_tags_by_model(arch)
    if tag and tag not in tags:
        raise FpbenchError(
            f"open_clip model {arch} has no pretrained tag {tag!r}; "
            f"valid: {', '.join(tags) or 'none (give backbone.weights)'}"
        )
    _check_clip_config(arch, open_clip.get_model_config(arch) or {})
    cfg = open_clip.get_pretrained_cfg(arch, tag) if tag else {}
    return ClipSpec(
        name=f"open_clip:{name}",
        model_name=arch,
        description=f"open_clip {arch} ({tag or 'weights file'}), named in the suite",
        pretrained="openai" if tag else "file",
        tag=tag,
        hf_repo=str(cfg.get("hf_hub", "")).strip("/"),
        own_tokenizer=True,
    )


def _check_clip_config(arch: str, cfg: dict) -> None:
    text, vision = cfg.get("text_cfg", {}), cfg.get("vision_cfg", {})
    reasons = [
        (cfg.get("custom_text") or "hf_model_name" in text, "has a custom text tower"),
        ("multimodal_cfg" in cfg, "is a captioning model (CoCa)"),
        ("timm_model_name" in vision, "has a timm image tower"),
    ]
    for bad, why in reasons:
        if bad:
            raise FpbenchError(
                f"open_clip model {arch} {why}; fpbench's prompt adapters need an open_clip CLIP "
                "with its own text tower and a ViT or ModifiedResNet image tower"
            )


RESOLVERS = {"timm": timm_backbone, "open_clip": open_clip_backbone}
