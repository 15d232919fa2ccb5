"""KgCoOp: CoOp whose class text features are kept near the hand-crafted prompt's.

KgCoOp (Yao, Zhang, Xu, "Visual-Language Prompt Tuning with Knowledge-guided Context
Optimization", CVPR 2023, arXiv:2303.13283; code github.com/htyao89/KgCoOp). A CoOp context is
trained with cross-entropy plus w times a distance between the prompt's normalised class text
features t_c and those of the hand-written template t_c^clip ("a photo of a {}." and CoOp's
per-dataset templates, KgCoOp's table: its DTD template is "a photo of a {}, a type of
texture."). The official code's distance, the default, is 1 - mean_c cos(t_c, t_c^clip); the
paper's (eq. 5) is mean_c ||t_c - t_c^clip||^2, i.e. twice that on unit vectors
(`distance = "squared-l2"`). Defaults from the official scripts: the context initialised from
"a photo of a" (4 tokens), class token at the end, w = 8.0 (its README's runs and the paper's
lambda; `train.py`'s fallback is 1.0).

Adapted to FL as FLiP does: every client trains the context with this loss on its own data, the
server averages it weighted by train size (FedAvg, as PromptFL); inference: the global context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, Output
from fpbench.methods.coop import CoOpConfig, CoOpModel
from fpbench.methods.zero_shot import (
    COOP_TEMPLATES,
    dataset_template,
    hand_crafted_text_features,
)
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

# KgCoOp's own template table (trainers/kgcoop.py): CoOp's, but DTD's
KGCOOP_TEMPLATES = {**COOP_TEMPLATES, "dtd": "a photo of a {}, a type of texture."}


class KgCoOpConfig(CoOpConfig):
    ctx_init: str | None = Field(
        "a photo of a", description='init phrase (the official "a photo of a"); None: random'
    )
    w: float = Field(8.0, ge=0, description="weight of the knowledge-guided distance")
    distance: Literal["cosine", "squared-l2"] = Field(
        "cosine", description="cosine: 1 - mean cos (code); squared-l2: mean ||.||^2 (paper)"
    )
    template: str | None = Field(
        None, description="hand-crafted template with one {}; default KgCoOp's per dataset"
    )


def knowledge_distance(text: Tensor, anchor: Tensor, distance: str = "cosine") -> Tensor:
    """Per row (K,) distance between text features (K, C, E) and the anchor's (C, E), both
    L2-normalised: 1 - mean_c cos, or mean_c squared Euclidean distance."""
    if distance == "cosine":
        return 1.0 - (text * anchor).sum(-1).mean(-1)
    return (text - anchor).pow(2).sum(-1).mean(-1)


@METHODS.register()
class KgCoOp(CoOpModel):
    name = "kgcoop"
    Config = KgCoOpConfig

    def anchor(self, device: torch.device) -> Tensor:
        """The hand-crafted class text features (C, E), computed once per device."""
        key = f"anchor:{device}"
        if key not in self._fixed_text:
            template = self.cfg.template or KGCOOP_TEMPLATES.get(self.task.dataset)
            text = hand_crafted_text_features(
                self.backbone, self.task.class_names, dataset_template(self.task.dataset, template)
            )
            self._fixed_text[key] = (text, text.to(device))
        return self._fixed_text[key][1]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        text = self.text_features(params["ctx"])  # (K, C, E)
        logits = self.logits(self.image_features(x), text, client_index)
        if not ctx.training:
            return logits
        dist = knowledge_distance(text, self.anchor(text.device), self.cfg.distance)  # (K,)
        return Output(logits, self.cfg.w * dist[client_index])
