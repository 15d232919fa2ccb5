"""fpbench's `pfedmoap` against the official pFedMoAP code (ljaiverson/pFedMoAP a481de3), by
execution (scripts/peer/official_pfedmoap.py: the unmodified checkout by path, same weights,
context, gate, expert contexts and images): logits, and the cross-entropy gradients of the
context and of every gate tensor, to fp32 rounding (1e-5 relative to the gradient scale), with
experts and without. Without a checkout a case skips with one line saying how to get it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def _harness():
    path = ROOT / "scripts/peer/official_pfedmoap.py"
    spec = importlib.util.spec_from_file_location("official_pfedmoap", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HARNESS = _harness()
FAST = {"pfedmoap vit, 2 experts"}  # the rest: pytest -m slow
CASES = [
    pytest.param(name, marks=() if name in FAST else pytest.mark.slow, id=name.replace(" ", "-"))
    for name in HARNESS.CASES
]


@pytest.mark.parametrize("name", CASES)
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, args = HARNESS.CASES[name]
    if line := HARNESS.why_not(kind):
        pytest.skip(line)
    d = HARNESS.run(name, tmp_path)
    scale = max(1.0, d["grad_max"])
    assert d["logits"] < 1e-5 and d["grad_ctx"] < 1e-5 * scale, d
    assert d["grad_gate"] < 1e-5 * scale, d
    assert d["grad_max"] > 0, d


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "PFEDMOAP", tmp_path / "pFedMoAP")
    assert HARNESS.why_not("pfedmoap") == (
        f"official checkout not found at {tmp_path / 'pFedMoAP'}: git clone "
        f"https://github.com/ljaiverson/pFedMoAP {tmp_path / 'pFedMoAP'} "
        "(or set FPBENCH_PEER_PFEDMOAP)"
    )
