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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fpbench.backbones.frozen_linear import freeze_linears
from fpbench.backbones.recall import autocast_key, last_call, recalled
from fpbench.errors import FpbenchError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@cache
def openai_tokenizer() -> Any:
    """OpenAI CLIP's BPE tokenizer (open_clip's for ViT-B-16), built once per process: building
    it reads a 49k-merge vocabulary (about 0.1 s a backbone), and it is only read from."""
    import open_clip

    return open_clip.get_tokenizer("ViT-B-16")


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
        super().__init__()
        if not hasattr(model, "token_embedding") or not hasattr(model, "visual"):
            raise ValueError("PromptedCLIP needs an open_clip CLIP with its own text tower")
        self.model = freeze_linears(model.requires_grad_(False))
        self.name = name
        self.tokenizer = tokenizer or openai_tokenizer()
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
        fraction of the cost (prompts are ~10-30 of 77 tokens). Within an evaluation the last
        call's features are reused while the (truncated) embeddings and ids are exactly equal
        (`fpbench.backbones.recall.last_call`).
        """
        n = int(ids.argmax(-1).max()) + 1 if truncate else ids.shape[1]
        embeds, ids = embeds[:, :n], ids[:, :n]
        key = (id(self), "text", autocast_key(embeds))
        return last_call(key, (embeds, ids), lambda: self._encode_prompts(embeds, ids))

    def _encode_prompts(self, embeds: Tensor, ids: Tensor) -> Tensor:
        model = self.model
        cast = model.transformer.get_cast_dtype()
        n = ids.shape[1]
        x = embeds.to(cast) + model.positional_embedding[:n].to(cast)  # (N, n, d)
        mask = model.attn_mask[:n, :n] if model.attn_mask is not None else None
        return _text_head(model, model.transformer(x, attn_mask=mask), ids)

    def encode_text(self, ids: Tensor) -> Tensor:
        """`encode_prompts` on the ids' own embeddings (= open_clip's `encode_text`)."""
        return self.encode_prompts(self.token_embed(ids), ids)


def _text_head(model: nn.Module, x: Tensor, ids: Tensor) -> Tensor:
    """Text features (N, E) from the transformer's output x (N, n, d): final norm, the EOT
    token's state (open_clip's pooling), projection."""
    from open_clip.transformer import text_global_pool

    x = model.ln_final(x)
    pool = getattr(model, "text_pool_type", "argmax")
    x = text_global_pool(x, ids, pool, eos_token_id=getattr(model, "text_eos_id", None))
    proj = model.text_projection
    if proj is None:
        return x
    return proj(x) if isinstance(proj, nn.Linear) else x @ proj  # (N, E)


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


# -- deep prompts: MaPLe's and PromptSRC's (independent V-L) per-layer prompt tokens ------------


def _run_blocks(
    transformer: nn.Module,
    x: Tensor,
    deep: Sequence[Tensor],
    put: Callable[[Tensor, Tensor], Tensor],
    attn_mask: Tensor | None = None,
) -> Tensor:
    """open_clip's `Transformer.forward` on batch-first x (N, L, w), with `put(x, deep[i - 1])`
    applied to the tokens entering block i for i = 1..len(deep)."""
    if len(deep) >= len(transformer.resblocks):
        raise FpbenchError(
            f"{len(deep) + 1} prompted layers, but the transformer has "
            f"{len(transformer.resblocks)}: use a prompt depth of at most "
            f"{len(transformer.resblocks)}"
        )
    if not transformer.batch_first:
        x = x.transpose(0, 1)
    for i, block in enumerate(transformer.resblocks):
        if 1 <= i <= len(deep):
            tokens = x if transformer.batch_first else x.transpose(0, 1)
            tokens = put(tokens, deep[i - 1])
            x = tokens if transformer.batch_first else tokens.transpose(0, 1)
        x = block(x, attn_mask=attn_mask)
    return x if transformer.batch_first else x.transpose(0, 1)


def _rows(p: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """Prompt tokens (m, w) or (N, m, w) as (n, m, w) in dtype."""
    p = p.to(dtype)
    return p.unsqueeze(0).expand(n, -1, -1) if p.ndim == 2 else p.expand(n, -1, -1)


def encode_prompts_deep(
    clip: PromptedCLIP,
    embeds: Tensor,
    ids: Tensor,
    deep: Sequence[Tensor],
    truncate: bool = False,
) -> Tensor:
    """Text features (N, E) with deep language prompts (MaPLe, PromptSRC's IVLP).

    `embeds` (N, L, d) hold the layer-0 prompt (the context at tokens 1..m, as CoOp's layout
    places it at the end); `deep[i - 1]` ((m, d), or (N, m, d) per prompt) replaces tokens 1..m
    entering block i, i = 1..len(deep), without a positional embedding. `deep = []` is
    `encode_prompts`. `truncate` as there.
    """

    model = clip.model
    cast = model.transformer.get_cast_dtype()
    n = int(ids.argmax(-1).max()) + 1 if truncate else ids.shape[1]
    embeds, ids = embeds[:, :n], ids[:, :n]
    x = embeds.to(cast) + model.positional_embedding[:n].to(cast)  # (N, n, d)
    mask = model.attn_mask[:n, :n] if model.attn_mask is not None else None

    def put(tokens: Tensor, prompt: Tensor) -> Tensor:
        p = _rows(prompt, tokens.shape[0], tokens.dtype)  # (N, m, d)
        return torch.cat([tokens[:, :1], p, tokens[:, 1 + p.shape[1] :]], dim=1)

    return _text_head(model, _run_blocks(model.transformer, x, deep, put, mask), ids)


def check_vit(clip: PromptedCLIP, method: str) -> None:
    """Raise unless the image tower is a ViT (deep visual prompts are tokens)."""
    visual = clip.model.visual
    if hasattr(visual, "attnpool") or not hasattr(visual, "class_embedding"):
        raise FpbenchError(
            f"method {method} prompts the image encoder's transformer layers and needs a ViT "
            f"CLIP (clip-test, clip-vit-b16); {clip.name or 'this backbone'} is a ResNet"
        )


def vision_width(clip: PromptedCLIP) -> int:
    """Token width of the ViT image tower (768 for ViT-B/16)."""
    check_vit(clip, "deep visual prompting")
    return int(clip.model.visual.class_embedding.shape[-1])


def encode_image_deep(
    clip: PromptedCLIP, x: Tensor, shallow: Tensor | None, deep: Sequence[Tensor] = ()
) -> Tensor:
    """Image features (B, E) of preprocessed x with deep visual prompts (MaPLe, IVLP).

    `shallow` ((m, w), or (B, m, w) per sample) is appended after the patch tokens once the
    positional embedding is added, before `ln_pre`; `deep[i - 1]` (same shapes) replaces the
    last m tokens entering block i, i = 1..len(deep). The pooled CLS token is unaffected in
    layout. `shallow = None` with no `deep` is `encode_image`. ViT CLIP only.
    """
    check_vit(clip, "deep visual prompting")
    if shallow is None and len(deep):
        raise FpbenchError("deep visual prompts need the layer-0 (shallow) prompt too")
    visual = clip.model.visual
    b = x.shape[0]
    t = visual.conv1(x)  # (B, w, g, g)
    t = t.reshape(b, t.shape[1], -1).permute(0, 2, 1)  # (B, g*g, w)
    cls = visual.class_embedding.view(1, 1, -1).expand(b, -1, -1).to(t.dtype)
    t = torch.cat([cls, t], dim=1) + visual.positional_embedding.to(t.dtype)
    t = visual.patch_dropout(t)
    if shallow is not None:
        t = torch.cat([t, _rows(shallow, b, t.dtype)], dim=1)  # (B, 1 + g*g + m, w)
    t = visual.ln_pre(t)

    def put(tokens: Tensor, prompt: Tensor) -> Tensor:
        p = _rows(prompt, tokens.shape[0], tokens.dtype)
        return torch.cat([tokens[:, : tokens.shape[1] - p.shape[1]], p], dim=1)

    t = _run_blocks(visual.transformer, t, deep, put)
    pooled, _ = visual._pool(t)
    return pooled @ visual.proj if visual.proj is not None else pooled
