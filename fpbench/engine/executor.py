"""Local training executors: reference (one client at a time) and lockstep (all together).

Both run the same function, `train_together`; they differ only in how many clients it trains at
once. Together, each local step draws one minibatch per client that still has one, concatenates
them, runs one forward and one backward, and minimises the sum over clients of each client's
mean loss, so every client's gradient is what it would be alone. `lockstep_samples` bounds the
samples of one forward: the step's client batches are cut into chunks of whole clients, each
chunk's backward adds to its clients' gradients, and one optimiser step follows. Each client's
batch order comes from its own generator, seeded by (seed, round, client, phase, epoch), so
training together never changes the data a client sees, and a resumed run replays exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from fpbench.backbones.recall import PhaseStates
from fpbench.engine.augment import draws_needed, uniforms
from fpbench.engine.inputs import Inputs
from fpbench.engine.optim import OptimizerGroup, make_optimizer
from fpbench.engine.precision import autocast, start_params
from fpbench.engine.seeding import client_batches, derive_seed
from fpbench.engine.task import Task
from fpbench.methods.base import Context, Method, Phase, ServerState, training_loss
from fpbench.packing import consecutive_chunks
from fpbench.specs import Augment, TrainConfig
from fpbench.strategies import Strategy


@dataclass
class LocalResult:
    """Trained parameters stacked (K, ...) in the order of `client_ids`, stats and losses."""

    client_ids: Tensor  # (K,)
    params: dict[str, Tensor]
    stats: dict[str, Tensor]
    loss: Tensor  # (K,) mean training loss of each client over its local steps
    lr_steps: Tensor | None = None  # (K,) the run's lr summed over each client's steps


def train_clients(
    method: Method,
    server: ServerState,
    task: Task,
    client_ids: list[int],
    cfg: TrainConfig,
    *,
    round_idx: int,
    seed: int,
    executor: str = "lockstep",
    inputs: Inputs | None = None,
    precision: str = "fp32",
    reuse_frozen: bool = True,
    strategy: Strategy | None = None,
    lockstep_samples: int | None = None,
) -> LocalResult:
    """Local training of this round's clients with the chosen executor.

    `strategy`: what a client adds to its loss (`Strategy.client_term`; None: nothing).

    `reuse_frozen=False` recomputes at every step the lower blocks that a phase does not train,
    instead of keeping their states for the phase (same result; for tests and the benchmark).
    """
    inputs = inputs or Inputs.of(method, task)
    if executor == "lockstep":
        passes = [client_ids]
    elif executor == "reference":
        passes = [[c] for c in client_ids]
    else:
        raise ValueError(f"unknown executor {executor!r}")
    results: list[LocalResult] = []
    earlier: dict[str, Tensor] = {}  # the stats of the passes trained so far, summed
    with autocast(task.priors.device, precision):
        for ids in passes:
            results.append(
                train_together(
                    method, server, task, inputs, ids, cfg,
                    round_idx=round_idx, seed=seed, earlier=earlier, reuse_frozen=reuse_frozen,
                    strategy=strategy, lockstep_samples=lockstep_samples,
                )
            )  # fmt: skip
            earlier = {k: earlier.get(k, 0) + v.sum(0) for k, v in results[-1].stats.items()}
    return concat_results(results)


def concat_results(results: list[LocalResult]) -> LocalResult:
    """Several passes' results as one, in order."""
    if len(results) == 1:
        return results[0]
    return LocalResult(
        client_ids=torch.cat([r.client_ids for r in results]),
        params={k: torch.cat([r.params[k] for r in results]) for k in results[0].params},
        stats={k: torch.cat([r.stats[k] for r in results]) for k in results[0].stats},
        loss=torch.cat([r.loss for r in results]),
        lr_steps=None
        if any(r.lr_steps is None for r in results)
        else torch.cat([r.lr_steps for r in results]),
    )


def round_lr(cfg: TrainConfig, round_idx: int) -> float:
    """The local lr of a round, constant within it.

    "exp": lr * lr_decay**round. "cosine": lr * (1 + cos(pi * round / rounds)) / 2, annealed
    once per round (PyTorch's CosineAnnealingLR stepped per round with T_max = rounds, as
    TPFL's "cosine scheduler, max_epoch 20" read as 20 global epochs), so a one-epoch round gets
    Dassl's per-epoch cosine; lr_decay is ignored. "cosine-local": lr in every round; within it
    `epoch_factor` anneals it over the local epochs (the PromptFL code's reading of max_epoch).
    """
    if cfg.lr_schedule == "cosine-local":
        return cfg.lr
    if cfg.lr_schedule == "cosine":
        return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * round_idx / cfg.rounds))
    return cfg.lr * cfg.lr_decay**round_idx


