#!/usr/bin/env python3
"""Differential check of fpbench's BPL against its official code, run unmodified from the
checkout (saic-fi/Bayesian-Prompt-Learning, `trainers/vpt.py`: `CustomCLIP`; written against
commit 8a73fff).

Both sides get the same random CLIP weights, class names, context, posterior parameters and
preprocessed images (the helpers of `official.py`), and the same Monte Carlo draws: the official
`PromptLearner.sample` draws eps from the global generator, which is seeded before each of its
calls; fpbench gets the same eps as its server buffer. Compared: `init` (the "a photo of a"
context), `logits` (the log mean softmax, the official eval output), `loss` (the official
training output: -log p(y | x) + 0.001 KL) and `grad_<tensor>` (its gradient on each trained
tensor), with `grad_max` for scale. The `cocoopvpt` cases use one image, as the official code
must (its bias broadcast assumes a batch of one).

    git clone https://github.com/saic-fi/Bayesian-Prompt-Learning ../peer/Bayesian-Prompt-Learning

`python tests/peer/official_bpl.py` prints the largest differences of every case;
tests/test_peer_bpl.py asserts them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, missing, print_cases, sibling  # noqa: E402

OFFICIAL = sibling("official")
BPL = checkout("FPBENCH_PEER_BPL", "Bayesian-Prompt-Learning")
CLASSES = OFFICIAL.CLASSES
_diff = OFFICIAL._diff
# fpbench's name of each official tensor of the posterior
COOP_POSTERIOR = {"mean_posterior": "mean_posterior", "std_posterior": "std_posterior"}


def why_not(kind: str) -> str | None:
    return missing(BPL, "saic-fi/Bayesian-Prompt-Learning", "FPBENCH_PEER_BPL")


def _posterior_names(vpt_type: str) -> dict[str, str]:
    """fpbench's parameter name -> the official prompt learner's."""
    if vpt_type == "coopvpt":
        return COOP_POSTERIOR
    out = {}
    for head, official in (("mean", "weight_mean"), ("logvar", "weight_log_variance")):
        for i, layer in enumerate((0, 2, 4), start=1):
            out[f"{head}_w{i}"] = f"meta_net.{official}.module.{layer}.weight"
            out[f"{head}_b{i}"] = f"meta_net.{official}.module.{layer}.bias"
    return out


def bpl_case(
    folder: Path, vpt_type: str = "coopvpt", n_samples: int = 3, batch: int = 4, seed: int = 5
) -> dict[str, float]:
    from fpbench.methods.base import Context, training_loss

    clip_model, vpt = OFFICIAL.load_official(BPL, "trainers.vpt", "dassl")
    path, state = OFFICIAL.weights(OFFICIAL.VIT, "fpbench-peer-vit", folder)
    theirs = OFFICIAL.official_clip(clip_model, state)
    cfg = NS(TRAINER=NS(VPT=NS(N_CTX=4, CTX_INIT="a photo of a", L=n_samples,
                                VPT_TYPE=vpt_type, PREC="fp32")),
             INPUT=NS(SIZE=(32, 32)))  # fmt: skip
    with torch.random.fork_rng():  # its posterior init draws from the global generator
        torch.manual_seed(0)
        official = vpt.CustomCLIP(cfg, CLASSES, theirs)
    backbone = OFFICIAL.fpbench_backbone("fpbench-peer-vit", path)
    ours = OFFICIAL.fpbench_method("bpl", backbone, vpt_type=vpt_type, n_samples=n_samples)
    start = ours.init_params(torch.Generator().manual_seed(0)).params
    learner = dict(official.prompt_learner.named_parameters())
    out = {"init": _diff(start["ctx"], learner["ctx"])}
    names = {"ctx": "ctx", **_posterior_names(vpt_type)}
    assert set(names) == set(start), set(start) ^ set(names)
    params = {k: learner[v].detach().clone().reshape(start[k].shape) for k, v in names.items()}

    images = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    labels = torch.tensor([2, 0, 1, 1])[:batch]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        loss_theirs = official(images, labels)  # training mode: the loss
    loss_theirs.sum().backward()
    official.eval()
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        logits_theirs = official(images)  # eval mode: the log mean softmax
    with torch.random.fork_rng():  # the draws of its sample(): (L, 1, d), batch or not
        torch.manual_seed(seed)
        eps = torch.randn(n_samples, 1, backbone.ctx_dim)[:, 0]

    leaves = {k: v.unsqueeze(0).requires_grad_(True) for k, v in params.items()}
    rows = torch.zeros(batch, dtype=torch.long)
    buffers = {"eps": eps}
    train = Context(True, labels=labels, buffers=buffers)
    loss, _ = training_loss(ours.forward(leaves, images, rows, train), labels)
    loss.mean().backward()
    with torch.no_grad():
        logits = ours.forward(leaves, images, rows, Context(False, buffers=buffers))
    out["logits"] = _diff(logits, logits_theirs)
    out["loss"] = _diff(loss.mean(), loss_theirs.sum())
    grad_max = 0.0
    for k, v in names.items():
        grad = learner[v].grad.reshape(start[k].shape)
        out[f"grad_{k}"] = _diff(leaves[k].grad[0], grad)
        grad_max = max(grad_max, float(grad.abs().max()))
    out["grad_max"] = grad_max
    return out


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "bpl coopvpt L 3": ("bpl", {}),
    "bpl coopvpt L 10": ("bpl", {"n_samples": 10, "seed": 11}),
    "bpl cocoopvpt L 3": ("bpl", {"vpt_type": "cocoopvpt", "batch": 1}),
    "bpl cocoopvpt L 4": ("bpl", {"vpt_type": "cocoopvpt", "n_samples": 4, "batch": 1}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    return bpl_case(folder, **args)


def main() -> None:
    print_cases(CASES, run, why_not, 24)


if __name__ == "__main__":
    main()
