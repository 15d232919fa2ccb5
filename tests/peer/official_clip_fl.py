#!/usr/bin/env python3
"""Differential checks of fpbench's federated CLIP prompt methods (issue #34) against their
official code, run unmodified from its checkout; the helpers (tiny random CLIP weights read by
both sides, Dassl stand-ins, isolated imports) are those of `official.py` beside this file.

Covered:
* FedPGP (TianyuCuiOvO/FedPGP, `trainers/fedpgp.py`, checked at d43045b): the official
  `CustomCLIP` and the official trainer's `forward_backward` (cross-entropy + mu * the
  contrastive term), on the same U, V, Sigma, class names and images; logits, loss and the
  gradients of U, V and Sigma.
* PromptFolio (PanBikang/PromptFolio, `trainers/PromptFolio.py`, checked at 8f729aa): the
  official `CustomCLIP` (two prompts, their features mixed by FRAC = theta) on the same global
  and local prompts; logits and the cross-entropy gradients of both. Only the class token at the
  end: the official middle / front branches build one of the two prompt sets and fail.
* FedTPG (boschresearch/FedTPG, `model/prompt_net.py` and `model/FedTPG.py`, checked at
  f141c29): the official prompt generator and CLIP encoders (`FedTPG.forward`'s computation,
  its `.cuda()` aside) on a tiny CLIP with ViT-B/16's text widths (the generator hard-codes
  512), every class seen (global) and a client's classes only (cross-entropy over them).
* DP-FPL (linhhtran/DP-FPL, `trainers/DP_FPL.py`, checked at cce74b4): the official
  `CustomCLIP` and trainer step `forward_pass` (factorisation "dpfpl") from the same random
  start v0, without privacy and with clipping (noise set to zero on both sides); logits, the
  global prompt's gradient and the local prompt's full gradient.
* FedCLIP (microsoft/PersonalizedFL, `fedclip/`, checked at 441670e): the official adapter
  (`nets/models.py` `ClipModelat.initdgatal`, its PyTorch init from the seeded global
  generator), the official `train` step (`methods/fed_at_clip.py`: CLIP's symmetric
  contrastive loss) and `test` (accuracy against the class prompts), with an open_clip model
  holding the same weights as fpbench's backbone. The official code imports OpenAI's `clip`
  package only to load a model and to tokenise; a stand-in provides open_clip's tokenizer (the
  same BPE). Class names are given to it with "_" read as a space, as fpbench does (the
  official code takes PACS's folder names, which have none).

Get the checkouts next to the repository (or set FPBENCH_PEER_FEDPGP, FPBENCH_PEER_FEDCLIP,
FPBENCH_PEER_PROMPTFOLIO, FPBENCH_PEER_FEDTPG, FPBENCH_PEER_DPFPL; FedTPG also needs
`pip install 'fpbench[peer]'`, for einops):

    git clone https://github.com/TianyuCuiOvO/FedPGP ../peer/FedPGP
    git clone https://github.com/boschresearch/FedTPG ../peer/FedTPG
    git clone https://github.com/linhhtran/DP-FPL ../peer/DP-FPL
    git clone https://github.com/PanBikang/PromptFolio ../peer/PromptFolio
    git clone https://github.com/microsoft/PersonalizedFL ../peer/PersonalizedFL

`python tests/peer/official_clip_fl.py` prints the largest differences of every case;
tests/test_peer_clip_fl.py asserts them.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # py, beside this file
from peer_harness import checkout, missing, print_cases, sibling  # noqa: E402

REF = sibling("official")
FEDPGP = checkout("FPBENCH_PEER_FEDPGP", "FedPGP")
FEDCLIP = checkout("FPBENCH_PEER_FEDCLIP", "PersonalizedFL")
PROMPTFOLIO = checkout("FPBENCH_PEER_PROMPTFOLIO", "PromptFolio")
FEDTPG = checkout("FPBENCH_PEER_FEDTPG", "FedTPG")
DPFPL = checkout("FPBENCH_PEER_DPFPL", "DP-FPL")
# FedTPG's generator hard-codes ViT-B/16's widths (512): a tiny CLIP with those text widths
WIDE = {
    "embed_dim": 512,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 64, "patch_size": 16, "head_width": 64},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 1},
}
VIT_NAME = "fpbench-peer-vit"


def _tensor_diffs(ours: dict, theirs: dict) -> dict[str, float]:
    return {k: REF._diff(ours[k], theirs[k]) for k in theirs}


# -- FedPGP --------------------------------------------------------------------------------------


def fedpgp_case(folder: Path, n_ctx: int = 4, bottleneck: int = 2, mu: float = 0.5,
                temp: float = 0.5, batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official FedPGP CustomCLIP and `forward_backward` against fpbench's `fedpgp` loss.

    Returns the largest absolute differences of `init` (the official N(0, 0.02^2) draws of U,
    V, Sigma from the seeded global generator against fpbench's from a seeded one), `logits`,
    `loss`, `grad_U`, `grad_V`, `grad_sigma` and, for scale, `grad_max`.
    """

    clip_model, pgp = REF.load_official(FEDPGP, "trainers.fedpgp", "Dassl.dassl")
    path, state = REF.weights(REF.VIT, VIT_NAME, folder)
    design = {"trainer": "FedPGP", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0}  # fmt: skip
    theirs = REF.official_clip(clip_model, state, design)
    cfg = REF._cfg("FEDPGP", 32, N_CTX=n_ctx, CTX_INIT="", CSC=False, CLASS_TOKEN_POSITION="end",
                 BOTTLENECK=bottleneck, N=1, PREC="fp32", mu=mu, temp=temp)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = pgp.CustomCLIP(cfg, REF.CLASSES, theirs)
    backbone = REF.fpbench_backbone(VIT_NAME, path)
    ours = REF.fpbench_method("fedpgp", backbone, n_ctx=n_ctx, bottleneck=bottleneck, mu=mu,
                            temp=temp)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)  # U (M, r), V (r, d), sigma (M, d)
    learner = official.prompt_learner
    init = max(REF._diff(start[k], getattr(learner, k)[0]) for k in ("U", "V", "sigma"))
    with torch.no_grad():
        for k in ("U", "V", "sigma"):
            getattr(learner, k).copy_(start[k].unsqueeze(0))  # the official (N = 1, ...)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.arange(batch) % len(REF.CLASSES)

    # the official trainer's step, its framework parts (TrainerX) supplied here
    losses: list[torch.Tensor] = []
    trainer = pgp.FedPGP.__new__(pgp.FedPGP)
    trainer.cfg, trainer.model, trainer.mu, trainer.temp = cfg, official, mu, temp
    trainer.device, trainer.batch_idx, trainer.num_batches = torch.device("cpu"), 0, 2
    trainer.model_backward_and_update = lambda loss: (losses.append(loss), loss.backward())
    pgp.compute_accuracy = lambda output, label: [torch.zeros(())]  # Dassl's metric, unused
    official.train()
    trainer.forward_backward({"img": images, "label": labels})
    with torch.no_grad():
        official.eval()
        logits_theirs = official(images)

    params, loss, logits_ours = REF._train_step(ours, start, images, labels)
    out = {"init": init, "logits": REF._diff(logits_ours, logits_theirs),
           "loss": REF._diff(loss, losses[0])}  # fmt: skip
    for k in ("U", "V", "sigma"):
        out[f"grad_{k}"] = REF._diff(params[k].grad[0], getattr(learner, k).grad[0])
    out["grad_max"] = max(float(getattr(learner, k).grad.abs().max()) for k in ("U", "V", "sigma"))
    return out


