"""Tests for summary tables and plots (fpbench.report)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fpbench.errors import FpbenchError
from fpbench.report import plots
from fpbench.report.compare import COLUMNS, compare_methods, paired_test
from fpbench.report.tables import render, summary_stats, summary_table
from fpbench.store import Store

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Rows:
    """Builds a metric frame shaped like `Store.metrics()`."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(
        self, run_id, method, seed, rnd, name, value, *, ds="cifar100", part="dir-0.1", client=None
    ):  # noqa: E501
        self.rows.append(
            {
                "run_id": run_id,
                "suite": "label-het",
                "method": method,
                "dataset": ds,
                "partition": part,
                "seed": seed,
                "round": rnd,
                "client_id": client,
                "name": name,
                "value": value,
                "count": None,
            }
        )

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows).astype({"client_id": "Int64", "count": "Int64"})


@pytest.fixture
def metrics() -> pd.DataFrame:
    """2 methods x 2 seeds on one (dataset, partition).

    fedavg (seen first) has no `_last10` rows, so its last-round values count; sgpt has them,
    so its per-round values (and a per-client row) must be ignored.
    """
    r = Rows()
    r.add(1, "fedavg", 0, 10, "acc_global", 0.99)
    r.add(1, "fedavg", 0, 20, "acc_global", 0.70)
    r.add(1, "fedavg", 0, 20, "acc_local_worst", 0.30)
    r.add(2, "fedavg", 1, 20, "acc_global", 0.75)
    r.add(2, "fedavg", 1, 20, "acc_local_worst", 0.36)
    r.add(3, "sgpt", 0, 20, "acc_global", 0.10)
    r.add(3, "sgpt", 0, 20, "acc_global_last10", 0.80)
    r.add(3, "sgpt", 0, 20, "acc_local_worst_last10", 0.50)
    r.add(3, "sgpt", 0, 20, "acc_global", 0.0, client=7)
    r.add(4, "sgpt", 1, 20, "acc_global", 0.20)
    r.add(4, "sgpt", 1, 20, "acc_global_last10", 0.82)
    r.add(4, "sgpt", 1, 20, "acc_local_worst_last10", 0.54)
    return r.frame()


@pytest.fixture
def two_panels(metrics: pd.DataFrame) -> pd.DataFrame:
    """Adds a second (dataset, partition) with one seed of fedavg only."""
    r = Rows()
    r.add(5, "fedavg", 0, 5, "acc_global", 0.40, ds="domainnet", part="domain")
    r.add(5, "fedavg", 0, 10, "acc_global", 0.60, ds="domainnet", part="domain")
    r.add(5, "fedavg", 0, 10, "acc_local_worst", 0.20, ds="domainnet", part="domain")
    return pd.concat([metrics, r.frame()], ignore_index=True)


# -- tables ----------------------------------------------------------------------------------


def test_summary_table_strings(metrics: pd.DataFrame) -> None:
    table = summary_table(metrics, ["acc_global", "acc_local_worst"])
    assert table.index.tolist() == ["fedavg", "sgpt"]  # first-seen order
    assert table.index.name == "method"
    assert table.columns.names == ["dataset", "partition", "metric"]
    # fedavg: 0.70, 0.75 -> mean 72.50, sample std 3.5355; sgpt: 0.80, 0.82 -> 81.00 +- 1.4142
    assert table.loc["fedavg", ("cifar100", "dir-0.1", "acc_global")] == "72.50 ± 3.54"
    assert table.loc["sgpt", ("cifar100", "dir-0.1", "acc_global")] == "81.00 ± 1.41"
    assert table.loc["fedavg", ("cifar100", "dir-0.1", "acc_local_worst")] == "33.00 ± 4.24"
    assert table.loc["sgpt", ("cifar100", "dir-0.1", "acc_local_worst")] == "52.00 ± 2.83"


def test_summary_table_one_seed_order_and_missing_cells(two_panels: pd.DataFrame) -> None:
    table = summary_table(two_panels, ["acc_global"], order={"method": ["sgpt"]})
    assert table.index.tolist() == ["sgpt", "fedavg"]
    assert table.columns.tolist() == [
        ("cifar100", "dir-0.1", "acc_global"),
        ("domainnet", "domain", "acc_global"),
    ]
    assert table.loc["fedavg", ("domainnet", "domain", "acc_global")] == "60.00"  # one seed
    assert table.loc["sgpt", ("domainnet", "domain", "acc_global")] == "-"


