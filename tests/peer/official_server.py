#!/usr/bin/env python3
"""Differential checks of fpbench's server steps (`Method.aggregate`) against each official
code's own, run from its checkout: a few clients of unequal train sizes, random trained tensors,
the official step and fpbench's on the same ones, and the new global state (and the clients'
kept rows) compared.

The official server steps live in training loops and trainer classes whose modules import far
more than the step needs (Dassl, prettytable, sklearn, datasets); each step here is its own
function or method, read from the checkout's file and compiled unmodified (`official_def`:
Python's `ast` finds the definition, nothing is copied), then called on the tensors, or on a
stand-in object holding just what the method reads. Where the step is a few lines inside a
`federated_main.py` loop (which tensors go to the server, which stay on the client), the
harness does what that loop does and names its lines.

Covered (each official code at the commit the README names):
* FedOTP (`utils/fed_utils.py` `average_weights`; `federated_main.py` 391-407): the first
  `avg_prompt` prompts averaged by train size, the rest kept on the client.
* FedPGP (`fed_utils.py` `average_weights`; `federated_main.py` 344-362): Sigma averaged by
  train size, U and V kept.
* PromptFolio (`trainers/PromptFolio.py` `fed_aggregate_model`, Dassl's `average_weights` in
  `Dassl/dassl/engine/trainer.py`): the global prompt (ctx[:1]) by train size.
* FedPHA (`utils/fed_utils.py` `average_weights`; `federated_main.py` 316-331, trainer
  GL_SVDMSE): ctx_global by train size, ctx_local kept.
* DP-FPL (`federated_main.py` 162-166: the clients' global gradients averaged uniformly, plus
  N(0, (std / N)^2); `trainers/DP_FPL.py` `backward_pass` and `build_model`'s std): one SGD step
  from the clients' clipped gradients without noise, and the noise's scale.
* pFedMoAP (`trainers/pfedmoap.py` `sparse_selection`, "nearest"; `utils/fed_utils.py`
  `average_weights`; `federated_main.py` 383-392): the contexts by train size, the gates kept
  from a client's second round, the experts each client gets, over two rounds.
* FedTPG, FedMVP (`federated/server.py` `Server.train`): the generator's tensors, the plain
  mean over the round's clients.
* FedCLIP (`fedclip/methods/fed_at_clip.py` `communication`): the adapter, weights 1 / K.
* SGPT (`utils.py` `aggregation_func` and `group_ratio_func`; `main_prompt.py` 179-187):
  head and shared prompts by train size, group prompts by train size then momentum, keys by
  the round's selection counts (uniform where a group's total is at most 50) then momentum.
* PromptSRC (`trainers/promptsrc.py` `build_model`'s Gaussian weights and `forward_backward`'s
  GPA over epochs): fpbench's server GPA over rounds, one round an epoch.

`python tests/peer/official_server.py` prints the largest differences of every case;
tests/test_peer_server.py asserts them.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import functools
import io
import json
import math
import sys
import types
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

if (_HERE := str(Path(__file__).resolve().parent)) not in sys.path:
    sys.path.append(_HERE)  # peer_harness.py, beside this file
from peer_harness import checkout, not_found, print_cases, sibling  # noqa: E402

REF = sibling("official")
NS = types.SimpleNamespace
REPOS = {  # kind: (checkout, GitHub repository, variable, the file holding the server step)
    "fedotp": (checkout("FPBENCH_PEER_FEDOTP", "FedOTP"), "HongxiaLee/FedOTP",
               "FPBENCH_PEER_FEDOTP", "utils/fed_utils.py"),
    "fedpgp": (checkout("FPBENCH_PEER_FEDPGP", "FedPGP"), "TianyuCuiOvO/FedPGP",
               "FPBENCH_PEER_FEDPGP", "fed_utils.py"),
    "promptfolio": (checkout("FPBENCH_PEER_PROMPTFOLIO", "PromptFolio"), "PanBikang/PromptFolio",
                    "FPBENCH_PEER_PROMPTFOLIO", "trainers/PromptFolio.py"),
    "fedpha": (checkout("FPBENCH_PEER_FEDPHA", "FedPHA"), "CYFang6/FedPHA",
               "FPBENCH_PEER_FEDPHA", "utils/fed_utils.py"),
    "dpfpl": (checkout("FPBENCH_PEER_DPFPL", "DP-FPL"), "linhhtran/DP-FPL",
              "FPBENCH_PEER_DPFPL", "trainers/DP_FPL.py"),
    "pfedmoap": (checkout("FPBENCH_PEER_PFEDMOAP", "pFedMoAP"), "ljaiverson/pFedMoAP",
                 "FPBENCH_PEER_PFEDMOAP", "trainers/pfedmoap.py"),
    "fedtpg": (checkout("FPBENCH_PEER_FEDTPG", "FedTPG"), "boschresearch/FedTPG",
               "FPBENCH_PEER_FEDTPG", "federated/server.py"),
    "fedmvp": (checkout("FPBENCH_PEER_FEDMVP", "FedMVP"), "mainaksingha01/FedMVP",
               "FPBENCH_PEER_FEDMVP", "federated/server.py"),
    "fedclip": (checkout("FPBENCH_PEER_FEDCLIP", "PersonalizedFL"), "microsoft/PersonalizedFL",
                "FPBENCH_PEER_FEDCLIP", "fedclip/methods/fed_at_clip.py"),
    "sgpt": (checkout("FPBENCH_PEER_SGPT", "SGPT"), "ubc-tea/SGPT", "FPBENCH_PEER_SGPT",
             "utils.py"),
    "promptsrc": (checkout("FPBENCH_PEER_PROMPTSRC", "PromptSRC"), "muzairkhattak/PromptSRC",
                  "FPBENCH_PEER_PROMPTSRC", "trainers/promptsrc.py"),
}  # fmt: skip
SIZES = torch.tensor([5, 17, 40, 11])  # the four clients' train sizes
ROUND = torch.tensor([2, 0, 3])  # this round's clients, in the order the server saw them
CLASSES = REF.CLASSES


def official_def(kind: str, name: str, owner: str | None = None, file: str | None = None,
                 **names: Any) -> Any:  # fmt: skip
    """The function `name` (a method of class `owner`) of the checkout's `file` (default the
    kind's), compiled unmodified from its source with `names` (and copy, torch, np) global."""
    root, *_, default = REPOS[kind]
    path = root / (file or default)
    with warnings.catch_warnings():  # the files' own invalid escapes, elsewhere in them
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        tree = ast.parse(path.read_text())
    scope = tree.body
    if owner is not None:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    space = {"copy": copy, "torch": torch, "np": np, "math": math, **names}
    exec(compile(ast.Module([node], []), str(path), "exec"), space)
    return space[name]


