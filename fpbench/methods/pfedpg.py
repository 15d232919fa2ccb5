"""pFedPG: a server-side prompt generator produces each client's prompts from its descriptor.

pFedPG (Yang, Wang, Wang, "Efficient Model Personalization in Federated Learning via
Client-Specific Prompt Generation", ICCV 2023), on a frozen ViT with VPT-shallow prompts as in
the paper. Server: a client-agnostic prompt basis P_base (p, d), a learnable descriptor per
client d_n (p, d) and a generator G, one multi-head cross-attention with the descriptor tokens
as queries and linear maps of the basis as keys and values, whose projected output is added to
the basis: P_n = P_base + Attn(d_n, P_base) (one query token per prompt token; with p = 1 this
is exactly the one-token form). Client ("personalised prompt adaptation"): starts from P_n,
trains the prompts and its own linear head H_n (never sent) with cross-entropy, returns
delta = P~_n - P_n. Server ("personalised prompt generation"): treats -delta as the gradient
at P_n, i.e. descends 1/2 ||P_n(phi) - P~_n||^2 in phi = (P_base, descriptors, G), averaged over
the round's participants (`server_reduce = "mean"`: with server lr 1 the basis moves by the
mean delta, a FedAvg step; pFedPG's paper does not say; "sum" is pFedHN's per-client step).
The sign is the descent one: the unofficial re-implementation's +delta and its unused
generated prompt (notes, sec. 9.2) are not reproduced. Evaluation: each client's last adapted
prompts and its head (kept locally); a client never sampled has only its initial generated
prompts and a random head, so by default (`train.unseen_clients`) it is left out of the local
metrics and counted in `clients_untrained`.

Defaults (fpbench's; the paper's generator and server-optimiser settings are not in the sources
we could read): prompt length 5, the backbone's number of attention heads (12 on ViT-B/16, as
the unofficial code), server plain SGD with lr 1.0 (the basis then moves by the participants'
mean prompt delta, as a FedAvg step would), no momentum, no weight decay.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.errors import FpbenchError
from fpbench.lazy import torch
from fpbench.methods.base import ServerState, Updates
from fpbench.methods.helpers import init_linear, init_prompts
from fpbench.methods.pfedhn import HypernetConfig, HypernetworkMethod
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class PFedPGConfig(HypernetConfig):
    server_lr: float = Field(1.0, gt=0, description="learning rate of the prompt generator")
    server_momentum: float = Field(0.0, ge=0, lt=1, description="server SGD momentum")
    server_reduce: Literal["sum", "mean"] = Field(
        "mean", description="combine the participants' generator gradients: mean (a FedAvg step)"
    )
    server_weight_decay: float = Field(0.0, ge=0, description="server SGD weight decay")
    generator_heads: int | None = Field(
        None, ge=1, description="attention heads of the generator; None: the backbone's"
    )


@METHODS.register()
class PFedPG(HypernetworkMethod):
    name = "pfedpg"
    Config = PFedPGConfig
    personal = frozenset({"head_w", "head_b", "local_prompts"})
    generated = ("prompts",)

    def _heads(self) -> int:
        d = self.backbone.embed_dim
        h = self.cfg.generator_heads or self.backbone.vit.blocks[0].attn.num_heads
        if d % h:
            raise FpbenchError(f"pfedpg: generator_heads={h} must divide the embed dim {d}")
        return h

    def init_generator(self, gen: torch.Generator) -> dict[str, Tensor]:
        d, p, n = self.backbone.embed_dim, self.cfg.prompt_len, self.task.num_clients
        patch = self.backbone.patch_size
        phi = {
            "basis": init_prompts(gen, p, d, patch),  # (p, d)
            "descriptors": torch.stack([init_prompts(gen, p, d, patch) for _ in range(n)]),
        }
        for proj in ("q", "k", "v", "o"):
            phi[f"w_{proj}"], phi[f"b_{proj}"] = init_linear(gen, d, d)
        return phi

    def init_params(self, gen: torch.Generator) -> ServerState:
        server = super().init_params(gen)
        n = self.task.num_clients
        w, b = init_linear(gen, self.task.num_classes, self.backbone.embed_dim)
        with torch.no_grad():
            start = self.generate(server.params, torch.arange(n))["prompts"]  # (N, p, d)
        server.personal = {
            "head_w": w.expand(n, *w.shape).clone(),
            "head_b": b.expand(n, *b.shape).clone(),
            "local_prompts": start,
        }
        return server

    def generate(self, phi: dict[str, Tensor], client_ids: Tensor) -> dict[str, Tensor]:
        basis = phi["basis"]  # (p, d)
        desc = phi["descriptors"][client_ids.to(basis.device)]  # (K, p, d)
        k_, p, d = desc.shape
        h = self._heads()
        q = (desc @ phi["w_q"].T + phi["b_q"]).view(k_, p, h, d // h).transpose(1, 2)
        k = (basis @ phi["w_k"].T + phi["b_k"]).view(p, h, d // h).transpose(0, 1)  # (h, p, dh)
        v = (basis @ phi["w_v"].T + phi["b_v"]).view(p, h, d // h).transpose(0, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1)  # (K, h, p, p)
        mixed = (att @ v).transpose(1, 2).reshape(k_, p, d)  # (K, p, d)
        return {"prompts": basis + mixed @ phi["w_o"].T + phi["b_o"]}

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Training starts from generated prompts; evaluation uses each client's own trained
        prompts and heads."""
        if not training:
            names = {"prompts": "local_prompts", "head_w": "head_w", "head_b": "head_b"}
            return {k: server.personal[v][client_ids].clone() for k, v in names.items()}
        with torch.no_grad():
            prompts = self.generate(server.params, client_ids)["prompts"]
        heads = {n: server.personal[n][client_ids].clone() for n in ("head_w", "head_b")}
        return {"prompts": prompts, **heads}

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained, client_ids = updates.params, updates.client_ids
        new = super().aggregate(server, updates)
        local = server.personal["local_prompts"]
        new.personal["local_prompts"] = local.index_copy(0, client_ids, trained["prompts"].detach())
        return new
