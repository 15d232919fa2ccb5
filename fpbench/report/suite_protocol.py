"""A suite's own protocol: the rules of a suite that feeds no paper table, checked as a paper's.

`benchmarks/protocols/<suite>.toml` holds, for the shipped suite of that name:

* `anchor`: what the suite claims to run (one line, e.g. FLiP's "aligned settings");
* `[[protocol]]` blocks as a paper's (`fpbench.report.protocol`) without `tables`: every block
  covers every cell of the suite (narrowed by its `match`);
* optionally `recipes = "aligned"` or `"own"` with a `[common]` recipe (each setting
  `{ value, source }`, a method's exception in `methods`): rules made from each method's own
  recipe (`benchmarks/protocols/recipes.toml`, `fpbench.report.recipes.recipe_blocks`):
  "aligned" runs the common recipe and declares where it departs from each method's own, "own"
  pins every method's own recipe (the common one fills what it lacks);
* optionally `method_defaults = true`: every method argument a cell leaves at its registered
  default and the method's readings pinned to fpbench's method (`recipes.defaults_blocks`;
  the source is the recipe's `args`, the official file of those defaults);
* optionally `min_budget_fraction` and `[short_budget]` (method label = reason): every method
  trains at least that fraction of the suite's median budget (`fpbench.report.budget`) or says
  why not.

Completeness and sources are checked exactly as a paper's: every leaf path of every cell pinned,
declared or free; every pinned or declared rule's source a `file:line` of a spec, a code
reference `Name/path:line@commit` of an official checkout (`fpbench.report.sources`), a quote
after either, or `silent:` for an unstated value. There is no paper text: a bare quote fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import tomllib

from fpbench.errors import FpbenchError
from fpbench.report.protocol import (
    Block,
    Coverage,
    FedCell,
    Finding,
    check,
    coverage,
    deviations,
    parse_protocol,
    readings_of,
)
from fpbench.shipped import shipped_dir
from fpbench.specs import _DUMPED_WHERE_SET

PROTOCOLS_DIR = shipped_dir() / "protocols"
RECIPES_FILE = "recipes"  # benchmarks/protocols/recipes.toml: the methods' own recipes
SUITE_TABLE = 0  # the one pseudo-table every cell of a suite feeds
KEYS = {
    "suite", "anchor", "protocol", "recipes", "common", "method_defaults", "min_budget_fraction",
    "short_budget",
}  # fmt: skip
# TrainConfig fields dumped only where set (centralized aside: a reference row's label): their
# defaults are filled in for the check, so a suite's protocol holds them in every cell
FILLED = {k: v for k, v in _DUMPED_WHERE_SET.items() if k != "centralized"}


@dataclass(frozen=True)
class SuiteProtocol:
    suite: str
    anchor: str
    blocks: list[Block]
    recipes: str | None = None
    min_budget_fraction: float | None = None
    short_budget: dict[str, str] = field(default_factory=dict)

    @property
    def paper(self) -> Any:
        """The stand-in `Paper` of `fpbench.report.protocol.check`: one table, number 0."""
        return SimpleNamespace(name=f"suite {self.suite}", tables=[SimpleNamespace(number=0)])


def list_suite_protocols(root: Path = PROTOCOLS_DIR) -> list[str]:
    """The suites with a protocol file."""
    return sorted(p.stem for p in root.glob("*.toml") if p.stem != RECIPES_FILE)


def load_suite_protocol(suite: str, root: Path = PROTOCOLS_DIR) -> SuiteProtocol:
    """Suite `suite`'s protocol, its recipe rules made.

    Raises:
        FpbenchError: no protocol for the suite, or a malformed file.
    """
    path = root / f"{suite}.toml"
    if not path.is_file():
        have = ", ".join(list_suite_protocols(root))
        raise FpbenchError(f"suite {suite!r} has no protocol ({path}); have: {have}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise FpbenchError(f"{path}: {e}") from None
    from fpbench.suites import load_suite

    methods = [(c.method.name, c.method.args) for c in load_suite(suite).cells]
    return parse_suite_protocol(data, suite, methods, root, f"protocols/{suite}.toml")


def parse_suite_protocol(
    data: dict[str, Any],
    suite: str,
    methods: list[tuple[str, dict[str, Any]]],
    root: Path = PROTOCOLS_DIR,
    where: str = "<memory>",
) -> SuiteProtocol:
    """A suite protocol from its parsed file; `methods` are (method name, method args) of the
    suite's cells (the recipe rules are made for them) and `root` holds recipes.toml."""
    from fpbench.report.recipes import defaults_blocks, load_recipes, recipe_blocks

    unknown = sorted(set(data) - KEYS)
    if unknown:
        raise FpbenchError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(sorted(KEYS))}")
    if data.get("suite", suite) != suite:
        raise FpbenchError(f"{where}: suite = {data['suite']!r}, the file names {suite!r}")
    raw = [{**b, "tables": [SUITE_TABLE]} for b in data.get("protocol", [])]
    if any("tables" in b for b in data.get("protocol", [])):
        raise FpbenchError(f"{where}: a suite's protocol block has no tables (it covers the suite)")
    recipes = data.get("recipes")
    if recipes not in (None, "aligned", "own"):
        raise FpbenchError(f'{where}: recipes = "aligned" or "own", got {recipes!r}')
    names = {name for name, _ in methods}
    made = []
    if recipes is not None:
        made += recipe_blocks(load_recipes(root), data.get("common", {}), names, recipes, where)
    elif "common" in data:
        raise FpbenchError(f'{where}: [common] needs recipes = "aligned" or "own"')
    if data.get("method_defaults", False):
        made += defaults_blocks(load_recipes(root), methods, where)
    raw += [{**b, "tables": [SUITE_TABLE]} for b in made]
    frac = data.get("min_budget_fraction")
    if frac is not None and not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        raise FpbenchError(f"{where}: min_budget_fraction is in (0, 1], got {frac!r}")
    return SuiteProtocol(
        suite, str(data.get("anchor", "")), parse_protocol({"protocol": raw}, where), recipes,
        frac, {str(k): str(v) for k, v in data.get("short_budget", {}).items()},
    )  # fmt: skip


