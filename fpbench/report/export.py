"""`fpbench export`: a database's runs, rounds and per-client metrics as flat tables.

The tables are the database's own data, reshaped for analysis; values and numbering are the
database's (accuracies as fractions, `round` counted from 0), so they join with a direct SQL
read of the same database:

* `runs`: one row per run: id, run_key, the cell's labels, status, times, versions, device,
  `last_round` and the resolved config as JSON (`config_json`);
* `rounds`: one row per (run, round): the run's labels, the round's scalars (loss_train,
  wall_s, bytes_up, bytes_down) and one column per aggregate metric (NaN where a round has
  none: unevaluated rounds, `_last<N>` summaries outside the last round);
* `clients`: one row per (run, evaluated round, client): the run's labels, one column per
  per-client metric (`acc_local`, `acc_global`, `acc_heldout`, ...) and `<metric>_count`, the
  number of test samples behind it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from fpbench.errors import FpbenchError
from fpbench.store.repo import ROUND_COLUMNS

TABLES = ("runs", "rounds", "clients")
FORMATS = ("csv", "parquet")
LABELS = ["run_id", "run_key", "suite", "method", "dataset", "partition", "seed"]


def export_tables(store, run_ids: Sequence[int]) -> dict[str, pd.DataFrame]:
    """The `runs`, `rounds` and `clients` tables of these runs (see the module docstring)."""
    ids = [int(i) for i in run_ids]
    runs = store.runs()
    runs = runs[runs["id"].isin(ids)].reset_index(drop=True)
    parsed = {i: store.get_run(i).config for i in runs["id"]}
    configs = {i: json.dumps(c, sort_keys=True) for i, c in parsed.items()}
    runs = runs.assign(config_json=runs["id"].map(configs))
    runs = pd.concat([runs, flat_config(runs["id"], parsed)], axis=1)
    labels = runs.rename(columns={"id": "run_id"})[LABELS]
    rounds = pd.concat([store.rounds(i) for i in runs["id"]] or [pd.DataFrame()])
    metrics = store.metrics(run_ids=ids, aggregate_only=False)
    aggregate = metrics[metrics["client_id"].isna()]
    wide = _wide(aggregate, ["run_id", "round"], counts=False)
    wide = wide.drop(columns=["loss_train"], errors="ignore")  # as in `rounds` (every round)
    if rounds.empty:
        rounds = pd.DataFrame(columns=ROUND_COLUMNS)
    per_round = rounds.merge(wide, on=["run_id", "round"], how="outer")
    per_client = _wide(metrics[metrics["client_id"].notna()], ["run_id", "round", "client_id"])
    return {
        "runs": runs,
        "rounds": _labelled(labels, per_round, ["run_id", "round"]),
        "clients": _labelled(labels, per_client, ["run_id", "round", "client_id"]),
    }


def flat_config(ids: pd.Series, configs: dict[int, dict]) -> pd.DataFrame:
    """Each run's config as one column per setting, `config.train.lr` (lists as JSON text), in
    the order of `ids`: a table to filter and group runs by their settings."""

    def flat(tree: dict, prefix: str) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in sorted(tree.items()):
            name = f"{prefix}.{key}"
            if isinstance(value, dict) and value:
                out.update(flat(value, name))
            else:
                out[name] = json.dumps(value) if isinstance(value, list | dict) else value
        return out

    rows = [flat(configs[i], "config") for i in ids]
    return pd.DataFrame(rows, index=ids.index)


def _wide(long: pd.DataFrame, keys: list[str], counts: bool = True) -> pd.DataFrame:
    """Metric rows as one column per name (and `<name>_count` where counts are stored)."""
    if long.empty:
        return pd.DataFrame(columns=keys)
    values = long.pivot(index=keys, columns="name", values="value")
    names = list(values.columns)
    if counts:
        n = long.pivot(index=keys, columns="name", values="count")
        n = n.loc[:, n.notna().any()].add_suffix("_count")
        values = values.join(n)
        order = [c for name in names for c in (name, f"{name}_count") if c in values.columns]
        values = values[order]
    values.columns.name = None
    return values.reset_index()


def _labelled(labels: pd.DataFrame, frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    out = labels.merge(frame, on="run_id", how="inner")
    for key in keys[1:]:
        out[key] = out[key].astype("int64")
    return out.sort_values(keys, kind="stable").reset_index(drop=True)


def has_pyarrow() -> bool:
    """Whether pandas can write Parquet here (through pyarrow, the `parquet` extra)."""
    return importlib.util.find_spec("pyarrow") is not None


def write_tables(
    tables: dict[str, pd.DataFrame], out: Path, fmt: str, *, force: bool = False
) -> list[Path]:
    """Write each table to `out/<name>.<fmt>`; returns the paths written.

    Raises:
        FpbenchError: unknown format, parquet without pyarrow, or a target file exists and
            `force` is off (a file fpbench did not write is never overwritten unasked).
    """
    if fmt not in FORMATS:
        raise FpbenchError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt == "parquet" and not has_pyarrow():
        raise FpbenchError("--format parquet needs pyarrow: pip install 'fpbench[parquet]'")
    paths = [out / f"{name}.{fmt}" for name in tables]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise FpbenchError(f"{', '.join(existing)} already there; --force overwrites")
    out.mkdir(parents=True, exist_ok=True)
    for path, frame in zip(paths, tables.values(), strict=True):
        if fmt == "csv":
            frame.to_csv(path, index=False)
        else:
            frame.to_parquet(path, index=False)
    return paths
