"""A frozen open_clip CLIP with CoOp text prompts and Bahng-style pixel prompts.

Nothing in open_clip is patched: the text path is rebuilt from the model's public parts
(`token_embedding`, `positional_embedding`, `transformer`, `attn_mask`, `ln_final`,
`text_projection`, `text_global_pool`) and, fed the tokens' own embeddings, equals
`model.encode_text` exactly (tested). Images go through `model.encode_image`, optionally after
adding a pixel-space visual prompt to the normalised image.

Pieces:

* `PromptedCLIP`: the frozen model, `preprocess(uint8)` with CLIP's normalisation, `encode_image`,
  `encode_prompts` (prompt embeddings -> text features), `forward_features(x).cls` (image
  features, recalled from the engine's frozen store where no pixel prompt is added), `logit_scale`
  (frozen, exp of the model's learned log scale).
* `fpbench.backbones.clip_prompts`: CoOp's prompt layout and Bahng et al.'s pixel prompts.
* `fpbench.backbones.catalog.ClipSpec`: registered backbones and their weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpbench.backbones.frozen_linear import freeze_linears
from fpbench.backbones.recall import recalled

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ClipFeatures:
    """`forward_features` output; `cls` is the image feature (B, E), unnormalised."""

    cls: Tensor


class PromptedCLIP(nn.Module):
    """A frozen, always-eval open_clip CLIP with a prompt-aware text path.

    Attributes: `name`, `embed_dim` (joint space E), `ctx_dim` (token width d),
    `context_length`, `img_size`, `mean`, `std`, `tokenizer`, `model` (the open_clip CLIP).
    """

    family = "clip"

    def __init__(self, model: nn.Module, name: str = "", tokenizer: Any = None) -> None:
        import open_clip

        super().__init__()
        if not hasattr(model, "token_embedding") or not hasattr(model, "visual"):
            raise ValueError("PromptedCLIP needs an open_clip CLIP with its own text tower")
        self.model = freeze_linears(model.requires_grad_(False))
        self.name = name
        self.tokenizer = tokenizer or open_clip.get_tokenizer("ViT-B-16")
        self.ctx_dim: int = model.token_embedding.weight.shape[1]
        self.context_length: int = model.positional_embedding.shape[0]
        self.embed_dim: int = _joint_dim(model)
        size = model.visual.image_size
        self.img_size: int = int(size[0] if isinstance(size, (tuple, list)) else size)
        norm = getattr(model.visual, "preprocess_cfg", None) or {}  # the pretrained config's
        self.mean = tuple(float(v) for v in norm.get("mean", CLIP_MEAN))
        self.std = tuple(float(v) for v in norm.get("std", CLIP_STD))
        self.train(False)

    def train(self, mode: bool = True) -> PromptedCLIP:
        """Stay in eval mode whatever is asked (batch norm in RN50 stays frozen)."""
        return super().train(False)

    @property
    def logit_scale(self) -> float:
        """exp of the model's (frozen) log temperature: 100 for OpenAI weights."""
        return float(self.model.logit_scale.detach().exp())

    # -- images -----------------------------------------------------------------------------
    def preprocess(self, images: Tensor) -> Tensor:
        """uint8 (B, 3, H, W) -> CLIP-normalised float32 (B, 3, S, S) on the same device.

        Bicubic resize of the shorter side to S (antialiased when shrinking), centre crop.
        """
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 (B, 3, H, W), got {images.dtype} {images.shape}")
        x = images.to(torch.float32) / 255.0  # (B, 3, H, W)
        h, w = x.shape[-2:]
        s = self.img_size
        if (h, w) != (s, s):
            scale = s / min(h, w)
            size = (max(s, round(h * scale)), max(s, round(w * scale)))
            shrink = min(h, w) > s
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=shrink)
            top, left = (size[0] - s) // 2, (size[1] - s) // 2
            x = x[..., top : top + s, left : left + s].clamp(0.0, 1.0)
        m = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        sd = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - m) / sd

    def encode_image(self, x: Tensor, pixel_prompt: Tensor | None = None) -> Tensor:
        """Image features (B, E) of preprocessed x, plus an optional pixel prompt (B, 3, S, S).

        Without a prompt they depend on the images alone: recalled from the engine's frozen
        store where x is its batch (`fpbench.backbones.recall`)."""
        if pixel_prompt is None:
            return recalled("cls", self.model.encode_image, x)
        return self.model.encode_image(x + pixel_prompt.to(x.dtype))

    def encode_image_tokens(self, x: Tensor, pixel_prompt: Tensor | None = None) -> Tensor:
        """Projected image tokens (B, 1 + M, E): 0 is the pooled feature, 1.. the local ones.

        ViT: the patch tokens after `ln_post`, through `proj` (FedOTP's local features). RN:
        `attnpool`'s attention evaluated at every position (open_clip returns position 0 only).
        """
        if pixel_prompt is not None:
            x = x + pixel_prompt.to(x.dtype)
        visual = self.model.visual
        if hasattr(visual, "attnpool"):
            return _attnpool_all(visual.attnpool, _resnet_trunk(visual, x))
        pooled, tokens = visual._pool(visual.transformer(visual._embeds(x)))
        out = torch.cat([pooled.unsqueeze(1), tokens], dim=1)  # (B, 1 + M, width)
        return out @ visual.proj if visual.proj is not None else out

    def forward_features(self, x: Tensor) -> ClipFeatures:
        """Frozen image features of preprocessed images, as the engine's feature cache wants."""
        return ClipFeatures(cls=self.encode_image(x))

    forward = forward_features

    # -- text -------------------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> Tensor:
        """Token ids (N, context_length) on the model's device."""
        ids = self.tokenizer(texts, context_length=self.context_length)
        return ids.to(self.model.token_embedding.weight.device)

    def token_embed(self, ids: Tensor) -> Tensor:
        """Frozen token embeddings (N, L, d) of ids (N, L)."""
        return self.model.token_embedding(ids)

    def encode_prompts(self, embeds: Tensor, ids: Tensor, truncate: bool = False) -> Tensor:
        """Text features (N, E) of prompt embeddings (N, L, d); ids (N, L) locate EOT.

        With `truncate`, tokens after the last EOT are dropped: under the causal mask they never
        reach an EOT output, so the features agree with the full pass up to float rounding, at a
        fraction of the cost (prompts are ~10-30 of 77 tokens).
        """
        from open_clip.transformer import text_global_pool

        model = self.model
        cast = model.transformer.get_cast_dtype()
        n = int(ids.argmax(-1).max()) + 1 if truncate else ids.shape[1]
        embeds, ids = embeds[:, :n], ids[:, :n]
        x = embeds.to(cast) + model.positional_embedding[:n].to(cast)  # (N, n, d)
        mask = model.attn_mask[:n, :n] if model.attn_mask is not None else None
        x = model.transformer(x, attn_mask=mask)
        x = model.ln_final(x)
        pool = getattr(model, "text_pool_type", "argmax")
        x = text_global_pool(x, ids, pool, eos_token_id=getattr(model, "text_eos_id", None))
        proj = model.text_projection
        if proj is None:
            return x
        return proj(x) if isinstance(proj, nn.Linear) else x @ proj  # (N, E)

    def encode_text(self, ids: Tensor) -> Tensor:
        """`encode_prompts` on the ids' own embeddings (= open_clip's `encode_text`)."""
        return self.encode_prompts(self.token_embed(ids), ids)


