"""Plots for the papers' figures: held-out, sweeps, heatmaps, communication; and their CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.report import plots
from fpbench.report.paper import load_results
from fpbench.store import Store

SUITE = "sweep-toy"
PNG = b"\x89PNG\r\n\x1a\n"


def _run(store, method, seed, groups, epochs, accs, *, heldout=True, family=None):
    """One run: acc_global per round = accs; held-out 10 points lower; 1000 B up, 3000 B down."""
    config = {
        "method": {"name": family or method, "label": method, "args": {"num_groups": groups}},
        "train": {"local_epochs": epochs},
    }
    rec = store.create_run(
        run_key=f"{method}-{seed}-{groups}-{epochs}", suite=SUITE, method=method,
        dataset="cifar100", partition="path-s10", seed=seed, config=config,
        fpbench_version="t", torch_version="t", device="cpu",
    )  # fmt: skip
    for rnd, acc in enumerate(accs):
        rows = [(None, "acc_global", acc, None), (None, "acc_local_mean", acc + 0.05, None)]
        if heldout:
            rows.append((None, "acc_heldout_mean", acc - 0.1, None))
        store.write_round(rec.id, rnd, loss_train=1.0, wall_s=1.5, bytes_up=1000,
                          bytes_down=3000, metrics=rows)  # fmt: skip


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """fgpt: G in {10, 20} x E in {1, 2}, 2 seeds each; fedvpt: G 10, E 1; fedrep: no held-out."""
    path = tmp_path_factory.mktemp("plots") / "r.db"
    with Store(f"sqlite:///{path}") as store:
        for groups, base in ((10, 0.6), (20, 0.7)):
            for epochs in (1, 2):
                for seed in (0, 1):
                    acc = base + 0.1 * (epochs - 1) + 0.02 * seed
                    _run(store, f"fgpt-g{groups}", seed, groups, epochs, [acc - 0.2, acc],
                         family="fgpt")  # fmt: skip
        _run(store, "fedvpt", 0, 10, 1, [0.5, 0.82, 0.9])
        _run(store, "fedrep", 0, 10, 1, [0.4, 0.5], heldout=False)
    return path


@pytest.fixture(scope="module")
def results(db):
    with Store(f"sqlite:///{db}") as store:
        return load_results(store, [SUITE])


def _written(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000


def test_heldout_one_marker_per_method_with_heldout_accuracy(results, tmp_path):
    fig = plots.heldout(results.metrics, suite=SUITE)
    ax = fig.axes[0]
    labels = {line.get_label() for line in ax.get_lines()} | {c.get_label() for c in ax.containers}
    assert {"fedvpt", "fgpt-g10", "fgpt-g20"} <= labels and "fedrep" not in labels
    assert ax.get_xlabel() == "mean local accuracy (%)"
    assert ax.get_ylabel() == "mean held-out accuracy (%)"
    assert SUITE in fig.get_suptitle()
    fig.savefig(tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes().startswith(PNG)


def test_sweep_groups_runs_by_method_name_and_averages_seeds(results):
    fig = plots.sweep(results.metrics, results.configs, "num_groups", "acc_global", suite=SUITE)
    ax = fig.axes[0]
    lines = {c.get_label(): c.lines[0] for c in ax.containers}  # errorbar: one per series
    assert set(lines) == {"fgpt", "fedvpt", "fedrep"}
    x, y = lines["fgpt"].get_data()
    # final value = last round; mean over seeds (+0, +0.02) and epochs (+0, +0.1)
    assert list(x) == [10.0, 20.0]
    assert np.allclose(y, [100 * (0.6 + 0.06), 100 * (0.7 + 0.06)])
    assert ax.get_xlabel() == "num_groups" and ax.get_ylabel() == "global accuracy (%)"
    assert "num_groups" in fig.get_suptitle() and SUITE in fig.get_suptitle()
    with pytest.raises(FpbenchError, match="no run config has 'nope'"):
        plots.sweep(results.metrics, results.configs, "nope")


def test_heatmap_grid_holds_the_mean_over_seeds(results):
    metrics = results.metrics[results.metrics["method"].str.startswith("fgpt")]
    fig = plots.heatmap(metrics, results.configs, "num_groups", "train.local_epochs", suite=SUITE)
    ax = fig.axes[0]
    grid = ax.images[0].get_array()
    expected = 100 * np.array([[0.61, 0.71], [0.71, 0.81]])  # rows: E = 1, 2; cols: G = 10, 20
    assert np.allclose(grid, expected)
    assert ax.get_xlabel() == "num_groups" and ax.get_ylabel() == "train.local_epochs"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "20"]


def test_comm_curves_and_cost_to_target(results, tmp_path):
    fig = plots.comm(results.metrics, results.rounds, "acc_global", target=0.8, suite=SUITE)
    ax = fig.axes[0]
    curves = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(curves) == {"fgpt-g10", "fgpt-g20", "fedvpt", "fedrep"}
    assert list(curves["fedvpt"].get_xdata()) == pytest.approx([0.004, 0.008, 0.012])  # MB
    assert ax.get_xlabel() == "cumulative communication (MB, up + down)"
    table = plots.to_target(results.metrics, results.rounds, "acc_global", 0.79)
    fedvpt = table[table["method"] == "fedvpt"].iloc[0]
    assert (fedvpt["rounds"], fedvpt["wall_s"], fedvpt["bytes"]) == (2, 3.0, 8000)
    g20 = table[table["method"] == "fgpt-g20"].iloc[0]
    assert (g20["reached"], g20["runs"]) == (2, 4)  # only the E = 2 runs (80 %, 82 %) reach 79 %
    assert np.isnan(table[table["method"] == "fedrep"].iloc[0]["rounds"])


def test_cli_plots_write_png_and_pdf(db, tmp_path):
    runner = CliRunner()
    commands = {
        "heldout": [],
        "sweep": ["--param", "train.local_epochs"],
        "heatmap": ["--x", "num_groups", "--y", "train.local_epochs"],
        "comm": ["--target", "80"],
    }
    for name, extra in commands.items():
        out = tmp_path / f"{name}.png"
        args = ["plot", name, "--suite", SUITE, "--out", str(out), "--db", str(db), *extra]
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (name, result.output)
        assert out.read_bytes().startswith(PNG) and _written(out)
        assert out.with_suffix(".pdf").read_bytes().startswith(b"%PDF")
    assert "to reach 80.00%" in result.output  # comm prints the cost-to-target table
    bad = runner.invoke(app, ["plot", "sweep", "--suite", "nope", "--out", "x.png",
                              "--param", "g", "--db", str(db)])  # fmt: skip
    assert bad.exit_code == 2 and "no results for suite nope" in bad.output


def test_cli_table_paper_formats(db, tmp_path):
    runner = CliRunner()
    out = tmp_path / "t.csv"
    args = ["table", "--paper", "sgpt", "--table", "3", "--format", "csv", "--db", str(db)]
    assert runner.invoke(app, [*args, "--out", str(out)]).exit_code == 0
    frame = pd.read_csv(out)
    assert len(frame) == 10 and set(frame["paper_value"]) >= {84.64, 73.85}
    term = runner.invoke(app, ["table", "--paper", "pep-fedpt", "--table", "4", "--format",
                               "term", "--db", str(tmp_path / "absent.db")])  # fmt: skip
    assert term.exit_code == 0 and "paper 95.46" in term.output
    bad = runner.invoke(app, ["table", "--paper", "sgpt", "--table", "9", "--db", str(db)])
    assert bad.exit_code == 2 and "no table 9" in bad.output


def test_config_value_reads_dotted_paths_list_items_and_bare_keys():
    config_value = plots.config_value
    cfg = {"train": {"lr": 0.1}, "method": {"args": {"local_lengths": [8, 8, 20, 20]}}}
    assert config_value(cfg, "train.lr") == 0.1
    assert config_value(cfg, "method.args.local_lengths.2") == 20
    assert config_value(cfg, "lr") == 0.1
    assert config_value(cfg, "method.args.local_lengths.9") is None
