"""Every paper-table cell that names a suite has a run in that suite's file.

A cell of `benchmarks/papers/*.toml` selects runs by suite, run labels (method, dataset,
partition) and an optional `config` filter. Here each referenced suite is expanded with
`load_suite` and every non-empty cell must match at least one of its runs, matched the way
`fpbench.report.paper` matches stored runs (labels equal, config contained in the resolved
config). Expanding needs no data, backbone weights or GPU.
"""

from __future__ import annotations

from collections import defaultdict
from functools import cache
from typing import Any

import pytest

from fpbench.report.paper import SELECT, _contains, list_papers, load_paper
from fpbench.specs import RunConfig, Suite
from fpbench.suites import load_suite

# Suites a paper table references on purpose although fpbench has no suite file for them.
ALLOWED_MISSING: set[str] = set()

Wanted = tuple[str, str, dict[str, Any]]  # (where, "method/dataset/partition", selection)


def _wanted() -> dict[str, list[Wanted]]:
    """Suite name -> the filled cells that select its runs."""
    out: dict[str, list[Wanted]] = defaultdict(list)
    for name in list_papers():
        for table in load_paper(name).tables:
            for row in table.rows:
                for col in table.columns:
                    spec = table.spec(row, col)
                    if table.values[(row.key, col.key)].empty or not _selects(spec):
                        continue
                    where = f"{name} table {table.number} cell {row.key}.{col.key}"
                    labels = "/".join(str(spec.get(k, "*")) for k in SELECT[1:])
                    out[str(spec["suite"])].append((where, labels, spec))
    return dict(out)


def _selects(spec: dict[str, Any]) -> bool:
    """A cell fpbench fills: it names a suite, a method and a metric (as paper.fill does)."""
    return bool(spec.get("suite") and spec.get("method") and spec.get("metric"))


@cache
def _suite(name: str) -> Suite:
    return load_suite(name)


def _matches(cfg: RunConfig, spec: dict[str, Any]) -> bool:
    labels = {"method": cfg.method.label, "dataset": cfg.dataset.label}
    labels["partition"] = cfg.partition.label
    if any(k in spec and spec[k] != labels[k] for k in labels):
        return False
    want = spec.get("config")
    return not want or _contains(cfg.model_dump(mode="json"), want)


WANTED = _wanted()


def test_paper_specs_reference_suites() -> None:
    """The collection itself is not vacuous: the known tables select runs."""
    assert {"sgpt-table1", "pep-ablations", "fgpt-table8", "sdfed-ablations"} <= set(WANTED)
    assert set(ALLOWED_MISSING) <= set(WANTED), "allow-list names a suite no paper references"


@pytest.mark.parametrize("suite", sorted(set(WANTED) - ALLOWED_MISSING))
def test_every_paper_cell_has_a_run(suite: str) -> None:
    cells = _suite(suite).cells
    missing: dict[str, list[str]] = defaultdict(list)  # selection -> the cells wanting it
    for where, labels, spec in WANTED[suite]:
        if not any(_matches(c, spec) for c in cells):
            missing[f"{labels} {spec.get('config', '')}".strip()].append(where)
    lines = [f"{sel}  ({len(w)} cells, e.g. {w[0]})" for sel, w in sorted(missing.items())]
    assert not missing, f"suite {suite}: no run for {len(lines)} selections:\n  " + "\n  ".join(
        lines
    )


def test_matching_uses_labels_and_config() -> None:
    """The matcher rejects a wrong label and a config the run does not have."""
    cfg = _suite("fgpt-table8").cells[0]
    base = {"method": cfg.method.label, "dataset": cfg.dataset.label}
    assert _matches(cfg, base)
    assert not _matches(cfg, {**base, "partition": "no-such-partition"})
    epochs = cfg.train.local_epochs
    assert _matches(cfg, {**base, "config": {"train": {"local_epochs": epochs}}})
    assert not _matches(cfg, {**base, "config": {"train": {"local_epochs": epochs + 1}}})
