"""The round loop of one cell: sampling, local training, aggregation, evaluation, and a
checkpoint and stored rows after every round."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.cell import Cell
from fpbench.engine.cost import count_flops
from fpbench.engine.eval_modes import derived
from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import LocalResult, concat_results, train_clients
from fpbench.engine.inputs import Inputs
from fpbench.engine.metrics import (
    EvalCounts,
    MetricRow,
    aggregates,
    client_rows,
    domain_accuracies,
    params_trainable,
    summary,
)
from fpbench.engine.observer import Observer
from fpbench.engine.populations import (
    Population,
    client_profiles,
    merge_counts,
    pack,
    participants,
    share,
    start_shared,
    unpack,
)
from fpbench.engine.seeding import derive_seed
from fpbench.engine.task import Task
from fpbench.errors import FpbenchError
from fpbench.methods.base import ServerState, Updates
from fpbench.specs import RunConfig, TrainConfig
from fpbench.store import Store


class NonFiniteLoss(RuntimeError):
    """Local training produced a NaN or infinite loss: the cell fails (its error is stored)."""


def should_eval(r: int, train: TrainConfig) -> bool:
    return (
        (r + 1) % train.eval_every == 0
        or r >= train.rounds - train.eval_last
        or r == train.rounds - 1
    )


def run_rounds(
    cell: Cell,
    store: Store,
    run_id: int,
    checkpoint_dir: Path,
    observer: Observer,
    owner: str | None = None,
) -> float:
    """The round loop, from the last checkpoint on; returns the run's total training time.

    The first round played while the run has no FLOPs stored is counted (`fpbench.engine.cost`;
    the counter's overhead is in that round's `wall_s`). `checkpoint_dir`: this database's
    checkpoint folder (`checkpoint.folder_for`).
    """
    cfg, device = cell.cfg, cell.device
    path = ckpt_io.checkpoint_path(checkpoint_dir, cfg.run_key)
    bound_to = ckpt_io.binding(store.database_id, run_id)
    check_centralized(cfg, cell.populations)
    ckpt = ckpt_io.load(path, cfg.run_key, device, bound_to)
    if ckpt is None:
        servers = {
            pop.key: pop.method.init_server(
                torch.Generator().manual_seed(derive_seed(cfg.seed, "init-params"))
            ).to(device)
            for pop in cell.populations
        }
        if _sharing(cfg):
            servers = start_shared(servers)
        ckpt = ckpt_io.Checkpoint(cfg.run_key, -1, pack(servers), [], 0.0)
    store.truncate_after(run_id, ckpt.round)
    observer.cell_start(cfg, ckpt.round + 1)
    count = store.get_run(run_id).round_flops is None
    for r in range(ckpt.round + 1, cfg.train.rounds):
        start = time.perf_counter()
        with count_flops() if count else nullcontext() as flops:
            server, rows, scalars = play_round(cell, ckpt.server, r, ckpt.history)
        wall = time.perf_counter() - start
        store.write_round(run_id, r, wall_s=wall, metrics=rows, owner=owner, **scalars)
        if flops is not None:
            store.record_cost(run_id, round_flops=flops.total, owner=owner)
            count = False
        ckpt = ckpt_io.Checkpoint(cfg.run_key, r, server, ckpt.history, ckpt.elapsed_s + wall)
        ckpt_io.save(path, ckpt, bound_to)
        evaluated = should_eval(r, cfg.train)
        metrics = {**ckpt.history[-1], "loss_train": scalars["loss_train"]} if evaluated else {}
        observer.round_end(cfg, r, metrics)
    return ckpt.elapsed_s


def _sharing(cfg: RunConfig) -> bool:
    return cfg.model_het is not None and cfg.model_het.share == "shared"


def play_round(cell: Cell, server: ServerState, r: int, history: list[dict[str, float]]):
    """Round r of the cell's schedule: local training, aggregation, evaluation; returns the
    server state, the rows to store and the round's scalars."""
    cfg, task, device, populations = cell.cfg, cell.task, cell.device, cell.populations
    client_ids = cell.schedule[r]
    servers = unpack(server, [pop.key for pop in populations])
    losses, weight, up, down = [], {}, 0, 0
    central = cfg.train.centralized
    train_task, train_ids = (pooled(task, client_ids), [0]) if central else (task, client_ids)
    for pop in populations:
        local = _train_population(
            cell, pop, servers[pop.key], train_task, r, train_ids, len(client_ids)
        )
        if local is None:
            weight[pop.key] = 0.0
            continue
        weights = train_task.aggregation_weights[local.client_ids].to(device)
        if not cfg.train.centralized:  # the centralized reference communicates nothing
            d, u = pop.strategy.communication(pop.method, servers[pop.key])
            down, up = down + _nbytes(d) * len(weights), up + _nbytes(u) * len(weights)
        updates = Updates(local.params, local.client_ids.to(device), weights, local.stats)
        servers[pop.key] = pop.strategy.aggregate(
            pop.method, servers[pop.key], updates, local.lr_steps
        )
        losses.append(local.loss)
        weight[pop.key] = float(weights.sum())
    if _sharing(cfg):
        servers = share(servers, weight)
    loss_all = torch.cat(losses)
    loss = float(loss_all.mean())
    if not torch.isfinite(loss_all).all():
        raise NonFiniteLoss(
            f"training loss is {loss} (not finite) after local training in round {r}; "
            "lower train.lr or set train.grad_clip"
        )
    rows = [(None, "loss_train", loss, len(client_ids))]
    for pop in populations:
        suffix = f"@{pop.key}" if len(populations) > 1 else ""
        metrics = pop.method.round_metrics(servers[pop.key], view_of_test(task, pop.inputs))
        rows += [(None, f"{k}{suffix}", v, None) for k, v in metrics.items()]
    if r == 0:  # a property of the method, stored once (the largest over backbones)
        count = max(params_trainable(s.params, s.personal) for s in servers.values())
        rows.append((None, "params_trainable", count, None))
    if should_eval(r, cfg.train):
        rows += evaluate_populations(cell, servers, history, r, cell.seen(r))
    return pack(servers), rows, {"loss_train": loss, "bytes_up": up, "bytes_down": down}


