"""FedVPT: VPT-shallow prompts plus a linear head, trained with FedAvg.

Visual Prompt Tuning (Jia et al., ECCV 2022) in its shallow form, federated with FedAvg
(McMahan et al., 2017), as the baseline "FedVPT" of SGPT (Deng et al., CVPR 2024) and
PEP-FedPT. Client: `prompt_len` learnable tokens inserted after cls before block 0, and a linear
head on the final cls token, trained with cross-entropy. Server: FedAvg of prompts and head,
weighted by client train sizes. Default prompt length 5, FGPT's VPT-shallow setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, Method, MethodConfig
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class VPTConfig(MethodConfig):
    prompt_len: int = Field(5, ge=1, description="number of VPT-shallow prompt tokens")


class ShallowPromptModel(Method):
    """VPT-shallow prompts + linear head; subclasses choose how they are federated."""

    Config = VPTConfig

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        d = self.backbone.embed_dim
        prompts = init_prompts(gen, self.cfg.prompt_len, d, self.backbone.patch_size)
        w, b = init_linear(gen, self.task.num_classes, d)
        return {"prompts": prompts, "head_w": w, "head_b": b}

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        prompts = {0: params["prompts"][client_index]}  # (B, p, d)
        feats = self.features(x, ctx, prompts, "shallow")
        return per_client_linear(feats.cls, params["head_w"], params["head_b"], client_index)

    def prefix(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, layer: int
    ) -> Tensor:
        prompts = {0: params["prompts"][client_index]}  # (B, p, d)
        return self.backbone.prefix(x, layer, prompts, style="shallow")


@METHODS.register()
class FedVPT(ShallowPromptModel):
    name = "fedvpt"
