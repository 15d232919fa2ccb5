"""fpbench.tiny: the tiny federation that the conformance kit and `fpbench bench` share."""

from __future__ import annotations

import copy
import subprocess
import sys

from fpbench.tiny import TINY, tiny_backbone, tiny_suite


def test_tiny_suite_of_a_clip_method_has_its_backbone_offline_args_and_overrides():
    before = copy.deepcopy(TINY)
    raw = tiny_suite("maple", rounds=1, eval_last=0)
    assert raw["methods"] == [{"name": "maple", "prompt_depth": 2}]
    assert raw["defaults"]["backbone"] == {"name": "clip-test"}
    assert raw["defaults"]["train"] == {
        "rounds": 1,
        "participation": 0.75,
        "batch_size": 8,
        "lr": 0.05,
        "eval_batch_size": 64,
        "eval_last": 0,
    }
    assert raw["partitions"] == [{"name": "dirichlet", "alpha": 0.5, "min_size": 4}]
    raw["defaults"]["runtime"] = {"device": "cpu"}
    assert before == TINY  # the shared settings are never written through a suite made of them


def test_tiny_backbone_is_the_test_sized_one_of_the_family():
    assert (tiny_backbone("fedvpt"), tiny_backbone("promptfl")) == ("vit-test", "clip-test")
    assert tiny_suite("fedvpt")["methods"] == [{"name": "fedvpt"}]


def test_tiny_imports_neither_torch_nor_pytest():
    code = "import sys, fpbench.tiny; print('torch' in sys.modules, 'pytest' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
