"""`fpbench plot partition`: per-client class histograms of a suite's partition, before any run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from matplotlib.container import BarContainer
from matplotlib.image import AxesImage
from typer.testing import CliRunner

from fpbench.cli import app
from fpbench.errors import FpbenchError
from fpbench.partition.base import make_client
from fpbench.report.partition_plot import (
    HELDOUT_COLOR,
    PartitionView,
    class_counts,
    partition_figure,
    select_cell,
    suite_partition,
    suite_partitions,
)
from fpbench.suites import load_suite

PNG = b"\x89PNG\r\n\x1a\n"
SUITE = """
name = "part-plot"
seeds = [0, 1]

[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 5, image_size = 16, train_per_class = 12, test_per_class = 4 }
partition = { num_clients = 4, heldout_frac = 0.25 }

[[datasets]]
name = "synthetic"

[[partitions]]
name = "dirichlet"
label = "dir-0.5"
alpha = 0.5
min_size = 2

[[partitions]]
name = "iid"

[[methods]]
name = "fedvpt"
"""


@pytest.fixture(scope="module")
def suite_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("suite") / "part-plot.toml"
    path.write_text(SUITE)
    return path


def _view(heldout=(False, True, False)) -> PartitionView:
    counts = np.array([[3, 0, 1], [0, 2, 2], [5, 5, 0]])
    return PartitionView(counts, list(heldout), ["cat", "dog", "eel"], "a title")


def test_class_counts_hand_checked():
    labels = np.array([0, 0, 1, 2, 2, 2, 1])
    clients = [
        make_client(0, np.array([0, 2, 3]), np.array([], int), labels, 3),
        make_client(1, np.array([1, 4, 5, 6]), np.array([], int), labels, 3),
    ]
    assert class_counts(clients, labels, 3).tolist() == [[1, 1, 1], [1, 1, 2]]


def test_bars_one_series_per_class_and_heldout_marked():
    fig = partition_figure(_view(), "bars")
    ax = fig.axes[0]
    bars = [c for c in ax.containers if isinstance(c, BarContainer)]
    assert len(bars) == 3  # one stacked series per class
    heights = np.array([[p.get_height() for p in b] for b in bars]).T  # (N, C)
    assert heights.tolist() == _view().counts.tolist()
    assert [h.get_text() for h in ax.get_legend().get_texts()] == ["cat", "dog", "eel"]
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == ["0", "1 (held out)", "2"]
    assert ticks[1].get_color() == HELDOUT_COLOR and ticks[0].get_color() != HELDOUT_COLOR
    assert [str(p.get_hatch() or "") for p in bars[0]] == ["", "//", ""]


def test_heatmap_shows_the_counts_and_marks_heldout():
    fig = partition_figure(_view(heldout=(True, False, False)), "heatmap")
    ax = fig.axes[0]
    images = [a for a in ax.get_children() if isinstance(a, AxesImage)]
    assert len(images) == 1
    assert np.asarray(images[0].get_array()).tolist() == _view().counts.tolist()
    assert ax.get_yticklabels()[0].get_text() == "0 (held out)"
    assert ax.get_yticklabels()[0].get_color() == HELDOUT_COLOR


def test_auto_switches_to_heatmap_for_many_classes():
    counts = np.ones((2, 30), dtype=np.int64)
    view = PartitionView(counts, [False, False], [f"c{k}" for k in range(30)], "t")
    ax = partition_figure(view).axes[0]
    assert any(isinstance(a, AxesImage) for a in ax.get_children())
    assert partition_figure(_view()).axes[0].containers  # 3 classes: bars


def test_unknown_kind_is_a_user_error():
    with pytest.raises(FpbenchError, match="auto, bars, heatmap"):
        partition_figure(_view(), "pie")


def test_select_cell_filters_and_errors(suite_file):
    cells = load_suite(str(suite_file)).cells
    cell = select_cell(cells, None, "iid", 1)
    assert (cell.partition.label, cell.seed) == ("iid", 1)
    assert select_cell(cells, None, None, None).partition.label == "dir-0.5"
    with pytest.raises(FpbenchError, match="valid: dir-0.5, iid"):
        select_cell(cells, None, "dir-9", None)


def test_suite_partition_matches_the_runs_clients(suite_file):
    cell = select_cell(load_suite(str(suite_file)).cells, None, "dir-0.5", 0)
    view = suite_partition(cell)
    assert view.counts.shape == (4, 5)
    assert view.counts.sum() == 5 * 12  # every train sample is dealt exactly once
    assert sum(view.heldout) == 1  # round(0.25 * 4)
    assert "dir-0.5" in view.title and "part-plot" in view.title


def test_cli_writes_png_and_pdf(suite_file, tmp_path):
    out = tmp_path / "part.png"
    args = [
        "plot",
        "partition",
        "--suite",
        str(suite_file),
        "--partition",
        "iid",
        "--seed",
        "0",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert out.read_bytes().startswith(PNG)
    assert out.with_suffix(".pdf").read_bytes().startswith(b"%PDF")
    bad = CliRunner().invoke(app, [*args[:-4], "--seed", "7", "--out", str(out)])
    assert bad.exit_code == 2
    assert "--seed 7" in bad.output


EVERY = """
name = "every-part"
seeds = [0, 1]

