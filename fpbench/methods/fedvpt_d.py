"""FedVPT-D: VPT-deep prompts at every layer plus a linear head, trained with FedAvg.

Visual Prompt Tuning, deep variant (Jia et al., ECCV 2022), federated with FedAvg, as the
"FedVPT-D" baseline of SGPT (Deng et al., CVPR 2024) and PEP-FedPT. Client: `prompt_len` tokens
per block, inserted after cls before every block and replacing the previous block's prompt
tokens, and a linear head on the final cls token, trained with cross-entropy. Server: FedAvg of
all prompts and the head, weighted by client train sizes. Default: one token per layer, SGPT's
prompt length.
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


class DeepConfig(MethodConfig):
    prompt_len: int = Field(1, ge=1, description="prompt tokens per layer")


@METHODS.register()
class FedVPTDeep(Method):
    name = "fedvpt-d"
    Config = DeepConfig

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        d, depth = self.backbone.embed_dim, self.backbone.depth
        patch = self.backbone.patch_size
        prompts = torch.stack(
            [init_prompts(gen, self.cfg.prompt_len, d, patch) for _ in range(depth)]
        )  # (L, p, d)
        w, b = init_linear(gen, self.task.num_classes, d)
        return {"prompts": prompts, "head_w": w, "head_b": b}

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        prompts = params["prompts"][client_index]  # (B, L, p, d)
        per_layer = {layer: prompts[:, layer] for layer in range(prompts.shape[1])}
        feats = self.backbone.forward_features(x, per_layer, style="deep").cls  # (B, d)
        return per_client_linear(feats, params["head_w"], params["head_b"], client_index)
