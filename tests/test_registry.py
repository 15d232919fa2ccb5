import subprocess
import sys

import pytest

from fpbench.errors import FpbenchError
from fpbench.registry import BACKBONES, DATASETS, METHODS, PARTITIONS, Registry


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


def test_loading_suites_imports_neither_timm_nor_open_clip():
    """Registering the backbones and validating suites (ViT and CLIP ones) leaves the model
    libraries unimported; building a backbone imports them."""
    code = (
        "import sys; from fpbench.suites import load_suite; "
        "[load_suite(s) for s in ('sgpt-table1', 'smoke-clip')]; "
        "print(sorted(m for m in ('timm', 'open_clip') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