[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 4, image_size = 16, train_per_class = 8, test_per_class = 2 }
partition = { num_clients = 2, heldout_frac = 0.0 }

[[datasets]]
name = "synthetic"

[[partitions]]
name = "class-blocks"
label = "blocks"
classes_per_client = 2

[[partitions]]
name = "iid"

[[methods]]
name = "fedvpt"

[[methods]]
name = "head-tune"
"""


def test_every_distinct_partition_of_a_suite_one_figure_each(tmp_path):
    """class-blocks deals the same clients whatever the seed: one figure for both seeds; iid
    deals each seed its own: one figure per seed. The two methods add nothing."""
    suite = tmp_path / "every-part.toml"
    suite.write_text(EVERY)
    views = suite_partitions(load_suite(str(suite)).cells)
    assert [name for name, _ in views] == [
        "synthetic-blocks",
        "synthetic-iid-s0",
        "synthetic-iid-s1",
    ]
    titles = [v.title for _, v in views]
    assert (
        titles[0] == "synthetic / blocks / seeds 0, 1 (suite every-part): train samples per class"
    )
    assert titles[1].startswith("synthetic / iid / seed 0 (suite every-part)")
    assert views[0][1].counts.tolist() == [[8, 8, 0, 0], [0, 0, 8, 8]]
    one = suite_partitions(load_suite(str(suite)).cells[:1])  # the view of one cell, as before
    assert (
        one[0][1].counts.tolist()
        == suite_partition(load_suite(str(suite)).cells[0]).counts.tolist()
    )
    out = tmp_path / "plots" / "part.png"
    result = CliRunner().invoke(
        app, ["plot", "partition", "--suite", str(suite), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    names = ("synthetic-blocks", "synthetic-iid-s0", "synthetic-iid-s1")
    written = sorted(p.name for p in out.parent.iterdir())
    assert written == [f"part-{n}.{ext}" for n in names for ext in ("pdf", "png")]
    assert (out.parent / "part-synthetic-iid-s1.png").read_bytes().startswith(PNG)
    folder = tmp_path / "folder"
    args = ["plot", "partition", "--suite", str(suite), "--partition", "iid", "--out", str(folder)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    written = sorted(p.name for p in folder.iterdir())
    assert written == [f"{n}.{ext}" for n in names[1:] for ext in ("pdf", "png")]
    single = tmp_path / "blocks.svg"
    args = [
        "plot",
        "partition",
        "--suite",
        str(suite),
        "--partition",
        "blocks",
        "--out",
        str(single),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert single.is_file() and not single.with_suffix(".pdf").exists()  # one figure: --out
