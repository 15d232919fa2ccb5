"""ATPFL: TPFL plus InfoNCE terms pulling each prompt towards the global one.

ATPFL (Zhao, Shi, Liu, Ding, "Inclusive Data Representation in Federated Learning: A Novel
Approach Integrating Textual and Visual Prompt", UbiComp/ISWC 2023 Adjunct, sec. 3.3, eqs. 4-7,
Algorithm 1). On top of TPFL's twin prompts, each client adds for the text and for the visual
prompt a contrastive term

    l_con(z) = -log( e^{sim(z, z_g)/T} / (e^{sim(z, z_g)/T} + e^{sim(z, z_p)/T}) )

where z is the embedding under the client's current prompt, z_g under the global prompt it
received this round (positive) and z_p under its own prompt of the previous round (negative);
sim is the cosine. For the text prompt z are the class text features (l_con averaged over the
classes), for the visual prompt the image features of each training image. The loss is
CE + mu * (l_con_t + l_con_v): l_con_t depends only on the text prompt and l_con_v only on the
visual prompt, so each prompt gets exactly the gradient of its own eq. (6) / (7). A client that
has not trained before has no previous prompt and skips both terms. Server: TPFL's sample-size
weighted FedAvg of both prompts (eq. 3).

Defaults: the paper trains with Adam, lr 1e-3, cosine schedule (set in the suite); it gives no
values for mu and T, so mu = 1 and T = 0.5 follow MOON (Li, He, Song, CVPR 2021), the
model-contrastive loss this one mirrors.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output, Phase, ServerState, Updates
from fpbench.methods.tpfl import TPFLConfig, TwinPromptModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

PROMPTS = ("ctx", "visual_prompt")
PREVIOUS = {"ctx": "prev_ctx", "visual_prompt": "prev_visual"}


class ATPFLConfig(TPFLConfig):
    mu: float = Field(1.0, ge=0, description="weight of the InfoNCE terms")
    temperature: float = Field(0.5, gt=0, description="InfoNCE temperature")


def info_nce(z: Tensor, positive: Tensor, negative: Tensor, temperature: float) -> Tensor:
    """-log softmax of the positive among (positive, negative) cosines / T, over the last dim."""
    pos = F.cosine_similarity(z, positive, dim=-1) / temperature
    neg = F.cosine_similarity(z, negative, dim=-1) / temperature
    return torch.logsumexp(torch.stack([pos, neg]), dim=0) - pos


@METHODS.register()
class ATPFL(TwinPromptModel):
    name = "atpfl"
    Config = ATPFLConfig
    personal = frozenset({"prev_ctx", "prev_visual", "has_prev"})

    def init_params(self, gen: torch.Generator) -> ServerState:
        params = super().init_params(gen)
        n = self.task.num_clients
        personal = {PREVIOUS[k]: torch.zeros(n, *v.shape) for k, v in params.items()}
        personal["has_prev"] = torch.zeros(n)
        return ServerState(params, personal, self._globals(params))

    @staticmethod
    def _globals(params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The global prompts as server buffers, so the local loss can read them."""
        return {f"global_{k}": v.detach().clone() for k, v in params.items()}

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", PROMPTS, local_epochs, self.visual_optimizer())]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits (B, C); in training, the weighted contrastive loss of clients that have
        trained before (B,)."""
        text = self.text_features(params["ctx"])  # (K, C, E)
        feats = self.image_features(x, params["visual_prompt"][client_index])  # (B, E)
        logits = self.logits(feats, text, client_index)
        if not ctx.training or self.cfg.mu == 0:
            return logits
        has_prev = params["has_prev"][client_index]  # (B,)
        if not bool(has_prev.any()):
            return logits
        con = self._contrast(params, x, text, feats, client_index, ctx)  # (B,)
        return Output(logits, self.cfg.mu * has_prev * con)

    def _contrast(
        self,
        params: dict[str, Tensor],
        x: Tensor,
        text: Tensor,
        feats: Tensor,
        client_index: Tensor,
        ctx: Context,
    ) -> Tensor:
        """l_con_t (per sample's client) + l_con_v (per sample), (B,)."""
        b, t = len(x), self.cfg.temperature
        text_g = self.fixed_text_features("global", ctx.buffers["global_ctx"], False)  # (1, C, E)
        text_p = self.fixed_text_features("previous", params["prev_ctx"])  # (K, C, E)
        with torch.no_grad():
            global_v = ctx.buffers["global_visual_prompt"].expand(b, -1, -1)  # (B, 3, P)
            feats_g = self.image_features(x, global_v)  # (B, E)
            feats_p = self.image_features(x, params["prev_visual"][client_index])  # (B, E)
        con_t = info_nce(text, text_g.expand_as(text), text_p, t).mean(-1)  # (K,)
        return con_t[client_index] + info_nce(feats, feats_g, feats_p, t)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """FedAvg of both prompts; each participant's trained prompts become its previous ones."""
        trained, client_ids = updates.params, updates.client_ids
        done = {PREVIOUS[k]: trained[k] for k in PROMPTS}
        done["has_prev"] = torch.ones(len(client_ids), device=client_ids.device)
        state = super().aggregate(server, replace(updates, params={**trained, **done}))
        return ServerState(state.params, state.personal, self._globals(state.params))