def _method(method: str, folder: Path, arch: tuple[dict, str] | None = None,
            dataset: str = "peer", **args: Any) -> Any:  # fmt: skip
    """fpbench's `method` on a tiny random CLIP (`arch`: its config and name), for the four
    clients of SIZES."""
    from fpbench.methods.base import TaskInfo
    from fpbench.registry import METHODS

    config, name = arch or (REF.VIT, "fpbench-peer-vit")
    path, _ = REF.weights(config, name, folder)
    backbone = REF.fpbench_backbone(name, path)
    cls, c, n = METHODS.get(method), len(CLASSES), len(SIZES)
    task = TaskInfo(c, n, torch.full((n, c), 1 / c), SIZES, tuple(CLASSES), dataset)
    return cls(cls.Config(**args), backbone, task)


def _round(ours: Any, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor]]:
    """The initial server state and random trained tensors (K, ...) of ROUND's clients, every
    tensor the clients train (global and personal)."""
    server = ours.init_server(torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 1)
    k = len(ROUND)
    trained = {n: torch.randn(k, *v.shape, generator=gen) for n, v in server.params.items()}
    trained |= {n: torch.randn(k, *v.shape[1:], generator=gen) for n, v in server.personal.items()}
    return server, trained


def _aggregate(ours: Any, server: Any, trained: dict, **stats: torch.Tensor) -> Any:
    """fpbench's server step on `trained`, weights the train sizes (train.aggregation_weights
    = "train_size", the default)."""
    from fpbench.methods.base import Updates

    return ours.aggregate(server, Updates(trained, ROUND, SIZES[ROUND].double(), stats))


def _kept(new: Any, server: Any, trained: dict, names: tuple[str, ...]) -> float:
    """Largest difference of the clients' kept rows from what the official loop keeps: a
    round's client its trained tensor, the others their old row."""
    worst = 0.0
    for n in names:
        want = server.personal[n].clone()
        want[ROUND] = trained[n]
        worst = max(worst, REF._diff(new.personal[n], want))
    return worst


def _spread(theirs: torch.Tensor, trained: torch.Tensor, weights: torch.Tensor) -> float:
    """How far the official result is from the other reading (`weights`, normalised, instead
    of the official ones): what the case can tell apart."""
    w = (weights / weights.sum()).to(trained.dtype).view(-1, *[1] * (trained.dim() - 1))
    return REF._diff(theirs, (w * trained).sum(0))


def _sized(kind: str, trained: torch.Tensor, file: str | None = None) -> torch.Tensor:
    """The official `average_weights(w, idxs_users, datanumber_client, islist=True)` on one
    tensor per client, indexed by client id as the official loops fill it."""
    average = official_def(kind, "average_weights", file=file)
    w: list[Any] = [[] for _ in SIZES]
    for j, i in enumerate(ROUND.tolist()):
        w[i] = trained[j].clone()
    return average(w, ROUND.tolist(), SIZES.tolist(), islist=True)


