"""DP-FPL: a global prompt plus a personal prompt trained through its low-rank factors, under
differential privacy.

DP-FPL (Tran, Chen, Ma, Tran, Shokri, Zhou, "Privacy-Preserving Personalized Federated Prompt
Learning for Multimodal Large Language Models", ICLR 2025, arXiv 2501.13904). Each client's
CoOp context is global + local. At every step the local prompt L is factorised by one power
iteration from a random start, v0 ~ N(0, 1) (d x r): u = GS(L v0), v = GS(L^T u)^T (GS:
Gram-Schmidt on the columns), residual = L - u v, and the context is global + u v + residual
(the residual carries no gradient). The gradient reaching u v, G, gives g_u = G v^T and
g_v = u^T G; with privacy on (epsilon > 0) each is clipped to norm C and gets Gaussian noise
N(0, std^2) (local DP), and L's gradient is the official "full gradient" of the factors:

    a = g_u / 10, b = g_v / 10;   grad L = a v + u b + u u^T a v

The global prompt's gradient is clipped to C (privacy on) and the server averages the clients'
global gradients uniformly, adding N(0, (std / N)^2); std = sqrt(R ln(1/delta)) / epsilon *
C / B (R: the official round count, B: the largest client batch). Inference: the client's
global + local, so it is personal.

Adapted to fpbench's rounds: the official protocol trains every batch of each round (SGD
momentum 0.9) and exchanges the global gradient after every step. The suites train every
batch each round (a local epoch, the official budget) and the server averages the clients'
global prompts once per round (declared in their protocols). With `max_local_steps = 1` and
SGD without momentum a fpbench round is one official step: the server's uniform mean of the
clients' one-step global prompts is then the official averaged-gradient step. The server's noise is
drawn by the
clients instead, N(0, std^2 / N) each, whose mean has the official N(0, (std / N)^2) (declared
in `method_readings`). Randomness (v0, noise) is seeded per (run, client, round) from generators
of fpbench's own: it repeats over the steps of a round where a round has several.

Defaults from the official code (linhhtran/DP-FPL, `trainers/DP_FPL.py`, `federated_main.py`,
commit cce74b4): 16 context tokens, rank 8, clip C = 10, delta = 1e-5, epsilon 0 (no noise;
the README's runs: 0.1, 0.2, 0.4), R = 100 rounds, prompts N(0, 0.02^2); its factorisation
variants (promptfl, fedotp, fedpgp, dplora) are other methods of fpbench or not offered.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, MethodConfig, Phase, ServerState, Updates
from fpbench.methods.helpers import weighted_mean
from fpbench.methods.promptfolio import GlobalLocalPrompts
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class DPFPLConfig(MethodConfig):
    n_ctx: int = Field(16, ge=1, le=70, description="context tokens (official: 16)")
    rank: int = Field(8, ge=1, description="rank r of the local factorisation (official: 8)")
    epsilon: float = Field(0.0, ge=0, description="privacy budget; 0: no clipping, no noise")
    delta: float = Field(1e-5, gt=0, lt=1, description="privacy delta (official: 1e-5)")
    clip: float = Field(10.0, gt=0, description="gradient clipping norm C (official: 10)")
    dp_rounds: int = Field(100, ge=1, description="R in the noise scale (official: --round 100)")
    dp_batch: int = Field(32, ge=1, description="B in the sensitivity C / B: largest batch")


def gram_schmidt(m: Tensor) -> Tensor:
    """The official in-place Gram-Schmidt on the columns of m (..., n, r), as a new tensor:
    each column is normalised, then removed from the columns after it."""
    cols = list(m.unbind(-1))
    for i in range(len(cols)):
        cols[i] = cols[i] / cols[i].pow(2).sum(-1, keepdim=True).sqrt()
        for j in range(i + 1, len(cols)):
            cols[j] = cols[j] - (cols[i] * cols[j]).sum(-1, keepdim=True) * cols[i]
    return torch.stack(cols, dim=-1)


def factorize(local: Tensor, v0: Tensor) -> tuple[Tensor, Tensor]:
    """u (..., n, r), v (..., r, d) of local (..., n, d) from the random start v0 (..., d, r)."""
    u = gram_schmidt(local @ v0)
    v = gram_schmidt(local.transpose(-1, -2) @ u).transpose(-1, -2)
    return u, v


def clip_rows(g: Tensor, c: float) -> Tensor:
    """Each row g[k] scaled to norm c where its norm exceeds c."""
    norm = g.flatten(1).norm(dim=1).view(-1, *[1] * (g.dim() - 1))
    return torch.where(norm > c, g * (c / norm), g)


def full_grad(u: Tensor, v: Tensor, gu: Tensor, gv: Tensor) -> Tensor:
    """The official gradient of the local prompt from its factors' gradients."""
    a, b = gu / 10.0, gv / 10.0
    av = a @ v
    return av + u @ b + u @ (u.transpose(-1, -2) @ av)


