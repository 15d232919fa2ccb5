"""fpbench's PLOT on a ViT against FLiP's port of it (0-ml/flip ec3a848,
`flcore/models/clip/PLOT.py`), by execution (tests/peer/flip_plot.py: the checkout's
modules imported unmodified by path). Without the checkout every case skips with a line saying
how to get it. The initial contexts are bit-identical (the same N(0, 0.02^2) draw), logits agree
to 1e-5 and the contexts' gradient to 1e-5 relative to its scale; the official PLOT's RN path is
in tests/test_peer_official_deep.py.
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("flip_plot")
FAST = {"flip plot vit 5 iterations"}  # the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_flips_port_computes(name, tmp_path):
    d = run_case(HARNESS, name, tmp_path)
    assert d["init"] == 0 and d["logits"] < 1e-5, d
    assert d["grad ctx"] < 1e-5 * max(1.0, d["grad_max"]) and d["grad_max"] > 0, d


def test_a_missing_checkout_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(HARNESS, "FLIP", tmp_path / "flip")
    assert HARNESS.why_not("plot") == (
        f"official checkout not found at {tmp_path / 'flip'}: git clone "
        f"https://github.com/0-ml/flip {tmp_path / 'flip'} (or set FPBENCH_PEER_FLIP)"
    )