def test_summary_stats_numbers(metrics: pd.DataFrame) -> None:
    stats = summary_stats(metrics, ["acc_local_worst", "acc_global"])
    assert stats.columns.tolist() == [
        "method", "dataset", "partition", "metric", "mean", "std", "n", "ci_low", "ci_high",
    ]  # fmt: skip
    assert stats["metric"].tolist()[:2] == ["acc_local_worst", "acc_global"]  # given order
    sgpt = stats[(stats["method"] == "sgpt") & (stats["metric"] == "acc_global")].iloc[0]
    assert sgpt["mean"] == pytest.approx(0.81)
    assert sgpt["std"] == pytest.approx(np.std([0.80, 0.82], ddof=1))
    assert sgpt["n"] == 2
    # 95% t-interval: 0.81 ± t(0.975, 1) * 0.01414 / sqrt(2) = 0.81 ± 12.7062 * 0.01
    assert (sgpt["ci_low"], sgpt["ci_high"]) == pytest.approx((0.682938, 0.937062), abs=1e-6)
    pop = summary_stats(metrics, ["acc_global"], ddof=0)
    assert pop.loc[pop["method"] == "sgpt", "std"].item() == pytest.approx(0.01)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=6))
def test_summary_stats_match_numpy(values: list[float]) -> None:
    r = Rows()
    for seed, v in enumerate(values):
        r.add(seed, "m", seed, 3, "acc_global", 0.0)
        r.add(seed, "m", seed, 9, "acc_global", v)
    row = summary_stats(r.frame(), ["acc_global"]).iloc[0]
    assert row["n"] == len(values)
    assert row["mean"] == pytest.approx(np.mean(values))
    if len(values) > 1:
        assert row["std"] == pytest.approx(np.std(values, ddof=1), abs=1e-12)
    else:
        assert np.isnan(row["std"])


def test_empty_and_unknown_metric_errors(metrics: pd.DataFrame) -> None:
    with pytest.raises(FpbenchError, match=r"run `fpbench run --suite label-het` first"):
        summary_table(metrics.iloc[:0], ["acc_global"], suite="label-het")
    with pytest.raises(FpbenchError, match="no results"):
        plots.curves(metrics.iloc[:0])
    with pytest.raises(FpbenchError, match="acc_nope.*stored metrics: acc_global"):
        summary_table(metrics, ["acc_nope"])


def test_render_markdown(metrics: pd.DataFrame) -> None:
    md = render(summary_table(metrics, ["acc_global"]), "md")
    assert md.splitlines() == [
        "| method | cifar100 / dir-0.1 / acc_global |",
        "| :-- | --: |",
        "| fedavg | 72.50 ± 3.54 |",
        "| sgpt | 81.00 ± 1.41 |",
    ]


def test_render_csv_round_trips(metrics: pd.DataFrame) -> None:
    csv = render(summary_table(metrics, ["acc_global", "acc_local_worst"]), "csv")
    back = pd.read_csv(io.StringIO(csv), index_col="method")
    assert back.columns.tolist() == [
        "cifar100/dir-0.1/acc_global",
        "cifar100/dir-0.1/acc_local_worst",
    ]
    assert back.loc["sgpt", "cifar100/dir-0.1/acc_local_worst"] == "52.00 ± 2.83"


def test_render_latex_booktabs(two_panels: pd.DataFrame) -> None:
    tex = render(summary_table(two_panels, ["acc_global", "acc_local_worst"]), "latex")
    lines = tex.splitlines()
    assert lines[0] == r"\begin{tabular}{lrrrr}" and lines[-1] == r"\end{tabular}"
    assert lines[1] == r"\toprule"
    assert lines[2] == r" & \multicolumn{2}{c}{cifar100} & \multicolumn{2}{c}{domainnet} \\"
    assert lines[3] == r"\cmidrule(lr){2-3} \cmidrule(lr){4-5}"
    assert r"method & acc\_global & acc\_local\_worst & acc\_global & acc\_local\_worst \\" in lines
    assert r"sgpt & 81.00 $\pm$ 1.41 & 52.00 $\pm$ 2.83 & - & - \\" in lines
    assert r"fedavg & 72.50 $\pm$ 3.54 & 33.00 $\pm$ 4.24 & 60.00 & 20.00 \\" in lines
    assert lines.index(r"\midrule") < lines.index(r"\bottomrule")


