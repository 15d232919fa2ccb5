"""Suites and run configs: TOML in, validated pydantic models out, each run hashed to a `run_key`.

A suite file (``benchmarks/NAME.toml``) holds ``defaults`` plus one list per grid axis::

    seeds = [0, 1]
    [defaults]                 # any RunConfig field; component args merge into every entry
    backbone = { name = "vit-smoke" }
    train = { rounds = 10 }
    [[datasets]]               # each entry: name, optional label and overrides; the rest = args
    name = "synthetic"
    [[partitions]]
    name = "dirichlet"
    alpha = 0.3
    [[methods]]
    name = "fedvpt"
    overrides = { train = { lr = 0.1 } }
    [[methods]]                # a sweep: one entry per value (labels fedvpt-prompt_len=1, ...)
    name = "fedvpt"
    sweep = { prompt_len = [1, 5, 10] }

The cells are datasets x partitions x methods x seeds. A cell's config is the deep merge of the
defaults, the three entries (in that order) and their ``overrides``; every component's args are
validated by that component's own ``Config`` so the stored config carries all defaults.

A suite whose datasets need different partitions lists several grids: each ``[[grids]]`` entry
has its own axes (an axis it omits is the suite's) and ``defaults`` merged over the suite's; the
cells are the union of the grids' cells.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, Registry
from fpbench.shipped import shipped_dir

AXES = {"datasets": "dataset", "partitions": "partition", "methods": "method"}
SUITE_DIR = shipped_dir()  # the shipped suites: package data, or benchmarks/ in a checkout
MAX_CELLS = 100_000  # a suite larger than this is almost surely a typo in a grid
MAX_LABEL = 100
# suite names and labels end up in tables, plots and the database, never in file paths; still,
# nothing that looks like a path (separators, "..", control characters) is accepted
_LABEL = re.compile(r"[^\x00-\x1f\x7f/\\]+")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Augment(_Strict):
    """On-device training augmentation (none by default; SGPT's reference code on Office)."""

    hflip: bool = Field(False, description="random horizontal flip, p = 0.5")
    rotate: float = Field(
        0.0, ge=0, le=180, description="random rotation, uniform in +-this many degrees"
    )

    @property
    def active(self) -> bool:
        return self.hflip or self.rotate > 0


class TrainConfig(_Strict):
    """Federated schedule and local optimisation, shared by every method."""

    rounds: int = Field(10, ge=1, description="communication rounds")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients per round")
    local_epochs: int = Field(1, ge=1, description="local epochs per phase")
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.01, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum / Adam beta1")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(None, gt=0, description="per-client gradient-norm clip")
    lr_decay: float = Field(1.0, gt=0, le=1, description="lr multiplier per round (exponential)")
    lr_schedule: Literal["exp", "cosine"] = Field(
        "exp", description="exp: lr * lr_decay**round; cosine: anneal lr to 0 over the rounds"
    )
    eval_every: int = Field(1, ge=1, description="evaluate every this many rounds")
    eval_last: int = Field(10, ge=0, description="also evaluate each of the last this many rounds")
    summary_window: int = Field(10, ge=1, description="`*_last10` = mean over this many evals")
    eval_batch_size: int = Field(256, ge=1)
    local_label_space: Literal["all", "client"] = Field(
        "all",
        description="local accuracy over all classes, or only the classes the client trains on",
    )
    max_local_steps: int | None = Field(
        None, ge=1, description="cap on a client's optimiser steps per round (all epochs)"
    )
    unseen_clients: Literal["exclude", "score"] = Field(
        "exclude",
        description="personal methods' participating clients not yet sampled in any round: "
        "exclude them from local metrics (their count is `clients_untrained`) or score them "
        "with their untrained personal parameters",
    )
    augment: Augment = Field(Augment(), description="training augmentation, on the device")
    aggregation_weights: Literal["train_size", "domain_size"] = Field(
        "train_size",
        description="FedAvg client weights: the client's train size, or its domain's full "
        "train-list size shared equally by the domain's clients (SGPT reference code on "
        "Office-Caltech10 / DomainNet, whose clients train on a subset)",
    )


class RuntimeConfig(_Strict):
    """How a run executes; not part of its identity (the numbers do not depend on it)."""

    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    executor: Literal["reference", "lockstep"] = "lockstep"
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="auto: bf16 autocast on CUDA, fp32 on CPU"
    )
    compile: bool = Field(False, description="torch.compile the backbone's blocks")
    cache_features: bool = Field(
        True, description="compute frozen features and queries once per sample, when first needed"
    )
    feature_cache_dir: str | None = Field(None, description="also keep them on disk here")
    deterministic: bool = Field(
        True,
        description="deterministic kernels: results bit-identical across processes, resumes and "
        "executors on one machine; false is faster and may differ in the last bits, which "
        "training amplifies (see fpbench.determinism)",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads a cell computes with; unset: in deterministic mode the count of "
        "the `fpbench run` process for every executor on this machine (CPU matrix kernels split "
        "their work by threads, which changes the last bits), else the executor's share",
    )
    cpu_linear: Literal["onednn", "blas"] = Field(
        "onednn",
        description="the frozen backbone's fp32 linear layers on the CPU: oneDNN (about 2x "
        "PyTorch's default MKL on AMD CPUs) or blas (PyTorch's default); equal up to rounding",
    )


