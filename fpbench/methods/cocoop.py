"""CoCoOp: a CoOp context shifted per image by a small meta-network of its features.

CoCoOp (Zhou, Yang, Loy, Liu, "Conditional Prompt Learning for Vision-Language Models", CVPR
2022, arXiv:2203.05557; code KaiyangZhou/CoOp `trainers/cocoop.py`). For an image with
normalised CLIP features f, the meta-net pi = Linear(E, E/16) -> ReLU -> Linear(E/16, d) gives one
token-wide shift added to every context token: ctx_m(f) = ctx_m + pi(f). The class prompts
"SOT ctx(f) name . EOT" are encoded per image, and the logits are exp(logit_scale) * cos(f,
t_c(f)); trained with cross-entropy. Defaults from the official config
`vit_b16_c4_ep10_batch1_ctxv1`: 4 context tokens initialised from "a photo of a", the meta-net
in PyTorch's default Linear init, class token at the end (the only position CoCoOp builds).

Adapted to FL as FLiP does: every client trains the context and the meta-net on its own data;
the server averages both weighted by train size (FedAvg); inference: the global ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.backbones.clip_prompts import init_context, phrase_length
from fpbench.lazy import torch
from fpbench.methods.base import Context, MethodConfig
from fpbench.methods.coop import CoOpModel
from fpbench.methods.helpers import init_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class CoCoOpConfig(MethodConfig):
    n_ctx: int = Field(4, ge=1, le=70, description="context tokens (ignored with ctx_init)")
    ctx_init: str | None = Field(
        "a photo of a", description="init phrase (sets the context length); None: random"
    )
    reduction: int = Field(16, ge=1, description="meta-net hidden width = E // reduction")


@METHODS.register()
class CoCoOp(CoOpModel):
    name = "cocoop"
    Config = CoCoOpConfig

    @property
    def n_ctx(self) -> int:
        phrase = self.cfg.ctx_init
        return phrase_length(self.backbone, phrase) if phrase else self.cfg.n_ctx

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        e, d = self.backbone.embed_dim, self.backbone.ctx_dim
        hidden = max(1, e // self.cfg.reduction)
        ctx = init_context(self.backbone, gen, self.n_ctx, self.cfg.ctx_init)
        w1, b1 = init_linear(gen, hidden, e)
        w2, b2 = init_linear(gen, d, hidden)
        return {"ctx": ctx, "meta_w1": w1, "meta_b1": b1, "meta_w2": w2, "meta_b2": b2}

    def shift(self, params: dict[str, Tensor], feats: Tensor, client_index: Tensor) -> Tensor:
        """The meta-net's token shift (B, d) of normalised features (B, E), per sample's row."""
        k = client_index
        h = torch.einsum("bhe,be->bh", params["meta_w1"][k], feats) + params["meta_b1"][k]
        h = torch.relu(h)
        return torch.einsum("bdh,bh->bd", params["meta_w2"][k], h) + params["meta_b2"][k]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        feats = self.image_features(x)  # (B, E)
        shifted = params["ctx"][client_index] + self.shift(params, feats, client_index)[:, None]
        text = self.text_features(shifted)  # (B, C, E): each image's own prompts
        scale = self.backbone.logit_scale
        return scale * torch.einsum("be,bce->bc", feats, text.to(feats.dtype))