def test_render_escapes_and_unknown_format() -> None:
    table = pd.DataFrame({"a|b_c": ["50%"]}, index=pd.Index(["x&y"], name="method"))
    assert "| x&y | 50% |" in render(table, "md") and "a\\|b_c" in render(table, "md")
    assert r"x\&y & 50\% \\" in render(table, "latex")
    with pytest.raises(FpbenchError, match="'html'.*md, csv, latex"):
        render(table, "html")


# -- plots -----------------------------------------------------------------------------------


def saved_png(fig, path: Path) -> bytes:
    fig.savefig(path)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 1000
    return data


def test_tradeoff_markers(metrics: pd.DataFrame, tmp_path: Path) -> None:
    fig = plots.tradeoff(metrics)
    (ax,) = fig.axes
    assert [c.get_label() for c in ax.containers] == ["fedavg", "sgpt"]
    points = {c.get_label(): c.lines[0].get_xydata()[0] for c in ax.containers}
    assert points["fedavg"] == pytest.approx([72.5, 33.0])
    assert points["sgpt"] == pytest.approx([81.0, 52.0])
    assert all(c.has_xerr and c.has_yerr for c in ax.containers)  # two seeds each
    assert sorted(t.get_text() for t in ax.texts) == ["fedavg", "sgpt"]
    assert ax.get_xlabel() == "global accuracy (%)"
    assert ax.get_ylabel() == "worst local accuracy (%)"
    saved_png(fig, tmp_path / "tradeoff.png")


def test_tradeoff_panels_per_dataset_partition(two_panels: pd.DataFrame, tmp_path: Path) -> None:
    fig = plots.tradeoff(two_panels)
    assert [ax.get_title() for ax in fig.axes] == ["cifar100 / dir-0.1", "domainnet / domain"]
    assert [len(ax.containers) for ax in fig.axes] == [2, 1]
    single = fig.axes[1].containers[0]
    assert not single.has_xerr and single.lines[0].get_xydata()[0] == pytest.approx([60, 20])
    assert single.lines[0].get_color() == fig.axes[0].containers[0].lines[0].get_color()
    saved_png(fig, tmp_path / "tradeoff2.png")
    with pytest.raises(FpbenchError, match="no run has both"):
        plots.tradeoff(two_panels, y="acc_heldout_worst")


def test_curves(two_panels: pd.DataFrame, tmp_path: Path) -> None:
    fig = plots.curves(two_panels, "acc_global")
    assert len(fig.axes) == 2
    first, second = fig.axes
    assert [line.get_label() for line in first.lines] == ["fedavg", "sgpt"]
    fedavg = first.lines[0].get_xydata()
    # rounds 10 and 20 of the database are rounds 11 and 21 of every view (numbered from 1)
    assert fedavg == pytest.approx(np.array([[11, 99.0], [21, 72.5]]))  # mean over seeds
    assert first.lines[1].get_xydata() == pytest.approx(np.array([[21, 15.0]]))  # no client row
    assert (len(first.collections), len(second.collections)) == (2, 0)  # std bands: 2 seeds only
    assert second.lines[0].get_xydata() == pytest.approx(np.array([[6, 40.0], [11, 60.0]]))
    assert first.get_xlabel() == "round (1 = the first)"
    assert first.get_ylabel() == "global accuracy (%)"
    saved_png(fig, tmp_path / "curves.png")
    with pytest.raises(FpbenchError, match="no rows for metric 'acc_pooled'"):
        plots.curves(two_panels, "acc_pooled")


