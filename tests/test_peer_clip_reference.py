"""Zero-shot CLIP, CoCoOp, KgCoOp and ProGrad against their official code, by execution
(tests/peer/clip_reference.py; checkouts used: KaiyangZhou/CoOp ff61507, htyao89/KgCoOp
c43ccc3, BeierZhu/Prompt-align 1b76203). Without a checkout its cases skip with one line saying
how to get it. Logits agree to 1e-5 and gradients to 1e-5 relative to their scale, the initial
contexts bit for bit; CoCoOp's four meta-net tensors each get a non-zero gradient (also from a
seeded random meta-net set on both sides); ProGrad's cases include one where the two
gradients conflict (the projection runs) and one where they do not."""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("clip_reference")
FAST = {
    "zsclip oxford-pets",
    "kgcoop oxford-pets w 8",
    "prograd oxford-pets",
    "cocoop random meta-net N(0, 0.5^2)",
}


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, args = HARNESS.CASES[name]
    d = run_case(HARNESS, name, tmp_path)
    assert d["logits"] < 1e-5
    assert d.get("init", 0.0) == 0.0  # the same initial context, bit for bit
    scale = max(1.0, d.get("grad_max", 1.0))
    for key, value in d.items():
        if key.startswith("grad") and key != "grad_max":
            assert value < 1e-5 * scale, key
    if kind == "kgcoop":
        assert d["score"] < 1e-6
    if kind == "cocoop":  # every meta-net tensor gets a gradient: the comparison is not of zeros
        assert d["meta_grad_min"] > 1e-5, d  # far above the differences (1e-7)
    if kind == "prograd":
        assert d["zero_shot"] < 1e-5
        assert d["conflict"] == (0.0 if "no conflict" in name else 1.0)


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "KGCOOP", tmp_path / "KgCoOp")
    assert HARNESS.why_not("kgcoop") == (
        f"official checkout not found at {tmp_path / 'KgCoOp'}: git clone "
        "https://github.com/htyao89/KgCoOp (or set FPBENCH_PEER_KGCOOP)"
    )
