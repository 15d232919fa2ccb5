"""Zero-shot CLIP: the frozen model with a hand-written prompt per class, nothing trained.

The reference row of every CLIP table (Radford et al., "Learning Transferable Visual Models From
Natural Language Supervision", ICML 2021, arXiv:2103.00020), as CoOp reports it (Zhou et al.,
"Learning to Prompt for Vision-Language Models", IJCV 2022, arXiv:2109.01134): one template per
dataset (CoOp's `trainers/zsclip.py`, `CUSTOM_TEMPLATES`), filled with each class name
(underscores read as spaces), encoded by the text tower and L2-normalised; the logits are
exp(logit_scale) * cos(image, text). Nothing is trained or communicated: the engine still plays
the suite's rounds (each computes the zero-shot loss on the sampled clients' train data without
a step) and evaluates and stores them like any other method's, so the row sits beside the others.

Datasets without a CoOp template (CIFAR, Office, DomainNet, synthetic ...) get CoOp's generic
"a photo of a {}." (declared in `method_readings`); `template` overrides the choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.backbones.clip_prompts import clean_name
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, ServerState, Updates
from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP

GENERIC_TEMPLATE = "a photo of a {}."

# CoOp's per-dataset template (trainers/zsclip.py), keyed by fpbench's dataset names
COOP_TEMPLATES: dict[str, str] = {
    "oxford-pets": "a photo of a {}, a type of pet.",
    "flowers102": "a photo of a {}, a type of flower.",
    "fgvc-aircraft": "a photo of a {}, a type of aircraft.",
    "dtd": "{} texture.",
    "eurosat": "a centered satellite photo of {}.",
    "stanford-cars": "a photo of a {}.",
    "food101": "a photo of {}, a type of food.",
    "sun397": "a photo of a {}.",
    "caltech101": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
    "imagenet": "a photo of a {}.",
    "imagenet-sketch": "a photo of a {}.",
    "imagenet-v2": "a photo of a {}.",
    "imagenet-a": "a photo of a {}.",
    "imagenet-r": "a photo of a {}.",
}


def dataset_template(dataset: str, template: str | None = None) -> str:
    """The hand-written template of a dataset: `template` if given, else CoOp's, else generic."""
    out = template or COOP_TEMPLATES.get(dataset, GENERIC_TEMPLATE)
    if out.count("{}") != 1:
        raise FpbenchError(f"prompt template {out!r} must hold exactly one '{{}}' for the class")
    return out


def hand_crafted_text_features(
    clip: PromptedCLIP, class_names: tuple[str, ...] | list[str], template: str
) -> Tensor:
    """L2-normalised text features (C, E) of `template` filled with each class name."""
    prompts = [template.format(clean_name(name)) for name in class_names]
    with torch.no_grad():
        return F.normalize(clip.encode_text(clip.tokenize(prompts)).float(), dim=-1)


class ZeroShotConfig(MethodConfig):
    template: str | None = Field(
        None, description="prompt template with one {} for the class name; default CoOp's"
    )


@METHODS.register()
class ZeroShot(CoOpModel):
    name = "zero-shot"
    Config = ZeroShotConfig

    @property
    def template(self) -> str:
        return dataset_template(self.task.dataset, self.cfg.template)

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        return {}

    def text(self, device: torch.device) -> Tensor:
        """The class text features (C, E), computed once per device."""
        held = self._fixed_text.get(str(device))
        if held is None:
            text = hand_crafted_text_features(self.backbone, self.task.class_names, self.template)
            held = self._fixed_text[str(device)] = (text, text.to(device))
        return held[1]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        feats = self.image_features(x)  # (B, E)
        return self.backbone.logit_scale * feats @ self.text(feats.device).T

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        return server  # nothing trained
