"""TPFL: twin prompts, a CoOp text prompt and a pixel-space visual prompt, both FedAvg'd.

TPFL (Zhao, Shi, Liu, Ding, "Inclusive Data Representation in Federated Learning: A Novel
Approach Integrating Textual and Visual Prompt", UbiComp/ISWC 2023 Adjunct, sec. 3.2). Client:
CoOp's learnable text context (M vectors, class token at the end) and a visual prompt v added to
the normalised image (x + v) in one of Bahng et al.'s three patterns (padding, fixed patch,
random patch), trained jointly with CLIP's cross-entropy on a frozen CLIP. Server: the text and
the visual prompt each averaged with weights n_i / sum_j n_j (eq. 3). Inference: the global
prompts for every client.

Defaults: 16 context tokens (CoOp; the paper gives no length), padding pattern 30 pixels wide
at 224 px (Bahng et al.; scaled to the backbone's input size). The paper trains with Adam, lr 1e-3
and a cosine schedule over 20 epochs (set in the suite) and says nothing about the visual
prompt's own training; a pixel prompt at that lr barely moves in the few steps a few-shot client
takes, so the visual prompt follows its authors' recipe instead (Bahng et al.'s CLIP setting:
SGD, lr 40, momentum 0.9, no weight decay; annealed with the run's schedule) and starts at zero,
so round 0 sees CLIP's own images (Bahng's N(0, 1) init covers 46% of the pixels with noise:
`visual_init = "normal"`, `visual_optimizer = "shared"` restore the old reading).
Random-patch positions are drawn per sample from torch's global generator (Bahng draws one per
batch); runs stay reproducible, but the reference and lockstep executors then see different
positions, so only the padding and fixed-patch patterns are executor-invariant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from fpbench.backbones.clip_prompts import PixelPrompter
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Phase
from fpbench.methods.coop import CoOpConfig, CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class TPFLConfig(CoOpConfig):
    visual_pattern: Literal["padding", "fixed_patch", "random_patch"] = "padding"
    visual_size: int | None = Field(
        None, ge=1, description="prompt width/patch side in pixels; None: 30 at 224 px, scaled"
    )
    visual_init: Literal["zeros", "normal"] = Field(
        "zeros", description="zeros: no effect at round 0; normal: Bahng's N(0, 1)"
    )
    visual_optimizer: Literal["sgd", "adam", "shared"] = Field(
        "sgd", description="the visual prompt's optimiser (Bahng: SGD); shared: the run's train"
    )
    visual_lr: float = Field(40.0, gt=0, description="Bahng et al.'s CLIP lr")
    visual_momentum: float = Field(0.9, ge=0, lt=1)
    visual_weight_decay: float = Field(0.0, ge=0)


class TwinPromptModel(CoOpModel):
    """Text context plus a pixel prompt; images go through the (frozen) image encoder."""

    Config = TPFLConfig

    @property
    def prompter(self) -> PixelPrompter:
        if not hasattr(self, "_prompter"):
            s = self.backbone.img_size
            size = self.cfg.visual_size or max(1, round(30 * s / 224))
            self._prompter = PixelPrompter(self.cfg.visual_pattern, s, size)
        return self._prompter

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        ctx = self.init_context(gen)
        visual = self.prompter.init(gen)
        if self.cfg.visual_init == "zeros":
            visual = torch.zeros_like(visual)
        return {"ctx": ctx, "visual_prompt": visual}

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", names, local_epochs, self.visual_optimizer())]

    def visual_optimizer(self) -> dict[str, dict[str, Any]]:
        """The pixel prompt's own optimiser (`Phase.optimizers`); none when it is `shared`."""
        cfg = self.cfg
        if cfg.visual_optimizer == "shared":
            return {}
        own = {
            "optimizer": cfg.visual_optimizer,
            "lr": cfg.visual_lr,
            "momentum": cfg.visual_momentum,
            "weight_decay": cfg.visual_weight_decay,
        }
        return {"visual_prompt": own}

    def image_features(self, x: Tensor, visual: Tensor | None = None) -> Tensor:
        """Normalised features (B, E) of images x (B, 3, S, S) plus per-sample prompts (B, 3, P)."""
        pixels = None if visual is None else self.prompter.render(visual)  # (B, 3, S, S)
        return F.normalize(self.backbone.encode_image(x, pixels).float(), dim=-1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        text = self.text_features(params["ctx"])  # (K, C, E)
        feats = self.image_features(x, params["visual_prompt"][client_index])  # (B, E)
        return self.logits(feats, text, client_index)


@METHODS.register()
class TPFL(TwinPromptModel):
    name = "tpfl"
