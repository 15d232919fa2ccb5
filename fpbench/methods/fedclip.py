"""FedCLIP: an attention adapter on CLIP's frozen image features, averaged by the server.

FedCLIP (Lu, Hu, Wang, Xie, "FedCLIP: Fast Generalization and Personalization for CLIP in
Federated Learning", IEEE Data Engineering Bulletin 2023, arXiv 2302.13485). CLIP stays frozen;
each client trains one small adapter on the image feature f (E-dimensional):

    a = softmax(W2 tanh(W1 f + b1) + b2)      (softmax over the E feature dimensions)
    f' = a * f                                 (elementwise "attention" on the feature)

and classifies by exp(logit_scale) * cos(f', t_c) against the frozen text features t_c of the
hand-written prompts "a picture of a {class}". The server averages the adapter; every client
then uses the same one, so inference is global. Nothing else is adapted to FL: this is the
method's own federation.

Defaults from the official code (microsoft/PersonalizedFL, `fedclip/`, commit 441670e):
the template "a picture of a {}" (no period); PyTorch's default Linear init; training on
CLIP's symmetric contrastive loss over the batch, whose i-th text is the prompt of sample i's
class (targets the diagonal, so two samples of one class in a batch are each other's
negatives); the server's mean is uniform over the clients that trained (`aggregation =
"size"` weights by train size). In lockstep the contrastive batch of a sample is its own
client's part of the step, which is the client's minibatch of the reference code.
`loss = "cross-entropy"` is fpbench's C-way reading (cross-entropy over every class's text),
offered for comparison. The official optimiser is Adam lr 5e-5, betas (0.9, 0.98), eps 1e-6,
weight decay 0.2 (L2), new every round, batch 32, 1 local epoch: the suites set it
(`train.optimizer = "adam"`, `train.adam_beta2`, `train.adam_eps`; flip-compare runs the
optimiser with FLiP's batch and schedule, flip-compare-own the whole recipe).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, Output, ServerState, Updates
from fpbench.methods.coop import CoOpModel
from fpbench.methods.helpers import init_linear, per_client_linear, weighted_mean
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class FedCLIPConfig(MethodConfig):
    template: str = Field(
        "a picture of a {}", description="class prompt; {} is the class name (official code)"
    )
    loss: Literal["contrastive", "cross-entropy"] = Field(
        "contrastive",
        description="contrastive: CLIP's symmetric image-text loss over the batch (official "
        "code); cross-entropy: over all class prompts (fpbench's reading)",
    )
    aggregation: Literal["uniform", "size"] = Field(
        "uniform", description="server mean: uniform over trained clients (official) or by size"
    )


def adapter_attention(feats: Tensor, params: dict[str, Tensor], client_index: Tensor) -> Tensor:
    """softmax(W2 tanh(W1 f + b1) + b2) over the feature dim: feats (B, E) -> (B, E), each
    sample with its client's adapter (params (K, ...))."""
    h = torch.tanh(per_client_linear(feats, params["w1"], params["b1"], client_index))
    return torch.softmax(per_client_linear(h, params["w2"], params["b2"], client_index), dim=-1)


@METHODS.register()
class FedCLIP(CoOpModel):
    name = "fedclip"
    Config = FedCLIPConfig

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        e = self.backbone.embed_dim
        w1, b1 = init_linear(gen, e, e)
        w2, b2 = init_linear(gen, e, e)
        return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}

    def class_text(self) -> Tensor:
        """Normalised frozen text features (C, E) of the template filled with each class."""
        held = self._fixed_text.get("template")
        if held is None:
            names = [n.replace("_", " ") for n in self.task.class_names]
            with torch.no_grad():
                ids = self.backbone.tokenize([self.cfg.template.format(n) for n in names])
                text = F.normalize(self.backbone.encode_text(ids).float(), dim=-1)
            held = self._fixed_text["template"] = (ids, text)
        return held[1]

    def adapted(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Normalised adapted image features a * f (B, E) of preprocessed images x, where f is
        CLIP's frozen image feature (recalled, not recomputed, by the backbone)."""
        f = self.backbone.encode_image(x).float()
        return F.normalize(adapter_attention(f, params, client_index) * f, dim=-1)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """Logits; in training with the contrastive loss, that loss alone (no logits)."""
        if self.cfg.loss == "contrastive" and ctx.labels is not None:
            loss = contrastive_loss(
                self.adapted(params, x, client_index),
                self.class_text().to(x.device)[ctx.labels],
                client_index,
                self.backbone.logit_scale,
            )
            return Output(None, loss=loss)
        text = self.class_text().to(x.device)  # (C, E)
        return self.backbone.logit_scale * self.adapted(params, x, client_index) @ text.T

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        if self.cfg.aggregation == "size":
            return super().aggregate(server, updates)
        k = len(updates.client_ids)
        w = torch.full((k,), 1.0 / k, dtype=updates.params["w1"].dtype)
        params = {n: weighted_mean(updates.params[n], w.to(updates.params[n].device))
                  for n in server.params}  # fmt: skip
        return ServerState(params, server.personal, server.buffers)


def contrastive_loss(img: Tensor, txt: Tensor, client_index: Tensor, scale: float) -> Tensor:
    """CLIP's symmetric loss per sample (B,): (CE_image_i + CE_text_i) / 2 with targets on the
    diagonal, over the samples of the same client only; img, txt (B, E) normalised, txt[i] the
    text of sample i. A client's mean of it is the reference code's batch loss."""
    logits = scale * img @ txt.T  # (B, B) image i against text j
    same = client_index.unsqueeze(0) == client_index.unsqueeze(1)
    logits = logits.masked_fill(~same, float("-inf"))
    target = torch.arange(len(img), device=img.device)
    per_image = F.cross_entropy(logits, target, reduction="none")
    per_text = F.cross_entropy(logits.T, target, reduction="none")
    return (per_image + per_text) / 2
