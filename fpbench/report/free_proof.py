"""Proof that a protocol's *free* paths are free: perturbed, the stored results stay bit-identical.

A `[[protocol]]` rule may mark a path free ("it cannot change the table's number"). That is a
claim about the code, and this module tests it. Each feeding cell gets an *offline twin*
(`offline_twin`): the same method, method arguments, training recipe and runtime, on the
test-sized backbone of its family (`vit-test`, `clip-test`), synthetic data (a held-out domain
one of its synthetic style domains) and a few clients, and a few rounds (where an
evaluation-schedule path is free, as many as keep the schedule's shape: the last `eval_last`
rounds and one `eval_every` stride before them). The twin runs once as it is and once with every
free path perturbed; `prove` compares every stored value
(`fpbench.store.diff.values`: each round's loss and bytes, each metric row) bit for bit and,
where they differ, names the paths that change a number, one at a time.

A perturbation value comes from the rule (`perturb = value` beside `free`) or from the field
(`perturbation`): another choice of a `Literal`, the other boolean, a larger number, a changed
label; a path whose twin cannot carry it (a dataset argument of a real dataset) cannot be proven
free here and is reported, as is a path with no valid perturbation. `readings.*` paths describe
the method's code, not a setting, and are not perturbed.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fpbench.report.protocol import (
    FREE,
    NULL,
    READINGS,
    Block,
    FedCell,
    Rule,
    _matches,
    leaf_paths,
    lookup,
)

TWIN_BLOCKS = 2  # the twin backbones' depth (vit-test, clip-test)
TWIN_DATASET = {"num_classes": 6, "image_size": 16, "train_per_class": 12, "test_per_class": 6}
TWIN_CLIENTS = 4
TWIN_DOMAINS = 3  # a held-out-domain twin's synthetic style domains d0, d1, d2 (d1 held out)
TWIN_ROUNDS = 3
TWIN_WIDTH = 32  # the test backbones' feature width
SCHEDULE = ("train.eval_every", "train.eval_last", "train.summary_window")
# partitions the synthetic twin data can run as they are; any other runs as `pathological`
TWIN_PARTITIONS = ("pathological", "dirichlet", "disjoint-classes", "iid")
TWIN_PART_ARGS = {"s": 3, "min_size": 1, "num_clients": TWIN_CLIENTS}
TWIN_BACKBONES = {"vit": "vit-test", "clip": "clip-test"}
TWIN_PROFILE_BACKBONES = {"clip-rn50": "clip-test-rn", "clip-rn101": "clip-test-rn"}
NOT_PERTURBED = (READINGS,)  # virtual: the method's code, no config path


@dataclass(frozen=True)
class FreePath:
    """A leaf path of a cell that a free rule covers (and no pinned or declared rule does)."""

    path: str
    value: Any
    rule: Rule
    block: int


def free_paths(blocks: list[Block], cell: FedCell) -> list[FreePath]:
    """The cell's leaf paths whose strongest covering rule is free (as `coverage` ranks them)."""
    chosen = [
        (b, r)
        for b in blocks
        if cell.tables & set(b.tables) and _matches(b.match, cell)
        for r in b.rules
        if _matches(r.match, cell)
    ]
    out = []
    for leaf, value in leaf_paths(cell.config).items():
        covering = [(b, r) for b, r in chosen if r.covers(leaf)]
        if covering and all(r.kind == FREE for _, r in covering):
            b, r = covering[0]
            out.append(FreePath(leaf, value, r, b.index))
    return out


# -- the offline twin ---------------------------------------------------------------------------


