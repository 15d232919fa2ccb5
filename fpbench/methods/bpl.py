"""BPL: Bayesian prompt learning, a Gaussian posterior over a shift of the CoOp context.

BPL (Derakhshani, Sanchez, Bulat, da Costa, Snoek, Tzimiropoulos, Martinez, "Bayesian Prompt
Learning for Image-Language Model Generalization", ICCV 2023, arXiv:2210.02390; official code
github.com/saic-fi/Bayesian-Prompt-Learning, `trainers/vpt.py`, read at commit 8a73fff). A CoOp
context ctx (n, d) is shifted by a bias r ~ N(mu, diag(exp(logvar))), the same r added to every
context token; L samples r_l = mu + eps_l * exp(logvar / 2) give L sets of class text features
and the prediction is the mean of their softmaxes, log p(c | x) = logsumexp_l log_softmax_l(c)
- log L. Training minimises -log p(y | x) plus kl_weight times the KL divergence of the
posterior from N(0, I), averaged over the d dimensions. Two posteriors (`vpt_type`):
`coopvpt`, mu and logvar learnt vectors (d,) (init: zeros and U(0, 1), the official
`mean_posterior` and `std_posterior`, the latter read as logvar as the code does), and
`cocoopvpt`, mu and logvar from the normalised image feature by two 3-layer ELU MLPs
(E -> E/2 -> E/2 -> d, PyTorch's Linear init). Defaults from the official scripts
(`configs/trainers/VPT/vit_b16_c4_ep10_batch1_ctxv1.yaml`, which every script of `scripts/vpt`
runs): context "a photo of a", `coopvpt`, L = 10 (its README: 10 to 40 per dataset),
kl_weight 0.001 (`CustomCLIP.forward`). FLiP's port (0-ml/flip `BPLCLIP`) runs `cocoopvpt` with
L = 4 (`vpt_type`, `n_samples`).

The official code draws eps afresh at every forward (torch.randn, its batch size is 1: one
draw per image), at test time too. fpbench's forward is deterministic (both client executors and
a resumed run must compute the same values), so the L draws eps (L, d) are a server buffer,
drawn anew each round from the run's seed and shared by every client, step and image of that
round, and by the evaluation after it (`fpbench/report/method_readings.py`).

Adapted to FL as FLiP does: every client trains ctx and the posterior's parameters on its own
data, the server averages them weighted by train size (FedAvg); inference: the global ones.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, Output, ServerState, Updates
from fpbench.methods.coop import CoOpModel
from fpbench.methods.helpers import init_linear
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor

MLP = ("w1", "b1", "w2", "b2", "w3", "b3")


class BPLConfig(MethodConfig):
    n_ctx: int = Field(4, ge=1, le=70, description="context tokens without ctx_init")
    ctx_init: str | None = Field("a photo of a", description="init phrase (official); None: random")
    vpt_type: Literal["coopvpt", "cocoopvpt"] = Field(
        "coopvpt", description="coopvpt: learnt posterior (official scripts); cocoopvpt: from x"
    )
    n_samples: int = Field(10, ge=1, description="L: Monte Carlo samples of the context shift")
    kl_weight: float = Field(0.001, ge=0, description="weight of KL(posterior || N(0, I))")


def kl_to_standard_normal(mu: Tensor, logvar: Tensor) -> Tensor:
    """KL(N(mu, exp(logvar)) || N(0, 1)) averaged over the last dimension."""
    return (0.5 * (logvar.exp() + mu.pow(2) - 1.0 - logvar)).mean(-1)


def mean_prediction(logits: Tensor) -> Tensor:
    """log of the mean softmax over the L samples: logits (L, B, C) -> (B, C)."""
    return torch.logsumexp(F.log_softmax(logits, dim=-1), dim=0) - math.log(logits.shape[0])


@METHODS.register()
class BPL(CoOpModel):
    name = "bpl"
    Config = BPLConfig

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The context and the posterior's parameters; then the noise seed (a buffer)."""
        d = self.backbone.ctx_dim
        params = {"ctx": self.init_context(gen)}
        if self.cfg.vpt_type == "coopvpt":
            params["mean_posterior"] = torch.zeros(d)
            params["std_posterior"] = torch.rand(d, generator=gen)
        else:
            e = self.backbone.embed_dim
            h = e // 2
            for head in ("mean", "logvar"):
                for i, (out_dim, in_dim) in enumerate(((h, e), (h, h), (d, h)), start=1):
                    w, b = init_linear(gen, out_dim, in_dim)
                    params[f"{head}_w{i}"], params[f"{head}_b{i}"] = w, b
        seed = torch.randint(2**31 - 1, (1,), generator=gen)  # drawn after the parameters
        return ServerState(
            params, buffers=self.noise_buffers(seed, torch.zeros(1, dtype=torch.long))
        )

    def noise_buffers(self, seed: Tensor, round_idx: Tensor) -> dict[str, Tensor]:
        """The round's draws eps (L, d) ~ N(0, 1), from the run's seed and the round index."""
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(round_idx))
        eps = torch.randn(self.cfg.n_samples, self.backbone.ctx_dim, generator=gen)
        return {"eps": eps, "eps_seed": seed, "eps_round": round_idx}

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        new = super().aggregate(server, updates)
        buf = server.buffers
        new.buffers = self.noise_buffers(buf["eps_seed"].cpu(), buf["eps_round"].cpu() + 1)
        new.buffers = {k: v.to(buf["eps"].device) for k, v in new.buffers.items()}
        return new

    def posterior(
        self, params: dict[str, Tensor], feats: Tensor, rows: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(mu, logvar), each (B, d) per sample (cocoopvpt) or (K, d) per client (coopvpt)."""
        if self.cfg.vpt_type == "coopvpt":
            return params["mean_posterior"], params["std_posterior"]
        out = []
        for head in ("mean", "logvar"):
            w = [params[f"{head}_{p}"][rows] for p in MLP]
            h = F.elu(torch.einsum("bhe,be->bh", w[0], feats) + w[1])
            h = F.elu(torch.einsum("bgh,bh->bg", w[2], h) + w[3])
            out.append(torch.einsum("bdh,bh->bd", w[4], h) + w[5])
        return out[0], out[1]

    def sample_logits(
        self, params: dict[str, Tensor], feats: Tensor, rows: Tensor, eps: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Logits (L, B, C) of the L shifted contexts, and the posterior (mu, logvar)."""
        mu, logvar = self.posterior(params, feats, rows)
        bias = mu + eps[:, None] * logvar.exp().sqrt()  # (L, B or K, d)
        ctx = params["ctx"] if self.cfg.vpt_type == "coopvpt" else params["ctx"][rows]
        shifted = ctx.unsqueeze(0) + bias.unsqueeze(2)  # (L, B or K, n, d)
        text = self.text_features(shifted.flatten(0, 1)).unflatten(0, shifted.shape[:2])
        if self.cfg.vpt_type == "coopvpt":
            text = text[:, rows]  # (L, B, C, E)
        logits = self.backbone.logit_scale * torch.einsum("be,lbce->lbc", feats, text)
        return logits, mu, logvar

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        if "eps" not in ctx.buffers:
            raise ValueError("BPL's forward needs the server's Monte Carlo draws (buffer 'eps')")
        feats = self.image_features(x)
        eps = ctx.buffers["eps"].to(feats.dtype)
        logits, mu, logvar = self.sample_logits(params, feats, client_index, eps)
        pred = mean_prediction(logits)
        if not ctx.training:
            return pred
        kl = kl_to_standard_normal(mu, logvar)  # (B,) or (K,)
        if self.cfg.vpt_type == "coopvpt":
            kl = kl[client_index]
        return Output(pred, self.cfg.kl_weight * kl)
