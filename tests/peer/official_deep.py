#!/usr/bin/env python3
"""Differential checks of fpbench's MaPLe, PromptSRC and PLOT against their official code.

Covered: MaPLe (muzairkhattak/multimodal-prompt-learning, `trainers/maple.py`), PromptSRC
(muzairkhattak/PromptSRC, `trainers/promptsrc.py`: the model and its trainer's
`forward_backward`, so the self-regulating loss is the official one) and PLOT (CHENGY12/PLOT,
`plot-coop/trainers/plot.py`). As in `official.py` (whose helpers this file uses), both sides get
one random open_clip state dict, the same prompts, class names and preprocessed images; the
official modules are imported unmodified from their checkouts, with Dassl replaced by empty
stand-ins. The official code runs CLIP in fp16 on a GPU: here it runs on the CPU in fp32, so its
`.half()` and `.cuda()` calls are made identities while it runs (a cast to fp16 would round the
prompts and their gradients to 11 bits), and PromptSRC's loader of the frozen CLIP is pointed at
the same weights instead of a download. Checkouts (or FPBENCH_PEER_MAPLE, _PROMPTSRC, _PLOT):

    git clone https://github.com/muzairkhattak/multimodal-prompt-learning ../peer/MaPLe
    git clone https://github.com/muzairkhattak/PromptSRC ../peer/PromptSRC
    git clone https://github.com/CHENGY12/PLOT ../peer/PLOT

`python tests/peer/official_deep.py` prints the largest differences of every case;
tests/test_peer_official_deep.py asserts them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, missing, print_cases, sibling  # noqa: E402

OP = sibling("official")
MAPLE = checkout("FPBENCH_PEER_MAPLE", "MaPLe")
PROMPTSRC = checkout("FPBENCH_PEER_PROMPTSRC", "PromptSRC")
PLOT = checkout("FPBENCH_PEER_PLOT", "PLOT")
# MaPLe at 69bce21, PromptSRC at bb95c77, PLOT at 728539f were the checkouts these checks used

# MaPLe's prompt learner hard-codes ViT-B/16's widths (text 512, vision 768): a 2-layer CLIP of
# those widths (heads of 64, as the official build_model infers them)
WIDE = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 768, "patch_size": 16,
                   "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8,
                 "layers": 2},
}  # fmt: skip
CLASSES = OP.CLASSES


@contextlib.contextmanager
def _fp32_on_cpu() -> Iterator[None]:
    """`.half()` and `.cuda()` as identities (tensors and modules) while the official code runs."""
    same = lambda self, *a, **k: self  # noqa: E731
    with contextlib.ExitStack() as stack:
        for cls in (torch.Tensor, torch.nn.Module):
            stack.enter_context(mock.patch.object(cls, "half", same))
            stack.enter_context(mock.patch.object(cls, "cuda", same))
        yield


def _layers(arch: dict, name: str, layers: int) -> tuple[dict, str]:
    """`arch` with `layers` blocks in both towers, and its registered name (`name` at the
    config's own depth)."""
    if layers == arch["vision_cfg"]["layers"] == arch["text_cfg"]["layers"]:
        return arch, name
    deeper = {**arch, "vision_cfg": {**arch["vision_cfg"], "layers": layers},
              "text_cfg": {**arch["text_cfg"], "layers": layers}}  # fmt: skip
    return deeper, f"{name}-{layers}l"


def _ours(tensors: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """fpbench's tensor of an official one's key: "name", or "name j" for the j-th of a stack."""
    name, _, j = key.partition(" ")
    return tensors[name][int(j)] if j else tensors[name]


def _start_from(start: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    """Copy fpbench's initial values into the official tensors (keys as in `_ours`)."""
    with torch.no_grad():
        for key, p in theirs.items():
            p.copy_(_ours(start, key))


def _grads(params: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, float]:
    """The gradients' largest differences (official gradients keyed as in `_ours`), and
    `grad_max` for scale."""
    ours = {k: p.grad[0] for k, p in params.items() if p.grad is not None}
    out = {f"grad {k}": OP._diff(_ours(ours, k), g) for k, g in theirs.items()}
    out["grad_max"] = max(float(g.abs().max()) for g in theirs.values())
    return out


# -- MaPLe ---------------------------------------------------------------------------------------


def maple_case(folder: Path, n_ctx: int = 2, depth: int = 2, layers: int = 2,
               seed: int = 0) -> dict[str, float]:  # fmt: skip
    """MaPLe's CustomCLIP against fpbench's forward: `logits` and every tensor's cross-entropy
    gradient (largest absolute differences), `init` (the layer-0 context from "a photo of a"),
    `eot`, and `grad_max` for scale; on a CLIP of `layers` blocks per tower (depth <= layers)."""
    from fpbench.methods.base import Context

    clip_model, maple = OP.load_official(MAPLE, "trainers.maple", "dassl")
    arch, name = _layers(WIDE, "fpbench-peer-wide", layers)
    path, state = OP.weights(arch, name, folder)
    design = {"trainer": "MaPLe", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0, "maple_length": n_ctx}  # fmt: skip
    theirs = OP.official_clip(clip_model, state, design)
    cfg = OP._cfg("MAPLE", 32, N_CTX=n_ctx, CTX_INIT="a photo of a", PREC="fp32",
                 PROMPT_DEPTH=depth)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = maple.CustomCLIP(cfg, CLASSES, theirs).float().eval()
    ours = OP.fpbench_method("maple", OP.fpbench_backbone(name, path),
                            n_ctx=n_ctx, prompt_depth=depth)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)
    learner = official.prompt_learner
    out = {"init": OP._diff(start["ctx"], learner.ctx)}
    out["eot"] = OP._diff(ours.layout.ids.argmax(-1), official.tokenized_prompts.argmax(-1))
    pairs = {"ctx": learner.ctx, "proj_w": learner.proj.weight, "proj_b": learner.proj.bias}
    for j in range(depth - 1):
        pairs[f"deep_ctx {j}"] = learner.compound_prompts_text[j]
        pairs[f"deep_proj_w {j}"] = learner.compound_prompt_projections[j].weight
        pairs[f"deep_proj_b {j}"] = learner.compound_prompt_projections[j].bias
    _start_from(start, pairs)
    images = torch.randn(4, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 1, 2, 1])
    with _fp32_on_cpu():
        logits_theirs = official(images)
        F.cross_entropy(logits_theirs, labels).backward()
    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    rows = torch.zeros(len(labels), dtype=torch.long)
    logits_ours = ours.forward(params, images, rows, Context(training=True))
    F.cross_entropy(logits_ours, labels).backward()
    out["logits"] = OP._diff(logits_ours, logits_theirs)
    out.update(_grads(params, {k: p.grad for k, p in pairs.items()}))
    return out


# -- PromptSRC -----------------------------------------------------------------------------------


def promptsrc_case(folder: Path, depth: int = 2, layers: int = 2,
                   seed: int = 0) -> dict[str, float]:  # fmt: skip
    """PromptSRC's CustomCLIP and its trainer's `forward_backward` (cross-entropy plus the
    self-regulating terms) against fpbench's `loss`: `loss`, eval `logits`, `zs_text` (the
    template-mean teacher), every prompt's gradient, `init`, and `grad_max` for scale; on a
    CLIP of `layers` blocks per tower (depth <= layers)."""
    from fpbench.methods.base import Context, training_loss

    clip_model, psrc = OP.load_official(PROMPTSRC, "trainers.promptsrc", "dassl")
    arch, name = _layers(OP.VIT, "fpbench-peer-vit", layers)
    path, state = OP.weights(arch, name, folder)
    n = 4
    design = {"trainer": "IVLP", "vision_depth": depth, "language_depth": depth,
              "vision_ctx": n, "language_ctx": n}  # fmt: skip
    zero = {"trainer": "IVLP", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
            "language_ctx": 0}  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        theirs = clip_model.build_model({k: v.clone() for k, v in state.items()}, design)
    theirs = theirs.float()
    missing = theirs.load_state_dict(state, strict=False).missing_keys  # the exact fp32 bits
    assert all("VPT" in k for k in missing), missing  # only the prompts are not CLIP's
    cfg = OP._cfg("PROMPTSRC", 32, N_CTX_TEXT=n, N_CTX_VISION=n, CTX_INIT="a photo of a",
                 PREC="fp32", PROMPT_DEPTH_TEXT=depth, PROMPT_DEPTH_VISION=depth,
                 TEXT_LOSS_WEIGHT=25, IMAGE_LOSS_WEIGHT=10, GPA_MEAN=15, GPA_STD=1)  # fmt: skip
    cfg.OPTIM = OP.NS(MAX_EPOCH=20)
    frozen = lambda *a, **k: OP.official_clip(clip_model, state, zero)  # noqa: E731
    with _fp32_on_cpu(), mock.patch.object(psrc, "load_clip_to_cpu", frozen):
        official = psrc.CustomCLIP(cfg, CLASSES, theirs).float()
    ours = OP.fpbench_method("promptsrc", OP.fpbench_backbone(name, path),
                            prompt_depth_text=depth, prompt_depth_vision=depth)  # fmt: skip
    start = ours.init_params(torch.Generator().manual_seed(seed)).params
    visual, text = official.image_encoder, official.text_encoder.transformer
    pairs = {"ctx": official.prompt_learner.ctx, "vision": visual.VPT}
    for j in range(1, depth):
        pairs[f"deep_text {j - 1}"] = text.resblocks[j].VPT_shallow
        pairs[f"deep_vision {j - 1}"] = visual.transformer.resblocks[j].VPT_shallow
    out = {"init": OP._diff(start["ctx"], pairs["ctx"])}
    _start_from(start, pairs)
    out["zs_text"] = OP._diff(
        ours.zero_shot_text(), F.normalize(official.prompt_learner.fixed_embeddings, dim=-1)
    )
    gen = torch.Generator().manual_seed(seed + 1)
    images = torch.randn(4, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 1, 2, 1])
    trainer = object.__new__(psrc.PromptSRC)  # its forward_backward, on a bare trainer
    trainer.__dict__.update(cfg=cfg, model=official, scaler=None, batch_idx=0, num_batches=2,
                            device=torch.device("cpu"), step_counter=1,
                            optim=OP.NS(zero_grad=lambda: None, step=lambda: None))  # fmt: skip
    official.train()
    with _fp32_on_cpu():
        loss_theirs = trainer.forward_backward({"img": images, "label": labels})["loss"]
        official.eval()
        logits_theirs = official(images)
    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    rows = torch.zeros(len(labels), dtype=torch.long)
    train = Context(training=True, labels=labels)
    loss_ours = training_loss(ours.forward(params, images, rows, train), labels)[0].mean()
    loss_ours.backward()
    with torch.no_grad():
        logits_ours = ours.forward(params, images, rows, Context(training=False))
    out["loss"] = abs(loss_ours.item() - loss_theirs)
    out["logits"] = OP._diff(logits_ours, logits_theirs)
    out.update(_grads(params, {k: p.grad for k, p in pairs.items()}))
    return out


