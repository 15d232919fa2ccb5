"""PLOT: several text prompts per class matched to local image features by optimal transport.

PLOT (Chen, Yao, Wang, Bi, Zhang, Zhang, Yao, "PLOT: Prompt Learning with Optimal Transport for
Vision-Language Models", ICLR 2023, arXiv 2210.01253; reference code CHENGY12/PLOT,
`plot-coop/trainers/plot.py`). N CoOp contexts (generic, shared by the classes) give each class N
text features. For an image and a class, the cosine similarities S[m, n] between the image's M
local features (RN50 `attnpool` outputs at the spatial positions; ViT patch tokens after `ln_post`
and `proj`, as fpbench's FedOTP reads them) and the class's N prompt features define a balanced
entropic transport problem with kernel exp(-(1 - S) / eps) and uniform marginals 1/M, 1/N; the
Sinkhorn plan T carries no gradient and the logit is exp(logit_scale) * sum_mn T[m, n] S[m, n],
trained with cross-entropy. The solver is fpbench's FedOTP one (`fedotp.transport_plan`,
balanced, watching u as the reference does).

Adapted to FL: the N contexts are averaged by FedAvg (weighted by train size); inference is
global. Defaults from the reference (`scripts/main.sh`, `train.py`, `configs/trainers/PLOT/
rn50.yaml`): N = 4 prompts of 16 tokens, class token at the end, eps = 0.1, stop when the mean
change of u is below 1e-2, at most 100 iterations; its recipe (SGD lr 0.002, batch 128 (32 in
the paper), cosine) is the suite's `train` settings. Deviations (`method_readings`): the
stopping rule applies to each (image, class) problem on its own (the reference: to the batch's
mean change), the plan is solved in float64; the reference adds the global (pooled) CLIP
logits on ImageNet only (`add_global_logits`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, init_context
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Method, MethodConfig, TaskInfo
from fpbench.methods.fedotp import transport_plan
from fpbench.methods.maple import clip_backbone, clip_logits
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP


class PLOTConfig(MethodConfig):
    n_ctx: int = Field(16, ge=1, le=70, description="context tokens of each prompt")
    n_prompts: int = Field(4, ge=1, description="N: prompts (contexts) per class")
    class_token_position: Literal["end", "middle", "front"] = "end"
    eps: float = Field(0.1, gt=0, description="entropic regularisation")
    thresh: float = Field(1e-2, gt=0, description="stop when mean |u - u_prev| < thresh")
    max_iter: int = Field(100, ge=1)
    add_global_logits: bool = Field(
        False, description="add exp(scale) * cos(pooled image, mean prompt) (reference: ImageNet)"
    )


@METHODS.register()
class PLOT(Method):
    name = "plot"
    Config = PLOTConfig
    backbone_family: ClassVar[str] = "clip"

    def __init__(self, cfg: PLOTConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        clip_backbone(self, backbone, task)
        self._layout: PromptLayout | None = None

    @property
    def layout(self) -> PromptLayout:
        if self._layout is None:
            cfg, names = self.cfg, list(self.task.class_names)
            pos = cfg.class_token_position
            self._layout = PromptLayout.build(self.backbone, names, cfg.n_ctx, pos)
        return self._layout

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        """N contexts (N, n_ctx, d), each N(0, 0.02^2)."""
        ctx = [init_context(self.backbone, gen, self.cfg.n_ctx) for _ in range(self.cfg.n_prompts)]
        return {"ctx": torch.stack(ctx)}

    def text_features(self, ctx: Tensor) -> Tensor:
        """Un-normalised prompt features (K, N, C, E) of per-client contexts (K, N, n, d)."""
        k, n = ctx.shape[:2]
        emb = self.layout.assemble(ctx.flatten(0, 1))  # (K*N, C, L, d)
        c = emb.shape[1]
        ids = self.layout.ids.repeat(k * n, 1)
        feats = self.backbone.encode_prompts(emb.flatten(0, 1), ids, truncate=True)
        return feats.float().view(k, n, c, -1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        raw = self.text_features(params["ctx"])  # (K, N, C, E)
        text = F.normalize(raw, dim=-1)
        with torch.no_grad():
            tokens = F.normalize(self.backbone.encode_image_tokens(x).float(), dim=-1)
        sim = torch.einsum("bme,bnce->bcmn", tokens[:, 1:], text[client_index])  # (B, C, M, N)
        cfg = self.cfg
        plan = transport_plan(sim, 1.0, cfg.eps, cfg.thresh, cfg.max_iter, True, watch="u")
        logits = self.backbone.logit_scale * (plan * sim).sum((-1, -2))  # (B, C)
        if cfg.add_global_logits:
            pooled_text = F.normalize(raw.mean(1), dim=-1)  # (K, C, E)
            logits = logits + clip_logits(self.backbone, tokens[:, 0], pooled_text, client_index)
        return logits
