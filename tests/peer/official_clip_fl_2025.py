#!/usr/bin/env python3
"""Differential checks of fpbench's pFedMoAP and FedPHA (issue #34, both 2025) against their
official code, run unmodified from its checkout; the helpers (tiny random CLIP weights read by
both sides, Dassl stand-ins, isolated imports) are those of `official.py` beside this file.

Covered:
* pFedMoAP (ljaiverson/pFedMoAP, `trainers/pfedmoap.py`, checked at a481de3): the official
  `CustomCLIP` with its `MultiheadAttention` gate, on the same local context, gate tensors,
  non-local expert contexts (handed to it as the trainer's `download_nonlocal_ctx` does:
  `nonlocal_ctx`, then `_compute_nonlocal_text_features`), class names and images; logits and
  the cross-entropy gradients of the context and of all eight gate tensors, with experts and
  without (round one: the local logits alone). Which experts a client gets is not compared: the
  official "nearest" selection fails whenever it would rank (see fpbench/methods/pfedmoap.py);
  fpbench's is tested by hand in tests/methods/test_pfedmoap.py.
* FedPHA (CYFang6/FedPHA, `trainers/GL_SVDMSE.py`, checked at 1ab33df): the official
  `CustomCLIP` and trainer step `forward_backward` (cross-entropy of the local and of the global
  prompt, the pull term on the projection off the global prompt's top singular directions, the
  push hinge), on the same prompts, class names and images (the frozen image tower in eval mode
  on both sides: Dassl's train mode would put RN's batch norm in training mode, fpbench's CLIP
  keeps it frozen); the initial prompts (the official N(0, 0.02^2) draws from the seeded global
  generator against fpbench's), the evaluation logits, the loss and both prompts' gradients.

Get the checkouts next to the repository (or set FPBENCH_PEER_PFEDMOAP, FPBENCH_PEER_FEDPHA):

    git clone https://github.com/ljaiverson/pFedMoAP ../peer/pFedMoAP
    git clone https://github.com/CYFang6/FedPHA ../peer/FedPHA

`python tests/peer/official_clip_fl_2025.py` prints the largest differences of every case;
tests/test_peer_clip_fl_2025.py asserts them.
"""

from __future__ import annotations

import importlib
import os
import sys
import tempfile
import types
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, missing, print_cases, sibling  # noqa: E402

REF = sibling("official")
PFEDMOAP = checkout("FPBENCH_PEER_PFEDMOAP", "pFedMoAP")
FEDPHA = checkout("FPBENCH_PEER_FEDPHA", "FedPHA")
GATE = {"q": "W_q", "k": "W_k", "v": "W_v", "o": "W_o"}  # fpbench's gate_w{x} -> official


# -- pFedMoAP ------------------------------------------------------------------------------------


def load_official() -> tuple[Any, Any]:
    """(clip.model module, trainers.pfedmoap module) of the checkout, imported unmodified.

    Its `clip.py` reads $PROJECT for a download folder at import (never used here: the weights
    come from a file); its trainers import a few more Dassl names than `official.py` stubs.
    """
    stubs = REF._dassl_stubs("Dassl.dassl")
    more = ("Registry", "MetricMeter", "AverageMeter", "tolist_if_not", "count_num_param",
            "save_checkpoint", "mkdir_if_missing", "resume_from_checkpoint")  # fmt: skip
    for name in more:
        setattr(stubs["Dassl.dassl.utils"], name, None)
    data = types.ModuleType("Dassl.dassl.data")
    data.DataManager = None
    stubs["Dassl.dassl.data"] = data
    project = {"PROJECT": os.environ.get("PROJECT", tempfile.gettempdir())}
    with mock.patch.dict(os.environ, project), REF._isolated(PFEDMOAP, stubs):
        return importlib.import_module("clip.model"), importlib.import_module("trainers.pfedmoap")


