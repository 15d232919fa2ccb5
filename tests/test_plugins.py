"""Components from other installed packages: entry points register them, with their source."""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint

import pytest

from fpbench.registry import PluginError, Registry


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Write importable modules {name: source} into a folder on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(**sources: str) -> None:
        for name, source in sources.items():
            (tmp_path / f"{name}.py").write_text(source)
            monkeypatch.delitem(sys.modules, name, raising=False)

    yield write
    for name in [m for m in sys.modules if m.startswith("plug_")]:
        del sys.modules[name]


def _ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name, value, "fpbench.methods")


def test_an_object_is_registered_under_the_entry_point_name(modules):
    modules(plug_obj="class Thing:\n    pass\n")
    registry: Registry = Registry("method")
    registry.load_entry_point(_ep("thing", "plug_obj:Thing"))
    assert registry.get("thing").__name__ == "Thing"
    assert registry.source("thing") == "plug_obj"  # no distribution: the module
    registry.register("builtin")(object)
    assert registry.source("builtin") == "fpbench"


def test_a_module_registers_through_its_decorators(modules):
    registry: Registry = Registry("method")
    modules(
        plug_mod="import builtins\nreg = builtins._plug_registry\n"
        "@reg.register('a')\nclass A: ...\n@reg.register('b')\nclass B: ...\n"
    )
    import builtins

    builtins._plug_registry = registry  # type: ignore[attr-defined]
    try:
        registry.load_entry_point(_ep("a", "plug_mod"))
    finally:
        del builtins._plug_registry  # type: ignore[attr-defined]
    assert registry.names() == ["a", "b"]
    assert {registry.source("a"), registry.source("b")} == {"plug_mod"}


def test_a_plugin_that_fails_to_import_is_named(modules):
    modules(plug_bad="import not_a_module_anywhere\n")
    registry: Registry = Registry("method")
    with pytest.raises(PluginError) as e:
        registry.load_entry_point(_ep("bad", "plug_bad:Bad"))
    msg = str(e.value)
    assert "method plugin 'bad' (plug_bad:Bad)" in msg
    assert "ModuleNotFoundError" in msg and "not_a_module_anywhere" in msg


def test_a_plugin_cannot_take_a_registered_name(modules):
    modules(plug_dup="class Other:\n    pass\n")
    registry: Registry = Registry("method")
    registry.register("fedvpt")(object)
    with pytest.raises(PluginError, match="'fedvpt' is registered twice"):
        registry.load_entry_point(_ep("fedvpt", "plug_dup:Other"))
    assert registry.get("fedvpt") is object


def test_a_module_that_registers_another_name_is_refused(modules):
    modules(plug_none="X = 1\n")
    registry: Registry = Registry("method")
    with pytest.raises(PluginError, match="registered no method named 'x'"):
        registry.load_entry_point(_ep("x", "plug_none"))
