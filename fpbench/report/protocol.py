"""A paper's protocol as data, and the check that holds the suites feeding its tables to it.

A paper data file (`benchmarks/papers/<paper>.toml`, see `fpbench.report.paper`) may carry, beside
its `[[tables]]`, `[[protocol]]` blocks: rules on the resolved configs of the suite cells that
feed some of its tables (format: the README section "Paper protocols"). The cells
feeding a table are those its cells select (suite, method, dataset, partition labels and
`config`, as `fpbench table --paper` selects runs), taken from `fpbench.suites.load_suite`.

A rule pins one dotted path of `RunConfig.model_dump(mode="json")` (or the virtual path `seeds`:
the sorted seeds of each cell over its seeds; or `readings.<key>`: what the method's code does
where paper and reference code leave a choice, declared in `fpbench.report.method_readings`, leaf
paths like any other and not the `[[readings]]` metric blocks below) to the paper's `value`, or,
where the rule declares a `deviation`, to what fpbench runs instead (`deviation.runs`, with a
one-line `reason`).
TOML has no null: the string "null" stands for None. A `match` maps run labels (suite, method,
dataset, partition) to an fnmatch glob or a list of them: a label matches when it matches any of
its positive globs (or there are none) and none of its negative ones ("!fedpr" leaves fedpr out);
`config`, a nested table, selects the cells whose resolved config contains it (as a paper
table's cells select runs, e.g. FGPT Table 8's rows by `train.local_epochs`).

Completeness: every leaf path of every feeding cell's resolved config (`leaf_paths`) must be
covered by a rule of a block that selects the cell: *pinned* (a paper value), *declared* (a
deviation) or *free* (`free = "why it cannot change the table's number"`, no value). A rule's
path may be an fnmatch glob ("runtime.*"); a path also covers everything below it, and `seeds`
covers `seed`. `coverage` names every uncovered (cell, path) and counts the paths of each kind.

Metric readings: `[[readings]]` blocks say which metric each column of a table reads (`tables`,
optional `columns` / `rows` globs over the column and row keys, `metric`, `source`);
`check_readings` fails on a filled cell without a reading or reading another metric.

Sources (`fpbench.report.sources`): every pinned or declared rule and every reading names a
checkable source, a verbatim quote of its paper or a `file:line` of a spec of reference code.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from fpbench.errors import FpbenchError
from fpbench.report.method_readings import method_readings
from fpbench.report.paper import (
    PAPERS_DIR,
    SELECT,
    Paper,
    PaperTable,
    _contains,
    load_paper,
    paper_data,
)

UNSTATED = "unstated"
NULL = "null"
SEEDS = "seeds"
CONFIG = "config"
READINGS = "readings"  # virtual config section: the method's readings (method_readings)
REL_TOL = 1e-9


@dataclass(frozen=True)
class Deviation:
    """What fpbench runs instead of the paper's value, and why (`impossible`: why the stated
    value cannot be run here, required where the paper or its code states one)."""

    runs: Any
    reason: str
    impossible: str | None = None


PINNED, DECLARED, FREE = "pinned", "declared", "free"


@dataclass(frozen=True)
class Rule:
    path: str
    value: Any
    source: str
    match: Mapping[str, Any] = field(default_factory=dict)
    deviation: Deviation | None = None
    free: str | None = None  # why the path cannot change the table's number (no value then)
    perturb: Any = (
        None  # a free path's value in the proof that it is free (fpbench.report.free_proof)
    )

    @property
    def expected(self) -> Any:
        """The value a cell must resolve to: the paper's, or the declared deviation's."""
        return self.deviation.runs if self.deviation else self.value

    @property
    def kind(self) -> str:
        return FREE if self.free is not None else DECLARED if self.deviation else PINNED

    @cached_property
    def is_glob(self) -> bool:
        return any(ch in self.path for ch in "*?[")

    def covers(self, leaf: str) -> bool:
        """Whether this rule's path is `leaf` or above it (`seeds` covers `seed`)."""
        if self.path == SEEDS:
            return leaf == "seed"
        if not self.is_glob:
            return leaf == self.path or leaf.startswith(self.path + ".")
        return fnmatch.fnmatchcase(leaf, self.path) or fnmatch.fnmatchcase(leaf, self.path + ".*")