def _resnet_trunk(visual: nn.Module, x: Tensor) -> Tensor:
    x = visual.stem(x.to(visual.conv1.weight.dtype))
    for layer in (visual.layer1, visual.layer2, visual.layer3, visual.layer4):
        x = layer(x)
    return x  # (B, C, h, w)


def _attnpool_all(pool: nn.Module, x: Tensor) -> Tensor:
    """open_clip's AttentionPool2d, keeping the outputs at all 1 + h*w positions (B, 1+hw, E)."""
    x = x.flatten(2).permute(2, 0, 1)  # (hw, B, C)
    x = torch.cat([x.mean(dim=0, keepdim=True), x], dim=0)  # (1 + hw, B, C)
    x = x + pool.positional_embedding[:, None, :].to(x.dtype)
    x, _ = F.multi_head_attention_forward(
        query=x, key=x, value=x, embed_dim_to_check=x.shape[-1], num_heads=pool.num_heads,
        q_proj_weight=pool.q_proj.weight, k_proj_weight=pool.k_proj.weight,
        v_proj_weight=pool.v_proj.weight, in_proj_weight=None,
        in_proj_bias=torch.cat([pool.q_proj.bias, pool.k_proj.bias, pool.v_proj.bias]),
        bias_k=None, bias_v=None, add_zero_attn=False, dropout_p=0.0,
        out_proj_weight=pool.c_proj.weight, out_proj_bias=pool.c_proj.bias,
        use_separate_proj_weight=True, training=False, need_weights=False,
    )  # fmt: skip
    return x.permute(1, 0, 2)  # (B, 1 + hw, E)


def _joint_dim(model: nn.Module) -> int:
    proj = model.text_projection
    if proj is None:
        return model.token_embedding.weight.shape[1]
    return proj.out_features if isinstance(proj, nn.Linear) else proj.shape[1]