def epoch_factor(cfg: TrainConfig, epoch: int, epochs: int) -> float:
    """The lr factor of local epoch `epoch` of `epochs`: (1 + cos(pi * epoch / epochs)) / 2
    under "cosine-local" (Dassl's CosineAnnealingLR with T_max = MAX_EPOCH, stepped per epoch,
    as PromptFL's code counts MAX_EPOCH in local epochs), else 1."""
    if cfg.lr_schedule != "cosine-local":
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * epoch / epochs))


def train_together(
    method: Method,
    server: ServerState,
    task: Task,
    inputs: Inputs,
    client_ids: list[int],
    cfg: TrainConfig,
    *,
    round_idx: int,
    seed: int,
    earlier: dict[str, Tensor] | None = None,
    reuse_frozen: bool = True,
    strategy: Strategy | None = None,
    lockstep_samples: int | None = None,
) -> LocalResult:
    """Train K clients together: one forward/backward per step over all their minibatches
    (or per chunk of at most `lockstep_samples` of them, see `chunk_rows`).

    `earlier` holds the statistics of the clients trained before these in the same round,
    summed over them (empty in lockstep, where every client trains in one pass). A strategy's
    `client_term` is added to each client's loss in the backward pass only (the loss recorded is
    the learner's); its `client_step` follows each optimiser step.
    """
    device = task.priors.device
    ids = torch.tensor(client_ids, dtype=torch.long)
    k = len(client_ids)
    params = start_params(method, server, ids, device)
    priors = task.priors[ids.to(device)]
    stats: dict[str, Tensor] = {}  # what the forwards recorded, combined over the steps
    loss_sum = torch.zeros(k, device=device)
    loss_steps = torch.zeros(k, device=device)
    lr_steps = torch.zeros(k, device=device, dtype=torch.float64)
    budget = [cfg.max_local_steps] * k  # optimiser steps each client has left (None: no cap)
    lr = round_lr(cfg, round_idx)
    for phase_idx, phase in enumerate(method.phases(cfg.local_epochs, tuple(params))):
        ctx = Context(True, phase.name, None, priors, server.buffers, earlier or {})
        hidden = None  # the phase's kept hidden states (`fpbench.backbones.recall`)
        if reuse_frozen and not cfg.augment.active:
            rows = [task.train_idx[c].to(device) for c in client_ids]
            hidden = PhaseStates(rows, len(task.data.train_labels))
        leaves = {n: p.detach().requires_grad_(n in phase.trainable) for n, p in params.items()}
        opt = phase_optimizer(cfg, [leaves[n] for n in phase.trainable], phase, lr)
        for epoch in range(phase.epochs):
            factor = epoch_factor(cfg, epoch, phase.epochs)
            opt.scale_lr(factor)
            seeds = [derive_seed(seed, round_idx, c, phase_idx, epoch) for c in client_ids]
            cap = budget if phase.trainable else [None] * k  # scoring takes no optimiser step
            batches = [
                client_batches(task.train_idx[c], cfg.batch_size, seeds[row])[: cap[row]]
                for row, c in enumerate(client_ids)
            ]
            views = None
            if cfg.augment.active:  # each row's epoch seed, with a sample's index, fixes its view
                views = (cfg.augment, torch.tensor(seeds, device=device))
            if phase.trainable:
                budget = [
                    n if n is None else n - len(b) for n, b in zip(budget, batches, strict=True)
                ]
            for step in range(max(len(b) for b in batches)):
                active = torch.tensor([step < len(b) for b in batches], device=device)
                chunks = chunk_rows(batches, step, lockstep_samples)
                if phase.trainable:
                    opt.zero_grad()
                per_client = None
                for chunk in chunks:
                    with torch.enable_grad() if phase.trainable else torch.no_grad():
                        part = _step(
                            method, leaves, task, inputs, batches, step, ctx, k, stats, views,
                            hidden, chunk,
                        )  # fmt: skip
                    if len(chunks) > 1 and phase.trainable:  # free this chunk's activations
                        part.sum().backward()  # before the next chunk's forward
                        part = part.detach()
                    per_client = part if per_client is None else per_client + part
                if phase.trainable:  # a phase that trains nothing only scores its batches
                    objective = per_client if len(chunks) == 1 else 0  # not backpropagated yet
                    if strategy is not None:
                        term = strategy.client_term(server, ids.to(device), leaves)
                        if term is not None:
                            objective = objective + term * active
                    if isinstance(objective, Tensor):
                        objective.sum().backward()
                    opt.step(active)
                    if strategy is not None:
                        strategy.client_step(server, ids.to(device), leaves, lr * factor, active)
                    lr_steps += active * (lr * factor)
                loss_sum += per_client.detach()
                loss_steps += active
        params = {n: t.detach() for n, t in leaves.items()}
    return LocalResult(ids, params, stats, loss_sum / loss_steps.clamp(min=1), lr_steps)