@dataclass(frozen=True)
class Block:
    """One `[[protocol]]` block: rules for the cells feeding `tables` (narrowed by `match`)."""

    index: int
    tables: tuple[int, ...]
    rules: tuple[Rule, ...]
    match: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FedCell:
    """A suite cell feeding a paper table: its labels and resolved config (JSON form)."""

    suite: str
    method: str
    dataset: str
    partition: str
    seed: int
    config: Mapping[str, Any]
    tables: frozenset[int]

    @property
    def name(self) -> str:
        return f"{self.suite}: {self.method}/{self.dataset}/{self.partition}"

    def label(self, key: str) -> str:
        return str(getattr(self, key))


@dataclass(frozen=True)
class Finding:
    """A cell that does not run what the protocol says."""

    block: int
    tables: tuple[int, ...]
    cell: str
    path: str
    expected: Any
    got: Any
    source: str
    declared: bool

    def __str__(self) -> str:
        what = "declared deviation" if self.declared else "paper value"
        tables = ",".join(map(str, self.tables))
        return (
            f"table(s) {tables}, cell {self.cell}: {self.path} = {self.got!r}, "
            f"protocol {what} {self.expected!r} ({self.source})"
        )


# -- loading ---------------------------------------------------------------------------------


def load_protocol(name: str, root: Path = PAPERS_DIR) -> list[Block]:
    """The `[[protocol]]` blocks of paper `name` (empty when it has none).

    Raises:
        FpbenchError: unknown paper, or a malformed block or rule.
    """
    return parse_protocol(paper_data(name, root), f"{name}.toml")


def parse_protocol(data: Mapping[str, Any], where: str = "<memory>") -> list[Block]:
    """Blocks from a parsed paper data file."""
    return [_block(i, b, where) for i, b in enumerate(data.get("protocol", []))]


def _block(i: int, raw: Mapping[str, Any], where: str) -> Block:
    at = f"{where} protocol block {i + 1}"
    unknown = sorted(set(raw) - {"tables", "match", "rules"})
    if unknown:
        raise FpbenchError(f"{at}: unknown key(s) {unknown}; valid: match, rules, tables")
    tables = raw.get("tables")
    if not tables or not all(isinstance(t, int) for t in tables):
        raise FpbenchError(f"{at}: tables must be a non-empty list of table numbers")
    rules = tuple(_rule(r, f"{at} rule {j + 1}") for j, r in enumerate(raw.get("rules", [])))
    if not rules:
        raise FpbenchError(f"{at}: no rules")
    return Block(i + 1, tuple(tables), rules, _match(raw.get("match", {}), at))


def _match(raw: Any, at: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping) or set(raw) - {*SELECT, CONFIG}:
        raise FpbenchError(f"{at}: match takes labels {', '.join(SELECT)} and config, got {raw!r}")
    if CONFIG in raw and (not isinstance(raw[CONFIG], Mapping) or not raw[CONFIG]):
        raise FpbenchError(f"{at}: match config is a non-empty table, got {raw[CONFIG]!r}")
    out: dict[str, Any] = {
        k: tuple(map(str, v)) if isinstance(v, list) else (str(v),)
        for k, v in raw.items()
        if k != CONFIG
    }
    if any(not globs for globs in out.values()):
        raise FpbenchError(f"{at}: a match label needs at least one glob, got {raw!r}")
    if CONFIG in raw:
        out[CONFIG] = dict(raw[CONFIG])
    return out


def _rule(raw: Mapping[str, Any], at: str) -> Rule:
    if "free" in raw:
        return _free_rule(raw, at)
    unknown = sorted(set(raw) - {"path", "value", "source", "match", "deviation"})
    missing = [k for k in ("path", "value", "source") if k not in raw]
    if unknown or missing:
        raise FpbenchError(
            f"{at}: needs path, value, source (optional match, deviation), or path and free; "
            f"unknown {unknown}, missing {missing}"
        )
    at = f"{at} ({raw['path']})"
    dev = raw.get("deviation")
    if dev is not None:
        keys = set(dev) if isinstance(dev, Mapping) else set()
        if not {"runs", "reason"} <= keys <= {"runs", "reason", "impossible"} or not dev["reason"]:
            raise FpbenchError(
                f'{at}: deviation = {{ runs = ..., reason = "one line" }} (and impossible = '
                '"why the stated value cannot run here", where the value is stated)'
            )
        impossible = str(dev["impossible"]).strip() if "impossible" in dev else None
        dev = Deviation(dev["runs"], str(dev["reason"]), impossible or None)
        if raw["value"] != UNSTATED and dev.impossible is None:
            raise FpbenchError(
                f"{at}: the paper or its code states {raw['value']!r}, so it is run; a deviation "
                'from it needs impossible = "why it cannot run here" (else run the value)'
            )
    if raw["value"] == UNSTATED and dev is None:
        raise FpbenchError(f'{at}: value "unstated" needs a deviation saying what fpbench runs')
    return Rule(
        str(raw["path"]), raw["value"], str(raw["source"]), _match(raw.get("match", {}), at), dev
    )


