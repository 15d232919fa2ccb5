"""The round loop of one run and the loop over a suite's cells, with resume and storage."""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from traceback import format_exc

import numpy as np
import torch

import fpbench
from fpbench import stages
from fpbench.backbones import create_backbone
from fpbench.backbones.frozen_linear import cpu_linear
from fpbench.determinism import deterministic
from fpbench.engine import checkpoint as ckpt_io
from fpbench.engine.evaluate import evaluate
from fpbench.engine.executor import LocalResult, concat_results, derive_seed, train_clients
from fpbench.engine.groups import (
    Cohort,
    Group,
    client_profiles,
    merge_counts,
    pack,
    participants,
    share,
    start_shared,
    unpack,
)
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.engine.metrics import (
    EvalCounts,
    MetricRow,
    aggregates,
    client_rows,
    domain_accuracies,
    params_trainable,
    summary,
)
from fpbench.engine.task import Task, build_task
from fpbench.errors import FpbenchError
from fpbench.methods.base import Method, ServerState, TaskInfo
from fpbench.registry import METHODS
from fpbench.specs import BackboneRef, RunConfig, TrainConfig
from fpbench.store import CLAIM_TIMEOUT_S, ClaimLost, Store, claim_is_live, new_owner


class Observer:
    """Progress callbacks, no-ops here; the CLI's subclass shows rich progress bars."""

    def cell_start(self, cfg: RunConfig, start_round: int) -> None:
        """A cell starts training at `start_round` (> 0 when resumed)."""

    def round_end(self, cfg: RunConfig, round_idx: int, metrics: dict[str, float]) -> None:
        """A round is stored; `metrics` are its aggregates and `loss_train` if it was evaluated."""

    def stage(self, cfg: RunConfig | None, what: str, done: int, total: int) -> None:
        """Long work outside the rounds (data preparation, a frozen pass): `done` of `total`
        steps, 0 when it starts and `total` when it ends; `cfg` None for suite-wide work."""

    def cell_end(self, result: CellResult) -> None:
        """A cell finished, was skipped or failed."""


class NonFiniteLoss(RuntimeError):
    """Local training produced a NaN or infinite loss: the cell fails (its error is stored)."""


@dataclass(frozen=True)
class CellResult:
    cfg: RunConfig
    status: str  # done, skipped, failed
    error: str | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FpbenchError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise FpbenchError(f"invalid device {name!r}; use auto, cpu, cuda or cuda:N") from None


def sampling_schedule(
    seed: int, rounds: int, clients: list[int], participation: float
) -> list[list[int]]:
    """The clients of every round, pre-drawn from the seed so every method sees the same ones."""
    rng = np.random.default_rng(derive_seed(seed, "client-sampling"))
    m = max(1, math.floor(participation * len(clients) + 1e-9))
    return [[int(c) for c in rng.choice(clients, m, replace=False)] for _ in range(rounds)]


def should_eval(r: int, train: TrainConfig) -> bool:
    return (
        (r + 1) % train.eval_every == 0
        or r >= train.rounds - train.eval_last
        or r == train.rounds - 1
    )


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def build_method(
    cfg: RunConfig, task: Task, device: torch.device, pretrained: bool = True
) -> Method:
    backbone = create_backbone(
        cfg.backbone.name, weights=cfg.backbone.weights, pretrained=pretrained
    ).to(device)
    if cfg.backbone.mean is not None:  # the suite's input normalisation (e.g. the reference code's)
        backbone.mean, backbone.std = cfg.backbone.mean, cfg.backbone.std
    if cfg.runtime.compile and hasattr(backbone, "vit"):
        for block in backbone.vit.blocks:
            block.compile(dynamic=True)
    method_cls = METHODS.get(cfg.method.name)
    info = TaskInfo(
        num_classes=task.data.num_classes,
        num_clients=task.num_clients,
        class_priors=task.priors,
        train_sizes=task.train_sizes,
        class_names=tuple(task.data.class_names),
        dataset=cfg.dataset.name,
        train_images=task.data.train_images,
        train_idx=tuple(task.train_idx),
        heldout=task.heldout,
        train_labels=task.data.train_labels,
        test_images=task.data.test_images,
        test_labels=task.data.test_labels,
        coarse_of_class=task.data.coarse_of_class,
    )
    return method_cls(method_cls.Config(**cfg.method.args), backbone, info)