def view_of_test(
    task: Task, inputs: Inputs
) -> Callable[[Callable[[Tensor], Tensor]], tuple[Tensor, Tensor]] | None:
    """What `Method.round_metrics` may read of the test split: fn's outputs over its images
    and its labels; None where the split is empty."""
    labels = task.data.test_labels
    if not len(labels):
        return None
    return lambda fn: (inputs.test_map(fn), labels)


def _train_population(
    cell: Cell,
    population: Population,
    server: ServerState,
    task: Task,
    r: int,
    client_ids: list[int],
    sampled: int = 1,
) -> LocalResult | None:
    """Local training of this round's clients of one population, cohort by cohort (None: none).

    Under `train.centralized`, `task` is the `pooled` one and its client 0 trains alone, its
    step cap (if any) `sampled` times the clients' (the budget of the round's clients).
    """
    cfg = cell.cfg
    if cfg.train.centralized:
        train = population.cohorts[0].train
        if train.max_local_steps is not None:
            train = train.model_copy(update={"max_local_steps": train.max_local_steps * sampled})
        cohorts = [dataclasses.replace(population.cohorts[0], clients=(0,), train=train)]
    else:
        cohorts = list(population.cohorts)
    results = [
        train_clients(
            population.method,
            server,
            task,
            ids,
            cohort.train,
            round_idx=r,
            seed=cfg.seed,
            executor=cfg.runtime.executor,
            inputs=population.inputs,
            precision=cell.precision,
            strategy=population.strategy,
            lockstep_samples=cfg.runtime.lockstep_samples,
        )
        for cohort in cohorts
        if (ids := participants(cohort, client_ids))
    ]
    return concat_results(results) if results else None


def pooled(task: Task, client_ids: list[int] | None = None) -> Task:
    """The centralized reference's training view of a round: one client 0 holding the union
    (concatenation, in the round's order) of the train data of the round's clients (default:
    every trainable client), so that it trains on the same samples as the federation; FedAvg of
    one client is its parameters."""
    ids = task.trainable_clients() if client_ids is None else client_ids
    train_idx = torch.cat([task.train_idx[c] for c in ids])
    sizes = task.train_sizes[ids]
    prior = (task.priors[ids] * sizes.to(task.priors).unsqueeze(1)).sum(0) / sizes.sum()
    client = dataclasses.replace(
        task.clients[ids[0]],
        id=0,
        train_idx=np.concatenate([task.clients[c].train_idx for c in ids]),
        class_prior=prior.double().cpu().numpy(),
        domain=None,
    )
    return dataclasses.replace(
        task,
        clients=[client],
        train_idx=[train_idx],
        test_idx=[task.test_idx[ids[0]]],
        priors=prior.unsqueeze(0),
        train_sizes=sizes.sum().view(1),
        heldout=torch.tensor([False]),
        aggregation_sizes=None,
    )


