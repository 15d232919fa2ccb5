import numpy as np
import pytest

from fpbench.engine.metrics import EvalCounts, aggregates, client_rows, summary


def counts(**kw):
    base = dict(
        correct_local=np.array([8, 5, 0, 3]),
        total_local=np.array([10, 10, 0, 4]),
        heldout=np.array([False, False, False, True]),
        global_acc=np.array([0.6]),
        global_total=50,
    )
    return EvalCounts(**{**base, **kw})


def test_aggregates_hand_checked():
    agg = aggregates(counts())
    # participating clients with a test set: 0 (0.8) and 1 (0.5); client 2 has none
    assert agg["acc_local_mean"] == pytest.approx(0.65)
    assert agg["acc_local_worst"] == pytest.approx(0.5)
    assert agg["acc_pooled"] == pytest.approx(13 / 20)
    assert agg["acc_global"] == pytest.approx(0.6)
    # numpy linear percentile between 0.5 and 0.8
    assert agg["acc_local_p10"] == pytest.approx(0.5 + 0.1 * 0.3)
    assert agg["acc_heldout_mean"] == pytest.approx(0.75)
    assert agg["acc_heldout_worst"] == pytest.approx(0.75)


def test_percentiles_order_and_bounds():
    rng = np.random.default_rng(0)
    total = rng.integers(5, 50, size=40)
    correct = rng.integers(0, total + 1)
    agg = aggregates(
        counts(correct_local=correct, total_local=total, heldout=np.zeros(40, dtype=bool))
    )
    assert agg["acc_local_worst"] <= agg["acc_local_p05"] <= agg["acc_local_p10"]
    assert agg["acc_local_p10"] <= agg["acc_local_p15"] <= agg["acc_local_mean"] + 1e-12


def test_personal_methods_have_no_heldout_and_per_client_global():
    ev = counts(global_acc=np.array([0.7, 0.5, 0.4, np.nan]), heldout_applicable=False)
    agg = aggregates(ev)
    assert "acc_heldout_mean" not in agg
    assert agg["acc_global"] == pytest.approx((0.7 + 0.5 + 0.4) / 3)
    rows = client_rows(ev)
    assert (3, "acc_heldout", 0.75, 4) not in rows
    assert [r for r in rows if r[1] == "acc_global"] == [
        (0, "acc_global", 0.7, 50),
        (1, "acc_global", 0.5, 50),
        (2, "acc_global", 0.4, 50),
    ]


def test_client_rows_names_and_counts():
    rows = client_rows(counts())
    assert rows == [
        (0, "acc_local", 0.8, 10),
        (1, "acc_local", 0.5, 10),
        (3, "acc_heldout", 0.75, 4),
    ]


def test_summary_is_mean_of_last_window():
    history = [{"acc_global": v} for v in (0.1, 0.2, 0.3, 0.5)]
    assert summary(history, 2) == {"acc_global_last2": pytest.approx(0.4)}
    assert summary(history, 10) == {"acc_global_last10": pytest.approx(0.275)}
