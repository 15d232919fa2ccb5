"""fpbench's federated CLIP prompt methods (#34) against their official code, by execution
(tests/peer/official_clip_fl.py: unmodified checkouts by path, same weights, prompts and
images). Without a checkout a case skips with one line saying how to get it.

FedPGP (TianyuCuiOvO/FedPGP d43045b): the official CustomCLIP and trainer step; logits, loss
and the gradients of U, V and Sigma to fp32 rounding (1e-5 relative to the gradient scale), the
initial U, V, Sigma to 1e-8 (the same N(0, 0.02^2) draws; torch's normal_ against randn * 0.02).
FedCLIP (microsoft/PersonalizedFL 441670e): the official adapter init bit-identical, the
gradients of its train step's contrastive loss, the same test accuracy. PromptFolio
(PanBikang/PromptFolio 8f729aa): the official CustomCLIP (two prompts mixed by theta); initial
prompts bit-identical, logits and both prompts' cross-entropy gradients to fp32 rounding.
FedTPG (boschresearch/FedTPG f141c29): the official prompt generator and CLIP encoders, the
generator's init bit-identical (after the official fp16 cast), logits over every class, and a
client's loss over its own classes with every generator gradient, to fp32 rounding. DP-FPL
(linhhtran/DP-FPL cce74b4): the official CustomCLIP and trainer step (factorisation "dpfpl") from
the same random start, without privacy and with clipping (zero noise): logits, the global
gradient and the local prompt's full gradient to fp32 rounding.
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("official_clip_fl")
FAST = {
    "fedpgp vit r2",
    "fedclip vit",
    "promptfolio vit",
    "fedtpg vit, client of classes 0 2",
    "dp-fpl vit, clipped to 0.05",
}  # the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, _ = HARNESS.CASES[name]
    d = run_case(HARNESS, name, tmp_path)
    scale = max(1.0, d["grad_max"])
    if kind == "fedtpg":  # every generator tensor's gradient in one number, the client case
        assert d["init"] == 0 and d["logits"] < 1e-5 and d["loss_client"] < 1e-5, d
        assert d["grad"] < 1e-5 * scale and d["grad_max"] > 0, d
        return
    grads = [k for k in d if k.startswith("grad_") and k != "grad_max"]
    assert len(grads) == {"fedpgp": 3, "fedclip": 4, "promptfolio": 2, "dpfpl": 2}[kind]
    for k in grads:
        assert d[k] < 1e-5 * scale, (k, d)
    if kind == "fedpgp":
        assert d["init"] < 1e-8 and d["logits"] < 1e-5 and d["loss"] < 1e-5, d
    elif kind in ("promptfolio", "dpfpl"):
        assert d["init"] < 1e-8 and d["logits"] < 1e-5, d
    else:
        assert d["init"] == 0 and d["acc"] == 0, d


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(HARNESS, "FEDCLIP", tmp_path / "PersonalizedFL")
    monkeypatch.setattr(HARNESS, "FEDPGP", tmp_path / "FedPGP")
    monkeypatch.setattr(HARNESS, "PROMPTFOLIO", tmp_path / "PromptFolio")
    monkeypatch.setattr(HARNESS, "FEDTPG", tmp_path / "FedTPG")
    monkeypatch.setattr(HARNESS, "DPFPL", tmp_path / "DP-FPL")
    assert "git clone https://github.com/linhhtran/DP-FPL" in HARNESS.why_not("dpfpl")
    line = HARNESS.why_not("fedtpg")
    assert "einops" in line or "git clone https://github.com/boschresearch/FedTPG" in line
    assert "git clone https://github.com/PanBikang/PromptFolio" in HARNESS.why_not("promptfolio")
    assert HARNESS.why_not("fedclip") == (
        f"official checkout not found at {tmp_path / 'PersonalizedFL'}: git clone "
        f"https://github.com/microsoft/PersonalizedFL {tmp_path / 'PersonalizedFL'} "
        "(or set FPBENCH_PEER_FEDCLIP)"
    )
    assert HARNESS.why_not("fedpgp").startswith(
        f"official checkout not found at {tmp_path / 'FedPGP'}: git clone "
        "https://github.com/TianyuCuiOvO/FedPGP"
    )