def check_centralized(cfg: RunConfig, populations: Sequence[Population]) -> None:
    """`train.centralized` needs one population of a global method without personal tensors."""
    if not cfg.train.centralized:
        return
    if cfg.model_het is not None:
        raise FpbenchError("train.centralized cannot be combined with model_het")
    method = populations[0].method
    if method.inference != "global" or method.personal:
        raise FpbenchError(
            f"train.centralized needs a method with global inference and no personal tensors; "
            f"{method.name} has inference {method.inference!r}"
            + (f" and personal {sorted(method.personal)}" if method.personal else "")
        )


def evaluate_populations(
    cell: Cell,
    servers: dict[str, ServerState],
    history: list[dict[str, float]],
    r: int,
    seen: list[int],
) -> list[MetricRow]:
    """Evaluate every population on its clients; the per-client and aggregate rows of round r.

    `seen`: the clients sampled so far (`Cell.seen`), whom `train.unseen_clients` reads.
    """
    cfg, task, precision, populations = cell.cfg, cell.task, cell.precision, cell.populations
    single = len(populations) == 1
    counts = merge_counts(
        [
            (
                evaluate(
                    pop.method,
                    servers[pop.key],
                    task,
                    cfg.train.eval_batch_size,
                    pop.inputs,
                    precision,
                    label_space=cfg.train.local_label_space,
                    clients=None if single else pop.clients,
                    full_split=cfg.train.full_split_clients,
                ),
                pop.clients,
            )
            for pop in populations
        ]
    )
    counts = mark_untrained(counts, populations, seen, cfg.train.unseen_clients)
    domains = [c.domain for c in task.clients]
    agg = aggregates(counts) | domain_accuracies(counts, domains, task.data.domain_names)
    if cfg.model_het is not None:
        names = [p.name for p in cfg.model_het.profiles]
        profiles = client_profiles(cfg.model_het)
        agg |= domain_accuracies(counts, profiles, names, prefix="acc_profile_")
    agg |= score_targets(cell, servers, seen)
    agg |= derived(cfg.evaluation, agg)
    history.append(agg)
    rows = client_rows(counts) + [(None, k, v, None) for k, v in agg.items()]
    if r == cfg.train.rounds - 1:
        rows += [(None, k, v, None) for k, v in summary(history, cfg.train.summary_window).items()]
    return rows


def score_targets(cell: Cell, servers: dict[str, ServerState], seen: list[int]) -> dict[str, float]:
    """`acc_<set>` / `ece_<set>` of each set the evaluation mode scores (`eval_modes`): the
    global model's, or the mean over the trained clients' own models, on its whole test split."""
    cfg, precision, populations = cell.cfg, cell.precision, cell.populations
    out: dict[str, float] = {}
    single = len(populations) == 1
    for i, first in enumerate(populations[0].targets):
        counts = merge_counts(
            [
                (
                    evaluate(
                        pop.targets[i].method,
                        servers[pop.key],
                        pop.targets[i].task,
                        cfg.train.eval_batch_size,
                        pop.targets[i].inputs,
                        precision,
                        clients=None if single else pop.clients,
                    ),
                    pop.clients,
                )
                for pop in populations
            ]
        )
        agg = aggregates(mark_untrained(counts, populations, seen, cfg.train.unseen_clients))
        for metric in ("acc", "ece"):
            if f"{metric}_global" in agg:
                out[f"{metric}_{first.name}"] = agg[f"{metric}_global"]
    return out


def mark_untrained(
    counts: EvalCounts, populations: Sequence[Population], seen: list[int], rule: str
) -> EvalCounts:
    """Under `train.unseen_clients = "exclude"`, mark the personal methods' participating
    clients that no round has sampled yet (see `fpbench.engine.metrics`)."""
    personal = [pop for pop in populations if pop.method.inference.startswith("personal")]
    if rule != "exclude" or not personal:
        return counts
    mine = np.zeros(len(counts.total_local), dtype=bool)
    for pop in personal:
        mine[np.asarray(pop.clients, dtype=np.int64)] = True
    trained = np.zeros_like(mine)
    trained[np.asarray(seen, dtype=np.int64)] = True
    return dataclasses.replace(counts, untrained=mine & ~trained & ~counts.heldout)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