def _free_rule(raw: Mapping[str, Any], at: str) -> Rule:
    unknown = sorted(set(raw) - {"path", "free", "match", "perturb"})
    if unknown or "path" not in raw or not str(raw["free"]).strip():
        raise FpbenchError(
            f'{at}: a free rule is {{ path = "...", free = "why it cannot change the number" }} '
            f"(optional match); unknown {unknown}"
        )
    at = f"{at} ({raw['path']})"
    match = _match(raw.get("match", {}), at)
    return Rule(
        str(raw["path"]), None, "", match, free=str(raw["free"]), perturb=raw.get("perturb")
    )


# -- the cells feeding a paper's tables ----------------------------------------------------------


def feeding_cells(paper: Paper, suites: Mapping[str, Any] | None = None) -> list[FedCell]:
    """Every suite cell that feeds a table of `paper`, each once, with the tables it feeds
    (a figure's cells feed the tables whose protocol the figure names).

    `suites` maps a suite name to its `Suite` (tests pass in-memory suites); by default each is
    read with `fpbench.suites.load_suite`.
    """
    from fpbench.suites import load_suite

    loaded: dict[str, Any] = dict(suites or {})

    def cells(name: str) -> Any:
        if name not in loaded:
            loaded[name] = load_suite(name)
        return loaded[name].cells

    found: dict[str, tuple[Any, set[int]]] = {}
    for table in paper.tables:
        for spec in _specs(table):
            for cfg in cells(str(spec["suite"])):
                if _selects(spec, cfg):
                    found.setdefault(cfg.run_key, (cfg, set()))[1].add(table.number)
    for figure in paper.figures:  # a figure's suite runs the protocol of the tables it names
        for cfg in cells(figure.suite):
            found.setdefault(cfg.run_key, (cfg, set()))[1].update(figure.tables)
    return [_fed(cfg, tables) for cfg, tables in found.values()]


def _specs(table: PaperTable) -> Iterable[Mapping[str, Any]]:
    for row in table.rows:
        for col in table.columns:
            spec = table.spec(row, col)
            if spec.get("suite") and spec.get("method"):
                yield spec


def _selects(spec: Mapping[str, Any], cfg: Any) -> bool:
    labels = {"suite": cfg.suite, "method": cfg.method.label, "dataset": cfg.dataset.label,
              "partition": cfg.partition.label}  # fmt: skip
    if any(k in spec and str(spec[k]) != labels[k] for k in SELECT):
        return False
    want = spec.get("config")
    return not want or _contains(cfg.model_dump(mode="json"), want)


def _fed(cfg: Any, tables: set[int]) -> FedCell:
    return FedCell(
        cfg.suite, cfg.method.label, cfg.dataset.label, cfg.partition.label, cfg.seed,
        {**cfg.model_dump(mode="json"), READINGS: readings_of(cfg.method.name)}, frozenset(tables),
    )  # fmt: skip


def readings_of(method: str) -> dict[str, str]:
    """The method's readings (`fpbench.report.method_readings`), seen by the rules as
    `readings.<key>`."""
    from fpbench.registry import METHODS

    METHODS.get(method)  # an unknown method fails here, with the registry's message
    return method_readings(method)


# -- checking --------------------------------------------------------------------------------


