"""FedPHA: a global and a local prompt, the local one pulled towards its part outside the global
prompt's main directions and pushed away from the global prompt's features.

FedPHA (Fang, Huang, Wan, Yang, Ye, "FedPHA: Federated Prompt Learning for Heterogeneous Client
Adaptation", ICML 2025, PMLR 267:15960-15975). Each client holds a global CoOp context G
(averaged by the server, weighted by train size) and a local one L (kept on the client). It
scores with L alone; training adds the global prompt's cross-entropy and two alignment terms on
the normalised class text features t(.):

    G = U S V^T (SVD, V: d x m, m = min(M, d)),   V2 = V[:, floor(m (1 - ratio)):]
    P = L V2 V2^T                                  (L projected off G's top directions)
    loss = CE(t(L)) + CE(t(G)) + mean_{c,e} (t(L) - t(P))^2
           + mean_c relu(alpha - ||t(L)_c - t(G)_c||)

Gradients flow through the SVD into G. Inference is personal (the client's L); a client that
never trained is not scored (its L is the initial one, never trained). This is the method's own
federation; nothing was adapted.

Defaults from the official code (CYFang6/FedPHA, `trainers/GL_SVDMSE.py` and
`federated_main.py`, commit 1ab33df): 16 context tokens (`--n_ctx`), both prompts N(0, 0.02^2),
one prompt set (`N = 1`), class token at the end, ratio 0.8 (`--ratio`), alpha 1.0 (`--alpha`),
the pull and push weights 1 (hard-coded). Its variant with local prompts of different lengths
per client (`GL_SVDMSE_HE`) is not offered: fpbench stacks the clients' tensors, so every local
prompt has one length. The official middle / front class-token branches build only the local
prompt set (and fail); fpbench applies the position to all three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import F, torch
from fpbench.methods.base import Context, MethodConfig, Output
from fpbench.methods.promptfolio import GlobalLocalPrompts
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from torch import Tensor


class FedPHAConfig(MethodConfig):
    n_ctx: int = Field(16, ge=1, le=70, description="context tokens per prompt (official: 16)")
    class_token_position: Literal["end", "middle", "front"] = "end"
    ratio: float = Field(
        0.8, ge=0, le=1, description="share of G's directions kept for the projection (0.8)"
    )
    alpha: float = Field(1.0, ge=0, description="margin of the push term (official: 1.0)")
    pull: float = Field(1.0, ge=0, description="weight of the pull term (official: 1)")
    push: float = Field(1.0, ge=0, description="weight of the push term (official: 1)")


def minor_projection(local: Tensor, global_: Tensor, ratio: float) -> Tensor:
    """local (..., M, d) times V2 V2^T, V2 the right singular vectors of global_ (..., M, d)
    after its top floor(m (1 - ratio)) ones (m = min(M, d)); differentiable in both."""
    _, _, vh = torch.linalg.svd(global_.float(), full_matrices=False)  # (..., m, d)
    v2 = vh[..., int(vh.shape[-2] * (1 - ratio)) :, :]
    return local @ v2.transpose(-1, -2) @ v2


def pull_push(local: Tensor, global_: Tensor, projected: Tensor, alpha: float) -> tuple:
    """Per row (K,): mean squared gap of local to projected features, and the mean hinge
    relu(alpha - ||local - global||) over classes; all (K, C, E)."""
    pull = (local - projected).pow(2).mean((-1, -2))
    push = F.relu(alpha - (local - global_).norm(dim=-1)).mean(-1)
    return pull, push


@METHODS.register()
class FedPHA(GlobalLocalPrompts):
    name = "fedpha"
    Config = FedPHAConfig

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor | Output:
        """The local prompt's logits; in training, the global prompt's cross-entropy and the
        pull and push terms as the auxiliary loss (needs `ctx.labels`)."""
        cfg, feats = self.cfg, self.image_features(x)
        local, glob = params["local_ctx"], params["global_ctx"]
        text = self.text_features(local)  # (K, C, E)
        logits = self.logits(feats, text, client_index)
        if not ctx.training:
            return logits
        if ctx.labels is None:
            raise ValueError("fedpha's training forward needs the batch's labels (ctx.labels)")
        text_global = self.text_features(glob)
        ce_global = F.cross_entropy(
            self.logits(feats, text_global, client_index), ctx.labels, reduction="none"
        )
        projected = self.text_features(minor_projection(local, glob, cfg.ratio).to(local.dtype))
        pull, push = pull_push(text, text_global, projected, cfg.alpha)
        return Output(logits, ce_global + (cfg.pull * pull + cfg.push * push)[client_index])
