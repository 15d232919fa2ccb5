"""fpbench's pFedMoAP and FedPHA against their official code, by execution
(tests/peer/official_clip_fl_2025.py: unmodified checkouts by path, same weights, prompts and
images). Without a checkout a case skips with one line saying how to get it.

pFedMoAP (ljaiverson/pFedMoAP a481de3): logits, and the cross-entropy gradients of the context
and of every gate tensor, with experts and without. FedPHA (CYFang6/FedPHA 1ab33df): the initial
prompts bit-identical, the evaluation logits, the training step's loss and both prompts'
gradients (through the SVD). All to fp32 rounding (1e-5 relative to the gradient scale).
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("official_clip_fl_2025")
FAST = {"pfedmoap vit, 2 experts", "fedpha vit"}  # the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, _ = HARNESS.CASES[name]
    d = run_case(HARNESS, name, tmp_path)
    scale = max(1.0, d["grad_max"])
    assert d["logits"] < 1e-5 and d["grad_max"] > 0, d
    grads = {"pfedmoap": ("grad_ctx", "grad_gate"), "fedpha": ("grad_global", "grad_local")}
    for k in grads[kind]:
        assert d[k] < 1e-5 * scale, (k, d)
    if kind == "fedpha":
        assert d["init"] == 0 and d["loss"] < 1e-5, d


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "PFEDMOAP", tmp_path / "pFedMoAP")
    monkeypatch.setattr(HARNESS, "FEDPHA", tmp_path / "FedPHA")
    assert HARNESS.why_not("pfedmoap") == (
        f"official checkout not found at {tmp_path / 'pFedMoAP'}: git clone "
        f"https://github.com/ljaiverson/pFedMoAP {tmp_path / 'pFedMoAP'} "
        "(or set FPBENCH_PEER_PFEDMOAP)"
    )
    assert HARNESS.why_not("fedpha") == (
        f"official checkout not found at {tmp_path / 'FedPHA'}: git clone "
        f"https://github.com/CYFang6/FedPHA {tmp_path / 'FedPHA'} (or set FPBENCH_PEER_FEDPHA)"
    )