# -- PromptFolio --------------------------------------------------------------------------------


def promptfolio_case(folder: Path, n_ctx: int = 4, theta: float = 0.4, init: bool = False,
                     batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official PromptFolio CustomCLIP (N = 2 prompts, mixed by FRAC) against fpbench's
    `promptfolio` forward; cross-entropy on both sides.

    Returns the largest absolute differences of `init` (the official N(0, 0.02^2) draw of both
    prompts from the seeded global generator against fpbench's, or with `init` both prompts
    from the phrase "a photo of a"), `logits`, `grad_global`,
    `grad_local` and, for scale, `grad_max`.
    """
    from fpbench.methods.base import Context

    clip_model, folio = REF.load_official(PROMPTFOLIO, "trainers.PromptFolio", "Dassl.dassl")
    path, state = REF.weights(REF.VIT, VIT_NAME, folder)
    design = {"trainer": "PromptFL", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0}  # fmt: skip
    theirs = REF.official_clip(clip_model, state, design)
    phrase = "a photo of a" if init else ""
    cfg = REF._cfg("PLOT", 32, N_CTX=n_ctx, CTX_INIT=phrase, N=2, CLASS_TOKEN_POSITION="end",
                   PREC="fp32")  # fmt: skip
    cfg.TRAINER.PROMPTFL = types.SimpleNamespace(CSC=False, FRAC=theta)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = folio.CustomCLIP(cfg, REF.CLASSES, theirs)
    backbone = REF.fpbench_backbone(VIT_NAME, path)
    ours = REF.fpbench_method("promptfolio", backbone, n_ctx=n_ctx, theta=theta,
                              ctx_init=phrase or None)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    start = ours.init_params(gen)  # global_ctx, local_ctx (M, d)
    both = torch.stack([start["global_ctx"], start["local_ctx"]])
    learner = official.prompt_learner
    out = {"init": REF._diff(both, learner.ctx)}
    with torch.no_grad():
        learner.ctx.copy_(both)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.arange(batch) % len(REF.CLASSES)
    logits_theirs = official(images)
    F.cross_entropy(logits_theirs, labels).backward()
    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    rows = torch.zeros(batch, dtype=torch.long)
    logits_ours = ours.forward(params, images, rows, Context(training=True))
    F.cross_entropy(logits_ours, labels).backward()
    out["logits"] = REF._diff(logits_ours, logits_theirs)
    out["grad_global"] = REF._diff(params["global_ctx"].grad[0], learner.ctx.grad[0])
    out["grad_local"] = REF._diff(params["local_ctx"].grad[0], learner.ctx.grad[1])
    out["grad_max"] = float(learner.ctx.grad.abs().max())
    return out


# -- FedTPG -------------------------------------------------------------------------------------


def _fedtpg_params(meta_net: Any) -> dict[str, torch.Tensor]:
    """fpbench's parameter names for the official PromptTranslator's tensors."""
    attn_block, ff = meta_net.encoder.cross_attend_blocks
    attn = attn_block.fn
    q_w, k_w, v_w = attn.in_proj_weight.chunk(3)
    q_b, k_b, v_b = attn.in_proj_bias.chunk(3)
    net = ff.net
    return {
        "queries": meta_net.soft_prompt, "ln_q_w": attn_block.norm.weight,
        "ln_q_b": attn_block.norm.bias, "ln_kv_w": attn_block.norm_context.weight,
        "ln_kv_b": attn_block.norm_context.bias, "q_w": q_w, "k_w": k_w, "v_w": v_w,
        "q_b": q_b, "k_b": k_b, "v_b": v_b, "out_w": attn.out_proj.weight,
        "out_b": attn.out_proj.bias, "ff_ln_w": net[0].weight, "ff_ln_b": net[0].bias,
        "ff1_w": net[1].weight, "ff1_b": net[1].bias, "ff2_w": net[3].weight,
        "ff2_b": net[3].bias,
    }  # fmt: skip


def fedtpg_case(folder: Path, n_ctx: int = 4, subset: tuple[int, ...] = (0, 2), batch: int = 4,
                seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official FedTPG model (PromptTranslator + CLIP encoders, `forward`'s computation:
    its `.cuda()` line aside) against fpbench's `fedtpg`, in fp32 (the official casts the
    generator to fp16: here it is cast back).

    Global: every class's name seen by the generator, logits over all classes. Client: the
    generator sees only `subset`'s names and the cross-entropy is over them (the official
    client's local label space, labels relabelled); fpbench trains with that client's class
    priors. Returns the largest absolute differences of `init` (the official init, which the
    official then rounds to fp16, against fpbench's, rounded alike), `logits`, `loss_client`,
    `grad` (every generator tensor, client case) and, for scale, `grad_max`.
    """
    from fpbench.methods.base import Context, training_loss

    with REF._isolated(FEDTPG, {}, ("clip", "model")):
        clip_model = importlib.import_module("clip.model")
        tpg = importlib.import_module("model.FedTPG")
    path, state = REF.weights(WIDE, "fpbench-peer-wide", folder)
    theirs = REF.official_clip(clip_model, state)
    cfg = types.SimpleNamespace(MODEL=types.SimpleNamespace(N_CTX=n_ctx, D_CTX=1, DEPTH=0))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = tpg.FedTPG(cfg, theirs, device="cpu")
    official.prompt_learner.float()
    backbone = REF.fpbench_backbone("fpbench-peer-wide", path)
    ours = REF.fpbench_method("fedtpg", backbone, n_ctx=n_ctx)
    start = ours.init_params(torch.Generator().manual_seed(seed))
    mapped = _fedtpg_params(official.prompt_learner.meta_net)
    # the official generator is cast to fp16 after its init: fpbench's draws, so rounded
    out = {"init": max(REF._diff(start[k].half().float(), v) for k, v in mapped.items())}
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, 32, 32, generator=gen)

    def official_logits(names: list[str]) -> torch.Tensor:  # FedTPG.forward without .cuda()
        names = [n.replace("_", " ") for n in names]
        with torch.no_grad():
            ids = torch.cat([tpg.clip.tokenize(n) for n in names])
            emb = F.normalize(official.clip_model_.encode_text(ids), dim=-1)
        text, vis_ctx = official.encode_text(names, emb)
        img = F.normalize(official.encode_image(images, vis_ctx), dim=-1)
        return official.logit_scale.exp() * img @ F.normalize(text, dim=-1).t()

    params = {k: v.detach().unsqueeze(0).clone().requires_grad_(True) for k, v in mapped.items()}
    rows = torch.zeros(batch, dtype=torch.long)
    with torch.no_grad():
        glob = ours.forward(params, images, rows, Context(training=False))
        out["logits"] = REF._diff(glob, official_logits(REF.CLASSES))
    # one client holding `subset`: official relabelled local classes, fpbench's priors
    local = torch.tensor(subset)
    labels = local[torch.arange(batch) % len(subset)]
    loss_theirs = F.cross_entropy(
        official_logits([REF.CLASSES[c] for c in subset]), torch.arange(batch) % len(subset)
    )
    loss_theirs.backward()
    priors = torch.zeros(1, len(REF.CLASSES))
    priors[0, local] = 1.0 / len(subset)
    ctx = Context(training=True, labels=labels, priors=priors)
    loss = training_loss(ours.forward(params, images, rows, ctx), labels)[0].mean()
    loss.backward()
    out["loss_client"] = REF._diff(loss, loss_theirs)
    attn = official.prompt_learner.meta_net.encoder.cross_attend_blocks[0].fn
    grads = {k: v.grad for k, v in mapped.items() if v.is_leaf}
    for i, k in enumerate(("q", "k", "v")):  # the packed projection's gradient, in thirds
        grads[f"{k}_w"] = attn.in_proj_weight.grad.chunk(3)[i]
        grads[f"{k}_b"] = attn.in_proj_bias.grad.chunk(3)[i]
    out["grad"] = max(REF._diff(params[k].grad[0], g) for k, g in grads.items())
    out["grad_max"] = max(float(g.abs().max()) for g in grads.values())
    return out


