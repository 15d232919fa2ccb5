#!/usr/bin/env python3
"""Differential check of fpbench's FedMVP (issue #34) against its official code, run from its
checkout by path; the helpers (tiny random CLIP weights read by both sides, isolated imports)
are those of `official.py` beside this file.

Covered (mainaksingha01/FedMVP, `model/FedMVP.py`, `model/descriptors.py` and the client's
loss in `federated/client.py`, checked at 246800e): the official `FedMVP` module on the same
CLIP weights, prompt-net tensors (fpbench's initial ones copied in), class names, attribute
descriptions (a small attributes/<dataset>.json in its native format, written here, read by
both sides) and images; its logits and the client's loss CE + ALPHA * vis_score, against
fpbench's forward and per-sample loss averaged, and the gradients of every prompt-net tensor.
The official batch flip is a coin (torchvision's RandomHorizontalFlip on the batch): each
outcome is fixed in turn by replacing the module's `flip_transform`, and fpbench's default
("expected") is checked against the mean of the two official losses. After the switch to LoRA
(a client as `federated/client.py:95-101` leaves it: `use_lora`, the attention frozen), the
training logits, the loss and the gradients of W_t, b_t and the six LoRA factors, with no
gradient of the frozen attention on either side.

Three things the published code lacks are supplied here, nothing else is changed: the module
`model.prompt_net` that `model/FedMVP.py` imports (absent from the repository; nothing of it is
used), `einops` where it is not installed (imported, unused), and the `image_encoder` that
`FedMVP.forward` calls but `__init__` never sets (its own `ImageEncoder` on the CLIP's visual
tower). The official prompt net is built in fp16 (`.half()`); it is cast to fp32 here, as the
CLIP is. Its widths are ViT-B/16's (768 vision, 512 joint), so the tiny CLIP has them too.

Get the checkout next to the repository (or set FPBENCH_PEER_FEDMVP):

    git clone https://github.com/mainaksingha01/FedMVP ../peer/FedMVP

`python tests/peer/official_fedmvp.py` prints the largest differences of every case;
tests/test_peer_fedmvp.py asserts them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, missing, print_cases, sibling  # noqa: E402

REF = sibling("official")
FEDMVP = checkout("FPBENCH_PEER_FEDMVP", "FedMVP")
# ViT-B/16's widths (the official prompt net hard-codes 768 and 512), one layer per tower
VIT = {
    "embed_dim": 512,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 768, "patch_size": 16,
                   "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 1},
}  # fmt: skip
# fpbench dataset -> (official dataset name, attributes file stem)
DATASETS = {"caltech101": ("Caltech101", "caltech101"), "flowers102": ("OxfordFlowers",
            "oxford_flowers")}  # fmt: skip
# three per class (the official code stacks them: equal counts); one runs past 77 characters
DESCRIPTIONS = {
    "golden retriever": ["floppy ears", "a golden coat", "often seen retrieving a ball"],
    "tabby cat": ["striped fur", "an m-shaped marking on the forehead", "can climb"],
    "airplane": ["wings", "used for travel between distant cities across oceans and "
                 "continents of the world", "may have jet engines"],
}  # fmt: skip
# fpbench's tensor -> the official prompt learner's
NAMES = {
    "text_w": "linear.weight", "text_b": "linear.bias",
    "norm_w": "crossattn.cross_attend_blocks.0.norm.weight",
    "norm_b": "crossattn.cross_attend_blocks.0.norm.bias",
    "norm_ctx_w": "crossattn.cross_attend_blocks.0.norm_context.weight",
    "norm_ctx_b": "crossattn.cross_attend_blocks.0.norm_context.bias",
    "attn_in_w": "crossattn.cross_attend_blocks.0.fn.in_proj_weight",
    "attn_in_b": "crossattn.cross_attend_blocks.0.fn.in_proj_bias",
    "attn_out_w": "crossattn.cross_attend_blocks.0.fn.out_proj.weight",
    "attn_out_b": "crossattn.cross_attend_blocks.0.fn.out_proj.bias",
    "ff_norm_w": "crossattn.cross_attend_blocks.1.net.0.weight",
    "ff_norm_b": "crossattn.cross_attend_blocks.1.net.0.bias",
    "ff1_w": "crossattn.cross_attend_blocks.1.net.1.weight",
    "ff1_b": "crossattn.cross_attend_blocks.1.net.1.bias",
    "ff2_w": "crossattn.cross_attend_blocks.1.net.3.weight",
    "ff2_b": "crossattn.cross_attend_blocks.1.net.3.bias",
}  # fmt: skip
LORA = {
    "lora_qa": "cross_loraparams.cross_queryA", "lora_qb": "cross_loraparams.cross_queryB",
    "lora_ka": "cross_loraparams.cross_keyA", "lora_kb": "cross_loraparams.cross_keyB",
    "lora_va": "cross_loraparams.cross_valueA", "lora_vb": "cross_loraparams.cross_valueB",
}  # fmt: skip
FLIPS = {"never": lambda x: x, "always": lambda x: x.flip(-1)}


def load_official() -> tuple[Any, Any]:
    """(clip.model module, model.FedMVP module) of the checkout, with the stand-ins above."""
    stubs = {"model.prompt_net": types.ModuleType("model.prompt_net")}
    if importlib.util.find_spec("einops") is None:
        stubs["einops"] = types.ModuleType("einops")
        stubs["einops"].repeat = None
    with REF._isolated(FEDMVP, stubs, ("clip", "model", "einops")):
        return importlib.import_module("clip.model"), importlib.import_module("model.FedMVP")


@contextlib.contextmanager
def _cwd(folder: Path):
    """The official forward reads attributes/<dataset>.json relative to the working folder."""
    before = Path.cwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def fedmvp_case(folder: Path, dataset: str = "caltech101", flip: str = "never",
                alpha: float = 10.0, batch: int = 2, lora: bool = False,
                seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official FedMVP module and client loss against fpbench's `fedmvp`; `lora`: a client
    after its switch (the official `use_lora`, the attention frozen, the LoRA factors in).

    Returns the largest absolute differences of `logits`, `loss` and `grad` (over the 16
    prompt-net tensors, or with `lora` over W_t, b_t and the 6 LoRA factors, the attention's
    gradients being none on both sides) and, for scale, `grad_max`.
    """
    from fpbench.methods.base import Context, TaskInfo, as_logits, training_loss
    from fpbench.methods.fedmvp import FedMVP

    clip_model, mvp = load_official()
    path, state = REF.weights(VIT, "fpbench-peer-fedmvp", folder, seed)
    theirs = REF.official_clip(clip_model, state)
    dataname, stem = DATASETS[dataset]
    (folder / "attributes").mkdir(exist_ok=True)
    (folder / "attributes" / f"{stem}.json").write_text(json.dumps(DESCRIPTIONS))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = mvp.FedMVP(NS(MODEL=NS(N_CTX=4), TRAIN=NS(ALPHA=alpha)), theirs, "cpu")
    official.image_encoder = mvp.ImageEncoder(theirs.visual)  # never set by the official init
    learner = official.prompt_learner.float()

    backbone = REF.fpbench_backbone("fpbench-peer-fedmvp", path)
    c = len(REF.CLASSES)
    task = TaskInfo(c, 1, torch.full((1, c), 1 / c), torch.tensor([8]), tuple(REF.CLASSES),
                    dataset)  # fmt: skip
    cfg = FedMVP.Config(alpha=alpha, flip=flip, attributes_dir=str(folder / "attributes"))
    ours = FedMVP(cfg, backbone, task)
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen).params
    with torch.no_grad():
        for mine, name in (NAMES | LORA).items():
            learner.get_parameter(name).copy_(start[mine])
    names = NAMES  # the tensors whose gradients are compared
    if lora:  # as the official client switches (federated/client.py:95-101)
        learner.crossattn.requires_grad_(False)
        learner.use_lora = True
        names = {m: n for m, n in (NAMES | LORA).items() if m in LORA or m.startswith("text_")}
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.arange(batch) % c

    losses = []
    for outcome in ("never", "always") if flip == "expected" else (flip,):
        mvp.flip_transform = FLIPS[outcome]  # the coin's outcome, fixed
        with _cwd(folder):
            logits_theirs, vis_score = official(images, REF.CLASSES, dataname)
        losses.append(F.cross_entropy(logits_theirs, labels) + alpha * vis_score)
    loss_theirs = sum(losses) / len(losses)
    loss_theirs.backward()

    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    if lora:
        params["lora_on"] = torch.ones(1, dtype=torch.bool)
    rows = torch.zeros(batch, dtype=torch.long)
    train = Context(training=True, labels=labels)
    loss, _ = training_loss(ours.forward(params, images, rows, train), labels)
    loss = loss.mean()
    loss.backward()
    with torch.no_grad():  # the official module applies LoRA in evaluation too, fpbench's never
        out = ours.forward(params, images, rows, train if lora else Context(False))
        logits_ours = as_logits(out)
    frozen = [m for m in NAMES if m not in names]
    if any(params[m].grad is not None or learner.get_parameter(NAMES[m]).grad is not None
           for m in frozen):  # fmt: skip
        raise AssertionError("a frozen attention tensor got a gradient")
    grads = [(params[m].grad[0], learner.get_parameter(n).grad) for m, n in names.items()]
    return {
        "logits": REF._diff(logits_ours, logits_theirs),
        "loss": REF._diff(loss, loss_theirs),
        "grad": max(REF._diff(a, b) for a, b in grads),
        "grad_max": max(float(b.abs().max()) for _, b in grads),
    }


CASES = {
    "fedmvp caltech101, flip never": ("fedmvp", {}),
    "fedmvp caltech101, flip always, alpha 2": ("fedmvp", {"flip": "always", "alpha": 2.0}),
    "fedmvp flowers102 (suffix), expected flip": ("fedmvp", {"dataset": "flowers102",
                                                              "flip": "expected", "batch": 3}),
    "fedmvp caltech101, after the switch to LoRA": ("fedmvp", {"lora": True}),
}  # fmt: skip


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    return fedmvp_case(folder, **args)


def why_not(kind: str) -> str | None:
    """Why a case cannot run here (the checkout is absent), or None."""
    return missing(FEDMVP, "mainaksingha01/FedMVP", "FPBENCH_PEER_FEDMVP", "model", "clip")


def main() -> None:
    print_cases(CASES, run, why_not, 46)


if __name__ == "__main__":
    main()
