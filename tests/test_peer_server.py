"""fpbench's server steps against each official code's own, by execution
(tests/peer/official_server.py: the official aggregation functions and methods read from the
unmodified checkouts by path, on clients of unequal train sizes). Without a checkout a case
skips with one line saying how to get it.

Each case's new global state agrees to fp32 rounding (1e-6 on N(0, 1) tensors), and `spread`
(the official result against the other weighting: uniform where the official weighs by size,
by size where it averages uniformly) shows that the case tells the two apart. PromptFolio's
official `fed_aggregate_model` pairs the sizes with the wrong clients unless the round's clients
come in id order (its shuffled case is the finding, asserted as such).
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

HARNESS = load_script("official_server")
FAST = {
    "fedotp, 3 of 4 clients",
    "fedpgp, 3 of 4 clients",
    "fedpha, 3 of 4 clients",
    "promptfolio, every client in order",
    "promptfolio, every client shuffled",
    "pfedmoap, 2 rounds, 4 experts",
    "fedclip, every client",
    "dp-fpl, clipped, noise scale",
    "sgpt, 3 of 4 clients",
    "sgpt, 3 of 4 clients, no momentum",
    "promptsrc GPA, 6 rounds",
}  # the rest: pytest -m slow


@pytest.mark.parametrize("name", case_params(HARNESS, FAST))
def test_the_server_step_is_the_official_one(name, tmp_path):
    kind, args = HARNESS.CASES[name]
    d = run_case(HARNESS, name, tmp_path)
    if kind == "promptfolio" and "order" in args:  # the official pairs sizes with other clients
        assert d["global"] > 0.1 and d["spread"] > 0.1, d
        return
    if kind == "promptsrc":  # the Gaussian-weighted mean of the rounds' prompts
        assert d["gpa"] < 1e-6 and d["spread"] > 0.1, d
        return
    if kind == "sgpt":
        for part in ("head", "shared", "group", "keys"):
            assert d[part] < 1e-6, (part, d)
        assert d["spread"] > 0.1, d
        return
    assert d["global"] < 1e-6 and d.get("kept", 0.0) == 0.0, d
    if kind == "dpfpl":  # one SGD step of 0.1 on gradients clipped to 0.05: a small spread
        assert d["spread"] > 1e-5, d
        assert d["std_rel"] < 1e-12, d  # the same std, analytically
        assert d["draw_rel"] < 4 * d["draw_sigma"], d  # and drawn (a 4-sigma band)
        return
    assert d["spread"] > 0.1, d
    if kind == "pfedmoap":
        assert d["experts"] == 0 and d["experts_n"] == 6 and d["fails"] == 1, d


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(monkeypatch, tmp_path):
    for kind, (_, repo, var, file) in list(HARNESS.REPOS.items()):
        name = "PersonalizedFL" if kind == "fedclip" else kind
        monkeypatch.setitem(HARNESS.REPOS, kind, (tmp_path / name, repo, var, file))
    assert HARNESS.why_not("fedclip") == (
        f"official checkout not found at {tmp_path / 'PersonalizedFL'}: git clone "
        f"https://github.com/microsoft/PersonalizedFL {tmp_path / 'PersonalizedFL'} "
        "(or set FPBENCH_PEER_FEDCLIP)"
    )
    for kind, (_, repo, var, _) in HARNESS.REPOS.items():
        line = HARNESS.why_not(kind)
        assert f"https://github.com/{repo} " in line and var in line, line