def offline_twin(config: Mapping[str, Any], schedule_free: bool = False) -> dict[str, Any]:
    """The resolved config (JSON form, `readings` dropped) of a cell's offline twin; see the
    module docstring. `TWIN_ROUNDS` rounds, unless `schedule_free` (a free `eval_*` path): then
    the last `eval_last` rounds and one `eval_every` stride before them. Validate it with
    `RunConfig.model_validate`."""
    from fpbench.registry import METHODS
    from fpbench.tiny import OFFLINE_ARGS

    cfg = {k: v for k, v in config.items() if k != READINGS}
    method = dict(cfg["method"])
    family = METHODS.get(method["name"]).backbone_family
    method["args"] = {  # ViT-B block indices: None gives the twin's 2 blocks the defaults
        k: None if k.endswith("_layers") and isinstance(v, list) else v
        for k, v in {**method.get("args", {}), **OFFLINE_ARGS.get(method["name"], {})}.items()
    }
    for k, v in method["args"].items():  # one block index (SGPT's query_layer): the twin's last
        if k.endswith("_layer") and isinstance(v, int) and v > TWIN_BLOCKS - 1:
            method["args"][k] = TWIN_BLOCKS - 1
    if (method["args"].get("num_groups") or 0) > TWIN_WIDTH:  # orthogonal keys need <= width
        method["args"]["num_groups"] = TWIN_WIDTH
    if method["args"].get("select_encoder") not in (None, "backbone"):  # hub weights: offline,
        method["args"]["select_encoder"] = "backbone"  # the twin's own backbone selects
    part = dict(cfg["partition"])
    args = dict(part.get("args", {}))
    if part["name"] not in TWIN_PARTITIONS:
        part["name"], args = (
            "pathological",
            {"s": 3, **{k: args[k] for k in ("min_train",) if k in args}},
        )
    args.update({k: v for k, v in TWIN_PART_ARGS.items() if k in args or k == "num_clients"})
    if args.get("blocks") == "dassl":  # round(C / N) classes each must leave none empty
        args["num_clients"] = 3
    if args.get("heldout_frac"):
        args["heldout_frac"] = 0.25
    if args.get("shots"):
        args["shots"] = min(args["shots"], 4)
    part["args"] = args
    train = dict(cfg["train"])
    if train.get("aggregation_weights") == "domain_size":  # synthetic data records no domains
        train["aggregation_weights"] = "train_size"
    every, last = train["eval_every"], train["eval_last"]
    if schedule_free:  # keep the schedule's shape: a stride before the last rounds
        train["rounds"] = min(train["rounds"], last + every + 1)
    else:
        train["rounds"] = min(train["rounds"], TWIN_ROUNDS)
        train["eval_last"] = min(last, TWIN_ROUNDS - 1)
        train["summary_window"] = min(train["summary_window"], TWIN_ROUNDS - 1)
    het = cfg.get("model_het")
    if het:
        profiles = [
            {**p, "backbone": p["backbone"] and {**p["backbone"], "weights": None,
                "name": TWIN_PROFILE_BACKBONES.get(p["backbone"]["name"], "clip-test")}}
            for p in het["profiles"]
        ]  # fmt: skip
        het = {**het, "profiles": profiles}
        args["num_clients"] = sum(p["clients"] for p in profiles)
    data = {**TWIN_DATASET, "num_classes": max(TWIN_DATASET["num_classes"], args["num_clients"])}
    evaluation = cfg.get("evaluation")
    if evaluation and evaluation.get("targets"):  # real target datasets: synthetic ones, sized
        targets = [  # as the source, their own seeds
            {**t, "name": "synthetic", "args": {**TWIN_DATASET, "seed": 11 + i}}
            for i, t in enumerate(evaluation["targets"])
        ]
        cfg = {**cfg, "evaluation": {**evaluation, "targets": targets}}
    if evaluation and evaluation.get("domain"):  # a held-out domain: synthetic style domains
        data["num_domains"] = TWIN_DOMAINS
        cfg = {**cfg, "evaluation": {**evaluation, "domain": "d1"}}
    return {
        **cfg,
        "dataset": {"name": "synthetic", "label": cfg["dataset"]["label"], "args": data},
        "partition": part,
        "method": method,
        "backbone": {**cfg["backbone"], "name": TWIN_BACKBONES[family], "weights": None},
        "train": train,
        "model_het": het,
        "runtime": {**cfg["runtime"], "device": "cpu", "threads": 1, "feature_cache_dir": None},
    }


# -- perturbation values ------------------------------------------------------------------------


def _field(model: type[BaseModel], parts: list[str]) -> Any:
    """The annotation of `parts` below `model`, or None when it is not a declared field."""
    annotation: Any = model
    for part in parts:
        base = _model_of(annotation)
        if base is None or part not in base.model_fields:
            return None
        annotation = base.model_fields[part].annotation
    return annotation


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for arm in _arms(annotation):
        if isinstance(arm, type) and issubclass(arm, BaseModel):
            return arm
    return None


