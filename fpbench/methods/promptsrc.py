"""PromptSRC: deep vision-language prompts that regulate themselves towards frozen CLIP.

PromptSRC (Khattak, Wasim, Naseer, Khan, Yang, Khan, "Self-regulating Prompts: Foundational
Model Adaptation without Forgetting", ICCV 2023, arXiv 2307.06948; reference code
muzairkhattak/PromptSRC, `trainers/promptsrc.py`). Independent deep prompts in both towers
(IVLP): the text prompt "a photo of a {name}." with its first `n_ctx_text` tokens learned and
tokens 1..n replaced by a new learned prompt entering each of the next J_t - 1 text layers;
`n_ctx_vision` learned vision tokens appended after the patch tokens (before `ln_pre`) and
replaced entering each of the next J_v - 1 vision layers. The loss adds to the cross-entropy
three self-regulating terms: L1 between the prompted and the frozen (zero-shot) text features,
weighted 25; L1 between the prompted and the frozen image features, weighted 10; and the KL
divergence of the prompted logits from the zero-shot ones, KL(p_zs || p), summed over the
classes and divided by their number (the reference's `reduction='sum' / logits.numel()`). The
zero-shot text features are the mean of frozen CLIP's features over 60 ImageNet templates
(`imagenet_templates` below, the reference's ensemble, from CLIP's ImageNet prompt list),
normalised. Gaussian prompt aggregation (GPA) averages the prompts over training with weights
N(t; mean, std).

Adapted to FL: every prompt is averaged by FedAvg (weighted by train size); inference is global.
GPA runs on the server over rounds instead of over the centralised run's epochs (a client's few
local epochs would leave nothing to aggregate): after each round's FedAvg the server folds the
new global prompts into a running Gaussian-weighted mean with weight N(round; gpa_mean, gpa_std),
normalised by the weight so far (the reference normalises over all epochs: the same at the last
round), and evaluates that mean; training continues from the FedAvg prompts, as the reference
trains on and replaces its weights by the GPA ones only after its last epoch. `gpa_mean` and
`gpa_std` are in rounds: the reference's 15 and 1 (for 20 epochs) are kept as defaults; a suite
of R rounds should set about 0.75 R and 0.05 R. Other defaults from the reference
(`configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml`): 4 + 4 prompt tokens, depth
9 in both towers, init "a photo of a", loss weights 25 and 10; its recipe (SGD lr 0.0025, batch
4, cosine) is the suite's `train` settings. ViT CLIP only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, clean_name
from fpbench.lazy import F, torch
from fpbench.methods.base import (
    Context,
    Method,
    MethodConfig,
    Output,
    ServerState,
    TaskInfo,
    Updates,
)
from fpbench.methods.maple import (
    check_depth,
    clip_backbone,
    clip_logits,
    deep_text_features,
    phrase_context,
    phrase_layout,
)
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP

# The reference's zero-shot ensemble: CLIP's 80 ImageNet templates (open_clip's copy) less these 20,
# with "a photo of a {}." moved first (PromptSRC's trainer; the order fixes the mean's rounding).
LEFT_OUT = frozenset({
    "a jpeg corrupted photo of the {}.", "a good photo of a {}.", "a plushie {}.",
    "a photo of the nice {}.", "a photo of the small {}.", "a photo of the weird {}.",
    "the cartoon {}.", "art of the {}.", "a drawing of the {}.", "a photo of the large {}.",
    "a black and white photo of a {}.", "the plushie {}.", "a dark photo of a {}.",
    "itap of a {}.", "graffiti of the {}.", "a toy {}.", "itap of my {}.",
    "a photo of a cool {}.", "a photo of a small {}.", "a tattoo of the {}.",
})  # fmt: skip


def imagenet_templates() -> tuple[str, ...]:
    """The 60 templates of the reference's zero-shot text features, in its order."""
    from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

    first = "a photo of a {}."
    rest = [t("{}") for t in OPENAI_IMAGENET_TEMPLATES]
    return (first, *(t for t in rest if t not in LEFT_OUT and t != first))