def pfedmoap_case(folder: Path, arch: str = "vit", n_ctx: int = 4, experts: int = 2,
                  heads: int = 2, embed: int = 8, lmbda: float = 0.5, scaling: float = 10.0,
                  batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official pFedMoAP CustomCLIP against fpbench's `pfedmoap` forward, cross-entropy on
    both sides, with `experts` non-local experts (0: round one, no gate).

    Returns the largest absolute differences of `logits`, `grad_ctx`, `grad_gate` (over the
    eight gate tensors; 0 without experts, where neither side's gate is used) and, for scale,
    `grad_max`.
    """
    from fpbench.methods.base import Context, TaskInfo
    from fpbench.methods.pfedmoap import PFedMoAP

    clip_model, moap = load_official()
    spec, size = (REF.VIT, 32) if arch == "vit" else (REF.RN, 64)
    name = f"fpbench-peer-{arch}"
    path, state = REF.weights(spec, name, folder)
    theirs = REF.official_clip(clip_model, state, {"trainer": "PFEDMOAP"})
    cfg = REF._cfg("PFEDMOAP", size, N_CTX=n_ctx, CTX_INIT="", CSC=False,
                   CLASS_TOKEN_POSITION="end", PREC="fp32", NUM_EXPERTS=experts + 1,
                   GATING_HEADS=heads, GATING_EMBED_DIM=embed, LMBDA=lmbda,
                   SCALING=scaling)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = moap.CustomCLIP(cfg, REF.CLASSES, theirs)
    backbone = REF.fpbench_backbone(name, path)
    c, n = len(REF.CLASSES), experts + 2  # clients: this one, its experts and one more
    task = TaskInfo(c, n, torch.full((n, c), 1 / c), torch.full((n,), 8), tuple(REF.CLASSES),
                    "peer")  # fmt: skip
    ours = PFedMoAP(PFedMoAP.Config(n_ctx=n_ctx, num_experts=experts + 1, gating_heads=heads,
                                    gating_embed_dim=embed, lmbda=lmbda, scaling=scaling),
                    backbone, task)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen).params
    uploads = torch.randn(n, n_ctx, backbone.ctx_dim, generator=gen) * 0.3
    chosen = torch.arange(1, experts + 1)  # this client is 0; its experts 1..experts
    with torch.no_grad():
        official.prompt_learner.ctx.copy_(start["ctx"])
        for x, layer in GATE.items():
            getattr(official.gating, layer).weight.copy_(start[f"gate_w{x}"])
            getattr(official.gating, layer).bias.copy_(start[f"gate_b{x}"])
    if experts:
        official.nonlocal_ctx = [uploads[j].clone() for j in chosen.tolist()]
        official._compute_nonlocal_text_features()
    images = torch.randn(batch, 3, size, size, generator=gen)
    labels = torch.arange(batch) % c
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, labels).backward()

    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    params["expert_ids"] = chosen.view(1, -1)
    params["expert_mask"] = torch.ones(1, experts, dtype=torch.bool)
    rows = torch.zeros(batch, dtype=torch.long)
    ctx = Context(training=True, buffers={"uploads": uploads})
    logits_ours = ours.forward(params, images, rows, ctx)
    F.cross_entropy(logits_ours, labels).backward()
    grad = official.prompt_learner.ctx.grad
    out = {"logits": REF._diff(logits_ours, logits_theirs),
           "grad_ctx": REF._diff(params["ctx"].grad[0], grad)}  # fmt: skip
    gate = 0.0
    for x, layer in GATE.items():
        for mine, part in ((f"gate_w{x}", "weight"), (f"gate_b{x}", "bias")):
            theirs_grad = getattr(getattr(official.gating, layer), part).grad
            if theirs_grad is None:  # no experts: the official gate is not in the graph
                theirs_grad = torch.zeros_like(params[mine][0])
            gate = max(gate, REF._diff(params[mine].grad[0], theirs_grad))
    out["grad_gate"] = gate
    out["grad_max"] = float(grad.abs().max())
    return out


# -- FedPHA --------------------------------------------------------------------------------------


def fedpha_case(folder: Path, arch: str = "vit", n_ctx: int = 4, ratio: float = 0.8,
                alpha: float = 1.0, batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official FedPHA (GL_SVDMSE) CustomCLIP and trainer step against fpbench's `fedpha`.

    Returns the largest absolute differences of `init`, `logits` (evaluation: the local
    prompt), `loss` (the official step's, against the mean of fpbench's per-sample loss),
    `grad_global`, `grad_local` and, for scale, `grad_max`.
    """

    clip_model, pha = REF.load_official(FEDPHA, "trainers.GL_SVDMSE", "Dassl.dassl")
    spec, size = (REF.VIT, 32) if arch == "vit" else (REF.RN, 64)
    name = f"fpbench-peer-{arch}"
    path, state = REF.weights(spec, name, folder)
    design = {"trainer": "GL_SVDMSE", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0}  # fmt: skip
    theirs = REF.official_clip(clip_model, state, design)
    cfg = REF._cfg("GL_SVDMSE", size, N_CTX=n_ctx, CTX_INIT=False, CSC=False, PREC="fp32",
                   CLASS_TOKEN_POSITION="end", N=1, lambda_orthogonal=1, alpha=alpha,
                   ratio=ratio)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = pha.CustomCLIP(cfg, REF.CLASSES, theirs)
    backbone = REF.fpbench_backbone(name, path)
    ours = REF.fpbench_method("fedpha", backbone, n_ctx=n_ctx, ratio=ratio, alpha=alpha)
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)  # global_ctx, local_ctx (M, d)
    learner = official.prompt_learner
    out = {"init": max(REF._diff(start["global_ctx"], learner.ctx_global[0]),
                       REF._diff(start["local_ctx"], learner.ctx_local[0]))}  # fmt: skip
    with torch.no_grad():
        learner.ctx_global.copy_(start["global_ctx"].unsqueeze(0))  # the official (N = 1, ...)
        learner.ctx_local.copy_(start["local_ctx"].unsqueeze(0))
    images = torch.randn(batch, 3, size, size, generator=gen)
    labels = torch.arange(batch) % len(REF.CLASSES)

    # the official trainer's step, its framework parts (TrainerX) supplied here
    losses: list[torch.Tensor] = []
    trainer = pha.GL_SVDMSE.__new__(pha.GL_SVDMSE)
    trainer.cfg, trainer.model, trainer.alpha = cfg, official, alpha
    trainer.device, trainer.batch_idx, trainer.num_batches = torch.device("cpu"), 0, 2
    trainer.model_backward_and_update = lambda loss: (losses.append(loss), loss.backward())
    pha.compute_accuracy = lambda output, label: [torch.zeros(())]  # Dassl's metric, unused
    official.train()  # its forward returns the training outputs in train mode
    official.image_encoder.eval()  # RN's batch norm frozen, as fpbench's CLIP keeps it
    trainer.forward_backward(0, {"img": images, "label": labels})
    with torch.no_grad():
        official.eval()
        logits_theirs = official(images)

    params, loss, logits_ours = REF._train_step(ours, start, images, labels)
    out["logits"] = REF._diff(logits_ours, logits_theirs)
    out["loss"] = REF._diff(loss, losses[0])
    out["grad_global"] = REF._diff(params["global_ctx"].grad[0], learner.ctx_global.grad[0])
    out["grad_local"] = REF._diff(params["local_ctx"].grad[0], learner.ctx_local.grad[0])
    out["grad_max"] = max(float(learner.ctx_global.grad.abs().max()),
                          float(learner.ctx_local.grad.abs().max()))  # fmt: skip
    return out


CASES = {
    "pfedmoap vit, 2 experts": ("pfedmoap", {}),
    "pfedmoap vit, no experts (round one)": ("pfedmoap", {"experts": 0}),
    "pfedmoap vit, 3 experts, 4 heads, lambda 0.3": (
        "pfedmoap",
        {"experts": 3, "heads": 4, "embed": 16, "lmbda": 0.3, "scaling": 2.0},
    ),
    "pfedmoap rn, 2 experts": ("pfedmoap", {"arch": "rn"}),
    "fedpha vit": ("fedpha", {}),
    "fedpha vit, ratio 0.5, alpha 2": ("fedpha", {"ratio": 0.5, "alpha": 2.0}),
    "fedpha rn, 6 tokens": ("fedpha", {"arch": "rn", "n_ctx": 6}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    return {"pfedmoap": pfedmoap_case, "fedpha": fedpha_case}[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout is absent), or None."""
    if kind == "pfedmoap":
        return missing(PFEDMOAP, "ljaiverson/pFedMoAP", "FPBENCH_PEER_PFEDMOAP")
    return missing(FEDPHA, "CYFang6/FedPHA", "FPBENCH_PEER_FEDPHA")


def main() -> None:
    print_cases(CASES, run, why_not, 44)


if __name__ == "__main__":
    main()