def _arms(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def annotation_of(config: Mapping[str, Any], path: str) -> Any:
    """The declared type of `path` in a resolved config: RunConfig's fields, and below
    `method.args`, `partition.args` and `dataset.args` the component's own `Config`."""
    from fpbench.registry import DATASETS, METHODS, PARTITIONS
    from fpbench.specs import RunConfig

    parts = path.split(".")
    registries = {"method": METHODS, "partition": PARTITIONS, "dataset": DATASETS}
    if len(parts) > 2 and parts[0] in registries and parts[1] == "args":
        component = registries[parts[0]].get(config[parts[0]]["name"])
        return _field(component.Config, parts[2:])
    return _field(RunConfig, parts)


def perturbation(value: Any, annotation: Any) -> Any:
    """Another valid-looking value for a field of `annotation` now holding `value` (a
    `ValueError` when none can be derived: then the rule gives `perturb`)."""
    arms = [a for a in _arms(annotation) if a is not type(None)]
    for arm in arms:
        if typing.get_origin(arm) is typing.Literal:
            others = [c for c in typing.get_args(arm) if c != value]
            if others:
                return others[0]
    if isinstance(value, bool) or bool in arms:
        return not value
    if isinstance(value, int) or (value is None and int in arms):
        return (value or 0) + 1
    if isinstance(value, float) or (value is None and float in arms):
        return value * 2 if value else 0.5
    if value is None and (fixed := [a for a in arms if typing.get_origin(a) is tuple]):
        return [0.5] * len(typing.get_args(fixed[0]))
    if isinstance(value, str) or (value is None and str in arms):
        return f"{value or 'x'}-perturbed"
    raise ValueError(f"no perturbation derived for {value!r} ({annotation}); give perturb")


PAIRED = {"backbone.mean": "backbone.std", "backbone.std": "backbone.mean"}  # both or neither


def set_path(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `config` with dotted `path` set to `value` (and a `PAIRED` partner that is
    None to the same value, so the config stays valid)."""
    partner = PAIRED.get(path)
    if partner and value is not None and lookup(config, partner) is None:
        config = _set(config, partner, value)
    return _set(config, path, value)


def _set(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    if not rest:
        return {**config, head: value}
    return {**config, head: _set(dict(config[head]), rest, value)}


@dataclass
class Perturbation:
    """What one free path of a twin is perturbed to (or why it cannot be)."""

    free: FreePath
    value: Any = None
    problem: str = ""


def perturbations(
    twin: Mapping[str, Any], frees: Iterable[FreePath], files: Callable[..., Any] | None = None
) -> list[Perturbation]:
    """Each free path's perturbation on `twin` (`files(path, twin)` gives a value for a path
    that names a file, e.g. a copy of the twin's weights for `backbone.weights`)."""
    from fpbench.registry import METHODS
    from fpbench.specs import RunConfig

    out = []
    for free in frees:
        if free.path.split(".")[0] in NOT_PERTURBED:
            continue
        p = Perturbation(free)
        current = lookup(twin, free.path)
        if current is _missing():
            p.problem = "the offline twin has no such path (a setting of the real dataset)"
        elif free.rule.perturb is not None:
            p.value = None if free.rule.perturb == NULL else free.rule.perturb
        elif files is not None and (made := files(free.path, twin)) is not None:
            p.value = made
        else:
            try:
                p.value = perturbation(current, annotation_of(twin, free.path))
            except ValueError as e:
                p.problem = str(e)
        if not p.problem:
            try:
                changed = RunConfig.model_validate(set_path(dict(twin), free.path, p.value))
                METHODS.get(changed.method.name).Config(**changed.method.args)
            except Exception as e:  # noqa: BLE001 (any validation error: one line)
                p.problem = f"perturbed to {p.value!r} the config is invalid: {_line(e)}"
        out.append(p)
    return out


def _missing() -> Any:
    from fpbench.report.protocol import _MISSING

    return _MISSING


def _line(e: Exception) -> str:
    from pydantic import ValidationError

    from fpbench.specs import first_error

    return first_error(e) if isinstance(e, ValidationError) else str(e).split("\n")[0][:200]


def twin_files(folder: Path) -> Callable[[str], Any]:
    """`files` for `perturbations`: `backbone.weights` -> a file holding the twin backbone's
    own weights (the copy a free `backbone.weights` names), `runtime.feature_cache_dir` -> a
    fresh folder; None for any other path."""

    def make(path: str, twin: Mapping[str, Any]) -> Any:
        if path == "runtime.feature_cache_dir":
            return str(folder / "feature-cache")
        if path == "backbone.weights":
            return str(weights_copy(twin["backbone"]["name"], folder))
        return None

    return make


def weights_copy(name: str, folder: Path) -> Path:
    """A weights file of test-sized backbone `name` (seeded: the same weights it builds)."""
    import shutil

    import torch

    from fpbench.backbones.catalog import CLIP_SPECS, VIT_SPECS

    folder.mkdir(parents=True, exist_ok=True)
    spec = {s.name: s for s in (*VIT_SPECS, *CLIP_SPECS)}[name]
    path = folder / f"{name}-copy.pth"
    if name.startswith("clip"):
        shutil.copyfile(spec._seeded_file(None), path)
    else:
        torch.save(spec._timm().state_dict(), path)
    return path


# -- running and comparing ----------------------------------------------------------------------


def stored_values(config: Mapping[str, Any], folder: Path) -> dict[tuple[Any, ...], Any]:
    """Run `config` (a resolved config, JSON form) into a fresh database under `folder`; every
    value it stored (`fpbench.store.diff.values`)."""
    from fpbench.engine.runner import run_cell
    from fpbench.specs import RunConfig
    from fpbench.store import Store
    from fpbench.store.diff import values

    cfg = RunConfig.model_validate(config)
    folder.mkdir(parents=True, exist_ok=True)
    with Store(f"sqlite:///{folder / 'results.db'}") as store:
        result = run_cell(cfg, store, checkpoint_dir=folder / "checkpoints")
        if result.status != "done":
            raise RuntimeError(f"twin run {result.status}: {result.message}")
        return values(store)[cfg.run_key]


def differences(a: Mapping[tuple, Any], b: Mapping[tuple, Any]) -> list[str]:
    """Every stored value that is not bit-identical, described as `fpbench db diff` does."""
    from fpbench.store.diff import describe, same_bits

    missing = object()
    out = []
    for what in sorted(set(a) | set(b), key=lambda w: tuple(map(str, w))):
        x, y = a.get(what, missing), b.get(what, missing)
        if x is missing or y is missing or not same_bits(x, y):
            shown = ["(missing)" if v is missing else repr(v) for v in (x, y)]
            out.append(f"{describe(what)}: {shown[0]} != {shown[1]}")
    return out


@dataclass
class Proof:
    """What perturbing a twin's free paths found."""

    cell: str
    perturbed: list[Perturbation] = field(default_factory=list)
    changes: dict[str, list[str]] = field(default_factory=dict)  # path -> first differences

    @property
    def problems(self) -> list[str]:
        out = [
            f"{self.cell}: {p.free.path} (block {p.free.block}) cannot be perturbed: {p.problem}"
            for p in self.perturbed
            if p.problem
        ]
        return out + [
            f"{self.cell}: {path} is free but changes stored values when set to "
            f"{self._value(path)!r}: {'; '.join(diffs[:3])}"
            for path, diffs in self.changes.items()
        ]

    def _value(self, path: str) -> Any:
        return next(p.value for p in self.perturbed if p.free.path == path)


def prove(
    cell: FedCell,
    blocks: list[Block],
    folder: Path,
    files: Callable[..., Any] | None = None,
) -> Proof:
    """Run the cell's twin as it is and with every free path perturbed at once; where the
    stored values differ, perturb one path at a time to name each that changes a number."""
    frees = free_paths(blocks, cell)
    twin = offline_twin(cell.config, any(f.path in SCHEDULE for f in frees))
    files = files or twin_files(folder / "files")
    proof = Proof(cell.name, perturbations(twin, frees, files))
    runnable = [p for p in proof.perturbed if not p.problem]
    if not runnable:
        return proof
    base = stored_values(twin, folder / "base")
    every = dict(twin)
    for p in runnable:
        every = set_path(every, p.free.path, p.value)
    if not differences(base, stored_values(every, folder / "all")):
        return proof
    for i, p in enumerate(runnable):
        one = stored_values(set_path(dict(twin), p.free.path, p.value), folder / f"one-{i}")
        if found := differences(base, one):
            proof.changes[p.free.path] = found
    return proof
