"""FedPR: federated visual prompts learned in the null space of the global prompts.

FedPR (Feng, Yan, Wang, Li, Shao, Zhu, Zhou, Xu; "Learning Federated Visual Prompt in Null Space
for MRI Reconstruction", CVPR 2023), adapted from MRI reconstruction with a Swin backbone to
classification with prompt tuning on a frozen ViT, as SGPT's FedPR baseline.

Client: VPT-deep prompts (one block of `prompt_len` tokens per layer, replaced per layer, as in
FedPR's per-block prompts) and a linear head. Each local prompt update is projected onto the
approximate null space of the global prompts, as FedPR's AdamSVD does: for each layer's global
prompt P (p, d), take its right singular vectors, drop the top floor((1 - keep_ratio) * d) of them
and keep the rest, V_keep; the projector is Pi = V_keep V_keep^T, divided by its Frobenius norm
(FedPR's code does). The optimiser's update u is applied as u Pi. Here the engine owns the
optimiser, so the client trains an unprojected accumulator Z (`prompt_update`, zero at the start
of the round) and uses the prompts P_global + Z Pi, with the gradient of Z taken straight through
the projection: Z then follows the raw optimiser steps and P_global + Z Pi is exactly the sum of
the projected steps. Round 1 has no projector (the identity), as in FedPR. With p << d (p = 1
here) the dropped directions are the whole row space plus arbitrary null-space directions, as in
FedPR's code.

Server: FedAvg (by train size) of each client's P_global + Z Pi and of the heads, then the new
projectors from the new global prompts (a server buffer; clients can compute it themselves from
the prompts they receive, so it is not counted as communication).

Adaptations: FedPR freezes its (pretrained) head; a classification head must be learned, so the
head is trained with unprojected updates and averaged. FedPR keeps each client's Adam state
across rounds; the engine starts a fresh optimiser every round. Weight decay, if any, acts on Z
(FedPR used none).

Defaults: keep_ratio 0.8 and the Frobenius normalisation from FedPR's code; one prompt token per
layer, SGPT's benchmark setting (FedPR used 20 per block). The optimiser comes from the run's
TrainConfig: FedPR uses Adam (betas 0.9/0.999, no weight decay), so set `optimizer = "adam"`
(`momentum` is Adam's beta1). FedPR's lr 0.1 moved only its (normalised, projected) prompts; one
lr of 0.1 for the learned head too diverges (smoke: train loss 2.4 -> 8). The head FedPR lacks
therefore takes its own optimiser (`head_optimizer = "sgd"`, `head_lr`, ...): the suites train it
as their other baselines train their heads (the run's SGD settings), while the prompts keep
FedPR's Adam 0.1; `head_optimizer = "run"` trains it with the run's optimiser, as the prompts.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fpbench.lazy import torch
from fpbench.methods.base import Context, Phase, ServerState, Updates
from fpbench.methods.fedvpt import DeepConfig, FedVPTDeep
from fpbench.registry import METHODS

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor


class FedPRConfig(DeepConfig):
    keep_ratio: float = Field(
        0.8, gt=0, le=1, description="fraction of singular directions kept for local updates"
    )
    normalize: bool = Field(True, description="divide the projector by its Frobenius norm")
    head_optimizer: Literal["run", "sgd", "adam"] = Field(
        "run", description="the learned head's optimiser (FedPR's head is frozen): run = train's"
    )
    head_lr: float = Field(0.01, gt=0, description="the head's lr (not with run), on the schedule")
    head_momentum: float = Field(0.9, ge=0, lt=1, description="the head's momentum / Adam beta1")
    head_weight_decay: float = Field(0.0, ge=0)


def null_space_projector(prompts: Tensor, keep_ratio: float, normalize: bool = True) -> Tensor:
    """Projectors (L, d, d) away from the top singular directions of prompts (L, p, d).

    The top floor((1 - keep_ratio) * d) right singular vectors of each layer's prompt are
    dropped; the projector is V_keep V_keep^T (over its Frobenius norm if `normalize`).
    """
    d = prompts.shape[-1]
    drop = int(d * (1.0 - keep_ratio))
    _, _, vh = torch.linalg.svd(prompts.detach().float(), full_matrices=True)  # (L, d, d)
    keep = vh[:, drop:].transpose(1, 2)  # (L, d, d - drop), singular values descending
    proj = keep @ keep.transpose(1, 2)  # (L, d, d)
    if normalize:
        proj = proj / torch.linalg.matrix_norm(proj, keepdim=True)
    return proj


def project(update: Tensor, proj: Tensor) -> Tensor:
    """Right-multiply each layer's update (K, L, p, d) by its projector (L, d, d)."""
    return torch.einsum("klpd,lde->klpe", update, proj.to(update.dtype))


def project_straight_through(update: Tensor, proj: Tensor) -> Tensor:
    """Value `project(update, proj)`; gradient passed to `update` unprojected.

    The optimiser then sees the raw gradient, and its step on `update` reaches the prompts
    projected, which is FedPR's "project the optimiser's update".
    """
    return update + (project(update, proj) - update).detach()


@METHODS.register()
class FedPR(FedVPTDeep):
    name = "fedpr"
    Config = FedPRConfig

    def init_params(self, gen: torch.Generator) -> ServerState:
        params = super().init_params(gen)
        depth, d = params["prompts"].shape[0], self.backbone.embed_dim
        eye = torch.eye(d).expand(depth, d, d).clone()  # round 1: no projection
        return ServerState(params, buffers={"projector": eye})

    def client_params(
        self,
        server: ServerState,
        client_ids: Tensor,
        training: bool = True,
        draw: Callable[[int], tuple[Tensor, Tensor, Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        out = super().client_params(server, client_ids, training, draw)
        out["prompt_update"] = torch.zeros_like(out["prompts"])  # (K, L, p, d)
        return out

    def phases(self, local_epochs: int, names: tuple[str, ...]) -> list[Phase]:
        # the global prompts stay fixed; the update Z and the head train (the head with its own
        # optimiser unless `head_optimizer = "run"`)
        cfg = self.cfg
        own: dict[str, dict[str, object]] = {}
        if cfg.head_optimizer != "run":
            head = {
                "optimizer": cfg.head_optimizer,
                "lr": cfg.head_lr,
                "momentum": cfg.head_momentum,
                "weight_decay": cfg.head_weight_decay,
            }
            own = {"head_w": head, "head_b": head}
        return [Phase("local", tuple(n for n in names if n != "prompts"), local_epochs, own)]

    def forward(
        self, params: dict[str, Tensor], x: Tensor, client_index: Tensor, ctx: Context
    ) -> Tensor:
        step = project_straight_through(params["prompt_update"], ctx.buffers["projector"])
        prompts = params["prompts"] + step  # (K, L, p, d)
        return super().forward({**params, "prompts": prompts}, x, client_index, ctx)

    def aggregate(self, server: ServerState, updates: Updates) -> ServerState:
        trained = updates.params
        local_prompts = trained["prompts"] + project(
            trained["prompt_update"], server.buffers["projector"]
        )  # (K, L, p, d): what each client sends
        new = super().aggregate(
            server, replace(updates, params={**trained, "prompts": local_prompts})
        )
        proj = null_space_projector(new.params["prompts"], self.cfg.keep_ratio, self.cfg.normalize)
        return ServerState(new.params, new.personal, {**new.buffers, "projector": proj})