class PromptSRCConfig(MethodConfig):
    n_ctx_text: int = Field(4, ge=1, le=70, description="learned text tokens per layer")
    n_ctx_vision: int = Field(4, ge=1, description="learned vision tokens per layer")
    ctx_init: str | None = Field(
        "a photo of a", description="the prompt's phrase; its first n_ctx_text tokens are learned"
    )
    prompt_depth_text: int = Field(9, ge=1, description="J_t: text layers that get prompts")
    prompt_depth_vision: int = Field(9, ge=0, description="J_v: vision layers (0: none)")
    text_loss_weight: float = Field(25.0, ge=0, description="L1 to the zero-shot text features")
    image_loss_weight: float = Field(10.0, ge=0, description="L1 to the zero-shot image features")
    gpa: bool = Field(True, description="evaluate the Gaussian-weighted mean over rounds")
    gpa_mean: float = Field(15.0, description="GPA's Gaussian mean, in rounds (1-based)")
    gpa_std: float = Field(1.0, gt=0, description="GPA's Gaussian std, in rounds")


def gpa_log_weight(round_idx: float, mean: float, std: float) -> float:
    """log N(round; mean, std), the reference's un-normalised Gaussian weight of an epoch."""
    return -0.5 * ((round_idx - mean) / std) ** 2 - math.log(std * math.sqrt(2 * math.pi))


def self_regulating_loss(
    logits: Tensor,
    zs_logits: Tensor,
    image: Tensor,
    text: Tensor,
    zs_image: Tensor,
    zs_text: Tensor,
    text_weight: float,
    image_weight: float,
    client_index: Tensor | None = None,
) -> Tensor:
    """Per-sample (B,) self-regulating terms; their batch mean is the reference's L_SCL.

    logits, zs_logits (B, C); image, zs_image (B, E) normalised; text (K, C, E) the clients'
    normalised text features, sample i's row `client_index[i]` (None: K = B, row i); zs_text
    (C, E).
    """
    l_text = (text - zs_text).abs().mean((-1, -2))  # (K,)
    if client_index is not None:
        l_text = l_text[client_index]  # (B,)
    l_image = (image - zs_image).abs().mean(-1)  # (B,)
    log_p, log_q = F.log_softmax(logits, -1), F.log_softmax(zs_logits, -1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1) / logits.shape[-1]  # (B,)
    return text_weight * l_text + image_weight * l_image + kl


