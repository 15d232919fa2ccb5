"""fpbench against the official code of CoOp (PromptFL's prompt learner), FedOTP, SGPT and
FedPR's optimiser, by execution.

The official checkouts are run unmodified by path (tests/peer/official.py says how to get
them); without them every test here skips with a line saying so. The initial contexts are
bit-identical (CoOp's N(0, 0.02^2) draw from the same seed, or an init phrase's embeddings);
logits and gradients agree to
fp32 rounding (1e-5, relative to the gradient's scale), FedOTP's transport plans to fp64
rounding (1e-12) where both sides run the same iterations, and to 1e-6 under the suites' stopping
threshold, where fpbench stops each (image, class) problem on its own and the official code when
the batch's mean converges (a declared deviation). SGPT: both phases of a round (shared
prompts without selection; group prompts and keys with Select weighted by the accumulated counts)
and test time, the selected groups identical.
"""

from __future__ import annotations

import pytest

from tests.peer import case_params, load_script, run_case

OFFICIAL = load_script("official")
# one case of each in the default run; the rest: pytest -m slow
FAST = {"coop end", "fedotp vit cot eps 0.1", "sgpt both phases, counts 5 1 0 3",
        "fedpr adam-svd, eps 0"}  # fmt: skip


@pytest.mark.parametrize("name", case_params(OFFICIAL, FAST))
def test_fpbench_computes_what_the_official_code_computes(name, tmp_path):
    kind, args = OFFICIAL.CASES[name]
    d = run_case(OFFICIAL, name, tmp_path)
    if kind == "fedpr":  # the projector, and the prompts after the projected Adam steps
        assert d["projector"] < 1e-6
        if args.get("eps", 1e-8) == 0:
            assert d["prompts"] < 1e-5 * max(1.0, d["step_max"])
        else:  # torch's eps placement against AdamSVD's (declared): well below the steps
            assert d["prompts"] < 1e-3 * d["step_max"]
        return
    if kind == "sgpt":  # both phases and test time: logits, every trained tensor's gradient
        for key, value in d.items():
            if "logits" in key:
                assert value < 1e-5, key
            elif " grad " in key:
                assert value < 1e-5 * max(1.0, d["grad_max"]), key
        assert d["select train"] == d["select test"] == 0  # the same group for every sample
        assert d["groups_test"] >= 2  # the batch spreads over the groups
        return
    if kind == "coop":
        assert d["eot"] == 0 and d["init"] == 0  # same pooled token, bit-identical init
        assert d["logits"] < 1e-5
        assert d["grad"] < 1e-5 * max(1.0, d["grad_max"])
        return
    assert d["init"] == 0  # both prompts: the official N(0, 0.02^2) draw from the same seed
    stop = args.get("thresh", 0.0) > 0
    assert d["plan"] < (1e-6 if stop else 1e-12) * max(1.0, d["plan_max"])
    if args.get("forward", True):
        assert d["logits"] < 1e-5
        for g in ("grad_global", "grad_local"):
            assert d[g] < 1e-5 * max(1.0, d["grad_max"])
    else:  # eps = 0.01 in fp32: the official kernel underflows; fpbench's fp64 plan does not
        assert d["official_none"] == 1.0


def test_a_missing_checkout_is_one_line_saying_how_to_get_it(tmp_path):
    line = OFFICIAL.missing(tmp_path / "CoOp", "KaiyangZhou/CoOp", "FPBENCH_PEER_COOP")
    assert line == (
        f"official checkout not found at {tmp_path / 'CoOp'}: git clone "
        f"https://github.com/KaiyangZhou/CoOp {tmp_path / 'CoOp'} (or set FPBENCH_PEER_COOP)"
    )
    (tmp_path / "CoOp" / "trainers").mkdir(parents=True)
    (tmp_path / "CoOp" / "clip").mkdir()
    assert OFFICIAL.missing(tmp_path / "CoOp", "KaiyangZhou/CoOp", "FPBENCH_PEER_COOP") is None
