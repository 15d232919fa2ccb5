"""No module imports a layer above its own (imports inside functions count too)."""

import ast
import re
from functools import cache
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import fpbench

# Each top-level module or package of fpbench, lowest first; a unit imports only lower ones.
LAYERS = [
    {"fpbench", "errors", "lazy", "packing", "stages", "shipped", "units"},
    {"registry", "determinism", "store", "specs"},
    {"data", "suites", "tiny"},
    {"partition", "backbones"},
    {"methods", "cache"},
    {"strategies"},
    {"engine"},
    {"measure", "report", "testing", "tune"},
    {"cli"},
    {"__main__"},
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "fpbench"


def _imports(path: Path, package: str | None = None) -> set[str]:
    """The fpbench modules `path` imports: `import a.b`, `from a.b import c` (and `a.b.c` where
    `c` is a module: `from fpbench.engine import cost`), relative imports resolved from
    `package` (default: the file's own)."""
    package = _package_of(path) if package is None else package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}"))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "fpbench" or m.startswith("fpbench.")}


def _package_of(path: Path) -> str:
    """The package a file's relative imports start from ("" outside fpbench)."""
    root = Path(fpbench.__file__).parent
    if not path.is_relative_to(root):
        return ""
    return ".".join(path.parent.relative_to(root.parent).parts)


def _is_module(name: str) -> bool:
    base = Path(fpbench.__file__).parent.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_no_module_imports_a_layer_above_its_own():
    root = Path(fpbench.__file__).parent
    upward = []
    for path, imports in _fpbench_imports().items():
        parts = path.relative_to(root).with_suffix("").parts
        unit = "fpbench" if parts == ("__init__",) else parts[0]
        assert unit in RANK, f"{unit} is in no layer: add it to LAYERS in {__file__}"
        for module in sorted(imports):
            target = _unit(module)
            if target != unit and RANK[target] >= RANK[unit]:
                upward.append(f"{path.relative_to(root)} imports {module}")
    assert upward == []


@cache
def _fpbench_imports() -> dict[Path, frozenset[str]]:
    """`_imports` of every fpbench file, parsed once for the three checks below (~0.7 s)."""
    root = Path(fpbench.__file__).parent
    return {path: frozenset(_imports(path)) for path in sorted(root.rglob("*.py"))}


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_two_modules_import_each_other():
    """Each pair of modules depends one way (imports inside functions count too); a package's
    `__init__` and its own modules are one unit."""
    root = Path(fpbench.__file__).parent
    graph = {_module_name(root, p): set(found) for p, found in _fpbench_imports().items()}
    pairs = sorted(
        f"{a} <-> {b}" for a, deps in graph.items() for b in deps
        if a < b and a in graph.get(b, set()) and not b.startswith(a + ".")
    )  # fmt: skip
    assert pairs == []


def test_no_import_cycles():
    """No longer cycle either (a -> b -> c -> a), edges between a package and its own modules
    aside."""
    root = Path(fpbench.__file__).parent
    graph = {_module_name(root, p): set(found) for p, found in _fpbench_imports().items()}
    deps = {
        a: {b for b in bs if b in graph and not (a + ".").startswith(b + ".")
            and not b.startswith(a + ".")}
        for a, bs in graph.items()
    }  # fmt: skip
    try:
        TopologicalSorter(deps).prepare()
    except CycleError as e:
        raise AssertionError(f"import cycle: {' -> '.join(e.args[1])}") from None


def test_imports_inside_functions_are_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from fpbench.engine.rounds import Observer\n")
    assert _imports(module) == {"fpbench.engine.rounds"}


def test_modules_imported_by_name_and_relative_imports_are_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "from fpbench.engine import cost, not_a_module\nfrom . import rounds\n"
        "from ..store import repo\nfrom .runner import run_cell\n"
    )
    found = _imports(module, package="fpbench.engine")
    assert found == {
        "fpbench.engine",
        "fpbench.engine.cost",
        "fpbench.engine.rounds",
        "fpbench.store",
        "fpbench.store.repo",
        "fpbench.engine.runner",
    }


def test_architecture_page_lists_these_layers_and_existing_modules():
    """docs/architecture.md's table of layers is LAYERS, and every module it names exists."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", page, flags=re.M)
    table = [{n.rstrip("/") for n in re.findall(r"`([^`]+)`", names)} for _, names in rows]
    assert table == [units - {"fpbench", "__main__"} for units in LAYERS][: len(table)]
    assert [set(u) - {"fpbench", "__main__"} for u in LAYERS][len(table) :] == [set()]
    root = Path(fpbench.__file__).parent
    named = set(re.findall(r"`((?:engine|measure)/\w+\.py)`", page))
    assert named and {n for n in named if not (root / n).is_file()} == set()
