"""One small generic registry for datasets, partitions, backbones and methods (timm-style).

The built-in components register when their packages are imported; components of other
installed packages register through entry points (group `fpbench.methods`, `fpbench.datasets`,
`fpbench.partitions`, `fpbench.backbones` or `fpbench.strategies`): `name = "module:object"`
registers the object under `name` (unless importing the module registered it already),
`name = "module"` imports a module whose decorators register its components. Each name keeps
the package it came from.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib
import types
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Generic, TypeVar

from fpbench.errors import FpbenchError

T = TypeVar("T")

# Modules whose import registers the built-in components (timm's models/__init__.py pattern).
PLUGINS = (
    "fpbench.data", "fpbench.partition", "fpbench.backbones", "fpbench.methods",
    "fpbench.strategies",
)  # fmt: skip
BUILTIN = "fpbench"  # the source of the built-in components
_loaded = False


def load_plugins() -> None:
    """Import the built-in components, then every installed package's entry points (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # set first: plugin modules import this registry while they load
    try:
        for module in PLUGINS:
            importlib.import_module(module)
        for group, registry in ENTRY_POINT_GROUPS.items():
            for ep in entry_points(group=group):
                registry.load_entry_point(ep)
    except BaseException:
        _loaded = False
        raise


class UnknownNameError(FpbenchError):
    """Raised for a name that is not registered; the message lists the valid names."""


class PluginError(FpbenchError):
    """An installed package's entry point failed to load or clashes with a registered name."""


class Registry(Generic[T]):
    """Maps names to objects; names are unique, lookups of unknown names list the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        self._sources: dict[str, str] = {}  # name -> package of a plugin (absent: built in)
        self._resolvers: dict[str, Callable[[str], T]] = {}

    def add_resolver(self, prefix: str, resolve: Callable[[str], T]) -> None:
        """Names `prefix:rest` that are not registered are built by `resolve(rest)`."""
        self._resolvers[prefix] = resolve

    def register(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator: register an object under `name` (default: its `name` attribute)."""

        def deco(obj: T) -> T:
            key = name or getattr(obj, "name", None) or obj.__name__  # type: ignore[attr-defined]
            if key in self._items:
                raise ValueError(f"{self.kind} {key!r} is registered twice")
            self._items[key] = obj
            return obj

        return deco

    def load_entry_point(self, ep: EntryPoint) -> None:
        """Register what an installed package's entry point names (see the module docstring)."""
        package = ep.dist.name if ep.dist is not None else ep.value.partition(":")[0]
        where = f"{self.kind} plugin {ep.name!r} ({ep.value}) of package {package!r}"
        before = set(self._items)
        try:
            obj = ep.load()
            if not isinstance(obj, types.ModuleType) and self._items.get(ep.name) is not obj:
                self.register(ep.name)(obj)  # unless its import registered it
        except Exception as e:  # a third party's import error, whatever its type, or a clash
            raise PluginError(f"{where} failed to load: {type(e).__name__}: {e}") from e
        if ep.name not in self._items:
            raise PluginError(f"{where} registered no {self.kind} named {ep.name!r}")
        for key in set(self._items) - before:
            self._sources[key] = package

    def source(self, name: str) -> str:
        """The package a registered name comes from (`fpbench` for the built-in ones)."""
        load_plugins()
        return self._sources.get(name, BUILTIN)

    def get(self, name: str) -> T:
        load_plugins()
        prefix, colon, rest = name.partition(":")
        if name not in self._items and colon and prefix in self._resolvers:
            return self._resolvers[prefix](rest)
        if name not in self._items:
            close = suggestions(name, list(self._items))
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            more = "".join(f", or {p}:NAME" for p in self._resolvers)
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}.{hint} Valid: {', '.join(self.names())}{more}"
            )
        return self._items[name]

    def names(self, pattern: str = "*") -> list[str]:
        load_plugins()
        return sorted(n for n in self._items if fnmatch.fnmatch(n, pattern))

    def __contains__(self, name: object) -> bool:
        load_plugins()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


DATASETS: Registry = Registry("dataset")
PARTITIONS: Registry = Registry("partition")
BACKBONES: Registry = Registry("backbone")
METHODS: Registry = Registry("method")
STRATEGIES: Registry = Registry("strategy")

ENTRY_POINT_GROUPS: dict[str, Registry] = {
    "fpbench.methods": METHODS,
    "fpbench.datasets": DATASETS,
    "fpbench.partitions": PARTITIONS,
    "fpbench.backbones": BACKBONES,
    "fpbench.strategies": STRATEGIES,
}


def suggestions(name: str, known: list[str], n: int = 3) -> list[str]:
    """Names `name` may have meant: those it begins (a shortened name, `patho` for
    `pathological`) first, then difflib's close matches."""
    low = name.lower()
    prefixed = sorted(k for k in known if low and k.lower().startswith(low))
    close = difflib.get_close_matches(name, known, n=n)
    return list(dict.fromkeys([*prefixed, *close]))[:n]