class Component(_Strict):
    """A registered component by name, its validated args, and the label shown in tables."""

    name: str
    label: str
    args: dict[str, Any] = Field(default_factory=dict)


Triple = tuple[float, float, float]


class BackboneRef(_Strict):
    name: str = "vit-smoke"
    weights: str | None = Field(None, description="local weights file; None: hub or built-in")
    mean: Triple | None = Field(
        None,
        description="input normalisation mean; None: the backbone's own. SGPT's reference code "
        "uses CIFAR-100 statistics (0.5071, 0.4865, 0.4409) on CIFAR and (0, 0, 0) (no "
        "normalisation) on Office-Caltech10 and DomainNet",
    )
    std: Triple | None = Field(
        None,
        description="input normalisation std; None: the backbone's own (reference code: "
        "(0.2673, 0.2564, 0.2762) on CIFAR, (1, 1, 1) on Office-Caltech10 and DomainNet)",
    )

    @model_validator(mode="after")
    def _both_or_neither(self) -> BackboneRef:
        if (self.mean is None) != (self.std is None):
            raise ValueError("backbone.mean and backbone.std go together: give both or neither")
        if self.std is not None and min(self.std) <= 0:
            raise ValueError(f"backbone.std must be positive, got {self.std}")
        return self


# fields added after run keys were first stored: at their default they are left out of the
# identity, so the keys of runs made before them stay the same
_LATER_FIELDS: dict[tuple[str, str], Any] = {
    ("train", "lr_schedule"): "exp",
    ("train", "local_label_space"): "all",
    ("backbone", "mean"): None,
    ("backbone", "std"): None,
    ("train", "max_local_steps"): None,
    ("train", "unseen_clients"): "score",  # the behaviour before the field existed
    ("train", "augment"): Augment().model_dump(mode="json"),
    ("train", "aggregation_weights"): "train_size",
}


# the local-training settings a client profile may set for its clients
PROFILE_TRAIN_KEYS = frozenset(
    {"batch_size", "local_epochs", "max_local_steps", "optimizer", "lr", "momentum",
     "weight_decay", "grad_clip"}
)  # fmt: skip


class Profile(_Strict):
    """A class of clients in a model-heterogeneous run: their backbone and local budget."""

    name: str = Field(min_length=1, max_length=MAX_LABEL, pattern=r"^[A-Za-z0-9_.-]+$")
    clients: int = Field(ge=1, description="how many clients have this profile")
    backbone: BackboneRef | None = Field(None, description="None: the run's backbone")
    train: dict[str, Any] = Field(
        default_factory=dict, description=f"overrides of {sorted(PROFILE_TRAIN_KEYS)}"
    )

    @model_validator(mode="after")
    def _train_keys(self) -> Profile:
        unknown = sorted(set(self.train) - PROFILE_TRAIN_KEYS)
        if unknown:
            raise ValueError(
                f"profile {self.name!r}: train keys {unknown} cannot vary per client; "
                f"valid: {sorted(PROFILE_TRAIN_KEYS)}"
            )
        return self