# -- the plain size-weighted averages ---------------------------------------------------------


def fedotp_case(folder: Path, n_ctx: int = 4) -> dict[str, float]:
    """FedOTP: ctx = [global, local] (the official `num_prompt` 2, `avg_prompt` 1); the server
    averages ctx[:1] by train size (`federated_main.py` 395-407)."""
    ours = _method("fedotp", folder, n_ctx=n_ctx)
    server, trained = _round(ours)
    new = _aggregate(ours, server, trained)
    ctx = torch.stack([trained["global_ctx"], trained["local_ctx"]], dim=1)  # (K, 2, n, d)
    theirs = _sized("fedotp", ctx[:, :1])
    uniform = _spread(theirs[0], trained["global_ctx"], torch.ones(len(ROUND)))
    return {"global": REF._diff(new.params["global_ctx"], theirs[0]),
            "kept": _kept(new, server, trained, ("local_ctx",)), "spread": uniform}  # fmt: skip


def fedpgp_case(folder: Path) -> dict[str, float]:
    """FedPGP: Sigma by train size, U and V kept (`federated_main.py` 344-362)."""
    ours = _method("fedpgp", folder, n_ctx=4, bottleneck=2)
    server, trained = _round(ours)
    new = _aggregate(ours, server, trained)
    theirs = _sized("fedpgp", trained["sigma"])
    return {"global": REF._diff(new.params["sigma"], theirs),
            "kept": _kept(new, server, trained, ("U", "V")),
            "spread": _spread(theirs, trained["sigma"], torch.ones(len(ROUND)))}  # fmt: skip


def fedpha_case(folder: Path) -> dict[str, float]:
    """FedPHA (GL_SVDMSE): ctx_global by train size, ctx_local kept (`federated_main.py`
    316-331)."""
    ours = _method("fedpha", folder, n_ctx=4)
    server, trained = _round(ours)
    new = _aggregate(ours, server, trained)
    glob = next(n for n in server.params)
    theirs = _sized("fedpha", trained[glob])
    return {"global": REF._diff(new.params[glob], theirs),
            "kept": _kept(new, server, trained, tuple(server.personal)),
            "spread": _spread(theirs, trained[glob], torch.ones(len(ROUND)))}  # fmt: skip


