#!/usr/bin/env python3
"""Differential check of fpbench's `fedpha` against the official FedPHA code, run unmodified
from its checkout (CYFang6/FedPHA, `trainers/GL_SVDMSE.py`, checked at 1ab33df); the helpers
(tiny random CLIP weights read by both sides, Dassl stand-ins, isolated imports) are those of
`official.py` beside this file.

The official `CustomCLIP` and the official trainer step `forward_backward` (cross-entropy of the
local and of the global prompt, the pull term on the projection off the global prompt's top
singular directions, the push hinge), on the same global and local prompts, class names and
images (the frozen image tower in eval mode on both sides: Dassl's train mode would put RN's
batch norm in training mode, fpbench's CLIP keeps it frozen): the initial prompts (the
official N(0, 0.02^2) draws from the seeded global generator against fpbench's), the evaluation
logits, the loss and the gradients of both prompts.

Get the checkout next to the repository (or set FPBENCH_PEER_FEDPHA):

    git clone https://github.com/CYFang6/FedPHA ../peer/FedPHA

`python scripts/peer/official_fedpha.py` prints the largest differences of every case;
tests/test_peer_fedpha.py asserts them.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def _load_sibling() -> Any:
    spec = importlib.util.spec_from_file_location(
        "fpbench_peer_official", Path(__file__).with_name("official.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REF = _load_sibling()
FEDPHA = Path(os.environ.get("FPBENCH_PEER_FEDPHA", REF.PEER / "FedPHA"))


def fedpha_case(folder: Path, arch: str = "vit", n_ctx: int = 4, ratio: float = 0.8,
                alpha: float = 1.0, batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official FedPHA (GL_SVDMSE) CustomCLIP and trainer step against fpbench's `fedpha`.

    Returns the largest absolute differences of `init`, `logits` (evaluation: the local
    prompt), `loss` (the official step's, against the mean of fpbench's per-sample loss),
    `grad_global`, `grad_local` and, for scale, `grad_max`.
    """
    from fpbench.methods.base import Context

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

    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    rows = torch.zeros(batch, dtype=torch.long)
    loss = ours.loss(params, images, labels, rows, Context(training=True, labels=labels)).mean()
    loss.backward()
    with torch.no_grad():
        logits_ours = ours.forward(params, images, rows, Context(training=False))
    out["logits"] = REF._diff(logits_ours, logits_theirs)
    out["loss"] = REF._diff(loss, losses[0])
    out["grad_global"] = REF._diff(params["global_ctx"].grad[0], learner.ctx_global.grad[0])
    out["grad_local"] = REF._diff(params["local_ctx"].grad[0], learner.ctx_local.grad[0])
    out["grad_max"] = max(float(learner.ctx_global.grad.abs().max()),
                          float(learner.ctx_local.grad.abs().max()))  # fmt: skip
    return out


CASES = {
    "fedpha vit": ("fedpha", {}),
    "fedpha vit, ratio 0.5, alpha 2": ("fedpha", {"ratio": 0.5, "alpha": 2.0}),
    "fedpha rn, 6 tokens": ("fedpha", {"arch": "rn", "n_ctx": 6}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    return {"fedpha": fedpha_case}[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout is absent), or None."""
    return REF.missing(FEDPHA, "CYFang6/FedPHA", "FPBENCH_PEER_FEDPHA")


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (kind, _) in CASES.items():
            if line := why_not(kind):
                print(f"{name:32s} skipped: {line}")
                continue
            diffs = run(name, Path(tmp))
            print(f"{name:32s} " + "  ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


if __name__ == "__main__":
    main()