class ModelHet(_Strict):
    """Model heterogeneity (SDFed appendix B): client profiles with their own backbones.

    Clients are assigned to profiles in id order (the first `clients` ids to the first profile,
    and so on). Clients of one backbone share one method instance and server state; after each
    round, `share = "shared"` averages every shared parameter whose shape agrees across
    backbones (e.g. 512-wide CLIP text prompts), weighted by the participants' train sizes,
    which is FedAvg over all participants; `"per_backbone"` keeps one federation per backbone.
    """

    profiles: tuple[Profile, ...] = Field(min_length=1)
    share: Literal["shared", "per_backbone"] = "shared"

    @model_validator(mode="after")
    def _unique_names(self) -> ModelHet:
        names = [p.name for p in self.profiles]
        if len(set(names)) != len(names):
            raise ValueError(f"model_het.profiles names must be unique, got {names}")
        return self

    @property
    def num_clients(self) -> int:
        return sum(p.clients for p in self.profiles)


class RunConfig(_Strict):
    """The fully resolved config of one run (one cell of a suite)."""

    suite: str
    seed: int
    dataset: Component
    partition: Component
    method: Component
    backbone: BackboneRef = BackboneRef()
    train: TrainConfig = TrainConfig()
    model_het: ModelHet | None = None
    runtime: RuntimeConfig = RuntimeConfig()

    @model_validator(mode="after")
    def _profile_train(self) -> RunConfig:
        for profile in self.model_het.profiles if self.model_het else ():
            try:
                self.profile_train(profile)
            except ValidationError as e:
                raise ValueError(f"model_het profile {profile.name!r}: {_first_error(e)}") from None
        return self

    def profile_train(self, profile: Profile) -> TrainConfig:
        """The train config of a profile's clients: the run's, with the profile's overrides."""
        return TrainConfig(**{**self.train.model_dump(), **profile.train})

    def identity(self) -> dict[str, Any]:
        """Everything that determines the results (the runtime section does not)."""
        out = self.model_dump(mode="json", exclude={"runtime"})
        for (section, key), default in _LATER_FIELDS.items():
            if out[section][key] == default:
                del out[section][key]
        if out["model_het"] is None:  # added later: absent keeps the older run keys
            del out["model_het"]
        return out

    @property
    def run_key(self) -> str:
        blob = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


class Suite(_Strict):
    name: str
    description: str = ""
    path: str
    cells: tuple[RunConfig, ...]