def check(paper: Paper, blocks: list[Block], cells: list[FedCell]) -> list[Finding]:
    """Every difference between `cells` and the protocol `blocks` of `paper`.

    A glob rule with a value checks every path it covers; a free rule checks nothing (see
    `coverage` for the paths no rule covers).

    Raises:
        FpbenchError: a block naming a table the paper lacks, a block or rule selecting no
            cell, a rule path missing from a cell's resolved config (a typo), or a glob or free
            rule that covers no path of its cells.
    """
    numbers = {t.number for t in paper.tables}
    findings: list[Finding] = []
    for block in blocks:
        at = f"{paper.name} protocol block {block.index} (tables {list(block.tables)})"
        if set(block.tables) - numbers:
            raise FpbenchError(
                f"{at}: the paper has no table {sorted(set(block.tables) - numbers)}"
            )
        mine = [c for c in cells if c.tables & set(block.tables) and _matches(block.match, c)]
        if not mine:
            raise FpbenchError(f"{at}: matches no suite cell (match {dict(block.match)})")
        for rule in block.rules:
            chosen = [c for c in mine if _matches(rule.match, c)]
            if not chosen:
                raise FpbenchError(
                    f"{at}, rule {rule.path}: matches no suite cell (match {dict(rule.match)})"
                )
            if (rule.free is not None or rule.is_glob) and not any(
                rule.covers(leaf) for c in chosen for leaf in leaf_paths(c.config)
            ):
                raise FpbenchError(f"{at}: rule path {rule.path!r} covers no path of its cells")
            if rule.free is None:
                findings += _check_rule(block, rule, chosen, at)
    return findings


def _matches(match: Mapping[str, Any], cell: FedCell) -> bool:
    return all(
        _contains(cell.config, want) if k == CONFIG else _label_matches(cell.label(k), want)
        for k, want in match.items()
    )


def _label_matches(label: str, globs: tuple[str, ...]) -> bool:
    """Any positive glob (or none given) and no negative ("!glob") one."""
    yes = [g for g in globs if not g.startswith("!")]
    no = [g[1:] for g in globs if g.startswith("!")]
    hit = not yes or any(fnmatch.fnmatchcase(label, g) for g in yes)
    return hit and not any(fnmatch.fnmatchcase(label, g) for g in no)


def _check_rule(block: Block, rule: Rule, cells: list[FedCell], at: str) -> list[Finding]:
    got: list[tuple] = []
    if rule.path == SEEDS:
        runs: dict[tuple, list[FedCell]] = {}
        for c in cells:
            runs.setdefault((c.suite, c.method, c.dataset, c.partition, _unseeded(c)), []).append(c)
        got = [(group[0], sorted(c.seed for c in group)) for group in runs.values()]
    elif rule.is_glob:
        for c in cells:
            leaves = leaf_paths(c.config)
            got += [(c, leaf, leaves[leaf]) for leaf in leaves if rule.covers(leaf)]
    else:
        for c in cells:
            value = lookup(c.config, rule.path)
            if value is _MISSING:
                raise FpbenchError(f"{at}: path {rule.path!r} is not in the config of {c.name}")
            got.append((c, value))
    got = [g if len(g) == 3 else (g[0], rule.path, g[1]) for g in got]
    return [
        Finding(
            block.index,
            block.tables,
            c.name,
            path,
            rule.expected,
            value,
            rule.source,
            rule.deviation is not None,
        )  # fmt: skip
        for c, path, value in got
        if not same(value, rule.expected)
    ]


def _unseeded(cell: FedCell) -> str:
    import json

    return json.dumps({k: v for k, v in cell.config.items() if k != "seed"}, sort_keys=True)


_MISSING = object()


def lookup(config: Mapping[str, Any], path: str) -> Any:
    """The value at dotted `path` of `config`, or a sentinel when it is absent."""
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def same(got: Any, want: Any) -> bool:
    """Protocol equality: floats to a relative 1e-9, sequences element-wise, "null" is None."""
    if want == NULL or want is None:
        return got is None
    if isinstance(got, bool) or isinstance(want, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got == want
    if isinstance(got, (int, float)) and isinstance(want, (int, float)):
        return math.isclose(got, want, rel_tol=REL_TOL, abs_tol=0.0)
    if isinstance(got, (list, tuple)) and isinstance(want, (list, tuple)):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, Mapping) and isinstance(want, Mapping):
        return set(got) == set(want) and all(same(got[k], want[k]) for k in got)
    return got == want


