"""FedVPT and FedVPT-D: VPT prompts plus a linear head, trained with FedAvg.

Visual Prompt Tuning (Jia et al., ECCV 2022), federated with FedAvg (McMahan et al., 2017), as
the baselines "FedVPT" and "FedVPT-D" of SGPT (Deng et al., CVPR 2024) and PEP-FedPT. Client:
learnable prompt tokens and a linear head on the final cls token, trained with cross-entropy.
Server: FedAvg of prompts and head, weighted by client train sizes. The two differ only in the
prompt style (`VPTModel.style`):

- FedVPT (shallow): `prompt_len` tokens inserted after cls before block 0; default 5, FGPT's
  VPT-shallow setting.
- FedVPT-D (deep): `prompt_len` tokens per block, inserted after cls before every block and
  replacing the previous block's prompt tokens; default one token per layer, SGPT's length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, Method, MethodConfig
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear, rows_of
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class VPTConfig(MethodConfig):
    prompt_len: int = Field(5, ge=1, description="number of VPT-shallow prompt tokens")


class DeepConfig(MethodConfig):
    prompt_len: int = Field(1, ge=1, description="prompt tokens per layer")


class VPTModel(Method):
    """VPT prompts (`style`: shallow, or deep: one set per block) + a linear head; subclasses
    choose how they are federated."""

    Config = VPTConfig
    style: ClassVar[Literal["shallow", "deep"]] = "shallow"

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        d, patch = self.backbone.embed_dim, self.backbone.patch_size
        if self.style == "shallow":
            prompts = init_prompts(gen, self.cfg.prompt_len, d, patch)  # (p, d)
        else:
            layers = range(self.backbone.depth)
            prompts = torch.stack(
                [init_prompts(gen, self.cfg.prompt_len, d, patch) for _ in layers]
            )
        w, b = init_linear(gen, self.task.num_classes, d)
        return {"prompts": prompts, "head_w": w, "head_b": b}

    def _prompts(self, params: dict[str, Tensor], client_index: Tensor) -> dict[int, Tensor]:
        """Each sample's prompts by the block they enter before: (B, p, d) each."""
        prompts = rows_of(params["prompts"], client_index)  # (B, p, d) or (B, L, p, d)
        if self.style == "shallow":
            return {0: prompts}
        return {layer: prompts[:, layer] for layer in range(prompts.shape[1])}

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        prompts = self._prompts(params, client_index)
        feats = self.backbone.forward_features(x, prompts, self.style)
        return per_client_linear(feats.cls, params["head_w"], params["head_b"], client_index)


@METHODS.register()
class FedVPT(VPTModel):
    """FedVPT: VPT-shallow prompts plus a linear head, trained with FedAvg."""

    name = "fedvpt"


@METHODS.register()
class FedVPTDeep(VPTModel):
    """FedVPT-D: VPT-deep prompts at every layer plus a linear head, trained with FedAvg."""

    name = "fedvpt-d"
    style = "deep"
    Config = DeepConfig
