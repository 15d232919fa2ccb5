"""Suites: TOML in, validated `RunConfig`s (`fpbench.specs`) out, one per cell.

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
    [[methods]]                # a learner with a federation strategy and its settings
    name = "kgcoop"
    strategy = { name = "fedprox", mu = 0.01 }

A suite may also list ``[[strategies]]`` (each: name, optional label, settings): every method is
then crossed with every strategy, its label `method+strategy`. Without a strategy a cell runs its
method's own federation (`fpbench.strategies`); `fedavg` without settings is that same cell.

The cells are datasets x partitions x methods x seeds. A cell's config is the deep merge of the
defaults, the three entries (in that order) and their ``overrides``; every component's args are
validated by that component's own ``Config`` so the stored config carries all defaults.

A suite whose datasets need different partitions lists several grids: each ``[[grids]]`` entry
has its own axes (an axis it omits is the suite's) and ``defaults`` merged over the suite's; the
cells are the union of the grids' cells.

``fpbench run --set PATH=VALUE`` (`load_suite`'s ``sets``) sets a path of every cell's resolved
config (``train.rounds``, ``method.args.prompt_len``) after everything else is merged, validated
like the file's own values. Such cells are other cells (other run keys), so a suite loaded with
sets that change results is stored under its own name, ``NAME+PATH=VALUE,...`` (`sets_name`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import tomllib
from pydantic import ValidationError

from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, STRATEGIES, Registry
from fpbench.shipped import shipped_dir
from fpbench.specs import MAX_LABEL, Component, Evaluation, RunConfig, Suite, first_error

AXES = {"datasets": "dataset", "partitions": "partition", "methods": "method"}
SUITE_DIR = shipped_dir()  # the shipped suites: package data, or benchmarks/ in a checkout
MAX_CELLS = 100_000  # a suite larger than this is almost surely a typo in a grid
# suite names and labels end up in tables, plots and the database, never in file paths; still,
# nothing that looks like a path (separators, "..", control characters) is accepted
_LABEL = re.compile(r"[^\x00-\x1f\x7f/\\]+")


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


def load_suite(
    name_or_path: str,
    sets: Mapping[str, Any] | None = None,
    methods: Collection[str] | None = None,
) -> Suite:
    """Read, expand and validate a suite; raises FpbenchError with file and field on bad input.

    Args:
        sets: config path -> value, set in every cell last (see `set_overrides`); the suite
            is then named `sets_name(name, sets)`.
        methods: only the cells of these methods (labels or names) are resolved, so that a
            set path only they have (`method.args.prompt_len`) does not fail on the others.
    """
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
    name = raw.get("name", path.stem)
    if sets:
        check_label(name, "suite name", str(path))
        name = sets_name(name, sets)
    return expand_suite(raw, name=name, path=str(path), sets=sets, methods=methods)


# where --set may write: a RunConfig section, or a component's args
SET_SECTIONS = ("train", "backbone", "runtime", "model_het", "evaluation")
SET_COMPONENTS = ("dataset", "partition", "method")


def set_overrides(sets: Mapping[str, Any]) -> dict[str, Any]:
    """`--set` paths and values as one nested table, merged over every cell's config.

    A path names a field of the resolved config, as stored: `train.rounds`,
    `backbone.name`, `runtime.device`, `method.args.prompt_len` (a component's own
    settings are under `.args`).

    Raises:
        FpbenchError: a path outside those sections, or two paths that overlap.
    """
    out: dict[str, Any] = {}
    sections = [f"{s}." for s in SET_SECTIONS] + [f"{c}.args." for c in SET_COMPONENTS]
    for path, value in sets.items():
        keys = path.split(".")
        in_args = keys[0] in SET_COMPONENTS and len(keys) >= 3 and keys[1] == "args"
        if not all(keys) or not (in_args or (keys[0] in SET_SECTIONS and len(keys) >= 2)):
            raise FpbenchError(
                f"--set {path}: not a settable path; it starts with one of "
                f"{', '.join(sections)} (e.g. train.rounds=2, method.args.prompt_len=5)"
            )
        node = out
        for depth, key in enumerate(keys[:-1]):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise FpbenchError(f"--set {path}: {'.'.join(keys[: depth + 1])} is set too")
        if keys[-1] in node:
            raise FpbenchError(f"--set {path}: given twice or inside another --set")
        node[keys[-1]] = value
    return out


def sets_name(suite: str, sets: Mapping[str, Any]) -> str:
    """The name a suite's cells are stored under with `sets`: `suite+path=value,...`.

    `runtime.*` paths leave the name alone (they do not change results). A name that would
    be too long or hold a path separator ends in a hash of the sets instead.
    """
    shown = {
        k: v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
        for k, v in sets.items()
        if not k.startswith("runtime.")
    }
    if not shown:
        return suite
    name = f"{suite}+" + ",".join(f"{k}={v}" for k, v in shown.items())
    if len(name) <= MAX_LABEL and _LABEL.fullmatch(name):
        return name
    blob = json.dumps(shown, sort_keys=True).encode()
    return f"{suite[: MAX_LABEL - 14]}+set-{hashlib.sha256(blob).hexdigest()[:8]}"


def expand_suite(
    raw: dict[str, Any],
    *,
    name: str,
    path: str = "<memory>",
    sets: Mapping[str, Any] | None = None,
    methods: Collection[str] | None = None,
) -> Suite:
    known = {"name", "description", "seeds", "defaults", "grids", "strategies", *AXES}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise FpbenchError(f"{path}: unknown top-level key(s) {unknown}; valid: {sorted(known)}")
    check_label(name, "suite name", path)
    if not isinstance(raw.get("description", ""), str):
        raise FpbenchError(f"{path}: description must be a string")
    seeds = _seeds(raw.get("seeds", [0]), path)
    forced = set_overrides(sets or {})
    plans = [_grid_plan(raw, grid, seeds, path) for grid in _grids(raw, path)]
    total = sum(math.prod(map(len, axes.values())) * len(st) * len(s) for _, axes, st, s in plans)
    if total > MAX_CELLS:
        raise FpbenchError(
            f"{path}: the grid expands to {total:,} cells, more than the limit of {MAX_CELLS:,}; "
            "check the lists (seeds, [[methods]], ...) or split the suite into several files"
        )
    cells = []
    for defaults, axes, strategies, grid_seeds in plans:
        for ds, part, meth, strat, seed in itertools.product(
            *axes.values(), strategies, grid_seeds
        ):
            meth = _with_strategy(meth, strat, path)
            if methods and not {meth["name"], meth.get("label", meth["name"])} & set(methods):
                continue
            cells.append(
                resolve_cell(
                    defaults, (ds, part, meth), suite=name, seed=seed, path=path, sets=forced
                )
            )
    if not cells:
        raise FpbenchError(f"{path}: no cells of methods {sorted(methods or [])}")
    keys = [c.run_key for c in cells]
    if len(set(keys)) != len(keys):
        why = "--set makes them equal" if forced else "remove the duplicate"
        raise FpbenchError(f"{path}: two cells resolve to the same config; {why}")
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
        if not isinstance(grid, dict) or set(grid) - {"defaults", "seeds", "strategies", *AXES}:
            raise FpbenchError(f"{path}: [[grids]] entries hold only defaults, seeds and the axes")
    return grids


def _grid_plan(raw: dict[str, Any], grid: dict[str, Any], seeds: list[int], path: str):
    """A grid's defaults (merged over the suite's), axes (else the suite's) and seeds."""
    for where in (raw, grid):
        if not isinstance(where.get("defaults", {}), dict):
            raise FpbenchError(f"{path}: defaults must be a table ([defaults]), not a value")
    defaults = _deep_merge(raw.get("defaults", {}), grid.get("defaults", {}))
    axes = {axis: _entries(grid if axis in grid else raw, axis, path) for axis in AXES}
    where = grid if "strategies" in grid else raw
    strategies = _entries(where, "strategies", path) if "strategies" in where else [None]
    grid_seeds = _seeds(grid["seeds"], path, "[[grids]] seeds") if "seeds" in grid else seeds
    return defaults, axes, strategies, grid_seeds


def _with_strategy(
    method: dict[str, Any], strategy: dict[str, Any] | None, path: str
) -> dict[str, Any]:
    """A [[methods]] entry crossed with a [[strategies]] entry: its strategy, label `m+s`."""
    if strategy is None:
        return method
    if "strategy" in method:
        raise FpbenchError(
            f"{path}: [[methods]] {method.get('label', method['name'])!r} names a strategy and "
            "the suite lists [[strategies]]: give one or the other"
        )
    settings = {k: v for k, v in strategy.items() if k not in ("label", "overrides")}
    label = f"{method.get('label', method['name'])}+{strategy.get('label', strategy['name'])}"
    return {**method, "strategy": settings, "label": label}


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
    sets: dict[str, Any] | None = None,
) -> RunConfig:
    """Merge defaults and one entry per axis (then `sets`, see `set_overrides`) into a
    validated RunConfig."""
    merged = _deep_merge({}, defaults)
    for axis_key, entry in zip(AXES.values(), entries, strict=True):
        args = {
            k: v for k, v in entry.items() if k not in ("name", "label", "overrides", "strategy")
        }
        base = merged.get(axis_key, {})
        if not isinstance(base, dict):
            raise FpbenchError(f"{path}: defaults.{axis_key} must be a table {{ key = value }}")
        merged[axis_key] = {
            "name": entry["name"],
            "label": entry.get("label", entry["name"]),
            "args": _deep_merge(_deep_merge({}, base), args),
        }
        if axis_key == "method" and "strategy" in entry:
            merged["method"]["strategy"] = _strategy_ref(entry["strategy"], path)
    for entry in entries:
        merged = _deep_merge(merged, entry.get("overrides", {}))
    merged = _deep_merge(merged, sets or {})
    where = f"{path} [{'/'.join(e.get('label', e['name']) for e in entries)}, seed {seed}]"
    if sets:
        where += " with --set"
    try:
        cfg = RunConfig(suite=suite, seed=seed, **merged)
    except ValidationError as e:
        raise FpbenchError(f"{where}: {first_error(e)}") from None
    return _validate_components(cfg, where)


