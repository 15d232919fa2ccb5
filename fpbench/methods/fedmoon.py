"""FedMoon: MOON's model-contrastive loss on prompt-tuned ViT representations.

MOON (Li, He, Song; "Model-Contrastive Federated Learning", CVPR 2021), on VPT-shallow prompts
and a linear head over a frozen ViT, as FGPT's FedMoon baseline.

Client: cross-entropy plus mu times the model-contrastive loss on the representation z of each
sample, the final cls token (the head's input; MOON's projection head has no counterpart here):

    l_con = -log( e^{sim(z, z_glob) / tau} / (e^{sim(z, z_glob) / tau} + e^{sim(z, z_prev) / tau}) )

with sim the cosine similarity, z_glob the representation under this round's global prompts
(positive) and z_prev under the client's prompts after its previous local training (negative);
both are fixed targets (no gradient). A client that has not trained yet uses the initial prompts
as its previous ones, as MOON initialises every previous model to the initial global model (the
term is then constant).

Server: FedAvg of prompts and head by client train size. Each client's previous prompts are kept
on the client (`prev_prompts`, personal and never trained nor sent); the global prompts used as
the positive are the ones it received.

Defaults: mu = 1 (MOON's setting for CIFAR-100 and Tiny-ImageNet; 5 for CIFAR-10), tau = 0.5.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Output, Phase, ServerState, Updates
from fpbench.methods.fedvpt import VPTConfig, VPTModel
from fpbench.methods.helpers import per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class MoonConfig(VPTConfig):
    mu: float = Field(1.0, ge=0, description="weight of the model-contrastive loss")
    temperature: float = Field(0.5, gt=0, description="temperature tau of the contrastive loss")


def model_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """MOON's per-sample loss (B,): z (B, d) towards z_glob, away from z_prev."""
    pos = F.cosine_similarity(z, z_glob, dim=-1)  # (B,)
    neg = F.cosine_similarity(z, z_prev, dim=-1)  # (B,)
    logits = torch.stack([pos, neg], dim=-1) / tau  # (B, 2)
    return -F.log_softmax(logits, dim=-1)[:, 0]


@METHODS.register()
class FedMoon(VPTModel):
    name = "fedmoon"
    Config = MoonConfig
    personal = frozenset({"prev_prompts"})

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        params = super().init_params(gen)
        return {**params, "prev_prompts": params["prompts"].clone()}

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        out = super().client_params(server, client_ids, training, draw)
        out["global_prompts"] = out["prompts"].clone()  # (K, p, d) the positive's prompts
        return out

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", ("prompts", "head_w", "head_b"), local_epochs)]

    def represent(self, prompts: Tensor, x: Tensor, client_index: Tensor) -> Tensor:
        """Final cls features (B, d) of x under each sample's row of prompts (K, p, d)."""
        return self.backbone.forward_features(x, {0: prompts[client_index]}, style="shallow").cls

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits (B, C); in training, MOON's weighted contrastive loss (B,)."""
        z = self.represent(params["prompts"], x, client_index)  # (B, d)
        logits = per_client_linear(z, params["head_w"], params["head_b"], client_index)
        if not (ctx.training and self.cfg.mu):
            return logits
        with torch.no_grad():
            z_glob = self.represent(params["global_prompts"], x, client_index)
            z_prev = self.represent(params["prev_prompts"], x, client_index)
        con = model_contrastive_loss(z, z_glob, z_prev, self.cfg.temperature)
        return Output(logits, self.cfg.mu * con)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained = updates.params
        # this round's local prompts become each client's previous prompts
        local = {**trained, "prev_prompts": trained["prompts"]}
        return super().aggregate(server, replace(updates, params=local))
