"""One small generic registry for datasets, partitions, backbones and methods (timm-style)."""

from __future__ import annotations

import difflib
import fnmatch
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from fpbench.errors import FpbenchError

T = TypeVar("T")

# Modules whose import registers the built-in components (timm's models/__init__.py pattern).
PLUGINS = ("fpbench.data", "fpbench.partition", "fpbench.backbones", "fpbench.methods")


def load_plugins() -> None:
    for module in PLUGINS:
        importlib.import_module(module)


class UnknownNameError(FpbenchError):
    """Raised for a name that is not registered; the message lists the valid names."""


class Registry(Generic[T]):
    """Maps names to objects; names are unique, lookups of unknown names list the valid ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
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

    def get(self, name: str) -> T:
        load_plugins()
        prefix, colon, rest = name.partition(":")
        if name not in self._items and colon and prefix in self._resolvers:
            return self._resolvers[prefix](rest)
        if name not in self._items:
            close = difflib.get_close_matches(name, list(self._items), n=3)
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