def run_suite(
    cells: list[RunConfig],
    store: Store,
    *,
    checkpoint_dir: Path,
    observer: Observer | None = None,
    cache: FeatureCache | None = None,
) -> list[CellResult]:
    """Run or resume every cell; finished cells are skipped, a failed one does not stop the rest."""
    observer = observer or Observer()
    results = []
    for cfg in cells:
        try:
            result = run_cell(
                cfg, store, checkpoint_dir=checkpoint_dir, observer=observer, cache=cache
            )
        except FpbenchError:
            raise
        except Exception as e:  # a crashed run is recorded as failed; the suite goes on
            result = CellResult(cfg, "failed", error_text(e))
        observer.cell_end(result)
        results.append(result)
    return results


def run_cell(
    cfg: RunConfig,
    store: Store,
    *,
    checkpoint_dir: Path,
    observer: Observer | None = None,
    cache: FeatureCache | None = None,
    claim_timeout: float = CLAIM_TIMEOUT_S,
) -> CellResult:
    """Run or resume one cell. Missing data or weights raise before anything is written.

    The cell is claimed atomically first (see `fpbench.store`): a cell another live
    driver is running is skipped, and a claim silent for `claim_timeout` seconds is taken over.
    It computes in deterministic mode unless `runtime.deterministic` is off (see
    `fpbench.determinism`); every executor comes through here.

    Raises:
        FpbenchError: missing data or weights, or an op with no deterministic kernel.
    """
    observer = observer or Observer()
    on_stage = getattr(observer, "stage", Observer().stage)  # duck-typed observers may lack it
    stage = lambda what, done, total: on_stage(cfg, what, done, total)  # noqa: E731
    with (
        deterministic(cfg.runtime.deterministic, cfg.runtime.threads),
        cpu_linear(cfg.runtime.cpu_linear),
        stages.reporting(stage),
    ):
        return _run_cell(cfg, store, checkpoint_dir, observer, cache, claim_timeout)


def _run_cell(
    cfg: RunConfig,
    store: Store,
    checkpoint_dir: Path,
    observer: Observer,
    cache: FeatureCache | None,
    claim_timeout: float,
) -> CellResult:
    record = store.find_run(cfg.run_key)
    if record is not None and record.status == "done":
        return CellResult(cfg, "skipped")
    if record is not None and claim_is_live(record, claim_timeout):  # before building anything
        return CellResult(cfg, "skipped", "claimed by another driver")
    device = resolve_device(cfg.runtime.device)
    torch.manual_seed(derive_seed(cfg.seed, "torch"))
    try:  # reports reach the observer's `stage` (run_cell); so do the frozen passes' later
        stages.report("preparing data", 0, 1)
        task = build_task(cfg, device)
        stages.report("preparing data", 1, 1)
        groups = build_groups(cfg, task, device, cache)
    except Exception as e:
        if not isinstance(e, FpbenchError):  # a crash (a bug, out of memory) is recorded
            record = record or _create_record(cfg, store, device)
            _record_failure(store, record.id, e, claim_timeout)
        raise
    record = record or _create_record(cfg, store, device)
    owner = new_owner()
    if not store.claim_run(record.id, owner, timeout_s=claim_timeout):
        return CellResult(cfg, "skipped", "claimed by another driver")
    try:
        with store.keep_alive(record.id, owner, claim_timeout / 4):
            elapsed = _rounds(cfg, groups, task, store, record.id, checkpoint_dir, observer, owner)
    except ClaimLost as e:
        return CellResult(cfg, "skipped", str(e))
    except BaseException as e:
        store.finish_run(record.id, owner, "failed", error=error_text(e), traceback=format_exc())
        raise
    if not store.finish_run(record.id, owner, "done", wall_s=elapsed):
        return CellResult(cfg, "skipped", "claim taken over by another driver")
    ckpt_io.checkpoint_path(checkpoint_dir, cfg.run_key).unlink(missing_ok=True)
    return CellResult(cfg, "done")


def error_text(e: BaseException) -> str:
    """How a crashed cell's error is stored and reported: 'Type: message'."""
    return f"{type(e).__name__}: {e}"


def _record_failure(store: Store, run_id: int, e: BaseException, claim_timeout: float) -> None:
    """Mark a run failed with the exception being handled, unless another driver holds it."""
    owner = new_owner()
    if store.claim_run(run_id, owner, timeout_s=claim_timeout):
        store.finish_run(run_id, owner, "failed", error=error_text(e), traceback=format_exc())


def _create_record(cfg: RunConfig, store: Store, device: torch.device):
    return store.ensure_run(
        run_key=cfg.run_key,
        suite=cfg.suite,
        method=cfg.method.label,
        dataset=cfg.dataset.label,
        partition=cfg.partition.label,
        seed=cfg.seed,
        config=cfg.model_dump(mode="json"),
        fpbench_version=fpbench.__version__,
        torch_version=torch.__version__,
        device=_device_name(device, cfg),
    )