def find_suite(name_or_path: str) -> Path:
    """A suite file by path, or by name in $FPBENCH_SUITES, ./benchmarks, or fpbench's own."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.suffix == ".toml":
        raise FpbenchError(f"suite file not found: {name_or_path}")
    for folder in suite_dirs():
        candidate = folder / f"{name_or_path}.toml"
        if candidate.is_file():
            return candidate
    names = ", ".join(list_suites()) or "none"
    raise FpbenchError(f"unknown suite {name_or_path!r}. Valid: {names}")


def suite_dirs() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("FPBENCH_SUITES", "").split(os.pathsep) if p]
    dirs = [*extra, Path.cwd() / "benchmarks", SUITE_DIR]
    return list(dict.fromkeys(d.resolve() for d in dirs if d.is_dir()))


def list_suites() -> list[str]:
    return sorted({p.stem for d in suite_dirs() for p in d.glob("*.toml")})


def load_suite(name_or_path: str) -> Suite:
    """Read, expand and validate a suite; raises FpbenchError with file and field on bad input."""
    path = find_suite(name_or_path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise FpbenchError(f"malformed suite file {path}: {e}") from None
    except UnicodeDecodeError as e:
        raise FpbenchError(
            f"malformed suite file {path}: not UTF-8 text (byte {e.start})"
        ) from None
    except OSError as e:
        raise FpbenchError(f"cannot read suite file {path}: {e.strerror or e}") from None
    return expand_suite(raw, name=raw.get("name", path.stem), path=str(path))


def expand_suite(raw: dict[str, Any], *, name: str, path: str = "<memory>") -> Suite:
    known = {"name", "description", "seeds", "defaults", "grids", *AXES}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise FpbenchError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(known)}")
    check_label(name, "suite name", path)
    if not isinstance(raw.get("description", ""), str):
        raise FpbenchError(f"{path}: description must be a string")
    seeds = _seeds(raw.get("seeds", [0]), path)
    plans = [_grid_plan(raw, grid, seeds, path) for grid in _grids(raw, path)]
    total = sum(math.prod(map(len, axes.values())) * len(s) for _, axes, s in plans)
    if total > MAX_CELLS:
        raise FpbenchError(
            f"{path}: the grid expands to {total:,} cells, more than the limit of {MAX_CELLS:,}; "
            "check the lists (seeds, [[methods]], ...) or split the suite into several files"
        )
    cells = []
    for defaults, axes, grid_seeds in plans:
        for ds, part, meth, seed in itertools.product(*axes.values(), grid_seeds):
            cells.append(resolve_cell(defaults, (ds, part, meth), suite=name, seed=seed, path=path))
    keys = [c.run_key for c in cells]
    if len(set(keys)) != len(keys):
        raise FpbenchError(f"{path}: two cells resolve to the same config; remove the duplicate")
    return Suite(name=name, description=raw.get("description", ""), path=path, cells=tuple(cells))


def check_label(value: Any, what: str, path: str) -> None:
    """A suite name or label: 1-100 printable characters, no path separators, not '.' or '..'."""
    ok = isinstance(value, str) and 0 < len(value) <= MAX_LABEL and _LABEL.fullmatch(value)
    if not ok or value.strip() in ("", ".", ".."):
        raise FpbenchError(
            f"{path}: {what} {value!r} is not allowed; use 1-{MAX_LABEL} printable characters "
            "without '/', '\\' or control characters (e.g. \"dir-0.3\")"
        )


def _seeds(seeds: Any, path: str, where: str = "seeds") -> list[int]:
    ok = isinstance(seeds, list) and seeds
    if not ok or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds):
        raise FpbenchError(
            f"{path}: {where} must be a non-empty list of non-negative integers, got {seeds!r}"
        )
    return seeds


def _grids(raw: dict[str, Any], path: str) -> list[dict[str, Any]]:
    grids = raw.get("grids") or [{}]
    if not isinstance(grids, list):
        raise FpbenchError(f"{path}: grids must be a list of [[grids]] tables, got {grids!r}")
    for grid in grids:
        if not isinstance(grid, dict) or set(grid) - {"defaults", "seeds", *AXES}:
            raise FpbenchError(f"{path}: [[grids]] entries hold only defaults, seeds and the axes")
    return grids


def _grid_plan(raw: dict[str, Any], grid: dict[str, Any], seeds: list[int], path: str):
    """A grid's defaults (merged over the suite's), axes (else the suite's) and seeds."""
    for where in (raw, grid):
        if not isinstance(where.get("defaults", {}), dict):
            raise FpbenchError(f"{path}: defaults must be a table ([defaults]), not a value")
    defaults = _deep_merge(raw.get("defaults", {}), grid.get("defaults", {}))
    axes = {axis: _entries(grid if axis in grid else raw, axis, path) for axis in AXES}
    grid_seeds = _seeds(grid["seeds"], path, "[[grids]] seeds") if "seeds" in grid else seeds
    return defaults, axes, grid_seeds


def _entries(raw: dict[str, Any], axis: str, path: str) -> list[dict[str, Any]]:
    entries = raw.get(axis)
    if not isinstance(entries, list) or not entries:
        raise FpbenchError(f"{path}: needs at least one [[{axis}]] entry with a name")
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise FpbenchError(f'{path}: every [[{axis}]] entry needs name = "..."')
    entries = [e for entry in entries for e in _swept(entry, axis, path)]
    labels = []
    for entry in entries:
        labels.append(entry.get("label", entry["name"]))
        check_label(labels[-1], f"[[{axis}]] label", path)
        if not isinstance(entry.get("overrides", {}), dict):
            raise FpbenchError(f"{path}: [[{axis}]] overrides must be a table {{ ... }}")
    dupes = sorted({label for label in labels if labels.count(label) > 1})
    if dupes:
        raise FpbenchError(f"{path}: [[{axis}]] entries share the label {dupes}; give each a label")
    return entries


def _swept(entry: dict[str, Any], axis: str, path: str) -> list[dict[str, Any]]:
    """An entry with `sweep = { arg = [v1, v2, ...], ... }`: one entry per combination.

    Each gets the combination's args and the label `label.format(arg=v, ...)` when the label
    has placeholders, else `label-arg=v-...`; a list value is written joined by "x".
    """
    sweep = entry.get("sweep")
    label = entry.get("label", entry["name"])
    if sweep is None or not isinstance(label, str):  # a bad label is reported by the caller
        return [entry]
    ok = isinstance(sweep, dict) and sweep
    if not ok or not all(isinstance(v, list) and v for v in sweep.values()):
        raise FpbenchError(
            f"{path}: [[{axis}]] sweep must be a table of non-empty lists, e.g. "
            "sweep = { shots = [1, 2, 4] }"
        )
    base = {k: v for k, v in entry.items() if k != "sweep"}
    out = []
    for combo in itertools.product(*sweep.values()):
        values = dict(zip(sweep, combo, strict=True))
        shown = {
            k: "x".join(map(str, v)) if isinstance(v, list) else str(v) for k, v in values.items()
        }
        try:
            name = (
                label.format(**shown)
                if "{" in label
                else "-".join([label, *(f"{k}={v}" for k, v in shown.items())])
            )
        except (KeyError, IndexError, ValueError) as e:
            raise FpbenchError(
                f"{path}: [[{axis}]] label {label!r} names a placeholder that is not swept ({e})"
            ) from None
        out.append({**base, **values, "label": name})
    return out


def resolve_cell(
    defaults: dict[str, Any],
    entries: tuple[dict[str, Any], ...],
    *,
    suite: str,
    seed: int,
    path: str = "<memory>",
) -> RunConfig:
    """Merge defaults and one entry per axis into a validated RunConfig."""
    merged = _deep_merge({}, defaults)
    for axis_key, entry in zip(AXES.values(), entries, strict=True):
        args = {k: v for k, v in entry.items() if k not in ("name", "label", "overrides")}
        base = merged.get(axis_key, {})
        if not isinstance(base, dict):
            raise FpbenchError(f"{path}: defaults.{axis_key} must be a table {{ key = value }}")
        merged[axis_key] = {
            "name": entry["name"],
            "label": entry.get("label", entry["name"]),
            "args": _deep_merge(_deep_merge({}, base), args),
        }
    for entry in entries:
        merged = _deep_merge(merged, entry.get("overrides", {}))
    where = f"{path} [{'/'.join(e.get('label', e['name']) for e in entries)}, seed {seed}]"
    try:
        cfg = RunConfig(suite=suite, seed=seed, **merged)
    except ValidationError as e:
        raise FpbenchError(f"{where}: {_first_error(e)}") from None
    return _validate_components(cfg, where)


def _validate_components(cfg: RunConfig, where: str) -> RunConfig:
    """Validate each component's args with its own Config; fill in all defaults."""
    resolved = {}
    for field, registry in (("dataset", DATASETS), ("partition", PARTITIONS), ("method", METHODS)):
        comp: Component = getattr(cfg, field)
        config_cls = _lookup(registry, comp.name, where).Config
        try:
            args = config_cls(**comp.args)
        except ValidationError as e:
            raise FpbenchError(f"{where}: {field}.{_first_error(e)}") from None
        resolved[field] = comp.model_copy(update={"args": args.model_dump(mode="json")})
    _lookup(BACKBONES, cfg.backbone.name, where)
    for profile in cfg.model_het.profiles if cfg.model_het else ():
        if profile.backbone is not None:
            _lookup(BACKBONES, profile.backbone.name, where)
    cfg = cfg.model_copy(update=resolved)
    _check_compatibility(cfg, where)
    return cfg


def _check_compatibility(cfg: RunConfig, where: str) -> None:
    """Cross-component checks that need the dataset's shape (e.g. s <= number of classes)."""
    dataset = DATASETS.get(cfg.dataset.name)
    partition = PARTITIONS.get(cfg.partition.name)
    info = dataset.info(dataset.Config(**cfg.dataset.args))
    try:
        partition.check(partition.Config(**cfg.partition.args), info)
    except FpbenchError as e:
        raise FpbenchError(f"{where}: {e}") from None
    wanted = cfg.partition.args.get("num_clients")
    if cfg.model_het and wanted is not None and wanted != cfg.model_het.num_clients:
        raise FpbenchError(
            f"{where}: model_het.profiles have {cfg.model_het.num_clients} clients in all but "
            f"partition.num_clients = {wanted}; make them equal"
        )


def _lookup(registry: Registry, name: str, where: str) -> Any:
    try:
        return registry.get(name)
    except FpbenchError as e:
        raise FpbenchError(f"{where}: {e}") from None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    got = (
        f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
    )
    return f"{loc}: {err['msg']}{got}"


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out
