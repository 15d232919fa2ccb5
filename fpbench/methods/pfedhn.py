"""pFedHN: a server hypernetwork maps each client's embedding to that client's prompts and head.

pFedHN (Shamsian, Navon, Fetaya, Chechik, "Personalized Federated Learning using Hypernetworks",
ICML 2021), adapted to prompt tuning on a frozen ViT as the "pFedHN" baseline of FGPT: the
personal model the hypernetwork generates is the trainable part only, VPT-shallow prompts and a
linear head; the backbone stays frozen and shared. Server: a learnable embedding per client and
an MLP (ReLU) whose output layers emit the client's prompts (p, d), head weight (C, d) and bias
(C,). Client: starts from the generated tensors, trains them for the local epochs with
cross-entropy, returns the update direction delta = trained - generated. Server: one step on the
hypernetwork with the gradient -(d generated / d phi)^T delta, i.e. the gradient of
1/2 ||generated(phi) - trained||^2 (the paper's update rule), summed over the round's
participants (`server_reduce = "sum"`): the paper takes one step per sampled client, so each
client's delta moves phi with the full server lr, as K steps from the same point would; "mean"
divides that step by K. SGD with momentum and weight decay, whose state lives in the server
buffers. Nothing stays on the clients: evaluation uses the generated
tensors; a held-out client (untrained embedding) is not applicable, and a participating client
not yet sampled is left out of the local metrics by default (`train.unseen_clients`).

Defaults from the original paper and its code: hidden width 100, 3 hidden layers, embedding size
1 + N / 4, server SGD lr 1e-2, momentum 0.9, weight decay 1e-3. The local optimiser, its
learning rate and epochs are the benchmark's `train` settings. Prompt length 5 is fpbench's
VPT-shallow default (FGPT does not state it for this baseline).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Method, MethodConfig, ServerState, Updates
from fpbench.methods.helpers import init_linear, per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class HypernetConfig(MethodConfig):
    """Server-optimiser settings shared by the hypernetwork-style methods."""

    prompt_len: int = Field(5, ge=1, description="VPT-shallow prompt tokens")
    server_lr: float = Field(1e-2, gt=0, description="learning rate of the server's generator")
    server_momentum: float = Field(0.9, ge=0, lt=1, description="server SGD momentum")
    server_weight_decay: float = Field(1e-3, ge=0, description="server SGD weight decay (L2)")
    server_reduce: Literal["sum", "mean"] = Field(
        "sum",
        description="combine the participants' generator gradients: sum (one full step per "
        "client, pFedHN's per-client step) or mean (one step of their average)",
    )


class HypernetworkMethod(Method):
    """A server-side generator of the clients' trainable tensors, trained from their deltas.

    Subclasses define `init_generator`, `generate` (stacked (K, ...) tensors named `generated`)
    and may keep per-client tensors in `server.personal`.
    """

    Config = HypernetConfig
    inference = "personal"
    generated: ClassVar[tuple[str, ...]] = ("prompts", "head_w", "head_b")

    def init_generator(self, gen: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

    def generate(self, phi: dict[str, Tensor], client_ids: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The generator's weights phi, each with a zero momentum buffer."""
        phi = self.init_generator(gen)
        momentum = {f"momentum.{k}": torch.zeros_like(v) for k, v in phi.items()}
        return ServerState(phi, {}, momentum)

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        with torch.no_grad():
            out = self.generate(server.params, client_ids)
        out.update({name: t[client_ids].clone() for name, t in server.personal.items()})
        return out

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        prompts = params["prompts"][client_index]  # (B, p, d)
        feats = self.backbone.forward_features(x, {0: prompts}, style="shallow").cls  # (B, d)
        return per_client_linear(feats, params["head_w"], params["head_b"], client_index)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained, client_ids = updates.params, updates.client_ids
        grads = self.generator_grads(server.params, trained, client_ids)
        phi, buffers = self.server_step(server.params, grads, server.buffers)
        personal = {
            name: t.index_copy(0, client_ids, trained[name].detach())
            for name, t in server.personal.items()
            if name in trained
        }
        return ServerState(phi, {**server.personal, **personal}, buffers)

    def generator_grads(
        self, phi: dict[str, Tensor], trained: dict[str, Tensor], client_ids: Tensor
    ) -> dict[str, Tensor]:
        """Gradient of sum_k (or mean_k) 1/2 ||generated_k(phi) - trained_k||^2 w.r.t. phi."""
        leaves = {k: v.detach().requires_grad_() for k, v in phi.items()}
        with torch.enable_grad():
            out = self.generate(leaves, client_ids)
            # d/dphi of <generated, -delta> = (d generated / d phi)^T (generated - trained)
            surrogate = sum(
                (out[n] * (out[n].detach() - trained[n].detach())).sum() for n in self.generated
            )
            if self.cfg.server_reduce == "mean":
                surrogate = surrogate / len(client_ids)
            grads = torch.autograd.grad(surrogate, list(leaves.values()), allow_unused=True)
        pairs = zip(phi.items(), grads, strict=True)
        return {k: torch.zeros_like(v) if g is None else g for (k, v), g in pairs}

    def server_step(
        self, phi: dict[str, Tensor], grads: dict[str, Tensor], buffers: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """torch.optim.SGD's rule (momentum, L2 weight decay); a zero buffer makes step 1 exact."""
        cfg, new_phi, new_buf = self.cfg, {}, dict(buffers)
        for k, p in phi.items():
            g = grads[k] + cfg.server_weight_decay * p
            m = cfg.server_momentum * buffers[f"momentum.{k}"] + g
            new_buf[f"momentum.{k}"] = m
            new_phi[k] = p - cfg.server_lr * m
        return new_phi, new_buf

    def communication(self, server: ServerState) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Down: the client's generated tensors; up: their deltas (same shapes)."""
        with torch.no_grad():
            one = self.generate(server.params, torch.zeros(1, dtype=torch.long))
        rows = {n: one[n][0] for n in self.generated}
        return rows, dict(rows)


class PFedHNConfig(HypernetConfig):
    embed_dim: int | None = Field(
        None, ge=1, description="client embedding size; None: 1 + N // 4 (the original rule)"
    )
    hidden_dim: int = Field(100, ge=1, description="hypernetwork hidden width")
    hidden_layers: int = Field(3, ge=0, description="hidden ReLU + Linear blocks after the first")


@METHODS.register()
class PFedHN(HypernetworkMethod):
    name = "pfedhn"
    Config = PFedHNConfig

    def _out_shapes(self) -> dict[str, tuple[int, ...]]:
        d, c = self.backbone.embed_dim, self.task.num_classes
        return {"prompts": (self.cfg.prompt_len, d), "head_w": (c, d), "head_b": (c,)}

    def init_generator(self, gen: torch.Generator) -> dict[str, Tensor]:
        e = self.cfg.embed_dim or 1 + self.task.num_clients // 4
        h = self.cfg.hidden_dim
        phi = {"embeddings": torch.randn(self.task.num_clients, e, generator=gen)}
        for i in range(self.cfg.hidden_layers + 1):
            phi[f"mlp_w{i}"], phi[f"mlp_b{i}"] = init_linear(gen, h, e if i == 0 else h)
        for name, shape in self._out_shapes().items():
            phi[f"out_w.{name}"], phi[f"out_b.{name}"] = init_linear(gen, math.prod(shape), h)
        return phi

    def generate(self, phi: dict[str, Tensor], client_ids: Tensor) -> dict[str, Tensor]:
        ids = client_ids.to(phi["embeddings"].device)
        h = phi["embeddings"][ids]  # (K, e)
        for i in range(self.cfg.hidden_layers + 1):
            h = h if i == 0 else F.relu(h)
            h = h @ phi[f"mlp_w{i}"].T + phi[f"mlp_b{i}"]  # (K, hidden)
        return {
            name: (h @ phi[f"out_w.{name}"].T + phi[f"out_b.{name}"]).view(len(ids), *shape)
            for name, shape in self._out_shapes().items()
        }
