import json
import subprocess
import sys

import pytest

from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, Registry
from fpbench.suites import list_suites


def test_register_get_and_list():
    reg = Registry("thing")

    @reg.register()
    class Alpha:
        name = "alpha"

    @reg.register("beta-two")
    def beta():
        return 2

    assert reg.get("alpha") is Alpha
    assert reg.get("beta-two") is beta
    assert reg.names() == ["alpha", "beta-two"]
    assert reg.names("b*") == ["beta-two"]
    assert "alpha" in reg


def test_duplicates_raise():
    reg = Registry("thing")
    reg.register("x")(object())
    with pytest.raises(ValueError, match="twice"):
        reg.register("x")(object())


def test_unknown_name_lists_valid_and_close_matches():
    reg = Registry("method")
    reg.register("fedvpt")(object())
    reg.register("fedvpt-d")(object())
    with pytest.raises(FpbenchError) as e:
        reg.get("fedvtp")
    msg = str(e.value)
    assert "unknown method 'fedvtp'" in msg and "Did you mean fedvpt" in msg
    assert "Valid: fedvpt, fedvpt-d" in msg


def test_builtin_components_are_registered():
    assert {"head-tune", "fedvpt", "local"} <= set(METHODS.names())
    assert "synthetic" in DATASETS.names()
    assert {"pathological", "dirichlet", "pachinko", "domain", "domain-dirichlet"} <= set(
        PARTITIONS.names()
    )
    assert {"vit-test", "vit-smoke", "vit-b16-in21k"} <= set(BACKBONES.names())


def test_loading_every_suite_imports_no_torch():
    """Registering every built-in component and loading every shipped suite (which validates each
    component's Config) imports none of torch, torchvision, timm, open_clip or scipy; such an
    import fails with the chain of fpbench modules that led to it."""
    code = """
import importlib.util, json, os, sys, traceback
HEAVY = ("torch", "torchvision", "timm", "open_clip", "scipy")
ROOT = os.path.dirname(importlib.util.find_spec("fpbench").origin) + os.sep
class Guard:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            chain = [f"{f.filename[len(ROOT):]}:{f.lineno}" for f in traceback.extract_stack()
                     if f.filename.startswith(ROOT) and not f.filename.endswith("lazy.py")]
            raise ImportError(f"{name} imported through " + " -> ".join(chain))
sys.meta_path.insert(0, Guard())
from fpbench.suites import list_suites, load_suite
from fpbench.registry import METHODS
for name in list_suites():
    load_suite(name)
print(json.dumps([list_suites(), METHODS.names()]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == [list_suites(), METHODS.names()]
