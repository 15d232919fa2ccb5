"""BPL against its official code, by execution (tests/peer/official_bpl.py; checkout used:
saic-fi/Bayesian-Prompt-Learning 8a73fff). Without the checkout its cases skip with one line
saying how to get it. Same weights, context, posterior and Monte Carlo draws: the initial
context bit for bit, the log mean softmax and the loss to 1e-5, every trained tensor's gradient
to 1e-5 relative to their scale."""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("official_bpl")
FAST = {"bpl coopvpt L 3", "bpl cocoopvpt L 3"}


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    d = run_case(HARNESS, name, tmp_path)
    assert d["init"] == 0.0
    assert d["logits"] < 1e-5 and d["loss"] < 1e-5
    scale = max(1.0, d["grad_max"])
    grads = [k for k in d if k.startswith("grad_") and k != "grad_max"]
    assert "grad_ctx" in grads and len(grads) in (3, 13)  # ctx + 2 vectors or 2 MLPs of 3 layers
    for key in grads:
        assert d[key] < 1e-5 * scale, key


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "BPL", tmp_path / "BPL")
    assert HARNESS.why_not("bpl") == (
        f"official checkout not found at {tmp_path / 'BPL'}: git clone "
        f"https://github.com/saic-fi/Bayesian-Prompt-Learning {tmp_path / 'BPL'} "
        "(or set FPBENCH_PEER_BPL)"
    )