def build_groups(
    cfg: RunConfig, task: Task, device: torch.device, cache: FeatureCache | None = None
) -> list[Group]:
    """One group of every client, or with `model_het` one group per distinct backbone."""
    if cfg.model_het is None:
        method = build_method(cfg, task, device)
        everyone = Cohort(None, tuple(range(task.num_clients)), cfg.train)
        return [Group("", method, _inputs(cfg, method, task, cache), (everyone,))]
    het = cfg.model_het
    if het.num_clients != task.num_clients:
        raise FpbenchError(
            f"model_het.profiles have {het.num_clients} clients in all but the partition made "
            f"{task.num_clients}; make them equal"
        )
    cohorts: dict[BackboneRef, list[Cohort]] = {}
    start = 0
    for p in het.profiles:
        clients = tuple(range(start, start + p.clients))
        cohorts.setdefault(p.backbone or cfg.backbone, []).append(
            Cohort(p.name, clients, cfg.profile_train(p))
        )
        start += p.clients
    groups = []
    for i, (ref, members) in enumerate(cohorts.items()):
        sub = cfg.model_copy(update={"backbone": ref})
        method = build_method(sub, task, device)
        key = f"{i}-{ref.name}"
        groups.append(Group(key, method, _inputs(sub, method, task, cache), tuple(members)))
    return groups


def _inputs(cfg: RunConfig, method: Method, task: Task, cache: FeatureCache | None) -> Inputs:
    folder = cfg.runtime.feature_cache_dir
    if not cfg.runtime.cache_features:
        cache = None
    elif folder:
        cache = FeatureCache(Path(folder))
    else:
        cache = cache or FeatureCache()
    return Inputs.of(method, task, cache, cfg.train.eval_batch_size)


def _rounds(
    cfg: RunConfig,
    groups: list[Group],
    task: Task,
    store: Store,
    run_id: int,
    checkpoint_dir: Path,
    observer: Observer,
    owner: str | None = None,
) -> float:
    """The round loop, from the last checkpoint on; returns the run's total training time."""
    device = task.priors.device
    path = ckpt_io.checkpoint_path(checkpoint_dir, cfg.run_key)
    ckpt = ckpt_io.load(path, cfg.run_key, device)
    if ckpt is None:
        servers = {
            g.key: _to(
                g.method.init_server(
                    torch.Generator().manual_seed(derive_seed(cfg.seed, "init-params"))
                ),
                device,
            )
            for g in groups
        }
        if _sharing(cfg):
            servers = start_shared(servers)
        ckpt = ckpt_io.Checkpoint(cfg.run_key, -1, pack(servers), [], 0.0)
    store.truncate_after(run_id, ckpt.round)
    observer.cell_start(cfg, ckpt.round + 1)
    schedule = sampling_schedule(
        cfg.seed, cfg.train.rounds, task.trainable_clients(), cfg.train.participation
    )
    for r in range(ckpt.round + 1, cfg.train.rounds):
        start = time.perf_counter()
        seen = sorted({c for ids in schedule[: r + 1] for c in ids})
        server, rows, scalars = _round(
            groups, ckpt.server, task, cfg, r, schedule[r], ckpt.history, seen
        )
        wall = time.perf_counter() - start
        store.write_round(run_id, r, wall_s=wall, metrics=rows, owner=owner, **scalars)
        ckpt = ckpt_io.Checkpoint(cfg.run_key, r, server, ckpt.history, ckpt.elapsed_s + wall)
        ckpt_io.save(path, ckpt)
        evaluated = should_eval(r, cfg.train)
        metrics = {**ckpt.history[-1], "loss_train": scalars["loss_train"]} if evaluated else {}
        observer.round_end(cfg, r, metrics)
    return ckpt.elapsed_s


def _sharing(cfg: RunConfig) -> bool:
    return cfg.model_het is not None and cfg.model_het.share == "shared"