# -- DP-FPL -------------------------------------------------------------------------------------


def dpfpl_case(folder: Path, n_ctx: int = 4, rank: int = 2, clip: float | None = None,
               batch: int = 4, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """The official DP-FPL CustomCLIP and trainer step (`forward_pass`, factorisation
    "dpfpl") against fpbench's `dp-fpl`, both factorising from the same random start v0.

    `clip`: privacy on with clipping norm `clip` and zero noise (the official std set to 0,
    fpbench's draws of noise replaced by zeros), so that the clipped gradients compare; None:
    no privacy. Returns the largest absolute differences of `init`, `logits`, `grad_global`,
    `grad_local` (the official full gradient) and, for scale, `grad_max`.
    """
    from fpbench.methods.base import Context, training_loss

    clip_model, dp = REF.load_official(DPFPL, "trainers.DP_FPL", "Dassl.dassl")
    path, state = REF.weights(REF.VIT, VIT_NAME, folder)
    design = {"trainer": "DP_FPL", "vision_depth": 0, "language_depth": 0, "vision_ctx": 0,
              "language_ctx": 0}  # fmt: skip
    theirs = REF.official_clip(clip_model, state, design)
    cfg = REF._cfg("DP_FPL", 32, N_CTX=n_ctx, PREC="fp32", CLASS_TOKEN_POSITION="end")
    cfg.FACTORIZATION, cfg.RANK = "dpfpl", rank
    cfg.NOISE, cfg.NORM_THRESH = (0.0, 10.0) if clip is None else (1.0, clip)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official = dp.CustomCLIP(cfg, REF.CLASSES, theirs)
    backbone = REF.fpbench_backbone(VIT_NAME, path)
    args = {} if clip is None else {"epsilon": 1.0, "clip": clip}
    ours = REF.fpbench_method("dp-fpl", backbone, n_ctx=n_ctx, rank=rank, **args)
    start = ours.init_params(torch.Generator().manual_seed(seed)).params
    learner = official.prompt_learner
    out = {"init": max(REF._diff(start[k], getattr(learner, k)) for k in start)}
    with torch.no_grad():
        for k, v in start.items():
            getattr(learner, k).copy_(v)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.arange(batch) % len(REF.CLASSES)
    d = backbone.ctx_dim
    with torch.random.fork_rng():  # the official start: torch.normal from the global generator
        torch.manual_seed(seed + 1)
        v0 = torch.normal(0, 1, size=(d, rank))

    trainer = dp.DP_FPL.__new__(dp.DP_FPL)
    trainer.cfg, trainer.model, trainer.dtype = cfg, official, torch.float32
    trainer.device, trainer.std = torch.device("cpu"), 0.0
    trainer.model_zero_grad = official.zero_grad
    trainer.model_backward = lambda loss: loss.backward()
    dp.compute_accuracy = lambda output, label: [torch.zeros(())]  # Dassl's metric, unused
    official.train()
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        trainer.forward_pass({"img": images, "label": labels})
    with torch.no_grad():
        logits_theirs = official(images)

    def draws(key: torch.Tensor, n: int, width: int) -> dict[str, torch.Tensor]:
        zeros = {"u": torch.zeros(n, rank), "v": torch.zeros(rank, width),
                 "global": torch.zeros(n, width)}  # fmt: skip
        return {"v0": v0, **({} if clip is None else zeros)}

    ours.draws = draws
    params = {k: v.unsqueeze(0).clone().requires_grad_(True) for k, v in start.items()}
    params["dp_key"] = torch.zeros(1, 3, dtype=torch.long)
    rows = torch.zeros(batch, dtype=torch.long)
    ctx = Context(training=True, labels=labels)
    training_loss(ours.forward(params, images, rows, ctx), labels)[0].mean().backward()
    with torch.no_grad():
        logits_ours = ours.forward(params, images, rows, ctx)
    out["logits"] = REF._diff(logits_ours, logits_theirs)
    out["grad_global"] = REF._diff(params["global_ctx"].grad[0], learner.global_ctx.grad)
    out["grad_local"] = REF._diff(params["local_ctx"].grad[0], learner.local_ctx.grad)
    out["grad_max"] = max(float(learner.global_ctx.grad.abs().max()),
                          float(learner.local_ctx.grad.abs().max()))  # fmt: skip
    return out


# -- FedCLIP -------------------------------------------------------------------------------------


def _clip_stub() -> types.ModuleType:
    """OpenAI's `clip` package as the FedCLIP code uses it: `tokenize` (open_clip's BPE)."""
    import open_clip

    tok = open_clip.get_tokenizer("ViT-B-16")
    mod = types.ModuleType("clip")
    mod.tokenize = lambda texts: tok(texts if isinstance(texts, list) else [texts])
    mod.load = None  # fpbench hands the official code its model instead
    return mod


def load_fedclip() -> Any:
    """The official `methods/fed_at_clip.py` module, imported unmodified."""
    root = FEDCLIP / "fedclip"
    packages = ("clip", "utils", "nets", "methods")
    before = list(sys.path)
    with REF._isolated(root, {"clip": _clip_stub()}, packages):
        module = importlib.import_module("methods.fed_at_clip")
    sys.path[:] = before  # the module appends its folder to sys.path
    return module


def fedclip_case(folder: Path, batch: int = 6, seed: int = 0) -> dict[str, float]:
    """The official FedCLIP adapter, train step and test against fpbench's `fedclip`.

    Returns the largest absolute differences of `init` (the official adapter's PyTorch init
    from the seeded global generator against fpbench's from a seeded generator), the
    gradients `grad_w1`, `grad_b1`, `grad_w2`, `grad_b2` of the contrastive loss, `acc` (test
    accuracy, official against fpbench's argmax of its logits) and, for scale, `grad_max`.
    """
    import open_clip

    from fpbench.methods.base import Context, training_loss

    fac = load_fedclip()
    path, state = REF.weights(REF.VIT, VIT_NAME, folder)
    model = open_clip.create_model(VIT_NAME, pretrained=None)
    model.load_state_dict(state)
    model.eval()
    backbone = REF.fpbench_backbone(VIT_NAME, path)
    ours = REF.fpbench_method("fedclip", backbone)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, 32, 32, generator=gen)
    labels = torch.tensor([0, 1, 2, 1, 0, 2])[:batch]
    names = [n.replace("_", " ") for n in REF.CLASSES]
    texts = ["a picture of a " + n for n in names]  # the official ImageTextData's prompts
    tokens = torch.cat([fac.clu.clip.tokenize(t) for t in texts])  # (C, 77)

    official = fac.ClipModelat.__new__(fac.ClipModelat)
    official.model, official.preprocess, official.device = model, None, "cpu"
    official.imgadpy = official.freezepy = True
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        official.initdgatal([(images, None, labels)])
    adapter = official.img_adap
    linears = {"w1": adapter[0].weight, "b1": adapter[0].bias,
               "w2": adapter[2].weight, "b2": adapter[2].bias}  # fmt: skip
    start = ours.init_params(torch.Generator().manual_seed(seed))
    out = {"init": max(REF._diff(start[k], v) for k, v in linears.items())}

    grads: dict[str, torch.Tensor] = {}

    class Recorder:  # the optimiser the official `train` steps: keeps the gradients
        def zero_grad(self) -> None:
            adapter.zero_grad()

        def step(self) -> None:
            grads.update({k: v.grad.clone() for k, v in linears.items()})

    loader = [(images, tokens[labels], labels)]
    fac.train(None, official, loader, Recorder(), "cpu")
    official.setselflabel(texts)
    # its text features default to device "cuda" (the caller cannot pass one): here the CPU
    fac.clu.get_text_features_list = functools.partial(fac.clu.get_text_features_list, device="cpu")
    acc_theirs = fac.test(None, official, [(images, tokens[labels], labels)], "cpu")

    params = {k: v.detach().unsqueeze(0).clone().requires_grad_(True) for k, v in linears.items()}
    rows = torch.zeros(batch, dtype=torch.long)
    train = Context(training=True, labels=labels)
    training_loss(ours.forward(params, images, rows, train), labels)[0].mean().backward()
    with torch.no_grad():
        logits = ours.forward(params, images, rows, Context(training=False))
    for k in linears:
        out[f"grad_{k}"] = REF._diff(params[k].grad[0], grads[k])
    out["grad_max"] = max(float(g.abs().max()) for g in grads.values())
    out["acc"] = abs(float((logits.argmax(-1) == labels).float().mean()) - float(acc_theirs))
    return out


