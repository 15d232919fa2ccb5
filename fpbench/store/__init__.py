"""Results database: SQLAlchemy models behind the small `Store` facade."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpbench.store.repo import RunRecord, Store

__all__ = ["RunRecord", "Store"]


def __getattr__(name: str) -> Any:
    # imported on first use, so `fpbench --help` (which imports fpbench.store.cli_db) stays fast
    if name in __all__:
        from fpbench.store import repo

        return getattr(repo, name)
    raise AttributeError(f"module 'fpbench.store' has no attribute {name!r}")
