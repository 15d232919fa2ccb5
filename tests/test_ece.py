"""Expected calibration error: the formula on hand-checked cases, and its rows in a round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fpbench.engine.metrics import EvalCounts, aggregates, client_rows, expected_calibration_error


def test_ece_of_a_hand_checked_case():
    # bins of width 1/15: 0.95 and 0.99 share (14/15, 1]; 0.6 is in (8/15, 9/15];
    # 0.3 in (4/15, 5/15]
    conf = np.array([0.95, 0.99, 0.6, 0.3])
    hit = np.array([True, False, True, False])
    # (14/15, 1]: acc 1/2, conf 0.97 -> |0.5 - 0.97| = 0.47, weight 2/4
    # (8/15, 9/15]: acc 1, conf 0.6 -> 0.4, weight 1/4; (4/15, 5/15]: acc 0, conf 0.3 -> 0.3
    expected = 2 / 4 * 0.47 + 1 / 4 * 0.4 + 1 / 4 * 0.3
    assert expected_calibration_error(conf, hit) == pytest.approx(expected)


def test_ece_bins_are_right_closed_and_perfect_calibration_is_zero():
    # 1/15 lies in the first bin (0, 1/15], with 0.05: acc 1/2 vs conf (1/15 + 0.05) / 2
    conf = np.array([1 / 15, 0.05])
    hit = np.array([True, False])
    assert expected_calibration_error(conf, hit) == pytest.approx(abs(0.5 - (1 / 15 + 0.05) / 2))
    # one bin (9/15, 10/15] of conf 0.625 with 5 of 8 right: calibrated
    assert expected_calibration_error(np.full(8, 0.625), np.arange(8) < 5) == pytest.approx(0)
    assert np.isnan(expected_calibration_error(np.array([]), np.array([], dtype=bool)))


def test_ece_from_logits_matches_softmax_confidence():
    from fpbench.engine.evaluate import confidence

    logits = torch.tensor([[2.0, 0.0], [0.0, 0.0], [1.0, 3.0]])
    # softmax maxima: e^2/(e^2+1), 1/2, e^3/(e^1+e^3)
    expected = [np.exp(2) / (np.exp(2) + 1), 0.5, np.exp(3) / (np.exp(1) + np.exp(3))]
    assert confidence(logits).tolist() == pytest.approx(expected)


def test_ece_rows_sit_beside_accuracy():
    counts = EvalCounts(
        correct_local=np.array([1, 2, 1]), total_local=np.array([2, 2, 2]),
        heldout=np.array([False, False, True]), global_acc=np.array([0.5, 0.75, np.nan]),
        global_total=4, ece_local=np.array([0.1, 0.3, 0.2]),
        ece_global=np.array([0.25, 0.15, np.nan]),
    )  # fmt: skip
    rows = client_rows(counts)
    assert (0, "ece_local", 0.1, 2) in rows and (1, "ece_local", 0.3, 2) in rows
    assert (2, "ece_heldout", 0.2, 2) in rows
    assert (0, "ece_global", 0.25, 4) in rows and (1, "ece_global", 0.15, 4) in rows
    agg = aggregates(counts)
    assert agg["ece_local_mean"] == pytest.approx(0.2)
    assert agg["ece_heldout_mean"] == pytest.approx(0.2)
    assert agg["ece_global"] == pytest.approx(0.2)


def test_ece_keeps_the_lowest_and_highest_bins_apart_and_scores_one_sample():
    # 0.05 -> (0, 1/15], 0.1 -> (1/15, 2/15]: two bins, |1 - 0.05| / 2 + |0 - 0.1| / 2
    assert expected_calibration_error(np.array([0.05, 0.1]), np.array([True, False])) == (
        pytest.approx(0.525)
    )
    # 0.9 -> (13/15, 14/15], 0.99 -> (14/15, 1]: two bins, |1 - 0.9| / 2 + |0 - 0.99| / 2
    assert expected_calibration_error(np.array([0.9, 0.99]), np.array([True, False])) == (
        pytest.approx(0.545)
    )
    # a confidence of 0 falls in the first bin, beside 0.05: |1/2 - 0.025|
    assert expected_calibration_error(np.array([0.0, 0.05]), np.array([False, True])) == (
        pytest.approx(0.475)
    )
    assert expected_calibration_error(np.array([0.8]), np.array([True])) == pytest.approx(0.2)
    # float32 confidences (as evaluate hands them) are binned by their float64 value:
    # float32(0.6) = 0.6000000238 -> (9/15, 10/15], apart from 0.59 in (8/15, 9/15]
    # (in float32, 0.6 * 15 rounds to 9.0 and would share 0.59's bin)
    conf32 = np.array([0.6, 0.59], dtype=np.float32)
    assert expected_calibration_error(conf32, np.array([True, False])) == pytest.approx(0.495)


def test_ece_means_count_only_their_own_clients():
    # clients 0, 1 local; 2 held out; 3 left out untrained; 4 with an empty test set (nan)
    counts = EvalCounts(
        correct_local=np.array([1, 2, 1, 1, 0]), total_local=np.array([2, 2, 2, 2, 0]),
        heldout=np.array([False, False, True, False, False]), global_acc=np.array([0.5]),
        global_total=4, untrained=np.array([False, False, False, True, False]),
        ece_local=np.array([0.1, 0.3, 0.5, 0.9, np.nan]),
    )  # fmt: skip
    agg = aggregates(counts)
    assert agg["ece_local_mean"] == pytest.approx(0.2)  # (0.1 + 0.3) / 2
    assert agg["ece_heldout_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("method_name", ["promptfl", "coop-local"])
def test_evaluate_records_ece_of_the_methods_logits(tiny, method_name):
    from fpbench.engine.evaluate import confidence, evaluate
    from fpbench.methods.base import Context

    from .conftest import seeded_server

    _, task, method = tiny(method_name)
    server = seeded_server(method)
    ev = evaluate(method, server, task, 64)
    client = task.trainable_clients()[0]
    params = method.client_params(server, torch.tensor([client]), training=False)
    x = task.data.test_images
    images = method.backbone.preprocess(x)
    rows = torch.zeros(len(x), dtype=torch.long)
    with torch.no_grad():
        logits = method.forward(params, images, rows, Context(training=False))
    hit = (logits.argmax(-1) == task.data.test_labels).numpy()
    conf = confidence(logits).numpy()
    expected = expected_calibration_error(conf, hit)
    assert ev.ece_global[0 if len(ev.ece_global) == 1 else client] == pytest.approx(
        expected, abs=1e-6
    )
    idx = task.test_idx[client].numpy()
    assert ev.ece_local[client] == pytest.approx(
        expected_calibration_error(conf[idx], hit[idx]), abs=1e-6
    )
