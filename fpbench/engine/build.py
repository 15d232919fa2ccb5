"""Building a cell: its device and numerics, its method(s) and their inputs."""

from __future__ import annotations

import copy

import torch

from fpbench.backbones import create_backbone
from fpbench.cache import frozen_dir
from fpbench.engine.inputs import FeatureCache, Inputs
from fpbench.engine.populations import Cohort, Population
from fpbench.engine.scoring import Target, method_for, scoring_task
from fpbench.engine.task import Task
from fpbench.errors import FpbenchError
from fpbench.methods.base import Method, TaskInfo
from fpbench.registry import METHODS
from fpbench.specs import BackboneRef, RunConfig
from fpbench.strategies import build_strategy


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise FpbenchError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    try:
        return torch.device(name)
    except RuntimeError:
        raise FpbenchError(f"invalid device {name!r}; use auto, cpu, cuda or cuda:N") from None


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def build_method(
    cfg: RunConfig,
    task: Task,
    device: torch.device,
    pretrained: bool = True,
    backbones: dict | None = None,
    *,
    precision: str | None = None,
) -> Method:
    """The cell's method on its backbone; `backbones` (random weights only) keeps each
    architecture built once and hands out copies (`fpbench estimate` builds hundreds).
    `precision`: the cell's resolved one (default: `runtime.precision` on `device`)."""
    precision = precision or resolve_precision(cfg.runtime.precision, device)
    key = (cfg.backbone.name, cfg.backbone.weights)
    if backbones is None or pretrained:
        backbone = create_backbone(key[0], weights=key[1], pretrained=pretrained)
    else:
        if key not in backbones:
            backbones[key] = create_backbone(key[0], weights=key[1], pretrained=False)
        backbone = copy.deepcopy(backbones[key])
    backbone = backbone.to(device)
    if cfg.backbone.mean is not None:  # the suite's input normalisation (e.g. the reference code's)
        backbone.mean, backbone.std = cfg.backbone.mean, cfg.backbone.std
    if precision == "bf16-frozen" and hasattr(backbone, "hold_bf16_blocks"):
        backbone.hold_bf16_blocks()
    if cfg.runtime.compile and hasattr(backbone, "vit"):
        for blocks in (backbone.vit.blocks, *getattr(backbone, "_bf16_blocks", ())):
            for block in blocks:
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
        coarse_of_class=task.data.coarse_of_class,
    )
    method = method_cls(method_cls.Config(**cfg.method.args), backbone, info)
    build_strategy(cfg.method.strategy).bind(method)  # e.g. FedOTP's personal prompts
    return method


def build_populations(
    cfg: RunConfig,
    task: Task,
    device: torch.device,
    cache: FeatureCache | None = None,
    pretrained: bool = True,
    backbones: dict | None = None,
    *,
    precision: str | None = None,
) -> list[Population]:
    """One population of every client, or with `model_het` one population per distinct backbone
    (`pretrained=False`: random weights, as `fpbench estimate` times them)."""
    if cfg.model_het is None:
        method = build_method(cfg, task, device, pretrained, backbones, precision=precision)
        everyone = Cohort(None, tuple(range(task.num_clients)), cfg.train)
        targets = _targets(cfg, method, task, cache)
        inputs, strategy = _inputs(cfg, method, task, cache), build_strategy(cfg.method.strategy)
        return [Population("", method, inputs, (everyone,), targets, strategy)]
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
    populations = []
    for i, (ref, members) in enumerate(cohorts.items()):
        sub = cfg.model_copy(update={"backbone": ref})
        method = build_method(sub, task, device, pretrained, backbones, precision=precision)
        key = f"{i}-{ref.name}"
        inputs, targets = _inputs(sub, method, task, cache), _targets(sub, method, task, cache)
        strategy = build_strategy(cfg.method.strategy)
        populations.append(Population(key, method, inputs, tuple(members), targets, strategy))
    return populations


def _targets(
    cfg: RunConfig, method: Method, task: Task, cache: FeatureCache | None
) -> tuple[Target, ...]:
    """The evaluation mode's scored sets for one method instance (see `eval_modes`)."""
    out = []
    for s in task.eval_sets:
        where = f"evaluation mode {cfg.evaluation.mode if cfg.evaluation else ''}"
        scoring = scoring_task(s.data, task, where)
        scorer = method if s.same_classes else method_for(method, scoring, where)
        out.append(Target(s.name, scoring, scorer, _inputs(cfg, scorer, scoring, cache)))
    return tuple(out)


def _inputs(cfg: RunConfig, method: Method, task: Task, cache: FeatureCache | None) -> Inputs:
    """The method's inputs, its frozen values kept as `runtime.cache_features` says: in
    `cache`'s memory (shared by a process's cells) and, unless "memory", on disk in
    `runtime.feature_cache_dir` (default: fpbench's cache folder)."""
    rt = cfg.runtime
    if rt.cache_features is False:
        found = None
    else:
        folder = None if rt.cache_features == "memory" else frozen_dir(rt.feature_cache_dir)
        found = (cache or FeatureCache()).on(folder)
    return Inputs.of(method, task, found, cfg.train.eval_batch_size, rt.frozen_precision)