def _strategy_ref(value: Any, path: str) -> dict[str, Any]:
    """A method entry's `strategy = { name = "...", setting = value, ... }` as stored."""
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        raise FpbenchError(
            f'{path}: strategy must be a table with a name, e.g. strategy = {{ name = "fedprox", '
            f"mu = 0.01 }}; got {value!r}"
        )
    return {"name": value["name"], "args": {k: v for k, v in value.items() if k != "name"}}


def _validate_strategy(cfg: RunConfig, where: str) -> RunConfig:
    """The strategy's settings validated by its Config and checked against the learner; a
    strategy that is the method's own federation (`fedavg`) is stored as none."""
    ref = cfg.method.strategy
    if ref is None:
        return cfg
    strategy = _lookup(STRATEGIES, ref.name, where)
    try:
        args = strategy.Config(**ref.args).model_dump(mode="json")
    except ValidationError as e:
        raise FpbenchError(f"{where}: method.strategy.{first_error(e)}") from None
    try:
        strategy.check(METHODS.get(cfg.method.name))
    except FpbenchError as e:
        raise FpbenchError(f"{where}: {e}") from None
    resolved = None if ref.name == "fedavg" else ref.model_copy(update={"args": args})
    return cfg.model_copy(update={"method": cfg.method.model_copy(update={"strategy": resolved})})


