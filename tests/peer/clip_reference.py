#!/usr/bin/env python3
"""Differential checks of the CLIP reference rows and CoOp's successors against their official
code, run unmodified from the checkouts (issue #34).

Covered: zero-shot CLIP (KaiyangZhou/CoOp `trainers/zsclip.py`, `ZeroshotCLIP`), CoCoOp (same
repo, `trainers/cocoop.py`), KgCoOp (htyao89/KgCoOp `KgCoOp/trainers/kgcoop.py`) and ProGrad
(BeierZhu/Prompt-align `ProGrad.public/trainers/prograd.py`, with the gradient step
`prograd_backward_and_update` of its Dassl fork, `Dassl.ProGrad.pytorch/dassl/engine/trainer.py`).
Both sides get the same random CLIP weights, class names, contexts and preprocessed images (see
`official.py`, whose helpers this file reuses); the logits, the losses and the gradients of the
trained tensors are compared in fp32.

The official modules are imported by path and never edited. Where they reach for what a CPU
test cannot give, this harness supplies it from outside: their `load_clip_to_cpu` (a download)
returns the shared random CLIP, `.cuda()` is the identity while they are built, and ProGrad's
step (a method of Dassl's trainer, whose module imports the whole framework) is compiled from
its own source text and called on a stand-in trainer holding the prompt learner. Checkouts
(or set FPBENCH_PEER_COOP, FPBENCH_PEER_KGCOOP, FPBENCH_PEER_PROGRAD):

    git clone https://github.com/KaiyangZhou/CoOp ../peer/CoOp           # ff61507 (as official.py)
    git clone https://github.com/htyao89/KgCoOp ../peer/KgCoOp           # c43ccc3
    git clone https://github.com/BeierZhu/Prompt-align ../peer/Prompt-align   # 1b76203

`python tests/peer/clip_reference.py` prints the largest differences of every case;
tests/test_peer_clip_reference.py asserts them.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, print_cases, sibling  # noqa: E402

OFFICIAL = sibling("official")
COOP = OFFICIAL.COOP
KGCOOP = checkout("FPBENCH_PEER_KGCOOP", "KgCoOp")
PROGRAD = checkout("FPBENCH_PEER_PROGRAD", "Prompt-align")
CLASSES = OFFICIAL.CLASSES
# fpbench's dataset name -> the official one, for the per-dataset templates
DATASETS = {"oxford-pets": "OxfordPets", "dtd": "DescribableTextures", "caltech101": "Caltech101"}


def _roots(kind: str) -> tuple[Path, str, str]:
    """(checkout, code root inside it, how to get it) of a kind of case."""
    if kind in ("zsclip", "cocoop"):
        return COOP, "", "KaiyangZhou/CoOp (or set FPBENCH_PEER_COOP)"
    if kind == "kgcoop":
        return KGCOOP, "KgCoOp", "htyao89/KgCoOp (or set FPBENCH_PEER_KGCOOP)"
    return PROGRAD, "ProGrad.public", "BeierZhu/Prompt-align (or set FPBENCH_PEER_PROGRAD)"


def why_not(kind: str) -> str | None:
    """A line saying how to get an absent checkout, or None when it is there."""
    repo, sub, how = _roots(kind)
    code = repo / sub
    if (code / "trainers").is_dir() and (code / "clip").is_dir():
        return None
    return f"official checkout not found at {repo}: git clone https://github.com/{how}"


@contextlib.contextmanager
def _cuda_is_identity() -> Iterator[None]:
    """`.cuda()` returns the tensor or module itself while the official models are built."""
    saved = torch.Tensor.cuda, torch.nn.Module.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.nn.Module.cuda = saved


def _setup(kind: str, trainer: str, folder: Path) -> tuple[Any, Any, Any, Any]:
    """(official trainer module, official CLIP, fpbench backbone, preprocessed images)."""
    repo, sub, _ = _roots(kind)
    clip_model, module = OFFICIAL.load_official(repo / sub, trainer, "dassl")
    path, state = OFFICIAL.weights(OFFICIAL.VIT, "fpbench-peer-vit", folder)
    theirs = OFFICIAL.official_clip(clip_model, state)
    module.load_clip_to_cpu = lambda cfg: theirs  # their loader downloads OpenAI's weights
    backbone = OFFICIAL.fpbench_backbone("fpbench-peer-vit", path)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    return module, theirs, backbone, images


def fpbench_method(method: str, backbone: Any, dataset: str, **args: Any) -> Any:
    from fpbench.methods.base import TaskInfo
    from fpbench.registry import METHODS

    cls = METHODS.get(method)
    c = len(CLASSES)
    prior = torch.full((1, c), 1 / c)
    task = TaskInfo(c, 1, prior, torch.tensor([8]), tuple(CLASSES), dataset)
    return cls(cls.Config(**args), backbone, task)


def _cfg(dataset: str, **trainer: Any) -> NS:
    sections = {k: NS(**v) for k, v in trainer.items()}
    return NS(TRAINER=NS(**sections), INPUT=NS(SIZE=(32, 32)), DATASET=NS(NAME=dataset),
              MODEL=NS(BACKBONE=NS(NAME="fpbench-peer-vit"), INIT_WEIGHTS=""))  # fmt: skip


_diff = OFFICIAL._diff
LABELS = torch.tensor([0, 1, 2, 1])


def _features(backbone: Any, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return backbone.forward_features(images).cls


# -- zero-shot -----------------------------------------------------------------------------------


def zsclip_case(folder: Path, dataset: str = "oxford-pets") -> dict[str, float]:
    """CoOp's ZeroshotCLIP against fpbench's zero-shot: `logits` of the same images."""
    from fpbench.methods.base import Context

    zs, _, backbone, images = _setup("zsclip", "trainers.zsclip", folder)
    trainer = object.__new__(zs.ZeroshotCLIP)  # Dassl's TrainerX is a stand-in: no __init__
    trainer.cfg = _cfg(DATASETS[dataset])
    trainer.dm = NS(dataset=NS(classnames=CLASSES))
    trainer.device = "cpu"
    trainer.build_model()
    with torch.no_grad():
        theirs = trainer.model_inference(images)
    ours = fpbench_method("zero-shot", backbone, dataset)
    rows = torch.zeros(len(images), dtype=torch.long)
    logits = ours.forward({}, images, rows, Context(training=False))
    return {"logits": _diff(logits, theirs), "logits_max": float(theirs.abs().max())}


# -- KgCoOp --------------------------------------------------------------------------------------


def kgcoop_case(folder: Path, dataset: str = "oxford-pets", w: float = 8.0) -> dict[str, float]:
    """KgCoOp's CustomCLIP against fpbench's: `init` (the "a photo of a" context), `logits`,
    `score` (its 1 - mean cos against the hand-written prompt's features), `grad` (of
    CE + w * score on the context) and, for scale, `grad_max`."""
    from fpbench.methods.base import Context

    kg, theirs, backbone, images = _setup("kgcoop", "trainers.kgcoop", folder)
    cfg = _cfg(DATASETS[dataset], COOP={"N_CTX": 4, "CTX_INIT": True, "CSC": False,
               "CLASS_TOKEN_POSITION": "end", "W": w, "PREC": "fp32"},
               COCOOP={"PREC": "fp32"})  # fmt: skip
    with _cuda_is_identity():
        official = kg.CustomCLIP(cfg, CLASSES, theirs)
    ours = fpbench_method("kgcoop", backbone, dataset, w=w)
    start = ours.init_params(torch.Generator().manual_seed(0))["ctx"]
    out = {"init": _diff(start, official.prompt_learner.ctx)}
    logits_theirs, score = official(images)
    (F.cross_entropy(logits_theirs, LABELS) + w * score).backward()
    ctx = start.unsqueeze(0).clone().requires_grad_(True)
    rows = torch.zeros(len(LABELS), dtype=torch.long)
    res = ours.forward({"ctx": ctx}, images, rows, Context(training=True))
    (F.cross_entropy(res.logits, LABELS) + res.aux_loss.mean()).backward()
    grad = official.prompt_learner.ctx.grad
    out["logits"] = _diff(res.logits, logits_theirs)
    out["score"] = _diff(res.aux_loss[0] / w, score)
    out["grad"] = _diff(ctx.grad[0], grad)
    out["grad_max"] = float(grad.abs().max())
    return out


# -- CoCoOp --------------------------------------------------------------------------------------

META = {"meta_w1": "linear1.weight", "meta_b1": "linear1.bias", "meta_w2": "linear2.weight",
        "meta_b2": "linear2.bias"}  # fmt: skip


def cocoop_case(folder: Path, ctx_init: str = "a photo of a", meta_std: float | None = None,
                seed: int = 0) -> dict[str, float]:  # fmt: skip
    """CoOp's CoCoOp CustomCLIP against fpbench's, the meta-net weights copied across: `init`
    (the context), `logits`, `grad_<tensor>` (cross-entropy gradients of the context and the
    meta-net) and, for scale, `grad_max`; `meta_grad_min`: the smallest of the meta-net
    tensors' largest gradient (all four non-zero where it is).

    `meta_std`: the meta-net's four tensors drawn N(0, meta_std^2) (seeded) and set on both
    sides instead of the official init, so that every hidden unit is active for some image."""
    from fpbench.methods.base import Context

    co, theirs, backbone, images = _setup("cocoop", "trainers.cocoop", folder)
    cfg = _cfg("Caltech101", COCOOP={"N_CTX": 4, "CTX_INIT": ctx_init, "PREC": "fp32"})
    official = co.CustomCLIP(cfg, CLASSES, theirs)
    ours = fpbench_method("cocoop", backbone, "caltech101", ctx_init=ctx_init or None)
    start = ours.init_params(torch.Generator().manual_seed(0))
    out = {"init": _diff(start["ctx"], official.prompt_learner.ctx)} if ctx_init else {}
    meta = dict(official.prompt_learner.meta_net.named_parameters())
    if meta_std is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in meta.values():
                p.copy_(torch.randn(p.shape, generator=gen) * meta_std)
    params = {"ctx": official.prompt_learner.ctx.detach().clone()}
    params |= {k: meta[v].detach().clone() for k, v in META.items()}
    official.eval()  # its forward returns the loss in training mode, the logits in eval
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, LABELS).backward()
    leaves = {k: v.unsqueeze(0).requires_grad_(True) for k, v in params.items()}
    rows = torch.zeros(len(LABELS), dtype=torch.long)
    logits = ours.forward(leaves, images, rows, Context(training=True))
    F.cross_entropy(logits, LABELS).backward()
    out["logits"] = _diff(logits, logits_theirs)
    theirs_grads = {"ctx": official.prompt_learner.ctx.grad}
    theirs_grads |= {k: meta[v].grad for k, v in META.items()}
    for k, g in theirs_grads.items():
        out[f"grad_{k}"] = _diff(leaves[k].grad[0], g)
    out["grad_max"] = max(float(g.abs().max()) for g in theirs_grads.values())
    out["meta_grad_min"] = min(float(theirs_grads[k].abs().max()) for k in META)
    return out


# -- ProGrad -------------------------------------------------------------------------------------


def _prograd_step() -> Any:
    """Dassl.ProGrad's `SimpleTrainer.prograd_backward_and_update`, compiled from its source
    (its module imports the whole Dassl framework)."""
    path = PROGRAD / "Dassl.ProGrad.pytorch" / "dassl" / "engine" / "trainer.py"
    tree = ast.parse(path.read_text())
    name = "prograd_backward_and_update"
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module([fn], []), str(path), "exec"), namespace)
    return namespace["prograd_backward_and_update"]


class _Trainer:
    """What `prograd_backward_and_update` asks of its trainer: one model, an optimiser that
    leaves the projected gradient in place."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._models = {"prompt_learner": model}
        self._optims = {"prompt_learner": NS(zero_grad=model.zero_grad, step=lambda: None)}

    def model_zero_grad(self, names: Any = None) -> None:
        self._models["prompt_learner"].zero_grad()

    def get_model_names(self, names: Any = None) -> list[str]:
        return ["prompt_learner"]

    def detect_anomaly(self, loss: torch.Tensor) -> None:
        pass