@METHODS.register()
class PromptSRC(Method):
    name = "promptsrc"
    Config = PromptSRCConfig
    backbone_family: ClassVar[str] = "clip"

    def __init__(self, cfg: PromptSRCConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        from fpbench.backbones.clip import check_vit

        super().__init__(cfg, backbone, task)
        clip_backbone(self, backbone, task)
        check_vit(backbone, self.name)
        depths = {"prompt_depth_text": cfg.prompt_depth_text}
        check_depth(backbone, self.name, **depths, prompt_depth_vision=cfg.prompt_depth_vision)
        self._layout: PromptLayout | None = None
        self._zs_text: Tensor | None = None

    @property
    def layout(self) -> PromptLayout:
        if self._layout is None:
            cfg = self.cfg
            names = list(self.task.class_names)
            self._layout = phrase_layout(self.backbone, names, cfg.n_ctx_text, cfg.ctx_init)
        return self._layout

    def zero_shot_text(self, chunk: int = 2048) -> Tensor:
        """Frozen CLIP's class features (C, E): the mean over the templates, normalised.

        All template-class prompts are encoded `chunk` at a time, cut after their last EOT
        (`encode_prompts(truncate=True)`: equal to `encode_text` up to float rounding)."""
        if self._zs_text is None:
            clip = self.backbone
            names = [clean_name(n) for n in self.task.class_names]
            templates = imagenet_templates()
            texts = [t.format(n) for t in templates for n in names]  # template-major
            with torch.no_grad():
                parts = []
                for i in range(0, len(texts), chunk):
                    ids = clip.tokenize(texts[i : i + chunk])
                    parts.append(clip.encode_prompts(clip.token_embed(ids), ids, True).float())
                feats = torch.cat(parts).view(len(templates), len(names), -1)
            self._zs_text = F.normalize(feats.mean(0), dim=-1)  # (C, E)
        return self._zs_text

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The prompts, and the GPA buffers: their running mean (a copy of the start)."""
        from fpbench.backbones.clip import vision_width

        cfg, clip = self.cfg, self.backbone
        d, w = clip.ctx_dim, vision_width(clip)
        nt, nv = cfg.n_ctx_text, cfg.n_ctx_vision
        params = {"ctx": phrase_context(clip, gen, nt, cfg.ctx_init)}  # (n_t, d)
        if cfg.prompt_depth_text > 1:
            params["deep_text"] = torch.randn(cfg.prompt_depth_text - 1, nt, d, generator=gen)
            params["deep_text"] *= 0.02  # (J_t - 1, n_t, d)
        if cfg.prompt_depth_vision > 0:
            params["vision"] = torch.randn(nv, w, generator=gen) * 0.02  # (n_v, w)
        if cfg.prompt_depth_vision > 1:
            params["deep_vision"] = torch.randn(cfg.prompt_depth_vision - 1, nv, w, generator=gen)
            params["deep_vision"] *= 0.02  # (J_v - 1, n_v, w)
        buffers = {f"gpa_{k}": v.clone() for k, v in params.items()}
        buffers["gpa_round"] = torch.zeros(())  # rounds folded in so far
        buffers["gpa_log_weight"] = torch.full((), -math.inf, dtype=torch.float64)
        return ServerState(params, buffers=buffers)

    def text_features(self, params: dict[str, Tensor]) -> Tensor:
        """Normalised prompted text features (K, C, E)."""
        ctx = params["ctx"]
        deep = params.get("deep_text", ctx[:, :0, None])  # (K, J_t - 1, n, d)
        return deep_text_features(self.backbone, self.layout, ctx, deep)

    def image_features(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Normalised prompted image features (B, E)."""
        from fpbench.backbones.clip import encode_image_deep

        if "vision" not in params:
            return F.normalize(self.backbone.encode_image(x).float(), dim=-1)
        shallow = params["vision"][client_index]  # (B, n_v, w)
        deep = params.get("deep_vision")
        layers = [] if deep is None else [deep[client_index, j] for j in range(deep.shape[1])]
        return F.normalize(encode_image_deep(self.backbone, x, shallow, layers).float(), dim=-1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        text = self.text_features(params)  # (K, C, E)
        image = self.image_features(params, x, client_index)
        logits = clip_logits(self.backbone, image, text, client_index)
        if not ctx.training:
            return logits
        zs_text = self.zero_shot_text().to(image.device)  # (C, E)
        with torch.no_grad():
            zs_image = F.normalize(self.backbone.encode_image(x).float(), dim=-1)  # (B, E)
            zs_logits = self.backbone.logit_scale * zs_image @ zs_text.T
        cfg = self.cfg
        w_text, w_image = cfg.text_loss_weight, cfg.image_loss_weight
        terms = (logits, zs_logits, image, text, zs_image, zs_text, w_text, w_image)
        return Output(logits, self_regulating_loss(*terms, client_index))

    # -- GPA on the server ------------------------------------------------------------------------
    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """FedAvg, then the new global prompts folded into the Gaussian-weighted mean."""
        new = super().aggregate(server, updates)
        b = server.buffers
        r = float(b["gpa_round"]) + 1
        log_w = gpa_log_weight(r, self.cfg.gpa_mean, self.cfg.gpa_std)
        held_w = b["gpa_log_weight"]
        total = torch.logaddexp(
            held_w, torch.tensor(log_w, dtype=held_w.dtype, device=held_w.device)
        )
        share = float(torch.exp(log_w - total))  # w_r / (w_1 + ... + w_r)
        buffers = dict(b)
        for k, v in new.params.items():
            held = b[f"gpa_{k}"].to(v.device)
            buffers[f"gpa_{k}"] = held + share * (v.detach() - held)
        buffers["gpa_round"] = b["gpa_round"] + 1
        buffers["gpa_log_weight"] = total
        return ServerState(new.params, new.personal, buffers)

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Training starts from the FedAvg prompts; evaluation uses GPA's mean (with `gpa`)."""
        if training or not self.cfg.gpa:
            return super().client_params(server, client_ids, training, draw)
        gpa = {k: server.buffers[f"gpa_{k}"] for k in server.params}
        return super().client_params(ServerState(gpa, server.personal), client_ids, training, draw)