def test_store_frames_feed_the_report(tmp_path: Path) -> None:
    with Store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        for seed, acc in enumerate([0.6, 0.7]):
            run = store.create_run(
                run_key=f"key{seed:04d}", suite="s", method="sgpt", dataset="d", partition="p",
                seed=seed, config={}, fpbench_version="0", torch_version="0", device="cpu",
            )  # fmt: skip
            for rnd in (1, 2):
                rows = [(None, "acc_global", acc * rnd / 2, None), (0, "acc_global", 0.0, 5)]
                store.write_round(
                    run.id, rnd, loss_train=None, wall_s=1, bytes_up=1, bytes_down=1, metrics=rows
                )
        df = store.metrics(suite="s")
    assert summary_table(df, ["acc_global"]).iloc[0, 0] == "65.00 ± 7.07"
    assert len(plots.curves(df).axes[0].lines) == 1


# -- compare: two methods, paired by seed ----------------------------------------------------


def test_paired_test_alpha_sign_and_interval_by_hand() -> None:
    # differences -0.05, -0.06, -0.07: mean -0.06, sd 0.01, t = -10.392 (2 df), p = 0.00913;
    # at alpha 0.01 the interval is -0.06 ± t(0.995, 2) 9.9248 * 0.01 / sqrt(3) = ± 0.0573011
    got = paired_test([0.3, 0.2, 0.1], [0.25, 0.14, 0.03], 0.01)
    assert got["mean_diff"] == pytest.approx(-0.06) and got["std_diff"] == pytest.approx(0.01)
    assert got["t"] == pytest.approx(-10.3923, abs=1e-4)
    assert got["p"] == pytest.approx(0.0091326, abs=1e-6)
    assert (got["ci_low"], got["ci_high"]) == pytest.approx((-0.1173011, -0.0026989), abs=1e-6)
    assert got["verdict"] == "exceeds seed noise"
    # differences 0.1, 0.05, 0.15, 0.1: sd 0.040825, t = 4.899 (3 df), p = 0.016277
    a, b = [0.1, 0.2, 0.3, 0.4], [0.2, 0.25, 0.45, 0.5]
    loose = paired_test(a, b, 0.2)  # 0.1 ± t(0.9, 3) 1.6377 * 0.020412
    assert (loose["ci_low"], loose["ci_high"]) == pytest.approx((0.0665697, 0.1334303), abs=1e-6)
    assert loose["verdict"] == "exceeds seed noise"
    strict = paired_test(a, b, 0.01)
    assert strict["p"] == pytest.approx(0.0162766, abs=1e-6) and strict["t"] == pytest.approx(
        4.89898
    )
    assert strict["verdict"] == "within seed noise"  # p above alpha
    assert paired_test(a, b, 0.0162767)["verdict"] == "exceeds seed noise"
    assert paired_test(a, b, 0.0162765)["verdict"] == "within seed noise"
    down = paired_test([0.3, 0.2], [0.1, 0.0])  # equal negative differences
    assert (down["t"], down["p"], down["std_diff"]) == (-np.inf, 0.0, 0.0)
    assert (down["ci_low"], down["ci_high"], down["verdict"]) == (-0.2, -0.2, "exceeds seed noise")
    up = paired_test([0.1, 0.2, 0.3], [0.2, 0.3, 0.4])  # 0.1 each, up to float rounding
    assert (up["t"], up["p"], up["std_diff"]) == (np.inf, 0.0, 0.0)
    none = paired_test([0.1, 0.2], [0.1, 0.2])
    assert np.isnan(none["t"]) and none["p"] == 1.0 and none["verdict"] == "within seed noise"
    one = paired_test([0.25], [0.5])
    assert one["mean_diff"] == 0.25 and one["verdict"] == "one seed: no test"
    assert all(np.isnan(one[k]) for k in ("std_diff", "ci_low", "ci_high", "t", "p"))
    with pytest.raises(ValueError):
        paired_test([0.1, 0.2], [0.1])


