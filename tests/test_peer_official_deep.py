"""fpbench's MaPLe, PromptSRC and PLOT against their official code, by execution.

The official checkouts run unmodified by path (tests/peer/official_deep.py says how to get
them and what is stubbed); without them every test here skips with a line saying so. The
initial contexts are bit-identical (the phrase's embeddings; PLOT's N(0, 0.02^2) draw from the
same seed); logits, PromptSRC's whole loss (cross-entropy plus the self-regulating terms, from
its trainer's own `forward_backward`) and every trained tensor's gradient agree to fp32 rounding
(1e-5, relative to the gradient's scale). MaPLe and PromptSRC also run at the suites' depth
(the methods' default 9) on a test CLIP of 10 blocks per tower (slow).
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

OFFICIAL = load_script("official_deep")
FAST = {"plot 5 iterations"}  # one case in the default run; the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(OFFICIAL, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, _ = OFFICIAL.CASES[name]
    d = run_case(OFFICIAL, name, tmp_path)
    assert d["init"] == 0
    assert d.get("eot", 0) == 0  # MaPLe: the same pooled token
    assert d["logits"] < 1e-5
    if kind == "promptsrc":
        assert d["loss"] < 1e-5 and d["zs_text"] < 1e-6
    grads = [k for k in d if k.startswith("grad ")]
    assert grads
    for key in grads:
        assert d[key] < 1e-5 * max(1.0, d["grad_max"]), key


def test_a_missing_checkout_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(OFFICIAL.REPOS, "plot", (tmp_path / "PLOT", "CHENGY12/PLOT", "VAR"))
    assert OFFICIAL.why_not("plot") == (
        f"official checkout not found at {tmp_path / 'PLOT'}: git clone "
        f"https://github.com/CHENGY12/PLOT {tmp_path / 'PLOT'} (or set VAR)"
    )