CASES = {
    "fedpgp vit r2": ("fedpgp", {}),
    "fedpgp vit r4 mu 1": ("fedpgp", {"bottleneck": 4, "mu": 1.0, "n_ctx": 6}),
    "fedclip vit": ("fedclip", {}),
    "promptfolio vit": ("promptfolio", {}),
    "dp-fpl vit, no privacy": ("dpfpl", {}),
    "dp-fpl vit, clipped to 0.05": ("dpfpl", {"clip": 0.05}),
    "fedtpg vit, client of classes 0 2": ("fedtpg", {}),
    "fedtpg vit, client of classes 1 2, 6 tokens": ("fedtpg", {"subset": (1, 2), "n_ctx": 6}),
    # only "end": the official middle / front branches build one prompt set of the two and fail
    "promptfolio vit theta 0.8 'a photo of a'": ("promptfolio", {"theta": 0.8, "init": True}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    cases = {"fedpgp": fedpgp_case, "fedclip": fedclip_case, "promptfolio": promptfolio_case,
             "fedtpg": fedtpg_case, "dpfpl": dpfpl_case}  # fmt: skip
    return cases[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout is absent), or None."""
    if kind == "fedpgp":
        return missing(FEDPGP, "TianyuCuiOvO/FedPGP", "FPBENCH_PEER_FEDPGP")
    if kind == "fedtpg":
        if importlib.util.find_spec("einops") is None:
            return "the official FedTPG code imports einops: pip install 'fpbench[peer]'"
        return missing(FEDTPG, "boschresearch/FedTPG", "FPBENCH_PEER_FEDTPG",
                       "model/prompt_net.py", "clip")  # fmt: skip
    if kind == "dpfpl":
        return missing(DPFPL, "linhhtran/DP-FPL", "FPBENCH_PEER_DPFPL")
    if kind == "promptfolio":
        return missing(PROMPTFOLIO, "PanBikang/PromptFolio", "FPBENCH_PEER_PROMPTFOLIO")
    return missing(FEDCLIP, "microsoft/PersonalizedFL", "FPBENCH_PEER_FEDCLIP",
                   "fedclip/methods/fed_at_clip.py")  # fmt: skip


def main() -> None:
    print_cases(CASES, run, why_not, 24)


if __name__ == "__main__":
    main()