def chunk_rows(batches: list[list[Tensor]], step: int, limit: int | None) -> list[list[int]]:
    """The rows with a batch at `step`, cut in order into chunks of whole clients holding at
    most `limit` samples each (a client's batch alone may hold more); None: one chunk."""
    rows = [row for row, b in enumerate(batches) if step < len(b)]
    if limit is None:
        return [rows]
    sizes = [len(batches[row][step]) for row in rows]
    return [[rows[i] for i in chunk] for chunk in consecutive_chunks(sizes, limit)]


def phase_optimizer(
    cfg: TrainConfig, tensors: list[Tensor], phase: Phase, lr: float
) -> OptimizerGroup:
    """The run's optimiser for a phase's tensors, plus one per tensor with its own settings
    (`Phase.optimizers`).

    A tensor's own lr is scaled by this round's schedule factor (lr / train.lr).
    """
    own = phase.optimizers
    shared = [t for n, t in zip(phase.trainable, tensors, strict=True) if n not in own]
    opts = []
    if shared:
        opts.append(
            make_optimizer(
                cfg.optimizer,
                shared,
                lr=lr,
                momentum=cfg.momentum,
                weight_decay=cfg.weight_decay,
                grad_clip=cfg.grad_clip,
                beta2=cfg.adam_beta2,
                eps=cfg.adam_eps,
            )
        )
    factor = lr / cfg.lr
    for name, t in zip(phase.trainable, tensors, strict=True):
        if name in own:
            s = own[name]
            opts.append(
                make_optimizer(
                    s["optimizer"],
                    [t],
                    lr=s["lr"] * factor,
                    momentum=s.get("momentum", 0.0),
                    weight_decay=s.get("weight_decay", 0.0),
                    grad_clip=cfg.grad_clip,
                )
            )
    return OptimizerGroup(opts)


def _step(
    method: Method,
    leaves: dict[str, Tensor],
    task: Task,
    inputs: Inputs,
    batches: list[list[Tensor]],
    step: int,
    ctx: Context,
    k: int,
    stats: dict[str, Tensor],
    views: tuple[Augment, Tensor] | None = None,
    hidden: PhaseStates | None = None,
    only: list[int] | None = None,
) -> Tensor:
    """Per-client mean loss (K,) of one lockstep minibatch (`training_loss` of the forward's
    result) over the rows `only` (None: every row with a batch); zero for the other clients.
    The statistics the forward returns are added to `stats` (see `record`).

    `views`: the augmentation and each row's epoch seed (K,), which with a sample's index fixes
    its random view (see `fpbench.engine.augment`). Without one, the backbone recalls frozen
    work and, given `hidden`, the phase's kept states (`fpbench.backbones.recall`).
    """
    chosen = range(len(batches)) if only is None else only
    parts = [(row, batches[row][step]) for row in chosen if step < len(batches[row])]
    idx = torch.cat([b for _, b in parts])
    rows = torch.cat([torch.full((len(b),), row, dtype=torch.long) for row, b in parts])
    rows = rows.to(idx.device)
    labels = task.data.train_labels[idx]
    ctx = replace(ctx, labels=labels)
    if views is None:
        x = inputs.train(idx)
        with inputs.recall(x, "train", idx, rows, hidden):
            per_sample, recorded = training_loss(method.forward(leaves, x, rows, ctx), labels)
    else:
        cfg, seeds = views
        u = uniforms(seeds[rows], idx, draws_needed(cfg))  # seeds (K,)
        x = inputs.train(idx, augmentation=(cfg, u))
        per_sample, recorded = training_loss(method.forward(leaves, x, rows, ctx), labels)
    record(stats, recorded)
    counts = torch.zeros(k, device=idx.device).index_add_(0, rows, torch.ones_like(per_sample))
    sums = torch.zeros(k, device=idx.device, dtype=per_sample.dtype).index_add(0, rows, per_sample)
    return sums / counts.clamp(min=1)


def record(stats: dict[str, Tensor], recorded: Mapping[str, Tensor]) -> None:
    """Add one step's statistics (`Output.stats`) to the round's: summed, `max_*` maximised."""
    for name, value in recorded.items():
        value = value.detach()
        old = stats.get(name)
        if old is None:
            stats[name] = value
        elif name.startswith("max_"):
            stats[name] = torch.maximum(old, value)
        else:
            stats[name] = old + value
