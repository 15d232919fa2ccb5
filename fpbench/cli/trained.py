"""`fpbench export-params` and `evaluate`: a finished run's kept trained state, written out
and scored again (`fpbench.engine.artifacts`)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fpbench.cli.apps import app
from fpbench.cli.common import DEFAULT_DB, DbOpt, console, open_store, user_errors
from fpbench.errors import FpbenchError


class SplitChoice(str, Enum):
    test = "test"
    train = "train"


CheckpointOpt = Annotated[
    Path, typer.Option(help="the run's --checkpoint-dir (where a database server's runs keep it)")
]


def _finished(store, ref: str):
    record = store.get_run(ref)
    if record.status != "done":
        raise FpbenchError(f"run {record.id} is {record.status}: only a done run has final state")
    return record


@app.command("export-params")
@user_errors
def export_params(
    run_ref: Annotated[str, typer.Argument(metavar="RUN", help="run id or run_key prefix")],
    out: Annotated[Path, typer.Option(help="the .npz file to write")],
    force: Annotated[bool, typer.Option("--force", help="overwrite an earlier file")] = False,
    checkpoint_dir: CheckpointOpt = Path("results/checkpoints"),
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Write a finished run's trained state as a NumPy .npz.

    params/NAME (shared), personal/NAME (one row per client id), buffers/NAME, and meta
    (JSON: format, run_key, last round from 0, the run's config)."""
    import torch

    from fpbench.engine.artifacts import load_params, write_npz
    from fpbench.engine.checkpoint import folder_for

    if out.exists() and not force:
        raise FpbenchError(f"{out} already there; --force overwrites")
    with open_store(db, must_exist=True) as store:
        record = _finished(store, run_ref)
        folder = folder_for(checkpoint_dir, store.database_id)
        ckpt = load_params(store.url, folder, record.run_key, torch.device("cpu"))
    write_npz(ckpt, record.config, out)
    n = sum(len(d) for d in ckpt.server.state_dict().values())
    console.print(f"wrote {out} (run {record.id}, {n} tensors)", highlight=False)


@app.command("evaluate", short_help="Score a finished run's trained state again.")
@user_errors
def evaluate_cmd(
    run_ref: Annotated[str, typer.Argument(metavar="RUN", help="run id or run_key prefix")],
    dataset: Annotated[
        str | None,
        typer.Option(help="score on this dataset instead (same classes; its default config)"),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            metavar="PATH=VALUE",
            help="change the dataset's config, e.g. dataset.args.seed=1 (repeatable)",
        ),
    ] = None,
    split: Annotated[
        SplitChoice,
        typer.Option(help="test (as evaluated in training) or train (the data it trained on)"),
    ] = SplitChoice.test,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda (default: the run's)")] = None,
    checkpoint_dir: CheckpointOpt = Path("results/checkpoints"),
    db: DbOpt = DEFAULT_DB,
) -> None:
    """Score a finished run's trained state again (and compare with the stored values).

    Each client on its local test set as in training: on the run's own test split it gives
    the stored last-round values, bit for bit, on the machine and software that ran it.
    --split train scores each client on its own train samples (acc_global: the whole train
    split). With --dataset or --set dataset.args.*, on other data: the run's partition rules
    on that dataset."""
    from fpbench.engine.artifacts import load_params, rescore
    from fpbench.engine.build import resolve_device
    from fpbench.engine.checkpoint import folder_for

    with open_store(db, must_exist=True) as store:
        record = _finished(store, run_ref)
        cfg = _scored_config(record.config, dataset, sets)
        dev = resolve_device(device or cfg.runtime.device)
        ckpt = load_params(
            store.url, folder_for(checkpoint_dir, store.database_id), record.run_key, dev
        )
        stored = store.metrics(run_ids=[record.id], aggregate_only=False)
    rows = rescore(cfg, ckpt, dev, split.value)
    own = cfg.dataset == _scored_config(record.config, None, None).dataset
    own = own and split is SplitChoice.test
    stored = stored[stored["round"] == ckpt.round] if own else stored.iloc[0:0]
    _print_rescore(record, cfg, rows, stored, split.value)


def _scored_config(config: dict, dataset: str | None, sets: list[str] | None):
    """The run's config, its dataset replaced by `dataset` and `--set dataset.args.*`."""
    from fpbench.cli.common import parse_sets
    from fpbench.registry import DATASETS
    from fpbench.specs import RunConfig
    from fpbench.suites import set_overrides

    raw = dict(config)
    values = parse_sets(sets)
    bad = [k for k in values if not k.startswith("dataset.args.")]
    if bad:
        raise FpbenchError(f"--set {bad[0]}: evaluate changes only dataset.args.* paths")
    comp = dict(raw["dataset"])
    if dataset is not None and dataset != comp["name"]:
        DATASETS.get(dataset)  # unknown: one line naming the valid ones
        comp = {"name": dataset, "label": dataset, "args": {}}
    comp["args"] = {**comp["args"], **set_overrides(values).get("dataset", {}).get("args", {})}
    cls = DATASETS.get(comp["name"])
    try:
        comp["args"] = cls.Config(**comp["args"]).model_dump(mode="json")
        cfg = RunConfig.model_validate({**raw, "dataset": comp})
    except ValueError as e:
        raise FpbenchError(f"dataset {comp['name']}: {e}") from None
    old = DATASETS.get(config["dataset"]["name"])
    before = old.info(old.Config(**config["dataset"]["args"])).num_classes
    after = cls.info(cls.Config(**comp["args"])).num_classes
    if before != after:
        raise FpbenchError(f"dataset {comp['name']} has {after} classes, the run's {before}")
    return cfg


def _print_rescore(record, cfg, rows: list, stored, split: str) -> None:
    from fpbench.report.tables import is_percent

    compare = not stored.empty
    title = f"run {record.id} ({record.method} / seed {record.seed}) on {cfg.dataset.label}"
    title += f" ({split} split)"
    table = Table(title=title + (": stored vs re-scored" if compare else ""))
    for col in ["metric", *(["stored"] if compare else []), "re-scored"]:
        table.add_column(col, justify="left" if col == "metric" else "right")
    known = {
        (None if c != c else int(c), n): v
        for c, n, v in zip(
            stored["client_id"].astype(float), stored["name"], stored["value"], strict=True
        )
    }
    same = checked = 0
    for client, name, value, _ in rows:
        if compare and (client, name) in known:
            checked += 1
            same += known[(client, name)] == value
        if client is not None:
            continue
        shown = (lambda v: f"{100 * v:.2f}") if is_percent(name) else (lambda v: f"{v:.4g}")
        cells = [shown(known[(None, name)]) if (None, name) in known else "-"] if compare else []
        table.add_row(name + (" (%)" if is_percent(name) else ""), *cells, shown(value))
    console.print(table)
    if compare:
        verdict = "all equal" if same == checked else f"{checked - same} differ"
        console.print(
            f"{same} of {checked} stored values (per client and aggregate) re-scored bit for "
            f"bit: {verdict}",
            highlight=False,
        )