# -- PLOT ----------------------------------------------------------------------------------------


def plot_case(folder: Path, max_iter: int = 100, n_prompts: int = 4, n_ctx: int = 4,
              seed: int = 0) -> dict[str, float]:  # fmt: skip
    """PLOT's CustomCLIP (RN, as its reference) against fpbench's forward: `logits`, `grad ctx`,
    `init` (the N contexts' N(0, 0.02^2) draw from the same seed), `grad_max`. With a small
    `max_iter` both solvers run exactly that many iterations (fpbench's stop is per problem, the
    official one on the batch's mean change of u: a declared deviation); at 100 they stop by
    their own rules."""
    from fpbench.methods.base import Context

    clip_model, plot = OP.load_official(PLOT / "plot-coop", "trainers.plot", "dassl")
    path, state = OP.weights(OP.RN, "fpbench-peer-rn", folder)
    theirs = OP.official_clip(clip_model, state)
    cfg = OP._cfg("PLOT", 64, N_CTX=n_ctx, CTX_INIT="", CSC=False, CLASS_TOKEN_POSITION="end",
                 N=n_prompts, PREC="fp32")  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = plot.CustomCLIP(cfg, CLASSES, theirs).float().eval()
    official.max_iter = max_iter
    thresh = 1e-2 if max_iter >= 100 else 1e-300
    ours = OP.fpbench_method("plot", OP.fpbench_backbone("fpbench-peer-rn", path), n_ctx=n_ctx,
                            n_prompts=n_prompts, max_iter=max_iter, thresh=thresh)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)
    out = {"init": OP._diff(start["ctx"], official.prompt_learner.ctx)}
    with torch.no_grad():
        official.prompt_learner.ctx.copy_(start["ctx"])
    images = torch.randn(3, 3, 64, 64, generator=gen)
    labels = torch.tensor([0, 1, 2])
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, labels).backward()
    params = {"ctx": start["ctx"].unsqueeze(0).clone().requires_grad_(True)}
    rows = torch.zeros(len(labels), dtype=torch.long)
    logits_ours = ours.forward(params, images, rows, Context(training=True))
    F.cross_entropy(logits_ours, labels).backward()
    out["logits"] = OP._diff(logits_ours, logits_theirs)
    out.update(_grads(params, {"ctx": official.prompt_learner.ctx.grad}))
    return out


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "maple depth 2": ("maple", {}),
    "maple depth 1": ("maple", {"depth": 1}),
    "promptsrc depth 2": ("promptsrc", {}),
    # the suites' depth (the methods' defaults, 9) on a CLIP one block deeper than that
    "maple depth 9 of 10 blocks": ("maple", {"depth": 9, "layers": 10}),
    "promptsrc depth 9 of 10 blocks": ("promptsrc", {"depth": 9, "layers": 10}),
    "plot 5 iterations": ("plot", {"max_iter": 5}),
    "plot defaults": ("plot", {}),
}
REPOS = {
    "maple": (MAPLE, "muzairkhattak/multimodal-prompt-learning", "FPBENCH_PEER_MAPLE"),
    "promptsrc": (PROMPTSRC, "muzairkhattak/PromptSRC", "FPBENCH_PEER_PROMPTSRC"),
    "plot": (PLOT, "CHENGY12/PLOT", "FPBENCH_PEER_PLOT"),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    cases = {"maple": maple_case, "promptsrc": promptsrc_case, "plot": plot_case}
    return cases[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout is absent), or None."""
    path, repo, var = REPOS[kind]
    needed = ("plot-coop/trainers",) if kind == "plot" else ()  # PLOT's CoOp is in a folder
    return missing(path, repo, var, *needed)


def main() -> None:
    print_cases(CASES, run, why_not, 24)


if __name__ == "__main__":
    main()
