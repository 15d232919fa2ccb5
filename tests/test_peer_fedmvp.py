"""fpbench's FedMVP against its official code, by execution (tests/peer/official_fedmvp.py:
the checkout mainaksingha01/FedMVP 246800e by path, same CLIP weights, prompt-net tensors,
class names, attribute descriptions and images). Without the checkout a case skips with one line
saying how to get it.

Logits, the client's loss (cross-entropy plus alpha times the flip-consistency term, each flip
outcome fixed; fpbench's "expected" against the mean of the two) and the gradients of all 16
prompt-net tensors, to fp32 rounding (1e-5 relative to the gradient scale); after the switch to
LoRA, those of the text map and the LoRA factors.
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("official_fedmvp")
FAST = {"fedmvp flowers102 (suffix), expected flip"}  # the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    d = run_case(HARNESS, name, tmp_path)
    scale = max(1.0, d["grad_max"])
    assert d["logits"] < 1e-5 and d["loss"] < 1e-5 and d["grad_max"] > 0, d
    assert d["grad"] < 1e-5 * scale, d


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "FEDMVP", tmp_path / "FedMVP")
    assert HARNESS.why_not("fedmvp") == (
        f"official checkout not found at {tmp_path / 'FedMVP'}: git clone "
        f"https://github.com/mainaksingha01/FedMVP {tmp_path / 'FedMVP'} "
        "(or set FPBENCH_PEER_FEDMVP)"
    )
