#!/usr/bin/env python3
"""Differential checks of fpbench against the official code, run unmodified from its checkout.

Covered: CoOp's prompt learner (KaiyangZhou/CoOp, `trainers/coop.py`: PromptFL's and the CLIP
methods' text prompts), FedOTP (HongxiaLee/FedOTP, `trainers/GLP_OT.py`: global + local
prompts matched to image patches by unbalanced optimal transport), SGPT (ubc-tea/SGPT,
`models/vit_models_pr.py`: both phases of a round and test time, see `sgpt_case`) and FedPR's
optimiser (chunmeifeng/FedPR, `util/adam_svd.py`, see `fedpr_case`). Both CLIP sides get the
same
random CLIP weights (one open_clip state dict, read by fpbench through `open_clip:<config>` and
by the official code's own `clip.model.build_model`), the same context vectors, class names and
preprocessed images; the logits, the gradients of the cross-entropy with respect to the context
and FedOTP's transport plans are compared in fp32 (plans also in fp64).

The official modules are imported by path from the checkouts (never copied into fpbench); the
trainer framework they import (Dassl) is replaced by empty stand-ins, since only their model
classes run. Get the checkouts next to the repository (or set FPBENCH_PEER_COOP,
FPBENCH_PEER_FEDOTP, FPBENCH_PEER_SGPT, FPBENCH_PEER_FEDPR):

    git clone https://github.com/KaiyangZhou/CoOp ../peer/CoOp
    git clone https://github.com/HongxiaLee/FedOTP ../peer/FedOTP
    git clone https://github.com/ubc-tea/SGPT ../peer/SGPT   # + pip install 'fpbench[peer]'
    git clone https://github.com/chunmeifeng/FedPR ../peer/FedPR

`python tests/peer/official.py` prints the largest differences of every case (a case whose
checkout is absent prints why); tests/test_peer_official.py asserts them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import HOW, PEER, REPO, checkout, missing, print_cases  # noqa: E402, F401

COOP = checkout("FPBENCH_PEER_COOP", "CoOp")
FEDOTP = checkout("FPBENCH_PEER_FEDOTP", "FedOTP")
# CoOp at ff61507, FedOTP at 9948611 were the checkouts these checks were written against

# Tiny CLIPs whose heads are 64 wide, as the official build_model infers them (width // 64)
VIT = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 16, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2},
}
RN = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 1, "layers": 2},
}
CLASSES = ["golden_retriever", "tabby cat", "airplane"]
_PACKAGES = ("clip", "trainers", "dassl", "Dassl")


# -- the official code, imported by path ---------------------------------------------------------


def _dassl_stubs(root: str) -> dict[str, types.ModuleType]:
    """Empty stand-ins for the Dassl modules the official trainers import (`root`: its package
    path, "dassl" for CoOp, "Dassl.dassl" for FedOTP's vendored copy)."""
    parts = root.split(".")
    mods = {
        ".".join(parts[: i + 1]): types.ModuleType(".".join(parts[: i + 1]))
        for i in range(len(parts))
    }
    registry = NS(register=lambda *a, **k: lambda cls: cls)
    leaves = {
        "engine": {"TRAINER_REGISTRY": registry, "TrainerX": object},
        "engine.trainer": {"TrainerX": object},
        "metrics": {"compute_accuracy": None},
        "utils": {"load_pretrained_weights": None, "load_checkpoint": None},
        "optim": {"build_optimizer": None, "build_lr_scheduler": None},
    }
    for name, attrs in leaves.items():
        mod = types.ModuleType(f"{root}.{name}")
        mod.__dict__.update(attrs)
        mods[f"{root}.{name}"] = mod
    mods[f"{root}.engine"].trainer = mods[f"{root}.engine.trainer"]
    return mods


@contextlib.contextmanager
def _isolated(
    repo: Path, stubs: dict[str, types.ModuleType], packages: tuple[str, ...] = _PACKAGES
) -> Iterator[None]:
    """Import from `repo` with its own top-level packages; restore sys.modules after."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in packages}
    for k in saved:
        del sys.modules[k]
    sys.modules.update(stubs)
    sys.path.insert(0, str(repo))
    try:
        yield
    finally:
        sys.path.remove(str(repo))
        for k in [k for k in sys.modules if k.split(".")[0] in packages]:
            del sys.modules[k]
        sys.modules.update(saved)


def load_official(repo: Path, trainer: str, dassl: str) -> tuple[Any, Any]:
    """(clip.model module, trainer module) of an official checkout, imported unmodified."""
    with _isolated(repo, _dassl_stubs(dassl)):
        return importlib.import_module("clip.model"), importlib.import_module(trainer)


# -- one set of weights for both sides -----------------------------------------------------------


def weights(arch: dict, name: str, folder: Path, seed: int = 0) -> tuple[Path, dict]:
    """Random open_clip weights of config `arch` registered as `name`, saved under `folder`."""
    import open_clip

    cfg = folder / f"{name}.json"
    cfg.write_text(json.dumps(arch))
    if open_clip.get_model_config(name) != arch:  # new, or the name held another config
        open_clip.add_model_config(cfg)
    with torch.random.fork_rng():  # leaves the caller's global generator as it was
        torch.manual_seed(seed)
        model = open_clip.create_model(name, pretrained=None)
    state = model.state_dict()
    path = folder / f"{name}.pth"
    torch.save(state, path)
    return path, state


def official_clip(clip_model: Any, state: dict, *build_args: Any) -> Any:
    """The official `build_model` on the state dict, in fp32 with the exact fp32 weights (its
    build casts to fp16; the trainers call `.float()` for fp32, and reloading restores the bits
    that the fp16 round trip lost)."""
    model = clip_model.build_model({k: v.clone() for k, v in state.items()}, *build_args).float()
    model.load_state_dict(state)
    return model.eval()


def fpbench_backbone(name: str, path: Path) -> Any:
    from fpbench.backbones import create_backbone

    return create_backbone(f"open_clip:{name}", weights=path)


def fpbench_method(method: str, backbone: Any, **args: Any) -> Any:
    from fpbench.methods.base import TaskInfo
    from fpbench.registry import METHODS

    cls = METHODS.get(method)
    c = len(CLASSES)
    task = TaskInfo(c, 1, torch.full((1, c), 1 / c), torch.tensor([8]), tuple(CLASSES), "peer")
    return cls(cls.Config(**args), backbone, task)


def _cfg(section: str, size: int, **trainer: Any) -> NS:
    return NS(TRAINER=NS(**{section: NS(**trainer)}), INPUT=NS(SIZE=(size, size)),
              DATASET=NS(NAME="peer"))  # fmt: skip


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def _train_step(
    ours: Any, start: dict[str, torch.Tensor], images: torch.Tensor, labels: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """fpbench's side of a one-client step from `start`: (its leaves, their gradients set; the
    mean training loss; the evaluation logits)."""
    from fpbench.methods.base import Context, training_loss

    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    rows = torch.zeros(len(images), dtype=torch.long)
    train = Context(training=True, labels=labels)
    loss = training_loss(ours.forward(params, images, rows, train), labels)[0].mean()
    loss.backward()
    with torch.no_grad():
        logits = ours.forward(params, images, rows, Context(training=False))
    return params, loss, logits


# -- CoOp ----------------------------------------------------------------------------------------


def coop_case(folder: Path, position: str = "end", csc: bool = False, ctx_init: str = "",
              n_ctx: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """CoOp's CustomCLIP against fpbench's PromptFL forward on one set of inputs.

    Returns the largest absolute differences: `init` (the initial context: CoOp's N(0, 0.02^2)
    draw from the same seed, or the embeddings of `ctx_init`),
    `eot` (where each class prompt ends, which the text encoder pools: fpbench tokenises "X..X
    name." whatever the init, CoOp the init phrase, of the same length), `logits` and `grad`
    (cross-entropy gradient of the context), and for scale `grad_max`.
    """
    from fpbench.methods.base import Context

    clip_model, coop = load_official(COOP, "trainers.coop", "dassl")
    path, state = weights(VIT, "fpbench-peer-vit", folder)
    theirs = official_clip(clip_model, state)
    cfg = _cfg("COOP", 32, N_CTX=n_ctx, CTX_INIT=ctx_init, CSC=csc, CLASS_TOKEN_POSITION=position)
    with torch.random.fork_rng():  # the official random init draws from the global generator
        torch.manual_seed(seed)
        official = coop.CustomCLIP(cfg, CLASSES, theirs)
    backbone = fpbench_backbone("fpbench-peer-vit", path)
    ours = fpbench_method("promptfl", backbone, n_ctx=n_ctx, class_token_position=position,
                          csc=csc, ctx_init=ctx_init or None)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_context(gen)  # (M, d) or (C, M, d)
    out = {"init": _diff(start, official.prompt_learner.ctx)}
    eot = ours.layout(ours.n_ctx).ids.argmax(-1)
    out["eot"] = _diff(eot, official.tokenized_prompts.argmax(-1))
    with torch.no_grad():
        official.prompt_learner.ctx.copy_(start)
    images = torch.randn(4, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 1, 2, 1])
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, labels).backward()
    ctx = start.unsqueeze(0).clone().requires_grad_(True)  # (K = 1, ...)
    rows = torch.zeros(len(labels), dtype=torch.long)
    logits_ours = ours.forward({"ctx": ctx}, images, rows, Context(training=True))
    F.cross_entropy(logits_ours, labels).backward()
    out["logits"] = _diff(logits_ours, logits_theirs)
    out["grad"] = _diff(ctx.grad[0], official.prompt_learner.ctx.grad)
    out["grad_max"] = float(official.prompt_learner.ctx.grad.abs().max())
    return out


# -- FedOTP --------------------------------------------------------------------------------------


def fedotp_case(folder: Path, arch: str = "vit", eps: float = 0.1, thresh: float = 0.0,
                ot: str = "cot", n_ctx: int = 4, batch: int = 3, seed: int = 0,
                forward: bool = True) -> dict[str, float]:  # fmt: skip
    """FedOTP's CustomCLIP (GLP_OT) against fpbench's FedOTP forward on one set of inputs.

    `thresh = 0` runs every solve for max_iter iterations on both sides (the official code stops
    when the mean change over the whole batch converges, fpbench per (image, class) problem, a
    declared deviation). Returns the largest absolute differences of `init` (the two prompts'
    N(0, 0.02^2) draws from the same seed), `logits`, `grad_global`,
    `grad_local` and `plan` (the official solver and fpbench's on the same similarities, in
    fp64) and, for scale, `grad_max` and `plan_max`. `forward = False` compares the plans only
    and reports `official_none` = 1 where the official fp32 forward returns None (its kernel
    exp(-(1 - S) / eps) underflows to a NaN plan, as at eps = 0.01 here; fpbench solves the plan
    in fp64, a declared deviation).
    """
    from fpbench.methods.base import Context
    from fpbench.methods.fedotp import transport_plan

    clip_model, glp = load_official(FEDOTP, "trainers.GLP_OT", "Dassl.dassl")
    spec, size = (VIT, 32) if arch == "vit" else (RN, 64)
    name = f"fpbench-peer-{arch}"
    path, state = weights(spec, name, folder)
    design = {"trainer": "GLP_OT", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0}  # fmt: skip
    theirs = official_clip(clip_model, state, design)
    top = {"cot": "COT", "sinkhorn": "Sinkhorn"}[ot]
    cfg = _cfg("GLP_OT", size, N_CTX=n_ctx, CTX_INIT="", CSC=False, CLASS_TOKEN_POSITION="end",
               N=2, EPS=eps, THRESH=thresh, OT=top, TOP_PERCENT=0.8, MAX_ITER=100)  # fmt: skip
    with torch.random.fork_rng():  # the official random init draws from the global generator
        torch.manual_seed(seed)
        official = glp.CustomCLIP(cfg, CLASSES, theirs)
    backbone = fpbench_backbone(name, path)
    ours = fpbench_method("fedotp", backbone, n_ctx=n_ctx, eps=eps, thresh=max(thresh, 1e-300),
                          ot=ot, rho=0.8, max_iter=100)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)  # global_ctx, local_ctx (M, d) each
    init = _diff(
        torch.stack([start["global_ctx"], start["local_ctx"]]), official.prompt_learner.ctx
    )
    with torch.no_grad():
        official.prompt_learner.ctx.copy_(torch.stack([start["global_ctx"], start["local_ctx"]]))
    images = torch.randn(batch, 3, size, size, generator=gen)
    labels = torch.arange(batch) % len(CLASSES)
    logits_theirs = official(images)
    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    out: dict[str, float] = {"init": init}
    if not forward:
        out["official_none"] = float(logits_theirs is None)
    elif logits_theirs is None:
        raise ValueError("the official forward returned None (a NaN in its transport plan)")
    else:
        F.cross_entropy(logits_theirs, labels).backward()
        rows = torch.zeros(batch, dtype=torch.long)
        logits_ours = ours.forward(params, images, rows, Context(training=True))
        F.cross_entropy(logits_ours, labels).backward()
        grad = official.prompt_learner.ctx.grad
        out["logits"] = _diff(logits_ours, logits_theirs)
        out["grad_global"] = _diff(params["global_ctx"].grad[0], grad[0])
        out["grad_local"] = _diff(params["local_ctx"].grad[0], grad[1])
        out["grad_max"] = float(grad.abs().max())
    # the plans of the same similarities (fpbench's layout: (B, C, M, N)), both in fp64
    with torch.no_grad():
        prompts = (params["global_ctx"], params["local_ctx"])
        text = torch.stack([ours.text_features(p) for p in prompts], dim=1)[0]  # (N, C, E)
        local = F.normalize(backbone.encode_image_tokens(images)[:, 1:].float(), dim=-1)
        sim = torch.einsum("bme,nce->bcmn", local, text).double()  # (B, C, M, N)
        mine = transport_plan(sim, 0.8, eps, max(thresh, 1e-300), 100, ot != "cot")
        b, c, m, n = sim.shape
        kern = torch.exp(-(1.0 - sim) / eps).reshape(b * c, m, n)
        a = torch.full((b * c, m), 1.0 / m, dtype=torch.float64)
        if ot == "cot":
            v = torch.full((b * c, n), 0.8 / n, dtype=torch.float64)
            plan = official.entropic_COT_fast(a, v, kern, 0.01, numItermax=100)
        else:
            plan = official.Sinkhorn(kern, a, torch.full((b * c, n), 1.0 / n, dtype=torch.float64))
    out["plan"] = _diff(mine.reshape(b * c, m, n), plan)
    out["plan_max"] = float(plan.abs().max())
    return out


# -- SGPT ----------------------------------------------------------------------------------------

SGPT = checkout("FPBENCH_PEER_SGPT", "SGPT")
FAKE_NPZ = REPO.parent / "shared" / "peer-sgpt" / "make_fake_vit_npz.py"  # the steering repo's
SGPT_VIT = {"hidden": 192, "heads": 3, "mlp": 768, "layers": 4, "patch": 16}  # vit-ti16-d4
SGPT_LAYOUT = {"num_groups": 4, "shared_layers": (0, 1), "group_layers": (2, 3)}


def sgpt_missing() -> str | None:
    """A line saying what is absent for the SGPT case, or None."""
    if line := missing(SGPT, "ubc-tea/SGPT", "FPBENCH_PEER_SGPT", "models/vit_models_pr.py"):
        return line
    if not FAKE_NPZ.is_file():
        return f"needs the steering repo's {FAKE_NPZ} (random Google-layout ViT weights)"
    if importlib.util.find_spec("ml_collections") is None:
        return "the official SGPT code imports ml_collections: pip install 'fpbench[peer]'"
    return None


def sgpt_case(folder: Path, counts: tuple[int, ...] = (5, 1, 0, 3), batch: int = 6,
              seed: int = 0) -> dict[str, float]:  # fmt: skip
    """SGPT's VisionTransformer_m (models/vit_models_pr.py) against fpbench's SGPT forward, in
    both phases of a round (shared: head + shared prompts, no selection; group: selection with
    the accumulated counts `counts`, group prompts, keys and head, CE + key loss) and at test
    time, on the same random ViT (one Google-layout .npz, read by the official `load_from` and
    by fpbench through timm), prompts, keys, head and images.

    Returns the largest absolute differences of each phase's `logits`, the gradients of every
    tensor the phase trains, and `select` (samples whose chosen group differs, training and
    test), with `grad_max` for scale and `groups_train` / `groups_test`, how many distinct
    groups the batch spreads over.
    """
    import subprocess

    import numpy as np

    from fpbench.backbones import create_backbone
    from fpbench.methods.base import Context, TaskInfo
    from fpbench.registry import METHODS

    npz = folder / "vit.npz"
    if not npz.is_file():
        flags = [f"--{k}={v}" for k, v in SGPT_VIT.items()]
        cmd = [sys.executable, "-B", str(FAKE_NPZ), "--out", str(npz), *flags]
        subprocess.run(cmd, check=True, capture_output=True)
    with _isolated(SGPT, {}, ("models",)):
        configs = importlib.import_module("models.configs")
        vit = importlib.import_module("models.vit_models_pr")
    cfg = configs.get_b16_config()
    cfg.hidden_size = SGPT_VIT["hidden"]
    cfg.patches.size = (SGPT_VIT["patch"],) * 2
    cfg.transformer.num_heads = SGPT_VIT["heads"]
    cfg.transformer.mlp_dim = SGPT_VIT["mlp"]
    cfg.transformer.num_layers = SGPT_VIT["layers"]
    groups = SGPT_LAYOUT["num_groups"]
    args = NS(key_prompt=groups, share_blocks=list(SGPT_LAYOUT["shared_layers"]),
              share_blocks_g=list(SGPT_LAYOUT["group_layers"]), n_prompt=1,
              dataset="cifar100", device="cpu", domain_query=False)  # fmt: skip
    c = len(CLASSES)
    with torch.random.fork_rng():  # its own inits draw from the global generator
        official = vit.VisionTransformer_m(cfg, 224, num_classes=c, args=args)
    official.load_from(np.load(npz))
    official.freeze()

    backbone = create_backbone("vit-ti16-d4", weights=npz)
    cls = METHODS.get("sgpt")
    task = TaskInfo(c, 1, torch.full((1, c), 1 / c), torch.tensor([8]), tuple(CLASSES), "peer")
    ours = cls(cls.Config(**SGPT_LAYOUT), backbone, task)
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen).params
    start["shared_prompts"] = torch.randn(start["shared_prompts"].shape, generator=gen) * 0.1
    images = torch.randn(batch, 3, 224, 224, generator=gen)
    images = images * torch.linspace(0.5, 2.0, batch).view(-1, 1, 1, 1)  # samples far apart
    # keys near the first samples' queries, so that Select spreads the batch over the groups
    near = ours.query(images[:groups])
    start["keys"] = near + 0.05 * torch.randn(near.shape, generator=gen)
    with torch.no_grad():  # the same tensors into the official model's parameters
        for i, p in enumerate(official.prompt_common):
            p.copy_(start["shared_prompts"][i].unsqueeze(0))
        for j in range(len(SGPT_LAYOUT["group_layers"])):
            for g, p in enumerate(official.prompt_embeddings[str(j)]):
                p.copy_(start["group_prompts"][g, j].unsqueeze(0))
        official.prompt_keys.copy_(start["keys"])
        official.head.weight.copy_(start["head_w"])
        official.head.bias.copy_(start["head_b"])
    theirs = dict(official.named_parameters())
    names = {"shared_prompts": [f"prompt_common.{i}" for i in range(2)],
             "head_w": ["head.weight"], "head_b": ["head.bias"], "keys": ["prompt_keys"],
             "group_prompts": [f"prompt_embeddings.{j}.{g}" for g in range(groups)
                               for j in range(2)]}  # fmt: skip

    def official_grad(name: str) -> torch.Tensor:
        grads = [theirs[n].grad for n in names[name]]
        if name == "shared_prompts":
            return torch.cat(grads)  # (2, 1, d)
        if name == "group_prompts":
            return torch.cat(grads).view(groups, 2, 1, -1)
        return grads[0]

    labels = torch.arange(batch) % c
    rows = torch.zeros(batch, dtype=torch.long)
    buffers = {"select_counts": torch.tensor(counts)}
    out: dict[str, float] = {"grad_max": 0.0}
    for phase, trained in (("shared", ("shared_prompts", "head_w", "head_b")),
                           ("group", ("group_prompts", "keys", "head_w", "head_b"))):  # fmt: skip
        official.zero_grad()
        official.train()
        official.selection = phase == "group"
        official.cluster_size_g = dict(enumerate(counts))
        result = official(images)
        loss = F.cross_entropy(result["logits"], labels)
        if phase == "group":
            loss = loss + result["reduced_sim"]
        loss.backward()
        params = {k: v.unsqueeze(0).clone().requires_grad_(k in trained) for k, v in start.items()}
        ctx = Context(training=True, phase=phase, buffers=buffers)
        mine = ours.forward(params, images, rows, ctx)
        loss = F.cross_entropy(mine.logits, labels)
        if mine.aux_loss is not None:
            loss = loss + mine.aux_loss.mean()
        loss.backward()
        out[f"{phase} logits"] = _diff(mine.logits, result["logits"])
        for name in trained:
            theirs_grad = official_grad(name)
            out[f"{phase} grad {name}"] = _diff(params[name].grad[0], theirs_grad)
            out["grad_max"] = max(out["grad_max"], float(theirs_grad.abs().max()))
    # the groups Select picks: training (with the counts) and test (nearest key)
    with torch.no_grad():
        query = official.forward_g(official.transformer.embeddings(images))["out_x"]
        params = {k: v.unsqueeze(0) for k, v in start.items()}
        for training in (True, False):
            official.train(training)
            picked, _, _ = official.clusters_g(query)
            ctx = Context(training=training, phase="group", buffers=buffers)
            mine, _ = ours.select_groups(params["keys"], images, rows, ctx)
            which = "train" if training else "test"
            out[f"select {which}"] = float((mine != picked[:, 0]).sum())
            out[f"groups_{which}"] = float(len(set(mine.tolist())))
        official.eval()
        official.selection = True
        logits = official(images)["logits"]
        mine = ours.forward(params, images, rows, Context(training=False))
        out["test logits"] = _diff(mine.logits, logits)
    return out


# -- FedPR ---------------------------------------------------------------------------------------

FEDPR = checkout("FPBENCH_PEER_FEDPR", "FedPR")


def fedpr_missing() -> str | None:
    return missing(FEDPR, "chunmeifeng/FedPR", "FPBENCH_PEER_FEDPR", "util/adam_svd.py")


def fedpr_case(folder: Path, eps: float = 1e-8, steps: int = 3, layers: int = 2,
               tokens: int = 4, dim: int = 16, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """FedPR's AdamSVD (util/adam_svd.py: Adam whose every update is projected onto the null
    space of the global prompts) against fpbench's FedPR path on the same prompts and gradients.

    The official optimiser takes `steps` steps on the prompts P (L, p, d) after its
    `get_eigens` / `get_transforms` on the global prompts; fpbench trains the unprojected update
    Z with its Adam (the engine's `make_optimizer("adam")`) and uses P + project(Z). With
    p = `tokens` >= the dropped floor(0.2 d) directions the dropped subspace lies in the
    prompts' row space and the projector is unique (with p = 1, as the suites run, it also
    drops an arbitrary basis of the null space, LAPACK's choice on both sides). Returns the
    largest absolute differences of the `projector` and of the `prompts` after the steps, and
    for scale `step_max` (the largest change of a prompt entry).
    """
    from fpbench.engine.optim import make_optimizer
    from fpbench.methods.fedpr import null_space_projector, project, project_straight_through

    with _isolated(FEDPR, {}, ("util",)):
        adam_svd = importlib.import_module("util.adam_svd")
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randn(layers, tokens, dim, generator=gen)  # the global prompts
    grads = [torch.randn(layers, tokens, dim, generator=gen) * 0.01 for _ in range(steps)]

    theirs = prompts.clone().requires_grad_(True)
    opt = adam_svd.AdamSVD([{"params": [theirs], "svd": True, "thres": 600.0}], lr=0.1, eps=eps,
                           ratio=0.8)  # fmt: skip
    theirs.grad = torch.zeros_like(theirs)  # get_eigens / get_transforms skip grad-less tensors
    opt.get_eigens({0: torch.bmm(prompts.transpose(1, 2), prompts)})
    opt.get_transforms()
    for g in grads:
        theirs.grad = g.clone()
        opt.step()

    proj = null_space_projector(prompts, keep_ratio=0.8)
    update = torch.zeros(1, layers, tokens, dim, requires_grad=True)  # (K = 1, L, p, d)
    ours = make_optimizer("adam", [update], lr=0.1, momentum=0.9, weight_decay=0.0,
                          grad_clip=None)  # fmt: skip
    ours.eps = eps
    for g in grads:  # the gradient reaches the update straight through the projection
        ours.zero_grad()
        (project_straight_through(update, proj) * g.unsqueeze(0)).sum().backward()
        ours.step(torch.ones(1, dtype=torch.bool))
    mine = prompts + project(update.detach(), proj)[0]
    return {
        "projector": _diff(proj, opt.transforms[theirs]),
        "prompts": _diff(mine, theirs),
        "step_max": float((theirs.detach() - prompts).abs().max()),
    }


CASES = {
    **{f"coop {p}": ("coop", {"position": p}) for p in ("end", "middle", "front")},
    "coop end csc": ("coop", {"csc": True}),
    "coop 'a photo of a'": ("coop", {"ctx_init": "a photo of a"}),
    "fedotp vit cot eps 0.1": ("fedotp", {"eps": 0.1}),
    "fedotp vit cot eps 0.01 (plans)": ("fedotp", {"eps": 0.01, "forward": False}),
    "fedotp vit sinkhorn": ("fedotp", {"ot": "sinkhorn"}),
    "fedotp rn cot eps 0.1": ("fedotp", {"arch": "rn", "eps": 0.1}),
    "fedotp vit cot stop 1e-3": ("fedotp", {"eps": 0.1, "thresh": 1e-3}),
    "sgpt both phases, counts 5 1 0 3": ("sgpt", {}),
    "sgpt both phases, no counts yet": ("sgpt", {"counts": (0, 0, 0, 0)}),
    "fedpr adam-svd, eps 0": ("fedpr", {"eps": 0.0}),
    "fedpr adam-svd, eps 1e-8": ("fedpr", {}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    cases = {"coop": coop_case, "fedotp": fedotp_case, "sgpt": sgpt_case, "fedpr": fedpr_case}
    return cases[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout or a dependency is absent), or None."""
    if kind == "sgpt":
        return sgpt_missing()
    if kind == "fedpr":
        return fedpr_missing()
    if kind == "coop":
        return missing(COOP, "KaiyangZhou/CoOp", "FPBENCH_PEER_COOP")
    return missing(FEDOTP, "HongxiaLee/FedOTP", "FPBENCH_PEER_FEDOTP")


def main() -> None:
    print_cases(CASES, run, why_not, 40)


if __name__ == "__main__":
    main()
