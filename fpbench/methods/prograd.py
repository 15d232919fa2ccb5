"""ProGrad: CoOp updated only along gradients that do not conflict with zero-shot CLIP's.

ProGrad (Zhu, Niu, Han, Wu, Zhang, "Prompt-aligned Gradient for Prompt Tuning", ICCV 2023,
arXiv:2205.14865; code github.com/BeierZhu/Prompt-align). Per step, with the CoOp logits z and
the zero-shot logits z0 of the same images (the hand-written template of ProGrad's table), two
batch-mean losses are taken: the cross-entropy L_ce(z, y) and the distillation
L_kl = -T^2 sum_c softmax(z0 / T)_c log softmax(z / T)_c. With their gradients g and g_kl on the
context, the step uses g where g . g_kl >= 0 and else g - lambda (g . u) u, u = g_kl / ||g_kl||
(Dassl.ProGrad `prograd_backward_and_update`). Defaults from the official scripts: 16 context
tokens, the last of which are initialised from the template's words (the rest zeros), class token
at the end, T = 1, lambda = 1. As in the official code, the prompt is then the text
"X..X <template words> name." whose first 16 tokens are the context: a template with more BPE
tokens than words ("a type of pet, a photo of a": "pet," is two tokens) keeps the extra ones as
fixed tokens before the class name, and its last word's embedding is not in the context.

The custom step is written in the training forward's loss (`Output.loss`): each client's
projected gradient is computed there (`torch.autograd.grad` of its two batch means) and returned
through a surrogate whose value is the cross-entropy and whose gradient is exactly that projected
gradient, so the engine's optimiser, clipping and lockstep executor apply unchanged. Adapted to
FL as FLiP does: FedAvg of the context weighted by train size; inference: the global context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.backbones.clip_prompts import PromptLayout, clean_name
from fpbench.errors import FpbenchError
from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output
from fpbench.methods.coop import CoOpConfig, CoOpModel
from fpbench.methods.zero_shot import dataset_template, hand_crafted_text_features
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

# ProGrad's template table (trainers/prograd.py), keyed by fpbench's dataset names
PROGRAD_TEMPLATES: dict[str, str] = {
    "oxford-pets": "a type of pet, a photo of a {}.",
    "flowers102": "a type of flower, a photo of a {}.",
    "fgvc-aircraft": "a type of aircraft, a photo of a {}.",
    "dtd": "a texture of {}.",
    "eurosat": "a centered satellite photo of {}.",
    "stanford-cars": "a photo of a {}.",
    "food101": "a type of food, a photo of {}.",
    "sun397": "a photo of a {}.",
    "caltech101": "a photo of a {}.",
    "ucf101": "a photo of a person doing {}.",
    "imagenet": "a photo of a {}.",
    "imagenet-sketch": "a photo of a {}.",
    "imagenet-v2": "a photo of a {}.",
    "imagenet-a": "a photo of a {}.",
    "imagenet-r": "a photo of a {}.",
}


class ProGradConfig(CoOpConfig):
    init_from_template: bool = Field(
        True, description="the last context tokens start as the template's words (CTX_INIT)"
    )
    lam: float = Field(1.0, ge=0, description="lambda: how much of the conflicting part goes")
    temperature: float = Field(1.0, gt=0, description="T of the distillation loss")
    template: str | None = Field(
        None, description="zero-shot template with one {}; default ProGrad's per dataset"
    )


def project(g: Tensor, g_kl: Tensor, lam: float) -> Tensor:
    """ProGrad's update per row (K, ...): g, or g - lam (g . u) u with u = g_kl / ||g_kl||
    where g . g_kl < 0 (rows whose g_kl is zero keep g)."""
    a, b = g.flatten(1), g_kl.flatten(1)
    norm = b.norm(dim=1, keepdim=True)
    u = torch.where(norm > 0, b / norm.clamp(min=torch.finfo(b.dtype).tiny), torch.zeros_like(b))
    dot = (a * u).sum(1, keepdim=True)
    out = torch.where(dot < 0, a - lam * dot * u, a)
    return out.view_as(g)


def distillation(logits: Tensor, teacher: Tensor, t: float) -> Tensor:
    """Per-sample -T^2 sum_c softmax(teacher / T) log softmax(logits / T) (B,)."""
    return -(F.softmax(teacher / t, -1) * F.log_softmax(logits / t, -1)).sum(-1) * t * t


@METHODS.register()
class ProGrad(CoOpModel):
    name = "prograd"
    Config = ProGradConfig

    @property
    def template(self) -> str:
        template = self.cfg.template or PROGRAD_TEMPLATES.get(self.task.dataset)
        return dataset_template(self.task.dataset, template)

    @property
    def from_template(self) -> bool:
        """Whether the context starts from the template (CTX_INIT), class token at the end."""
        cfg = self.cfg
        return cfg.init_from_template and not cfg.ctx_init and not cfg.csc

    def _phrase(self) -> tuple[str, int]:
        """The template without its class slot, and its number of space-separated words."""
        phrase = self.template.replace(" {}.", "").replace("_", " ")
        return phrase, len(phrase.split(" "))

    def layout(self, n_ctx: int) -> PromptLayout:
        """With the template init, the official prompt text "X..X <template words> name." (the
        context is its first n_ctx tokens after SOT; where the template has more BPE tokens than
        words, e.g. "pet,", the rest stay fixed before the name); else CoOp's."""
        if not self.from_template or n_ctx in self._layouts:
            return super().layout(n_ctx)
        if self.cfg.class_token_position != "end":
            raise FpbenchError("prograd's template init puts the class token at the end")
        phrase, words = self._phrase()
        head = " ".join(["X"] * (n_ctx - words) + [phrase])
        names = [clean_name(n) for n in self.task.class_names]
        with torch.no_grad():
            ids = self.backbone.tokenize([f"{head} {n}." for n in names])  # (C, L)
            emb = self.backbone.token_embed(ids).float()
        order = torch.arange(ids.shape[1] - 1, device=ids.device).repeat(len(names), 1)
        lens = [len(self.backbone.tokenizer.encode(n)) for n in names]
        self._layouts[n_ctx] = PromptLayout(
            n_ctx, "end", ids, emb[:, :1], emb[:, 1 + n_ctx :], order, lens
        )
        return self._layouts[n_ctx]

    def init_context(self, gen: torch.Generator) -> Tensor:
        """Zeros (M, d) whose last k rows are the embeddings of the template's first k tokens,
        k its number of space-separated words (the official count), or CoOp's random init."""
        if not self.from_template:
            return super().init_context(gen)
        phrase, words = self._phrase()
        m = self.cfg.n_ctx
        if words > m:
            raise FpbenchError(f"{m} context tokens cannot hold the template's {words} words")
        ids = self.backbone.tokenize([phrase])
        with torch.no_grad():
            emb = self.backbone.token_embed(ids)[0, 1 : 1 + words].float().cpu()
        ctx = torch.zeros(m, self.backbone.ctx_dim)
        ctx[m - words :] = emb
        return ctx

    def zero_shot_text(self, device: torch.device) -> Tensor:
        """The template's class text features (C, E), computed once per device."""
        key = f"zero-shot:{device}"
        if key not in self._fixed_text:
            text = hand_crafted_text_features(self.backbone, self.task.class_names, self.template)
            self._fixed_text[key] = (text, text.to(device))
        return self._fixed_text[key][1]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """CoOp's logits; in training, with a loss that is the cross-entropy in value and, in
        gradient, each client's ProGrad update of its context."""
        logits = super().forward(params, x, client_index, ctx)
        if ctx.labels is None:
            return logits
        y = ctx.labels
        feats = self.image_features(x)
        with torch.no_grad():
            teacher = self.backbone.logit_scale * feats @ self.zero_shot_text(feats.device).T
        ce = F.cross_entropy(logits, y, reduction="none")
        kl = distillation(logits, teacher, self.cfg.temperature)
        context = params["ctx"]
        k = context.shape[0]
        count = torch.zeros(k, device=ce.device).index_add_(0, client_index, torch.ones_like(ce))
        count = count.clamp(min=1)
        ce_k = torch.zeros(k, device=ce.device).index_add(0, client_index, ce) / count
        kl_k = torch.zeros(k, device=ce.device).index_add(0, client_index, kl) / count
        g_ce = torch.autograd.grad(ce_k.sum(), context, retain_graph=True)[0]
        g_kl = torch.autograd.grad(kl_k.sum(), context)[0]
        g = project(g_ce, g_kl, self.cfg.lam)
        surrogate = (context * g).flatten(1).sum(1)  # (K,): its gradient is g
        return Output(logits, loss=ce.detach() + (surrogate - surrogate.detach())[client_index])
