"""The tuned suite: the suite with each tuned method's best values, as a suite file of its own.

`NAME+tuned.toml` holds the suite's defaults and axes, and one entry per tuned method: its own
entry with the best trial's values set (`method.args.*` as the entry's args, other paths under
its `overrides`) and the label `LABEL+tuned`, so its cells are stored under the suite name
`NAME+tuned` and every table marks the rows tuned. It runs on the test split with the suite's
own rounds (`fpbench run --suite NAME+tuned`). Tuning another method of the suite later adds
its entry to the same file, which refuses a method tuned with another budget.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import tomllib

from fpbench.errors import FpbenchError
from fpbench.suites import find_suite

TUNED = "+tuned"
_BUDGET = "fpbench tune budget: "


def tuned_label(label: str) -> str:
    return f"{label}{TUNED}"


def tuned_suite(
    suite: str, best: dict[str, dict[str, Any]], budget: str, existing: dict[str, Any] | None
) -> dict[str, Any]:
    """The raw tuned suite: `suite`'s file with the methods of `best` (label -> values) tuned,
    merged into `existing` (an earlier tuned file of the suite), whose budget must match.

    Raises:
        FpbenchError: a method entry tune cannot rewrite (in [[grids]], swept), or a budget
            other than the existing file's.
    """
    raw = tomllib.loads(find_suite(suite).read_text())
    name = raw.get("name", find_suite(suite).stem)
    if any("methods" in g for g in raw.get("grids", [])):
        raise FpbenchError(f"suite {suite}: tune rewrites top-level [[methods]], not grids'")
    entries = []
    for label, values in best.items():
        found = [e for e in raw["methods"] if e.get("label", e["name"]) == label]
        if len(found) != 1 or "sweep" in found[0]:
            raise FpbenchError(f"suite {suite}: method {label!r} is not one unswept entry")
        entries.append(with_values(found[0], values))
    description = f"{name} with tuned methods; {_BUDGET}{budget}"
    if existing is not None:
        if existing.get("description") != description:
            raise FpbenchError(
                f"the tuned suite {name}{TUNED} was tuned with another budget "
                f"({existing.get('description', '').partition(_BUDGET)[2] or 'unknown'}; now "
                f"{budget}): methods compared need the same; write to another --out"
            )
        mine = {e["label"] for e in entries}
        entries = [e for e in existing["methods"] if e["label"] not in mine] + entries
    out = {k: v for k, v in raw.items() if k != "methods"}
    return {**out, "name": f"{name}{TUNED}", "description": description, "methods": entries}


def with_values(entry: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """A method entry with config paths set: `method.args.X` as its arg X, the rest under its
    `overrides` (e.g. `train.lr` -> overrides.train.lr)."""
    out = copy.deepcopy(entry)
    out["label"] = tuned_label(entry.get("label", entry["name"]))
    for path, value in values.items():
        keys = path.split(".")
        if keys[:2] == ["method", "args"]:
            node, keys = out, keys[2:]
        else:
            node = out.setdefault("overrides", {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return out


def write_toml(raw: dict[str, Any], path: Path) -> None:
    """`raw` as a TOML file, one `key = value` line per top-level key (inline tables)."""
    lines = ["# written by `fpbench tune`: the best configuration of each tuned method"]
    lines += [f"{_key(k)} = {_value(v)}" for k, v in raw.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # parallel workers write the same file
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if v != v else repr(v)
    if isinstance(v, int | str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + " }"
    raise FpbenchError(f"cannot write {v!r} to a suite file")
