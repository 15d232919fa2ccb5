"""Head-Tune: train only a linear classifier on the frozen backbone's cls feature, FedAvg.

The simplest parameter-efficient baseline of SGPT (Deng et al., CVPR 2024, Table 1) and
PEP-FedPT. Client: cross-entropy on a linear head over the frozen cls token. Server: FedAvg of
the head weighted by client train sizes. No prompts, so the backbone's features are fixed: the
backbone recalls them from the engine's frozen store, computed once per sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fpbench.lazy import torch
from fpbench.methods.base import Context, Method, MethodConfig
from fpbench.methods.helpers import init_linear, per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


@METHODS.register()
class HeadTune(Method):
    name = "head-tune"
    Config = MethodConfig

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        w, b = init_linear(gen, self.task.num_classes, self.backbone.embed_dim)
        return {"head_w": w, "head_b": b}

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        feats = self.backbone.forward_features(x).cls  # (B, d), unprompted: recalled
        return per_client_linear(feats, params["head_w"], params["head_b"], client_index)
