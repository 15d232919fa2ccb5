"""ProDA: a collection of prompts whose class text features are modelled as a Gaussian.

ProDA (Lu, Liu, Zhang, Liu, Tian, "Prompt Distribution Learning", CVPR 2022, arXiv:2205.03340).
P learnable CoOp contexts (generic, class token at the end) give each class c P normalised text
features t_pc. Their mean mu_c is the classifier (the logit is exp(logit_scale) * x . mu_c, at
training and at evaluation); their spread is a Gaussian over classifier weights, and training
minimises a surrogate of the expected cross-entropy under it: the logit of class c gains
s^2 / 2 * sigma_c(x, y), where s = exp(logit_scale), y the label and sigma_c the variance of
x . (t_c - t_y) under a diagonal covariance estimate,

    sigma_c = sum_d x_d^2 * sum_p ((t_pc - mu_c)_d - (t_py - mu_y)_d)^2 / (P + 1).

A diversity term adds w times the mean absolute cosine similarity between the P prompts' text
features without a class name ("SOT ctx EOT"), over the pairs p != q.

ProDA's authors released no code. The reference is FLiP's reimplementation (github 0-ml/flip,
`flcore/models/clip/ProDA.py` and `ProDAPromptLearner` in `flcore/models/text/prompt.py`, read at
commit 80572ee); from it: the surrogate above (its divisor P + 1), w = 1, 4 context tokens N(0,
0.02^2) (FLiP's `--num_context`), every prompt's class token at the end (its prompt builder uses
the "end" prompts only), evaluation with the mean of the normalised features (not renormalised).
Not from it, declared in `fpbench/report/method_readings.py`: FLiP runs ProDA with one prompt
(`--num_prompt` 1), which makes the covariance and the diversity term vanish, i.e. CoOp; the
default here is P = 4 (`n_prompts = 1` is FLiP's run), every prompt encoded at every step (the
paper samples a mini-batch of prompts from a larger collection; FLiP's `prompt_batch_size`).

Adapted to FL as FLiP does: every client trains the P contexts on its own data, the server
averages them weighted by train size (FedAvg); inference: the global contexts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, init_context
from fpbench.lazy import torch
from fpbench.methods.base import Context, MethodConfig, Output, TaskInfo
from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

    from fpbench.backbones.clip import PromptedCLIP


class ProDAConfig(MethodConfig):
    n_ctx: int = Field(4, ge=1, le=70, description="context tokens of each prompt (FLiP: 4)")
    n_prompts: int = Field(4, ge=1, description="P: prompts in the collection (FLiP runs 1)")
    w: float = Field(1.0, ge=0, description="weight of the prompts' diversity loss")


def surrogate_variance(feats: Tensor, deviations: Tensor, labels: Tensor, rows: Tensor) -> Tensor:
    """sigma (B, C): per sample, the variance of x . (t_c - t_y) under the prompts' diagonal
    covariance. feats (B, E), deviations t - mu (K, P, C, E), labels and rows (B,)."""
    dev = deviations[rows]  # (B, P, C, E)
    dev_y = deviations[rows, :, labels]  # (B, P, E)
    diff = dev - dev_y.unsqueeze(2)
    return torch.einsum("be,bpce->bc", feats.pow(2), diff.pow(2)) / (deviations.shape[1] + 1)


def prompt_diversity(features: Tensor) -> Tensor:
    """(K,) mean |cos| between the P class-free prompt features (K, P, E) over p != q;
    zero for one prompt."""
    p = features.shape[1]
    if p == 1:
        return features.new_zeros(features.shape[0])
    sim = features @ features.transpose(1, 2)  # (K, P, P)
    off = ~torch.eye(p, dtype=torch.bool, device=features.device)
    return sim[:, off].abs().mean(-1)


@METHODS.register()
class ProDA(CoOpModel):
    name = "proda"
    Config = ProDAConfig

    def __init__(self, cfg: ProDAConfig, backbone: PromptedCLIP, task: TaskInfo) -> None:
        super().__init__(cfg, backbone, task)
        self._class_free: PromptLayout | None = None

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        """P contexts (P, n_ctx, d), each N(0, 0.02^2)."""
        cfg = self.cfg
        ctx = [init_context(self.backbone, gen, cfg.n_ctx) for _ in range(cfg.n_prompts)]
        return {"ctx": torch.stack(ctx)}

    def prompt_features(self, ctx: Tensor) -> Tensor:
        """Normalised class text features (K, P, C, E) of per-client contexts (K, P, n, d)."""
        k, p = ctx.shape[:2]
        return self.text_features(ctx.flatten(0, 1)).unflatten(0, (k, p))

    def class_free_features(self, ctx: Tensor) -> Tensor:
        """Normalised features (K, P, E) of the prompts "SOT ctx ." without a class name."""
        if self._class_free is None:
            self._class_free = PromptLayout.build(self.backbone, [""], ctx.shape[-2])
        k, p = ctx.shape[:2]
        return self._class_free.text_features(self.backbone, ctx.flatten(0, 1)).view(k, p, -1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        text = self.prompt_features(params["ctx"])  # (K, P, C, E)
        mean = text.mean(1)  # (K, C, E)
        feats = self.image_features(x)
        logits = self.logits(feats, mean, client_index)
        if not ctx.training:
            return logits
        if ctx.labels is None:
            raise ValueError("ProDA's training forward needs the batch's labels")
        deviations = text - mean.unsqueeze(1)
        sigma = surrogate_variance(feats, deviations, ctx.labels, client_index)
        logits = logits + 0.5 * self.backbone.logit_scale**2 * sigma
        diversity = prompt_diversity(self.class_free_features(params["ctx"]))  # (K,)
        return Output(logits, self.cfg.w * diversity[client_index])
