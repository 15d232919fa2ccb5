"""Each method's own training recipe, as data, and the protocol rules made from it.

`benchmarks/protocols/recipes.toml` has one table per method (its registry name) with the
settings of its official code, each `{ value = ..., source = "Name/path:line@commit ..." }`
(a code reference into the checkout of its official code, or a spec `file:line`; see
`fpbench.report.sources`). A setting fpbench cannot run as stated also carries
`deviation = { runs = ..., reason = "...", impossible = "why" }`: what every suite runs instead.
The settings and the config paths they are held to are `SETTINGS`.

`recipe_blocks` makes the protocol rules of a suite that runs every method with its own recipe
("own") or one common recipe for all (FLiP's "aligned settings"), declaring each method's
departures from its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib

from fpbench.errors import FpbenchError

SETTINGS = {
    "optimizer": "train.optimizer",
    "lr": "train.lr",
    "momentum": "train.momentum",
    "adam_beta2": "train.adam_beta2",
    "adam_eps": "train.adam_eps",
    "weight_decay": "train.weight_decay",
    "batch_size": "train.batch_size",
    "local_epochs": "train.local_epochs",
    "max_local_steps": "train.max_local_steps",
    "rounds": "train.rounds",
    "lr_schedule": "train.lr_schedule",
    "augment": "train.augment",
    "precision": "runtime.precision",
}
SETTING_KEYS = {"value", "source", "deviation"}
COMMON_KEYS = {"value", "source", "deviation", "reason", "methods"}
ARGS = "args"  # a recipe's `args = { source }`: the official file of the method's defaults


def load_recipes(root: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """method name -> setting -> {value, source[, deviation]}, validated.

    Raises:
        FpbenchError: a missing file, an unknown setting, or a setting without value or source.
    """
    path = root / "recipes.toml"
    if not path.is_file():
        raise FpbenchError(f"no method recipes at {path}")
    return parse_recipes(tomllib.loads(path.read_text()), str(path))


def parse_recipes(data: Mapping[str, Any], where: str = "<memory>") -> dict[str, Any]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for method, settings in data.items():
        if not isinstance(settings, Mapping):
            raise FpbenchError(f"{where}: [{method}] is a table of settings")
        out[method] = {}
        for key, spec in settings.items():
            at = f"{where} [{method}] {key}"
            if key == ARGS:
                if not isinstance(spec, Mapping) or set(spec) != {"source"}:
                    raise FpbenchError(f"{at}: args = {{ source = '...' }}")
                out[method][key] = dict(spec)
                continue
            if key not in SETTINGS:
                raise FpbenchError(f"{at}: unknown setting; valid: {', '.join(SETTINGS)}")
            if not isinstance(spec, Mapping) or set(spec) - SETTING_KEYS or not spec.get("source"):
                raise FpbenchError(f"{at}: {{ value = ..., source = '...' }} (optional deviation)")
            dev = spec.get("deviation")
            if dev is not None and not _deviation_form(dev):
                raise FpbenchError(
                    f'{at}: deviation = {{ runs = ..., reason = "...", impossible = "..." }}'
                )
            out[method][key] = dict(spec)
    return out


def _match(method: str) -> dict[str, Any]:
    return {"config": {"method": {"name": method}}}


def recipe_blocks(
    recipes: Mapping[str, Any],
    common: Mapping[str, Any],
    methods: Iterable[str],
    mode: str,
    where: str = "<memory>",
) -> list[dict[str, Any]]:
    """Protocol blocks (`{match, rules}`, match by method name) holding each method of a suite
    to a recipe.

    `common` is the suite's common recipe: setting -> {value, source, optional deviation =
    {runs, reason} where the suite cannot run its anchor's value, optional methods = {name:
    {value, source, optional deviation, reason}}} (a method's exception). Mode "aligned": every
    method runs the common recipe; a setting is pinned where the method's own recipe agrees or
    states nothing, and declared (its own value, what the suite runs, and why) where it
    departs. Mode "own": every method runs its own recipe (pinned, or the recipe's declared
    deviation where fpbench cannot run it); the common recipe fills what its recipe lacks.
    """
    for key, spec in common.items():
        at = f"{where} [common.{key}]"
        if key not in SETTINGS:
            raise FpbenchError(f"{at}: unknown setting; valid: {', '.join(SETTINGS)}")
        if not isinstance(spec, Mapping) or {"value", "source"} - set(spec):
            raise FpbenchError(f"{at}: {{ value = ..., source = '...' }} (optional methods)")
        dev = spec.get("deviation")
        if dev is not None and not _deviation_form(dev):
            raise FpbenchError(
                f'{at}: deviation = {{ runs = ..., reason = "...", impossible = "..." }}'
            )
    blocks = []
    for method in sorted(set(methods)):
        own_recipe = recipes.get(method, {})
        keys = list(common) + [
            k for k in own_recipe if mode == "own" and k not in common and k != ARGS
        ]
        rules = [_rule(key, own_recipe.get(key), common, method, mode, where) for key in keys]
        if rules:
            blocks.append({"match": _match(method), "rules": rules})
    return blocks


def _rule(
    key: str, own: Mapping[str, Any] | None, common: Mapping[str, Any], method: str, mode: str,
    where: str,
) -> dict[str, Any]:  # fmt: skip
    runs = None  # the suite's setting for this method: {value, source, deviation?, reason?}
    if key in common:
        runs = common[key].get("methods", {}).get(method, common[key])
        if {"value", "source"} - set(runs) or set(runs) - COMMON_KEYS:
            raise FpbenchError(
                f"{where} [common.{key}] methods.{method}: value and source (optional "
                "deviation, reason)"
            )
    rule: dict[str, Any] = {"path": SETTINGS[key]}
    if own is None or (mode == "own" and runs is None):
        picked = runs if own is None else own
        return rule | {k: v for k, v in picked.items() if k in SETTING_KEYS}
    if mode == "own":
        return rule | own
    assert runs is not None
    dev = runs.get("deviation")
    value = dev["runs"] if dev else runs["value"]
    if _same(own["value"], value):
        return rule | {"value": own["value"], "source": f"{own['source']}; {runs['source']}"}
    why = (dev or {}).get("reason") or runs.get("reason") or "the suite's common recipe"
    impossible = (dev or {}).get("impossible") or ALIGNED
    return rule | {
        "value": own["value"], "source": own["source"],
        "deviation": {
            "runs": value, "reason": f"{why} ({runs['source']})", "impossible": impossible,
        },
    }  # fmt: skip


# why an aligned suite cannot run a method's own stated value: it exists to hold every method
# to its anchor's one recipe (the suite of own recipes runs the other reading)
ALIGNED = (
    "the suite holds every method to its anchor's one recipe; the method's own value runs in "
    "the suite of own recipes"
)


def _deviation_form(dev: Mapping[str, Any]) -> bool:
    """A deviation has runs and a reason, and may say why the stated value is impossible here."""
    return {"runs", "reason"} <= set(dev) <= {"runs", "reason", "impossible"} and bool(
        dev["reason"]
    )


def defaults_blocks(
    recipes: Mapping[str, Any], cells: Iterable[tuple[str, Mapping[str, Any]]], where: str
) -> list[dict[str, Any]]:
    """Rules pinning each method argument a suite leaves at its registered default, and the
    method's readings (`readings.*`), to what fpbench's method runs: defaults from the official
    code (its docstring, held there by its differential test), sourced by the recipe's `args`.

    `cells` are (method name, method args) of the suite's cells; an argument a cell sets to
    another value needs a rule of the suite's own.
    """
    from fpbench.registry import METHODS
    from fpbench.report.method_readings import method_readings

    args: dict[str, list[Mapping[str, Any]]] = {}
    for name, cell_args in cells:
        args.setdefault(name, []).append(cell_args)
    blocks = []
    for name in sorted(args):
        source = recipes.get(name, {}).get(ARGS, {}).get("source")
        if source is None:
            raise FpbenchError(f"{where}: method {name!r} has no args source in recipes.toml")
        defaults = METHODS.get(name).Config().model_dump(mode="json")
        rules: list[dict[str, Any]] = [
            {"path": "readings", "value": method_readings(name), "source": source}
        ]
        for key, value in defaults.items():
            if any(_same(a.get(key), value) for a in args[name]):
                rules.append({
                    "path": f"method.args.{key}", "value": value, "source": source,
                    "match": {"config": {"method": {"args": {key: value}}}},
                })  # fmt: skip
        blocks.append({"match": _match(name), "rules": rules})
    return blocks


def _same(a: Any, b: Any) -> bool:
    from fpbench.report.protocol import same

    return same(a, b)
