"""Edge cases of the metric functions, each pinning what a surviving mutant changed (see
docs/mutation-equivalent.md for the mutants left alive and why)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from fpbench.engine.metrics import EvalCounts, aggregates, client_rows, domain_accuracies, macro_f1


def _counts(**kw) -> EvalCounts:
    base = dict(
        correct_local=np.array([1, 3, 2, 0]),
        total_local=np.array([1, 4, 4, 2]),
        heldout=np.array([False, False, False, True]),
        global_acc=np.array([0.5]),
        global_total=10,
    )
    return EvalCounts(**{**base, **kw})


def test_a_client_with_a_single_test_sample_counts():
    """Client 0 has one local test sample (right): it is in every local metric."""
    agg = aggregates(_counts())
    assert agg["acc_local_mean"] == pytest.approx((1 + 0.75 + 0.5) / 3)
    assert agg["acc_local_worst"] == pytest.approx(0.5)
    assert agg["acc_pooled"] == pytest.approx(6 / 9)
    dom = domain_accuracies(_counts(), [0, 0, 1, 1], ["a", "b"])
    assert dom == pytest.approx({"acc_domain_a": (1 + 0.75) / 2, "acc_domain_b": 0.5})
    assert client_rows(_counts())[0] == (0, "acc_local", 1.0, 1)


def test_two_personal_models_each_get_a_global_row():
    ev = EvalCounts(
        correct_local=np.array([1, 2]),
        total_local=np.array([2, 2]),
        heldout=np.array([False, False]),
        global_acc=np.array([0.25, 0.75]),
        global_total=8,
    )
    rows = [r for r in client_rows(ev) if r[1] == "acc_global"]
    assert rows == [(0, "acc_global", 0.25, 8), (1, "acc_global", 0.75, 8)]
    assert aggregates(ev)["acc_global"] == pytest.approx(0.5)


def test_f1_is_averaged_over_the_trained_participants_like_acc_global():
    """Per-client F1 of clients 0, 1 count; client 2 is excluded as never trained, client 3 is
    held out (a model-heterogeneous run gives it its population's value), client 4 has none."""
    ev = EvalCounts(
        correct_local=np.array([1, 1, 1, 1, 1]),
        total_local=np.array([2, 2, 2, 2, 2]),
        heldout=np.array([False, False, False, True, False]),
        global_acc=np.array([0.4, 0.6, 0.9, 0.8, np.nan]),
        global_total=10,
        f1_global=np.array([0.2, 0.4, 0.9, 0.8, np.nan]),
        untrained=np.array([False, False, True, False, False]),
    )
    agg = aggregates(ev)
    assert agg["acc_global"] == pytest.approx(0.5)
    assert agg["f1_macro_global"] == pytest.approx(0.3)
    one = aggregates(_counts(f1_global=np.array([0.35])))
    assert one["f1_macro_global"] == pytest.approx(0.35)
    assert "f1_macro_global" not in aggregates(_counts(f1_global=np.array([np.nan])))


def test_macro_f1_by_hand_with_absent_classes():
    """5 classes; class 4 only predicted, class 3 absent from both, class 2 true once.

    class 0: tp 2 of 2 predicted, 3 true -> 4/5; class 1: tp 1, 2 predicted, 1 true -> 2/3;
    class 2: tp 0, 0 predicted, 1 true -> 0; class 4: tp 0, 1 predicted -> 0.
    """
    pred = np.array([0, 0, 1, 1, 4])
    labels = np.array([0, 0, 1, 2, 0])
    assert macro_f1(pred, labels, 5) == pytest.approx((4 / 5 + 2 / 3 + 0 + 0) / 4)
    # integer-valued arrays of another dtype (a float tensor's numpy view) give the same
    assert macro_f1(pred.astype(float), labels.astype(float), 5) == pytest.approx(
        (4 / 5 + 2 / 3) / 4
    )
    assert macro_f1(np.array([1]), np.array([1]), 3) == 1.0


def test_macro_f1_of_nothing_is_nan_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(macro_f1(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 3))