def cell_config(cfg: Any) -> dict[str, Any]:
    """A cell's resolved config as the check sees it: its JSON dump, the defaults of the
    train fields dumped only where set (`FILLED`), and its method's readings."""
    out = cfg.model_dump(mode="json")
    out["train"] = {**FILLED, **out["train"]}
    return {**out, "readings": readings_of(cfg.method.name)}


def suite_cells(suite: str, suites: dict[str, Any] | None = None) -> list[FedCell]:
    """Every cell of `suite` (from `fpbench.suites.load_suite` unless given in `suites`)."""
    from fpbench.suites import load_suite

    loaded = (suites or {}).get(suite) or load_suite(suite)
    return [
        FedCell(
            c.suite,
            c.method.label,
            c.dataset.label,
            c.partition.label,
            c.seed,
            cell_config(c),
            frozenset({SUITE_TABLE}),
        )  # fmt: skip
        for c in loaded.cells
    ]


def check_suite(proto: SuiteProtocol, cells: list[FedCell]) -> list[Finding]:
    """Every undeclared difference between the suite's cells and its protocol."""
    return check(proto.paper, proto.blocks, cells)


def suite_coverage(proto: SuiteProtocol, cells: list[FedCell]) -> Coverage:
    return coverage(proto.paper, proto.blocks, cells)


def suite_deviations(proto: SuiteProtocol) -> list[dict[str, str]]:
    """`fpbench.report.protocol.deviations` without the pseudo-table column, the stated value
    under "anchor" (the anchor's, or for a recipe rule the method's own)."""
    return [
        {("anchor" if k == "paper" else k): v for k, v in row.items() if k != "tables"}
        for row in deviations(proto.blocks)
    ]