def _validate_components(cfg: RunConfig, where: str) -> RunConfig:
    """Validate each component's args with its own Config; fill in all defaults."""
    resolved = {}
    for field, registry in (("dataset", DATASETS), ("partition", PARTITIONS), ("method", METHODS)):
        comp: Component = getattr(cfg, field)
        config_cls = _lookup(registry, comp.name, where).Config
        try:
            args = config_cls(**comp.args)
        except ValidationError as e:
            raise FpbenchError(f"{where}: {field}.{first_error(e)}") from None
        resolved[field] = comp.model_copy(update={"args": args.model_dump(mode="json")})
    if cfg.evaluation is not None and cfg.evaluation.targets:
        targets = []
        for t in cfg.evaluation.targets:
            config_cls = _lookup(DATASETS, t.name, where).Config
            try:
                args = config_cls(**t.args)
            except ValidationError as e:
                raise FpbenchError(f"{where}: evaluation.targets.{first_error(e)}") from None
            targets.append(t.model_copy(update={"args": args.model_dump(mode="json")}))
        evaluation = cfg.evaluation.model_copy(update={"targets": tuple(targets)})
        resolved["evaluation"] = evaluation
    _lookup(BACKBONES, cfg.backbone.name, where)
    for profile in cfg.model_het.profiles if cfg.model_het else ():
        if profile.backbone is not None:
            _lookup(BACKBONES, profile.backbone.name, where)
    cfg = _validate_strategy(cfg.model_copy(update=resolved), where)
    _check_compatibility(cfg, where)
    return cfg


def _check_compatibility(cfg: RunConfig, where: str) -> None:
    """Cross-component checks that need the dataset's shape (e.g. s <= number of classes)."""
    dataset = DATASETS.get(cfg.dataset.name)
    partition = PARTITIONS.get(cfg.partition.name)
    info = _mode_info(cfg.evaluation, dataset.info(dataset.Config(**cfg.dataset.args)))
    if info.train_size == 0:
        raise FpbenchError(
            f"{where}: dataset {cfg.dataset.name!r} is test-only (it has no train split); "
            "score it as an evaluation target (evaluation.targets) of a run on its source"
        )
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


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _mode_info(evaluation: Evaluation | None, info: Any) -> Any:
    """What the run's partition sees of a dataset (its `DatasetInfo`) under `evaluation`."""
    if evaluation is None:
        return info
    if evaluation.mode == "base2novel":
        return dataclasses.replace(info, num_classes=math.ceil(info.num_classes / 2))
    if evaluation.mode == "leave-one-domain-out":
        return dataclasses.replace(info, num_domains=info.num_domains - 1)
    return info