def _round(
    groups: list[Group],
    server: ServerState,
    task: Task,
    cfg: RunConfig,
    r: int,
    client_ids: list[int],
    history: list[dict[str, float]],
    seen: list[int] | None = None,
):
    """One round: local training, aggregation, evaluation; returns the rows to store.

    `seen`: the clients sampled in this or any earlier round (default: this round's).
    """
    device = task.priors.device
    precision = resolve_precision(cfg.runtime.precision, device)
    servers = unpack(server, [g.key for g in groups])
    losses, weight, up, down = [], {}, 0, 0
    for g in groups:
        local = _train_group(g, servers[g.key], task, cfg, r, client_ids, precision)
        if local is None:
            weight[g.key] = 0.0
            continue
        weights = task.aggregation_weights[local.client_ids].to(device)
        d, u = g.method.communication(servers[g.key])
        down, up = down + _nbytes(d) * len(weights), up + _nbytes(u) * len(weights)
        servers[g.key] = g.method.aggregate(
            servers[g.key], local.params, local.client_ids.to(device), weights, local.stats
        )
        losses.append(local.loss)
        weight[g.key] = float(weights.sum())
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
    for g in groups:
        suffix = f"@{g.key}" if len(groups) > 1 else ""
        metrics = g.method.round_metrics(servers[g.key])
        rows += [(None, f"{k}{suffix}", v, None) for k, v in metrics.items()]
    if r == 0:  # a property of the method, stored once (the largest over backbones)
        count = max(params_trainable(s.params, s.personal) for s in servers.values())
        rows.append((None, "params_trainable", count, None))
    if should_eval(r, cfg.train):
        seen = client_ids if seen is None else seen
        rows += _evaluate(groups, servers, task, cfg, precision, history, r, seen)
    return pack(servers), rows, {"loss_train": loss, "bytes_up": up, "bytes_down": down}


def _train_group(
    group: Group,
    server: ServerState,
    task: Task,
    cfg: RunConfig,
    r: int,
    client_ids: list[int],
    precision: str,
) -> LocalResult | None:
    """Local training of this round's clients of one group, cohort by cohort (None: none)."""
    results = [
        train_clients(
            group.method,
            server,
            task,
            ids,
            cohort.train,
            round_idx=r,
            seed=cfg.seed,
            executor=cfg.runtime.executor,
            inputs=group.inputs,
            precision=precision,
        )
        for cohort in group.cohorts
        if (ids := participants(cohort, client_ids))
    ]
    return concat_results(results) if results else None


def _evaluate(
    groups: list[Group],
    servers: dict[str, ServerState],
    task: Task,
    cfg: RunConfig,
    precision: str,
    history: list[dict[str, float]],
    r: int,
    seen: list[int],
) -> list[MetricRow]:
    """Evaluate every group on its clients; the per-client and aggregate rows of the round."""
    single = len(groups) == 1
    counts = merge_counts(
        [
            (
                evaluate(
                    g.method,
                    servers[g.key],
                    task,
                    cfg.train.eval_batch_size,
                    g.inputs,
                    precision,
                    label_space=cfg.train.local_label_space,
                    clients=None if single else g.clients,
                ),
                g.clients,
            )
            for g in groups
        ]
    )
    counts = mark_untrained(counts, groups, seen, cfg.train.unseen_clients)
    domains = [c.domain for c in task.clients]
    agg = aggregates(counts) | domain_accuracies(counts, domains, task.data.domain_names)
    if cfg.model_het is not None:
        names = [p.name for p in cfg.model_het.profiles]
        profiles = client_profiles(cfg.model_het)
        agg |= domain_accuracies(counts, profiles, names, prefix="acc_profile_")
    history.append(agg)
    rows = client_rows(counts) + [(None, k, v, None) for k, v in agg.items()]
    if r == cfg.train.rounds - 1:
        rows += [(None, k, v, None) for k, v in summary(history, cfg.train.summary_window).items()]
    return rows


def mark_untrained(
    counts: EvalCounts, groups: list[Group], seen: list[int], rule: str
) -> EvalCounts:
    """Under `train.unseen_clients = "exclude"`, mark the personal methods' participating
    clients that no round has sampled yet (see `fpbench.engine.metrics`)."""
    personal = [g for g in groups if g.method.inference == "personal"]
    if rule != "exclude" or not personal:
        return counts
    mine = np.zeros(len(counts.total_local), dtype=bool)
    for g in personal:
        mine[np.asarray(g.clients, dtype=np.int64)] = True
    trained = np.zeros_like(mine)
    trained[np.asarray(seen, dtype=np.int64)] = True
    return dataclasses.replace(counts, untrained=mine & ~trained & ~counts.heldout)


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _to(server: ServerState, device: torch.device) -> ServerState:
    move = lambda d: {k: v.to(device) for k, v in d.items()}  # noqa: E731
    return ServerState(move(server.params), move(server.personal), move(server.buffers))


def _device_name(device: torch.device, cfg: RunConfig) -> str:
    """The device and the numerics it ran with, e.g. 'NVIDIA H200 (bf16)'."""
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})"
    )
    return f"{name} ({resolve_precision(cfg.runtime.precision, device)})"
