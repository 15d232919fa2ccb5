"""Search spaces: per method, the config paths `fpbench tune` searches and their ranges, as data.

`fpbench/tune/search-spaces.toml` (package data; `--space` reads another) holds one table per
registered method name; each key is a config
path as `--set` takes it (`train.lr`, `method.args.prompt_len`), each value a range::

    [fedvpt]
    "train.lr" = { low = 0.001, high = 0.3, log = true, source = '...' }
    "method.args.prompt_len" = { choices = [1, 5, 20, 50], source = '...' }

`low`/`high` integers give an int range (optional `step`), floats a float range (optional
`log`), `choices` a categorical. Every range names its source as the paper protocols do
(`fpbench.report.sources`): a `file:line "quote"` of the paper or reference-code spec the range
comes from, or `silent: ...` with why fpbench chose these bounds where the paper gives none.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from fpbench.errors import FpbenchError

FILE = "search-spaces.toml"
_KEYS = {"low", "high", "log", "step", "choices", "source"}


@dataclass(frozen=True)
class Param:
    """One searched config path and its range."""

    path: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    step: int | None = None
    choices: tuple[Any, ...] | None = None
    source: str = ""

    @property
    def example(self) -> Any:
        """A value of the range (its first choice, else its low end)."""
        return self.choices[0] if self.choices is not None else self.low

    @property
    def last(self) -> Any:
        """The other end of the range (its last choice, else its high end)."""
        return self.choices[-1] if self.choices is not None else self.high

    @property
    def kind(self) -> str:
        if self.choices is not None:
            return "categorical"
        return "int" if isinstance(self.low, int) and isinstance(self.high, int) else "float"

    def suggest(self, trial: Any) -> Any:
        """The trial's value (an `optuna.Trial`'s suggest_* under the path as its name)."""
        if self.kind == "categorical":
            return trial.suggest_categorical(self.path, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.path, self.low, self.high, step=self.step or 1,
                                     log=self.log)  # fmt: skip
        return trial.suggest_float(self.path, self.low, self.high, log=self.log)


SHIPPED = Path(__file__).with_name(FILE)  # not in benchmarks/, where every .toml is a suite


def load_spaces(path: Path) -> dict[str, tuple[Param, ...]]:
    """Every method's search space in `path`, validated.

    Raises:
        FpbenchError: an unreadable file, or a range that is malformed, empty or unsourced.
    """
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise FpbenchError(f"cannot read search spaces {path}: {e}") from None
    spaces = {}
    for method, table in raw.items():
        if not isinstance(table, dict):
            raise FpbenchError(f"{path}: [{method}] must be a table of config paths")
        spaces[method] = tuple(_param(path, method, p, r) for p, r in table.items())
    return spaces


def space_for(method: str, path: Path) -> tuple[Param, ...]:
    """The search space of registered method `method`.

    Raises:
        FpbenchError: the file has no table for it, or an empty one.
    """
    spaces = load_spaces(path)
    if method not in spaces:
        listed = ", ".join(sorted(spaces)) or "none"
        raise FpbenchError(f"{path}: no search space for method {method!r} (it has: {listed})")
    if not spaces[method]:
        raise FpbenchError(f"{path}: the search space of method {method!r} is empty")
    return spaces[method]


def fingerprint(space: tuple[Param, ...]) -> str:
    """A short hash of the ranges (not their sources): a changed space is another study."""
    blob = [(p.path, p.low, p.high, p.log, p.step, p.choices) for p in space]
    return hashlib.sha256(json.dumps(blob, default=list).encode()).hexdigest()[:8]


def _param(file: Path, method: str, path: str, r: Any) -> Param:
    where = f"{file}: [{method}] {path!r}"
    if not isinstance(r, dict) or set(r) - _KEYS:
        raise FpbenchError(f"{where}: a range is a table of {sorted(_KEYS)}")
    if not isinstance(r.get("source"), str) or not r["source"].strip():
        raise FpbenchError(f"{where}: needs a source (a paper quote, file:line, or silent: why)")
    if path.split(".")[0] == "runtime":
        raise FpbenchError(f"{where}: runtime settings do not change results; search others")
    if "choices" in r:
        choices = r["choices"]
        if set(r) - {"choices", "source"} or not isinstance(choices, list) or not choices:
            raise FpbenchError(f"{where}: choices is a non-empty list, without low/high")
        return Param(path, choices=tuple(choices), source=r["source"])
    low, high = r.get("low"), r.get("high")
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (low, high))
    if not numbers or not (math.isfinite(low) and math.isfinite(high)) or not low < high:
        raise FpbenchError(f"{where}: needs numbers low < high, got low={low!r} high={high!r}")
    log = r.get("log", False)
    if log and low <= 0:
        raise FpbenchError(f"{where}: a log range needs low > 0, got {low}")
    step = r.get("step")
    if step is not None and not (isinstance(step, int) and step >= 1 and isinstance(low, int)):
        raise FpbenchError(f"{where}: step is a positive integer of an int range")
    return Param(path, low, high, bool(log), step, source=r["source"])