def promptfolio_case(folder: Path, order: tuple[int, ...] | None = None) -> dict[str, float]:
    """PromptFolio: the trainer's `fed_aggregate_model(idx_users)` on a stand-in trainer whose
    `local_info` holds each client's ctx = [global, local], its `average_weights` Dassl's.

    The official method lists the round's global prompts in the order of `idx_users` and hands
    that list to `average_weights`, which reads entry `idx_users[j]` of it for client
    `idx_users[j]`: the sizes meet their own clients only where `idx_users` is 0..K-1 in order
    (every client, sorted). `order`: the round's `idx_users` (default all four clients sorted);
    every client trains (random trained tensors for the fourth too)."""
    ours = _method("promptfolio", folder, n_ctx=4)
    ids = list(range(len(SIZES))) if order is None else list(order)
    server = ours.init_server(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    trained = {n: torch.randn(len(ids), *v.shape, generator=gen) for n, v in server.params.items()}
    trained |= {n: torch.randn(len(ids), *v.shape[1:], generator=gen)
                for n, v in server.personal.items()}  # fmt: skip
    from fpbench.methods.base import Updates

    at = torch.tensor(ids)
    new = ours.aggregate(server, Updates(trained, at, SIZES[at].double()))
    root = REPOS["promptfolio"][0]
    aggregate = official_def("promptfolio", "fed_aggregate_model", "PromptFolio")
    average = official_def("promptfolio", "average_weights", "SimpleTrainer",
                           file="Dassl/dassl/engine/trainer.py")  # fmt: skip
    assert (root / "Dassl/dassl/engine/trainer.py").is_file()
    trainer = NS(
        cfg=NS(DATASET=NS(USERS=len(SIZES))),
        fed_train_loader_x_dict={
            i: NS(dataset=range(int(s))) for i, s in enumerate(SIZES)
        },  # fmt: skip
        local_info={},
    )
    trainer.average_weights = types.MethodType(average, trainer)
    for j, i in enumerate(ids):
        ctx = torch.stack([trained["global_ctx"][j], trained["local_ctx"][j]])
        trainer.local_info[i] = {"prompt_learner.ctx": ctx}
    aggregate(trainer, ids)
    theirs = trainer.global_info[0]
    return {"global": REF._diff(new.params["global_ctx"], theirs),
            "spread": _spread(theirs, trained["global_ctx"], torch.ones(len(ids)))}  # fmt: skip


# -- DP-FPL: the averaged gradient step, and its noise ----------------------------------------


def dpfpl_case(folder: Path, clip: float = 0.05, lr: float = 0.1, eps: float = 0.4,
               draws: int = 400) -> dict[str, float]:  # fmt: skip
    """DP-FPL: the official server step (`federated_main.py` 162-166: the mean of the clients'
    global gradients over all N clients; `backward_pass` sets it as the gradient and steps) with
    SGD (no momentum) from global prompt g0, against fpbench's `aggregate` of the clients' one
    local SGD step each (the suites' `max_local_steps = 1`), noise off and clipping on (each
    client's gradient clipped to `clip` as the official `forward_pass` does, before either side).

    The noise: the official std (`build_model`, run on a stand-in trainer: sqrt(R ln(1/delta))
    / epsilon * C / B over the clients' largest batch B) over N is the server's noise; fpbench
    draws N(0, std^2 / N) on every client and averages them. Returns the largest differences of
    `global` and `kept`, `std_rel` (fpbench's std of the mean noise over the official one, minus
    1, analytic) and `draw_rel` (the same from `draws` seeded draws of each side, sampling error
    about 1 / sqrt(2 * draws * n_ctx * d))."""
    n = len(SIZES)
    ours = _method("dp-fpl", folder, n_ctx=4, rank=2, epsilon=eps, clip=clip, dp_batch=8)
    server, trained = _round(ours)
    gen = torch.Generator().manual_seed(5)
    g0 = server.params["global_ctx"]
    grads = torch.randn(n, *g0.shape, generator=gen) * torch.tensor([0.01, 1.0, 3.0, 0.02]).view(
        -1, 1, 1
    )
    clipped = grads * (clip / grads.flatten(1).norm(dim=1)).clamp(max=1).view(-1, 1, 1)
    # fpbench: every client steps alone; the round is all N clients (the suites' participation 1)
    from fpbench.methods.base import Updates

    everyone = torch.arange(n)
    trained = {"global_ctx": g0 - lr * clipped,
               "local_ctx": torch.randn(n, *g0.shape, generator=gen)}  # fmt: skip
    new = ours.aggregate(server, Updates(trained, everyone, SIZES.double()))
    # the official: the mean gradient (line 163) into backward_pass, one SGD step
    backward = official_def("dpfpl", "backward_pass", "DP_FPL")
    learner = torch.nn.Module()
    learner.global_ctx = torch.nn.Parameter(g0.clone())
    model = torch.nn.Module()
    model.prompt_learner = learner
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    trainer = NS(model=model, model_update=optim.step)
    avg = sum(clipped[i] for i in range(n)) / n  # federated_main.py 163, noise off (line 164)
    backward(trainer, avg)
    sized = _spread(learner.global_ctx, trained["global_ctx"], SIZES.double())
    out = {"global": REF._diff(new.params["global_ctx"], learner.global_ctx),
           "kept": REF._diff(new.personal["local_ctx"], trained["local_ctx"]),
           "spread": sized}  # fmt: skip
    # the noise's scale: the official build_model's std on a stand-in trainer
    build = official_def("dpfpl", "build_model", "DP_FPL", load_clip_to_cpu=lambda cfg: NS(
        float=lambda: None, dtype=torch.float32), CustomCLIP=lambda *a: model,
        load_pretrained_weights=None, build_optimizer=lambda *a: None,
        build_lr_scheduler=lambda *a: None)  # fmt: skip
    cfg = NS(TRAINER=NS(DP_FPL=NS(PREC="fp32")), MODEL=NS(INIT_WEIGHTS="", BACKBONE=NS(NAME="")),
             OPTIM=NS(ROUND=100), DATASET=NS(USERS=n), NOISE=eps, NORM_THRESH=clip)  # fmt: skip
    loaders = {i: NS(batch_size=b) for i, b in enumerate((8, 4, 8, 2))}
    official = NS(cfg=cfg, dm=NS(dataset=NS(classnames=CLASSES), fed_train_loader_x_dict=loaders),
                  device="cpu", register_model=lambda *a: None)  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        build(official)
    server_std = official.std / n  # federated_main.py 129
    out["std_rel"] = abs(ours.noise_std / math.sqrt(n) / math.sqrt(n) / server_std - 1)
    torch.manual_seed(0)
    theirs = torch.normal(0, server_std, size=(draws, *g0.shape))
    mine = []
    for r in range(draws):  # fpbench's per-client draws of round r, averaged over the N clients
        keys = torch.tensor([[7, i, r] for i in range(n)])
        mine.append(torch.stack([ours.draws(k, *g0.shape)["global"] for k in keys]).mean(0))
    out["draw_rel"] = abs(float(torch.stack(mine).std() / theirs.std()) - 1)
    out["draw_sigma"] = 1 / math.sqrt(2 * theirs.numel())
    return out


# -- pFedMoAP: the contexts' average and the experts ------------------------------------------


def pfedmoap_case(folder: Path, num_experts: int = 4) -> dict[str, float]:
    """pFedMoAP over two rounds (ROUND, then clients 0, 1, 3): the contexts by train size
    (`federated_main.py` 392), the gates (a client's trained gate is kept from its second
    round on, line 386: `local_gatings` is saved only where it uploaded before), and the
    experts each round's clients then get: the official `sparse_selection(idx, local_prompts,
    "nearest")` on a stand-in trainer with every client's last upload; with no more uploads
    than `num_experts` it returns every other uploader (in client order), which fpbench's
    nearest ones are then as a set.

    Returns `global` (both rounds), `spread`, `kept` (the gates, both rounds), `experts`
    (clients whose expert sets differ), `experts_n` (how many sets were compared) and `fails`:
    1 where the official selection raises with more uploads than experts (its `torch.topk` of
    a list), 0 where it returns."""
    from fpbench.methods.base import Updates

    ours = _method(
        "pfedmoap", folder, n_ctx=4, num_experts=num_experts, gating_embed_dim=8, gating_heads=2
    )
    select = official_def("pfedmoap", "sparse_selection", "PFEDMOAP")
    cached = official_def("pfedmoap", "_get_dist_from_cache", "PFEDMOAP")
    n = len(SIZES)

    def trainer(experts: int) -> Any:
        t = NS(num_experts=experts, shuffled_all_indices=list(range(n)),
               distance_cache={i: {j: None for j in range(n)} for i in range(n)})  # fmt: skip
        t.random_selection_condition = lambda i, cur, ctxs: i != cur and ctxs[i] != []
        t._get_dist_from_cache = types.MethodType(cached, t)
        return t

    server, trained = _round(ours)
    gen = torch.Generator().manual_seed(9)
    second = torch.tensor([0, 1, 3])
    rounds = [(ROUND, trained), (second, {k: torch.randn(v.shape, generator=gen)
                                          for k, v in trained.items()})]  # fmt: skip
    uploads: list[Any] = [[] for _ in range(n)]  # the official local_prompts
    gates = {k: v.clone() for k, v in server.personal.items()}  # the official's, per client
    out = {"global": 0.0, "kept": 0.0, "experts": 0.0, "experts_n": 0.0}
    average = official_def("pfedmoap", "average_weights", file="utils/fed_utils.py")
    for ids, tensors in rounds:
        new = ours.aggregate(server, Updates(tensors, ids, SIZES[ids].double()))
        for j, i in enumerate(ids.tolist()):  # the official loop's upload, lines 385-387
            if uploads[i] != []:
                for k in gates:
                    gates[k][i] = tensors[k][j]
            uploads[i] = tensors["ctx"][j]
        theirs = average(uploads, ids.tolist(), SIZES.tolist(), islist=True)
        out["global"] = max(out["global"], REF._diff(new.params["ctx"], theirs))
        out["kept"] = max(out["kept"], max(REF._diff(new.personal[k], g) for k, g in gates.items()))
        got, mask = ours.experts(new, ids, training=True)
        for j, i in enumerate(ids.tolist()):
            official = select(trainer(num_experts), i, uploads, "nearest")
            out["experts"] += set(official) != set(got[j][mask[j]].tolist())
        out["experts_n"] += len(ids)
        server = new
    out["spread"] = _spread(theirs, rounds[-1][1]["ctx"], torch.ones(len(second)))
    try:
        select(trainer(2), 0, uploads, "nearest")
        out["fails"] = 0.0
    except TypeError:
        out["fails"] = 1.0
    return out


# -- FedTPG and FedMVP: Server.train's plain mean ---------------------------------------------


def generator_case(folder: Path, kind: str = "fedtpg") -> dict[str, float]:
    """FedTPG / FedMVP: the official `Server.train` (one round, AVAIL_PERCENT 1: every client)
    on a stand-in server whose clients return the trained tensors as their `train` result;
    the global state is the new `meta_net_glob`."""
    from fpbench.methods.base import Updates

    if kind == "fedtpg":
        ours = _method("fedtpg", folder, (_sibling("official_clip_fl").WIDE,
                       "fpbench-peer-wide"), n_ctx=4)  # fmt: skip
    else:
        mvp = _sibling("official_fedmvp")
        (folder / "attributes").mkdir(exist_ok=True)
        (folder / "attributes" / "caltech101.json").write_text(json.dumps(mvp.DESCRIPTIONS))
        ours = _method("fedmvp", folder, (mvp.VIT, "fpbench-peer-fedmvp"), "caltech101",
                       attributes_dir=str(folder / "attributes"))  # fmt: skip
    server = ours.init_server(torch.Generator().manual_seed(0))
    n = len(SIZES)
    gen = torch.Generator().manual_seed(1)
    trained = {k: torch.randn(n, *v.shape, generator=gen) for k, v in server.params.items()}
    stats = {}
    if kind == "fedmvp":  # no client on LoRA nor switching to it this round (losses above the
        # threshold): the LoRA factors come back untrained, as the official clients' state
        from fpbench.methods.fedmvp import LORA

        stats = {"loss_sum": torch.full((n,), 1e3), "samples": torch.ones(n)}
        trained |= {k: server.params[k].expand(n, *server.params[k].shape).clone()
                    for k in LORA if k in server.params}  # fmt: skip
    new = ours.aggregate(server, Updates(trained, torch.arange(n), SIZES.double(), stats))
    train = official_def(kind, "train", "Server")
    learner = torch.nn.Module()
    for k, v in server.params.items():
        learner.register_parameter(k, torch.nn.Parameter(v.clone()))
    clients = [NS(load_meta=lambda state: None,
                  train=lambda epoch, i=i: {k: v[i].clone() for k, v in trained.items()})
               for i in range(n)]  # fmt: skip
    official = NS(before_train=lambda: None, after_train=lambda: None, start_epoch=0,
                  max_epoch=1, cfg=NS(TRAIN=NS(AVAIL_PERCENT=1.0)), clients=clients,
                  num_clients=n, model=NS(prompt_learner=learner))  # fmt: skip
    official.distribute = lambda idx: None
    state = np.random.get_state()  # its draw of the round's clients (all of them, some order)
    np.random.seed(0)
    try:
        train(official)
    finally:
        np.random.set_state(state)
    got = official.meta_net_glob.state_dict()
    k = next(k for k in server.params if not torch.equal(trained[k][0], trained[k][1]))
    return {
        "global": max(REF._diff(new.params[k], got[k]) for k in server.params),
        "spread": _spread(got[k], trained[k], SIZES.double()),
    }


@functools.cache
def _sibling(name: str) -> Any:
    """A sibling harness (its tiny CLIP configs), loaded once."""
    return sibling(name)


# -- FedCLIP: communication -------------------------------------------------------------------


def fedclip_case(folder: Path) -> dict[str, float]:
    """FedCLIP: the official `communication(args, server_model, models, client_weights)` with
    its `client_weights` (1 / K for each of the K training clients, `fed_at_clip.py` 159)."""
    ours = _method("fedclip", folder)
    n = len(SIZES)
    server = ours.init_server(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    trained = {k: torch.randn(n, *v.shape, generator=gen) for k, v in server.params.items()}
    from fpbench.methods.base import Updates

    new = ours.aggregate(server, Updates(trained, torch.arange(n), SIZES.double()))
    communication = official_def("fedclip", "communication")

    def model(i: int | None) -> Any:
        e, h = server.params["w1"].shape[1], server.params["w1"].shape[0]
        adapter = torch.nn.Sequential(torch.nn.Linear(e, h), torch.nn.Tanh(),
                                      torch.nn.Linear(h, e), torch.nn.Softmax(dim=1))  # fmt: skip
        if i is not None:
            with torch.no_grad():
                for mod, w, b in ((adapter[0], "w1", "b1"), (adapter[2], "w2", "b2")):
                    mod.weight.copy_(trained[w][i])
                    mod.bias.copy_(trained[b][i])
        return NS(img_adap=adapter)

    glob = model(None)
    communication(NS(test_envs=[]), glob, [model(i) for i in range(n)], [1 / n] * n)
    got = {"w1": glob.img_adap[0].weight, "b1": glob.img_adap[0].bias,
           "w2": glob.img_adap[2].weight, "b2": glob.img_adap[2].bias}  # fmt: skip
    return {
        "global": max(REF._diff(new.params[k], got[k]) for k in got),
        "spread": _spread(got["w1"], trained["w1"], SIZES.double()),
    }


# -- SGPT: shared and group prompts, keys -----------------------------------------------------


COUNTS = ((30, 2, 0, 9), (1, 40, 0, 3), (4, 25, 3, 60))  # group totals 35, 67, 3, 72


def sgpt_case(folder: Path, counts: tuple[tuple[int, ...], ...] = COUNTS, moment: float = 0.5,
              moment_p: float = 0.5) -> dict[str, float]:  # fmt: skip
    """SGPT: the official `aggregation_func(keys_dict, global_para, selected, fed_avg_freqs,
    group_ratio, args)` (its default branch, `all_moment` off) with `group_ratio_func` over the
    round's selection counts `counts` (one row per client of ROUND; a group's round total of
    at most 50 gives every client 1 / K) against fpbench's `aggregate` with those counts.

    Returns the largest differences of `head`, `shared` (shared prompts), `group` (group
    prompts) and `keys`."""
    from fpbench.backbones import create_backbone
    from fpbench.methods.base import TaskInfo
    from fpbench.registry import METHODS

    backbone = create_backbone("vit-ti16-d4", pretrained=False)
    layout = REF.SGPT_LAYOUT
    cls, c, n = METHODS.get("sgpt"), len(CLASSES), len(SIZES)
    task = TaskInfo(c, n, torch.full((n, c), 1 / c), SIZES, tuple(CLASSES), "peer")
    ours = cls(cls.Config(**layout, key_momentum=moment, group_momentum=moment_p), backbone, task)
    server, trained = _round(ours)
    select = torch.tensor(counts)
    new = _aggregate(ours, server, trained, select_counts=select)
    g, j = layout["num_groups"], len(layout["group_layers"])

    def para(t: dict[str, torch.Tensor], i: int | None) -> dict[str, torch.Tensor]:
        """The official state-dict entries (`head`, `prompt_common.l`,
        `prompt_embeddings.j.g` of shape (1, p, d), `prompt_keys`) of fpbench's tensors."""
        row = (lambda v: v) if i is None else (lambda v: v[i])
        out = {"head.weight": row(t["head_w"]).clone(), "head.bias": row(t["head_b"]).clone(),
               "prompt_keys": row(t["keys"]).clone()}  # fmt: skip
        for layer, p in enumerate(row(t["shared_prompts"])):
            out[f"prompt_common.{layer}"] = p.unsqueeze(0).clone()
        for gg in range(g):
            for jj in range(j):
                out[f"prompt_embeddings.{jj}.{gg}"] = row(t["group_prompts"])[gg, jj].clone()
        return out

    ratio_func = official_def("sgpt", "group_ratio_func")
    aggregation = official_def("sgpt", "aggregation_func")
    selected = ROUND.tolist()
    keys_dict = {r: para(trained, k) for k, r in enumerate(selected)}
    cluster = {r: {"cluster_size": dict(enumerate(select[k].tolist()))}
               for k, r in enumerate(selected)}  # fmt: skip
    total = sum(int(SIZES[r]) for r in selected)
    freqs = [int(SIZES[r]) / total for r in selected]  # main_prompt.py 179-180
    args = NS(all_moment=False, moment=moment, moment_p=moment_p)
    got = aggregation(keys_dict, para(server.params, None), selected, freqs,
                      ratio_func(cluster, selected), args)  # fmt: skip
    want = para(new.params, None)
    part = {"head": ("head.",), "shared": ("prompt_common",), "group": ("prompt_embeddings",),
            "keys": ("prompt_keys",)}  # fmt: skip
    out = {name: max(REF._diff(want[k], got[k]) for k in want if k.startswith(prefix))
           for name, prefix in part.items()}  # fmt: skip
    # what the keys' weights tell apart: the train sizes' FedAvg in their place
    w = (SIZES[ROUND] / SIZES[ROUND].sum()).view(-1, 1, 1)
    plain = moment * server.params["keys"] + (1 - moment) * (w * trained["keys"]).sum(0)
    out["spread"] = REF._diff(got["prompt_keys"], plain)
    return out


# -- PromptSRC: Gaussian-weighted prompt aggregation (GPA) --------------------------------------


def promptsrc_case(folder: Path, epochs: int = 6, mean: float = 4.0, std: float = 1.5,
                   clients: int = 2) -> dict[str, float]:  # fmt: skip
    """PromptSRC's GPA: the official trainer's `build_model` (its Gaussian weights over
    MAX_EPOCH = `epochs`) and `forward_backward` (its last batch of an epoch folds the model's
    state into `previous_model_gpa`; after the last epoch it loads it) on a stand-in model
    whose tensors are each round's FedAvg prompts, against fpbench's server GPA (the buffers
    `gpa_*` after `epochs` rounds of `clients` clients of unequal sizes, each round one epoch).
    Returns `gpa` (largest difference after the last round) and `spread` (against the plain
    mean of the rounds' prompts)."""
    from unittest import mock

    from fpbench.methods.base import Updates

    ours = _method("promptsrc", folder, prompt_depth_text=2, prompt_depth_vision=2,
                   gpa_mean=mean, gpa_std=std)  # fmt: skip
    server = ours.init_server(torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    ids, sizes = torch.arange(clients), SIZES[:clients].double()
    share = sizes / sizes.sum()

    def fedavg(t: torch.Tensor) -> torch.Tensor:  # a round's FedAvg of one tensor (K, ...)
        return (share.view(-1, *[1] * (t.dim() - 1)).to(t.dtype) * t).sum(0)

    shapes = {k: v.shape for k, v in server.params.items()}
    rounds = [{k: torch.randn(clients, *sh, generator=gen) for k, sh in shapes.items()}
              for _ in range(epochs)]  # fmt: skip
    for trained in rounds:
        server = ours.aggregate(server, Updates(trained, ids, sizes))

    class Standin(
        torch.nn.Module
    ):  # the model: the prompts, and the 7 outputs forward_backward reads
        def __init__(self) -> None:
            super().__init__()
            for k, sh in shapes.items():  # named so that build_model leaves them trainable
                self.register_parameter(f"prompt_learner_{k}", torch.nn.Parameter(torch.zeros(sh)))
            self.total_epochs = epochs

        def forward(self, image: torch.Tensor, label: torch.Tensor) -> tuple:
            x = sum(p.sum() for p in self.parameters()) * torch.ones(2, 3)
            return (x.sum() * 0, x, x.detach(), x.detach(), x, x.detach(), x)

    model = Standin()
    build = official_def("promptsrc", "build_model", "PromptSRC",
                         load_clip_to_cpu=lambda cfg: NS(float=lambda: None),
                         CustomCLIP=lambda *a: model, load_pretrained_weights=None,
                         build_optimizer=lambda *a: NS(zero_grad=lambda: None,
                                                       step=lambda: None),
                         build_lr_scheduler=lambda *a: None)  # fmt: skip
    step = official_def("promptsrc", "forward_backward", "PromptSRC", F=torch.nn.functional)
    cfg = NS(MODEL=NS(BACKBONE=NS(NAME=""), INIT_WEIGHTS=""), OPTIM=NS(MAX_EPOCH=epochs),
             TRAINER=NS(PROMPTSRC=NS(PREC="fp32", GPA_MEAN=mean, GPA_STD=std,
                                     TEXT_LOSS_WEIGHT=25, IMAGE_LOSS_WEIGHT=10)))  # fmt: skip
    trainer = NS(cfg=cfg, dm=NS(dataset=NS(classnames=CLASSES)), device="cpu",
                 register_model=lambda *a: None, previous_model_gpa=None, num_batches=1,
                 batch_idx=0, update_lr=lambda: None,
                 parse_batch_train=lambda batch: (batch["img"], batch["label"]))  # fmt: skip
    for name in ("state_dict_weighting", "state_dict_add", "get_gauss"):
        fn = official_def("promptsrc", name, "PromptSRC")
        setattr(trainer, name, types.MethodType(fn, trainer))
    same = lambda self, *a, **k: self  # noqa: E731  (its .cuda() calls, on the CPU)
    batch = {"img": torch.zeros(1), "label": torch.zeros(1, dtype=torch.long)}
    with contextlib.redirect_stdout(io.StringIO()), mock.patch.object(torch.Tensor, "cuda", same):
        build(trainer)
        for trained in rounds:
            with torch.no_grad():
                for k in shapes:
                    getattr(model, f"prompt_learner_{k}").copy_(
                        fedavg(trained[k])
                    )  # the round's FedAvg (both: train sizes)
            step(trainer, batch)
    got = {k: getattr(model, f"prompt_learner_{k}") for k in shapes}
    plain = {k: torch.stack([fedavg(t[k]) for t in rounds]).mean(0) for k in shapes}
    return {"gpa": max(REF._diff(server.buffers[f"gpa_{k}"], got[k]) for k in shapes),
            "spread": max(REF._diff(plain[k], got[k]) for k in shapes)}  # fmt: skip


CASES = {
    "fedotp, 3 of 4 clients": ("fedotp", {}),
    "fedpgp, 3 of 4 clients": ("fedpgp", {}),
    "fedpha, 3 of 4 clients": ("fedpha", {}),
    "promptfolio, every client in order": ("promptfolio", {}),
    "promptfolio, every client shuffled": ("promptfolio", {"order": (2, 0, 3, 1)}),
    "dp-fpl, clipped, noise scale": ("dpfpl", {}),
    "pfedmoap, 2 rounds, 4 experts": ("pfedmoap", {}),
    "fedtpg, every client": ("fedtpg", {}),
    "fedmvp, every client": ("fedmvp", {}),
    "fedclip, every client": ("fedclip", {}),
    "promptsrc GPA, 6 rounds": ("promptsrc", {}),
    "sgpt, 3 of 4 clients": ("sgpt", {}),
    "sgpt, 3 of 4 clients, no momentum": ("sgpt", {"moment": 0.0, "moment_p": 0.0}),
}


def run(name: str, folder: Path) -> dict[str, float]:
    kind, args = CASES[name]
    if kind in ("fedtpg", "fedmvp"):
        return generator_case(folder, kind)
    cases = {"fedotp": fedotp_case, "fedpgp": fedpgp_case, "fedpha": fedpha_case,
             "promptfolio": promptfolio_case, "dpfpl": dpfpl_case, "pfedmoap": pfedmoap_case,
             "fedclip": fedclip_case, "sgpt": sgpt_case,
             "promptsrc": promptsrc_case}  # fmt: skip
    return cases[kind](folder, **args)


def why_not(kind: str) -> str | None:
    """Why a kind of case cannot run here (its checkout or its server step's file is absent)."""
    root, repo, var, file = REPOS[kind]
    if not (root / file).is_file():
        return not_found(root, repo, var)
    return None


def main() -> None:
    print_cases(CASES, run, why_not, 36)


if __name__ == "__main__":
    main()