@functools.cache
def _functions() -> tuple[type, type]:
    """The two autograd functions, built on first use (importing this module must not import
    torch)."""

    class LowRank(torch.autograd.Function):
        @staticmethod
        def forward(ctx, local, u, v, noise_u, noise_v, clip):  # noqa: ANN001, ANN205
            ctx.save_for_backward(u, v, noise_u, noise_v)
            ctx.clip = clip
            uv = u @ v
            return uv + (local - uv)

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            u, v, noise_u, noise_v = ctx.saved_tensors
            gu, gv = g @ v.transpose(-1, -2), u.transpose(-1, -2) @ g
            if ctx.clip is not None:
                gu = clip_rows(gu, ctx.clip) + noise_u
                gv = clip_rows(gv, ctx.clip) + noise_v
            return full_grad(u, v, gu, gv), None, None, None, None, None

    class ClipNoise(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, noise, clip):  # noqa: ANN001, ANN205
            ctx.save_for_backward(noise)
            ctx.clip = clip
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            (noise,) = ctx.saved_tensors
            return clip_rows(g, ctx.clip) + noise, None, None

    return LowRank, ClipNoise


def low_rank(
    local: Tensor, u: Tensor, v: Tensor, noise_u: Tensor, noise_v: Tensor, clip: float | None
) -> Tensor:
    """Forward: u v + (local - u v) (the residual carries no gradient); backward: the
    factors' gradients, clipped to `clip` and noised where `clip` is set, turned into the
    local prompt's `full_grad`."""
    return _functions()[0].apply(local, u, v, noise_u, noise_v, clip)


def clip_noise(x: Tensor, noise: Tensor, clip: float) -> Tensor:
    """Identity forward; backward clips each client's gradient to `clip` and adds `noise`."""
    return _functions()[1].apply(x, noise, clip)


@METHODS.register()
class DPFPL(GlobalLocalPrompts):
    name = "dp-fpl"
    Config = DPFPLConfig

    def init_params(self, gen: torch.Generator) -> ServerState:
        params = super().init_params(gen)
        seed = torch.randint(0, 2**62, (1,), generator=gen)
        return ServerState(
            params, buffers={"dp_seed": seed, "dp_round": torch.zeros(1, dtype=torch.long)}
        )

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """Adds `dp_key` (K, 3): the run's seed, the client and the round, which seed the
        client's draws; never trained."""
        out = super().client_params(server, client_ids, training, draw)
        k = len(client_ids)
        seed, round_ = server.buffers["dp_seed"].cpu(), server.buffers["dp_round"].cpu()
        out["dp_key"] = torch.stack([seed.expand(k), client_ids.cpu(), round_.expand(k)], dim=1)
        return out

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        return [Phase("local", ("global_ctx", "local_ctx"), local_epochs)]

    @property
    def noise_std(self) -> float:
        """sqrt(R ln(1/delta)) / epsilon * C / B: the official std of the local noise."""
        cfg = self.cfg
        if cfg.epsilon == 0:
            return 0.0
        sigma = math.sqrt(cfg.dp_rounds * math.log(1 / cfg.delta)) / cfg.epsilon
        return sigma * cfg.clip / cfg.dp_batch

    def draws(self, key: Tensor, n: int, d: int) -> dict[str, Tensor]:
        """One client's random start v0 (d, r) and noises, from its `dp_key` row."""
        seed, client, round_ = (int(v) for v in key)
        gen = torch.Generator().manual_seed(
            ((seed * 1_000_003 + client) * 1_000_003 + round_) % 2**63
        )
        r, std = self.cfg.rank, self.noise_std
        out = {"v0": torch.randn(d, r, generator=gen)}
        if std > 0:
            n_clients = self.task.num_clients
            out["u"] = torch.randn(n, r, generator=gen) * std
            out["v"] = torch.randn(r, d, generator=gen) * std
            out["global"] = torch.randn(n, d, generator=gen) * (std / math.sqrt(n_clients))
        return out

    def client_context(self, params: dict[str, Tensor], training: bool) -> Tensor:
        """global + local (K, n, d); in training through the private factorised gradients."""
        glob, local = params["global_ctx"], params["local_ctx"]
        if not training:
            return glob + local
        k, n, d = local.shape
        rows = [self.draws(key, n, d) for key in params["dp_key"]]
        stack = lambda name: torch.stack([r[name] for r in rows]).to(local.device)  # noqa: E731
        with torch.no_grad():
            u, v = factorize(local.detach(), stack("v0").to(local.dtype))
        clip = self.cfg.clip if self.noise_std > 0 else None
        zeros_u, zeros_v = torch.zeros_like(u), torch.zeros_like(v)
        noise_u = stack("u") if clip else zeros_u
        noise_v = stack("v") if clip else zeros_v
        if clip:
            glob = clip_noise(glob, stack("global"), clip)
        return glob + low_rank(local, u, v, noise_u, noise_v, clip)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        text = self.text_features(self.client_context(params, ctx.training))
        return self.logits(self.image_features(x), text, client_index)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        """Uniform mean of the global prompts (the official mean over all clients); local
        prompts back to their rows; the round counter advances."""
        k = len(updates.client_ids)
        glob = updates.params["global_ctx"]
        w = torch.full((k,), 1.0 / k, dtype=glob.dtype, device=glob.device)
        local = server.personal["local_ctx"]
        ids = updates.client_ids.to(local.device)
        personal = {"local_ctx": local.index_copy(0, ids, updates.params["local_ctx"].detach())}
        buffers = {**server.buffers, "dp_round": server.buffers["dp_round"] + 1}
        return ServerState({"global_ctx": weighted_mean(glob, w)}, personal, buffers)
