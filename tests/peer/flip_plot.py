#!/usr/bin/env python3
"""Differential check of fpbench's PLOT on a ViT against FLiP's port (FLiP,
`flcore/models/clip/PLOT.py` `PLOTCLIP`, with its `BasePromptLearner`, `TextEncoder` and its
CLIP's `VisionTransformer`, whose forward returns every token after `ln_post` and `proj`: the
pooled one first, then the patches that PLOT transports). The official PLOT code
(CHENGY12/PLOT) builds only the RN50 path; `official_deep.py` compares that one.

FLiP's modules are imported unmodified by path from the checkout under a bare package skeleton
(its package `__init__` files import every model, dataset and matplotlib): its `clip/clip.py`
is empty in the checkout, so a stand-in gives `clip.tokenize` (open_clip's tokenizer, the same
BPE) and no loader (the harness hands PLOTCLIP the model); `flcore.utils`, which imports
matplotlib for plots, is a stand-in (PLOT reads nothing of it); the dataset entry `peer` (image
size 32) is added to FLiP's `INFO` table. Both sides get one random open_clip state dict (FLiP's
`build_model` reads it), the same contexts and images; fp32 on the CPU. Checkout (or set
FPBENCH_PEER_FLIP):

    git clone https://github.com/0-ml/flip ../peer/flip

`python tests/peer/flip_plot.py` prints the largest differences of every case;
tests/test_peer_flip_plot.py asserts them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, not_found, print_cases, sibling  # noqa: E402

OP = sibling("official")
FLIP = checkout("FPBENCH_PEER_FLIP", "flip")
REPO = "0-ml/flip"  # as benchmarks/flip-compare.toml cites it
PACKAGES = ("flcore", "flcore.models", "flcore.models.clip", "flcore.models.text",
            "flcore.datasets")  # fmt: skip


def load_flip() -> tuple[Any, Any]:
    """(FLiP's clip model module, its PLOT module), imported unmodified under a bare package
    skeleton (see the module docstring); sys.modules is restored after."""
    import open_clip

    root = FLIP / "flcore"
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "flcore"}
    for k in saved:
        del sys.modules[k]
    for name in PACKAGES:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    tok = open_clip.get_tokenizer("ViT-B-16")
    clip = types.ModuleType("flcore.models.clip.clip")
    clip.tokenize = lambda texts: tok(texts if isinstance(texts, list) else [texts])
    clip.load_clip_to_cpu = None  # PLOT's learner loads nothing
    sys.modules["flcore.models.clip.clip"] = clip
    sys.modules["flcore.models.clip"].clip = clip
    utils = types.ModuleType("flcore.utils")
    utils.filter_states = None  # read only by other learners
    sys.modules["flcore.utils"] = utils
    try:
        model = importlib.import_module("flcore.models.clip.model")
        plot = importlib.import_module("flcore.models.clip.PLOT")
        info = importlib.import_module("flcore.datasets.info")
        info.INFO["peer"] = {"shape": (3, 32, 32), "num_classes": len(OP.CLASSES)}
        return model, plot
    finally:
        for k in [k for k in sys.modules if k.split(".")[0] == "flcore"]:
            del sys.modules[k]
        sys.modules.update(saved)


def plot_case(folder: Path, max_iter: int = 100, n_prompts: int = 4, n_ctx: int = 4,
              seed: int = 0) -> dict[str, float]:  # fmt: skip
    """FLiP's PLOTCLIP on a ViT against fpbench's `plot`: `logits`, `grad ctx`, `init` (the N
    contexts' N(0, 0.02^2) draw from the same seed), `grad_max`. With a small `max_iter`
    both solvers run exactly that many iterations; at 100 they stop by their own rules
    (fpbench per problem, FLiP on the batch's mean change of u, as the official PLOT)."""
    from fpbench.methods.base import Context

    model, plot = load_flip()
    path, state = OP.weights(OP.VIT, "fpbench-peer-vit", folder)
    theirs = OP.official_clip(model, state, None)
    args = types.SimpleNamespace(
        task="class", prompt_algo="PLOT", precision="fp32", num_context=n_ctx,
        num_prompt=n_prompts, ctx_init="", class_specific_context="false", image_backbone="",
        device_id=0, class_token_position="end", batch_size=4, dataset="peer",
    )  # fmt: skip
    with torch.random.fork_rng(), contextlib.redirect_stdout(io.StringIO()):
        torch.manual_seed(seed)
        official = plot.PLOTCLIP(args, OP.CLASSES, theirs).float().eval()
    official.max_iter = max_iter
    thresh = 1e-2 if max_iter >= 100 else 1e-300
    ours = OP.fpbench_method("plot", OP.fpbench_backbone("fpbench-peer-vit", path), n_ctx=n_ctx,
                             n_prompts=n_prompts, max_iter=max_iter, thresh=thresh)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)
    learner = official.prompt_learner
    out = {"init": OP._diff(start["ctx"], learner.ctx)}
    with torch.no_grad():
        learner.ctx.copy_(start["ctx"])
    images = torch.randn(3, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 1, 2])
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, labels).backward()
    params = {"ctx": start["ctx"].unsqueeze(0).clone().requires_grad_(True)}
    rows = torch.zeros(len(labels), dtype=torch.long)
    logits_ours = ours.forward(params, images, rows, Context(training=True))
    F.cross_entropy(logits_ours, labels).backward()
    out["logits"] = OP._diff(logits_ours, logits_theirs)
    out["grad ctx"] = OP._diff(params["ctx"].grad[0], learner.ctx.grad)
    out["grad_max"] = float(learner.ctx.grad.abs().max())
    return out


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "flip plot vit 5 iterations": ("plot", {"max_iter": 5}),
    "flip plot vit defaults": ("plot", {}),
    "flip plot vit 2 prompts of 6 tokens": ("plot", {"n_prompts": 2, "n_ctx": 6}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    _, args = CASES[name]
    return plot_case(folder, **args)


def why_not(kind: str) -> str | None:
    """Why the case cannot run here (FLiP's checkout is absent), or None."""
    if (FLIP / "flcore" / "models" / "clip" / "PLOT.py").is_file():
        return None
    return not_found(FLIP, REPO, "FPBENCH_PEER_FLIP")


def main() -> None:
    print_cases(CASES, run, why_not, 36)


if __name__ == "__main__":
    main()
