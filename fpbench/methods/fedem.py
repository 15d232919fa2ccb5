"""FedEM: M prompt/head learners, per-client mixture weights by EM, prediction mixes them.

FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021), adapted to prompt tuning on a frozen ViT as in SGPT's baseline:
each of the M learners is a set of VPT-shallow prompts and a linear head on the shared frozen
backbone (all M run in one batched pass). Each client keeps mixture weights pi (M,), never sent.
Client: E-step, responsibilities q_m(i) = softmax_m(log pi_m - loss_m(x_i, y_i)); each learner
trains on the q-weighted cross-entropy sum_m q_m(i) loss_m(i); M-step, pi_m = mean_i q_m(i).
Adaptation to the lockstep engine (no pass over the data before training): the E-step runs on
the fly on each minibatch with the learners as they train and the round's starting pi, and the
responsibilities are summed over the round (the forward's statistics) so the M-step in `aggregate`
sets pi to the mean responsibility of every sample visit; FedEM computes q once per round, before
local training. Server: each learner is averaged by client train size over the round's participants
(FedEM's aggregator averages over all clients with the non-sampled ones' stale copies, a damped
FedAvg; both agree at full participation). Prediction: log sum_m pi_m softmax(f_m(x)).

Defaults: M = 3, the paper's; prompt length 5, fpbench's VPT-shallow default; the local
optimiser and schedule are the benchmark's `train` settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, Method, Output, Phase, ServerState, Updates
from fpbench.methods.fedvpt import VPTConfig
from fpbench.methods.helpers import init_linear, init_prompts, per_client_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

LEARNERS = ("prompts", "head_w", "head_b")


class FedEMConfig(VPTConfig):
    learners: int = Field(3, ge=1, description="number of mixture components M")


def responsibilities(log_pi: Tensor, losses: Tensor) -> Tensor:
    """E-step: q (B, M) = softmax_m(log pi_m - loss_m) for log_pi (B, M), losses (B, M)."""
    return torch.softmax(log_pi - losses, dim=-1)


@METHODS.register()
class FedEM(Method):
    name = "fedem"
    Config = FedEMConfig
    inference = "personal"
    personal = frozenset({"pi"})

    def init_params(self, gen: torch.Generator) -> dict[str, Tensor]:
        d, m, p = self.backbone.embed_dim, self.cfg.learners, self.cfg.prompt_len
        prompts = torch.stack([init_prompts(gen, p, d, self.backbone.patch_size) for _ in range(m)])
        heads = [init_linear(gen, self.task.num_classes, d) for _ in range(m)]
        return {
            "prompts": prompts,  # (M, p, d)
            "head_w": torch.stack([w for w, _ in heads]),  # (M, C, d)
            "head_b": torch.stack([b for _, b in heads]),  # (M, C)
            "pi": torch.full((m,), 1.0 / m),
        }

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", tuple(n for n in names if n in LEARNERS), local_epochs)]

    def learner_logits(self, params: dict[str, Tensor], x: Tensor, client_index: Tensor) -> Tensor:
        """Logits (B, M, C) of every learner, all M in one backbone pass."""
        prompts = params["prompts"][client_index]  # (B, M, p, d)
        b, m = prompts.shape[:2]
        xs = x.unsqueeze(1).expand(b, m, *x.shape[1:]).reshape(b * m, *x.shape[1:])
        feats = self.backbone.forward_features(xs, {0: prompts.flatten(0, 1)}, style="shallow")
        feats = feats.cls.view(b, m, -1)  # (B, M, d)
        w, bias = params["head_w"], params["head_b"]  # (K, M, C, d), (K, M, C)
        return torch.stack(
            [per_client_linear(feats[:, j], w[:, j], bias[:, j], client_index) for j in range(m)],
            dim=1,
        )

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """The mixture's logits; in training, the E-step's q-weighted loss of the learners
        (no mixture logits) and the responsibilities summed per row (`q_sum`, (K, M))."""
        logits = self.learner_logits(params, x, client_index)  # (B, M, C)
        log_pi = params["pi"][client_index].clamp_min(1e-12).log()  # (B, M)
        if ctx.labels is None:
            log_probs = logits.log_softmax(-1)  # (B, M, C)
            return torch.logsumexp(log_pi.unsqueeze(-1) + log_probs, dim=1)  # (B, C)
        b, m, c = logits.shape
        losses = F.cross_entropy(
            logits.flatten(0, 1), ctx.labels.repeat_interleave(m), reduction="none"
        ).view(b, m)
        q = responsibilities(log_pi, losses.detach())  # (B, M)
        k = params["pi"].shape[0]
        q_sum = torch.zeros(k, m, device=q.device, dtype=q.dtype).index_add_(0, client_index, q)
        return Output(None, stats={"q_sum": q_sum}, loss=(q * losses).sum(-1))  # (B,), (K, M)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        client_ids, stats = updates.client_ids, updates.stats
        new = super().aggregate(server, updates)
        if "q_sum" in stats:
            q = stats["q_sum"].to(new.personal["pi"].dtype)  # (K, M)
            pi = q / q.sum(-1, keepdim=True).clamp_min(1e-12)  # M-step
            new.personal["pi"] = server.personal["pi"].index_copy(0, client_ids, pi)
        return new