def test_compare_methods_pairs_each_cell_by_seed_in_metric_order() -> None:
    r = Rows()
    cell2 = {"ds": "domainnet", "part": "domain"}
    fedavg = {0: 0.9, 1: 0.1, 2: 0.2, 3: 0.3}  # seed 0 has no sgpt partner
    sgpt = {1: 0.15, 2: 0.26, 3: 0.37, 4: 0.8}  # seed 4 has no fedavg partner
    run = iter(range(1, 100))
    for method, values in (("sgpt", sgpt), ("fedavg", fedavg)):  # sgpt seen first
        for seed, v in values.items():
            i = next(run)
            r.add(i, method, seed, 9, "acc_global", v)
            r.add(i, method, seed, 9, "loss", 1 - v)
        for seed in (1, 0):
            v = 0.5 + seed / 10 + (0.2 if method == "sgpt" else 0.0)
            r.add(next(run), method, seed, 9, "acc_global", v, **cell2)
    r.add(next(run), "other", 1, 9, "acc_global", 0.0)
    found = compare_methods(r.frame(), "fedavg", "sgpt", ["loss", "acc_global"])
    assert list(found.columns) == COLUMNS
    assert found[["dataset", "partition", "metric", "n"]].values.tolist() == [
        ["cifar100", "dir-0.1", "loss", 3],
        ["cifar100", "dir-0.1", "acc_global", 3],
        ["domainnet", "domain", "acc_global", 2],
    ]
    loss, acc, other = (found.iloc[i] for i in range(3))
    assert acc["seeds"] == [1, 2, 3] and other["seeds"] == [0, 1]
    assert acc["diffs"] == pytest.approx([0.05, 0.06, 0.07])
    assert loss["diffs"] == pytest.approx([-0.05, -0.06, -0.07])
    assert (acc["mean_a"], acc["mean_b"]) == pytest.approx((0.2, 0.26))
    assert acc["mean_diff"] == pytest.approx(0.06) and acc["std_diff"] == pytest.approx(0.01)
    assert (acc["t"], acc["p"]) == pytest.approx((10.3923, 0.0091326), abs=1e-4)
    assert (acc["ci_low"], acc["ci_high"]) == pytest.approx((0.0351586, 0.0848414), abs=1e-6)
    assert loss["t"] == pytest.approx(-10.3923, abs=1e-4)
    assert other["diffs"] == pytest.approx([0.2, 0.2]) and other["p"] == 0.0
    assert (other["mean_a"], other["mean_b"]) == pytest.approx((0.55, 0.75))
    strict = compare_methods(r.frame(), "fedavg", "sgpt", ["acc_global"], alpha=0.005)
    assert strict["verdict"].tolist() == ["within seed noise", "exceeds seed noise"]
    assert (strict["ci_low"].iloc[0], strict["ci_high"].iloc[0]) == pytest.approx(
        (0.06 - 0.0813432, 0.06 + 0.0813432), abs=1e-6
    )  # t(0.9975, 2) 14.0890 * 0.01 / sqrt(3)
    swapped = compare_methods(r.frame(), "sgpt", "fedavg", ["acc_global"])
    assert swapped["diffs"].iloc[0] == pytest.approx([-0.05, -0.06, -0.07])
    only = compare_methods(r.frame(), "fedavg", "sgpt", ["acc_global"], suite="label-het")
    assert len(only) == 2


def test_compare_methods_refuses_what_cannot_be_compared() -> None:
    r = Rows()
    r.add(1, "fedavg", 0, 9, "acc_global", 0.5)
    r.add(2, "sgpt", 1, 9, "acc_global", 0.6)
    r.add(3, "sgpt", 0, 9, "acc_global", 0.6, ds="domainnet")
    frame = r.frame()
    with pytest.raises(FpbenchError, match="^compare needs two different methods, got sgpt twice$"):
        compare_methods(frame, "sgpt", "sgpt", ["acc_global"])
    for alpha in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(FpbenchError, match=f"^--alpha must be between 0 and 1, got {alpha}$"):
            compare_methods(frame, "fedavg", "sgpt", ["acc_global"], alpha=alpha)
    with pytest.raises(
        FpbenchError, match="^no runs of method 'nope' with these metrics; stored: fedavg, sgpt$"
    ):  # noqa: E501
        compare_methods(frame, "nope", "sgpt", ["acc_global"])
    with pytest.raises(FpbenchError, match="^no runs of method 'nope'"):
        compare_methods(frame, "sgpt", "nope", ["acc_global"])
    with pytest.raises(
        FpbenchError, match=r"^fedavg and sgpt share no \(dataset, partition, seed\) to compare$"
    ):  # noqa: E501
        compare_methods(frame, "fedavg", "sgpt", ["acc_global"])
    with pytest.raises(FpbenchError, match="no results for suite x"):
        compare_methods(frame.iloc[:0], "fedavg", "sgpt", ["acc_global"], suite="x")