def prograd_case(folder: Path, dataset: str = "oxford-pets", lam: float = 1.0,
                 t: float = 1.0, n_ctx: int = 16) -> dict[str, float]:  # fmt: skip
    """ProGrad's CustomCLIP, zero-shot CLIP, ProGradLoss and Dassl step against fpbench's loss
    hook: `init` (zeros, then the template's words), `logits`, `zero_shot` (the teacher's
    logits), `grad` (the projected gradient of the context) and, for scale, `grad_max`;
    `conflict` = 1 where the two gradients conflict (the projection ran)."""
    from fpbench.methods.base import Context, training_loss

    pg, theirs, backbone, images = _setup("prograd", "trainers.prograd", folder)
    cfg = _cfg(DATASETS[dataset], COOP={"N_CTX": n_ctx, "CTX_INIT": True, "CSC": False,
               "CLASS_TOKEN_POSITION": "end", "PREC": "fp32"})  # fmt: skip
    cfg.LOSS = NS(NAME="prograd", T=t, LAMBDA=lam)
    official = pg.CustomCLIP(cfg, CLASSES, theirs)
    teacher = pg.CLIP(cfg, CLASSES)
    ours = fpbench_method("prograd", backbone, dataset, n_ctx=n_ctx, lam=lam, temperature=t)
    start = ours.init_params(torch.Generator().manual_seed(0))["ctx"]
    out = {"init": _diff(start, official.prompt_learner.ctx)}
    logits_theirs = official(images)
    with torch.no_grad():
        zs_theirs = teacher(images)
    xe, kl = pg.ProGradLoss(T=t)(logits_theirs, zs_theirs, LABELS)
    g_ce = torch.autograd.grad(xe, official.prompt_learner.ctx, retain_graph=True)[0]
    g_kl = torch.autograd.grad(kl, official.prompt_learner.ctx, retain_graph=True)[0]
    out["conflict"] = float(torch.dot(g_ce.flatten(), g_kl.flatten()) < 0)
    _prograd_step()(_Trainer(official.prompt_learner), xe, kl, lam)
    grad = official.prompt_learner.ctx.grad
    ctx = start.unsqueeze(0).clone().requires_grad_(True)
    rows = torch.zeros(len(LABELS), dtype=torch.long)
    feats = _features(backbone, images)
    train = Context(training=True, labels=LABELS)
    loss, _ = training_loss(ours.forward({"ctx": ctx}, images, rows, train), LABELS)
    loss.mean().backward()
    logits = ours.forward({"ctx": ctx.detach()}, images, rows, Context(training=False))
    zs = (
        ours.backbone.logit_scale * F.normalize(feats, dim=-1) @ ours.zero_shot_text(feats.device).T
    )
    out["logits"] = _diff(logits, logits_theirs)
    out["zero_shot"] = _diff(zs, zs_theirs)
    out["grad"] = _diff(ctx.grad[0], grad)
    out["grad_max"] = float(grad.abs().max())
    return out


CASES = {
    "zsclip oxford-pets": ("zsclip", {}),
    "zsclip dtd": ("zsclip", {"dataset": "dtd"}),
    "kgcoop oxford-pets w 8": ("kgcoop", {}),
    "kgcoop dtd w 1": ("kgcoop", {"dataset": "dtd", "w": 1.0}),
    "cocoop 'a photo of a'": ("cocoop", {}),
    "cocoop random context": ("cocoop", {"ctx_init": ""}),
    "cocoop random meta-net N(0, 0.5^2)": ("cocoop", {"meta_std": 0.5}),
    "prograd oxford-pets": ("prograd", {}),
    "prograd caltech101 (no conflict)": ("prograd", {"dataset": "caltech101"}),
    "prograd dtd lambda 0.5 T 2": ("prograd", {"dataset": "dtd", "lam": 0.5, "t": 2.0}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    cases = {"zsclip": zsclip_case, "kgcoop": kgcoop_case, "cocoop": cocoop_case,
             "prograd": prograd_case}  # fmt: skip
    return cases[kind](folder, **args)


def main() -> None:
    print_cases(CASES, run, why_not, 40)


if __name__ == "__main__":
    main()
