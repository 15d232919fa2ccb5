"""What each figure shows, value by value: labels, titles, data, markers, colours, legends.

Small hand-built metric frames (shaped like `Store.metrics()`), no database: every expected value
below is worked out in the comment beside it from the rows of the test.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.font_manager import FontProperties
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import MaxNLocator

from fpbench.errors import FpbenchError
from fpbench.report import plots
from fpbench.report.partition_plot import (
    HELDOUT_COLOR,
    PartitionView,
    _class_colors,
    class_counts,
    partition_figure,
    select_cell,
    suite_partition,
)

SMALL = FontProperties(size="small").get_size_in_points()  # 8.33 with matplotlib's defaults
MEDIUM = FontProperties(size="medium").get_size_in_points()


def _frame(rows: list[tuple]) -> pd.DataFrame:
    """(run_id, method, seed, round, name, value[, client_id[, dataset, partition]]) rows."""
    records = []
    for row in rows:
        run_id, method, seed, rnd, name, value, *rest = row
        client = rest[0] if rest else None
        ds, part = rest[1:3] if len(rest) > 1 else ("cifar100", "dir")
        records.append(
            {"run_id": run_id, "suite": "s", "method": method, "dataset": ds, "partition": part,
             "seed": seed, "round": rnd, "client_id": client, "name": name, "value": value,
             "count": None}
        )  # fmt: skip
    columns = ["run_id", "suite", "method", "dataset", "partition", "seed", "round", "client_id"]
    frame = pd.DataFrame(records, columns=[*columns, "name", "value", "count"])
    return frame.astype({"client_id": "Int64", "count": "Int64"})


def _near(expected, **tol):
    return pytest.approx(np.array(expected, dtype=float), **tol)


def _gridded(ax) -> tuple[bool, float]:
    line = ax.xaxis.get_gridlines()[0]
    return line.get_visible(), line.get_alpha()


def _legend(ax) -> tuple[list[str], list[float]]:
    texts = ax.get_legend().get_texts()
    return [t.get_text() for t in texts], [t.get_fontsize() for t in texts]


# -- labels, panels, styles --------------------------------------------------------------------


def test_axis_label_names_and_percent():
    assert plots.axis_label("acc_global") == "global accuracy (%)"
    assert plots.axis_label("loss_train") == "training loss"
    assert plots.axis_label("ece_global") == "expected calibration error (global)"
    assert plots.axis_label("acc_domain_real-world") == "acc domain real-world (%)"
    assert plots.axis_label("wall_s") == "wall s"


def test_panels_grid_size_and_canvas():
    fig, axes = plots._panels(1)
    assert tuple(fig.get_size_inches()) == pytest.approx((4.5, 3.8))
    assert [ax.get_subplotspec().get_geometry() for ax in axes] == [(1, 1, 0, 0)]
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    fig, axes = plots._panels(4)  # at most 3 columns: 2 rows
    assert tuple(fig.get_size_inches()) == pytest.approx((13.5, 7.6))
    assert [ax.get_subplotspec().get_geometry() for ax in axes] == [
        (2, 3, 0, 0), (2, 3, 1, 1), (2, 3, 2, 2), (2, 3, 3, 3)
    ]  # fmt: skip
    fig, axes = plots._panels(2, width=2.0, height=1.0)
    assert tuple(fig.get_size_inches()) == pytest.approx((4.0, 1.0))


def test_styles_cycle_ten_colours_and_twelve_markers_in_first_seen_order():
    methods = pd.Series(["b", "a", "b", *[f"m{i}" for i in range(11)]])
    styles = plots._styles(methods)
    assert list(styles)[:3] == ["b", "a", "m0"]
    assert [styles[m] for m in ["b", "a", "m0"]] == [("C0", "o"), ("C1", "s"), ("C2", "D")]
    # the 10th to 13th methods: colours wrap after C9, markers after the 12th ("p")
    assert [styles[f"m{i}"] for i in range(7, 11)] == [
        ("C9", "<"), ("C0", ">"), ("C1", "p"), ("C2", "o")
    ]  # fmt: skip


def test_panel_groups_titles_in_first_seen_order():
    df = pd.DataFrame({"dataset": ["b", "a", "b"], "partition": ["x", "y", "x"], "v": [1, 2, 3]})
    groups = plots._panel_groups(df)
    assert [(title, rows["v"].tolist()) for title, rows in groups] == [
        ("b / x", [1, 3]), ("a / y", [2])
    ]  # fmt: skip
    only = plots._panel_groups(df[["partition", "v"]])
    assert [title for title, _ in only] == ["x", "y"]
    ((title, rows),) = plots._panel_groups(df[["v"]])
    assert title == "" and rows["v"].tolist() == [1, 2, 3]


def test_require_names_the_suite_and_drops_client_rows():
    with pytest.raises(FpbenchError, match=re.escape("no results for suite s9; run `fpbench")):
        plots._require(_frame([]), "s9")
    with pytest.raises(FpbenchError, match="no results in the database"):
        plots._require(_frame([]), None)
    df = _frame([(1, "a", 0, 0, "acc_global", 0.5), (1, "a", 0, 0, "acc_global", 0.1, 3)])
    assert plots._require(df, None)["value"].tolist() == [0.5]


# -- trade-off and held-out ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trade() -> pd.DataFrame:
    """fedavg 2 seeds (70/30, 80/40), sgpt (90/50), fedrep (60/20), fedprox (50/10): final round."""
    rows = []
    for run, method, seed, g, w in [
        (1, "fedavg", 0, 0.7, 0.3), (2, "fedavg", 1, 0.8, 0.4), (3, "sgpt", 0, 0.9, 0.5),
        (4, "fedrep", 0, 0.6, 0.2), (5, "fedprox", 0, 0.5, 0.1),
    ]:  # fmt: skip
        rows += [(run, method, seed, 0, "acc_global", 0.0), (run, method, seed, 1, "acc_global", g)]
        rows += [(run, method, seed, 1, "acc_local_worst", w)]
        rows += [(run, method, seed, 1, "acc_heldout_mean", w + 0.05)]
        rows += [(run, method, seed, 1, "acc_local_mean", g + 0.05)]
    return _frame(rows)


def test_tradeoff_markers_error_bars_and_names(trade):
    fig = plots.tradeoff(trade, suite="s")
    (ax,) = fig.axes
    bars = ax.containers
    assert [c.get_label() for c in bars] == ["fedavg", "sgpt", "fedrep", "fedprox"]
    points = [c.lines[0].get_xydata().tolist() for c in bars]
    assert points == _near([[[75, 35]], [[90, 50]], [[60, 20]], [[50, 10]]])
    assert [c.lines[0].get_marker() for c in bars] == ["o", "s", "D", "^"]
    assert [c.lines[0].get_color() for c in bars] == ["C0", "C1", "C2", "C3"]
    assert [c.lines[0].get_markersize() for c in bars] == [8] * 4
    assert [(c.has_xerr, c.has_yerr) for c in bars] == [(True, True)] + [(False, False)] * 3
    # std of (70, 80) and of (30, 40): 7.071 both; caps 2 * capsize = 6 points wide
    (xerr, yerr) = bars[0].lines[2]
    assert xerr.get_segments()[0] == pytest.approx(np.array([[67.929, 35], [82.071, 35]]), 1e-4)
    assert yerr.get_segments()[0] == pytest.approx(np.array([[75, 27.929], [75, 42.071]]), 1e-4)
    assert [cap.get_markersize() for cap in bars[0].lines[1]] == [6.0] * 4
    names = [(t.get_text(), t.xy, t.xyann, t.anncoords) for t in ax.texts]
    offsets = [(6, 6), (6, -6), (6, -18), (6, 6)]  # staggered by position mod 3
    assert [n[0] for n in names] == ["fedavg", "sgpt", "fedrep", "fedprox"]
    points = np.array([n[1] for n in names], dtype=float)
    assert points == pytest.approx(np.array([(75, 35), (90, 50), (60, 20), (50, 10)], dtype=float))
    assert [n[2] for n in names] == offsets
    assert {n[3] for n in names} == {"offset points"}
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("global accuracy (%)", "worst local accuracy (%)")
    assert ax.get_title() == "cifar100 / dir"
    assert _gridded(ax) == (True, 0.3) and ax.margins() == (0.15, 0.15)
    assert fig.get_suptitle() == "worst local accuracy vs global accuracy\nsuite s"
    assert fig._suptitle.get_fontsize() == MEDIUM
    assert plots.tradeoff(trade).get_suptitle() == "worst local accuracy vs global accuracy"


def test_tradeoff_other_metrics_and_the_missing_pair(trade):
    runs = trade.drop_duplicates("run_id")
    loss = runs.assign(name="loss_x", value=runs["run_id"] * 0.5)
    fig = plots.tradeoff(pd.concat([trade, loss]), x="acc_local_mean", y="loss_x")
    assert fig.get_suptitle() == "loss_x vs mean local accuracy"
    swapped = plots.tradeoff(pd.concat([trade, loss]), x="loss_x", y="acc_global")
    assert swapped.get_suptitle() == "global accuracy vs loss_x"
    (ax,) = fig.axes
    assert ax.get_ylabel() == "loss x"
    # fedavg: local mean (75 + 5) %, loss mean(0.5, 1.0) not scaled
    assert ax.containers[0].lines[0].get_xydata().tolist() == _near([[80, 0.75]])
    msg = "no run has both 'acc_global' and 'loss_x'; pick other metrics with --x/--y"
    extra = _frame([(9, "z", 0, 1, "loss_x", 2.0)])
    with pytest.raises(FpbenchError, match=re.escape(msg)):
        plots.tradeoff(pd.concat([trade[trade["name"] == "acc_global"], extra]), y="loss_x")


def test_heldout_axes_and_title(trade):
    fig = plots.heldout(trade, suite="s")
    (ax,) = fig.axes
    assert fig.get_suptitle() == "participating vs held-out client accuracy\nsuite s"
    assert plots.heldout(trade).get_suptitle() == "participating vs held-out client accuracy"
    with pytest.raises(FpbenchError, match="no results for suite q;"):
        plots.heldout(trade.iloc[:0], suite="q")
    assert (ax.get_xlabel(), ax.get_ylabel()) == (
        "mean local accuracy (%)", "mean held-out accuracy (%)"
    )  # fmt: skip
    # fedavg: local 75 + 5, held out 35 + 5
    assert ax.containers[0].lines[0].get_xydata().tolist() == _near([[80, 40]])


# -- learning curves ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def learn() -> pd.DataFrame:
    """fedavg seeds 0/1: rounds 0, 1 at 50/60 %, 70/90 %; sgpt: 40, 45 %; a client row ignored."""
    return _frame([
        (1, "fedavg", 0, 0, "acc_global", 0.5), (2, "fedavg", 1, 0, "acc_global", 0.6),
        (1, "fedavg", 0, 1, "acc_global", 0.7), (2, "fedavg", 1, 1, "acc_global", 0.9),
        (3, "sgpt", 0, 1, "acc_global", 0.45), (3, "sgpt", 0, 0, "acc_global", 0.4),
        (1, "fedavg", 0, 1, "acc_global", 0.0, 4), (3, "sgpt", 0, 1, "loss_train", 1.5),
        (3, "sgpt", 0, 0, "loss_train", 2.5), (3, "sgpt", 0, 0, "acc_local_worst", 0.1),
    ])  # fmt: skip


def test_curves_mean_lines_std_bands_and_labels(learn):
    fig = plots.curves(learn, "acc_global", suite="s")
    (ax,) = fig.axes
    assert [ln.get_label() for ln in ax.lines] == ["fedavg", "sgpt"]
    # rounds from 1; fedavg mean over seeds 55, 80; sgpt sorted by round
    assert ax.lines[0].get_xydata().tolist() == _near([[1, 55], [2, 80]])
    assert ax.lines[1].get_xydata().tolist() == _near([[1, 40], [2, 45]])
    assert [(ln.get_color(), ln.get_marker()) for ln in ax.lines] == [("C0", "o"), ("C1", "s")]
    (band,) = ax.collections  # one seed of sgpt: no band
    assert band.get_alpha() == 0.2
    assert tuple(band.get_facecolor()[0]) == pytest.approx(to_rgba("C0", 0.2))
    verts = band.get_paths()[0].vertices
    # std of (50, 60) = 7.071, of (70, 90) = 14.142
    for x, low, high in [(1, 47.929, 62.071), (2, 65.858, 94.142)]:
        ys = verts[np.isclose(verts[:, 0], x), 1]
        assert (ys.min(), ys.max()) == pytest.approx((low, high), abs=1e-3)
    locator = ax.xaxis.get_major_locator()
    assert type(locator) is MaxNLocator and locator._integer
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("round (1 = the first)", "global accuracy (%)")
    assert _gridded(ax) == (True, 0.3)
    assert _legend(ax) == (["fedavg", "sgpt"], [SMALL, SMALL])
    assert ax.get_title() == "cifar100 / dir"
    assert fig.get_suptitle() == "global accuracy per round\nsuite s"
    assert plots.curves(learn).get_suptitle() == "global accuracy per round"  # the default metric


def test_curves_of_a_loss_are_not_scaled_and_unknown_metric_lists_the_stored(learn):
    fig = plots.curves(learn, "loss_train")
    ax = fig.axes[0]
    assert ax.lines[0].get_xydata().tolist() == _near([[1, 2.5], [2, 1.5]])
    assert ax.get_ylabel() == "training loss"
    assert fig.get_suptitle() == "training loss per round"
    other = learn.assign(name=learn["name"].replace("loss_train", "wall_x"))
    assert plots.curves(other, "wall_x").get_suptitle() == "wall_x per round"
    msg = "no rows for metric 'acc_pooled'; stored metrics: acc_global, acc_local_worst, loss_train"
    with pytest.raises(FpbenchError, match=re.escape(msg)):
        plots.curves(learn, "acc_pooled")
    with pytest.raises(FpbenchError, match="no results for suite q"):
        plots.curves(learn.iloc[:0], suite="q")


def test_curves_markers_only_up_to_25_points_and_thin_bands():
    rows = [(1, "b", 0, r, "acc_global", 0.5) for r in range(25)]
    rows += [(2, "a", 0, r, "acc_global", 0.5) for r in range(26)]
    # c: 50.0 and 51.0 % at round 0 (std 0.71 points), one seed only at round 1 (60 %)
    rows += [(3, "c", 0, 0, "acc_global", 0.5), (4, "c", 1, 0, "acc_global", 0.51)]
    rows += [(3, "c", 0, 1, "acc_global", 0.6)]
    ax = plots.curves(_frame(rows)).axes[0]
    assert [ln.get_label() for ln in ax.lines] == ["b", "a", "c"]  # first-seen order
    assert [ln.get_marker() for ln in ax.lines] == ["o", "None", "D"]
    (band,) = ax.collections
    assert tuple(band.get_facecolor()[0]) == pytest.approx(to_rgba("C2", 0.2))  # c's colour
    verts = band.get_paths()[0].vertices
    at_1, at_2 = verts[np.isclose(verts[:, 0], 1), 1], verts[np.isclose(verts[:, 0], 2), 1]
    assert (at_1.min(), at_1.max()) == pytest.approx((50.5 - 0.7071, 50.5 + 0.7071), abs=1e-4)
    assert len(at_2) and np.allclose(at_2, 60.0)  # one seed: the band closes on the line


# -- config values, sweeps, heatmaps -------------------------------------------------------------


def test_config_value_paths_fallbacks_and_nested_keys():
    cfg = {
        "train": {"lr": 0.1, "sched": {"lr": 0.5}, "zero": 0, "none": None},
        "method": {"name": "x", "args": {"ls": [8, 9, 20, 21], "nest": {"k": {"deep": 3}}}},
        "other": {"none": 5},
    }
    value = plots.config_value
    assert value(cfg, "method.args.ls.2") == 20
    assert value(cfg, "method.args.ls.3") == 21
    assert value(cfg, "method.args.ls.4") is None  # past the end: looked up as a key "4"
    assert value(cfg, "method.args.ls.x") is None
    assert value(cfg, "train.sched.lr") == 0.5
    assert value(cfg, "lr") == 0.1  # the first found, depth first
    assert value(cfg, "train.nope.lr") == 0.1  # the last part is looked up anywhere
    assert value(cfg, "deep") == 3
    assert value(cfg, "k") is None  # a mapping is not a value
    assert value(cfg, "zero") == 0
    assert value(cfg, "none") == 5  # a None value is not found: the search goes on
    assert value({"xs": [{"v": 1}, {"v": 2}]}, "xs.1.v") == 2


def _sweep_data():
    """fgpt-g10 / -g20 (family fgpt) with 2 seeds each, fedvpt with G 10 and no method name."""
    rows, configs = [], {}
    runs = [
        (1, "fgpt-g10", 0, 10, 1, 0.60), (2, "fgpt-g10", 1, 10, 1, 0.64),
        (3, "fgpt-g20", 0, 20, 1, 0.70), (4, "fgpt-g20", 1, 20, 2, 0.80),
        (5, "fedvpt", 0, 10, 2, 0.50), (6, "nogroups", 0, None, 1, 0.3),
    ]  # fmt: skip
    for run, method, seed, groups, epochs, acc in runs:
        rows.append((run, method, seed, 1, "acc_global", acc))
        args = {} if groups is None else {"num_groups": groups}
        named = {"name": "fgpt"} if method.startswith("fgpt") else {}
        configs[run] = {"method": {**named, "args": args}, "train": {"local_epochs": epochs}}
    return _frame(rows), configs


def test_sweep_lines_per_family_with_std_bars():
    metrics, configs = _sweep_data()
    fig = plots.sweep(metrics, configs, "num_groups", suite="s")
    (ax,) = fig.axes
    bars = ax.containers
    assert [c.get_label() for c in bars] == ["fgpt", "fedvpt"]  # "nogroups" has no num_groups
    # fgpt: G 10 mean(60, 64) = 62, std 2.828; G 20 mean(70, 80) = 75, std 7.071
    assert bars[0].lines[0].get_xydata().tolist() == _near([[10, 62], [20, 75]])
    assert bars[1].lines[0].get_xydata().tolist() == _near([[10, 50]])
    (yerr,) = bars[0].lines[2]
    assert [s[:, 1].tolist() for s in yerr.get_segments()] == _near(
        [[59.172, 64.828], [67.929, 82.071]], abs=1e-3
    )
    (one,) = bars[1].lines[2]  # one run: no std, a zero-length bar
    assert one.get_segments()[0][:, 1].tolist() == pytest.approx([50, 50])
    assert [(c.lines[0].get_color(), c.lines[0].get_marker()) for c in bars] == [
        ("C0", "o"), ("C1", "s")
    ]  # fmt: skip
    assert [cap.get_markersize() for cap in bars[0].lines[1]] == [6.0, 6.0]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "cifar100 / dir", "num_groups", "global accuracy (%)"
    )  # fmt: skip
    assert _gridded(ax) == (True, 0.3)
    assert _legend(ax) == (["fgpt", "fedvpt"], [SMALL, SMALL])
    locator = ax.xaxis.get_major_locator()
    assert type(locator) is MaxNLocator and locator._integer  # whole numbers
    assert fig.get_suptitle() == "global accuracy vs num_groups\nsuite s"
    loss = metrics.assign(name="loss_x", value=metrics["value"] * 10)
    fig = plots.sweep(loss, configs, "train.local_epochs", "loss_x")
    assert fig.get_suptitle() == "loss_x vs train.local_epochs"
    # by epochs: fgpt E 1 mean(6.0, 6.4, 7.0), E 2 8.0; not scaled
    assert fig.axes[0].containers[0].lines[0].get_xydata().tolist() == _near(
        [[1, 6.4667], [2, 8.0]], abs=1e-4
    )
    msg = "no run config has 'nope'; name a config key, e.g. train.local_epochs or num_groups"
    with pytest.raises(FpbenchError, match=re.escape(msg)):
        plots.sweep(metrics, configs, "nope")
    with pytest.raises(FpbenchError, match="no results for suite q;"):
        plots.sweep(metrics.iloc[:0], configs, "num_groups", suite="q")


def test_sweep_categorical_and_fractional_values():
    metrics, configs = _sweep_data()
    for run, cfg in configs.items():
        cfg["optim"] = {"name": {1: "sgd", 2: "sgd", 3: "adam"}.get(run, "lamb")}
        cfg["frac"] = {1: 1.0, 2: 1.0, 3: 1.5}.get(run, 2.5)
    ax = plots.sweep(metrics, configs, "optim.name").axes[0]
    # sorted names at 0, 1, 2: adam (run 3), lamb (runs 4-6), sgd (runs 1, 2)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["adam", "lamb", "sgd"]
    assert list(ax.get_xticks()) == [0, 1, 2]
    fgpt = ax.containers[0].lines[0].get_xydata().tolist()
    assert fgpt == _near([[0, 70], [1, 80], [2, 62]])
    ax = plots.sweep(metrics, configs, "frac").axes[0]
    assert ax.containers[0].lines[0].get_xydata().tolist() == _near(
        [[1.0, 62], [1.5, 70], [2.5, 80]]
    )
    assert type(ax.xaxis.get_major_locator()) is not MaxNLocator  # 1.5 is not whole


def test_sweep_keeps_a_run_whose_final_value_is_nan():
    metrics = _frame([(1, "a", 0, 1, "acc_global", 0.5), (2, "a", 0, 1, "acc_global", np.nan)])
    configs = {1: {"g": 1}, 2: {"g": 2}}
    (bar,) = plots.sweep(metrics, configs, "g").axes[0].containers
    assert bar.lines[0].get_xydata().tolist() == _near([[1, 50], [2, np.nan]], nan_ok=True)


def test_heatmap_grid_annotations_ticks_and_colourbar():
    metrics, configs = _sweep_data()
    fgpt = metrics[metrics["method"].str.startswith("fgpt")]
    with matplotlib.rc_context({"image.cmap": "gray"}):  # viridis whatever the user's default
        fig = plots.heatmap(fgpt, configs, "num_groups", "train.local_epochs", suite="s")
    ax, bar = fig.axes
    image = ax.images[0]
    # rows E = 1, 2; columns G = 10, 20: (60 + 64) / 2, 70; no run at (E 2, G 10); 80
    grid = np.ma.filled(image.get_array().astype(float), np.nan)
    assert np.allclose(grid, [[62, 70], [np.nan, 80]], equal_nan=True)
    assert image.get_cmap().name == "viridis" and image.origin == "lower"
    texts = [(t.get_text(), t.get_position(), t.get_color()) for t in ax.texts]
    # low 62, high 80, middle 71: above it dark ("k"), else white
    assert texts == [("62.0", (0, 0), "w"), ("70.0", (1, 0), "w"), ("80.0", (1, 1), "k")]
    assert {(t.get_ha(), t.get_va(), t.get_fontsize()) for t in ax.texts} == {
        ("center", "center", 8)
    }
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "20"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"]
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "fgpt / cifar100 / dir", "num_groups", "train.local_epochs"
    )  # fmt: skip
    assert bar.get_ylabel() == "global accuracy (%)"
    assert bar.get_ylim() == pytest.approx((62, 80))  # the colour scale spans the grid
    assert fig.get_suptitle() == "global accuracy over num_groups x train.local_epochs\nsuite s"
    assert plots.heatmap(fgpt, configs, "num_groups", "train.local_epochs").get_suptitle() == (
        "global accuracy over num_groups x train.local_epochs"
    )
    one = plots.heatmap(
        metrics[metrics["run_id"] == 5], configs, "num_groups", "train.local_epochs"
    )
    assert [(t.get_text(), t.get_color()) for t in one.axes[0].texts] == [("50.0", "w")]
    assert one.axes[0].get_title() == "fedvpt / cifar100 / dir"
    loss = plots.heatmap(fgpt.assign(name="loss_x"), configs, "num_groups", "train.local_epochs",
                         "loss_x")  # fmt: skip
    assert loss.axes[0].texts[0].get_text() == "0.6" and loss.axes[1].get_ylabel() == "loss x"
    with pytest.raises(FpbenchError, match=re.escape("no run config has 'a' and 'b'; name")):
        plots.heatmap(fgpt, configs, "a", "b")
    with pytest.raises(FpbenchError, match="no results for suite q;"):
        plots.heatmap(fgpt.iloc[:0], configs, "a", "b", suite="q")
    assert loss.get_suptitle() == "loss_x over num_groups x train.local_epochs"
    # panels in first-seen order: fgpt's runs come before fedvpt's
    both = plots.heatmap(metrics, configs, "num_groups", "train.local_epochs")
    assert [a.get_title() for a in both.axes[:2]] == [
        "fgpt / cifar100 / dir", "fedvpt / cifar100 / dir"
    ]  # fmt: skip


def test_heatmap_rows_and_columns_of_a_non_square_grid():
    metrics, configs = _sweep_data()
    for run, cfg in configs.items():
        cfg["lr"] = {1: 1.0, 2: 1.5, 3: 1.5}.get(run, 2.5)
    fgpt = metrics[metrics["method"].str.startswith("fgpt")]
    ax = plots.heatmap(fgpt, configs, "num_groups", "lr").axes[0]
    # rows lr 1.0, 1.5, 2.5; columns G 10, 20: [60, -], [64, 70], [-, 80]
    grid = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    assert np.allclose(grid, [[60, np.nan], [64, 70], [np.nan, 80]], equal_nan=True)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1.0", "1.5", "2.5"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["10", "20"]
    texts = [(t.get_text(), t.get_position(), t.get_color()) for t in ax.texts]
    # middle (60 + 80) / 2 = 70: only values above it are dark
    assert texts == [
        ("60.0", (0, 0), "w"), ("64.0", (0, 1), "w"), ("70.0", (1, 1), "w"), ("80.0", (1, 2), "k")
    ]  # fmt: skip


# -- communication -------------------------------------------------------------------------------


def _comm_data():
    """Two fedavg seeds and one apfl run (after them: not in name order), 3 rounds of 10 B up +
    30 B down, 1.5 s each."""
    rows, rounds = [], []
    accs = {1: [0.5, 0.6, 0.8], 2: [0.5, 0.7, 0.8], 3: [0.2, 0.3, 0.5]}
    for run, method in [(1, "fedavg"), (2, "fedavg"), (3, "apfl")]:
        for r in (2, 0, 1):  # out of order: the cost is summed in round order
            rows.append((run, method, run - 1, r, "acc_global", accs[run][r]))
            rounds.append({"run_id": run, "round": r, "bytes_up": 10, "bytes_down": 30,
                           "wall_s": 1.5})  # fmt: skip
        rows.append((run, method, run - 1, 2, "acc_global", 0.0, 1))  # a client's row
        rows.append((run, method, run - 1, 2, "loss_train", 1.0))
    return _frame(rows), pd.DataFrame(rounds)


def test_cumulative_cost_sums_bytes_and_seconds_per_run():
    metrics, rounds = _comm_data()
    cost = plots.cumulative_cost(metrics, rounds, "acc_global")
    assert list(cost.columns) == [
        "run_id", "method", "dataset", "partition", "round", "value", "bytes", "wall_s"
    ]  # fmt: skip
    one = cost[cost["run_id"] == 1].sort_values("round")
    assert one["bytes"].tolist() == [40, 80, 120]
    assert one["wall_s"].tolist() == pytest.approx([1.5, 3.0, 4.5])
    assert one["value"].tolist() == [0.5, 0.6, 0.8]
    assert len(cost) == 9  # no client rows, no loss rows


def test_to_target_first_crossing_and_runs_that_never_reach():
    metrics, rounds = _comm_data()
    table = plots.to_target(metrics, rounds, "acc_global", 0.7)
    assert list(table.columns) == [
        "method", "dataset", "partition", "runs", "rounds", "wall_s", "bytes", "reached"
    ]  # fmt: skip
    fedavg, apfl = table.iloc[0], table.iloc[1]
    # run 1 reaches 0.7 at its round 2 (3rd), run 2 exactly at round 1 (2nd): means 2.5 rounds
    assert (fedavg["method"], fedavg["runs"], fedavg["reached"]) == ("fedavg", 2, 2)
    assert (fedavg["rounds"], fedavg["wall_s"], fedavg["bytes"]) == pytest.approx((2.5, 3.75, 100))
    assert (apfl["method"], apfl["runs"], apfl["reached"]) == ("apfl", 1, 0)
    assert np.isnan(apfl["rounds"]) and table["reached"].dtype == int


def test_comm_lines_target_stars_and_labels():
    metrics, rounds = _comm_data()
    fig = plots.comm(metrics, rounds, target=0.7, suite="s")
    (ax,) = fig.axes
    lines = ax.get_lines()
    named = [ln for ln in lines if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in named] == ["fedavg", "apfl"]
    # fedavg: mean over seeds 50, 65, 80 at 40, 80, 120 B = 4e-5, 8e-5, 1.2e-4 MB
    assert named[0].get_xydata().tolist() == _near(
        [[4e-5, 50], [8e-5, 65], [1.2e-4, 80]], rel=1e-12
    )
    assert named[1].get_xydata().tolist() == _near([[4e-5, 20], [8e-5, 30], [1.2e-4, 50]])
    assert [(ln.get_color(), ln.get_marker(), ln.get_markersize()) for ln in named] == [
        ("C0", "o", 4), ("C1", "s", 4)
    ]  # fmt: skip
    stars = [ln for ln in lines if ln.get_marker() == "*"]  # fedavg only: apfl never gets there
    assert len(stars) == 1 and stars[0].get_xydata().tolist() == _near([[1.2e-4, 80]])
    assert (stars[0].get_color(), stars[0].get_markersize()) == ("C0", 14)
    (target,) = [ln for ln in lines if ln.get_linestyle() == "--"]
    assert list(target.get_ydata()) == [70, 70]
    assert (target.get_color(), target.get_linewidth()) == ("grey", 1)
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == (
        "cifar100 / dir", "cumulative communication (MB, up + down)", "global accuracy (%)"
    )  # fmt: skip
    assert _gridded(ax) == (True, 0.3)
    assert _legend(ax) == (["fedavg", "apfl"], [SMALL, SMALL])
    assert fig.get_suptitle() == "global accuracy vs communication\nsuite s"
    # reaching the target exactly counts: fedavg at its 1st round, apfl at its 3rd
    fig = plots.comm(metrics, rounds, "acc_global", target=0.5)
    stars = [ln for ln in fig.axes[0].get_lines() if ln.get_marker() == "*"]
    assert [s.get_xydata().tolist() for s in stars] == _near([[[4e-5, 50]], [[1.2e-4, 50]]])
    assert [s.get_color() for s in stars] == ["C0", "C1"]
    plain = plots.comm(metrics, rounds, "loss_train")
    assert len(plain.axes[0].get_lines()) == 2  # no target: no stars, no dashed line
    assert plain.axes[0].get_lines()[0].get_ydata().tolist() == [1.0]  # not scaled
    assert plain.axes[0].get_ylabel() == "training loss"
    assert plain.get_suptitle() == "training loss vs communication"
    other = metrics.assign(name=metrics["name"].replace("loss_train", "loss_x"))
    assert plots.comm(other, rounds, "loss_x").get_suptitle() == "loss_x vs communication"
    with pytest.raises(FpbenchError, match="no evaluated rounds of 'acc_pooled' with comm"):
        plots.comm(metrics, rounds, "acc_pooled")
    with pytest.raises(FpbenchError, match="no results for suite q"):
        plots.comm(metrics.iloc[:0], rounds, suite="q")


# -- partition plots -----------------------------------------------------------------------------


def _cells():
    """Stand-ins for suite cells: dataset and partition labels, a seed."""

    def cell(ds, part, seed):
        return SimpleNamespace(dataset=SimpleNamespace(label=ds),
                               partition=SimpleNamespace(label=part), seed=seed)  # fmt: skip

    return [cell("cifar", "dir", 0), cell("cifar", "iid", 0), cell("svhn", "iid", 1),
            cell("svhn", "dir", 1), cell("svhn", "iid", 2)]  # fmt: skip


def test_select_cell_filters_in_turn_and_names_the_valid_values():
    cells = _cells()
    assert select_cell(cells, None, None, None) is cells[0]
    assert select_cell(cells, "svhn", None, None) is cells[2]
    assert select_cell(cells, "svhn", "iid", 2) is cells[4]
    assert select_cell(cells, None, "dir", 1) is cells[3]
    with pytest.raises(FpbenchError) as err:
        select_cell(cells, "mnist", None, None)
    assert str(err.value) == "--dataset 'mnist' is not in the suite; valid: cifar, svhn"
    with pytest.raises(FpbenchError) as err:  # valid values of the cells left by the filters
        select_cell(cells, "svhn", "iid", 0)
    assert str(err.value) == "--seed 0 is not in the suite; valid: 1, 2"
    with pytest.raises(FpbenchError) as err:
        select_cell(cells, "cifar", "path", None)
    assert str(err.value) == "--partition 'path' is not in the suite; valid: dir, iid"


def test_class_counts_keeps_every_class_and_no_clients():
    labels = np.array([0, 1, 1, 0])
    clients = [SimpleNamespace(train_idx=np.array([0, 1, 2]))]
    counts = class_counts(clients, labels, 4)  # classes 2 and 3 held by no one
    assert counts.tolist() == [[1, 2, 0, 0]] and counts.dtype == np.int64
    empty = class_counts([], labels, 3)
    assert empty.shape == (0, 3) and empty.dtype == np.int64


def _pview(n: int, c: int, heldout: tuple[int, ...] = (1,)) -> PartitionView:
    counts = np.arange(n * c).reshape(n, c) % 7
    names = [f"k{k}" for k in range(c)]
    return PartitionView(counts, [i in heldout for i in range(n)], names, "T")


def test_partition_figure_size_layout_and_title():
    # bars: width max(6, min(0.35 n + 2.5, 18)), height 4.8
    for n, width in [(3, 6.0), (20, 9.5), (50, 18.0)]:
        fig = partition_figure(_pview(n, 3), "bars")
        assert tuple(fig.get_size_inches()) == pytest.approx((width, 4.8))
    # heatmap: height max(3.5, 0.25 n + 2)
    for n, size in [(3, (6.0, 3.5)), (10, (6.0, 4.5))]:
        assert tuple(partition_figure(_pview(n, 3), "heatmap").get_size_inches()) == (
            pytest.approx(size)
        )
    fig = partition_figure(_pview(3, 3))
    assert isinstance(fig.canvas, FigureCanvasAgg)
    assert isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine)
    ax = fig.axes[0]
    assert ax.get_title() == "T" and ax.title.get_fontsize() == MEDIUM
    with pytest.raises(FpbenchError) as err:
        partition_figure(_pview(3, 3), "pie")
    assert str(err.value) == "unknown plot kind 'pie'; choose one of auto, bars, heatmap"


def test_partition_auto_bars_up_to_20_classes():
    assert partition_figure(_pview(2, 20)).axes[0].containers  # bars
    ax = partition_figure(_pview(2, 21)).axes[0]
    assert not ax.containers and len(ax.images) == 1


def test_partition_bars_stack_colours_hatches_ticks_and_legend():
    view = _pview(3, 3)  # counts [[0, 1, 2], [3, 4, 5], [6, 0, 1]]; client 1 held out
    ax = partition_figure(view, "bars").axes[0]
    tab20 = colormaps["tab20"].colors
    for k, bars in enumerate(ax.containers):
        assert [p.get_height() for p in bars] == view.counts[:, k].tolist()
        below = view.counts[:, :k].sum(axis=1).tolist()  # stacked on the classes before
        assert [p.get_y() for p in bars] == below
        assert [p.get_x() + p.get_width() / 2 for p in bars] == pytest.approx([0, 1, 2])
        assert {tuple(p.get_facecolor()) for p in bars} == {to_rgba(tab20[k])}
        assert {tuple(p.get_edgecolor()) for p in bars} == {(1.0, 1.0, 1.0, 1.0)}
        assert {p.get_linewidth() for p in bars} == {0.3}
        assert [p.get_hatch() or "" for p in bars] == ["", "//", ""]
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == ["0", "1 (held out)", "2"]
    assert [t.get_color() for t in ticks] == ["black", HELDOUT_COLOR, "black"]
    assert {t.get_rotation() for t in ticks} == {0}
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("client", "train samples")
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "class"
    assert [t.get_text() for t in legend.get_texts()] == ["k0", "k1", "k2"]
    assert {t.get_fontsize() for t in legend.get_texts()} == {
        FontProperties(size="x-small").get_size_in_points()
    }
    assert (legend._ncols, legend._loc) == (2, 2)  # 2: upper left
    corner = legend.get_bbox_to_anchor().get_points()[0]
    assert corner == pytest.approx(ax.transAxes.transform((1, 1)))
    many = partition_figure(_pview(9, 2), "bars").axes[0]  # more than 8 clients: upright labels
    assert {t.get_rotation() for t in many.get_xticklabels()} == {90}
    assert {t.get_rotation() for t in partition_figure(_pview(8, 2), "bars").axes[0]
            .get_xticklabels()} == {0}  # fmt: skip


def test_partition_class_colours_tab20_then_turbo():
    assert _class_colors(3) == list(colormaps["tab20"].colors[:3])
    assert _class_colors(20) == list(colormaps["tab20"].colors)
    turbo = _class_colors(21)
    assert np.allclose(turbo, colormaps["turbo"](np.linspace(0, 1, 21)))
    assert np.allclose(turbo[0], colormaps["turbo"](0.0)) and len(turbo) == 21


def test_partition_heatmap_image_ticks_and_colourbar():
    view = _pview(4, 50, heldout=(0, 3))
    with matplotlib.rc_context({"image.cmap": "gray"}):  # viridis whatever the user's default
        fig = partition_figure(view, "heatmap")
    ax, bar = fig.axes
    (image,) = ax.images
    assert np.asarray(image.get_array()).tolist() == view.counts.tolist()
    assert (image.get_cmap().name, image.get_interpolation()) == ("viridis", "nearest")
    assert ax.get_aspect() == "auto"
    assert bar.get_ylabel() == "train samples"
    assert bar.get_ylim() == (0, 6)  # the colour scale spans the counts (mod 7: 0 to 6)
    ys = ax.get_yticklabels()
    assert list(ax.get_yticks()) == [0, 1, 2, 3]
    assert [t.get_text() for t in ys] == ["0 (held out)", "1", "2", "3 (held out)"]
    assert [t.get_color() for t in ys] == [HELDOUT_COLOR, "black", "black", HELDOUT_COLOR]
    assert {t.get_fontsize() for t in ys} == {SMALL}
    # 50 classes: every 50 // 25 = 2nd class named
    assert list(ax.get_xticks()) == list(range(0, 50, 2))
    xs = ax.get_xticklabels()
    assert [t.get_text() for t in xs] == [f"k{k}" for k in range(0, 50, 2)]
    assert {(t.get_rotation(), t.get_fontsize()) for t in xs} == {(90, SMALL)}
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("class", "client")
    few = partition_figure(_pview(2, 3), "heatmap").axes[0]
    assert list(few.get_xticks()) == [0, 1, 2]


def test_suite_partition_title_names_and_heldout_flags(tmp_path):
    from fpbench.engine.task import load_dataset
    from fpbench.partition import make_clients
    from fpbench.suites import load_suite

    path = tmp_path / "pp.toml"
    path.write_text(PART_SUITE)
    cell = select_cell(load_suite(str(path)).cells, None, None, 1)
    view = suite_partition(cell)
    assert view.title == "synthetic / dir-0.5 / seed 1 (suite pp): train samples per class"
    data = load_dataset(cell.dataset)
    clients = make_clients(cell.partition.name, cell.partition.args, data, seed=1)
    assert view.heldout == [c.heldout for c in clients] and sum(view.heldout) == 1
    assert view.class_names == list(data.class_names) and len(view.class_names) == 4
    labels = data.train_labels.numpy()
    expected = [[int((labels[c.train_idx] == k).sum()) for k in range(4)] for c in clients]
    assert view.counts.tolist() == expected


PART_SUITE = """
name = "pp"
seeds = [0, 1]

[defaults]
backbone = { name = "vit-test" }
dataset = { num_classes = 4, image_size = 8, train_per_class = 6, test_per_class = 2 }
partition = { num_clients = 4, heldout_frac = 0.25 }

[[datasets]]
name = "synthetic"

[[partitions]]
name = "dirichlet"
label = "dir-0.5"
alpha = 0.5
min_size = 1

[[methods]]
name = "fedvpt"
"""
