"""No module imports a layer above its own (imports inside functions count too)."""

import ast
from pathlib import Path

import fpbench

# Each top-level module or package of fpbench, lowest first; a unit imports only lower ones.
LAYERS = [
    {"fpbench", "errors", "lazy", "stages", "shipped", "units"},
    {"registry", "determinism", "store", "specs"},
    {"data", "suites"},
    {"partition", "backbones"},
    {"methods", "cache"},
    {"engine"},
    {"measure", "report", "testing"},
    {"cli"},
    {"__main__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fpbench"


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "fpbench" or m.startswith("fpbench.")}


def test_no_module_imports_a_layer_above_its_own():
    root = Path(fpbench.__file__).parent
    upward = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        unit = "fpbench" if parts == ("__init__",) else parts[0]
        assert unit in RANK, f"{unit} is in no layer: add it to LAYERS in {__file__}"
        for module in _imports(path):
            target = _unit(module)
            if target != unit and RANK[target] >= RANK[unit]:
                upward.append(f"{path.relative_to(root)} imports {module}")
    assert upward == []


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other():
    """Each pair of modules depends one way (imports inside functions count too); a package's
    `__init__` and its own modules are one unit."""
    root = Path(fpbench.__file__).parent
    graph = {_module_name(root, p): _imports(p) for p in root.rglob("*.py")}
    pairs = sorted(
        f"{a} <-> {b}" for a, deps in graph.items() for b in deps
        if a < b and a in graph.get(b, set()) and not b.startswith(a + ".")
    )  # fmt: skip
    assert pairs == []


def test_imports_inside_functions_are_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from fpbench.engine.rounds import Observer\n")
    assert _imports(module) == {"fpbench.engine.rounds"}
