"""SDFed: a shared fixed-length global prompt, private variable-length local prompts.

SDFed (Di, Yuan, He, Zhang, Ma, Liu, Yin, "SDFed: Bridging Local-Global Discrepancy via Subspace
Refinement and Divergence Control in Federated Prompt Learning", arXiv 2602.08590, 2026;
eqs. 4-14, Algorithm 1). Each client holds the global prompt G_s (S_s = 8 tokens) and its own
local prompt G_c (S_l in 4..64 tokens), both CoOp contexts on a frozen CLIP. At every local
step (Algorithm 1, line 14) it takes the SVD G_s = H Z X^T with the full right basis X (m x m),
keeps X_2 = the right singular vectors beyond the top floor(lambda m) and projects the local
prompt, G~_c = G_c X_2 X_2^T (eq. 10; the projector carries no gradient; sec. 4.2.5 says once per
round, Algorithm 1 every step: fpbench follows the algorithm). The loss (eq. 14) is

    CE(G_c) + CE(G_s) + ||d(G_c) - d(G~_c)||^2 + ReLU(gamma - ||d(G_c) - d(G_s)||)

with d(.) the prompt's normalised class text features; the two feature terms are averaged over
the classes. The stretch term treats the projection as a fixed target (App. C.4, eq. 25:
"treating G~ as fixed in this term"): d(G~_c) carries no gradient, so the term pulls G_c
towards its projection and not the projection towards G_c (`stretch_target = "through"` lets
the gradient flow through both, fpbench's reading before the fix). Server: sample-size
weighted FedAvg of G_s only (eq. 5); G_c never leaves the client. Inference uses the local
prompt only, so it is personal.

Global and local prompts are encoded as separate sequences, so a 64-token local prompt fits
CLIP's 77-token budget whatever the global length (the budget is checked per prompt). Since
G_s has rank <= S_s, the directions past its rank have zero singular value and their order is
LAPACK's: with the paper's floor(lambda m) > S_s the projector also drops an arbitrary (but
deterministic) part of G_s's null space, as specified.

Ablations (Table 6): `pfhf = False` trains the global prompt alone (no local prompt);
`srlp = False` sets the projector to the identity (the stretch term vanishes); with `srlp` on
and `irdc` off the local prompt is used through its projection G~_c (CE and inference) and the
stretch and separation terms are dropped. Table 7 / Figs. 5-6: fixed local lengths
(`local_len`), random ones per client (`local_len_range`), or an explicit list
(`local_lengths`, cycled over the clients). Defaults from the paper: lambda = 0.6,
gamma = 0.8, S_s = 8, S_l = 8, SGD lr 0.01, batch 16, 1 local epoch (set in the suite).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, Output, Phase, ServerState
from fpbench.methods.coop import CoOpModel
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class SDFedConfig(MethodConfig):
    global_len: int = Field(8, ge=1, le=70, description="global prompt length S_s")
    local_len: int = Field(8, ge=1, le=70, description="local prompt length S_l of every client")
    local_len_range: tuple[int, int] | None = Field(
        None, description="draw each client's S_l uniformly from [lo, hi] (paper: [4, 64])"
    )
    local_lengths: list[int] | None = Field(None, description="explicit S_l per client (cycled)")
    lam: float = Field(0.6, gt=0, lt=1, description="lambda: drop the top floor(lambda m) dirs")
    gamma: float = Field(0.8, ge=0, description="separation margin")
    pfhf: bool = Field(True, description="local prompts (off: global prompt only)")
    srlp: bool = Field(True, description="subspace refinement of the local prompt")
    irdc: bool = Field(True, description="stretch and separation losses")
    stretch_target: Literal["fixed", "through"] = Field(
        "fixed", description="d(G~_c) in the stretch term: fixed target (eq. 25) or differentiated"
    )
    class_token_position: Literal["end", "middle", "front"] = "end"


def projector(global_prompt: Tensor, lam: float) -> Tensor:
    """R = X_2 X_2^T (m, m): X_2 = right singular vectors of G_s (S, m) past floor(lam m)."""
    m = global_prompt.shape[-1]
    _, _, vh = torch.linalg.svd(global_prompt.detach().float(), full_matrices=True)  # (m, m)
    x2 = vh[math.floor(lam * m) :].T  # (m, m')
    return x2 @ x2.T


def stretch_loss(local: Tensor, refined: Tensor) -> Tensor:
    """||d(G_c) - d(G~_c)||^2 per class, averaged over classes: (..., C, E) -> (...)."""
    return (local - refined).pow(2).sum(-1).mean(-1)


def separation_loss(local: Tensor, global_: Tensor, gamma: float) -> Tensor:
    """ReLU(gamma - ||d(G_c) - d(G_s)||) per class, averaged over classes."""
    return F.relu(gamma - (local - global_).norm(dim=-1)).mean(-1)


@METHODS.register()
class SDFed(CoOpModel):
    name = "sdfed"
    Config = SDFedConfig
    inference = "personal"
    personal = frozenset({"local_prompt", "local_len"})

    def lengths(self, gen: torch.Generator) -> Tensor:
        """Each client's local prompt length S_l, (N,)."""
        n, cfg = self.task.num_clients, self.cfg
        if cfg.local_lengths:
            return torch.tensor([cfg.local_lengths[i % len(cfg.local_lengths)] for i in range(n)])
        if cfg.local_len_range:
            lo, hi = cfg.local_len_range
            return torch.randint(lo, hi + 1, (n,), generator=gen)
        return torch.full((n,), cfg.local_len)

    def init_params(self, gen: torch.Generator) -> ServerState:
        """The global prompt, and each client's own local prompt, padded to the longest."""
        d = self.backbone.ctx_dim
        params = {"global_prompt": torch.randn(self.cfg.global_len, d, generator=gen) * 0.02}
        lens = self.lengths(gen)  # (N,)
        longest = int(lens.max())
        for n in lens.unique().tolist():
            self.layout(int(n))  # fail early on the token budget
        local = torch.randn(len(lens), longest, d, generator=gen) * 0.02
        return ServerState(params, {"local_prompt": local, "local_len": lens})

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        trainable = ("global_prompt", "local_prompt") if self.cfg.pfhf else ("global_prompt",)
        return [Phase("local", trainable, local_epochs)]

    # -- text features ----------------------------------------------------------------------
    def local_features(self, params: dict[str, Tensor], refine: bool) -> Tensor:
        """Text features (K, C, E) of each row's local prompt, optionally projected."""
        rows = []
        for k, n in enumerate(params["local_len"].tolist()):
            prompt = params["local_prompt"][k, :n]  # (S_l, d)
            if refine:
                prompt = prompt @ projector(params["global_prompt"][k], self.cfg.lam)
            rows.append(self.text_features(prompt.unsqueeze(0))[0])  # (C, E)
        return torch.stack(rows)

    def inference_features(self, params: dict[str, Tensor]) -> Tensor:
        cfg = self.cfg
        if not cfg.pfhf:
            return self.text_features(params["global_prompt"])
        return self.local_features(params, refine=cfg.srlp and not cfg.irdc)

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """The inference prompt's logits; in training with local prompts, with the loss: the
        global and local prompts' cross-entropies plus the stretch and separation terms."""
        if ctx.labels is None:
            text = self.inference_features(params)  # (K, C, E)
            return self.logits(self.image_features(x), text, client_index)
        y = ctx.labels
        feats = self.image_features(x)  # (B, E)
        text_g = self.text_features(params["global_prompt"])  # (K, C, E)
        logits_g = self.logits(feats, text_g, client_index)
        if not self.cfg.pfhf:
            return logits_g  # the global prompt is the inference prompt: its cross-entropy
        loss = F.cross_entropy(logits_g, y, reduction="none")
        text_l = self.inference_features(params)  # (K, C, E)
        logits = self.logits(feats, text_l, client_index)
        loss = loss + F.cross_entropy(logits, y, reduction="none")
        if self.cfg.irdc:
            reg = separation_loss(text_l, text_g, self.cfg.gamma)  # (K,)
            if self.cfg.srlp:
                target = self.local_features(params, refine=True)
                if self.cfg.stretch_target == "fixed":
                    target = target.detach()
                reg = reg + stretch_loss(text_l, target)
            loss = loss + reg[client_index]
        return Output(logits, loss=loss)