def leaf_paths(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every leaf of a resolved config by dotted path: mappings are descended (an empty one has
    no leaf), anything else (a number, a string, None, a list) is a leaf."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(leaf_paths(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@dataclass(frozen=True)
class Coverage:
    """How the protocol covers the leaf paths of the feeding cells."""

    uncovered: list[tuple[str, str]]  # (cell name, path), sorted
    kinds: Mapping[str, str]  # path -> pinned / declared / free (the strongest over its cells)

    @property
    def paths(self) -> set[str]:
        """Every leaf path of the cells, covered or not."""
        return set(self.kinds) | {path for _, path in self.uncovered}

    def counts(self) -> dict[str, int]:
        """How many distinct paths are pinned, declared and free."""
        kinds = list(self.kinds.values())
        return {k: kinds.count(k) for k in (PINNED, DECLARED, FREE)}


_STRENGTH = {FREE: 0, PINNED: 1, DECLARED: 2}


def coverage(paper: Paper, blocks: list[Block], cells: list[FedCell]) -> Coverage:
    """Which leaf path of which feeding cell no rule covers, and the kind of every covered path.

    A rule covers the paths of the cells its block and its own `match` select (blocks only of
    the tables a cell feeds).
    """
    uncovered: list[tuple[str, str]] = []
    kinds: dict[str, str] = {}
    seen: dict[tuple[tuple[int, ...], str], list[str]] = {}  # cells share rules and paths
    for cell in cells:
        rules = [
            r
            for b in blocks
            if cell.tables & set(b.tables) and _matches(b.match, cell)
            for r in b.rules
            if _matches(r.match, cell)
        ]
        ids = tuple(map(id, rules))
        for leaf in leaf_paths(cell.config):
            if (found := seen.get((ids, leaf))) is None:
                found = seen[ids, leaf] = [r.kind for r in rules if r.covers(leaf)]
            if not found:
                uncovered.append((cell.name, leaf))
                continue
            kind = max(found, key=_STRENGTH.__getitem__)
            if leaf not in kinds or _STRENGTH[kind] > _STRENGTH[kinds[leaf]]:
                kinds[leaf] = kind
    return Coverage(sorted(set(uncovered)), kinds)


def paper_coverage(name: str, root: Path = PAPERS_DIR) -> Coverage:
    """`coverage` of paper `name` over the suites feeding its tables."""
    paper = load_paper(name, root)
    return coverage(paper, load_protocol(name, root), feeding_cells(paper))


def check_paper(name: str, root: Path = PAPERS_DIR) -> list[Finding]:
    """Load paper `name`, its protocol and the suites feeding it; every undeclared difference."""
    paper = load_paper(name, root)
    return check(paper, load_protocol(name, root), feeding_cells(paper))


# -- the deviations listing ------------------------------------------------------------------


def deviations(blocks: list[Block]) -> list[dict[str, str]]:
    """One row per declared deviation: tables, match, path, paper value, source, runs, reason."""
    rows = []
    for block in blocks:
        for rule in block.rules:
            if rule.deviation is None:
                continue
            match = [_show_match(k, v) for k, v in {**block.match, **rule.match}.items()]
            if set(block.match) & set(rule.match):  # both narrow one label: show both
                match = [_show_match(k, v) for k, v in block.match.items()] + [
                    _show_match(k, v) for k, v in rule.match.items()
                ]
            rows.append({
                "tables": ", ".join(map(str, block.tables)),
                "match": " ".join(match) or "all",
                "path": rule.path,
                "paper": _show(rule.value),
                "source": rule.source,
                "fpbench runs": _show(rule.deviation.runs),
                "reason": rule.deviation.reason,
                "impossible here": rule.deviation.impossible or "",
            })  # fmt: skip
    return rows


STATED, SILENT = "stated", "silent"


def deviation_kind(rule: Rule) -> str:
    """`stated`: a departure from a value the paper or its code states (impossible to run
    here); `silent`: fpbench's choice where the sources are silent (value "unstated")."""
    return SILENT if rule.value == UNSTATED else STATED


def deviation_counts(blocks: list[Block], cells: list[FedCell]) -> dict[str, dict[str, int]]:
    """Per suite, how many declared deviations (rules) apply to at least one of its feeding
    cells, by kind (`deviation_kind`); the key "all" counts the paper's rules once each."""
    out: dict[str, dict[str, int]] = {"all": {STATED: 0, SILENT: 0}}
    for block in blocks:
        for rule in block.rules:
            if rule.deviation is None:
                continue
            kind = deviation_kind(rule)
            out["all"][kind] += 1
            suites = {
                c.suite
                for c in cells
                if c.tables & set(block.tables)
                and _matches(block.match, c)
                and _matches(rule.match, c)
            }
            for suite in suites:
                out.setdefault(suite, {STATED: 0, SILENT: 0})[kind] += 1
    return out


def _show_match(key: str, want: Any) -> str:
    if key == CONFIG:
        return " ".join(f"{p}={_show(v)}" for p, v in leaf_paths(want).items())
    return f"{key}={','.join(want)}"


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_show, value)) + "]"
    return str(value)
